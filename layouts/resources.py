"""Per-SM resources of the GPUs the kernels target, and the residency they allow.

sm_80, sm_90 and sm_100 alike: 64K 32-bit registers per SM in four sub-partitions (16K
each; a warp lives in one), allocated per warp in units of 256 registers; at most 64
warps and 32 CTAs per SM.  The host uses ``ctas_per_sm`` with the register counts
ptxas reports for a kernel to size grids (decode splits, BitNet split-K and unroll),
so that all CTAs are resident in one wave where possible.
"""

from __future__ import annotations

SUBPARTITIONS = 4
SUBPARTITION_REGISTERS = 16384
REGISTER_UNIT = 256  # per-warp allocation granularity
MAX_WARPS_PER_SM = 64
MAX_CTAS_PER_SM = 32
WARP = 32
L2_LINE_BYTES = 128  # an L2 cache line: the granularity of the GEMVs' weight prefetches
REGISTER_FILE = SUBPARTITIONS * SUBPARTITION_REGISTERS  # registers of one SM
MAX_THREAD_REGISTERS = 255
SETMAXNREG_STEP = 8  # setmaxnreg counts are multiples of 8
# shared memory one CTA may allocate on sm_90 / sm_100 (227 KB of the SM's 228)
HOPPER_CTA_SMEM_BYTES = 227 * 1024
HOPPER_SM_SMEM_BYTES = 228 * 1024
CTA_RESERVED_SMEM_BYTES = 1024  # what the system takes of an SM's shared memory per resident CTA


def smem_ctas_per_sm(smem_bytes: int) -> int:
    """CTAs of ``smem_bytes`` of shared memory each that one sm_90 / sm_100 SM holds (the
    system's reserve per CTA included)."""
    return HOPPER_SM_SMEM_BYTES // (smem_bytes + CTA_RESERVED_SMEM_BYTES)


def ctas_per_sm(registers: int, warps: int) -> int:
    """CTAs of ``warps`` warps at ``registers`` per thread resident on one SM (registers
    and the warp / CTA limits; shared memory is not the bound for these kernels)."""
    per_warp = -(-registers * WARP // REGISTER_UNIT) * REGISTER_UNIT
    warps_per_sm = min(MAX_WARPS_PER_SM, SUBPARTITIONS * min(16, SUBPARTITION_REGISTERS // per_warp))
    return min(MAX_CTAS_PER_SM, warps_per_sm // warps)


def launch_registers(ctas: int, threads: int) -> int:
    """Registers per thread a CTA of ``threads`` launches with when ``ctas`` of them are to
    share an SM (ptxas's cap under that launch bound), as a setmaxnreg count."""
    return min(MAX_THREAD_REGISTERS, REGISTER_FILE // ctas // threads) // SETMAXNREG_STEP * SETMAXNREG_STEP


def consumer_registers(ctas: int, producer_threads: int, producer_regs: int, consumer_threads: int,
                       cap: int) -> int:
    """Registers per consumer thread of a warp-specialized CTA after setmaxnreg: the pool
    the CTA launched with (``launch_registers``) less what its producer threads keep, at
    most ``cap``.  Never more: ``setmaxnreg.inc`` waits until the CTA's own pool can serve
    it, so asking beyond it hangs the CTA."""
    pool = launch_registers(ctas, producer_threads + consumer_threads) * (producer_threads + consumer_threads)
    pool -= producer_threads * producer_regs
    return min(cap, pool // consumer_threads // SETMAXNREG_STEP * SETMAXNREG_STEP)
