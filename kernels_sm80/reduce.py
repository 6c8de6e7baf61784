"""Reductions shared by the kernels of every arch: over the rows of MMA accumulator
fragments (decode), and over a whole CTA (the split combine, the activation quantizer)."""

from __future__ import annotations

import operator

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


def across_lanes(x, lanes: int, combine):
    """``combine`` of ``x`` over each group of ``lanes`` adjacent lanes (a power of two up to
    the warp): butterfly shuffles by 1, 2, .. lanes / 2; every lane of a group gets the result."""
    for step in range(lanes.bit_length() - 1):
        x = combine(x, cute.arch.shuffle_sync_bfly(x, 1 << step))
    return x


@cute.jit
def block_reduce(x: Float32, s_red, tid, warps: cutlass.Constexpr[int], is_max: cutlass.Constexpr[bool],
                 sync=cute.arch.sync_threads) -> Float32:
    """Max (``is_max``) or sum of ``x`` over ``warps`` warps (``tid`` counted from the first
    one's): butterfly shuffles in each warp, then the warps' results through ``s_red``
    (``warps`` fp32 in shared memory, free again on return); ``sync``: their barrier (the
    CTA's, or a named one where only these warps take part)."""
    if const_expr(is_max):
        x = across_lanes(x, cute.arch.WARP_SIZE, cute.arch.fmax)
    else:
        x = across_lanes(x, cute.arch.WARP_SIZE, operator.add)
    if tid % 32 == 0:
        s_red[tid // 32] = x
    sync()
    r = s_red[0]
    for w in cutlass.range_constexpr(1, warps):
        if const_expr(is_max):
            r = cute.arch.fmax(r, s_red[w])
        else:
            r = r + s_red[w]
    sync()
    return r
