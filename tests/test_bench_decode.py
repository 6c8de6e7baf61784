"""The decode benchmark's FlashInfer peer (profiles/bench_decode.py): its page table, the
reference it is checked against, and on a GPU with the peer kit its graph-replayed call."""

import contextlib
import json
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from bitdecode import _files, _memory as memory, cli_bench

bench = cli_bench._load("decode")
B, HQ, HKV, D = 2, 32, 8, 128


def paged(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """K / V ``[B, N, Hkv, D]`` in FlashInfer's NHD pages, one table a sequence in order."""
    b, n, hkv, d = k.shape
    pages = -(-n // bench.PEER_PAGE)
    pad = pages * bench.PEER_PAGE - n
    kv = torch.stack([F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (k, v)], dim=2)  # [B, N', 2, Hkv, D]
    return kv.view(b, pages, bench.PEER_PAGE, 2, hkv, d).transpose(2, 3).reshape(b * pages, 2, bench.PEER_PAGE, hkv, d)


@pytest.mark.parametrize("n, last", [(40, 8), (48, 16), (1, 1)])
def test_peer_page_table(n, last):
    indptr, indices, last_len = bench.peer_pages(3, n, "cpu")
    pages = -(-n // bench.PEER_PAGE)
    assert indptr.tolist() == [0, pages, 2 * pages, 3 * pages]
    assert indices.tolist() == list(range(3 * pages))
    assert last_len.tolist() == [last] * 3
    assert {t.dtype for t in (indptr, indices, last_len)} == {torch.int32}


@pytest.mark.parametrize("n", [16, 37])
def test_peer_cache_reads_back_as_sequences(n):
    """``peer_kv_dense`` undoes the page layout token for token (a partial last page too)."""
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(B, n, HKV, 4, generator=gen) for _ in range(2))
    k_back, v_back = bench.peer_kv_dense(paged(k, v), n)
    assert torch.equal(k_back, k.transpose(1, 2)) and torch.equal(v_back, v.transpose(1, 2))


def test_peer_error_sees_a_wrong_output():
    """The peer's check is 0 on SDPA's own output over the stored K / V, and over the
    tolerance once one head of one sequence is off (so a wrong peer fails the run)."""
    gen = torch.Generator().manual_seed(1)
    n = 40
    q = torch.randn(B, 1, HQ, D, generator=gen)
    k, v = (torch.randn(B, n, HKV, D, generator=gen) for _ in range(2))
    cache = paged(k, v)
    want = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          enable_gqa=True).transpose(1, 2).reshape(B, HQ, D)
    assert bench.peer_error(q, want, cache, n) < 1e-5
    want[1, 5] += 0.1
    assert bench.peer_error(q, want, cache, n) > bench.PEER_TOLERANCE


def test_no_peer_without_flashinfer(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    assert bench.flashinfer_version() is None


def test_summary_and_plot_with_the_peer(tmp_path, capsys):
    """A record with the peer's columns prints and plots (the plot only where matplotlib is)."""
    row = {"B": 1, "Hq": HQ, "Hkv": HKV, "D": D, "N": 4096, "sdpa_us": 15.0}
    for bits in ("4", "2"):
        row.update({f"bd{bits}_us": 10.0, f"bd{bits}_speedup": 1.5, f"bd{bits}_roofline": 0.5})
    for kv in bench.PEER_KV:
        row.update({f"fi_{kv}_us": 20.0, f"fi_{kv}_roofline": 0.25})
    result = {"gpu": "a GPU", "sdpa_backend": "cudnn", "roofline": {"best_bytes_per_s": 4e12},
              "backends": [], "rows": [row], "small_graph": {}, "peer": {"flashinfer": "0.0"}}
    bench.print_summary(result)
    out = capsys.readouterr().out
    assert "FlashInfer 0.0" in out and "  1  32   8    4096  fp16 KV:    20.0 (0.25)  fp8 KV:    20.0 (0.25)" in out
    png = bench.plot(result, tmp_path / "d.png")
    assert png is None or png.stat().st_size > 0


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["fp16", "fp8"])
def test_flashinfer_peer_replays_right(kv):
    """FlashInfer's decode as the benchmark builds it, replayed from a CUDA graph, matches
    fp32 SDPA over its stored K / V at a length that ends mid-page."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if bench.flashinfer_version() is None:
        pytest.skip("FlashInfer is not importable (the GPU host's kit: eval \"$(bash .device/fi-setup.sh)\")")
    gen = torch.Generator(device="cuda").manual_seed(2)
    n = 1000
    q = torch.randn(B, 1, HQ, D, device="cuda", dtype=torch.float16, generator=gen)
    call, out, cache = bench.flashinfer_decode(q, HKV, n, kv, gen)
    assert cache.dtype == bench.PEER_KV[kv]
    call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert bench.peer_error(q, out, cache, n) <= bench.PEER_TOLERANCE


def test_release_memory_waits_by_the_bytes_freed(monkeypatch):
    """The benchmarks' ``release_memory`` sleeps ``SETTLE_S_PER_GB`` for each GB that
    ``empty_cache`` gave back, and not at all when nothing was freed."""
    reserved = iter([5 * 2 ** 30, 1 * 2 ** 30, 2 ** 30, 2 ** 30])
    slept = []
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: next(reserved))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(memory.time, "sleep", slept.append)
    assert memory.release_memory() == pytest.approx(4 * memory.SETTLE_S_PER_GB)
    assert memory.release_memory() == 0
    assert slept == [pytest.approx(4 * memory.SETTLE_S_PER_GB), 0]
    # every benchmark that frees memory between cases waits the same way (no bare
    # empty_cache left but in bench_free_settle, which measures the slow spell itself)
    for path in sorted(cli_bench.profiles_dir().glob("*.py")):
        if path.name != "bench_free_settle.py":
            assert "empty_cache" not in path.read_text(), path.name


def test_captured_waits_out_what_its_capture_frees(monkeypatch):
    """``bitnet_tune.captured`` (every benchmark's graph capture) gives the allocator's cache
    back and waits it out after the warm-up calls and before the capture, whose own
    ``empty_cache`` would otherwise free it with the timed replays coming next."""
    from bitdecode import bitnet_tune

    events = []

    class Fake:  # a stream, a stream context, a graph and the capture context at once
        def __init__(self, *args, **kwargs):
            pass

        def wait_stream(self, other):
            pass

        def __enter__(self):
            events.append("capture")

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "Stream", Fake)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", Fake)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Fake)
    monkeypatch.setattr(torch.cuda, "graph", lambda g, **kw: g)
    monkeypatch.setattr(bitnet_tune, "release_memory", lambda: events.append("release"))
    bitnet_tune.captured([lambda: events.append("call")])
    # warm-up (compile, then the allocator on a side stream), the release, the captured call
    assert events == ["call", "call", "release", "capture", "call"]
    # every other capture of a timed call waits the same way right before it (but
    # bench_free_settle's, which empties the cache and sleeps a second itself)
    sources = sorted(cli_bench.profiles_dir().glob("*.py")) + sorted(Path(bitnet_tune.__file__).parent.glob("*.py"))
    for path in sources:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if "torch.cuda.graph(" in line and path.name not in ("bench_free_settle.py", "bitnet_tune.py"):
                assert any("release_memory()" in before for before in lines[max(0, i - 4):i]), f"{path.name}:{i + 1}"


def profile_script(name: str):
    """The module of ``profiles/<name>.py`` (which imports its sibling scripts by name)."""
    import importlib

    sys.path.insert(0, str(cli_bench.profiles_dir()))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(cli_bench.profiles_dir()))


def test_free_settle_counts_the_last_slow_point():
    """``bench_free_settle.slow_for``: the time of the last point over 5 % above steady."""
    settle = profile_script("bench_free_settle")
    points = {"t_s": [0.01, 0.02, 0.03, 0.04, 0.05], "us": [65.0, 64.0, 57.0, 60.0, 56.0]}
    assert settle.slow_for(points, 56.5) == 0.04
    assert settle.slow_for({"t_s": [0.03], "us": [57.0]}, 56.5) == 0.0


@pytest.mark.parametrize("argv, named", [(["--shape", "16"], "--shape"), (["--shape", "2x64,4x64"], "--shape"),
                                          (["--allocs", "0"], "--allocs"), (["--tag", "1a"], "--tag")])
def test_placement_refuses_bad_options(argv, named, capsys):
    """``bench_placement``: one BxN, positive counts and an identifier tag, refused before any
    GPU work with the option named (exit status 2); ``spread`` is (max - min) / min."""
    placement = profile_script("bench_placement")
    with pytest.raises(SystemExit) as e:
        placement.main(argv)
    assert e.value.code == 2 and named in capsys.readouterr().err
    assert placement.spread([300.0, 345.0, 302.0]) == pytest.approx(0.15)


def test_palette_png_keeps_the_picture(tmp_path):
    """``_files.palette_png`` (every plot's last step) turns an RGB plot into a palette PNG
    of the same size and lines."""
    image = pytest.importorskip("PIL.Image")
    picture = image.new("RGB", (64, 32), "white")
    for x in range(64):
        picture.putpixel((x, x // 2), (0, 0, 255))
    path = tmp_path / "p.png"
    picture.save(path)
    assert _files.palette_png(path) == path
    with image.open(path) as out:
        assert out.mode == "P" and out.size == (64, 32)
        assert out.convert("RGB").getpixel((10, 5)) == (0, 0, 255)
        assert out.convert("RGB").getpixel((10, 20)) == (255, 255, 255)


def test_device_run_refuses_unknown_steps_and_a_missing_out(tmp_path):
    """profiles/device_run.sh (one device call's steps) stops at a step it does not know,
    before running anything, and refuses to start without ``$OUT``."""
    import os
    import subprocess

    script = str(cli_bench.profiles_dir() / "device_run.sh")
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    for steps in (["bogus"], ["settle", "suite:abc"]):
        res = subprocess.run(["bash", script, *steps], env={**env, "OUT": str(tmp_path)}, capture_output=True, text=True)
        assert res.returncode == 2 and f"unknown step '{steps[-1]}'" in res.stderr
        assert res.stdout == "" and list(tmp_path.iterdir()) == []
    res = subprocess.run(["bash", script, "quick"], env=env, capture_output=True, text=True)
    assert res.returncode != 0 and "OUT must name the output folder" in res.stderr
    # every step its header documents passes the check (the bogus one after it is refused)
    header = (cli_bench.profiles_dir() / "device_run.sh").read_text()
    documented = re.findall(r"^#   (\w+)(?:\[:S\])? {2,}\S", header, re.M)
    assert {"suite", "peer", "quick", "wide", "ringwide"} <= set(documented)
    for step in documented + ["suite:120"]:
        res = subprocess.run(["bash", script, step, "bogus"], env={**env, "OUT": str(tmp_path)},
                             capture_output=True, text=True)
        assert res.returncode == 2 and "unknown step 'bogus'" in res.stderr, step


def test_records_keep_four_significant_digits(tmp_path):
    """``rounded``: every float of a record, nested, at four significant digits; other
    values as they are.  ``write_record``, every benchmark's JSON writer, writes that."""
    record = {"us": 25.696000084280968, "rows": [{"bw": 3224430545833.3224, "B": 16, "tag": "x"}], "n": None}
    short = {"us": 25.7, "rows": [{"bw": 3.224e12, "B": 16, "tag": "x"}], "n": None}
    assert _files.rounded(record) == short
    path = _files.write_record(tmp_path / "r.json", record)
    assert path == tmp_path / "r.json" and json.loads(path.read_text()) == short
    assert path.read_text().endswith("}\n")
    # no benchmark writes its record another way
    for src in sorted(cli_bench.profiles_dir().glob("*.py")):
        assert "write_text(json.dumps" not in src.read_text(), src.name


def test_save_plot_writes_a_closed_palette_png(tmp_path):
    """``_files.save_plot``, every plot's writer: the PNG at ``path``, palette where Pillow
    is, and the figure closed (a sweep of many plots holds no figures)."""
    plt = pytest.importorskip("matplotlib.pyplot")
    fig, ax = plt.subplots()
    ax.plot([1, 2, 3], [3, 1, 2])
    path = _files.save_plot(fig, tmp_path / "p.png", dpi=50)
    assert path == tmp_path / "p.png" and path.stat().st_size > 0
    assert not plt.fignum_exists(fig.number)
    image = pytest.importorskip("PIL.Image")
    with image.open(path) as out:
        assert out.mode == "P"
