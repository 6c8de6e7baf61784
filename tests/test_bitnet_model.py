"""``bd.bitnet.convert`` on a tiny random transformers ``BitNetForCausalLM`` (CPU reference
path; the ``gpu`` test runs the kernels).

What transformers computes: a ``BitNetForCausalLM`` built from a ``BitNetConfig`` has plain
``nn.Linear`` layers (no quantization at all); it is W1.58A8 only when its linears are
swapped by the BitNet quantizer.  The reference here is that quantizer's online
``AutoBitLinear`` (``replace_with_bitnet_linear``, ``quantization_mode="online"``):
``WeightQuant`` (ternary, ``mean|W|`` per tensor) and ``ActQuant`` (int8, ``127 / max|x|``
per token), fake-quantized, then ``F.linear``.  bitdecode computes the same integers and
scales exactly and rounds each linear's output once to bf16 (the kernels' output), so:

* per layer: the converted output equals transformers' ``AutoBitLinear`` output (run in
  float64) rounded to bf16, except where float rounding lands next to a bf16 tie (one
  bf16 ulp);
* per model: the logits are within 1e-2 (relative) of transformers' model run in float64
  with each linear's output rounded to bf16, and closer to transformers' fp32 forward than
  transformers' own bf16 run of the same model is.  (The W2A8 error itself, the
  quantized model against the float one, is ~100% of the logits on a random model: no
  usable tolerance.)  Residual differences come from int8 roundings flipped by the
  last-bit differences, which the layers amplify;
* greedy tokens agree with transformers' (bf16-rounded) forward and, through
  ``bitdecode.hf.BitDecodingCache``, with the 16-bit cache;
* fusing q/k/v and gate/up changes no bit (same activation quantization, same integer
  sums, each row scaled by its own segment's scale).

transformers' BitNet functions are wrapped in ``torch.compile``; the tests run them with
dynamo disabled (the same maths, eager; compiling them costs ~20 s on the CPU).
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import torch._dynamo  # noqa: E402
from transformers.integrations import bitnet as hf_bitnet  # noqa: E402

import bitdecode as bd  # noqa: E402
from bitdecode import bitnet as bn  # noqa: E402
from bitdecode import hf  # noqa: E402

VOCAB = 128
LAYERS = 2
PROJ_GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("self_attn", ("o_proj",)),
               ("mlp", ("gate_proj", "up_proj")), ("mlp", ("down_proj",)))


@pytest.fixture(autouse=True)
def _eager_transformers_bitnet():
    with torch._dynamo.config.patch(disable=True):
        yield


def _config(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=LAYERS,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                bos_token_id=None, eos_token_id=None, pad_token_id=0)
    base.update(kw)
    return transformers.BitNetConfig(**base)


def _float_model(seed=0, dtype=torch.float32, device="cpu", **kw):
    torch.manual_seed(seed)
    return transformers.BitNetForCausalLM(_config(**kw)).to(device=device, dtype=dtype).eval()


@torch.no_grad()
def _hf_quantized(model, **qkw):
    """transformers' own W1.58A8 BitNet: its quantizer's linear swap, the same weights."""
    q = copy.deepcopy(model)
    cfg = transformers.BitNetQuantConfig(**({"linear_class": "autobitlinear", "quantization_mode": "online"} | qkw))
    hf_bitnet.replace_with_bitnet_linear(q, modules_to_not_convert=["lm_head"], quantization_config=cfg)
    for m in q.modules():  # the swap builds some layers (all of them in 5.17) on the meta device
        if any(t.is_meta for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]):
            m.to_empty(device=model.device, recurse=False)
    for m in q.modules():
        if getattr(m, "rms_norm", None) is not None:
            m.rms_norm.weight.fill_(1.0)
    mine = q.state_dict()  # packed layers' weights have other shapes: filled by the caller
    q.load_state_dict({k: v for k, v in model.state_dict().items() if mine[k].shape == v.shape}, strict=False)
    return q.eval()


def _round_outputs_to_bf16(model):
    """Round every transformers BitNet linear's output to bf16 (what bitdecode's
    kernels emit), in the model's dtype."""
    for m in model.modules():
        if isinstance(m, (hf_bitnet.AutoBitLinear, hf_bitnet.BitLinear)):
            m.register_forward_hook(lambda mod, inp, out: out.to(torch.bfloat16).to(out.dtype))
    return model


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="module")
def fp32():
    """(float model, transformers' quantized model, converted model), fp32."""
    fl = _float_model()
    with torch._dynamo.config.patch(disable=True):
        return fl, _hf_quantized(fl), bn.convert(copy.deepcopy(fl), backend="reference")


def _ids(seed, batch=2, length=16):
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------------------
# Structure
# --------------------------------------------------------------------------------------


