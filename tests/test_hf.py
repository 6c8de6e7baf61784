"""The transformers drop-in (``bitdecode.hf``) on a tiny random Llama, reference backend (CPU).

Prefill attention runs on the 16-bit K / V, so prefill logits equal the SDPA model's
exactly; decode steps read the packed cache, so they differ from the 16-bit cache by the
format's error (4-bit closer than 2-bit); left pads are dropped before packing, so a
padded sequence decodes like the same sequence alone.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import bitdecode as bd  # noqa: E402
from bitdecode import hf  # noqa: E402

VOCAB = 128


def _models():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                                   max_position_embeddings=4096)
    base = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    assert base.config._attn_implementation != hf.ATTN_IMPLEMENTATION
    packed = transformers.LlamaForCausalLM._from_config(copy.deepcopy(cfg), attn_implementation=hf.ATTN_IMPLEMENTATION)
    packed = packed.to(torch.bfloat16).eval()
    packed.load_state_dict(base.state_dict())
    assert base.config._attn_implementation != hf.ATTN_IMPLEMENTATION  # configs are not shared
    return base, packed


@pytest.fixture(scope="module")
def models():
    return _models()


def _cache(model, bits, **kw):
    return hf.BitDecodingCache(model, bd.KVFormat(bits=bits, group_size=64), max_seqlen=1024,
                               backend="reference", **kw)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _feed(base, packed, c16, cbd, blocks):
    """Each token block through both models, the 16-bit cache beside the packed one:
    their logits, (16-bit, packed) per block."""
    return [(base(x, past_key_values=c16, use_cache=True).logits,
             packed(x, past_key_values=cbd, use_cache=True).logits) for x in blocks]


@torch.no_grad()
def test_prefill_exact_and_decode_within_the_format_error(models):
    base, packed = models
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 300), generator=gen)
    steps = torch.randint(0, VOCAB, (2, 6), generator=gen)
    errs = {}
    for bits in (4, 2):
        cbd = _cache(packed, bits)
        (a, b), *decoded = _feed(base, packed, transformers.DynamicCache(config=base.config), cbd,
                                 [ids, *steps.split(1, dim=1)])
        assert torch.equal(a, b), "prefill attention runs on the 16-bit K/V"
        errs[bits] = max(_rel(b, a) for a, b in decoded)
        assert cbd.get_seq_length() == 306
        assert [layer.kv.lengths for layer in cbd.layers] == [[306, 306]] * 2
    assert errs[4] < 0.06 and errs[4] < errs[2], errs


@torch.no_grad()
def test_decode_steps_append_in_the_attention_call(models, monkeypatch):
    """A decode step's new token is held by ``update`` and appended by the attention call
    with the decode (``decode(k_new=, v_new=)``: one launch on the sm80 and sm90
    kernels), bit for bit as the two calls; a reader of the cache before the attention
    call, or the next ``update``, appends a held token first."""
    _, packed = models
    gen = torch.Generator().manual_seed(5)
    ids, steps = torch.randint(0, VOCAB, (2, 40), generator=gen), torch.randint(0, VOCAB, (2, 3), generator=gen)
    calls = []
    real = hf.decode

    def spy(q, cache, **kw):
        calls.append(kw.get("k_new") is not None)
        return real(q, cache, **kw)

    monkeypatch.setattr(hf, "decode", spy)
    cbd = _cache(packed, 4)
    out = [packed(x, past_key_values=cbd, use_cache=True).logits for x in [ids, *steps.split(1, dim=1)]]
    assert calls == [True] * 6 and all(layer._pending is None for layer in cbd.layers)
    monkeypatch.setattr(hf, "decode", real)
    monkeypatch.setattr(hf.BitDecodingLayer, "take_pending", lambda self: self.flush())  # the two calls
    ref = _cache(packed, 4)  # (the model's attention modules follow the newest cache)
    want = [packed(x, past_key_values=ref, use_cache=True).logits for x in [ids, *steps.split(1, dim=1)]]
    assert all(torch.equal(a, b) for a, b in zip(out, want))
    monkeypatch.undo()
    _cache(packed, 4)  # (unbinds ``ref``: ``cbd``'s layers are driven by hand below)
    layer = cbd.layers[0]
    k = torch.randn(2, 2, 1, 64).to(torch.bfloat16)
    layer.update(k, k)
    assert layer._pending is not None and layer.kv.lengths == [44, 44] and layer._pending is None
    layer.update(k, k)
    layer.update(k, k)  # (the held token goes in first)
    assert layer.kv.lengths == [46, 46] and cbd.get_seq_length() == 46


@torch.no_grad()
def test_left_padded_sequence_decodes_like_itself_alone(models):
    _, packed = models
    gen = torch.Generator().manual_seed(2)
    long = torch.randint(0, VOCAB, (1, 200), generator=gen)
    short = torch.randint(0, VOCAB, (1, 137), generator=gen)
    pad = long.shape[1] - short.shape[1]
    ids = torch.cat([torch.cat([torch.zeros(1, pad, dtype=torch.long), short], 1), long])
    mask = torch.ones_like(ids)
    mask[0, :pad] = 0
    cache = _cache(packed, 4)
    batched = packed.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=4, do_sample=False,
                              output_logits=True, return_dict_in_generate=True)
    assert cache.layers[0].kv.lengths == [137 + 3, 200 + 3]  # pads were never stored
    alone = packed.generate(short, past_key_values=_cache(packed, 4), max_new_tokens=4, do_sample=False,
                            output_logits=True, return_dict_in_generate=True)
    for a, b in zip(batched.logits, alone.logits):
        assert _rel(a[0], b[0]) < 2e-2
    assert torch.equal(batched.sequences[0, -4:], alone.sequences[0, -4:])


@torch.no_grad()
def test_generate_agrees_with_the_16bit_cache(models):
    base, packed = models
    ids = torch.randint(0, VOCAB, (2, 160), generator=torch.Generator().manual_seed(3))
    g16 = base.generate(ids, max_new_tokens=8, do_sample=False)
    gbd = packed.generate(ids, past_key_values=_cache(packed, 4), max_new_tokens=8, do_sample=False)
    agree = (g16[:, 160:] == gbd[:, 160:]).float().mean().item()
    assert agree >= 0.75, agree


@torch.no_grad()
def test_multi_token_chunk_over_the_packed_cache(models):
    base, packed = models
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, VOCAB, (2, 270), generator=gen)
    chunk = torch.randint(0, VOCAB, (2, 5), generator=gen)
    cbd = _cache(packed, 4)
    _, (a, b) = _feed(base, packed, transformers.DynamicCache(config=base.config), cbd, [ids, chunk])
    assert _rel(b, a) < 0.06
    assert cbd.layers[1].kv.lengths == [275, 275]


def test_cache_needs_the_bitdecode_attention(models):
    base, _ = models
    with pytest.raises(ValueError, match="attn_implementation='bitdecode'"):
        hf.BitDecodingCache(base, bd.KVFormat(bits=4))
    with pytest.raises(TypeError, match="fmt must be a bitdecode.KVFormat"):
        hf.BitDecodingCache(models[1], "4bit")


def test_import_bitdecode_does_not_import_transformers():
    import subprocess
    import sys

    code = "import sys, bitdecode; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_fused_norm_classes_compute_llamas_norm():
    """Every class ``fuse_norms`` replaces has LlamaRMSNorm's forward line for line in the
    installed transformers (a change there makes this fail, not the models)."""
    import importlib
    import inspect

    def body(cls):
        return inspect.getsource(cls.forward).split("\n", 1)[1]

    llama = importlib.import_module("transformers.models.llama.modeling_llama").LlamaRMSNorm
    for name in hf.RMS_NORM_CLASSES:
        family = name[: -len("RMSNorm")].lower()
        cls = getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), name)
        assert body(cls) == body(llama), name


@torch.no_grad()
def test_fuse_norms_on_the_cpu_changes_no_bit(models):
    """fuse_norms swaps each RMSNorm (2 per layer + the final one) for FusedRMSNorm with
    the same weight; on the CPU it runs torch's ops, so logits are bit-identical."""
    base, _ = models
    fused = copy.deepcopy(base)
    assert hf.fuse_norms(fused) == 2 * base.config.num_hidden_layers + 1
    assert isinstance(fused.model.norm, hf.FusedRMSNorm) and fused.model.norm.weight.shape == (256,)
    assert "model.layers.0.input_layernorm.weight" in fused.state_dict()
    assert hf.fuse_norms(fused) == 0  # nothing left to replace
    # the residual add after attention joins the post-attention norm: every layer's forward
    assert all(vars(layer)["forward"].__func__ is hf._fused_residual_forward for layer in fused.model.layers)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    assert torch.equal(fused(ids).logits, base(ids).logits)
    keys = list(fused.state_dict())
    assert keys == list(base.state_dict())  # the original norm is kept, not registered again
    assert hf.unfuse_norms(fused) == 2 * base.config.num_hidden_layers + 1
    assert type(fused.model.norm) is type(base.model.norm) and not any(
        isinstance(m, hf.FusedRMSNorm) for m in fused.modules())
    assert not any("forward" in vars(layer) for layer in fused.model.layers)
    assert list(fused.state_dict()) == keys and torch.equal(fused(ids).logits, base(ids).logits)
    with pytest.raises(TypeError, match="model"):
        hf.fuse_norms("llama")


