"""CPU tests of ``layouts/`` (sm80, sm90, sm100) and of ``bitdecode layout``.

The checks are written from the PTX ISA, independently of ``layouts/``: closed forms of the
m16n8k16 and wgmma fragments, of the ldmatrix / stmatrix distributions, of the 32/64/128B
shared-memory swizzles and of the tcgen05 scale-factor chunk.  The decode path is emulated
per lane with integer bit operations (ldmatrix of the swizzled packed tile -> the lane's
word -> the lop3 steps of ``layouts.packing`` -> fp16/bf16 -> (scale, zero) fetched in
fragment order) and must give exactly the values each lane's MMA fragment holds.
"""

from __future__ import annotations

import math
import re
import xml.etree.ElementTree as ET

import pytest
import torch

from bitdecode import cli, reference
from bitdecode.formats import KVFormat
from bitdecode.layouts import packing, sm80, sm90, sm100

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
BANKS = 32


# --------------------------------------------------------------------------------------
# Closed forms from the PTX ISA
# --------------------------------------------------------------------------------------


def ptx_mma_a(lane):
    """mma.m16n8k16 .f16/.bf16 A (16 x 16): registers a0..a7 -> (row, col)."""
    g, t = divmod(lane, 4)
    return [(g + 8 * ((i >> 1) & 1), 2 * t + (i & 1) + 8 * (i >> 2)) for i in range(8)]


def ptx_mma_b(lane):
    """B (16 x 8): registers b0..b3 -> (k row, n col)."""
    g, t = divmod(lane, 4)
    return [(2 * t + (i & 1) + 8 * (i >> 1), g) for i in range(4)]


def ptx_mma_c(lane):
    """C / D (16 x 8, f32): registers c0..c3 -> (row, col)."""
    g, t = divmod(lane, 4)
    return [(g + 8 * (i >> 1), 2 * t + (i & 1)) for i in range(4)]


def ptx_wgmma_a(thread):
    """wgmma .f16/.bf16 A from registers (64 x 16): warp w holds rows 16w.. like m16n8k16."""
    w, lane = divmod(thread, 32)
    return [(16 * w + r, c) for r, c in ptx_mma_a(lane)]


