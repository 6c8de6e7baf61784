"""Warp reductions over MMA accumulator fragments, and the log-base constants of the
softmax, shared by the decode and combine kernels of every arch."""

from __future__ import annotations

import math

import cutlass.cute as cute

LOG2_E = math.log2(math.e)  # the softmax runs in base 2: exp(x) = exp2(x log2 e)
LN_2 = math.log(2.0)  # the LSE the kernels return is natural: log(s) = log2(s) ln 2

COLUMN_LANE_STRIDE = 4  # lanes l and l + 4k hold the same columns (quad lane l % 4) of a fragment


def across_rows(x, combine):
    """``combine`` of ``x`` over the 8 lanes holding one column of an m16n8 (or wgmma) C
    fragment, i.e. over its rows: butterfly shuffles by 4, 8 and 16 lanes."""
    for step in range(3):
        x = combine(x, cute.arch.shuffle_sync_bfly(x, COLUMN_LANE_STRIDE << step))
    return x
