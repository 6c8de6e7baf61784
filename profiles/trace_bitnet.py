"""Per-CTA timeline of back-to-back BitNet GEMVs / GEMMs in one CUDA graph (a probe).

Needs ``profiles/probes/bitnet_trace.patch`` applied (``git apply``; never committed): with
it every CTA of the GEMV kernels and of the wgmma GEMM stamps ``%globaltimer`` at its entry,
after the PDL wait, before its stores (GEMV) or after its main loop (GEMM), and at its end,
into a buffer whose address is compiled into the kernels (so the disk cache is off).  Each
shape's calls rotate over distinct weight copies (>= 4 x L2 in all, at least 24), so a
record's weight address names its call; the graph is replayed once more with the buffer
cleared and each call is summarized (first / median / last CTA of each stamp, us from the
first entry).  What it answers: where a call's time goes once the weight bytes are hidden
(the wait for the previous grid, the activations' round trip, the tail).

    git apply profiles/probes/bitnet_trace.patch
    python3 profiles/trace_bitnet.py --gemv 3200x10240 --forms host,bulk,bulk_x --gemm 4800x3200 --out profiles/h200
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def summarize(rec, waddrs):
    """Records (rows of 8 words) -> (one row per call, ordered as ``waddrs``; one call's CTAs)."""
    by = {}
    for r in rec:
        d = by.setdefault((r[6], r[5]), [0, 0, 0, 0, r[4]])  # (weights, block): a GEMM CTA's two records merge
        for w in range(4):
            d[w] = r[w] or d[w]
    call_of = {a: i for i, a in enumerate(waddrs)}
    per = {}
    for (addr, _), d in by.items():
        per.setdefault(call_of.get(addr, -1), []).append(d)
    t0 = min(d[0] for v in per.values() for d in v if d[0])
    rows = []
    for c in sorted(per):
        stamps = [sorted((d[w] - t0) / 1e3 for d in per[c] if d[w]) for w in range(4)]
        row = {"call": c, "ctas": len(per[c]), "sms": len({d[4] for d in per[c]})}
        for w, name in enumerate(("entry", "waited", "pre_store", "end")):
            xs = stamps[w]
            if xs:
                row[name] = [xs[0], xs[len(xs) // 2], xs[-1]]
        rows.append(row)
    # one call in the middle, CTA by CTA (sm, then the four stamps; None where not stamped),
    # ordered by entry: which CTAs finish late, and on which SMs
    mid = sorted(per)[len(per) // 2]
    detail = sorted(([d[4]] + [(t - t0) / 1e3 if t else None for t in d[:4]] for d in per[mid]),
                    key=lambda z: z[1] if z[1] is not None else float("inf"))
    return rows, {"call": mid, "ctas": detail}


def trace(buf, calls, waddrs, replays: int, records: int):
    import torch
    from bitdecode.bitnet_tune import captured, replay_time_us

    graph = captured(calls)
    us = replay_time_us(graph, len(calls), replays)  # (then the same graph, traced once)
    buf.zero_()
    graph.replay()
    torch.cuda.synchronize()
    n = int(buf[0].item())
    if n >= records:
        raise RuntimeError(f"{n} records: more than the patch's ring of {records}")
    return us, summarize(buf[8:8 + 8 * n].view(n, 8).cpu().tolist(), waddrs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gemv", default="", help="NxK,... GEMV shapes")
    p.add_argument("--forms", default="host", help="GEMV forms: host, u4 .. u10pin, bulk, bulk_x, bulk_es, bulk_x_late")
    p.add_argument("--gemm", default="", help="NxK,... wgmma GEMM shapes (at --m tokens)")
    p.add_argument("--m", type=int, default=256, help="GEMM tokens (default 256)")
    p.add_argument("--replays", type=int, default=20, help="timed replays before the traced one")
    p.add_argument("--out", required=True, type=Path, help="folder for trace_bitnet.json")
    args = p.parse_args(argv)
    from bench_gemm_variants import parse_shapes

    shapes = {}
    for flag in ("gemv", "gemm"):
        try:
            shapes[flag] = parse_shapes(getattr(args, flag))
        except ValueError as e:
            p.error(f"--{flag}: {e}")
    gemvs, gemms = shapes["gemv"], shapes["gemm"]
    if not gemvs and not gemms:
        p.error("give --gemv and / or --gemm shapes")
    from bench_bitnet import gemv_forms

    forms = gemv_forms()
    unknown = [f for f in args.forms.split(",") if f != "host" and f not in forms]
    if unknown:
        p.error(f"--forms: unknown {unknown}; known: host, {', '.join(forms)}")
    os.environ["BITDECODE_NO_DISK_CACHE"] = "1"  # the buffer's address is compiled in
    import torch

    from bitdecode.kernels_sm80 import ptx

    if not hasattr(ptx, "TRACE"):
        print("trace_bitnet needs profiles/probes/bitnet_trace.patch applied", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("trace_bitnet needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda", torch.cuda.current_device())
    buf = torch.zeros(8 + 8 * ptx.TRACE_RECORDS, dtype=torch.int64, device=dev)
    ptx.TRACE[0] = buf.data_ptr()
    from bench_bitnet import copies_for, gemv_call

    from bitdecode import bitnet as bn
    from bitdecode._files import write_record

    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    out = {"command": "python3 profiles/trace_bitnet.py " + " ".join(argv or sys.argv[1:]), "gpu": torch.cuda.get_device_name(),
           "method": __doc__, "runs": []}

    def operands(n, k, m):
        gen = torch.Generator(device=dev).manual_seed(n + k)
        packed = bn.pack_weight(torch.randint(-1, 2, (n, k), generator=gen, dtype=torch.int8, device=dev))
        packs = [packed.clone() for _ in range(max(copies_for(packed.numel(), l2), 24))]
        x, xs = bn.quantize_activation(torch.randn(m, k, generator=gen, device=dev))
        return packs, x, xs, torch.ones(1, device=dev)

    for n, k in gemvs:
        packs, x, xs, ws = operands(n, k, 1)
        for name in args.forms.split(","):
            cfg = bn.gemv_config_for(dev, n, k) if name == "host" else forms[name]
            call = gemv_call(cfg)
            us, (rows, detail) = trace(buf, [(lambda q=q: call(x, q, xs, ws)) for q in packs],
                                       [q.data_ptr() for q in packs], args.replays, ptx.TRACE_RECORDS)
            out["runs"].append({"kind": "gemv", "n": n, "k": k, "form": name, "config": repr(cfg), "us_per_call": us,
                                "calls": rows, "detail": detail})
            print(f"gemv {n}x{k} {name}: {us:.2f} us a call (stamps on)", flush=True)
        del packs
    for n, k in gemms:
        packs, x, xs, ws = operands(n, k, args.m)
        us, (rows, detail) = trace(buf, [(lambda q=q: bn.gemm(x, q, xs, ws, kernel="wgmma")) for q in packs],
                                   [q.data_ptr() for q in packs], args.replays, ptx.TRACE_RECORDS)
        out["runs"].append({"kind": "gemm", "m": args.m, "n": n, "k": k, "us_per_call": us, "calls": rows,
                            "detail": detail})
        print(f"gemm M={args.m} {n}x{k}: {us:.2f} us a call (stamps on)", flush=True)
        del packs
    for run in out["runs"]:
        print(f"== {run['kind']} {run.get('m', 1)}x{run['n']}x{run['k']} {run.get('form', '')}: call, then first / "
              "median / last CTA of each stamp, us")
        for row in run["calls"][2:8]:
            print(f"{row['call']:3d} " + " | ".join(f"{s} " + " ".join(f"{t:6.2f}" for t in row[s])
                                                     for s in ("entry", "waited", "pre_store", "end") if s in row))
    args.out.mkdir(parents=True, exist_ok=True)
    write_record(args.out / "trace_bitnet.json", out)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
