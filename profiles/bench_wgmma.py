"""What a small-N ``wgmma`` costs on this GPU: SM cycles per instruction, by N, operand
source and type.

The sm90 decode kernel issues ``wgmma 64 x 8 x 16`` (the query heads of one KV head are
its N = 8, four of them padding at GQA 4), 32 of them per 128-token tile, and the BitNet
GEMM ``64 x N x 32`` s8.  Whether such a wgmma costs by its N (its MACs) or by the
instruction decides what a cheaper tile must cut: MACs (skip the padding columns) or
instructions (more work per wgmma, e.g. s8 with k = 32).  Each warpgroup here issues
``ksteps`` wgmmas on two accumulators (two M-blocks, as the decode's 128-token steps do),
commits, waits, ``iters`` times; CTAs fill every SM with ``warpgroups`` per SM in all.
Operands are constant (1.0 / 1): throughput does not depend on values.

    python3 profiles/bench_wgmma.py --out profiles/h200

writes ``<out>/wgmma.json``: per configuration the time, SM cycles per wgmma (at the clock
``torch.cuda.clock_rate`` reports, or ``--clock-ghz``) and the achieved dense TOPS.
"""

# no `from __future__ import annotations`: the kernel class reads its annotations as objects

import argparse
import sys
from pathlib import Path

# (operand type, N, A from registers) the table covers, at 1, 2 and 4 warpgroups an SM
CASES = (("f16", 8, True), ("f16", 8, False), ("s8", 8, True), ("f16", 16, True), ("s8", 16, True),
         ("f16", 32, True), ("f16", 64, True), ("f16", 128, False))
WARPGROUPS_PER_SM = (1, 2, 4)
M_BLOCKS = 2  # accumulators a warpgroup alternates between (the decode's two 64-token M-blocks)
K_STEPS = {"f16": 8, "s8": 4}  # wgmmas per M-block and commit: 128 channels of K either way


