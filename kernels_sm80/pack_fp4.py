"""FP4 (NVFP4 / MXFP4) pack kernel: the residual kernel's prefill / append with e2m1 codes.

Everything but the quantization is ``PackSm80``'s: the grid, the staging of a full
``Nr``-token block (128 tokens) in shared memory, the residual and sink copies, the
capacity guard and the length commit, so FP4 appends are one graph-safe launch as the
integer ones are.  ``pack_k`` / ``pack_v`` are replaced: FP4 codes are stored in natural
order (``KVFormat.fp4``: the bytes Blackwell's block-scaled MMA reads), K per token in
blocks of ``SF_VEC`` channels, V per channel in blocks of ``SF_VEC`` tokens, the block
scales in the 128 x 4 basic chunks of ``layouts.sm100``.  One thread owns one row (a
token of K, a channel of V) and writes its code words and its chunk word whole, so no
two threads share a word.

Rounding, bit for bit ``reference.quantize_fp4``:

* NVFP4 scale: ``amax / 6`` (IEEE division), clamped to [2^-9, 448], rounded half to even
  onto e4m3 by adding and subtracting ``1.5 * 2^(23 + q)`` (``q`` = the exponent of the
  e4m3 quantum at that magnitude), then its bits moved into the byte;
* MXFP4 scale: ``2^(floor(log2 amax) - 2)`` read off the fp32 exponent (``-127`` for an
  all-zero block, clamped to [-127, 127]);
* codes: ``|x|`` compared with the seven e2m1 midpoints times the scale (exact products:
  both have at most four significant bits), ties to the even code, the sign bit from
  ``x``; a block holding a NaN or an infinity gets the NaN scale byte and codes 0.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32, const_expr

from ..layouts import packing, sm100
from ..layouts.packing import F32_EXP_BIAS, F32_MANTISSA_BITS, F32_MIN_EXP, F32_SIGN_BIT
from ..layouts.sm100 import E4M3_EXP_BIAS, E4M3_MANTISSA_BITS, E4M3_MIN_EXP
from . import ptx
from .pack import NUM_THREADS, PackSm80

FIELD_BITS = sm100.ELEM_BITS["e2m1"]
CODES_PER_WORD = packing.codes_per_word(FIELD_BITS)


def _pow2(e: int) -> float:
    return 2.0 ** e


class Fp4Blocks:
    """FP4 block quantization in registers (``KVFormat.fp4``'s rounding, exactly): the
    scale of a block from its largest magnitude, and e2m1 codes by comparing magnitudes
    with the grid's midpoints times the scale (exact products: no division per value).
    The FP4 pack kernel quantizes K / V with it, the sm100 decode kernel Q and P."""

    def __init__(self, fp4: str):
        assert fp4 in sm100.FP4_FORMATS
        self.fp4 = fp4
        self.vec = sm100.SF_VEC[fp4]

    @cute.jit
    def e4m3_round(self, s: Float32):
        """``s`` in [2^-9, 448] -> (its e4m3 byte, the e4m3 value) rounding half to even."""
        e = cutlass.max(ptx.f32_exponent(ptx.f32_bits(s)), E4M3_MIN_EXP)
        # 1.5 * 2^(23 + quantum exponent): adding it leaves s rounded to the quantum
        magic = ptx.u32_as_f32(Uint32(e - E4M3_MANTISSA_BITS + F32_MANTISSA_BITS + F32_EXP_BIAS) << F32_MANTISSA_BITS
                               | Uint32(1 << (F32_MANTISSA_BITS - 1)))
        r = ptx.add_rn(ptx.add_rn(s, magic), -magic)
        rb = ptx.f32_bits(r)
        re = ptx.f32_exponent(rb)
        byte = (Uint32(((re + E4M3_EXP_BIAS) << E4M3_MANTISSA_BITS))
                | ((rb >> (F32_MANTISSA_BITS - E4M3_MANTISSA_BITS)) & ((1 << E4M3_MANTISSA_BITS) - 1)))
        if re < E4M3_MIN_EXP:  # subnormal: the value in quanta of 2^-9, read off 2^23 + it
            quanta = r * Float32(_pow2(-(E4M3_MIN_EXP - E4M3_MANTISSA_BITS)))
            byte = ptx.f32_bits(ptx.add_rn(quanta, Float32(_pow2(F32_MANTISSA_BITS)))) & ((1 << E4M3_MANTISSA_BITS) - 1)
        return byte, r

    @cute.jit
    def ue8m0_round(self, amax: Float32):
        """MXFP4: (the e8m0 byte, 2^e) with e = floor(log2 amax) - 2 (amax 0: e = -127)."""
        # subnormal fp32 amax (bf16 blocks below 2^-126) read exactly after a 2^64 lift
        lift = 0
        a = amax
        if amax < Float32(_pow2(F32_MIN_EXP)):
            a = amax * Float32(_pow2(64))
            lift = 64
        e = ptx.f32_exponent(ptx.f32_bits(a)) - lift - sm100.E2M1_EMAX
        if amax == Float32(0.0):
            e = Int32(sm100.UE8M0_MIN_EXP)
        e = cutlass.min(cutlass.max(e, sm100.UE8M0_MIN_EXP), sm100.UE8M0_BIAS)
        # 2^e as fp32 bits: normal from -126, else the subnormal 2^-127
        bits = Uint32(e + F32_EXP_BIAS) << F32_MANTISSA_BITS
        if e < F32_MIN_EXP:
            bits = Uint32(1 << (F32_MANTISSA_BITS - 1))
        return Uint32(e + sm100.UE8M0_BIAS), ptx.u32_as_f32(bits)

    @cute.jit
    def block_scale(self, amax: Float32):
        """(scale byte, scale value) of a block whose largest magnitude is ``amax``."""
        if const_expr(self.fp4 == "nvfp4"):
            s = ptx.div_rn(amax, Float32(sm100.E2M1_MAX))
            s = cute.arch.fmin(cute.arch.fmax(s, Float32(sm100.UE4M3_MIN)), Float32(sm100.UE4M3_MAX))
            byte, scale = self.e4m3_round(s)
        else:
            byte, scale = self.ue8m0_round(amax)
        return byte, scale

    @cute.jit
    def code_of(self, x: Float32, thresholds, graded, finite) -> Uint32:
        """e2m1 code of ``x`` against the block's midpoint ``thresholds``: the magnitude
        only when ``graded`` (a finite block with a nonzero amax: an all-zero block's
        thresholds would be subnormal, its codes are signed zeros), the sign bit when
        ``finite``."""
        a = ptx.fabs(x)
        mag = Uint32(0)
        if graded:
            for m in cutlass.range_constexpr(len(thresholds)):
                up = (a >= thresholds[m]) if const_expr(sm100.E2M1_TIE_UP[m]) else (a > thresholds[m])
                mag = mag + Uint32(up)
        sign = (ptx.f32_bits(x) >> F32_SIGN_BIT) & Uint32(finite)
        return mag | (sign << sm100.E2M1_SIGN_BIT)

    @cute.jit
    def quantize_block(self, vals):
        """``vals`` (SF_VEC fp32 values) -> (scale byte, code words)."""
        byte, _, words = self.quantize_block_scaled(vals)
        return byte, words

    @cute.jit
    def quantize_block_scaled(self, vals):
        """``vals`` (SF_VEC fp32 values) -> (scale byte, scale value, code words)."""
        amax = Float32(0.0)
        for i in cutlass.range_constexpr(self.vec):
            amax = cute.arch.fmax(amax, ptx.fabs(vals[i]), nan=True)
        byte, scale = self.block_scale(amax)
        thresholds = [Float32(m) * scale for m in sm100.E2M1_MIDPOINTS]
        finite = amax < Float32.inf  # false for NaN too
        if not (amax < Float32.inf):
            byte = Uint32(sm100.SCALE_NAN[self.fp4])
        graded = finite & (amax > Float32(0.0))
        words = []
        for w in cutlass.range_constexpr(self.vec // CODES_PER_WORD):
            word = Uint32(0)
            for i in cutlass.range_constexpr(CODES_PER_WORD):
                code = self.code_of(vals[CODES_PER_WORD * w + i], thresholds, graded, finite)
                word = word | (code << (FIELD_BITS * i))
            words.append(word)
        return byte, scale, words


class PackFp4Sm80(PackSm80, Fp4Blocks):
    """The FP4 residual kernel (``KVFormat.fp4``); constexpr config as ``PackSm80``."""

    def __init__(self, dtype, fp4: str, head_dim: int, mode: str, pdl: bool = False, sinks: int = 0):
        Fp4Blocks.__init__(self, fp4)
        PackSm80.__init__(self, dtype, 4, "token", self.vec, head_dim, mode, pdl=pdl, sinks=sinks, v_bits=4)
        assert self.nr == sm100.SF_ATOM_ROWS == NUM_THREADS  # a thread per token of K's chunk rows
        assert self.v_tile == self.nr

    # ---- K: a thread per token, blocks along the channels ------------------------------
    @cute.jit
    def pack_k(self, s_tile, s_red, s_zi, mBlockTable, mKp, mKs, b, head, blk, warp_idx, lane, tid):
        page, off = self.locate(mBlockTable, mKp.shape[2], b, blk)
        cols = self.d // self.vec  # scale columns of a token
        chunk_word = sm100.sf_chunk_word(tid)
        for chunk in cutlass.range_constexpr(sm100.sf_chunks(cols)):
            sf_word = Uint32(0)
            for j in cutlass.range_constexpr(sm100.SF_ATOM_COLS):
                col = chunk * sm100.SF_ATOM_COLS + j
                if const_expr(col < cols):
                    vals = [Float32(s_tile[tid, col * self.vec + i]) for i in range(self.vec)]
                    byte, words = self.quantize_block(vals)
                    for w in cutlass.range_constexpr(len(words)):
                        mKp[page, head, off + tid, col * len(words) + w] = Int32(words[w])
                    sf_word = sf_word | (byte << (sm100.SF_BITS * j))
            mKs[page, head, off // self.nr, chunk, chunk_word] = Int32(sf_word)

    # ---- V: a thread per channel, blocks along the tokens ------------------------------
    @cute.jit
    def pack_v(self, s_tile, mBlockTable, mVp, mVs, b, head, blk, warp_idx, lane):
        page, off = self.locate(mBlockTable, mVp.shape[2] * self.v_tile, b, blk)
        tile = off // self.v_tile
        tid, _, _ = cute.arch.thread_idx()
        cols = self.v_tile // self.vec
        # every row of the basic chunks down the channels (a thread per row of each), padding
        # rows (>= D) written zero
        for row_chunk in cutlass.range_constexpr(sm100.sf_row_chunks(self.d)):
            ch = row_chunk * sm100.SF_ATOM_ROWS + tid
            for chunk in cutlass.range_constexpr(sm100.sf_chunks(cols)):
                sf_word = Uint32(0)
                if ch < self.d:
                    for j in cutlass.range_constexpr(sm100.SF_ATOM_COLS):
                        col = chunk * sm100.SF_ATOM_COLS + j
                        if const_expr(col < cols):
                            vals = [Float32(s_tile[col * self.vec + i, ch]) for i in range(self.vec)]
                            byte, words = self.quantize_block(vals)
                            for w in cutlass.range_constexpr(len(words)):
                                mVp[page, head, tile, ch, col * len(words) + w] = Int32(words[w])
                            sf_word = sf_word | (byte << (sm100.SF_BITS * j))
                mVs[page, head, tile, row_chunk, chunk, sm100.sf_chunk_word(tid)] = Int32(sf_word)
