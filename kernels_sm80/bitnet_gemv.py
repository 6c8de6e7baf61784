"""BitNet W2A8 GEMV (M = 1): 2-bit ternary weights x int8 activations, dp4a on CUDA cores.

Memory bound: the packed weights (N*K/4 bytes) are read once, so everything is about
streaming them at full HBM bandwidth.

Work split.  The packed format stores each 16-row stripe of W as one contiguous run of
``K/128`` *groups* of 512 bytes (four 16x32 tiles).  A CTA owns one stripe; its warps
split the groups (warp ``w`` takes groups ``w, w + W, w + 2W, ...``), so even the long-K
shapes (3200 x 10240: 200 stripes) put thousands of warps to work.  A warp reads a
group with one fully coalesced 16-byte load per lane (512 bytes), ``UNROLL`` groups
before it computes anything, so every lane has ``16 * UNROLL`` bytes in flight.  The
warp count is a launch argument, not a compile-time constant: the host picks it per
shape (``warps_for``) so that each warp gets about ``UNROLL`` groups, and one
compilation serves every (N, K).

Lane ``l`` of a warp reads chunk ``q = l % 8`` of tile ``l // 8`` of the group, i.e.
four rows (``chunk_row(q) + r``) times the same 16 columns; the matching 16 bytes of
the activation vector come from global memory through L1 (every warp of the SM reads
the same vector).

Decode + dot product, per 32-bit word ``w`` (16 codes ``c = w + 2`` of one row): the
four AND masks ``0x03030303 << 2i`` (one lop3 each) isolate elements ``4i .. 4i+3`` as
bytes ``c * 4**i``; ``dp4a.u32.s32`` against the activation word ``i`` adds
``4**i * sum(c * x)`` to accumulator ``i`` of the row.  No shifts: the four
accumulators are combined once at the end (``a0 + a1>>2 + a2>>4 + a3>>6``, exact since
accumulator i is a multiple of 4**i), and the code offset is removed once with
``sum(w x) = sum(c x) - 2 * sum(x)``, where each lane sums its activation bytes with one
more dp4a per word.  That is 8 instructions per 16 weights instead of BitNet's 12.

Reduction: lanes ``l, l^2, l^8, l^16`` hold the same four rows (``^2`` flips the column
half, ``^8``/``^16`` the tile), so three butterfly shuffles leave the warp's row sums in
lanes 0, 1, 4, 5; the warps then meet in shared memory and 16 threads scale and store.

The last batch of a warp is padded with its last group again (an L2 hit) whose
activation words are zeroed: it adds nothing to ``sum(c x)`` nor to ``sum(x)``, and all
loads stay unpredicated, which lets ptxas issue a whole batch before the arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from ..layouts import bitnet as fmt
from .bitnet_ptx import (WARP, dp4a_ss, dp4a_us, load_v4, lop3_and, matmul_fake_args, segment_of, segment_scale,
                         store_out)
from .ptx import load_here, u32_as_f32
from .tensors import prefetch_run_l2, wait_holding, xor_words

MAX_WARPS = 16


@cute.jit
def accumulate_words(w: tuple, x: tuple, acc: cute.Tensor):
    """Four rows x 16 columns: ``acc[4r + i] += 4**i * sum(c * x)`` over elements 4i..4i+3
    of word r (one lop3 and one dp4a per four weights)."""
    for r in cutlass.range_constexpr(fmt.ROWS_PER_CHUNK):
        for i in cutlass.range_constexpr(fmt.DECODE_STEPS):
            codes = lop3_and(w[r], fmt.DECODE_MASK << (2 * i))
            acc[r * fmt.DECODE_STEPS + i] = dp4a_us(codes, x[i], acc[r * fmt.DECODE_STEPS + i])


@cute.jit
def add_byte_sums(x: tuple, total: Int32) -> Int32:
    """``total`` plus the sum of the signed bytes of the activation words ``x`` (one dp4a
    by ones a word): the x sum that turns the codes' products into the ternary weights'."""
    for i in cutlass.range_constexpr(fmt.DECODE_STEPS):
        total = dp4a_ss(x[i], Int32(0x01010101), total)
    return total


@cute.jit
def fold_rows(acc: cute.Tensor) -> cute.Tensor:
    """Per row of this lane: undo the 4**i scaling of accumulator i (exact, accumulator i
    is a multiple of 4**i), then add lanes l, l^2 (other column half), l^8, l^16 (other
    tiles), which hold the same four rows: the warp's row sums end up in lanes 0, 1, 4, 5
    (rows ``chunk_row(q) + r``)."""
    rows = cute.make_rmem_tensor((fmt.ROWS_PER_CHUNK,), Int32)
    for r in cutlass.range_constexpr(fmt.ROWS_PER_CHUNK):
        s = acc[r * 4] + (acc[r * 4 + 1] >> 2) + (acc[r * 4 + 2] >> 4) + (acc[r * 4 + 3] >> 6)
        for i in cutlass.range_constexpr(len(fmt.SAME_ROW_LANE_MASKS)):
            s = s + cute.arch.shuffle_sync_bfly(s, offset=fmt.SAME_ROW_LANE_MASKS[i])
        rows[r] = s
    return rows


@cute.jit
def early_scales(tidx, stripe, mXScale: cute.Tensor, mWScale: cute.Tensor, e1: Int32, e2: Int32, e3: Int32):
    """(x's scale, the row's segment scale) for the stripe's 16 storing threads, loaded
    where this is called (after the PDL wait: x's scale is the previous kernel's) by loads
    with side effects, so that neither LLVM nor ptxas sinks them to their use after the
    reduction's barrier; zero in the other threads."""
    x_scale = Float32(0.0)
    w_scale = Float32(0.0)
    if tidx < fmt.TILE_N:
        seg = segment_of(stripe * fmt.TILE_N + tidx, e1, e2, e3)
        x_scale = u32_as_f32(load_here(mXScale.iterator.toint()))
        w_scale = u32_as_f32(load_here(mWScale.iterator.toint() + Int64(seg) * 4))
    return x_scale, w_scale


