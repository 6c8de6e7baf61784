"""The BitNet W2A8 packed weight layout, and how the kernels' threads walk it.

Format (byte-compatible with microsoft/BitNet ``gpu/pack_weight.py``): a ternary weight
``W[N, K]`` (values -1, 0, 1) is stored as 2-bit codes ``c = w + 2`` in ``N*K/4`` bytes.

* The matrix is cut into 16 x 32 tiles (16 rows ``n``, 32 columns ``k``), stored one after
  the other, tile ``(n // 16, k // 32)`` at byte ``128 * ((n // 16) * K/32 + k // 32)``.
* Inside a tile BitNet permutes the 512 codes (``B_global_16x32_to_shared_load_16x32``):
  permuted position ``p = 16 * t + e`` (word ``t`` < 32, element ``e`` < 16) holds tile
  row ``8 * (t // 16) + t % 8`` and column ``16 * ((t // 8) % 2) + e``.  So one 32-bit
  word holds 16 consecutive columns of one row: word ``t`` of a tile is row ``n0 + 8*n1``,
  column half ``h`` with ``t = n0 + 8*h + 16*n1``.
* Codes are packed four to a byte, then each 32-bit word is re-interleaved so that
  element ``e`` sits at bit ``8 * (e % 4) + 2 * (e // 4)`` (the order
  [0, 4, 8, 12, 1, 5, 9, 13, ...] from the least significant 2-bit field up).  One AND
  with ``0x03030303 << 2*i`` then isolates elements ``4i .. 4i+3`` as four bytes.

All of this is one CuTe layout: composing the element interleave with the inverse of the
tile permutation gives, for a tile coordinate (row, col), the bit offset
``((8, 2), (4, 4, 2)) : ((32, 512), (8, 2, 256))`` -- the closed form
``bit(n, k) = 32*t + 8*(e % 4) + 2*(e // 4)`` with ``t = 16*((n%16)//8) + 8*((k%32)//16)
+ n%8`` and ``e = k % 16``.  ``make_tile_bit_layout`` derives it with
``right_inverse`` + ``composition``; the tests check it against that closed form.

Thread mappings (kernels, tests and CPU emulations all use the functions below):

* GEMV: a 16-byte chunk ``q`` (0..7) of a tile holds words ``4q .. 4q+3`` = four
  consecutive rows ``gemv_chunk_row(q) + r`` (r < 4) over the same 16 columns
  ``16 * gemv_chunk_khalf(q) + e``; one 16-byte load gives four rows times one 16-byte
  activation vector.
* MMA (``mma.sync.m16n8k32`` with int8 operands; the 2-bit weights are the A operand,
  16 rows per warp; ``int8_a_fragment`` reads that fragment off CuTe's int8 wgmma
  atom, whose per-warp A fragment is the same): the contraction is permutation invariant, so
  per group of 128 columns (four tiles, eight 16-column *chunks*) lane ``(g, tq)``
  takes the whole word of (row ``g + 8*(j % 2)``, chunk ``tq + 4*(j // 2)``) for A
  register ``j``, and its decode step ``i`` (bytes = elements ``4i..4i+3``) feeds the
  i-th MMA of the group.  The activations (B operand) are read in the same permuted
  order: lane ``(g, tq)`` takes 16 bytes at columns ``16*tq`` and ``64 + 16*tq`` of the
  group, whose word ``i`` is its B register for the i-th MMA.
* wgmma (sm90; B comes from shared memory in natural k order, so no permutation): per
  32-column k-step, A register ``j`` of lane ``(g, tq)`` is decode step ``tq`` of the
  word ``kstep_word_offset(g, j)`` of the tile (rows ``g + 8*(j % 2)``, half ``j // 2``);
  the four lanes of a quad share each word.
"""

from __future__ import annotations

import functools
from typing import Tuple

from . import dense, packing, sm90
from ._trace import evaluate, traced

