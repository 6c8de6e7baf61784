"""A probe of what a TMA ring alone streams on this GPU: how many bytes in flight an SM
needs to read HBM at its rate, with nothing of the decode around it.

The sm90 decode's ring, with its consumers doing nothing (``probe_ring_only``), reads
4-bit B=16 N=64K at 0.98 of the H100's read rate but 0.88 of the H200's, and 2-bit's
half-size tiles at 0.77-0.79 on both (profiles/NOTES.md).  Whether that is the H200's
HBM wanting more bytes in flight than the ring keeps, or something of the decode's ring
(block-table lookups, the params' copies, the scalers' lag), this kernel separates: each
CTA streams its own contiguous run of ``tiles`` tiles of ``tile_bytes`` through a ring of
``stages`` stages, one warp issuing ``copies`` ``cp.async.bulk`` copies a tile on the
stage's mbarrier (``cutlass.pipeline.PipelineTmaAsync``), ``consumer_warps`` warps
waiting for each tile, reading it from shared memory (16-byte loads) and releasing it.
Bytes in flight an SM: at most ``stages x tile_bytes x`` CTAs an SM.

With ``apart``, each of a tile's ``copies`` comes from its own region of the source (copy
``c`` of every CTA's every tile in the ``c``-th of ``copies`` equal parts), as the decode's
stage gathers K's codes, V's and both params from four tensors: whether the streams a CTA
reads at once, not the bytes in flight, cost the decode's ring its rate.

The consumers' sums make the result checkable: thread ``t`` of CTA ``c`` adds (mod 2^32)
the words ``4 t .. 4 t + 3`` of every ``4 x threads``-word chunk of every tile, so a
ring that read the wrong bytes (or too few) cannot pass for a fast one.
"""

# no `from __future__ import annotations`: @cute.struct reads its field annotations as objects
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32, const_expr

from .. import jit
from ..kernels_sm80.host import fake_tensor, stream
from ..layouts import resources, sm80
from . import ptx90

WARP = cute.arch.WARP_SIZE
VEC = sm80.CHUNK_WORDS  # words a consumer thread loads at once (16 bytes)
MAX_COPIES = 64  # bulk copies a tile (unrolled in the producer)


