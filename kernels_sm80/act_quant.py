"""BitNet's per-token int8 activation quantizer as one kernel (any sm_80+ GPU), alone or
fused with the RMSNorm in front of it.

``q = round(x * s)`` clamped to int8 with ``s = 127 / max(|x|, eps)`` per row, bit-identical
to ``bitdecode.bitnet.quantize_activation``'s torch ops (fp32 maths, each op rounded once,
ties to even; the scale as torch computes a scalar over a tensor: ``rcp(max) * 127``), which launch nine kernels per call: this is on the path of every BitLinear
call, so in a decode step it was most of the launches.

One CTA per row.  Pass 1 streams the row in 16-byte vectors (8 halves) for ``max |x|``
(warp shuffles, then shared memory); pass 2 reads the row again (a few KB per row, so from
L1 / L2, not HBM), scales, rounds and stores 8 int8 per vector.  Memory-bound by
nature: a reduction and an elementwise pass, no matrix maths, so no tensor cores.

``RmsNormQuantSm80`` puts the model's RMSNorm in front (every BitLinear input of BitNet
b1.58 is an RMSNorm output): the sum of squares first, then the normalized row (stored,
the model may read it) and its ``max |y|``, then the quantizer over the stored row; one
launch instead of the norm's eight torch kernels plus the quantizer.  ``gated``: the
norm's input is BitNet's MLP activation ``relu(gate)^2 * up``, made from the fused
gate / up projection's output as the norm reads it (three more torch kernels saved).
``residual``: the norm's input is a decoder layer's residual sum ``x + r`` (torch's add:
fp32, rounded once), which the kernel also stores (``call_add_norm``: the add's own launch
saved, ``bitdecode.hf.fuse_norms``).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from ..layouts import bitnet as fmt
from .bitnet_ptx import WARP
from .ptx import _asm, cvt_pack_x2, half_pair_to_f32, mul_rn, rcp_rn
from .reduce import block_reduce
from .tensors import cute_float16, prefetch_run_l2, wait_for_previous_kernel

THREADS = 128
VEC = fmt.ACT_QUANT_VEC  # halves per 16-byte load
HALF_BYTES = fmt.CHUNK_BYTES // VEC
WARPS = THREADS // WARP


@dsl_user_op
def _load16(addr: Int64, ordered: bool = False, *, loc=None, ip=None):
    """16-byte global load through L1 (pass 2 re-reads the row).  ``ordered``: declared
    with side effects, so LLVM keeps it after an earlier ``griddepcontrol.wait`` (data the
    previous kernel writes; a pure asm load may be hoisted above the wait)."""
    struct_ty = ir.Type.parse("!llvm.struct<(i32, i32, i32, i32)>")
    res = llvm.inline_asm(struct_ty, [Int64(addr).ir_value(loc=loc, ip=ip)],
                          "ld.global.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l",
                          has_side_effects=ordered, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
                          loc=loc, ip=ip)
    return tuple(Int32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(4))


@dsl_user_op
def _quant4(a: Float32, b: Float32, c: Float32, d: Float32, s: Float32, *, loc=None, ip=None) -> Int32:
    """Four values times ``s`` (mul.rn), rounded to the nearest even integer, clamped to
    int8 and packed little-endian into one word."""
    ops = [Float32(v).ir_value(loc=loc, ip=ip) for v in (a, b, c, d, s)]
    body = "".join(
        f"mul.rn.f32 t{i}, ${i + 1}, $5;\ncvt.rni.s32.f32 i{i}, t{i};\n"
        f"max.s32 i{i}, i{i}, {fmt.ACT_Q_MIN};\nmin.s32 i{i}, i{i}, {fmt.ACT_Q_MAX};\n"
        for i in range(4)
    )
    return Int32(_asm(
        T.i32(), ops,
        "{\n.reg .f32 t0, t1, t2, t3;\n.reg .s32 i0, i1, i2, i3;\n.reg .b32 lo, hi;\n" + body
        + "prmt.b32 lo, i0, i1, 0x0040;\nprmt.b32 hi, i2, i3, 0x0040;\nprmt.b32 $0, lo, hi, 0x5410;\n}",
        "=r,f,f,f,f,f", loc=loc, ip=ip))


@dsl_user_op
def _store_words(addr: Int64, *words, loc=None, ip=None) -> None:
    """One vector store of 2 or 4 32-bit words (``st.global.v2`` / ``.v4``)."""
    regs = ", ".join(f"${i + 1}" for i in range(len(words)))
    _asm(None, [Int64(addr).ir_value(loc=loc, ip=ip)] + [Int32(w).ir_value(loc=loc, ip=ip) for w in words],
         f"st.global.v{len(words)}.b32 [$0], {{{regs}}};", "l" + ",r" * len(words), side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def _relu(x: Float32, *, loc=None, ip=None) -> Float32:
    """max(x, 0) keeping NaN (as torch's relu does)."""
    return Float32(_asm(T.f32(), [Float32(x).ir_value(loc=loc, ip=ip)], "max.NaN.f32 $0, $1, 0f00000000;", "=f,f",
                        loc=loc, ip=ip))


class ActQuantSm80:
    """Arguments: ``x`` fp16/bf16 [M, K] (K % 8 == 0, 16-byte aligned rows), ``q`` int8
    [M, K], ``s`` fp32 [M]; ``eps`` the floor of ``max |x|``."""

    def __init__(self, is_bf16: bool, eps: float):
        self.is_bf16 = is_bf16
        self.eps = eps

    @cute.jit
    def __call__(self, mX: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor, stream):
        self.kernel(mX, mQ, mS).launch(grid=[mX.shape[0], 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.jit
    def halves(self, word: Int32):
        return half_pair_to_f32(word, self.is_bf16)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        k = mX.shape[1]
        vecs = k // VEC
        x_row = mX.iterator.toint() + Int64(row) * Int64(k) * HALF_BYTES
        q_row = mQ.iterator.toint() + Int64(row) * Int64(k)

        amax = Float32(0.0)
        for v in cutlass.range(tidx, vecs, THREADS, unroll=2):
            for word in _load16(x_row + Int64(v) * fmt.CHUNK_BYTES):
                lo, hi = self.halves(word)
                amax = cute.arch.fmax(amax, cute.arch.fmax(cute.math.absf(lo), cute.math.absf(hi)))
        smem = cutlass.memory.SmemAllocator()
        s_red = smem.allocate_tensor(Float32, cute.make_layout((WARPS,)), 16)
        self.quantize_row(x_row, q_row, vecs, amax, s_red, mS, tidx, row)

    @cute.jit
    def quantize_row(self, x_row: Int64, q_row: Int64, vecs, amax: Float32, s_red, mS: cute.Tensor, tidx, row):
        """The row's scale from this thread's part of ``max |x|`` (reduced over the CTA),
        then the quantization pass over the row at ``x_row`` (16-bit) into ``q_row``."""
        amax = block_reduce(amax, s_red, tidx, WARPS, True)
        # torch evaluates ``127.0 / t`` as ``t.reciprocal() * 127`` (two roundings), and so must we
        scale = mul_rn(rcp_rn(cute.arch.fmax(amax, Float32(self.eps))), Float32(fmt.ACT_Q_MAX))
        if tidx == 0:
            mS[row] = scale

        for v in cutlass.range(tidx, vecs, THREADS, unroll=2):
            # (ordered: RmsNormQuantSm80 re-reads the y it has just stored)
            w0, w1, w2, w3 = _load16(x_row + Int64(v) * fmt.CHUNK_BYTES, True)
            a0, a1 = self.halves(w0)
            a2, a3 = self.halves(w1)
            a4, a5 = self.halves(w2)
            a6, a7 = self.halves(w3)
            _store_words(q_row + Int64(v) * VEC, _quant4(a0, a1, a2, a3, scale), _quant4(a4, a5, a6, a7, scale))


class RmsNormQuantSm80(ActQuantSm80):
    """RMSNorm, then the quantizer of its output.  Arguments: ``x``, ``w`` (the norm's
    weight, [K]) and ``y`` fp16/bf16 of one dtype, ``q``, ``s`` as ``ActQuantSm80``;
    ``gated``: ``x`` is [M, 2K], gate then up, and the norm's input is
    ``dtype(dtype(relu(gate)^2) * up)`` (transformers' ``relu2`` activation times up,
    each op rounded to the dtype as torch does).

    ``y = dtype(w * dtype(x * rsqrt(mean(x^2) + norm_eps)))`` with the fp32 maths of
    transformers' ``BitNetRMSNorm`` / ``LlamaRMSNorm`` (squares exact, the mean as torch
    takes it, ``sum * (1 / K)``; the product by ``w`` of two 16-bit values exact in fp32,
    rounded once).  The sum runs in another order than torch's, so ``y`` can differ from
    torch's by up to two 16-bit ulps where the row's ``rsqrt`` lands near a rounding edge; ``q``
    and ``s`` are exactly the quantizer's of this ``y``."""

    def __init__(self, is_bf16: bool, eps: float, norm_eps: float, gated: bool = False, quantize: bool = True,
                 pdl: bool = False, residual: bool = False, prefetch_weight: bool = False):
        super().__init__(is_bf16, eps)
        assert not (gated and residual), "one input transform: the gated product or the residual sum"
        self.norm_eps = norm_eps
        self.gated = gated
        self.residual = residual  # the input is x + r, stored to h (``call_add_norm``)
        self.quantize = quantize  # False: the norm alone (``call_norm``: no ``q``, ``s``)
        # programmatic dependent launch (sm_90+): the next kernel (a projection's GEMV) is let
        # in at once, so it starts fetching its weights while this one-CTA-per-token kernel runs
        self.pdl = pdl
        # The weight is read in pass 2, after the sum of squares' reduction: a global round
        # trip (from HBM in a model step, whose weights stream through L2) between the two
        # passes.  ``prefetch_weight`` asks L2 for it before the wait for the previous
        # kernel (it never depends on it), so pass 2 finds it there.  The host builds it
        # so while ``bitdecode.bitnet.NORM_PREFETCH`` is set (the default)
        self.prefetch_weight = prefetch_weight

    @cute.jit
    def __call__(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor,
                 stream):
        self.launch(mX, mW, mY, mQ, mS, stream)

    @cute.jit
    def call_norm(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, stream):
        """The norm alone (``quantize=False``): ``y`` only."""
        self.launch(mX, mW, mY, None, None, stream)

    @cute.jit
    def call_add_norm(self, mX: cute.Tensor, mR: cute.Tensor, mW: cute.Tensor, mH: cute.Tensor, mY: cute.Tensor,
                      stream):
        """The residual sum and its norm (``residual=True``, ``quantize=False``): ``h = x +
        r`` and ``y = norm(h)``."""
        self.launch(mX, mW, mY, None, None, stream, mR, mH)

    def launch(self, mX, mW, mY, mQ, mS, stream, mR=None, mH=None):
        """(plain Python, traced inside each entry point: a jit entry calling another would
        take its exported signature)"""
        self.kernel(mX, mW, mY, mQ, mS, mR, mH).launch(grid=[mX.shape[0], 1, 1], block=[THREADS, 1, 1],
                                                       stream=stream, use_pdl=self.pdl)

    @cute.jit
    def rounded(self, a: Float32, b: Float32):
        """(a, b) rounded to the 16-bit dtype: the packed word and both values widened back."""
        word = cvt_pack_x2(a, b, self.is_bf16)
        lo, hi = self.halves(word)
        return word, lo, hi

    @cute.jit
    def inputs(self, x_row: Int64, v, k, r_row=None, h_row=None):
        """The eight norm inputs of vector ``v`` of a row, as fp32 (four pairs).  With
        ``residual``: ``x + r`` (``r_row``), rounded as torch's add, also stored to ``h_row``
        where given."""
        pairs = []
        if const_expr(self.residual):
            xs = _load16(x_row + Int64(v) * fmt.CHUNK_BYTES, self.pdl)
            rs = _load16(r_row + Int64(v) * fmt.CHUNK_BYTES, self.pdl)
            words = []
            for i in cutlass.range_constexpr(4):
                x0, x1 = self.halves(xs[i])
                r0, r1 = self.halves(rs[i])
                word, h0, h1 = self.rounded(x0 + r0, x1 + r1)
                words.append(word)
                pairs.append((h0, h1))
            if const_expr(h_row is not None):
                _store_words(h_row + Int64(v) * fmt.CHUNK_BYTES, *words)
        elif const_expr(self.gated):
            gate = _load16(x_row + Int64(v) * fmt.CHUNK_BYTES, self.pdl)
            up = _load16(x_row + Int64(k) * HALF_BYTES + Int64(v) * fmt.CHUNK_BYTES, self.pdl)
            for i in cutlass.range_constexpr(4):
                g0, g1 = self.halves(gate[i])
                u0, u1 = self.halves(up[i])
                r0, r1 = _relu(g0), _relu(g1)
                _, a0, a1 = self.rounded(mul_rn(r0, r0), mul_rn(r1, r1))
                _, h0, h1 = self.rounded(mul_rn(a0, u0), mul_rn(a1, u1))
                pairs.append((h0, h1))
        else:
            for word in _load16(x_row + Int64(v) * fmt.CHUNK_BYTES, self.pdl):
                pairs.append(self.halves(word))
        return pairs

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor,
               mR: cute.Tensor, mH: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        k = mY.shape[1]
        vecs = k // VEC
        row_bytes = Int64(row) * Int64(k) * HALF_BYTES
        x_row = mX.iterator.toint() + Int64(row) * Int64(mX.shape[1]) * HALF_BYTES
        y_row = mY.iterator.toint() + row_bytes
        r_row, h_row = None, None
        if const_expr(self.residual):
            r_row = mR.iterator.toint() + row_bytes
            h_row = mH.iterator.toint() + row_bytes
        w_row = mW.iterator.toint()
        smem = cutlass.memory.SmemAllocator()
        s_red = smem.allocate_tensor(Float32, cute.make_layout((WARPS,)), 16)
        if const_expr(self.prefetch_weight):
            prefetch_run_l2(w_row, Int64(k) * HALF_BYTES, tidx, THREADS)
        wait_for_previous_kernel(self.pdl)

        # pass 1: sum of squares (each square exact in fp32)
        ss = Float32(0.0)
        for v in cutlass.range(tidx, vecs, THREADS, unroll=2):
            for lo, hi in self.inputs(x_row, v, k, r_row, h_row):
                ss = ss + lo * lo + hi * hi
        total = block_reduce(ss, s_red, tidx, WARPS, False)
        # torch's mean is ``sum * (1 / K)``; then ``+ eps`` and rsqrt, each rounded once (the
        # rsqrt approximate without flush-to-zero: what CUDA's ``rsqrtf``, torch.rsqrt on
        # fp32 CUDA tensors, compiles to)
        inv_rms = cute.math.rsqrt(mul_rn(total, rcp_rn(Float32(k))) + Float32(self.norm_eps), approx=True)

        # pass 2: y (rounded to the dtype before and after the weight, as the model does),
        # stored, and its max |y|
        amax = Float32(0.0)
        for v in cutlass.range(tidx, vecs, THREADS, unroll=2):
            xs = self.inputs(x_row, v, k, r_row)  # (the gated product / sum again: cheaper than a round trip)
            ww = _load16(w_row + Int64(v) * fmt.CHUNK_BYTES)
            out = []
            for i in cutlass.range_constexpr(4):
                x0, x1 = xs[i]
                w0, w1 = self.halves(ww[i])
                _, h0, h1 = self.rounded(mul_rn(x0, inv_rms), mul_rn(x1, inv_rms))
                word, y0, y1 = self.rounded(mul_rn(w0, h0), mul_rn(w1, h1))
                if const_expr(self.quantize):
                    amax = cute.arch.fmax(amax, cute.arch.fmax(cute.math.absf(y0), cute.math.absf(y1)))
                out.append(word)
            _store_words(y_row + Int64(v) * fmt.CHUNK_BYTES, *out)
        # pass 3: the quantizer over y, each thread re-reading the vectors it stored (the
        # same vectors: the loops share their thread mapping, so no barrier is needed)
        if const_expr(self.quantize):
            q_row = mQ.iterator.toint() + Int64(row) * Int64(k)
            self.quantize_row(y_row, q_row, vecs, amax, s_red, mS, tidx, row)


def compile_act_quant(is_bf16: bool, eps: float, options: str):
    """Compile for every M and every K % 8 == 0."""
    m = cute.sym_int()
    k = cute.sym_int(divisibility=VEC)
    fake = cute.runtime.make_fake_compact_tensor
    x = fake(cute_float16(is_bf16), (m, k), stride_order=(1, 0), assumed_align=16)
    q = fake(cutlass.Int8, (m, k), stride_order=(1, 0), assumed_align=16)
    s = fake(Float32, (m,), assumed_align=4)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(ActQuantSm80(is_bf16, eps), x, q, s, stream, options=options)


def compile_norm_quant(is_bf16: bool, eps: float, norm_eps: float, options: str, gated: bool = False,
                       quantize: bool = True, pdl: bool = False, residual: bool = False, prefetch_weight: bool = False):
    """Compile ``RmsNormQuantSm80`` for every M and every K % 8 == 0.  Without
    ``quantize``: its ``call_norm`` entry point, ``(x, w, y)`` only; with ``residual`` (and
    without ``quantize``) its ``call_add_norm``, ``(x, r, w, h, y)``."""
    m = cute.sym_int()
    k = cute.sym_int(divisibility=VEC)
    fake = cute.runtime.make_fake_compact_tensor
    dtype = cute_float16(is_bf16)
    x = fake(dtype, (m, cute.sym_int(divisibility=2 * VEC) if gated else k), stride_order=(1, 0), assumed_align=16)
    w = fake(dtype, (k,), assumed_align=16)
    y = fake(dtype, (m, k), stride_order=(1, 0), assumed_align=16)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    kernel = RmsNormQuantSm80(is_bf16, eps, norm_eps, gated, quantize, pdl, residual, prefetch_weight)
    if residual:
        assert not quantize, "the residual sum's norm is the norm alone"
        r, h = (fake(dtype, (m, k), stride_order=(1, 0), assumed_align=16) for _ in range(2))
        return cute.compile(kernel.call_add_norm, x, r, w, h, y, stream, options=options)
    if not quantize:
        return cute.compile(kernel.call_norm, x, w, y, stream, options=options)
    q = fake(cutlass.Int8, (m, k), stride_order=(1, 0), assumed_align=16)
    s = fake(Float32, (m,), assumed_align=4)
    return cute.compile(kernel, x, w, y, q, s, stream, options=options)
