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
    return [(base(x, **hf.cache_kwargs(base, c16), use_cache=True).logits,
             packed(x, **hf.cache_kwargs(packed, cbd), use_cache=True).logits) for x in blocks]


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
    out = [packed(x, **hf.cache_kwargs(packed, cbd), use_cache=True).logits for x in [ids, *steps.split(1, dim=1)]]
    assert calls == [True] * 6 and all(layer._pending is None for layer in cbd.layers)
    monkeypatch.setattr(hf, "decode", real)
    monkeypatch.setattr(hf.BitDecodingLayer, "take_pending", lambda self: self.flush())  # the two calls
    ref = _cache(packed, 4)  # (the model's attention modules follow the newest cache)
    want = [packed(x, **hf.cache_kwargs(packed, ref), use_cache=True).logits for x in [ids, *steps.split(1, dim=1)]]
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
    batched = packed.generate(ids, attention_mask=mask, **hf.cache_kwargs(packed, cache), max_new_tokens=4,
                              do_sample=False, output_logits=True, return_dict_in_generate=True)
    assert cache.layers[0].kv.lengths == [137 + 3, 200 + 3]  # pads were never stored
    alone = packed.generate(short, **hf.cache_kwargs(packed, _cache(packed, 4)), max_new_tokens=4, do_sample=False,
                            output_logits=True, return_dict_in_generate=True)
    for a, b in zip(batched.logits, alone.logits):
        assert _rel(a[0], b[0]) < 2e-2
    assert torch.equal(batched.sequences[0, -4:], alone.sequences[0, -4:])


