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
                                          t.cache_seqlens, t.block_table, 4, "channel", 64, 64 ** -0.5, 0,
                                          "reference")
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


def test_decode_op_fake_shapes():
    torch.library.opcheck(torch.ops.bitdecode.decode.default, _op_args(torch.Generator().manual_seed(0)),
                          test_utils=("test_schema", "test_faketensor"))


def _op_args(gen):
    cache = _cache(gen, [140, 7])
    t = cache.tensors()
    q = torch.randn(2, 1, 4, 64, generator=gen).half()
    return (q, t.k_pack, t.k_params, t.v_pack, t.v_params, t.k_res, t.v_res, t.cache_seqlens, t.block_table,
            4, "channel", 64, 0.125, 0, "reference")


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
