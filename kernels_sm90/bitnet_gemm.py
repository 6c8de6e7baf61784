"""BitNet W2A8 GEMM on Hopper: ``wgmma.mma_async m64nNk32`` s8 x s8 -> s32, A from registers.

Operands.  The 2-bit weights are the wgmma A operand (64 rows per warpgroup, decoded in
registers: wgmma RS), the int8 tokens are B (N = ``block_m`` tokens, read by wgmma
from a K-major 128B-swizzled shared-memory tile), so the accumulators hold
``out.T``.  CuTe DSL 4.8.1 has the int8 wgmma atom (``warpgroup.MmaI8Op``, sm_90a),
so the MMA, its shared-memory descriptors and the fragment layouts all come from CuTe.

Decode.  wgmma reads B in natural k order, so A must be in natural order too: per
32-column k-step, A register ``j`` of lane ``(g, tq)`` is decode step ``tq`` of the word
``layouts.bitnet.kstep_word_offset(g, j)`` of the 16 x 32 tile (two rows x two
16-column halves).  The four lanes of a quad read the same word (a shared-memory
broadcast), so there is no bank conflict and no shuffle.  Each register is decoded
straight to the signed weights ``c - 2`` (shift, lop3, sub, xor: ``decode_s8``), so the
MMA is s8 x s8 and needs no correction by the token sums.

Pipeline.  Both operands go global -> shared with 16-byte ``cp.async`` in a
``stages``-deep ring: per 128-column group, the CTA's weight rows (4 x 512 contiguous
bytes per warpgroup: each 16-row stripe's group is one run) and the ``block_m`` x 128
token tile (tokens past M are zero-filled).  The A registers are double-buffered, so the
wgmmas of group g run while group g + 1 is decoded (one wgmma group in flight,
``wait_group(1)``); the ring is therefore filled ``stages - 2`` groups ahead (the slot a
copy overwrites was last read by the wgmmas of two groups back).  One
``__syncthreads`` per group publishes the landed stage (after ``fence.proxy.async``
makes it visible to wgmma) and frees the slot the next copy overwrites.  Two warpgroups
can share each token tile (128 weight rows per CTA), halving the L2 traffic of the token
tiles.

No programmatic dependent launch, measured: with the weight copies of the prologue and an
L2 prefetch of the CTA's rows before ``griddepcontrol.wait`` (trigger at entry), back-to-back
GEMMs on the H200 took 13.5 -> 19.4 us (M = 256, 2560 x 2560) and 37.8 -> 63.6 us (M = 256,
3200 x 10240), and were level (+-1 %) from M = 1024: the next GEMM's waiting CTAs hold SM
slots (shared memory) that this GEMM's later CTAs need.

Epilogue.  The scaled bf16 (or raw int32) results go through shared memory (the token
ring, free by then) transposed to ``out``'s [token, row] order, then out in 16-byte
row-contiguous stores (a fragment's own stores would write 16 of every 32 bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
from cutlass.tensor_utils import LayoutEnum

from ..kernels_sm80.bitnet_ptx import (
    WARP,
    copy16_s2g,
    cp_async_16,
    decode_s8,
    lds_b32,
    matmul_fake_args,
    scale_out,
    segment_scale,
    store_bf16,
    store_i32,
)
from ..layouts import bitnet as fmt
from ..layouts import sm90

WG_ROWS = sm90.WGMMA_M  # weight rows per warpgroup (the wgmma M)
WG_THREADS = 128
STAGE_W_BYTES = WG_ROWS // fmt.TILE_N * fmt.GROUP_BYTES  # 2 KB per warpgroup and stage
X_ROW_BYTES = fmt.GROUP_K  # one token's 128 bytes of a group
CHUNKS_PER_X_ROW = X_ROW_BYTES // fmt.CHUNK_BYTES
KSTEPS = fmt.GROUP_K // fmt.TILE_K  # wgmma k-steps per group
A_BUFFERS = 2  # A register sets: the group being decoded and the one the wgmmas read
OUT_PAD_BYTES = 16  # per staged output row: rows 16 bytes apart mod 128 -> no bank conflicts


@dataclass(frozen=True)
class WgmmaConfig:
    """``block_m``: tokens per CTA (the wgmma N); ``warpgroups``: 64-row weight tiles per
    CTA sharing each token tile; ``stages``: depth of the cp.async ring (``stages - 2``
    groups loaded ahead)."""

    block_m: int = 128
    warpgroups: int = 2
    stages: int = 4
    raw: bool = False  # store the int32 sums instead of the scaled bf16 output

    def __post_init__(self):
        assert self.block_m in (64, 128, 256) and self.warpgroups in (1, 2, 3, 4) and self.stages >= 3

    @property
    def threads(self) -> int:
        return WG_THREADS * self.warpgroups

    @property
    def block_n(self) -> int:
        return WG_ROWS * self.warpgroups

    @property
    def out_bytes(self) -> int:
        return 4 if self.raw else 2

    @property
    def out_row_bytes(self) -> int:
        """Bytes per token row of the staged output tile."""
        return self.block_n * self.out_bytes + OUT_PAD_BYTES

    @property
    def x_ring_bytes(self) -> int:
        """The token ring, which the staged output tile reuses."""
        return max(self.stages * self.block_m * X_ROW_BYTES, self.block_m * self.out_row_bytes)


# From this many weight rows on, a 64-token tile's CTA count fills the GPU and the larger
# tiles win (H200 sweep over the eight BitNet shapes, profiles/NOTES.md)
LARGE_N = 8192
LARGE_M = 1024


def config_for(m: int, n: int, sms: int) -> WgmmaConfig:
    """The tile by M and N, from the H200 sweep: 64 tokens x 64 rows up to M = 64; from
    M = 1024 or N = 8192 on, 128 x 128 (two warpgroups sharing the token tile); between,
    64 x 128 while that is one wave of CTAs, else 64 x 64 (more, shorter CTAs)."""
    if m <= 64:
        return WgmmaConfig(block_m=64, warpgroups=1)
    if m >= LARGE_M or n >= LARGE_N:
        return WgmmaConfig(block_m=128, warpgroups=2)
    return WgmmaConfig(block_m=64, warpgroups=2 if -(-m // 64) * -(-n // (2 * WG_ROWS)) <= sms else 1)


def grid_for(cfg: WgmmaConfig, m, n):
    """(token tiles, weight-row tiles): host ints or the kernel's traced sizes."""
    return ((m + cfg.block_m - 1) // cfg.block_m, (n + cfg.block_n - 1) // cfg.block_n)


class BitnetGemmSm90:
    """Arguments: ``x`` int8 [M, K], ``w`` int8 [N, K/4] packed, ``x_scale`` fp32 [M],
    ``w_scale`` fp32 [S], ``out`` bf16 [M, N], segment ends ``e1, e2, e3``."""

    def __init__(self, cfg: WgmmaConfig):
        self.cfg = cfg
        self.ahead = cfg.stages - 2  # groups in flight ahead of the one being computed
        self.x_chunks = cfg.block_m * CHUNKS_PER_X_ROW // cfg.threads  # token copies a thread
        self.out_chunks = cfg.block_n * cfg.out_bytes // fmt.CHUNK_BYTES  # 16-byte stores a token
        assert self.x_chunks * cfg.threads == cfg.block_m * CHUNKS_PER_X_ROW
        assert (cfg.block_m * self.out_chunks) % cfg.threads == 0

    def x_layout(self):
        """The staged token tiles: (block_m, 128, stages), K-major, 128-byte swizzle."""
        return sm90_utils.make_smem_layout_b(
            LayoutEnum.ROW_MAJOR, (WG_ROWS, self.cfg.block_m, fmt.GROUP_K), cutlass.Int8, self.cfg.stages
        )

    def tiled_mma(self):
        return sm90_utils.make_trivial_tiled_mma(
            cutlass.Int8,
            cutlass.Int8,
            OperandMajorMode.K,
            OperandMajorMode.K,
            Int32,
            (1, 1, 1),
            (WG_ROWS, self.cfg.block_m),
            warpgroup.OperandSource.RMEM,
        )

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
        # shared memory (token ring / output tile, weight ring) is sized by the DSL from the
        # allocations in the kernel
        self.kernel(mX, mW, mXScale, mWScale, mOut, e1, e2, e3).launch(
            grid=[*grid_for(cfg, m, n), 1],
            block=[cfg.threads, 1, 1],
            stream=stream,
        )

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

        m = mX.shape[0]
        n = mW.shape[0]
        row_bytes = mW.shape[1]  # K / 4
        k = row_bytes * fmt.CODES_PER_BYTE
        groups = row_bytes // (fmt.GROUP_BYTES // fmt.TILE_N)
        n_stripes = n // fmt.TILE_N

        x_layout = self.x_layout()
        smem = cutlass.memory.SmemAllocator()
        x_ptr = smem.allocate(cfg.x_ring_bytes, 1024)
        sX = cute.make_tensor(cute.recast_ptr(x_ptr, x_layout.inner, dtype=cutlass.Int8), x_layout.outer)
        sW = smem.allocate_tensor(cutlass.Int8, cute.make_layout((cfg.stages * cfg.warpgroups * STAGE_W_BYTES,)), 128)
        x_base = sX.iterator.toint()
        w_base = sW.iterator.toint()
        x_stage_bytes = cfg.block_m * X_ROW_BYTES
        w_stage_bytes = cfg.warpgroups * STAGE_W_BYTES

        tiled_mma = self.tiled_mma()
        thr_mma = tiled_mma.get_slice(tidx % WG_THREADS)
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sX))
        a_shape = thr_mma.partition_shape_A((WG_ROWS, fmt.GROUP_K))
        tCrA = [tiled_mma.make_fragment_A(a_shape) for _ in range(A_BUFFERS)]
        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((WG_ROWS, cfg.block_m)), Int32)
        acc.fill(0)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)

        # This thread's copies: one 16-byte weight chunk and x_chunks token chunks.
        stripe = cutlass.min(bn * (cfg.block_n // fmt.TILE_N) + warp, n_stripes - 1)
        w_src = mW.iterator.toint() + Int64(stripe) * Int64(row_bytes * fmt.TILE_N) + Int64(lane * fmt.CHUNK_BYTES)
        w_dst = w_base + tidx * fmt.CHUNK_BYTES
        x_src = []
        x_dst = []
        x_bytes = []
        for i in cutlass.range_constexpr(self.x_chunks):
            idx = tidx + i * cfg.threads
            r = idx // CHUNKS_PER_X_ROW
            c = idx % CHUNKS_PER_X_ROW
            tok = bm * cfg.block_m + r
            x_src.append(mX.iterator.toint() + Int64(cutlass.min(tok, m - 1)) * Int64(k) + Int64(c * fmt.CHUNK_BYTES))
            x_dst.append(x_base + x_layout((r, c * fmt.CHUNK_BYTES, 0)))
            x_bytes.append(cutlass.select_(tok < m, Int32(fmt.CHUNK_BYTES), Int32(0)))
        copies = (w_src, w_dst, x_src, x_dst, x_bytes, w_stage_bytes, x_stage_bytes)

        # Prologue: the first `ahead` groups in flight.
        for s in cutlass.range_constexpr(self.ahead):
            if s < groups:
                self.issue(s, s, *copies)
            cute.arch.cp_async_commit_group()

        w_warp = w_base + warp * fmt.GROUP_BYTES
        a_offs = [fmt.kstep_word_offset(g, j) for j in range(4)]
        shift = fmt.kstep_shift(tq)
        # Pairs of groups, one per A buffer; an odd count ends with a phantom group whose A
        # is zero (no branch around the wgmmas: ptxas serializes every wgmma (C7513) when
        # the accumulators pass through one)
        for kg0 in cutlass.range(0, groups, A_BUFFERS, unroll=1):
            for buf in cutlass.range_constexpr(A_BUFFERS):
                kg = kg0 + buf
                cute.arch.cp_async_wait_group(self.ahead - 1)
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.sync_threads()
                nxt = kg + self.ahead
                if nxt < groups:
                    self.issue(nxt, nxt % cfg.stages, *copies)
                cute.arch.cp_async_commit_group()

                st = kg % cfg.stages
                words = cute.recast_tensor(tCrA[buf], Int32)  # word j + 4*kstep
                w_stage = w_warp + st * w_stage_bytes
                for ks in cutlass.range_constexpr(KSTEPS):
                    for j in cutlass.range_constexpr(4):
                        a = decode_s8(lds_b32(w_stage + ks * fmt.TILE_BYTES + a_offs[j]), shift)
                        if cutlass.const_expr(buf > 0):
                            a = cutlass.select_(kg < groups, a, Int32(0))
                        words[j + 4 * ks] = a
                warpgroup.fence()
                for ks in cutlass.range_constexpr(KSTEPS):
                    cute.gemm(tiled_mma, acc, tCrA[buf][None, None, ks], tCrB[None, None, ks, st], acc)
                warpgroup.commit_group()
                warpgroup.wait_group(A_BUFFERS - 1)
        warpgroup.wait_group(0)
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()  # every warpgroup is done with the token ring
        self.epilogue(acc, thr_mma, x_base, mXScale, mWScale, mOut, e1, e2, e3)

    @cute.jit
    def epilogue(self, acc, thr_mma, s_base: Int32, mXScale, mWScale, mOut, e1: Int32, e2: Int32, e3: Int32):
        """Scale each sum (``(acc / x_scale) * w_scale``, or the raw int32), stage the tile
        in [token, row] order in shared memory, store it in 16-byte row runs."""
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        bm, bn, _ = cute.arch.block_idx()
        m = mOut.shape[0]
        n = mOut.shape[1]
        coords = thr_mma.partition_C(cute.make_identity_tensor((WG_ROWS, cfg.block_m)))
        row_in_tile0 = (tidx // WG_THREADS) * WG_ROWS
        for i in cutlass.range_constexpr(cute.size(acc)):
            r, c = coords[i]
            row_in_tile = row_in_tile0 + r
            addr = s_base + c * cfg.out_row_bytes + row_in_tile * cfg.out_bytes
            if cutlass.const_expr(cfg.raw):
                store_i32(addr, acc[i], "shared")
            else:
                tok = cutlass.min(bm * cfg.block_m + c, m - 1)
                row = cutlass.min(bn * cfg.block_n + row_in_tile, n - 1)
                value = scale_out(acc[i], Float32(mXScale[tok]), segment_scale(mWScale, row, e1, e2, e3))
                store_bf16(addr, value, "shared")
        cute.arch.sync_threads()
        per_elem = fmt.CHUNK_BYTES // cfg.out_bytes
        for it in cutlass.range_constexpr(cfg.block_m * self.out_chunks // cfg.threads):
            idx = tidx + it * cfg.threads
            c = idx // self.out_chunks
            q = idx % self.out_chunks
            tok = bm * cfg.block_m + c
            row = bn * cfg.block_n + q * per_elem
            if tok < m and row < n:
                copy16_s2g(
                    s_base + c * cfg.out_row_bytes + q * fmt.CHUNK_BYTES,
                    mOut.iterator.toint() + (Int64(tok) * Int64(n) + Int64(row)) * cfg.out_bytes,
                )

    @cute.jit
    def issue(self, grp: Int32, stage: Int32, w_src, w_dst, x_src: list, x_dst: list, x_bytes: list, w_stage_bytes: int, x_stage_bytes: int):
        """cp.async of group ``grp`` into ring slot ``stage``."""
        cp_async_16(w_dst + stage * w_stage_bytes, w_src + Int64(grp) * fmt.GROUP_BYTES, Int32(fmt.CHUNK_BYTES))
        for i in cutlass.range_constexpr(len(x_src)):
            cp_async_16(x_dst[i] + stage * x_stage_bytes, x_src[i] + Int64(grp) * fmt.GROUP_K, x_bytes[i])


def compile_gemm(cfg: WgmmaConfig, options: str):
    """Compile for every M and every (N, K) with N % 16 == 0, K % 128 == 0 (sm_90a only)."""
    return cute.compile(BitnetGemmSm90(cfg), *matmul_fake_args(cfg.raw, launch_arg=False), options=options)
