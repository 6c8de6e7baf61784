"""The Python share of an eager decode step's host time, measured on any CPU.

``bench_host.py`` times an eager step on a GPU host: the Python of ``bd.decode(q, cache,
k_new=, v_new=)`` plus one TVM-FFI call and one driver launch a layer.  The launch's share
is the driver's (~5 us on the H200 hosts, profiles/NOTES.md); the Python's share can be cut,
and this script measures it where no GPU is: the same call on ``L`` CPU caches whose
backend is made to say it appends, through the real ``DecodePlan`` with no-op kernel
functions, the CUDA stream and capture queries stubbed (cheaper than torch's own, so the
numbers are a floor of what the same Python costs beside a GPU).  A CPU torch ``add_`` is
timed beside it as this host's yardstick.  Rows alternate (one sample of each per round),
median of rounds.

    python3 profiles/host_python.py --out profiles/cpu
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

import bitdecode as bd
from bitdecode._files import write_record
from bitdecode.kernels_sm80 import backend as sm80_backend

STREAM = 0x7F3A_1C00_0000  # what a raw CUDA stream handle looks like


@contextlib.contextmanager
def stand_ins(splits: int):
    """The sm80 host path with no GPU under it, while the block runs: plans whose kernel
    functions are no-ops, ``splits`` splits, a constant stream, no capture."""
    def noop(*args):
        return None

    def plan(self, cache, q_shape, q_dtype, device, n, append=False, max_len=0):
        return sm80_backend.DecodePlan(cache, q_shape, q_dtype, device, n, noop, noop, append=append)

    with mock.patch.object(sm80_backend.Sm80Backend, "plan", plan), \
            mock.patch.object(sm80_backend.Sm80Backend, "choose_splits", lambda self, *args: splits), \
            mock.patch.object(torch._C, "_cuda_isCurrentStreamCapturing", lambda: False, create=True), \
            mock.patch.object(torch._C, "_cuda_getCurrentRawStream", lambda index: STREAM, create=True):
        yield


def stand_in_caches(layers: int, context: int, fmt: bd.KVFormat):
    """``layers`` CPU caches of ``context`` tokens (B=1, 8 KV heads, D 128) whose decode runs
    the sm80 host path as if on a GPU (under ``stand_ins``)."""
    gen = torch.Generator().manual_seed(0)
    caches = []
    for _ in range(layers):
        c = bd.KVCache.allocate(1, 8, 128, max_seqlen=context + 4096, fmt=fmt, dtype=torch.float16, device="cpu")
        k = torch.randn(1, context, 8, 128, generator=gen).half()
        c.prefill(k, k)
        c.backend = "sm80"  # (the reference built it; the sm80 host path runs it from here)
        c._on_cuda, c._device_index = True, 0

        def refuse(*args):
            raise RuntimeError("the step left the one-call path (a residual block completes: another --context)")

        c._append = refuse
        caches.append(c)
    return caches


def rewind(caches) -> None:
    """Undo a step's host bookkeeping, so that every timed step is the same step."""
    for c in caches:
        c._host_max -= 1
        c._host_added -= 1
        c._fuse_room += 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--context", type=int, default=200, help="tokens in each cache (within one residual block's room)")
    ap.add_argument("--splits", type=int, default=4, help="the split count the stand-in heuristic gives")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=50, help="steps (of all layers) a sample")
    ap.add_argument("--out", type=Path, default=None, help="directory for host_python.json")
    args = ap.parse_args(argv)
    if args.layers < 1 or args.rounds < 1 or args.steps < 1:
        ap.error("--layers, --rounds and --steps must be positive")
    with stand_ins(args.splits):
        row = measure(args)
    print(f"one call {row['one_call_us_per_layer']:.2f} us a layer (of it the plan {row['plan_us_per_layer']:.2f}); "
          f"a CPU torch add_ {row['torch_add_us']:.2f} us")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        result = {"torch": torch.__version__, "python": sys.version.split()[0],
                  "command": "python3 profiles/host_python.py --out profiles/cpu", "method": __doc__.strip(),
                  "row": row}
        write_record(args.out / "host_python.json", result)
    return 0


def measure(args) -> dict:
    """us a layer: the one call, its plan's share, a CPU torch add (alternating rounds)."""
    fmt = bd.KVFormat(bits=4, k_mode="channel", group_size=128)
    caches = stand_in_caches(args.layers, args.context, fmt)
    q = torch.randn(1, 1, 32, 128).half()
    kv = torch.randn(1, 1, 8, 128).half()
    x = torch.zeros(1)

    def step():
        for c in caches:
            bd.decode(q, c, k_new=kv, v_new=kv)
        rewind(caches)

    def plans():
        for c in caches:
            c._fast_append[1].append_step(q, kv, kv, 0.1, False, STREAM)

    def adds():
        for _ in caches:
            x.add_(1.0)

    forms = {"one_call_us": step, "rewind_us": lambda: rewind(caches), "plan_us": plans, "torch_add_us": adds}
    step()  # plans made, fast path entered
    samples = {name: [] for name in forms}
    for _ in range(args.rounds):
        for name, f in forms.items():
            t0 = time.perf_counter()
            for _ in range(args.steps):
                f()
            samples[name].append((time.perf_counter() - t0) * 1e6 / args.steps / args.layers)
    us = {name: statistics.median(s) for name, s in samples.items()}
    return {"one_call_us_per_layer": us["one_call_us"] - us["rewind_us"], "plan_us_per_layer": us["plan_us"],
            "torch_add_us": us["torch_add_us"], "layers": args.layers, "context": args.context,
            "splits": args.splits}


if __name__ == "__main__":
    sys.exit(main())
