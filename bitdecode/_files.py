"""Files the library and its commands write: whole or not at all, and refused before the
work that fills them where they cannot be written."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Union


def cannot_write(path: Union[str, Path]) -> str:
    """Why ``path`` cannot take a file (its folder refuses a new file, or a device or pipe
    there refuses writes), or ""."""
    path = os.fspath(path)
    try:
        if os.path.exists(path) and not os.path.isfile(path):  # a device or pipe: written in place
            with open(path, "a", encoding="utf-8"):
                return ""
        with tempfile.NamedTemporaryFile(dir=os.path.dirname(os.path.realpath(path))):
            return ""
    except OSError as exc:
        return exc.strerror or str(exc)


def write_whole(path: Union[str, Path], text: str) -> None:
    """``text`` into ``path`` whole or not at all: a regular file is written beside it and
    renamed over it (a failed write, a full disk, leaves the old file as it was; a reader
    never sees half of it), keeping the old file's mode or giving a new one the umask's;
    a device or pipe is written in place."""
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isfile(path):
        with open(path, "w", encoding="utf-8") as out:
            out.write(text)
        return
    target = os.path.realpath(path)
    if os.path.exists(target):
        mode = os.stat(target).st_mode & 0o7777
    else:  # (mkstemp's file is the owner's alone; a new file gets what open() would give)
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=f".{os.path.basename(target)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise


def rounded(record, digits: int = 4):
    """``record`` with every float at ``digits`` significant digits: the records live in git,
    and the timer's spread is far above the fifth digit."""
    if isinstance(record, float):
        return float(f"{record:.{digits}g}")
    if isinstance(record, dict):
        return {k: rounded(v, digits) for k, v in record.items()}
    if isinstance(record, (list, tuple)):
        return [rounded(v, digits) for v in record]
    return record


def write_record(path: Union[str, Path], record) -> Path:
    """A benchmark's record as JSON at ``path``, floats ``rounded``, whole or not at all."""
    write_whole(path, json.dumps(rounded(record), indent=1) + "\n")
    return Path(path)


def save_plot(fig, path: Union[str, Path], dpi: int) -> Path:
    """A matplotlib figure as a PNG at ``path`` (then closed), with a palette where Pillow
    is installed (``palette_png``)."""
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return palette_png(Path(path))


def palette_png(path: Path, colors: int = 64) -> Path:
    """Rewrite the PNG at ``path`` with a ``colors``-entry palette where Pillow is installed:
    a line plot loses nothing seen and the file is ~4x smaller (the benchmarks' plots live
    in git)."""
    try:
        from PIL import Image
    except ImportError:
        return path
    with Image.open(path) as im:
        small = im.convert("RGB").quantize(colors=colors, method=Image.Quantize.MEDIANCUT)
    small.save(path, optimize=True)
    return path
