"""``bench_decode.Timer`` with and without its slack (a spin kernel between the L2 flush
and the start event, ``SLACK_CYCLES``), side by side on the same calls in alternating
rounds: where the host enqueues a call more slowly than the flush runs, the timer without
slack counts the GPU's idle wait for the call.  Decode (Hq/Hkv 32/8, D 128, fp16, K per
channel g128) eager and replayed from a CUDA graph, and a torch add, at shapes short
enough for the host to matter (B=1 N=4K) and one where it should not (B=1 N=128K)::

    python3 profiles/timer_slack.py --out profiles/h100

writes ``<out>/timer_slack.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bitdecode as bd  # noqa: E402
from bench_decode import FORMATS, SLACK_CYCLES, Timer, _graph_time, build  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for timer_slack.json")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (a median of 30 calls each)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be positive, got {args.rounds}")
    if not torch.cuda.is_available():
        print("timer_slack needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    timers = {"slack": Timer(dev), "no_slack": Timer(dev, slack_cycles=0)}
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.zeros(1024, device=dev)
    cases = {"torch_add": lambda: x.add_(1.0)}
    keep = []
    for bits, n in (("4", 4096), ("2", 4096), ("4", 131072)):
        cache, k, v = build(FORMATS[bits], 1, 8, 128, n, dev, gen)
        cache.prefill(k, v)
        q = torch.randn(1, 1, 32, 128, device=dev, dtype=torch.float16, generator=gen)
        keep.append((cache, q))
        cases[f"bd{bits}_n{n}_eager"] = lambda c=cache, q=q: bd.decode(q, c)
        cases[f"bd{bits}_n{n}_graph"] = ("graph", lambda c=cache, q=q: bd.decode(q, c))
    rows = {name: {t: [] for t in timers} for name in cases}
    for r in range(args.rounds):
        order = list(timers.items()) if r % 2 == 0 else list(timers.items())[::-1]
        for name, case in cases.items():
            for tname, timer in order:
                if isinstance(case, tuple):
                    rows[name][tname].append(_graph_time(timer, case[1]))
                else:
                    rows[name][tname].append(timer(case))
    for name, row in rows.items():
        print(f"{name:22s} " + "  ".join(f"{t} {'/'.join(f'{v:.1f}' for v in vs)} (median {statistics.median(vs):.1f})"
                                         for t, vs in row.items()), flush=True)
    res = {"command": "python3 profiles/timer_slack.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "slack_cycles": SLACK_CYCLES,
           "method": __doc__.split("\n\n")[0].replace("\n", " "), "us": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "timer_slack.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
