"""A/B of sm90 (or sm80) decode kernel variants: each variant is a set of ``DecodeSm90`` keyword
arguments (its constexpr configuration; ``--backend sm80``: ``DecodeSm80``'s, timed
through the sm80 backend), run in its own process with the kernels compiled
afresh (the JIT cache's key does not hold these arguments, so no disk cache there), timed
as ``bench_decode`` times (CUDA-graph replay between CUDA events, L2 flushed before each
call, median of 30) on the same shapes, with the error against the reference at N <= 32K.

    python3 profiles/bench_variants.py --variant base= --variant exact_max=lazy_max=False \\
        --out profiles/h200

writes ``<out>/variants.json`` (``variants_<tag>.json`` with ``--tag``): every variant's rows and each row's time over the first
variant's.  The variants run one after the other on one GPU, so compare them within one
file only.  Keywords: any ``DecodeSm90.__init__`` argument after the format's (``lazy_max``,
``fold_k``, ``fold_v``, ``num_stages``, ``step``, ``ctas_per_sm``, ``consumers``, ``half_cols``), or
``CombineSm80.__init__``'s (``hoist_loads``: the split combine's).  Where the
backend builds a grid variant (``Sm90Backend.grid_variant``: small grids, and one split of
short sequences whose pairs fill the SMs; ``kernels_sm90.backend`` says which formats), the
variant's keywords apply on top of that kernel's.  A variant that does not finish (a launch
the GPU refuses, a hang past ``--variant-timeout``) is reported and its rows so far kept
beside every other variant's; the JSON lists it under ``failed`` and the exit status is 1.
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from bitdecode.cli import DTYPE_NAMES, torch_dtype
from bitdecode._files import write_record

FORMATS = {"4c128": (4, "channel", 128), "4c64": (4, "channel", 64), "2c128": (2, "channel", 128),
           "2c64": (2, "channel", 64), "4t64": (4, "token", 64), "2t64": (2, "token", 64),
           "k4v2c128": (4, "channel", 128, 2)}  # (bits, k_mode, group_size[, v_bits]): KVFormat's order
DEFAULT_SHAPES = "1x4096,1x32768,1x131072,8x65536,16x32768,16x65536"
HQ, HKV, D = 32, 8, 128


def parse_variant(text: str, words: Tuple[str, ...] = ()) -> Tuple[str, Dict[str, object]]:
    """``NAME=key=value,key=value`` (``NAME=`` for the defaults) -> (name, kwargs); values
    are Python literals, or for the keys in ``words`` also bare words (``tile=medium``)."""
    name, sep, rest = text.partition("=")
    if not sep or not name.isidentifier():
        raise ValueError(f"--variant must be NAME=key=value,... (NAME an identifier), got {text!r}")
    kwargs: Dict[str, object] = {}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise ValueError(f"--variant {name}: expected key=value, got {item!r}")
        try:
            kwargs[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            if key in words and value.isidentifier():
                kwargs[key] = value
                continue
            raise ValueError(f"--variant {name}: {key}'s value {value!r} is not a Python literal") from None
    return name, kwargs


def add_variant_arguments(p: argparse.ArgumentParser, what: str, stem: str) -> None:
    """The A/B scripts' shared options: ``--variant`` (repeated, the first the baseline),
    ``--out`` and ``--tag`` (``<out>/<stem>.json``, ``<stem>_<tag>.json``)."""
    p.add_argument("--variant", action="append", required=True, metavar="NAME=KW",
                   help=f"a variant: NAME=key=value,... of {what} (NAME= for the defaults); "
                        "repeat it, the first is the baseline")
    p.add_argument("--out", type=Path, default=None, help=f"write <out>/{stem}.json")
    p.add_argument("--tag", default="", help=f"write <out>/{stem}_<tag>.json instead (an identifier)")


def variants_of(p: argparse.ArgumentParser, args, words: Tuple[str, ...] = ()) -> List[Tuple[str, Dict[str, object]]]:
    """The parsed ``--variant`` list (``p.error`` on a bad one, a repeated name or ``--tag``;
    ``words``: keys that take bare words, see ``parse_variant``)."""
    if args.tag and not args.tag.isidentifier():
        p.error(f"--tag must be an identifier, got {args.tag!r}")
    try:
        variants = [parse_variant(v, words) for v in args.variant]
    except ValueError as e:
        p.error(str(e))
    if len({name for name, _ in variants}) != len(variants):
        p.error("--variant names must differ")
    return variants


def write_result(args, stem: str, options: str, variants, method: str, rows: List[dict],
                 failed: Optional[List[dict]] = None) -> None:
    """The run to ``<out>/<stem>[_<tag>].json`` when ``--out`` was given: the command that
    reproduces it (``profiles/bench_<stem>.py``, its ``--variant`` list, the script's own
    ``options``, ``--out``, ``--tag``), the GPU and torch, the variants, ``method`` and ``rows``
    (and ``failed``: the variants that did not finish, and why)."""
    if args.out is None:
        return
    import torch

    command = " ".join([f"python3 profiles/bench_{stem}.py", *(f"--variant {v}" for v in args.variant), options,
                        f"--out {args.out}", *([f"--tag {args.tag}"] if args.tag else [])])
    result = {"command": command, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "variants": dict(variants), "method": method, "rows": rows}
    if failed:
        result["failed"] = failed
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"{stem}_{args.tag}.json" if args.tag else f"{stem}.json"
    write_record(args.out / name, result)


def parse_shapes(text: str) -> List[Tuple[int, int]]:
    """``BxN,BxN`` -> [(B, N)]."""
    out = []
    for item in filter(None, text.split(",")):
        b, sep, n = item.partition("x")
        if not sep or not b.isdigit() or not n.isdigit() or int(b) < 1 or int(n) < 1:
            raise ValueError(f"--shapes must be BxN,BxN,... with positive integers, got {item!r}")
        out.append((int(b), int(n)))
    return out


KERNEL_CLASSES = {"sm90": ("bitdecode.kernels_sm90.decode", "DecodeSm90"),
                  "sm80": ("bitdecode.kernels_sm80.decode", "DecodeSm80")}  # --backend: whose keywords


def target_keywords(cls) -> set:
    """The keyword arguments ``cls.__init__`` takes (a variant's keys go to the kernel
    classes that take them: the decode kernel's, or ``CombineSm80``'s such as
    ``hoist_loads``)."""
    import inspect

    return set(inspect.signature(cls.__init__).parameters) - {"self"}


def variant_classes(backend: str) -> tuple:
    """The kernel classes a variant's keys go to with ``--backend backend``: its decode
    kernel's and the split combine's."""
    import importlib

    from bitdecode.kernels_sm80.combine import CombineSm80

    module, cls_name = KERNEL_CLASSES[backend]
    return getattr(importlib.import_module(module), cls_name), CombineSm80


def known_keywords(backend: str) -> set:
    """Every key a variant may set with ``--backend backend``."""
    return set().union(*(target_keywords(cls) for cls in variant_classes(backend)))


def with_keywords(self, init, keywords, *args, **kw):
    """``init`` (a kernel class's own ``__init__``) with ``keywords`` over the caller's."""
    init(self, *args, **{**kw, **keywords})


def run_variant(cmd: List[str], env: Dict[str, str], timeout: float) -> Tuple[List[dict], str]:
    """One variant's worker process: (the rows it printed, "" or why it did not finish: its
    exit status and last lines, or the timeout).  A variant that cannot launch (too much
    shared memory) or hangs loses its own rows only, not the run's."""
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        out, why = done.stdout, ""
        if done.returncode != 0:
            why = f"exit status {done.returncode}: " + " | ".join((done.stdout + done.stderr).strip().splitlines()[-3:])
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        why = f"timed out after {timeout:g} s"
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")], why


