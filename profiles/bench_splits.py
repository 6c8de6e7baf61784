"""sm90 decode time by split count: each shape at ``--splits`` (0: the backend's own choice),
through the public API, so each count runs the kernel the dispatch builds for it (with the
4-head tile, one split whose pairs fit the SMs takes the one-CTA two-consumer kernel, more
splits the default two CTAs an SM: ``Sm90Backend.grid_variant``).  CUDA-graph replay, L2
flushed before each call, median of 30 (``bench_decode``'s timer); a count (or a backend)
given twice keeps its last time, every time listed in its ``*_runs_us`` (the first call on a
fresh cache measured up to ~5 % slow before the sixty-ninth session's capture mend).  ``--backends
sm90,sm80`` times other backends beside it on the same caches (their keys
``<backend>_splits_<n>_us``).  ``--even`` times sm90's own choice with its weighted tails off
and on, twice each in turn (``Sm90Backend.tails``; ``even_us`` / ``tail_us``, the faster of
each pair: even splits in whole waves), records the split count and tail weight of each, and
beside them 16-bit SDPA on the same shape (``sdpa_us``, ``bench_decode.sdpa_baseline``) and
the cache's bytes at the bandwidth measured in the same run (``roofline_us``).  ``--splits
""`` times no fixed count; ``--any-tail`` lifts the tail rule's length and weight limits (to
measure where it could widen).

    python3 profiles/bench_splits.py --format 4c128 --shapes 16x65536,20x32768 --splits "" \\
        --even --out profiles/h200 --tag tails_4bit

    python3 profiles/bench_splits.py --format 2c128 --shapes 16x4096,16x8192,16x16384,16x32768 \\
        --splits 1,2,0 --out profiles/h200 --tag short_2bit

writes ``<out>/splits_<tag>.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import shlex
import sys
from pathlib import Path

import torch

import bitdecode as bd
from bitdecode._files import write_record
from bitdecode._memory import release_memory
from bitdecode.cli import DTYPE_NAMES, torch_dtype

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import Timer, _graph_time, build, cache_bytes, measure_roofline, sdpa_baseline  # noqa: E402
from bench_variants import FORMATS, HKV, HQ, D, parse_shapes  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--format", default="2c128", choices=sorted(FORMATS))
    p.add_argument("--dtype", default="fp16", choices=DTYPE_NAMES, help="the model dtype (default fp16)")
    p.add_argument("--shapes", default="16x4096,16x8192,16x16384,16x32768", help="BxN,...")
    p.add_argument("--splits", default="1,2,0", help="split counts, comma-separated (0: the heuristic's)")
    p.add_argument("--backends", default="sm90", help="comma-separated decode backends (default sm90)")
    p.add_argument("--out", type=Path, default=Path("profiles/h200"))
    p.add_argument("--tag", default="", help="suffix of the output file")
    p.add_argument("--even", action="store_true",
                   help="also time sm90's choice with even splits (its weighted tails off)")
    p.add_argument("--heads", default=f"{HQ}/{HKV}", help=f"query / KV heads (default {HQ}/{HKV})")
    p.add_argument("--head-dim", type=int, default=D, help=f"head dim (default {D})")
    p.add_argument("--any-tail", action="store_true",
                   help="sm90 takes a weighted tail wherever its model gives one (the rule's length and "
                        "weight limits off): where the rule could widen, with --even")
    args = p.parse_args(argv)
    backends = [b for b in args.backends.split(",") if b]
    unknown = [b for b in backends if b not in bd.backend.shipped()]
    if unknown or not backends:
        raise SystemExit(f"--backends: unknown {unknown or args.backends!r} (shipped: {', '.join(bd.backend.shipped())})")
    try:
        hq, hkv = (int(h) for h in args.heads.split("/"))
    except ValueError:
        raise SystemExit(f"--heads: QUERY/KV head counts such as 32/8, got {args.heads!r}") from None
    if not 0 < hkv <= hq or hq % hkv:
        raise SystemExit(f"--heads: the query heads must be a positive multiple of the KV heads, got {args.heads!r}")
    d = args.head_dim
    if not torch.cuda.is_available():
        raise SystemExit("bench_splits needs a CUDA GPU")
    counts = [int(s) for s in args.splits.split(",") if s]
    if args.any_tail:
        from bitdecode.kernels_sm90 import backend as sm90_rules
        from bitdecode.layouts.sm80 import TAIL_UNIT

        # any weight above even (sixteenths: TAIL_UNIT) and any length
        sm90_rules.TAIL_MIN_TOKENS, sm90_rules.MIN_TAIL_WEIGHT = 0, TAIL_UNIT + 1
        sm90_rules.ONE_SPLIT_TAIL_MIN_TOKENS = dict.fromkeys(sm90_rules.ONE_SPLIT_TAIL_MIN_TOKENS, 0)
    dev = torch.device("cuda")
    timer, gen = Timer(dev), torch.Generator(device=dev).manual_seed(0)
    fmt = bd.KVFormat(*FORMATS[args.format])
    dtype = torch_dtype(args.dtype)
    rows = []
    roofline = measure_roofline(timer, dev) if args.even else None
    for b, n in parse_shapes(args.shapes):
        q = torch.randn(b, 1, hq, d, device=dev, dtype=dtype, generator=gen)
        cache, k, v = build(fmt, b, hkv, d, n, dev, gen, dtype)
        cache.prefill(k, v)
        del k, v
        row = {"B": b, "N": n}
        for name in backends:
            for s in counts:
                key = f"splits_{s}_us" if name == "sm90" else f"{name}_splits_{s}_us"
                t = _graph_time(timer, functools.partial(bd.decode, q, cache, num_splits=s, backend=name))
                if key in row:  # (timed again: the last time counts, every time is kept beside it)
                    row.setdefault(key[:-3] + "_runs_us", [row[key]]).append(t)
                row[key] = t
        if args.even:
            # even and tail alternate twice (E T E T) and each keeps its faster median: a
            # configuration timed first on a fresh cache measured up to ~5 % slow (the
            # capture's freed K / V, which ``captured`` waits out since the sixty-ninth
            # session; the alternation is kept so that records stay comparable)
            sm90 = bd.backend.get("sm90")
            for tails in (False, True, False, True):
                sm90.tails = tails
                try:
                    splits = sm90.choose_splits(cache.tensors(), tuple(q.shape), n, dev)
                    weight = sm90.tail_weight(cache.tensors(), tuple(q.shape), splits, n, dev)
                    tag = "tail" if tails else "even"
                    row.update({f"{tag}_splits": splits, f"{tag}_weight": weight})
                    t = _graph_time(timer, functools.partial(bd.decode, q, cache, num_splits=splits, backend="sm90"))
                    row.setdefault(f"{tag}_runs_us", []).append(t)
                    row[f"{tag}_us"] = min(row[f"{tag}_runs_us"])
                finally:
                    sm90.tails = True
            row["roofline_us"] = cache_bytes(cache) / roofline["best_bytes_per_s"] * 1e6
            row["sdpa_us"] = _graph_time(timer, sdpa_baseline(q, hkv, n, gen))
        print(json.dumps(row), flush=True)
        rows.append(row)
        del cache
        release_memory()
    result = {"command": "python3 profiles/bench_splits.py " + shlex.join(sys.argv[1:] if argv is None else argv),
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "format": args.format,
              "dtype": args.dtype, "heads": [hq, hkv], "head_dim": d, "backends": backends,
              "method": __doc__.split("\n\n")[0].replace("\n", " "), "roofline": roofline, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    write_record(args.out / f"splits{'_' + args.tag if args.tag else ''}.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
