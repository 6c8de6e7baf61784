"""A whole BitNet b1.58 model on bitdecode, end to end (issue 13): prefill and decode.

``python3 profiles/bench_bitnet_model.py --out profiles/h200`` -> ``bitnet_model.json``.

One run, one random-weight BitNet b1.58 2B-shaped model (transformers' ``BitNetConfig``:
30 layers, hidden 2560, MLP 6912, GQA 20/5, head dim 128, bf16), four ways:

* ``bf16``: the model as transformers builds it (bf16 ``nn.Linear``), StaticCache + SDPA:
  what the same model costs in 16 bits;
* ``hf-bitnet``: transformers' own BitNet path, its ``AutoBitLinear`` layers with online
  quantization (ternary weights and int8 activations simulated in bf16 each call), as a
  transformers user runs a BitNet checkpoint today; StaticCache + SDPA;
* ``bitdecode``: ``bd.bitnet.convert`` (W2A8 GEMV at one token, the GEMM above; each
  norm in front of linear layers fused with their activation quantizer) and the bitdecode
  4-bit KV cache (``attn_implementation="bitdecode"``);
* ``bitdecode-plain-norms``: the same with ``fuse_norms=False`` (transformers' RMSNorm
  ops, each linear quantizing its own input): what the norm fusion buys.

Prefill: one forward of ``--prefill`` prompt tokens (B=1) into an empty cache, eager,
median of ``--steps`` after a warm-up.  Decode: the caches filled with random K/V to each
context (as ``bench_e2e.py`` does), one token per step at position N, eager and CUDA-graph
captured (``bench_e2e.run_config``).  Targets (issue 13, H200): bitdecode's graph-captured
decode >= 3x the tokens/s of the bf16 model's at B=1 N=4K, and its prefill at 4K tokens
no slower than bf16's.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import List, Optional

import torch

if __package__ in (None, ""):  # run as a script: profiles/ is not a package on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bitdecode as bd  # noqa: E402
from bitdecode import bitnet, cli_generate  # noqa: E402
from bitdecode._files import write_record  # noqa: E402
from bitdecode._memory import release_memory  # noqa: E402
from profiles import bench_e2e as e2e  # noqa: E402

CONTEXTS = ((1, 4096), (1, 32768))
PREFILL = 4096
TARGETS = {"decode_speedup_b1_4k": 3.0, "prefill_vs_bf16": 1.0}


def build(size: str, device, seed: int = 0):
    """The random-weight BitNet model in bf16 with SDPA (the ``bf16`` configuration)."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.BitNetConfig(**cli_generate.RANDOM_BITNET[size])
    with torch.device(device):
        model = transformers.BitNetForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16)
    return model.eval()


@torch.no_grad()
def to_hf_bitnet(model) -> None:
    """transformers' ``AutoBitLinear`` (online quantization) in place of every linear layer
    but ``lm_head``, keeping the weights: the model as transformers runs BitNet."""
    from transformers.integrations.bitnet import AutoBitLinear

    lm_head = model.get_output_embeddings()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear) and child is not lm_head and not isinstance(child, AutoBitLinear):
                layer = AutoBitLinear(child.in_features, child.out_features, bias=child.bias is not None,
                                      device=child.weight.device, dtype=child.weight.dtype,
                                      online_quant=True).to(child.weight.device, child.weight.dtype)
                layer.weight.copy_(child.weight)
                if child.bias is not None:
                    layer.bias.copy_(child.bias)
                setattr(parent, name, layer)


