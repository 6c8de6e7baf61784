"""Test data and independent maths for the KV-cache tests.

Nothing here uses the packing, params layout or attention code under test: expected
values come from ``reference.quantize``/``dequantize`` (whose own properties
test_reference.py checks) and from torch's scaled_dot_product_attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bitdecode import reference

MANTISSA_BITS = {torch.float16: 10, torch.bfloat16: 7}
# The GPU suite's decode configurations, (bits, k_mode, group, dtype, head_dim, q heads per
# kv head): a covering set of the supported combinations (every value of every axis, most
# pairs) at a bounded compile cost
KERNEL_CONFIGS = [
    (4, "channel", 128, torch.float16, 128, 4),
    (2, "channel", 128, torch.float16, 128, 4),
    (4, "token", 32, torch.bfloat16, 128, 8),
    (2, "token", 64, torch.bfloat16, 64, 1),
    (4, "channel", 64, torch.float16, 256, 16),
    (2, "channel", 32, torch.bfloat16, 256, 2),
    (4, "token", 64, torch.float16, 64, 12),
    (2, "token", 128, torch.float16, 128, 16),
    (4, "channel", 32, torch.bfloat16, 64, 5),
]
MIN_EXPONENT = {torch.float16: -14, torch.bfloat16: -126}
DTYPES = (torch.float16, torch.bfloat16)


def ulp(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of ``dtype`` numbers just above ``|y|`` (float64; subnormal spacing at 0)."""
    a = y.double().abs()
    _, e = torch.frexp(a)  # a = m * 2^e with m in [0.5, 1)
    e = torch.where(a > 0, e - 1, MIN_EXPONENT[dtype]).clamp(min=MIN_EXPONENT[dtype])
    return torch.ldexp(torch.ones_like(a), e - MANTISSA_BITS[dtype])


def randn(gen: torch.Generator, *shape, dtype=torch.float16, device="cpu", std=1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * std).to(dtype).to(device)


def kv(gen, batch, n, heads, dim, dtype=torch.float16, device="cpu", outliers=2):
    """K with a few large channels per head (as real models have), V plain Gaussian."""
    k = torch.randn(batch, n, heads, dim, generator=gen)
    chan = torch.randint(0, dim, (heads, outliers), generator=gen)
    for h in range(heads):
        k[:, :, h, chan[h]] = k[:, :, h, chan[h]] * 8 + 10
    v = torch.randn(batch, n, heads, dim, generator=gen)
    return k.to(dtype).to(device), v.to(dtype).to(device)


