"""End-to-end decode benchmark: a Llama-3.1-8B-shaped model, tokens/s of one decode step
with transformers' 16-bit caches, transformers' QuantizedCache and bitdecode, in one run.

Model: 32 layers, 32 / 8 heads, head dim 128, hidden 4096, MLP 14336, vocab 128256, bf16,
random weights built directly on the GPU (no download, no fp32 or CPU copy).  One model
serves every configuration (its attention implementation is switched between "sdpa" and
"bitdecode").

Caches (each filled with random K/V of N tokens per sequence directly, through the
cache's own ``update`` -- and for bitdecode its prompt packing -- instead of an N-token
prefill through the model: a 128K-token prefill of an 8B model takes long and does not
change a decode step):

* ``dynamic``: transformers' default ``DynamicCache`` + SDPA (grows by ``torch.cat``), eager;
* ``static``: ``StaticCache`` + SDPA, eager and CUDA-graph captured (the fastest 16-bit
  setup transformers has without a compiler); ``--compile`` adds ``static-compiled``:
  ``torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)``;
* ``static-packed``: only when the installed transformers still expands the KV heads
  (``repeat_kv``) for a masked single-token decode (before transformers' ``pack_gqa``):
  ``StaticCache`` + SDPA with the query heads of a KV head packed as query rows, as newer
  transformers does it -- so the 16-bit baseline is the strongest either way;
* ``quanto4`` / ``quanto2``: ``QuantizedCache(backend="quanto")``, eager (dequantizes the
  whole cache every step), when optimum-quanto is importable, else recorded "not installed"
  (the H200 host has no optimum-quanto: its pure-Python wheel travels with the run, and its
  CUDA extension builds with nvcc on first use, 86 s there; profiles/NOTES.md, forty-first
  session);
* ``bd4`` / ``bd2``: ``BitDecodingCache`` (K per channel, groups of 128), eager and
  CUDA-graph captured;
* ``bd4-norms``: ``bd4`` with the model's RMSNorms replaced by one kernel each
  (``bitdecode.hf.fuse_norms``, undone after): what the norms' eight torch kernels cost;
* ``bd4-fused``: ``bd4-norms`` plus the rotary embedding of q and k as one kernel per layer
  (``bitdecode.hf.fuse_rope``, undone after) instead of transformers' ten torch kernels;
* ``bd4-merged``: ``bd4-fused`` plus q / k / v and gate / up merged into one GEMM each, on
  torch's ops (cuBLAS; ``bitdecode.hf.fuse_projections(backend="reference")``, undone after);
* ``bd4-all``: ``bd4-fused`` plus ``bitdecode.hf.fuse_projections``: the merged projections,
  o_proj and down_proj on bitdecode's GEMV (``bd.dense.linear``) and SwiGLU's
  ``silu(gate) * up`` as one kernel (``bd.dense.silu_mul``).

Steps: one token per sequence at position N, ``input_ids`` / ``position_ids`` in fixed
buffers.  Eager: every step synchronized, CUDA events around it.  Graph: the step captured
once (after warm-up on a side stream) and replayed; each replay appends one more token on
the device (the host-side bookkeeping of the caches advances only at capture), so the
caches are sized N + a margin that covers every warm-up and timed step.  Median of
``--steps`` steps after ``--warmup``.  Before a cache is allocated its size (and the
step's transient buffers) is checked against the free memory: a configuration that does
not fit is recorded as skipped instead of being run into an out-of-memory error.

Roofline: (bytes of the weights a step reads + the KV bytes it must read) / the read
bandwidth measured in the same run (the best of a large sum and an SDPA decode over a large
16-bit K / V, as ``bench_decode`` measures it; recordings before 2026-12-06 divided by a
copy's rate, ~6 % below the H200's best read).  Targets (issue 10) are recorded
pass / fail in the JSON; the 1.3x-of-roofline one lists every bitdecode 4-bit configuration's
ratios (the plain cache and each fusion level) and names in ``met_by`` those within the
bound at all four contexts of the full sweep.

    python3 profiles/bench_e2e.py --out profiles/h200            # full sweep, H200 (~3-5 min)
    python3 profiles/bench_e2e.py --quick --out /tmp/e2e         # B=1 N=128K and B=8 N=64K only
    python3 profiles/bench_e2e.py --tiny --device cpu --out /tmp/e2e   # smoke test, no GPU
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from a checkout

import bitdecode as bd  # noqa: E402
from bitdecode import cli_generate, hf  # noqa: E402
from bitdecode._files import save_plot, write_record  # noqa: E402
from bitdecode._memory import release_memory  # noqa: E402
from bitdecode.formats import model_head_dim  # noqa: E402
from profiles.bench_decode import cache_bytes as decode_read_bytes  # noqa: E402

GiB = 1 << 30
# (role, B, N): the roles name the points the targets refer to
CONTEXTS = [("b1_32k", 1, 32768), ("b1_128k", 1, 131072), ("b8_64k", 8, 65536), ("b16_64k", 16, 65536)]
QUICK = [("b1_128k", 1, 131072), ("b8_64k", 8, 65536)]
TINY = [("b1_32k", 1, 256), ("b1_128k", 1, 1024), ("b8_64k", 2, 512), ("b16_64k", 4, 512)]
TARGETS = {"roofline_ratio_max": 1.3, "b1_128k_speedup_min": 1.5, "b8_64k_speedup_min": 2.2}
PACKED_GQA = "sdpa_packed_gqa"
SIXTEEN_BIT = ("dynamic", "static", "static-packed", "static-compiled")


# --------------------------------------------------------------------------------------
# Configurations
# --------------------------------------------------------------------------------------


def transformers_packs_gqa() -> bool:
    """True when transformers' SDPA path packs GQA heads for a masked one-token decode."""
    from transformers.integrations import sdpa_attention

    return hasattr(sdpa_attention, "pack_gqa")


