"""KVCache: a preallocated, packed low-bit KV cache with a 16-bit residual block."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch

from . import _validate, attention, backend as backends, dispatch, jit, reference
from .backend import CacheTensors
from .formats import KVFormat

# what ``decode(q, cache, k_new=, v_new=)`` calls the tokens it appends (its errors name them)
NEW_NAMES = ("k_new", "v_new")


class CacheOverflowError(RuntimeError):
    """An append was refused on the device: it would have passed the cache's capacity."""


class KVCache:
    """Packed K/V pages + params + a 16-bit residual block per sequence.

    Storage (see ``KVFormat`` and ``layouts.sm80`` for the bit layouts)::

        k_pack    int32 [pages, Hkv, page, D*bits/32]
        k_params  int32 [pages, Hkv, page/G, D] (K per channel) or [pages, Hkv, page, D/G]
        v_pack    int32 [pages, Hkv, page/Nr, D, Nr*bits/32]
        v_params  int32 [pages, Hkv, page/16, D/G, 16]
        k_res     dtype [B, Nr, Hkv, D]   newest len % Nr tokens, 16-bit
        v_res     dtype [B, Nr, Hkv, D]
        seqlens   int32 [B]               tokens per sequence (device)
        block_table int32 [B, pages per sequence]
        overflow  int32 [B]               0, or the length a refused append asked for

    Without ``page_size`` every sequence owns one page of ``max_seqlen`` (rounded up to Nr)
    tokens.  Appends write in place; a residual block that fills is quantized and packed
    into the pages.  Host-side copies of the lengths let every call check capacity before
    anything is written, without a device sync.  A CUDA graph replays an append without
    the host, so the kernels check capacity again: a sequence that would pass ``capacity``
    is not written and keeps its length, and ``check()`` reports it.
    """

    def __init__(self, fmt: KVFormat, dtype: torch.dtype, max_seqlen: int, backend: str,
                 k_pack, k_params, v_pack, v_params, k_res, v_res, seqlens, block_table,
                 k_sink: Optional[torch.Tensor] = None, v_sink: Optional[torch.Tensor] = None):
        self.fmt = fmt
        self.dtype = dtype
        self.max_seqlen = max_seqlen
        self.backend = backend
        # whether ``auto`` picked ``backend`` (``allocate``): then a decode with ``backend="auto"``
        # may run on the one ``backend`` hands its call to (``_auto_backend``); a backend named
        # at allocation runs every such call
        self._auto_picked = False
        self.k_pack, self.k_params = k_pack, k_params
        self.v_pack, self.v_params = v_pack, v_params
        self.k_res, self.v_res = k_res, v_res
        self._seqlens, self._block_table = seqlens, block_table  # (read-only properties)
        self.k_sink, self.v_sink = k_sink, v_sink  # [B, S, Hkv, D] 16-bit, fmt.sink_tokens > 0
        # host-side lengths without a device sync: per-sequence base + the tokens appended
        # since (an append adds the same count to every sequence), and their maximum
        self._host_base: List[int] = [0] * k_res.shape[0]
        self._host_added = 0
        self._host_max = 0
        self._append_key = None  # (k, v) shapes / dtypes / devices / strides last validated
        self._appender = None  # the backend's compiled append, bound to this cache
        self.overflow = torch.zeros_like(seqlens)
        # the storage tensors are fixed for the cache's lifetime (written in place only), so
        # compiled-kernel plans built for them can be reused call after call
        self._tensors = CacheTensors(k_pack, k_params, v_pack, v_params, k_res, v_res, seqlens, block_table, fmt,
                                     capacity=max_seqlen, overflow=self.overflow,
                                     commits=torch.zeros_like(seqlens),
                                     sinks=(k_sink, v_sink) if k_sink is not None else None)
        self._plans: dict = {}
        # the device's kind and index, fixed for the cache's lifetime (read on every step)
        self._on_cuda, self._device_index = k_res.is_cuda, k_res.get_device()
        self._fast = None  # (validated call key, plan, scale_log2) of the last kernel decode
        # ... of the last appending decode (``decode(k_new=, v_new=)``), with whether its k / v
        # are laid out as the kernel takes them
        self._fast_append = None
        self._fuse_room: Optional[int] = None  # ``_append_room``'s answer, until lengths change
        # (backend name, whether its decode kernel can append: ``_kernel_appends``)
        self._appends = (None, False)
        self._query_checked = None  # ``_check_query_once``'s key of the last q and options it passed
        # allocated under torch.inference_mode(): torch's in-place ops on these tensors then
        # raise outside it, after some have run (``_check_inference_writes``)
        self._inference_tensors = seqlens.is_inference()
        # (the block table's version counter, per-sequence lengths) it was last verified for:
        # a prefill within them, the table unchanged in place since, needs no check (a sync)
        self._table_verified: Optional[Tuple[int, Tuple[int, ...]]] = None

    def __getstate__(self) -> dict:
        """What ``copy.deepcopy`` and pickle take: the tensors and lengths, not what is bound
        to this cache's own tensors (the compiled plans and appender hold them: a copy builds
        its own at its first call; the block table verified at a version of this table's
        counter: a copy's table has a counter of its own, so its first prefill checks it)."""
        return {**self.__dict__, "_plans": {}, "_fast": None, "_fast_append": None, "_appender": None,
                "_table_verified": None}

    # ---- construction -----------------------------------------------------------------
    @classmethod
    def allocate(
        cls,
        batch: int,
        num_kv_heads: int,
        head_dim: int,
        max_seqlen: int,
        fmt: KVFormat,
        dtype: torch.dtype = torch.float16,
        device: Union[str, torch.device] = "cuda",
        page_size: Optional[int] = None,
        backend: str = "auto",
    ) -> "KVCache":
        if not isinstance(fmt, KVFormat):
            raise TypeError(f"fmt must be a bitdecode.KVFormat, got {type(fmt).__name__}")
        # (each as a Python int: numpy's ints pass the checks, and sizes are stored)
        batch = _validate.positive_int("batch", batch)
        num_kv_heads = _validate.positive_int("num_kv_heads", num_kv_heads)
        max_seqlen = _validate.positive_int("max_seqlen", max_seqlen)
        head_dim = _validate.positive_int("head_dim", head_dim)
        fmt.check_head_dim(head_dim)
        if fmt.sink_tokens > max_seqlen:  # (16-bit sink buffers no sequence could fill)
            raise ValueError(f"fmt.sink_tokens={fmt.sink_tokens} exceeds max_seqlen={max_seqlen}: a sequence "
                             "holds at most max_seqlen tokens, so fewer sinks")
        _validate.model_dtype("dtype", dtype)
        device = _validate.device("device", device)
        picked = backend == "auto"
        backend = dispatch.resolve(backend, device, what="KV cache", fmt=fmt, head_dim=head_dim, dtype=dtype)
        nr = fmt.residual_block
        packed_cap = -(-max_seqlen // nr) * nr
        if page_size is None:
            page, per_seq = packed_cap, 1
        else:
            page_size = _validate.positive_int("page_size", page_size)
            if page_size > MAX_SEQLEN:
                raise ValueError(f"page_size must be at most {MAX_SEQLEN} tokens (lengths are int32 on the "
                                 f"device), got {page_size}")
            if page_size % nr:
                raise ValueError(
                    f"page_size must be a multiple of the residual block ({nr} tokens for "
                    f"{fmt.bits}-bit), got {page_size}"
                )
            page, per_seq = page_size, -(-packed_cap // page_size)
        if packed_cap > MAX_SEQLEN:
            raise ValueError(f"max_seqlen must be at most {MAX_SEQLEN} (lengths are int32 on the device), "
                             f"got {max_seqlen}")
        pages = batch * per_seq
        i32 = dict(dtype=torch.int32, device=device)
        args = (pages, num_kv_heads, page, head_dim)
        sink = (batch, fmt.sink_tokens, num_kv_heads, head_dim)
        try:
            sinks = {} if not fmt.sink_tokens else dict(k_sink=torch.zeros(sink, dtype=dtype, device=device),
                                                        v_sink=torch.zeros(sink, dtype=dtype, device=device))
            cache = cls(
                fmt, dtype, max_seqlen, backend,
                torch.zeros(fmt.k_pack_shape(*args), **i32),
                torch.zeros(fmt.k_params_shape(*args), **i32),
                torch.zeros(fmt.v_pack_shape(*args), **i32),
                torch.zeros(fmt.v_params_shape(*args), **i32),
                torch.zeros(batch, nr, num_kv_heads, head_dim, dtype=dtype, device=device),
                torch.zeros(batch, nr, num_kv_heads, head_dim, dtype=dtype, device=device),
                torch.zeros(batch, **i32),
                torch.arange(pages, **i32).view(batch, per_seq),
                **sinks,
            )
        except RuntimeError as e:  # (torch.OutOfMemoryError on CUDA, a RuntimeError from the CPU allocator)
            if not isinstance(e, torch.OutOfMemoryError) and "allocate" not in str(e):
                raise
            gib = pages * page * num_kv_heads * fmt.bytes_per_token(head_dim) / 2**30
            # the 16-bit buffers: the residual blocks and the sink tokens (K and V each)
            gib16 = 2 * batch * (nr + fmt.sink_tokens) * num_kv_heads * head_dim * 2 / 2**30
            raise torch.OutOfMemoryError(
                f"KVCache.allocate(batch={batch}, num_kv_heads={num_kv_heads}, head_dim={head_dim}, "
                f"max_seqlen={max_seqlen}, fmt={fmt}): its packed pages need {gib:.2f} GiB and its 16-bit "
                f"residual and sink buffers {gib16:.2f} GiB on {device}, which could not be allocated "
                f"({str(e).splitlines()[0]})") from e
        cache._auto_picked = picked
        # distinct, in-range pages by construction, for every length the cache can hold
        version = _validate.version_counter(cache.block_table)
        cache._table_verified = None if version is None else (version, (max_seqlen,) * batch)
        return cache

    # ---- shape facts -------------------------------------------------------------------
    @property
    def batch(self) -> int:
        return self.k_res.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.k_res.shape[2]

    @property
    def head_dim(self) -> int:
        return self.k_res.shape[3]

    @property
    def device(self) -> torch.device:
        return self.k_res.device

    @property
    def page_size(self) -> int:
        return self.k_pack.shape[2]

    @property
    def capacity(self) -> int:
        """Tokens each sequence can hold (``max_seqlen``)."""
        return self.max_seqlen

    @property
    def lengths(self) -> List[int]:
        """Tokens per sequence as the host tracks them (no device sync; after CUDA-graph
        replays, ``check()`` brings them up to date)."""
        return list(self._host_lens)

    def check(self) -> None:
        """Wait for the cache's work on the current stream and confirm no append was refused.

        Raises ``CacheOverflowError`` naming each sequence whose append was refused on the
        device because it would pass ``capacity`` (only a replayed CUDA graph can get
        there: eager appends are refused on the host first).  Those sequences kept their
        content and length; the flags stay until ``reset()``.  Otherwise the host-side
        ``lengths`` are refreshed from the device (graph replays advance them there only),
        after a check that they lie in ``[0, capacity]`` (a ValueError names a length written
        to ``seqlens`` by hand).
        """
        asked = self.overflow.tolist()
        over = [(b, n) for b, n in enumerate(asked) if n]
        if over:
            listed = ", ".join(f"sequence {b} (asked for {n} tokens)" for b, n in over)
            raise CacheOverflowError(
                f"append refused on the device for {listed}: capacity is {self.capacity} tokens "
                "per sequence; those sequences were not written (reset() clears this)"
            )
        lens = self.seqlens.tolist()
        attention.check_lengths(self._tensors, lens)
        self._host_lens = lens

    # The lengths and the block table are the cache's own tensors: its plans, appenders and
    # captured graphs hold them, so a new tensor assigned in their place would be ignored.
    @property
    def seqlens(self) -> torch.Tensor:
        """int32 [B] tokens per sequence, on the device (``lengths`` is the host's copy)."""
        return self._seqlens

    @seqlens.setter
    def seqlens(self, value) -> None:
        raise AttributeError("seqlens is the cache's own tensor (its kernels and plans hold it): the cache's calls "
                             "set the lengths (prefill, append, truncate, reset)")

    @property
    def block_table(self) -> torch.Tensor:
        """int32 [B, pages per sequence]: the pages of each sequence, edited in place
        (``cache.block_table[b, i] = page`` or ``cache.block_table.copy_(table)``)."""
        return self._block_table

    @block_table.setter
    def block_table(self, value) -> None:
        raise AttributeError("block_table is the cache's own tensor (its kernels and plans hold it): edit it in "
                             "place, e.g. cache.block_table.copy_(table)")

    @property
    def _host_lens(self) -> List[int]:
        return [n + self._host_added for n in self._host_base]

    @_host_lens.setter
    def _host_lens(self, lens: List[int]) -> None:
        self._host_base, self._host_added = list(lens), 0
        self._host_max = max(self._host_base, default=0)
        self._fuse_room = None

    def _append_room(self) -> int:
        """Steps of one new token each that an appending decode kernel can take in place:
        until some sequence's next token would complete its residual block (the pack
        kernel's work), fall among the sink tokens, or pass ``max_seqlen``."""
        room = self._fuse_room
        if room is None:
            nr, sinks = self.fmt.residual_block, self.fmt.sink_tokens
            room = min((nr - 1 - (n - sinks) % nr if n >= sinks else 0 for n in self._host_lens), default=0)
            room = self._fuse_room = max(0, min(room, self.max_seqlen - self._host_max))
        return room

    def tensors(self) -> CacheTensors:
        return self._tensors

    def memory_bytes(self) -> int:
        """Bytes of all cache storage (packed pages, params, residual blocks, lengths, table)."""
        return sum(t.numel() * t.element_size() for t in (
            self.k_pack, self.k_params, self.v_pack, self.v_params, self.k_res, self.v_res,
            self.seqlens, self.block_table, self.k_sink, self.v_sink) if t is not None)

    def __repr__(self) -> str:
        return (f"KVCache(batch={self.batch}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"max_seqlen={self.max_seqlen}, page_size={self.page_size}, dtype={self.dtype}, "
                f"fmt={self.fmt}, backend={self.backend!r})")

    # ---- input checks ------------------------------------------------------------------
    def _check_kv(self, k, v, what: str, max_tokens: Optional[int] = None, names=("k", "v")):
        """``names``: the caller's names of k and v (``decode``'s ``k_new`` / ``v_new``)."""
        _validate.new_tokens(k, v, self.k_res, names)
        if max_tokens is not None and k.shape[1] > max_tokens:
            raise ValueError(f"{what}: {names[0]} has {k.shape[1]} tokens, more than max_seqlen={max_tokens}")

    def _check_inference_writes(self, what: str) -> None:
        """Refuse a write that torch would refuse part-way: the cache's tensors are inference
        tensors (allocated under ``torch.inference_mode()``) and inference mode is off."""
        if self._inference_tensors and not torch.is_inference_mode_enabled():
            raise RuntimeError(
                f"{what}: this cache was allocated under torch.inference_mode(), so torch refuses "
                "in-place updates of its tensors outside it; call it inside inference_mode (nothing "
                "was written)"
            )

    # ---- writes ------------------------------------------------------------------------
    def prefill(self, k: torch.Tensor, v: torch.Tensor, seqlens: Optional[Sequence[int]] = None) -> None:
        """Replace the cache content with ``k``, ``v`` ``[B, N, Hkv, D]`` (the first
        ``seqlens[b]`` tokens of each sequence; all ``N`` by default)."""
        self._check_kv(k, v, "prefill", self.max_seqlen)
        self._check_inference_writes("prefill")
        n = k.shape[1]
        if seqlens is None:
            lens = [n] * self.batch
        else:
            lens = _validate.int_list("seqlens", seqlens)
            if len(lens) != self.batch:
                raise ValueError(f"seqlens must have {self.batch} entries, got {len(lens)}")
            _validate.prompt_lengths("seqlens", lens, n)
        lens_t = torch.tensor(lens, dtype=torch.int32, device=self.device)
        # the pages the prompt will be packed into (a block table edited by the caller):
        # checked always on the CPU (no sync to save); on a GPU (one device sync) unless
        # unchanged since verified for lengths >= these by torch's version counter, which
        # writes past torch (``.data``, DLPack, a kernel of one's own) do not advance (an
        # inference-mode table has no version counter: checked every time)
        ok, version = self._table_verified, _validate.version_counter(self.block_table)
        if (not self._on_cuda or ok is None or ok[0] != version
                or any(n > m for n, m in zip(lens, ok[1]))):
            attention.check_block_table(self._tensors, lens_t)
            self._table_verified = None if version is None else (version, tuple(lens))
        # (detached: a write of tensors that require grad would tie the cache to their graph)
        k, v = reference.rotate(k.detach(), self.fmt), v.detach()  # KVFormat.hadamard: K is stored rotated
        if self.backend == "reference":
            reference_prefill(self._tensors, k, v, lens)
        else:
            backends.get(self.backend).prefill(self._tensors, k, v, lens_t)
        self._host_lens = lens

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append ``k``, ``v`` ``[B, T, Hkv, D]`` to every sequence, in place.

        Raises before anything is written when a sequence would exceed ``max_seqlen``.
        With a kernel backend this is one launch and can be captured in a CUDA graph
        (the host-side capacity check then only sees the capture, not the replays).
        """
        self._append(k, v, ("k", "v"))

    def _append(self, k: torch.Tensor, v: torch.Tensor, names: Tuple[str, str]) -> None:
        """``append``, its errors naming the arguments ``names`` (``decode``'s k_new / v_new)."""
        # the checks of k and v run once per new (shape, dtype, device, strides): a decode
        # loop's appends cost one tuple compare, one max and the launch
        key = (k.shape, v.shape, k.stride(), v.stride(), k.dtype, v.dtype, k.device, v.device) \
            if isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) else None
        if key is None or key != self._append_key:
            self._check_kv(k, v, "append", names=names)
            self._append_key = key
        t = k.shape[1]
        if self._host_max + t > self.max_seqlen:
            lens = self._host_lens
            b = next(i for i, n in enumerate(lens) if n + t > self.max_seqlen)
            raise ValueError(
                f"append of {t} tokens would grow sequence {b} from {lens[b]} to "
                f"{lens[b] + t} tokens, beyond max_seqlen={self.max_seqlen}; nothing was written"
            )
        if t == 0:
            return
        self._check_inference_writes("append")
        k = reference.rotate(k, self.fmt)  # KVFormat.hadamard: K is stored rotated
        if self.backend == "reference":
            if self.device.type == "cpu":  # the table is visible without a sync: check it
                attention.check_block_table(self._tensors, self.seqlens + t)
            reference_append(self._tensors, k.detach(), v.detach())  # (the cache joins no autograd graph)
        else:
            if k.data_ptr() % 16 or v.data_ptr() % 16:  # the kernel reads 16-byte rows
                k, v = k.clone(), v.clone()
            if self._appender is None:
                self._appender = backends.get(self.backend).appender(self._tensors)
            self._appender(k, v)
        self._host_added += t
        self._host_max += t
        self._fuse_room = None

    def truncate(self, tokens: int) -> None:
        """Drop the newest ``tokens`` tokens of every sequence (the rejected drafts of
        speculative decoding).  Where the new end falls inside a block that was already
        packed, that block's surviving tokens return to the 16-bit residual buffer
        dequantized: their quantization error stays, the 16-bit originals are gone.  Runs
        torch ops on the cache's device (a few small ones, and syncs: the lengths are read
        from the device first, as ``check()`` reads them, and so is its overflow refusal);
        any backend."""
        tokens = _validate.nonnegative_int("tokens", tokens)
        self.check()  # (the device's lengths: compiled steps and graph replays advance only those)
        lens = self._host_lens
        short = [b for b, n in enumerate(lens) if n < tokens]
        if short:
            raise ValueError(f"tokens={tokens} is more than sequence {short[0]} holds ({lens[short[0]]} tokens)")
        if tokens == 0:
            return
        self._check_inference_writes("truncate")
        # the blocks it may unpack are read through the block table (a caller may have edited
        # it): checked before anything is written, as prefill and append do
        attention.check_block_table(self._tensors, torch.tensor(lens, dtype=torch.int32, device=self.device))
        c, nr, sinks = self._tensors, self.fmt.residual_block, self.fmt.sink_tokens
        for b, n in enumerate(lens):
            rest_old, rest_new = max(0, n - sinks), max(0, n - tokens - sinks)
            blk = rest_new // nr
            keep = rest_new - blk * nr
            if blk < rest_old // nr and keep:  # the new end lies in a packed block
                kp, kq, vp, vq = _block_slices(c, b, blk)
                k = reference.unpack_k(c.k_pack[kp], c.k_params[kq], self.fmt, self.dtype)  # [Hkv, Nr, D]
                v = reference.unpack_v(c.v_pack[vp], c.v_params[vq], self.fmt, self.dtype)
                self.k_res[b, :keep] = k[:, :keep].transpose(0, 1)
                self.v_res[b, :keep] = v[:, :keep].transpose(0, 1)
        self.seqlens.sub_(tokens)
        self._host_lens = [n - tokens for n in lens]

    def reorder(self, indices) -> None:
        """Make sequence ``i`` a copy of sequence ``indices[i]`` for every ``i`` (beam search's
        reordering): its packed blocks, residual block, sink tokens and length.  Each
        sequence keeps its own pages (the blocks are copied through the block table, so no
        page is shared and later appends stay apart).  Torch ops on the cache's device (a
        copy of the blocks in use, and syncs: the lengths are read from the device first, as
        ``check()`` reads them, so a cache whose append was refused on the device raises its
        ``CacheOverflowError`` first); any backend."""
        src = _validate.int_list("indices", indices)
        if len(src) != self.batch:
            raise ValueError(f"indices must have {self.batch} entries (one per sequence), got {len(src)}")
        bad = next((j for j in src if not 0 <= j < self.batch), None)
        if bad is not None:
            raise ValueError(f"indices must lie in [0, {self.batch}), got {bad}")
        if src == list(range(self.batch)):
            return
        self._check_inference_writes("reorder")
        self.check()  # (the device's lengths: compiled steps and graph replays advance only those)
        new_lens = [self._host_lens[j] for j in src]
        attention.check_block_table(self._tensors, torch.tensor(new_lens, dtype=torch.int32, device=self.device))
        self._copy_sequences(self, src)  # (the pages written: a caller's table, checked above)
        self._host_lens = new_lens

    def select(self, indices) -> "KVCache":
        """A new cache of ``len(indices)`` sequences, sequence ``i`` a copy of this cache's
        sequence ``indices[i]`` (its packed blocks, residual block, sink tokens and length;
        indices may repeat or leave sequences out: transformers' ``batch_select_indices`` /
        ``batch_repeat_interleave``), with this cache's format, capacity, page size and
        backend; this cache is left as it is.  Reads the lengths as ``check()`` does."""
        src = _validate.int_list("indices", indices)
        if not src:
            raise ValueError("indices must name at least one sequence, got none")
        bad = next((j for j in src if not 0 <= j < self.batch), None)
        if bad is not None:
            raise ValueError(f"indices must lie in [0, {self.batch}), got {bad}")
        self.check()
        new = KVCache.allocate(len(src), self.num_kv_heads, self.head_dim, self.max_seqlen, self.fmt,
                               dtype=self.dtype, device=self.device, page_size=self.page_size, backend=self.backend)
        new._auto_picked = self._auto_picked
        self._copy_sequences(new, src)
        new._host_lens = [self._host_lens[j] for j in src]
        return new

    def _copy_sequences(self, dst: "KVCache", src: List[int]) -> None:
        """Sequence ``i`` of ``dst`` (this cache, or one of its shape) becomes a copy of this
        cache's sequence ``src[i]``: the pages its packed blocks use, copied through both
        block tables (none shared), its residual block, sink tokens, length and overflow
        flag.  The pages read are checked first (a caller's table)."""
        lens = self._host_lens
        c, nr, sinks = self._tensors, self.fmt.residual_block, self.fmt.sink_tokens
        attention.check_block_table(c, torch.tensor(lens, dtype=torch.int32, device=self.device))
        table, dst_table = self.block_table.tolist(), dst.block_table.tolist()
        dst_pages, src_pages = [], []
        for i, j in enumerate(src):
            if dst is not self or i != j:
                used = -(-(max(0, lens[j] - sinks) // nr * nr) // self.page_size)
                dst_pages += dst_table[i][:used]
                src_pages += table[j][:used]
        if dst_pages:  # (indexing copies the sources before any page is written)
            to = torch.tensor(dst_pages, dtype=torch.long, device=self.device)
            frm = torch.tensor(src_pages, dtype=torch.long, device=self.device)
            for name in ("k_pack", "k_params", "v_pack", "v_params"):
                getattr(dst, name)[to] = getattr(self, name)[frm]
        idx = torch.tensor(src, dtype=torch.long, device=self.device)
        for name in ("k_res", "v_res", "seqlens", "overflow", "k_sink", "v_sink"):
            if getattr(self, name) is not None:
                getattr(dst, name).copy_(getattr(self, name)[idx])

    def reset(self) -> None:
        """Empty every sequence and clear the overflow flags."""
        self._check_inference_writes("reset")
        self.seqlens.zero_()
        self.overflow.zero_()
        self._host_lens = [0] * self.batch

    # ---- reads -------------------------------------------------------------------------
    def decode(self, q: torch.Tensor, softmax_scale: Optional[float] = None, num_splits: int = 0,
               *, backend: str = "auto", return_lse: bool = False, k_new: Optional[torch.Tensor] = None,
               v_new: Optional[torch.Tensor] = None):
        """Attention of ``q`` ``[B, T, Hq, D]`` over the cache (see ``bitdecode.decode``);
        with ``k_new`` / ``v_new`` appended first."""
        if k_new is not None or v_new is not None:
            return self._append_decode(q, k_new, v_new, softmax_scale, num_splits, backend, return_lse)
        if return_lse is not False and return_lse is not True:
            _validate.flag("return_lse", return_lse)
        max_len = self._host_max
        if not isinstance(q, torch.Tensor):
            raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
        # fast path: a query like the last validated one (shape, strides, dtype, device,
        # options and their types, the same split and backend decisions) reuses its compiled
        # plan with no further Python work
        key = self._call_key(q, softmax_scale, num_splits, backend, max_len)
        fast = self._fast
        if fast is not None and fast[0] == key and q.data_ptr() % 16 == 0:
            return fast[1](reference.rotate(q, self.fmt), fast[2], return_lse)
        if backend == "auto":
            backend = self._auto_backend(q, num_splits, max_len)
        elif backend != self.backend:
            backend = dispatch.resolve(backend, self.device, fmt=self.fmt, head_dim=self.head_dim, dtype=self.dtype)
        cache = self._tensors
        attention.check_query(q, cache, backend)
        q = reference.rotate(q, self.fmt)  # KVFormat.hadamard: Q meets the rotated K
        if backend == "reference" and self.device.type == "cpu":  # the table is visible without a sync
            attention.check_block_table(cache, self.seqlens)

        def remember(plan, scale_log2):
            self._fast = (key, plan, scale_log2)

        return attention.run(q, cache, softmax_scale=softmax_scale, num_splits=num_splits, backend=backend,
                             return_lse=return_lse, max_len=max_len, plans=self._plans, on_plan=remember)

    def _call_key(self, q, softmax_scale, num_splits, backend, max_len: int) -> tuple:
        """What a kernel decode's plan depends on in a call: q's shape, strides, dtype and
        device, the options and their types, the backend asked for, and the tiles of
        ``max_len`` tokens (what ``choose_splits`` and ``call_backend`` count); one flat tuple
        (building and comparing it is the fast path's main host cost).  An appending decode's
        key adds k_new's and v_new's (``_append_decode``)."""
        return (q.shape, q.stride(), q.dtype, q.device, softmax_scale, type(softmax_scale), num_splits,
                type(num_splits), backend, self.fmt.tiles(max_len))

    def _auto_backend(self, q: torch.Tensor, num_splits, max_len: int) -> str:
        """The backend ``auto`` runs this call on: the cache's, or the one the cache's backend
        hands such calls to (``Backend.call_backend``: sm90 gives short sequences of small
        grids to sm80) where ``auto`` picked the cache's.  An explicit split count keeps the
        cache's backend."""
        if num_splits or not self._auto_picked or self.backend == "reference" or q.dim() != 4:
            return self.backend
        return backends.get(self.backend).call_backend(self._tensors, tuple(q.shape), max_len)

    def backend_for(self, q: torch.Tensor, num_splits: int = 0) -> str:
        """The backend that ``decode(q, num_splits=num_splits)`` with ``backend="auto"`` runs
        on at the cache's current lengths: ``KVCache.backend``, but where ``auto`` picked it
        and it hands the call to another (on Hopper, short sequences of small grids run on
        sm80)."""
        if not isinstance(q, torch.Tensor):
            raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
        return self._auto_backend(q, num_splits, self._host_max)

    def _kernel_appends(self, name: str) -> bool:
        """Whether backend ``name``'s decode kernel can append this cache's new tokens (no
        Hadamard rotation or FP4 codes: their K is written rotated or reordered)."""
        return (name != "reference" and backends.get(name).appends and not self.fmt.hadamard
                and not self.fmt.fp4)

    def _append_decode(self, q, k_new, v_new, softmax_scale, num_splits, backend, return_lse):
        """``append(k_new, v_new)`` then ``decode(q)``: in one launch where the backend's
        decode kernel appends (``appends``: the sm80 and sm90 kernels) and the step allows
        it (one token each, eager, no Hadamard rotation or FP4, no block completed,
        ``_append_room``, at most ``append_max_splits`` splits), else the two calls.  Same
        results, same cache contents either way."""
        if k_new is None or v_new is None:
            raise ValueError("k_new and v_new are appended together: pass both or neither")
        if return_lse is not False and return_lse is not True:
            _validate.flag("return_lse", return_lse)
        if self._inference_tensors:  # (the kernel's writes would pass; the cache's rule is one for every path)
            self._check_inference_writes("decode(k_new=, v_new=)")
        appends = self._appends
        if appends[0] != self.backend:
            appends = self._appends = (self.backend, self._kernel_appends(self.backend))
        # the stream the step runs on; None while a graph is captured, whose appends take the
        # two calls (the append kernel checks capacity on the device at every replay)
        stream = jit.current_stream(self._device_index) if self._on_cuda else 0
        if (backend == "auto" and not appends[1]) or stream is None:  # (no key to build: two calls)
            self._check_query_once(q, softmax_scale, num_splits, backend, stream is None)  # before the append writes
            self._append(k_new, v_new, NEW_NAMES)
            return self.decode(q, softmax_scale, num_splits, backend=backend, return_lse=return_lse)
        # ``_call_key``'s items and k_new's and v_new's, written out: this is the eager step's
        # hot path, where a call to build it costs as much as a tuple's items (the devices as
        # indices, which compare faster: only a CUDA cache's kernel plan gets an entry, and a
        # tensor on any other device has another index than its device's; a CPU cache's two
        # calls below check q by its device)
        try:
            key = (q.shape, q.stride(), k_new.shape, k_new.stride(), v_new.shape, v_new.stride(), q.dtype,
                   k_new.dtype, v_new.dtype, q.get_device(), k_new.get_device(), v_new.get_device(), softmax_scale,
                   type(softmax_scale), num_splits, type(num_splits), backend, self.fmt.tiles(self._host_max + 1))
        except AttributeError:  # (not tensors: ``_append_decode_plan`` says which)
            key = None
        fast = self._fast_append
        if fast is None or fast[0] != key:
            fast = self._fast_append = self._append_decode_plan(key, q, k_new, v_new, softmax_scale, num_splits,
                                                                backend)
        plan = fast[1]
        room = self._fuse_room
        if room is None:
            room = self._append_room()
        if plan is None or room <= 0 or (q.data_ptr() | k_new.data_ptr() | v_new.data_ptr()) % 16:
            if not self._on_cuda:  # (q checked by its whole device before the append writes: the
                # key's indices tell a CUDA cache's device from any other, not a CPU's from "meta")
                self._check_query_once(q, softmax_scale, num_splits, backend)
            self._append(k_new, v_new, NEW_NAMES)
            return self.decode(q, softmax_scale, num_splits, backend=backend, return_lse=return_lse)
        self._fuse_room = room - 1
        self._host_added += 1
        self._host_max += 1
        return plan.append_step(q if fast[3] else q.contiguous(), k_new if fast[4] else k_new.contiguous(),
                                v_new if fast[5] else v_new.contiguous(), fast[2], return_lse, stream)

    def _check_call(self, q, softmax_scale, num_splits, backend):
        """``decode``'s checks of q and the options, before an appending decode writes
        anything: (the backend's name, the softmax scale, the split count asked for)."""
        if not isinstance(q, torch.Tensor):
            raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
        name = self.backend if backend == "auto" else dispatch.resolve(
            backend, self.device, fmt=self.fmt, head_dim=self.head_dim, dtype=self.dtype)
        attention.check_query(q, self._tensors, name)
        return (name, attention.softmax_scale_or_default(softmax_scale, q.shape[-1]),
                attention.check_splits(num_splits, name))

    def _check_query_once(self, q, softmax_scale, num_splits, backend, capturing: bool = False) -> None:
        """``_check_call`` for an appending decode that runs as two calls, once per new (q
        layout, options): the two calls' eager steps pay one tuple compare.  While a graph is
        captured, every time (``attention.check_query`` refuses there what it passes eagerly)."""
        key = self._call_key(q, softmax_scale, num_splits, backend, 0) if isinstance(q, torch.Tensor) else None
        if capturing or key is None or key != self._query_checked:
            self._check_call(q, softmax_scale, num_splits, backend)
            self._query_checked = key

    def _append_decode_plan(self, key, q, k_new, v_new, softmax_scale, num_splits, backend):
        """The fast-path entry of ``_append_decode`` for these arguments (validated): (key,
        plan or None where the kernel cannot append them, scale_log2, q dense, k laid out, v
        laid out)."""
        name, scale, splits = self._check_call(q, softmax_scale, num_splits, backend)
        self._check_kv(k_new, v_new, "append", names=NEW_NAMES)
        if backend == "auto":
            name = self._auto_backend(q, splits, self._host_max + 1)
        if (not self._kernel_appends(name) or q.shape[1] != 1 or k_new.shape[1] != 1
                or not attention.fits_kernel_tile(q, self._tensors, name)):
            return (key, None)
        kernels = backends.get(name)
        splits = splits or kernels.choose_splits(self._tensors, tuple(q.shape), self._host_max + 1, q.device)
        if splits > kernels.append_max_splits:  # (the merge in the kernel would cost more GPU time)
            return (key, None)
        plan = attention.plan_decode(self._tensors, q, name, splits, self._host_max + 1, self._plans, append=True)
        return (key, plan, scale * attention.LOG2_E, q.is_contiguous(), kernels.takes_rows(k_new),
                kernels.takes_rows(v_new))

    def dequantized(self, b: int, k_dtype: Optional[torch.dtype] = None):
        """K, V ``[len, Hkv, D]`` of sequence ``b`` as the kernels see them, K rotated back
        to the model's basis under ``KVFormat.hadamard`` (for inspection; synchronizes, and
        raises like ``check()``).  K in the model's dtype, or ``k_dtype`` (float32: the exact
        values ``code * scale + zero``, before the one rounding to 16 bits)."""
        b = _validate.integer("b", b)
        if not 0 <= b < self.batch:
            raise ValueError(f"b must be a sequence index in [0, {self.batch}), got {b}")
        if k_dtype is not None and not (isinstance(k_dtype, torch.dtype) and k_dtype.is_floating_point):
            raise TypeError(f"k_dtype must be a floating-point torch.dtype or None, got {k_dtype!r}")
        self.check()
        c = self.tensors()
        attention.check_block_table(c, self.seqlens)  # (the pages it reads: edited in place?)
        k, v = reference.gather_kv(b, self._host_lens[b], c.k_pack, c.k_params, c.v_pack, c.v_params,
                                   c.k_res, c.v_res, c.block_table.cpu(), self.fmt, c.sinks, k_dtype)
        return reference.rotate(k, self.fmt), v


# the longest a sequence may grow: lengths (and the kernels' token counts) are int32; the
# largest multiple of every residual block below 2**31, so that the rounded capacity fits too
MAX_SEQLEN = 2**31 - 2**16


def decode(
    q: torch.Tensor,
    cache: KVCache,
    softmax_scale: Optional[float] = None,
    num_splits: int = 0,
    *,
    backend: str = "auto",
    return_lse: bool = False,
    k_new: Optional[torch.Tensor] = None,
    v_new: Optional[torch.Tensor] = None,
):
    """Decode attention against a ``KVCache``: q ``[B, T, Hq, D]`` -> ``[B, T, Hq, D]``
    (and the LSE ``[B, T, Hq]`` fp32 with ``return_lse``).

    ``k_new`` / ``v_new`` ``[B, T, Hkv, D]``: ``cache.append(k_new, v_new)`` first, then the
    attention (the step's new token attends to itself).  On the sm80 and sm90 kernels one
    token a step is one launch (the decode kernel stores it into the 16-bit residual block,
    commits the lengths and, split, merges the splits in its last CTA), where append +
    decode take two or three; where that does not apply (the reference backend, a step
    that completes a packed block, graph capture, more than the backend's
    ``append_max_splits`` splits, Hadamard or FP4 formats, several tokens) it is the two
    calls.  The cache contents are the same either way; so are the results, to fp32
    rounding where the kernel merged (the same partials summed in another order).

    ``T`` = 1: the usual decode step.  ``T`` > 1 (speculative verification, a chunk of a
    prompt): the queries are each sequence's newest ``T`` tokens, appended to the cache
    before the call, and query ``j`` attends to the first ``len - T + 1 + j`` tokens
    (causal); a query that sees no token (an empty sequence, or ``len - T + 1 + j <= 0``)
    gets a zero output and an LSE of -inf, on every backend.  The kernels take up to 16
    query rows per KV head (``T`` x query heads per KV head: 4 tokens at GQA 4, 2 at GQA 8,
    16 at MHA) in one launch, CUDA-graph safe;
    more run the cache dequantized to 16 bits + SDPA (``attention.chunk_decode``).

    With a kernel backend the output is a view into a buffer allocated for several calls'
    outputs (each call's its own memory): ``torch.save`` of it writes that whole buffer;
    ``out.clone()`` is a tensor of its own.  ``num_splits=0`` chooses the split count for the
    longest sequence the host knows of at this call; a CUDA graph keeps its capture's choice
    while the sequences grow (correct, but few CTAs past the capture's lengths: capture at the
    lengths the replays run, or pass the same ``num_splits`` to the warm-up and the capture).

    ``backend="auto"`` runs the cache's backend, except where ``auto`` picked it and it hands
    the call to another (``cache.backend_for(q)`` says which): on Hopper, sm90 gives short
    sequences of small grids to sm80, whose kernels decode them faster
    (``kernels_sm90.backend.SM80_SHORT`` holds the tiers, README's Backends section lists
    them: K per channel g128, head dim 128, at most 32 (sequence, KV head) pairs of at most
    16K tokens).  A capture keeps that choice too; an explicit ``num_splits`` or ``backend``
    keeps the cache's."""
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache must be a bitdecode.KVCache, got {type(cache).__name__}")
    if k_new is not None or v_new is not None:  # (straight to it: an eager step's hot path)
        return cache._append_decode(q, k_new, v_new, softmax_scale, num_splits, backend, return_lse)
    return cache.decode(q, softmax_scale=softmax_scale, num_splits=num_splits, backend=backend,
                        return_lse=return_lse)


# --------------------------------------------------------------------------------------
# The writes in plain torch (the reference backend; what the pack kernels are tested against)
# --------------------------------------------------------------------------------------


def _block_slices(c: CacheTensors, b: int, block: int):
    """Where packed block ``block`` (Nr tokens) of sequence ``b`` lives in k_pack, k_params,
    v_pack and v_params: every one of them is block-major along dim 2 (``KVFormat``'s
    storage shapes: rows, groups, V tiles, k-blocks or scale chunks per page), so a block's
    share is its equal part of the page's extent there."""
    nr = c.fmt.residual_block
    start = block * nr
    page = int(c.block_table[b, start // c.page_size])
    first = start % c.page_size // nr  # the block's index within its page
    out = []
    for t in (c.k_pack, c.k_params, c.v_pack, c.v_params):
        per_block = t.shape[2] * nr // c.page_size
        out.append((page, slice(None), slice(first * per_block, (first + 1) * per_block)))
    return tuple(out)


def _write_blocks(c: CacheTensors, b: int, first: int, kb: torch.Tensor, vb: torch.Tensor) -> None:
    """Quantize and pack whole blocks ``first ..`` of sequence ``b``: kb, vb ``[n * Nr, Hkv,
    D]``, in one call (every packed tensor is block-major along its dim 1, so each block's
    share is one equal chunk).  Non-finite values are not checked (the kernels cannot
    without a sync): their groups pack as NaN, as the kernels pack them."""
    blocks = kb.shape[0] // c.fmt.residual_block
    if blocks == 0:
        return
    packed = (*reference.pack_k(kb.transpose(0, 1), c.fmt, check_finite=False),
              *reference.pack_v(vb.transpose(0, 1), c.fmt, check_finite=False))
    dests = (c.k_pack, c.k_params, c.v_pack, c.v_params)
    for i, parts in enumerate(zip(*(t.chunk(blocks, dim=1) for t in packed))):
        for dst, where, part in zip(dests, _block_slices(c, b, first + i), parts):
            dst[where] = part


def reference_prefill(c: CacheTensors, k: torch.Tensor, v: torch.Tensor, lens: List[int]) -> None:
    """Sink tokens (the first ``fmt.sink_tokens``) 16-bit, full blocks of the rest packed,
    its tail to the residual buffer."""
    nr, sinks = c.fmt.residual_block, c.fmt.sink_tokens
    for b, n in enumerate(lens):
        s = min(n, sinks)
        if s:
            c.sinks[0][b, :s] = k[b, :s]
            c.sinks[1][b, :s] = v[b, :s]
        kb, vb, m = k[b, s:n], v[b, s:n], n - s
        _write_blocks(c, b, 0, kb[:m // nr * nr], vb[:m // nr * nr])
        r = m % nr
        c.k_res[b, :r] = kb[m - r:m]
        c.v_res[b, :r] = vb[m - r:m]
    c.cache_seqlens.copy_(torch.tensor(lens, dtype=torch.int32))


def reference_append(c: CacheTensors, k: torch.Tensor, v: torch.Tensor) -> None:
    """The append kernel's semantics, from the lengths on the cache's device: a sequence
    that would pass ``c.capacity`` is not written and is flagged in ``c.overflow``."""
    nr, t, sinks = c.fmt.residual_block, k.shape[1], c.fmt.sink_tokens
    for b, n in enumerate(c.cache_seqlens.tolist()):
        if n + t > c.capacity:
            c.overflow[b] = n + t
            continue
        for i in range(t):
            pos = n + i
            if pos < sinks:  # still filling the sequence's 16-bit sink tokens
                c.sinks[0][b, pos] = k[b, i]
                c.sinks[1][b, pos] = v[b, i]
                continue
            pos -= sinks
            slot = pos % nr
            c.k_res[b, slot] = k[b, i]
            c.v_res[b, slot] = v[b, i]
            if slot == nr - 1:
                _write_blocks(c, b, pos // nr, c.k_res[b], c.v_res[b])
        c.cache_seqlens[b] = n + t
