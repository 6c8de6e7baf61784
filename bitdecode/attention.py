"""Decode attention over a packed low-bit KV cache: the public entry points."""

from __future__ import annotations

import math
import numbers
from typing import Optional, Tuple

import torch

from . import _validate, backend as backends, dispatch, reference
from .backend import CacheTensors
from .formats import KVFormat
from .layouts.packing import LOG2_E


def check_cache(
    fmt,
    k_pack,
    k_params,
    v_pack,
    v_params,
    k_res,
    v_res,
    cache_seqlens,
    block_table,
    *,
    batch: Optional[int] = None,
    head_dim: Optional[int] = None,
    dtype: Optional[torch.dtype] = None,
    check_values: bool = True,
    sinks: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
) -> CacheTensors:
    """The validated ``CacheTensors`` of these tensors.  ``sinks``: the 16-bit sink tokens
    ``[B, S, Hkv, D]`` of a format with ``sink_tokens`` (the torch ops pass them; the
    functional ``decode_attention`` takes none)."""
    if not isinstance(fmt, KVFormat):
        raise TypeError(f"fmt must be a bitdecode.KVFormat, got {type(fmt).__name__}")
    if fmt.sink_tokens and sinks is None:
        raise ValueError(f"fmt has sink_tokens={fmt.sink_tokens}: the functional form takes no sink "
                         "buffers; use a KVCache")
    _validate.tensor("k_res", k_res, dtypes=[dtype] if dtype else _validate.FLOAT16_DTYPES, ndim=4)
    bsz, nr, hkv, d = k_res.shape
    batch = bsz if batch is None else batch
    head_dim = d if head_dim is None else head_dim
    fmt.check_head_dim(head_dim)
    dtype = k_res.dtype
    res_shape = (batch, fmt.residual_block, None, head_dim)
    _validate.tensor("k_res", k_res, dtypes=[dtype], shape=res_shape, contiguous=True)
    _validate.tensor("v_res", v_res, dtypes=[dtype], shape=k_res.shape, contiguous=True)
    _validate.tensor("k_pack", k_pack, dtypes=[torch.int32], ndim=4, contiguous=True)
    pages, _, page, _ = k_pack.shape
    if page % fmt.residual_block:
        raise ValueError(
            f"k_pack holds pages of {page} tokens; pages must be a multiple of the residual "
            f"block ({fmt.residual_block} tokens for {fmt.bits}-bit)"
        )
    _validate.tensor("k_pack", k_pack, shape=fmt.k_pack_shape(pages, hkv, page, head_dim))
    _validate.tensor("k_params", k_params, dtypes=[torch.int32], contiguous=True,
                     shape=fmt.k_params_shape(pages, hkv, page, head_dim))
    _validate.tensor("v_pack", v_pack, dtypes=[torch.int32], contiguous=True,
                     shape=fmt.v_pack_shape(pages, hkv, page, head_dim))
    _validate.tensor("v_params", v_params, dtypes=[torch.int32], contiguous=True,
                     shape=fmt.v_params_shape(pages, hkv, page, head_dim))
    _validate.tensor("cache_seqlens", cache_seqlens, dtypes=[torch.int32], shape=(batch,), contiguous=True)
    if block_table is None:
        if pages != batch:
            raise ValueError(
                f"without block_table the cache must hold one page per sequence: k_pack has "
                f"{pages} pages for batch {batch}"
            )
        block_table = torch.arange(batch, dtype=torch.int32, device=k_pack.device).view(batch, 1)
    else:
        _validate.tensor("block_table", block_table, dtypes=[torch.int32], ndim=2, contiguous=True)
        if block_table.shape[0] != batch:
            raise ValueError(f"block_table must have shape ({batch}, *), got {tuple(block_table.shape)}")
    _validate.same_device(k_res=k_res, v_res=v_res, k_pack=k_pack, k_params=k_params, v_pack=v_pack,
                          v_params=v_params, cache_seqlens=cache_seqlens, block_table=block_table)
    if fmt.sink_tokens:
        sink_shape = (batch, fmt.sink_tokens, hkv, head_dim)
        _validate.tensor("k_sink", sinks[0], dtypes=[dtype], shape=sink_shape, contiguous=True)
        _validate.tensor("v_sink", sinks[1], dtypes=[dtype], shape=sink_shape, contiguous=True)
        _validate.same_device(k_res=k_res, k_sink=sinks[0], v_sink=sinks[1])
    cache = CacheTensors(k_pack, k_params, v_pack, v_params, k_res, v_res, cache_seqlens, block_table, fmt,
                         sinks=tuple(sinks) if fmt.sink_tokens else None)
    if check_values and not capturing(k_pack.device):
        check_cache_values(cache)
    return cache


