"""PTX helpers of the BitNet kernels: loads with cache hints, dp4a, lop3, int8 mma.sync,
and the exactly-rounded fp32 epilogue (one instruction each, via ``llvm.inline_asm``).

CuTe DSL 4.8.1 has no integer warp-level MMA atom and no dp4a op, so those go through
inline PTX.  Pure instructions are declared free of side effects so LLVM may schedule
and CSE them.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from ..layouts import bitnet as fmt
from ..layouts import packing
from ..layouts import resources
from .ptx import _asm, div_rn, fma_rn, mul_rn

WARP = resources.WARP

# --------------------------------------------------------------------------------------


@dsl_user_op
def load_v4(addr: Int64, stream: bool, ordered: bool = False, l2_only: bool = False, *, loc=None, ip=None):
    """16-byte global load of read-only data as four 32-bit words.

    ``stream``: the data is read exactly once (the weights), so it bypasses L1
    (``ld.global.nc.L1::no_allocate``); otherwise many warps share it (the activations)
    and it goes through L1.  Unpredicated on purpose: ptxas schedules plain loads early,
    while a predicated, zero-filled asm block ended up pinned next to its first use.
    ``ordered``: data the previous kernel may still be writing, read after an earlier
    ``griddepcontrol.wait``: declared with side effects, so LLVM keeps it after the wait,
    and a coherent ``ld.global`` (not ``.nc``: ptxas may hoist a read-only load above the
    wait; on the H200 a GEMV behind a programmatic launch read stale activations so).
    ``l2_only``: data another SM wrote earlier in this kernel (behind a fence), read past
    this SM's L1, which may hold the same addresses from an earlier launch (``ld.global.cg``,
    kept in place like ``ordered``).
    """
    if l2_only:
        op = "ld.global.cg"
    else:
        op = ("ld.global" if ordered else "ld.global.nc") + (".L1::no_allocate" if stream else "")
    return _load_words4(f"{op}.v4.u32", Int64(addr).ir_value(loc=loc, ip=ip), "l", ordered or l2_only, loc, ip)


def _load_words4(op: str, addr, addr_constraint: str, side_effects: bool, loc, ip):
    """One 16-byte vector load ``op`` from ``addr`` as four 32-bit words."""
    res = llvm.inline_asm(
        ir.Type.parse("!llvm.struct<(i32, i32, i32, i32)>"),
        [addr],
        f"{op} {{$0, $1, $2, $3}}, [$4];",
        f"=r,=r,=r,=r,{addr_constraint}",
        has_side_effects=side_effects,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )
    i32 = T.i32()
    return tuple(Int32(llvm.extractvalue(i32, res, [i], loc=loc, ip=ip)) for i in range(4))


@dsl_user_op
def store_v4(addr: Int64, a, b, c, d, *, loc=None, ip=None) -> None:
    """16-byte global store of four 32-bit words (``addr`` 16-byte aligned)."""
    _asm(None, [Int64(addr).ir_value(loc=loc, ip=ip)] + [Int32(v).ir_value(loc=loc, ip=ip) for v in (a, b, c, d)],
         "st.global.v4.b32 [$0], {$1, $2, $3, $4};", "l,r,r,r,r", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def load_b32(addr: Int64, stream: bool, *, loc=None, ip=None) -> Int32:
    """4-byte global load of read-only data (``stream``: read once, bypass L1)."""
    hint = ".L1::no_allocate" if stream else ""
    return Int32(
        _asm(T.i32(), [Int64(addr).ir_value(loc=loc, ip=ip)], f"ld.global.nc{hint}.b32 $0, [$1];", "=r,l", loc=loc, ip=ip)
    )


@dsl_user_op
def shr_and(a: Int32, shift: int, mask: int, *, loc=None, ip=None) -> Int32:
    """``(a >> shift) & mask`` (logical shift, then one lop3): one decode step."""
    src = Int32(a).ir_value(loc=loc, ip=ip)
    if shift == 0:
        text = f"lop3.b32 $0, $1, {mask & 0xFFFFFFFF}, 0, {fmt.LOP3_AND};"
    else:
        text = f"{{\n.reg .b32 t;\nshr.b32 t, $1, {shift};\nlop3.b32 $0, t, {mask & 0xFFFFFFFF}, 0, {fmt.LOP3_AND};\n}}"
    return Int32(_asm(T.i32(), [src], text, "=r,r", loc=loc, ip=ip))


@dsl_user_op
def mma_m16n8k32_u8s8(a, b, c, *, loc=None, ip=None):
    """``mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32``: D = A (u8 codes) x B (s8) + C.

    ``a``: 4 registers, ``b``: 2, ``c``: 4 (int32 accumulators); returns the 4 of D.
    """
    operands = [Int32(v).ir_value(loc=loc, ip=ip) for v in (*a, *b, *c)]
    struct_ty = ir.Type.parse("!llvm.struct<(i32, i32, i32, i32)>")
    res = llvm.inline_asm(
        struct_ty,
        operands,
        "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 "
        "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
        "=r,=r,=r,=r," + ",".join(["r"] * 10),
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )
    i32 = T.i32()
    return tuple(Int32(llvm.extractvalue(i32, res, [i], loc=loc, ip=ip)) for i in range(4))


def _dp4a(kind: str, a, b, c, loc, ip) -> Int32:
    operands = [Int32(v).ir_value(loc=loc, ip=ip) for v in (a, b, c)]
    return Int32(_asm(T.i32(), operands, f"dp4a.{kind}.s32 $0, $1, $2, $3;", "=r,r,r,r", loc=loc, ip=ip))


@dsl_user_op
def dp4a_us(a: Int32, b: Int32, c: Int32, *, loc=None, ip=None) -> Int32:
    """``c + sum(a.u8[i] * b.s8[i])``: unsigned weight bytes times signed activations."""
    return _dp4a("u32", a, b, c, loc, ip)


@dsl_user_op
def dp4a_ss(a: Int32, b: Int32, c: Int32, *, loc=None, ip=None) -> Int32:
    """``c + sum(a.s8[i] * b.s8[i])``."""
    return _dp4a("s32", a, b, c, loc, ip)


@dsl_user_op
def lop3_and(a: Int32, mask: int, *, loc=None, ip=None) -> Int32:
    """``a & mask`` as one ``lop3.b32`` with an immediate mask (the decode step)."""
    return Int32(
        _asm(
            T.i32(),
            [Int32(a).ir_value(loc=loc, ip=ip)],
            f"lop3.b32 $0, $1, {mask & 0xFFFFFFFF}, 0, {fmt.LOP3_AND};",
            "=r,r",
            loc=loc,
            ip=ip,
        )
    )


def _address(addr, space: str, loc, ip):
    """(operand, constraint) of a global (64-bit) or shared (32-bit) address."""
    if space == "global":
        return Int64(addr).ir_value(loc=loc, ip=ip), "l"
    assert space == "shared", space
    return Int32(addr).ir_value(loc=loc, ip=ip), "r"


@dsl_user_op
def store_bf16(addr, value: Float32, space: str = "global", *, loc=None, ip=None) -> None:
    """Round ``value`` to bf16 (nearest even) and store it at ``addr`` (in ``space``)."""
    a, c = _address(addr, space, loc, ip)
    _asm(None, [a, Float32(value).ir_value(loc=loc, ip=ip)],
         f"{{\n.reg .b16 h;\ncvt.rn.bf16.f32 h, $1;\nst.{space}.b16 [$0], h;\n}}", f"{c},f",
         side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def store_i32(addr, value: Int32, space: str = "global", *, loc=None, ip=None) -> None:
    a, c = _address(addr, space, loc, ip)
    _asm(None, [a, Int32(value).ir_value(loc=loc, ip=ip)], f"st.{space}.b32 [$0], $1;", f"{c},r",
         side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def cp_async_16(smem_addr: Int32, gmem_addr: Int64, src_bytes: Int32, *, loc=None, ip=None) -> None:
    """16-byte ``cp.async.cg`` (L2 only); bytes past ``src_bytes`` are zero-filled."""
    _asm(None, [Int32(smem_addr).ir_value(loc=loc, ip=ip), Int64(gmem_addr).ir_value(loc=loc, ip=ip),
                Int32(src_bytes).ir_value(loc=loc, ip=ip)],
         "cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def decode_s8(a: Int32, shift: Int32, *, loc=None, ip=None) -> Int32:
    """Decode step ``shift`` of a packed word as four signed bytes ``c - 2`` (-1, 0, 1):
    shift, mask and bias (lop3), subtract the code offset, unbias
    (``layouts.bitnet.decode_signed_bytes`` is the same on the host)."""
    return Int32(
        _asm(
            T.i32(),
            [Int32(a).ir_value(loc=loc, ip=ip), Int32(shift).ir_value(loc=loc, ip=ip)],
            "{\n.reg .b32 t;\nshr.b32 t, $1, $2;\n"
            f"lop3.b32 t, t, {fmt.DECODE_MASK}, {fmt.BYTE_BIAS}, {packing.LOP3_AND_OR};\n"
            f"sub.u32 t, t, {fmt.CODE_OFFSET_BYTES};\nxor.b32 $0, t, {fmt.BYTE_BIAS};\n}}",
            "=r,r,r",
            loc=loc,
            ip=ip,
        )
    )


@dsl_user_op
def copy16_s2g(smem_addr: Int32, gmem_addr: Int64, *, loc=None, ip=None) -> None:
    """16 bytes from shared to global memory (one vector load, one vector store)."""
    _asm(None, [Int32(smem_addr).ir_value(loc=loc, ip=ip), Int64(gmem_addr).ir_value(loc=loc, ip=ip)],
         "{\n.reg .b32 a, b, c, d;\nld.shared.v4.b32 {a, b, c, d}, [$0];\n"
         "st.global.v4.b32 [$1], {a, b, c, d};\n}", "r,l", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def lds_v4(smem_addr: Int32, *, loc=None, ip=None):
    """16-byte shared load as four 32-bit words (kept in order with barriers: side effects)."""
    return _load_words4("ld.shared.v4.b32", Int32(smem_addr).ir_value(loc=loc, ip=ip), "r", True, loc, ip)


@dsl_user_op
def lds_b32(smem_addr: Int32, *, loc=None, ip=None) -> Int32:
    return Int32(_asm(T.i32(), [Int32(smem_addr).ir_value(loc=loc, ip=ip)], "ld.shared.b32 $0, [$1];",
                      "=r,r", side_effects=True, loc=loc, ip=ip))


@cute.jit
def store_out(out_base: Int64, index: Int64, acc: Int32, x_scale: Float32, w_scale: Float32, raw: cutlass.Constexpr):
    """Element ``index`` of the output: the int32 sum itself (``raw``), else bf16 of
    ``(acc / x_scale) * w_scale``."""
    if cutlass.const_expr(raw):
        store_i32(out_base + index * 4, acc)
    else:
        store_bf16(out_base + index * 2, scale_out(acc, x_scale, w_scale))


@cute.jit
def segment_of(row: Int32, e1: Int32, e2: Int32, e3: Int32) -> Int32:
    """The fused segment (q/k/v, w1/w3) that ``row`` belongs to; ``e1..e3`` are the
    cumulative row ends of segments 0..2 (``N`` where unused)."""
    seg = Int32(0)
    if row >= e1:
        seg = seg + 1
    if row >= e2:
        seg = seg + 1
    if row >= e3:
        seg = seg + 1
    return seg


@cute.jit
def segment_scale(mWScale: cute.Tensor, row: Int32, e1: Int32, e2: Int32, e3: Int32) -> Float32:
    """Scale of the fused segment that ``row`` belongs to (``segment_of``)."""
    return Float32(mWScale[segment_of(row, e1, e2, e3)])


@cute.jit
def scale_out(acc: Int32, x_scale: Float32, w_scale: Float32) -> Float32:
    """``(acc / x_scale) * w_scale`` in fp32, each op rounded once like the torch reference."""
    return mul_rn(div_rn(Float32(acc), x_scale), w_scale)


@cute.jit
def scale_out_rcp(acc: Int32, x_scale: Float32, x_rcp: Float32, w_scale: Float32) -> Float32:
    """``scale_out`` with the token's correctly rounded reciprocal ``x_rcp`` (``rcp.rn``)
    given: the quotient ``q0 = a r`` is corrected once with the exact residual ``a - q0 b``
    (an fma), which is the correctly rounded ``a / b`` whenever ``r`` is the correctly
    rounded ``1 / b`` and nothing under- or overflows (Markstein's theorem; the tests check
    it against exact rational arithmetic).  Three fp32 ops a value instead of ``div.rn``'s
    sequence with its range check and slow-path branch."""
    a = Float32(acc)
    q0 = mul_rn(a, x_rcp)
    q = fma_rn(fma_rn(-q0, x_scale, a), x_rcp, q0)
    return mul_rn(q, w_scale)


def matmul_fake_args(raw: bool, tokens=None, launch_arg: bool = True) -> tuple:
    """Symbolic-size arguments of the BitNet kernels for ``cute.compile``: every M (or
    ``tokens`` rows) and every (N, K) with N % 16 == 0, K % 128 == 0; 16-byte aligned
    x and w; any number of segment scales; then the segment ends ``e1..e3``, the
    launch-size argument (warps / split-K warps / CTAs) if ``launch_arg``, the stream."""
    m = cute.sym_int() if tokens is None else tokens
    n = cute.sym_int(divisibility=fmt.N_MULTIPLE)
    k = cute.sym_int(divisibility=fmt.K_MULTIPLE)
    kb = cute.sym_int(divisibility=fmt.K_MULTIPLE // fmt.CODES_PER_BYTE)
    segs = cute.sym_int()
    fake = cute.runtime.make_fake_compact_tensor
    x = fake(cutlass.Int8, (m, k), stride_order=(1, 0), assumed_align=16)
    w = fake(cutlass.Int8, (n, kb), stride_order=(1, 0), assumed_align=16)
    x_scale = fake(Float32, (m,), assumed_align=4)
    w_scale = fake(Float32, (segs,), assumed_align=4)
    out = fake(Int32 if raw else cutlass.BFloat16, (m, n), stride_order=(1, 0), assumed_align=4)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    size = (Int32(1),) if launch_arg else ()
    return (x, w, x_scale, w_scale, out, Int32(0), Int32(0), Int32(0), *size, stream)
