"""The torch reference: quantization properties, packing round trips, attention maths."""

import math

import pytest
import torch

from bitdecode import KVCache, KVFormat, reference
from bitdecode.layouts import sm80

import kvdata
from kvdata import DTYPES

# --------------------------------------------------------------------------------------
# Quantize / dequantize
# --------------------------------------------------------------------------------------


def error_bound(x, x_hat, scale, zero, bits, group_size, dim):
    """Per-element bound on |x - x_hat| for one quantize/dequantize round trip.

    With s the stored scale, s* = (max - min) / qmax the exact one, and zero = min exact
    (min is a 16-bit value):

    * an element whose code is not clamped is off by at most s/2: |x - zero - q s| <= s/2
      (plus the fp32 roundings of x - zero and of 1/s in the code, relative 2^-23 each);
    * the top code is clamped to qmax: x - zero - qmax s <= qmax (s* - s), and the scale
      is rounded toward zero, so 0 <= s* - s < ulp16(s) (plus the fp32 rounding of the
      range times fp32(1/qmax), relative 3 * 2^-24); with s = 0 (range below one 16-bit
      ulp times qmax) the whole range lies within qmax ulp16(0);
    * the dequantized value is rounded once to 16 bits: half an ulp of x_hat.

    So |x - x_hat| <= s/2 + qmax ulp16(s) + ulp16(x_hat)/2 + (max - min) 2^-20, the last
    term covering every fp32 rounding with room to spare.
    """
    dtype = x.dtype
    qmax = (1 << bits) - 1
    s = scale.double().repeat_interleave(group_size, dim=dim)
    xs = x.double().movedim(dim, -1)
    groups = xs.reshape(*xs.shape[:-1], -1, group_size)
    rng = (groups.amax(-1) - groups.amin(-1)).repeat_interleave(group_size, dim=-1).movedim(-1, dim)
    return s / 2 + qmax * kvdata.ulp(s, dtype) + kvdata.ulp(x_hat, dtype) / 2 + rng * 2.0**-20


def roundtrip(x, bits, g, dim):
    codes, scale, zero = reference.quantize(x, bits, g, dim=dim)
    return codes, scale, zero, reference.dequantize(codes, scale, zero, g, dim=dim)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("dim,g", [(-1, 32), (-1, 128), (0, 64)])
def test_quantize_error_within_bound(dtype, bits, dim, g, gen, device):
    # magnitudes from 1e-3 to 1e3 per row, so scales span many binades (fp16 subnormals too)
    mag = 10.0 ** torch.empty(64, 1).uniform_(-3, 3, generator=gen)
    x = (torch.randn(64, 256, generator=gen) * mag + torch.randn(64, 1, generator=gen) * mag)
    x = x.to(dtype).to(device)
    codes, scale, zero, x_hat = roundtrip(x, bits, g, dim)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= (1 << bits) - 1
    assert scale.dtype == zero.dtype == dtype
    err = (x.double() - x_hat.double()).abs()
    bound = error_bound(x, x_hat, scale, zero, bits, g, dim)
    assert bool((err <= bound).all()), f"worst excess {float((err - bound).max())}"
    # the bound is not vacuous: typical errors reach close to half a step
    s = scale.double().repeat_interleave(g, dim=dim)
    ratio = err[s > 0] / s[s > 0]
    assert float(ratio.max()) > 0.45


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [4, 2])
def test_scale_is_range_rounded_toward_zero(dtype, bits, gen, device):
    x = kvdata.randn(gen, 128, 64, dtype=dtype, device=device, std=50.0)
    _, scale, zero = reference.quantize(x, bits, 64)
    g = x.float().reshape(128, 1, 64)
    exact = (g.amax(-1) - g.amin(-1)) * reference.inv_qmax(bits)  # fp32, as the kernels
    assert torch.equal(zero, x.reshape(128, 1, 64).amin(-1))
    assert bool((scale.float() <= exact).all())
    above = (scale.view(torch.int16) + 1).view(dtype)  # next 16-bit value up
    assert bool((above.float() > exact).all())
    # so the top code never lands past the group max
    top = (scale.double() * ((1 << bits) - 1) + zero.double()).to(dtype)
    assert bool((top <= x.reshape(128, 1, 64).amax(-1)).all())


