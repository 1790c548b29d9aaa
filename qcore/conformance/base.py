"""pytest mixins and fixtures of the conformance suite, for qcore's backends and plugins alike.

Adopt the suite with two tiny files (see `docs/plugins.md`), pandas-style::

    # conftest.py
    import pytest

    @pytest.fixture
    def qcore_backend():
        from my_package import MyBackend
        return MyBackend()

    # test_conformance.py
    from qcore.conformance import ConformanceTests

    class TestMyBackend(ConformanceTests):
        pass

or fsspec-style, overriding the fixture on a subclass::

    class TestMyBackend(ConformanceTests):
        @pytest.fixture
        def backend(self):
            return MyBackend()

Required fixture: `backend` (or a conftest `qcore_backend`); until given, every test fails
loudly with "must be overridden". Optional fixtures: `reference`, `tolerances`, `peer_backends`,
`expected_support` (or a conftest `qcore_expected_support`). Collection-time knobs are class
attributes (parametrization happens before fixtures exist): `max_elements`, `max_schemes`,
`shapes_per_scheme`, `full`.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import pytest

from . import cases as C
from . import checks as K
from .plugin import OUTCOMES

__all__ = [
    "ConformanceFixtures",
    "BaseSchemeTests",
    "BaseBadInputTests",
    "BaseOpsTests",
    "BaseCrossBackendTests",
    "ConformanceTests",
    "installed_backend",
    "required_backends",
    "REQUIRE_BACKENDS_ENV",
    "REQUIRE_CUDA_ENV",
]

REQUIRE_BACKENDS_ENV = "QCORE_REQUIRE_BACKENDS"
"""Comma-separated backend names (or `all`) whose absence fails the suite instead of skipping."""
REQUIRE_CUDA_ENV = "QCORE_REQUIRE_CUDA"
"""`1`: a missing or unavailable `cuda` backend (or simulator) is a failure, not a skip."""


def required_backends() -> set[str]:
    """Names that must be installed and available ($QCORE_REQUIRE_BACKENDS, $QCORE_REQUIRE_CUDA)."""
    names = {n.strip() for n in os.environ.get(REQUIRE_BACKENDS_ENV, "").split(",") if n.strip()}
    if os.environ.get(REQUIRE_CUDA_ENV, "") not in ("", "0"):
        names.add("cuda")
    return names


def installed_backend(name: str):
    """The registered backend `name`, ready to use. When it is not installed, failed to load, or is
    installed but unavailable (no device), skip with that reason, or fail if `name` is required
    (see `required_backends`)."""
    from .. import registry

    required = name in required_backends() or "all" in required_backends()
    stop = pytest.fail if required else pytest.skip
    why = f" (required by ${REQUIRE_BACKENDS_ENV}/${REQUIRE_CUDA_ENV})" if required else ""
    reg = registry.registered()
    if name not in reg:
        err = registry.plugin_errors().get(name)
        detail = f"its plugin failed to load: {err}" if err else \
            f"not installed (installed: {', '.join(sorted(reg)) or 'none'})"
        stop(f"backend '{name}' {detail}{why}")
    be = reg[name]
    try:
        ok = bool(be.available())
    except Exception as e:  # noqa: BLE001
        stop(f"backend '{name}' raised {type(e).__name__} from available(): {e}{why}")
    if not ok:
        stop(f"backend '{name}' is installed but not available: {be.describe()}{why}")
    return be


def _opt(config, name: str, default=None):
    try:
        return config.getoption(name)
    except (ValueError, AttributeError):  # the plugin is not loaded (-p no:qcore_conformance)
        return default


def _cap(a, b):
    vals = [v for v in (a, b) if v is not None]
    return min(vals) if vals else None


def _subset(space: list, n: int | None) -> list:
    if n is None or n >= len(space):
        return space
    if n <= 0:
        return []
    step = len(space) / n
    return [space[int(i * step)] for i in range(n)]


def _record(request, outcome: K.Outcome) -> None:
    request.config.stash.setdefault(OUTCOMES, []).append(outcome)


class ConformanceFixtures:
    """Fixtures and knobs of the suite. Subclass it in your conftest and override `backend`."""

    max_elements: int | None = None
    """At most this many elements per tensor (e.g. 512 for a simulator); None: no cap."""
    max_schemes: int | None = None
    """Check an evenly spaced subset of this many schemes; None: the whole (sampled) space."""
    shapes_per_scheme: int | None = None
    """Shapes per scheme in the default run (default 2; --qcore-full: every shape)."""
    full: bool = False
    """Always run the whole space (as --qcore-full)."""

    # ------------------------------------------------------------------ fixtures
    @pytest.fixture
    def backend(self, request):
        """The backend under test (a `qcore.Backend`). Required: override it in a subclass, or
        define a `qcore_backend` fixture in your conftest.py."""
        try:
            return request.getfixturevalue("qcore_backend")
        except pytest.FixtureLookupError:
            pass
        raise NotImplementedError(
            f"{type(self).__name__}: the 'backend' fixture must be overridden: return the "
            "qcore Backend under test (e.g. `return MyBackend()` or "
            "`return qcore.conformance.installed_backend('name')`), or define a `qcore_backend` "
            "fixture in conftest.py")

    @pytest.fixture
    def reference(self):
        """The backend every result is compared with (default: qcore's `reference`)."""
        return K.reference_backend()

    @pytest.fixture
    def tolerances(self) -> K.Tolerances:
        """Tolerances of the ops checks (quantize/dequantize are always bit for bit)."""
        return K.Tolerances()

    @pytest.fixture
    def peer_backends(self, backend) -> list:
        """Other installed, available backends to exchange payloads with (default: every
        registered one but `reference` and the backend itself)."""
        from .. import registry

        out = []
        for name, be in sorted(registry.registered().items()):
            if name in ("reference", getattr(backend, "name", None)):
                continue
            try:
                if be.available():
                    out.append(be)
            except Exception:  # noqa: BLE001 - an unavailable peer is simply not a peer
                continue
        return out

    @pytest.fixture
    def expected_support(self, request) -> Callable[[Any], bool | None] | None:
        """Optional: `scheme -> bool` stating what the backend is meant to support, so a backend
        that wrongly refuses (or claims) a scheme fails. Default: a `qcore_expected_support`
        fixture from conftest.py if there is one, else None (trust `supports()`)."""
        try:
            return request.getfixturevalue("qcore_expected_support")
        except pytest.FixtureLookupError:
            return None

    # ------------------------------------------------------------------ parametrization
    def _settings(self, config) -> dict:
        return dict(
            full=bool(self.full or _opt(config, "qcore_full", False)),
            seed=int(_opt(config, "qcore_seed", 0) or 0),
            max_elements=_cap(self.max_elements, _opt(config, "qcore_max_elements")),
            max_schemes=_cap(self.max_schemes, _opt(config, "qcore_max_schemes")),
        )

    def pytest_generate_tests(self, metafunc) -> None:
        names = metafunc.fixturenames
        if "qcore_case" not in names and "qcore_scheme_case" not in names:
            return
        st = self._settings(metafunc.config)
        space = _subset(C.scheme_space(st["full"]), st["max_schemes"])
        if "qcore_case" in names:
            items = list(C.cases(st["full"], st["seed"], st["max_elements"], self.shapes_per_scheme,
                                 schemes=space))
            metafunc.parametrize("qcore_case", items, ids=[c.id for c in items])
        else:
            kind = getattr(metafunc.function, "qcore_kind", "bad-input")
            items = list(C.scheme_cases(kind, st["full"], st["seed"], st["max_elements"], schemes=space))
            metafunc.parametrize("qcore_scheme_case", items, ids=[c.id for c in items])


def _kind(kind: str):
    def mark(fn):
        fn.qcore_kind = kind
        return fn
    return mark


def _fail(outcome_or_exc) -> None:
    pytest.fail(str(outcome_or_exc), pytrace=False)


def _check(fn, *args) -> Any:
    """Run a check function; report its failure as one clean pytest failure line (outside the
    `except`, so no chained tracebacks)."""
    failure = None
    try:
        return fn(*args)
    except K.ConformanceFailure as f:
        failure = str(f)
    _fail(failure)


def _supported(backend, case) -> bool:
    return bool(_check(K.check_supports, backend, case.qscheme))


class BaseSchemeTests(ConformanceFixtures):
    """Every case: supported -> bit-for-bit with the reference; not supported -> refused."""

    def test_scheme(self, backend, reference, qcore_case, expected_support, request):
        outcome = K.check_case(backend, qcore_case, reference)
        if outcome.status != K.FAILED and expected_support is not None:
            want = expected_support(qcore_case.qscheme)
            if want is not None and bool(want) != (outcome.status == K.PASSED):
                outcome = K.Outcome(
                    K.FAILED, outcome.backend, outcome.scheme, "expected-support", outcome.case,
                    f"backend '{outcome.backend}' failed check 'expected-support' on "
                    f"{qcore_case.scheme}: supports() says {outcome.status == K.PASSED}, "
                    f"the adopter expects {bool(want)}")
        _record(request, outcome)
        if outcome.status == K.FAILED:
            _fail(outcome.message)


class BaseBadInputTests(ConformanceFixtures):
    """Bad input and bad payloads raise the SPEC §5 error types, never another exception."""

    @_kind("bad-input")
    def test_bad_input(self, backend, reference, qcore_scheme_case):
        if _supported(backend, qcore_scheme_case):
            _check(K.check_bad_inputs, backend, qcore_scheme_case, reference)
        else:  # unsupported comes first, even for bad input
            _check(K.check_rejected, backend, qcore_scheme_case, reference)


class BaseOpsTests(ConformanceFixtures):
    """reshape, permute, slice, cat and matmul against the reference within `tolerances`."""

    @_kind("ops")
    def test_ops(self, backend, reference, tolerances, qcore_scheme_case):
        if _supported(backend, qcore_scheme_case):
            _check(K.check_ops, backend, qcore_scheme_case, reference, tolerances)
        else:
            _check(K.check_rejected, backend, qcore_scheme_case, reference)


class BaseCrossBackendTests(ConformanceFixtures):
    """A payload made by one backend loads on every other installed backend that supports it."""

    @_kind("cross")
    def test_cross_backend(self, backend, peer_backends, reference, qcore_scheme_case):
        case = qcore_scheme_case
        if not _supported(backend, case):
            pytest.skip(f"'{backend.name}' does not support {case.scheme}; its refusal is checked by test_scheme")
        peers = [p for p in peer_backends if p.supports(case.qscheme)]
        if not peers:
            names = ", ".join(p.name for p in peer_backends) or "none"
            pytest.skip(f"no other installed backend supports {case.scheme} (peers: {names})")
        for peer in peers:
            _check(K.check_cross_backend, backend, peer, case, reference)


class ConformanceTests(BaseSchemeTests, BaseBadInputTests, BaseOpsTests, BaseCrossBackendTests):
    """The whole suite. Mix it with your fixtures class: `class TestX(ConformanceTests, XFixtures): pass`."""
