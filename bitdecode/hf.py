"""Hugging Face transformers drop-in: a ``Cache`` backed by one ``KVCache`` per layer and an
attention function registered as ``attn_implementation="bitdecode"``.

    import bitdecode as bd
    from bitdecode.hf import BitDecodingCache
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="bitdecode")
    cache = BitDecodingCache(model, bd.KVFormat(bits=4), max_seqlen=32768)
    out = model.generate(**inputs, cache=cache, max_new_tokens=64)  # (before 5.2x: past_key_values=)

What runs where:

* prefill (a layer's first call): attention on the 16-bit K / V in hand (torch SDPA with
  transformers' mask), and the prompt stored packed.  Left padding is read off the mask:
  each sequence's pads are dropped before packing, so they never enter a later attention;
* decode (one new token per sequence): the token is appended in place and attention runs
  over the packed cache through ``bitdecode.decode``;
* a later multi-token chunk (a second chat turn, a verification block): the chunk is
  appended and attended through ``bitdecode.decode`` with a causal mask over the chunk (a
  chunk with masked, padded positions is refused: the cache appends the same tokens to
  every sequence);
* rejected drafts of assisted generation: ``crop`` truncates every layer's cache
  (``KVCache.truncate``); beam search reorders it (``reorder_cache``).

The attention function finds the cache through the key tensor ``update`` returned (it
names the cache and layer), else through the model's attention modules, which the cache a
forward's ``update`` calls reach binds to itself: so several caches can serve one model by
turns, a ``copy.deepcopy`` of a filled cache (prompt reuse) serves the same model, and a
forward without one (``use_cache=False``, another ``Cache``) runs transformers' SDPA.
(Under ``torch.compile`` only the binding is followed: the last one made eagerly.)  A
step whose attention would not read the cache (the model switched to another
``attn_implementation``) is refused.  Not supported, refused with an error:
attention-logit soft-capping (Gemma 2), attention sinks (GPT-OSS), sequences longer than
a sliding window or than Llama 4's attention chunk (the cache keeps every token; within
the window the results are the model's), and float32 models.  ``batch_select_indices`` /
``batch_repeat_interleave`` (contrastive search) make each layer a cache of the new batch
(``KVCache.select``).
Importing this module imports transformers (it is not a dependency of ``bitdecode``).

Tensor parallelism is transformers' own (``from_pretrained(..., tp_plan="auto")``, or
``distributed_config=DistributedConfig(tp_plan="auto")``, under ``torchrun``): q/k/v are
split by heads, so each rank's attention sees only its query and KV heads, each layer's
``KVCache`` (allocated from the first update's shapes) holds only this rank's KV heads on
this rank's device, and ``memory_bytes()`` counts this rank's share.  Nothing here is
collective; the ranks meet only in the model's own all-reduces (``tests/test_tp.py``).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import weakref
from typing import Iterable, List, Optional

import torch
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from . import _validate, bitnet, dense, dispatch, ops, rope
from .bitnet import RMS_NORM_CLASSES
from .attention import capturing
from .cache import KVCache, decode
from .formats import KVFormat, model_head_dim

ATTN_IMPLEMENTATION = "bitdecode"
_CACHE_ATTR = "_bitdecode_cache"
# set on the key tensor an eager ``update`` returns: (the cache's weakref, the layer index),
# so that the attention call reads the cache the forward stored into, whichever model
# modules the cache was made for (a deep copy's, another instance of the model)
_KEY_ATTR = "_bitdecode_layer"


def cache_kwarg(model) -> str:
    """The name under which ``model.forward`` / ``generate`` take the cache: ``cache`` from
    transformers 5.2x on (``past_key_values`` is then deprecated), ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def cache_kwargs(model, cache) -> dict:
    """``cache`` under ``model``'s keyword (``cache_kwarg``), for ``model(..., **cache_kwargs(
    model, cache))`` or ``generate`` in code that runs on either side of transformers 5.2x."""
    return {cache_kwarg(model): cache}


def use_attention(model, name: str) -> None:
    """Switch the model's attention implementation (transformers' ``set_attn_implementation``,
    or the config field where that method refuses a registered custom name)."""
    try:
        model.set_attn_implementation(name)
    except Exception:  # noqa: BLE001 - older versions check names against their own list
        pass
    if model.config._attn_implementation != name:
        model.config._attn_implementation = name


