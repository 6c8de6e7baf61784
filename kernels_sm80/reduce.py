"""Warp reductions over MMA accumulator fragments, shared by the decode kernels of every arch."""

from __future__ import annotations

import cutlass.cute as cute

COLUMN_LANE_STRIDE = 4  # lanes l and l + 4k hold the same columns (quad lane l % 4) of a fragment


def across_rows(x, combine):
    """``combine`` of ``x`` over the 8 lanes holding one column of an m16n8 (or wgmma) C
    fragment, i.e. over its rows: butterfly shuffles by 4, 8 and 16 lanes."""
    for step in range(3):
        x = combine(x, cute.arch.shuffle_sync_bfly(x, COLUMN_LANE_STRIDE << step))
    return x
