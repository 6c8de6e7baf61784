"""LSE-weighted merge of split-KV partial outputs (FlashDecoding's second kernel).

out[b, h] = sum_s exp(lse_s - lse) * o_s,  lse = log sum_s exp(lse_s).  Splits that saw
no tokens carry lse = -inf and weight 0; a row with no tokens at all gives 0 and -inf.

One CTA merges one (batch, head) row and works on all splits at once, so the latency is
a few dependent loads whatever the split count: every thread fetches split LSEs, the CTA
reduces max and sum through warp shuffles and shared memory, and then threads split the
(split, channel) grid, each streaming 16-byte partial vectors of several splits before a
shared-memory reduction over split groups.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from ..layouts import sm80
from ..layouts.packing import LN_2, LOG2_E
from .reduce import block_reduce
from .tensors import one_token, wait_for_previous_kernel

NUM_THREADS = 128
NUM_WARPS = NUM_THREADS // 32
VEC = 4
MAX_SPLITS = sm80.MAX_SPLITS
LSES_PER_THREAD = -(-MAX_SPLITS // NUM_THREADS)  # (``hoist_loads`` keeps them in registers)
PREFETCH_PARTS = 4  # partial-output vectors a thread loads ahead with ``hoist_loads``


@cute.jit
def store_row(acc, total, m, mO, mL, b, h, vec):
    """The end of a merge: channel vector ``vec`` of row ``(b, h)`` is ``acc / total`` (fp32
    sums weighted against the maximum LSE ``m``) in mO's dtype, and thread ``vec`` 0 stores
    the row's LSE ``m + ln(total)``; ``total`` 0 (no token in any split) gives 0 and -inf."""
    inv = Float32(0.0) if total == Float32(0.0) else 1.0 / total
    out = cute.make_rmem_tensor((VEC,), mO.element_type)
    for j in cutlass.range_constexpr(VEC):
        out[j] = mO.element_type(acc[j] * inv)
    cute.autovec_copy(out, cute.local_tile(mO[b, h, None], (VEC,), (vec,)))
    if vec == 0:
        lse = -Float32.inf
        if total > Float32(0.0):
            lse = m + cute.math.log2(total, fastmath=True) * LN_2
        mL[b, h] = lse


