"""The kernel backends (``backend`` fixture: sm80, sm90, ...) on a GPU against the torch
reference (marker ``gpu``).

Decode is checked on caches packed by the reference (so it is tested independently of
the pack kernel) with FlashAttention's tolerance rule: the kernel's error against an fp32
reference may be at most twice that of a same-precision torch computation (P rounded to
the model dtype, as the tensor cores consume it) plus a small floor.  The pack kernel is
checked bit for bit against the reference pack.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys

import pytest
import torch

import bitdecode as bd
from bitdecode import cache as cache_module
from bitdecode import cli_selfcheck, dispatch, selfcheck
from bitdecode.reference import kernel_tolerance

from kernel_builds import built_with, fresh_jit
from kvdata import KERNEL_CONFIGS, kv, needle_batch, on_grid

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # pragma: no cover - CPU machines skip the module
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

DEV = torch.device("cuda")

CONFIGS = KERNEL_CONFIGS  # (kvdata: the CPU suite checks their needle batches' sensitivity)


def _ids(c):
    bits, mode, g, dtype, d, gq = c
    return f"{bits}b-{mode}-g{g}-{str(dtype)[6:]}-d{d}-gq{gq}"


def make_cache(fmt, lens, hkv, d, dtype, page_size=None, backend="reference", seed=0, shuffle=False, room=300):
    gen = torch.Generator().manual_seed(seed)
    n = max(max(lens), 1)
    k, v = kv(gen, len(lens), n, hkv, d, dtype=dtype, device=DEV)
    cache = bd.KVCache.allocate(len(lens), hkv, d, n + room, fmt, dtype=dtype, device=DEV,
                                page_size=page_size, backend=backend)
    if shuffle:
        perm = torch.randperm(cache.block_table.numel(), generator=gen).to(torch.int32).to(DEV)
        cache.block_table.copy_(perm.view_as(cache.block_table))
    cache.prefill(k, v, lens)
    return cache, k, v


def check_decode(q, cache, backend, num_splits=0):
    """The kernel's decode against the reference (``cli_selfcheck.decode_mismatch``: the
    tolerance rule on the output, the LSE, queries that see no token)."""
    why = cli_selfcheck.decode_mismatch(q, cache, backend, num_splits)
    assert not why, why


@pytest.mark.parametrize("cfg", CONFIGS, ids=_ids)
def test_decode_matches_reference(cfg, backend):
    bits, mode, g, dtype, d, gq = cfg
    fmt = bd.KVFormat(bits=bits, k_mode=mode, group_size=g)
    nr = fmt.residual_block
    lens = [3 * nr + 5, nr, 1, 0, nr - 1, 7 * nr + nr // 2]
    hkv = 2
    cache, _, _ = make_cache(fmt, lens, hkv, d, dtype)
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(len(lens), 1, hkv * gq, d, generator=gen).to(dtype).to(DEV)
    for splits in (0, 1, 3):
        check_decode(q, cache, backend, num_splits=splits)


@pytest.mark.parametrize("cfg", CONFIGS, ids=_ids)
def test_every_token_counts_under_a_needle(cfg, backend):
    """A needle token (a logit ~24 above the rest) at each place a decode could drop or
    misplace a token (``kvdata.needle_positions``: block ends, the packed part's end, the
    residual's first and last): the output is ~that token's V, so a miss costs ~|V|, where
    random data hides one token of hundreds within the tolerance (test_reference.py checks
    these batches' margin on the CPU)."""
    bits, mode, g, dtype, d, gq = cfg
    fmt = bd.KVFormat(bits=bits, k_mode=mode, group_size=g)
    q, k, v, lens, _ = needle_batch(fmt.residual_block, 2, d, gq, dtype, DEV)
    cache = bd.KVCache.allocate(len(lens), 2, d, max(lens) + 64, fmt, dtype=dtype, device=DEV, page_size=fmt.residual_block)
    cache.prefill(k, v, lens)
    for splits in (1, 3, 0):
        check_decode(q, cache, backend, num_splits=splits)


@pytest.mark.parametrize("cfg", CONFIGS[:4], ids=_ids)
def test_paged_equals_dense(cfg, backend):
    bits, mode, g, dtype, d, gq = cfg
    fmt = bd.KVFormat(bits=bits, k_mode=mode, group_size=g)
    nr = fmt.residual_block
    lens = [5 * nr + 3, 2 * nr, 17]
    dense, _, _ = make_cache(fmt, lens, 2, d, dtype, seed=3)
    paged, _, _ = make_cache(fmt, lens, 2, d, dtype, seed=3, page_size=2 * nr, shuffle=True)
    q = torch.randn(len(lens), 1, 2 * gq, d, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEV)
    a = bd.decode(q, dense, backend=backend, num_splits=2)
    b = bd.decode(q, paged, backend=backend, num_splits=2)
    assert torch.equal(a, b)


@pytest.mark.parametrize("cfg", CONFIGS[:4], ids=_ids)
def test_backends_agree(cfg):
    """Every backend the GPU runs agrees with the first (auto's order) within the format's tolerance."""
    runs = [b for b in dispatch.available(DEV) if b != "reference"]
    if len(runs) < 2:
        pytest.skip("one kernel backend on this GPU")
    bits, mode, g, dtype, d, gq = cfg
    fmt = bd.KVFormat(bits=bits, k_mode=mode, group_size=g)
    nr = fmt.residual_block
    cache, _, _ = make_cache(fmt, [9 * nr + 17, 2 * nr, 3], 2, d, dtype, seed=4)
    q = torch.randn(3, 1, 2 * gq, d, generator=torch.Generator().manual_seed(6)).to(dtype).to(DEV)
    outs = {b: bd.decode(q, cache, backend=b).float() for b in runs}
    ref = bd.decode(q, cache, backend="reference").float()
    tol = kernel_tolerance(q, cache, ref, factor=4.0)
    for b in runs[1:]:
        err = (outs[b] - outs[runs[0]]).abs().max().item()
        assert err <= tol, f"{b} vs {runs[0]}: {err:.3g} > {tol:.3g}"


def _valid_regions(cache):
    """The parts of the cache that hold data (sink tokens, packed blocks in use, the
    residual tokens)."""
    nr, sinks = cache.fmt.residual_block, cache.fmt.sink_tokens
    t = cache.tensors()
    out = []
    for b, n in enumerate(cache.lengths):
        s = min(n, sinks)
        if s:
            out += [t.sinks[0][b, :s], t.sinks[1][b, :s]]
        n -= s
        nb = n // nr
        for blk in range(nb):
            kp, kq, vp, vq = cache_module._block_slices(cache.tensors(), b, blk)
            out += [cache.k_pack[kp], cache.k_params[kq], cache.v_pack[vp], cache.v_params[vq]]
        out += [cache.k_res[b, :n % nr], cache.v_res[b, :n % nr]]
    return out


def _assert_same_cache(a, b):
    assert a.lengths == b.lengths
    assert torch.equal(a.seqlens, b.seqlens)
    for x, y in zip(_valid_regions(a), _valid_regions(b)):
        assert torch.equal(x, y)


@pytest.mark.parametrize("cfg", CONFIGS, ids=_ids)
def test_pack_kernel_bit_identical_on_grid(cfg):
    bits, mode, g, dtype, d, _ = cfg
    fmt = bd.KVFormat(bits=bits, k_mode=mode, group_size=g)
    nr = fmt.residual_block
    gen = torch.Generator().manual_seed(11)
    n = 4 * nr + 9  # four packed blocks on the grid, nine 16-bit residual tokens
    if mode == "channel":  # K groups run along the tokens
        k = torch.cat([on_grid(gen, (2, 4 * nr, 2, d), bits, g, 1, dtype=dtype, device=DEV),
                       torch.randn(2, 9, 2, d, generator=gen).to(dtype).to(DEV)], dim=1)
    else:
        k = on_grid(gen, (2, n, 2, d), bits, g, 3, dtype=dtype, device=DEV)
    v = on_grid(gen, (2, n, 2, d), bits, g, 3, dtype=dtype, device=DEV)
    caches = []
    for backend in ("sm80", "reference"):
        c = bd.KVCache.allocate(2, 2, d, n, fmt, dtype=dtype, device=DEV, backend=backend)
        c.prefill(k.contiguous(), v, [n, n - nr - 3])
        caches.append(c)
    _assert_same_cache(*caches)


@pytest.mark.parametrize("cfg", CONFIGS, ids=_ids)
def test_pack_kernel_matches_reference_on_llm_like_data(cfg):
    bits, mode, g, dtype, d, _ = cfg
    fmt = bd.KVFormat(bits=bits, k_mode=mode, group_size=g)
    nr = fmt.residual_block
    lens = [3 * nr + 7, nr, 5]
    a, _, _ = make_cache(fmt, lens, 2, d, dtype, backend="sm80", seed=5)
    b, _, _ = make_cache(fmt, lens, 2, d, dtype, backend="reference", seed=5)
    _assert_same_cache(a, b)


def _appended_in_steps(fmt, k, v, first):
    """A cache (sm80 writer) that got ``k``, ``v`` [B, N, Hkv, D] as a prefill of ``first``
    tokens, then appends of single tokens, a few, and more than a block (completed from
    the residual buffer), then single tokens to the end."""
    b, n, hkv, d = k.shape
    nr = fmt.residual_block
    steps = bd.KVCache.allocate(b, hkv, d, n, fmt, dtype=k.dtype, device=DEV, backend="sm80")
    steps.prefill(k[:, :first], v[:, :first])
    t = first
    for chunk in (1, 1, 3, nr - 2, 1, nr + 7):
        steps.append(k[:, t:t + chunk], v[:, t:t + chunk])
        t += chunk
    while t < n:
        steps.append(k[:, t:t + 1], v[:, t:t + 1])
        t += 1
    return steps


@pytest.mark.parametrize("cfg", CONFIGS[:3] + CONFIGS[5:6], ids=_ids)
def test_append_token_by_token_equals_prefill(cfg):
    bits, mode, g, dtype, d, _ = cfg
    fmt = bd.KVFormat(bits=bits, k_mode=mode, group_size=g)
    nr = fmt.residual_block
    n = 2 * nr + nr // 2 + 3
    gen = torch.Generator().manual_seed(9)
    k, v = kv(gen, 2, n, 2, d, dtype=dtype, device=DEV)
    full = bd.KVCache.allocate(2, 2, d, n, fmt, dtype=dtype, device=DEV, backend="sm80")
    full.prefill(k, v)
    _assert_same_cache(full, _appended_in_steps(fmt, k, v, 5))
    ref = bd.KVCache.allocate(2, 2, d, n, fmt, dtype=dtype, device=DEV, backend="reference")
    ref.prefill(k, v)
    _assert_same_cache(full, ref)


def _merged_slices(k, v, extra=64):
    """``k``, ``v`` ``[B, T, Hkv, D]`` as slices of one merged projection output ``[B, T,
    (2 Hkv + extra / D) D]`` (tokens and sequences further apart than ``Hkv D``), as
    ``bitdecode.hf.fuse_projections`` hands them to the cache."""
    b, t, h, d = k.shape
    buf = torch.full((b, t, 2 * h * d + extra), float("nan"), dtype=k.dtype, device=k.device)
    buf[..., :h * d] = k.reshape(b, t, h * d)
    buf[..., h * d:2 * h * d] = v.reshape(b, t, h * d)
    return buf[..., :h * d].view(b, t, h, d), buf[..., h * d:2 * h * d].view(b, t, h, d)


@pytest.mark.parametrize("fmt", [bd.KVFormat(bits=4), bd.KVFormat(bits=2, k_mode="token", group_size=64, sink_tokens=5)],
                         ids=["4c128", "2t64-s5"])
def test_strided_k_v_are_written_without_a_copy_and_equal_contiguous(fmt, backend, monkeypatch):
    """K and V that are slices of a merged projection's output (sequences and tokens
    further apart than Hkv x D, the nan-filled columns between them never read) are packed
    and appended in place, and give the same cache bytes as contiguous copies: prefill,
    single-token and three-token appends, across a block boundary."""
    from bitdecode.kernels_sm80 import backend as sm80_backend

    d, hkv, nr = 128, 2, fmt.residual_block
    gen = torch.Generator().manual_seed(21)
    n = nr + 9
    k, v = kv(gen, 3, n + nr + 4, hkv, d, dtype=torch.bfloat16, device=DEV)
    copies = []
    real = sm80_backend.token_rows
    monkeypatch.setattr(sm80_backend, "token_rows", lambda t: copies.append(real(t) is not t) or real(t))
    caches = []
    for strided in (False, True):
        c = bd.KVCache.allocate(3, hkv, d, 3 * nr, fmt, dtype=torch.bfloat16, device=DEV, backend=backend)
        split = lambda a, b: _merged_slices(a, b) if strided else (a.contiguous(), b.contiguous())  # noqa: E731
        c.prefill(*split(k[:, :n], v[:, :n]))
        for t0, t1 in [(n, n + 1), (n + 1, n + 4)] + [(i, i + 1) for i in range(n + 4, n + nr + 4)]:
            c.append(*split(k[:, t0:t1], v[:, t0:t1]))
        caches.append(c)
    assert copies and not any(copies), "a strided K / V was copied before the pack kernel"
    _assert_same_cache(*caches)
    ref = bd.KVCache.allocate(3, hkv, d, 3 * nr, fmt, dtype=torch.bfloat16, device=DEV, backend="reference")
    ref.prefill(k, v)
    _assert_same_cache(caches[1], ref)


# (format, dtype, head dim, q heads per kv head) of the formats beyond one width without
# sinks: sink tokens (fewer than a block and not a multiple of 16, a 16-token multiple,
# more than a block) and K 4-bit / V 2-bit (256-token tiles; with sinks; head dim 256)
SINK_CONFIGS = [
    (bd.KVFormat(bits=4, k_mode="channel", group_size=128, sink_tokens=16), torch.float16, 128, 4),
    (bd.KVFormat(bits=2, k_mode="token", group_size=64, sink_tokens=5), torch.bfloat16, 64, 8),
    (bd.KVFormat(bits=4, k_mode="channel", group_size=32, sink_tokens=200), torch.bfloat16, 128, 1),
    (bd.KVFormat(bits=4, v_bits=2, k_mode="channel", group_size=64), torch.float16, 128, 4),
    (bd.KVFormat(bits=4, v_bits=2, k_mode="token", group_size=32, sink_tokens=16), torch.bfloat16, 64, 8),
    (bd.KVFormat(bits=4, v_bits=2, k_mode="channel", group_size=128), torch.float16, 256, 2),
    (bd.KVFormat(bits=2, k_mode="channel", group_size=32, sink_tokens=16, hadamard=True), torch.bfloat16, 128, 4),
    # K2V4: two 128-token 4-bit V tiles per 256-token block
    (bd.KVFormat(bits=2, v_bits=4, k_mode="channel", group_size=128), torch.float16, 128, 4),
    (bd.KVFormat(bits=2, v_bits=4, k_mode="token", group_size=32, sink_tokens=16), torch.bfloat16, 64, 16),
]


def _sink_ids(c):
    fmt, dtype, d, gq = c
    return (f"k{fmt.bits}v{fmt.v_bits}-{fmt.k_mode}-g{fmt.group_size}-s{fmt.sink_tokens}{'-h' * fmt.hadamard}"
            f"-{str(dtype)[6:]}-d{d}-gq{gq}")


def _sink_lengths(fmt):
    s, nr = fmt.sink_tokens, fmt.residual_block
    return [0, 3, s, s + 1, s + nr, s + 3 * nr + 7, 2 * nr + 5]


@pytest.mark.parametrize("cfg", SINK_CONFIGS, ids=_sink_ids)
def test_sinks_and_k4v2_prefill_and_append_equal_the_reference(cfg):
    """The pack kernel keeps the first ``sink_tokens`` 16-bit and packs the rest from the
    token after them, and packs K and V at their own widths, bit for bit as the reference:
    in prefill (ragged lengths below, at and past the sink count) and in appends of one
    token and of several (crossing the sinks, completing blocks)."""
    fmt, dtype, d, _ = cfg
    lens = _sink_lengths(fmt)
    chunks = (1, 2, fmt.sink_tokens + 3, fmt.residual_block + 5, 1)
    kern, k, v = make_cache(fmt, lens, 2, d, dtype, backend="sm80", seed=13, room=sum(chunks))
    ref, _, _ = make_cache(fmt, lens, 2, d, dtype, backend="reference", seed=13, room=sum(chunks))
    _assert_same_cache(kern, ref)
    gen = torch.Generator().manual_seed(14)
    for chunk in chunks:
        kn, vn = kv(gen, len(lens), chunk, 2, d, dtype=dtype, device=DEV)
        kern.append(kn, vn)
        ref.append(kn, vn)
        _assert_same_cache(kern, ref)
    assert kern.lengths == [n + sum(chunks) for n in lens]


@pytest.mark.parametrize("cfg", SINK_CONFIGS, ids=_sink_ids)
def test_sinks_and_k4v2_decode_matches_reference(cfg, backend):
    """Decode attends to the 16-bit sink tokens (split 0) as well as the packed blocks and
    the residual, and dequantizes K and V at their own widths, on caches the reference
    packed and on caches the kernels packed."""
    fmt, dtype, d, gq = cfg
    lens = _sink_lengths(fmt)
    q = torch.randn(len(lens), 1, 2 * gq, d, generator=torch.Generator().manual_seed(15)).to(dtype).to(DEV)
    for writer in ("reference", "sm80"):
        cache, _, _ = make_cache(fmt, lens, 2, d, dtype, backend=writer, seed=16)
        for splits in (0, 1, 3):
            check_decode(q, cache, backend, num_splits=splits)


@pytest.mark.parametrize("sinks, fp4", [(0, None), (6, None), (6, "nvfp4")])
def test_cuda_graph_replay_equals_eager(backend, sinks, fp4):
    fmt = bd.KVFormat(bits=4, sink_tokens=sinks) if fp4 is None else bd.KVFormat(fp4=fp4, sink_tokens=sinks)
    nr = fmt.residual_block
    # with sinks, the replayed appends of the first sequence cross from the sink tokens
    # into the packed part, those of the second complete a block
    lens = [4 * nr - 2, nr + 1] if not sinks else [sinks - 2, sinks + 4 * nr - 3]
    d, hkv, gq = 128, 2, 4
    eager, _, _ = make_cache(fmt, lens, hkv, d, torch.float16, backend=backend, seed=21)
    graphed, _, _ = make_cache(fmt, lens, hkv, d, torch.float16, backend=backend, seed=21)
    gen = torch.Generator().manual_seed(2)
    steps = 5
    ks = torch.randn(steps, 2, 1, hkv, d, generator=gen).half().to(DEV)
    vs = torch.randn(steps, 2, 1, hkv, d, generator=gen).half().to(DEV)
    qs = torch.randn(steps, 2, 1, hkv * gq, d, generator=gen).half().to(DEV)
    k_in, v_in, q_in = ks[0].clone(), vs[0].clone(), qs[0].clone()
    # warm up (compile) outside the capture, then undo the warm-up append
    state = [graphed.k_pack, graphed.k_params, graphed.v_pack, graphed.v_params, graphed.k_res, graphed.v_res,
             graphed.seqlens] + list(graphed.tensors().sinks or ())
    snapshot = [t.clone() for t in state]
    lens_before = graphed.lengths
    graphed.append(k_in, v_in)
    graphed.decode(q_in, num_splits=3)
    for t, s in zip(state, snapshot):
        t.copy_(s)
    graphed._host_lens = lens_before
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed.append(k_in, v_in)
        out_g = graphed.decode(q_in, num_splits=3)
    graphed._host_lens = lens_before  # the capture did not run anything
    for i in range(steps):
        k_in.copy_(ks[i]), v_in.copy_(vs[i]), q_in.copy_(qs[i])
        graph.replay()
        eager.append(ks[i], vs[i])
        out_e = eager.decode(qs[i], num_splits=3)
        torch.cuda.synchronize()
        assert torch.equal(out_g, out_e), f"step {i}"
    assert torch.equal(graphed.seqlens, eager.seqlens)
    graphed._host_lens = eager.lengths
    _assert_same_cache(graphed, eager)


@pytest.mark.parametrize("fmt", [bd.KVFormat(fp4="nvfp4"), bd.KVFormat(bits=4, sink_tokens=16)], ids=["nvfp4", "4b-sinks"])
def test_first_use_check_passes_in_its_child_process(backend, fmt):
    """``auto``'s first-use check (``bitdecode.selfcheck``, what it runs before taking an
    unvalidated backend such as sm100) as ``auto`` runs it: a child process on this GPU,
    its JSON verdict read back."""
    command = selfcheck.child_command(backend, torch.cuda.current_device(), fmt, 128, torch.float16)
    assert selfcheck.run_child(command, timeout=600) == (True, "matches the reference")


def test_first_use_check_catches_a_wrong_kernel(monkeypatch):
    """The same check in this process with the sm80 decode's output nudged past the tolerance
    rule: it must say so (a check that cannot fail would let a broken kernel through)."""
    real = bd.decode

    def nudged(q, cache, *args, **kwargs):
        got = real(q, cache, *args, **kwargs)
        if kwargs.get("backend") != "sm80":
            return got
        out, lse = got
        return out + 0.1, lse

    monkeypatch.setattr(bd, "decode", nudged)
    why = cli_selfcheck.run_check("sm80", DEV, bd.KVFormat(bits=4), 128, torch.float16)
    assert why.startswith("num_splits=0: max error"), why


def test_plans_hold_their_cache_tensors_as_tvm_ffi_tensors(backend):
    """The kernels come out of the JIT cache as raw TVM-FFI functions, so a decode plan's
    cache tensors and split workspace are converted once (``jit.bound_arguments``), not on
    every launch; the results stay the reference's."""
    import tvm_ffi

    fmt = bd.KVFormat(bits=4)
    cache, _, _ = make_cache(fmt, [700, 300], 2, 128, torch.float16, backend=backend)
    q = torch.randn(2, 1, 8, 128, device=DEV).half()
    cache.decode(q, num_splits=3)
    plan = cache._fast[1]
    assert all(isinstance(t, tvm_ffi.Tensor) for t in plan.static)
    assert all(isinstance(t, tvm_ffi.Tensor) for ws in plan.workspaces.values() for t in ws)
    check_decode(q, cache, backend, num_splits=3)


@pytest.mark.parametrize("bits, dtype", [(4, torch.float16), (2, torch.float16), (4, torch.bfloat16)])
@pytest.mark.parametrize("lens, hkv, splits", [([9000], 8, 0), ([500], 8, 0), ([700, 300], 2, 3), ([2000], 8, 1),
                                               ([900, 1200, 64, 3000], 8, 0), ([1500, 300] * 8, 8, 0),
                                               ([1500, 300] * 8, 8, 2)])
def test_sm90_grid_variants_match_reference(lens, hkv, splits, bits, dtype):
    """A 4-bit (fp16 or bf16) / 2-bit (fp16) cache on sm90 (GQA 4) takes the one-CTA kernel
    (two consumer warpgroups; 4-bit without K's scale in Q) while batch x Hkv x
    SMALL_GRID_SPLITS fits in the SMs and the default kernel above (2-bit: one consumer, two
    CTAs an SM; at B=16 with short sequences, 4-bit and 2-bit, the one-CTA kernel's one
    split, or two splits of the default); both, split (auto or forced) and direct, against
    the reference."""
    if not dispatch.runnable("sm90", DEV):
        pytest.skip(f"the sm90 kernels do not run on {torch.cuda.get_device_name()}")
    from bitdecode.kernels_sm90 import backend as sm90

    fmt = bd.KVFormat(bits, "channel", 128)
    cache, _, _ = make_cache(fmt, lens, hkv, 128, dtype, backend="sm90")
    q = torch.randn(len(lens), 1, 4 * hkv, 128, generator=torch.Generator().manual_seed(len(lens) + splits))
    q = q.to(dtype).to(DEV)
    small = sm90.small_pairs(len(lens) * hkv, torch.cuda.get_device_properties(DEV).multi_processor_count)
    assert sm90.BACKEND.grid_variant(fmt, dtype, 128, sm90.HALF_TILE, len(lens), hkv, 1, DEV) == \
        ("small" if small else "")
    check_decode(q, cache, "sm90", num_splits=splits)


def test_auto_runs_short_small_grids_on_sm80_and_long_ones_on_sm90():
    """On Hopper an ``auto`` cache of 2-bit K per channel g128 (sm90's) decodes a B=1 GQA 4
    sequence of 1000 tokens on sm80 (``SM80_SHORT``), its appending decode too, and the
    same sequence grown past 8K tokens on sm90: the plans each call built name the backend,
    and each output equals that backend's named call bit for bit."""
    if not dispatch.runnable("sm90", DEV):
        pytest.skip(f"the sm90 kernels do not run on {torch.cuda.get_device_name()}")
    fmt = bd.KVFormat(bits=2)
    cache, _, _ = make_cache(fmt, [1000], 8, 128, torch.float16, backend="auto", room=8000)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 1, 32, 128, generator=gen).half().to(DEV)
    assert cache.backend == "sm90" and cache.backend_for(q) == "sm80"
    out = bd.decode(q, cache)
    assert {key[2] for key in cache._plans} == {"sm80"}
    assert torch.equal(out, bd.decode(q, cache, backend="sm80"))
    k, v = kv(gen, 1, 7300, 8, 128, dtype=torch.float16, device=DEV)
    twin = cache.select([0])  # (the same bytes, for the appending decode named sm80)
    got = bd.decode(q, cache, k_new=k[:, :1], v_new=v[:, :1])
    assert [key for key in cache._plans if key[-1] == "append"] and {key[2] for key in cache._plans} == {"sm80"}
    assert torch.equal(got, bd.decode(q, twin, k_new=k[:, :1], v_new=v[:, :1], backend="sm80"))
    cache.append(k[:, 1:], v[:, 1:])  # 8300 tokens: past 2-bit's 8K
    assert cache.backend_for(q) == "sm90"
    out = bd.decode(q, cache)
    assert "sm90" in {key[2] for key in cache._plans}
    assert torch.equal(out, bd.decode(q, cache, backend="sm90"))
    check_decode(q, cache, "sm90")


@pytest.mark.parametrize("bits", [4, 2])
def test_sm90_pairs_past_one_wave_split_match_reference(bits):
    """More (sequence, KV head) pairs than the default kernel's CTA slots, by up to 1.75x
    (B=40 at Hkv=8 on the H200's 132 SMs): the heuristic splits each pair (``wave_splits``),
    ragged lengths down to an empty sequence, against the reference."""
    if not dispatch.runnable("sm90", DEV):
        pytest.skip(f"the sm90 kernels do not run on {torch.cuda.get_device_name()}")
    fmt = bd.KVFormat(bits, "channel", 128)
    lens = [2048, 777, 0, 1500, 64] * 8
    cache, _, _ = make_cache(fmt, lens, 8, 128, torch.float16, backend="sm90")
    q = torch.randn(len(lens), 1, 32, 128, generator=torch.Generator().manual_seed(bits)).half().to(DEV)
    check_decode(q, cache, "sm90", num_splits=0)
    splits, = [key[3] for key in cache._plans]
    if torch.cuda.get_device_properties(DEV).multi_processor_count == 132:  # 264 slots for 320 pairs
        assert splits in (2, 4)


def test_sm90_half_full_band_splits_match_reference():
    """Pairs between half the default kernel's CTA slots and all of them (B=17 at Hkv=8:
    136 pairs on the H200's 264 slots), where one split would leave slots idle: the
    heuristic's even count over several waves (``half_full_splits``: 5 splits at 8K tokens
    there), ragged lengths with an empty and a one-tile sequence, against the reference."""
    if not dispatch.runnable("sm90", DEV):
        pytest.skip(f"the sm90 kernels do not run on {torch.cuda.get_device_name()}")
    fmt = bd.KVFormat(4, "channel", 128)
    lens = [8192, 8000, 0, 4097, 8191, 129, 6000, 7777] * 2 + [8192]
    cache, _, _ = make_cache(fmt, lens, 8, 128, torch.float16, backend="sm90")
    q = torch.randn(len(lens), 1, 32, 128, generator=torch.Generator().manual_seed(17)).half().to(DEV)
    check_decode(q, cache, "sm90", num_splits=0)
    splits, = [key[3] for key in cache._plans]
    if torch.cuda.get_device_properties(DEV).multi_processor_count == 132:
        assert splits >= 3, splits  # (one split, with or without a tail, is 1 or 2)


@pytest.mark.parametrize("bits, dtype, hkv, keywords", [
    (2, torch.float16, 8, {"v_slots": 1}),  # one consumer, two CTAs an SM (2-bit's default grid)
    (2, torch.float16, 8, {"v_slots": 2, "ctas_per_sm": 1}),
    (2, torch.float16, 8, {"v_slots": 3, "consumers": 2}),  # the fewest slots two consumers may take
    (2, torch.float16, 8, {"v_slots": 2, "step": 64, "num_stages": 3}),  # 16 KB slots of 64-token steps
    (2, torch.bfloat16, 8, {"v_slots": 1}),
    (4, torch.float16, 8, {"v_slots": 2}),
])
def test_sm90_v_through_shared_memory_matches_reference(bits, dtype, hkv, keywords, monkeypatch):
    """The SS form of the P V product (``DecodeSm90(v_slots=...)``: the producer warpgroup
    dequantizes V^T into shared memory with stmatrix, the wgmma reads it there) in the
    default grid's kernel, built into a fresh JIT cache: ragged lengths with residuals, one
    split (a CTA's slots wrap many times) and several, paged and shuffled, against the
    reference."""
    with sm90_default_kernel_with(monkeypatch, keywords, "v_slots") as built:
        check_ragged(bd.KVFormat(bits, "channel", 128), dtype, hkv, seed=bits)
        assert keywords["v_slots"] in built, built  # the default grid's kernel ran with the slots


def check_ragged(fmt, dtype, hkv, seed, backend="sm90"):
    """``backend``'s decode (sm90's unless said) against the reference over ragged lengths
    with residuals (an empty sequence among them), contiguous and paged with the pages
    shuffled, at 1 / 3 / automatic splits; GQA 4, head dim 128."""
    lens = [9000, 700, 3000, 64, 4097, 0, 1500, 2049]
    for page_size, shuffle in ((None, False), (256, True)):
        cache, _, _ = make_cache(fmt, lens, hkv, 128, dtype, page_size=page_size, shuffle=shuffle, backend=backend)
        q = torch.randn(len(lens), 1, 4 * hkv, 128, generator=torch.Generator().manual_seed(seed))
        q = q.to(dtype).to(DEV)
        for splits in (1, 3, 0):
            check_decode(q, cache, backend, num_splits=splits)


@contextlib.contextmanager
def sm90_default_kernel_with(monkeypatch, keywords, attribute, every_variant=False):
    """The sm90 default grid's decode kernel built with ``keywords`` added to its
    ``DecodeSm90`` keywords (the "small" grid's as shipped, unless ``every_variant``), into
    a fresh JIT cache with the disk cache off; yields the list every ``DecodeSm90`` built
    inside appends its ``attribute`` to, so a test can check that the kernel it meant ran.
    Skips the test where the sm90 kernels do not run."""
    if not dispatch.runnable("sm90", DEV):
        pytest.skip(f"the sm90 kernels do not run on {torch.cuda.get_device_name()}")
    from bitdecode.kernels_sm90 import backend as sm90
    from bitdecode.kernels_sm90 import decode as d90

    grid_keywords = sm90.grid_keywords

    def with_keywords(fmt, fp16, head_dim, nh, variant):
        found = grid_keywords(fmt, fp16, head_dim, nh, variant)
        return {**found, **keywords} if variant == "" or every_variant else found

    monkeypatch.setattr(sm90, "grid_keywords", with_keywords)
    built = built_with(monkeypatch, d90.DecodeSm90, {}, lambda kernel: getattr(kernel, attribute))
    fresh_jit(monkeypatch)
    sm90._kernel_ctas_per_sm.cache_clear()
    try:
        yield built
    finally:
        sm90._kernel_ctas_per_sm.cache_clear()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [bd.KVFormat(2, "channel", 128), bd.KVFormat(2, "channel", 128, sink_tokens=5),
                                 bd.KVFormat(4, "channel", 128, v_bits=2)])
