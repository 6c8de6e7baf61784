"""Argument checks shared by every public entry point.

Each failure raises before anything is launched or written, with a message that names the
argument, what was expected and what came.
"""

from __future__ import annotations

import numbers
from typing import Iterable, Optional, Sequence

import torch

FLOAT16_DTYPES = (torch.float16, torch.bfloat16)


def _fmt_shape(shape) -> str:
    return "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"


def tensor(
    name: str,
    t,
    *,
    dtypes: Optional[Iterable[torch.dtype]] = None,
    ndim: Optional[int] = None,
    shape: Optional[Sequence[Optional[int]]] = None,
    device: Optional[torch.device] = None,
    contiguous: bool = False,
    last_contiguous: bool = False,
) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            want = " or ".join(str(d) for d in dtypes)
            raise TypeError(f"{name} must have dtype {want}, got {t.dtype}")
    if shape is not None:
        ndim = len(shape)
    if ndim is not None and t.dim() != ndim:
        want = _fmt_shape(shape) if shape is not None else f"{ndim} dims"
        raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")
    if shape is not None:
        for want, got in zip(shape, t.shape):
            if want is not None and want != got:
                raise ValueError(f"{name} must have shape {_fmt_shape(shape)}, got {tuple(t.shape)}")
    if device is not None and t.device != torch.device(device):
        raise ValueError(f"{name} must be on {torch.device(device)}, got {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {tuple(t.stride())}")
    if last_contiguous and t.dim() and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension, got strides {tuple(t.stride())}")
    return t


def new_tokens(k, v, like: torch.Tensor, names=("k", "v")) -> None:
    """K and V ``[B, T, Hkv, D]`` for a cache whose residual block is ``like`` ``[B, Nr,
    Hkv, D]``: its dtype and device, contiguous rows, the same shape (``names``: the
    caller's names of k and v)."""
    shape = (like.shape[0], None, like.shape[2], like.shape[3])
    tensor(names[0], k, dtypes=[like.dtype], shape=shape, device=like.device, last_contiguous=True)
    tensor(names[1], v, dtypes=[like.dtype], shape=k.shape, device=like.device, last_contiguous=True)


def prompt_lengths(name: str, lens: Sequence[int], tokens: int) -> None:
    """A prefill's per-sequence lengths: each in ``[0, tokens]`` (the tokens given)."""
    bad = next((n for n in lens if not 0 <= n <= tokens), None)
    if bad is not None:
        raise ValueError(f"{name} must lie in [0, {tokens}] (tokens given), got {bad}")


def same_device(**tensors) -> torch.device:
    devices = {n: t.device for n, t in tensors.items() if t is not None}
    first_name, first = next(iter(devices.items()))
    for n, d in devices.items():
        if d != first:
            raise ValueError(f"{n} is on {d} but {first_name} is on {first}; all tensors must share a device")
    return first


def integer(name: str, value) -> int:
    """An int (numpy's too, as a Python int; bools refused), else a TypeError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return int(value)


def model_dtype(name: str, dtype) -> None:
    """A model (cache) dtype: torch.float16 or torch.bfloat16, else a TypeError naming ``name``."""
    if dtype not in FLOAT16_DTYPES:
        raise TypeError(f"{name} must be torch.float16 or torch.bfloat16, got {dtype}")


def flag(name: str, value) -> bool:
    """A bool, else a TypeError naming ``name`` (a truthy string or tensor is not taken for
    True)."""
    if not isinstance(value, bool):
        kind = type(value)  # (numpy's bool is also named "bool": say whose)
        what = kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__name__}"
        raise TypeError(f"{name} must be a bool, got {what}")
    return value


def axis(name: str, value, tensor_name: str, t: torch.Tensor) -> int:
    """A dimension of ``t`` (negative counts from the end), as its index >= 0."""
    integer(name, value)
    if t.dim() == 0:
        raise ValueError(f"{tensor_name} must have at least one dimension, got a 0-dim tensor")
    if not -t.dim() <= value < t.dim():
        raise ValueError(f"{name} must lie in [{-t.dim()}, {t.dim() - 1}] for {tensor_name} of {t.dim()} dims, "
                         f"got {value}")
    return value % t.dim()


def nonnegative_int(name: str, value) -> int:
    """An int >= 0 (numpy's too, as a Python int; bools refused), else a ValueError naming
    ``name`` and the value."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return int(value)


def positive_int(name: str, value, allowed: Optional[Sequence[int]] = None) -> int:
    value = integer(name, value)
    if allowed is not None and value not in allowed:
        raise ValueError(f"{name} must be one of {tuple(allowed)}, got {value}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def finite(name: str, t: torch.Tensor) -> None:
    """Raise on NaN/Inf (synchronizes; only used where documented)."""
    if t.numel() and not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} contains NaN or Inf; quantization needs finite values")


def device(name: str, value) -> torch.device:
    """A usable torch device (CUDA with an index that exists; 'cuda' means the current one)."""
    if not isinstance(value, (str, torch.device)):
        raise TypeError(f"{name} must be a str or torch.device, got {type(value).__name__}")
    try:
        dev = torch.device(value)
    except (RuntimeError, ValueError) as err:
        raise ValueError(f"{name} must name a torch device, got {value!r} ({err})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{name} must be a usable torch device, got {value!r} but CUDA is not available")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        elif dev.index >= torch.cuda.device_count():
            raise ValueError(f"{name} must be a usable torch device, got {value!r} but there are "
                             f"{torch.cuda.device_count()} CUDA devices")
    elif dev.type != "cpu":
        raise ValueError(f"{name} must be a cpu or cuda device, got {value!r}")
    return dev


def int_list(name: str, values) -> list:
    """A sequence (or 1-D integer tensor) of ints, as a list; bools and floats are refused."""
    if isinstance(values, torch.Tensor):
        if values.dim() != 1 or values.dtype.is_floating_point or values.dtype == torch.bool:
            raise TypeError(f"{name} must be a 1-D integer tensor or a sequence of ints, got a "
                            f"{values.dim()}-D {values.dtype} tensor")
        if values.is_meta:
            raise ValueError(f"{name} is a meta tensor, which holds no values")
        return [int(x) for x in values.tolist()]
    if type(values).__name__ == "ndarray" and getattr(values, "ndim", 0) == 1:  # numpy, not imported here
        values = values.tolist()
    if isinstance(values, (str, bytes, dict)) or not isinstance(values, Sequence):
        raise TypeError(f"{name} must be a sequence of ints, got {type(values).__name__}")
    out = []
    for x in values:
        if isinstance(x, bool) or not isinstance(x, numbers.Integral):
            raise TypeError(f"{name} must hold ints, got {type(x).__name__} ({x!r})")
        out.append(int(x))
    return out


def version_counter(t: torch.Tensor) -> Optional[int]:
    """``t._version`` (bumped by every in-place change), or None for an inference-mode
    tensor, which has no counter (its in-place changes cannot be seen)."""
    return None if t.is_inference() else t._version