def test_convert_structure(fp32):
    _, _, conv = fp32
    assert isinstance(conv.lm_head, torch.nn.Linear) and conv.lm_head.weight.dtype == torch.float32
    assert isinstance(conv.model.embed_tokens, torch.nn.Embedding)
    for layer in conv.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        assert attn.qkv_proj.segments == (128, 64, 64) and attn.qkv_proj.weight_scale.shape == (3,)
        assert mlp.gate_up_proj.segments == (256, 256)
        assert isinstance(attn.o_proj, bn.BitLinear) and isinstance(mlp.down_proj, bn.BitLinear)
        for name, start, stop in (("q_proj", 0, 128), ("k_proj", 128, 192), ("v_proj", 192, 256)):
            s = getattr(attn, name)
            assert isinstance(s, bn.FusedSlice) and s.fused is attn.qkv_proj and (s.start, s.stop) == (start, stop)
        # the four norms in front of linear layers carry their output's quantization, with
        # the same weight Parameter; the final norm (before lm_head) stays transformers'
        for norm in (layer.input_layernorm, layer.post_attention_layernorm, attn.attn_sub_norm, mlp.ffn_sub_norm):
            assert isinstance(norm, bn.RMSNormQuant) and norm.variance_epsilon == conv.config.rms_norm_eps
        # the MLP: relu^2(gate) * up made by the ffn_sub_norm kernel from the fused output
        assert isinstance(mlp, bn.FusedMLP) and mlp.ffn_sub_norm.gated and not attn.attn_sub_norm.gated
    assert isinstance(conv.model.norm, transformers.models.bitnet.modeling_bitnet.BitNetRMSNorm)
    assert "model.layers.0.mlp.ffn_sub_norm.weight" in conv.state_dict()
    assert not any(isinstance(m, torch.nn.Linear) for n, m in conv.named_modules() if n != "lm_head")
    # the fused layer is registered once (on the attention / MLP), not under each slice
    keys = conv.state_dict().keys()
    assert "model.layers.0.self_attn.qkv_proj.weight_packed" in keys
    assert not any("q_proj" in k for k in keys)
    with pytest.raises(ValueError, match="model already holds bitdecode layers"):  # (a second backend would mix)
        bn.convert(conv)
    twin = copy.deepcopy(conv)  # a copy shares its fused layer between the slices as well
    assert twin.model.layers[1].self_attn.v_proj.fused is twin.model.layers[1].self_attn.qkv_proj
    assert twin.model.layers[1].mlp.up_proj._memo is twin.model.layers[1].mlp.gate_proj._memo


def test_weights_are_transformers_ternary_and_scales(fp32):
    """The packed weights hold transformers' ``WeightQuant`` ternary values, one scale per
    projection (its per-tensor ``mean|W|``), in microsoft/BitNet's int2 layout."""
    fl, _, conv = fp32
    for i in range(LAYERS):
        for parent, names in PROJ_GROUPS:
            src = [getattr(getattr(fl.model.layers[i], parent), n).weight.detach() for n in names]
            deq = [hf_bitnet.WeightQuant.apply(w) for w in src]  # ternary / (1 / mean|W|), fp32
            mod = getattr(getattr(conv.model.layers[i], parent), names[0])
            layer = mod.fused if isinstance(mod, bn.FusedSlice) else mod
            assert torch.equal(bn.unpack_weight(layer.weight_packed), torch.cat([d.sign() for d in deq]).to(torch.int8))
            want = torch.stack([d.abs().max() for d in deq])
            torch.testing.assert_close(layer.weight_scale, want, rtol=2.0**-22, atol=0)
            wq, ws = bn.quantize_weight(torch.cat(src), tuple(w.shape[0] for w in src) if len(src) > 1 else None)
            assert torch.equal(layer.weight_packed, bn.pack_weight(wq)) and torch.equal(layer.weight_scale, ws)


# --------------------------------------------------------------------------------------
# Numerics against transformers' BitNet forward
# --------------------------------------------------------------------------------------


@torch.no_grad()
def test_each_layer_is_transformers_output_rounded_to_bf16(fp32):
    _, hfq, conv = fp32
    hf64 = copy.deepcopy(hfq).double()
    gen = torch.Generator().manual_seed(3)
    total = exact = 0
    for i in range(LAYERS):
        for parent, names in PROJ_GROUPS:
            mine, theirs = getattr(conv.model.layers[i], parent), getattr(hf64.model.layers[i], parent)
            k = getattr(theirs, names[0]).in_features
            x = torch.randn(2, 5, k, generator=gen) * 3
            for name in names:
                got = getattr(mine, name)(x)
                hf_layer = getattr(theirs, name)
                want = hf_layer(x.double()).to(torch.bfloat16).float()
                assert got.dtype == torch.float32 and got.shape == want.shape
                # transformers multiplies fp32-rounded q / s and t / (1 / mean|W|): each term
                # off by <= 2^-23 of itself, so its sum by <= 2^-23 * sum |terms| (mag)
                mag = x.double().abs() @ hf_bitnet.WeightQuant.apply(hf_layer.weight.float()).double().abs().t()
                diff = (got - want).abs()
                bound = want.abs() * 2.0**-7 + mag.float() * 2.0**-21  # one bf16 ulp + that slack
                assert bool((diff <= bound).all()), (i, name, diff.max())
                # the differences seen: integer sums of 0, where bitdecode gives an exact 0
                # and transformers its rounding noise (~1e-8)
                cancel = (got == 0) & (want.abs() <= mag.float() * 2.0**-21)
                total += int((~cancel).sum())
                exact += int(((diff == 0) & ~cancel).sum())
    assert exact >= 0.999 * total, (exact, total)


@torch.no_grad()
def test_logits_match_transformers_bitnet(fp32):
    fl, hfq, conv = fp32
    ids = _ids(1)
    got = conv(ids).logits
    ref64 = _round_outputs_to_bf16(copy.deepcopy(hfq).double())(ids).logits
    assert _rel(got, ref64) < 1e-2, _rel(got, ref64)
    theirs32 = hfq(ids).logits
    theirs16 = copy.deepcopy(hfq).to(torch.bfloat16)(ids).logits
    assert _rel(got, theirs32) < _rel(theirs16, theirs32), (_rel(got, theirs32), _rel(theirs16, theirs32))
    assert (got.argmax(-1) == theirs32.argmax(-1)).float().mean() >= 0.9
    # (the W2A8 error: transformers' quantized model against the float one)
    assert _rel(theirs32, fl(ids).logits) > 0.3


@torch.no_grad()
def test_fused_equals_unfused_bit_for_bit(fp32):
    fl, _, conv = fp32
    unfused = bn.convert(copy.deepcopy(fl), backend="reference", fuse=False)
    attn = unfused.model.layers[0].self_attn
    assert isinstance(attn.q_proj, bn.BitLinear) and attn.q_proj.segments == (128,) and not hasattr(attn, "qkv_proj")
    ids = _ids(2)
    assert torch.equal(conv(ids).logits, unfused(ids).logits)
    for layer in conv.model.layers:  # every slice was read: no activation kept alive
        assert layer.self_attn.q_proj._memo == {} and layer.mlp.gate_proj._memo == {}


