"""The GEMV tuning table (``bitdecode.bitnet_tune``), ``bitnet.tune_gemv`` and ``bitdecode
tune``: shapes and files refused with clear errors, entries round-trip through a file and
are looked up per GPU kind, and on a GPU the measured pick is the one ``gemv`` launches."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from bitdecode import bitnet as bn
from bitdecode import bitnet_tune as tune
from bitdecode.cli import main

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
H100 = ("NVIDIA H100 80GB HBM3", 132)
H200 = ("NVIDIA H200", 132)


@pytest.fixture(autouse=True)
def empty_table(monkeypatch):
    """Every test starts and ends with no entries and no tuning file in the environment."""
    monkeypatch.delenv(tune.ENV_GEMV_TUNING, raising=False)
    tune.clear()
    monkeypatch.setattr(tune, "_ENV_LOADED", False)
    yield
    tune.clear()


def _configs():
    """The sm90 backend's GEMV configurations (register kernels, BULK, BULK_X)."""
    from bitdecode.backend import of_arch

    return of_arch("sm_90a").bitnet.gemv_configs()


def _file(tmp_path, entries, name="tuning.json"):
    path = tmp_path / name
    path.write_text(json.dumps({"format": tune.FORMAT, "entries": entries}))
    return path


def test_parse_shapes():
    assert tune.parse_shapes("4096x4096, 11008X4096") == [(4096, 4096), (11008, 4096)]
    assert tune.parse_shapes([(48, 384), (48, 384), (32, 128)]) == [(48, 384), (32, 128)]
    for shapes, message in [("4096", "NxK"), ("4096x4096,axb", "NxK"), ("", "no shape"), ([(4096,)], "(N, K)"),
                            ([(40, 128)], "multiple of 16"), ([(48, 100)], "multiple of 128"),
                            ([(48.0, 128)], "(N, K) integers"), ([(0, 128)], "positive"), ([4096], "(N, K) integers"),
                            (4096, "pairs or a string")]:
        with pytest.raises(ValueError, match="shapes") as e:
            tune.parse_shapes(shapes)
        assert message in str(e.value), (shapes, str(e.value))


def test_entries_round_trip_through_a_file(tmp_path, monkeypatch):
    configs = _configs()
    start = tune.generation
    tune.remember(H100, 4096, 4096, configs[-1])
    tune.remember(H200, 4096, 4096, configs[0])
    tune.remember(H100, 2048, 2048, dataclasses.replace(configs[-2], raw=True))  # (raw is the call's, not kept)
    assert tune.generation == start + 3
    path = tune.save(tmp_path / "t.json")
    saved = json.loads(path.read_text())
    assert saved["format"] == tune.FORMAT and len(saved["entries"]) == 3
    assert all("raw" not in e["config"] for e in saved["entries"])
    table = dict(tune._TUNED)
    tune.clear()
    assert tune.entries() == [] and tune.generation == start + 4
    assert tune.load(path) == 3
    assert tune._TUNED == table
    assert tune._TUNED[(*H100, 2048, 2048)] == dataclasses.replace(configs[-2], raw=False)
    assert [(e["n"], e["k"]) for e in tune.entries(H100)] == [(2048, 2048), (4096, 4096)]
    assert [e["gpu"] for e in tune.entries(H200)] == [H200[0]] and tune.entries(("NVIDIA A100", 108)) == []
    # looked up per GPU kind: name and SM count
    for gpu, n, k, want in [(H100, 4096, 4096, configs[-1]), (H200, 4096, 4096, configs[0]),
                            (("NVIDIA H100 80GB HBM3", 114), 4096, 4096, None), (H100, 4096, 8192, None)]:
        monkeypatch.setattr(tune, "gpu_key", lambda device, gpu=gpu: gpu)
        assert tune.lookup("cuda", n, k) == want
    tune.forget(H100, 4096, 4096)
    monkeypatch.setattr(tune, "gpu_key", lambda device: H100)
    assert tune.lookup("cuda", 4096, 4096) is None and len(tune.entries()) == 2


