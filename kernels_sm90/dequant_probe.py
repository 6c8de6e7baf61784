"""A one-warpgroup probe of the sm90 operand path on hardware: packed tile -> ldmatrix ->
lop3 dequant -> stmatrix -> 128B-swizzled K-major tile -> ``wgmma`` (SS).

For one K tile (``Nr`` tokens x ``D``) or one V tile (``D`` x ``Nr``) of the packed cache
(``layouts.sm90.tile_shape``):

1. the packed words (in their TMA swizzle atom, ``make_packed_smem_layout``) and the
   per-element (scale, zero) words (row-major, each row in fragment order) are copied to
   shared memory with cp.async;
2. warp ``w`` issues the ldmatrix x4 loads of ``warp_loads(...)[w]``, dequantizes every
   word with the decode kernel's lop3 / fma sequence (``kernels_sm80.dequant``), puts each
   pair where ``dequant_pair_targets`` says in the A-fragment registers of a 16x16 block,
   and stores the blocks with ``make_dequant_stsm_copy`` into the wgmma operand tile
   ``make_kv_smem_layout`` (the swizzle on the pointer, as TMA and the descriptor see it);
3. the tile is the B operand (N = its rows, K = its columns) of ``wgmma 64 x N x 16``
   with fp32 accumulation; A is one-hot, ``A[m, k] = 1`` iff ``k == m + 64 t`` in pass
   ``t``, so ``C[m, n] = B[n, 64 t + m]``: one exact product per output, the rest exact
   zeros.  ``out[n, 64 t + m]`` is written, so ``out`` equals the dequantized tile.

The params path is the same for K per-channel, K per-token and V: the host expands the
cache's params to one word per element, so the probe tests the packed layout and the
operand path, not the params layouts (the sm80 decode kernel owns those).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32
from cutlass.cute.nvgpu import warpgroup

from .. import jit
from ..kernels_sm80.copy import copy_rows, wait_all
from ..kernels_sm80.dequant import WordDequant, split_params
from ..kernels_sm80.host import fake_tensor, stream
from ..layouts import packing, sm80, sm90

THREADS = sm90.WARPGROUP_THREADS
WARP = sm90.WARP_THREADS


class DequantProbeSm90:
    """Arguments: ``packed`` f16 view ``(rows, 2*words)``, ``params`` int32 ``(rows, cols)``
    (one (scale, zero) word per element, each row in ``sm80.fragment_order``), ``out`` fp32
    ``(rows, cols)``, where ``(rows, cols) = sm90.tile_shape(bits, operand, head_dim)``."""

    def __init__(self, dtype, bits: int, operand: str, head_dim: int):
        self.dtype = dtype
        self.is_bf16 = dtype is cutlass.BFloat16
        self.bits = bits
        self.operand = operand
        self.head_dim = head_dim
        self.rows, self.cols = sm90.tile_shape(bits, operand, head_dim)
        self.words = sm80.words_per_row(bits, self.cols)
        self.kpw = sm80.k_blocks_per_word(bits)
        self.pairs = packing.codes_per_word(bits) // 2
        self.loads = sm90.warp_loads(bits, operand, head_dim)
        self.targets = sm90.dequant_pair_targets(bits)
        self.passes = self.cols // sm90.WGMMA_M  # one 64-column slice of B per one-hot A

    @staticmethod
    def compile(arch: str, dtype, bits: int, operand: str, head_dim: int, keep_ptx: bool = False):
        """Compiled against fake tensors of one K or V tile (sm_90a only)."""
        probe = DequantProbeSm90(dtype, bits, operand, head_dim)
        rows, cols = sm90.tile_shape(bits, operand, head_dim)
        args = [fake_tensor(cutlass.Float16, (rows, 2 * probe.words)), fake_tensor(cutlass.Int32, (rows, cols)),
                fake_tensor(Float32, (rows, cols))]
        return cute.compile(probe, *args, stream(), options=jit.compile_options(arch, keep_ptx=keep_ptx))

    @staticmethod
    def cached(arch: str, dtype, bits: int, operand: str, head_dim: int):
        """``compile`` through the JIT cache."""
        key = ("dequant_probe_sm90", arch, str(dtype), bits, operand, head_dim)
        return jit.KERNELS.get(key, lambda: DequantProbeSm90.compile(arch, dtype, bits, operand, head_dim))

    @cute.jit
    def __call__(self, mPacked: cute.Tensor, mParams: cute.Tensor, mOut: cute.Tensor, stream):
        # shared memory (up to 200 KB for 2-bit D=128) is sized by the DSL from the kernel
        self.kernel(mPacked, mParams, mOut).launch(grid=(1, 1, 1), block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mPacked: cute.Tensor, mParams: cute.Tensor, mOut: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        warp = tidx // WARP
        lane = tidx % WARP
        rows, cols = self.rows, self.cols

        packed_layout = sm90.make_packed_smem_layout(rows, 4 * self.words)
        b_layout = sm90.make_kv_smem_layout(self.dtype, self.bits, self.operand, self.head_dim)
        a_layout = sm90.make_operand_smem_layout(self.dtype, sm90.WGMMA_M, cols)
        smem = cutlass.memory.SmemAllocator()
        # 1024-byte alignment: the 128B swizzle repeats every 8 rows of 128 bytes, and the
        # pointer swizzle (byte address bits 4-6 ^= bits 7-9) assumes the tile starts there
        sPacked = smem.allocate_tensor(cutlass.Float16, packed_layout.outer, 1024, swizzle=packed_layout.inner)
        sB = smem.allocate_tensor(self.dtype, b_layout.outer, 1024, swizzle=b_layout.inner)
        # The params are dead once the tile is dequantized, and the one-hot A is written only
        # after that: both live in one buffer (2-bit V with D = 128 would not fit otherwise).
        params_bytes = rows * cols * 4
        a_bytes = cute.cosize(a_layout.outer) * self.dtype.width // 8
        scratch = smem.allocate_array(cutlass.Uint8, max(params_bytes, a_bytes), byte_alignment=1024)
        sParams = cute.make_tensor(cute.recast_ptr(scratch, dtype=Int32),
                                   cute.make_layout((rows, cols), stride=(cols, 1)))
        sA = cute.make_tensor(cute.recast_ptr(scratch, a_layout.inner, dtype=self.dtype), a_layout.outer)

        copy_rows(mPacked, sPacked, tidx, THREADS, 0, False)
        copy_rows(mParams, sParams, tidx, THREADS, 0, False)
        wait_all()

        # (8 values, rows/32, chunks) and (8 values, rows/16, cols/16): one x4 load / 16x16 block
        ld_src = sm90.make_packed_ldmatrix_copy(cutlass.Float16).get_slice(lane).partition_S(sPacked)
        st_thr = sm90.make_dequant_stsm_copy(self.dtype).get_slice(lane)
        st_dst = st_thr.partition_D(sB)
        a_dst = st_thr.partition_D(sA)
        a_coord = st_thr.partition_S(cute.make_identity_tensor((sm90.WGMMA_M, cols)))  # A-fragment order

        # Each warp's loads are static (layouts.sm90.warp_loads); branch on the warp index so
        # every register and smem index below is a compile-time constant.
        for w in cutlass.range_constexpr(sm90.WARPGROUP_WARPS):
            if warp == w:
                self.dequant_warp(w, lane, ld_src, st_dst, sParams, a_coord[None, 0, 0].shape)
        # stmatrix writes through the generic proxy; wgmma reads through the async proxy
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_threads()

        mma = sm90.make_wgmma(self.dtype, rows)
        thr_mma = mma.get_slice(tidx)
        tCrA = mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = mma.make_fragment_B(thr_mma.partition_B(sB))
        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((sm90.WGMMA_M, rows)), Float32)
        c_coord = thr_mma.partition_C(cute.make_identity_tensor((sm90.WGMMA_M, rows)))
        for t in cutlass.range_constexpr(self.passes):
            # one-hot A of pass t, stored with the same stmatrix copy: warp w owns rows 16w..
            for w in cutlass.range_constexpr(sm90.WARPGROUP_WARPS):
                if warp == w:
                    self.store_one_hot(t, a_coord[None, w, None], a_dst[None, w, None])
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_threads()

            warpgroup.fence()
            for kb in cutlass.range_constexpr(cols // sm90.WGMMA_K):
                mma.set(warpgroup.Field.ACCUMULATE, kb != 0)
                cute.gemm(mma, acc, tCrA[None, None, kb], tCrB[None, None, kb], acc)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            # C[m, n] = B[n, 64 t + m]
            # (64 values: a traced loop the compiler unrolls, not 64 traced copies of its body)
            for i in cutlass.range(cute.size(acc), unroll_full=True):
                m, n = c_coord[i]
                mOut[n, sm90.WGMMA_M * t + m] = acc[i]
            # every warp's wgmma has read A before the next pass overwrites it
            cute.arch.sync_threads()

    # Plain Python helpers, traced inside the per-warp branches (everything in them is
    # static, so nothing has to be carried through the run-time ``if``).

    def dequant_warp(self, w: int, lane, ld_src, st_dst, sParams, block_shape):
        """Warp ``w``: its ldmatrix loads -> lop3 dequant -> A-fragment blocks -> stmatrix."""
        dq = WordDequant(self.bits, self.is_bf16)
        c = lane % 4
        ldsm = sm90.make_packed_ldmatrix_copy(cutlass.Float16)
        stsm = sm90.make_dequant_stsm_copy(self.dtype)
        for row0, chunk in self.loads[w]:
            regs = cute.make_fragment_like(ld_src[None, 0, 0], cutlass.Float16)
            cute.copy(ldsm, ld_src[None, row0 // sm90.LDSM_BLOCK_ROWS, chunk], regs)
            words = cute.recast_tensor(regs, Uint32)  # word i: matrix i, row 8*i + lane//4
            # the 2*kpw 16x16 blocks this load fills: rows 16*mt.., k-block kpw*chunk + kb
            blocks = [cute.make_rmem_tensor(block_shape, self.dtype) for _ in range(2 * self.kpw)]
            block_words = [cute.recast_tensor(b, Uint32) for b in blocks]
            for i in range(4):
                row = row0 + sm80.LDSM_ROWS * i + lane // 4
                codes = dq.codes(words[i], range(self.pairs))
                for p in range(self.pairs):
                    mt, kb, v = self.targets[i][p]
                    # params of the pair's two columns, adjacent in fragment order
                    pos = sm80.param_position(self.kpw * chunk + kb, c, 2 * (p % 2))
                    s2, z2 = split_params(Uint32(sParams[row, pos]), Uint32(sParams[row, pos + 1]))
                    block_words[mt * self.kpw + kb][v // 2] = dq.scale(codes[p], s2, z2)
            for mt in range(2):
                for kb in range(self.kpw):
                    dst = st_dst[None, row0 // sm90.STSM_BLOCK + mt, self.kpw * chunk + kb]
                    cute.copy(stsm, blocks[mt * self.kpw + kb], dst)

    def store_one_hot(self, t: int, coord, dst):
        """This warp's 16 rows of the one-hot A of pass ``t`` (``A[m, k] = (k == m + 64 t)``)."""
        stsm = sm90.make_dequant_stsm_copy(self.dtype)
        one, zero = self.dtype(1.0), self.dtype(0.0)
        for kb in range(cute.size(dst, mode=[1])):
            regs = cute.make_rmem_tensor(coord[None, 0].shape, self.dtype)
            for v in range(cute.size(regs)):
                m, k = coord[None, kb][v]
                regs[v] = cutlass.select_(k == m + sm90.WGMMA_M * t, one, zero)
            cute.copy(stsm, regs, dst[None, kb])
