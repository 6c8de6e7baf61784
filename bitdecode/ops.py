"""torch.library custom ops, so ``torch.compile`` traces around bitdecode calls.

``torch.ops.bitdecode.decode`` is ``decode_attention`` as an opaque op with a fake
(meta) implementation: a compiled graph keeps it as one node instead of breaking at the
Python dispatch, the kernel plans and the TVM-FFI launch.  ``bitdecode::append`` and
``bitdecode::prefill`` are the cache writes, mutating the cache tensors in place.  They
read the lengths on the device, not the host: an append that would pass the capacity is
refused there and flagged in the cache's ``overflow`` (``KVCache.check`` reports it), so a
compiled or graph-captured step stays safe without the host-side check of
``KVCache.append``.  The ``KVCache`` host-side lengths do not follow these ops;
``KVCache.check()`` brings them up to date.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch

from . import _validate, attention, backend as backends, reference
from .backend import CacheTensors
from .formats import KVFormat

_WRITES = ("k_pack", "k_params", "v_pack", "v_params", "k_res", "v_res", "cache_seqlens", "overflow", "commits",
           "k_sink", "v_sink")


@torch.library.custom_op("bitdecode::decode", mutates_args=())
def decode(q: torch.Tensor, k_pack: torch.Tensor, k_params: torch.Tensor, v_pack: torch.Tensor,
           v_params: torch.Tensor, k_res: torch.Tensor, v_res: torch.Tensor, cache_seqlens: torch.Tensor,
           block_table: torch.Tensor, k_sink: Optional[torch.Tensor], v_sink: Optional[torch.Tensor],
           bits: int, v_bits: int, k_mode: str, group_size: int, sink_tokens: int, fp4: str, hadamard: bool,
           softmax_scale: float, num_splits: int, backend: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """``bd.decode`` over the cache tensors: (out ``[B, T, Hq, D]``, lse ``[B, T, Hq]``);
    ``k_sink`` / ``v_sink`` the 16-bit sink tokens of a format with ``sink_tokens`` (else
    None); ``fp4`` the FP4 format (``KVFormat.fp4``) or ""; ``hadamard`` that of
    ``KVFormat.hadamard``: q comes in the model's basis, and is rotated as the cache's K was
    (as ``bd.decode`` does).  The values of the lengths and
    block table are not re-checked on the kernel backends (no device sync); on the
    reference, which reads them on the host anyway, they are."""
    cache, backend = _checked(k_pack, k_params, v_pack, v_params, k_res, v_res, cache_seqlens, block_table, k_sink,
                              v_sink, _format(bits, v_bits, k_mode, group_size, sink_tokens, fp4, hadamard), backend)
    return attention.decode_tensors(q, cache, softmax_scale=softmax_scale, num_splits=num_splits, backend=backend,
                                    return_lse=True)


@decode.register_fake
def _decode_fake(q, k_pack, k_params, v_pack, v_params, k_res, v_res, cache_seqlens, block_table, k_sink, v_sink,
                 bits, v_bits, k_mode, group_size, sink_tokens, fp4, hadamard, softmax_scale, num_splits, backend):
    # the metadata checks of the real op (a meta tensor among real ones reaches this, not
    # the op; the format's own where its numbers are given, not symbols of a dynamic
    # trace), then outputs laid out as the real ones: dense whatever q's strides are
    _validate.same_device(q=q, k_res=k_res)
    if all(type(n) is int for n in (bits, v_bits, group_size, sink_tokens)):
        cache = attention.check_cache(_format(bits, v_bits, k_mode, group_size, sink_tokens, fp4, hadamard), k_pack,
                                      k_params, v_pack, v_params, k_res, v_res, cache_seqlens, block_table,
                                      check_values=False, sinks=(k_sink, v_sink) if sink_tokens else None)
        attention.check_query(q, cache, "reference")
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


def _format(bits: int, v_bits: int, k_mode: str, group_size: int, sink_tokens: int, fp4: str,
            hadamard: bool) -> KVFormat:
    """The ``KVFormat`` the ops' scalar arguments describe (its Hadamard rotation is applied
    to Q and K by the ops, around the kernels, which never see it)."""
    if fp4:
        return KVFormat(fp4=fp4, sink_tokens=sink_tokens, hadamard=hadamard)
    return KVFormat(bits=bits, v_bits=v_bits, k_mode=k_mode, group_size=group_size, sink_tokens=sink_tokens,
                    hadamard=hadamard)


def _checked(k_pack, k_params, v_pack, v_params, k_res, v_res, cache_seqlens, block_table, k_sink, v_sink,
             fmt: KVFormat, backend: str) -> Tuple[CacheTensors, str]:
    """(the ops' cache tensors checked against ``fmt``, the backend that runs them:
    ``attention.run_on``).  Shapes are checked on the host (no sync); the lengths' and
    block table's values only where the reference runs."""
    cache = attention.check_cache(fmt, k_pack, k_params, v_pack, v_params, k_res, v_res, cache_seqlens, block_table,
                                  check_values=False, sinks=(k_sink, v_sink) if fmt.sink_tokens else None)
    return cache, attention.run_on(cache, backend)


