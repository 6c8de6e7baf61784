"""The package's import graph: one direction, no cycles (checked on the source with ast).

API (``bitdecode/*.py``) -> ``bitdecode.backend`` <- ``kernels_sm*`` -> ``layouts``; kernels
may also use ``bitdecode.jit`` (the compile cache) and ``bitdecode.formats`` (the format
description), nothing else of the API; layouts import neither kernels nor the API.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {  # folder -> installed package name (pyproject's package-dir)
    "bitdecode": "bitdecode", "layouts": "bitdecode.layouts", "kernels_sm80": "bitdecode.kernels_sm80",
    "kernels_sm90": "bitdecode.kernels_sm90", "kernels_sm100": "bitdecode.kernels_sm100",
}
KERNEL_API_ALLOWED = {"bitdecode.backend", "bitdecode.jit", "bitdecode.formats"}
# The one API module that reaches kernel packages directly: jit hashes their sources for the
# compile-cache key.  bitnet, dense and rope ask the arch's backend (``Backend.bitnet``,
# ``Backend.dense``), as decode does.
API_TO_KERNELS_ALLOWED = {"bitdecode.jit"}


def _modules():
    out = {}
    for folder, pkg in PACKAGES.items():
        for path in sorted((ROOT / folder).glob("*.py")):
            name = pkg if path.stem == "__init__" else f"{pkg}.{path.stem}"
            out[name] = path
    return out


def _imports(name: str, path: Path, known) -> set:
    tree = ast.parse(path.read_text())
    pkg = name if path.stem == "__init__" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):  # imports inside functions count too
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            # ``from X import a``: the submodule X.a when there is one, else X itself
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in known and t != name}
    return found


def _graph():
    mods = _modules()
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def test_no_import_cycle():
    graph = _graph()
    state = {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in graph[node]:
            if state.get(nxt) == "open":
                raise AssertionError("import cycle: " + " -> ".join(stack + [node, nxt]))
            if nxt not in state:
                visit(nxt, stack + [node])
        state[node] = "done"

    for node in graph:
        if node not in state:
            visit(node, [])


def test_dependencies_point_one_way():
    graph = _graph()
    for mod, deps in graph.items():
        if mod.startswith("bitdecode.layouts"):
            bad = {d for d in deps if not d.startswith("bitdecode.layouts")}
            assert not bad, f"{mod} (layouts) imports {bad}"
        elif mod.startswith("bitdecode.kernels_sm"):
            api = {d for d in deps if not d.startswith(("bitdecode.layouts", "bitdecode.kernels_sm"))}
            assert api <= KERNEL_API_ALLOWED, f"{mod} imports API modules {api - KERNEL_API_ALLOWED}"
    api_to_kernels = {m: {d for d in deps if d.startswith("bitdecode.kernels_sm")} for m, deps in graph.items()
                      if not m.startswith(("bitdecode.layouts", "bitdecode.kernels_sm"))
                      and m not in API_TO_KERNELS_ALLOWED}
    assert not any(api_to_kernels.values()), f"the API imports kernel modules directly: {api_to_kernels}"


def test_the_api_names_no_arch():
    """The API chooses kernels through the backends (``backend.for_arch`` / ``dispatch``),
    never by comparing arch strings itself; only ``bitdecode compile``'s list of targets
    names them."""
    import re

    for path in sorted((ROOT / "bitdecode").glob("*.py")):
        if path.name == "cli_compile.py":
            continue
        found = re.findall(r"[\"']sm_\d+a?[\"']", path.read_text())
        assert not found, f"{path.name} compares arch strings {found}"


def test_import_does_not_load_cutlass():
    import subprocess
    import sys

    code = "import sys, bitdecode; assert 'cutlass' not in sys.modules, 'cutlass imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
