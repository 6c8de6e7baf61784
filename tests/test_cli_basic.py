"""The CLI as a user runs it: ``bitdecode --help``, ``info``, ``demo --device cpu``."""

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bitdecode import cli_bench, cli_compile, cli_demo, cli_eval, cli_info, cli_selfcheck
from bitdecode.cli import COMMANDS, INT64_MAX, build_parser, main, nonnegative_int, positive_int
from bitdecode.formats import KVFormat


def bitdecode(*args, timeout=300):
    """Run ``python -m bitdecode.cli`` (what the ``bitdecode`` script calls), wide output."""
    env = dict(os.environ, COLUMNS="200", NO_COLOR="1", TERM="dumb")
    proc = subprocess.run([sys.executable, "-m", "bitdecode.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_help_lists_every_command():
    out = bitdecode("--help")
    assert "usage: bitdecode" in out
    for name in ("info", "demo", "layout", "bench", "compile", "selfcheck", "tune"):
        assert re.search(rf"^\s+{name}\s+\S", out, re.M), name


def test_info():
    import cutlass
    import torch

    out = bitdecode("info", timeout=120)
    for row in ("Python", "torch", "CuTe DSL", "TVM-FFI", "GPU", "backends", "GEMV tuning", "compile cache"):
        assert row in out, row
    assert torch.__version__ in out and cutlass.__version__ in out
    if not torch.cuda.is_available():
        assert "no GPU" in out and "reference" in out
        assert re.search(r"BitNet W2A8 +│ torch reference", out)
    else:  # the device's backend's kernels: mma.sync everywhere, Hopper's stripe GEMV and wgmma there
        hopper = torch.cuda.get_device_capability()[0] == 9
        assert re.search(r"GEMM: mma / wgmma\s+│" if hopper else r"GEMM: mma\s+│", out)
        assert ("bulk-copy stripe" in out) == hopper


def test_info_cache_dir_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("BITDECODE_CACHE_DIR", str(tmp_path / "jit"))
    monkeypatch.delenv("BITDECODE_NO_DISK_CACHE", raising=False)  # (switched off, the row says only that)
    out = bitdecode("info", timeout=120)
    assert str(tmp_path / "jit") in out and "$BITDECODE_CACHE_DIR" in out


def _rows(out):
    """{first cell: [cells]} of the rich table rows in ``out``."""
    rows = {}
    for line in out.splitlines():
        if line.startswith("│"):
            cells = [c.strip() for c in line.strip("│").split("│")]
            rows[cells[0]] = cells[1:]
    return rows


def test_demo_cpu():
    out = bitdecode("demo", "--device", "cpu", "--seqlen", "1024")
    for header in ("KV cache", "rel. error vs 16-bit", "KV memory", "vs 16-bit"):
        assert header in out, header
    assert "1,024 tokens" in out and "backend reference" in out
    rows = _rows(out)
    four = next(v for k, v in rows.items() if k.startswith("4-bit"))
    two = next(v for k, v in rows.items() if k.startswith("2-bit"))
    base = next(v for k, v in rows.items() if k.startswith("16-bit"))
    err4, err2, err16 = float(four[0]), float(two[0]), float(base[0])
    assert err16 < 1e-3 < err4 < 0.1 and err4 < err2 < 0.5
    ratio4, ratio2 = float(four[2].rstrip("x")), float(two[2].rstrip("x"))
    assert ratio2 <= ratio4 < 0.5 and base[2] == "1.000x"  # equal at 1024 tokens: Nr is 256 for 2-bit


def test_demo_one_width_options(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    code = main(["demo", "--device", "cpu", "--seqlen", "300", "--bits", "2", "--k-mode", "token",
                 "--group-size", "64", "--batch", "2", "--dtype", "bf16", "--seed", "3"])
    out = capsys.readouterr().out
    assert code == 0
    rows = _rows(out)
    assert any(k.startswith("2-bit (K per token, G=64)") for k in rows)
    assert not any(k.startswith("4-bit") for k in rows)
    assert "batch 2" in out and "bf16" in out


def test_demo_bit_width_given_twice_is_one_row(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["demo", "--device", "cpu", "--seqlen", "200", "--bits", "4", "4"]) == 0
    out = capsys.readouterr().out
    assert sum(line.strip("│ ").startswith("4-bit") for line in out.splitlines()) == 1, out


@pytest.mark.parametrize("args", [["--seqlen", "0"], ["--bits", "3"], ["--group-size", "48"], ["--device", "tpu"]])
def test_demo_rejects_bad_options(args, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo", *args])
    assert exc.value.code == 2 and "error: argument" in capsys.readouterr().err


def test_demo_backend_the_device_lacks(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["demo", "--device", "cpu", "--seqlen", "256", "--backend", "sm80"]) == 2
    assert "backend 'sm80' runs CUDA kernels, but the tensors are on cpu" in capsys.readouterr().err


def test_demo_sizes_that_do_not_fit(capsys, monkeypatch):
    """An allocation that fails is one line and exit 2 (it was a traceback, exit 1)."""
    from bitdecode import cli_demo

    def no_memory(*args):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 157286400000 bytes.")

    monkeypatch.setenv("COLUMNS", "300")
    monkeypatch.setattr(cli_demo, "measure", no_memory)
    assert main(["demo", "--device", "cpu", "--seqlen", "600000", "--batch", "64"]) == 2
    err = capsys.readouterr().err
    assert "--seqlen 600000 --batch 64: the 16-bit K / V and the caches do not fit in cpu's memory" in err
    # sizes past what a tensor's byte count can hold; a long message is cut between words
    # (it was cut at 120 characters, inside the byte count it reports)
    for message, shown in (("Storage size calculation overflowed with sizes=[1, 2000000000000000000, 8, 128]",
                            "Storage size calculation overflowed"),
                           ("CUDA out of memory. " + "x" * 70 + " Tried to allocate 409600000000000 bytes (GPU 0; "
                            "79.19 GiB total capacity; 1.2 GiB already allocated; 77 GiB free)", " [...]")):
        monkeypatch.setattr(cli_demo, "measure", lambda *a, m=message: (_ for _ in ()).throw(RuntimeError(m)))
        assert main(["demo", "--device", "cpu", "--seqlen", "600000"]) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert shown in err and ("409600000000000" in err or "40960" not in err), err
    monkeypatch.setattr(cli_demo, "measure", lambda *a: (_ for _ in ()).throw(RuntimeError("a kernel bug")))
    with pytest.raises(RuntimeError, match="a kernel bug"):  # other failures are not called memory
        main(["demo", "--device", "cpu", "--seqlen", "256"])


def test_demo_cuda_without_gpu(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the message on a machine without CUDA")
    assert main(["demo", "--device", "cuda"]) == 2
    assert "no CUDA GPU is available" in capsys.readouterr().err


# --------------------------------------------------------------------------------------
# Bad input: an argparse error naming the argument (exit status 2, one line, no traceback)
# for a bad option value, a one-line message and a non-zero status for a runtime problem
# --------------------------------------------------------------------------------------


def _parser_error(argv, capsys) -> str:
    """``main(argv)`` exits through argparse (status 2); its one error line."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(lines) == 1, lines
    return lines[0]


def _one_line_error(argv, capsys, monkeypatch) -> str:
    """``main(argv)`` returns 2 after printing one error line on standard error (no
    exception), and nothing on standard output."""
    monkeypatch.setenv("COLUMNS", "80")  # long messages must not wrap either
    assert main(argv) == 2
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and not out.strip(), (out, err)
    return lines[0]


@pytest.mark.parametrize("argv, message", [
    (["layout", "packed", "--svg", "/nonexistent/dir/a.svg"], "argument --svg: no such folder"),
    (["compile", "--out", "OUT", "--bits", "3"], "argument --bits: invalid choice: 3"),
    (["eval", "--random-llama", "tiny", "--text", "/nonexistent/text.txt"],
     "--text /nonexistent/text.txt: no such file"),
    (["selfcheck", "--backend", "sm90", "--format-json", "{bad"], "argument --format-json: not valid JSON"),
    (["generate", "--device", "cpu", "/nonexistent_model_dir"], "'/nonexistent_model_dir': no such folder"),
])
def test_bad_input_is_one_line_without_a_traceback(argv, message, tmp_path):
    """As a user runs them: a non-zero status, the message, no traceback."""
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
    env = dict(os.environ, COLUMNS="80", NO_COLOR="1", TERM="dumb")
    proc = subprocess.run([sys.executable, "-m", "bitdecode.cli", *argv], capture_output=True, text=True, env=env,
                          timeout=300)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text
    assert "Traceback" not in text and message in text, text
    assert len([line for line in text.splitlines() if "error" in line]) == 1, text
    assert not (tmp_path / "out").exists()  # refused before anything was made


def test_eval_without_a_model_lists_its_own_sources(capsys, monkeypatch):
    line = _one_line_error(["eval", "--device", "cpu"], capsys, monkeypatch)
    for source in ("MODEL", "--gguf-file", "--random-llama", "--smollm2"):
        assert source in line, source
    assert "--random-bitnet" not in line  # generate's, not eval's


def test_eval_text_file_missing(tmp_path, capsys, monkeypatch):
    missing = tmp_path / "missing.txt"
    line = _one_line_error(["eval", "--random-llama", "tiny", "--device", "cpu", "--text", str(missing)], capsys,
                           monkeypatch)
    assert f"--text {missing}: no such file" in line


@pytest.mark.parametrize("argv, message", [
    (["--formats", "3c64"], "--formats 3c64: KVFormat.bits must be one of"),
    (["--formats", "4c48"], "--formats 4c48: KVFormat.group_size must be one of"),
    (["--formats", "4c64v3"], "--formats 4c64v3: KVFormat.v_bits must be one of"),
    (["--formats", "quanto3"], "--formats quanto3: quanto takes 2 or 4 bits"),
    (["--formats", "4q64"], "--formats: cannot read the method spec '4q64'"),
    (["--formats", ""], "--formats '': no method spec"),
    (["--formats", " , "], "no method spec"),
    (["--needle-formats", "2t64s"], "--needle-formats: cannot read the method spec"),
])
def test_eval_refuses_bad_format_specs_before_loading(argv, message, capsys, monkeypatch):
    """Specs of no form of the grammar, formats KVFormat refuses and an empty list are
    refused before the model loads (--gguf-file of a missing file would fail there)."""
    line = _one_line_error(["eval", "--gguf-file", "/nonexistent/model.gguf", "--device", "cpu", *argv], capsys,
                           monkeypatch)
    assert message in line


def test_eval_takes_every_spec_form():
    """What eval's help lists is what it takes (before a model's head dim is known)."""
    import argparse

    from bitdecode import cli_eval

    args = argparse.Namespace(smollm2=False, model=None, gguf_file=None, random_llama="tiny", text=None,
                              formats="16,4c64,2t32v4s16h,4C64s8v2,nvfp4,mxfp4s16h,quanto4,quanto2,bf16",
                              needle_formats="16")
    assert cli_eval.check_inputs(args) is None


def test_eval_help_states_the_spec_grammar(capsys):
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    out = capsys.readouterr().out
    for text in ("<bits><c|t><group>[v<bits>][s<n>][h]", "nvfp4[s<n>][h]", "mxfp4[s<n>][h]", "quanto4", "quanto2",
                 "16 (also 16-bit", "refused"):
        assert text in out, text


@pytest.mark.parametrize("svg, message", [
    ("/nonexistent/dir/a.svg", "argument --svg: no such folder: /nonexistent/dir"),
    (".", "argument --svg: . is a folder"),
    ("", "argument --svg: an empty path is not a file"),
])
def test_layout_svg_where_it_cannot_be_written(svg, message, capsys):
    assert message in _parser_error(["layout", "packed", "--svg", svg], capsys)


@pytest.mark.parametrize("argv, message", [
    (["--bits", "3"], "argument --bits: invalid choice: 3 (choose from 4, 2)"),
    (["--bits", "4,x"], "argument --bits: expected a comma-separated list of integers"),
    (["--k-mode", "foo"], "argument --k-mode: invalid choice: 'foo'"),
    (["--group-size", "16"], "argument --group-size: invalid choice: 16"),
    (["--fp4", "fp8"], "argument --fp4: invalid choice: 'fp8'"),
    (["--dtype", "fp32"], "argument --dtype: invalid choice: 'fp32'"),
    (["--head-dim", "-5"], "argument --head-dim: invalid choice: -5"),
    (["--head-dim", "96"], "argument --head-dim: invalid choice: 96 (choose from 64, 128, 256)"),
    (["--head-dim", ""], "argument --head-dim: expected a non-empty"),
    (["--kernels", "decode,gemm"], "argument --kernels: invalid choice: 'gemm'"),
    (["--jobs", "0"], "argument --jobs: must be a positive integer"),
    (["--jobs", "-3"], "argument --jobs: must be a positive integer"),
    (["--bits", ""], "no KV format for the decode / pack kernels: --bits empty and no --fp4"),
    (["--warm-cache"], "--warm-cache fills the JIT disk cache and writes no PTX: give no --out"),
])
def test_compile_refuses_bad_options(argv, message, tmp_path, capsys):
    """Refused by the parser, before any compile (and before --out is made)."""
    assert message in _parser_error(["compile", "--out", str(tmp_path / "ptx"), *argv], capsys)
    assert not (tmp_path / "ptx").exists()


@pytest.mark.parametrize("command", [["compile"], ["bench", "decode"]])
def test_out_must_be_a_folder(command, tmp_path, capsys):
    """A file given as --out is refused by the parser, before any compile or benchmark run."""
    (tmp_path / "file").write_text("")
    message = _parser_error([*command, "--out", str(tmp_path / "file")], capsys)
    assert f"argument --out: {tmp_path / 'file'} exists and is not a folder" in message
    assert "--out DIR is required" in _parser_error(["compile"], capsys)
    assert "argument --out: an empty path is not a folder" in _parser_error([*command, "--out", ""], capsys)


def test_bench_flush_option(capsys, monkeypatch, tmp_path):
    """``bitdecode bench decode --flush`` reaches the sweep's timer (clean by default); the
    bitnet suite, which flushes nothing, refuses it by name, with or without a GPU (the
    clash, not the missing GPU, is what is wrong); a bad value is refused."""
    import torch

    from bitdecode import cli_bench

    assert "argument --flush: invalid choice" in _parser_error(["bench", "decode", "--flush", "memset"], capsys)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    runs = []

    class Suite:
        @staticmethod
        def run(out, quick=False, progress=None, **kw):
            runs.append(kw)
            return {}

    monkeypatch.setattr(cli_bench, "_load", lambda suite: Suite)
    assert main(["bench", "decode", "--out", str(tmp_path)]) == 0
    assert main(["bench", "decode", "--flush", "dirty", "--out", str(tmp_path)]) == 0
    assert main(["bench", "bitnet", "--out", str(tmp_path)]) == 0
    assert runs == [{"flush": "clean"}, {"flush": "dirty"}, {}]
    capsys.readouterr()
    for gpu in (True, False):
        monkeypatch.setattr(torch.cuda, "is_available", lambda gpu=gpu: gpu)
        message = _parser_error(["bench", "bitnet", "--flush", "dirty", "--out", str(tmp_path)], capsys)
        assert "--flush: only the decode suite flushes L2 (bitnet rotates its operands)" in message
    assert len(runs) == 3


def test_compile_only_combine_when_no_format_fits(tmp_path, capsys, monkeypatch):
    """Group 128 at head dim 64 leaves no decode variant: refused, not a run of the combine
    kernel alone."""
    line = _one_line_error(["compile", "--out", str(tmp_path / "ptx"), "--head-dim", "64", "--group-size", "128",
                            "--kernels", "decode,combine"], capsys, monkeypatch)
    assert "no decode variant" in line and not (tmp_path / "ptx").exists()


def test_compile_warm_cache_without_gpu(capsys, monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the message on a machine without CUDA")
    line = _one_line_error(["compile", "--warm-cache"], capsys, monkeypatch)
    assert "--warm-cache" in line and "no CUDA GPU is available" in line


def test_compile_help_states_every_default(capsys):
    with pytest.raises(SystemExit):
        main(["compile", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for text in ("--bits LIST integer formats' widths, comma list of 4,2 (default 4,2",
                 "--k-mode LIST integer formats' K modes, comma list of channel,token (default channel,token)",
                 "--group-size LIST integer formats' group sizes, comma list of 32,64,128 (default 32,64,128",
                 "--head-dim LIST head dims, comma list of 64,128,256 (default 64,128,256)",
                 "--dtype LIST 16-bit types, comma list of fp16,bf16 (default fp16,bf16)",
                 f"(default: the CPU count, {os.cpu_count()} here)"):
        assert text in out, text


def test_compile_counts_each_copy_kind_apart():
    """The table's copy columns: cp.async.ca / .cg copies, not their commit / wait groups;
    bulk and TMA copies, not bulk prefetches or bulk commit / wait groups."""
    from bitdecode import cli_compile

    ptx = "\n".join([
        "cp.async.cg.shared.global [%r1], [%rd1], 16;", "cp.async.cg.shared.global [%r2], [%rd2], 16;",
        "cp.async.ca.shared.global [%r3], [%rd3], 4;", "cp.async.commit_group;", "cp.async.wait_group 0;",
        "cp.async.wait_all;",
        "cp.async.bulk.tensor.4d.shared::cta.global.tile.mbarrier::complete_tx::bytes [%r4], [%rd4, {%r5}], [%r6];",
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%r7], [%rd5], 512, [%r8];",
        "cp.async.bulk.global.shared::cta.bulk_group [%rd6], [%r9], 256;", "cp.async.bulk.commit_group;",
        "cp.async.bulk.wait_group.read 0;", "cp.async.bulk.prefetch.L2.global [%rd7], 128;",
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%f1}, {%r1}, {%r2}, {%f2};",
        "lop3.b32 %r1, %r2, %r3, %r4, 0xea;",
    ])
    counts = cli_compile.count_instructions(ptx)
    assert counts["cp.async.ca|cg"] == 3 and counts["cp.async.bulk[.tensor]"] == 3
    assert counts["mma.sync"] == 1 and counts["lop3"] == 1 and counts["wgmma"] == counts["ldmatrix"] == 0


def test_compile_combine_table(tmp_path, monkeypatch):
    """One small real compile (the combine kernel, about a second): its PTX file and the
    table's precisely named columns."""
    monkeypatch.setenv("BITDECODE_NO_DISK_CACHE", "1")
    out = bitdecode("compile", "--kernels", "combine", "--head-dim", "64", "--dtype", "fp16", "--jobs", "1",
                    "--out", str(tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == ["combine_fp16_d64.sm_80.ptx"]
    assert "cp.async.ca|cg" in out and "cp.async.bulk[.tensor]" in out and "wrote 1 variants" in out


@pytest.mark.parametrize("argv, message", [
    (["--format-json", "{bad"], "argument --format-json: not valid JSON"),
    (["--format-json", '{"bits": 3}'], "argument --format-json: KVFormat.bits must be one of (4, 2), got 3"),
    (["--format-json", '{"bitz": 4}'], "argument --format-json: not a KVFormat"),
    (["--format-json", "[4]"], "argument --format-json: expected a JSON object"),
    (["--format-json", '{"bits": 2}', "--bits", "4"], "--format-json gives every KVFormat field: give no --bits"),
    (["--format-json", '{"bits": 4}', "--fp4", "nvfp4"], "give no --fp4"),
    (["--fp4", "nvfp4", "--bits", "2"], "--bits must be 4 or left out"),
    (["--dtype", "fp32"], "argument --dtype: invalid choice: 'fp32'"),
    (["--head-dim", "96"], "argument --head-dim: invalid choice: 96"),
])
def test_selfcheck_refuses_bad_options(argv, message, capsys):
    assert message in _parser_error(["selfcheck", "--backend", "sm90", *argv], capsys)


@pytest.mark.parametrize("argv, message", [
    (["tune"], "the following arguments are required: --out"),
    (["tune", "--out", "t.json", "--shapes", "4096x100"], "argument --shapes: shapes: the weights' columns K"),
    (["tune", "--out", "t.json", "--shapes", "4096"], "argument --shapes: shapes must be NxK pairs"),
    (["tune", "--out", "t.json", "--replays", "0"], "argument --replays: must be a positive integer"),
    (["tune", "--out", "/nonexistent/dir/t.json"], "argument --out: no such folder"),
])
def test_tune_command_refuses_bad_options(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert message in _parser_error(argv, capsys)


def test_tune_command_help_and_no_gpu(tmp_path):
    """``bitdecode tune``'s help names the file variable; without a GPU it exits 2 with one
    line and writes nothing (its run path is tests/test_bitnet_tune.py's)."""
    import torch

    out = bitdecode("tune", "--help", timeout=120)
    assert "BITDECODE_GEMV_TUNING" in out and "--shapes" in out
    if torch.cuda.is_available():
        return
    env = dict(os.environ, COLUMNS="200", NO_COLOR="1", TERM="dumb")
    proc = subprocess.run([sys.executable, "-m", "bitdecode.cli", "tune", "--out", str(tmp_path / "t.json")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr and "Traceback" not in proc.stdout + proc.stderr
    assert not (tmp_path / "t.json").exists()


def test_selfcheck_backend_and_dtype_choices(capsys):
    from bitdecode import backend as backends
    from bitdecode.cli import build_parser

    assert "argument --backend: invalid choice: 'sm70'" in _parser_error(["selfcheck", "--backend", "sm70"], capsys)
    parser = build_parser(["selfcheck"])
    for name in backends.REGISTRY:
        assert parser.parse_args(["selfcheck", "--backend", name]).backend == name
    args = parser.parse_args(["selfcheck", "--backend", "sm80"])
    assert args.dtype == "fp16" and args.format_json is None
    for name in ("fp16", "bf16", "float16", "bfloat16"):  # (the child auto starts names torch's spelling)
        assert parser.parse_args(["selfcheck", "--backend", "sm80", "--dtype", name]).dtype == name
    args = parser.parse_args(["selfcheck", "--backend", "sm80", "--format-json", '{"bits": 4, "v_bits": 2}'])
    assert args.format_json.v_bits == 2
    import torch

    if not torch.cuda.is_available():  # 2 as the other GPU commands; 1 is the check's "FAILED"
        assert main(["selfcheck", "--backend", "sm80", "--dtype", "bf16"]) == 2
        assert "selfcheck: needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("name, path", [("/nonexistent_model_dir", True), ("./model", True), ("~/model", True),
                                        ("a/b/c", True), ("org/model-1.5B", False), ("model", False)])
def test_generate_model_argument_that_is_a_path(name, path):
    from bitdecode.cli_generate import looks_like_path

    assert looks_like_path(name) == path


def test_generate_model_folder_missing(tmp_path, capsys, monkeypatch):
    missing = tmp_path / "missing-model"
    line = _one_line_error(["generate", "--device", "cpu", str(missing)], capsys, monkeypatch)
    assert line == f"error: cannot load '{missing}': no such folder"


def _profile_script(name: str):
    """profiles/<name>.py, loaded by path (profiles/ is not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "profiles" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bench_variants():
    return _profile_script("bench_variants")


def _refused(main, argv, message, capsys):
    """A profiles/ script's ``main(argv)`` exits through argparse with ``message`` on stderr."""
    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err


def test_probe_patches_apply(tmp_path):
    """profiles/probes/*.patch, the measurement-only kernel switches that NOTES.md's numbers
    name, still apply to the tree (``git apply --check``) and leave Python that parses (a
    refresh that kept a merge's conflict markers applies cleanly too), so the measurements
    can be repeated; a kernel change that breaks one must refresh it.
    (``profiles/probes/pinned/`` holds rejected experiments that apply to the commit their
    name gives, not checked.)"""
    import ast
    import shutil
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists() or shutil.which("git") is None:
        pytest.skip("needs a git checkout")
    patches = sorted((root / "profiles" / "probes").glob("*.patch"))
    assert patches
    for patch in patches:
        done = subprocess.run(["git", "apply", "--check", str(patch)], cwd=root, capture_output=True, text=True)
        assert done.returncode == 0, f"{patch.name}: {done.stderr}"
        # the patched files, in a copy of their own outside any repository
        copy = tmp_path / patch.stem
        files = re.findall(r"^diff --git a/(\S+) b/", patch.read_text(), re.M)
        for name in files:
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(root / name, copy / name)
        done = subprocess.run(["git", "apply", str(patch)], cwd=copy, capture_output=True, text=True,
                              env={**os.environ, "GIT_CEILING_DIRECTORIES": str(tmp_path)})
        assert done.returncode == 0, f"{patch.name}: {done.stderr}"
        for name in files:
            text = (copy / name).read_text()
            assert not re.search(r"^(<<<<<<<|>>>>>>>) ", text, re.M), f"{patch.name}: conflict markers in {name}"
            if name.endswith(".py"):
                ast.parse(text, filename=f"{name} ({patch.name})")


def test_bench_gemv_sweep_arguments(capsys, monkeypatch):
    """profiles/bench_gemv_sweep.py: NxK shapes on the packed format's tiles, a tag that is
    an identifier; on a machine without a GPU it says so instead of timing anything."""
    import torch
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "profiles"))
    sweep = _profile_script("bench_gemv_sweep")
    assert sweep.parse_shapes("8448x2560,16x128") == [(8448, 2560), (16, 128)]
    for bad, message in (("100x128", "N % 16 == 0"), ("16x100", "K % 128 == 0"), ("16", "must be NxK"),
                         (",", "no shape")):
        _refused(sweep.main, ["--shapes", bad, "--out", "x"], message, capsys)
    _refused(sweep.main, ["--shapes", "16x128", "--out", "x", "--tag", "a-b"], "Python identifier", capsys)
    if not torch.cuda.is_available():
        assert sweep.main(["--shapes", "16x128", "--out", "x"]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err


def test_bench_gemv_checks_every_timed_output(monkeypatch):
    """``bench_bitnet.wrong_gemv_outputs`` (what the GEMV sweeps record as ``wrong_outputs``
    and ``bench_gemv_scales`` as ``bit_equal``): nothing where every configuration's output
    equals the host's and the host's is the reference's; the name of a configuration whose
    bf16 output is one ulp off, or whose raw sums are; ``host`` once the host's are off the
    reference.  Run on the CPU: the launches are stand-ins over the torch reference."""
    import torch
    from pathlib import Path

    from bitdecode import bitnet as bn

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "profiles"))
    bench = _profile_script("bench_bitnet")
    assert bench.check_segments(16) == (16,) and bench.check_segments(3216) == (800, 800, 1616)
    gen = torch.Generator().manual_seed(3)
    packed = bn.pack_weight(torch.randint(-1, 2, (64, 256), generator=gen, dtype=torch.int8))
    x, xs = bn.quantize_activation(torch.randn(1, 256, generator=gen))
    seen = []

    def launch(x, w, xs, ws, ends, raw, cfg):
        seen.append((tuple(ends), tuple(ws.tolist())))
        segs = tuple(b - a for a, b in zip([0] + ends, ends) if b > a)
        out = bn.reference_gemm(x, w, xs, ws, segs, torch.int32 if raw else torch.bfloat16)
        if cfg == "bf16_off" and not raw:
            out.view(torch.int16)[0, 5] += 1
        if (cfg == "raw_off" or (cfg is None and host_off)) and raw:
            out[0, 5] += 1
        return out

    monkeypatch.setattr(bn, "_gemv_launch", launch)
    host_off = False
    assert bench.wrong_gemv_outputs(x, packed, xs, {"a": "same", "b": "bf16_off", "c": "raw_off"}) == ["b", "c"]
    assert seen[0] == ((16, 32, 64), (0.75, 1.25, 1.5))  # three fused segments, their own scales
    assert bench.wrong_gemv_outputs(x, packed, xs, {"a": "same"}) == []
    host_off = True
    assert bench.wrong_gemv_outputs(x, packed, xs, {"a": "same"}) == ["host", "a"]


def test_bench_gemv_scales_arguments(capsys, monkeypatch):
    """profiles/bench_gemv_scales.py: forms of ``bench_bitnet.gemv_forms``, NxK shapes, a tag
    that is an identifier, refused by name before any GPU work; on a machine without a GPU
    it says so instead of timing anything."""
    import torch
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "profiles"))
    scales = _profile_script("bench_gemv_scales")
    _refused(scales.main, ["--out", "x", "--forms", "bulk,nope"], "--forms takes names of", capsys)
    _refused(scales.main, ["--out", "x", "--forms", ","], "--forms takes names of", capsys)
    _refused(scales.main, ["--out", "x", "--shapes", "100x128"], "N % 16 == 0", capsys)
    _refused(scales.main, ["--out", "x", "--tag", "a-b"], "Python identifier", capsys)
    if not torch.cuda.is_available():
        assert scales.main(["--out", "x", "--forms", "bulk,bulk_x", "--shapes", "3200x10240"]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err


def test_bench_splits_arguments(capsys):
    """profiles/bench_splits.py: a known format, model dtype and backends, else it refuses; on a
    machine without a GPU it says so instead of timing anything."""
    import torch

    bs = _profile_script("bench_splits")
    _refused(bs.main, ["--dtype", "fp8"], "invalid choice", capsys)
    _refused(bs.main, ["--format", "9c1"], "invalid choice", capsys)
    with pytest.raises(SystemExit, match="--backends: unknown"):
        bs.main(["--backends", "sm90,sm70"])
    for heads in ("32", "32/5", "4/8", "x/8"):
        with pytest.raises(SystemExit, match="--heads"):
            bs.main(["--heads", heads])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            bs.main(["--dtype", "bf16"])


def test_bench_dense_arguments(capsys):
    """profiles/bench_dense.py: token counts 1 to 16 (past the GEMV's three: the small-M
    GEMM), a tag that names a file, else it refuses; without a GPU it says so."""
    import torch

    bd_ = _profile_script("bench_dense")
    _refused(bd_.main, ["--tokens", "0,4"], "--tokens must each be 1 to 16", capsys)
    _refused(bd_.main, ["--tokens", "4,x"], "--tokens must be integers", capsys)
    _refused(bd_.main, ["--tokens", "8", "--tag", "a/b"], "--tag must be a Python identifier", capsys)
    _refused(bd_.main, ["--small-m", "w8b4,8x4"], "--small-m must be wWbB", capsys)
    _refused(bd_.main, ["--small-m", "w8b0"], "--small-m must be wWbB", capsys)
    assert bd_.parse_small_m("w8b4,w2b16r3") == [(8, 4, 1), (2, 16, 3)]
    if not torch.cuda.is_available():
        _refused(bd_.main, ["--tokens", "4,8,16", "--tag", "small_m"], "needs a CUDA GPU", capsys)


def test_bench_variants_arguments(capsys):
    """profiles/bench_variants.py: NAME=key=value variants (Python literals), BxN shapes, and
    clear refusals naming the argument; without a GPU it says so and exits 2."""
    bv = _bench_variants()
    assert bv.parse_variant("base=") == ("base", {})
    assert bv.parse_variant("exact=lazy_max=False,num_stages=3") == ("exact", {"lazy_max": False, "num_stages": 3})
    assert bv.parse_shapes("1x4096,16x65536") == [(1, 4096), (16, 65536)]
    for bad, message in (("lazy_max=False", "expected key=value"), ("x=lazy_max", "expected key=value"),
                         ("1x=a=1", "NAME an identifier"), ("v=step=sixty", "is not a Python literal")):
        with pytest.raises(ValueError, match=message):
            bv.parse_variant(bad)
    for bad in ("16", "0x4096", "4x-1"):
        with pytest.raises(ValueError, match="--shapes"):
            bv.parse_shapes(bad)
    _refused(bv.main, ["--variant", "a=", "--variant", "a=lazy_max=False"], "names must differ", capsys)
    _refused(bv.main, ["--variant", "a=", "--formats", "5c128"], "unknown format", capsys)
    _refused(bv.main, ["--variant", "a=", "--tag", "2-bit"], "--tag must be an identifier", capsys)
    _refused(bv.main, ["--variant", "a=", "--backend", "sm70"], "--backend: invalid choice", capsys)
    assert set(bv.KERNEL_CLASSES) == {"sm80", "sm90"}
    _refused(bv.main, ["--variant", "a=early_load=True"], "early_load is no keyword", capsys)  # (a typo)
    assert {"early_loads", "hoist_loads", "num_stages"} <= bv.known_keywords("sm80")
    assert {"early_tiles", "hoist_loads", "v_slots"} <= bv.known_keywords("sm90")
    import torch

    if not torch.cuda.is_available():
        assert bv.main(["--variant", "a="]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err


def test_bench_ring_arguments(capsys):
    """profiles/bench_ring.py: refusals naming the argument; without a GPU it says so."""
    import torch

    br = _profile_script("bench_ring")
    _refused(br.main, ["--out", "x", "--stages", "2,0"], "expected positive integers", capsys)
    _refused(br.main, ["--out", "x", "--tile-kb", "8,a"], "expected comma-separated integers", capsys)
    _refused(br.main, ["--out", "x", "--tag", "a-b"], "--tag must be an identifier", capsys)
    _refused(br.main, ["--out", "x", "--gib", "0"], "--gib and --replays must be positive", capsys)
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            br.main(["--out", "x"])


def test_bench_flush_arguments(capsys):
    """profiles/bench_flush.py and the benches' ``Timer``: refusals naming the argument (the
    flush is one of clean, dirty, none); without a GPU it says so."""
    import torch

    bf = _profile_script("bench_flush")
    _refused(bf.main, ["--out", "x", "--tag", "a-b"], "--tag must be an identifier", capsys)
    _refused(bf.main, ["--out", "x", "--rounds", "0"], "--rounds must be positive", capsys)
    _refused(bf.main, ["--out", "x", "--shapes", "16"], "--shapes", capsys)
    assert _profile_script("bench_decode").Timer.FLUSHES == ("clean", "dirty", "none")
    with pytest.raises(ValueError, match="flush must be one of clean, dirty, none, got 'memset'"):
        _profile_script("bench_decode").Timer(torch.device("cpu"), flush="memset")
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            bf.main(["--out", "x"])


def test_ncu_ring_arguments(capsys):
    """profiles/ncu_ring.py: a kernel is required, one shape, known formats; without a GPU
    it says so."""
    import torch

    nr = _profile_script("ncu_ring")
    _refused(nr.main, [], "the following arguments are required: kernel", capsys)
    _refused(nr.main, ["decode", "--shape", "1x4096,2x4096"], "--shape takes one BxN", capsys)
    _refused(nr.main, ["decode", "--format", "3c128"], "--format: invalid choice", capsys)
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            nr.main(["ring"])


def test_bench_variants_write_result(tmp_path, monkeypatch):
    """The A/B scripts' JSON: the command that reproduces the run (script, every --variant,
    the script's options, --out, --tag), the GPU, torch, the variants, method and rows."""
    import argparse

    import torch

    bv = _bench_variants()
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "H200-like")
    args = argparse.Namespace(variant=["plan=", "t96=block_m=96"], out=tmp_path, tag="short")
    bv.write_result(args, "gemm_variants", "--shapes 4800x3200 --ms 256", [("plan", {}), ("t96", {"block_m": 96})],
                    "graph replay", [{"m": 256}])
    got = json.loads((tmp_path / "gemm_variants_short.json").read_text())
    assert got == {"command": f"python3 profiles/bench_gemm_variants.py --variant plan= --variant t96=block_m=96 "
                              f"--shapes 4800x3200 --ms 256 --out {tmp_path} --tag short",
                   "gpu": "H200-like", "torch": torch.__version__, "variants": {"plan": {}, "t96": {"block_m": 96}},
                   "method": "graph replay", "rows": [{"m": 256}]}
    bv.write_result(argparse.Namespace(variant=["a="], out=None, tag=""), "variants", "", [("a", {})], "", [])
    assert [p.name for p in tmp_path.iterdir()] == ["gemm_variants_short.json"]  # no --out: nothing written


def test_bench_variants_goes_on_past_a_failed_variant(tmp_path, monkeypatch):
    """A variant's worker that exits with an error or hangs loses its own rows only: the
    rows it printed are kept, the reason comes back, and the JSON lists it under
    ``failed`` (a refused launch ended a whole device run before)."""
    import argparse
    import sys

    import torch

    bv = _bench_variants()
    row = '{"variant": "a", "us": 1.5}'
    rows, why = bv.run_variant([sys.executable, "-c", f"print({row!r}); import sys; sys.stderr.write('refused\\n'); "
                                                      "sys.exit(3)"], dict(os.environ), 60)
    assert rows == [{"variant": "a", "us": 1.5}] and why.startswith("exit status 3:") and "refused" in why
    rows, why = bv.run_variant([sys.executable, "-c", f"print({row!r}, flush=True); import time; time.sleep(60)"],
                               dict(os.environ), 3)
    assert rows == [{"variant": "a", "us": 1.5}] and why == "timed out after 3 s"
    assert bv.run_variant([sys.executable, "-c", f"print({row!r})"], dict(os.environ), 60) == (
        [{"variant": "a", "us": 1.5}], "")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "H200-like")
    args = argparse.Namespace(variant=["a=", "b=num_stages=9"], out=tmp_path, tag="")
    bv.write_result(args, "variants", "", [("a", {}), ("b", {"num_stages": 9})], "m", [],
                    [{"variant": "b", "why": "exit status 1: launch refused"}])
    assert json.loads((tmp_path / "variants.json").read_text())["failed"] == [
        {"variant": "b", "why": "exit status 1: launch refused"}]


def test_bench_gemm_variants_arguments(capsys):
    """profiles/bench_gemm_variants.py: the variant keys (tile, WgmmaConfig fields, cluster
    CTAs, workspace splits, PDL, a persistent grid, kernel) become the tile and plans the
    host launches, unset keys keep the host's; bad keys, values and shapes are refused
    naming the argument; without a Hopper GPU it says so and exits 2."""
    from bitdecode.kernels_sm90 import bitnet_gemm as g90

    bg = _profile_script("bench_gemm_variants")
    host = g90.config_for, g90.cluster_plan, g90.split_plan
    host_plans = g90.pdl_plan, g90.persistent_plan

    def chosen(kwargs, m, n, k):
        cfg = bg.variant_tile(kwargs, m, n, 132, host[0])
        return cfg, bg.variant_plan(kwargs, cfg, m, n, k, 132, *host[1:])

    # no key: the host's own choices (M = 64, 2560 x 2560: a cluster of two on the small tile)
    assert chosen({}, 64, 2560, 2560) == (g90.SMALL, (2, (40, 1, 0)))
    assert chosen({"cluster_k": 1, "splits": 1}, 64, 2560, 2560) == (g90.SMALL, (1, (40, 1, 0)))
    # tile and kernel take bare words on the command line, other keys Python literals
    bv = _profile_script("bench_variants")
    words = ("tile", "kernel")
    assert bv.parse_variant("a=tile=medium,kernel=mma,stages=3", words) == ("a", {"tile": "medium", "kernel": "mma",
                                                                                  "stages": 3})
    with pytest.raises(ValueError, match="not a Python literal"):
        bv.parse_variant("a=stages=three", words)
    # 120 tiles of 96 tokens (the host's pick: fewer CTAs than SMs) for 264 slots: all of
    # them the last wave's, three CTAs each
    assert chosen({"splits": 3}, 256, 2560, 2560) == (g90.MEDIUM_96, (1, (0, 3, 120)))
    assert chosen({"tile": "medium", "splits": 3}, 256, 2560, 2560) == (g90.MEDIUM, (1, (0, 3, 80)))
    cfg, plan = chosen({"tile": "large", "stages": 3}, 256, 2560, 2560)
    assert (cfg.block_m, cfg.stages, plan[0]) == (256, 3, 1)
    with bg.applied({"tile": "medium", "cluster_k": 2}):
        assert g90.config_for(64, 2560, 132) == g90.MEDIUM
        assert g90.cluster_plan(g90.MEDIUM, 64, 2560, 2560, 132) == 2
        assert g90.pdl_plan(64) and not g90.pdl_plan(4096)  # unset: the host's
    # pdl is a plan key: it decides the launch whatever the host would, and never reaches
    # the tile as a field
    for pdl in (True, False):
        with bg.applied({"pdl": pdl}):
            assert g90.pdl_plan(64) == g90.pdl_plan(4096) == pdl
            assert g90.config_for(64, 2560, 132) == g90.SMALL
    # persistent: a CTA an SM for tiles of one an SM (whatever K and the tile count), never
    # for two-CTA tiles or where the staging does not fit; unset, the host's
    with bg.applied({"persistent": True}):
        assert g90.persistent_plan(g90.LARGE, 1024, 2560, 10240, 132) == 132
        assert g90.persistent_plan(g90.MEDIUM, 1024, 2560, 2560, 132) == 0
        assert g90.persistent_plan(dataclasses.replace(g90.LARGE, raw=True), 4096, 20480, 3200, 132) == 0
    with bg.applied({"persistent": False}):
        assert g90.persistent_plan(g90.LARGE, 4096, 20480, 3200, 132) == 0
    with bg.applied({}):
        assert g90.persistent_plan(g90.LARGE, 4096, 20480, 3200, 132) == 132
    assert (g90.config_for, g90.cluster_plan, g90.split_plan, g90.pdl_plan, g90.persistent_plan) == host + host_plans
    assert bg.parse_shapes("2560x2560,20480x3200") == [(2560, 2560), (20480, 3200)]
    for bad in ("2560", "2561x2560", "2560x100", "0x128"):
        with pytest.raises(ValueError, match="--shapes"):
            bg.parse_shapes(bad)
    for kwargs, message in (({"foo": 1}, "unknown key 'foo'"), ({"tile": "huge"}, "tile must be"),
                            ({"kernel": "cublas"}, "kernel must be")):
        with pytest.raises(ValueError, match=message):
            bg.check_variant("v", kwargs)
    _refused(bg.main, ["--variant", "a=foo=1"], "unknown key", capsys)
    _refused(bg.main, ["--variant", "a=", "--variant", "a=splits=1"], "names must differ", capsys)
    import torch

    if not torch.cuda.is_available():
        assert bg.main(["--variant", "a="]) == 2
        assert "needs a Hopper GPU" in capsys.readouterr().err


@pytest.mark.parametrize("splits", [1, 4])
def test_host_python_measures_the_one_call_path(tmp_path, capsys, splits):
    """profiles/host_python.py (the eager step's Python on a CPU, launches stubbed) runs the
    appending decode's one-call path on every step it times (a step that left it raises),
    writes its row, and puts back what it stubbed."""
    import json

    import torch

    from bitdecode.kernels_sm80 import backend as sm80_backend

    script = _profile_script("host_python")
    plan, capturing = sm80_backend.Sm80Backend.plan, torch._C._cuda_isCurrentStreamCapturing
    assert script.main(["--layers", "2", "--rounds", "5", "--steps", "5", "--splits", str(splits),
                        "--out", str(tmp_path)]) == 0
    row = json.loads((tmp_path / "host_python.json").read_text())["row"]
    assert 0 < row["plan_us_per_layer"] < row["one_call_us_per_layer"] and row["splits"] == splits
    assert "one call" in capsys.readouterr().out
    assert sm80_backend.Sm80Backend.plan is plan and torch._C._cuda_isCurrentStreamCapturing is capturing
    _refused(script.main, ["--layers", "0"], "must be positive", capsys)


def test_bench_variants_merge_variant_is_launched_as_built(monkeypatch):
    """A variant's keywords go to the kernel class's ``__init__`` (``apply_keywords``), so
    what the host asks of the built kernel (whether the split decode merges in its last
    CTAs, and so which arguments it is launched with) must come from the kernel object:
    ``merge_splits=True`` on 2-bit (whose default keeps the combine) merges, and off on
    4-bit (whose default merges) does not."""
    pytest.importorskip("cutlass")
    import cutlass

    from bitdecode.formats import KVFormat
    from bitdecode.kernels_sm90 import backend as sm90

    bv = _bench_variants()
    two, four = KVFormat(bits=2, k_mode="channel", group_size=128), KVFormat(bits=4, k_mode="channel", group_size=128)
    host = sm90.Sm90Backend()
    asked = lambda fmt: host.merges_splits("sm_90a", fmt, cutlass.Float16, 128, 8, True)  # noqa: E731
    assert (asked(two), asked(four)) == (False, True)  # the defaults
    for on in (True, False):
        for cls in bv.variant_classes("sm90"):
            monkeypatch.setattr(cls, "__init__", cls.__init__)  # (put back after the test)
        bv.apply_keywords({"merge_splits": on})
        assert (asked(two), asked(four)) == (on, on)
        monkeypatch.undo()


# --------------------------------------------------------------------------------------
# the disk cache under the CLI: switched off, not writable, not readable (a helper's audit,
# sixty-first session)
# --------------------------------------------------------------------------------------


def _fake_gpu(monkeypatch):
    import torch

    from bitdecode import jit

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(jit, "target_arch", lambda device_index=None: "sm_90a")
    monkeypatch.setattr(jit, "fingerprint", lambda: "fp")


def test_compile_warm_cache_refuses_a_cache_it_cannot_fill(tmp_path, capsys, monkeypatch):
    """--warm-cache with the disk cache switched off, or a folder it cannot write, is
    refused before anything compiles (it used to compile and say "wrote N variants")."""
    from bitdecode import cli_compile

    _fake_gpu(monkeypatch)
    monkeypatch.setattr(cli_compile, "_compile_one", lambda *a: pytest.fail("compiled"))
    monkeypatch.setenv("BITDECODE_NO_DISK_CACHE", "1")
    line = _one_line_error(["compile", "--warm-cache"], capsys, monkeypatch)
    assert "BITDECODE_NO_DISK_CACHE='1' switches it off" in line
    monkeypatch.delenv("BITDECODE_NO_DISK_CACHE")
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("BITDECODE_CACHE_DIR", str(tmp_path / "file" / "below"))  # (under a file: no folder)
    line = _one_line_error(["compile", "--warm-cache"], capsys, monkeypatch)
    assert "--warm-cache fills the JIT disk cache, but it cannot be written" in line


def test_compile_warm_cache_reports_kernels_the_disk_did_not_take(tmp_path, capsys, monkeypatch):
    from bitdecode import cli_compile

    _fake_gpu(monkeypatch)
    monkeypatch.delenv("BITDECODE_NO_DISK_CACHE", raising=False)
    monkeypatch.setenv("BITDECODE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cli_compile, "_compile_one", lambda v, *a: (v.name, 0.1, {"unwritten": 1}))
    assert main(["compile", "--warm-cache", "--kernels", "combine", "--jobs", "1"]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "the JIT disk cache did not take 6 of the kernels compiled" in err  # (one a combine variant)


def test_info_prints_its_table_whatever_the_cache(capsys, monkeypatch):
    """``bitdecode info`` on a broken CuTe DSL install or an unreadable cache folder prints
    the table with the reason in the cache's row (it used to exit 1 with a traceback)."""
    from bitdecode import jit

    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.delenv("BITDECODE_NO_DISK_CACHE", raising=False)

    def broken():
        raise ModuleNotFoundError("No module named 'cutlass'")

    monkeypatch.setattr(jit, "cache_dir", broken)
    assert main(["info"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "unavailable" in out and "ModuleNotFoundError: No module named 'cutlass'" in out and "GEMV tuning" in out
    monkeypatch.setenv("BITDECODE_NO_DISK_CACHE", "1")
    assert main(["info"]) == 0
    assert "off ($BITDECODE_NO_DISK_CACHE='1')" in " ".join(capsys.readouterr().out.split())


def test_selfcheck_refuses_a_device_it_does_not_have(capsys, monkeypatch):
    """A device index that is negative, or past the machine's devices, is a refusal (exit
    2), not a FAILED check (exit 1) with a traceback."""
    import torch

    assert "argument --device" in _parser_error(["selfcheck", "--backend", "sm80", "--device", "-1"], capsys)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    line = _one_line_error(["selfcheck", "--backend", "sm80", "--device", "2"], capsys, monkeypatch)
    assert "--device 2: this machine has 2 CUDA device(s), 0..1" in line


@pytest.mark.parametrize("fmt_kw, n", [(dict(bits=4), 4196), (dict(bits=2, group_size=32, sink_tokens=16), 4096),
                                       (dict(bits=4, v_bits=2, k_mode="token", group_size=64), 1000)])
def test_decode_bench_counts_the_bytes_the_cache_holds(fmt_kw, n):
    """The decode benchmark's roofline bytes come from the cache's own tensors: packed
    tokens at what they take in the pages, the residual and the sink tokens 16-bit (its
    formula used to count the sinks as packed: 21 % low at 2-bit g32 with 16 sinks)."""
    import torch

    import bitdecode as bd

    bench = _profile_script("bench_decode")
    fmt = bd.KVFormat(**fmt_kw)
    cache = bd.KVCache.allocate(2, 8, 128, n + 64, fmt, device="cpu", backend="reference")
    k = torch.randn(2, n, 8, 128, dtype=torch.float16)
    cache.prefill(k, k, [n, n - 37])
    want = 0
    for length in (n, n - 37):
        rest = length - fmt.sink_tokens
        packed = rest // fmt.residual_block * fmt.residual_block
        want += 8 * (packed * fmt.bytes_per_token(128) + (rest - packed + fmt.sink_tokens) * 128 * 2 * 2)
    assert bench.cache_bytes(cache) == want


def test_bitnet_bench_judges_targets_on_whole_sets_only():
    """The BitNet benchmark's targets are judged on the sets they name: a run without some
    M (a quick run, or rows lost) reports ``pass`` None instead of passing on what is left,
    and a wrong output passes nothing (it used to pass the GEMM's minimum with every M = 256
    row removed)."""
    bench = _profile_script("bench_bitnet")
    gemv = [dict(n=n, k=k, roofline_frac=0.8, speedup=5.0, us=3.0) for n, k in bench.SHAPES]
    gemm = [dict(m=m, n=n, k=k, default=True, speedup=2.0) for m in bench.GEMM_M for n, k in bench.SHAPES]
    whole = bench.check_targets(gemv, gemm)
    assert all(whole["pass"].values()) and "not_judged_because" not in whole
    partial = bench.check_targets(gemv, [r for r in gemm if r["m"] != 256])
    assert partial["pass"]["gemm_min_speedup"] is None and partial["pass"]["roofline_frac_largest3"] is True
    assert "partial run" in partial["not_judged_because"]
    wrong = bench.check_targets(gemv, gemm, ["gemm M=16 2560x2560 mma"])
    assert not any(wrong["pass"].values()) and "gemm M=16 2560x2560 mma" in wrong["not_passed_because"]


# --------------------------------------------------------------------------------------
# Mutation audit of the command-line modules: bounds, exit codes and what each command
# hands on
# --------------------------------------------------------------------------------------


def test_integer_options_take_int64_max_and_refuse_one_more(capsys):
    """The count and seed types' bound is torch's int64 maximum, inclusive: 2**63 - 1
    parses, 2**63 is refused naming the option."""
    assert positive_int(str(INT64_MAX)) == INT64_MAX and nonnegative_int(str(INT64_MAX)) == INT64_MAX
    for parse in (positive_int, nonnegative_int):
        with pytest.raises(argparse.ArgumentTypeError, match=f"at most {INT64_MAX}"):
            parse(str(INT64_MAX + 1))
    assert "argument --seed: must be an integer >= 0" in _parser_error(["demo", "--seed", str(2**63)], capsys)


@pytest.mark.parametrize("window, message", [
    (",", "expected positive integers, got ','"),
    ("64,0", "expected positive integers, got '64,0'"),
    ("64,x", "expected comma-separated integers, got '64,x'"),
])
def test_eval_window_refuses_an_empty_list_a_zero_and_a_non_integer(window, message, capsys):
    """--window (a positive_int_list): a list with no length in it, a zero length or a word
    is refused by the parser naming the option; a list with spaces parses."""
    argv = ["eval", "--gguf-file", "/nonexistent/model.gguf", "--device", "cpu"]
    assert f"argument --window: {message}" in _parser_error([*argv, "--window", window], capsys)
    assert build_parser(["eval"]).parse_args([*argv, "--window", "64, 128"]).window == [64, 128]


@pytest.mark.parametrize("argv, message", [
    (["layout", "packed", "--svg", "  "], "argument --svg: an empty path is not a file"),
    (["tune", "--out", " "], "argument --out: an empty path is not a file"),
])
def test_a_blank_path_is_refused_as_an_empty_one(argv, message, tmp_path, capsys, monkeypatch):
    """A path of spaces only is no file anyone asked for: refused by the parser as an empty
    one, and nothing is written in the working folder."""
    monkeypatch.chdir(tmp_path)
    assert message in _parser_error(argv, capsys)
    assert not any(tmp_path.iterdir())


def test_no_command_prints_the_usage_and_succeeds(capsys):
    """``bitdecode`` alone prints the usage listing every command and exits 0 (nothing
    failed)."""
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: bitdecode") and all(name in out for name in COMMANDS)


def test_bench_hands_out_and_quick_on_and_fails_on_wrong_outputs(tmp_path, capsys, monkeypatch):
    """``bitdecode bench``: without a GPU exit 2 before any suite loads; --out and --quick
    reach the suite's run; a run that lists wrong outputs exits 1 naming them."""
    import torch

    calls, wrong = [], []

    class Suite:
        @staticmethod
        def run(out, quick=False, progress=None, **kw):
            calls.append((out, quick))
            return {"wrong_outputs": list(wrong)}

    monkeypatch.setattr(cli_bench, "_load", lambda suite: Suite)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "bitnet", "--out", str(tmp_path)]) == 2
    assert "bitdecode bench needs a CUDA GPU" in capsys.readouterr().err and calls == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert main(["bench", "bitnet", "--out", str(tmp_path / "a"), "--quick"]) == 0
    assert main(["bench", "decode", "--out", str(tmp_path / "b")]) == 0
    assert calls == [(tmp_path / "a", True), (tmp_path / "b", False)]
    capsys.readouterr()
    wrong.append("gemv 2560x2560 pdl_bulk")
    assert main(["bench", "bitnet", "--out", str(tmp_path)]) == 1
    assert "wrong outputs: gemv 2560x2560 pdl_bulk" in " ".join(capsys.readouterr().err.split())


def test_compile_combine_alone_needs_no_kv_format(tmp_path):
    """The combine kernel takes no KV format: --kernels combine with empty --bits / --k-mode
    is no refusal (the decode / pack kernels refuse it, naming the empty options)."""
    args = build_parser(["compile"]).parse_args(["compile", "--out", str(tmp_path), "--kernels", "combine",
                                                 "--bits", "", "--k-mode", ""])
    assert cli_compile.check_args(args) is None
    args.kernels = ["combine", "pack"]
    assert "--bits, --k-mode empty and no --fp4" in cli_compile.check_args(args)


def test_compile_defaults(tmp_path):
    """compile's defaults as its help states them: sm_80, every kernel, format and head dim,
    and one compile process per CPU."""
    args = build_parser(["compile"]).parse_args(["compile", "--out", str(tmp_path)])
    assert args.arch == "sm_80" and args.jobs == (os.cpu_count() or 1)
    assert args.kernels == ["decode", "pack", "combine"] and args.head_dim == [64, 128, 256] and args.fp4 == []


def test_compile_out_it_cannot_make_is_one_line_before_compiling(capsys, monkeypatch):
    """An --out folder that cannot be made (under /proc, even as root) is refused with
    exit 2 and one line naming --out, before anything compiles."""
    if not Path("/proc/self").is_dir():
        pytest.skip("needs Linux's /proc")
    monkeypatch.setattr(cli_compile, "_compile_one", lambda *a: pytest.fail("compiled"))
    line = _one_line_error(["compile", "--out", "/proc/bitdecode_ptx", "--kernels", "combine", "--jobs", "1"], capsys,
                           monkeypatch)
    assert "--out /proc/bitdecode_ptx: cannot make the folder" in line


def test_demo_hands_its_options_and_defaults_to_the_measurement(capsys, monkeypatch):
    """What ``demo`` measures: on the CPU 4096 tokens, --backend auto, 4 and 2 bits, K per
    channel in groups of 128, batch 1, seed 0 by default; the options given otherwise (the
    backend as given, not auto)."""
    seen = []

    def measure(args, device, n, backend):
        seen.append((device, n, backend, args.bits, args.k_mode, args.group_size, args.batch, args.seed))
        rows = [(KVFormat(bits=b, k_mode=args.k_mode, group_size=args.group_size), 0.01, 300, None) for b in args.bits]
        return ("16-bit (torch SDPA, math)", 0.0, 1000, None), rows, [backend] * len(rows)

    monkeypatch.setattr(cli_demo, "measure", measure)
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["demo", "--device", "cpu"]) == 0
    assert "4,096 tokens" in capsys.readouterr().out
    assert main(["demo", "--device", "cpu", "--backend", "reference", "--seqlen", "300", "--bits", "2", "--k-mode",
                 "token", "--group-size", "32", "--batch", "3", "--seed", "5"]) == 0
    assert "2-bit (K per token, G=32)" in capsys.readouterr().out
    assert seen == [("cpu", 4096, "auto", [4, 2], "channel", 128, 1, 0),
                    ("cpu", 300, "reference", [2], "token", 32, 3, 5)]


def test_eval_needle_depths_take_both_ends_and_refuse_an_empty_list(capsys):
    """--needle-depths: fractions of the filler in [0, 1], both ends included; an empty
    list or a depth outside is refused by the parser naming the option."""
    argv = ["eval", "--gguf-file", "/nonexistent/model.gguf", "--device", "cpu"]
    assert build_parser(["eval"]).parse_args([*argv, "--needle-depths", "0,0.5,1"]).needle_depths == [0.0, 0.5, 1.0]
    for text in (",", "0.5,1.01", "-0.1"):
        assert "argument --needle-depths: expected depths in [0, 1]" in _parser_error(
            [*argv, "--needle-depths", text], capsys), text


def test_eval_out_json_path_that_is_a_folder(tmp_path, capsys):
    """An --out ending in .json names the results file: a folder of that name is refused by
    the parser (the run's results would be lost at its end)."""
    (tmp_path / "r.json").mkdir()
    line = _parser_error(["eval", "--gguf-file", "/nonexistent/model.gguf", "--device", "cpu", "--out",
                          str(tmp_path / "r.json")], capsys)
    assert f"argument --out: {tmp_path / 'r.json'} is a folder, not a .json file" in line


def test_eval_smollm2_refuses_a_second_model(capsys, monkeypatch):
    """--smollm2 names its own model: with --random-llama (or MODEL, --gguf-file) it is one
    line and exit 2, before anything is fetched."""
    monkeypatch.setattr(cli_eval, "fetch_smollm2", lambda *a: pytest.fail("fetched"))
    for extra in (["--random-llama", "tiny"], ["some/model"], ["--gguf-file", "m.gguf"]):
        line = _one_line_error(["eval", "--smollm2", "--device", "cpu", *extra], capsys, monkeypatch)
        assert "--smollm2 names its own model: give no MODEL, --gguf-file or --random-llama" in line, extra


@pytest.mark.parametrize("command", [["generate", "--random-llama", "tiny"], ["eval", "--random-llama", "tiny"]])
def test_model_commands_cuda_without_gpu(command, capsys, monkeypatch):
    """generate / eval with --device cuda on a machine without CUDA: one line and exit 2
    (not a traceback from the model's first CUDA tensor)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the message on a machine without CUDA")
    line = _one_line_error([*command, "--device", "cuda"], capsys, monkeypatch)
    assert "--device cuda, but no CUDA GPU is available (use --device cpu)" in line


def test_info_cache_row_says_where_the_folder_comes_from(tmp_path, monkeypatch):
    """``info``'s compile-cache row: the folder from $BITDECODE_CACHE_DIR or the default
    (the row says which), and "not created yet" until the folder exists."""
    from bitdecode import jit

    monkeypatch.delenv("BITDECODE_NO_DISK_CACHE", raising=False)
    monkeypatch.setenv("BITDECODE_CACHE_DIR", str(tmp_path / "jit"))
    row = cli_info._cache_row()
    assert "from $BITDECODE_CACHE_DIR" in row and "not created yet" in row
    jit.cache_dir().mkdir(parents=True)
    row = cli_info._cache_row()
    assert "from $BITDECODE_CACHE_DIR" in row and "not created yet" not in row and str(tmp_path / "jit") in row
    monkeypatch.delenv("BITDECODE_CACHE_DIR")
    assert "default, $BITDECODE_CACHE_DIR unset" in cli_info._cache_row()


def test_info_lists_auto_picks_for_every_format_head_dim_and_dtype(capsys, monkeypatch):
    """``info``'s "auto picks" row names auto's backend for 4-bit, 2-bit and NVFP4 caches at
    head dims 128 and 256, in fp16 and bf16."""
    monkeypatch.setenv("COLUMNS", "1000")
    monkeypatch.setenv("BITDECODE_NO_DISK_CACHE", "1")
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for name in ("4-bit", "2-bit", "NVFP4"):
        for d in (128, 256):
            for dt in ("fp16", "bf16"):
                assert re.search(rf"{name} D{d} {dt}: \w+", out), (name, d, dt)


def test_compile_warm_cache_compiles_for_this_gpu_arch(tmp_path, capsys, monkeypatch):
    """--warm-cache compiles every variant for the arch of this machine's GPU
    (``jit.target_arch``), not --arch's default sm_80, into the disk cache (no PTX)."""
    _fake_gpu(monkeypatch)  # an sm_90a GPU
    monkeypatch.delenv("BITDECODE_NO_DISK_CACHE", raising=False)
    monkeypatch.setenv("BITDECODE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("COLUMNS", "200")
    calls = []

    def compile_one(v, arch, out, warm):
        calls.append((arch, out, warm))
        return v.name, 0.1, {}

    monkeypatch.setattr(cli_compile, "_compile_one", compile_one)
    assert main(["compile", "--warm-cache", "--kernels", "combine", "--jobs", "1"]) == 0
    assert calls and set(calls) == {("sm_90a", "", True)}
    out = capsys.readouterr().out
    assert f"{len(calls)} kernel variants for sm_90a" in out and f"wrote {len(calls)} variants to the JIT disk cache" in out


def test_compile_warm_cache_refuses_a_folder_that_takes_no_file(capsys, monkeypatch):
    """--warm-cache whose cache folder exists but takes no new file (/proc, even for root)
    is refused before anything compiles."""
    from bitdecode import jit

    if not Path("/proc/self").is_dir():
        pytest.skip("needs Linux's /proc")
    _fake_gpu(monkeypatch)
    monkeypatch.delenv("BITDECODE_NO_DISK_CACHE", raising=False)
    monkeypatch.setattr(jit, "cache_dir", lambda: Path("/proc"))
    monkeypatch.setattr(cli_compile, "_compile_one", lambda *a: pytest.fail("compiled"))
    line = _one_line_error(["compile", "--warm-cache", "--kernels", "combine", "--jobs", "1"], capsys, monkeypatch)
    assert "--warm-cache fills the JIT disk cache, but it cannot be written" in line


def test_selfcheck_hands_its_options_to_the_check_and_reports_its_verdict(capsys, monkeypatch):
    """``selfcheck`` on a (pretend) GPU, the check stood in: the backend, the device index,
    the format (--bits, or --format-json whole), the head dim and the dtype reach it; a
    match exits 0, a mismatch exits 1 naming it, in the text and the --json verdict."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Pretend GPU")
    calls, verdict = [], [""]

    def run_check(backend, device, fmt, head_dim, dtype):
        calls.append((backend, device, fmt, head_dim, dtype))
        return verdict[0]

    monkeypatch.setattr(cli_selfcheck, "run_check", run_check)
    base = ["selfcheck", "--backend", "sm90", "--device", "1"]
    assert main([*base, "--bits", "2", "--head-dim", "64", "--dtype", "bf16"]) == 0
    assert "sm90 on Pretend GPU" in capsys.readouterr().out
    assert main([*base, "--format-json", '{"bits": 4, "v_bits": 2}', "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"ok": True, "detail": "matches the reference"}
    assert calls == [("sm90", torch.device("cuda", 1), KVFormat(bits=2), 64, torch.bfloat16),
                     ("sm90", torch.device("cuda", 1), KVFormat(bits=4, v_bits=2), 128, torch.float16)]
    verdict[0] = "num_splits=3: max error 0.5 > tolerance 0.01"
    assert main([*base, "--json"]) == 1
    assert json.loads(capsys.readouterr().out) == {"ok": False, "detail": verdict[0]}
    assert main(base) == 1
    assert f"FAILED: {verdict[0]}" in capsys.readouterr().out
