"""Split-KV decode attention over an FP4 (NVFP4 / MXFP4) KV cache on Blackwell (sm_100a).

The packed bytes are read as they are by the block-scaled ``tcgen05.mma``: K's rows
(tokens) and V's rows (channels of a 128-token tile) are K-major e2m1 operands, their
scale bytes sit in the 128 x 4 basic chunks tcgen05 reads (``layouts.sm100``), so TMA and
one bulk copy bring a tile and its scales to shared memory and ``tcgen05.cp`` moves the
scales to tensor memory.  The instruction kinds that read an NVFP4 operand as it is take
FP4 on both sides (``kind::mxf4nvf4``; MXFP4 the same with ``kind::mxf4``), so Q and P are
quantized on the fly to the cache's own format, with one fp32 scale per query row (Q) and
per tile and query row (P) that maps the largest value to the top of the e4m3 block-scale
range, each as ``OPERAND_TERMS`` FP4 terms (every term the residual of the ones before,
with its own block scales): one term alone costs 0.12-0.22 relative L2 of the output,
four reach 16-bit operands' accuracy, at four block-scaled MMAs per product accumulating
in the same tensor memory; ``bitdecode.emulate_sm100`` is the arithmetic step by step, in
torch, and the CPU test that checks it against the reference.  The 16-bit tiles (sink tokens, the residual
block) run on ``kind::f16`` with 16-bit Q and P::

    S^T = K . Q^T    A = K   (128 tokens x D, smem),        B = Q (N query heads x D)
    O^T = V^T . P^T  A = V^T (D channels x 128 tokens),     B = P (N x 128 tokens)

One CTA = (split, KV head, sequence), six warps with fixed roles:

* warps 0-3, **softmax**: thread ``t`` owns TMEM lane ``t`` (token ``t`` of S^T, channel
  ``t`` of O^T; a warp reads only its own lane quarter).  Quantizes Q's terms once; per tile reads
  S^T, exchanges the per-head tile maxima through shared memory, writes P (FP4 terms' codes
  and block scales, or 16 bits), reads the tile's O^T and folds it into fp32 registers with
  the running-max correction (each tile's P V lands in a fresh accumulator: summing a
  million tokens inside the tensor core drifted on sm90), and writes the split's O / LSE;
  for 16-bit tiles it also stages K and V^T in shared memory.
* warp 4, **load**: TMA of the packed K and V rows of a tile and bulk copies of their
  scale chunks, on a ``PipelineTmaUmma`` ring.
* warp 5, **MMA**: allocates tensor memory, moves scales to it (``tcgen05.cp``) and issues
  both products (one thread), committing to the softmax's barriers.

Not run on hardware (there is no Blackwell GPU here): compiled for sm_100a, its PTX
checked, its arithmetic emulated on the CPU.
"""

# no `from __future__ import annotations`: @cute.struct reads its field annotations as objects
import math
from types import SimpleNamespace
from typing import Type

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blockscaled_layout as blockscaled
from cutlass import Float32, Int32, Uint32, const_expr
from cutlass.cute.nvgpu import cpasync, tcgen05

from ..kernels_sm80 import ptx
from ..kernels_sm80.decode import PackedDecodeConfig, query_views
from ..kernels_sm80.pack_fp4 import FIELD_BITS, Fp4Blocks
from ..kernels_sm80.tensors import page_of, split_tiles, wait_for_previous_kernel
from ..kernels_sm90 import ptx90
from ..layouts import sm100
from ..layouts.packing import F32_MAX, F32_SIGN_BIT, LN_2

ROWS = sm100.UMMA_M  # tokens of a tile = TMEM lanes = softmax threads
SOFTMAX_WARPS = 4
LOAD_WARP = 4
MMA_WARP = 5
THREADS = 32 * 6
E2M1_PER_WORD = 32 // FIELD_BITS
SMEM_BYTES = 200 * 1024  # of the 227 KB a Blackwell SM gives one CTA


def sync(method, state):
    """``method(state)`` of a pipeline (wait / acquire / commit / release / tail).  Called
    through this function, the pipeline objects stay out of what the staged loops and
    branches carry (their CTA-group enum cannot be staged); the states are carried."""
    method(state)


@cute.jit
def store_at(byte_ptr, value):
    """Store ``value`` (its own type) at a shared-memory byte address."""
    cute.make_tensor(cute.recast_ptr(byte_ptr, dtype=type(value)), cute.make_layout(1))[0] = value


class Barrier:
    """Named barriers (id 0 is __syncthreads)."""

    SOFTMAX = 1  # the four softmax warps: the tile maxima / row sums are in shared memory
    Q_READY = 2  # softmax warps + the MMA warp: Q (both forms) and its scales are in smem