@torch.no_grad()
def test_fused_norms_change_no_bit(fp32):
    """RMSNormQuant is transformers' norm op for op, and the layers reading its output use
    the quantization it carries: logits equal the model with transformers' norms (whose
    layers quantize their own inputs) bit for bit."""
    fl, _, conv = fp32
    plain = bn.convert(copy.deepcopy(fl), backend="reference", fuse_norms=False)
    assert isinstance(plain.model.layers[0].input_layernorm, transformers.models.bitnet.modeling_bitnet.BitNetRMSNorm)
    ids = _ids(5)
    assert torch.equal(conv(ids).logits, plain(ids).logits)


@torch.no_grad()
def test_norm_output_carries_its_quantization(monkeypatch):
    """The quantization travels with the norm's output: a BitLinear reading it does not
    quantize again; a copy, a view or an in-place change of the output makes it quantize
    its input itself (and the result is that of the input it got)."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.rand(256) + 0.5)
    norm = bn.RMSNormQuant(w, 1e-6, backend="reference")
    lin = bn.BitLinear.from_float(torch.nn.Linear(256, 64), backend="reference")
    x = torch.randn(3, 256) * 4
    y = norm(x)
    assert torch.equal(y, bn._rms_norm(x, w, 1e-6))
    calls = []
    real = bn.quantize_activation
    monkeypatch.setattr(bn, "quantize_activation", lambda t, **kw: calls.append(t.shape) or real(t, **kw))
    out = lin(y)
    assert calls == []  # the carried (q, s)
    assert torch.equal(out, lin(y.clone())) and len(calls) == 1
    y.mul_(-2)  # an in-place change: the carried quantization is stale
    assert torch.equal(lin(y), lin(y.clone())) and len(calls) == 3
    z = norm(x)  # (its own quantization on the reference path counts once)
    assert torch.equal(lin(z.view(3, 256)), out) and len(calls) == 5  # a view quantizes itself
    with torch.inference_mode():  # no version counter to guard in-place changes: not carried
        y = norm(x)
        assert not hasattr(y, bn._ACT_ATTR) and torch.equal(lin(y), out) and len(calls) == 7


def test_rms_norm_quantize_gated_is_bitnet_mlp_activation():
    """gated: x is the fused gate / up output; the norm's input is transformers' relu2 of
    the gate times up, op for op."""
    from transformers.activations import ACT2FN

    x = torch.randn(3, 2 * 64, dtype=torch.bfloat16) * 2
    w = (torch.rand(64) + 0.5).to(torch.bfloat16)
    y, q, s = bn.rms_norm_quantize(x, w, 1e-6, gated=True)
    hf = transformers.models.bitnet.modeling_bitnet.BitNetRMSNorm(64, eps=1e-6).to(torch.bfloat16)
    hf.weight.data.copy_(w)
    want = hf(ACT2FN["relu2"](x[:, :64]) * x[:, 64:])
    assert torch.equal(y, want) and y.shape == (3, 64)
    assert torch.equal(q, bn.quantize_activation(want)[0]) and torch.equal(s, bn.quantize_activation(want)[1])
    with pytest.raises(ValueError, match="even"):
        bn.rms_norm_quantize(x[:, :127], w, 1e-6, gated=True)
    with pytest.raises(ValueError, match="half x's last dimension"):
        bn.rms_norm_quantize(x, torch.ones(128, dtype=torch.bfloat16), 1e-6, gated=True)


def test_rms_norm_quantize_reference_and_errors():
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16) * 3
    w = (torch.rand(64) + 0.5).to(torch.bfloat16)
    y, q, s = bn.rms_norm_quantize(x, w, 1e-5)
    hf = transformers.models.bitnet.modeling_bitnet.BitNetRMSNorm(64, eps=1e-5).to(torch.bfloat16)
    hf.weight.data.copy_(w)
    assert torch.equal(y, hf(x)) and y.dtype == torch.bfloat16
    q_ref, s_ref = bn.quantize_activation(y)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref) and q.shape == (2, 5, 64) and s.shape == (2, 5)
    with pytest.raises(ValueError, match="weight must have shape"):
        bn.rms_norm_quantize(x, w[:32], 1e-5)
    with pytest.raises(ValueError, match="eps"):
        bn.rms_norm_quantize(x, w, -1.0)
    with pytest.raises(ValueError, match="backend"):
        bn.rms_norm_quantize(x, w, 1e-5, backend="fast")
    with pytest.raises(ValueError, match="CUDA tensors"):
        bn.rms_norm_quantize(x, w, 1e-5, backend="kernel")
    with pytest.raises(ValueError, match="one dtype"):
        bn.rms_norm_quantize(x, w.float(), 1e-5, backend="kernel")
    with pytest.raises(ValueError, match="backend"):
        bn.RMSNormQuant(torch.nn.Parameter(w), 1e-5, backend="fast")


def test_fused_slice_recomputes_for_another_input(fp32):
    _, _, conv = fp32
    attn = conv.model.layers[0].self_attn
    a, b = torch.randn(3, 128), torch.randn(3, 128)
    q_a = attn.q_proj(a)
    k_b = attn.k_proj(b)  # a different tensor: its own fused product
    assert torch.equal(k_b, attn.qkv_proj(b)[:, 128:192])
    assert torch.equal(q_a, attn.qkv_proj(a)[:, :128])
    assert torch.equal(attn.v_proj(b), attn.qkv_proj(b)[:, 192:])
    # the same tensor written in place between the slices' calls: the fused layer again
    with torch.no_grad():
        buf = a.clone()
        attn.q_proj(buf)
        attn.k_proj(buf)
        buf.copy_(b)
        assert torch.equal(attn.v_proj(buf), attn.qkv_proj(b)[:, 192:])


@torch.no_grad()
def test_greedy_generate_agrees_with_transformers(fp32):
    _, hfq, conv = fp32
    ids = _ids(4)
    theirs = _round_outputs_to_bf16(copy.deepcopy(hfq)).generate(ids, max_new_tokens=8, do_sample=False)
    mine = conv.generate(ids, max_new_tokens=8, do_sample=False)
    agree = (mine[:, 16:] == theirs[:, 16:]).float().mean().item()
    assert agree >= 0.9, agree


# --------------------------------------------------------------------------------------
# The bitdecode KV cache: prefill through the GEMM, decode through the GEMV
# --------------------------------------------------------------------------------------


def _count_matmuls(monkeypatch):
    calls = []
    for name in ("gemv", "gemm"):
        fn = getattr(bn, name)

        def wrapped(x, *args, _fn=fn, _name=name, **kw):
            calls.append((_name, x.shape[0]))
            return _fn(x, *args, **kw)

        monkeypatch.setattr(bn, name, wrapped)
    return calls


@torch.no_grad()
def test_generate_with_the_bitdecode_cache(monkeypatch):
    """bf16 (the KV cache stores 16-bit K / V), ``initializer_range=0.2`` (embeddings and
    lm_head wide enough that greedy choices are not decided by the 4-bit cache's noise)."""
    fl = _float_model(seed=5, dtype=torch.bfloat16, initializer_range=0.2)
    conv = bn.convert(copy.deepcopy(fl), backend="reference")
    packed = copy.deepcopy(conv)
    packed.set_attn_implementation(hf.ATTN_IMPLEMENTATION)
    fmt = bd.KVFormat(bits=4, group_size=64)

    def cache():
        return hf.BitDecodingCache(packed, fmt, max_seqlen=256, backend="reference")

    # prefill: attention on the 16-bit K / V, so the logits equal the DynamicCache model's;
    # decode steps read the packed cache: within the 4-bit format's error
    ids = _ids(6, batch=2, length=20)
    steps = torch.randint(1, VOCAB, (2, 4), generator=torch.Generator().manual_seed(6))
    c16, cbd = transformers.DynamicCache(config=conv.config), cache()
    assert torch.equal(packed(ids, **hf.cache_kwargs(packed, cbd), use_cache=True).logits,
                       conv(ids, **hf.cache_kwargs(conv, c16), use_cache=True).logits)
    agree = []
    for t in range(steps.shape[1]):
        a = conv(steps[:, t : t + 1], **hf.cache_kwargs(conv, c16), use_cache=True).logits
        b = packed(steps[:, t : t + 1], **hf.cache_kwargs(packed, cbd), use_cache=True).logits
        assert _rel(b, a) < 0.06, (t, _rel(b, a))
        agree.append((a.argmax(-1) == b.argmax(-1)).float().mean().item())
    assert sum(agree) / len(agree) >= 0.75, agree
    assert [layer.kv.lengths for layer in cbd.layers] == [[24, 24]] * LAYERS

    # greedy generate, two sequences: tokens agree with the 16-bit cache
    ref = conv.generate(ids, max_new_tokens=6, do_sample=False)
    mine = packed.generate(ids, **hf.cache_kwargs(packed, cache()), max_new_tokens=6, do_sample=False)
    assert (mine[:, 20:] == ref[:, 20:]).float().mean().item() >= 0.75

    # one sequence: the prompt runs the GEMM (M = 20 tokens), each decode step the GEMV
    calls = _count_matmuls(monkeypatch)
    c = cache()
    out = packed.generate(ids[:1], **hf.cache_kwargs(packed, c), max_new_tokens=6, do_sample=False)
    per_forward = 4 * LAYERS  # qkv, o, gate_up, down
    assert calls == [("gemm", 20)] * per_forward + [("gemv", 1)] * per_forward * 5
    assert c.layers[0].kv.lengths == [25]
    assert out.shape == (1, 26)


# --------------------------------------------------------------------------------------
# Models loaded with a BitNet quantization_config (microsoft/bitnet-b1.58-2B-4T's path)
# --------------------------------------------------------------------------------------


@torch.no_grad()
def test_convert_transformers_packed_bitlinear(fp32):
    """transformers' offline ``BitLinear`` (uint8, four row blocks per byte, ``weight_scale
    = 1 / mean|W|``: what ``from_pretrained("microsoft/bitnet-b1.58-2B-4T")`` builds) keeps
    its ternary values and scales; offline ``AutoBitLinear`` (unpacked ternary,
    ``weight_scale = mean|W|``) too."""
    fl, _, conv = fp32
    packed = _hf_quantized(fl, linear_class="bitlinear", quantization_mode="offline")
    offline = _hf_quantized(fl, linear_class="autobitlinear", quantization_mode="offline")
    for name, m in packed.named_modules():
        if isinstance(m, hf_bitnet.BitLinear):
            w = fl.get_submodule(name).weight.detach()
            t, s = bn.quantize_weight(w)
            m.weight.copy_(hf_bitnet.pack_weights(t.clone()))  # transformers' own packing
            m.weight_scale.copy_(1.0 / s)
            a = offline.get_submodule(name)
            a.weight.copy_(t.float())
            a.weight_scale.copy_(s)
    ids = _ids(8)
    ref = _round_outputs_to_bf16(copy.deepcopy(packed))(ids).logits
    for model in (packed, offline):
        got = bn.convert(copy.deepcopy(model), backend="reference")
        for i in range(LAYERS):
            for parent, names in PROJ_GROUPS:
                mine = getattr(getattr(got.model.layers[i], parent), names[0])
                want = getattr(getattr(conv.model.layers[i], parent), names[0])
                mine, want = (mine.fused, want.fused) if isinstance(mine, bn.FusedSlice) else (mine, want)
                assert torch.equal(mine.weight_packed, want.weight_packed)
                torch.testing.assert_close(mine.weight_scale, want.weight_scale, rtol=2.0**-22, atol=0)
        assert _rel(got(ids).logits, ref) < 1e-2


@torch.no_grad()
def test_convert_keeps_a_linear_rms_norm(fp32):
    """``use_rms_norm=True`` puts an RMSNorm inside each BitNet linear (before the
    activation quantization): kept in front of the converted layer, and not fused (the
    projections' normalized inputs differ)."""
    fl, _, _ = fp32
    normed = _hf_quantized(fl, use_rms_norm=True)
    for m in normed.modules():
        if isinstance(m, hf_bitnet.AutoBitLinear):
            m.rms_norm.weight.copy_(torch.rand(m.in_features) + 0.5)
    got = bn.convert(copy.deepcopy(normed), backend="reference")
    q = got.model.layers[0].self_attn.q_proj
    assert isinstance(q, torch.nn.Sequential) and isinstance(q[1], bn.BitLinear)
    assert not hasattr(got.model.layers[0].self_attn, "qkv_proj")
    ids = _ids(9)
    assert _rel(got(ids).logits, _round_outputs_to_bf16(copy.deepcopy(normed).double())(ids).logits) < 1e-2


def test_convert_refuses_a_full_precision_model():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1)
    with pytest.raises(ValueError, match="not a BitNet model"):
        bn.convert(transformers.LlamaForCausalLM(cfg))
    with pytest.raises(ValueError, match="backend must be one of"):
        bn.convert(_float_model(), backend="sm90")
    with pytest.raises(ValueError, match=r"cannot convert .*q_proj"):
        bn.convert(_float_model(hidden_size=96, num_attention_heads=1, intermediate_size=128))


