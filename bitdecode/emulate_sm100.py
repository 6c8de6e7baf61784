"""The sm100 FP4 decode kernel's arithmetic, replayed in torch: the spec that kernel follows.

``kernels_sm100/decode.py`` (a split-KV decode on ``tcgen05`` block-scaled MMAs over an
NVFP4 / MXFP4 cache) cannot run without a Blackwell GPU, so its arithmetic is written down
here, step by step, as the CPU can check it: the kernel mirrors these functions (the two
quantizers above all), and ``tests/test_sm100_emulation.py`` checks this module against
``bitdecode.reference.decode``.  A difference between the kernel and this module is a bug
in one of them.

Why Q and P are FP4.  K and V arrive as the cache stores them (e2m1 codes and block
scales, the bytes TMA copies), and the only block-scaled tcgen05 kinds that read an NVFP4
operand as it is take FP4 on both sides: ``kind::mxf4nvf4`` (MXFP4 caches: ``kind::mxf4``
the same way).  So the query (B of ``S = K Q^T``) and the probabilities (B of
``O^T = V^T P^T``) are quantized to the cache's own format inside the kernel, Q once per
CTA and P once per 128-token tile, in blocks of ``SF_VEC`` along the contraction.

Why ``OPERAND_TERMS`` (four) terms each.  One FP4 term of Q and of P costs 0.12-0.22
relative L2 of the output against the reference (LLM-like data; 16-bit operands: ~1e-3),
some 50 times the tolerance rule every backend is held to.  So each operand is a sum of
terms: term 0 quantizes the operand, term ``t + 1`` the residual the terms before it left
(in the same blocks, on the same fp32 operand scale, with its own block scales), and each
product is one block-scaled MMA per term accumulating into the same tensor memory.  Each
term cuts the error 6-10x; four reach the 16-bit operands' accuracy (0.0002-0.0021).

Why the fp32 operand scales ``rg`` (per query row) and ``rp`` (per query row and tile).
NVFP4's e4m3 block scales span only ``2^-9 .. 448``: a Q row whose values are all small, or
a tile whose probabilities are all far below the running max, would sit on the smallest
scales and keep only a code or two of precision (or flush to zero).  Multiplying the row
by ``r = 2688 / amax`` first (2688 = e2m1's 6 times e4m3's 448, the largest value an NVFP4
block holds) maps its largest value to the top of the format: with rp the tile's largest p
maps to 2688.  Dividing the fp32 accumulator by ``r`` afterwards undoes it where it is
cheap: ``rg`` folds into the softmax scale, ``rp`` into the tile's P.V product and row sum.
MXFP4's power-of-two scales span ``2^-127 .. 2^127`` and need no help with range, but P
takes ``rp = 6 / pmax`` all the same (``OPERAND_TOP``; Q ``rg = 6 / amax`` by the same
rule): then P's quantization grid is the tile's own, ``6 exp2(s - m_tile)``, not one set
by the running max ``m_new``, which depends on which tiles a split saw first.  With
``rp = 1`` an MXFP4 decode split 3 ways differs from the unsplit one by 4-6 % (relative
L2 of the output, LLM-like data), so results would change with the GPU's split heuristic;
with ``rp = 6 / pmax`` by fp32 / 16-bit rounding only, as NVFP4's.  The row's largest
value then dequantizes to exactly ``OPERAND_TOP`` in both formats (code 6 on scale 448,
resp. 1), whatever the fp32 rounding of ``r``.

Per (sequence b, KV head h) and per split, in fp32 unless said otherwise (G query heads per
KV head, rows ``h G .. h G + G - 1`` of ``q[b, 0]``; scores in log2 units):

1. Q: ``quantize_q_operand`` (codes, scale bytes per term, rg); ``qhat = sum over the
   terms of e2m1(code) * s_b``;
   ``c = fp32(scale_log2 / rg)`` per row, ``scale_log2 = softmax_scale * log2(e)``.
2. Each packed 128-token tile, K and V read from the packed words and scale chunks (the
   bytes TMA copies; scale of row t, column j at byte ``sf_offsets(fmt, rows, cols)[t][j]``
   of the tile's chunks): ``s = (K qhat^T, exact then fp32) * c``; ``m_new = max(m,
   max_t s)``, ``alpha = exp2(m - m_new)`` (0 while m = -inf), ``p = exp2(s - m_new)``;
   P: ``quantize_p_operand(p, exp2(m_tile - m_new))`` (codes, scale bytes per term, rp),
   ``phat`` its terms' sum; ``l = l alpha + sum_t phat / rp``, ``O = O alpha + (phat V) / rp``
   (``/ rp`` as a multiply by the one fp32 reciprocal per row, as the kernel does it).
3. Each 16-bit tile (the sinks first, in split 0; the residual last): ``s = (q . k in
   fp32) * scale_log2`` with q as it is, the same running max, ``p16 = exp2(s - m_new)``
   rounded to the cache dtype, ``l = l alpha + sum p16``, ``O = O alpha + p16 . v``.
4. ``O / l`` and ``lse = (m + log2 l) ln 2`` per split (no tokens: 0 and -inf), merged as
   ``kernels_sm80/combine.py`` merges them, cast to q's dtype.

The tiles a split owns are those of ``kernels_sm80.tensors.split_tiles`` (``split_tiles``
here is its integer arithmetic in Python).  Sums the MMA forms exactly are formed in
float64 here and rounded once to fp32; the kernel's own summation order differs from that
by fp32 rounding only.  Importable without cutlass: only ``sf_offsets`` (called on the
first decode) traces the DSL.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from . import reference
from .attention import softmax_scale_or_default
from .backend import CacheTensors
from .formats import KVFormat
from .layouts import sm100
from .layouts.packing import F32_MAX, LN_2, LOG2_E
from .layouts.sm80 import TAIL_UNIT, tiles_per_split

__all__ = ["NVFP4_MAX", "OPERAND_TOP", "OPERAND_TERMS", "emulate_cache", "split_tiles", "quantize_q_operand",
           "quantize_p_operand", "emulate_decode"]

NVFP4_MAX = sm100.NVFP4_MAX
OPERAND_TOP = sm100.OPERAND_TOP
OPERAND_TERMS = sm100.OPERAND_TERMS
FP32_MAX = F32_MAX
TILE_TOKENS = sm100.SF_ATOM_ROWS  # a packed tile: 128 tokens, one chunk of K's scale rows


# --------------------------------------------------------------------------------------
# Which tiles a split owns
# --------------------------------------------------------------------------------------


def split_tiles(seqlen: int, tile_tokens: int, split_idx: int, num_splits: int,
                tail_weight: int = TAIL_UNIT) -> Tuple[int, int, bool, int]:
    """(tile_begin, packed_end, has_residual, n_res): ``kernels_sm80.tensors.split_tiles``
    in Python integers, so every split count and tail weight (in sixteenths, ``TAIL_UNIT``;
    one unit or less: even) partition the tiles as the kernels do (the residual counts as
    tile ``n_full``, and a split past the last tile owns nothing)."""
    n_full, n_res = divmod(seqlen, tile_tokens)
    n_tiles = n_full + (n_res > 0)
    per_split = tiles_per_split(n_tiles, num_splits, tail_weight)
    tile_begin = split_idx * per_split
    tile_end = min(tile_begin + per_split, n_tiles)
    packed_end = min(tile_end, n_full)
    has_residual = n_res > 0 and tile_begin <= n_full < tile_end
    return tile_begin, packed_end, has_residual, n_res


# --------------------------------------------------------------------------------------
# The FP4 operands the kernel forms itself (Q and P)
# --------------------------------------------------------------------------------------


def _operand_scale(amax: torch.Tensor, fp4: str) -> torch.Tensor:
    """fp32 ``r = OPERAND_TOP / amax`` per row (one fp32 division), capped at fp32's largest
    finite value so that a row of tiny values (a bf16 subnormal query, a tile 120 log2
    units below the running max) never multiplies by infinity; 1 for a row of zeros."""
    r = (OPERAND_TOP[fp4] / amax.float()).clamp(max=FP32_MAX)
    return torch.where(amax > 0, r, torch.ones_like(r))


def _fp4_terms(x: torch.Tensor, r: torch.Tensor, fp4: str, terms: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """fp32 rows ``x [R, L]`` times ``r [R]`` (one fp32 multiply) as ``terms`` FP4 terms in
    blocks of ``SF_VEC`` along L -> (codes [terms, R, L], scale bytes [terms, R, L/V]).
    Term 0 quantizes ``y = x r`` by the cache's own rounding; term ``t + 1`` quantizes the
    residual ``y - sum of the terms so far`` (one fp32 subtraction per term: a term's
    values ``e2m1 * scale`` are exact in fp32), with its own block scales."""
    y = x.float() * r[:, None]
    vec = sm100.SF_VEC[fp4]
    all_codes, all_sf = [], []
    for _ in range(terms):
        codes, sf = reference._quantize_fp4_blocks(y.reshape(y.shape[0], -1, vec), fp4)
        codes = codes.reshape(y.shape)
        all_codes.append(codes)
        all_sf.append(sf)
        y = y - reference.dequantize_fp4(codes, sf, fp4, torch.float32)
    return torch.stack(all_codes), torch.stack(all_sf)


def _terms(terms: Optional[int]) -> int:
    terms = OPERAND_TERMS if terms is None else terms
    if not isinstance(terms, int) or terms < 1:
        raise ValueError(f"terms must be a positive int, got {terms!r}")
    return terms


def quantize_q_operand(q_rows: torch.Tensor, fp4: str, terms: Optional[int] = None
                       ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A CTA's query rows ``[G, D]`` (16-bit) as the B operands of ``S = K Q^T`` -> (e2m1
    codes uint8 ``[T, G, D]``, scale bytes uint8 ``[T, G, D / SF_VEC]``, rg fp32 ``[G]``),
    ``T = terms`` (default ``OPERAND_TERMS``), with the terms' ``e2m1(code) * scale``
    summing to ``q * rg``, ``rg = OPERAND_TOP / max|q row|``."""
    qf = q_rows.float()
    rg = _operand_scale(qf.abs().amax(dim=-1), fp4)
    return (*_fp4_terms(qf, rg, fp4, _terms(terms)), rg)


