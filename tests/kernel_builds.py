"""Helpers for tests that build kernels with keywords other than the shipped ones."""


def fresh_jit(monkeypatch):
    """Kernels compiled afresh from here on: an empty in-memory JIT cache and no disk cache
    (neither's keys hold keywords a test patches into a kernel class)."""
    from bitdecode import jit

    monkeypatch.setattr(jit, "KERNELS", jit.KernelCache())
    monkeypatch.setenv(jit.ENV_DISABLE_DISK, "1")


def built_with(monkeypatch, cls, keywords, record):
    """``cls.__init__`` with ``keywords`` over its caller's, each instance's ``record(self)``
    appended to the returned list (so a test can check that the kernel it meant ran)."""
    init = cls.__init__
    built = []

    def patched(self, *args, **kw):
        init(self, *args, **{**kw, **keywords})
        built.append(record(self))

    monkeypatch.setattr(cls, "__init__", patched)
    return built