BITS = 2
CODE_OFFSET = 2  # stored code = w + 2, so -1, 0, 1 -> 1, 2, 3
TILE_N = 16
TILE_K = 32
TILE_BYTES = TILE_N * TILE_K * BITS // 8  # 128
WORD_BITS = 32
CODES_PER_WORD = WORD_BITS // BITS  # 16
CODES_PER_BYTE = 8 // BITS  # 4
# mma.sync.m16n8k32 (int8): a 16 x 32 weight tile is one MMA's A operand, 8 tokens its B
MMA_M = TILE_N
MMA_N = 8  # tokens per MMA
# fused projections (q/k/v, w1/w3): the kernels take the row ends of the first three
# segments (e1, e2, e3) and pick a segment's scale by comparing against them
MAX_SEGMENTS = 4
TILE_WORDS = TILE_BYTES // 4  # 32
# The 4-per-byte field a decode step isolates: bytes (e, e+1, e+2, e+3) = elements 4i..4i+3.
DECODE_MASK = 0x03030303
DECODE_STEPS = CODES_PER_WORD // 4  # 4 shifts of 2 bits
LOP3_AND = packing.LOP3_A & packing.LOP3_B  # lop3 lookup table of a & b
# Signed decode (the sm90 GEMM's s8 A operand): codes c in {1, 2, 3} -> w = c - 2 in each
# byte without a borrow across bytes: ((c | 0x80) - 2) ^ 0x80, the 0x80 bias keeping every
# byte >= 0x81 before the subtraction.
BYTE_BIAS = 0x80808080
CODE_OFFSET_BYTES = CODE_OFFSET * 0x01010101


def decode_signed_bytes(word: int, shift: int) -> int:
    """The signed decode on the host (reference of the kernel's four instructions): the
    four bytes of ``(word >> shift) & DECODE_MASK`` minus ``CODE_OFFSET``, as a u32."""
    t = ((word >> shift) & DECODE_MASK) | BYTE_BIAS
    return ((t - CODE_OFFSET_BYTES) ^ BYTE_BIAS) & 0xFFFFFFFF


# Kernel granularity: a GEMV step and an MMA k-group both cover 128 columns = 4 tiles.
GROUP_K = 4 * TILE_K
GROUP_BYTES = 4 * TILE_BYTES  # 512: one warp's 32 lanes x 16 bytes
N_MULTIPLE = TILE_N
K_MULTIPLE = GROUP_K
CHUNK_BYTES = 16
CHUNKS_PER_TILE = TILE_BYTES // CHUNK_BYTES  # 8
ROWS_PER_CHUNK = CHUNK_BYTES // 4  # 4 words = 4 rows
CHUNK_K = CODES_PER_WORD  # 16 columns per word / chunk
ROW_SUM_BYTES = 4  # a GEMV warp's int32 sum of one stripe row
# A GEMV lane l reads chunk l % 8 of tile l // 8 of a group, so its four rows are
# chunk_row(l % 8): lane bits 0 and 2 pick them, and lanes l ^ 2 (the other column half),
# l ^ 8 and l ^ 16 (the other tiles) hold the same rows.  The row fold adds over the first
# masks, a sum wanted once for every row (x's) over the second: the rest of a 32-lane warp's
# five butterfly masks.
SAME_ROW_LANE_MASKS = (2, 8, 16)
OTHER_ROW_LANE_MASKS = tuple(1 << b for b in range(5) if 1 << b not in SAME_ROW_LANE_MASKS)  # (1, 4)


def stripes(n: int) -> int:
    """16-row stripes (one GEMV CTA each) of a packed [N, K] matrix."""
    return n // TILE_N


def stripe_bytes(k: int) -> int:
    """Bytes of one 16-row stripe of a packed [N, K] matrix (one contiguous run of K / 128
    groups of GROUP_BYTES)."""
    return TILE_N * k // CODES_PER_BYTE


def row_sums_bytes(warps: int) -> int:
    """Shared memory of a GEMV CTA's per-warp row sums (``make_row_sums_layout``)."""
    return ROW_SUM_BYTES * TILE_N * warps

# Per-token int8 activations (BitNet's absmax quantizer): q = round(x * s), s = ACT_Q_MAX / max|x|,
# clamped to [ACT_Q_MIN, ACT_Q_MAX]; its kernel reads 16-byte chunks of 16-bit values.
ACT_Q_MAX = 127
ACT_Q_MIN = -128
ACT_QUANT_VEC = dense.VEC  # 16-bit values per 16-byte load (the row kernels' vector): K must be a multiple


# --------------------------------------------------------------------------------------
# CuTe layouts (call inside a @cute.jit trace)
# --------------------------------------------------------------------------------------


def make_row_sums_layout(warps):
    """A GEMV CTA's per-warp sums of its stripe's rows in shared memory: (TILE_N rows,
    ``warps``), a warp's 16 rows contiguous (the 16 storing threads read one row each)."""
    import cutlass.cute as cute

    return cute.make_layout((TILE_N, warps), stride=(1, TILE_N))


