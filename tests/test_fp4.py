"""FP4 KV formats (``KVFormat.fp4``: NVFP4, MXFP4) on the torch reference backend: the
rounding against a float64 model written here from the format's definition (every e2m1
and scale value enumerated, nearest with ties to even), the natural nibble order and the
scale factors' basic chunks (checked against the DSL's own block-scaled layout), the
cache's writes and decode, and the refusals of the paths that do not take FP4 yet."""

import math

import pytest
import torch

import bitdecode as bd
from bitdecode import dispatch, reference
from bitdecode.layouts import sm100

import kvdata

FP4 = ["nvfp4", "mxfp4"]


# ---- a float64 model of the format ----------------------------------------------------


def _nearest_even(x: float, grid) -> int:
    """Index of the grid value nearest ``x`` (grid ascending), ties to the even index."""
    best = min(range(len(grid)), key=lambda i: (abs(grid[i] - x), i % 2))
    return best


def model_quantize(block, fp4):
    """(codes, scale byte) of one block of Python floats."""
    amax = max(abs(v) for v in block)
    if not math.isfinite(amax):
        return [0] * len(block), (0x7F if fp4 == "nvfp4" else 0xFF)
    if fp4 == "nvfp4":
        target = min(max(amax / 6, sm100.UE4M3_MIN), sm100.UE4M3_MAX)
        grid = [sm100.ue4m3_value(b) for b in range(0x7F)]  # ascending, 0 .. 448
        byte = _nearest_even(target, grid)
        scale = grid[byte]
    else:
        e = -127 if amax == 0 else min(max(math.floor(math.log2(amax)) - 2, -127), 127)
        byte, scale = e + 127, 2.0 ** e
    mags = sm100.E2M1_MAGNITUDES
    codes = []
    for v in block:
        y = v / scale
        mag = _nearest_even(min(abs(y), 6.0), mags)
        codes.append(mag | (8 if math.copysign(1.0, y) < 0 else 0))
    return codes, byte