@cute.jit
def store_stripe(acc: cute.Tensor, xsum: Int32, red: cute.Tensor, warp, warps, lane, tidx, stripe, mXScale: cute.Tensor,
                 mWScale: cute.Tensor, mOut: cute.Tensor, e1: Int32, e2: Int32, e3: Int32, raw: cutlass.Constexpr,
                 scales=None):
    """A GEMV CTA's end, from each lane's accumulators and activation sum: the +2 code
    offset (``sum(w x) = sum(c x) - 2 sum(x)``, before the fold), the fold, the warps' row
    sums through ``red`` (16 rows x ``warps``: an int, or a launch argument) and the
    stripe's 16 scaled outputs.  ``scales``: the storing threads' (x's scale, the row's
    scale), loaded before (``early_scales``), else they are loaded here."""
    for r in cutlass.range_constexpr(fmt.ROWS_PER_CHUNK):
        acc[r * fmt.DECODE_STEPS] = acc[r * fmt.DECODE_STEPS] - fmt.CODE_OFFSET * xsum
    rows = fold_rows(acc)
    if (lane & sum(fmt.SAME_ROW_LANE_MASKS)) == 0:  # lanes 0, 1, 4, 5: chunks 0, 1, 4, 5 = rows 0, 4, 8, 12
        base = fmt.chunk_row(lane % fmt.CHUNKS_PER_TILE)
        for r in cutlass.range_constexpr(fmt.ROWS_PER_CHUNK):
            red[base + r, warp] = rows[r]
    cute.arch.sync_threads()
    if tidx < fmt.TILE_N:
        total = Int32(0)
        if cutlass.const_expr(isinstance(warps, int)):
            for w in cutlass.range_constexpr(warps):
                total = total + red[tidx, w]
        else:
            for w in cutlass.range(warps, unroll=1):
                total = total + red[tidx, w]
        row = stripe * fmt.TILE_N + tidx
        if cutlass.const_expr(scales is None):
            store_out(mOut.iterator.toint(), Int64(row), total, Float32(mXScale[0]),
                      segment_scale(mWScale, row, e1, e2, e3), raw)
        else:
            store_out(mOut.iterator.toint(), Int64(row), total, scales[0], scales[1], raw)


# --------------------------------------------------------------------------------------
# The kernel
# --------------------------------------------------------------------------------------


MAX_UNROLL = 16  # (the shipped configurations unroll 4-8; the bound keeps a hand-edited tuning table sane)


