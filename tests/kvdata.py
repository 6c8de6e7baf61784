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