class SplitMerge:
    """The combine kernel's merge of one (batch, head) row's splits by the CTA's 128 threads
    (``NUM_THREADS``): all splits at once, the LSEs reduced across the CTA.  A decode
    kernel that merges its own splits takes all the rows of a KV head at once instead
    (``HeadMerge``)."""

    def __init__(self, head_dim: int, hoist_loads: bool = False):
        self.d = head_dim
        self.vecs = head_dim // VEC  # threads per split row
        self.groups = NUM_THREADS // self.vecs  # split groups working in parallel
        # The merge loads the LSEs (a round trip to L2), reduces them, loads them again (L1
        # at best) for the weights, and only then loads the partial outputs (a second round
        # trip), though nothing but the weights needs the LSEs first.  ``hoist_loads`` loads
        # a thread's first ``PREFETCH_PARTS`` splits' output vectors before the LSEs and keeps
        # its LSEs in registers: one round trip (the same sums in the same order: the
        # outputs' bits do not change).  On by default in ``CombineSm80``: H200, fp16 GQA 4,
        # one run, us, the late loads / hoisted (profiles/h200/variants_early_default_2c128.json,
        # variants_sm80_early_default.json): sm90 2c128 B=1 N=4096 12.35 / 11.86, 4296 15.79 /
        # 15.36, 131272 47.26 / 47.31; sm80 4c128 B=1 N=4096 11.84 / 11.36, 2t64 12.24 / 11.86;
        # B=16 level (+-0.8 %).
        self.ahead = PREFETCH_PARTS if hoist_loads else 0
        # shared memory: split weights, the warps' reductions, the split groups' sums
        self.smem_bytes = 4 * (MAX_SPLITS + NUM_WARPS + VEC * self.vecs * self.groups)

    def smem_tensors(self, ptr):
        """(weights, reductions, group sums) over ``smem_bytes`` of shared memory at ``ptr``
        (16-byte aligned)."""
        f32 = cute.recast_ptr(ptr, dtype=Float32)
        s_w = cute.make_tensor(f32, cute.make_layout(MAX_SPLITS))
        s_red = cute.make_tensor(f32 + MAX_SPLITS, cute.make_layout(NUM_WARPS))
        s_acc = cute.make_tensor(f32 + MAX_SPLITS + NUM_WARPS, cute.make_layout(
            (VEC, self.vecs, self.groups), stride=(1, VEC, VEC * self.vecs)))
        return s_w, s_red, s_acc

    def weigh(self, lse, m_use, s_w, s):
        """Split ``s``'s weight ``exp(lse - m_use)`` into ``s_w``; returns it."""
        w = cute.math.exp2((lse - m_use) * LOG2_E, fastmath=True)
        s_w[s] = w
        return w

    @cute.jit
    def merge(self, mOp, mLp, mO, mL, b, h, smem, tid):
        """Row ``(b, h)``: mOp (S, B, Hq, D) f32 and mLp (S, B, Hq) f32 -> mO (B, Hq, D)
        dtype and mL (B, Hq) f32; ``smem`` from ``smem_tensors``, ``tid`` 0-127."""
        s_w, s_red, s_acc = smem
        num_splits = mOp.shape[0]
        vec, grp = tid % self.vecs, tid // self.vecs  # step 2's thread: (channel vector, split group)
        ahead = self.ahead
        if const_expr(ahead):  # (step 2's first splits, loaded before the LSEs)
            early = cute.make_rmem_tensor((VEC, ahead), Float32)
            for i in cutlass.range_constexpr(ahead):
                if grp + i * self.groups < num_splits:
                    cute.autovec_copy(cute.local_tile(mOp[grp + i * self.groups, b, h, None], (VEC,), (vec,)),
                                      early[None, i])
        # 1. the splits' LSEs: the threads' max, then weights exp(lse_s - max) and their sum
        m = -Float32.inf
        if const_expr(ahead):  # (each LSE loaded once, held for the weights)
            lses = cute.make_rmem_tensor((LSES_PER_THREAD,), Float32)
            for i in cutlass.range_constexpr(LSES_PER_THREAD):
                if tid + i * NUM_THREADS < num_splits:
                    lses[i] = mLp[tid + i * NUM_THREADS, b, h]
                    m = cute.arch.fmax(m, lses[i])
        else:
            for s in cutlass.range(tid, num_splits, NUM_THREADS, unroll=1):
                m = cute.arch.fmax(m, mLp[s, b, h])
        m = block_reduce(m, s_red, tid, NUM_WARPS, True)
        m_use = m if m != -Float32.inf else Float32(0.0)
        total = Float32(0.0)
        if const_expr(ahead):
            for i in cutlass.range_constexpr(LSES_PER_THREAD):
                if tid + i * NUM_THREADS < num_splits:
                    total += self.weigh(lses[i], m_use, s_w, tid + i * NUM_THREADS)
        else:
            for s in cutlass.range(tid, num_splits, NUM_THREADS, unroll=1):
                total += self.weigh(mLp[s, b, h], m_use, s_w, s)
        total = block_reduce(total, s_red, tid, NUM_WARPS, False)
        # 2. weighted sum of the partial outputs: thread = (channel vector, split group)
        acc = cute.make_rmem_tensor((VEC,), Float32)
        acc.fill(0.0)
        for i in cutlass.range_constexpr(ahead):
            if grp + i * self.groups < num_splits:
                w = s_w[grp + i * self.groups]
                for j in cutlass.range_constexpr(VEC):
                    acc[j] = acc[j] + w * early[j, i]
        part = cute.make_rmem_tensor((VEC,), Float32)
        for s in cutlass.range(grp + ahead * self.groups, num_splits, self.groups, unroll=4):
            cute.autovec_copy(cute.local_tile(mOp[s, b, h, None], (VEC,), (vec,)), part)
            w = s_w[s]
            for i in cutlass.range_constexpr(VEC):
                acc[i] = acc[i] + w * part[i]
        for i in cutlass.range_constexpr(VEC):
            s_acc[i, vec, grp] = acc[i]
        cute.arch.sync_threads()
        if grp == 0:
            row = cute.make_rmem_tensor((VEC,), Float32)
            for i in cutlass.range_constexpr(VEC):
                x = s_acc[i, vec, 0]
                for g in cutlass.range_constexpr(1, self.groups):
                    x += s_acc[i, vec, g]
                row[i] = x
            store_row(row, total, m, mO, mL, b, h, vec)


MERGE_AHEAD = 8  # splits a thread of ``HeadMerge`` loads at once (8 x 16 bytes and 8 LSEs in flight)


