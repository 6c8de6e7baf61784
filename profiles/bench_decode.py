"""Decode benchmark: bitdecode vs torch SDPA (16-bit) vs the measured bandwidth roofline.

Everything is measured in one run on one GPU: CUDA events around each call, warm-up,
median of many, the L2 flushed before every timed call (a read of a 2x-L2 buffer: ``Timer``).  The roofline
is the best streaming bandwidth measured in the same run.  Results go to
``<out_dir>/decode.json`` (+ ``decode.png``), or with ``--quick`` (three context lengths,
B = 1 and 16, every backend side by side) to ``decode_backends.json`` (+ ``.png``);
``python -m profiles.bench_decode --help`` or ``bitdecode bench decode``.  Where FlashInfer
imports (the GPU host's peer kit), its paged decode at fp16 and fp8 KV is timed beside them
(``fi_<kv>_us``) and its output checked against SDPA (``bench_peer``).
"""

from __future__ import annotations

import statistics
import time
import warnings
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

import bitdecode as bd
from bitdecode._files import save_plot, write_record
from bitdecode._memory import release_memory
from bitdecode.bitnet_tune import captured

SHAPES = [(1, 32, 8, 128), (1, 32, 32, 128), (16, 32, 8, 128), (64, 32, 8, 128)]
MAX_TOKENS = 2 ** 21  # B * N cap: keeps the 16-bit SDPA cache of the sweep under ~10 GB
# the formats timed (K per channel g128), by the key of their result columns (bd<key>_us):
# 4-bit and 2-bit in every sweep, K 4-bit / V 2-bit and NVFP4 in the quick one
FORMATS = {"4": bd.KVFormat(bits=4, k_mode="channel", group_size=128),
           "2": bd.KVFormat(bits=2, k_mode="channel", group_size=128),
           "4v2": bd.KVFormat(bits=4, v_bits=2, k_mode="channel", group_size=128),
           "nvfp4": bd.KVFormat(fp4="nvfp4")}
LABELS = {"4": "4-bit", "2": "2-bit", "4v2": "K4V2", "nvfp4": "NVFP4"}


class Timer:
    """Median time of ``fn`` (CUDA events) with the L2 flushed before each call.

    ``flush`` says how: ``"clean"`` (the default) sums a buffer of twice the L2 that nothing
    writes after its first pass, so the timed call finds L2 full of other data's clean
    lines; ``"dirty"`` zeroes such a buffer (the benches' flush before the fifty-fifth
    session, as a memset-based flush does), which leaves L2 full of dirty lines that the
    timed call's own misses must write back first: up to an L2 of DRAM writes charged to
    it (H100, ``bench_flush.py``, two runs: +9 to +12 us on a 4-bit decode at B=1 N=128K
    and at B=16 N=64K and on SDPA there; 0.4 and 6 us at N=4K); ``"none"`` times the call as
    it comes."""

    FLUSHES = ("clean", "dirty", "none")

    def __init__(self, device, flush: str = "clean"):
        if flush not in self.FLUSHES:
            raise ValueError(f"flush must be one of {', '.join(self.FLUSHES)}, got {flush!r}")
        self.how = flush  # (the flush method; ``__call__``'s ``flush`` switches it off)
        self._device = device
        self._words = max(2 * torch.cuda.get_device_properties(device).L2_cache_size, 64 << 20) // 4
        self._bufs: Dict[str, torch.Tensor] = {}  # a flush's buffer, made on its first use
        self._sink = torch.empty((), dtype=torch.float32, device=device)
        if flush != "none":
            self._buffer(flush)

    def _buffer(self, how: str) -> torch.Tensor:
        buf = self._bufs.get(how)
        if buf is None:
            make = torch.ones if how == "clean" else torch.empty
            buf = self._bufs[how] = make(self._words, dtype=torch.float32, device=self._device)
            if how == "clean":  # (its own first write leaves dirty lines: read it once now)
                torch.sum(buf, dim=0, out=self._sink)
        return buf

    def flush_l2(self, how: Optional[str] = None) -> None:
        """Flush L2 as ``how`` (default: this timer's ``how``) says."""
        how = how or self.how
        if how == "clean":
            torch.sum(self._buffer("clean"), dim=0, out=self._sink)
        elif how == "dirty":
            self._buffer("dirty").zero_()

    def once(self, fn: Callable, how: Optional[str] = None, host: bool = False) -> float:
        """One call of ``fn`` after a flush (``flush_l2``'s ``how``), microseconds; with
        ``host`` the GPU is idle when the call starts, so its host work (Python, launches)
        is in the number (else it runs while the GPU flushes: the GPU's time only)."""
        self.flush_l2(how)
        if host:
            torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3

    def __call__(self, fn: Callable, iters: int = 30, warmup: int = 5, flush: bool = True,
                 host: bool = False) -> float:
        for _ in range(warmup):
            fn()
        return statistics.median(self.once(fn, None if flush else "none", host) for _ in range(iters))


