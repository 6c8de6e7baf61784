"""Which implementation runs a call: the torch reference or a compiled kernel family."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

BACKENDS = ("auto", "reference", "sm80", "sm90", "sm100")
KERNEL_BACKENDS = ("sm80", "sm90", "sm100")

# Kernel families this build ships for decode attention, best first.  A family runs on
# every GPU at least as new as its arch (sm80 code runs on Hopper and Blackwell too).
SHIPPED = ("sm80",)
MIN_CAPABILITY = {"sm80": (8, 0), "sm90": (9, 0), "sm100": (10, 0)}


def device_capability(device: torch.device) -> Optional[Tuple[int, int]]:
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


def runnable(backend: str, device: torch.device) -> bool:
    cap = device_capability(device)
    if cap is None:
        return False
    lo = MIN_CAPABILITY[backend]
    if backend == "sm90":  # wgmma / sm_90a code runs on Hopper only
        return cap[0] == 9
    if backend == "sm100":
        return cap[0] == 10
    return cap >= lo


def available(device: torch.device) -> Tuple[str, ...]:
    """Backends usable on ``device`` with this build, best first."""
    kernels = tuple(b for b in SHIPPED if runnable(b, device))
    return kernels + ("reference",)


def resolve(backend: str, device: torch.device, what: str = "decode") -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "reference":
        return backend
    if backend == "auto":
        if device.type != "cuda":
            return "reference"
        kernels = [b for b in SHIPPED if runnable(b, device)]
        if not kernels:
            cap = device_capability(device)
            raise ValueError(
                f"no compiled {what} kernel supports {torch.cuda.get_device_name(device)} "
                f"(sm_{cap[0]}{cap[1]}); this build ships {SHIPPED} (needs sm_80 or newer); "
                "use backend='reference' to run the torch reference"
            )
        return kernels[0]
    if backend not in SHIPPED:
        raise ValueError(
            f"backend {backend!r} is not available for {what} in this build; "
            f"available kernel backends: {SHIPPED}, or 'reference'"
        )
    if device.type != "cuda":
        raise ValueError(f"backend {backend!r} runs CUDA kernels, but the tensors are on {device}")
    if not runnable(backend, device):
        cap = device_capability(device)
        raise ValueError(
            f"backend {backend!r} needs compute capability >= {MIN_CAPABILITY[backend]}, "
            f"{torch.cuda.get_device_name(device)} has {cap}"
        )
    return backend
