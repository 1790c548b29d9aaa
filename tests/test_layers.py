"""The core's layers import downwards only (ARCHITECTURE.md): the arithmetic of SPEC §2 lives in
`qcore.arithmetic`, and nothing but the registry's built-in plugin and the conformance suite
imports the `reference` backend."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# module -> modules of the qcore package it must not import (directly or lazily)
LOWER = ["codecs", "scheme", "layout", "payload", "arithmetic", "checks", "errors", "activations"]
HIGHER = {"protocol", "registry", "ops", "reference", "_builtin", "cli", "io", "report", "conformance"}


def _imports(path: Path) -> set[str]:
    """qcore submodules `path` imports anywhere in its body (absolute or relative)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level and path.parent.name == "qcore":  # from . import x / from .x import y
                out.update([mod.split(".")[0]] if mod else [a.name for a in node.names])
            elif mod == "qcore":
                out.update(a.name for a in node.names)
            elif mod.startswith("qcore."):
                out.add(mod.split(".")[1])
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[1] for a in node.names if a.name.startswith("qcore."))
    return out


@pytest.mark.parametrize("name", LOWER)
def test_lower_layers_import_no_higher_one(name):
    assert not _imports(ROOT / "qcore" / f"{name}.py") & HIGHER


def _sources():
    yield ROOT / "qcore" / "ops.py"
    yield ROOT / "qcore" / "protocol.py"
    yield ROOT / "qcore" / "registry.py"
    for pkg in ("backends/ndarray/qcore_ndarray", "backends/cuda/qcore_cuda", "examples/plugin/qcore_lutcpu"):
        yield from sorted((ROOT / pkg).glob("*.py"))


@pytest.mark.parametrize("path", list(_sources()), ids=lambda p: str(p.relative_to(ROOT)))
def test_ops_and_backends_do_not_borrow_from_the_reference_backend(path):
    assert "reference" not in _imports(path), f"{path.name} imports qcore.reference; use qcore.arithmetic"