def register_packed_gqa() -> None:
    """``attn_implementation="sdpa_packed_gqa"``: transformers' SDPA, except a one-token
    query attends with the query heads of each KV head as rows of one KV head (no
    ``repeat_kv`` of the cache), as transformers' own ``pack_gqa`` does in newer versions."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    def packed(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        bsz, hq, tq, d = query.shape
        hkv = key.shape[1]
        if tq != 1 or hq == hkv or (attention_mask is not None and attention_mask.shape[1] != 1):
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, **kwargs)
        q = query.reshape(bsz, hkv, hq // hkv, d)
        out = F.scaled_dot_product_attention(q, key, value, attn_mask=attention_mask, scale=scaling)
        return out.reshape(bsz, hq, 1, d).transpose(1, 2).contiguous(), None

    AttentionInterface.register(PACKED_GQA, packed)
    ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_GQA, sdpa_mask)


def quanto_available() -> Optional[str]:
    """optimum-quanto's version, or None when it cannot be imported."""
    try:
        import optimum.quanto as quanto
    except Exception:  # noqa: BLE001 - missing or broken: recorded, not fatal
        return None
    return getattr(quanto, "__version__", "unknown")


def configurations(args, device) -> List[dict]:
    """Every configuration of the run, in run order, with its modes."""
    graph = ["eager", "graph"] if device.type == "cuda" else ["eager"]
    out = [dict(name="dynamic", label="transformers DynamicCache + SDPA (default)", modes=["eager"], attn="sdpa")]
    out.append(dict(name="static", label="transformers StaticCache + SDPA", modes=graph, attn="sdpa"))
    if not transformers_packs_gqa():
        out.append(dict(name="static-packed", label="StaticCache + SDPA, GQA heads packed (newer transformers' "
                        "pack_gqa)", modes=graph, attn=PACKED_GQA))
    if args.compile and device.type == "cuda":
        out.append(dict(name="static-compiled", label="StaticCache + SDPA, torch.compile reduce-overhead",
                        modes=["compiled"], attn="sdpa"))
    for bits in (4, 2):
        out.append(dict(name=f"quanto{bits}", label=f"transformers QuantizedCache quanto {bits}-bit", modes=["eager"],
                        attn="sdpa", bits=bits))
    for bits in (4, 2):
        out.append(dict(name=f"bd{bits}", label=f"bitdecode {bits}-bit (K per channel, G=128)", modes=graph,
                        attn="bitdecode", bits=bits))
    out.append(dict(name="bd4-norms", label="bitdecode 4-bit + the model's RMSNorms as one kernel each, "
                    "the residual add after attention in the next (bitdecode.hf.fuse_norms)", modes=graph, attn="bitdecode", bits=4, fuse_norms=True))
    out.append(dict(name="bd4-fused", label="bitdecode 4-bit + RMSNorms and the rotary embedding as one kernel "
                    "each (bitdecode.hf.fuse_norms, fuse_rope)", modes=graph, attn="bitdecode", bits=4,
                    fuse_norms=True, fuse_rope=True))
    out.append(dict(name="bd4-merged", label="bitdecode 4-bit + norms, rotary embedding, q/k/v and gate/up merged "
                    "on cuBLAS", modes=graph, attn="bitdecode", bits=4, fuse_norms=True, fuse_rope=True,
                    fuse_projections="reference"))
    out.append(dict(name="bd4-all", label="bitdecode 4-bit + every bitdecode.hf fusion (norms, rotary embedding, "
                    "merged projections, the GEMV and SwiGLU kernels)", modes=graph, attn="bitdecode", bits=4,
                    fuse_norms=True, fuse_rope=True, fuse_projections="auto"))
    if args.configs:
        keep = set(args.configs.split(","))
        out = [c for c in out if c["name"] in keep]
    return out


# --------------------------------------------------------------------------------------
# Sizes
# --------------------------------------------------------------------------------------