def capturing(device: torch.device) -> bool:
    """Whether work on ``device`` is being captured into a CUDA graph now."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def check_cache_values(cache: CacheTensors) -> None:
    """Data-dependent checks (one device sync): lengths and block-table range."""
    nr = cache.fmt.residual_block
    lens = cache.cache_seqlens
    if lens.numel():
        lo, hi = int(lens.min()), int(lens.max())
        cap = cache.max_packed_tokens + nr - 1
        if lo < 0 or hi // nr * nr > cache.max_packed_tokens:
            raise ValueError(
                f"cache_seqlens must lie in [0, {cap}] for this cache "
                f"({cache.block_table.shape[1]} pages of {cache.page_size} tokens + a "
                f"{nr}-token residual), got min {lo}, max {hi}"
            )
    check_block_table(cache, lens)


def check_lengths(cache: CacheTensors, lens) -> None:
    """A cache's sequence lengths ``lens`` (its device ``seqlens`` read to the host, plus
    what a write adds) must lie in ``[0, capacity]``: the host tracks the lengths itself, so
    a length outside is one written to ``seqlens`` on the device (bare tensors without a
    capacity are checked by their callers)."""
    if cache.capacity is None:
        return
    b = next((b for b, n in enumerate(lens) if not 0 <= n <= cache.capacity), None)
    if b is not None:
        raise ValueError(f"sequence {b} would hold {lens[b]} tokens, outside [0, {cache.capacity}] (the "
                         "capacity): the cache's seqlens were changed on the device, not by its calls; "
                         "prefill() or reset() starts again (nothing was written)")


def check_block_table(cache: CacheTensors, lens: torch.Tensor) -> None:
    """The pages sequences of lengths ``lens`` use (their packed blocks) must be valid,
    distinct pages (one device sync); unused entries may hold anything."""
    if cache.capacity is not None:
        check_lengths(cache, lens.tolist())
    nr = cache.fmt.residual_block
    if cache.block_table.numel():
        packed = (lens.long() - cache.fmt.sink_tokens).clamp(min=0)  # sink tokens hold no page
        used = (packed // nr * nr + cache.page_size - 1) // cache.page_size
        need = int(used.max()) if used.numel() else 0
        if need > cache.block_table.shape[1]:  # (a table resized in place, or handed in short)
            raise ValueError(f"block_table has {cache.block_table.shape[1]} pages a sequence, but these lengths "
                             f"need {need} pages of {cache.page_size} tokens")
        cols = torch.arange(cache.block_table.shape[1], device=lens.device)
        mask = cols[None, :] < used[:, None]
        vals = cache.block_table[mask]
        if vals.numel() and (int(vals.min()) < 0 or int(vals.max()) >= cache.num_pages):
            raise ValueError(
                f"block_table entries in use must lie in [0, {cache.num_pages}), got "
                f"[{int(vals.min())}, {int(vals.max())}]"
            )
        # a page in use by two sequences (or twice by one) would be packed over by both
        pages, counts = torch.unique(vals, return_counts=True)
        if counts.numel() and int(counts.max()) > 1:
            shared = int(pages[counts > 1][0])
            users = sorted(set(((cache.block_table == shared) & mask).nonzero()[:, 0].tolist()))
            raise ValueError(
                f"block_table entries in use must be distinct pages: page {shared} is used "
                f"more than once (sequences {users})"
            )


def check_query(q: torch.Tensor, cache: CacheTensors, backend: str) -> None:
    """q ``[B, T, Hq, D]``: ``T`` >= 1 query tokens (T > 1: the newest T of each sequence,
    already in the cache, causal)."""
    _validate.tensor("q", q, dtypes=[cache.k_res.dtype], last_contiguous=True,
                     shape=(cache.k_res.shape[0], None, None, cache.k_res.shape[3]))
    _validate.same_device(q=q, k_pack=cache.k_pack)
    if q.shape[1] == 0:
        raise ValueError("q must hold at least one query token per sequence (q.shape[1] >= 1), got 0")
    hq, hkv = q.shape[2], cache.k_res.shape[2]
    if hq % hkv or hq == 0:
        raise ValueError(f"q has {hq} heads, not a positive multiple of the cache's {hkv} KV heads")
    if capturing(q.device):
        refuse_host_reads_in_capture(q, cache, backend)
    if backend == "reference":
        return
    max_gqa = backends.get(backend).limits.max_gqa
    if hq // hkv > max_gqa:
        raise ValueError(
            f"q has {hq // hkv} query heads per KV head; the {backend} kernels support 1 to "
            f"{max_gqa} (use backend='reference' for more)"
        )


def refuse_host_reads_in_capture(q: torch.Tensor, cache: CacheTensors, backend: str) -> None:
    """While a CUDA graph is captured: refuse the decode paths that read the lengths on the
    host (the reference, ``chunk_decode``), whose sync would invalidate the capture with a
    CUDA error, before anything is written (an appending decode checks q first)."""
    if backend == "reference":
        what = "the reference backend"
    elif not fits_kernel_tile(q, cache, backend):
        rows = backends.query_rows(q.shape[1], q.shape[2], cache.k_res.shape[2])
        what = (f"{q.shape[1]} query tokens ({rows} rows a KV head, more than the {backend} kernels' "
                f"{backends.get(backend).limits.max_gqa}: the cache dequantized + SDPA)")
    else:
        return
    raise ValueError(f"q: {what} reads the sequence lengths on the host, which a CUDA graph capture "
                     "cannot do; run this call outside the capture (captured decodes take the kernels, "
                     "with at most the kernels' rows a KV head)")


def fits_kernel_tile(q: torch.Tensor, cache: CacheTensors, backend: str) -> bool:
    """Whether the kernels take q's query rows per KV head (tokens x heads) in one tile;
    more query tokens than that run ``chunk_decode``."""
    return backends.query_rows(q.shape[1], q.shape[2], cache.k_res.shape[2]) <= backends.get(backend).limits.max_gqa


def aligned_rows(q: torch.Tensor) -> bool:
    """Whether the kernels can take ``q`` as it is: dense, 16-byte aligned rows (else a
    copy: padded heads, a storage offset)."""
    return q.is_contiguous() and q.data_ptr() % 16 == 0


def reference_decode(q: torch.Tensor, cache: CacheTensors, scale: float, return_lse: bool):
    """``reference.decode`` over the cache tensors."""
    return reference.decode(q, cache.k_pack, cache.k_params, cache.v_pack, cache.v_params, cache.k_res,
                            cache.v_res, cache.cache_seqlens, cache.fmt, cache.block_table, scale, return_lse,
                            cache.sinks)


def chunk_decode(q: torch.Tensor, cache: CacheTensors, scale: float, return_lse: bool):
    """Query tokens past the kernels' tile (a chunked prefill, a long draft): each sequence's
    cache dequantized to the model dtype with the reference's unpacking (torch ops on the
    cache's device), then SDPA with the causal mask over the new tokens (one call per
    sequence; lengths are ragged).  Reads the lengths (one sync), so it is not
    graph-capturable.  With ``return_lse`` the reference's fp32 maths instead."""
    if return_lse:
        return reference_decode(q, cache, scale, True)
    tq = q.shape[1]
    outs = []
    for b, n in enumerate(cache.cache_seqlens.tolist()):
        k, v = reference.gather_kv(b, n, cache.k_pack, cache.k_params, cache.v_pack, cache.v_params, cache.k_res,
                                   cache.v_res, cache.block_table, cache.fmt, cache.sinks)  # [n, Hkv, D]
        causal = torch.ones(tq, n, dtype=torch.bool, device=q.device).tril(diagonal=n - tq)
        o = torch.nn.functional.scaled_dot_product_attention(
            q[b].transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            attn_mask=causal, scale=scale, enable_gqa=True)
        outs.append(o[0].transpose(0, 1))  # [T, Hq, D]
    return torch.stack(outs).to(q.dtype)