def test_a_bad_file_is_refused_and_changes_nothing(tmp_path):
    good = {"gpu": H100[0], "sms": 132, "n": 4096, "k": 4096, "config": tune.config_fields(_configs()[-1])}
    tune.remember(H200, 48, 128, _configs()[0])
    before = dict(tune._TUNED)
    cases = [
        ({"entries": []}, "not a GEMV tuning"),
        ({"format": tune.FORMAT, "entries": {}}, "\"entries\" must be a list"),
        ({"format": tune.FORMAT, "entries": [good, 7]}, "entries[1] must be an object"),
        ({"format": tune.FORMAT, "entries": [{**good, "n": 4100}]}, "entries[0]: the weights' rows N"),
        ({"format": tune.FORMAT, "entries": [{**good, "k": 4000}]}, "entries[0]: the weights' columns K"),
        ({"format": tune.FORMAT, "entries": [{**good, "sms": True}]}, "sms must be a positive integer"),
        ({"format": tune.FORMAT, "entries": [{**good, "gpu": ""}]}, "gpu must be the GPU's name"),
        ({"format": tune.FORMAT, "entries": [{k: v for k, v in good.items() if k != "config"}]}, "lacks config"),
        ({"format": tune.FORMAT, "entries": [{**good, "config": {"unroll": 4, "warp": 2}}]}, "GemvConfig fields"),
        ({"format": tune.FORMAT, "entries": [{**good, "config": {"unroll": True}}]}, "its GemvConfig type"),
        ({"format": tune.FORMAT, "entries": [good, {**good, "config": {"stage_x": True}}]},
         "entries[1]: config {'stage_x': True}: GemvConfig: stage_x applies to the stripe kernel"),
    ]
    for i, (content, message) in enumerate(cases):
        path = tmp_path / f"bad{i}.json"
        path.write_text(json.dumps(content))
        with pytest.raises(ValueError) as e:
            tune.load(path)
        assert message in str(e.value) and str(path) in str(e.value), (message, str(e.value))
        assert tune._TUNED == before  # the good entry before the bad one was not applied either
    (tmp_path / "not.json").write_text("{")
    with pytest.raises(ValueError, match="is not JSON"):
        tune.load(tmp_path / "not.json")
    with pytest.raises(ValueError, match="cannot read the GEMV tuning file"):
        tune.load(tmp_path / "missing.json")


@pytest.mark.parametrize("edit, message", [
    (dict(sms=0), "sms must be a positive integer, got 0"),
    (dict(sms=-132), "sms must be a positive integer, got -132"),
    (dict(gpu=7), "gpu must be the GPU's name, got 7"),
])
def test_an_entry_of_no_gpu_kind_is_refused(tmp_path, edit, message):
    """An entry's key names a GPU kind: a non-empty name string and a positive SM count.
    An entry for 0 SMs or a number for a name, which no GPU would ever look up, is refused
    at load, not kept as a dead entry."""
    entry = {"gpu": H100[0], "sms": H100[1], "n": 4096, "k": 4096, "config": tune.config_fields(_configs()[-1]),
             **edit}
    with pytest.raises(ValueError, match=re.escape(f"entries[0]: {message}")):
        tune.load(_file(tmp_path, [entry]))
    assert tune.entries() == []


def test_copies_exceed_four_times_the_l2():
    """``copies_for``: the fewest copies of the operand whose total reaches 4 x L2 (rounded
    up: 200 / 3 MB takes 67 copies, not 66), and never fewer than two, however large the
    operand, so that no call reads a copy the previous call left in L2."""
    l2 = 50 << 20
    assert tune.copies_for(l2, l2) == 4
    assert tune.copies_for(3 << 20, l2) == 67  # ceil(200 / 3)
    assert tune.copies_for(2 * l2, l2) == 2
    assert tune.copies_for(64 * l2, l2) == 2  # (one copy would exceed 4 x L2 by itself)
    for nbytes in (1 << 20, 7 * 10 ** 6, 3 * l2):
        copies = tune.copies_for(nbytes, l2)
        assert copies * nbytes >= 4 * l2 and (copies == 2 or (copies - 1) * nbytes < 4 * l2), nbytes