def measure_roofline(timer: Timer, device) -> Dict[str, float]:
    """Streaming bandwidth (bytes/s): a 4 GiB read (sum; the roofline's floor) and copy (recorded)."""
    n = 1 << 31
    x = torch.ones(n, dtype=torch.float16, device=device)
    y = torch.empty_like(x)
    t_copy = timer(lambda: y.copy_(x), iters=10, warmup=2, flush=False)
    t_read = timer(lambda: x.sum(dtype=torch.float32), iters=10, warmup=2, flush=False)
    copy_bw = 2 * x.numel() * 2 / (t_copy * 1e-6)
    read_bw = x.numel() * 2 / (t_read * 1e-6)
    x = y = None  # (free them; rebinding, not del: the lambdas above name them)
    release_memory()
    # (the copy's bytes are its reads and its writes: not a read rate, so never the roofline)
    return {"copy_bytes_per_s": copy_bw, "read_bytes_per_s": read_bw, "best_bytes_per_s": read_bw}


def sdpa_backend(q, k, v) -> str:
    """Which SDPA implementation the default dispatch ran (from the kernel names)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        torch.cuda.synchronize()
    names = " ".join(e.name.lower() for e in prof.events())
    for key, label in (("cudnn", "cudnn"), ("flash", "flash"), ("fmha", "efficient"), ("mem_eff", "efficient")):
        if key in names:
            return label
    return "math"


def cache_bytes(cache: bd.KVCache) -> int:
    """Bytes one decode over ``cache`` reads, from its own tensors: each sequence's packed
    tokens (codes and params at what a token takes in the pages, padding included), its
    16-bit residual tokens and its 16-bit sink tokens.  Q and the output are not counted
    (at B = 1, Hq 32, D 128 they are 16 KB: 1.5 % / 2.7 % of a 4-bit / 2-bit N = 1K read)."""
    pages = (cache.k_pack, cache.k_params, cache.v_pack, cache.v_params)
    per_token = sum(t.numel() * t.element_size() for t in pages) / (cache.k_pack.shape[0] * cache.page_size)
    row16 = 2 * cache.num_kv_heads * cache.head_dim * cache.k_res.element_size()  # a 16-bit token, K and V
    nr, sinks = cache.fmt.residual_block, cache.fmt.sink_tokens
    total = 0
    for n in cache.lengths:
        rest = max(0, n - sinks)
        packed = rest // nr * nr
        total += packed * per_token + (rest - packed + min(n, sinks)) * row16
    return int(total)


def kernel_backends(device) -> List[str]:
    from bitdecode import dispatch

    return [b for b in dispatch.available(device) if b != "reference"]


def build(fmt, b, hkv, d, n, device, gen, dtype=torch.float16):
    k = torch.randn(b, n, hkv, d, device=device, dtype=dtype, generator=gen)
    v = torch.randn(b, n, hkv, d, device=device, dtype=dtype, generator=gen)
    cache = bd.KVCache.allocate(b, hkv, d, n, fmt, dtype=dtype, device=device)
    return cache, k, v


def sdpa_baseline(q: torch.Tensor, hkv: int, n: int, gen) -> Callable[[], torch.Tensor]:
    """The 16-bit baseline every decode benchmark times beside bitdecode: SDPA of ``q``
    ``[B, 1, Hq, D]`` over random K / V ``[B, Hkv, n, D]`` of q's dtype (drawn from ``gen``)
    with grouped KV heads; the callable holds the two tensors."""
    b, _, _, d = q.shape
    k16, v16 = (torch.randn(b, hkv, n, d, device=q.device, dtype=q.dtype, generator=gen) for _ in range(2))
    q4 = q.transpose(1, 2)
    return lambda: F.scaled_dot_product_attention(q4, k16, v16, enable_gqa=True)


# FlashInfer's paged batch decode: the peer a user would pick instead (fp16 or fp8 e4m3 KV),
# timed where ``flashinfer.decode`` imports (the GPU host's kit: ``eval "$(bash
# .device/fi-setup.sh)"``, ../shared/peers/flashinfer) and left out of the record elsewhere
PEER_PAGE = 16  # tokens a page (FlashInfer's common page size; the kit's README measured at 16)
PEER_KV = {"fp16": torch.float16, "fp8": torch.float8_e4m3fn}


def flashinfer_version() -> Optional[str]:
    """The importable FlashInfer's version, or None where it is absent (CI, a bare host)."""
    try:
        import flashinfer
        import flashinfer.decode  # noqa: F401  (the trimmed kit's package imports nothing itself)
    except ImportError:
        return None
    return getattr(flashinfer, "__version__", "unknown")