@torch.no_grad()
def test_generate_agrees_with_the_16bit_cache(models):
    base, packed = models
    ids = torch.randint(0, VOCAB, (2, 160), generator=torch.Generator().manual_seed(3))
    g16 = base.generate(ids, max_new_tokens=8, do_sample=False)
    gbd = packed.generate(ids, **hf.cache_kwargs(packed, _cache(packed, 4)), max_new_tokens=8, do_sample=False)
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
    out_f = fused.generate(ids, **hf.cache_kwargs(fused, hf.BitDecodingCache(fused, fmt, max_seqlen=1024)),
                           max_new_tokens=8, do_sample=False)
    out_p = packed.generate(ids, **hf.cache_kwargs(packed, hf.BitDecodingCache(packed, fmt, max_seqlen=1024)),
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
    packed(torch.randint(0, VOCAB, (2, 150), generator=gen), **hf.cache_kwargs(packed, cbd), use_cache=True)
    packed(torch.randint(0, VOCAB, (2, 7), generator=gen), **hf.cache_kwargs(packed, cbd), use_cache=True)
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
    plain = packed.generate(ids, **hf.cache_kwargs(packed, _cache(packed, 4)), max_new_tokens=12, do_sample=False)
    cache = _cache(packed, 4)
    assisted = packed.generate(ids, **hf.cache_kwargs(packed, cache), assistant_model=assistant, max_new_tokens=12,
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
    out = packed.generate(ids, **hf.cache_kwargs(packed, hf.BitDecodingCache(packed, bd.KVFormat(bits=4, group_size=32),
                                                                   max_seqlen=512, backend="reference")),
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


def _pair(model_cls, config):
    """(16-bit SDPA model, the same weights with the bitdecode attention) of ``config``."""
    torch.manual_seed(0)
    cls = getattr(transformers, model_cls)
    base = cls._from_config(copy.deepcopy(config), attn_implementation="sdpa").to(torch.bfloat16).eval()
    packed = cls._from_config(copy.deepcopy(config), attn_implementation=hf.ATTN_IMPLEMENTATION)
    packed = packed.to(torch.bfloat16).eval()
    packed.load_state_dict(base.state_dict())
    return base, packed


def _state(cache):
    """What a refused call must leave as it was: transformers' length, each layer's lengths."""
    return cache.get_seq_length(), [layer.kv.lengths for layer in cache.layers]


@torch.no_grad()
def test_the_attention_follows_the_cache_the_forward_updates(models):
    """Two caches alive for one model (a server keeping one per conversation), used by
    turns: each forward attends over the cache it updates, not the one made last, so the
    older cache's logits equal those of a cache used alone.  A forward without a bitdecode
    cache beside a filled one (``use_cache=False``, a ``DynamicCache``) is plain SDPA:
    the 16-bit model's logits, bit for bit."""
    base, packed = models
    gen = torch.Generator().manual_seed(12)
    prompt, other = torch.randint(0, VOCAB, (2, 40), generator=gen), torch.randint(0, VOCAB, (2, 24), generator=gen)
    steps = torch.randint(0, VOCAB, (2, 3), generator=gen).split(1, dim=1)
    alone = _cache(packed, 4)
    want = [packed(x, **hf.cache_kwargs(packed, alone), use_cache=True).logits for x in [prompt, *steps]]
    older, newer = _cache(packed, 4), _cache(packed, 4)
    got = [packed(prompt, **hf.cache_kwargs(packed, older), use_cache=True).logits]
    # (turns: the newer cache between the older's steps)
    packed(other, **hf.cache_kwargs(packed, newer), use_cache=True)
    for x in steps:
        got.append(packed(x, **hf.cache_kwargs(packed, older), use_cache=True).logits)
        packed(x, **hf.cache_kwargs(packed, newer), use_cache=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert older.get_seq_length() == 43 and newer.get_seq_length() == 27
    assert [layer.kv.lengths for layer in older.layers] == [[43, 43]] * 2
    # beside the live caches: no cache, then a DynamicCache over a prompt and a step
    assert torch.equal(packed(other, use_cache=False).logits, base(other, use_cache=False).logits)
    before = _state(newer)
    for a, b in _feed(base, packed, transformers.DynamicCache(config=base.config),
                      transformers.DynamicCache(config=packed.config), [other, steps[0]]):
        assert torch.equal(a, b)
    assert _state(newer) == before  # the bitdecode caches were not touched


@torch.no_grad()
def test_beam_search_reorders_the_packed_cache(models):
    """Beam search calls ``reorder_cache`` after each step: greedy beam search (3 beams,
    all returned) on the bitdecode cache picks the same sequences as on transformers'
    ``DynamicCache``, with beam scores within the 4-bit format's error."""
    base, packed = models
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(3))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, num_beams=3, num_return_sequences=3,
              do_sample=False, return_dict_in_generate=True, output_scores=True)
    want = base.generate(ids, **kw)
    got = packed.generate(ids, **hf.cache_kwargs(packed, _cache(packed, 4)), **kw)
    assert got.sequences.shape == want.sequences.shape == (6, 46)
    agree = (got.sequences[:, 40:] == want.sequences[:, 40:]).float().mean().item()
    assert agree >= 0.9, agree
    assert _rel(got.sequences_scores, want.sequences_scores) < 1e-3


@torch.no_grad()
def test_reorder_cache_copies_the_source_sequences(models):
    """``reorder_cache(beam_idx)``: sequence ``i`` of every layer becomes a copy of sequence
    ``beam_idx[i]`` (packed blocks, residual tokens and length: the sequences here differ in
    length by their left pads), and later appends keep the copies apart."""
    _, packed = models
    gen = torch.Generator().manual_seed(13)
    ids = torch.randint(1, VOCAB, (3, 150), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :20], mask[2, :7] = 0, 0
    cache = _cache(packed, 4)
    packed(ids, attention_mask=mask, **hf.cache_kwargs(packed, cache), use_cache=True)
    mask = torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], 1)
    packed(torch.randint(0, VOCAB, (3, 1), generator=gen), attention_mask=mask, **hf.cache_kwargs(packed, cache),
           use_cache=True)
    before = [[layer.kv.dequantized(b) for b in range(3)] for layer in cache.layers]
    assert cache.layers[0].kv.lengths == [151, 131, 144]
    beam_idx = torch.tensor([2, 0, 0])
    cache.reorder_cache(beam_idx)
    assert cache.get_seq_length() == 151
    for layer, old in zip(cache.layers, before):
        assert layer.kv.lengths == [144, 151, 151]
        for b, src in enumerate(beam_idx.tolist()):
            k, v = layer.kv.dequantized(b)
            assert torch.equal(k, old[src][0]) and torch.equal(v, old[src][1])
    mask = torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], 1)
    packed(torch.tensor([[5], [6], [7]]), attention_mask=mask, **hf.cache_kwargs(packed, cache), use_cache=True)
    (k1, _), (k2, _) = cache.layers[0].kv.dequantized(1), cache.layers[0].kv.dequantized(2)
    assert torch.equal(k1[:151], k2[:151]) and not torch.equal(k1[151], k2[151])