def apply_keywords(kwargs: Dict[str, object], backend: str = "sm90") -> None:
    """Build every decode kernel of ``backend`` this process makes (the split heuristic reads
    the CTAs per SM a variant is built for from the kernel's config) and every combine
    kernel with the keywords of ``kwargs`` that it takes."""
    for target in variant_classes(backend):
        mine = {k: v for k, v in kwargs.items() if k in target_keywords(target)}
        target.__init__ = functools.partialmethod(with_keywords, target.__init__, mine)


def prefilled_case(fmt, dtype, b: int, n: int, dev, gen):
    """(q ``[b, 1, HQ, D]``, a cache of ``b`` sequences of ``n`` random tokens prefilled) from
    ``gen``: one timed case of this bench and of ``bench_placement``."""
    import torch
    from bench_decode import build

    q = torch.randn(b, 1, HQ, D, device=dev, dtype=dtype, generator=gen)
    cache, k, v = build(fmt, b, HKV, D, n, dev, gen, dtype)
    cache.prefill(k, v)
    return q, cache


def worker(name: str, kwargs: Dict[str, object], shapes, formats, dtypes, backend: str = "sm90") -> List[dict]:
    """One variant, in this process: the rows of every (format, dtype, shape)."""
    import torch

    apply_keywords(kwargs, backend)

    import bitdecode as bd
    from bench_decode import Timer, _graph_time

    from bitdecode._memory import release_memory

    dev = torch.device("cuda")
    timer = Timer(dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for fkey in formats:
        fmt = bd.KVFormat(*FORMATS[fkey])
        for dname in dtypes:
            dtype = torch_dtype(dname)
            for b, n in shapes:
                q, cache = prefilled_case(fmt, dtype, b, n, dev, gen)
                decode = functools.partial(bd.decode, q, cache, backend=backend)
                row = {"variant": name, "backend": backend, "format": fkey, "dtype": dname, "B": b, "N": n,
                       "us": _graph_time(timer, decode)}
                if n <= 32768:
                    ref = bd.decode(q, cache, backend="reference").float()
                    row["rel_err"] = ((decode().float() - ref).norm() / ref.norm()).item()
                print(json.dumps(row), flush=True)
                rows.append(row)
                del cache, decode
                release_memory()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_variant_arguments(p, "DecodeSm90 keywords (DecodeSm80's with --backend sm80)", "variants")
    p.add_argument("--backend", default="sm90", choices=sorted(KERNEL_CLASSES),
                   help="whose decode kernels the variants build and the timing calls (default sm90)")
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"BxN,... (default {DEFAULT_SHAPES})")
    p.add_argument("--formats", default="4c128", help=f"comma-separated, of {', '.join(FORMATS)} (default 4c128)")
    p.add_argument("--dtypes", default="fp16", help="comma-separated, of fp16, bf16 (default fp16)")
    p.add_argument("--variant-timeout", type=float, default=600, metavar="S",
                   help="seconds one variant's process may take (its compiles and every shape); past "
                        "them it is stopped, reported, and the run goes on (default 600)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    variants = variants_of(p, args)
    if args.variant_timeout <= 0:
        p.error(f"--variant-timeout must be positive, got {args.variant_timeout:g}")
    shapes = parse_shapes(args.shapes)
    formats = [f for f in args.formats.split(",") if f]
    dtypes = [d for d in args.dtypes.split(",") if d]
    for f in formats:
        if f not in FORMATS:
            p.error(f"--formats: unknown format {f!r} (known: {', '.join(FORMATS)})")
    for d in dtypes:
        if d not in DTYPE_NAMES:
            p.error(f"--dtypes: unknown dtype {d!r} (known: {', '.join(DTYPE_NAMES)})")
    known = known_keywords(args.backend)
    for name, kwargs in variants:
        unknown = sorted(set(kwargs) - known)
        if unknown:
            p.error(f"--variant {name}: {', '.join(unknown)} is no keyword of the {args.backend} decode kernel "
                    f"or the combine kernel")
    if args.worker:
        worker(*variants[0], shapes, formats, dtypes, args.backend)
        return 0
    import torch

    if not torch.cuda.is_available():
        print("bench_variants needs a CUDA GPU", file=sys.stderr)
        return 2
    env = dict(os.environ, BITDECODE_NO_DISK_CACHE="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent), env.get("PYTHONPATH")]))
    rows: List[dict] = []
    failed: List[dict] = []
    for (name, _), text in zip(variants, args.variant):
        cmd = [sys.executable, __file__, "--worker", "--variant", text, "--shapes", args.shapes,
               "--formats", args.formats, "--dtypes", args.dtypes, "--backend", args.backend]
        got, why = run_variant(cmd, env, args.variant_timeout)
        rows += got
        if why:
            print(f"variant {name} did not finish: {why}", file=sys.stderr)
            failed.append({"variant": name, "why": why})
    base = {(r["format"], r["dtype"], r["B"], r["N"]): r["us"] for r in rows if r["variant"] == variants[0][0]}
    for r in rows:
        first = base.get((r["format"], r["dtype"], r["B"], r["N"]))
        r["over_first"] = r["us"] / first if first else None
    for r in rows:
        err = f"  err {r['rel_err']:.2e}" if "rel_err" in r else ""
        ratio = f"x{r['over_first']:.3f}" if r["over_first"] else "(no baseline)"
        print(f"{r['variant']:>12} {r['format']} {r['dtype']} B={r['B']:<3} N={r['N']:<7} "
              f"{r['us']:8.2f} us  {ratio}{err}")
    write_result(args, "variants", f"--shapes {args.shapes} --formats {args.formats} --dtypes {args.dtypes}"
                 + (f" --backend {args.backend}" if args.backend != "sm90" else ""),
                 variants, f"{args.backend} decode, Hq/Hkv 32/8, D 128; CUDA-graph replay between CUDA events, "
                           "median of 30 after 5 warm-ups, L2 flushed before each call (Timer's clean flush: a "
                           "read of 2 x L2); one process per variant",
                 rows, failed)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
