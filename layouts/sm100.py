"""The sm100 (Blackwell) instruction configuration: tcgen05 operands and block-scaled FP4.

tcgen05 MMAs are issued by one thread; A and B are read from shared memory through
descriptors (A may also come from tensor memory) and the accumulator lives in tensor
memory, so the layouts that matter are the shared-memory operand layouts and, for the
block-scaled kinds, the layout of the scale factors.  Every table here is read off the
DSL's own helpers and atoms, evaluated in an ``sm_100a`` trace (no GPU needed).

Operands.  Every operand the decode kernel feeds tcgen05 is K-major (``MmaMXF4NVF4Op``
and ``MmaMXF4Op`` accept nothing else): K with rows = tokens and the head dim as the
contraction, V with rows = channels and the tokens as the contraction (the same
orientation as the packed integer rows of ``sm80``).  Each tile is the widest
``tcgen05.make_smem_layout_atom`` K-major swizzle atom its row allows (``K_SW128`` for
128-byte rows, ``K_SW64`` for 64 bytes, ...; ``blackwell_helpers.get_smem_layout_atom_ab``
chooses), tiled rows-first.  As on sm90 the swizzle acts on byte addresses.

* Integer formats (4/2-bit codes, the ``sm80`` packed words): dequantized to 16 bits in
  registers exactly as on sm80/sm90 and stored to a 16-bit K-major tile, then a
  ``tcgen05.MmaF16BF16Op`` (``make_f16_mma``).
* NVFP4: e2m1 codes (``E2M1_VALUES``; two per byte, element ``2k`` in the low nibble),
  one UE4M3 scale factor per 16 consecutive values along the contraction dim, and one
  fp32 scale per KV head applied to the fp32 accumulator.  ``MmaMXF4NVF4Op``, K = 64 per
  instruction, so 4 scale factors per row per MMA.
* MXFP4: e2m1 codes, one UE8M0 scale factor per 32 values (``MmaMXF4Op``, 2 per MMA),
  and the same per-head fp32 scale.

Scale factors.  tcgen05 reads them in the 128 x 4 "basic chunk" of
``blockscaled_layout.BlockScaledBasicChunk``: within a chunk of 128 rows and 4 scale
columns (512 bytes), the scale of row ``m`` and scale column ``s`` sits at byte
``16*(m % 32) + 4*(m // 32) + s``; ``tile_atom_to_shape_SF`` tiles chunks over an
operand with the scale columns fastest.  Stored that way in global memory, TMA copies
them to shared memory unchanged.  Rows pad to 128, scale columns to 4.

Query transformation.  With K / V as A (``M = UMMA_M = 128`` tokens or channels) the
query heads are the N side of the MMA (``query_tile_cols``: a multiple of 8, at least 8).
"""

from __future__ import annotations

from typing import Tuple

from . import sm90
from ._trace import traced_for

ARCH = "sm100"
TRACE_ARCH = "sm_100a"
UMMA_M = 128  # rows of one cta_group::1 block-scaled MMA
UMMA_N_STEP = 8
FP4_FORMATS = ("nvfp4", "mxfp4")
SF_VEC = {"nvfp4": 16, "mxfp4": 32}  # values per scale factor along the contraction dim
SF_NAME = {"nvfp4": "ue4m3", "mxfp4": "ue8m0"}
SF_ATOM_ROWS = 128  # rows of one scale-factor basic chunk
SF_ATOM_COLS = 4  # scale factors per row in one basic chunk
OPERAND_DTYPES = ("e2m1", "fp16", "bf16")
ELEM_BITS = {"e2m1": 4, "fp16": 16, "bf16": 16}


_traced = traced_for(TRACE_ARCH)


def _check_format(fmt: str) -> None:
    if fmt not in FP4_FORMATS:
        raise ValueError(f"block-scaled format must be one of {FP4_FORMATS}, got {fmt!r}")


def _dtype(name: str):
    import cutlass

    table = {"e2m1": cutlass.Float4E2M1FN, "fp16": cutlass.Float16, "bf16": cutlass.BFloat16}
    if name not in table:
        raise ValueError(f"operand dtype must be one of {OPERAND_DTYPES}, got {name!r}")
    return table[name]


