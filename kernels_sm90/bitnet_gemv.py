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

A bulk-copy (``cp.async.bulk`` + mbarrier ring, persistent CTAs) variant was measured
and dropped: slower on every shape (7.1 - 8.5 us at 20480 x 3200), see profiles/NOTES.md.
So was a fixed grid of at most half an SM walking the stripes (the next GEMV's CTAs fit
beside it and bulk-prefetch all their stripes to L2 while it runs; next stripe's loads in
flight during this one's arithmetic): 8.1 - 14 us at 20480 x 3200, 5.6 - 8.8 at 13824 x
2560, and slower at every shape; each CTA's chain of stripes from L2 after the wait is
longer than one more wave.
"""

from __future__ import annotations

from ..kernels_sm80.bitnet_gemv import MAX_WARPS, BitnetGemv, GemvConfig, compile_gemv, launch_size, warps_for
from ..layouts import bitnet as fmt
from ..layouts.resources import ctas_per_sm

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
    stripes = n // fmt.TILE_N
    waves = -(-stripes // slots)
    pays = stripes <= (1 - PIN_FREE_SLOTS) * slots
    return waves, cfg.pin != pays, batches, warps * cfg.unroll * batches - groups, -warps


def config_for(n: int, k: int, sms: int) -> GemvConfig:
    """The GEMV configuration for an (N, K) problem on a Hopper GPU with ``sms`` SMs."""
    return min(CANDIDATES, key=lambda cfg: cost(cfg, n, k, sms))


__all__ = ["BitnetGemv", "CANDIDATES", "GemvConfig", "MAX_WARPS", "REGISTERS", "compile_gemv", "config_for", "cost",
           "launch_size", "warps_for"]
