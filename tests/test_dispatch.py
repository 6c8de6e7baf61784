"""Backend choice by the registry (CPU: the GPU's compute capability is faked)."""

from __future__ import annotations

import json
import sys

import pytest
import torch

import bitdecode as bd
from bitdecode import backend as backends, cli, cli_selfcheck, dispatch, jit, selfcheck

CUDA0 = torch.device("cuda", 0)


@pytest.fixture
def capability(monkeypatch):
    def use(cap):
        monkeypatch.setattr(dispatch, "device_capability", lambda device: cap if device.type == "cuda" else None)
    return use


def test_shipped_backends_best_first():
    assert backends.shipped()[-1] == "sm80"
    assert "sm90" in backends.shipped()


@pytest.mark.parametrize("cap, bits, head_dim, dtype, expect", [
    ((9, 0), 4, 128, torch.float16, "sm90"),  # Hopper: the TMA + wgmma kernel for 4-bit fp16 caches
    ((9, 0), 4, 64, torch.float16, "sm90"),
    ((9, 0), 4, 128, torch.bfloat16, "sm90"),  # ... and bf16 (since V's scale is folded into P)
    ((9, 0), 4, 128, None, "sm80"),  # ... nor an unknown dtype
    ((9, 0), 4, 256, torch.float16, "sm80"),  # ... nor head dim 256 (never timed)
    ((9, 0), 2, 128, torch.float16, "sm90"),  # 2-bit K per channel g128 fp16 (128-token steps)
    ((9, 0), 2, 128, torch.bfloat16, "sm90"),  # ... and bf16 (since K's scale is in Q there too)
    ((9, 0), (4, 2), 128, torch.float16, "sm90"),  # K 4-bit / V 2-bit, K per channel g128 fp16
    ((9, 0), (4, 2), 128, torch.bfloat16, "sm90"),  # ... and bf16 (splits_backends_k4v2_bf16.json)
    ((8, 0), 4, 128, torch.float16, "sm80"),
    ((8, 9), 2, 64, torch.bfloat16, "sm80"),
    ((10, 0), 4, 128, torch.float16, "sm80"),  # Blackwell: the tcgen05 kernel is for FP4 caches only
])
def test_auto_by_capability_format_and_dtype(capability, cap, bits, head_dim, dtype, expect):
    capability(cap)
    bits, v_bits = bits if isinstance(bits, tuple) else (bits, bits)
    fmt = bd.KVFormat(bits=bits, v_bits=v_bits)
    assert dispatch.resolve("auto", CUDA0, fmt=fmt, head_dim=head_dim, dtype=dtype) == expect


@pytest.mark.parametrize("fmt", [bd.KVFormat(bits=2, k_mode="token", group_size=64), bd.KVFormat(bits=2, group_size=64),
                                 bd.KVFormat(bits=4, v_bits=2, group_size=64), bd.KVFormat(bits=2, v_bits=4)],
                         ids=["2t64", "2c64", "k4v2g64", "k2v4"])
def test_auto_keeps_sm80_for_the_2bit_formats_not_timed_faster_on_sm90(capability, fmt):
    capability((9, 0))
    assert dispatch.resolve("auto", CUDA0, fmt=fmt, head_dim=128, dtype=torch.float16) == "sm80"


def test_auto_without_format_takes_the_first_usable(capability):
    capability((9, 0))
    assert dispatch.resolve("auto", CUDA0) == "sm90"
    assert dispatch.available(CUDA0) == ("sm90", "sm80", "reference")


