"""KVCache on the reference backend: accuracy vs 16-bit attention, appends vs prefill,
variable lengths and paged storage."""

import pytest
import torch

import bitdecode as bd
import kvdata
from kvdata import DTYPES

HKV, HQ, D, G = 2, 8, 64, 32


def allocate(bits, k_mode="channel", *, batch=2, max_seqlen=600, dtype=torch.float16, device="cpu",
             page_size=None, group_size=G):
    fmt = bd.KVFormat(bits=bits, k_mode=k_mode, group_size=group_size)
    return bd.KVCache.allocate(batch, HKV, D, max_seqlen, fmt, dtype=dtype, device=device,
                               page_size=page_size, backend="reference")


def expected(q, k, v, fmt, lens, softmax_scale=None):
    """Attention in fp32 over what the cache should hold (independent of the packing)."""
    ks, vs = zip(*(kvdata.fake_quant_cache(k[b], v[b], fmt, n) for b, n in enumerate(lens)))
    return kvdata.batch_attention(q, ks, vs, softmax_scale)


def assert_out_close(out, ref_out, dtype):
    """``out`` is the fp32 result rounded once to 16 bits: within one 16-bit ulp."""
    torch.testing.assert_close(out.float(), ref_out, rtol=2.0 ** -kvdata.MANTISSA_BITS[dtype], atol=1e-6)


# --------------------------------------------------------------------------------------
# Accuracy
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k_mode", ["channel", "token"])
def test_error_vs_16bit_shrinks_from_2_to_4_bits(dtype, k_mode, gen, device):
    n = 600  # 4-bit: 4 packed blocks + 88 residual tokens; 2-bit: 2 blocks + 88
    k, v = kvdata.kv(gen, 2, n, HKV, D, dtype=dtype, device=device)
    q = kvdata.randn(gen, 2, 1, HQ, D, dtype=dtype, device=device)
    ref_out, _ = kvdata.batch_attention(q, k, v)
    err = {}
    for bits in (4, 2):
        cache = allocate(bits, k_mode, dtype=dtype, device=device)
        cache.prefill(k, v)
        out = bd.decode(q, cache)
        assert out.shape == q.shape and out.dtype == dtype
        err[bits] = kvdata.rel_err(out, ref_out)
    # random V has no structure to average out, so errors stay near those of single
    # values: about 0.2 at 4 bits, 1 to 2.5 at 2 bits (token mode suffers the outliers)
    assert 0.0 < err[4] < 0.35, err
    assert err[4] < 0.35 * err[2], err  # the step shrinks 5x from 2 to 4 bits


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("k_mode", ["channel", "token"])
def test_exact_on_the_quantization_grid(dtype, bits, k_mode, gen, device):
    cache = allocate(bits, k_mode, dtype=dtype, device=device)
    n = 2 * cache.fmt.residual_block + G  # the last G tokens stay in the 16-bit residual
    shape = (2, n, HKV, D)
    k = kvdata.on_grid(gen, shape, bits, G, dim=1 if k_mode == "channel" else -1, dtype=dtype, device=device)
    v = kvdata.on_grid(gen, shape, bits, G, dim=-1, dtype=dtype, device=device)
    q = kvdata.randn(gen, 2, 1, HQ, D, dtype=dtype, device=device)
    cache.prefill(k, v)
    for b in range(2):
        kb, vb = cache.dequantized(b)
        assert torch.equal(kb, k[b]) and torch.equal(vb, v[b])
    out, lse = bd.decode(q, cache, return_lse=True)
    ref_out, ref_lse = kvdata.batch_attention(q, k, v)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-6, atol=1e-5)
    assert_out_close(out, ref_out, dtype)


@pytest.mark.parametrize("bits", [4, 2])
def test_decode_matches_fake_quantized_attention(bits, gen, device):
    """Whole packed blocks dequantize as quantize/dequantize does; the residual is 16-bit."""
    cache = allocate(bits, "channel", device=device)
    n = cache.fmt.residual_block + 50
    k, v = kvdata.kv(gen, 2, n, HKV, D, device=device)
    q = kvdata.randn(gen, 2, 1, HQ, D, device=device)
    cache.prefill(k, v)
    for scale in (None, 0.05):
        out, lse = cache.decode(q, softmax_scale=scale, return_lse=True)
        ref_out, ref_lse = expected(q, k, v, cache.fmt, [n, n], scale)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-6, atol=1e-5)
        assert_out_close(out, ref_out, torch.float16)


# --------------------------------------------------------------------------------------
# Appends
# --------------------------------------------------------------------------------------


def assert_same_cache(a, b):
    for name in ("k_pack", "k_params", "v_pack", "v_params", "seqlens"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.lengths == b.lengths
    for i, n in enumerate(a.lengths):
        r = n % a.fmt.residual_block
        assert torch.equal(a.k_res[i, :r], b.k_res[i, :r]) and torch.equal(a.v_res[i, :r], b.v_res[i, :r])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("k_mode", ["channel", "token"])
def test_append_token_by_token_equals_prefill(dtype, bits, k_mode, gen, device):
    n = 300  # 4-bit: 2 blocks + 44; 2-bit: 1 block + 44
    k, v = kvdata.kv(gen, 2, n, HKV, D, dtype=dtype, device=device)
    q = kvdata.randn(gen, 2, 1, HQ, D, dtype=dtype, device=device)
    whole = allocate(bits, k_mode, dtype=dtype, device=device)
    whole.prefill(k, v)
    steps = allocate(bits, k_mode, dtype=dtype, device=device)
    for t in range(n):
        steps.append(k[:, t:t + 1], v[:, t:t + 1])
    assert whole.lengths == steps.lengths == [n, n]
    assert_same_cache(whole, steps)
    chunks = allocate(bits, k_mode, dtype=dtype, device=device)
    chunks.prefill(k[:, :37], v[:, :37])
    for a, b in [(37, 38), (38, 128), (128, 130), (130, 300)]:
        chunks.append(k[:, a:b], v[:, a:b])
    assert_same_cache(whole, chunks)
    assert torch.equal(bd.decode(q, whole), bd.decode(q, steps))


# --------------------------------------------------------------------------------------
# Variable lengths and pages
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [4, 2])
def test_variable_lengths(bits, gen, device):
    nr = bd.KVFormat(bits=bits).residual_block
    lens = [0, 1, nr - 1, nr, nr + 5, 2 * nr + 3]
    n = max(lens) + 4  # tokens past seqlens[b] are ignored
    k, v = kvdata.kv(gen, len(lens), n, HKV, D, device=device)
    q = kvdata.randn(gen, len(lens), 1, HQ, D, device=device)
    cache = allocate(bits, batch=len(lens), max_seqlen=n, device=device)
    cache.prefill(k, v, seqlens=lens)
    assert cache.lengths == lens and cache.seqlens.tolist() == lens
    out, lse = bd.decode(q, cache, return_lse=True)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and bool((lse[0] == -float("inf")).all())
    ref_out, ref_lse = expected(q, k, v, cache.fmt, lens)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-6, atol=1e-5)
    assert_out_close(out, ref_out, torch.float16)
    for b, length in enumerate(lens):  # each row as if decoded alone
        one = allocate(bits, batch=1, max_seqlen=n, device=device)
        one.prefill(k[b:b + 1, :length], v[b:b + 1, :length])
        assert torch.equal(bd.decode(q[b:b + 1], one), out[b:b + 1])


