"""Split-KV decode attention over a packed low-bit KV cache (sm80: mma.sync, ldmatrix, cp.async).

One CTA = (split, KV head, sequence); 4 warps along the sequence (Wm = 1, Wn = 4).  Each
packed tile is one residual block of ``Nr`` tokens; warp ``w`` owns tokens
``[w*T, (w+1)*T)`` of it (T = Nr/4), which is exactly chunk ``w`` of the packed V rows
(K2V4: chunks ``2 (w % 2)`` and ``2 (w % 2) + 1`` of the block's 4-bit V tile ``w // 2``).

Query transformation: the ``gq`` query heads that share a KV head form the N side (8 or
16 columns) of transposed products, so the sequence and the head dim fill the M = 16
rows of ``mma.sync.m16n8k16`` instead of padding 4 heads to 16 rows::

    S^T = K  . Q^T     A = K     (tokens x D, dequantized from packed words)
    O^T = V^T. P^T     A = V^T   (D x tokens, dequantized), B = P^T (movmatrix of S^T)

Both A operands come from the same fragment-induced packed rows (``layouts.sm80``): one
ldmatrix x4 per 32 rows of a chunk hands every lane its four words, ``lop3`` turns each
word into exact half2 codes and one packed fma applies (scale, zero).  Softmax is online
per warp; the four warps merge through shared memory at the end of the split
(LSE-weighted), and splits are merged by the combine kernel.  The 16-bit residual
block (``len % Nr`` tokens) is the last tile, read with plain ldmatrix in sub-tiles of
64 tokens (16 per warp); a format's 16-bit sink tokens (the first ``sinks`` of the
sequence, ``[B, sinks, Hkv, D]`` buffers) are more such sub-tiles, attended by split 0.
Tiles stream through a ``num_stages`` cp.async pipeline; all four warps share one barrier
per tile.

FP4 caches (``fp4``: NVFP4 / MXFP4) hold e2m1 codes in natural order, the bytes
Blackwell's block-scaled MMA reads, and their block scales in basic chunks
(``layouts.sm100``).  ldmatrix hands lane ``c`` of a quad the values ``8 c .. 8 c + 7`` of
each 32-value segment, so the kernel takes Q's channels (and the 16-bit K tokens') and
K's rows in that order (``layouts.sm80.fp4_position``): the scores' rows then come out in
the order in which V's natural bytes reach the P V fragments, and no byte of the packed
cache moves.  ``E2M1Dequant`` turns each byte into a half2; one packed fma applies the
block scale (no zero point).
"""

from __future__ import annotations

import operator
from typing import Optional, Type

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32, const_expr
from cutlass.cute.nvgpu import warp

from ..layouts import resources, sm80, sm100
from ..layouts.packing import LN_2
from . import ptx
from .combine import MERGE_AHEAD, HeadMerge
from .copy import copy_rows, load_a_fragments, load_packed_words, wait_all
from .dequant import E2M1Dequant, WordDequant, broadcast_params, fp4_scale_pair, split_params
from .reduce import across_rows
from .tensors import (aligned_ptr, assume_aligned, commit_length, first_page, one_token, page_of,
                      split_tiles, wait_for_previous_kernel)

NUM_WARPS = sm80.WARPS_N
NUM_THREADS = resources.WARP * NUM_WARPS
RES_ROWS_PER_WARP = 16  # residual sub-tile: one m16 tile of tokens per warp
RES_SUBTILE = RES_ROWS_PER_WARP * NUM_WARPS
SMEM_ALIGN = 1024


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def query_views(mQ: cute.Tensor, mO: cute.Tensor, split: bool):
    """The kernels' (B, Hq, D) views of the query and of the unsplit output (the split
    output is the fp32 partials, already (S, B, Hq, D))."""
    return one_token(mQ), (mO if split else one_token(mO))


