"""Broken plugins are reported and skipped; every other backend keeps working.

Each fake plugin is a real distribution on `sys.path` (a `*.dist-info` with an entry point in the
`qcore` group, and its module), found by `importlib.metadata` like an installed one.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import qcore
from qcore import BackendNotFoundError, BackendUnavailableError
from qcore.backend import registry

GOOD_BACKEND = """
import qcore
from qcore.backend.reference import ReferenceBackend

class Good(ReferenceBackend):
    name = "{name}"
    priority = {priority}
"""

PLUGINS = {
    # name: module text
    "importfail": "raise ImportError('needs libfoo.so.3')\n",
    "exitatimport": "import sys\nsys.exit(3)\n",
    "hookraises": textwrap.dedent("""
        import qcore
        @qcore.hookimpl
        def qcore_register_backends():
            raise RuntimeError('hook exploded')
    """),
    "duplicate": GOOD_BACKEND.format(name="reference", priority=5) + textwrap.dedent("""
        class Other(Good):
            name = "dupsibling"
        @qcore.hookimpl
        def qcore_register_backends():
            return [Good(), Other()]
    """),
    "malformed": textwrap.dedent("""
        import qcore
        from qcore.backend.reference import ReferenceBackend
        class NumName(ReferenceBackend):
            name = 42
        class StrPrio(ReferenceBackend):
            name = "strprio"
            priority = "high"
        class NotCallable(ReferenceBackend):
            name = "notcallable"
            quantize = None
        @qcore.hookimpl
        def qcore_register_backends():
            return [NumName(), StrPrio(), NotCallable(), object()]
    """),
    "hangs": GOOD_BACKEND.format(name="hangs", priority=100) + textwrap.dedent("""
        import time
        class Hangs(Good):
            def available(self):
                time.sleep(3600)
                return True
        @qcore.hookimpl
        def qcore_register_backends():
            return [Hangs()]
    """),
    "fine": GOOD_BACKEND.format(name="fine", priority=-5) + textwrap.dedent("""
        @qcore.hookimpl
        def qcore_register_backends():
            return [Good()]
    """),
}


def _install(root, names) -> None:
    for name in names:
        dist = root / f"qfake_{name}-0.1.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: qfake-{name}\nVersion: 0.1\n")
        (dist / "entry_points.txt").write_text(f"[qcore]\n{name} = qfake_{name}\n")
        (root / f"qfake_{name}.py").write_text(PLUGINS[name])


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    _install(tmp_path, PLUGINS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(registry.TIMEOUT_VAR, "0.3")
    for name in PLUGINS:
        sys.modules.pop(f"qfake_{name}", None)
    registry.reset()
    yield tmp_path
    registry.reset()
    for name in PLUGINS:
        sys.modules.pop(f"qfake_{name}", None)


def test_each_fault_is_reported_and_skipped(plugins):
    errors = registry.plugin_errors()
    names = qcore.backends()
    assert "ImportError: needs libfoo.so.3" in errors["importfail"]
    assert "SystemExit: 3" in errors["exitatimport"]
    assert "RuntimeError: hook exploded" in errors["hookraises"]
    assert "backend name 'reference' is already taken" in errors["duplicate"]
    assert "dupsibling" in names  # the duplicate's sibling is kept
    assert "named 42" in errors["malformed"] and "priority 'high'" in errors["malformed"]
    assert "non-callable quantize" in errors["malformed"] and "lacks name" in errors["malformed"]
    assert not {"strprio", "notcallable"} & set(names)
    assert "fine" in names and "hangs" in names  # registered; its available() is only asked later


def test_a_hanging_available_is_skipped_after_the_timeout(plugins):
    x = np.linspace(-1, 1, 32, dtype=np.float32)
    t0 = time.perf_counter()
    q = qcore.quantize(x, "q8s")  # auto: 'hangs' has the highest priority, but does not answer
    waited = time.perf_counter() - t0
    assert q.backend.name != "hangs"
    assert "available() did not answer within 0.3 s" in registry.plugin_errors()["hangs"]
    assert waited < 30  # one timeout, not a hang (the thread is a daemon)
    t0 = time.perf_counter()
    with pytest.raises(BackendUnavailableError, match="did not answer within 0.3 s"):
        qcore.backend("hangs")
    assert time.perf_counter() - t0 < 0.25  # remembered: not asked again
    # every other backend keeps working
    for name in ("reference", "fine", "dupsibling"):
        y = qcore.backend(name).quantize(x, "q8s").numpy()
        assert np.array_equal(y, qcore.backend("reference").quantize(x, "q8s").numpy())


def test_broken_names_are_not_found_with_the_reason(plugins):
    with pytest.raises(BackendNotFoundError, match="its plugin failed to load: ImportError: needs libfoo"):
        qcore.backend("importfail")


def test_disable_plugins_by_name(plugins, monkeypatch):
    monkeypatch.setenv(registry.DISABLE_VAR, "importfail, hangs,lutcpu")
    registry.reset()
    assert {"importfail", "hangs", "lutcpu"}.isdisjoint(qcore.backends())
    assert "importfail" not in registry.plugin_errors() and "hangs" not in registry.plugin_errors()
    assert registry.disabled_plugins() == ["importfail", "hangs", "lutcpu"]
    assert "reference" in qcore.backends()


def test_qcore_backends_command_reports_them(plugins):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugins), os.environ.get("PYTHONPATH", "")]),
           registry.TIMEOUT_VAR: "0.5", registry.DISABLE_VAR: "exitatimport", "NUMBA_ENABLE_CUDASIM": "1"}
    exe = os.path.join(os.path.dirname(sys.executable), "qcore")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "qcore.cli.main"]
    p = subprocess.run(cmd + ["backends"], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    for name, text in (("importfail", "needs libfoo"), ("hookraises", "hook exploded"),
                       ("duplicate", "already taken"), ("malformed", "named 42"), ("hangs", "did not answer")):
        assert f"{name}: " in out and text in out, (name, out)
    assert "plugins disabled by QCORE_DISABLE_PLUGINS: exitatimport" in out
    assert "│ reference" in out and "│ fine" in out
    assert "Traceback" not in p.stderr
