"""KV-cache quantization formats and the shapes of their packed storage."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Optional, Tuple

from . import _validate
from .layouts import packing, sm80, sm100

BITS = (4, 2)
K_MODES = ("channel", "token")
GROUP_SIZES = (32, 64, 128)
HEAD_DIMS = (64, 128, 256)
FP4_FORMATS = sm100.FP4_FORMATS  # ("nvfp4", "mxfp4")
PARAM_WORD_BYTES = 4  # one (scale, zero) 16-bit pair


def _choice(name: str, value, allowed) -> None:
    if isinstance(value, bool) or not isinstance(value, type(allowed[0])) or value not in allowed:
        raise ValueError(f"KVFormat.{name} must be one of {allowed}, got {value!r}")


@dataclass(frozen=True)
class KVFormat:
    """How K and V are quantized and packed.

    * ``bits``: 4 or 2 bits per value (K and V).
    * ``k_mode``: ``"channel"`` (KIVI, default): one (scale, zero) per channel per group of
      ``group_size`` tokens; ``"token"``: one pair per token per group of ``group_size``
      channels.  V is always per token, groups of ``group_size`` channels.
    * ``group_size``: 32, 64 or 128 (default 128).
    * ``fp4``: ``"nvfp4"`` or ``"mxfp4"`` instead of integer codes: 4-bit e2m1 values with
      one scale per block of values along the MMA's contraction dim, the layout Blackwell's
      block-scaled ``tcgen05.mma`` reads (``layouts.sm100``).  NVFP4: one UE4M3 scale per
      16 values; MXFP4 (OCP MX): one UE8M0 (power of two) per 32.  K is scaled per token
      along its channels (``k_mode`` "token", the default then), V per channel along its
      tokens, both in blocks of ``group_size`` = 16 / 32 (the default then; nothing else is
      allowed); no zero point.  Rounding, exactly: NVFP4 ``s = ue4m3_rne(clamp(amax / 6,
      2^-9, 448))``; MXFP4 ``s = 2^(floor(log2 amax) - 2)`` (``2^-127`` for an all-zero
      block); codes ``e2m1_rne(x / s)``, half to even, saturating at +-6.  A block holding
      a NaN or an infinity gets the NaN scale (its values dequantize to NaN).  NVFP4 has no
      per-head fp32 scale here: blocks with ``amax`` above 6 x 448 = 2688 saturate, blocks
      below 6 x 2^-9 are quantized on the smallest scale.  ``bits`` must be 4.  On a GPU
      the FP4 pack kernel writes FP4 caches (the reference's bytes) and both decode kernels
      read them (``auto``: sm90 on Hopper up to head dim 128, else sm80); multi-token
      kernel queries refuse them.
    * ``v_bits``: V's own width when it differs from K's (``bits``): K4V2, K2V4.  The
      residual block is then the larger of the two widths' blocks (256 tokens: both
      widths' packed tiles complete together), V packed in tiles of its own width's block
      (``v_tile``).  Default (None): V as K.
    * ``sink_tokens``: the first S tokens of every sequence stay 16-bit for good
      (attention sinks, never quantized); the packed blocks and the residual start after
      them.  Every backend takes them: the kernels attend to them as 16-bit sub-tiles
      like the residual.  Default 0.
    * ``hadamard``: K is stored rotated by the normalized Walsh-Hadamard matrix of the
      head dim (``K H``), and every query is rotated the same way before attention
      (``(Q H)(K H)^T = Q K^T``: the scores are unchanged, up to one 16-bit rounding of the
      rotated Q and K).  The rotation spreads K's outlier channels over all channels before
      they are grouped, which 2-bit K needs (SmolLM2: 2-bit K per channel g32 with 16 sinks
      +8.1 % perplexity unrotated, +3.9 % rotated; README).  V is not rotated.  The
      rotation is torch on the host side of every backend (one matmul per append / decode
      call); the kernels are unchanged.  Default False.

    Quantization is asymmetric: ``zero = min``, ``scale = (max - min) / (2^bits - 1)``,
    ``q = clamp(rint((x - zero) / scale), 0, 2^bits - 1)``, ``x = q * scale + zero``,
    scale and zero stored as a 16-bit pair in the model dtype.  The newest
    ``(len - sinks) % residual_block`` tokens stay in 16 bits.

    Every backend takes every combination of widths: a K2V4 block holds two 128-token 4-bit
    V tiles, which the kernels read one after the other.

    The defaults are filled in when the format is made (``v_bits`` = ``bits``, ``group_size``
    128, ...), so ``dataclasses.replace`` keeps them: ``replace(KVFormat(bits=4), bits=2)``
    is K2V4.  Build a new ``KVFormat`` for another width.
    """

    bits: int = 4
    k_mode: Optional[str] = None
    group_size: Optional[int] = None
    v_bits: Optional[int] = None
    sink_tokens: int = 0
    hadamard: bool = False
    fp4: Optional[str] = None
    # derived from the widths (not an argument): out of repr and comparisons, so that a
    # format's repr rebuilds it
    residual_block: int = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        for name in ("bits", "group_size", "v_bits"):  # numpy's ints as Python ints (bools stay refused)
            value = getattr(self, name)
            if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)):
                object.__setattr__(self, name, int(value))
        _choice("bits", self.bits, BITS)
        if self.fp4 is not None:
            self._resolve_fp4()
        if self.k_mode is None:
            object.__setattr__(self, "k_mode", "channel")
        _choice("k_mode", self.k_mode, K_MODES)
        if self.group_size is None:
            object.__setattr__(self, "group_size", 128)
        if self.fp4 is None:
            _choice("group_size", self.group_size, GROUP_SIZES)
        if self.v_bits is None:
            object.__setattr__(self, "v_bits", self.bits)
        _choice("v_bits", self.v_bits, BITS)
        object.__setattr__(self, "sink_tokens", _validate.nonnegative_int("KVFormat.sink_tokens", self.sink_tokens))
        if not isinstance(self.hadamard, bool):
            raise ValueError(f"KVFormat.hadamard must be True or False, got {self.hadamard!r}")
        object.__setattr__(self, "residual_block",
                           max(sm80.residual_block(self.bits), sm80.residual_block(self.v_bits)))

    def _resolve_fp4(self) -> None:
        _choice("fp4", self.fp4, FP4_FORMATS)
        vec = sm100.SF_VEC[self.fp4]
        if self.bits != 4 or self.v_bits not in (None, 4):
            raise ValueError(f"KVFormat(fp4={self.fp4!r}) stores 4-bit e2m1 codes: bits and v_bits must be 4, "
                             f"got bits={self.bits!r}, v_bits={self.v_bits!r}")
        if self.k_mode not in (None, "token"):
            raise ValueError(f"KVFormat(fp4={self.fp4!r}) scales K per token along its channels (the MMA's "
                             f"contraction dim): k_mode must be 'token' or left out, got {self.k_mode!r}")
        if self.group_size not in (None, vec):
            raise ValueError(f"KVFormat(fp4={self.fp4!r}) has one scale per {vec} values: group_size must be "
                             f"{vec} or left out, got {self.group_size!r}")
        object.__setattr__(self, "k_mode", "token")
        object.__setattr__(self, "group_size", vec)

    @property
    def k_bits(self) -> int:
        return self.bits

    @property
    def v_tile(self) -> int:
        """Tokens of one packed V tile (V's own width's residual block)."""
        return sm80.residual_block(self.v_bits)

    # ---- derived quantities -----------------------------------------------------------
    @property
    def qmax(self) -> int:
        return packing.qmax(self.bits)

    @property
    def codes_per_word(self) -> int:
        return packing.codes_per_word(self.bits)

    def tiles(self, tokens: int) -> int:
        """Residual blocks (the decode kernels' tiles) that ``tokens`` tokens span."""
        return -(-tokens // self.residual_block)

    def check_head_dim(self, head_dim: int, name: str = "head_dim") -> None:
        if isinstance(head_dim, bool) or head_dim not in HEAD_DIMS:
            raise ValueError(f"{name} must be one of {HEAD_DIMS}, got {head_dim!r}")
        if self.group_size > head_dim:
            raise ValueError(
                f"KVFormat.group_size={self.group_size} groups channels of V"
                f"{' and K' if self.k_mode == 'token' else ''}, so it must not exceed "
                f"{name}={head_dim}; choose group_size <= {head_dim}"
            )

    # ---- storage shapes (per page of `page` tokens; see layouts/sm80.py) ---------------
    def k_pack_shape(self, pages: int, heads: int, page: int, head_dim: int) -> Tuple[int, ...]:
        return (pages, heads, page, sm80.words_per_row(self.bits, head_dim))

    def v_pack_shape(self, pages: int, heads: int, page: int, head_dim: int) -> Tuple[int, ...]:
        nv = self.v_tile
        return (pages, heads, page // nv, head_dim, sm80.words_per_row(self.v_bits, nv))

    def k_params_shape(self, pages: int, heads: int, page: int, head_dim: int) -> Tuple[int, ...]:
        if self.fp4:  # per 128-token tile: basic chunks across the scale columns (int32 words)
            return (pages, heads, page // sm100.SF_ATOM_ROWS, sm100.sf_chunks(head_dim // self.group_size),
                    sm100.SF_CHUNK_WORDS)
        if self.k_mode == "channel":
            return (pages, heads, page // self.group_size, head_dim)
        return (pages, heads, page, head_dim // self.group_size)

    def v_params_shape(self, pages: int, heads: int, page: int, head_dim: int) -> Tuple[int, ...]:
        if self.fp4:  # per V tile: basic chunks down the channels and across the scale columns
            nv = self.v_tile
            return (pages, heads, page // nv, sm100.sf_row_chunks(head_dim), sm100.sf_chunks(nv // self.group_size),
                    sm100.SF_CHUNK_WORDS)
        k = sm80.MMA_SHAPE[2]
        return (pages, heads, page // k, head_dim // self.group_size, k)

    def bytes_per_token(self, head_dim: int) -> float:
        """Packed K+V plus params, per token per KV head (residual excluded)."""
        packed = head_dim * (self.bits + self.v_bits) / 8
        if self.fp4:  # one scale byte per G values of K and of V (chunk padding excluded)
            return packed + 2 * head_dim / self.group_size
        # per channel per G tokens, or per token per G channels: D/G pairs a token either way
        k_params = head_dim / self.group_size * PARAM_WORD_BYTES
        v_params = head_dim / self.group_size * PARAM_WORD_BYTES
        return packed + k_params + v_params

    @property
    def code_name(self) -> str:
        """The codes' short name: ``"4-bit"``, ``"2-bit"`` (K's width) or ``"NVFP4"`` / ``"MXFP4"``."""
        return self.fp4.upper() if self.fp4 else f"{self.bits}-bit"

    def describe(self) -> str:
        width = self.code_name if self.v_bits == self.bits else f"K {self.bits}-bit / V {self.v_bits}-bit"
        sinks = f", first {self.sink_tokens} tokens 16-bit" if self.sink_tokens else ""
        sinks += ", K and Q Hadamard-rotated" if self.hadamard else ""
        if self.fp4:
            scale = sm100.SF_NAME[self.fp4].upper()
            return (f"{self.code_name} (e2m1, one {scale} scale per {self.group_size} values): K per token along "
                    f"its channels, V per channel along its tokens, residual block {self.residual_block}{sinks}")
        return (f"{width}, K per {self.k_mode} (groups of {self.group_size} "
                f"{'tokens' if self.k_mode == 'channel' else 'channels'}), V per token "
                f"(groups of {self.group_size} channels), residual block {self.residual_block}{sinks}")


def model_head_dim(config) -> Optional[int]:
    """The attention head dim a transformers model config states: ``head_dim``, else
    ``hidden_size / num_attention_heads``; None where it states neither."""
    head_dim = getattr(config, "head_dim", None)
    if isinstance(head_dim, int) and not isinstance(head_dim, bool) and head_dim > 0:
        return head_dim
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 and hidden % heads == 0:
        return hidden // heads
    return None
