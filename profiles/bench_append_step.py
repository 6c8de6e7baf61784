"""GPU time of an eager decode step at long contexts: ``append`` + ``decode`` (two calls:
the pack kernel's launch, the decode's, the combine's when split) against the one call
``decode(q, cache, k_new=, v_new=)`` (one launch: the decode kernel appends the token and
its last CTA of each (sequence, KV head) merges the splits).  The merge is serial work of
one CTA per KV head, so its cost grows with the splits; this is what
``append_max_splits`` (kernels_sm80/backend.py) was set from (before the limit; past it the
one call now takes the two calls, so its column matches theirs there).  B=1, 4-bit
(``--bits``), bf16 (``--dtype``), GQA 4 (32 / 8 heads, ``--kv-heads``; head dim 128), every
kernel backend this GPU runs that appends; CUDA events around 60 back-to-back steps (the
cache truncated back after each round), median of five rounds.  At 32K tokens the packed
cache (~33 MB) fits the H200's L2; at 128K it does not.

    python3 profiles/bench_append_step.py --out profiles/h200
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

import bitdecode as bd
from bitdecode import backend as backends, dispatch
from bitdecode._files import write_record
from bitdecode._memory import release_memory
from bitdecode.cli import DTYPE_NAMES, torch_dtype

STEPS = 60  # inside one residual block (the cache starts at a block boundary)


def time_forms(c, q, kv) -> dict:
    """GPU us a step of both forms over cache ``c`` (left as it was)."""
    def two():
        c.append(kv, kv)
        bd.decode(q, c)

    def one():
        bd.decode(q, c, k_new=kv, v_new=kv)

    res = {}
    for name, fn in (("append+decode", two), ("one_call", one)):
        for _ in range(3):
            fn()
        c.truncate(3)
        times = []
        for _ in range(5):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            s.record()
            for _ in range(STEPS):
                fn()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) * 1e3 / STEPS)
            c.truncate(STEPS)
        res[name] = round(statistics.median(times), 2)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("profiles/h200"), help="output folder (append_step_gpu.json)")
    p.add_argument("--bits", type=int, choices=(4, 2), default=4, help="the cache's K and V bits (default 4)")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="bf16", help="q's and the cache's dtype (default bf16)")
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads, four query heads each (default 8)")
    p.add_argument("--tag", default="", help="write append_step_gpu_<tag>.json instead (an identifier)")
    p.add_argument("--append-max-splits", type=int, metavar="S",
                   help="every appending backend's append_max_splits for this run (the one call merges up to S "
                        "splits in its last CTA; past them it takes the two calls)")
    args = p.parse_args(argv)
    if args.tag and not args.tag.isidentifier():
        p.error(f"--tag must be an identifier, got {args.tag!r}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_append_step needs a CUDA GPU")
    dev = torch.device("cuda")
    names = [n for n in reversed(backends.shipped()) if dispatch.runnable(n, dev) and backends.get(n).appends]
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "command": " ".join(["python3 profiles/bench_append_step.py", *(sys.argv[1:] if argv is None else argv)])}
    if args.append_max_splits is not None:
        out["append_max_splits"] = args.append_max_splits
        for name in names:
            backends.get(name).append_max_splits = args.append_max_splits
    dtype = torch_dtype(args.dtype)
    out["format"], out["dtype"] = str(bd.KVFormat(bits=args.bits)), args.dtype
    hkv = out["kv_heads"] = args.kv_heads
    for backend in names:
        for n in (32768, 131072):
            c = bd.KVCache.allocate(1, hkv, 128, n + 256, bd.KVFormat(bits=args.bits), dtype=dtype, device="cuda",
                                    backend=backend)
            k = torch.randn(1, n, hkv, 128, device="cuda", dtype=dtype)
            c.prefill(k, k)
            del k
            q = torch.randn(1, 1, 4 * hkv, 128, device="cuda", dtype=dtype)
            kv = torch.randn(1, 1, hkv, 128, device="cuda", dtype=dtype)
            res = time_forms(c, q, kv)
            kernels = backends.get(backend)
            res["splits"] = kernels.choose_splits(c.tensors(), tuple(q.shape), n, q.device)
            res["merged_in_kernel"] = 1 < res["splits"] <= kernels.append_max_splits
            out[f"{backend}_b1_{n}"] = res
            print(backend, n, res, flush=True)
            del c
            release_memory()
    args.out.mkdir(parents=True, exist_ok=True)
    write_record(args.out / (f"append_step_gpu_{args.tag}.json" if args.tag else "append_step_gpu.json"), out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
