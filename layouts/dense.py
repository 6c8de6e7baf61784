"""The 16-bit row kernels of a decode step (``kernels_sm80.dense``: GEMV, SwiGLU;
``kernels_sm80.rope``): how they cut rows into 16-byte loads, and what that requires of
the tensors the API hands them (``bitdecode.dense``, ``bitdecode.rope``)."""

from __future__ import annotations

import functools
from typing import Tuple

from . import resources, sm80

VEC_BYTES = 16  # one vector load
ELEM_BYTES = 2  # fp16 / bf16
VEC = VEC_BYTES // ELEM_BYTES  # 16-bit values per load: channel counts and row strides are multiples
GEMV_ROW_STEP = VEC * resources.WARP  # values of a weight row one warp-wide load covers: K is a multiple
GEMV_MAX_TOKENS = 3  # rows of x the GEMV takes (more go to cuBLAS; kernels_sm80.dense says why)

# The GEMM for a few more tokens (``kernels_sm80.dense.GemmSmallMSm80``): mma.sync m16n8k16
# with the weights as A (16 rows a CTA) and the tokens as B (8 a tile, one or two tiles).
SMALL_M_MAX_TOKENS = 16  # tokens it takes (GEMV_MAX_TOKENS + 1 up to this)
SMALL_M_ROWS = sm80.MMA_SHAPE[0]  # weight rows a CTA owns
SMALL_M_TOKEN_TILE = sm80.MMA_SHAPE[1]  # tokens an MMA takes
SMALL_M_CHUNK = 4 * VEC  # k values a quad of lanes loads per step (4 x 16 bytes): two MMAs
SMALL_M_WARPS = 8  # warps of a CTA (its default build), each a slice of K
SMALL_M_K_STEP = SMALL_M_CHUNK * SMALL_M_WARPS  # K is a multiple: every warp streams whole chunks


@functools.lru_cache(maxsize=None)
def small_m_slots() -> Tuple[Tuple[Tuple[int, int], ...], Tuple[int, ...], Tuple[Tuple[int, int], ...]]:
    """Where the small-M GEMM's MMA registers come from, read off the m16n8k16 atom
    (``sm80.fragment``).

    Lane (g, c) = (lane // 4, lane % 4) loads 16 bytes (8 k values: 4 words) of weight rows
    g and g + 8 and of token g's x, at k offset 8c of a ``SMALL_M_CHUNK``-wide chunk.  MMA
    q (0, 1) of the chunk takes words 2q + ch (ch = 0, 1) of each, so the atom's k columns
    2c + 8ch and + 1 are the chunk's k 8c + 4q + 2ch and + 1, for A and B alike (a
    permutation of the chunk's k: the sums are the GEMM's).  Returns ``(a, b, c)``:
    ``a[r] = (row half, ch)`` of A's 32-bit register r, ``b[r] = ch`` of B's register r,
    ``c[v] = (row half, token offset)`` of accumulator value v (row g + 8 half, token
    2c + offset of the tile)."""
    fa, fb, fc = sm80.fragment("a"), sm80.fragment("b"), sm80.fragment("c")

    def regs(table, lane):
        vals = table[lane]
        out = []
        for r in range(len(vals) // 2):
            (row, col), (row1, col1) = vals[2 * r], vals[2 * r + 1]
            assert row1 == row and col1 == col + 1, "a register holds two consecutive k"
            out.append((row, col))
        return out

    a = b = c = None
    for lane in range(resources.WARP):
        g, q = divmod(lane, 4)
        la = tuple(((row - g) // 8, (col - 2 * q) // 8) for row, col in regs(fa, lane))
        lb = tuple((col - 2 * q) // 8 for row, col in regs(fb, lane))
        assert all(row == g for row, _ in regs(fb, lane)), "B register rows are the lane's token"
        lc = tuple(((row - g) // 8, col - 2 * q) for row, col in fc[lane])
        for row, col in regs(fa, lane):
            assert (row - g) % 8 == 0 and (col - 2 * q) % 8 == 0
        if a is None:
            a, b, c = la, lb, lc
        assert (la, lb, lc) == (a, b, c), "the slots depend on the register, not the lane"
    assert sorted(a) == [(h, ch) for h in (0, 1) for ch in (0, 1)] and sorted(b) == [0, 1]
    assert sorted(c) == [(h, t) for h in (0, 1) for t in (0, 1)]
    return a, b, c


__all__ = ["VEC_BYTES", "ELEM_BYTES", "VEC", "GEMV_ROW_STEP", "GEMV_MAX_TOKENS", "SMALL_M_MAX_TOKENS",
           "SMALL_M_ROWS", "SMALL_M_TOKEN_TILE", "SMALL_M_CHUNK", "SMALL_M_WARPS", "SMALL_M_K_STEP", "small_m_slots"]
