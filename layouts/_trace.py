"""Evaluate CuTe layout algebra to plain Python integers, without a GPU.

CuTe DSL layouts only exist while a ``@cute.jit`` function is being traced.  Static
layouts evaluate to Python ints there, so every table in ``layouts/`` is produced by
running a small builder inside such a trace and returning what it computed.  The
result is cached per process: the tables never change for a given configuration.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any, Callable

# CuTe DSL silently assumes sm_100 when no arch is named; the layout tables only
# depend on the instruction shapes, which every supported arch shares, so any
# valid target works for tracing.  Only set it when the user has not.
_DEFAULT_TRACE_ARCH = "sm_80"


@contextlib.contextmanager
def _trace_arch(arch: str | None):
    old = os.environ.get("CUTE_DSL_ARCH")
    if arch is not None:
        os.environ["CUTE_DSL_ARCH"] = arch
    elif old is None:
        os.environ["CUTE_DSL_ARCH"] = _DEFAULT_TRACE_ARCH
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("CUTE_DSL_ARCH", None)
        else:
            os.environ["CUTE_DSL_ARCH"] = old


def evaluate(builder: Callable[[], Any], arch: str | None = None) -> Any:
    """Run ``builder`` inside a CuTe trace and return its (pure Python) result."""
    import cutlass.cute as cute

    box: dict[str, Any] = {}

    @cute.jit
    def _trace():
        box["value"] = builder()

    with _trace_arch(arch):
        cute.compile(_trace)
    return box["value"]


def traced(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: evaluate ``fn(*args)`` inside a trace, cached on its (hashable) args."""

    @functools.lru_cache(maxsize=None)
    def cached(*args):
        return evaluate(lambda: fn(*args))

    functools.update_wrapper(cached, fn)
    return cached
