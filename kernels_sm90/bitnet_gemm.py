"""BitNet W2A8 GEMM on Hopper: ``wgmma.mma_async m64nNk32`` s8 x s8 -> s32, A from registers,
warp-specialized around a TMA / bulk-copy ring.

Operands.  The 2-bit weights are the wgmma A operand (64 rows per consumer warpgroup,
decoded in registers: wgmma RS), the int8 tokens are B (N = ``block_m`` tokens, read by
wgmma from a K-major 128B-swizzled shared-memory tile), so the accumulators hold
``out.T``.  CuTe DSL 4.8.1 has the int8 wgmma atom (``warpgroup.MmaI8Op``, sm_90a), so
the MMA, its shared-memory descriptors and the fragment layouts all come from CuTe.

Decode.  wgmma reads B in natural k order, so A must be in natural order too: per
32-column k-step, A register ``j`` of lane ``(g, tq)`` is decode step ``tq`` of the word
``layouts.bitnet.kstep_word_offset(g, j)`` of the 16 x 32 tile (two rows x two
16-column halves).  The four lanes of a quad read the same word (a shared-memory
broadcast), so there is no bank conflict and no shuffle.  Each register is decoded
straight to the signed weights ``c - 2`` (shift, lop3, sub, xor: ``decode_s8``), so the
MMA is s8 x s8 and needs no correction by the token sums.

Roles.  Warp 0 of the producer warpgroup (registers handed to the consumers with
``setmaxnreg``) fills a ``cutlass.pipeline.PipelineTmaAsync`` ring, one stage per
128-column group: one TMA box of the ``block_m`` x 128 token tile (tokens past M are
zero-filled by TMA) and one 512-byte bulk copy per 16-row weight stripe (a stripe's group
is one contiguous run), all completing on the stage's mbarrier.  Each consumer warpgroup
waits for a stage, decodes its 64 rows into one of two A register sets, issues the
group's four wgmmas and keeps them in flight while it decodes the next group
(``wait_group(1)``); a stage is released once the wgmmas that read it are done.  There is
no CTA-wide barrier in the loop: the warpgroups run ahead of each other and of the loads as
far as the ring lets them.  (The previous kernel, cp.async by every thread and a
``__syncthreads`` per group, kept only two groups of loads in flight and its warpgroups in
lock step: with its wgmmas removed it still took 489 us at M = 4096, 20480 x 3200, against
640 us in all, H200; profiles/NOTES.md.)

Programmatic dependent launch (``pdl``, up to ``PDL_MAX_M`` tokens): every thread waits for
the previous grid before its first global access (x, the scales, the weights, out, the
split workspace), and each CTA lets the next grid launch once it is past that wait, so the
next GEMM's launch and prologue (barrier init, descriptor prefetch, setmaxnreg) overlap
this one's drain.  Nothing is read before the wait: with the first stages' weights
requested before it the next CTAs' copies competed with ours (H200, thirty-third session:
M = 256 1.2-1.5x slower; db2e5cb measured the same on an earlier kernel), and a trigger
after the main loop instead of at the wait lost 7-18 % at M = 256 (profiles/NOTES.md).

Persistent grid.  Where a tile runs one CTA an SM and the tiles outnumber the SMs
(``persistent_plan``), one CTA an SM walks the tiles round-robin: the producer's ring runs
on across tiles, so the next tile's first stages land while the consumers run this one's
epilogue, which stages the output in a buffer of its own instead of the token ring.

Split-K.  Tiles that do not fill the last wave are split along K (``split_plan``): each
split stores its int32 sums in a workspace, and the last of a tile to arrive adds them and
stores the tile (``sum_splits``).  Where the tiles leave half the CTA slots idle (small M)
each tile is instead a thread-block cluster whose CTAs split K (``cluster_plan``): the
others' sums reach the first CTA's shared memory through ``st.async`` (``sum_cluster``),
with no global round trip.  Each variant is compiled only where the host's plan needs it
(``split_k``, ``cluster_k``): the split arithmetic costs whole tiles 0.5-1 us a call.

Epilogue.  The scaled bf16 (or raw int32) results go through shared memory (the token
ring, free once every consumer is done) transposed to ``out``'s [token, row] order, then
out in 16-byte row-contiguous stores (a fragment's own stores would write 16 of every 32
bytes).  The scaling divides by the token's scale through its reciprocal with one exact
correction (``scale_out_rcp``: the same bits as ``div.rn``), the bf16 pairs are
transposed on the way by ``stmatrix .trans`` (``layouts.sm90.acc_stsm_*``): ~880
instructions a thread where a division and a 16-bit store per value took ~2800.
"""


from dataclasses import dataclass, replace

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup

from ..kernels_sm80.bitnet_ptx import (
    WARP,
    copy16_s2g,
    decode_s8,
    lds_b32,
    load_v4,
    lds_v4,
    matmul_fake_args,
    scale_out_rcp,
    segment_scale,
    store_i32,
    store_v4,
)
from ..kernels_sm80.ptx import cvt_pack_x2, rcp_rn
from ..layouts import bitnet as fmt
from ..layouts import resources, sm90
from . import ptx90
from .rings import seq_state

WG_ROWS = sm90.WGMMA_M  # weight rows per consumer warpgroup (the wgmma M)
WG_THREADS = sm90.WARPGROUP_THREADS
WG_STRIPES = WG_ROWS // fmt.TILE_N  # 16-row weight stripes per warpgroup (one per warp)
STAGE_W_BYTES = WG_STRIPES * fmt.GROUP_BYTES  # 2 KB per warpgroup and stage
X_ROW_BYTES = fmt.GROUP_K  # one token's 128 bytes of a group
KSTEPS = fmt.GROUP_K // fmt.TILE_K  # wgmma k-steps per group
A_BUFFERS = 2  # A register sets: the group being decoded and the one the wgmmas read
PRODUCER_REGS = 40  # the producer warpgroup only issues copies
MAX_REGS = 240  # what a consumer asks for at most (setmaxnreg allows 256)


class Barrier:
    """Named barriers (id 0 is __syncthreads)."""

    EPI = 1  # the consumer warpgroups: every wgmma is done, the token ring may hold the output


