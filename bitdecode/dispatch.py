"""Which implementation runs a call: the torch reference or a kernel backend (``backend.py``)."""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from . import _validate, jit
from . import backend as backends, selfcheck

BACKENDS = ("auto", "reference", "sm80", "sm90", "sm100")


def device_capability(device: torch.device) -> Optional[Tuple[int, int]]:
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if torch.compiler.is_compiling():
        # (traced by torch.compile, as in BitLinear's forward: Dynamo traces past an
        # lru_cache with a UserWarning to the user; the uncached read traces the same)
        return tuple(torch.cuda.get_device_capability(index))
    return jit.capability(index)


def capability_at_least(device: torch.device, major: int) -> bool:
    """True on a CUDA device of compute capability ``major``.x or newer."""
    cap = device_capability(device)
    return cap is not None and cap[0] >= major


def runnable(backend: str, device: torch.device) -> bool:
    cap = device_capability(device)
    return cap is not None and backend in backends.shipped() and backends.get(backend).supports(cap)


def available(device: torch.device) -> Tuple[str, ...]:
    """Backends usable on ``device`` with this build, ``auto``'s choice first."""
    kernels = tuple(b for b in backends.shipped() if runnable(b, device))
    return kernels + ("reference",)


def auto_order(device: torch.device, fmt=None, head_dim: int = 0, dtype: Optional[torch.dtype] = None) -> List[str]:
    """The kernel backends ``auto`` considers for a cache of format ``fmt`` (when given),
    best first: the registry's order among those that run on ``device`` and whose
    ``auto_picks`` takes the cache (which ones each takes, and the measurements behind it,
    are in its ``auto_picks``)."""
    kernels = [b for b in backends.shipped() if runnable(b, device)]
    if fmt is not None:
        kernels = [b for b in kernels if backends.get(b).auto_picks(fmt, head_dim, dtype)] or kernels
    return kernels


def resolve(backend: str, device: torch.device, what: str = "decode", fmt=None, head_dim: int = 0,
            dtype: Optional[torch.dtype] = None, first_use_checks: bool = True) -> str:
    """The backend a call runs: ``backend`` checked against the device, or ``auto``'s choice
    (for a cache of format ``fmt``, ``head_dim`` and ``dtype`` when given).  A backend whose
    kernels have not run on their GPU in this project is taken only for a known cache whose
    first-use check (``selfcheck``) passed on this device; ``first_use_checks=False`` takes
    the verdicts kept so far and runs none."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "reference":
        return backend
    if backend == "auto" and device.type != "cuda":
        return "reference"
    if backend == "auto":
        for b in auto_order(device, fmt, head_dim, dtype):
            if backends.get(b).hardware_validated or (
                    fmt is not None and selfcheck.verdict(b, device, fmt, head_dim, dtype, run=first_use_checks)):
                return b
        cap = device_capability(device)
        raise ValueError(
            f"no compiled {what} kernel supports {torch.cuda.get_device_name(device)} "
            f"(sm_{cap[0]}{cap[1]}); this build ships {backends.shipped()} (needs sm_80 or newer); "
            "use backend='reference' to run the torch reference"
        )
    if backend not in backends.shipped():
        raise ValueError(
            f"backend {backend!r} is not available for {what} in this build; "
            f"available kernel backends: {backends.shipped()}, or 'reference'"
        )
    if device.type != "cuda":
        raise ValueError(f"backend {backend!r} runs CUDA kernels, but the tensors are on {device}")
    if not runnable(backend, device):
        cap = device_capability(device)
        raise ValueError(
            f"backend {backend!r} does not run on {torch.cuda.get_device_name(device)} "
            f"(compute capability {cap})"
        )
    return backend


# --------------------------------------------------------------------------------------
# The small sm80-family kernels with one implementation on every arch (rope, dense):
# "auto" (the kernel when it takes the tensors), "reference" (torch's ops), "kernel"
# --------------------------------------------------------------------------------------

KERNEL_CHOICES = ("auto", "reference", "kernel")


def check_kernel_choice(backend: str) -> None:
    if backend not in KERNEL_CHOICES:
        raise ValueError(f"backend must be one of {KERNEL_CHOICES}, got {backend!r}")


def float16_kernel_fit(tensors) -> str:
    """Why a 16-bit kernel cannot take ``tensors`` ("" when it can): one fp16 / bf16 dtype,
    one CUDA device of compute capability 8.0+, no autograd (the kernels have no backward)."""
    first = tensors[0]
    if first.dtype not in _validate.FLOAT16_DTYPES or any(t.dtype != first.dtype for t in tensors):
        return f"one fp16 / bf16 dtype, got {[str(t.dtype) for t in tensors]}"
    if first.device.type != "cuda" or any(t.device != first.device for t in tensors):
        return f"CUDA tensors on one device, got {[str(t.device) for t in tensors]}"
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return "no autograd (the kernels are inference only: run under torch.no_grad())"
    if not capability_at_least(first.device, 8):
        return f"compute capability 8.0 or newer, {torch.cuda.get_device_name(first.device)} is older"
    return ""


def kernel_runs(backend: str, why: str, what: str) -> bool:
    """Whether ``backend`` runs the ``what`` kernel given ``why`` it cannot ("" when it
    can): never for "reference" or under torch.compile (torch's ops, which the compiler
    fuses); "kernel" raises a ValueError with ``why``."""
    if backend == "reference" or torch.compiler.is_compiling():
        return False
    if why and backend == "kernel":
        raise ValueError(f"the {what} kernel needs {why}")
    return not why

