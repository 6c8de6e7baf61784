"""Independent K / V widths (``KVFormat.v_bits``) and attention-sink tokens
(``KVFormat.sink_tokens``) on the torch reference backend, against a float64 model of the
format built here from ``reference.quantize`` / ``dequantize`` (whose own properties
test_reference.py checks) and plain softmax attention."""

import math

import pytest
import torch

import bitdecode as bd
from bitdecode import dispatch, reference

import kvdata

FORMATS = [
    bd.KVFormat(bits=4, v_bits=2, group_size=64),                      # K4V2
    bd.KVFormat(bits=2, v_bits=4, k_mode="token", group_size=32),      # K2V4
    bd.KVFormat(bits=2, group_size=32, sink_tokens=16),                # 2-bit with 16 sinks
    bd.KVFormat(bits=4, v_bits=2, group_size=64, sink_tokens=5),       # both, sinks not a block multiple
]
IDS = ["k4v2", "k2v4-token", "2bit-s16", "k4v2-s5"]


def test_format_fields():
    f = bd.KVFormat(bits=4, v_bits=2)
    assert (f.k_bits, f.v_bits, f.residual_block, f.v_tile) == (4, 2, 256, 256)
    f = bd.KVFormat(bits=2, v_bits=4)
    assert (f.residual_block, f.v_tile) == (256, 128)
    assert bd.KVFormat(bits=4).v_bits == 4 and bd.KVFormat(bits=4) == bd.KVFormat(bits=4, v_bits=4)
    assert f.bytes_per_token(128) == 128 * 6 / 8 + 2 * 128 / 128 * 4
    assert "K 2-bit / V 4-bit" in f.describe() and "first 3 tokens 16-bit" in bd.KVFormat(sink_tokens=3).describe()
    assert f.v_pack_shape(2, 3, 512, 64) == (2, 3, 4, 64, 16)  # 128-token tiles of 4-bit V