def test_round_half_to_even(device):
    # group [0, 15]: scale exactly 1, zero 0, so codes are rint(x)
    vals = [0.0, 15.0, 0.5, 1.5, 2.5, 3.5, 4.5, 13.5, 14.5, 7.25, 7.75]
    x = torch.tensor(vals + [1.0] * (32 - len(vals)), dtype=torch.float16, device=device)
    codes, scale, zero = reference.quantize(x[None], 4, 32)
    assert float(scale) == 1.0 and float(zero) == 0.0
    assert codes[0, : len(vals)].tolist() == [0, 15, 0, 2, 2, 4, 4, 14, 14, 7, 8]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [4, 2])
def test_constant_groups_scale_zero_exact(dtype, bits, device):
    consts = [0.0, -0.0, 1.5, -3.0e-5, 65504.0, -65504.0, 1e-7]
    x = torch.tensor(consts, dtype=torch.float64)[:, None].expand(-1, 32).to(dtype).to(device)
    x = torch.cat([x, torch.linspace(-1, 1, 32, dtype=dtype, device=device)[None]])
    codes, scale, zero, x_hat = roundtrip(x, bits, 32, -1)
    assert torch.equal(scale[:-1].float(), torch.zeros_like(scale[:-1].float()))
    assert scale[-1].item() > 0
    assert bool((codes[:-1] == 0).all())
    assert not bool(x_hat.isnan().any())
    assert torch.equal(x_hat[:-1], x[:-1])  # exact (-0.0 comes back as +0.0, an fma's sum)


@pytest.mark.parametrize("bits", [4, 2])
def test_fp16_extremes(bits, gen, device):
    big = 65504.0
    rows = [
        torch.tensor([-big, big]),                     # full fp16 range in one group
        torch.tensor([big, big - 32.0]),               # top of the range, tiny spread
        torch.tensor([-big, -big + 32.0]),
        torch.tensor([0.0, big]),
    ]
    fill = torch.rand(len(rows), 30, generator=gen)
    x = torch.stack([torch.cat([r, r.min() + (r.max() - r.min()) * f]) for r, f in zip(rows, fill)])
    x = x.to(torch.float16).to(device)
    codes, scale, zero, x_hat = roundtrip(x, bits, 32, -1)
    assert bool(x_hat.isfinite().all()), x_hat
    assert torch.equal(x_hat[:, 0][[0, 2]], x[:, 0][[0, 2]])  # the group min is exact
    err = (x.double() - x_hat.double()).abs()
    assert bool((err <= error_bound(x, x_hat, scale, zero, bits, 32, -1)).all())


def test_bf16_wide_range(gen, device):
    x = kvdata.randn(gen, 8, 64, dtype=torch.bfloat16, device=device, std=1e30)
    codes, scale, zero, x_hat = roundtrip(x, 4, 64, -1)
    assert bool(x_hat.isfinite().all())
    err = (x.double() - x_hat.double()).abs()
    assert bool((err <= error_bound(x, x_hat, scale, zero, 4, 64, -1)).all())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_rejects_non_finite(bad, dtype):
    x = torch.zeros(4, 64, dtype=dtype)
    x[2, 17] = bad
    with pytest.raises(ValueError, match="x contains NaN or Inf"):
        reference.quantize(x, 4, 32)
    # opted out (what the caches do): the group holding it packs as NaN, the others as before
    codes, scale, zero = reference.quantize(x, 4, 32, check_finite=False)
    clean_codes, clean_scale, clean_zero = reference.quantize(torch.zeros_like(x), 4, 32)
    nan = torch.tensor(float("nan"), dtype=dtype)
    assert scale[2, 0].view(torch.int16) == nan.view(torch.int16) and zero[2, 0].isnan()
    assert (codes[2, :32] == 0).all()
    keep = torch.ones_like(scale, dtype=torch.bool)
    keep[2, 0] = False
    assert torch.equal(scale[keep], clean_scale[keep]) and torch.equal(zero[keep], clean_zero[keep])
    assert torch.equal(codes[:, 32:], clean_codes[:, 32:]) and torch.equal(codes[:2], clean_codes[:2])
    assert reference.dequantize(codes, scale, zero, 32)[2, :32].isnan().all()