@torch.no_grad()
def test_fused_layers_compile_in_one_graph(models):
    """A model with its norms and projections fused (the residual adds in the norm and in
    down_proj) compiles with fullgraph=True and computes what it computes eagerly."""
    fused = copy.deepcopy(models[0])
    hf.fuse_norms(fused)
    hf.fuse_projections(fused)
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(4))
    want = fused(ids).logits
    torch._dynamo.reset()
    try:
        got = torch.compile(fused, fullgraph=True, backend="aot_eager")(ids).logits
    finally:
        torch._dynamo.reset()
    assert _rel(got, want) < 1e-5


def test_residual_add_joins_the_norm_only_in_the_pre_norm_block():
    """The decoder layers of Llama, Mistral, Qwen2 and Qwen3 are the pre-norm residual
    block statement by statement (so their middle add may join the norm after it); a layer
    whose forward does anything else keeps its own forward, and the fused forward passes a
    positional argument on under its name."""
    import importlib

    from transformers.models.llama import modeling_llama

    for family in ("llama", "mistral", "qwen2", "qwen3"):
        mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        cls = next(v for k, v in vars(mod).items() if k.endswith("DecoderLayer") and isinstance(v, type))
        assert hf._is_residual_block(cls.forward), family

    class Scaled(modeling_llama.LlamaDecoderLayer):
        def forward(self, hidden_states, attention_mask=None, **kwargs):
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
            hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask, **kwargs)
            hidden_states = residual + 0.5 * hidden_states
            residual = hidden_states
            hidden_states = self.post_attention_layernorm(hidden_states)
            hidden_states = self.mlp(hidden_states)
            hidden_states = residual + hidden_states
            return hidden_states

    assert not hf._is_residual_block(Scaled.forward)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=1, vocab_size=VOCAB)
    layer = Scaled(config, 0)
    model = torch.nn.Sequential(layer)
    hf.fuse_norms(model)
    assert "forward" not in vars(layer) and isinstance(layer.post_attention_layernorm, hf.FusedRMSNorm)

    seen = {}

    class Attention(torch.nn.Module):
        def forward(self, **kwargs):
            seen.update(kwargs)
            return kwargs["hidden_states"], None

    plain = modeling_llama.LlamaDecoderLayer(config, 0)
    plain.self_attn = Attention()
    torch.nn.init.normal_(plain.post_attention_layernorm.weight)
    x = torch.randn(2, 3, 64)
    want = plain(x, "mask", position_embeddings="rope", extra=1)
    hf.fuse_norms(plain)
    got = plain(x, "mask", position_embeddings="rope", extra=1)
    assert torch.equal(got, want)
    assert seen["attention_mask"] == "mask" and seen["position_embeddings"] == "rope" and seen["extra"] == 1


