"""``auto``'s first-use check of a backend whose kernels have not run on their GPU here.

A backend marked ``hardware_validated = False`` is taken by ``auto``, where its
``auto_picks`` wants it, only once a child process, ``bitdecode selfcheck``
(``cli_selfcheck``), has run it on this device for the cache's format, head dim and dtype
and found it equal to the torch reference.  (Today that backend is sm100, compiled for
sm_100a and emulated on the CPU, never run on a Blackwell GPU by this project; its
``auto_picks`` wants FP4 caches at head dims 128 / 256.)  A
child process, because a kernel that faults leaves its CUDA context unusable and one that
hangs never returns: either costs only the child, and ``auto`` keeps the validated
backend with a warning that says why.

Verdicts are kept for the process and on disk beside the compiled kernels (their
directory carries the sources' and the toolchain's fingerprint), keyed by the GPU's name
and compute capability and the configuration, so the check runs once per machine and
configuration; the child's compiled kernels land in the same disk cache, so the caller
does not compile them again.

``BITDECODE_SELFCHECK=0`` turns the check off (``auto`` never takes an unvalidated
backend); ``BITDECODE_SELFCHECK_TIMEOUT`` bounds the child in seconds, compilation
included (default 900).  ``BITDECODE_NO_DISK_CACHE=1`` keeps the verdicts in the process
only, as it keeps the kernels; a check that timed out or ran out of GPU memory is kept in
the process only too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ._files import write_whole
from .formats import KVFormat

ENV_SWITCH = "BITDECODE_SELFCHECK"
ENV_TIMEOUT = "BITDECODE_SELFCHECK_TIMEOUT"
DEFAULT_TIMEOUT_S = 900.0
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
TIMED_OUT = "the check did not finish in"  # such a verdict is kept for the process only
OUT_OF_MEMORY = "the check ran out of GPU memory"  # so is this one (the memory may be free later)

_verdicts: Dict[Tuple, Tuple[bool, str]] = {}


def format_json(fmt: KVFormat) -> str:
    """``fmt`` as the child's ``--format-json`` (every field ``KVFormat`` takes)."""
    fields = {f.name: getattr(fmt, f.name) for f in dataclasses.fields(fmt) if f.init}
    return json.dumps(fields, sort_keys=True)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def child_command(backend: str, device_index: int, fmt: KVFormat, head_dim: int, dtype: torch.dtype) -> List[str]:
    return [sys.executable, "-m", "bitdecode.cli", "selfcheck", "--backend", backend, "--device", str(device_index),
            "--format-json", format_json(fmt), "--head-dim", str(head_dim), "--dtype", dtype_name(dtype),
            "--json"]


def run_child(command: Sequence[str], timeout: float) -> Tuple[bool, str]:
    """Runs the check's child; its verdict, or why there is none (a crash, a timeout)."""
    env = dict(os.environ)
    env[ENV_SWITCH] = "0"  # the child names its backend; it never checks another one
    try:
        done = subprocess.run(list(command), capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return False, f"{TIMED_OUT} {timeout:.0f} s (a kernel that hangs, or a slow first compile: " \
                      f"raise {ENV_TIMEOUT})"
    lines = done.stdout.strip().splitlines()
    try:
        verdict = json.loads(lines[-1])
        return bool(verdict["ok"]), str(verdict["detail"])
    except (IndexError, ValueError, KeyError, TypeError):
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return False, f"the check's process exited with code {done.returncode}: {' | '.join(tail)}"


def _verdict_path(key: Tuple):
    from . import jit

    digest = hashlib.sha256(repr(key).encode()).hexdigest()[:24]
    return jit.cache_dir() / "selfcheck" / f"{digest}.json"


def _read_verdict(key: Tuple) -> Optional[Tuple[bool, str]]:
    from . import jit

    if not jit.disk_cache_on():  # (verdicts live beside the compiled kernels, under the same switch)
        return None
    try:
        saved = json.loads(_verdict_path(key).read_text())
        return (bool(saved["ok"]), str(saved["detail"])) if saved.get("key") == repr(key) else None
    except (OSError, RuntimeError, ValueError, KeyError, TypeError):
        return None


def _write_verdict(key: Tuple, verdict: Tuple[bool, str]) -> None:
    from . import jit

    if not jit.disk_cache_on():
        return
    try:
        path = _verdict_path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_whole(path, json.dumps({"key": repr(key), "ok": verdict[0], "detail": verdict[1]}))
    except (OSError, RuntimeError):  # a read-only cache directory, no home: the verdict lives for this process only
        pass


def timeout_s() -> float:
    """``$BITDECODE_SELFCHECK_TIMEOUT`` in seconds (default 900), refused by name where it is
    not a positive number."""
    value = os.environ.get(ENV_TIMEOUT) or ""
    if not value.strip():
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise ValueError(f"{ENV_TIMEOUT} must be a positive number of seconds, got {value!r}")
    return seconds


def verdict(backend: str, device: torch.device, fmt: KVFormat, head_dim: int, dtype: Optional[torch.dtype],
            run: bool = True) -> Optional[bool]:
    """Whether ``auto`` may take the unvalidated ``backend`` for this cache on ``device``:
    the kept verdict, else (``run``) the child's, else None (not checked yet).  Checked once
    per process, machine and configuration; a failure warns once."""
    if os.environ.get(ENV_SWITCH, "1") == "0" or dtype not in DTYPES.values() or not head_dim:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (backend, torch.cuda.get_device_name(index), tuple(torch.cuda.get_device_capability(index)),
           format_json(fmt), head_dim, dtype_name(dtype))
    if key in _verdicts:
        return _verdicts[key][0]
    found = _read_verdict(key)
    if found is None and not run:
        return None
    if found is None:
        found = run_child(child_command(backend, index, fmt, head_dim, dtype), timeout_s())
        # kept on disk unless it may pass another time: a slow first compile with a longer
        # timeout, a check that found the GPU's memory taken
        if not found[1].startswith((TIMED_OUT, OUT_OF_MEMORY)):
            _write_verdict(key, found)
    _verdicts[key] = found
    if not found[0]:
        warnings.warn(
            f"bitdecode: backend {backend!r} failed its first-use check on {key[1]} for {fmt.describe()}, "
            f"head_dim={head_dim}, {key[5]} ({found[1]}); auto uses the next backend "
            f"(backend={backend!r} still forces it; {ENV_SWITCH}=0 skips the check)",
            RuntimeWarning, stacklevel=4)
    return found[0]
