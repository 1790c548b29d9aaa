"""The package's rooms import downwards only, lazy imports included, and no module imports
itself back through others (ARCHITECTURE.md): errors and signals, then `spec` (what bytes and
numbers mean), `backend` (the contract, registry, reference), `files`, `formats`, `model`,
the integrations, `conformance`, `cli`, and last the `qcore` facade. Nothing but the registry's
built-in plugin and the conformance suite imports the reference backend."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "qcore"

ROOMS = ["base", "spec", "backend", "files", "formats", "model", "integrations", "conformance", "cli", "facade"]
"""Lowest first: a module may import its own room and the rooms before it."""
BASE = {"qcore.errors", "qcore._signals", "qcore._regex", "qcore._version", "qcore.plugins"}
TOP_LEVEL_ROOMS = {"qcore.nn": "integrations"}


def _modules() -> dict[str, Path]:
    """Every module of the package: dotted name -> file."""
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        parts = p.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


MODULES = _modules()


def _room(name: str) -> str:
    if name == "qcore":
        return "facade"
    if name in BASE:
        return "base"
    if name in TOP_LEVEL_ROOMS:
        return TOP_LEVEL_ROOMS[name]
    return name.split(".")[1]


def _target(mod: str, alias: str | None = None) -> str:
    """The module an import names: `from mod import alias` is the submodule mod.alias where one
    exists, else mod itself."""
    if alias is not None and f"{mod}.{alias}" in MODULES:
        return f"{mod}.{alias}"
    return mod


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(name: str) -> set[str]:
    """Package modules that module `name` imports anywhere in its body (lazy imports included)."""
    path = MODULES[name]
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _is_type_checking(node.test)
                   for b in node.body for n in ast.walk(b)}
    for node in ast.walk(tree):
        if id(node) in typing_only:  # `if TYPE_CHECKING:` names types only, never runs
            continue
        if isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([mod] if mod else []))
            if mod == "qcore" or mod.startswith("qcore."):
                out.update(_target(mod, a.name) for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name == "qcore" or a.name.startswith("qcore."))
    out.discard(name)
    return {m for m in out if m in MODULES}


GRAPH = {name: _imports(name) for name in MODULES}


@pytest.mark.parametrize("name", [n for n in MODULES if n != "qcore"])
def test_a_module_imports_only_its_room_and_lower_ones(name):
    mine = ROOMS.index(_room(name))
    up = sorted(m for m in GRAPH[name] if ROOMS.index(_room(m)) > mine)
    assert not up, f"{name} ({_room(name)}) imports higher rooms: " + ", ".join(f"{m} ({_room(m)})" for m in up)


def test_no_module_imports_itself_back():
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def _reference_free():
    for name in ("qcore.backend.ops", "qcore.backend.protocol", "qcore.backend.base", "qcore.backend.registry"):
        yield MODULES[name]
    for pkg in ("backends/ndarray/qcore_ndarray", "backends/cuda/qcore_cuda", "examples/plugin/qcore_lutcpu"):
        yield from sorted((ROOT / pkg).rglob("*.py"))


@pytest.mark.parametrize("path", list(_reference_free()), ids=lambda p: str(p.relative_to(ROOT)))
def test_ops_and_backends_do_not_borrow_from_the_reference_backend(path):
    text = path.read_text()
    assert "qcore.backend.reference" not in text and "from .reference" not in text, \
        f"{path.name} imports qcore.backend.reference; use qcore.spec.arithmetic"


def test_a_low_module_loads_no_higher_room():
    """Python runs the facade (qcore/__init__.py) before any submodule; it imports its re-exported
    names on first use, so importing a spec module loads no recipe, file, format or model module.
    The backend room's package is loaded (the facade's `backend` function shares its name), and
    with it the registry, which hands the contract's types their lookups (`use_registry`)."""
    code = "import sys, qcore.spec.schemes; print(*sorted(m for m in sys.modules if m.startswith('qcore')))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            cwd=ROOT).stdout.split()
    higher = [m for m in loaded if m in MODULES and m != "qcore" and ROOMS.index(_room(m)) > ROOMS.index("backend")]
    assert "qcore.spec.schemes" in loaded and not higher, f"importing qcore.spec.schemes loads {higher}"


def test_every_facade_name_resolves():
    import qcore
    import qcore.backend.registry  # (a first import of a subpackage must not replace the function)

    assert [n for n in qcore.__all__ if not hasattr(qcore, n)] == []
    assert callable(qcore.backend) and qcore.backend("reference").name == "reference"
    assert set(qcore.__all__) <= set(dir(qcore))


BACKEND_ORDER = ["qcore.backend.hookspecs", "qcore.backend.activations", "qcore.backend.protocol",
                 "qcore.backend.stats", "qcore.backend.ops", "qcore.backend.act", "qcore.backend.base",
                 "qcore.backend.reference", "qcore.backend._builtin", "qcore.backend.registry", "qcore.backend"]
"""The backend room, lowest first: the contract's types below everything that uses them, the
registry (which hands `protocol` its lookups) on top, then the room's package, which imports it."""


@pytest.mark.parametrize("name", [n for n in MODULES if _room(n) == "backend"])
def test_the_backend_room_imports_downwards(name):
    assert name in BACKEND_ORDER, f"{name} has no place in BACKEND_ORDER; add it where its imports allow"
    mine = BACKEND_ORDER.index(name)
    up = sorted(m for m in GRAPH[name] if _room(m) == "backend" and BACKEND_ORDER.index(m) > mine)
    assert not up, f"{name} imports modules above it in the backend room: {', '.join(up)}"
