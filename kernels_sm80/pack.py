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
  packed when it is full (``(blk + 1) * Nr <= lens[b]``).  Grid ``(2 * blocks, Hkv, B)``.
* ``append``: source = new tokens ``[B, T, Hkv, D]`` with ``lens`` = lengths before the
  append.  Blocks completed by the new tokens are assembled from the residual buffer and
  the new tokens and packed; the remaining new tokens go to the residual buffer.  Grid
  ``(2, Hkv, B)``; one launch, no host sync (CUDA-graph safe).
"""

from __future__ import annotations

from typing import Type

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32, const_expr

from ..layouts import packing, resources, sm80
from . import ptx
from .copy import copy_rows, copy_rows_two_sources, load_a_fragments, wait_all
from .tensors import assume_aligned, page_of

NUM_WARPS = sm80.WARPS_N
NUM_THREADS = resources.WARP * NUM_WARPS
CHUNK = sm80.CHUNK_BYTES // 2  # 16-bit elements per 16-byte chunk


class PackSm80:
    def __init__(self, dtype: Type[cutlass.Numeric], bits: int, k_mode: str, group_size: int,
                 head_dim: int, mode: str):
        assert mode in ("prefill", "append")
        self.dtype = dtype
        self.is_bf16 = dtype is cutlass.BFloat16
        self.bits = bits
        self.qmax = packing.qmax(bits)
        self.inv_qmax = packing.inv_qmax(bits)
        self.k_channel = k_mode == "channel"
        self.group = group_size
        self.d = head_dim
        self.mode = mode
        self.nr = sm80.residual_block(bits)
        self.t = sm80.tokens_per_warp(bits)
        self.kpw = sm80.k_blocks_per_word(bits)
        self.wk = sm80.words_per_row(bits, head_dim)
        self.seg = min(group_size, self.t)  # K per channel: one warp's share of a group
        self.tile_bytes = self.nr * head_dim * 2
        self.red_bytes = (self.nr // self.seg) * head_dim * 2 * 4 if self.k_channel else 0

    @cute.jit
    def __call__(self, mSrcK, mSrcV, mKr, mVr, mLens, mBlockTable, mKp, mKs, mVp, mVs, stream):
        if const_expr(self.mode == "prefill"):
            blocks = (mSrcK.shape[1] + self.nr - 1) // self.nr
            grid = (2 * blocks, mSrcK.shape[2], mSrcK.shape[0])
        else:
            grid = (2, mSrcK.shape[2], mSrcK.shape[0])
        self.kernel(mSrcK, mSrcV, mKr, mVr, mLens, mBlockTable, mKp, mKs, mVp, mVs).launch(
            grid=grid, block=[NUM_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mSrcK, mSrcV, mKr, mVr, mLens, mBlockTable, mKp, mKs, mVp, mVs):
        tid, _, _ = cute.arch.thread_idx()
        x, head, b = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(tid // 32)
        lane = tid % 32
        smem = cutlass.memory.SmemAllocator()
        base = smem.allocate_array(cutlass.Uint8, self.tile_bytes + max(self.red_bytes, 16), byte_alignment=1024)
        # the swizzle stays in the layout (16-bit element units), as the kernels' tables assume
        s_tile = cute.make_tensor(cute.recast_ptr(base, dtype=self.dtype), sm80.make_smem_layout(self.nr, 2 * self.d))
        s_red = cute.make_tensor(cute.recast_ptr(base + self.tile_bytes, dtype=Float32),
                                 cute.make_layout(max(self.red_bytes // 4, 4)))
        length = mLens[b]
        if const_expr(self.mode == "prefill"):
            blk = x // 2
            which = x - 2 * blk
            if (blk + 1) * self.nr <= length:
                if which == 0:
                    self.load_rows(s_tile, mSrcK, mSrcK, b, head, blk * self.nr, Int32(0), tid)
                    wait_all()
                    self.pack_k(s_tile, s_red, mBlockTable, mKp, mKs, b, head, blk, warp_idx, lane)
                else:
                    self.load_rows(s_tile, mSrcV, mSrcV, b, head, blk * self.nr, Int32(0), tid)
                    wait_all()
                    self.pack_v(s_tile, mBlockTable, mVp, mVs, b, head, blk, warp_idx, lane)
        else:
            if x == 0:
                self.append(s_tile, s_red, mSrcK, mKr, length, mBlockTable, mKp, mKs, mVp, mVs,
                            b, head, warp_idx, lane, tid, True)
            else:
                self.append(s_tile, s_red, mSrcV, mVr, length, mBlockTable, mKp, mKs, mVp, mVs,
                            b, head, warp_idx, lane, tid, False)

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
    def append(self, s_tile, s_red, mNew, mRes, length, mBlockTable, mKp, mKs, mVp, mVs,
               b, head, warp_idx, lane, tid, is_k: cutlass.Constexpr[bool]):
        new = mNew.shape[1]
        first = length // self.nr
        last = (length + new) // self.nr
        for blk in cutlass.range(first, last, unroll=1):
            # tokens of this block already in the residual buffer are those below `length`
            self.load_rows(s_tile, mRes, mNew, b, head, blk * self.nr, length, tid)
            wait_all()
            if const_expr(is_k):
                self.pack_k(s_tile, s_red, mBlockTable, mKp, mKs, b, head, blk, warp_idx, lane)
            else:
                self.pack_v(s_tile, mBlockTable, mVp, mVs, b, head, blk, warp_idx, lane)
            cute.arch.sync_threads()  # s_tile (and the residual rows it came from) are free again
        # the tokens that do not complete a block stay 16-bit in the residual buffer
        tail0 = cutlass.max(length, last * self.nr)
        per_row = self.d // CHUNK
        count = (length + new - tail0) * per_row
        for q in cutlass.range(tid, count, NUM_THREADS, unroll=1):
            r = q // per_row
            col = q - r * per_row
            pos = tail0 + r
            src = cute.local_tile(mNew[b, None, head, None], (1, CHUNK), (pos - length, col))
            dst = cute.local_tile(mRes[b, None, head, None], (1, CHUNK), (pos % self.nr, col))
            cute.autovec_copy(assume_aligned(src), assume_aligned(dst))

    # ---------------------------------------------------------------------------------
    # Quantization helpers
    # ---------------------------------------------------------------------------------
    @cute.jit
    def params(self, mn: Float32, mx: Float32):
        """(scale, zero) word, zero (fp32) and 1/scale (0 for a constant group), as the
        reference computes them (the scale rounds toward zero so that zero + qmax*scale
        never passes the group's max)."""
        scale = (mx - mn) * Float32(self.inv_qmax)
        s_bits = ptx.f32_to_half_bits(scale, self.is_bf16, True)
        z_bits = ptx.f32_to_half_bits(mn, self.is_bf16)
        s16 = ptx.half_to_f32(s_bits, self.is_bf16)
        inv = Float32(0.0)
        if s16 > Float32(0.0):
            inv = ptx.rcp_rn(s16)
        word = (s_bits << packing.PARAM_SCALE_SHIFT) | (z_bits << packing.PARAM_ZERO_SHIFT)
        return word, ptx.half_to_f32(z_bits, self.is_bf16), inv

    @cute.jit
    def code(self, x: Float32, zero: Float32, inv: Float32) -> Uint32:
        q = ptx.round_even((x - zero) * inv)
        q = cute.arch.fmin(cute.arch.fmax(q, Float32(0.0)), Float32(self.qmax))
        return ptx.f32_to_u32(q)

    def locate(self, mBlockTable, page_size, b, blk):
        return page_of(mBlockTable, b, blk * self.nr, page_size)

    def fragments(self, view, lane, transpose: bool):
        """A-operand fragments of a smem view, loaded exactly as the decode kernel loads them."""
        return load_a_fragments(sm80.make_mma(self.dtype), view, lane, transpose)

    # ---------------------------------------------------------------------------------
    # K: rows = tokens, columns = channels
    # ---------------------------------------------------------------------------------
    @cute.jit
    def pack_k(self, s_tile, s_red, mBlockTable, mKp, mKs, b, head, blk, warp_idx, lane):
        page, off = self.locate(mBlockTable, mKp.shape[2], b, blk)
        c, g = lane % 4, lane // 4
        row0 = warp_idx * self.t
        kt_count = self.d // 16
        if const_expr(self.k_channel):
            self.k_channel_minmax(s_tile, s_red, warp_idx, lane)
            cute.arch.sync_threads()
        for mt in cutlass.range_constexpr(self.t // 16):
            rows = cute.local_tile(s_tile, (16, self.d), (warp_idx * (self.t // 16) + mt, 0))
            frag = self.fragments(rows, lane, False)  # ((2,2,2), 1, D/16)
            # per (row half, k-block, column): the value's (zero, 1/scale)
            zinv = {}
            if const_expr(self.k_channel):
                grp = (row0 + 16 * mt) // self.group
                first_seg = grp * (self.group // self.seg)
                for kt in cutlass.range_constexpr(kt_count):
                    for v in cutlass.range_constexpr(4):
                        col = 16 * kt + 2 * c + (v % 2) + 8 * (v // 2)
                        mn = s_red[(2 * first_seg) * self.d + col]
                        mx = s_red[(2 * first_seg + 1) * self.d + col]
                        for sg in cutlass.range_constexpr(1, self.group // self.seg):
                            mn = cute.arch.fmin(mn, s_red[(2 * (first_seg + sg)) * self.d + col])
                            mx = cute.arch.fmax(mx, s_red[(2 * (first_seg + sg) + 1) * self.d + col])
                        word, zero, inv = self.params(mn, mx)
                        zinv[(0, kt, v)] = (zero, inv)
                        zinv[(1, kt, v)] = (zero, inv)
                        # the segment that starts a group writes its params (fragment order)
                        if ((row0 + 16 * mt) % self.group == 0) & (g == 0):
                            mKs[page, head, (off + row0 + 16 * mt) // self.group, sm80.param_position(kt, c, v)] = Int32(word)
            else:
                gk = self.group // 16  # k-blocks per channel group
                for h in cutlass.range_constexpr(2):
                    for gi in cutlass.range_constexpr(self.d // self.group):
                        mn = Float32.inf
                        mx = -Float32.inf
                        for kk in cutlass.range_constexpr(gk):
                            for v in cutlass.range_constexpr(4):
                                x = Float32(frag[(v % 2, h, v // 2), 0, gi * gk + kk])
                                mn = cute.arch.fmin(mn, x)
                                mx = cute.arch.fmax(mx, x)
                        for off_c in cutlass.range_constexpr(2):  # the 4 lanes of a quad share a row
                            mn = cute.arch.fmin(mn, cute.arch.shuffle_sync_bfly(mn, 1 << off_c))
                            mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, 1 << off_c))
                        word, zero, inv = self.params(mn, mx)
                        for kk in cutlass.range_constexpr(gk):
                            for v in cutlass.range_constexpr(4):
                                zinv[(h, gi * gk + kk, v)] = (zero, inv)
                        if c == 0:
                            mKs[page, head, off + row0 + 16 * mt + 8 * h + g, gi] = Int32(word)
            # quantize and pack: word 4*chunk + c of rows g and g+8
            for h in cutlass.range_constexpr(2):
                for chunk in cutlass.range_constexpr(self.wk // 4):
                    word = Uint32(0)
                    for kl in cutlass.range_constexpr(self.kpw):
                        kt = chunk * self.kpw + kl
                        for v in cutlass.range_constexpr(4):
                            x = Float32(frag[(v % 2, h, v // 2), 0, kt])
                            zero, inv = zinv[(h, kt, v)]
                            shift = packing.shift_of_element(self.bits, 4 * kl + v)
                            word = word | (self.code(x, zero, inv) << shift)
                    mKp[page, head, off + row0 + 16 * mt + 8 * h + g, 4 * chunk + c] = Int32(word)

    @cute.jit
    def k_channel_minmax(self, s_tile, s_red, warp_idx, lane):
        """Per channel min/max over each ``seg``-token segment of this warp -> s_red."""
        g = lane // 4
        c = lane % 4
        row0 = warp_idx * self.t
        for s in cutlass.range_constexpr(self.t // self.seg):
            mins = {}
            maxs = {}
            for m in cutlass.range_constexpr(self.seg // 16):
                rows = cute.local_tile(s_tile, (16, self.d), ((row0 + s * self.seg) // 16 + m, 0))
                frag = self.fragments(rows, lane, False)
                for kt in cutlass.range_constexpr(self.d // 16):
                    for v in cutlass.range_constexpr(4):
                        for h in cutlass.range_constexpr(2):
                            x = Float32(frag[(v % 2, h, v // 2), 0, kt])
                            key = (kt, v)
                            if const_expr(key in mins):
                                mins[key] = cute.arch.fmin(mins[key], x)
                                maxs[key] = cute.arch.fmax(maxs[key], x)
                            else:
                                mins[key] = x
                                maxs[key] = x
            seg_idx = (row0 + s * self.seg) // self.seg
            for kt in cutlass.range_constexpr(self.d // 16):
                for v in cutlass.range_constexpr(4):
                    mn = mins[(kt, v)]
                    mx = maxs[(kt, v)]
                    for o in cutlass.range_constexpr(3):  # lanes with the same quad lane share columns
                        mn = cute.arch.fmin(mn, cute.arch.shuffle_sync_bfly(mn, 4 << o))
                        mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, 4 << o))
                    if g == 0:
                        col = 16 * kt + 2 * c + (v % 2) + 8 * (v // 2)
                        s_red[(2 * seg_idx) * self.d + col] = mn
                        s_red[(2 * seg_idx + 1) * self.d + col] = mx

    # ---------------------------------------------------------------------------------
    # V: rows = channels, columns = the block's tokens (warp w: chunk w)
    # ---------------------------------------------------------------------------------
    @cute.jit
    def pack_v(self, s_tile, mBlockTable, mVp, mVs, b, head, blk, warp_idx, lane):
        page, off = self.locate(mBlockTable, mVp.shape[2] * self.nr, b, blk)
        c, g = lane % 4, lane // 4
        s_vt = cute.composition(s_tile, cute.make_layout((self.d, self.nr), stride=(self.nr, 1)))
        gm = self.group // 16  # channel m-tiles per group
        words = {}
        for kt in cutlass.range_constexpr(self.kpw):
            # V^T (all D channels x one 16-token k-block), loaded exactly as decode loads it
            view = cute.local_tile(s_vt, (self.d, 16), (0, warp_idx * self.kpw + kt))
            frag = self.fragments(view, lane, True)  # ((2,2,2), D/16, 1)
            for gi in cutlass.range_constexpr(self.d // self.group):
                for v in cutlass.range_constexpr(4):
                    # one token: min/max over the group's channels (rows g, g+8 of each m-tile)
                    mn = Float32.inf
                    mx = -Float32.inf
                    for mm in cutlass.range_constexpr(gm):
                        for h in cutlass.range_constexpr(2):
                            x = Float32(frag[(v % 2, h, v // 2), gi * gm + mm, 0])
                            mn = cute.arch.fmin(mn, x)
                            mx = cute.arch.fmax(mx, x)
                    for o in cutlass.range_constexpr(3):
                        mn = cute.arch.fmin(mn, cute.arch.shuffle_sync_bfly(mn, 4 << o))
                        mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, 4 << o))
                    word, zero, inv = self.params(mn, mx)
                    if g == 0:
                        tile16 = (off + warp_idx * self.t) // 16 + kt
                        mVs[page, head, tile16, gi, sm80.param_position(0, c, v)] = Int32(word)
                    shift = packing.shift_of_element(self.bits, 4 * kt + v)
                    for mm in cutlass.range_constexpr(gm):
                        for h in cutlass.range_constexpr(2):
                            x = Float32(frag[(v % 2, h, v // 2), gi * gm + mm, 0])
                            bits = self.code(x, zero, inv) << shift
                            key = (gi, mm, h)
                            words[key] = bits if const_expr(key not in words) else words[key] | bits
        for gi in cutlass.range_constexpr(self.d // self.group):
            for mm in cutlass.range_constexpr(gm):
                for h in cutlass.range_constexpr(2):
                    d = 16 * (gi * gm + mm) + 8 * h + g
                    mVp[page, head, off // self.nr, d, 4 * warp_idx + c] = Int32(words[(gi, mm, h)])
