"""The torch emulation of the sm100 FP4 decode kernel (``bitdecode.emulate_sm100``, the spec
that kernel follows) against the reference, on the CPU.

The emulation reads K and V from the packed bytes as tcgen05 would (scale bytes through the
DSL's block-scaled layout) and quantizes Q and P to FP4 itself, as ``OPERAND_TERMS`` terms
each, so it cannot equal the reference's fp32 attention over the dequantized cache: the FP4
operands cost accuracy, which the bounds below are measured for, and which the tolerance
rule of the GPU suite and of ``auto``'s first-use check must allow.  With Q and P kept 16-bit the same emulation
matches the reference to 16-bit rounding, which checks everything else it does (tile
reading, paging, online softmax, splits, sinks, residual) tightly.  Layout mistakes
(naive scale rows, swapped nibbles) exceed the bounds many times over.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional, Tuple

import pytest
import torch

pytest.importorskip("cutlass")  # sf_offsets (the scale bytes' layout) traces the DSL

import bitdecode as bd
from bitdecode import reference
from bitdecode import emulate_sm100 as emulate
from bitdecode.layouts import sm100

import kvdata


class Case(NamedTuple):
    fp4: str
    dtype: torch.dtype
    head_dim: int
    kv_heads: int
    group: int  # query heads per KV head
    lens: Tuple[int, int]
    sinks: int
    page_size: Optional[int]  # None: one page per sequence; else a shuffled block table
    bound: float  # relative L2 error of out against the reference (Q and P in OPERAND_TERMS terms)


# Relative L2 error of out against reference.decode over the same cache (the worst of the
# two sequences), measured on this seeded data: Q and P in 1 | 2 | 3 | 4 FP4 terms | Q and
# P kept 16-bit (``_sixteen_bit_operands``); one term: only Q FP4 | only P FP4:
#   nvfp4-fp16-d128-g4-page128      0.203 | 0.024 | 0.0015 | 0.0002 | 0.00025;  0.161 | 0.084
#   nvfp4-bf16-d128-g8-s16          0.153 | 0.014 | 0.0026 | 0.0018 | 0.0022;   0.138 | 0.082
#   nvfp4-bf16-d256-g4-s16-page256  0.121 | 0.011 | 0.0021 | 0.0021 | 0.0023;   0.097 | 0.079
#   mxfp4-fp16-d128-g4-page256      0.201 | 0.026 | 0.0043 | 0.0006 | 0.00028;  0.133 | 0.160
#   mxfp4-bf16-d128-g8-s16          0.215 | 0.024 | 0.0040 | 0.0014 | 0.0021;   0.161 | 0.144
#   mxfp4-fp16-d64-g3               0.215 | 0.027 | 0.0037 | 0.0007 | 0.00022;  0.176 | 0.119
# One term: FP4 Q costs most under NVFP4 (its error meets K's outlier channels in every
# score), Q and P about equally under MXFP4.  LSE errs by up to 0.73 nats with one term,
# by <= 1.3e-3 with four.  Bounds: the four-term column x ~1.5 (at least 16-bit's).
CASES = [
    Case("nvfp4", torch.float16, 128, 2, 4, (3 * 128 + 37, 256), 0, 128, 0.0004),
    Case("nvfp4", torch.bfloat16, 128, 1, 8, (5 * 128 + 16 + 5, 10), 16, None, 0.003),
    Case("nvfp4", torch.bfloat16, 256, 2, 4, (2 * 128 + 16 + 100, 129), 16, 256, 0.0035),
    Case("mxfp4", torch.float16, 128, 2, 4, (4 * 128 + 1, 2 * 128), 0, 256, 0.001),
    Case("mxfp4", torch.bfloat16, 128, 1, 8, (5 * 128 + 16 + 5, 16 + 128 + 7), 16, None, 0.0025),
    Case("mxfp4", torch.float16, 64, 3, 3, (3 * 128 + 64, 128 + 3), 0, None, 0.0012),
]
LSE_BOUND = 2e-3  # nats (measured <= 1.3e-3)
ONE_TERM_BOUND = 0.27  # relative L2 with Q and P in one FP4 term each (measured <= 0.215)


def _case_id(c: Case) -> str:
    dtype = {torch.float16: "fp16", torch.bfloat16: "bf16"}[c.dtype]
    paged = f"-page{c.page_size}" if c.page_size else ""
    sinks = f"-s{c.sinks}" if c.sinks else ""
    return f"{c.fp4}-{dtype}-d{c.head_dim}-g{c.group}{sinks}{paged}"


IDS = [_case_id(c) for c in CASES]


@functools.lru_cache(maxsize=None)
def _kv_cache(case: Case):
    """(cache, q) of a case: LLM-like K / V prefilled through the reference backend, the
    block table shuffled across both sequences' pages when paged."""
    gen = torch.Generator().manual_seed(7)
    fmt = bd.KVFormat(fp4=case.fp4, sink_tokens=case.sinks)
    n = max(case.lens)
    k, v = kvdata.kv(gen, 2, n, case.kv_heads, case.head_dim, dtype=case.dtype)
    cache = bd.KVCache.allocate(2, case.kv_heads, case.head_dim, n, fmt, dtype=case.dtype, device="cpu",
                                backend="reference", page_size=case.page_size)
    if case.page_size:
        table = cache.block_table
        table.copy_(table.flatten()[torch.randperm(table.numel(), generator=gen)].view_as(table))
    cache.prefill(k, v, list(case.lens))
    q = kvdata.randn(gen, 2, 1, case.kv_heads * case.group, case.head_dim, dtype=case.dtype)
    return cache, q


