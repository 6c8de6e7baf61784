"""The sm90 (Hopper) instruction configuration and the layouts it induces.

Configuration (BitDecoding's Hopper design).  A producer warp brings packed K/V words and
their params into shared memory with TMA.  A consumer warpgroup (4 warps, 128 threads)
turns them into 16-bit operands and runs ``wgmma``:

1. ``ldmatrix`` x4 of the packed tile, exactly as on sm80 (the packed format is the same
   bytes on every arch): lane ``l = 4*g + c`` receives word ``c`` of chunk ``j`` of rows
   ``g + 8*i`` (i = 0..3) of a 32-row block.
2. the lop3 dequant of ``packing`` turns each word into ``F/2`` 16-bit pairs.  Pair
   ``p = 2*kb + ch`` of the word of row ``r`` holds columns
   ``16*(kpw*j + kb) + 2*c + 8*ch + (0, 1)`` (``kpw = F/4`` k-blocks per word), so the
   lane now holds, for m-tile ``mt`` (rows ``16*mt + ...``) and k-tile ``kt``, the
   register pair ``(h, ch)`` of the m16n8k16 **A** fragment: rows ``16*mt + g + 8*h``,
   columns ``16*kt + 2*c + 8*ch + (0, 1)``, from matrix ``i = 2*mt + h`` and pair
   ``2*(kt % kpw) + ch``.
3. ``stmatrix`` x4 (``StMatrix8x8x16bOp``) stores one 16x16 block per instruction:
   its four 8x8 matrices take the register pairs in A-fragment order
   ``(h, ch) = (0,0), (1,0), (0,1), (1,1)``, lane ``l`` addressing row ``l % 8`` of matrix
   ``l // 8``, i.e. block row ``8*((l//8) % 2) + l % 8`` at block column ``8*(l // 16)``.
   This is ``make_tiled_copy_A(stmatrix, m16n8k16)``: the copy whose source TV layout is
   the MMA's A layout (``stsm_fragment`` reads it off and checks it).
4. The destination is a K-major shared-memory tile in the wgmma canonical layout:
   ``warpgroup.make_smem_layout_atom`` of the widest swizzle the row allows (128-byte
   swizzle for every 16-bit tile the kernels use: rows of ``2*D >= 128`` bytes and of
   ``2*Nr`` bytes), tiled rows-first.  That swizzle acts on byte addresses (it is the
   pointer's swizzle, the one TMA and the wgmma descriptor use), which is why the tables
   below evaluate the atom's outer layout recast to bytes before applying it.

The two products (query transformation: the ``gq`` query heads sharing a KV head are the
M rows, padded to ``WGMMA_M = 64``; unused rows are zero and their outputs dropped):

* ``S = Q . K^T``: ``wgmma 64 x Nr x 16``, A = Q (``query_tile_rows x D``, K-major, smem),
  B = the dequantized K tile (``Nr`` tokens x ``D``, K-major: the packed K rows are tokens).
* ``O = P . V``: ``wgmma 64 x D x 16``, A = P (registers: the S accumulator converted to
  16 bits is already an A fragment, see ``wgmma_fragment``), B = the dequantized V tile
  seen as ``D`` channels x ``Nr`` tokens, K-major: the packed V rows are channels.

Warp ``w`` of the consumer warpgroup dequantizes the tokens of chunk ``w`` (tokens
``[w*T, (w+1)*T)``, ``T = Nr/4``) of both K and V, as on sm80 (``warp_loads``).

The alternative with A from registers (``wgmma`` RS, K or V^T as A with 64 tokens or
channels per instruction, the query heads as N padded to 8) needs no stmatrix: the RS A
fragment of warp ``w`` is the m16n8k16 A fragment of rows ``16*w .. 16*w + 15``
(``wgmma_fragment("a")`` checks it), so the dequantized registers feed it unchanged.

Shared-memory tiles of packed words, written by TMA and read by ldmatrix, use the same
swizzle atoms (``K_INTER`` / ``K_SW32`` / ``K_SW64`` / ``K_SW128`` by row width); their
physical placement equals sm80's ``smem_offsets``.  With wide boxes (``packed_fold``) rows
narrower than 128 bytes are folded into 128-byte box rows under the 128-byte swizzle
instead.
"""

from __future__ import annotations

import functools
from typing import Tuple