def softmax_scale_or_default(softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):  # (numpy scalars too)
        raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
    if not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
    return float(softmax_scale)


def check_splits(num_splits, backend: str) -> int:
    # the reference ignores the split count; it accepts what the kernel backends accept
    names = backends.shipped() if backend == "reference" else (backend,)
    top = max(backends.get(name).limits.max_splits for name in names)
    if (isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral) or num_splits < 0
            or num_splits > top):
        raise ValueError(f"num_splits must be an int in [0, {top}] (0 picks a heuristic), "
                         f"got {num_splits!r}")
    return int(num_splits)


def plan_decode(cache: CacheTensors, q: torch.Tensor, backend: str, num_splits: int, max_len: int,
                plans: Optional[dict] = None, append: bool = False):
    """The kernel backend's decode plan for this query shape (splits chosen when 0 for
    sequences of up to ``max_len`` tokens), kept in ``plans`` when given; ``append``: its
    kernel appends the step's new token first (the backend's ``appends``)."""
    kernels = backends.get(backend)
    splits = num_splits or kernels.choose_splits(cache, tuple(q.shape), max_len, q.device)
    key = (tuple(q.shape), q.dtype, backend, splits) + (("append",) if append else ())
    plan = plans.get(key) if plans is not None else None
    if plan is None:
        plan = kernels.plan(cache, tuple(q.shape), q.dtype, q.device, splits, append=append, max_len=max_len)
        if plans is not None:
            plans[key] = plan
    return plan


