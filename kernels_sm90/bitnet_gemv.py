"""BitNet W2A8 GEMV on Hopper: the sm80 dp4a kernel (there is no tensor-core win at M = 1)
with programmatic dependent launch, and the unroll depth picked per shape.

Why PDL.  At decode sizes (1.6 - 16 MB of packed weights) a GEMV is short next to its
fixed costs: launch, the first HBM round trip, the CTA-wide reduction and the drain.
Back to back in a CUDA graph the sm80 kernel took 3.1 us for 1.6 MB and 7.8 us for
16.4 MB on the H200.  With ``griddepcontrol`` the next kernel's CTAs start as ours
retire, issue their weight loads at once (the weights are static parameters) and only
wait for the previous grid before reading ``x`` and writing ``out``: 1.8 us and 6.3 us.

Unroll (16-byte weight loads in flight per lane).  Measured on the H200 (graph replay,
PDL, weights from HBM; profiles/NOTES.md): 4 wins while one batch covers a warp's
groups and the matrix is small (more warps per stripe, no padded loads: 1.8 vs 2.0 us at
2560 x 2560); 8 wins on the largest matrices (6.3 vs 7.5 us at 20480 x 3200) and when
4 would need a second batch (3.5 vs 3.9 us at 3200 x 10240).

A bulk-copy (``cp.async.bulk`` + mbarrier ring, persistent CTAs) variant was measured
and dropped: slower on every shape (7.1 - 8.5 us at 20480 x 3200), see profiles/NOTES.md.
"""

from __future__ import annotations

from ..kernels_sm80.bitnet_gemv import MAX_WARPS, BitnetGemv, GemvConfig, compile_gemv, launch_size, warps_for
from ..layouts import bitnet as fmt

SM90 = GemvConfig(unroll=8, pdl=True)
SM90_SMALL = GemvConfig(unroll=4, pdl=True)

# above this many packed weight bytes the deeper unroll wins (see the module docstring)
LARGE_BYTES = 12 << 20


def config_for(n: int, k: int) -> GemvConfig:
    """The GEMV configuration for an (N, K) problem on Hopper."""
    groups = k // fmt.GROUP_K
    one_batch = groups <= MAX_WARPS * SM90_SMALL.unroll
    return SM90_SMALL if one_batch and n * k // fmt.CODES_PER_BYTE < LARGE_BYTES else SM90


__all__ = ["BitnetGemv", "GemvConfig", "SM90", "SM90_SMALL", "compile_gemv", "config_for", "launch_size", "warps_for"]