def _sf_dtype(fmt: str):
    import cutlass

    _check_format(fmt)
    return {"nvfp4": cutlass.Float8E4M3FN, "mxfp4": cutlass.Float8E8M0FNU}[fmt]


# --------------------------------------------------------------------------------------
# Number formats (what the codes and scale bytes mean)
# --------------------------------------------------------------------------------------


E2M1_MANTISSA_BITS = 1  # e2m1: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0
E2M1_SIGN_BIT = ELEM_BITS["e2m1"] - 1  # 3
E2M1_EXP_BIAS = 1
E4M3_MANTISSA_BITS = 3  # UE4M3 (NVFP4's scale): exponent bits 6..3 (bias 7), mantissa 2..0
E4M3_EXP_BIAS = 7
E4M3_MIN_EXP = 1 - E4M3_EXP_BIAS  # -6: below it e4m3 is subnormal, in quanta of 2^-9
SF_BITS = 8  # a scale byte


def e2m1_value(code: int) -> float:
    """Value of a 4-bit e2m1 code: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0."""
    if not 0 <= code < 1 << ELEM_BITS["e2m1"]:
        raise ValueError(f"e2m1 code must be in [0, 16), got {code}")
    sign = -1.0 if code >> E2M1_SIGN_BIT & 1 else 1.0
    exp, man = (code >> E2M1_MANTISSA_BITS) & 3, code & 1
    half = 2.0 ** -E2M1_MANTISSA_BITS
    mag = man * half if exp == 0 else (1.0 + man * half) * 2.0 ** (exp - E2M1_EXP_BIAS)
    return sign * mag


E2M1_VALUES = tuple(e2m1_value(c) for c in range(16))


UE4M3_NAN = 0x7F  # the NaN scale byte of each format (a block that held a NaN or an infinity)
UE8M0_NAN = 0xFF
UE8M0_BIAS = 127
UE8M0_MIN_EXP = -UE8M0_BIAS  # byte 0: 2^-127, an all-zero block's MXFP4 scale
SCALE_NAN = {"nvfp4": UE4M3_NAN, "mxfp4": UE8M0_NAN}


def ue4m3_value(byte: int) -> float:
    """Value of an NVFP4 scale byte (e4m3 with the sign bit clear, bias 7; 0x7f is NaN)."""
    if not 0 <= byte < 128:
        raise ValueError(f"a UE4M3 scale is a byte in [0, 128), got {byte}")
    if byte == UE4M3_NAN:
        return float("nan")
    exp, man = byte >> E4M3_MANTISSA_BITS, byte & ((1 << E4M3_MANTISSA_BITS) - 1)
    frac = man / (1 << E4M3_MANTISSA_BITS)
    return frac * 2.0**E4M3_MIN_EXP if exp == 0 else (1 + frac) * 2.0 ** (exp - E4M3_EXP_BIAS)


def ue8m0_value(byte: int) -> float:
    """Value of an MXFP4 scale byte: ``2^(byte - 127)``; 0xff is NaN."""
    if not 0 <= byte < 256:
        raise ValueError(f"a UE8M0 scale is a byte in [0, 256), got {byte}")
    return float("nan") if byte == UE8M0_NAN else 2.0 ** (byte - UE8M0_BIAS)