def _cache(case: Case):
    """(fmt, cache tensors, q) of a case (``_kv_cache``)."""
    cache, q = _kv_cache(case)
    return cache.fmt, cache.tensors(), q


def _args(fmt, t, q, **replace):
    """reference.decode's positional arguments for cache tensors ``t`` (some replaced)."""
    names = ("k_pack", "k_params", "v_pack", "v_params", "k_res", "v_res", "cache_seqlens")
    return (q, *(replace.get(n, getattr(t, n)) for n in names), fmt, t.block_table)


def _reference(case: Case):
    fmt, t, q = _cache(case)
    return reference.decode(*_args(fmt, t, q), return_lse=True, sinks=t.sinks)


def _emulate(case: Case, num_splits: int = 1, terms=None, **replace):
    fmt, t, q = _cache(case)
    return emulate.emulate_decode(*_args(fmt, t, q, **replace), num_splits=num_splits, sinks=t.sinks, terms=terms)


def _sixteen_bit_operands(monkeypatch, dtype):
    """The emulation with Q as it is and P rounded to ``dtype`` (as the 16-bit tiles take
    them) in place of the FP4 operands: everything else it does stays."""
    def q_operand(q_rows, fp4, terms=None):
        return q_rows.double(), torch.ones(q_rows.shape[0])

    def p_operand(p, pmax, fp4, terms=None):
        return p.to(dtype).double(), torch.ones(p.shape[0])

    monkeypatch.setattr(emulate, "_q_operand", q_operand)
    monkeypatch.setattr(emulate, "_p_operand", p_operand)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The worst sequence's relative L2 error (one over the whole batch would let a short,
    exact sequence with a large output hide a long one's error)."""
    return max(kvdata.rel_err(o, r) for o, r in zip(out, ref))


def _eps(dtype) -> float:
    return torch.finfo(dtype).eps