@pytest.mark.parametrize("kwargs, msg", [
    (dict(v_bits=3), "KVFormat.v_bits must be one of"),
    (dict(v_bits=True), "KVFormat.v_bits must be one of"),
    (dict(sink_tokens=-1), "KVFormat.sink_tokens must be an int >= 0"),
    (dict(sink_tokens=2.0), "KVFormat.sink_tokens must be an int >= 0"),
    (dict(sink_tokens=True), "KVFormat.sink_tokens must be an int >= 0"),
])
def test_format_rejects(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        bd.KVFormat(**kwargs)


def model_kv(fmt: bd.KVFormat, k: torch.Tensor, v: torch.Tensor):
    """K, V ``[n, H, D]`` of one sequence as the format stores them (float64): sinks exact,
    then blocks of ``residual_block`` tokens quantized (K: ``bits`` per channel over groups
    of tokens or per token over groups of channels; V: ``v_bits`` per token), the tail exact."""
    n, s, nr, g = k.shape[0], min(k.shape[0], fmt.sink_tokens), fmt.residual_block, fmt.group_size
    ks, vs = [k[:s].double()], [v[:s].double()]
    rest_k, rest_v = k[s:], v[s:]
    full = (n - s) // nr * nr
    for i in range(0, full, nr):
        kb, vb = rest_k[i:i + nr].transpose(0, 1), rest_v[i:i + nr].transpose(0, 1)  # [H, Nr, D]
        kdim = -2 if fmt.k_mode == "channel" else -1
        ck, sk, zk = reference.quantize(kb, fmt.bits, g, dim=kdim)
        cv, sv, zv = reference.quantize(vb, fmt.v_bits, g, dim=-1)
        ks.append(reference.dequantize(ck, sk, zk, g, dim=kdim).transpose(0, 1).double())
        vs.append(reference.dequantize(cv, sv, zv, g, dim=-1).transpose(0, 1).double())
    ks.append(rest_k[full:].double())
    vs.append(rest_v[full:].double())
    return torch.cat(ks), torch.cat(vs)


def model_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q ``[Hq, D]``, k / v ``[n, Hkv, D]`` float64 -> ``[Hq, D]``."""
    hq, d = q.shape
    hkv = k.shape[1]
    qg = q.double().view(hkv, hq // hkv, d)
    s = torch.einsum("hgd,nhd->hgn", qg, k) / math.sqrt(d)
    return torch.einsum("hgn,nhd->hgd", torch.softmax(s, dim=-1), v).reshape(hq, d)


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
@pytest.mark.parametrize("page_size", [None, 512], ids=["dense", "paged"])
def test_cache_equals_the_float64_model(fmt, page_size, gen):
    """Ragged prefill, then appends that cross block boundaries (and, from an empty
    sequence, the sink boundary): the cache dequantizes to the model bit for bit and
    decodes to the model's attention within fp16 rounding."""
    h, d, gq = 2, 64, 3
    lens, steps = [600, 0, 260], 300
    n = max(lens) + steps
    k, v = kvdata.kv(gen, 3, n, h, d)
    cache = bd.KVCache.allocate(3, h, d, n + 8, fmt, device="cpu", page_size=page_size, backend="reference")
    cache.prefill(k[:, :max(lens)], v[:, :max(lens)], lens)
    for i in range(steps):  # every sequence takes the same next tokens of its own stream
        idx = torch.tensor(lens) + i
        cache.append(k[torch.arange(3), idx][:, None], v[torch.arange(3), idx][:, None])
    q = kvdata.randn(gen, 3, 1, h * gq, d)
    out = cache.decode(q)
    for b, n0 in enumerate(lens):
        total = n0 + steps
        want_k, want_v = model_kv(fmt, k[b, :total], v[b, :total])
        got_k, got_v = cache.dequantized(b)
        assert torch.equal(got_k.double(), want_k) and torch.equal(got_v.double(), want_v), f"sequence {b}"
        want = model_attention(q[b, 0], want_k, want_v)
        torch.testing.assert_close(out[b, 0].double(), want, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_memory_counts_both_widths_and_the_sinks(fmt):
    c = bd.KVCache.allocate(2, 2, 64, 1024, fmt, device="cpu", backend="reference")
    base = bd.KVCache.allocate(2, 2, 64, 1024, bd.KVFormat(bits=fmt.bits, k_mode=fmt.k_mode,
                                                            group_size=fmt.group_size), device="cpu",
                               backend="reference")
    sinks = 2 * 2 * fmt.sink_tokens * 2 * 64 * 2
    v_words = c.v_pack.numel() - base.v_pack.numel()
    residual = (c.k_res.numel() - base.k_res.numel()) * 2 * 2
    assert c.memory_bytes() - base.memory_bytes() == sinks + 4 * v_words + residual


def test_kernel_backends_take_every_format(monkeypatch):
    monkeypatch.setattr(dispatch, "device_capability", lambda device: (9, 0) if device.type == "cuda" else None)
    cuda = torch.device("cuda", 0)
    for fmt in FORMATS:  # K4V2, K2V4, sinks
        for backend in ("auto", "sm80", "sm90"):
            assert dispatch.resolve(backend, cuda, fmt=fmt, head_dim=64) in ("sm80", "sm90")
        assert dispatch.resolve("reference", cuda, fmt=fmt) == "reference"
        assert dispatch.resolve("auto", torch.device("cpu"), fmt=fmt) == "reference"


def test_functional_form_takes_no_sinks(gen):
    fmt = bd.KVFormat(bits=4, group_size=64, sink_tokens=4)
    c = bd.KVCache.allocate(1, 1, 64, 256, fmt, device="cpu", backend="reference")
    q = kvdata.randn(gen, 1, 1, 2, 64)
    with pytest.raises(ValueError, match="fmt has sink_tokens=4"):
        bd.decode_attention(q, c.k_pack, c.k_params, c.v_pack, c.v_params, c.k_res, c.v_res, c.seqlens,
                            fmt=fmt, backend="reference")


def test_rotation_is_orthogonal_and_its_own_inverse(gen):
    fmt = bd.KVFormat(hadamard=True)
    x = torch.randn(5, 3, 128, generator=gen)  # fp32: the round trip is exact to rounding
    torch.testing.assert_close(reference.rotate(reference.rotate(x, fmt), fmt), x, rtol=0, atol=1e-5)
    torch.testing.assert_close(reference.rotate(x, fmt).norm(dim=-1), x.norm(dim=-1))
    assert reference.rotate(x, bd.KVFormat()) is x  # no rotation unless the format asks


@pytest.mark.parametrize("fmt", [bd.KVFormat(bits=2, group_size=32, sink_tokens=16, hadamard=True),
                                 bd.KVFormat(bits=4, v_bits=2, k_mode="token", group_size=64, hadamard=True)],
                         ids=["2bit-s16-h", "k4v2-token-h"])
def test_hadamard_cache_equals_the_float64_model(fmt, gen):
    """K is stored rotated (K H, rounded once to 16 bits), then quantized as the format
    says; decode rotates q the same way, so the output is the model's attention over
    (q H, K H); ``dequantized`` hands K back in the model's basis."""
    h, d, gq = 2, 64, 3
    k, v = kvdata.kv(gen, 2, 600, h, d)
    cache = bd.KVCache.allocate(2, h, d, 608, fmt, device="cpu", backend="reference")
    cache.prefill(k[:, :300], v[:, :300], [300, 260])
    cache.append(k[:, 300:], v[:, 300:])  # appends rotate K as the prefill does
    seqs = [(k[0], v[0]), (torch.cat([k[1, :260], k[1, 300:]]), torch.cat([v[1, :260], v[1, 300:]]))]
    q = kvdata.randn(gen, 2, 1, h * gq, d)
    out = cache.decode(q)
    qr = reference.rotate(q, fmt)
    c = cache.tensors()
    for b, (kb, vb) in enumerate(seqs):
        n = kb.shape[0]
        want_k, want_v = model_kv(fmt, reference.rotate(kb, fmt), vb)
        got_k, got_v = reference.gather_kv(b, n, c.k_pack, c.k_params, c.v_pack, c.v_params, c.k_res, c.v_res,
                                           c.block_table, fmt, c.sinks)
        assert torch.equal(got_k.double(), want_k) and torch.equal(got_v.double(), want_v), f"sequence {b}"
        torch.testing.assert_close(out[b, 0].double(), model_attention(qr[b, 0], want_k, want_v), rtol=2e-3, atol=2e-3)
        back, _ = cache.dequantized(b)
        torch.testing.assert_close(back.double(), reference.rotate(want_k, fmt), rtol=1e-2, atol=1e-2)


def test_a_paged_cache_checks_only_the_pages_its_packed_tokens_use():
    """Sink tokens hold no page: a sequence of 4 sinks and 126 residual tokens packs
    nothing, so a junk entry in its table is never used and is not refused (the table check
    counts the lengths less the sinks)."""
    fmt = bd.KVFormat(bits=4, group_size=64, sink_tokens=4)
    c = bd.KVCache.allocate(2, 2, 64, 512, fmt, device="cpu", page_size=128, backend="reference")
    gen = torch.Generator().manual_seed(2)
    k, v = kvdata.kv(gen, 2, 200, 2, 64, dtype=torch.float16, device="cpu")
    c.block_table[0, 0] = 99  # no such page
    c.prefill(k, v, [130, 200])
    c.append(k[:, :1], v[:, :1])
    assert c.lengths == [131, 201] and torch.isfinite(c.decode(kvdata.randn(gen, 2, 1, 4, 64))).all()
    with pytest.raises(ValueError, match=r"block_table entries in use must lie in \[0, 8\), got \[4, 99\]"):
        c.prefill(k, v, [140, 200])  # 136 packable tokens: one block, on page 99


def test_sinks_with_a_callers_table_truncate_and_reorder_touch_only_pages_in_use():
    """Sink tokens hold no page.  Truncating into the sinks reads no table entry (an unused
    one may hold anything), and a reorder copies only the pages a sequence's packed tokens
    use (an unused entry naming another sequence's live page is not written)."""
    fmt = bd.KVFormat(bits=4, group_size=64, sink_tokens=8)
    gen = torch.Generator().manual_seed(5)
    c = bd.KVCache.allocate(1, 2, 64, 512, fmt, device="cpu", page_size=128, backend="reference")
    k, v = kvdata.kv(gen, 1, 300, 2, 64, dtype=torch.float16, device="cpu")
    c.prefill(k, v)  # 8 sinks, 2 packed blocks, 36 residual tokens
    c.block_table[0, -1] = 10**6  # unused
    c.truncate(296)  # 4 tokens left, all sinks
    assert c.lengths == [4]
    kd, vd = c.dequantized(0)
    assert torch.equal(kd, k[0, :4]) and torch.equal(vd, v[0, :4])
    c = bd.KVCache.allocate(2, 2, 64, 384, fmt, device="cpu", page_size=128, backend="reference")
    c.block_table.copy_(torch.tensor([[0, 2, 4], [2, 3, 5]], dtype=torch.int32))  # seq 0's unused column 1 is seq 1's page
    k, v = kvdata.kv(gen, 2, 260, 2, 64, dtype=torch.float16, device="cpu")
    c.prefill(k, v)  # 8 sinks, 1 packed block (one page), 124 residual tokens each
    want = c.dequantized(1)
    c.reorder([1, 1])
    for b in (0, 1):
        got = c.dequantized(b)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), b