def test_entries_of_a_gpu_kind_need_its_sm_count():
    """``entries(gpu)`` keeps only entries of that name *and* SM count: a MIG slice of an
    H100 (fewer SMs, same name) is another GPU kind, as ``lookup`` treats it."""
    mig = (H100[0], 114)
    tune.remember(H100, 4096, 4096, _configs()[-1])
    tune.remember(mig, 2048, 2048, _configs()[0])
    assert [(e["sms"], e["n"]) for e in tune.entries(H100)] == [(132, 4096)]
    assert [(e["sms"], e["n"]) for e in tune.entries(mig)] == [(114, 2048)]


def test_forget_changes_the_generation_only_when_it_drops_an_entry():
    """``forget`` bumps ``generation`` (part of the key of ``bitnet``'s cached launchers) when
    it drops an entry, so that no launcher built with the dropped pick is reused, and
    leaves it as it is when there was nothing to drop."""
    tune.remember(H100, 4096, 4096, _configs()[-1])
    start = tune.generation
    tune.forget(H100, 4096, 4096)
    assert tune.generation == start + 1 and tune.entries() == []
    tune.forget(H100, 4096, 4096)
    tune.forget(H200, 2048, 2048)
    assert tune.generation == start + 1


def test_the_environment_names_a_file(tmp_path, monkeypatch):
    monkeypatch.setattr(tune, "gpu_key", lambda device: H100)
    cfg = _configs()[-1]
    path = _file(tmp_path, [{"gpu": H100[0], "sms": 132, "n": 4096, "k": 4096, "config": tune.config_fields(cfg)}])
    monkeypatch.setenv(tune.ENV_GEMV_TUNING, str(path))
    assert tune.lookup("cuda", 4096, 4096) == cfg
    # the file is read before the first change, so it cannot undo one
    monkeypatch.setattr(tune, "_ENV_LOADED", False)
    tune._TUNED.clear()
    tune.forget(H100, 4096, 4096)
    assert tune.lookup("cuda", 4096, 4096) is None
    monkeypatch.setattr(tune, "_ENV_LOADED", False)
    tune.remember(H100, 4096, 4096, _configs()[0])
    assert tune.lookup("cuda", 4096, 4096) == _configs()[0]
    tune.clear()  # (the file's entries too)
    assert tune.lookup("cuda", 4096, 4096) is None
    # a broken file is refused on every lookup, naming the variable, not skipped
    tune.clear()
    monkeypatch.setattr(tune, "_ENV_LOADED", False)
    path.write_text("[]")
    for _ in range(2):
        with pytest.raises(ValueError, match=re.escape(f"${tune.ENV_GEMV_TUNING}: {path}: not a GEMV tuning")):
            tune.lookup("cuda", 4096, 4096)


def test_clear_before_the_first_lookup_keeps_the_environment_file_out(tmp_path, monkeypatch):
    """``clear`` forgets ``$BITDECODE_GEMV_TUNING``'s entries even where nothing has read the
    file yet: a later lookup does not read it then (the rule decides), until ``load``."""
    monkeypatch.setattr(tune, "gpu_key", lambda device: H100)
    cfg = _configs()[-1]
    path = _file(tmp_path, [{"gpu": H100[0], "sms": 132, "n": 4096, "k": 4096, "config": tune.config_fields(cfg)}])
    monkeypatch.setenv(tune.ENV_GEMV_TUNING, str(path))
    tune.clear()
    assert tune.lookup("cuda", 4096, 4096) is None and tune.entries() == []
    assert tune.load(path) == 1 and tune.lookup("cuda", 4096, 4096) == cfg


def test_the_environment_variable_is_stripped(tmp_path, monkeypatch):
    """``$BITDECODE_GEMV_TUNING`` of blanks only counts as unset (no file is looked for), and
    blanks around a path (a trailing space or newline of a shell line) are not part of it."""
    monkeypatch.setattr(tune, "gpu_key", lambda device: H100)
    monkeypatch.setenv(tune.ENV_GEMV_TUNING, "  ")
    assert tune.lookup("cuda", 4096, 4096) is None
    cfg = _configs()[-1]
    path = _file(tmp_path, [{"gpu": H100[0], "sms": 132, "n": 4096, "k": 4096, "config": tune.config_fields(cfg)}])
    monkeypatch.setenv(tune.ENV_GEMV_TUNING, f" {path}\n")
    monkeypatch.setattr(tune, "_ENV_LOADED", False)
    assert tune.lookup("cuda", 4096, 4096) == cfg


