"""Single PTX instructions the kernels need and CuTe DSL does not expose as pure ops.

Everything here is one instruction (or a tight group that ptxas turns into one SASS op)
wrapped with ``llvm.inline_asm``.  Pure ops are marked side-effect free so LLVM can CSE
and schedule them; warp-collective ops (movmatrix) are not, so they are never moved
into divergent code.

Where CuTe DSL 4.8.1 has the op the kernels call it instead (the same instruction, and
LLVM can schedule around it): ``cute.arch.fmax`` / ``fmin``, ``cute.arch.shuffle_sync_bfly``,
``cute.math.exp2`` / ``log2`` with ``fastmath=True``.  Kept here: prmt (the DSL's has side
effects, which block CSE), lop3 with immediate masks, movmatrix, the exact-rounding packed
fma, the cvt packs and rounding conversions.
"""

from __future__ import annotations

from cutlass import Float32, Int32, Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from ..layouts import packing


def _asm(ret, operands, text, constraints, side_effects=False, loc=None, ip=None):
    return llvm.inline_asm(ret, operands, text, constraints, has_side_effects=side_effects,
                           is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


def _u32(x, loc, ip):
    return Uint32(x).ir_value(loc=loc, ip=ip)


@dsl_user_op
def lop3_and_or(a, mask: int, c: int, *, loc=None, ip=None) -> Uint32:
    """``(a & mask) | c`` in one lop3 (mask and c immediates): lifts a code pair into a
    half2 whose exponent is the dequant magic number."""
    res = _asm(T.i32(), [_u32(a, loc, ip)],
               "{.reg .b32 m, k;\n"
               f"mov.b32 m, {mask & 0xFFFFFFFF};\nmov.b32 k, {c & 0xFFFFFFFF};\n"
               f"lop3.b32 $0, $1, m, k, 0x{packing.LOP3_AND_OR:X};}}", "=r,r", loc=loc, ip=ip)
    return Uint32(res)


@dsl_user_op
def prmt(a, b, selector: int, *, loc=None, ip=None) -> Uint32:
    """Byte permute of {b, a}; selectors 0x5410 / 0x7632 gather low / high halves."""
    res = _asm(T.i32(), [_u32(a, loc, ip), _u32(b, loc, ip)],
               f"prmt.b32 $0, $1, $2, {selector};", "=r,r,r", loc=loc, ip=ip)
    return Uint32(res)


@dsl_user_op
def fma_x2(a, b, c, is_bf16: bool, *, loc=None, ip=None) -> Uint32:
    """Packed fma of two 16-bit floats (single rounding): a * b + c."""
    kind = "bf16x2" if is_bf16 else "f16x2"
    res = _asm(T.i32(), [_u32(a, loc, ip), _u32(b, loc, ip), _u32(c, loc, ip)],
               f"fma.rn.{kind} $0, $1, $2, $3;", "=r,r,r,r", loc=loc, ip=ip)
    return Uint32(res)


@dsl_user_op
def fma_x2_imm(a, b: int, c: int, is_bf16: bool, *, loc=None, ip=None) -> Uint32:
    """Packed fma with immediate multiplier and addend (the exact magic-number fix-up)."""
    kind = "bf16x2" if is_bf16 else "f16x2"
    res = _asm(T.i32(), [_u32(a, loc, ip)],
               "{.reg .b32 m, k;\n"
               f"mov.b32 m, {b & 0xFFFFFFFF};\nmov.b32 k, {c & 0xFFFFFFFF};\n"
               f"fma.rn.{kind} $0, $1, m, k;}}", "=r,r", loc=loc, ip=ip)
    return Uint32(res)


@dsl_user_op
def cvt_pack_x2(lo, hi, is_bf16: bool, *, loc=None, ip=None) -> Uint32:
    """Two fp32 -> one packed f16x2/bf16x2 (``lo`` in the low half), round to nearest."""
    kind = "bf16x2" if is_bf16 else "f16x2"
    res = _asm(T.i32(), [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)],
               f"cvt.rn.{kind}.f32 $0, $1, $2;", "=r,f,f", loc=loc, ip=ip)
    return Uint32(res)


@dsl_user_op
def movmatrix_trans(a, *, loc=None, ip=None) -> Uint32:
    """Transpose an 8x8 16-bit matrix held in the standard fragment across the warp."""
    res = _asm(T.i32(), [_u32(a, loc, ip)], "movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;",
               "=r,r", side_effects=True, loc=loc, ip=ip)
    return Uint32(res)


