"""The sm80 instruction configuration and the layouts it induces.

Configuration: ``mma.sync.m16n8k16`` (fp16/bf16 in, fp32 accumulate) fed by ``ldmatrix``
(x4, 16-bit, non-transposed), one warp per MMA tile, ``WARPS_N = 4`` warps along the
sequence.  The same configuration is used by the residual (pack) kernel, which quantizes
fragments it loaded with ldmatrix, and by the decode kernel, which loads the packed words
with ldmatrix and dequantizes them back into fragments: the packed layout is whatever
that instruction pair induces, so nothing is reshuffled at run time.

Fragments.  In both MMA operand fragments of m16n8k16, the quad lane ``c = lane % 4``
holds, of every 16-wide block of the contraction (k) dimension, the four columns
``(2c, 2c+1, 2c+8, 2c+9)`` in register order, for rows ``lane // 4`` (+8 for the
second row half of A).  ``fragment_columns`` reads this off CuTe's MMA atom.

Packed rows.  A packed row is one row of an operand (a token of K, a channel of V)
with its columns grouped by the lane that consumes them: word ``4*j + c`` of the row
holds the ``F = 32/bits`` codes lane ``c`` needs for the k-blocks of chunk ``j``
(``F/4`` k-blocks, i.e. 32 columns for 4-bit, 64 for 2-bit), in fragment order, with
the element-to-bit-field interleave of ``packing``.  The word column ``c`` is exactly
where ``ldmatrix`` delivers a 16-byte row to lane ``c`` (``ldmatrix_lane_word``), so a
plain x4 ldmatrix of four 8-row blocks gives every lane its words for four rows.

* K (``k_pack``): rows are tokens, columns the head dim.  ``[..., tokens, D*bits/32]``.
* V (``v_pack``): rows are channels, columns the tokens of one residual block (``Nr``),
  stored per block: ``[..., blocks, D, Nr*bits/32]`` (always 16 words = 64 bytes a row).
  Warp ``w`` of the decode kernel owns chunk ``w`` (tokens ``[w*T, (w+1)*T)``).

Residual block ``Nr`` = warps along N x rows of one ldmatrix tile x codes per 16-bit
ldmatrix element = 4 x 8 x (16/bits): 128 tokens for 4-bit, 256 for 2-bit.

Params.  (scale, zero) 16-bit pairs packed in one 32-bit word.  Where a parameter row
runs along an operand's k dimension (K per-channel: along the head dim; V: along the
tokens) it is stored in fragment order, ``position 16*kt + 4*c + v`` holding column
``16*kt + fragment_columns()[c][v]``, so each lane fetches its four pairs of a k-block
with one 16-byte shared-memory load.
"""

from __future__ import annotations

import functools
import math
from typing import Dict, List, Tuple

from . import packing
from ._trace import traced

ARCH = "sm80"
MMA_SHAPE = (16, 8, 16)  # m, n, k of mma.sync
WARPS_N = 4  # warps along the sequence (Wm = 1)
# query heads of one KV head a decode tile holds: the N of the transposed products (one or
# two m16n8k16 N blocks); GQA groups up to 8 use 8, up to 16 use 16
HEADS_TILES = (8, 16)
LDSM_ROWS = 8  # rows of one 8x8 ldmatrix tile
CHUNK_WORDS = 4  # 32-bit words in one 16-byte ldmatrix row (one per quad lane)
CHUNK_BYTES = 16
SMEM_BANKS = 32
MAX_SPLITS = 256  # split-KV partials the combine kernel weighs (one fp32 weight each in smem)
# the unit of a split partition's tail weight (``kernels_sm80.tensors.split_tiles``): the
# long splits take w / TAIL_UNIT times the last split's share, TAIL_UNIT = even
TAIL_UNIT = 16
BANK_BYTES = 4


# --------------------------------------------------------------------------------------
# Derived sizes
# --------------------------------------------------------------------------------------


