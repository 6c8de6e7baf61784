"""torch.library ops: the decode op equals the Python call, and torch.compile(fullgraph)
traces through it (CPU, reference backend)."""

from __future__ import annotations

import pytest
import torch

import bitdecode as bd
from bitdecode import ops

import kvdata


def _cache(gen, lens, bits=4):
    fmt = bd.KVFormat(bits=bits, group_size=64)
    n = max(lens)
    k, v = kvdata.kv(gen, len(lens), n, 2, 64, dtype=torch.float16, device="cpu")
    cache = bd.KVCache.allocate(len(lens), 2, 64, n + 8, fmt, dtype=torch.float16, device="cpu", backend="reference")
    cache.prefill(k, v, lens)
    return cache


def test_decode_op_equals_the_python_call(gen):
    cache = _cache(gen, [300, 129, 5])
    q = torch.randn(3, 1, 8, 64, generator=gen).half()
    want, want_lse = bd.decode(q, cache, return_lse=True)
    t = cache.tensors()
    out, lse = torch.ops.bitdecode.decode(q, t.k_pack, t.k_params, t.v_pack, t.v_params, t.k_res, t.v_res,
                                          t.cache_seqlens, t.block_table, None, None, 4, 4, "channel", 64, 0, "",
                                          False, 64 ** -0.5, 0, "reference")
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


def test_raw_ops_rotate_under_hadamard(gen):
    """The raw ops take the format's Hadamard flag: K and q come in the model's basis, as
    with the Python calls (the schema used to drop the flag, so a raw decode over a rotated
    cache with an unrotated q was silently wrong)."""
    fmt = bd.KVFormat(bits=4, group_size=64, hadamard=True)
    a, b = (bd.KVCache.allocate(2, 2, 64, 200, fmt, device="cpu", backend="reference") for _ in range(2))
    k, v = kvdata.kv(gen, 2, 150, 2, 64, dtype=torch.float16, device="cpu")
    a.prefill(k[:, :140], v[:, :140], [140, 70])
    a.append(k[:, 140:], v[:, 140:])
    t = b.tensors()
    args = (t.k_pack, t.k_params, t.v_pack, t.v_params, t.k_res, t.v_res, t.cache_seqlens, t.block_table,
            t.overflow, t.commits, None, None, 4, 4, "channel", 64, 0, "", True, t.capacity, "reference")
    torch.ops.bitdecode.prefill(k[:, :140], v[:, :140], torch.tensor([140, 70], dtype=torch.int32), *args)
    torch.ops.bitdecode.append(k[:, 140:], v[:, 140:], *args)
    for name in ("k_pack", "k_params", "v_pack", "v_params", "k_res", "v_res"):
        assert torch.equal(getattr(t, name), getattr(a.tensors(), name)), name
    q = torch.randn(2, 1, 4, 64, generator=gen).half()
    out, lse = torch.ops.bitdecode.decode(q, *args[:8], None, None, *args[12:18], True, 0.125, 0, "reference")
    want, want_lse = bd.decode(q, a, softmax_scale=0.125, return_lse=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


def test_decode_op_fake_shapes():
    torch.library.opcheck(torch.ops.bitdecode.decode.default, _op_args(torch.Generator().manual_seed(0)),
                          test_utils=("test_schema", "test_faketensor"))


def _op_args(gen):
    cache = _cache(gen, [140, 7])
    t = cache.tensors()
    q = torch.randn(2, 1, 4, 64, generator=gen).half()
    return (q, t.k_pack, t.k_params, t.v_pack, t.v_params, t.k_res, t.v_res, t.cache_seqlens, t.block_table,
            None, None, 4, 4, "channel", 64, 0, "", False, 0.125, 0, "reference")


def test_compiled_step_traces_the_op_in_one_graph(gen):
    """A decode-step-shaped function (projection, attention over the cache, projection)
    compiles with fullgraph=True: the op is one opaque node."""
    cache = _cache(gen, [260, 64])
    w_q = torch.randn(64, 4 * 64, generator=gen).half()
    w_o = torch.randn(4 * 64, 64, generator=gen).half()
    x = torch.randn(2, 64, generator=gen).half()

    def step(x):
        q = (x @ w_q).view(2, 1, 4, 64)
        o = ops.decode_cache(q, cache, 64 ** -0.5)
        return o.reshape(2, -1) @ w_o

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), step(x))


