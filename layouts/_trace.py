"""Evaluate CuTe layout algebra to plain Python integers, without a GPU.

CuTe DSL layouts only exist while a ``@cute.jit`` function is being traced.  Static
layouts evaluate to Python ints there, so every table in ``layouts/`` is produced by
running a small builder inside such a trace and returning what it computed.  The
result is cached per process: the tables never change for a given configuration.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

# The tables depend only on instruction shapes; the target is named explicitly so that
# tracing never probes for a GPU (CuTe DSL would otherwise assume sm_100).
DEFAULT_TRACE_ARCH = "sm_80"


def evaluate(builder: Callable[[], Any], arch: str = DEFAULT_TRACE_ARCH) -> Any:
    """Run ``builder`` inside a CuTe trace and return its (pure Python) result."""
    import cutlass.cute as cute

    box: dict[str, Any] = {}

    @cute.jit
    def _trace():
        box["value"] = builder()

    cute.compile(_trace, options=f"--gpu-arch {arch}")
    return box["value"]


def traced_for(arch: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: evaluate ``fn(*args)`` inside a trace for ``arch``, cached on its
    (hashable) args."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.lru_cache(maxsize=None)
        def cached(*args):
            return evaluate(lambda: fn(*args), arch=arch)

        functools.update_wrapper(cached, fn)
        return cached

    return decorate


traced = traced_for(DEFAULT_TRACE_ARCH)