@torch.no_grad()
def test_a_chunk_with_masked_positions_is_refused_and_changes_nothing(models):
    """After the first call the cache appends the same tokens to every sequence, so a
    later chunk whose mask hides some of its positions (a padded second turn, a chunked
    prefill of a left-padded batch) is refused before anything is stored: the length and
    every layer's lengths stay, and the next valid chunk computes what it would have."""
    _, packed = models
    gen = torch.Generator().manual_seed(14)
    prompt, chunk = torch.randint(1, VOCAB, (2, 30), generator=gen), torch.randint(1, VOCAB, (2, 5), generator=gen)
    ref = _cache(packed, 4)
    packed(prompt, **hf.cache_kwargs(packed, ref), use_cache=True)
    want = packed(chunk, **hf.cache_kwargs(packed, ref), use_cache=True).logits
    cache = _cache(packed, 4)
    packed(prompt, **hf.cache_kwargs(packed, cache), use_cache=True)
    before = _state(cache)
    mask = torch.ones(2, 35, dtype=torch.long)
    mask[1, 30:32] = 0  # sequence 1's turn is shorter: pads where it joins
    with pytest.raises(ValueError, match=r"masked \(padding\) positions"):
        packed(chunk, attention_mask=mask, **hf.cache_kwargs(packed, cache), use_cache=True)
    assert _state(cache) == before == (30, [[30, 30]] * 2)
    assert torch.equal(packed(chunk, **hf.cache_kwargs(packed, cache), use_cache=True).logits, want)
    # generate's chunked prefill of a left-padded batch: the second chunk has pads in sequence 1
    ids = torch.randint(1, VOCAB, (2, 40), generator=gen)
    mask = torch.ones_like(ids)
    ids[1, :20], mask[1, :20] = 0, 0
    cache = _cache(packed, 4)
    with pytest.raises(ValueError, match=r"masked \(padding\) positions"):
        packed.generate(ids, attention_mask=mask, **hf.cache_kwargs(packed, cache), prefill_chunk_size=16,
                        max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert _state(cache) == (16, [[16, 0]] * 2)


@torch.no_grad()
def test_a_refused_step_leaves_the_cache_as_it_was(models):
    """A decode step the cache refuses (past ``max_seqlen``; a batch that is not the
    cache's) raises without advancing the position transformers reads
    (``get_seq_length``: the next step's RoPE position), so the next valid step's logits
    equal those of a cache that never saw the refused call."""
    _, packed = models
    gen = torch.Generator().manual_seed(15)
    prompt, steps = torch.randint(0, VOCAB, (2, 40), generator=gen), torch.randint(0, VOCAB, (2, 2), generator=gen)
    full = hf.BitDecodingCache(packed, bd.KVFormat(bits=4, group_size=64), max_seqlen=40, backend="reference")
    packed(prompt, **hf.cache_kwargs(packed, full), use_cache=True)
    with pytest.raises(ValueError, match="max_seqlen"):
        packed(steps[:, :1], **hf.cache_kwargs(packed, full), use_cache=True)
    assert _state(full) == (40, [[40, 40]] * 2)
    ref, cache = _cache(packed, 4), _cache(packed, 4)
    want = [packed(x, **hf.cache_kwargs(packed, ref), use_cache=True).logits
            for x in [prompt, steps[:, :1], steps[:, 1:]]]
    packed(prompt, **hf.cache_kwargs(packed, cache), use_cache=True)
    with pytest.raises(ValueError, match="shape"):
        packed(steps[:1, :1], **hf.cache_kwargs(packed, cache), use_cache=True)  # one sequence of the two
    assert _state(cache) == (40, [[40, 40]] * 2)
    got = [packed(x, **hf.cache_kwargs(packed, cache), use_cache=True).logits for x in [steps[:, :1], steps[:, 1:]]]
    assert torch.equal(got[0], want[1]) and torch.equal(got[1], want[2])


def _sliding_config(config_cls, **kw):
    return getattr(transformers, config_cls)(**(dict(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=4096) | kw))


@torch.no_grad()
def test_sequences_past_a_sliding_window_are_refused():
    """The cache keeps every token, so a layer attending over a sliding window computes
    the model's attention only within the window: a Mistral model with a 32-token window
    runs (prefill logits equal SDPA's) up to 32 tokens and refuses the step past it;
    with ``sliding_window=None`` it runs on.  Where ``layer_types`` mixes full and sliding
    layers (Qwen2, ``max_window_layers``), only the sliding layers count."""
    base, packed = _pair("MistralForCausalLM", _sliding_config("MistralConfig", sliding_window=32))
    gen = torch.Generator().manual_seed(16)
    prompt, steps = torch.randint(0, VOCAB, (1, 30), generator=gen), torch.randint(0, VOCAB, (1, 3), generator=gen)
    cache = _cache(packed, 4)
    assert torch.equal(packed(prompt, **hf.cache_kwargs(packed, cache), use_cache=True).logits, base(prompt).logits)
    packed(steps[:, :1], **hf.cache_kwargs(packed, cache), use_cache=True)
    packed(steps[:, 1:2], **hf.cache_kwargs(packed, cache), use_cache=True)
    with pytest.raises(ValueError, match="sliding window of 32 tokens"):
        packed(steps[:, 2:], **hf.cache_kwargs(packed, cache), use_cache=True)
    assert cache.get_seq_length() == 32
    _, unwindowed = _pair("MistralForCausalLM", _sliding_config("MistralConfig", sliding_window=None))
    cache = _cache(unwindowed, 4)
    unwindowed(torch.cat([prompt, prompt], 1), **hf.cache_kwargs(unwindowed, cache), use_cache=True)
    unwindowed(steps[:, :1], **hf.cache_kwargs(unwindowed, cache), use_cache=True)
    assert cache.get_seq_length() == 61
    # Qwen2 with use_sliding_window: layer 0 full, layer 1 sliding (max_window_layers=1)
    mixed = _sliding_config("Qwen2Config", use_sliding_window=True, sliding_window=32, max_window_layers=1)
    assert mixed.layer_types == ["full_attention", "sliding_attention"]
    _, packed = _pair("Qwen2ForCausalLM", mixed)
    cache = _cache(packed, 4)
    with pytest.raises(ValueError, match="layer 1 attends over a sliding window"):
        packed(torch.cat([prompt, prompt], 1), **hf.cache_kwargs(packed, cache), use_cache=True)
    # refused at layer 0 (full attention), before it stored the prompt: no layer holds it
    assert cache.get_seq_length() == 0 and all(layer.kv is None or layer.kv.lengths == [0] for layer in cache.layers)
    packed(prompt, **hf.cache_kwargs(packed, cache), use_cache=True)
    packed(steps[:, :2], **hf.cache_kwargs(packed, cache), use_cache=True)
    before = _state(cache)
    with pytest.raises(ValueError, match="layer 1 attends over a sliding window"):
        packed(steps[:, 2:], **hf.cache_kwargs(packed, cache), use_cache=True)
    assert _state(cache) == before == (32, [[32], [32]])  # the step refused by every layer alike
    full = _sliding_config("Qwen2Config", use_sliding_window=True, sliding_window=32, max_window_layers=2)
    assert full.layer_types == ["full_attention"] * 2  # a window in the config, but no layer slides
    _, packed = _pair("Qwen2ForCausalLM", full)
    cache = _cache(packed, 4)
    packed(torch.cat([prompt, prompt], 1), **hf.cache_kwargs(packed, cache), use_cache=True)
    assert cache.get_seq_length() == 60


def test_the_cache_refuses_what_it_cannot_compute_or_hold(models):
    """Refused when the cache is made, not at the first forward (or never): a model that
    soft-caps its attention logits (Gemma 2) or has attention sinks (GPT-OSS), whose
    attention the bitdecode function does not compute, and a ``max_seqlen``,
    ``page_size`` or ``backend`` that the layers' caches would refuse, each error naming
    its argument."""
    small = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=64)
    fmt = bd.KVFormat(bits=4, group_size=64)
    gemma2 = transformers.Gemma2Config(**small)
    assert gemma2.attn_logit_softcapping is not None
    model = transformers.Gemma2ForCausalLM._from_config(gemma2, attn_implementation=hf.ATTN_IMPLEMENTATION).half()
    with pytest.raises(ValueError, match="soft-caps its attention logits"):
        hf.BitDecodingCache(model, fmt, backend="reference")
    model.config.attn_logit_softcapping = None  # the same model without soft-capping is served
    hf.BitDecodingCache(model, fmt, backend="reference")
    if hasattr(transformers, "GptOssConfig"):
        config = transformers.GptOssConfig(**small, num_local_experts=2, num_experts_per_tok=1)
        model = transformers.GptOssForCausalLM._from_config(config, attn_implementation=hf.ATTN_IMPLEMENTATION)
        with pytest.raises(ValueError, match="sinks"):
            hf.BitDecodingCache(model, fmt, backend="reference")
    _, packed = models
    for value, error in ((0, ValueError), (-5, ValueError), ("10", TypeError), (10.0, TypeError)):
        with pytest.raises(error, match="max_seqlen"):
            hf.BitDecodingCache(packed, fmt, max_seqlen=value, backend="reference")
    for value, error in ((fmt.residual_block + 64, ValueError), (0, ValueError), ("128", TypeError)):
        with pytest.raises(error, match="page_size"):
            hf.BitDecodingCache(packed, fmt, page_size=value, backend="reference")
    with pytest.raises(ValueError, match="backend"):
        hf.BitDecodingCache(packed, fmt, backend="bogus")
    # the format's groups wider than the model's head dim (KVFormat's default g128 on a
    # head dim of 64, as SmolLM2's): refused here, not inside the first generate
    with pytest.raises(ValueError, match="group_size=128 .* must not exceed the model's head_dim=64"):
        hf.BitDecodingCache(packed, bd.KVFormat(bits=4), backend="reference")
    hf.BitDecodingCache(packed, fmt, max_seqlen=512, page_size=2 * fmt.residual_block, backend="reference")