def test_sm90_v_subnormal_matches_reference(fmt, monkeypatch):
    """``DecodeSm90(v_subnormal=True)`` (fp16 2-bit V, ``V_SUBNORMAL_AUTO``): V^T's codes as fp16
    subnormals (the lop3 alone), 1 / mult in P^T, packed products folded times 2^24, the
    residual's and the sinks' unscaled, in the default grid's kernel: ragged lengths with
    residuals, paged and shuffled, 1 / 3 / automatic splits, against the reference (fp16,
    GQA 4)."""
    with sm90_default_kernel_with(monkeypatch, {"v_subnormal": True}, "v_subnormal") as built:
        check_ragged(fmt, torch.float16, 8, seed=2)
        assert True in built, built


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, dtype", [(bd.KVFormat(4, "channel", 128), torch.float16),
                                        (bd.KVFormat(2, "channel", 128), torch.float16),
                                        (bd.KVFormat(2, "channel", 128), torch.bfloat16),
                                        (bd.KVFormat(4, "channel", 128, v_bits=2, sink_tokens=5), torch.float16)])
@pytest.mark.parametrize("keywords", [{"early_tiles": True}, {"early_loads": True},
                                      {"early_loads": True, "early_tiles": True, "early_residual": True},
                                      {"wide_boxes": False}],
                         ids=["tiles", "loads", "all", "narrow"])