def _generates_like(fused, packed, n: int = 300):
    """``fused`` (a copy of ``packed`` with bitdecode's fusions, on the GPU): prompt logits
    within 2 % of the plain model's and at least 3 in 4 of 8 greedy tokens the same, both on
    the bitdecode cache."""
    ids = torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(6)).cuda()
    assert _rel(fused(ids).logits, packed(ids).logits) < 2e-2
    fmt = bd.KVFormat(bits=4, group_size=64)
    out_f = fused.generate(ids, past_key_values=hf.BitDecodingCache(fused, fmt, max_seqlen=1024),
                           max_new_tokens=8, do_sample=False)
    out_p = packed.generate(ids, past_key_values=hf.BitDecodingCache(packed, fmt, max_seqlen=1024),
                            max_new_tokens=8, do_sample=False)
    assert (out_f[:, n:] == out_p[:, n:]).float().mean().item() >= 0.75


@pytest.mark.gpu
@torch.no_grad()
def test_gpu_fused_norms_generate_like_transformers():
    """On the GPU the norms run the kernel: logits within the norms' last-bit differences
    of transformers' own, the same greedy tokens; a decode step captured in a CUDA graph
    replays as it ran eagerly."""
    base, packed = _models()
    base, packed = base.cuda(), packed.cuda()
    fused = copy.deepcopy(packed)
    hf.fuse_norms(fused)
    _generates_like(fused, packed)
    x = torch.randn(1, 1, 256, device="cuda", dtype=torch.bfloat16)
    norm = fused.model.layers[0].input_layernorm
    graph = torch.cuda.CUDAGraph()
    norm(x)
    with torch.cuda.graph(graph):
        y = norm(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(y, norm(x))


@pytest.mark.gpu
@torch.no_grad()
def test_kernels_decode_within_the_format_error(backend):
    """The same drop-in over the GPU kernels (``backend`` fixture)."""
    base, packed = _models()
    base, packed = base.cuda(), packed.cuda()
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (2, 700), generator=gen).cuda()
    steps = torch.randint(0, VOCAB, (2, 4), generator=gen).cuda()
    cbd = hf.BitDecodingCache(packed, bd.KVFormat(bits=4, group_size=64), max_seqlen=1024, backend=backend)
    _, *decoded = _feed(base, packed, transformers.DynamicCache(config=base.config), cbd,
                        [ids, *steps.split(1, dim=1)])
    for a, b in decoded:
        assert _rel(b, a) < 0.06
    assert cbd.layers[0].kv.backend == backend