def run(q, cache: CacheTensors, *, softmax_scale, num_splits, backend, return_lse, max_len=None, plans=None,
        on_plan=None):
    """Validated dispatch shared by ``decode`` and ``decode_attention``.  ``max_len`` and
    ``plans``: a ``KVCache``'s longest sequence and its plan cache (without them a fresh
    plan, split for the cache's capacity); ``on_plan(plan, scale_log2)`` hears of a kernel
    plan that took ``q`` as it is (the cache keeps it for its fast path)."""
    scale = softmax_scale_or_default(softmax_scale, q.shape[-1])
    splits = check_splits(num_splits, backend)
    if backend == "reference":
        return reference_decode(q, cache, scale, return_lse)
    if not fits_kernel_tile(q, cache, backend):  # more query tokens than one tile takes
        return chunk_decode(q, cache, scale, return_lse)
    if max_len is None:
        max_len = cache.max_packed_tokens + cache.fmt.residual_block
    plan = plan_decode(cache, q, backend, splits, max_len, plans)
    scale_log2 = scale * LOG2_E
    if not aligned_rows(q):  # a copy, every call
        return plan(q.clone(memory_format=torch.contiguous_format), scale_log2, return_lse)
    if on_plan is not None:
        on_plan(plan, scale_log2)
    return plan(q, scale_log2, return_lse)


def decode_attention(
    q: torch.Tensor,
    k_pack: torch.Tensor,
    k_params: torch.Tensor,
    v_pack: torch.Tensor,
    v_params: torch.Tensor,
    k_res: torch.Tensor,
    v_res: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: Optional[torch.Tensor] = None,
    *,
    fmt: KVFormat,
    softmax_scale: Optional[float] = None,
    num_splits: int = 0,
    backend: str = "auto",
    return_lse: bool = False,
    check_values: bool = True,
):
    """Functional decode attention over a packed cache (layouts in ``KVFormat``/``layouts.sm80``).

    ``q``: ``[B, 1, Hq, D]`` fp16/bf16.  ``k_pack``/``v_pack``/``k_params``/``v_params``:
    int32 pages (``fmt.*_shape``); ``k_res``/``v_res``: ``[B, Nr, Hkv, D]`` 16-bit residual;
    ``cache_seqlens``: int32 ``[B]`` total tokens per sequence; ``block_table``: int32
    ``[B, max_pages]`` or None for one page per sequence.  ``check_values`` verifies the
    lengths and block-table range (one device sync; skipped under CUDA graph capture); the
    reference backend, which reads them on the host anyway, verifies them either way.
    Returns ``out`` ``[B, 1, Hq, D]`` (and ``lse`` ``[B, 1, Hq]`` fp32, natural log).
    """
    _validate.flag("return_lse", return_lse)
    _validate.flag("check_values", check_values)
    cache = check_cache(fmt, k_pack, k_params, v_pack, v_params, k_res, v_res, cache_seqlens,
                        block_table, check_values=check_values)
    backend = run_on(cache, backend, values_checked=check_values)
    return decode_tensors(q, cache, softmax_scale=softmax_scale, num_splits=num_splits, backend=backend,
                          return_lse=return_lse)


def run_on(cache: CacheTensors, backend: str, values_checked: bool = False) -> str:
    """``backend`` resolved for the cache's device; where that is the reference, which reads
    the lengths and the block table on the host anyway, their values are checked (unless
    ``values_checked``: a bad length would be read short, not refused)."""
    backend = dispatch.resolve(backend, cache.device, fmt=cache.fmt, head_dim=cache.head_dim, dtype=cache.dtype)
    if backend == "reference" and not values_checked:
        check_cache_values(cache)
    return backend


def decode_tensors(q, cache: CacheTensors, *, softmax_scale, num_splits, backend, return_lse):
    """Decode over validated cache tensors (``decode_attention``, the torch op) on the
    ``backend`` that ``run_on`` resolved for them: q checked (on the cache's device) and
    rotated as the format stores K."""
    check_query(q, cache, backend)
    q = reference.rotate(q, cache.fmt)  # KVFormat.hadamard: the cache holds K rotated
    return run(q, cache, softmax_scale=softmax_scale, num_splits=num_splits, backend=backend,
               return_lse=return_lse)
