"""Every argument check: the error type, a message that names the argument, and nothing
written to the cache."""

import dataclasses
import math

import pytest
import torch

import bitdecode as bd
from bitdecode import attention
import kvdata

B, HKV, HQ, D, N = 2, 2, 8, 64, 200
FP16 = torch.float16


@pytest.fixture
def cache(gen):
    """A 4-bit cache (Nr = 128, max_seqlen 200) holding 150 tokens: one packed block and a
    22-token residual, so a lost write would show in every storage tensor."""
    c = bd.KVCache.allocate(B, HKV, D, N, bd.KVFormat(bits=4, group_size=32), device="cpu")
    k, v = kvdata.kv(gen, B, 150, HKV, D)
    c.prefill(k, v)
    return c


def snapshot(c):
    return c.lengths, [t.clone() for t in (c.k_pack, c.k_params, c.v_pack, c.v_params, c.k_res, c.v_res,
                                           c.seqlens, c.block_table)]


def assert_unchanged(c, snap):
    lengths, tensors = snap
    assert c.lengths == lengths
    now = (c.k_pack, c.k_params, c.v_pack, c.v_params, c.k_res, c.v_res, c.seqlens, c.block_table)
    for before, after in zip(tensors, now):
        assert torch.equal(before, after)


def kv(t=1, *, batch=B, heads=HKV, dim=D, dtype=FP16):
    return torch.randn(batch, t, heads, dim).to(dtype), torch.randn(batch, t, heads, dim).to(dtype)


def q(*, batch=B, tokens=1, heads=HQ, dim=D, dtype=FP16):
    return torch.randn(batch, tokens, heads, dim).to(dtype)


# --------------------------------------------------------------------------------------
# allocate
# --------------------------------------------------------------------------------------

FMT = bd.KVFormat(bits=4, group_size=32)


@pytest.mark.parametrize(
    "kwargs,exc,msg",
    [
        (dict(fmt="4bit"), TypeError, "fmt must be a bitdecode.KVFormat, got str"),
        (dict(batch=0), ValueError, "batch must be positive, got 0"),
        (dict(batch=2.0), TypeError, "batch must be an int, got float"),
        (dict(num_kv_heads=-1), ValueError, "num_kv_heads must be positive, got -1"),
        (dict(num_kv_heads=True), TypeError, "num_kv_heads must be an int, got bool"),
        (dict(max_seqlen=0), ValueError, "max_seqlen must be positive, got 0"),
        (dict(max_seqlen=2**31), ValueError, r"max_seqlen must be at most 2147418112 \(lengths are int32 on the "
                                             r"device\), got 2147483648"),
        (dict(head_dim=80), ValueError, r"head_dim must be one of \(64, 128, 256\), got 80"),
        (dict(fmt=bd.KVFormat(group_size=128)), ValueError, "group_size=128 .* must not exceed head_dim=64"),
        (dict(dtype=torch.float32), TypeError, "dtype must be torch.float16 or torch.bfloat16, got torch.float32"),
        (dict(page_size=96), ValueError, r"page_size must be a multiple of the residual block \(128 tokens for 4-bit\), got 96"),
        (dict(page_size=0), ValueError, "page_size must be positive, got 0"),
        (dict(page_size=2**40), ValueError, r"page_size must be at most 2147418112 tokens .*got 1099511627776"),
        (dict(backend="cuda"), ValueError, r"backend must be one of \('auto', 'reference', 'sm80', 'sm90', 'sm100'\), got 'cuda'"),
        (dict(backend="sm80"), ValueError, "backend 'sm80' runs CUDA kernels, but the tensors are on cpu"),
        (dict(backend="sm90"), ValueError, "backend 'sm90' runs CUDA kernels, but the tensors are on cpu"),
        (dict(backend="sm100"), ValueError, "backend 'sm100' runs CUDA kernels, but the tensors are on cpu"),
    ],
)
def test_allocate_errors(kwargs, exc, msg):
    args = dict(batch=B, num_kv_heads=HKV, head_dim=D, max_seqlen=N, fmt=FMT, device="cpu") | kwargs
    with pytest.raises(exc, match=msg):
        bd.KVCache.allocate(**args)


