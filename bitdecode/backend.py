"""The backend interface: what the API asks of a kernel family, and the registry of them.

Each ``kernels_smXX`` package owns one backend object (its host glue: decode plans, the
split heuristic, compile functions next to the kernel classes, prefill / append).  The
API (``attention``, ``cache``, ``dispatch``) talks to backends only through this module,
so imports run one way: API -> ``backend`` <- ``kernels_smXX`` -> ``layouts``.  Backend
modules are imported lazily: ``import bitdecode`` never imports CuTe DSL.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from dataclasses import dataclass
from typing import Callable, List, NamedTuple, Optional, Protocol, Tuple

import torch

from .formats import KVFormat

# kernel families, best first (``auto`` takes the first that supports the device and the
# cache: ``Backend.supports`` / ``auto_picks``); sm80 code runs on Hopper and Blackwell too,
# sm_90a / sm_100a code only on its own arch
REGISTRY = {
    "sm100": "kernels_sm100.backend",
    "sm90": "kernels_sm90.backend",
    "sm80": "kernels_sm80.backend",
}


@dataclass(frozen=True)
class CacheTensors:
    """The validated tensors of a packed cache, as the kernels and the reference take them."""

    k_pack: torch.Tensor
    k_params: torch.Tensor
    v_pack: torch.Tensor
    v_params: torch.Tensor
    k_res: torch.Tensor
    v_res: torch.Tensor
    cache_seqlens: torch.Tensor
    block_table: torch.Tensor
    fmt: KVFormat
    # what the writes need beyond the storage (a KVCache's; None for bare tensors, which
    # are only read): tokens a sequence may hold, the lengths refused appends asked for
    # (int32 [B], 0 = none) and the append kernel's per-sequence commit counters (int32 [B])
    capacity: Optional[int] = None
    overflow: Optional[torch.Tensor] = None
    commits: Optional[torch.Tensor] = None
    # a format with sink tokens: their 16-bit K, V ``[B, S, Hkv, D]`` (reference backend)
    sinks: Optional[Tuple[torch.Tensor, torch.Tensor]] = None

    @property
    def page_size(self) -> int:
        return self.k_pack.shape[2]

    @property
    def num_pages(self) -> int:
        return self.k_pack.shape[0]

    @property
    def max_packed_tokens(self) -> int:
        return self.block_table.shape[1] * self.page_size

    @property
    def device(self) -> torch.device:
        return self.k_res.device

    @property
    def dtype(self) -> torch.dtype:
        return self.k_res.dtype

    @property
    def head_dim(self) -> int:
        return self.k_res.shape[3]


@dataclass(frozen=True)
class Limits:
    max_gqa: int  # query heads per KV head that one kernel tile holds
    max_splits: int  # the largest num_splits a decode call accepts


class Variant(NamedTuple):
    """One compiled kernel configuration (what ``bitdecode compile`` builds)."""

    kind: str
    dtype: str
    head_dim: int
    bits: int = 0
    k_mode: str = ""
    group_size: int = 0
    extra: Tuple = ()
    fp4: str = ""  # an FP4 format (KVFormat.fp4) instead of bits / k_mode / group_size

    @property
    def name(self) -> str:
        parts = [self.kind, self.dtype, f"d{self.head_dim}"]
        if self.fp4:
            parts.append(self.fp4)
        elif self.bits:
            parts += [f"{self.bits}bit", self.k_mode, f"g{self.group_size}"]
        parts += [str(e) for e in self.extra]
        return "_".join(parts)


DecodeFn = Callable[..., object]  # (q, scale_log2, return_lse[, new]) -> out | (out, lse)


class BitnetKernels(Protocol):
    """The BitNet W2A8 GEMV / GEMM of a backend (``bitdecode.bitnet`` launches them)."""

    gemm_kernels: Tuple[str, ...]  # what ``bitnet.gemm(kernel=...)`` may name besides "auto"
    stripe_gemv: bool  # whether it runs the bulk-copy stripe GEMV (``GemvConfig.bulk``)

    def compile_act_quant(self, bf16: bool, eps: float, options: str): ...

    def compile_norm_quant(self, bf16: bool, eps: float, norm_eps: float, options: str, **flags): ...

    def gemv_config(self, n: int, k: int, sms: int): ...

    def gemv_configs(self) -> list: ...

    def gemv_key(self, cfg, k: int) -> tuple:
        """What one GEMV compilation serves (refuses a configuration it cannot build)."""

    def compile_gemv(self, cfg, k: int, options: str): ...

    def gemv_launch_size(self, cfg, n: int, k: int, sms: int) -> int: ...

    def default_gemm_kernel(self, m: int, n: Optional[int] = None, k: Optional[int] = None) -> str: ...

    def gemm_plan(self, kernel: str, m: int, n: int, k: int, sms: int, raw: bool, pdl: bool) -> tuple:
        """(configuration, launch arguments after the segment ends, split-K workspace
        ``(values, tiles)`` or None)."""

    def compile_gemm(self, kernel: str, cfg, options: str): ...


class DenseKernels(Protocol):
    """A backend's 16-bit kernels of a model's decode step (``bitdecode.dense`` and
    ``bitdecode.rope`` launch them): the few-token GEMV, the small-M GEMM, SwiGLU and the
    rotary embedding."""

    def compile_gemv(self, bf16: bool, k: int, tokens: int, has_bias: bool, options: str, *, pdl: bool,
                     has_residual: bool, residual_ahead: bool): ...

    def gemv_rows_per_warp(self, n: int, k: int, sms: int) -> int:
        """Output rows each warp of the GEMV streams for N x K weights on ``sms`` SMs."""

    def compile_gemm_small_m(self, bf16: bool, k: int, tokens: int, options: str, *, pdl: bool,
                             has_residual: bool, residual_ahead: bool, **config):
        """``config``: tile settings other than the kernel's defaults (benchmarks time them)."""

    def compile_silu_mul(self, bf16: bool, options: str, *, pdl: bool): ...

    def compile_rope(self, bf16: bool, head_dim: int, options: str): ...


