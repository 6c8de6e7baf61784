"""``bitdecode demo``: an LLM-like KV cache quantized to 4 and 2 bits and decoded.

The cache imitates one attention layer of a GQA model (8 KV heads, 32 query heads, head
dim 128): K has rotary structure plus a few channels per head 10-20x larger than the rest
(the outlier channels that make per-channel K quantization worth it), V is Gaussian.  For each bit width the demo prefills a ``KVCache``, appends the last tokens one
decode step at a time, decodes one query token and reports the relative error of the
attention output against 16-bit attention (fp32 maths over the original 16-bit K/V), the
KV memory against a 16-bit cache, and on a GPU the decode time against torch SDPA.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from . import dispatch, reference
from .bitnet_tune import captured
from .cache import KVCache
from .cli import DTYPE_NAMES, nonnegative_int, out_of_memory, positive_int, print_error, torch_dtype
from .formats import GROUP_SIZES, K_MODES, KVFormat

KV_HEADS, Q_HEADS, HEAD_DIM = 8, 32, 128
APPENDED = 8  # tokens added by decode-step appends after the prefill


def add_parser(subparsers, name: str, help_text: str) -> argparse.ArgumentParser:
    p = subparsers.add_parser(name, help=help_text, description=__doc__.split("\n\n")[1].replace("``", ""))
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="where to run (default: cuda when available, else cpu)")
    p.add_argument("--seqlen", type=positive_int, default=None,
                   help="tokens per sequence (default: 32768 on cuda, 4096 on cpu)")
    p.add_argument("--bits", type=int, nargs="+", choices=(4, 2), default=[4, 2], help="bit widths to run (default: 4 2)")
    p.add_argument("--k-mode", choices=K_MODES, default="channel", help="K groups: per channel over tokens (KIVI) or per token over channels (default: channel)")
    p.add_argument("--group-size", type=int, choices=GROUP_SIZES, default=128, help="values per (scale, zero) pair (default: 128)")
    p.add_argument("--batch", type=positive_int, default=1, help="sequences (default: 1)")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="fp16", help="model dtype (default: fp16)")
    p.add_argument("--backend", choices=dispatch.BACKENDS, default="auto",
                   help="auto (default): the compiled kernel on a GPU, the torch reference on the CPU")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="seed of the synthetic cache (default: 0)")
    return p


# --------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------


def make_kv(batch: int, seqlen: int, seed: int):
    """fp32 K, V ``[B, N, Hkv, D]`` and q ``[B, 1, Hq, D]``, drawn on the CPU (the same data
    on every device).

    K: unit Gaussian plus a per-channel mean, 4-6 outlier channels per head carrying a
    constant of magnitude 10-20 (in the low-frequency rotary pairs, where real models have
    them), then rotary embedding (NeoX halves).  V: unit Gaussian plus a small per-channel
    mean.  q: unit Gaussian.
    """
    g = torch.Generator().manual_seed(seed)
    shape = (batch, seqlen, KV_HEADS, HEAD_DIM)
    half = HEAD_DIM // 2
    k = torch.randn(KV_HEADS, HEAD_DIM, generator=g) * 0.5 + torch.randn(shape, generator=g)
    for h in range(KV_HEADS):
        n_out = int(torch.randint(4, 7, (1,), generator=g))
        pairs = half * 3 // 4 + torch.randperm(half // 4, generator=g)[:n_out]
        chans = pairs + half * torch.randint(0, 2, (n_out,), generator=g)
        sign = torch.randint(0, 2, (n_out,), generator=g) * 2 - 1
        k[:, :, h, chans] += sign * torch.empty(n_out).uniform_(10, 20, generator=g)
    freq = 10000.0 ** (-torch.arange(half, dtype=torch.float32) / half)
    angle = torch.arange(seqlen, dtype=torch.float32)[:, None] * freq
    cos, sin = angle.cos()[None, :, None], angle.sin()[None, :, None]
    k1, k2 = k[..., :half], k[..., half:]
    k = torch.cat([k1 * cos - k2 * sin, k1 * sin + k2 * cos], dim=-1)
    v = torch.randn(shape, generator=g) + torch.randn(KV_HEADS, HEAD_DIM, generator=g) * 0.2
    q = torch.randn(batch, 1, Q_HEADS, HEAD_DIM, generator=g)
    return k, v, q


# --------------------------------------------------------------------------------------
# Measurements
# --------------------------------------------------------------------------------------


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm())


def cuda_time_ms(fn, iters: int = 50, warmup: int = 10) -> float:
    """Median GPU time of ``fn`` in ms: replays of a CUDA graph of ``fn``, each between two
    CUDA events, after warm-up (the graph keeps Python launch overhead out of the number)."""
    for _ in range(warmup):
        fn()
    fn = captured([fn]).replay
    for _ in range(3):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def sdpa_backend(q, k, v) -> str:
    """Which fused SDPA kernel torch picks for these inputs (private API: best effort)."""
    try:
        from torch.nn.attention import SDPBackend

        return SDPBackend(torch._fused_sdp_choice(q, k, v, enable_gqa=True)).name.lower()
    except Exception:
        return "unknown"


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


# --------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------


def measure(args, device: str, n: int, backend: str):
    """(16-bit row, one row per bit width); a row is (label or KVFormat, error, bytes, ms)."""
    on_gpu = device == "cuda"
    dtype, bsz = torch_dtype(args.dtype), args.batch
    k, v, q = (t.to(device=device, dtype=dtype) for t in make_kv(bsz, n, args.seed))
    # 16-bit attention: fp32 maths over the original 16-bit K/V
    ref = torch.stack([reference.attention(q[b, 0], k[b], v[b])[0] for b in range(bsz)])[:, None]

    qs, ks, vs = q.transpose(1, 2), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()

    def sdpa():  # torch SDPA on the 16-bit cache, [B, H, N, D]
        return torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True)

    dense_bytes = 2 * bsz * n * KV_HEADS * HEAD_DIM * k.element_size()
    base = (f"16-bit (torch SDPA, {sdpa_backend(qs, ks, vs)})", rel_error(sdpa().transpose(1, 2), ref),
            dense_bytes, cuda_time_ms(sdpa) if on_gpu else None)
    ks = vs = None  # (free the 16-bit copies; rebinding, not del: sdpa names them)

    rows, used = [], []
    for bits in args.bits:
        fmt = KVFormat(bits=bits, k_mode=args.k_mode, group_size=args.group_size)
        cache = KVCache.allocate(bsz, KV_HEADS, HEAD_DIM, n, fmt, dtype=dtype, device=device, backend=backend)
        first = max(n - APPENDED, 0)
        cache.prefill(k[:, :first], v[:, :first])
        for t in range(first, n):  # decode steps: one token at a time, in place
            cache.append(k[:, t:t + 1], v[:, t:t + 1])
        used.append(cache.backend_for(q))  # (auto's pick for this call: on Hopper, by length too)
        out = cache.decode(q)
        ms = cuda_time_ms(lambda: cache.decode(q)) if on_gpu else None
        rows.append((fmt, rel_error(out, ref), cache.memory_bytes(), ms))
        cache = None
    return base, rows, used


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.panel import Panel
    from rich.table import Table

    console = Console()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print_error("--device cuda, but no CUDA GPU is available (use --device cpu)")
        return 2
    try:  # before any work: a backend this device or build does not have
        dispatch.resolve(args.backend, torch.device(device), what="KV cache")
    except ValueError as exc:
        print_error(str(exc))
        return 2
    on_gpu = device == "cuda"
    n = args.seqlen or (32768 if on_gpu else 4096)
    args.bits = list(dict.fromkeys(args.bits))  # (--bits 4 4: one row)
    t0 = time.perf_counter()
    try:
        base, rows, used = measure(args, device, n, args.backend)
    except RuntimeError as exc:  # (torch.OutOfMemoryError is one)
        if not out_of_memory(exc):
            raise
        import textwrap

        print_error(f"--seqlen {n} --batch {args.batch}: the 16-bit K / V and the caches do not fit in "
                    f"{device}'s memory ({textwrap.shorten(str(exc), 160)}); try smaller sizes")
        return 2
    # auto may pick a different backend per bit width (Backend.auto_picks)
    backend = used[0] if len(set(used)) == 1 else ", ".join(f"{b}-bit {u}" for b, u in zip(args.bits, used))

    table = Table(title="decode attention: low-bit KV cache vs 16-bit", header_style="bold")
    table.add_column("KV cache", no_wrap=True)
    table.add_column("rel. error vs 16-bit", justify="right")
    table.add_column("KV memory", justify="right")
    table.add_column("vs 16-bit", justify="right")
    if on_gpu:
        table.add_column("decode time", justify="right")
        table.add_column("speedup vs SDPA", justify="right")
    dense_bytes, sdpa_ms = base[2], base[3]
    for what, err, nbytes, ms in [base, *rows]:
        label = what if isinstance(what, str) else f"{what.bits}-bit (K per {what.k_mode}, G={what.group_size})"
        cells = [label, f"{err:.2e}", _mib(nbytes), f"{nbytes / dense_bytes:.3f}x"]
        table.add_row(*cells, *([f"{ms * 1e3:,.1f} us", f"{sdpa_ms / ms:.2f}x"] if on_gpu else []))

    setup = (f"LLM-like KV cache: batch {args.batch}, {n:,} tokens, {KV_HEADS} KV heads / {Q_HEADS} query "
             f"heads, head dim {HEAD_DIM}, {args.dtype}; K: 4-6 outlier channels per head (10-20x) + "
             f"rotary structure, V: Gaussian; seed {args.seed}\n"
             f"device {device}, backend {backend}; prefill {max(n - APPENDED, 0):,} tokens, "
             f"append {min(APPENDED, n)} one at a time, decode 1 query token")
    console.print(Panel(setup, title="bitdecode demo", expand=False))
    console.print(table)
    notes = ["error: ||out - out16|| / ||out16|| over all heads, out16 = fp32 attention over the 16-bit K/V",
             "memory: packed K/V + (scale, zero) params + the 16-bit residual block, vs 16-bit K and V"]
    if on_gpu:
        notes.append("time: GPU time, median of 50 CUDA-graph replays between CUDA events, after warm-up")
    else:
        notes.append("time: run with --device cuda on a GPU to compare the speed with SDPA")
    console.print("\n".join(f"[dim]{x}[/]" for x in notes))
    console.print(f"[dim]done in {time.perf_counter() - t0:.1f} s[/]")
    return 0