def test_allocate_takes_max_seqlen_up_to_the_limit_and_not_one_past(monkeypatch):
    """``MAX_SEQLEN`` itself is a capacity the cache takes (its pages stood in for by meta
    tensors: a real one needs ~2**31 tokens of memory), rounded to no more than itself; one
    token more is refused by name before anything is allocated."""
    from bitdecode.cache import MAX_SEQLEN
    zeros = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *shape, **kw: zeros(*shape, **(kw | dict(device="meta"))))
    fmt = bd.KVFormat(bits=2, group_size=32)  # (the longest residual block, 256 tokens)
    page = 2**24
    cache = bd.KVCache.allocate(1, HKV, D, MAX_SEQLEN, fmt, device="cpu", page_size=page)
    assert cache.max_seqlen == MAX_SEQLEN and MAX_SEQLEN % fmt.residual_block == 0
    assert cache.block_table.tolist() == [list(range(-(-MAX_SEQLEN // page)))]
    with pytest.raises(ValueError, match=rf"max_seqlen must be at most {MAX_SEQLEN} .*got {MAX_SEQLEN + 1}"):
        bd.KVCache.allocate(1, HKV, D, MAX_SEQLEN + 1, fmt, device="cpu", page_size=page)


def test_allocate_too_large_says_what_it_asked_for(monkeypatch):
    """A cache the device cannot hold: the allocator's failure (stood in for: a real one
    would need the memory) comes back as torch.OutOfMemoryError naming the arguments and
    the GiB its packed pages need (``KVFormat.bytes_per_token``), nothing else changed:
    a cache that fits keeps its identity block table."""
    fmt = bd.KVFormat(bits=2, k_mode="token", group_size=32, sink_tokens=4)
    small = bd.KVCache.allocate(3, HKV, D, 1000, fmt, device="cpu", page_size=256)
    assert small.block_table.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    packed = small.memory_bytes() - sum(t.numel() * t.element_size() for t in (
        small.k_res, small.v_res, small.seqlens, small.block_table, small.k_sink, small.v_sink))
    assert packed == 3 * 1024 * HKV * fmt.bytes_per_token(D)  # (what the message counts)

    zeros = torch.zeros

    def refuse_large(*shape, **kw):
        if math.prod(shape[0] if isinstance(shape[0], (tuple, list, torch.Size)) else shape) > 2**30:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes.")
        return zeros(*shape, **kw)

    monkeypatch.setattr(torch, "zeros", refuse_large)
    gib = f"{64 * 10**8 * HKV * FMT.bytes_per_token(D) / 2**30:.2f}"  # (a page a sequence of 10**8 tokens)
    gib16 = f"{2 * 64 * 128 * HKV * D * 2 / 2**30:.2f}"  # (the residual blocks)
    with pytest.raises(torch.OutOfMemoryError, match=rf"^KVCache.allocate\(batch=64, num_kv_heads=2, head_dim=64, "
                                                     rf"max_seqlen=100000000, fmt=.*\): its packed pages need {gib} "
                                                     rf"GiB and its 16-bit residual and sink buffers {gib16} GiB on "
                                                     r"cpu, which could not be allocated \(DefaultCPUAllocator"):
        bd.KVCache.allocate(64, HKV, D, 10**8, FMT, device="cpu")
    # sink buffers too large to allocate: the message counts them
    sinks = dataclasses.replace(FMT, sink_tokens=10**9)
    with pytest.raises(torch.OutOfMemoryError, match=r"and its 16-bit residual and sink buffers 953.67 GiB on cpu"):
        bd.KVCache.allocate(2, HKV, D, 10**9, sinks, device="cpu")
    with pytest.raises(ValueError, match="fmt.sink_tokens=1000000000 exceeds max_seqlen=100"):  # (never filled)
        bd.KVCache.allocate(2, HKV, D, 100, sinks, device="cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_allocate_on_cuda_without_cuda():
    with pytest.raises(ValueError, match="device must be a usable torch device, got 'cuda' but CUDA is not available"):
        bd.KVCache.allocate(B, HKV, D, N, FMT)  # device="cuda" is the default


# --------------------------------------------------------------------------------------
# prefill / append
# --------------------------------------------------------------------------------------

_k, _v = kv(4)
_bad_cases = [
    ("not a tensor", lambda: (_k.tolist(), _v), TypeError, "k must be a torch.Tensor, got list"),
    ("dtype", lambda: (_k.bfloat16(), _v), TypeError, "k must have dtype torch.float16, got torch.bfloat16"),
    ("v dtype", lambda: (_k, _v.float()), TypeError, "v must have dtype torch.float16, got torch.float32"),
    ("rank", lambda: (_k[0], _v[0]), ValueError, r"k must have shape \(2, \*, 2, 64\), got \(4, 2, 64\)"),
    ("batch", lambda: kv(4, batch=3), ValueError, r"k must have shape \(2, \*, 2, 64\), got \(3, 4, 2, 64\)"),
    ("heads", lambda: kv(4, heads=4), ValueError, r"k must have shape \(2, \*, 2, 64\), got \(2, 4, 4, 64\)"),
    ("head dim", lambda: kv(4, dim=128), ValueError, r"k must have shape \(2, \*, 2, 64\), got \(2, 4, 2, 128\)"),
    ("v shape", lambda: (_k, _v[:, :3]), ValueError, r"v must have shape \(2, 4, 2, 64\), got \(2, 3, 2, 64\)"),
    ("strides", lambda: (_k.transpose(2, 3).contiguous().transpose(2, 3), _v), ValueError,
     "k must have a contiguous last dimension, got strides"),
    ("device", lambda: (_k.to("meta"), _v), ValueError, "k must be on cpu, got meta"),
]


@pytest.mark.parametrize("what", ["prefill", "append"])
@pytest.mark.parametrize("case", _bad_cases, ids=[c[0] for c in _bad_cases])
def test_write_errors_leave_the_cache_untouched(cache, what, case):
    _, make, exc, msg = case
    snap = snapshot(cache)
    k, v = make()
    with pytest.raises(exc, match=msg):
        getattr(cache, what)(k, v)
    assert_unchanged(cache, snap)


@pytest.mark.parametrize(
    "seqlens,msg",
    [
        ([4], "seqlens must have 2 entries, got 1"),
        ([4, 5], r"seqlens must lie in \[0, 4\] \(tokens given\), got 5"),
        ([-1, 2], r"seqlens must lie in \[0, 4\] \(tokens given\), got -1"),
        (torch.tensor([1, 2, 3]), "seqlens must have 2 entries, got 3"),
    ],
)
def test_prefill_seqlens_errors(cache, seqlens, msg):
    snap = snapshot(cache)
    with pytest.raises(ValueError, match=msg):
        cache.prefill(*kv(4), seqlens=seqlens)
    assert_unchanged(cache, snap)


def test_capacity(cache):
    snap = snapshot(cache)
    with pytest.raises(ValueError, match=r"prefill: k has 201 tokens, more than max_seqlen=200"):
        cache.prefill(*kv(201))
    assert_unchanged(cache, snap)
    with pytest.raises(ValueError, match="append of 51 tokens would grow sequence 0 from 150 to 201 tokens, "
                                         "beyond max_seqlen=200; nothing was written"):
        cache.append(*kv(51))
    assert_unchanged(cache, snap)
    cache.append(*kv(50))  # exactly full is fine
    assert cache.lengths == [200, 200]
    snap = snapshot(cache)
    with pytest.raises(ValueError, match="from 200 to 201 tokens"):
        cache.append(*kv(1))
    assert_unchanged(cache, snap)


# --------------------------------------------------------------------------------------
# decode
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make,kwargs,exc,msg",
    [
        (lambda: q().numpy(), {}, TypeError, "q must be a torch.Tensor, got ndarray"),
        (lambda: q(dtype=torch.bfloat16), {}, TypeError, "q must have dtype torch.float16, got torch.bfloat16"),
        (lambda: q(tokens=0), {}, ValueError, r"q must hold at least one query token per sequence"),
        (lambda: q(batch=1), {}, ValueError, r"q must have shape \(2, \*, \*, 64\), got \(1, 1, 8, 64\)"),
        (lambda: q(dim=128), {}, ValueError, r"q must have shape \(2, \*, \*, 64\), got \(2, 1, 8, 128\)"),
        (lambda: q(heads=7), {}, ValueError, "q has 7 heads, not a positive multiple of the cache's 2 KV heads"),
        (lambda: q(heads=0), {}, ValueError, "q has 0 heads, not a positive multiple of the cache's 2 KV heads"),
        (lambda: q()[..., ::2], {}, ValueError, "q must have shape"),
        (lambda: q().transpose(2, 3).contiguous().transpose(2, 3), {}, ValueError,
         "q must have a contiguous last dimension"),
        (lambda: q().to("meta"), {}, ValueError, "k_pack is on cpu but q is on meta"),
        (q, dict(softmax_scale="0.1"), TypeError, "softmax_scale must be a float or None, got str"),
        (q, dict(softmax_scale=float("nan")), ValueError, "softmax_scale must be finite, got nan"),
        (q, dict(num_splits=-1), ValueError, r"num_splits must be an int in \[0, 256\] \(0 picks a heuristic\), got -1"),
        (q, dict(num_splits=1.5), ValueError, r"num_splits must be an int in \[0, 256\]"),
        (q, dict(num_splits=257), ValueError, r"num_splits must be an int in \[0, 256\] .*got 257"),
        (q, dict(backend="triton"), ValueError, "backend must be one of"),
        (q, dict(return_lse="no"), TypeError, "return_lse must be a bool, got str"),
        (q, dict(return_lse=1, k_new=torch.zeros(B, 1, HKV, D, dtype=FP16), v_new=torch.zeros(B, 1, HKV, D, dtype=FP16)),
         TypeError, "return_lse must be a bool, got int"),
        (q, dict(backend="sm80"), ValueError, "backend 'sm80' runs CUDA kernels, but the tensors are on cpu"),
    ],
)
def test_decode_errors(cache, make, kwargs, exc, msg):
    snap = snapshot(cache)
    with pytest.raises(exc, match=msg):
        bd.decode(make(), cache, **kwargs)
    assert_unchanged(cache, snap)


def test_decode_needs_a_cache():
    with pytest.raises(TypeError, match="cache must be a bitdecode.KVCache, got dict"):
        bd.decode(q(), {})


def test_kernel_gqa_limit(cache):
    tensors = cache.tensors()
    with pytest.raises(ValueError, match=r"q has 17 query heads per KV head; the sm80 kernels support 1 to 16"):
        attention.check_query(q(heads=34), tensors, "sm80")
    attention.check_query(q(heads=34), tensors, "reference")


# --------------------------------------------------------------------------------------
# decode_attention (functional form)
# --------------------------------------------------------------------------------------


def _args(cache):
    c = cache.tensors()
    return dict(k_pack=c.k_pack, k_params=c.k_params, v_pack=c.v_pack, v_params=c.v_params, k_res=c.k_res,
                v_res=c.v_res, cache_seqlens=c.cache_seqlens, block_table=None, fmt=cache.fmt)


_functional_cases = [
    ("fmt", lambda a: dict(fmt=None), TypeError, "fmt must be a bitdecode.KVFormat, got NoneType"),
    ("k_res dtype", lambda a: dict(k_res=a["k_res"].float()), TypeError, "k_res must have dtype"),
    ("k_res rank", lambda a: dict(k_res=a["k_res"][0]), ValueError, r"k_res must have shape 4 dims, got \(128, 2, 64\)"),
    ("k_res size", lambda a: dict(k_res=a["k_res"][:, :64]), ValueError, r"k_res must have shape \(2, 128, \*, 64\)"),
    ("v_res dtype", lambda a: dict(v_res=a["v_res"].bfloat16()), TypeError, "v_res must have dtype torch.float16"),
    ("v_res shape", lambda a: dict(v_res=a["v_res"][:1]), ValueError, r"v_res must have shape \(2, 128, 2, 64\)"),
    ("v_res strides", lambda a: dict(v_res=a["v_res"].transpose(0, 1).contiguous().transpose(0, 1)), ValueError,
     "v_res must be contiguous"),
    ("k_pack dtype", lambda a: dict(k_pack=a["k_pack"].long()), TypeError, "k_pack must have dtype torch.int32"),
    ("k_pack strides", lambda a: dict(k_pack=a["k_pack"][:, :, :64]), ValueError, "k_pack must be contiguous"),
    ("k_pack page", lambda a: dict(k_pack=a["k_pack"][:, :, :64].contiguous()), ValueError,
     r"k_pack holds pages of 64 tokens; pages must be a multiple of the residual block \(128 tokens for 4-bit\)"),
    ("k_pack words", lambda a: dict(k_pack=a["k_pack"][..., :4].contiguous()), ValueError,
     r"k_pack must have shape \(2, 2, 256, 8\), got \(2, 2, 256, 4\)"),
    ("k_params", lambda a: dict(k_params=a["k_params"][:, :, :4].contiguous()), ValueError,
     r"k_params must have shape \(2, 2, 8, 64\), got \(2, 2, 4, 64\)"),
    ("v_pack", lambda a: dict(v_pack=a["v_pack"].transpose(-1, -2)), ValueError,
     r"v_pack must have shape \(2, 2, 2, 64, 16\), got \(2, 2, 2, 16, 64\)"),
    ("v_pack strides", lambda a: dict(v_pack=a["v_pack"].transpose(0, 1).contiguous().transpose(0, 1)), ValueError,
     "v_pack must be contiguous"),
    ("v_params", lambda a: dict(v_params=a["v_params"][:1]), ValueError, r"v_params must have shape \(2, 2, 16, 2, 16\)"),
    ("seqlens dtype", lambda a: dict(cache_seqlens=a["cache_seqlens"].long()), TypeError,
     "cache_seqlens must have dtype torch.int32, got torch.int64"),
    ("seqlens shape", lambda a: dict(cache_seqlens=a["cache_seqlens"][:1]), ValueError,
     r"cache_seqlens must have shape \(2\), got \(1,\)"),
    ("seqlens range", lambda a: dict(cache_seqlens=torch.tensor([150, 400], dtype=torch.int32)), ValueError,
     r"cache_seqlens must lie in \[0, 383\] for this cache \(1 pages of 256 tokens \+ a 128-token residual\), got min 150, max 400"),
    ("seqlens negative", lambda a: dict(cache_seqlens=torch.tensor([-1, 3], dtype=torch.int32)), ValueError,
     "cache_seqlens must lie in .* got min -1"),
    ("pages without table", lambda a: dict(k_pack=a["k_pack"].repeat(2, 1, 1, 1), k_params=a["k_params"].repeat(2, 1, 1, 1),
                                           v_pack=a["v_pack"].repeat(2, 1, 1, 1, 1), v_params=a["v_params"].repeat(2, 1, 1, 1, 1)),
     ValueError, "without block_table the cache must hold one page per sequence: k_pack has 4 pages for batch 2"),
    ("table dtype", lambda a: dict(block_table=torch.zeros(2, 1, dtype=torch.int64)), TypeError,
     "block_table must have dtype torch.int32, got torch.int64"),
    ("table rows", lambda a: dict(block_table=torch.zeros(3, 1, dtype=torch.int32)), ValueError,
     r"block_table must have shape \(2, \*\), got \(3, 1\)"),
    ("table range", lambda a: dict(block_table=torch.tensor([[0], [2]], dtype=torch.int32)), ValueError,
     r"block_table entries in use must lie in \[0, 2\), got \[0, 2\]"),
    ("table shared page", lambda a: dict(block_table=torch.tensor([[1], [1]], dtype=torch.int32)), ValueError,
     r"block_table entries in use must be distinct pages: page 1 is used more than once \(sequences \[0, 1\]\)"),
    ("device", lambda a: dict(v_params=a["v_params"].to("meta")), ValueError, "v_params is on meta but k_res is on cpu"),
    ("return_lse", lambda a: dict(return_lse="yes"), TypeError, "return_lse must be a bool, got str"),
    ("check_values", lambda a: dict(check_values=None), TypeError, "check_values must be a bool, got NoneType"),
]


@pytest.mark.parametrize("case", _functional_cases, ids=[c[0] for c in _functional_cases])
def test_decode_attention_errors(cache, case):
    _, change, exc, msg = case
    args = _args(cache)
    args |= change(args)
    snap = snapshot(cache)
    with pytest.raises(exc, match=msg):
        bd.decode_attention(q(), **args, backend="reference")
    assert_unchanged(cache, snap)


@pytest.mark.parametrize("name", ["seqlens range", "seqlens negative", "table range", "table shared page"])
def test_decode_attention_on_the_reference_checks_values_whatever_check_values_says(cache, name):
    """``check_values=False`` saves a GPU backend its device sync; the reference reads the
    lengths and the table on the host anyway, so it refuses bad ones as the torch op does,
    not returns a sum over the tokens it happened to read."""
    _, change, exc, msg = next(c for c in _functional_cases if c[0] == name)
    args = _args(cache)
    args |= change(args)
    with pytest.raises(exc, match=msg):
        bd.decode_attention(q(), **args, backend="reference", check_values=False)


def test_decode_attention_accepts_the_cache_tensors(cache):
    query = q()
    out = bd.decode_attention(query, **_args(cache), backend="reference")
    assert out.shape == (B, 1, HQ, D)
    # unused block-table entries may hold anything: only the pages in use are checked
    args = _args(cache) | dict(block_table=torch.tensor([[0, -7], [1, 99]], dtype=torch.int32))
    assert torch.equal(bd.decode_attention(query, **args, backend="reference"), out)


def _packed(fmt, n=128):
    """(k, k_pack, k_params, v_pack, v_params) of ``n`` tokens, one head of D channels."""
    k = torch.randn(1, n, D, generator=torch.Generator().manual_seed(3)).half()
    return (k, *bd.reference.pack_k(k, fmt), *bd.reference.pack_v(k, fmt))


F4, F2 = bd.KVFormat(bits=4, group_size=32), bd.KVFormat(bits=2, group_size=32)
CODES = torch.zeros(4, 32, dtype=torch.uint8)
SCALE = torch.ones(4, 1, dtype=FP16)
REF_ERRORS = {  # name: (call on _packed(F4)'s tensors, error, message)
    "pack_k 1-d": (lambda p: bd.reference.pack_k(p[0][0, 0], F4), ValueError, r"^k must have shape \[\.\.\., N, D\]"),
    "pack_k list": (lambda p: bd.reference.pack_k([1.0, 2.0], F4), TypeError, "^k must be a torch.Tensor"),
    "pack_k groups": (lambda p: bd.reference.pack_k(p[0][:, :100], F4), ValueError, "^k has 100 values along"),
    "pack_v 1-d": (lambda p: bd.reference.pack_v(p[0][0, 0], F4), ValueError, r"^v must have shape \[\.\.\., N, D\]"),
    "pack_v list": (lambda p: bd.reference.pack_v([1.0, 2.0], F4), TypeError, "^v must be a torch.Tensor"),
    "pack_v float32": (lambda p: bd.reference.pack_v(p[0].float(), F4), TypeError, "^v must have dtype"),
    "unpack_k other bits": (lambda p: bd.reference.unpack_k(p[1], p[2], F2, FP16), ValueError,
                            "^k_params .* and k_pack .* are not one packing of"),
    "unpack_k float params": (lambda p: bd.reference.unpack_k(p[1], p[2].float(), F4, FP16), TypeError,
                              "^k_params must have dtype torch.int32"),
    "unpack_k dtype": (lambda p: bd.reference.unpack_k(p[1], p[2], F4, torch.float32), TypeError, "^dtype must be"),
    "unpack_k fmt": (lambda p: bd.reference.unpack_k(p[1], p[2], 4, FP16), TypeError, "^fmt must be"),
    "unpack_v other bits": (lambda p: bd.reference.unpack_v(p[3], p[4], F2, FP16), ValueError,
                            "^v_params .* and v_pack .* are not one packing of"),
    "unpack_v params": (lambda p: bd.reference.unpack_v(p[3], p[4][..., :8], F4, FP16), ValueError, "^v_params"),
    "pack_rows range": (lambda p: bd.reference.pack_rows(CODES + 16, 4), ValueError, r"^codes must lie in \[0, 15\]"),
    "pack_rows float": (lambda p: bd.reference.pack_rows(CODES.float(), 4), TypeError, "^codes must have dtype"),
    "pack_rows bits": (lambda p: bd.reference.pack_rows(CODES, 3), ValueError, "^bits must be one of"),
    "pack_params float32": (lambda p: bd.reference.pack_params(SCALE.float(), SCALE.float()), TypeError,
                            "^scale must have dtype"),
    "pack_params shapes": (lambda p: bd.reference.pack_params(SCALE, SCALE[:2]), ValueError, "^zero must have shape"),
    "dequantize group 0": (lambda p: bd.reference.dequantize(CODES, SCALE, SCALE, 0), ValueError, "^group_size"),
    "dequantize float group": (lambda p: bd.reference.dequantize(CODES, SCALE, SCALE, 32.0), TypeError, "^group_size"),
    "dequantize shapes": (lambda p: bd.reference.dequantize(CODES, SCALE, SCALE, 16), ValueError,
                          r"^scale and zero must have shape \(4, 2\)"),
}


@pytest.mark.parametrize("case", sorted(REF_ERRORS))
def test_reference_helpers_name_what_they_refuse(case):
    """``bd.reference``'s packing helpers refuse what they cannot pack or unpack with an
    error naming the argument (not torch's own IndexError / RuntimeError from inside), and
    take what ``pack_k`` / ``pack_v`` made back exactly."""
    call, exc, msg = REF_ERRORS[case]
    with pytest.raises(exc, match=msg):
        call(_packed(F4))


def test_reference_helpers_round_trip_what_they_check():
    k, kp, ks, vp, vs = _packed(F4)
    assert torch.equal(bd.reference.unpack_k(kp, ks, F4, FP16), bd.reference.dequantize(
        *bd.reference.quantize(k, 4, 32, dim=-2), 32, dim=-2))
    assert torch.equal(bd.reference.unpack_v(vp, vs, F4, FP16), bd.reference.dequantize(
        *bd.reference.quantize(k, 4, 32, dim=-1), 32, dim=-1))
    assert torch.equal(bd.reference.unpack_rows(bd.reference.pack_rows(CODES + 15, 4), 4, 32), CODES + 15)


def test_numpy_ints_are_ints():
    """numpy's ints (what a length or size read from an array is) pass every int check as
    Python ints, as ``seqlens`` and ``reorder`` already took them; bools stay refused."""
    np = pytest.importorskip("numpy")
    fmt = bd.KVFormat(bits=4, sink_tokens=np.int64(4))
    assert type(fmt.sink_tokens) is int and fmt.sink_tokens == 4
    c = bd.KVCache.allocate(np.int64(2), np.int32(2), np.int64(128), np.int64(512), fmt=fmt,
                            page_size=np.int64(256), backend="reference", device="cpu")
    assert (c.batch, c.page_size, c.max_seqlen) == (2, 256, 512) and type(c.max_seqlen) is int
    k = torch.randn(2, 300, 2, 128, dtype=torch.float16)
    c.prefill(k, k)
    c.truncate(np.int64(3))
    assert c.lengths == [297, 297]
    with pytest.raises(ValueError, match="tokens must be an int >= 0, got True"):
        c.truncate(True)


def test_formats_and_options_take_numpy_scalars_as_python_ones():
    """KVFormat's widths and group and ``num_splits`` take numpy ints as ints; a numpy bool
    given for a flag is named as numpy's (the message said "must be a bool, got bool");
    the derived ``residual_block`` stays out of the format's repr, which rebuilds it; sinks
    past the capacity are refused (buffers no sequence could fill)."""
    np = pytest.importorskip("numpy")
    fmt = bd.KVFormat(bits=np.int64(4), group_size=np.int64(64), v_bits=np.int32(2))
    assert fmt == bd.KVFormat(bits=4, group_size=64, v_bits=2) and type(fmt.bits) is int
    assert eval("bd." + repr(fmt)) == fmt and "residual_block" not in repr(fmt)
    c = bd.KVCache.allocate(1, 2, 128, 512, fmt=bd.KVFormat(bits=4), backend="reference", device="cpu")
    k = torch.randn(1, 300, 2, 128, dtype=torch.float16)
    c.prefill(k, k)
    q = torch.randn(1, 1, 4, 128, dtype=torch.float16)
    assert torch.equal(bd.decode(q, c, num_splits=np.int64(2)), bd.decode(q, c, num_splits=2))
    with pytest.raises(TypeError, match="return_lse must be a bool, got numpy.bool"):
        bd.decode(q, c, return_lse=np.bool_(True))
    with pytest.raises(ValueError, match="fmt.sink_tokens=600 exceeds max_seqlen=512"):
        bd.KVCache.allocate(1, 2, 128, 512, fmt=bd.KVFormat(bits=4, sink_tokens=600), backend="reference",
                            device="cpu")


def _unchecked_cache(lens, fmt=bd.KVFormat(bits=4, group_size=32)):
    c = bd.KVCache.allocate(B, HKV, D, N, fmt, device="cpu")
    return attention.check_cache(fmt, c.k_pack, c.k_params, c.v_pack, c.v_params, c.k_res, c.v_res,
                                 torch.tensor(lens, dtype=torch.int32), c.block_table, check_values=False)


def test_lengths_up_to_full_pages_and_a_residual_block_less_one_are_valid():
    """The longest length a cache holds: every page packed, the residual block one short of
    full; one more is refused."""
    nr = bd.KVFormat(bits=4, group_size=32).residual_block
    top = _unchecked_cache([0, 0]).max_packed_tokens
    attention.check_cache_values(_unchecked_cache([top, top + nr - 1]))
    with pytest.raises(ValueError, match="cache_seqlens must lie in"):
        attention.check_cache_values(_unchecked_cache([0, top + nr]))


def test_query_heads_up_to_the_backends_gqa_limit():
    """Exactly ``max_gqa`` query heads per KV head are taken; one more is refused by name."""
    from bitdecode import backend as backends

    cache = _unchecked_cache([1, 1])
    g = backends.get("sm80").limits.max_gqa
    attention.check_query(q(heads=HKV * g), cache, "sm80")
    with pytest.raises(ValueError, match="query heads per KV head"):
        attention.check_query(q(heads=HKV * (g + 1)), cache, "sm80")
