"""``bitdecode bench``: the benchmark sweeps of ``profiles/`` (needs a GPU and a source checkout).

``bitdecode bench decode`` times decode (4 and 2 bits) against torch SDPA on the 16-bit
cache and the measured bandwidth roofline, plus prefill packing, append latency and a
CUDA-graph run, and FlashInfer's paged decode (fp16 and fp8 KV, its output checked against
SDPA) where ``flashinfer.decode`` imports (``pip install flashinfer-python==0.7.2.post1``; the
project's GPU host: ``eval "$(bash .device/fi-setup.sh)"`` first); ``bitdecode bench bitnet``
times the W2A8 GEMV/GEMM against bf16 and checks every GEMV configuration it times against
the reference (a wrong output is listed and the command exits 1).  Results go to
``profiles/<gpu>/<name>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from typing import Optional

from .cli import output_folder, print_error

SUITES = {"decode": "bench_decode.py", "bitnet": "bench_bitnet.py"}


def profiles_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "profiles"


def add_parser(sub, name: str, help_text: str) -> None:
    p = sub.add_parser(name, help=help_text, description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suite", choices=sorted(SUITES), help="which benchmark")
    p.add_argument("--out", type=output_folder, default=None, help="output dir (default profiles/<gpu>)")
    p.add_argument("--quick", action="store_true",
                   help="a few points only; decode: B=1 and 16 at 4K/32K/128K, every backend side by side, "
                        "written to decode_backends.json instead of decode.json")
    p.add_argument("--flush", choices=("clean", "dirty"), default="clean",
                   help="decode: how L2 is flushed before each timed call: clean (default; a read of a "
                        "2x-L2 buffer) or dirty (a 2x-L2 memset, as records before 2026-12-06 were timed: "
                        "the call then pays the write-back of the memset's lines)")


def check_args(args) -> Optional[str]:
    """An option the chosen suite does not take (refused before the GPU is looked for)."""
    if args.suite != "decode" and args.flush != "clean":
        return f"--flush: only the decode suite flushes L2 ({args.suite} rotates its operands)"
    return None


def _load(suite: str):
    path = profiles_dir() / SUITES[suite]
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: run the benchmarks from a source checkout")
    spec = importlib.util.spec_from_file_location(f"bitdecode_bench_{suite}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def gpu_dirname() -> str:
    import torch

    name = torch.cuda.get_device_name().lower()
    for key in ("h200", "h100", "a100", "b200", "l40", "4090"):
        if key in name:
            return key
    return name.replace(" ", "_")


def run(args) -> int:
    import torch
    from rich.console import Console
    from rich.progress import Progress

    console = Console()
    if not torch.cuda.is_available():
        print_error("bitdecode bench needs a CUDA GPU")
        return 2
    mod = _load(args.suite)
    out = args.out or profiles_dir() / gpu_dirname()
    # no refresh thread: it would take the GIL from the eager timings
    with Progress(console=console, auto_refresh=False) as progress:
        kw = {"flush": args.flush} if args.suite == "decode" else {}
        result = mod.run(out, quick=args.quick, progress=progress, **kw)
    if hasattr(mod, "print_summary"):
        mod.print_summary(result)
    console.print(f"results in {out}")
    if result.get("wrong_outputs"):  # (a kernel the run timed gave a wrong result: the run fails)
        print_error(f"wrong outputs: {', '.join(result['wrong_outputs'])}")
        return 1
    return 0