def test_sm90_early_issue_match_reference(fmt, dtype, keywords, monkeypatch):
    """``DecodeSm90(early_tiles=True)``: with K's scale in Q the producer issues its first
    ``lag`` tiles before the barrier that publishes Q; ``early_loads=True``: Q's copy and the
    sequence's first block-table entry are issued beside the sequence length's load, and the
    tile loop reads the table only past the first page; ``early_residual=True`` (where it
    fits: the small grids' kernels): the residual block's first sub-tile copied into a
    buffer of its own at the start; ``wide_boxes=False``: the packed tiles' TMA boxes as
    narrow as their rows (the default folds them into 128-byte ones).  On every grid's kernel
    (the default and the small grid's, splits with fewer tiles than ``lag`` among them):
    ragged lengths with residuals
    of one to four sub-tiles, paged and shuffled (tiles on the first page and past it), 1 / 3
    / automatic splits, against the reference."""
    attribute = next(iter(keywords))
    with sm90_default_kernel_with(monkeypatch, keywords, attribute, every_variant=True) as built:
        check_ragged(fmt, dtype, 8, seed=3)
        for lens in ([4096], [4296], [3077, 190]):  # B <= 2: the small grid (2-bit residuals: 0, 200, 5, 190)
            q = torch.randn(len(lens), 1, 32, 128, generator=torch.Generator().manual_seed(4)).to(dtype).to(DEV)
            cache, _, _ = make_cache(fmt, lens, 8, 128, dtype, backend="sm90")
            for splits in (3, 0):
                check_decode(q, cache, "sm90", num_splits=splits)
        if fmt.v_bits == 2 and dtype == torch.float16:  # the appending kernels (one launch a step) too
            check_appending_steps("sm90", fmt, 4, [700, 1530], None, dtype)
        assert built and all(value == keywords[attribute] for value in built), built


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, dtype", [(bd.KVFormat(4, "channel", 128), torch.float16),
                                        (bd.KVFormat(2, "channel", 128), torch.bfloat16),
                                        (bd.KVFormat(4, "channel", 128, v_bits=2, sink_tokens=5), torch.float16)])
