"""Compile-once cache for the CuTe DSL kernels: in memory, and on disk across processes.

A kernel is compiled (``cute.compile(..., options="--enable-tvm-ffi --gpu-arch ...")``)
against fake tensors with symbolic sizes, so one compilation serves every batch size and
sequence length.  The key holds everything that changes the generated code: the kernel
and its constexpr configuration, the target arch, and a fingerprint of the library
sources, the CuTe DSL and TVM-FFI versions and the Python version.  Compiled functions
are exported as object files under ``$BITDECODE_CACHE_DIR`` (default
``~/.cache/bitdecode``) and loaded from there by later processes;
``BITDECODE_NO_DISK_CACHE=1`` keeps them in memory only.  A cache folder that cannot be
read or written costs only the disk: the kernels are compiled in memory.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Dict, Hashable, Optional, Tuple

import torch

ENV_CACHE_DIR = "BITDECODE_CACHE_DIR"
ENV_DISABLE_DISK = "BITDECODE_NO_DISK_CACHE"
_EXPORT_NAME = "bitdecode_kernel"
_PKG_ROOT = Path(__file__).resolve().parent


def disk_cache_on() -> bool:
    """Whether compiled kernels are kept on disk: ``BITDECODE_NO_DISK_CACHE`` unset, empty or
    a "no" (0, false, no, off), as the other switches read 0."""
    return os.environ.get(ENV_DISABLE_DISK, "").strip().lower() in ("", "0", "false", "no", "off")


def cache_root() -> Path:
    """``$BITDECODE_CACHE_DIR`` (``~`` expanded, made absolute: a relative path would move
    with the working directory), else ``~/.cache/bitdecode``; a RuntimeError where the
    variable is unset and there is no home directory to put it in."""
    value = os.environ.get(ENV_CACHE_DIR)
    if value:
        return Path(os.path.expanduser(value)).absolute()
    home = Path(os.path.expanduser("~"))  # (Path.home() raises on some Pythons, returns "~" on others)
    if not home.is_absolute():
        raise RuntimeError(f"no home directory for the kernel cache: set ${ENV_CACHE_DIR} "
                           f"(or ${ENV_DISABLE_DISK}=1)")
    return home / ".cache" / "bitdecode"


@functools.lru_cache(maxsize=1)
def fingerprint() -> str:
    """Hash of every kernel-relevant source plus the toolchain versions."""
    import cutlass

    h = hashlib.sha256()
    h.update(f"py{sys.version_info.major}.{sys.version_info.minor}".encode())
    h.update(f"cutlass={cutlass.__version__}".encode())
    try:
        import tvm_ffi

        h.update(f"tvm_ffi={tvm_ffi.__version__}".encode())
    except ImportError:  # pragma: no cover - tvm_ffi is a dependency
        pass
    import bitdecode.kernels_sm80 as k80
    import bitdecode.kernels_sm90 as k90
    import bitdecode.kernels_sm100 as k100
    import bitdecode.layouts as lay

    # the package's own directories (layouts/ and kernels_*/ sit beside bitdecode/ in a
    # checkout): nothing else in the tree may change the cache key
    for root in (_PKG_ROOT, *(Path(m.__file__).resolve().parent for m in (lay, k80, k90, k100))):
        for src in sorted(root.rglob("*.py")):
            h.update(src.relative_to(root).as_posix().encode())
            h.update(src.read_bytes())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    return cache_root() / fingerprint()


def target_arch(device_index: Optional[int] = None) -> str:
    """CuTe DSL target for the current GPU: sm_80 / sm_86 / sm_89 / sm_90a / sm_100a ..."""
    return _target_arch(torch.cuda.current_device() if device_index is None else device_index)


@functools.lru_cache(maxsize=None)
def _target_arch(device_index: int) -> str:
    major, minor = capability(device_index)
    return f"sm_{major}{minor}{'a' if major >= 9 else ''}"


@functools.lru_cache(maxsize=None)
def capability(device_index: int) -> Tuple[int, int]:
    """(major, minor) compute capability of CUDA device ``device_index``, read once."""
    return tuple(torch.cuda.get_device_capability(device_index))


def has_pdl(arch: str) -> bool:
    """Whether ``arch`` (``sm_80`` .. ``sm_100a``) has programmatic dependent launch
    (``griddepcontrol``, sm_90 and later)."""
    return int(arch[len("sm_"):].rstrip("af")) >= 90


def compile_options(arch: str, *, keep_ptx: bool = False) -> str:
    opts = [f"--gpu-arch {arch}", "--enable-tvm-ffi"]  # every kernel is called through TVM-FFI
    if keep_ptx:
        # the PTX text comes back in ``compiled.artifacts.PTX``; the file CuTe DSL also
        # writes goes to a scratch dir rather than the current directory
        opts.append(f"--keep-ptx --dump-dir {_ptx_dump_dir()}")
    return " ".join(opts)


@functools.lru_cache(maxsize=1)
def _ptx_dump_dir() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="bitdecode-ptx-")


class KernelCache:
    """Compiled kernels by key; a miss compiles (or loads from disk) exactly once."""

    def __init__(self) -> None:
        self._mem: Dict[Tuple[Hashable, ...], Any] = {}
        self._lock = threading.Lock()
        self.unwritten = 0  # kernels compiled that the disk cache (on) did not take: ``compile --warm-cache``

    def get(self, key: Tuple[Hashable, ...], build: Callable[[], Any]) -> Any:
        fn = self._mem.get(key)
        if fn is not None:
            return fn
        with self._lock:
            fn = self._mem.get(key)
            if fn is None:
                fn = self._load(key)
                if fn is None:
                    fn = build()
                    if disk_cache_on() and not self._store(key, fn):
                        self.unwritten += 1
                fn = self._mem[key] = _positional(fn)
        return fn

    # ---- disk ----------------------------------------------------------------------
    @staticmethod
    def _path(key) -> Path:
        digest = hashlib.sha256(pickle.dumps(key)).hexdigest()[:32]
        return cache_dir() / f"{digest}.o"

    def _load(self, key):
        if not disk_cache_on():
            return None
        try:
            path = self._path(key)
            if not path.exists():
                return None
            import cutlass.cute as cute

            module = cute.runtime.load_module(str(path), enable_tvm_ffi=True)
            return getattr(module, _EXPORT_NAME)
        except Exception:  # an unreadable folder, no home, a stale or partial file: compile (and overwrite)
            return None

    def _store(self, key, fn) -> bool:
        """Exports ``fn`` to the disk cache (``get`` calls it with the disk on); whether it is
        there now."""
        try:
            path = self._path(key)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp.o")
            fn.export_to_c(object_file_path=str(tmp), function_name=_EXPORT_NAME)
            os.replace(tmp, path)
            return True
        except Exception:  # read-only or full disk: the in-memory cache still works
            return False


def _positional(fn):
    """The TVM-FFI function behind a compiled kernel, called positionally.  The DSL's
    callable forwards to it through two Python frames (a keyword-argument wrapper that our
    all-positional, no-default signatures never need), a few microseconds per launch that a
    decode step pays per layer; kernels with raw-pointer arguments keep the wrapper, which
    converts those."""
    get = getattr(fn, "__tvm_ffi_object__", None)
    raw = get() if get is not None else None
    execution_args = getattr(fn, "execution_args", None)
    if raw is None or getattr(execution_args, "has_pointer_address_arg_specs", False):
        return fn
    return raw


def bound_arguments(args: Tuple[Any, ...], *fns) -> Tuple[Any, ...]:
    """``args`` of kernel calls that never change (a cache's tensors), in the form the
    kernels ``fns`` take fastest: TVM-FFI tensors, converted here once, when every one is a
    raw TVM-FFI function (``_positional``), which otherwise converts each torch tensor
    through DLPack on every call (CPU: 12 tensors 1.4 us, pre-converted 0.3,
    profiles/NOTES.md); as they are otherwise.  Each ffi tensor holds its torch tensor's
    storage alive, as the torch tensor would.  The call's own torch tensors (q, the output,
    ``k`` / ``v`` of an append) still set the launch's stream: TVM-FFI takes it from the
    first CUDA torch tensor of a call."""
    import tvm_ffi

    if not all(isinstance(fn, tvm_ffi.Function) for fn in fns):
        return tuple(args)
    return tuple(tvm_ffi.from_dlpack(a) if isinstance(a, torch.Tensor) else a for a in args)


class PerStream:
    """Values a host object keeps per CUDA stream (a split workspace, a chunk of outputs):
    launches on one stream are ordered, so they may share one; launches on different
    streams may overlap, so they never do.  At most ``limit`` streams are kept (the least
    recently added dropped first).  While a graph is captured there is no stream to key on
    (``current_stream`` gives None): callers make a fresh value from the graph's pool."""

    def __init__(self, limit: int = 8) -> None:
        self.limit = limit
        self._by_stream: Dict[Hashable, Any] = {}

    def get(self, stream: Hashable, make: Callable[[], Any], keep: Optional[Callable[[Any], bool]] = None) -> Any:
        """The value kept for ``stream``, or ``make()``'s, kept from now on; also when
        ``keep`` says the kept one no longer serves (an empty list, a buffer too small)."""
        value = self._by_stream.get(stream)
        if value is not None and (keep is None or keep(value)):  # (the per-call path: one lookup)
            return value
        if value is None or (keep is not None and not keep(value)):
            if value is None and len(self._by_stream) >= self.limit:
                self._by_stream.pop(next(iter(self._by_stream)))
            value = self._by_stream[stream] = make()
        return value

    def values(self):
        return self._by_stream.values()


def current_stream(device_index: int):
    """The current raw CUDA stream of ``device_index``, or None while it captures a graph
    (on every eager decode's path: torch is imported once, not in here)."""
    if torch._C._cuda_isCurrentStreamCapturing():
        return None
    return torch._C._cuda_getCurrentRawStream(device_index)


KERNELS = KernelCache()