@torch.no_grad()
def test_crop_takes_an_int_only(models):
    """``crop``'s count is an int (or a 0-d tensor, as older transformers pass it): a
    float or a str is a TypeError naming it (``int()`` truncated 1.5 to 1, keeping one
    token), and the cache is left as it was."""
    _, packed = models
    cache = _cache(packed, 4)
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(17))
    packed(ids, **hf.cache_kwargs(packed, cache), use_cache=True)
    for bad in (1.5, "x", True):
        with pytest.raises(TypeError, match="tokens_to_remove"):
            cache.crop(bad)
        assert _state(cache) == (20, [[20, 20]] * 2)
    cache.crop(torch.tensor(-3))
    assert _state(cache) == (17, [[17, 17]] * 2)


def test_fused_checks_its_arguments_before_fusing(models):
    """``fused`` (and ``fuse_norms``) refuse a bad backend or projections argument before
    anything is fused: no FusedRMSNorm or merged projection in the model afterwards, and
    no modeling module's rotary embedding patched."""
    from transformers.models.llama import modeling_llama

    model = copy.deepcopy(models[0])
    rope_before, rope_fn = dict(hf._ROPE_ORIGINALS), modeling_llama.apply_rotary_pos_emb
    try:
        for kw, match in ((dict(projections="kernel"), "projections"), (dict(backend="bogus"), "backend")):
            with pytest.raises(ValueError, match=match):
                with hf.fused(model, **kw):
                    pass
            assert not any(isinstance(m, (hf.FusedRMSNorm, hf.ProjectionSlice, hf.Projection))
                           for m in model.modules()), kw
            assert not any("forward" in vars(m) for m in model.modules()), kw
            assert hf._ROPE_ORIGINALS == rope_before and modeling_llama.apply_rotary_pos_emb is rope_fn, kw
        with pytest.raises(ValueError, match="backend"):
            hf.fuse_norms(model, backend="bogus")
        assert not any(isinstance(m, hf.FusedRMSNorm) for m in model.modules())
    finally:  # (nothing to undo where the checks hold)
        hf.restore_rope(set(hf._ROPE_ORIGINALS) - set(rope_before))


