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
`expected_support` (or a conftest `qcore_expected_support`). Knobs are class attributes:
`max_elements`, `max_schemes`, `cases_per_stratum`, `full`.

Why strata: pytest parametrizes at collection, before any fixture (so before the backend) exists.
The tests are therefore parametrized over the fixed strata of the scheme space (`sampling`), and
each test draws its concrete schemes at run time from what the backend's `supports()` says, so a
narrow backend gets every one of its (value, level kind, scale dtype, store kind) combinations
tested, and the test ids stay the same for every backend (`-k 'q8s/block:f32/native'`).
"""
from __future__ import annotations

import os
from typing import Any

import pytest

from qcore.conformance import cases as C
from qcore.conformance import checks as K
from qcore.conformance import sampling as S
from qcore.conformance.expect import as_expectation, per_backend
from qcore.conformance.plugin import OUTCOMES

__all__ = [
    "ConformanceFixtures",
    "BaseSchemeTests",
    "BaseBadInputTests",
    "BaseOpsTests",
    "BaseCrossBackendTests",
    "BaseInputKindTests",
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
    from qcore.backend import registry

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


def _record(request, outcome: K.Outcome) -> None:
    request.config.stash.setdefault(OUTCOMES, []).append(outcome)


def _check(fn, *args) -> Any:
    """Run a check function; report its failure as one clean pytest failure line (outside the
    `except`, so no chained tracebacks)."""
    failure = None
    try:
        return fn(*args)
    except K.ConformanceFailure as f:
        failure = str(f)
    pytest.fail(failure, pytrace=False)


class ConformanceFixtures:
    """Fixtures and knobs of the suite. Subclass it in your conftest and override `backend`."""

    max_elements: int | None = None
    """At most this many elements per tensor (e.g. 320 for a simulator); None: no cap."""
    max_schemes: int | None = None
    """Check an evenly spaced subset of this many strata (and groups); None: all of them."""
    cases_per_stratum: int | None = None
    """Supported cases per stratum in the default run (default 2, plus a classic input on every
    third stratum); 1 for a slow backend."""
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
        from qcore.backend import registry

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
    def expected_support(self, request) -> Any:
        """Optional: what the backend is meant to support, so a backend that wrongly refuses (or
        claims) a scheme fails: a `scheme -> bool` callable, scheme patterns (a string or a list,
        see `qcore.conformance.expect`), or `[]` / `"none"` for an empty support. Default: a
        `qcore_expected_support` fixture from conftest.py if there is one, else the
        `--qcore-expect` option, else None (trust `supports()`)."""
        try:
            return request.getfixturevalue("qcore_expected_support")
        except pytest.FixtureLookupError:
            pass
        items = _opt(request.config, "qcore_expect", None) or []
        if not items:
            return None
        name = str(getattr(request.getfixturevalue("backend"), "name", "?"))
        want = per_backend(items, [name] + [i.partition("=")[0].strip() for i in items if "=" in i])
        return want.get(name) if isinstance(want, dict) else want

    # ------------------------------------------------------------------ parametrization
    def _settings(self, config) -> S.Settings:
        return S.Settings(
            full=bool(self.full or _opt(config, "qcore_full", False)),
            seed=int(_opt(config, "qcore_seed", 0) or 0),
            max_elements=_cap(self.max_elements, _opt(config, "qcore_max_elements")),
            cases_per_stratum=self.cases_per_stratum,
        )

    def _max_schemes(self, config) -> int | None:
        return _cap(self.max_schemes, _opt(config, "qcore_max_schemes"))

    def pytest_generate_tests(self, metafunc) -> None:
        # Collection runs before any fixture exists, so the backend is unknown here: parametrize
        # over the fixed strata / groups; each test draws its schemes from `supports()`.
        names = metafunc.fixturenames
        n = self._max_schemes(metafunc.config)
        if "qcore_stratum" in names:
            items = S.strata_subset(n)
            metafunc.parametrize("qcore_stratum", items, ids=[s.id for s in items])
        if "qcore_group" in names:
            items = S.subset(S.groups(), n)
            metafunc.parametrize("qcore_group", items, ids=[s.id for s in items])


def _fail(outcome_or_exc) -> None:
    pytest.fail(str(outcome_or_exc), pytrace=False)


def _settle(request, outcomes: list[K.Outcome]) -> None:
    """Record the outcomes for the summary; fail with the first failure's line."""
    for o in outcomes:
        _record(request, o)
    failed = [o for o in outcomes if o.status == K.FAILED]
    if failed:
        more = f"\n(and {len(failed) - 1} more failing case(s) in this test)" if len(failed) > 1 else ""
        _fail(failed[0].message + more)


class BaseSchemeTests(ConformanceFixtures):
    """Every stratum: its candidates' `supports()` against the expectation; supported schemes
    bit for bit with the reference on separating inputs; refused ones refused correctly."""

    def test_scheme(self, backend, reference, qcore_stratum, expected_support, request):
        st = self._settings(request.config)
        _settle(request, S.check_stratum(backend, qcore_stratum, st, reference,
                                         as_expectation(expected_support)))

    def test_tested_something(self, backend, expected_support, request):
        """The run tests at least one supported scheme, unless the author declares an empty
        support."""
        st = self._settings(request.config)
        items = S.strata_subset(self._max_schemes(request.config))
        cands = [s for stratum in items for s in stratum.candidates]
        if S.supports_nothing(as_expectation(expected_support), cands):
            return
        for s in cands:
            if bool(_check(K.check_supports, backend, s)) and C.shapes_for(s, C.SHAPES, st.max_elements):
                return
        _fail(S.tested_nothing(str(getattr(backend, "name", "?")), [], len(items)).message)


class BaseBadInputTests(ConformanceFixtures):
    """Bad input and bad payloads raise the spec's error types (docs/spec.md, errors), never
    another exception."""

    def test_bad_input(self, backend, reference, qcore_group, request):
        _settle(request, S.check_group(backend, "bad-input", qcore_group, self._settings(request.config),
                                       reference))


class BaseOpsTests(ConformanceFixtures):
    """reshape, permute, slice, cat and matmul against the reference within `tolerances`."""

    def test_ops(self, backend, reference, tolerances, qcore_group, request):
        _settle(request, S.check_group(backend, "ops", qcore_group, self._settings(request.config),
                                       reference, tolerances))


class BaseCrossBackendTests(ConformanceFixtures):
    """A payload made by one backend loads on every other installed backend that supports it."""

    def test_cross_backend(self, backend, peer_backends, reference, qcore_group, request):
        outcomes = S.check_group(backend, "cross", qcore_group, self._settings(request.config),
                                 reference, peers=peer_backends)
        if not outcomes:
            names = ", ".join(p.name for p in peer_backends) or "none"
            pytest.skip(f"no scheme of {qcore_group.id} is supported by '{backend.name}' and a peer "
                        f"(peers: {names})")
        _settle(request, outcomes)


class BaseInputKindTests(ConformanceFixtures):
    """Inputs of other kinds: the maximum on the first / last element of the tensor and of every
    (edge) block, non-C-ordered views, every output dtype, a tensor past 2**20 elements."""

    def test_input_kinds(self, backend, reference, qcore_group, request):
        _settle(request, S.check_group(backend, "inputs", qcore_group, self._settings(request.config),
                                       reference))


class ConformanceTests(BaseSchemeTests, BaseBadInputTests, BaseOpsTests, BaseCrossBackendTests,
                       BaseInputKindTests):
    """The whole suite. Mix it with your fixtures class: `class TestX(ConformanceTests, XFixtures): pass`."""