def time_prefill(model, cfg: dict, n: int, args, device, backend: str) -> dict:
    """ms of one forward of ``n`` prompt tokens into a fresh cache (eager)."""
    from bitdecode import hf

    hf.use_attention(model, cfg["attn"])
    ids = torch.randint(0, model.config.vocab_size, (1, n), device=device)
    kwarg = hf.cache_kwarg(model)
    times = []
    for i in range(args.warmup + args.steps):
        cache = e2e.make_cache(cfg, model, n + 16, backend)
        e2e.sync(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        model(input_ids=ids, use_cache=True, logits_to_keep=1, **{kwarg: cache})
        end.record()
        end.synchronize()
        if i >= args.warmup:
            times.append(start.elapsed_time(end))
        del cache
    ms = statistics.median(times)
    return dict(config=cfg["name"], label=cfg["label"], tokens=n, status="ok", prefill_ms=ms,
                prefill_tokens_per_s=n / ms * 1e3)


def configurations() -> List[dict]:
    modes = ["eager", "graph"]
    return [
        dict(name="bf16", cache="static", label="bf16 model, StaticCache + SDPA", attn="sdpa", modes=modes),
        dict(name="hf-bitnet", cache="static", label="transformers AutoBitLinear (online W1.58A8 in bf16), "
             "StaticCache + SDPA", attn="sdpa", modes=modes),
        dict(name="bitdecode", cache="bd4", bits=4, label="bitdecode W2A8 linears + 4-bit KV cache, "
             "norm + quantizer fused", attn="bitdecode", modes=modes, fuse_norms=True),
        dict(name="bitdecode-plain-norms", cache="bd4", bits=4, label="the same with transformers' RMSNorms "
             "(each linear quantizes its input)", attn="bitdecode", modes=modes, fuse_norms=False),
    ]


def run(args) -> dict:
    import transformers

    from bitdecode import hf  # noqa: F401 - registers attn_implementation="bitdecode"

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    if not torch.cuda.is_available():
        raise SystemExit("the BitNet model benchmark needs a CUDA GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    backend = args.backend
    contexts = [(1, 256)] if args.tiny else CONTEXTS
    prefill = 256 if args.tiny else args.prefill
    margin = 2 * (args.warmup + args.steps) + 16
    t_start = time.perf_counter()
    bw = e2e.measure_bandwidth(device)
    model = build("tiny" if args.tiny else "2b", device)
    s = e2e.model_shape(model)
    prefills, rows, info = [], [], {}
    gen = torch.Generator(device=device).manual_seed(0)
    for cfg in configurations():
        if cfg["name"] == "hf-bitnet":
            to_hf_bitnet(model)
        elif cfg["name"].startswith("bitdecode"):
            del model
            gc.collect()
            release_memory()
            model = build("tiny" if args.tiny else "2b", device)  # from the float weights again
            bitnet.convert(model, backend=backend, fuse_norms=cfg["fuse_norms"])
        cache_cfg = dict(cfg, name=cfg["cache"])
        weights = e2e.weight_bytes_read(model)
        info[cfg["name"]] = dict(weight_bytes_read_per_step=weights, label=cfg["label"])
        print(f"{cfg['name']}: {weights / 2**30:.2f} GiB of weights read per decode step", flush=True)
        with torch.no_grad():
            try:
                p = time_prefill(model, cache_cfg, prefill, args, device, backend)
            except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
                if args.verbose:
                    traceback.print_exc()
                p = dict(config=cfg["name"], tokens=prefill, status=f"error: {type(exc).__name__}: {exc}"[:300])
            p["config"] = cfg["name"]
            prefills.append(p)
            print(f"  prefill {prefill} tokens: " + (f"{p['prefill_ms']:.2f} ms" if p["status"] == "ok" else p["status"]),
                  flush=True)
        for b, n in contexts:
            ctx = dict(role=f"b{b}_n{n}", B=b, N=n, cap=n + margin)
            shape = (b, s["hkv"], n, s["d"])
            data = dict(k=torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16),
                        v=torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16),
                        valid=torch.ones(b, n, dtype=torch.bool, device=device),
                        ids=torch.randint(0, s["vocab"], (b, 1), generator=gen, device=device),
                        pos=torch.full((b, 1), n, dtype=torch.long, device=device), weights=weights,
                        bw=bw["bytes_per_s"])
            try:
                new = e2e.run_config(cache_cfg, model, ctx, data, args, device, backend)
            except Exception as exc:  # noqa: BLE001
                if args.verbose:
                    traceback.print_exc()
                new = e2e._skip_rows(cache_cfg, ctx, f"error: {type(exc).__name__}: {exc}"[:300])
            for r in new:
                r["config"] = cfg["name"]
            rows += new
            del data
            gc.collect()
            release_memory()
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device_name": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "bitdecode": bd.__version__,
        "model": dict(name="BitNet b1.58 2B shape" if not args.tiny else "tiny BitNet", **s,
                      intermediate=model.config.intermediate_size, dtype="bfloat16"),
        "configs": info,
        "bandwidth": bw,
        "method": {
            "prefill": f"B=1, {prefill} prompt tokens into an empty cache, eager, logits of the last token only, "
                       f"median of {args.steps} after {args.warmup} warm-ups",
            "decode": "bench_e2e.run_config: caches filled with random K/V to N tokens, one token at position N; "
                      f"eager and CUDA-graph replay, median of {args.steps} steps",
            "roofline": "(weight bytes read per step + KV bytes read) / the read bandwidth of bench_e2e.measure_bandwidth",
        },
        "prefill": prefills,
        "rows": rows,
        "targets": evaluate(prefills, rows, prefill),
        "wall_s": time.perf_counter() - t_start,
    }
    return result


def evaluate(prefills: List[dict], rows: List[dict], n_prefill: int) -> dict:
    def step(config: str, n: int) -> Optional[float]:
        r = [x for x in rows if x["config"] == config and x["N"] == n and x["mode"] == "graph" and x["status"] == "ok"]
        return r[0]["tokens_per_s"] if r else None

    def pre(config: str) -> Optional[float]:
        r = [x for x in prefills if x["config"] == config and x["status"] == "ok"]
        return r[0]["prefill_ms"] if r else None

    out = {}
    bd4, bf = step("bitdecode", 4096), step("bf16", 4096)
    speed = bd4 / bf if bd4 and bf else None
    out["decode_speedup_b1_4k"] = dict(value=speed, target=TARGETS["decode_speedup_b1_4k"],
                                       pass_=bool(speed and speed >= TARGETS["decode_speedup_b1_4k"]))
    p_bd, p_bf = pre("bitdecode"), pre("bf16")
    ratio = p_bf / p_bd if p_bd and p_bf else None  # > 1: bitdecode faster
    out["prefill_vs_bf16"] = dict(value=ratio, tokens=n_prefill, target=TARGETS["prefill_vs_bf16"],
                                  pass_=bool(ratio and ratio >= TARGETS["prefill_vs_bf16"]))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Records --out/bitnet_model.json.")
    p.add_argument("--out", type=Path, default=Path("profiles/h200"), help="folder for bitnet_model.json")
    p.add_argument("--prefill", type=int, default=PREFILL, help=f"prompt tokens of the prefill (default {PREFILL})")
    p.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps (default 3)")
    p.add_argument("--tiny", action="store_true", help="tiny BitNet config, short contexts (a smoke run)")
    p.add_argument("--backend", default="auto", help="bitdecode backend (default auto)")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failed configurations")
    args = p.parse_args(argv)
    res = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bitnet_model.json"
    write_record(path, res)
    for r in res["prefill"]:
        print(f"prefill {r['config']:<10s} " + (f"{r['prefill_ms']:8.2f} ms" if r["status"] == "ok" else r["status"]))
    print(json.dumps(res["targets"], indent=1))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