def test_sm90_merge_splits_equals_the_combine(fmt, dtype, monkeypatch):
    """``DecodeSm90(merge_splits=True)`` (integer 4-bit's default: ``merges_in_kernel``)
    against ``merge_splits=False``: the split decode's last CTA of each (sequence, KV
    head) merges the partials itself (``call_merged``, ``HeadMerge``) and no combine kernel
    runs; its outputs and LSEs are the combine path's to fp32 rounding (the same partials
    summed in another order: one unit in the last place of the output's dtype at most, an
    empty row's 0 and -inf exactly) and the same bits call after call, on every grid's
    kernel: ragged lengths with residuals and an empty sequence, paged and shuffled, 3 /
    automatic splits, each call twice (the arrival counters reset), and a CUDA-graph
    replay of a merging decode."""
    cases = [([9000, 700, 3000, 64, 4097, 0, 1500, 2049], None, False),
             ([9000, 700, 3000, 64, 4097, 0, 1500, 2049], 256, True), ([4096], None, False), ([3077, 190], None, False)]

    def calls():
        for i, (lens, page, shuffle) in enumerate(cases):
            cache, _, _ = make_cache(fmt, lens, 2, 128, dtype, page_size=page, shuffle=shuffle, backend="sm90")
            q = torch.randn(len(lens), 1, 8, 128, generator=torch.Generator().manual_seed(i)).to(dtype).to(DEV)
            for splits in (3, 0):
                yield (i, splits), cache, q

    with sm90_default_kernel_with(monkeypatch, {"merge_splits": False}, "merges", every_variant=True) as built:
        want = {key: bd.decode(q, cache, num_splits=key[1], return_lse=True) for key, cache, q in calls()}
        assert built and not any(built), built  # (the combine kernel's results, whatever the default)
    ulp = torch.finfo(dtype).eps
    merged = {}
    with sm90_default_kernel_with(monkeypatch, {"merge_splits": True}, "merges", every_variant=True) as built:
        for key, cache, q in calls():
            for _ in range(2):
                out, lse = bd.decode(q, cache, num_splits=key[1], return_lse=True)
                torch.testing.assert_close(out, want[key][0], rtol=ulp, atol=ulp * 2 ** -4, msg=lambda m: f"{key}: {m}")
                torch.testing.assert_close(lse, want[key][1], rtol=1e-6, atol=1e-5, msg=lambda m: f"{key}: {m}")
                assert torch.equal(torch.isinf(lse), torch.isinf(want[key][1])), key
                assert key not in merged or (torch.equal(out, merged[key][0]) and torch.equal(lse, merged[key][1]))
                merged[key] = out, lse
            if key[1] == 3:
                assert any(getattr(plan, "merged", False) for plan in cache._plans.values()), key
            check_decode(q, cache, "sm90", num_splits=key[1])
        assert True in built, built
        (key, cache, q), = [c for c in calls() if c[0] == (0, 3)]
        q_in = q.clone()
        bd.decode(q_in, cache, num_splits=3)  # (compiled and planned outside the capture)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out_g = bd.decode(q_in, cache, num_splits=3)
        for _ in range(2):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out_g, merged[key][0])


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, head_dim", [(bd.KVFormat(4, "channel", 64), 64), (bd.KVFormat(2, "token", 32), 64),
                                           (bd.KVFormat(4, "channel", 128), 256),
                                           (bd.KVFormat(4, "token", 64, v_bits=2), 256)])
def test_sm90_wide_boxes_head_dims(fmt, head_dim, monkeypatch):
    """``DecodeSm90(wide_boxes=True)`` where the fold differs from head dim 128's two rows:
    head dim 64 (4-bit K rows of 32 bytes, four to a box row; 2-bit's 16, eight), 256 (4-bit
    K rows of 128 bytes, not folded, beside V's folded 64-byte rows), on every grid's
    kernel: ragged lengths with residuals, paged and shuffled, 1 / 3 / automatic splits."""
    with sm90_default_kernel_with(monkeypatch, {"wide_boxes": True}, "wide_boxes", every_variant=True) as built:
        lens = [5000, 700, 64, 4097, 1]
        for page_size, shuffle in ((None, False), (256, True)):
            cache, _, _ = make_cache(fmt, lens, 2, head_dim, torch.float16, page_size=page_size, shuffle=shuffle,
                                     backend="sm90")
            q = torch.randn(len(lens), 1, 8, head_dim, generator=torch.Generator().manual_seed(head_dim))
            for splits in (1, 3, 0):
                check_decode(q.half().to(DEV), cache, "sm90", num_splits=splits)
        for lens in ([4096], [3077, 190]):  # the small grid
            cache, _, _ = make_cache(fmt, lens, 2, head_dim, torch.float16, backend="sm90")
            q = torch.randn(len(lens), 1, 8, head_dim, generator=torch.Generator().manual_seed(5)).half().to(DEV)
            check_decode(q, cache, "sm90", num_splits=0)
        assert built and all(built), built


@pytest.mark.gpu
@pytest.mark.parametrize("tile_bytes, stages, copies, warps, apart",
                         [(16384, 4, 1, 4, False), (8192, 6, 4, 2, False), (4096, 2, 2, 1, False),
                          (32768, 3, 16, 8, False), (16384, 4, 4, 4, True), (4096, 2, 2, 1, True)])