def make_tile_permutation():
    """Permuted code position (e, t) -> row-major offset ``32*row + col`` inside the tile.

    BitNet's ``B_global_16x32_to_shared_load_16x32_layout``: word ``t = n0 + 8*h + 16*n1``
    holds row ``n0 + 8*n1``, columns ``16*h + e``.
    """
    import cutlass.cute as cute

    return cute.make_layout(
        (CODES_PER_WORD, (8, 2, 2)), stride=(1, (TILE_K, 16, 8 * TILE_K))
    )


def make_word_interleave():
    """Element e of a word -> its bit offset: ``8*(e % 4) + 2*(e // 4)``."""
    import cutlass.cute as cute

    return cute.make_layout((4, 4), stride=(8, BITS))


def make_tile_bit_layout():
    """Tile coordinate (row, col) -> bit offset inside the 128-byte tile.

    Derived: packed position p = e + 16*t sits at bit ``interleave(e) + 32*t``; compose
    that with the inverse of the tile permutation (offset -> position) and with the
    row-major (row, col) -> offset layout.  Evaluates to
    ``((8,2),(4,4,2)):((32,512),(8,2,256))``.
    """
    import cutlass.cute as cute

    position_bits = cute.make_layout(((4, 4), TILE_WORDS), stride=((8, BITS), WORD_BITS))
    offset_to_position = cute.right_inverse(make_tile_permutation())
    row_major = cute.make_layout((TILE_N, TILE_K), stride=(TILE_K, 1))
    return cute.composition(cute.composition(position_bits, offset_to_position), row_major)


def make_word_row():
    """Word t of a tile -> its tile row (``t % 8 + 8 * (t // 16)``)."""
    import cutlass.cute as cute

    return cute.make_layout((8, 2, 2), stride=(1, 0, 8))


def make_word_khalf():
    """Word t of a tile -> which 16-column half of the tile it holds."""
    import cutlass.cute as cute

    return cute.make_layout((8, 2, 2), stride=(0, 1, 0))


def _chunk_of(word_layout):
    """Restrict a word layout to the first word of each 16-byte chunk (4 words)."""
    import cutlass.cute as cute

    by_chunk = cute.composition(word_layout, cute.make_layout((ROWS_PER_CHUNK, CHUNKS_PER_TILE), stride=(1, ROWS_PER_CHUNK)))
    return cute.get(by_chunk, mode=[1])


def make_chunk_row():
    """16-byte chunk q of a tile -> first of its four rows: ``(2,2,2):(4,0,8)``."""
    return _chunk_of(make_word_row())


def make_chunk_khalf():
    """16-byte chunk q of a tile -> its 16-column half: ``(2,2,2):(0,1,0)``."""
    return _chunk_of(make_word_khalf())


def make_mma_word_offset():
    """(lane, A register j) -> byte offset, inside a 128-column group, of the word it decodes.

    Lane ``(g, tq) = (lane // 4, lane % 4)``; register j covers row ``g + 8*(j % 2)`` and
    chunk ``c = tq + 4*(j // 2)`` (tile ``c // 2``, half ``c % 2``).  The word is
    ``t = g + 8*(c % 2) + 16*(j % 2)`` of tile ``c // 2``, at byte ``128*(c//2) + 4*t``:
    ``(((2, 2), 8), (2, 2)) : (((32, 128), 4), (64, 256))`` over ``((tq, g), j)``.
    """
    import cutlass.cute as cute

    return cute.make_layout(
        (((2, 2), 8), (2, 2)), stride=(((4 * 8, TILE_BYTES), 4), (4 * 16, 2 * TILE_BYTES))
    )


# --------------------------------------------------------------------------------------
# The same layouts as integer tables (evaluated in a trace once, then cached)
# --------------------------------------------------------------------------------------


@traced
def tile_bit_table() -> Tuple[int, ...]:
    """Bit offset of tile (row, col), at index ``32*row + col``."""
    layout = make_tile_bit_layout()
    return tuple(layout((r, c)) for r in range(TILE_N) for c in range(TILE_K))