def on_grid(gen, shape, bits, group_size, dim, dtype=torch.float16, device="cpu", params=False):
    """Values that quantization reproduces exactly: random codes times chosen 16-bit
    (scale, zero) per group along ``dim``, every group holding code 0 and code 2^bits - 1.

    scale = k * 2^-6 (k in 1..8), zero = m * 2^-6 (m in -64..64): every ``q * scale +
    zero`` is a small multiple of 2^-6, exact in fp16 and bf16, and requantizing gives
    back the same scale (range / (2^bits - 1) is exact up to the fp32 rounding of the
    reciprocal, far below half a 16-bit ulp), zero (the group min) and codes.
    With ``params``, also returns the codes, scale and zero as ``quantize`` lays them out.
    """
    qmax = (1 << bits) - 1
    shape = list(shape)
    shape.append(shape.pop(dim))  # grouped dim last
    lead, n = shape[:-1], shape[-1]
    codes = torch.randint(0, qmax + 1, (*lead, n // group_size, group_size), generator=gen)
    codes[..., 0], codes[..., 1] = 0, qmax
    scale = torch.randint(1, 9, (*lead, n // group_size, 1), generator=gen) / 64.0
    zero = torch.randint(-64, 65, (*lead, n // group_size, 1), generator=gen) / 64.0
    x = (codes * scale + zero).reshape(*lead, n).movedim(-1, dim).to(dtype).to(device).contiguous()
    if not params:
        return x
    codes = codes.reshape(*lead, n).movedim(-1, dim).to(torch.uint8).to(device)
    scale, zero = (t[..., 0].movedim(-1, dim).to(dtype).to(device) for t in (scale, zero))
    return x, codes, scale, zero


def fake_quant_cache(k, v, fmt, length):
    """What a cache holding ``k``, ``v`` ``[N, Hkv, D]`` (first ``length`` tokens) should
    dequantize to: whole residual blocks quantized per format, the rest kept in 16 bits."""
    n = length // fmt.residual_block * fmt.residual_block
    k, v = k[:length].clone(), v[:length].clone()
    g, bits = fmt.group_size, fmt.bits
    if n:
        kdim = 0 if fmt.k_mode == "channel" else -1
        k[:n] = reference.dequantize(*reference.quantize(k[:n], bits, g, dim=kdim), g, dim=kdim)
        v[:n] = reference.dequantize(*reference.quantize(v[:n], bits, g, dim=-1), g, dim=-1)
    return k, v


def attention(q, k, v, softmax_scale=None):
    """One sequence in fp32 by torch SDPA: q ``[Hq, D]``, k/v ``[L, Hkv, D]`` ->
    (out ``[Hq, D]``, lse ``[Hq]``)."""
    hq, d = q.shape
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    if k.shape[0] == 0:
        return torch.zeros(hq, d, device=q.device), torch.full((hq,), -float("inf"), device=q.device)
    qh = q.float()[None, :, None, :]  # [1, Hq, 1, D]
    kh, vh = k.float().permute(1, 0, 2)[None], v.float().permute(1, 0, 2)[None]
    out = F.scaled_dot_product_attention(qh, kh, vh, scale=scale, enable_gqa=True)[0, :, 0]
    rep = hq // k.shape[1]
    scores = torch.einsum("hd,hld->hl", q.float(), kh[0].repeat_interleave(rep, 0)) * scale
    return out, torch.logsumexp(scores, dim=-1)


def batch_attention(q, ks, vs, softmax_scale=None):
    """q ``[B, 1, Hq, D]``, lists of per-sequence k/v -> (out ``[B, 1, Hq, D]`` fp32, lse)."""
    res = [attention(q[b, 0], ks[b], vs[b], softmax_scale) for b in range(q.shape[0])]
    return torch.stack([o for o, _ in res])[:, None], torch.stack([s for _, s in res])[:, None]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def needle_positions(nr: int) -> list:
    """Where a decode could drop a token: the ends of a packed block and of the packed part,
    the first and last residual tokens (a sequence of ``3 nr + 5`` tokens), and the last
    token of a sequence that is one whole packed block."""
    n = 3 * nr + 5
    return [(n, 0), (n, nr - 1), (n, nr), (n, 3 * nr - 1), (n, 3 * nr), (n, n - 1), (nr, nr - 1)]


def needle_batch(nr: int, hkv: int, dim: int, gq: int, dtype=torch.float16, device="cpu", seed=0):
    """(q ``[B, 1, hkv gq, dim]``, k, v ``[B, N, hkv, dim]``, lengths, needle positions): one
    sequence per ``needle_positions`` entry, whose needle token's K lies along its queries'
    sign vector (a logit ~24 above every other token's), so attention reads ~only the
    needle's V there: a decode that drops or misplaces that token misses by ~|V|."""
    gen = torch.Generator().manual_seed(seed)
    places = needle_positions(nr)
    n = max(length for length, _ in places)
    k = torch.randn(len(places), n, hkv, dim, generator=gen) * 0.1
    v = torch.randn(len(places), n, hkv, dim, generator=gen)
    signs = torch.randint(0, 2, (len(places), hkv, dim), generator=gen) * 2.0 - 1
    for b, (_, t) in enumerate(places):
        k[b, t] = signs[b] * 24 / dim ** 0.5  # q . k / sqrt(dim) = 24
    q = signs.repeat_interleave(gq, dim=1)[:, None]
    return (q.to(dtype).to(device), k.to(dtype).to(device), v.to(dtype).to(device),
            [length for length, _ in places], [t for _, t in places])
