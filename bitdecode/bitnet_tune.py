"""Measured GEMV configurations for the shapes and GPU at hand.

``bitnet.gemv`` picks its kernel configuration by a rule (``kernels_sm90.bitnet_gemv.
config_for`` on Hopper) fitted on an H200 at the BitNet b1.58 shapes.  Elsewhere the rule can
miss the fastest one: on an H100 at 4096 x 4096 its register kernel took 2.62 us where the
staged stripe kernel took 2.14, at 5120 x 5120 3.83 against 3.26
(``profiles/h100/gemv_sweep_s53_general.json``).  ``bitnet.tune_gemv`` measures instead: it times
every configuration this GPU's kernels run at each given weight shape, checks each one's
sums, and from then on ``bitnet.gemv`` launches the fastest::

    import bitdecode as bd
    rows = bd.bitnet.tune_gemv([(4096, 4096), (11008, 4096)])  # times, checks, applies
    bd.bitnet_tune.save("gemv_tuning.json")  # every entry of this process
    bd.bitnet_tune.load("gemv_tuning.json")  # in a later process; or at start-up:
    # BITDECODE_GEMV_TUNING=gemv_tuning.json python serve.py

``bitdecode tune --shapes 4096x4096,11008x4096 --out gemv_tuning.json`` does the same from
the command line.  This module holds the table ``bitnet.gemv_config_for`` consults, its file
form and the timing method.  Entries are keyed by the GPU's name and SM count (a MIG slice
is another GPU), N and K; a file may hold several GPUs' entries, each used only on its own
kind.  Tune before capturing CUDA graphs: a captured GEMV keeps the kernel it was captured
with.

Method (the one ``profiles/bench_bitnet.py`` times with): the weights rotate over enough
copies (``>= 4 x`` the L2 size in total) that every call reads them from HBM; a run of calls
(one per copy, at least ``MIN_CALLS``) is captured in a CUDA graph and replayed between CUDA
events, after warm-up replays; the time per call is the median over the replays.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch

from ._memory import release_memory

FORMAT = "bitdecode-gemv-tuning/1"
ENV_GEMV_TUNING = "BITDECODE_GEMV_TUNING"
MIN_CALLS = 32

# (GPU name, SMs, N, K) -> the GEMV configuration measured fastest there (raw and PDL as
# the rule's: ``bitnet.gemv_config_for`` applies both after the lookup)
_TUNED: Dict[Tuple[str, int, int, int], object] = {}
_ENV_LOADED = False
# bumped on every change of the table: part of the key of ``bitnet``'s launchers built with
# the looked-up pick, so none outlives a change
generation = 0


# --------------------------------------------------------------------------------------
# Timing (CUDA graphs of calls that read their weights from HBM)
# --------------------------------------------------------------------------------------


def copies_for(nbytes: int, l2_bytes: int) -> int:
    """Copies of an ``nbytes`` operand that together exceed ``4 x l2_bytes`` (at least 2), so
    that a rotated copy is evicted from L2 long before it is read again."""
    return max(2, math.ceil(4 * l2_bytes / nbytes))


def captured(calls: List[Callable[[], object]]) -> "torch.cuda.CUDAGraph":
    """``calls`` captured back to back in one CUDA graph (compiled and warmed up first)."""
    for fn in calls[: min(len(calls), 2)]:  # compile / autotune outside the capture
        fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # allocator warm-up on a side stream, as torch documents
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    # torch's capture empties the allocator's cache as it begins: memory freed before (a
    # benchmark's 16-bit K / V after its prefill) would go back to the driver there, and the
    # replays timed next run through the slow spell that follows (``release_memory``:
    # 4c128 B=16 N=64K 451-457 against 383-388 us for the first ~20 replays after 4 GB,
    # H100, sixty-ninth session).  Given back and waited out here, the capture frees nothing
    release_memory()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    return graph


def graph_time_us(calls: List[Callable[[], object]], replays: int, warmup: int = 3) -> float:
    """Median GPU time per call of ``calls`` captured back to back in one CUDA graph."""
    return replay_time_us(captured(calls), len(calls), replays, warmup)


def replay_time_us(graph: "torch.cuda.CUDAGraph", calls: int, replays: int, warmup: int = 3) -> float:
    """Median GPU time per call of a captured ``graph`` of ``calls`` calls."""
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


# --------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------


def gpu_key(device: torch.device) -> Tuple[str, int]:
    """(name, SM count) of a CUDA device: what a tuning entry is valid for."""
    from .backend import num_sms

    device = torch.device(device)
    return torch.cuda.get_device_name(device), num_sms(device)


def lookup(device: torch.device, n: int, k: int):
    """The tuned GEMV configuration for N x K weights on ``device``, or None (then the rule
    decides).  Loads ``$BITDECODE_GEMV_TUNING`` on first use."""
    table = _table()
    return table.get((*gpu_key(device), n, k)) if table else None


def entries(gpu: Optional[Tuple[str, int]] = None) -> List[dict]:
    """Every entry of this process as JSON-ready dicts (what ``save`` writes), or only those
    of GPUs of ``gpu`` (``gpu_key``: what the benchmarks record beside their times)."""
    return _entries(_table(), gpu)


def _entries(table: dict, gpu: Optional[Tuple[str, int]] = None) -> List[dict]:
    return [{"gpu": name, "sms": sms, "n": n, "k": k, "config": config_fields(cfg)}
            for (name, sms, n, k), cfg in sorted(table.items()) if gpu is None or (name, sms) == tuple(gpu)]


def save(path: Union[str, Path], table: Optional[dict] = None) -> Path:
    """Write every entry of this process to ``path`` (JSON; ``load`` reads it back), or those
    of ``table`` (``read``'s form: ``bitdecode tune --out`` writes the file's entries and its
    own picks, not those another file put in this process)."""
    from ._files import write_whole

    path = Path(path).expanduser()
    rows = entries() if table is None else _entries(table)
    write_whole(path, json.dumps({"format": FORMAT, "entries": rows}, indent=1) + "\n")  # (a reader never sees half)
    return path


def read(source: Union[str, Path, dict]) -> dict:
    """The entries of a file written by ``save`` (or of its parsed dict), every one checked,
    as ``{(gpu, sms, n, k): config}``; this process's table is left as it is."""
    where = "tuning"
    if not isinstance(source, dict):
        where = str(source)
        try:
            source = json.loads(Path(source).expanduser().read_text())
        except OSError as e:
            raise ValueError(f"cannot read the GEMV tuning file {where}: {e}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"the GEMV tuning file {where} is not JSON: {e}") from None
    if not isinstance(source, dict) or source.get("format") != FORMAT:
        raise ValueError(f"{where}: not a GEMV tuning (expected a JSON object with \"format\": \"{FORMAT}\")")
    rows = source.get("entries")
    if not isinstance(rows, list):
        raise ValueError(f"{where}: \"entries\" must be a list")
    return parse_entries(rows, where)


def parse_entries(rows: list, where: str = "tuning") -> dict:
    """Entries as ``save`` writes them (``gpu``, ``sms``, ``n``, ``k``, ``config``), every one
    checked, as ``{(gpu, sms, n, k): config}``."""
    return dict(_parse_entry(row, f"{where}: entries[{i}]") for i, row in enumerate(rows))


def load(source: Union[str, Path, dict]) -> int:
    """Add the entries of a file written by ``save`` (or of its parsed dict) to this
    process's table, replacing entries of the same GPU and shape; returns their number.
    Every entry is checked before any is applied: a bad file changes nothing."""
    table = read(source)
    _table()  # (the environment's file first, so that this one's entries win)
    for (gpu, sms, n, k), cfg in table.items():
        remember((gpu, sms), n, k, cfg)
    return len(table)


def clear() -> None:
    """Forget every tuned entry, those of ``$BITDECODE_GEMV_TUNING``'s file too: the rule
    decides again (kernels already captured in CUDA graphs keep theirs)."""
    global generation, _ENV_LOADED
    _ENV_LOADED = True
    _TUNED.clear()
    generation += 1


def remember(gpu: Tuple[str, int], n: int, k: int, cfg) -> None:
    """Make ``cfg`` the GEMV configuration for N x K weights on GPUs of ``gpu`` (``gpu_key``)."""
    global generation
    _table()[(*gpu, n, k)] = dataclasses.replace(cfg, raw=False)
    generation += 1


def forget(gpu: Tuple[str, int], n: int, k: int) -> None:
    """Drop the entry of N x K weights on GPUs of ``gpu``, if any (the rule decides)."""
    global generation
    if _table().pop((*gpu, n, k), None) is not None:
        generation += 1


def _table() -> dict:
    """The table, with ``$BITDECODE_GEMV_TUNING``'s file read into it on first use (before
    any entry is added or dropped, so that the file cannot undo a later change)."""
    global _ENV_LOADED
    if not _ENV_LOADED:
        _ENV_LOADED = True
        _load_env()
    return _TUNED


def _load_env() -> None:
    global _ENV_LOADED
    path = os.environ.get(ENV_GEMV_TUNING, "").strip()
    if path:
        try:
            load(path)
        except ValueError as e:
            _ENV_LOADED = False  # (refused again on the next call, not silently ignored)
            raise ValueError(f"${ENV_GEMV_TUNING}: {e}") from None


def config_fields(cfg) -> dict:
    """A configuration's fields as saved: without ``raw`` (the call decides)."""
    out = dataclasses.asdict(cfg)
    out.pop("raw")
    return out


def _config_template():
    """A GEMV configuration of a shipped backend (all share one configuration class):
    ``dataclasses.replace`` on it builds any other from its fields (the API reaches kernel
    classes only through a backend)."""
    from .backend import get, shipped

    return get(shipped()[0]).bitnet.gemv_configs()[0]


def _parse_entry(row, where: str):
    from .layouts import bitnet as layout

    if not isinstance(row, dict):
        raise ValueError(f"{where} must be an object, got {type(row).__name__}")
    missing = [name for name in ("gpu", "sms", "n", "k", "config") if name not in row]
    if missing:
        raise ValueError(f"{where} lacks {', '.join(missing)}")
    gpu, sms, n, k, fields = row["gpu"], row["sms"], row["n"], row["k"], row["config"]
    if not isinstance(gpu, str) or not gpu:
        raise ValueError(f"{where}: gpu must be the GPU's name, got {gpu!r}")
    for name, value in (("sms", sms), ("n", n), ("k", k)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{where}: {name} must be a positive integer, got {value!r}")
    try:
        layout.check_shape(n, k, k_multiple=layout.K_MULTIPLE, name="the weights'")
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    template = _config_template()
    known = {f.name for f in dataclasses.fields(template)} - {"raw"}
    if not isinstance(fields, dict) or set(fields) - known:
        raise ValueError(f"{where}: config must be an object of GemvConfig fields {sorted(known)}, got {fields!r}")
    if not all(type(v) is type(getattr(template, name)) for name, v in fields.items()):
        raise ValueError(f"{where}: config {fields!r}: each field must have its GemvConfig type "
                         f"({', '.join(f'{f}: {type(getattr(template, f)).__name__}' for f in sorted(known))})")
    try:
        cfg = dataclasses.replace(template, **fields)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: config {fields!r}: {e}") from None
    return (gpu, sms, n, k), cfg


# --------------------------------------------------------------------------------------
# Shapes and names
# --------------------------------------------------------------------------------------


def parse_shapes(shapes) -> List[Tuple[int, int]]:
    """``shapes``: (N, K) pairs, or a string ``"NxK,NxK"``; each N a positive multiple of 16,
    each K of 128 (``ValueError`` naming ``shapes`` otherwise)."""
    from .layouts import bitnet as layout

    if isinstance(shapes, str):
        text = shapes
        try:
            shapes = [tuple(int(v) for v in item.lower().split("x")) for item in text.split(",") if item.strip()]
        except ValueError:
            shapes = None
        if shapes is None or any(len(shape) != 2 for shape in shapes):
            raise ValueError(f"shapes must be NxK pairs separated by commas, e.g. 4096x4096,11008x4096; got {text!r}")
    if not isinstance(shapes, (list, tuple)):
        raise ValueError(f"shapes must be (N, K) pairs or a string \"NxK,NxK\", got {type(shapes).__name__}")
    out = []
    for shape in shapes:
        if (not isinstance(shape, (list, tuple)) or len(shape) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in shape)):
            raise ValueError(f"shapes: each shape must be (N, K) integers, got {shape!r}")
        layout.check_shape(*shape, k_multiple=layout.K_MULTIPLE, name="shapes: the weights'")
        out.append(tuple(shape))
    if not out:
        raise ValueError("shapes: no shape given")
    return list(dict.fromkeys(out))


def describe(fields: dict) -> str:
    """A configuration's short name: ``bulk_x`` / ``bulk`` (the stripe kernels) or
    ``unrollU[_pin]``, ``pdl_`` in front where it launches with PDL."""
    if fields.get("bulk"):
        shape = "bulk_x" if fields.get("stage_x") else "bulk"
    else:
        shape = f"unroll{fields.get('unroll')}" + ("_pin" if fields.get("pin") else "")
    return ("pdl_" if fields.get("pdl") else "") + shape


__all__ = ["ENV_GEMV_TUNING", "FORMAT", "MIN_CALLS", "captured", "clear", "config_fields", "copies_for", "describe",
           "entries", "forget", "gpu_key", "graph_time_us", "load", "lookup", "parse_shapes", "remember",
           "replay_time_us", "save"]