def build(kind: str, n: int, rs: bool, warpgroups: int, iters: int):
    """The compiled probe kernel (``warpgroups`` per CTA) and its TVM-FFI call."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass import Float32, Int32, const_expr
    from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
    from cutlass.tensor_utils import LayoutEnum

    from bitdecode import jit
    from bitdecode.kernels_sm80.host import fake_vector, stream

    dtype = cutlass.Int8 if kind == "s8" else cutlass.Float16
    acc_dtype = Int32 if kind == "s8" else Float32
    k_block = 256 // dtype.width
    ksteps = K_STEPS[kind]
    m = 64 * M_BLOCKS
    one = 0x01010101 if kind == "s8" else 0x3C003C00  # four s8 ones / two f16 ones

    class WgmmaProbe:
        def tiled_mma(self):
            source = warpgroup.OperandSource.RMEM if rs else warpgroup.OperandSource.SMEM
            k = OperandMajorMode.K
            return sm90_utils.make_trivial_tiled_mma(dtype, dtype, k, k, acc_dtype, (1, 1, 1), (64, n), source)

        @cute.jit
        def __call__(self, mOut: cute.Tensor, ctas: Int32, stream):
            tile = (m, n, k_block * ksteps)
            a_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, tile, dtype, 1)
            b_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, tile, dtype, 1)

            @cute.struct
            class Storage:
                sA: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(a_layout)], 1024]
                sB: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(b_layout)], 1024]

            self.kernel(mOut, a_layout, b_layout, Storage).launch(
                grid=[ctas, 1, 1], block=[128 * warpgroups, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, mOut: cute.Tensor, a_layout: cute.ComposedLayout, b_layout: cute.ComposedLayout,
                   Storage: cutlass.Constexpr):
            tid, _, _ = cute.arch.thread_idx()
            bid, _, _ = cute.arch.block_idx()
            storage = cutlass.utils.SmemAllocator().allocate(Storage)
            sA = storage.sA.get_tensor(a_layout.outer, swizzle=a_layout.inner)
            sB = storage.sB.get_tensor(b_layout.outer, swizzle=b_layout.inner)
            for buf, layout in ((storage.sA, a_layout), (storage.sB, b_layout)):
                words = cute.make_tensor(cute.recast_ptr(buf.data_ptr(), dtype=Int32),
                                         cute.make_layout(cute.cosize(layout) * dtype.width // 32))
                for i in cutlass.range(tid, cute.size(words), 128 * warpgroups, unroll=1):
                    words[i] = Int32(one)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_threads()
            mma = self.tiled_mma()
            thr = mma.get_slice(tid % 128)
            tCrB = mma.make_fragment_B(thr.partition_B(sB))
            if const_expr(rs):
                tCrA = mma.make_fragment_A(thr.partition_shape_A((m, k_block * ksteps)))
                a_words = cute.recast_tensor(tCrA, Int32)
                for i in cutlass.range_constexpr(cute.size(a_words)):
                    a_words[i] = Int32(one)
            else:
                tCrA = mma.make_fragment_A(thr.partition_A(sA))
            acc = cute.make_rmem_tensor(thr.partition_shape_C((m, n)), acc_dtype)
            acc.fill(0)
            for _ in cutlass.range(iters, unroll=1):
                warpgroup.fence()
                for k in cutlass.range_constexpr(ksteps):
                    mma.set(warpgroup.Field.ACCUMULATE, True)
                    a = tCrA[None, None, k] if const_expr(rs) else tCrA[None, None, k, 0]
                    cute.gemm(mma, acc, a, tCrB[None, None, k, 0], acc)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
            total = acc_dtype(0)
            for i in cutlass.range_constexpr(cute.size(acc)):
                total = total + acc[i]
            mOut[bid * 128 * warpgroups + tid] = Float32(total)

    fn = cute.compile(WgmmaProbe(), fake_vector(Float32, 1), Int32(1), stream(),
                      options=jit.compile_options("sm_90a"))
    return fn, 64 * n * k_block * ksteps * M_BLOCKS  # MACs of one iteration of one warpgroup


def measure(timer, kind: str, n: int, rs: bool, per_sm: int, clock_hz: float, iters: int = 4000) -> dict:
    import torch
    from cutlass import Int32

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    warpgroups = min(per_sm, 2)  # up to two warpgroups a CTA, the rest as more CTAs an SM
    ctas = sms * per_sm // warpgroups
    fn, macs = build(kind, n, rs, warpgroups, iters)
    out = torch.zeros(ctas * 128 * warpgroups, device="cuda", dtype=torch.float32)
    t = timer(lambda: fn(out, Int32(ctas)), iters=7, warmup=1, flush=False) * 1e-6  # the operands live in smem
    # thread 0 sums its n accumulator values, each 128 channels x iters of 1 x 1: every wgmma ran
    expect = n * 128 * iters
    assert float(out[0]) == expect, (kind, n, float(out[0]), expect)
    per_sm_wgmmas = iters * K_STEPS[kind] * M_BLOCKS * per_sm
    return {"type": kind, "n": n, "a": "registers" if rs else "smem", "warpgroups_per_sm": per_sm,
            "seconds": t, "sm_cycles_per_wgmma": t * clock_hz / per_sm_wgmmas,
            "dense_tops": 2 * iters * macs * per_sm * sms / t / 1e12}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="write <out>/wgmma.json")
    p.add_argument("--clock-ghz", type=float, default=None, help="SM clock for the cycle counts (default: the "
                   "GPU's maximum)")
    args = p.parse_args(argv)
    import torch

    from bitdecode._files import write_record

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("bench_wgmma needs a Hopper GPU (sm_90a)", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    # the maximum SM clock (kHz in the device properties where torch has it; the H200's 1.98 GHz else)
    clock_hz = args.clock_ghz * 1e9 if args.clock_ghz else getattr(props, "clock_rate", 1_980_000) * 1e3
    from bench_decode import Timer

    timer = Timer(torch.device("cuda"))
    rows = []
    for per_sm in WARPGROUPS_PER_SM:
        for kind, n, rs in CASES:
            row = measure(timer, kind, n, rs, per_sm, clock_hz)
            print(f"{kind} 64x{n}x{256 // (8 if kind == 's8' else 16)} A in {row['a']:9} {per_sm} WG/SM: "
                  f"{row['sm_cycles_per_wgmma']:6.1f} cycles / wgmma / SM, {row['dense_tops']:6.0f} TOPS", flush=True)
            rows.append(row)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        result = {"command": f"python3 profiles/bench_wgmma.py --out {args.out}", "gpu": props.name,
                  "clock_hz": clock_hz, "method": "CUDA events around one launch of iters x ksteps x 2 wgmmas per "
                  "warpgroup on every SM, median of 7 (bench_decode.Timer, no flush)", "rows": rows}
        write_record(args.out / "wgmma.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
