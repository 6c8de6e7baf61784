"""The non-finite K / V policy, the same on every backend.

The caches do not check K / V for NaN / Inf (a check would cost a device sync per write).
A quantization group whose range is not finite packs as NaN (scale and zero), so all its
values dequantize to NaN; 16-bit residual tokens are used as they are.  Attention then
gives NaN in exactly the outputs those values feed: a NaN K value poisons the scores of
every query head reading that KV head (its whole output row), a NaN V group the output
channels of that group.  Every other output is the clean cache's.
"""

import pytest
import torch

import bitdecode as bd

from kvdata import kv

D, HKV, GQA, G = 128, 2, 2, 32
FMT = bd.KVFormat(bits=4, k_mode="token", group_size=G)


def _cache(device, backend, k, v, lens):
    c = bd.KVCache.allocate(len(lens), HKV, D, max(lens) + 64, FMT, dtype=k.dtype, device=device, backend=backend)
    c.prefill(k, v, lens)
    return c


def _poison(k, v, nr):
    """NaN in packed K (seq 0, head 0), +Inf in packed V (seq 1, head 1, channel 70: the
    V group of channels 64..95), NaN in residual K (seq 1, head 0)."""
    k, v = k.clone(), v.clone()
    k[0, 10, 0, 5] = float("nan")
    v[1, nr + 3, 1, 70] = float("inf")
    k[1, 3 * nr + 2, 0, 9] = float("nan")
    return k, v


def _check_policy(out, clean):
    """out, clean: [B, 1, Hq, D]; query heads 2h, 2h+1 read KV head h."""
    heads = lambda h: slice(GQA * h, GQA * (h + 1))  # noqa: E731
    assert out[0, 0, heads(0)].isnan().all(), "NaN packed K: the KV head's output rows are NaN"
    assert out[1, 0, heads(0)].isnan().all(), "NaN residual K: the KV head's output rows are NaN"
    v_group = slice(64, 96)
    assert out[1, 0, heads(1), v_group].isnan().all(), "Inf packed V: its channel group is NaN"
    rest = torch.ones(D, dtype=torch.bool)
    rest[v_group] = False
    torch.testing.assert_close(out[1, 0, heads(1)][:, rest], clean[1, 0, heads(1)][:, rest], rtol=0, atol=0)
    torch.testing.assert_close(out[0, 0, heads(1)], clean[0, 0, heads(1)], rtol=0, atol=0)


def _run(device, backend, splits):
    gen = torch.Generator().manual_seed(5)
    nr = FMT.residual_block
    lens = [3 * nr + 7, 3 * nr + 7]
    k, v = kv(gen, 2, lens[0], HKV, D, device=device)
    q = torch.randn(2, 1, HKV * GQA, D, generator=gen).half().to(device)
    clean = _cache(device, backend, k, v, lens).decode(q, num_splits=splits)
    bad = _cache(device, backend, *_poison(k, v, nr), lens)
    out = bad.decode(q, num_splits=splits)
    _check_policy(out.cpu(), clean.cpu())
    return bad


@pytest.mark.parametrize("splits", [1, 3])
def test_non_finite_values_reach_the_outputs_that_read_them_reference(splits):
    _run(torch.device("cpu"), "reference", splits)


def test_append_does_not_reject_non_finite_values():
    """A NaN appended token is stored (and packed as NaN once its block fills), not refused."""
    c = bd.KVCache.allocate(1, HKV, D, 512, FMT, device="cpu", backend="reference")
    k = torch.zeros(1, FMT.residual_block, HKV, D, dtype=torch.float16)
    k[0, 3, 1, 40] = float("nan")
    c.append(k, torch.zeros_like(k))
    assert c.lengths == [FMT.residual_block]
    kd, _ = c.dequantized(0)
    assert kd[3, 1, 32:64].isnan().all() and not kd[3, 0].isnan().any() and not kd[4].isnan().any()


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 3])
def test_non_finite_values_reach_the_outputs_that_read_them_kernels(backend, splits):
    bad = _run(torch.device("cuda"), backend, splits)
    # and the kernels pack exactly the reference's bytes, NaN params included
    nr = FMT.residual_block
    gen = torch.Generator().manual_seed(5)
    k, v = kv(gen, 2, 3 * nr + 7, HKV, D)
    ref = _cache("cpu", "reference", *_poison(k, v, nr), [3 * nr + 7] * 2)
    for name in ("k_pack", "k_params", "v_pack", "v_params", "k_res", "v_res"):
        mine, theirs = getattr(bad, name).cpu(), getattr(ref, name)
        if mine.dtype != torch.int32:  # the residual holds the NaN itself: compare bits
            mine, theirs = mine.view(torch.int16), theirs.view(torch.int16)
        assert torch.equal(mine, theirs), name


def test_hadamard_rotation_saturates_finite_keys():
    """``KVFormat.hadamard`` stores K rotated, and a rotated value can be sqrt(D) times the
    token's largest: fp16 K of 6000 in every channel rotates to 67882, past fp16's largest.
    It saturates there (the group stays finite, every output finite) instead of turning
    the group and every output reading it NaN; a NaN in K still reaches the outputs that
    read it.  (bf16 shares fp32's exponent range: its limit is the group range's, README.)"""
    dtype = torch.float16
    fmt = bd.KVFormat(bits=4, group_size=64, hadamard=True)
    big = torch.finfo(dtype).max / 10.9  # 6009 (sqrt(128) = 11.3)
    gen = torch.Generator().manual_seed(41)
    k, v = kv(gen, 1, 200, HKV, D, dtype=dtype, device="cpu")
    k[0, 5] = big  # every channel of token 5, both heads
    c = bd.KVCache.allocate(1, HKV, D, 256, fmt, dtype=dtype, device="cpu", backend="reference")
    c.prefill(k, v, [200])
    got_k, _ = c.dequantized(0)
    assert got_k.isfinite().all()
    q = torch.randn(1, 1, HKV * GQA, D, generator=gen).to(dtype) / 1e4
    assert bd.decode(q, c).isfinite().all()
    k[0, 7, 1, 3] = float("nan")
    c.prefill(k, v, [200])
    out = bd.decode(q, c)[0, 0]
    assert out[GQA:].isnan().all() and out[:GQA].isfinite().all()  # (KV head 1 only)
