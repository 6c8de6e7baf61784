"""BitNet W2A8 GEMM on Hopper: ``wgmma.mma_async m64nNk32`` u8 x s8 -> s32, A from registers.

Operands.  The 2-bit weights are the wgmma A operand (64 rows per warpgroup, decoded in
registers: wgmma RS), the int8 tokens are B (N = ``block_m`` tokens, read by wgmma
from a K-major 128B-swizzled shared-memory tile), so the accumulators hold
``out.T``.  CuTe DSL 4.8.1 has the int8 wgmma atom (``warpgroup.MmaI8Op``, sm_90a),
so the MMA, its shared-memory descriptors and the fragment layouts all come from CuTe.

Decode.  wgmma reads B in natural k order, so A must be in natural order too: per
32-column k-step, A register ``j`` of lane ``(g, tq)`` is decode step ``tq`` of the word
``layouts.bitnet.kstep_word_offset(g, j)`` of the 16 x 32 tile (two rows x two
16-column halves), ``(w >> 2tq) & 0x03030303``.  The four lanes of a quad read the same
word (a shared-memory broadcast), so there is no bank conflict and no shuffle.  The A
values are the codes ``c = w + 2`` (u8); the ``+2`` is removed at the end with
``sum w x = sum c x - 2 sum x``, the token sums taken from the same shared-memory tiles
while they are resident (each thread sums a fixed slice of one token's 128 bytes per
stage; slices meet in shared memory at the end).

Pipeline.  Both operands go global -> shared with 16-byte ``cp.async`` in a
``stages``-deep ring: per 128-column group, the CTA's weight rows (4 x 512 contiguous
bytes per warpgroup: each 16-row stripe's group is one run) and the ``block_m`` x 128
token tile (tokens past M are zero-filled).  One ``__syncthreads`` per group both
publishes the landed stage (after ``fence.proxy.async`` makes it visible to wgmma)
and frees the stage the next copy overwrites.  Two warpgroups share each token tile
(128 weight rows per CTA), which halves the L2 traffic of the token tiles, the larger
of the two operands of a CTA.
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
    cp_async_16,
    lds_b32,
    lds_sum16,
    matmul_fake_args,
    segment_scale,
    shr_and_var,
    store_out,
)
from ..layouts import bitnet as fmt
from ..layouts import sm90

WG_ROWS = sm90.WGMMA_M  # weight rows per warpgroup (the wgmma M)
WG_THREADS = 128
STAGE_W_BYTES = WG_ROWS // fmt.TILE_N * fmt.GROUP_BYTES  # 2 KB per warpgroup and stage
X_ROW_BYTES = fmt.GROUP_K  # one token's 128 bytes of a group
CHUNKS_PER_X_ROW = X_ROW_BYTES // fmt.CHUNK_BYTES


@dataclass(frozen=True)
class WgmmaConfig:
    """``block_m``: tokens per CTA (the wgmma N); ``warpgroups``: 64-row weight tiles per
    CTA sharing each token tile; ``stages``: depth of the cp.async ring."""

    block_m: int = 128
    warpgroups: int = 2
    stages: int = 4
    raw: bool = False  # store the int32 sums instead of the scaled bf16 output

    @property
    def threads(self) -> int:
        return WG_THREADS * self.warpgroups

    @property
    def block_n(self) -> int:
        return WG_ROWS * self.warpgroups


def config_for(m: int, n: int, sms: int) -> WgmmaConfig:
    """64 tokens per CTA up to M = 64, else 128 (64 int32 accumulators a thread); two
    warpgroups share each token tile unless that leaves SMs without a CTA."""
    block_m = 64 if m <= 64 else 128
    warpgroups = 2 if -(-m // block_m) * -(-n // (2 * WG_ROWS)) >= sms else 1
    return WgmmaConfig(block_m=block_m, warpgroups=warpgroups)


def grid_for(cfg: WgmmaConfig, m: int, n: int):
    return (-(-m // cfg.block_m), -(-n // cfg.block_n))


class BitnetGemmSm90:
    """Arguments: ``x`` int8 [M, K], ``w`` int8 [N, K/4] packed, ``x_scale`` fp32 [M],
    ``w_scale`` fp32 [S], ``out`` bf16 [M, N], segment ends ``e1, e2, e3``."""

    def __init__(self, cfg: WgmmaConfig):
        self.cfg = cfg
        assert cfg.threads % cfg.block_m == 0 or cfg.block_m % cfg.threads == 0

    def x_layout(self):
        """The staged token tiles: (block_m, 128, stages), K-major, 128-byte swizzle."""
        return sm90_utils.make_smem_layout_b(
            LayoutEnum.ROW_MAJOR, (WG_ROWS, self.cfg.block_m, fmt.GROUP_K), cutlass.Int8, self.cfg.stages
        )

    def tiled_mma(self):
        return sm90_utils.make_trivial_tiled_mma(
            cutlass.Uint8,
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
        # shared memory (weight and token rings, token-sum slices: 82 KB for 128 tokens and
        # two warpgroups) is sized by the DSL from the allocations in the kernel
        self.kernel(mX, mW, mXScale, mWScale, mOut, e1, e2, e3).launch(
            grid=[(m + cfg.block_m - 1) // cfg.block_m, (n + cfg.block_n - 1) // cfg.block_n, 1],
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
        wg_i = tidx // WG_THREADS

        m = mX.shape[0]
        n = mW.shape[0]
        row_bytes = mW.shape[1]  # K / 4
        k = row_bytes * fmt.CODES_PER_BYTE
        groups = row_bytes // (fmt.GROUP_BYTES // fmt.TILE_N)
        n_stripes = n // fmt.TILE_N

        x_layout = self.x_layout()
        smem = cutlass.memory.SmemAllocator()
        sX = smem.allocate_tensor(cutlass.Int8, x_layout.outer, 1024, swizzle=x_layout.inner)
        sW = smem.allocate_tensor(cutlass.Int8, cute.make_layout((cfg.stages * cfg.warpgroups * STAGE_W_BYTES,)), 128)
        sSum = smem.allocate_tensor(Int32, cute.make_layout((cfg.threads,)), 16)
        x_base = sX.iterator.toint()
        w_base = sW.iterator.toint()
        x_stage_bytes = cfg.block_m * X_ROW_BYTES
        w_stage_bytes = cfg.warpgroups * STAGE_W_BYTES

        tiled_mma = self.tiled_mma()
        thr_mma = tiled_mma.get_slice(tidx % WG_THREADS)
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sX))
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_shape_A((WG_ROWS, fmt.GROUP_K)))
        tCrA_words = cute.recast_tensor(tCrA, Int32)  # word j + 4*kstep: rows g / g+8, k half j // 2
        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((WG_ROWS, cfg.block_m)), Int32)
        acc.fill(0)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)

        # This thread's copies: one 16-byte weight chunk and block_m * 8 / threads token chunks.
        stripe = cutlass.min(bn * (cfg.block_n // fmt.TILE_N) + tidx // WARP, n_stripes - 1)
        w_src = mW.iterator.toint() + Int64(stripe) * Int64(row_bytes * fmt.TILE_N) + Int64(lane * fmt.CHUNK_BYTES)
        w_dst = w_base + tidx * fmt.CHUNK_BYTES
        x_chunks = cfg.block_m * CHUNKS_PER_X_ROW // cfg.threads
        x_src = []
        x_dst = []
        x_bytes = []
        for i in cutlass.range_constexpr(x_chunks):
            idx = tidx + i * cfg.threads
            r = idx // CHUNKS_PER_X_ROW
            c = idx % CHUNKS_PER_X_ROW
            tok = bm * cfg.block_m + r
            x_src.append(mX.iterator.toint() + Int64(cutlass.min(tok, m - 1)) * Int64(k) + Int64(c * fmt.CHUNK_BYTES))
            x_dst.append(x_base + x_layout((r, c * fmt.CHUNK_BYTES, 0)))
            x_bytes.append(cutlass.select_(tok < m, Int32(fmt.CHUNK_BYTES), Int32(0)))

        # Prologue: stages - 1 groups in flight.
        for s in cutlass.range_constexpr(cfg.stages - 1):
            if s < groups:
                self.issue(s, s, w_src, w_dst, x_src, x_dst, x_bytes, w_stage_bytes, x_stage_bytes)
            cute.arch.cp_async_commit_group()

        # Token sums: thread t sums bytes [slice * width, (slice+1) * width) of token t % block_m.
        sum_tok = tidx % cfg.block_m
        sum_slices = cfg.threads // cfg.block_m
        sum_chunks = CHUNKS_PER_X_ROW // sum_slices
        sum_addr = x_base + sum_tok * X_ROW_BYTES + (tidx // cfg.block_m) * sum_chunks * fmt.CHUNK_BYTES
        xsum = Int32(0)

        w_warp = w_base + warp * fmt.GROUP_BYTES
        a_offs = [fmt.kstep_word_offset(g, j) for j in range(4)]
        shift = fmt.kstep_shift(tq)
        for kg in cutlass.range(groups, unroll=1):
            cute.arch.cp_async_wait_group(cfg.stages - 2)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_threads()
            nxt = kg + cfg.stages - 1
            if nxt < groups:
                self.issue(nxt, nxt % cfg.stages, w_src, w_dst, x_src, x_dst, x_bytes, w_stage_bytes, x_stage_bytes)
            cute.arch.cp_async_commit_group()

            st = kg % cfg.stages
            for c in cutlass.range_constexpr(sum_chunks):
                xsum = lds_sum16(sum_addr + st * x_stage_bytes + c * fmt.CHUNK_BYTES, xsum)
            w_stage = w_warp + st * w_stage_bytes
            for ks in cutlass.range_constexpr(fmt.GROUP_K // fmt.TILE_K):
                for j in cutlass.range_constexpr(4):
                    word = lds_b32(w_stage + ks * fmt.TILE_BYTES + a_offs[j])
                    tCrA_words[j + 4 * ks] = shr_and_var(word, shift, fmt.DECODE_MASK)
            warpgroup.fence()
            for ks in cutlass.range_constexpr(fmt.GROUP_K // fmt.TILE_K):
                cute.gemm(tiled_mma, acc, tCrA[None, None, ks], tCrB[None, None, ks, st], acc)
            warpgroup.commit_group()
            warpgroup.wait_group(0)

        sSum[tidx] = xsum
        cute.arch.sync_threads()

        coords = thr_mma.partition_C(cute.make_identity_tensor((WG_ROWS, cfg.block_m)))
        row0 = bn * cfg.block_n + wg_i * WG_ROWS
        for i in cutlass.range_constexpr(cute.size(acc)):
            r, c = coords[i]
            row = row0 + r
            tok = bm * cfg.block_m + c
            if row < n and tok < m:
                tok_sum = Int32(0)
                for p in cutlass.range_constexpr(sum_slices):
                    tok_sum = tok_sum + sSum[p * cfg.block_m + c]
                store_out(
                    mOut.iterator.toint(),
                    Int64(tok) * Int64(n) + Int64(row),
                    acc[i] - fmt.CODE_OFFSET * tok_sum,
                    Float32(mXScale[tok]),
                    segment_scale(mWScale, row, e1, e2, e3),
                    cfg.raw,
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