class PackedDecodeConfig:
    """The constexpr facts every packed-cache decode kernel derives from its configuration:
    the packed tile (``Nr`` tokens) and the bytes its K / V words and params take.  The
    sm80 and sm90 decode kernels both start from it."""

    # splits a thread of the in-kernel merge loads at once (``HeadMerge``): 16 spill in
    # the sm80 kernel's register budget (64 bytes, the appending 4-bit split decode)
    merge_ahead = MERGE_AHEAD

    def __init__(self, dtype: Type[cutlass.Numeric], bits: int, k_mode: str, group_size: int,
                 head_dim: int, heads_tile: int, split: bool, pdl: bool = False, sinks: int = 0,
                 v_bits: int = 0, tq: int = 1, fp4: Optional[str] = None, append: bool = False,
                 merge_splits: bool = False):
        assert dtype in (cutlass.Float16, cutlass.BFloat16)
        assert heads_tile in sm80.HEADS_TILES
        self.dtype = dtype
        self.is_bf16 = dtype is cutlass.BFloat16
        # K's and V's code widths (KVFormat.bits / v_bits)
        self.bits = bits
        self.v_bits = v_bits or bits
        self.k_channel = k_mode == "channel"
        self.group = group_size
        self.d = head_dim
        self.nh = heads_tile
        self.split = split
        # programmatic dependent launch (sm_90+): the CTAs start while the previous kernel
        # on the stream (the append that wrote the cache) drains and wait for it before the
        # first read; the combine that follows launches early the same way
        self.pdl = pdl
        # 16-bit sink tokens ahead of the packed blocks (KVFormat.sink_tokens): positions of
        # packed tiles count from the token after them
        self.sinks = sinks
        # query tokens per sequence: with tq > 1 the query rows of a KV head are (token,
        # head) pairs, token-major (the host orders them so), and token j of the newest tq
        # sees the first len - tq + 1 + j tokens (a causal mask on every softmax step)
        self.tq = tq
        # tokens of one packed tile: the wider tile of the two widths (K4V2 and K2V4: the
        # 2-bit tile of 256); V is packed in tiles of its own width (KVFormat.v_tile), so a
        # tile holds one V tile, or two 128-token 4-bit V tiles beside 2-bit K (K2V4)
        self.nr = max(sm80.residual_block(bits), sm80.residual_block(self.v_bits))
        self.v_tile = sm80.residual_block(self.v_bits)
        self.v_tiles = self.nr // self.v_tile
        self.kpw_k = sm80.k_blocks_per_word(bits)  # 16-wide k-blocks per packed K word
        self.kpw_v = sm80.k_blocks_per_word(self.v_bits)  # ... per packed V word
        self.wk = sm80.words_per_row(bits, head_dim)  # words of a packed K row (a token)
        self.wv = sm80.words_per_row(self.v_bits, self.v_tile)  # words of a V tile's row (a channel)
        self.groups_v = head_dim // group_size
        # one tile's packed words and (scale, zero) words
        self.bytes_kp = self.nr * self.wk * 4
        self.bytes_vp = self.v_tiles * head_dim * self.wv * 4
        self.words_ks = (self.nr // group_size * head_dim) if self.k_channel else self.nr * self.groups_v
        self.words_vs = self.nr * self.groups_v
        # FP4 (KVFormat.fp4): e2m1 codes in natural order, block scales in basic chunks
        # (layouts.sm100) per 128-token K tile and per V tile
        self.fp4 = fp4
        # FP4's natural order permutes the tokens of a 32-token segment (sm80: the scores'
        # rows; sm90: P^T's columns), so positions inside a packed tile: no causal mask yet
        assert not (fp4 and tq > 1), "FP4 caches take one query token per sequence"
        if fp4:
            self.k_chunks = sm100.sf_chunks(head_dim // group_size)
            self.v_chunks = (sm100.sf_row_chunks(head_dim), sm100.sf_chunks(self.v_tile // group_size))
            self.words_ks = self.k_chunks * sm100.SF_CHUNK_WORDS
            self.words_vs = self.v_chunks[0] * self.v_chunks[1] * sm100.SF_CHUNK_WORDS
        # ``call_append``: the launch first appends one new token per sequence (into the
        # 16-bit residual block; the host sends only tokens that complete no block and fall
        # past the sinks) and attends over it too, so an eager step's append costs no launch
        if append and (tq != 1 or fp4):
            raise ValueError(f"the appending decode takes one query token of an integer format, got tq={tq}, "
                             f"fp4={fp4!r}")
        self.append = append
        # appending with splits, or split with ``merge_splits`` (``call_merged``), the last CTA
        # of a (sequence, KV head) merges the splits (``merge_if_last``, ``HeadMerge``: every
        # query row of the KV head at once): the step is one launch, no combine after it.
        # sm90's integer 4-bit kernels merge so (``kernels_sm90.backend.merges_in_kernel``:
        # the combine's GPU time, one launch less); merged one row after another
        # (``SplitMerge``, two round trips each) it had cost more than the combine launch
        # (H100, sm90 fp16 GQA 4, us, combine / merged,
        # profiles/h100/variants_merge_splits_h100.json: 4c128 B=1 N=4K 11.14 / 17.17, N=128K
        # 56.78 / 62.91)
        self.merges = split and (append or merge_splits)
        self.merger = HeadMerge(head_dim, self.merge_ahead)
        self.merge_smem_bytes = 16  # the "last" flag

    # ---- entry points: one calling convention for every packed decode kernel, so the
    # backends share one ``DecodePlan``; each kernel class traces its ``launch`` ----------
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (B, 1, Hq, D) dtype
        mKp: cute.Tensor,  # (P, Hkv, page, 2*wk) f16 view of the packed K words
        mKs: cute.Tensor,  # K params (int32), see KVFormat.k_params_shape
        mVp: cute.Tensor,  # (P, Hkv, page/Nr, D, 2*wv) f16 view of the packed V words
        mVs: cute.Tensor,  # (P, Hkv, page/16, D/G, 16) int32
        mKr: cute.Tensor,  # (B, Nr, Hkv, D) dtype residual
        mVr: cute.Tensor,
        mKsink: cute.Tensor,  # (B, sinks, Hkv, D) dtype sink tokens (any such tensor when sinks = 0)
        mVsink: cute.Tensor,
        mSeqlens: cute.Tensor,  # (B,) int32
        mBlockTable: cute.Tensor,  # (B, max_pages) int32
        mO: cute.Tensor,  # split: (S, B, Hq, D) f32; else (B, 1, Hq, D) dtype
        mLSE: cute.Tensor,  # split: (S, B, Hq) f32; else (B, Hq) f32
        softmax_scale_log2: Float32,
        tail_weight: Int32,  # the splits' partition (split_tiles; TAIL_UNIT: even)
        stream,
    ):
        self.launch(mQ, mKp, mKs, mVp, mVs, mKr, mVr, mKsink, mVsink, mSeqlens, mBlockTable, mO, mLSE,
                    softmax_scale_log2, tail_weight, stream, None)

    @cute.jit
    def call_append(self, mQ: cute.Tensor, mKnew: cute.Tensor, mVnew: cute.Tensor, mCommits: cute.Tensor,
                    mKp: cute.Tensor, mKs: cute.Tensor, mVp: cute.Tensor, mVs: cute.Tensor, mKr: cute.Tensor,
                    mVr: cute.Tensor, mKsink: cute.Tensor, mVsink: cute.Tensor, mSeqlens: cute.Tensor,
                    mBlockTable: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor, mOut: cute.Tensor,
                    mLout: cute.Tensor, mArrivals: cute.Tensor, softmax_scale_log2: Float32, tail_weight: Int32,
                    stream):
        """``cache.append(k_new, v_new)`` and the decode after it in one launch (``append``):
        ``mKnew`` / ``mVnew`` ``[B, 1, Hkv, D]`` (heads D apart), ``mCommits`` the cache's
        per-sequence commit counters (zero, and left so); with ``split``, the last CTA of
        each (sequence, KV head) merges the partials (mO, mLSE) into ``mOut`` ``[B, 1, Hq,
        D]`` and ``mLout`` ``[B, Hq]``, counted on ``mArrivals`` ``[B * Hkv]`` (zero, and
        left so; unsplit, the three are not read); the rest as ``__call__``'s."""
        self.launch(mQ, mKp, mKs, mVp, mVs, mKr, mVr, mKsink, mVsink, mSeqlens, mBlockTable, mO, mLSE,
                    softmax_scale_log2, tail_weight, stream, (mKnew, mVnew, mCommits, mOut, mLout, mArrivals))

    @cute.jit
    def call_merged(self, mQ: cute.Tensor, mKp: cute.Tensor, mKs: cute.Tensor, mVp: cute.Tensor, mVs: cute.Tensor,
                    mKr: cute.Tensor, mVr: cute.Tensor, mKsink: cute.Tensor, mVsink: cute.Tensor,
                    mSeqlens: cute.Tensor, mBlockTable: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                    mOut: cute.Tensor, mLout: cute.Tensor, mArrivals: cute.Tensor, softmax_scale_log2: Float32,
                    tail_weight: Int32, stream):
        """The split decode (``merge_splits``) with its splits merged in the kernel: the last
        CTA of each (sequence, KV head) merges the partials (mO, mLSE) into ``mOut`` ``[B,
        1, Hq, D]`` and ``mLout`` ``[B, Hq]``, counted on ``mArrivals`` ``[B * Hkv]`` (zero,
        and left so), as ``call_append``'s; the rest as ``__call__``'s."""
        self.launch(mQ, mKp, mKs, mVp, mVs, mKr, mVr, mKsink, mVsink, mSeqlens, mBlockTable, mO, mLSE,
                    softmax_scale_log2, tail_weight, stream, (mOut, mLout, mArrivals))

    @cute.jit
    def merge_if_last(self, mO, mLSE, new, batch, head_kv, gq, smem_ptr, tid, sync=cute.arch.sync_threads):
        """``merges`` (``append`` or ``merge_splits``, and ``split``), after this CTA wrote its
        partials (mO, mLSE): its 128 threads (``tid`` 0-127, ``sync`` their barrier) count
        the CTA in on the (sequence, KV head)'s arrival counter
        (``new[-1]``); the last CTA to arrive resets it and merges every split of the KV
        head's ``gq`` query rows into the output ``new[-3]`` and its LSE ``new[-2]``
        (``HeadMerge``).  ``smem_ptr``: ``merge_smem_bytes`` of shared memory no one else
        uses by then."""
        if const_expr(self.merges):
            mOut, mLout, mArrivals = one_token(new[-3]), new[-2], new[-1]
            num_splits, heads, _ = cute.arch.grid_dim()
            s_last = cute.make_tensor(cute.recast_ptr(smem_ptr, dtype=cutlass.Int32), cute.make_layout(1))
            # The barrier orders every thread's partials before thread 0's count-in, whose
            # release (acq_rel at GPU scope) publishes them with it; the last CTA's acquire in
            # the same atomic and the barrier after it order its threads' loads after every
            # split's stores (causality is transitive: one fence, not one a thread, as
            # CUTLASS's split-K semaphore)
            sync()
            if tid == 0:
                slot = batch * heads + head_kv
                arrived = cute.arch.atomic_add(mArrivals.iterator + slot, cutlass.Int32(1), sem="acq_rel",
                                               scope="gpu")
                s_last[0] = cutlass.Int32(0)
                if arrived == num_splits - 1:
                    mArrivals[slot] = cutlass.Int32(0)
                    s_last[0] = cutlass.Int32(1)
            sync()
            if s_last[0] != 0:
                self.merger.merge(mO, mLSE, mOut, mLout, batch, head_kv * gq, gq, tid)

    @cute.jit
    def sequence_length(self, mSeqlens, new, batch, num_splits, tid):
        """The tokens sequence ``batch`` attends over: its length, one more with ``append``
        (the new token is the sequence's last).  Appending, every CTA counts itself in once
        it has read the old length and the last one stores the new (``commit_length``), so
        no CTA of the launch sees it; all the CTA's threads call this."""
        seqlen = mSeqlens[batch]
        if const_expr(self.append):
            seqlen = seqlen + 1
            _, heads, _ = cute.arch.grid_dim()
            commit_length(mSeqlens, new[2], batch, seqlen, num_splits * heads, tid)
        return seqlen

    @cute.jit
    def store_new_token(self, mKnew, mVnew, mKr, mVr, batch, head_kv, row, tid, threads: cutlass.Constexpr[int]):
        """``append``: the new token's K and V rows of this head into residual row ``row``,
        by ``threads`` threads; the caller reads the block back after a barrier (the fence
        makes the stores visible to the CTA's cp.async reads)."""
        for i in cutlass.range(tid, self.d, threads, unroll=1):
            mKr[batch, row, head_kv, i] = mKnew[batch, 0, head_kv, i]
            mVr[batch, row, head_kv, i] = mVnew[batch, 0, head_kv, i]
        cute.arch.fence_acq_rel_cta()

    @cute.jit
    def causal_limits(self, seqlen, rows_per_kv_head, lane):
        """Multi-token queries: per head column a thread holds (``2 * (nh // 8)``, ordered
        as the MMA accumulators' columns ``8 nt + 2 (lane % 4) + v0``), the position of the
        last token its query token may see; None for one query token."""
        lim = None
        if const_expr(self.tq > 1):
            lim = cute.make_rmem_tensor((sm80.head_columns(self.nh),), cutlass.Int32)
            heads = rows_per_kv_head // self.tq  # query heads per KV head
            for nt in cutlass.range_constexpr(self.nh // 8):
                for v0 in cutlass.range_constexpr(2):
                    row = 8 * nt + 2 * (lane % 4) + v0
                    lim[2 * nt + v0] = seqlen - self.tq + row // heads
        return lim

    @cute.jit
    def copy_fp4_order(self, gsrc, sdst, valid_rows, tid, threads: cutlass.Constexpr[int]):
        """``gsrc`` (rows, D) -> ``sdst`` with the channels in the fragment order of FP4's
        natural K rows (column ``L`` holds channel ``sm80.fp4_position(L)``), moved as
        16-bit pairs (the order keeps them); rows >= ``valid_rows`` zero.  Q and the 16-bit
        K tokens (residual, sinks) meet the packed K in the same channel order this way."""
        rows = cute.size(sdst, mode=[0])
        perm = sm80.make_fp4_perm(self.d // sm80.FP4_SEGMENT)
        for i in cutlass.range(tid, rows * self.d // 2, threads, unroll=1):
            row, col = i // (self.d // 2), 2 * (i % (self.d // 2))
            src = perm(col)
            x0, x1 = self.dtype(0.0), self.dtype(0.0)
            if row < valid_rows:
                x0 = gsrc[row, src]
                x1 = gsrc[row, src + 1]
            sdst[row, col] = x0
            sdst[row, col + 1] = x1

    @cute.jit
    def token_counts(self, seqlen):
        """(sink tokens, the rest) of a sequence of ``seqlen`` tokens."""
        n_sink = cutlass.Int32(0)
        if const_expr(self.sinks > 0):
            n_sink = cutlass.min(seqlen, self.sinks)
        return n_sink, seqlen - n_sink


class DecodeSm80(PackedDecodeConfig):
    """Packed-cache decode attention; constexpr configuration in ``__init__``."""

    def __init__(
        self,
        dtype: Type[cutlass.Numeric],
        bits: int,
        k_mode: str,
        group_size: int,
        head_dim: int,
        heads_tile: int,
        split: bool,
        num_stages: int = 0,
        min_blocks_per_sm: int = 0,
        pdl: bool = False,
        sinks: int = 0,
        v_bits: int = 0,
        tq: int = 1,
        fp4: Optional[str] = None,
        append: bool = False,
        early_loads: bool = True,
    ):
        super().__init__(dtype, bits, k_mode, group_size, head_dim, heads_tile, split, pdl, sinks, v_bits, tq, fp4,
                         append)
        self.min_blocks_per_sm = min_blocks_per_sm  # caps registers so that many CTAs fit an SM
        # The first tiles' cp.asyncs wait on two dependent global loads after the PDL wait
        # (the sequence length, which places the split's tiles, then their block-table
        # entries), and Q's waits on the length too.  ``early_loads`` issues Q's copy and
        # the sequence's first block-table entry (what every tile of an unpaged cache and
        # the first page's tiles of a paged one take: ``page_of``'s ``first``) beside the
        # length's load: one round trip less before the first tiles (as ``DecodeSm90``'s).
        # H200 (sm80 kernels on Hopper), fp16 GQA 4, one run, us, without / with
        # (profiles/h200/variants_sm80_early_loads.json): 2t64 B=1 N=4K 11.94 / 11.74, 128K
        # 51.58 / 50.94, B=16 N=64K 323.4 / 316.4; 4c128 12.29 / 11.97, 62.61 / 61.50,
        # 362.9 / 355.4
        self.early_loads = early_loads
        self.t = self.nr // NUM_WARPS  # tokens per warp per tile
        # 16-byte chunks of V rows those tokens span: one, or two of a 4-bit V tile (K2V4)
        self.cpw_v = self.t // sm80.chunk_columns(self.v_bits)
        # shared memory per stage (bytes)
        self.stage_bytes = _round_up(self.bytes_kp + self.bytes_vp + 4 * (self.words_ks + self.words_vs), 128)
        self.num_stages = num_stages or (3 if head_dim <= 128 else 2)
        self.q_bytes = _round_up(heads_tile * head_dim * 2, 128)
        self.res_bytes = 2 * RES_SUBTILE * head_dim * 2
        self.epi_bytes = NUM_WARPS * (head_dim * heads_tile + 2 * heads_tile) * 4
        self.union_bytes = max(self.num_stages * self.stage_bytes, self.res_bytes, self.epi_bytes)
        self.smem_bytes = self.q_bytes + self.union_bytes
        assert self.union_bytes >= self.merge_smem_bytes  # (the union hosts the split merge)

    # ---------------------------------------------------------------------------------
    # Host side: layouts, atoms, launch
    # ---------------------------------------------------------------------------------
    def launch(self, mQ, mKp, mKs, mVp, mVs, mKr, mVr, mKsink, mVsink, mSeqlens, mBlockTable, mO, mLSE,
               softmax_scale_log2, tail_weight, stream, new):
        """(plain Python, traced inside ``PackedDecodeConfig``'s entry points, ``__call__`` and
        ``call_append``)"""
        mQ, mO = query_views(mQ, mO, self.split)
        num_splits = mO.shape[0] if const_expr(self.split) else 1
        grid = (num_splits, mKr.shape[2], mKr.shape[0])
        self.kernel(mQ, mKp, mKs, mVp, mVs, mKr, mVr, mKsink, mVsink, mSeqlens, mBlockTable, mO, mLSE,
                    softmax_scale_log2, tail_weight, new).launch(
            grid=grid, block=[NUM_THREADS, 1, 1], stream=stream, min_blocks_per_mp=self.min_blocks_per_sm,
            preferred_smem_carveout=100, use_pdl=self.pdl)

    # ---------------------------------------------------------------------------------
    # Device side
    # ---------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, mQ, mKp, mKs, mVp, mVs, mKr, mVr, mKsink, mVsink, mSeqlens, mBlockTable, mO, mLSE,
               softmax_scale_log2: Float32, tail_weight: Int32, new):
        tid, _, _ = cute.arch.thread_idx()
        # (the grid's own order: sm80 splits evenly, and ``split_coords``' remap cost the FP4
        # kernel two registers past its residency model)
        split_idx, head_kv, batch = cute.arch.block_idx()
        num_splits, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(tid // 32)
        lane = tid % 32
        gq = mQ.shape[1] // mKr.shape[2]

        sQ, union = self.shared_tensors()  # (a static allocation: no instruction)
        wait_for_previous_kernel(self.pdl)
        first = None  # early_loads: the sequence's first block-table entry (``page_of``'s ``first``)
        if const_expr(self.early_loads):
            first = first_page(mBlockTable, batch, mKp.shape[0])
        seqlen = self.sequence_length(mSeqlens, new, batch, num_splits, tid)
        if const_expr(self.early_loads):  # (issued beside the length's load, which it does not wait for)
            self.load_q(mQ, sQ, batch, head_kv, gq, tid)
            cute.arch.cp_async_commit_group()
        n_sink, n_rest = self.token_counts(seqlen)
        tile_begin, packed_end, has_residual, n_res = split_tiles(n_rest, self.nr, split_idx, num_splits,
                                                                  tail_weight)
        lim = self.causal_limits(seqlen, gq, lane)

        mma = sm80.make_mma(self.dtype)
        thr_mma = mma.get_slice(lane)
        if const_expr(self.fp4):
            dq_k = dq_v = E2M1Dequant(self.is_bf16)
        else:
            dq_k, dq_v = WordDequant(self.bits, self.is_bf16), WordDequant(self.v_bits, self.is_bf16)

        # ---- Q: global -> smem (rows >= gq zero) -> B fragments --------------------
        if const_expr(not self.early_loads):
            self.load_q(mQ, sQ, batch, head_kv, gq, tid)
            cute.arch.cp_async_commit_group()

        # ---- pipeline prologue ------------------------------------------------------
        for s in cutlass.range_constexpr(self.num_stages - 1):
            if tile_begin + s < packed_end:
                self.load_tile(mKp, mKs, mVp, mVs, mBlockTable, batch, head_kv, tile_begin + s,
                               union + s * self.stage_bytes, tid, first)
            cute.arch.cp_async_commit_group()

        cute.arch.cp_async_wait_group(self.num_stages - 1)
        cute.arch.sync_threads()
        tQrQ = self.q_fragments(mma, thr_mma, sQ, lane)

        acc_o = cute.make_rmem_tensor(thr_mma.partition_shape_C((self.d, self.nh)), Float32)
        acc_o.fill(0.0)
        row_max = cute.make_rmem_tensor((sm80.head_columns(self.nh),), Float32)
        row_sum = cute.make_rmem_tensor((sm80.head_columns(self.nh),), Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)

        # ---- packed tiles -----------------------------------------------------------
        for tile in cutlass.range(tile_begin, packed_end, unroll=1):
            it = tile - tile_begin
            cute.arch.cp_async_wait_group(self.num_stages - 2)
            cute.arch.sync_threads()
            nxt = tile + self.num_stages - 1
            if nxt < packed_end:
                self.load_tile(mKp, mKs, mVp, mVs, mBlockTable, batch, head_kv, nxt,
                               union + ((it + self.num_stages - 1) % self.num_stages) * self.stage_bytes, tid,
                               first)
            cute.arch.cp_async_commit_group()
            stage = union + (it % self.num_stages) * self.stage_bytes
            # V's words are fetched first so their smem latency hides under Q.K^T and softmax
            v_words = self.load_v_words(stage, warp_idx, lane)
            acc_s = self.scores_packed(mma, thr_mma, dq_k, tQrQ, stage, warp_idx, lane)
            self.online_softmax(acc_s, acc_o, row_max, row_sum, softmax_scale_log2, None, warp_idx * self.t,
                                lim, n_sink + tile * self.nr)
            self.pv_packed(mma, thr_mma, dq_v, acc_s, acc_o, stage, v_words, warp_idx, lane)

        # ---- the 16-bit residual block ---------------------------------------------
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()
        if has_residual:
            if const_expr(self.append):  # its sub-tile's barrier orders these stores before the reads
                self.store_new_token(new[0], new[1], mKr, mVr, batch, head_kv, n_res - 1, tid, NUM_THREADS)
            self.sixteen_bit_tokens(mma, thr_mma, tQrQ, mKr, mVr, union, batch, head_kv, n_res, acc_o, row_max,
                                    row_sum, softmax_scale_log2, warp_idx, lane, tid, lim, n_sink + n_rest - n_res)
        if const_expr(self.sinks > 0):  # the sink tokens, 16-bit as the residual, in split 0
            if split_idx == 0:
                self.sixteen_bit_tokens(mma, thr_mma, tQrQ, mKsink, mVsink, union, batch, head_kv, n_sink, acc_o,
                                        row_max, row_sum, softmax_scale_log2, warp_idx, lane, tid, lim, 0)

        # ---- merge the warps, write this split ---------------------------------------
        self.epilogue(acc_o, row_max, row_sum, union, mO, mLSE, batch, head_kv, split_idx, gq,
                      warp_idx, lane, tid)
        self.merge_if_last(mO, mLSE, new, batch, head_kv, gq, union, tid)

    # ---------------------------------------------------------------------------------
    # Loads
    # ---------------------------------------------------------------------------------
    def copy_words(self, gsrc, sdst, words: int, tid):
        """cp.async a contiguous run of ``words`` int32 words (a multiple of 4), seen as rows
        of one 16-byte chunk."""
        rows = cute.make_layout((words // 4, 4), stride=(4, 1))
        copy_rows(assume_aligned(cute.make_tensor(gsrc, rows)), cute.make_tensor(sdst, rows), tid, NUM_THREADS,
                  0, False)

    def stage_tensors(self, stage):
        """The four smem tensors of one pipeline stage (stage bases are 128-byte aligned)."""
        stage = aligned_ptr(stage, 128)
        kp = cute.make_tensor(cute.recast_ptr(stage, dtype=cutlass.Float16),
                              sm80.make_smem_layout(self.nr, 4 * self.wk))
        vp = cute.make_tensor(cute.recast_ptr(stage + self.bytes_kp, dtype=cutlass.Float16),
                              sm80.make_smem_layout(self.v_tiles * self.d, 4 * self.wv))  # V tiles stacked
        ks_ptr = cute.recast_ptr(stage + self.bytes_kp + self.bytes_vp, dtype=cutlass.Int32)
        vs_ptr = cute.recast_ptr(stage + self.bytes_kp + self.bytes_vp + 4 * self.words_ks, dtype=cutlass.Int32)
        if const_expr(self.fp4):  # basic chunks: K (chunks, 128 words); V (row chunks, chunks, 128 words)
            w = sm100.SF_CHUNK_WORDS
            ks = cute.make_tensor(ks_ptr, cute.make_layout((self.k_chunks, w), stride=(w, 1)))
            vs = cute.make_tensor(vs_ptr, cute.make_layout((*self.v_chunks, w), stride=(self.v_chunks[1] * w, w, 1)))
            return kp, vp, ks, vs
        if const_expr(self.k_channel):
            ks = cute.make_tensor(ks_ptr, cute.make_layout((self.nr // self.group, self.d), stride=(self.d, 1)))
        else:
            ks = cute.make_tensor(ks_ptr, cute.make_layout((self.nr, self.groups_v), stride=(self.groups_v, 1)))
        vs = cute.make_tensor(vs_ptr, cute.make_layout((self.nr // 16, self.groups_v, 16),
                                                       stride=(16 * self.groups_v, 16, 1)))
        return kp, vp, ks, vs

    def shared_tensors(self):
        """(sQ, the union's base): the CTA's shared memory, Q's tile first."""
        smem = cutlass.memory.SmemAllocator()
        base = smem.allocate_array(cutlass.Uint8, self.smem_bytes, byte_alignment=SMEM_ALIGN)
        sQ = cute.make_tensor(cute.recast_ptr(base, dtype=self.dtype), sm80.make_smem_layout(self.nh, 2 * self.d))
        return sQ, base + self.q_bytes

    @cute.jit
    def load_tile(self, mKp, mKs, mVp, mVs, mBlockTable, batch, head_kv, tile, stage, tid, first=None):
        """Packed tile ``tile`` into ``stage`` (every thread's share of its cp.asyncs);
        ``first``: the sequence's first block-table entry, loaded already (``early_loads``)."""
        page, off = page_of(mBlockTable, batch, tile * self.nr, mKp.shape[2], mKp.shape[0], first)
        kp, vp, ks, vs = self.stage_tensors(stage)
        gkp = cute.local_tile(mKp[page, head_kv, None, None], (self.nr, 2 * self.wk), (off // self.nr, 0))
        copy_rows(assume_aligned(gkp), kp, tid, NUM_THREADS, 0, False)
        for i in cutlass.range_constexpr(self.v_tiles):  # the block's V tiles, one under the other
            gvp = mVp[page, head_kv, off // self.v_tile + i, None, None]
            copy_rows(assume_aligned(gvp), cute.local_tile(vp, (self.d, 2 * self.wv), (i, 0)), tid, NUM_THREADS,
                      0, False)
        if const_expr(self.fp4):  # the tile's chunks are contiguous words
            self.copy_words(mKs[page, head_kv, off // self.nr, None, None].iterator, ks.iterator, self.words_ks, tid)
            self.copy_words(mVs[page, head_kv, off // self.v_tile, None, None, None].iterator, vs.iterator,
                            self.words_vs, tid)
        else:
            if const_expr(self.k_channel):
                gks = cute.local_tile(mKs[page, head_kv, None, None], (self.nr // self.group, self.d),
                                      (off // self.nr, 0))
            else:
                gks = cute.local_tile(mKs[page, head_kv, None, None], (self.nr, self.groups_v), (off // self.nr, 0))
            self.copy_words(gks.iterator, ks.iterator, self.words_ks, tid)
            gvs = cute.local_tile(mVs[page, head_kv, None, None, None], (self.nr // 16, self.groups_v, 16),
                                  (off // self.nr, 0, 0))
            self.copy_words(gvs.iterator, vs.iterator, self.words_vs, tid)

    @cute.jit
    def load_q(self, mQ, sQ, batch, head_kv, gq, tid):
        q_rows = mQ[batch, None, None]  # (Hq, D)
        gQ = cute.local_tile(q_rows, (self.nh, self.d), (0, 0))
        # the kv head's query rows start at head_kv * gq; rows >= gq are padding
        gQ = assume_aligned(cute.make_tensor(gQ.iterator + head_kv * gq * mQ.stride[1], gQ.layout))
        if const_expr(self.fp4):
            self.copy_fp4_order(gQ, sQ, gq, tid, NUM_THREADS)
        else:
            copy_rows(gQ, sQ, tid, NUM_THREADS, gq, True)

    def q_fragments(self, mma, thr_mma, sQ, lane):
        """Q^T as the B operand (k = head dim, n = query heads), kept in registers."""
        ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        copy = cute.make_tiled_copy_B(ldsm, mma)
        thr = copy.get_slice(lane)
        frag = thr_mma.make_fragment_B(thr_mma.partition_B(sQ))
        cute.copy(copy, thr.partition_S(sQ), thr.retile(frag))
        return frag

    # ---------------------------------------------------------------------------------
    # Packed tile: S^T = K Q^T
    # ---------------------------------------------------------------------------------
    def k_param_pairs(self, ks, tok0, kt, lane):
        """(scale, zero) half2 pairs for the A fragment's column halves of k-block ``kt``.

        Returns a function (m-tile, row half, column half) -> (scale2, zero2); each pair is
        loaded and split once per tile.
        """
        c = lane % 4
        cache = {}
        if const_expr(self.k_channel):
            # a warp's T tokens lie in one group (G >= T) or span T/G whole groups
            base = tok0 // self.group

            def pairs(mt, h, ch):
                local = (16 * mt) // self.group  # 0 when G >= T (16 * mt < T)
                if (local, ch) not in cache:
                    row = ks[base + local, None]
                    pos = sm80.param_position(kt, c, 2 * ch)
                    p0, p1 = Uint32(row[pos]), Uint32(row[pos + 1])
                    cache[(local, ch)] = split_params(p0, p1)
                return cache[(local, ch)]

            return pairs
        gi = (16 * kt) // self.group

        def pairs(mt, h, ch):
            if (mt, h) not in cache:
                p = Uint32(ks[tok0 + 16 * mt + 8 * h + lane // 4, gi])
                cache[(mt, h)] = broadcast_params(p)
            return cache[(mt, h)]

        return pairs

    def k_scales_fp4(self, ks, warp_idx, kt, lane):
        """FP4: (scale2, None) of the A fragment's rows for k-block ``kt``; the lane's eight
        channels ``32 (kt // 2) + 8 c ..`` share one block scale per token.  Row ``16 mt +
        8 h + g`` of the warp's fragment is token ``32 warp + fp4_position(..)``."""
        c, g = lane % 4, lane // 4
        block = sm80.fp4_lane_scale_column(kt // 2, c, self.group)  # scale column of the row
        perm = sm80.make_fp4_perm(1)
        cache = {}

        def pairs(mt, h, ch):
            if (mt, h) not in cache:
                tok = perm(16 * mt + 8 * h + g)  # token within the warp's segment
                _, col_chunk, w, byte = sm100.sf_location(sm80.FP4_SEGMENT * warp_idx + tok, block)
                cache[(mt, h)] = (fp4_scale_pair(Uint32(ks[col_chunk, w]), byte, self.fp4, self.is_bf16), None)
            return cache[(mt, h)]

        return pairs

    @cute.jit
    def scores_packed(self, mma, thr_mma, dq, tQrQ, stage, warp_idx, lane):
        kp, _, ks, _ = self.stage_tensors(stage)
        slice_k = cute.local_tile(kp, (self.t, 2 * self.wk), (warp_idx, 0))
        if const_expr(self.fp4):  # the warp's 32 tokens in fragment order: the scores' rows
            slice_k = cute.composition(slice_k, cute.make_layout((sm80.FP4_PERM_SHAPE, 2 * self.wk),
                                                                 stride=(sm80.FP4_PERM_STRIDE, self.t)))
        words = load_packed_words(slice_k, lane)
        acc_s = cute.make_rmem_tensor(thr_mma.partition_shape_C((self.t, self.nh)), Float32)
        acc_s.fill(0.0)
        mt_count = self.t // 16
        tok0 = warp_idx * self.t
        for kt in cutlass.range_constexpr(self.d // 16):
            chunk, ktl = kt // self.kpw_k, kt % self.kpw_k
            frag_a = cute.make_rmem_tensor(thr_mma.partition_shape_A((self.t, 16)), self.dtype)
            frag_a32 = cute.recast_tensor(frag_a, Uint32)
            if const_expr(self.fp4):
                params = self.k_scales_fp4(ks, warp_idx, kt, lane)
            else:
                params = self.k_param_pairs(ks, tok0, kt, lane)
            for mt in cutlass.range_constexpr(mt_count):
                for h in cutlass.range_constexpr(2):
                    i = 2 * (mt % 2) + h
                    word = words[(i, 0), mt // 2, chunk]
                    codes = dq.codes(word, (2 * ktl, 2 * ktl + 1))
                    for ch in cutlass.range_constexpr(2):
                        s2, z2 = params(mt, h, ch)
                        frag_a32[(0, h, ch), mt, 0] = dq.scale(codes[2 * ktl + ch], s2, z2)
            cute.gemm(mma, acc_s, frag_a[None, None, 0], tQrQ[None, None, kt], acc_s)
        return acc_s

    # ---------------------------------------------------------------------------------
    # Softmax (online, per warp; S^T: rows = tokens, columns = query heads)
    # ---------------------------------------------------------------------------------
    @cute.jit
    def online_softmax(self, acc_s, acc_o, row_max, row_sum, scale_log2, valid_tokens, tok0, lim=None, abs0=0):
        """Scale, mask (tokens >= valid_tokens when given; with ``lim`` (``causal_limits``)
        also tokens past a column's limit, at sequence position ``abs0 + tok0 + row``),
        exponentiate acc_s in place."""
        mt_count = cute.size(acc_s, mode=[1])
        for nt in cutlass.range_constexpr(self.nh // 8):
            for v0 in cutlass.range_constexpr(2):
                col = 2 * nt + v0
                m_tile = -Float32.inf
                for mt in cutlass.range_constexpr(mt_count):
                    for v1 in cutlass.range_constexpr(2):
                        x = acc_s[(v0, v1), mt, nt] * scale_log2
                        if const_expr(valid_tokens is not None):
                            if tok0 + 16 * mt + 8 * v1 + (cute.arch.lane_idx() // 4) >= valid_tokens:
                                x = -Float32.inf
                        if const_expr(lim is not None):
                            if abs0 + tok0 + 16 * mt + 8 * v1 + (cute.arch.lane_idx() // 4) > lim[col]:
                                x = -Float32.inf
                        acc_s[(v0, v1), mt, nt] = x
                        m_tile = cute.arch.fmax(m_tile, x)
                m_tile = across_rows(m_tile, cute.arch.fmax)
                m_old = row_max[col]
                m_new = cute.arch.fmax(m_old, m_tile)
                # a column that has seen only masked tokens keeps -inf; exponentiate against 0
                m_use = m_new if m_new != -Float32.inf else Float32(0.0)
                alpha = cute.math.exp2(m_old - m_use, fastmath=True)
                tile_sum = Float32(0.0)
                for mt in cutlass.range_constexpr(mt_count):
                    for v1 in cutlass.range_constexpr(2):
                        p = cute.math.exp2(acc_s[(v0, v1), mt, nt] - m_use, fastmath=True)
                        acc_s[(v0, v1), mt, nt] = p
                        tile_sum += p
                row_sum[col] = row_sum[col] * alpha + tile_sum
                row_max[col] = m_new
                for mo in cutlass.range_constexpr(cute.size(acc_o, mode=[1])):
                    for v1 in cutlass.range_constexpr(2):
                        acc_o[(v0, v1), mo, nt] = acc_o[(v0, v1), mo, nt] * alpha

    def p_fragments(self, thr_mma, acc_s, tokens):
        """P^T as the B operand (k = tokens, n = heads): convert and transpose S^T tiles."""
        frag = cute.make_rmem_tensor(thr_mma.partition_shape_B((self.nh, tokens)), self.dtype)
        frag32 = cute.recast_tensor(frag, Uint32)
        for mt in range(tokens // 16):
            for nt in range(self.nh // 8):
                for v1 in range(2):
                    packed = ptx.cvt_pack_x2(acc_s[(0, v1), mt, nt], acc_s[(1, v1), mt, nt], self.is_bf16)
                    frag32[(0, v1), nt, mt] = ptx.movmatrix_trans(packed)
        return frag

    # ---------------------------------------------------------------------------------
    # Packed tile: O^T += V^T P^T
    # ---------------------------------------------------------------------------------
    def load_v_words(self, stage, warp_idx, lane):
        """The warp's ``cpw_v`` chunks of every V row, one word tensor per chunk: chunk
        ``warp`` of the one V tile, or (two 4-bit V tiles) chunks ``2 (warp % 2) ..`` of
        tile ``warp // 2``.  One 8-column slice per chunk: a 16-column slice of the 64-byte
        swizzled rows read the neighbouring channel's words in the right half (measured:
        K2V4 tokens 64-127 of a block took channel c + 1's values)."""
        _, vp, _, _ = self.stage_tensors(stage)
        if const_expr(self.cpw_v == 1):
            coords = [(0, warp_idx)]
        else:
            per_tile = NUM_WARPS // self.cpw_v  # warps that share a V tile
            coords = [(warp_idx // per_tile, self.cpw_v * (warp_idx % per_tile) + j) for j in range(self.cpw_v)]
        return [load_packed_words(cute.local_tile(vp, (self.d, 8), c), lane) for c in coords]

    def v_scale_fp4(self, vs, warp_idx, lane, mt, h):
        """FP4: (scale2, None) of V^T's row (channel) ``16 mt + 8 h + g``; the lane's eight
        tokens ``32 warp + 8 c ..`` share one block scale (reloaded per k-block: kept for
        the whole tile, the 2 D / 16 pairs would cost more registers than the 4-bit cap)."""
        c, g = lane % 4, lane // 4
        block = sm80.fp4_lane_scale_column(warp_idx, c, self.group)  # scale column of the tile
        row_chunk, col_chunk, w, byte = sm100.sf_location(16 * mt + 8 * h + g, block)
        return fp4_scale_pair(Uint32(vs[row_chunk, col_chunk, w]), byte, self.fp4, self.is_bf16), None

    @cute.jit
    def pv_packed(self, mma, thr_mma, dq, acc_s, acc_o, stage, words, warp_idx, lane):
        _, _, _, vs = self.stage_tensors(stage)
        frag_p = self.p_fragments(thr_mma, acc_s, self.t)
        c = lane % 4
        for kb in cutlass.range_constexpr(self.t // 16):  # the warp's k-blocks: chunk kb // kpw_v, field kt
            chunk, kt = kb // self.kpw_v, kb % self.kpw_v
            # (scale, zero) of the lane's four tokens of this k-block, per channel group
            pairs = []
            for gi in cutlass.range_constexpr(0 if self.fp4 else self.groups_v):
                row = vs[warp_idx * (self.t // 16) + kb, gi, None]
                p0, p1 = Uint32(row[4 * c]), Uint32(row[4 * c + 1])
                p2, p3 = Uint32(row[4 * c + 2]), Uint32(row[4 * c + 3])
                pairs.append((split_params(p0, p1), split_params(p2, p3)))
            frag_a = cute.make_rmem_tensor(thr_mma.partition_shape_A((self.d, 16)), self.dtype)
            frag_a32 = cute.recast_tensor(frag_a, Uint32)
            for mt in cutlass.range_constexpr(self.d // 16):
                gi = (16 * mt) // self.group
                for h in cutlass.range_constexpr(2):
                    i = 2 * (mt % 2) + h
                    word = words[chunk][(i, 0), mt // 2, 0]
                    codes = dq.codes(word, (2 * kt, 2 * kt + 1))
                    if const_expr(self.fp4):
                        v_scale = self.v_scale_fp4(vs, warp_idx, lane, mt, h)
                    for ch in cutlass.range_constexpr(2):
                        s2, z2 = v_scale if const_expr(self.fp4) else pairs[gi][ch]
                        frag_a32[(0, h, ch), mt, 0] = dq.scale(codes[2 * kt + ch], s2, z2)
            cute.gemm(mma, acc_o, frag_a[None, None, 0], frag_p[None, None, kb], acc_o)

    # ---------------------------------------------------------------------------------
    # 16-bit residual sub-tile (64 tokens, 16 per warp)
    # ---------------------------------------------------------------------------------
    @cute.jit
    def sixteen_bit_tokens(self, mma, thr_mma, tQrQ, mK, mV, union, batch, head_kv, count, acc_o, row_max, row_sum,
                           scale_log2, warp_idx, lane, tid, lim, abs_first):
        """The ``count`` 16-bit tokens of ``mK`` / ``mV`` (the residual or the sinks; row 0
        is sequence position ``abs_first``), sub-tile by sub-tile."""
        for sub in cutlass.range(0, (count + RES_SUBTILE - 1) // RES_SUBTILE, unroll=1):
            self.residual_subtile(mma, thr_mma, tQrQ, mK, mV, union, batch, head_kv, sub, count, acc_o, row_max,
                                  row_sum, scale_log2, warp_idx, lane, tid, lim, abs_first)

    @cute.jit
    def residual_subtile(self, mma, thr_mma, tQrQ, mKr, mVr, union, batch, head_kv, sub, n_res,
                         acc_o, row_max, row_sum, scale_log2, warp_idx, lane, tid, lim, abs_first):
        """Sub-tile ``sub`` of the ``n_res`` 16-bit tokens of ``mKr`` / ``mVr`` (the residual
        or the sinks; row 0 is sequence position ``abs_first``)."""
        layout = sm80.make_smem_layout(RES_SUBTILE, 2 * self.d)
        union = aligned_ptr(union, 128)
        sK = cute.make_tensor(cute.recast_ptr(union, dtype=self.dtype), layout)
        sV = cute.make_tensor(cute.recast_ptr(union + RES_SUBTILE * self.d * 2, dtype=self.dtype), layout)
        cute.arch.sync_threads()  # the previous sub-tile (or packed stage) is done with this smem
        valid = n_res - sub * RES_SUBTILE
        gK = cute.local_tile(mKr[batch, None, head_kv, None], (RES_SUBTILE, self.d), (sub, 0))
        gV = cute.local_tile(mVr[batch, None, head_kv, None], (RES_SUBTILE, self.d), (sub, 0))
        if const_expr(self.fp4):  # K's channels in Q's order (copy_fp4_order)
            self.copy_fp4_order(gK, sK, valid, tid, NUM_THREADS)
        else:
            copy_rows(assume_aligned(gK), sK, tid, NUM_THREADS, valid, True)
        copy_rows(assume_aligned(gV), sV, tid, NUM_THREADS, valid, True)
        wait_all()

        # S^T = K Q^T over this warp's 16 tokens
        sK_w = cute.local_tile(sK, (RES_ROWS_PER_WARP, self.d), (warp_idx, 0))
        frag_k = load_a_fragments(mma, sK_w, lane, False)
        acc_s = cute.make_rmem_tensor(thr_mma.partition_shape_C((RES_ROWS_PER_WARP, self.nh)), Float32)
        acc_s.fill(0.0)
        for kt in cutlass.range_constexpr(self.d // 16):
            cute.gemm(mma, acc_s, frag_k[None, None, kt], tQrQ[None, None, kt], acc_s)
        self.online_softmax(acc_s, acc_o, row_max, row_sum, scale_log2, valid, warp_idx * RES_ROWS_PER_WARP,
                            lim, abs_first + sub * RES_SUBTILE)

        # O^T += V^T P^T: V^T (D x tokens) through a transposing ldmatrix
        sVt = cute.composition(sV, cute.make_layout((self.d, RES_SUBTILE), stride=(RES_SUBTILE, 1)))
        sVt_w = cute.local_tile(sVt, (self.d, RES_ROWS_PER_WARP), (0, warp_idx))
        frag_v = load_a_fragments(mma, sVt_w, lane, True)
        frag_p = self.p_fragments(thr_mma, acc_s, RES_ROWS_PER_WARP)
        cute.gemm(mma, acc_o, frag_v[None, None, 0], frag_p[None, None, 0], acc_o)

    # ---------------------------------------------------------------------------------
    # Epilogue: merge the four warps (LSE-weighted), normalize, write
    # ---------------------------------------------------------------------------------
    @cute.jit
    def epilogue(self, acc_o, row_max, row_sum, union, mO, mLSE, batch, head_kv, split_idx, gq,
                 warp_idx, lane, tid):
        nt_count = self.nh // 8
        # full row sums of this warp: lanes that share a head column differ in lane // 4
        for col in cutlass.range_constexpr(2 * nt_count):
            row_sum[col] = across_rows(row_sum[col], operator.add)
        cute.arch.sync_threads()  # everyone is done with the pipeline / residual smem
        f32 = cute.recast_ptr(aligned_ptr(union, 128), dtype=Float32)
        s_ml = cute.make_tensor(f32, cute.make_layout((2, self.nh, NUM_WARPS), stride=(1, 2, 2 * self.nh)))
        s_o = cute.make_tensor(f32 + 2 * self.nh * NUM_WARPS,
                               cute.make_layout((self.d, self.nh, NUM_WARPS),
                                                stride=(1, self.d, self.d * self.nh)))
        c, g = lane % 4, lane // 4
        if g == 0:
            for nt in cutlass.range_constexpr(nt_count):
                for v0 in cutlass.range_constexpr(2):
                    head = 8 * nt + 2 * c + v0
                    s_ml[0, head, warp_idx] = row_max[2 * nt + v0]
                    s_ml[1, head, warp_idx] = row_sum[2 * nt + v0]
        cute.arch.sync_threads()
        # each warp rescales its O by its weight relative to the CTA-wide max
        for nt in cutlass.range_constexpr(nt_count):
            for v0 in cutlass.range_constexpr(2):
                head = 8 * nt + 2 * c + v0
                m_all = s_ml[0, head, 0]
                for w in cutlass.range_constexpr(1, NUM_WARPS):
                    m_all = cute.arch.fmax(m_all, s_ml[0, head, w])
                m_use = m_all if m_all != -Float32.inf else Float32(0.0)
                weight = cute.math.exp2(row_max[2 * nt + v0] - m_use, fastmath=True)
                for mo in cutlass.range_constexpr(self.d // 16):
                    for v1 in cutlass.range_constexpr(2):
                        d = 16 * mo + 8 * v1 + g
                        s_o[d, head, warp_idx] = acc_o[(v0, v1), mo, nt] * weight
        cute.arch.sync_threads()
        # 128 threads sum the warps and write (head, d) outputs
        total = self.d * self.nh
        for it in cutlass.range_constexpr((total + NUM_THREADS - 1) // NUM_THREADS):
            idx = tid + it * NUM_THREADS
            if idx < total:
                head = idx // self.d
                d = idx - head * self.d
                m_all = s_ml[0, head, 0]
                for w in cutlass.range_constexpr(1, NUM_WARPS):
                    m_all = cute.arch.fmax(m_all, s_ml[0, head, w])
                m_use = m_all if m_all != -Float32.inf else Float32(0.0)
                l_all = Float32(0.0)
                o = Float32(0.0)
                for w in cutlass.range_constexpr(NUM_WARPS):
                    l_all += s_ml[1, head, w] * cute.math.exp2(s_ml[0, head, w] - m_use, fastmath=True)
                    o += s_o[d, head, w]
                inv = Float32(0.0) if l_all == Float32(0.0) else 1.0 / l_all
                if head < gq:
                    qh = head_kv * gq + head
                    if const_expr(self.split):
                        mO[split_idx, batch, qh, d] = o * inv
                    else:
                        mO[batch, qh, d] = self.dtype(o * inv)
                    if d == 0:
                        lse = -Float32.inf
                        if l_all > Float32(0.0):
                            lse = (m_all + cute.math.log2(l_all, fastmath=True)) * LN_2
                        if const_expr(self.split):
                            mLSE[split_idx, batch, qh] = lse
                        else:
                            mLSE[batch, qh] = lse
