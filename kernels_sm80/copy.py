"""Global -> shared row copies (cp.async, 16-byte chunks) shared by the sm80 kernels."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import const_expr
from cutlass.cute.nvgpu import cpasync, warp

from ..layouts import sm80

CHUNK_BITS = 8 * sm80.CHUNK_BYTES


def g2s_atom(dtype):
    return cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                               dtype, num_bits_per_copy=CHUNK_BITS)


def row_copy(dtype, rows: int, cols: int, num_threads: int):
    """Tiled cp.async of a (rows, cols) tile: each thread moves 16-byte chunks of a row.

    Returns the tiled copy and the number of threads that take part (fewer than
    ``num_threads`` when the tile has fewer chunks than the CTA has threads).
    """
    vec = CHUNK_BITS // dtype.width
    per_row = cols // vec
    thr_rows = min(num_threads // per_row, rows)
    copy = cute.make_tiled_copy_tv(
        g2s_atom(dtype),
        cute.make_layout((thr_rows, per_row), stride=(per_row, 1)),
        cute.make_layout((1, vec)),
    )
    return copy, thr_rows * per_row


@cute.jit
def copy_rows(gsrc: cute.Tensor, sdst: cute.Tensor, tid, num_threads: cutlass.Constexpr[int],
              valid_rows, check_rows: cutlass.Constexpr[bool]):
    """cp.async ``gsrc`` -> ``sdst`` (same (rows, cols) shape); rows >= valid_rows -> 0."""
    rows, cols = cute.size(gsrc, mode=[0]), cute.size(gsrc, mode=[1])
    copy, used = row_copy(gsrc.element_type, rows, cols, num_threads)
    if tid < used:
        thr = copy.get_slice(tid)
        t_s = thr.partition_S(gsrc)
        t_d = thr.partition_D(sdst)
        if const_expr(check_rows):
            t_c = thr.partition_S(cute.make_identity_tensor((rows, cols)))
            for m in cutlass.range_constexpr(cute.size(t_s, mode=[1])):
                if t_c[0, m, 0][0] < valid_rows:
                    cute.copy(copy, t_s[None, m, None], t_d[None, m, None])
                else:
                    t_d[None, m, None].fill(0)
        else:
            cute.copy(copy, t_s, t_d)


@cute.jit
def copy_rows_two_sources(g_first: cute.Tensor, g_second: cute.Tensor, sdst: cute.Tensor, tid,
                          num_threads: cutlass.Constexpr[int], split_row):
    """Rows below ``split_row`` from ``g_first``, the rest from ``g_second`` (same shape)."""
    rows, cols = cute.size(sdst, mode=[0]), cute.size(sdst, mode=[1])
    copy, used = row_copy(sdst.element_type, rows, cols, num_threads)
    if tid < used:
        thr = copy.get_slice(tid)
        t_a = thr.partition_S(g_first)
        t_b = thr.partition_S(g_second)
        t_d = thr.partition_D(sdst)
        t_c = thr.partition_S(cute.make_identity_tensor((rows, cols)))
        steps = cute.size(t_d, mode=[1])
        if const_expr(steps < 64):
            for m in cutlass.range_constexpr(steps):
                _copy_row_from_either(copy, t_a, t_b, t_d, t_c, m, split_row)
        else:  # (a traced loop of 64 or more makes CuTe DSL warn at every compile: the compiler unrolls it)
            for m in cutlass.range(steps, unroll_full=True):
                _copy_row_from_either(copy, t_a, t_b, t_d, t_c, m, split_row)


@cute.jit
def _copy_row_from_either(copy, t_a: cute.Tensor, t_b: cute.Tensor, t_d: cute.Tensor, t_c: cute.Tensor, m,
                          split_row):
    """Row step ``m`` of ``copy_rows_two_sources``: from ``t_a`` below ``split_row``, else ``t_b``."""
    if t_c[0, m, 0][0] < split_row:
        cute.copy(copy, t_a[None, m, None], t_d[None, m, None])
    else:
        cute.copy(copy, t_b[None, m, None], t_d[None, m, None])


def wait_all():
    """Commit the thread's cp.async copies, wait for all of them, then the CTA barrier:
    the staged tile is visible to every thread."""
    cute.arch.cp_async_commit_group()
    cute.arch.cp_async_wait_group(0)
    cute.arch.sync_threads()


def load_packed_words(tile16: cute.Tensor, lane):
    """ldmatrix x4 over every 32-row block and chunk of a packed smem slice (16-bit view).

    Returns uint32 words indexed [(i, 0), r32, chunk] = word of row 32*r32 + 8*i + lane//4.
    """
    copy = sm80.make_packed_ldmatrix_copy(cutlass.Float16)
    src = copy.get_slice(lane).partition_S(tile16)
    regs = cute.make_fragment_like(src, cutlass.Float16)
    cute.copy(copy, src, regs)
    return cute.recast_tensor(regs, cutlass.Uint32)


def load_a_fragment_blocks(mma, view: cute.Tensor, thread, blocks=None, transpose: bool = False):
    """MMA A-operand fragments of a whole smem view over every warp of ``mma`` (``thread``:
    0 .. its threads - 1), with ldmatrix x4 loading only the (M, K) blocks ``blocks`` (static
    pairs; the rest of the fragment stays unset), or all of them (None).

    Partitioning the whole view rather than each warp's slice keeps a block's offset a static
    index into the partition: on a swizzled pointer CuTe DSL then adds it after the swizzle,
    one immediate offset, where a slice's offset is folded in before it whenever the slice's
    alignment does not exceed the swizzle's span (sm90's 128-byte-swizzled wide packed tiles,
    whose 16-row slabs are 1024 bytes apart; profiles/NOTES.md, sixty-seventh session)."""
    thr_mma = mma.get_slice(thread)
    atom = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=transpose, num_matrices=4), view.element_type)
    copy = cute.make_tiled_copy_A(atom, mma)
    thr = copy.get_slice(thread)
    frag = thr_mma.make_fragment_A(thr_mma.partition_A(view))
    src, dst = thr.partition_S(view), thr.retile(frag)
    if blocks is None:
        cute.copy(copy, src, dst)
    else:
        for m, k in blocks:
            cute.copy(copy, src[None, m, k], dst[None, m, k])
    return frag


def load_a_fragments(mma, view: cute.Tensor, lane, transpose: bool):
    """MMA A-operand fragments of a (16*m, 16*k) smem view, loaded with ldmatrix x4
    (``transpose`` for a view whose rows are contiguous along M, e.g. V^T)."""
    return load_a_fragment_blocks(mma, view, lane, None, transpose)
