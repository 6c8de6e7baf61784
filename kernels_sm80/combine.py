"""The split-KV merge, done by the decode kernels themselves (no combine launch).

out[b, h] = sum_s exp(lse_s - lse) * o_s,  lse = log sum_s exp(lse_s).  Splits that saw
no tokens carry lse = -inf and weight 0; a row with no tokens at all gives 0 and -inf.

Every split CTA of a (sequence, KV head) writes its fp32 partial O and LSE, then counts
itself on a per-(sequence, KV head) counter; the last one to arrive merges the head's
query rows and puts the counter back to zero (``last_to_arrive``, ``merge_splits``).  A
separate combine kernel would cost a launch per decode call (~3.5 us of host time on an
H200 host, a third of an eager decode step's) and its own ramp on the GPU; the merge here
is a short tail of one CTA per (sequence, KV head).

Memory order: each thread fences its partial writes (``fence.acq_rel.gpu``) before the
CTA's barrier, thread 0's counter add is acq_rel at GPU scope, and after the barrier that
publishes the verdict every thread of the last CTA fences again before it reads the other
splits' partials: the pattern of CUDA's threadfence reduction, with the writers' fences
made explicit.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ..layouts.packing import LN_2, LOG2_E

VEC = 4  # fp32 channels per load / store


@cute.jit
def last_to_arrive(mCount: cute.Tensor, batch, head_kv, num_heads, num_splits, s_flag: cute.Tensor, tid):
    """Thread 0 counts this CTA among the splits of (``batch``, ``head_kv``) and stores in
    ``s_flag[0]`` whether it was the last (1) or not (0); the last one resets the counter.
    The caller fences each thread's partial writes and syncs before, syncs after, and reads
    ``s_flag[0]``."""
    if tid == 0:
        slot = batch * num_heads + head_kv
        done = cute.arch.atomic_add(mCount.iterator + slot, Int32(1), sem="acq_rel", scope="gpu")
        last = Int32(0)
        if done + Int32(1) == num_splits:  # (not num_splits - 1: ptxas would keep that from the start)
            last = Int32(1)
            mCount[slot] = Int32(0)
        s_flag[0] = last


@cute.jit
def merge_splits(mOp: cute.Tensor, mLp: cute.Tensor, mO: cute.Tensor, mL: cute.Tensor, batch, qh0, rows, tid,
                 threads: cutlass.Constexpr[int], head_dim: cutlass.Constexpr[int]):
    """Query rows ``qh0 .. qh0 + rows - 1`` of sequence ``batch``: the LSE-weighted merge of
    the partials ``mOp`` (S, B, Hq, D) fp32 and ``mLp`` (S, B, Hq) into ``mO`` (B, Hq, D),
    in its dtype, and ``mL`` (B, Hq), by ``threads`` threads (``tid``), one (row, 4-channel
    vector) pair at a time over every split (the row's LSEs twice: max, then weights)."""
    vecs = head_dim // VEC
    num_splits = mOp.shape[0]
    cute.arch.fence_acq_rel_gpu()  # after the verdict, before reading the other splits' partials
    for idx in cutlass.range(tid, rows * vecs, threads, unroll=1):
        r = idx // vecs
        c0 = (idx - r * vecs) * VEC  # this thread's first channel
        qh = qh0 + r
        m = -Float32.inf
        for s in cutlass.range(num_splits, unroll=4):
            m = cute.arch.fmax(m, mLp[s, batch, qh])
        m_use = m if m != -Float32.inf else Float32(0.0)
        total = Float32(0.0)
        a0, a1, a2, a3 = Float32(0.0), Float32(0.0), Float32(0.0), Float32(0.0)
        for s in cutlass.range(num_splits, unroll=2):
            w = cute.math.exp2((mLp[s, batch, qh] - m_use) * LOG2_E, fastmath=True)
            total += w
            a0 += w * mOp[s, batch, qh, c0]
            a1 += w * mOp[s, batch, qh, c0 + 1]
            a2 += w * mOp[s, batch, qh, c0 + 2]
            a3 += w * mOp[s, batch, qh, c0 + 3]
        inv = Float32(0.0) if total == Float32(0.0) else 1.0 / total
        mO[batch, qh, c0] = (a0 * inv).to(mO.element_type)
        mO[batch, qh, c0 + 1] = (a1 * inv).to(mO.element_type)
        mO[batch, qh, c0 + 2] = (a2 * inv).to(mO.element_type)
        mO[batch, qh, c0 + 3] = (a3 * inv).to(mO.element_type)
        if c0 == 0:
            lse = -Float32.inf
            if total > Float32(0.0):
                lse = m + cute.math.log2(total, fastmath=True) * LN_2
            mL[batch, qh] = lse


@cute.jit
def merge_when_last(mOp: cute.Tensor, mLp: cute.Tensor, mCount: cute.Tensor, mO: cute.Tensor, mL: cute.Tensor,
                    rows, s_flag: cute.Tensor, first_thread: cutlass.Constexpr[int], threads: cutlass.Constexpr[int],
                    barrier_id: cutlass.Constexpr[int], head_dim: cutlass.Constexpr[int]):
    """After a split CTA's ``threads`` threads (from thread ``first_thread`` on, synchronized
    by named barrier ``barrier_id``; 0 is the CTA's) wrote its partials: count it, and if it
    was the last of its (sequence, KV head), merge that KV head's query rows into ``mO``
    (B, Hq, D) / ``mL``.  ``s_flag``: one int32 of shared memory nobody reads any more.  The
    CTA's coordinates are read again here, not carried from the kernel's start: held
    through the main loop, ptxas spilled them (sm80 K4V2)."""
    cute.arch.fence_acq_rel_gpu()  # this thread's partial writes, before the count
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=threads)
    tid = cute.arch.thread_idx()[0] - first_thread
    _, head_kv, batch = cute.arch.block_idx()
    num_splits, num_heads, _ = cute.arch.grid_dim()
    last_to_arrive(mCount, batch, head_kv, num_heads, num_splits, s_flag, tid)
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=threads)
    if s_flag[0] != Int32(0):
        merge_splits(mOp, mLp, mO, mL, batch, head_kv * rows, rows, tid, threads, head_dim)
