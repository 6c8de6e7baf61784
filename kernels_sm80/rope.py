"""Rotary position embedding of a layer's queries and keys as one kernel (any sm_80+ GPU).

transformers' ``apply_rotary_pos_emb`` (Llama and the families that copy it) is
``x * cos + rotate_half(x) * sin`` for q and for k: ten torch kernels per layer (two
multiplies, the half rotation's slice / negate / concatenate, two more multiplies and the
sum, for each of q and k).  In a graph-captured decode step those launches, not their few
KB of data, are the cost; this kernel does both tensors in one launch.

Bit-identical to torch's ops: each product of two 16-bit values is exact in fp32 and is
rounded to the 16-bit dtype (as torch's elementwise multiply rounds its fp32 result), the
two rounded products are added in fp32 (``add.rn``: never fused into an fma) and the sum
rounded again, as torch's add.

A CTA per (token, sequence, 128 head-slices); a thread takes 8 channels of the first half
of a head and the matching 8 of the second half (16-byte loads of x, cos and sin), so a
head of 128 channels is 8 threads and a decode step's 40 heads (Llama-3-8B: 32 + 8) three
CTAs: one CTA looping over them measured 3.6 us per call on the H200, latency-bound.  q and k may be strided (transformers hands transposed views); the
outputs are contiguous ``(B, H, T, D)``, as torch's ops return them.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int64

from ..layouts.dense import ELEM_BYTES, VEC, VEC_BYTES
from .act_quant import _load16, _store_words
from .ptx import add_rn, cvt_pack_x2, half_pair_to_f32, mul_rn
from .tensors import cute_float16

THREADS = 128


def _row_addr(m: cute.Tensor, *coords) -> Int64:
    """Byte address of the row of ``m`` at ``coords`` (every mode but the channels)."""
    off = Int64(0)
    for i, c in enumerate(coords):
        off = off + Int64(c) * Int64(m.stride[i])
    return m.iterator.toint() + off * ELEM_BYTES


class RopeSm80:
    """Arguments: ``q`` / ``k`` (B, H, T, D) and ``cos`` / ``sin`` (B, T, D) in one 16-bit
    dtype (channel stride 1, other strides multiples of 8 values, 16-byte aligned; ``cos`` /
    ``sin`` may have batch stride 0), outputs ``q_out`` / ``k_out`` contiguous (B, H, T, D)."""

    def __init__(self, is_bf16: bool, head_dim: int):
        assert head_dim % (2 * VEC) == 0
        self.is_bf16 = is_bf16
        self.d = head_dim
        self.units = head_dim // 2 // VEC  # threads per head

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mCos: cute.Tensor, mSin: cute.Tensor,
                 mQo: cute.Tensor, mKo: cute.Tensor, stream):
        units = (mQ.shape[1] + mK.shape[1]) * self.units
        self.kernel(mQ, mK, mCos, mSin, mQo, mKo).launch(
            grid=[mQ.shape[2], mQ.shape[0], (units + THREADS - 1) // THREADS], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mCos: cute.Tensor, mSin: cute.Tensor,
               mQo: cute.Tensor, mKo: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        t, b, part = cute.arch.block_idx()
        hq, hk = mQ.shape[1], mK.shape[1]
        cos_row, sin_row = _row_addr(mCos, b, t), _row_addr(mSin, b, t)
        u = part * THREADS + tidx
        if u < (hq + hk) * self.units:
            h, j = u // self.units, u % self.units
            if h < hq:
                self.rotate(mQ, mQo, b, h, t, j, cos_row, sin_row)
            else:
                self.rotate(mK, mKo, b, h - hq, t, j, cos_row, sin_row)

    @cute.jit
    def rotate(self, mX: cute.Tensor, mOut: cute.Tensor, b, h, t, j, cos_row: Int64, sin_row: Int64):
        """Channels ``8 j ..`` and ``D/2 + 8 j ..`` of head ``h``, token ``t``, sequence ``b``."""
        half = self.d // 2 * ELEM_BYTES
        lo = Int64(j) * VEC_BYTES
        x_row, o_row = _row_addr(mX, b, h, t), _row_addr(mOut, b, h, t)
        x1, x2 = _load16(x_row + lo), _load16(x_row + lo + half)
        c1, c2 = _load16(cos_row + lo), _load16(cos_row + lo + half)
        s1, s2 = _load16(sin_row + lo), _load16(sin_row + lo + half)
        out1, out2 = [], []
        for w in cutlass.range_constexpr(VEC // 2):
            # first half: x1 cos - x2 sin; second half: x2 cos + x1 sin (rotate_half's -x2, x1)
            out1.append(self.pair(x1[w], c1[w], x2[w], s1[w], True))
            out2.append(self.pair(x2[w], c2[w], x1[w], s2[w], False))
        _store_words(o_row + lo, *out1)
        _store_words(o_row + lo + half, *out2)

    @cute.jit
    def pair(self, x, c, y, s, negate: cutlass.Constexpr[bool]):
        """Two lanes of ``round(round(x c) +- round(y s))`` (16-bit pairs in, one word out)."""
        xw, cw, yw, sw = (half_pair_to_f32(v, self.is_bf16) for v in (x, c, y, s))
        vals = []
        for lane in cutlass.range_constexpr(2):
            xc = mul_rn(xw[lane], cw[lane])
            ys = mul_rn(yw[lane], sw[lane])
            if cutlass.const_expr(negate):
                ys = -ys
            vals.append((xc, ys))
        # each product rounded to 16 bits (both lanes at once), widened back, added, rounded
        r_xc = half_pair_to_f32(cvt_pack_x2(vals[0][0], vals[1][0], self.is_bf16), self.is_bf16)
        r_ys = half_pair_to_f32(cvt_pack_x2(vals[0][1], vals[1][1], self.is_bf16), self.is_bf16)
        return cvt_pack_x2(add_rn(r_xc[0], r_ys[0]), add_rn(r_xc[1], r_ys[1]), self.is_bf16)


def compile_rope(is_bf16: bool, head_dim: int, options: str):
    """Compile ``RopeSm80`` for every batch, head count and length."""
    dtype = cute_float16(is_bf16)

    def strided(rank):
        stride = tuple(cute.sym_int64(divisibility=VEC) for _ in range(rank - 1)) + (1,)
        shape = tuple(cute.sym_int() for _ in range(rank - 1)) + (head_dim,)
        return cute.runtime.make_fake_tensor(dtype, shape, stride=stride, assumed_align=16)

    def compact():
        shape = (cute.sym_int(), cute.sym_int(), cute.sym_int(), head_dim)
        return cute.runtime.make_fake_compact_tensor(dtype, shape, stride_order=(3, 2, 1, 0), assumed_align=16)

    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(RopeSm80(is_bf16, head_dim), strided(4), strided(4), strided(3), strided(3), compact(),
                        compact(), stream, options=options)
