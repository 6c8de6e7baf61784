"""The 16-bit dense layers of a decode step: a GEMV for a few tokens and SwiGLU's ``silu(gate) * up``
(any sm_80+ GPU).

GEMV.  A decode step of a Llama-3-8B-shaped model reads 15 GB of projection weights for one
token per sequence: each projection is a matrix-vector product whose time is the time to
stream its weight matrix once.  cuBLAS runs these shapes as a split-K GEMV plus a reduction
kernel; on the H200 that reached 73 % (o_proj, 4096 x 4096) to 80 % (merged q/k/v) of a
large copy's bandwidth inside a captured decode step.  Here a warp owns ``rows_per_warp``
consecutive output rows (for every token) and streams them back to back: lane ``l`` reads
the 16-byte vectors ``l, l + 32, l + 64, ...`` of a row (``ld.global.nc.L1::no_allocate``:
the weights are read exactly once) in batches of ``batch`` loads issued before any is used,
multiplies them with the same vectors of each token's ``x`` (through L1: every warp of the
SM reads the same activations), accumulates in fp32, and a butterfly shuffle sums the warp.
bf16 widens to fp32 with a shift or a mask (bf16 is fp32's top half), fp16 with ``cvt``.

Why several rows per warp: with one row per warp every CTA issues its loads, waits one
round trip and retires, and a tall matrix (gate / up: 28672 rows) runs as waves of CTAs
that start and finish together, HBM idle in between (65 us vs cuBLAS's 58 on the H200).
Warps that stream several rows drift apart and keep HBM busy: 55 us with 8 rows per warp.
``rows_per_warp`` (host side) sizes the grid to about 24 warps per SM; long rows (K >= 8192:
a row alone is several round trips) keep one row per warp.

With programmatic dependent launch (sm_90+) the kernel is launched while the previous one
(the RMSNorm, the attention's combine, SwiGLU) still runs: each warp first asks L2 to fetch
its first row's first batch (``prefetch.global.L2``: the weights do not depend on that
kernel), then waits for it (``griddepcontrol.wait``) before reading ``x`` (coherent loads:
see ``bitnet_ptx.load_v4``).  So HBM streams weights during the small kernels between the
GEMVs.  The next kernel is let in (``griddepcontrol.launch_dependents``) only at the end:
earlier, its CTAs would take SM slots that this kernel's later CTAs still need.

``call_residual``: ``y = dtype(dtype(x W^T) + r)``, the product rounded, then a residual
``r`` added as torch's add would (a decoder layer's last add, ``bitdecode.hf``'s fused
layers): one kernel fewer a layer.

A few more tokens (``GemmSmallMSm80``: GEMV_MAX_TOKENS < tokens <= 16, a batch of decode
steps or a verification block) go to the tensor cores: mma.sync m16n8k16 with 16 weight
rows as A and the tokens as B (one or two 8-token tiles).  The weights are still streamed
once, straight from global memory into A registers: lane (g, c) loads 16 bytes of rows g
and g + 8 and of token g's x at the same k, and the chunk's k are permuted so that those
words are the atom's A and B registers as they are (``layouts.dense.small_m_slots``).  A
CTA owns 16 rows, its warps split K and add their partial tiles in shared memory.

SwiGLU.  ``y = silu(gate) * up`` over the merged gate / up GEMM's output ``[M, 2I]`` in one
kernel instead of torch's two, bit for bit torch's ``F.silu(gate) * up``: silu in fp32 as
``x / (1 + exp(-x))`` (IEEE division, libdevice-accurate ``exp``) rounded to the 16-bit
dtype, then the product of two 16-bit values (exact in fp32) rounded.
"""

from __future__ import annotations