class Backend(Protocol):
    name: str
    limits: Limits
    bitnet: BitnetKernels
    dense: DenseKernels

    def supports(self, capability: Tuple[int, int]) -> bool: ...

    # False: its kernels have not run on its GPU in this project; ``auto`` takes it only after
    # its first-use check passes on the device (``bitdecode.selfcheck``)
    hardware_validated: bool

    def auto_picks(self, fmt: KVFormat, head_dim: int, dtype: Optional[torch.dtype] = None) -> bool:
        """Whether ``auto`` takes it for a cache of this format, head dim and dtype (None:
        not known yet)."""

    def fp4_operands(self, fmt: KVFormat, head_dim: int) -> bool:
        """Whether its decode of such a cache takes Q and P as FP4 terms (the sm100
        block-scaled kernel): its results then follow ``emulate_sm100`` too, and
        ``bitdecode selfcheck`` holds it to that spec besides the reference's tolerance rule."""

    def choose_splits(self, cache: CacheTensors, q_shape: Tuple[int, ...], max_len: int,
                      device: torch.device) -> int: ...

    def call_backend(self, cache: CacheTensors, q_shape: Tuple[int, ...], max_len: int) -> str:
        """The backend that ``auto`` runs one ``KVCache.decode`` of this query shape on, over
        sequences of at most ``max_len`` tokens: this one, or another whose kernels measured
        faster for such calls over the same packed cache (sm90 hands short small grids to
        sm80)."""

    def plan(self, cache: CacheTensors, q_shape: Tuple[int, ...], q_dtype: torch.dtype,
             device: torch.device, splits: int, append: bool = False, max_len: int = 0) -> DecodeFn: ...

    # whether its decode kernel can append the step's new token itself: ``plan(append=True)``
    # then gives a plan with ``append_step(q, k_new, v_new, scale_log2, return_lse, stream)``
    # (``KVCache.decode``)
    appends: bool
    # the most splits an appending decode takes (its last CTA merges them; more take append
    # + decode and the combine kernel)
    append_max_splits: int

    def takes_rows(self, t: torch.Tensor) -> bool:
        """Whether new tokens ``[B, T, Hkv, D]`` laid out as ``t`` go to its kernels as they are."""

    def prefill(self, cache: CacheTensors, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor) -> None: ...

    def append(self, cache: CacheTensors, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def appender(self, cache: CacheTensors) -> Callable[[torch.Tensor, torch.Tensor], None]:
        """``append`` bound to one cache (what a decode loop calls)."""

    def variants(self, kinds, formats, head_dims, dtypes) -> List[Variant]: ...

    def compile_variant(self, arch: str, variant: Variant, keep_ptx: bool = False, cached: bool = False): ...


def query_rows(tq: int, q_heads: int, kv_heads: int) -> int:
    """Query rows of one KV head in a decode tile: its query heads times the query tokens
    (``limits.max_gqa`` bounds it)."""
    return tq * (q_heads // kv_heads)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached)."""
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _module_name(name: str) -> str:
    if name not in REGISTRY:
        raise ValueError(f"unknown kernel backend {name!r}; known: {tuple(REGISTRY)}")
    return f"{__package__}.{REGISTRY[name]}"


@functools.lru_cache(maxsize=None)
def shipped() -> Tuple[str, ...]:
    """Registry names whose backend module is installed, best first."""
    out = []
    for name in REGISTRY:
        try:
            if importlib.util.find_spec(_module_name(name)) is not None:
                out.append(name)
        except ModuleNotFoundError:
            pass
    return tuple(out)


@functools.lru_cache(maxsize=None)
def get(name: str) -> Backend:
    """The backend object of ``name`` (imports its kernel package on first use)."""
    if name not in shipped():
        raise ValueError(f"backend {name!r} is not available in this build; shipped: {shipped()}")
    return importlib.import_module(_module_name(name)).BACKEND


def of_arch(arch: str) -> Backend:
    """The backend object of ``for_arch(arch)``: whose kernels a CuTe DSL target takes."""
    name = for_arch(arch)
    if name is None:
        raise ValueError(f"no kernel backend builds for {arch!r}: the kernels need sm_80 or newer")
    return get(name)


def for_arch(arch: str) -> Optional[str]:
    """The backend whose kernels ``bitdecode compile --arch`` builds for a CuTe DSL target."""
    major = int(arch[3:].rstrip("a")) // 10
    if major == 10 and "sm100" in shipped():
        return "sm100"
    if major == 9 and "sm90" in shipped():
        return "sm90"
    return "sm80" if major >= 8 else None
