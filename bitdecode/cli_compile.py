"""``bitdecode compile``: ahead-of-time compile the kernel variants for an arch (no GPU needed).

Writes one PTX file per variant into ``--out`` (or, with ``--warm-cache``, fills the
on-disk JIT cache of this machine's GPU so later processes start without compiling).
"""

from __future__ import annotations

import argparse
import itertools
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Dict, List, Tuple

from .backend import Variant

ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90a", "sm_100a")
KINDS = ("decode", "pack", "combine")
# instructions counted per variant: sm80 MMAs, sm90 MMAs, the dequant, the loads
COUNTED = ("mma.sync.aligned.m16n8k16", "wgmma.mma_async", "tcgen05.mma", "ldmatrix", "lop3.b32", "cp.async.bulk",
           "cp.async")


def _csv(kind):
    def parse(text: str):
        return [kind(x) for x in text.split(",") if x]

    return parse


def add_parser(sub, name: str, help_text: str) -> None:
    p = sub.add_parser(name, help=help_text, description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="sm_80", choices=ARCHS, help="target GPU arch (default sm_80)")
    p.add_argument("--out", type=Path, help="directory for the PTX files (created)")
    p.add_argument("--kernels", type=_csv(str), default=list(KINDS), help="comma list of decode,pack,combine")
    p.add_argument("--bits", type=_csv(int), default=[4, 2])
    p.add_argument("--k-mode", type=_csv(str), default=["channel", "token"])
    p.add_argument("--group-size", type=_csv(int), default=[32, 64, 128])
    p.add_argument("--fp4", type=_csv(str), default=[],
                   help="also these FP4 formats, comma list of nvfp4,mxfp4 (decode and pack; default none)")
    p.add_argument("--head-dim", type=_csv(int), default=[64, 128, 256])
    p.add_argument("--dtype", type=_csv(str), default=["fp16", "bf16"])
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compile processes")
    p.add_argument("--warm-cache", action="store_true",
                   help="compile for this machine's GPU into the JIT disk cache instead of writing PTX")


def _backend_for(arch: str):
    from . import backend as backends

    return backends.get(backends.for_arch(arch))


def variants(args) -> List[Variant]:
    from .formats import KVFormat

    formats = []
    for bits, mode, g in itertools.product(args.bits, args.k_mode, args.group_size):
        formats.append(KVFormat(bits=bits, k_mode=mode, group_size=g))
    formats += [KVFormat(fp4=f) for f in args.fp4]
    return _backend_for(args.arch).variants(args.kernels, formats, args.head_dim, args.dtype)


def _compile_one(v: Variant, arch: str, out: str, warm: bool) -> Tuple[str, float, Dict[str, int]]:
    kernels = _backend_for(arch)
    t0 = time.time()
    if warm:
        kernels.compile_variant(arch, v, cached=True)
        return v.name, time.time() - t0, {}
    ptx = kernels.compile_variant(arch, v, keep_ptx=True).artifacts.PTX
    Path(out, f"{v.name}.{arch}.ptx").write_text(ptx)
    counts = {k: ptx.count(k) for k in COUNTED}
    return v.name, time.time() - t0, counts


def run(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    console = Console()
    if args.warm_cache:
        from . import jit

        args.arch = jit.target_arch()
        out = ""
    else:
        if args.out is None:
            console.print("[red]--out DIR is required (or --warm-cache)[/red]")
            return 2
        args.out.mkdir(parents=True, exist_ok=True)
        out = str(args.out)
    pending = variants(args)
    if not pending:
        console.print("[red]no variant matches the filters[/red]")
        return 2
    results = []
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console) as progress:
        task = progress.add_task(f"compiling for {args.arch}", total=len(pending))
        if args.jobs <= 1:
            for v in pending:
                results.append(_compile_one(v, args.arch, out, args.warm_cache))
                progress.advance(task)
        else:
            with ProcessPoolExecutor(max_workers=args.jobs) as pool:
                futs = [pool.submit(_compile_one, v, args.arch, out, args.warm_cache) for v in pending]
                for fut in as_completed(futs):
                    results.append(fut.result())
                    progress.advance(task)
    table = Table(title=f"{len(results)} kernel variants for {args.arch}")
    for col in ("variant", "seconds", "mma.sync", "wgmma", "tcgen05.mma", "ldmatrix", "lop3", "cp.async.bulk", "cp.async"):
        table.add_column(col, justify="right" if col != "variant" else "left")
    for name, secs, counts in sorted(results):
        table.add_row(name, f"{secs:.1f}", *(str(counts.get(k, "")) for k in COUNTED))
    console.print(table)
    where = "the JIT disk cache" if args.warm_cache else str(args.out)
    console.print(f"wrote {len(results)} variants to {where}")
    return 0