@pytest.mark.parametrize("check", [True, False])
@torch.no_grad()
def test_compiled_decode_steps_then_an_eager_step(models, check):
    """Decode steps through ``torch.compile`` (aot_eager: the cache's custom ops, no
    CUDA) append on the device only; ``check()`` then sets each layer's position from the
    device's lengths (not the growth added on top of what the compiled steps counted), so
    ``get_seq_length`` is the true length; with or without ``check()`` a following eager
    step (which catches the host's lengths up first) computes an all-eager run's logits."""
    _, packed = models
    gen = torch.Generator().manual_seed(18)
    prompt, steps = torch.randint(0, VOCAB, (2, 30), generator=gen), torch.randint(0, VOCAB, (2, 3), generator=gen)
    blocks = [prompt, *steps.split(1, dim=1)]
    ref = _cache(packed, 4)
    want = [packed(x, **hf.cache_kwargs(packed, ref), use_cache=True).logits for x in blocks]
    cache = _cache(packed, 4)
    packed(prompt, **hf.cache_kwargs(packed, cache), use_cache=True)  # eager prefill (binds the cache)
    torch._dynamo.reset()
    try:
        forward = torch.compile(packed.forward, backend="aot_eager")
        for i in (1, 2):
            assert _rel(forward(blocks[i], **hf.cache_kwargs(packed, cache), use_cache=True).logits, want[i]) < 1e-3
    finally:
        torch._dynamo.reset()
    if check:
        cache.check()
        assert _state(cache) == (32, [[32, 32]] * 2)
    assert cache.get_seq_length() == 32
    assert torch.equal(packed(blocks[3], **hf.cache_kwargs(packed, cache), use_cache=True).logits, want[3])
    assert _state(cache) == (33, [[33, 33]] * 2)


