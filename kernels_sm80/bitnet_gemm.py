"""BitNet W2A8 GEMM (M > 1) on integer tensor cores: ``mma.sync.m16n8k32`` u8 x s8 -> s32.

``out[m, n] = sum_k x[m, k] * W[n, k]`` with the 2-bit weights as the MMA's A operand (16
weight rows per MMA) and the int8 tokens as B (8 tokens per MMA), so one MMA tile is 16
rows x 8 tokens and the output comes out "transposed" (rows of W along the fragment M).

Operand A straight from the packed bytes.  The contraction is permutation invariant,
so per group of 128 columns (4 tiles of 16 x 32) a lane ``(g, tq)`` loads the four words
``layouts.bitnet.mma_word_offset(g, tq, j)`` (rows ``g`` and ``g + 8``, the 16-column
chunks ``tq`` and ``tq + 4``) and decode step ``i`` of those words,
``(w >> 2i) & 0x03030303``, is its A fragment for the i-th of the group's four MMAs:
4 word loads and 7 ALU ops give 16 A registers, every loaded bit is used, and no
shuffles are needed.  The B fragment follows the same permutation: lane ``(g, tq)``
loads 16 activation bytes at ``mma_x_offset(tq, 0)`` and ``mma_x_offset(tq, 1)`` of its
token ``g``, and word ``i`` of each is its B register for MMA ``i``.

Codes, not weights.  The A operand holds the unsigned codes ``c = w + 2``; the MMA adds
``sum c x`` and the ``+2`` is removed once at the end: ``sum w x = sum c x - 2 sum x``,
where each lane sums its activation bytes with dp4a as it loads them and two butterfly
shuffles plus two indexed shuffles hand every lane the sums of its accumulator columns.

Work split (``GemmConfig``).  A CTA computes ``wn * tiles`` 16-row tiles times ``8 * mb8``
tokens; its ``wn * wk`` warps split the rows ``wn`` ways and the 128-column groups ``wk``
ways (split-K inside the CTA, partial sums reduced through shared memory).  Small M is
memory bound like the GEMV, so it needs many CTAs streaming weights (split-K, few rows
per CTA); larger M reuses each activation tile across more rows (``wn`` > 1, the warps
then share the activation loads through L1).  Weights are read once per CTA column with
``ld.global.nc.L1::no_allocate`` and the CTAs along M (grid x, fastest) share them
through L2.  The activations are small and are read through L1 from every CTA.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from ..layouts import bitnet as fmt
from .bitnet_ptx import (
    WARP,
    dp4a_ss,
    load_b32,
    load_v4,
    mma_m16n8k32_u8s8,
    segment_scale,
    shr_and,
    store_out,
)

MMA_M = 16  # weight rows per MMA
MMA_N = 8  # tokens per MMA
MMA_K = 32


@dataclass(frozen=True)
class GemmConfig:
    """``mb8``: 8-token MMA columns per CTA; ``tiles``: 16-row tiles per warp; ``wn`` x
    ``wk``: warps along rows x along K (split-K); ``unroll``: 128-column groups loaded
    before any is consumed."""

    mb8: int = 2
    tiles: int = 2
    wn: int = 1
    wk: int = 4
    unroll: int = 2
    raw: bool = False  # store the int32 sums instead of the scaled bf16 output

    @property
    def warps(self) -> int:
        return self.wn * self.wk

    @property
    def block_m(self) -> int:
        return MMA_N * self.mb8

    @property
    def block_n(self) -> int:
        return MMA_M * self.tiles * self.wn


def config_for(m: int, n: int, sms: int) -> GemmConfig:
    """Pick the tile for M tokens and N rows on a GPU with ``sms`` multiprocessors.

    Tokens per CTA: the smallest of 16 / 32 / 64 that covers M (64 beyond).  Up to 32
    tokens the GEMM is memory bound like the GEMV: 32 rows per CTA and the K groups
    split four ways, for the most CTAs streaming weights.  Beyond, two warps along the
    rows share each activation load (through L1) when that still gives every SM a CTA.
    """
    mb8 = 2 if m <= 16 else 4 if m <= 32 else 8
    wn = 1
    if mb8 == 8 and -(-m // (MMA_N * mb8)) * -(-n // (MMA_M * 2 * 2)) >= sms:
        wn = 2
    # 16 tokens: 16 accumulators a lane, room for two groups of loads in flight
    unroll = 2 if mb8 == 2 else 1
    return GemmConfig(mb8=mb8, tiles=2, wn=wn, wk=4 // wn, unroll=unroll)


def grid_for(cfg: GemmConfig, m: int, n: int):
    return (-(-m // cfg.block_m), -(-n // cfg.block_n))


class BitnetGemm:
    """Arguments: ``x`` int8 [M, K], ``w`` int8 [N, K/4] packed, ``x_scale`` fp32 [M],
    ``w_scale`` fp32 [S], ``out`` bf16 [M, N], segment ends ``e1, e2, e3``."""

    def __init__(self, cfg: GemmConfig):
        self.cfg = cfg

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,
        mW: cute.Tensor,
        mXScale: cute.Tensor,
        mWScale: cute.Tensor,
        mOut: cute.Tensor,
        e1: Int32,
        e2: Int32,
        e3: Int32,
        stream,
    ):
        cfg = self.cfg
        m = mX.shape[0]
        n = mW.shape[0]
        grid_m = (m + cfg.block_m - 1) // cfg.block_m
        grid_n = (n + cfg.block_n - 1) // cfg.block_n
        # shared memory (the split-K partials) is sized by the DSL from the allocations
        self.kernel(mX, mW, mXScale, mWScale, mOut, e1, e2, e3).launch(
            grid=[grid_m, grid_n, 1], block=[cfg.warps * WARP, 1, 1], stream=stream
        )

    def partials_size(self) -> int:
        cfg = self.cfg
        return (cfg.wk - 1) * cfg.wn * cfg.tiles * cfg.mb8 * 4 * WARP

    @cute.kernel
    def kernel(
        self,
        mX: cute.Tensor,
        mW: cute.Tensor,
        mXScale: cute.Tensor,
        mWScale: cute.Tensor,
        mOut: cute.Tensor,
        e1: Int32,
        e2: Int32,
        e3: Int32,
    ):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        bm, bn, _ = cute.arch.block_idx()
        warp = tidx // WARP
        lane = tidx % WARP
        g = lane >> 2
        tq = lane & 3
        wn_i = warp % cfg.wn
        wk_i = warp // cfg.wn

        m = mX.shape[0]
        n = mW.shape[0]
        row_bytes = mW.shape[1]  # K / 4
        k = row_bytes * fmt.CODES_PER_BYTE
        groups = row_bytes // (fmt.GROUP_BYTES // fmt.TILE_N)
        n_tiles = n // fmt.TILE_N

        # This warp's 16-row tiles (clamped: a tile past N re-reads the last one and is
        # not stored) and its tokens (clamped likewise: a token's column is its own).
        tile0 = (bn * cfg.wn + wn_i) * cfg.tiles
        w_tile = []
        for t in cutlass.range_constexpr(cfg.tiles):
            tile = cutlass.min(tile0 + t, n_tiles - 1)
            w_tile.append(mW.iterator.toint() + Int64(tile) * Int64(row_bytes * fmt.TILE_N))
        x_tok = []
        for b in cutlass.range_constexpr(cfg.mb8):
            tok = cutlass.min(bm * cfg.block_m + b * MMA_N + g, m - 1)
            x_tok.append(mX.iterator.toint() + Int64(tok) * Int64(k))
        w_offs = [fmt.mma_word_offset(g, tq, j) for j in range(4)]
        x_offs = [fmt.mma_x_offset(tq, h) for h in range(2)]

        acc = cute.make_rmem_tensor((cfg.tiles * cfg.mb8 * 4,), Int32)
        acc.fill(0)
        xsum = cute.make_rmem_tensor((cfg.mb8,), Int32)
        xsum.fill(0)

        mine = (groups - wk_i + cfg.wk - 1) // cfg.wk
        batches = mine // cfg.unroll
        for it in cutlass.range(batches, unroll=1):
            loaded = []
            for u in cutlass.range_constexpr(cfg.unroll):
                grp = (it * cfg.unroll + u) * cfg.wk + wk_i
                loaded.append(self.load_group(grp, w_tile, w_offs, x_tok, x_offs))
            for u in cutlass.range_constexpr(cfg.unroll):
                self.mma_group(loaded[u], acc, xsum)
        for j in cutlass.range(batches * cfg.unroll, mine, unroll=1):
            grp = j * cfg.wk + wk_i
            self.mma_group(self.load_group(grp, w_tile, w_offs, x_tok, x_offs), acc, xsum)

        self.remove_code_offset(acc, xsum, tq)

        if cutlass.const_expr(cfg.wk > 1):
            smem = cutlass.memory.SmemAllocator()
            part = smem.allocate_tensor(Int32, cute.make_layout((self.partials_size(),)), 16)
            per_warp = cfg.tiles * cfg.mb8 * 4 * WARP
            if wk_i > 0:
                base = ((wk_i - 1) * cfg.wn + wn_i) * per_warp
                for a in cutlass.range_constexpr(cfg.tiles * cfg.mb8 * 4):
                    part[base + a * WARP + lane] = acc[a]
            cute.arch.sync_threads()
            if wk_i == 0:
                for p in cutlass.range_constexpr(cfg.wk - 1):
                    base = (p * cfg.wn + wn_i) * per_warp
                    for a in cutlass.range_constexpr(cfg.tiles * cfg.mb8 * 4):
                        acc[a] = acc[a] + part[base + a * WARP + lane]

        if wk_i == 0:
            for t in cutlass.range_constexpr(cfg.tiles):
                for c in cutlass.range_constexpr(4):
                    row = (tile0 + t) * fmt.TILE_N + g + 8 * (c >> 1)
                    if row < n:
                        w_scale = segment_scale(mWScale, row, e1, e2, e3)
                        for b in cutlass.range_constexpr(cfg.mb8):
                            tok = bm * cfg.block_m + b * MMA_N + 2 * tq + (c & 1)
                            if tok < m:
                                store_out(
                                    mOut.iterator.toint(),
                                    Int64(tok) * Int64(n) + Int64(row),
                                    acc[(t * cfg.mb8 + b) * 4 + c],
                                    Float32(mXScale[tok]),
                                    w_scale,
                                    cfg.raw,
                                )

    @cute.jit
    def load_group(self, grp: Int32, w_tile: list, w_offs: list, x_tok: list, x_offs: list):
        """One 128-column group: 4 weight words per tile, 2 x 16 activation bytes per block."""
        cfg = self.cfg
        words = []
        for t in cutlass.range_constexpr(cfg.tiles):
            base = w_tile[t] + Int64(grp) * fmt.GROUP_BYTES
            words.append([load_b32(base + w_offs[j], True) for j in range(4)])
        xs = []
        for b in cutlass.range_constexpr(cfg.mb8):
            base = x_tok[b] + Int64(grp) * fmt.GROUP_K
            xs.append([load_v4(base + x_offs[h], False) for h in range(2)])
        return words, xs

    @cute.jit
    def mma_group(self, loaded, acc: cute.Tensor, xsum: cute.Tensor):
        """Decode, sum the activations, and run the group's 4 MMAs per (tile, token block)."""
        cfg = self.cfg
        words, xs = loaded
        for b in cutlass.range_constexpr(cfg.mb8):
            for h in cutlass.range_constexpr(2):
                for i in cutlass.range_constexpr(fmt.DECODE_STEPS):
                    xsum[b] = dp4a_ss(xs[b][h][i], Int32(0x01010101), xsum[b])
        for t in cutlass.range_constexpr(cfg.tiles):
            # a[i][j]: A register j of MMA i = decode step i of word j
            a = [[shr_and(words[t][j], 2 * i, fmt.DECODE_MASK) for j in range(4)] for i in range(fmt.DECODE_STEPS)]
            for b in cutlass.range_constexpr(cfg.mb8):
                base = (t * cfg.mb8 + b) * 4
                for i in cutlass.range_constexpr(fmt.DECODE_STEPS):
                    d = mma_m16n8k32_u8s8(
                        a[i],
                        (xs[b][0][i], xs[b][1][i]),
                        (acc[base], acc[base + 1], acc[base + 2], acc[base + 3]),
                    )
                    for c in cutlass.range_constexpr(4):
                        acc[base + c] = d[c]

    @cute.jit
    def remove_code_offset(self, acc: cute.Tensor, xsum: cute.Tensor, tq: Int32):
        """``acc -= 2 * sum_k x[token, k]`` over this warp's groups.

        Lane ``(g, tq)`` summed token ``g``'s bytes of its chunks; the butterfly over
        ``tq`` completes token ``g``; accumulator columns ``2tq, 2tq+1`` then fetch the
        sums of tokens ``2tq`` and ``2tq+1`` from lanes ``8tq`` and ``8tq + 4``.
        """
        cfg = self.cfg
        for b in cutlass.range_constexpr(cfg.mb8):
            s = xsum[b]
            s = s + cute.arch.shuffle_sync_bfly(s, offset=1)
            s = s + cute.arch.shuffle_sync_bfly(s, offset=2)
            even = cute.arch.shuffle_sync(s, 8 * tq)
            odd = cute.arch.shuffle_sync(s, 8 * tq + 4)
            for t in cutlass.range_constexpr(cfg.tiles):
                base = (t * cfg.mb8 + b) * 4
                acc[base] = acc[base] - fmt.CODE_OFFSET * even
                acc[base + 1] = acc[base + 1] - fmt.CODE_OFFSET * odd
                acc[base + 2] = acc[base + 2] - fmt.CODE_OFFSET * even
                acc[base + 3] = acc[base + 3] - fmt.CODE_OFFSET * odd


def compile_gemm(cfg: GemmConfig, options: str):
    """Compile for every M and every (N, K) with N % 16 == 0, K % 128 == 0."""
    m = cute.sym_int()
    n = cute.sym_int(divisibility=fmt.N_MULTIPLE)
    k = cute.sym_int(divisibility=fmt.K_MULTIPLE)
    kb = cute.sym_int(divisibility=fmt.K_MULTIPLE // fmt.CODES_PER_BYTE)
    segs = cute.sym_int()
    fake = cute.runtime.make_fake_compact_tensor
    x = fake(cutlass.Int8, (m, k), stride_order=(1, 0), assumed_align=16)
    w = fake(cutlass.Int8, (n, kb), stride_order=(1, 0), assumed_align=16)
    x_scale = fake(Float32, (m,), assumed_align=4)
    w_scale = fake(Float32, (segs,), assumed_align=4)
    out = fake(Int32 if cfg.raw else BFloat16, (m, n), stride_order=(1, 0), assumed_align=4)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(
        BitnetGemm(cfg), x, w, x_scale, w_scale, out, Int32(0), Int32(0), Int32(0), stream, options=options
    )