@dataclass(frozen=True)
class GemvConfig:
    """Compile-time configuration: 16-byte weight loads in flight per lane."""

    unroll: int = 4
    raw: bool = False  # store the int32 sums instead of the scaled bf16 output
    # programmatic dependent launch: the CTA's weight stripe is fetched to L2 while the
    # previous kernel drains; x is read (and out written) after griddepcontrol.wait
    pdl: bool = False
    # with pdl: the first batch of weight loads also lands in registers before the wait
    # (pays when the CTAs are resident early, in one wave; ptxas's register count changes)
    pin: bool = False
    # sm_90a only: each CTA takes its whole weight stripe into shared memory with one bulk
    # copy (``kernels_sm90.bitnet_gemv.BitnetGemvBulk``, compiled per K; ``unroll`` and
    # ``pin`` do not apply)
    bulk: bool = False
    # with bulk: x too through shared memory (one bulk copy after the wait) instead of
    # registers, and the group loop rolled, so the CTAs are lighter still and more of them
    # fit an SM
    stage_x: bool = False
    # with pdl: the storing threads load x's scale and their row's segment scale right after
    # the PDL wait (into registers, beside x's loads) instead of after the warps'
    # reduction, where the loads put a global round trip between the sums and the stores
    early_scales: bool = False

    def __post_init__(self):
        if isinstance(self.unroll, bool) or not isinstance(self.unroll, int) or not 1 <= self.unroll <= MAX_UNROLL:
            raise ValueError(f"GemvConfig: unroll must be an integer in [1, {MAX_UNROLL}], got {self.unroll!r}")
        if self.stage_x and not self.bulk:
            raise ValueError("GemvConfig: stage_x applies to the stripe kernel (bulk=True) only")
        if self.early_scales and not self.pdl:
            raise ValueError("GemvConfig: early_scales loads the scales after the PDL wait (pdl=True) only")

    @property
    def loads_scales_early(self) -> bool:
        """Whether the kernel loads the scales after the PDL wait: ``early_scales`` asked for and
        scales applied (raw sums take none)."""
        return self.early_scales and not self.raw


# A100: 4 loads of 16 bytes per lane (2 KB per warp) in flight cover the ~1.5 TB/s x
# ~600 ns latency product with the ~30 warps per SM that 48 registers allow.
SM80 = GemvConfig(unroll=4)


def config_for(n: int, k: int, sms: int) -> GemvConfig:
    """The GEMV configuration for an (N, K) problem on Ampere: one for all shapes."""
    return SM80


def launch_size(cfg: GemvConfig, n: int, k: int, sms: int) -> int:
    """The kernel's last argument for an (N, K) problem: warps per CTA."""
    return warps_for(k, cfg.unroll)