class BitDecodingLayer(CacheLayerMixin):
    """One attention layer's packed cache, allocated from the first update's shapes."""

    is_compileable = False
    is_sliding = False
    is_croppable = True

    def __init__(self, fmt: KVFormat, max_seqlen: int, page_size: Optional[int], backend: str):
        super().__init__()
        self.fmt, self.max_seqlen, self.page_size, self.backend = fmt, max_seqlen, page_size, backend
        self._kv: Optional[KVCache] = None
        self.seen = 0  # positions transformers has fed (pads included): its view of the length
        # ``seen`` less the longest sequence's length: the prompt's pads (left padding drops
        # them from the shorter sequences only); constant while both advance together
        self.pad_offset = 0
        # the key ``update`` returned, until the attention call takes it: whether this
        # forward's attention is this cache's (``bitdecode_attention``)
        self.returned: Optional[torch.Tensor] = None
        self.prompt_pending = False  # a first call's K / V await packing (its mask shows the pads)
        # an eager step's new tokens ([B, T, Hkv, D] K and V), held from ``update`` to the
        # attention call, which checks the chunk's mask and appends them with the decode
        # (``decode(k_new=, v_new=)``: one launch on the sm80 and sm90 kernels for one
        # token); anything else that reads the cache appends them first (``kv``)
        self._pending: Optional[tuple] = None

    @property
    def kv(self) -> Optional[KVCache]:
        """The layer's packed cache, holding every token ``update`` was given."""
        self.flush()
        return self._kv

    @kv.setter
    def kv(self, cache: Optional[KVCache]) -> None:
        self._pending, self._kv = None, cache

    def flush(self) -> None:
        """Append the token held for the attention call, if there is one (a step whose
        attention call never came, or a reader of the cache before it)."""
        if self._pending is not None:
            (k, v), self._pending = self._pending, None
            try:
                self._kv.append(k, v)
            except BaseException:  # refused (a shard of another head count, say)
                self.uncount(k.shape[1])
                raise

    def uncount(self, tokens: int) -> None:
        """Take back the positions ``update`` counted for ``tokens`` new tokens that the cache
        never took (a refused append, prompt or decode; ``crop`` drops tokens it did take)."""
        self.seen -= tokens

    def take_pending(self) -> Optional[tuple]:
        """The decode step's new K and V, not yet appended (None if there are none): the
        caller appends them."""
        pending, self._pending = self._pending, None
        return pending

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        bsz, hkv, _, d = key_states.shape
        self.kv = KVCache.allocate(bsz, hkv, d, self.max_seqlen, self.fmt, dtype=key_states.dtype,
                                   device=key_states.device, page_size=self.page_size, backend=self.backend)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store the new tokens ([B, Hkv, T, D], RoPE applied); returns them unchanged (the
        attention function reads the packed cache itself)."""
        if not self.is_initialized or (self.seen == 0 and not self._holds(key_states)):
            self.lazy_initialization(key_states, value_states)  # (after reset(): a batch of another shape)
        if self.seen == 0:
            self.prompt_pending = True  # packed by the attention call, which has the mask
        elif torch.compiler.is_compiling():  # one op node; capacity checked on the device
            ops.append_cache(key_states.transpose(1, 2).contiguous(), value_states.transpose(1, 2).contiguous(),
                             self.kv)
        else:  # the attention call appends them (``_pending``)
            self.flush()
            if self.seen - self._kv._host_max != self.pad_offset and not capturing(key_states.device):
                self._kv.check()  # compiled steps appended on the device only: the host's lengths catch up
            self._pending = (key_states.transpose(1, 2), value_states.transpose(1, 2))
        self.seen += key_states.shape[2]
        return key_states, value_states

    def _holds(self, key_states: torch.Tensor) -> bool:
        """Whether the allocated cache takes a prompt of ``key_states``' batch, heads, head
        dim, dtype and device."""
        kv, (bsz, hkv, _, d) = self._kv, key_states.shape
        return (kv is not None and (kv.batch, kv.num_kv_heads, kv.head_dim) == (bsz, hkv, d)
                and kv.dtype == key_states.dtype and kv.device == key_states.device)

    def store_prompt(self, key_states, value_states, valid: Optional[torch.Tensor],
                     lens: Optional[List[int]] = None) -> None:
        """Pack the first call's tokens, each sequence without its left pads (``valid``:
        [B, T] bool, True for real tokens, right-aligned after left padding; None: no
        padding).  ``lens``: ``valid``'s row sums if the caller has them (a device sync)."""
        k, v = key_states.transpose(1, 2), value_states.transpose(1, 2)  # [B, T, Hkv, D]
        t = k.shape[1]
        if lens is None:
            lens = [t] * k.shape[0] if valid is None else valid.sum(dim=1).tolist()
        if any(n != t for n in lens):  # shift every sequence's real tokens to the front
            idx = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)[:, :max(lens)]
            k = torch.take_along_dim(k, idx[:, :, None, None], dim=1)  # (the pads past the
            v = torch.take_along_dim(v, idx[:, :, None, None], dim=1)  # longest are not kept)
        self.kv.prefill(k.contiguous(), v.contiguous(), seqlens=lens)
        self.pad_offset = t - max(lens, default=0)
        self.prompt_pending = False
        self.returned = None  # (the update's tokens are read: a caller packing a prompt by hand)

    def dequantized(self):
        """Every sequence's cached K, V as [len, Hkv, D] 16-bit tensors."""
        return [self.kv.dequantized(b) for b in range(self.kv.batch)]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return self.max_seqlen

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the newest tokens (assisted generation's rejected drafts): ``-n`` removes n,
        a positive value is the length to keep (transformers' older convention)."""
        if isinstance(tokens_to_remove, torch.Tensor) and tokens_to_remove.dim() == 0:
            tokens_to_remove = tokens_to_remove.item()  # older transformers pass a 0-d tensor
        tokens_to_remove = _validate.integer("tokens_to_remove", tokens_to_remove)
        remove = self.seen - tokens_to_remove if tokens_to_remove > 0 else -tokens_to_remove
        if remove <= 0 or self.kv is None:
            return
        self.kv.truncate(remove)
        self.seen -= remove

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: sequence ``i`` becomes a copy of sequence ``beam_idx[i]``."""
        if self._kv is not None:
            self.kv.reorder(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep sequences ``indices`` (contrastive search): a cache of that batch, each
        sequence a copy of its packed blocks (``KVCache.select``)."""
        if self._kv is not None:
            self.kv = self.kv.select(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each sequence ``repeats`` times in a row (``KVCache.select``)."""
        repeats = _validate.positive_int("repeats", repeats)
        if self._kv is not None:
            self.kv = self.kv.select([b for b in range(self._kv.batch) for _ in range(repeats)])

    def reset(self) -> None:
        self._pending = None
        if self._kv is not None:
            self._kv.reset()
        self.seen = 0
        self.pad_offset = 0
        self.returned = None
        self.prompt_pending = False


class BitDecodingCache(Cache):
    """A transformers ``Cache`` whose layers hold packed low-bit K / V (``KVFormat``).

    ``max_seqlen`` bounds the tokens per sequence (prompt + generated; an append past it
    raises before anything is written); ``page_size`` makes the layers' caches paged;
    ``backend`` picks the kernels as everywhere in bitdecode ("auto", "sm80", "sm90",
    "reference").  The model must run ``attn_implementation="bitdecode"``.
    """

    def __init__(self, model: torch.nn.Module, fmt: KVFormat, max_seqlen: int = 32768,
                 page_size: Optional[int] = None, backend: str = "auto"):
        if not isinstance(fmt, KVFormat):
            raise TypeError(f"fmt must be a bitdecode.KVFormat, got {type(fmt).__name__}")
        # what ``KVCache.allocate`` would refuse at the first forward, refused here
        max_seqlen = _validate.positive_int("max_seqlen", max_seqlen)
        if page_size is not None:
            page_size = _validate.positive_int("page_size", page_size)
            if page_size % fmt.residual_block:
                raise ValueError(f"page_size must be a multiple of the residual block ({fmt.residual_block} "
                                 f"tokens for this format), got {page_size}")
        if backend not in dispatch.BACKENDS:
            raise ValueError(f"backend must be one of {dispatch.BACKENDS}, got {backend!r}")
        config = getattr(model, "config", None)
        if config is None or getattr(config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
            raise ValueError(
                "model must be loaded with attn_implementation='bitdecode' (import bitdecode.hf first), got "
                f"{getattr(config, '_attn_implementation', None)!r}"
            )
        _check_supported(config)
        dtype = getattr(model, "dtype", None)  # (refused here, not by the first forward's allocation)
        if isinstance(dtype, torch.dtype) and dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"model's dtype must be torch.float16 or torch.bfloat16 (the cache keeps 16-bit K / V "
                            f"beside the packed ones), got {dtype}: load it with dtype=torch.bfloat16")
        head_dim = model_head_dim(config)
        if head_dim is not None:  # (else the first update's K says it)
            fmt.check_head_dim(head_dim, name="the model's head_dim")
        layer = functools.partial(BitDecodingLayer, fmt, max_seqlen, page_size, backend)
        super().__init__(layer_class_to_replicate=layer)
        self.fmt = fmt
        self._prompt_lens = None  # (weakref to a prefill's mask, its length, version, prompt lengths)
        windows = _sliding_windows(config)  # layer index -> (its window in tokens, what it is)
        # (the narrowest window, its first layer, what it is) or None: what every update checks
        self._window = min((w, i, what) for i, (w, what) in windows.items()) if windows else None
        self._ref = weakref.ref(self)
        self._attention_modules: dict = {}  # layer index -> the model's attention modules of it
        for module in model.modules():  # the attention modules find their layer through this
            if hasattr(module, "layer_idx") and hasattr(module, "q_proj"):
                setattr(module, _CACHE_ATTR, self._ref)
                self._attention_modules.setdefault(module.layer_idx, []).append(module)
        if not self._attention_modules:
            raise ValueError("found no attention module (with layer_idx and q_proj) in the model")
        self._first_layer = min(self._attention_modules)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """transformers' ``Cache.update``; binds this cache to the layer's attention modules
        (the forward that calls it attends over this cache, whichever cache was made last)."""
        if self._window is not None:
            # checked at every layer against the narrowest window, so that the step is refused
            # at its first layer, before any layer (a full-attention one below the sliding
            # ones, say) stores it: the layers never disagree about the sequence's length
            window, windowed, what = self._window
            seen = self.layers[layer_idx].seen if layer_idx < len(self.layers) else 0
            if seen + key_states.shape[2] > window:
                raise ValueError(
                    f"layer {windowed} attends over {what} of {window} tokens and this step would make the "
                    f"sequence {seen + key_states.shape[2]} tokens long: BitDecodingCache keeps every token, so "
                    "past that its attention would not be the model's (a longer window, config.sliding_window or "
                    "attention_chunk_size, or a cache that evicts)"
                )
        compiling = torch.compiler.is_compiling()
        if not compiling:
            self._check_attention_reads(layer_idx)
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if not compiling:
            for module in self._attention_modules.get(layer_idx, ()):
                setattr(module, _CACHE_ATTR, self._ref)
            self.layers[layer_idx].returned = keys
            setattr(keys, _KEY_ATTR, (self._ref, layer_idx))
        return keys, values

    def _check_attention_reads(self, layer_idx: int) -> None:
        """Refuse a step whose attention would not read this cache: ``update`` returns only the
        new tokens, so any other attention function would attend over those alone, silently
        wrong.  Caught when the layer's modules run another implementation, or when the last
        forward's attention never took what ``update`` returned (another model's forward)."""
        # once a forward, at its first layer (a config's attribute costs microseconds); every
        # module of the index (a composite model's other towers may number theirs alike)
        impls = [getattr(getattr(module, "config", None), "_attn_implementation", ATTN_IMPLEMENTATION)
                 for module in self._attention_modules.get(layer_idx, ())] if layer_idx == self._first_layer else ()
        if impls and all(isinstance(impl, str) and impl != ATTN_IMPLEMENTATION for impl in impls):
            raise ValueError(f"layer {layer_idx}'s attention runs attn_implementation={impls[0]!r}, which would "
                             f"attend over the new tokens only: BitDecodingCache needs "
                             f"attn_implementation='{ATTN_IMPLEMENTATION}' (bitdecode.hf.use_attention)")
        if layer_idx < len(self.layers) and self.layers[layer_idx].returned is not None:
            self.layers[layer_idx].returned = None  # (said once: the next step may run)
            raise ValueError(f"layer {layer_idx}: the last forward's attention did not read this cache (a model "
                             f"whose attention is not attn_implementation='{ATTN_IMPLEMENTATION}', or a forward "
                             "that stopped between the cache update and the attention); its output attended "
                             "over the new tokens only.  The cache still holds every token it was given")

    def __deepcopy__(self, memo):
        """A copy with caches of its own (``copy.deepcopy``: transformers' prompt reuse) that
        serves the same model: the model's attention modules are shared, not copied."""
        for modules in self._attention_modules.values():
            for module in modules:
                memo[id(module)] = module
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        new.__dict__.update({name: copy.deepcopy(value, memo) for name, value in self.__dict__.items()})
        new._ref = weakref.ref(new)
        return new

    def memory_bytes(self) -> int:
        return sum(layer.kv.memory_bytes() for layer in self.layers if layer.kv is not None)

    def check(self) -> None:
        """After CUDA-graph replays (or compiled steps) of decode steps: raise
        ``bitdecode.CacheOverflowError`` if any layer refused an append on the device, else
        bring each layer's host-side lengths (and ``get_seq_length``) up to the device's."""
        for layer in self.layers:
            if layer.kv is not None:
                layer.kv.check()
                # (what the device holds: a graph replay advanced neither count on the host, a
                # compiled step only ``seen``)
                layer.seen = max(layer.kv.lengths, default=0) + layer.pad_offset


def _check_supported(config) -> None:
    """Refuse the attention variants the cache's attention does not compute."""
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None:
        raise ValueError(f"the model soft-caps its attention logits (config.attn_logit_softcapping={softcap}), "
                         "which attn_implementation='bitdecode' does not compute")
    if getattr(config, "model_type", None) == "gpt_oss":
        raise ValueError("the model's attention has learned sinks (GPT-OSS's s_aux), which "
                         "attn_implementation='bitdecode' does not compute")


def _sliding_windows(config) -> dict:
    """{layer index: (window, what it is)} of the layers that attend over part of the
    sequence only: every layer where the config has a ``sliding_window`` (and no
    ``use_sliding_window=False``), or the ``"sliding_attention"`` ones of its
    ``layer_types``; and the ``"chunked_attention"`` ones (Llama 4: attention within chunks
    of ``attention_chunk_size`` tokens, the model's own only while the sequence fits one)."""
    def tokens(name):
        n = getattr(config, name, None)
        return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None

    window, chunk = tokens("sliding_window"), tokens("attention_chunk_size")
    types = getattr(config, "layer_types", None)
    if types is not None:
        kinds = {"sliding_attention": (window, "a sliding window"), "chunked_attention": (chunk, "chunks")}
        return {i: kinds[kind] for i, kind in enumerate(types) if kind in kinds and kinds[kind][0] is not None}
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return {}
    return {i: (window, "a sliding window") for i in range(getattr(config, "num_hidden_layers", 0))}


_UNSUPPORTED_KWARGS = ("s_aux", "softcap")  # attention sinks (GPT-OSS), logit soft-capping (Gemma 2)


def _valid_tokens(attention_mask: Optional[torch.Tensor], t: int) -> Optional[torch.Tensor]:
    """[B, T] bool: the prompt tokens that are not left padding (from transformers' 4D
    boolean / additive mask, last query row); None without a mask (no padding)."""
    if attention_mask is None:
        return None
    last = attention_mask[:, 0, -1, -t:]
    return last if last.dtype == torch.bool else last == 0


def _prompt_lengths(cache: "BitDecodingCache", attention_mask: Optional[torch.Tensor], t: int):
    """(valid tokens, their count per sequence) of a prefill.  Every layer gets the same
    mask object, so the counts (a device sync) are taken once per forward, not per layer."""
    valid = _valid_tokens(attention_mask, t)
    if valid is None:
        return None, None
    memo, version = cache._prompt_lens, _validate.version_counter(attention_mask)
    if memo is not None and memo[0]() is attention_mask and memo[1:3] == (t, version) and version is not None:
        return valid, memo[3]
    lens = valid.sum(dim=1).tolist()
    cache._prompt_lens = (weakref.ref(attention_mask), t, version, lens)
    return valid, lens


def bitdecode_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                        scaling: Optional[float] = None, **kwargs):
    """transformers attention function: query [B, Hq, Tq, D]; returns ([B, Tq, Hq, D], None)."""
    tag = getattr(key, _KEY_ATTR, None)  # (eager: the cache and layer whose update returned ``key``)
    ref, idx = tag if tag is not None else (getattr(module, _CACHE_ATTR, None), module.layer_idx)
    cache = ref() if ref is not None else None
    layer = cache.layers[idx] if cache is not None and idx < len(cache.layers) else None
    if layer is not None and not torch.compiler.is_compiling():
        returned, layer.returned = layer.returned, None
        if returned is None:  # the cache was not updated for this call: another cache's, or none
            layer = None
    if layer is None:
        # no bitdecode cache in use (use_cache=False, or a forward with another Cache): plain SDPA
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    bsz, hq, tq, d = query.shape
    if layer.prompt_pending:  # prefill: 16-bit attention, then pack without the pads
        try:
            for name in _UNSUPPORTED_KWARGS:  # (a model passes the same ones at every call: checked once)
                if kwargs.get(name) is not None:
                    raise ValueError(f"attn_implementation='bitdecode' does not compute the model's {name!r} "
                                     "(attention sinks, soft-capping)")
            out = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                         scaling=scaling, **kwargs)
            layer.store_prompt(key, value, *_prompt_lengths(cache, attention_mask, key.shape[2]))
        except BaseException:  # refused before anything was written: the layer holds no prompt
            layer.uncount(key.shape[2])
            raise
        return out
    if tq == 1:  # decode over the packed cache
        q = query.transpose(1, 2)
        if torch.compiler.is_compiling():  # one opaque op node instead of the Python dispatch
            scale = scaling if scaling is not None else d ** -0.5
            return ops.decode_cache(q.contiguous(), layer.kv, scale), None
        return _decode_pending(layer, q, scaling), None
    # several new tokens (assisted generation's drafts, a later chunk of a prompt): appended
    # (the same tokens to every sequence, so none may be masked), then causal over the cache,
    # in the kernels when they fit one tile
    return _decode_pending(layer, query.transpose(1, 2).contiguous(), scaling, attention_mask), None


def _decode_pending(layer: BitDecodingLayer, q: torch.Tensor, scaling, attention_mask=None) -> torch.Tensor:
    """``decode`` of ``q`` [B, T, Hq, D] over the layer's cache with the tokens ``update``
    held appended first (with ``attention_mask``: a chunk of several, refused if the mask
    hides any of them); a refused call takes back the position ``update`` counted for them."""
    k_new, v_new = layer.take_pending() or (None, None)
    kv = layer.kv
    added = kv._host_added
    try:
        if attention_mask is not None and k_new is not None and not capturing(q.device):
            valid = _valid_tokens(attention_mask, q.shape[1])
            if valid is not None and not bool(valid.all()):
                raise ValueError(
                    "a chunk of several new tokens has masked (padding) positions: BitDecodingCache appends "
                    "the same tokens to every sequence after the first call, so pad only the first call's "
                    "prompt (left padding) or run the sequences one at a time"
                )
        return decode(q, kv, softmax_scale=scaling, k_new=k_new, v_new=v_new)
    except BaseException:  # refused: ``update`` counted tokens that the cache never took
        if k_new is not None and kv._host_added == added:
            layer.uncount(k_new.shape[1])
        raise


class FusedRMSNorm(torch.nn.Module):
    """One of transformers' RMSNorms (``bd.bitnet.RMS_NORM_CLASSES``) as one kernel
    (``bd.bitnet.rms_norm``) instead of its eight torch ops: the same weight Parameter and
    ``variance_epsilon``, the output within two 16-bit ulps of the original's (torch's ops
    on the CPU, for fp32, and under torch.compile)."""

    def __init__(self, norm: torch.nn.Module, backend: str = "auto"):
        super().__init__()
        self.weight = norm.weight
        self.variance_epsilon = float(norm.variance_epsilon)
        self.backend = backend
        # for ``unfuse_norms``; not a submodule: it shares ``weight`` (one state_dict key)
        self.__dict__["original"] = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return bitnet.rms_norm(x, self.weight, self.variance_epsilon, backend=self.backend)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor):
        """``(residual + x, self(residual + x))`` as one kernel (``bd.bitnet.add_rms_norm``)."""
        return bitnet.add_rms_norm(x, residual, self.weight, self.variance_epsilon, backend=self.backend)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, one kernel"