def _format_args(fmt: KVFormat) -> tuple:
    return fmt.bits, fmt.v_bits, fmt.k_mode, fmt.group_size, fmt.sink_tokens, fmt.fp4 or "", fmt.hadamard


def decode_cache(q: torch.Tensor, cache, softmax_scale: float, backend: str = "auto") -> torch.Tensor:
    """``bd.decode(q, cache)`` through the op (for compiled code): ``cache`` is a ``KVCache``."""
    t = cache.tensors()
    k_sink, v_sink = t.sinks or (None, None)
    out, _ = torch.ops.bitdecode.decode(q, t.k_pack, t.k_params, t.v_pack, t.v_params, t.k_res, t.v_res,
                                        t.cache_seqlens, t.block_table, k_sink, v_sink, *_format_args(t.fmt),
                                        attention.softmax_scale_or_default(softmax_scale, q.shape[-1]), 0,
                                        cache.backend if backend == "auto" else backend)
    return out


def _write_cache(k, v, seqlens, k_pack, k_params, v_pack, v_params, k_res, v_res, cache_seqlens, block_table,
                 overflow, commits, k_sink, v_sink, bits, v_bits, k_mode, group_size, sink_tokens, fp4, hadamard,
                 capacity) -> CacheTensors:
    """A write op's checks that read no values, the op's and its fake's (a meta tensor among
    real ones dispatches to the fake, which must refuse it as the op would): ``k`` and ``v``
    (and a prefill's ``seqlens``) for the cache, the cache tensors against their format, the
    capacity and the write counters.  The cache tensors, with the capacity and counters."""
    _validate.new_tokens(k, v, k_res)  # (public ops: a shape torch would broadcast must not reach the cache)
    if seqlens is not None:
        _validate.tensor("seqlens", seqlens, dtypes=[torch.int32], shape=(k.shape[0],), device=k_res.device)
    c = attention.check_cache(_format(bits, v_bits, k_mode, group_size, sink_tokens, fp4, hadamard), k_pack,
                              k_params, v_pack, v_params, k_res, v_res, cache_seqlens, block_table,
                              check_values=False, sinks=(k_sink, v_sink) if sink_tokens else None)
    holds = c.block_table.shape[1] * c.page_size  # the tokens a sequence's pages hold
    if not 0 < capacity <= holds:
        raise ValueError(f"capacity must lie in [1, {holds}] for these pages ({c.block_table.shape[1]} of "
                         f"{c.page_size} tokens a sequence), got {capacity}")
    if seqlens is not None and k.shape[1] > capacity:  # (after the capacity itself is known sound)
        raise ValueError(f"prefill: k has {k.shape[1]} tokens, more than the capacity of {capacity}")
    for name, t in (("overflow", overflow), ("commits", commits)):
        _validate.tensor(name, t, dtypes=[torch.int32], shape=(k_res.shape[0],), contiguous=True,
                         device=k_res.device)
    return dataclasses.replace(c, capacity=capacity, overflow=overflow, commits=commits)


def _write_on(c: CacheTensors, backend: str) -> str:
    """The backend a write of ``c`` runs on (``attention.run_on``), refused before anything is
    written where the write could not finish (inference tensors outside inference mode)."""
    backend = attention.run_on(c, backend)
    if c.k_res.is_inference() and not torch.is_inference_mode_enabled():  # (torch would refuse mid-write)
        raise RuntimeError("the cache tensors were allocated under torch.inference_mode(), so torch refuses "
                           "in-place updates of them outside it; call the op inside inference_mode (nothing "
                           "was written)")
    return backend


def _write_fake(k, v, seqlens, *args) -> None:
    """A write op's fake (``args``: the op's after ``seqlens``): ``_write_cache``'s checks
    where the format's numbers are given, not symbols of a dynamic trace (then k and v's)."""
    k_res = args[4]  # (after k_pack, k_params, v_pack, v_params)
    bits, v_bits, _k_mode, group_size, sink_tokens, _fp4, _hadamard, capacity, _backend = args[-9:]
    if all(type(n) is int for n in (bits, v_bits, group_size, sink_tokens, capacity)):
        _write_cache(k, v, seqlens, *args[:-1])
    else:
        _validate.new_tokens(k, v, k_res)


