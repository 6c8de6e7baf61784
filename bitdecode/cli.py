"""The ``bitdecode`` command line: info, demo, generate, eval, layout, bench, compile, selfcheck, tune.

Each subcommand lives in its own module (``bitdecode/cli_<name>.py``) exposing
``add_parser(subparsers, name, help_text)`` and ``run(args) -> int``, and optionally
``check_args(args) -> Optional[str]``: what is wrong with a combination of options (the
command's parser then exits with that error, status 2, before ``run``); they are imported
only when used so ``bitdecode --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Iterable, List, Optional

COMMANDS = {
    "info": "versions, GPU and arch, available kernels, compile cache dir",
    "demo": "build an LLM-like KV cache, quantize at 4 and 2 bits, decode; accuracy, memory, speed",
    "generate": "run a transformers causal LM with the bitdecode KV cache: text, tokens/s, KV memory vs 16-bit",
    "eval": "accuracy of KV formats on a causal LM: perplexity, KL, top-1 and needle vs 16-bit and QuantizedCache",
    "layout": "draw fragment / packed / remap / params / swizzle layouts as thread-value grids",
    "bench": "benchmark sweeps (decode incl. prefill packing, bitnet) written to profiles/<gpu>/",
    "compile": "ahead-of-time compile the kernels for an arch and dump their PTX (no GPU needed)",
    "selfcheck": "run one kernel backend on this GPU against the torch reference (auto's first-use check)",
    "tune": "measure the BitNet GEMV's fastest kernel configuration for your weight shapes on this GPU",
}


# ``--dtype`` of the commands that build a model or a cache (``torch_dtype`` maps them)
DTYPE_NAMES = ("fp16", "bf16")


def torch_dtype(name: str):
    """A ``--dtype`` name (``DTYPE_NAMES``) as the torch dtype (torch imported on use, so that
    ``bitdecode --help`` stays fast)."""
    import torch

    return {"fp16": torch.float16, "bf16": torch.bfloat16}[name]


# the largest count or seed an option takes: torch's int64 (larger ones overflowed far from
# the option, "Overflow when unpacking long long")
INT64_MAX = 2**63 - 1


def _int_from(text: str, low: int, what: str) -> int:
    """``int(text)`` in [``low``, ``INT64_MAX``], else argparse's error saying it must be ``what``."""
    value = int(text)
    if not low <= value <= INT64_MAX:
        raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
    return value


def positive_int(text: str) -> int:
    """argparse type of the subcommands' counts (tokens, batch, steps)."""
    return _int_from(text, 1, f"a positive integer of at most {INT64_MAX}")


def positive_int_list(text: str) -> List[int]:
    """argparse type of a comma-separated list of positive integers (window sizes, stage
    counts)."""
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def nonnegative_int(text: str) -> int:
    """argparse type of counts that may be zero (sink tokens) and of seeds (what
    ``torch.manual_seed`` takes)."""
    return _int_from(text, 0, f"an integer >= 0 and at most {INT64_MAX}")


def csv_list(kind, choices=None, allow_empty: bool = False):
    """argparse type of a comma-separated list of ``kind`` values (``kind`` is ``int`` or
    ``str``), each one of ``choices`` when given; an empty list only if ``allow_empty``."""

    def parse(text: str) -> list:
        items = [t.strip() for t in text.split(",") if t.strip()]
        try:
            values = [kind(t) for t in items]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {text!r}") from None
        if not values and not allow_empty:
            raise argparse.ArgumentTypeError(f"expected a non-empty comma-separated list, got {text!r}")
        if choices is not None:
            bad = [v for v in values if v not in choices]
            if bad:
                raise argparse.ArgumentTypeError(f"invalid choice: {bad[0]!r} (choose from "
                                                 f"{', '.join(str(c) for c in choices)})")
        return values

    parse.__name__ = f"comma-separated {kind.__name__} list"  # (argparse names the type in some errors)
    return parse


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation that failed: CUDA's ``OutOfMemoryError``, or the
    ``RuntimeError`` of the CPU allocator (or of a size past what it can address)."""
    import torch

    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and any(w in str(exc) for w in ("alloc", "overflow")))


def print_error(message: str) -> None:
    """One ``error:`` line on standard error, as every command's refusals are printed: the
    message as plain text (no markup read from it) and never wrapped, apart from the
    command's output (``bitdecode bench ... > log`` still shows why it stopped)."""
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True).print(f"[red]error:[/] {escape(message)}", soft_wrap=True)


def given_path(text: str, kind: str):
    """An option's path, ``~`` expanded; an empty one refused (``Path("")`` is ".": the
    working folder, which nobody asked for)."""
    from pathlib import Path

    if not text.strip():
        raise argparse.ArgumentTypeError(f"an empty path is not a {kind}")
    return Path(text).expanduser()


def output_file(text: str) -> str:
    """argparse type of a file the command writes: its folder must exist, and it must not
    be a folder."""
    path = given_path(text, "file")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder, not a file")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"no such folder: {path.parent} (the folder of {text} must exist)")
    return str(path)


def output_folder(text: str):
    """argparse type of a folder the command writes into (made if missing): refused where
    the path is a file, before any work is done."""
    path = given_path(text, "folder")
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} exists and is not a folder")
    return path


def build_parser(full: Optional[Iterable[str]] = None) -> argparse.ArgumentParser:
    """The parser; only the commands in ``full`` (default: all) get their own options."""
    full = set(COMMANDS if full is None else full)
    parser = argparse.ArgumentParser(
        prog="bitdecode",
        description="Low-bit KV-cache decode attention (BitDecoding) and BitNet W2A8 kernels in CuTe DSL.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        if name in full:
            mod = importlib.import_module(f"bitdecode.cli_{name}")
            mod.add_parser(sub, name, help_text)
        else:
            sub.add_parser(name, help=help_text)
    parser.command_parsers = sub.choices  # {command: its parser}, for ``check_args``'s errors
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv[:1] if argv and argv[0] in COMMANDS else ())
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    mod = importlib.import_module(f"bitdecode.cli_{args.command}")
    check = getattr(mod, "check_args", None)
    problem = check(args) if check is not None else None
    if problem:
        parser.command_parsers[args.command].error(problem)
    return int(mod.run(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
