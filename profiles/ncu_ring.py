"""One launch of the bare TMA ring (``RingProbeSm90``) or of the sm90 decode, between
``cudaProfilerStart`` / ``Stop``, for ncu to read counters of (DRAM and L2 bytes and rates,
L2 requests a sector) with nothing else in the profiled range:

    M=gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,\\
    lts__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_requests.sum,lts__t_sectors.sum
    ncu --clock-control none --profile-from-start off --metrics $M \\
        python3 profiles/ncu_ring.py ring --tile-kb 16 --copies 2 --stages 4 --ctas-per-sm 2 --apart
    ncu ... python3 profiles/ncu_ring.py decode --shape 16x65536 --variant probe_ring_only=True

``decode``'s ``--variant`` takes ``DecodeSm90`` keywords as ``bench_variants.py`` does
(``probe_*`` ones need ``profiles/probes/sm90_decode_ablation.patch`` applied).  The ring
reads 1 GiB; the decode is fp16, Hq/Hkv 32/8, D 128.  Each prints its eager time a call
(``bench_decode.Timer``, no flush: median of 10 after 3 warm-ups) before the profiled launch.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_variants as bv  # noqa: E402
from bench_decode import Timer  # noqa: E402
from bench_ring import ring_source  # noqa: E402


def ring_call(args, dev):
    from bitdecode.kernels_sm90.ring_probe import RingProbeSm90

    probe = RingProbeSm90(args.tile_kb * 1024, args.stages, args.copies, 4, args.apart)
    fn = RingProbeSm90.compile("sm_90a", probe.tile_bytes, args.stages, args.copies, 4, apart=args.apart)
    pool = torch.randint(-(2**31), 2**31 - 1, ((1 << 30) // 4,), dtype=torch.int32, device=dev)
    src = ring_source(pool, probe, args.ctas_per_sm * torch.cuda.get_device_properties(dev).multi_processor_count)
    out = torch.zeros(src.shape[0], probe.threads, dtype=torch.int32, device=dev)
    return lambda: fn(src, out)


def decode_call(args, dev):
    bv.apply_keywords(bv.parse_variant("v=" + args.variant)[1])
    import bitdecode as bd
    from bench_decode import build

    (b, n), = args.shape
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(b, 1, bv.HQ, bv.D, device=dev, dtype=torch.float16, generator=gen)
    cache, k, v = build(bd.KVFormat(*bv.FORMATS[args.format]), b, bv.HKV, bv.D, n, dev, gen)
    cache.prefill(k, v)
    return functools.partial(bd.decode, q, cache, backend="sm90")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="kernel", required=True)
    r = sub.add_parser("ring", help="the bare ring probe over 1 GiB")
    r.add_argument("--tile-kb", type=int, default=16)
    r.add_argument("--copies", type=int, default=2)
    r.add_argument("--stages", type=int, default=4)
    r.add_argument("--ctas-per-sm", type=int, default=2)
    r.add_argument("--apart", action="store_true", help="each copy of a tile from its own region")
    d = sub.add_parser("decode", help="the sm90 decode (and its split combine)")
    d.add_argument("--shape", type=bv.parse_shapes, default=bv.parse_shapes("16x65536"), help="BxN")
    d.add_argument("--format", choices=sorted(bv.FORMATS), default="4c128")
    d.add_argument("--variant", default="", help="DecodeSm90 keywords, key=value,...")
    args = p.parse_args(argv)
    if args.kernel == "decode" and len(args.shape) != 1:
        p.error("--shape takes one BxN")
    if not torch.cuda.is_available():
        raise SystemExit("ncu_ring needs a CUDA GPU")
    dev = torch.device("cuda")
    call = ring_call(args, dev) if args.kernel == "ring" else decode_call(args, dev)
    us = Timer(dev, "none")(call, iters=10, warmup=3)
    print(f"{' '.join(sys.argv[1:] if argv is None else argv)}: {us:.1f} us a call (eager, median of 10, no flush)")
    torch.cuda.profiler.start()
    call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