from . import packing, resources, sm80
from ._trace import traced_for

ARCH = "sm90"
TRACE_ARCH = "sm_90a"
WGMMA_M = 64  # rows of one wgmma (and of the padded query tile)
WGMMA_K = 16  # contraction of one 16-bit wgmma
WARPGROUP_WARPS = 4
WARP_THREADS = resources.WARP
WARPGROUP_THREADS = WARPGROUP_WARPS * WARP_THREADS
WARP_SLAB_ROWS = WGMMA_M // WARPGROUP_WARPS  # rows of a wgmma that one warp's registers hold
assert WARP_SLAB_ROWS == sm80.MMA_SHAPE[0]  # ... the m16 of the warp-level mma fragments
STSM_BLOCK = 16  # one stmatrix x4 stores a 16 x 16 block (four 8 x 8 matrices)
ELEM_BYTES = 2
# The sm90 decode's packed K / V tiles arrive in wide TMA boxes (``packed_fold``: rows folded
# into 128-byte box rows) unless a kernel is built with ``wide_boxes=False``: one definition
# for the kernel's default and for what ``bitdecode layout`` draws (profiles/NOTES.md,
# sixty-seventh session: the same consumer loop as narrow boxes, fewer L2 requests)
WIDE_BOXES = True
CHUNK_BYTES = sm80.CHUNK_BYTES
LDSM_BLOCK_ROWS = 4 * sm80.LDSM_ROWS  # rows of one packed ldmatrix x4 (four 8-row blocks)
OPERANDS = ("k", "v")


_traced = traced_for(TRACE_ARCH)


# --------------------------------------------------------------------------------------
# Derived sizes
# --------------------------------------------------------------------------------------


def query_tile_rows(group: int) -> int:
    """M rows of the query tile for ``group`` query heads per KV head: a multiple of 64."""
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise ValueError(f"group must be a positive int, got {group!r}")
    return -(-group // WGMMA_M) * WGMMA_M


def block_tokens(bits: int) -> int:
    """Tokens of one K/V tile: one residual block (the N of S = Q.K^T, the K of P.V)."""
    return sm80.residual_block(bits)


def tile_shape(bits: int, operand: str, head_dim: int) -> Tuple[int, int]:
    """(rows, cols) of the dequantized K-major operand tile: K (Nr, D), V as (D, Nr)."""
    if operand not in OPERANDS:
        raise ValueError(f"operand must be one of {OPERANDS}, got {operand!r}")
    nr = block_tokens(bits)
    return (nr, head_dim) if operand == "k" else (head_dim, nr)


def warp_loads(bits: int, operand: str, head_dim: int) -> Tuple[Tuple[Tuple[int, int], ...], ...]:
    """For each consumer warp, the packed ldmatrix x4 loads it issues: (first row, chunk).

    One load covers rows ``row .. row+31`` of the packed tile and 16-byte chunk ``chunk``
    of those rows.  K tile (rows = tokens): warp ``w`` takes its ``T`` tokens, every chunk
    of the head dim.  V tile (rows = channels): warp ``w`` takes chunk ``w``, every channel.
    """
    rows, length = tile_shape(bits, operand, head_dim)
    chunks = sm80.words_per_row(bits, length) // sm80.CHUNK_WORDS
    t = sm80.tokens_per_warp(bits)
    out = []
    for w in range(WARPGROUP_WARPS):
        if operand == "k":
            loads = tuple((r, j) for r in range(w * t, (w + 1) * t, LDSM_BLOCK_ROWS) for j in range(chunks))
        else:
            loads = tuple((r, w) for r in range(0, rows, LDSM_BLOCK_ROWS))
        out.append(loads)
    return tuple(out)


# --------------------------------------------------------------------------------------
# Kernel-side CuTe objects (call inside a @cute.jit trace for sm_90a)
# --------------------------------------------------------------------------------------


def make_wgmma(dtype, n: int, a_from_registers: bool = False):
    """One-warpgroup ``wgmma 64 x n x 16`` (fp32 accumulate), both operands K-major."""
    import cutlass
    import cutlass.utils.hopper_helpers as hopper
    from cutlass.cute.nvgpu import OperandMajorMode

    source = hopper.OperandSource.RMEM if a_from_registers else hopper.OperandSource.SMEM
    k = OperandMajorMode.K
    return hopper.make_trivial_tiled_mma(dtype, dtype, k, k, cutlass.Float32, (1, 1, 1), (WGMMA_M, n), source)


def smem_atom_kind(dtype, row_elems: int):
    """The widest K-major swizzle atom whose row fits ``row_elems`` (hopper_helpers' choice)."""
    import cutlass.utils.hopper_helpers as hopper
    from cutlass.tensor_utils import LayoutEnum

    return hopper.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, row_elems)