def test_config_names_are_the_benchmark_columns():
    """``describe`` names a configuration as the GEMV benchmarks' columns do."""
    names = [tune.describe(tune.config_fields(c)) for c in _configs()]
    assert len(set(names)) == len(names)
    assert {"unroll4", "unroll8", "pdl_unroll4", "pdl_unroll10_pin", "pdl_bulk", "pdl_bulk_x"} <= set(names)


def test_bulk_x_names_the_stripe_kernel_that_stages_x():
    """``describe`` calls the stripe kernel with ``stage_x`` ``bulk_x`` and the one without
    it ``bulk`` (the columns of the GEMV benchmarks and of ``bitdecode tune``'s table): the
    two names are not interchangeable."""
    assert tune.describe({"bulk": True, "stage_x": True, "pdl": True, "unroll": 4}) == "pdl_bulk_x"
    assert tune.describe({"bulk": True, "stage_x": False, "pdl": False, "unroll": 4}) == "bulk"
    stripes = {tune.describe(tune.config_fields(c)): c.stage_x for c in _configs() if c.bulk}
    assert stripes == {"pdl_bulk": False, "pdl_bulk_x": True}


def test_tune_gemv_refuses_bad_arguments():
    with pytest.raises(ValueError, match="device: tune_gemv times kernels on a CUDA GPU, got cpu"):
        bn.tune_gemv([(4096, 4096)], "cpu")
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="shapes"):
            bn.tune_gemv("4096x100")
        with pytest.raises(ValueError, match="replays must be a positive integer"):
            bn.tune_gemv([(4096, 4096)], replays=0)
        with pytest.raises(ValueError, match="margin"):
            bn.tune_gemv([(4096, 4096)], margin=1.5)


@pytest.mark.gpu
@cuda
def test_gpu_tune_gemv_picks_what_gemv_launches(tmp_path):
    """Tune two shapes (a register kernel's and a stripe kernel's on Hopper), then: the pick
    is one of the timed configurations, ``gemv`` launches it and sums exactly, a file
    round-trips it, and ``clear`` gives the rule back."""
    shapes = [(4096 + 16, 2560), (3200, 10240)]
    rule = {s: bn.gemv_config_for("cuda", *s) for s in shapes}
    rows = bn.tune_gemv(shapes, replays=3)
    assert [(r["n"], r["k"]) for r in rows] == shapes
    for row, (n, k) in zip(rows, shapes):
        timed = {tune.describe(t["config"]): t["us"] for t in row["times"]}
        assert len(timed) >= 2 and all(0 < us < 1e4 for us in timed.values())
        assert timed[tune.describe(row["config"])] == row["us"] and row["us"] <= row["default_us"]
        assert row["default"] == tune.config_fields(rule[(n, k)])
        picked = bn.gemv_config_for("cuda", n, k)
        assert tune.config_fields(picked) == row["config"]
        w = torch.randint(-1, 2, (n, k), dtype=torch.int8, device="cuda")
        x, xs = bn.quantize_activation(torch.randn(1, k, device="cuda"))
        ws = torch.ones(1, device="cuda")
        assert torch.equal(bn.gemv(x, bn.pack_weight(w), xs, ws, out_dtype=torch.int32), bn.accumulate(x, w))
    path = tune.save(tmp_path / "t.json")
    picks = {s: bn.gemv_config_for("cuda", *s) for s in shapes}
    tune.clear()
    assert {s: bn.gemv_config_for("cuda", *s) for s in shapes} == rule
    assert tune.load(path) == 2
    assert {s: bn.gemv_config_for("cuda", *s) for s in shapes} == picks