# ---- the decode against the reference ----------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_emulation_matches_the_reference(case):
    (ref, ref_lse), (out, lse) = _reference(case), _emulate(case)
    assert out.dtype == case.dtype and out.shape == ref.shape and lse.shape == ref_lse.shape
    assert _rel_err(out, ref) < case.bound
    assert (lse - ref_lse).abs().max() < LSE_BOUND


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_emulation_meets_the_tolerance_rule(case):
    """What lets ``auto`` take the sm100 kernel: its spec passes the rule every backend is
    held to (``cli_selfcheck.decode_mismatch``: the output within twice a same-precision
    torch computation's error plus a floor, the LSE within 2e-3 + 1e-3 relative), at one
    and at three splits."""
    cache, q = _kv_cache(case)
    ref, ref_lse = _reference(case)
    tol = reference.decode_tolerance(reference.rounded_p_attention(q, cache, q.shape[-1] ** -0.5), ref.float())
    for splits in (1, 3):
        out, lse = _emulate(case, num_splits=splits)
        assert (out.float() - ref.float()).abs().max().item() <= tol
        assert torch.allclose(lse, ref_lse, atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=[IDS[0], IDS[3]])
def test_each_operand_term_cuts_the_error(case):
    """Why four terms: one FP4 term of Q and of P misses the reference by ~0.2 relative L2
    (beyond the tolerance rule by ~50x); each further term cuts that ~6-10x (measured
    0.20 / 0.025 / 0.0015-0.0043 / 0.0002-0.0006) down to 16-bit rounding."""
    ref, _ = _reference(case)
    errs = [_rel_err(_emulate(case, terms=n)[0], ref) for n in (1, 2, 3, 4)]
    assert 0.1 < errs[0] < ONE_TERM_BOUND
    assert all(b < a / 5 for a, b in zip(errs, errs[1:])), errs
    assert errs[3] < case.bound
    with pytest.raises(ValueError, match="terms"):
        _emulate(case, terms=0)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_with_sixteen_bit_q_and_p_the_rest_is_exact(case, monkeypatch):
    """Everything but the FP4 operands (tile bytes, pages, online softmax, sinks, residual,
    the merge) agrees with the reference to 16-bit rounding: out within one ulp of relative
    L2 (measured 0.22-0.29 of it), LSE within a quarter ulp in nats (measured <= 0.13 ulp:
    P rounded to 16 bits, as the 16-bit tiles round it, is all that remains)."""
    _sixteen_bit_operands(monkeypatch, case.dtype)
    (ref, ref_lse), (out, lse) = _reference(case), _emulate(case)
    assert _rel_err(out, ref) < _eps(case.dtype)
    assert (lse - ref_lse).abs().max() < _eps(case.dtype) / 4


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_split_count_changes_only_rounding(case):
    """Three splits (the kernels' tile partition, merged as the combine kernel merges) give
    the unsplit result up to 16-bit rounding: P of a 16-bit tile is rounded after
    ``exp2(s - m_new)``, and m_new depends on the tiles a split saw.  FP4 P is not moved by
    it: ``rp`` quantizes every tile relative to its own max."""
    out1, lse1 = _emulate(case, num_splits=1)
    out3, lse3 = _emulate(case, num_splits=3)
    assert _rel_err(out3, out1) < _eps(case.dtype) / 2  # measured <= 0.36 of it
    assert (lse3 - lse1).abs().max() < _eps(case.dtype) / 16  # measured <= 0.48 of it


@pytest.mark.parametrize("case", [CASES[0], CASES[5]], ids=[IDS[0], IDS[5]])
def test_a_softmax_scale_is_the_callers(case, monkeypatch):
    """``softmax_scale`` (here 0.3, not the default 1 / sqrt(D)) is the scale of the scores:
    with Q and P kept 16-bit the emulation meets the reference given the same scale to
    16-bit rounding, as it does at the default."""
    _sixteen_bit_operands(monkeypatch, case.dtype)
    fmt, t, q = _cache(case)
    ref, ref_lse = reference.decode(*_args(fmt, t, q), softmax_scale=0.3, return_lse=True, sinks=t.sinks)
    out, lse = emulate.emulate_decode(*_args(fmt, t, q), softmax_scale=0.3, sinks=t.sinks)
    assert _rel_err(out, ref) < _eps(case.dtype)
    assert (lse - ref_lse).abs().max() < _eps(case.dtype) / 4