def make_operand_smem_layout(dtype, rows: int, cols: int, stages: int = 0):
    """K-major wgmma operand tile ``(rows, cols[, stages])``: swizzle atom tiled rows-first.

    Returns a composed layout whose swizzle belongs on the pointer (byte addresses):
    ``storage.get_tensor(layout.outer, swizzle=layout.inner)``.
    """
    import cutlass.cute as cute
    from cutlass.cute.nvgpu import warpgroup

    atom = warpgroup.make_smem_layout_atom(smem_atom_kind(dtype, cols), dtype)
    shape = (rows, cols, stages) if stages else (rows, cols)
    return cute.tile_to_shape(atom, shape, (0, 1, 2) if stages else (0, 1))


def make_q_smem_layout(dtype, group: int, head_dim: int):
    """A of S = Q.K^T: ``query_tile_rows(group) x head_dim``, K-major."""
    return make_operand_smem_layout(dtype, query_tile_rows(group), head_dim)


def make_kv_smem_layout(dtype, bits: int, operand: str, head_dim: int, stages: int = 0):
    """B tile the dequantized K (``Nr x D``) or V (``D x Nr``) is stored to with stmatrix."""
    rows, cols = tile_shape(bits, operand, head_dim)
    return make_operand_smem_layout(dtype, rows, cols, stages)


def packed_fold(rows: int, row_bytes: int, wide: bool = False) -> int:
    """Packed rows that one row of a wide TMA box holds: ``128 // row_bytes`` (1 for rows of
    128 bytes or more, a tile too short for the 128-byte swizzle's 8-row period, or narrow
    boxes: ``wide`` false).

    A tile's packed rows are contiguous in global memory (``formats``: K's page rows, V's
    channels of one V tile), so a box of ``rows // fold`` rows of 128 bytes brings the same
    bytes as one of ``rows`` narrower rows, in 128-byte pieces instead of 32- or 64-byte
    ones (the L2 requests a tile costs; profiles/NOTES.md, fifty-fifth session)."""
    fold = max(1, sm80.SWIZZLE_ROW_BYTES // row_bytes) if wide else 1
    return fold if rows % (sm80.SWIZZLE_ATOM_ROWS * fold) == 0 else 1


def packed_box(rows: int, row_bytes: int, wide: bool = False) -> Tuple[int, int]:
    """(rows, 16-bit values a row) of the TMA box that brings a packed tile of ``rows`` rows
    of ``row_bytes``: the tile itself, or with ``wide`` its rows folded by ``packed_fold``."""
    fold = packed_fold(rows, row_bytes, wide)
    return rows // fold, fold * row_bytes // ELEM_BYTES


def make_packed_tma_layout(rows: int, row_bytes: int, stages: int = 0, wide: bool = False):
    """The TMA's view of a packed-word tile (16-bit): ``packed_box`` in the widest swizzle
    atom its row fits (with ``wide``, 128-byte rows: the 128-byte swizzle)."""
    import cutlass

    sm80.swizzle_params(row_bytes)  # validates the row width
    return make_operand_smem_layout(cutlass.Float16, *packed_box(rows, row_bytes, wide), stages)


def make_packed_smem_layout(rows: int, row_bytes: int, stages: int = 0, wide: bool = False):
    """Packed-word tile ``(rows, row_bytes / 2[, stages])`` viewed as 16-bit, as ldmatrix
    reads it: ``make_packed_tma_layout``'s memory, row ``r`` of the tile being row
    ``r // fold`` of the wide box at column ``(r % fold) * row_bytes / 2``.

    The 128-byte swizzle keeps ldmatrix conflict-free on the folded rows: the eight rows of
    a phase sit in four (or two, one) wide rows whose XOR patterns differ in the bits
    above the fold's (``tests/test_layouts.py::test_sm90_wide_packed_tiles`` checks every
    phase)."""
    import cutlass.cute as cute

    tma = make_packed_tma_layout(rows, row_bytes, stages, wide)
    fold = packed_fold(rows, row_bytes, wide)
    if fold == 1:
        return tma
    cols, wide_rows = row_bytes // ELEM_BYTES, rows // fold
    # (row % fold, row // fold, col[, stage]) as a colexicographic index of the wide tile's
    # (rows // fold, fold * cols[, stages])
    shape, stride = ((fold, wide_rows), cols), ((wide_rows * cols, 1), wide_rows)
    if stages:
        shape, stride = shape + (stages,), stride + (wide_rows * fold * cols,)
    view = cute.composition(tma.outer, cute.make_layout(shape, stride=stride))
    return cute.make_composed_layout(tma.inner, 0, view)


def make_dequant_stsm_copy(dtype):
    """stmatrix x4 whose source is the m16n8k16 A fragment: stores one 16x16 block per call."""
    import cutlass.cute as cute
    from cutlass.cute.nvgpu import warp

    atom = cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), dtype)
    return cute.make_tiled_copy_A(atom, sm80.make_mma(dtype))