def test_a_refused_held_token_is_not_counted():
    """``update`` holds an eager step's K / V for the attention call; a reader of the cache
    before it (``kv``) appends them, and a refused append (a shard of another head count)
    takes back the tokens ``update`` counted, so the layer's length stays the cache's."""
    from bitdecode.hf import BitDecodingLayer

    layer = BitDecodingLayer(bd.KVFormat(bits=4, group_size=64), 256, None, "reference")
    k = torch.randn(1, 2, 5, 64, dtype=torch.float16)
    layer.update(k, k)
    layer.store_prompt(k, k, None)
    bad = torch.randn(1, 1, 1, 64, dtype=torch.float16)  # one KV head of the cache's two
    layer.update(bad, bad)
    with pytest.raises(ValueError, match=r"k must have shape \(1, \*, 2, 64\)"):
        layer.kv
    good = torch.randn(1, 2, 1, 64, dtype=torch.float16)
    layer.update(good, good)
    assert layer.get_seq_length() == 6 and layer.kv.lengths == [6]


# --------------------------------------------------------------------------------------
# A helper's audit (sixtieth session): where the cache's attention could read the wrong
# cache, or none, without an error
# --------------------------------------------------------------------------------------


@torch.no_grad()
def test_a_deep_copy_serves_the_same_model(models):
    """transformers' prompt reuse: a cache filled with a shared prefix, ``copy.deepcopy``'d
    per request.  The copy's forwards attend over the copy (the key ``update`` returns says
    which cache), its layers are its own, and the model's modules are not copied."""
    _, packed = models
    gen = torch.Generator().manual_seed(21)
    prefix, steps = torch.randint(0, VOCAB, (1, 30), generator=gen), torch.randint(0, VOCAB, (1, 3), generator=gen)
    shared = _cache(packed, 4)
    packed(prefix, **hf.cache_kwargs(packed, shared), use_cache=True)
    copied = copy.deepcopy(shared)
    assert copied._ref() is copied and copied._attention_modules[0][0] is shared._attention_modules[0][0]
    got = [packed(x, **hf.cache_kwargs(packed, copied), use_cache=True).logits for x in steps.split(1, dim=1)]
    fresh = _cache(packed, 4)
    want = [packed(x, **hf.cache_kwargs(packed, fresh), use_cache=True).logits
            for x in [prefix, *steps.split(1, dim=1)]][1:]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert copied.get_seq_length() == 33 and shared.get_seq_length() == 30
    assert [layer.kv.lengths for layer in shared.layers] == [[30]] * 2


@torch.no_grad()
def test_another_instance_of_the_model_reads_the_cache_it_updates(models):
    """A cache made for one model instance, used with another of the same architecture
    (the key tensor, not the modules, names the cache): the same logits as a cache made
    for it."""
    base, packed = models
    _, twin = _pair("LlamaForCausalLM", packed.config)
    twin.load_state_dict(packed.state_dict())
    gen = torch.Generator().manual_seed(22)
    prompt, steps = torch.randint(0, VOCAB, (1, 20), generator=gen), torch.randint(0, VOCAB, (1, 3), generator=gen)
    blocks = [prompt, *steps.split(1, dim=1)]
    foreign, own = _cache(packed, 4), _cache(twin, 4)
    got = [twin(x, **hf.cache_kwargs(twin, foreign), use_cache=True).logits for x in blocks]
    want = [twin(x, **hf.cache_kwargs(twin, own), use_cache=True).logits for x in blocks]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert [layer.kv.lengths for layer in foreign.layers] == [[23]] * 2


@torch.no_grad()
def test_an_attention_that_would_not_read_the_cache_is_refused():
    """``update`` returns only the new tokens: any attention but bitdecode's would attend
    over those alone.  The model switched to SDPA after the cache was made is refused at
    its next step, before the cache takes the token, and runs on once switched back."""
    _, packed = _pair("LlamaForCausalLM", _sliding_config("LlamaConfig"))
    gen = torch.Generator().manual_seed(23)
    prompt, steps = torch.randint(0, VOCAB, (1, 20), generator=gen), torch.randint(0, VOCAB, (1, 2), generator=gen)
    cache = _cache(packed, 4)
    packed(prompt, **hf.cache_kwargs(packed, cache), use_cache=True)
    hf.use_attention(packed, "sdpa")
    with pytest.raises(ValueError, match="attn_implementation='sdpa', which would attend over the new tokens only"):
        packed(steps[:, :1], **hf.cache_kwargs(packed, cache), use_cache=True)
    assert _state(cache) == (20, [[20], [20]])
    hf.use_attention(packed, hf.ATTN_IMPLEMENTATION)
    packed(steps[:, :1], **hf.cache_kwargs(packed, cache), use_cache=True)
    assert _state(cache) == (21, [[21], [21]])