def test_an_unpaged_cache_needs_no_block_table():
    """Without a block table sequence b reads page b (as ``reference.decode``): the same
    result, bit for bit, as with the unpaged cache's own table."""
    case = CASES[5]
    fmt, t, q = _cache(case)
    assert case.page_size is None
    out, lse = emulate.emulate_decode(*_args(fmt, t, q)[:-1], sinks=t.sinks)
    want, want_lse = _emulate(case)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


def test_emulate_cache_passes_its_arguments_on():
    """``emulate_cache`` is ``emulate_decode`` over the cache's tensors with the split count
    and the operand terms it is given (one term and three splits here: bit for bit the
    same, and not the four-term result)."""
    case = CASES[5]
    cache, q = _kv_cache(case)
    out, lse = emulate.emulate_cache(q, cache, 3, terms=1)
    want, want_lse = _emulate(case, num_splits=3, terms=1)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    assert not torch.equal(out, _emulate(case, num_splits=3)[0])


def test_arguments_it_does_not_emulate_are_refused():
    """One query token per sequence (``q [B, 1, Hq, D]``: the kernel decodes one) and a
    positive int count of operand terms, and query heads a positive multiple of the KV
    heads, else ``ValueError``: two query tokens are not silently decoded as the first, nor
    ``terms=2.0`` taken for two, nor 8 query heads over 3 KV heads returned with two rows
    never written."""
    case = CASES[5]
    fmt, t, q = _cache(case)
    with pytest.raises(ValueError, match="one query token"):
        emulate.emulate_decode(*_args(fmt, t, q.expand(-1, 2, -1, -1)), sinks=t.sinks)
    assert t.k_res.shape[2] == 3 and q.shape[2] == 9
    for heads in (8, 0):
        with pytest.raises(ValueError, match=f"q has {heads} heads, not a positive multiple of the cache's 3"):
            emulate.emulate_decode(*_args(fmt, t, q[:, :, :heads]), sinks=t.sinks)
    for terms in (2.0, "4", -1):
        with pytest.raises(ValueError, match="terms must be a positive int"):
            _emulate(case, terms=terms)


def test_a_tile_far_below_the_running_max_adds_nothing():
    """The running max never drops: a tile 196 log2 units below an earlier one (past fp32's
    2^128) rescales nothing (alpha 1), its p underflow to 0, and the output stays the
    earlier tile's (no inf or NaN from ``exp2(m - m_tile)``)."""
    fmt = bd.KVFormat(fp4="nvfp4")
    d, n = 128, 2 * 128 + 5
    k = torch.zeros(1, n, 1, d, dtype=torch.float16)
    k[:, :128] = 3.0  # tile 0: q . k * log2(e) / sqrt(d) = 196 log2 units; tile 1 and the residual: 0
    v = kvdata.randn(torch.Generator().manual_seed(3), 1, n, 1, d)
    cache = bd.KVCache.allocate(1, 1, d, n, fmt, dtype=torch.float16, device="cpu", backend="reference")
    cache.prefill(k, v, [n])
    q = torch.full((1, 1, 2, d), 4.0, dtype=torch.float16)
    t = cache.tensors()
    ref, ref_lse = reference.decode(*_args(fmt, t, q), return_lse=True)
    out, lse = emulate.emulate_decode(*_args(fmt, t, q))
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert _rel_err(out, ref) < CASES[0].bound and (lse - ref_lse).abs().max() < LSE_BOUND


def test_sixteen_bit_tiles_round_p_to_the_cache_dtype():
    """A 16-bit tile (sinks, residual) rounds ``p = exp2(s - m_new)`` to the cache dtype
    before both the row sum and P.V, as the kernel's 16-bit MMA takes it: p of a score
    0.1 below the max enters l and O as its fp16 value, not its fp32 one."""
    state = emulate._Softmax.empty(1, 2, torch.device("cpu"))
    k = torch.tensor([[0.0, 0.0], [-0.1, 0.0]], dtype=torch.float16)
    v = torch.eye(2, dtype=torch.float16)
    q = torch.tensor([[1.0, 0.0]], dtype=torch.float16)
    emulate._sixteen_bit_tile(state, q, torch.tensor(1.0), k, v)
    p32 = torch.exp2(k[1, :1].float())
    p16 = p32.half().float()
    assert p16 != p32  # (the rounding is visible)
    assert torch.equal(state.l, 1 + p16) and torch.equal(state.o, torch.cat([torch.ones(1), p16])[None])