# The decoder layers whose forward is the pre-norm residual block (Llama's, Mistral's,
# Qwen2/3's): norm, attention, add, norm, MLP, add.  Statement by statement, with the
# forward's own parameter names for what it hands the attention module.
_RESIDUAL_BLOCK = """
residual = hidden_states
hidden_states = self.input_layernorm(hidden_states)
hidden_states, _ = self.self_attn(hidden_states=hidden_states, {keywords}**kwargs)
hidden_states = residual + hidden_states
residual = hidden_states
hidden_states = self.post_attention_layernorm(hidden_states)
hidden_states = self.mlp(hidden_states)
hidden_states = residual + hidden_states
return hidden_states
"""


@functools.lru_cache(maxsize=None)
def _is_residual_block(forward) -> bool:
    """Whether ``forward`` (a decoder layer class's) is ``_RESIDUAL_BLOCK``: its
    parameters after ``hidden_states`` all reach ``self_attn`` by name, with ``**kwargs``."""
    import ast

    try:
        node = _function_node(forward)
    except (OSError, TypeError, SyntaxError):
        return False
    a = node.args
    names = [x.arg for x in a.args]
    if names[:2] != ["self", "hidden_states"] or a.kwarg is None or a.vararg or a.kwonlyargs or a.posonlyargs:
        return False
    keywords = "".join(f"{n}={n}, " for n in names[2:])
    want = ast.parse(_RESIDUAL_BLOCK.format(keywords=keywords)).body
    return len(node.body) == len(want) and all(ast.dump(x) == ast.dump(y) for x, y in zip(node.body, want))


