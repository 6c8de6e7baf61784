"""Small tensor helpers shared by the sm80 kernels."""

from __future__ import annotations

import cutlass.cute as cute


def assume_aligned(t: cute.Tensor, align_bytes: int = 16) -> cute.Tensor:
    """Re-tag ``t``'s pointer as ``align_bytes``-aligned.

    Tiles of the packed cache start at multiples of 16 bytes (rows are whole 16-byte
    chunks), but a page index read at run time hides that from the compiler, which would
    otherwise refuse 128-bit cp.async.
    """
    ptr = cute.make_ptr(t.element_type, t.iterator.toint(), t.memspace, assumed_align=align_bytes)
    return cute.make_tensor(ptr, t.layout)


def page_of(block_table: cute.Tensor, batch, tok, page_size):
    """(page, offset in the page) of token ``tok`` of sequence ``batch`` (paged cache)."""
    slot = tok // page_size
    return block_table[batch, slot], tok - slot * page_size


def aligned_ptr(ptr, align_bytes: int):
    """``ptr`` re-tagged as ``align_bytes``-aligned (a stage base: static multiple of it)."""
    return cute.make_ptr(ptr.dtype, ptr.toint(), ptr.memspace, assumed_align=align_bytes)