def _naive_scale_rows(fp4: str, rows: int, cols: int) -> torch.Tensor:
    """The mistake a row-major reading of the chunks makes: scale (r, j) at byte 4 r + j of
    its chunk (the basic chunk holds row r at 16 (r % 32) + 4 (r // 32))."""
    n = cols // sm100.SF_VEC[fp4]
    r, j = torch.arange(rows)[:, None], torch.arange(n)[None]
    chunk = r // sm100.SF_ATOM_ROWS * sm100.sf_chunks(n) + j // sm100.SF_ATOM_COLS
    return chunk * sm100.SF_CHUNK_WORDS * 4 + sm100.SF_ATOM_COLS * (r % sm100.SF_ATOM_ROWS) + j % sm100.SF_ATOM_COLS


def _swap_nibbles(words: torch.Tensor) -> torch.Tensor:
    """Every byte's two e2m1 codes swapped (the high nibble read as the lower index)."""
    w = words.long() & 0xFFFFFFFF
    s = ((w & 0x0F0F0F0F) << 4) | ((w >> 4) & 0x0F0F0F0F)
    return torch.where(s >= 2**31, s - 2**32, s).to(torch.int32)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_layout_mistakes_fail_by_far(case, monkeypatch):
    """Scale bytes read row-major, or K's nibbles swapped: the error exceeds 3x the bound
    (one term: naive rows 1.5-7.2, 7.5-28x the bound; swapped nibbles 1.1-1.5, 4.6-7.9x;
    four terms put the bound 100x lower)."""
    ref, _ = _reference(case)
    _, t, _ = _cache(case)
    swapped, _ = _emulate(case, k_pack=_swap_nibbles(t.k_pack))
    assert _rel_err(swapped, ref) > 3 * case.bound
    monkeypatch.setattr(emulate, "_scale_byte_offsets", _naive_scale_rows)
    naive, _ = _emulate(case)
    assert _rel_err(naive, ref) > 3 * case.bound


