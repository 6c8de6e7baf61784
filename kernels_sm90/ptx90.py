"""Hopper-only PTX the kernels need and CuTe DSL 4.8.1 exposes only through tensor copies."""

from __future__ import annotations

from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from ..kernels_sm80.ptx import _asm


@dsl_user_op
def bulk_g2s(dst, src, num_bytes, mbar, *, loc=None, ip=None) -> None:
    """``cp.async.bulk`` of ``num_bytes`` contiguous bytes (a multiple of 16, both ends
    16-byte aligned) from global ``src`` to shared ``dst``, completing on the transaction
    count of ``mbar``.  One thread issues it."""
    llvm.inline_asm(
        None,
        [dst.to_llvm_ptr(loc=loc, ip=ip), src.to_llvm_ptr(loc=loc, ip=ip),
         Int32(num_bytes).ir_value(loc=loc, ip=ip), mbar.to_llvm_ptr(loc=loc, ip=ip)],
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];",
        "r,l,r,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def barrier_or(barrier_id, num_threads: int, pred, *, loc=None, ip=None) -> Int32:
    """Named barrier ``barrier_id`` (an immediate, or a warp-uniform run-time value) over
    ``num_threads`` threads that also ORs a predicate across them (``bar.red.or.pred``): 1
    in every thread when any thread's ``pred`` held, else 0.  Warp-uniform control flow
    only (an aligned barrier)."""
    operands = [Int32(pred).ir_value(loc=loc, ip=ip)]
    constraints = "=r,r"
    if isinstance(barrier_id, int):
        name = str(barrier_id)
    else:
        operands.append(Int32(barrier_id).ir_value(loc=loc, ip=ip))
        constraints += ",r"
        name = "$2"
    return Int32(llvm.inline_asm(
        Int32.mlir_type,
        operands,
        "{\n.reg .pred p, q;\nsetp.ne.u32 p, $1, 0;\n"
        f"bar.red.or.pred q, {name}, {num_threads}, p;\n"
        "selp.u32 $0, 1, 0, q;\n}",
        constraints + ",~{memory}",  # a barrier: shared-memory accesses stay on their side of it
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def stmatrix_x4_trans(addr, r0, r1, r2, r3, *, loc=None, ip=None) -> None:
    """``stmatrix .x4 .trans`` of four 8x8 16-bit matrices (the mma C-fragment order of each
    in ``r0..r3``): lane ``8 m + k`` gives the shared address of row ``k`` of matrix ``m`` as
    stored, which holds column ``k`` of the fragment's matrix (8 contiguous values)."""
    _asm(None, [Int32(v).ir_value(loc=loc, ip=ip) for v in (addr, r0, r1, r2, r3)],
         "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [$0], {$1, $2, $3, $4};", "r,r,r,r,r",
         side_effects=True, loc=loc, ip=ip)