def fold_packed_rows(tensor, fold: int):
    """A packed global view ``(rows, values, ...)`` (16-bit values; rows contiguous, as every
    packed tile's are) seen as ``(rows // fold, fold * values, ...)``: the global side of
    ``make_packed_tma_layout(..., wide=True)``'s box."""
    import cutlass.cute as cute

    if fold == 1:
        return tensor
    shape, stride = tensor.shape, tensor.layout.stride
    values = shape[1]
    assert stride[1] == 1 and (not isinstance(stride[0], int) or stride[0] == values), "rows must be contiguous"
    layout = cute.make_layout((shape[0] // fold, fold * values) + tuple(shape[2:]),
                              stride=(fold * values, 1) + tuple(stride[2:]))
    return cute.make_tensor(tensor.iterator, layout)


make_packed_ldmatrix_copy = sm80.make_packed_ldmatrix_copy


# --------------------------------------------------------------------------------------
# Tables (evaluated in an sm_90a trace, cached)
# --------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def wgmma_fragment(operand: str, n: int = 64) -> Tuple[Tuple[Tuple[int, int], ...], ...]:
    """Register fragments of ``wgmma 64 x n x 16``: ``[thread][value] = (row, col)``.

    ``"a"``: A from registers (RS), 64 x 16; ``"c"``: the accumulator, 64 x n.  (B, and A
    in SS mode, are read from shared memory by descriptor: no per-thread layout.)
    Checks that warp ``w``'s A (and C) fragment is the m16n8k16 one shifted by 16*w rows.
    """
    if operand not in ("a", "c"):
        raise ValueError(f"operand must be 'a' or 'c' (B is read from shared memory), got {operand!r}")
    ref = sm80.fragment(operand)
    table = _wgmma_tv(operand, n)
    out = []
    for t, vals in enumerate(table):
        w, lane = divmod(t, WARP_THREADS)
        blocks = 1 if operand == "a" else n // sm80.MMA_SHAPE[1]
        expect = tuple(
            (WARP_SLAB_ROWS * w + r, sm80.MMA_SHAPE[1] * nb + c) for nb in range(blocks) for r, c in ref[lane]
        )
        assert vals == expect, f"wgmma {operand} fragment of thread {t} is not the m16n8k16 one"
        out.append(vals)
    return tuple(out)


def acc_row_value(i: int) -> int:
    """The first value of a wgmma accumulator fragment on the same row as value ``i``: each
    8-column block holds (row g: two columns, row g + 8: two columns), so a thread's values
    sit on two rows, those of values 0 and 2 (``wgmma_fragment("c")`` checks it)."""
    return 2 * ((i // 2) % 2)


def acc_col_value(i: int) -> int:
    """The first value of a wgmma accumulator fragment in the same column as value ``i``
    (its row-g twin: ``i`` less the row step)."""
    return i - acc_row_value(i)


# The decode's heads tile for GQA groups of at most 4 query heads (one query token): the
# 8-column wgmma, whose columns 4..7 are padding and belong to whole lanes of the C fragment
# (quad lanes 2 and 3).  The softmax then takes one value slot a column instead of two:
# quad lanes 0, 1 keep their row-g values, quad lanes 2, 3 take the row-g + 8 values of quad
# lane - 2 (``HALF_SOURCE_XOR``; ``DecodeSm90.gather_rows``), so every real (row, head) of
# the tile is one slot of one thread (``test_layouts`` checks it against ``wgmma_fragment``).
HALF_HEADS_TILE = 4
HALF_SOURCE_XOR = 2  # the lane a quad lane 2 / 3 takes its values from: lane ^ 2


def c_slot_v1(v1: int, c, half: bool):
    """The row half (0: row g, 1: row g + 8 of the warp's 16-row slab) of quad lane ``c``'s
    softmax slot ``v1``: ``v1``, or in the half view ``c // 2`` (one slot, ``v1 = 0``)."""
    return c // 2 if half else v1


def c_slot_head(nt: int, v0: int, c, half: bool):
    """The tile column (query head) of quad lane ``c``'s softmax column ``2 nt + v0``:
    ``8 nt + 2 c + v0``, or in the half view ``2 (c % 2) + v0`` (quad lanes c and c ^ 2
    share heads).  ``c`` may be a traced integer."""
    return c % 2 * 2 + v0 if half else 8 * nt + 2 * c + v0


# The accumulator through ``stmatrix .x4 .trans`` (the BitNet GEMM's epilogue: its wgmma C
# tile is weight rows x tokens, its output [token, row]).  Each 8 x 8 block of a warp's C
# slab is an m16n8 C fragment of 16-bit values (a 32-bit register: columns 2c, 2c + 1 of
# row g); ``.trans`` stores column k of matrix ``mat`` as the 8 contiguous values that lane
# ``8 mat + k`` addresses.  Matrices 0..3 of stmatrix ``p``: (rows 0-7, columns 16 p + 0-7),
# (rows 8-15, the same columns), then both again for columns 16 p + 8-15.
ACC_STSM_COLS = STSM_BLOCK  # accumulator columns (tokens) of one stmatrix x4


def acc_stsm_value(p: int, mat: int) -> int:
    """The first of the two accumulator values (fragment order) packed into register ``mat``
    of stmatrix ``p``; the other is the next value (the adjacent column)."""
    return 4 * (2 * p + mat // 2) + 2 * (mat % 2)


def acc_stsm_lane_target(lane: int) -> Tuple[int, int]:
    """(column, row) in the warp's 16-row slab of the first value of the 8 that lane
    ``lane``'s address receives from each stmatrix (add ``ACC_STSM_COLS * p`` to the
    column); the 8 are rows ``row .. row + 7`` of that column, contiguous."""
    mat = lane // 8  # (// and %, not divmod: ``lane`` may be a traced kernel value)
    return 8 * (mat // 2) + lane % 8, 8 * (mat % 2)


@functools.lru_cache(maxsize=None)
def acc_stsm_trans_placement(n: int) -> Tuple[Tuple[Tuple[int, int], ...], ...]:
    """Where the stores put each accumulator value: ``[thread][value] = (row, col)`` of the
    64 x ``n`` tile, from stmatrix's semantics (lane ``4 r + c`` holds elements (r, 2 c),
    (r, 2 c + 1) of each matrix) and the two functions above.  Equal to
    ``wgmma_fragment("c", n)`` when the epilogue stores every value where it belongs."""
    out = [[None] * (n // 2) for _ in range(WARPGROUP_THREADS)]
    for w in range(WARPGROUP_WARPS):
        for p in range(n // ACC_STSM_COLS):
            for mat in range(4):
                for k in range(8):  # stored row k of matrix mat: its address comes from lane 8 mat + k
                    col0, row0 = acc_stsm_lane_target(8 * mat + k)
                    col = ACC_STSM_COLS * p + col0
                    for r in range(8):  # element r of that stored row is fragment (r, k)
                        lane = 4 * r + k // 2
                        value = acc_stsm_value(p, mat) + k % 2
                        out[w * WARP_THREADS + lane][value] = (WARP_SLAB_ROWS * w + row0 + r, col)
    return tuple(tuple(v) for v in out)


# A K split's int32 partial tile in a slot (the BitNet GEMM's workspace split and its
# cluster split): thread t's j-th 16-byte word of accumulators (values 4 j .. 4 j + 3) at
# byte t * 16 + j * threads * 16, so a warp's store covers 512 contiguous bytes.
SUM_WORD_BYTES = 16


def sum_thread_offset(t):
    """Byte offset of thread ``t``'s first word in a partial-sum slot (host or traced)."""
    return t * SUM_WORD_BYTES


def sum_word_offset(j: int, threads: int) -> int:
    """Byte offset of word ``j`` from its thread's first word in a partial-sum slot."""
    return j * threads * SUM_WORD_BYTES


# A tile staged in shared memory for 16-byte row-contiguous global stores (the BitNet GEMM's
# [token, row] output): rows a multiple of 128 bytes long are padded by 16, so the 8 rows an
# 8 x 8 matrix of a stmatrix (or ldmatrix) addresses fall on 8 different 16-byte bank
# groups (row r at 16 r mod 128) instead of all on one.
STAGED_ROW_PAD_BYTES = 16


def staged_row_bytes(row_bytes: int) -> int:
    """The pitch of a staged row of ``row_bytes`` (a multiple of 128)."""
    assert row_bytes % 128 == 0, row_bytes
    return row_bytes + STAGED_ROW_PAD_BYTES


@_traced
def _wgmma_tv(operand: str, n: int) -> Tuple[Tuple[Tuple[int, int], ...], ...]:
    """The tiled MMA's TV layout, (thread, value) -> column-major offset in the (M, K|N) tile."""
    import cutlass
    import cutlass.cute as cute

    mma = make_wgmma(cutlass.Float16, n, a_from_registers=True)
    tv = mma.tv_layout_A_tiled if operand == "a" else mma.tv_layout_C_tiled
    values = cute.size(tv, mode=[1])
    out = []
    for t in range(WARPGROUP_THREADS):
        out.append(tuple(divmod(tv((t, v)), WGMMA_M)[::-1] for v in range(values)))
    return tuple(out)


@functools.lru_cache(maxsize=None)
def stsm_fragment() -> Tuple[Tuple[Tuple[int, int], ...], ...]:
    """For each lane, the (row, col) in a 16x16 block of its 8 values as stmatrix stores them.

    Equal to the m16n8k16 A fragment (``sm80.fragment("a")``): what the dequant produces.
    """
    table = _stsm_source()
    assert table == sm80.fragment("a"), "stmatrix source is not the A fragment"
    return table


@_traced
def _stsm_source() -> Tuple[Tuple[Tuple[int, int], ...], ...]:
    import cutlass
    import cutlass.cute as cute

    copy = make_dequant_stsm_copy(cutlass.Float16)
    ident = cute.make_identity_tensor((STSM_BLOCK, STSM_BLOCK))
    out = []
    for lane in range(WARP_THREADS):
        src = copy.get_slice(lane).partition_S(ident)
        out.append(tuple((src[i][0], src[i][1]) for i in range(cute.size(src))))
    return tuple(out)


@_traced
def stsm_row_addresses() -> Tuple[Tuple[int, int], ...]:
    """For each lane, the (row, first col) of the 8 contiguous 16-bit values it addresses."""
    import cutlass
    import cutlass.cute as cute

    copy = make_dequant_stsm_copy(cutlass.Float16)
    ident = cute.make_identity_tensor((STSM_BLOCK, STSM_BLOCK))
    out = []
    for lane in range(WARP_THREADS):
        dst = copy.get_slice(lane).partition_D(ident)
        coords = [dst[i] for i in range(cute.size(dst))]
        row, col = coords[0]
        assert coords == [(row, col + k) for k in range(8)], "a stmatrix row address covers 8 columns"
        out.append((row, col))
    return tuple(out)


def pointer_swizzled_offsets(composed, rows: int, cols: int, elem_bits: int) -> Tuple[Tuple[int, ...], ...]:
    """Physical element offset of each (row, col) of a layout whose swizzle is on the pointer.

    Call inside a trace.  ``composed`` is a swizzle atom tiled to ``(rows, cols)`` (wgmma /
    UMMA canonical layouts), ``elem_bits`` the element width (16, or 4 for e2m1).

    The swizzle acts on byte addresses: recast the outer layout to bytes, apply the swizzle
    there, read one 16-byte granule at a time (a base-4 swizzle keeps granules intact).
    """
    import cutlass.cute as cute

    sw = composed.inner
    assert sw.num_base >= 4, "swizzle must keep 16-byte granules whole"
    in_bytes = cute.make_composed_layout(sw, 0, cute.recast_layout(8, elem_bits, composed.outer))
    per_chunk = CHUNK_BYTES * 8 // elem_bits
    out = []
    for r in range(rows):
        row = []
        for c0 in range(0, cols, per_chunk):
            start = in_bytes((r, c0 * elem_bits // 8)) * 8 // elem_bits
            row.extend(start + k for k in range(per_chunk))
        out.append(tuple(row))
    return tuple(out)


@_traced
def operand_smem_offsets(rows: int, cols: int) -> Tuple[Tuple[int, ...], ...]:
    """Physical 16-bit offset of each (row, col) of a K-major wgmma operand tile."""
    import cutlass

    return pointer_swizzled_offsets(make_operand_smem_layout(cutlass.Float16, rows, cols), rows, cols, 16)


@_traced
def packed_smem_offsets(rows: int, row_bytes: int, wide: bool = False) -> Tuple[Tuple[int, ...], ...]:
    """Physical 16-bit offset of each (row, col) of a packed tile (TMA swizzle atom)."""
    return pointer_swizzled_offsets(make_packed_smem_layout(rows, row_bytes, wide=wide), rows,
                                    row_bytes // ELEM_BYTES, 16)


@_traced
def packed_tma_offsets(rows: int, row_bytes: int, wide: bool = False) -> Tuple[Tuple[int, ...], ...]:
    """Physical 16-bit offset of each (row, col) of ``make_packed_tma_layout``'s box."""
    return pointer_swizzled_offsets(make_packed_tma_layout(rows, row_bytes, wide=wide),
                                    *packed_box(rows, row_bytes, wide), 16)


@_traced
def swizzle_of(rows: int, cols: int) -> Tuple[int, int, int]:
    """(bits, base, shift) of the byte-address swizzle of a K-major 16-bit tile."""
    import cutlass

    sw = make_operand_smem_layout(cutlass.Float16, rows, cols).inner
    return (sw.num_bits, sw.num_base, sw.num_shift)


@functools.lru_cache(maxsize=None)
def dequant_smem_offsets(bits: int, rows: int, length: int) -> Tuple[Tuple[Tuple[int, ...], ...], ...]:
    """Where each code of a packed tile lands, dequantized, in the operand tile.

    ``[row][word][element]`` = physical 16-bit offset in the ``(rows, length)`` K-major
    tile of the value of element ``element`` of word ``word`` of packed row ``row``.
    """
    offsets = operand_smem_offsets(rows, length)
    words = sm80.word_elements(bits, length)
    return tuple(tuple(tuple(offsets[r][col] for col in w) for w in words) for r in range(rows))


def a_pair_value(h: int, ch: int) -> int:
    """The first of the two adjacent A-fragment (m16n8k16) values that hold a dequantized
    pair: row half ``h`` (rows ``8 h + g``), column half ``ch`` (k columns ``8 ch + 2 c``,
    ``+ 1``); the pair is 32-bit register ``a_pair_value(h, ch) // 2``."""
    frag = sm80.fragment("a")[0]  # lane 0 (g = c = 0): (row, col) of each value in order
    v = frag.index((sm80.LDSM_ROWS * h, 8 * ch))
    assert v % 2 == 0 and frag[v + 1] == (sm80.LDSM_ROWS * h, 8 * ch + 1), "a pair is two adjacent registers"
    return v


def dequant_pair_targets(bits: int) -> Tuple[Tuple[Tuple[int, int, int], ...], ...]:
    """Where a lane's dequantized pairs go in the stmatrix registers, for one 32-row load.

    ``[i][p] = (mt, kb, v)``: pair ``p`` of the word the lane got from matrix ``i`` of the
    ldmatrix x4 becomes values ``v, v+1`` of the stmatrix (A-fragment) registers of the
    16x16 block in rows ``16*mt ..`` of the load and k-block ``kb`` of the chunk.
    """
    out = []
    for i in range(4):
        h = i % 2
        row = []
        for p in range(packing.codes_per_word(bits) // 2):
            kb, ch = divmod(p, 2)
            row.append((i // 2, kb, a_pair_value(h, ch)))
        out.append(tuple(row))
    return tuple(out)
