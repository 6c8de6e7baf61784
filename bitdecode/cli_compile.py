"""``bitdecode compile``: ahead-of-time compile the kernel variants for an arch (no GPU needed).

Writes one PTX file per variant into ``--out`` (or, with ``--warm-cache``, fills the
on-disk JIT cache of this machine's GPU so later processes start without compiling).
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from .backend import Variant
from .cli import DTYPE_NAMES, csv_list, output_folder, positive_int, print_error
from .formats import BITS, FP4_FORMATS, GROUP_SIZES, HEAD_DIMS, K_MODES

ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90a", "sm_100a")
KINDS = ("decode", "pack", "combine")
# the results table's instruction counts per variant (sites in the PTX text): its column,
# the instructions counted.  sm80 MMAs, sm90 MMAs, sm100 MMAs, the shared-memory matrix
# loads, the dequant's logic ops; the asynchronous copies: cp.async.ca / .cg (Ampere's
# 4-16-byte copies; not their commit_group / wait_group / wait_all) apart from the bulk
# copies (cp.async.bulk and cp.async.bulk.tensor, TMA: global <-> shared and shared ->
# cluster shared; not cp.async.bulk.prefetch nor their commit / wait groups)
COUNTED = (
    ("mma.sync", r"\bmma\.sync\.aligned\.m16n8k16\b"),
    ("wgmma", r"\bwgmma\.mma_async\b"),
    ("tcgen05.mma", r"\btcgen05\.mma\b"),
    ("ldmatrix", r"\bldmatrix\b"),
    ("lop3", r"\blop3\.b32\b"),
    ("cp.async.ca|cg", r"\bcp\.async\.c[ag]\b"),
    ("cp.async.bulk[.tensor]", r"\bcp\.async\.bulk\.(?:tensor|shared|global)\b"),
)
_COUNTED_RE = {col: re.compile(pattern) for col, pattern in COUNTED}


def count_instructions(ptx: str) -> Dict[str, int]:
    """The ``COUNTED`` columns of one variant's PTX."""
    return {col: len(regex.findall(ptx)) for col, regex in _COUNTED_RE.items()}


def _list(values) -> str:
    return ",".join(str(v) for v in values)


def add_parser(sub, name: str, help_text: str) -> None:
    p = sub.add_parser(name, help=help_text, description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="sm_80", choices=ARCHS, help="target GPU arch (default sm_80)")
    p.add_argument("--out", type=output_folder, metavar="DIR",
                   help="folder for the PTX files (created; required unless --warm-cache)")
    p.add_argument("--kernels", type=csv_list(str, KINDS), default=list(KINDS), metavar="LIST",
                   help=f"comma list of {_list(KINDS)} (default all)")
    p.add_argument("--bits", type=csv_list(int, BITS, allow_empty=True), default=list(BITS), metavar="LIST",
                   help=f"integer formats' widths, comma list of {_list(BITS)} (default {_list(BITS)}; "
                        "an empty list with --fp4: FP4 formats only)")
    p.add_argument("--k-mode", type=csv_list(str, K_MODES, allow_empty=True), default=list(K_MODES),
                   metavar="LIST", help=f"integer formats' K modes, comma list of {_list(K_MODES)} "
                                        f"(default {_list(K_MODES)})")
    p.add_argument("--group-size", type=csv_list(int, GROUP_SIZES, allow_empty=True), default=list(GROUP_SIZES),
                   metavar="LIST", help=f"integer formats' group sizes, comma list of {_list(GROUP_SIZES)} "
                                        f"(default {_list(GROUP_SIZES)}; a group larger than a head dim is "
                                        "skipped at that head dim)")
    p.add_argument("--fp4", type=csv_list(str, FP4_FORMATS, allow_empty=True), default=[], metavar="LIST",
                   help=f"also these FP4 formats, comma list of {_list(FP4_FORMATS)} (decode and pack; default none)")
    p.add_argument("--head-dim", type=csv_list(int, HEAD_DIMS), default=list(HEAD_DIMS), metavar="LIST",
                   help=f"head dims, comma list of {_list(HEAD_DIMS)} (default {_list(HEAD_DIMS)})")
    p.add_argument("--dtype", type=csv_list(str, DTYPE_NAMES), default=list(DTYPE_NAMES), metavar="LIST",
                   help=f"16-bit types, comma list of {_list(DTYPE_NAMES)} (default {_list(DTYPE_NAMES)})")
    p.add_argument("--jobs", type=positive_int, default=os.cpu_count() or 1,
                   help=f"parallel compile processes (default: the CPU count, {os.cpu_count() or 1} here)")
    p.add_argument("--warm-cache", action="store_true",
                   help="compile for this machine's GPU (its arch, not --arch) into the JIT disk cache instead of "
                        "writing PTX; needs a CUDA GPU")