@torch.no_grad()
@pytest.mark.parametrize("return_lse", [False, True])
def test_chunk_attention_equals_a_float64_model(models, return_lse):
    """A chunk of queries over the packed cache (``bd.decode`` with T > 1, as the attention
    function calls it): each query attends to the dequantized cache up to its own position
    (causal over the chunk), GQA, the model's scale; the reference maths and, past the
    kernels' tile (7 tokens x 4 heads > 16 rows), the dequantize + SDPA path."""
    _, packed = models
    gen = torch.Generator().manual_seed(6)
    cbd = _cache(packed, 2)
    packed(torch.randint(0, VOCAB, (2, 150), generator=gen), past_key_values=cbd, use_cache=True)
    packed(torch.randint(0, VOCAB, (2, 7), generator=gen), past_key_values=cbd, use_cache=True)
    layer = cbd.layers[1]
    query = torch.randn(2, 8, 7, 64, generator=gen).to(torch.bfloat16)
    q = query.transpose(1, 2).contiguous()  # [B, Tq, Hq, D]
    if return_lse:
        got, _ = bd.decode(q, layer.kv, softmax_scale=0.125, return_lse=True)
    else:  # the chunk path (what a kernel backend runs for this many query rows)
        got = bd.attention.chunk_decode(q, layer.kv.tensors(), 0.125, False)
    for b, (k, v) in enumerate(layer.dequantized()):
        n = k.shape[0]
        for t in range(7):
            kk, vv = k[:n - 7 + t + 1].double(), v[:n - 7 + t + 1].double()  # [m, Hkv, D]
            q = query[b, :, t].double().view(2, 4, 64)
            p = torch.softmax(torch.einsum("hgd,mhd->hgm", q, kk) * 0.125, dim=-1)
            want = torch.einsum("hgm,mhd->hgd", p, vv).reshape(8, 64)
            torch.testing.assert_close(got[b, t].double(), want, rtol=1e-2, atol=1e-2)


