"""Small tensor helpers shared by the sm80 kernels."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int64

from ..layouts.resources import L2_LINE_BYTES
from ..layouts.sm80 import TAIL_UNIT, tiles_per_split
from .ptx import load_here, prefetch_l2


def assume_aligned(t: cute.Tensor, align_bytes: int = 16) -> cute.Tensor:
    """Re-tag ``t``'s pointer as ``align_bytes``-aligned.

    Tiles of the packed cache start at multiples of 16 bytes (rows are whole 16-byte
    chunks), but a page index read at run time hides that from the compiler, which would
    otherwise refuse 128-bit cp.async.
    """
    ptr = cute.make_ptr(t.element_type, t.iterator.toint(), t.memspace, assumed_align=align_bytes)
    return cute.make_tensor(ptr, t.layout)


def clamp_page(page, num_pages):
    """A block-table entry clamped into ``[0, num_pages)``: one unsigned min (an entry past
    the cache, negative ones included, reads the last page)."""
    return cutlass.Int32(cutlass.min(cutlass.Uint32(page), cutlass.Uint32(num_pages - 1)))


def page_of(block_table: cute.Tensor, batch, tok, page_size, num_pages=None, first=None):
    """(page, offset in the page) of token ``tok`` of sequence ``batch`` (paged cache).

    The host rejects block tables with entries outside ``[0, num_pages)``; a table edited
    after that check must still not send a kernel outside the cache, so with ``num_pages``
    such an entry reads the last page instead (``clamp_page``).  ``first``: the
    sequence's first entry, loaded already (``first_page``, with ``num_pages``): tokens of
    the first page then read no block table (``page_after``)."""
    if first is not None:
        return page_after(block_table, batch, tok, page_size, num_pages, first)
    slot = tok // page_size
    page = block_table[batch, slot]
    if num_pages is not None:
        page = clamp_page(page, num_pages)
    return page, tok - slot * page_size


def first_page(block_table: cute.Tensor, batch, num_pages):
    """Sequence ``batch``'s first block-table entry, clamped: its address needs no sequence
    length, so a kernel may load it beside that length's load (``page_of``'s ``first``)."""
    row = block_table.iterator + batch * block_table.stride[0]
    return clamp_page(load_here(row.toint()), num_pages)  # (a plain load would be sunk to its use)


@cute.jit
def page_after(block_table: cute.Tensor, batch, tok, page_size, num_pages, first):
    """``page_of`` given the first page's entry: the table read only past the first page."""
    slot = tok // page_size
    page = first
    if slot != 0:
        page = clamp_page(block_table[batch, slot], num_pages)
    return page, tok - slot * page_size


