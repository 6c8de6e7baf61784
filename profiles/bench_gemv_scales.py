"""The BitNet GEMV's stripe kernels with their scales loaded late (after the warps'
reduction, before the stores) and early (right after the PDL wait: ``GemvConfig.early_scales``),
beside the host's pick (and, where that is a register kernel, the same with early scales:
``host_es``), on the eight model shapes, in one run::

    python3 profiles/bench_gemv_scales.py --out profiles/h200

Any other forms of ``bench_bitnet.gemv_forms`` and shapes A/B the same way: ``--forms
bulk,bulk_x --shapes 3200x10240 --tag long_stripes`` writes ``gemv_scales_long_stripes.json``
(with ``profiles/probes/pinned/gemv_bulk_pieces_d7762cf.patch`` applied to commit d7762cf,
the forms ``bulk_x_p2`` etc. too).

First each form's bf16 outputs over three segments (and its raw int32 sums) are checked
bit-equal to the host's kernel, and the host's against the reference
(``bench_bitnet.wrong_gemv_outputs``); then each is timed as ``bench_bitnet`` times a GEMV (CUDA-graph
replay of back-to-back calls over weight copies >= 4 x L2, median of 30) in two rounds, the
second in the reverse order, so drift between them shows.  Writes ``<out>/gemv_scales.json``
(``gemv_scales_<tag>.json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path


SCALE_FORMS = ("bulk", "bulk_es", "bulk_x_late", "bulk_x")  # (``bench_bitnet.gemv_forms``)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="folder for gemv_scales.json")
    p.add_argument("--replays", type=int, default=30, help="graph replays per form and round (default 30)")
    p.add_argument("--forms", default=",".join(SCALE_FORMS),
                   help=f"comma-separated forms of bench_bitnet.gemv_forms (default {','.join(SCALE_FORMS)})")
    p.add_argument("--shapes", default=None, help="NxK,... (default: the eight BitNet model shapes)")
    p.add_argument("--tag", default="", help="file name suffix (a Python identifier)")
    args = p.parse_args(argv)
    if args.tag and not args.tag.isidentifier():
        p.error(f"--tag must be a Python identifier, got {args.tag!r}")
    from bench_bitnet import gemv_forms
    from bench_gemm_variants import parse_shapes

    known = gemv_forms()
    names = [f for f in args.forms.split(",") if f]
    if not names or any(f not in known for f in names):
        p.error(f"--forms takes names of {sorted(known)}, got {args.forms!r}")
    try:
        shapes = parse_shapes(args.shapes) if args.shapes else None
    except ValueError as e:
        p.error(str(e))
    import torch

    if not torch.cuda.is_available():
        print("bench_gemv_scales needs a CUDA GPU", file=sys.stderr)
        return 2
    from bench_bitnet import copies_for, gemv_bytes, gemv_call, graph_time_us, measure_roofline, wrong_gemv_outputs

    from bitdecode import bitnet as bn
    from bitdecode._files import write_record
    from bitdecode._memory import release_memory

    dev = torch.device("cuda", torch.cuda.current_device())
    kernels = bn.kernels_for(dev)
    if not kernels.stripe_gemv:
        print("bench_gemv_scales: the stripe kernels run on sm_90a", file=sys.stderr)
        return 2
    started = time.perf_counter()
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    roof = measure_roofline(dev, args.replays)["bytes_per_s"]
    rows = []
    for n, k in shapes or bn.MODEL_SHAPES:
        gen = torch.Generator(device=dev).manual_seed(n + k)
        packed = bn.pack_weight(torch.randint(-1, 2, (n, k), generator=gen, dtype=torch.int8, device=dev))
        copies = copies_for(packed.numel(), l2)
        packs = [packed.clone() for _ in range(copies)]
        x, xs = bn.quantize_activation(torch.randn(1, k, generator=gen, device=dev))
        ws = torch.rand(3, device=dev) + 0.5
        host = bn.gemv_config_for(dev, n, k)
        mine = {name: known[name] for name in names if runs(kernels, known[name], k)}
        if not host.bulk:  # the register kernel the host picks, with its scales early
            mine["host_es"] = dataclasses.replace(host, early_scales=True)
        ok = not wrong_gemv_outputs(x, packed, xs, mine)
        row = {"n": n, "k": k, "host": repr(host), "bit_equal": ok, "roofline_us": gemv_bytes(n, k) / roof * 1e6}
        order = [("host", host)] + list(mine.items())
        for rnd in range(2):
            for name, cfg in (order if rnd == 0 else order[::-1]):
                call = gemv_call(cfg)
                calls = [(lambda q=packs[i % copies], call=call: call(x, q, xs, ws)) for i in range(max(copies, 32))]
                row.setdefault(name + "_us", []).append(graph_time_us(calls, args.replays))
        print(f"{n:>6} x {k:<6} {'bit-equal' if ok else 'MISMATCH'} " + "  ".join(
            f"{key[:-3]} {'/'.join(f'{t:.2f}' for t in v)}" for key, v in row.items() if key.endswith("_us")
            and key != "roofline_us"), flush=True)
        rows.append(row)
        del packs
        release_memory()
    res = {"command": "python3 profiles/bench_gemv_scales.py " + " ".join(argv or sys.argv[1:]),
           "gpu": torch.cuda.get_device_name(dev), "method": __doc__, "roofline_bytes_per_s": roof, "rows": rows,
           "seconds": time.perf_counter() - started}
    args.out.mkdir(parents=True, exist_ok=True)
    write_record(args.out / f"gemv_scales{'_' + args.tag if args.tag else ''}.json", res)
    return 0 if all(r["bit_equal"] for r in rows) else 1


def runs(kernels, cfg, k: int) -> bool:
    """Whether ``kernels`` (a backend's ``bitnet``) build the form ``cfg`` at K columns:
    ``gemv_key`` refuses what they cannot (a stripe that does not fit shared memory)."""
    try:
        kernels.gemv_key(cfg, k)
    except ValueError:
        return False
    return True


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