class RingProbeSm90:
    """Arguments: ``src`` int32 ``(ctas, tiles, tile_bytes // 4)``, compact (each CTA's run of
    tiles; with ``apart`` the same memory read as ``(copies, ctas, tiles, tile_bytes // 4 //
    copies)``), ``out`` int32 ``(ctas, consumer_warps * 32)`` (the consumers' sums)."""

    def __init__(self, tile_bytes: int, stages: int, copies: int = 1, consumer_warps: int = 4,
                 apart: bool = False):
        if stages < 2:
            raise ValueError(f"stages must be at least 2, got {stages}")
        if not 1 <= consumer_warps <= 8:
            raise ValueError(f"consumer_warps must be 1 to 8, got {consumer_warps}")
        if not 1 <= copies <= MAX_COPIES or tile_bytes % (copies * sm80.CHUNK_BYTES):
            raise ValueError(f"copies must be 1 to {MAX_COPIES} and split tile_bytes ({tile_bytes}) into "
                             f"{sm80.CHUNK_BYTES}-byte multiples, got {copies}")
        self.threads = consumer_warps * WARP
        if tile_bytes % (self.threads * sm80.CHUNK_BYTES):
            raise ValueError(f"tile_bytes ({tile_bytes}) must be a multiple of {self.threads * sm80.CHUNK_BYTES} "
                             f"(a 16-byte load for each of the {self.threads} consumer threads)")
        self.tile_bytes, self.stages, self.copies, self.consumer_warps = tile_bytes, stages, copies, consumer_warps
        self.apart = apart
        self.tile_words = tile_bytes // 4
        self.copy_words = self.tile_words // copies

    def storage(self):
        """The CTA's shared memory: two mbarriers a stage (full, empty), then the stages'
        tiles, 128-byte aligned (a plain Python struct, so the host can size it too)."""
        stages, tile_words = self.stages, self.tile_words

        @cute.struct
        class Storage:
            mbar: cute.struct.MemRange[cutlass.Int64, 2 * stages]  # full, empty
            tiles: cute.struct.Align[cute.struct.MemRange[Int32, stages * tile_words], 128]

        return Storage

    def smem_bytes(self) -> int:
        """Shared memory a CTA takes (``storage``'s size)."""
        return self.storage().size_in_bytes()

    def ctas_per_sm(self) -> int:
        """How many of these CTAs an SM holds by shared memory (0: one does not fit)."""
        smem = self.smem_bytes()
        return resources.smem_ctas_per_sm(smem) if smem <= resources.HOPPER_CTA_SMEM_BYTES else 0

    def expected_sums(self, src):
        """What the consumers store for ``src`` (torch int32, ``(ctas, tiles, tile_bytes //
        4)``): thread ``t``'s sum, mod 2^32, of words ``4 t .. 4 t + 3`` of every ``4 x
        threads``-word chunk of every tile, as int64 ``(ctas, threads)``."""
        import torch

        ctas, tiles, _ = src.shape
        if self.apart:  # each copy's part of a tile from its own region (``produce``)
            src = src.reshape(self.copies, ctas, tiles, self.copy_words).permute(1, 2, 0, 3)
        parts = src.reshape(ctas, tiles, -1, self.threads, VEC).to(torch.int64)
        return parts.sum(dim=(1, 2, 4)) & 0xFFFFFFFF

    @staticmethod
    def compile(arch: str, tile_bytes: int, stages: int, copies: int = 1, consumer_warps: int = 4,
                keep_ptx: bool = False, apart: bool = False):
        """Compiled against fake tensors (any CTA and tile count; sm_90a only)."""
        probe = RingProbeSm90(tile_bytes, stages, copies, consumer_warps, apart)
        args = [fake_tensor(Int32, (None, None, probe.tile_words)), fake_tensor(Int32, (None, probe.threads))]
        return cute.compile(probe, *args, stream(), options=jit.compile_options(arch, keep_ptx=keep_ptx))

    @cute.jit
    def __call__(self, mSrc: cute.Tensor, mOut: cute.Tensor, stream):
        self.kernel(mSrc, mOut, self.storage()).launch(grid=(mSrc.shape[0], 1, 1),
                                                block=[WARP + self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mSrc: cute.Tensor, mOut: cute.Tensor, Storage: cutlass.Constexpr):
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(tid // WARP)
        storage = cutlass.memory.SmemAllocator().allocate(Storage)
        ring = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.consumer_warps),
            tx_count=self.tile_bytes,
        )
        sTiles = storage.tiles.get_tensor(cute.make_layout((self.tile_words, self.stages)))
        tiles = mSrc.shape[1]
        if warp == 0:
            self.produce(ring, mSrc, sTiles, cta, tiles)
        else:
            self.consume(ring, sTiles, mOut, cta, tiles, tid - WARP)

    @cute.jit
    def produce(self, ring, mSrc, sTiles, cta, tiles):
        """Warp 0: tile ``t`` of the CTA's run into the next free stage, ``copies`` bulk
        copies on the stage's barrier (whose transaction count is the whole tile); with
        ``apart`` copy ``c`` from the ``c``-th part of ``src``."""
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        part = self.copy_words  # words between a tile's copy c and copy c + 1 ...
        if const_expr(self.apart):  # ... or between the regions of copies c and c + 1
            part = mSrc.shape[0] * tiles * self.copy_words
        for t in cutlass.range(tiles, unroll=1):
            ring.producer_acquire(state)
            bar = ring.producer_get_barrier(state)
            if const_expr(self.apart):
                src = mSrc.iterator + (cta * tiles + t) * self.copy_words
            else:
                src = mSrc[cta, t, None].iterator
            dst = sTiles[None, state.index].iterator
            with cute.arch.elect_one():
                for c in cutlass.range_constexpr(self.copies):
                    ptx90.bulk_g2s(dst + c * self.copy_words, src + c * part, 4 * self.copy_words, bar)
            state.advance()

    @cute.jit
    def consume(self, ring, sTiles, mOut, cta, tiles, ctid):
        """Consumer thread ``ctid``: waits for each tile, adds its words of it, releases it;
        then stores its sum."""
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        acc = Int32(0)
        chunks = self.tile_words // VEC
        for _ in cutlass.range(tiles, unroll=1):
            ring.consumer_wait(state)
            tile = sTiles[None, state.index]
            for i in cutlass.range_constexpr(chunks // self.threads):
                words = cute.make_rmem_tensor((VEC,), Int32)
                cute.autovec_copy(cute.local_tile(tile, (VEC,), (ctid + i * self.threads,)), words)
                for j in cutlass.range_constexpr(VEC):
                    acc = acc + words[j]
            ring.consumer_release(state)
            state.advance()
        mOut[cta, ctid] = acc
