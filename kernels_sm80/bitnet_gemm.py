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
ways (split-K inside the CTA; every warp parks its partial sums in shared memory and
the whole CTA then reduces, scales and stores them).  ``wk`` is a launch argument
chosen per shape by the host (``split_for``): small M is latency bound like the GEMV,
so a warp should get only as many groups as it loads at once (``unroll``), i.e. the
whole weight matrix is requested in one round trip -- unless the grid would then need
a second wave of CTAs, which pays that latency again.  Weights are read once per CTA
column with ``ld.global.nc.L1::no_allocate`` and the CTAs along M (grid x, fastest)
share them through L2.  The activations are read through L1 by every CTA column, which
is what limits large M x N (there the sm90 wgmma kernel, whose 128-row CTAs stage the
token tile in shared memory, takes over).
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from ..layouts import bitnet as fmt
from ..layouts.bitnet import MMA_M, MMA_N
from ..layouts.resources import ctas_per_sm
from .bitnet_ptx import (
    WARP,
    dp4a_ss,
    load_b32,
    load_v4,
    matmul_fake_args,
    mma_m16n8k32_u8s8,
    segment_scale,
    shr_and,
    store_out,
)
from .tensors import prefetch_run_l2



@dataclass(frozen=True)
class GemmConfig:
    """``mb8``: 8-token MMA columns per CTA; ``tiles``: 16-row tiles per warp; ``wn``:
    warps along the rows; ``unroll``: 128-column groups loaded before any is consumed;
    ``max_wk``: bound on the split-K warp count, which is a launch argument
    (``split_for``), so one compilation serves every (N, K); ``registers``: per thread,
    as ptxas allocates them on sm_90a (residency, ``layouts.resources``) and
    ``max_batches``: serial batches of loads a warp may be given to save a second wave
    of CTAs -- both for the host's choice of ``wk`` only."""

    mb8: int = 2
    tiles: int = 1
    wn: int = 1
    unroll: int = 2
    max_wk: int = 16
    registers: int = 64
    max_batches: int = 10
    raw: bool = False  # store the int32 sums instead of the scaled bf16 output
    # programmatic dependent launch (sm_90+): the CTA's weights are fetched to L2 while the
    # previous kernel drains; activations are read, out written, after the wait
    pdl: bool = False

    @property
    def max_threads(self) -> int:
        return self.wn * self.max_wk * WARP

    @property
    def block_m(self) -> int:
        return MMA_N * self.mb8

    @property
    def block_n(self) -> int:
        return MMA_M * self.tiles * self.wn

    @property
    def acc_regs(self) -> int:
        return self.tiles * self.mb8 * 4


# Measured on the H200 (a sweep of tiles and split-K counts over the eight model shapes
# at M = 16, 64, 256): 16 tokens a CTA and 16 rows a warp, two groups of loads in
# flight per warp (64 registers: 32 warps an SM) -- the most CTAs and split-K warps.
STREAM = GemmConfig(mb8=2, tiles=1, wn=1, unroll=2, max_wk=16, registers=64, max_batches=10)
# 32 tokens x 32 rows a warp: each activation load feeds twice the MMAs of STREAM, which
# pays once the activations (re-read from L2 by every CTA column) dominate (118 registers,
# 128 with PDL: 16 warps an SM either way).
# Its warps hold one group in flight: more than 8 serial batches cost more than a second
# wave (M = 256: 4800 x 3200 with 1 split-K warp 55 us, with 7 warps 39 us).
TILED = GemmConfig(mb8=4, tiles=2, wn=1, unroll=1, max_wk=8, registers=128, max_batches=8)


def config_for(m: int, n: int, sms: int) -> GemmConfig:
    """The tile for M tokens and N rows on a GPU with ``sms`` multiprocessors.

    Up to 64 tokens the GEMM streams the weights like the GEMV: small tiles, the K
    groups split over many warps, so that (nearly) every weight byte is requested in
    the first round trip.  Beyond, the larger warp tile halves the activation traffic.
    """
    return STREAM if m <= 64 else TILED


