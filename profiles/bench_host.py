"""Host overhead of an eager decode step: ``cache.append`` + ``bd.decode`` per layer.

A model's decode step calls, for each of its layers, one append of the new token and one
decode over that layer's cache.  Eagerly, the step costs at least the Python and launch
time of those calls; this measures it per layer: ``L`` caches (layers) of a small context,
one step over all of them timed on the host while the GPU is held busy by a spin kernel
queued first (``torch.cuda._sleep``), so the host never waits for the GPU and what is timed
is the host's own work (the step's launches stay far below the launch queue's depth).  The
host behind a lent GPU changes speed between calls and within one, so the host samples of
every configuration and form are taken in interleaved rounds (one step of each per round)
and each row reports their median and quartiles.  The host's yardstick is a torch add's
launch (one a layer) timed the same way in the same rounds (``host_in_torch_adds`` divides by
it: both in the state of a host that has just waited), and in a loop before and after
(``host_reference``).  Beside it, the GPU time of the same steps run back to back
(CUDA events) and the wall time of that back-to-back loop per layer: when the GPU time is
the larger, an eager step at this context is GPU-bound and the host time is hidden.  Each
step is timed two ways: ``append`` + ``decode`` (two calls), and ``decode(q, cache,
k_new=, v_new=)`` (one call: on the sm80 and sm90 kernels one launch, the decode kernel
appending the token itself while no block completes and merging its splits in its last
CTA).  Issue 10's target: host time <= 15 us per layer per step.

    python3 profiles/bench_host.py --out profiles/h200
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import bitdecode as bd
from bitdecode import backend as backends, dispatch
from bitdecode._files import write_record
from bitdecode.cli import csv_list

TARGET_US = 15.0
# ~5 ms at the H200's ~1.8 GHz: longer than any host loop timed here (32 layers x ~30 us)
SPIN_CYCLES = 10_000_000


def torch_adds(n: int):
    """A function launching ``n`` small in-place torch adds (one launch each): the host's
    yardstick, timed beside the step's host time."""
    x = torch.zeros(1024, device="cuda")

    def adds():
        for _ in range(n):
            x.add_(1.0)

    return adds


def add_cache_arguments(p: argparse.ArgumentParser) -> None:
    """The options of the timed caches every host script shares: layers and context."""
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--context", type=int, default=1024, help="tokens per sequence in each layer's cache")


def host_reference(calls: int = 200) -> dict:
    """Host time per call of two torch operations on this host (no sync in the timed loop,
    median of 7): an allocation and a small in-place add (one launch).  The host behind a
    lent GPU changes between sessions (an allocation took 2.4 us on one, 8.7 on another),
    so the per-layer numbers compare across runs only relative to these."""
    ops = {"torch_empty_us": lambda: torch.empty(1, 1, 32, 128, dtype=torch.bfloat16, device="cuda"),
           "torch_add_launch_us": torch_adds(1)}
    out = {}
    for name, op in ops.items():
        times = []
        for _ in range(7):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                op()
            times.append((time.perf_counter() - t0) * 1e6 / calls)
        torch.cuda.synchronize()
        out[name] = statistics.median(times)
    return out


FORMS = ("", "fused_")  # append + decode; decode(k_new=, v_new=)
HKV, HQ, D = 8, 32, 128  # a Llama-3-8B layer's attention


def make_caches(backend: str, bits: int, batch: int, layers: int, context: int, tokens: int) -> list:
    """``layers`` bf16 caches of ``context`` random tokens a sequence with room for
    ``tokens`` more."""
    caches = []
    for _ in range(layers):
        c = bd.KVCache.allocate(batch, HKV, D, context + tokens, bd.KVFormat(bits=bits), dtype=torch.bfloat16,
                                device="cuda", backend=backend)
        k = torch.randn(batch, context, HKV, D, device="cuda", dtype=torch.bfloat16)
        c.prefill(k, k)
        caches.append(c)
    return caches