@pytest.mark.parametrize(
    "kwargs,exc,msg",
    [
        (dict(x=torch.zeros(2, 64)), TypeError, "x must have dtype torch.float16 or torch.bfloat16, got torch.float32"),
        (dict(x=[1.0] * 64), TypeError, "x must be a torch.Tensor, got list"),
        (dict(bits=3), ValueError, r"bits must be one of \(4, 2\), got 3"),
        (dict(group_size=0), ValueError, "group_size must be positive, got 0"),
        (dict(group_size=48), ValueError, "64 values along dim 1, not a multiple of group_size=48"),
    ],
)
def test_quantize_argument_errors(kwargs, exc, msg):
    args = dict(x=torch.zeros(2, 64, dtype=torch.float16), bits=4, group_size=32) | kwargs
    with pytest.raises(exc, match=msg):
        reference.quantize(args["x"], args["bits"], args["group_size"])


@pytest.mark.parametrize("dim,exc,msg", [(2, ValueError, r"dim must lie in \[-2, 1\] for (x|codes) of 2 dims, got 2"),
                                         (-3, ValueError, "dim must lie in .* got -3"),
                                         (True, TypeError, "dim must be an int"), (1.0, TypeError, "dim must be an int")])
def test_every_quantizer_checks_its_dim(dim, exc, msg):
    """quantize, dequantize and quantize_fp4 refuse a dim outside the tensor (indexing
    would wrap it to another dim silently) and a 0-dim tensor."""
    x = torch.zeros(2, 64, dtype=torch.float16)
    codes, scale, zero = reference.quantize(x, 4, 32)
    for call in (lambda: reference.quantize(x, 4, 32, dim=dim), lambda: reference.quantize_fp4(x, "nvfp4", dim=dim),
                 lambda: reference.dequantize(codes, scale, zero, 32, dim=dim)):
        with pytest.raises(exc, match=msg):
            call()
    for call in (lambda: reference.quantize(x[0, 0], 4, 32), lambda: reference.quantize_fp4(x[0, 0], "nvfp4")):
        with pytest.raises(ValueError, match="x must have at least one dimension"):
            call()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("dim", [0, -1])
def test_on_grid_data_requantizes_exactly(dtype, bits, dim, gen, device):
    x, codes, scale, zero = kvdata.on_grid(gen, (64, 96), bits, 32, dim=dim, dtype=dtype, device=device,
                                           params=True)
    got = roundtrip(x, bits, 32, dim)
    for name, want, have in zip(("codes", "scale", "zero", "x_hat"), (codes, scale, zero, x), got):
        assert torch.equal(have, want), name


