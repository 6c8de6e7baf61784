"""BitNet W2A8 GEMV on Hopper: the sm80 dp4a kernel (there is no tensor-core win at M = 1)
with programmatic dependent launch, and its unroll depth chosen per shape from an
occupancy model.

Why PDL.  At decode sizes (1.6 - 16 MB of packed weights) a GEMV is short next to its
fixed costs: launch, the first HBM round trip, the CTA-wide reduction and the drain.
Back to back in a CUDA graph the sm80 kernel took 3.2 us for 1.6 MB and 7.7 us for
16.4 MB on the H200.  With ``griddepcontrol`` the next kernel's CTAs start as ours
retire and have L2 fetch their whole weight stripe (the weights are static parameters),
and only wait for the previous grid before reading ``x`` (coherent loads: ptxas hoists
read-only ones above the wait) and writing ``out``: 2.4 us at 1.6 MB, 6.9 us at 16.4 MB
before the stripe prefetch (bitnet.json; the 1.8 us recorded earlier came from x loads
hoisted above the wait, a race).  The first batch of weight loads is written before the
wait too, but ptxas sinks plain loads below it (an acquire allows that); ``pin`` keeps
them above with a branch on their XOR (``kernels_sm80.tensors.wait_holding``), so the
data is in registers when the wait returns.  That pays when the next GEMV's CTAs are
resident while ours run (one wave with room to spare: 2560 x 2560 2.12 -> 1.87 us, 2560 x
6912 3.41 -> 2.60) and costs otherwise (up to 10 more registers can add a wave; a full or
second wave waits anyway), so ``cost`` pins only one-wave configurations that leave a
quarter of the CTA slots free.

Which unroll.  A warp issues all the loads of its batch (``unroll`` groups of 512 bytes
per warp) before it computes, so the whole matrix is in flight at once only if every CTA
(one per 16-row stripe) is resident in the first wave; a second wave waits for the
first to retire.  Residency is set by registers (``layouts.resources.ctas_per_sm``).  Measured on the H200 over 12 shapes
(profiles/NOTES.md), the time is ordered by (waves, batches per warp, padded loads,
fewer warps per CTA): e.g. 13824 x 2560 takes 4.6 us at unroll 4 (5-warp CTAs, 5 per SM:
two waves) and 3.0 us at unroll 5 (4-warp CTAs, 7 per SM: one wave); 20480 x 3200 7.5 us
at unroll 4 (three waves) and 5.8 us at unroll 5 (two waves, no padded loads).
``config_for`` evaluates that order for the compiled candidates, whose register counts
(ptxas, sm_90a) are recorded in ``REGISTERS`` and checked by the CPU tests.

The stripe kernel (``BitnetGemvBulk``: a CTA's whole stripe by one bulk copy into shared
memory, no weight in a register) takes the shapes with at least four stripes an SM, or
36 KB of weights an SM, or long stripes (``stripes_pay``, ``stripe_config``; where that
wave would leave the next GEMV no room, the form with x staged in shared memory too and its loop rolled, ``BULK_X``, lighter still: 20480 x 3200
5.5 us against 6.2 - 6.7): there all of the matrix is asked for at once by light CTAs,
where the register kernel's are few and heavy (H200: 13824 x 2560 3.2 us against 3.7;
fewer stripes an SM, its CTAs wait for their whole stripe before any arithmetic and it
loses up to 25 %). A bulk-copy ring with persistent CTAs was measured
and dropped: slower on every shape (7.1 - 8.5 us at 20480 x 3200), see profiles/NOTES.md.
So was a fixed grid of at most half an SM walking the stripes (the next GEMV's CTAs fit
beside it and bulk-prefetch all their stripes to L2 while it runs; next stripe's loads in
flight during this one's arithmetic): 8.1 - 14 us at 20480 x 3200, 5.6 - 8.8 at 13824 x
2560, and slower at every shape; each CTA's chain of stripes from L2 after the wait is
longer than one more wave.
"""

# no `from __future__ import annotations`: @cute.struct reads its field annotations as objects
import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from ..kernels_sm80.bitnet_gemv import (MAX_WARPS, BitnetGemv, GemvConfig, accumulate_words, add_byte_sums,
                                        compile_gemv, early_scales, launch_size, store_stripe, warps_for)