def tiles_per_split(n_tiles, num_splits, tail_weight=TAIL_UNIT, maximum=max):
    """Tiles of every split but the last in a partition of ``n_tiles`` with ``tail_weight``
    (in sixteenths, ``TAIL_UNIT``; one unit or less: even, as lighter ones would leave
    tiles past the last split): ceil(n w / (w (S - 1) + TAIL_UNIT)), the last split the
    rest.  Host ints, or a kernel's traced integers with ``maximum=cutlass.max``
    (``kernels_sm80.tensors.split_tiles``): the one definition of the partition."""
    weight = maximum(tail_weight, TAIL_UNIT)
    parts = weight * (num_splits - 1) + TAIL_UNIT
    return (n_tiles * weight + parts - 1) // parts


def residual_block(bits: int) -> int:
    """Nr: tokens one CTA's warps cover in one packed V tile (128 for 4-bit, 256 for 2-bit)."""
    return WARPS_N * LDSM_ROWS * packing.codes_per_half(bits)


def tokens_per_warp(bits: int) -> int:
    """T: tokens of one packed chunk, the share of one warp in a residual block."""
    return residual_block(bits) // WARPS_N


def heads_tile(group: int) -> int:
    """The decode tile's query-head count for ``group`` query heads per KV head."""
    return next(n for n in HEADS_TILES if group <= n)


def param_position(kblock, c, v):
    """Fragment-order position of the (scale, zero) word of value ``v`` (0..3) of quad lane
    ``c`` in 16-wide k-block ``kblock`` of a parameter row (module docstring, "Params");
    element pair p of a word takes values 2*(p % 2) and 2*(p % 2) + 1."""
    return MMA_SHAPE[2] * kblock + 4 * c + v