# --------------------------------------------------------------------------------------
# Packing
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits,length", [(4, 32), (4, 128), (4, 256), (2, 64), (2, 256)])
def test_pack_rows_round_trip(bits, length, gen, device):
    codes = torch.randint(0, 1 << bits, (3, 5, length), generator=gen, dtype=torch.uint8).to(device)
    words = reference.pack_rows(codes, bits)
    assert words.dtype == torch.int32 and words.shape == (3, 5, length * bits // 32)
    assert torch.equal(reference.unpack_rows(words, bits, length), codes)
    # every bit of every word is used exactly once
    full = torch.full((length,), (1 << bits) - 1, dtype=torch.uint8, device=device)
    assert bool((reference.pack_rows(full, bits) == -1).all())
    for col in range(0, length, 7):
        one = torch.zeros(length, dtype=torch.uint8, device=device)
        one[col] = 1
        w = reference.pack_rows(one, bits).long() & 0xFFFFFFFF
        word, shift = sm80.packed_row_map(bits, length)[col]
        assert w.nonzero().flatten().tolist() == [word] and int(w[word]) == 1 << shift


def test_pack_rows_4bit_word_order():
    """DESIGN: a word holds what one lane's fragment needs, nibbles from the most
    significant holding elements 7,5,3,1,6,4,2,0; lane 0 holds k columns 0,1,8,9 of every
    16-wide block, so word 0 holds columns 0,1,8,9,16,17,24,25 as elements 0..7."""
    codes = (torch.arange(32) % 16).to(torch.uint8)  # column c holds code c % 16
    word0 = int(reference.pack_rows(codes, 4)[0]) & 0xFFFFFFFF
    element_cols = [0, 1, 8, 9, 16, 17, 24, 25]
    nibbles = [element_cols[e] % 16 for e in (7, 5, 3, 1, 6, 4, 2, 0)]
    assert word0 == int("".join(format(n, "x") for n in nibbles), 16) == 0x91918080


@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_params_round_trip(dtype, gen, device):
    scale = kvdata.randn(gen, 4, 16, dtype=dtype, device=device).abs()
    zero = kvdata.randn(gen, 4, 16, dtype=dtype, device=device, std=100.0)
    zero[0, :4] = torch.tensor([-0.0, 0.0, 65504.0, -65504.0], dtype=dtype)
    words = reference.pack_params(scale, zero)
    assert words.dtype == torch.int32 and words.shape == scale.shape
    s, z = reference.unpack_params(words, dtype)
    assert torch.equal(s.view(torch.int16), scale.view(torch.int16))
    assert torch.equal(z.view(torch.int16), zero.view(torch.int16))


def test_pack_params_word_layout():
    one, two = torch.tensor([1.0], dtype=torch.float16), torch.tensor([-2.0], dtype=torch.float16)
    word = int(reference.pack_params(one, two)[0]) & 0xFFFFFFFF
    assert word == 0xC000_3C00  # scale (0x3c00) in the low half, zero (0xc000) in the high


# DESIGN / layouts.sm80: params along an MMA k dimension are stored in fragment order,
# quad lane c's four columns (2c, 2c+1, 2c+8, 2c+9) of each 16-wide block next to each other
FRAGMENT_ORDER_16 = [0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15]


def test_params_in_fragment_order():
    fmt = KVFormat(bits=4, k_mode="channel", group_size=128)
    # K per channel: params run along the head dim; make channel c's range (c + 1) * 15
    d = 64
    k = torch.zeros(1, 128, d, dtype=torch.float16)
    k[0, 1] = (torch.arange(d) + 1) * 15.0
    _, k_params = reference.pack_k(k, fmt)
    scale, zero = reference.unpack_params(k_params, torch.float16)
    order = [16 * (p // 16) + FRAGMENT_ORDER_16[p % 16] for p in range(d)]
    assert scale[0, 0].tolist() == [c + 1.0 for c in order] and bool((zero == 0).all())
    # V: params of 16 consecutive tokens, stored [tokens/16, D/G, 16] with tokens in fragment order
    v = torch.zeros(1, 128, d, dtype=torch.float16)
    v[0, :, 0] = (torch.arange(128) + 1) * 15.0
    _, v_params = reference.pack_v(v, _fmt(4, "channel", 64))
    scale, _ = reference.unpack_params(v_params, torch.float16)  # [1, 8, 1, 16]
    tokens = [16 * blk + FRAGMENT_ORDER_16[i] for blk in range(8) for i in range(16)]
    assert scale[0, :, 0].flatten().tolist() == [t + 1.0 for t in tokens]


def _fmt(bits, k_mode, g):
    return KVFormat(bits=bits, k_mode=k_mode, group_size=g)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("k_mode", ["channel", "token"])
def test_pack_k_round_trip(dtype, bits, k_mode, gen, device):
    fmt = _fmt(bits, k_mode, 32)
    n, d = fmt.residual_block, 64
    k = kvdata.randn(gen, 2, n, d, dtype=dtype, device=device)
    k_pack, k_params = reference.pack_k(k, fmt)
    assert k_pack.shape == fmt.k_pack_shape(1, 2, n, d)[1:]
    assert k_params.shape == fmt.k_params_shape(1, 2, n, d)[1:]
    dim = -2 if k_mode == "channel" else -1
    expect = reference.dequantize(*reference.quantize(k, bits, 32, dim=dim), 32, dim=dim)
    assert torch.equal(reference.unpack_k(k_pack, k_params, fmt, dtype), expect)
    grid = kvdata.on_grid(gen, (2, n, d), bits, 32, dim=dim, dtype=dtype, device=device)
    assert torch.equal(reference.unpack_k(*reference.pack_k(grid, fmt), fmt, dtype), grid)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [4, 2])
def test_pack_v_round_trip(dtype, bits, gen, device):
    fmt = _fmt(bits, "channel", 64)
    n, d = 2 * fmt.residual_block, 128
    v = kvdata.randn(gen, 2, n, d, dtype=dtype, device=device)
    v_pack, v_params = reference.pack_v(v, fmt)
    assert v_pack.shape == fmt.v_pack_shape(1, 2, n, d)[1:]
    assert v_params.shape == fmt.v_params_shape(1, 2, n, d)[1:]
    expect = reference.dequantize(*reference.quantize(v, bits, 64), 64)
    assert torch.equal(reference.unpack_v(v_pack, v_params, fmt, dtype), expect)
    grid = kvdata.on_grid(gen, (2, n, d), bits, 64, dim=-1, dtype=dtype, device=device)
    assert torch.equal(reference.unpack_v(*reference.pack_v(grid, fmt), fmt, dtype), grid)


def test_pack_v_needs_whole_blocks():
    fmt = _fmt(4, "channel", 32)
    with pytest.raises(ValueError, match="packed 128 tokens at a time, got 96 tokens"):
        reference.pack_v(torch.zeros(1, 96, 64, dtype=torch.float16), fmt)


# --------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 2), (6, 1)])
def test_attention_matches_torch(hq, hkv, gen, device):
    q = kvdata.randn(gen, hq, 64, device=device)
    k, v = kvdata.kv(gen, 1, 77, hkv, 64, device=device)
    for scale in (None, 0.3):
        out, lse = reference.attention(q, k[0], v[0], scale)
        ref_out, ref_lse = kvdata.attention(q, k[0], v[0], scale)
        assert out.dtype == lse.dtype == torch.float32
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_attention_empty_sequence():
    q = torch.ones(4, 64, dtype=torch.float16)
    out, lse = reference.attention(q, torch.zeros(0, 2, 64), torch.zeros(0, 2, 64))
    assert torch.equal(out, torch.zeros(4, 64)) and bool((lse == -math.inf).all())


def test_decode_tolerance_is_flash_attentions_rule():
    """The GPU suite's rule, pinned: twice a same-precision computation's error plus twice
    1e-3 of the largest reference value (at least 1), so a kernel off by 5e-3 at values ~1
    fails where the rounded computation is exact."""
    ref = torch.tensor([[0.5, -3.0]])
    assert reference.decode_tolerance(ref, ref) == pytest.approx(2e-3 * 3.0)
    assert reference.decode_tolerance(ref / 10, ref / 10) == pytest.approx(2e-3)  # the floor's (at least 1)
    rounded = ref + torch.tensor([[1e-3, 0.0]])
    assert reference.decode_tolerance(rounded, ref) == pytest.approx(2 * 1e-3 + 2e-3 * 3.0, rel=1e-5)  # (fp32)
    small = torch.tensor([[0.9, -1.0]])
    assert (small + 5e-3 - small).abs().max().item() > reference.decode_tolerance(small, small)


@pytest.mark.parametrize("cfg", kvdata.KERNEL_CONFIGS, ids=lambda c: f"{c[0]}b-{c[1]}-g{c[2]}-{str(c[3])[6:]}-d{c[4]}-gq{c[5]}")
def test_needle_batches_make_a_dropped_token_fail_the_tolerance(cfg):
    """The GPU suite's needle test (``kvdata.needle_batch``) can fail: on the reference the
    output of every sequence and query head is its needle's dequantized V (the softmax
    peaked on it), and that V is far larger than the kernel tolerance, so a decode that
    dropped or misplaced the needle token would miss by ~|V| >> the tolerance."""
    import bitdecode as bd

    bits, mode, g, dtype, d, gq = cfg
    fmt = KVFormat(bits=bits, k_mode=mode, group_size=g)
    q, k, v, lens, at = kvdata.needle_batch(fmt.residual_block, 2, d, gq, dtype)
    cache = bd.KVCache.allocate(len(lens), 2, d, max(lens) + 64, fmt, dtype=dtype, device="cpu",
                                page_size=fmt.residual_block, backend="reference")
    cache.prefill(k, v, lens)
    out = bd.decode(q, cache).float()
    tol = reference.kernel_tolerance(q, cache, out)
    for b, t in enumerate(at):
        needle = cache.dequantized(b)[1][t].float().repeat_interleave(gq, dim=0)  # [hkv gq, d]
        assert (out[b, 0] - needle).abs().max().item() < 0.05 * needle.abs().max().item()
        assert (needle - v[b, :lens[b]].float().mean(0).repeat_interleave(gq, dim=0)).abs().max().item() > 20 * tol


def test_a_scale_that_rounds_to_zero_gives_code_zero():
    """A group whose range is below the 16-bit scale's smallest step has scale 0 and codes
    0 (as the GPU pack kernel writes them), not the largest code."""
    x = torch.zeros(1, 32, dtype=torch.float16)
    x[0, 1] = 2.0 ** -24  # fp16's smallest subnormal: the scale 2^-24 / 15 rounds to 0
    codes, scale, zero = reference.quantize(x, 4, 32)
    assert scale.item() == 0 and zero.item() == 0 and codes.max().item() == 0


@pytest.mark.parametrize("bits", [4, 2])
def test_codes_stay_below_qmax_when_the_scale_rounds_down(bits):
    """A range of a few fp16 subnormal steps: the scale rounds toward zero to one step, so
    the largest value's code would be 2^bits (one bit into the next field of a word)
    without the clamp."""
    x = torch.zeros(1, 64, dtype=torch.float16)  # (two groups of 32: a row 2-bit words pack)
    x[0, 1] = (1 << bits) * 2.0 ** -24
    codes, scale, zero = reference.quantize(x, bits, 32)
    assert scale[0, 0].item() == 2.0 ** -24 and int(codes.max()) == (1 << bits) - 1
    reference.pack_rows(codes, bits)  # (checks the codes' range)


def test_pack_params_keeps_the_zero_beside_a_negative_scale():
    """The scale's half of a params word does not sign-extend into the zero's half."""
    scale = torch.tensor([-0.0, -1.0, 2.0], dtype=torch.float16)
    zero = torch.tensor([3.0, -5.0, 0.5], dtype=torch.float16)
    s, z = reference.unpack_params(reference.pack_params(scale, zero), torch.float16)
    assert torch.equal(s.view(torch.int16), scale.view(torch.int16))
    assert torch.equal(z.view(torch.int16), zero.view(torch.int16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_of_several_queries_is_causal_over_the_newest_tokens(dtype, gen):
    """``reference.decode`` with T = 3: query j attends to the first len - T + 1 + j tokens
    (the cache's own dequantized K / V), each sequence at its own length."""
    fmt = _fmt(4, "channel", 32)
    lens, d, t = [300, 131], 64, 3
    k, v = (kvdata.randn(gen, 2, 300, 2, d, dtype=dtype) for _ in range(2))
    cache = KVCache.allocate(2, 2, d, 320, fmt, dtype=dtype, device="cpu", backend="reference")
    cache.prefill(k, v, seqlens=torch.tensor(lens, dtype=torch.int32))
    q = kvdata.randn(gen, 2, t, 4, d, dtype=dtype)
    tn = cache.tensors()
    out = reference.decode(q, tn.k_pack, tn.k_params, tn.v_pack, tn.v_params, tn.k_res, tn.v_res,
                           tn.cache_seqlens, fmt, tn.block_table)
    for b, n in enumerate(lens):
        kd, vd = reference.gather_kv(b, n, tn.k_pack, tn.k_params, tn.v_pack, tn.v_params, tn.k_res, tn.v_res,
                                     tn.block_table, fmt, None)
        for j in range(t):
            seen = n - t + 1 + j
            want, _ = reference.attention(q[b, j], kd[:seen], vd[:seen], None)
            assert torch.equal(out[b, j], want.to(dtype)), (b, j)
        assert not torch.equal(out[b, 0], out[b, 2])
