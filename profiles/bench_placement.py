"""Whether a decode's time depends on the allocation it reads: one cache (a format, B x N,
Hq/Hkv 32/8, D 128, data from one seed) allocated afresh ``--allocs`` times in one process,
each allocation's decode graph-replayed and timed ``--repeats`` times (each time the median
of 30 calls after the timer's clean L2 flush), the memory given back and waited out
(``release_memory``) between allocations.

    python3 profiles/bench_placement.py --format k4v2c128 --shape 16x65536 --out profiles/h100

writes ``<out>/placement.json`` (``placement_<tag>.json`` with ``--tag``).  Asked by the
sixty-eighth session (profiles/NOTES.md): K4V2 fp16 B=16 N=64K took ~300 us in some
processes of ``bench_variants.py`` and ~346 in others on one H100, the same launch each time.
If the allocations differ and the repeats of one allocation agree, the time follows where
the cache lies, not the kernel; ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` in the
environment maps the memory another way, for a second run.  Each row keeps the cache's
first virtual address (the allocator's segment: a reused one repeats it).  The answer (H100,
sixty-ninth session): neither; each allocation's first repeat was slow (355.5-358.6 against
304.8-306.3 us) because the graph capture gave the prefill's freed 16-bit K / V back to the
driver, which ``bitnet_tune.captured`` now waits out (296.0-298.7 us, within 0.6 %).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import Timer, _graph_time  # noqa: E402
from bench_variants import FORMATS, parse_shapes, prefilled_case  # noqa: E402

from bitdecode._files import write_record  # noqa: E402
from bitdecode.cli import DTYPE_NAMES, torch_dtype  # noqa: E402


def spread(values) -> float:
    """(largest - smallest) / smallest of ``values``."""
    return (max(values) - min(values)) / min(values)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--format", default="k4v2c128", choices=sorted(FORMATS), help="the cache's format")
    p.add_argument("--dtype", default="fp16", choices=sorted(DTYPE_NAMES), help="q's and the residual's dtype")
    p.add_argument("--shape", default="16x65536", help="BxN (default 16x65536)")
    p.add_argument("--allocs", type=int, default=6, help="fresh allocations of the cache (default 6)")
    p.add_argument("--repeats", type=int, default=3, help="timings of each allocation (default 3)")
    p.add_argument("--backend", default="auto", choices=("auto", "sm90", "sm80"),
                   help="the decode's backend (default auto)")
    p.add_argument("--out", type=Path, default=None, help="write <out>/placement.json")
    p.add_argument("--tag", default="", help="write <out>/placement_<tag>.json instead (an identifier)")
    args = p.parse_args(argv)
    try:
        shapes = parse_shapes(args.shape)
    except ValueError:
        shapes = []
    if len(shapes) != 1:
        p.error(f"--shape must be one BxN with positive integers, got {args.shape!r}")
    (b, n), = shapes
    if args.allocs < 1 or args.repeats < 1:
        p.error(f"--allocs and --repeats must be positive, got {args.allocs} and {args.repeats}")
    if args.tag and not args.tag.isidentifier():
        p.error(f"--tag must be an identifier, got {args.tag!r}")
    import torch

    import bitdecode as bd
    from bitdecode._memory import release_memory

    if not torch.cuda.is_available():
        print("bench_placement needs a CUDA GPU", file=sys.stderr)
        return 2
    dev, dtype = torch.device("cuda"), torch_dtype(args.dtype)
    fmt = bd.KVFormat(*FORMATS[args.format])
    timer = Timer(dev)
    rows = []
    for alloc in range(args.allocs):
        gen = torch.Generator(device=dev).manual_seed(0)  # (the same data in every allocation)
        q, cache = prefilled_case(fmt, dtype, b, n, dev, gen)
        decode = functools.partial(bd.decode, q, cache, backend=args.backend)
        us = [_graph_time(timer, decode) for _ in range(args.repeats)]
        row = {"alloc": alloc, "us": us, "k_pack_address": cache.k_pack.data_ptr(),
               "v_pack_address": cache.v_pack.data_ptr()}
        print(json.dumps(row), flush=True)
        rows.append(row)
        del cache, decode, q
        release_memory()
    medians = [statistics.median(r["us"]) for r in rows]
    within = max(spread(r["us"]) for r in rows)
    print(f"{args.format} {args.dtype} B={b} N={n}: allocations {min(medians):.1f}-{max(medians):.1f} us "
          f"(spread {spread(medians):.1%}), within one allocation at most {within:.1%}")
    if args.out is not None:
        command = "python3 profiles/bench_placement.py " + " ".join(sys.argv[1:] if argv is None else argv)
        result = {"command": command, "gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                  "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
                  "method": __doc__.split("\n\n")[0].replace("\n", " "), "format": args.format,
                  "dtype": args.dtype, "B": b, "N": n, "spread_between": spread(medians),
                  "spread_within": within, "rows": rows}
        args.out.mkdir(parents=True, exist_ok=True)
        write_record(args.out / (f"placement_{args.tag}.json" if args.tag else "placement.json"), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
