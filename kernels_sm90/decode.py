"""Split-KV decode attention over a packed low-bit KV cache on Hopper (sm_90a).

One CTA = (split, KV head, sequence), warpgroups with fixed roles:

* **producer** (warpgroup 0, registers given back with ``setmaxnreg``): one warp walks the
  split's packed tiles and, per tile, issues a TMA tensor load of the packed K rows and of
  the packed V rows (into the 16-byte-granule swizzle ``layouts.sm90`` reads them with) and
  two bulk copies of their (scale, zero) words, all completing on the stage's mbarrier of a
  ``cutlass.pipeline.PipelineTmaAsync`` ring;
* **consumer** (warpgroup 1; with ``consumers`` > 1, warpgroups 1 .. on alternate tiles of
  the split, merged at the end): dequantizes each stage in registers and runs both products
  on ``wgmma`` with the dequantized operand read from registers (RS)::

      S^T = K . Q^T    A = K   (64 tokens x 16 channels per wgmma, registers), B = Q  (smem)
      O^T = V^T . P^T  A = V^T (64 channels x 16 tokens, registers),           B = P  (smem)

  With K per channel in groups of at least 64 tokens (``fold_k``, fp16) K holds its exact
  (centered) codes and Q carries K's scale: the producer warpgroup writes Q o s and the
  per-head bias Q . (zero + center s) of each K group into the stage (``scale_stage``):
  all four warps, warp 0 between its TMA issues (``produce_and_scale``).
  With V groups of at least 64 channels (``fold_v``) V^T holds V's exact (centered)
  codes and P^T carries V's per-token scale, one P^T copy per V group, while V's zero
  points reach O through per-head sums of P times zero: V costs one lop3 and one exact fma
  per pair instead of two fmas and its params in fragment order.  fp16 2-bit V goes one
  step further (``v_subnormal``): its raw codes as fp16 subnormals, the lop3 alone, with
  1 / mult in P^T and each product folded into O times 2^24.
  The SS form of the second product, V^T dequantized by the producer warpgroup into
  shared memory with stmatrix (``v_slots``), is built and tested but not the default: at
  two CTAs an SM its 32 KB V^T tiles leave the ring two stages, and with three the
  producer's dequantization still trails the consumers (H200, 2c128 B=16 N=64K: 363 us
  against 267 RS; profiles/NOTES.md, thirty-fifth session).
  The query heads that share the KV head are the N = 8 (or 16) side, so GQA wastes no MMA
  rows on padding queries, and the wgmma RS A fragment of warp ``w`` is the m16n8k16 A
  fragment of rows ``16 w ..`` (``layouts.sm90.wgmma_fragment``): the lop3 dequant of the
  sm80 path produces it unchanged.  Warp ``w`` of the consumer dequantizes rows
  ``64 m + 16 w .. + 15`` of M-block ``m`` of K (tokens) and of V (channels), loading each
  16-row slab with ldmatrix x4 over two 16-byte chunks (the A-operand copy of m16n8k16).

Softmax is online over the whole warpgroup: the four warps hold different tokens of a
step, so a common per-head maximum needs an exchange through shared memory.  Packed steps
take P against the running maximum as it stands while no logit passes it by more than a
small margin, which the warpgroup learns from one barrier that ORs every thread's verdict
(``lazy_softmax``); only then are the maxima exchanged (shuffles, shared slots, a second
barrier) and O rescaled.  P^T goes to shared memory for the second product (a proxy fence
and a named barrier); the O^T accumulators are split by channels and need no merge.
The consumer is software-pipelined with one wgmma group in flight at a time: the S wgmma
of a step runs while V is dequantized, and its P·V wgmma while the K of the next step
(the next stage's, across tiles) is dequantized.  Each P·V lands in its own accumulator,
folded into O in fp32 before the next S is issued (summed inside the tensor core over a
million tokens, O drifted).  Two wgmma groups are never in flight together: that made
ptxas serialize every wgmma of the kernel (warning C7514, checked by the PTX test), and
V^T registers are rewritten only after the P·V that reads them has landed.
The 16-bit residual block (``len % Nr`` tokens) is the last tile, in 64-token sub-tiles
read from the (by then idle) stage buffers; a format's 16-bit sink tokens (the first
``sinks`` of the sequence) are more such sub-tiles, attended by split 0.  The output of a
split is the fp32 partial O and its LSE, merged by the combine kernel or, with
``merge_splits`` (integer 4-bit's kernels: ``backend.merges_in_kernel``), by the last CTA of
the (sequence, KV head) to finish (``merge_if_last``); one split writes O in the model dtype.
"""

# no `from __future__ import annotations`: @cute.struct reads its field annotations as objects
import math
import operator
from typing import Optional, Type

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, Uint32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from ..kernels_sm80 import ptx
from ..kernels_sm80.copy import copy_rows, load_a_fragment_blocks, load_a_fragments
from ..kernels_sm80.decode import PackedDecodeConfig, query_views
from ..kernels_sm80.dequant import (E2M1Dequant, WordDequant, broadcast_params, fp4_scale_pair, half2_bits,
                                    split_params)
from ..kernels_sm80.reduce import across_lanes, across_rows
from ..kernels_sm80.tensors import (assume_aligned, first_page, page_of, split_coords, split_tiles,
                                    wait_for_previous_kernel)
from ..layouts import packing, resources, sm80, sm90, sm100
from ..layouts.packing import LN_2
from . import ptx90
from .rings import seq_state

WG = sm90.WARPGROUP_THREADS
WARPS = sm90.WARPGROUP_WARPS
M_BLOCK = sm90.WGMMA_M  # rows of one wgmma: tokens of S^T, channels of O^T
K_BLOCK = sm90.WGMMA_K  # = sm80.MMA_SHAPE[2]: tokens of a V params row, channels of a K k-block
assert K_BLOCK == sm80.MMA_SHAPE[2]
SLAB = sm90.WARP_SLAB_ROWS  # rows of one warp in an M-block
# Registers per thread after setmaxnreg: a CTA enters with its share of the register file
# (the cap ``min_blocks_per_mp`` sets) and the producer warpgroup, which needs few, hands
# the rest to the consumers.
PRODUCER_REGS = {1: 40, 2: 40, 3: 24}
# With ``fold_k`` the producer warpgroup also scales Q by K's per-channel scales for each
# stage (four (scale, zero) words, two Q pairs and three fp32 sums a thread)
SCALER_REGS = 56
# ... and with ``v_slots`` dequantizes V^T too (ptxas spilled at 56 and 72 registers), on
# all its warps but the one that issues the TMA loads
VT_SCALER_REGS = 88
V_DECODERS = WARPS - 1
SMEM_BUDGET = 192 * 1024  # of the 227 KB an SM has: what the stage rings of its CTAs may take
# log2 units a logit may pass the running maximum by before the warpgroup exchanges maxima
# (``lazy_softmax``): P then stays below 4 (H200: 2 skips nearly every exchange)
LAZY_MARGIN = 2.0
# ``v_subnormal``: mantissa bits above a 2-bit code's own that its offset may take (the
# default of ``v_sub_room``): 2 gives mult 1 or 4 and a shift every two pairs; 0 gives mult 1
# and a shift every pair (P^T as fp16's underflow takes it with centered codes)
V_SUB_ROOM = 2
# ``v_subnormal``: a packed P V product's factor into O (the subnormal codes' 2^-24)
V_SUB_FOLD = float(2 ** packing.SUBNORMAL_LOG2["fp16"])
# ``v_subnormal=None`` takes the subnormal V codes wherever they apply only with this set.
# Off: the zero sums' present form (``subnormal_factors``, centered in the zero sums) with
# room 2 misses the 1M-token test's tolerance with K per token (H200, fortieth session:
# 0.00214 against 0.00206 at one split); room 0 passes but was slower at B=16 (2c128 N=64K:
# 263.5 centered, 257.9 room 2, 272.6 room 0 us; profiles/h200/variants_v_subnormal_center.json).
# The form the H200 measured first (thirty-seventh session) dropped whole tokens whose P^T
# underflowed (flat V tokens of large offset).
V_SUBNORMAL_AUTO = False
# ``k_shift``: the B tile's rows stay under 2^K_SHIFT_LOG2, fp16's largest power of two (its
# exponent bias), so their rounding to fp16 cannot reach infinity
K_SHIFT_LOG2 = packing.EXP_BIAS["fp16"]


def dot2(a, b):
    """``a . b`` of two fp32 pairs."""
    return a[0] * b[0] + a[1] * b[1]


class Barrier:
    """Named barriers (id 0 is __syncthreads): three per consumer warpgroup (consumer ``c``
    uses ``MAX + PER_CONSUMER c`` ..), then two of the whole CTA after the last consumer's."""

    MAX = 1  # the step's lazy verdict is in (bar.red), or its per-warp maxima are in shared memory
    P = 2  # P^T of a step is in shared memory (and the previous PV product is done)
    EPI = 3
    PER_CONSUMER = 3

    @staticmethod
    def q(consumers: int) -> int:
        """Q is in shared memory: the consumers arrive (several consumers: sync), the scalers
        (``fold_k``) wait."""
        return 1 + Barrier.PER_CONSUMER * consumers

    @staticmethod
    def done(consumers: int) -> int:
        """Consumers 1 .. left their partial softmax state for consumer 0 (and the rings)."""
        return 2 + Barrier.PER_CONSUMER * consumers


@cute.jit
def zero_shared(t: cute.Tensor, tid, threads: cutlass.Constexpr[int]):
    """Zeroes all of shared tensor ``t`` (its whole cosize, swizzled or not), ``threads``
    threads from ``tid``."""
    flat = cute.make_tensor(t.iterator, cute.make_layout(cute.cosize(t.layout)))
    for i in cutlass.range(tid, cute.cosize(t.layout), threads, unroll=1):
        flat[i] = t.element_type(0.0)


def pair_word(tile, row, col, value=None):
    """The 32-bit word of elements ``(row, col)``, ``(row, col + 1)`` of a 16-bit smem tile
    (``col`` even): read it, or with ``value`` write it.  Two 16-bit accesses through the
    tile's own (swizzled) layout: a 32-bit recast of a swizzled slice addressed the wrong
    words."""
    pair = cute.make_rmem_tensor((2,), tile.element_type)
    word = cute.recast_tensor(pair, Uint32)
    if value is None:
        pair[0] = tile[row, col]
        pair[1] = tile[row, col + 1]
        return Uint32(word[0])
    word[0] = value
    tile[row, col] = pair[0]
    tile[row, col + 1] = pair[1]


def log2_nibbles(mults) -> int:
    """Powers of two ``mults`` as one run-time table: log2 of ``mults[i]`` in bits 4 i .. 4 i + 3."""
    return sum((m.bit_length() - 1) << 4 * i for i, m in enumerate(mults))


def nibble(table: int, index):
    """Entry ``index`` (traced) of a ``log2_nibbles`` table."""
    return (Uint32(table) >> Uint32(4 * index)) & Uint32(0xF)


def default_ctas_per_sm(head_dim: int) -> int:
    """CTAs one SM holds by default: two up to head_dim 128 (registers: 128 per thread at
    entry), one for 256 (its consumers need 240 registers)."""
    return 2 if head_dim <= 128 else 1