@functools.lru_cache(maxsize=None)
def _attention_params(forward) -> tuple:
    """(name, default) of a residual block's forward parameters after ``hidden_states``."""
    params = list(inspect.signature(inspect.unwrap(forward)).parameters.values())[2:]
    return tuple((p.name, p.default) for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _fused_residual_forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """``_RESIDUAL_BLOCK`` with its middle add and the norm after it as one kernel
    (``FusedRMSNorm.add_forward``), and after ``fuse_projections`` its last add in the down
    projection's GEMV: what the class's own forward computes, the adds bit for bit; the
    arguments reach the attention module as the class's forward passes them."""
    params = self._bitdecode_attention_params  # (set by fuse_norms: nothing to trace under torch.compile)
    for (name, _), value in zip(params, args):
        kwargs[name] = value
    passed = {name: kwargs.pop(name, default) for name, default in params}
    residual = hidden_states
    hidden_states, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **passed, **kwargs)
    residual, hidden_states = self.post_attention_layernorm.add_forward(hidden_states, residual)
    if _own_forward(self.mlp) is _swiglu_mlp_forward:
        return self.mlp.forward(hidden_states, residual=residual)  # the last add in down_proj's GEMV
    return residual + self.mlp(hidden_states)


def fuse_norms(model: torch.nn.Module, backend: str = "auto") -> int:
    """Replace every RMSNorm of ``RMS_NORM_CLASSES`` in ``model`` (in place) by
    ``FusedRMSNorm``: one launch per norm in a decode step instead of eight (a Llama-3-8B
    step has 65 norms), and in decoder layers that are the pre-norm residual block
    (Llama's, Mistral's, Qwen2/3's forward, checked statement by statement) the residual
    add after attention joins the norm after it (``bd.bitnet.add_rms_norm``: one launch
    fewer a layer).  Returns how many norms were replaced.  Independent of the cache; for
    a BitNet model ``bd.bitnet.convert`` fuses its norms with the activation quantizer."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if backend not in bitnet.BACKENDS:  # (checked here: the norms would only refuse it at their first call)
        raise ValueError(f"backend must be one of {bitnet.BACKENDS}, got {backend!r}")
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if bitnet.is_rms_norm(child):
                setattr(parent, name, FusedRMSNorm(child, backend))
                count += 1
    for layer in model.modules():
        if (isinstance(getattr(layer, "post_attention_layernorm", None), FusedRMSNorm)
                and "forward" not in vars(layer) and _is_residual_block(type(layer).forward)):
            layer._bitdecode_attention_params = _attention_params(type(layer).forward)
            layer.forward = _fused_residual_forward.__get__(layer)
    return count


def unfuse_norms(model: torch.nn.Module) -> int:
    """Put back the RMSNorms ``fuse_norms`` replaced (they share the weight Parameter: no
    copy); returns how many."""
    count = 0
    for layer in model.modules():
        if _own_forward(layer) is _fused_residual_forward:
            del layer.forward, layer._bitdecode_attention_params
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, FusedRMSNorm):
                child.original.weight = child.weight  # the current Parameter, if a conversion swapped it
                setattr(parent, name, child.original)
                count += 1
    return count


# --------------------------------------------------------------------------------------
# The rotary embedding as one kernel
# --------------------------------------------------------------------------------------

_ROPE_ORIGINALS: dict = {}  # modeling module name -> its own apply_rotary_pos_emb


def _function_node(fn):
    """A function's syntax tree without its decorators and docstring."""
    import ast
    import textwrap

    node = ast.parse(textwrap.dedent(inspect.getsource(_plain_function(fn)))).body[0]
    node.decorator_list = []
    if node.body and isinstance(node.body[0], ast.Expr) and isinstance(getattr(node.body[0], "value", None), ast.Constant):
        node.body = node.body[1:]
    return node


