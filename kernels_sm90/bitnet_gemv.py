"""BitNet W2A8 GEMV on Hopper: the sm80 kernel (dp4a streams as well as anything on
sm_90a; there is no tensor-core win at M = 1), compiled for sm_90a with an H200 config.

The H200 moves ~4.8 TB/s with a longer loaded latency than the A100, so each lane keeps
twice the bytes in flight: 8 loads of 16 bytes (4 KB per warp).  That costs ~30 more
registers (two 8 x 4-word load buffers), still under 96, i.e. 20+ warps per SM.
"""

from __future__ import annotations

from ..kernels_sm80.bitnet_gemv import BitnetGemv, GemvConfig, compile_gemv, warps_for

SM90 = GemvConfig(unroll=8)

__all__ = ["BitnetGemv", "GemvConfig", "SM90", "compile_gemv", "warps_for"]