class DecodeSm100(PackedDecodeConfig, Fp4Blocks):
    """FP4-cache decode attention on tcgen05; constexpr configuration here."""

    def __init__(self, dtype: Type[cutlass.Numeric], fp4: str, head_dim: int, heads_tile: int, split: bool,
                 pdl: bool = True, sinks: int = 0, num_stages: int = 0, terms: int = sm100.OPERAND_TERMS):
        Fp4Blocks.__init__(self, fp4)
        PackedDecodeConfig.__init__(self, dtype, 4, "token", self.vec, head_dim, heads_tile, split, pdl, sinks,
                                    4, 1, fp4)
        assert self.nr == self.v_tile == ROWS
        assert head_dim % ROWS == 0, "the sm100 kernel takes head dims 128 and 256 (V^T's rows are the MMA's M)"
        self.m_v = head_dim // ROWS  # M-blocks of O^T
        self.k_tiler = (ROWS, heads_tile, head_dim)  # S^T: tokens x query heads, over channels
        self.v_tiler = (head_dim, heads_tile, ROWS)  # O^T: channels x query heads, over tokens
        self.sf_dtype = cutlass.Float8E4M3FN if fp4 == "nvfp4" else cutlass.Float8E8M0FNU
        self.bytes_sfk = 4 * self.words_ks
        self.bytes_sfv = 4 * self.words_vs
        self.tx_bytes = self.bytes_kp + self.bytes_vp + self.bytes_sfk + self.bytes_sfv
        assert terms >= 1
        self.terms = terms  # FP4 terms of Q and of P (sm100.OPERAND_TERMS says why four)
        # the 16-bit K / V^T tiles, 16-bit Q and P, and per term FP4 Q and P with their scales
        fixed = 2 * (2 * ROWS * head_dim) + 4 * 1024 + (terms - 1) * (heads_tile * (head_dim + ROWS) // 2 + 2048)
        self.num_stages = num_stages or max(2, min(4, (SMEM_BYTES - fixed) // self.tx_bytes))
        self.q_blocks = heads_tile * head_dim // self.vec  # Q's scale blocks

    # ---------------------------------------------------------------------------------
    # Host side
    # ---------------------------------------------------------------------------------
    def _mmas(self):
        """(block-scaled FP4 MMA, 16-bit MMA), both 128 x N (call in a trace)."""
        return sm100.make_blockscaled_mma(self.fp4, self.nh), sm100.make_f16_mma(self.dtype, self.nh)

    def _layouts(self, mma, mma16):
        e2m1, st = cutlass.Float4E2M1FN, self.num_stages
        return SimpleNamespace(
            k=sm100.mma_operand_layout(mma, self.k_tiler, e2m1, "a", st),
            v=sm100.mma_operand_layout(mma, self.v_tiler, e2m1, "a", st),
            q=sm100.mma_operand_layout(mma, self.k_tiler, e2m1, "b", self.terms),  # a stage per term
            p=sm100.mma_operand_layout(mma, self.v_tiler, e2m1, "b", self.terms),
            sfk=blockscaled.make_smem_layout_sfa(mma, self.k_tiler, self.vec, st),
            sfv=blockscaled.make_smem_layout_sfa(mma, self.v_tiler, self.vec, st),
            sfq=blockscaled.make_smem_layout_sfb(mma, self.k_tiler, self.vec, self.terms),
            sfp=blockscaled.make_smem_layout_sfb(mma, self.v_tiler, self.vec, self.terms),
            k16=sm100.mma_operand_layout(mma16, self.k_tiler, self.dtype, "a"),
            v16=sm100.mma_operand_layout(mma16, self.v_tiler, self.dtype, "a"),
            q16=sm100.mma_operand_layout(mma16, self.k_tiler, self.dtype, "b"),
            p16=sm100.mma_operand_layout(mma16, self.v_tiler, self.dtype, "b"),
        )

    def _p_region(self, lay):
        """Byte offsets of the buffers sharing the P region, and its size (call in a trace).

        The FP4 P terms with their scales (packed tiles), 16-bit P (sink / residual tiles)
        and Q's scale terms (read once, by the tcgen05.cp before the first MMA) are never
        live together, so they share bytes: every write of P follows the ``p`` pipeline's
        acquire, which waits for the MMA warp's release of the previous P, a tcgen05.commit
        that arrives once the MMAs (and scale copies) reading it have completed; and the
        first P is written after the first S^T landed, committed after Q's scale copies.
        It keeps four terms within a Blackwell SM's shared memory at head dim 256 and 16
        query columns (NVFP4: 12 KB less, 232 KB otherwise)."""
        bytes_of = lambda layout, bits: cute.cosize(layout) * bits // 8  # noqa: E731
        sfp = -(-bytes_of(lay.p, FIELD_BITS) // 1024) * 1024
        size = max(sfp + bytes_of(lay.sfp, 8), bytes_of(lay.p16, self.dtype.width), bytes_of(lay.sfq, 8))
        return {"sP": 0, "sSFP": sfp, "sP16": 0, "sSFQ": 0}, size

    def _shared_storage(self, lay):
        st, nh, e2m1 = self.num_stages, self.nh, cutlass.Float4E2M1FN
        _, p_bytes = self._p_region(lay)

        def buf(dtype, layout, align=1024):
            return cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(layout)], align]

        @cute.struct
        class Storage:
            kv_mbar: cute.struct.MemRange[cutlass.Int64, 2 * st]
            s_mbar: cute.struct.MemRange[cutlass.Int64, 2]
            p_mbar: cute.struct.MemRange[cutlass.Int64, 2]
            o_mbar: cute.struct.MemRange[cutlass.Int64, 2]
            x_mbar: cute.struct.MemRange[cutlass.Int64, 2]
            tmem_addr: Int32
            red: cute.struct.MemRange[Float32, SOFTMAX_WARPS * nh]  # per-warp maxima / sums
            q_amax: cute.struct.MemRange[Float32, self.q_blocks]
            sK: buf(e2m1, lay.k)
            sV: buf(e2m1, lay.v)
            sQ: buf(e2m1, lay.q)
            sSFK: buf(self.sf_dtype, lay.sfk, 128)
            sSFV: buf(self.sf_dtype, lay.sfv, 128)
            sK16: buf(self.dtype, lay.k16)
            sV16: buf(self.dtype, lay.v16)
            sQ16: buf(self.dtype, lay.q16)
            sPQ: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, p_bytes], 1024]  # _p_region

        return Storage

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mKp: cute.Tensor, mKs: cute.Tensor, mVp: cute.Tensor, mVs: cute.Tensor,
                 mKr: cute.Tensor, mVr: cute.Tensor, mKsink: cute.Tensor, mVsink: cute.Tensor,
                 mSeqlens: cute.Tensor, mBlockTable: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 softmax_scale_log2: Float32, tail_weight: Int32, stream):
        """The decode calling convention of ``DecodeSm80.__call__`` (``k_pack`` / ``v_pack``
        as int32 words here), so every backend shares one ``DecodePlan``."""
        mQ, mO = query_views(mQ, mO, self.split)
        mma, mma16 = self._mmas()
        lay = self._layouts(mma, mma16)
        Storage = self._shared_storage(lay)
        e2m1 = cutlass.Float4E2M1FN
        # K (pages, Hkv, page, D) -> (page rows, D, (Hkv, pages)); V (pages, Hkv, blocks, D,
        # 128) -> (D, 128, (blocks, Hkv, pages)): one tile is one TMA box of each
        k4 = cute.recast_tensor(mKp, e2m1)
        v4 = cute.recast_tensor(mVp, e2m1)
        k_view = cute.group_modes(cute.make_tensor(k4.iterator, cute.select(k4.layout, mode=[2, 3, 1, 0])), 2, 4)
        v_view = cute.group_modes(cute.make_tensor(v4.iterator, cute.select(v4.layout, mode=[3, 4, 2, 1, 0])), 2, 5)
        op = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)
        tma_k, tma_tk = cute.nvgpu.make_tiled_tma_atom_A(
            op, k_view, cute.slice_(lay.k, (None, None, None, 0)), self.k_tiler, mma)
        tma_v, tma_tv = cute.nvgpu.make_tiled_tma_atom_A(
            op, v_view, cute.slice_(lay.v, (None, None, None, 0)), self.v_tiler, mma)
        num_splits = mO.shape[0] if const_expr(self.split) else 1
        grid = (num_splits, mKr.shape[2], mKr.shape[0])
        self.kernel(mma, mma16, mQ, tma_k, tma_tk, mKs, tma_v, tma_tv, mVs, mKr, mVr, mKsink, mVsink, mSeqlens,
                    mBlockTable, mO, mLSE, softmax_scale_log2, tail_weight, Storage).launch(
            grid=grid, block=[THREADS, 1, 1], stream=stream, use_pdl=self.pdl)

    # ---------------------------------------------------------------------------------
    # Device side
    # ---------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, mma: cute.TiledMma, mma16: cute.TiledMma, mQ, tma_k: cute.CopyAtom, mKt: cute.Tensor, mKs,
               tma_v: cute.CopyAtom, mVt: cute.Tensor, mVs, mKr, mVr, mKsink, mVsink, mSeqlens, mBlockTable, mO,
               mLSE, softmax_scale_log2: Float32, tail_weight: Int32, Storage: cutlass.Constexpr):
        lay = self._layouts(mma, mma16)
        # (the grid's own order: the sm100 backend splits evenly, and the remap of
        # ``split_coords`` made ptxas spill here)
        split_idx, head_kv, batch = cute.arch.block_idx()
        num_splits, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == LOAD_WARP:
            cpasync.prefetch_descriptor(tma_k)
            cpasync.prefetch_descriptor(tma_v)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(Storage)
        one = pipeline.CooperativeGroup(pipeline.Agent.Thread)
        softmax_group = pipeline.CooperativeGroup(pipeline.Agent.Thread, 32 * SOFTMAX_WARPS)
        pipes = SimpleNamespace(
            kv=pipeline.PipelineTmaUmma.create(  # packed tiles: load warp -> MMA warp
                num_stages=self.num_stages, producer_group=one, consumer_group=one, tx_count=self.tx_bytes,
                barrier_storage=storage.kv_mbar.data_ptr(), defer_sync=True),
            s=pipeline.PipelineUmmaAsync.create(  # S^T in TMEM, read by the softmax
                num_stages=1, producer_group=one, consumer_group=softmax_group,
                barrier_storage=storage.s_mbar.data_ptr(), defer_sync=True),
            p=pipeline.PipelineAsyncUmma.create(  # P (and its scales) in smem
                num_stages=1, producer_group=softmax_group, consumer_group=one,
                barrier_storage=storage.p_mbar.data_ptr(), defer_sync=True),
            o=pipeline.PipelineUmmaAsync.create(  # the tile's O^T in TMEM
                num_stages=1, producer_group=one, consumer_group=softmax_group,
                barrier_storage=storage.o_mbar.data_ptr(), defer_sync=True),
            x=pipeline.PipelineAsyncUmma.create(  # a 16-bit K / V^T tile in smem
                num_stages=1, producer_group=softmax_group, consumer_group=one,
                barrier_storage=storage.x_mbar.data_ptr(), defer_sync=True))

        tmem_cols = self.tmem_columns(mma, lay)
        if warp_idx == MMA_WARP:
            cute.arch.alloc_tmem(tmem_cols, storage.tmem_addr.ptr)
        cute.arch.sync_threads()  # barrier inits and the TMEM address visible to every warp

        wait_for_previous_kernel(self.pdl)
        n_sink, n_rest = self.token_counts(mSeqlens[batch])
        tile_begin, packed_end, has_residual, n_res = split_tiles(n_rest, self.nr, split_idx, num_splits,
                                                                  tail_weight)
        sink_tile = (split_idx == 0) & (n_sink > 0)
        tmem = self.tmem_tensors(mma, lay, storage)

        if warp_idx == LOAD_WARP:
            self.load(pipes.kv, tma_k, mKt, tma_v, mVt, mKs, mVs, storage, lay, mma, mBlockTable, batch, head_kv,
                      tile_begin, packed_end)
        elif warp_idx == MMA_WARP:
            self.issue(mma, mma16, lay, storage, tmem, pipes, sink_tile, tile_begin, packed_end, has_residual)
            cute.arch.relinquish_tmem_alloc_permit()
            cute.arch.dealloc_tmem(tmem.base, tmem_cols)
        elif warp_idx < SOFTMAX_WARPS:
            self.softmax(lay, storage, tmem, pipes, mQ, mKr, mVr, mKsink, mVsink, mO,
                         mLSE, batch, head_kv, split_idx, sink_tile, n_sink, tile_begin, packed_end, has_residual,
                         n_res, softmax_scale_log2)

    # ---------------------------------------------------------------------------------
    # Tensor memory: S^T, O^T and the four scale-factor operands
    # ---------------------------------------------------------------------------------
    def _tmem_layouts(self, mma, lay):
        acc_s = mma.make_fragment_C(mma.partition_shape_C(self.k_tiler[:2]))
        acc_o = mma.make_fragment_C(mma.partition_shape_C(self.v_tiler[:2]))
        one = (None, None, None, 0)
        sf = (blockscaled.make_tmem_layout_sfa(mma, self.k_tiler, self.vec, cute.slice_(lay.sfk, one)),
              blockscaled.make_tmem_layout_sfb(mma, self.k_tiler, self.vec, cute.slice_(lay.sfq, one)),
              blockscaled.make_tmem_layout_sfa(mma, self.v_tiler, self.vec, cute.slice_(lay.sfv, one)),
              blockscaled.make_tmem_layout_sfb(mma, self.v_tiler, self.vec, cute.slice_(lay.sfp, one)))
        return acc_s, acc_o, sf

    def _sf_copies(self):
        """How many TMEM copies of each scale-factor operand (K, Q, V, P): one per term of Q
        and of P, so no term's scales overwrite another's under an MMA in flight."""
        return (1, self.terms, 1, self.terms)

    def tmem_columns(self, mma, lay) -> int:
        """TMEM columns to allocate: S^T, O^T, the scale factors, rounded up to a power of two."""
        acc_s, acc_o, sf = self._tmem_layouts(mma, lay)
        cols = tcgen05.find_tmem_tensor_col_offset(acc_s) + tcgen05.find_tmem_tensor_col_offset(acc_o)
        for layout, copies in zip(sf, self._sf_copies()):  # (a TMEM tensor at address 0 only to measure it)
            cols += copies * tcgen05.find_tmem_tensor_col_offset(cute.make_tensor(cute.make_ptr(
                self.sf_dtype, 0, cute.AddressSpace.tmem, assumed_align=16), layout))
        return max(32, 1 << (cols - 1).bit_length())

    @cute.jit
    def tmem_tensors(self, mma, lay, storage):
        acc_s, acc_o, sf = self._tmem_layouts(mma, lay)
        base = cute.arch.retrieve_tmem_ptr(Float32, 16, storage.tmem_addr.ptr)
        tS = cute.make_tensor(base, acc_s.layout)
        col = tcgen05.find_tmem_tensor_col_offset(acc_s)
        tO = cute.make_tensor(base + col, acc_o.layout)
        col += tcgen05.find_tmem_tensor_col_offset(acc_o)
        sfs = []
        for layout, copies in zip(sf, self._sf_copies()):
            ts = []
            for _ in cutlass.range_constexpr(copies):
                t = cute.make_tensor(cute.recast_ptr(base + col, dtype=self.sf_dtype), layout)
                ts.append(t)
                col += tcgen05.find_tmem_tensor_col_offset(t)
            sfs.append(ts)
        return SimpleNamespace(base=base, s=tS, o=tO, sfk=sfs[0][0], sfq=sfs[1], sfv=sfs[2][0], sfp=sfs[3])

    def _bytes(self, storage, lay, name: str):
        """Byte pointer of smem buffer ``name`` (those of ``_p_region`` inside it)."""
        offsets, _ = self._p_region(lay)
        if name in offsets:
            return storage.sPQ.data_ptr() + offsets[name]
        return cute.recast_ptr(getattr(storage, name).data_ptr(), dtype=cutlass.Uint8)

    def _smem(self, storage, lay, name: str, layout, dtype):
        """A staged smem operand tensor with its swizzle on the pointer (MMA / TMA view)."""
        return cute.make_tensor(cute.recast_ptr(self._bytes(storage, lay, name), layout.inner, dtype=dtype),
                                layout.outer)

    def _sf_smem(self, storage, lay, name: str, layout):
        return cute.make_tensor(cute.recast_ptr(self._bytes(storage, lay, name), dtype=self.sf_dtype), layout)

    # ---------------------------------------------------------------------------------
    # Load warp: TMA of the packed rows, bulk copies of the scale chunks
    # ---------------------------------------------------------------------------------
    @cute.jit
    def load(self, kv, tma_k, mKt, tma_v, mVt, mKs, mVs, storage, lay, mma, mBlockTable, batch, head_kv,
             tile_begin, packed_end):
        e2m1 = cutlass.Float4E2M1FN
        sK = self._smem(storage, lay, "sK", lay.k, e2m1)
        sV = self._smem(storage, lay, "sV", lay.v, e2m1)
        thr = mma.get_slice(0)
        gK = cute.local_tile(mKt, (ROWS, self.d), (None, None, None))
        gV = cute.local_tile(mVt, (self.d, ROWS), (None, None, None))
        tKs, tKg = cpasync.tma_partition(tma_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 3),
                                         cute.group_modes(thr.partition_A(gK), 0, 3))
        tVs, tVg = cpasync.tma_partition(tma_v, 0, cute.make_layout(1), cute.group_modes(sV, 0, 3),
                                         cute.group_modes(thr.partition_A(gV), 0, 3))
        sfk = cute.recast_ptr(storage.sSFK.data_ptr(), dtype=Int32)
        sfv = cute.recast_ptr(storage.sSFV.data_ptr(), dtype=Int32)
        page_rows = mKt.shape[0]
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        for tile in cutlass.range(tile_begin, packed_end, unroll=1):
            page, off = page_of(mBlockTable, batch, tile * self.nr, page_rows, mKs.shape[0])
            blk = off // self.nr
            kv.producer_acquire(state)
            bar = kv.producer_get_barrier(state)
            cute.copy(tma_k, tKg[None, blk, 0, (head_kv, page)], tKs[None, state.index], tma_bar_ptr=bar)
            cute.copy(tma_v, tVg[None, 0, 0, (blk, head_kv, page)], tVs[None, state.index], tma_bar_ptr=bar)
            with cute.arch.elect_one():  # a tile's scale chunks are contiguous words, in the MMA's order
                ks_src = mKs[page, head_kv, blk, None, None].iterator
                vs_src = mVs[page, head_kv, blk, None, None, None].iterator
                ptx90.bulk_g2s(sfk + state.index * self.words_ks, ks_src, self.bytes_sfk, bar)
                ptx90.bulk_g2s(sfv + state.index * self.words_vs, vs_src, self.bytes_sfv, bar)
            state.advance()
        kv.producer_tail(state)

    # ---------------------------------------------------------------------------------
    # MMA warp
    # ---------------------------------------------------------------------------------
    def _s2t(self, s_sf, t_sf):
        """``tcgen05.cp`` of scale factors smem -> TMEM: (copy, staged smem source, TMEM dest)."""
        s_c, t_c = cute.filter_zeros(s_sf), cute.filter_zeros(t_sf)
        copy = tcgen05.make_s2t_copy(cute.make_copy_atom(tcgen05.Cp4x32x128bOp(tcgen05.CtaGroup.ONE),
                                                         self.sf_dtype), t_c)
        thr = copy.get_slice(0)
        return copy, tcgen05.get_s2t_smem_desc_tensor(copy, thr.partition_S(s_c)), thr.partition_D(t_c)

    @cute.jit
    def issue(self, mma, mma16, lay, storage, tmem, pipes, sink_tile, tile_begin, packed_end, has_residual):
        """The MMAs of the split (one warp; each MMA is issued by one elected thread)."""
        e2m1 = cutlass.Float4E2M1FN
        rK = mma.make_fragment_A(self._smem(storage, lay, "sK", lay.k, e2m1))
        rV = mma.make_fragment_A(self._smem(storage, lay, "sV", lay.v, e2m1))
        rQ = mma.make_fragment_B(self._smem(storage, lay, "sQ", lay.q, e2m1))
        rP = mma.make_fragment_B(self._smem(storage, lay, "sP", lay.p, e2m1))
        rK16 = mma16.make_fragment_A(self._smem(storage, lay, "sK16", lay.k16, self.dtype))
        rV16 = mma16.make_fragment_A(self._smem(storage, lay, "sV16", lay.v16, self.dtype))
        rQ16 = mma16.make_fragment_B(self._smem(storage, lay, "sQ16", lay.q16, self.dtype))
        rP16 = mma16.make_fragment_B(self._smem(storage, lay, "sP16", lay.p16, self.dtype))
        cp_k, src_k, dst_k = self._s2t(self._sf_smem(storage, lay, "sSFK", lay.sfk), tmem.sfk)
        cp_v, src_v, dst_v = self._s2t(self._sf_smem(storage, lay, "sSFV", lay.sfv), tmem.sfv)
        # one (copy, source, TMEM destination) per term; the smem source's stage is the term
        cp_q = [self._s2t(self._sf_smem(storage, lay, "sSFQ", lay.sfq), t) for t in tmem.sfq]
        cp_p = [self._s2t(self._sf_smem(storage, lay, "sSFP", lay.sfp), t) for t in tmem.sfp]

        cute.arch.barrier(barrier_id=Barrier.Q_READY, number_of_threads=32 * (SOFTMAX_WARPS + 1))
        # (the copies are indexed, never unpacked into locals: a local assigned inside the
        # staged tile loop would be carried through it, and a tiled copy cannot be)
        for t in cutlass.range_constexpr(self.terms):  # Q's scales stay in TMEM for the whole split
            cute.copy(cp_q[t][0], cp_q[t][1][(None, None, None, None, t)], cp_q[t][2])

        producer, consumer = pipeline.PipelineUserType.Producer, pipeline.PipelineUserType.Consumer
        kv_st = pipeline.make_pipeline_state(consumer, self.num_stages)
        s_st = pipeline.make_pipeline_state(producer, 1)
        p_st = pipeline.make_pipeline_state(consumer, 1)
        o_st = pipeline.make_pipeline_state(producer, 1)
        x_st = pipeline.make_pipeline_state(consumer, 1)
        # (helpers hand the pipeline states back: they are carried through the staged
        # branches and loops only as rebound locals)
        if sink_tile:
            mma16, s_st, p_st, o_st, x_st = self.issue_16bit(mma16, tmem, rK16, rV16, rQ16, rP16, pipes, s_st, p_st,
                                                             o_st, x_st)
        for _tile in cutlass.range(tile_begin, packed_end, unroll=1):
            sync(pipes.kv.consumer_wait, kv_st)
            sync(pipes.s.producer_acquire, s_st)
            cute.copy(cp_k, src_k[(None, None, None, None, kv_st.index)], dst_k)
            for t in cutlass.range_constexpr(self.terms):  # S^T = sum over Q's terms of K qhat_t^T
                mma = self.accumulate_k(mma, tmem.s, rK, rQ, kv_st.index, tmem.sfk, tmem.sfq[t], t, t > 0)
            sync(pipes.s.producer_commit, s_st)
            sync(pipes.p.consumer_wait, p_st)
            sync(pipes.o.producer_acquire, o_st)
            cute.copy(cp_v, src_v[(None, None, None, None, kv_st.index)], dst_v)
            for t in cutlass.range_constexpr(self.terms):
                cute.copy(cp_p[t][0], cp_p[t][1][(None, None, None, None, t)], cp_p[t][2])
            for t in cutlass.range_constexpr(self.terms):  # every M-block of O^T, every term of P
                mma = self.accumulate_k(mma, tmem.o, rV, rP, kv_st.index, tmem.sfv, tmem.sfp[t], t, t > 0)
            sync(pipes.o.producer_commit, o_st)
            sync(pipes.kv.consumer_release, kv_st)
            sync(pipes.p.consumer_release, p_st)
            kv_st.advance()
            s_st.advance()
            p_st.advance()
            o_st.advance()
        if has_residual:
            mma16, s_st, p_st, o_st, x_st = self.issue_16bit(mma16, tmem, rK16, rV16, rQ16, rP16, pipes, s_st, p_st,
                                                             o_st, x_st)
        sync(pipes.o.producer_tail, o_st)  # the softmax read the last O^T: the TMEM can go

    @cute.jit
    def accumulate_k(self, mma, acc, a, b, a_stage, sfa=None, sfb=None, b_stage: cutlass.Constexpr = 0,
                     onto: cutlass.Constexpr = False):
        """``acc = A B`` (``acc += A B`` when ``onto``) over the K-blocks of operand fragments
        ``a`` (stage ``a_stage``) and ``b`` (stage ``b_stage``: an FP4 term), with their
        scale-factor fragments in TMEM for the block-scaled kinds; the MMA is handed back
        (its ACCUMULATE field is set per block)."""
        for k in cutlass.range_constexpr(cute.size(a, mode=[2])):
            mma.set(tcgen05.Field.ACCUMULATE, k != 0 or onto)
            if cutlass.const_expr(sfa is None):
                cute.gemm(mma, acc, a[None, None, k, a_stage], b[None, None, k, b_stage], acc)
            else:
                cute.gemm(mma, acc, [a[None, None, k, a_stage], sfa[None, None, k]],
                          [b[None, None, k, b_stage], sfb[None, None, k]], acc)
        return mma

    @cute.jit
    def issue_16bit(self, mma16, tmem, rK16, rV16, rQ16, rP16, pipes, s_st, p_st, o_st, x_st):
        """Both products of a 16-bit tile (sinks, residual) on ``kind::f16``."""
        sync(pipes.x.consumer_wait, x_st)
        sync(pipes.s.producer_acquire, s_st)
        mma16 = self.accumulate_k(mma16, tmem.s, rK16, rQ16, 0)
        sync(pipes.s.producer_commit, s_st)
        sync(pipes.p.consumer_wait, p_st)
        sync(pipes.o.producer_acquire, o_st)
        mma16 = self.accumulate_k(mma16, tmem.o, rV16, rP16, 0)
        sync(pipes.o.producer_commit, o_st)
        sync(pipes.x.consumer_release, x_st)
        sync(pipes.p.consumer_release, p_st)
        s_st.advance()
        p_st.advance()
        o_st.advance()
        x_st.advance()
        return mma16, s_st, p_st, o_st, x_st

    # ---------------------------------------------------------------------------------
    # Softmax warps
    # ---------------------------------------------------------------------------------
    @cute.jit
    def softmax(self, lay, storage, tmem, pipes, mQ, mKr, mVr, mKsink, mVsink, mO,
                mLSE, batch, head_kv, split_idx, sink_tile, n_sink, tile_begin, packed_end, has_residual, n_res,
                scale_log2):
        tid = cute.arch.thread_idx()[0]
        lane = tid % 32
        warp = cute.arch.make_warp_uniform(tid // 32)
        gq = mQ.shape[1] // mKr.shape[2]
        red = storage.red.get_tensor(cute.make_layout((self.nh, SOFTMAX_WARPS)))
        # TMEM -> registers: thread t reads lane t, one fp32 per query column
        ld = tcgen05.make_tmem_copy(cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition(self.nh)), Float32),
                                    tmem.s[(None, 0, 0)])
        thr_ld = ld.get_slice(tid)
        tS = thr_ld.partition_S(tmem.s[(None, 0, 0)])
        tO = [thr_ld.partition_S(tmem.o[(None, m, 0)]) for m in range(self.m_v)]

        rg = self.stage_q(lay, storage, mQ, batch, head_kv, gq, tid)
        cute.arch.barrier(barrier_id=Barrier.Q_READY, number_of_threads=32 * (SOFTMAX_WARPS + 1))
        # per query column (the thread's copy of it): running max, row sum, output rows
        row_max = cute.make_rmem_tensor((self.nh,), Float32)
        row_sum = cute.make_rmem_tensor((self.nh,), Float32)
        acc_o = cute.make_rmem_tensor((self.m_v, self.nh), Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)
        acc_o.fill(0.0)
        c_fp4 = cute.make_rmem_tensor((self.nh,), Float32)  # S^T of an FP4 tile to log2 units
        for h in cutlass.range_constexpr(self.nh):
            c_fp4[h] = ptx.div_rn(scale_log2, rg[h])
        st = SimpleNamespace(ld=ld, thr_ld=thr_ld, s_tile=tmem.s[(None, 0, 0)], tS=tS, tO=tO, row_max=row_max, row_sum=row_sum,
                             acc_o=acc_o, red=red, tid=tid, lane=lane, warp=warp)

        producer, consumer = pipeline.PipelineUserType.Producer, pipeline.PipelineUserType.Consumer
        s_st = pipeline.make_pipeline_state(consumer, 1)
        p_st = pipeline.make_pipeline_state(producer, 1)
        o_st = pipeline.make_pipeline_state(consumer, 1)
        x_st = pipeline.make_pipeline_state(producer, 1)
        if sink_tile:
            x_st = self.stage_16bit(lay, storage, pipes, x_st, mKsink, mVsink, batch, head_kv, n_sink, tid)
            s_st, p_st, o_st = self.tile(lay, storage, st, pipes, s_st, p_st, o_st, None, scale_log2, n_sink, False)
        for _tile in cutlass.range(tile_begin, packed_end, unroll=1):
            s_st, p_st, o_st = self.tile(lay, storage, st, pipes, s_st, p_st, o_st, c_fp4, scale_log2, ROWS, True)
        if has_residual:
            res_k = mKr[batch, None, head_kv, None]
            res_v = mVr[batch, None, head_kv, None]
            x_st = self.stage_16bit(lay, storage, pipes, x_st, res_k, res_v, None, None, n_res, tid)
            s_st, p_st, o_st = self.tile(lay, storage, st, pipes, s_st, p_st, o_st, None, scale_log2, n_res, False)
        self.epilogue(st, mO, mLSE, batch, head_kv, split_idx, gq)

    # ---- Q: both operand forms, once ------------------------------------------------
    @cute.jit
    def stage_q(self, lay, storage, mQ, batch, head_kv, gq, tid):
        """Writes Q (rows ``>= gq`` zero) as the FP4 operand with its block scales and as the
        16-bit operand; returns ``rg`` per query column (``OPERAND_TOP / max|q row|``)."""
        q_amax = storage.q_amax.get_tensor(cute.make_layout((self.q_blocks,)))
        per_row = self.d // self.vec
        q0 = head_kv * gq
        # pass 1: block maxima (and the 16-bit copy)
        b16 = sm100.rows_cols_bytes(lay.q16, self.dtype)
        p16 = cute.recast_ptr(storage.sQ16.data_ptr(), dtype=cutlass.Uint8)
        for b in cutlass.range(tid, self.q_blocks, 32 * SOFTMAX_WARPS, unroll=1):
            row, col0 = b // per_row, (b % per_row) * self.vec
            amax = Float32(0.0)
            for i in cutlass.range_constexpr(self.vec):
                x = self.dtype(0.0)
                if row < gq:
                    x = mQ[batch, q0 + row, col0 + i]
                amax = cute.arch.fmax(amax, ptx.fabs(x.to(Float32)))
                store_at(p16 + b16((row, 2 * (col0 + i))), x)
            q_amax[b] = amax
        cute.arch.barrier(barrier_id=Barrier.SOFTMAX, number_of_threads=32 * SOFTMAX_WARPS)
        # pass 2: the row scale, then each term's codes and block scales (the residual of
        # the terms before it, ``emulate_sm100._fp4_terms``)
        bq = sm100.rows_cols_bytes(lay.q, cutlass.Float4E2M1FN)
        pq = self._bytes(storage, lay, "sQ")
        sfq = self._bytes(storage, lay, "sSFQ")
        q_term, sfq_term = self.term_bytes(lay.q.outer, FIELD_BITS), self.term_bytes(lay.sfq, 8)
        for b in cutlass.range(tid, self.q_blocks, 32 * SOFTMAX_WARPS, unroll=1):
            row, col0 = b // per_row, (b % per_row) * self.vec
            rg = self.row_scale(q_amax, row * per_row, per_row)
            vals = []
            for i in cutlass.range_constexpr(self.vec):
                x = Float32(0.0)
                if row < gq:
                    x = mQ[batch, q0 + row, col0 + i].to(Float32)
                vals.append(ptx.mul_rn(x, rg))
            for t in cutlass.range_constexpr(self.terms):
                byte, scale, words = self.quantize_block_scaled(vals)
                for w in cutlass.range_constexpr(len(words)):
                    store_at(pq + (t * q_term + bq((row, (col0 + w * E2M1_PER_WORD) // 2))), words[w])
                self.store_scale(sfq + t * sfq_term, row, col0 // self.vec, byte)
                if const_expr(t + 1 < self.terms):
                    vals = self.residual(vals, words, scale)
        cute.arch.fence_view_async_shared()  # generic-proxy writes, read by tcgen05
        rg = cute.make_rmem_tensor((self.nh,), Float32)
        for h in cutlass.range_constexpr(self.nh):
            rg[h] = self.row_scale(q_amax, h * per_row, per_row)
        return rg

    def term_bytes(self, layout, bits: int) -> int:
        """Bytes from one FP4 term (stage) of a Q / P operand or scale-factor smem layout to
        the next (call in a trace): the offset of the second stage's first element."""
        return cute.crd2idx(cute.size(layout) // self.terms, layout) * bits // 8

    @cute.jit
    def residual(self, vals, words, scale):
        """``vals`` minus the values their term holds (``e2m1(code) * scale``, exact in
        fp32): what the next term quantizes."""
        out = []
        for i in cutlass.range_constexpr(len(vals)):
            code = (words[i // E2M1_PER_WORD] >> (FIELD_BITS * (i % E2M1_PER_WORD))) & Uint32(0xF)
            out.append(vals[i] - self.e2m1_signed(code) * scale)
        return out

    @cute.jit
    def e2m1_signed(self, code) -> Float32:
        """Value of an e2m1 code (sign in bit 3): twice its magnitude picked by a byte
        permute, converted and halved (exact), the sign bit moved over."""
        lo, hi = sm100.E2M1_TWICE_WORDS
        twice = Uint32(cute.arch.prmt(lo, hi, code & Uint32((1 << sm100.E2M1_SIGN_BIT) - 1)))
        mag = twice.to(Float32) * Float32(0.5)
        return ptx.u32_as_f32(ptx.f32_bits(mag) | ((code >> sm100.E2M1_SIGN_BIT) << F32_SIGN_BIT))

    @cute.jit
    def row_scale(self, q_amax, first, count) -> Float32:
        """``rg`` of a Q row from its block maxima (1 for a row of zeros)."""
        amax = Float32(0.0)
        for j in cutlass.range_constexpr(count):
            amax = cute.arch.fmax(amax, q_amax[first + j])
        rg = Float32(1.0)
        if amax > Float32(0.0):
            rg = self.operand_scale(amax)
        return rg

    @cute.jit
    def operand_scale(self, amax: Float32) -> Float32:
        """``OPERAND_TOP / amax`` capped at fp32's largest finite value (a row of tiny values
        never multiplies by infinity; ``amax`` 0 gives the cap, over values that are all 0)."""
        return cute.arch.fmin(ptx.div_rn(Float32(sm100.OPERAND_TOP[self.fp4]), amax), Float32(F32_MAX))

    @cute.jit
    def store_scale(self, base, row, col, byte):
        """Scale byte of operand row ``row``, scale column ``col`` into its basic chunk."""
        _, chunk, word, sub = sm100.sf_location(row, col)  # rows < 128: one row chunk
        off = (chunk * sm100.SF_CHUNK_WORDS + word) * 4 + sub
        store_at(base + off, cutlass.Uint8(byte))

    # ---- 16-bit tiles: K and V^T staged by the softmax warps ------------------------
    @cute.jit
    def stage_16bit(self, lay, storage, pipes, x_st, mK, mV, batch, head_kv, n_tok, tid):
        """K (tokens x D) and V^T (D x tokens) of a 16-bit tile into the ``kind::f16`` operand
        tiles, rows / columns past ``n_tok`` zero (a zero V keeps a masked token out of O even
        where the buffer holds stale values).  ``mK`` / ``mV`` are (B, S, Hkv, D) sink
        tensors (with ``batch`` and ``head_kv``) or the sequence's (tokens, D) residual rows."""
        sync(pipes.x.producer_acquire, x_st)
        bk = sm100.rows_cols_bytes(lay.k16, self.dtype)
        bv = sm100.rows_cols_bytes(lay.v16, self.dtype)
        pk = cute.recast_ptr(storage.sK16.data_ptr(), dtype=cutlass.Uint8)
        pv = cute.recast_ptr(storage.sV16.data_ptr(), dtype=cutlass.Uint8)
        t = tid  # a thread per token; scalar loads and stores: one such tile per split at most
        for c in cutlass.range(self.d, unroll=8):
            k = self.dtype(0.0)
            v = self.dtype(0.0)
            if t < n_tok:
                if const_expr(batch is None):
                    k = mK[t, c]
                    v = mV[t, c]
                else:
                    k = mK[batch, t, head_kv, c]
                    v = mV[batch, t, head_kv, c]
            store_at(pk + bk((t, 2 * c)), k)
            store_at(pv + bv((c, 2 * t)), v)
        cute.arch.fence_view_async_shared()
        sync(pipes.x.producer_commit, x_st)
        x_st.advance()
        return x_st

    # ---- one tile: S^T -> online softmax -> P -> O^T ---------------------------------
    @cute.jit
    def tile(self, lay, storage, st, pipes, s_st, p_st, o_st, c_fp4, scale_log2, n_valid, fp4: cutlass.Constexpr):
        """One tile of ``n_valid`` tokens; returns the advanced (s, p, o, x) pipeline states."""
        sync(pipes.s.consumer_wait, s_st)
        acc = self.tmem_fragment(st)
        cute.copy(st.ld, st.tS, acc)
        cute.arch.fence_view_async_tmem_load()
        sync(pipes.s.consumer_release, s_st)
        x = cute.make_rmem_tensor((self.nh,), Float32)  # this token's scores, log2 units
        tile_max = cute.make_rmem_tensor((self.nh,), Float32)
        for h in cutlass.range_constexpr(self.nh):
            if const_expr(fp4):
                x[h] = acc[h] * c_fp4[h]
            else:
                x[h] = acc[h] * scale_log2
            if st.tid >= n_valid:
                x[h] = -Float32.inf
            tile_max[h] = self.warp_max(x[h])
        # the tile's maxima across the four warps (a local alias: a store through an
        # attribute inside a staged branch would make the tracer carry the namespace)
        red = st.red
        if st.lane == 0:
            for h in cutlass.range_constexpr(self.nh):
                red[h, st.warp] = tile_max[h]
        cute.arch.barrier(barrier_id=Barrier.SOFTMAX, number_of_threads=32 * SOFTMAX_WARPS)
        alpha = cute.make_rmem_tensor((self.nh,), Float32)
        p = cute.make_rmem_tensor((self.nh,), Float32)
        inv_rp = cute.make_rmem_tensor((self.nh,), Float32)
        for h in cutlass.range_constexpr(self.nh):
            m = st.red[h, 0]
            for w in cutlass.range_constexpr(1, SOFTMAX_WARPS):
                m = cute.arch.fmax(m, st.red[h, w])
            tile_max[h] = m
            m_new = cute.arch.fmax(st.row_max[h], m)
            # no token yet: a finite stand-in keeps exp2(-inf - m) at 0, never NaN
            m_use = cute.arch.fmax(m_new, Float32(-F32_MAX))
            alpha[h] = cute.math.exp2(st.row_max[h] - m_use, fastmath=True)
            st.row_max[h] = m_new
            st.row_sum[h] = st.row_sum[h] * alpha[h]  # (O^T's registers take alpha below)
            p[h] = cute.math.exp2(x[h] - m_use, fastmath=True)
            inv_rp[h] = Float32(1.0)
            if const_expr(fp4):
                rp = self.operand_scale(cute.math.exp2(m - m_use, fastmath=True))
                inv_rp[h] = ptx.div_rn(Float32(1.0), rp)
                p[h] = ptx.mul_rn(p[h], rp)
        cute.arch.barrier(barrier_id=Barrier.SOFTMAX, number_of_threads=32 * SOFTMAX_WARPS)  # red reusable

        sync(pipes.p.producer_acquire, p_st)
        if const_expr(fp4):
            self.store_p_fp4(lay, storage, st, p, inv_rp)
        else:
            self.store_p_16bit(lay, storage, st, p)
        cute.arch.fence_view_async_shared()
        sync(pipes.p.producer_commit, p_st)

        sync(pipes.o.consumer_wait, o_st)
        for m in cutlass.range_constexpr(self.m_v):
            acc_t = self.tmem_fragment(st)
            cute.copy(st.ld, st.tO[m], acc_t)
            for h in cutlass.range_constexpr(self.nh):
                st.acc_o[m, h] = st.acc_o[m, h] * alpha[h] + acc_t[h] * inv_rp[h]
        cute.arch.fence_view_async_tmem_load()
        sync(pipes.o.consumer_release, o_st)
        s_st.advance()
        p_st.advance()
        o_st.advance()
        return s_st, p_st, o_st

    def tmem_fragment(self, st):
        """Registers for one lane's row of S^T or of an O^T M-block (``nh`` fp32)."""
        return cute.make_rmem_tensor(st.thr_ld.partition_D(cute.make_identity_tensor(st.s_tile.shape)).shape, Float32)

    @cute.jit
    def store_p_fp4(self, lay, storage, st, y, inv_rp):
        """P^T's column of this token (``y``: p times the tile's ``rp``) as FP4 terms, each
        e2m1 codes with a block scale per ``vec`` tokens (the block's maximum magnitude over
        ``vec`` lanes; eight lanes' codes gathered into one word) quantizing the residual of
        the terms before it; adds the terms' dequantized sum to the row sums."""
        bp = sm100.rows_cols_bytes(lay.p, cutlass.Float4E2M1FN)
        pp = self._bytes(storage, lay, "sP")
        sfp = self._bytes(storage, lay, "sSFP")
        p_term, sfp_term = self.term_bytes(lay.p.outer, FIELD_BITS), self.term_bytes(lay.sfp, 8)
        token = st.tid
        for h in cutlass.range_constexpr(self.nh):
            r = y[h]  # term 0 quantizes p >= 0, the later ones signed residuals
            phat = Float32(0.0)
            for t in cutlass.range_constexpr(self.terms):
                amax = ptx.fabs(r)
                for k in cutlass.range_constexpr(int(math.log2(self.vec))):
                    amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=1 << k))
                byte, scale = self.block_scale(amax)
                thresholds = [Float32(m) * scale for m in sm100.E2M1_MIDPOINTS]
                code = self.code_of(r, thresholds, amax > Float32(0.0), True)
                value = self.e2m1_signed(code) * scale
                phat = phat + value
                word = code << (FIELD_BITS * (st.lane % E2M1_PER_WORD))
                for k in cutlass.range_constexpr(int(math.log2(E2M1_PER_WORD))):
                    word = word | cute.arch.shuffle_sync_bfly(word, offset=1 << k)
                if st.lane % E2M1_PER_WORD == 0:
                    store_at(pp + (t * p_term + bp((h, token // 2))), word)
                if st.lane % self.vec == 0:
                    self.store_scale(sfp + t * sfp_term, h, token // self.vec, byte)
                if const_expr(t + 1 < self.terms):
                    r = r - value
            st.row_sum[h] = st.row_sum[h] + phat * inv_rp[h]

    @cute.jit
    def store_p_16bit(self, lay, storage, st, p):
        bp = sm100.rows_cols_bytes(lay.p16, self.dtype)
        pp = self._bytes(storage, lay, "sP16")
        for h in cutlass.range_constexpr(self.nh):
            p16 = p[h].to(self.dtype)
            st.row_sum[h] = st.row_sum[h] + p16.to(Float32)
            store_at(pp + bp((h, 2 * st.tid)), p16)

    @cute.jit
    def warp_max(self, x: Float32) -> Float32:
        for k in cutlass.range_constexpr(5):
            x = cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=1 << k))
        return x

    # ---- the split's output ----------------------------------------------------------
    @cute.jit
    def epilogue(self, st, mO, mLSE, batch, head_kv, split_idx, gq):
        """Row sums across the 128 threads, then O = acc / l (channel ``t`` of each M-block
        per thread) and LSE = (m + log2 l) ln 2; rows that saw no token give 0 and -inf."""
        red = st.red
        for h in cutlass.range_constexpr(self.nh):
            l = st.row_sum[h]
            for k in cutlass.range_constexpr(5):
                l = l + cute.arch.shuffle_sync_bfly(l, offset=1 << k)
            if st.lane == 0:
                red[h, st.warp] = l
        cute.arch.barrier(barrier_id=Barrier.SOFTMAX, number_of_threads=32 * SOFTMAX_WARPS)
        for h in cutlass.range_constexpr(self.nh):
            if h < gq:
                l = st.red[h, 0]
                for w in cutlass.range_constexpr(1, SOFTMAX_WARPS):
                    l = l + st.red[h, w]
                inv = Float32(0.0)
                lse = -Float32.inf
                if l > Float32(0.0):
                    inv = 1.0 / l
                    lse = (st.row_max[h] + cute.math.log2(l, fastmath=True)) * LN_2
                qh = head_kv * gq + h
                for m in cutlass.range_constexpr(self.m_v):
                    c = m * ROWS + st.tid
                    if const_expr(self.split):
                        mO[split_idx, batch, qh, c] = st.acc_o[m, h] * inv
                    else:
                        mO[batch, qh, c] = (st.acc_o[m, h] * inv).to(mO.element_type)
                if st.tid == 0:
                    if const_expr(self.split):
                        mLSE[split_idx, batch, qh] = lse
                    else:
                        mLSE[batch, qh] = lse