def _plain_function(fn):
    """The Python function behind ``fn``: unwrapped from decorators, and from the module
    that transformers' ``use_kernel_forward_from_hub`` makes of a function where the
    ``kernels`` package is installed (transformers 5.25: an ``nn.Module`` whose forward
    calls the function it closes over as ``func``)."""
    if isinstance(fn, torch.nn.Module):
        inner = inspect.getclosurevars(type(fn).forward).nonlocals.get("func")
        if not inspect.isfunction(inner):
            raise TypeError(f"{type(fn).__qualname__} wraps no Python function bitdecode can read")
        fn = inner
    return inspect.unwrap(fn)


def _body(fn) -> str:
    """A function's code without its decorators and docstring (an AST dump)."""
    import ast

    return ast.dump(_function_node(fn))


def _own_forward(module: torch.nn.Module):
    """The function bound as ``module``'s own ``forward`` (one of this module's patches),
    None where it runs its class's."""
    return getattr(vars(module).get("forward"), "__func__", None)


@functools.lru_cache(maxsize=None)
def _llama_rope_body() -> str:
    from transformers.models.llama import modeling_llama

    return _body(_ROPE_ORIGINALS.get(modeling_llama.__name__, modeling_llama.apply_rotary_pos_emb))


def _fused_rope(original, backend: str):
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if unsqueeze_dim != 1:
            return original(q, k, cos, sin, unsqueeze_dim)
        return rope.apply_rotary(q, k, cos, sin, backend=backend)

    apply_rotary_pos_emb.__doc__ = f"bitdecode.rope.apply_rotary in place of {original.__module__}'s own"
    apply_rotary_pos_emb._bitdecode_rope = True
    return apply_rotary_pos_emb