def warps_for(k: int, unroll: int) -> int:
    """Warps per CTA for a given K: about ``unroll`` groups per warp, at most MAX_WARPS."""
    groups = k // fmt.GROUP_K
    iters = -(-groups // (MAX_WARPS * unroll))
    return max(1, -(-groups // (unroll * iters)))


class BitnetGemv:
    """``out[0, n] = bf16(sum_k x[0, k] * W[n, k] / x_scale * w_scale[segment(n)])``.

    Arguments (TVM-FFI, torch tensors): ``x`` int8 [1, K], ``w`` int8 [N, K/4] (packed),
    ``x_scale`` fp32 [1], ``w_scale`` fp32 [S], ``out`` bf16 [1, N], then the segment
    ends ``e1, e2, e3`` and the warp count (ints).
    """

    def __init__(self, cfg: GemvConfig):
        self.unroll = cfg.unroll
        self.raw = cfg.raw
        self.pdl = cfg.pdl
        self.pin = cfg.pin and cfg.pdl
        self.early_scales = cfg.loads_scales_early

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,
        mW: cute.Tensor,
        mXScale: cute.Tensor,
        mWScale: cute.Tensor,
        mOut: cute.Tensor,
        e1: Int32,
        e2: Int32,
        e3: Int32,
        warps: Int32,
        stream,
    ):
        n = mW.shape[0]
        self.kernel(mX, mW, mXScale, mWScale, mOut, e1, e2, e3, warps).launch(
            grid=[fmt.stripes(n), 1, 1],
            block=[warps * WARP, 1, 1],
            # the block size is a launch argument: bound it so ptxas may use up to 128
            # registers (it assumes 1024 threads, i.e. 64 registers, otherwise, and then
            # sinks the loads next to their uses instead of keeping them all in flight)
            max_number_threads=[MAX_WARPS * WARP, 1, 1],
            stream=stream,
            use_pdl=self.pdl,
        )

    @cute.kernel
    def kernel(
        self,
        mX: cute.Tensor,
        mW: cute.Tensor,
        mXScale: cute.Tensor,
        mWScale: cute.Tensor,
        mOut: cute.Tensor,
        e1: Int32,
        e2: Int32,
        e3: Int32,
        warps: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        stripe, _, _ = cute.arch.block_idx()
        warp = tidx // WARP
        lane = tidx % WARP
        q = lane % fmt.CHUNKS_PER_TILE
        tile = lane // fmt.CHUNKS_PER_TILE

        row_bytes = mW.shape[1]  # K / 4
        groups = row_bytes // (fmt.GROUP_BYTES // fmt.TILE_N)  # K / 128
        # This lane's 16 bytes of every group, and its 16 activation bytes.
        w_lane = mW.iterator.toint() + Int64(stripe) * Int64(row_bytes * fmt.TILE_N) + Int64(lane * fmt.CHUNK_BYTES)
        x_lane = mX.iterator.toint() + Int64(tile * fmt.TILE_K + fmt.chunk_khalf(q) * fmt.CHUNK_K)

        smem = cutlass.memory.SmemAllocator()
        red = smem.allocate_tensor(Int32, fmt.make_row_sums_layout(MAX_WARPS), 16)

        if cutlass.const_expr(self.pdl):
            # the next kernel's CTAs may take our SMs as soon as ours retire
            cute.arch.griddepcontrol_launch_dependents()
        acc = cute.make_rmem_tensor((fmt.ROWS_PER_CHUNK * fmt.DECODE_STEPS,), Int32)
        acc.fill(0)
        xsum = cute.make_rmem_tensor((1,), Int32)
        xsum.fill(0)
        if cutlass.const_expr(self.pdl):
            # The weights never depend on the previous kernel: L2 fetches this CTA's whole
            # stripe while that kernel drains (the wait below gates the activations only).
            stripe_first = mW.iterator.toint() + Int64(stripe) * Int64(row_bytes * fmt.TILE_N)
            prefetch_run_l2(stripe_first, row_bytes * fmt.TILE_N, tidx, warps * WARP)
        # Groups warp, warp + W, ...: batches of `unroll` loads issued before any is used.
        # The last batch is padded with the warp's last group again: that re-read hits L2,
        # and its activation words are zeroed, so it adds nothing to either sum.
        mine = (groups - warp + warps - 1) // warps
        batches = (mine + self.unroll - 1) // self.unroll
        if cutlass.const_expr(self.early_scales):  # (set in the first batch, after the wait)
            x_scale, w_scale = Float32(0.0), Float32(0.0)
        for it in cutlass.range(batches, unroll=1):
            wv = []
            xv = []
            keep = []
            grps = []
            for u in cutlass.range_constexpr(self.unroll):
                j = it * self.unroll + u
                grps.append(cutlass.min(j, mine - 1) * warps + warp)
                keep.append(cutlass.select_(j < mine, Int32(-1), Int32(0)))
                wv.append(load_v4(w_lane + Int64(grps[u]) * fmt.GROUP_BYTES, True))
            if cutlass.const_expr(self.pdl):
                if it == 0:
                    if cutlass.const_expr(self.pin):
                        wait_holding(xor_words(wv), w_lane)  # the weights in registers first
                    else:
                        cute.arch.griddepcontrol_wait()
                    if cutlass.const_expr(self.early_scales):
                        x_scale, w_scale = early_scales(tidx, stripe, mXScale, mWScale, e1, e2, e3)
            for u in cutlass.range_constexpr(self.unroll):
                xv.append(load_v4(x_lane + Int64(grps[u]) * fmt.GROUP_K, False, self.pdl))
            for u in cutlass.range_constexpr(self.unroll):
                x = tuple(xv[u][i] & keep[u] for i in range(4))
                xsum[0] = add_byte_sums(x, xsum[0])
                accumulate_words(wv[u], x, acc)

        store_stripe(acc, xsum[0], red, warp, warps, lane, tidx, stripe, mXScale, mWScale, mOut, e1, e2, e3, self.raw,
                     (x_scale, w_scale) if cutlass.const_expr(self.early_scales) else None)


def compile_gemv(cfg: GemvConfig, options: str):
    """Compile for every (N, K) with N % 16 == 0 and K % 128 == 0 (symbolic sizes)."""
    return cute.compile(BitnetGemv(cfg), *matmul_fake_args(cfg.raw, tokens=1), options=options)