class DecodeSm90(PackedDecodeConfig):
    """Packed-cache decode attention, warp-specialized TMA + wgmma; constexpr config here."""

    merge_ahead = 16  # (the merging consumer warpgroup holds 240 registers: one round trip for 16 splits)

    def __init__(self, dtype: Type[cutlass.Numeric], bits: int, k_mode: str, group_size: int,
                 head_dim: int, heads_tile: int, split: bool, num_stages: int = 0, step: int = 0,
                 ctas_per_sm: int = 0, pdl: bool = False, sinks: int = 0, v_bits: int = 0, tq: int = 1,
                 fold_v: bool = True, fp4: Optional[str] = None, fold_k: bool = True, lazy_max: bool = True,
                 raw_k_all: bool = True, consumers: int = 0, half_cols: bool = False, fold_k_bf16: bool = True,
                 append: bool = False, v_slots: int = 0, v_subnormal: Optional[bool] = None,
                 v_sub_room: int = V_SUB_ROOM, early_tiles: bool = False, early_loads: bool = False,
                 early_residual: bool = False, wide_boxes: bool = sm90.WIDE_BOXES,
                 merge_splits: bool = False):
        super().__init__(dtype, bits, k_mode, group_size, head_dim, heads_tile, split, pdl, sinks, v_bits, tq, fp4,
                         append, merge_splits)
        # V's per-token (scale, zero) folded into P (``store_p``): the P V product takes V's
        # exact codes, so V^T costs no scale fma and no param loads in fragment order.  Needs
        # each 64-channel M-block of O^T inside one V group (groups of >= 64 channels): P^T
        # is scaled once per group into its own buffer.  The codes are centered (code -
        # 2^(bits-1), the zero moved by as many scales): with raw codes the products and
        # the zero sums both grow like the zero point and cancel in O, which lost precision
        # over a 2^20-token split (H200: 0.0119 against a 0.0024 tolerance).
        self.fold_v = fold_v and group_size >= M_BLOCK
        # K per channel with groups of >= 64 tokens (every 64-token M-block of S^T inside one
        # group): K's scale goes into Q instead of into every K element,
        #   S = (Q o s) . (code - center) + Q . (zero + center s)   (per head, per group),
        # so the scores' wgmma takes K's exact centered codes (one lop3 and one exact fma per
        # pair, no params in fragment order), against a Q o s copy per group of the tile; the
        # per-head bias goes into the softmax's scaling fma.  The producer warpgroup
        # (``produce_and_scale``) builds both for each stage as it lands, off the consumer's
        # chain.  bf16 kernels fold too (``fold_k_bf16``), with the scores' operands in fp16
        # (``s_dtype``): K's exact lop3 halves, and Q o s / mult rounded from fp32 to fp16 (11
        # bits; in bf16, 8 bits shared by every token of the group, it doubled the error,
        # eleventh session).  A CPU model on stored codes (twenty-fourth session,
        # profiles/NOTES.md) put these scores 8-14x closer to exact arithmetic than bf16 K per
        # element; ``k_shift`` keeps Q o s within fp16's range.  H200, 4c128 bf16 GQA 4, us,
        # without / with (profiles/h200/variants_fold_bf16.json): B=4 N=64K 98.1 / 94.5, B=8
        # 183.8 / 175.0, B=16 349.0 / 331.7 (B=1: the small grid's kernel, which keeps K's
        # scale out of Q either way).
        self.fold_k = fold_k and self.k_channel and group_size >= M_BLOCK and not fp4 and (
            not self.is_bf16 or fold_k_bf16)
        # With K's scale in Q the producer warpgroup scales each stage from Q, which the
        # consumers load after the sequence length: a global round trip before the barrier
        # that publishes it.  ``early_tiles`` issues the first ``lag`` tiles (which need no
        # Q) before that barrier, so their loads run under Q's instead of after it (no
        # effect without ``fold_k``; the host takes it for 2-bit's small grid:
        # ``kernels_sm90.backend.EARLY_ISSUE`` has the measurements)
        self.early_tiles = early_tiles
        # Every kernel's first tile waits on two dependent global loads before its TMA
        # issue (the sequence length, which places the split's first tile, then that
        # tile's block-table entry), and the consumers issue Q's copy only once the length
        # is in.  ``early_loads`` issues both address-independent loads right after the PDL
        # wait, beside the length's: Q's cp.async by the consumers, and the sequence's first
        # block-table entry, which every tile of an unpaged cache (one page a sequence) and
        # the first page's tiles of a paged one then take instead of reading the table
        # (``page_of``'s ``first``).  One global round trip less before the first tile's loads, and
        # Q's under the length's (the host takes it for the small grids:
        # ``kernels_sm90.backend.EARLY_ISSUE``)
        self.early_loads = early_loads
        # the scores' wgmma operand type: fp16 wherever K's scale is in Q, else the model's
        self.s_dtype = cutlass.Float16 if self.fold_k else dtype
        self.s_bf16 = self.s_dtype is cutlass.BFloat16
        # bf16 Q and scales may take Q o s past fp16's range: each (head, K group) row of the
        # B tile is scaled by 2^-e, the smallest power that keeps its largest magnitude under
        # 2^K_SHIFT_LOG2 (e = 0 wherever |q s| stays below 32768), and the scaling
        # fma takes 2^e back with the softmax scale (``scale_row_shifted``)
        self.k_shift = self.fold_k and self.is_bf16
        self.q_copies = self.nr // group_size if self.fold_k else 0
        self.k_center = 1 << (bits - 1) if self.fold_k else 0
        # ... and with 4-bit K not even the exact fix-up: the scores take the lop3 halves
        # t = 1024 + code * mult themselves (mult 1 for a fragment's columns 2c, 2c + 1, 16
        # for 2c + 8, 2c + 9), Q o s / mult is the B tile, and the offset goes into the bias:
        #   S = sum (Q o s / mult) t - sum (Q o s / mult)(1024 + center mult) + Q . (zero + center s)
        # 2-bit words spread a column half over five multipliers, which depend on the k-block's
        # place in its word (``k_mult[kb][half]``, the pair ``2 kb + half`` of the word):
        # ``raw_k_all`` takes the lop3 halves there too, each scaler thread picking its
        # k-block's multiplier at run time (H200, sixteenth session: 1-3.5 % faster at 2c128,
        # same error; Q o s / 256 may reach fp16's subnormals, whose absolute step, 2^-24,
        # times a half of at most 1792 stays under 1.1e-4 per product), else they keep the
        # exact fix-up
        steps = packing.dequant_steps(bits, "fp16")
        mults = tuple(tuple(steps[2 * kb + half].mult for half in range(2)) for kb in range(self.kpw_k))
        self.k_mult_uniform = len(set(mults)) == 1  # 4-bit: (1, 16) in every k-block
        self.raw_k = self.fold_k and (self.k_mult_uniform or raw_k_all)
        self.k_mult = mults if self.raw_k else ((1, 1),) * self.kpw_k
        # log2 of k_mult[kb][half], nibble 2 kb + half: the scalers' run-time lookup
        self.k_mult_log2 = log2_nibbles([self.k_mult[kb][h] for kb in range(self.kpw_k) for h in range(2)])
        self.k_offset = packing.MAGIC_VALUE["fp16"]
        # the producer threads that scale one head (a quad of lanes per k-block), and the
        # k-blocks each of them takes: (16, 1) at head dim 64, (32, 1) at 128, (32, 2) at 256
        lanes = min(resources.WARP, head_dim // 4)
        self.scale_lanes = (lanes, head_dim // 4 // lanes)
        self.p_copies = self.groups_v if self.fold_v else 1
        # Packed steps take P against the running maximum as it stands while no logit passes
        # it by more than ``lazy_margin`` (log2 units), and exchange the maxima across the
        # four warps (a named barrier, shuffles, shared-memory reads on every step's chain)
        # only when one does (``lazy_softmax``).  With V's scale in P^T (``fold_v``, fp16) the
        # margin must keep P^T finite: 2^margin times V's largest scale, 2 fp16_max / (2^bits
        # - 1), stays under fp16_max for a margin below log2((2^bits - 1) / 2); the largest
        # half-unit step below it is 2.5 at 4 bits (LAZY_MARGIN's 2 stands), 0.5 at 2 bits.
        self.lazy_max = lazy_max
        self.lazy_margin = LAZY_MARGIN
        if self.fold_v and not self.is_bf16:
            room = math.log2((2 ** self.v_bits - 1) / 2)
            self.lazy_margin = min(LAZY_MARGIN, math.ceil(2 * room) / 2 - 0.5)
        # V^T's 2-bit codes as fp16 subnormals (``v_subnormal``; None: wherever it applies,
        # once ``V_SUBNORMAL_AUTO`` is set).
        # With ``fold_v`` every V pair cost a lop3 and an exact fma (the magic exponent's and
        # the center's fix-up).  With no magic exponent the lop3 alone gives (code << offset)
        # 2^-24 exactly (fp16 subnormals: wgmma takes them unflushed, H200); ``store_p`` folds
        # 1 / mult (2^-offset, offsets 0 or ``v_sub_room``) into P^T beside V's scale, and each
        # packed product enters O times 2^24 (``fold``; the residual's and the sinks' 16-bit
        # products unscaled).  The product takes the raw codes and the zero sums take the
        # center back out (``subnormal_factors``).  Only fp16: bf16's subnormals sit at
        # 2^-133, whose 2^133 fold fp32 cannot hold.  Measured with an earlier form of the
        # zero sums (P' times the zero; a cvt, a select and an fma a value, as now a cvt and
        # two fmas): H200, fp16 GQA 4, us, without / with (profiles/h200/variants_v_subnormal_consistent
        # .json, one run): 2c128 B=1 N=4K 13.57 / 13.38, N=128K 46.02 / 43.87, B=16 N=64K
        # 262.3 / 259.1; K4V2 g128 14.91 / 14.78, 53.20 / 52.53, 297.8 / 295.5.
        applies = self.fold_v and not self.is_bf16 and self.v_bits == 2 and not fp4 and not v_slots
        if v_subnormal and not applies:
            raise ValueError("v_subnormal needs fp16, 2-bit V with its scale in P (fold_v), no FP4 and no v_slots")
        self.v_subnormal = applies and V_SUBNORMAL_AUTO if v_subnormal is None else v_subnormal
        # the center V's zero sums carry (``store_p``); the codes come centered by it unless
        # they are subnormal (``v_dequant``: the zero sums then take it back out)
        self.v_center = 1 << (self.v_bits - 1) if self.fold_v else 0
        self.v_mult_log2 = 0  # log2 of V pair p's mult, nibble p (``v_subnormal``)
        self.v_sub_room = v_sub_room if self.v_subnormal else 0
        if self.v_subnormal:
            if v_sub_room not in (0, V_SUB_ROOM):
                raise ValueError(f"v_sub_room must be 0 or {V_SUB_ROOM}, got {v_sub_room}")
            steps = packing.dequant_steps(self.v_bits, "fp16", self.v_bits + v_sub_room, True)
            self.v_mult_log2 = log2_nibbles([s.mult for s in steps])
            assert {s.mult for s in steps} <= {1, 1 << v_sub_room}  # (store_p picks one of the two)
        # tokens of one softmax step: the registers of its K and V^T fragments (and, with 16
        # head columns, of its accumulators) bound it.  128 halves the per-step chain (the
        # S wait, the lazy verdict's barrier, P's store, fence and barrier) per token: 2-bit K
        # per channel took 64 until K's scale went into Q and the maximum became lazy, then
        # measured 3-12 % faster at 128 (H200, fifteenth session,
        # profiles/h200/variants_2bit_step.json: groups 64 and 128, fp16 and bf16)
        # (NVFP4 at head dim 128: its 16-channel block scales spill 24 bytes at 128, which
        # measured 1.7 % faster all the same at B=16 N=64K on the H200; kept spill-free;
        # 2-bit K per token and mixed widths were never timed at 128 and keep 64)
        self.step = step or (128 if bits == self.v_bits and (bits == 4 or self.k_channel) and head_dim <= 128
                             and heads_tile == 8 and not (fp4 == "nvfp4" and head_dim > 64) else 64)
        self.steps = self.nr // self.step
        self.m_k = self.step // M_BLOCK  # M-blocks of S^T per step
        self.m_v = head_dim // M_BLOCK if head_dim >= M_BLOCK else 1  # M-blocks of O^T
        assert head_dim % M_BLOCK == 0, "head_dim must be a multiple of 64"
        # bytes one stage's TMA and bulk copies bring (the mbarrier's transaction count)
        self.tx_bytes = self.bytes_kp + self.bytes_vp + 4 * (self.words_ks + self.words_vs)
        # Consumer warpgroups of a CTA: with several, consumer c takes the split's tiles c,
        # c + consumers, .. from the one ring (its own softmax state, P^T tile and named
        # barriers) and consumer 0 merges the others' partial state at the end (``merge``).
        # Two in one CTA an SM, against two CTAs of one, for 2-bit with K's scale in Q: 1.4-6 %
        # faster at every shape measured (H200, 2c128 fp16, B=1 N=4K-128K, B=8 / 16 N=64K,
        # profiles/h200/variants_consumers.json); 4-bit lost 14 % at B=8 and 16 that way (one
        # warpgroup of scalers for both consumers), and three consumers at 64-token steps
        # (152 registers each) were slower still (profiles/NOTES.md, twenty-first session)
        # GQA groups of at most four query heads (one query token) fill columns 0..3 of the
        # N = 8 tile only, which quad lanes 0 and 1 hold: with ``half_cols`` quad lanes 2 and 3
        # take the second row (g + 8) of their partner's (quad lane - 2) values by one shuffle
        # a value (``gather_rows``) instead of running the softmax on padding, so every thread
        # scales, exponentiates, sums and stores half as many values (the 4-bit loop's SASS:
        # 548 -> 500 instructions a tile).  H200, one run (profiles/h200/variants_half_cols.json,
        # GQA 4, fp16, us, half / full): 4c128 B=8 N=64K 168.6 / 176.0, B=16 319.5 / 332.4;
        # 2c128 144.5 / 148.0, 272.7 / 280.1; B=1 level (4K-128K within +-1 %)
        assert not half_cols or (heads_tile == 8 and tq == 1), "half_cols: 8-head tiles of one query token"
        self.half_cols = half_cols
        if consumers == 0:
            # (the sm90 backend passes one for 2-bit with the 4-head tile at head dim 128, and
            # two again for fp16's small grids: ``kernels_sm90.backend.grid_keywords``)
            consumers = 2 if self.fold_k and bits == self.v_bits == 2 and head_dim <= 128 else 1
        assert 1 <= consumers and Barrier.done(consumers) < 16, "named barriers: at most four consumers"
        self.consumers = consumers
        self.ctas_per_sm = ctas_per_sm or (1 if consumers > 1 else default_ctas_per_sm(head_dim))
        # V^T through shared memory (the SS form of the P V product, ``v_slots`` > 0): the
        # producer warpgroup, which visits every stage for Q o s already, also decodes the
        # stage's V codes (the consumers' ``v_block`` sequence) and stores them with stmatrix
        # into one of ``v_slots`` K-major V^T tiles (channels x tokens, ``stage_v``); the
        # consumers' P V wgmma reads A from there, so V's ldmatrix, lop3 and centering leave
        # their chain and their V^T registers are freed.  A slot is one softmax step's V^T
        # (32 KB at 128 tokens and head dim 128), handed over by a ``PipelineAsync`` of its
        # own: full once decoded, empty once the consumer's wgmma that read it has landed.
        # Needs the scalers (``fold_k``) and V's scale in P (``fold_v``: codes only).
        # Measured slower everywhere (H200, fp16 GQA 4, us, RS / SS): 2c128 B=16 N=64K 267 /
        # 363 (one slot, three stages; the slots' hand-over alone, no decode, 265), 4c128
        # 314 / 389, 2c128 B=1 N=128K 45.9 / 74.1 (profiles/h200/variants_vss_*.json).
        self.v_slots = v_slots
        self.vt_bytes = head_dim * self.step * sm90.ELEM_BYTES if v_slots else 0
        # With K's scale in Q the producer warpgroup's warp 0 issues tile ``it``, then all four
        # warps wait for tile ``it - lag`` to land and scale it (``produce_and_scale``): the
        # issue waits on the landing, so only about ``lag + 1`` tiles are in flight a CTA
        # (three at B=16's four stages and one consumer: ~51 KB of 4-bit tiles, ~102 KB an SM
        # at two CTAs, which covers ~3.1 us of latency at the H200's 32.6 GB/s an SM).
        # (Warp 0 issuing alone, as far ahead as the free stages let it, while warps 1-3
        # scaled each tile once it had landed, ``free_issue``, measured slower everywhere:
        # H100 +0.1 to +14 %, H200 +0.6 to +15 %, shipped kernels; removed in the
        # sixty-eighth session, profiles/NOTES.md.)
        # ``wide_boxes``: a packed tile's TMA box takes its rows folded into 128-byte ones
        # (``sm90.packed_fold``: two 64-byte rows of 4-bit K at head dim 128 or of a 4-bit V
        # tile, four 32-byte rows of 2-bit K) with the 128-byte swizzle on the ring, so a
        # stage's codes reach L2 as 128-byte requests instead of 64- or 32-byte ones.  With
        # the narrow boxes the decode's ring asked L2 for 57 % more requests than a bare ring
        # of the same bytes (H100 ncu, fifty-fifth session), and on the H200 it streams at
        # 0.86 of the read rate against the bare ring's 1.03 (fifty-fourth session).  ldmatrix
        # reads the folded rows conflict-free (``sm90.make_packed_smem_layout``).  H100, 4c128
        # / 2c128 B=16 N=64K (ncu, fifty-sixth session): L2 requests 26.4 M -> 17.9 M and
        # 17.8 M -> 9.4 M, the time unchanged (370.6 / 370.6, 263.2 / 265.0 us), B=1 and N=4K
        # within +-1.4 % (profiles/h100/variants_wide_boxes_h100.json), when the wide boxes
        # still cost the consumer loop 3-15 instructions of address arithmetic a tile.  Since
        # ``block_words`` both boxes compile to the same loop, so the wide boxes are the
        # default: fewer L2 requests for the same code.  H100, fp16, us, narrow / wide, three
        # runs (profiles/h100/variants_block_words_mend*_h100.json): 4c128 B=1 N=128K
        # 57.7-58.0 / 56.6-57.0, B=16 N=64K 390.9-400.5 / 387.5-389.9, 2c128 B=16 267.3-267.5
        # / 257.6-258.4, B=1 N=128K 45.6-45.8 / 45.6-45.9, N=4K level; bf16, K4V2 and K per
        # token level or faster, 4t64 bf16 B=1 N=128K 66.3-67.3 / 63.2-63.7
        # (profiles/h100/variants_wide_boxes_formats*_h100.json); the H200 unmeasured.
        self.wide_boxes = wide_boxes
        self.k_fold = sm90.packed_fold(self.nr, 4 * self.wk, wide_boxes)
        self.v_fold = sm90.packed_fold(head_dim, 4 * self.wv, wide_boxes)
        self.k_box = sm90.packed_box(self.nr, 4 * self.wk, wide_boxes)
        self.v_box = sm90.packed_box(head_dim, 4 * self.wv, wide_boxes)
        # the A-fragment register of each dequantized (row half, column half) pair that
        # ``stage_v`` hands to stmatrix (a traced table: read here, before the kernel's trace)
        self.vt_registers = {(h, ch): sm90.a_pair_value(h, ch) // 2 for h in range(2) for ch in range(2)} \
            if v_slots else {}
        if v_slots:
            if not (self.fold_k and self.fold_v and self.p_copies == 1 and not fp4 and self.v_tiles == 1):
                raise ValueError("v_slots needs K's scale in Q (fold_k), V's in P (fold_v) with one V group a "
                                 "row, an integer format and one V tile a stage")
            least = (consumers - 1) * self.steps + 1
            if v_slots < least:
                # A consumer releases a slot at its next step, which for a tile's last step is
                # its next tile's first: that waits for the tile's Q o s, which the scalers
                # commit before they wait for the tile's V^T slots.  From this many slots up,
                # the slot they wait for is never one released only by such a later tile.
                raise ValueError(f"v_slots must be at least {least} with {consumers} consumers and "
                                 f"{self.steps} steps a tile, got {v_slots}")
        stage_smem = self.tx_bytes + self.q_copies * self.nh * head_dim * 2
        budget = SMEM_BUDGET // self.ctas_per_sm - self.v_slots * self.vt_bytes
        if num_stages == 0:
            # four stages measured best on the H200 with one consumer (5 or 8 were slower at
            # B=1; 3 no better); several consumers hold a stage each
            cap = 4 if consumers == 1 else 3 * consumers
            num_stages = max(2, min(cap, budget // stage_smem))
        self.num_stages = num_stages
        # The split that owns the 16-bit residual block reads it after its packed tiles, 64
        # tokens at a time through the idle rings: a global round trip (cp.async, wait,
        # barrier) before each sub-tile's products, on the kernel's last stretch (a 64-token
        # residual added 1.2-1.5 us at B=1 N=4K, 1.0-1.4 with the consumers idle:
        # profiles/h200/variants_ring_b1_short.json).  ``early_residual`` has consumer 0 load
        # the first sub-tile into a buffer of its own right after Q (before its packed
        # tiles), so the first round trip runs under them.  Where that buffer fits beside
        # the rings without fewer stages (the one-CTA-an-SM kernels of small grids); not in
        # the appending kernels, which store the new token into the block at the end (the
        # host takes it for the small grids: ``kernels_sm90.backend.EARLY_ISSUE``)
        self.res_tile = M_BLOCK * head_dim  # values of a residual sub-tile's K (or V) rows
        self.early_residual = early_residual and not append and (
            num_stages * stage_smem + 2 * self.res_tile * sm90.ELEM_BYTES <= budget)
        self.producer_regs = PRODUCER_REGS[self.ctas_per_sm]
        if self.fold_k:
            self.producer_regs = max(self.producer_regs, VT_SCALER_REGS if v_slots else SCALER_REGS)
        self.consumer_regs = resources.consumer_registers(self.ctas_per_sm, WG, self.producer_regs,
                                                          consumers * WG, 256)
        # the residual sub-tile (64 tokens of K and of V, 16-bit) reuses the K / V rings
        res_bytes = self.res_tile * sm90.ELEM_BYTES
        assert num_stages * self.bytes_kp >= res_bytes and num_stages * self.bytes_vp >= res_bytes
        assert num_stages * self.bytes_kp >= self.merge_smem_bytes  # (the K ring hosts the split merge)

    # ---------------------------------------------------------------------------------
    # Host side
    # ---------------------------------------------------------------------------------
    def _layouts(self):
        """Shared-memory layouts (call in a trace): Q and P^T (K-major wgmma B operands; P^T
        one copy per V group with ``fold_v``) and the packed K / V rings as ldmatrix reads
        them (TMA swizzle atoms, a stage mode last)."""
        return (sm90.make_operand_smem_layout(self.dtype, self.nh, self.d),
                sm90.make_operand_smem_layout(self.dtype, self.nh, self.step, self.p_copies * self.consumers),
                sm90.make_packed_smem_layout(self.nr, 4 * self.wk, self.num_stages, self.wide_boxes),
                # V: one slot per V tile of a stage (two 4-bit tiles per 2-bit K tile in K2V4)
                sm90.make_packed_smem_layout(self.d, 4 * self.wv, self.num_stages * self.v_tiles, self.wide_boxes))

    def _tma_layouts(self):
        """The packed K / V rings as the TMA writes them (``wide_boxes``: rows folded into
        128-byte ones; the same memory as ``_layouts``' rings)."""
        return (sm90.make_packed_tma_layout(self.nr, 4 * self.wk, self.num_stages, self.wide_boxes),
                sm90.make_packed_tma_layout(self.d, 4 * self.wv, self.num_stages * self.v_tiles, self.wide_boxes))

    def _qs_layout(self):
        """``fold_k``: Q o s, one K-major wgmma B tile per (stage, K group of the tile)."""
        return sm90.make_operand_smem_layout(self.s_dtype, self.nh, self.d, self.num_stages * self.q_copies)

    def _vt_layout(self):
        """``v_slots``: the dequantized V^T tiles, K-major wgmma A operands (channels, tokens,
        slot)."""
        return sm90.make_operand_smem_layout(self.dtype, self.d, self.step, self.v_slots)

    @property
    def red_slots(self) -> int:
        """Per (head, warp) fp32 slots of the cross-warp exchange: the step's maxima, the
        row sums, and with ``fold_v`` one P.zero sum per V group."""
        return 2 + (self.p_copies if self.fold_v else 0)

    def _red_layout(self):
        """One consumer's exchange slots: (head, warp, ``red_slots``) fp32, consumers apart."""
        return cute.make_layout((self.nh, WARPS, self.red_slots))

    def _stash_layout(self):
        """Consumers 1 ..: their partial softmax state, (thread, ``stash_slots``, consumer - 1)
        fp32, slot-major so a warp's stores of one slot are consecutive words (``merge``)."""
        return cute.make_layout((WG, self.stash_slots, self.consumers - 1))

    @property
    def stash_slots(self) -> int:
        """fp32 values of a consumer thread's partial softmax state: its head columns' maxima
        and row sums, with ``fold_v`` their zero sums, and its O^T accumulators."""
        ncols = sm80.head_columns(self.nh)
        return 2 * ncols + (ncols * self.p_copies if self.fold_v else 0) + M_BLOCK * self.m_v * self.nh // WG

    def _shared_storage(self):
        stages = self.num_stages
        q_layout, p_layout, kp_layout, vp_layout = self._layouts()

        n = self.consumers

        @cute.struct
        class Storage:
            mbar: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            red: cute.struct.MemRange[Float32, cute.cosize(self._red_layout()) * n]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(q_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(p_layout)], 1024]
            sKp: cute.struct.Align[cute.struct.MemRange[cutlass.Float16, cute.cosize(kp_layout)], 1024]
            sVp: cute.struct.Align[cute.struct.MemRange[cutlass.Float16, cute.cosize(vp_layout)], 1024]
            sKs: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, stages * self.words_ks], 128]
            sVs: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, stages * self.words_vs], 128]
            if n > 1:
                stash: cute.struct.MemRange[Float32, cute.cosize(self._stash_layout())]
            if self.early_residual:
                sRes: cute.struct.Align[cute.struct.MemRange[self.dtype, 2 * self.res_tile], 1024]  # K, V

        if not self.fold_k:
            return Storage
        qs_layout = self._qs_layout()

        @cute.struct
        class FoldStorage:
            base: Storage
            qbar: cute.struct.MemRange[cutlass.Int64, 2 * stages]  # the scalers' Q o s is ready
            bias: cute.struct.MemRange[Float32, stages * self.q_copies * self.nh]
            if self.k_shift:
                shift: cute.struct.MemRange[Float32, stages * self.q_copies * self.nh]  # 2^e of each row
            sQs: cute.struct.Align[cute.struct.MemRange[self.s_dtype, cute.cosize(qs_layout)], 1024]
            if self.v_slots:
                vbar: cute.struct.MemRange[cutlass.Int64, 2 * self.v_slots]  # V^T slots: full, empty
                sVt: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(self._vt_layout())], 1024]

        return FoldStorage

    def launch(self, mQ, mKp, mKs, mVp, mVs, mKr, mVr, mKsink, mVsink, mSeqlens, mBlockTable, mO, mLSE,
               softmax_scale_log2, tail_weight, stream, new):
        """(plain Python, traced inside ``PackedDecodeConfig``'s entry points, ``__call__`` and
        ``call_append``)"""
        mQ, mO = query_views(mQ, mO, self.split)
        Storage = self._shared_storage()
        kt_layout, vt_layout = self._tma_layouts()
        # TMA views with the tile's two modes first: K (page rows, words, Hkv, P) and
        # V (channels, words, blocks, Hkv, P), rows folded with ``wide_boxes``; each tile
        # is one box of the swizzled stage
        k_view = sm90.fold_packed_rows(cute.make_tensor(mKp.iterator, cute.select(mKp.layout, mode=[2, 3, 1, 0])),
                                       self.k_fold)
        v_view = sm90.fold_packed_rows(cute.make_tensor(mVp.iterator, cute.select(mVp.layout, mode=[3, 4, 2, 1, 0])),
                                       self.v_fold)
        tma_k, tma_tk = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), k_view, cute.select(kt_layout, mode=[0, 1]), self.k_box)
        tma_v, tma_tv = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), v_view, cute.select(vt_layout, mode=[0, 1]), self.v_box)
        num_splits = mO.shape[0] if const_expr(self.split) else 1
        grid = (num_splits, mKr.shape[2], mKr.shape[0])
        # the register cap at entry (from the CTAs per SM) is what setmaxnreg redistributes
        self.kernel(mQ, tma_k, tma_tk, mKs, tma_v, tma_tv, mVs, mKr, mVr, mKsink, mVsink, mSeqlens, mBlockTable,
                    mO, mLSE, softmax_scale_log2, tail_weight, new, Storage).launch(
            grid=grid, block=[(1 + self.consumers) * WG, 1, 1], stream=stream, min_blocks_per_mp=self.ctas_per_sm,
            preferred_smem_carveout=100, use_pdl=self.pdl)

    # ---------------------------------------------------------------------------------
    # Device side
    # ---------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, mQ, tma_k: cute.CopyAtom, mKt: cute.Tensor, mKs, tma_v: cute.CopyAtom, mVt: cute.Tensor,
               mVs, mKr, mVr, mKsink, mVsink, mSeqlens, mBlockTable, mO, mLSE, softmax_scale_log2: Float32,
               tail_weight: Int32, new, Storage: cutlass.Constexpr):
        q_layout, p_layout, kp_layout, vp_layout = self._layouts()
        tid, _, _ = cute.arch.thread_idx()
        split_idx, head_kv, batch = split_coords(tail_weight)
        num_splits, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_k)
            cpasync.prefetch_descriptor(tma_v)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(Storage)
        fold = None  # fold_k: (qready pipeline, Q o s tiles, bias) of every stage
        vt = None  # v_slots: (the V^T slots' pipeline, the slots)
        if const_expr(self.fold_k):
            qready = pipeline.PipelineAsync.create(
                barrier_storage=storage.qbar.data_ptr(),
                num_stages=self.num_stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, WG),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, WARPS),
                defer_sync=True,  # the ring's create below syncs the CTA for both
            )
            qs_layout = self._qs_layout()
            sQs = storage.sQs.get_tensor(qs_layout.outer, swizzle=qs_layout.inner)
            sBias = storage.bias.get_tensor(cute.make_layout((self.nh, self.q_copies, self.num_stages)))
            sShift = None
            if const_expr(self.k_shift):
                sShift = storage.shift.get_tensor(cute.make_layout((self.nh, self.q_copies, self.num_stages)))
            fold = (qready, sQs, sBias, sShift)
            if const_expr(self.v_slots):
                vtiles = pipeline.PipelineAsync.create(
                    barrier_storage=storage.vbar.data_ptr(),
                    num_stages=self.v_slots,
                    producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, V_DECODERS * cute.arch.WARP_SIZE),
                    consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, WG),
                    defer_sync=True,
                )
                vt_layout = self._vt_layout()
                vt = (vtiles, storage.sVt.get_tensor(vt_layout.outer, swizzle=vt_layout.inner))
            storage = storage.base
        ring = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar.data_ptr(),
            num_stages=self.num_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, WARPS),
            tx_count=self.tx_bytes,
        )
        sKp = storage.sKp.get_tensor(kp_layout.outer, swizzle=kp_layout.inner)
        sVp = storage.sVp.get_tensor(vp_layout.outer, swizzle=vp_layout.inner)
        sKs = storage.sKs.get_tensor(cute.make_layout((self.words_ks, self.num_stages)))
        sVs = storage.sVs.get_tensor(cute.make_layout((self.words_vs, self.num_stages)))

        wait_for_previous_kernel(self.pdl)
        first = None  # early_loads: the sequence's first block-table entry (``page_of``'s ``first``)
        if const_expr(self.early_loads):
            if warp_idx >= WARPS:  # (consume waits for it; the producer warps skip to their loads)
                self.copy_q(mQ, storage.sQ.get_tensor(q_layout.outer, swizzle=q_layout.inner), mKr, batch, head_kv,
                            tid - WG)
            first = Int32(0)
            if warp_idx == 0:  # (in a branch of its own: in the common code ptxas sinks it past the length)
                first = first_page(mBlockTable, batch, mKs.shape[0])
        seqlen = self.sequence_length(mSeqlens, new, batch, num_splits, tid)
        n_sink, n_rest = self.token_counts(seqlen)
        tile_begin, packed_end, has_residual, n_res = split_tiles(n_rest, self.nr, split_idx, num_splits,
                                                                  tail_weight)

        if warp_idx < WARPS:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if const_expr(self.fold_k):
                sQ = storage.sQ.get_tensor(q_layout.outer, swizzle=q_layout.inner)
                self.produce_and_scale(ring, fold, sQ, tma_k, mKt, sKp, mKs, sKs, tma_v, mVt, sVp, mVs, sVs,
                                       mBlockTable, batch, head_kv, tile_begin, packed_end,
                                       mQ.shape[1] // mKr.shape[2], tid, vt, first)
            else:
                if warp_idx == 0:
                    self.produce(ring, tma_k, mKt, sKp, mKs, sKs, tma_v, mVt, sVp, mVs, sVs, mBlockTable,
                                 batch, head_kv, tile_begin, packed_end, first)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            self.consume(ring, storage, q_layout, p_layout, sKp, sKs, sVp, sVs, mQ, mKr, mVr, mKsink, mVsink,
                         mO, mLSE, batch, head_kv, split_idx, tile_begin, packed_end, has_residual, n_res,
                         n_sink, n_sink + n_rest, softmax_scale_log2, fold, new, vt)

    # ---------------------------------------------------------------------------------
    # Producer: TMA of packed K / V rows, bulk copies of their params
    # ---------------------------------------------------------------------------------
    def tma_views(self, tma_k, mKt, sKp, tma_v, mVt, sVp):
        """(smem, gmem) TMA partitions: (TMA values, stage) and (TMA values, row block, Hkv,
        P) for K, (TMA values, block, Hkv, P) for V."""
        gK = cute.flat_divide(mKt, self.k_box)[None, None, None, 0, None, None]
        gV = cute.flat_divide(mVt, self.v_box)[None, None, 0, 0, None, None, None]
        kt_layout, vt_layout = self._tma_layouts()  # (the rings' memory as the boxes fill it)
        sKt = cute.make_tensor(sKp.iterator, kt_layout.outer)
        sVt = cute.make_tensor(sVp.iterator, vt_layout.outer)
        tKs, tKg = cpasync.tma_partition(tma_k, 0, cute.make_layout(1), cute.group_modes(sKt, 0, 2),
                                         cute.group_modes(gK, 0, 2))
        tVs, tVg = cpasync.tma_partition(tma_v, 0, cute.make_layout(1), cute.group_modes(sVt, 0, 2),
                                         cute.group_modes(gV, 0, 2))
        return tKs, tKg, tVs, tVg

    def issue_tile(self, ring, state, tile, views, tma_k, mKt, mKs, sKs, tma_v, mVs, sVs, mBlockTable, batch,
                   head_kv, first=None):
        """One warp: waits for stage ``state`` to be free, then loads packed tile ``tile``
        into it (a TMA box of K rows, one per V tile, bulk copies of both params);
        ``first``: the sequence's first block-table entry, loaded already (``early_loads``)."""
        tKs, tKg, tVs, tVg = views
        page, off = page_of(mBlockTable, batch, tile * self.nr, mKt.shape[0] * self.k_fold, mKs.shape[0], first)
        blk = off // self.nr
        ring.producer_acquire(state)
        bar = ring.producer_get_barrier(state)
        cute.copy(tma_k, tKg[None, blk, head_kv, page], tKs[None, state.index], tma_bar_ptr=bar)
        for i in range(self.v_tiles):  # (a plain helper: unrolled by Python)
            cute.copy(tma_v, tVg[None, off // self.v_tile + i, head_kv, page],
                      tVs[None, state.index * self.v_tiles + i], tma_bar_ptr=bar)
        with cute.arch.elect_one():
            if const_expr(self.fp4):  # the tile's scale chunks are contiguous words
                ks_src = mKs[page, head_kv, off // self.nr, None, None].iterator
                vs_src = mVs[page, head_kv, off // self.v_tile, None, None, None].iterator
            else:
                ks_first = mKs[page, head_kv, None, None]  # rows: groups of tokens (K per channel) or tokens
                ks_row = off // self.group if const_expr(self.k_channel) else off
                ks_src = ks_first.iterator + ks_row * ks_first.stride[0]
                vs_first = mVs[page, head_kv, None, None, None]
                vs_src = vs_first.iterator + (off // K_BLOCK) * vs_first.stride[0]  # a row per 16-token k-block
            ptx90.bulk_g2s(sKs[None, state.index].iterator, ks_src, 4 * self.words_ks, bar)
            ptx90.bulk_g2s(sVs[None, state.index].iterator, vs_src, 4 * self.words_vs, bar)

    @cute.jit
    def produce(self, ring, tma_k, mKt, sKp, mKs, sKs, tma_v, mVt, sVp, mVs, sVs, mBlockTable,
                batch, head_kv, tile_begin, packed_end, first=None):
        """Warp 0 of the producer warpgroup: the split's tiles into the ring."""
        views = self.tma_views(tma_k, mKt, sKp, tma_v, mVt, sVp)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        for tile in cutlass.range(tile_begin, packed_end, unroll=1):
            self.issue_tile(ring, state, tile, views, tma_k, mKt, mKs, sKs, tma_v, mVs, sVs, mBlockTable, batch,
                            head_kv, first)
            state.advance()

    # ---------------------------------------------------------------------------------
    # Producer with fold_k: the ring, and Q o s and the per-head bias of each stage
    # ---------------------------------------------------------------------------------
    @cute.jit
    def produce_and_scale(self, ring, fold, sQ, tma_k, mKt, sKp, mKs, sKs, tma_v, mVt, sVp, mVs, sVs,
                          mBlockTable, batch, head_kv, tile_begin, packed_end, gq, tid, vt=None, first=None):
        """The whole producer warpgroup (``tid`` < 128).  Iteration ``it``: warp 0 loads tile
        ``it`` into the ring; then all four warps scale tile ``it - lag``, which has had
        ``lag`` iterations to land.  Four warps, one per SM sub-partition, share the scaling
        evenly: on two warps (one k-block of a head each) the decode measured 3-5 % slower
        than without the fold, their sub-partitions' consumer warps held back at every
        barrier of the warpgroup (H200, profiles/NOTES.md, thirteenth session)."""
        views = self.tma_views(tma_k, mKt, sKp, tma_v, mVt, sVp)
        warp = cute.arch.make_warp_uniform(tid // cute.arch.WARP_SIZE)
        lane = tid % cute.arch.WARP_SIZE
        # scaling tile j waits (through warp 0's acquire of tile j + lag) for the consumers to
        # release tile j + lag - stages: with lag = stages - 1 - consumers that is j - 1 -
        # consumers, so tile j is scaled while the consumers work on the tiles before it (one
        # consumer with stages - 1 waited for j - 1: the scaling sat on its critical path)
        lag = max(1, self.num_stages - 1 - self.consumers)
        qready = fold[0]
        start = tile_begin  # the loop's first iteration
        if const_expr(self.early_tiles):
            # the loop's first ``lag`` iterations only issue tiles: run them before the barrier
            # (and before warp 0's share of the zero fills below, ~64 stores a thread)
            start = tile_begin + lag
            if warp == 0:
                for it in cutlass.range(tile_begin, cutlass.min(start, packed_end), unroll=1):
                    self.issue_tile(ring, seq_state(it - tile_begin, self.num_stages, True), it, views, tma_k, mKt,
                                    mKs, sKs, tma_v, mVs, sVs, mBlockTable, batch, head_kv, first)
        self.zero_scales(fold, tid)
        # the consumers put Q in smem
        cute.arch.barrier(barrier_id=Barrier.q(self.consumers), number_of_threads=self.q_threads)
        for it in cutlass.range(start, packed_end + lag, unroll=1):
            if warp == 0:
                if it < packed_end:
                    self.issue_tile(ring, seq_state(it - tile_begin, self.num_stages, True), it, views, tma_k, mKt,
                                    mKs, sKs, tma_v, mVs, sVs, mBlockTable, batch, head_kv, first)
            if it >= tile_begin + lag:
                state = seq_state(it - lag - tile_begin, self.num_stages, False)
                ring.consumer_wait(state)  # waits only: the consumer warps release the stage
                self.scale_stage(fold, sQ, sKs, state.index, gq, tid)
                cute.arch.fence_proxy("async.shared", space="cta")  # the scores' wgmma reads sQs
                qready.producer_commit(state)
                if const_expr(self.v_slots):
                    # after Q o s: the consumer starts the tile's scores while V^T is decoded,
                    # by warps 1 .. 3: warp 0, which issues the TMA loads, never waits for a slot
                    vtiles, sVt = vt
                    if warp != 0:
                        for st in cutlass.range_constexpr(self.steps):
                            vstate = self.v_state(it - lag - tile_begin, st, producer=True)
                            vtiles.producer_acquire(vstate)
                            self.stage_v(sVp, sVt[None, None, vstate.index], state.index, st, warp - 1, lane)
                            cute.arch.fence_proxy("async.shared", space="cta")  # the P V wgmma reads sVt
                            vtiles.producer_commit(vstate)

    @cute.jit
    def zero_scales(self, fold, tid):
        """The producer warpgroup's zero fills of every stage's Q o s rows and biases: padding
        heads' stay zero (``scale_stage`` skips them), so their scores are exactly 0, never
        shared memory left by an earlier CTA (``lazy_softmax`` decides over every head
        column of the tile)."""
        _, sQs, sBias, sShift = fold
        zero_shared(sQs, tid, WG)
        zero_shared(sBias, tid, WG)
        if const_expr(self.k_shift):
            zero_shared(sShift, tid, WG)

    @cute.jit
    def scale_stage(self, fold, sQ, sKs, stage, gq, tid):
        """Q o s_g and sum_d q_d (zero_d + center s_d) of every K group ``g`` of the tile in
        ``stage`` (``raw_k``: the B tile is Q o s_g / mult and the bias takes minus its
        values times their code offsets, magic + center mult).  Producer thread ``tid``: quad
        lane ``c`` of k-block ``kt`` of one head, i.e. the four fragment-order (scale, zero) words
        ``16 kt + 4 c ..`` (channels ``16 kt + 2 c, + 1, + 8, + 9``) and those channels of
        Q; a head's threads are adjacent lanes of one warp (two heads a warp at head dim 64,
        two k-blocks a thread at 256), reduced with butterfly shuffles.  Rows of padding
        heads (>= gq) are skipped a warp at a time: their Q o s rows and biases stay zero."""
        per_pass = WG // self.scale_lanes[0]  # heads a pass of the warpgroup
        for ps in cutlass.range_constexpr(self.nh // per_pass):
            self.scale_heads(fold, sQ, sKs, stage, gq, tid, ps * per_pass)

    @cute.jit
    def scale_heads(self, fold, sQ, sKs, stage, gq, tid, head0):
        """One pass of ``scale_stage``: the producer threads' heads from ``head0`` on."""
        _, sQs, sBias, sShift = fold
        lane = tid % cute.arch.WARP_SIZE
        head = head0 + tid // self.scale_lanes[0]
        # the first head of this warp: padding heads are skipped a whole warp at a time
        first = head0 + (tid // cute.arch.WARP_SIZE) * (cute.arch.WARP_SIZE // self.scale_lanes[0])
        if first < gq:
            for g in cutlass.range_constexpr(self.q_copies):
                row = sQs[None, None, stage * self.q_copies + g]
                pairs = self.row_pairs(sQ, sKs, stage, g, head, lane, tid)
                if const_expr(self.k_shift):
                    bias, up = self.scale_row_shifted(pairs, row, head)
                else:
                    bias = self.scale_row(pairs, row, head)
                bias = across_lanes(bias, self.scale_lanes[0], operator.add)
                if tid % self.scale_lanes[0] == 0:
                    sBias[head, g, stage] = bias
                    if const_expr(self.k_shift):
                        sShift[head, g, stage] = up

    @cute.jit
    def stage_v(self, sVp, sVt, stage, st: cutlass.Constexpr[int], decoder, lane):
        """``v_slots``: V^T of step ``st`` of the tile in ``stage``, dequantized to its exact
        centered codes, into slot ``sVt`` (channels x step tokens, K-major).  The three
        decoder warps (``decoder`` 0 .. 2) take the 16-channel slabs round robin; each slab
        is what a consumer warp's ``v_block`` makes of it, an m16n8k16 A fragment a k-block,
        stored with one stmatrix x4."""
        vp = [sVp[None, None, stage]]
        stsm = sm90.make_dequant_stsm_copy(self.dtype)
        thr = stsm.get_slice(lane)
        dst = thr.partition_D(sVt)  # (values, channels / 16, tokens / 16)
        block_shape = thr.partition_S(cute.make_identity_tensor((self.d, self.step)))[None, 0, 0].shape
        dq = self.v_dequant()
        slabs = self.d // SLAB
        for r in cutlass.range_constexpr(-(-slabs // V_DECODERS)):
            slab = r * V_DECODERS + decoder
            if slab < slabs:
                words = self.v_slab(vp, st, slab * SLAB, lane)
                for k in cutlass.range_constexpr(self.step // K_BLOCK):
                    block = cute.make_rmem_tensor(block_shape, self.dtype)
                    block32 = cute.recast_tensor(block, Uint32)
                    for (h, ch), word in self.v_block(words, None, st, k, slab * SLAB, 0, dq, lane, {}).items():
                        block32[self.vt_registers[h, ch]] = word
                    cute.copy(stsm, block, dst[None, slab, k])

    def row_pairs(self, sQ, sKs, stage, g, head, lane, tid):
        """This scaler thread's pairs of head ``head``'s B-tile row for K group ``g`` of
        ``stage``: ``(kt, half, column, Q pair, scale pair, zero pair)`` per k-block ``kt``
        and column half (channels 2c, 2c+1 and 2c+8, 2c+9), generated as the caller takes
        them, so each k-block's words are loaded next to their use."""
        for i in range(self.scale_lanes[1]):
            kt = (tid % self.scale_lanes[0]) // 4 + i * (self.scale_lanes[0] // 4)
            c = lane % 4
            # the quad lane's four words of the k-block, one 16-byte load
            word0 = g * self.d + sm80.param_position(kt, c, 0)
            words = cute.make_rmem_tensor((sm80.CHUNK_WORDS,), cutlass.Int32)
            cute.autovec_copy(cute.local_tile(sKs[None, stage], (sm80.CHUNK_WORDS,),
                                              (word0 // sm80.CHUNK_WORDS,)), words)
            for half in range(2):
                col = sm80.fragment_column(kt, c, half)
                q2 = pair_word(sQ, head, col)
                w0, w1 = Uint32(words[2 * half]), Uint32(words[2 * half + 1])
                s2, z2 = split_params(w0, w1)
                yield kt, half, col, q2, s2, z2

    def scale_row(self, pairs, row, head):
        """fp16 kernels: this thread's pairs of ``Q o s`` (``raw_k``: ``/ mult``, packed fp16
        fmas) into B-tile ``row``, and its part of the bias."""
        zsum = Float32(0.0)
        ssum = Float32(0.0)
        osum = Float32(0.0)  # raw_k: sum of B-tile values times their code offset
        for kt, half, col, q2, s2, z2 in pairs:
            qs2 = ptx.fma_x2(q2, s2, Uint32(0), False)
            offset = Float32(0.0)
            if self.raw_k:
                qs2, offset = self.divide_by_mult(qs2, kt, half)
            pair_word(row, head, col, qs2)
            if self.raw_k:
                r_lo, r_hi = ptx.half_pair_to_f32(qs2, False)
                osum += (r_lo + r_hi) * offset
            q, sc, z = self.widened(q2, s2, z2)
            zsum += dot2(q, z)
            ssum += dot2(q, sc)
        return zsum + Float32(self.k_center) * ssum - osum

    def widened(self, q2, s2, z2):
        """A B-tile pair's Q, scale and zero words, each widened to an fp32 pair."""
        return tuple(ptx.half_pair_to_f32(w, self.is_bf16) for w in (q2, s2, z2))

    def scale_row_shifted(self, pairs, row, head):
        """``k_shift`` (bf16 kernels with the fold): this thread's pairs of ``Q o s / mult``
        in fp32 times ``2^-e``, rounded once to fp16 into B-tile ``row``, with ``e`` shared by
        the row (its largest magnitude, over the head's lanes, under ``2^K_SHIFT_LOG2``).
        Returns this thread's part of the bias (the lop3 halves' offsets scaled back by
        ``2^e``) and ``2^e``."""
        zsum = Float32(0.0)
        ssum = Float32(0.0)
        big = Float32(0.0)
        products = []  # (column, low, high, offset) of this thread's pairs
        for kt, half, col, q2, s2, z2 in pairs:
            q, sc, z = self.widened(q2, s2, z2)
            inv, offset = self.mult_inverse(kt, half)
            lo, hi = q[0] * sc[0] * inv, q[1] * sc[1] * inv
            big = cute.arch.fmax(big, cute.arch.fmax(ptx.fabs(lo), ptx.fabs(hi)))
            products.append((col, lo, hi, offset))
            zsum += dot2(q, z)
            ssum += dot2(q, sc)
        big = across_lanes(big, self.scale_lanes[0], cute.arch.fmax)
        e = cutlass.max(ptx.f32_exponent(ptx.f32_bits(big)) - (K_SHIFT_LOG2 - 1), cutlass.Int32(0))
        down, up = ptx.pow2(-e), ptx.pow2(e)
        osum = Float32(0.0)  # raw_k: sum of B-tile values times their code offset
        for col, lo, hi, offset in products:
            qs2 = ptx.cvt_pack_x2(lo * down, hi * down, False)
            pair_word(row, head, col, qs2)
            if self.raw_k:
                r_lo, r_hi = ptx.half_pair_to_f32(qs2, False)
                osum += (r_lo + r_hi) * offset
        return zsum + Float32(self.k_center) * ssum - up * osum, up

    @cute.jit
    def mult_inverse(self, kt, half: cutlass.Constexpr[int]):
        """(1 / mult, the lop3 halves' offset ``magic + center mult``) of k-block ``kt``'s
        column half ``half`` in fp32, as ``divide_by_mult`` takes them (without ``raw_k``: 1, 0)."""
        if const_expr(not self.raw_k):
            return Float32(1.0), Float32(0.0)
        if const_expr(self.k_mult_uniform):
            mult = self.k_mult[0][half]
            return Float32(1.0 / mult), self.k_offset_of(mult)
        log2_mult = self.k_log2_mult(kt, half)
        return ptx.pow2(-cutlass.Int32(log2_mult)), self.k_offset_of(Uint32(1) << log2_mult)

    def k_log2_mult(self, kt, half: int):
        """log2 of k-block ``kt``'s column-half ``half`` multiplier where it depends on the
        k-block's place in its word (2-bit ``raw_k``): a run-time lookup in ``k_mult_log2``."""
        return nibble(self.k_mult_log2, 2 * (kt % self.kpw_k) + half)

    def k_offset_of(self, mult):
        """The offset ``magic + center mult`` that B-tile values of multiplier ``mult``
        carry into the bias: an immediate for a Python number (``k_mult_uniform``), else
        computed from the traced integer (a power of two)."""
        if isinstance(mult, (int, float)):
            return Float32(self.k_offset + self.k_center * mult)
        return Float32(self.k_offset) + Float32(self.k_center) * Float32(mult)

    @cute.jit
    def divide_by_mult(self, qs2, kt, half: cutlass.Constexpr[int]):
        """``raw_k`` in fp16 kernels (bf16's: ``scale_row_shifted``): the B-tile pair ``Q o s /
        mult`` of k-block ``kt``'s column half ``half`` and the lop3 halves' offset ``magic +
        center mult`` its values carry into the bias.  One multiplier per half in every
        k-block (4-bit): immediates; else the k-block's place in its word picks it at run
        time (exact either way: a power of two)."""
        if const_expr(self.k_mult_uniform):
            mult = self.k_mult[0][half]
            if const_expr(mult != 1):
                qs2 = ptx.fma_x2_imm(qs2, half2_bits(1.0 / mult, False), 0, False)
            return qs2, self.k_offset_of(mult)
        log2_mult = self.k_log2_mult(kt, half)
        # 2^-log2_mult as an fp16 pair: biased exponent (bias - log2_mult), mantissa 0 (the fp16 kernels' path)
        inv2 = ((Uint32(packing.EXP_BIAS["fp16"]) - log2_mult) << Uint32(packing.MANTISSA_BITS["fp16"])) \
            * Uint32(packing.HALF2_BOTH)
        qs2 = ptx.fma_x2(qs2, inv2, Uint32(0), False)
        return qs2, self.k_offset_of(Uint32(1) << log2_mult)

    # ---------------------------------------------------------------------------------
    # Consumer warpgroup
    # ---------------------------------------------------------------------------------
    @cute.jit
    def consume(self, ring, storage, q_layout, p_layout, sKp, sKs, sVp, sVs, mQ, mKr, mVr, mKsink, mVsink,
                mO, mLSE, batch, head_kv, split_idx, tile_begin, packed_end, has_residual, n_res, n_sink,
                seqlen, scale_log2, fold=None, new=None, vt=None):
        n = self.consumers
        consumer = self.consumer_index()
        tid_all = cute.arch.thread_idx()[0] - WG  # over every consumer warpgroup
        tid = tid_all if const_expr(n == 1) else tid_all - WG * consumer
        warp = cute.arch.make_warp_uniform(tid // 32)
        lane = tid % 32
        gq = mQ.shape[1] // mKr.shape[2]
        sQ = storage.sQ.get_tensor(q_layout.outer, swizzle=q_layout.inner)
        # the consumer's own P^T copies and exchange slots
        sP = storage.sP.get_tensor(p_layout.outer, swizzle=p_layout.inner)
        if const_expr(n > 1):  # (a tile of the stage mode: the wgmma descriptors need its alignment)
            sP = cute.local_tile(sP, (self.nh, self.step, self.p_copies), (0, 0, consumer))
        red_layout = self._red_layout()
        red = cute.make_tensor(storage.red.data_ptr() + consumer * cute.cosize(red_layout), red_layout)
        if const_expr(self.half_cols):  # P^T's padding heads are never written: zero (published with Q)
            zero_shared(sP, tid, WG)
        lim = self.causal_limits(seqlen, gq, lane)  # multi-token queries: each column's last token

        if const_expr(not self.early_loads):  # (else issued right after the PDL wait)
            self.copy_q(mQ, sQ, mKr, batch, head_kv, tid_all)
        cute.arch.cp_async_wait_group(0)
        cute.arch.fence_proxy("async.shared", space="cta")
        if const_expr(n == 1):
            self.bar(Barrier.P)
            if const_expr(self.fold_k):
                cute.arch.barrier_arrive(barrier_id=Barrier.q(n), number_of_threads=self.q_threads)
        else:  # Q is every consumer's: a barrier of all of them (and of the scalers, who read it)
            cute.arch.barrier(barrier_id=Barrier.q(n), number_of_threads=self.q_threads)
        if const_expr(self.early_residual):
            if consumer == 0 and has_residual:  # (consumer 0 runs ``finish``; it waits for this copy)
                self.copy_residual_rows(self.residual_buffers(storage.sRes.data_ptr()), mKr, mVr, batch, head_kv,
                                        0, n_res, tid)

        # both products are wgmma 64 x nh x 16 with A from registers: one partitioning serves
        # both (the MMA objects that issue them are made per product, see ``scores``)
        mma = sm90.make_wgmma(self.dtype, self.nh, a_from_registers=True)
        thr_s = thr_o = mma.get_slice(tid)
        tSrQ = mma.make_fragment_B(thr_s.partition_B(sQ))
        bias = mul = None
        if const_expr(self.fold_k):
            qready, sQs, sBias, sShift = fold
            # (MMA, N, K, stage x group); an fp16 MMA's descriptors in a bf16 kernel (fold_k_bf16)
            mma_s = mma
            if const_expr(self.s_dtype is not self.dtype):
                mma_s = sm90.make_wgmma(self.s_dtype, self.nh, a_from_registers=True)
            tSrQs = mma_s.make_fragment_B(thr_s.partition_B(sQs))
            bias = cute.make_rmem_tensor((sm80.head_columns(self.nh), self.m_k), Float32)
            if const_expr(self.k_shift):  # the scaling fma's multiplier, 2^e times the softmax scale
                mul = cute.make_rmem_tensor((sm80.head_columns(self.nh), self.m_k), Float32)
        tOrP = [mma.make_fragment_B(thr_o.partition_B(sP[None, None, i])) for i in range(self.p_copies)]
        tOsV = None  # v_slots: the V^T slots as the SS P V product's A (MMA, M-blocks, k-blocks, slot)
        if const_expr(self.v_slots):
            vtiles, sVt = vt
            mma_ss = sm90.make_wgmma(self.dtype, self.nh)
            tOsV = mma_ss.make_fragment_A(mma_ss.get_slice(tid).partition_A(sVt))
        acc_o = cute.make_rmem_tensor(thr_o.partition_shape_C((M_BLOCK * self.m_v, self.nh)), Float32)
        acc_o.fill(0.0)
        # each step's P V product goes to its own accumulator, folded into acc_o with fp32
        # adds once it lands: summed inside the tensor core over a million tokens (one
        # split), O drifted twice past the error of the reference with P in 16 bits
        acc_pv = cute.make_rmem_tensor(thr_o.partition_shape_C((M_BLOCK * self.m_v, self.nh)), Float32)
        acc_pv.fill(0.0)
        ncols = sm80.head_columns(self.nh)
        row_max = cute.make_rmem_tensor((ncols,), Float32)
        row_sum = cute.make_rmem_tensor((ncols,), Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)
        # with fold_v, sum_t p_t zero_t per head column and V group (this thread's tokens)
        zsum = None
        if const_expr(self.fold_v):
            zsum = cute.make_rmem_tensor((ncols, self.p_copies), Float32)
            zsum.fill(0.0)
        if const_expr(self.fp4):
            dq_k = dq_v = E2M1Dequant(self.is_bf16)
        else:
            dq_k = WordDequant(self.bits, self.s_bf16, self.k_center)
            dq_v = self.v_dequant()

        # Software pipeline, one wgmma group in flight at a time: S of a step overlaps the
        # V dequant of that step, and its P V overlaps the K dequant of the next step (the
        # next stage's, across tiles), so neither product's latency is exposed.  K goes
        # to one register tensor that every step rewrites only after its S has landed.
        k_frag = cute.make_rmem_tensor(thr_s.partition_shape_A((M_BLOCK * self.m_k, self.d)), self.s_dtype)
        first = tile_begin if const_expr(n == 1) else tile_begin + consumer  # consumer c: tiles c, c + n, ..
        if const_expr(n == 1):
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        else:
            state = seq_state(consumer, self.num_stages, False)
        if first < packed_end:
            ring.consumer_wait(state)
            self.k_fragments(k_frag, sKp[None, None, state.index], sKs[None, state.index], 0, dq_k, warp, lane)
        for tile in cutlass.range(first, packed_end, n, unroll=1):
            kp = sKp[None, None, state.index]
            vp = [sVp[None, None, state.index * self.v_tiles + i] for i in range(self.v_tiles)]
            ks = sKs[None, state.index]
            vs = sVs[None, state.index]
            if const_expr(self.fold_k):
                qready.consumer_wait(state)  # the scalers' Q o s of this stage
            for st in cutlass.range_constexpr(self.steps):
                # the previous P V has landed: its V^T registers may be rewritten, its sum folded
                warpgroup.wait_group(0)
                self.fold(acc_o, acc_pv, self.packed_fold())
                if const_expr(self.v_slots):  # ... and the V^T slot it read may take the scalers' next
                    if const_expr(st > 0):
                        vtiles.consumer_release(self.v_state(tile - tile_begin, st - 1))
                    elif tile != first:
                        vtiles.consumer_release(self.v_state(tile - n - tile_begin, self.steps - 1))
                if const_expr(self.fold_k):
                    # M-block mb of the step is in K group g(mb): its scores take that group's Q o s
                    g0 = (st * self.step) // self.group
                    g1 = (st * self.step + (self.m_k - 1) * M_BLOCK) // self.group
                    acc_s = self.scores(thr_s, k_frag, tSrQs[None, None, None, state.index * self.q_copies + g0],
                                        tSrQs[None, None, None, state.index * self.q_copies + g1], g0 != g1)
                    self.load_bias(bias, sBias, state.index, st, scale_log2, lane, mul, sShift)
                else:
                    acc_s = self.scores(thr_s, k_frag, tSrQ)  # in flight while V is dequantized
                v_frag = None
                if const_expr(not self.v_slots):
                    v_frag = self.v_fragments(thr_o, vp, vs, st, dq_v, warp, lane)
                warpgroup.wait_group(0)
                if const_expr(self.lazy_max):
                    self.lazy_softmax(acc_s, acc_o, row_max, row_sum, scale_log2, red, warp, lane, st * self.step, lim,
                                      n_sink + tile * self.nr, zsum, bias, mul)
                else:
                    self.softmax_step(acc_s, acc_o, row_max, row_sum, scale_log2, red, warp, lane, None,
                                      st * self.step, lim, n_sink + tile * self.nr, zsum, bias, mul)
                self.store_p(acc_s, sP, warp, lane, vs, st, zsum, self.fp4 is not None)
                if const_expr(self.v_slots):
                    vstate = self.v_state(tile - tile_begin, st)
                    vtiles.consumer_wait(vstate)
                    self.pv_ss(tOsV, vstate.index, tOrP, acc_pv)
                else:
                    self.pv(v_frag, tOrP, acc_pv, self.fold_v)
                if const_expr(st + 1 < self.steps):
                    self.k_fragments(k_frag, kp, ks, st + 1, dq_k, warp, lane)
                else:
                    ring.consumer_release(state)  # this stage's words are all in registers
                    if const_expr(n == 1):
                        state.advance()
                    else:  # the consumer's next tile, n uses of the ring on
                        state = seq_state(tile + n - tile_begin, self.num_stages, False)
                    if tile + n < packed_end:
                        ring.consumer_wait(state)
                        self.k_fragments(k_frag, sKp[None, None, state.index], sKs[None, state.index], 0,
                                         dq_k, warp, lane)

        if const_expr(n == 1):
            self.finish(thr_s, thr_o, tSrQ, tOrP, sP, storage, mKr, mVr, mKsink, mVsink, mO, mLSE, batch, head_kv,
                        split_idx, has_residual, n_res, n_sink, seqlen, acc_o, acc_pv, row_max, row_sum, zsum,
                        scale_log2, red, gq, warp, lane, tid, lim, new=new)
        else:
            stash = storage.stash.get_tensor(self._stash_layout())
            if consumer > 0:
                warpgroup.wait_group(0)
                self.fold(acc_o, acc_pv, self.packed_fold())
                self.stash_state(stash[None, None, consumer - 1], tid, acc_o, row_max, row_sum, zsum)
                # the rings are idle too once every consumer is here (the residual reuses them)
                cute.arch.barrier_arrive(barrier_id=Barrier.done(n), number_of_threads=n * WG)
            else:
                cute.arch.barrier(barrier_id=Barrier.done(n), number_of_threads=n * WG)
                self.finish(thr_s, thr_o, tSrQ, tOrP, sP, storage, mKr, mVr, mKsink, mVsink, mO, mLSE, batch,
                            head_kv, split_idx, has_residual, n_res, n_sink, seqlen, acc_o, acc_pv, row_max,
                            row_sum, zsum, scale_log2, red, gq, warp, lane, tid, lim, stash, new)

    @cute.jit
    def finish(self, thr_s, thr_o, tSrQ, tOrP, sP, storage, mKr, mVr, mKsink, mVsink, mO, mLSE, batch, head_kv,
               split_idx, has_residual, n_res, n_sink, seqlen, acc_o, acc_pv, row_max, row_sum, zsum, scale_log2,
               red, gq, warp, lane, tid, lim, stash=None, new=None):
        """After the packed tiles (consumer 0): the 16-bit residual block (with ``append``
        the new token stored into it first), the sink tokens, the other consumers' state
        (``stash``: softmax states merge in any order) and the epilogue."""
        pend = self.packed_fold()  # the factor of the product acc_pv holds (v_subnormal)
        if has_residual:
            if const_expr(self.append):
                self.store_new_token(new[0], new[1], mKr, mVr, batch, head_kv, n_res - 1, tid, WG)
            early = self.residual_buffers(storage.sRes.data_ptr()) if const_expr(self.early_residual) else None
            pend = self.residual(thr_s, thr_o, tSrQ, tOrP, sP, storage, mKr, mVr, batch, head_kv, n_res,
                                 acc_o, acc_pv, row_max, row_sum, scale_log2, red, warp, lane, tid, lim, seqlen - n_res,
                                 zsum, pend, early)
        if const_expr(self.sinks > 0):  # the sink tokens, 16-bit as the residual, in split 0
            if split_idx == 0:
                pend = self.residual(thr_s, thr_o, tSrQ, tOrP, sP, storage, mKsink, mVsink, batch, head_kv, n_sink,
                                     acc_o, acc_pv, row_max, row_sum, scale_log2, red, warp, lane, tid, lim, 0, zsum,
                                     pend)
        warpgroup.wait_group(0)
        self.fold(acc_o, acc_pv, pend)
        if const_expr(stash is not None):
            self.merge(stash, tid, acc_o, row_max, row_sum, zsum)
        self.epilogue(acc_o, row_max, row_sum, red, mO, mLSE, batch, head_kv, split_idx, gq, warp, lane, zsum)
        # (the K ring is idle by now; consumer 0's warpgroup merges, on its own barrier)
        self.merge_if_last(mO, mLSE, new, batch, head_kv, gq, storage.sKp.data_ptr(), tid,
                           lambda: self.bar(Barrier.EPI))

    def state_slots(self, acc_o, row_max, row_sum, zsum):
        """A consumer thread's partial softmax state as ``[(registers, index, head column)]``
        in ``stash_slots`` order: the maxima, row sums, zero sums (``fold_v``) and O^T of its
        head columns."""
        ncols = sm80.head_columns(self.nh)
        slots = [(row_max, col, col) for col in range(ncols)] + [(row_sum, col, col) for col in range(ncols)]
        if zsum is not None:
            slots += [(zsum, (col, i), col) for col in range(ncols) for i in range(self.p_copies)]
        for nt in range(self.nh // 8):
            for v0 in range(2):
                for v1 in range(2):
                    for mo in range(cute.size(acc_o, mode=[1])):
                        slots.append((acc_o, (self.cv(v0, v1, nt), mo, 0), 2 * nt + v0))
        assert len(slots) == self.stash_slots
        return slots

    @cute.jit
    def stash_state(self, stash, tid, acc_o, row_max, row_sum, zsum):
        """Consumers 1 ..: this thread's partial state into its column of ``stash``."""
        for j, (regs, idx, _) in enumerate(self.state_slots(acc_o, row_max, row_sum, zsum)):
            stash[tid, j] = regs[idx]

    def copy_q(self, mQ, sQ, mKr, batch, head_kv, tid_all):
        """Q: global -> smem (rows >= gq zero), cp.async by every consumer warpgroup's
        ``tid_all``, committed (the caller waits for it)."""
        gq = mQ.shape[1] // mKr.shape[2]
        gQ = cute.local_tile(mQ[batch, None, None], (self.nh, self.d), (0, 0))
        gQ = assume_aligned(cute.make_tensor(gQ.iterator + head_kv * gq * mQ.stride[1], gQ.layout))
        if const_expr(self.fp4):  # Q's channels in the fragment order of FP4's natural K rows
            self.copy_fp4_order(gQ, sQ, gq, tid_all, self.consumers * WG)
        else:
            copy_rows(gQ, sQ, tid_all, self.consumers * WG, gq, True)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def merge(self, stash, tid, acc_o, row_max, row_sum, zsum):
        """Consumer 0: the other consumers' partial state (thread ``tid``'s same fragment
        positions, each at its own running maximum) added into this thread's at the largest
        maximum.  A consumer that saw no unmasked token (maximum -inf, sums zero) adds
        nothing."""
        ncols = sm80.head_columns(self.nh)
        slots = self.state_slots(acc_o, row_max, row_sum, zsum)
        for col in cutlass.range_constexpr(ncols):
            m_all = row_max[col]
            for c in cutlass.range_constexpr(self.consumers - 1):
                m_all = cute.arch.fmax(m_all, stash[tid, col, c])
            weights = []
            for c in cutlass.range_constexpr(self.consumers):
                m = row_max[col] if c == 0 else stash[tid, col, c - 1]
                w = Float32(0.0)
                if m != -Float32.inf:
                    w = cute.math.exp2(m - m_all, fastmath=True)
                weights.append(w)
            row_max[col] = m_all
            for j in cutlass.range_constexpr(ncols, len(slots)):
                regs, idx, slot_col = slots[j]
                if const_expr(slot_col == col):
                    total = regs[idx] * weights[0]
                    for c in cutlass.range_constexpr(1, self.consumers):
                        total += weights[c] * stash[tid, j, c - 1]
                    regs[idx] = total

    def bar(self, barrier_id: int):
        """Named barrier ``barrier_id`` of the calling consumer warpgroup."""
        cute.arch.barrier(barrier_id=self.own_barrier(barrier_id), number_of_threads=WG)

    def own_barrier(self, barrier_id: int):
        """The calling consumer warpgroup's copy of ``Barrier`` id ``barrier_id`` (an immediate
        with one consumer)."""
        if const_expr(self.consumers == 1):
            return barrier_id
        return barrier_id + Barrier.PER_CONSUMER * self.consumer_index()

    def consumer_index(self):
        """0 .. consumers - 1: the calling consumer warpgroup (warpgroup 0 is the producer)."""
        if const_expr(self.consumers == 1):
            return 0
        return cute.arch.make_warp_uniform(cute.arch.warp_idx()) // WARPS - 1

    @property
    def q_threads(self) -> int:
        """Threads of the barrier that publishes Q: the consumers, and with ``fold_k`` the
        producer warpgroup, whose scalers read it."""
        return (self.consumers + (1 if self.fold_k else 0)) * WG

    # ---- fragments ----------------------------------------------------------------------
    def slab_words(self, tile16, row0, chunk0: int, chunks: int, lane):
        """ldmatrix x4 words of the 16-row slab at ``row0`` of a packed 16-bit tile view,
        16-byte chunks ``chunk0 ..``: ``[(h, j)]`` = the word of row ``row0 + 8 h + lane // 4``,
        chunk ``chunk0 + j`` (the A-operand copy of m16n8k16 takes two chunks per x4)."""
        cols = chunks * sm80.CHUNK_BYTES // 2
        slab = cute.local_tile(tile16, (SLAB, cols), (row0 // SLAB, chunk0 * sm80.CHUNK_BYTES // 2 // cols))
        frag = load_a_fragments(sm80.make_mma(cutlass.Float16), slab, lane, False)
        words = cute.recast_tensor(frag, Uint32)  # [(h, j % 2), 0, j // 2]
        return {(h, chunk0 + j): words[(0, h, j % 2), 0, j // 2] for h in range(2) for j in range(chunks)}

    def block_words(self, tile16, mblocks, chunk0: int, chunks: int, warp, lane):
        """``slab_words`` of this warp's slab of each M-block in ``mblocks`` (64-row blocks of a
        packed 16-bit tile view), one dict an M-block: the whole tile partitioned over the
        warpgroup's warps at once (``load_a_fragment_blocks``), so that an M-block's offset is
        an immediate added after the swizzle and the warp's offset is swizzled with the lane's
        (with wide boxes a slab per warp swizzled each of its addresses whole)."""
        k0, k1 = chunk0 // 2, -(-(chunk0 + chunks) // 2)  # 16-value k-blocks: two chunks each
        frag = load_a_fragment_blocks(sm80.make_mma(cutlass.Float16, WARPS), tile16, warp * resources.WARP + lane,
                                      [(mb, k) for mb in mblocks for k in range(k0, k1)])
        words = cute.recast_tensor(frag, Uint32)  # [(0, h, chunk % 2), M-block, chunk // 2]
        return [{(h, c): words[(0, h, c % 2), mb, c // 2] for h in range(2) for c in range(chunk0, chunk0 + chunks)}
                for mb in mblocks]

    def k_params(self, ks, tok0, kt, lane, shared, base):
        """(scale2, zero2) for row half h, column half ch of k-block ``kt`` (channels) of the
        16 tokens from ``tok0``.  ``base`` is the static part of ``tok0`` (step and M-block):
        with K per channel and groups of at least 64 tokens the group row is static, and
        M-blocks of one group reuse the pairs through ``shared``."""
        c = lane % 4
        out = {}
        if const_expr(self.fp4):
            # the lane's eight channels 32 (kt // 2) + 8 c .. share one block scale per token
            block = sm80.fp4_lane_scale_column(kt // 2, c, self.group)
            key = ("fp4", base, kt // 2)
            if key in shared:
                return shared[key]
            for h in range(2):
                pair = self.fp4_scale(ks, block, tok0 + 8 * h + lane // 4)
                out[(h, 0)] = out[(h, 1)] = (pair, None)
            shared[key] = out
        elif const_expr(self.k_channel):
            static_row = self.group >= M_BLOCK
            key = (base // self.group, kt)
            if static_row and key in shared:
                return shared[key]
            row = base // self.group if static_row else tok0 // self.group
            for ch in range(2):
                pos = row * self.d + sm80.param_position(kt, c, 2 * ch)
                pair = split_params(Uint32(ks[pos]), Uint32(ks[pos + 1]))
                out[(0, ch)] = out[(1, ch)] = pair
            if static_row:
                shared[key] = out
        else:
            gi = (K_BLOCK * kt) // self.group
            for h in range(2):
                pair = broadcast_params(Uint32(ks[(tok0 + 8 * h + lane // 4) * self.groups_v + gi]))
                out[(h, 0)] = out[(h, 1)] = pair
        return out

    def fp4_scale(self, words, block, row, col_chunks: int = 1):
        """FP4: the half2 scale of column ``block`` of operand row ``row`` from a stage's basic
        chunks (``words``, flat: row chunks of ``col_chunks`` column chunks of 128 words)."""
        row_chunk, col_chunk, w, byte = sm100.sf_location(row, block)
        chunk = row_chunk * col_chunks + col_chunk
        return fp4_scale_pair(Uint32(words[chunk * sm100.SF_CHUNK_WORDS + w]), byte, self.fp4, self.is_bf16)

    @cute.jit
    def k_fragments(self, frag, kp, ks, st, dq, warp, lane):
        """Dequantizes K of step ``st`` into ``frag``, its A-fragments ``(regs, M-blocks, D/16)``."""
        frag32 = cute.recast_tensor(frag, Uint32)
        # every M-block's words first, then k-block by k-block, so the (scale, zero) pairs
        # M-blocks share are loaded once and die at once
        bases = [st * self.step + mb * M_BLOCK for mb in range(self.m_k)]
        words = self.block_words(kp, [base // M_BLOCK for base in bases], 0, self.wk // sm80.CHUNK_WORDS, warp, lane)
        shared = {}
        for kt in cutlass.range_constexpr(self.d // K_BLOCK):
            j, kb = kt // self.kpw_k, kt % self.kpw_k
            for mb in cutlass.range_constexpr(self.m_k):
                params = None  # fold_k: the exact centered codes; K's scale and zero are Q's
                if const_expr(not self.fold_k):
                    params = self.k_params(ks, bases[mb] + warp * SLAB, kt, lane, shared, bases[mb])
                for h in cutlass.range_constexpr(2):
                    if const_expr(self.raw_k):  # the lop3 halves; the fix-up is Q's and the bias's
                        codes = dq.raw(words[mb][(h, j)], (2 * kb, 2 * kb + 1))
                    else:
                        codes = dq.codes(words[mb][(h, j)], (2 * kb, 2 * kb + 1))
                    for ch in cutlass.range_constexpr(2):
                        if const_expr(self.fold_k):
                            frag32[(0, h, ch), mb, kt] = codes[2 * kb + ch]
                        else:
                            s2, z2 = params[(h, ch)]
                            frag32[(0, h, ch), mb, kt] = dq.scale(codes[2 * kb + ch], s2, z2)

    @cute.jit
    def v_fragments(self, thr_o, vp, vs, st, dq, warp, lane):
        """Dequantized V^T A-fragments of step ``st``: ``(regs, channel M-blocks, step/16)``.
        ``vp``: the stage's V tiles (one, or two 128-token 4-bit tiles in K2V4); a step
        lies in one of them."""
        frag = cute.make_rmem_tensor(thr_o.partition_shape_A((M_BLOCK * self.m_v, self.step)), self.dtype)
        frag32 = cute.recast_tensor(frag, Uint32)
        words = self.v_slabs(vp, st, warp, lane)
        shared = {}
        for k in cutlass.range_constexpr(self.step // K_BLOCK):
            for mb in cutlass.range_constexpr(self.m_v):
                pairs = self.v_block(words[mb], vs, st, k, mb * M_BLOCK + warp * SLAB, mb, dq, lane, shared)
                for (h, ch), word in pairs.items():
                    frag32[(0, h, ch), mb, k] = word
        return frag

    def v_slabs(self, vp, st, warp, lane):
        """``v_slab`` of this warp's slab of every channel M-block, one dict an M-block
        (``block_words``)."""
        tile, chunk0, chunks = self.v_step_chunks(st)
        return self.block_words(vp[tile], range(self.m_v), chunk0, chunks, warp, lane)

    def v_tile_of(self, st: int):
        """(the V tile step ``st`` lies in, that tile's first chunk among the stage's): a
        stage holds ``v_tiles`` V tiles of ``v_tile`` tokens, a chunk column per 16 bytes."""
        tile = (st * self.step) // self.v_tile
        return tile, tile * (self.v_tile // sm80.chunk_columns(self.v_bits))

    def v_step_chunks(self, st: int):
        """(the V tile step ``st`` lies in, the step's first chunk in that tile, its chunks)."""
        per_step = self.step // sm80.chunk_columns(self.v_bits)  # chunks of a V row per step
        tile, chunk0 = self.v_tile_of(st)
        return tile, st * per_step - chunk0, per_step

    def v_slab(self, vp, st, row0, lane):
        """ldmatrix words (``slab_words``) of step ``st`` for the 16 channels from ``row0``:
        the step's chunks of the V tile it lies in."""
        tile, chunk0, chunks = self.v_step_chunks(st)
        return self.slab_words(vp[tile], row0, chunk0, chunks, lane)

    def v_block(self, words, vs, st, k, ch0, mb, dq, lane, shared):
        """The four A-fragment words ``{(h, ch): word}`` of V^T's 16 channels from ``ch0``
        (M-block ``mb``) at k-block ``k`` of step ``st``, from that M-block's ``v_slabs``
        words: the exact codes with ``fold_v`` (``vs`` unused), else scaled."""
        kt = st * (self.step // K_BLOCK) + k  # k-block of tokens in the tile
        j, kb = kt // self.kpw_v - self.v_tile_of(st)[1], kt % self.kpw_v  # chunk within the V tile
        params = self.v_params(vs, kt, ch0, mb, lane, shared)
        out = {}
        for h in range(2):
            codes = dq.codes(words[(h, j)], (2 * kb, 2 * kb + 1))
            for ch in range(2):
                code = codes[2 * kb + ch]
                if params is None:  # fold_v: the exact codes; scale and zero are P's
                    out[(h, ch)] = code
                else:
                    s2, z2 = params[(h, ch)]
                    out[(h, ch)] = dq.scale(code, s2, z2)
        return out

    def v_params(self, vs, kt, ch0, mb, lane, shared):
        """(scale2, zero2) for row half h, column half ch of V^T's rows ``ch0 ..`` (M-block
        ``mb``) at k-block ``kt`` (tokens), keyed ``(h, ch)``; None with ``fold_v`` (P carries
        them).  Channel groups of at least 64 make the group static: M-blocks in one group
        share a k-block's pairs (loaded once, through ``shared``); FP4: the lane's eight
        tokens ``32 (kt // 2) + 8 c ..`` share a block scale per channel."""
        c = lane % 4
        if const_expr(self.fold_v):
            return None
        out = {}
        if const_expr(self.fp4):
            block = sm80.fp4_lane_scale_column(kt // 2, c, self.group)
            for h in range(2):
                key = ("fp4", kt // 2, mb, h)
                if key not in shared:
                    shared[key] = self.fp4_scale(vs, block, ch0 + 8 * h + lane // 4, self.v_chunks[1])
                out[(h, 0)] = out[(h, 1)] = (shared[key], None)
            return out
        static_gi = self.group >= M_BLOCK
        gi = (mb * M_BLOCK) // self.group if static_gi else ch0 // self.group
        key = (kt, gi)
        if static_gi and key in shared:
            return shared[key]
        base = sm80.param_position(kt * self.groups_v + gi, c, 0)  # fragment-order row
        pairs = (split_params(Uint32(vs[base]), Uint32(vs[base + 1])),
                 split_params(Uint32(vs[base + 2]), Uint32(vs[base + 3])))
        out = {(h, ch): pairs[ch] for h in range(2) for ch in range(2)}
        if static_gi:
            shared[key] = out
        return out

    # ---- products ------------------------------------------------------------------------
    @cute.jit
    def scores(self, thr_s, k_frag, tSrQ, tSrQ_last=None, per_block: cutlass.Constexpr[bool] = False):
        """S^T = K Q^T of a step.  ``per_block`` (``fold_k`` with 64-token K groups): M-block
        0 takes ``tSrQ`` and the last M-block ``tSrQ_last`` (at most two M-blocks a step)."""
        # a fresh tiled MMA per product: its ACCUMULATE field is state that must not
        # escape the loop body it is set in; of K's type (fp16 under fold_k_bf16, the
        # model's for the 16-bit residual)
        mma_s = sm90.make_wgmma(k_frag.element_type, self.nh, a_from_registers=True)
        m_blocks = cute.size(k_frag, mode=[1])
        acc_s = cute.make_rmem_tensor(thr_s.partition_shape_C((M_BLOCK * m_blocks, self.nh)), Float32)
        warpgroup.fence()
        if const_expr(per_block):
            a_g = cute.logical_divide(k_frag, (None, 1))
            c_g = cute.logical_divide(acc_s, (None, 1))
            for mb in cutlass.range_constexpr(m_blocks):
                b = tSrQ if mb == 0 else tSrQ_last
                for kt in cutlass.range_constexpr(self.d // K_BLOCK):
                    mma_s.set(warpgroup.Field.ACCUMULATE, kt != 0)
                    cute.gemm(mma_s, c_g[None, (None, mb), None], a_g[None, (None, mb), kt], b[None, None, kt],
                              c_g[None, (None, mb), None])
        else:
            for kt in cutlass.range_constexpr(self.d // K_BLOCK):
                mma_s.set(warpgroup.Field.ACCUMULATE, kt != 0)
                cute.gemm(mma_s, acc_s, k_frag[None, None, kt], tSrQ[None, None, kt], acc_s)
        warpgroup.commit_group()
        return acc_s

    @cute.jit
    def load_bias(self, bias, sBias, stage, st, scale_log2, lane, mul=None, sShift=None):
        """``fold_k``: the scalers' per-head bias of each M-block's K group in step ``st``,
        times the softmax's log2 scale, for this thread's head columns (``k_shift``: and into
        ``mul`` the row's 2^e times that scale)."""
        c = lane % 4
        for nt in cutlass.range_constexpr(self.nh // 8):
            for v0 in cutlass.range_constexpr(2):
                for mb in cutlass.range_constexpr(self.m_k):
                    g = (st * self.step + mb * M_BLOCK) // self.group
                    bias[2 * nt + v0, mb] = sBias[self.head_of(nt, v0, c), g, stage] * scale_log2
                    if const_expr(mul is not None):
                        mul[2 * nt + v0, mb] = sShift[self.head_of(nt, v0, c), g, stage] * scale_log2

    @cute.jit
    def pv(self, v_frag, tOrP, acc_pv, per_group: cutlass.Constexpr[bool]):
        """acc_pv = V^T P^T of one step (a fresh sum; ``fold`` adds it to O).  ``per_group``:
        the M-blocks of V group ``i`` take P^T copy ``i`` (``fold_v``), else all take copy 0."""
        mma_o = sm90.make_wgmma(self.dtype, self.nh, a_from_registers=True)
        warpgroup.fence()
        if const_expr(per_group and self.p_copies > 1):
            per = self.m_v // self.p_copies  # M-blocks of one V group
            a_g = cute.logical_divide(v_frag, (None, per))
            c_g = cute.logical_divide(acc_pv, (None, per))
            for i in cutlass.range_constexpr(self.p_copies):
                for k in cutlass.range_constexpr(cute.size(v_frag, mode=[2])):
                    mma_o.set(warpgroup.Field.ACCUMULATE, k != 0)
                    cute.gemm(mma_o, c_g[None, (None, i), None], a_g[None, (None, i), k], tOrP[i][None, None, k],
                              c_g[None, (None, i), None])
        else:
            for k in cutlass.range_constexpr(cute.size(v_frag, mode=[2])):
                mma_o.set(warpgroup.Field.ACCUMULATE, k != 0)
                cute.gemm(mma_o, acc_pv, v_frag[None, None, k], tOrP[0][None, None, k], acc_pv)
        warpgroup.commit_group()

    @cute.jit
    def pv_ss(self, tOsV, slot, tOrP, acc_pv):
        """``v_slots``: ``pv`` with the step's V^T read from shared-memory slot ``slot`` (wgmma
        SS); one P^T copy (``fold_v`` with one V group a row)."""
        mma_o = sm90.make_wgmma(self.dtype, self.nh)
        warpgroup.fence()
        for k in cutlass.range_constexpr(self.step // K_BLOCK):
            mma_o.set(warpgroup.Field.ACCUMULATE, k != 0)
            cute.gemm(mma_o, acc_pv, tOsV[None, None, k, slot], tOrP[0][None, None, k], acc_pv)
        warpgroup.commit_group()

    def v_state(self, tile_count, st: int, producer: bool = False):
        """The consumers' (``producer``: the decoding warps') state of the V^T slot of step
        ``st`` of the split's tile number ``tile_count`` (from 0)."""
        return seq_state(tile_count * self.steps + st, self.v_slots, producer)

    def packed_fold(self):
        """A packed P V product's factor into O: 2^24 with ``v_subnormal``, else None (a plain
        add)."""
        return Float32(V_SUB_FOLD) if self.v_subnormal else None

    @cute.jit
    def fold(self, acc_o, acc_pv, scale=None):
        """O += the last P V product (landed: after a wait that covers its wgmma).  Every
        fold is followed by a fresh product before the next one, and acc_pv starts at zero,
        so each product is added once (writing the zeros here instead made ptxas serialize
        the wgmmas).  ``scale`` (``v_subnormal``): the product's factor into O."""
        for i in cutlass.range_constexpr(cute.size(acc_o)):
            if const_expr(scale is None):
                acc_o[i] = acc_o[i] + acc_pv[i]
            else:
                acc_o[i] = acc_o[i] + acc_pv[i] * scale

    def cv(self, v0: int, v1: int, nt: int):
        """Value index of (head 2c + v0 + 8 nt, row g + 8 v1) in a wgmma C fragment."""
        return (v0, v1) if self.nh == 8 else (v0, v1, nt)

    # ---- the softmax's view of the S^T fragment: all of it, or half of it (``half_cols``) --
    @property
    def row_slots(self) -> int:
        """The ``v1`` slots of a C fragment the softmax takes (with ``half_cols`` slot 0
        holds the thread's row after ``gather_rows``)."""
        return 1 if self.half_cols else 2

    def row_of(self, v1: int, c):
        """Row offset (0 or 8, within the thread's 16-row slab past ``g``) of quad lane
        ``c``'s slot ``v1`` (``layouts.sm90.c_slot_v1``)."""
        return sm90.c_slot_v1(v1, c, self.half_cols) * 8

    def head_of(self, nt: int, v0: int, c):
        """The query head of quad lane ``c``'s softmax column ``2 nt + v0``
        (``layouts.sm90.c_slot_head``)."""
        return sm90.c_slot_head(nt, v0, c, self.half_cols)

    @cute.jit
    def gather_rows(self, acc_s, lane):
        """``half_cols``: quad lanes 2 and 3 replace slot 0 of their values (padding heads) by
        slot 1 of quad lane - 2's (heads 0..3, rows g + 8), one butterfly shuffle a value
        (the view ``layouts.sm90`` defines for ``HALF_HEADS_TILE``)."""
        if const_expr(self.half_cols):
            upper = lane % 4 >= 2
            for mb in cutlass.range_constexpr(cute.size(acc_s, mode=[1])):
                for v0 in cutlass.range_constexpr(2):
                    other = cute.arch.shuffle_sync_bfly(acc_s[self.cv(v0, 1, 0), mb, 0], sm90.HALF_SOURCE_XOR)
                    acc_s[self.cv(v0, 0, 0), mb, 0] = cutlass.select_(upper, other, acc_s[self.cv(v0, 0, 0), mb, 0])

    def across_column(self, x, combine):
        """``combine`` of a softmax column's per-thread ``x`` over the threads that share the
        column: its 8 rows' lanes, and with ``half_cols`` the partner quad lane too."""
        x = across_rows(x, combine)
        if const_expr(self.half_cols):
            x = combine(x, cute.arch.shuffle_sync_bfly(x, sm90.HALF_SOURCE_XOR))
        return x

    # ---- softmax ------------------------------------------------------------------------
    @cute.jit
    def softmax_step(self, acc_s, acc_o, row_max, row_sum, scale_log2, red, warp, lane, valid, tok0,
                     lim=None, abs0=0, zsum=None, bias=None, mul=None):
        """Online softmax over one step's S^T (rows = tokens of all four warps), against the
        exact running maximum: ``logits``, ``new_max`` (the cross-warp exchange), then P in
        place of the logits."""
        self.gather_rows(acc_s, lane)
        self.logits(acc_s, scale_log2, warp, lane, valid, tok0, lim, abs0, bias, mul)
        self.new_max(acc_s, acc_o, row_max, row_sum, red, warp, lane, zsum)
        self.exponentiate(acc_s, row_max, row_sum)

    @cute.jit
    def exponentiate(self, acc_s, row_max, row_sum):
        """P = 2^(logit - reference) in place of the logits, summed into the row sums."""
        for nt in cutlass.range_constexpr(self.nh // 8):
            for v0 in cutlass.range_constexpr(2):
                col = 2 * nt + v0
                m_use = self.reference(row_max, col)
                part = Float32(0.0)
                for mb in cutlass.range_constexpr(cute.size(acc_s, mode=[1])):
                    for v1 in cutlass.range_constexpr(self.row_slots):
                        p = cute.math.exp2(acc_s[self.cv(v0, v1, nt), mb, 0] - m_use, fastmath=True)
                        acc_s[self.cv(v0, v1, nt), mb, 0] = p
                        part += p
                row_sum[col] = row_sum[col] + part

    @cute.jit
    def logits(self, acc_s, scale_log2, warp, lane, valid, tok0, lim=None, abs0=0, bias=None, mul=None):
        """S^T in log2 units, in place: masks tokens ``>= valid`` (residual) when ``valid`` is
        given, and with ``lim`` (``causal_limits``) tokens past a column's limit, at sequence
        position ``abs0 + tok0 + row``.  ``bias`` (``fold_k``, already in log2 units): added
        per (head column, M-block); ``mul`` (``k_shift``): the multiplier per (head column,
        M-block) in place of ``scale_log2``."""
        g = lane // 4
        c = lane % 4
        for nt in cutlass.range_constexpr(self.nh // 8):
            for v0 in cutlass.range_constexpr(2):
                for mb in cutlass.range_constexpr(cute.size(acc_s, mode=[1])):
                    for v1 in cutlass.range_constexpr(self.row_slots):
                        s = acc_s[self.cv(v0, v1, nt), mb, 0]
                        if const_expr(mul is not None):
                            x = s * mul[2 * nt + v0, mb] + bias[2 * nt + v0, mb]
                        elif const_expr(bias is not None):
                            x = s * scale_log2 + bias[2 * nt + v0, mb]
                        else:
                            x = s * scale_log2
                        if const_expr(valid is not None):
                            if tok0 + mb * M_BLOCK + warp * SLAB + self.row_of(v1, c) + g >= valid:
                                x = -Float32.inf
                        if const_expr(lim is not None):
                            if abs0 + tok0 + mb * M_BLOCK + warp * SLAB + self.row_of(v1, c) + g > lim[2 * nt + v0]:
                                x = -Float32.inf
                        acc_s[self.cv(v0, v1, nt), mb, 0] = x

    @cute.jit
    def column_max(self, acc_s, nt: int, v0: int):
        """This thread's largest logit of head column ``2 nt + v0`` in the step."""
        m_local = -Float32.inf
        for mb in cutlass.range_constexpr(cute.size(acc_s, mode=[1])):
            for v1 in cutlass.range_constexpr(self.row_slots):
                m_local = cute.arch.fmax(m_local, acc_s[self.cv(v0, v1, nt), mb, 0])
        return m_local

    @cute.jit
    def new_max(self, acc_s, acc_o, row_max, row_sum, red, warp, lane, zsum=None):
        """The running maximum over the step's logits of all four warps (exchanged through
        shared memory, one named barrier), with O, the row sums and the zero sums rescaled
        to it."""
        c, g = lane % 4, lane // 4
        for nt in cutlass.range_constexpr(self.nh // 8):
            for v0 in cutlass.range_constexpr(2):
                m_local = self.across_column(self.column_max(acc_s, nt, v0), cute.arch.fmax)
                if g == 0:  # (with half_cols quad lanes 2, 3 fill the padding heads' slots)
                    red[sm90.c_slot_head(nt, v0, c, False), warp, 0] = m_local
        self.bar(Barrier.MAX)
        for nt in cutlass.range_constexpr(self.nh // 8):
            for v0 in cutlass.range_constexpr(2):
                col = 2 * nt + v0
                head = self.head_of(nt, v0, c)
                m_new = row_max[col]
                for w in cutlass.range_constexpr(WARPS):
                    m_new = cute.arch.fmax(m_new, red[head, w, 0])
                m_old = row_max[col]
                row_max[col] = m_new
                alpha = cute.math.exp2(m_old - self.reference(row_max, col), fastmath=True)
                row_sum[col] = row_sum[col] * alpha
                if const_expr(zsum is not None):
                    for i in cutlass.range_constexpr(self.p_copies):
                        zsum[col, i] = zsum[col, i] * alpha
                for mo in cutlass.range_constexpr(cute.size(acc_o, mode=[1])):
                    for v1 in cutlass.range_constexpr(2):
                        acc_o[self.cv(v0, v1, nt), mo, 0] = acc_o[self.cv(v0, v1, nt), mo, 0] * alpha

    @cute.jit
    def reference(self, row_max, col: int):
        """The maximum P is taken against: the running maximum, or 0 while a column has seen
        only masked tokens (its maximum is -inf)."""
        m = row_max[col]
        return m if m != -Float32.inf else Float32(0.0)

    @cute.jit
    def lazy_softmax(self, acc_s, acc_o, row_max, row_sum, scale_log2, red, warp, lane, tok0, lim, abs0, zsum,
                     bias, mul=None):
        """``softmax_step`` of a packed step, with the cross-warp exchange of maxima only when
        a logit passes the running maximum by more than ``lazy_margin``: the warpgroup
        agrees on that through one barrier that ORs each thread's verdict (``barrier_or``);
        otherwise P is taken against the running maximum as it stands (values up to
        ``2^lazy_margin``) and O, the row sums and the zero sums need no rescaling."""
        self.gather_rows(acc_s, lane)
        self.logits(acc_s, scale_log2, warp, lane, None, tok0, lim, abs0, bias, mul)
        over = -Float32.inf
        for nt in cutlass.range_constexpr(self.nh // 8):
            for v0 in cutlass.range_constexpr(2):
                # -inf - -inf (a column masked so far and now) is NaN, which fmax ignores
                over = cute.arch.fmax(over, self.column_max(acc_s, nt, v0) - row_max[2 * nt + v0])
        if ptx90.barrier_or(self.own_barrier(Barrier.MAX), WG, over > Float32(self.lazy_margin)) != 0:
            self.new_max(acc_s, acc_o, row_max, row_sum, red, warp, lane, zsum)
        self.exponentiate(acc_s, row_max, row_sum)

    @cute.jit
    def store_p(self, acc_s, sP, warp, lane, vs=None, st=0, zsum=None, fp4_order: cutlass.Constexpr[bool] = False):
        """P^T (heads x tokens of the step, K-major) from the S^T accumulators, into copy 0
        of ``sP``.  With ``zsum`` (``fold_v``, a packed step): copy ``i`` takes P times the
        scale of V group ``i`` of each token, and ``zsum`` gathers P times its zero, so
        ``O = V^T(codes) P^T(scaled) + zsum``; ``vs`` are the stage's V params.
        ``fp4_order``: token ``t`` goes to the column whose V^T fragment position holds it
        (FP4's natural V rows, ``sm80.fp4_position``)."""
        c, g = lane % 4, lane // 4
        for mb in cutlass.range_constexpr(cute.size(acc_s, mode=[1])):
            for v1 in cutlass.range_constexpr(self.row_slots):
                tok = mb * M_BLOCK + warp * SLAB + self.row_of(v1, c) + g
                if const_expr(fp4_order):
                    tok = sm80.fp4_fragment_position(tok)
                if const_expr(zsum is None):
                    for nt in cutlass.range_constexpr(self.nh // 8):
                        for v0 in cutlass.range_constexpr(2):
                            sP[self.head_of(nt, v0, c), tok, 0] = self.dtype(acc_s[self.cv(v0, v1, nt), mb, 0])
                else:
                    # the token's (scale, zero) word of each group: row kt of the stage's
                    # params is in fragment order (quad lane g // 2, value g % 2 + 2 v1)
                    kt = (st * self.step + mb * M_BLOCK) // K_BLOCK + warp
                    for i in cutlass.range_constexpr(self.p_copies):
                        word = Uint32(vs[sm80.param_position(kt * self.groups_v + i, g // 2,
                                                             g % 2 + 2 * sm90.c_slot_v1(v1, c, self.half_cols))])
                        scale = ptx.half_to_f32(word, self.is_bf16)
                        # the codes come centered (or the zero sums take the center back
                        # out): v = (code - center) * scale + zero'
                        zero = ptx.half_to_f32(word >> 16, self.is_bf16) + self.v_center * scale
                        scale_p, back = scale, None
                        if const_expr(self.v_subnormal):
                            scale_p, back = self.subnormal_factors(kt, v1, c, scale)
                        for nt in cutlass.range_constexpr(self.nh // 8):
                            for v0 in cutlass.range_constexpr(2):
                                p = acc_s[self.cv(v0, v1, nt), mb, 0]
                                h = self.dtype(p * scale_p)
                                sP[self.head_of(nt, v0, c), tok, i] = h
                                zsum[2 * nt + v0, i] = zsum[2 * nt + v0, i] + p * zero
                                if const_expr(back is not None):
                                    zsum[2 * nt + v0, i] = zsum[2 * nt + v0, i] + Float32(h) * back
        cute.arch.fence_proxy("async.shared", space="cta")  # wgmma reads sP through the async proxy
        self.bar(Barrier.P)

    def subnormal_factors(self, kt, v1: int, c, scale):
        """``store_p``'s factors for one token with ``v_subnormal`` (raw codes read ``(code <<
        offset) 2^-24``): P^T's scale ``scale / mult``, and ``-center mult``, what the zero
        sums take of ``h = fp16(p scale / mult)`` beside ``p (zero + center scale)``.  O then
        gets ``sum P' scale (code - center) + sum P zero`` with ``P' = h mult / scale``, the P
        the product got, so P's rounding (and fp16's underflow of small ``p scale / mult``)
        costs ``scale (code - center)`` a token, mixed in sign, as with centered codes: the
        zero sums on ``p`` alone left ``P' scale code`` of one sign (a bias over a 2^20-token
        split: 0.0046 against 0.0021, H200), and on ``P'`` alone a token whose ``h``
        underflows lost its zero too (flat V tokens of large offset under a peaked softmax;
        a CPU model of the three, profiles/NOTES.md)."""
        # the token's pair of its V word
        one = nibble(self.v_mult_log2, 2 * (kt % self.kpw_v) + self.row_of(v1, c) // 8) == Uint32(0)
        mult = 1 << self.v_sub_room
        scale_p = scale * cutlass.select_(one, Float32(1.0), Float32(1.0 / mult))
        back = cutlass.select_(one, Float32(-self.v_center), Float32(-self.v_center * mult))
        return scale_p, back

    def v_dequant(self) -> WordDequant:
        """V's dequantization: codes centered by ``v_center``, or with ``v_subnormal`` the raw
        codes as subnormals (``v_sub_room``)."""
        if self.v_subnormal:
            return WordDequant(self.v_bits, self.is_bf16, 0, self.v_bits + self.v_sub_room)
        return WordDequant(self.v_bits, self.is_bf16, self.v_center)

    # ---- the 16-bit residual block --------------------------------------------------------
    @cute.jit
    def residual(self, thr_s, thr_o, tSrQ, tOrP, sP, storage, mKr, mVr, batch, head_kv, n_res,
                 acc_o, acc_pv, row_max, row_sum, scale_log2, red, warp, lane, tid, lim, abs_first, zsum=None,
                 pend=None, early=None):
        """The ``n_res`` 16-bit tokens of ``mKr`` / ``mVr`` (the residual block or the sink
        tokens; row 0 is sequence position ``abs_first``) in 64-token sub-tiles, staged in the
        idle K / V rings; ``early``: the first sub-tile's (K, V) buffers, copied already
        (``early_residual``; this thread's copies are its only ones in flight)."""
        sK, sV = self.residual_tiles(storage.sKp.data_ptr(), storage.sVp.data_ptr())
        mma16 = sm80.make_mma(self.dtype)
        first = 0
        if const_expr(early is not None):
            pend = self.land_product(acc_o, acc_pv, pend)  # (the last packed one: it has read sP)
            cute.arch.cp_async_wait_group(0)
            self.bar(Barrier.EPI)  # every thread's rows of the early copy have landed
            self.residual_products(thr_s, thr_o, tSrQ, tOrP, sP, early[0], early[1], mma16, n_res, abs_first,
                                   acc_o, acc_pv, row_max, row_sum, scale_log2, red, warp, lane, lim, zsum)
            first = 1
        for sub in cutlass.range(first, (n_res + M_BLOCK - 1) // M_BLOCK, unroll=1):
            pend = self.land_product(acc_o, acc_pv, pend)  # (it has read sP and its V^T registers)
            self.bar(Barrier.EPI)  # every warp is done with the previous sub-tile's smem
            self.copy_residual_rows((sK, sV), mKr, mVr, batch, head_kv, sub, n_res, tid)
            cute.arch.cp_async_wait_group(0)
            self.bar(Barrier.EPI)
            self.residual_products(thr_s, thr_o, tSrQ, tOrP, sP, sK, sV, mma16, n_res - sub * M_BLOCK,
                                   abs_first + sub * M_BLOCK, acc_o, acc_pv, row_max, row_sum, scale_log2, red, warp,
                                   lane, lim, zsum)
        return pend

    def land_product(self, acc_o, acc_pv, pend):
        """Waits for the last P V product and folds it into O with its factor ``pend``;
        returns the factor of the products after it (16-bit ones: 1, where ``pend`` is not
        None)."""
        warpgroup.wait_group(0)
        self.fold(acc_o, acc_pv, pend)
        return None if const_expr(pend is None) else Float32(1.0)

    def residual_tiles(self, k_ptr, v_ptr):
        """(sK, sV): one 64-token sub-tile of 16-bit K and V rows at ``k_ptr`` / ``v_ptr``,
        K-major 128B-swizzled (the swizzle on the pointer, as for every sm90 tile)."""
        layout = sm90.make_operand_smem_layout(self.dtype, M_BLOCK, self.d)
        return tuple(cute.make_tensor(cute.recast_ptr(ptr, layout.inner, dtype=self.dtype), layout.outer)
                     for ptr in (k_ptr, v_ptr))

    def residual_buffers(self, ptr):
        """``early_residual``: (sK, sV) of the first sub-tile in its own buffer at ``ptr``."""
        return self.residual_tiles(ptr, ptr + self.res_tile)

    def copy_residual_rows(self, tiles, mKr, mVr, batch, head_kv, sub, n_res, tid):
        """cp.async of sub-tile ``sub`` of the ``n_res`` rows into ``tiles`` (rows past them
        zero), by consumer 0's ``tid``; committed."""
        sK, sV = tiles
        valid = n_res - sub * M_BLOCK
        gK = cute.local_tile(mKr[batch, None, head_kv, None], (M_BLOCK, self.d), (sub, 0))
        gV = cute.local_tile(mVr[batch, None, head_kv, None], (M_BLOCK, self.d), (sub, 0))
        if const_expr(self.fp4):  # K's channels in Q's order
            self.copy_fp4_order(assume_aligned(gK), sK, valid, tid, WG)
        else:
            copy_rows(assume_aligned(gK), sK, tid, WG, valid, True)
        copy_rows(assume_aligned(gV), sV, tid, WG, valid, True)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def residual_products(self, thr_s, thr_o, tSrQ, tOrP, sP, sK, sV, mma16, valid, abs_first, acc_o, acc_pv,
                          row_max, row_sum, scale_log2, red, warp, lane, lim, zsum):
        """One staged 16-bit sub-tile (``valid`` rows, the first at sequence position
        ``abs_first``): its scores, a softmax step, and its P V product issued into acc_pv."""
        sVt = cute.composition(sV, cute.make_layout((self.d, M_BLOCK), stride=(M_BLOCK, 1)))  # (channels, tokens)
        k_frag = load_a_fragments(mma16, cute.local_tile(sK, (SLAB, self.d), (warp, 0)), lane, False)
        acc_s = self.scores(thr_s, k_frag, tSrQ)
        v_frag = cute.make_rmem_tensor(thr_o.partition_shape_A((M_BLOCK * self.m_v, M_BLOCK)), self.dtype)
        for mb in cutlass.range_constexpr(self.m_v):
            part = load_a_fragments(mma16, cute.local_tile(sVt, (SLAB, M_BLOCK), (mb * WARPS + warp, 0)),
                                    lane, True)
            dst = v_frag[None, mb, None]
            for i in cutlass.range_constexpr(cute.size(part)):
                dst[i] = part[i]
        warpgroup.wait_group(0)
        self.softmax_step(acc_s, acc_o, row_max, row_sum, scale_log2, red, warp, lane, valid, 0,
                          lim, abs_first, zsum)
        self.store_p(acc_s, sP, warp, lane)  # 16-bit V: plain P, no zero sums
        self.pv(v_frag, tOrP, acc_pv, False)

    # ---- epilogue -----------------------------------------------------------------------
    @cute.jit
    def epilogue(self, acc_o, row_max, row_sum, red, mO, mLSE, batch, head_kv, split_idx, gq, warp, lane,
                 zsum=None):
        c, g = lane % 4, lane // 4
        nt_count = self.nh // 8
        for col in cutlass.range_constexpr(2 * nt_count):
            row_sum[col] = self.across_column(row_sum[col], operator.add)
            if const_expr(zsum is not None):
                for i in cutlass.range_constexpr(self.p_copies):
                    zsum[col, i] = self.across_column(zsum[col, i], operator.add)
        if g == 0:
            for nt in cutlass.range_constexpr(nt_count):
                for v0 in cutlass.range_constexpr(2):
                    red[sm90.c_slot_head(nt, v0, c, False), warp, 1] = row_sum[2 * nt + v0]
                    if const_expr(zsum is not None):
                        for i in cutlass.range_constexpr(self.p_copies):
                            red[sm90.c_slot_head(nt, v0, c, False), warp, 2 + i] = zsum[2 * nt + v0, i]
        self.bar(Barrier.EPI)
        for nt in cutlass.range_constexpr(nt_count):
            for v0 in cutlass.range_constexpr(2):
                head = sm90.c_slot_head(nt, v0, c, False)  # O^T's columns: the whole C fragment
                total = Float32(0.0)
                for w in cutlass.range_constexpr(WARPS):
                    total += red[head, w, 1]
                inv = Float32(0.0) if total == Float32(0.0) else 1.0 / total
                if head < gq:
                    qh = head_kv * gq + head
                    for mo in cutlass.range_constexpr(cute.size(acc_o, mode=[1])):
                        zero_part = Float32(0.0)  # sum_t p_t zero_t of this M-block's V group
                        if const_expr(zsum is not None):
                            for w in cutlass.range_constexpr(WARPS):
                                zero_part += red[head, w, 2 + mo // (self.m_v // self.p_copies)]
                        for v1 in cutlass.range_constexpr(2):
                            d = mo * M_BLOCK + warp * SLAB + 8 * v1 + g
                            o = (acc_o[self.cv(v0, v1, nt), mo, 0] + zero_part) * inv
                            if const_expr(self.split):
                                mO[split_idx, batch, qh, d] = o
                            else:
                                mO[batch, qh, d] = self.dtype(o)
                    if warp == 0 and g == 0:
                        lse = -Float32.inf
                        if total > Float32(0.0):
                            lse = (row_max[2 * nt + v0] + cute.math.log2(total, fastmath=True)) * LN_2
                        if const_expr(self.split):
                            mLSE[split_idx, batch, qh] = lse
                        else:
                            mLSE[batch, qh] = lse

