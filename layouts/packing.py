"""Bit-level packing of low-bit codes into 32-bit words, and the lop3 sequence that undoes it.

A 32-bit word holds ``F = 32 / bits`` codes: 8 for 4-bit, 16 for 2-bit.  The codes are
*elements* 0..F-1 in the order the dequantized half2 registers are consumed: elements
(0, 1) become the first half2 register pair, (2, 3) the second, and so on.  Element
``e`` sits in bit field ``(e % 2) * F/2 + e // 2``: even elements fill the low 16 bits,
odd elements the high 16 bits, so one AND with a mask repeated in both halves
(``0x000f000f``) lifts an element pair into the two 16-bit lanes of a register at
once.  For 4 bits this is BitDecoding's "75316420" interleave (nibbles from most to
least significant hold elements 7,5,3,1,6,4,2,0); for 2 bits the analogous
"fedcba98 76543210"-style split of 16 fields.

Dequantization of one element pair (the instruction sequence kernels emit and the
tests emulate):

    t  = lop3(word >> shift, mask, MAGIC)      # (w & mask) | magic, one instruction
    q  = fma(t, 1/mult, -MAGIC_VALUE/mult)     # exact: the code as a 16-bit float
    x  = fma(q, scale, zero)                   # the dequantized value pair

``MAGIC`` is the 16-bit float whose mantissa LSBs the code lands in: 0x6400 (1024.0)
for fp16, 0x4300 (128.0) for bf16.  A field whose bits reach past the mantissa (bit 10
for fp16, bit 7 for bf16) needs the word shifted first; ``dequant_steps`` chooses the
fewest distinct shifts (for fp16 4-bit: none for pairs 0-1 and ``>> 8`` for pairs 2-3,
as in BitDecoding).
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Tuple

SUPPORTED_BITS = (4, 2)
WORD_BITS = 32

# 16-bit float with all mantissa bits zero and an exponent that makes the mantissa
# LSB worth exactly 1: OR-ing an integer code into the mantissa gives MAGIC + code.
MAGIC_BITS = {"fp16": 0x6400, "bf16": 0x4300}
MAGIC_VALUE = {"fp16": 1024.0, "bf16": 128.0}
MANTISSA_BITS = {"fp16": 10, "bf16": 7}
HALF_SIGN_BIT = 15  # a 16-bit float's sign bit
EXP_BIAS = {"fp16": 15, "bf16": 127}  # exponent bias of the 16-bit floats
EXP_MAX_FINITE = {"fp16": 30, "bf16": 254}  # their largest finite biased exponent
# log2 of the smallest subnormal's reciprocal: a half2 word's low mantissa bits, exponent 0,
# read ``bits x 2^-SUBNORMAL_LOG2`` (fp16: 2^-24)
SUBNORMAL_LOG2 = {dt: EXP_BIAS[dt] - 1 + MANTISSA_BITS[dt] for dt in EXP_BIAS}
F32_MANTISSA_BITS = 23
F32_EXP_BITS = 8
F32_EXP_BIAS = 127
F32_MIN_EXP = 1 - F32_EXP_BIAS  # the smallest normal fp32 exponent, -126
F32_SIGN_BIT = 31
F32_MAX = (2.0 - 2.0 ** -F32_MANTISSA_BITS) * 2.0 ** F32_EXP_BIAS  # the largest finite fp32
HALF2_BOTH = 0x00010001  # times a 16-bit pattern: the same pattern in both halves of a word

# lop3 lookup tables are written with PTX's operand convention a=0xF0, b=0xCC, c=0xAA.
LOP3_A, LOP3_B, LOP3_C = 0xF0, 0xCC, 0xAA
LOP3_AND_OR = (LOP3_A & LOP3_B) | LOP3_C  # (a & b) | c: 0xEA


def _check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")


def _check_dtype(dtype: str) -> None:
    if dtype not in MAGIC_BITS:
        raise ValueError(f"dtype must be one of {tuple(MAGIC_BITS)}, got {dtype!r}")


def qmax(bits: int) -> int:
    """Largest code: ``2^bits - 1``."""
    return (1 << bits) - 1


def inv_qmax(bits: int) -> float:
    """fp32(1 / (2^bits - 1)), the constant the kernels and the reference multiply the
    range by (rounded to fp32 once, here)."""
    import struct

    return struct.unpack("<f", struct.pack("<f", 1.0 / qmax(bits)))[0]


def codes_per_word(bits: int) -> int:
    """F: codes in one 32-bit word."""
    _check_bits(bits)
    return WORD_BITS // bits


def codes_per_half(bits: int) -> int:
    """Codes in one 16-bit half word (what one ldmatrix element carries)."""
    return codes_per_word(bits) // 2


def field_of_element(bits: int, element: int) -> int:
    """Bit field (0 = least significant) that holds element ``element`` of a word."""
    f = codes_per_word(bits)
    if not 0 <= element < f:
        raise ValueError(f"element must be in [0, {f}), got {element}")
    return (element % 2) * (f // 2) + element // 2


def shift_of_element(bits: int, element: int) -> int:
    """Bit offset of element ``element`` inside its word."""
    return bits * field_of_element(bits, element)


def interleave(bits: int) -> Tuple[int, ...]:
    """Elements held by the fields of a word, from the most to the least significant.

    ``interleave(4) == (7, 5, 3, 1, 6, 4, 2, 0)``: the "75316420" order.
    """
    f = codes_per_word(bits)
    by_field = {field_of_element(bits, e): e for e in range(f)}
    return tuple(by_field[i] for i in reversed(range(f)))


def interleave_string(bits: int) -> str:
    return "".join(format(e, "x") for e in interleave(bits))


@dataclass(frozen=True)
class DequantStep:
    """Turns element pair ``pair`` (elements 2*pair, 2*pair+1) of a word into a half2.

    ``t = ((word >> shift) & mask) | magic`` then ``q = t * (1/mult) - magic_value/mult``.
    """

    pair: int
    shift: int
    mask: int
    magic: int
    mult: int

    @property
    def fix_scale(self) -> float:
        return 1.0 / self.mult

    def fix_bias(self, dtype: str) -> float:
        return -MAGIC_VALUE[dtype] / self.mult


def dequant_steps(bits: int, dtype: str, room: int = 0, subnormal: bool = False) -> Tuple[DequantStep, ...]:
    """The per-pair lop3 sequence for one word, with the fewest distinct shifts that keep
    every code within the lowest ``room`` mantissa bits (default: all of them).
    ``subnormal``: no magic exponent, the lop3's halves read ``(code << offset)
    2^-SUBNORMAL_LOG2`` (subnormals, exact)."""
    _check_bits(bits)
    _check_dtype(dtype)
    f = codes_per_word(bits)
    room = room or MANTISSA_BITS[dtype]
    magic = 0 if subnormal else MAGIC_BITS[dtype] * HALF2_BOTH
    steps = []
    shift = 0
    for pair in range(f // 2):
        low = shift_of_element(bits, 2 * pair)  # the high element sits 16 bits above
        if low - shift + bits > room:
            shift = low
        offset = low - shift
        mask = ((1 << bits) - 1) << offset
        steps.append(DequantStep(pair, shift, mask * HALF2_BOTH, magic, 1 << offset))
    return tuple(steps)


def distinct_shifts(bits: int, dtype: str) -> Tuple[int, ...]:
    return tuple(sorted({s.shift for s in dequant_steps(bits, dtype)}))


# ---- (scale, zero) params word ----------------------------------------------------------
# One 32-bit word per group: the 16-bit scale in the low half, the 16-bit zero in the high
# half, so the word is a half2 (scale, zero).  prmt selectors that gather two words' halves:
PARAM_SCALE_SHIFT = 0
PARAM_ZERO_SHIFT = 16
PRMT_LOW_HALVES = 0x5410  # (a.lo, b.lo): the scales of two words
PRMT_HIGH_HALVES = 0x7632  # (a.hi, b.hi): the zeros of two words
PRMT_LOW_BROADCAST = 0x1010  # (a.lo, a.lo): one word's scale in both lanes
PRMT_HIGH_BROADCAST = 0x3232  # (a.hi, a.hi): one word's zero in both lanes
# (a.byte p, a.byte p, b.byte p, b.byte p): byte p of a word in both bytes of the low half
# and byte p of a second word in the high half (FP4: a byte's two e2m1 codes, one per half)
PRMT_BYTE_PAIR = tuple(p | (p << 4) | ((4 + p) << 8) | ((4 + p) << 12) for p in range(4))
# the scale and zero of a group whose range is not finite (NaN / Inf inside): the quiet NaN
# torch gives when it rounds a float NaN to the 16-bit type, so kernel and reference
# params are the same bytes
NAN_FP16 = 0x7E00
NAN_BF16 = 0x7FC0


def nan16(is_bf16: bool) -> int:
    return NAN_BF16 if is_bf16 else NAN_FP16


# The softmax convention the host and the kernels share: the host passes the scale times
# log2(e) and the kernels exponentiate in base 2; the LSE they return is natural (times ln 2).
LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)
