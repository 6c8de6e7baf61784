"""Tensor-parallel decode of a Llama-3.1-70B-shaped model: 16-bit cache vs bitdecode 4 / 2 bits.

    torchrun --nproc-per-node 2 profiles/bench_tp.py --out profiles/h200       # 2, 4 or 8 GPUs
    torchrun --nproc-per-node 2 profiles/bench_tp.py --tiny --device cpu --out /tmp/tp   # CPU smoke

The model is transformers' ``LlamaForCausalLM`` under transformers' own tensor parallelism
(``from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto"))``, i.e. the
config's ``base_model_tp_plan`` over torch.distributed / NCCL): 80 layers, 64 query / 8 KV
heads of 128, hidden 8192, MLP 28672, vocab 128256, bf16.  The weights are random and
never exist whole: ``from_pretrained(None, config=..., state_dict={})`` builds the model on
the meta device, turns every parameter into a sharded DTensor and then allocates and
initializes only each rank's shard, on its GPU (no checkpoint, no download, no CPU copy).

Caches are filled directly with random K / V at the context length (the prefill is not
run through the model and not timed): every layer gets the same random [B, N, Hkv/world, D]
tensors, through the cache's own ``update`` (and, for bitdecode, ``store_prompt``, which
packs them as a prompt would be).  Then one decode step (one new token per sequence through
the whole model: embedding, 80 layers with the cache append and attention, the all-reduces,
lm_head) is timed, CUDA-graph captured when the capture works (else eager, and the JSON
says so), CUDA events around each replay, median after warm-up; the slowest rank counts.
Each rank's steps append in place, so the context grows by one token per call (a few
hundred at most: negligible at 32K / 128K; the caches are sized for it).

Caches compared (``kind`` in the JSON):

* ``sdpa16``: transformers' ``StaticCache`` (16-bit) and torch SDPA with ``enable_gqa`` over
  the N + 1 valid positions, no mask (the fastest 16-bit decode here: cuDNN / flash, K/V read
  once; a registered attention function ``bench_sdpa_gqa``);
* ``sdpa16_hf`` (B = 1 only, skipped by ``--quick``): the same cache with transformers'
  stock ``"sdpa"`` attention, which at decode masks the whole static length (and, in
  transformers 5.17, repeats the KV heads with ``repeat_kv``; newer ones pack the query
  heads per KV head instead);
* ``bd4`` / ``bd2``: ``bitdecode.hf.BitDecodingCache`` (K per channel, group 128), the
  ``"bitdecode"`` attention, kernels by ``backend`` (``auto``).

For each context length N (32K, 128K) and cache: B = 1 and the largest batch whose cache
(plus the fill's transient K / V and a reserve) fits the free memory of every rank.
Results: ``<out>/tp<world>.json`` (+ ``tp<world>.png`` with matplotlib), written by rank 0
after every row.  The script sets ``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``
and ``NVSHMEM_DISABLE_NVLS=1`` (``os.environ.setdefault``, before torch.distributed starts).
"""

from __future__ import annotations

import os

for _key, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                     ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_key, _value)

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable, List, Optional  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bitdecode._files import write_record  # noqa: E402
from bitdecode._memory import release_memory  # noqa: E402

GIB = 1024 ** 3
NVLS_ENV = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")

# Llama-3.1-70B's shape (random weights)
LLAMA_70B = dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                 num_attention_heads=64, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
                 rope_theta=500000.0, max_position_embeddings=131072 + 4096, tie_word_embeddings=False)
# the CPU smoke model: the same code path, 2 layers
TINY = dict(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=16,
            num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
            max_position_embeddings=8192, tie_word_embeddings=False)

GQA_ATTN = "bench_sdpa_gqa"
_VALID = {"len": None}  # positions the sdpa16 attention reads (N + 1), set per cache
_CAPTURED = {"any": False}  # whether a CUDA graph with NCCL collectives was captured


def sdpa_gqa_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                       scaling: Optional[float] = None, **kwargs):
    """16-bit decode over a StaticCache: SDPA with grouped KV heads on the first
    ``_VALID['len']`` positions of the static buffers, no mask (so cuDNN / flash can take it).
    Anything else (a multi-token call) goes to transformers' SDPA function."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    n = _VALID["len"]
    if query.shape[2] != 1 or n is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    out = F.scaled_dot_product_attention(query, key[:, :, :n], value[:, :, :n], scale=scaling, enable_gqa=True)
    return out.transpose(1, 2), None


# ---- distributed setup -------------------------------------------------------------------

def init_distributed(device_kind: str):
    """torch.distributed from torchrun's environment: NCCL on one GPU per rank, or gloo on the CPU."""
    from datetime import timedelta

    local = int(os.environ.get("LOCAL_RANK", 0))
    timeout = timedelta(hours=1)  # the first decode of each format compiles its kernels on every rank
    if device_kind == "cuda":
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    return device