def fragment_column(kblock, c, half):
    """k column (channel) of the first of the two values quad lane ``c`` holds in column half
    ``half`` of 16-wide k-block ``kblock`` of an m16n8k16 A / B fragment: ``16 kblock + 2 c
    + 8 half`` (``fragment_columns``); its (scale, zero) word is ``param_position(kblock, c,
    2 half)``, the next column's the word after."""
    return MMA_SHAPE[2] * kblock + 2 * c + (MMA_SHAPE[2] // 2) * half


def head_columns(heads_tile: int) -> int:
    """Columns (query heads) one thread holds of an ``m x heads_tile`` MMA accumulator: two
    of every 8-column block (mma.sync m16n8 and wgmma m64nN alike)."""
    return 2 * (heads_tile // MMA_SHAPE[1])


def k_blocks_per_word(bits: int) -> int:
    """16-wide k blocks whose fragment values one 32-bit word carries (2 or 4)."""
    return packing.codes_per_word(bits) // 4


def chunk_columns(bits: int) -> int:
    """Columns of a packed row covered by one 16-byte chunk (32 for 4-bit, 64 for 2-bit)."""
    return MMA_SHAPE[2] * k_blocks_per_word(bits)


# FP4 codes (KVFormat.fp4) are stored in natural order, the bytes Blackwell's block-scaled
# MMA reads (layouts.sm100).  ldmatrix hands quad lane c of a 32-value segment (one 16-byte
# chunk) the word of values 8 c .. 8 c + 7, so the m16n8k16 fragments built from it see the
# segment permuted: fragment position L = 16 kb + 8 hi + 2 c + h (k-block kb, column half
# hi, lane c, element h) holds value 8 c + 4 kb + 2 hi + h, i.e. byte 2 kb + hi of the word.
# The sm80 decode kernel orders Q's channels (the contraction of Q K^T) and K's rows (the
# tokens: the contraction of P V runs in the scores' row order) the same way.
FP4_SEGMENT = 32
FP4_PERM_SHAPE = (2, 4, 2, 2)  # (h, c, hi, kb) of a fragment position, colexicographic
FP4_PERM_STRIDE = (1, 8, 2, 4)  # ... their weights in the natural position
FP4_LANE_VALUES = FP4_SEGMENT // CHUNK_WORDS  # the values of one lane's word: 8


def fp4_position(position: int) -> int:
    """Natural index of the value at fragment position ``position`` (per 32-value segment)."""
    seg, r = divmod(position, FP4_SEGMENT)
    h, c, hi, kb = r % 2, (r // 2) % 4, (r // 8) % 2, r // 16
    return FP4_SEGMENT * seg + h * FP4_PERM_STRIDE[0] + c * FP4_PERM_STRIDE[1] + hi * FP4_PERM_STRIDE[2] \
        + kb * FP4_PERM_STRIDE[3]


def fp4_fragment_position(natural):
    """Fragment position of the value at natural index ``natural`` (``fp4_position``
    inverted); works on traced integers (shifts and masks: every extent is a power of two)."""
    seg, r = natural >> (FP4_SEGMENT.bit_length() - 1), natural & (FP4_SEGMENT - 1)
    pos, weight = 0, 1
    for extent, stride in zip(FP4_PERM_SHAPE, FP4_PERM_STRIDE):
        pos = pos + ((r >> (stride.bit_length() - 1)) & (extent - 1)) * weight
        weight *= extent
    return FP4_SEGMENT * seg + pos


def fp4_lane_scale_column(segment, c, group: int):
    """Scale column (block of ``group`` values) of the eight values quad lane ``c`` holds of
    32-value segment ``segment`` (a lane's word: ``FP4_LANE_VALUES`` consecutive values)."""
    return (FP4_SEGMENT * segment + FP4_LANE_VALUES * c) // group


def make_fp4_perm(segments: int):
    """CuTe layout: fragment position -> natural index over ``segments`` segments (trace)."""
    import cutlass.cute as cute

    return cute.make_layout((FP4_PERM_SHAPE, segments), stride=(FP4_PERM_STRIDE, FP4_SEGMENT))


def words_per_row(bits: int, length: int) -> int:
    if length % chunk_columns(bits):
        raise ValueError(
            f"a packed row of {bits}-bit codes needs a length that is a multiple of "
            f"{chunk_columns(bits)}, got {length}"
        )
    return length * bits // packing.WORD_BITS


# --------------------------------------------------------------------------------------
# Tables read off CuTe's atoms (evaluated in a trace, cached)
# --------------------------------------------------------------------------------------


def _mma_atom(dtype_name: str = "fp16"):
    import cutlass
    from cutlass.cute.nvgpu import warp

    ab = {"fp16": cutlass.Float16, "bf16": cutlass.BFloat16}[dtype_name]
    return warp.MmaF16BF16Op(ab, cutlass.Float32, MMA_SHAPE)


@traced
def fragment_columns() -> Tuple[Tuple[int, ...], ...]:
    """For each quad lane c, the k columns (of a 16-wide block) it holds, in register order.

    Read from the B operand of the m16n8k16 atom and checked against the A operand: both
    give ``((0, 1, 8, 9), (2, 3, 10, 11), (4, 5, 12, 13), (6, 7, 14, 15))``.
    """
    import cutlass.cute as cute

    m, n, k = MMA_SHAPE
    mma = cute.make_tiled_mma(_mma_atom(), (1, 1, 1))
    cB = cute.make_identity_tensor((n, k))
    cA = cute.make_identity_tensor((m, k))
    cols: List[Tuple[int, ...]] = []
    for lane in range(32):
        thr = mma.get_slice(lane)
        b = thr.partition_B(cB)
        b_coords = [b[i] for i in range(cute.size(b))]
        row = b_coords[0][0]
        assert all(nn == row == lane // 4 for nn, _ in b_coords), "B fragment row"
        ks = tuple(kk for _, kk in b_coords)
        a = thr.partition_A(cA)
        a_coords = [a[i] for i in range(cute.size(a))]
        # A values ((2 lanes, 2 row halves, 2 col halves)): rows lane//4 and +8
        a_first_row = tuple(kk for mm, kk in a_coords if mm == lane // 4)
        assert a_first_row == ks, "A and B fragments disagree on the lane's k columns"
        if lane < 4:
            cols.append(ks)
        else:
            assert ks == cols[lane % 4], "k columns depend only on the quad lane"
    return tuple(cols)


MMA_OPERAND_SHAPES = {"a": (MMA_SHAPE[0], MMA_SHAPE[2]), "b": (MMA_SHAPE[1], MMA_SHAPE[2]),
                      "c": (MMA_SHAPE[0], MMA_SHAPE[1])}


@traced
def fragment(operand: str) -> Tuple[Tuple[Tuple[int, int], ...], ...]:
    """Thread-value layout of one m16n8k16 operand: ``[lane][value] = (row, col)``.

    ``operand``: ``"a"`` (16 x 16, rows m, cols k), ``"b"`` (8 x 16, rows n, cols k) or
    ``"c"`` (16 x 8 accumulator, rows m, cols n).  Values are in register order (16-bit
    values for A and B, fp32 for C), read off the atom by partitioning an identity tensor.
    """
    import cutlass.cute as cute

    if operand not in MMA_OPERAND_SHAPES:
        raise ValueError(f"operand must be one of {tuple(MMA_OPERAND_SHAPES)}, got {operand!r}")
    mma = cute.make_tiled_mma(_mma_atom(), (1, 1, 1))
    ident = cute.make_identity_tensor(MMA_OPERAND_SHAPES[operand])
    out = []
    for lane in range(32):
        thr = mma.get_slice(lane)
        part = {"a": thr.partition_A, "b": thr.partition_B, "c": thr.partition_C}[operand](ident)
        out.append(tuple((part[i][0], part[i][1]) for i in range(cute.size(part))))
    return tuple(out)


@traced
def ldmatrix_lane_word() -> Tuple[Tuple[int, int], ...]:
    """(row, 32-bit word column) of the 8x8 16-bit tile that ldmatrix gives each lane."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.nvgpu import warp

    atom = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), cutlass.Float16)
    dst = atom.layout_dst_tv  # (lane, value) -> row-major offset in 8x8 (x4 stacked)
    out = []
    for lane in range(32):
        lo, hi = dst((lane, 0)), dst((lane, 1))
        assert hi == lo + 1 and lo % 2 == 0, "a lane's two 16-bit values form one word"
        row, col16 = divmod(lo % 64, 8)
        out.append((row, col16 // 2))
    return tuple(out)


# --------------------------------------------------------------------------------------
# Packed rows
# --------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def packed_row_map(bits: int, length: int) -> Tuple[Tuple[int, int], ...]:
    """For every column of a row of ``length`` codes: (word index in the row, bit shift).

    Inverse view: ``word_elements`` gives, for a word, the column of each element.
    """
    words_per_row(bits, length)
    cols = fragment_columns()
    lane_col = {lane % 4: wc for lane, (_, wc) in enumerate(ldmatrix_lane_word())}
    f = packing.codes_per_word(bits)
    kpw = k_blocks_per_word(bits)
    table: Dict[int, Tuple[int, int]] = {}
    for chunk in range(length // chunk_columns(bits)):
        for c in range(4):
            word = CHUNK_WORDS * chunk + lane_col[c]
            for e in range(f):
                kt = kpw * chunk + e // 4
                col = MMA_SHAPE[2] * kt + cols[c][e % 4]
                table[col] = (word, packing.shift_of_element(bits, e))
    assert sorted(table) == list(range(length))
    assert len(set(table.values())) == length, "two columns share a bit field"
    return tuple(table[col] for col in range(length))


@functools.lru_cache(maxsize=None)
def word_elements(bits: int, length: int) -> Tuple[Tuple[int, ...], ...]:
    """For every word of a packed row, the column held by each element 0..F-1."""
    f = packing.codes_per_word(bits)
    shift_to_element = {packing.shift_of_element(bits, e): e for e in range(f)}
    out = [[-1] * f for _ in range(words_per_row(bits, length))]
    for col, (word, shift) in enumerate(packed_row_map(bits, length)):
        out[word][shift_to_element[shift]] = col
    return tuple(tuple(w) for w in out)


@functools.lru_cache(maxsize=None)
def fragment_order(length: int) -> Tuple[int, ...]:
    """Params order along a k dimension: position p holds column ``fragment_order(L)[p]``."""
    k = MMA_SHAPE[2]
    if length % k:
        raise ValueError(f"fragment order needs a multiple of {k} columns, got {length}")
    cols = fragment_columns()
    return tuple(k * (p // k) + cols[(p % k) // 4][p % 4] for p in range(length))


# --------------------------------------------------------------------------------------
# Shared-memory swizzles (16-bit element offsets; every smem tile is read with ldmatrix)
# --------------------------------------------------------------------------------------

ELEM_BYTES = 2  # smem tiles are addressed as 16-bit matrices (what ldmatrix moves)
_SW_BASE = 3  # 8 16-bit elements = one 16-byte chunk
_SW_SHIFT = 3
SWIZZLE_ROW_BYTES = 128  # the widest swizzled row (8 chunks: the 32 banks once; TMA's SWIZZLE_128B)
SWIZZLE_ATOM_ROWS = 8  # rows of that widest swizzle before its XOR pattern repeats


def swizzle_params(row_bytes: int) -> Tuple[int, int, int, int]:
    """(bits, base, shift, atom_rows) of the swizzle for a tile with rows of ``row_bytes``.

    Rows are split into 16-byte chunks; XOR-ing the chunk index with the row index
    (shifted so that 8 consecutive rows land on 8 different 16-byte bank groups) makes
    the 8 row addresses of one ldmatrix phase, and the 8 consecutive chunks of one
    cp.async phase, hit all 32 banks once.  Rows of 128 bytes or more use CUTLASS's
    8 x 64 (16-bit) atom tiled over the tile.
    """
    if row_bytes % CHUNK_BYTES or row_bytes <= 0:
        raise ValueError(f"smem rows must be a positive multiple of 16 bytes, got {row_bytes}")
    chunks = min(row_bytes, SWIZZLE_ROW_BYTES) // CHUNK_BYTES
    return int(math.log2(chunks)), _SW_BASE, _SW_SHIFT, SWIZZLE_ATOM_ROWS if row_bytes >= SWIZZLE_ROW_BYTES else 0


def make_smem_layout(rows: int, row_bytes: int):
    """CuTe swizzled layout of a (rows, row_bytes/2) 16-bit tile.  Call inside a trace."""
    import cutlass.cute as cute

    bits, base, shift, atom_rows = swizzle_params(row_bytes)
    cols = row_bytes // ELEM_BYTES
    if atom_rows:
        atom = cute.make_composed_layout(
            cute.make_swizzle(bits, base, shift), 0, cute.make_layout((8, 64), stride=(64, 1))
        )
        return cute.tile_to_shape(atom, (rows, cols), (0, 1))
    return cute.make_composed_layout(
        cute.make_swizzle(bits, base, shift), 0, cute.make_layout((rows, cols), stride=(cols, 1))
    )


@traced
def smem_offsets(rows: int, row_bytes: int) -> Tuple[Tuple[int, ...], ...]:
    """Physical 16-bit offset of each logical (row, col) of a swizzled smem tile."""
    layout = make_smem_layout(rows, row_bytes)
    cols = row_bytes // ELEM_BYTES
    out = []
    for r in range(rows):
        out.append(tuple(layout((r, c)) for c in range(cols)))
    return tuple(out)



# --------------------------------------------------------------------------------------
# Kernel-side CuTe objects (call inside a @cute.jit trace)
# --------------------------------------------------------------------------------------


def make_mma(dtype, warps: int = 1):
    """The m16n8k16 tiled MMA: one warp (each warp partitions its own slice of a tile), or
    ``warps`` warps stacked along M (warp ``w`` takes rows ``16 w ..`` of every ``16 warps``)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.nvgpu import warp

    return cute.make_tiled_mma(warp.MmaF16BF16Op(dtype, cutlass.Float32, MMA_SHAPE), (warps, 1, 1))


def make_packed_ldmatrix_copy(dtype):
    """ldmatrix x4 over four 8-row blocks of one 16-byte chunk of a packed (16-bit) tile.

    Lane ``l`` receives the word ``l % 4`` of rows ``l//4 + 8*i`` (i = 0..3) of the chunk:
    the four packed rows a lane dequantizes into its fragments.  Tile (32 rows, 8 cols).
    """
    import cutlass.cute as cute
    from cutlass.cute.nvgpu import warp

    atom = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), dtype)
    # (lane, value) -> column-major (row + 32*col) coordinate in the (32, 8) tile:
    # lane%4 picks the word (2 columns), lane//4 the row, value (j, i) the half and block.
    tv = cute.make_layout(((4, 8), (2, 4)), stride=((64, 1), (32, 8)))
    return cute.make_tiled_copy(atom, tv, (32, 8))
