"""The packed layout on hardware (issue: layouts): ldmatrix + lop3 dequant in a CuTe DSL
kernel gives exactly the torch reference's dequantized values, lane by lane, in the order
the MMA fragments consume them (sm80); and on sm90, dequantized tiles stored with stmatrix
into the swizzled wgmma operand layout are read by wgmma as exactly those values."""

from __future__ import annotations

import pytest
import torch

from bitdecode import jit, reference
from bitdecode.formats import KVFormat
from bitdecode.layouts import packing, sm80, sm90

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # pragma: no cover
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from bitdecode.kernels_sm80.dequant_probe import DequantProbe  # noqa: E402
from bitdecode.kernels_sm90.dequant_probe import DequantProbeSm90  # noqa: E402


def _bits16(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("length", [128, 256])
def test_ldmatrix_lop3_dequant_matches_reference(bits, dtype, length):
    import cutlass

    gen = torch.Generator().manual_seed(bits * 1000 + length)
    x = (torch.randn(32, length, generator=gen) * 3).to(dtype)
    codes, scale, zero = reference.quantize(x, bits, 32, dim=-1)
    expect = reference.dequantize(codes, scale, zero, 32, dim=-1)  # [32, length]
    packed = reference.pack_rows(codes, bits)  # [32, words] int32
    words_per_elem = reference.pack_params(scale, zero).repeat_interleave(32, dim=-1)
    order = torch.tensor(sm80.fragment_order(length))
    params = words_per_elem[:, order].contiguous()
    cute_dtype = {torch.float16: cutlass.Float16, torch.bfloat16: cutlass.BFloat16}[dtype]
    probe = DequantProbe.compile(jit.target_arch(), cute_dtype, bits, length)
    pairs = packing.codes_per_word(bits) // 2
    chunks = sm80.words_per_row(bits, length) // sm80.CHUNK_WORDS
    out = torch.empty(32, 4, chunks, pairs, dtype=torch.int32, device="cuda")
    probe(packed.cuda().view(torch.float16), params.cuda(), out)
    got = out.cpu().to(torch.int64) & 0xFFFFFFFF
    cols = sm80.word_elements(bits, length)
    ebits = _bits16(expect)
    want = torch.empty_like(got)
    for lane in range(32):
        for i in range(4):
            row = 8 * i + lane // 4
            for chunk in range(chunks):
                elems = cols[4 * chunk + lane % 4]
                for p in range(pairs):
                    lo, hi = ebits[row, elems[2 * p]], ebits[row, elems[2 * p + 1]]
                    want[lane, i, chunk, p] = lo | (hi << 16)
    assert torch.equal(got, want)


def _element_params(operand: str, fmt: KVFormat, params: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The cache's params as one (scale, zero) word per element of the probe's tile
    (``rows x cols``, each row in fragment order), what ``DequantProbeSm90`` reads."""
    g = fmt.group_size
    if operand == "v":  # [Nr/16, D/G, 16], tokens in fragment order -> [D, Nr]
        per_group = params.permute(1, 0, 2).reshape(rows // g, cols)
        return per_group.repeat_interleave(g, dim=0)
    if fmt.k_mode == "channel":  # [Nr/G, D], fragment order along D already
        return params.repeat_interleave(g, dim=0)
    order = torch.tensor(sm80.fragment_order(cols))  # token mode: [Nr, D/G]
    return params.repeat_interleave(g, dim=1)[:, order]


@pytest.mark.parametrize("head_dim", [128, 64])
@pytest.mark.parametrize("operand,k_mode", [("k", "channel"), ("k", "token"), ("v", "token")],
                         ids=["k-channel", "k-token", "v"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("bits", [4, 2])
def test_sm90_stmatrix_wgmma_operand_matches_reference(bits, dtype, operand, k_mode, head_dim):
    """ldmatrix -> lop3 -> stmatrix into the 128B-swizzled K-major tile -> wgmma (one-hot A):
    the accumulators equal the reference dequantized K (Nr x D) / V^T (D x Nr) tile, bit for bit."""
    import cutlass

    arch = jit.target_arch()
    if arch != sm90.TRACE_ARCH:
        pytest.skip(f"wgmma needs sm_90a, this GPU is {arch}")
    fmt = KVFormat(bits=bits, k_mode=k_mode, group_size=32)
    gen = torch.Generator().manual_seed(bits * 100 + head_dim + (operand == "v") + 2 * (k_mode == "token"))
    x = (torch.randn(fmt.residual_block, head_dim, generator=gen) * 3).to(dtype)
    if operand == "k":
        packed, params = reference.pack_k(x, fmt)
        expect = reference.unpack_k(packed, params, fmt, dtype)  # [Nr, D]
    else:
        v_pack, params = reference.pack_v(x, fmt)
        packed = v_pack[0]  # [D, Nr*bits/32]: rows are channels
        expect = reference.unpack_v(v_pack, params, fmt, dtype).T  # [D, Nr]
    rows, cols = sm90.tile_shape(bits, operand, head_dim)
    assert expect.shape == (rows, cols)
    per_elem = _element_params(operand, fmt, params, rows, cols).contiguous()
    cute_dtype = {torch.float16: cutlass.Float16, torch.bfloat16: cutlass.BFloat16}[dtype]
    probe = DequantProbeSm90.cached(arch, cute_dtype, bits, operand, head_dim)
    out = torch.full((rows, cols), float("nan"), dtype=torch.float32, device="cuda")
    probe(packed.contiguous().cuda().view(torch.float16), per_elem.cuda(), out)
    got = out.cpu()
    bad = (got != expect.float()).nonzero()
    assert bad.numel() == 0, f"{len(bad)} of {rows * cols} differ, first (row, col): {bad[:8].tolist()}"
    assert torch.equal(_bits16(got.to(dtype)), _bits16(expect))  # signs of zeros too
