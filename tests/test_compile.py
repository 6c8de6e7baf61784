"""Compile the sm80 kernel family for sm_80, sm_90a and sm_100a on the CPU and check the PTX.

No GPU is needed: CuTe DSL compiles against fake tensors with ``--gpu-arch``.  The design
requires tensor-core MMAs fed by ldmatrix, lop3 dequantization and cp.async loads; the
decode kernel must not spill (checked with ptxas when it is installed).
"""

from __future__ import annotations

import re

import ptxas
import pytest

cutlass = pytest.importorskip("cutlass")

from bitdecode import KVFormat  # noqa: E402
from bitdecode.kernels_sm80 import backend as kernels  # noqa: E402
from bitdecode.layouts import resources, sm80, sm100  # noqa: E402

ARCHS = ("sm_80", "sm_90a", "sm_100a")

# (bits, k_mode, group, dtype, head_dim, heads per tile, split)
DECODE = [
    (4, "channel", 128, "fp16", 128, 8, True),
    (2, "token", 32, "bf16", 64, 16, False),
    (2, "token", 64, "fp16", 128, 8, True),  # more registers on sm_90a (``WIDE_2BIT_TOKEN``)
]


def _dtype(name):
    return {"fp16": cutlass.Float16, "bf16": cutlass.BFloat16}[name]


def _spills(ptx: str, arch: str, tmp_path) -> int:
    return ptxas.spill_bytes(ptxas.report(ptx, arch, tmp_path))


def _sm90_decode_ptx(kernel, fmt: KVFormat, arch: str = "sm_90a") -> str:
    """PTX (``arch``) of ``kernel``, a ``DecodeSm90`` (or ``DecodeSm80``) built with the
    test's own keywords: the split fp16 head-dim-128 decode's arguments."""
    import cutlass.cute as cute

    from bitdecode import jit

    args = kernels.decode_args(fmt, cutlass.Float16, 128, True)
    return cute.compile(kernel, *args, cutlass.Float32(1.0), cutlass.Int32(sm80.TAIL_UNIT), kernels._stream(),
                        options=jit.compile_options(arch, keep_ptx=True)).artifacts.PTX


def _global_reads(ptx: str) -> list:
    """The global loads and 16-byte cp.asyncs of ``ptx``, in order (``ld.global`` /
    ``cp.async.cg``)."""
    return re.findall(r"^\s*(ld\.global|cp\.async\.cg)", ptx, re.M)


def _table_reads_skipped(ptx: str) -> bool:
    """Whether ``ptx`` reads the block table (``ld.global.b32``, tab-separated: not the
    early entry's inline load) and every read is jumped over by a predicated branch just
    before it (``page_after``: a tile on the sequence's first page reads no table)."""
    lines = ptx.splitlines()
    reads = [i for i, line in enumerate(lines) if re.match(r"\s*ld\.global\.b32\s*\t", line)]

    def skipped(i):  # a predicated branch shortly before line i jumps to a label shortly after it
        for line in lines[max(0, i - 10):i]:
            m = re.match(r"\s*@%p\d+ bra\s+(\$L__BB\d+_\d+);", line)
            if m and any(after.startswith(m.group(1) + ":") for after in lines[i + 1:i + 6]):
                return True
        return False

    return bool(reads) and all(skipped(i) for i in reads)


def _cache_stand_in(fmt: KVFormat, dtype=None, tokens: int = 128, hkv: int = 8):
    """What the split heuristics read of a cache: its format and a residual buffer of
    ``hkv`` KV heads, head dim 128 (``dtype``: the model's; fp16 when None)."""
    from types import SimpleNamespace

    import torch

    return SimpleNamespace(fmt=fmt, k_res=torch.empty(1, tokens, hkv, 128, dtype=dtype or torch.float16))


@pytest.fixture
def h200_sms(monkeypatch):
    """The split heuristics see the H200's 132 SMs (where the counts the tests name were
    measured)."""
    from bitdecode.kernels_sm90 import backend as sm90

    for module in (sm90, kernels):
        monkeypatch.setattr(module, "num_sms", lambda device: 132)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cfg", DECODE, ids=lambda c: f"{c[0]}b-{c[1]}-g{c[2]}-{c[3]}-d{c[4]}-h{c[5]}-{'split' if c[6] else 'direct'}")
def test_decode_ptx(arch, cfg, tmp_path):
    bits, mode, g, dtype, d, nh, split = cfg
    fn = kernels.compile_decode(arch, KVFormat(bits, mode, g), _dtype(dtype), d, nh, split, keep_ptx=True)
    ptx = fn.artifacts.PTX
    assert f".target {arch}" in ptx
    for instr in ("mma.sync.aligned.m16n8k16", "ldmatrix.sync.aligned", "lop3.b32", "cp.async",
                  "movmatrix.sync.aligned.m8n8.trans.b16"):
        assert instr in ptx, f"{instr} missing from the {arch} decode PTX"
    assert ".local" not in ptx, "the decode kernel keeps a local-memory array"
    # programmatic dependent launch from sm_90 on: wait for the append, release the combine
    pdl = ("griddepcontrol.wait" in ptx, "griddepcontrol.launch_dependents" in ptx)
    assert pdl == ((True, True) if arch != "sm_80" else (False, False)), f"griddepcontrol in the {arch} decode PTX: {pdl}"
    report = ptxas.report(ptx, arch, tmp_path)
    if arch == "sm_90a":
        assert ptxas.spill_bytes(report) == 0, "ptxas spills registers in the decode kernel"
    # the split heuristic's residency model: no more registers than ptxas uses would allow,
    # and at head dim <= 128 with 8 head columns the same CTAs an SM as ptxas's count gives
    fmt, fp16 = KVFormat(bits, mode, g), dtype == "fp16"
    used = max(int(n) for n in re.findall(r"Used (\d+) registers", report))
    assert used <= kernels.decode_registers(fmt, d, nh, arch, fp16), used
    if d <= 128 and nh == 8:
        assert kernels.ctas_per_sm(fmt, d, nh, arch, fp16) == resources.ctas_per_sm(used, sm80.WARPS_N), used


@pytest.mark.parametrize("arch", ARCHS)
def test_pack_ptx(arch):
    fn = kernels.compile_pack(arch, KVFormat(4, "channel", 128), cutlass.Float16, 128, "append", keep_ptx=True)
    ptx = fn.artifacts.PTX
    for instr in ("ldmatrix.sync.aligned", "cp.async", "shfl.sync.bfly", "cvt.rz.f16.f32", "rcp.rn.f32",
                  "add.rn.f32",  # rint by the 1.5 * 2^23 add, never fused with the multiply
                  "min.NaN.f16x2", "max.NaN.f16x2",  # group ranges on 16-bit pairs; a NaN reaches the params
                  "atom.global.acq_rel.add"):  # the last CTA of a sequence commits its length
        assert instr in ptx, f"{instr} missing from the {arch} pack PTX"
    # no conversion-pipe rounding per element (a quarter-rate pipe: it bound the kernel)
    assert "cvt.rni" not in ptx and "cvt.rzi" not in ptx
    # Hopper on: launched while the previous kernel drains, waits before its first read
    assert ("griddepcontrol.wait" in ptx) == (arch != "sm_80")


@pytest.mark.parametrize("fmt", [KVFormat(2, "channel", 128), KVFormat(2, "token", 32)], ids=["2c128", "2t32"])
def test_append_at_head_dim_256_compiles_without_warnings(fmt, recwarn):
    """2-bit append at head dim 256 (a 256-token block: 64 row steps a thread) used to make
    CuTe DSL warn twice a compile about a traced loop of 64 iterations; a user saw it at
    the first append."""
    fn = kernels.compile_pack("sm_80", fmt, cutlass.Float16, 256, "append", keep_ptx=True)
    assert "cp.async" in fn.artifacts.PTX
    assert not [str(w.message) for w in recwarn if "loop" in str(w.message)]


@pytest.mark.parametrize("arch, fp4, dtype, head_dim, mode", [
    ("sm_80", "nvfp4", cutlass.Float16, 128, "append"),
    ("sm_90a", "mxfp4", cutlass.BFloat16, 64, "prefill"),
    ("sm_100a", "nvfp4", cutlass.BFloat16, 64, "append"),  # Blackwell runs the sm80 family too
])
def test_fp4_pack_ptx(arch, fp4, dtype, head_dim, mode, tmp_path):
    """The FP4 pack kernel: IEEE division for the NVFP4 scale, its e4m3 rounding by the
    1.5 * 2^(23 + q) add (never fused), no conversion-pipe rounding (every rounding by
    adds and bit moves), the length commit, PDL from Hopper on, and no spills."""
    fn = kernels.compile_pack(arch, KVFormat(fp4=fp4), dtype, head_dim, mode, keep_ptx=True)
    ptx = fn.artifacts.PTX
    need = ["st.global"] + (["div.rn.f32", "add.rn.f32"] if fp4 == "nvfp4" else [])
    need += ["atom.global.acq_rel.add"] if mode == "append" else []  # the append commits the lengths
    for instr in need:
        assert instr in ptx, f"{instr} missing from the {arch} {fp4} pack PTX"
    assert "cvt.rni" not in ptx and "cvt.rzi" not in ptx
    assert ("griddepcontrol.wait" in ptx) == (arch != "sm_80")
    assert _spills(ptx, arch, tmp_path) == 0, "ptxas spills registers in the FP4 pack kernel"


@pytest.mark.parametrize("arch", ("sm_80", "sm_90a"))
def test_combine_ptx(arch):
    fn = kernels.compile_combine(arch, cutlass.BFloat16, 128, keep_ptx=True)
    ptx = fn.artifacts.PTX
    assert "ex2.approx" in ptx and "ld.global" in ptx
    # on Hopper it launches while the decode kernel drains and waits for its partials
    assert ("griddepcontrol.wait" in ptx) == (arch == "sm_90a")


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_combine_hoist_loads_ptx(head_dim, monkeypatch, tmp_path):
    """``CombineSm80(hoist_loads=True)``, the default: every global load of the merge (the
    prefetched partial vectors, the LSEs, once) comes before its first barrier, where the
    late form loads the LSEs again and the partials after its reductions; no spill."""
    from bitdecode.kernels_sm80 import combine

    init = combine.CombineSm80.__init__
    hoisted = kernels.compile_combine("sm_90a", cutlass.Float16, head_dim, keep_ptx=True).artifacts.PTX
    monkeypatch.setattr(combine.CombineSm80, "__init__",
                        lambda self, *a, **kw: init(self, *a, **{**kw, "hoist_loads": False}))
    late = kernels.compile_combine("sm_90a", cutlass.Float16, head_dim, keep_ptx=True).artifacts.PTX

    def lse_loads_after_first_barrier(ptx):  # (scalar loads: the partials are 16-byte vectors)
        return len(re.findall(r"ld\.global\.(?!v4)", ptx[ptx.index("bar.sync"):]))

    def partial_loads_before_first_barrier(ptx):
        return len(re.findall(r"ld\.global\.v4", ptx[:ptx.index("bar.sync")]))

    assert lse_loads_after_first_barrier(late) == 1 and lse_loads_after_first_barrier(hoisted) == 0
    assert partial_loads_before_first_barrier(late) == 0
    assert partial_loads_before_first_barrier(hoisted) == combine.PREFETCH_PARTS
    assert ptxas.spill_bytes(ptxas.report(hoisted, "sm_90a", tmp_path)) == 0


@pytest.mark.parametrize("arch", ("sm_80", "sm_90a"))
def test_dequant_probe_ptx(arch):
    from bitdecode.kernels_sm80.dequant_probe import DequantProbe

    fn = DequantProbe.compile(arch, cutlass.BFloat16, 2, 256, keep_ptx=True)
    ptx = fn.artifacts.PTX
    assert "ldmatrix.sync.aligned" in ptx and "lop3.b32" in ptx and "fma.rn.bf16x2" in ptx


@pytest.mark.parametrize("cfg", [(4, "k", 128, "fp16"), (2, "v", 64, "bf16")], ids=lambda c: f"{c[0]}b-{c[1]}-d{c[2]}-{c[3]}")
def test_dequant_probe_sm90_ptx(cfg):
    """The sm90 operand path: ldmatrix -> lop3 -> stmatrix -> wgmma (sm_90a only)."""
    bits, operand, d, dtype = cfg
    from bitdecode.kernels_sm90.dequant_probe import DequantProbeSm90

    fn = DequantProbeSm90.compile("sm_90a", _dtype(dtype), bits, operand, d, keep_ptx=True)
    ptx = fn.artifacts.PTX
    for instr in ("ldmatrix.sync.aligned", "lop3.b32", "stmatrix.sync.aligned.m8n8.x4", "wgmma.mma_async",
                  "fence.proxy.async.shared::cta"):
        assert instr in ptx, f"{instr} missing from the sm90 dequant probe PTX"


@pytest.mark.parametrize("cfg", [(16384, 4, 1, 4, False), (8192, 6, 4, 2, False), (16384, 4, 4, 4, True)],
                         ids=lambda c: f"{c[0] // 1024}k-s{c[1]}-x{c[2]}{'-apart' if c[4] else ''}")
def test_ring_probe_sm90_ptx(cfg, tmp_path):
    """profiles/bench_ring.py's kernel: the producer's ``copies`` bulk copies a tile on the
    stage's transaction barrier (from one run or, ``apart``, from their own regions), the
    consumers' 16-byte shared loads (a tile's worth over their threads), waits on mbarriers,
    no spill (sm_90a only)."""
    tile_bytes, stages, copies, warps, apart = cfg
    from bitdecode.kernels_sm90.ring_probe import RingProbeSm90

    ptx = RingProbeSm90.compile("sm_90a", tile_bytes, stages, copies, warps, keep_ptx=True,
                                apart=apart).artifacts.PTX
    assert ptx.count("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes") == copies
    assert ptx.count("mbarrier.arrive.expect_tx") == 1 and "mbarrier.try_wait" in ptx
    assert ptx.count("ld.shared.v4") == tile_bytes // 16 // (32 * warps)
    assert ptxas.spill_bytes(ptxas.report(ptx, "sm_90a", tmp_path)) == 0


