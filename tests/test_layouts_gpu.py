"""The packed layout on hardware (issue: layouts): ldmatrix + lop3 dequant in a CuTe DSL
kernel gives exactly the torch reference's dequantized values, lane by lane, in the order
the MMA fragments consume them."""

from __future__ import annotations

import pytest
import torch

from bitdecode import jit, kernels, reference
from bitdecode.layouts import packing, sm80

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # pragma: no cover
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


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
    probe = kernels.compile_dequant_probe(jit.target_arch(), cute_dtype, bits, length)
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