@dataclass(frozen=True)
class WgmmaConfig:
    """``block_m``: tokens per CTA (the wgmma N); ``warpgroups``: consumer warpgroups, 64
    weight rows each, sharing each token tile; ``stages``: depth of the ring;
    ``ctas_per_sm``: the residency the registers are split for."""

    block_m: int = 128
    warpgroups: int = 2
    stages: int = 4
    raw: bool = False  # store the int32 sums instead of the scaled bf16 output
    ctas_per_sm: int = 1
    # split-K of a partial last wave (``split_plan``): the most CTAs a tile is split into
    # (the last one reads every other's partial tile back through L2) and what a split
    # costs (storing, counting, reading back), in this tile's 128-column groups
    max_splits: int = 4
    split_cost_groups: int = 16
    # compiled with the split-K tail (a 1-D grid walked by ``CtaWork.of``, ``sum_splits``);
    # without it a CTA's tile is its 2-D block index and its K loop the whole of K: the
    # split arithmetic and the branch around the epilogue cost whole tiles 0.5-0.9 us a call
    # (H200, nineteenth session), so the host takes this variant only for a plan with tails
    split_k: bool = False
    # K split over the CTAs of a thread-block cluster (``cluster_plan``): each of the
    # ``cluster_k`` CTAs of a tile takes a run of K groups, the others store their int32
    # sums into the first one's token ring through distributed shared memory
    cluster_k: int = 1
    # ``cluster_plan``: a cluster CTA per this many K groups (0: this tile never splits so)
    cluster_groups: int = 0
    # programmatic dependent launch (``pdl_plan``): wait for the previous grid before the
    # first global access, then let the next one launch
    pdl: bool = False
    # a persistent grid of this many CTAs (``persistent_plan``; 0: a CTA a tile): CTA ``b``
    # takes tiles b, b + persistent, .. with the ring running on from tile to tile, so the
    # next tile's first stages load while this one's epilogue runs (the output is staged in
    # its own buffer, not in the token ring)
    persistent: int = 0
    # The epilogue loads its rows' segment scales after the main loop's last barrier: a
    # global round trip between the last wgmma and the scaled stores, on every tile's path.
    # ``early_scales`` loads them before the main loop (two fp32 registers a consumer
    # thread).  H200, one run, us, the host's plan without / with
    # (profiles/h200/gemm_variants_early_scales.json): M = 256 4800 x 3200 11.53 / 11.53,
    # 2560 x 2560 6.74 / 6.48, 2560 x 6912 14.09 / 14.04, 13824 x 2560 20.55 / 20.33,
    # 20480 x 3200 37.74 / 35.33; M = 1024 32.24 / 31.28, 13.99 / 14.33, 34.45 / 32.62,
    # 66.89 / 63.21, 104.79 / 105.36.
    early_scales: bool = True

    def __post_init__(self):
        assert self.block_m in (64, 96, 128, 192, 256) and self.warpgroups in (1, 2) and self.stages >= 2
        assert self.ctas_per_sm in (1, 2, 3)
        assert 1 <= self.cluster_k <= self.max_cluster_k and not (self.split_k and self.cluster_k > 1)
        assert not self.persistent or (not self.split_k and self.cluster_k == 1)
        assert not self.persistent or self.persistent_fits, self

    @property
    def tile_sum_bytes(self) -> int:
        """A tile's int32 sums (one K split's share of a cluster's reduction)."""
        return self.block_m * self.block_n * 4

    @property
    def max_cluster_k(self) -> int:
        """CTAs a cluster split may have: the first one's token ring holds the others' sums."""
        return 1 + self.x_ring_bytes // self.tile_sum_bytes

    @property
    def threads(self) -> int:
        """Consumer threads (the producer warpgroup comes on top)."""
        return WG_THREADS * self.warpgroups

    @property
    def block_threads(self) -> int:
        return self.threads + WG_THREADS

    @property
    def block_n(self) -> int:
        return WG_ROWS * self.warpgroups

    @property
    def out_bytes(self) -> int:
        return 4 if self.raw else 2

    @property
    def out_row_bytes(self) -> int:
        """Bytes per token row of the staged output tile."""
        return sm90.staged_row_bytes(self.block_n * self.out_bytes)

    @property
    def x_stage_bytes(self) -> int:
        return self.block_m * X_ROW_BYTES

    @property
    def w_stage_bytes(self) -> int:
        return self.warpgroups * STAGE_W_BYTES

    @property
    def out_stage_bytes(self) -> int:
        """The staged output tile."""
        return self.block_m * self.out_row_bytes

    @property
    def persistent_smem_bytes(self) -> int:
        """Shared memory of the persistent variant: its storage struct's size."""
        return shared_storage(self, persistent=True).size_in_bytes()

    @property
    def persistent_fits(self) -> bool:
        """Whether the persistent variant fits in a CTA's shared memory (the int32 output of
        256-token tiles does not, beside their rings)."""
        return self.persistent_smem_bytes <= resources.HOPPER_CTA_SMEM_BYTES

    @property
    def resident(self) -> bool:
        """Whether ``ctas_per_sm`` CTAs of this config fit one SM's shared memory (the
        registers are split for them by construction: ``entry_regs``)."""
        smem = shared_storage(self, bool(self.persistent)).size_in_bytes()
        return self.ctas_per_sm <= resources.smem_ctas_per_sm(smem)

    @property
    def persistent_capable(self) -> bool:
        """Whether this tile can run a persistent grid: one CTA an SM, and its variant's
        staging fits in shared memory (``persistent_plan`` decides where it pays)."""
        return self.ctas_per_sm == 1 and self.persistent_fits

    def token_ring_bytes(self, persistent: bool) -> int:
        """The token ring, which the staged output tile reuses (a persistent CTA's ring
        holds the next tile's tokens by then: it stages in a buffer of its own)."""
        ring = self.stages * self.x_stage_bytes
        return ring if persistent else max(ring, self.out_stage_bytes)

    @property
    def x_ring_bytes(self) -> int:
        return self.token_ring_bytes(bool(self.persistent))

    @property
    def entry_regs(self) -> int:
        """Registers per thread at launch: ptxas's cap for ``ctas_per_sm`` CTAs an SM."""
        return resources.launch_registers(self.ctas_per_sm, self.block_threads)

    @property
    def consumer_regs(self) -> int:
        """Registers per consumer thread after setmaxnreg (``resources.consumer_registers``:
        more would deadlock)."""
        return resources.consumer_registers(self.ctas_per_sm, WG_THREADS, PRODUCER_REGS, self.threads, MAX_REGS)


# Tiles by M, from the H200 sweep of this kernel over 2560 x 2560, 2560 x 6912, 3200 x 10240,
# 20480 x 3200 and 13824 x 2560 at M = 64 / 256 / 1024 / 4096 (profiles/NOTES.md, seventeenth
# session): the pick is the sweep's best (within 1 %) at 14 of the 15 points from M = 256,
# 17 % off at M = 256, 13824 x 2560.  Two warpgroups sharing a 256-token tile (1 CTA an
# SM) halve the token traffic per MAC and win from 1024 tokens; below, shorter
# single-warpgroup CTAs, two an SM, give the GPU enough of them.
# The split costs: H200, split against whole tiles on the eight shapes at M = 64 / 256 /
# 1024 / 4096 (profiles/NOTES.md, eighteenth session).
# The cluster splits: H200, whole vs 2-5 CTAs a cluster on the eight shapes at M = 64 /
# 256 / 1024 (nineteenth session); the 256 x 128 tile (one an SM) lost at every count.
SMALL = WgmmaConfig(block_m=64, warpgroups=1, stages=8, ctas_per_sm=2, max_splits=6, split_cost_groups=23,
                    cluster_groups=10)