def ptx_wgmma_d(thread, n):
    """wgmma f32 accumulator (64 x n): d_i -> (row, col)."""
    w, lane = divmod(thread, 32)
    g, t = divmod(lane, 4)
    return [(16 * w + g + 8 * ((i >> 1) & 1), 8 * (i >> 2) + 2 * t + (i & 1)) for i in range(n // 2)]


def ptx_ldmatrix_element(lane):
    """ldmatrix / stmatrix .x4 .b16 (non-trans): for every matrix i, lane gets (row, col, col+1)."""
    return lane // 4, 2 * (lane % 4)


def swizzle_bytes(addr: int, bits: int) -> int:
    """The 32/64/128-byte swizzle (Swizzle<bits, 4, 3>) on a byte address."""
    return addr ^ (((addr >> 7) & ((1 << bits) - 1)) << 4)


def canonical_kmajor(r: int, c: int, rows: int, row_bytes: int, elem_bits: int) -> int:
    """Physical element offset of (r, c) in the K-major canonical (TMA / GMMA / UMMA) tile.

    Atoms of 8 rows x min(128, row_bytes) bytes, swizzled with log2(atom row / 16) bits,
    stacked along the rows first, then along the columns.
    """
    atom_bytes_row = min(128, row_bytes)
    bits = int(math.log2(atom_bytes_row // 16))
    byte_col = c * elem_bits // 8
    atom = (byte_col // atom_bytes_row) * (rows // 8) + r // 8
    inside = (r % 8) * atom_bytes_row + byte_col % atom_bytes_row
    phys = atom * 8 * atom_bytes_row + swizzle_bytes(inside, bits)
    sub = (c * elem_bits % 8) // elem_bits if elem_bits < 8 else 0
    return phys * 8 // elem_bits + sub


def sf_chunk_offset(m: int, s: int, sf_cols: int) -> int:
    """tcgen05 scale-factor layout: 128 x 4 chunks of 512 bytes, scale columns fastest."""
    chunk = (m // 128) * (sf_cols // 4) + s // 4
    return chunk * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + s % 4


def bank_wavefronts(byte_addrs) -> int:
    """Extra wavefronts of one phase of 16-byte accesses (0 = conflict-free)."""
    count = [0] * BANKS
    for a in byte_addrs:
        assert a % 16 == 0, "16-byte accesses must be 16-byte aligned"
        for k in range(4):
            count[(a // 4 + k) % BANKS] += 1
    return max(count) - 1


def chunk_addrs(offsets, elem_bits=16):
    """Byte address of every 16-byte chunk of every row of an offsets table (checks contiguity)."""
    per = 128 // elem_bits
    out = []
    for row in offsets:
        line = []
        for q in range(len(row) // per):
            first = row[q * per]
            assert list(row[q * per:(q + 1) * per]) == list(range(first, first + per)), "chunk not contiguous"
            line.append(first * elem_bits // 8)
        out.append(line)
    return out


def is_permutation(values, n):
    return sorted(values) == list(range(n))


def flat(table):
    return [x for row in table for x in row]


# --------------------------------------------------------------------------------------
# sm80 tables against the PTX ISA, and bijections
# --------------------------------------------------------------------------------------


def test_sm80_fragments_match_ptx():
    for lane in range(32):
        assert list(sm80.fragment("a")[lane]) == ptx_mma_a(lane)
        assert list(sm80.fragment("b")[lane]) == [(n, k) for k, n in ptx_mma_b(lane)]
        assert list(sm80.fragment("c")[lane]) == ptx_mma_c(lane)
        assert sm80.ldmatrix_lane_word()[lane] == (lane // 4, lane % 4)
    assert sm80.fragment_columns() == tuple((2 * c, 2 * c + 1, 2 * c + 8, 2 * c + 9) for c in range(4))


@pytest.mark.parametrize("tokens", [4, 8, 13, 16])
def test_small_m_gemm_words_make_the_product(tokens):
    """The small-M GEMM's data movement (``kernels_sm80.dense.GemmSmallMSm80``), emulated
    with the m16n8k16 atom's own fragment tables: each lane's 16-byte loads of two weight
    rows and of its token's x, placed in the A / B registers as ``small_m_slots`` says, two
    MMAs a 32-wide chunk, and the accumulator values read back as (row, token) give W x^T."""
    from bitdecode.layouts import dense

    a_slots, b_slots, c_slots = dense.small_m_slots()
    fa, fb, fc = sm80.fragment("a"), sm80.fragment("b"), sm80.fragment("c")
    gen = torch.Generator().manual_seed(tokens)
    chunks, rows, tile = 3, dense.SMALL_M_ROWS, dense.SMALL_M_TOKEN_TILE
    w = torch.randn(rows, chunks * dense.SMALL_M_CHUNK, generator=gen, dtype=torch.float64)
    x = torch.randn(tokens, chunks * dense.SMALL_M_CHUNK, generator=gen, dtype=torch.float64)
    tiles = -(-tokens // tile)
    got = torch.zeros(tokens, rows, dtype=torch.float64)
    for t in range(tiles):
        d = torch.zeros(rows, tile, dtype=torch.float64)  # the accumulator tile (rows m, tokens n)
        for chunk in range(chunks):
            for q in range(2):
                a = torch.full((rows, 16), float("nan"), dtype=torch.float64)
                b = torch.full((tile, 16), float("nan"), dtype=torch.float64)
                for lane in range(32):
                    g, c = divmod(lane, 4)
                    k0 = chunk * dense.SMALL_M_CHUNK + dense.VEC * c

                    def word(row_values, index):  # the two 16-bit values of loaded word ``index``
                        return row_values[k0 + 2 * index], row_values[k0 + 2 * index + 1]

                    tok = min(tile * t + g, tokens - 1)
                    for r, (half, ch) in enumerate(a_slots):
                        for e, value in enumerate(word(w[g + 8 * half], 2 * q + ch)):
                            a[fa[lane][2 * r + e]] = value
                    for r, ch in enumerate(b_slots):
                        for e, value in enumerate(word(x[tok], 2 * q + ch)):
                            b[fb[lane][2 * r + e]] = value
                assert not a.isnan().any() and not b.isnan().any(), "every register of the atom is filled"
                d += a @ b.T
        for lane in range(32):
            g, c = divmod(lane, 4)
            for v, (half, off) in enumerate(c_slots):
                tok = tile * t + 2 * c + off
                if tok < tokens:
                    got[tok, g + 8 * half] = d[fc[lane][v]]
    assert torch.allclose(got, x @ w.T)


def test_sm80_fragment_column_and_params():
    """The closed forms the kernels index with agree with the traced fragment: quad lane c's
    columns of k-block kb, the (scale, zero) word of each, and the head columns a thread
    holds of an accumulator."""
    cols = sm80.fragment_columns()
    for kb in range(3):
        for c in range(4):
            for half in range(2):
                first = sm80.fragment_column(kb, c, half)
                assert (first - 16 * kb, first + 1 - 16 * kb) == cols[c][2 * half: 2 * half + 2]
                # the pair's words are param_position(kb, c, 2 half) and the one after
                assert sm80.param_position(kb, c, 2 * half) + 1 == sm80.param_position(kb, c, 2 * half + 1)
    for nh in sm80.HEADS_TILES:
        per_lane = {8 * nt + 2 * (lane % 4) + v for lane in range(4) for nt in range(nh // 8) for v in range(2)}
        assert len(per_lane) == nh and sm80.head_columns(nh) == 2 * (nh // 8)


def test_sm80_packed_ldmatrix_copy_matches_ptx():
    """The kernel's tiled ldmatrix copy: lane 4g+c receives word c of rows g + 8i."""
    from bitdecode.layouts._trace import evaluate

    def build():
        import cutlass
        import cutlass.cute as cute

        copy = sm80.make_packed_ldmatrix_copy(cutlass.Float16)
        ident = cute.make_identity_tensor((32, 8))
        out = []
        for lane in range(32):
            d = copy.get_slice(lane).partition_D(ident)
            out.append(sorted((d[i][0], d[i][1]) for i in range(cute.size(d))))
        return out

    got = evaluate(build)
    for lane in range(32):
        row, col = ptx_ldmatrix_element(lane)
        assert got[lane] == sorted((row + 8 * i, col + e) for i in range(4) for e in range(2))


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("length", [64, 128, 256])
def test_packed_row_map_is_a_bijection(bits, length):
    table = sm80.packed_row_map(bits, length)
    f = packing.codes_per_word(bits)
    words = length * bits // 32
    assert sorted(table) == sorted((w, bits * fld) for w in range(words) for fld in range(f))
    elements = sm80.word_elements(bits, length)
    assert is_permutation(flat(elements), length)
    for w, cols in enumerate(elements):
        for e, col in enumerate(cols):
            assert table[col] == (w, packing.shift_of_element(bits, e))


@pytest.mark.parametrize("length", [16, 64, 128, 256])
def test_fragment_order_is_a_permutation(length):
    order = sm80.fragment_order(length)
    assert is_permutation(order, length)
    for p, col in enumerate(order):  # position 16kt + 4c + v holds column 16kt + (2c, 2c+1, 2c+8, 2c+9)[v]
        kt, c, v = p // 16, (p % 16) // 4, p % 4
        assert col == 16 * kt + 2 * c + (v & 1) + 8 * (v >> 1)


def test_interleave_and_dequant_constants():
    assert packing.interleave(4) == (7, 5, 3, 1, 6, 4, 2, 0)
    for bits in (4, 2):
        f = packing.codes_per_word(bits)
        assert is_permutation([packing.field_of_element(bits, e) for e in range(f)], f)
        for dtype in DTYPES:
            steps = packing.dequant_steps(bits, dtype)
            assert [s.pair for s in steps] == list(range(f // 2))
    fp16_4 = packing.dequant_steps(4, "fp16")
    assert [(s.shift, s.mask, s.magic) for s in fp16_4] == [
        (0, 0x000F000F, 0x64006400), (0, 0x00F000F0, 0x64006400),
        (8, 0x000F000F, 0x64006400), (8, 0x00F000F0, 0x64006400)]


@pytest.mark.parametrize("bits", [4, 2])
def test_field_of_element_refuses_an_element_outside_the_word(bits):
    for bad in (-1, packing.codes_per_word(bits)):
        with pytest.raises(ValueError, match=r"^element must be in \[0, "):
            packing.field_of_element(bits, bad)


@pytest.mark.parametrize("bits", [4, 2])
def test_dequant_steps_recover_every_code(bits):
    """Each step's own ``fix_scale`` / ``fix_bias`` (the kernels' fma constants) and the
    subnormal form (no magic: ``code << offset`` read times 2^-SUBNORMAL_LOG2, at most
    ``room`` bits above the code) give back the codes of a word exactly."""
    f = packing.codes_per_word(bits)
    codes = torch.randint(0, 1 << bits, (512, f), generator=torch.Generator().manual_seed(bits))
    words = sum(codes[:, e] << packing.shift_of_element(bits, e) for e in range(f))

    for dtype, tdt in DTYPES.items():
        for s in packing.dequant_steps(bits, dtype):
            q = bits16_to(tdt, word_halves(((words >> s.shift) & s.mask) | s.magic)).double()
            assert torch.equal(q * s.fix_scale + s.fix_bias(dtype), codes[:, [2 * s.pair, 2 * s.pair + 1]].double())
    assert packing.SUBNORMAL_LOG2 == {"fp16": 24, "bf16": 133}  # 2^-24: fp16's smallest subnormal
    for room in (bits, bits + 2):
        for s in packing.dequant_steps(bits, "fp16", room, subnormal=True):
            assert s.magic == 0 and s.mult <= 2 ** (room - bits)
            t = (words >> s.shift) & s.mask
            q = bits16_to(torch.float16, word_halves(t)).double() * 2.0 ** packing.SUBNORMAL_LOG2["fp16"] / s.mult
            assert torch.equal(q, codes[:, [2 * s.pair, 2 * s.pair + 1]].double())


def _prmt(a: int, b: int, selector: int) -> int:
    """PTX ``prmt.b32`` (default mode): byte i of the result is byte ``selector``'s nibble i
    of the pair (b:a)."""
    pool = (b << 32) | a
    return sum(((pool >> 8 * ((selector >> 4 * i) & 7)) & 0xFF) << 8 * i for i in range(4))


def test_prmt_selectors_gather_the_params_halves():
    a, b = 0xA1A2A3A4, 0xB1B2B3B4  # two params words: (scale, zero) = (lo, hi)
    assert _prmt(a, b, packing.PRMT_LOW_HALVES) == 0xB3B4A3A4  # the two scales
    assert _prmt(a, b, packing.PRMT_HIGH_HALVES) == 0xB1B2A1A2  # the two zeros
    assert _prmt(a, b, packing.PRMT_LOW_BROADCAST) == 0xA3A4A3A4
    assert _prmt(a, b, packing.PRMT_HIGH_BROADCAST) == 0xA1A2A1A2
    for p, sel in enumerate(packing.PRMT_BYTE_PAIR):
        ab, bb = (a >> 8 * p) & 0xFF, (b >> 8 * p) & 0xFF
        assert _prmt(a, b, sel) == ab | ab << 8 | bb << 16 | bb << 24


@pytest.mark.parametrize("dtype, bf16", [(torch.float16, False), (torch.bfloat16, True)])
def test_nan_params_are_the_references_bytes(dtype, bf16):
    """A group with a NaN inside gets the (scale, zero) bytes the kernels write (``nan16``)."""
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    x[0, 3] = float("nan")
    _, scale, zero = reference.quantize(x, 4, 64, check_finite=False)
    for t in (scale, zero):
        assert t[0, 0].view(torch.int16).item() & 0xFFFF == packing.nan16(bf16)
        assert not t[1, 0].isnan()


def test_residual_block():
    for bits, nr in ((4, 128), (2, 256)):
        assert sm80.residual_block(bits) == nr == 4 * 8 * (16 // bits)
        assert KVFormat(bits=bits).residual_block == nr
        assert sm80.tokens_per_warp(bits) == nr // 4 == sm80.chunk_columns(bits)
        assert sm90.block_tokens(bits) == nr


# --------------------------------------------------------------------------------------
# Emulation of the decode path (ldmatrix -> lop3 dequant -> fragments), per lane
# --------------------------------------------------------------------------------------


def bits16_to(dtype, pattern: torch.Tensor) -> torch.Tensor:
    """Reinterpret 16-bit patterns (0..65535 in an int64 tensor) as fp16 / bf16."""
    signed = torch.where(pattern >= 32768, pattern - 65536, pattern).to(torch.int16)
    return signed.view(dtype)


def word_halves(t: torch.Tensor) -> torch.Tensor:
    """The (low, high) 16-bit halves of 32-bit words, on a new last dim."""
    return torch.stack([t & 0xFFFF, (t >> 16) & 0xFFFF], dim=-1)


def write_smem(tile_words: torch.Tensor, offsets) -> torch.Tensor:
    """cp.async of a packed tile (rows of int32 words) into swizzled smem: 16-bit cells."""
    w = tile_words.long() & 0xFFFFFFFF
    halves = word_halves(w).reshape(w.shape[0], -1)  # 16-bit col 2k, 2k+1
    phys = torch.tensor(offsets, dtype=torch.long)
    assert phys.shape == halves.shape
    smem = torch.full((phys.numel(),), -1, dtype=torch.long)
    smem[phys.flatten()] = halves.flatten()
    assert (smem >= 0).all(), "the smem layout is not a bijection onto the tile"
    return smem


def ldmatrix_x4(smem: torch.Tensor, offsets, loads) -> torch.Tensor:
    """words[load, lane, i] of ldmatrix.x4: lane 8i+r addresses row row0+8i+r at the 16-byte chunk."""
    addr = torch.tensor([[[offsets[row0 + 8 * i + r][8 * chunk] for r in range(8)] for i in range(4)]
                         for row0, chunk in loads])  # [load, matrix i, row r] (lane 8i + r)
    assert (addr % 8 == 0).all(), "ldmatrix row addresses must be 16-byte aligned"
    lane = torch.arange(32)
    row, col = lane // 4, 2 * (lane % 4)  # ptx_ldmatrix_element
    a = addr[:, :, row].transpose(1, 2) + col[None, :, None]  # [load, lane, i]
    return smem[a] | (smem[a + 1] << 16)


def dequant_codes(words: torch.Tensor, bits: int, dtype: str) -> torch.Tensor:
    """codes[..., p, e] of element pair p, half e, by the lop3 steps, as exact 16-bit floats."""
    tdt = DTYPES[dtype]
    out = []
    for step in packing.dequant_steps(bits, dtype):
        t = ((words >> step.shift) & step.mask) | step.magic
        magic = bits16_to(tdt, torch.tensor([step.magic & 0xFFFF])).double()
        q = (bits16_to(tdt, word_halves(t)).double() - magic) / step.mult
        assert torch.equal(q, q.round()) and q.min() >= 0 and q.max() < (1 << bits)
        out.append(q)
    return torch.stack(out, dim=-2)


def param_pair(words: torch.Tensor, dtype):
    w = words.long() & 0xFFFFFFFF
    return bits16_to(dtype, w & 0xFFFF).double(), bits16_to(dtype, w >> 16).double()


PTX_A = torch.tensor([ptx_mma_a(lane) for lane in range(32)])  # [lane, reg, (row, col)]
PTX_B = torch.tensor([ptx_mma_b(lane) for lane in range(32)])  # [lane, reg, (k, n)]


def lane_positions(bits: int, view: str):
    """Where register pair p, half e of the word from matrix i lands, per lane (PTX closed form).

    Returns (row in the 32-row load, column in the chunk, kb, ch, e, t) over [lane, i, p, e].
    Kernel convention: A pair (h, ch) of m-tile mt / k-tile kt <- word of row 16mt+8h+g,
    pair 2*(kt % kpw) + ch; B pair ch of n-tile nt <- word of row 8nt+g, same pair.
    """
    pairs = packing.codes_per_word(bits) // 2
    lane, i, p, e = torch.meshgrid(torch.arange(32), torch.arange(4), torch.arange(pairs), torch.arange(2),
                                   indexing="ij")
    kb, ch = p // 2, p % 2
    if view == "a":
        reg = 2 * (i % 2) + 4 * ch + e
        row = 16 * (i // 2) + PTX_A[lane, reg, 0]
        col = 16 * kb + PTX_A[lane, reg, 1]
    else:
        reg = 2 * ch + e
        row = 8 * i + PTX_B[lane, reg, 1]
        col = 16 * kb + PTX_B[lane, reg, 0]
    assert torch.equal(row, 8 * i + lane // 4), "a register's row is the row its word came from"
    return row, col, kb, ch, e, lane % 4


def emulate_tile(words_tile, bits, dtype, view, loads, fetch_params, swizzle_offsets):
    """Run the decode path on one packed tile; returns got[row, col] as int16 bit patterns.

    ``fetch_params(row, col, t, kt, ch, e)`` -> (scale, zero) the way the kernel fetches
    them; ``view`` "a" (tile rows = MMA M rows) or "b" (tile rows = the N side).
    """
    tdt = DTYPES[dtype]
    rows = words_tile.shape[0]
    length = words_tile.shape[1] * 32 // bits
    kpw = packing.codes_per_word(bits) // 4
    smem = write_smem(words_tile, swizzle_offsets)
    codes = dequant_codes(ldmatrix_x4(smem, swizzle_offsets, loads), bits, dtype)  # [load, lane, i, p, e]
    row_rel, col_rel, kb, ch, e, t = lane_positions(bits, view)
    row0 = torch.tensor([r for r, _ in loads]).view(-1, 1, 1, 1, 1)
    chunk = torch.tensor([j for _, j in loads]).view(-1, 1, 1, 1, 1)
    row, kt = row0 + row_rel, kpw * chunk + kb
    col = 16 * kpw * chunk + col_rel
    s, z = fetch_params(row, col, t.expand_as(row), kt, ch.expand_as(row), e.expand_as(row))
    x = (codes * s + z).to(tdt).view(torch.int16).long()
    got = torch.full((rows, length), -(1 << 20), dtype=torch.long)
    seen = torch.zeros(rows, length, dtype=torch.long)
    got.index_put_((row.flatten(), col.flatten()), x.flatten())
    seen.index_put_((row.flatten(), col.flatten()), torch.ones(row.numel(), dtype=torch.long), accumulate=True)
    assert torch.equal(seen, torch.ones_like(seen)), "every fragment value produced exactly once"
    return got


def expect_bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int16).long()


def k_loads(rows, length, bits):
    return [(r, j) for r in range(0, rows, 32) for j in range(length // sm80.chunk_columns(bits))]


K_CASES = [("channel", 32), ("channel", 128), ("token", 32)]


@pytest.mark.parametrize("view", ["a", "b"])
@pytest.mark.parametrize("k_mode,group", K_CASES)
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("bits", [4, 2])
def test_decode_emulation_k(bits, dtype, k_mode, group, view):
    gen = torch.Generator().manual_seed(bits * 100 + group)
    n, d = 128, 128
    fmt = KVFormat(bits=bits, k_mode=k_mode, group_size=group)
    k = (torch.randn(n, d, generator=gen) * 3).to(DTYPES[dtype])
    k_pack, k_params = reference.pack_k(k, fmt)
    dim = -2 if k_mode == "channel" else -1
    codes, scale, zero = reference.quantize(k, bits, group, dim=dim)
    expected = reference.dequantize(codes, scale, zero, group, dim=dim)

    def fetch(row, col, t, kt, ch, e):
        if k_mode == "channel":  # fragment order: the lane's 4 pairs of k block kt at 16kt + 4t
            word = k_params[row // group, 16 * kt + 4 * t + 2 * ch + e]
        else:
            word = k_params[row, col // group]
        return param_pair(word, DTYPES[dtype])

    offsets = sm80.smem_offsets(n, d * bits // 8)
    got = emulate_tile(k_pack, bits, dtype, view, k_loads(n, d, bits), fetch, offsets)
    assert torch.equal(got, expect_bits(expected))


@pytest.mark.parametrize("view", ["a", "b"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("bits", [4, 2])
def test_decode_emulation_v(bits, dtype, view):
    gen = torch.Generator().manual_seed(7 + bits)
    fmt = KVFormat(bits=bits, group_size=32)
    nr, d, blocks = fmt.residual_block, 64, 2
    v = (torch.randn(blocks * nr, d, generator=gen) * 2).to(DTYPES[dtype])
    v_pack, v_params = reference.pack_v(v, fmt)
    assert v_pack.shape == (blocks, d, nr * bits // 32)
    codes, scale, zero = reference.quantize(v, bits, 32, dim=-1)
    expected = reference.dequantize(codes, scale, zero, 32, dim=-1)
    offsets = sm80.smem_offsets(d, nr * bits // 8)
    for b in range(blocks):
        def fetch(row, col, t, kt, ch, e):  # row = channel, col = token of the block
            return param_pair(v_params[(b * nr) // 16 + kt, row // 32, 4 * t + 2 * ch + e], DTYPES[dtype])

        # warp w of the decode kernel owns chunk w = tokens [w*T, (w+1)*T)
        loads = [(r, w) for w in range(sm80.WARPS_N) for r in range(0, d, 32)]
        got = emulate_tile(v_pack[b], bits, dtype, view, loads, fetch, offsets)
        assert torch.equal(got, expect_bits(expected[b * nr:(b + 1) * nr].T))


# --------------------------------------------------------------------------------------
# Shared-memory swizzles: closed forms and bank conflicts
# --------------------------------------------------------------------------------------

PACKED_K_ROW_BYTES = sorted({d * b // 8 for d in (64, 128, 256) for b in (4, 2)})  # 16 .. 128
PACKED_V_ROW_BYTES = [64]
HALF_ROW_BYTES = [2 * d for d in (64, 128, 256)]
ALL_ROW_BYTES = sorted(set(PACKED_K_ROW_BYTES + PACKED_V_ROW_BYTES + HALF_ROW_BYTES))
SWIZZLE_ROWS = 32  # four periods of every swizzle (they repeat every 8 rows)


def ldmatrix_phases(addrs):
    """8 row addresses of one 8x8 tile: rows r0..r0+7 (r0 % 8 == 0) at one chunk."""
    for r0 in range(0, len(addrs), 8):
        for q in range(len(addrs[0])):
            yield [addrs[r0 + r][q] for r in range(8)]


def cpasync_phases(addrs):
    """8 consecutive 16-byte chunks of the tile in row-major order."""
    seq = flat(addrs)
    for i in range(0, len(seq), 8):
        yield seq[i:i + 8]


@pytest.mark.parametrize("row_bytes", ALL_ROW_BYTES)
def test_sm80_swizzle_conflict_free(row_bytes):
    rows = SWIZZLE_ROWS
    offsets = sm80.smem_offsets(rows, row_bytes)
    cols = row_bytes // 2
    assert is_permutation(flat(offsets), rows * cols)
    for r in range(rows):
        for c in range(cols):
            assert offsets[r][c] == canonical_kmajor(r, c, rows, row_bytes, 16)
    addrs = chunk_addrs(offsets)
    assert all(bank_wavefronts(p) == 0 for p in ldmatrix_phases(addrs))
    assert all(bank_wavefronts(p) == 0 for p in cpasync_phases(addrs))


@pytest.mark.parametrize("row_bytes", ALL_ROW_BYTES)
def test_sm90_packed_tiles_equal_sm80(row_bytes):
    assert sm90.packed_smem_offsets(SWIZZLE_ROWS, row_bytes) == sm80.smem_offsets(SWIZZLE_ROWS, row_bytes)


@pytest.mark.parametrize("row_bytes", ALL_ROW_BYTES)
def test_sm90_wide_packed_tiles(row_bytes):
    """The packed tile seen through a wide (128-byte-row) TMA box: each (row, col) is where
    the box puts that row's bytes (row // fold, (row % fold) * cols + col of the box), the
    box is the 128-byte swizzle of its rows, and ldmatrix stays conflict-free."""
    rows, cols = 128, row_bytes // 2
    fold = sm90.packed_fold(rows, row_bytes, True)
    assert fold == max(1, 128 // row_bytes) and fold * row_bytes >= 128
    view = sm90.packed_smem_offsets(rows, row_bytes, True)
    box = sm90.packed_tma_offsets(rows, row_bytes, True)
    assert len(box) == rows // fold and all(len(line) == fold * cols for line in box)
    for r in range(rows):
        assert view[r] == box[r // fold][(r % fold) * cols:(r % fold + 1) * cols]
    wide_bytes = fold * row_bytes
    for w in range(rows // fold):
        for c in range(fold * cols):
            assert box[w][c] == canonical_kmajor(w, c, rows // fold, wide_bytes, 16)
    if fold == 1:  # nothing to fold: the narrow box
        assert view == sm90.packed_smem_offsets(rows, row_bytes)
    assert all(bank_wavefronts(p) == 0 for p in ldmatrix_phases(chunk_addrs(view)))
    assert sorted(flat(view)) == list(range(rows * cols)), "the view covers the tile once"


def test_sm90_packed_fold_needs_whole_periods():
    assert sm90.packed_fold(128, 64, True) == 2 and sm90.packed_fold(128, 32, True) == 4
    assert sm90.packed_fold(128, 16, True) == 8
    assert sm90.packed_fold(32, 16, True) == 1  # 4 wide rows: less than the 128-byte swizzle's 8
    assert sm90.packed_fold(128, 128, True) == sm90.packed_fold(128, 256, True) == 1
    assert sm90.packed_fold(128, 64) == 1  # narrow boxes, the default of every packed-tile helper


@pytest.mark.parametrize("cols", [64, 128, 256])
def test_sm90_operand_tiles(cols):
    rows = 32
    offsets = sm90.operand_smem_offsets(rows, cols)
    assert is_permutation(flat(offsets), rows * cols)
    for r in range(rows):
        for c in range(cols):
            assert offsets[r][c] == canonical_kmajor(r, c, rows, 2 * cols, 16)
    assert sm90.swizzle_of(rows, cols) == (3, 4, 3)  # 128B swizzle for every 16-bit tile used
    addrs = chunk_addrs(offsets)
    assert all(bank_wavefronts(p) == 0 for p in ldmatrix_phases(addrs))  # stmatrix phases


@pytest.mark.parametrize("cols", [64, 128, 256])
def test_sm100_e2m1_tiles(cols):
    rows = 16
    offsets = sm100.operand_smem_offsets("e2m1", rows, cols)
    assert is_permutation(flat(offsets), rows * cols)
    for r in range(rows):
        for c in range(cols):
            assert offsets[r][c] == canonical_kmajor(r, c, rows, cols // 2, 4)
    addrs = chunk_addrs(offsets, elem_bits=4)
    assert all(bank_wavefronts(p) == 0 for p in cpasync_phases(addrs))


def test_sm100_16bit_tiles_equal_sm90():
    for cols in (64, 128, 256):
        assert sm100.operand_smem_offsets("fp16", 16, cols) == sm90.operand_smem_offsets(16, cols)


# --------------------------------------------------------------------------------------
# sm90: wgmma fragments, stmatrix, and the dequant -> stmatrix -> smem path
# --------------------------------------------------------------------------------------


def test_sm90_fragments_match_ptx():
    a = sm90.wgmma_fragment("a")
    assert is_permutation([r * 16 + c for vals in a for r, c in vals], 64 * 16)
    for n in (64,):  # the accumulator pattern repeats every 8 columns
        d = sm90.wgmma_fragment("c", n)
        assert is_permutation([r * n + c for vals in d for r, c in vals], 64 * n)
        for t in range(128):
            assert list(d[t]) == ptx_wgmma_d(t, n)
    for n in (64, 128, 256):  # what the BitNet GEMM's epilogue takes once per row / per column
        d = sm90.wgmma_fragment("c", n)
        for t in range(128):
            for i, (r, c) in enumerate(d[t]):
                assert d[t][sm90.acc_row_value(i)][0] == r and d[t][sm90.acc_col_value(i)][1] == c
    for t in range(128):
        assert list(a[t]) == ptx_wgmma_a(t)
    stsm = sm90.stsm_fragment()
    assert is_permutation([r * 16 + c for vals in stsm for r, c in vals], 256)
    for lane in range(32):
        assert list(stsm[lane]) == ptx_mma_a(lane)
    addrs = sm90.stsm_row_addresses()
    # register pair q = h + 2ch of the A fragment goes to matrix q; matrix q's rows come from lanes 8q..8q+7
    for q in range(4):
        h, ch = q % 2, q // 2
        for rr in range(8):
            assert addrs[8 * q + rr] == (8 * h + rr, 8 * ch)
    assert sm90.query_tile_rows(1) == 64 and sm90.query_tile_rows(8) == 64 and sm90.query_tile_rows(65) == 128


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("operand", ["k", "v"])
def test_sm90_warp_loads_cover_the_tile(bits, operand):
    for d in (64, 128, 256):
        rows, length = sm90.tile_shape(bits, operand, d)
        loads = [ld for w in sm90.warp_loads(bits, operand, d) for ld in w]
        chunks = length // sm80.chunk_columns(bits)
        assert sorted(loads) == sorted((r, j) for r in range(0, rows, 32) for j in range(chunks))


@pytest.mark.parametrize("operand", ["k", "v"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("bits", [4, 2])
def test_sm90_dequant_stmatrix_emulation(bits, dtype, operand):
    """ldmatrix -> lop3 -> A fragments -> stmatrix (PTX) -> the K-major tile wgmma reads."""
    tdt = DTYPES[dtype]
    gen = torch.Generator().manual_seed(11 * bits)
    fmt = KVFormat(bits=bits, k_mode="token", group_size=32)
    nr, d = fmt.residual_block, 64
    x = (torch.randn(nr, d, generator=gen) * 2).to(tdt)
    codes, scale, zero = reference.quantize(x, bits, 32, dim=-1)
    deq = reference.dequantize(codes, scale, zero, 32, dim=-1)  # [tokens, D]
    if operand == "k":
        words, expected = reference.pack_k(x, fmt)[0], deq
    else:
        words, expected = reference.pack_v(x, fmt)[0][0], deq.T
    rows, length = sm90.tile_shape(bits, operand, d)
    assert expected.shape == (rows, length)
    kpw = packing.codes_per_word(bits) // 4
    packed_offsets = sm90.packed_smem_offsets(rows, length * bits // 8)
    smem_in = write_smem(words, packed_offsets)
    loads = [ld for warp in sm90.warp_loads(bits, operand, d) for ld in warp]
    q = dequant_codes(ldmatrix_x4(smem_in, packed_offsets, loads), bits, dtype)  # [load, lane, i, p, e]

    pairs = q.shape[3]
    lane, i, p, e = torch.meshgrid(torch.arange(32), torch.arange(4), torch.arange(pairs), torch.arange(2),
                                   indexing="ij")
    targets = torch.tensor(sm90.dequant_pair_targets(bits))  # [i, p, (mt, kb, v)]
    mt, kb, v = (targets[i, p, k] for k in range(3))
    reg = v + e  # index among the 8 values of the 16x16 block's A-fragment (stmatrix) registers
    row0 = torch.tensor([r for r, _ in loads]).view(-1, 1, 1, 1, 1)
    kt = kpw * torch.tensor([j for _, j in loads]).view(-1, 1, 1, 1, 1) + kb
    # where the A fragment (PTX) says the value belongs
    row = row0 + 16 * mt + PTX_A[lane, reg, 0]
    col = 16 * kt + PTX_A[lane, reg, 1]
    assert torch.equal(row, row0 + 8 * i + lane // 4), "the pair comes from the word of its row"
    tok, ch = (row, col) if operand == "k" else (col, row)
    val = (q * scale[tok, ch // 32].double() + zero[tok, ch // 32].double()).to(tdt).view(torch.int16).long()
    # stmatrix x4 (PTX): register pair m = reg // 2 goes to matrix m; the lane's values are row
    # lane // 4, cols 2*(lane % 4) + (0, 1) of it; that row is addressed by lane 8m + lane // 4
    addrs = torch.tensor(sm90.stsm_row_addresses())
    addr = addrs[8 * (reg // 2) + lane // 4]
    dst_r = row0 + 16 * mt + addr[..., 0]
    dst_c = 16 * kt + addr[..., 1] + 2 * (lane % 4) + reg % 2
    assert torch.equal(dst_r, row.expand_as(dst_r)) and torch.equal(dst_c, col.expand_as(dst_c))
    phys = torch.tensor(sm90.operand_smem_offsets(rows, length))[dst_r, dst_c]
    smem_out = torch.full((rows * length,), -(1 << 20), dtype=torch.long)
    written = torch.zeros(rows * length, dtype=torch.long)
    smem_out[phys.flatten()] = val.flatten()
    written.index_put_((phys.flatten(),), torch.ones(phys.numel(), dtype=torch.long), accumulate=True)
    assert torch.equal(written, torch.ones_like(written)), "every element stored exactly once"
    # wgmma reads the canonical K-major layout
    canon = torch.tensor([[canonical_kmajor(r, c, rows, 2 * length, 16) for c in range(length)]
                          for r in range(rows)])
    assert torch.equal(smem_out[canon], expect_bits(expected))


def test_sm90_dequant_smem_offsets_bijection():
    for bits in (4, 2):
        table = sm90.dequant_smem_offsets(bits, 32, 128)
        assert is_permutation([o for row in table for w in row for o in w], 32 * 128)


# --------------------------------------------------------------------------------------
# sm100: block-scaled MMA, scale-factor layout, number formats
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_sm100_scale_factor_layout(fmt):
    vec = sm100.SF_VEC[fmt]
    assert vec == (16 if fmt == "nvfp4" else 32)
    assert sm100.mma_shape(fmt, 128) == (128, 128, 64)
    assert sm100.sf_per_mma(fmt) == 64 // vec
    rows, cols = 256, 8 * vec
    table = sm100.sf_offsets(fmt, rows, cols)
    sf_cols = cols // vec
    assert is_permutation(flat(table), rows * sf_cols)
    assert sm100.sf_storage_bytes(fmt, rows, cols) == rows * sf_cols
    for m in range(rows):
        for s in range(sf_cols):
            assert table[m][s] == sf_chunk_offset(m, s, sf_cols)
            # the kernels' and pack kernel's addressing: (row chunk, column chunk, word, byte)
            rc, cc, word, byte = sm100.sf_location(m, s)
            chunk = rc * sm100.sf_chunks(sf_cols) + cc
            assert table[m][s] == chunk * sm100.SF_CHUNK_WORDS * 4 + 4 * word + byte
    with pytest.raises(ValueError, match=rf"{fmt} scale factors tile 128 rows .* got 100 x {cols}"):
        sm100.sf_offsets(fmt, 100, cols)


def test_fp4_fragment_order():
    """``fp4_position`` (fragment position -> the natural value the ldmatrix'd word puts
    there) and ``fp4_fragment_position`` are inverse permutations, segment by segment; the
    lane's eight values share one scale column of either block size."""
    n = 4 * sm80.FP4_SEGMENT
    assert sorted(sm80.fp4_position(p) for p in range(n)) == list(range(n))
    for p in range(n):
        assert sm80.fp4_fragment_position(sm80.fp4_position(p)) == p
        assert sm80.fp4_position(p) // sm80.FP4_SEGMENT == p // sm80.FP4_SEGMENT
    for seg in range(4):
        for c in range(4):
            values = [sm80.FP4_SEGMENT * seg + sm80.FP4_LANE_VALUES * c + i for i in range(sm80.FP4_LANE_VALUES)]
            for group in (16, 32):
                assert {v // group for v in values} == {sm80.fp4_lane_scale_column(seg, c, group)}


def test_sm100_number_formats():
    e2m1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    assert sm100.E2M1_VALUES[:8] == tuple(e2m1.tolist())
    assert sm100.E2M1_VALUES[8:] == tuple((-e2m1).tolist())
    for byte in range(0x7F):
        want = torch.tensor([byte], dtype=torch.uint8).view(torch.float8_e4m3fn).float().item()
        assert sm100.ue4m3_value(byte) == want
    for byte in range(0xFF):
        want = torch.tensor([byte], dtype=torch.uint8).view(torch.float8_e8m0fnu).float().item()
        assert sm100.ue8m0_value(byte) == want
    assert sm100.query_tile_cols(1) == 8 and sm100.query_tile_cols(12) == 16


# --------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------

CLI_OK = [
    ["mma", "--arch", "sm80", "--operand", "q"],
    ["mma", "--arch", "sm80", "--operand", "v"],
    ["mma", "--arch", "sm90", "--operand", "p"],
    ["mma", "--arch", "sm90", "--operand", "k"],
    ["ldmatrix", "--arch", "sm80", "--bits", "2", "--operand", "v"],
    ["ldmatrix", "--arch", "sm90", "--operand", "k"],
    ["packed", "--arch", "sm80", "--bits", "4", "--operand", "k"],
    ["packed", "--arch", "sm80", "--bits", "2", "--operand", "v"],
    ["packed", "--arch", "sm100", "--format", "nvfp4", "--operand", "k"],
    ["remap", "--bits", "4", "--dtype", "fp16"],
    ["remap", "--bits", "2", "--dtype", "bf16"],
    ["params", "--operand", "k", "--k-mode", "channel"],
    ["params", "--operand", "k", "--k-mode", "token"],
    ["params", "--operand", "v"],
    ["params", "--arch", "sm100", "--format", "mxfp4"],
    ["swizzle", "--arch", "sm80", "--operand", "k", "--bits", "2", "--head-dim", "64"],
    ["swizzle", "--arch", "sm90", "--operand", "v"],
    ["swizzle", "--arch", "sm100", "--format", "nvfp4", "--operand", "k"],
]

CLI_BAD = [
    ["mma", "--arch", "sm100"],
    ["packed", "--operand", "q"],
    ["remap", "--arch", "sm100", "--format", "nvfp4"],
    ["swizzle", "--arch", "sm80", "--operand", "p"],
    ["packed", "--arch", "sm80", "--format", "nvfp4"],
]


@pytest.mark.parametrize("argv", CLI_OK, ids=lambda a: "-".join(x.lstrip("-") for x in a))
def test_cli_layout_views(argv, capsys):
    assert cli.main(["layout", *argv]) == 0
    assert capsys.readouterr().out.strip()


def test_cli_layout_sm90_packed_tile_is_the_kernels(capsys, monkeypatch):
    """``bitdecode layout swizzle --arch sm90`` draws the packed tile as the decode kernel's
    default boxes place it: ``DecodeSm90``'s ``wide_boxes`` default, ``sm90.WIDE_BOXES`` (rows folded into
    128-byte TMA box rows, 4-bit K at D 128 two to a row, where row 8 lies in the second half
    of a 128-byte line; narrow boxes put it in the first)."""
    import inspect

    from bitdecode.kernels_sm90.decode import DecodeSm90

    wide = inspect.signature(DecodeSm90.__init__).parameters["wide_boxes"].default
    assert wide is sm90.WIDE_BOXES
    monkeypatch.setenv("COLUMNS", "200")
    assert cli.main(["layout", "swizzle", "--arch", "sm90", "--operand", "k", "--bits", "4"]) == 0
    out = capsys.readouterr().out
    assert ("2 rows to a 128-byte TMA box row" in out) == wide
    row8 = re.search(r"^ row 8 +(\d+)-", out, re.M)
    assert row8 and int(row8.group(1)) == (16 if wide else 0), out


@pytest.mark.parametrize("argv", CLI_BAD, ids=lambda a: "-".join(x.lstrip("-") for x in a))
def test_cli_layout_meaningless_combinations(argv, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")  # (a refusal is one line at any terminal width)
    assert cli.main(["layout", *argv]) != 0
    err = capsys.readouterr().err.strip()
    assert err and "\n" not in err


def test_cli_layout_unwritable_svg_draws_nothing(capsys):
    """The --svg file is opened before the picture is drawn: a path the parser cannot tell
    is unwritable (a file under /proc, which even root cannot make) gets the one-line
    refusal and no picture."""
    from pathlib import Path

    if not Path("/proc/self").is_dir():
        pytest.skip("needs Linux's /proc")
    assert cli.main(["layout", "packed", "--arch", "sm80", "--svg", "/proc/bitdecode_layout.svg"]) == 2
    out, err = capsys.readouterr()
    assert not out.strip() and "cannot write it" in err and "\n" not in err.strip()


@pytest.mark.parametrize("view", ["packed", "mma", "swizzle", "remap"])
def test_cli_layout_svg_parses(view, tmp_path):
    out = tmp_path / f"{view}.svg"
    assert cli.main(["layout", view, "--arch", "sm80", "--svg", str(out)]) == 0
    root = ET.parse(out).getroot()
    assert root.tag.endswith("svg")
    assert len(root.findall("{http://www.w3.org/2000/svg}rect")) > 16


@pytest.mark.parametrize("argv, message", [
    (["packed", "--arch", "sm100", "--format", "nvfp4", "--bits", "2"], "nvfp4 codes are 4-bit e2m1: --bits 2"),
    (["packed", "--operand", "p"], "P stays 16-bit in the integer formats"),
    (["params", "--operand", "p"], "P stays 16-bit in the integer formats"),
    (["ldmatrix", "--operand", "q"], "Q stays 16-bit in the integer formats"),
])
def test_cli_layout_refusals_exit_2_and_draw_nothing(argv, message, capsys, monkeypatch):
    """A view without meaning for its options (FP4 codes of 2 bits, a packed P or Q) is
    refused with exit status 2, as every command's refusal, on one line saying why; nothing
    is drawn."""
    monkeypatch.setenv("COLUMNS", "300")
    assert cli.main(["layout", *argv]) == 2
    out, err = capsys.readouterr()
    assert not out.strip() and f"error: layout {argv[0]}: " in err and message in err


def test_cli_layout_defaults(capsys, monkeypatch):
    """A view without options draws the defaults its help states: sm80, the 4-bit K
    operand, head dim 128."""
    monkeypatch.setenv("COLUMNS", "300")
    assert cli.main(["layout", "swizzle"]) == 0
    assert "sm80: shared-memory tiles for operand K (4-bit, D = 128)" in capsys.readouterr().out


# --------------------------------------------------------------------------------------
# Kernel-side constructors trace for their arch (no GPU)
# --------------------------------------------------------------------------------------


def test_sm90_constructors_trace():
    from bitdecode.layouts._trace import evaluate

    def build():
        import cutlass
        import cutlass.cute as cute
        import cutlass.utils.hopper_helpers as hopper
        from cutlass.tensor_utils import LayoutEnum

        f16 = cutlass.Float16
        out = {"mma": tuple(sm90.make_wgmma(f16, 128).shape_mnk),
               "rs": tuple(sm90.make_wgmma(cutlass.BFloat16, 64, a_from_registers=True).shape_mnk)}
        q = sm90.make_q_smem_layout(f16, 6, 128)
        out["q"] = (cute.size(q.outer, mode=[0]), cute.size(q.outer, mode=[1]))
        kv = sm90.make_kv_smem_layout(f16, 4, "v", 128, stages=2)
        ref = hopper.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (64, 128, 128), f16, 2)  # B: N = D, K = Nr
        out["kv_same_as_hopper_helper"] = str(kv) == str(ref)
        out["packed"] = str(sm90.make_packed_smem_layout(128, 64).inner)
        out["stsm"] = tuple(sm90.make_dequant_stsm_copy(f16).tiler_mn[i].shape for i in range(2))
        return out

    got = evaluate(build, arch=sm90.TRACE_ARCH)
    assert got["mma"] == (64, 128, 16) and got["rs"] == (64, 64, 16)
    assert got["q"] == (64, 128)
    assert got["kv_same_as_hopper_helper"]
    assert got["packed"] == "S<2,4,3>"
    assert got["stsm"] == (16, 16)


def test_sm100_constructors_trace():
    from bitdecode.layouts._trace import evaluate

    def build():
        import cutlass
        import cutlass.cute as cute

        mma = sm100.make_blockscaled_mma("nvfp4", 128)
        sfa, sfb = sm100.make_sf_smem_layouts("nvfp4", mma, (128, 128, 256), 2)
        return {
            "nvfp4": tuple(mma.shape_mnk),
            "mxfp4": tuple(sm100.make_blockscaled_mma("mxfp4", 16).shape_mnk),
            "f16": tuple(sm100.make_f16_mma(cutlass.BFloat16, 64).shape_mnk),
            "op": str(sm100.make_operand_smem_layout(cutlass.Float4E2M1FN, 128, 256, stages=2).inner),
            "sf": cute.size(sm100.make_sf_layout("mxfp4", 128, 256)),
            "sfa": cute.cosize(cute.filter_zeros(sfa)),
            "sfb": cute.cosize(cute.filter_zeros(sfb)),
        }

    got = evaluate(build, arch=sm100.TRACE_ARCH)
    assert got["nvfp4"] == (128, 128, 64) and got["mxfp4"] == (128, 16, 64) and got["f16"] == (128, 64, 16)
    assert got["op"] == "S<3,4,3>"
    assert got["sf"] == 128 * 256
    assert got["sfa"] == got["sfb"] == 2 * 128 * 256 // 16  # two stages of 128 rows x 16 scales


def test_residency_from_registers():
    """layouts.resources: CTAs per SM from registers and warps (the decode split count and
    the BitNet grids rely on it); the decode kernel's ptxas counts give 4 / 3 / 2."""
    from bitdecode.kernels_sm80 import backend as kernels
    from bitdecode.layouts.resources import ctas_per_sm

    assert ctas_per_sm(128, 4) == 4 and ctas_per_sm(168, 4) == 3 and ctas_per_sm(255, 4) == 2
    assert ctas_per_sm(32, 1) == 32 and ctas_per_sm(16, 4) == 16  # CTA and warp limits
    fmt4, fmt2 = KVFormat(4, "channel", 128), KVFormat(2, "channel", 128)
    assert [kernels.ctas_per_sm(f, d, nh) for f in (fmt4, fmt2) for d, nh in ((128, 8), (256, 8), (128, 16))] == [
        4, 2, 2, 3, 2, 2]


def test_setmaxnreg_split_stays_in_the_pool():
    """layouts.resources.consumer_registers: the producer's and the consumers' registers
    after setmaxnreg fit the pool the CTA launched with (beyond it setmaxnreg.inc hangs),
    in multiples of 8; e.g. 384 threads at 2 CTAs an SM launch with 80 registers, so two
    consumer warpgroups get 96, not the 104 the register file / CTAs would suggest."""
    from bitdecode.layouts import resources as r

    for ctas in (1, 2, 3):
        for consumers in (128, 256):
            for producer_regs in (24, 40, 56):
                entry = r.launch_registers(ctas, 128 + consumers)
                got = r.consumer_registers(ctas, 128, producer_regs, consumers, 256)
                assert entry % 8 == 0 and got % 8 == 0 and entry <= 255
                assert 128 * producer_regs + consumers * got <= entry * (128 + consumers)
                assert 128 * producer_regs + consumers * (got + 8) > entry * (128 + consumers) or got == 256
    assert r.launch_registers(2, 384) == 80 and r.consumer_registers(2, 128, 40, 256, 240) == 96


@pytest.mark.parametrize("dtype, operand, rows, cols, n", [
    ("e2m1", "a", 256, 128, 8),  # V^T of head dim 256 (two M-blocks), the FP4 MMA's A
    ("e2m1", "b", 16, 128, 16),  # Q / P as the FP4 MMA's B
    ("bf16", "a", 128, 128, 8),  # a 16-bit residual K tile (kind::f16)
])
def test_sm100_writes_land_where_the_mma_reads(dtype, operand, rows, cols, n):
    """The sm100 decode kernel writes Q, P and the 16-bit tiles through ``rows_cols_bytes`` of
    the MMA's own smem layout: a bijection onto the tile, equal to the canonical K-major
    operand layout (``operand_smem_offsets``) byte for byte."""
    from bitdecode.layouts import sm100

    got = sm100.mma_operand_bytes(dtype, "nvfp4", operand, rows, cols, n)
    canon = sm100.operand_smem_offsets(dtype, rows, cols)
    bits = sm100.ELEM_BITS[dtype]
    width = cols * bits // 8
    assert sorted(x for row in got for x in row) == list(range(rows * width))
    for r in range(rows):
        for cb in range(width):
            e = cb * 8 // bits  # the element holding byte column cb
            assert got[r][cb] == canon[r][e] * bits // 8 + (cb % 2 if bits == 16 else 0), (r, cb)


@pytest.mark.parametrize("n", [64, 128, 256])
def test_acc_stsm_trans_places_every_accumulator_value(n):
    """The BitNet GEMM's epilogue: stmatrix .x4 .trans of the packed accumulator pairs
    (``acc_stsm_value``) to the lane addresses ``acc_stsm_lane_target`` gives, put every
    value of the 64 x n wgmma accumulator at its own (row, column) of the [token, row] tile."""
    assert sm90.acc_stsm_trans_placement(n) == sm90.wgmma_fragment("c", n)


@pytest.mark.parametrize("row_bytes", [128, 256, 512, 1024])
def test_staged_rows_spread_over_the_banks(row_bytes):
    """The staged output tile's pitch: the 8 rows one 8 x 8 matrix of a stmatrix addresses
    (16 bytes each) land on 8 different 16-byte bank groups, wherever the matrix starts;
    unpadded they would all share one (an 8-way conflict)."""
    pitch = sm90.staged_row_bytes(row_bytes)
    for first in range(16):
        groups = {((first + r) * pitch // 16) % 8 for r in range(8)}
        assert len(groups) == 8, (row_bytes, first)
    assert len({(r * row_bytes // 16) % 8 for r in range(8)}) == 1
    with pytest.raises(AssertionError):
        sm90.staged_row_bytes(row_bytes + 16)


@pytest.mark.parametrize("threads", [128, 256])
def test_partial_sum_slot_words(threads):
    """A K split's partial-sum slot (the BitNet GEMM's workspace and cluster sums): every
    thread's words at distinct 16-byte offsets covering the slot exactly, and one word index
    across a warp is 512 contiguous bytes (one coalesced store)."""
    words = 8
    offsets = sorted(sm90.sum_thread_offset(t) + sm90.sum_word_offset(j, threads)
                     for t in range(threads) for j in range(words))
    assert offsets == list(range(0, threads * words * sm90.SUM_WORD_BYTES, sm90.SUM_WORD_BYTES))
    for j in range(words):
        warp = sorted(sm90.sum_thread_offset(t) + sm90.sum_word_offset(j, threads) for t in range(32, 64))
        assert warp[-1] + sm90.SUM_WORD_BYTES - warp[0] == 512


def test_half_heads_tile_view_covers_the_real_heads_once():
    """The 4-head tile's softmax view of the 8-column wgmma C fragment: every (row, head)
    of heads 0..3 is one slot of one thread, and the slot holds the value the C fragment
    puts there (quad lanes 2 and 3 take value ``v0 + 2`` of lane ``^ HALF_SOURCE_XOR``)."""
    frag = sm90.wgmma_fragment("c", 8)  # thread -> (row, column) of each value, v0 + 2 v1 order
    seen = []
    for t, values in enumerate(frag):
        lane, c = t % 32, t % 4
        source = t ^ sm90.HALF_SOURCE_XOR if c >= 2 else t
        for v0 in range(2):
            v1 = sm90.c_slot_v1(0, c, True)
            pos = (sm90.WARP_SLAB_ROWS * (t // 32) + lane // 4 + 8 * v1, sm90.c_slot_head(0, v0, c, True))
            assert frag[source][v0 + 2 * (1 if c >= 2 else 0)] == pos, (t, v0)
            seen.append(pos)
        # the full view: slot (v0, v1) is the C fragment's value v0 + 2 v1
        for v0 in range(2):
            for v1 in range(2):
                full = (sm90.WARP_SLAB_ROWS * (t // 32) + lane // 4 + 8 * sm90.c_slot_v1(v1, c, False),
                        sm90.c_slot_head(0, v0, c, False))
                assert values[v0 + 2 * v1] == full
    assert sorted(seen) == [(r, h) for r in range(sm90.WGMMA_M) for h in range(sm90.HALF_HEADS_TILE)]


def test_cli_layout_svg_is_written_whole_or_not_at_all(tmp_path, capsys, monkeypatch):
    """A failed SVG write (the picture's output closed, a full disk) leaves the file that
    was there as it was (it used to be emptied when opened, before the picture), and a
    full disk is a one-line refusal, not a traceback; a new file gets the usual mode."""
    import os
    import stat

    from bitdecode import cli_layout

    good = tmp_path / "good.svg"
    assert cli.main(["layout", "packed", "--arch", "sm80", "--svg", str(good)]) == 0
    before = good.read_text()
    assert stat.S_IMODE(good.stat().st_mode) == 0o666 & ~_umask()

    def closed(fig, console):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(cli_layout, "render_rich", closed)
    with pytest.raises(BrokenPipeError):
        cli.main(["layout", "mma", "--arch", "sm80", "--svg", str(good)])
    assert good.read_text() == before
    monkeypatch.undo()
    capsys.readouterr()
    if os.path.exists("/dev/full"):
        assert cli.main(["layout", "packed", "--arch", "sm80", "--svg", "/dev/full"]) == 2
        err = capsys.readouterr().err.strip()
        assert "cannot write it" in err and "\n" not in err and os.path.exists("/dev/full")
        assert not stat.S_ISREG(os.stat("/dev/full").st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.svg"]  # (no temporary left behind)


def _umask() -> int:
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask
