"""KV-cache quantization formats and the shapes of their packed storage."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Tuple

from . import _validate
from .layouts import packing, sm80

BITS = (4, 2)
K_MODES = ("channel", "token")
GROUP_SIZES = (32, 64, 128)
HEAD_DIMS = (64, 128, 256)
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
    * ``group_size``: 32, 64 or 128.
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
    """

    bits: int = 4
    k_mode: str = "channel"
    group_size: int = 128
    v_bits: Optional[int] = None
    sink_tokens: int = 0
    hadamard: bool = False
    residual_block: int = field(init=False)

    def __post_init__(self):
        _choice("bits", self.bits, BITS)
        _choice("k_mode", self.k_mode, K_MODES)
        _choice("group_size", self.group_size, GROUP_SIZES)
        if self.v_bits is None:
            object.__setattr__(self, "v_bits", self.bits)
        _choice("v_bits", self.v_bits, BITS)
        _validate.nonnegative_int("KVFormat.sink_tokens", self.sink_tokens)
        if not isinstance(self.hadamard, bool):
            raise ValueError(f"KVFormat.hadamard must be True or False, got {self.hadamard!r}")
        object.__setattr__(self, "residual_block",
                           max(sm80.residual_block(self.bits), sm80.residual_block(self.v_bits)))

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
        if self.k_mode == "channel":
            return (pages, heads, page // self.group_size, head_dim)
        return (pages, heads, page, head_dim // self.group_size)

    def v_params_shape(self, pages: int, heads: int, page: int, head_dim: int) -> Tuple[int, ...]:
        k = sm80.MMA_SHAPE[2]
        return (pages, heads, page // k, head_dim // self.group_size, k)

    def bytes_per_token(self, head_dim: int) -> float:
        """Packed K+V plus params, per token per KV head (residual excluded)."""
        packed = head_dim * (self.bits + self.v_bits) / 8
        # per channel per G tokens, or per token per G channels: D/G pairs a token either way
        k_params = head_dim / self.group_size * PARAM_WORD_BYTES
        v_params = head_dim / self.group_size * PARAM_WORD_BYTES
        return packed + k_params + v_params

    def describe(self) -> str:
        width = f"{self.bits}-bit" if self.v_bits == self.bits else f"K {self.bits}-bit / V {self.v_bits}-bit"
        sinks = f", first {self.sink_tokens} tokens 16-bit" if self.sink_tokens else ""
        sinks += ", K and Q Hadamard-rotated" if self.hadamard else ""
        return (f"{width}, K per {self.k_mode} (groups of {self.group_size} "
                f"{'tokens' if self.k_mode == 'channel' else 'channels'}), V per token "
                f"(groups of {self.group_size} channels), residual block {self.residual_block}{sinks}")