class HeadMerge:
    """The merge of the splits of all query rows of one (sequence, KV head) at once by 128
    threads (``NUM_THREADS``), as a split decode's last CTA runs it (``merge_if_last``) in
    place of the combine launch.  ``SplitMerge`` takes one row at a time with two dependent
    round trips to L2 and four barriers each, which made the in-kernel merge slower than the
    launch it saves; here a thread takes a (row, channel vector) and streams every split's
    vector and LSE, ``ahead`` of each in flight (``MERGE_AHEAD`` unless the kernel's
    registers allow more), weighing them against a running maximum (the merge as online
    softmax): ceil(S / ahead) round trips for all the rows, no barrier, no shared memory.
    The sums run in another order than the combine kernel's (fp32 rounding apart)."""

    def __init__(self, head_dim: int, ahead: int = MERGE_AHEAD):
        self.vecs = head_dim // VEC  # threads per row
        self.ahead = ahead

    @cute.jit
    def merge(self, mOp, mLp, mO, mL, b, h0, rows, tid):
        """Rows ``h0 .. h0 + rows - 1`` of sequence ``b``: mOp (S, B, Hq, D) f32 and mLp (S,
        B, Hq) f32 -> mO (B, Hq, D) dtype and mL (B, Hq) f32; ``tid`` 0-127.  A row with no
        tokens in any split gives 0 and -inf, as the combine kernel's."""
        num_splits = mOp.shape[0]
        ahead = self.ahead
        for item in cutlass.range(tid, rows * self.vecs, NUM_THREADS, unroll=1):
            r = item // self.vecs
            vec, h = item - r * self.vecs, h0 + r
            m, total = -Float32.inf, Float32(0.0)
            acc = cute.make_rmem_tensor((VEC,), Float32)
            acc.fill(0.0)
            lse = cute.make_rmem_tensor((ahead,), Float32)
            part = cute.make_rmem_tensor((VEC, ahead), Float32)
            for s0 in cutlass.range(0, num_splits, ahead, unroll=1):
                # a batch's loads all issue before any use; past the last split they reload
                # it (no branch around a load) and weigh nothing
                for i in cutlass.range_constexpr(ahead):
                    s = cutlass.min(s0 + i, num_splits - 1)
                    lse[i] = mLp[s, b, h]
                    cute.autovec_copy(cute.local_tile(mOp[s, b, h, None], (VEC,), (vec,)), part[None, i])
                m_new = m
                for i in cutlass.range_constexpr(ahead):
                    if s0 + i >= num_splits:
                        lse[i] = -Float32.inf
                    m_new = cute.arch.fmax(m_new, lse[i])
                # all weights so far against m_new; while every LSE is -inf the reference is
                # 0 (no -inf - -inf), and the old sums, all 0, scale by exp2(-inf) = 0
                m_use = m_new if m_new != -Float32.inf else Float32(0.0)
                rescale = cute.math.exp2((m - m_use) * LOG2_E, fastmath=True)
                total = total * rescale
                for j in cutlass.range_constexpr(VEC):
                    acc[j] = acc[j] * rescale
                for i in cutlass.range_constexpr(ahead):
                    w = cute.math.exp2((lse[i] - m_use) * LOG2_E, fastmath=True)
                    total += w
                    for j in cutlass.range_constexpr(VEC):
                        acc[j] = acc[j] + w * part[j, i]
                m = m_new
            store_row(acc, total, m, mO, mL, b, h, vec)


class CombineSm80:
    def __init__(self, dtype, head_dim: int, pdl: bool = False, hoist_loads: bool = True):
        self.dtype = dtype
        # programmatic dependent launch (sm_90+): the CTAs launch while the decode kernel
        # drains and wait for its partials (tensors.wait_for_previous_kernel)
        self.pdl = pdl
        self.d = head_dim
        self.merger = SplitMerge(head_dim, hoist_loads)

    @cute.jit
    def __call__(self, mOp: cute.Tensor, mLp: cute.Tensor, mO: cute.Tensor, mL: cute.Tensor, stream):
        # mOp (S, B, Hq, D) f32, mLp (S, B, Hq) f32, mO (B, 1, Hq, D) dtype, mL (B, Hq) f32
        mO = one_token(mO)
        grid = (mO.shape[0] * mO.shape[1], 1, 1)
        self.kernel(mOp, mLp, mO, mL).launch(grid=grid, block=[NUM_THREADS, 1, 1], stream=stream,
                                             use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mOp, mLp, mO, mL):
        tid, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        heads = mO.shape[1]
        b = row // heads
        h = row - b * heads
        smem = cutlass.memory.SmemAllocator()
        base = smem.allocate_array(cutlass.Uint8, self.merger.smem_bytes, byte_alignment=16)
        wait_for_previous_kernel(self.pdl)
        self.merger.merge(mOp, mLp, mO, mL, b, h, self.merger.smem_tensors(base), tid)