def tp_kwargs() -> dict:
    """transformers' tensor parallelism with the model's own plan over all ranks."""
    try:
        from transformers.distributed import DistributedConfig
    except ImportError:  # transformers before the distributed package
        return {"tp_plan": "auto"}
    return {"distributed_config": DistributedConfig(tp_plan="auto")}


def build_model(shape: dict, layers: Optional[int]):
    """The random-weight model, each rank holding (and initializing) only its shards."""
    import transformers

    from bitdecode import hf

    cfg = dict(shape)
    if layers:
        cfg["num_hidden_layers"] = layers
    config = transformers.LlamaConfig(**cfg)
    model = transformers.LlamaForCausalLM.from_pretrained(
        None, config=config, state_dict={}, dtype=torch.bfloat16, attn_implementation=hf.ATTN_IMPLEMENTATION,
        **tp_kwargs())
    return model.eval()


def local_bytes(model) -> int:
    """Bytes of this rank's parameters (its DTensor shards, the replicated rest)."""
    total = 0
    for p in model.parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        total += t.numel() * t.element_size()
    return total


def set_attention(model, name: str) -> None:
    model.config._attn_implementation = name  # every module reads the one config object
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and cfg is not model.config and hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = name


def nccl_version() -> str:
    v = torch.cuda.nccl.version()
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


# ---- caches ------------------------------------------------------------------------------

class Shapes:
    def __init__(self, model, world: int):
        c = model.config
        self.layers = c.num_hidden_layers
        self.hq = c.num_attention_heads // world
        self.hkv = c.num_key_value_heads // world
        self.d = c.head_dim
        self.vocab = c.vocab_size


def fmt_for(kind: str, d: int):
    import bitdecode as bd

    return bd.KVFormat(bits=4 if kind == "bd4" else 2, k_mode="channel", group_size=min(128, d))


def cache_bytes_per_seq(kind: str, s: Shapes, capacity: int) -> int:
    """This rank's bytes of one sequence's cache over all layers (exact: the allocation's shapes, on the
    CPU: a cache is never allocated on the meta device)."""
    import bitdecode as bd

    if kind.startswith("sdpa16"):
        return s.layers * 2 * s.hkv * capacity * s.d * 2
    kv = bd.KVCache.allocate(1, s.hkv, s.d, capacity, fmt_for(kind, s.d), dtype=torch.bfloat16, device="cpu",
                             backend="reference")
    return s.layers * kv.memory_bytes()


def transient_bytes_per_seq(kind: str, s: Shapes, n: int) -> int:
    """The fill's random K and V (one layer's worth, reused by every layer); the stock SDPA
    path may also repeat one layer's KV heads at decode (K and V at the query-head count)."""
    fill = 2 * n * s.hkv * s.d * 2
    if kind == "sdpa16_hf":
        fill += 2 * s.hq * (n + 1) * s.d * 2
    return fill


def make_cache(model, kind: str, s: Shapes, b: int, n: int, capacity: int, backend: str, device):
    """A cache of ``b`` sequences holding ``n`` random tokens in every layer."""
    import transformers

    from bitdecode import hf

    gen = torch.Generator(device=device).manual_seed(1234 + dist.get_rank())
    k = torch.randn(b, n, s.hkv, s.d, generator=gen, device=device, dtype=torch.bfloat16)
    v = torch.randn(b, n, s.hkv, s.d, generator=gen, device=device, dtype=torch.bfloat16)
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, N, D] as the attention modules hand them
    if kind.startswith("sdpa16"):
        set_attention(model, GQA_ATTN if kind == "sdpa16" else "sdpa")
        cache = transformers.StaticCache(config=model.config, max_cache_len=capacity)
        for i in range(s.layers):
            cache.update(kt, vt, i)
    else:
        set_attention(model, hf.ATTN_IMPLEMENTATION)
        cache = hf.BitDecodingCache(model, fmt_for(kind, s.d), max_seqlen=capacity, backend=backend)
        valid = torch.ones(b, n, dtype=torch.bool, device=device)
        for i in range(s.layers):
            cache.update(kt, vt, i)  # allocates the layer from the shapes, as a prompt would
            cache.layers[i].store_prompt(kt, vt, valid)  # and packs the tokens
    del k, v, kt, vt
    return cache


