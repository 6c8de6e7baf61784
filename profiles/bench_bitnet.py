"""BitNet W2A8 benchmark: GEMV (M = 1) and GEMM (M = 16, 64, 256, 1024, 4096) vs torch bf16 (cuBLAS).

Method (everything in one run, on one GPU):

* Each measured call reads its weights from HBM, not L2: the weights are rotated over
  enough copies (``>= 4 x`` the L2 size in total, at least 2) that a copy is evicted
  long before it is read again; the bf16 baseline is rotated the same way.
* A sequence of calls (one per copy, at least 32) is captured in a CUDA graph and the
  graph replayed: the time per call is GPU time back to back, free of Python and
  launch overhead (that is how a decoder runs these layers).  CUDA events around each
  replay, warm-up replays first, median of the replays.
* Roofline: the HBM bandwidth measured in the same run, the better of a 1 GiB
  device-to-device copy ((bytes read + written) / time) and a 1 GiB fp32 ``sum`` (bytes
  read / time).  The GEMV moves ``N*K/4`` weight bytes plus ``K`` activation bytes and
  ``2N`` output bytes; bf16 moves ``2NK + 2K + 2N``.

``run(out_dir, quick=False, progress=None)`` writes ``out_dir/bitnet.json`` and
``out_dir/bitnet.png`` (if matplotlib is importable) and returns the results.
``quick=True``: fewer replays, GEMM at M = 16 with the default kernel only, no GEMV
variants.  The full run also times the other GEMV configurations side by side
(``unroll4_us`` / ``unroll8_us``, on Hopper also ``pdl_unrollU_us`` and
``pdl_unrollU_pin_us`` for U = 4, 5, 8, 10 with programmatic dependent launch, and
``pdl_bulk_us`` / ``pdl_bulk_x_us``, the stripe kernels; ``config`` names the default) and, on Hopper,
both GEMM kernels (mma.sync and wgmma) at every M; ``default`` marks the one
``bitnet.gemm`` picks.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

from bitdecode import bitnet as bn
from bitdecode._files import save_plot, write_record
from bitdecode._memory import release_memory
from bitdecode.bitnet_tune import MIN_CALLS, config_fields, copies_for, describe, entries, gpu_key, graph_time_us
from bitdecode.layouts.bitnet import TILE_N

SHAPES = bn.MODEL_SHAPES
GEMM_M = (16, 64, 256, 1024, 4096)
# Targets of the issue (H200): fraction of the roofline and speed-up over bf16 on the three
# largest GEMVs, the slowest GEMV, the GEMM speed-up at M = 16; the GEMM (default kernel)
# against bf16 at every M, and its geometric mean over the shapes at M >= 1024.
TARGETS = {"roofline_frac_largest3": 0.70, "speedup_largest3": 4.0, "max_gemv_us": 6.0, "gemm_m16_speedup": 2.0,
           "gemm_min_speedup": 1.2, "gemm_large_m_geomean": 1.6}
LARGE_M = 1024


def measure_roofline(device, replays: int) -> Dict[str, float]:
    """HBM bandwidth the GEMV is held to: the best of a 1 GiB device-to-device copy
    ((read + write bytes) / time) and a 1 GiB fp32 sum (read bytes / time; the GEMV only
    reads, and torch's copy kernel falls short of the read rate on Hopper)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    src.fill_(1)
    t_copy = graph_time_us([lambda: dst.copy_(src)] * 4, replays)
    dst = None  # (free it; rebinding, not del: the lambda above names it)
    as_f32 = src.view(torch.float32)
    t_sum = graph_time_us([lambda: as_f32.sum()] * 4, replays)
    src = as_f32 = None
    release_memory()
    copy_bw = 2 * (1 << 30) / (t_copy * 1e-6)
    read_bw = (1 << 30) / (t_sum * 1e-6)
    return {"copy_bytes": 2 * (1 << 30), "copy_us": t_copy, "copy_bytes_per_s": copy_bw,
            "read_bytes": 1 << 30, "read_us": t_sum, "read_bytes_per_s": read_bw,
            "bytes_per_s": max(copy_bw, read_bw)}


def gemv_bytes(n: int, k: int) -> int:
    """Bytes a W2A8 GEMV of an ``n x k`` weight moves: packed weights, int8 activations, bf16
    outputs."""
    return n * k // 4 + k + 2 * n


def gemv_variants(device) -> Dict[str, tuple]:
    """Every GEMV configuration this GPU runs (``bitnet.gemv_configs``) by column name:
    ``unrollU_us`` plain, ``pdl_unrollU_us`` with programmatic dependent launch
    (``pdl_unrollU_pin_us`` with the first weight batch pinned above the wait; ``pdl_bulk_us``
    the stripe kernel, ``pdl_bulk_x_us`` with x staged in shared memory too) ->
    (config, ``call(x, w, xs, ws) -> out`` running it)."""
    out = {}
    for cfg in bn.gemv_configs(device):
        out[describe(config_fields(cfg)) + "_us"] = (cfg, gemv_call(cfg))
    return out


def gemv_forms() -> Dict[str, object]:
    """The Hopper GEMV configurations by short name, for A/B runs beside the host's pick:
    ``u4`` .. ``u10pin`` (the register kernel's PDL candidates), ``bulk`` / ``bulk_x`` (the
    stripe kernels as shipped), ``bulk_es`` (BULK with its scales early) and ``bulk_x_late``
    (BULK_X with its scales late)."""
    import dataclasses

    from bitdecode.kernels_sm90 import bitnet_gemv as v90

    forms = {f"u{c.unroll}" + ("pin" if c.pin else ""): c for c in v90.CANDIDATES}
    forms.update(bulk=v90.BULK, bulk_x=v90.BULK_X, bulk_es=dataclasses.replace(v90.BULK, early_scales=True),
                 bulk_x_late=dataclasses.replace(v90.BULK_X, early_scales=False))
    return forms


def gemv_call(cfg) -> Callable:
    """``call(x, w, xs, ws) -> out``: the GEMV run with configuration ``cfg`` (one segment)."""
    def call(x, w, xs, ws):
        n = w.shape[0]
        return bn._gemv_launch(x, w, xs, ws, [n, n, n], False, cfg)

    return call


def check_segments(n: int) -> tuple:
    """Row counts of three fused segments over ``n`` rows (whole ``TILE_N``-row tiles; one
    segment where ``n`` has fewer than three tiles), for the output checks."""
    tiles = n // TILE_N
    if tiles < 3:
        return (n,)
    a = max(1, tiles // 4) * TILE_N
    return (a, a, n - 2 * a)


def wrong_gemv_outputs(x, packed, xs, configs: Dict[str, object]) -> List[str]:
    """The names of the GEMV configurations (``configs``, name -> configuration) whose
    outputs are wrong, and ``host`` for the host's own pick: checked over three fused
    segments with their own scales, the bf16 output and the raw int32 sums.  The host's sums
    must equal ``bn.reference_gemm``'s and its bf16 values lie within one bf16 ulp of it (the
    same fp32 maths rounded once); every other configuration must be bit-equal to the host's
    (they all sum exactly and share the epilogue).  A sweep thus checks each kernel it times
    at its own shapes."""
    n = packed.shape[0]
    segs = check_segments(n)
    ws = torch.tensor((0.75, 1.25, 1.5)[:len(segs)], device=x.device)
    ends = list(bn._segment_ends(segs, n))
    wrong = []
    for raw in (False, True):
        host = bn._gemv_launch(x, packed, xs, ws, ends, raw, None)
        ref = bn.reference_gemm(x, packed, xs, ws, segs, torch.int32 if raw else torch.bfloat16)
        if raw:
            right = torch.equal(host, ref)
        else:
            ref = ref.float()
            right = bool(((host.float() - ref).abs() <= ref.abs().clamp_min(1e-30) * 2.0**-7).all())
        if not right:
            wrong.append("host")
        wrong += [name for name, cfg in configs.items()
                  if not torch.equal(bn._gemv_launch(x, packed, xs, ws, ends, raw, cfg), host)]
    return list(dict.fromkeys(wrong))


def bench_gemv(n: int, k: int, device, l2: int, replays: int, roofline: float, variants=None) -> Dict[str, float]:
    """One GEMV shape: the host's configuration and every other of ``variants`` timed, bf16
    cuBLAS beside them, and ``wrong_outputs``: the configurations whose output was wrong
    (``wrong_gemv_outputs``: the variants' column names, ``host`` for the host's pick; empty
    when all are right)."""
    gen = torch.Generator(device=device).manual_seed(n + k)
    w = torch.randint(-1, 2, (n, k), generator=gen, dtype=torch.int8, device=device)
    packed = bn.pack_weight(w)
    copies = copies_for(packed.numel(), l2)
    packs = [packed.clone() for _ in range(copies)]
    x, xs = bn.quantize_activation(torch.randn(1, k, generator=gen, device=device))
    ws = torch.ones(1, device=device)
    calls = [(lambda p=packs[i % copies]: bn.gemv(x, p, xs, ws)) for i in range(max(copies, MIN_CALLS))]
    t = graph_time_us(calls, replays)
    others = {}
    default = bn.gemv_config_for(device, n, k)
    for name, (cfg, call) in (variants or {}).items():
        if cfg == default:
            continue
        calls = [(lambda p=packs[i % copies], call=call: call(x, p, xs, ws)) for i in range(max(copies, MIN_CALLS))]
        others[name] = graph_time_us(calls, replays)
    wrong = wrong_gemv_outputs(x, packed, xs, {name: cfg for name, (cfg, _) in (variants or {}).items()
                                               if cfg != default})
    del packs, calls
    # bf16: the same GEMV through cuBLAS, weights rotated the same way
    w16 = w.to(torch.bfloat16)
    copies16 = copies_for(w16.numel() * 2, l2)
    w16s = [w16.clone() for _ in range(copies16)]
    x16 = torch.randn(1, k, generator=gen, device=device, dtype=torch.bfloat16)
    calls = [(lambda q=w16s[i % copies16]: torch.matmul(x16, q.t())) for i in range(max(copies16, MIN_CALLS))]
    t16 = graph_time_us(calls, replays)
    del w16s, calls, w16
    release_memory()
    moved = gemv_bytes(n, k)
    moved16 = 2 * n * k + 2 * k + 2 * n
    return {
        "n": n,
        "k": k,
        "config": repr(default),
        "us": t,
        "bf16_us": t16,
        "speedup": t16 / t,
        "bytes": moved,
        "bytes_per_s": moved / (t * 1e-6),
        "roofline_frac": moved / (t * 1e-6) / roofline,
        "bf16_bytes_per_s": moved16 / (t16 * 1e-6),
        "bf16_roofline_frac": moved16 / (t16 * 1e-6) / roofline,
        "wrong_outputs": wrong,
        **others,
    }


def gemm_operands(n: int, k: int, device, l2: int):
    """A GEMM shape's ternary weights (seeded by the shape): (generator, weights, packed
    copies, bf16 copies), each set rotated over enough copies to exceed L2; the generator
    goes on to make the activations."""
    gen = torch.Generator(device=device).manual_seed(n * 3 + k)
    w = torch.randint(-1, 2, (n, k), generator=gen, dtype=torch.int8, device=device)
    packed = bn.pack_weight(w)
    packs = [packed.clone() for _ in range(copies_for(packed.numel(), l2))]
    w16 = w.to(torch.bfloat16)
    w16s = [w16.clone() for _ in range(copies_for(w16.numel() * 2, l2))]
    return gen, w, packs, w16s


def bench_gemm(n: int, k: int, ms, kernels, device, l2: int, replays: int) -> List[Dict[str, object]]:
    gen, w, packs, w16s = gemm_operands(n, k, device, l2)
    copies, copies16 = len(packs), len(w16s)
    ws = torch.ones(1, device=device)
    rows = []
    for m in ms:
        x, xs = bn.quantize_activation(torch.randn(m, k, generator=gen, device=device))
        x16 = torch.randn(m, k, generator=gen, device=device, dtype=torch.bfloat16)
        calls16 = [(lambda q=w16s[i % copies16]: torch.matmul(x16, q.t())) for i in range(max(copies16, MIN_CALLS))]
        t16 = graph_time_us(calls16, replays)
        default = bn.gemm_kernel_for(m, device, n, k)
        want = bn.accumulate(x, w)  # (exact int32 sums: every kernel timed is checked first)
        for kernel in kernels:
            got = bn.gemm(x, packs[0], xs, ws, kernel=kernel, out_dtype=torch.int32)
            wrong = [] if torch.equal(got, want) else [f"gemm M={m} {n}x{k} {kernel}"]
            calls = [
                (lambda p=packs[i % copies]: bn.gemm(x, p, xs, ws, kernel=kernel)) for i in range(max(copies, MIN_CALLS))
            ]
            t = graph_time_us(calls, replays)
            rows.append(
                {
                    "m": m,
                    "n": n,
                    "k": k,
                    "kernel": kernel,
                    "default": kernel == default,
                    "us": t,
                    "bf16_us": t16,
                    "speedup": t16 / t,
                    "tops": 2 * m * n * k / (t * 1e-6) / 1e12,
                    "wrong_outputs": wrong,
                }
            )
    del packs, w16s
    release_memory()
    return rows


def check_targets(gemv: List[Dict], gemm: List[Dict], wrong: Optional[List[str]] = None) -> Dict[str, object]:
    """The issue's targets from a run's rows.  Each is judged only on the whole set it names
    (every shape; the GEMM's default kernel at every M of ``GEMM_M`` on every shape): a
    partial run (``--quick``) reports what it measured with ``pass`` None; a run with a wrong
    output passes nothing."""
    largest = sorted(gemv, key=lambda r: r["n"] * r["k"])[-3:]
    shapes = set(SHAPES)
    whole_gemv = {(r["n"], r["k"]) for r in gemv} == shapes
    cells = [(r["m"], r["n"], r["k"]) for r in gemm if r["default"]]
    whole_gemm = sorted(cells) == sorted((m, n, k) for m in GEMM_M for n, k in shapes)
    m16 = [r for r in gemm if r["m"] == 16 and r["default"]]
    default = [r for r in gemm if r["default"]]
    large = [r["speedup"] for r in default if r["m"] >= LARGE_M]
    out = {
        "roofline_frac_largest3": min(r["roofline_frac"] for r in largest),
        "speedup_largest3": min(r["speedup"] for r in largest),
        "max_gemv_us": max(r["us"] for r in gemv),
        "gemm_m16_speedup": statistics.geometric_mean([r["speedup"] for r in m16]) if m16 else None,
        "gemm_min_speedup": min(r["speedup"] for r in default) if default else None,
        "gemm_min_speedup_by_m": {m: min(r["speedup"] for r in default if r["m"] == m)
                                  for m in sorted({r["m"] for r in default})},
        "gemm_large_m_geomean": statistics.geometric_mean(large) if large else None,
    }
    met = {
        "roofline_frac_largest3": out["roofline_frac_largest3"] >= TARGETS["roofline_frac_largest3"],
        "speedup_largest3": out["speedup_largest3"] >= TARGETS["speedup_largest3"],
        "max_gemv_us": out["max_gemv_us"] <= TARGETS["max_gemv_us"],
        "gemm_m16_speedup": bool(m16) and out["gemm_m16_speedup"] >= TARGETS["gemm_m16_speedup"],
        "gemm_min_speedup": bool(default) and out["gemm_min_speedup"] >= TARGETS["gemm_min_speedup"],
        "gemm_large_m_geomean": bool(large) and out["gemm_large_m_geomean"] >= TARGETS["gemm_large_m_geomean"],
    }
    whole = {"roofline_frac_largest3": whole_gemv, "speedup_largest3": whole_gemv, "max_gemv_us": whole_gemv,
             "gemm_m16_speedup": whole_gemm, "gemm_min_speedup": whole_gemm, "gemm_large_m_geomean": whole_gemm}
    out["pass"] = {name: (False if wrong else ok) if whole[name] else None for name, ok in met.items()}
    if wrong:
        out["not_passed_because"] = f"wrong outputs: {', '.join(wrong)}"
    elif not (whole_gemv and whole_gemm):
        out["not_judged_because"] = "a partial run (every shape, and the GEMM at every M of GEMM_M, are the targets' sets)"
    out["targets"] = TARGETS
    return out


def plot(results: Dict, path: Path) -> Optional[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    gemv = results["gemv"]
    labels = [f"{r['n']}x{r['k']}" for r in gemv]
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.8))
    ax = axes[0]
    xs = range(len(gemv))
    ax.bar([i - 0.2 for i in xs], [r["us"] for r in gemv], width=0.4, label="W2A8 GEMV (CuTe DSL)")
    ax.bar([i + 0.2 for i in xs], [r["bf16_us"] for r in gemv], width=0.4, label="bf16 matmul (cuBLAS)")
    for i, r in enumerate(gemv):
        ax.text(i - 0.2, r["us"], f"{100 * r['roofline_frac']:.0f}%", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(xs), labels, rotation=30, fontsize=8)
    ax.set_ylabel("us per call (HBM-resident weights)")
    ax.set_title(f"GEMV M=1 on {results['device']} (labels: % of {results['roofline']['bytes_per_s'] / 1e12:.2f} TB/s)")
    ax.legend(fontsize=8)
    ax = axes[1]
    gemm = [r for r in results["gemm"] if r["default"]]
    for m in sorted({r["m"] for r in gemm}):
        rows = [r for r in gemm if r["m"] == m]
        ax.plot([f"{r['n']}x{r['k']}" for r in rows], [r["speedup"] for r in rows], marker="o", label=f"M={m}")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_ylabel("speed-up over bf16 cuBLAS")
    ax.set_title("GEMM (integer tensor cores)")
    ax.tick_params(axis="x", rotation=30, labelsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save_plot(fig, path, dpi=120)


def run(out_dir: Path, quick: bool = False, progress=None) -> dict:
    """Run the benchmark on the current CUDA device; write bitnet.json (+ bitnet.png)."""
    if not torch.cuda.is_available():
        raise RuntimeError("the BitNet benchmark needs a CUDA GPU")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda", torch.cuda.current_device())
    props = torch.cuda.get_device_properties(device)
    l2 = props.L2_cache_size
    replays = 10 if quick else 30
    hopper = torch.cuda.get_device_capability(device)[0] == 9
    ms = (16,) if quick else GEMM_M
    kernels = ("mma", "wgmma") if hopper and not quick else ("mma",)
    variants = {} if quick else gemv_variants(device)

    task = None
    if progress is not None:
        task = progress.add_task("bitnet", total=1 + 2 * len(SHAPES))
    started = time.perf_counter()
    roofline = measure_roofline(device, replays)
    if progress is not None:
        progress.advance(task)
    gemv = []
    for n, k in SHAPES:
        gemv.append(bench_gemv(n, k, device, l2, replays, roofline["bytes_per_s"], variants))
        if progress is not None:
            progress.advance(task)
    gemm = []
    for n, k in SHAPES:
        gemm += bench_gemm(n, k, ms, kernels, device, l2, replays)
        if progress is not None:
            progress.advance(task)
    results = {
        "command": f"bitdecode bench bitnet{' --quick' if quick else ''} --out {out_dir}",
        "device": props.name,
        "capability": ".".join(map(str, torch.cuda.get_device_capability(device))),
        "sms": props.multi_processor_count,
        "l2_bytes": l2,
        "torch": torch.__version__,
        "quick": quick,
        "method": "CUDA-graph replay of back-to-back calls, weights rotated over >= 4x L2, median",
        # measured picks in effect (bitnet_tune; empty: the GEMV's rule chose every config)
        "gemv_tuning": entries(gpu_key(device)),
        "roofline": roofline,
        "gemv": gemv,
        "gemm": gemm,
        "wrong_outputs": [f"gemv {r['n']}x{r['k']} {name}" for r in gemv for name in r["wrong_outputs"]]
                         + [name for r in gemm for name in r["wrong_outputs"]],
        "seconds": time.perf_counter() - started,
    }
    results["summary"] = check_targets(gemv, gemm, results["wrong_outputs"])
    write_record(out_dir / "bitnet.json", results)
    png = plot(results, out_dir / "bitnet.png")
    results["plot"] = str(png) if png else None
    return results


def print_summary(res: dict) -> None:
    for r in res["gemv"]:
        print(
            f"gemv {r['n']:>5}x{r['k']:<5} {r['us']:7.2f} us  bf16 {r['bf16_us']:7.2f} us  "
            f"x{r['speedup']:5.2f}  {100 * r['roofline_frac']:5.1f}% of roofline"
        )
    for r in res["gemm"]:
        mark = "*" if r["default"] else " "
        print(
            f"gemm M={r['m']:<3} {r['n']:>5}x{r['k']:<5} {r['kernel']:<5}{mark} {r['us']:8.2f} us  "
            f"bf16 {r['bf16_us']:8.2f} us  x{r['speedup']:5.2f}  {r['tops']:6.1f} TOPS"
        )
    print(json.dumps(res["summary"], indent=1))
    for wrong in res["wrong_outputs"]:
        print(f"WRONG OUTPUT: {wrong}")


if __name__ == "__main__":  # pragma: no cover
    import sys

    from bitdecode import cli

    sys.exit(cli.main(["bench", "bitnet", *sys.argv[1:]]))
