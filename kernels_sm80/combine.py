"""LSE-weighted merge of split-KV partial outputs (FlashDecoding's second kernel).

out[b, h] = sum_s exp(lse_s - lse) * o_s,  lse = log sum_s exp(lse_s).  Splits that saw
no tokens carry lse = -inf and weight 0; a row with no tokens at all gives 0 and -inf.
One CTA merges ``rows_per_cta`` (batch, head) rows; each thread owns 4 consecutive
channels so the partials stream in with 16-byte loads.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from . import ptx

LOG2_E = 1.4426950408889634
LN_2 = 0.6931471805599453
NUM_THREADS = 128
VEC = 4


class CombineSm80:
    def __init__(self, dtype, head_dim: int):
        self.dtype = dtype
        self.d = head_dim
        self.threads_per_row = head_dim // VEC
        self.rows_per_cta = NUM_THREADS // self.threads_per_row

    @cute.jit
    def __call__(self, mOp: cute.Tensor, mLp: cute.Tensor, mO: cute.Tensor, mL: cute.Tensor, stream):
        # mOp (S, B, Hq, D) f32, mLp (S, B, Hq) f32, mO (B, Hq, D) dtype, mL (B, Hq) f32
        rows = mO.shape[0] * mO.shape[1]
        grid = ((rows + self.rows_per_cta - 1) // self.rows_per_cta, 1, 1)
        self.kernel(mOp, mLp, mO, mL).launch(grid=grid, block=[NUM_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mOp, mLp, mO, mL):
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        num_splits, heads = mOp.shape[0], mO.shape[1]
        row = cta * self.rows_per_cta + tid // self.threads_per_row
        col = (tid % self.threads_per_row) * VEC
        if row < mO.shape[0] * heads:
            b = row // heads
            h = row - b * heads
            m = -Float32.inf
            for s in cutlass.range(num_splits, unroll=4):
                m = ptx.fmax(m, mLp[s, b, h])
            m_use = m if m != -Float32.inf else Float32(0.0)
            acc = cute.make_rmem_tensor((VEC,), Float32)
            acc.fill(0.0)
            part = cute.make_rmem_tensor((VEC,), Float32)
            total = Float32(0.0)
            for s in cutlass.range(num_splits, unroll=2):
                w = ptx.ex2((mLp[s, b, h] - m_use) * LOG2_E)
                total += w
                src = cute.local_tile(mOp[s, b, h, None], (VEC,), (col // VEC,))
                cute.autovec_copy(src, part)
                for i in cutlass.range_constexpr(VEC):
                    acc[i] = acc[i] + w * part[i]
            inv = Float32(0.0) if total == Float32(0.0) else 1.0 / total
            out = cute.make_rmem_tensor((VEC,), self.dtype)
            for i in cutlass.range_constexpr(VEC):
                out[i] = self.dtype(acc[i] * inv)
            cute.autovec_copy(out, cute.local_tile(mO[b, h, None], (VEC,), (col // VEC,)))
            if col == 0:
                lse = -Float32.inf
                if total > Float32(0.0):
                    lse = m + ptx.lg2(total) * LN_2
                mL[b, h] = lse