# e2m1 rounding, half to even: the magnitudes (codes 0-7), and per midpoint between codes
# c and c + 1 whether a value exactly on it goes up (to the even code c + 1)
E2M1_MAGNITUDES = E2M1_VALUES[:8]
E2M1_MAX = E2M1_MAGNITUDES[-1]
# twice the magnitudes, one byte each in two words (codes 0-3, 4-7): a byte permute picks a
# code's (the sm100 decode kernel reads its FP4 terms' values back that way)
_E2M1_TWICE = tuple(int(2 * m) for m in E2M1_MAGNITUDES)
assert all(2 * m == t for m, t in zip(E2M1_MAGNITUDES, _E2M1_TWICE))
E2M1_TWICE_WORDS = tuple(sum(t << 8 * i for i, t in enumerate(_E2M1_TWICE[w:w + 4])) for w in (0, 4))
E2M1_MIDPOINTS = tuple((a + b) / 2 for a, b in zip(E2M1_MAGNITUDES, E2M1_MAGNITUDES[1:]))
E2M1_TIE_UP = tuple(c % 2 == 1 for c in range(7))
UE4M3_MIN = ue4m3_value(1)  # 2^-9, the smallest positive scale
UE4M3_MAX = ue4m3_value(0x7E)  # 448
E2M1_EMAX = 2  # exponent of e2m1's largest power of two (OCP MX: the shared exponent offset)
NVFP4_MAX = E2M1_MAX * UE4M3_MAX  # 2688: the largest value an NVFP4 block holds
# the sm100 decode kernel's fp32 operand scales (Q per row, P per row and tile) map the
# largest |value| here: the top of the block format (bitdecode.emulate_sm100 says why)
OPERAND_TOP = {"nvfp4": NVFP4_MAX, "mxfp4": E2M1_MAX}
# ... and split each operand into this many FP4 terms, every term the previous terms'
# residual quantized again in the same blocks on the same fp32 operand scale, so the terms
# are block-scaled MMAs accumulating into one tensor-memory accumulator.  Relative L2 of
# the output against the reference on the emulation's six cases, 1 / 2 / 3 / 4 terms:
# 0.12-0.22 / 0.010-0.027 / 0.0015-0.0043 / 0.0002-0.0021 (16-bit Q and P: 0.0002-0.0023;
# profiles/NOTES.md, fifteenth session): four reach 16-bit operands' accuracy.
OPERAND_TERMS = 4


# --------------------------------------------------------------------------------------
# Scale factors in global memory (the basic chunk as 32-bit words)
# --------------------------------------------------------------------------------------

SF_CHUNK_WORDS = SF_ATOM_ROWS * SF_ATOM_COLS // 4  # one basic chunk: 512 bytes


def sf_chunk_word(row: int) -> int:
    """The 32-bit word of a basic chunk that holds row ``row``'s (0-127) four scale bytes,
    byte ``s`` = scale column ``s``: the chunk's byte ``16 (row % 32) + 4 (row // 32) + s``
    (``sf_offsets`` reads the same off the DSL's layout; a test checks them equal)."""
    if isinstance(row, int) and not 0 <= row < SF_ATOM_ROWS:  # (kernels pass traced values)
        raise ValueError(f"a basic chunk has rows 0..{SF_ATOM_ROWS - 1}, got {row}")
    return 4 * (row & 31) + (row >> 5)  # shifts and masks: kernels pass signed traced ints


def sf_location(row, col):
    """Where the scale of operand row ``row``, scale column ``col`` of a tile lives in its
    basic chunks: (row chunk, column chunk, word of the chunk, byte of the word).  Works on
    traced integers too (the kernels' indices)."""
    rows_log2, cols_log2 = SF_ATOM_ROWS.bit_length() - 1, SF_ATOM_COLS.bit_length() - 1
    return (row >> rows_log2, col >> cols_log2, sf_chunk_word(row & (SF_ATOM_ROWS - 1)), col & (SF_ATOM_COLS - 1))