def resolved_backend(cache) -> Optional[str]:
    layers = getattr(cache, "layers", [])
    kv = getattr(layers[0], "kv", None) if layers else None
    return kv.backend if kv is not None else None


# ---- timing ------------------------------------------------------------------------------

def all_reduce(value: float, op=dist.ReduceOp.MAX, device=None) -> float:
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.item()


def time_calls(fn: Callable, iters: int, warmup: int, device) -> float:
    """Median milliseconds of ``fn`` (CUDA events on a GPU, perf_counter on the CPU)."""
    from bench_e2e import time_eager  # profiles/ is on the path of a script run from there

    return statistics.median(time_eager(fn, device, warmup, iters))


def capture(step: Callable):
    """``step`` as a CUDA graph (warmed up on a side stream first), or the error text.
    Thread-local capture mode: c10d's watchdog thread keeps querying the events of earlier
    collectives, which the global mode would count as an unsafe call during the capture."""
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        release_memory()  # (what the capture would free, given back and waited out first: ``captured``)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            step()
        torch.cuda.synchronize()
        return graph, None
    except Exception as exc:  # noqa: BLE001 - any failure falls back to eager, reported in the JSON
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001
            pass
        return None, f"{type(exc).__name__}: {exc}"[:500]


def run_config(model, kind: str, s: Shapes, b: int, n: int, args, device) -> Optional[dict]:
    """Build, fill and time one cache configuration; every rank runs it, rank 0 reports.
    Returns None when a rank ran out of memory filling the cache (the ranks agree on that
    before anything collective runs; the fill itself has no collectives)."""
    capacity = n + margin_tokens(args)
    row = {"kind": kind, "N": n, "B": b}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _VALID["len"] = n + 1
    cache, fill_error, oom = None, None, False
    try:
        cache = make_cache(model, kind, s, b, n, capacity, args.backend, device)
    except torch.cuda.OutOfMemoryError:
        oom = True
    except Exception:  # noqa: BLE001 - reported below, after the ranks agree
        fill_error = traceback.format_exc()[-2000:]
    if cache is None:
        gc.collect()
        if device.type == "cuda":
            release_memory()
    # 0: filled, 1: out of memory, 2: failed; the worst rank decides for all
    state = all_reduce(2.0 if fill_error else 1.0 if oom else 0.0, device=device)
    if state > 0:
        del cache
        free_memory(device)
        if state == 1:
            return None
        raise RuntimeError(f"filling the cache failed:\n{fill_error or 'on another rank'}")
    row["backend"] = resolved_backend(cache)
    gen = torch.Generator(device=device).manual_seed(7)
    ids = torch.randint(0, s.vocab, (b, 1), generator=gen, device=device)
    pos = torch.full((b, 1), n, dtype=torch.long, device=device)
    from bitdecode.hf import cache_kwarg

    kw = {cache_kwarg(model): cache, "use_cache": True}

    def step():
        return model(input_ids=ids, position_ids=pos, **kw).logits

    graph = None
    with torch.inference_mode():
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        row["eager_ms"] = all_reduce(time_calls(step, args.eager_iters, args.eager_warmup, device), device=device)
        if device.type != "cuda":
            err = "not a CUDA device"
        elif args.eager:
            err = "--eager"
        else:
            graph, err = capture(step)
        ok = all_reduce(1.0 if graph is not None else 0.0, op=dist.ReduceOp.MIN, device=device) > 0
        if ok:
            _CAPTURED["any"] = True
            dist.barrier()
            ms = all_reduce(time_calls(graph.replay, args.iters, args.warmup, device), device=device)
        else:
            ms = row["eager_ms"]
    row.update(graph=ok, ms_per_step=ms, tokens_per_s=b / (ms * 1e-3))
    if not ok:
        row["graph_error"] = err if graph is None else "another rank's capture failed"
    row["cache_gib_per_gpu"] = b * cache_bytes_per_seq(kind, s, capacity) / GIB
    if device.type == "cuda":
        row["mem_allocated_gib"] = all_reduce(torch.cuda.memory_allocated(device), device=device) / GIB
        row["max_mem_allocated_gib"] = all_reduce(torch.cuda.max_memory_allocated(device), device=device) / GIB
    kw.clear()
    del graph, step, cache
    free_memory(device)
    return row