def split_for(cfg: GemmConfig, m: int, n: int, k: int, sms: int) -> int:
    """Split-K warps per CTA: about ``unroll`` groups per warp (one batch of loads in
    flight covers the warp's whole share), at most ``max_wk``; fewer when the grid
    would otherwise not fit the GPU in one wave of CTAs -- a second wave pays the
    whole memory latency again, while more groups per warp just keep loads in flight --
    as long as a warp's share stays within ``max_batches`` serial round trips."""
    groups = k // fmt.GROUP_K
    iters = -(-groups // (cfg.max_wk * cfg.unroll))
    wk = min(cfg.max_wk, max(1, -(-groups // (cfg.unroll * iters))))
    gm, gn = grid_for(cfg, m, n)

    def fits(w):
        return gm * gn <= sms * ctas_per_sm(cfg.registers, cfg.wn * w)

    while wk > 1 and not fits(wk) and -(-groups // ((wk - 1) * cfg.unroll)) <= cfg.max_batches:
        wk -= 1
    return wk


def grid_for(cfg: GemmConfig, m: int, n: int):
    return (-(-m // cfg.block_m), -(-n // cfg.block_n))


class BitnetGemm:
    """Arguments: ``x`` int8 [M, K], ``w`` int8 [N, K/4] packed, ``x_scale`` fp32 [M],
    ``w_scale`` fp32 [S], ``out`` bf16 [M, N], segment ends ``e1, e2, e3``, split-K
    warps ``wk`` (<= ``max_wk``)."""

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
        wk: Int32,
        stream,
    ):
        cfg = self.cfg
        m = mX.shape[0]
        n = mW.shape[0]
        grid_m = (m + cfg.block_m - 1) // cfg.block_m
        grid_n = (n + cfg.block_n - 1) // cfg.block_n
        # shared memory (the split-K partials) is sized by the DSL from the allocations;
        # the block size is a launch argument: bound it so that ptxas may give every
        # thread the registers that keep a whole batch of loads in flight
        self.kernel(mX, mW, mXScale, mWScale, mOut, e1, e2, e3, wk).launch(
            grid=[grid_m, grid_n, 1],
            block=[cfg.wn * wk * WARP, 1, 1],
            max_number_threads=[cfg.max_threads, 1, 1],
            stream=stream,
            use_pdl=cfg.pdl,
        )

    def partials_size(self) -> int:
        cfg = self.cfg
        return cfg.max_wk * cfg.wn * cfg.acc_regs * WARP

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
        wk: Int32,
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

        acc = cute.make_rmem_tensor((cfg.acc_regs,), Int32)
        acc.fill(0)
        xsum = cute.make_rmem_tensor((cfg.mb8,), Int32)
        xsum.fill(0)

        # Groups wk_i, wk_i + wk, ...: batches of `unroll` groups whose loads are all
        # issued before any is used.  The last batch is padded with the warp's last group
        # again (an L2 hit, so every load stays unpredicated and can be hoisted); its
        # weight words and its ones-vector are zeroed, so it adds nothing to either sum.
        mine = (groups - wk_i + wk - 1) // wk
        batches = (mine + cfg.unroll - 1) // cfg.unroll
        if cutlass.const_expr(cfg.pdl):
            # the next kernel's CTAs may take our SMs as soon as ours retire
            cute.arch.griddepcontrol_launch_dependents()
            # The weights never depend on the previous kernel: L2 fetches the CTA's rows (one
            # contiguous run of 16-row tiles) while that kernel drains; the wait in the first
            # batch gates the activations only.
            first_tile = bn * cfg.wn * cfg.tiles
            run_bytes = cutlass.min(n_tiles - first_tile, cfg.wn * cfg.tiles) * row_bytes * fmt.TILE_N
            run_first = mW.iterator.toint() + Int64(first_tile) * Int64(row_bytes * fmt.TILE_N)
            prefetch_run_l2(run_first, run_bytes, tidx, cfg.wn * wk * WARP)
        for it in cutlass.range(batches, unroll=1):
            grps = []
            keeps = []
            words = []
            for u in cutlass.range_constexpr(cfg.unroll):
                j = it * cfg.unroll + u
                grps.append(cutlass.min(j, mine - 1) * wk + wk_i)
                keeps.append(cutlass.select_(j < mine, Int32(-1), Int32(0)))
                words.append(self.load_weights(grps[u], w_tile, w_offs))
            if cutlass.const_expr(cfg.pdl):
                if it == 0:
                    # (ptxas issues this batch's weight loads after the wait; holding them
                    # above it as the GEMV does, tensors.wait_holding, was slower on 13 of 16
                    # shapes at M = 16 and 64 on the H200, by up to 1.5x: profiles/NOTES.md)
                    cute.arch.griddepcontrol_wait()
            xs = [self.load_activations(grps[u], x_tok, x_offs) for u in range(cfg.unroll)]
            for u in cutlass.range_constexpr(cfg.unroll):
                self.mma_group((words[u], xs[u]), keeps[u], acc, xsum)

        self.remove_code_offset(acc, xsum, tq)
        self.reduce_and_store(acc, mXScale, mWScale, mOut, e1, e2, e3, wk, tidx, warp, lane, bm, bn)

    @cute.jit
    def load_weights(self, grp: Int32, w_tile: list, w_offs: list):
        """One 128-column group's weights: 4 words per tile."""
        words = []
        for t in cutlass.range_constexpr(self.cfg.tiles):
            base = w_tile[t] + Int64(grp) * fmt.GROUP_BYTES
            words.append([load_b32(base + w_offs[j], True) for j in range(4)])
        return words

    @cute.jit
    def load_activations(self, grp: Int32, x_tok: list, x_offs: list):
        """One group's activations: 2 x 16 bytes per token block (after the PDL wait)."""
        cfg = self.cfg
        xs = []
        for b in cutlass.range_constexpr(cfg.mb8):
            base = x_tok[b] + Int64(grp) * fmt.GROUP_K
            xs.append([load_v4(base + x_offs[h], False, cfg.pdl) for h in range(2)])
        return xs

    @cute.jit
    def mma_group(self, loaded, keep: Int32, acc: cute.Tensor, xsum: cute.Tensor):
        """Decode, sum the activations, and run the group's 4 MMAs per (tile, token block).

        ``keep`` is all ones for a real group and 0 for a padding one: zero codes and a
        zero ones-vector make its MMAs and its activation sum add nothing.
        """
        cfg = self.cfg
        words, xs = loaded
        ones = keep & 0x01010101
        for b in cutlass.range_constexpr(cfg.mb8):
            for h in cutlass.range_constexpr(2):
                for i in cutlass.range_constexpr(fmt.DECODE_STEPS):
                    xsum[b] = dp4a_ss(xs[b][h][i], ones, xsum[b])
        for t in cutlass.range_constexpr(cfg.tiles):
            # a[i][j]: A register j of MMA i = decode step i of word j
            w = [words[t][j] & keep for j in range(4)]
            a = [[shr_and(w[j], 2 * i, fmt.DECODE_MASK) for j in range(4)] for i in range(fmt.DECODE_STEPS)]
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

    @cute.jit
    def reduce_and_store(self, acc, mXScale, mWScale, mOut, e1, e2, e3, wk: Int32, tidx, warp, lane, bm, bn):
        """Split-K reduction through shared memory, then scale and store.

        Every warp parks its accumulators (entry ``(wn_i, a, lane)`` of split ``wk_i``);
        then the whole CTA shares the sums and the stores, each thread taking entries
        ``tidx, tidx + threads, ...``: with many split-K warps no single warp serializes
        ``wk`` partials of every accumulator.
        """
        cfg = self.cfg
        n = mOut.shape[1]
        m = mOut.shape[0]
        per_split = cfg.wn * cfg.acc_regs * WARP
        smem = cutlass.memory.SmemAllocator()
        part = smem.allocate_tensor(Int32, cute.make_layout((self.partials_size(),)), 16)
        base = warp * (cfg.acc_regs * WARP)  # == wk_i * per_split + wn_i * acc_regs * WARP
        for a in cutlass.range_constexpr(cfg.acc_regs):
            part[base + a * WARP + lane] = acc[a]
        cute.arch.sync_threads()
        threads = cfg.wn * wk * WARP
        for e in cutlass.range(tidx, per_split, threads, unroll=1):
            total = Int32(0)
            for p in cutlass.range(wk, unroll=1):
                total = total + part[p * per_split + e]
            # entry e = (wn_i * acc_regs + a) * WARP + lane, a = (t * mb8 + b) * 4 + c
            ln = e % WARP
            a = (e // WARP) % cfg.acc_regs
            wn_e = e // (WARP * cfg.acc_regs)
            c = a % 4
            b = (a // 4) % cfg.mb8
            t = a // (4 * cfg.mb8)
            row = ((bn * cfg.wn + wn_e) * cfg.tiles + t) * fmt.TILE_N + (ln >> 2) + 8 * (c >> 1)
            tok = bm * cfg.block_m + b * MMA_N + 2 * (ln & 3) + (c & 1)
            if row < n and tok < m:
                store_out(
                    mOut.iterator.toint(),
                    Int64(tok) * Int64(n) + Int64(row),
                    total,
                    Float32(mXScale[tok]),
                    segment_scale(mWScale, row, e1, e2, e3),
                    cfg.raw,
                )


def compile_gemm(cfg: GemmConfig, options: str):
    """Compile for every M and every (N, K) with N % 16 == 0, K % 128 == 0."""
    return cute.compile(BitnetGemm(cfg), *matmul_fake_args(cfg.raw), options=options)