@pytest.mark.parametrize("bits,k_mode", [(4, "channel"), (4, "token"), (2, "channel")])
@pytest.mark.parametrize("pages_per_block", [1, 2])
def test_paged_with_shuffled_block_table_equals_dense(bits, k_mode, pages_per_block, gen, device):
    nr = bd.KVFormat(bits=bits).residual_block
    page = pages_per_block * nr
    lens = [3 * nr + 10, nr + 1, 2 * nr - 1]
    n = 3 * nr + 30
    k, v = kvdata.kv(gen, 3, n, HKV, D, device=device)
    q = kvdata.randn(gen, 3, 1, HQ, D, device=device)
    dense = allocate(bits, k_mode, batch=3, max_seqlen=n, device=device)
    paged = allocate(bits, k_mode, batch=3, max_seqlen=n, device=device, page_size=page)
    assert paged.page_size == page and paged.block_table.shape[0] == 3
    perm = torch.randperm(paged.block_table.numel(), generator=gen).to(torch.int32)
    paged.block_table.copy_(perm.view_as(paged.block_table))
    for cache in (dense, paged):
        cache.prefill(k[:, :n - 20], v[:, :n - 20], seqlens=lens)
    # the pages hold what the dense cache holds, where the block table says
    for b, length in enumerate(lens):
        for j in range(length // nr * nr // page):
            p = int(paged.block_table[b, j])
            assert torch.equal(paged.k_pack[p], dense.k_pack[b, :, j * page:(j + 1) * page])
            assert torch.equal(paged.v_pack[p], dense.v_pack[b, :, j * page // nr:(j + 1) * page // nr])
    assert torch.equal(bd.decode(q, paged), bd.decode(q, dense))
    for t in range(n - 20, n):  # decode steps crossing block and page boundaries
        for cache in (dense, paged):
            cache.append(k[:, t:t + 1], v[:, t:t + 1])
    assert paged.lengths == dense.lengths == [x + 20 for x in lens]
    out = bd.decode(q, paged)
    assert torch.equal(out, bd.decode(q, dense))
    c = paged.tensors()
    functional = bd.decode_attention(q, c.k_pack, c.k_params, c.v_pack, c.v_params, c.k_res, c.v_res,
                                     c.cache_seqlens, c.block_table, fmt=paged.fmt, backend="reference")
    assert torch.equal(functional, out)


# --------------------------------------------------------------------------------------
# Storage
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits,limit", [(4, 0.30), (2, 0.17)])
def test_memory_vs_16bit_at_32k_tokens(bits, limit):
    fmt = bd.KVFormat(bits=bits)
    n, hkv, d = 32768, 8, 128
    cache = bd.KVCache.allocate(1, hkv, d, n, fmt, device="cpu")
    nr = fmt.residual_block
    accounted = (fmt.bytes_per_token(d) * n * hkv  # packed K/V + params
                 + 2 * nr * hkv * d * 2            # 16-bit residual blocks
                 + 4 + 4)                          # seqlens, block table
    assert cache.memory_bytes() == accounted
    assert cache.memory_bytes() / (2 * n * hkv * d * 2) <= limit


def test_reset_then_reuse(gen):
    cache = allocate(4)
    k, v = kvdata.kv(gen, 2, 200, HKV, D)
    q = kvdata.randn(gen, 2, 1, HQ, D)
    cache.prefill(k, v)
    first = bd.decode(q, cache)
    cache.reset()
    assert cache.lengths == [0, 0] and cache.seqlens.tolist() == [0, 0]
    assert torch.equal(bd.decode(q, cache), torch.zeros_like(first))
    cache.append(k, v)
    assert torch.equal(bd.decode(q, cache), first)


def test_prefill_rejects_a_block_table_that_shares_or_leaves_the_pages(gen):
    """A caller-edited block table is checked before the prompt is packed into it."""
    cache = allocate(4, batch=2, max_seqlen=512, page_size=256)
    k = torch.randn(2, 512, HKV, D, generator=gen).half()
    snap = [t.clone() for t in (cache.k_pack, cache.k_params, cache.v_pack, cache.v_params)]
    cache.block_table[1, 0] = cache.block_table[0, 1]  # sequence 1's first page is sequence 0's second
    with pytest.raises(ValueError, match=r"page 1 is used more than once \(sequences \[0, 1\]\)"):
        cache.prefill(k, k)
    cache.block_table[1, 0] = 7
    with pytest.raises(ValueError, match=r"block_table entries in use must lie in \[0, 4\), got \[0, 7\]"):
        cache.prefill(k, k)
    assert all(torch.equal(a, b) for a, b in zip(snap, (cache.k_pack, cache.k_params, cache.v_pack, cache.v_params)))
    assert cache.lengths == [0, 0]
    # only the pages the lengths use are checked: a short second sequence may keep a bad entry
    cache.prefill(k, k, seqlens=[512, 100])
    assert cache.lengths == [512, 100]


def _as_if_on_a_gpu(cache):
    """A CPU cache whose prefill takes the GPU's rule for the table check (the only use of
    the flag on prefill's path)."""
    cache._on_cuda = True
    return cache


def test_prefill_checks_the_block_table_only_after_an_edit(gen, monkeypatch):
    """On a GPU the table check costs a device sync per prefill (a model's prefill runs one
    per layer), so it runs only when the table may be wrong: after an in-place edit (its
    version counter moved), or for lengths past those it was verified for."""
    from bitdecode import attention

    calls = []
    real = attention.check_block_table
    monkeypatch.setattr(attention, "check_block_table", lambda c, lens: calls.append(lens.tolist()) or real(c, lens))
    cache = _as_if_on_a_gpu(allocate(4, batch=2, max_seqlen=512, page_size=256))
    k = torch.randn(2, 512, HKV, D, generator=gen).half()
    cache.prefill(k, k)
    assert calls == []  # allocate's own table: distinct pages for every length
    cache.block_table[1, 0] = cache.block_table[0, 1]
    with pytest.raises(ValueError, match="page 1 is used more than once"):
        cache.prefill(k, k)
    cache.block_table[1, 0], cache.block_table[1, 1] = 2, 7  # page 7 does not exist
    cache.prefill(k, k, seqlens=[512, 100])  # sequence 1 packs no page yet: verified as it is
    assert len(calls) == 2
    cache.prefill(k, k, seqlens=[300, 60])  # within the verified lengths, table untouched
    assert len(calls) == 2
    with pytest.raises(ValueError, match=r"must lie in \[0, 4\), got \[0, 7\]"):
        cache.prefill(k, k, seqlens=[512, 512])  # past them: checked, and page 7 refused
    assert len(calls) == 3
    with torch.inference_mode():  # an inference-mode table has no version counter: always checked
        cache = _as_if_on_a_gpu(allocate(4, batch=2, max_seqlen=512, page_size=256))
        cache.prefill(k, k)
        cache.prefill(k, k)
    assert len(calls) == 5


def test_a_block_table_narrower_than_the_lengths_is_refused_by_name(gen):
    """A table resized in place to fewer pages than the lengths need is refused naming
    block_table before the write, not with an index error inside it."""
    cache = allocate(4, batch=2, max_seqlen=512, page_size=128)
    k = torch.randn(2, 300, HKV, D, generator=gen).half()
    cache.prefill(k, k)
    snap = [t.clone() for t in (cache.k_pack, cache.k_params, cache.v_pack, cache.v_params, cache.k_res)]
    cache.block_table.resize_(2, 2)
    with pytest.raises(ValueError, match="block_table has 2 pages a sequence, but these lengths need 3 pages"):
        cache.append(k[:, :100], k[:, :100])
    with pytest.raises(ValueError, match="block_table has 2 pages a sequence, but these lengths need 4 pages"):
        cache.prefill(torch.cat([k, k[:, :212]], 1), torch.cat([k, k[:, :212]], 1))
    assert all(torch.equal(a, b) for a, b in zip(snap, (cache.k_pack, cache.k_params, cache.v_pack, cache.v_params,
                                                         cache.k_res)))
    assert cache.lengths == [300, 300]


def test_a_cpu_prefill_checks_a_table_edited_past_torch(gen):
    """A write through ``.data`` (or numpy, DLPack) leaves the version counter where it was;
    on the CPU, where the check costs no sync, prefill checks the table every time, so such
    an edit cannot pack one sequence over another's pages."""
    cache = allocate(4, batch=2, max_seqlen=512, page_size=128)
    k = torch.randn(2, 300, HKV, D, generator=gen).half()
    cache.prefill(k, k)
    snap = [t.clone() for t in (cache.k_pack, cache.k_params, cache.v_pack, cache.v_params)]
    version = cache.block_table._version
    cache.block_table.data[1, 0] = 0  # sequence 1's first page is sequence 0's
    assert cache.block_table._version == version
    with pytest.raises(ValueError, match=r"page 0 is used more than once \(sequences \[0, 1\]\)"):
        cache.prefill(k, k)
    cache.block_table.numpy()[1, 0] = 9  # past the pages
    with pytest.raises(ValueError, match=r"block_table entries in use must lie in \[0, 8\)"):
        cache.prefill(k, k)
    assert all(torch.equal(a, b) for a, b in zip(snap, (cache.k_pack, cache.k_params, cache.v_pack, cache.v_params)))
    assert cache.lengths == [300, 300]


# --------------------------------------------------------------------------------------
# capacity flags (the device side runs in test_reliability_gpu.py)
# --------------------------------------------------------------------------------------


def test_check_reports_refused_appends_by_sequence():
    """``check()`` names every sequence the device flagged, keeps the flags until reset,
    and otherwise brings the host lengths up to the device's."""
    c = bd.KVCache.allocate(3, 2, 64, 300, bd.KVFormat(bits=4, group_size=64), device="cpu", backend="reference")
    assert c.capacity == 300
    c.check()
    c.seqlens.copy_(torch.tensor([5, 6, 7], dtype=torch.int32))  # as graph replays would leave them
    c.check()
    assert c.lengths == [5, 6, 7]
    c.overflow[1] = 301
    c.overflow[2] = 302
    for _ in range(2):
        with pytest.raises(bd.CacheOverflowError, match=r"sequence 1 \(asked for 301 tokens\), sequence 2 "
                                                        r"\(asked for 302 tokens\): capacity is 300"):
            c.check()
    assert c.lengths == [5, 6, 7]
    c.reset()
    c.check()
    assert c.lengths == [0, 0, 0]


# --------------------------------------------------------------------------------------
# truncate (speculative decoding's rejected drafts)
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", [bd.KVFormat(bits=4, group_size=64), bd.KVFormat(bits=2, k_mode="token", group_size=32),
                                 bd.KVFormat(bits=4, v_bits=2, group_size=64, sink_tokens=7)],
                         ids=["4bit", "2bit-token", "k4v2-s7"])
@pytest.mark.parametrize("tokens", [0, 30, 130, 405])
def test_truncate_keeps_what_the_cache_held(fmt, tokens, gen):
    """After truncate(t) every sequence dequantizes to the first len - t tokens of what it
    held (a packed block the new end falls in returns to the residual as its dequantized
    values), and later appends and decodes run on as usual."""
    k, v = kvdata.kv(gen, 2, 600, 2, 64)
    c = bd.KVCache.allocate(2, 2, 64, 900, fmt, device="cpu", backend="reference", page_size=256)
    c.prefill(k[:, :300], v[:, :300], [300, 290])
    c.append(k[:, 300:420], v[:, 300:420])
    held = [c.dequantized(b) for b in range(2)]
    c.truncate(tokens)
    assert c.lengths == [420 - tokens, 410 - tokens] and c.seqlens.tolist() == c.lengths
    for b in range(2):
        kd, vd = c.dequantized(b)
        n = held[b][0].shape[0] - tokens
        assert torch.equal(kd, held[b][0][:n]) and torch.equal(vd, held[b][1][:n])
    c.append(k[:, 500:600], v[:, 500:600])
    assert c.lengths == [520 - tokens, 510 - tokens]
    assert torch.isfinite(c.decode(kvdata.randn(gen, 2, 1, 4, 64))).all()


def test_truncate_rejects_bad_counts():
    c = bd.KVCache.allocate(2, 2, 64, 300, bd.KVFormat(bits=4, group_size=64), device="cpu", backend="reference")
    k = torch.zeros(2, 5, 2, 64, dtype=torch.float16)
    c.prefill(k, k, [5, 3])
    for bad, msg in ((-1, "tokens must be an int >= 0"), (1.0, "tokens must be an int >= 0"),
                     (4, "more than sequence 1 holds")):
        with pytest.raises(ValueError, match=msg):
            c.truncate(bad)
    assert c.lengths == [5, 3]
    c.truncate(3)  # a sequence may be emptied
    assert c.lengths == [2, 0] and c.seqlens.tolist() == [2, 0]


def test_kernel_decode_keeps_its_plan_for_the_fast_path(monkeypatch):
    """The host side of a kernel decode (a stand-in plan on the CPU): the first call plans
    with the cache's plan table and longest length and is remembered, the next identical
    call takes the fast path without planning, and a query whose rows the kernels cannot
    take as they are is copied and not remembered."""
    from bitdecode import attention

    c = bd.KVCache.allocate(1, 1, 64, 256, bd.KVFormat(group_size=64), device="cpu", backend="reference")
    c.backend = "sm80"
    made = []

    def plan_decode(cache, q, backend, splits, max_len, plans=None):
        made.append((backend, max_len, plans is c._plans))
        return lambda q, scale_log2, return_lse: (q, scale_log2)

    monkeypatch.setattr(attention, "plan_decode", plan_decode)
    q = torch.ones(1, 1, 2, 64, dtype=torch.float16)
    first, second = c.decode(q), c.decode(q)
    assert first[0] is q and second[0] is q and first[1] == second[1] == 64 ** -0.5 * attention.LOG2_E
    assert made == [("sm80", 0, True)]  # the second call took the fast path
    padded = torch.ones(1, 1, 2, 128, dtype=torch.float16)[..., :64]
    out, _ = c.decode(padded)
    assert out is not padded and out.is_contiguous() and len(made) == 2
    assert c.decode(q)[0] is q and len(made) == 2  # the remembered plan is still the aligned query's


@pytest.mark.parametrize("fmt, dtype, batch, hkv, hq, tokens, sm80", [
    (bd.KVFormat(bits=2), torch.float16, 1, 8, 32, 8192, True),  # 2-bit GQA 4, up to 16 pairs: up to 8K
    (bd.KVFormat(bits=2), torch.float16, 1, 8, 32, 8193, False),
    (bd.KVFormat(bits=2), torch.bfloat16, 2, 8, 32, 8192, True),
    (bd.KVFormat(bits=2), torch.float16, 4, 8, 32, 4096, True),  # 32 pairs: up to 4K
    (bd.KVFormat(bits=2), torch.float16, 4, 8, 32, 4097, False),
    (bd.KVFormat(bits=2), torch.float16, 5, 8, 32, 1024, False),  # 40 pairs: no tier
    (bd.KVFormat(bits=4, v_bits=2), torch.float16, 1, 8, 32, 16384, True),  # K4V2: up to 16K
    (bd.KVFormat(bits=4, v_bits=2), torch.float16, 1, 8, 32, 16385, False),
    (bd.KVFormat(bits=4, v_bits=2), torch.bfloat16, 2, 8, 32, 8192, True),  # 16 pairs: up to 8K
    (bd.KVFormat(bits=4, v_bits=2), torch.float16, 2, 8, 32, 8193, False),
    (bd.KVFormat(bits=4), torch.float16, 1, 8, 32, 1024, False),  # 4-bit GQA 4: sm90 (the H200 led)
    (bd.KVFormat(bits=4), torch.float16, 1, 8, 32, 0, False),  # (no tier: not even empty sequences)
    (bd.KVFormat(bits=4), torch.float16, 1, 8, 8, 2048, True),  # 4-bit MHA: up to 2K
    (bd.KVFormat(bits=4), torch.float16, 1, 8, 8, 2049, False),
    (bd.KVFormat(bits=2), torch.float16, 1, 32, 32, 4096, True),  # 2-bit MHA at 32 pairs: up to 4K
    (bd.KVFormat(bits=2), torch.float16, 2, 32, 32, 1024, False),  # 64 pairs
    (bd.KVFormat(bits=2), torch.float16, 1, 8, 64, 1024, False),  # GQA 8: the 8-head tile, not measured
    (bd.KVFormat(bits=2, group_size=64), torch.float16, 1, 8, 32, 1024, False),  # not measured
    (bd.KVFormat(bits=4, fp4="nvfp4"), torch.float16, 1, 8, 8, 1024, False),
])
def test_auto_hands_short_small_grids_from_sm90_to_sm80(fmt, dtype, batch, hkv, hq, tokens, sm80, monkeypatch):
    """``auto`` on a cache whose backend is sm90 runs a decode on sm80 where sm90's
    ``SM80_SHORT`` says sm80's kernels measured faster (short sequences of small grids);
    an explicit backend or split count keeps sm90, and the fast path keeps the decision
    with the tile count, so a longer sequence goes back to sm90 (a stand-in plan on the
    CPU records the backend each call planned for)."""
    from bitdecode import attention

    c = bd.KVCache.allocate(batch, hkv, 128, 16384 + 256, fmt, dtype=dtype, device="cpu", backend="reference")
    c.backend, c._auto_picked = "sm90", True  # (as ``auto`` picks it on Hopper)
    made = []

    def plan_decode(cache, q, backend, splits, max_len, plans=None):
        made.append(backend)
        return lambda q, scale_log2, return_lse: q

    monkeypatch.setattr(attention, "plan_decode", plan_decode)
    q = torch.ones(batch, 1, hq, 128, dtype=dtype)
    want = "sm80" if sm80 else "sm90"
    c._host_max = tokens
    assert c.backend_for(q) == want
    c.decode(q)
    c.decode(q)  # (the fast path)
    assert made == [want]
    c.decode(q, backend="sm90")
    c.decode(q, num_splits=2)
    assert made[1:] == ["sm90", "sm90"]
    if sm80:  # a longer sequence goes back to sm90; a cache allocated for sm90 by name stays there
        c._host_max = 16384 + 256
        c.decode(q)
        assert made[-1] == "sm90" and c.backend_for(q) == "sm90"
        c._host_max, c._auto_picked = tokens, False
        c.decode(q)
        assert made[-1] == "sm90" and c.backend_for(q) == "sm90"


def test_sm80_short_tier_of_no_tokens_is_a_lower_bound_on_pairs(monkeypatch):
    """A tier of 0 tokens in ``SM80_SHORT`` hands nothing off and bounds the pairs of the
    tiers after it from below (how a many-pairs tier is written)."""
    from bitdecode.kernels_sm90 import backend as sm90_backend

    fmt = bd.KVFormat(bits=4)
    monkeypatch.setitem(sm90_backend.SM80_SHORT, (4, 4, True), ((256, 0), (512, 1024)))
    short = [sm90_backend.sm80_short(fmt, torch.float16, 128, pairs, 4, 1, tokens)
             for pairs, tokens in ((256, 1024), (257, 1024), (512, 1024), (512, 1025), (513, 1024))]
    assert short == [False, True, True, False, False]


def test_auto_hands_a_short_appending_decode_to_sm80(monkeypatch):
    """The appending decode follows the same rule at the length it decodes (its new token
    counted): the one-launch plan is sm80's at a short 2-bit B=1 sequence."""
    from bitdecode import attention
    from bitdecode.kernels_sm80 import backend as sm80_backend

    c = bd.KVCache.allocate(1, 8, 128, 400, bd.KVFormat(bits=2), device="cpu", backend="reference")
    z = torch.zeros(1, 300, 8, 128, dtype=torch.float16)
    c.prefill(z, z)
    c.backend, c._auto_picked = "sm90", True
    made = []

    class Plan:
        def append_step(self, q, k_new, v_new, scale_log2, return_lse, stream):
            return q

    def plan_decode(cache, q, backend, splits, max_len, plans=None, append=False):
        made.append((backend, max_len, append))
        return Plan()

    monkeypatch.setattr(attention, "plan_decode", plan_decode)
    monkeypatch.setattr(sm80_backend.Sm80Backend, "choose_splits", lambda self, *a: 2)
    q, new = torch.ones(1, 1, 32, 128, dtype=torch.float16), torch.zeros(1, 1, 8, 128, dtype=torch.float16)
    assert c.decode(q, k_new=new, v_new=new) is q
    assert made == [("sm80", 301, True)]


def test_appending_decode_on_the_reference_is_append_then_decode(gen):
    """``decode(q, cache, k_new=, v_new=)`` appends first: on the reference backend (the two
    calls) the same outputs, lengths and bytes as ``append`` then ``decode``; one of the
    two alone, or a K of another shape, is refused by name before anything is written."""
    a, b = allocate(4), allocate(4)
    k, v = kvdata.kv(gen, 2, 140, HKV, D)
    for c in (a, b):
        c.prefill(k[:, :120], v[:, :120], [120, 60])
    for t in range(120, 140):  # the first sequence completes a block on the way
        q = torch.randn(2, 1, HQ, D, generator=gen).half()
        got = bd.decode(q, a, k_new=k[:, t:t + 1], v_new=v[:, t:t + 1])
        b.append(k[:, t:t + 1], v[:, t:t + 1])
        assert torch.equal(got, bd.decode(q, b))
    assert a.lengths == b.lengths == [140, 80]
    assert all(torch.equal(getattr(a, n), getattr(b, n)) for n in ("k_pack", "k_params", "v_pack", "v_params",
                                                                   "k_res", "v_res", "seqlens"))
    with pytest.raises(ValueError, match="k_new and v_new"):
        bd.decode(q, a, k_new=k[:, :1])
    with pytest.raises(ValueError, match="^k_new must have shape"):
        bd.decode(q, a, k_new=k[:, :1, :1], v_new=v[:, :1, :1])
    with pytest.raises(TypeError, match="^v_new must have dtype"):
        bd.decode(q, a, k_new=k[:, :1], v_new=v[:, :1].float())
    assert a.lengths == [140, 80]


def _stand_in_appending_cache(monkeypatch, max_seqlen: int = 140, inference: bool = False):
    """A CPU cache whose backend says it appends, with a stand-in plan that records its
    calls: (cache, fused calls' ``new`` lengths, plain calls and appends, whether each q
    was dense, the split count ``choose_splits`` gives); ``inference``: made under
    ``torch.inference_mode()``."""
    from bitdecode import attention
    from bitdecode.kernels_sm80 import backend as sm80_backend

    fmt = bd.KVFormat(bits=4, group_size=64, sink_tokens=2)
    with torch.inference_mode(inference):
        c = bd.KVCache.allocate(2, 1, 64, max_seqlen, fmt, device="cpu", backend="reference")
        z = torch.zeros(2, 130, 1, 64, dtype=torch.float16)
        c.prefill(z, z, [1, 125])
    c.backend = "sm80"
    fused, plain, dense, splits = [], [], [], [2]

    class Plan:
        decode_fn = None

        def __call__(self, q, scale_log2, return_lse):
            plain.append(0)
            dense.append(q.is_contiguous())
            return q

        def append_step(self, q, k_new, v_new, scale_log2, return_lse, stream):
            fused.append(len((k_new, v_new)))
            dense.append(q.is_contiguous())
            return q

    monkeypatch.setattr(attention, "plan_decode", lambda *a, **kw: Plan())
    monkeypatch.setattr(sm80_backend.Sm80Backend, "appends", True)
    monkeypatch.setattr(sm80_backend.Sm80Backend, "choose_splits", lambda self, *a: splits[0])
    def append(k, v, names):
        plain.append("append")
        c._host_added, c._host_max, c._fuse_room = c._host_added + 1, c._host_max + 1, None

    monkeypatch.setattr(c, "_append", append)
    return c, fused, plain, dense, splits


def test_appending_decode_takes_the_kernel_while_no_block_completes(monkeypatch):
    """The host side of the one-launch appending decode (a stand-in plan on the CPU, the
    backend made to say it appends): steps run it, with the new K and V token after q (the
    plan holds the commit counters), until a sequence's next token would complete its
    residual block, fall among the sink tokens or pass max_seqlen; those steps take append
    + decode."""
    c, fused, plain, dense, _ = _stand_in_appending_cache(monkeypatch)
    q = torch.ones(2, 1, 2, 64, dtype=torch.float16)
    kv = torch.zeros(2, 1, 1, 64, dtype=torch.float16)
    steps = []
    for _ in range(12):
        before = len(fused)
        c.decode(q, k_new=kv, v_new=kv)
        steps.append(len(fused) > before)
    # lengths 1 / 125 (2 sinks, Nr 128): the first's token goes to the sinks (step 0), the
    # second's (126 after it) completes its block at length 130 (step 4)
    assert steps == [False, True, True, True, False] + [True] * 7, steps
    assert c.lengths == [13, 137] and set(fused) == {2}
    assert c._append_room() == 140 - 137  # then capacity bounds it
    sparse = torch.ones(2, 1, 4, 64, dtype=torch.float16)[:, :, ::2]  # heads 128 apart: copied for the kernel
    c.decode(sparse, k_new=kv, v_new=kv)
    assert len(fused) == 11 and all(dense)
    # on the fast path (q as before), a v_new of another shape but the same strides (one
    # sequence short) is refused, not read past its end
    c.decode(q, k_new=kv, v_new=kv)
    with pytest.raises(ValueError, match="^v_new must have shape"):
        c.decode(q, k_new=kv, v_new=kv[:1])
    with pytest.raises(TypeError, match="^k_new must be a torch.Tensor"):
        c.decode(q, k_new="k", v_new=kv)
    assert len(fused) == 12 and c.lengths == [15, 139]


def test_appending_decode_of_an_inference_mode_cache_outside_it_is_refused(monkeypatch):
    """The cache's rule for inference-mode caches holds on the one-launch path too (whose
    kernel writes would pass torch): outside inference_mode the call is refused before any
    write, the first step and a step on the fast path alike; inside it runs."""
    c, fused, plain, _, _ = _stand_in_appending_cache(monkeypatch, inference=True)
    q = torch.ones(2, 1, 2, 64, dtype=torch.float16)
    kv = torch.zeros(2, 1, 1, 64, dtype=torch.float16)
    with torch.inference_mode():
        c.decode(q, k_new=kv, v_new=kv)  # (sinks filled: the next steps take the kernel)
        c.decode(q, k_new=kv, v_new=kv)
    assert len(fused) == 1 and c.lengths == [3, 127]
    with pytest.raises(RuntimeError, match=r"^decode\(k_new=, v_new=\): this cache was allocated under "
                                           "torch.inference_mode"):
        c.decode(q, k_new=kv, v_new=kv)
    assert len(fused) == 1 and c.lengths == [3, 127] and c._host_max == 127


def test_appending_decode_takes_two_calls_past_the_merge_splits(monkeypatch):
    """More splits than the backend's ``append_max_splits`` (its kernel's last CTA merges
    them, which costs GPU time with many) take append + decode, chosen or asked for."""
    from bitdecode import backend as backends

    c, fused, plain, _, splits = _stand_in_appending_cache(monkeypatch, 400)
    limit = backends.get("sm80").append_max_splits
    q = torch.ones(2, 1, 2, 64, dtype=torch.float16)
    kv = torch.zeros(2, 1, 1, 64, dtype=torch.float16)
    c.decode(q, k_new=kv, v_new=kv)  # (the first sequence's token fills the sinks)
    splits[0] = limit + 1
    c.decode(q, 0.125, k_new=kv, v_new=kv)
    assert not fused
    c.decode(q, 0.125, limit, k_new=kv, v_new=kv)
    assert len(fused) == 1
    c.decode(q, 0.125, limit + 1, k_new=kv, v_new=kv)
    assert len(fused) == 1 and c.lengths == [5, 129]


def _state(c):
    """Everything a KVCache holds, host and device, to compare before / after a refused call."""
    tensors = {n: getattr(c, n).clone() for n in ("k_pack", "k_params", "v_pack", "v_params", "k_res", "v_res",
                                                 "seqlens", "overflow", "block_table")}
    return tensors, c.lengths


def _unchanged(c, state) -> bool:
    tensors, lens = state
    return c.lengths == lens and all(torch.equal(getattr(c, n), t) for n, t in tensors.items())


def test_appending_decode_refused_for_its_q_writes_nothing(gen):
    """``decode(q, cache, k_new=, v_new=)`` as two calls (the reference backend, auto): a q
    or an option the decode refuses is refused before the append writes the new token."""
    c = allocate(4)
    k, v = kvdata.kv(gen, 2, 13, HKV, D)
    c.prefill(k[:, :10], v[:, :10], [10, 4])
    before = _state(c)
    q = kvdata.randn(gen, 2, 1, HQ, D)
    for bad_q, kw, err, msg in ((q.float(), {}, TypeError, "^q must have dtype"),
                                (q[:, :0], {}, ValueError, "at least one query token"),
                                (q[:, :, :3], {}, ValueError, "not a positive multiple of the cache's 2 KV heads"),
                                ([1.0], {}, TypeError, "q must be a torch.Tensor"),
                                (q, {"softmax_scale": "x"}, TypeError, "softmax_scale"),
                                (q, {"num_splits": -1}, ValueError, "num_splits")):
        with pytest.raises(err, match=msg):
            bd.decode(bad_q, c, k_new=k[:, 10:11], v_new=v[:, 10:11], **kw)
        assert _unchanged(c, before), msg
    bd.decode(q, c, k_new=k[:, 10:11], v_new=v[:, 10:11])
    assert c.lengths == [11, 5]
    # the same q on "meta", after a call of its layout was checked (and remembered): "meta"
    # and the CPU share a device index (-1), so the check must not pass it on that
    for t, backend in ((11, "reference"), (12, "auto")):
        bd.decode(q, c, k_new=k[:, t:t + 1], v_new=v[:, t:t + 1], backend=backend)
        before = _state(c)
        with pytest.raises(ValueError, match="q is on meta"):
            bd.decode(q.to("meta"), c, k_new=k[:, t:t + 1], v_new=v[:, t:t + 1], backend=backend)
        assert _unchanged(c, before), backend
    assert c.lengths == [13, 7]


def test_decodes_that_read_lengths_on_the_host_are_refused_inside_a_capture(gen, monkeypatch):
    """While a CUDA graph is captured (a stand-in capture on the CPU), the decode paths that
    read the lengths on the host, the reference and a query past the kernels' tile (the
    cache dequantized + SDPA), are refused with an error naming q, before an appending
    decode writes anything; a query that fits the kernels' tile passes the check."""
    from bitdecode import attention

    c = bd.KVCache.allocate(1, 2, 64, 512, bd.KVFormat(bits=4, group_size=64), device="cpu")
    k = torch.randn(1, 100, 2, 64, generator=gen).half()
    c.prefill(k, k)
    q, kv = torch.randn(1, 1, 8, 64, generator=gen).half(), torch.zeros(1, 1, 2, 64, dtype=torch.float16)
    monkeypatch.setattr(attention, "capturing", lambda device: True)
    with pytest.raises(ValueError, match="^q: the reference backend reads the sequence lengths on the host"):
        c.decode(q)
    with pytest.raises(ValueError, match="^q: the reference backend"):
        c.decode(q, k_new=kv, v_new=kv)
    assert c.lengths == [100] and int(c.seqlens[0]) == 100  # (refused before the append)
    tensors = c.tensors()
    attention.check_query(q, tensors, "sm80")  # 4 rows a KV head: the kernels take it
    long = torch.randn(1, 8, 8, 64, generator=gen).half()  # 8 tokens x GQA 4 = 32 rows
    with pytest.raises(ValueError, match=r"^q: 8 query tokens \(32 rows a KV head, more than the sm80 kernels' 16"):
        attention.check_query(long, tensors, "sm80")
    monkeypatch.setattr(attention, "capturing", lambda device: False)
    assert c.decode(q).shape == q.shape  # eager, the same call runs
    # an appending decode whose q passed eagerly is checked again under a capture (whose
    # calls take append + decode), before its append is captured
    c.decode(q, k_new=kv, v_new=kv)
    assert c.lengths == [101]
    from bitdecode import jit

    monkeypatch.setattr(c, "_on_cuda", True)  # (a CUDA cache's capture; this one stands in)
    monkeypatch.setattr(jit, "current_stream", lambda index: None)
    monkeypatch.setattr(attention, "capturing", lambda device: True)
    with pytest.raises(ValueError, match="^q: the reference backend"):
        c.decode(q, k_new=kv, v_new=kv)
    assert c.lengths == [101] and int(c.seqlens[0]) == 101


def test_query_rows_that_see_no_token_give_zero_and_minus_inf(gen):
    """T query tokens are each sequence's newest T: a sequence that holds fewer (or none)
    leaves its first query rows with no token to see; they give 0 and an LSE of -inf (the
    kernels' rule, which ``bitdecode selfcheck`` checks), and the other rows attend as
    usual (the same as a query of just those rows)."""
    c = allocate(4)
    k, v = kvdata.kv(gen, 2, 12, HKV, D)
    c.prefill(k, v, [12, 3])
    q = kvdata.randn(gen, 2, 5, HQ, D)
    out, lse = bd.decode(q, c, return_lse=True)
    assert (out[1, :2] == 0).all() and torch.isneginf(lse[1, :2]).all()
    assert torch.isfinite(lse[1, 2:]).all() and torch.isfinite(lse[0]).all()
    part, part_lse = bd.decode(q[:, 2:], c, return_lse=True)
    assert torch.equal(out[1, 2:], part[1]) and torch.equal(lse[1, 2:], part_lse[1])


def test_truncate_checks_the_block_table_before_it_writes(gen):
    """A block table edited out of range (or to a page another sequence uses) is refused
    by truncate before it unpacks anything, as prefill and append refuse it."""
    c = allocate(4, max_seqlen=600, page_size=128)
    k, v = kvdata.kv(gen, 2, 300, HKV, D)
    c.prefill(k, v)
    for page, msg in ((99, r"must lie in \[0, 10\)"), (-1, r"must lie in \[0, 10\)"), (0, "distinct pages")):
        table = c.block_table.clone()
        c.block_table[1, 0] = page
        before = _state(c)
        with pytest.raises(ValueError, match=msg):
            c.truncate(200)
        assert _unchanged(c, before)
        c.block_table.copy_(table)
    c.truncate(200)
    assert c.lengths == [100, 100]


def test_inference_mode_cache_refuses_writes_outside_it(gen):
    """torch refuses in-place updates of inference tensors outside inference_mode, after
    some have run: the cache refuses first, naming the call, and holds what it held."""
    with torch.inference_mode():
        c = allocate(4)
        k, v = kvdata.kv(gen, 2, 140, HKV, D)
        c.prefill(k[:, :130], v[:, :130])
    before = _state(c)
    for call in (lambda: c.append(k[:, 130:131], v[:, 130:131]), lambda: c.prefill(k, v), lambda: c.truncate(5),
                 c.reset, lambda: c.reorder([1, 0])):
        with pytest.raises(RuntimeError, match="allocated under torch.inference_mode"):
            call()
        assert _unchanged(c, before)
    with torch.inference_mode():
        c.append(k[:, 130:131], v[:, 130:131])
    assert c.lengths == [131, 131]


@pytest.mark.parametrize("page_size", [None, 256])
@pytest.mark.parametrize("fmt", [bd.KVFormat(bits=4, group_size=32), bd.KVFormat(bits=2, group_size=64, sink_tokens=4)],
                         ids=["4bit", "2bit-sinks"])
def test_reorder_copies_sequences_and_keeps_them_apart(fmt, page_size, gen):
    """Beam search's reordering: sequence i becomes sequence order[i] (one source copied to
    two, one dropped), byte for byte as a cache prefilled in that order, and appends after
    it stay apart (no page shared)."""
    order = [2, 0, 0]
    lens = [250, 130, 7]
    k, v = kvdata.kv(gen, 3, 320, HKV, D)
    c, want = (bd.KVCache.allocate(3, HKV, D, 400, fmt, device="cpu", page_size=page_size, backend="reference")
               for _ in range(2))
    c.prefill(k[:, :250], v[:, :250], lens)
    c.reorder(torch.tensor(order))
    want.prefill(k[order, :250], v[order, :250], [lens[j] for j in order])
    c.append(k[:, 250:], v[:, 250:])
    want.append(k[:, 250:], v[:, 250:])
    assert c.lengths == want.lengths == [77, 320, 320]
    for b in range(3):
        assert all(torch.equal(x, y) for x, y in zip(c.dequantized(b), want.dequantized(b))), b
    q = kvdata.randn(gen, 3, 1, HQ, D)
    assert torch.equal(bd.decode(q, c), bd.decode(q, want))


def test_reorder_and_dequantized_refuse_bad_arguments():
    c = allocate(4)
    c.prefill(torch.zeros(2, 5, HKV, D, dtype=torch.float16), torch.zeros(2, 5, HKV, D, dtype=torch.float16))
    for bad, err, msg in (([0], ValueError, "indices must have 2 entries"), ([0, 2], ValueError, r"in \[0, 2\)"),
                          ([0, -1], ValueError, r"in \[0, 2\)"), ([0.0, 1.0], TypeError, "indices must hold ints"),
                          ("01", TypeError, "indices must be a sequence of ints")):
        with pytest.raises(err, match=msg):
            c.reorder(bad)
    for b, err in ((2, ValueError), (-1, ValueError), (True, TypeError), ("0", TypeError)):
        with pytest.raises(err, match="^b must be"):
            c.dequantized(b)
    for k_dtype in (torch.int32, "float32"):
        with pytest.raises(TypeError, match="k_dtype must be a floating-point torch.dtype"):
            c.dequantized(0, k_dtype)
    assert c.dequantized(1, torch.float32)[0].dtype == torch.float32


def _ragged_paged_cache():
    c = bd.KVCache.allocate(3, 2, 128, 1024, fmt=bd.KVFormat(bits=4), page_size=128, backend="reference",
                            device="cpu")
    k = torch.randn(3, 700, 2, 128, dtype=torch.float16, generator=torch.Generator().manual_seed(0))
    c.prefill(k, k, seqlens=[700, 5, 300])
    return c


def test_lengths_changed_on_the_device_are_refused():
    """The device ``seqlens`` written by hand (outside the cache's calls): an append is
    refused before any sequence is written (it appended the first two, then failed), and
    a decode, ``check()`` and ``dequantized`` name the length instead of reading past it."""
    kn = torch.ones(3, 1, 2, 128, dtype=torch.float16)
    c = _ragged_paged_cache()
    c.seqlens[2] = -3
    with pytest.raises(ValueError, match=r"sequence 2 would hold -2 tokens, outside \[0, 1024\]"):
        c.append(kn, kn)
    assert c.seqlens.tolist() == [700, 5, -3] and c.lengths == [700, 5, 300]
    c = _ragged_paged_cache()
    c.seqlens[0] = 5000
    q = torch.ones(3, 1, 4, 128, dtype=torch.float16)
    for call in (lambda: bd.decode(q, c), c.check, lambda: c.dequantized(0)):
        with pytest.raises(ValueError, match=r"sequence 0 would hold 5000 tokens"):
            call()


def test_block_table_is_edited_in_place_only():
    """``dequantized`` checks the pages it reads as decode does; assigning a new table (or
    new lengths) is refused, since the cache's calls would keep using their own."""
    c = _ragged_paged_cache()
    c.block_table[2, 1] = -1
    with pytest.raises(ValueError, match=r"block_table entries in use must lie in \[0, 24\)"):
        c.dequantized(2)
    with pytest.raises(AttributeError, match="edit it in place, e.g. cache.block_table.copy_"):
        c.block_table = torch.zeros_like(c.block_table)
    with pytest.raises(AttributeError, match="seqlens is the cache's own tensor"):
        c.seqlens = torch.zeros_like(c.seqlens)


def test_writes_of_tensors_that_require_grad_stay_out_of_autograd():
    c = _ragged_paged_cache()
    k = torch.randn(3, 10, 2, 128, dtype=torch.float16, requires_grad=True)
    c.prefill(k, k)
    kn = torch.randn(3, 1, 2, 128, dtype=torch.float16, requires_grad=True)
    c.append(kn, kn)
    assert not any(t.requires_grad for t in (c.k_res, c.v_res, c.k_pack, c.v_pack, c.k_params, c.v_params))
    assert not bd.decode(torch.ones(3, 1, 4, 128, dtype=torch.float16), c).requires_grad


def test_deepcopy_is_a_cache_of_its_own():
    """``copy.deepcopy`` (transformers' prompt reuse): the copy's tensors and lengths are its
    own, and the compiled state bound to the original's tensors (plans, the fast paths'
    entries, the appender) is not carried over: the copy builds its own."""
    import copy

    gen = torch.Generator().manual_seed(3)
    c = bd.KVCache.allocate(2, 2, 64, 400, bd.KVFormat(bits=4, group_size=64, sink_tokens=4), device="cpu",
                            backend="reference")
    k, v = kvdata.kv(gen, 2, 200, 2, 64, dtype=torch.float16, device="cpu")
    c.prefill(k, v, [200, 9])
    compiled = object()  # (a kernel plan holds compiled functions bound to these tensors)
    c._plans, c._fast, c._fast_append, c._appender = {"key": compiled}, ("key", compiled), ("key", compiled), compiled
    before = _state(c)
    twin = copy.deepcopy(c)
    assert (twin._plans, twin._fast, twin._fast_append, twin._appender) == ({}, None, None, None)
    assert twin.lengths == c.lengths == [200, 9] and twin.fmt == c.fmt
    twin_t, orig_t = twin.tensors(), c.tensors()
    for name in ("k_pack", "k_params", "v_pack", "v_params", "k_res", "v_res", "cache_seqlens", "block_table",
                 "overflow", "commits"):
        a, b = getattr(twin_t, name), getattr(orig_t, name)
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr(), name
    assert twin_t.k_res is twin.k_res and twin_t.cache_seqlens is twin.seqlens  # (one set of tensors)
    assert twin_t.sinks[0] is twin.k_sink and not twin.k_sink.data_ptr() == c.k_sink.data_ptr()
    q = torch.randn(2, 1, 4, 64, generator=gen).half()
    assert torch.equal(bd.decode(q, twin), bd.decode(q, c))
    new_k, new_v = kvdata.kv(gen, 2, 60, 2, 64, dtype=torch.float16, device="cpu")
    twin.append(new_k, new_v)  # (completes a packed block of sequence 0)
    assert twin.lengths == [260, 69] and _unchanged(c, before)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_checks_its_own_block_table(how):
    """The cache remembers the block table's version counter at its last check, so that a
    prefill into an unedited table skips the check (a sync).  A copy's (or an unpickled
    cache's) table is another tensor, counting from its own start: the copy checks its
    first prefill, so a page shared by two sequences is refused, not packed over."""
    import copy
    import pickle

    c = bd.KVCache.allocate(2, 1, 64, 256, bd.KVFormat(bits=4, group_size=64), device="cpu", page_size=128,
                            backend="reference")
    c.block_table.copy_(torch.tensor([[1, 0], [3, 2]], dtype=torch.int32))
    c.block_table.copy_(torch.tensor([[0, 1], [2, 3]], dtype=torch.int32))
    k, v = kvdata.kv(torch.Generator().manual_seed(4), 2, 200, 1, 64, dtype=torch.float16, device="cpu")
    c.prefill(k, v)
    twin = copy.deepcopy(c) if how == "deepcopy" else pickle.loads(pickle.dumps(c))
    twin.block_table[1, 0] = twin.block_table[0, 0]
    with pytest.raises(ValueError, match="must be distinct pages"):
        twin.prefill(k, v)


def test_select_copies_sequences_into_a_new_cache():
    """``KVCache.select``: a cache of the chosen sequences (repeated, reordered, some left
    out), each with its packed blocks, residual, sink tokens and length, on pages of its
    own in a paged cache with a shuffled table; the source is left as it was."""
    fmt = bd.KVFormat(bits=4, group_size=64, sink_tokens=4)
    gen = torch.Generator().manual_seed(6)
    c = bd.KVCache.allocate(3, 2, 64, 512, fmt, device="cpu", page_size=128, backend="reference")
    c.block_table.copy_(c.block_table.flatten()[torch.randperm(c.block_table.numel(), generator=gen)]
                        .view_as(c.block_table))
    k, v = kvdata.kv(gen, 3, 400, 2, 64, dtype=torch.float16, device="cpu")
    c.prefill(k, v, [400, 3, 260])
    before = _state(c)
    new = c.select([2, 0, 2])
    assert new.batch == 3 and new.lengths == [260, 400, 260] and new.page_size == c.page_size
    for i, j in enumerate([2, 0, 2]):
        assert all(torch.equal(a, b) for a, b in zip(new.dequantized(i), c.dequantized(j)))
    assert _unchanged(c, before)
    more_k, more_v = kvdata.kv(gen, 3, 1, 2, 64, dtype=torch.float16, device="cpu")
    new.append(more_k, more_v)
    assert not torch.equal(new.dequantized(0)[0], new.dequantized(2)[0])
    # the repeated sequence's copies share no page: the pages each length uses are its own
    nr, page = fmt.residual_block, new.page_size
    used = [new.block_table[b, :-(-((n - fmt.sink_tokens) // nr * nr) // page)].tolist()
            for b, n in enumerate(new.lengths)]
    assert [len(pages) for pages in used] == [2, 3, 2]
    assert len({p for pages in used for p in pages}) == sum(map(len, used))
    for bad, error in (([], ValueError), ([3], ValueError), ([0.5], TypeError)):
        with pytest.raises(error, match="indices"):
            c.select(bad)
