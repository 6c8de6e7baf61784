"""The maths every kernel is tested against, in plain torch (CPU or GPU).

Quantization (per group, asymmetric, computed in fp32 exactly as the kernels do):

    mn, mx  = min(x), max(x) over the group               (exact: 16-bit inputs)
    scale   = to16_rz((mx - mn) * fp32(1 / (2^bits - 1))) (one fp32 multiply, then round
                                                           toward zero, cvt.rz)
    zero    = to16(mn)                                     (exact)
    q       = clamp(rint((x - zero) * fp32(1 / scale)), 0, 2^bits - 1)   (0 where scale == 0)
    x_hat   = to16(q * scale + zero)                       (one rounding: an fma)

``rint`` rounds half to even.  Rounding the scale toward zero keeps
``zero + (2^bits - 1) * scale <= max``, so the largest code never dequantizes past the
group's range (an fp16 group spanning +-65504 would otherwise give inf).  A group whose
values are all equal gets scale 0 and dequantizes to exactly ``zero``, never NaN.

Non-finite inputs: ``quantize`` raises ``ValueError`` when ``check_finite`` is on (the
default).  Off (what the caches do, on every backend, since a check would need a device
sync), a group whose range ``mx - mn`` is not finite (a NaN or an infinity inside) gets
the 16-bit NaN as scale and zero and code 0, exactly as the kernels pack it: every value
of the group dequantizes to NaN, and attention over it gives NaN in the outputs it feeds.

FP4 formats (``KVFormat.fp4``, the rounding stated there): ``quantize_fp4`` /
``dequantize_fp4``; codes in natural order, eight per 32-bit word (value ``8 j + i`` of a
row in bits ``4 i .. 4 i + 3`` of word ``j``: two per byte, the lower index in the low
nibble), K rows = tokens, V rows = channels of a 128-token tile; the scale bytes in the
basic chunks of ``layouts.sm100`` (``sf_chunk_word``), so Blackwell's block-scaled MMA
reads both as they are.

Packing into 32-bit words and the order of params follow ``bitdecode.layouts.sm80``
(the single definition the kernels use).  Attention is computed in fp32 over the
dequantized 16-bit cache plus the 16-bit residual, with grouped-query heads, per-sequence
lengths and an optional block table.  A sequence of length 0 gives zeros and LSE = -inf.
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Tuple

import torch

from . import _validate
from .formats import KVFormat
from .layouts import packing, sm80, sm100

__all__ = [
    "quantize",
    "dequantize",
    "quantize_fp4",
    "dequantize_fp4",
    "pack_rows",
    "unpack_rows",
    "pack_params",
    "unpack_params",
    "pack_k",
    "pack_v",
    "unpack_k",
    "unpack_v",
    "gather_kv",
    "attention",
    "decode",
]


# --------------------------------------------------------------------------------------
# Quantization
# --------------------------------------------------------------------------------------


inv_qmax = packing.inv_qmax  # fp32(1 / (2^bits - 1)), shared with the kernels


@functools.lru_cache(maxsize=None)
def _hadamard(d: int, device: str) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < d:  # Sylvester's construction: d is a power of two (HEAD_DIMS)
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(d)).to(device)


def rotate(x: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """``x [..., D]`` times the normalized Walsh-Hadamard matrix ``H`` of ``D`` (in fp32,
    rounded once to x's dtype) when ``fmt.hadamard``, else ``x`` itself.  ``H`` is
    symmetric and orthogonal, so the same call undoes it (``KVFormat.hadamard``).  A
    rotated value can be up to sqrt(D) times the row's largest: past the dtype's largest
    finite value it saturates there (fp16 K of ~6000 in every channel of a token, D = 128),
    where rounding would make it infinite and its quantization group NaN; a NaN or an
    infinity in ``x`` stays non-finite."""
    if not fmt.hadamard:
        return x
    y = x.float() @ _hadamard(x.shape[-1], str(x.device))
    if x.dtype in (torch.float16, torch.bfloat16):
        top = torch.finfo(x.dtype).max
        y = torch.where(y.isfinite(), y.clamp(-top, top), y)
    return y.to(x.dtype)


def quantize(
    x: torch.Tensor, bits: int, group_size: int, dim: int = -1, check_finite: bool = True, *, name: str = "x"
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``x`` in groups of ``group_size`` along ``dim``.

    Returns ``codes`` (uint8, shape of x), ``scale`` and ``zero`` (x.dtype, with ``dim``
    shrunk by ``group_size``).  ``name``: what errors call ``x`` (``pack_k``'s "k").
    """
    _validate.tensor(name, x, dtypes=_validate.FLOAT16_DTYPES)
    _validate.positive_int("group_size", group_size)
    _check_bits(bits)
    dim = _validate.axis("dim", dim, name, x)
    if x.shape[dim] % group_size:
        raise ValueError(
            f"{name} has {x.shape[dim]} values along dim {dim}, not a multiple of group_size={group_size}"
        )
    if check_finite:
        _validate.finite(name, x)
    xs = x.movedim(dim, -1)
    grouped = xs.float().reshape(*xs.shape[:-1], xs.shape[-1] // group_size, group_size)
    mn = grouped.amin(dim=-1)
    mx = grouped.amax(dim=-1)
    scale32 = (mx - mn) * inv_qmax(bits)
    scale = scale32.to(x.dtype)
    below = (scale.view(torch.int16) - 1).view(x.dtype)  # next 16-bit value toward 0 (scale > 0)
    scale = torch.where(scale.float() > scale32, below, scale)
    zero = mn.to(x.dtype)
    bad = ~((mx - mn) < math.inf)  # a NaN or an infinity in the group
    nan = torch.full_like(scale, math.nan)
    scale, zero = torch.where(bad, nan, scale), torch.where(bad, nan, zero)
    s32 = scale.float()
    inv = torch.where(s32 > 0, torch.reciprocal(s32), torch.zeros_like(s32))
    q = ((grouped - zero.float()[..., None]) * inv[..., None]).round()
    q = q.nan_to_num(0.0).clamp(0, (1 << bits) - 1).to(torch.uint8)
    codes = q.reshape(xs.shape).movedim(-1, dim)
    return codes, scale.movedim(-1, dim), zero.movedim(-1, dim)


def dequantize(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int, dim: int = -1,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """``to16(q * scale + zero)`` with a single rounding, in the dtype of ``scale`` (or
    ``out_dtype``: float32 keeps it exact)."""
    _validate.tensor("codes", codes, dtypes=(torch.uint8,))
    for name, t in (("scale", scale), ("zero", zero)):
        _validate.tensor(name, t)
        if not t.is_floating_point():
            raise TypeError(f"{name} must have a floating-point dtype, got {t.dtype}")
    _validate.positive_int("group_size", group_size)
    dim = _validate.axis("dim", dim, "codes", codes)
    want = (*codes.shape[:dim], codes.shape[dim] // group_size, *codes.shape[dim + 1:])
    if codes.shape[dim] % group_size or scale.shape != want or zero.shape != scale.shape:
        raise ValueError(f"scale and zero must have shape {want} (codes {tuple(codes.shape)} in groups of "
                         f"{group_size} along dim {dim}), got {tuple(scale.shape)} and {tuple(zero.shape)}")
    s = scale.double().repeat_interleave(group_size, dim=dim)
    z = zero.double().repeat_interleave(group_size, dim=dim)
    return (codes.double() * s + z).to(out_dtype or scale.dtype)


# --------------------------------------------------------------------------------------
# FP4 (NVFP4 / MXFP4)
# --------------------------------------------------------------------------------------


def _e2m1_rne(y: torch.Tensor) -> torch.Tensor:
    """e2m1 codes of fp32 ``y``: magnitude rounded half to even onto the e2m1 grid,
    saturating at 6, the sign bit from ``y`` (NaN gives code 0)."""
    a = y.abs().nan_to_num(0.0, posinf=sm100.E2M1_MAX)
    mag = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for mid, up in zip(sm100.E2M1_MIDPOINTS, sm100.E2M1_TIE_UP):
        mag += (a >= mid if up else a > mid).to(torch.uint8)
    return mag | (torch.signbit(y) & ~y.isnan()).to(torch.uint8) << 3


@functools.lru_cache(maxsize=None)
def _e2m1_table(device: str) -> torch.Tensor:
    return torch.tensor(sm100.E2M1_VALUES, dtype=torch.float64, device=device)


def _scale_values(sf: torch.Tensor, fp4: str) -> torch.Tensor:
    """fp64 values of scale bytes (uint8)."""
    if fp4 == "nvfp4":
        return sf.view(torch.float8_e4m3fn).double()
    e = sf.double() - sm100.UE8M0_BIAS
    return torch.where(sf == sm100.UE8M0_NAN, torch.full_like(e, math.nan), torch.exp2(e))


def quantize_fp4(x: torch.Tensor, fp4: str, dim: int = -1, check_finite: bool = True
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x`` in blocks of ``SF_VEC[fp4]`` along ``dim`` -> (codes uint8 e2m1, shape of x;
    scale bytes uint8, ``dim`` shrunk by the block): ``KVFormat.fp4``'s rounding."""
    _validate.tensor("x", x, dtypes=_validate.FLOAT16_DTYPES)
    if fp4 not in sm100.FP4_FORMATS:
        raise ValueError(f"fp4 must be one of {sm100.FP4_FORMATS}, got {fp4!r}")
    vec = sm100.SF_VEC[fp4]
    dim = _validate.axis("dim", dim, "x", x)
    if x.shape[dim] % vec:
        raise ValueError(f"x has {x.shape[dim]} values along dim {dim}, not a multiple of {fp4}'s block of {vec}")
    if check_finite:
        _validate.finite("x", x)
    xs = x.movedim(dim, -1)
    blocks = xs.float().reshape(*xs.shape[:-1], xs.shape[-1] // vec, vec)
    codes, sf = _quantize_fp4_blocks(blocks, fp4)
    return codes.reshape(xs.shape).movedim(-1, dim), sf.movedim(-1, dim)


def _quantize_fp4_blocks(blocks: torch.Tensor, fp4: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """The rounding of ``quantize_fp4`` on fp32 ``blocks [..., n, SF_VEC]`` (unchecked) ->
    (codes uint8 ``[..., n, SF_VEC]``, scale bytes uint8 ``[..., n]``).  Apart from the
    validating wrapper because the sm100 kernel's emulation quantizes fp32 operands
    (``bitdecode.emulate_sm100``: Q and P times their fp32 scales) by the same rule."""
    amax = blocks.abs().amax(dim=-1)
    bad = ~(amax < math.inf)  # a NaN or an infinity in the block
    if fp4 == "nvfp4":
        s8 = (amax / sm100.E2M1_MAX).clamp(sm100.UE4M3_MIN, sm100.UE4M3_MAX).to(torch.float8_e4m3fn)
        sf = s8.view(torch.uint8)
    else:  # OCP MX: the shared exponent is floor(log2 amax) minus e2m1's largest exponent
        # floor(log2 amax) exactly, from the binary exponent (log2 itself is inexact on some
        # devices at powers of two); an all-zero block takes the smallest scale
        _, e2 = torch.frexp(amax)  # amax = m * 2^e2, m in [0.5, 1)
        e = torch.where(amax > 0, e2.double() - 1 - sm100.E2M1_EMAX, -sm100.UE8M0_BIAS)
        e = e.clamp(-sm100.UE8M0_BIAS, sm100.UE8M0_BIAS)
        sf = (e + sm100.UE8M0_BIAS).to(torch.uint8)
    sf = torch.where(bad, sm100.SCALE_NAN[fp4], sf.to(torch.int32)).to(torch.uint8)
    scale = _scale_values(sf, fp4)
    codes = _e2m1_rne(blocks.double() / scale[..., None])  # exact: no rounding before the grid's
    codes = torch.where(bad[..., None], 0, codes.to(torch.int32)).to(torch.uint8)
    return codes, sf


def dequantize_fp4(codes: torch.Tensor, sf: torch.Tensor, fp4: str, dtype: torch.dtype, dim: int = -1
                   ) -> torch.Tensor:
    """``to16(e2m1(code) * scale)`` (exact before the one rounding), in ``dtype``."""
    dim = dim % codes.dim()
    scale = _scale_values(sf, fp4).repeat_interleave(sm100.SF_VEC[fp4], dim=dim)
    return (_e2m1_table(str(codes.device))[codes.long()] * scale).to(dtype)


def _fields_to_words(fields: torch.Tensor, width: int) -> torch.Tensor:
    """Unsigned ``width``-bit fields ``[..., L]`` -> int32 words ``[..., L * width / 32]``,
    field ``i`` of each run of ``32 / width`` in bits ``width * i ..`` (natural order)."""
    per = packing.WORD_BITS // width
    f = fields.long().reshape(*fields.shape[:-1], fields.shape[-1] // per, per)
    return _to_int32((f << torch.arange(0, packing.WORD_BITS, width, device=fields.device)).sum(dim=-1))


def _words_to_fields(words: torch.Tensor, width: int) -> torch.Tensor:
    """Inverse of ``_fields_to_words`` (uint8 fields)."""
    shifts = torch.arange(0, packing.WORD_BITS, width, device=words.device)
    f = ((words.long() & 0xFFFFFFFF)[..., None] >> shifts) & ((1 << width) - 1)
    return f.reshape(*words.shape[:-1], words.shape[-1] * len(shifts)).to(torch.uint8)


@functools.lru_cache(maxsize=None)
def _chunk_rows(device: str) -> torch.Tensor:
    """Row of a basic chunk held by each of its words (``sf_chunk_word`` inverted)."""
    inv = [0] * sm100.SF_CHUNK_WORDS
    for r in range(sm100.SF_ATOM_ROWS):
        inv[sm100.sf_chunk_word(r)] = r
    return torch.tensor(inv, dtype=torch.long, device=device)


def _sf_to_chunks(sf: torch.Tensor) -> torch.Tensor:
    """Scale bytes ``[..., R, C]`` (R rows, C scale columns) -> basic chunks ``[...,
    ceil(R/128), ceil(C/4), 128]`` int32 (rows and columns past R, C zero)."""
    rows, cols = sf.shape[-2:]
    rc, cc = sm100.sf_row_chunks(rows), sm100.sf_chunks(cols)
    pad = torch.zeros(*sf.shape[:-2], rc * sm100.SF_ATOM_ROWS, cc * sm100.SF_ATOM_COLS, dtype=torch.long,
                      device=sf.device)
    pad[..., :rows, :cols] = sf.long()
    b = pad.reshape(*sf.shape[:-2], rc, sm100.SF_ATOM_ROWS, cc, sm100.SF_ATOM_COLS).transpose(-3, -2)
    words = _fields_to_words(b, sm100.SF_BITS)[..., 0]  # a row's four scale bytes in one word: [..., rc, cc, 128 rows]
    return words[..., _chunk_rows(str(sf.device))]


def _chunks_to_sf(words: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of ``_sf_to_chunks``: ``[..., rc, cc, 128]`` -> bytes ``[..., rows, cols]``."""
    by_row = torch.empty_like(words)
    by_row[..., _chunk_rows(str(words.device))] = words
    b = _words_to_fields(by_row[..., None], sm100.SF_BITS)  # [..., rc, cc, 128 rows, 4 bytes]
    rc, cc = b.shape[-4], b.shape[-3]
    b = b.transpose(-3, -2).reshape(*b.shape[:-4], rc * sm100.SF_ATOM_ROWS, cc * sm100.SF_ATOM_COLS)
    return b[..., :rows, :cols].to(torch.uint8)


def _pack_fp4_rows(x: torch.Tensor, fmt: KVFormat, check_finite: bool):
    """Tiles ``[..., R, L]`` (rows, values along the contraction) -> (words ``[..., R, L/8]``,
    scale chunks ``[..., ceil(R/128), ceil(L/G/4), 128]``)."""
    codes, sf = quantize_fp4(x, fmt.fp4, dim=-1, check_finite=check_finite)
    return _fields_to_words(codes, sm100.ELEM_BITS["e2m1"]), _sf_to_chunks(sf)


def _unpack_fp4_rows(words: torch.Tensor, chunks: torch.Tensor, rows: int, fmt: KVFormat, dtype: torch.dtype):
    codes = _words_to_fields(words, sm100.ELEM_BITS["e2m1"])
    sf = _chunks_to_sf(chunks, rows, codes.shape[-1] // fmt.group_size)
    return dequantize_fp4(codes, sf, fmt.fp4, dtype)


# --------------------------------------------------------------------------------------
# Words and params
# --------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _row_tables(bits: int, length: int, device: str):
    table = sm80.packed_row_map(bits, length)
    word = torch.tensor([w for w, _ in table], dtype=torch.long, device=device)
    shift = torch.tensor([s for _, s in table], dtype=torch.long, device=device)
    return word, shift


def _to_int32(words64: torch.Tensor) -> torch.Tensor:
    return torch.where(words64 >= 2**31, words64 - 2**32, words64).to(torch.int32)


def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``[..., L]`` (uint8, each below ``2**bits``) -> packed rows ``[..., L*bits/32]``
    (int32).  Checks the codes' range (on a GPU, one sync)."""
    _validate.tensor("codes", codes, dtypes=(torch.uint8,))
    _check_bits(bits)
    if codes.dim() == 0:
        raise ValueError("codes must have at least one dimension, got a 0-dim tensor")
    if codes.numel() and int(codes.max()) >> bits:
        raise ValueError(f"codes must lie in [0, {(1 << bits) - 1}] for bits={bits}, got {int(codes.max())}")
    return _pack_rows(codes, bits)


def _check_bits(bits) -> None:
    _validate.integer("bits", bits)
    if bits not in packing.SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {packing.SUPPORTED_BITS}, got {bits!r}")


def _pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``pack_rows`` unchecked (codes that ``quantize`` made)."""
    length = codes.shape[-1]
    n_words = sm80.words_per_row(bits, length)
    word, shift = _row_tables(bits, length, str(codes.device))
    vals = codes.long() << shift
    out = torch.zeros(*codes.shape[:-1], n_words, dtype=torch.long, device=codes.device)
    out.scatter_add_(-1, word.expand_as(vals), vals)  # fields never overlap: add == or
    return _to_int32(out)


def unpack_rows(words: torch.Tensor, bits: int, length: int) -> torch.Tensor:
    """Inverse of ``pack_rows``."""
    word, shift = _row_tables(bits, length, str(words.device))
    w = words.long() & 0xFFFFFFFF
    return ((w[..., word] >> shift) & ((1 << bits) - 1)).to(torch.uint8)


def pack_params(scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """(scale, zero) -> one int32 word: scale in the low 16 bits, zero in the high."""
    _validate.tensor("scale", scale, dtypes=_validate.FLOAT16_DTYPES)
    _validate.tensor("zero", zero, dtypes=(scale.dtype,), shape=scale.shape)
    s = scale.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    z = zero.contiguous().view(torch.int16).to(torch.int32)
    return (s << packing.PARAM_SCALE_SHIFT) | (z << packing.PARAM_ZERO_SHIFT)


def unpack_params(words: torch.Tensor, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    lo = ((words >> packing.PARAM_SCALE_SHIFT) & 0xFFFF).to(torch.int32)
    lo = torch.where(lo >= 2**15, lo - 2**16, lo).to(torch.int16)
    hi = (words >> packing.PARAM_ZERO_SHIFT).to(torch.int16)
    return lo.view(dtype), hi.view(dtype)


@functools.lru_cache(maxsize=None)
def _order(length: int, device: str) -> torch.Tensor:
    return torch.tensor(sm80.fragment_order(length), dtype=torch.long, device=device)


def _to_fragment_order(t: torch.Tensor, dim: int) -> torch.Tensor:
    return t.index_select(dim, _order(t.shape[dim], str(t.device)))


def _from_fragment_order(t: torch.Tensor, dim: int) -> torch.Tensor:
    inv = torch.argsort(_order(t.shape[dim], str(t.device)))
    return t.index_select(dim, inv)


# --------------------------------------------------------------------------------------
# K and V blocks
# --------------------------------------------------------------------------------------


def _check_fmt(fmt) -> None:
    if not isinstance(fmt, KVFormat):
        raise TypeError(f"fmt must be a bitdecode.KVFormat, got {type(fmt).__name__}")


def pack_k(k: torch.Tensor, fmt: KVFormat, check_finite: bool = True):
    """K ``[..., N, D]`` -> (k_pack ``[..., N, D*bits/32]``, k_params).

    k_params: channel mode ``[..., N/G, D]`` (fragment order along D);
    token mode ``[..., N, D/G]``.
    """
    _check_fmt(fmt)
    _check_tokens("k", k)
    if fmt.fp4:  # per 128-token tile: rows = tokens, scales along the channels
        nr = sm100.SF_ATOM_ROWS
        if k.shape[-2] % nr:
            raise ValueError(f"k must hold a multiple of {nr} tokens (dim -2) for {fmt.fp4}, got shape "
                             f"{tuple(k.shape)}")
        tiles = k.reshape(*k.shape[:-2], k.shape[-2] // nr, nr, k.shape[-1])
        words, chunks = _pack_fp4_rows(tiles, fmt, check_finite)
        return words.reshape(*k.shape[:-1], -1), chunks.squeeze(-3)  # a tile is one chunk of rows
    if fmt.k_mode == "channel":
        codes, scale, zero = quantize(k, fmt.bits, fmt.group_size, dim=-2, check_finite=check_finite, name="k")
        params = _to_fragment_order(pack_params(scale, zero), dim=-1)
    else:
        codes, scale, zero = quantize(k, fmt.bits, fmt.group_size, dim=-1, check_finite=check_finite, name="k")
        params = pack_params(scale, zero)
    return _pack_rows(codes, fmt.bits), params


def _check_tokens(name: str, t) -> None:
    """K or V ``[..., N, D]`` as ``pack_k`` / ``pack_v`` take it."""
    _validate.tensor(name, t, dtypes=_validate.FLOAT16_DTYPES)
    if t.dim() < 2:
        raise ValueError(f"{name} must have shape [..., N, D] (at least 2 dims), got {tuple(t.shape)}")


def unpack_k(k_pack: torch.Tensor, k_params: torch.Tensor, fmt: KVFormat, dtype: torch.dtype,
             out_dtype: Optional[torch.dtype] = None):
    """Dequantized K of packed pages; ``dtype`` is the model's (the params' words), the
    values rounded once to ``out_dtype`` (default ``dtype``)."""
    _check_unpack("k_pack", k_pack, 2, fmt, dtype)
    head_dim = k_pack.shape[-1] * 32 // fmt.bits
    if fmt.fp4:
        nr = sm100.SF_ATOM_ROWS
        tiles = k_pack.reshape(*k_pack.shape[:-2], k_pack.shape[-2] // nr, nr, k_pack.shape[-1])
        return _unpack_fp4_rows(tiles, k_params.unsqueeze(-3), nr, fmt,
                                out_dtype or dtype).reshape(*k_pack.shape[:-1], head_dim)
    n = k_pack.shape[-2]  # (KVFormat's storage shapes, as one page of n tokens)
    _check_params("k_params", k_params, (*k_pack.shape[:-2], *fmt.k_params_shape(1, 1, n, head_dim)[2:]), "k_pack",
                  k_pack, fmt, n % fmt.group_size == 0 or fmt.k_mode != "channel")
    codes = unpack_rows(k_pack, fmt.bits, head_dim)
    if fmt.k_mode == "channel":
        scale, zero = unpack_params(_from_fragment_order(k_params, dim=-1), dtype)
        return dequantize(codes, scale, zero, fmt.group_size, dim=-2, out_dtype=out_dtype)
    scale, zero = unpack_params(k_params, dtype)
    return dequantize(codes, scale, zero, fmt.group_size, dim=-1, out_dtype=out_dtype)


def _check_unpack(name: str, pack, dims: int, fmt, dtype) -> None:
    """``unpack_k`` / ``unpack_v``'s packed words, format and dtype."""
    _check_fmt(fmt)
    _validate.tensor(name, pack, dtypes=(torch.int32,))
    if pack.dim() < dims:
        raise ValueError(f"{name} must have at least {dims} dims, got shape {tuple(pack.shape)}")
    _validate.model_dtype("dtype", dtype)


def _check_params(name: str, params, want, pack_name: str, pack, fmt, fits: bool = True) -> None:
    """Integer formats' params words: int32 of shape ``want`` (what ``pack``, packed in
    ``fmt``, needs; ``fits``: ``pack``'s own shape agrees with ``fmt``)."""
    _validate.tensor(name, params, dtypes=(torch.int32,))
    if not fits or tuple(params.shape) != tuple(want):
        raise ValueError(f"{name} {tuple(params.shape)} and {pack_name} {tuple(pack.shape)} are not one packing of "
                         f"{fmt} (for that {pack_name}, {name} would be {tuple(want)})")


def pack_v(v: torch.Tensor, fmt: KVFormat, check_finite: bool = True):
    """V ``[..., N, D]`` (N a multiple of ``fmt.v_tile``) -> (v_pack ``[..., N/Nv, D,
    Nv*v_bits/32]``, v_params ``[..., N/16, D/G, 16]`` with tokens in fragment order)."""
    _check_fmt(fmt)
    _check_tokens("v", v)
    nr, n = fmt.v_tile, v.shape[-2]
    if n % nr:
        raise ValueError(f"V blocks are packed {nr} tokens at a time, got {n} tokens")
    lead = v.shape[:-2]
    if fmt.fp4:  # V^T per tile: rows = channels, scales along the tokens
        return _pack_fp4_rows(v.reshape(*lead, n // nr, nr, v.shape[-1]).transpose(-1, -2), fmt, check_finite)
    codes, scale, zero = quantize(v, fmt.v_bits, fmt.group_size, dim=-1, check_finite=check_finite, name="v")
    blocks = codes.reshape(*lead, n // nr, nr, v.shape[-1]).transpose(-1, -2)
    v_pack = _pack_rows(blocks, fmt.v_bits)
    words = pack_params(scale, zero)  # [..., N, D/G]
    k = sm80.MMA_SHAPE[2]
    words = words.reshape(*lead, n // k, k, words.shape[-1])
    v_params = _to_fragment_order(words, dim=-2).transpose(-1, -2).contiguous()
    return v_pack, v_params


def unpack_v(v_pack: torch.Tensor, v_params: torch.Tensor, fmt: KVFormat, dtype: torch.dtype):
    """Dequantized V ``[..., N, D]`` of ``pack_v``'s pages, in ``dtype`` (the model's)."""
    _check_unpack("v_pack", v_pack, 3, fmt, dtype)
    nr = fmt.v_tile
    if fmt.fp4:
        v = _unpack_fp4_rows(v_pack, v_params, v_pack.shape[-2], fmt, dtype).transpose(-1, -2)  # [..., tiles, Nv, D]
        return v.reshape(*v.shape[:-3], -1, v.shape[-1])
    n, d = v_pack.shape[-3] * nr, v_pack.shape[-2]  # (KVFormat's storage shapes, as one page of n tokens)
    _check_params("v_params", v_params, (*v_pack.shape[:-3], *fmt.v_params_shape(1, 1, n, d)[2:]), "v_pack", v_pack,
                  fmt, tuple(v_pack.shape[-3:]) == fmt.v_pack_shape(1, 1, n, d)[2:])
    codes = unpack_rows(v_pack, fmt.v_bits, nr).transpose(-1, -2)  # [..., blocks, Nv, D]
    lead = codes.shape[:-3]
    codes = codes.reshape(*lead, -1, codes.shape[-1])
    words = _from_fragment_order(v_params.transpose(-1, -2), dim=-2)  # [..., N/16, 16, D/G]
    words = words.reshape(*lead, -1, words.shape[-1])
    scale, zero = unpack_params(words, dtype)
    return dequantize(codes, scale, zero, fmt.group_size, dim=-1)


# --------------------------------------------------------------------------------------
# Cache-level maths
# --------------------------------------------------------------------------------------


def gather_kv(
    b: int,
    length: int,
    k_pack: torch.Tensor,
    k_params: torch.Tensor,
    v_pack: torch.Tensor,
    v_params: torch.Tensor,
    k_res: torch.Tensor,
    v_res: torch.Tensor,
    block_table: torch.Tensor,
    fmt: KVFormat,
    sinks: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
    k_dtype: Optional[torch.dtype] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Dequantized K, V ``[length, Hkv, D]`` of sequence ``b``: its 16-bit sink tokens
    (``sinks`` = (k_sink, v_sink) ``[B, S, Hkv, D]``, the first ``fmt.sink_tokens``), then
    the packed part, then the residual.  K in ``k_dtype`` where given (float32: the packed
    part's exact values, as a kernel that puts K's scale in Q multiplies them)."""
    nr = fmt.residual_block
    dtype = k_res.dtype
    k_dtype = k_dtype or dtype
    page = k_pack.shape[2]
    ks, vs = [], []
    if fmt.sink_tokens:
        s = min(length, fmt.sink_tokens)
        ks.append(sinks[0][b, :s].to(k_dtype))
        vs.append(sinks[1][b, :s])
        length -= s
    n_packed = length // nr * nr
    if n_packed:
        n_pages = -(-n_packed // page)
        pages = block_table[b, :n_pages].long().to(k_pack.device)
        k = unpack_k(k_pack[pages], k_params[pages], fmt, dtype, k_dtype)  # [p, H, page, D]
        v = unpack_v(v_pack[pages], v_params[pages], fmt, dtype)
        k = k.transpose(0, 1).reshape(k.shape[1], -1, k.shape[-1])[:, :n_packed]
        v = v.transpose(0, 1).reshape(v.shape[1], -1, v.shape[-1])[:, :n_packed]
        ks.append(k.transpose(0, 1))
        vs.append(v.transpose(0, 1))
    r = length - n_packed
    ks.append(k_res[b, :r].to(k_dtype))
    vs.append(v_res[b, :r])
    return torch.cat(ks), torch.cat(vs)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: Optional[float] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """One sequence: q ``[Hq, D]``, k/v ``[L, Hkv, D]`` -> (out ``[Hq, D]`` fp32, lse ``[Hq]``).

    The sums run in float64, rounded to fp32 once: callers compare two reference decodes
    of equal values bit for bit (a paged cache against a dense one), and with fp32 sums
    through BLAS such a pair came out one fp16 ulp apart in 2 of ~16 runs on a loaded
    2-core host (profiles/NOTES.md); a float64 sum's run-to-run wobble is far below an fp32
    rounding step."""
    hq, d = q.shape
    hkv = k.shape[1]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    if k.shape[0] == 0:
        return q.new_zeros(hq, d, dtype=torch.float32), q.new_full((hq,), -math.inf, dtype=torch.float32)
    qg = q.double().view(hkv, hq // hkv, d)
    s = torch.einsum("hgd,lhd->hgl", qg, k.double()) * scale
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])
    out = torch.einsum("hgl,lhd->hgd", p, v.double())
    return out.reshape(hq, d).float(), lse.reshape(hq).float()


def decode(
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
    return_lse: bool = False,
    sinks: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
):
    """Decode attention over a packed cache: q ``[B, T, Hq, D]`` -> out ``[B, T, Hq, D]``.

    Arguments as in ``bitdecode.decode_attention`` (no validation here); ``sinks`` the
    16-bit sink tokens of a format with ``sink_tokens``.  With ``T`` > 1 the queries are
    the sequence's newest ``T`` tokens (already in the cache), causal: query ``j`` attends
    to the first ``len - T + 1 + j`` tokens.
    """
    bsz, tq, hq, d = q.shape
    if block_table is None:
        block_table = torch.arange(bsz, dtype=torch.int32).view(bsz, 1)
    lengths = [int(x) for x in cache_seqlens.tolist()]
    outs, lses = [], []
    for b in range(bsz):
        k, v = gather_kv(b, lengths[b], k_pack, k_params, v_pack, v_params, k_res, v_res, block_table, fmt, sinks)
        for j in range(tq):
            seen = max(0, lengths[b] - tq + 1 + j)
            o, lse = attention(q[b, j], k[:seen], v[:seen], softmax_scale)
            outs.append(o)
            lses.append(lse)
    out = torch.stack(outs).to(q.dtype).view(bsz, tq, hq, d)
    if return_lse:
        return out, torch.stack(lses).view(bsz, tq, hq)
    return out


def rounded_p_attention(q: torch.Tensor, cache, scale: float, exact_k: bool = False) -> torch.Tensor:
    """Attention over a cache's dequantized K/V (``cache.lengths``, ``cache.dequantized(b)``:
    a ``KVCache``) with P rounded to the model dtype, as the tensor cores consume it, fp32
    otherwise; ``q`` ``[B, T, Hq, D]``, query ``j`` of ``T`` over the first ``len - T + 1 +
    j`` tokens.  What a same-precision computation of the kernels' maths gets.  K rounded to
    the model dtype once dequantized, or with ``exact_k`` its exact values (what a kernel that
    puts K's scale in Q multiplies: the codes, exact in 16 bits)."""
    outs = []
    tq, hq, d = q.shape[1:]
    for b, length in enumerate(cache.lengths):
        kd, vd = cache.dequantized(b, torch.float32 if exact_k else None)
        hkv = kd.shape[1]
        for j in range(tq):
            seen = max(0, length - tq + 1 + j)
            if seen == 0:
                outs.append(torch.zeros(hq, d, device=q.device))
                continue
            qg = q[b, j].float().view(hkv, hq // hkv, d)
            s = torch.einsum("hgd,lhd->hgl", qg, kd[:seen].float()) * scale
            p = torch.softmax(s, dim=-1)
            o = torch.einsum("hgl,lhd->hgd", p.to(q.dtype).float(), vd[:seen].float())
            outs.append(o.reshape(hq, d))
    return torch.stack(outs).view(q.shape)


def kernel_tolerance(q: torch.Tensor, cache, ref: torch.Tensor, factor: float = 2.0) -> float:
    """The tolerance a kernel's decode of ``q`` over ``cache`` is held to against the fp32
    reference ``ref`` (``decode_tolerance``): against the larger error of the two
    same-precision computations a kernel may make, K dequantized and rounded to the model
    dtype (as the reference), or K's exact values (K's scale in Q: the reference's rounding
    of K is then an error the kernel does not make, up to 2^-9 of each K element in bf16)."""
    scale = q.shape[-1] ** -0.5
    return max(decode_tolerance(rounded_p_attention(q, cache, scale, exact), ref, factor) for exact in (False, True))


def decode_tolerance(rounded: torch.Tensor, ref: torch.Tensor, factor: float = 2.0) -> float:
    """FlashAttention's rule for a kernel's error against the fp32 reference ``ref``:
    ``factor`` times that of a same-precision torch computation (``rounded``,
    ``rounded_p_attention``) plus a small floor."""
    return factor * (rounded - ref).abs().max().item() + factor * 1e-3 * max(ref.abs().max().item(), 1.0)