@dsl_user_op
def rcp_rn(x, *, loc=None, ip=None) -> Float32:
    """IEEE round-to-nearest reciprocal (bit-identical to torch.reciprocal)."""
    res = _asm(T.f32(), [Float32(x).ir_value(loc=loc, ip=ip)], "rcp.rn.f32 $0, $1;", "=f,f",
               loc=loc, ip=ip)
    return Float32(res)


@dsl_user_op
def div_rn(a, b, *, loc=None, ip=None) -> Float32:
    """IEEE round-to-nearest division (bit-identical to torch's fp32 ``a / b``)."""
    res = _asm(T.f32(), [Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip)],
               "div.rn.f32 $0, $1, $2;", "=f,f,f", loc=loc, ip=ip)
    return Float32(res)


@dsl_user_op
def mul_rn(a, b, *, loc=None, ip=None) -> Float32:
    """fp32 multiply, rounded once (no contraction into an fma with later ops)."""
    res = _asm(T.f32(), [Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip)],
               "mul.rn.f32 $0, $1, $2;", "=f,f,f", loc=loc, ip=ip)
    return Float32(res)


@dsl_user_op
def fma_rn(a, b, c, *, loc=None, ip=None) -> Float32:
    """fp32 ``a * b + c`` rounded once."""
    res = _asm(T.f32(), [Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip),
                         Float32(c).ir_value(loc=loc, ip=ip)],
               "fma.rn.f32 $0, $1, $2, $3;", "=f,f,f,f", loc=loc, ip=ip)
    return Float32(res)


@dsl_user_op
def u32_as_f32(x, *, loc=None, ip=None) -> Float32:
    """The bits of ``x`` as an fp32 value."""
    res = _asm(T.f32(), [_u32(x, loc, ip)], "mov.b32 $0, $1;", "=f,r", loc=loc, ip=ip)
    return Float32(res)


@dsl_user_op
def round_even(x, *, loc=None, ip=None) -> Float32:
    """Round to the nearest integer, ties to even (torch.round)."""
    res = _asm(T.f32(), [Float32(x).ir_value(loc=loc, ip=ip)], "cvt.rni.f32.f32 $0, $1;", "=f,f",
               loc=loc, ip=ip)
    return Float32(res)


@dsl_user_op
def f32_to_u32(x, *, loc=None, ip=None) -> Uint32:
    res = _asm(T.i32(), [Float32(x).ir_value(loc=loc, ip=ip)], "cvt.rzi.u32.f32 $0, $1;", "=r,f",
               loc=loc, ip=ip)
    return Uint32(res)


@dsl_user_op
def half_to_f32(bits16, is_bf16: bool, *, loc=None, ip=None) -> Float32:
    """The low 16 bits of ``bits16`` as an fp16/bf16 value, widened to fp32."""
    if is_bf16:
        res = _asm(T.f32(), [_u32(bits16, loc, ip)], "{.reg .b32 t;\nshl.b32 t, $1, 16;\nmov.b32 $0, t;}",
                   "=f,r", loc=loc, ip=ip)
    else:
        res = _asm(T.f32(), [_u32(bits16, loc, ip)],
                   "{.reg .b16 h;\ncvt.u16.u32 h, $1;\ncvt.f32.f16 $0, h;}", "=f,r", loc=loc, ip=ip)
    return Float32(res)


@dsl_user_op
def half_pair_to_f32(word, is_bf16: bool, *, loc=None, ip=None):
    """The two 16-bit values of a 32-bit word (low, high) widened to fp32; bf16 with one
    shift and one mask (bf16 is fp32's top half)."""
    if is_bf16:
        w = _u32(word, loc, ip)
        lo = _asm(T.f32(), [w], "{.reg .b32 t;\nshl.b32 t, $1, 16;\nmov.b32 $0, t;}", "=f,r", loc=loc, ip=ip)
        hi = _asm(T.f32(), [w], "{.reg .b32 t;\nand.b32 t, $1, 0xFFFF0000;\nmov.b32 $0, t;}", "=f,r", loc=loc, ip=ip)
        return Float32(lo), Float32(hi)
    return half_to_f32(word, False, loc=loc, ip=ip), half_to_f32(Uint32(word) >> 16, False, loc=loc, ip=ip)