@pytest.mark.gpu
@cuda
def test_gpu_a_changed_entry_reaches_the_next_call():
    """A launcher built with the rule's pick is not reused once an entry names another."""
    n, k = 4096 + 16, 2560
    w = torch.randint(-1, 2, (n, k), dtype=torch.int8, device="cuda")
    wp = bn.pack_weight(w)
    x, xs = bn.quantize_activation(torch.randn(1, k, device="cuda"))
    ws = torch.ones(1, device="cuda")
    dev = torch.device("cuda", torch.cuda.current_device())
    rule = bn.gemv_config_for(dev, n, k)
    before = bn._gemv_kernel(dev, True, n, k)[0]
    other = next(c for c in bn._gemv_candidates(dev, k) if c != rule)
    tune.remember(tune.gpu_key(dev), n, k, other)
    assert bn.gemv_config_for(dev, n, k) == other
    assert bn._gemv_kernel(dev, True, n, k)[0] is not before
    assert torch.equal(bn.gemv(x, wp, xs, ws, out_dtype=torch.int32), bn.accumulate(x, w))


def test_info_names_the_tuning_file(tmp_path, monkeypatch):
    from bitdecode.cli_info import _gemv_tuning

    assert "unset" in _gemv_tuning()
    fields = tune.config_fields(_configs()[-1])
    path = _file(tmp_path, [{"gpu": gpu, "sms": sms, "n": 4096, "k": 4096, "config": fields}
                            for gpu, sms in (H100, H200)])
    monkeypatch.setenv(tune.ENV_GEMV_TUNING, str(path))
    monkeypatch.setattr(tune, "_ENV_LOADED", False)
    text = _gemv_tuning()
    assert text.startswith("2 shape(s) from $BITDECODE_GEMV_TUNING") and "NVIDIA H200 (132 SMs)" in text
    tune.clear()
    monkeypatch.setattr(tune, "_ENV_LOADED", False)
    path.write_text("{")
    assert "is not JSON" in _gemv_tuning()


def test_candidates_are_what_a_call_would_launch(monkeypatch):
    """``bitnet._gemv_candidates`` on an sm_90a device (arch patched, nothing launched): every
    configuration the backend runs, PDL as ``$BITDECODE_PDL`` says, none twice, the stripe
    kernels only where their stripe fits shared memory."""
    monkeypatch.setattr(bn, "_arch", lambda device: "sm_90a")
    dev = torch.device("cuda", 0)
    names = lambda k: [tune.describe(tune.config_fields(c)) for c in bn._gemv_candidates(dev, k)]  # noqa: E731
    monkeypatch.delenv("BITDECODE_PDL", raising=False)
    short = names(2560)
    assert len(short) == len(set(short)) and {"pdl_bulk", "pdl_bulk_x", "pdl_unroll10_pin"} <= set(short)
    assert all(name.startswith("pdl_") for name in short)  # (the plain unroll 4 / 8 launch with PDL too)
    long = names(65536)  # (16 rows x 16 KB: a stripe too long for shared memory)
    assert long and not any("bulk" in name for name in long)
    # the rule's pick is always one of them (tune_gemv times it as the baseline)
    monkeypatch.setattr(bn, "num_sms", lambda device: 132)
    for n in range(16, 40000, 16 * 37):
        for k in (128, 2560, 3200, 6912, 10240, 40960, 65536):
            assert bn.gemv_config_for(dev, n, k) in bn._gemv_candidates(dev, k), (n, k)
    monkeypatch.setenv("BITDECODE_PDL", "0")
    off = bn._gemv_candidates(dev, 2560)
    assert off and not any(c.pdl or c.early_scales for c in off)


