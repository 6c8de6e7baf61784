"""The pieces of an eager decode step's host time (issue 10), each timed in two host states.

``bench_host.py`` times one step of ``L`` layers right after the host waited ~5 ms for a
spin kernel (``after_spin``): the host's own work, never throttled by the GPU, but taken
from a host that has just idled.  Here every piece is also timed in a steady loop
(``loop``: eight steps back to back from an idle GPU; ``L`` x 8 launches stay far below the
launch queue's depth, so the host never waits for the GPU there either).  The pieces, per
layer (one cache each, ``bench_host``'s shapes: B=1, 32 / 8 heads, D=128, bf16, 1024
tokens, 4-bit): torch's own yardsticks (an in-place add: one launch; an empty tensor: no
launch), the raw TVM-FFI calls of the decode plan's kernels with its bound arguments (q and
the output as torch tensors, or pre-converted), the plan's call, ``bd.decode``,
``cache.append`` and the one-call step ``bd.decode(q, cache, k_new=, v_new=)``.

    python3 profiles/host_parts.py --out profiles/h200
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import bitdecode as bd
from bitdecode import attention, dispatch
from bitdecode._files import write_record
from bitdecode import backend as backends
from bitdecode.cli import csv_list

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_host import HKV, HQ, D, add_cache_arguments, host_once, make_caches, torch_adds  # noqa: E402

ROOM = 8192  # tokens each cache can still take: what the appending pieces add, with margin
APPENDING = ("append", "decode_kv")


def pieces(caches):
    """(the decode plan's split count, {name: a function running that piece once per layer})."""
    import tvm_ffi

    from bitdecode.layouts.sm80 import TAIL_UNIT

    q = torch.randn(1, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(1, 1, HKV, D, device="cuda", dtype=torch.bfloat16)
    for c in caches:
        bd.decode(q, c)  # builds each cache's decode plan
    plans = [next(p for key, p in c._plans.items() if "append" not in key) for c in caches]
    scale_log2 = attention.softmax_scale_or_default(None, q.shape[-1]) * attention.LOG2_E
    outs = [torch.empty(p.q_shape, dtype=p.dtype, device="cuda") for p in plans]
    stream = torch.cuda.current_stream().cuda_stream
    works = [p._take(stream)[1] for p in plans]

    def raw(qq, oo):
        def run():
            for p, o, w in zip(plans, oo, works):
                if w is None:
                    p.decode_fn(qq, *p.static, o, p.unused_lse, scale_log2, TAIL_UNIT)
                else:
                    p.decode_fn(qq, *p.static, w[0], w[1], scale_log2, p.tail_weight)
                    p.combine_fn(w[0], w[1], o, p.unused_lse)
        return run

    ffi_q, ffi_outs = tvm_ffi.from_dlpack(q), [tvm_ffi.from_dlpack(o) for o in outs]
    return plans[0].splits, {
        "torch_add": torch_adds(len(caches)),
        "torch_empty": lambda: [torch.empty(1, 1, HQ, D, dtype=torch.bfloat16, device="cuda") for _ in caches],
        "raw_kernels_torch_args": raw(q, outs),
        "raw_kernels_ffi_args": raw(ffi_q, ffi_outs),
        "plan_call": lambda: [p(q, scale_log2, False) for p in plans],
        "decode": lambda: [bd.decode(q, c) for c in caches],
        "append": lambda: [c.append(kv, kv) for c in caches],
        "decode_kv": lambda: [bd.decode(q, c, k_new=kv, v_new=kv) for c in caches],
    }


def measure(fns: dict, layers: int, repeats: int, loops: int) -> dict:
    """Per piece: the median (and quartiles) of ``repeats`` single runs after a spin
    kernel's wait, interleaved over the pieces, and the median of ``loops`` runs of eight
    back to back."""
    for f in fns.values():
        f(), f()
    torch.cuda.synchronize()
    spin = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            spin[k].append(host_once(f, layers))
    loop = {k: [] for k in fns}
    for _ in range(loops):
        for k, f in fns.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(8):
                f()
            loop[k].append((time.perf_counter() - t0) * 1e6 / (8 * layers))
    torch.cuda.synchronize()
    return {k: {"after_spin_us": statistics.median(v), "after_spin_quartiles_us": statistics.quantiles(v, n=4)[::2],
                "loop_us": statistics.median(loop[k]), "loop_min_us": min(loop[k])} for k, v in spin.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="output folder (host_parts.json)")
    add_cache_arguments(p)
    p.add_argument("--repeats", type=int, default=41, help="single runs after a spin (median)")
    p.add_argument("--loops", type=int, default=9, help="runs of eight back to back (median)")
    p.add_argument("--backends", type=csv_list(str, backends.shipped()), default=None,
                   help="comma-separated kernel backends (default: every one this GPU runs that appends)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("host_parts needs a CUDA GPU")
    if (2 + args.repeats + 8 * args.loops) * len(APPENDING) > ROOM:
        p.error(f"--repeats and --loops append more than the caches' room of {ROOM} tokens")
    dev = torch.device("cuda")
    names = [n for n in reversed(backends.shipped()) if dispatch.runnable(n, dev) and backends.get(n).appends
             and (args.backends is None or n in args.backends)]
    rows = []
    for name in names:
        splits, fns = pieces(make_caches(name, 4, 1, args.layers, args.context, ROOM))
        row = {"backend": name, "splits": splits, "pieces": measure(fns, args.layers, args.repeats, args.loops)}
        rows.append(row)
        for k, v in row["pieces"].items():
            print(f"{name} {k:24s} after a spin {v['after_spin_us']:6.2f} us/layer, in a loop {v['loop_us']:6.2f}")
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "command": " ".join(["python3 profiles/host_parts.py", *(sys.argv[1:] if argv is None else argv)]),
              "method": __doc__.strip().split("\n\n")[1].replace("\n", " "), "layers": args.layers,
              "context": args.context, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    write_record(args.out / "host_parts.json", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
