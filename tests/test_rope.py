"""The rotary embedding as one kernel (``bitdecode.rope``, ``bitdecode.hf.fuse_rope``): checked
bit for bit against transformers' own ``apply_rotary_pos_emb``."""

from __future__ import annotations

import pytest
import torch

from bitdecode import rope

transformers = pytest.importorskip("transformers")
from transformers.models.llama import modeling_llama  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _qkcs(b, hq, hk, t, d, dtype, device="cpu", transposed=True, cos_batch=None, seed=0):
    """q / k as transformers hands them (the projections' (B, T, H, D) output transposed to
    (B, H, T, D) views) and cos / sin (B, T, D) as its rotary module makes them."""
    g = torch.Generator().manual_seed(seed)

    def heads(h):
        x = torch.randn(b, t, h, d, generator=g) * 3
        x = x.to(dtype).to(device)
        return x.transpose(1, 2) if transposed else x.transpose(1, 2).contiguous()

    pos = torch.arange(t, dtype=torch.float32)[None].expand(cos_batch or b, t) + 1000 * torch.rand(cos_batch or b, 1, generator=g)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = torch.cat([pos[..., None] * inv] * 2, dim=-1)
    return heads(hq), heads(hk), ang.cos().to(dtype).to(device), ang.sin().to(dtype).to(device)


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_reference_is_transformers(dtype):
    q, k, c, s = _qkcs(2, 4, 2, 5, 64, dtype)
    assert _same(rope.apply_rotary(q, k, c, s, backend="reference"), modeling_llama.apply_rotary_pos_emb(q, k, c, s))


def test_bad_arguments_are_named():
    q, k, c, s = _qkcs(2, 4, 2, 5, 64, torch.float16)
    with pytest.raises(ValueError, match="k .* must share q's batch"):
        rope.apply_rotary(q, k[:1], c, s)
    with pytest.raises(ValueError, match="cos must be"):
        rope.apply_rotary(q, k, c[:, :3], s)
    with pytest.raises(ValueError, match="sin must be"):
        rope.apply_rotary(q, k, c, s[..., :32])
    with pytest.raises(ValueError, match=r"q must be \(B, H, T, D\)"):
        rope.apply_rotary(q[0], k, c, s)
    with pytest.raises(ValueError, match="backend must be one of"):
        rope.apply_rotary(q, k, c, s, backend="cuda")
    with pytest.raises(ValueError, match="kernel needs CUDA tensors"):
        rope.apply_rotary(q, k, c, s, backend="kernel")
    with pytest.raises(ValueError, match="sin is on meta but q is on cpu"):
        rope.apply_rotary(q, k, c, s.to("meta"))


def _tiny_llama():
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=100)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_fuse_rope_patches_llama_and_restores():
    from bitdecode import hf

    model = _tiny_llama()
    ids = torch.randint(0, 100, (2, 7))
    own = modeling_llama.apply_rotary_pos_emb
    with torch.no_grad():
        before = model(ids).logits
    try:
        assert hf.fuse_rope(model) == [modeling_llama.__name__]
        assert modeling_llama.apply_rotary_pos_emb is not own
        assert hf.fuse_rope(model) == [modeling_llama.__name__]  # idempotent
        with torch.no_grad():
            assert torch.equal(model(ids).logits, before)
    finally:
        assert hf.restore_rope() == [modeling_llama.__name__]
    assert modeling_llama.apply_rotary_pos_emb is own
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        hf.fuse_rope("llama")
    with pytest.raises(ValueError, match="backend must be one of"):
        hf.fuse_rope(model, backend="cuda")


def test_fuse_rope_leaves_other_rotary_embeddings_alone(monkeypatch):
    """A modeling module whose ``apply_rotary_pos_emb`` is not Llama's (here: Llama's with the
    halves interleaved instead) is not patched."""
    from bitdecode import hf

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        cos = cos.unsqueeze(unsqueeze_dim)
        sin = sin.unsqueeze(unsqueeze_dim)
        q_embed = (q * cos) + (q.flip(-1) * sin)
        k_embed = (k * cos) + (k.flip(-1) * sin)
        return q_embed, k_embed

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", apply_rotary_pos_emb)
    assert hf.fuse_rope(_tiny_llama()) == []
    assert modeling_llama.apply_rotary_pos_emb is apply_rotary_pos_emb


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("b, hq, hk, t, d, transposed, cos_batch", [
    (1, 32, 8, 1, 128, True, None),  # a Llama-3-8B decode step
    (3, 28, 4, 37, 128, True, None),  # prefill, ragged head counts
    (2, 8, 8, 5, 64, False, 1),  # contiguous inputs, cos / sin shared by the batch
    (1, 16, 2, 3, 256, True, None),
])
def test_gpu_kernel_is_transformers_bit_for_bit(dtype, b, hq, hk, t, d, transposed, cos_batch):
    q, k, c, s = _qkcs(b, hq, hk, t, d, dtype, "cuda", transposed, cos_batch)
    got = rope.apply_rotary(q, k, c, s, backend="kernel")
    want = modeling_llama.apply_rotary_pos_emb(q, k, c, s)
    assert _same(got, want), max((x.float() - y.float()).abs().max().item() for x, y in zip(got, want))
    assert all(x.is_contiguous() for x in got)


@pytest.mark.gpu
@cuda
def test_gpu_auto_falls_back_on_what_the_kernel_does_not_take():
    q, k, c, s = _qkcs(1, 4, 2, 3, 72, torch.float16, "cuda")  # head dim 72: not a multiple of 16
    assert _same(rope.apply_rotary(q, k, c, s), modeling_llama.apply_rotary_pos_emb(q, k, c, s))
    with pytest.raises(ValueError, match="head dim that is a multiple of 16"):
        rope.apply_rotary(q, k, c, s, backend="kernel")


@pytest.mark.gpu
@cuda
def test_gpu_fused_llama_logits_unchanged():
    from bitdecode import hf

    model = _tiny_llama().to("cuda", torch.bfloat16)
    ids = torch.randint(0, 100, (2, 9), device="cuda")
    with torch.no_grad():
        before = model(ids).logits
    try:
        hf.fuse_rope(model, backend="kernel")
        with torch.no_grad():
            assert torch.equal(model(ids).logits, before)
    finally:
        hf.restore_rope()


@pytest.mark.gpu
@cuda
def test_gpu_autograd_takes_torchs_ops():
    """The kernel has no backward: with autograd on, "auto" keeps torch's ops (differentiable)
    and "kernel" says why it refuses."""
    q, k, c, s = _qkcs(1, 4, 2, 3, 64, torch.bfloat16, "cuda")
    q = q.detach().requires_grad_(True)
    q_out, _ = rope.apply_rotary(q, k, c, s)
    assert q_out.grad_fn is not None
    with pytest.raises(ValueError, match="no autograd"):
        rope.apply_rotary(q, k, c, s, backend="kernel")


def test_the_rope_kernel_needs_head_dims_of_whole_16_byte_halves(monkeypatch):
    """Each half of a head is read as 8-value vectors: head dims of 8, 24, 40 ... stay with
    torch (a GPU check; the dtype / device rule stubbed out here)."""
    from bitdecode import dispatch

    monkeypatch.setattr(dispatch, "float16_kernel_fit", lambda tensors: "")
    q, c = torch.randn(1, 2, 3, 24).half(), torch.randn(1, 3, 24).half()
    assert "multiple of 16" in rope._kernel_fits(q, q, c, c)
