"""Tensor parallelism: the transformers drop-in (``bitdecode.hf``) under transformers' own
tensor-parallel plans (``from_pretrained(..., tp_plan="auto")`` over torch.distributed).

A tiny random Llama is saved to a temporary directory and run twice: as two ranks launched
by ``torchrun --standalone`` (gloo on the CPU, the reference backend), where each rank's
attention sees its own query / KV heads and its ``BitDecodingCache`` holds only those, and
as one plain process.  The same prompt and the same teacher-forced decode tokens go through
both; the ranks' logits must equal the single process's within the format's error (the
tensor-parallel matmuls sum in another order, which moves a few codes across a rounding
boundary), and greedy generation must pick the same tokens where the choice is clear.

The ``gpu`` variant does the same with NCCL over 2, 4 or 8 GPUs and the kernels (``auto``).

This file is also the ranks' program: ``python -m torch.distributed.run ... tests/test_tp.py
--ckpt DIR --out FILE``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

VOCAB = 128
PROMPT, STEPS, GEN = 300, 6, 5
PAD = 37  # left pads of sequence 0 in the generate batch


def _config(gpu: bool):
    import transformers

    if gpu:  # 8 KV heads: 2, 4 or 8 ranks each hold a whole number of them; head dim 128
        heads = dict(hidden_size=512, num_attention_heads=32, num_key_value_heads=8, head_dim=128)
    else:
        heads = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=64)
    return transformers.LlamaConfig(vocab_size=VOCAB, intermediate_size=512, num_hidden_layers=2,
                                    max_position_embeddings=4096, initializer_range=0.05, **heads)


def _tp_kwargs() -> dict:
    """transformers' own tensor parallelism: the model's ``base_model_tp_plan`` across all ranks."""
    try:
        from transformers.distributed import DistributedConfig
    except ImportError:  # transformers before the distributed package
        return {"tp_plan": "auto"}
    return {"distributed_config": DistributedConfig(tp_plan="auto")}


def _load(ckpt, device, tp: bool):
    import transformers

    from bitdecode import hf

    kw = _tp_kwargs() if tp else {}
    model = transformers.LlamaForCausalLM.from_pretrained(ckpt, attn_implementation=hf.ATTN_IMPLEMENTATION,
                                                          dtype=torch.bfloat16, **kw)
    if not tp:
        model = model.to(device)
    return model.eval()


def _inputs(device):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, PROMPT), generator=gen)
    steps = torch.randint(0, VOCAB, (2, STEPS), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :PAD] = 0
    return ids.to(device), steps.to(device), mask.to(device)


@torch.no_grad()
def _scenario(model, device, backend: str) -> dict:
    """The prompt and the decode tokens through the model with a 16-bit cache and a 4- and a
    2-bit ``BitDecodingCache``; a greedy ``generate`` of a left-padded batch at 4 bits."""
    import transformers

    import bitdecode as bd
    from bitdecode import hf

    ids, steps, mask = _inputs(device)
    out = {}
    for name in ("16", "4", "2"):
        if name == "16":
            cache = transformers.DynamicCache(config=model.config)
        else:
            cache = hf.BitDecodingCache(model, bd.KVFormat(bits=int(name), group_size=64), max_seqlen=1024,
                                        backend=backend)
        logits = [model(ids, **hf.cache_kwargs(model, cache), use_cache=True).logits[:, -1]]
        logits += [model(steps[:, i:i + 1], **hf.cache_kwargs(model, cache), use_cache=True).logits[:, -1]
                   for i in range(STEPS)]
        out[f"logits{name}"] = torch.stack(logits, 1).float().cpu()  # [B, 1 + STEPS, V]
        if name != "16":
            out[f"heads{name}"] = [layer.kv.num_kv_heads for layer in cache.layers]
            out[f"lengths{name}"] = [layer.kv.lengths for layer in cache.layers]
            out[f"bytes{name}"] = cache.memory_bytes()
        del cache
    cache = hf.BitDecodingCache(model, bd.KVFormat(bits=4, group_size=64), max_seqlen=1024, backend=backend)
    res = model.generate(ids, attention_mask=mask, **hf.cache_kwargs(model, cache), max_new_tokens=GEN,
                         do_sample=False, output_logits=True, return_dict_in_generate=True)
    out["gen_tokens"] = res.sequences[:, PROMPT:].cpu()
    out["gen_logits"] = torch.stack(res.logits, 1).float().cpu()
    out["gen_lengths"] = cache.layers[0].kv.lengths
    return out


def _worker(argv=None) -> None:
    """One rank: load the checkpoint with transformers' tensor-parallel plan, run the scenario."""
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--backend", default="reference")
    args = p.parse_args(argv)
    import torch.distributed as dist

    import bitdecode.hf  # noqa: F401  registers attn_implementation="bitdecode"

    use_cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if use_cuda else "gloo",
                            device_id=torch.device("cuda", local) if use_cuda else None)
    try:
        model = _load(args.ckpt, None, tp=True)
        device = model.model.embed_tokens.weight.device
        out = _scenario(model, device, args.backend)
        out["world"] = dist.get_world_size()
        out["device"] = str(device)
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, {k: out[k] for k in ("heads4", "heads2", "device")})
        out["per_rank"] = per_rank
        if dist.get_rank() == 0:
            torch.save(out, args.out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


# ---- the tests --------------------------------------------------------------------------

def _save_model(tmp_path: Path, gpu: bool) -> Path:
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config(gpu)).to(torch.bfloat16)
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt)
    return ckpt