def fuse_rope(model: torch.nn.Module, backend: str = "auto") -> List[str]:
    """Run the rotary embedding of ``model``'s attention layers as one kernel
    (``bd.rope.apply_rotary``, bit-identical to transformers' ops) instead of ten torch ops
    per layer.  transformers' attention forward calls its modeling module's
    ``apply_rotary_pos_emb``, so that function is replaced in each modeling module of
    ``model`` whose own is Llama's (Llama, Mistral, Qwen2/3, SmolLM3, ...): for every model of
    that family in the process, with the same results (``restore_rope`` undoes it).
    Returns the modules patched (already patched ones included)."""
    import sys

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if backend not in rope.BACKENDS:
        raise ValueError(f"backend must be one of {rope.BACKENDS}, got {backend!r}")
    patched = []
    for mod_name in sorted({type(m).__module__ for m in model.modules()}):
        module = sys.modules.get(mod_name)
        fn = getattr(module, "apply_rotary_pos_emb", None)
        if fn is None:
            continue
        if getattr(fn, "_bitdecode_rope", False):
            patched.append(mod_name)
            continue
        try:
            llama_like = _body(fn) == _llama_rope_body()
        except (OSError, TypeError):  # no source to read (a compiled or foreign function): not Llama's
            llama_like = False
        if not llama_like:
            continue
        _ROPE_ORIGINALS[mod_name] = fn
        module.apply_rotary_pos_emb = _fused_rope(fn, backend)
        patched.append(mod_name)
    return patched