def peer_pages(b: int, n: int, device) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's page table for ``b`` sequences of ``n`` tokens each, laid out one after
    another: (indptr [b + 1], page indices, the tokens in each sequence's last page), int32."""
    pages = -(-n // PEER_PAGE)
    indptr = torch.arange(b + 1, dtype=torch.int32, device=device) * pages
    indices = torch.arange(b * pages, dtype=torch.int32, device=device)
    last = torch.full((b,), n - (pages - 1) * PEER_PAGE, dtype=torch.int32, device=device)
    return indptr, indices, last


def peer_kv_dense(cache: torch.Tensor, n: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[B, Hkv, n, D]`` (fp32) of a one-table-per-sequence FlashInfer cache
    ``[B * pages, 2, PEER_PAGE, Hkv, D]`` (``peer_pages``' order), for the reference."""
    pages, _, page, hkv, d = cache.shape
    b = pages // -(-n // page)
    flat = cache.float().view(b, -1, 2, page, hkv, d)  # (the page table is the identity)
    kv = flat.permute(2, 0, 4, 1, 3, 5).reshape(2, b, hkv, -1, d)[..., :n, :]
    return kv[0], kv[1]


def flashinfer_decode(q: torch.Tensor, hkv: int, n: int, kv: str, gen) -> Tuple[Callable, torch.Tensor, torch.Tensor]:
    """FlashInfer's batch decode (tensor cores, its fa2 backend: the kit builds no fa3) of
    ``q`` ``[B, 1, Hq, D]`` over random paged K / V of ``n`` tokens a sequence stored as
    ``kv`` (``PEER_KV``), planned for CUDA graphs (its fixed page-table buffers); (the call,
    its output ``[B, Hq, D]``, the paged cache)."""
    import flashinfer.decode as fi

    b, _, hq, d = q.shape
    indptr, indices, last = peer_pages(b, n, q.device)
    cache = torch.randn(indices.numel(), 2, PEER_PAGE, hkv, d, device=q.device, dtype=q.dtype,
                        generator=gen).to(PEER_KV[kv])
    workspace = torch.zeros(128 << 20, dtype=torch.uint8, device=q.device)  # (its README's size)
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True, backend="fa2",
        paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last)
    wrapper.plan(indptr, indices, last, hq, hkv, d, PEER_PAGE, q_data_type=q.dtype, kv_data_type=PEER_KV[kv])
    q3, out = q.reshape(b, hq, d), q.new_empty(b, hq, d)
    return (lambda: wrapper.run(q3, cache, out=out)), out, cache


def peer_error(q: torch.Tensor, out: torch.Tensor, cache: torch.Tensor, n: int) -> float:
    """Largest |FlashInfer's output - SDPA in fp32 over the same (stored) K / V|."""
    k, v = peer_kv_dense(cache, n)
    want = F.scaled_dot_product_attention(q.float().transpose(1, 2), k, v, enable_gqa=True)
    return (out.float() - want.transpose(1, 2).reshape(out.shape)).abs().max().item()


PEER_CHECK_TOKENS = 1 << 17  # B * N up to which the peer's output is checked (the fp32 reference's copy)
PEER_TOLERANCE = 2e-2  # on outputs of unit-variance V (measured: 8e-6 to 6e-5, H100, fp16 and fp8)


def bench_peer(timer, q: torch.Tensor, hkv: int, n: int, gen, row: dict, wrong: List[str]) -> None:
    """FlashInfer's decode at each ``PEER_KV`` width into ``row`` (``fi_<kv>_us``, its bytes
    a second ``fi_<kv>_bw``, and ``fi_<kv>_err`` where B * N <= PEER_CHECK_TOKENS), a
    wrong output named in ``wrong``."""
    b, d = q.shape[0], q.shape[-1]
    for kv in PEER_KV:
        call, out, cache = flashinfer_decode(q, hkv, n, kv, gen)
        t = _graph_time(timer, call)
        row[f"fi_{kv}_us"] = t
        row[f"fi_{kv}_bw"] = 2 * b * n * hkv * d * cache.element_size() / (t * 1e-6)
        if b * n <= PEER_CHECK_TOKENS:
            call()
            row[f"fi_{kv}_err"] = err = peer_error(q, out, cache, n)
            if not err <= PEER_TOLERANCE:
                wrong.append(f"flashinfer {kv} B={b} N={n}: max error {err:.3g}")
        call = out = cache = None
        release_memory()


# torch's fused SDPA backends, each timed where it takes the case (the math backend builds
# the scores in memory: never the fastest at these lengths)
SDPA_BACKENDS = ("cudnn", "flash", "efficient")


def fastest_sdpa(timer, sdpa: Callable[[], torch.Tensor]) -> Tuple[float, str, Dict[str, float], Callable]:
    """The 16-bit baseline at its best: ``sdpa`` (``sdpa_baseline``'s) under each of torch's
    fused backends that takes the case, graph-replayed; (the fastest's time, its name, every
    backend's time, the fastest pinned as a callable)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kinds = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION}
    times, pinned = {}, {}
    for name in SDPA_BACKENDS:
        def call(backend=kinds[name]):
            with sdpa_kernel(backend):
                return sdpa()

        try:
            with warnings.catch_warnings():  # (torch warns why a backend declines, then raises)
                warnings.simplefilter("ignore")
                times[name] = _graph_time(timer, call)
            pinned[name] = call
        except RuntimeError as exc:  # declined before any capture (GQA, the shape, this GPU)
            if "No available kernel" not in str(exc):
                raise
    if not times:
        raise RuntimeError("no fused SDPA backend of this torch takes the 16-bit baseline's shapes")
    best = min(times, key=times.get)
    return times[best], best, times, pinned[best]


def bench_shape(timer, shape, seqlens, keys, device, progress=None, task=None,
                peer: bool = False, wrong: Optional[List[str]] = None) -> List[dict]:
    """One row per length of ``seqlens``: SDPA, each format of ``keys`` on every backend,
    and with ``peer`` FlashInfer (``bench_peer``; its wrong outputs named in ``wrong``)."""
    b, hq, hkv, d = shape
    rows = []
    wrong = [] if wrong is None else wrong
    gen = torch.Generator(device=device).manual_seed(0)
    for n in seqlens:
        if b * n > MAX_TOKENS:  # (listed in the result's "skipped", with the reason)
            continue
        q = torch.randn(b, 1, hq, d, device=device, dtype=torch.float16, generator=gen)
        sdpa = sdpa_baseline(q, hkv, n, gen)
        t_sdpa, sdpa_name, sdpa_times, sdpa = fastest_sdpa(timer, sdpa)
        sdpa_bytes = 2 * b * hkv * n * d * 2
        row = {"B": b, "Hq": hq, "Hkv": hkv, "D": d, "N": n, "sdpa_us": t_sdpa, "sdpa_backend": sdpa_name,
               **{f"sdpa_{name}_us": us for name, us in sdpa_times.items()},
               "sdpa_eager_us": timer(sdpa, host=True), "sdpa_bw": sdpa_bytes / (t_sdpa * 1e-6)}
        del sdpa  # (its 16-bit K / V)
        if peer:
            bench_peer(timer, q, hkv, n, gen, row, wrong)
        for bits in keys:
            fmt = FORMATS[bits]
            cache, k, v = build(fmt, b, hkv, d, n, device, gen)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            cache.prefill(k, v)
            torch.cuda.synchronize()
            first_prefill_s = time.perf_counter() - t0  # includes compiling (or loading) the kernels
            timed = n >= 8192
            t_pre = timer(lambda: cache.prefill(k, v), iters=5, warmup=1, flush=True) if timed else float("nan")
            pre_bytes = 2 * b * n * hkv * d * 2 + cache_bytes(cache)  # (the 16-bit K / V read, the cache written)
            k = v = None
            t = _graph_time(timer, lambda: bd.decode(q, cache))
            row[f"bd{bits}_eager_us"] = timer(lambda: bd.decode(q, cache), host=True)
            nbytes = cache_bytes(cache)
            row[f"bd{bits}_us"] = t
            row[f"bd{bits}_bw"] = nbytes / (t * 1e-6)
            row[f"bd{bits}_speedup"] = t_sdpa / t
            picked = row[f"bd{bits}_auto"] = cache.backend_for(q)  # auto's pick for this call
            for name in kernel_backends(device):  # every backend side by side (auto's timed above)
                tb = t if name == picked else _graph_time(timer, lambda: bd.decode(q, cache, backend=name))
                row[f"bd{bits}_{name}_us"] = tb
                row[f"bd{bits}_{name}_bw"] = nbytes / (tb * 1e-6)
            row[f"bd{bits}_prefill_bw"] = pre_bytes / (t_pre * 1e-6) if t_pre == t_pre else None
            row[f"bd{bits}_first_prefill_s"] = first_prefill_s
            cache = None
            release_memory()
        rows.append(row)
        if progress is not None:
            progress.advance(task)
            progress.refresh()
    return rows


def bench_graph_small(timer, device) -> dict:
    """B=1, Hq/Hkv=32/8, N=4K: eager and CUDA-graph replay, bitdecode 4/2-bit vs SDPA."""
    b, hq, hkv, d, n = 1, 32, 8, 128, 4096
    gen = torch.Generator(device=device).manual_seed(1)
    q = torch.randn(b, 1, hq, d, device=device, dtype=torch.float16, generator=gen)
    sdpa = sdpa_baseline(q, hkv, n, gen)
    out = {"sdpa_eager_us": timer(sdpa, host=True), "sdpa_graph_us": _graph_time(timer, sdpa)}
    # the host's yardstick, timed the same way: one torch add on a tiny tensor (the eager
    # columns moved by ~1.5x between just-started hosts; in torch adds they compare)
    one = torch.zeros(1, device=device)
    out["torch_add_eager_us"] = timer(lambda: one.add_(1), host=True)
    for bits in (4, 2):
        fmt = bd.KVFormat(bits=bits)
        cache, k, v = build(fmt, b, hkv, d, n, device, gen)
        cache.prefill(k, v)
        out[f"bd{bits}_eager_us"] = timer(lambda: bd.decode(q, cache), host=True)
        out[f"bd{bits}_graph_us"] = _graph_time(timer, lambda: bd.decode(q, cache))
        picked = cache.backend_for(q)  # auto's backend: the column above
        for name in kernel_backends(device):
            if name != picked:
                out[f"bd{bits}_{name}_graph_us"] = _graph_time(timer, lambda: bd.decode(q, cache, backend=name))
        # append latency: one token into the residual (no flush of a block), eager
        k1 = torch.randn(b, 1, hkv, d, device=device, dtype=torch.float16, generator=gen)
        cache2 = bd.KVCache.allocate(b, hkv, d, n + 10 ** 6, fmt, device=device)
        cache2.prefill(k, v)
        out[f"bd{bits}_append_us"] = timer(lambda: cache2.append(k1, k1), iters=40, host=True)  # median: no block fills
    return out


def _graph_time(timer, fn) -> float:
    """Median time of ``fn`` replayed from a CUDA graph (no host launch cost in the number;
    ``captured`` waits out the memory its capture would free)."""
    return timer(captured([fn]).replay)


def plot(result: dict, path: Path) -> Optional[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    # (lines drawn without antialiasing: the PNG, kept in git, is ~25 % smaller)
    with matplotlib.rc_context({"lines.antialiased": False, "patch.antialiased": False}):
        return _draw(plt, result, path)


def _draw(plt, result: dict, path: Path) -> Path:
    shapes = sorted({(r["B"], r["Hq"], r["Hkv"], r["D"]) for r in result["rows"]})
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.5 * len(shapes), 3.6), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        rows = [r for r in result["rows"] if (r["B"], r["Hq"], r["Hkv"], r["D"]) == shape]
        ns = [r["N"] for r in rows]
        ax.plot(ns, [r["sdpa_us"] for r in rows], "k-o", label="SDPA fp16", ms=3)
        for kv, style in zip(PEER_KV, ("-", "--")):
            if f"fi_{kv}_us" in rows[0]:
                ax.plot(ns, [r[f"fi_{kv}_us"] for r in rows], "0.5", ls=style, marker="x",
                        label=f"FlashInfer {kv} KV", ms=3)
        for bits, color in (("4", "b"), ("2", "r"), ("4v2", "g"), ("nvfp4", "m")):
            for name, style in zip(result.get("backends", []), ("-s", "--^", ":o")):
                if f"bd{bits}_{name}_us" in rows[0]:
                    ax.plot(ns, [r[f"bd{bits}_{name}_us"] for r in rows], color + style,
                            label=f"bitdecode {LABELS[bits]} {name}", ms=3)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title("B=%d Hq/Hkv=%d/%d D=%d" % shape, fontsize=9)
        ax.set_xlabel("tokens")
        ax.set_ylabel("µs")
        ax.grid(alpha=0.3)
        if ax is axes[0][0]:  # (one legend: every panel draws the same series)
            ax.legend(fontsize=7)
    fig.suptitle(f"decode on {result['gpu']} (L2 flushed, median)", fontsize=10)
    fig.tight_layout()
    return save_plot(fig, path, dpi=110)


def run(out_dir: Path, quick: bool = False, progress=None, flush: str = "clean") -> dict:
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    timer = Timer(device, flush)
    roofline = measure_roofline(timer, device)
    best = roofline["best_bytes_per_s"]
    seqlens = [4096, 32768, 131072] if quick else [2 ** i for i in range(10, 19)]
    shapes = SHAPES[:1] + SHAPES[2:3] if quick else SHAPES
    skipped = [{"B": b, "N": n, "why": f"B * N = {b * n} > MAX_TOKENS = {MAX_TOKENS} (the 16-bit baseline's "
                "K / V would not fit beside the caches)"}
               for b, _, _, _ in shapes for n in seqlens if b * n > MAX_TOKENS]
    task = None
    if progress is not None:
        task = progress.add_task("decode sweep", total=len(shapes) * len(seqlens) - len(skipped))
    rows = []
    keys = ("4", "2", "4v2", "nvfp4") if quick else ("4", "2")
    peer, wrong = flashinfer_version(), []
    for shape in shapes:
        rows += bench_shape(timer, shape, seqlens, keys, device, progress, task, peer is not None, wrong)
    # the roofline is the best read bandwidth seen in this run: a torch sum (a read; the copy
    # moves twice its bytes, read and write, and is recorded beside), or SDPA itself (cuDNN
    # streams the 16-bit cache faster than torch's reductions); which one is recorded
    best_row = max(rows, key=lambda r: r["sdpa_bw"])
    source = "torch sum of a 4 GiB buffer (measure_roofline)"
    if best_row["sdpa_bw"] > best:
        best = best_row["sdpa_bw"]
        source = f"SDPA ({best_row['sdpa_backend']}) at B={best_row['B']} Hkv={best_row['Hkv']} N={best_row['N']}"
    roofline["best_bytes_per_s"], roofline["best_source"] = best, source
    for r in rows:
        for bits in keys:
            r[f"bd{bits}_roofline"] = r[f"bd{bits}_bw"] / best
            for name in kernel_backends(device):
                if f"bd{bits}_{name}_bw" in r:
                    r[f"bd{bits}_{name}_roofline"] = r[f"bd{bits}_{name}_bw"] / best
        for kv in PEER_KV:
            if f"fi_{kv}_bw" in r:
                r[f"fi_{kv}_roofline"] = r[f"fi_{kv}_bw"] / best
    gen = torch.Generator(device=device).manual_seed(3)
    qb = torch.randn(1, 32, 1, 128, device=device, dtype=torch.float16, generator=gen)
    kb = torch.randn(1, 8, 4096, 128, device=device, dtype=torch.float16, generator=gen)
    # the quick sweep (every backend side by side) is its own record: it never replaces the
    # full sweep's decode.json
    name = "decode_backends" if quick else "decode"
    result = {
        "command": (f"bitdecode bench decode{' --quick' if quick else ''}"
                    f"{' --flush ' + flush if flush != 'clean' else ''} --out {out_dir}"),
        "gpu": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "sdpa_backend": sdpa_backend(qb, kb, kb),
        "backends": kernel_backends(device),
        "roofline": roofline,
        "method": ("kernel time: CUDA-graph replay between CUDA events, median of 30 after 5 warm-ups, "
               f"L2 flushed before each call ({timer.how}: Timer), memory freed between cases waited out "
               "(release_memory); *_eager_us: plain eager calls started on an idle "
               "GPU after the flush (their host work included; small_graph.torch_add_eager_us: the host's yardstick, "
               "a torch add timed so); sdpa_us: the fastest of torch's fused SDPA "
               "backends that take the case (sdpa_backend, each one's sdpa_<name>_us); roofline: the bytes each "
               "decode reads (cache_bytes: packed pages, 16-bit residual and sinks; Q and the output not "
               "counted) over roofline.best_bytes_per_s (its source: roofline.best_source)"),
        "flush": timer.how,
        "format": ("K per channel g128, V per token g128, fp16; bd4 / bd2: one width, bd4v2: K 4-bit / V 2-bit; "
                   "bdnvfp4: NVFP4 (K per token, V per channel, one e4m3 scale per 16 values)"),
        "peer": ({"flashinfer": peer, "columns": "fi_<kv>_us: FlashInfer's BatchDecodeWithPagedKVCacheWrapper "
                  f"(tensor cores, fa2 backend, NHD pages of {PEER_PAGE} tokens, fixed page-table buffers) "
                  "graph-replayed under the same timer; kv fp16 or fp8 (e4m3, unit scales); fi_<kv>_err: its "
                  f"largest error against fp32 SDPA over the same stored K / V (B * N <= {PEER_CHECK_TOKENS})"}
                 if peer else None),
        "wrong_outputs": wrong,
        "rows": rows,
        "skipped": skipped,
        "small_graph": bench_graph_small(timer, device),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    write_record(out_dir / f"{name}.json", result)
    plot(result, out_dir / f"{name}.png")
    return result


def print_summary(res: dict) -> None:
    print(f"{res['gpu']}  SDPA backend: {res['sdpa_backend']}  roofline "
          f"{res['roofline']['best_bytes_per_s'] / 1e12:.2f} TB/s")
    print(f"{'B':>3} {'Hq':>3} {'Hkv':>3} {'N':>7} {'sdpa':>8} {'bd4':>8} {'x':>5} {'roof':>5} {'bd2':>8} {'x':>5} {'roof':>5}")
    for r in res["rows"]:
        print(f"{r['B']:3d} {r['Hq']:3d} {r['Hkv']:3d} {r['N']:7d} {r['sdpa_us']:8.1f} "
              f"{r['bd4_us']:8.1f} {r['bd4_speedup']:5.2f} {r['bd4_roofline']:5.2f} "
              f"{r['bd2_us']:8.1f} {r['bd2_speedup']:5.2f} {r['bd2_roofline']:5.2f}")
    names = res.get("backends", [])
    if names:
        r0 = res["rows"][0]
        print("per backend (us, fraction of the roofline); auto:",
              ", ".join(f"{LABELS[bits]} {r0.get(f'bd{bits}_auto')}" for bits in FORMATS if f"bd{bits}_auto" in r0))
        for r in res["rows"]:
            cells = [f"{LABELS[bits]} {n}: {r[f'bd{bits}_{n}_us']:7.1f} ({r[f'bd{bits}_{n}_roofline']:.2f})"
                     for bits in FORMATS for n in names if f"bd{bits}_{n}_us" in r]
            print(f"{r['B']:3d} {r['N']:7d}  " + "  ".join(cells))
    if res.get("peer"):
        print(f"FlashInfer {res['peer']['flashinfer']} (us, fraction of the roofline):")
        for r in res["rows"]:
            print(f"{r['B']:3d} {r['Hq']:3d} {r['Hkv']:3d} {r['N']:7d}  " + "  ".join(
                f"{kv} KV: {r[f'fi_{kv}_us']:7.1f} ({r[f'fi_{kv}_roofline']:.2f})" for kv in PEER_KV))
    print("small/graph:", {k: round(v, 1) for k, v in res["small_graph"].items()})


if __name__ == "__main__":
    import sys

    from bitdecode import cli

    sys.exit(cli.main(["bench", "decode", *sys.argv[1:]]))
