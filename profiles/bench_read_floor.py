"""What streaming the BitNet GEMVs' weight bytes costs torch's own kernels, timed the way
``bitdecode bench bitnet`` times the GEMVs (CUDA-graph replay of >= 32 back-to-back calls,
buffers rotated over >= 4 x L2, median): a fp32 sum reading the bytes, and a copy reading
and writing them, each as a fraction of the same roofline (bytes moved / time / the best of
a 1 GiB copy's and sum's bandwidth).  Issue 13 holds the GEMV to 0.70 of that roofline on
its three largest shapes (16.4, 8.9 and 8.2 MB of packed weights); this says what a plain
stream of those byte counts reaches on the same GPU.

    python3 profiles/bench_read_floor.py --out profiles/h200
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_bitnet import MIN_CALLS, SHAPES, copies_for, gemv_bytes, graph_time_us, measure_roofline  # noqa: E402

from bitdecode._files import write_record  # noqa: E402

# the bytes of the four largest GEMVs of the model and of its smallest (16.4 MB .. 1.6 MB)
_BY_SIZE = sorted((gemv_bytes(n, k) for n, k in SHAPES), reverse=True)
SIZES = tuple(_BY_SIZE[:4] + _BY_SIZE[-1:])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("profiles/h200"), help="output folder (read_floor.json)")
    p.add_argument("--replays", type=int, default=30)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_read_floor needs a CUDA GPU")
    dev = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    roof = measure_roofline(dev, args.replays)["bytes_per_s"]
    rows = []
    for nbytes in SIZES:
        n = copies_for(nbytes, l2)
        bufs = [torch.ones(nbytes // 4, dtype=torch.float32, device=dev) for _ in range(n)]
        reps = max(1, math.ceil(MIN_CALLS / n))
        t_sum = graph_time_us([(lambda b=b: b.sum()) for b in bufs] * reps, args.replays)
        out = torch.empty(nbytes // 4, dtype=torch.float32, device=dev)
        t_copy = graph_time_us([(lambda b=b, out=out: out.copy_(b)) for b in bufs] * reps, args.replays)
        rows.append({"bytes": nbytes, "sum_us": t_sum, "sum_roofline_frac": nbytes / (t_sum * 1e-6) / roof,
                     "copy_us": t_copy, "copy_roofline_frac": 2 * nbytes / (t_copy * 1e-6) / roof})
        print(f"{nbytes / 1e6:6.2f} MB: sum {t_sum:6.2f} us ({rows[-1]['sum_roofline_frac']:.2f}), "
              f"copy {t_copy:6.2f} us ({rows[-1]['copy_roofline_frac']:.2f} of the roofline, read + write)")
        del bufs, out
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "command": " ".join(["python3 profiles/bench_read_floor.py", *(sys.argv[1:] if argv is None else argv)]),
              "method": __doc__.strip().split("\n\n")[0].replace("\n", " "), "roofline_bytes_per_s": roof, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    write_record(args.out / "read_floor.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
