"""The compiled kernels' disk cache degrades to memory, never to a crash: an unreadable or
unwritable folder, no home directory, the switch spelled as the other switches are (CPU;
the kernels are stand-ins, the folder logic is the cache's own)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bitdecode import jit


@pytest.mark.parametrize("value, on", [(None, True), ("", True), ("0", True), ("false", True), (" No ", True),
                                       ("off", True), ("1", False), ("yes", False), ("true", False)])
def test_disk_switch_reads_zero_as_off(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv(jit.ENV_DISABLE_DISK, raising=False)
    else:
        monkeypatch.setenv(jit.ENV_DISABLE_DISK, value)
    assert jit.disk_cache_on() is on


def test_cache_root_expands_home_and_is_absolute(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv(jit.ENV_CACHE_DIR, "~/kernels")
    assert jit.cache_root() == tmp_path / "kernels"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(jit.ENV_CACHE_DIR, "rel/dir")
    assert jit.cache_root() == tmp_path / "rel" / "dir"  # (not a path that moves with the working directory)
    monkeypatch.delenv(jit.ENV_CACHE_DIR)
    assert jit.cache_root() == tmp_path / ".cache" / "bitdecode"


def test_no_home_names_the_variable(monkeypatch):
    monkeypatch.delenv(jit.ENV_CACHE_DIR, raising=False)
    monkeypatch.setattr(jit.os.path, "expanduser", lambda p: p)  # what Python gives with no home to expand to
    with pytest.raises(RuntimeError, match=r"set \$BITDECODE_CACHE_DIR"):
        jit.cache_root()


class _Kernel:
    """A compiled kernel's stand-in; its export fails as a full disk would."""

    def export_to_c(self, object_file_path, function_name):
        raise OSError(28, "No space left on device")


@pytest.mark.parametrize("failure", ["unreadable", "no_home", "unwritable"])
def test_a_folder_that_fails_costs_only_the_disk(monkeypatch, tmp_path, failure):
    """The kernel is built (once) and served from memory; the folder's failure is counted
    (``compile --warm-cache`` reports it), not raised."""
    monkeypatch.delenv(jit.ENV_DISABLE_DISK, raising=False)
    monkeypatch.setattr(jit, "fingerprint", lambda: "fp")
    monkeypatch.setenv(jit.ENV_CACHE_DIR, str(tmp_path))
    if failure == "unreadable":  # (root reads any folder, so the refusal is staged where Python meets it)
        def refuse(self, *args, **kwargs):
            raise PermissionError(13, "Permission denied", str(self))
        monkeypatch.setattr(Path, "exists", refuse)
        monkeypatch.setattr(Path, "mkdir", refuse)
    elif failure == "no_home":
        monkeypatch.delenv(jit.ENV_CACHE_DIR)
        monkeypatch.setattr(jit.os.path, "expanduser", lambda p: p)
    cache, kernel, builds = jit.KernelCache(), _Kernel(), []
    got = cache.get(("decode", 1), lambda: builds.append(1) or kernel)
    assert got is kernel and cache.get(("decode", 1), lambda: builds.append(1) or kernel) is kernel
    assert builds == [1] and cache.unwritten == 1
    monkeypatch.setenv(jit.ENV_DISABLE_DISK, "1")  # switched off: nothing to write, nothing unwritten
    assert cache.get(("decode", 2), lambda: kernel) is kernel and cache.unwritten == 1


def test_the_disk_key_and_folder_carry_every_field(monkeypatch, tmp_path):
    """Two keys that differ in one field (the dtype, last) get two files; the folder is the
    sources' fingerprint under the cache root (a changed source compiles afresh)."""
    monkeypatch.setattr(jit, "fingerprint", lambda: "fp")
    monkeypatch.setenv(jit.ENV_CACHE_DIR, str(tmp_path))
    assert jit.KernelCache._path(("k", "sm_80", torch.float16)) != jit.KernelCache._path(("k", "sm_80", torch.bfloat16))
    assert jit.cache_dir() == tmp_path / "fp"


def test_arch_names_and_pdl(monkeypatch):
    for cap, name in [((8, 0), "sm_80"), ((8, 6), "sm_86"), ((9, 0), "sm_90a"), ((10, 0), "sm_100a")]:
        monkeypatch.setattr(jit, "capability", lambda i, cap=cap: cap)
        assert jit._target_arch.__wrapped__(0) == name
    assert jit.has_pdl("sm_90a") and jit.has_pdl("sm_100a") and not jit.has_pdl("sm_89")


def test_fingerprint_sees_a_renamed_source(monkeypatch, tmp_path):
    pytest.importorskip("cutlass")
    (tmp_path / "a.py").write_text("x = 1\n")
    monkeypatch.setattr(jit, "_PKG_ROOT", tmp_path)
    jit.fingerprint.cache_clear()
    try:
        one = jit.fingerprint()
        (tmp_path / "a.py").rename(tmp_path / "b.py")
        jit.fingerprint.cache_clear()
        assert jit.fingerprint() != one
    finally:
        jit.fingerprint.cache_clear()