def quantize_p_operand(p: torch.Tensor, pmax: torch.Tensor, fp4: str, terms: Optional[int] = None
                       ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A tile's probabilities ``p [G, T]`` fp32 (query heads x tokens, 0 where masked) as
    the B operands of ``O^T = V^T P^T`` -> (codes ``[terms, G, T]``, scale bytes ``[terms,
    G, T / SF_VEC]``, rp fp32 ``[G]``), blocks of SF_VEC consecutive tokens.  ``pmax [G]``:
    the tile's largest p, ``exp2(m_tile - m_new)``, which the kernel has without another
    reduction; ``rp = OPERAND_TOP / pmax`` (1 when the whole row is masked: codes 0)."""
    rp = _operand_scale(pmax, fp4)
    return (*_fp4_terms(p, rp, fp4, _terms(terms)), rp)


def _fp4_values(codes: torch.Tensor, sf: torch.Tensor, fp4: str) -> torch.Tensor:
    """``e2m1(code) * scale`` in float64 (exact): what the MMA multiplies."""
    return reference.dequantize_fp4(codes, sf, fp4, torch.float64)


def _q_operand(q_rows: torch.Tensor, fp4: str, terms: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(qhat float64 ``[G, D]``, rg ``[G]``): the Q terms' values summed (the MMAs of a
    tile's scores accumulate them) and the row scale."""
    codes, sf, rg = quantize_q_operand(q_rows, fp4, terms)
    return _fp4_values(codes, sf, fp4).sum(dim=0), rg


def _p_operand(p: torch.Tensor, pmax: torch.Tensor, fp4: str, terms: Optional[int] = None
               ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(phat * rp float64 ``[G, T]``, rp ``[G]``): the P terms' values summed and the row scale."""
    codes, sf, rp = quantize_p_operand(p, pmax, fp4, terms)
    return _fp4_values(codes, sf, fp4).sum(dim=0), rp


# --------------------------------------------------------------------------------------
# K and V tiles, from the bytes TMA copies
# --------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _scale_byte_offsets(fp4: str, rows: int, cols: int) -> torch.Tensor:
    """``[rows, cols / SF_VEC]`` byte of each scale in a tile's chunks: the DSL's own
    block-scaled layout (``sm100.sf_offsets``), so the emulation reads what tcgen05 reads.
    The layout is asked for the padded operand the chunks hold (whole 128-row chunks, whole
    4-scale columns: MXFP4 head dim 64 fills half a chunk's columns)."""
    vec, n_sf = sm100.SF_VEC[fp4], cols // sm100.SF_VEC[fp4]
    padded_rows = sm100.sf_row_chunks(rows) * sm100.SF_ATOM_ROWS
    padded_cols = sm100.sf_chunks(n_sf) * sm100.SF_ATOM_COLS * vec
    table = torch.tensor(sm100.sf_offsets(fp4, padded_rows, padded_cols), dtype=torch.long)
    return table[:rows, :n_sf]


def _tile_codes(words: torch.Tensor) -> torch.Tensor:
    """e2m1 codes ``[R, 8 W]`` of packed rows ``[R, W]`` int32 (natural order, low nibble first)."""
    return reference._words_to_fields(words, sm100.ELEM_BITS["e2m1"])


def _chunk_bytes(words: torch.Tensor) -> torch.Tensor:
    """A tile's scale chunks (int32 words, any shape) as the flat bytes in memory (little
    endian: byte ``i`` of a word holds bits ``8 i ..``)."""
    return reference._words_to_fields(words.reshape(1, -1), sm100.SF_BITS)[0]


def _fp4_tile(words: torch.Tensor, chunks: torch.Tensor, fp4: str) -> torch.Tensor:
    """Float64 values ``[R, L]`` of an FP4 operand tile: rows ``[R, L / 8]`` int32 and the
    tile's scale chunks (rows padded to whole 128-row chunks, as stored)."""
    codes = _tile_codes(words)
    rows, cols = words.shape[0], codes.shape[-1]
    offsets = _scale_byte_offsets(fp4, rows, cols)
    sf = _chunk_bytes(chunks)[offsets.to(words.device)]
    return _fp4_values(codes, sf, fp4)


@dataclass
class _HeadCache:
    """One (sequence, KV head)'s share of the cache tensors, tile by tile."""

    c: CacheTensors
    pages: torch.Tensor  # the sequence's block-table row
    b: int
    h: int

    @property
    def fp4(self) -> str:
        return self.c.fmt.fp4

    def _where(self, tile: int) -> Tuple[int, int]:
        """(page, tile slot within it) of packed tile ``tile``, as ``reference.gather_kv``
        pages the packed tokens."""
        per_page = self.c.page_size // TILE_TOKENS
        return int(self.pages[tile // per_page]), tile % per_page

    def k_tile(self, tile: int) -> torch.Tensor:
        """K ``[128 tokens, D]`` float64: rows = tokens, scales along the channels."""
        page, slot = self._where(tile)
        rows = self.c.k_pack[page, self.h, slot * TILE_TOKENS:(slot + 1) * TILE_TOKENS]
        return _fp4_tile(rows, self.c.k_params[page, self.h, slot], self.fp4)

    def v_tile(self, tile: int) -> torch.Tensor:
        """V ``[128 tokens, D]`` float64, read as stored: rows = channels, scales along the tokens."""
        page, slot = self._where(tile)
        return _fp4_tile(self.c.v_pack[page, self.h, slot], self.c.v_params[page, self.h, slot], self.fp4).T

    def residual(self, n: int) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.c.k_res[self.b, :n, self.h], self.c.v_res[self.b, :n, self.h]

    def sink_tokens(self, n: int) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.c.sinks[0][self.b, :n, self.h], self.c.sinks[1][self.b, :n, self.h]


# --------------------------------------------------------------------------------------
# Online softmax over one split's tiles
# --------------------------------------------------------------------------------------


@dataclass
class _Softmax:
    """Running max ``m`` (log2 units), row sum ``l`` and unnormalized output ``O`` of G rows."""

    m: torch.Tensor
    l: torch.Tensor
    o: torch.Tensor

    @classmethod
    def empty(cls, g: int, d: int, device: torch.device) -> "_Softmax":
        f32 = dict(dtype=torch.float32, device=device)
        return cls(torch.full((g,), -math.inf, **f32), torch.zeros(g, **f32), torch.zeros(g, d, **f32))

    def advance(self, s: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Scores ``s [G, T]`` -> (m_tile, m_new, alpha); ``m`` becomes m_new.  ``alpha`` is
        0 while the old max is -inf (no token yet), never ``exp2(-inf + inf)``."""
        m_tile = s.amax(dim=-1)
        m_new = torch.maximum(self.m, m_tile)
        alpha = torch.where(self.m == -math.inf, torch.zeros_like(m_new), torch.exp2(self.m - m_new))
        self.m = m_new
        return m_tile, m_new, alpha

    def accumulate(self, alpha: torch.Tensor, row_sum: torch.Tensor, pv: torch.Tensor) -> None:
        self.l = self.l * alpha + row_sum
        self.o = self.o * alpha[:, None] + pv

    def result(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(O / l ``[G, D]``, lse ``[G]`` natural log); a split that saw no token: 0, -inf."""
        seen = self.m > -math.inf
        o = torch.where(seen[:, None], self.o / self.l[:, None], torch.zeros_like(self.o))
        return o, torch.where(seen, (self.m + torch.log2(self.l)) * LN_2, self.m)


def _exp2_masked(s: torch.Tensor, m_new: torch.Tensor) -> torch.Tensor:
    """``exp2(s - m_new)`` with 0 where ``s`` is -inf (a masked token), even if m_new is -inf."""
    return torch.where(s == -math.inf, torch.zeros_like(s), torch.exp2(s - m_new[:, None]))


def _packed_tile(state: _Softmax, qhat: torch.Tensor, c: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 fp4: str, terms: int) -> None:
    """One 128-token FP4 tile: both products on FP4 operands, P quantized per tile."""
    s = (qhat @ k.T).float() * c[:, None]  # [G, 128]
    m_tile, m_new, alpha = state.advance(s)
    p = _exp2_masked(s, m_new)
    pmax = torch.where(m_tile == -math.inf, torch.zeros_like(m_tile), torch.exp2(m_tile - m_new))
    phat, rp = _p_operand(p, pmax, fp4, terms)
    inv_rp = 1.0 / rp  # fp32: the kernel multiplies by the one reciprocal per row
    row_sum = phat.sum(dim=-1).float() * inv_rp
    pv = (phat @ v).float() * inv_rp[:, None]
    state.accumulate(alpha, row_sum, pv)


def _sixteen_bit_tile(state: _Softmax, q_rows: torch.Tensor, scale_log2: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor) -> None:
    """Up to 128 16-bit tokens (sinks, residual): q as it is, P rounded to the cache dtype.
    Only the tile's real tokens are passed: the kernel's masked rows give p = 0."""
    s = (q_rows.double() @ k.double().T).float() * scale_log2
    _, m_new, alpha = state.advance(s)
    p16 = _exp2_masked(s, m_new).to(k.dtype)
    state.accumulate(alpha, p16.double().sum(dim=-1).float(), (p16.double() @ v.double()).float())


def _split(cache: _HeadCache, q_rows: torch.Tensor, qhat: torch.Tensor, c: torch.Tensor,
           scale_log2: torch.Tensor, n_sink: int, n_rest: int, split_idx: int, num_splits: int, terms: int
           ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Split ``split_idx``'s partial (O, lse): sinks (split 0), its packed tiles, the residual."""
    state = _Softmax.empty(*qhat.shape, qhat.device)
    tile_begin, packed_end, has_residual, n_res = split_tiles(n_rest, TILE_TOKENS, split_idx, num_splits)
    if split_idx == 0 and n_sink:
        _sixteen_bit_tile(state, q_rows, scale_log2, *cache.sink_tokens(n_sink))
    for tile in range(tile_begin, packed_end):
        _packed_tile(state, qhat, c, cache.k_tile(tile), cache.v_tile(tile), cache.fp4, terms)
    if has_residual:
        _sixteen_bit_tile(state, q_rows, scale_log2, *cache.residual(n_res))
    return state.result()


def _merge_splits(o: torch.Tensor, lse: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``o [S, G, D]``, ``lse [S, G]`` -> (out ``[G, D]``, lse ``[G]``), as
    ``kernels_sm80/combine.py``: weights ``exp2((lse_s - max) log2 e)`` (0 for a split that
    saw nothing), no tokens at all giving 0 and -inf."""
    m = lse.amax(dim=0)
    m_use = torch.where(m == -math.inf, torch.zeros_like(m), m)
    w = torch.exp2((lse - m_use) * LOG2_E)
    total = w.sum(dim=0)
    inv = torch.where(total == 0, torch.zeros_like(total), 1.0 / total)
    out = (w[..., None] * o).sum(dim=0) * inv[:, None]
    return out, torch.where(total > 0, m + torch.log2(total) * LN_2, torch.full_like(m, -math.inf))


# --------------------------------------------------------------------------------------
# The decode
# --------------------------------------------------------------------------------------


def emulate_decode(
    q: torch.Tensor,
    k_pack: torch.Tensor,
    k_params: torch.Tensor,
    v_pack: torch.Tensor,
    v_params: torch.Tensor,
    k_res: torch.Tensor,
    v_res: torch.Tensor,
    cache_seqlens: torch.Tensor,
    fmt: KVFormat,
    block_table: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    num_splits: int = 1,
    sinks: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
    terms: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The sm100 kernel's decode of one query token: q ``[B, 1, Hq, D]`` over an FP4 cache
    (arguments as ``bitdecode.reference.decode``) -> (out ``[B, 1, Hq, D]`` in q's dtype,
    lse ``[B, 1, Hq]`` fp32, natural log), ``num_splits`` partials merged; Q and P in
    ``terms`` FP4 terms each (default ``OPERAND_TERMS``, as the kernel)."""
    terms = _terms(terms)
    if not isinstance(fmt, KVFormat) or not fmt.fp4:
        raise ValueError(f"emulate_decode emulates the FP4 (nvfp4 / mxfp4) kernel, got fmt={fmt!r}")
    bsz, tq, hq, d = q.shape
    if tq != 1:
        raise ValueError(f"emulate_decode takes one query token per sequence, got q of shape {tuple(q.shape)}")
    hkv = k_res.shape[2]
    if hq % hkv or hq == 0:  # (else the rows past hkv * (hq // hkv) would be left unwritten)
        raise ValueError(f"q has {hq} heads, not a positive multiple of the cache's {hkv} KV heads")
    g = hq // hkv
    scale_log2 = softmax_scale_or_default(softmax_scale, d) * LOG2_E
    scale_log2 = torch.tensor(scale_log2, dtype=torch.float32, device=q.device)  # the kernel's fp32 argument
    if block_table is None:
        block_table = torch.arange(bsz, dtype=torch.int32).view(bsz, 1)
    tensors = CacheTensors(k_pack, k_params, v_pack, v_params, k_res, v_res, cache_seqlens, block_table, fmt,
                           sinks=sinks)
    out = torch.empty(bsz, 1, hq, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(bsz, 1, hq, dtype=torch.float32, device=q.device)
    for b, seqlen in enumerate(int(x) for x in cache_seqlens.tolist()):
        n_sink = min(seqlen, fmt.sink_tokens)
        for h in range(hkv):
            rows = slice(h * g, (h + 1) * g)
            cache = _HeadCache(tensors, block_table[b].cpu(), b, h)
            q_rows = q[b, 0, rows]
            qhat, rg = _q_operand(q_rows, fmt.fp4, terms)  # once per CTA (every split forms the same)
            c = scale_log2 / rg
            parts = [_split(cache, q_rows, qhat, c, scale_log2, n_sink, seqlen - n_sink, s, num_splits, terms)
                     for s in range(num_splits)]
            o, l = _merge_splits(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
            out[b, 0, rows] = o.to(q.dtype)
            lse[b, 0, rows] = l
    return out, lse


def emulate_cache(q: torch.Tensor, cache, num_splits: int = 0, terms: Optional[int] = None
                  ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``emulate_decode`` over a ``KVCache``'s tensors, with ``bd.decode``'s ``num_splits``
    (0, the split heuristic's choice, is emulated as one split: splits change only the
    rounding, ``tests/test_sm100_emulation.py``)."""
    t = cache.tensors()
    return emulate_decode(q, t.k_pack, t.k_params, t.v_pack, t.v_params, t.k_res, t.v_res, t.cache_seqlens, t.fmt,
                          t.block_table, num_splits=max(num_splits, 1), sinks=t.sinks, terms=terms)