def free_memory(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        release_memory()
    dist.barrier()


def free_budget(device, args) -> float:
    """Bytes this rank can still give a cache: free device memory plus torch's idle reserve,
    less a margin for activations, CUDA-graph pools and the decode workspaces."""
    if device.type != "cuda":
        return args.cpu_budget_gib * GIB
    free, total = torch.cuda.mem_get_info(device)
    idle = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    reserve = max(args.reserve_gib * GIB, 0.03 * total)
    return free + idle - reserve


def margin_tokens(args) -> int:
    """Cache room past N for every call a configuration makes (each appends one token)."""
    return args.eager_warmup + args.eager_iters + 3 + args.warmup + args.iters + 16


def max_batch(kind: str, s: Shapes, n: int, args, device) -> int:
    per_seq = cache_bytes_per_seq(kind, s, n + margin_tokens(args)) + transient_bytes_per_seq(kind, s, n)
    b = int(free_budget(device, args) // per_seq)
    b = int(all_reduce(b, op=dist.ReduceOp.MIN, device=device))  # every rank must fit it
    return max(0, min(b, args.max_batch))


def try_config(model, kind, s, b, n, args, device) -> Optional[dict]:
    """``run_config``, with a smaller batch when the cache does not fit after all."""
    for _ in range(4):
        row = run_config(model, kind, s, b, n, args, device)
        if row is not None or b == 1:
            return row
        b = max(1, int(b * 0.85))
    return None


# ---- report ------------------------------------------------------------------------------

def summarize(rows: List[dict]) -> dict:
    """The issue's ratios per context: bitdecode's largest batch and decode rate over the
    16-bit cache's (largest batch each), and its decode rate at B = 1."""
    rows = [r for r in rows if "tokens_per_s" in r]
    out = {}
    for n in sorted({r["N"] for r in rows}):
        at = {(r["kind"], r["B"]): r for r in rows if r["N"] == n}
        best = {}
        for r in rows:
            if r["N"] == n and r.get("is_max_batch"):
                best[r["kind"]] = r
        one = {k: r for (k, b), r in at.items() if b == 1}
        s = {}
        if "sdpa16" in best and "bd4" in best:
            s["bd4_over_sdpa16_max_batch"] = best["bd4"]["B"] / best["sdpa16"]["B"]
            s["bd4_over_sdpa16_max_batch_tokens_per_s"] = best["bd4"]["tokens_per_s"] / best["sdpa16"]["tokens_per_s"]
        if "sdpa16" in best and "bd2" in best:
            s["bd2_over_sdpa16_max_batch"] = best["bd2"]["B"] / best["sdpa16"]["B"]
        for bits in ("bd4", "bd2"):
            if bits in one and "sdpa16" in one:
                s[f"{bits}_over_sdpa16_tokens_per_s_b1"] = one[bits]["tokens_per_s"] / one["sdpa16"]["tokens_per_s"]
            if bits in one and "sdpa16_hf" in one:
                s[f"{bits}_over_sdpa16_hf_tokens_per_s_b1"] = (one[bits]["tokens_per_s"]
                                                               / one["sdpa16_hf"]["tokens_per_s"])
        out[str(n)] = s
    return out


def targets(result: dict) -> dict:
    """Issue 15's targets, read at 128K (they are stated for 4 GPUs: ``applies`` says
    whether this run is one): bitdecode 4-bit serves >= 3x the batch of the 16-bit cache
    and >= 1.5x its decode tokens/s at B = 1, graph-captured steps on both sides."""
    rows = [r for r in result["rows"] if r["N"] == 131072 and "tokens_per_s" in r]
    pick = {(r["kind"], "max" if r.get("is_max_batch") else "one"): r for r in rows}
    pick.update({(r["kind"], "one"): r for r in rows if r["B"] == 1})
    out = {"applies": result["world_size"] == 4 and result["device"] == "cuda"}
    a, b = pick.get(("bd4", "max")), pick.get(("sdpa16", "max"))
    if a and b:
        out["batch_ratio"] = a["B"] / b["B"]
        out["batch_ge_3x"] = out["batch_ratio"] >= 3
    a, b = pick.get(("bd4", "one")), pick.get(("sdpa16", "one"))
    if a and b:
        out["b1_tokens_per_s_ratio"] = a["tokens_per_s"] / b["tokens_per_s"]
        out["b1_tokens_per_s_ge_1.5x"] = out["b1_tokens_per_s_ratio"] >= 1.5
        out["graph_captured_both"] = bool(a["graph"] and b["graph"])
    return out


def plot(result: dict, path: Path) -> Optional[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    from bitdecode._files import save_plot

    rows = [r for r in result["rows"] if "tokens_per_s" in r]
    if not rows:
        return None
    ns = sorted({r["N"] for r in rows})
    kinds = [k for k in ("sdpa16_hf", "sdpa16", "bd4", "bd2") if any(r["kind"] == k for r in rows)]
    colors = {"sdpa16_hf": "0.6", "sdpa16": "k", "bd4": "b", "bd2": "r"}
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, want_max, title in ((axes[0], False, "B = 1"), (axes[1], True, "largest batch that fits")):
        width = 0.8 / max(1, len(kinds))
        for j, kind in enumerate(kinds):
            for i, n in enumerate(ns):
                sel = [r for r in rows if r["kind"] == kind and r["N"] == n
                       and (r.get("is_max_batch") if want_max else r["B"] == 1)]
                if not sel:
                    continue
                r = sel[0]
                x = i + (j - (len(kinds) - 1) / 2) * width
                ax.bar(x, r["tokens_per_s"], width, color=colors[kind], label=kind if i == 0 else None)
                ax.text(x, r["tokens_per_s"], f"B={r['B']}" if want_max else f"{r['ms_per_step']:.1f}ms",
                        ha="center", va="bottom", fontsize=6)
        ax.set_xticks(range(len(ns)))
        ax.set_xticklabels([f"N={n // 1024}K" if n >= 1024 else f"N={n}" for n in ns])
        ax.set_ylabel("decode tokens/s")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3, axis="y")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(f"{result['model']} TP={result['world_size']} on {result['gpu']}", fontsize=10)
    fig.tight_layout()
    return save_plot(fig, path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="output directory (rank 0 writes tp<world>.json)")
    p.add_argument("--quick", action="store_true", help="fewer timed steps, no stock sdpa16_hf row")
    p.add_argument("--tiny", action="store_true", help="a 2-layer toy model (CPU smoke test of the same path)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the model's (a short GPU run)")
    p.add_argument("--seqlens", type=str, default=None, help="comma-separated context lengths (default 32K,128K)")
    p.add_argument("--kinds", type=str, default=None, help="comma-separated subset of sdpa16_hf,sdpa16,bd4,bd2")
    p.add_argument("--batches", choices=("both", "one", "max"), default="both", help="B = 1, the largest, or both")
    p.add_argument("--backend", default="auto", help="bitdecode kernel backend (auto, sm80, sm90; reference on CPU)")
    p.add_argument("--max-batch", type=int, default=None, help="cap on the largest batch (512; --tiny: 6)")
    p.add_argument("--reserve-gib", type=float, default=4.0, help="memory kept free for activations and graphs")
    p.add_argument("--cpu-budget-gib", type=float, default=0.04, help="--device cpu: the cache budget per rank")
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--eager", action="store_true", help="do not capture CUDA graphs")
    args = p.parse_args(argv)
    if args.device == "cpu":  # transformers picks the mesh's device type from the visible accelerator
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if args.max_batch is None:
        args.max_batch = 6 if args.tiny else 512
    args.iters = args.iters or (10 if args.quick or args.tiny else 30)
    args.warmup = 3 if args.quick or args.tiny else 5
    args.eager_iters, args.eager_warmup = (3, 1) if args.tiny else (5, 2)
    if args.device == "cpu" and args.backend == "auto":
        args.backend = "reference"

    import transformers
    from transformers.modeling_utils import AttentionInterface

    from bitdecode import hf  # noqa: F401  registers attn_implementation="bitdecode"

    transformers.logging.set_verbosity_error()
    AttentionInterface.register(GQA_ATTN, sdpa_gqa_attention)

    device = init_distributed(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    shape = TINY if args.tiny else LLAMA_70B
    seqlens = ([int(x) for x in args.seqlens.split(",")] if args.seqlens
               else [512, 2048] if args.tiny else [32768, 131072])
    kinds = (args.kinds.split(",") if args.kinds
             else ["sdpa16", "bd4", "bd2"] if args.quick else ["sdpa16_hf", "sdpa16", "bd4", "bd2"])
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = build_model(shape, args.layers)
    if device.type == "cuda":
        torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    s = Shapes(model, world)
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    result = {
        "model": "Llama-3.1-70B-shaped (random bf16 weights)" if not args.tiny else "tiny Llama (smoke test)",
        "config": {**shape, **({"num_hidden_layers": args.layers} if args.layers else {})},
        "world_size": world,
        "gpu": dev_name,
        "device": args.device,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "nccl": nccl_version() if device.type == "cuda" else None,
        "env": {k: os.environ.get(k) for k in NVLS_ENV},
        "command": f"torchrun --nproc-per-node {world} profiles/bench_tp.py " + " ".join(sys.argv[1:]),
        "tensor_parallel": "transformers from_pretrained(distributed_config=DistributedConfig(tp_plan='auto'))"
                           if "distributed_config" in tp_kwargs() else "transformers from_pretrained(tp_plan='auto')",
        "per_rank": {"q_heads": s.hq, "kv_heads": s.hkv, "head_dim": s.d},
        "weights_gib_per_gpu": all_reduce(local_bytes(model), device=device) / GIB,
        "load_s": load_s,
        "method": ("one decode step of the whole model per call (B new tokens), caches filled with random K/V at "
                   "context N (prefill not timed); CUDA-graph replay between CUDA events, median of "
                   f"{args.iters} after {args.warmup} warm-ups, slowest rank; 'graph': false rows are eager calls "
                   "(graph_error says why); eager_ms: plain eager calls; tokens/s = B / step time; "
                   "largest batch = what the free memory of every rank holds after a reserve"),
        "kinds": {
            "sdpa16": "StaticCache (bf16) + torch SDPA enable_gqa over the N+1 valid positions, no mask",
            "sdpa16_hf": "StaticCache (bf16) + transformers' stock 'sdpa' attention (a mask over the static "
                         "length; repeat_kv in transformers 5.17, packed GQA in newer ones)",
            "bd4": "bitdecode BitDecodingCache 4-bit, K per channel g128, V per token g128",
            "bd2": "bitdecode BitDecodingCache 2-bit, K per channel g128, V per token g128",
        },
        "rows": [],
    }
    out_json = args.out / f"tp{world}.json"
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        print(f"model built in {load_s:.1f}s: {result['weights_gib_per_gpu']:.1f} GiB per rank, "
              f"{s.hq}/{s.hkv} heads per rank", flush=True)

    def write():
        if rank == 0:
            result["summary"] = summarize(result["rows"])
            result["targets"] = targets(result)
            write_record(out_json, result)

    write()
    for n in seqlens:
        for kind in kinds:
            plan = []  # (batch, is the largest batch)
            bmax = None
            if kind != "sdpa16_hf" and args.batches in ("both", "max"):
                bmax = max_batch(kind, s, n, args, device)
            if args.batches in ("both", "one"):
                plan.append((1, bmax == 1))
            if bmax is not None and (bmax != 1 or args.batches == "max"):
                plan.append((bmax, True))  # 0: not even one sequence fits
            for b, is_max in plan:
                if b < 1:
                    row = {"kind": kind, "N": n, "B": 0, "fits": False}
                else:
                    try:
                        row = try_config(model, kind, s, b, n, args, device)
                    except Exception:  # noqa: BLE001 - a failed configuration is reported, the sweep goes on
                        row = {"kind": kind, "N": n, "B": b, "error": traceback.format_exc()[-2000:]}
                        free_memory(device)
                    if row is None:
                        row = {"kind": kind, "N": n, "B": b, "fits": False}
                row["is_max_batch"] = is_max
                row["planned_max_batch"] = bmax
                if rank == 0:
                    result["rows"].append(row)
                    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
                                      if k not in ("error", "graph_error")}), flush=True)
                    if "error" in row or (device.type == "cuda" and "graph_error" in row):
                        print(row.get("error") or row.get("graph_error"), flush=True)
                write()
    if rank == 0:
        png = plot(result, args.out / f"tp{world}.png")
        print(f"results in {out_json}" + (f" and {png}" if png else ""), flush=True)
        print(json.dumps({"summary": result["summary"], "targets": result["targets"]}, indent=1), flush=True)
    dist.barrier()
    if _CAPTURED["any"]:
        # ncclCommDestroy can hang once NCCL calls were captured in a CUDA graph
        # (pytorch/pytorch#115388): the results are written, leave without it
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
