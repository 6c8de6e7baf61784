"""ptxas -v on a kernel's PTX, for the tests that check registers, spills and warnings."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest


def report(ptx: str, arch: str, tmp_path) -> str:
    """ptxas -v's report on ``ptx`` (skips without a ptxas that assembles ``arch``)."""
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        pytest.skip("ptxas not installed: register / spill check skipped")
    src = tmp_path / "k.ptx"
    src.write_text(ptx)
    res = subprocess.run([ptxas, f"-arch={arch}", "-v", str(src), "-o", str(tmp_path / "k.cubin")],
                         capture_output=True, text=True)
    if res.returncode != 0 and "Unsupported" in res.stderr + res.stdout:
        pytest.skip(f"this ptxas cannot assemble {arch}")
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stderr + res.stdout


def spill_bytes(report: str) -> int:
    """Spill stores plus loads, in bytes, over every function of a ``report`` (asserts
    ptxas printed its resource lines)."""
    found = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert found, "no ptxas resource usage lines in the report"
    return sum(int(a) + int(b) for a, b in found)


def sass(report_dir) -> str | None:
    """The SASS of the cubin ``report`` left in ``report_dir`` (nvdisasm from the PATH or
    Triton's wheel), or None where no nvdisasm is installed."""
    tool = shutil.which("nvdisasm")
    if tool is None:
        try:
            import triton  # noqa: F401  (ships nvdisasm beside its ptxas)
            from pathlib import Path

            cand = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
            tool = str(cand) if cand.exists() else None
        except ImportError:
            tool = None
    if tool is None:
        return None
    res = subprocess.run([tool, "-c", str(report_dir / "k.cubin")], capture_output=True, text=True)
    return res.stdout if res.returncode == 0 else None
