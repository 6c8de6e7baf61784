"""A/B of BitNet GEMM variants on the Hopper wgmma kernel: each variant overrides the
host's per-shape choices (the tile, the K split), every variant runs on the same shapes
in one process, timed as ``bench_bitnet`` times (CUDA-graph replay of back-to-back calls
over weight copies that exceed L2, median of 20), its output checked against the torch
reference, bf16 cuBLAS beside it.

    python3 profiles/bench_gemm_variants.py --variant plan= --variant whole=cluster_k=1,splits=1 \\
        --variant c2=cluster_k=2 --ms 64,256 --out profiles/h200 --tag cluster

writes ``<out>/gemm_variants.json`` (``gemm_variants_<tag>.json`` with ``--tag``): each
(M, shape)'s time under every variant and over the first.  Keys (any subset; unset ones
keep the host's choice): ``tile`` (small, medium or large: ``kernels_sm90.bitnet_gemm``'s
SMALL / MEDIUM / LARGE), any ``WgmmaConfig`` field of the tile (``stages``,
``ctas_per_sm``, ...), ``cluster_k`` (CTAs a cluster split puts on a tile; 1: none),
``splits`` (the workspace split of the last wave's tiles: that many CTAs a tail tile,
1: whole tiles), ``pdl`` (True / False: launch with programmatic dependent launch or
not; unset: ``pdl_plan``'s choice), ``persistent`` (True: a persistent grid of a CTA per
CTA slot, for tiles of one CTA an SM; False: a CTA a tile; unset: ``persistent_plan``'s),
``kernel`` (``mma`` times the mma.sync kernel instead).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from pathlib import Path
from typing import Dict, List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_variants import add_variant_arguments, variants_of, write_result  # noqa: E402

DEFAULT_SHAPES = "2560x2560,3840x2560,13824x2560,2560x6912,3200x3200,4800x3200,3200x10240,20480x3200"
TILES = {"small": "SMALL", "medium": "MEDIUM", "large": "LARGE"}  # --variant tile=... -> bitnet_gemm's config
PLAN_KEYS = ("tile", "cluster_k", "splits", "pdl", "persistent", "kernel")


def parse_shapes(text: str) -> List[Tuple[int, int]]:
    """``NxK,NxK`` -> [(N, K)] (N a multiple of 16, K of 128: the packed format's contract;
    ``bitnet_tune.parse_shapes``), an empty list where the text names none."""
    from bitdecode.bitnet_tune import parse_shapes as weight_shapes

    if not any(item.strip() for item in text.split(",")):
        return []
    try:
        return weight_shapes(text)
    except ValueError as e:
        raise ValueError(f"--shapes must be NxK,... with N % 16 == 0 and K % 128 == 0 ({e})") from None


def check_variant(name: str, kwargs: Dict[str, object]) -> None:
    """Reject keys the variant cannot apply before any GPU work."""
    from bitdecode.kernels_sm90 import bitnet_gemm as g90

    fields = {f.name for f in dataclasses.fields(g90.WgmmaConfig)}
    for key, value in kwargs.items():
        if key not in PLAN_KEYS and key not in fields:
            raise ValueError(f"--variant {name}: unknown key {key!r} (known: {', '.join(PLAN_KEYS)}, "
                             f"or a WgmmaConfig field: {', '.join(sorted(fields))})")
    if "tile" in kwargs and kwargs["tile"] not in TILES:
        raise ValueError(f"--variant {name}: tile must be one of {', '.join(TILES)}, got {kwargs['tile']!r}")
    if kwargs.get("kernel", "wgmma") not in ("mma", "wgmma"):
        raise ValueError(f"--variant {name}: kernel must be mma or wgmma, got {kwargs['kernel']!r}")


def variant_tile(kwargs: Dict[str, object], m: int, n: int, sms: int, config_for):
    """The tile config the variant gives this GEMM (unset: ``config_for``'s)."""
    from bitdecode.kernels_sm90 import bitnet_gemm as g90

    cfg = config_for(m, n, sms)
    if "tile" in kwargs:
        cfg = getattr(g90, TILES[kwargs["tile"]])
    return dataclasses.replace(cfg, **{key: v for key, v in kwargs.items() if key not in PLAN_KEYS})


def variant_plan(kwargs: Dict[str, object], cfg, m: int, n: int, k: int, sms: int, cluster_plan, split_plan):
    """(cluster CTAs, workspace plan) the variant gives this GEMM on tile ``cfg``; unset
    keys keep the host's (``cluster_plan``, ``split_plan``)."""
    from bitdecode.kernels_sm90 import bitnet_gemm as g90

    cluster_k = kwargs.get("cluster_k", cluster_plan(cfg, m, n, k, sms))
    tiles = g90.tile_count(cfg, m, n)
    if cluster_k > 1:
        return cluster_k, (tiles, 1, 0)
    if "splits" not in kwargs:
        return 1, split_plan(cfg, m, n, k, sms)
    tail = tiles % (sms * cfg.ctas_per_sm) or tiles
    return 1, (tiles, 1, 0) if kwargs["splits"] == 1 else (tiles - tail, kwargs["splits"], tail)


def variant_persistent(kwargs: Dict[str, object], cfg, m: int, n: int, k: int, sms: int, persistent_plan) -> int:
    """The persistent grid's CTAs the variant gives this GEMM (0: none): with ``persistent``
    True a CTA an SM wherever the tile runs one an SM and its variant fits in shared
    memory; unset, the host's (``persistent_plan``)."""
    if "persistent" not in kwargs:
        return persistent_plan(cfg, m, n, k, sms)
    return sms if kwargs["persistent"] and cfg.persistent_capable else 0


@contextlib.contextmanager
def applied(kwargs: Dict[str, object]):
    """The host's tile and split choices replaced by the variant's for this block."""
    from bitdecode import bitnet as bn
    from bitdecode.kernels_sm90 import bitnet_gemm as g90

    host = g90.config_for, g90.cluster_plan, g90.split_plan, g90.pdl_plan, g90.persistent_plan
    g90.config_for = lambda m, n, sms: variant_tile(kwargs, m, n, sms, host[0])
    g90.persistent_plan = lambda cfg, m, n, k, sms: variant_persistent(kwargs, cfg, m, n, k, sms, host[4])
    g90.cluster_plan = lambda cfg, m, n, k, sms: variant_plan(kwargs, cfg, m, n, k, sms, *host[1:3])[0]
    g90.split_plan = lambda cfg, m, n, k, sms: variant_plan(kwargs, cfg, m, n, k, sms, *host[1:3])[1]
    g90.pdl_plan = lambda m: bool(kwargs["pdl"]) if "pdl" in kwargs else host[3](m)
    bn._LAUNCHERS.clear()
    try:
        yield
    finally:
        g90.config_for, g90.cluster_plan, g90.split_plan, g90.pdl_plan, g90.persistent_plan = host
        bn._LAUNCHERS.clear()


def run(variants, shapes, ms, replays: int = 20) -> List[dict]:
    import torch

    from bench_bitnet import MIN_CALLS, gemm_operands, graph_time_us
    from bitdecode import bitnet as bn
    from bitdecode._memory import release_memory

    dev = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    rows = []
    for n, k in shapes:
        gen, _, packs, w16s = gemm_operands(n, k, dev, l2)
        copies, copies16 = len(packs), len(w16s)
        ws = torch.ones(1, device=dev)
        for m in ms:
            x, xs = bn.quantize_activation(torch.randn(m, k, generator=gen, device=dev))
            x16 = torch.randn(m, k, generator=gen, device=dev, dtype=torch.bfloat16)
            row = {"m": m, "n": n, "k": k, "bf16_us": graph_time_us(
                [(lambda q=w16s[i % copies16]: torch.matmul(x16, q.t())) for i in range(max(copies16, MIN_CALLS))],
                replays)}
            ref = bn.reference_gemm(x, packs[0], xs, ws).float()
            for name, kwargs in variants:
                kernel = kwargs.get("kernel", "wgmma")
                with applied(kwargs):
                    got = bn.gemm(x, packs[0], xs, ws, kernel=kernel).float()
                    err = ((got - ref).norm() / ref.norm()).item()
                    if err > 1e-2:
                        raise AssertionError(f"variant {name}: M={m} {n}x{k} relative error {err:.2e}")
                    row[name] = graph_time_us(
                        [(lambda p=packs[i % copies]: bn.gemm(x, p, xs, ws, kernel=kernel))
                         for i in range(max(copies, MIN_CALLS))], replays)
            row["over_first"] = {name: row[name] / row[variants[0][0]] for name, _ in variants}
            print(json.dumps({a: (round(b, 2) if isinstance(b, float) else b) for a, b in row.items()}), flush=True)
            rows.append(row)
        del packs, w16s
        release_memory()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_variant_arguments(p, "the keys above (NAME= for the host's choices)", "gemm_variants")
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="NxK,... (default: the eight BitNet 2B shapes)")
    p.add_argument("--ms", default="64,256,1024", help="tokens, comma-separated (default 64,256,1024)")
    args = p.parse_args(argv)
    variants = variants_of(p, args, words=("tile", "kernel"))
    try:
        for name, kwargs in variants:
            check_variant(name, kwargs)
        shapes = parse_shapes(args.shapes)
        ms = [int(v) for v in args.ms.split(",") if v]
    except ValueError as e:
        p.error(str(e))
    if not ms or min(ms) < 1:
        p.error("--ms must be positive integers")
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("bench_gemm_variants needs a Hopper GPU (the wgmma kernel)", file=sys.stderr)
        return 2
    rows = run(variants, shapes, ms)
    write_result(args, "gemm_variants", f"--shapes {args.shapes} --ms {args.ms}", variants,
                 "CUDA-graph replay of back-to-back calls over weight copies > L2, median of 20; "
                 "output within 1e-2 relative of the torch reference; bf16 cuBLAS rotated the same way", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
