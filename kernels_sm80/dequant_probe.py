"""A one-warp probe of the packed layout on hardware: ldmatrix + lop3 dequant, no MMA.

It loads a 32-row tile of packed rows (K: tokens x head dim; V: channels x one block)
into shared memory, fetches the words with the same packed ldmatrix copy the decode
kernel uses, dequantizes every element pair with the same lop3 / fma sequence and
(scale, zero) pairs, and writes each lane's half2 registers out in the order the MMA
fragments consume them: ``out[lane, i, chunk, pair]`` is pair ``pair`` of the word of row
``8*i + lane//4`` in chunk ``chunk``.  The test compares these bits with the torch
reference's dequantized values, proving the layouts on the GPU.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Uint32

from .. import jit
from ..layouts import packing, sm80
from .copy import copy_rows, load_packed_words, wait_all
from .dequant import WordDequant, split_params
from .host import fake_tensor, stream

ROWS = 32


class DequantProbe:
    def __init__(self, dtype, bits: int, length: int):
        self.dtype = dtype
        self.is_bf16 = dtype is cutlass.BFloat16
        self.bits = bits
        self.length = length  # columns of a packed row
        self.words = sm80.words_per_row(bits, length)
        self.pairs = packing.codes_per_word(bits) // 2

    @staticmethod
    def compile(arch: str, dtype, bits: int, length: int, keep_ptx: bool = False):
        """Compiled against fake tensors (32 packed rows of ``length`` codes)."""
        probe = DequantProbe(dtype, bits, length)
        words = sm80.words_per_row(bits, length)
        args = [fake_tensor(cutlass.Float16, (32, 2 * words)), fake_tensor(cutlass.Int32, (32, length)),
                fake_tensor(cutlass.Int32, (32, 4, words // sm80.CHUNK_WORDS, probe.pairs))]
        return cute.compile(probe, *args, stream(), options=jit.compile_options(arch, keep_ptx=keep_ptx))

    @cute.jit
    def __call__(self, mPacked: cute.Tensor, mParams: cute.Tensor, mOut: cute.Tensor, stream):
        # mPacked (32, 2*words) f16 view; mParams (32, length) int32 (scale, zero) per element
        # in fragment order; mOut (32 lanes, 4, chunks, pairs) int32
        self.kernel(mPacked, mParams, mOut).launch(grid=(1, 1, 1), block=[32, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mPacked, mParams, mOut):
        lane, _, _ = cute.arch.thread_idx()
        smem = cutlass.memory.SmemAllocator()
        base = smem.allocate_array(cutlass.Uint8, ROWS * self.words * 4, byte_alignment=1024)
        tile = cute.make_tensor(cute.recast_ptr(base, dtype=cutlass.Float16),
                                sm80.make_smem_layout(ROWS, 4 * self.words))
        copy_rows(mPacked, tile, lane, 32, 0, False)
        wait_all()
        words = load_packed_words(tile, lane)  # the decode kernel's own packed load
        dq = WordDequant(self.bits, self.is_bf16)
        c = lane % 4
        for chunk in cutlass.range_constexpr(self.words // sm80.CHUNK_WORDS):
            for i in cutlass.range_constexpr(4):
                row = 8 * i + lane // 4
                codes = dq.codes(words[(i, 0), 0, chunk], range(self.pairs))
                for p in cutlass.range_constexpr(self.pairs):
                    # pair p = elements 2p, 2p+1: fragment columns of k-block p//2, half p%2
                    pos = sm80.param_position(chunk * sm80.k_blocks_per_word(self.bits) + p // 2, c, 2 * (p % 2))
                    s2, z2 = split_params(Uint32(mParams[row, pos]), Uint32(mParams[row, pos + 1]))
                    mOut[lane, i, chunk, p] = Int32(dq.scale(codes[p], s2, z2))
