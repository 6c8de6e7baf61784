"""Hopper-only PTX the kernels need and CuTe DSL 4.8.1 exposes only through tensor copies."""

from __future__ import annotations

from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op


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
