"""Reductions shared by the kernels of every arch: over the rows of MMA accumulator
fragments (decode), and over a whole CTA (the split combine, the activation quantizer)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

COLUMN_LANE_STRIDE = 4  # lanes l and l + 4k hold the same columns (quad lane l % 4) of a fragment


def across_rows(x, combine):
    """``combine`` of ``x`` over the 8 lanes holding one column of an m16n8 (or wgmma) C
    fragment, i.e. over its rows: butterfly shuffles by 4, 8 and 16 lanes."""
    for step in range(3):
        x = combine(x, cute.arch.shuffle_sync_bfly(x, COLUMN_LANE_STRIDE << step))
    return x


@cute.jit
def block_reduce(x: Float32, s_red, tid, warps: cutlass.Constexpr[int], is_max: cutlass.Constexpr[bool]) -> Float32:
    """Max (``is_max``) or sum of ``x`` over a CTA of ``warps`` warps: butterfly shuffles in
    each warp, then the warps' results through ``s_red`` (``warps`` fp32 in shared memory,
    free again on return)."""
    for off in cutlass.range_constexpr(5):
        y = cute.arch.shuffle_sync_bfly(x, 1 << off)
        if const_expr(is_max):
            x = cute.arch.fmax(x, y)
        else:
            x = x + y
    if tid % 32 == 0:
        s_red[tid // 32] = x
    cute.arch.sync_threads()
    r = s_red[0]
    for w in cutlass.range_constexpr(1, warps):
        if const_expr(is_max):
            r = cute.arch.fmax(r, s_red[w])
        else:
            r = r + s_red[w]
    cute.arch.sync_threads()
    return r
