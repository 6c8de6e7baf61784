"""Register-level dequantization: the lop3 sequence of ``layouts.packing`` in PTX.

A packed word becomes F/2 half2 registers, each holding two codes as exact 16-bit
floats (lop3 into the mantissa of a magic number, then one exact packed fma removes the
magic offset and the field's power-of-two weight).  A final packed fma with the
(scale, zero) pair gives the values the MMA consumes.
"""

from __future__ import annotations

import struct
from typing import Dict, Iterable

from cutlass import Uint32

from ..layouts import packing
from . import ptx


def half_bits(value: float, is_bf16: bool) -> int:
    """16-bit pattern of ``value`` (exact for the small powers of two used here)."""
    if is_bf16:
        bits32 = struct.unpack("<I", struct.pack("<f", value))[0]
        assert bits32 & 0xFFFF == 0, f"{value} is not exact in bf16"
        return bits32 >> 16
    return struct.unpack("<H", struct.pack("<e", value))[0]


def half2_bits(value: float, is_bf16: bool) -> int:
    h = half_bits(value, is_bf16)
    return h | (h << 16)


class WordDequant:
    """Dequantizes element pairs of packed words (trace-time object; one per kernel)."""

    def __init__(self, bits: int, is_bf16: bool):
        self.is_bf16 = is_bf16
        dtype = "bf16" if is_bf16 else "fp16"
        self.steps = packing.dequant_steps(bits, dtype)
        self.fix_mul = [half2_bits(s.fix_scale, is_bf16) for s in self.steps]
        self.fix_add = [half2_bits(s.fix_bias(dtype), is_bf16) for s in self.steps]

    def codes(self, word, pairs: Iterable[int]) -> Dict[int, Uint32]:
        """Exact half2 codes of the requested element pairs of ``word``."""
        shifted: Dict[int, Uint32] = {}
        out: Dict[int, Uint32] = {}
        for p in pairs:
            step = self.steps[p]
            if step.shift not in shifted:
                shifted[step.shift] = word if step.shift == 0 else word >> step.shift
            t = ptx.lop3_and_or(shifted[step.shift], step.mask, step.magic)
            out[p] = ptx.fma_x2_imm(t, self.fix_mul[p], self.fix_add[p], self.is_bf16)
        return out

    def scale(self, code2, scale2, zero2):
        """``code * scale + zero`` on a half2 pair, one rounding."""
        return ptx.fma_x2(code2, scale2, zero2, self.is_bf16)


def split_params(p0, p1):
    """Two (scale, zero) words -> (scale pair, zero pair) for adjacent fragment columns."""
    return ptx.prmt(p0, p1, packing.PRMT_LOW_HALVES), ptx.prmt(p0, p1, packing.PRMT_HIGH_HALVES)


def broadcast_params(p):
    """One (scale, zero) word -> (scale, scale), (zero, zero)."""
    return ptx.prmt(p, p, packing.PRMT_LOW_BROADCAST), ptx.prmt(p, p, packing.PRMT_HIGH_BROADCAST)