def test_convert_refuses_before_it_swaps():
    """A layer the kernels cannot take, past layers they can (the down projection's K of
    200 after the attention and gate / up of every layer), is refused with the model left
    as it was; ``skip`` must name modules the model has, as a collection of names."""
    m = _float_model(intermediate_size=200)
    before = _snapshot(m)
    with pytest.raises(ValueError, match=r"cannot convert model.layers.0.mlp.down_proj \(128 x 200\)"):
        bn.convert(m, backend="reference")
    assert _unchanged(m, *before)
    with pytest.raises(TypeError, match="skip must be a collection of qualified module names"):
        bn.convert(m, backend="reference", skip="model.layers.0.mlp.down_proj")
    with pytest.raises(TypeError, match="skip must be a collection"):
        bn.convert(m, backend="reference", skip=None)
    with pytest.raises(ValueError, match=r"skip names modules the model does not have: \['model.layers.0.mlp.dwn'\]"):
        bn.convert(m, backend="reference", skip=["model.layers.0.mlp.dwn"])
    assert _unchanged(m, *before)
    skipped = [f"model.layers.{i}.mlp.down_proj" for i in range(LAYERS)]
    got = bn.convert(m, backend="reference", skip=(x for x in skipped))  # any iterable of names
    assert all(type(layer.mlp.down_proj) is torch.nn.Linear for layer in got.model.layers)
    assert isinstance(got.model.layers[0].self_attn.qkv_proj, bn.BitLinear)


