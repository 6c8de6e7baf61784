"""What a bare TMA ring streams on this GPU (``kernels_sm90.ring_probe``), against the HBM
read rate measured in the same run: how many bytes in flight an SM needs to read at
the rate, with nothing of the decode around the ring.

The sm90 decode's ring alone reads 4-bit B=16 N=64K (16.5 KB tiles, four stages, two
CTAs an SM) at 0.98 of the H100's read rate and 0.88 of the H200's, 2-bit (8.6 KB tiles,
six stages) at 0.77-0.79 on both (profiles/NOTES.md).  This sweep says whether a plain
ring of those sizes does the same: if it does, the decode needs more bytes in flight an
SM; if it reads at the rate, the loss is in the decode's ring itself.  On the H200
(fifty-fourth session) it reads at 1.03 of the rate from 48 KB in flight an SM, where the
decode's ring alone reads 4-bit B=16 N=64K at ~0.86: ``--apart`` then takes each tile's
copies from separate regions, as the decode's stage gathers four tensors.

Each configuration (tile bytes, bulk copies a tile, stages, CTAs an SM) is one launch of
one wave (CTAs = CTAs an SM x SMs, each streaming its own contiguous run of tiles) over
``--gib`` GiB (well above L2, so nothing is served from it), timed between CUDA events,
median of ``--replays`` after a warm-up; each configuration's consumer sums are checked
against torch's once, so no time comes from a ring that read the wrong bytes.  The read
rate is ``measure_roofline``'s (a 1 GiB fp32 sum, and the best of it and a copy).

    python3 profiles/bench_ring.py --out profiles/h200

writes ``<out>/ring_probe.json`` (``ring_probe_<tag>.json`` with ``--tag``) and a PNG of
the fraction of the read rate against the bytes in flight an SM, if matplotlib imports.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from typing import Dict, List, Optional

import torch

from bitdecode._files import save_plot, write_record
from bitdecode.cli import positive_int_list

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_bitnet import measure_roofline  # noqa: E402
from bench_decode import Timer  # noqa: E402


def ring_source(pool: torch.Tensor, probe, ctas: int) -> torch.Tensor:
    """The probe's ``src`` for ``ctas`` CTAs out of ``pool`` (int32 words): as many whole
    tiles each as the pool holds, ``(ctas, tiles, tile words)``."""
    tiles = pool.numel() // (ctas * probe.tile_words)
    return pool[: ctas * tiles * probe.tile_words].view(ctas, tiles, probe.tile_words)


def run_config(timer: Timer, probe, fn, src: torch.Tensor, replays: int) -> float:
    """us per launch of ``probe`` compiled (``fn``) over ``src`` (median of ``replays`` after
    one warm-up; no L2 flush: ``src`` is far larger than L2); raises if its sums are wrong."""
    out = torch.zeros(src.shape[0], probe.threads, dtype=torch.int32, device=src.device)
    fn(src, out)
    torch.cuda.synchronize()
    if not torch.equal(out.to(torch.int64) & 0xFFFFFFFF, probe.expected_sums(src)):
        raise RuntimeError("the ring probe's sums differ from torch's: it read the wrong bytes")
    return timer(lambda: fn(src, out), iters=replays, warmup=1, flush=False)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="output folder, e.g. profiles/h200")
    p.add_argument("--tag", default="", help="suffix of the file name (an identifier)")
    p.add_argument("--tile-kb", type=positive_int_list, default=[8, 16, 32], help="tile sizes, KiB")
    p.add_argument("--stages", type=positive_int_list, default=[2, 3, 4, 6, 8])
    p.add_argument("--ctas-per-sm", type=positive_int_list, default=[1, 2])
    p.add_argument("--copies", type=positive_int_list, default=[1, 4, 16],
                   help="bulk copies a tile (the decode issues four a stage: K's box, V's, their params)")
    p.add_argument("--apart", choices=("no", "yes", "both"), default="no",
                   help="each of a tile's copies from its own region of the source (the decode's stage reads "
                        "four tensors), from one contiguous run, or both")
    p.add_argument("--consumer-warps", type=int, default=4)
    p.add_argument("--gib", type=float, default=1.0, help="bytes each launch reads, GiB")
    p.add_argument("--replays", type=int, default=15)
    args = p.parse_args(argv)
    if args.tag and not args.tag.isidentifier():
        p.error(f"--tag must be an identifier, got {args.tag!r}")
    if args.gib <= 0 or args.replays < 1:
        p.error("--gib and --replays must be positive")
    if not torch.cuda.is_available():
        raise SystemExit("bench_ring needs a CUDA GPU")
    from bitdecode import jit
    from bitdecode.kernels_sm90.ring_probe import RingProbeSm90

    arch = jit.target_arch()
    if arch != "sm_90a":
        raise SystemExit(f"the ring probe is a Hopper kernel (cp.async.bulk on mbarriers); this GPU is {arch}")
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    roof = measure_roofline(dev, 10)
    timer = Timer(dev)
    words = int(args.gib * (1 << 30)) // 4
    pool = torch.randint(-(2**31), 2**31 - 1, (words,), dtype=torch.int32, device=dev)
    rows: List[Dict] = []
    skipped: List[Dict] = []
    name = f"ring_probe_{args.tag}" if args.tag else "ring_probe"
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "sms": sms,
              "command": " ".join(["python3 profiles/bench_ring.py", *(sys.argv[1:] if argv is None else argv)]),
              "method": __doc__.strip().split("\n\n")[0].replace("\n", " "), "roofline": roof,
              "consumer_warps": args.consumer_warps, "rows": rows, "skipped": skipped}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{name}.json"
    aparts = {"no": (False,), "yes": (True,), "both": (False, True)}[args.apart]
    for tile_kb, copies, apart, stages in itertools.product(args.tile_kb, args.copies, aparts, args.stages):
        if apart and copies == 1:
            continue  # (one copy a tile reads one region either way)
        probe = RingProbeSm90(tile_kb * 1024, stages, copies, args.consumer_warps, apart)
        shape = {"tile_bytes": probe.tile_bytes, "copies": copies, "apart": apart, "stages": stages}
        runnable = [c for c in args.ctas_per_sm if c <= probe.ctas_per_sm()]
        for c in sorted(set(args.ctas_per_sm) - set(runnable)):
            skipped.append({**shape, "ctas_per_sm": c, "why": f"{probe.smem_bytes()} bytes of shared "
                                                              f"memory a CTA do not fit {c} an SM"})
        if not runnable:
            continue
        fn = RingProbeSm90.compile(arch, probe.tile_bytes, stages, copies, args.consumer_warps, apart=apart)
        for cps in runnable:
            src = ring_source(pool, probe, cps * sms)
            us = run_config(timer, probe, fn, src, args.replays)
            nbytes = src.numel() * 4
            row = {**shape, "ctas_per_sm": cps, "in_flight_per_sm": cps * stages * probe.tile_bytes,
                   "bytes": nbytes, "us": us, "bytes_per_s": nbytes / (us * 1e-6),
                   "read_rate_frac": nbytes / (us * 1e-6) / roof["read_bytes_per_s"]}
            rows.append(row)
            print(f"tile {tile_kb:3d} KB x{copies:<2d}{' apart' if apart else ''} stages {stages} CTAs/SM {cps}: "
                  f"{row['in_flight_per_sm'] / 1024:6.0f} KB in flight, {us:8.2f} us, "
                  f"{row['bytes_per_s'] / 1e12:.2f} TB/s = {row['read_rate_frac']:.3f} of the read rate")
            # (written after every row: a configuration that ends the process keeps the others')
            write_record(path, result)
    write_record(path, result)
    plot(result, args.out / f"{name}.png")
    return 0


def plot(result: Dict, path: Path) -> Optional[Path]:
    """Fraction of the read rate against KiB in flight an SM, a line per (tile, copies)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    series: Dict[tuple, List[Dict]] = {}
    for row in result["rows"]:
        series.setdefault((row["tile_bytes"], row["copies"], row.get("apart", False)), []).append(row)
    for (tile, copies, apart), rows in sorted(series.items()):
        rows = sorted(rows, key=lambda r: r["in_flight_per_sm"])
        ax.plot([r["in_flight_per_sm"] / 1024 for r in rows], [r["read_rate_frac"] for r in rows], marker="o",
                label=f"{tile // 1024} KB tiles, {copies} cop{'y' if copies == 1 else 'ies'}"
                      f"{' apart' if apart else ''}")
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bytes in flight an SM (stages x tile x CTAs an SM), KiB")
    ax.set_ylabel("fraction of the read rate")
    ax.set_title(f"A bare TMA ring, {result['gpu']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save_plot(fig, path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
