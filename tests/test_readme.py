"""README's Python examples run as written (on the CPU: ``device="cuda"`` becomes "cpu",
which the README names as the torch reference), so the usage a new user copies cannot
drift from the API.  The transformers examples need a model and are covered by
tests/test_hf.py."""

from __future__ import annotations

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parent.parent / "README.md"


def code_blocks(language: str) -> list:
    """The bodies of README's fenced blocks of ``language``."""
    return re.findall(rf"^```{language}\n(.*?)^```", README.read_text(), re.M | re.S)


def block_with(text: str) -> str:
    found = [b for b in code_blocks("python") if text in b]
    assert len(found) == 1, f"README: {len(found)} python blocks contain {text!r}"
    return found[0]


def run_on_cpu(code: str) -> dict:
    scope: dict = {}
    exec(compile(code.replace('device="cuda"', 'device="cpu"'), str(README), "exec"), scope)
    return scope


def test_readme_names_the_install_and_test_commands():
    text = README.read_text()
    assert 'pip install -e ".[test]"\npytest -m "not gpu"' in text


def test_readme_cache_example_runs():
    """The KVCache example: prefill, append, decode, and the appending decode."""
    scope = run_on_cpu(block_with("bd.KVCache.allocate("))
    out, q, cache = scope["out"], scope["q"], scope["cache"]
    assert out.shape == q.shape == (1, 1, 32, 128) and out.dtype == torch.float16
    assert torch.isfinite(out).all()
    assert cache.lengths == [4002]  # prefill 4000, append 1, the appending decode 1


def test_readme_bitnet_example_runs():
    """The BitNet example: BitLinear and the functional quantize / pack / GEMV / GEMM."""
    scope = run_on_cpu(block_with("bd.bitnet.BitLinear.from_float("))
    y, x = scope["y"], scope["x"]
    assert y.shape == (1, 3840) and x.shape == (1, 2560) and torch.isfinite(y.float()).all()
    # the layer and the functional path compute the same W2A8 product
    assert torch.allclose(scope["layer"](x).float(), y.float(), rtol=2e-2, atol=2e-2)


def readme_commands() -> list:
    """The ``bitdecode ...`` command lines of README's bash blocks (continuations joined,
    comments dropped), as argument lists."""
    import shlex

    out = []
    for block in code_blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words[:1] == ["bitdecode"]:
                out.append(words[1:])
    return out


def test_readme_commands_parse():
    """Every ``bitdecode`` command README shows parses with the CLI as it is: each flag
    exists and each value is one its option takes (nothing is run)."""
    from bitdecode import cli

    commands = readme_commands()
    assert len(commands) >= 10 and {c[0] for c in commands} >= {"demo", "info", "generate", "eval"}
    parser = cli.build_parser()  # every command with its options
    for argv in commands:
        try:
            args = parser.parse_args(argv)
        except SystemExit as e:
            raise AssertionError(f"README: `bitdecode {' '.join(argv)}` does not parse") from e
        assert args.command == argv[0], argv
