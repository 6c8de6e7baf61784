"""The BitNet GEMV's configurations side by side over (N, K) shapes beyond the model's eight,
to find where one kernel overtakes another (e.g. the stripe kernel, ``pdl_bulk_us``, against
the register kernel the host picks), in one run::

    python3 profiles/bench_gemv_sweep.py --shapes 8448x2560,13824x2560,16896x2560 --out profiles/h200

writes ``<out>/gemv_sweep.json`` (``gemv_sweep_<tag>.json`` with ``--tag``): per shape the
host's configuration and its time, every other configuration's time (the columns of
``bench_bitnet``'s GEMV rows: CUDA-graph replay of back-to-back calls, weights rotated over
>= 4x L2, median), bf16 cuBLAS and the HBM roofline measured in the same run, the
shape's stripes (16-row CTAs) per SM, and ``wrong_outputs``: the configurations whose output
was wrong (three fused segments, bf16 and raw sums: the host's against the reference, every
other against the host's, bit for bit; ``bench_bitnet.wrong_gemv_outputs``).  A wrong
output is printed and the run exits 1.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bench_bitnet import bench_gemv, gemv_variants, measure_roofline
from bench_gemm_variants import parse_shapes

from bitdecode.bitnet_tune import entries, gpu_key
from bitdecode._files import write_record


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", required=True, help="NxK,... (N a multiple of 16, K of 128)")
    p.add_argument("--out", required=True, type=Path, help="folder for gemv_sweep[_TAG].json")
    p.add_argument("--tag", default="", help="file name suffix (a Python identifier)")
    p.add_argument("--replays", type=int, default=30, help="graph replays per configuration (default 30)")
    args = p.parse_args(argv)
    if args.tag and not args.tag.isidentifier():
        p.error(f"--tag must be a Python identifier, got {args.tag!r}")
    try:
        shapes = parse_shapes(args.shapes)  # (the GEMM A/B's: NxK on the packed format's tiles)
    except ValueError as e:
        p.error(str(e))
    if not shapes:
        p.error("--shapes: no shape given")
    import torch

    if not torch.cuda.is_available():
        print("bench_gemv_sweep needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    props = torch.cuda.get_device_properties(device)
    started = time.perf_counter()
    roofline = measure_roofline(device, args.replays)
    variants = gemv_variants(device)
    rows = []
    for n, k in shapes:
        row = bench_gemv(n, k, device, props.L2_cache_size, args.replays, roofline["bytes_per_s"], variants)
        row["stripes_per_sm"] = n / 16 / props.multi_processor_count
        others = {name: us for name, us in row.items() if name.endswith("_us") and name != "bf16_us"}
        best = min(others.items(), key=lambda kv: kv[1], default=(None, None))
        print(f"{n:>6} x {k:<6} {row['stripes_per_sm']:5.2f} stripes/SM  host {row['us']:6.2f} us  "
              f"best other {best[0]} {best[1] if best[1] is None else round(best[1], 2)}  "
              f"bulk {row.get('pdl_bulk_us', float('nan')):6.2f}  bulk_x {row.get('pdl_bulk_x_us', float('nan')):6.2f}",
              flush=True)
        for name in row["wrong_outputs"]:
            print(f"WRONG OUTPUT: {n} x {k} {name}", file=sys.stderr, flush=True)
        rows.append(row)
    name = f"gemv_sweep_{args.tag}.json" if args.tag else "gemv_sweep.json"
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "command": " ".join(["python3 profiles/bench_gemv_sweep.py", f"--shapes {args.shapes}", f"--out {args.out}",
                             *([f"--tag {args.tag}"] if args.tag else []),
                             *([f"--replays {args.replays}"] if args.replays != 30 else [])]),
        "device": props.name,
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "method": "CUDA-graph replay of back-to-back calls, weights rotated over >= 4x L2, median",
        "gemv_tuning": entries(gpu_key(device)),  # (measured picks in effect: the host column's; empty: the rule's)
        "roofline": roofline,
        "rows": rows,
        "seconds": time.perf_counter() - started,
    }
    write_record(args.out / name, result)
    print(f"results in {args.out / name}")
    return 1 if any(row["wrong_outputs"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