def restore_rope(names: Optional[Iterable[str]] = None) -> List[str]:
    """Put back the own ``apply_rotary_pos_emb`` of every modeling module ``fuse_rope``
    patched (or of those in ``names``); returns the names restored."""
    import sys

    names = sorted(_ROPE_ORIGINALS if names is None else set(names) & set(_ROPE_ORIGINALS))
    for name in names:
        sys.modules[name].apply_rotary_pos_emb = _ROPE_ORIGINALS.pop(name)
    return names


# --------------------------------------------------------------------------------------
# Projections that read the same input as one GEMM
# --------------------------------------------------------------------------------------

PROJECTION_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
SINGLE_PROJECTIONS = ("o_proj", "down_proj")  # projections with an input of their own
_SILU_CLASSES = ("SiLU", "SiLUActivation")  # torch's and transformers' (ACT2FN["silu"])


class _MergedProjection:
    """The weights of projections that read the same input, concatenated (one storage: the
    slices' ``weight`` Parameters are views of it), and the last input's outputs: the first
    projection called runs the one GEMM (``bd.dense.linear``), the others return their
    slice of its output.  The outputs are let go once every projection has taken its slice
    (held to the next call, a prefill's gate / up outputs, 235 MB a layer at 4K tokens on
    an 8B model, would add up over the layers)."""

    def __init__(self, linears: List[torch.nn.Linear], backend: str):
        self.weight = torch.cat([lin.weight.detach() for lin in linears])
        has_bias = linears[0].bias is not None
        self.bias = torch.cat([lin.bias.detach() for lin in linears]) if has_bias else None
        self.splits = [lin.out_features for lin in linears]
        self.backend = backend
        self._x: Optional[weakref.ref] = None
        self._version = -1
        self._outs: tuple = ()
        self._untaken: set = set()

    def merged(self, x: torch.Tensor) -> torch.Tensor:
        """Every projection's output for input ``x``, concatenated along the last dim."""
        if x.device != self.weight.device or x.dtype != self.weight.dtype:
            raise ValueError(f"merged projections hold {self.weight.dtype} weights on {self.weight.device}, the input "
                             f"is {x.dtype} on {x.device}: call hf.fuse_projections after moving the model")
        return dense.linear(x, self.weight, self.bias, backend=self.backend)

    def output(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """Projection ``index``'s output for input ``x``."""
        version = _validate.version_counter(x)  # (None in inference mode: identity only)
        if self._x is None or self._x() is not x or version != self._version or index not in self._untaken:
            self._outs = self.merged(x).split(self.splits, dim=-1)
            self._x, self._version = weakref.ref(x), version
            self._untaken = set(range(len(self.splits)))
        out = self._outs[index]
        self._untaken.discard(index)
        if not self._untaken:
            self._outs, self._x = (), None
        return out


class ProjectionSlice(torch.nn.Module):
    """One projection of a ``_MergedProjection`` (``fuse_projections``): its ``weight`` (and
    ``bias``) are views of the merged storage, its output the merged GEMM's slice (a
    strided view, as a slice of the last dim is)."""

    def __init__(self, group: _MergedProjection, index: int, linear: torch.nn.Linear):
        super().__init__()
        start = sum(group.splits[:index])
        end = start + group.splits[index]
        self.group, self.index = group, index
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = torch.nn.Parameter(group.weight[start:end], requires_grad=False)
        self.bias = None if group.bias is None else torch.nn.Parameter(group.bias[start:end], requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # (no identity caching inside a traced graph)
            return torch.nn.functional.linear(x, self.weight, self.bias)
        return self.group.output(x, self.index)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, slice {self.index} of " \
               f"{len(self.group.splits)} merged projections"


class Projection(torch.nn.Module):
    """A projection that reads an input of its own (``SINGLE_PROJECTIONS``: o_proj,
    down_proj) through ``bd.dense.linear``: the same ``weight`` / ``bias`` Parameters, the
    GEMV kernel for a decode step's few tokens, cuBLAS for more."""

    def __init__(self, linear: torch.nn.Linear, backend: str):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.backend = backend

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``linear(x)``, or ``residual + linear(x)`` (the GEMV's epilogue adds it)."""
        return dense.linear(x, self.weight, self.bias, backend=self.backend, residual=residual)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bitdecode.dense.linear"


def _mergeable(linears) -> bool:
    first = linears[0]
    return (all(type(lin) is torch.nn.Linear for lin in linears)
            and all(lin.in_features == first.in_features and lin.weight.dtype == first.weight.dtype
                    and lin.weight.device == first.weight.device and (lin.bias is None) == (first.bias is None)
                    for lin in linears))


@functools.lru_cache(maxsize=None)
def _llama_mlp_body() -> str:
    from transformers.models.llama import modeling_llama

    return _body(modeling_llama.LlamaMLP.forward)


def _swiglu_mlp_forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Llama's MLP forward, ``down(silu(gate(x)) * up(x))``, on the merged gate / up GEMM's
    output with ``silu(gate) * up`` as one kernel (``bd.dense.silu_mul``); with ``residual``
    (a fused decoder layer's: ``_fused_residual_forward``) ``residual + down(...)``, the add
    in the down projection's GEMV."""
    group = self.gate_proj.group
    act = dense.silu_mul(group.merged(x), backend=group.backend)
    if residual is None:
        return self.down_proj(act)
    if isinstance(self.down_proj, Projection):
        return self.down_proj(act, residual=residual)
    return residual + self.down_proj(act)


def _is_swiglu_mlp(module: torch.nn.Module) -> bool:
    """A Llama-style SwiGLU MLP (its forward's code is ``LlamaMLP``'s, its activation SiLU)
    whose gate / up projections ``fuse_projections`` has just merged."""
    gate = getattr(module, "gate_proj", None)
    return (isinstance(gate, ProjectionSlice) and gate.index == 0 and len(gate.group.splits) == 2
            and type(getattr(module, "act_fn", None)).__name__ in _SILU_CLASSES
            and "forward" not in vars(module) and _body(type(module).forward) == _llama_mlp_body())


def fuse_projections(model: torch.nn.Module, backend: str = "auto") -> int:
    """Run ``model``'s projections as few, lean kernels (in place):

    * the projections that read the same input are merged into one GEMM each: an attention
      layer's ``q_proj`` / ``k_proj`` / ``v_proj`` and an MLP's ``gate_proj`` / ``up_proj``
      (``PROJECTION_GROUPS``; plain ``nn.Linear`` of one input size, dtype and device).  The
      weights move into one concatenated storage (``weight`` of each projection a view of
      it, so the memory and ``state_dict`` keys stay).  Call it after moving the model to
      its device and dtype;
    * every projection (the merged ones and ``o_proj`` / ``down_proj``) goes through
      ``bd.dense.linear``: bitdecode's GEMV for a decode step's few tokens, cuBLAS for more;
    * a Llama-style MLP (Llama, Mistral, Qwen2/3, SmolLM: its forward's code is
      ``LlamaMLP``'s, its activation SiLU) computes ``silu(gate) * up`` as one kernel over
      the merged output (``bd.dense.silu_mul``, bit-identical to torch's ops).

    ``backend``: "auto" as above, "reference" merged on torch's ops only.  Outputs equal
    ``nn.Linear``'s up to the summation order.  Returns the number of groups merged;
    ``unfuse_projections`` undoes it."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if backend not in ("auto", "reference"):  # ("kernel" would refuse a prefill's many tokens)
        raise ValueError(f"backend must be 'auto' or 'reference', got {backend!r}")
    count = 0
    for parent in list(model.modules()):
        for names in PROJECTION_GROUPS:
            linears = [getattr(parent, n, None) for n in names]
            if any(lin is None for lin in linears) or not _mergeable(linears):
                continue
            group = _MergedProjection(linears, backend)
            for i, name in enumerate(names):
                setattr(parent, name, ProjectionSlice(group, i, linears[i]))
            count += 1
        for name in SINGLE_PROJECTIONS:
            if type(getattr(parent, name, None)) is torch.nn.Linear:
                setattr(parent, name, Projection(getattr(parent, name), backend))
        if _is_swiglu_mlp(parent):
            parent.forward = _swiglu_mlp_forward.__get__(parent)
    return count


@contextlib.contextmanager
def fused(model: torch.nn.Module, norms: bool = True, rotary: bool = True, projections: Optional[str] = "auto",
          backend: str = "auto"):
    """``fuse_norms`` / ``fuse_rope`` / ``fuse_projections`` (``projections``: its backend,
    None to skip) on ``model`` for a ``with`` block, undone after (the rotary embedding of
    only the modeling modules this call patched).  ``backend``: the norms' and the rotary
    embedding's.  Yields ``{"norms": n, "rope": modules, "projection_groups": n}``.  The
    arguments are checked before anything is fused, and what was fused is undone if a
    later step raises."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    for used, choices in ((norms, bitnet.BACKENDS), (rotary, rope.BACKENDS)):
        if used and backend not in choices:
            raise ValueError(f"backend must be one of {choices}, got {backend!r}")
    if projections not in (None, "auto", "reference"):
        raise ValueError(f"projections must be 'auto', 'reference' or None, got {projections!r}")
    before = set(_ROPE_ORIGINALS)
    done = {"norms": 0, "rope": [], "projection_groups": 0}
    ran = []
    try:
        if norms:
            ran.append(unfuse_norms)
            done["norms"] = fuse_norms(model, backend)
        if rotary:
            ran.append(lambda _: restore_rope(set(done["rope"]) - before))
            done["rope"] = fuse_rope(model, backend)
        if projections:
            ran.append(unfuse_projections)
            done["projection_groups"] = fuse_projections(model, projections)
        yield done
    finally:
        for undo in reversed(ran):
            undo(model)


def unfuse_projections(model: torch.nn.Module) -> int:
    """Put plain ``nn.Linear`` modules back in place of ``fuse_projections``' (their
    weights stay views of the merged storage: no copy) and the MLPs' own forward; returns
    how many projections were replaced."""
    count = 0
    for parent in list(model.modules()):
        if _own_forward(parent) is _swiglu_mlp_forward:
            del parent.forward
        for name, child in list(parent.named_children()):
            if isinstance(child, (ProjectionSlice, Projection)):
                lin = torch.nn.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                                      device="meta")
                lin.weight = child.weight
                if child.bias is not None:
                    lin.bias = child.bias
                setattr(parent, name, lin)
                count += 1
    return count


AttentionInterface.register(ATTN_IMPLEMENTATION, bitdecode_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, sdpa_mask)

__all__ = ["BitDecodingCache", "BitDecodingLayer", "bitdecode_attention", "ATTN_IMPLEMENTATION", "FusedRMSNorm",
           "fuse_norms", "unfuse_norms", "RMS_NORM_CLASSES", "fuse_rope", "restore_rope", "fuse_projections", "unfuse_projections", "fused", "ProjectionSlice",
           "Projection", "PROJECTION_GROUPS", "SINGLE_PROJECTIONS", "cache_kwarg", "cache_kwargs"]