# --------------------------------------------------------------------------------------
# the write ops
# --------------------------------------------------------------------------------------


def _twins(gen, lens, max_seqlen=None, sinks=0, hadamard=False, v_bits=None):
    fmt = bd.KVFormat(bits=4, group_size=64, sink_tokens=sinks, hadamard=hadamard, v_bits=v_bits)
    n = max(lens)
    k, v = kvdata.kv(gen, len(lens), n, 2, 64, dtype=torch.float16, device="cpu")
    caches = [bd.KVCache.allocate(len(lens), 2, 64, max_seqlen or n + 200, fmt, dtype=torch.float16, device="cpu",
                                  backend="reference") for _ in range(2)]
    return caches, k, v


def _same_storage(a, b):
    for name in ("k_pack", "k_params", "v_pack", "v_params", "k_res", "v_res", "seqlens", "overflow"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for x, y in zip(a.tensors().sinks or (), b.tensors().sinks or ()):
        assert torch.equal(x, y), "sinks"


@pytest.mark.parametrize("sinks, hadamard, v_bits", [(0, False, None), (24, False, None), (0, True, None),
                                                     (0, False, 2)])
def test_write_ops_equal_the_python_calls(gen, sinks, hadamard, v_bits):
    (a, b), k, v = _twins(gen, [150, 20], sinks=sinks, hadamard=hadamard, v_bits=v_bits)
    a.prefill(k, v, [150, 20])
    ops.prefill_cache(k, v, torch.tensor([150, 20], dtype=torch.int32), b)
    _same_storage(a, b)
    new_k, new_v = kvdata.kv(gen, 2, 120, 2, 64, dtype=torch.float16, device="cpu")
    a.append(new_k, new_v)  # completes a packed block of both sequences
    ops.append_cache(new_k, new_v, b)
    _same_storage(a, b)
    b.check()  # the ops leave the host lengths behind; check() reads them back
    assert b.lengths == a.lengths == [270, 140]
    q = torch.randn(2, 1, 4, 64, generator=gen).half()
    assert torch.equal(ops.decode_cache(q, b, 0.125), bd.decode(q, a, softmax_scale=0.125))


def test_append_op_refuses_a_sequence_past_capacity_on_the_device(gen):
    """What a replayed graph gets: no host check, the sequence is left as it was and flagged."""
    (a, _), k, v = _twins(gen, [250, 10], max_seqlen=256)
    a.prefill(k, v, [250, 10])
    before = {n: getattr(a, n).clone() for n in ("k_pack", "k_params", "v_pack", "v_params", "k_res", "v_res")}
    new_k, new_v = kvdata.kv(gen, 2, 8, 2, 64, dtype=torch.float16, device="cpu")
    ops.append_cache(new_k, new_v, a)
    assert a.seqlens.tolist() == [250, 18] and a.overflow.tolist() == [258, 0]
    assert torch.equal(a.k_res[0], before["k_res"][0]) and torch.equal(a.v_res[0], before["v_res"][0])
    with pytest.raises(bd.CacheOverflowError, match=r"sequence 0 \(asked for 258 tokens\)"):
        a.check()


def test_append_op_fills_a_sequence_to_capacity_and_not_one_past(gen):
    """The device check's edge: 256 tokens fit a 256-token capacity, 257 do not."""
    (a, _), k, v = _twins(gen, [250, 249], max_seqlen=256)
    a.prefill(k, v, [250, 249])
    new_k, new_v = kvdata.kv(gen, 2, 7, 2, 64, dtype=torch.float16, device="cpu")
    ops.append_cache(new_k[:, :6], new_v[:, :6], a)  # 256 and 255: both fit
    assert a.capacity == 256 and a.seqlens.tolist() == [256, 255] and a.overflow.tolist() == [0, 0]
    ops.append_cache(new_k[:, 6:], new_v[:, 6:], a)  # 257 past it, 256 at it
    assert a.seqlens.tolist() == [256, 256] and a.overflow.tolist() == [257, 0]


@pytest.mark.parametrize("sinks", [0, 4])
@pytest.mark.parametrize("op", ["append", "prefill"])
def test_write_op_schemas_and_fakes(gen, op, sinks):
    (a, _), k, v = _twins(gen, [70, 3], sinks=sinks)
    a.prefill(k, v, [70, 3])
    args = (k[:, :2].contiguous(), v[:, :2].contiguous())
    if op == "prefill":
        args += (torch.tensor([2, 1], dtype=torch.int32),)
    torch.library.opcheck(getattr(torch.ops.bitdecode, op).default, args + ops._write_args(a),
                          test_utils=("test_schema", "test_faketensor"))


def test_compiled_step_traces_append_and_decode_in_one_graph(gen):
    """A decode step that appends the new token and attends over the cache compiles with
    fullgraph=True and does what the eager calls do."""
    (a, b), k, v = _twins(gen, [130, 60])
    for c in (a, b):
        c.prefill(k, v, [130, 60])
    x = torch.randn(2, 64, generator=gen).half()
    w = torch.randn(64, 3 * 4 * 64, generator=gen).half() / 8

    def step(x, cache):
        q, kk, vv = (x @ w).view(2, 1, 3, 4 * 64).unbind(2)
        kk = kk.reshape(2, 1, 4, 64)[:, :, :2].contiguous()
        vv = vv.reshape(2, 1, 4, 64)[:, :, :2].contiguous()
        ops.append_cache(kk, vv, cache)
        return ops.decode_cache(q.reshape(2, 1, 4, 64).contiguous(), cache, 0.125)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = compiled(x, a)
    want = step(x, b)
    assert torch.equal(got, want)
    _same_storage(a, b)


def test_ops_carry_both_widths(gen):
    """K 2-bit / V 4-bit through the ops equals the Python calls (the schema carries v_bits)."""
    fmt = bd.KVFormat(bits=2, v_bits=4, group_size=64)
    a, b = (bd.KVCache.allocate(1, 2, 64, 600, fmt, device="cpu", backend="reference") for _ in range(2))
    k, v = kvdata.kv(gen, 1, 520, 2, 64, dtype=torch.float16, device="cpu")
    a.prefill(k[:, :500], v[:, :500])
    ops.prefill_cache(k[:, :500], v[:, :500], torch.tensor([500], dtype=torch.int32), b)
    a.append(k[:, 500:], v[:, 500:])
    ops.append_cache(k[:, 500:], v[:, 500:], b)
    _same_storage(a, b)
    q = torch.randn(1, 1, 4, 64, generator=gen).half()
    assert torch.equal(ops.decode_cache(q, b, 0.125), bd.decode(q, a, softmax_scale=0.125))


@pytest.mark.parametrize("fp4, hadamard", [("nvfp4", False), ("mxfp4", True)])
def test_ops_carry_fp4(gen, fp4, hadamard):
    """An FP4 cache (with sinks, and rotated) through the ops equals the Python calls (the
    schema carries the FP4 format), and the write ops pass torch's schema / fake checks."""
    fmt = bd.KVFormat(fp4=fp4, sink_tokens=3, hadamard=hadamard)
    a, b = (bd.KVCache.allocate(2, 2, 64, 600, fmt, device="cpu", backend="reference") for _ in range(2))
    k, v = kvdata.kv(gen, 2, 420, 2, 64, dtype=torch.float16, device="cpu")
    a.prefill(k[:, :300], v[:, :300], [300, 131])
    ops.prefill_cache(k[:, :300], v[:, :300], torch.tensor([300, 131], dtype=torch.int32), b)
    _same_storage(a, b)
    a.append(k[:, 300:], v[:, 300:])  # completes packed blocks of both sequences
    ops.append_cache(k[:, 300:], v[:, 300:], b)
    _same_storage(a, b)
    q = torch.randn(2, 1, 4, 64, generator=gen).half()
    assert torch.equal(ops.decode_cache(q, b, 0.125), bd.decode(q, a, softmax_scale=0.125))
    torch.library.opcheck(torch.ops.bitdecode.append.default,
                          (k[:, :2].contiguous(), v[:, :2].contiguous()) + ops._write_args(a),
                          test_utils=("test_schema", "test_faketensor"))


def test_write_ops_check_k_and_v(gen):
    """The write ops are public: a K / V torch would broadcast or cast (one head for two, a
    batch of one, fp32), or lengths past what was given, are refused by name and nothing
    is written (the reference backend, which reads the lengths on the host anyway)."""
    c = _cache(gen, [20, 9])
    before = {n: getattr(c, n).clone() for n in ("k_pack", "k_params", "v_pack", "v_params", "k_res", "v_res",
                                                 "seqlens")}
    k, v = kvdata.kv(gen, 2, 3, 2, 64, dtype=torch.float16, device="cpu")
    for bad_k, bad_v, err, msg in ((k[:, :, :1], v[:, :, :1], ValueError, r"^k must have shape \(2, \*, 2, 64\)"),
                                   (k[:1], v[:1], ValueError, "^k must have shape"),
                                   (k.float(), v, TypeError, "^k must have dtype torch.float16"),
                                   (k, v[:, :1], ValueError, r"^v must have shape \(2, 3, 2, 64\)")):
        with pytest.raises(err, match=msg):
            ops.append_cache(bad_k, bad_v, c)
    lens = torch.tensor([3, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"seqlens must lie in \[0, 3\].*got 4"):
        ops.prefill_cache(k, v, torch.tensor([4, 2], dtype=torch.int32), c)
    with pytest.raises(ValueError, match=r"seqlens must lie in \[0, 3\].*got -1"):
        ops.prefill_cache(k, v, torch.tensor([-1, 2], dtype=torch.int32), c)
    with pytest.raises(TypeError, match="^seqlens must have dtype torch.int32"):
        ops.prefill_cache(k, v, lens.long(), c)
    assert all(torch.equal(getattr(c, n), t) for n, t in before.items())
    ops.prefill_cache(k, v, lens, c)
    assert c.seqlens.tolist() == [3, 2]


def test_write_ops_check_the_cache_against_their_format(gen):
    """The write ops check the cache tensors against the format and capacity they are
    given, as the decode op does, before anything is written: another group size, K mode
    or FP4 format, sink tokens the cache has no buffers for, a capacity past its pages; and
    on the reference backend (which reads them on the host anyway) the lengths and the
    pages the write reaches.  Nothing is written by a refused call."""
    c = _cache(gen, [200, 9])
    names = ("k_pack", "k_params", "v_pack", "v_params", "k_res", "v_res", "seqlens", "block_table")
    before = {n: getattr(c, n).clone() for n in names}
    k, v = kvdata.kv(gen, 2, 130, 2, 64, dtype=torch.float16, device="cpu")  # (either sequence reaches a page)
    args = list(ops._write_args(c))
    at = {"bits": 12, "k_mode": 14, "group_size": 15, "sink_tokens": 16, "fp4": 17, "capacity": 19}
    table = args[7]

    def changed(**kw):
        out = list(args)
        for key, value in kw.items():
            out[at[key] if key in at else 7] = value
        return out

    for kw, err, msg in ((dict(group_size=32), ValueError, r"^k_params must have shape"),
                         (dict(k_mode="token"), ValueError, r"^k_params must have shape"),
                         (dict(fp4="nvfp4"), ValueError, r"^k_params must have shape"),
                         (dict(sink_tokens=4), TypeError, "^k_sink must be a torch.Tensor"),
                         (dict(capacity=10**6), ValueError, r"^capacity must lie in \[1, 256\]"),
                         (dict(capacity=-1), ValueError, r"^capacity must lie in \[1, 256\].*got -1$"),
                         (dict(capacity=0), ValueError, r"^capacity must lie in \[1, 256\].*got 0$"),
                         (dict(block_table=torch.tensor([[1], [1]], dtype=torch.int32)), ValueError,
                          "page 1 is used more than once"),
                         (dict(block_table=torch.tensor([[-1], [1]], dtype=torch.int32)), ValueError,
                          r"block_table entries in use must lie in \[0, 2\)")):
        for op, head in ((torch.ops.bitdecode.append, (k, v)),
                         (torch.ops.bitdecode.prefill, (k, v, torch.tensor([130, 130], dtype=torch.int32)))):
            with pytest.raises(err, match=msg):
                op(*head, *changed(**kw))
            assert all(torch.equal(getattr(c, n), t) for n, t in before.items()), (kw, op)
    assert table is c.block_table
    # a sound capacity, shorter than the prefill: k's length is refused, after the capacity
    with pytest.raises(ValueError, match="^prefill: k has 130 tokens, more than the capacity of 100$"):
        torch.ops.bitdecode.prefill(k, v, torch.tensor([130, 130], dtype=torch.int32), *changed(capacity=100))
    assert all(torch.equal(getattr(c, n), t) for n, t in before.items())
    # the decode op on the reference: the lengths' values, read on the host anyway
    with pytest.raises(ValueError, match=r"^cache_seqlens must lie in .*got min -5"):
        torch.ops.bitdecode.decode(torch.zeros(2, 1, 4, 64, dtype=torch.float16), *args[:6],
                                   torch.tensor([-5, 9], dtype=torch.int32), table, None, None, *args[12:19], 0.125,
                                   0, "reference")


# --------------------------------------------------------------------------------------
# what the ops refuse or lay out as the real calls do (a helper's audit, sixtieth session)
# --------------------------------------------------------------------------------------


def _decode_args(cache, q, backend="reference", scale=0.125):
    t = cache.tensors()
    return (q, t.k_pack, t.k_params, t.v_pack, t.v_params, t.k_res, t.v_res, t.cache_seqlens, t.block_table,
            None, None, *ops._format_args(t.fmt), scale, 0, backend)


def test_decode_op_fake_is_laid_out_as_the_output(gen):
    """q of several tokens with permuted strides (transformers' ``query.transpose(1, 2)``):
    the real output is dense, and so must the fake be, or inductor reads it with q's strides
    (wrong values with its size asserts off)."""
    cache = _cache(gen, [140, 7])
    q = torch.randn(2, 4, 3, 64, generator=gen).half().permute(0, 2, 1, 3)  # [B, T=3, Hq=4, D]
    args = _decode_args(cache, q)
    torch.library.opcheck(torch.ops.bitdecode.decode.default, args, test_utils=("test_schema", "test_faketensor"))
    out, lse = torch.ops.bitdecode.decode(*args)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake, fake_lse = torch.ops.bitdecode.decode(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                                                      for a in args))
    assert fake.stride() == out.stride() and fake_lse.stride() == lse.stride()
    assert out.is_contiguous()


def test_decode_op_fake_checks_what_the_op_checks(gen):
    """A meta tensor among the cache's CPU tensors sends the call to the fake: it refuses
    what the op would, not returns an output of any shape."""
    cache = _cache(gen, [140, 7])
    q = torch.randn(2, 1, 4, 64, generator=gen).half()
    with pytest.raises(ValueError, match="q is on meta"):
        torch.ops.bitdecode.decode(*_decode_args(cache, q.to("meta")))
    with pytest.raises(ValueError, match="k_res"):
        torch.ops.bitdecode.decode(*_decode_args(cache, q.to("meta")[:, :, :, :32]))


def test_write_op_fakes_check_what_the_ops_check(gen):
    """A meta k, v or seqlens among the cache's CPU tensors sends a write to its fake, which
    used to return as if written: it refuses them as the op would, naming the tensor, and the
    cache is unchanged."""
    cache = _cache(gen, [140, 7])
    snap = [t.clone() for t in (cache.k_pack, cache.k_params, cache.v_pack, cache.v_params, cache.k_res, cache.seqlens)]
    k = torch.randn(2, 1, cache.num_kv_heads, 64, generator=gen).half()
    with pytest.raises(ValueError, match="k must be on cpu, got meta"):
        ops.append_cache(k.to("meta"), k.to("meta"), cache)
    with pytest.raises(ValueError, match="v must be on cpu, got meta"):
        ops.append_cache(k, k.to("meta"), cache)
    lens = torch.tensor([1, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="seqlens must be on cpu, got meta"):
        ops.prefill_cache(k, k, lens.to("meta"), cache)
    with pytest.raises(ValueError, match="k must be on cpu, got meta"):
        ops.prefill_cache(k.to("meta"), k.to("meta"), lens, cache)
    t = cache.tensors()  # a cache tensor on meta, named as the op names it
    args = list(ops._write_args(cache))
    args[1] = t.k_params.to("meta")
    with pytest.raises(ValueError, match="k_params is on meta but k_res is on cpu"):
        torch.ops.bitdecode.append(k, k, *args)
    after = (cache.k_pack, cache.k_params, cache.v_pack, cache.v_params, cache.k_res, cache.seqlens)
    assert all(torch.equal(a, b) for a, b in zip(snap, after))
    with pytest.raises(ValueError, match="seqlens is a meta tensor"):  # the cache's own call names it too
        cache.prefill(k, k, seqlens=lens.to("meta"))


def test_decode_op_with_auto_checks_the_lengths_where_the_reference_runs(gen):
    """``backend="auto"`` on CPU runs the reference, which reads the lengths on the host: so
    it checks them as ``backend="reference"`` does (a length past the pages was read short)."""
    cache = _cache(gen, [140, 7])
    q = torch.randn(2, 1, 4, 64, generator=gen).half()
    for backend in ("reference", "auto"):
        args = list(_decode_args(cache, q, backend))
        for lens in ([600, 7], [-5, 7]):
            args[7] = torch.tensor(lens, dtype=torch.int32)
            with pytest.raises(ValueError, match=r"cache_seqlens must lie in \[0, "):
                torch.ops.bitdecode.decode(*args)


def test_ops_refuse_a_kernel_backend_for_cpu_tensors(gen):
    """The write ops resolve their backend as the decode op does: a kernel backend on CPU
    tensors is refused naming it, and "auto" runs the reference there."""
    cache = _cache(gen, [140, 7])
    k, v = kvdata.kv(gen, 2, 1, 2, 64, dtype=torch.float16, device="cpu")
    q = torch.randn(2, 1, 4, 64, generator=gen).half()
    args = ops._write_args(cache)
    for backend in ("sm80", "sm90"):
        with pytest.raises(ValueError, match=f"backend '{backend}' runs CUDA kernels"):
            torch.ops.bitdecode.append(k, v, *args[:-1], backend)
        with pytest.raises(ValueError, match=f"backend '{backend}' runs CUDA kernels"):
            torch.ops.bitdecode.decode(*_decode_args(cache, q, backend))
    assert cache.seqlens.tolist() == [140, 7]
    torch.ops.bitdecode.append(k, v, *args[:-1], "auto")
    assert cache.seqlens.tolist() == [141, 8]


def test_write_ops_refuse_inference_tensors_before_writing(gen):
    """A cache allocated under inference_mode, written outside it: torch would refuse part of
    the way through (a sequence's residual rows written, its length not); refused first."""
    fmt = bd.KVFormat(bits=4, group_size=64)
    k, v = kvdata.kv(gen, 2, 200, 2, 64, dtype=torch.float16, device="cpu")
    with torch.inference_mode():
        cache = bd.KVCache.allocate(2, 2, 64, 400, fmt, dtype=torch.float16, device="cpu", backend="reference")
        cache.prefill(k, v, [200, 7])
    before = {n: getattr(cache, n).clone() for n in ("k_pack", "k_res", "v_res", "seqlens")}
    new_k, new_v = kvdata.kv(gen, 2, 3, 2, 64, dtype=torch.float16, device="cpu")
    with pytest.raises(RuntimeError, match="inference_mode"):
        ops.append_cache(new_k, new_v, cache)
    with pytest.raises(RuntimeError, match="inference_mode"):
        ops.prefill_cache(k, v, torch.tensor([5, 5], dtype=torch.int32), cache)
    assert all(torch.equal(getattr(cache, n), t) for n, t in before.items())


@pytest.mark.parametrize("scale, error", [(True, TypeError), ("0.1", TypeError), (float("nan"), ValueError)])
def test_decode_cache_checks_the_softmax_scale(gen, scale, error):
    cache = _cache(gen, [140, 7])
    q = torch.randn(2, 1, 4, 64, generator=gen).half()
    with pytest.raises(error, match="softmax_scale"):
        ops.decode_cache(q, cache, scale)
    assert torch.equal(ops.decode_cache(q, cache, None), bd.decode(q, cache))  # (None: 1 / sqrt(D), as bd.decode)


def test_truncate_after_the_ops_reads_the_device_lengths(gen):
    """The ops advance the lengths on the device only; truncate (and reorder) read them
    there, so the block the new end falls in returns to the residual as in the eager twin."""
    (a, b), k, v = _twins(gen, [250], max_seqlen=400)
    a.prefill(k, v, [250])
    b.prefill(k, v, [250])
    new_k, new_v = kvdata.kv(gen, 1, 10, 2, 64, dtype=torch.float16, device="cpu")
    a.append(new_k, new_v)  # 260: completes the second packed block
    ops.append_cache(new_k, new_v, b)
    a.truncate(5)
    b.truncate(5)
    assert a.lengths == b.lengths == [255]
    _same_storage(a, b)
    b.reorder([0])


def test_dynamic_compile_over_query_lengths(gen):
    """``torch.compile(dynamic=True)``: the format's numbers reach the fake as symbols; it
    checks what it can and the step equals the eager twin for several query lengths."""
    (a, b), k, v = _twins(gen, [120, 5], max_seqlen=400)
    a.prefill(k, v, [120, 5])
    b.prefill(k, v, [120, 5])

    def step(q, k, v, cache):
        ops.append_cache(k, v, cache)
        return ops.decode_cache(q, cache, 0.125)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=True)
    for t in (2, 3, 5):
        q = torch.randn(2, t, 4, 64, generator=gen).half()
        new_k, new_v = kvdata.kv(gen, 2, t, 2, 64, dtype=torch.float16, device="cpu")
        assert torch.equal(compiled(q, new_k, new_v, a), step(q, new_k, new_v, b))
    _same_storage(a, b)


def test_prefill_op_takes_a_prompt_of_exactly_the_capacity(gen):
    (cache, _), _, _ = _twins(gen, [1], max_seqlen=256)
    k = torch.randn(1, cache.capacity, 2, 64).half()
    ops.prefill_cache(k, k, torch.tensor([cache.capacity], dtype=torch.int32), cache)
    cache.check()
    assert cache.lengths == [cache.capacity] == [256]


def test_decode_cache_runs_the_caches_backend(gen, monkeypatch):
    """``ops.decode_cache(..., backend="auto")`` hands the op the backend the cache was
    allocated for (on a GPU, "auto" would pick one afresh)."""
    (cache, _), _, _ = _twins(gen, [1], max_seqlen=256)
    seen = []

    class Spy:
        def decode(self, *args):
            seen.append(args[-1])
            return args[0], None

    monkeypatch.setattr(torch.ops, "bitdecode", Spy())
    ops.decode_cache(torch.randn(1, 1, 4, 64).half(), cache, 0.125)
    assert seen == [cache.backend]
