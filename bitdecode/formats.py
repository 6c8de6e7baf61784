"""KV-cache quantization formats and the shapes of their packed storage."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Tuple

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

    Quantization is asymmetric: ``zero = min``, ``scale = (max - min) / (2^bits - 1)``,
    ``q = clamp(rint((x - zero) / scale), 0, 2^bits - 1)``, ``x = q * scale + zero``,
    scale and zero stored as a 16-bit pair in the model dtype.  The newest
    ``len % residual_block`` tokens stay in 16 bits.
    """

    bits: int = 4
    k_mode: str = "channel"
    group_size: int = 128
    residual_block: int = field(init=False)

    def __post_init__(self):
        _choice("bits", self.bits, BITS)
        _choice("k_mode", self.k_mode, K_MODES)
        _choice("group_size", self.group_size, GROUP_SIZES)
        object.__setattr__(self, "residual_block", sm80.residual_block(self.bits))

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
        nr = self.residual_block
        return (pages, heads, page // nr, head_dim, sm80.words_per_row(self.bits, nr))

    def k_params_shape(self, pages: int, heads: int, page: int, head_dim: int) -> Tuple[int, ...]:
        if self.k_mode == "channel":
            return (pages, heads, page // self.group_size, head_dim)
        return (pages, heads, page, head_dim // self.group_size)

    def v_params_shape(self, pages: int, heads: int, page: int, head_dim: int) -> Tuple[int, ...]:
        k = sm80.MMA_SHAPE[2]
        return (pages, heads, page // k, head_dim // self.group_size, k)

    def bytes_per_token(self, head_dim: int) -> float:
        """Packed K+V plus params, per token per KV head (residual excluded)."""
        packed = 2 * head_dim * self.bits / 8
        # per channel per G tokens, or per token per G channels: D/G pairs a token either way
        k_params = head_dim / self.group_size * PARAM_WORD_BYTES
        v_params = head_dim / self.group_size * PARAM_WORD_BYTES
        return packed + k_params + v_params

    def describe(self) -> str:
        return (f"{self.bits}-bit, K per {self.k_mode} (groups of {self.group_size} "
                f"{'tokens' if self.k_mode == 'channel' else 'channels'}), V per token "
                f"(groups of {self.group_size} channels), residual block {self.residual_block}")