def test_tune_command_prints_and_merges_the_picks(tmp_path, monkeypatch, capsys):
    """``bitdecode tune`` as a GPU would run it, with ``bitnet.tune_gemv`` standing in (no
    kernel runs): the table names the rule's and the measured picks, and the file keeps
    the entries it held and gains the new ones."""
    configs = {tune.describe(tune.config_fields(c)): c for c in _configs()}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    calls = []

    def fake_tune(shapes, device, *, replays, progress):
        calls.append((shapes, device, replays))
        rows = []
        for n, k in shapes:
            progress(f"{n} x {k}")
            tune.remember(H100, n, k, configs["pdl_bulk_x"])
            rows.append({"gpu": H100[0], "sms": H100[1], "n": n, "k": k,
                         "config": tune.config_fields(configs["pdl_bulk_x"]), "us": 2.14,
                         "default": tune.config_fields(configs["pdl_unroll4_pin"]), "default_us": 2.62, "times": []})
        return rows

    monkeypatch.setattr(bn, "tune_gemv", fake_tune)
    out = _file(tmp_path, [{"gpu": H200[0], "sms": 132, "n": 2560, "k": 2560,
                            "config": tune.config_fields(configs["pdl_unroll10_pin"])}])
    # an entry of the environment's tuning file is used by the process, not written into --out
    env = tmp_path / "env.json"
    env.write_text(json.dumps({"format": tune.FORMAT, "entries": [
        {"gpu": H200[0], "sms": 132, "n": 6144, "k": 4096, "config": tune.config_fields(configs["pdl_bulk_x"])}]}))
    monkeypatch.setenv(tune.ENV_GEMV_TUNING, str(env))
    monkeypatch.setattr(tune, "_ENV_LOADED", False)
    assert [e["n"] for e in tune.entries(H200)] == [6144]
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["tune", "--shapes", "4096x4096", "--out", str(out), "--replays", "5"]) == 0
    assert calls == [([(4096, 4096)], torch.device("cuda", 0), 5)]
    text = capsys.readouterr().out
    assert "pdl_unroll4_pin" in text and "pdl_bulk_x" in text and "+22%" in text and "BITDECODE_GEMV_TUNING" in text
    saved = json.loads(out.read_text())["entries"]
    assert [(e["gpu"], e["n"]) for e in saved] == [(H100[0], 4096), (H200[0], 2560)]
    # a broken --out file is refused before any timing
    out.write_text("{")
    calls.clear()
    assert main(["tune", "--shapes", "4096x4096", "--out", str(out)]) == 2
    # (the console wraps the message where the temporary path runs long: compare it unwrapped)
    assert calls == [] and "is not JSON" in " ".join(capsys.readouterr().err.split())


def test_tune_shape_picks_by_time_and_refuses_wrong_sums(monkeypatch):
    """``bitnet._tune_shape`` with the launches and the timer stood in (the reference's sums,
    a time per configuration): the fastest wins by more than the margin, else the rule's
    pick stays; a configuration with a wrong sum stops the tuning and keeps the earlier
    entry."""
    monkeypatch.setattr(bn, "_arch", lambda device: "sm_90a")
    monkeypatch.setattr(bn, "num_sms", lambda device: 132)
    monkeypatch.setattr(tune, "gpu_key", lambda device: H100)
    launched, wrong = {}, set()

    def launch(x, w, xs, ws, ends, raw, cfg):
        launched["name"] = tune.describe(tune.config_fields(cfg))
        out = bn.reference_gemm(x, w, xs, ws, None, torch.int32 if raw else torch.bfloat16)
        return out + 1 if launched["name"] in wrong else out

    speeds = {}

    def timed(calls, replays):
        calls[0]()  # (names the configuration the calls launch)
        return speeds.get(launched["name"], 3.0)

    monkeypatch.setattr(bn, "_gemv_launch", launch)
    monkeypatch.setattr(tune, "graph_time_us", timed)
    n, k, dev = 512, 1024, torch.device("cpu")
    rule = tune.describe(tune.config_fields(bn._with_pdl(bn._rule_gemv_config(dev, n, k), "sm_90a")))
    fast = "pdl_bulk_x" if rule != "pdl_bulk_x" else "pdl_bulk"
    speeds[fast] = 2.0
    row = bn._tune_shape(n, k, dev, 1 << 20, 1, 0.02)
    assert tune.describe(row["config"]) == fast and row["us"] == 2.0 and row["default_us"] == 3.0
    assert tune.describe(row["default"]) == rule and len(row["times"]) >= 10
    assert tune.describe(tune.config_fields(tune.lookup(dev, n, k))) == fast
    speeds[fast] = 2.95  # within 2 % of the rule's 3.0: the rule's pick stays
    assert tune.describe(bn._tune_shape(n, k, dev, 1 << 20, 1, 0.02)["config"]) == rule
    speeds[fast] = 2.0
    bn._tune_shape(n, k, dev, 1 << 20, 1, 0.02)
    wrong.add("pdl_unroll8")
    with pytest.raises(RuntimeError, match=r"summed N=512 x K=1024 wrongly \(512 of 512 outputs\): a kernel bug"):
        bn._tune_shape(n, k, dev, 1 << 20, 1, 0.02)
    assert tune.describe(tune.config_fields(tune.lookup(dev, n, k))) == fast