def test_a_forward_whose_attention_skipped_the_cache_is_reported():
    """The last forward's update returned the new tokens and no bitdecode attention took
    them (another model's attention, a forward that stopped between the two): the next
    update says so instead of attending over a cache the last output never read."""
    _, packed = _pair("LlamaForCausalLM", _sliding_config("LlamaConfig"))
    cache = _cache(packed, 4)
    k = torch.randn(1, 2, 5, 64).to(torch.bfloat16)
    cache.update(k, k, 0)
    with pytest.raises(ValueError, match="layer 0: the last forward's attention did not read this cache"):
        cache.update(k, k, 0)
    cache.update(k, k, 0)  # (said once)


@torch.no_grad()
def test_llama4_chunked_attention_is_refused_past_a_chunk():
    """Llama 4's ``"chunked_attention"`` layers attend within chunks of
    ``attention_chunk_size`` tokens: the model's attention only while the sequence fits
    one, so the step past it is refused as a sliding window's is."""
    if not hasattr(transformers, "Llama4TextConfig"):
        pytest.skip("this transformers has no Llama 4")
    cfg = transformers.Llama4TextConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=128,
                                        intermediate_size_mlp=128, num_hidden_layers=2, num_attention_heads=2,
                                        num_key_value_heads=1, head_dim=64, num_local_experts=2,
                                        attention_chunk_size=16, no_rope_layers=[1, 0], interleave_moe_layer_step=1,
                                        pad_token_id=0)
    assert "chunked_attention" in cfg.layer_types
    base, packed = _pair("Llama4ForCausalLM", cfg)
    cache = _cache(packed, 4)
    ids = torch.randint(3, VOCAB, (1, 16), generator=torch.Generator().manual_seed(24))
    assert torch.equal(packed(ids, **hf.cache_kwargs(packed, cache), use_cache=True).logits, base(ids).logits)
    with pytest.raises(ValueError, match=r"attends over chunks of 16 tokens .* 17 tokens long"):
        packed(ids[:, :1], **hf.cache_kwargs(packed, cache), use_cache=True)
    assert cache.get_seq_length() == 16


@torch.no_grad()
def test_reset_then_another_batch(models):
    """``reset()`` then a generation of another batch size (beam search after greedy): the
    layers' caches are made anew for it, as transformers' own caches allow."""
    base, packed = models
    ids = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(25))
    cache = _cache(packed, 4)
    packed.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False,
                    **hf.cache_kwargs(packed, cache))
    cache.reset()
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=3, num_beams=2, do_sample=False)
    got = packed.generate(ids, **hf.cache_kwargs(packed, cache), **kw)
    assert torch.equal(got, base.generate(ids, **kw))  # (under the residual block: nothing quantized)
    assert [layer.kv.batch for layer in cache.layers] == [2, 2]


@torch.no_grad()
def test_pads_past_the_longest_prompt_take_no_room(models):
    """Prompts left-padded to a fixed length longer than ``max_seqlen``: the pads are not
    stored, so prompts that fit are served."""
    base, packed = models
    gen = torch.Generator().manual_seed(26)
    ids = torch.randint(1, VOCAB, (2, 30), generator=gen)
    mask = torch.zeros_like(ids)
    mask[0, -10:], mask[1, -12:] = 1, 1
    cache = hf.BitDecodingCache(packed, bd.KVFormat(bits=4, group_size=64), max_seqlen=20, backend="reference")
    got = packed.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, **hf.cache_kwargs(packed, cache))
    want = base.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, want)
    assert [layer.kv.lengths for layer in cache.layers] == [[13, 15]] * 2


def test_the_cache_refuses_a_float32_model(models):
    _, packed = models
    model = transformers.LlamaForCausalLM._from_config(copy.deepcopy(packed.config),
                                                       attn_implementation=hf.ATTN_IMPLEMENTATION)
    with pytest.raises(TypeError, match="model's dtype must be torch.float16 or torch.bfloat16"):
        _cache(model, 4)
    _cache(model.half(), 4)


