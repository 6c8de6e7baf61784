"""Residual kernel: quantize and pack full residual blocks of 16-bit K or V into the cache.

One CTA packs one ``Nr``-token block of K *or* V of one (sequence, KV head).  The block is
staged in shared memory and read back with the same ldmatrix + mma.m16n8k16 A-operand
configuration the decode kernel uses, so every lane holds exactly the values of the
packed words it writes (``layouts.sm80``): for K (rows = tokens) the plain A-operand
ldmatrix, for V (rows = channels) the transposing one over the V^T view.  Group
min/max are reduced in registers, then with warp shuffles, and for K per channel with
groups longer than one warp's tokens through shared memory.  Codes are packed in
registers with the element-to-field interleave and written as words, params as
(scale, zero) pairs in fragment order.

Modes:
* ``prefill``: source = the prompt ``[B, N, Hkv, D]``; block ``blk`` of sequence ``b`` is
  packed when it is full (``(blk + 1) * Nr <= lens[b]``), and the CTAs of its last,
  partial block copy those tokens to the residual buffer.  Grid ``(2 * blocks, Hkv, B)``
  (K blocks, then V blocks); one launch whatever the lengths.
* ``append``: source = new tokens ``[B, T, Hkv, D]`` with ``lens`` = lengths before the
  append.  Blocks completed by the new tokens are assembled from the residual buffer and
  the new tokens and packed; the remaining new tokens go to the residual buffer.  Grid
  ``(2, Hkv, B)``; one launch, no host sync (CUDA-graph safe).  The kernel also commits the
  lengths: the last CTA of a sequence to finish stores ``lens[b] + T``.

Sink tokens (``sinks`` > 0, ``KVFormat.sink_tokens``): the first ``sinks`` tokens of a
sequence are copied 16-bit to the sink buffers ``[B, sinks, Hkv, D]`` and never packed;
blocks and the residual count from the token after them.  In prefill the CTA that copies
the residual tail copies them too (the grid always has that CTA); in append each CTA
first copies its new tokens that still fall below ``sinks``.

Capacity guard (both modes): the host checks capacity before a launch, but a CUDA graph
replays an append without the host, so the kernel checks again.  A sequence whose new
length would pass ``capacity`` is not written at all and keeps its length; the length it
asked for goes to ``overflow[b]`` for the host to report (``KVCache.check``).

Non-finite values: min / max propagate NaN, and a group whose range is not finite (NaN,
or an infinity) gets NaN scale and zero, so each of its values dequantizes to NaN and
reaches every output that attends to it (``reference.quantize`` does the same).
"""

from __future__ import annotations

from typing import Type

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32, const_expr

from ..layouts import packing, resources, sm80
from . import ptx
from .copy import copy_rows, copy_rows_two_sources, load_a_fragments, wait_all
from .tensors import assume_aligned, commit_length, page_in_range, page_of, wait_for_previous_kernel

NUM_WARPS = sm80.WARPS_N


# Rounding without a conversion: adding 1.5 * 2^23 to t in [0, 2^22) leaves rint(t) (ties to
# even, as torch.round) in the low mantissa bits, on the fp32 pipe instead of the two
# conversions (cvt.rni + cvt.rzi) per element, which ran at a quarter of its rate
ROUND_MAGIC = 12582912.0
ROUND_MAGIC_BITS = 0x4B400000


def _min(a, b):
    """Group minimum: NaN-propagating, so a NaN makes its group's params NaN."""
    return cute.arch.fmin(a, b, nan=True)


def _max(a, b):
    return cute.arch.fmax(a, b, nan=True)
NUM_THREADS = resources.WARP * NUM_WARPS
CHUNK = sm80.CHUNK_BYTES // 2  # 16-bit elements per 16-byte chunk