@pytest.mark.parametrize("fp4", FP4)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_quantize_matches_the_float64_model(fp4, dtype, gen):
    vec = sm100.SF_VEC[fp4]
    # scales across e4m3's range (subnormal, normal, clamped both ways), every e2m1
    # midpoint exactly (ties), negative zero, all-zero blocks
    rows = []
    for s in (2.0 ** -12, 2.0 ** -8, 0.37, 1.0, 3.0, 100.0, 600.0):
        rows.append(torch.randn(vec, generator=gen) * s)
    rows.append(torch.tensor(([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4)[:vec]))
    rows.append(torch.tensor(([-0.25, -0.75, -5.0, -6.0, -0.0, 7.0, 0.0, 1.0] * 4)[:vec]))
    rows.append(torch.zeros(vec))
    x = torch.stack(rows).to(dtype)
    codes, sf = reference.quantize_fp4(x, fp4)
    for r in range(x.shape[0]):
        want_codes, want_byte = model_quantize([float(v) for v in x[r].double()], fp4)
        assert int(sf[r, 0]) == want_byte, (r, int(sf[r, 0]), want_byte)
        assert codes[r].tolist() == want_codes, r
    xd = reference.dequantize_fp4(codes, sf, fp4, dtype)
    for r in range(x.shape[0]):
        scale = (sm100.ue4m3_value if fp4 == "nvfp4" else sm100.ue8m0_value)(int(sf[r, 0]))
        want = torch.tensor([sm100.e2m1_value(int(c)) * scale for c in codes[r]], dtype=torch.float64).to(dtype)
        assert torch.equal(xd[r], want), r


@pytest.mark.parametrize("fp4", FP4)
def test_grid_values_round_trip_and_nonfinite_blocks_give_nan(fp4):
    vec = sm100.SF_VEC[fp4]
    grid = torch.tensor(sm100.E2M1_VALUES).repeat(vec // 16 + 1)[:vec]  # every code
    for scale in (0.5, 1.0, 4.0):  # exact in both scale formats
        x = (grid * scale).half()[None]
        codes, sf = reference.quantize_fp4(x, fp4)
        assert torch.equal(reference.dequantize_fp4(codes, sf, fp4, torch.float16), x)
    bad = torch.ones(3, vec)
    bad[0, 3], bad[1, 0], bad[2, 5] = math.nan, math.inf, -math.inf
    with pytest.raises(ValueError, match="x contains NaN or Inf"):
        reference.quantize_fp4(bad.half(), fp4)
    codes, sf = reference.quantize_fp4(bad.half(), fp4, check_finite=False)
    assert reference.dequantize_fp4(codes, sf, fp4, torch.float16).isnan().all()


def test_nibble_order_and_scale_chunks():
    """Value ``8 j + i`` of a row sits in bits ``4 i`` of word ``j`` (two per byte, the
    lower index in the low nibble); a row's scale bytes sit where the block-scaled MMA's
    own layout (``sm100.sf_offsets``, read off the DSL) puts them."""
    codes = torch.arange(16, dtype=torch.uint8).repeat(2)[None]  # 32 values
    words = reference._fields_to_words(codes, 4)
    assert [w & 0xFFFFFFFF for w in words[0].tolist()] == [0x76543210, 0xFEDCBA98] * 2
    assert torch.equal(reference._words_to_fields(words, 4), codes)
    pytest.importorskip("cutlass")
    for fp4, rows, cols in (("nvfp4", 128, 64), ("nvfp4", 256, 128), ("mxfp4", 128, 256)):
        offsets = sm100.sf_offsets(fp4, rows, cols)
        sf = torch.arange(rows * (cols // sm100.SF_VEC[fp4])).reshape(rows, -1) % 251
        chunks = reference._sf_to_chunks(sf.to(torch.uint8))
        flat = ((chunks.long() & 0xFFFFFFFF)[..., None] >> torch.arange(0, 32, 8)) & 0xFF  # bytes in memory order
        flat = flat.reshape(-1)
        for r in range(rows):
            for s in range(sf.shape[1]):
                assert int(flat[offsets[r][s]]) == int(sf[r, s]), (fp4, r, s)
        assert torch.equal(reference._chunks_to_sf(chunks, rows, sf.shape[1]), sf.to(torch.uint8))


def test_format_fields_and_errors():
    f = bd.KVFormat(fp4="nvfp4")
    assert (f.bits, f.v_bits, f.k_mode, f.group_size, f.residual_block, f.v_tile) == (4, 4, "token", 16, 128, 128)
    assert bd.KVFormat(fp4="mxfp4", sink_tokens=4, hadamard=True).group_size == 32
    assert bd.KVFormat(fp4="nvfp4", k_mode="token", group_size=16) == f
    assert bd.KVFormat(bits=4) == bd.KVFormat(bits=4, k_mode="channel", group_size=128)
    assert f.bytes_per_token(128) == 128 + 2 * 128 / 16
    assert f.k_params_shape(2, 3, 256, 128) == (2, 3, 2, 2, 128)  # 2 tiles x 2 chunks (8 scale columns)
    assert f.v_params_shape(2, 3, 256, 64) == (2, 3, 2, 1, 2, 128)  # channels pad to one 128-row chunk
    assert "NVFP4" in f.describe() and "UE4M3" in f.describe()
    for kwargs, msg in [(dict(fp4="fp8"), "KVFormat.fp4 must be one of"),
                        (dict(fp4="nvfp4", bits=2), "bits and v_bits must be 4"),
                        (dict(fp4="nvfp4", v_bits=2), "bits and v_bits must be 4"),
                        (dict(fp4="mxfp4", k_mode="channel"), "k_mode must be 'token'"),
                        (dict(fp4="nvfp4", group_size=32), "group_size must be 16"),
                        (dict(group_size=16), "KVFormat.group_size must be one of")]:
        with pytest.raises(ValueError, match=msg):
            bd.KVFormat(**kwargs)


# ---- the cache -------------------------------------------------------------------------


def _model_dequantized(x, fmt, dim):
    """x [N, D] through the float64 model: blocks of G along ``dim``."""
    xt = x.movedim(dim, -1).double()
    out = torch.empty_like(xt)
    vec = fmt.group_size
    for r in range(xt.shape[0]):
        for b in range(0, xt.shape[1], vec):
            block = [float(v) for v in x.movedim(dim, -1)[r, b:b + vec].double()]
            codes, byte = model_quantize(block, fmt.fp4)
            scale = (sm100.ue4m3_value if fmt.fp4 == "nvfp4" else sm100.ue8m0_value)(byte)
            out[r, b:b + vec] = torch.tensor([sm100.e2m1_value(c) * scale for c in codes])
    return out.to(x.dtype).movedim(-1, dim)


@pytest.mark.parametrize("fp4", FP4)
def test_cache_holds_the_model_and_appends_equal_prefill(fp4, device, gen):
    fmt = bd.KVFormat(fp4=fp4, sink_tokens=3)
    n, d = 3 + 2 * 128 + 7, 64
    k, v = kvdata.kv(gen, 2, n, 1, d, dtype=torch.bfloat16, device=device)
    whole = bd.KVCache.allocate(2, 1, d, 512, fmt, dtype=torch.bfloat16, device=device, backend="reference",
                                page_size=128)
    whole.block_table.copy_(whole.block_table.flip(0))  # pages out of order
    whole.prefill(k, v, [n, 40])
    stepped = bd.KVCache.allocate(2, 1, d, 512, fmt, dtype=torch.bfloat16, device=device, backend="reference")
    stepped.prefill(k[:, :1], v[:, :1], [1, 1])
    for t in range(1, n):
        stepped.append(k[:, t:t + 1], v[:, t:t + 1])
    kd, vd = whole.dequantized(0)
    ks, vs = stepped.dequantized(0)
    assert torch.equal(kd, ks) and torch.equal(vd, vs)
    # sinks 16-bit, then two packed blocks (K per token along channels, V per channel
    # along the block's tokens), then the 16-bit residual
    body = slice(3, 3 + 256)
    assert torch.equal(kd[:3], k[0, :3]) and torch.equal(kd[259:], k[0, 259:])
    for blk in range(2):
        rows = slice(3 + 128 * blk, 3 + 128 * (blk + 1))
        assert torch.equal(kd[rows, 0].cpu(), _model_dequantized(k[0, rows, 0].cpu(), fmt, dim=1))
        assert torch.equal(vd[rows, 0].cpu(), _model_dequantized(v[0, rows, 0].cpu(), fmt, dim=0))
    assert not torch.equal(kd[body], k[0, body])
    q = kvdata.randn(gen, 2, 1, 4, d, dtype=torch.bfloat16, device=device)
    out, lse = bd.decode(q, whole, return_lse=True)
    for b, length in enumerate([n, 40]):
        kb, vb = whole.dequantized(b)
        o, l = reference.attention(q[b, 0], kb, vb)
        torch.testing.assert_close(out[b, 0].float(), o, atol=1e-2, rtol=0)
        torch.testing.assert_close(lse[b, 0], l, atol=1e-5, rtol=1e-5)
    whole.truncate(10)  # back into the second packed block: its survivors return 16-bit
    assert torch.equal(whole.dequantized(0)[0], kd[:n - 10])


def test_memory_counts_the_scale_chunks():
    """Codes, one 512-byte basic chunk per 128-token K tile and per V tile (head dim 64:
    2 of mxfp4's 4 scale columns and 64 of the chunk's 128 rows are padding), the 16-bit
    residual, lengths and block table."""
    fmt = bd.KVFormat(fp4="mxfp4")
    c = bd.KVCache.allocate(1, 2, 64, 512, fmt, device="cpu", backend="reference")
    heads, tiles = 2, 512 // 128
    codes = heads * 2 * 512 * 64 // 2
    chunks = heads * 2 * tiles * 512
    residual = 2 * 128 * heads * 64 * 2
    assert c.memory_bytes() == codes + chunks + residual + c.seqlens.numel() * 4 + c.block_table.numel() * 4


def test_fp4_backends_and_refusals(monkeypatch):
    """An FP4 cache is written by the FP4 pack kernel and decoded by the sm80 kernel, or on
    Hopper by the sm90 one (``auto``'s choice with a known 16-bit dtype); multi-token kernel
    plans refuse it with a clear error."""
    fmt = bd.KVFormat(fp4="nvfp4")
    monkeypatch.setattr(dispatch, "device_capability", lambda device: (9, 0) if device.type == "cuda" else None)
    for what in ("decode", "KV cache"):
        for backend in ("auto", "sm80"):
            assert dispatch.resolve(backend, torch.device("cuda", 0), what=what, fmt=fmt, head_dim=64) == "sm80"
    assert dispatch.resolve("auto", torch.device("cpu"), fmt=fmt) == "reference"
    from bitdecode.kernels_sm80 import backend as sm80
    from bitdecode.kernels_sm90 import backend as sm90

    assert sm90.BACKEND.auto_picks(fmt, 64, torch.float16)
    assert dispatch.resolve("auto", torch.device("cuda", 0), fmt=fmt, head_dim=64, dtype=torch.bfloat16) == "sm90"
    for kernels in (sm80.BACKEND, sm90.BACKEND):
        with pytest.raises(ValueError, match="one query token per sequence"):
            kernels.make_decode("sm_90a", fmt, None, 64, 8, True, tq=2)
    c = bd.KVCache.allocate(1, 1, 64, 256, fmt, device="cpu", backend="reference")
    assert c.backend == "reference" and bd.KVCache.allocate(1, 1, 64, 256, bd.KVFormat(group_size=64), device="cpu").backend == "reference"


def test_eval_specs():
    from bitdecode import eval as bdeval

    m = bdeval.parse_method("nvfp4s16h", 64)
    assert m.fmt == bd.KVFormat(fp4="nvfp4", sink_tokens=16, hadamard=True) and m.error is None
    assert bdeval.parse_method("mxfp4", 64).fmt.group_size == 32
    with pytest.raises(ValueError, match="nvfp4 / mxfp4"):
        bdeval.parse_method("nvfp4v2", 64)


def test_mxfp4_scale_clamps_at_its_smallest_power_of_two():
    """A bf16 block whose largest magnitude is 2^-126 asks for the E8M0 exponent -128; the
    scale byte clamps at 0 (2^-127), not wrapping to 255 (the NaN scale)."""
    x = torch.full((1, 32), 2.0 ** -126, dtype=torch.bfloat16)
    x[0, 1] = -(2.0 ** -127)
    codes, sf = reference.quantize_fp4(x, "mxfp4")
    assert sf.tolist() == [[0]]
    assert torch.equal(reference.dequantize_fp4(codes, sf, "mxfp4", torch.bfloat16), x)
