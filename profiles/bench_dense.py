"""The decode step's dense layers: bitdecode's GEMV (``bd.dense.linear``) vs cuBLAS (torch's
``linear``) vs the HBM roofline, and SwiGLU (``bd.dense.silu_mul``) vs torch's two ops, at
the Llama-3-8B decode shapes, in one run.

Method (bench_bitnet's): the weights are rotated over enough copies (>= 4 x L2) that every
call reads them from HBM; a sequence of calls (one per copy, at least 32) is captured back
to back in one CUDA graph and replayed (GPU time per call, no launch overhead: how a
captured decode step runs them; with programmatic dependent launch each GEMV prefetches its
weights while the one before finishes, as it does behind the norms and SwiGLU in a
model); CUDA events, median of the replays.  Roofline: the bytes a call must move (weights
+ x + y) at the better of a 1 GiB copy's and a 1 GiB sum's bandwidth, measured in the run.

    python3 profiles/bench_dense.py --out profiles/h200      # writes dense.json (+ dense.png)
    python3 profiles/bench_dense.py --tokens 4,8,16 --tag small_m --out profiles/h200
        # the small-M GEMM (mma.sync, 4-16 tokens) vs cuBLAS: dense_small_m.json
    python3 profiles/bench_dense.py --tokens 1,3,8 --small-m w8b4,w4b8,w8b4r4 --tag sweep
        # also the small-M GEMM at each (warps a CTA, load batch, row blocks a CTA), any token count
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path
from typing import Dict, List

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bitdecode import dense  # noqa: E402
from bitdecode._files import save_plot, write_record  # noqa: E402
from bitdecode._memory import release_memory  # noqa: E402
from profiles.bench_bitnet import MIN_CALLS, copies_for, graph_time_us, measure_roofline  # noqa: E402

# Llama-3-8B (hidden 4096, 32 / 8 heads of 128, MLP 14336) decode projections, q/k/v and
# gate/up merged as bitdecode.hf.fuse_projections runs them
SHAPES = {"o_proj": (4096, 4096), "qkv": (6144, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
TOKENS = tuple(range(1, dense.GEMV_MAX_TOKENS + 1))


def parse_small_m(text: str) -> List[tuple]:
    """``w8b4,w4b8r4`` -> [(8, 4, 1), (4, 8, 4)]: small-M GEMM configs (warps a CTA, load
    batch, 16-row blocks a CTA: ``rR``, 1 when left out)."""
    import re

    out = []
    for item in filter(None, text.split(",")):
        m = re.fullmatch(r"w([1-9]\d*)b([1-9]\d*)(?:r([1-9]\d*))?", item)
        if not m:
            raise ValueError(f"--small-m must be wWbB[rR],... (warps a CTA, load batch, row blocks a CTA), "
                             f"got {item!r}")
        out.append((int(m[1]), int(m[2]), int(m[3] or 1)))
    return out


def bench_linear(name: str, n: int, k: int, tokens: int, device, l2: int, replays: int, roofline: float,
                 small_m=()) -> Dict:
    gen = torch.Generator(device=device).manual_seed(n + k + tokens)
    w = torch.randn(n, k, generator=gen, device=device, dtype=torch.bfloat16) * 0.02
    x = torch.randn(tokens, k, generator=gen, device=device, dtype=torch.bfloat16)
    err = ((dense.linear(x, w, backend="kernel").float() - torch.nn.functional.linear(x, w).float()).abs().max()
           / torch.nn.functional.linear(x, w).float().abs().max()).item()
    copies = copies_for(w.numel() * 2, l2)
    ws = [w.clone() for _ in range(copies)]
    row = {"name": name, "n": n, "k": k, "tokens": tokens, "rel_err_vs_cublas": err}
    timed = [("bd_us", lambda q: dense.linear(x, q, backend="kernel")),
             ("cublas_us", lambda q: torch.nn.functional.linear(x, q))]
    for warps, batch, blocks in small_m:  # the small-M GEMM itself at this config (K must split over the warps)
        if k % (warps * 32) == 0:
            timed.append((f"small_m_w{warps}b{batch}r{blocks}_us",
                          lambda q, c=(warps, batch, blocks): dense._gemm_small_m(x, q, config=c)))
    for key, fn in timed:
        calls = [(lambda q=ws[i % copies], fn=fn: fn(q)) for i in range(max(copies, MIN_CALLS))]
        row[key] = graph_time_us(calls, replays)
    del ws
    release_memory()
    moved = 2 * (n * k + tokens * (k + n))
    row["bytes"] = moved
    row["roofline_us"] = moved / roofline * 1e6
    row["bd_of_roofline"] = row["bd_us"] / row["roofline_us"]
    row["cublas_of_roofline"] = row["cublas_us"] / row["roofline_us"]
    row["speedup"] = row["cublas_us"] / row["bd_us"]
    return row


def bench_after_norm(name: str, n: int, k: int, device, l2: int, replays: int) -> Dict:
    """The projection behind its RMSNorm (q/k/v, gate/up in a decode step): pairs of
    (``bd.bitnet.rms_norm`` kernel, projection) back to back, time per pair.  With
    programmatic dependent launch the GEMV fetches its weights while the norm runs."""
    from bitdecode import bitnet

    gen = torch.Generator(device=device).manual_seed(n + k)
    w = torch.randn(n, k, generator=gen, device=device, dtype=torch.bfloat16) * 0.02
    x = torch.randn(1, k, generator=gen, device=device, dtype=torch.bfloat16)
    wn = torch.rand(k, generator=gen, device=device, dtype=torch.bfloat16) + 0.5
    copies = copies_for(w.numel() * 2, l2)
    ws = [w.clone() for _ in range(copies)]
    row = {"name": name, "n": n, "k": k, "tokens": 1}
    for key, fn in (("norm_bd_us", lambda q: dense.linear(bitnet.rms_norm(x, wn, 1e-5, backend="kernel"), q,
                                                          backend="kernel")),
                    ("norm_cublas_us", lambda q: torch.nn.functional.linear(bitnet.rms_norm(x, wn, 1e-5,
                                                                                            backend="kernel"), q))):
        calls = [(lambda q=ws[i % copies], fn=fn: fn(q)) for i in range(max(copies, MIN_CALLS))]
        row[key] = graph_time_us(calls, replays)
    del ws
    release_memory()
    row["speedup"] = row["norm_cublas_us"] / row["norm_bd_us"]
    return row


def bench_silu_mul(tokens: int, inter: int, device, replays: int) -> Dict:
    gu = torch.randn(tokens, 2 * inter, device=device, dtype=torch.bfloat16)
    same = torch.equal(dense.silu_mul(gu, backend="kernel"), dense.silu_mul_reference(gu))
    row = {"tokens": tokens, "inter": inter, "bit_identical": same}
    for key, fn in (("bd_us", lambda: dense.silu_mul(gu, backend="kernel")),
                    ("torch_us", lambda: dense.silu_mul_reference(gu))):
        row[key] = graph_time_us([fn] * MIN_CALLS, replays)
    return row


def run(out_dir: Path, replays: int = 50, tokens_list=TOKENS, tag: str = "", small_m=()) -> dict:
    device = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    roof = measure_roofline(device, replays)
    rows: List[Dict] = []
    for tokens in tokens_list:
        for name, (n, k) in SHAPES.items():
            r = bench_linear(name, n, k, tokens, device, l2, replays, roof["bytes_per_s"], small_m)
            extra = "".join(f"  {key[:-3]} {us:.2f}" for key, us in r.items() if key.startswith("small_m_"))
            print(f"{name:8s} M={tokens} N={n:6d} K={k:6d}  bitdecode {r['bd_us']:7.2f} us ({r['bd_of_roofline']:.2f}x "
                  f"roofline)  cuBLAS {r['cublas_us']:7.2f} us ({r['cublas_of_roofline']:.2f}x)  "
                  f"speedup {r['speedup']:.2f}{extra}", flush=True)
            rows.append(r)
    after_norm = [bench_after_norm(name, *SHAPES[name], device, l2, replays) for name in ("qkv", "gate_up")]
    for r in after_norm:
        print(f"norm + {r['name']:8s} M=1: bitdecode {r['norm_bd_us']:7.2f} us, cuBLAS {r['norm_cublas_us']:7.2f} us, "
              f"speedup {r['speedup']:.2f}", flush=True)
    silu = [bench_silu_mul(t, 14336, device, replays) for t in (1, 8)]
    for r in silu:
        print(f"silu_mul M={r['tokens']} I=14336: bitdecode {r['bd_us']:.2f} us, torch {r['torch_us']:.2f} us, "
              f"bit-identical {r['bit_identical']}", flush=True)
    res = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__, "python": platform.python_version(),
           "command": " ".join(["python3", "profiles/bench_dense.py", *sys.argv[1:]]), "roofline": roof, "gemv": rows,
           "after_norm": after_norm, "silu_mul": silu, "method": "CUDA graph of >= 32 back-to-back calls over weight copies >= 4 x L2, "
                                        "median of replays; roofline = bytes moved / best of copy and sum bandwidth"}
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"dense_{tag}" if tag else "dense"
    write_record(out_dir / f"{stem}.json", res)
    plot(res, out_dir / f"{stem}.png")
    return res


def plot(res: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = res["gemv"]
    labels = [f"{r['name']}\nM={r['tokens']}" for r in rows]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(rows)), 4.4))
    ax.bar([x - 0.2 for x in xs], [r["bd_us"] for r in rows], 0.4, label="bitdecode GEMV", color="#2ca02c")
    ax.bar([x + 0.2 for x in xs], [r["cublas_us"] for r in rows], 0.4, label="cuBLAS (torch linear)", color="#1f77b4")
    ax.scatter(list(xs), [r["roofline_us"] for r in rows], marker="_", s=400, color="k", label="HBM roofline", zorder=3)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("us per call (CUDA graph, weights from HBM)")
    ax.set_title(f"bf16 decode GEMV, Llama-3-8B shapes ({res['gpu']})")
    ax.legend()
    fig.tight_layout()
    save_plot(fig, path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("profiles/h200"), help="folder for dense.json / dense.png")
    p.add_argument("--replays", type=int, default=50, help="graph replays per measurement (median; default 50)")
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)),
                   help=f"token counts, 1 to {dense.SMALL_M_MAX_TOKENS} (default {','.join(map(str, TOKENS))}: the "
                        f"GEMV's; {dense.GEMV_MAX_TOKENS + 1} and more time the small-M GEMM)")
    p.add_argument("--tag", default="", help="write dense_<tag>.json / .png instead of dense.json")
    p.add_argument("--small-m", default="", help="also time the small-M GEMM itself at these configs, wWbB[rR],... "
                   "(W warps a CTA, B chunks loaded before use, R 16-row blocks a CTA; the default kernel is w8b4r1), "
                   "at every token count")
    args = p.parse_args(argv)
    try:
        small_m = parse_small_m(args.small_m)
    except ValueError as exc:
        p.error(str(exc))
    try:
        tokens = tuple(int(t) for t in args.tokens.split(","))
    except ValueError:
        p.error(f"--tokens must be integers separated by commas, got {args.tokens!r}")
    if not tokens or not all(1 <= t <= dense.SMALL_M_MAX_TOKENS for t in tokens):
        p.error(f"--tokens must each be 1 to {dense.SMALL_M_MAX_TOKENS}, got {args.tokens!r}")
    if args.tag and not args.tag.isidentifier():
        p.error(f"--tag must be a Python identifier, got {args.tag!r}")
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    run(args.out, args.replays, tokens, args.tag, small_m)
    return 0


if __name__ == "__main__":
    sys.exit(main())
