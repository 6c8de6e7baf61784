"""Register-level dequantization: the lop3 sequence of ``layouts.packing`` in PTX.

A packed word becomes F/2 half2 registers, each holding two codes as exact 16-bit
floats (lop3 into the mantissa of a magic number, then one exact packed fma removes the
magic offset and the field's power-of-two weight).  A final packed fma with the
(scale, zero) pair gives the values the MMA consumes.
"""

from __future__ import annotations

import struct
from typing import Dict, Iterable

import cutlass
from cutlass import Int32, Uint32

from ..layouts import packing, sm100
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

    def __init__(self, bits: int, is_bf16: bool, center: int = 0, subnormal_room: int = 0):
        """``center``: subtracted from every code by the exact fix step (``codes`` then
        yields ``code - center``, still exact), for consumers that apply (scale, zero)
        themselves and want small products (``kernels_sm90.decode``'s ``fold_v``).
        ``subnormal_room`` (fp16): ``codes`` is the lop3 alone, ``(code << offset) 2^-24``
        with offsets under ``subnormal_room - bits`` bits (``steps[p].mult = 2^offset``): the
        consumer folds ``2^24 / mult`` into the other operand and the result."""
        self.is_bf16 = is_bf16
        dtype = "bf16" if is_bf16 else "fp16"
        self.subnormal = bool(subnormal_room)
        assert not (self.subnormal and (is_bf16 or center))
        self.steps = packing.dequant_steps(bits, dtype, subnormal_room, self.subnormal)
        self.fix_mul = [half2_bits(s.fix_scale, is_bf16) for s in self.steps]
        self.fix_add = [half2_bits(s.fix_bias(dtype) - center, is_bf16) for s in self.steps]

    def codes(self, word, pairs: Iterable[int]) -> Dict[int, Uint32]:
        """Exact half2 codes of the requested element pairs of ``word``."""
        shifted: Dict[int, Uint32] = {}
        if self.subnormal:
            return {p: self._lop3(word, p, shifted) for p in pairs}
        return {p: ptx.fma_x2_imm(self._lop3(word, p, shifted), self.fix_mul[p], self.fix_add[p], self.is_bf16)
                for p in pairs}

    def raw(self, word, pairs: Iterable[int]) -> Dict[int, Uint32]:
        """The lop3 halves of the requested pairs, ``magic + code * mult`` (exact), for a
        consumer that folds the fix-up into the other operand of its product."""
        shifted: Dict[int, Uint32] = {}
        return {p: self._lop3(word, p, shifted) for p in pairs}

    def _lop3(self, word, p: int, shifted: Dict[int, Uint32]) -> Uint32:
        step = self.steps[p]
        if step.shift not in shifted:  # one shift per distinct amount, shared by its pairs
            shifted[step.shift] = word if step.shift == 0 else word >> step.shift
        return ptx.lop3_and_or(shifted[step.shift], step.mask, step.magic)

    def scale(self, code2, scale2, zero2):
        """``code * scale + zero`` on a half2 pair, one rounding."""
        return ptx.fma_x2(code2, scale2, zero2, self.is_bf16)


def split_params(p0, p1):
    """Two (scale, zero) words -> (scale pair, zero pair) for adjacent fragment columns."""
    return ptx.prmt(p0, p1, packing.PRMT_LOW_HALVES), ptx.prmt(p0, p1, packing.PRMT_HIGH_HALVES)


def broadcast_params(p):
    """One (scale, zero) word -> (scale, scale), (zero, zero)."""
    return ptx.prmt(p, p, packing.PRMT_LOW_BROADCAST), ptx.prmt(p, p, packing.PRMT_HIGH_BROADCAST)