def model_shape(model) -> dict:
    c = model.config
    d = model_head_dim(c)
    return dict(layers=c.num_hidden_layers, hq=c.num_attention_heads, hkv=c.num_key_value_heads, d=d,
                vocab=c.vocab_size, hidden=c.hidden_size)


def weight_bytes_read(model) -> int:
    """Bytes of the weights one decode step reads: every parameter, plus the packed weights
    and scales of bitdecode's ``BitLinear`` layers (buffers), less the input embedding table
    (one row per token) unless it is tied to the output projection (read whole)."""
    from bitdecode import bitnet

    params = {id(p): p for p in model.parameters()}
    total = sum(p.numel() * p.element_size() for p in params.values())
    total += sum(b.numel() * b.element_size() for m in model.modules() if isinstance(m, bitnet.BitLinear)
                 for b in m.buffers(recurse=False))
    emb, out = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    if emb is not out:
        total -= emb.numel() * emb.element_size()
    return total


def bd_fmt(bits: int, d: int) -> bd.KVFormat:
    return bd.KVFormat(bits=bits, k_mode="channel", group_size=min(128, d))


def bd_storage_bytes(fmt: bd.KVFormat, b: int, hkv: int, d: int, max_seqlen: int, dtype) -> int:
    """``KVCache.allocate``'s bytes, from the format's storage shapes."""
    nr = fmt.residual_block
    cap = -(-max_seqlen // nr) * nr
    args = (b, hkv, cap, d)
    words = sum(int(torch.Size(s).numel()) for s in (fmt.k_pack_shape(*args), fmt.k_params_shape(*args),
                                                      fmt.v_pack_shape(*args), fmt.v_params_shape(*args)))
    return 4 * words + 2 * b * nr * hkv * d * torch.tensor([], dtype=dtype).element_size() + 4 * 2 * b


def needed_bytes(cfg: dict, s: dict, b: int, n: int, cap: int, esize: int, packs_gqa: bool) -> int:
    """Memory a configuration allocates beyond what is already held (weights, the random
    K/V): its cache plus the largest transient buffer of a fill or a step."""
    layer16 = 2 * b * s["hkv"] * cap * s["d"] * esize  # one layer's K + V in 16 bits
    logits = b * s["vocab"] * 4 * 2
    name = cfg["name"]
    if name == "dynamic":
        need = s["layers"] * layer16 + layer16  # torch.cat holds the old and the new layer at once
    elif name.startswith("static"):
        expand = name == "static-compiled" or (name == "static" and not packs_gqa)
        need = s["layers"] * layer16 + (layer16 * s["hq"] // s["hkv"] if expand else 0)  # repeat_kv
    elif name.startswith("quanto"):
        per_value = cfg["bits"] / 8 + 2 * 2 / 64 + 0.5  # codes, scale + shift per group of 64; quanto's slack
        need = int(s["layers"] * layer16 / esize * per_value) + 2 * layer16  # a dequantized layer + its cat
    else:  # bitdecode
        fmt = bd_fmt(cfg["bits"], s["d"])
        need = s["layers"] * bd_storage_bytes(fmt, b, s["hkv"], s["d"], cap, torch.bfloat16) + layer16  # + NHD copy
    return int(need + logits)


def free_bytes(device, budget: Optional[int], held: int) -> int:
    """Memory free for the next cache: the device's free memory (the CPU's available),
    or what is left of ``budget`` bytes after ``held`` bytes."""
    if budget is not None:
        return budget - held
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def cache_bytes(cache) -> int:
    """Bytes of a cache's storage: bitdecode's own count, else every tensor (and tensor
    subclass component, for quanto) a transformers cache layer holds."""
    if hasattr(cache, "memory_bytes"):
        return cache.memory_bytes()

    def size(t) -> int:
        if not isinstance(t, torch.Tensor):
            return 0
        flatten = getattr(type(t), "__tensor_flatten__", None)
        if flatten is not None and type(t) is not torch.Tensor:
            try:
                return sum(size(getattr(t, name)) for name in t.__tensor_flatten__()[0])
            except Exception:  # noqa: BLE001
                pass
        return t.numel() * t.element_size()

    total = 0
    for layer in cache.layers:
        for name in ("keys", "values", "_quantized_keys", "_quantized_values"):
            total += size(getattr(layer, name, None))
    return total


# --------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_eager(step: Callable, device, warmup: int, steps: int) -> List[float]:
    """ms of each synchronized step (CUDA events on a GPU, the wall clock on the CPU)."""
    for _ in range(warmup):
        step()
    sync(device)
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def time_graph(step: Callable, device, warmup: int, steps: int) -> Tuple[List[float], float]:
    """(ms of each replay of a CUDA graph of ``step``, seconds the capture took)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    sync(device)
    release_memory()  # (what the capture would free, given back and waited out first: ``captured``)
    t0 = time.perf_counter()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    sync(device)
    capture_s = time.perf_counter() - t0
    for _ in range(warmup):
        graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    sync(device)
    times = [s.elapsed_time(e) for s, e in events]
    del graph
    return times, capture_s


def measure_bandwidth(device) -> Dict[str, float]:
    """The read rate the rooflines divide by (``bytes_per_s``), measured as ``bench_decode``
    measures it: the best of a large sum (a read) and a decode-shaped SDPA over a large
    16-bit K / V (cuDNN streams it faster than torch's reductions), median of 10 each;
    ``bytes_per_s_source`` names the winner.  A copy's rate (its bytes read and written) is
    recorded beside, not used (the rooflines before 2026-12-06 divided by it)."""
    import torch.nn.functional as F

    n = (1 << 30) if device.type == "cuda" else (1 << 25)  # 2 GiB / 64 MiB of bf16
    x = torch.ones(n, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    copy_s = statistics.median(time_eager(lambda: y.copy_(x), device, warmup=2, steps=10)) * 1e-3
    sum_s = statistics.median(time_eager(lambda: x.sum(dtype=torch.float32), device, warmup=2, steps=10)) * 1e-3
    y = None  # (free it; rebinding, not del: the lambda above names it)
    kv = x.view(2, 1, 8, n // (2 * 8 * 128), 128)  # K and V [B=1, Hkv=8, N, D=128] of the same bytes
    q = torch.ones(1, 32, 1, 128, dtype=torch.bfloat16, device=device)
    sdpa_s = statistics.median(time_eager(lambda: F.scaled_dot_product_attention(q, kv[0], kv[1], enable_gqa=True),
                                          device, warmup=2, steps=10)) * 1e-3
    rates = {"torch sum": n * 2 / sum_s, "SDPA decode over 16-bit K / V": n * 2 / sdpa_s}
    best = max(rates, key=rates.get)
    return {"copy_bytes": 2 * n * 2, "copy_ms": copy_s * 1e3, "copy_bytes_per_s": 2 * n * 2 / copy_s,
            "sum_bytes_per_s": rates["torch sum"], "sdpa_bytes_per_s": rates["SDPA decode over 16-bit K / V"],
            "bytes_per_s": rates[best], "bytes_per_s_source": best}


# --------------------------------------------------------------------------------------
# One configuration at one context
# --------------------------------------------------------------------------------------


def make_cache(cfg: dict, model, cap: int, backend: str):
    import transformers

    from bitdecode import hf

    if cfg["name"] == "dynamic":
        return transformers.DynamicCache(config=model.config)
    if cfg["name"].startswith("static"):
        return transformers.StaticCache(config=model.config, max_cache_len=cap)
    if cfg["name"].startswith("quanto"):
        return transformers.QuantizedCache(backend="quanto", config=model.config, nbits=cfg["bits"])
    return hf.BitDecodingCache(model, bd_fmt(cfg["bits"], model_shape(model)["d"]), max_seqlen=cap, backend=backend)


def fill(cache, k: torch.Tensor, v: torch.Tensor, layers: int, valid: torch.Tensor) -> None:
    """Every layer holds ``k``, ``v`` ([B, Hkv, N, D]) as its first N tokens, through the
    cache's own ``update`` (bitdecode: and its prompt packing, as its attention call does
    after a prefill)."""
    from bitdecode import hf

    for i in range(layers):
        cache.update(k, v, i)
        if isinstance(cache, hf.BitDecodingCache):
            cache.layers[i].store_prompt(k, v, valid)


def run_config(cfg: dict, model, ctx: dict, data: dict, args, device, backend: str) -> List[dict]:
    """Rows (one per mode) of one configuration at one context."""
    s = model_shape(model)
    b, n, cap = ctx["B"], ctx["N"], ctx["cap"]
    base = dict(role=ctx["role"], B=b, N=n, config=cfg["name"], label=cfg["label"])
    rows = []
    hf.use_attention(model, cfg["attn"])
    t0 = time.perf_counter()
    cache = make_cache(cfg, model, cap, backend)
    fill(cache, data["k"], data["v"], s["layers"], data["valid"])
    sync(device)
    fill_s = time.perf_counter() - t0
    kv_bytes = cache_bytes(cache)
    if cfg["name"].startswith("bd"):
        kv_read = sum(decode_read_bytes(layer.kv) for layer in cache.layers)  # (each layer's own tensors)
    elif cfg["name"].startswith("quanto"):
        kv_read = kv_bytes
    else:
        kv_read = s["layers"] * 2 * b * s["hkv"] * n * s["d"] * 2
    roof_ms = (data["weights"] + kv_read) / data["bw"] * 1e3
    kwarg = hf.cache_kwarg(model)
    ids, pos = data["ids"], data["pos"]

    def step():
        return model(input_ids=ids, position_ids=pos, use_cache=True, **{kwarg: cache})

    for mode in cfg["modes"]:
        row = dict(base, mode=mode, kv_bytes=kv_bytes, kv_read_bytes=kv_read, roofline_ms=roof_ms, fill_s=fill_s)
        try:
            with torch.no_grad():
                if mode == "eager":
                    t1 = time.perf_counter()
                    step()
                    sync(device)
                    row["first_step_s"] = time.perf_counter() - t1  # bitdecode: includes compiling the kernels
                    times = time_eager(step, device, args.warmup, args.steps)
                elif mode == "graph":
                    times, row["capture_s"] = time_graph(step, device, args.warmup, args.steps)
                else:  # compiled
                    compiled = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
                    t1 = time.perf_counter()
                    compiled(input_ids=ids, position_ids=pos, use_cache=True, **{kwarg: cache})
                    sync(device)
                    row["compile_s"] = time.perf_counter() - t1
                    times = time_eager(lambda: compiled(input_ids=ids, position_ids=pos, use_cache=True,
                                                        **{kwarg: cache}), device, args.warmup, args.steps)
            ms = statistics.median(times)
            # (the median leaves out a step that packs a completed block, one in 128 (4-bit) or
            # 256 (2-bit) a layer; the mean over that many --steps or more counts it, amortized)
            row.update(status="ok", step_ms=ms, step_ms_mean=statistics.fmean(times), step_ms_min=min(times),
                       step_ms_max=max(times),
                       tokens_per_s=b / ms * 1e3, of_roofline=ms / roof_ms)
        except Exception as exc:  # noqa: BLE001 - one configuration failing must not end the run
            row.update(status=f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}")
            if args.verbose:
                traceback.print_exc()
        finally:
            if mode == "compiled":
                torch._dynamo.reset()
        rows.append(row)
        print(_row_line(row), flush=True)
    return rows


def _skip_rows(cfg: dict, ctx: dict, status: str) -> List[dict]:
    return [dict(role=ctx["role"], B=ctx["B"], N=ctx["N"], config=cfg["name"], label=cfg["label"], mode=m,
                 status=status) for m in cfg["modes"]]


def _row_line(r: dict) -> str:
    head = f"  B={r['B']:<3d} N={r['N']:<7d} {r['config']:<16s} {r['mode']:<8s}"
    if r["status"] != "ok":
        return f"{head} {r['status']}"
    return (f"{head} {r['step_ms']:9.2f} ms  {r['tokens_per_s']:9.1f} tok/s  {r['of_roofline']:5.2f}x roofline  "
            f"KV {_size(r['kv_bytes']):>10s}")


def _size(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / 2**20:.2f} MiB"


# --------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------


def evaluate_targets(rows: List[dict], meaningful: bool) -> dict:
    ok = [r for r in rows if r["status"] == "ok"]

    def best(role: str, names) -> Optional[dict]:
        cands = [r for r in ok if r["role"] == role and r["config"] in names]
        return max(cands, key=lambda r: r["tokens_per_s"]) if cands else None

    def bd_row(role: str, bits: int) -> Optional[dict]:
        cands = [r for r in ok if r["role"] == role and r["config"] == f"bd{bits}"]
        graph = [r for r in cands if r["mode"] == "graph"]
        return (graph or cands or [None])[0]

    out = {"meaningful": meaningful}
    mode = "graph" if any(x["mode"] == "graph" for x in ok) else "eager"

    def ratios_of(config: str) -> dict:
        return {r["role"]: round(r["of_roofline"], 3) for r in ok if r["config"] == config and r["mode"] == mode}

    # Every 4-bit configuration is bitdecode's public API: the plain cache (``bd4``) and the
    # same cache with bitdecode.hf's fusions (norms, + rotary embedding, + projections).  The
    # target is met by a configuration whose ratio is within the bound at all four contexts
    # of the full sweep (a partial sweep meets it nowhere); ``met_by`` names them, the
    # plain cache's ratios stay beside them.
    roles = {role for role, _, _ in CONTEXTS}
    entry = {"need": f"step time <= {TARGETS['roofline_ratio_max']} x roofline at every point",
             "ratios": ratios_of("bd4"), "met_by": []}
    for config in ("bd4", "bd4-norms", "bd4-fused", "bd4-merged", "bd4-all"):
        got = ratios_of(config)
        if config != "bd4" and got:
            entry["ratios_" + config.replace("-", "_")] = got
        if got and set(got) == set(roles) and all(x <= TARGETS["roofline_ratio_max"] for x in got.values()):
            entry["met_by"].append(config)
    entry["pass"] = bool(entry["met_by"])
    out["bd4_graph_within_1.3x_roofline"] = entry
    for role, key in (("b1_128k", "b1_128k_speedup_min"), ("b8_64k", "b8_64k_speedup_min")):
        fast16 = best(role, SIXTEEN_BIT)
        entry = {"need": f"bitdecode 4-bit tokens/s >= {TARGETS[key]} x the fastest 16-bit configuration"}
        if fast16 is None or bd_row(role, 4) is None:
            entry.update(status="not measured", **{"pass": None})
        else:
            entry["fastest_16bit"] = f"{fast16['config']} {fast16['mode']}: {fast16['tokens_per_s']:.1f} tok/s"
            if not any(r["role"] == role and r["config"] in SIXTEEN_BIT and r["mode"] == "graph" for r in ok):
                entry["note"] = "no graph-captured 16-bit configuration ran here: the fastest is an eager one"
            # a 16-bit step at its own roofline (weights + 16-bit KV over the run's read rate),
            # which none of transformers' 16-bit paths comes near (static: the whole capacity
            # attended under a mask): what a tuned 16-bit attention could reach at best
            ideal = fast16["B"] / fast16["roofline_ms"] * 1e3
            entry["16bit_at_its_roofline"] = f"{ideal:.1f} tok/s"
            for bits in (4, 2):
                r = bd_row(role, bits)
                if r is not None:
                    entry[f"bd{bits}"] = f"{r['mode']}: {r['tokens_per_s']:.1f} tok/s"
                    entry[f"bd{bits}_speedup"] = round(r["tokens_per_s"] / fast16["tokens_per_s"], 3)
                    entry[f"bd{bits}_vs_16bit_roofline"] = round(r["tokens_per_s"] / ideal, 3)
            entry["pass"] = entry["bd4_speedup"] >= TARGETS[key]
        out[f"{role}_speedup>={TARGETS[key]}"] = entry
    served = {name: any(r["role"] == "b16_64k" and r["config"] == name for r in ok)
              for name in sorted({r["config"] for r in rows})}
    skipped = sorted({f"{r['config']}: {r['status']}" for r in rows if r["role"] == "b16_64k" and r["status"] != "ok"})
    out["b16_64k_served"] = {"need": "bitdecode 4-bit runs B=16 N=64K", "served": served, "not_served": skipped,
                             "pass": served.get("bd4", False) if any(r["role"] == "b16_64k" for r in rows) else None}
    return out


def plot(result: dict, path: Path) -> Optional[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        return None
    rows = result["rows"]
    points = []
    for r in rows:
        if (r["B"], r["N"]) not in points:
            points.append((r["B"], r["N"]))
    series = []
    for r in rows:
        key = (r["config"], r["mode"])
        if key not in series:
            series.append(key)
    fig, ax = plt.subplots(figsize=(max(8, 2.6 * len(points)), 4.6))
    width = 0.85 / max(1, len(series))
    colors = {"dynamic": "#7f7f7f", "static": "#1f77b4", "static-packed": "#17becf", "static-compiled": "#9467bd",
              "quanto4": "#ff7f0e", "quanto2": "#e7ba52", "bd4": "#2ca02c", "bd2": "#d62728",
              "bd4-norms": "#8c564b", "bd4-fused": "#e377c2", "bd4-merged": "#bcbd22", "bd4-all": "#393b79"}
    handles = []
    for i, (name, mode) in enumerate(series):
        xs, ys, notes = [], [], []
        for j, p in enumerate(points):
            r = next((x for x in rows if (x["B"], x["N"]) == p and x["config"] == name and x["mode"] == mode), None)
            x = j + (i - (len(series) - 1) / 2) * width
            if r is not None and r["status"] == "ok":
                xs.append(x)
                ys.append(r["tokens_per_s"])
            elif r is not None:
                notes.append(x)
        color = colors.get(name, "#bcbd22")
        hatch = "//" if mode == "graph" else ("xx" if mode == "compiled" else None)
        style = dict(facecolor=color, alpha=0.5 if mode == "eager" else 1.0, hatch=hatch, edgecolor="black", lw=0.3)
        ax.bar(xs, ys, width, **style)
        handles.append(Patch(label=f"{name} {mode}" + ("" if xs else " (none ran)"), **style))
        for x in notes:  # at the foot of the axis (a log scale has no 0)
            ax.text(x, 0.01, "×", ha="center", va="bottom", fontsize=9, color=color,
                    transform=ax.get_xaxis_transform())
    ax.set_xticks(range(len(points)))
    ax.set_xticklabels([f"B={b}\nN={n // 1024}K" if n >= 1024 else f"B={b}\nN={n}" for b, n in points])
    ax.set_ylabel("decode tokens/s")
    ax.set_yscale("log")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(handles=handles, fontsize=7, ncol=2)
    ax.set_title(f"{result['model']['name']} decode step on {result['device_name']} "
                 f"(× = skipped / not installed / failed)", fontsize=9)
    fig.tight_layout()
    return save_plot(fig, path, dpi=110)


def run(args) -> dict:
    import transformers

    from bitdecode import hf  # noqa: F401 - registers attn_implementation="bitdecode"

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda, but no CUDA GPU is available (use --tiny --device cpu)")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    size = "tiny" if args.tiny else "8b"
    backend = args.backend if args.backend != "auto" or device.type == "cuda" else "reference"
    if args.contexts:
        contexts = []
        for item in args.contexts.split(","):
            b, n = (int(x) for x in item.lower().split("x"))
            role = next((r for r, bb, nn in CONTEXTS if (bb, nn) == (b, n)), f"b{b}_n{n}")
            contexts.append((role, b, n))
    else:
        contexts = TINY if args.tiny else (QUICK if args.quick else CONTEXTS)
    margin = 2 * (args.warmup + args.steps) + 16  # tokens every warm-up and timed step may append
    packs = transformers_packs_gqa()
    if not packs:
        register_packed_gqa()
    quanto = quanto_available()

    t_start = time.perf_counter()
    bw = measure_bandwidth(device)
    print(f"read bandwidth {bw['bytes_per_s'] / 1e12:.3f} TB/s ({bw['bytes_per_s_source']}; copy "
          f"{bw['copy_bytes_per_s'] / 1e12:.3f})", flush=True)
    t0 = time.perf_counter()
    # the tiny model gets 8 layers, so that (as at 8B) the cache, not a one-layer transient, decides what fits
    model = cli_generate.random_llama(size, device, torch.bfloat16, "sdpa", seed=0,
                                      **(dict(num_hidden_layers=8) if args.tiny else {}))
    sync(device)
    build_s = time.perf_counter() - t0
    s = model_shape(model)
    weights = weight_bytes_read(model)
    params_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    print(f"model {size}: {params_bytes / GiB:.2f} GiB of weights, built in {build_s:.1f} s", flush=True)
    cfgs = configurations(args, device)
    budget = None if args.budget_gib is None else int(args.budget_gib * GiB)
    if budget is None and args.tiny:
        # a budget that, like an H200 at B=16 N=64K, holds a 4-bit cache at the last point but no 16-bit one
        _, b, n = contexts[-1]
        need16 = needed_bytes(dict(name="static"), s, b, n, n + margin, 2, True)  # the smallest 16-bit need
        need4 = needed_bytes(dict(name="bd4", bits=4), s, b, n, n + margin, 2, packs)
        budget = params_bytes + 2 * 2 * b * s["hkv"] * n * s["d"] + (need16 + need4) // 2

    rows: List[dict] = []
    gen = torch.Generator(device=device).manual_seed(0)
    for role, b, n in contexts:
        print(f"B={b} N={n}", flush=True)
        ctx = dict(role=role, B=b, N=n, cap=n + margin)
        shape = (b, s["hkv"], n, s["d"])
        data = dict(k=torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16),
                    v=torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16),
                    valid=torch.ones(b, n, dtype=torch.bool, device=device),
                    ids=torch.randint(0, s["vocab"], (b, 1), generator=gen, device=device),
                    pos=torch.full((b, 1), n, dtype=torch.long, device=device),
                    weights=weights, bw=bw["bytes_per_s"])
        held = params_bytes + 2 * data["k"].numel() * 2
        for cfg in cfgs:
            if cfg["name"].startswith("quanto") and quanto is None:
                rows += _skip_rows(cfg, ctx, "not installed (optimum-quanto)")
                print(f"  B={b:<3d} N={n:<7d} {cfg['name']:<16s} not installed (optimum-quanto)", flush=True)
                continue
            gc.collect()
            if device.type == "cuda":
                release_memory()
            need = needed_bytes(cfg, s, b, n, ctx["cap"], 2, packs)
            free = free_bytes(device, budget, held)
            reserve = int(0.03 * torch.cuda.get_device_properties(device).total_memory) if device.type == "cuda" else 0
            if need + reserve > free:
                status = f"skipped: needs {_size(need)}, {_size(free)} free" + (
                    f" (of a {_size(budget)} budget)" if budget is not None else "")
                rows += _skip_rows(cfg, ctx, status)
                print(f"  B={b:<3d} N={n:<7d} {cfg['name']:<16s} {status}", flush=True)
                continue
            try:
                with hf.fused(model, cfg.get("fuse_norms", False), cfg.get("fuse_rope", False),
                              cfg.get("fuse_projections")):
                    new = run_config(cfg, model, ctx, data, args, device, backend)
                for r in new:
                    r["need_estimate_bytes"] = need
                rows += new
            except Exception as exc:  # noqa: BLE001 - allocation / fill failures: recorded, the sweep goes on
                msg = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
                if args.verbose:
                    traceback.print_exc()
                rows += _skip_rows(cfg, ctx, msg)
                print(f"  B={b:<3d} N={n:<7d} {cfg['name']:<16s} {msg}", flush=True)
            gc.collect()
            if device.type == "cuda":
                release_memory()
        del data
    model_info = dict(name="Llama-3.1-8B shape" if size == "8b" else "tiny Llama", size=size,
                      **{k: v for k, v in s.items()}, intermediate=model.config.intermediate_size, dtype="bfloat16",
                      param_bytes=params_bytes, weight_bytes_read_per_step=weights)
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "bitdecode": bd.__version__,
        "optimum_quanto": quanto or "not installed",
        "transformers_packs_gqa": packs,
        "backend": backend,
        "dense_residual_ahead": bd.dense.RESIDUAL_AHEAD,
        "norm_prefetch": bd.bitnet.NORM_PREFETCH,
        "model": model_info,
        "bandwidth": bw,
        "memory_budget_bytes": budget,
        "method": {
            "caches": "filled with random K/V through each cache's update (bitdecode: + its prompt packing), "
                      "no prefill through the model",
            "step": "one token per sequence at position N; eager: synchronized steps between CUDA events; graph: "
                    "one CUDA graph of the step replayed (each replay appends a token on the device); compiled: "
                    "torch.compile reduce-overhead calls",
            "stat": f"median of {args.steps} steps after {args.warmup} warm-ups",
            "roofline": ("(weight bytes read per step + KV bytes read) / the read bandwidth measured in the run "
                         "(bandwidth.bytes_per_s: the best of a torch sum and an SDPA decode; its source beside)"),
            "cache_capacity": f"N + {margin} tokens",
            "fit": "cache + largest transient vs free memory (less 3 % reserve) before allocating",
        },
        "contexts": [dict(role=r, B=b, N=n) for r, b, n in contexts],
        "rows": rows,
        "targets": evaluate_targets(rows, meaningful=device.type == "cuda" and not args.tiny),
        "wall_s": time.perf_counter() - t_start,
    }
    return result


def write(result: dict, out: Path) -> Tuple[Path, Optional[Path]]:
    if out.suffix == ".json":
        json_path, png_path = out, out.with_suffix(".png")
    else:
        json_path, png_path = out / "e2e.json", out / "e2e.png"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    write_record(json_path, result)
    return json_path, plot(result, png_path)


def print_summary(result: dict) -> None:
    print(f"\n{result['model']['name']} on {result['device_name']}: torch {result['torch']}, transformers "
          f"{result['transformers']}, read bandwidth {result['bandwidth']['bytes_per_s'] / 1e12:.3f} TB/s, "
          f"{result['wall_s']:.0f} s")
    for r in result["rows"]:
        print(_row_line(r))
    print("targets:")
    for name, t in result["targets"].items():
        if isinstance(t, dict):
            extra = {k: v for k, v in t.items() if k not in ("need", "pass")}
            print(f"  {name}: {'PASS' if t['pass'] else ('n/a' if t['pass'] is None else 'FAIL')}  {extra}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="bench_e2e.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("profiles/h200"),
                   help="output folder for e2e.json + e2e.png, or a .json path (default: profiles/h200)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="default: cuda")
    p.add_argument("--tiny", action="store_true", help="tiny Llama, short contexts (with --device cpu: a smoke test)")
    p.add_argument("--quick", action="store_true", help="B=1 N=128K and B=8 N=64K only")
    p.add_argument("--contexts", default=None, help="BxN list overriding the sweep, e.g. 1x32768,8x65536")
    p.add_argument("--configs", default=None,
                   help="comma list of configurations to run (dynamic,static,static-packed,static-compiled,"
                        "quanto4,quanto2,bd4,bd2,bd4-norms,bd4-fused,bd4-merged,bd4-all; default all)")
    p.add_argument("--compile", action="store_true",
                   help="add static-compiled (torch.compile reduce-overhead; ~1 min of compiling per context)")
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps per measurement (default 20; 10 with --quick; 3 with --tiny); the rows give "
                        "their median (tokens/s) and mean: with a block's tokens or more (128 at 4 bits, 256 at 2) "
                        "the mean includes bitdecode's packing of the completed block, which the median leaves out")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 3; 1 with --tiny)")
    p.add_argument("--backend", default="auto", help="bitdecode backend (default auto; reference on the CPU)")
    p.add_argument("--budget-gib", type=float, default=None,
                   help="memory cap for the fit check (default: the free memory; with --tiny, one that fits "
                        "a 4-bit cache but no 16-bit one at the last point)")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failed configurations")
    p.add_argument("--dense-residual-ahead", action=argparse.BooleanOptionalAction, default=None,
                   help="whether the fused-residual dense kernels read the residual with the first weights "
                        "(bitdecode.dense.RESIDUAL_AHEAD, on by default; --no-... for an A/B)")
    p.add_argument("--norm-prefetch", action=argparse.BooleanOptionalAction, default=None,
                   help="whether the RMSNorm kernels ask L2 for their weight before waiting for the previous "
                        "kernel (bitdecode.bitnet.NORM_PREFETCH, on by default; --no-... for an A/B)")
    args = p.parse_args(argv)
    if args.dense_residual_ahead is not None:
        bd.dense.RESIDUAL_AHEAD = args.dense_residual_ahead
    if args.norm_prefetch is not None:
        bd.bitnet.NORM_PREFETCH = args.norm_prefetch
    if args.steps is None:
        args.steps = 3 if args.tiny else (10 if args.quick else 20)
    if args.warmup is None:
        args.warmup = 1 if args.tiny else 3
    result = run(args)
    json_path, png_path = write(result, args.out)
    print_summary(result)
    print(f"results: {json_path}" + (f", {png_path}" if png_path else " (no matplotlib: no plot)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
