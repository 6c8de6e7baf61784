"""``bitdecode tune``: measure the BitNet GEMV's kernel configuration for your shapes and GPU.

Times every GEMV configuration this GPU's kernels run at each weight shape N x K (one token
against N x K ternary weights, read from HBM, in CUDA graphs), checks each one's int32 sums
against the reference first, prints the rule's pick beside the fastest and writes the
picks to ``--out`` (entries of other GPUs or shapes already in the file are kept).  Use the
file with ``bitdecode.bitnet_tune.load(path)`` or ``BITDECODE_GEMV_TUNING=path``;
``bitnet.gemv`` (and ``BitLinear`` at one token) then launch the measured pick.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

from ._files import cannot_write
from .cli import nonnegative_int, output_file, positive_int, print_error


def _shapes(text: str):
    """argparse type of ``--shapes``: ``bitnet_tune.parse_shapes``'s (N, K) pairs."""
    from .bitnet_tune import parse_shapes

    try:
        return parse_shapes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_parser(subparsers, name: str, help_text: str) -> argparse.ArgumentParser:
    p = subparsers.add_parser(name, help=help_text, description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", type=_shapes, default=None, metavar="NxK,...",
                   help="weight shapes, N rows x K columns (N a multiple of 16, K of 128), e.g. "
                        "4096x4096,11008x4096 (default: BitNet b1.58 2B's, bitnet.MODEL_SHAPES)")
    p.add_argument("--out", type=output_file, required=True, metavar="FILE",
                   help="JSON file the picks are written to (merged with the entries already there)")
    p.add_argument("--device", type=nonnegative_int, default=0, help="CUDA device index (default 0)")
    p.add_argument("--replays", type=positive_int, default=20,
                   help="graph replays a configuration (median; default 20)")
    return p


def run(args) -> int:
    import torch
    from rich.console import Console
    from rich.table import Table

    from . import bitnet, bitnet_tune

    console = Console()
    if not torch.cuda.is_available():
        print_error("bitdecode tune times kernels: it needs a CUDA GPU")
        return 2
    if not 0 <= args.device < torch.cuda.device_count():
        print_error(f"--device {args.device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        return 2
    try:  # $BITDECODE_GEMV_TUNING's file, which the timing's lookups read: refused before any timing
        bitnet_tune.entries()
    except ValueError as e:
        print_error(str(e))
        return 2
    if _kept(args.out) is None:  # (the file's entries, checked before any timing too)
        return 2
    why = cannot_write(args.out)
    if why:
        print_error(f"--out {args.out}: cannot write it ({why})")
        return 2
    shapes = args.shapes or bitnet.MODEL_SHAPES
    device = torch.device("cuda", args.device)
    try:
        with console.status("tuning") as status:
            rows = bitnet.tune_gemv(shapes, device, replays=args.replays,
                                    progress=lambda text: status.update(f"tuning {text}"))
    except ValueError as e:  # (a GPU the kernels do not run on)
        print_error(f"--device {args.device}: {e}")
        return 2
    table = Table(title=f"GEMV on {rows[0]['gpu']} ({rows[0]['sms']} SMs), us a call")
    for column in ("N x K", "rule's pick", "us", "measured pick", "us", "faster"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(f"{row['n']} x {row['k']}", bitnet_tune.describe(row["default"]), f"{row['default_us']:.2f}",
                      bitnet_tune.describe(row["config"]), f"{row['us']:.2f}",
                      f"{row['default_us'] / row['us'] - 1:+.0%}")
    console.print(table)
    # the file's entries and this run's picks only: entries that $BITDECODE_GEMV_TUNING's file
    # put in this process stay in that file
    picks = bitnet_tune.parse_entries([{key: row[key] for key in ("gpu", "sms", "n", "k", "config")} for row in rows])
    kept = _kept(args.out)  # read again: what another run wrote there meanwhile is kept too
    if kept is None:  # (the picks are in the table above)
        return 2
    try:
        bitnet_tune.save(args.out, {**kept, **picks})
    except OSError as e:
        print_error(f"--out {args.out}: the picks (the table above) were not written: {e.strerror or e}")
        return 2
    console.print(f"picks written to {args.out}; use them with BITDECODE_GEMV_TUNING={args.out}")
    return 0


def _kept(out) -> Optional[dict]:
    """The entries ``out`` holds ({} where there is no file yet), or None after printing why
    they cannot be read."""
    from . import bitnet_tune

    if not Path(out).exists():
        return {}
    try:
        return bitnet_tune.read(out)
    except ValueError as e:
        print_error(f"--out {out}: {e}")
        return None
