"""BitNet W2A8: packing, quantization, reference, kernel data flow (CPU), compiles, GPU.

CPU tests check the format against two independent computations of microsoft/BitNet's
bytes (the closed form and the four-step pipeline of ``gpu/pack_weight.py`` as
documented), the quantization rules, the reference maths, and emulate in torch exactly
the per-lane data flow of each kernel (which words and activation bytes a lane loads,
how it decodes them, what the MMA instructions compute) so that the index arithmetic the
kernels use is proven on the CPU.  Compile tests build every kernel for sm_80 / sm_90a /
sm_100a without a GPU and check the PTX.  ``gpu`` tests compare the kernels with the
reference on the device.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import re
import warnings

import pytest
import torch

from bitdecode import backend as backends
from bitdecode import bitnet as bn
from bitdecode import jit
from bitdecode.layouts import bitnet as L

import ptxas
from kernel_builds import fresh_jit

MODEL_SHAPES = list(bn.MODEL_SHAPES)
# plus: a padded last batch at both unroll depths, long K (several batches), many stripes
ODD_SHAPES = [(16, 128), (4096 + 16, 2560), (48, 384), (1040, 1152), (272, 40960), (16 * 17000, 128)]


def ternary(n, k, gen, device="cpu"):
    return torch.randint(-1, 2, (n, k), generator=gen, dtype=torch.int8).to(device)


def int8_acts(m, k, gen, device="cpu"):
    return torch.randint(-128, 128, (m, k), generator=gen, dtype=torch.int8).to(device)


# --------------------------------------------------------------------------------------
# Independent computations of the packed bytes
# --------------------------------------------------------------------------------------


def pack_closed_form(w: torch.Tensor) -> torch.Tensor:
    """ANCHORS: weight (n, k) sits in the word at byte ``((n>>4)*(K/32) + (k>>5))*128 + 4t``,
    ``t = 16*((n&15)>>3) + 8*((k&31)>>4) + (n&7)``, element ``e = k&15`` at bit
    ``8*(e&3) + 2*(e>>2)``, code ``w + 2``."""
    n_, k_ = w.shape
    n = torch.arange(n_).view(-1, 1).expand(n_, k_)
    k = torch.arange(k_).view(1, -1).expand(n_, k_)
    t = 16 * ((n & 15) >> 3) + 8 * ((k & 31) >> 4) + (n & 7)
    e = k & 15
    word_byte = ((n >> 4) * (k_ // 32) + (k >> 5)) * 128 + 4 * t
    bit = 8 * (e & 3) + 2 * (e >> 2)
    byte = word_byte + bit // 8
    out = torch.zeros(n_ * k_ // 4, dtype=torch.int64)
    out.index_add_(0, byte.flatten(), ((w.long() + 2) << (bit % 8)).flatten())
    return out.to(torch.uint8).view(torch.int8).view(n_, k_ // 4)


def pack_bitnet_steps(w: torch.Tensor) -> torch.Tensor:
    """The documented BitNet pipeline, step by step: +2, 16x32 tile permutation,
    4 codes per byte (``byte |= c << 2j``), then the int32 re-interleave that moves the
    2-bit field ``o`` of each word to bit ``(o % 4) * 8 + (o // 4) * 2``."""
    n_, k_ = w.shape
    codes = (w.long() + 2).numpy()
    perm = torch.zeros(n_ // 16, k_ // 32, 16, 32, dtype=torch.int64).numpy()
    for i in range(16):
        for j in range(32):
            tid = i * 2 + j // 16
            row = (tid // 16) * 8 + tid % 8
            col = j % 16 + 16 * ((tid % 16) // 8)
            for nt in range(n_ // 16):
                perm[nt, :, i, j] = codes[nt * 16 + row, col::32][: k_ // 32]
    packed = torch.zeros(n_ // 16, k_ // 32, 16, 8, dtype=torch.int64).numpy()
    for j in range(8):
        for b in range(4):
            packed[..., j] |= perm[..., 4 * j + b] << (2 * b)
    words = torch.from_numpy(packed).reshape(-1, 4)
    words = words[:, 0] | (words[:, 1] << 8) | (words[:, 2] << 16) | (words[:, 3] << 24)
    out = torch.zeros_like(words)
    for o in range(16):
        out |= ((words >> (2 * o)) & 3) << ((o % 4) * 8 + (o // 4) * 2)
    out = torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)
    return out.view(torch.int8).view(n_, k_ // 4)


# --------------------------------------------------------------------------------------
# Format
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("n,k", [(16, 32), (32, 128), (48, 96), (64, 384)])
def test_pack_matches_closed_form_and_bitnet_steps(n, k, gen):
    w = ternary(n, k, gen)
    p = bn.pack_weight(w)
    assert p.shape == (n, k // 4) and p.dtype == torch.int8
    assert torch.equal(p, pack_closed_form(w))
    assert torch.equal(p, pack_bitnet_steps(w))


@pytest.mark.parametrize("n,k", [(16, 32), (80, 640), (256, 1024)])
def test_pack_unpack_round_trip(n, k, gen):
    w = ternary(n, k, gen)
    assert torch.equal(bn.unpack_weight(bn.pack_weight(w)), w)


def test_pack_extremes():
    """All -1 / all 0 / all 1 give the bytes of codes 1 / 2 / 3 in every field."""
    for value, byte in ((-1, 0x55), (0, 0xAA), (1, 0xFF)):
        p = bn.pack_weight(torch.full((16, 32), value, dtype=torch.int8))
        assert torch.equal(p.view(torch.uint8), torch.full((16, 8), byte, dtype=torch.uint8))


def test_tile_layout_is_the_closed_form():
    """The CuTe derivation (right_inverse + composition) gives the closed-form layout."""
    table = L.tile_bit_table()
    for r in range(16):
        for c in range(32):
            t = 16 * (r >> 3) + 8 * (c >> 4) + (r & 7)
            e = c & 15
            assert table[32 * r + c] == 32 * t + 8 * (e & 3) + 2 * (e >> 2)
    assert sorted(table) == list(range(0, 1024, 2))
    assert L.word_interleave_table() == tuple(8 * (e % 4) + 2 * (e // 4) for e in range(16))
    # BitNet's permutation: position 16*t + e holds tile row 8*(t//16) + t%8, col 16*((t//8)%2) + e
    perm = L.tile_permutation_table()
    for p in range(512):
        t, e = divmod(p, 16)
        assert perm[p] == 32 * (8 * (t // 16) + t % 8) + 16 * ((t // 8) % 2) + e


def test_thread_mappings_match_layouts():
    rows, halves = L.chunk_tables()
    assert rows == (0, 4, 0, 4, 8, 12, 8, 12) and halves == (0, 0, 1, 1, 0, 0, 1, 1)
    assert all(L.chunk_row(q) == rows[q] and L.chunk_khalf(q) == halves[q] for q in range(8))
    # the GEMV's lane masks: the row fold's keep a lane's rows, the x sum's reach every other
    # row chunk, and together they are the warp's five butterfly steps
    same, other = L.SAME_ROW_LANE_MASKS, L.OTHER_ROW_LANE_MASKS
    assert sorted(same + other) == [1, 2, 4, 8, 16]
    for lane in range(32):
        assert all(L.chunk_row((lane ^ m) % 8) == L.chunk_row(lane % 8) for m in same)
        reach = {lane ^ a ^ b for a in (0, other[0]) for b in (0, other[1])}
        assert sorted(L.chunk_row(r % 8) for r in reach) == [0, 4, 8, 12]
    table = L.mma_word_offset_table()
    for lane in range(32):
        g, tq = lane // 4, lane % 4
        for j in range(4):
            assert L.mma_word_offset(g, tq, j) == table[lane][j]
            # the word of (row g + 8*(j%2), chunk tq + 4*(j//2)), from the format itself
            row, chunk = g + 8 * (j % 2), tq + 4 * (j // 2)
            t = 16 * (row >> 3) + 8 * (chunk % 2) + (row & 7)
            assert table[lane][j] == 128 * (chunk // 2) + 4 * t


def test_int8_a_fragment_read_off_cute():
    """CuTe's wgmma int8 atom (warp 0 of the warpgroup) has exactly the m16n8k32 A
    fragment the kernels fill: register j = (row g + 8*(j%2), k 4*tq + 16*(j//2) + byte)."""
    frag = L.int8_a_fragment()
    for lane in range(32):
        g, tq = lane // 4, lane % 4
        for j in range(4):
            for byte in range(4):
                assert frag[lane][4 * j + byte] == (g + 8 * (j % 2), 4 * tq + 16 * (j // 2) + byte)


# --------------------------------------------------------------------------------------
# Quantization
# --------------------------------------------------------------------------------------


def test_quantize_weight_segments(gen):
    w = torch.randn(96, 64, generator=gen)
    w[:48] *= 3.0  # q rows much larger than k, v rows
    q, s = bn.quantize_weight(w, segments=(48, 16, 32))
    assert q.dtype == torch.int8 and set(q.unique().tolist()) <= {-1, 0, 1}
    assert s.dtype == torch.float32 and s.shape == (3,)
    for (a, b), scale in zip(((0, 48), (48, 64), (64, 96)), s):
        part = w[a:b]
        assert torch.equal(scale, part.abs().mean())
        assert torch.equal(q[a:b], torch.round(part / scale).clamp(-1, 1).to(torch.int8))
    q1, s1 = bn.quantize_weight(w)
    assert s1.shape == (1,) and torch.equal(s1[0], w.abs().mean())


def test_quantize_weight_rounds_half_to_even():
    # mean|W| = 1 exactly: 0.5 -> 0 (even), 1.5 -> 2 -> clamped to 1, -0.5 -> 0, -1.5 -> -1
    w = torch.tensor([[0.5, 1.5, -0.5, -1.5] * 8] * 16)
    q, s = bn.quantize_weight(w)
    assert s.tolist() == [1.0]
    assert q[0, :4].tolist() == [0, 1, 0, -1]


def test_quantize_weight_zero_and_errors():
    q, s = bn.quantize_weight(torch.zeros(16, 32))
    assert torch.equal(q, torch.zeros(16, 32, dtype=torch.int8)) and s.item() == pytest.approx(1e-5)
    with pytest.raises(ValueError, match="segments"):
        bn.quantize_weight(torch.zeros(32, 32), segments=(16, 8))
    with pytest.raises(ValueError, match=r"segments must hold positive ints, got \(32, 0\)"):
        bn.quantize_weight(torch.zeros(32, 32), segments=(32, 0))  # (an empty segment's scale was NaN)
    with pytest.raises(ValueError, match="at most"):
        bn.quantize_weight(torch.zeros(80, 32), segments=(16,) * 5)
    with pytest.raises(TypeError, match="segments"):
        bn.quantize_weight(torch.zeros(32, 32), segments=32)
    with pytest.raises(TypeError, match="w must have dtype"):
        bn.quantize_weight(torch.zeros(32, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="NaN"):
        bn.quantize_weight(torch.full((16, 32), float("nan")))
    with pytest.raises(ValueError, match=r"w must hold at least one weight, got shape \(0, 128\)"):
        bn.quantize_weight(torch.zeros(0, 128))


def test_quantize_activation_rules():
    x = torch.tensor([[127.0, 2.5, -2.5, 3.5, 0.5, -127.0, 1.0, 0.0]])
    q, s = bn.quantize_activation(x)
    assert s.tolist() == [1.0]
    assert q.tolist() == [[127, 2, -2, 4, 0, -127, 1, 0]]  # ties to even
    x = torch.randn(4, 3, 256) * 7
    q, s = bn.quantize_activation(x)
    assert q.shape == x.shape and q.dtype == torch.int8 and s.shape == (4, 3) and s.dtype == torch.float32
    ref = torch.round(x * (127.0 / x.abs().amax(-1, keepdim=True))).clamp(-128, 127)
    assert torch.equal(q, ref.to(torch.int8))
    assert torch.equal(q.abs().amax(-1), torch.full((4, 3), 127, dtype=torch.int8))
    qz, sz = bn.quantize_activation(torch.zeros(2, 64, dtype=torch.bfloat16))
    assert torch.equal(qz, torch.zeros(2, 64, dtype=torch.int8)) and torch.allclose(sz, torch.full((2,), 127e5))


# --------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------


def test_reference_is_int32_matmul_then_scaled(gen):
    m, n, k = 5, 96, 256
    x = int8_acts(m, k, gen)
    w = ternary(n, k, gen)
    wp = bn.pack_weight(w)
    exact = (x.long() @ w.long().t()).to(torch.int32)
    raw = bn.gemm(x, wp, torch.ones(m), torch.ones(1), out_dtype=torch.int32)
    assert raw.dtype == torch.int32 and torch.equal(raw, exact)
    assert torch.equal(bn.accumulate(x, w), exact)
    xs = torch.rand(m, generator=gen) * 3 + 0.5
    ws = torch.tensor([0.25, 2.0, 0.75])
    segs = (32, 16, 48)
    y = bn.gemm(x, wp, xs, ws, segs)
    rows = torch.cat([torch.full((c,), float(v)) for c, v in zip(segs, ws)])
    assert torch.equal(y, ((exact.float() / xs[:, None]) * rows[None, :]).to(torch.bfloat16))
    y1 = bn.gemv(x[:1], wp, xs[:1], ws, segs)
    assert torch.equal(y1, y[:1])


def test_reference_end_to_end_accuracy(gen):
    """W2A8 equals the float product with the dequantized ternary weights up to the int8
    activation rounding (half a step, max|x|/254, per element) and the bf16 output."""
    n, k = 64, 512
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(3, k, generator=gen)
    q, s = bn.quantize_activation(x)
    wq, ws = bn.quantize_weight(w)
    y = bn.gemm(q, bn.pack_weight(wq), s, ws).float()
    w_hat = wq.float() * ws
    ref = x @ w_hat.t()
    bound = (x.abs().amax(-1, keepdim=True) / 254) * w_hat.abs().sum(-1)[None, :] + ref.abs() * 2.0**-8
    assert bool(((y - ref).abs() <= bound).all())


def test_validation_errors(gen):
    x = int8_acts(1, 256, gen)
    wp = bn.pack_weight(ternary(32, 256, gen))
    xs, ws = torch.ones(1), torch.ones(1)
    with pytest.raises(TypeError, match="x must have dtype torch.int8"):
        bn.gemv(x.float(), wp, xs, ws)
    with pytest.raises(ValueError, match="gemv takes one token"):
        bn.gemv(int8_acts(2, 256, gen), wp, torch.ones(2), ws)
    with pytest.raises(ValueError, match="K must be a positive multiple of 128"):
        bn.gemv(int8_acts(1, 192, gen), bn.pack_weight(ternary(32, 192, gen)), xs, ws)
    with pytest.raises(ValueError, match=r"w_packed must have shape \(32, K/4\)"):
        bn.gemv(int8_acts(1, 128, gen), wp, xs, ws)
    with pytest.raises(ValueError, match="N must be a positive multiple of 16"):
        bn.gemv(x, torch.zeros(24, 64, dtype=torch.int8), xs, ws)
    with pytest.raises(ValueError, match="x_scale must have shape"):
        bn.gemv(x, wp, torch.ones(2), ws)
    with pytest.raises(TypeError, match="x_scale must have dtype torch.float32"):
        bn.gemv(x, wp, xs.half(), ws)
    with pytest.raises(ValueError, match="w_scales must have shape"):
        bn.gemv(x, wp, xs, ws, segments=(16, 16))
    with pytest.raises(ValueError, match="sum to"):
        bn.gemv(x, wp, xs, torch.ones(2), segments=(16, 8))
    with pytest.raises(ValueError, match="backend"):
        bn.gemv(x, wp, xs, ws, backend="fast")
    with pytest.raises(ValueError, match="runs on CUDA"):
        bn.gemv(x, wp, xs, ws, backend="kernel")
    with pytest.raises(ValueError, match="out_dtype"):
        bn.gemv(x, wp, xs, ws, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="kernel must be one of"):
        bn.gemm(x, wp, xs, ws, kernel="tcgen05")
    with pytest.raises(ValueError, match="share a device"):
        bn.gemv(x, wp, xs.to("meta"), ws)
    with pytest.raises(ValueError, match="ternary"):
        bn.pack_weight(torch.full((16, 32), 2, dtype=torch.int8))
    with pytest.raises(ValueError, match="multiple of 32"):
        bn.pack_weight(torch.zeros(16, 48, dtype=torch.int8))


def test_bitlinear_reference(gen):
    lin = torch.nn.Linear(256, 96, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(96, 256, generator=gen) * 0.05)
        lin.bias.copy_(torch.randn(96, generator=gen))
    layer = bn.BitLinear.from_float(lin, segments=(64, 32))
    assert layer.weight_packed.shape == (96, 64) and layer.weight_scale.shape == (2,)
    x = torch.randn(2, 3, 256, generator=gen, dtype=torch.float32)
    y = layer(x)
    assert y.shape == (2, 3, 96) and y.dtype == torch.float32
    q, s = bn.quantize_activation(x.reshape(-1, 256))
    wq, ws = bn.quantize_weight(lin.weight.detach(), (64, 32))
    ref = bn.gemm(q, bn.pack_weight(wq), s, ws, (64, 32)).float() + lin.bias.detach()
    assert torch.equal(y.reshape(-1, 96), ref)
    assert layer(x[:1, :1]).shape == (1, 1, 96)  # one token: the gemv path
    assert "segments=(64, 32)" in repr(layer)
    with pytest.raises(ValueError, match="256 features"):
        layer(torch.randn(3, 128))
    with pytest.raises(ValueError, match="256 features"):
        layer(torch.tensor(1.0))
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        layer([1.0] * 256)
    with pytest.raises(TypeError, match="bias must be a bool, got str"):
        bn.BitLinear(256, 96, bias="yes")
    # a model's .half() / .to(bf16) keeps the fp32 scales and bias as they were (the
    # kernels take fp32; a round trip through 16 bits would change them)
    scale, bias = layer.weight_scale.clone(), layer.bias.clone()
    for cast in (torch.nn.Module.half, lambda m: m.to(torch.bfloat16), lambda m: m.to("cpu", torch.float16)):
        cast(layer)
        assert torch.equal(layer.weight_scale, scale) and torch.equal(layer.bias, bias)
        assert "weight_scale" in dict(layer.named_buffers())
    fresh = bn.BitLinear.from_float(lin, segments=(64, 32))
    assert torch.equal(layer(x.half()), fresh(x.half()))


def test_torch_library_ops_have_fake_impls():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(1, 256, dtype=torch.int8, device="cuda" if torch.cuda.is_available() else "cpu")
        w = torch.empty(48, 64, dtype=torch.int8, device=x.device)
        y = torch.ops.bitdecode.bitnet_gemv(x, w, torch.empty(1, device=x.device), torch.empty(1, device=x.device), [48, 48, 48], False)
        assert y.shape == (1, 48) and y.dtype == torch.bfloat16
        x7 = torch.empty(7, 256, dtype=torch.int8, device=x.device)
        y = torch.ops.bitdecode.bitnet_gemm(x7, w, torch.empty(7, device=x.device), torch.empty(1, device=x.device), [48, 48, 48], "auto", True)
        assert y.shape == (7, 48) and y.dtype == torch.int32


# --------------------------------------------------------------------------------------
# Kernel data flow, emulated in torch (the index maths of each kernel, on the CPU)
# --------------------------------------------------------------------------------------


def _bytes(word: torch.Tensor, signed: bool) -> torch.Tensor:
    """int64 words -> [..., 4] bytes (least significant first)."""
    b = torch.stack([(word >> (8 * i)) & 0xFF for i in range(4)], dim=-1)
    return torch.where(b >= 128, b - 256, b) if signed else b


def dp4a_us(a, b):
    return (_bytes(a, False) * _bytes(b, True)).sum(-1)


def dp4a_ss(a, b):
    return (_bytes(a, True) * _bytes(b, True)).sum(-1)


def emulate_gemv(x: torch.Tensor, wp: torch.Tensor) -> torch.Tensor:
    """The GEMV kernel's arithmetic for every lane, group and stripe (int32 [N])."""
    n, kb = wp.shape
    k = kb * 4
    groups = k // L.GROUP_K
    words = (wp.contiguous().view(torch.int32).long() & 0xFFFFFFFF).reshape(n // 16, groups, 32, 4)
    x32 = x.reshape(-1).contiguous().view(torch.int32).long() & 0xFFFFFFFF  # [K/4]
    total = torch.zeros(n, dtype=torch.int64)
    for lane in range(32):
        q, tile = lane % 8, lane // 8
        xoff = torch.arange(groups) * L.GROUP_K + tile * 32 + L.chunk_khalf(q) * 16
        xv = torch.stack([x32[(xoff // 4) + i] for i in range(4)], dim=-1)  # [G, 4]
        xsum = sum(dp4a_ss(xv[:, i], torch.tensor(0x01010101)) for i in range(4)).sum()
        for r in range(4):
            w = words[:, :, lane, r]  # [N/16, G]
            acc = [dp4a_us(w & (L.DECODE_MASK << (2 * i)), xv[None, :, i]).sum(-1) for i in range(4)]
            row_val = acc[0] + (acc[1] >> 2) + (acc[2] >> 4) + (acc[3] >> 6) - L.CODE_OFFSET * xsum
            total[torch.arange(n // 16) * 16 + L.chunk_row(q) + r] += row_val
    return total.to(torch.int32)


def mma_m16n8k32(a_regs, b_regs):
    """PTX ``mma.m16n8k32`` (A u8 row-major 16x32, B s8 col-major 32x8) from per-lane
    fragments: ``a_regs[lane][j]``, ``b_regs[lane][h]`` (int64 words).  Returns D[16, 8]."""
    A = torch.zeros(16, 32, dtype=torch.int64)
    B = torch.zeros(32, 8, dtype=torch.int64)
    for lane in range(32):
        g, tq = lane // 4, lane % 4
        for j in range(4):
            A[g + 8 * (j % 2), 4 * tq + 16 * (j // 2) : 4 * tq + 16 * (j // 2) + 4] = _bytes(a_regs[lane][j], False)
        for h in range(2):
            B[4 * tq + 16 * h : 4 * tq + 16 * h + 4, g] = _bytes(b_regs[lane][h], True)
    return A @ B


def emulate_mma_gemm(x: torch.Tensor, wp: torch.Tensor) -> torch.Tensor:
    """The sm80 GEMM's lanes: words at ``mma_word_offset``, activations at ``mma_x_offset``,
    decode step i -> MMA i, then ``- 2 * sum(x)``.  int32 [M, N]."""
    m, k = x.shape
    n = wp.shape[0]
    mp = -(-m // 8) * 8
    xb = torch.zeros(mp, k, dtype=torch.int8)
    xb[:m] = x
    wbytes = wp.contiguous().view(torch.uint8).reshape(-1).long()
    xbytes = xb.view(torch.uint8).long()

    def word(buf, off):
        return buf[off] | (buf[off + 1] << 8) | (buf[off + 2] << 16) | (buf[off + 3] << 24)

    out = torch.zeros(mp, n, dtype=torch.int64)
    for tile in range(n // 16):
        for blk in range(mp // 8):
            d = torch.zeros(16, 8, dtype=torch.int64)
            for grp in range(k // L.GROUP_K):
                base = tile * 16 * (k // 4) + grp * L.GROUP_BYTES
                words = [[word(wbytes, base + L.mma_word_offset(l // 4, l % 4, j)) for j in range(4)] for l in range(32)]
                xrow = [xbytes[blk * 8 + l // 4, grp * L.GROUP_K :] for l in range(32)]
                for i in range(4):
                    a = [[(words[l][j] >> (2 * i)) & L.DECODE_MASK for j in range(4)] for l in range(32)]
                    b = [[word(xrow[l], L.mma_x_offset(l % 4, h) + 4 * i) for h in range(2)] for l in range(32)]
                    d += mma_m16n8k32(a, b)
            rowsum = xb[blk * 8 : blk * 8 + 8].long().sum(-1)
            out[blk * 8 : blk * 8 + 8, tile * 16 : tile * 16 + 16] = (d - L.CODE_OFFSET * rowsum[None, :]).t()
    return out[:m].to(torch.int32)


def emulate_wgmma_gemm(x: torch.Tensor, wp: torch.Tensor) -> torch.Tensor:
    """The sm90 GEMM's warps: per 32-column k-step the A register j of lane (g, tq) is
    the signed decode (``decode_signed_bytes``) of step ``tq`` of the word at
    ``kstep_word_offset(g, j)`` (weights in natural k order, activations read by wgmma
    from shared memory as they are, s8 x s8: no token-sum correction)."""
    m, k = x.shape
    n = wp.shape[0]
    wbytes = wp.contiguous().view(torch.uint8).reshape(-1).long()

    def word(off):
        return int(wbytes[off] | (wbytes[off + 1] << 8) | (wbytes[off + 2] << 16) | (wbytes[off + 3] << 24))

    out = torch.zeros(m, n, dtype=torch.int64)
    xl = x.long()
    for tile in range(n // 16):
        a_full = torch.zeros(16, k, dtype=torch.int64)
        for kt in range(k // 32):
            base = tile * 16 * (k // 4) + kt * L.TILE_BYTES
            for lane in range(32):
                g, tq = lane // 4, lane % 4
                for j in range(4):
                    reg = L.decode_signed_bytes(word(base + L.kstep_word_offset(g, j)), L.kstep_shift(tq))
                    col = kt * 32 + 4 * tq + 16 * (j // 2)
                    a_full[g + 8 * (j % 2), col : col + 4] = _bytes(torch.tensor(reg), True)
        out[:, tile * 16 : tile * 16 + 16] = xl @ a_full.t()
    return out.to(torch.int32)


def test_gemv_dataflow_emulated(gen):
    n, k = 48, 640
    x = int8_acts(1, k, gen)
    w = ternary(n, k, gen)
    assert torch.equal(emulate_gemv(x, bn.pack_weight(w)), bn.accumulate(x, w)[0])


def test_mma_gemm_dataflow_emulated(gen):
    m, n, k = 11, 32, 256
    x = int8_acts(m, k, gen)
    w = ternary(n, k, gen)
    assert torch.equal(emulate_mma_gemm(x, bn.pack_weight(w)), bn.accumulate(x, w))


def test_wgmma_gemm_dataflow_emulated(gen):
    m, n, k = 5, 32, 256
    x = int8_acts(m, k, gen)
    w = ternary(n, k, gen)
    assert torch.equal(emulate_wgmma_gemm(x, bn.pack_weight(w)), bn.accumulate(x, w))


def test_kernel_configs():
    from bitdecode.kernels_sm80 import bitnet_gemm as g80
    from bitdecode.kernels_sm80 import bitnet_gemv as v80
    from bitdecode.kernels_sm90 import bitnet_gemm as g90

    for k in (128, 2560, 3200, 6912, 10240, 40960):
        groups = k // 128
        for unroll in (4, 8):
            warps = v80.warps_for(k, unroll)
            assert 1 <= warps <= v80.MAX_WARPS
            iters = -(-groups // (warps * unroll))
            assert warps * unroll * iters >= groups  # every group has a warp
            assert (warps - 1) * unroll * iters < groups  # and every warp has a group
    for m in (1, 2, 16, 17, 64, 256, 1000):
        for n in (16, 2560, 20480):
            cfg = g80.config_for(m, n, 132)
            assert cfg.block_m >= min(m, 16) and cfg.max_threads <= 512
            gm, gn = g80.grid_for(cfg, m, n)
            assert gm * cfg.block_m >= m and gn * cfg.block_n >= n
            for k in (128, 2560, 6912, 10240, 40960):
                groups = k // 128
                wk = g80.split_for(cfg, m, n, k, 132)
                assert 1 <= wk <= min(cfg.max_wk, groups)
            cfg90 = g90.config_for(m, n, 132)
            assert cfg90.block_m >= min(m, 64) and cfg90.threads in (128, 256)
    # PDL up to PDL_MAX_M tokens (level to 4 % slower at M = 4096 on the H200)
    assert g90.pdl_plan(1) and g90.pdl_plan(g90.PDL_MAX_M) and not g90.pdl_plan(g90.PDL_MAX_M + 1)
    # a persistent grid only for one-CTA-an-SM tiles with more tiles than SMs, K of at most
    # PERSISTENT_MAX_GROUPS groups, and only where its own output staging fits
    assert g90.persistent_plan(g90.LARGE, 1024, 13824, 2560, 132) == 132  # 432 tiles
    assert g90.persistent_plan(g90.LARGE, 4096, 20480, 3200, 132) == 132
    assert g90.persistent_plan(g90.LARGE, 4096, 3200, 10240, 132) == 0  # 80 groups
    assert g90.persistent_plan(g90.LARGE, 1024, 2560, 2560, 132) == 0  # 80 tiles
    assert g90.persistent_plan(g90.MEDIUM, 4096, 20480, 3200, 132) == 0  # two CTAs an SM
    raw = dataclasses.replace(g90.LARGE, raw=True)  # int32 staging: 280 KB with the rings
    assert not raw.persistent_fits and g90.persistent_plan(raw, 4096, 20480, 3200, 132) == 0
    for cfg in (g90.SMALL, g90.MEDIUM, g90.LARGE, g90.MEDIUM_96, g90.LARGE_192):
        for m in (64, 256, 1024, 4096):
            for n, k in ((2560, 2560), (13824, 2560), (20480, 3200), (3200, 10240)):
                ctas = g90.persistent_plan(cfg, m, n, k, 132)
                if ctas:
                    dataclasses.replace(cfg, persistent=ctas)  # (its own checks: fits, no splits)
                    assert ctas == 132 < g90.tile_count(cfg, m, n)
    # split-K only where the last wave is partial: whole tiles first, at most the idle slots
    # of tail CTAs, at least MIN_SPLIT_GROUPS groups each
    for cfg in (g90.SMALL, g90.MEDIUM, g90.LARGE):
        slots = 132 * cfg.ctas_per_sm
        for m in (2, 64, 256, 1024, 4096):
            for n, k in ((2560, 2560), (4800, 3200), (3200, 10240), (20480, 3200), (16, 256)):
                gm, gn = g90.grid_for(cfg, m, n)
                full, splits, tail = g90.split_plan(cfg, m, n, k, 132)
                assert full + tail == gm * gn
                if splits > 1:
                    assert full % slots == 0 and 0 < tail < slots and tail * splits <= slots
                    assert splits <= cfg.max_splits and splits * g90.MIN_SPLIT_GROUPS <= k // 128
                    # the groups a split saves pay for it
                    assert (k // 128) * (1 - 1 / splits) >= cfg.split_cost_groups
                else:
                    assert tail == 0
    assert g90.split_plan(g90.LARGE, 1024, 4800, 3200, 132) == (132, 4, 20)  # 152 tiles: not two waves
    assert g90.split_plan(g90.LARGE, 4096, 4800, 3200, 132)[1] == 1  # 608 tiles: the last wave 61 % full
    assert g90.split_plan(g90.SMALL, 64, 2560, 6912, 132) == (0, 6, 40)  # 40 tiles for 264 slots, K long
    assert g90.split_plan(g90.SMALL, 64, 2560, 2560, 132)[1] == 1  # K too short to pay for a split
    # K split over a cluster only where the tiles leave half the CTA slots idle, every
    # tile's cluster in the slots, at most what the first CTA's ring holds the sums of
    for cfg in (g90.SMALL, g90.MEDIUM, g90.LARGE):
        for m in (2, 64, 256, 1024):
            for n, k in ((2560, 2560), (4800, 3200), (3200, 10240), (20480, 3200), (16, 256)):
                ck = g90.cluster_plan(cfg, m, n, k, 132)
                gm, gn = g90.grid_for(cfg, m, n)
                assert 1 <= ck <= min(g90.MAX_CLUSTER_K, cfg.max_cluster_k)
                assert ck == 1 or (gm * gn * ck <= 132 * cfg.ctas_per_sm and cfg.cluster_groups)
    assert g90.cluster_plan(g90.SMALL, 64, 2560, 2560, 132) == 2  # 40 tiles, 20 groups
    assert g90.cluster_plan(g90.SMALL, 64, 3200, 10240, 132) == 4
    assert g90.cluster_plan(g90.SMALL, 64, 13824, 2560, 132) == 1  # 216 tiles of 264 slots
    assert g90.cluster_plan(g90.LARGE, 1024, 2560, 2560, 132) == 1  # never on the large tile
    # from M = 1024 the large tile, unless the medium one needs fewer waves' time
    assert g90.config_for(1024, 4800, 132) == g90.MEDIUM  # 152 large tiles = 2 waves, 600 medium = 3
    for m, n in ((1024, 20480), (4096, 4800), (4096, 13824), (4096, 2560)):
        assert g90.config_for(m, n, 132) == g90.LARGE, (m, n)
    # three quarters of the tokens a tile where both grids have at most a CTA an SM
    assert g90.config_for(1024, 2560, 132) == g90.LARGE_192  # 80 large tiles or 120 of 192 tokens
    assert g90.config_for(1024, 3200, 132) == g90.LARGE  # 150 of 192 tokens: more than the SMs
    assert g90.config_for(256, 2560, 132) == g90.MEDIUM_96
    assert g90.config_for(256, 3840, 132) == g90.MEDIUM
    # two tiles on the busiest SM either way: 225 of 96 tokens beat 150 of 128 (H200: 13.25 -> 12.41 us)
    assert g90.config_for(256, 4800, 132) == g90.MEDIUM_96
    assert g90.config_for(256, 13824, 132) == g90.MEDIUM  # 5 x 96 rows against 4 x 128: too little gain
    assert g90.config_for(4096, 2560, 132) == g90.LARGE  # 4 x 192 = 3 x 256
    # the H200 sweep's picks: mma.sync up to 16 tokens, wgmma above 48, between by N and K
    pick = backends.get("sm90").bitnet.default_gemm_kernel
    assert [pick(m, 2560, 2560) for m in (1, 16, 17, 48, 49, 64, 256, 4096)] == ["mma"] * 4 + ["wgmma"] * 4
    assert [pick(m, 20480) for m in (16, 17, 64)] == ["mma", "wgmma", "wgmma"]
    assert [pick(m, n, k) for m, n, k in ((40, 2560, 2560), (40, 3200, 3200), (24, 3200, 10240),
                                          (24, 13824, 2560), (64, 2560, 2560))] == [
        "mma", "wgmma", "mma", "wgmma", "wgmma"]
    assert {backends.get(backends.for_arch(arch)).bitnet.default_gemm_kernel(4096, 20480)
            for arch in ("sm_80", "sm_100a")} == {"mma"}


def test_bitnet_kernels_come_from_the_backends():
    """``bitnet`` chooses its GEMV / GEMM through the arch's backend (``Backend.bitnet``), as
    decode does: sm80's kernels on sm_80 and (shared) on sm_100a, Hopper's stripe GEMV and
    wgmma GEMM only in the sm90 backend; each refuses what it cannot build, by name."""
    from bitdecode.kernels_sm80 import bitnet_gemv as v80
    from bitdecode.kernels_sm90 import bitnet_gemv as v90

    k80, k90, k100 = (backends.get(backends.for_arch(a)).bitnet for a in ("sm_80", "sm_90a", "sm_100a"))
    assert k100 is k80 and k90 is not k80
    assert (k80.gemm_kernels, k80.stripe_gemv) == (("mma",), False)
    assert (k90.gemm_kernels, k90.stripe_gemv) == (("mma", "wgmma"), True)
    assert k80.gemv_configs() == [v80.GemvConfig(unroll=4), v80.GemvConfig(unroll=8)]
    assert k90.gemv_configs()[:2] == k80.gemv_configs() and k90.gemv_configs()[-2:] == [v90.BULK, v90.BULK_X]
    assert k80.gemv_config(3200, 10240, 132) == v80.config_for(3200, 10240, 132)
    assert k90.gemv_config(3200, 10240, 132) == v90.config_for(3200, 10240, 132)
    # the stripe kernel: compiled per K on sm90, refused on the others
    assert k90.gemv_key(v90.BULK, 10240) == ("bulk", v90.BULK, 10240)
    assert k90.gemv_key(v80.SM80, 10240) == k80.gemv_key(v80.SM80, 2560) == (v80.SM80,)
    assert k90.gemv_launch_size(v90.BULK, 3200, 10240, 132) == v90.bulk_warps(10240)
    with pytest.raises(ValueError, match="sm_90a only"):
        k80.gemv_key(v90.BULK, 2560)
    with pytest.raises(ValueError, match="K=1048576 does not fit"):
        k90.gemv_key(v90.BULK, 1 << 20)
    # GEMM plans: mma.sync's split-K warps at launch, no workspace; wgmma's (full, splits)
    # and its split-K workspace
    cfg, extra, work = k90.gemm_plan("mma", 16, 2560, 2560, 132, raw=False, pdl=True)
    assert cfg.pdl and len(extra) == 1 and work is None
    assert k80.gemm_plan("mma", 16, 2560, 2560, 132, raw=True, pdl=False)[0].raw
    cfg, extra, work = k90.gemm_plan("wgmma", 64, 3200, 10240, 132, raw=False, pdl=True)
    assert (cfg.cluster_k, cfg.split_k, extra, work) == (4, False, (50, 1), (0, 0))  # K over 4 CTAs, no tail
    with pytest.raises(ValueError, match="kernel='wgmma' is not one of"):
        k80.gemm_plan("wgmma", 64, 2560, 2560, 132, raw=False, pdl=False)


# --------------------------------------------------------------------------------------
# Compile without a GPU, check the PTX
# --------------------------------------------------------------------------------------


def _ptx(compiled) -> str:
    return compiled.artifacts.PTX


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a", "sm_100a"])
def test_gemv_compiles(arch):
    from bitdecode.kernels_sm80 import bitnet_gemv as v80

    ptx = _ptx(v80.compile_gemv(v80.SM80, jit.compile_options(arch, keep_ptx=True)))
    assert ptx.count("lop3.b32") >= 16 and "dp4a.u32.s32" in ptx and "dp4a.s32.s32" in ptx
    assert "ld.global.nc.L1::no_allocate.v4.u32" in ptx and "shfl.sync.bfly" in ptx


def test_pdl_switch(monkeypatch):
    monkeypatch.delenv("BITDECODE_PDL", raising=False)
    assert bn.pdl_enabled()
    monkeypatch.setenv("BITDECODE_PDL", "0")
    assert not bn.pdl_enabled()
    monkeypatch.setenv("BITDECODE_PDL", "1")
    assert bn.pdl_enabled()


def test_pdl_off_keeps_every_gemv_config_buildable(monkeypatch):
    """BITDECODE_PDL=0 turns every configuration the sm90 host may pick into a plain launch:
    the scales placed after the PDL wait (``early_scales``, BULK_X's) go with it, where
    ``dataclasses.replace(cfg, pdl=False)`` alone raised."""
    from bitdecode.kernels_sm90 import bitnet_gemv as v90

    configs = list(v90.CANDIDATES) + [v90.BULK, v90.BULK_X]
    assert any(c.early_scales for c in configs)
    monkeypatch.setenv("BITDECODE_PDL", "0")
    for cfg in configs:
        off = bn._with_pdl(cfg, "sm_90a")
        assert not off.pdl and not off.early_scales
        assert dataclasses.replace(off, pdl=True, early_scales=cfg.early_scales) == cfg
    monkeypatch.setenv("BITDECODE_PDL", "1")
    assert all(bn._with_pdl(cfg, "sm_90a") == cfg for cfg in configs)
    assert not bn._with_pdl(v90.BULK_X, "sm_80").pdl


@pytest.mark.parametrize("unroll,pin", [(u, p) for p in (False, True) for u in (4, 5, 8, 10)])
def test_sm90_gemv_compiles(unroll, pin, tmp_path):
    from bitdecode.kernels_sm90 import bitnet_gemv as v90

    cfg = next(c for c in v90.CANDIDATES if c.unroll == unroll and c.pin == pin)
    ptx = _ptx(v90.compile_gemv(cfg, jit.compile_options("sm_90a", keep_ptx=True)))
    assert ptx.count("lop3.b32") >= 16 and "dp4a.u32.s32" in ptx and "ld.global.nc.L1::no_allocate.v4.u32" in ptx
    # programmatic dependent launch: weights loaded before the wait, x after it
    assert "griddepcontrol.launch_dependents" in ptx and "griddepcontrol.wait" in ptx
    wait = ptx.index("griddepcontrol.wait")
    assert ptx.index("ld.global.nc.L1::no_allocate.v4.u32") < wait
    assert "ld.global.nc.v4.u32" not in ptx[:wait]  # no activation load before the wait
    assert "prefetch.global.L2" in ptx[:wait]  # the CTA's weight stripe, fetched while the previous kernel drains
    # pinned: the branch on the loaded words (xor, setp) sits before the wait
    assert (ptx[:wait].count("xor.b32") >= 4 * unroll - 1) == pin
    # the occupancy model's register count is the one ptxas allocates, with no spills
    rep = ptxas.report(ptx, "sm_90a", tmp_path)
    assert f"Used {v90.REGISTERS[unroll, pin]} registers" in rep, rep[-2000:]
    assert ptxas.spill_bytes(rep) == 0


@pytest.mark.gpu  # (no GPU needed, but nvdisasm: the GPU hosts have it in Triton's wheel, CI has none)
@pytest.mark.parametrize("unroll,pin", [(u, p) for p in (False, True) for u in (4, 5, 8, 10)])
def test_sm90_gemv_pinned_loads_stay_above_the_wait_in_sass(unroll, pin, tmp_path):
    """ptxas keeps the first batch of weight loads above the PDL wait (ACQBULK) only if
    pinned: what ``pin`` is for, seen in the SASS."""
    from bitdecode.kernels_sm90 import bitnet_gemv as v90

    cfg = next(c for c in v90.CANDIDATES if c.unroll == unroll and c.pin == pin)
    ptxas.report(_ptx(v90.compile_gemv(cfg, jit.compile_options("sm_90a", keep_ptx=True))), "sm_90a", tmp_path)
    sass = ptxas.sass(tmp_path)
    if sass is None:
        pytest.skip("no nvdisasm on the PATH or in Triton's wheel")
    acq = sass.index("ACQBULK")
    assert (sass[:acq].count("LDG.E.NA.128.CONSTANT") == unroll) == pin


def test_gemm_early_scales_ptx(tmp_path):
    """``WgmmaConfig(early_scales=True)``, the default: the two rows' segment scales the
    epilogue applies are loaded into registers between the PDL wait and the first wgmma,
    where the late build loads them after its last wgmma; no spill.  (The GEMV's
    ``early_scales`` loads them into registers after the PDL wait:
    ``test_sm90_gemv_early_scales_ptx``; its first form, copied into shared memory by
    cp.async, measured slower and was dropped: profiles/probes/pinned/gemv_early_scales_*.patch.)"""
    from bitdecode.kernels_sm90 import bitnet_gemm as g90

    base = dataclasses.replace(g90.MEDIUM_96, pdl=True)
    late, early = (_ptx(g90.compile_gemm(dataclasses.replace(base, early_scales=on),
                                         jit.compile_options("sm_90a", keep_ptx=True))) for on in (False, True))
    scalar_loads = re.compile(r"ld\.global(\.nc)?\.(b32|f32|u32|s32)\s")
    assert len(scalar_loads.findall(late[late.rindex("wgmma.mma_async"):])) == 2
    assert not scalar_loads.findall(early[early.rindex("wgmma.mma_async"):])
    assert len(scalar_loads.findall(early[early.index("griddepcontrol.wait"):early.index("wgmma.mma_async")])) >= 2
    assert ptxas.spill_bytes(ptxas.report(early, "sm_90a", tmp_path)) == 0


@pytest.mark.parametrize("stage_x", [False, True])
@pytest.mark.parametrize("k", [2560, 3200, 6912, 10240, 40960])
def test_sm90_gemv_bulk_compiles(k, stage_x, tmp_path):
    """The stripe kernel: one bulk copy of the CTA's weights onto an mbarrier, issued before
    the wait for the previous kernel; the activations after it (by loads, or staged by a
    second bulk copy); the weights read from shared memory only; light on registers (so
    many CTAs fit an SM), no spills."""
    from bitdecode.kernels_sm90 import bitnet_gemv as v90
    from bitdecode.layouts.resources import ctas_per_sm

    cfg = v90.BULK_X if stage_x else v90.BULK
    ptx = _ptx(v90.compile_bulk(cfg, k, jit.compile_options("sm_90a", keep_ptx=True)))
    wait = ptx.index("griddepcontrol.wait")
    assert "griddepcontrol.launch_dependents" in ptx[:wait]
    bulk = "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
    assert ptx.count(bulk) == 1 + stage_x and ptx[:wait].count(bulk) == 1
    assert "mbarrier.try_wait" in ptx[wait:] and "ld.global.nc" not in ptx
    groups = k // L.GROUP_K
    per_warp = -(-groups // v90.bulk_warps(k))  # a warp's groups, unrolled
    if stage_x:  # no activation load from global: a shared load beside each weight load, the
        # loop rolled (two groups an iteration, and a remainder), x's sum once before it (one
        # vector's four dp4a in its loop), not in every lane of every group
        assert "ld.global.v4" not in ptx and 4 <= ptx.count("ld.shared.v4.b32") <= 9 < 2 * per_warp + 4
        assert ptx.count("dp4a.s32.s32") == 4 and ptx.count("dp4a.u32.s32") <= 48
    else:
        assert "ld.global.v4.u32" in ptx[wait:] and "ld.global.v4.u32" not in ptx[:wait]
        assert ptx.count("ld.shared.v4.b32") == per_warp
    assert ptx.count("lop3.b32") >= 16 and "dp4a.u32.s32" in ptx
    rep = ptxas.report(ptx, "sm_90a", tmp_path)
    # (bulk_registers: the count the host's residency rule, stripe_config, assumes)
    used = int(rep.split("Used ")[1].split(" registers")[0])
    assert ptxas.spill_bytes(rep) == 0 and used <= 64, rep[-1000:]
    # the CTAs an SM the rule counts on are resident at ptxas's count (staged, 37-40 against
    # the rule's 40: 42 at K = 10240 leaves shared memory the limit)
    assert ctas_per_sm(used, v90.bulk_warps(k)) >= v90.bulk_ctas_per_sm(k, stage_x), rep[-1000:]
    assert stage_x or used <= v90.bulk_registers(k)
    assert v90.bulk_fits(k, stage_x) and not v90.bulk_fits(65536, stage_x)
    # the scales the stores apply: the staged form (``early_scales``) loads x's and the row's
    # right after the wait, with side effects so that they stay there, none after the
    # reduction's barrier; the plain form loads them after it
    scalar = re.compile(r"ld\.global(\.nc)?\.(b32|f32|u32|s32)\s")
    last_bar = ptx.rindex("bar.sync")
    assert len(scalar.findall(ptx[wait:last_bar])) == (2 if stage_x else 0)
    assert len(scalar.findall(ptx[last_bar:])) == (0 if stage_x else 2)


@pytest.mark.parametrize("unroll,pin", [(4, False), (8, False), (10, False), (5, True), (8, True)])
def test_sm90_gemv_early_scales_ptx(unroll, pin, tmp_path):
    """``GemvConfig(early_scales=True)`` on the register kernel (off by default there): the
    storing threads' two scale loads sit between the PDL wait and the reduction's last
    barrier, none before the wait (x's scale is the previous kernel's) or after the barrier;
    no spill.  The default build loads them after the barrier."""
    from bitdecode.kernels_sm90 import bitnet_gemv as v90

    cfg = next(c for c in v90.CANDIDATES if c.unroll == unroll and c.pin == pin)
    scalar = re.compile(r"ld\.global(\.nc)?\.(b32|f32|u32|s32)\s")
    for early in (True, False):
        ptx = _ptx(v90.compile_gemv(dataclasses.replace(cfg, early_scales=early),
                                    jit.compile_options("sm_90a", keep_ptx=True)))
        wait, bar = ptx.index("griddepcontrol.wait"), ptx.rindex("bar.sync")
        assert not scalar.findall(ptx[:wait])
        assert len(scalar.findall(ptx[wait:bar])) == (2 if early else 0)
        assert len(scalar.findall(ptx[bar:])) == (0 if early else 2)
        if early:
            assert ptxas.spill_bytes(ptxas.report(ptx, "sm_90a", tmp_path)) == 0
    with pytest.raises(ValueError, match="pdl"):
        dataclasses.replace(cfg, pdl=False, pin=False, early_scales=True)


def test_sm90_gemv_config():
    from bitdecode.kernels_sm90 import bitnet_gemv as v90
    from bitdecode.layouts.resources import ctas_per_sm

    # H200 measurements (profiles/NOTES.md): the model picks the fastest or within 5 %
    def pick(n, k):
        cfg = v90.config_for(n, k, 132)
        return ("bulk_x" if cfg.stage_x else "bulk") if cfg.bulk else (cfg.unroll, cfg.pin)

    assert pick(2560, 2560) == (4, True)  # one wave either way: the most warps, no padding, pinned
    assert pick(2560, 6912) == (5, True)  # 11-warp CTAs, 2 an SM (unroll 4: 14 warps, 1 an SM, two waves)
    assert pick(3200, 3200) == (5, True)
    # 1.5 stripes an SM, but 40 KB stripes (LONG_STRIPE_BYTES: K = 8192): the stripe
    # kernel, x staged, at any count of them
    assert v90.LONG_STRIPE_BYTES == L.stripe_bytes(8192)
    assert pick(3200, 10240) == "bulk_x" and v90.stripe_config(2304, 8192, 132, 1) == v90.BULK
    # ... and at fewer than 4 stripes an SM from 36 KB of weights an SM (STRIPE_MIN_BYTES_PER_SM:
    # 24 KB stripes 1.5 an SM), whatever their length: H200, 6144 x 4096 (46.5 KB an SM) and
    # 5120 x 5120 (48.5) on BULK, 4096 x 4096 (31.0) and 2560 x 6912 (32.7) on the register
    # kernel; H100 4800 x 6912 3.9 against the register kernel's 6.3 us, 3200 x 6912 3.4
    # against 3.8
    assert v90.STRIPE_MIN_BYTES_PER_SM == 1.5 * L.stripe_bytes(6144)
    assert [v90.stripes_pay(n, k, 132) for n, k in ((6144, 4096), (5120, 5120), (4864, 4096), (2432, 8064),
                                                    (4096, 4096), (2560, 6912), (4736, 4096), (2048, 8064))] == [
        True] * 4 + [False] * 4
    assert pick(6144, 4096) == "bulk" and pick(5120, 5120) == "bulk" and pick(4096, 4096) == (4, True)
    assert pick(4800, 6912) == "bulk" and pick(3200, 6912) == "bulk" and pick(2560, 6912) == (5, True)
    assert v90.stripe_config(3168, 6144, 132, 1) == v90.BULK and v90.stripe_config(3152, 6144, 132, 1) is None
    assert v90.stripe_config(3200, 6016, 132, 1) is None and v90.stripe_config(4800, 3200, 132, 1) is None
    # ... plain where its slots hold the next GEMV's stripes too (3200 x 10240: 2 x 200 stripes
    # against 396 BULK slots, so x staged; 2560 x 10240 320, 3200 x 8192 400 of 528, 1600 x
    # 16384 200 of 264: BULK)
    assert v90.bulk_ctas_per_sm(10240) * 132 == 396 and v90.bulk_ctas_per_sm(8192) * 132 == 528
    assert [pick(n, k) for n, k in ((2560, 10240), (3200, 8192), (1600, 16384), (6400, 10240))] == [
        "bulk", "bulk", "bulk", "bulk_x"]
    # ... in one wave only (2 CTAs an SM at K = 20480: 264 slots)
    assert v90.stripe_config(264 * 16, 20480, 132, 2) == v90.BULK_X and v90.stripe_config(400 * 16, 20480, 132, 2) is None
    # the stripe kernel from 4 stripes an SM, all resident at once (stripe_config)
    for n, k in ((13824, 2560), (16384, 2560), (8448, 2560), (13824, 3200)):
        assert pick(n, k) == "bulk", (n, k)
    assert pick(3840, 2560) == (4, True) and pick(4800, 3200) == (5, True)  # 1.8 and 2.3 stripes an SM
    # 1280 stripes against 9 of 4-warp CTAs an SM (56 registers), 13824 x 6912 against 5 of 7 warps
    assert v90.bulk_ctas_per_sm(3200) == 9 and v90.bulk_ctas_per_sm(6912) == 5 and v90.bulk_ctas_per_sm(2560) == 12
    # past one wave of BULK: staged x where that holds all (20480 x 3200: 12 CTAs an SM, 1584
    # slots), else BULK where it takes fewer waves than the register kernel (2 against 3)
    assert pick(20480, 3200) == "bulk_x" and pick(8448, 10240) == "bulk_x" and pick(13824, 6912) == "bulk"
    # the first form whose wave leaves a quarter of its slots free (BULK at 13824 x 3200: 864 of
    # 1188, 27 %; BULK at 16896 x 3200: 1056 of 1188, 11 %, so BULK_X: 1056 of 1584), else the
    # first in one wave (BULK_X at 8448 x 10240: one full wave of 528)
    assert v90.bulk_ctas_per_sm(3200, True) == 12 and v90.stripe_waves(v90.BULK, 20480, 3200, 132) == 2
    assert pick(16896, 3200) == "bulk_x" and pick(13824, 3200) == "bulk" and v90.bulk_ctas_per_sm(10240, True) == 4
    assert pick(8448, 6912) == "bulk_x" and pick(20480, 2560) == "bulk_x"  # 20 % and 19 % free
    assert v90.stripe_config(20480, 3200, 132, 2) == v90.BULK_X and v90.stripe_config(26400, 3200, 132, 2) is None
    assert v90.stripe_config(20480, 3200, 107, 2) == v90.BULK_X  # 1284 slots, nearly full: still one wave
    assert v90.stripe_waves(v90.BULK, 1 << 16, 1 << 16, 132) == 0  # a stripe past a CTA's shared memory
    assert v90.stripe_config(1 << 16, 1 << 16, 132, 9) is None
    with pytest.raises(ValueError, match="stage_x"):
        v90.GemvConfig(stage_x=True)
    assert ctas_per_sm(72, 4) == 7 and ctas_per_sm(88, 3) == 6 and ctas_per_sm(72, 16) == 1
    for n, k in ((16, 128), (16, 40960), (1 << 20, 128)):
        cfg = v90.config_for(n, k, 132)
        assert cfg.pdl and v90.warps_for(k, cfg.unroll) <= v90.MAX_WARPS


def test_mma_gemm_pdl_compiles(tmp_path):
    from bitdecode.kernels_sm80 import bitnet_gemm as g80

    for cfg in (g80.STREAM, g80.TILED):
        ptx = _ptx(g80.compile_gemm(dataclasses.replace(cfg, pdl=True), jit.compile_options("sm_90a", keep_ptx=True)))
        wait = ptx.index("griddepcontrol.wait")
        assert "griddepcontrol.launch_dependents" in ptx
        assert ptx.index("ld.global.nc.L1::no_allocate") < wait  # weights stream before the wait
        assert "prefetch.global.L2" in ptx[:wait]  # and the CTA's rows are asked of L2 before it
        assert "ld.global.nc.v4.u32" not in ptx[:wait]  # activations only after it
        # the occupancy model (split_for) assumes at most cfg.registers per thread
        rep = ptxas.report(ptx, "sm_90a", tmp_path)
        assert ptxas.spill_bytes(rep) == 0
        used = int(re.search(r"Used (\d+) registers", rep).group(1))
        assert used <= cfg.registers, (used, cfg)


def test_wgmma_gemm_refuses_ctas_that_cannot_co_reside():
    """A tile whose ``ctas_per_sm`` CTAs do not fit one SM's shared memory is refused at
    compile time (its registers would be split for CTAs that never run side by side), but
    for a persistent grid; the shipped tiles and the three-an-SM 64-token tile fit."""
    from bitdecode.kernels_sm90 import bitnet_gemm as g90

    for cfg in (g90.SMALL, g90.MEDIUM, g90.LARGE, g90.MEDIUM_96, g90.LARGE_192,
                dataclasses.replace(g90.SMALL, ctas_per_sm=3, stages=7)):
        assert cfg.resident, cfg
    crowded = dataclasses.replace(g90.SMALL, ctas_per_sm=3)  # 8 stages: 3 x 83 KB
    assert not crowded.resident
    with pytest.raises(ValueError, match="3 CTAs an SM do not fit"):
        g90.compile_gemm(crowded, jit.compile_options("sm_90a"))
    # a persistent grid sizes itself (``test_gpu_wgmma_gemm_every_tile`` runs three CTAs of
    # the two-an-SM tiles, whose persistent staging does not fit twice)
    walk = dataclasses.replace(g90.MEDIUM, persistent=3)
    assert not walk.resident
    g90.compile_gemm(walk, jit.compile_options("sm_90a"))


def test_wgmma_gemm_compiles(tmp_path):
    """s8 x s8 wgmma with the A operand from registers, fed by a TMA + bulk-copy mbarrier
    ring (warp-specialized: setmaxnreg), one wgmma group in flight, no CTA-wide barrier in
    the main loop; no wgmma serialization by ptxas (C7513 / C7514), no spills, for the
    shipped tiles and the largest ring."""
    from bitdecode.kernels_sm90 import bitnet_gemm as g90

    split = [dataclasses.replace(cfg, split_k=True) for cfg in (g90.SMALL, g90.LARGE)]
    # (PDL as the host launches M <= 1024: the cluster splits and the 96-token tile)
    cluster = [dataclasses.replace(cfg, cluster_k=3, pdl=True) for cfg in (g90.SMALL, g90.MEDIUM)]
    for cfg in (g90.SMALL, g90.MEDIUM, g90.LARGE, dataclasses.replace(g90.MEDIUM_96, pdl=True),
                dataclasses.replace(g90.LARGE_192, persistent=132),
                g90.WgmmaConfig(block_m=256, warpgroups=2, stages=5),
                dataclasses.replace(g90.SMALL, ctas_per_sm=3, stages=7, pdl=True), *split, *cluster):
        ptx = _ptx(g90.compile_gemm(cfg, jit.compile_options("sm_90a", keep_ptx=True)))
        assert "wgmma.mma_async.sync.aligned" in ptx and ".s32.s8.s8" in ptx
        assert re.search(r"wgmma.wait_group.sync.aligned\s+1;", ptx), "one wgmma group kept in flight"
        for instr in ("cp.async.bulk.tensor.2d.shared::cta.global", "cp.async.bulk.shared::cluster.global",
                      "mbarrier.try_wait.parity", "mbarrier.arrive.expect_tx", "st.global.v4.b32"):
            assert instr in ptx, (instr, cfg)
        assert re.search(rf"setmaxnreg.dec.sync.aligned.u32\s+{g90.PRODUCER_REGS};", ptx)
        assert re.search(rf"setmaxnreg.inc.sync.aligned.u32\s+{cfg.consumer_regs};", ptx)
        assert "cp.async.cg" not in ptx and "cp.async.wait_group" not in ptx
        # PDL: every thread waits for the previous grid before the first copy of anything,
        # then lets the next grid launch
        assert ("griddepcontrol.wait" in ptx) == ("griddepcontrol.launch_dependents" in ptx) == cfg.pdl
        if cfg.pdl:
            assert ptx.index("griddepcontrol.wait") < ptx.index("griddepcontrol.launch_dependents")
            assert ptx.index("griddepcontrol.launch_dependents") < ptx.index("cp.async.bulk")
        # the epilogue: one reciprocal per token (no division per value), bf16 pairs through
        # stmatrix .trans into the [token, row] staging tile
        assert "div.rn.f32" not in ptx and "rcp.rn.f32" in ptx and "fma.rn.f32" in ptx
        assert "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in ptx
        # the split-K tail: partial sums stored 16 bytes at a time, an acq_rel arrival count,
        # the last split reads the others' through L2; none of it in the whole-tile variant
        for instr in ("atom.global.acq_rel.add", "fence.acq_rel.gpu", "ld.global.cg.v4.u32"):
            assert (instr in ptx) == cfg.split_k, (instr, cfg)
        # a cluster split: the other CTAs' sums reach the first one's shared memory through
        # st.async between two cluster barriers
        assert ("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32" in ptx) == (cfg.cluster_k > 1)
        assert len(re.findall(r"barrier.cluster.arrive;", ptx)) == (5 if cfg.cluster_k > 1 else 0)
        # the only CTA-wide barrier is the pipeline's init; the consumers' named barrier
        # comes after the main loop (twice more in a split-K tail CTA: the arrival count)
        assert len(re.findall(r"bar.sync\s+0;", ptx)) == 1
        bars = len(re.findall(rf"bar.sync\s+1, {cfg.threads};", ptx))
        assert bars == 2 + 2 * cfg.split_k + (cfg.cluster_k > 1), (bars, cfg)  # (the cluster sum's read)
        report = ptxas.report(ptx, "sm_90a", tmp_path)
        assert "C7513" not in report and "C7514" not in report, f"ptxas serializes the wgmmas ({cfg})"
        assert ptxas.spill_bytes(report) == 0, f"spills ({cfg})"
        # setmaxnreg.inc waits for registers the CTA's own pool holds: more would deadlock
        used = int(re.search(r"Used (\d+) registers", report).group(1))
        assert used <= cfg.entry_regs
        assert 128 * g90.PRODUCER_REGS + cfg.threads * cfg.consumer_regs <= cfg.entry_regs * cfg.block_threads


def _rn32(x):
    """A rational rounded to the nearest binary32 (ties to even; normal range)."""
    from fractions import Fraction

    if x == 0:
        return Fraction(0)
    sign, x = (-1 if x < 0 else 1), abs(x)
    e = x.numerator.bit_length() - x.denominator.bit_length()
    while Fraction(2) ** e > x:
        e -= 1
    while Fraction(2) ** (e + 1) <= x:
        e += 1
    q = x / Fraction(2) ** (e - 23)
    whole, rest = divmod(q.numerator, q.denominator)
    half = Fraction(rest, q.denominator)
    if half > Fraction(1, 2) or (half == Fraction(1, 2) and whole % 2):
        whole += 1
    return sign * whole * Fraction(2) ** (e - 23)


def test_scale_out_rcp_is_correctly_rounded():
    """``bitnet_ptx.scale_out_rcp``'s quotient, q0 = RN(a r), q = RN(q0 + RN(a - q0 b) r) with
    r = RN(1 / b), equals RN(a / b) (``div.rn``) for the GEMM's operands: integer sums up to
    2^22 over token scales 127 / absmax, absmax over nine decades, each step in exact
    rational arithmetic.  A plain RN(a r) differs from RN(a / b) on some of them."""
    from fractions import Fraction

    rng = random.Random(5)
    plain_differs = 0
    for _ in range(4000):
        a = Fraction(rng.randint(-(1 << 22), 1 << 22))
        b = Fraction(float(torch.tensor(127.0) / torch.tensor(10 ** rng.uniform(-5, 4))))
        r = _rn32(1 / b)
        q0 = _rn32(a * r)
        q = _rn32(q0 + _rn32(a - q0 * b) * r)
        assert q == _rn32(a / b), (a, b)
        plain_differs += q0 != q
    assert plain_differs > 0  # the correction step is needed


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a", "sm_100a"])
def test_act_quant_compiles(arch):
    """One kernel: 16-byte loads, round-to-nearest-even, int8 clamp and byte packing (built
    through the arch's backend, as ``bitnet.quantize_activation`` builds it)."""
    kernels = backends.get(backends.for_arch(arch)).bitnet
    for bf16 in (True, False):
        ptx = _ptx(kernels.compile_act_quant(bf16, bn.ACT_EPS, jit.compile_options(arch, keep_ptx=True)))
        for instr in ("ld.global.v4.u32", "cvt.rni.s32.f32", "mul.rn.f32", "rcp.rn.f32", "prmt.b32",
                      "st.global.v2.b32", "shfl.sync.bfly"):
            assert instr in ptx, f"{instr} missing ({arch}, bf16={bf16})"
        assert ".local" not in ptx


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a", "sm_100a"])
def test_norm_quant_compiles(arch):
    """RMSNorm + quantizer in one kernel: 16-byte loads and stores of the rows, the
    rsqrt torch's fp32 CUDA rsqrt compiles to, roundings to the 16-bit dtype, the
    quantizer's round-to-nearest-even and byte packing; no local memory."""
    from bitdecode.kernels_sm80 import act_quant

    kernels = backends.get(backends.for_arch(arch)).bitnet  # (as ``bitnet.rms_norm_quantize`` builds it)
    for bf16, gated in ((True, False), (False, False), (True, True)):
        ptx = _ptx(kernels.compile_norm_quant(bf16, bn.ACT_EPS, 1e-6, jit.compile_options(arch, keep_ptx=True),
                                              gated=gated))
        kind = "bf16x2" if bf16 else "f16x2"
        for instr in ("ld.global.v4.u32", "st.global.v4.b32", "rsqrt.approx.f32", f"cvt.rn.{kind}.f32",
                      "rcp.rn.f32", "cvt.rni.s32.f32", "st.global.v2.b32", "shfl.sync.bfly"):
            assert instr in ptx, f"{instr} missing ({arch}, bf16={bf16})"
        assert "rsqrt.approx.ftz" not in ptx and ".local" not in ptx
        assert ("max.NaN.f32" in ptx) == gated  # relu keeping NaN, as torch's
    # the norm alone (bd.bitnet.rms_norm): no quantizer pass
    ptx = _ptx(act_quant.compile_norm_quant(True, bn.ACT_EPS, 1e-5, jit.compile_options(arch, keep_ptx=True),
                                            False, False))
    assert "rsqrt.approx.f32" in ptx and "st.global.v4.b32" in ptx
    assert "cvt.rni.s32.f32" not in ptx and "st.global.v2.b32" not in ptx and ".local" not in ptx
    y_stores = ptx.count("st.global.v4.b32")
    # the residual sum's norm (bd.bitnet.add_rms_norm): the fp32 add, the sum stored beside y
    ptx = _ptx(act_quant.compile_norm_quant(True, bn.ACT_EPS, 1e-5, jit.compile_options(arch, keep_ptx=True),
                                            quantize=False, residual=True))
    assert "add.f32" in ptx and "rsqrt.approx.f32" in ptx and ".local" not in ptx
    assert ptx.count("st.global.v4.b32") == 2 * y_stores  # h in pass 1, y in pass 2


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_norm_prefetch_weight_ptx(arch):
    """``prefetch_weight``: the norm kernels ask L2 for their weight's lines before the wait
    for the previous kernel (sm_90a) / before pass 1 (sm_80), the late ones never; the
    maths untouched."""
    from bitdecode.kernels_sm80 import act_quant

    for gated, quantize, residual in ((False, True, False), (True, True, False), (False, False, True)):
        late, early = (_ptx(act_quant.compile_norm_quant(True, bn.ACT_EPS, 1e-5,
                                                         jit.compile_options(arch, keep_ptx=True), gated, quantize,
                                                         pdl=arch != "sm_80", residual=residual,
                                                         prefetch_weight=on)) for on in (False, True))
        assert "prefetch.global.L2" not in late and "prefetch.global.L2" in early
        first_load = early.index("ld.global")
        assert early.index("prefetch.global.L2") < first_load
        if arch != "sm_80":
            assert early.index("prefetch.global.L2") < early.index("griddepcontrol.wait")
        for instr in ("rsqrt.approx.f32", "mul.rn.f32", "st.global.v4.b32", "ld.global"):
            assert early.count(instr) == late.count(instr), (instr, gated, quantize, residual)


def test_act_quant_kernel_maths():
    """The kernel's op sequence (max |x|, rcp.rn, mul.rn by 127, mul.rn, round to nearest
    even, clamp), in fp32 torch ops one rounding each, equals quantize_activation: torch
    evaluates ``127.0 / t`` as ``t.reciprocal() * 127``, not as one correctly rounded
    division (which the kernel's first version used and the GPU test caught)."""
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(64, 1024, generator=gen) * torch.rand(64, 1, generator=gen) * 10).to(torch.bfloat16)
    x[0] = 0
    xf = x.float()
    amax = torch.maximum(xf.abs().amax(-1), torch.tensor(bn.ACT_EPS, dtype=torch.float32))
    s = torch.reciprocal(amax) * torch.tensor(127.0)
    q = torch.round(xf * s[:, None]).clamp(-128, 127).to(torch.int8)
    q_ref, s_ref = bn.quantize_activation(x)
    assert torch.equal(s, s_ref) and torch.equal(q, q_ref)
    assert not torch.equal(torch.tensor(127.0) / amax, s_ref)  # the one-division scale differs somewhere


def test_rms_norm_reference_and_errors():
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    w = (torch.rand(64) + 0.5).to(torch.bfloat16)
    assert torch.equal(bn.rms_norm(x, w, 1e-5), bn.rms_norm_quantize(x, w, 1e-5)[0])  # CPU: torch's ops
    with pytest.raises(ValueError, match="CUDA tensors"):
        bn.rms_norm(x, w, 1e-5, backend="kernel")
    with pytest.raises(ValueError, match="one dtype"):
        bn.rms_norm(x, w.half(), 1e-5, backend="kernel")
    with pytest.raises(ValueError, match="weight must have shape"):
        bn.rms_norm(x, w[:8], 1e-5)
    with pytest.raises(ValueError, match="backend"):
        bn.rms_norm(x, w, 1e-5, backend="fast")
    with pytest.raises(TypeError, match="gated must be a bool, got str"):
        bn.rms_norm_quantize(x, w, 1e-5, gated="yes")


def test_add_rms_norm_reference_and_errors():
    """The residual sum and its norm: torch's add and ``rms_norm`` of it on the CPU; a
    residual of another shape or dtype is refused by name."""
    gen = torch.Generator().manual_seed(3)
    x, r = (torch.randn(2, 3, 64, generator=gen).to(torch.bfloat16) for _ in range(2))
    w = (torch.rand(64, generator=gen) + 0.5).to(torch.bfloat16)
    h, y = bn.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(h, r + x) and torch.equal(y, bn.rms_norm(r + x, w, 1e-5))
    with pytest.raises(ValueError, match="residual"):
        bn.add_rms_norm(x, r[:1], w, 1e-5)
    with pytest.raises(TypeError, match="residual must have dtype"):
        bn.add_rms_norm(x, r.half(), w, 1e-5)
    with pytest.raises(ValueError, match="CUDA tensors"):
        bn.add_rms_norm(x, r, w, 1e-5, backend="kernel")


def test_norm_kernel_glue_shapes(monkeypatch):
    """The host side of the norm kernels (rows flattened and aligned, outputs reshaped,
    no rows, the norm-only variant's zero-size q / s), with the launch replaced by the
    torch maths: the GPU path's shapes are checked on the CPU too."""
    launched = []

    def fake_launch(x2, w, eps, gated, quantize=True):
        launched.append((tuple(x2.shape), quantize))
        y = bn._rms_norm(bn._relu2_times_up(x2) if gated else x2, w, eps)
        q, s = bn.quantize_activation(y)
        return (y, q, s) if quantize else (y, q[:0, :0], s[:0])

    monkeypatch.setattr(bn, "_use_kernel", lambda *a: True)
    monkeypatch.setattr(bn, "_norm_quant_launch", fake_launch)
    x = torch.randn(2, 3, 128, dtype=torch.bfloat16)
    w = (torch.rand(64) + 0.5).to(torch.bfloat16)
    y, q, s = bn.rms_norm_quantize(x, w, 1e-6, gated=True, backend="kernel")
    assert y.shape == q.shape == (2, 3, 64) and s.shape == (2, 3) and launched[-1] == ((6, 128), True)
    assert torch.equal(y, bn.rms_norm_quantize(x, w, 1e-6, gated=True)[0])
    y = bn.rms_norm(x[..., :64], w, 1e-6, backend="kernel")
    assert y.shape == (2, 3, 64) and launched[-1] == ((6, 64), False)
    y, q, s = bn.rms_norm_quantize(x[:0, :, :64], w, 1e-6, backend="kernel")  # no rows: no launch
    assert y.shape == q.shape == (0, 3, 64) and s.shape == (0, 3) and s.dtype == torch.float32 and len(launched) == 2
    assert bn.rms_norm(x[:0, :, :64], w, 1e-6, backend="kernel").shape == (0, 3, 64)


def test_act_quant_backend_errors():
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA tensors"):
        bn.quantize_activation(x, backend="kernel")
    with pytest.raises(ValueError, match="K % 8"):
        bn.quantize_activation(torch.randn(2, 12, dtype=torch.bfloat16), backend="kernel")
    with pytest.raises(ValueError, match="backend"):
        bn.quantize_activation(x, backend="fast")
    q, s = bn.quantize_activation(x, backend="auto")  # on the CPU: the torch ops
    q2, s2 = bn.quantize_activation(x)
    assert torch.equal(q, q2) and torch.equal(s, s2)


def test_signed_decode_bytes():
    """decode_signed_bytes (the kernel's shift / lop3 / sub / xor) maps codes 1, 2, 3 to
    the bytes of -1, 0, 1 in every byte at every shift."""
    for codes in itertools.product((1, 2, 3), repeat=4):
        for shift in (0, 2, 4, 6):
            word = sum(c << (8 * b + shift) for b, c in enumerate(codes))
            got = L.decode_signed_bytes(word, shift)
            assert [((got >> (8 * b)) & 0xFF) for b in range(4)] == [(c - 2) & 0xFF for c in codes]


# --------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
_WEIGHTS = {}


def _weights(n, k):
    """Random ternary weights, packed, per shape (cached across the GPU tests)."""
    if (n, k) not in _WEIGHTS:
        gen = torch.Generator(device="cuda").manual_seed(n * 7 + k)
        w = torch.randint(-1, 2, (n, k), generator=gen, device="cuda", dtype=torch.int8)
        _WEIGHTS.clear()
        _WEIGHTS[(n, k)] = (w, bn.pack_weight(w))
    return _WEIGHTS[(n, k)]


def _acts(m, k, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=gen, device="cuda") * 3
    return bn.quantize_activation(x)


def _check_chain(step, want_first, want, label):
    """``step()`` -> (first, second), two launches the second of which reads the first's
    output: exact eager, then replayed in a CUDA graph with both outputs poisoned before each
    replay (a read before the first kernel completes, or an early write, shows)."""
    first, second = step()
    assert torch.equal(first, want_first) and torch.equal(second, want), label
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        first, second = step()
    for _ in range(3):
        first.fill_(-7)
        second.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(first, want_first) and torch.equal(second, want), label


def _segments_for(n):
    if n % 48 == 0:  # three unequal parts: q gets half, k and v a quarter each
        return (n // 2, n // 4, n // 4)
    return (n - 16, 16) if n > 16 else None


def _check(y_kernel, y_ref, raw_kernel, raw_ref):
    assert torch.equal(raw_kernel, raw_ref), (raw_kernel - raw_ref).abs().max()
    assert y_kernel.dtype == torch.bfloat16 and y_kernel.shape == y_ref.shape
    diff = (y_kernel.float() - y_ref.float()).abs()
    # the same fp32 maths rounded once to bf16: at most one bf16 ulp apart
    ulp = torch.maximum(y_ref.float().abs(), torch.full_like(diff, 1e-30)) * 2.0**-7
    assert bool((diff <= ulp).all()), diff.max()


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("n,k", [(48, 384), (4096 + 16, 2560), (3200, 3200), (3200 + 16, 6912), (272, 40960)])
def test_gpu_gemv_every_config(n, k):
    """Each compiled GEMV configuration (not only the one the host picks for this shape):
    exact int32 sums, including padded last batches and several batches per warp."""
    w, wp = _weights(n, k)
    x, xs = _acts(1, k, n + k)
    ref = bn.accumulate(x, w)
    for cfg in bn.gemv_configs("cuda"):
        out = bn._gemv_launch(x, wp, xs, torch.ones(1, device="cuda"), [n, n, n], True, cfg)
        assert torch.equal(out, ref), (cfg, (out - ref).abs().max())


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("n,k", [(4096 + 16, 2560), (3200, 10240), (272, 40960)])
def test_gpu_gemv_early_scales(n, k):
    """The GEMVs that load their scales right after the PDL wait (``BULK_X``, and ``BULK``
    and two register kernels with ``early_scales``): bf16 outputs over three segments
    bit-equal to the plain register kernel's, which loads them at its end; and behind the
    activation quantizer's kernel, which writes x's scale, the scale read only once that
    kernel is done (``_check_chain``: eager, then graph replays with the scale and the output
    poisoned)."""
    from bitdecode.kernels_sm80 import bitnet_gemv as v80
    from bitdecode.kernels_sm90 import bitnet_gemv as v90

    if not v90.bulk_fits(k, True) or not bn.kernels_for("cuda").stripe_gemv:
        pytest.skip("the stripe kernels run on sm_90a")
    _, wp = _weights(n, k)
    ws = torch.tensor([0.5, 1.25, 3.0], device="cuda")
    seg = [n // 64 * 16, n // 32 * 16, n]
    src = (torch.randn(1, k, device="cuda") * 3).to(torch.bfloat16)
    x, xs = bn.quantize_activation(src, backend="kernel")
    want = bn._gemv_launch(x, wp, xs, ws, seg, False, v80.GemvConfig(unroll=4))
    register = [dataclasses.replace(c, early_scales=True) for c in v90.CANDIDATES if (c.unroll, c.pin) in
                ((8, False), (5, True))]
    for cfg in [v90.BULK_X, dataclasses.replace(v90.BULK, early_scales=True)] + register:
        assert cfg.early_scales
        assert torch.equal(bn._gemv_launch(x, wp, xs, ws, seg, False, cfg), want), cfg

        def step(cfg=cfg):
            xq, scale = bn.quantize_activation(src, backend="kernel")
            return scale, bn._gemv_launch(xq, wp, scale, ws, seg, False, cfg)

        _check_chain(step, xs, want, cfg)


@pytest.mark.gpu
@cuda
def test_gpu_gemv_reads_the_gemv_before():
    """Every GEMV configuration launched right after another GEMV reads that one's output
    (its int32 sums taken as int8 activations) only once it is complete (the PDL builds
    wait on the grid before, the staged-x stripe kernel copies x by the async proxy after
    that wait): eager, then replayed in a CUDA graph with both outputs poisoned; exact."""
    n1, n2 = 2560, 640
    w1, wp1 = _weights(n1, 2560)
    w2, wp2 = _weights(n2, 4 * n1)
    x, xs = _acts(1, 2560, 11)
    ones = torch.ones(1, device="cuda")
    want_first = bn.accumulate(x, w1)
    want = bn.accumulate(want_first.view(torch.int8), w2)
    for cfg in bn.gemv_configs("cuda"):
        def step(cfg=cfg):
            first = bn._gemv_launch(x, wp1, xs, ones, [n1] * 3, True, cfg)
            return first, bn._gemv_launch(first.view(torch.int8), wp2, xs, ones, [n2] * 3, True, cfg)

        _check_chain(step, want_first, want, cfg)


@pytest.mark.gpu
@cuda
def test_gpu_pdl_off(monkeypatch):
    """BITDECODE_PDL=0: plain launches, same exact results."""
    monkeypatch.setenv("BITDECODE_PDL", "0")
    # (the second shape takes a stripe kernel on Hopper, BULK_X with PDL on)
    for n, k in ((4096 + 16, 2560), (3200, 10240)):
        w, wp = _weights(n, k)
        assert not bn.gemv_config_for("cuda", n, k).pdl
        ws = torch.ones(1, device="cuda")
        for m in (1, 16):
            x, xs = _acts(m, k, n + m)
            fn = bn.gemv if m == 1 else bn.gemm
            assert torch.equal(fn(x, wp, xs, ws, out_dtype=torch.int32), bn.accumulate(x, w))
        x, xs = _acts(1, k, n)  # the bf16 output too: BULK_X scales it in its own epilogue
        _check(bn.gemv(x, wp, xs, ws), bn.reference_gemm(x, wp, xs, ws), bn.gemv(x, wp, xs, ws, out_dtype=torch.int32),
               bn.accumulate(x, w))


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("n,k", MODEL_SHAPES + ODD_SHAPES)
def test_gpu_gemv(n, k):
    w, wp = _weights(n, k)
    x, xs = _acts(1, k, n + k)
    segs = _segments_for(n)
    ws = torch.rand(len(segs or (n,)), device="cuda") + 0.5
    raw = bn.gemv(x, wp, xs, ws, segs, out_dtype=torch.int32)
    y = bn.gemv(x, wp, xs, ws, segs)
    _check(y, bn.reference_gemm(x, wp, xs, ws, segs), raw, bn.accumulate(x, w))


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("n,k", MODEL_SHAPES + ODD_SHAPES)
@pytest.mark.parametrize("kernel", ["mma", "wgmma"])
def test_gpu_gemm(n, k, kernel):
    if kernel == "wgmma" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("wgmma needs Hopper")
    w, wp = _weights(n, k)
    segs = _segments_for(n)
    ws = torch.rand(len(segs or (n,)), device="cuda") + 0.5
    # (M = 1024 and 4096: the 256-token tiles, the persistent grid where they outnumber
    # the SMs, with PDL at 1024)
    ms = (1, 2, 7, 16, 64, 100, 256) + ((1000, 1024, 4096) if (n, k) in MODEL_SHAPES else ())
    for m in ms:
        x, xs = _acts(m, k, n + k + m)
        raw = bn.gemm(x, wp, xs, ws, segs, kernel=kernel, out_dtype=torch.int32)
        y = bn.gemm(x, wp, xs, ws, segs, kernel=kernel)
        _check(y, bn.reference_gemm(x, wp, xs, ws, segs), raw, bn.accumulate(x, w))


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("block_m,warpgroups,stages,ctas", [(64, 1, 8, 2), (64, 2, 3, 2), (96, 1, 6, 2), (128, 1, 6, 2),
                                                          (128, 2, 5, 1), (192, 2, 4, 1), (256, 1, 4, 1), (256, 2, 4, 1),
                                                          (256, 2, 2, 1), (64, 1, 7, 3)])
def test_gpu_wgmma_gemm_every_tile(block_m, warpgroups, stages, ctas):
    """Every tile shape of the sm90 GEMM (the default picks only some per shape): ragged
    M and N tiles, an odd group count (the phantom group), exact sums and bf16 output,
    whole and split along K (split CTAs with fewer groups than stages included), and a
    persistent grid of three CTAs walking every tile (the ring's phases running on from
    tile to tile)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("wgmma needs Hopper")
    check_wgmma_tiles(block_m, warpgroups, stages, ctas, (True, False))


def check_wgmma_tiles(block_m, warpgroups, stages, ctas, raws, **fields):
    """``test_gpu_wgmma_gemm_every_tile``'s check of one tile shape (``fields``: more
    ``WgmmaConfig`` fields), its int32 (``raws`` True) and bf16 outputs."""
    from bitdecode.kernels_sm90 import bitnet_gemm as g90

    n, k = 4800 + 16, 3200  # 25 groups of 128 columns
    w, wp = _weights(n, k)
    ws = torch.tensor([0.7, 1.3], device="cuda")
    segs = (n - 16, 16)
    for raw in raws:
        cfg = g90.WgmmaConfig(block_m=block_m, warpgroups=warpgroups, stages=stages, raw=raw, ctas_per_sm=ctas,
                              **fields)
        fns = {split_k: g90.compile_gemm(dataclasses.replace(cfg, split_k=split_k), jit.compile_options("sm_90a"))
               for split_k in (False, True)}
        persistent = cfg.persistent_fits  # (not int32 256-token tiles)
        if persistent:
            fns["persistent"] = g90.compile_gemm(dataclasses.replace(cfg, persistent=3), jit.compile_options("sm_90a"))
        for m in (1, block_m - 3, block_m + 5, 3 * block_m):
            x, xs = _acts(m, k, m)
            tiles = g90.grid_for(cfg, m, n)[0] * g90.grid_for(cfg, m, n)[1]
            # whole tiles (both variants); every tile split in 3; the last one split in 7 (25
            # groups: 3 or 4 each)
            for split_k, full, splits in ((False, tiles, 1), (True, tiles, 1), (True, 0, 3), (True, tiles - 1, 7),
                                          ("persistent", tiles, 1)):
                if split_k == "persistent" and not persistent:
                    continue
                fn = fns[split_k]
                work = torch.full(((tiles - full) * splits * block_m * cfg.block_n + 4,), -5, dtype=torch.int32,
                                  device="cuda")
                count = torch.zeros(tiles - full + 1, dtype=torch.int32, device="cuda")
                out = torch.full((m, n), -7, dtype=torch.int32 if raw else torch.bfloat16, device="cuda")
                fn(x, wp, xs, ws, out, n - 16, n, n, work, count, full, splits)
                if raw:
                    assert torch.equal(out, bn.accumulate(x, w)), (cfg, m, full, splits)
                else:
                    _check(out, bn.reference_gemm(x, wp, xs, ws, segs), torch.zeros(1), torch.zeros(1))
                # the split CTAs leave the counts at zero, for the next launch
                assert not count.any(), (cfg, m, full, splits)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("block_m,warpgroups,stages,ctas", [(96, 1, 6, 2), (64, 1, 7, 3), (192, 2, 4, 1)])
def test_gpu_wgmma_gemm_late_scales(block_m, warpgroups, stages, ctas):
    """``WgmmaConfig(early_scales=False)``, the rows' segment scales loaded after the main
    loop (the default loads them before it): the bf16 outputs of whole, split and persistent
    tiles against the reference, as ``test_gpu_wgmma_gemm_every_tile`` checks the shipped
    kernel's."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("wgmma needs Hopper")
    check_wgmma_tiles(block_m, warpgroups, stages, ctas, (False,), early_scales=False)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("k", [2560, 3200, 128])
def test_gpu_wgmma_gemm_persistent_group_counts(k):
    """A persistent grid of three CTAs over many tiles at an even group count (20: the
    last group's stage is released after the main loop, or the ring runs dry on the next
    tile), an odd one (25: the phantom group) and one group; exact sums, and bf16 output
    through the LARGE tile (whose int32 staging does not fit beside its rings)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("wgmma needs Hopper")
    from bitdecode.kernels_sm90 import bitnet_gemm as g90

    n = 2560 + 16
    w, wp = _weights(n, k)
    ws = torch.ones(1, device="cuda")
    for cfg, raw in ((g90.MEDIUM_96, True), (g90.LARGE, False)):
        cfg = dataclasses.replace(cfg, raw=raw, persistent=3)
        fn = g90.compile_gemm(cfg, jit.compile_options("sm_90a"))
        m = 2 * cfg.block_m + 7
        x, xs = _acts(m, k, k)
        tiles = g90.tile_count(cfg, m, n)
        dummy = torch.zeros(4, dtype=torch.int32, device="cuda")
        out = torch.full((m, n), -7, dtype=torch.int32 if raw else torch.bfloat16, device="cuda")
        fn(x, wp, xs, ws, out, n, n, n, dummy, dummy, tiles, 1)
        if raw:
            assert torch.equal(out, bn.accumulate(x, w)), (cfg, k)
        else:
            _check(out, bn.reference_gemm(x, wp, xs, ws), torch.zeros(1), torch.zeros(1))


@pytest.mark.gpu
@cuda
def test_gpu_wgmma_gemm_reads_the_gemm_before():
    """PDL (M <= 1024): a wgmma GEMM launched right after another reads that one's output
    (its int32 sums taken as int8 bytes) only once it is complete, and the first one's
    output is not overwritten early: eager, then replayed in a CUDA graph; every value
    exact."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("wgmma needs Hopper")
    m, n, k = 256, 2560, 2560
    assert bn.gemm_kernel_for(m, "cuda", n, k) == "wgmma"
    w1, wp1 = _weights(n, k)
    w2, wp2 = _weights(640, 4 * n)  # x of the second: the first's [m, n] int32 as [m, 4n] int8
    x, xs = _acts(m, k, 5)
    ws = torch.ones(1, device="cuda")

    def step():
        first = bn.gemm(x, wp1, xs, ws, out_dtype=torch.int32)
        return first, bn.gemm(first.view(torch.int8), wp2, xs, ws, out_dtype=torch.int32)

    want_first = bn.accumulate(x, w1)
    _check_chain(step, want_first, bn.accumulate(want_first.view(torch.int8), w2), "wgmma")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("block_m,warpgroups,stages,ctas,cluster_k", [(64, 1, 8, 2, 2), (64, 1, 8, 2, 5), (128, 1, 6, 2, 3),
                                                                    (256, 2, 4, 1, 2)])
def test_gpu_wgmma_gemm_cluster_split(block_m, warpgroups, stages, ctas, cluster_k):
    """K split over the CTAs of a cluster, summed through distributed shared memory: exact
    sums and bf16 output with ragged M and N tiles, K runs of unequal group counts (25
    groups), and fewer groups than CTAs (one group: the others add zeros)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("wgmma needs Hopper")
    from bitdecode.kernels_sm90 import bitnet_gemm as g90

    ws = torch.tensor([0.7, 1.3], device="cuda")
    for raw in (True, False):
        cfg = g90.WgmmaConfig(block_m=block_m, warpgroups=warpgroups, stages=stages, raw=raw, ctas_per_sm=ctas,
                              cluster_k=cluster_k)
        fn = g90.compile_gemm(cfg, jit.compile_options("sm_90a"))
        for n, k in ((4800 + 16, 3200), (160, 128)):
            w, wp = _weights(n, k)
            segs = (n - 16, 16)
            for m in (1, block_m + 5, 3 * block_m):
                x, xs = _acts(m, k, m)
                tiles = g90.grid_for(cfg, m, n)[0] * g90.grid_for(cfg, m, n)[1]
                dummy = torch.zeros(4, dtype=torch.int32, device="cuda")
                out = torch.full((m, n), -7, dtype=torch.int32 if raw else torch.bfloat16, device="cuda")
                fn(x, wp, xs, ws, out, n - 16, n, n, dummy, dummy, tiles, 1)
                if raw:
                    assert torch.equal(out, bn.accumulate(x, w)), (cfg, m, n, k)
                else:
                    _check(out, bn.reference_gemm(x, wp, xs, ws, segs), torch.zeros(1), torch.zeros(1))


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_act_quant_bit_exact(dtype):
    """The quantizer kernel equals the torch ops bit for bit: model widths, a ragged K,
    rows of zeros (the eps floor), exact .5 ties after scaling, 3-D input, no rows."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    for m, k in ((1, 2560), (7, 6912), (300, 3200), (4096, 2560), (3, 8), (2, 1032)):
        x = (torch.randn(m, k, generator=gen, device="cuda") * 4).to(dtype)
        x[0, :] = 0
        if m > 2:  # max 127 -> scale 1: halves land on ties
            x[1] = torch.arange(k, device="cuda").remainder(255).sub(127).to(dtype) * 0.5
            x[1, 0] = 127
        q, s = bn.quantize_activation(x, backend="kernel")
        q_ref, s_ref = bn.quantize_activation(x)
        assert torch.equal(s, s_ref) and torch.equal(q, q_ref), (m, k)
    x3 = torch.randn(2, 5, 2560, device="cuda", dtype=dtype)
    q, s = bn.quantize_activation(x3, backend="kernel")
    q_ref, s_ref = bn.quantize_activation(x3)
    assert q.shape == (2, 5, 2560) and s.shape == (2, 5) and torch.equal(q, q_ref) and torch.equal(s, s_ref)
    q, s = bn.quantize_activation(torch.empty(0, 256, device="cuda", dtype=dtype), backend="auto")
    assert q.shape == (0, 256) and s.shape == (0,)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_add_rms_norm(dtype):
    """The residual sum and its norm in one kernel: the sum bit for bit torch's add, y the
    norm kernel's y of that sum (within two 16-bit ulps of torch's norm); 3-D input, a
    residual that cancels x (a zero row), no rows; in a CUDA graph replayed on new input."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    for shape in ((1, 4096), (8, 4096), (3, 5, 2560), (300, 8), (2, 1032)):
        x, r = ((torch.randn(*shape, generator=gen, device="cuda") * 3).to(dtype) for _ in range(2))
        r.view(-1, shape[-1])[0] = -x.view(-1, shape[-1])[0]
        w = (torch.rand(shape[-1], generator=gen, device="cuda") + 0.5).to(dtype)
        h, y = bn.add_rms_norm(x, r, w, 1e-5, backend="kernel")
        assert h.shape == y.shape == x.shape and torch.equal(h, r + x), shape
        assert torch.equal(y, bn.rms_norm(r + x, w, 1e-5, backend="kernel")), shape
        want = bn.rms_norm(r + x, w, 1e-5, backend="reference")
        ulps = (y.float() - want.float()).abs() / (torch.finfo(dtype).eps * want.float().abs()).clamp(min=1e-30)
        assert ulps.max().item() <= 2 and not y.view(-1, shape[-1])[0].any(), shape
    h, y = bn.add_rms_norm(*(torch.empty(0, 64, device="cuda", dtype=dtype) for _ in range(2)), w[:64], 1e-5)
    assert h.shape == y.shape == (0, 64)
    x, r = (torch.randn(2, 4096, device="cuda", dtype=dtype) for _ in range(2))
    w = torch.rand(4096, device="cuda", dtype=dtype) + 0.5
    bn.add_rms_norm(x, r, w, 1e-5)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        h, y = bn.add_rms_norm(x, r, w, 1e-5)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(h, r + x) and torch.equal(y, bn.rms_norm(r + x, w, 1e-5))


@pytest.mark.gpu
@cuda
def test_gpu_norm_prefetch_weight_is_bit_equal(monkeypatch):
    """``bitdecode.bitnet.NORM_PREFETCH`` (the norm kernels' weight asked of L2 before the
    wait): the same bits from rms_norm, add_rms_norm and rms_norm_quantize, widths whose
    weight is not a whole number of L2 lines included, and in a graph behind the kernel
    that writes their input."""
    gen = torch.Generator(device="cuda").manual_seed(6)
    cases = []
    for m, k in ((1, 4096), (8, 4096), (3, 1032), (2, 2560)):
        x, r = ((torch.randn(m, k, generator=gen, device="cuda") * 3).to(torch.bfloat16) for _ in range(2))
        w = (torch.rand(k, generator=gen, device="cuda") + 0.5).to(torch.bfloat16)
        cases.append((x, r, w))

    def run():
        return [(bn.rms_norm(x, w, 1e-5, backend="kernel"), *bn.add_rms_norm(x, r, w, 1e-5, backend="kernel"),
                 *bn.rms_norm_quantize(x, w, 1e-6, backend="kernel")) for x, r, w in cases]

    monkeypatch.setattr(bn, "NORM_PREFETCH", False)  # (the default is on: build without it first)
    fresh_jit(monkeypatch)
    want = run()
    monkeypatch.setattr(bn, "NORM_PREFETCH", True)
    fresh_jit(monkeypatch)
    for got_case, want_case in zip(run(), want):
        for got, w_ in zip(got_case, want_case):
            assert torch.equal(got, w_)
    x, r, w = cases[1]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = bn.rms_norm(x + r, w, 1e-5)
    r.add_(1.0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, bn.rms_norm(x + r, w, 1e-5, backend="kernel"))


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_norm_quant(dtype):
    """The RMSNorm + quantizer kernel: y within two 16-bit ulps of transformers' norm (equal
    on almost every element), q / s exactly the quantizer's of that y; zero rows, 3-D
    input, no rows; a BitLinear reading an RMSNormQuant output in a CUDA graph."""
    gen = torch.Generator(device="cuda").manual_seed(4)
    for m, k in ((1, 2560), (7, 6912), (300, 3200), (4096, 2560), (3, 8), (2, 1032)):
        x = (torch.randn(m, k, generator=gen, device="cuda") * 4).to(dtype)
        x[0, :] = 0
        w = (torch.rand(k, generator=gen, device="cuda") + 0.5).to(dtype)
        y, q, s = bn.rms_norm_quantize(x, w, 1e-6, backend="kernel")
        want = bn.rms_norm_quantize(x, w, 1e-6)[0]
        assert y.dtype == dtype and y.shape == (m, k)
        # a last-bit difference of the row's rsqrt flips the rounding of x * rsqrt to the
        # dtype, and the weight's product can carry that to two ulps of y
        ulps = (y.float() - want.float()).abs() / (torch.finfo(dtype).eps * want.float().abs()).clamp(min=1e-30)
        differ = (y != want).float().mean().item()
        assert ulps.max().item() <= 2 and differ <= 1e-2, (m, k, ulps.max().item(), differ)
        q_ref, s_ref = bn.quantize_activation(y)
        assert torch.equal(q, q_ref) and torch.equal(s, s_ref), (m, k)
        assert not y[0].any() and s[0].item() == pytest.approx(127 / bn.ACT_EPS, rel=1e-6)
        assert torch.equal(bn.rms_norm(x, w, 1e-6, backend="kernel"), y)  # the norm alone: the same y
    for m, k in ((1, 6912), (300, 6912), (5, 8)):  # gated: relu(gate)^2 * up, then the norm
        x = (torch.randn(m, 2 * k, generator=gen, device="cuda") * 2).to(dtype)
        x[0, :k] = -1  # a row of zero activations
        w = (torch.rand(k, generator=gen, device="cuda") + 0.5).to(dtype)
        y, q, s = bn.rms_norm_quantize(x, w, 1e-6, gated=True, backend="kernel")
        want = bn.rms_norm_quantize(x, w, 1e-6, gated=True)[0]
        ulps = (y.float() - want.float()).abs() / (torch.finfo(dtype).eps * want.float().abs()).clamp(min=1e-30)
        differ = (y != want).float().mean().item()
        assert y.shape == (m, k) and ulps.max().item() <= 2 and differ <= 1e-2, (m, k, ulps.max().item(), differ)
        assert torch.equal(q, bn.quantize_activation(y)[0]) and torch.equal(s, bn.quantize_activation(y)[1])
        assert not y[0].any()
    x3 = torch.randn(2, 5, 2560, device="cuda", dtype=dtype)
    w = torch.rand(2560, device="cuda", dtype=dtype)
    y, q, s = bn.rms_norm_quantize(x3, w, 1e-5, backend="auto")
    assert y.shape == q.shape == (2, 5, 2560) and s.shape == (2, 5)
    assert torch.equal(q, bn.quantize_activation(y)[0])
    y, q, s = bn.rms_norm_quantize(torch.empty(0, 256, device="cuda", dtype=dtype), w[:256], 1e-5, backend="auto")
    assert y.shape == q.shape == (0, 256) and s.shape == (0,)
    # norm -> BitLinear captured in a CUDA graph, replayed on new input
    norm = bn.RMSNormQuant(torch.nn.Parameter(w), 1e-5)
    lin = bn.BitLinear.from_float(torch.nn.Linear(2560, 3840, device="cuda", dtype=dtype))
    static_x = torch.randn(1, 2560, device="cuda", dtype=dtype)
    with torch.no_grad():
        for _ in range(2):
            lin(norm(static_x))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = lin(norm(static_x))
        for _ in range(3):
            static_x.copy_(torch.randn(1, 2560, device="cuda", dtype=dtype))
            graph.replay()
            y = norm(static_x)
            assert torch.equal(static_out, lin(y)) and torch.equal(static_out, lin(y.clone()))


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("m,n,k,cluster", [(256, 2560, 6912, False), (64, 2560, 6912, True)])
def test_gpu_split_k_gemm_in_a_cuda_graph(m, n, k, cluster):
    """A GEMM whose tiles are split along K through the workspace (M = 256, 2560 x 6912 on
    the wgmma kernel: 80 tiles over the idle slots) or over a cluster (M = 64) captured in
    a CUDA graph: the workspace split takes a workspace of its own from the graph's pool;
    replays on new input equal the exact sums and the eager bf16 output, and eager calls
    between replays do not disturb them."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the split-K GEMM is the Hopper wgmma kernel")
    from bitdecode.kernels_sm90 import bitnet_gemm as g90

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cfg = g90.config_for(m, n, sms)
    planned = g90.cluster_plan(cfg, m, n, k, sms) > 1 if cluster else (
        g90.cluster_plan(cfg, m, n, k, sms) == 1 and g90.split_plan(cfg, m, n, k, sms)[1] > 1)
    if bn.gemm_kernel_for(m, "cuda", n, k) != "wgmma" or not planned:
        pytest.skip("no such split at this shape on this GPU")
    w, wp = _weights(n, k)
    ws = torch.tensor([0.9], device="cuda")
    x, xs = _acts(m, k, 1)
    static_x, static_s = x.clone(), xs.clone()
    bn.gemm(static_x, wp, static_s, ws)  # compile outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        bn.gemm(static_x, wp, static_s, ws, out_dtype=torch.int32)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_raw = bn.gemm(static_x, wp, static_s, ws, out_dtype=torch.int32)
        static_y = bn.gemm(static_x, wp, static_s, ws)
    for seed in (2, 3, 4):
        x2, xs2 = _acts(m, k, seed)
        static_x.copy_(x2)
        static_s.copy_(xs2)
        graph.replay()
        eager = bn.gemm(x2, wp, xs2, ws)  # the eager workspace, between replays
        torch.cuda.synchronize()
        assert torch.equal(static_raw, bn.accumulate(x2, w)), seed
        assert torch.equal(static_y, eager), seed


@pytest.mark.gpu
@cuda
def test_gpu_bitlinear_end_to_end_and_cuda_graph():
    torch.manual_seed(0)
    lin = torch.nn.Linear(2560, 3840, bias=True, device="cuda", dtype=torch.bfloat16)
    layer = bn.BitLinear.from_float(lin, segments=(2560, 640, 640))
    ref_layer = bn.BitLinear.from_float(lin, segments=(2560, 640, 640), backend="reference")
    for shape in ((1, 2560), (3, 17, 2560), (64, 2560)):
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        y, y_ref = layer(x), ref_layer(x)
        assert y.shape == (*shape[:-1], 3840) and y.dtype == torch.bfloat16
        _check(y, y_ref, torch.zeros(1), torch.zeros(1))
    # CUDA graph: capture one decode step, replay on new inputs
    for shape in ((1, 2560), (16, 2560)):
        static_x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        layer(static_x)  # compile outside the capture
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            layer(static_x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = layer(static_x)
        for _ in range(3):
            static_x.copy_(torch.randn(shape, device="cuda", dtype=torch.bfloat16))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(static_y, layer(static_x))
        first = static_y.clone()
        graph.replay()
        assert torch.equal(static_y, first)


@pytest.mark.gpu
@cuda
def test_gpu_torch_compile_traces_the_ops():
    lin = torch.nn.Linear(512, 256, device="cuda", dtype=torch.bfloat16)
    layer = bn.BitLinear.from_float(lin)
    compiled = torch.compile(layer, backend="eager")
    for m in (1, 8):
        x = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            out = compiled(x)
        assert torch.equal(out, layer(x))
        # nothing of bitdecode's that Dynamo traces warns the user (an lru_cache did)
        assert not [str(w.message) for w in seen if "bitdecode" in str(w.filename) or "lru_cache" in str(w.message)]


def test_quantize_weight_takes_the_most_segments_and_refuses_an_infinite_eps():
    q, s = bn.quantize_weight(torch.randn(64, 32, generator=torch.Generator().manual_seed(0)), segments=(16,) * 4)
    assert q.shape == (64, 32) and s.shape == (4,)
    with pytest.raises(ValueError, match="eps must be a finite float >= 0, got inf"):
        bn.RMSNormQuant(torch.nn.Parameter(torch.ones(128)), float("inf"))