def test_tiles_are_the_reference_bytes():
    """The K / V tiles read from the words and chunks through ``sf_offsets`` are, rounded
    to the cache dtype, exactly what ``reference.unpack_k`` / ``unpack_v`` give (paged,
    sinks ahead of the packed tokens)."""
    for case in (CASES[2], CASES[5]):  # d256: two V row chunks, 4 K column chunks; d64: padded columns
        fmt, t, _ = _cache(case)
        k, v = reference.gather_kv(0, case.lens[0], t.k_pack, t.k_params, t.v_pack, t.v_params, t.k_res, t.v_res,
                                   t.block_table, fmt, t.sinks)
        for h in range(case.kv_heads):
            head = emulate._HeadCache(t, t.block_table[0], 0, h)
            for tile in range((case.lens[0] - case.sinks) // emulate.TILE_TOKENS):
                rows = slice(case.sinks + tile * 128, case.sinks + (tile + 1) * 128)
                assert torch.equal(head.k_tile(tile).to(case.dtype), k[rows, h])
                assert torch.equal(head.v_tile(tile).to(case.dtype), v[rows, h])


def test_empty_sequence_and_integer_formats():
    case = CASES[0]
    fmt, t, q = _cache(case)
    lens = torch.tensor([0, case.lens[1]], dtype=torch.int32)
    out, lse = _emulate(case, num_splits=3, cache_seqlens=lens)
    ref, ref_lse = reference.decode(*_args(fmt, t, q, cache_seqlens=lens), return_lse=True)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and bool((lse[0] == -math.inf).all())
    assert kvdata.rel_err(out[1], ref[1]) < case.bound and torch.isfinite(lse[1]).all()
    with pytest.raises(ValueError, match="fmt"):
        emulate.emulate_decode(*_args(bd.KVFormat(), t, q))


@pytest.mark.parametrize("weight", [8, 16, 17, 32, 336, 4096])
def test_split_tiles_partition_the_tiles(weight):
    """Every split count (and tail weight, in sixteenths) hands each packed tile to exactly
    one split, in order, and the residual to the split that ends with the last packed tile
    (or owns nothing else); weight 16 (or less) splits evenly (to a tile), a heavier one
    leaves the last split about 16 / weight of the others' tiles."""
    for seqlen in [0, 1, 127, 128, 129, 255, 256, 1000, 1024, 1100, 65536, 65600, 2 ** 24]:
        n_full, n_res = divmod(seqlen, 128)
        for splits in range(1, 8):
            tiles, residual, owned = [], [], []
            for s in range(splits):
                begin, packed_end, has_residual, res = emulate.split_tiles(seqlen, 128, s, splits, weight)
                assert res == n_res
                tiles += list(range(begin, packed_end))
                owned.append(max(0, packed_end - begin) + has_residual)
                if has_residual:
                    residual.append(s)
                    assert packed_end == n_full
            assert tiles == list(range(n_full))
            assert len(residual) == (n_res > 0)
            n_tiles = n_full + (n_res > 0)
            if weight <= 16:
                assert max(owned) == -(-n_tiles // splits)
            elif splits > 1 and n_tiles >= weight * splits * splits:  # long enough for every split's share
                assert len(set(owned[:-1])) == 1, owned
                assert owned[0] * 16 - weight * splits <= owned[-1] * weight <= owned[0] * 16, owned


# ---- the quantizers ----------------------------------------------------------------------

# An element's error, relative to its block's amax.  NVFP4: the scale s is amax / 6 rounded
# to e4m3 (at most 2^-4 away), e2m1's widest gap (4 to 6) errs by at most s, and a value
# past 6 s (s rounded down) saturates by less: err <= s <= (1 + 2^-4) amax / 6.  MXFP4:
# s = 2^(floor(log2 amax) - 2) lies in (amax / 8, amax / 4], so the gap errs by s <= amax / 4
# and saturation by amax - 6 s < amax / 4.
FP4_BLOCK_REL = {"nvfp4": (1 + 2.0 ** -(sm100.E4M3_MANTISSA_BITS + 1)) / sm100.E2M1_MAX,
                 "mxfp4": 2.0 ** -sm100.E2M1_EMAX}


def _check_operand(x, codes, sf, r, fp4):
    """Codes and scale bytes valid; ``e2m1(code) * scale / r`` within FP4_BLOCK_REL of each
    block's amax of ``x``; the row's largest value exactly OPERAND_TOP; r maps amax there."""
    assert codes.dtype == torch.uint8 and int(codes.max()) < 16
    assert sf.dtype == torch.uint8
    if fp4 == "nvfp4":  # positive, finite, at least the smallest scale 2^-9 (byte 1)
        assert int(sf.min()) >= 1 and int(sf.max()) <= 0x7E
    else:
        assert int(sf.max()) < sm100.UE8M0_NAN
    vals = emulate._fp4_values(codes, sf, fp4)
    vec = sm100.SF_VEC[fp4]
    err = (vals / r.double()[:, None] - x.double()).abs().view(x.shape[0], -1, vec).amax(-1)
    amax_b = x.double().abs().view(x.shape[0], -1, vec).amax(-1)
    assert bool((err <= FP4_BLOCK_REL[fp4] * amax_b * (1 + 2.0 ** -20)).all())
    amax = x.float().abs().amax(-1)
    live = amax > 0
    top = emulate.OPERAND_TOP[fp4]
    assert torch.equal(vals.abs().amax(-1)[live], torch.full_like(amax[live], top, dtype=torch.float64))
    assert bool(((r[live].double() * amax[live].double() - top).abs() <= top * 2.0 ** -23).all())
    assert bool((r[~live] == 1).all()) and bool((vals[~live] == 0).all())  # (-0 keeps its sign bit)
    return vals


@pytest.mark.parametrize("fp4", sm100.FP4_FORMATS)
@pytest.mark.parametrize("dtype", kvdata.DTYPES, ids=["fp16", "bf16"])
def test_q_operand(fp4, dtype, gen):
    """Rows from 1e3 down to 1e-4 (and a zero row) all keep FP4's relative precision: NVFP4
    without ``rg`` would put the small rows on the smallest e4m3 scale and lose them."""
    mags = torch.tensor([1e3, 10, 1, 1e-2, 1e-4, 0])[:, None]
    q = (torch.randn(6, 128, generator=gen) * mags).to(dtype)
    codes, sf, rg = emulate.quantize_q_operand(q, fp4, terms=1)
    codes, sf = codes[0], sf[0]
    vals = _check_operand(q, codes, sf, rg, fp4)
    rel = kvdata.rel_err(vals[4] / rg[4].double(), q[4])
    assert rel < 0.15  # measured 0.093 (NVFP4) / 0.119 (MXFP4), as the rows at 1e3 .. 1e-2
    if fp4 == "nvfp4":
        c0, s0 = reference.quantize_fp4(q[4:5], fp4)
        assert kvdata.rel_err(reference.dequantize_fp4(c0, s0, fp4, torch.float32), q[4:5]) > 0.9


@pytest.mark.parametrize("fp4", sm100.FP4_FORMATS)
def test_operand_terms_quantize_the_residual(fp4, gen):
    """Q's terms (P's are formed by the same function): term 0 is the one-term operand, and
    each later one quantizes what the terms before it left, so after t terms an element
    errs by at most FP4_BLOCK_REL^t of its block's amax (each term errs by FP4_BLOCK_REL of
    its residual's block amax, which the previous error bounds), plus under NVFP4 a quarter
    of the smallest e4m3 scale per term (a residual block below 6 * 2^-9 keeps scale 2^-9)."""
    q = (torch.randn(5, 128, generator=gen) * torch.tensor([1e3, 10, 1, 1e-2, 1e-4])[:, None]).to(torch.float16)
    codes, sf, rg = emulate.quantize_q_operand(q, fp4)
    assert codes.shape == (emulate.OPERAND_TERMS, *q.shape) and sf.shape[0] == emulate.OPERAND_TERMS
    one_codes, one_sf, one_rg = emulate.quantize_q_operand(q, fp4, terms=1)
    assert torch.equal(codes[0], one_codes[0]) and torch.equal(sf[0], one_sf[0]) and torch.equal(rg, one_rg)
    vec = sm100.SF_VEC[fp4]
    y = (q.float() * rg[:, None]).double()  # the kernel's fp32 product
    amax_b = y.abs().view(5, -1, vec).amax(-1)
    floor = sm100.UE4M3_MIN / 4 if fp4 == "nvfp4" else 0.0
    total = torch.zeros_like(y)
    for t in range(emulate.OPERAND_TERMS):
        total += emulate._fp4_values(codes[t], sf[t], fp4)
        err = (total - y).abs().view(5, -1, vec).amax(-1)
        assert bool((err <= FP4_BLOCK_REL[fp4] ** (t + 1) * amax_b * (1 + 2.0 ** -20) + floor * (t + 1)).all()), t


def test_q_operand_of_a_subnormal_row_stays_finite():
    """A bf16 row at 1e-39 (subnormal) would ask rg = 2688 / 1e-39 > fp32's largest: the
    cap keeps it finite and the row's codes alive."""
    q = (torch.tensor([[1.0, -0.5, 0.25, 0.75] * 4]) * 1e-39).to(torch.bfloat16)
    codes, sf, rg = emulate.quantize_q_operand(q, "nvfp4", terms=1)
    assert torch.isfinite(rg).all() and int(codes.max()) > 0


def _tile_scores(gen, masked_from: int):
    """Scores [4, 128] (log2 units) of one tile: row 0 holds the running max, row 1 lies 30
    below it, row 2 is masked from token ``masked_from`` on, row 3 entirely."""
    s = torch.randn(4, 128, generator=gen) * 3
    s[1] -= 30 + s[1].max()
    s[2, masked_from:] = -math.inf
    s[3] = -math.inf
    return s


@pytest.mark.parametrize("fp4", sm100.FP4_FORMATS)
def test_p_operand(fp4, gen):
    """P's blocks: all-masked ones give codes 0 (a fully masked row rp = 1 as well); a tile
    far below the running max keeps its precision through ``rp`` (which FP4 P without it
    would flush to 0 under NVFP4); a different running max moves no code that is not on a
    rounding edge, so the split count cannot change P."""
    vec = sm100.SF_VEC[fp4]
    s = _tile_scores(gen, masked_from=128 - 2 * vec + 3)  # the last block entirely masked
    m_tile = s.amax(-1)
    m_new = torch.maximum(m_tile, s[0].max().expand(4))

    def operand(m):
        p = torch.where(s == -math.inf, 0.0, torch.exp2(s - m[:, None]))
        pmax = torch.where(m_tile == -math.inf, 0.0, torch.exp2(m_tile - m))
        codes, sf, rp = emulate.quantize_p_operand(p, pmax, fp4, terms=1)
        return p, (codes[0], sf[0], rp)

    p, (codes, sf, rp) = operand(m_new)
    vals = _check_operand(p, codes, sf, rp, fp4)
    assert bool((codes[2, -vec:] == 0).all()) and bool((codes[3] == 0).all()) and rp[3] == 1
    assert kvdata.rel_err(vals[1] / rp[1].double(), p[1]) < 0.15  # measured 0.025 / 0.038
    if fp4 == "nvfp4":
        lost, _ = reference._quantize_fp4_blocks(p[1].view(-1, vec), fp4)
        assert int(lost.max()) == 0
    p_moved, (moved, _, _) = operand(m_new + 0.37)  # as if a split had seen a larger max before
    assert (moved != codes).float().mean() < 0.01  # measured 0
    # without rp the same shift re-rounds P (measured 10 % / 18 % of row 0's codes): what rp buys MXFP4
    plain = [reference._quantize_fp4_blocks(x[0].view(-1, vec), fp4)[0] for x in (p, p_moved)]
    assert (plain[0] != plain[1]).float().mean() > 0.05


@pytest.mark.parametrize("fp4, head_dim, dtype, sinks", [
    ("nvfp4", 128, torch.float16, 16),
    ("mxfp4", 256, torch.bfloat16, 0),
])
def test_the_spec_passes_the_first_use_check(monkeypatch, fp4, head_dim, dtype, sinks):
    """``bitdecode selfcheck --backend sm100`` (what ``auto`` runs before it takes the
    kernel) with the kernel replaced by its spec: the reference's tolerance rule and the
    spec check both pass, on the check's own data (ragged GQA, appends, 0 / 1 / 3 splits)."""
    from bitdecode import cli_selfcheck

    decode, allocate = bd.decode, bd.KVCache.allocate

    def spec_decode(q, cache, num_splits=0, backend="auto", return_lse=False, **kw):
        if backend != "sm100":
            return decode(q, cache, num_splits=num_splits, backend=backend, return_lse=return_lse, **kw)
        out, lse = emulate.emulate_cache(q, cache, num_splits)
        return (out, lse) if return_lse else out

    monkeypatch.setattr(bd, "decode", spec_decode)
    # the writes are the reference's (the sm100 backend's prefill / append are sm80 kernels)
    monkeypatch.setattr(bd.KVCache, "allocate", lambda *a, backend=None, **k: allocate(*a, backend="reference", **k))
    fmt = bd.KVFormat(fp4=fp4, sink_tokens=sinks)
    assert cli_selfcheck.run_check("sm100", torch.device("cpu"), fmt, head_dim, dtype) == ""