@torch.library.custom_op("bitdecode::append", mutates_args=_WRITES)
def append(k: torch.Tensor, v: torch.Tensor, k_pack: torch.Tensor, k_params: torch.Tensor, v_pack: torch.Tensor,
           v_params: torch.Tensor, k_res: torch.Tensor, v_res: torch.Tensor, cache_seqlens: torch.Tensor,
           block_table: torch.Tensor, overflow: torch.Tensor, commits: torch.Tensor, k_sink: Optional[torch.Tensor],
           v_sink: Optional[torch.Tensor], bits: int, v_bits: int, k_mode: str, group_size: int,
           sink_tokens: int, fp4: str, hadamard: bool, capacity: int, backend: str) -> None:
    """``KVCache.append`` of ``k``, ``v`` ``[B, T, Hkv, D]`` on the cache tensors, with the
    capacity checked on the device (no host sync); ``k`` in the model's basis (the op
    rotates it under ``hadamard``, as ``KVCache.append`` does)."""
    from .cache import reference_append

    c = _write_cache(k, v, None, k_pack, k_params, v_pack, v_params, k_res, v_res, cache_seqlens, block_table,
                     overflow, commits, k_sink, v_sink, bits, v_bits, k_mode, group_size, sink_tokens, fp4, hadamard,
                     capacity)
    backend = _write_on(c, backend)
    k = reference.rotate(k, c.fmt)  # KVFormat.hadamard: K is stored rotated
    if backend == "reference":  # (the pages the appended lengths reach, as the lengths now were above)
        attention.check_block_table(c, (cache_seqlens + k.shape[1]).clamp(max=capacity))
        reference_append(c, k, v)
    else:
        backends.get(backend).append(c, k, v)


@append.register_fake
def _append_fake(k, v, *args) -> None:
    _write_fake(k, v, None, *args)


@torch.library.custom_op("bitdecode::prefill", mutates_args=_WRITES)
def prefill(k: torch.Tensor, v: torch.Tensor, seqlens: torch.Tensor, k_pack: torch.Tensor, k_params: torch.Tensor,
            v_pack: torch.Tensor, v_params: torch.Tensor, k_res: torch.Tensor, v_res: torch.Tensor,
            cache_seqlens: torch.Tensor, block_table: torch.Tensor, overflow: torch.Tensor, commits: torch.Tensor,
            k_sink: Optional[torch.Tensor], v_sink: Optional[torch.Tensor], bits: int, v_bits: int, k_mode: str,
            group_size: int, sink_tokens: int, fp4: str, hadamard: bool, capacity: int, backend: str) -> None:
    """``KVCache.prefill``: the first ``seqlens[b]`` (int32, on the cache's device) tokens of
    ``k``, ``v`` ``[B, N, Hkv, D]`` replace each sequence's content (``k`` in the model's
    basis: the op rotates it under ``hadamard``).  On the kernel backends
    the block table's and lengths' values are not re-checked here (``KVCache.prefill``
    checks them, a device sync); on the reference, which reads them on the host anyway,
    they are."""
    from .cache import reference_prefill

    c = _write_cache(k, v, seqlens, k_pack, k_params, v_pack, v_params, k_res, v_res, cache_seqlens, block_table,
                     overflow, commits, k_sink, v_sink, bits, v_bits, k_mode, group_size, sink_tokens, fp4, hadamard,
                     capacity)
    backend = _write_on(c, backend)
    k = reference.rotate(k, c.fmt)  # KVFormat.hadamard: K is stored rotated
    if backend == "reference":
        lens = seqlens.tolist()
        _validate.prompt_lengths("seqlens", lens, k.shape[1])  # (k.shape[1] <= capacity: checked above)
        attention.check_block_table(c, seqlens)
        reference_prefill(c, k, v, lens)
    else:
        backends.get(backend).prefill(c, k, v, seqlens)


@prefill.register_fake
def _prefill_fake(k, v, seqlens, *args) -> None:
    _write_fake(k, v, seqlens, *args)


def _write_args(cache):
    t = cache.tensors()
    k_sink, v_sink = t.sinks or (None, None)
    return (t.k_pack, t.k_params, t.v_pack, t.v_params, t.k_res, t.v_res, t.cache_seqlens, t.block_table,
            t.overflow, t.commits, k_sink, v_sink, *_format_args(t.fmt), t.capacity, cache.backend)


def append_cache(k: torch.Tensor, v: torch.Tensor, cache) -> None:
    """``cache.append(k, v)`` through the op (for compiled code): ``cache`` is a ``KVCache``;
    its host-side lengths are not advanced (``cache.check()`` does that)."""
    torch.ops.bitdecode.append(k, v, *_write_args(cache))


def prefill_cache(k: torch.Tensor, v: torch.Tensor, seqlens: torch.Tensor, cache) -> None:
    """``cache.prefill(k, v, seqlens)`` through the op, ``seqlens`` an int32 device tensor."""
    torch.ops.bitdecode.prefill(k, v, seqlens, *_write_args(cache))
