"""Would an s8 wgmma path keep the sm90 decode's accuracy?  (issue 9: ``profiles/h200/
wgmma.json`` has an s8 ``64 x 8 x 32`` wgmma cost what an f16 ``64 x 8 x 16`` does, so
s8 operands would halve the decode's 32 wgmmas a 128-token tile.)

The sm90 kernel's products take K's and V's exact codes and carry the scales in the
other operand (``fold_k``, ``fold_v``): S = (Q o s_K) . codes + bias, O = (P o s_V) . codes
+ zero terms, with Q o s_K and P o s_V rounded to fp16.  An s8 path would round those two
to int8 instead, as ``terms`` int8 values side by side in the wgmma's N columns (GQA 4
pads N = 8 with four unused columns today): x ~ r (t1 + t2 / 127 + ...), r = max |x| / 127
per (head, K group) for Q o s_K and per (head, 128-token tile) for P o s_V, each term the
rounded residual of the ones before (or, for P o s_V, r = 4 max s_V / 127 from the tile's V
scales alone: the kernel's lazy maximum keeps P below 4, so the scale is known before P and
needs no exchange across warps).  Sums of int8 products are exact in s32.

On SmolLM2-135M's own Q / K / V (``tests/data/smollm2_kv.pt``), 4-bit K per channel and V
per token in groups of 128 (the reference's quantizer): the relative L2 error of the
output against float64 attention over the same dequantized cache, for fp16 operands (what
the kernel does) and one / two / three int8 terms.  CPU, seconds:
``python3 profiles/s8_operand_study.py``.
"""

from pathlib import Path

import torch

from bitdecode import reference as R

GROUP = 128
TILE = 128


def int8_terms(x: torch.Tensor, terms: int, dim: int, bound=None) -> torch.Tensor:
    """``x`` as ``terms`` int8 values with one scale per slice along ``dim``: max |x| / 127,
    or ``bound`` / 127 (a bound known before ``x``, broadcast against it)."""
    r = (x.abs().amax(dim, keepdim=True) if bound is None else bound).clamp(min=1e-30) / 127
    out = torch.zeros_like(x)
    rest = x / r
    for i in range(terms):
        unit = 127.0 ** -i
        t = (rest / unit).round().clamp(-127, 127)
        out = out + t * unit
        rest = rest - t * unit
    return out * r


def decode(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, operand):
    """One query token over one KV head's cache, the kernel's way: ``operand(x, dim, bound)``
    rounds Q o s_K (per head and K group, along channels) and P o s_V (per head and tile,
    along tokens; ``bound``: a bound of it known before P) as the MMA would take them;
    everything else in float64."""
    g, d = q.shape
    n = k_codes.shape[0]
    scale = d ** -0.5
    s = torch.zeros(g, n, dtype=torch.float64)
    for t0 in range(0, n, GROUP):
        sk, zk = k_scale[t0 // GROUP], k_zero[t0 // GROUP]  # [d] per channel
        qs = operand(q * sk, 1, None)
        s[:, t0:t0 + GROUP] = qs @ k_codes[t0:t0 + GROUP].T + (q @ zk)[:, None]
    s = s * scale
    p = torch.exp(s - s.amax(-1, keepdim=True))
    l = p.sum(-1, keepdim=True)
    o = torch.zeros(g, d, dtype=torch.float64)
    for t0 in range(0, n, TILE):
        sv, zv = v_scale[t0:t0 + TILE, 0], v_zero[t0:t0 + TILE, 0]  # per token (one group = d)
        pt = p[:, t0:t0 + TILE]
        # the kernel's P stays below 2^LAZY_MARGIN = 4 of the running maximum: with V's
        # largest scale in the tile that bounds P o s_V before P is known (no exchange)
        o += operand(pt * sv, 1, 4 * sv.abs().max()) @ v_codes[t0:t0 + TILE] + (pt @ zv)[:, None]
    return o / l


def main() -> None:
    data = torch.load(Path(__file__).resolve().parent.parent / "tests" / "data" / "smollm2_kv.pt")
    operands = {"fp16": lambda x, dim, bound: x.half().double()}
    for terms in (1, 2, 3):
        operands[f"s8 x{terms}"] = lambda x, dim, bound, t=terms: int8_terms(x, t, dim)
    operands["s8 x2, P o s_V scaled by a bound"] = lambda x, dim, bound: int8_terms(x, 2, dim, bound)
    for layer in data["layers"]:
        q, k, v = (data[f"{name}{layer}"].view(torch.float8_e4m3fn).float() * data[f"{name}{layer}_scale"]
                   for name in ("q", "k", "v"))
        n = k.shape[0] // GROUP * GROUP
        hkv = k.shape[1]
        g = q.shape[1] // hkv
        errs = {name: [] for name in operands}
        for h in range(hkv):
            kh, vh = k[:n, h].half(), v[:n, h].half()
            kc, ks, kz = R.quantize(kh, 4, GROUP, dim=0)  # per channel, groups of 128 tokens
            vc, vs, vz = R.quantize(vh, 4, kh.shape[1], dim=1)  # per token, one group of d
            cache = (kc.double(), ks.double(), kz.double(), vc.double(), vs.double(), vz.double())
            kd = R.dequantize(kc, ks, kz, GROUP, dim=0).double()
            vd = R.dequantize(vc, vs, vz, kh.shape[1], dim=1).double()
            for i in range(q.shape[0]):
                qh = q[i, h * g:(h + 1) * g].half().double()
                s = qh @ kd.T * kh.shape[1] ** -0.5
                p = torch.softmax(s, -1)
                exact = p @ vd
                for name, op in operands.items():
                    o = decode(qh, *cache, op)
                    errs[name].append(((o - exact).norm() / exact.norm()).item())
        print(f"layer {layer}: " + ", ".join(f"{name} {sum(e) / len(e):.2e}" for name, e in errs.items())
              + f"  (relative L2 against float64 over the same 4-bit cache, mean of {len(errs['fp16'])})")


if __name__ == "__main__":
    main()
