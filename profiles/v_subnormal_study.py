"""Which zero sums keep the sm90 decode's 2-bit V exact enough with V's codes as fp16
subnormals?  (issue 9: ``DecodeSm90(v_subnormal=True)``.)

The kernel folds V's per-token scale into P (``fold_v``): O = V^T(codes) P^T + zero sums.
With centered codes P^T is ``fp16(P s)`` and the codes ``code - c`` (an exact fix-up fma a
pair).  With subnormal codes the lop3 alone yields ``code mult 2^-24`` (raw codes, ``mult``
1 or 4 by the token's place in its word), so P^T is ``h = fp16(P s / mult)`` and the
product is ``sum h mult code``; the zero sums must supply the rest.  Four forms, each
``O = (product + zero sums) / sum P`` with everything but the fp16 rounding of P^T exact
(float64):

* ``centered``: the fix-up path (``v_subnormal=False``);
* ``p zero``: raw codes, zero sums ``sum P z`` (the probe, thirty-sixth session);
* ``h zero``: zero sums ``sum (h mult / s) z`` (P as the product got it; GPU-run in the
  thirty-seventh session, then replaced);
* ``h center``: zero sums ``sum P (z + c s) - c mult h`` (the kernel's form now): O gets
  ``sum P' s (code - c) + sum P z`` with ``P' = h mult / s``, the centered path's error
  but for the underflow that ``1 / mult`` adds;
* ``h center, room 0``: the same with every ``mult`` 1 (``v_sub_room=0``: a shift a pair),
  the centered path's arithmetic exactly.

The yardstick is the tolerance model of the GPU tests: ``fp16(P) V`` over the same
dequantized V.  Cases: SmolLM2-135M's own Q / K / V (``tests/data/smollm2_kv.pt``, V 2-bit
per token in one group of the head dim; K unquantized so only V's side differs), and two
synthetic ones: V drifting from -2 to 2 along 2^20 tokens with three needles scoring 14
(``test_one_million_token_sequence``), and flat V tokens (3 + 1e-3 noise: a tiny scale
under a large zero) beside needles (``flat_v_cache``).  CPU, about a minute:

    python3 profiles/v_subnormal_study.py --out profiles/cpu

writes ``<out>/v_subnormal_study.json``: each case's largest absolute error per form and
the yardstick's.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bitdecode import reference as R
from bitdecode._files import write_record
from layouts import packing

BITS = 2
CENTER = 1 << (BITS - 1)
FORMS = ("centered", "p zero", "h zero", "h center", "h center, room 0")


def f16(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to fp16 (subnormals and underflow included), back in float64."""
    return x.to(torch.float16).to(torch.float64)


def token_mults(n: int, room: int) -> torch.Tensor:
    """Each token's ``mult`` with ``v_sub_room`` ``room``: the subnormal steps' multipliers,
    eight tokens a pair in turn (the kernel's assignment differs, the share of each
    multiplier is the same)."""
    steps = packing.dequant_steps(BITS, "fp16", BITS + room, True)
    mults = torch.tensor([s.mult for s in steps], dtype=torch.float64)
    return mults[(torch.arange(n) // 8) % len(mults)]


def attend(p: torch.Tensor, code: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> dict:
    """O of each form for P ``[g, n]`` (relative to its maximum, as the kernel holds it) over
    V codes ``[n, d]`` with per-token scale / zero ``[n, 1]``, and the yardstick."""
    l = p.sum(-1, keepdim=True)
    vd = code * s + z
    out = {"exact": p @ vd / l, "yardstick": f16(p) @ vd / l}
    h = f16(p * s.T)
    out["centered"] = (h @ (code - CENTER) + p @ (z + CENTER * s)) / l
    m = token_mults(p.shape[1], 2)[:, None]
    h = f16(p * (s / m).T)
    product = h @ (code * m)
    out["p zero"] = (product + p @ z) / l
    flat = s == 0
    ratio = torch.where(flat, z, z * m / torch.where(flat, torch.ones_like(s), s))
    kept = torch.where(flat.T, p, h)
    out["h zero"] = (product + kept @ ratio) / l
    out["h center"] = (product + p @ (z + CENTER * s) - h @ (CENTER * m)) / l
    m = token_mults(p.shape[1], 0)[:, None]
    h = f16(p * (s / m).T)
    out["h center, room 0"] = (h @ (code * m) + p @ (z + CENTER * s) - h @ (CENTER * m)) / l
    return out


def errors(forms: dict) -> dict:
    exact = forms.pop("exact")
    return {name: (o - exact).abs().max().item() for name, o in forms.items()}


def quantized(v: torch.Tensor):
    """2-bit per-token codes, scale and zero of ``v`` ``[n, d]`` (fp16), in float64."""
    code, s, z = R.quantize(v.half(), BITS, v.shape[1], dim=1)
    return code.double(), s.double(), z.double()


def needles_case(n: int, v: torch.Tensor, score: float, gen: torch.Generator) -> dict:
    """Four query heads over ``n`` tokens of random K (scores ~ N(0, 1)) but three tokens
    scoring ``score`` for every head, over V ``[n, d]``."""
    s = torch.randn(4, n, generator=gen, dtype=torch.float64)
    s[:, [3, n // 2 + 77, n - 300]] = score
    p = torch.exp(s - s.amax(-1, keepdim=True))
    return errors(attend(p, *quantized(v)))


def smollm2_case() -> dict:
    """The largest error of each form over SmolLM2's recorded layers, heads and queries."""
    data = torch.load(Path(__file__).resolve().parent.parent / "tests" / "data" / "smollm2_kv.pt")
    worst = {}
    for layer in data["layers"]:
        q, k, v = (data[f"{name}{layer}"].view(torch.float8_e4m3fn).double() * data[f"{name}{layer}_scale"].double()
                   for name in ("q", "k", "v"))
        hkv, d = k.shape[1], k.shape[2]
        g = q.shape[1] // hkv
        for h in range(hkv):
            qh = q[:, h * g:(h + 1) * g].reshape(-1, d)
            s = qh @ k[:, h].T * d ** -0.5
            p = torch.exp(s - s.amax(-1, keepdim=True))
            for name, e in errors(attend(p, *quantized(v[:, h]))).items():
                worst[name] = max(worst.get(name, 0.0), e)
    return worst


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="write <out>/v_subnormal_study.json")
    args = ap.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    n, d = 1 << 20, 16
    drift = torch.randn(n, d, generator=gen, dtype=torch.float64) + torch.linspace(-2, 2, n, dtype=torch.float64)[:, None]
    flat = 3.0 + 1e-3 * torch.randn(n // 16, d, generator=gen, dtype=torch.float64)
    cases = {
        "smollm2 (2-bit V, every layer, head and query)": smollm2_case(),
        "2^20 tokens, V drifting -2..2, needles at 14": needles_case(n, drift, 14.0, gen),
        "2^16 flat V tokens (3 + 1e-3 noise), needles at 12": needles_case(n // 16, flat, 12.0, gen),
    }
    for name, errs in cases.items():
        print(f"{name}: yardstick {errs['yardstick']:.2e}; " + ", ".join(f"{f} {errs[f]:.2e}" for f in FORMS))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        record = {"command": "python3 profiles/v_subnormal_study.py --out profiles/cpu",
                  "what": "largest absolute error of O against float64 over the same dequantized 2-bit V, by "
                          "zero-sum form; yardstick: fp16(P) V (the GPU tests' tolerance model)",
                  "cases": cases}
        write_record(args.out / "v_subnormal_study.json", record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
