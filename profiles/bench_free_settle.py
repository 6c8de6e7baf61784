"""How long freed device memory slows the kernels that follow (``bitdecode._memory.release_memory``'s
wait): a 4-bit decode (K per channel g128, fp16, B=1 N=128K, Hq/Hkv 32/8, D 128: memory-bound,
~57 us on an H100) replayed from a CUDA graph, timed again and again (each point the median of
15 calls after the timer's L2 flush) right after ``empty_cache`` gave back a buffer of each
``--gb``, beside the same right after a buffer of that size was allocated and written (new
memory) and while one is only held.  A point's ``t_s`` is the seconds since the free.

    python3 profiles/bench_free_settle.py --out profiles/h100

writes ``<out>/free_settle.json`` (``free_settle_<tag>.json`` with ``--tag``); each case's
``slow_s`` is the time of its last point more than 5 % over the steady median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import FORMATS, Timer, build  # noqa: E402

import bitdecode as bd  # noqa: E402
from bitdecode._files import write_record  # noqa: E402


def course(timer: Timer, replay, points: int) -> dict:
    """``points`` medians of ``replay`` back to back: {"t_s": seconds since the call, "us":
    the medians}, two lists of one length."""
    start, t_s, us = time.perf_counter(), [], []
    for _ in range(points):
        us.append(timer(replay, iters=15, warmup=1))  # (write_record rounds the record)
        t_s.append(time.perf_counter() - start)
    return {"t_s": t_s, "us": us}


def slow_for(points: dict, steady: float) -> float:
    """Seconds until the last point of a ``course`` more than 5 % over ``steady`` (0: none was)."""
    return max((t for t, us in zip(points["t_s"], points["us"]) if us > 1.05 * steady), default=0.0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="output folder, e.g. profiles/h100")
    p.add_argument("--tag", default="", help="suffix of the file name (an identifier)")
    p.add_argument("--gb", default="0.4,4,12,24", help="buffer sizes freed, GB, comma-separated")
    p.add_argument("--points", type=int, default=45, help="timings after each free")
    args = p.parse_args(argv)
    sizes = [float(s) for s in args.gb.split(",")]
    dev = torch.device("cuda")
    timer = Timer(dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, 1, 32, 128, device=dev, dtype=torch.float16, generator=gen)
    cache, k, v = build(FORMATS["4"], 1, 8, 128, 131072, dev, gen)
    cache.prefill(k, v)
    k = v = None
    torch.cuda.empty_cache()
    time.sleep(1)
    bd.decode(q, cache)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        bd.decode(q, cache)
    steady = statistics.median(course(timer, graph.replay, 8)["us"])
    rows = []
    for gb in sizes:
        buf = torch.empty(int(gb * 2 ** 30), dtype=torch.uint8, device=dev)
        buf.zero_()
        torch.cuda.synchronize()
        time.sleep(1)
        held = course(timer, graph.replay, 4)
        buf = None
        torch.cuda.empty_cache()
        freed = course(timer, graph.replay, args.points)
        time.sleep(2)
        buf = torch.empty(int(gb * 2 ** 30), dtype=torch.uint8, device=dev)
        buf.zero_()
        torch.cuda.synchronize()
        fresh = course(timer, graph.replay, 8)
        buf = None
        torch.cuda.empty_cache()
        time.sleep(2)
        row = {"gb": gb, "slow_s": slow_for(freed, steady), "held": held, "freed": freed, "new_memory": fresh,
               "slow_s_new_memory": slow_for(fresh, steady)}
        print(json.dumps({k: row[k] for k in ("gb", "slow_s", "slow_s_new_memory")}), flush=True)
        rows.append(row)
    result = {"command": "python3 profiles/bench_free_settle.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "steady_us": steady,
              "method": __doc__.split("\n\n")[0].replace("\n", " "), "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"free_settle_{args.tag}.json" if args.tag else "free_settle.json"
    write_record(args.out / name, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