@pytest.mark.parametrize("gpu, arch, k, edit, message", [
    (H100, "sm_90a", 65536, dict(bulk=True, pdl=True), r"stripe of K=65536 does not fit"),
    (("NVIDIA A100-SXM4-80GB", 108), "sm_80", 4096, dict(bulk=True, pdl=True), r"runs on sm_90a only"),
])
def test_an_entry_the_gpu_cannot_run_is_refused_by_name(monkeypatch, tmp_path, gpu, arch, k, edit, message):
    """A tuning entry another arch's or a hand edit made, which this GPU's backend cannot
    build (a stripe kernel past shared memory, Hopper's kernel on an A100), is refused
    naming the table and the shape at the lookup (it used to fail deep in the compile, or
    divide by zero, with no word of the table)."""
    monkeypatch.setattr(bn, "_arch", lambda device: arch)
    monkeypatch.setattr(bn, "num_sms", lambda device: gpu[1])
    monkeypatch.setattr(tune, "gpu_key", lambda device: gpu)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu[0])
    cfg = dataclasses.replace(next(c for c in _configs() if not c.bulk), **edit)
    assert tune.load(_file(tmp_path, [{"gpu": gpu[0], "sms": gpu[1], "n": 4096, "k": k,
                                       "config": tune.config_fields(cfg)}])) == 1
    with pytest.raises(ValueError, match=rf"^the GEMV tuning entry for 4096 x {k} weights on {re.escape(gpu[0])} "
                                         rf"\(\$BITDECODE_GEMV_TUNING's file, or .*cannot run here: .*{message}"):
        bn.gemv_config_for(torch.device("cuda", 0), 4096, k)


@pytest.mark.parametrize("unroll", [0, -4, 17, True, 4.0])
def test_an_entry_with_an_unroll_no_kernel_takes_is_refused_at_load(tmp_path, unroll):
    fields = {**tune.config_fields(next(c for c in _configs() if not c.bulk)), "unroll": unroll}
    with pytest.raises(ValueError, match=r"entries\[0\]: config .*(unroll must be an integer in \[1, 16\]"
                                         r"|each field must have its GemvConfig type)"):
        tune.load(_file(tmp_path, [{"gpu": H100[0], "sms": H100[1], "n": 4096, "k": 4096, "config": fields}]))


def _stand_in_tuner(monkeypatch, during=None):
    """``bitnet.tune_gemv`` stood in on a pretend GPU (no kernel runs): each shape's pick
    is BULK_X; ``during()`` runs while it "times"; returns the calls it got."""
    pick = next(c for c in _configs() if tune.describe(tune.config_fields(c)) == "pdl_bulk_x")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("COLUMNS", "300")
    calls = []

    def fake_tune(shapes, device, *, replays, progress):
        calls.append(shapes)
        if during:
            during()
        return [{"gpu": H100[0], "sms": H100[1], "n": n, "k": k, "config": tune.config_fields(pick), "us": 2.0,
                 "default": tune.config_fields(pick), "default_us": 2.0, "times": []} for n, k in shapes]

    monkeypatch.setattr(bn, "tune_gemv", fake_tune)
    return calls