def build(backend: str, bits: int, batch: int, layers: int, context: int, tokens: int) -> dict:
    """``layers`` caches of ``context`` tokens with room for ``tokens`` more, and the two
    forms of one eager step over them: ``cache.append`` + ``bd.decode`` (two calls), and
    ``bd.decode(q, cache, k_new=, v_new=)`` (one call)."""
    caches = make_caches(backend, bits, batch, layers, context, tokens)
    q = torch.randn(batch, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(batch, 1, HKV, D, device="cuda", dtype=torch.bfloat16)

    def two_calls():
        for c in caches:
            c.append(kv, kv)
            bd.decode(q, c)

    def one_call():
        for c in caches:
            bd.decode(q, c, k_new=kv, v_new=kv)

    return {"backend": backend, "bits": bits, "batch": batch, "layers": layers, "context": context,
            "steps": dict(zip(FORMS, (two_calls, one_call)))}


def host_once(step, layers: int) -> float:
    """Host microseconds per layer of one ``step`` while a spin kernel holds the GPU."""
    torch.cuda._sleep(SPIN_CYCLES)  # the GPU stays busy past the timed host loop
    t0 = time.perf_counter()
    step()
    us = (time.perf_counter() - t0) * 1e6 / layers
    torch.cuda.synchronize()
    return us


def device_times(step, layers: int, steps: int):
    """(GPU, loop) microseconds per layer of ``steps`` back-to-back ``step`` calls (median
    of five)."""
    loop, gpu = [], []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        t1 = time.perf_counter()
        end.record()
        end.synchronize()
        loop.append((t1 - t0) * 1e6 / (steps * layers))
        gpu.append(start.elapsed_time(end) * 1e3 / (steps * layers))
    return statistics.median(gpu), statistics.median(loop)


def measure_all(configs: list, layers: int, steps: int, repeats: int):
    """One row per configuration: the host time of both forms from ``repeats`` interleaved
    rounds (median and quartiles), then their GPU and loop times; and the yardstick's
    samples from the same rounds (``layers`` torch adds, each one launch)."""
    adds = torch_adds(layers)
    for cfg in configs:
        for step in cfg["steps"].values():
            for _ in range(3):  # compile / plan / fast-path warm-up
                step()
    torch.cuda.synchronize()
    samples = {(i, form): [] for i in range(len(configs)) for form in FORMS}
    yardstick = []
    for _ in range(repeats):
        yardstick.append(host_once(adds, layers))
        for i, cfg in enumerate(configs):
            for form, step in cfg["steps"].items():
                samples[i, form].append(host_once(step, layers))
    rows = []
    for i, cfg in enumerate(configs):
        row = {k: v for k, v in cfg.items() if k != "steps"}
        row["target_us"] = TARGET_US
        for form, step in cfg["steps"].items():
            q1, host, q3 = statistics.quantiles(samples[i, form], n=4)
            gpu, loop = device_times(step, layers, steps)
            row.update({f"{form}host_us_per_layer": host, f"{form}host_quartiles_us": [q1, q3],
                        f"{form}gpu_us_per_layer": gpu, f"{form}loop_us_per_layer": loop,
                        f"{form}meets_target": host <= TARGET_US})
        rows.append(row)
    return rows, yardstick


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("profiles/h200"), help="output folder (host_overhead.json)")
    add_cache_arguments(p)
    p.add_argument("--steps", type=int, default=8, help="back-to-back steps of the GPU / loop timing")
    p.add_argument("--repeats", type=int, default=21, help="host-timed steps (median)")
    p.add_argument("--backends", type=csv_list(str, backends.shipped()), default=None,
                   help="comma-separated kernel backends (default: every one this GPU runs)")
    p.add_argument("--bits", type=csv_list(int, (4, 2)), default=[4, 2], help="comma-separated, of 4 and 2")
    p.add_argument("--batches", type=csv_list(int), default=[1, 16], help="comma-separated batch sizes")
    args = p.parse_args(argv)
    if any(b < 1 for b in args.batches):
        p.error(f"--batches takes positive sizes, got {args.batches}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_host needs a CUDA GPU")
    dev = torch.device("cuda")
    names = [n for n in reversed(backends.shipped()) if dispatch.runnable(n, dev)
             and (args.backends is None or n in args.backends)]
    reference = {"before": host_reference()}
    tokens = 2 * (3 + args.repeats + 5 * args.steps) + 16  # what the timings append
    configs = [build(name, bits, batch, args.layers, args.context, tokens)
               for name in names for bits in args.bits for batch in args.batches]
    rows, yardstick = measure_all(configs, args.layers, args.steps, args.repeats)
    reference["after"] = host_reference()
    q1, add, q3 = statistics.quantiles(yardstick, n=4)
    for row in rows:
        for form in FORMS:
            row[f"{form}host_in_torch_adds"] = row[f"{form}host_us_per_layer"] / add
        print(f"{row['backend']} {row['bits']}-bit B={row['batch']}: host {row['host_us_per_layer']:.1f} us/layer "
              f"(quartiles {row['host_quartiles_us'][0]:.1f}-{row['host_quartiles_us'][1]:.1f}), "
              f"GPU {row['gpu_us_per_layer']:.1f}, loop {row['loop_us_per_layer']:.1f}; "
              f"decode(k_new=, v_new=): host {row['fused_host_us_per_layer']:.1f} "
              f"({row['fused_host_quartiles_us'][0]:.1f}-{row['fused_host_quartiles_us'][1]:.1f}), "
              f"GPU {row['fused_gpu_us_per_layer']:.1f}, loop {row['fused_loop_us_per_layer']:.1f}")
    print(f"this host: a torch add's launch {add:.1f} us after a spin (quartiles {q1:.1f}-{q3:.1f}); in a loop "
          + ", ".join(f"{when}: " + ", ".join(f"{k} {v:.1f}" for k, v in ref.items()) for when, ref in reference.items()))
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "host_reference": reference,
              "torch_add_after_spin_us": add, "torch_add_after_spin_quartiles_us": [q1, q3],
              "command": " ".join(["python3 profiles/bench_host.py", *(sys.argv[1:] if argv is None else argv)]),
              "method": __doc__.strip().split("\n\n")[1].replace("\n", " "), "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    write_record(args.out / "host_overhead.json", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