@torch.no_grad()
def test_batch_select_and_repeat_copy_the_packed_sequences(models):
    """``batch_repeat_interleave`` / ``batch_select_indices`` (contrastive search): each
    layer becomes a cache of the new batch whose sequences are copies of the chosen ones,
    packed blocks included, so the next steps equal those of a cache filled with the
    repeated (selected) prompts."""
    _, packed = models
    gen = torch.Generator().manual_seed(27)
    prompts, step = torch.randint(0, VOCAB, (2, 150), generator=gen), torch.randint(0, VOCAB, (4, 1), generator=gen)
    cache = _cache(packed, 4)
    packed(prompts, **hf.cache_kwargs(packed, cache), use_cache=True)
    cache.batch_repeat_interleave(2)
    want_cache = _cache(packed, 4)
    packed(prompts.repeat_interleave(2, dim=0), **hf.cache_kwargs(packed, want_cache), use_cache=True)
    got = packed(step, **hf.cache_kwargs(packed, cache), use_cache=True).logits
    assert torch.equal(got, packed(step, **hf.cache_kwargs(packed, want_cache), use_cache=True).logits)
    cache.batch_select_indices(torch.tensor([3, 0]))
    fresh = _cache(packed, 4)
    packed(prompts[[1, 0]], **hf.cache_kwargs(packed, fresh), use_cache=True)
    packed(step[[3, 0]], **hf.cache_kwargs(packed, fresh), use_cache=True)
    nxt = torch.randint(0, VOCAB, (2, 1), generator=gen)
    got = packed(nxt, **hf.cache_kwargs(packed, cache), use_cache=True).logits
    assert torch.equal(got, packed(nxt, **hf.cache_kwargs(packed, fresh), use_cache=True).logits)
    assert [layer.kv.lengths for layer in cache.layers] == [[152, 152]] * 2
    with pytest.raises(ValueError, match="repeats"):
        cache.batch_repeat_interleave(0)


@torch.no_grad()
def test_a_decode_that_fails_after_its_append_keeps_the_position(models, monkeypatch):
    """A decode step whose attention call fails after the token was appended (a first-use
    compile, an out-of-memory) counts the token: the position stays the cache's length."""
    from bitdecode.cache import KVCache

    _, packed = models
    gen = torch.Generator().manual_seed(1)
    cache = _cache(packed, 4)
    packed(torch.randint(0, VOCAB, (1, 20), generator=gen), **hf.cache_kwargs(packed, cache), use_cache=True)

    def fails(self, *args, **kwargs):
        raise RuntimeError("decode failed")

    monkeypatch.setattr(KVCache, "decode", fails)
    with pytest.raises(RuntimeError, match="decode failed"):
        packed(torch.randint(0, VOCAB, (1, 1), generator=gen), **hf.cache_kwargs(packed, cache), use_cache=True)
    layer = cache.layers[0]
    assert layer.get_seq_length() == layer.kv.lengths[0] + layer.pad_offset


@torch.no_grad()
def test_check_keeps_the_pads_of_a_batch_padded_everywhere(models):
    """``check()`` rebuilds the position from the device lengths plus the prompt's pads: a
    batch whose every sequence was left-padded keeps its 30 positions (not the longest
    sequence's 12)."""
    _, packed = models
    ids = torch.randint(1, VOCAB, (2, 30), generator=torch.Generator().manual_seed(26))
    mask = torch.zeros_like(ids)
    mask[0, -10:], mask[1, -12:] = 1, 1
    cache = _cache(packed, 4)
    packed(ids, attention_mask=mask, **hf.cache_kwargs(packed, cache), use_cache=True)
    assert cache.get_seq_length() == 30
    cache.check()
    assert cache.get_seq_length() == 30


@torch.no_grad()
def test_a_refused_prompt_leaves_the_cache_empty(models):
    """A prompt past ``max_seqlen`` is refused and not counted: the next prompt starts at
    position 0 (its logits are the 16-bit model's), not as a chunk after 30 phantom tokens."""
    base, packed = models
    gen = torch.Generator().manual_seed(3)
    cache = hf.BitDecodingCache(packed, bd.KVFormat(bits=4, group_size=64), max_seqlen=20, backend="reference")
    with pytest.raises(ValueError):
        packed(torch.randint(0, VOCAB, (1, 30), generator=gen), **hf.cache_kwargs(packed, cache), use_cache=True)
    assert cache.get_seq_length() == 0
    ids = torch.randint(0, VOCAB, (1, 10), generator=gen)
    assert torch.equal(packed(ids, **hf.cache_kwargs(packed, cache), use_cache=True).logits, base(ids).logits)


@torch.no_grad()
def test_an_additive_4d_mask_drops_the_pads(models):
    """A float mask (0 where allowed, the dtype's minimum where not), as a caller may pass
    instead of the boolean one: the pads it hides are not stored."""
    _, packed = models
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(4))
    valid = torch.ones(2, 12, dtype=torch.bool)
    valid[1, :4] = False
    allowed = torch.tril(torch.ones(12, 12, dtype=torch.bool))[None] & valid[:, None, :]
    allowed |= torch.eye(12, dtype=torch.bool)[None]  # (a pad row sees itself: no row fully masked)
    mask = torch.zeros(2, 1, 12, 12, dtype=torch.bfloat16).masked_fill(~allowed[:, None], torch.finfo(torch.bfloat16).min)
    cache = _cache(packed, 4)
    packed(ids, attention_mask=mask, **hf.cache_kwargs(packed, cache), use_cache=True)
    assert cache.layers[0].kv.lengths == [12, 8]