def test_ring_probe_refuses_bad_sizes():
    from bitdecode.kernels_sm90.ring_probe import RingProbeSm90

    for kwargs, message in ((dict(tile_bytes=16384, stages=1), "stages must be at least 2"),
                            (dict(tile_bytes=16384, stages=4, consumer_warps=9), "consumer_warps must be 1 to 8"),
                            (dict(tile_bytes=16384, stages=4, copies=3), "copies must be 1 to 64"),
                            (dict(tile_bytes=16384, stages=4, copies=65), "copies must be 1 to 64"),
                            (dict(tile_bytes=3072, stages=4), "tile_bytes \\(3072\\) must be a multiple of 2048")):
        with pytest.raises(ValueError, match=message):
            RingProbeSm90(**kwargs)


def test_ring_probe_sums_and_fit():
    """``RingProbeSm90.expected_sums`` (what the GPU test and profiles/bench_ring.py hold the
    kernel to) against the rule written out as loops: thread t adds words 4t .. 4t+3 of
    every (4 x threads)-word chunk of every tile, mod 2^32; and which rings share an SM."""
    import torch

    from bitdecode.kernels_sm90.ring_probe import RingProbeSm90

    probe = RingProbeSm90(tile_bytes=1024, stages=2, consumer_warps=1)
    gen = torch.Generator().manual_seed(3)
    src = torch.randint(-(2**31), 2**31 - 1, (2, 3, 256), dtype=torch.int32, generator=gen)
    want = torch.zeros(2, 32, dtype=torch.int64)
    for c in range(2):
        for t in range(32):
            for tile in range(3):
                for chunk in range(256 // 128):
                    base = chunk * 128 + 4 * t
                    want[c, t] += int(src[c, tile, base:base + 4].to(torch.int64).sum())
    assert torch.equal(probe.expected_sums(src), want & 0xFFFFFFFF)
    # ``apart``: copy p of tile (c, tile) is words p*Q .. of part p of the source, read as
    # (copies, ctas, tiles, Q) with Q the words a copy (here 2 copies of 128 words)
    apart = RingProbeSm90(tile_bytes=1024, stages=2, copies=2, consumer_warps=1, apart=True)
    parts = src.reshape(2, 2, 3, 128)
    want = torch.zeros(2, 32, dtype=torch.int64)
    for c in range(2):
        for t in range(32):
            for tile in range(3):
                for p in range(2):
                    want[c, t] += int(parts[p, c, tile, 4 * t:4 * t + 4].to(torch.int64).sum())
    assert torch.equal(apart.expected_sums(src), want & 0xFFFFFFFF)
    # (16 KB x 4: three an SM; 32 KB x 6: one; 32 KB x 8: none, over the 227 KB a CTA may take)
    assert [RingProbeSm90(k * 1024, s).ctas_per_sm() for k, s in ((16, 4), (32, 6), (32, 8))] == [3, 1, 0]


# (bits, k_mode, group, dtype, head_dim, heads per tile, split): the sm90 decode kernel
SM90_DECODE = [
    (4, "channel", 128, "fp16", 128, 8, True),
    (4, "channel", 128, "fp16", 128, 4, True),  # GQA <= 4: the half-column softmax (``half_cols``)
    (2, "channel", 128, "fp16", 128, 4, False),
    (2, "channel", 128, "fp16", 128, 8, True),  # two consumer warpgroups (``DecodeSm90.consumers``)
    (2, "channel", 32, "bf16", 128, 8, False),
    (4, "token", 64, "fp16", 64, 16, True),
]


@pytest.mark.parametrize("cfg", SM90_DECODE, ids=lambda c: f"{c[0]}b-{c[1]}-g{c[2]}-{c[3]}-d{c[4]}-h{c[5]}-{'split' if c[6] else 'direct'}")
def test_sm90_decode_ptx(cfg, tmp_path):
    """TMA + mbarrier ring, warp-specialized setmaxnreg, ldmatrix + lop3 dequant, wgmma RS."""
    from bitdecode.kernels_sm90 import backend as sm90

    bits, mode, g, dtype, d, nh, split = cfg
    fn = sm90.compile_decode("sm_90a", KVFormat(bits, mode, g), _dtype(dtype), d, nh, split, keep_ptx=True)
    ptx = fn.artifacts.PTX
    for instr in ("wgmma.mma_async.sync.aligned.m64n", "cp.async.bulk.tensor", "cp.async.bulk.shared",
                  "mbarrier.try_wait", "setmaxnreg.inc", "setmaxnreg.dec", "ldmatrix.sync.aligned", "lop3.b32",
                  "fence.proxy.async.shared::cta", "wgmma.wait_group", "griddepcontrol.wait",
                  "griddepcontrol.launch_dependents",
                  "bar.red.or.pred"):  # the lazy maximum's vote (``DecodeSm90.lazy_softmax``)
        assert instr in ptx, f"{instr} missing from the sm90 decode PTX"
    assert ".local" not in ptx, "the sm90 decode kernel keeps a local-memory array"
    report = ptxas.report(ptx, "sm_90a", tmp_path)
    assert ptxas.spill_bytes(report) == 0, \
        "ptxas spills registers in the sm90 decode kernel"
    # C7514: ptxas makes every wgmma wait for the previous one when it cannot prove an
    # accumulator read safe (it did, unseen, for the kernel's first versions)
    assert "C7514" not in report, "ptxas serializes the sm90 decode kernel's wgmmas"


def test_sm90_half_tile():
    """GQA groups of at most 4 heads (one query token) take the 4-head tile: the 8-column
    wgmma with quad lanes 2 and 3 on their partner's second rows (one butterfly shuffle by 2
    lanes a value), so the softmax runs half the exponentials of the 8-head kernel; more
    rows, or several query tokens, keep sm80's tiles, and the 4-head tile refuses them."""
    from bitdecode.kernels_sm90 import backend as sm90

    be = sm90.BACKEND
    assert [be.heads_tile(r, 1) for r in (1, 2, 4, 5, 8, 9, 16)] == [4, 4, 4, 8, 8, 16, 16]
    assert be.heads_tile(4, 2) == 8 and kernels.BACKEND.heads_tile(4, 1) == 8
    fmt = KVFormat(4, "channel", 128)
    half = be.make_decode("sm_90a", fmt, cutlass.Float16, 128, 4, True)
    assert half.half_cols and half.nh == 8 and not be.make_decode("sm_90a", fmt, cutlass.Float16, 128, 8, True).half_cols
    with pytest.raises(ValueError, match="one query token"):
        be.make_decode("sm_90a", fmt, cutlass.Float16, 128, 4, True, tq=2)
    ex2 = {nh: _count(sm90.compile_decode("sm_90a", fmt, cutlass.Float16, 128, nh, True, keep_ptx=True).artifacts.PTX,
                      "ex2.approx") for nh in (4, 8)}
    # per step 4 exponentials a thread instead of 8 (the lazy and exact paths, the residual)
    assert ex2[4] < ex2[8], ex2
    assert any(v.extra[0] == "h4" for v in be.variants(("decode",), [fmt], [128], ["fp16"]))


@pytest.mark.parametrize("arch, bits, nh, split", [
    ("sm_90a", 4, 4, True), ("sm_90a", 2, 4, False), ("sm_90a", 4, 8, True),
    ("sm_80", 4, 8, True), ("sm_80", 2, 16, False), ("sm_80", 4, 16, True),
])
def test_appending_decode_ptx(arch, bits, nh, split, tmp_path, monkeypatch):
    """The appending decode (``KVCache.decode(k_new=, v_new=)``: ``call_append`` of
    DecodeSm90 and DecodeSm80): the decode kernel plus the new token's stores into the
    residual block (behind a CTA fence) and the lengths' commit (the pack kernel's acq_rel
    counter), and split, the splits' merge in the last CTA; no spills (sm90: its wgmmas
    unserialized); several query tokens and FP4 refuse it."""
    from bitdecode.kernels_sm90 import backend as sm90

    monkeypatch.setenv("CUTE_DSL_ARCH", arch)
    be, mma = (sm90.BACKEND, "wgmma.mma_async") if arch == "sm_90a" else (kernels.BACKEND, "mma.sync.aligned")
    fmt = KVFormat(bits, "channel", 128)
    ptx = be.compile_decode(arch, fmt, cutlass.BFloat16, 128, nh, split, keep_ptx=True, append=True).artifacts.PTX
    plain = be.compile_decode(arch, fmt, cutlass.BFloat16, 128, nh, split, keep_ptx=True).artifacts.PTX
    for instr in ("atom.global.acq_rel.add", "fence.acq_rel.cta", mma, "cp.async"):
        assert instr in ptx, f"{instr} missing from the appending decode's PTX"
    # (the plain split kernel's count-in where it merges its splits itself: sm90's 4-bit)
    merges = be.merges_splits(arch, fmt, cutlass.BFloat16, 128, nh, split)
    assert _count(plain, "atom.global") == merges and _count(ptx, "st.global") > _count(plain, "st.global")
    # split: the last CTA of a (sequence, KV head) merges the partials (no combine launch),
    # counted in on a second acq_rel counter at GPU scope (its release and acquire: no fence)
    assert _count(ptx, "atom.global.acq_rel.add") == 1 + split
    assert "fence.acq_rel.gpu" not in ptx
    report = ptxas.report(ptx, arch, tmp_path)
    assert ptxas.spill_bytes(report) == 0 and "C7514" not in report
    with pytest.raises(ValueError, match="one query token"):
        be.make_decode(arch, fmt, cutlass.Float16, 128, 8, True, tq=2, append=True)
    with pytest.raises(ValueError, match="integer format"):
        kernels.BACKEND.make_decode(arch, KVFormat(fp4="nvfp4"), cutlass.Float16, 128, 8, True, append=True)


def test_sm90_decode_refuses_other_archs():
    from bitdecode.kernels_sm90 import backend as sm90

    with pytest.raises(ValueError, match="compiles for sm_90a only"):
        sm90.compile_decode("sm_80", KVFormat(4, "channel", 128), cutlass.Float16, 128, 8, True)


def _count(ptx: str, instr: str) -> int:
    return len(re.findall(re.escape(instr), ptx))


@pytest.mark.parametrize("backend_name", ["sm80", "sm90"])
def test_decode_with_sink_tokens_ptx(backend_name, tmp_path):
    """A format with sink tokens compiles to a decode kernel with a second 16-bit sub-tile
    loop (more cp.async loads than without) and no spills."""
    from bitdecode import backend as backends

    be = backends.get(backend_name)
    ptx = {s: be.compile_decode("sm_90a", KVFormat(4, "channel", 128, sink_tokens=s), cutlass.Float16, 128, 8,
                                True, keep_ptx=True).artifacts.PTX for s in (0, 16)}
    assert _count(ptx[16], "cp.async.") > _count(ptx[0], "cp.async."), "no sink-token loads in the decode PTX"
    report = ptxas.report(ptx[16], "sm_90a", tmp_path)
    assert ptxas.spill_bytes(report) == 0
    assert "C7514" not in report


@pytest.mark.parametrize("mode", ["prefill", "append"])
def test_pack_with_sink_tokens_ptx(mode):
    """The pack kernel of a format with sink tokens copies them 16-bit (more 16-byte global
    stores than without)."""
    ptx = {s: kernels.compile_pack("sm_90a", KVFormat(2, "token", 64, sink_tokens=s), cutlass.BFloat16, 64, mode,
                                   keep_ptx=True).artifacts.PTX for s in (0, 5)}
    assert _count(ptx[5], "st.global.v4") > _count(ptx[0], "st.global.v4"), "no sink-token copies in the pack PTX"


@pytest.mark.parametrize("widths", [(4, 2), (2, 4)], ids=["k4v2", "k2v4"])
@pytest.mark.parametrize("backend_name", ["sm80", "sm90"])
def test_decode_k4v2_ptx(backend_name, widths, tmp_path):
    """K and V at their own widths (K4V2; K2V4 with two 4-bit V tiles per block): one kernel dequantizes with both
    widths' lop3 masks (the 4-bit pair mask 0x000F000F, the 2-bit 0x00030003) and does
    not spill."""
    from bitdecode import backend as backends

    fn = backends.get(backend_name).compile_decode("sm_90a", KVFormat(widths[0], "channel", 128, v_bits=widths[1]),
                                                   cutlass.Float16, 128, 8, True, keep_ptx=True)
    ptx = fn.artifacts.PTX
    assert "mov.b32 m, 983055;" in ptx and "mov.b32 m, 196611;" in ptx, "a width's lop3 mask is missing"
    report = ptxas.report(ptx, "sm_90a", tmp_path)
    assert ptxas.spill_bytes(report) == 0
    assert "C7514" not in report


@pytest.mark.parametrize("widths", [(4, 2), (2, 4)], ids=["k4v2", "k2v4"])
@pytest.mark.parametrize("mode", ["prefill", "append"])
def test_pack_k4v2_ptx(mode, widths, tmp_path):
    """The pack kernel of K 4-bit / V 2-bit (64 tokens of 4-bit K per warp) and of K2V4
    (two 4-bit V tiles per block) does not spill."""
    fn = kernels.compile_pack("sm_90a", KVFormat(widths[0], "channel", 64, v_bits=widths[1]), cutlass.Float16, 128,
                              mode, keep_ptx=True)
    assert _spills(fn.artifacts.PTX, "sm_90a", tmp_path) == 0


@pytest.mark.parametrize("backend_name", ["sm80", "sm90"])
def test_decode_multi_token_ptx(backend_name, tmp_path):
    """Four query tokens at GQA 4 (16 query rows per KV head, a causal mask per column)
    compile without spills; the mask adds compares to the one-token kernel."""
    from bitdecode import backend as backends

    be = backends.get(backend_name)
    ptx = {tq: be.compile_decode("sm_90a", KVFormat(4, "channel", 128), cutlass.Float16, 128, 16, True,
                                 keep_ptx=True, tq=tq).artifacts.PTX for tq in (1, 4)}
    assert _count(ptx[4], "setp.") > _count(ptx[1], "setp."), "no causal mask in the multi-token decode PTX"
    report = ptxas.report(ptx[4], "sm_90a", tmp_path)
    assert ptxas.spill_bytes(report) == 0
    assert "C7514" not in report


def _static_dims(fake):
    return tuple(s if isinstance(s, int) else None for s in fake.shape)


@pytest.mark.parametrize("fmt", [KVFormat(4, "channel", 128), KVFormat(2, "token", 32, sink_tokens=5),
                                 KVFormat(4, "channel", 64, v_bits=2), KVFormat(2, "channel", 64, v_bits=4)],
                         ids=["4bit", "2bit-s5", "k4v2", "k2v4"])
def test_compiled_argument_shapes_match_the_cache(fmt):
    """The static dims the kernels are compiled for are those of a cache's tensors, for
    every format (a static V row width taken from the block instead of V's own tile made
    every K2V4 call fail at the TVM-FFI shape check)."""
    import torch

    import bitdecode as bd
    from bitdecode.kernels_sm80.backend import sink_tensors

    d = 128
    cache = bd.KVCache.allocate(2, 2, d, 600, fmt, dtype=torch.float16, device="cpu", backend="reference")
    t = cache.tensors()
    real = [torch.empty(2, 1, 8, d), t.k_pack.view(torch.float16), t.k_params, t.v_pack.view(torch.float16),
            t.v_params, t.k_res, t.v_res, *sink_tensors(t), t.cache_seqlens, t.block_table]
    fakes = kernels.decode_args(fmt, cutlass.Float16, d, False)
    for i, (x, f) in enumerate(zip(real, fakes)):
        dims = _static_dims(f)
        assert len(dims) == x.dim() and all(s is None or s == n for s, n in zip(dims, x.shape)), (i, dims, x.shape)
    writes = [torch.empty(2, 3, 2, d), torch.empty(2, 3, 2, d), t.k_res, t.v_res, *sink_tensors(t), t.cache_seqlens,
              t.block_table, t.k_pack, t.k_params, t.v_pack, t.v_params, t.overflow, t.commits]
    for i, (x, f) in enumerate(zip(writes, kernels.pack_args(fmt, cutlass.Float16, d))):
        dims = _static_dims(f)
        assert len(dims) == x.dim() and all(s is None or s == n for s, n in zip(dims, x.shape)), (i, dims, x.shape)


@pytest.mark.parametrize("fp4, dtype, d", [("nvfp4", "fp16", 128), ("mxfp4", "bf16", 64)])
@pytest.mark.parametrize("arch", ARCHS)
def test_decode_fp4_ptx(fp4, dtype, d, arch, tmp_path):
    """FP4 caches on the sm80 decode kernel: e2m1 pairs moved under a 16-bit float with byte
    permutes (no lookup table in memory: no ld.global or ld.const besides the cache's
    loads), the block scale applied with one packed fma, mma.sync on the result; no spills."""
    from bitdecode.kernels_sm80 import backend as sm80_backend

    fn = sm80_backend.BACKEND.compile_decode(arch, KVFormat(fp4=fp4), _dtype(dtype), d, 8, True, keep_ptx=True)
    ptx = fn.artifacts.PTX
    for instr in ("mma.sync.aligned.m16n8k16", "ldmatrix.sync.aligned", "cp.async", "prmt.b32",
                  "fma.rn." + ("bf16x2" if dtype == "bf16" else "f16x2")):
        assert instr in ptx, f"{instr} missing from the FP4 decode PTX"
    assert ".const" not in ptx and ".local" not in ptx
    report = ptxas.report(ptx, arch, tmp_path)
    assert ptxas.spill_bytes(report) == 0
    # the split heuristic's residency model counts no fewer registers than ptxas uses
    used = max(int(n) for n in re.findall(r"Used (\d+) registers", report))
    assert used <= sm80_backend.decode_registers(KVFormat(fp4=fp4), d, 8), used


def test_compile_cli_lists_fp4_decode_variants():
    """``bitdecode compile --fp4 nvfp4`` adds the FP4 decode variants and the FP4 pack
    kernels, for both backends (sm90 compiles its own decode and the shared pack)."""
    import argparse

    from bitdecode import cli_compile
    from bitdecode.kernels_sm80 import backend as sm80_backend

    parser = argparse.ArgumentParser()
    cli_compile.add_parser(parser.add_subparsers(), "compile", "")
    common = ["--kernels", "decode,pack", "--bits", "4", "--k-mode", "token", "--group-size", "64", "--fp4",
              "nvfp4,mxfp4", "--head-dim", "64", "--dtype", "bf16"]
    names = [v.name for v in cli_compile.variants(parser.parse_args(["compile", "--arch", "sm_80"] + common))]
    assert "decode_bf16_d64_mxfp4_h16_split" in names and "decode_bf16_d64_nvfp4_h8_direct" in names
    assert "pack_bf16_d64_nvfp4_append" in names and "pack_bf16_d64_mxfp4_prefill" in names
    hopper = cli_compile.variants(parser.parse_args(["compile", "--arch", "sm_90a"] + common))
    assert any(v.fp4 and v.kind == "decode" for v in hopper) and any(v.fp4 and v.kind == "pack" for v in hopper)
    v = next(v for v in cli_compile.variants(parser.parse_args(["compile", "--arch", "sm_80"] + common))
             if v.name == "decode_bf16_d64_mxfp4_h8_split")
    assert "prmt.b32" in sm80_backend.BACKEND.compile_variant("sm_80", v, keep_ptx=True).artifacts.PTX


@pytest.mark.parametrize("fp4, dtype, d, nh", [("nvfp4", "fp16", 128, 8), ("mxfp4", "bf16", 64, 16)])
def test_decode_fp4_sm90_ptx(fp4, dtype, d, nh, tmp_path):
    """FP4 caches on the sm90 decode kernel: the same register dequant (byte permutes, one
    packed fma for the block scale, nothing read from a table) feeding wgmma from registers,
    the TMA + bulk-copy ring, setmaxnreg; no spills and no wgmma serialization."""
    from bitdecode.kernels_sm90 import backend as sm90_backend

    fn = sm90_backend.compile_decode("sm_90a", KVFormat(fp4=fp4), _dtype(dtype), d, nh, True, keep_ptx=True)
    ptx = fn.artifacts.PTX
    for instr in ("wgmma.mma_async", "cp.async.bulk.tensor", "cp.async.bulk.shared", "mbarrier", "setmaxnreg",
                  "prmt.b32", "fma.rn." + ("bf16x2" if dtype == "bf16" else "f16x2")):
        assert instr in ptx, f"{instr} missing from the sm90 FP4 decode PTX"
    assert ".const" not in ptx and ".local" not in ptx
    report = ptxas.report(ptx, "sm_90a", tmp_path)
    assert "C7514" not in report, "ptxas serializes the wgmmas"
    assert ptxas.spill_bytes(report) == 0


@pytest.mark.parametrize("fp4, dtype, head_dim, nh, split, sinks", [
    ("nvfp4", "fp16", 128, 8, True, 0),
    ("mxfp4", "bf16", 256, 16, False, 16),
])
def test_sm100_decode_ptx(fp4, dtype, head_dim, nh, split, sinks, tmp_path):
    """The Blackwell FP4 decode kernel: block-scaled tcgen05 MMAs on the packed bytes (and
    kind::f16 ones for the 16-bit tiles), tensor memory allocated, read and fed scales by
    tcgen05.cp, TMA + bulk copies on mbarriers, PDL, and no spills."""
    from bitdecode.kernels_sm100 import backend as sm100_backend

    fmt = KVFormat(fp4=fp4, sink_tokens=sinks)
    fn = sm100_backend.compile_decode("sm_100a", fmt, _dtype(dtype), head_dim, nh, split, keep_ptx=True)
    ptx = fn.artifacts.PTX
    kind = {"nvfp4": "kind::mxf4nvf4", "mxfp4": "kind::mxf4"}[fp4]
    mma = [ln for ln in ptx.splitlines() if "tcgen05.mma" in ln]
    assert any(kind in ln and "block_scale" in ln for ln in mma), f"no block-scaled {kind} tcgen05.mma"
    # per tile, both products once per FP4 term of Q / P: S^T over head_dim / 64 K-blocks, O^T
    # over 128 tokens / 64 K-blocks in each of head_dim / 128 M-blocks (four terms: 16 / 32)
    scaled = sum(kind in ln and "block_scale" in ln for ln in mma)
    assert scaled == sm100.OPERAND_TERMS * (head_dim // 64 + 2 * (head_dim // 128)), scaled
    assert any("kind::f16" in ln for ln in mma), "no kind::f16 tcgen05.mma for the 16-bit tiles"
    for instr in ("tcgen05.alloc", "tcgen05.dealloc", "tcgen05.ld", "tcgen05.cp", "tcgen05.commit",
                  "cp.async.bulk.tensor", "cp.async.bulk.shared::cluster.global", "mbarrier.try_wait",
                  "griddepcontrol.wait"):
        assert instr in ptx, f"{instr} missing from the sm100 decode PTX"
    assert _spills(ptx, "sm_100a", tmp_path) == 0, "ptxas spills registers in the sm100 decode kernel"


def test_sm100_backend_keeps_sm80_kernels_for_the_rest():
    """Integer caches and FP4 at head dim 64 get the sm80 decode kernel on the sm100 backend."""
    from bitdecode.kernels_sm100.backend import BACKEND
    from bitdecode.kernels_sm100.decode import DecodeSm100

    assert isinstance(BACKEND.make_decode("sm_100a", KVFormat(fp4="nvfp4"), cutlass.Float16, 128, 8, True),
                      DecodeSm100)
    for fmt, d in ((KVFormat(4), 128), (KVFormat(fp4="mxfp4"), 64)):
        assert not isinstance(BACKEND.make_decode("sm_100a", fmt, cutlass.Float16, d, 8, True), DecodeSm100)
    with pytest.raises(ValueError, match="sm_100a only"):
        BACKEND.make_decode("sm_90a", KVFormat(fp4="nvfp4"), cutlass.Float16, 128, 8, True)


@pytest.mark.parametrize("arch", ("sm_80", "sm_90a"))
def test_rope_ptx(arch):
    """The rotary embedding: 16-byte loads and stores, each product and the sum rounded on
    their own (``mul.rn`` / ``add.rn``, so ptxas never fuses them into an fma: bit-identity
    with torch's ops depends on it)."""
    from bitdecode import jit
    from bitdecode.kernels_sm80.rope import compile_rope

    ptx = compile_rope(False, 128, jit.compile_options(arch, keep_ptx=True)).artifacts.PTX
    for instr in ("ld.global.v4.u32", "st.global.v4.b32", "mul.rn.f32", "add.rn.f32", "cvt.rn.f16x2.f32"):
        assert instr in ptx, f"{instr} missing from the {arch} rope PTX"
    assert "fma.rn.f32" not in ptx


def test_sm100_decode_fits_one_sm():
    """The largest sm100 configurations (head dim 256, 16 query columns, both formats) fit a
    Blackwell SM: shared memory within the per-CTA capacity, tensor memory within 512 columns."""
    import cutlass.memory

    from bitdecode.kernels_sm100.decode import DecodeSm100
    from bitdecode.layouts._trace import evaluate

    def build():
        out = {}
        for fp4, d, nh in (("nvfp4", 256, 16), ("mxfp4", 256, 16), ("nvfp4", 128, 8)):
            k = DecodeSm100(cutlass.BFloat16, fp4, d, nh, True, sinks=16)
            mma, mma16 = k._mmas()
            lay = k._layouts(mma, mma16)
            out[fp4, d, nh] = (k._shared_storage(lay).size_in_bytes(), k.tmem_columns(mma, lay), k.num_stages)
        return out

    capacity = cutlass.memory.get_smem_capacity_in_bytes("sm_100")
    for cfg, (smem, cols, stages) in evaluate(build, arch="sm_100a").items():
        assert smem <= capacity, f"{cfg}: {smem} bytes of shared memory, an SM gives a CTA {capacity}"
        assert cols <= 512 and stages >= 2, (cfg, cols, stages)


def test_every_sm100_variant_compiles_without_spills(tmp_path):
    """``bitdecode compile --arch sm_100a`` over every FP4 tcgen05 decode variant (both formats,
    head dims 128 / 256, 8 / 16 query columns, split and direct; bf16: fp16 differs only in the
    16-bit tiles' MMA kind, compiled by the tests above) and the integer decode variants the
    sm100 backend runs on the sm80 kernel: every one compiles, every FP4 one is a tcgen05
    kernel, and ptxas spills none of those."""
    import subprocess
    import sys

    out = tmp_path / "ptx"
    args = ["compile", "--arch", "sm_100a", "--kernels", "decode", "--bits", "4", "--k-mode", "channel",
            "--group-size", "128", "--fp4", "nvfp4,mxfp4", "--head-dim", "128,256", "--dtype", "bf16", "--jobs", "2",
            "--out", str(out)]
    cmd = [sys.executable, "-c", f"from bitdecode.cli import main; raise SystemExit(main({args!r}))"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    fp4 = sorted(out.glob("decode_*fp4*.ptx"))
    assert len(fp4) == 16 and len(list(out.glob("decode_*4bit*.ptx"))) == 8
    for path in fp4:
        ptx = path.read_text()
        assert "tcgen05.mma" in ptx and "block_scale" in ptx, path.name
        assert _spills(ptx, "sm_100a", tmp_path) == 0, f"ptxas spills registers in {path.name}"


@pytest.mark.parametrize("arch", ("sm_80", "sm_90a"))
def test_dense_ptx(arch, tmp_path):
    """The decode step's GEMV: 16-byte streaming loads of the weights past L1, fp32 FMAs, a
    shuffle reduction; on sm_90 the L2 prefetch of the weights before griddepcontrol.wait
    (programmatic dependent launch); no spills at the Llama-3-8B row lengths (K = 4096,
    14336) for 1 to MAX_TOKENS tokens.  SwiGLU: 16-byte loads / stores and the IEEE
    division of silu."""
    from bitdecode import jit
    from bitdecode.kernels_sm80.dense import MAX_TOKENS, compile_gemv, compile_silu_mul

    pdl = jit.has_pdl(arch)
    opts = jit.compile_options(arch, keep_ptx=True)
    for tokens in range(1, MAX_TOKENS):
        ptx = compile_gemv(True, 4096, tokens, False, opts, pdl=pdl).artifacts.PTX
        assert _spills(ptx, arch, tmp_path) == 0, f"ptxas spills registers in the GEMV (K = 4096, {tokens} tokens)"
    ptx = compile_gemv(False, 4096, MAX_TOKENS, True, opts, pdl=pdl).artifacts.PTX
    assert _spills(ptx, arch, tmp_path) == 0, "ptxas spills registers in the GEMV (K = 4096)"
    # the residual epilogue (a decoder layer's last add): the residual read coherently, after the wait
    ptx = compile_gemv(True, 14336, MAX_TOKENS, False, opts, pdl=pdl, has_residual=True).artifacts.PTX
    assert _spills(ptx, arch, tmp_path) == 0 and "ld.global.b16" in ptx and "add.f32" in ptx
    if pdl:
        assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global.b16")
    ptx = compile_gemv(False, 14336, MAX_TOKENS, True, opts, pdl=pdl).artifacts.PTX
    want = ["ld.global.nc.L1::no_allocate.v4.u32", "fma.rn.f32", "shfl.sync.bfly"]
    if pdl:  # x, written by the previous kernel, read coherently after the wait
        want += ["prefetch.global.L2", "griddepcontrol.wait", "griddepcontrol.launch_dependents", "ld.global.v4.u32"]
    else:
        want += ["ld.global.nc.v4.u32"]
    for instr in want:
        assert instr in ptx, f"{instr} missing from the {arch} GEMV PTX"
    if pdl:
        assert "ld.global.nc.v4.u32" not in ptx, "x read through the non-coherent path behind griddepcontrol.wait"
    assert _spills(ptx, arch, tmp_path) == 0, "ptxas spills registers in the GEMV"
    ptx = compile_silu_mul(True, opts, pdl=pdl).artifacts.PTX
    for instr in ("ld.global.v4.u32", "st.global.v4.b32", "div.rn.f32", "ex2.approx"):
        assert instr in ptx, f"{instr} missing from the {arch} SwiGLU PTX"
    if pdl:  # the RMSNorm in front of a GEMV lets it launch at once (and waits before reading x)
        from bitdecode.bitnet import ACT_EPS
        from bitdecode.kernels_sm80.act_quant import compile_norm_quant

        ptx = compile_norm_quant(True, ACT_EPS, 1e-5, opts, quantize=False, pdl=True).artifacts.PTX
        assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx
        assert "ld.global.nc" not in ptx, "the norm reads x through the non-coherent path"


@pytest.mark.parametrize("arch", ("sm_80", "sm_90a"))
def test_small_m_gemm_ptx(arch, tmp_path):
    """The GEMM for 4-16 tokens: mma.sync m16n8k16 on the weights' own 16-byte loads (two
    MMAs a chunk and token tile), streamed past L1; the warps' tiles met through shared
    memory behind one barrier; on sm_90 the L2 prefetch before griddepcontrol.wait and x
    read coherently after it; no spills at the Llama-3-8B row lengths, one or two token
    tiles, with and without the residual epilogue."""
    from bitdecode import jit
    from bitdecode.kernels_sm80.dense import GemmSmallMSm80, compile_gemm_small_m

    pdl = jit.has_pdl(arch)
    opts = jit.compile_options(arch, keep_ptx=True)
    for bf16, k, tokens, residual in ((True, 4096, 8, False), (False, 4096, 4, True), (True, 14336, 16, True),
                                      (True, 2560, 13, False)):
        kernel = GemmSmallMSm80(bf16, k, tokens, pdl)
        ptx = compile_gemm_small_m(bf16, k, tokens, opts, pdl=pdl, has_residual=residual).artifacts.PTX
        kind = "bf16" if bf16 else "f16"
        assert ptx.count(f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32") == \
            2 * kernel.batch * kernel.tiles, (k, tokens)
        assert ptx.count("ld.global.nc.L1::no_allocate.v4.u32") == 2 * kernel.batch
        assert "bar.sync" in ptx and "st.shared.b32" in ptx and "ld.shared.b32" in ptx
        if pdl:
            assert "prefetch.global.L2" in ptx and "griddepcontrol.wait" in ptx
            assert ptx.count("ld.global.v4.u32") == kernel.batch * kernel.tiles  # x, coherent after the wait
        assert _spills(ptx, arch, tmp_path) == 0, f"ptxas spills registers in the small-M GEMM ({k}, {tokens})"
    # the configs bench_dense --small-m sweeps: fewer warps, longer batches, several row blocks a CTA
    for tokens, warps, batch, blocks in ((1, 4, 8, 1), (3, 2, 16, 1), (8, 8, 4, 4), (16, 4, 8, 2)):
        kernel = GemmSmallMSm80(True, 14336, tokens, pdl, warps, batch, blocks)
        ptx = compile_gemm_small_m(True, 14336, tokens, opts, pdl=pdl, warps=warps, batch=batch,
                                   row_blocks=blocks).artifacts.PTX
        assert ptx.count("ld.global.nc.L1::no_allocate.v4.u32") == 2 * kernel.batch and kernel.batch == batch
        assert ptx.count("bar.sync") == (1 if blocks == 1 else 2)  # several blocks: red is free again
        assert _spills(ptx, arch, tmp_path) == 0, f"ptxas spills registers in the small-M GEMM (w{warps}b{batch})"
    with pytest.raises(ValueError, match="1..16 tokens"):
        GemmSmallMSm80(True, 4096, 17)
    with pytest.raises(ValueError, match="K % 256 == 0"):
        GemmSmallMSm80(True, 4000, 8)


def test_sm90_fold_k_config():
    """K's per-channel scale goes into Q (``fold_k``) where every 64-token M-block lies in
    one K group and the dtype is fp16 (bf16's once-per-channel rounding of Q o s measured
    2x its tolerance); one Q o s tile per K group of a packed tile; the producer warpgroup,
    which builds them, keeps more registers."""
    from bitdecode.kernels_sm90.decode import PRODUCER_REGS, SCALER_REGS, DecodeSm90

    f16, bf16 = cutlass.Float16, cutlass.BFloat16
    k = DecodeSm90(f16, 4, "channel", 128, 128, 8, True)
    assert k.fold_k and k.q_copies == 1 and k.k_center == 8
    # 4-bit: the scores take the raw lop3 halves (one multiplier per fragment column half)
    assert k.raw_k and k.k_mult == ((1, 16), (1, 16)) and k.k_mult_uniform and k.k_offset == 1024
    assert k.producer_regs == SCALER_REGS > PRODUCER_REGS[2] and k.consumer_regs == 2 * 128 - SCALER_REGS
    two = DecodeSm90(f16, 2, "channel", 64, 128, 16, True)  # 256-token tiles: four K groups
    assert two.fold_k and two.q_copies == 4 and two.k_center == 2
    assert two.raw_k and two.k_mult != ((1, 1),) * 4  # 2-bit takes the lop3 halves too (raw_k_all)
    assert DecodeSm90(f16, 2, "channel", 64, 128, 16, True, raw_k_all=False).k_mult == ((1, 1),) * 4
    assert DecodeSm90(f16, 4, "channel", 128, 256, 8, False).scale_lanes == (32, 2)
    assert DecodeSm90(f16, 4, "channel", 64, 64, 16, True).scale_lanes == (16, 1)
    for off in (DecodeSm90(bf16, 4, "channel", 128, 128, 8, True, fold_k_bf16=False),  # bf16, asked not to
                DecodeSm90(f16, 4, "token", 64, 128, 8, True),  # K per token
                DecodeSm90(f16, 4, "channel", 32, 128, 8, True),  # groups inside an M-block
                DecodeSm90(f16, 4, "channel", 128, 128, 8, True, fold_k=False)):
        assert not off.fold_k and not off.raw_k and off.q_copies == 0 and off.producer_regs == PRODUCER_REGS[2]
        assert off.s_dtype is off.dtype
    assert k.s_dtype is f16
    # bf16 folds too (``fold_k_bf16``): the scores' operands are then fp16
    on = DecodeSm90(bf16, 4, "channel", 128, 128, 8, True)
    assert on.fold_k and on.raw_k and on.s_dtype is f16 and not on.s_bf16 and on.is_bf16
    assert on.k_shift and not k.k_shift  # bf16's rows of Q o s shifted into fp16's range
    assert not DecodeSm90(bf16, 4, "token", 64, 128, 8, True, fold_k_bf16=True).fold_k


def test_sm90_fold_k_bf16_ptx(monkeypatch, tmp_path):
    """``fold_k_bf16``: a bf16 kernel whose scores' wgmma runs on fp16 operands (K's lop3
    halves, Q o s / mult rounded once from fp32) and whose P V wgmma stays bf16; spill-free,
    no serialized wgmmas; without the keyword the bf16 kernel has no fp16 wgmma."""
    import functools

    from bitdecode.kernels_sm90 import backend as sm90_backend
    from bitdecode.kernels_sm90.decode import DecodeSm90

    fmt, bf16 = KVFormat(4, "channel", 128), cutlass.BFloat16
    ptx = sm90_backend.compile_decode("sm_90a", fmt, bf16, 128, 8, True, keep_ptx=True).artifacts.PTX
    monkeypatch.setattr(DecodeSm90, "__init__", functools.partialmethod(DecodeSm90.__init__, fold_k_bf16=False))
    plain = sm90_backend.compile_decode("sm_90a", fmt, bf16, 128, 8, True, keep_ptx=True).artifacts.PTX
    assert ".f32.f16.f16" in ptx and ".f32.bf16.bf16" in ptx and "cvt.rn.f16x2.f32" in ptx
    assert ".f32.f16.f16" not in plain and ".f32.bf16.bf16" in plain
    report = ptxas.report(ptx, "sm_90a", tmp_path)
    assert ptxas.spill_bytes(report) == 0 and "C7514" not in report


def test_sm90_early_tiles_ptx(tmp_path):
    """``early_tiles``: with K's scale in Q the producer's first TMA loads come before the
    barrier that publishes Q (the late form issues them after it); spill-free, no
    serialized wgmmas, and the consumers' code untouched (the same wgmmas and lop3s)."""
    from bitdecode.kernels_sm90.decode import Barrier, DecodeSm90

    # (2-bit, GQA 4: one consumer, two CTAs an SM; Q's barrier is 256 threads)
    late, early = (_sm90_decode_ptx(DecodeSm90(cutlass.Float16, 2, "channel", 128, 128, 8, True, half_cols=True,
                                               consumers=1, early_tiles=on), KVFormat(2, "channel", 128))
                   for on in (False, True))
    q_barrier = re.compile(rf"bar.sync\s+{Barrier.q(1)}, 256;")

    def first_tile_before_q(ptx):
        return ptx.index("cp.async.bulk.tensor") < q_barrier.search(ptx).start()

    assert first_tile_before_q(early) and not first_tile_before_q(late)
    assert early.count("cp.async.bulk.tensor") == 2 * late.count("cp.async.bulk.tensor")  # (two issue sites)
    for instr in ("wgmma.mma_async", "lop3.b32", "ldmatrix"):
        assert early.count(instr) == late.count(instr), instr
    report = ptxas.report(early, "sm_90a", tmp_path)
    assert ptxas.spill_bytes(report) == 0 and "C7514" not in report


@pytest.mark.parametrize("bits, group, head_dim, heads, bf16", [(4, 128, 128, 8, False), (2, 128, 128, 4, False),
                                                                (4, 64, 64, 8, True), (4, 128, 256, 8, False)])
def test_sm90_wide_boxes_ptx(bits, group, head_dim, heads, bf16, tmp_path, monkeypatch):
    """``wide_boxes``: each packed tile's TMA box takes its rows folded into 128-byte ones
    (4-bit K and V at head dim 128: two rows, 2-bit K four, head dim 64 four; 256's 4-bit K
    rows are 128 bytes already and stay one), ldmatrix reads the same tile through the
    folded view: the same TMA issues, wgmmas, lop3s and ldmatrix loads as the narrow boxes'
    kernel, spill-free."""
    from bitdecode.kernels_sm90 import backend as sm90

    fmt, dtype = KVFormat(bits, "channel", group), cutlass.BFloat16 if bf16 else cutlass.Float16
    keywords = sm90.grid_keywords
    ptx, kernels = {}, {}
    for on in (False, True):
        monkeypatch.setattr(sm90, "grid_keywords", lambda *a, on=on: {**keywords(*a), "wide_boxes": on})
        kernels[on] = sm90.BACKEND.make_decode("sm_90a", fmt, dtype, head_dim, heads, True)
        ptx[on] = sm90.BACKEND.compile_decode("sm_90a", fmt, dtype, head_dim, heads, True,
                                              keep_ptx=True).artifacts.PTX
    narrow, wide = kernels[False], kernels[True]
    k_row, v_row = 4 * narrow.wk, 4 * narrow.wv  # bytes of a packed K row (a token), of a V row
    assert (narrow.k_box, narrow.v_box) == ((narrow.nr, k_row // 2), (head_dim, v_row // 2))
    k_fold, v_fold = max(1, 128 // k_row), max(1, 128 // v_row)
    assert (wide.k_fold, wide.v_fold) == (k_fold, v_fold)
    assert wide.k_box == (narrow.nr // k_fold, k_fold * k_row // 2)
    assert wide.v_box == (head_dim // v_fold, v_fold * v_row // 2)
    assert wide.tx_bytes == narrow.tx_bytes
    for instr in ("wgmma.mma_async", "lop3.b32", "ldmatrix", "cp.async.bulk.tensor"):
        assert ptx[True].count(instr) == ptx[False].count(instr), instr
    # the M-blocks of a packed tile are ldmatrix'd at an immediate offset from the first's
    # swizzled address with either box (``DecodeSm90.block_words``), not swizzled one by one
    offsets = {on: len(re.findall(r"ldmatrix[^\n]*\[%r\d+\+\d+\]", p)) for on, p in ptx.items()}
    assert offsets[True] == offsets[False], offsets
    if max(narrow.m_k, narrow.m_v) > 1:
        assert offsets[True] > 0, offsets
    report = ptxas.report(ptx[True], "sm_90a", tmp_path)
    assert ptxas.spill_bytes(report) == 0 and "C7514" not in report


def test_sm90_integer_4bit_split_decodes_merge_in_the_kernel():
    """``merges_in_kernel``: sm90's integer 4-bit split decodes (K per channel or token, both
    dtypes, the default and small grids' kernels) merge their splits in their last CTA, so
    their plans launch no combine; 2-bit, K4V2 and FP4 keep the combine kernel; an unsplit
    kernel never merges."""
    from bitdecode.kernels_sm90 import backend as sm90

    cases = ((KVFormat(4, "channel", 128), True), (KVFormat(4, "token", 64), True),
             (KVFormat(2, "channel", 128), False), (KVFormat(4, "channel", 128, v_bits=2), False),
             (KVFormat(fp4="nvfp4"), False))
    seen = set()
    for fmt, want in cases:
        for dtype in (cutlass.Float16, cutlass.BFloat16):
            for variant in ("", "small"):
                if sm90.grid_keywords(fmt, dtype is cutlass.Float16, 128, 4, variant) is None:
                    continue
                assert sm90.BACKEND.merges_splits("sm_90a", fmt, dtype, 128, 4, True, 1, variant) is want, (fmt, variant)
                assert not sm90.BACKEND.merges_splits("sm_90a", fmt, dtype, 128, 4, False, 1, variant)
                seen.add((want, variant))
    assert seen == {(True, ""), (True, "small"), (False, ""), (False, "small")}


@pytest.mark.parametrize("bits, variant", [(4, ""), (4, "small"), (2, "")])
def test_sm90_merge_splits_ptx(bits, variant, tmp_path, monkeypatch):
    """``merge_splits``: the split kernel compiles through ``call_merged`` (three more
    arguments: the merged output, its LSE, the arrival counters) with the last-CTA merge's
    GPU-scope acq_rel atomic (no fence), and the backend says it merges (so its plans launch no
    combine); the products' code is the plain split kernel's; spill-free."""
    from bitdecode.kernels_sm90 import backend as sm90

    fmt = KVFormat(bits, "channel", 128)
    keywords = sm90.grid_keywords
    ptx = {}
    for on in (False, True):
        monkeypatch.setattr(sm90, "grid_keywords", lambda *a, on=on: {**keywords(*a), "merge_splits": on})
        assert sm90.BACKEND.merges_splits("sm_90a", fmt, cutlass.Float16, 128, 4, True, 1, variant) is on
        assert not sm90.BACKEND.merges_splits("sm_90a", fmt, cutlass.Float16, 128, 4, False, 1, variant)
        ptx[on] = sm90.BACKEND.compile_decode("sm_90a", fmt, cutlass.Float16, 128, 4, True, keep_ptx=True,
                                              variant=variant).artifacts.PTX
    params = {on: len(re.findall(r"\.param\s", p.split("{", 1)[0])) for on, p in ptx.items()}
    assert params[True] > params[False]
    arrive = re.compile(r"atom\.global\.acq_rel\.add")  # (the count-in: ``merge_if_last``)
    assert not arrive.search(ptx[False]) and len(arrive.findall(ptx[True])) == 1
    assert ptx[True].count("fence.acq_rel.gpu") == ptx[False].count("fence.acq_rel.gpu")  # (the atomic's order)
    for instr in ("wgmma.mma_async", "lop3.b32", "ldmatrix", "cp.async.bulk.tensor"):
        assert ptx[True].count(instr) == ptx[False].count(instr), instr
    report = ptxas.report(ptx[True], "sm_90a", tmp_path)
    assert ptxas.spill_bytes(report) == 0 and "C7514" not in report


@pytest.mark.parametrize("bits, keywords", [
    (2, {"half_cols": True, "consumers": 1}),  # K's scale in Q (the scalers wait for Q), GQA 4
    (4, {"consumers": 2, "fold_k": False}),  # the 4-bit small grid's kernel
])
def test_sm90_early_loads_ptx(bits, keywords, tmp_path):
    """``early_loads``: right after the PDL wait the consumers issue Q's cp.async and the
    producer loads the sequence's first block-table entry, both before the sequence
    length's load (the late form issues them once the length is in); in the tile loop
    the block table is read only past the first page; spill-free, the consumers' code
    otherwise untouched."""
    from bitdecode.kernels_sm90.decode import DecodeSm90

    fmt = KVFormat(bits, "channel", 128)
    late, early = (_sm90_decode_ptx(DecodeSm90(cutlass.Float16, bits, "channel", 128, 128, 8, True, pdl=True,
                                               early_loads=on, **keywords), fmt) for on in (False, True))

    def prologue(ptx):  # from the PDL wait to the producer's register hand-back
        start = ptx.index("griddepcontrol.wait")
        return ptx[start:ptx.index("setmaxnreg.dec", start)]

    assert _global_reads(prologue(late)) == ["ld.global"]  # the length only
    assert _global_reads(prologue(early))[:3] == ["cp.async.cg", "ld.global", "ld.global"]  # Q, the table, the length
    # the loop's table reads are skipped on the first page: a branch around each of them
    assert _table_reads_skipped(early[early.index("setmaxnreg.dec"):]), "a tile's table read is not conditional"
    assert not _table_reads_skipped(late[late.index("setmaxnreg.dec"):])
    for instr in ("wgmma.mma_async", "lop3.b32", "ldmatrix", "cp.async.bulk.tensor"):
        assert early.count(instr) == late.count(instr), instr
    report = ptxas.report(early, "sm_90a", tmp_path)
    assert ptxas.spill_bytes(report) == 0 and "C7514" not in report


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("kernel", ["gemv", "small_m"])
def test_dense_residual_ahead_ptx(kernel, arch, tmp_path):
    """``residual_ahead``: the fused residual's 16-bit loads come before the first weight
    load (the late form reads it after the row's products); the products untouched; no
    spill."""
    from bitdecode import jit
    from bitdecode.kernels_sm80.dense import compile_gemm_small_m, compile_gemv

    opts = jit.compile_options(arch, keep_ptx=True)
    pdl = arch != "sm_80"

    def build(ahead):
        if kernel == "gemv":
            return compile_gemv(True, 4096, 1, False, opts, pdl=pdl, has_residual=True, residual_ahead=ahead)
        return compile_gemm_small_m(True, 4096, 8, opts, pdl=pdl, has_residual=True, residual_ahead=ahead)

    late, ahead = (build(on).artifacts.PTX for on in (False, True))
    weights = "ld.global.nc.L1::no_allocate.v4.u32"  # (the weights' stream loads)

    def residual_before_weights(ptx):
        return re.search(r"ld\.global\.(b16|u16)", ptx).start() < ptx.index(weights)

    assert residual_before_weights(ahead) and not residual_before_weights(late)
    for instr in ("fma.rn.f32", "mma.sync"):
        assert ahead.count(instr) == late.count(instr), instr
    assert ptxas.spill_bytes(ptxas.report(ahead, arch, tmp_path)) == 0


def test_sm90_early_residual_ptx(tmp_path):
    """``early_residual``: the small grid's kernel (one CTA an SM) copies the residual
    block's first sub-tile (cp.async, 16-bit K and V rows) before its first wgmma, into a
    buffer of its own; the default grid's kernels (two CTAs an SM: no room beside the rings)
    and the appending ones do not take it; spill-free.  (The small grids take it by default:
    ``kernels_sm90.backend.EARLY_ISSUE``.)"""
    from bitdecode.kernels_sm90.backend import small_grid
    from bitdecode.kernels_sm90.decode import DecodeSm90

    fmt = KVFormat(2, "channel", 128)
    small = small_grid(fmt, True, 128, 4)
    assert small["early_residual"]
    late, early = (DecodeSm90(cutlass.Float16, 2, "channel", 128, 128, 8, True, half_cols=True,
                              **{**small, "early_residual": on}) for on in (False, True))
    assert early.early_residual and early.ctas_per_sm == 1 and early.num_stages == late.num_stages
    assert not DecodeSm90(cutlass.Float16, 2, "channel", 128, 128, 8, True, half_cols=True, consumers=1,
                          early_residual=True).early_residual  # (two CTAs an SM)
    assert not DecodeSm90(cutlass.Float16, 2, "channel", 128, 128, 8, True, half_cols=True, append=True,
                          **small).early_residual
    late_ptx, early_ptx = (_sm90_decode_ptx(k, fmt) for k in (late, early))

    def copies_before_first_mma(ptx):
        return ptx[:ptx.index("wgmma.mma_async")].count("cp.async.cg")

    extra = early_ptx.count("cp.async.cg") - late_ptx.count("cp.async.cg")
    assert extra > 0 and copies_before_first_mma(early_ptx) == copies_before_first_mma(late_ptx) + extra
    assert early_ptx.count("lop3.b32") == late_ptx.count("lop3.b32")  # (the packed loop untouched)
    # the first sub-tile's products, peeled out of the residual loop: 8 + 8 wgmmas at head dim 128
    assert early_ptx.count("wgmma.mma_async") == late_ptx.count("wgmma.mma_async") + 16
    report = ptxas.report(early_ptx, "sm_90a", tmp_path)
    assert ptxas.spill_bytes(report) == 0 and "C7514" not in report


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_sm80_early_loads_ptx(arch, tmp_path):
    """``DecodeSm80(early_loads=True)``: the sequence's first block-table entry and the
    length are loaded before Q's cp.async and the first tiles' (the late form loads the
    length alone first, and each tile's entry after it); tiles on the first page read no
    table; spill-free, the loop's MMAs and dequantization untouched."""
    from bitdecode.kernels_sm80.decode import DecodeSm80

    fmt = KVFormat(4, "channel", 128)
    late, early = (_sm90_decode_ptx(DecodeSm80(cutlass.Float16, 4, "channel", 128, 128, 8, True,
                                               pdl=arch != "sm_80", early_loads=on), fmt, arch)
                   for on in (False, True))

    assert _global_reads(late)[:3] == ["ld.global", "cp.async.cg", "ld.global"]  # the length, Q, a tile's entry
    assert _global_reads(early)[:3] == ["ld.global", "ld.global", "cp.async.cg"]  # the table, the length, Q
    early_tiles, late_tiles = (ptx[ptx.index("cp.async.cg"):] for ptx in (early, late))  # (past the length)
    assert _table_reads_skipped(early_tiles) and not _table_reads_skipped(late_tiles)
    for instr in ("mma.sync", "lop3.b32", "ldmatrix"):
        assert early.count(instr) == late.count(instr), instr
    report = ptxas.report(early, arch, tmp_path)
    assert ptxas.spill_bytes(report) == 0


def test_sm90_consumers_config(tmp_path):
    """Consumer warpgroups a CTA: two in one CTA an SM for 2-bit with K's scale in Q (the
    measured default), one (two CTAs an SM) elsewhere; the split heuristic counts the CTAs
    the kernel is built for.  Several consumers vote and wait on their own named barriers
    (ids in registers), hand their state to consumer 0 through one barrier of all of them,
    and three at 64-token steps fit their 152 registers."""
    import torch

    from bitdecode.kernels_sm90 import backend as sm90
    from bitdecode.kernels_sm90.decode import SCALER_REGS, Barrier, DecodeSm90

    f16, bf16 = cutlass.Float16, cutlass.BFloat16
    two = DecodeSm90(f16, 2, "channel", 128, 128, 8, True)
    assert two.consumers == 2 and two.ctas_per_sm == 1 and two.consumer_regs == 224
    for one in (DecodeSm90(bf16, 2, "channel", 128, 128, 8, True, fold_k_bf16=False),  # no K scale in Q
                DecodeSm90(f16, 4, "channel", 128, 128, 8, True), DecodeSm90(f16, 2, "channel", 128, 256, 8, True)):
        assert one.consumers == 1
    fmt2 = KVFormat(2, "channel", 128)
    assert sm90.BACKEND.ctas_per_sm(fmt2, 128, 8, torch.float16) == 1
    assert sm90.BACKEND.ctas_per_sm(fmt2, 128, 8, torch.bfloat16) == 1  # bf16 folds K too
    assert sm90.BACKEND.ctas_per_sm(KVFormat(4, "channel", 128), 128, 8, torch.float16) == 2
    three = DecodeSm90(f16, 4, "channel", 128, 128, 8, True, consumers=3, step=64)
    assert three.ctas_per_sm == 1 and three.consumer_regs == (65536 - 128 * SCALER_REGS) // (3 * 128)
    assert three.num_stages == 9 and Barrier.done(3) < 16
    with pytest.raises(AssertionError, match="at most four consumers"):
        DecodeSm90(f16, 4, "channel", 128, 128, 8, True, consumers=5)
    ptx = _sm90_decode_ptx(three, KVFormat(4, "channel", 128))
    def has(pattern):
        return re.search(pattern.replace(" ", r"\s+"), ptx) is not None

    assert has(r"bar\.red\.or\.pred q, %r\d+, 128, p;"), "the lazy vote's barrier is not the consumer's own"
    assert has(r"bar\.sync %r\d+, 128;"), "the consumers' barriers are not per consumer (run-time ids)"
    assert has(rf"bar\.sync {Barrier.done(3)}, 384;") and has(rf"bar\.arrive {Barrier.done(3)}, 384;")
    assert has(rf"bar\.sync {Barrier.q(3)}, 512;")  # Q: every consumer and the scalers
    report = ptxas.report(ptx, "sm_90a", tmp_path)
    assert ptxas.spill_bytes(report) == 0 and "C7514" not in report


def test_sm90_v_subnormal(tmp_path):
    """``v_subnormal``: V^T's codes without the fix-up fma (fewer ``fma.rn.f16x2`` than with
    centered codes, the same lop3 count), no spills; by default (``V_SUBNORMAL_AUTO``) only
    where it applies; refused where the codes are not 2-bit fp16 with V's scale in P."""

    from bitdecode.kernels_sm90 import decode as d90
    from bitdecode.kernels_sm90.decode import DecodeSm90

    f16 = cutlass.Float16
    counts = {}
    for sub, room in ((False, 0), (True, 2), (True, 0)):
        k = DecodeSm90(f16, 2, "channel", 128, 128, 8, True, half_cols=True, consumers=1, v_subnormal=sub,
                       v_sub_room=room)
        ptx = _sm90_decode_ptx(k, KVFormat(2, "channel", 128))
        counts[sub, room] = (ptx.count("fma.rn.f16x2"), ptx.count("lop3.b32"))
        assert ptxas.spill_bytes(ptxas.report(ptx, "sm_90a", tmp_path)) == 0
    for room in (2, 0):  # (``v_sub_room`` 0: a shift a pair instead of every two, the same lop3s)
        assert counts[True, room][0] < counts[False, 0][0] and counts[True, room][1] == counts[False, 0][1], counts
    with pytest.raises(ValueError, match="v_sub_room"):
        DecodeSm90(f16, 2, "channel", 128, 128, 8, True, v_subnormal=True, v_sub_room=1)
    auto = {(dt, bits, g): DecodeSm90(dt, bits, "channel", g, 128, 8, True).v_subnormal
            for dt in (f16, cutlass.BFloat16) for bits in (2, 4) for g in (32, 128)}
    assert auto == {key: d90.V_SUBNORMAL_AUTO and key == (f16, 2, 128) for key in auto}, auto
    assert DecodeSm90(f16, 4, "channel", 128, 128, 8, True, v_bits=2).v_subnormal == d90.V_SUBNORMAL_AUTO
    for refused in ({"dtype": cutlass.BFloat16}, {"bits": 4}, {"group_size": 32}):
        kw = {"dtype": f16, "bits": 2, "group_size": 128, **refused}
        with pytest.raises(ValueError, match="v_subnormal"):
            DecodeSm90(kw["dtype"], kw["bits"], "channel", kw["group_size"], 128, 8, True, v_subnormal=True)


def test_sm90_v_through_shared_memory(tmp_path):
    """``v_slots``: the producer warpgroup's warps 1-3 store V^T with stmatrix into 32 KB
    slots of a step and the P V wgmma reads A from shared memory (SS, two descriptors), the
    scores' wgmma still from registers; the slots come out of the ring's shared memory and
    the producer keeps more registers; slot counts a consumer's release could deadlock on,
    and kernels without K's scale in Q or V's in P, are refused."""

    from bitdecode.kernels_sm90.decode import VT_SCALER_REGS, DecodeSm90

    f16 = cutlass.Float16
    one = DecodeSm90(f16, 2, "channel", 128, 128, 8, True, half_cols=True, consumers=1, v_slots=1)
    plain = DecodeSm90(f16, 2, "channel", 128, 128, 8, True, half_cols=True, consumers=1)
    assert one.vt_bytes == 128 * 128 * 2 and one.producer_regs == VT_SCALER_REGS and one.steps == 2
    assert one.num_stages < plain.num_stages and one.ctas_per_sm == plain.ctas_per_sm == 2
    with pytest.raises(ValueError, match="at least 3 with 2 consumers"):
        DecodeSm90(f16, 2, "channel", 128, 128, 8, True, consumers=2, v_slots=2)
    with pytest.raises(ValueError, match="fold_k"):
        DecodeSm90(f16, 2, "channel", 128, 128, 8, True, fold_k=False, v_slots=1)
    for refused in ({"fold_v": False}, {"group_size": 64}):  # V's scale in V^T; two V groups a row (two P^T copies)
        with pytest.raises(ValueError, match="fold_v"):
            DecodeSm90(f16, 2, "channel", refused.get("group_size", 128), 128, 8, True, v_slots=3,
                       **{k: v for k, v in refused.items() if k != "group_size"})
    ptx = _sm90_decode_ptx(one, KVFormat(2, "channel", 128))
    mmas = [line for line in ptx.splitlines() if "wgmma.mma_async" in line]
    ss = [line for line in mmas if not re.search(r"\}, \{", line)]
    # P V: 2 steps x 2 channel M-blocks x 8 token k-blocks from shared memory
    assert len(ss) == 2 * 2 * 8 and len(mmas) > len(ss), (len(ss), len(mmas))
    # three decoder warps take the 8 slabs in 3 rounds: 3 x 8 k-blocks x 2 steps stores
    assert ptx.count("stmatrix.sync.aligned.m8n8.x4.shared.b16") == 3 * 8 * 2
    report = ptxas.report(ptx, "sm_90a", tmp_path)
    assert ptxas.spill_bytes(report) == 0 and "C7514" not in report


def test_sm90_small_grid_variant(monkeypatch, tmp_path, h200_sms):
    """Grids of few (sequence, KV head) pairs (B <= 2 at Hkv=8 on 132 SMs) take the one-CTA
    kernel with two consumers and K's scale not in Q, for the formats it was measured on;
    the split heuristic and the plan follow the same choice, the JIT cache keeps the two
    kernels apart, ``bitdecode compile`` lists it, and it compiles without spills."""
    import torch

    from bitdecode import jit
    from bitdecode.kernels_sm80 import backend as sm80_backend
    from bitdecode.kernels_sm90 import backend as sm90

    be, fmt, f16 = sm90.BACKEND, KVFormat(4, "channel", 128), torch.float16
    dev = torch.device("cpu")
    assert be.grid_variant(fmt, f16, 128, 8, 1, 8, 1, dev) == "small"
    assert be.grid_variant(fmt, f16, 128, 8, 2, 8, 1, dev) == "small"
    assert be.grid_variant(fmt, f16, 128, 4, 1, 8, 1, dev) == "small"  # the 4-head tile (GQA <= 4)
    for args in ((fmt, f16, 128, 8, 3, 8, 1), (fmt, torch.bfloat16, 128, 8, 1, 8, 1), (fmt, f16, 64, 8, 1, 8, 1),
                 (fmt, f16, 128, 16, 1, 8, 1), (fmt, f16, 128, 8, 1, 8, 2), (KVFormat(2, "channel", 128), f16, 128, 8, 1, 8, 1),
                 (KVFormat(4, "channel", 32), f16, 128, 8, 1, 8, 1), (KVFormat(4, "token", 64), f16, 128, 8, 1, 8, 1)):
        assert be.grid_variant(*args, dev) == "", args
    small = be.make_decode("sm_90a", fmt, cutlass.Float16, 128, 8, True, variant="small")
    assert small.consumers == 2 and not small.fold_k and small.ctas_per_sm == 1
    assert be.ctas_per_sm(fmt, 128, 8, f16, "small") == 1 and be.ctas_per_sm(fmt, 128, 8, f16) == 2
    # 2-bit with the 4-head tile: one consumer, two CTAs an SM, and the small grid's two
    # consumers in one CTA keep K's scale in Q; its 8-head tile keeps two consumers everywhere
    two = KVFormat(2, "channel", 128)
    assert be.grid_variant(two, f16, 128, 4, 1, 8, 1, dev) == "small"
    assert be.grid_variant(two, f16, 128, 4, 3, 8, 1, dev) == ""
    default2, small2 = (be.make_decode("sm_90a", two, cutlass.Float16, 128, 4, True, variant=v) for v in ("", "small"))
    assert (default2.consumers, default2.ctas_per_sm, small2.consumers, small2.ctas_per_sm) == (1, 2, 2, 1)
    assert default2.fold_k and small2.fold_k
    assert be.make_decode("sm_90a", two, cutlass.Float16, 128, 8, True).consumers == 2
    with pytest.raises(ValueError, match="no small-grid variant"):
        be.make_decode("sm_90a", two, cutlass.Float16, 128, 8, True, variant="small")
    # ... and at B=16 (128 pairs: more than half the SMs) one split of it for short sequences
    cache2 = _cache_stand_in(two, f16, tokens=256)
    assert be.choose_splits(cache2, (16, 1, 32, 128), sm90.SHORT_TILES[2] * 256, dev) == 1
    assert be.choose_splits(cache2, (16, 1, 32, 128), sm90.SHORT_TILES[2] * 256 + 1, dev) == 2
    assert be.choose_splits(cache2, (8, 1, 32, 128), 4096, dev) == 4  # 64 pairs: the default kernel
    assert be.grid_variant(two, f16, 128, 4, 16, 8, 1, dev, splits=1) == "small"
    assert be.grid_variant(two, f16, 128, 4, 16, 8, 1, dev, splits=2) == ""
    assert be.grid_variant(two, f16, 128, 4, 17, 8, 1, dev, splits=1) == ""  # 136 pairs: not one wave
    # 4-bit: the same for its 4-head tile (128-token tiles), not for its 8-head one
    cache4 = _cache_stand_in(fmt, f16)
    assert be.choose_splits(cache4, (16, 1, 32, 128), sm90.SHORT_TILES[4] * 128, dev) == 1
    assert be.choose_splits(cache4, (16, 1, 32, 128), sm90.SHORT_TILES[4] * 128 + 1, dev) == 2
    assert be.choose_splits(cache4, (16, 1, 64, 128), 4096, dev) == 2  # GQA 8: the 8-head tile
    assert be.choose_splits(cache4, (8, 1, 32, 128), 4096, dev) == 4  # 64 pairs: half the SMs
    assert be.grid_variant(fmt, f16, 128, 4, 16, 8, 1, dev, splits=1) == "small"
    assert be.grid_variant(fmt, f16, 128, 8, 16, 8, 1, dev, splits=1) == ""
    bf16 = _cache_stand_in(fmt, torch.bfloat16)
    assert be.choose_splits(bf16, (16, 1, 32, 128), 4096, dev) == 1  # bf16 too (4-head tile)
    assert be.choose_splits(bf16, (16, 1, 64, 128), 4096, dev) == 2  # not its 8-head tile
    assert be.grid_variant(fmt, torch.bfloat16, 128, 4, 1, 8, 1, dev) == "small"
    assert be.grid_variant(two, torch.bfloat16, 128, 4, 1, 8, 1, dev) == ""  # 2-bit: fp16 only
    # ... but bf16's 4-head tile runs one consumer (two CTAs an SM) at every grid, with K's scale in Q
    default2b = be.make_decode("sm_90a", two, cutlass.BFloat16, 128, 4, True)
    assert (default2b.consumers, default2b.ctas_per_sm, default2b.fold_k) == (1, 2, True)
    assert be.make_decode("sm_90a", two, cutlass.BFloat16, 128, 8, True).consumers == 2
    with pytest.raises(ValueError, match="no variant 'tiny'"):
        be.make_decode("sm_90a", fmt, cutlass.Float16, 128, 8, True, variant="tiny")
    with pytest.raises(ValueError, match="no variant 'small'"):
        sm80_backend.BACKEND.make_decode("sm_80", fmt, cutlass.Float16, 128, 8, True, variant="small")
    cache = _cache_stand_in(fmt, f16)
    assert be.choose_splits(cache, (1, 1, 32, 128), 131072, dev) == 16  # one CTA an SM
    # a small grid's very short sequences: unsplit (GQA 4: the 4-head tile), else split
    assert be.choose_splits(cache, (1, 1, 32, 128), sm90.DIRECT_TILES[4] * 128, dev) == 1
    assert be.choose_splits(cache, (1, 1, 32, 128), sm90.DIRECT_TILES[4] * 128 + 1, dev) > 1
    assert be.choose_splits(cache, (1, 1, 64, 128), sm90.DIRECT_TILES[4] * 128, dev) > 1  # GQA 8
    assert be.choose_splits(cache, (4, 1, 32, 128), sm90.DIRECT_TILES[4] * 128, dev) > 1  # not a small grid
    assert be.choose_splits(cache2, (1, 1, 32, 128), 512, dev) == 1  # 2-bit: sm80's heuristic already
    assert be.choose_splits(cache, (2, 1, 32, 128), 131072, dev) == 8  # one CTA an SM, 16 pairs
    assert be.choose_splits(cache, (3, 1, 32, 128), 131072, dev) == 11  # two CTAs an SM, 24 pairs
    built = []
    monkeypatch.setattr(jit.KERNELS, "get", lambda key, make: built.append(key))
    be.decode_kernel("sm_90a", fmt, cutlass.Float16, 128, 8, True)
    be.decode_kernel("sm_90a", fmt, cutlass.Float16, 128, 8, True, variant="small")
    assert built[0] != built[1] and built[1][-2:] == ("small", "merged")  # (4-bit: ``merges_in_kernel``)
    listed = be.variants(("decode",), [fmt, KVFormat(2, "channel", 128)], [128], ["fp16", "bf16"])
    assert [v.name for v in listed if v.extra[-1] == "small"] == [
        f"decode_fp16_d128_4bit_channel_g128_h{nh}_{split}_small" for nh in (4, 8) for split in ("direct", "split")] + [
        f"decode_fp16_d128_2bit_channel_g128_h4_{split}_small" for split in ("direct", "split")] + [
        f"decode_bf16_d128_4bit_channel_g128_h4_{split}_small" for split in ("direct", "split")]
    # the kernel B=1 at GQA 4 runs: the small grid's, with the 4-head tile
    v = next(v for v in listed if v.extra == ("h4", "split", "small"))
    report = ptxas.report(be.compile_variant("sm_90a", v, keep_ptx=True).artifacts.PTX, "sm_90a", tmp_path)
    assert ptxas.spill_bytes(report) == 0 and "C7514" not in report


def test_sm90_lazy_margin_keeps_fp16_p_finite():
    """The lazy maximum lets P reach 2^lazy_margin; with V's scale folded into P^T (fp16)
    that times the largest scale an fp16 V can have, (65504 - -65504) / (2^bits - 1), must
    stay under fp16's 65504 for every V width.  Without V's scale in P (small V groups,
    FP4) or in bf16, P itself must."""
    from bitdecode.kernels_sm90.decode import DecodeSm90

    f16, bf16 = cutlass.Float16, cutlass.BFloat16
    fp16_max = 65504.0
    for bits, v_bits in ((4, 4), (2, 2), (4, 2), (2, 4)):
        k = DecodeSm90(f16, bits, "channel", 128, 128, 8, True, v_bits=v_bits)
        assert k.lazy_max and k.fold_v
        assert 2 ** k.lazy_margin * (2 * fp16_max / (2 ** v_bits - 1)) < fp16_max, (bits, v_bits, k.lazy_margin)
    for k in (DecodeSm90(bf16, 2, "channel", 128, 128, 8, True),
              DecodeSm90(f16, 4, "channel", 32, 128, 8, True),  # V groups inside an M-block: plain P
              DecodeSm90(f16, 4, "channel", 128, 128, 8, True, fp4="nvfp4")):
        assert 1.0 <= 2 ** k.lazy_margin < fp16_max
    assert not DecodeSm90(f16, 4, "channel", 128, 128, 8, True, lazy_max=False).lazy_max


@pytest.mark.parametrize("bits, mode, group, v_bits, dtype, d, nh, fp4, step", [
    (4, "channel", 128, 4, "fp16", 128, 8, None, 128),
    (4, "token", 64, 4, "bf16", 128, 8, None, 128),
    (2, "channel", 128, 2, "fp16", 128, 8, None, 128),  # measured 3-12 % faster than 64 (H200)
    (2, "channel", 64, 2, "bf16", 64, 8, None, 128),
    (2, "token", 64, 2, "fp16", 128, 8, None, 64),  # never timed at 128
    (4, "channel", 128, 2, "fp16", 128, 8, None, 64),  # mixed widths: never timed at 128
    (4, "channel", 128, 4, "fp16", 256, 8, None, 64),  # registers
    (4, "channel", 128, 4, "fp16", 128, 16, None, 64),
    (4, "token", 16, 4, "fp16", 128, 8, "nvfp4", 64),  # its block scales spill at 128
    (4, "token", 32, 4, "bf16", 128, 8, "mxfp4", 128),
])
def test_sm90_softmax_step_per_format(bits, mode, group, v_bits, dtype, d, nh, fp4, step):
    """Tokens per softmax step of the sm90 decode, as measured (``DecodeSm90.step``)."""
    from bitdecode.kernels_sm90.decode import DecodeSm90

    k = DecodeSm90(_dtype(dtype), bits, mode, group, d, nh, True, v_bits=v_bits, fp4=fp4)
    assert k.step == step


def test_sm90_raw_k_all_drops_the_2bit_k_fixup(monkeypatch, tmp_path):
    """``raw_k_all`` (on by default; off is the A/B baseline): 2-bit K per channel takes the
    lop3 halves as 4-bit does, the scalers dividing Q o s by each k-block's multiplier,
    looked up at run time: the multiplier table is the dequant steps' (pair 2 kb + half of a
    word), the K fix-up fmas leave the PTX, nothing spills; 4-bit, whose multipliers are the
    same in every k-block, keeps its immediates."""
    import functools

    from bitdecode.kernels_sm90 import backend as sm90_backend
    from bitdecode.kernels_sm90.decode import DecodeSm90
    from bitdecode.layouts import packing

    f16 = cutlass.Float16
    two = DecodeSm90(f16, 2, "channel", 128, 128, 8, True)
    steps = packing.dequant_steps(2, "fp16")
    assert two.raw_k and not two.k_mult_uniform
    assert not DecodeSm90(f16, 2, "channel", 128, 128, 8, True, raw_k_all=False).raw_k
    for kb in range(two.kpw_k):
        for half in range(2):
            mult = steps[2 * kb + half].mult
            assert two.k_mult[kb][half] == mult and 1 << (two.k_mult_log2 >> 4 * (2 * kb + half) & 0xF) == mult
    assert DecodeSm90(f16, 4, "channel", 128, 128, 8, True).k_mult_uniform
    fmt = KVFormat(2, "channel", 128)
    raw = sm90_backend.compile_decode("sm_90a", fmt, f16, 128, 8, True, keep_ptx=True).artifacts.PTX
    monkeypatch.setattr(DecodeSm90, "__init__", functools.partialmethod(DecodeSm90.__init__, raw_k_all=False))
    exact = sm90_backend.compile_decode("sm_90a", fmt, f16, 128, 8, True, keep_ptx=True).artifacts.PTX
    assert raw.count("fma.rn.f16x2") < exact.count("fma.rn.f16x2") - 100
    report = ptxas.report(raw, "sm_90a", tmp_path)
    assert ptxas.spill_bytes(report) == 0 and "C7514" not in report


def test_bound_arguments_are_converted_once_for_tvm_ffi_functions():
    """A plan's fixed arguments (the cache's tensors) become TVM-FFI tensors once when every
    kernel it calls is a raw TVM-FFI function (``jit._positional``; on a GPU, checked by
    ``test_plans_hold_their_cache_tensors_as_tvm_ffi_tensors``): views of the same storage,
    not copies; with any other callable among the kernels they stay torch tensors."""
    import torch
    import tvm_ffi

    from bitdecode import jit

    fn = tvm_ffi.get_global_func("testing.nop")
    t = torch.arange(4.0)
    bound = jit.bound_arguments((t, 7), fn, fn)
    assert isinstance(bound[0], tvm_ffi.Tensor) and bound[1] == 7
    t.add_(1)  # the converted tensor aliases t's storage
    assert torch.equal(torch.from_dlpack(bound[0]), t)
    fn(*bound)
    assert jit.bound_arguments((t,), fn, lambda *a: None)[0] is t


def test_per_stream_values():
    """``jit.PerStream``, what the decode plans' split workspaces and output chunks and the
    BitNet GEMM's split-K workspace are kept in: one value per stream, made once and kept
    while ``keep`` accepts it, remade when it does not (the same stream's slot), the oldest
    stream dropped past ``limit``."""
    from bitdecode import jit

    made = []

    def make(tag):
        def f():
            made.append(tag)
            return [tag]
        return f

    cache = jit.PerStream(limit=2)
    a = cache.get("s1", make("a"))
    assert cache.get("s1", make("x")) is a and made == ["a"]
    a.pop()  # used up: ``keep=bool`` asks for a new one on the same stream
    b = cache.get("s1", make("b"), keep=bool)
    assert b == ["b"] and made == ["a", "b"]
    cache.get("s2", make("c"))
    cache.get("s3", make("d"))  # past the limit: s1, the oldest, goes
    assert list(cache.values()) == [["c"], ["d"]]
    assert cache.get("s1", make("e")) == ["e"]


def test_sm90_weighted_tail(monkeypatch, h200_sms):
    """Where the default kernel's whole waves leave SM slots free (B=16 Hkv=8 on 132 SMs:
    256 CTAs on 264 slots; B=28: 224), the sm90 split heuristic takes one more split, whose
    tail's tiles end with the long splits' on the free slots (the fixed-cost model of
    ``tail_weight``: a fluid at 4 bits, whole rounds at 2, the same where the rounds are
    many), and the plan hands the weight to the kernel; even splits elsewhere:
    no free slot, the small grid, short sequences, formats it was not measured on, sm80."""
    import torch

    from bitdecode import emulate_sm100 as emulate
    from bitdecode.kernels_sm80 import backend as sm80_backend
    from bitdecode.kernels_sm90 import backend as sm90

    be, dev, even = sm90.BACKEND, torch.device("cpu"), sm80.TAIL_UNIT

    for bits, tokens in ((4, 128), (2, 256)):
        cache = _cache_stand_in(KVFormat(bits, "channel", 128))
        for b, n, splits in ((16, 65536, 3), (28, 32768, 2), (8, 65536, 5)):
            pairs, shape = b * 8, (b, 1, 32, 128)
            assert be.choose_splits(cache, shape, n, dev) == splits
            w = be.tail_weight(cache, shape, splits, n, dev)
            long, tail = (emulate.split_tiles(n, tokens, s, splits, w)[:2] for s in (0, splits - 1))
            long, tail = long[1] - long[0], tail[1] - tail[0]
            # the tails (each with its fixed time) on the free slots, as long as a long split:
            # 4-bit as a fluid, 2-bit in whole rounds of the free slots
            free, f = 264 - pairs * (splits - 1), sm90.CTA_FIXED_TILES
            assert w > even and 1 <= tail < long, (b, w, long, tail)
            if bits == 4:
                assert abs(pairs * (tail + f) - free * (long + f)) <= pairs + free * w / even, (b, w, long, tail)
            else:
                rounds = -(-pairs // free)
                assert abs(rounds * (tail + f) - (long + f)) <= rounds + w / even, (b, w, long, tail)
            be.tails = False  # the A/B switch: even splits in whole waves
            try:
                # (one split's CTAs fill fewer than all slots at B=28: the wave model's count)
                untailed = be.half_full_splits(cache, shape, n, dev, 0) if splits == 2 else splits - 1
                assert be.choose_splits(cache, shape, n, dev) == untailed
                assert be.tail_weight(cache, shape, splits, n, dev) == even
            finally:
                be.tails = True
        # even: no free slot (B=3: 11 splits of 24 pairs fill 264), a heavy tail where the
        # even choice already splits (B=12: 3 splits would take weight 22 / 16), the small
        # grid (B=1), short sequences, sm80
        assert be.choose_splits(cache, (3, 1, 32, 128), 65536, dev) == 11
        assert be.tail_weight(cache, (12, 1, 32, 128), 3, 32768, dev) < sm90.MIN_TAIL_WEIGHT
        assert be.choose_splits(cache, (12, 1, 32, 128), 32768, dev) == 2
        assert be.tail_weight(cache, (1, 1, 32, 128), 16, 131072, dev) == even
        assert be.tail_weight(cache, (16, 1, 32, 128), 3, sm90.TAIL_MIN_TOKENS - 1, dev) == even
        assert sm80_backend.BACKEND.tail_weight(cache, (16, 1, 32, 128), 3, 65536, dev) == even
    assert be.tail_weight(_cache_stand_in(KVFormat(4, "token", 128)), (16, 1, 32, 128), 3, 65536, dev) == even
    # the plan takes it (and an unsplit plan has none)
    cache = _cache_stand_in(KVFormat(4, "channel", 128))
    made = []
    monkeypatch.setattr(sm80_backend, "DecodePlan", lambda *args, **kw: made.append(args[-1]))
    monkeypatch.setattr(be, "decode_kernel", lambda *args, **kw: None)
    monkeypatch.setattr(sm80_backend, "_combine_kernel", lambda *args: None)
    monkeypatch.setattr(sm80_backend.jit, "target_arch", lambda index: "sm_90a")
    for splits in (3, 1):
        be.plan(cache, (16, 1, 32, 128), torch.float16, dev, splits, max_len=65536)
    assert made == [be.tail_weight(cache, (16, 1, 32, 128), 3, 65536, dev), even] and made[0] > even


def test_sm90_splits_past_one_wave_and_short_tails(h200_sms):
    """Where the pairs outnumber the default kernel's 264 slots by up to 1.75x (B=33-58 at
    Hkv=8 on 132 SMs), sm90 splits each pair in 2 or 4 by the whole-wave model, and keeps
    one split past that and on formats it was not measured on; after one even
    split a weighted tail from 16K tokens at 4 bits and 4K at 2 bits (the measured points
    of ``MANY_PAIRS_MAX`` and ``ONE_SPLIT_TAIL_MIN_TOKENS``)."""
    import torch

    from bitdecode.kernels_sm90 import backend as sm90

    be, dev, even = sm90.BACKEND, torch.device("cpu"), sm80.TAIL_UNIT

    def splits(bits, b, n, k_mode="channel"):
        return be.choose_splits(_cache_stand_in(KVFormat(bits, k_mode, 128)), (b, 1, 32, 128), n, dev)

    # 4-bit: measured fastest (or within 1 % of it) at these counts
    for b, n, want in ((36, 32768, 4), (40, 32768, 4), (48, 32768, 2), (56, 32768, 4), (40, 16384, 4),
                       (48, 8192, 2), (64, 32768, 1), (66, 16384, 1), (96, 8192, 1), (128, 4096, 1)):
        assert splits(4, b, n) == want, (b, n)
    for b, n, want in ((40, 32768, 4), (48, 32768, 2), (56, 16384, 4), (64, 16384, 1)):
        assert splits(2, b, n) == want, (b, n)
    # each split keeps two tiles; K per token keeps one split
    assert (splits(4, 40, 512), splits(4, 40, 256)) == (2, 1)
    assert splits(4, 40, 32768, k_mode="token") == 1
    assert sm90.wave_splits(264, 264, 256) == sm90.wave_splits(463, 264, 256) == 1
    # after one even split (B=17-32), a tail from 16K tokens (4-bit) or 4K (2-bit), where
    # the wave model has it ahead of several even splits (``half_full_splits``)
    assert (splits(4, 28, 16384), splits(4, 28, 8192)) == (2, 1)
    assert (splits(2, 20, 4096), splits(2, 20, 2048)) == (2, 1)
    assert be.tail_weight(_cache_stand_in(KVFormat(4, "channel", 128)), (20, 1, 32, 128), 2, 16384, dev) > even


def test_sm90_even_waves_where_one_split_leaves_slots_idle(h200_sms):
    """Where one split's CTAs fill more than half the 264 slots but not all (B=17-33 at Hkv=8
    on 132 SMs), sm90 takes the even count whose whole waves end soonest where the model
    has it ahead of one split, or of one split and a weighted tail (the counts below timed
    fastest or within 3 % of it, profiles/h200/splits_band_*.json and the thirty-second
    session's notes); the model's tail time matches a list-scheduling simulation of the
    CTAs."""
    import heapq

    import torch

    from bitdecode.kernels_sm90 import backend as sm90

    be, dev = sm90.BACKEND, torch.device("cpu")

    def splits(bits, b, n, k_mode="channel", hq=32, tq=1):
        return be.choose_splits(_cache_stand_in(KVFormat(bits, k_mode, 128)), (b, tq, hq, 128), n, dev)

    for b, n, want in ((17, 8192, 5), (17, 16384, 5), (20, 8192, 3), (20, 16384, 3), (24, 32768, 4),
                       (24, 65536, 4), (28, 16384, 2), (28, 32768, 2), (32, 16384, 1)):
        assert splits(4, b, n) == want, (4, b, n)
    # 2-bit: a tail in whole rounds (``WHOLE_ROUNDS_BITS``) wins up to B=28 but at B=17-18
    # from 32K tokens
    for b, n, want in ((17, 4096, 2), (17, 32768, 5), (18, 65536, 9), (20, 4096, 2), (20, 32768, 2),
                       (24, 16384, 2), (24, 65536, 2), (28, 32768, 2), (32, 16384, 1)):
        assert splits(2, b, n) == want, (2, b, n)
    # B=16 (128 pairs: half the slots) keeps the fill rule's 2 and a tail; unmeasured formats,
    # and more than one query token, one split (and a tail)
    assert splits(4, 16, 65536) == 3
    assert splits(4, 17, 32768, k_mode="token") == 1
    assert splits(4, 17, 32768, tq=2) == 2

    def simulated(pairs, slots, tiles, n_splits, weight, fixed=sm90.CTA_FIXED_TILES):
        """Each CTA, long splits first, on the slot that frees first."""
        unit = sm80.TAIL_UNIT
        per = -(-tiles * weight // (weight * (n_splits - 1) + unit))
        ctas = [per + fixed] * (pairs * (n_splits - 1)) + [tiles - (n_splits - 1) * per + fixed] * pairs
        free, end = [0.0] * slots, 0.0
        for t in ctas:
            done = heapq.heappop(free) + t
            end = max(end, done)
            heapq.heappush(free, done)
        return end

    for pairs in range(136, 264, 8):
        for tiles in (32, 128, 512):
            for weight in (17, 25, 60, 200):
                model, sim = sm90.tail_time(pairs, 264, tiles, 2, weight), simulated(pairs, 264, tiles, 2, weight)
                assert abs(model - sim) <= 0.03 * sim, (pairs, tiles, weight, model, sim)
    assert sm90.tail_time(160, 264, 256, 2, 25) == 206  # 104 free slots run the tails twice
    assert sm90.tail_time(200, 264, 256, 3, 25) is None  # the long splits alone overfill the slots


def test_sm80_splits_by_waves(monkeypatch):
    """The sm80 heuristic counts whole waves (``fewest_waves``) at any CTAs an SM: 2-bit K per
    token fp16 holds two on sm_90a (three on sm_80), where it picks the counts measured
    fastest on the H200 (B=4 took 8 where 4, 7 and 9 were timed within 4 %); 4-bit four and
    2-bit bf16 three, where it picks the counts that the H200 ran faster than the fill
    rule's (``WAVE_FIXED_TILES``' table)."""
    import torch

    for arch, slots in (("sm_90a", 264), ("sm_80", 396)):
        monkeypatch.setattr(kernels, "num_sms", lambda device: 132)
        monkeypatch.setattr(kernels, "device_arch", lambda device, arch=arch: arch)
        fmt = KVFormat(2, "token", 64)
        assert kernels.ctas_per_sm(fmt, 128, 8, arch) * 132 == slots
        cache = _cache_stand_in(fmt)

        def splits(b, n):
            return kernels.BACKEND.choose_splits(cache, (b, 1, 32, 128), n, torch.device("cpu"))

        if arch == "sm_90a":
            for b, n, want in ((1, 32768, 33), (1, 131072, 33), (4, 32768, 8), (8, 65536, 4), (16, 32768, 2),
                               (24, 32768, 4), (54, 16384, 3), (60, 16384, 1), (72, 16384, 3), (84, 16384, 3),
                               (100, 16384, 2)):
                assert splits(b, n) == want, (b, n)
        else:  # 396 slots: 49 x 8 fill them once; 3 x 128 and 4 x 432 leave few idle
            assert (splits(1, 32768), splits(16, 32768), splits(54, 16384)) == (49, 3, 4)
    monkeypatch.setattr(kernels, "device_arch", lambda device: "sm_90a")
    for fmt, dtype, cases in ((KVFormat(4, "token", 64), None, ((8, 32768, 8), (12, 8192, 5), (16, 8192, 4),
                                                                 (24, 32768, 8), (28, 131072, 7))),
                              (KVFormat(2, "token", 64), torch.bfloat16, ((4, 32768, 12), (8, 32768, 6),
                                                                          (12, 8192, 4), (17, 131072, 11)))):
        cache = _cache_stand_in(fmt, dtype)
        for b, n, want in cases:
            assert kernels.BACKEND.choose_splits(cache, (b, 1, 32, 128), n, torch.device("cpu")) == want, (fmt, b, n)
    # bf16 keeps three CTAs an SM on sm_90a, and 4-bit four
    assert kernels.ctas_per_sm(KVFormat(2, "token", 64), 128, 8, "sm_90a", fp16=False) == 3
    assert kernels.ctas_per_sm(KVFormat(4, "token", 64), 128, 8, "sm_90a") == 4
    assert kernels.fewest_waves(8, 264, 128, 64) == 33 and kernels.fewest_waves(8, 264, 4, 2) == 2


@pytest.mark.parametrize("split", [False, True], ids=["unsplit", "split"])
@pytest.mark.parametrize("append", [False, True], ids=["decode", "append"])
def test_plan_passes_what_the_kernel_was_compiled_for(monkeypatch, split, append):
    """``DecodePlan`` calls the decode kernel (appending: ``call_append``) with the arguments
    its compile declared (``decode_args`` / ``append_decode_args``) in the same order: each
    position's dtype and rank, then the softmax scale and the splits' tail weight (the
    plan's when split, else 1); unsplit, an appending kernel's unread merge arguments are
    the plan's own bound buffers (never the call's output a second time)."""
    import torch

    import bitdecode as bd
    from bitdecode import jit

    from bitdecode.kernels_sm80.host import cute_dtype

    fmt, d = KVFormat(bits=4), 128
    cache = bd.KVCache.allocate(2, 2, d, 512, fmt, dtype=torch.bfloat16, device="cpu", backend="reference")
    calls = []
    monkeypatch.setattr(jit, "current_stream", lambda index: 0)
    plan = kernels.DecodePlan(cache.tensors(), (2, 1, 8, d), torch.bfloat16, torch.device("cpu"), 3 if split else 1,
                              lambda *args: calls.append(args), lambda *args: None, append=append, tail_weight=70)
    q = torch.zeros(2, 1, 8, d, dtype=torch.bfloat16)
    new = torch.zeros(2, 1, 2, d, dtype=torch.bfloat16)
    out = plan.append_step(q, new, new.clone(), 0.5, False, 0) if append else plan(q, 0.5, False)
    args, = calls
    fakes = (kernels.append_decode_args if append else kernels.decode_args)(fmt, cutlass.BFloat16, d, split)
    assert len(args) == len(fakes) + 2 and isinstance(args[-2], float)
    assert args[-1] == (70 if split else sm80.TAIL_UNIT) and isinstance(args[-1], int)
    for i, (arg, fake) in enumerate(zip(args, fakes)):
        assert cute_dtype(arg.dtype) == fake.element_type, (i, arg.dtype, fake.element_type)
        assert arg.dim() == len(fake.shape), (i, arg.shape, fake.shape)
    if append:
        assert args[3] is cache.tensors().commits
    if append and not split:  # out, its LSE, then the merge's: a dummy output, the unused LSE, any counters
        assert args[-7] is out and args[-5] is not out and args[-5].shape == out.shape


@pytest.mark.parametrize("append", [False, True], ids=["decode", "append"])
def test_plan_keeps_outputs_and_workspaces_per_stream(monkeypatch, append):
    """A plan's calls on one stream reuse that stream's split workspace and take outputs
    from its chunks (never one output twice, a new chunk when one is used up); a call on
    another stream gets that stream's own, and coming back finds the first stream's again;
    a call while a graph is captured (no stream) gets fresh ones, kept by nobody."""
    import torch

    import bitdecode as bd
    from bitdecode import jit

    d = 64
    cache = bd.KVCache.allocate(2, 2, d, 512, KVFormat(bits=4, group_size=64), device="cpu", backend="reference")
    works = []
    stream = ["A"]
    monkeypatch.setattr(jit, "current_stream", lambda index: stream[0])
    plan = kernels.DecodePlan(cache.tensors(), (2, 1, 4, d), torch.float16, torch.device("cpu"), 3,
                              lambda *args: works.append(args[-7 if append else -4]), lambda *args: None,  # o_part
                              append=append)
    q = torch.zeros(2, 1, 4, d, dtype=torch.float16)
    new = torch.zeros(2, 1, 2, d, dtype=torch.float16)

    def call():
        if append:
            return plan.append_step(q, new, new, 0.5, False, stream[0])
        return plan(q, 0.5, False)

    outs = {}
    for name, calls in (("A", plan.OUT_CHUNK + 3), ("B", 2), ("A", 2), (None, 2)):
        stream[0] = name
        outs.setdefault(name, []).extend(call() for _ in range(calls))
    everyone = [o for group in outs.values() for o in group]
    assert len({o.data_ptr() for o in everyone}) == len(everyone)  # every output its own memory
    a, b, a_again, captured = works[:plan.OUT_CHUNK + 3], works[-6:-4], works[-4:-2], works[-2:]
    assert all(w is a[0] for w in a + a_again) and all(w is b[0] for w in b)
    assert b[0] is not a[0] and b[0].data_ptr() != a[0].data_ptr()
    ws = {w.data_ptr() for w in captured}
    assert len(ws) == 2 and not ws & {a[0].data_ptr(), b[0].data_ptr()}


def test_split_rules_at_their_edges(h200_sms, monkeypatch):
    """Each rule at the point where a comparison decides (their docstrings say which way)."""
    import torch

    from bitdecode.kernels_sm90 import backend as sm90

    cpu, fmt4 = torch.device("cpu"), KVFormat(4, "channel", 128)
    # a tie in waves goes to the fewest splits: 384 pairs on 528 slots, 32 tiles, 1 or 4
    assert kernels.waves_time(384, 528, 32, 1) == kernels.waves_time(384, 528, 32, 4)
    assert kernels.fewest_waves(384, 528, 32, 16) == 1
    assert [kernels.most_splits(t) for t in (1, 2, 3, 5)] == [1, 1, 1, 2]  # two tiles a split at least
    # one split and its tail win a tie with even splits (2-bit, 25 x 8 pairs, 4K)
    assert sm90.BACKEND.choose_splits(_cache_stand_in(KVFormat(2, "channel", 128)), (25, 1, 32, 128), 4096, cpu) == 2
    # 66 pairs on 132 SMs (two slots each) are split: one split would leave half the slots idle
    assert sm90.BACKEND.choose_splits(_cache_stand_in(fmt4, hkv=1), (66, 1, 1, 128), 4096, cpu) == 4
    # the tail weight is capped
    assert sm90.BACKEND.tail_weight(_cache_stand_in(fmt4, hkv=1), (261, 1, 1, 128), 2, 65536, cpu) == sm90.MAX_TAIL_WEIGHT
    # a tail of exactly MIN_TAIL_WEIGHT is taken, one less is not
    shape, stand_in = (1, 1, 32, 128), _cache_stand_in(fmt4)
    base = sm90.BACKEND.choose_splits(stand_in, shape, 131072, cpu)
    assert 1 < base < sm80.MAX_SPLITS
    monkeypatch.setattr(sm90.Sm90Backend, "tail_weight", lambda self, *args: sm90.MIN_TAIL_WEIGHT)
    assert sm90.BACKEND.choose_splits(stand_in, shape, 131072, cpu) == base + 1
    monkeypatch.setattr(sm90.Sm90Backend, "tail_weight", lambda self, *args: sm90.MIN_TAIL_WEIGHT - 1)
    assert sm90.BACKEND.choose_splits(stand_in, shape, 131072, cpu) == base