def test_explicit_backend_checked_against_the_device(capability, monkeypatch):
    capability((8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "A100")
    with pytest.raises(ValueError, match="backend 'sm90' does not run on"):
        dispatch.resolve("sm90", CUDA0)
    assert dispatch.resolve("sm80", CUDA0) == "sm80"


def test_too_old_gpu(capability, monkeypatch):
    capability((7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    with pytest.raises(ValueError, match="no compiled decode kernel supports Tesla T4"):
        dispatch.resolve("auto", CUDA0)


def test_compile_arch_maps_to_its_backend():
    assert backends.for_arch("sm_90a") == "sm90"
    assert backends.for_arch("sm_80") == "sm80"
    assert backends.for_arch("sm_86") == "sm80"
    assert backends.for_arch("sm_100a") == "sm100"


NVFP4 = bd.KVFormat(fp4="nvfp4")


def test_auto_wants_the_sm100_fp4_kernel_for_fp4_caches_it_runs(capability):
    """Blackwell: the sm100 backend's ``auto_picks`` wants FP4 caches at head dims 128 / 256
    (its tcgen05 kernel, whose four FP4 terms of Q and P meet the tolerance rule), not head
    dim 64, integer caches or multi-token queries' kernels (sm80's, taken through sm80)."""
    capability((10, 0))
    sm100 = backends.get("sm100")
    for fmt, d, want in ((NVFP4, 128, True), (bd.KVFormat(fp4="mxfp4"), 256, True), (NVFP4, 64, False),
                         (bd.KVFormat(bits=4), 128, False)):
        assert sm100.auto_picks(fmt, d, torch.float16) is want, (fmt, d)
        assert sm100.runs_tcgen05(fmt, d) is want
    assert dispatch.available(CUDA0) == ("sm100", "sm80", "reference")
    assert dispatch.resolve("sm100", CUDA0) == "sm100"


@pytest.fixture
def child(monkeypatch, tmp_path, capability):
    """A Blackwell device (whose sm100 backend ``auto`` takes for FP4 caches at head dims
    128 / 256) whose first-use check's child process is faked: ``child.verdict`` is what it
    reports, ``child.calls`` the commands it was given; verdicts on disk go to ``tmp_path``."""
    capability((10, 0))
    monkeypatch.setenv("BITDECODE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(selfcheck.ENV_SWITCH, raising=False)
    monkeypatch.delenv("BITDECODE_NO_DISK_CACHE", raising=False)
    monkeypatch.setattr(selfcheck, "_verdicts", {})
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "B200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))

    class Child:
        verdict = (True, "matches the reference")
        calls = []

        def __call__(self, command, timeout):
            self.calls.append(list(command))
            return self.verdict

    fake = Child()
    monkeypatch.setattr(selfcheck, "run_child", fake)
    return fake


def test_auto_takes_an_unvalidated_backend_after_its_check(child):
    """``auto`` runs an unvalidated backend's first-use check once (a child process) and
    takes it when it passed; the verdict is kept in the process and on disk."""
    assert not backends.get("sm100").hardware_validated
    assert dispatch.resolve("auto", CUDA0, fmt=NVFP4, head_dim=128, dtype=torch.float16) == "sm100"
    assert len(child.calls) == 1
    command = child.calls[0]
    assert command[command.index("--backend") + 1] == "sm100" and command[command.index("--head-dim") + 1] == "128"
    assert command[command.index("--dtype") + 1] == "float16"
    assert dispatch.resolve("auto", CUDA0, fmt=NVFP4, head_dim=128, dtype=torch.float16) == "sm100"
    selfcheck._verdicts.clear()  # a new process: the verdict comes from disk
    assert dispatch.resolve("auto", CUDA0, fmt=NVFP4, head_dim=128, dtype=torch.float16) == "sm100"
    assert len(child.calls) == 1
    # another configuration is checked on its own
    assert dispatch.resolve("auto", CUDA0, fmt=NVFP4, head_dim=256, dtype=torch.bfloat16) == "sm100"
    assert len(child.calls) == 2


def test_auto_keeps_sm80_when_the_check_fails(child):
    child.verdict = (False, "num_splits=3: max error 0.5 > tolerance 0.01")
    with pytest.warns(RuntimeWarning, match=r"'sm100' failed its first-use check on B200.*max error 0\.5"):
        assert dispatch.resolve("auto", CUDA0, fmt=NVFP4, head_dim=128, dtype=torch.float16) == "sm80"
    assert dispatch.resolve("auto", CUDA0, fmt=NVFP4, head_dim=128, dtype=torch.float16) == "sm80"
    assert len(child.calls) == 1
    assert dispatch.resolve("sm100", CUDA0) == "sm100"  # by name it still runs


@pytest.mark.parametrize("why", [f"{selfcheck.TIMED_OUT} 900 s (...)",
                                 f"{selfcheck.OUT_OF_MEMORY}: CUDA out of memory. Tried to allocate 2.00 GiB"])
def test_a_check_that_may_pass_later_is_not_kept_on_disk(child, why):
    """A check that ran out of time (a hang, or only a slow first compile) or found the
    GPU's memory taken (by the process that started it, say) is kept for the process, not
    on disk: the next process, with a longer timeout or free memory, checks again."""
    child.verdict = (False, why)
    with pytest.warns(RuntimeWarning, match="did not finish|out of GPU memory"):
        assert dispatch.resolve("auto", CUDA0, fmt=NVFP4, head_dim=128, dtype=torch.float16) == "sm80"
    assert dispatch.resolve("auto", CUDA0, fmt=NVFP4, head_dim=128, dtype=torch.float16) == "sm80"
    assert len(child.calls) == 1
    selfcheck._verdicts.clear()  # a new process
    child.verdict = (True, "matches the reference")
    assert dispatch.resolve("auto", CUDA0, fmt=NVFP4, head_dim=128, dtype=torch.float16) == "sm100"
    assert len(child.calls) == 2


@pytest.mark.parametrize("fmt, head_dim, dtype", [
    (bd.KVFormat(bits=4), 128, torch.float16),  # integer caches: sm80's kernels on Blackwell
    (NVFP4, 64, torch.float16),  # head dim 64: the tcgen05 kernel's M is 128
    (NVFP4, 128, None),  # a dtype not known yet
    (None, 0, None),  # no cache at all
])
def test_auto_checks_only_where_it_would_take_the_backend(child, fmt, head_dim, dtype):
    assert dispatch.resolve("auto", CUDA0, fmt=fmt, head_dim=head_dim, dtype=dtype) == "sm80"
    assert child.calls == []
    assert dispatch.available(CUDA0) == ("sm100", "sm80", "reference")


def test_info_names_a_pending_check_without_running_it(child):
    """``bitdecode info`` shows the validated pick with the check still to come (it runs
    none: a check compiles kernels), then the checked backend once a verdict is kept."""
    from bitdecode import cli_info

    assert cli_info._auto_pick(CUDA0, NVFP4, 128, torch.float16) == "sm80 (sm100 after its first-use check)"
    assert cli_info._auto_pick(CUDA0, bd.KVFormat(bits=2), 128, torch.float16) == "sm80"
    assert child.calls == []
    dispatch.resolve("auto", CUDA0, fmt=NVFP4, head_dim=128, dtype=torch.float16)
    assert cli_info._auto_pick(CUDA0, NVFP4, 128, torch.float16) == "sm100"


def test_verdicts_stay_off_the_disk_with_the_kernels(child, monkeypatch, tmp_path):
    """``BITDECODE_NO_DISK_CACHE=1`` keeps the verdicts in the process, as the kernels."""
    monkeypatch.setenv("BITDECODE_NO_DISK_CACHE", "1")
    assert dispatch.resolve("auto", CUDA0, fmt=NVFP4, head_dim=128, dtype=torch.float16) == "sm100"
    assert not list(tmp_path.rglob("*.json"))
    selfcheck._verdicts.clear()  # a new process checks again
    assert dispatch.resolve("auto", CUDA0, fmt=NVFP4, head_dim=128, dtype=torch.float16) == "sm100"
    assert len(child.calls) == 2


@pytest.mark.parametrize("value", ["15m", "0", "-3", "inf", "nan"])
def test_the_check_timeout_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv(selfcheck.ENV_TIMEOUT, value)
    with pytest.raises(ValueError, match=rf"^BITDECODE_SELFCHECK_TIMEOUT must be a positive number of seconds, "
                                         rf"got '{value}'"):
        selfcheck.timeout_s()
    monkeypatch.setenv(selfcheck.ENV_TIMEOUT, " 60 ")
    assert selfcheck.timeout_s() == 60.0


def test_the_check_can_be_switched_off(child, monkeypatch):
    monkeypatch.setenv(selfcheck.ENV_SWITCH, "0")
    assert dispatch.resolve("auto", CUDA0, fmt=NVFP4, head_dim=128, dtype=torch.float16) == "sm80"
    assert child.calls == []


def test_the_child_process_verdicts():
    """A real child: its JSON line, a crash, a hang (the timeout)."""
    py = sys.executable
    ok = selfcheck.run_child([py, "-c", "print('log'); print('{\"ok\": true, \"detail\": \"fine\"}')"], 60)
    assert ok == (True, "fine")
    crash = selfcheck.run_child([py, "-c", "import sys; sys.stderr.write('illegal memory access\\n'); sys.exit(3)"], 60)
    assert not crash[0] and "exited with code 3" in crash[1] and "illegal memory access" in crash[1]
    hang = selfcheck.run_child([py, "-c", "import time; time.sleep(30)"], 0.5)
    assert not hang[0] and "did not finish in 0 s" in hang[1] and selfcheck.ENV_TIMEOUT in hang[1]


def test_the_child_command_round_trips_the_format():
    fmt = bd.KVFormat(bits=4, v_bits=2, sink_tokens=16, hadamard=True)
    command = selfcheck.child_command("sm100", 1, fmt, 128, torch.bfloat16)
    assert command[1:4] == ["-m", "bitdecode.cli", "selfcheck"]
    args = cli.build_parser().parse_args(command[3:])  # the child's parser takes it
    assert args.backend == "sm100" and args.head_dim == 128 and args.dtype == "bfloat16" and args.json
    text = command[command.index("--format-json") + 1]
    assert bd.KVFormat(**json.loads(text)) == fmt
    assert command[command.index("--device") + 1] == "1"


def test_the_check_itself_passes_the_reference_and_catches_a_wrong_decode(monkeypatch):
    """``run_check``'s comparisons on the CPU: the reference against itself passes; a decode
    off by a little more than the tolerance rule allows is caught, and so is an LSE."""
    fmt = bd.KVFormat(bits=4, group_size=64)
    assert cli_selfcheck.run_check("reference", torch.device("cpu"), fmt, 64, torch.float16) == ""
    cache = bd.KVCache.allocate(1, 2, 64, 300, fmt, device="cpu", backend="reference")
    gen = torch.Generator().manual_seed(1)
    cache.prefill(torch.randn(1, 290, 2, 64, generator=gen).half(), torch.randn(1, 290, 2, 64, generator=gen).half())
    q = torch.randn(1, 1, 8, 64, generator=gen).half()
    real = bd.decode

    def skewed(q, cache, num_splits=0, backend="auto", return_lse=False, shift=(0.05, 0.0)):
        out, lse = real(q, cache, backend="reference", return_lse=True)
        return out + shift[0], lse + shift[1]

    monkeypatch.setattr(bd, "decode", lambda *a, **k: skewed(*a, **k) if k.get("backend") == "fake"
                        else real(*a, **k))
    assert "max error" in cli_selfcheck.decode_mismatch(q, cache, "fake", 3)
    monkeypatch.setattr(bd, "decode", lambda *a, **k: skewed(*a, **k, shift=(0.0, 0.01)) if k.get("backend") == "fake"
                        else real(*a, **k))
    assert "LSE differs" in cli_selfcheck.decode_mismatch(q, cache, "fake", 1)
    # multi-token queries, the first two past a 1-token sequence: they see no token
    short = bd.KVCache.allocate(2, 2, 64, 300, fmt, device="cpu", backend="reference")
    short.prefill(torch.randn(2, 290, 2, 64, generator=gen).half(), torch.randn(2, 290, 2, 64, generator=gen).half(),
                  [290, 1])
    q3 = torch.randn(2, 3, 8, 64, generator=gen).half()
    assert cli_selfcheck.decode_mismatch(q3, short, "reference") == ""

    def finite_lse(q, cache, num_splits=0, backend="auto", return_lse=False):  # no -inf for an empty query
        out, lse = real(q, cache, backend="reference", return_lse=True)
        return out, torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)

    monkeypatch.setattr(bd, "decode", lambda *a, **k: finite_lse(*a, **k) if k.get("backend") == "fake"
                        else real(*a, **k))
    assert "sees no token" in cli_selfcheck.decode_mismatch(q3, short, "fake")


def test_the_sm100_kernel_is_checked_against_its_emulation(monkeypatch):
    """The FP4 kernel takes Q and P in FP4, so ``bitdecode selfcheck`` holds it to
    ``emulate_sm100`` (its spec): the emulation itself passes, an output off by a few
    percent fails (here ``bd.decode`` stands in for the GPU kernel)."""
    from bitdecode.emulate_sm100 import emulate_cache

    gen = torch.Generator().manual_seed(2)
    cache = bd.KVCache.allocate(2, 1, 128, 600, NVFP4, device="cpu", backend="reference")
    cache.prefill(torch.randn(2, 560, 1, 128, generator=gen).half(), torch.randn(2, 560, 1, 128, generator=gen).half(),
                  [560, 130])
    q = torch.randn(2, 1, 4, 128, generator=gen).half()
    assert cli_selfcheck.follows_emulation("sm100", cache)
    assert not cli_selfcheck.follows_emulation("sm80", cache) and not cli_selfcheck.follows_emulation("reference", cache)

    def kernel(scale):
        def decode(q, cache, num_splits=0, backend="auto"):
            return emulate_cache(q, cache, num_splits)[0] * scale
        return decode

    monkeypatch.setattr(bd, "decode", kernel(1.0))
    assert cli_selfcheck.spec_mismatch(q, cache, "sm100", 3) == ""
    monkeypatch.setattr(bd, "decode", kernel(1.05))
    assert "against the sm100 emulation" in cli_selfcheck.spec_mismatch(q, cache, "sm100", 0)


def test_the_check_needs_a_gpu_when_run_by_hand():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert cli.main(["selfcheck", "--backend", "sm100", "--fp4", "nvfp4"]) == 2  # (1 is the check's FAILED)


def test_limits_come_from_the_backend():
    for name in backends.shipped():
        lim = backends.get(name).limits
        assert lim.max_gqa == 16 and lim.max_splits == 256


def test_capability_at_least_counts_its_own_major(monkeypatch):
    monkeypatch.setattr(dispatch, "device_capability", lambda device: (8, 0))
    assert dispatch.capability_at_least(torch.device("cuda", 0), 8)
    assert not dispatch.capability_at_least(torch.device("cuda", 0), 9)


# the first-use check's verdict: its key, its file and its child (``child`` fakes the child)


def test_verdict_key_has_the_head_dim(child):
    selfcheck.verdict("sm100", CUDA0, NVFP4, 128, torch.float16)
    selfcheck.verdict("sm100", CUDA0, NVFP4, 256, torch.float16)
    assert len(child.calls) == 2


def test_verdict_key_has_the_capability(child, monkeypatch):
    selfcheck.verdict("sm100", CUDA0, NVFP4, 128, torch.float16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 3))
    selfcheck.verdict("sm100", CUDA0, NVFP4, 128, torch.float16)
    assert len(child.calls) == 2


def test_a_saved_verdict_of_another_key_is_ignored(child):
    selfcheck.verdict("sm100", CUDA0, NVFP4, 128, torch.float16)
    (path,) = list(jit.cache_dir().rglob("*.json"))
    saved = json.loads(path.read_text())
    saved["key"], saved["ok"] = "other", False
    path.write_text(json.dumps(saved))
    selfcheck._verdicts.clear()
    assert selfcheck.verdict("sm100", CUDA0, NVFP4, 128, torch.float16) is True
    assert len(child.calls) == 2


def test_disk_cache_off_reads_no_saved_verdict(child, monkeypatch):
    selfcheck.verdict("sm100", CUDA0, NVFP4, 128, torch.float16)
    monkeypatch.setenv("BITDECODE_NO_DISK_CACHE", "1")
    selfcheck._verdicts.clear()
    selfcheck.verdict("sm100", CUDA0, NVFP4, 128, torch.float16)
    assert len(child.calls) == 2


def test_the_check_runs_at_the_callers_dtype(child):
    selfcheck.verdict("sm100", CUDA0, NVFP4, 128, torch.bfloat16)
    assert child.calls[0][child.calls[0].index("--dtype") + 1] == "bfloat16"


def test_the_child_check_runs_with_the_check_switched_off(monkeypatch):
    monkeypatch.setenv(selfcheck.ENV_SWITCH, "1")
    code = f"import os, json; print(json.dumps({{'ok': True, 'detail': os.environ.get({selfcheck.ENV_SWITCH!r})}}))"
    assert selfcheck.run_child([sys.executable, "-c", code], 60) == (True, "0")