@torch.no_grad()
def test_assisted_generation_crops_the_packed_cache(models):
    """transformers' assisted generation verifies drafts as multi-token chunks and crops
    the rejected ones: greedy tokens agree with plain greedy decoding on the same cache
    format, and the cache ends as long as the sequence."""
    _, packed = models
    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    assistant = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    ids = torch.randint(0, VOCAB, (1, 140), generator=torch.Generator().manual_seed(7))
    plain = packed.generate(ids, past_key_values=_cache(packed, 4), max_new_tokens=12, do_sample=False)
    cache = _cache(packed, 4)
    assisted = packed.generate(ids, past_key_values=cache, assistant_model=assistant, max_new_tokens=12,
                               do_sample=False)
    assert assisted.shape == plain.shape
    agree = (assisted[:, 140:] == plain[:, 140:]).float().mean().item()
    assert agree >= 0.75, agree
    assert cache.layers[0].kv.lengths[0] in (assisted.shape[1] - 1, assisted.shape[1])


def _family_models(family):
    """(16-bit model, the same weights with the bitdecode attention) of a tiny random
    model of ``family``: GQA 8/2, head dim 64, RoPE applied before caching."""
    common = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096)
    config_cls, model_cls, extra = {
        "mistral": ("MistralConfig", "MistralForCausalLM", dict(head_dim=64, sliding_window=None)),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(hidden_size=512, use_sliding_window=False)),  # q/k/v biases
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=64)),  # q/k RMSNorm before RoPE
        # SmolLM2-135M's attention shape: 9 / 3 heads of 64, tied embeddings
        "smollm": ("LlamaConfig", "LlamaForCausalLM", dict(hidden_size=576, num_attention_heads=9,
                                                           num_key_value_heads=3, head_dim=64, tie_word_embeddings=True)),
    }[family]
    cfg = getattr(transformers, config_cls)(**(common | extra))
    torch.manual_seed(0)
    base = getattr(transformers, model_cls)(cfg).to(torch.bfloat16).eval()
    packed = getattr(transformers, model_cls)._from_config(copy.deepcopy(cfg),
                                                           attn_implementation=hf.ATTN_IMPLEMENTATION)
    packed = packed.to(torch.bfloat16).eval()
    packed.load_state_dict(base.state_dict())
    return base, packed


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3", "smollm"])
@torch.no_grad()
def test_model_families_prefill_exact_and_decode_within_the_format_error(family):
    """The drop-in on Mistral, Qwen2 (biased q/k/v), Qwen3 (q/k norms) and SmolLM-shaped
    (Llama, 9 / 3 heads, tied embeddings) models: prefill logits equal the 16-bit model's,
    decode steps (teacher-forced on the same tokens) stay within the 4-bit format's error
    and pick the same next token at most steps (a random tiny model has near ties), and
    ``generate`` runs on the cache."""
    base, packed = _family_models(family)
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, VOCAB, (2, 200), generator=gen)
    steps = torch.randint(0, VOCAB, (2, 8), generator=gen)
    cbd = hf.BitDecodingCache(packed, bd.KVFormat(bits=4, group_size=32), max_seqlen=512, backend="reference")
    (a, b), *decoded = _feed(base, packed, transformers.DynamicCache(config=base.config), cbd,
                             [ids, *steps.split(1, dim=1)])
    assert torch.equal(a, b), "prefill attention runs on the 16-bit K/V"
    err = max(_rel(y, x) for x, y in decoded)
    assert err < 0.06, err
    agree = torch.stack([(x[:, -1].argmax(-1) == y[:, -1].argmax(-1)) for x, y in decoded]).float().mean().item()
    assert agree >= 0.75, agree
    assert cbd.get_seq_length() == 208
    out = packed.generate(ids, past_key_values=hf.BitDecodingCache(packed, bd.KVFormat(bits=4, group_size=32),
                                                                   max_seqlen=512, backend="reference"),
                          max_new_tokens=4, do_sample=False)
    assert out.shape == (2, 204) and torch.equal(out[:, 200], base(ids).logits[:, -1].argmax(-1))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@torch.no_grad()