MEDIUM = WgmmaConfig(block_m=128, warpgroups=1, stages=6, ctas_per_sm=2, max_splits=6, split_cost_groups=28,
                     cluster_groups=32)
LARGE = WgmmaConfig(block_m=256, warpgroups=2, stages=4, ctas_per_sm=1, max_splits=4, split_cost_groups=16)
# Three quarters of MEDIUM / LARGE's tokens, where they leave the busiest SM fewer token
# rows (``_shorter``): e.g. a grid of at most a CTA an SM either way takes one tile's time,
# and a shorter tile takes less (H200, twentieth session, us: M = 256 2560 x 2560 7.92 ->
# 7.37, 2560 x 6912 15.8 -> 14.8; M = 1024 2560 x 2560 17.1 -> 14.8, 2560 x 6912 36.6 ->
# 31.2; profiles/NOTES.md).  No cluster split (``cluster_groups`` 0: none was measured).
MEDIUM_96 = replace(MEDIUM, block_m=3 * MEDIUM.block_m // 4, cluster_groups=0)
LARGE_192 = replace(LARGE, block_m=3 * LARGE.block_m // 4)
MEDIUM_M = 128  # above this many tokens, MEDIUM
LARGE_M = 1024  # from this many, LARGE unless MEDIUM needs fewer waves (``config_for``)
# A wave of MEDIUM tiles (two 128 x 64 tiles an SM) takes this fraction of a wave of LARGE
# ones (one 256 x 128 tile an SM: 2x the MACs, half the token traffic per MAC): H200, M =
# 1024, 20480 x 3200, 10 vs 5 whole waves, 131.8 vs 101.5 us (nineteenth session)
MEDIUM_WAVE = 0.65


def _waves(cfg: WgmmaConfig, m: int, n: int, sms: int) -> int:
    return -(-tile_count(cfg, m, n) // (sms * cfg.ctas_per_sm))


# Take the shorter tile where it puts at most this share of the busiest SM's token rows
# (``_shorter``): a 192-token tile does ~12 % less a token than a 256-token one (H200, M =
# 1024, 2560 x 2560: one tile an SM either way, 25 % fewer tokens, 13.5 % less time)
SHORT_GAIN = 0.8


def _busiest_rows(cfg: WgmmaConfig, m: int, n: int, sms: int) -> int:
    """Token rows of tiles on the busiest SM, tiles dealt evenly over the SMs."""
    return -(-tile_count(cfg, m, n) // sms) * cfg.block_m


def _shorter(cfg: WgmmaConfig, short: WgmmaConfig, m: int, n: int, sms: int) -> WgmmaConfig:
    """``short`` (fewer tokens a tile) where it leaves the busiest SM ``SHORT_GAIN`` of the
    token rows or less: grids of at most a CTA an SM either way (M = 256, 2560 x 2560: 80
    tiles of 128 tokens or 120 of 96 for 132 SMs, one tile's time either way), or two tiles
    on the busiest SM either way (M = 256, 4800 x 3200: 150 or 225 tiles)."""
    gain = _busiest_rows(short, m, n, sms) / _busiest_rows(cfg, m, n, sms)
    return short if gain <= SHORT_GAIN else cfg


def config_for(m: int, n: int, sms: int) -> WgmmaConfig:
    """The tile by M; from ``LARGE_M`` tokens LARGE unless MEDIUM's waves take less time
    (its finer tiles fill a last wave that LARGE leaves mostly empty: M = 1024, 4800 x
    3200, 152 LARGE tiles = 2 waves for 132 SMs, 37.9 us against MEDIUM's 31.8, the only
    such shape of the eight at M = 1024 and 4096); the shorter tiles where they leave the
    busiest SM fewer token rows (``_shorter``)."""
    if m >= LARGE_M:
        if MEDIUM_WAVE * _waves(MEDIUM, m, n, sms) < _waves(LARGE, m, n, sms):
            return MEDIUM
        return _shorter(LARGE, LARGE_192, m, n, sms)
    return _shorter(MEDIUM, MEDIUM_96, m, n, sms) if m > MEDIUM_M else SMALL


def grid_for(cfg: WgmmaConfig, m, n):
    """(token tiles, weight-row tiles): host ints or the kernel's traced sizes."""
    return ((m + cfg.block_m - 1) // cfg.block_m, (n + cfg.block_n - 1) // cfg.block_n)


def tile_count(cfg: WgmmaConfig, m, n):
    tiles_m, tiles_n = grid_for(cfg, m, n)
    return tiles_m * tiles_n


# Split-K of the last partial wave.  A tile is one CTA's whole K loop, so tiles that do
# not fill the last wave (or a first wave: 40 tiles of 64 x 64 at M = 64, N = 2560) leave
# SMs idle for a tile's time.  Those tail tiles are split along K instead, each into as
# many CTAs as the idle slots allow (at most ``max_splits``, at least this many 128-column
# groups each), when the groups that saves outweigh ``split_cost_groups``; the splits
# leave their int32 sums in a workspace and the last one of a tile adds them up (exact, in
# any order) and stores the tile.
MIN_SPLIT_GROUPS = 2


def split_plan(cfg: WgmmaConfig, m: int, n: int, k: int, sms: int):
    """(full tiles, splits per tail tile, tail tiles): the first ``full`` tiles (in launch
    order) run whole, each of the last ``tail`` as ``splits`` CTAs over K."""
    tiles = tile_count(cfg, m, n)
    slots = sms * cfg.ctas_per_sm
    tail = tiles % slots
    groups = k // fmt.GROUP_K
    splits = min(slots // tail, cfg.max_splits, groups // MIN_SPLIT_GROUPS) if tail else 1
    if splits <= 1 or groups * (splits - 1) < cfg.split_cost_groups * splits:
        return tiles, 1, 0
    return tiles - tail, splits, tail


# K split over a cluster's CTAs, where the tiles leave at least half of the CTA slots idle
# (a first partial wave: 40 tiles of 64 x 64 at M = 64, N = 2560).  Each CTA streams only
# its run of K through the SM (at M = 64 a CTA's time is its token and weight bytes), and
# the sums meet in shared memory, where the workspace split (``split_plan``) pays a global
# store, fence, count and read-back: M = 64, 2560 x 2560, whole 7.28 us, 2 CTAs a cluster
# 6.12, the workspace split 8.5 (H200).
MAX_CLUSTER_K = 4


def cluster_plan(cfg: WgmmaConfig, m: int, n: int, k: int, sms: int) -> int:
    """CTAs per cluster (1: no cluster split): one per ``cfg.cluster_groups`` K groups, at
    most ``MAX_CLUSTER_K`` (and what the first CTA's ring holds), only while every tile's
    cluster fits in the CTA slots."""
    tiles = tile_count(cfg, m, n)
    slots = sms * cfg.ctas_per_sm
    if not cfg.cluster_groups or 2 * tiles > slots:
        return 1
    groups = k // fmt.GROUP_K
    return max(1, min(groups // cfg.cluster_groups, MAX_CLUSTER_K, cfg.max_cluster_k, slots // tiles))


# Programmatic dependent launch up to this many tokens.  H200, two runs over the eight
# shapes at M = 64 / 256 / 1024 / 4096, graph replay of back-to-back GEMMs, time with PDL
# over without (profiles/h200/gemm_variants_pdl*.json): M = 64 0.85-0.97, M = 256 0.89-0.98,
# M = 1024 0.94-1.01; M = 4096 0.98-1.02 but 13824 x 2560 1.04 in both runs.
PDL_MAX_M = 1024


def pdl_plan(m: int) -> bool:
    """Whether a GEMM of ``m`` tokens launches with PDL (``WgmmaConfig.pdl``), where the
    GPU and ``$BITDECODE_PDL`` allow it."""
    return m <= PDL_MAX_M


# A persistent grid (``WgmmaConfig.persistent``) for one-CTA-an-SM tiles with more tiles
# than SMs and K of at most this many 128-column groups.  H200, one run, time persistent
# over a CTA a tile (profiles/h200/gemm_variants_persistent.json): M = 1024 13824 x 2560
# 0.915, 20480 x 3200 0.956; M = 4096, K <= 3200: 0.98-1.02 (2560 x 2560 0.980, 20480 x 3200
# 0.981, 3200 x 3200 1.020); longer K lost (2560 x 6912 1.018, 3200 x 10240 1.099: the tiles
# are dealt round-robin, where a CTA a tile lets an SM that finished early take the next).
PERSISTENT_MAX_GROUPS = 25


def persistent_plan(cfg: WgmmaConfig, m: int, n: int, k: int, sms: int) -> int:
    """CTAs of a persistent grid for this GEMM (0: a CTA a tile): one per SM where the tile
    runs one CTA an SM, there are more tiles than SMs, K is at most
    ``PERSISTENT_MAX_GROUPS`` groups and the variant's staging fits in shared memory."""
    if not cfg.persistent_capable or tile_count(cfg, m, n) <= sms or k // fmt.GROUP_K > PERSISTENT_MAX_GROUPS:
        return 0
    return sms


def k_bounds(part, parts, total_groups):
    """(first group, end group) of K part ``part`` of ``parts`` (host ints or traced values)."""
    return part * total_groups // parts, (part + 1) * total_groups // parts


class CtaWork:
    """What CTA ``bid`` of the 1-D grid computes (traced values): token / row tile ``bm``,
    ``bn`` (launch order: token tiles fastest, so CTAs in flight share weight rows), K groups
    ``group0 .. + groups``, its tile's ``splits`` (1: a whole tile) and, split, which
    ``part`` of them it is and the tile's index ``tail`` among the tail tiles (its
    workspace slots and count)."""

    def __init__(self, bm, bn, group0, groups, splits, part, tail):
        self.bm, self.bn, self.group0, self.groups = bm, bn, group0, groups
        self.splits, self.part, self.tail = splits, part, tail

    @staticmethod
    def of(bid, full_tiles, splits, total_groups, tiles_m):
        in_tail = bid >= full_tiles
        j = bid - full_tiles
        tile = cutlass.select_(in_tail, full_tiles + j // splits, bid)
        part = cutlass.select_(in_tail, j % splits, Int32(0))
        parts = cutlass.select_(in_tail, splits, Int32(1))
        group0, group1 = k_bounds(part, parts, total_groups)
        return CtaWork(tile % tiles_m, tile // tiles_m, group0, group1 - group0, parts, part, tile - full_tiles)

    @staticmethod
    def cluster(total_groups, cluster_k: int):
        """A CTA of a cluster split: the clusters tile the 2-D grid's x, the CTA's rank in
        its cluster is its ``part`` of K."""
        bx, bn, _ = cute.arch.block_idx()
        part = bx % cluster_k
        group0, group1 = k_bounds(part, cluster_k, total_groups)
        return CtaWork(bx // cluster_k, bn, group0, group1 - group0, Int32(cluster_k), part, Int32(0))

    @staticmethod
    def tile(t, tiles_m, total_groups):
        """Tile ``t`` of a persistent CTA (launch order as ``of``), the whole of K."""
        return CtaWork(t % tiles_m, t // tiles_m, Int32(0), total_groups, Int32(1), Int32(0), Int32(0))

    @staticmethod
    def whole(total_groups):
        """A CTA of the 2-D grid of a launch without split tiles: the whole of K."""
        bm, bn, _ = cute.arch.block_idx()
        return CtaWork(bm, bn, Int32(0), total_groups, Int32(1), Int32(0), Int32(0))


def shared_storage(cfg: WgmmaConfig, persistent: bool):
    """The kernel's shared memory for ``cfg`` (``persistent``: with the staged output tile of
    its own that a persistent CTA needs; a plain Python struct, so the host can size it)."""
    x_ring_bytes = cfg.token_ring_bytes(persistent)

    @cute.struct
    class Storage:
        mbar: cute.struct.MemRange[cutlass.Int64, 2 * cfg.stages]
        sX: cute.struct.Align[cute.struct.MemRange[cutlass.Int8, x_ring_bytes], 1024]
        sW: cute.struct.Align[cute.struct.MemRange[cutlass.Int8, cfg.stages * cfg.w_stage_bytes], 128]
        sXScale: cute.struct.MemRange[Float32, cfg.block_m]  # the tile's token scales
        sXRcp: cute.struct.MemRange[Float32, cfg.block_m]  # and their reciprocals
        flag: cute.struct.MemRange[Int32, 1]  # a split CTA learned it is its tile's last
        sums_bar: cute.struct.MemRange[cutlass.Int64, 1]  # a cluster split's sums have landed

    if not persistent:
        return Storage

    @cute.struct
    class PersistentStorage:
        base: Storage
        sOut: cute.struct.Align[cute.struct.MemRange[cutlass.Int8, cfg.out_stage_bytes], 128]

    return PersistentStorage


class BitnetGemmSm90:
    """Arguments: ``x`` int8 [M, K], ``w`` int8 [N, K/4] packed, ``x_scale`` fp32 [M],
    ``w_scale`` fp32 [S], ``out`` bf16 [M, N], segment ends ``e1, e2, e3``."""

    def __init__(self, cfg: WgmmaConfig):
        self.cfg = cfg
        self.out_chunks = cfg.block_n * cfg.out_bytes // fmt.CHUNK_BYTES  # 16-byte stores a token
        self.tx_bytes = cfg.x_stage_bytes + cfg.w_stage_bytes  # what one stage's copies bring
        assert (cfg.block_m * self.out_chunks) % cfg.threads == 0
        assert cfg.warpgroups * WG_STRIPES <= WARP  # one producer lane per weight stripe

    def x_layout(self):
        """The staged token tiles: (block_m, 128, stages), K-major, 128-byte swizzle."""
        return sm90.make_operand_smem_layout(cutlass.Int8, self.cfg.block_m, fmt.GROUP_K, self.cfg.stages)

    def tiled_mma(self):
        return sm90_utils.make_trivial_tiled_mma(
            cutlass.Int8,
            cutlass.Int8,
            OperandMajorMode.K,
            OperandMajorMode.K,
            Int32,
            (1, 1, 1),
            (WG_ROWS, self.cfg.block_m),
            warpgroup.OperandSource.RMEM,
        )

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
        mWork: cute.Tensor,
        mCount: cute.Tensor,
        full_tiles: Int32,
        splits: Int32,
        stream,
    ):
        """``mWork`` int32 [>= tail tiles x splits x block_m x block_n] (any contents) and
        ``mCount`` int32 [>= tail tiles] (zero; the kernel leaves it so): the split-K tail's
        partial sums and arrivals.  The first ``full_tiles`` tiles are whole CTAs, each later
        one ``splits`` CTAs (``split_plan``)."""
        cfg = self.cfg
        x_layout = self.x_layout()
        tma_x, tma_tx = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mX, cute.select(x_layout, mode=[0, 1]), (cfg.block_m, fmt.GROUP_K)
        )
        tiles_m, tiles_n = grid_for(cfg, mX.shape[0], mW.shape[0])
        grid = [tiles_m * cfg.cluster_k, tiles_n, 1]
        if const_expr(cfg.split_k):
            grid = [full_tiles + (tiles_m * tiles_n - full_tiles) * splits, 1, 1]
        if const_expr(cfg.persistent):
            grid = [cutlass.min(tiles_m * tiles_n, cfg.persistent), 1, 1]
        cluster = {"cluster": [cfg.cluster_k, 1, 1]} if cfg.cluster_k > 1 else {}
        self.kernel(tma_x, tma_tx, mW, mXScale, mWScale, mOut, e1, e2, e3, mWork, mCount, full_tiles, splits,
                    shared_storage(cfg, bool(cfg.persistent))).launch(
            grid=grid,
            **cluster,
            block=[cfg.block_threads, 1, 1],
            stream=stream,
            min_blocks_per_mp=cfg.ctas_per_sm,
            preferred_smem_carveout=100,
            use_pdl=cfg.pdl,
        )

    @cute.kernel
    def kernel(
        self,
        tma_x: cute.CopyAtom,
        mXt: cute.Tensor,
        mW: cute.Tensor,
        mXScale: cute.Tensor,
        mWScale: cute.Tensor,
        mOut: cute.Tensor,
        e1: Int32,
        e2: Int32,
        e3: Int32,
        mWork: cute.Tensor,
        mCount: cute.Tensor,
        full_tiles: Int32,
        splits: Int32,
        Storage: cutlass.Constexpr,
    ):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        groups = mW.shape[1] // (fmt.GROUP_BYTES // fmt.TILE_N)
        if const_expr(cfg.split_k):
            work = CtaWork.of(cute.arch.block_idx()[0], full_tiles, splits, groups,
                              grid_for(cfg, mOut.shape[0], mOut.shape[1])[0])
        elif const_expr(cfg.cluster_k > 1):
            work = CtaWork.cluster(groups, cfg.cluster_k)
        else:
            work = CtaWork.whole(groups)
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp == 0:
            cpasync.prefetch_descriptor(tma_x)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(Storage)
        s_out = None
        if const_expr(cfg.persistent):
            s_out = storage.sOut.data_ptr().toint()
            storage = storage.base
        x_layout = self.x_layout()
        sX = storage.sX.get_tensor(x_layout.outer, swizzle=x_layout.inner)
        sW = storage.sW.get_tensor(cute.make_layout((cfg.stages * cfg.w_stage_bytes,)))
        if const_expr(cfg.cluster_k > 1):
            if tidx == 0:  # (the ring's creation fences and syncs the inits)
                cute.arch.mbarrier_init(storage.sums_bar.data_ptr(), 1)
        ring = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar.data_ptr(),
            num_stages=cfg.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, cfg.threads // WARP),
            tx_count=self.tx_bytes,
        )
        if const_expr(cfg.pdl):
            cute.arch.griddepcontrol_wait()  # x, the scales, the weights, out, the split workspace
            cute.arch.griddepcontrol_launch_dependents()
        if warp < WG_THREADS // WARP:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp == 0:
                if const_expr(cfg.persistent):
                    tiles_m, first, tiles, step = self.walk(mOut)
                    for t in cutlass.range(first, tiles, step, unroll=1):
                        self.produce(ring, tma_x, mXt, sX, mW, sW, CtaWork.tile(t, tiles_m, groups), tidx,
                                     (t - first) // step * groups)
                else:
                    self.produce(ring, tma_x, mXt, sX, mW, sW, work, tidx)
            if const_expr(cfg.cluster_k > 1):
                # the cluster's two barriers count every thread (see ``sum_cluster``)
                cute.arch.cluster_arrive()
                cute.arch.cluster_wait()
                cute.arch.cluster_arrive()
        else:
            cute.arch.setmaxregister_increase(cfg.consumer_regs)
            sXScale = storage.sXScale.get_tensor(cute.make_layout((cfg.block_m,)))
            sXRcp = storage.sXRcp.get_tensor(cute.make_layout((cfg.block_m,)))
            if const_expr(cfg.persistent):
                tiles_m, first, tiles, step = self.walk(mOut)
                for t in cutlass.range(first, tiles, step, unroll=1):
                    self.tile(ring, sX, sW, sXScale, sXRcp, s_out, mXScale, mWScale, mOut, e1, e2, e3,
                              CtaWork.tile(t, tiles_m, groups), tidx - WG_THREADS, (t - first) // step * groups)
            else:
                self.whole_or_split(ring, sX, sW, sXScale, sXRcp, storage, mXScale, mWScale, mOut, e1, e2, e3, mWork,
                                    mCount, work, tidx - WG_THREADS)

    def walk(self, mOut: cute.Tensor):
        """A persistent CTA's tiles: (token tiles, its first tile, all tiles, step); the
        producer and the consumers walk the same ones, and the ring's uses before tile
        ``t`` are ``(t - first) // step`` times the groups of a tile."""
        tiles_m, tiles_n = grid_for(self.cfg, mOut.shape[0], mOut.shape[1])
        return tiles_m, cute.arch.block_idx()[0], tiles_m * tiles_n, cute.arch.grid_dim()[0]

    @cute.jit
    def tile(self, ring, sX, sW, sXScale, sXRcp, s_out: Int32, mXScale, mWScale, mOut, e1: Int32, e2: Int32,
             e3: Int32, work, ctid: Int32, uses: Int32):
        """A persistent CTA's tile ``work``, whose first group is the ring's use ``uses``:
        the main loop, then the epilogue through ``s_out``.  The barrier before the
        epilogue also keeps it from overwriting the staged tile before the previous tile's
        stores have read it."""
        w_scale = self.early_row_scales(mWScale, mOut, e1, e2, e3, work, ctid)
        acc, thr_mma = self.main_loop(ring, sX, sW, sXScale, sXRcp, mXScale, work, ctid, uses)
        self.epilogue(acc, thr_mma, s_out, sXScale, sXRcp, mWScale, mOut, e1, e2, e3, work, ctid, w_scale)

    @cute.jit
    def main_loop(self, ring, sX, sW, sXScale, sXRcp, mXScale, work, ctid: Int32, uses=0):
        """A tile's token scales staged and its main loop, up to the barrier after which
        every consumer's wgmmas are done: the output may be staged (all loads have landed,
        as every stage was waited for) and the token scales are in."""
        cfg = self.cfg
        if const_expr(not cfg.raw):
            self.stage_token_scales(mXScale, sXScale, sXRcp, work.bm, ctid)
        acc, thr_mma = self.consume(ring, sX, sW, work.groups, ctid, uses)
        cute.arch.barrier(barrier_id=Barrier.EPI, number_of_threads=cfg.threads)
        return acc, thr_mma

    @cute.jit
    def whole_or_split(self, ring, sX, sW, sXScale, sXRcp, storage, mXScale, mWScale, mOut, e1: Int32, e2: Int32,
                       e3: Int32, mWork, mCount, work, ctid: Int32):
        """A CTA's one tile (or split of one): main loop, the split's sums, the epilogue
        through the token ring."""
        cfg = self.cfg
        w_scale = self.early_row_scales(mWScale, mOut, e1, e2, e3, work, ctid)
        acc, thr_mma = self.main_loop(ring, sX, sW, sXScale, sXRcp, mXScale, work, ctid)  # (the token ring is free)
        last = Int32(1)  # a split tile: only the CTA that ends up with the whole sum stores it
        if const_expr(cfg.cluster_k > 1):
            last = self.sum_cluster(acc, storage, work, ctid)
        elif const_expr(cfg.split_k):
            if work.splits > 1:
                last = self.sum_splits(acc, mWork, mCount, storage.flag.get_tensor(cute.make_layout(1)), work, ctid)
        if last != 0:
            self.epilogue(acc, thr_mma, sX.iterator.toint(), sXScale, sXRcp, mWScale, mOut, e1, e2, e3, work, ctid,
                          w_scale)

    # ---------------------------------------------------------------------------------
    # Producer: warp 0 of warpgroup 0
    # ---------------------------------------------------------------------------------
    @cute.jit
    def produce(self, ring, tma_x, mXt: cute.Tensor, sX: cute.Tensor, mW: cute.Tensor, sW: cute.Tensor,
                work, tidx: Int32, uses=0):
        """Group after group: wait for a free stage, then one TMA box of the token tile and
        lane ``i``'s bulk copy of weight stripe ``i`` (512 contiguous bytes), all on the
        stage's mbarrier.  ``uses``: the ring's uses before this tile's first group (a
        persistent CTA's earlier tiles)."""
        cfg = self.cfg
        lane = tidx % WARP
        gX = cute.local_tile(mXt, (cfg.block_m, fmt.GROUP_K), (work.bm, None))  # (block_m, 128, groups)
        tXs, tXg = cpasync.tma_partition(tma_x, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2),
                                         cute.group_modes(gX, 0, 2))
        n_stripes = mW.shape[0] // fmt.TILE_N
        row_bytes = mW.shape[1]
        w_stripes = cfg.warpgroups * WG_STRIPES
        # rows past N: the last stripe again (their outputs are never stored)
        stripe = cutlass.min(work.bn * w_stripes + lane, n_stripes - 1)
        w_src = mW.iterator + Int64(stripe) * Int64(row_bytes * fmt.TILE_N)
        w_dst = sW.iterator + lane * fmt.GROUP_BYTES
        state = seq_state(Int32(uses), cfg.stages, True)
        for kg in cutlass.range(work.group0, work.group0 + work.groups, unroll=1):
            ring.producer_acquire(state)
            bar = ring.producer_get_barrier(state)
            cute.copy(tma_x, tXg[None, kg], tXs[None, state.index], tma_bar_ptr=bar)
            if lane < w_stripes:
                ptx90.bulk_g2s(w_dst + state.index * cfg.w_stage_bytes, w_src + Int64(kg) * fmt.GROUP_BYTES,
                               fmt.GROUP_BYTES, bar)
            state.advance()

    # ---------------------------------------------------------------------------------
    # Consumers: 64 weight rows each
    # ---------------------------------------------------------------------------------
    @cute.jit
    def consume(self, ring, sX: cute.Tensor, sW: cute.Tensor, groups: Int32, ctid: Int32, uses=0):
        """The warpgroup's 64 x ``block_m`` int32 tile of ``out.T`` over every group (the
        ring's uses ``uses`` ..)."""
        cfg = self.cfg
        lane = ctid % WARP
        g = lane >> 2
        tq = lane & 3
        tiled_mma = self.tiled_mma()
        thr_mma = tiled_mma.get_slice(ctid % WG_THREADS)
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sX))
        a_shape = thr_mma.partition_shape_A((WG_ROWS, fmt.GROUP_K))
        tCrA = [tiled_mma.make_fragment_A(a_shape) for _ in range(A_BUFFERS)]
        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((WG_ROWS, cfg.block_m)), Int32)
        acc.fill(0)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)

        # warp w of warpgroup c decodes stripe 4c + w of each stage
        w_warp = sW.iterator.toint() + (ctid // WARP) * fmt.GROUP_BYTES
        a_offs = [fmt.kstep_word_offset(g, j) for j in range(4)]
        shift = fmt.kstep_shift(tq)
        # Pairs of groups, one per A buffer; an odd count ends with a phantom group whose A
        # is zero (no branch around the wgmmas: ptxas serializes every wgmma (C7513) when
        # the accumulators pass through one); its B is whatever the next stage holds (in a
        # persistent CTA possibly the next tile's tokens landing: integer products with a
        # zero A are zero whatever B holds)
        for kg0 in cutlass.range(0, groups, A_BUFFERS, unroll=1):
            for buf in cutlass.range_constexpr(A_BUFFERS):
                kg = kg0 + buf
                state = seq_state(uses + kg, cfg.stages, False)
                if const_expr(buf == 0):
                    ring.consumer_wait(state)
                else:
                    if kg < groups:
                        ring.consumer_wait(state)
                words = cute.recast_tensor(tCrA[buf], Int32)  # word j + 4*kstep
                w_stage = w_warp + state.index * cfg.w_stage_bytes
                for ks in cutlass.range_constexpr(KSTEPS):
                    for j in cutlass.range_constexpr(4):
                        a = decode_s8(lds_b32(w_stage + ks * fmt.TILE_BYTES + a_offs[j]), shift)
                        if const_expr(buf > 0):
                            a = cutlass.select_(kg < groups, a, Int32(0))
                        words[j + 4 * ks] = a
                warpgroup.fence()
                for ks in cutlass.range_constexpr(KSTEPS):
                    cute.gemm(tiled_mma, acc, tCrA[buf][None, None, ks], tCrB[None, None, ks, state.index], acc)
                warpgroup.commit_group()
                warpgroup.wait_group(A_BUFFERS - 1)
                # the wgmmas of the group before are done: its stage is free (but the last
                # group's, whatever the count's parity: that one is released below)
                if kg >= 1:
                    if kg < groups:
                        ring.consumer_release(seq_state(uses + kg - 1, cfg.stages, False))
        warpgroup.wait_group(0)
        # every stage this CTA waited for goes back, so a persistent CTA's ring runs on into
        # its next tile (a split CTA may have no group at all)
        if groups > 0:
            ring.consumer_release(seq_state(uses + groups - 1, cfg.stages, False))
        return acc, thr_mma

    @cute.jit
    def stage_token_scales(self, mXScale: cute.Tensor, sXScale: cute.Tensor, sXRcp: cute.Tensor, bm: Int32,
                           ctid: Int32):
        """The tile's token scales and their correctly rounded reciprocals into shared memory
        once (tokens past M: the last one's), for the epilogue (which would otherwise load a
        scale per value, each behind the last, and divide by it: ``scale_out_rcp``)."""
        m = mXScale.shape[0]
        for t in cutlass.range(ctid, self.cfg.block_m, self.cfg.threads, unroll=1):
            xs = Float32(mXScale[cutlass.min(bm * self.cfg.block_m + t, m - 1)])
            sXScale[t] = xs
            sXRcp[t] = rcp_rn(xs)

    @cute.jit
    def sum_cluster(self, acc, storage, work, ctid: Int32):
        """A cluster split: once every CTA of the cluster is past its main loop (the first
        one's token ring is free: cluster barrier one), the others store their int32 sums
        into slots of that ring (``st.async``, 16 bytes a store, completing on its
        ``sums_bar``) and the first one adds them (exact in any order).  No global memory
        and no fence: the whole reduction stays in the cluster's shared memory.  Cluster
        barrier two keeps the others resident until the first one has every byte.  Returns
        1 in the first CTA (which stores the tile), else 0."""
        cfg = self.cfg
        words = cute.size(acc) // 4
        bar = storage.sums_bar.data_ptr()
        ring = storage.sX.data_ptr()
        lane_off = sm90.sum_thread_offset(ctid)
        if work.part == 0:
            if ctid == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(bar, (cfg.cluster_k - 1) * cfg.tile_sum_bytes)
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        if work.part != 0:
            slot = ring.toint() + (work.part - 1) * cfg.tile_sum_bytes + lane_off
            for j in cutlass.range_constexpr(words):
                dst = cute.make_ptr(Int32, slot + sm90.sum_word_offset(j, cfg.threads), cute.AddressSpace.smem,
                                   assumed_align=16)
                cute.arch.store_async_dsmem(dst, (acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]), bar, 0)
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
        else:
            cute.arch.mbarrier_wait(bar, 0)
            cute.arch.cluster_arrive()
            for z in cutlass.range_constexpr(cfg.cluster_k - 1):
                for j in cutlass.range_constexpr(words):
                    v = lds_v4(ring.toint() + z * cfg.tile_sum_bytes + lane_off + sm90.sum_word_offset(j, cfg.threads))
                    for e in cutlass.range_constexpr(4):
                        acc[4 * j + e] = acc[4 * j + e] + v[e]
            # every thread has read the ring before the epilogue stages the output tile there
            cute.arch.barrier(barrier_id=Barrier.EPI, number_of_threads=cfg.threads)
        return Int32(work.part == 0)

    @cute.jit
    def sum_splits(self, acc, mWork: cute.Tensor, mCount: cute.Tensor, s_flag: cute.Tensor, work, ctid: Int32):
        """A split-K CTA stores its partial int32 sums in its own workspace slot and counts
        itself in; the last of its tile to arrive adds the other splits' slots to ``acc`` (int32:
        exact in any order) and resets the count.  Returns 1 in the last CTA (which stores
        the tile), 0 in the others.  Memory order as CUDA's threadfence reduction: every
        thread fences its stores before the count (acq_rel, GPU scope), the last CTA fences
        again and reads through L2.  A slot's layout: ``layouts.sm90.sum_thread_offset`` /
        ``sum_word_offset`` (``sum_cluster``'s slots likewise)."""
        cfg = self.cfg
        words = cute.size(acc) // 4
        first = work.tail * work.splits  # the tile's first slot
        base = mWork.iterator.toint() + sm90.sum_thread_offset(Int64(ctid))
        mine = base + Int64(first + work.part) * cfg.tile_sum_bytes
        for j in cutlass.range_constexpr(words):
            store_v4(mine + sm90.sum_word_offset(j, cfg.threads), acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3])
        cute.arch.fence_acq_rel_gpu()
        cute.arch.barrier(barrier_id=Barrier.EPI, number_of_threads=cfg.threads)
        if ctid == 0:
            arrived = cute.arch.atomic_add(mCount.iterator + work.tail, Int32(1), sem="acq_rel", scope="gpu")
            s_flag[0] = Int32(arrived == work.splits - 1)
        cute.arch.barrier(barrier_id=Barrier.EPI, number_of_threads=cfg.threads)
        last = s_flag[0]
        if last != 0:
            cute.arch.fence_acq_rel_gpu()
            for z in cutlass.range(work.splits, unroll=1):
                if z != work.part:
                    slot = base + Int64(first + z) * cfg.tile_sum_bytes
                    for j in cutlass.range_constexpr(words):
                        v = load_v4(slot + sm90.sum_word_offset(j, cfg.threads), False, l2_only=True)
                        for e in cutlass.range_constexpr(4):
                            acc[4 * j + e] = acc[4 * j + e] + v[e]
            if ctid == 0:
                mCount[work.tail] = Int32(0)
        return last

    def row_scales(self, coords, mWScale, n, e1: Int32, e2: Int32, e3: Int32, bn, row_in_tile0):
        """The segment scales of this thread's two accumulator rows (``coords``: its C
        fragment's (row, token) coordinates), by accumulator value index."""
        w_scale = {}
        for i in range(2):  # (a plain helper: unrolled by Python)
            first = sm90.acc_row_value(2 * i)
            row = cutlass.min(bn * self.cfg.block_n + row_in_tile0 + coords[first][0], n - 1)
            w_scale[first] = segment_scale(mWScale, row, e1, e2, e3)
        return w_scale

    def early_row_scales(self, mWScale, mOut, e1: Int32, e2: Int32, e3: Int32, work, ctid: Int32):
        """``early_scales``: ``row_scales`` loaded before the main loop (weights: no
        dependence on the previous kernel), else None (the epilogue loads them)."""
        if const_expr(not self.cfg.early_scales or self.cfg.raw):
            return None
        thr_mma = self.tiled_mma().get_slice(ctid % WG_THREADS)
        coords = thr_mma.partition_C(cute.make_identity_tensor((WG_ROWS, self.cfg.block_m)))
        return self.row_scales(coords, mWScale, mOut.shape[1], e1, e2, e3, work.bn, (ctid // WG_THREADS) * WG_ROWS)

    @cute.jit
    def epilogue(self, acc, thr_mma, s_base: Int32, sXScale: cute.Tensor, sXRcp: cute.Tensor, mWScale, mOut,
                 e1: Int32, e2: Int32, e3: Int32, work, ctid: Int32, w_scale=None):
        """Scale each sum (``(acc / x_scale) * w_scale``, or the raw int32), stage the tile
        in [token, row] order in shared memory, store it in 16-byte row runs.  A thread's
        values lie on two rows (one segment scale each, looked up once) and pairs of them
        in one token column (one token scale and reciprocal each).  bf16 values reach
        shared memory through ``stmatrix .trans``: the accumulator's 8 x 8 blocks (weight
        rows x tokens) are mma C fragments, and transposed each token's 8 rows are one
        16-byte run of the [token, row] tile (a value at a time would be 128 16-bit stores
        a thread)."""
        cfg = self.cfg
        bm, bn = work.bm, work.bn
        m = mOut.shape[0]
        n = mOut.shape[1]
        coords = thr_mma.partition_C(cute.make_identity_tensor((WG_ROWS, cfg.block_m)))
        row_in_tile0 = (ctid // WG_THREADS) * WG_ROWS
        if const_expr(cfg.raw):
            # (up to 128 values a thread: a traced loop the compiler unrolls, not as many copies)
            for i in cutlass.range(cute.size(acc), unroll_full=True):
                r, c = coords[i]
                store_i32(s_base + c * cfg.out_row_bytes + (row_in_tile0 + r) * cfg.out_bytes, acc[i], "shared")
        else:
            if const_expr(w_scale is None):  # (else ``early_row_scales``' registers)
                w_scale = self.row_scales(coords, mWScale, n, e1, e2, e3, bn, row_in_tile0)
            # this lane's address in each stmatrix: a token column, 8 weight rows of its warp's 16
            tok, row = sm90.acc_stsm_lane_target(ctid % WARP)
            row = row + row_in_tile0 + sm90.WARP_SLAB_ROWS * ((ctid % WG_THREADS) // WARP)
            lane_addr = s_base + tok * cfg.out_row_bytes + row * cfg.out_bytes
            x_scale = {}
            x_rcp = {}
            for p in cutlass.range_constexpr(cfg.block_m // sm90.ACC_STSM_COLS):
                regs = []
                for mat in cutlass.range_constexpr(4):
                    i = sm90.acc_stsm_value(p, mat)  # (row, col) and (row, col + 1)
                    vals = []
                    for v in cutlass.range_constexpr(2):
                        col = sm90.acc_col_value(i + v)
                        if const_expr(col not in x_scale):
                            c = coords[col][1]
                            x_scale[col] = Float32(sXScale[c])
                            x_rcp[col] = Float32(sXRcp[c])
                        vals.append(scale_out_rcp(acc[i + v], x_scale[col], x_rcp[col],
                                                  w_scale[sm90.acc_row_value(i + v)]))
                    regs.append(cvt_pack_x2(vals[0], vals[1], True))
                ptx90.stmatrix_x4_trans(lane_addr + p * sm90.ACC_STSM_COLS * cfg.out_row_bytes, *regs)
        cute.arch.barrier(barrier_id=Barrier.EPI, number_of_threads=cfg.threads)
        per_elem = fmt.CHUNK_BYTES // cfg.out_bytes
        for it in cutlass.range_constexpr(cfg.block_m * self.out_chunks // cfg.threads):
            idx = ctid + it * cfg.threads
            c = idx // self.out_chunks
            q = idx % self.out_chunks
            tok = bm * cfg.block_m + c
            row = bn * cfg.block_n + q * per_elem
            if tok < m and row < n:
                copy16_s2g(
                    s_base + c * cfg.out_row_bytes + q * fmt.CHUNK_BYTES,
                    mOut.iterator.toint() + (Int64(tok) * Int64(n) + Int64(row)) * cfg.out_bytes,
                )


def compile_gemm(cfg: WgmmaConfig, options: str):
    """Compile for every M and every (N, K) with N % 16 == 0, K % 128 == 0 (sm_90a only).
    The launch takes, after the segment ends, the split-K workspace and counts (int32
    vectors) and ``split_plan``'s full tiles and splits."""
    # min_blocks_per_mp would split the registers for CTAs that never co-reside (a persistent
    # grid sizes itself: ``persistent`` CTAs, whatever the tile's residency)
    if not cfg.persistent and not cfg.resident:
        raise ValueError(f"{cfg.ctas_per_sm} CTAs an SM do not fit its shared memory: {cfg}")
    *args, stream = matmul_fake_args(cfg.raw, launch_arg=False)
    work = cute.runtime.make_fake_compact_tensor(Int32, (cute.sym_int(),), assumed_align=16)
    count = cute.runtime.make_fake_compact_tensor(Int32, (cute.sym_int(),), assumed_align=4)
    return cute.compile(BitnetGemmSm90(cfg), *args, work, count, Int32(0), Int32(1), stream, options=options)