# --------------------------------------------------------------------------------------
# GPU: the kernels
# --------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.no_grad()
def test_gpu_converted_model_on_the_kernels(monkeypatch):
    """BitNet b1.58 2B's layer shapes (hidden 2560, 20 heads of 128, 5 KV heads, MLP
    6912), two layers: every converted layer within one bf16 ulp of the reference, the
    logits within 2e-2, prefill on the GEMM and decode on the GEMV, greedy tokens with the
    bitdecode KV cache."""
    fl = _float_model(seed=11, dtype=torch.bfloat16, device="cuda", hidden_size=2560, intermediate_size=6912,
                      num_attention_heads=20, num_key_value_heads=5, vocab_size=1024, initializer_range=0.2)
    kern = bn.convert(copy.deepcopy(fl))  # auto: the kernels on CUDA tensors
    ref = bn.convert(copy.deepcopy(fl), backend="reference")
    gen = torch.Generator(device="cuda").manual_seed(12)
    for i in range(LAYERS):
        for parent, names in PROJ_GROUPS:
            mine, theirs = getattr(kern.model.layers[i], parent), getattr(ref.model.layers[i], parent)
            k = getattr(theirs, names[0]).in_features
            for m in (1, 7, 64):
                x = torch.randn(m, k, generator=gen, device="cuda", dtype=torch.bfloat16)
                for name in names:
                    got, want = getattr(mine, name)(x).float(), getattr(theirs, name)(x).float()
                    assert bool(((got - want).abs() <= want.abs() * 2.0**-7).all()), (i, name, m)
    ids = torch.randint(1, 1024, (2, 40), generator=gen, device="cuda")
    a, b = kern(ids).logits, ref(ids).logits  # last-bit differences may flip a few int8 roundings
    assert _rel(a, b) < 2e-2 and (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9, _rel(a, b)

    packed = copy.deepcopy(kern)
    packed.set_attn_implementation(hf.ATTN_IMPLEMENTATION)
    fmt = bd.KVFormat(bits=4, group_size=64)
    calls = _count_matmuls(monkeypatch)
    cache = hf.BitDecodingCache(packed, fmt, max_seqlen=512)
    out = packed.generate(ids[:1], **hf.cache_kwargs(packed, cache), max_new_tokens=8, do_sample=False)
    per_forward = 4 * LAYERS
    assert calls == [("gemm", 40)] * per_forward + [("gemv", 1)] * per_forward * 7
    monkeypatch.undo()
    assert cache.layers[0].kv.backend != "reference"
    plain = kern.generate(ids[:1], max_new_tokens=8, do_sample=False)
    assert (out[:, 40:] == plain[:, 40:]).float().mean().item() >= 0.75
    assert (plain[:, 40:] == ref.generate(ids[:1], max_new_tokens=8, do_sample=False)[:, 40:]).float().mean() >= 0.75


# --------------------------------------------------------------------------------------
# microsoft/BitNet's converted checkpoint (model_state_int2.pt)
# --------------------------------------------------------------------------------------


def _ms_interleave_rope_rows(w, heads):
    """convert_safetensors.invert_convert_q / _k of microsoft/BitNet's gpu/: rows
    ``(h l d) -> (h d l)`` with l = 2 (their rotary is interleaved)."""
    n, k = w.shape
    return w.reshape(heads, 2, n // heads // 2, k).transpose(1, 2).reshape(n, k)


def _ms_quant(w):
    """convert_checkpoint.quant_weight_int8: (ternary int8, bf16 [1] scale, the fp32 multiplier)."""
    s = 1.0 / w.abs().mean().clamp(min=1e-5)
    return (w * s).round().clamp(-1, 1).to(torch.int8), (1.0 / s).to(torch.bfloat16).reshape(1), s


def _ms_int2_checkpoint(model):
    """What microsoft/BitNet's gpu/ converters (convert_safetensors.py, then
    convert_checkpoint.py) make of a transformers BitNet model's weights, step by step as
    they do it; packing by ``pack_weight`` (byte-for-byte their ``pack_weight.py``, tested
    in test_bitnet.py).  Also returns the multipliers ``s`` per (layer, projection)."""
    cfg, st = model.config, {k: v.detach().float() for k, v in model.state_dict().items()}
    out, mult = {}, {}
    zero = torch.zeros(1, dtype=torch.bfloat16)
    for i in range(cfg.num_hidden_layers):
        b = f"model.layers.{i}."
        groups = {"attention.wqkv": [_ms_interleave_rope_rows(st[b + "self_attn.q_proj.weight"], cfg.num_attention_heads),
                                     _ms_interleave_rope_rows(st[b + "self_attn.k_proj.weight"], cfg.num_key_value_heads),
                                     st[b + "self_attn.v_proj.weight"]],
                  "attention.wo": [st[b + "self_attn.o_proj.weight"]],
                  "feed_forward.w13": [st[b + "mlp.gate_proj.weight"], st[b + "mlp.up_proj.weight"]],
                  "feed_forward.w2": [st[b + "mlp.down_proj.weight"]]}
        for name, parts in groups.items():
            quant = [_ms_quant(w) for w in parts]
            out[f"layers.{i}.{name}.weight"] = bn.pack_weight(torch.cat([t for t, _, _ in quant]))
            out[f"layers.{i}.{name}.weight_scale"] = torch.cat([s for _, s, _ in quant] + [zero] * (4 - len(quant)))
            mult[(i, name)] = [m for _, _, m in quant]
        for ms, hf_name in (("attention_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"),
                            ("attention.attn_sub_norm", "self_attn.attn_sub_norm"),
                            ("feed_forward.ffn_sub_norm", "mlp.ffn_sub_norm")):
            out[f"layers.{i}.{ms}.weight"] = st[b + hf_name + ".weight"].to(torch.bfloat16)
    out["tok_embeddings.weight"] = st["model.embed_tokens.weight"].to(torch.bfloat16)
    out["output.weight"] = st["model.embed_tokens.weight"].to(torch.bfloat16)
    out["norm.weight"] = st["model.norm.weight"].to(torch.bfloat16)
    return out, mult


def _bf16_model_weights(model):
    """The float model with its non-linear weights rounded to bf16 (what the checkpoint holds)."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if not name.endswith("proj.weight"):
                p.copy_(p.to(torch.bfloat16).float())
    return m


@pytest.mark.parametrize("fuse", [True, False])
def test_load_microsoft_int2_checkpoint(fuse, tmp_path):
    """A model_state_int2.pt made from a float model loads into a fresh BitNetForCausalLM
    (other random weights) as exactly the layers ``convert`` builds from those float
    weights with microsoft's rounding: the same ternary codes in transformers' row order
    (q / k rows un-interleaved), the bf16 scales, norms and embeddings; so the same logits
    bit for bit.  Loading from the file equals loading the dict."""
    fl = _float_model(seed=3, tie_word_embeddings=True)  # as the 2B model: output = the embeddings
    ckpt, mult = _ms_int2_checkpoint(fl)
    torch.save(ckpt, tmp_path / "model_state_int2.pt")
    loaded = bn.load_int2_checkpoint(_float_model(seed=4, tie_word_embeddings=True), tmp_path / "model_state_int2.pt",
                                     backend="reference", fuse=fuse)
    # the expectation: convert of the same float weights, each projection's codes rounded
    # as microsoft's converter does (its multiplier, transformers' row order) and its bf16 scale
    want = bn.convert(_bf16_model_weights(fl), backend="reference", fuse=fuse)
    st = {k: v.detach().float() for k, v in fl.state_dict().items()}
    names = {"attention.wqkv": ("self_attn", ("q_proj", "k_proj", "v_proj"), "qkv_proj"),
             "attention.wo": ("self_attn", ("o_proj",), None),
             "feed_forward.w13": ("mlp", ("gate_proj", "up_proj"), "gate_up_proj"),
             "feed_forward.w2": ("mlp", ("down_proj",), None)}
    for (i, ms), ss in mult.items():
        parent, members, fused_name = names[ms]
        t = [(st[f"model.layers.{i}.{parent}.{m}.weight"] * s).round().clamp(-1, 1).to(torch.int8)
             for m, s in zip(members, ss)]
        scales = ckpt[f"layers.{i}.{ms}.weight_scale"][:len(members)].float()
        mods = ([getattr(want.model.layers[i], parent).get_submodule(fused_name)] if fuse and fused_name
                else [getattr(want.model.layers[i], parent).get_submodule(m) for m in members])
        if len(mods) == 1:
            mods[0].weight_packed.copy_(bn.pack_weight(torch.cat(t)))
            mods[0].weight_scale.copy_(scales)
        else:
            for mod, tm, sc in zip(mods, t, scales):
                mod.weight_packed.copy_(bn.pack_weight(tm))
                mod.weight_scale.copy_(sc.reshape(1))
    got_state, want_state = loaded.state_dict(), want.state_dict()
    assert got_state.keys() == want_state.keys()
    for k in want_state:
        assert torch.equal(got_state[k], want_state[k]), k
    ids = _ids(5)
    assert torch.equal(loaded(ids).logits, want(ids).logits)
    again = bn.load_int2_checkpoint(_float_model(seed=6, tie_word_embeddings=True), ckpt, backend="reference",
                                    fuse=fuse)
    assert torch.equal(again(ids).logits, loaded(ids).logits)


def _unchanged(model, state, kinds) -> bool:
    """Whether ``model`` still has the ``state`` and the module classes ``kinds`` it had."""
    now = model.state_dict()
    return (now.keys() == state.keys() and all(torch.equal(now[k], state[k]) for k in state)
            and [type(m) for m in model.modules()] == kinds)


def _snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}, [type(m) for m in model.modules()]


def test_load_int2_checkpoint_errors():
    """A checkpoint that does not fit the model is refused by name, and the model is left as
    it was (every tensor checked before the first is written)."""
    fl = _float_model(seed=3)
    ckpt, _ = _ms_int2_checkpoint(fl)
    target = _float_model()
    before = _snapshot(target)
    with pytest.raises(ValueError, match="'layers.1.attention.wo.weight'"):  # a key of the last layer missing
        bn.load_int2_checkpoint(target, {k: v for k, v in ckpt.items() if k != "layers.1.attention.wo.weight"},
                                backend="reference")
    assert _unchanged(target, *before)
    with pytest.raises(ValueError, match=r"'layers.1.attention.wqkv.weight_scale'\] must hold one scale per "
                                         r"projection \(3"):
        bn.load_int2_checkpoint(target, ckpt | {"layers.1.attention.wqkv.weight_scale": torch.ones(1)},
                                backend="reference")
    with pytest.raises(ValueError, match=r"'layers.1.ffn_norm.weight'\] must have shape \(128,\)"):
        bn.load_int2_checkpoint(target, ckpt | {"layers.1.ffn_norm.weight": torch.ones(1)}, backend="reference")
    wo = ckpt["layers.1.attention.wo.weight"]
    with pytest.raises(ValueError, match=r"'layers.1.attention.wo.weight'\] must have shape \(128, 32\)"):
        bn.load_int2_checkpoint(target, ckpt | {"layers.1.attention.wo.weight": torch.cat([wo, wo], 1)},
                                backend="reference")
    assert _unchanged(target, *before)
    with pytest.raises(ValueError, match=r"'layers.0.attention.wqkv.weight'\] must have shape \(384, 32\) \(this "
                                         r"model's q_proj/k_proj/v_proj: 384 rows"):
        bn.load_int2_checkpoint(_float_model(num_key_value_heads=2), ckpt, backend="reference")
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128,
                                                                   intermediate_size=256, num_hidden_layers=1,
                                                                   num_attention_heads=2))
    with pytest.raises(ValueError, match="BitNetForCausalLM"):
        bn.load_int2_checkpoint(llama, ckpt)
    with pytest.raises(TypeError, match="state must be a dict"):
        bn.load_int2_checkpoint(_float_model(), [1, 2])


def test_load_int2_checkpoint_refuses_what_would_load_wrong(tmp_path):
    """Checkpoints that would load into wrong logits without an error: one of a deeper
    model (its last layers were dropped), a 2-bit code with no ternary value, a zero or
    NaN projection scale; refused by key, the model left as it was.  A bytes path reads."""
    ckpt, _ = _ms_int2_checkpoint(_float_model(seed=3))
    target = _float_model()
    before = _snapshot(target)
    deeper = ckpt | {k.replace("layers.1.", "layers.2."): v for k, v in ckpt.items() if k.startswith("layers.1.")}
    with pytest.raises(ValueError, match=r"state holds layers 2\.\.2 beyond this model's 2"):
        bn.load_int2_checkpoint(target, deeper, backend="reference")
    with pytest.raises(ValueError, match=r"'layers.1.attention.wo.weight'\] holds a 2-bit code that is no ternary"):
        bn.load_int2_checkpoint(target, ckpt | {"layers.1.attention.wo.weight": torch.zeros(128, 32, dtype=torch.int8)},
                                backend="reference")
    for bad in (0.0, float("nan")):
        scales = ckpt["layers.0.feed_forward.w13.weight_scale"].clone()
        scales[1] = bad
        with pytest.raises(ValueError, match=r"'layers.0.feed_forward.w13.weight_scale'\] holds a zero or non-finite "
                                             r"scale for gate_proj/up_proj"):
            bn.load_int2_checkpoint(target, ckpt | {"layers.0.feed_forward.w13.weight_scale": scales},
                                    backend="reference")
    assert _unchanged(target, *before)
    path = tmp_path / "model_state_int2.pt"
    torch.save(ckpt, path)
    ids = _ids(5)
    by_bytes = bn.load_int2_checkpoint(_float_model(), bytes(path), backend="reference")(ids).logits
    assert torch.equal(by_bytes, bn.load_int2_checkpoint(_float_model(), str(path), backend="reference")(ids).logits)
    with pytest.raises(ValueError, match="decoder layers at model.model.layers"):
        bn.load_int2_checkpoint(_float_model().model, ckpt, backend="reference")


def test_convert_and_load_refuse_a_converted_or_meta_model():
    """Converting (or loading into) a model these already ran on would keep the first
    run's fused MLP or mix backends: refused, as is a model with meta weights (no data)
    and a non-bool ``fuse`` / ``fuse_norms``.  A layer's quantization error names it."""
    ckpt, _ = _ms_int2_checkpoint(_float_model(seed=3))
    done = bn.convert(_float_model(), backend="reference")
    with pytest.raises(ValueError, match="model already holds bitdecode layers"):
        bn.load_int2_checkpoint(done, ckpt, backend="reference", fuse=False)
    with pytest.raises(ValueError, match="model already holds bitdecode layers"):
        bn.convert(done, backend="auto")
    with torch.device("meta"):
        meta = transformers.BitNetForCausalLM(_config())
    for call in (lambda: bn.convert(meta), lambda: bn.load_int2_checkpoint(meta, ckpt)):
        with pytest.raises(ValueError, match="model's weights are on the meta device"):
            call()
    with pytest.raises(TypeError, match="fuse must be a bool, got str"):
        bn.convert(_float_model(), fuse="no")
    with pytest.raises(TypeError, match="fuse_norms must be a bool, got int"):
        bn.load_int2_checkpoint(_float_model(), ckpt, fuse_norms=0)
    nan = _float_model()
    nan.model.layers[1].mlp.down_proj.weight.data[0, 0] = float("nan")
    with pytest.raises(ValueError, match="cannot convert model.layers.1.mlp.down_proj: w contains NaN"):
        bn.convert(nan, backend="reference")
    with pytest.raises(ValueError, match="w is on the meta device"):
        bn.quantize_weight(torch.empty(16, 128, device="meta"))


def test_offline_transformers_layers_are_not_quantized_again(fp32):
    """transformers' offline AutoBitLinear holds ternary weights and their scale:
    ``BitLinear.from_float`` would quantize them again and lose the scale (outputs ~13x
    off), so it is refused for ``convert``; a zero ``weight_scale`` of the packed layer
    (an infinite scale) and its code 3 are refused by layer."""
    fl, _, _ = fp32
    offline = _hf_quantized(fl, linear_class="autobitlinear", quantization_mode="offline")
    layer = offline.model.layers[0].self_attn.o_proj
    with pytest.raises(TypeError, match="offline AutoBitLinear"):
        bn.BitLinear.from_float(layer)
    packed = _hf_quantized(fl, linear_class="bitlinear", quantization_mode="offline")
    for m in packed.modules():
        if isinstance(m, hf_bitnet.BitLinear):
            m.weight.fill_(0b01010101)  # code 1: 0 everywhere
            m.weight_scale.fill_(1.0)
    zero = copy.deepcopy(packed)
    zero.model.layers[0].self_attn.o_proj.weight_scale.fill_(0.0)
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.o_proj: its weight_scale gives the non-finite"):
        bn.convert(zero, backend="reference")
    three = copy.deepcopy(packed)
    three.model.layers[0].mlp.down_proj.weight.fill_(-1)  # 0xFF: code 3 in every field
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj: transformers' packed BitNet weight holds "
                                         r"the 2-bit code 3"):
        bn.convert(three, backend="reference")
    bn.convert(packed, backend="reference")  # the same model with good codes and scales converts


def test_packed_weight_views_and_empty_k():
    """A packed weight viewed at a byte offset (not a multiple of 4) unpacks as its copy
    does; a K of 0 is refused by the matmuls' argument check."""
    gen = torch.Generator().manual_seed(0)
    t = torch.randint(-1, 2, (16, 128), generator=gen, dtype=torch.int8)
    p = bn.pack_weight(t)
    buf = torch.cat([torch.zeros(1, dtype=torch.int8), p.flatten()])
    assert torch.equal(bn.unpack_weight(buf[1:].view(16, 32)), t)
    x = torch.ones(2, 0, dtype=torch.int8)
    with pytest.raises(ValueError, match="x has K=0 columns; K must be a positive multiple"):
        bn.gemm(x, p[:, :0], torch.ones(2), torch.ones(1))


def test_kernel_helpers_refuse_a_cpu_device():
    """The public kernel-choice helpers name a CPU device instead of asserting inside
    torch.cuda (or, on a GPU machine, answering for the current GPU)."""
    for call in (lambda: bn.kernels_for("cpu"), lambda: bn.gemv_config_for("cpu", 2560, 2560),
                 lambda: bn.gemm_kernel_for(16, torch.device("cpu")), lambda: bn.gemv_configs("cpu")):
        with pytest.raises(ValueError, match="device: the BitNet kernels run on CUDA devices, got cpu"):
            call()


def test_fused_building_blocks_check_their_arguments():
    """``RMSNormQuant``, ``FusedSlice`` and ``FusedMLP`` built by hand: a bad argument is
    refused by name at construction, not at the first forward deep in a model."""
    w = torch.nn.Parameter(torch.ones(128))
    with pytest.raises(ValueError, match="eps must be a finite float >= 0, got '1e-5'"):
        bn.RMSNormQuant(w, "1e-5")
    with pytest.raises(ValueError, match="eps must be a finite float"):
        bn.RMSNormQuant(w, None)
    with pytest.raises(TypeError, match="gated must be a bool"):
        bn.RMSNormQuant(w, 1e-5, gated=1)
    layer = bn.BitLinear(128, 64, segments=(32, 32), backend="reference")
    with pytest.raises(ValueError, match="index must name one of fused's 2 segments, got 5"):
        bn.FusedSlice(layer, 5, {})
    with pytest.raises(TypeError, match="fused must be a BitLinear"):
        bn.FusedSlice(torch.nn.Linear(128, 64), 0, {})
    with pytest.raises(TypeError, match="mlp must be a BitNet MLP"):
        bn.FusedMLP(torch.nn.Linear(3, 3))
