"""Backend choice by the registry (CPU: the GPU's compute capability is faked)."""

from __future__ import annotations

import pytest
import torch

import bitdecode as bd
from bitdecode import backend as backends, dispatch

CUDA0 = torch.device("cuda", 0)


@pytest.fixture
def capability(monkeypatch):
    def use(cap):
        monkeypatch.setattr(dispatch, "device_capability", lambda device: cap if device.type == "cuda" else None)
    return use


def test_shipped_backends_best_first():
    assert backends.shipped()[-1] == "sm80"
    assert "sm90" in backends.shipped()


@pytest.mark.parametrize("cap, bits, head_dim, dtype, expect", [
    ((9, 0), 4, 128, torch.float16, "sm90"),  # Hopper: the TMA + wgmma kernel for 4-bit fp16 caches
    ((9, 0), 4, 64, torch.float16, "sm90"),
    ((9, 0), 4, 128, torch.bfloat16, "sm90"),  # ... and bf16 (since V's scale is folded into P)
    ((9, 0), 4, 128, None, "sm80"),  # ... nor an unknown dtype
    ((9, 0), 4, 256, torch.float16, "sm80"),  # ... nor head dim 256 (never timed)
    ((9, 0), 2, 128, torch.float16, "sm80"),  # ... nor 2-bit, where it measured slower
    ((8, 0), 4, 128, torch.float16, "sm80"),
    ((8, 9), 2, 64, torch.bfloat16, "sm80"),
    ((10, 0), 4, 128, torch.float16, "sm80"),  # the sm100 kernel is compile-verified only: sm80 on Blackwell
])
def test_auto_by_capability_format_and_dtype(capability, cap, bits, head_dim, dtype, expect):
    capability(cap)
    assert dispatch.resolve("auto", CUDA0, fmt=bd.KVFormat(bits=bits), head_dim=head_dim, dtype=dtype) == expect


def test_auto_without_format_takes_the_first_usable(capability):
    capability((9, 0))
    assert dispatch.resolve("auto", CUDA0) == "sm90"
    assert dispatch.available(CUDA0) == ("sm90", "sm80", "reference")


def test_explicit_backend_checked_against_the_device(capability, monkeypatch):
    capability((8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "A100")
    with pytest.raises(ValueError, match="backend 'sm90' does not run on"):
        dispatch.resolve("sm90", CUDA0)
    assert dispatch.resolve("sm80", CUDA0) == "sm80"


def test_too_old_gpu(capability, monkeypatch):
    capability((7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    with pytest.raises(ValueError, match="no compiled decode kernel supports Tesla T4"):
        dispatch.resolve("auto", CUDA0)


def test_compile_arch_maps_to_its_backend():
    assert backends.for_arch("sm_90a") == "sm90"
    assert backends.for_arch("sm_80") == "sm80"
    assert backends.for_arch("sm_86") == "sm80"
    assert backends.for_arch("sm_100a") == "sm100"


def test_auto_leaves_the_unvalidated_sm100_kernel_alone(capability):
    """Blackwell: ``auto`` keeps sm80 even for FP4 caches (the tcgen05 kernel has not run on a
    GPU); ``backend="sm100"`` opts in."""
    capability((10, 0))
    fmt = bd.KVFormat(fp4="nvfp4")
    assert dispatch.resolve("auto", CUDA0, fmt=fmt, head_dim=128, dtype=torch.float16) == "sm80"
    assert dispatch.resolve("auto", CUDA0) == "sm80"
    assert dispatch.available(CUDA0) == ("sm100", "sm80", "reference")
    assert dispatch.resolve("sm100", CUDA0) == "sm100"
    assert backends.get("sm100").runs_tcgen05(fmt, 128) and not backends.get("sm100").runs_tcgen05(fmt, 64)


def test_limits_come_from_the_backend():
    for name in backends.shipped():
        lim = backends.get(name).limits
        assert lim.max_gqa == 16 and lim.max_splits == 256