def test_ring_probe_reads_every_byte(tile_bytes, stages, copies, warps, apart):
    """``RingProbeSm90`` (profiles/bench_ring.py's kernel) over runs of tiles that wrap the
    ring many times, an odd count of CTAs and tiles, a tile's copies from one run or from
    their own regions (``apart``): each consumer thread's sum (mod 2^32) equals its words'
    sum in torch, so the ring hands every tile over once, whole, in its stage, and no time
    the benchmark reports comes from wrong bytes."""
    from bitdecode import jit
    from bitdecode.kernels_sm90.ring_probe import RingProbeSm90

    if jit.target_arch() != "sm_90a":
        pytest.skip("cp.async.bulk on mbarriers: Hopper only")
    probe = RingProbeSm90(tile_bytes, stages, copies, warps, apart)
    fn = RingProbeSm90.compile("sm_90a", tile_bytes, stages, copies, warps, apart=apart)
    threads, ctas, tiles = 32 * warps, 7, 4 * stages + 3
    gen = torch.Generator(device=DEV).manual_seed(tile_bytes + stages)
    src = torch.randint(-(2**31), 2**31 - 1, (ctas, tiles, tile_bytes // 4), dtype=torch.int32, device=DEV,
                        generator=gen)
    out = torch.full((ctas, threads), 12345, dtype=torch.int32, device=DEV)
    fn(src, out)
    # (``expected_sums`` is checked against loops on the CPU: test_ring_probe_sums_and_fit)
    assert torch.equal(out.to(torch.int64) & 0xFFFFFFFF, probe.expected_sums(src))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, dtype", [(bd.KVFormat(4, "channel", 128), torch.float16),
                                        (bd.KVFormat(2, "token", 64), torch.bfloat16),
                                        (bd.KVFormat(4, fp4="nvfp4", sink_tokens=5), torch.float16)])
def test_sm80_early_loads_match_reference(fmt, dtype, monkeypatch):
    """``DecodeSm80(early_loads=True)``: the sequence's first block-table entry and Q's copy
    issued beside the length's load, tiles on the first page reading no table: ragged
    lengths with residuals, paged and shuffled (tiles on the first page and past it), 1 / 3
    / automatic splits, against the reference; and the appending kernels bit-equal to
    append + decode."""
    from bitdecode.kernels_sm80 import decode as d80

    built = built_with(monkeypatch, d80.DecodeSm80, {"early_loads": True}, lambda kernel: kernel.early_loads)
    fresh_jit(monkeypatch)
    check_ragged(fmt, dtype, 8, seed=6, backend="sm80")
    if not fmt.fp4:  # (FP4 caches take the two calls: their K is written reordered)
        check_appending_steps("sm80", fmt, 4, [700, 1530], None, dtype)
    assert built and all(built), built


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, splits", [(128, 3), (128, 21), (128, 130), (64, 40), (256, 9)])
def test_combine_hoist_loads_is_bit_equal(head_dim, splits, backend, monkeypatch):
    """``CombineSm80(hoist_loads=True)``, the default (the first partial vectors loaded
    before the LSEs, the LSEs held in registers): outputs and LSEs bit-equal to the late
    form's, at split counts below, at and past one CTA's threads (two LSEs a thread) and
    past the prefetched splits, ragged lengths with an empty sequence among them."""
    from bitdecode.kernels_sm80 import combine

    fmt = bd.KVFormat(4, "channel", 64)
    q = torch.randn(3, 1, 8, head_dim, generator=torch.Generator().manual_seed(8)).half().to(DEV)

    def run():  # (a fresh cache each time: the same bytes)
        cache, _, _ = make_cache(fmt, [splits * 128 + 77, 0, 300], 2, head_dim, torch.float16, backend=backend)
        return bd.decode(q, cache, num_splits=splits, return_lse=True)

    # (sm90's integer 4-bit kernels merge their splits themselves, ``merges_in_kernel``:
    # built without it here, so that the combine kernel runs)
    with (sm90_default_kernel_with(monkeypatch, {"merge_splits": False}, "merges", every_variant=True)
          if backend == "sm90" else contextlib.nullcontext()):
        with monkeypatch.context() as m:
            late_built = built_with(m, combine.CombineSm80, {"hoist_loads": False},
                                    lambda kernel: kernel.merger.ahead)
            fresh_jit(m)
            late = run()
        built = built_with(monkeypatch, combine.CombineSm80, {}, lambda kernel: kernel.merger.ahead)
        fresh_jit(monkeypatch)  # (the late combine is not in this cache)
        hoist = run()
    assert late_built and not any(late_built), late_built
    assert built and all(built), built
    for a, b in zip(late, hoist):
        assert torch.equal(a, b)