def test_tune_command_refuses_before_timing(tmp_path, monkeypatch, capsys):
    """What would make the run's picks unusable is refused before any timing, each by its
    own name: an --out that cannot be written (it was a traceback after the timing, the
    picks lost), a broken $BITDECODE_GEMV_TUNING (it was blamed on --device, after the
    timing), a tuning file that is not text."""
    from pathlib import Path

    calls = _stand_in_tuner(monkeypatch)
    if Path("/proc/self").is_dir():
        assert main(["tune", "--shapes", "4096x4096", "--out", "/proc/bitdecode_tuning.json"]) == 2
        assert "--out /proc/bitdecode_tuning.json: cannot write it" in " ".join(capsys.readouterr().err.split())
    env = tmp_path / "env.json"
    env.write_text("{")
    monkeypatch.setenv(tune.ENV_GEMV_TUNING, str(env))
    monkeypatch.setattr(tune, "_ENV_LOADED", False)
    assert main(["tune", "--shapes", "4096x4096", "--out", str(tmp_path / "t.json")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "error: $BITDECODE_GEMV_TUNING: the GEMV tuning file" in err and "--device" not in err
    monkeypatch.delenv(tune.ENV_GEMV_TUNING)
    latin = tmp_path / "latin.json"
    latin.write_bytes(b"\xff\xfe{}")
    assert main(["tune", "--shapes", "4096x4096", "--out", str(latin)]) == 2
    assert f"{latin} is not JSON" in " ".join(capsys.readouterr().err.split())
    assert calls == [] and not (tmp_path / "t.json").exists()


def test_tune_command_keeps_what_another_run_wrote_meanwhile(tmp_path, monkeypatch, capsys):
    """Two runs on one --out: the file is read again just before it is written (whole, by
    a rename: a reader never sees half of it), so the other run's picks stay."""
    out = tmp_path / "t.json"
    other = {"gpu": H200[0], "sms": 132, "n": 2560, "k": 2560,
             "config": tune.config_fields(next(c for c in _configs() if not c.bulk))}
    _stand_in_tuner(monkeypatch, during=lambda: _file(tmp_path, [other], name="t.json"))
    assert main(["tune", "--shapes", "4096x4096", "--out", str(out)]) == 0
    saved = json.loads(out.read_text())["entries"]
    assert sorted((e["gpu"], e["n"]) for e in saved) == [(H100[0], 4096), (H200[0], 2560)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json"]


def test_tune_command_refuses_a_device_past_the_last(tmp_path, monkeypatch, capsys):
    """--device N on a machine of N devices (0..N-1) is refused naming it, before any
    timing, and nothing is written."""
    calls = _stand_in_tuner(monkeypatch)  # one device
    assert main(["tune", "--shapes", "4096x4096", "--out", str(tmp_path / "t.json"), "--device", "1"]) == 2
    assert "--device 1: this machine has 1 CUDA device(s)" in " ".join(capsys.readouterr().err.split())
    assert calls == [] and not (tmp_path / "t.json").exists()


def test_tune_command_replaces_the_pick_of_a_shape_it_measured_again(tmp_path, monkeypatch, capsys):
    """A shape of this GPU already in --out gets this run's pick: the new measurement
    replaces the old entry (entries of other shapes and GPUs stay)."""
    configs = {tune.describe(tune.config_fields(c)): c for c in _configs()}
    old = tune.config_fields(configs["pdl_unroll4_pin"])
    other = {"gpu": H200[0], "sms": 132, "n": 2560, "k": 2560, "config": old}
    out = _file(tmp_path, [{"gpu": H100[0], "sms": H100[1], "n": 4096, "k": 4096, "config": old}, other], "t.json")
    _stand_in_tuner(monkeypatch)  # picks pdl_bulk_x on an H100
    assert main(["tune", "--shapes", "4096x4096", "--out", str(out)]) == 0
    saved = {(e["gpu"], e["n"], e["k"]): e["config"] for e in json.loads(out.read_text())["entries"]}
    assert saved == {(H100[0], 4096, 4096): tune.config_fields(configs["pdl_bulk_x"]), (H200[0], 2560, 2560): old}


def test_tune_command_exit_2_where_the_picks_were_not_written_or_the_gpu_is_not_run(tmp_path, monkeypatch,
                                                                                  capsys):
    """A write of --out that fails after the timing exits 2 naming --out (the picks are in
    the table only); a GPU the kernels do not run on (``tune_gemv``'s ValueError) exits 2
    naming --device, without a traceback."""
    _stand_in_tuner(monkeypatch)

    def full(path, entries):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tune, "save", full)
    assert main(["tune", "--shapes", "4096x4096", "--out", str(tmp_path / "t.json")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "the picks (the table above) were not written: No space left on device" in err

    def unsupported(shapes, device, *, replays, progress):
        raise ValueError("the BitNet GEMV kernels need sm_80 or newer, got sm_75")

    monkeypatch.setattr(bn, "tune_gemv", unsupported)
    assert main(["tune", "--shapes", "4096x4096", "--out", str(tmp_path / "t.json")]) == 2
    assert "--device 0: the BitNet GEMV kernels need sm_80 or newer" in " ".join(capsys.readouterr().err.split())