class E2M1Dequant:
    """FP4 (e2m1) codes in natural order -> half2 pairs (trace-time object).

    Pair ``p`` of a word is its byte ``p`` (values ``2 p``, ``2 p + 1``: the low nibble to
    the low half).  Each nibble's magnitude bits (exponent e1 e0, mantissa m) go to the
    16-bit float's lowest exponent bits and top mantissa bit and its sign to the sign bit,
    which reads as the e2m1 value times 2^-14 (fp16) or 2^-126 (bf16), subnormals included;
    one exact packed multiply restores the power of two.  ``scale`` then applies the
    block's scale (``fp4_scale_pair``), as the integer path applies (scale, zero)."""

    def __init__(self, is_bf16: bool):
        self.is_bf16 = is_bf16
        dtype = "bf16" if is_bf16 else "fp16"
        # e1 e0 m onto the exponent's low bits + the mantissa's top bit (6 bf16, 9 fp16)
        self.mag_shift = packing.MANTISSA_BITS[dtype] - sm100.E2M1_MANTISSA_BITS
        # the code's sign (bit 3) to the 16-bit sign (bit 15): 8 * lift = 2^15 - 2^(3 + shift)
        self.sign_lift = (1 << (packing.HALF_SIGN_BIT - sm100.E2M1_SIGN_BIT)) - (1 << self.mag_shift)
        # the exponent read with the 16-bit bias instead of e2m1's: 2^14 (fp16), 2^126 (bf16)
        self.fix = half2_bits(2.0 ** (packing.EXP_BIAS[dtype] - sm100.E2M1_EXP_BIAS), is_bf16)

    def codes(self, word, pairs: Iterable[int]) -> Dict[int, Uint32]:
        hi_nibbles = word >> 4
        out: Dict[int, Uint32] = {}
        for p in pairs:
            # nibble 2p at bits 3:0 (its sign at 3), nibble 2p + 1 at bits 19:16 (sign at 19)
            nib = ptx.prmt(word, hi_nibbles, packing.PRMT_BYTE_PAIR[p]) & 0x000F000F
            # shifted by mag_shift the magnitudes land in place and the signs 6 (fp16) or 9
            # (bf16) bits below the sign bit; adding sign * (2^15 - 2^(3 + mag_shift)) moves
            # them up (a carry through the zero bits between)
            sign = nib & 0x00080008
            bits = (nib << self.mag_shift) + sign * self.sign_lift
            out[p] = ptx.fma_x2_imm(bits, self.fix, 0, self.is_bf16)
        return out

    def scale(self, code2, scale2, zero2=None):
        """``code * scale`` on a half2 pair (exact: at most 6 significant bits)."""
        return ptx.fma_x2(code2, scale2, Uint32(0), self.is_bf16)


def fp4_scale_pair(word, byte: int, fp4: str, is_bf16: bool):
    """Scale byte ``byte`` of ``word`` (one row's four scale columns, ``layouts.sm100``) as
    a half2 pair.  UE4M3: the byte's exponent and mantissa moved under the 16-bit float's,
    then an exact power-of-two multiply (subnormals included); the NaN byte gives NaN.
    UE8M0: ``2^(byte - 127)`` built as exponent bits (fp16: clamped to its normal range,
    which no block of fp16 values needs past)."""
    dtype = "bf16" if is_bf16 else "fp16"
    mant = packing.MANTISSA_BITS[dtype]
    b = (word >> (sm100.SF_BITS * byte)) & 0xFF
    pair = b | (b << 16)
    if fp4 == "nvfp4":
        e4m3_fix = half2_bits(2.0 ** (packing.EXP_BIAS[dtype] - sm100.E4M3_EXP_BIAS), is_bf16)
        s2 = ptx.fma_x2_imm(pair << (mant - sm100.E4M3_MANTISSA_BITS), e4m3_fix, 0, is_bf16)
        nan = b == sm100.UE4M3_NAN
    else:
        if is_bf16:
            s2 = pair << mant  # bf16 has e8m0's 8 exponent bits
        else:
            e = Int32(b) - (sm100.UE8M0_BIAS - packing.EXP_BIAS[dtype])
            e = cutlass.max(cutlass.min(e, packing.EXP_MAX_FINITE[dtype]), 1)
            s2 = Uint32(e) << mant
            s2 = s2 | (s2 << 16)
        nan = b == sm100.UE8M0_NAN
    return s2 | (Uint32(nan) * Uint32(0x7FFF7FFF))