def test_fuse_projections_merges_and_unmerges(models, family):
    """q/k/v and gate/up become one GEMM each (Qwen2: with its q/k/v biases): the weights
    move into one storage (the projections' Parameters are views of it, state_dict keys
    unchanged), o_proj / down_proj go through bd.dense.linear, the MLP's forward runs
    silu(gate) * up over the merged output, logits equal nn.Linear's up to the GEMM's
    summation order, and unfuse_projections puts nn.Linear and the MLP's own forward back
    on the same storage."""
    base = copy.deepcopy(models[0]) if family == "llama" else _family_models(family)[0]
    model = copy.deepcopy(base)
    keys = set(model.state_dict())
    layers = model.config.num_hidden_layers
    assert hf.fuse_projections(model) == 2 * layers
    assert hf.fuse_projections(model) == 0  # nothing left to merge
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.k_proj, hf.ProjectionSlice) and set(model.state_dict()) == keys
    merged = attn.q_proj.group.weight
    assert attn.k_proj.weight.data_ptr() == merged.data_ptr() + attn.q_proj.weight.numel() * merged.element_size()
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    want = base(ids).logits
    assert _rel(model(ids).logits, want) < 1e-2
    assert attn.q_proj.group._outs == ()  # every slice taken: the merged output is let go
    with torch.inference_mode():  # inference tensors have no version counter
        assert _rel(model(ids).logits, want) < 1e-2
    x = torch.randn(3, attn.q_proj.in_features, dtype=merged.dtype)
    for proj in (attn.v_proj, attn.q_proj, attn.q_proj):  # any order; a slice asked twice is recomputed
        assert torch.equal(proj(x), torch.nn.functional.linear(x, proj.weight, proj.bias))
    mlp = model.model.layers[0].mlp
    assert isinstance(attn.o_proj, hf.Projection) and isinstance(mlp.down_proj, hf.Projection)
    assert "forward" in vars(mlp), "a Llama-style MLP runs silu(gate) * up over the merged output"
    # with the norms fused too, the layer's last add goes to down_proj (torch's add on the CPU)
    fused = copy.deepcopy(model)
    hf.fuse_norms(fused)
    assert torch.equal(fused(ids).logits, model(ids).logits)
    assert hf.unfuse_projections(model) == 7 * layers
    assert "forward" not in vars(mlp) and type(mlp.down_proj) is torch.nn.Linear
    assert type(attn.k_proj) is torch.nn.Linear
    assert type(model.model.layers[0].self_attn.k_proj) is torch.nn.Linear
    assert model.model.layers[0].self_attn.k_proj.weight.data_ptr() != 0 and set(model.state_dict()) == keys
    assert _rel(model(ids).logits, want) < 1e-2


@torch.no_grad()
def test_fused_projections_refuse_a_moved_model(models):
    model = copy.deepcopy(models[0])
    hf.fuse_projections(model)
    model.float()  # the slices' Parameters are cast, the merged storage is not
    with pytest.raises(ValueError, match="call hf.fuse_projections after moving the model"):
        model(torch.randint(0, VOCAB, (1, 4)))
    with pytest.raises(TypeError, match="model"):
        hf.fuse_projections("llama")
    with pytest.raises(ValueError, match="backend must be 'auto' or 'reference'"):
        hf.fuse_projections(model, backend="kernel")


@pytest.mark.gpu
@torch.no_grad()
def test_gpu_every_fusion_generates_like_the_plain_model():
    """Norms, rotary embedding and merged projections on the kernels (bf16, GPU) with the
    bitdecode cache: logits close to the plain model's, mostly the same greedy tokens, and a
    graph-captured decode step equal to the eager one."""
    _, packed = _models()
    packed = packed.cuda()
    fused = copy.deepcopy(packed)
    hf.fuse_norms(fused)
    hf.fuse_projections(fused)
    try:
        hf.fuse_rope(fused)
        _generates_like(fused, packed)
    finally:
        hf.restore_rope()


@pytest.mark.parametrize("family, module", [("mistral", "mistral"), ("qwen2", "qwen2"), ("qwen3", "qwen3"),
                                            ("smollm", "llama")])
@torch.no_grad()
def test_fuse_rope_on_the_model_families(family, module):
    """fuse_rope recognizes each family's apply_rotary_pos_emb as Llama's and patches that
    family's modeling module; on the CPU (torch's ops) the logits stay bit-identical."""
    base, _ = _family_models(family)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(4))
    want = base(ids).logits
    try:
        assert hf.fuse_rope(base) == [f"transformers.models.{module}.modeling_{module}"]
        assert torch.equal(base(ids).logits, want)
    finally:
        hf.restore_rope()