class Width:
    """The constants of one code width (K's or V's): codes per word, the largest code,
    the field shifts and the biased start of a word."""

    def __init__(self, bits: int):
        self.bits = bits
        self.qmax = packing.qmax(bits)
        self.inv_qmax = packing.inv_qmax(bits)
        self.kpw = sm80.k_blocks_per_word(bits)  # 16-wide k-blocks per packed word
        # every code arrives biased by ROUND_MAGIC_BITS: a word starts at minus the sum of
        # the biases at its fields' shifts, so summing the shifted codes leaves the word
        cpw = packing.codes_per_word(bits)
        bias = sum(ROUND_MAGIC_BITS << packing.shift_of_element(bits, e) for e in range(cpw))
        self.word_start = -bias % (1 << 32)

    def shift(self, element: int) -> int:
        return packing.shift_of_element(self.bits, element)


class PackSm80:
    def __init__(self, dtype: Type[cutlass.Numeric], bits: int, k_mode: str, group_size: int,
                 head_dim: int, mode: str, pdl: bool = False, sinks: int = 0, v_bits: int = 0):
        assert mode in ("prefill", "append")
        self.dtype = dtype
        self.sinks = sinks  # 16-bit sink tokens ahead of the packed blocks
        self.pdl = pdl  # programmatic dependent launch (sm_90+), as the decode kernels
        self.is_bf16 = dtype is cutlass.BFloat16
        self.nan16 = packing.nan16(self.is_bf16)
        # K's and V's widths (K4V2, K2V4); the block is the wider tile of the two, and V
        # is packed in tiles of its own width (two 4-bit V tiles per block beside 2-bit K)
        self.kw, self.vw = Width(bits), Width(v_bits or bits)
        self.k_channel = k_mode == "channel"
        self.group = group_size
        self.d = head_dim
        self.mode = mode
        self.nr = max(sm80.residual_block(bits), sm80.residual_block(self.vw.bits))
        self.v_tile = sm80.residual_block(self.vw.bits)
        self.t = self.nr // NUM_WARPS  # tokens of one warp
        self.cpw_v = self.t // sm80.chunk_columns(self.vw.bits)  # the V-row chunks they span
        self.wk = sm80.words_per_row(bits, head_dim)
        self.seg = min(group_size, self.t)  # K per channel: one warp's share of a group
        self.tile_bytes = self.nr * head_dim * 2
        self.red_bytes = (self.nr // self.seg) * head_dim * 2 * 4 if self.k_channel else 0
        # K per channel: each group's (zero, 1/scale) per column, in fragment order
        self.zi_bytes = (self.nr // group_size) * head_dim * 2 * 4 if self.k_channel else 0

    @cute.jit
    def __call__(self, mSrcK, mSrcV, mKr, mVr, mKsink, mVsink, mLens, mBlockTable, mKp, mKs, mVp, mVs,
                 mOverflow, mCommits, capacity: Int32, stream):
        """``mKsink`` / ``mVsink``: the sink buffers ``[B, sinks, Hkv, D]`` (any tensor of the
        model dtype when ``sinks`` is 0: never touched)."""
        if const_expr(self.mode == "prefill"):
            grid = (2 * self.prefill_blocks(mSrcK.shape[1]), mSrcK.shape[2], mSrcK.shape[0])
        else:
            grid = (2, mSrcK.shape[2], mSrcK.shape[0])
        self.kernel(mSrcK, mSrcV, mKr, mVr, mKsink, mVsink, mLens, mBlockTable, mKp, mKs, mVp, mVs,
                    mOverflow, mCommits, capacity).launch(grid=grid, block=[NUM_THREADS, 1, 1], stream=stream,
                                                          use_pdl=self.pdl)

    def prefill_blocks(self, tokens):
        """Blocks of a prompt of ``tokens`` tokens, the partial last one included.  With
        sink tokens there is always one past the full blocks: its CTAs copy the sinks."""
        if const_expr(self.sinks > 0):
            return cutlass.max(tokens - self.sinks, 0) // self.nr + 1
        return (tokens + self.nr - 1) // self.nr

    @cute.kernel
    def kernel(self, mSrcK, mSrcV, mKr, mVr, mKsink, mVsink, mLens, mBlockTable, mKp, mKs, mVp, mVs,
               mOverflow, mCommits, capacity: Int32):
        tid, _, _ = cute.arch.thread_idx()
        x, head, b = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(tid // 32)
        lane = tid % 32
        smem = cutlass.memory.SmemAllocator()
        base = smem.allocate_array(cutlass.Uint8, self.tile_bytes + max(self.red_bytes, 16) + self.zi_bytes,
                                   byte_alignment=1024)
        # the swizzle stays in the layout (16-bit element units), as the kernels' tables assume
        s_tile = cute.make_tensor(cute.recast_ptr(base, dtype=self.dtype), sm80.make_smem_layout(self.nr, 2 * self.d))
        s_red = cute.make_tensor(cute.recast_ptr(base + self.tile_bytes, dtype=Float32),
                                 cute.make_layout(max(self.red_bytes // 4, 4)))
        s_zi = s_red  # unused unless K is per channel
        if const_expr(self.k_channel):
            groups = self.nr // self.group
            s_zi = cute.make_tensor(cute.recast_ptr(base + self.tile_bytes + self.red_bytes, dtype=Float32),
                                    cute.make_layout((2, self.d, groups), stride=(1, 2, 2 * self.d)))
        wait_for_previous_kernel(self.pdl)
        length = mLens[b]
        if const_expr(self.mode == "prefill"):
            # K blocks first, then V: CTAs resident together mostly run the same half of
            # the code (the instruction cache holds one half, not both)
            blocks = self.prefill_blocks(mSrcK.shape[1])
            which = x // blocks
            blk = x - which * blocks
            # the host checked the lengths; the clamp keeps any other from reaching past
            # the sequence's pages
            length = cutlass.min(length, capacity)
            n_sink = Int32(0)
            if const_expr(self.sinks > 0):
                n_sink = cutlass.min(length, self.sinks)
                length = length - n_sink  # tokens after the sinks: blocks count from there
            if ((blk + 1) * self.nr <= length) & self.page_ok(mBlockTable, mKp, b, blk):
                if which == 0:
                    self.load_rows(s_tile, mSrcK, mSrcK, b, head, n_sink + blk * self.nr, Int32(0), tid)
                    wait_all()
                    self.pack_k(s_tile, s_red, s_zi, mBlockTable, mKp, mKs, b, head, blk, warp_idx, lane, tid)
                else:
                    self.load_rows(s_tile, mSrcV, mSrcV, b, head, n_sink + blk * self.nr, Int32(0), tid)
                    wait_all()
                    self.pack_v(s_tile, mBlockTable, mVp, mVs, b, head, blk, warp_idx, lane)
            elif blk == length // self.nr:  # the sequence's last, partial block: 16-bit residual
                if which == 0:
                    self.copy_tail(mSrcK, mKr, mKsink, b, head, blk * self.nr, length, n_sink, tid)
                else:
                    self.copy_tail(mSrcV, mVr, mVsink, b, head, blk * self.nr, length, n_sink, tid)
        else:
            new_len = length + mSrcK.shape[1]
            fits = new_len <= capacity
            if fits:
                if x == 0:
                    self.append_with_sinks(s_tile, s_red, s_zi, mSrcK, mKr, mKsink, length, mBlockTable, mKp, mKs,
                                           mVp, mVs, b, head, warp_idx, lane, tid, True)
                else:
                    self.append_with_sinks(s_tile, s_red, s_zi, mSrcV, mVr, mVsink, length, mBlockTable, mKp, mKs,
                                           mVp, mVs, b, head, warp_idx, lane, tid, False)
            _, heads, _ = cute.arch.grid_dim()
            commit_length(mLens, mCommits, b, new_len, 2 * heads, tid, mOverflow, fits)  # (K and V CTAs)

    @cute.jit
    def copy_tail(self, mSrc, mRes, mSink, b, head, begin, end, n_sink, tid):
        """Prefill: the packed tokens ``[begin, end)`` past the last full block to the
        residual buffer, and the ``n_sink`` sink tokens to theirs (source rows are sequence
        positions; packed position ``p`` is row ``n_sink + p``)."""
        self.copy_tokens(mSrc, mRes, b, head, begin, end, -n_sink, tid, True)
        if const_expr(self.sinks > 0):
            self.copy_tokens(mSrc, mSink, b, head, Int32(0), n_sink, Int32(0), tid, False)

    @cute.jit
    def append_with_sinks(self, s_tile, s_red, s_zi, mNew, mRes, mSink, length, mBlockTable, mKp, mKs, mVp, mVs,
                          b, head, warp_idx, lane, tid, is_k: cutlass.Constexpr[bool]):
        """Append: new tokens that still fall below the sink count go 16-bit to the sink
        rows; the rest append after the sinks (``append``)."""
        new = mNew.shape[1]
        if const_expr(self.sinks > 0):
            to_sink = cutlass.min(cutlass.max(self.sinks - length, 0), new)
            self.copy_tokens(mNew, mSink, b, head, length, length + to_sink, length, tid, False)
            mNew = self.rows_from(mNew, to_sink)
            new = new - to_sink
            length = cutlass.max(length - self.sinks, 0)
        self.append(s_tile, s_red, s_zi, mNew, mRes, new, length, mBlockTable, mKp, mKs, mVp, mVs,
                    b, head, warp_idx, lane, tid, is_k)

    def rows_from(self, m: cute.Tensor, row0):
        """``m`` ``[B, T, Hkv, D]`` seen from token row ``row0`` on (same layout)."""
        return cute.make_tensor(m.iterator + row0 * m.stride[1], m.layout)

    # ---------------------------------------------------------------------------------
    # Staging the 16-bit block
    # ---------------------------------------------------------------------------------
    def block_rows(self, m: cute.Tensor, b, head, row0):
        """The (Nr, D) window of ``m[b, :, head, :]`` starting at token ``row0`` (which may
        lie before the first token: rows there are never read)."""
        rows = m[b, None, head, None]
        shifted = cute.make_tensor(rows.iterator + row0 * rows.stride[0], rows.layout)
        return assume_aligned(cute.local_tile(shifted, (self.nr, self.d), (0, 0)))

    @cute.jit
    def load_rows(self, s_tile, mRes, mNew, b, head, tok0, length, tid):
        """Rows ``tok0 + s`` of the block: from ``mRes[b, s]`` while below ``length`` (append:
        tokens already in the residual buffer), else ``mNew[b, tok0 + s - length]``."""
        if const_expr(self.mode == "prefill"):
            copy_rows(self.block_rows(mNew, b, head, tok0), s_tile, tid, NUM_THREADS, 0, False)
        else:
            copy_rows_two_sources(self.block_rows(mRes, b, head, 0),
                                  self.block_rows(mNew, b, head, tok0 - length),
                                  s_tile, tid, NUM_THREADS, length - tok0)

    @cute.jit
    def append(self, s_tile, s_red, s_zi, mNew, mRes, new, length, mBlockTable, mKp, mKs, mVp, mVs,
               b, head, warp_idx, lane, tid, is_k: cutlass.Constexpr[bool]):
        """Appends ``new`` tokens (rows of ``mNew``) to a sequence of ``length`` tokens (not
        counting sinks): packs the blocks they complete, keeps the rest 16-bit."""
        first = length // self.nr
        last = (length + new) // self.nr
        for blk in cutlass.range(first, last, unroll=1):
            # tokens of this block already in the residual buffer are those below `length`
            self.load_rows(s_tile, mRes, mNew, b, head, blk * self.nr, length, tid)
            wait_all()
            if self.page_ok(mBlockTable, mKp, b, blk):
                if const_expr(is_k):
                    self.pack_k(s_tile, s_red, s_zi, mBlockTable, mKp, mKs, b, head, blk, warp_idx, lane, tid)
                else:
                    self.pack_v(s_tile, mBlockTable, mVp, mVs, b, head, blk, warp_idx, lane)
            cute.arch.sync_threads()  # s_tile (and the residual rows it came from) are free again
        # the tokens that do not complete a block stay 16-bit in the residual buffer
        self.copy_tokens(mNew, mRes, b, head, cutlass.max(length, last * self.nr), length + new, length, tid, True)

    @cute.jit
    def copy_tokens(self, mSrc, mDst, b, head, begin, end, src0, tid, residual: cutlass.Constexpr[bool]):
        """Tokens ``[begin, end)`` of the sequence (source row ``pos - src0``) 16-bit to row
        ``pos % Nr`` of the residual buffer (``residual``) or row ``pos`` of a sink buffer,
        16 bytes per thread and step."""
        per_row = self.d // CHUNK
        for q in cutlass.range(tid, (end - begin) * per_row, NUM_THREADS, unroll=1):
            r = q // per_row
            col = q - r * per_row
            pos = begin + r
            row = pos % self.nr if const_expr(residual) else pos
            src = cute.local_tile(mSrc[b, None, head, None], (1, CHUNK), (pos - src0, col))
            dst = cute.local_tile(mDst[b, None, head, None], (1, CHUNK), (row, col))
            cute.autovec_copy(assume_aligned(src), assume_aligned(dst))

    # ---------------------------------------------------------------------------------
    # Quantization helpers
    # ---------------------------------------------------------------------------------
    @cute.jit
    def params(self, mn: Float32, mx: Float32, width: cutlass.Constexpr):
        """(scale, zero) word, zero (fp32) and 1/scale (0 for a constant group), as the
        reference computes them (the scale rounds toward zero so that zero + qmax*scale
        never passes the group's max).  A range that is not finite (NaN or an infinity
        in the group) gives the 16-bit NaN for both, 1/scale 0 and so code 0."""
        spread = mx - mn
        s_bits = ptx.f32_to_half_bits(spread * Float32(width.inv_qmax), self.is_bf16, True)
        z_bits = ptx.f32_to_half_bits(mn, self.is_bf16)
        if not (spread < Float32.inf):  # false for NaN too
            s_bits = Uint32(self.nan16)
            z_bits = Uint32(self.nan16)
        s16 = ptx.half_to_f32(s_bits, self.is_bf16)
        inv = Float32(0.0)
        if s16 > Float32(0.0):
            inv = ptx.rcp_rn(s16)
        word = (s_bits << packing.PARAM_SCALE_SHIFT) | (z_bits << packing.PARAM_ZERO_SHIFT)
        return word, ptx.half_to_f32(z_bits, self.is_bf16), inv

    @cute.jit
    def code(self, x: Float32, zero: Float32, inv: Float32, width: cutlass.Constexpr) -> Uint32:
        """rint((x - zero) * inv) clamped to [0, qmax], plus ROUND_MAGIC_BITS (see
        ``word_start``).  x >= zero, so only the top clamp does work; the bottom one, which
        drops NaN, makes a non-finite group's codes 0."""
        r = ptx.add_rn((x - zero) * inv, Float32(ROUND_MAGIC))
        r = cute.arch.fmin(cute.arch.fmax(r, Float32(ROUND_MAGIC)), Float32(ROUND_MAGIC + width.qmax))
        return ptx.f32_bits(r)

    def low(self, x2) -> Float32:
        return ptx.half_to_f32(x2, self.is_bf16)

    def high(self, x2) -> Float32:
        return ptx.half_to_f32(x2 >> 16, self.is_bf16)

    @cute.jit
    def pair_reduce(self, mn2, mx2, lane_masks):
        """Min / max pairs combined across the lanes of ``lane_masks`` (xor shuffles)."""
        for m in cutlass.range_constexpr(len(lane_masks)):
            mn2 = ptx.min_x2(mn2, cute.arch.shuffle_sync_bfly(mn2, lane_masks[m]), self.is_bf16)
            mx2 = ptx.max_x2(mx2, cute.arch.shuffle_sync_bfly(mx2, lane_masks[m]), self.is_bf16)
        return mn2, mx2

    def page_ok(self, mBlockTable, mKp, b, blk):
        return page_in_range(mBlockTable, b, blk * self.nr, mKp.shape[2], mKp.shape[0])

    def locate(self, mBlockTable, page_size, b, blk):
        return page_of(mBlockTable, b, blk * self.nr, page_size)

    def fragments(self, view, lane, transpose: bool):
        """A-operand fragments of a smem view, loaded exactly as the decode kernel loads them."""
        return load_a_fragments(sm80.make_mma(self.dtype), view, lane, transpose)

    # ---------------------------------------------------------------------------------
    # K: rows = tokens, columns = channels
    # ---------------------------------------------------------------------------------
    @cute.jit
    def pack_k(self, s_tile, s_red, s_zi, mBlockTable, mKp, mKs, b, head, blk, warp_idx, lane, tid):
        page, off = self.locate(mBlockTable, mKp.shape[2], b, blk)
        c, g = lane % 4, lane // 4
        row0 = warp_idx * self.t
        kt_count = self.d // 16
        if const_expr(self.k_channel):
            self.k_channel_minmax(s_tile, s_red, warp_idx, lane)
            cute.arch.sync_threads()
            self.k_channel_params(s_red, s_zi, mKs, page, head, off, tid)
            cute.arch.sync_threads()
        # a runtime loop over the warp's m-tiles: one copy of the body keeps the code small
        # enough for the instruction cache (unrolled, fetch stalls bound the kernel)
        for mt in cutlass.range(self.t // 16, unroll=1):
            rows = cute.local_tile(s_tile, (16, self.d), (warp_idx * (self.t // 16) + mt, 0))
            frag = self.fragments(rows, lane, False)  # ((2,2,2), 1, D/16)
            # per (row half, k-block, column): the value's (zero, 1/scale)
            zinv = {}
            if const_expr(self.k_channel):
                grp = (row0 + 16 * mt) // self.group
                for kt in cutlass.range_constexpr(kt_count):
                    # (zero, 1/scale) of the lane's 4 values of the k-block: 8 floats in a row
                    zi = cute.make_rmem_tensor((8,), Float32)
                    cute.autovec_copy(cute.local_tile(s_zi[None, None, grp], (2, 4), (0, 4 * kt + c)), zi)
                    for v in cutlass.range_constexpr(4):
                        zinv[(0, kt, v)] = (zi[2 * v], zi[2 * v + 1])
                        zinv[(1, kt, v)] = zinv[(0, kt, v)]
            else:
                gk = self.group // 16  # k-blocks per channel group
                frag32 = cute.recast_tensor(frag, Uint32)
                for h in cutlass.range_constexpr(2):
                    for gi in cutlass.range_constexpr(self.d // self.group):
                        # min / max of the row's group on 16-bit pairs (exact), then the pair
                        mn2 = frag32[(0, h, 0), 0, gi * gk]
                        mx2 = mn2
                        for kk in cutlass.range_constexpr(gk):
                            for p in cutlass.range_constexpr(2):
                                if const_expr(kk + p > 0):
                                    x2 = frag32[(0, h, p), 0, gi * gk + kk]
                                    mn2 = ptx.min_x2(mn2, x2, self.is_bf16)
                                    mx2 = ptx.max_x2(mx2, x2, self.is_bf16)
                        mn2, mx2 = self.pair_reduce(mn2, mx2, (1, 2))  # the 4 lanes of a quad share a row
                        word, zero, inv = self.params(_min(self.low(mn2), self.high(mn2)),
                                                      _max(self.low(mx2), self.high(mx2)), self.kw)
                        for kk in cutlass.range_constexpr(gk):
                            for v in cutlass.range_constexpr(4):
                                zinv[(h, gi * gk + kk, v)] = (zero, inv)
                        if c == 0:
                            mKs[page, head, off + row0 + 16 * mt + 8 * h + g, gi] = Int32(word)
            # quantize and pack: word 4*chunk + c of rows g and g+8
            for h in cutlass.range_constexpr(2):
                for chunk in cutlass.range_constexpr(self.wk // 4):
                    word = Uint32(self.kw.word_start)
                    for kl in cutlass.range_constexpr(self.kw.kpw):
                        kt = chunk * self.kw.kpw + kl
                        for v in cutlass.range_constexpr(4):
                            x = Float32(frag[(v % 2, h, v // 2), 0, kt])
                            zero, inv = zinv[(h, kt, v)]
                            word = word + (self.code(x, zero, inv, self.kw) << self.kw.shift(4 * kl + v))
                    mKp[page, head, off + row0 + 16 * mt + 8 * h + g, 4 * chunk + c] = Int32(word)

    @cute.jit
    def k_channel_minmax(self, s_tile, s_red, warp_idx, lane):
        """Per channel min/max over each ``seg``-token segment of this warp -> s_red.
        Reduced on 16-bit pairs (two adjacent channels per register, exact), widened once."""
        g = lane // 4
        c = lane % 4
        row0 = warp_idx * self.t
        for s in cutlass.range_constexpr(self.t // self.seg):
            mins = {}
            maxs = {}
            for m in cutlass.range_constexpr(self.seg // 16):
                rows = cute.local_tile(s_tile, (16, self.d), ((row0 + s * self.seg) // 16 + m, 0))
                frag32 = cute.recast_tensor(self.fragments(rows, lane, False), Uint32)
                for kt in cutlass.range_constexpr(self.d // 16):
                    for p in cutlass.range_constexpr(2):
                        for h in cutlass.range_constexpr(2):
                            x2 = frag32[(0, h, p), 0, kt]
                            key = (kt, p)
                            if const_expr(key in mins):
                                mins[key] = ptx.min_x2(mins[key], x2, self.is_bf16)
                                maxs[key] = ptx.max_x2(maxs[key], x2, self.is_bf16)
                            else:
                                mins[key] = x2
                                maxs[key] = x2
            seg_idx = (row0 + s * self.seg) // self.seg
            for kt in cutlass.range_constexpr(self.d // 16):
                for p in cutlass.range_constexpr(2):
                    # lanes with the same quad lane share columns
                    mn2, mx2 = self.pair_reduce(mins[(kt, p)], maxs[(kt, p)], (4, 8, 16))
                    if g == 0:
                        col = sm80.fragment_column(kt, c, p)
                        s_red[(2 * seg_idx) * self.d + col] = self.low(mn2)
                        s_red[(2 * seg_idx) * self.d + col + 1] = self.high(mn2)
                        s_red[(2 * seg_idx + 1) * self.d + col] = self.low(mx2)
                        s_red[(2 * seg_idx + 1) * self.d + col + 1] = self.high(mx2)

    @cute.jit
    def k_channel_params(self, s_red, s_zi, mKs, page, head, off, tid):
        """K per channel: every (group, column) of the block once, thread by thread: the
        group's min / max from its segments (s_red), its params word to global memory
        (consecutive threads, consecutive words) and (zero, 1/scale) to s_zi."""
        groups = self.nr // self.group
        segs = self.group // self.seg
        for j in cutlass.range_constexpr((groups * self.d + NUM_THREADS - 1) // NUM_THREADS):
            i = cutlass.min(tid + j * NUM_THREADS, groups * self.d - 1)  # a spare thread repeats the last
            grp = i // self.d
            pos = i - grp * self.d  # fragment-order position 16 kt + 4 c + v
            r = pos % 16
            v = r % 4
            col = pos - r + 2 * (r // 4) + (v % 2) + 8 * (v // 2)
            mn = s_red[(2 * grp * segs) * self.d + col]
            mx = s_red[(2 * grp * segs + 1) * self.d + col]
            for sg in cutlass.range_constexpr(1, segs):
                mn = _min(mn, s_red[(2 * (grp * segs + sg)) * self.d + col])
                mx = _max(mx, s_red[(2 * (grp * segs + sg) + 1) * self.d + col])
            word, zero, inv = self.params(mn, mx, self.kw)
            mKs[page, head, off // self.group + grp, pos] = Int32(word)
            s_zi[0, pos, grp] = zero
            s_zi[1, pos, grp] = inv

    # ---------------------------------------------------------------------------------
    # V: rows = channels, columns = the block's tokens (warp w: chunk w)
    # ---------------------------------------------------------------------------------
    @cute.jit
    def pack_v(self, s_tile, mBlockTable, mVp, mVs, b, head, blk, warp_idx, lane):
        page, off = self.locate(mBlockTable, mVp.shape[2] * self.v_tile, b, blk)
        s_vt = cute.composition(s_tile, cute.make_layout((self.d, self.nr), stride=(self.nr, 1)))
        if const_expr(self.cpw_v == 1):  # chunk `warp` of the block's one V tile
            self.pack_v_chunk(s_vt, mVp, mVs, page, off, head, warp_idx, Int32(0), warp_idx, lane)
        else:  # two 4-bit V tiles (K2V4): the warp's chunks 2 (warp % 2) .. of tile warp // 2
            for i in cutlass.range_constexpr(self.cpw_v):
                chunk = warp_idx * self.cpw_v + i
                self.pack_v_chunk(s_vt, mVp, mVs, page, off, head, chunk, chunk // NUM_WARPS, chunk % NUM_WARPS,
                                  lane)

    @cute.jit
    def pack_v_chunk(self, s_vt, mVp, mVs, page, off, head, chunk, tile, tile_chunk, lane):
        """Chunk ``chunk`` of the block's V rows (``chunk_columns`` tokens, one 16-byte
        word group per row; chunk ``tile_chunk`` of V tile ``tile``): its codes and its
        tokens' params."""
        c, g = lane % 4, lane // 4
        gm = self.group // 16  # channel m-tiles per group
        # the lane's words: rows g and g+8 of every channel m-tile, word c of the chunk
        words = cute.make_rmem_tensor((2, gm, self.d // self.group), Uint32)
        words.fill(self.vw.word_start)
        # a runtime loop over the word's k-blocks (small code, see pack_k): the fields of
        # k-block kt sit 2 * bits * kt above those of k-block 0
        for kt in cutlass.range(self.vw.kpw, unroll=1):
            # V^T (all D channels x one 16-token k-block), loaded exactly as decode loads it
            view = cute.local_tile(s_vt, (self.d, 16), (0, chunk * self.vw.kpw + kt))
            frag = self.fragments(view, lane, True)  # ((2,2,2), D/16, 1)
            frag32 = cute.recast_tensor(frag, Uint32)
            for gi in cutlass.range_constexpr(self.d // self.group):
                prm = {}
                for p in cutlass.range_constexpr(2):
                    # tokens 2p, 2p+1 of the quad: min/max over the group's channels (rows
                    # g, g+8 of each m-tile) on 16-bit pairs, then across the rows' lanes
                    mn2 = frag32[(0, 0, p), gi * gm, 0]
                    mx2 = mn2
                    for mm in cutlass.range_constexpr(gm):
                        for h in cutlass.range_constexpr(2):
                            if const_expr(mm + h > 0):
                                x2 = frag32[(0, h, p), gi * gm + mm, 0]
                                mn2 = ptx.min_x2(mn2, x2, self.is_bf16)
                                mx2 = ptx.max_x2(mx2, x2, self.is_bf16)
                    mn2, mx2 = self.pair_reduce(mn2, mx2, (4, 8, 16))
                    prm[2 * p] = self.params(self.low(mn2), self.low(mx2), self.vw)
                    prm[2 * p + 1] = self.params(self.high(mn2), self.high(mx2), self.vw)
                if g == 0:
                    tile16 = off // 16 + chunk * self.vw.kpw + kt
                    for v in cutlass.range_constexpr(4):
                        mVs[page, head, tile16, gi, sm80.param_position(0, c, v)] = Int32(prm[v][0])
                for mm in cutlass.range_constexpr(gm):
                    for h in cutlass.range_constexpr(2):
                        part = Uint32(0)
                        for v in cutlass.range_constexpr(4):
                            _, zero, inv = prm[v]
                            x = Float32(frag[(v % 2, h, v // 2), gi * gm + mm, 0])
                            part = part + (self.code(x, zero, inv, self.vw) << self.vw.shift(v))
                        words[h, mm, gi] = words[h, mm, gi] + (part << (2 * self.vw.bits * kt))
        for gi in cutlass.range_constexpr(self.d // self.group):
            for mm in cutlass.range_constexpr(gm):
                for h in cutlass.range_constexpr(2):
                    d = 16 * (gi * gm + mm) + 8 * h + g
                    mVp[page, head, off // self.v_tile + tile, d, 4 * tile_chunk + c] = Int32(words[h, mm, gi])