@traced
def tile_permutation_table() -> Tuple[int, ...]:
    """Row-major tile offset held by permuted position ``p = 16*t + e``."""
    layout = make_tile_permutation()
    return tuple(layout((p % CODES_PER_WORD, p // CODES_PER_WORD)) for p in range(TILE_N * TILE_K))


@traced
def word_interleave_table() -> Tuple[int, ...]:
    layout = make_word_interleave()
    return tuple(layout(e) for e in range(CODES_PER_WORD))


@traced
def chunk_tables() -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """(first row, column half) of each 16-byte chunk of a tile."""
    rows, halves = make_chunk_row(), make_chunk_khalf()
    return (
        tuple(rows(q) for q in range(CHUNKS_PER_TILE)),
        tuple(halves(q) for q in range(CHUNKS_PER_TILE)),
    )


@traced
def mma_word_offset_table() -> Tuple[Tuple[int, ...], ...]:
    """``[lane][j]``: byte offset in a 512-byte group of the word behind A register j."""
    layout = make_mma_word_offset()
    return tuple(
        tuple(layout(((lane % 4, lane // 4), j)) for j in range(4)) for lane in range(32)
    )


def _int8_a_fragment_builder():
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90
    from cutlass.cute.nvgpu import OperandMajorMode, warpgroup

    mma = sm90.make_trivial_tiled_mma(
        cutlass.Uint8, cutlass.Int8, OperandMajorMode.K, OperandMajorMode.K, cutlass.Int32,
        (1, 1, 1), (64, 8), warpgroup.OperandSource.RMEM,
    )
    coords = cute.make_identity_tensor((64, 32))
    out = []
    for lane in range(32):
        frag = mma.get_slice(lane).partition_A(coords)
        out.append(tuple(frag[i] for i in range(cute.size(frag))))
    return tuple(out)


@functools.lru_cache(maxsize=1)
def int8_a_fragment() -> Tuple[Tuple[Tuple[int, int], ...], ...]:
    """``[lane][v]``: (row, k) of byte v of the int8 A fragment of an m16 x k32 MMA tile.

    Read off CuTe's int8 wgmma atom (warp 0 of the warpgroup holds rows 0..15 exactly as
    ``mma.sync.m16n8k32`` lays them out): bytes ``4j .. 4j+3`` are register ``j``.
    """
    return evaluate(_int8_a_fragment_builder, arch=sm90.TRACE_ARCH)  # the wgmma atom needs sm_90a


# --------------------------------------------------------------------------------------
# Index arithmetic shared by the kernels (on DSL integers) and the CPU emulations (on
# Python ints / torch tensors).  Only shifts, masks, + and * -- no division.
# --------------------------------------------------------------------------------------


def chunk_row(q):
    """First row of 16-byte chunk ``q`` of a tile (``make_chunk_row``)."""
    return ((q & 1) << 2) + ((q >> 2) << 3)


def chunk_khalf(q):
    """Column half of 16-byte chunk ``q`` of a tile (``make_chunk_khalf``)."""
    return (q >> 1) & 1


def mma_word_offset(g, tq, j: int):
    """Byte offset in a 128-column group of A register ``j``'s word for lane ``(g, tq)``."""
    return 4 * g + 32 * (tq & 1) + TILE_BYTES * (tq >> 1) + 64 * (j & 1) + 2 * TILE_BYTES * (j >> 1)


def kstep_word_offset(g, j: int):
    """Byte offset in a 128-byte tile of the word behind A register ``j`` of lane ``(g, *)``
    for a natural-order k-step: row ``g + 8*(j % 2)``, column half ``j // 2``."""
    return 4 * (g + 8 * (j >> 1) + 16 * (j & 1))


def kstep_shift(tq):
    """Decode shift of lane ``(*, tq)`` in a natural-order k-step: columns ``4tq .. 4tq+3``
    of each half are elements ``4tq .. 4tq+3``, i.e. decode step ``tq``."""
    return 2 * tq


def mma_x_offset(tq, half: int):
    """Column (in a 128-column group) of the 16 activation bytes lane ``tq`` reads for B
    register ``half`` (b0: half 0, b1: half 1); byte ``4*i .. 4*i+3`` feeds MMA i."""
    return 16 * tq + 64 * half


# --------------------------------------------------------------------------------------
# Shapes
# --------------------------------------------------------------------------------------


def check_shape(n: int, k: int, *, k_multiple: int = TILE_K, name: str = "weight") -> None:
    if n <= 0 or n % TILE_N:
        raise ValueError(f"{name} rows N must be a positive multiple of {TILE_N}, got {n}")
    if k <= 0 or k % k_multiple:
        raise ValueError(f"{name} columns K must be a positive multiple of {k_multiple}, got {k}")