import operator

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from ..layouts import sm80
from ..layouts.dense import ELEM_BYTES, GEMV_MAX_TOKENS as MAX_TOKENS, GEMV_ROW_STEP as ROW_STEP
from ..layouts.dense import SMALL_M_CHUNK, SMALL_M_MAX_TOKENS, SMALL_M_ROWS, SMALL_M_TOKEN_TILE, SMALL_M_WARPS
from ..layouts.dense import VEC, VEC_BYTES, small_m_slots
from ..layouts.resources import L2_LINE_BYTES as LINE_BYTES
from .act_quant import _load16, _store_words
from .bitnet_ptx import WARP, load_v4
from .ptx import cvt_pack_x2, div_rn, half_pair_to_f32, mul_rn, prefetch_l2
from .reduce import across_lanes
from .tensors import cute_float16, wait_for_previous_kernel

GEMV_WARPS = 4  # warps per CTA
LONG_ROW = 8192  # K from which a row alone keeps a warp streaming: one row per warp
WARPS_PER_SM = 24  # the grid rows_per_warp aims at (o_proj / q/k/v: 2 rows, gate/up: 8)
MAX_ROWS_PER_WARP = 8  # the most measured
# MAX_TOKENS: each x row adds a 16-byte load and 8 FMAs per weight vector.  At 4, ptxas
# (12.x, sm_90a) held the one-row-per-warp version to 56-64 registers and spilled at every
# unroll tried; 4 tokens were not tried with the load batches.
SILU_THREADS = 128
SMALL_M_BATCH = 4  # chunks a warp loads before it uses them (at most: a divisor of its chunks)


def batch_for(k: int, tokens: int, sm90: bool) -> int:
    """16-byte weight loads a lane issues before using them (the kernel takes the largest
    divisor of the row's load count up to this).  Measured on the H200 at one token: 16 for
    K = 4096 (o_proj 10.7 us vs 12.0 with 8), 8 for K = 14336 (30.0 vs 32.7).  sm_80 at 2-3
    tokens: 8 (ptxas's allocation there is erratic: at 16, 32 registers and 3 KB of spills
    at K = 4096).  Spill-free at K = 4096 and 14336, 1-3 tokens, sm_80 and sm_90a
    (tests/test_compile.py); other K may spill a few words (sm_80, 2 tokens, K = 11264: 24
    bytes)."""
    if k >= LONG_ROW:
        return 8
    return 16 if sm90 or tokens == 1 else 8


