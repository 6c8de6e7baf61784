"""``bitdecode info``: versions, GPUs and their arch, usable backends (decode and BitNet), compile cache dir."""

from __future__ import annotations

import argparse
import os
import platform

import torch

from . import __version__, dispatch, jit, selfcheck
from .cli import DTYPE_NAMES, torch_dtype
from .formats import KVFormat

def add_parser(subparsers, name: str, help_text: str) -> argparse.ArgumentParser:
    return subparsers.add_parser(name, help=help_text, description=help_text)


def _version(module: str) -> str:
    try:
        mod = __import__(module)
    except Exception as exc:  # a broken install is worth showing, not crashing on
        return f"[red]not importable[/] ({type(exc).__name__}: {exc})"
    return str(getattr(mod, "__version__", "unknown"))


def _gpus():
    """(label, backends, device) for every visible GPU; one ("no GPU", ...) row without one."""
    if not torch.cuda.is_available():
        cpu = torch.device("cpu")
        return [("no GPU", dispatch.available(cpu), cpu)]
    rows = []
    for i in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(i)
        label = (f"cuda:{i} {torch.cuda.get_device_name(i)}, compute capability "
                 f"{major}.{minor} (sm_{major}{minor})")
        rows.append((label, dispatch.available(torch.device("cuda", i)), torch.device("cuda", i)))
    return rows


def _auto_pick(device, fmt, head_dim, dtype) -> str:
    """``auto``'s backend for a cache, running no first-use check (``selfcheck``): one not
    run yet is named beside the pick."""
    pick = dispatch.resolve("auto", device, fmt=fmt, head_dim=head_dim, dtype=dtype, first_use_checks=False)
    order = dispatch.auto_order(device, fmt, head_dim, dtype)
    before = order[: order.index(pick)] if pick in order else []
    waiting = [b for b in before if selfcheck.verdict(b, device, fmt, head_dim, dtype, run=False) is None]
    return f"{pick} ({waiting[0]} after its first-use check)" if waiting else pick


def _bitnet_kernels(device) -> str:
    """What ``bitnet.gemv`` / ``gemm`` run on ``device``: its backend's BitNet kernels."""
    if device.type != "cuda" or not dispatch.capability_at_least(device, 8):
        return "torch reference (the kernels need a CUDA GPU of sm_80 or newer)"
    from . import bitnet

    kernels = bitnet.kernels_for(device)
    gemv = "dp4a register kernel" + (" + bulk-copy stripe kernel" if kernels.stripe_gemv else "")
    return f"GEMV: {gemv}; GEMM: {' / '.join(kernels.gemm_kernels)}"


def _gemv_tuning() -> str:
    """Where measured GEMV configurations come from (``bitnet_tune``): the file named by
    ``$BITDECODE_GEMV_TUNING`` and how many entries of which GPUs it holds."""
    from rich.markup import escape

    from . import bitnet_tune

    env = bitnet_tune.ENV_GEMV_TUNING
    if not os.environ.get(env, "").strip():
        return f"none (${env} unset; `bitdecode tune` measures them)"
    try:
        entries = bitnet_tune.entries()
    except ValueError as e:
        return f"[red]{escape(str(e))}[/]"
    gpus = sorted({f"{e['gpu']} ({e['sms']} SMs)" for e in entries})
    return f"{len(entries)} shape(s) from ${env} = {escape(os.environ[env])}" + (f": {', '.join(gpus)}" if gpus else "")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"bitdecode {__version__}", show_header=True, header_style="bold")
    table.add_column("item", style="cyan", no_wrap=True)
    table.add_column("value")
    table.add_row("Python", f"{platform.python_version()} ({platform.python_implementation()})")
    cuda = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build"
    table.add_row("torch", f"{torch.__version__} ({cuda})")
    table.add_row("CuTe DSL (nvidia-cutlass-dsl)", _version("cutlass"))
    table.add_row("TVM-FFI (apache-tvm-ffi)", _version("tvm_ffi"))
    for label, backends, device in _gpus():
        table.add_row("GPU", label)
        table.add_row("  backends", ", ".join(backends))
        formats = {"4-bit": KVFormat(bits=4), "2-bit": KVFormat(bits=2), "NVFP4": KVFormat(fp4="nvfp4")}
        picks = {(name, d, dt): _auto_pick(device, fmt, d, torch_dtype(dt))
                 for name, fmt in formats.items() for d in (128, 256) for dt in DTYPE_NAMES}
        table.add_row("  auto picks", ", ".join(f"{name} D{d} {dt}: {b}" for (name, d, dt), b in picks.items()))
        table.add_row("  BitNet W2A8", _bitnet_kernels(device))
    table.add_row("GEMV tuning", _gemv_tuning())
    table.add_row("compile cache", _cache_row())
    Console().print(table)
    return 0


def _cache_row() -> str:
    """The compiled kernels' disk cache: $BITDECODE_CACHE_DIR (else ~/.cache/bitdecode) /
    the build's fingerprint, or why there is none (switched off, no folder, a broken CuTe
    DSL install: the row says so, the rest of the table still prints)."""
    from rich.markup import escape

    if not jit.disk_cache_on():
        return f"off [dim](${jit.ENV_DISABLE_DISK}={escape(repr(os.environ[jit.ENV_DISABLE_DISK]))})[/]"
    env = jit.ENV_CACHE_DIR
    source = f"from ${env}" if os.environ.get(env) else f"default, ${env} unset"
    try:
        path = jit.cache_dir()
        exists = "" if path.is_dir() else "; not created yet"
    except Exception as exc:  # noqa: BLE001 - an unreadable folder, no home, cutlass not importable
        return f"unavailable [dim]({source}: {escape(type(exc).__name__ + ': ' + str(exc))})[/]"
    return f"{escape(str(path))} [dim]({source}{exists})[/]"
