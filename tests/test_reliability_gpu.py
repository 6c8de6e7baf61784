"""Reliability of the kernel backends on a GPU (issue 14; marker ``gpu``, every shipped
backend through the ``backend`` fixture).

* A CUDA graph replayed past a sequence's capacity: the append kernel refuses that
  sequence on the device (nothing written, length kept, ``overflow`` set), the others go
  on, and ``check()`` raises ``CacheOverflowError`` naming it.  Inside a capture, the decode
  paths that read the lengths on the host are refused by name.
* 10,000 single-token appends leave the same bytes (and decode to the same bits) as one
  prefill of the same tokens.
* Concurrency: one cache decoded from four streams, and four threads each appending to and
  decoding its own cache on its own stream, give the serial results bit for bit.
* A sequence of 2^20 tokens decodes correctly at 4 and 2 bits.
* compute-sanitizer memcheck, racecheck and synccheck over a small case of every kernel
  (decode direct and split + combine, pack prefill and append, dense and paged, the
  device-side capacity guard; the BitNet GEMV and GEMMs).

Expected values are never the kernels' own: bytes come from an eager twin cache fed only
what fits, outputs from torch attention over ``cache.dequantized``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import bitdecode as bd
from bitdecode.reference import decode_tolerance

pytestmark = pytest.mark.gpu

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEV = torch.device("cuda")
STORAGE = ("k_pack", "k_params", "v_pack", "v_params")
FMT4 = bd.KVFormat(bits=4, k_mode="channel", group_size=128)
FMT2 = bd.KVFormat(bits=2, k_mode="token", group_size=64)
FORMATS = [pytest.param(FMT4, id="4bit-channel-g128"), pytest.param(FMT2, id="2bit-token-g64")]


def cuda_gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def randn(gen, *shape, dtype=torch.float16):
    return torch.randn(*shape, generator=gen, device=DEV).to(dtype)


def shuffle_pages(cache, seed: int) -> None:
    """Give the sequences pages of the pool in random order."""
    perm = torch.randperm(cache.block_table.numel(), generator=torch.Generator().manual_seed(seed))
    cache.block_table.copy_(perm.to(torch.int32).view_as(cache.block_table))


def packed_pieces(cache, b: int, length: int):
    """``(storage name, index)`` of every piece of sequence ``b``'s packed blocks, for its
    first ``length`` tokens (whole residual blocks only), wherever its block table puts them."""
    nr, page = cache.fmt.residual_block, cache.page_size
    table = cache.block_table[b].tolist()
    for start in range(0, length // nr * nr, nr):
        p, off = table[start // page], start % page
        for name in STORAGE:
            unit = page // getattr(cache, name).shape[2]  # tokens per step along the page axis
            yield name, (p, slice(None), slice(off // unit, (off + nr) // unit))


def in_use_masks(cache, lengths):
    """Per storage tensor, the elements that hold packed blocks of sequences of ``lengths``."""
    masks = {name: torch.zeros(getattr(cache, name).shape, dtype=torch.bool, device=DEV) for name in STORAGE}
    for b, n in enumerate(lengths):
        for name, idx in packed_pieces(cache, b, n):
            masks[name][idx] = True
    return masks


def assert_same_sequences(got, want, lengths):
    """The packed blocks and the live residual rows of every sequence are bit-identical."""
    nr = got.fmt.residual_block
    for b, n in enumerate(lengths):
        for name, idx in packed_pieces(got, b, n):
            assert torch.equal(getattr(got, name)[idx], getattr(want, name)[idx]), f"sequence {b}: {name}"
        r = n % nr
        assert torch.equal(got.k_res[b, :r], want.k_res[b, :r]), f"sequence {b}: k_res"
        assert torch.equal(got.v_res[b, :r], want.v_res[b, :r]), f"sequence {b}: v_res"


def prefilled_twin(like, page_size, k, v, lengths):
    """A fresh cache laid out like ``like`` (allocated with ``page_size``; the same pages)
    holding ``k[b, :lengths[b]]``."""
    twin = bd.KVCache.allocate(like.batch, like.num_kv_heads, like.head_dim, like.max_seqlen, like.fmt,
                               dtype=like.dtype, device=DEV, page_size=page_size, backend=like.backend)
    assert twin.page_size == like.page_size and twin.block_table.shape == like.block_table.shape
    twin.block_table.copy_(like.block_table)
    twin.prefill(k, v, lengths)
    return twin


# --------------------------------------------------------------------------------------
# A graph replayed past capacity
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [None, 256], ids=["dense", "paged"])
def test_graph_replay_past_capacity_is_refused_on_the_device(backend, page_size):
    """One decode step (append one token, decode) captured in a CUDA graph and replayed
    200 times over sequences of 500, 300 and 40 tokens with capacity 512.  Sequence 0
    fills after 12 replays; from then on its appends are refused on the device: its length
    stays 512, none of its bytes (pages, params, residual) change, ``overflow`` holds the
    513 tokens it asked for and ``check()`` raises ``CacheOverflowError`` naming it (and
    only it) and the capacity.  Sequences 1 and 2 take all 200 tokens: their blocks equal
    an eager cache prefilled with the same tokens, the graph's last decode equals that
    cache's, and no byte outside the blocks in use changed (the spare page of the paged
    pool included).  ``reset()`` clears the flags and the same graph appends again."""
    fmt, cap, start, steps = FMT4, 512, [500, 300, 40], 200
    hkv, d, gq = 2, 128, 4
    gen = cuda_gen(14)
    k_all = randn(gen, 3, max(start) + steps, hkv, d)
    v_all = randn(gen, 3, max(start) + steps, hkv, d)
    qs = randn(gen, steps, 3, 1, hkv * gq, d)
    # token i of sequence b's decode steps is token start[b] + i of its stream
    idx = torch.tensor(start, device=DEV)[:, None] + torch.arange(steps, device=DEV)[None]
    rows = torch.arange(3, device=DEV)[:, None]
    k_steps, v_steps = k_all[rows, idx], v_all[rows, idx]  # [3, steps, Hkv, D]

    cache = bd.KVCache.allocate(3, hkv, d, cap, fmt, device=DEV, page_size=page_size, backend=backend)
    assert cache.capacity == cap
    assert issubclass(bd.CacheOverflowError, RuntimeError)
    if page_size is not None:
        shuffle_pages(cache, 3)
    prompt_k, prompt_v = k_all[:, : max(start)].contiguous(), v_all[:, : max(start)].contiguous()
    cache.prefill(prompt_k, prompt_v, start)
    k_in, v_in, q_in = k_steps[:, :1].clone(), v_steps[:, :1].clone(), qs[0].clone()
    # compile (and plan) outside the capture; the second prefill undoes the warm-up step
    cache.append(k_in, v_in)
    cache.decode(q_in, num_splits=3)
    cache.prefill(prompt_k, prompt_v, start)
    torch.cuda.synchronize()
    before = {name: getattr(cache, name).clone() for name in STORAGE}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cache.append(k_in, v_in)
        out = cache.decode(q_in, num_splits=3)

    def replay(i):
        k_in.copy_(k_steps[:, i:i + 1])
        v_in.copy_(v_steps[:, i:i + 1])
        q_in.copy_(qs[i])
        graph.replay()

    fill = cap - start[0]
    for i in range(fill):
        replay(i)
    torch.cuda.synchronize()
    assert cache.overflow.tolist() == [0, 0, 0]  # exactly full is not past capacity
    assert cache.check() is None
    assert cache.lengths == [n + fill for n in start]  # check() brought the host up to date
    full_seq0 = [getattr(cache, name)[i].clone() for name, i in packed_pieces(cache, 0, cap)]
    full_res0 = (cache.k_res[0].clone(), cache.v_res[0].clone())

    for i in range(fill, steps):
        replay(i)
    torch.cuda.synchronize()
    with pytest.raises(bd.CacheOverflowError) as err:
        cache.check()
    msg = str(err.value)
    assert "sequence 0" in msg and str(cap) in msg, msg
    assert "sequence 1" not in msg and "sequence 2" not in msg, msg
    final = [cap, start[1] + steps, start[2] + steps]
    assert cache.seqlens.tolist() == final
    assert cache.overflow.tolist() == [cap + 1, 0, 0]

    # sequence 0: nothing changed once it was full
    for (name, i), kept in zip(packed_pieces(cache, 0, cap), full_seq0):
        assert torch.equal(getattr(cache, name)[i], kept), name
    assert torch.equal(cache.k_res[0], full_res0[0]) and torch.equal(cache.v_res[0], full_res0[1])

    # every sequence holds what an eager cache fed only what fits holds
    k_fit = torch.zeros(3, cap, hkv, d, dtype=torch.float16, device=DEV)
    v_fit = torch.zeros_like(k_fit)
    for b, n in enumerate(final):
        k_fit[b, :n], v_fit[b, :n] = k_all[b, :n], v_all[b, :n]
    twin = prefilled_twin(cache, page_size, k_fit, v_fit, final)
    assert torch.equal(cache.seqlens, twin.seqlens)
    masks = in_use_masks(cache, final)
    for name in STORAGE:
        got, m = getattr(cache, name), masks[name]
        assert torch.equal(got[m], getattr(twin, name)[m]), f"{name}: blocks in use"
        assert torch.equal(got[~m], before[name][~m]), f"{name}: bytes outside the blocks in use changed"
    for b, n in enumerate(final):
        r = n % fmt.residual_block
        assert torch.equal(cache.k_res[b, :r], twin.k_res[b, :r]) and torch.equal(cache.v_res[b, :r], twin.v_res[b, :r])
    if page_size is not None:  # the pool has a page no sequence reached: it was compared to `before` whole
        reached = masks["k_pack"].flatten(1).any(dim=1)
        assert not bool(reached.all())
    assert torch.equal(out, twin.decode(qs[-1], num_splits=3))

    cache.reset()
    assert cache.overflow.tolist() == [0, 0, 0]
    assert cache.check() is None and cache.lengths == [0, 0, 0]
    replay(0)  # the graph appends from the device lengths, now 0
    torch.cuda.synchronize()
    assert cache.check() is None and cache.lengths == [1, 1, 1]


def test_a_capture_refuses_the_decodes_that_read_lengths_on_the_host(backend):
    """Inside a CUDA graph capture, a query past the kernels' tile (the cache dequantized +
    SDPA) and the reference backend would read the lengths on the host, a sync that
    invalidates the capture with a CUDA error: both are refused by name before anything
    runs, and the cache and the GPU stay usable for the same query eagerly."""
    cache = bd.KVCache.allocate(1, 2, 128, 1024, FMT4, device=DEV, backend=backend)
    gen = cuda_gen(7)
    k = randn(gen, 1, 300, 2, 128)
    cache.prefill(k, k)
    long = randn(gen, 1, 8, 8, 128)  # 8 tokens x 4 query heads a KV head: 32 rows, past the tile
    for call in (lambda: cache.decode(long), lambda: cache.decode(long[:, :1], backend="reference")):
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(ValueError, match="reads the sequence lengths on the host"):
            with torch.cuda.graph(graph):
                call()
    out = cache.decode(long)
    torch.cuda.synchronize()
    assert out.shape == long.shape and bool(torch.isfinite(out).all()) and cache.lengths == [300]


# --------------------------------------------------------------------------------------
# Long runs of appends
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("page_size", [None, 512], ids=["dense", "paged"])
def test_ten_thousand_single_token_appends_equal_one_prefill(backend, fmt, page_size):
    """Sequences starting at 0, 77 and 300 tokens take 10,000 single-token appends each
    (crossing dozens of residual blocks and pages); the packed pages, params and live
    residual rows then equal, bit for bit, those of a cache prefilled once with the same
    tokens, and so do the decode outputs (same kernels, same bytes)."""
    start, steps, hkv, d = [0, 77, 300], 10_000, 2, 128
    final = [n + steps for n in start]
    cap = max(final)
    gen = cuda_gen(15)
    k_all, v_all = randn(gen, 3, cap, hkv, d), randn(gen, 3, cap, hkv, d)
    idx = torch.tensor(start, device=DEV)[:, None] + torch.arange(steps, device=DEV)[None]
    rows = torch.arange(3, device=DEV)[:, None]
    k_steps, v_steps = k_all[rows, idx], v_all[rows, idx]

    stepped = bd.KVCache.allocate(3, hkv, d, cap, fmt, device=DEV, page_size=page_size, backend=backend)
    if page_size is not None:
        shuffle_pages(stepped, 4)
    stepped.prefill(k_all[:, : max(start)], v_all[:, : max(start)], start)
    for i in range(steps):
        stepped.append(k_steps[:, i:i + 1], v_steps[:, i:i + 1])
    whole = prefilled_twin(stepped, page_size, k_all, v_all, final)
    assert stepped.lengths == whole.lengths == final
    stepped.check()  # no device-side refusal, host lengths = device lengths
    assert stepped.lengths == final and torch.equal(stepped.seqlens, whole.seqlens)
    assert_same_sequences(stepped, whole, final)
    q = randn(gen, 3, 1, hkv * 4, d)
    for splits in (0, 1, 5):
        assert torch.equal(bd.decode(q, stepped, num_splits=splits), bd.decode(q, whole, num_splits=splits)), splits


# --------------------------------------------------------------------------------------
# Concurrency
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_splits", [1, 8, 0])
def test_one_cache_decoded_from_four_streams_equals_serial(backend, num_splits):
    """Parallel sampling: four queries over one cache, launched interleaved on four
    streams for 20 rounds, give the serial results bit for bit (the split-KV workspace of
    each call is its own; direct, split and auto-split plans)."""
    nr = FMT4.residual_block
    gen = cuda_gen(16)
    lens = [40 * nr + 9, 33 * nr, 5]
    cache = bd.KVCache.allocate(3, 2, 128, max(lens), FMT4, device=DEV, backend=backend)
    cache.prefill(randn(gen, 3, max(lens), 2, 128), randn(gen, 3, max(lens), 2, 128), lens)
    qs = [randn(gen, 3, 1, 8, 128) for _ in range(4)]
    serial = [bd.decode(q, cache, num_splits=num_splits) for q in qs]
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream() for _ in qs]
    outs = [[] for _ in qs]
    for _ in range(20):
        for i, (q, s) in enumerate(zip(qs, streams)):
            with torch.cuda.stream(s):
                outs[i].append(bd.decode(q, cache, num_splits=num_splits))
    torch.cuda.synchronize()
    for i in range(len(qs)):
        for r, o in enumerate(outs[i]):
            assert torch.equal(o, serial[i]), f"stream {i}, round {r}"


def test_four_threads_append_and_decode_their_own_caches(backend):
    """Four Python threads, each owning one cache (4-bit and 2-bit, dense and paged) and
    one stream, run 50 append + decode steps at once; every output and the final cache
    contents equal the same calls made serially on twin caches."""
    specs = [(FMT4, None), (FMT4, 256), (FMT2, None), (FMT2, 512)]
    steps, hkv, d, gq = 50, 2, 128, 4
    gen = cuda_gen(17)
    data = []
    for fmt, _ in specs:
        nr = fmt.residual_block
        start = [nr - 20, 3]  # sequence 0 crosses a block boundary during the run
        k0, v0 = randn(gen, 2, max(start), hkv, d), randn(gen, 2, max(start), hkv, d)
        ks, vs = randn(gen, steps, 2, 1, hkv, d), randn(gen, steps, 2, 1, hkv, d)
        data.append((start, k0, v0, ks, vs, randn(gen, steps, 2, 1, hkv * gq, d)))

    def build(i):
        (fmt, page), (start, k0, v0, *_) = specs[i], data[i]
        c = bd.KVCache.allocate(2, hkv, d, 2 * fmt.residual_block + steps, fmt, device=DEV, page_size=page,
                                backend=backend)
        c.prefill(k0, v0, start)
        return c

    twins = [build(i) for i in range(len(specs))]  # serial run first: compiles every kernel
    serial = []
    for i, c in enumerate(twins):
        _, _, _, ks, vs, qs = data[i]
        outs = []
        for s in range(steps):
            c.append(ks[s], vs[s])
            outs.append(c.decode(qs[s]))
        serial.append(outs)
    caches = [build(i) for i in range(len(specs))]
    torch.cuda.synchronize()

    def work(i):
        _, _, _, ks, vs, qs = data[i]
        stream = torch.cuda.Stream()
        outs = []
        with torch.cuda.stream(stream):
            for s in range(steps):
                caches[i].append(ks[s], vs[s])
                outs.append(caches[i].decode(qs[s]))
        stream.synchronize()
        return outs

    with ThreadPoolExecutor(max_workers=len(specs)) as pool:
        threaded = list(pool.map(work, range(len(specs))))
    torch.cuda.synchronize()
    for i in range(len(specs)):
        caches[i].check()
        assert caches[i].lengths == twins[i].lengths
        assert_same_sequences(caches[i], twins[i], twins[i].lengths)
        for s in range(steps):
            assert torch.equal(threaded[i][s], serial[i][s]), f"cache {i}, step {s}"


# --------------------------------------------------------------------------------------
# A million tokens
# --------------------------------------------------------------------------------------


FMT2C = bd.KVFormat(2, "channel", 128)


@pytest.mark.parametrize("fmt", FORMATS + [pytest.param(FMT2C, id="2bit-channel-g128")])
def test_one_million_token_sequence(backend, fmt):
    """One sequence of 2^20 tokens (B = 1, Hkv = 1, 4 query heads, D = 128) decodes to
    torch attention over ``cache.dequantized`` within FlashAttention's rule (twice the
    error of fp32 attention with P rounded to fp16, plus a small floor), with the right
    LSE, whatever the split count.  V drifts along the sequence and four strongly
    attended "needle" tokens (first block, middle, last blocks) carry large values, so a
    kernel that lost any block or split would miss by far more than the tolerance."""
    check_one_million_tokens(backend, fmt)


@pytest.mark.parametrize("room", [0, 2])
@pytest.mark.parametrize("fmt", [pytest.param(FMT2, id="2bit-token-g64"), pytest.param(FMT2C, id="2bit-channel-g128")])
def test_one_million_tokens_v_subnormal(fmt, room, monkeypatch, request):
    """The same sequence through the sm90 kernels (both grids) with V's 2-bit codes as
    fp16 subnormals (``DecodeSm90(v_subnormal=True)``, ``v_sub_room`` 0 and 2): raw codes
    of one sign over 2^20 tokens in one split are where a bias of the zero sums shows (one
    form missed here by 2x on the H200, thirty-seventh session).  The "h center" form with
    room 2 misses it with K per token (H200, fortieth session, twice: 0.00214 against a
    0.00206 tolerance at one split), which is why ``V_SUBNORMAL_AUTO`` stays off."""
    from test_kernels_gpu import sm90_default_kernel_with

    if room == 2 and fmt is FMT2:
        request.applymarker(pytest.mark.xfail(strict=True, reason="v_sub_room=2 misses the 1M-token tolerance "
                                                                  "with K per token (0.00214 > 0.00206, H200)"))

    keywords = {"v_subnormal": True, "v_sub_room": room}
    with sm90_default_kernel_with(monkeypatch, keywords, "v_subnormal", every_variant=True) as built:
        check_one_million_tokens("sm90", fmt)
        assert built and all(built), built


def check_one_million_tokens(backend, fmt):
    """``test_one_million_token_sequence``'s sequence, cache and checks on ``backend``."""
    n, hkv, gq, d = 1 << 20, 1, 4, 128
    nr = fmt.residual_block
    gen = cuda_gen(18)
    q = randn(gen, 1, 1, hkv * gq, d)
    k = randn(gen, 1, n, hkv, d)
    v = randn(gen, 1, n, hkv, d)
    v += torch.linspace(-2, 2, n, device=DEV).to(torch.float16)[None, :, None, None]
    scale = d ** -0.5
    qh = q[0, 0].float()
    sign = torch.where(qh.sum(0) >= 0, 1.0, -1.0)  # a direction every head scores high
    c = 14.0 / float((qh @ sign).mean() * scale)  # needle scores around 14
    for j, t in enumerate((3, n // 2 + 77, n - nr - 1, n - 1)):
        k[0, t, 0] = (c * sign).half()
        v[0, t, 0] = (3.0 if j % 2 else -3.0) + 0.5 * randn(gen, d)
    cache = bd.KVCache.allocate(1, hkv, d, n, fmt, device=DEV, backend=backend)
    cache.prefill(k, v)
    del k, v
    kd, vd = cache.dequantized(0)  # [n, 1, D]
    s = (qh @ kd[:, 0].float().t()) * scale  # [Hq, n]
    ref_lse = torch.logsumexp(s, dim=-1)
    ref = torch.exp(s - ref_lse[:, None]) @ vd[:, 0].float()
    p = torch.exp(s - s.amax(dim=-1, keepdim=True))  # as the kernels hold P: relative to a max
    lowprec = (p.half().float() @ vd[:, 0].float()) / p.sum(dim=-1, keepdim=True)
    tol = decode_tolerance(lowprec, ref)
    for splits in (0, 1, 256):
        out, lse = bd.decode(q, cache, num_splits=splits, return_lse=True)
        assert torch.isfinite(out).all()
        err = (out[0, 0].float() - ref).abs().max().item()
        assert err <= tol, f"num_splits={splits}: max error {err:.3g} > tolerance {tol:.3g}"
        torch.testing.assert_close(lse[0, 0], ref_lse, atol=2e-3, rtol=1e-3)


# --------------------------------------------------------------------------------------
# compute-sanitizer
# --------------------------------------------------------------------------------------

SANITIZER_TOOLS = ["memcheck", "racecheck", "synccheck"]

KV_KERNELS = """
import torch, bitdecode as bd
backend = {backend!r}
torch.manual_seed(0)
for fmt in (bd.KVFormat(bits=4, k_mode="channel", group_size=128), bd.KVFormat(bits=2, k_mode="token", group_size=64)):
    nr = fmt.residual_block
    for page_size in (None, nr):
        cap = 2 * nr + 40
        c = bd.KVCache.allocate(2, 2, 128, cap, fmt, device="cuda", page_size=page_size, backend=backend)
        if page_size:
            c.block_table.copy_(c.block_table.flatten().flip(0).view_as(c.block_table))
        k = torch.randn(2, cap, 2, 128, device="cuda").half(); v = torch.randn_like(k)
        c.prefill(k[:, :nr + 7], v[:, :nr + 7], [nr + 7, 3])   # pack kernel, prefill: a block + residual
        c.append(k[:, :1], v[:, :1])                              # append kernel: residual only
        c.append(k[:, :nr - 8], v[:, :nr - 8])                    # append completing a block (seq 0)
        q = torch.randn(2, 1, 8, 128, device="cuda").half()
        for splits in (1, 3):                                     # direct decode; split decode + combine
            o = bd.decode(q, c, num_splits=splits); assert bool(torch.isfinite(o).all())
        # the device-side capacity guard: a captured append replayed past capacity
        k1, v1 = k[:, :1].clone(), v[:, :1].clone()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            c.append(k1, v1)
        for _ in range(cap - 2 * nr + 3):
            g.replay()
        torch.cuda.synchronize()
        assert c.seqlens.tolist()[0] == cap, c.seqlens.tolist()
print("ok")
"""

BITNET_KERNELS = """
import torch, bitdecode as bd
bn = bd.bitnet
torch.manual_seed(0)
n, k, segs = 48, 384, (32, 16)
w = torch.randint(-1, 2, (n, k), device="cuda", dtype=torch.int8)
wp = bn.pack_weight(w)
ws = torch.rand(2, device="cuda") + 0.5
hopper = torch.cuda.get_device_capability()[0] == 9
for m in (1, 7, 16, 64):
    x, xs = bn.quantize_activation(torch.randn(m, k, device="cuda"))
    if m == 1:
        for out_dtype in (torch.bfloat16, torch.int32):
            bn.gemv(x, wp, xs, ws, segs, out_dtype=out_dtype)
        for cfg in bn.gemv_configs("cuda"):   # every GEMV configuration, not only the host's pick
            bn._gemv_launch(x, wp, xs, ws, list(bn._segment_ends(segs, n)), False, cfg)
    for kernel in ("mma", "wgmma") if hopper else ("mma",):
        for out_dtype in (torch.bfloat16, torch.int32):
            bn.gemm(x, wp, xs, ws, segs, kernel=kernel, out_dtype=out_dtype)
torch.cuda.synchronize()
print("ok")
"""


def run_sanitizer(tmp_path, tool_name, source):
    tool = shutil.which("compute-sanitizer")
    if tool is None:
        pytest.skip("compute-sanitizer not on PATH")
    script = tmp_path / "kernels.py"
    script.write_text(source)
    res = subprocess.run([tool, "--tool", tool_name, "--report-api-errors", "no", "--error-exitcode", "3",
                          sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert "ok" in res.stdout


@pytest.mark.parametrize("tool_name", SANITIZER_TOOLS)
def test_compute_sanitizer_every_kv_kernel(tmp_path, backend, tool_name):
    """memcheck / racecheck / synccheck report nothing for the backend's decode (direct,
    split + combine), pack (prefill, append, block-completing append) on dense and paged
    caches at 4 and 2 bits, and graph-replayed appends refused by the capacity guard."""
    run_sanitizer(tmp_path, tool_name, KV_KERNELS.format(backend=backend))


@requires_cuda
@pytest.mark.parametrize("tool_name", SANITIZER_TOOLS)
def test_compute_sanitizer_bitnet_kernels(tmp_path, tool_name):
    """The same tools over the BitNet GEMV (every configuration) and GEMMs (mma.sync, and
    wgmma on Hopper), bf16 and int32 outputs."""
    run_sanitizer(tmp_path, tool_name, BITNET_KERNELS)