def _launch(ckpt: Path, out: Path, nproc: int, backend: str, cpu: bool, timeout: int) -> dict:
    """The ranks, as ``torchrun --standalone`` starts them (it picks a free port itself)."""
    env = dict(os.environ)
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""  # gloo on the CPU even on a GPU host
    env.setdefault("OMP_NUM_THREADS", "1")
    for key, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                       ("NVSHMEM_DISABLE_NVLS", "1")):
        env.setdefault(key, value)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           __file__, "--ckpt", str(ckpt), "--out", str(out), "--backend", backend]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and the ranks it started
        log, _ = proc.communicate()
        pytest.fail(f"the ranks did not finish in {timeout} s:\n{log[-6000:]}")
    assert proc.returncode == 0, log[-6000:]
    return torch.load(out, weights_only=False)


def _rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


def _clear(logits: torch.Tensor) -> torch.Tensor:
    """Where the top choice leads the runner-up by more than the tensor-parallel noise."""
    top2 = logits.topk(2, dim=-1).values
    return (top2[..., 0] - top2[..., 1]) > 0.05 * logits.abs().amax(-1)


def _check(tp: dict, single: dict, hkv: int, nproc: int) -> None:
    assert tp["world"] == nproc
    for bits in ("4", "2"):
        # each rank's caches hold its own KV heads only, the whole sequence of every layer
        assert all(r[f"heads{bits}"] == [hkv // nproc] * 2 for r in tp["per_rank"]), tp["per_rank"]
        assert single[f"heads{bits}"] == [hkv] * 2
        assert tp[f"lengths{bits}"] == single[f"lengths{bits}"] == [[PROMPT + STEPS] * 2] * 2
        assert tp[f"bytes{bits}"] < single[f"bytes{bits}"]
    # the 16-bit cache: tensor parallelism changes only the summation order
    assert _rel(tp["logits16"], single["logits16"]) < 3e-2
    for bits, bound in (("4", 0.05), ("2", 0.1)):
        a, b = tp[f"logits{bits}"], single[f"logits{bits}"]
        assert _rel(a[:, 0], b[:, 0]) < 3e-2, "prefill attention runs on the 16-bit K/V"
        fmt_err = _rel(b[:, 1:], single["logits16"][:, 1:])  # the format's own error, one process
        tp_err = _rel(a[:, 1:], b[:, 1:])
        assert tp_err < bound and tp_err < fmt_err, (bits, tp_err, fmt_err)
    for name in ("logits16", "logits4", "logits2"):  # teacher-forced: the same inputs on both sides
        clear = _clear(single[name])
        assert torch.equal(tp[name].argmax(-1)[clear], single[name].argmax(-1)[clear]), name
    # generate: the pads were dropped on every rank; tokens agree wherever the choice is clear
    assert tp["gen_lengths"] == single["gen_lengths"] == [PROMPT - PAD + GEN - 1, PROMPT + GEN - 1]
    assert _rel(tp["gen_logits"], single["gen_logits"]) < 0.05
    # a step can only be compared while all earlier tokens agree (later steps condition on them)
    agreed = torch.cat([torch.ones(2, 1, dtype=torch.bool),
                        (tp["gen_tokens"] == single["gen_tokens"]).cumprod(dim=1).bool()[:, :-1]], dim=1)
    differs = tp["gen_tokens"] != single["gen_tokens"]
    assert not (agreed & differs & _clear(single["gen_logits"])).any(), (tp["gen_tokens"], single["gen_tokens"])


@pytest.fixture(scope="module")
def _transformers():
    tf = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers' tensor-parallel loading needs it
    try:
        from transformers.distributed import DistributedConfig  # noqa: F401
    except ImportError:
        pytest.skip("this transformers has no DTensor tensor-parallel plans")
    return tf


def test_two_ranks_gloo_match_one_process(tmp_path, _transformers):
    ckpt = _save_model(tmp_path, gpu=False)
    tp = _launch(ckpt, tmp_path / "tp.pt", 2, "reference", cpu=True, timeout=300)
    assert tp["device"] == "cpu"
    single = _scenario(_load(ckpt, "cpu", tp=False), "cpu", "reference")
    _check(tp, single, hkv=2, nproc=2)


@pytest.mark.gpu
def test_ranks_nccl_kernels_match_one_process(tmp_path, _transformers):
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2:
        pytest.skip("needs 2 or more CUDA GPUs")
    nproc = max(k for k in (2, 4, 8) if k <= n)
    ckpt = _save_model(tmp_path, gpu=True)
    tp = _launch(ckpt, tmp_path / "tp.pt", nproc, "auto", cpu=False, timeout=900)
    assert [r["device"] for r in tp["per_rank"]] == [f"cuda:{i}" for i in range(nproc)]
    single = _scenario(_load(ckpt, "cuda", tp=False), torch.device("cuda"), "auto")
    _check(tp, single, hkv=8, nproc=nproc)


if __name__ == "__main__":
    _worker()


def test_bench_tp_tiny_cpu(tmp_path):
    """``profiles/bench_tp.py --tiny --device cpu`` (README's smoke run) over two gloo ranks:
    every kind's rows recorded, the bitdecode ones sized by their caches (the sizing
    allocated a cache on the meta device, which ``KVCache.allocate`` refuses, and the run
    died at the first bitdecode row)."""
    import json

    script = Path(__file__).resolve().parent.parent / "profiles" / "bench_tp.py"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script),
           "--tiny", "--device", "cpu", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:]
    rows = json.loads((tmp_path / "tp2.json").read_text())["rows"]
    assert {"sdpa16", "bd4", "bd2"} <= {r["kind"] for r in rows}
    assert all(r["cache_gib_per_gpu"] > 0 and r["planned_max_batch"] >= 1 for r in rows if r["kind"] in ("bd4", "bd2"))