def rows_per_warp(n: int, k: int, sms: int) -> int:
    """Output rows each warp of an (N, K) GEMV streams: one for long rows, else enough for a
    grid of about ``WARPS_PER_SM`` warps per SM, at most ``MAX_ROWS_PER_WARP``."""
    if k >= LONG_ROW:
        return 1
    return max(1, min(MAX_ROWS_PER_WARP, -(-n // (sms * WARPS_PER_SM))))


@cute.jit
def residual_values(mR: cute.Tensor, coords, mine) -> cute.Tensor:
    """``residual_ahead``: fp32 registers holding ``mR`` at each (token, row) of ``coords``,
    read where ``mine`` (the threads that store them) in a branch of its own, so ptxas keeps
    the loads there, beside the weight loads that follow, instead of sinking them to their
    use after the reduction (read after the PDL wait: the previous kernel writes r)."""
    vals = cute.make_rmem_tensor((len(coords),), Float32)
    if mine:
        for j in cutlass.range_constexpr(len(coords)):
            vals[j] = mR[coords[j][0], coords[j][1]].to(Float32)
    return vals


def add_residual(y, mR: cute.Tensor, tok, row, ahead, j: int):
    """The rounded 16-bit ``y`` plus the residual at (``tok``, ``row``) as torch adds it
    (in fp32, rounded again): ``ahead[j]`` where ``residual_values`` read it already, else
    read here (after the PDL wait: a coherent load); ``y`` itself without a residual."""
    if cutlass.const_expr(ahead is not None):
        return y.dtype(y.to(Float32) + ahead[j])
    if cutlass.const_expr(mR is not None):
        return y.dtype(y.to(Float32) + mR[tok, row].to(Float32))
    return y


class GemvSm80:
    """``y[m, n] = sum_k x[m, k] * w[n, k] (+ b[n])``, fp32 sums rounded once to the 16-bit
    dtype, for ``tokens`` rows of ``x``.  Arguments: ``x`` [tokens, K] (rows 16-byte aligned,
    row stride a multiple of 8), ``w`` [N, K] contiguous, ``b`` [N] (``call_bias`` only),
    ``y`` [tokens, N] contiguous, one fp16 / bf16 dtype, then ``rows_per_warp`` (the host's
    ``rows_per_warp(N, K, SMs)``); K (a multiple of 256) is compiled in.
    """

    def __init__(self, is_bf16: bool, k: int, tokens: int, batch: int, pdl: bool = False, warps: int = GEMV_WARPS,
                 residual_ahead: bool = False):
        if k % ROW_STEP or not 1 <= tokens <= MAX_TOKENS:
            raise ValueError(f"the GEMV takes K % {ROW_STEP} == 0 and 1..{MAX_TOKENS} tokens, got K={k}, {tokens}")
        self.is_bf16, self.k, self.tokens, self.pdl, self.warps = is_bf16, k, tokens, pdl, warps
        # ``call_residual`` reads a row's residual after its reduction: a global round trip
        # between the row's last sums and its store, on every warp's last stretch (and per
        # row, serially).  ``residual_ahead`` has lane 0 read it with the row's first weight
        # batch (``residual_values``).  The host builds it so while
        # ``bitdecode.dense.RESIDUAL_AHEAD`` is set (the default)
        self.residual_ahead = residual_ahead
        iters = k // ROW_STEP  # 16-byte vectors per lane per row
        self.batch = max(u for u in range(1, batch + 1) if iters % u == 0)  # no remainder batch
        self.batches = iters // self.batch
        # the L2 lines of the first batch of a row, spread over the lanes
        self.lines = self.batch * WARP * VEC_BYTES // LINE_BYTES

    @cute.jit
    def __call__(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, rows_per_warp: Int32, stream):
        self.launch(mX, mW, None, mY, rows_per_warp, stream)

    @cute.jit
    def call_bias(self, mX: cute.Tensor, mW: cute.Tensor, mB: cute.Tensor, mY: cute.Tensor, rows_per_warp: Int32,
                  stream):
        """The GEMV plus a bias ``b`` [N], added in fp32 before the one rounding."""
        self.launch(mX, mW, mB, mY, rows_per_warp, stream)

    @cute.jit
    def call_residual(self, mX: cute.Tensor, mW: cute.Tensor, mR: cute.Tensor, mY: cute.Tensor,
                      rows_per_warp: Int32, stream):
        """The GEMV, rounded, plus a residual ``r`` [tokens, N] (fp32 add, rounded once):
        torch's ``r + linear(x, w)`` bit for bit."""
        self.launch(mX, mW, None, mY, rows_per_warp, stream, mR)

    def launch(self, mX, mW, mB, mY, rows_per_warp, stream, mR=None):
        """(plain Python, traced inside each entry point: a jit entry calling another would
        take its exported signature)"""
        per_cta = self.warps * rows_per_warp
        self.kernel(mX, mW, mB, mR, mY, rows_per_warp).launch(
            grid=[(mW.shape[0] + per_cta - 1) // per_cta, 1, 1], block=[WARP * self.warps, 1, 1], stream=stream,
            use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mB: cute.Tensor, mR: cute.Tensor, mY: cute.Tensor,
               rows_per_warp: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        warp, lane = tidx // WARP, tidx % WARP
        n = mW.shape[0]
        first = (bid * self.warps + warp) * rows_per_warp  # this warp's rows: first, first + 1, ...
        x_lanes = [mX.iterator.toint() + (Int64(i) * Int64(mX.stride[0]) + Int64(lane * VEC)) * ELEM_BYTES
                   for i in range(self.tokens)]

        if cutlass.const_expr(self.pdl):
            w_first = self.row_address(mW, first)
            for p in cutlass.range_constexpr(-(-self.lines // WARP)):
                if p * WARP + lane < self.lines:
                    prefetch_l2(w_first + Int64((p * WARP + lane) * LINE_BYTES))
            cute.arch.griddepcontrol_wait()

        for r in cutlass.range(rows_per_warp, unroll=1):
            row = first + r
            ahead = None  # residual_ahead: the row's residual of each token, lane 0's registers
            if cutlass.const_expr(mR is not None and self.residual_ahead):
                ahead = residual_values(mR, [(i, cutlass.min(row, n - 1)) for i in range(self.tokens)], lane == 0)
            acc = self.row_dot(self.row_address(mW, row) + Int64(lane * VEC_BYTES), x_lanes)
            bias = Float32(0.0)
            if cutlass.const_expr(mB is not None):
                bias = mB[cutlass.min(row, n - 1)].to(Float32)
            for i in cutlass.range_constexpr(self.tokens):
                s = across_lanes(acc[i], WARP, operator.add)
                if lane == 0:
                    if row < n:
                        mY[i, row] = add_residual(mY.element_type(s + bias), mR, i, row, ahead, i)
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def row_address(self, mW: cute.Tensor, row) -> Int64:
        """Byte address of weight row ``row``; rows past N (the last warps) read row N-1 again
        and store nothing: no predicated loads."""
        return mW.iterator.toint() + Int64(cutlass.min(row, mW.shape[0] - 1)) * Int64(self.k * ELEM_BYTES)

    @cute.jit
    def row_dot(self, w_lane: Int64, x_lanes: list) -> cute.Tensor:
        """This lane's fp32 partial dot products of one weight row with each token's x, in
        batches of ``batch`` weight (and x) loads issued before any is used."""
        acc = cute.make_rmem_tensor((self.tokens,), Float32)
        acc.fill(0.0)
        if cutlass.const_expr(self.batches == 1):
            self.batch_dot(w_lane, x_lanes, Int64(0), acc)
        else:
            for b in cutlass.range(self.batches, unroll=1):
                self.batch_dot(w_lane, x_lanes, Int64(b) * (self.batch * ROW_STEP * ELEM_BYTES), acc)
        return acc

    @cute.jit
    def batch_dot(self, w_lane: Int64, x_lanes: list, base: Int64, acc: cute.Tensor):
        """``acc[i] +=`` one batch of this lane's products (the batch at byte ``base`` of the row)."""
        step = ROW_STEP * ELEM_BYTES
        ws = [load_v4(w_lane + base + u * step, True) for u in range(self.batch)]
        # (ordered after griddepcontrol.wait: the previous kernel writes x)
        xs = [[load_v4(x_lanes[i] + base + u * step, False, self.pdl) for u in range(self.batch)]
              for i in range(self.tokens)]
        for u in cutlass.range_constexpr(self.batch):
            for word in cutlass.range_constexpr(4):
                w_lo, w_hi = half_pair_to_f32(ws[u][word], self.is_bf16)
                for i in cutlass.range_constexpr(self.tokens):
                    x_lo, x_hi = half_pair_to_f32(xs[i][u][word], self.is_bf16)
                    acc[i] = acc[i] + w_lo * x_lo + w_hi * x_hi


class GemmSmallMSm80:
    """``y[m, n] = sum_k x[m, k] * w[n, k]``, fp32 sums rounded once to the 16-bit dtype, for
    ``GEMV_MAX_TOKENS`` < ``tokens`` <= 16 rows of ``x``, on mma.sync m16n8k16.  Arguments
    as ``GemvSm80``'s (no bias; ``call_residual`` adds a residual as its does); K (a
    multiple of ``SMALL_M_CHUNK`` x ``warps``) is compiled in.  CTA ``i`` owns weight rows
    ``16 i ..``; warp ``w`` of it takes the ``w``-th slice of K and streams it in chunks of
    32 k (a 16-byte load of two weight rows and of each token tile a lane), ``batch`` chunks
    loaded before any is used; the warps' fp32 tiles are added in shared memory and warp 0
    stores the rows."""

    def __init__(self, is_bf16: bool, k: int, tokens: int, pdl: bool = False, warps: int = SMALL_M_WARPS,
                 batch: int = SMALL_M_BATCH, row_blocks: int = 1, residual_ahead: bool = False):
        # (1-3 tokens build too, for timing against the GEMV; the API sends those to the GEMV)
        if not 1 <= tokens <= SMALL_M_MAX_TOKENS or k % (SMALL_M_CHUNK * warps) or not 1 <= batch or row_blocks < 1:
            raise ValueError(f"the small-M GEMM takes 1..{SMALL_M_MAX_TOKENS} tokens, K % {SMALL_M_CHUNK * warps} "
                             f"== 0 (warps={warps}), batch >= 1 and row_blocks >= 1, got {tokens} tokens, K={k}, "
                             f"batch={batch}, row_blocks={row_blocks}")
        self.is_bf16, self.k, self.tokens, self.pdl, self.warps = is_bf16, k, tokens, pdl, warps
        # 16-row blocks a CTA takes one after the other (1: one; more: fewer, longer-lived
        # CTAs for tall matrices, whose many short CTAs run as waves)
        self.row_blocks = row_blocks
        self.dtype = cute_float16(is_bf16)
        self.chunks = k // (SMALL_M_CHUNK * warps)  # per warp
        self.batch = max(d for d in range(1, batch + 1) if self.chunks % d == 0)
        self.tiles = -(-tokens // SMALL_M_TOKEN_TILE)
        # which loaded word each MMA register takes (read off the atom on the host)
        self.a_slots, self.b_slots, self.c_slots = small_m_slots()
        # warp 0 reads the residual of the values it stores with the block's first weight
        # batch, not after the warps' barrier (``GemvSm80.residual_ahead``)
        self.residual_ahead = residual_ahead

    @cute.jit
    def __call__(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, stream):
        self.launch(mX, mW, None, mY, stream)

    @cute.jit
    def call_residual(self, mX: cute.Tensor, mW: cute.Tensor, mR: cute.Tensor, mY: cute.Tensor, stream):
        """The product, rounded, plus a residual ``r`` [tokens, N] (as ``GemvSm80``'s)."""
        self.launch(mX, mW, mR, mY, stream)

    def launch(self, mX, mW, mR, mY, stream):
        """(plain Python, traced inside each entry point)"""
        per_cta = SMALL_M_ROWS * self.row_blocks
        self.kernel(mX, mW, mR, mY).launch(grid=[(mW.shape[0] + per_cta - 1) // per_cta, 1, 1],
                                           block=[WARP * self.warps, 1, 1], stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mR: cute.Tensor, mY: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        warp, lane = tidx // WARP, tidx % WARP
        g, quad = lane // 4, lane % 4
        n = mW.shape[0]
        first = bid * self.row_blocks * SMALL_M_ROWS  # the CTA's first row
        k0 = Int64(warp * (self.chunks * SMALL_M_CHUNK) + quad * VEC)  # this lane's first k
        # token rows past the last fill B columns whose outputs are never stored
        x_rows = [mX.iterator.toint()
                  + (Int64(cutlass.min(SMALL_M_TOKEN_TILE * t + g, self.tokens - 1)) * Int64(mX.stride[0]) + k0)
                  * ELEM_BYTES for t in range(self.tiles)]
        smem = cutlass.memory.SmemAllocator()
        values = 4 * self.tiles  # accumulator values a lane holds
        red = smem.allocate_tensor(Float32, cute.make_layout((WARP, values, self.warps)), 16)

        if cutlass.const_expr(self.pdl):  # the first batch of weights into L2 while the previous kernel runs
            w_rows = self.weight_rows(mW, first, g, k0, n)
            for j in cutlass.range_constexpr(self.batch):
                for h in cutlass.range_constexpr(2):
                    prefetch_l2(w_rows[h] + j * (SMALL_M_CHUNK * ELEM_BYTES))
            cute.arch.griddepcontrol_wait()

        mma = sm80.make_mma(self.dtype)
        thr = mma.get_slice(lane)
        if cutlass.const_expr(self.row_blocks == 1):
            self.row_block(mW, mR, mY, x_rows, red, mma, thr, warp, lane, first, k0, n)
        else:
            for i in cutlass.range(self.row_blocks, unroll=1):
                row0 = first + i * SMALL_M_ROWS
                if row0 < n:  # (uniform over the CTA: the barriers inside are safe)
                    self.row_block(mW, mR, mY, x_rows, red, mma, thr, warp, lane, row0, k0, n)
                    cute.arch.sync_threads()  # warp 0 has read ``red`` before the next block's partials land
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def weight_rows(self, mW: cute.Tensor, row0, g, k0: Int64, n):
        """Byte addresses of this lane's first loads of weight rows ``row0 + g`` and ``+ 8``;
        rows past N (the last block) read row N-1 again and store nothing."""
        return [mW.iterator.toint() + (Int64(cutlass.min(row0 + g + 8 * h, n - 1)) * Int64(self.k) + k0)
                * ELEM_BYTES for h in range(2)]

    @cute.jit
    def row_block(self, mW, mR, mY, x_rows, red, mma, thr, warp, lane, row0, k0: Int64, n):
        """Rows ``row0 ..`` of y (16): the warp's slice of K in batches of chunks, then the
        warps' tiles added and stored (``store``)."""
        w_rows = self.weight_rows(mW, row0, lane // 4, k0, n)
        ahead = None  # residual_ahead: warp 0's values' residuals (``store``'s order)
        if cutlass.const_expr(mR is not None and self.residual_ahead):
            ahead = residual_values(mR, self.stored_values(lane, row0, n), warp == 0)
        step = SMALL_M_CHUNK * ELEM_BYTES  # bytes from one chunk of a row to the next
        accs = [cute.make_rmem_tensor(thr.partition_shape_C((SMALL_M_ROWS, SMALL_M_TOKEN_TILE)), Float32)
                for _ in range(self.tiles)]
        for acc in accs:
            acc.fill(0.0)
        for b in cutlass.range(self.chunks // self.batch, unroll=1):
            base = Int64(b) * (self.batch * step)
            ws = [[load_v4(w_rows[h] + base + j * step, True) for h in range(2)] for j in range(self.batch)]
            # (ordered after griddepcontrol.wait: the previous kernel writes x)
            xs = [[load_v4(x_rows[t] + base + j * step, False, self.pdl) for t in range(self.tiles)]
                  for j in range(self.batch)]
            for j in cutlass.range_constexpr(self.batch):
                for q in cutlass.range_constexpr(2):
                    self.mma_words(mma, thr, ws[j], xs[j], q, accs)
        self.store(red, accs, mR, mY, warp, lane, row0, n, ahead)

    def value_coords(self, lane, row0, t: int, v: int):
        """(token, row) of accumulator value ``v`` of token tile ``t`` of ``lane`` (rows from
        ``row0``): where ``store`` puts it."""
        half, off = self.c_slots[v]
        return SMALL_M_TOKEN_TILE * t + 2 * (lane % 4) + off, row0 + lane // 4 + 8 * half

    def stored_values(self, lane, row0, n):
        """(token, row) of each value warp 0's ``lane`` stores, in ``store``'s order (clamped
        into y: values past it are not stored)."""
        out = []
        for t in range(self.tiles):
            for v in range(4):
                tok, row = self.value_coords(lane, row0, t, v)
                out.append((cutlass.min(tok, self.tokens - 1), cutlass.min(row, n - 1)))
        return out

    @cute.jit
    def mma_words(self, mma, thr, w_words, x_words, q, accs):
        """MMA ``q`` of a chunk: words 2q, 2q + 1 of the two weight rows as A, of each token
        tile's x as B (``small_m_slots``: the same permutation of the chunk's k for both)."""
        frag_a = cute.make_rmem_tensor(thr.partition_shape_A((SMALL_M_ROWS, sm80.MMA_SHAPE[2])), self.dtype)
        a32 = cute.recast_tensor(frag_a, Uint32)
        for r in cutlass.range_constexpr(len(self.a_slots)):
            half, ch = self.a_slots[r]
            a32[r] = Uint32(w_words[half][2 * q + ch])
        for t in cutlass.range_constexpr(self.tiles):
            frag_b = cute.make_rmem_tensor(thr.partition_shape_B((SMALL_M_TOKEN_TILE, sm80.MMA_SHAPE[2])),
                                           self.dtype)
            b32 = cute.recast_tensor(frag_b, Uint32)
            for r in cutlass.range_constexpr(len(self.b_slots)):
                b32[r] = Uint32(x_words[t][2 * q + self.b_slots[r]])
            cute.gemm(mma, accs[t], frag_a[None, None, 0], frag_b[None, None, 0], accs[t])

    @cute.jit
    def store(self, red, accs, mR, mY, warp, lane, row0, n, ahead=None):
        """The warps' partial tiles added in shared memory; warp 0 rounds (adds the residual,
        ``ahead``'s if read already) and stores the CTA's rows of each token."""
        for t in cutlass.range_constexpr(self.tiles):
            for v in cutlass.range_constexpr(4):
                red[lane, 4 * t + v, warp] = accs[t][v]
        cute.arch.sync_threads()
        if warp == 0:
            for t in cutlass.range_constexpr(self.tiles):
                for v in cutlass.range_constexpr(4):
                    s = red[lane, 4 * t + v, 0]
                    for w in cutlass.range_constexpr(1, self.warps):
                        s = s + red[lane, 4 * t + v, w]
                    tok, row = self.value_coords(lane, row0, t, v)
                    if row < n and tok < self.tokens:
                        mY[tok, row] = add_residual(mY.element_type(s), mR, tok, row, ahead, 4 * t + v)


class SiluMulSm80:
    """``y = silu(gate) * up`` (torch's ops, bit for bit).  Arguments: ``gu`` [M, 2I] (gate
    then up; rows 16-byte aligned, row stride a multiple of 8), ``y`` [M, I] contiguous, one
    fp16 / bf16 dtype, I % 8 == 0."""

    def __init__(self, is_bf16: bool, pdl: bool = False):
        self.is_bf16 = is_bf16
        self.pdl = pdl

    @cute.jit
    def __call__(self, mGU: cute.Tensor, mY: cute.Tensor, stream):
        vecs = mY.shape[1] // VEC
        self.kernel(mGU, mY).launch(grid=[(vecs + SILU_THREADS - 1) // SILU_THREADS, mY.shape[0], 1],
                                    block=[SILU_THREADS, 1, 1], stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mGU: cute.Tensor, mY: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bx, row, _ = cute.arch.block_idx()
        inter = mY.shape[1]
        v = bx * SILU_THREADS + tidx
        wait_for_previous_kernel(self.pdl)
        if v < inter // VEC:
            gu_row = mGU.iterator.toint() + Int64(row) * Int64(mGU.stride[0]) * ELEM_BYTES
            y_row = mY.iterator.toint() + Int64(row) * Int64(mY.stride[0]) * ELEM_BYTES
            # (ordered after griddepcontrol.wait: the previous kernel writes gate_up)
            gate = _load16(gu_row + Int64(v) * VEC_BYTES, self.pdl)
            up = _load16(gu_row + Int64(inter) * ELEM_BYTES + Int64(v) * VEC_BYTES, self.pdl)
            out = []
            for word in cutlass.range_constexpr(4):
                silu = [div_rn(g, 1.0 + cute.math.exp(-g, fastmath=False))
                        for g in half_pair_to_f32(gate[word], self.is_bf16)]
                # torch rounds silu's output to the dtype before the product
                s16 = half_pair_to_f32(cvt_pack_x2(silu[0], silu[1], self.is_bf16), self.is_bf16)
                u = half_pair_to_f32(up[word], self.is_bf16)
                out.append(cvt_pack_x2(mul_rn(s16[0], u[0]), mul_rn(s16[1], u[1]), self.is_bf16))
            _store_words(y_row + Int64(v) * VEC_BYTES, *out)


def compile_gemv(is_bf16: bool, k: int, tokens: int, has_bias: bool, options: str, pdl: bool = False,
                 has_residual: bool = False, residual_ahead: bool = False):
    """Compile ``GemvSm80`` for every N (K and the token count compiled in; ``pdl`` for
    sm_90+, which also picks the load batch: ``batch_for``); ``has_bias`` its
    ``call_bias``, ``has_residual`` its ``call_residual`` (one or the other)."""
    x, w, y, r, stream = _fake_projection(is_bf16, k, tokens)
    kernel = GemvSm80(is_bf16, k, tokens, batch_for(k, tokens, pdl), pdl, residual_ahead=residual_ahead)
    assert not (has_bias and has_residual), "a bias or a residual"
    if has_bias:
        b = cute.runtime.make_fake_compact_tensor(cute_float16(is_bf16), (w.shape[0],), assumed_align=2)
        return cute.compile(kernel.call_bias, x, w, b, y, Int32(1), stream, options=options)
    if has_residual:
        return cute.compile(kernel.call_residual, x, w, r, y, Int32(1), stream, options=options)
    return cute.compile(kernel, x, w, y, Int32(1), stream, options=options)


def _fake_projection(is_bf16: bool, k: int, tokens: int):
    """The fake operands both projection kernels compile for: x [tokens, K] (a row stride
    that is a multiple of 8), w [N, K], y and a residual [tokens, N] (N symbolic), a stream."""
    dtype = cute_float16(is_bf16)
    n = cute.sym_int()
    x = cute.runtime.make_fake_tensor(dtype, (tokens, k), stride=(cute.sym_int64(divisibility=VEC), 1),
                                      assumed_align=16)
    w = cute.runtime.make_fake_compact_tensor(dtype, (n, k), stride_order=(1, 0), assumed_align=16)
    y, r = (cute.runtime.make_fake_compact_tensor(dtype, (tokens, n), stride_order=(1, 0), assumed_align=2)
            for _ in range(2))
    return x, w, y, r, cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)


def compile_gemm_small_m(is_bf16: bool, k: int, tokens: int, options: str, pdl: bool = False,
                         has_residual: bool = False, warps: int = SMALL_M_WARPS, batch: int = SMALL_M_BATCH,
                         row_blocks: int = 1, residual_ahead: bool = False):
    """Compile ``GemmSmallMSm80`` for every N (K, the token count, the warps a CTA, the load
    batch and the row blocks a CTA compiled in); ``has_residual`` its ``call_residual``."""
    x, w, y, r, stream = _fake_projection(is_bf16, k, tokens)
    kernel = GemmSmallMSm80(is_bf16, k, tokens, pdl, warps, batch, row_blocks, residual_ahead)
    if has_residual:
        return cute.compile(kernel.call_residual, x, w, r, y, stream, options=options)
    return cute.compile(kernel, x, w, y, stream, options=options)


def compile_silu_mul(is_bf16: bool, options: str, pdl: bool = False):
    """Compile ``SiluMulSm80`` for every M and every I % 8 == 0."""
    dtype = cute_float16(is_bf16)
    m = cute.sym_int()
    gu = cute.runtime.make_fake_tensor(dtype, (m, cute.sym_int(divisibility=2 * VEC)),
                                       stride=(cute.sym_int64(divisibility=VEC), 1), assumed_align=16)
    y = cute.runtime.make_fake_compact_tensor(dtype, (m, cute.sym_int(divisibility=VEC)), stride_order=(1, 0),
                                              assumed_align=16)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(SiluMulSm80(is_bf16, pdl), gu, y, stream, options=options)