from ..kernels_sm80.bitnet_ptx import WARP, lds_v4, load_v4, matmul_fake_args
from ..layouts import bitnet as fmt
from ..layouts.resources import HOPPER_CTA_SMEM_BYTES, ctas_per_sm, smem_ctas_per_sm
from . import ptx90

# ptxas register counts of the PDL builds for sm_90a, by (unroll, pin) (tests/test_bitnet.py)
REGISTERS = {(4, False): 66, (5, False): 71, (8, False): 88, (10, False): 118,
             (4, True): 76, (5, True): 76, (8, True): 80, (10, True): 118}
CANDIDATES = tuple(GemvConfig(unroll=u, pdl=True, pin=p) for u, p in REGISTERS)


# Pinning pays only if the next kernel's CTAs find room beside ours from the start: one
# wave that leaves at least this share of the SMs' CTA slots free.
PIN_FREE_SLOTS = 0.25


def cost(cfg: GemvConfig, n: int, k: int, sms: int) -> tuple:
    """(waves, pinning where it does not pay, batches per warp, padded group loads per
    stripe, -warps): smaller is faster.  Pinning pays when the next GEMV's CTAs are resident
    early, i.e. one wave with room to spare (H200: 2560 x 2560 2.12 -> 1.87 us, 2560 x 6912
    3.41 -> 2.60), and costs otherwise (13824 x 2560, a nearly full wave: 3.78 -> 3.96;
    20480 x 3200, two waves: 6.54 -> 7.86 at unroll 5)."""
    groups = k // fmt.GROUP_K
    warps = warps_for(k, cfg.unroll)
    batches = -(-groups // (warps * cfg.unroll))
    slots = sms * ctas_per_sm(REGISTERS[cfg.unroll, cfg.pin], warps)
    stripes = fmt.stripes(n)
    waves = -(-stripes // slots)
    pays = stripes <= (1 - PIN_FREE_SLOTS) * slots
    return waves, cfg.pin != pays, batches, warps * cfg.unroll * batches - groups, -warps


def config_for(n: int, k: int, sms: int) -> GemvConfig:
    """The GEMV configuration for an (N, K) problem on a Hopper GPU with ``sms`` SMs: the
    stripe kernel where it pays (``stripe_config``), else the register kernel the occupancy
    model orders first."""
    register = min(CANDIDATES, key=lambda cfg: cost(cfg, n, k, sms))
    return stripe_config(n, k, sms, cost(register, n, k, sms)[0]) or register


# ---------------------------------------------------------------------------------------
# The stripe kernel: a CTA's weights through one bulk copy into shared memory
# ---------------------------------------------------------------------------------------

# Groups whose activation words a warp holds in registers at once (a batch)
BULK_BATCH = 8
# x staged: the group loop's unroll (1 measured 1.5 % faster at 20480 x 3200 but up to 40 %
# slower elsewhere, e.g. 13824 x 3200 5.47 against 4.24 - 4.51 us; full unrolling hoists
# every group's shared loads: 47 registers)
BULK_X_UNROLL = 2
BULK = GemvConfig(pdl=True, bulk=True)
# The staged form loads the scales its stores apply right after the PDL wait
# (``early_scales``), not after the warps' reduction: faster on seven model shapes, level on
# the eighth (H200, two alternating rounds, us, late / early: 2560 x 2560 2.29 / 2.07, 3840 x
# 2560 2.38 / 2.15, 13824 x 2560 3.74 / 3.72, 2560 x 6912 3.27 / 3.15, 3200 x 3200 2.18 / 2.04,
# 4800 x 3200 3.20 / 2.67, 3200 x 10240 4.46 / 4.06, 20480 x 3200 5.51 / 5.31;
# profiles/h200/gemv_scales.json) at the same residency (40 registers, 46 at K = 10240 where
# shared memory sets it).  The plain stripe kernel keeps them late: early it lost at 13824 x
# 2560, the one model shape the host gives it (3.24 -> 3.39 us), and won elsewhere (2560 x
# 6912 3.15 -> 2.66).
BULK_X = GemvConfig(pdl=True, bulk=True, stage_x=True, early_scales=True)


def bulk_warps(k: int) -> int:
    """Warps per CTA of the stripe kernel: a batch of groups each, at most ``MAX_WARPS``."""
    groups = k // fmt.GROUP_K
    return max(1, min(MAX_WARPS, -(-groups // BULK_BATCH)))


# the stripe's alignment in shared memory (the mbarrier before it and its padding fit in it)
BULK_STRIPE_ALIGN = 128


def bulk_storage(k: int, stage_x: bool = False):
    """The stripe kernel's shared memory at K columns: the mbarriers (the stripe's, x's), the
    stripe, the warps' row sums and with ``stage_x`` the activations (a plain Python struct,
    so the host can size it: ``bulk_smem_bytes``)."""

    @cute.struct
    class Storage:
        mbar: cute.struct.MemRange[cutlass.Int64, 2]
        sW: cute.struct.Align[cute.struct.MemRange[cutlass.Int8, fmt.stripe_bytes(k)], BULK_STRIPE_ALIGN]
        red: cute.struct.Align[cute.struct.MemRange[Int32, fmt.row_sums_bytes(bulk_warps(k)) // 4], 16]

    if not stage_x:
        return Storage

    @cute.struct
    class StagedStorage:
        base: Storage
        sX: cute.struct.Align[cute.struct.MemRange[cutlass.Int8, k], BULK_STRIPE_ALIGN]

    return StagedStorage


def bulk_smem_bytes(k: int, stage_x: bool = False) -> int:
    """The stripe kernel's shared memory at K columns (``bulk_storage``'s size)."""
    return bulk_storage(k, stage_x).size_in_bytes()


def bulk_fits(k: int, stage_x: bool = False) -> bool:
    """Whether the stripe kernel's shared memory at K columns fits in a CTA."""
    return bulk_smem_bytes(k, stage_x) <= HOPPER_CTA_SMEM_BYTES


def bulk_registers(k: int, stage_x: bool = False) -> int:
    """ptxas's register count of the stripe kernel for sm_90a at K columns, rounded up: with
    the activations in registers 48 - 56 to 7 warps a CTA, 62 - 64 past that; staged in
    shared memory (the loop rolled) 37 - 40, 42 at K = 10240 where shared memory limits the
    CTAs an SM anyway (tests/test_bitnet.py checks that the residency holds)."""
    if stage_x:
        return 40
    return 56 if bulk_warps(k) <= 7 else 64


def bulk_ctas_per_sm(k: int, stage_x: bool = False) -> int:
    """Stripe-kernel CTAs resident on one SM: registers, warps, and the stripes' shared memory."""
    return min(ctas_per_sm(bulk_registers(k, stage_x), bulk_warps(k)),
               smem_ctas_per_sm(bulk_smem_bytes(k, stage_x)))


def stripe_waves(cfg: GemvConfig, n: int, k: int, sms: int) -> int:
    """Waves of the stripe kernel ``cfg`` (``BULK`` or ``BULK_X``) over N / 16 stripes (0 if
    its shared memory does not fit)."""
    if not bulk_fits(k, cfg.stage_x):
        return 0
    return -(-fmt.stripes(n) // (bulk_ctas_per_sm(k, cfg.stage_x) * sms))


# The stripe kernel pays from this many stripes an SM up.  H200, back to back in a CUDA
# graph (profiles/h200/gemv_sweep.json, gemv_sweep_stage_x.json, bitnet.json; us, stripe /
# the register kernel the host picked): 4 stripes an SM and more in one wave, 8448 x 2560
# 2.83 / 3.01, 13824 x 2560 3.21 / 3.74, 20480 x 2560 4.42 / 5.70, 16896 x 3200 4.93 / 5.80,
# 8448 x 6912 4.96 / 6.84; fewer, 3840 x 2560 (1.8) 2.54 / 2.01, 4800 x 3200 (2.3) 2.83 /
# 2.38 ...
BULK_MIN_STRIPES_PER_SM = 4

# ... and at fewer stripes an SM from this share of the matrix an SM (its stripes an SM
# times ``fmt.stripe_bytes``: ``stripe_bytes_per_sm``) up, whatever the stripe's length.
# H200, us, the register kernel the host picks / BULK / BULK_X, KB an SM
# (profiles/h200/gemv_sweep*.json; the 16-20 KB stripes: gemv_sweep_s54_general.json):
#   register:  4800 x 3200 (28.4) 2.34 - 2.41 / 2.71 - 2.81 / 2.90 - 3.15, 4096 x 4096 (31.0)
#              2.39 / 2.51 / 2.45, 2560 x 6912 (32.7) 2.67 - 2.80 / 2.99 - 3.25 / 3.22 - 3.32;
#   stripes:   6144 x 4096 (46.5, 2.9 stripes an SM) 3.19 / 2.87 / 3.01, 5120 x 5120 (48.5,
#              2.4) 3.51 / 2.92 / 3.12, 3200 x 10240 (60.6, 1.5) 4.13 - 4.21 / 4.01 - 4.31 /
#              3.84 - 4.37.
# H100 (profiles/h100/gemv_sweep_s5*.json): 6144 x 4096 3.58 / 3.12 / 3.14, 5120 x 5120 3.83
# / 3.26 / 3.34, 3200 x 6912 (41.0) 3.80 / 3.44 / 3.29, 2560 x 8192 (38.8) 3.31 / 2.95 /
# 3.10.  Below it the H100 differs: 4096 x 4096 (31.0) 2.62 / 2.65 / 2.14, 2560 x 6912
# (32.7) 2.80 - 2.83 / 2.93 - 3.03 / 2.35 - 2.72 in four sweeps (this BULK_X) but the
# register kernel kept by one tuner run; and both GPUs run 2048 x 2048 (7.8 KB an SM,
# fewer stripes than SMs) faster on stripes (H200 1.75 / 1.56 / 1.48).  The rule follows
# the H200; ``bitdecode tune`` measures a user's shapes on their GPU.
STRIPE_MIN_BYTES_PER_SM = 36 * 1024

# ... and for long stripes at any count: from this many bytes a stripe (K = 8192) one bulk
# copy a CTA beats the register kernel's loads (which form: ``stripe_config``).  3200 x 10240
# (1.5 stripes an SM), us, BULK_X / the register kernel the host picked: H200 3.81 / 4.23
# (bitnet.json) and 3.84 / 4.19 (gemv_sweep_math.json), forty-sixth session; H100 3.78 -
# 3.90 / 4.61 - 4.73 in three runs (profiles/h100).
LONG_STRIPE_BYTES = 32 * 1024
# ... but the plain stripe kernel where its slots hold this GEMV's stripes and the next one's
# beside them (2 x stripes <= BULK's slots: the next GEMV's CTAs all start and fetch while
# this one runs), as on the short stripes.  Two alternating runs each, us, BULK / BULK_X
# (profiles/h200/gemv_scales_long_stripes.json, profiles/h100/ of the forty-seventh session):
# 2560 x 10240 (320 of 396 slots) H200 3.23 / 3.50, 3.17 / 3.52, H100 3.45 / 3.71, 3.45 /
# 3.72; 3200 x 8192 (400 of 528) H200 3.19 / 3.39, 3.16 / 3.41, H100 3.39 / 3.58, 3.37 /
# 3.58; 1600 x 16384 (200 of 264) H100 3.58 / 3.66, 3.62 / 3.71.  Where they do not fit,
# BULK_X: 3200 x 10240 (400 of 396) H200 4.47 / 3.72, 4.46 / 3.72; 6400 x 10240 (two
# waves of BULK) 7.45 / 4.96.


# A stripe kernel's wave should leave this share of its CTA slots free: the next GEMV's CTAs
# then start beside it and fetch their stripes while it drains.  H200
# (gemv_sweep_rolled*.json, gemv_sweep_final.json; us, BULK / BULK_X, the share BULK leaves
# free): 20480 x 3200 7.26 - 7.36 / 5.38 - 5.52 (BULK two waves; BULK_X unrolled, 3 % free,
# 6.18 - 6.27), 16896 x 3200 4.99 - 5.09 / 4.28 - 4.38 (11 %), 20480 x 2560 4.47 - 4.81 /
# 4.46 - 4.64 (19 %), 8448 x 6912 5.00 - 5.10 / 4.66 (20 %); 13824 x 3200 3.87 - 3.90 /
# 4.24 - 4.51 (27 %), 13824 x 2560 3.21 - 3.30 / 3.77 - 3.79 (45 %).
BULK_FREE_SLOTS = 0.25


def stripe_bytes_per_sm(n: int, k: int, sms: int) -> float:
    """An SM's share of an (N, K) GEMV's packed weights (bytes), as the stripe kernel
    deals them: N / 16 stripes of ``fmt.stripe_bytes(k)`` over ``sms`` SMs."""
    return fmt.stripes(n) * fmt.stripe_bytes(k) / sms


def stripes_pay(n: int, k: int, sms: int) -> bool:
    """Whether a stripe kernel beats the register kernel at (N, K): ``BULK_MIN_STRIPES_PER_SM``
    stripes an SM, ``STRIPE_MIN_BYTES_PER_SM`` an SM, or stripes of ``LONG_STRIPE_BYTES``."""
    return (fmt.stripes(n) >= BULK_MIN_STRIPES_PER_SM * sms
            or stripe_bytes_per_sm(n, k, sms) >= STRIPE_MIN_BYTES_PER_SM
            or fmt.stripe_bytes(k) >= LONG_STRIPE_BYTES)


def stripe_config(n: int, k: int, sms: int, register_waves: int):
    """The stripe kernel that runs an (N, K) GEMV where stripes pay (``stripes_pay``), or
    None.  Below ``BULK_MIN_STRIPES_PER_SM`` stripes an SM: ``BULK`` where its slots hold
    two GEMVs' stripes, else ``BULK_X`` where it holds them in one wave.  From there up: the first of ``BULK`` and ``BULK_X`` (x staged too, the loop
    rolled: 37 - 42 registers, more CTAs an SM) whose one wave leaves ``BULK_FREE_SLOTS`` of
    its slots free, else the first that holds every stripe in one wave (8448 x 10240: 528
    stripes, 396 / 528 slots; us, BULK 7.96 - 8.20, BULK_X 7.5 - 7.7, register 8.92), else
    ``BULK`` where it takes fewer waves than the register kernel (``register_waves``: 13824 x
    6912, 2 against 3; 8.92 - 9.02 against 12.04)."""
    if not stripes_pay(n, k, sms):
        return None
    stripes = fmt.stripes(n)
    if stripes < BULK_MIN_STRIPES_PER_SM * sms:
        if bulk_fits(k) and 2 * stripes <= bulk_ctas_per_sm(k) * sms:
            return BULK
        return BULK_X if stripe_waves(BULK_X, n, k, sms) == 1 else None
    one_wave = [cfg for cfg in (BULK, BULK_X) if stripe_waves(cfg, n, k, sms) == 1]
    for cfg in one_wave:
        if stripes <= (1 - BULK_FREE_SLOTS) * bulk_ctas_per_sm(k, cfg.stage_x) * sms:
            return cfg
    if one_wave:
        return one_wave[0]
    waves = stripe_waves(BULK, n, k, sms)
    return BULK if 0 < waves < register_waves else None


class BitnetGemvBulk:
    """The GEMV of ``BitnetGemv`` (same arguments, same lane mapping, decode and reduction)
    with the weights read from shared memory: thread 0 of each CTA asks for its whole
    16-row stripe (one contiguous run, ``16 K / 4`` bytes) with one ``cp.async.bulk`` on an
    mbarrier as soon as the CTA starts, before ``griddepcontrol.wait`` (the weights never
    depend on the previous kernel).  No register holds a weight in flight, so the CTAs are
    light (3-16 warps, 56-64 registers up to K = 10240) and a GPU's worth of stripes is requested at once
    (the register kernel holds its loads in registers and runs the large shapes in two
    waves); their shared memory leaves room for the next GEMV's first CTAs to start and ask
    for theirs while this one drains.  ``stage_x`` (``BULK_X``): x too comes by one bulk copy
    (after the wait) and the group loop runs rolled, so a CTA holds 37-42 registers and more
    of them fit an SM.  Compiled per K: the stripe's size and the warps' batches are
    static."""

    def __init__(self, cfg: GemvConfig, k: int):
        assert cfg.bulk and k % fmt.GROUP_K == 0 and bulk_fits(k, cfg.stage_x), (cfg, k)
        self.raw = cfg.raw
        self.pdl = cfg.pdl
        self.stage_x = cfg.stage_x
        self.early_scales = cfg.loads_scales_early
        self.k = k
        self.groups = k // fmt.GROUP_K
        self.warps = bulk_warps(k)
        self.per_warp = -(-self.groups // self.warps)  # groups a warp takes (the last may pad)
        self.stripe_bytes = fmt.stripe_bytes(k)

    @cute.jit
    def __call__(self, mX: cute.Tensor, mW: cute.Tensor, mXScale: cute.Tensor, mWScale: cute.Tensor,
                 mOut: cute.Tensor, e1: Int32, e2: Int32, e3: Int32, warps: Int32, stream):
        """``warps``: the register kernel's launch argument, unused (the block is static)."""
        n = mW.shape[0]
        self.kernel(mX, mW, mXScale, mWScale, mOut, e1, e2, e3).launch(
            grid=[fmt.stripes(n), 1, 1], block=[self.warps * WARP, 1, 1], stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mXScale: cute.Tensor, mWScale: cute.Tensor,
               mOut: cute.Tensor, e1: Int32, e2: Int32, e3: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        stripe, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(tidx // WARP)
        lane = tidx % WARP
        q = lane % fmt.CHUNKS_PER_TILE
        tile = lane // fmt.CHUNKS_PER_TILE

        storage = cutlass.memory.SmemAllocator().allocate(bulk_storage(self.k, self.stage_x))
        base = storage.base if cutlass.const_expr(self.stage_x) else storage
        mbar = base.mbar.data_ptr()  # the stripe's, x's
        sW = base.sW.data_ptr()
        red = base.red.get_tensor(fmt.make_row_sums_layout(self.warps))
        if tidx == 0:
            cute.arch.mbarrier_init(mbar, 1)
            cute.arch.mbarrier_init(mbar + 1, 1)
            cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()
        if tidx == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(mbar, self.stripe_bytes)
            ptx90.bulk_g2s(sW, mW.iterator + Int64(stripe) * Int64(self.stripe_bytes), self.stripe_bytes, mbar)
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()  # x (and out) may be the previous kernel's
        scales = None
        if cutlass.const_expr(self.early_scales):
            scales = early_scales(tidx, stripe, mXScale, mWScale, e1, e2, e3)
        sX = None
        if cutlass.const_expr(self.stage_x):
            # after the wait: the async proxy reads what the previous grid wrote and flushed
            sX = storage.sX.data_ptr()
            if tidx == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(mbar + 1, self.k)
                ptx90.bulk_g2s(sX, mX.iterator, self.k, mbar + 1)

        # Groups warp, warp + W, ..; in the plain form a warp's last group may be past the
        # stripe: it reads the stripe's last one again with zeroed activations, adding
        # nothing to either sum (the staged form runs each warp's exact count).
        x_offset = tile * fmt.TILE_K + fmt.chunk_khalf(q) * fmt.CHUNK_K  # the lane's x words in a group
        w_lane = sW.toint() + lane * fmt.CHUNK_BYTES
        acc = cute.make_rmem_tensor((fmt.ROWS_PER_CHUNK * fmt.DECODE_STEPS,), Int32)
        acc.fill(0)
        if cutlass.const_expr(self.stage_x):
            xsum = self.staged_products(mbar, w_lane, sX.toint(), x_offset, tidx, warp, acc)
        else:
            xsum = self.batched_products(mbar, w_lane, mX.iterator.toint() + Int64(x_offset), warp, acc)
        store_stripe(acc, xsum, red, warp, self.warps, lane, tidx, stripe, mXScale, mWScale, mOut, e1, e2, e3,
                     self.raw, scales)

    @cute.jit
    def batched_products(self, mbar, w_lane: Int32, x_lane: Int64, warp: Int32, acc: cute.Tensor) -> Int32:
        """x from registers: each batch's activation words are loaded (coherent loads, after
        the wait) before any is used, the first batch's while the stripe lands; then the
        batch's groups from shared memory into ``acc``.  Only a warp's last group can be past
        the stripe (``groups % warps`` > 0): it alone is clamped and masked.  Returns the lane's
        activation sum."""
        xsum = Int32(0)
        full = self.groups // self.warps  # groups every warp has
        for b0 in cutlass.range_constexpr(0, self.per_warp, BULK_BATCH):
            grps = []
            keep = []
            xv = []
            for j in cutlass.range_constexpr(b0, min(b0 + BULK_BATCH, self.per_warp)):
                g = warp + j * self.warps
                if cutlass.const_expr(j < full):
                    grps.append(g)
                    keep.append(None)
                else:
                    grps.append(cutlass.min(g, self.groups - 1))
                    keep.append(cutlass.select_(g < self.groups, Int32(-1), Int32(0)))
                xv.append(load_v4(x_lane + Int64(grps[-1]) * fmt.GROUP_K, False, self.pdl))
            if cutlass.const_expr(b0 == 0):
                cute.arch.mbarrier_wait(mbar, 0)
            for u in cutlass.range_constexpr(len(grps)):
                wv = lds_v4(w_lane + grps[u] * fmt.GROUP_BYTES)
                x = xv[u]
                if cutlass.const_expr(keep[u] is not None):
                    x = tuple(x[i] & keep[u] for i in range(4))
                xsum = add_byte_sums(x, xsum)
                accumulate_words(wv, x, acc)
        return xsum

    @cute.jit
    def staged_products(self, mbar, w_lane: Int32, sx: Int32, x_offset: Int32, tidx: Int32, warp: Int32,
                        acc: cute.Tensor) -> Int32:
        """x staged: x's sum first (``staged_x_sum``, while the stripe may still be landing),
        then the group loop rolled (two groups an iteration), each group's weight and x words
        read from shared memory only while it is used: 37-42 registers, two more CTAs an SM
        than unrolled (47; H200, 20480 x 3200: 5.47 against 6.25 us, profiles/NOTES.md).  The
        loop runs the warp's own count of groups (a static count, and one more group in the
        first ``groups % warps`` warps), so no group is padded and no activation word masked:
        16 lop3 and 16 dp4a a group, where the padded loop with a sum in every lane spent 4
        selp and 4 more dp4a.  Returns the lane's share of x's sum."""
        cute.arch.mbarrier_wait(mbar + 1, 0)
        xsum = self.staged_x_sum(sx, tidx)
        cute.arch.mbarrier_wait(mbar, 0)
        w_warp = w_lane + warp * fmt.GROUP_BYTES
        x_warp = sx + x_offset + warp * fmt.GROUP_K
        # every warp takes groups // warps groups, the first groups % warps one more
        full, extra = divmod(self.groups, self.warps)
        if cutlass.const_expr(extra > 0):
            if warp < extra:
                self.staged_group(w_warp, x_warp, full, acc)
        for j in cutlass.range(full, unroll=BULK_X_UNROLL):
            self.staged_group(w_warp, x_warp, j, acc)
        return xsum

    @cute.jit
    def staged_group(self, w_warp: Int32, x_warp: Int32, j, acc: cute.Tensor):
        """The warp's ``j``-th group (group ``warp + j * warps``) from shared memory into ``acc``."""
        wv = lds_v4(w_warp + j * (self.warps * fmt.GROUP_BYTES))
        xw = lds_v4(x_warp + j * (self.warps * fmt.GROUP_K))
        accumulate_words(wv, xw, acc)

    @cute.jit
    def staged_x_sum(self, sx: Int32, tidx: Int32) -> Int32:
        """x's sum, each thread taking the 16-byte chunks ``tidx, tidx + threads, ..`` of the
        staged x, then added over the lanes that hold other rows (``fmt.OTHER_ROW_LANE_MASKS``):
        the fold (``store_stripe``) adds the lanes that hold the same rows and then the warps,
        so every thread's share is counted once for every row."""
        xsum = Int32(0)
        for v in cutlass.range(tidx, self.k // fmt.CHUNK_BYTES, self.warps * WARP, unroll=1):
            xsum = add_byte_sums(lds_v4(sx + v * fmt.CHUNK_BYTES), xsum)  # (a 16-byte chunk: one shared load)
        for i in cutlass.range_constexpr(len(fmt.OTHER_ROW_LANE_MASKS)):
            xsum = xsum + cute.arch.shuffle_sync_bfly(xsum, offset=fmt.OTHER_ROW_LANE_MASKS[i])
        return xsum


def compile_bulk(cfg: GemvConfig, k: int, options: str):
    """The stripe kernel for K columns (any N, a multiple of 16)."""
    return cute.compile(BitnetGemvBulk(cfg, k), *matmul_fake_args(cfg.raw, tokens=1), options=options)


__all__ = ["BULK", "BULK_FREE_SLOTS", "BULK_MIN_STRIPES_PER_SM", "BULK_X", "BitnetGemv", "BitnetGemvBulk",
           "CANDIDATES", "GemvConfig", "LONG_STRIPE_BYTES", "MAX_WARPS", "REGISTERS", "STRIPE_MIN_BYTES_PER_SM",
           "bulk_ctas_per_sm", "bulk_fits", "bulk_registers", "bulk_smem_bytes", "bulk_warps", "compile_bulk",
           "compile_gemv", "config_for", "cost", "launch_size", "stripe_bytes_per_sm", "stripe_config",
           "stripe_waves", "stripes_pay", "warps_for"]