def page_in_range(block_table: cute.Tensor, batch, tok, page_size, num_pages):
    """Whether the block-table entry of token ``tok`` names a page of the cache (writers
    skip a block whose page does not: clamping would write into another sequence)."""
    return cutlass.Uint32(block_table[batch, tok // page_size]) < cutlass.Uint32(num_pages)


def aligned_ptr(ptr, align_bytes: int):
    """``ptr`` re-tagged as ``align_bytes``-aligned (a stage base: static multiple of it)."""
    return cute.make_ptr(ptr.dtype, ptr.toint(), ptr.memspace, assumed_align=align_bytes)


def split_tiles(seqlen, tile_tokens: int, split_idx, num_splits, tail_weight):
    """The tiles split ``split_idx`` of ``num_splits`` owns in a sequence of ``seqlen``
    tokens: full packed tiles ``[tile_begin, packed_end)``, and the 16-bit residual
    (``n_res`` tokens) as one more tile when ``has_residual``.  ``tail_weight`` w, in
    sixteenths (``TAIL_UNIT``): every split but the last takes w / TAIL_UNIT times the last
    one's share, ``ceil(n w / (w (S - 1) + TAIL_UNIT))`` tiles of n (w <= TAIL_UNIT: even).  A
    tail shorter than the others fills the SM slots that they leave free (``split_coords``;
    the host's ``tail_weight``).  Every decode kernel splits the same way, so any (split
    count, weight) gives the same partial results to combine."""
    n_full = seqlen // tile_tokens
    n_res = seqlen - n_full * tile_tokens
    n_tiles = n_full + (n_res + tile_tokens - 1) // tile_tokens  # the residual is one more tile
    per_split = tiles_per_split(n_tiles, num_splits, tail_weight, maximum=cutlass.max)
    tile_begin = split_idx * per_split
    tile_end = cutlass.min(tile_begin + per_split, n_tiles)
    packed_end = cutlass.min(tile_end, n_full)
    has_residual = (n_res > 0) & (tile_begin <= n_full) & (n_full < tile_end)
    return tile_begin, packed_end, has_residual, n_res


@cute.jit
def split_coords(tail_weight):
    """This CTA's (split, KV head, sequence) of a decode grid ``(splits, Hkv, B)``.  With a
    weighted tail (``tail_weight`` > ``TAIL_UNIT``, ``split_tiles``) the splits run slowest
    in the order the GPU starts CTAs (linear block index), so every long split starts first
    and the short last splits fill the slots that free up as long ones finish (a dynamic
    balance of the SMs); otherwise the grid's own order."""
    split_idx, head_kv, batch = cute.arch.block_idx()
    if tail_weight > TAIL_UNIT:
        num_splits, heads, batches = cute.arch.grid_dim()
        pairs = heads * batches
        started = split_idx + num_splits * (head_kv + heads * batch)  # the launch order
        split_idx = started // pairs
        pair = started - split_idx * pairs
        batch = pair // heads
        head_kv = pair - batch * heads
    return split_idx, head_kv, batch


@cute.jit
def commit_length(mLens: cute.Tensor, mCommits: cute.Tensor, b, new_len, ctas, tid, mOverflow=None, fits=None):
    """Sequence ``b``'s new length, stored by the last of its ``ctas`` CTAs to get here (or,
    ``fits`` false, put in ``mOverflow`` instead): every CTA read the old length before
    counting itself in (the barrier and the acq_rel atomic order the two), so none can see
    the new one; the counter goes back to zero for the next launch (a replayed graph
    reuses it).  The pack kernel's append and the appending decodes (sm80, sm90) commit so."""
    cute.arch.sync_threads()
    if tid == 0:
        done = cute.arch.atomic_add(mCommits.iterator + b, cutlass.Int32(1), sem="acq_rel", scope="gpu")
        if done == ctas - 1:
            mCommits[b] = cutlass.Int32(0)
            if cutlass.const_expr(mOverflow is None):  # (no capacity guard: the caller's host checked)
                mLens[b] = new_len
            else:
                if fits:
                    mLens[b] = new_len
                else:
                    mOverflow[b] = new_len


def one_token(t: cute.Tensor) -> cute.Tensor:
    """The (B, Hq, D) view of a decode query or output that arrives as the caller's
    (B, 1, Hq, D) tensor (no reshape on the host per call)."""
    return t[None, 0, None, None]


@cute.jit
def wait_for_previous_kernel(pdl: cutlass.Constexpr[bool]):
    """With programmatic dependent launch: block until the previous kernel on the stream
    has finished and its writes are visible, then let the next one launch."""
    if cutlass.const_expr(pdl):
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()


# Any value works (see ``wait_holding``); this one is merely unlikely.
PIN_MAGIC = 0x5A17C0DE


def xor_words(words) -> cutlass.Int32:
    """XOR of every 32-bit word in ``words`` (nested lists / tuples of them): what
    ``wait_holding`` branches on."""
    if isinstance(words, (list, tuple)):
        chk = cutlass.Int32(0)
        for w in words:
            chk = chk ^ xor_words(w)
        return chk
    return words


@cute.jit
def wait_holding(chk: cutlass.Int32, addr: Int64):
    """``griddepcontrol.wait`` with the loads that ``chk`` (their ``xor_words``) depends on
    kept above it.  An acquire lets ptxas sink plain loads below it (on sm_90a it issued the
    BitNet GEMV's whole first batch of weights after the wait); a branch on the loaded
    values cannot be sunk without them.  The branch guards an L2 prefetch of ``addr`` (any
    valid global address: side effects, no result), so either way the results are the same."""
    if chk == cutlass.Int32(PIN_MAGIC):
        prefetch_l2(addr)
    cute.arch.griddepcontrol_wait()


@cute.jit
def prefetch_run_l2(first: Int64, nbytes, tidx, threads):
    """Ask L2 for the ``nbytes`` (a multiple of a line) from global address ``first``, the
    lines spread over ``threads`` threads: the weights a kernel behind a programmatic launch
    fetches before ``griddepcontrol.wait`` (they never depend on the previous kernel)."""
    for line in cutlass.range(tidx, nbytes // L2_LINE_BYTES, threads, unroll=1):
        prefetch_l2(first + Int64(line) * L2_LINE_BYTES)


def cute_float16(is_bf16: bool):
    """The CuTe DSL 16-bit float type of a kernel (bf16 or fp16)."""
    return cutlass.BFloat16 if is_bf16 else cutlass.Float16