def check_args(args) -> Optional[str]:
    """What is wrong with the combination of options (``cli.main`` refuses it), or None."""
    if args.out is None and not args.warm_cache:
        return "--out DIR is required (or --warm-cache)"
    if args.out is not None and args.warm_cache:
        return "--warm-cache fills the JIT disk cache and writes no PTX: give no --out"
    if set(args.kernels) - {"combine"} and not _formats(args):
        empty = [opt for opt, v in (("--bits", args.bits), ("--k-mode", args.k_mode),
                                    ("--group-size", args.group_size)) if not v]
        return (f"no KV format for the decode / pack kernels: {', '.join(empty)} empty and no --fp4 "
                "(give them, or --kernels combine)")
    return None


def _backend_for(arch: str):
    from . import backend as backends

    return backends.get(backends.for_arch(arch))


def _formats(args) -> list:
    from .formats import KVFormat

    formats = [KVFormat(bits=bits, k_mode=mode, group_size=g)
               for bits, mode, g in itertools.product(args.bits, args.k_mode, args.group_size)]
    return formats + [KVFormat(fp4=f) for f in args.fp4]


def variants(args) -> List[Variant]:
    return _backend_for(args.arch).variants(args.kernels, _formats(args), args.head_dim, args.dtype)


def _compile_one(v: Variant, arch: str, out: str, warm: bool) -> Tuple[str, float, Dict[str, int]]:
    kernels = _backend_for(arch)
    t0 = time.time()
    if warm:  # (this process's kernels that the disk cache did not take, counted as "unwritten")
        from . import jit

        unwritten = jit.KERNELS.unwritten
        kernels.compile_variant(arch, v, cached=True)
        return v.name, time.time() - t0, {"unwritten": jit.KERNELS.unwritten - unwritten}
    ptx = kernels.compile_variant(arch, v, keep_ptx=True).artifacts.PTX
    Path(out, f"{v.name}.{arch}.ptx").write_text(ptx)
    return v.name, time.time() - t0, count_instructions(ptx)


def run(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    console = Console()  # (the options' combination: ``check_args``, which ``cli.main`` ran)
    if args.warm_cache:
        import torch

        from . import jit

        if not torch.cuda.is_available():
            print_error("--warm-cache compiles for this machine's GPU, but no CUDA GPU is available "
                        "(to compile without one: --arch ARCH --out DIR)")
            return 2
        args.arch = jit.target_arch()
        why = _unwritable_cache(jit)
        if why:
            print_error(f"--warm-cache fills the JIT disk cache, but {why}")
            return 2
    pending = variants(args)
    wanted = set(args.kernels) - {"combine"}  # the kinds that take a KV format
    if wanted and not any(v.kind in wanted for v in pending):  # (KVFormat.check_head_dim skips them all)
        print_error(f"no {' / '.join(sorted(wanted))} variant: every format's group size exceeds "
                    f"every --head-dim ({_list(args.head_dim)})")
        return 2
    out = ""
    if not args.warm_cache:
        try:
            args.out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            print_error(f"--out {args.out}: cannot make the folder ({exc.strerror or exc})")
            return 2
        out = str(args.out)
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
    for col in ("variant", "seconds", *(col for col, _ in COUNTED)):
        table.add_column(col, justify="right" if col != "variant" else "left")
    for name, secs, counts in sorted(results):
        table.add_row(name, f"{secs:.1f}", *(str(counts.get(col, "")) for col, _ in COUNTED))
    console.print(table)
    if not args.warm_cache:
        console.print("[dim]instruction sites in each PTX file; cp.async.ca|cg: the non-bulk asynchronous copies "
                      "(not their commit / wait groups); cp.async.bulk[.tensor]: bulk and TMA copies (not prefetches "
                      "nor their commit / wait groups)[/]")
    unwritten = sum(counts.get("unwritten", 0) for _, _, counts in results)
    if unwritten:
        print_error(f"the JIT disk cache did not take {unwritten} of the kernels compiled (a full or read-only "
                    "disk?): later processes compile them again")
        return 1
    where = "the JIT disk cache" if args.warm_cache else str(args.out)
    console.print(f"wrote {len(results)} variants to {where}")
    return 0


def _unwritable_cache(jit) -> str:
    """Why compiled kernels cannot go to the disk cache (switched off, no folder, a folder
    not writable), or ""."""
    from ._files import cannot_write

    if not jit.disk_cache_on():
        return f"${jit.ENV_DISABLE_DISK}={os.environ[jit.ENV_DISABLE_DISK]!r} switches it off"
    try:
        folder = jit.cache_dir()
        folder.mkdir(parents=True, exist_ok=True)
    except (OSError, RuntimeError) as exc:
        return f"it cannot be written ({exc})"
    why = cannot_write(folder / "kernel.o")
    return f"it cannot be written ({why})" if why else ""