@dsl_user_op
def f32_to_half_bits(x, is_bf16: bool, toward_zero: bool = False, *, loc=None, ip=None) -> Uint32:
    """fp32 -> fp16/bf16 (nearest even, or toward zero), returned in the low 16 bits."""
    kind = "bf16" if is_bf16 else "f16"
    rnd = "rz" if toward_zero else "rn"
    res = _asm(T.i32(), [Float32(x).ir_value(loc=loc, ip=ip)],
               f"{{.reg .b16 h;\ncvt.{rnd}.{kind}.f32 h, $1;\ncvt.u32.u16 $0, h;}}", "=r,f", loc=loc, ip=ip)
    return Uint32(res)


@dsl_user_op
def add_rn(a, b, *, loc=None, ip=None) -> Float32:
    """fp32 add with an explicit rounding mode, which ptxas never fuses with the multiply
    before it (the quantizer needs the product rounded on its own, as the reference)."""
    res = _asm(T.f32(), [Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip)],
               "add.rn.f32 $0, $1, $2;", "=f,f,f", loc=loc, ip=ip)
    return Float32(res)


@dsl_user_op
def f32_bits(x, *, loc=None, ip=None) -> Uint32:
    res = _asm(T.i32(), [Float32(x).ir_value(loc=loc, ip=ip)], "mov.b32 $0, $1;", "=r,f", loc=loc, ip=ip)
    return Uint32(res)


def f32_exponent(bits) -> Int32:
    """Unbiased exponent field of fp32 bits ``bits`` (normal numbers)."""
    return Int32((bits >> packing.F32_MANTISSA_BITS) & ((1 << packing.F32_EXP_BITS) - 1)) - packing.F32_EXP_BIAS


def fabs(x) -> Float32:
    """|x| by clearing the sign bit (NaN stays NaN).  Kept over ``cute.math.absf``
    (``abs.f32``): with that, ptxas spilled 44 bytes in the sm100 decode kernel (CuTe DSL
    4.8.1, sm_100a, nvfp4 fp16 D=128)."""
    return u32_as_f32(f32_bits(x) & Uint32((1 << packing.F32_SIGN_BIT) - 1))


def pow2(e) -> Float32:
    """2^e in fp32, built from its exponent bits (``e``, traced or not, in the normal range)."""
    return u32_as_f32(Uint32(e + packing.F32_EXP_BIAS) << packing.F32_MANTISSA_BITS)


def _minmax_x2(op: str, a, b, is_bf16: bool, loc, ip) -> Uint32:
    kind = "bf16x2" if is_bf16 else "f16x2"
    res = _asm(T.i32(), [_u32(a, loc, ip), _u32(b, loc, ip)], f"{op}.NaN.{kind} $0, $1, $2;", "=r,r,r",
               loc=loc, ip=ip)
    return Uint32(res)


@dsl_user_op
def min_x2(a, b, is_bf16: bool, *, loc=None, ip=None) -> Uint32:
    """Lane-wise minimum of two 16-bit pairs, NaN-propagating (exact: no rounding)."""
    return _minmax_x2("min", a, b, is_bf16, loc, ip)


@dsl_user_op
def max_x2(a, b, is_bf16: bool, *, loc=None, ip=None) -> Uint32:
    return _minmax_x2("max", a, b, is_bf16, loc, ip)


@dsl_user_op
def prefetch_l2(addr, *, loc=None, ip=None) -> None:
    """Ask L2 to fetch the line holding global address ``addr`` (no register, no wait)."""
    llvm.inline_asm(None, [Int64(addr).ir_value(loc=loc, ip=ip)], "prefetch.global.L2 [$0];", "l",
                    has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def load_here(addr, *, loc=None, ip=None) -> Int32:
    """The 32-bit word at global address ``addr``, loaded where the kernel's code says (an
    op with side effects: LLVM neither sinks it into the branch that uses it nor moves
    loads across it), so it is in flight beside the loads that follow.  ptxas may still
    sink it into the one block that uses it; loaded inside a branch of its own it stays
    (``DecodeSm90``'s first block-table entry)."""
    return Int32(_asm(T.i32(), [Int64(addr).ir_value(loc=loc, ip=ip)], "ld.global.b32 $0, [$1];", "=r,l",
                      side_effects=True, loc=loc, ip=ip))

