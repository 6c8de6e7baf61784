"""How the timer's L2 flush moves a decode's time: each call timed after a ``clean`` flush
(a read of a 2x-L2 buffer: L2 full of other data's clean lines, the benches' flush since
the fifty-fifth session), a ``dirty`` one (a 2x-L2 memset, the flush before it: L2 full of
dirty lines that the call's own misses write back first) and none, in interleaved rounds
(each case's three timings one after the other), CUDA-graph replay, median; bitdecode's
decode (4 and 2 bits, K per channel g128, the default backend) and torch SDPA on the
16-bit K/V, fp16, Hq/Hkv 32/8, D 128.

    python3 profiles/bench_flush.py --out profiles/h100

writes ``<out>/flush.json`` (``flush_<tag>.json`` with ``--tag``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import Timer, build  # noqa: E402
from bench_variants import D, FORMATS, HKV, HQ, parse_shapes  # noqa: E402

import bitdecode as bd  # noqa: E402
from bitdecode._files import write_record  # noqa: E402
from bitdecode.bitnet_tune import captured  # noqa: E402  (the library's one graph-capture helper)

TIMED = ("4c128", "2c128")  # (FORMATS' keys)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="output folder, e.g. profiles/h200")
    p.add_argument("--tag", default="", help="suffix of the file name (an identifier)")
    p.add_argument("--shapes", type=parse_shapes, default=parse_shapes("1x4096,1x131072,16x65536"),
                   help="BxN,... (default 1x4096,1x131072,16x65536)")
    p.add_argument("--rounds", type=int, default=31, help="timings of each case and flush (median)")
    args = p.parse_args(argv)
    if args.tag and not args.tag.isidentifier():
        p.error(f"--tag must be an identifier, got {args.tag!r}")
    if args.rounds < 1:
        p.error(f"--rounds must be positive, got {args.rounds}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_flush needs a CUDA GPU")
    dev = torch.device("cuda")
    timer = Timer(dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    cases = {}  # name -> (graph, the tensors it reads)
    for b, n in args.shapes:
        for key in TIMED:
            fmt = bd.KVFormat(*FORMATS[key])
            q = torch.randn(b, 1, HQ, D, device=dev, dtype=torch.float16, generator=gen)
            cache, k, v = build(fmt, b, HKV, D, n, dev, gen)
            cache.prefill(k, v)
            del k, v
            cases[f"bd{key} B={b} N={n}"] = (captured([lambda q=q, c=cache: bd.decode(q, c)]), (q, cache))
        q = torch.randn(b, HQ, 1, D, device=dev, dtype=torch.float16, generator=gen)
        k16, v16 = (torch.randn(b, HKV, n, D, device=dev, dtype=torch.float16, generator=gen) for _ in range(2))
        sdpa = lambda q=q, k=k16, v=v16: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
        cases[f"sdpa16 B={b} N={n}"] = (captured([sdpa]), (q, k16, v16))
        del k16, v16
    times = {(name, how): [] for name in cases for how in Timer.FLUSHES}
    for _ in range(args.rounds):
        for name, (graph, _) in cases.items():
            for how in Timer.FLUSHES:
                times[(name, how)].append(timer.once(graph.replay, how))
    rows = [{"case": name, **{f"{how}_us": statistics.median(times[(name, how)]) for how in Timer.FLUSHES}}
            for name in cases]
    result = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__,
              "l2_bytes": torch.cuda.get_device_properties(dev).L2_cache_size,
              "command": " ".join(["python3 profiles/bench_flush.py", *(sys.argv[1:] if argv is None else argv)]),
              "method": __doc__.split("\n\n")[0].replace("\n", " "), "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / (f"flush_{args.tag}.json" if args.tag else "flush.json")
    write_record(path, result)
    print(f"{result['gpu']}, L2 {result['l2_bytes'] >> 20} MiB; us, median of {args.rounds}")
    print(f"{'case':26s} {'clean':>9s} {'dirty':>9s} {'none':>9s} {'dirty - clean':>14s}")
    for r in rows:
        print(f"{r['case']:26s} {r['clean_us']:9.2f} {r['dirty_us']:9.2f} {r['none_us']:9.2f} "
              f"{r['dirty_us'] - r['clean_us']:14.2f}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