def flat_v_cache(backend, batch=8, hkv=8, n=16384, needle=12.0):
    """A 2c128 fp16 cache whose V tokens are flat (every channel 3 + 1e-3 noise: a tiny scale
    under a large zero) and whose K has three needle tokens per KV head scoring ~``needle``
    for every query head (GQA 4), so the other tokens' P sits near e^-needle: their P^T
    (P times a ~1e-3 scale) underflows fp16, and only their zero keeps them in O.
    Returns (q, cache)."""
    gen = torch.Generator().manual_seed(5)
    d, gq = 128, 4
    k = torch.randn(batch, n, hkv, d, generator=gen)
    v = 3.0 + 1e-3 * torch.randn(batch, n, hkv, d, generator=gen)
    q = torch.randn(batch, 1, hkv * gq, d, generator=gen)
    for b in range(batch):
        for h in range(hkv):
            qh = q[b, 0, h * gq:(h + 1) * gq]
            sign = torch.where(qh.sum(0) >= 0, 1.0, -1.0)
            c = needle / float((qh @ sign).mean() * d ** -0.5)
            for t in (3, n // 2 + 77, n - 300):
                k[b, t, h] = c * sign
    cache = bd.KVCache.allocate(batch, hkv, d, n, bd.KVFormat(2, "channel", 128), dtype=torch.float16, device=DEV,
                                backend=backend)
    cache.prefill(k.half().to(DEV), v.half().to(DEV))
    return q.half().to(DEV), cache


def test_flat_v_tokens_under_a_peaked_softmax(backend):
    """V tokens of a tiny scale and a large zero, attended weakly beside a few needles
    (``flat_v_cache``): every kernel keeps their zero in O (a fold of V's scale into P that
    dropped a token whose scaled P underflowed would miss by ~5 %)."""
    q, cache = flat_v_cache(backend)
    for splits in (1, 0):
        check_decode(q, cache, backend, num_splits=splits)


@pytest.mark.gpu
@pytest.mark.parametrize("room", [0, 2])
def test_sm90_v_subnormal_flat_v_tokens(room, monkeypatch):
    """``v_subnormal`` (``v_sub_room`` 0 and 2) on flat V tokens under a peaked softmax
    (``flat_v_cache``): the zero sums keep the zero of a token whose P^T underflowed (the
    form that put P^T's value in the zero sums lost it)."""
    with sm90_default_kernel_with(monkeypatch, {"v_subnormal": True, "v_sub_room": room}, "v_subnormal") as built:
        q, cache = flat_v_cache("sm90")
        for splits in (1, 3, 0):
            check_decode(q, cache, "sm90", num_splits=splits)
        assert True in built, built


@pytest.mark.parametrize("weight", [8, 17, 336, 4096])
@pytest.mark.parametrize("bits", [4, 2])
def test_weighted_tail_splits_match_reference(backend, bits, weight, monkeypatch):
    """Splits with a weighted tail (``split_tiles``, in sixteenths: 8 counts as even; the
    tails started last, ``split_coords``) whatever weight the backend's plan
    takes: ragged lengths (tails past the last tile, splits that own nothing, the residual
    in the tail or not), paged, against the reference; an unsplit call ignores it."""
    from bitdecode import backend as backends

    kernels = backends.get(backend)
    monkeypatch.setattr(type(kernels), "tail_weight", lambda self, *args: weight)
    fmt = bd.KVFormat(bits, "channel", 128)
    lens = [1, 130, 777, 2048, 3001, 0, 5000, 129]
    cache, _, _ = make_cache(fmt, lens, 2, 128, torch.float16, page_size=256, backend=backend, shuffle=True)
    q = torch.randn(len(lens), 1, 8, 128, generator=torch.Generator().manual_seed(weight)).half().to(DEV)
    for splits in (1, 2, 3, 5):
        check_decode(q, cache, backend, num_splits=splits)
        plan, = [p for key, p in cache._plans.items() if key[3] == splits]
        assert plan.tail_weight == (weight if splits > 1 else 16)


@pytest.mark.parametrize("bits, gq, sinks", [(4, 1, 0), (4, 3, 0), (4, 5, 0), (2, 3, 0), (4, 2, 4), (2, 4, 4)])
def test_sm90_head_tiles_match_reference(bits, gq, sinks):
    """GQA groups of 1-4 heads take the 4-head tile (``half_cols``: quad lanes 2 and 3 run the
    softmax on their partner's second rows), 5 the 8-head tile: ragged lengths with residual
    tokens, the lazy maximum's exchange (scores that jump), sink tokens, one and two consumer
    warpgroups (4-bit / 2-bit), split and direct, against the reference."""
    if not dispatch.runnable("sm90", DEV):
        pytest.skip(f"the sm90 kernels do not run on {torch.cuda.get_device_name()}")
    from bitdecode.kernels_sm90 import backend as sm90

    assert sm90.BACKEND.heads_tile(gq, 1) == (sm90.HALF_TILE if gq <= 4 else 8)
    fmt = bd.KVFormat(bits, "channel", 128, sink_tokens=sinks)
    lens, hkv = [3000, 700, 4100], 2
    cache, _, _ = make_cache(fmt, lens, hkv, 128, torch.float16, backend="sm90", seed=gq)
    gen = torch.Generator().manual_seed(40 + gq)
    q = torch.randn(len(lens), 1, hkv * gq, 128, generator=gen)
    q[1, 0, gq - 1] *= 6  # one head whose scores jump past the running maximum (the exchange path)
    q = q.half().to(DEV)
    for splits in (1, 3):
        check_decode(q, cache, "sm90", num_splits=splits)


def fold_case(big: bool = False):
    """A bf16 4-bit K-per-channel cache with outlier channels and per-channel offsets (where
    rounding K to bf16 per element costs most), GQA 4, ragged lengths, its query and softmax
    scale; deterministic, so a subprocess builds the same one.  24 (sequence, KV head) pairs:
    the default kernel's grid (the small grid's kernel leaves K's scale out of Q).  ``big``:
    outliers whose |q s| passes fp16's range (``DecodeSm90.k_shift``), the softmax scale
    shrunk to keep the logits O(1)."""
    gen = torch.Generator().manual_seed(24)
    lens, hkv, n = [3000, 700, 4100], 8, 4100
    k = torch.randn(len(lens), n, hkv, 128, generator=gen)
    k[..., :8] *= 20000 if big else 8
    k += 2 * torch.randn(1, 1, hkv, 128, generator=gen)
    v = torch.randn(len(lens), n, hkv, 128, generator=gen)
    q = torch.randn(len(lens), 1, 4 * hkv, 128, generator=gen) * (20 if big else 1)
    # big: logits with a standard deviation of about 2 (sequence 0's first KV head)
    scale = 2.0 / float((q[0, 0, :4] @ k[0, :512, 0].T).std()) if big else 128 ** -0.5
    q = q.bfloat16().to(DEV)
    cache = bd.KVCache.allocate(len(lens), hkv, 128, n + 64, bd.KVFormat(4, "channel", 128), dtype=torch.bfloat16,
                                device=DEV, backend="sm90")
    cache.prefill(k.bfloat16().to(DEV), v.bfloat16().to(DEV), lens)
    return cache, q, scale


FOLD_SCRIPT = """
import functools, sys
import torch
import bitdecode as bd
from bitdecode.kernels_sm90 import decode as d90
d90.DecodeSm90.__init__ = functools.partialmethod(d90.DecodeSm90.__init__, fold_k_bf16=sys.argv[1] == "fold")
sys.path.insert(0, sys.argv[3])
from test_kernels_gpu import fold_case
cache, q, scale = fold_case(sys.argv[4] == "big")
torch.save(torch.stack([bd.decode(q, cache, softmax_scale=scale, backend="sm90", num_splits=s).float().cpu()
                        for s in (1, 3)]), sys.argv[2])
"""


@pytest.mark.parametrize("big", [False, True])
def test_sm90_fold_k_bf16_is_closer_to_exact(tmp_path, monkeypatch, big):
    """``DecodeSm90(fold_k_bf16=True)`` (the default): K's scale in Q for bf16 caches, the scores'
    wgmma on fp16 operands.  Against exact arithmetic on the stored codes (the reference with
    K and V dequantized without rounding), its outputs are finite and at least as close as
    the bf16 kernel without it (K rounded to bf16 per element; a CPU model of the scores put
    the fold 8-14x closer, profiles/NOTES.md), also where |q s| passes fp16's range (``big``:
    the rows' power-of-two shift).  Each kernel runs in its own process without the disk
    cache: the keyword is not part of a compiled kernel's key."""
    if not dispatch.runnable("sm90", DEV):
        pytest.skip(f"the sm90 kernels do not run on {torch.cuda.get_device_name()}")
    from bitdecode import reference

    script = tmp_path / "fold.py"
    script.write_text(FOLD_SCRIPT)
    env = {**os.environ, "BITDECODE_NO_DISK_CACHE": "1"}
    outs = {}
    for name in ("plain", "fold"):
        path = tmp_path / f"{name}.pt"
        res = subprocess.run([sys.executable, str(script), name, str(path), os.path.dirname(__file__),
                              "big" if big else "plain"],
                             capture_output=True, text=True, env=env, timeout=600)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        outs[name] = torch.load(path)
    cache, q, scale = fold_case(big)
    exact = reference.dequantize

    def unrounded(codes, scale, zero, group_size, dim=-1, out_dtype=None):
        return exact(codes, scale.double(), zero.double(), group_size, dim)

    monkeypatch.setattr(reference, "dequantize", unrounded)
    c = cache.tensors()
    truth = reference.decode(q.float(), c.k_pack, c.k_params, c.v_pack, c.v_params, c.k_res, c.v_res,
                             c.cache_seqlens, c.fmt, c.block_table, softmax_scale=scale).float().cpu()
    err = {name: (o - truth).abs().max().item() for name, o in outs.items()}
    assert torch.isfinite(outs["fold"]).all()
    assert not torch.equal(outs["fold"], outs["plain"]), "the keyword did not reach the kernel"
    assert err["fold"] <= err["plain"], err


@pytest.mark.parametrize("tool_name", ["memcheck", "racecheck"])
def test_compute_sanitizer_clean(tmp_path, backend, tool_name):
    tool = shutil.which("compute-sanitizer")
    if tool is None:
        pytest.skip("compute-sanitizer not on PATH")
    script = tmp_path / "small.py"
    script.write_text(
        "import torch, bitdecode as bd\n"
        "fmt = bd.KVFormat(bits=2, k_mode='token', group_size=64)\n"
        f"c = bd.KVCache.allocate(2, 2, 128, 700, fmt, device='cuda', page_size=256, backend='{backend}')\n"
        "k = torch.randn(2, 600, 2, 128, device='cuda').half(); v = torch.randn_like(k)\n"
        "c.prefill(k, v, [600, 257])\n"
        "c.append(k[:, :3], v[:, :3])\n"
        "q = torch.randn(2, 1, 8, 128, device='cuda').half()\n"
        "o = bd.decode(q, c, num_splits=3); torch.cuda.synchronize(); print('ok', float(o.float().abs().sum()))\n"
        # the appending decode: the kernel stores the token, and its last CTA merges the splits
        "o = bd.decode(q, c, num_splits=3, k_new=k[:, 3:4], v_new=v[:, 3:4]); torch.cuda.synchronize()\n"
        "print('ok', float(o.float().abs().sum()), c.lengths)\n"
    )
    env = dict(os.environ)
    res = subprocess.run([tool, "--tool", tool_name, "--report-api-errors", "no", "--error-exitcode", "3",
                          sys.executable, str(script)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "ok" in res.stdout and "[604, 261]" in res.stdout, res.stdout[-3000:]


def test_one_cache_decoded_on_two_streams_equals_serial(backend):
    """Parallel sampling: two queries over one cache on two streams at once give the serial
    results (each call's split-KV workspace is its own)."""
    fmt = bd.KVFormat(bits=4)
    nr = fmt.residual_block
    cache, _, _ = make_cache(fmt, [40 * nr + 9, 33 * nr], 2, 128, torch.float16, backend=backend, seed=8)
    gen = torch.Generator().manual_seed(12)
    qs = [torch.randn(2, 1, 8, 128, generator=gen).half().to(DEV) for _ in range(2)]
    serial = [bd.decode(q, cache, num_splits=8) for q in qs]
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream() for _ in qs]
    outs = [[], []]
    for _ in range(20):  # interleaved launches on both streams
        for i, (q, s) in enumerate(zip(qs, streams)):
            with torch.cuda.stream(s):
                outs[i].append(bd.decode(q, cache, num_splits=8))
    torch.cuda.synchronize()
    for i in range(2):
        for o in outs[i]:
            assert torch.equal(o, serial[i])


def test_decode_outputs_are_never_handed_out_twice(backend):
    """Outputs come from chunks allocated ``DecodePlan.OUT_CHUNK`` at a time: every call's
    is its own memory, so outputs kept over more calls than a chunk holds keep their values."""
    from bitdecode.kernels_sm80.backend import DecodePlan

    fmt = bd.KVFormat(bits=4)
    cache, _, _ = make_cache(fmt, [5 * fmt.residual_block + 9, 77], 2, 128, torch.float16, backend=backend)
    gen = torch.Generator().manual_seed(3)
    qs = [torch.randn(2, 1, 8, 128, generator=gen).half().to(DEV) for _ in range(DecodePlan.OUT_CHUNK + 5)]
    outs = [bd.decode(q, cache, num_splits=split) for q in qs for split in (1, 3)]
    assert len({o.data_ptr() for o in outs}) == len(outs)
    torch.cuda.synchronize()
    again = [bd.decode(q, cache, num_splits=split).clone() for q in qs for split in (1, 3)]
    for o, a in zip(outs, again):
        assert torch.equal(o, a)


def test_edited_block_table_never_takes_a_kernel_outside_the_cache(backend):
    """A block table edited after prefill (the host check has passed) to hold page ids
    outside the cache: the append kernel skips those blocks (writes nothing anywhere) and the
    decode reads stay inside the cache (the run completes; sanitizer tests cover the rest)."""
    fmt = bd.KVFormat(bits=4)
    nr = fmt.residual_block
    cache, _, _ = make_cache(fmt, [3 * nr, 3 * nr], 2, 128, torch.float16, page_size=nr, backend=backend, seed=3)
    pages = cache.k_pack.shape[0]
    cache.block_table[1, 3] = pages + 1000  # the block the append completes
    cache.block_table[1, 0] = -5  # read by the decode
    before = [t.clone() for t in (cache.k_pack, cache.k_params, cache.v_pack, cache.v_params)]
    gen = torch.Generator().manual_seed(4)
    k = torch.randn(2, nr, 2, 128, generator=gen).half().to(DEV)
    cache.append(k, k)
    out = bd.decode(torch.randn(2, 1, 8, 128, generator=gen).half().to(DEV), cache, num_splits=2)
    torch.cuda.synchronize()
    written = int(cache.block_table[0, 3])  # the only page the append may write
    for t, b in zip((cache.k_pack, cache.k_params, cache.v_pack, cache.v_params), before):
        keep = torch.ones(pages, dtype=torch.bool)
        keep[written] = False
        assert torch.equal(t[keep.to(DEV)], b[keep.to(DEV)])
        assert not torch.equal(t[written], b[written])
    assert out.shape == (2, 1, 8, 128)
    assert cache.seqlens.tolist() == [4 * nr, 4 * nr]


def test_truncate_then_append_equals_the_reference(backend):
    """Speculative decoding on the kernels: append a draft block, drop part of it (the new
    end inside a block the append kernel packed), append again: the same bytes as the
    reference backend doing the same."""
    fmt = bd.KVFormat(bits=4)
    nr = fmt.residual_block
    gen = torch.Generator().manual_seed(31)
    k, v = kv(gen, 2, 4 * nr, 2, 128, dtype=torch.float16, device=DEV)
    caches = []
    for name in (backend, "reference"):
        c = bd.KVCache.allocate(2, 2, 128, 5 * nr, fmt, device=DEV, page_size=nr, backend=name)
        c.prefill(k[:, :nr + 10], v[:, :nr + 10], [nr + 10, nr - 3])
        c.append(k[:, 2 * nr:2 * nr + 130], v[:, 2 * nr:2 * nr + 130])
        c.truncate(40)
        c.append(k[:, 3 * nr:3 * nr + 70], v[:, 3 * nr:3 * nr + 70])
        caches.append(c)
    _assert_same_cache(*caches)


def test_deepcopy_of_a_cache_with_plans(backend):
    """``copy.deepcopy`` of a cache whose kernels have run (plans, the appending decode's fast
    path, the appender bound to its tensors): the copy builds its own, decodes as the
    original, and its steps leave the original as it was."""
    import copy

    fmt = bd.KVFormat(bits=4)
    gen = torch.Generator().manual_seed(32)
    k, v = kv(gen, 2, 300, 2, 128, dtype=torch.float16, device=DEV)
    c = bd.KVCache.allocate(2, 2, 128, 1024, fmt, device=DEV, backend=backend)
    c.prefill(k, v, [300, 77])
    q = torch.randn(2, 1, 8, 128, generator=gen).half().to(DEV)
    step = k[:, :1].contiguous(), v[:, :1].contiguous()
    bd.decode(q, c, k_new=step[0], v_new=step[1])
    c.append(*step)
    want = bd.decode(q, c).clone()
    twin = copy.deepcopy(c)
    assert twin._plans == {} and twin._fast is None and twin._fast_append is None and twin._appender is None
    assert torch.equal(bd.decode(q, twin), want)
    before = {n: getattr(c, n).clone() for n in ("k_pack", "k_res", "v_res", "seqlens")}
    for _ in range(3):
        out = bd.decode(q, twin, k_new=step[0], v_new=step[1])
    twin.append(*step)
    torch.cuda.synchronize()
    assert twin.lengths == [306, 83] and c.lengths == [302, 79] and out.isfinite().all()
    assert all(torch.equal(getattr(c, n), t) for n, t in before.items())
    assert torch.equal(bd.decode(q, c), want)


REAL_KV = os.path.join(os.path.dirname(__file__), "data", "smollm2_kv.pt")


def _real_kv(layer):
    """A real model's post-RoPE Q [4, Hq, D] (the last positions) and K, V [T, Hkv, D], bf16
    (tests/data/make_real_kv.py)."""
    data = torch.load(REAL_KV)

    def get(name):
        return (data[f"{name}{layer}"].view(torch.float8_e4m3fn).float() * data[f"{name}{layer}_scale"]).bfloat16()

    return get("q"), get("k"), get("v")


@pytest.mark.parametrize("layer", [2, 15])
@pytest.mark.parametrize("spec", ["4c64", "4c64s16", "4c64v2s16", "2c32v4s16h", "2c32s16", "2c32s16h"])
def test_real_model_kv(layer, spec, backend):
    """SmolLM2-135M's own Q / K / V (outlier channels, large first keys; 9 query and 3 KV
    heads, head dim 64) through the kernels: the pack kernel writes the reference's bytes,
    and decode (each of the last four positions over its causal prefix) matches the
    reference within the tolerance rule, with or without splits."""
    from bitdecode import eval as bdeval

    fmt = bdeval.parse_method(spec, 64).fmt
    q, k, v = _real_kv(layer)
    n = k.shape[0]
    lens = [n - 3 + i for i in range(4)]  # query i is the token at position lens[i] - 1
    kb, vb = k[None].expand(4, -1, -1, -1).contiguous().to(DEV), v[None].expand(4, -1, -1, -1).contiguous().to(DEV)
    caches = {}
    for writer in ("sm80", "reference"):
        caches[writer] = bd.KVCache.allocate(4, 3, 64, n, fmt, dtype=torch.bfloat16, device=DEV, backend=writer)
        caches[writer].prefill(kb, vb, lens)
    _assert_same_cache(caches["sm80"], caches["reference"])
    qd = q[:, None].to(DEV)  # [4, 1, 9, 64]
    for splits in (0, 1, 3):
        check_decode(qd, caches["sm80"], backend, num_splits=splits)


# (format, dtype, head dim, q heads per kv head, query tokens): T x heads = 16, 16, 16, 8
# query rows per KV head (the kernels' tile), and 32 (past it: the dequantize + SDPA path)
MULTI_TOKEN = [
    (bd.KVFormat(bits=4, k_mode="channel", group_size=128), torch.float16, 128, 4, 4),
    (bd.KVFormat(bits=2, k_mode="token", group_size=64), torch.bfloat16, 64, 2, 8),
    (bd.KVFormat(bits=4, k_mode="channel", group_size=64, sink_tokens=16), torch.float16, 128, 1, 16),
    (bd.KVFormat(bits=4, v_bits=2, k_mode="channel", group_size=64), torch.bfloat16, 128, 4, 2),
    (bd.KVFormat(bits=4, k_mode="token", group_size=32), torch.float16, 64, 4, 8),
    (bd.KVFormat(bits=2, v_bits=4, k_mode="channel", group_size=32, sink_tokens=16), torch.bfloat16, 128, 4, 4),
]


@pytest.mark.parametrize("cfg", MULTI_TOKEN, ids=lambda c: f"k{c[0].bits}v{c[0].v_bits}-{c[0].k_mode}-s{c[0].sink_tokens}"
                         f"-{str(c[1])[6:]}-d{c[2]}-gq{c[3]}-t{c[4]}")
def test_multi_token_queries_match_reference(cfg, backend):
    """T query tokens per sequence (the newest T, causal): the mask falls inside the 16-bit
    residual, across the last packed block (fewer residual tokens than T - 1), on a block
    boundary, and on a sequence that holds only the T new tokens; with and without splits."""
    fmt, dtype, d, gq, tq = cfg
    nr, s = fmt.residual_block, fmt.sink_tokens
    lens = [s + 3 * nr + 40, s + 2 * nr + 2, s + 2 * nr, tq + s, s + nr + tq - 1]
    cache, _, _ = make_cache(fmt, lens, 2, d, dtype, seed=31)
    q = torch.randn(len(lens), tq, 2 * gq, d, generator=torch.Generator().manual_seed(32)).to(dtype).to(DEV)
    for splits in (0, 1, 3):
        check_decode(q, cache, backend, num_splits=splits)
    # without the LSE: the kernels' own output path, or (past the tile) the SDPA path
    ref = bd.decode(q, cache, backend="reference").float()
    tol = kernel_tolerance(q, cache, ref)
    err = (bd.decode(q, cache, backend=backend).float() - ref).abs().max().item()
    assert err <= tol, f"max error {err:.3g} > tolerance {tol:.3g}"




@pytest.mark.parametrize("fmt", [bd.KVFormat(4, "channel", 128), bd.KVFormat(2, "channel", 128)],
                         ids=["4b", "2b"])
def test_rising_scores_match_reference(fmt, backend):
    """Scores that rise along the sequence, with three tokens each far above everything
    before them: the running maximum jumps by more than the sm90 kernel's lazy margin (2 in
    log2 units) three times a head, by 9 to 20 log2 units on this data (each time the
    warpgroup exchanges the maxima and rescales O).  One split and several."""
    nr, d, hkv, gq = fmt.residual_block, 128, 2, 4
    gen = torch.Generator().manual_seed(51)
    n = 12 * nr + 17
    k, v = kv(gen, 2, n, hkv, d, dtype=torch.float16)
    q = torch.randn(2, 1, hkv * gq, d, generator=gen).to(torch.float16)
    k = k.float() * torch.linspace(0.2, 3.0, n).view(1, n, 1, 1)  # scores grow ~15x along the sequence
    qdir = q.float().view(2, hkv, gq, d).mean(2)  # each KV head's mean query direction
    for t, size in ((3 * nr + 5, 20.0), (7 * nr + 64, 40.0), (11 * nr + 1, 60.0)):  # tokens along the queries
        k[:, t] = qdir / qdir.norm(dim=-1, keepdim=True) * size
    k = k.to(torch.float16).to(DEV)
    cache = bd.KVCache.allocate(2, hkv, d, n, fmt, dtype=torch.float16, device=DEV)
    cache.prefill(k, v.to(DEV), [n, n - nr // 2])
    for splits in (1, 0, 3):
        check_decode(q.to(DEV), cache, backend, num_splits=splits)


# FP4 caches decoded by the kernels: (format, dtype, head dim, q heads per kv head)
FP4_CONFIGS = [
    (bd.KVFormat(fp4="nvfp4"), torch.float16, 128, 4),
    (bd.KVFormat(fp4="nvfp4", sink_tokens=16), torch.bfloat16, 64, 8),
    (bd.KVFormat(fp4="mxfp4"), torch.bfloat16, 128, 1),
    (bd.KVFormat(fp4="mxfp4", hadamard=True), torch.float16, 64, 16),
    (bd.KVFormat(fp4="nvfp4"), torch.bfloat16, 256, 2),
]


@pytest.mark.parametrize("cfg", FP4_CONFIGS, ids=lambda c: f"{c[0].fp4}-s{c[0].sink_tokens}{'-h' * c[0].hadamard}"
                         f"-{str(c[1])[6:]}-d{c[2]}-gq{c[3]}")
def test_fp4_decode_matches_reference(cfg, backend):
    """e2m1 codes in natural order and block scales in basic chunks, dequantized in
    registers (Q's channels in the fragment order of K's natural bytes; sm80 takes K's rows
    in the order V's bytes meet P, sm90 writes P^T in that order): against the reference
    with the tolerance rule, with and without splits, dense and on shuffled pages."""
    fmt, dtype, d, gq = cfg
    nr, s = fmt.residual_block, fmt.sink_tokens
    lens = [s + 3 * nr + 5, nr, 1, 0, nr - 1, s + 7 * nr + 64]
    gen = torch.Generator().manual_seed(43)
    q = torch.randn(len(lens), 1, 2 * gq, d, generator=gen).to(dtype).to(DEV)
    for page_size, shuffle in ((None, False), (2 * nr, True)):
        cache, _, _ = make_cache(fmt, lens, 2, d, dtype, page_size=page_size, shuffle=shuffle, seed=41)
        for splits in (0, 1, 3):
            check_decode(q, cache, backend, num_splits=splits)
    if backend != "sm80":
        return
    # allocated with auto: the FP4 pack kernel writes it (prefill, then appends) and auto's
    # kernel decodes it
    cache, _, _ = make_cache(fmt, [max(n - 2, 0) for n in lens], 2, d, dtype, backend="auto", seed=41)
    assert cache.backend == dispatch.resolve("auto", DEV, fmt=fmt, head_dim=d, dtype=dtype) != "reference"
    step = kv(torch.Generator().manual_seed(44), len(lens), 2, 2, d, dtype=dtype, device=DEV)
    for t in range(2):
        cache.append(step[0][:, t:t + 1], step[1][:, t:t + 1])
    check_decode(q, cache, "auto")


def fp4_hard_blocks(gen, fmt, shape, dim, dtype):
    """Values along ``dim`` (blocks of the format's vector) that test every rounding rule:
    each block's amax is 6 (NVFP4) or 4-7.5 (MXFP4) times an exact scale, so its scale is
    that scale, and its values are e2m1 grid points, the midpoints between them (ties) and
    values just off them, times the scale, with random signs, -0.0 and an all-zero block."""
    from bitdecode.layouts import sm100

    vec = sm100.SF_VEC[fmt.fp4]
    shape = list(shape)
    shape.append(shape.pop(dim))
    lead, length = shape[:-1], shape[-1]
    n = -(-length // vec) * vec  # whole blocks, cut back to ``length`` at the end
    blocks = int(torch.tensor(lead).prod()) * (n // vec)
    if fmt.fp4 == "nvfp4":  # e4m3 scales with small exponents: every product exact in 16 bits
        scale = torch.tensor([sm100.ue4m3_value(b) for b in range(0x28, 0x48)])[torch.randint(0, 32, (blocks,),
                                                                                                 generator=gen)]
        top = torch.full((blocks,), sm100.E2M1_MAX)
    else:
        scale = 2.0 ** torch.randint(-8, 6, (blocks,), generator=gen).double()
        top = torch.tensor([4.0, 5.0, 6.0, 7.5])[torch.randint(0, 4, (blocks,), generator=gen)]
    points = torch.tensor(sorted(set(sm100.E2M1_MAGNITUDES) | set(sm100.E2M1_MIDPOINTS)), dtype=torch.float64)
    mag = points[torch.randint(0, len(points), (blocks, vec), generator=gen)]
    nudge = torch.randint(-1, 2, (blocks, vec), generator=gen) * 2.0 ** -7  # on, just below, just above
    mag = (mag * (1 + nudge)).clamp(max=sm100.E2M1_MAX)
    mag[:, 0] = top
    sign = torch.where(torch.rand(blocks, vec, generator=gen) < 0.5, -1.0, 1.0)
    x = sign * mag * scale.double()[:, None]
    x[0] = 0.0
    x[1, 1:] = -0.0
    x = x.to(dtype)
    return x.reshape(*lead, n)[..., :length].movedim(-1, dim).contiguous().to(DEV)


FP4_PACK_CONFIGS = [
    (bd.KVFormat(fp4="nvfp4"), torch.float16, 128),
    (bd.KVFormat(fp4="nvfp4", sink_tokens=5), torch.bfloat16, 64),
    (bd.KVFormat(fp4="mxfp4"), torch.bfloat16, 128),
    (bd.KVFormat(fp4="mxfp4"), torch.float16, 64),
    (bd.KVFormat(fp4="nvfp4"), torch.bfloat16, 256),
]


@pytest.mark.parametrize("cfg", FP4_PACK_CONFIGS, ids=lambda c: f"{c[0].fp4}-s{c[0].sink_tokens}-{str(c[1])[6:]}-d{c[2]}")
def test_fp4_pack_kernel_bit_identical(cfg):
    """The FP4 pack kernel writes the reference's bytes: codes, scale chunks (padding
    included), sinks and the 16-bit residual, on LLM-like data and on blocks built to sit on
    the rounding rules' edges (ties, values a hair off them, -0.0, zero blocks), dense and
    on shuffled pages; a block with a NaN or an infinity gets the NaN scale and zero codes."""
    fmt, dtype, d = cfg
    nr, s = fmt.residual_block, fmt.sink_tokens
    lens = [s + 3 * nr + 7, s + nr, 5]
    a, _, _ = make_cache(fmt, lens, 2, d, dtype, backend="sm80", seed=51, shuffle=True, page_size=2 * nr)
    b, _, _ = make_cache(fmt, lens, 2, d, dtype, backend="reference", seed=51, shuffle=True, page_size=2 * nr)
    assert a.backend == "sm80"
    _assert_same_cache(a, b)
    gen = torch.Generator().manual_seed(52)
    n = s + 4 * nr + 9
    k = fp4_hard_blocks(gen, fmt, (2, n, 2, d), 3, dtype)  # K blocks along the channels
    v = fp4_hard_blocks(gen, fmt, (2, n, 2, d), 1, dtype)  # V blocks along the tokens
    k[0, s + 2, 1, 3] = float("nan")  # non-finite blocks in the first packed block
    v[1, s + 5, 0, 7] = float("inf")
    caches = []
    for writer in ("sm80", "reference"):
        c = bd.KVCache.allocate(2, 2, d, n, fmt, dtype=dtype, device=DEV, backend=writer)
        c.prefill(k, v, [n, n - nr - 3])
        caches.append(c)
    _assert_same_cache(*caches)


@pytest.mark.parametrize("cfg", FP4_PACK_CONFIGS[:3], ids=lambda c: f"{c[0].fp4}-s{c[0].sink_tokens}-{str(c[1])[6:]}-d{c[2]}")
def test_fp4_append_token_by_token_equals_prefill(cfg):
    """Appends of one token, a few, and more than a block (the FP4 pack kernel's append
    mode, blocks completed from the residual buffer) leave the bytes one prefill writes."""
    fmt, dtype, d = cfg
    nr = fmt.residual_block
    n = fmt.sink_tokens + 2 * nr + nr // 2 + 3
    k, v = kv(torch.Generator().manual_seed(53), 2, n, 2, d, dtype=dtype, device=DEV)
    full = bd.KVCache.allocate(2, 2, d, n, fmt, dtype=dtype, device=DEV, backend="sm80")
    full.prefill(k, v)
    _assert_same_cache(full, _appended_in_steps(fmt, k, v, 2))


@pytest.mark.parametrize("fmt, gq, lens, page, dtype", [
    (bd.KVFormat(bits=4), 4, [120], None, torch.float16),  # B=1: splits and the combine; a block completes
    (bd.KVFormat(bits=4), 4, [3000, 126, 0], 128, torch.bfloat16),  # ragged, paged, an empty sequence
    (bd.KVFormat(bits=2), 4, [700, 1530], None, torch.float16),
    (bd.KVFormat(bits=4, v_bits=2, sink_tokens=5), 8, [3, 260], None, torch.float16),  # sinks filling first
    (bd.KVFormat(bits=4), 8, [9080] * 16, None, torch.bfloat16),  # the grid fills the SMs: one split
    (bd.KVFormat(bits=4), 4, [9080], None, torch.float16),  # ~35 splits: sm90 merges them in batches, sm80 two calls
], ids=["b1", "ragged-paged", "2bit", "k4v2-sinks", "b16", "many-splits"])
def test_appending_decode_equals_append_then_decode(backend, fmt, gq, lens, page, dtype):
    """``decode(q, cache, k_new=, v_new=)`` (on the sm80 and sm90 kernels one launch while
    no block completes, split decodes merged in their last CTA) gives the outputs and LSEs
    of ``append`` then ``decode`` (the combine kernel; bit for bit unless merged in the
    kernel, then to fp32 rounding: ``check_appending_steps``) over 12 steps that
    cross a block boundary for some sequence, leaves the same cache bytes and lengths, and
    its commit and arrival counters at zero."""
    check_appending_steps(backend, fmt, gq, lens, page, dtype)


def check_appending_steps(backend, fmt, gq, lens, page, dtype):
    """``test_appending_decode_equals_append_then_decode``'s check, for any kernel build."""
    hkv, d, steps = 2, 128, 12
    gen = torch.Generator().manual_seed(77)
    k, v = kv(gen, len(lens), max(lens) + steps, hkv, d, dtype=dtype, device=DEV)
    caches = []
    for _ in range(2):
        c = bd.KVCache.allocate(len(lens), hkv, d, max(lens) + 64, fmt, dtype=dtype, device=DEV, page_size=page,
                                backend=backend)
        c.prefill(k[:, :max(lens)], v[:, :max(lens)], lens)
        caches.append(c)
    fused, split = caches
    launches = []
    kernels = bd.backend.get(backend)
    appends = kernels.appends
    splits = kernels.choose_splits(fused.tensors(), (len(lens), 1, hkv * gq, d), max(lens) + 1, fused.device)
    # split, the appending kernel's last CTA merges (``HeadMerge``): the combine kernel's
    # partials summed in another order, so the two agree to fp32 rounding (one unit in the
    # last place of the output's dtype at most); otherwise bit for bit
    merged = appends and 1 < splits <= kernels.append_max_splits
    ulp = torch.finfo(dtype).eps
    if appends:  # count the appending kernel's launches
        real = fused._append_decode_plan

        class Counted:  # the plan, its appending launches counted
            def __init__(self, plan):
                self.plan = plan

            def append_step(self, *args):
                launches.append(1)
                return self.plan.append_step(*args)

        def spy(*a, **kw):
            entry = real(*a, **kw)
            if entry[1] is not None:
                entry = (entry[0], Counted(entry[1]), *entry[2:])
            return entry
        fused._append_decode_plan = spy
    for step in range(steps):
        q = torch.randn(len(lens), 1, hkv * gq, d, generator=gen).to(dtype).to(DEV)
        kn, vn = k[:, max(lens) + step:max(lens) + step + 1], v[:, max(lens) + step:max(lens) + step + 1]
        lse = step % 2 == 1  # (the merge in the kernel's last split CTA writes the LSE too)
        got = bd.decode(q, fused, k_new=kn, v_new=vn, return_lse=lse)
        split.append(kn, vn)
        want = bd.decode(q, split, return_lse=lse)
        if lse:
            if merged:
                torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-5, msg=lambda m: f"step {step}: {m}")
                assert torch.equal(torch.isinf(got[1]), torch.isinf(want[1])), f"step {step}: the LSEs differ"
            else:
                assert torch.equal(got[1], want[1]), f"step {step}: the LSEs differ"
            got, want = got[0], want[0]
        if merged:
            torch.testing.assert_close(got, want, rtol=ulp, atol=ulp * 2 ** -4, msg=lambda m: f"step {step}: {m}")
        else:
            assert torch.equal(got, want), f"step {step}: max diff {(got.float() - want.float()).abs().max().item()}"
    fused.check()
    _assert_same_cache(fused, split)
    assert not fused.tensors().commits.any()
    for plan in fused._plans.values():  # the appending plans' split arrival counters
        for work in plan.workspaces.values():
            assert len(work) == 2 or not torch.from_dlpack(work[2]).any()
    if appends:
        if splits <= kernels.append_max_splits:  # every step but those completing a block (and filling sinks)
            assert 0 < len(launches) < steps, launches
        else:  # more splits than the in-kernel merge is worth: every step took append + decode
            assert not launches, (splits, launches)
