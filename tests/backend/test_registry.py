"""Backends (docs/spec.md, backends): plugin discovery through entry points, selection, auto, and error text."""
import textwrap

import numpy as np
import pytest

import qcore
from qcore import (
    BackendNotFoundError, BackendUnavailableError, BaseBackend, InputError, UnsupportedSchemeError,
)
from qcore.backend import registry
from qcore.backend.reference import ReferenceBackend
from tests.doubles import Offline, Q8Only


@pytest.fixture
def fresh_registry():
    registry.reset()
    yield registry
    registry.reset()






def test_reference_found_through_entry_point():
    from importlib.metadata import entry_points

    assert any(ep.name == "reference" for ep in entry_points(group="qcore"))
    assert "reference" in qcore.backends()
    assert isinstance(qcore.backend("reference"), ReferenceBackend)


def test_unknown_backend(fresh_registry):
    with pytest.raises(BackendNotFoundError, match=r"no backend named 'nope'; installed: .*reference") as e:
        qcore.backend("nope")
    assert "pip install" not in str(e.value)  # never a guessed package name


def test_unknown_backend_did_you_mean(fresh_registry):
    with pytest.raises(BackendNotFoundError, match=r"no backend named 'refrence'; did you mean 'reference'\?") as e:
        qcore.backend("refrence")
    assert "pip install" not in str(e.value)


def test_unknown_own_backend_names_its_plugin(fresh_registry, monkeypatch):
    """A first-party backend that is not installed: the message names its distribution."""
    monkeypatch.setattr(registry, "_load", lambda: {"reference": ReferenceBackend()})
    with pytest.raises(BackendNotFoundError, match=r"'ndarray': pip install qcore-ndarray provides it"):
        qcore.backend("ndarray")


def test_unavailable_backend_and_auto_skips_it(fresh_registry):
    registry.register(Offline())
    with pytest.raises(BackendUnavailableError, match=r"'offline' is installed but not available: no device found"):
        qcore.backend("offline")
    assert qcore.backend("auto").pick("q8s").name != "offline"
    with pytest.raises(BackendUnavailableError, match="not available"):
        Offline().quantize(np.float32([1]), "q8s")


def test_auto_picks_highest_priority_that_supports(fresh_registry):
    registry.register(Q8Only())
    auto = qcore.backend("auto")
    assert auto.pick("q8s/block32:f16").name == "q8only"
    assert auto.pick("q4s").name != "q8only"
    q = qcore.quantize(np.float32([1, 2, 3]), "q4s")
    assert q.backend.name != "q8only"


def test_env_var_selects(fresh_registry, monkeypatch):
    registry.register(Q8Only())
    monkeypatch.setenv("QCORE_BACKEND", "q8only")
    assert qcore.backend().name == "q8only"
    monkeypatch.setenv("QCORE_BACKEND", "reference")
    assert qcore.quantize(np.float32([1.0]), "q8s").backend.name == "reference"
    monkeypatch.delenv("QCORE_BACKEND")
    assert qcore.backend().name == "auto"


def test_unsupported_error_names_backend_scheme_reason_and_alternatives(fresh_registry):
    registry.register(Q8Only())
    be = qcore.backend("q8only")
    assert not be.supports("e4m3") and "not an 8-bit integer" in be.supports("e4m3").reason
    x = np.float32([1, 2])
    d = qcore.backend("reference").quantize(x, "q4s").to_data()
    calls = [
        lambda: be.quantize(x, "q4s"),
        lambda: be.calibrate(x, "q4s"),
        lambda: be.from_data(d),
    ]
    for call in calls:
        with pytest.raises(UnsupportedSchemeError,
                           match=r"backend 'q8only' does not support q4s: q4s is not an 8-bit integer value; "
                                 r"backends that do: .*reference"):
            call()


def test_unsupported_checked_before_touching_data(fresh_registry):
    registry.register(Q8Only())
    # the input is garbage, but the capability check comes first
    with pytest.raises(UnsupportedSchemeError):
        qcore.backend("q8only").quantize("not an array", "e2m1")


def test_qtensor_of_other_backend_is_refused(fresh_registry):
    registry.register(Q8Only())
    q = qcore.backend("reference").quantize(np.float32([1]), "q8s")
    with pytest.raises(InputError, match=r"lives on backend 'reference'; move it with q.to\('q8only'\)"):
        qcore.backend("q8only").dequantize(q)
    assert q.to("q8only").backend.name == "q8only"


def test_broken_plugin_is_isolated(fresh_registry, tmp_path, monkeypatch):
    """One plugin that fails to import is recorded; the others still load (pluggy's loader would abort)."""
    dist = tmp_path / "brokenplug-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: brokenplug\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[qcore]\nbrokenplug = brokenplug_mod\n")
    (tmp_path / "brokenplug_mod.py").write_text("raise RuntimeError('kaboom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "reference" in qcore.backends()
    assert "kaboom at import" in registry.plugin_errors()["brokenplug"]
    with pytest.raises(BackendNotFoundError, match="its plugin failed to load: RuntimeError: kaboom"):
        qcore.backend("brokenplug")


def test_plugin_returning_non_backend_is_reported(fresh_registry, tmp_path, monkeypatch):
    dist = tmp_path / "oddplug-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: oddplug\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[qcore]\noddplug = oddplug_mod\n")
    (tmp_path / "oddplug_mod.py").write_text(textwrap.dedent("""
        import qcore
        @qcore.hookimpl
        def qcore_register_backends():
            return [object()]
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "lacks name" in registry.plugin_errors()["oddplug"]


def test_duplicate_name_rejected(fresh_registry):
    with pytest.raises(ValueError, match="already taken"):
        registry.register(ReferenceBackend())


def test_base_backend_without_capability_declaration_is_an_error():
    class Bare(BaseBackend):
        name = "bare"

    with pytest.raises(TypeError, match="abstract method"):
        Bare()
