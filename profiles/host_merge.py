"""Host time of an eager plain decode step with and without the combine launch: sm90,
B=1, 32 / 8 heads, head dim 128, 1024 tokens (a split decode), one cache a layer, 32
layers; each round holds the GPU busy (~10 ms of ``torch.cuda._sleep``) and times the
host's 32 ``bd.decode`` calls (the host never waits for the GPU), median of 30 rounds.
``--merge on`` builds the kernels with ``merge_splits`` (the last CTA merges the splits:
one launch a call), ``off`` without (the decode, then the combine kernel); each setting is
one process.  Prints one JSON line.

    python3 profiles/host_merge.py --merge off; python3 profiles/host_merge.py --merge on
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import bitdecode as bd

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_variants import apply_keywords  # noqa: E402

LAYERS = 32


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--merge", choices=("off", "on"), required=True, help="merge_splits in every sm90 decode kernel")
    p.add_argument("--bits", type=int, choices=(4, 2), default=4, help="the cache's bits (4: bf16, 2: fp16)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("host_merge needs a CUDA GPU")
    apply_keywords({"merge_splits": args.merge == "on"})  # (every sm90 decode kernel this process builds)
    fmt = bd.KVFormat(bits=args.bits)
    dtype = torch.bfloat16 if args.bits == 4 else torch.float16
    caches = []
    for _ in range(LAYERS):
        c = bd.KVCache.allocate(1, 8, 128, 2048, fmt, dtype=dtype, device="cuda", backend="sm90")
        k = torch.randn(1, 1024, 8, 128, device="cuda", dtype=dtype)
        c.prefill(k, k)
        caches.append(c)
    q = torch.randn(1, 1, 32, 128, device="cuda", dtype=dtype)
    for _ in range(5):
        for c in caches:
            bd.decode(q, c)
    torch.cuda.synchronize()
    times = []
    for _ in range(30):
        torch.cuda._sleep(20_000_000)
        t0 = time.perf_counter()
        for c in caches:
            bd.decode(q, c)
        times.append((time.perf_counter() - t0) * 1e6 / LAYERS)
        torch.cuda.synchronize()
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "merge": args.merge, "bits": args.bits,
                      "merged_plan": any(getattr(p, "merged", False) for p in caches[0]._plans.values()),
                      "host_us_per_layer_median": round(statistics.median(times), 2),
                      "quartiles": [round(x, 2) for x in statistics.quantiles(times, n=4)]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