def sf_chunks(cols: int) -> int:
    """Basic chunks across ``cols`` scale columns (4 per chunk; the last padded)."""
    return -(-cols // SF_ATOM_COLS)


def sf_row_chunks(rows: int) -> int:
    """Basic chunks down ``rows`` operand rows (128 per chunk; the last padded)."""
    return -(-rows // SF_ATOM_ROWS)


# --------------------------------------------------------------------------------------
# Derived sizes
# --------------------------------------------------------------------------------------


def query_tile_cols(group: int) -> int:
    """N columns for ``group`` query heads per KV head (K/V as the 128-row A operand)."""
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise ValueError(f"group must be a positive int, got {group!r}")
    return -(-group // UMMA_N_STEP) * UMMA_N_STEP


def sf_per_mma(fmt: str) -> int:
    """Scale factors per row that one MMA (K = 64) consumes: 4 for NVFP4, 2 for MXFP4."""
    return mma_shape(fmt, 128)[2] // SF_VEC[fmt]


def _check_sf_shape(fmt: str, rows: int, cols: int) -> None:
    _check_format(fmt)
    span = SF_VEC[fmt] * SF_ATOM_COLS
    if rows <= 0 or rows % SF_ATOM_ROWS or cols <= 0 or cols % span:
        raise ValueError(
            f"{fmt} scale factors tile {SF_ATOM_ROWS} rows x {span} values; pad the operand "
            f"to a multiple of that, got {rows} x {cols}"
        )


# --------------------------------------------------------------------------------------
# Kernel-side CuTe objects (call inside a @cute.jit trace for sm_100a)
# --------------------------------------------------------------------------------------


def make_blockscaled_mma(fmt: str, n: int):
    """cta_group::1 ``128 x n x 64`` block-scaled FP4 MMA (NVFP4: MXF4NVF4, MXFP4: MXF4)."""
    import cutlass
    import cutlass.utils.blackwell_helpers as blackwell
    from cutlass.cute.nvgpu import OperandMajorMode, tcgen05

    k = OperandMajorMode.K
    fp4 = cutlass.Float4E2M1FN
    return blackwell.make_blockscaled_trivial_tiled_mma(
        fp4, fp4, k, k, _sf_dtype(fmt), SF_VEC[fmt], tcgen05.CtaGroup.ONE, (UMMA_M, n)
    )


def make_f16_mma(dtype, n: int, m: int = UMMA_M):
    """cta_group::1 ``m x n x 16`` tcgen05 MMA on 16-bit operands (integer formats, dequantized)."""
    import cutlass
    import cutlass.utils.blackwell_helpers as blackwell
    from cutlass.cute.nvgpu import OperandMajorMode, tcgen05

    k = OperandMajorMode.K
    return blackwell.make_trivial_tiled_mma(
        dtype, dtype, k, k, cutlass.Float32, tcgen05.CtaGroup.ONE, (m, n)
    )


def make_operand_smem_layout(dtype, rows: int, cols: int, stages: int = 0):
    """K-major UMMA operand tile ``(rows, cols[, stages])``; swizzle goes on the pointer."""
    import cutlass.cute as cute
    import cutlass.utils.blackwell_helpers as blackwell
    from cutlass.cute.nvgpu import OperandMajorMode, tcgen05

    kind = blackwell.get_smem_layout_atom_ab(OperandMajorMode.K, dtype, (rows, cols))
    atom = tcgen05.make_smem_layout_atom(kind, dtype)
    shape = (rows, cols, stages) if stages else (rows, cols)
    return cute.tile_to_shape(atom, shape, (0, 1, 2) if stages else (0, 1))


def make_sf_layout(fmt: str, rows: int, cols: int):
    """Layout of the scale factors of a K-major ``rows x cols`` FP4 operand (global memory).

    ``((atom rows, row chunks), (values per scale x scale cols, col chunks), 1)``; the
    value mode has stride 0, so the layout maps each *value* to the byte of its scale.
    """
    import cutlass.utils.blockscaled_layout as blockscaled

    _check_sf_shape(fmt, rows, cols)
    return blockscaled.tile_atom_to_shape_SF((rows, cols, 1), SF_VEC[fmt])


def make_sf_smem_layouts(fmt: str, tiled_mma, mma_tiler, stages: int):
    """Staged shared-memory layouts of the A and B scale factors for ``mma_tiler``."""
    import cutlass.utils.blockscaled_layout as blockscaled

    _check_format(fmt)
    return (
        blockscaled.make_smem_layout_sfa(tiled_mma, mma_tiler, SF_VEC[fmt], stages),
        blockscaled.make_smem_layout_sfb(tiled_mma, mma_tiler, SF_VEC[fmt], stages),
    )


# --------------------------------------------------------------------------------------
# Tables (evaluated in an sm_100a trace, cached)
# --------------------------------------------------------------------------------------


@_traced
def mma_shape(fmt: str, n: int) -> Tuple[int, int, int]:
    """(M, N, K) of the block-scaled MMA atom for ``fmt`` with ``n`` columns."""
    _check_format(fmt)
    shape = make_blockscaled_mma(fmt, n).shape_mnk
    return tuple(int(x) for x in shape)


@_traced
def sf_offsets(fmt: str, rows: int, cols: int) -> Tuple[Tuple[int, ...], ...]:
    """``[row][s]`` = byte offset of the scale of values ``s*V .. s*V+V-1`` of ``row``.

    ``V = SF_VEC[fmt]``; read off ``tile_atom_to_shape_SF`` (checked: every value of the
    group maps to the same byte).
    """
    layout = make_sf_layout(fmt, rows, cols)
    vec = SF_VEC[fmt]
    out = []
    for r in range(rows):
        row = []
        for s in range(cols // vec):
            off = layout((r, s * vec, 0))
            assert layout((r, s * vec + vec - 1, 0)) == off, "a scale covers its whole group"
            row.append(off)
        out.append(tuple(row))
    return tuple(out)


@_traced
def sf_storage_bytes(fmt: str, rows: int, cols: int) -> int:
    """Bytes of scale-factor storage for a ``rows x cols`` operand (cosize of its layout)."""
    import cutlass.cute as cute

    return int(cute.cosize(cute.filter_zeros(make_sf_layout(fmt, rows, cols))))


@_traced
def operand_smem_offsets(dtype: str, rows: int, cols: int) -> Tuple[Tuple[int, ...], ...]:
    """Physical element offset of each (row, col) of a K-major UMMA operand tile.

    ``dtype``: ``"e2m1"`` (offsets in 4-bit units: byte ``o // 2``, nibble ``o % 2``),
    ``"fp16"`` or ``"bf16"`` (16-bit units).
    """
    layout = make_operand_smem_layout(_dtype(dtype), rows, cols)
    return sm90.pointer_swizzled_offsets(layout, rows, cols, ELEM_BITS[dtype])


@_traced
def swizzle_of(dtype: str, rows: int, cols: int) -> Tuple[int, int, int]:
    """(bits, base, shift) of the byte-address swizzle of a K-major UMMA operand tile."""
    sw = make_operand_smem_layout(_dtype(dtype), rows, cols).inner
    return (sw.num_bits, sw.num_base, sw.num_shift)


# --------------------------------------------------------------------------------------
# The decode kernel's operand tiles (K / V as A, Q / P as B) and their byte addresses
# --------------------------------------------------------------------------------------


def mma_operand_layout(mma, tiler, dtype, operand: str, stages: int = 1):
    """The smem layout tcgen05 reads operand ``"a"`` or ``"b"`` of ``mma`` from for the
    ``(M, N, K)`` ``tiler`` (``blackwell_helpers.make_smem_layout_a/b``): what the MMA
    descriptors and the TMA boxes are built from.  ``((rows, K_inst), MMA_M|N, MMA_K, stages)``."""
    import cutlass.utils.blackwell_helpers as blackwell

    make = blackwell.make_smem_layout_a if operand == "a" else blackwell.make_smem_layout_b
    return make(mma, tiler, dtype, stages)


def rows_cols_bytes(layout, dtype):
    """One stage of an ``mma_operand_layout`` seen as ``(row, byte column) -> byte offset``,
    its swizzle applied (call in a trace; traced coordinates work): the sm100 decode kernel
    writes Q and P (e2m1 words, 16-bit values) and the 16-bit residual tiles through it, so
    what it writes is what the MMA reads by construction."""
    import cutlass.cute as cute

    outer = cute.slice_(layout.outer, (None, None, None, 0)) if cute.rank(layout.outer) == 4 else layout.outer
    s, d = outer.shape, outer.stride
    rows_cols = cute.make_layout(((s[0][0], s[1]), (s[0][1], s[2])), stride=((d[0][0], d[1]), (d[0][1], d[2])))
    return cute.make_composed_layout(layout.inner, 0, cute.recast_layout(8, dtype.width, rows_cols))


@_traced
def mma_operand_bytes(dtype: str, fmt: str, operand: str, rows: int, cols: int, n: int) -> Tuple[Tuple[int, ...], ...]:
    """``[row][byte column]`` of ``rows_cols_bytes`` for operand ``"a"`` (``rows`` x ``cols``,
    M x K) or ``"b"`` (``rows`` = N query columns) of the block-scaled MMA of ``fmt``
    (``dtype`` ``"e2m1"``) or of the 16-bit MMA (a table for the tests)."""
    dt = _dtype(dtype)
    mma = make_blockscaled_mma(fmt, n) if dtype == "e2m1" else make_f16_mma(dt, n)
    tiler = (rows, n, cols) if operand == "a" else (UMMA_M, rows, cols)
    layout = rows_cols_bytes(mma_operand_layout(mma, tiler, dt, operand), dt)
    width = cols * ELEM_BITS[dtype] // 8
    return tuple(tuple(int(layout((r, c))) for c in range(width)) for r in range(rows))
