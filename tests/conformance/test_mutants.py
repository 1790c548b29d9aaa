"""Every deliberately broken backend in tests/mutants.py fails the conformance suite's DEFAULT run,
and the clean twins pass.

Both routes run the same per-stratum functions (`qcore.conformance.sampling.check_stratum` /
`check_group`), so every mutant goes through the runner behind `qcore conformance` (in process,
stopping at the first failure, a fraction of a second each), and one mutant per kind of failure
(codes, bytes, scales, bad input, expectation, a raising kernel, dequantize, input views) also goes through
pytest adoption (`-x`, about a second each), to keep this file well under a minute and a half.

The clean `full` twin is the reference maths re-assembled; its whole default run (like the
reference's, which CI runs through `qcore conformance`) takes about half a minute, so here it runs
on an evenly spaced subset of the strata."""
from __future__ import annotations

import textwrap

import pytest

from qcore.conformance import runner
from qcore.conformance.expect import parse_expect
from qcore.backend.protocol import Support
from qcore.backend.reference import ReferenceBackend
from tests.mutants import CLEAN, EXPECT, MUTANTS

IDS = [f"{model}-{bug}" for model, bug, _, _ in MUTANTS]
PYTEST_ROUTE = ("narrow-half-away", "narrow-big-endian-scales", "narrow-no-nonfinite-check",
                "narrow-refuses-expected", "full-claims-and-raises", "full-swapped-nibbles",
                "full-global-ignored", "full-round-up-off-by-one", "narrow-memory-order")


PRODUCT_BUGS = ("linear-", "act-")
"""Mutants of the products with a quantized weight (bug names starting so). The default run checks
`linear` in its `ops` groups, after every case stratum; their runs take those groups alone, the same
cases as in the whole run (each item draws its own from its index and the seed: `runner.plan`), so
each dies in under a second rather than after every stratum."""


@pytest.mark.parametrize(("model", "bug", "cls", "what"), MUTANTS, ids=IDS)
def test_runner_default_run_kills(model, bug, cls, what):
    product = bug.startswith(PRODUCT_BUGS)
    kinds = ("ops",) if product else runner.CHECK_KINDS
    report = runner.run([cls()], expect=parse_expect([EXPECT[model]]), max_failures=1, kinds=kinds)
    assert report.failed, f"{model} mutant '{bug}' ({what}) survived the default run ({', '.join(kinds)})"
    msg = report.failed[0].message
    assert f"backend '{cls.name}' failed check" in msg, msg
    if product:
        assert "failed check 'ops.linear" in msg, msg


@pytest.mark.parametrize(("model", "subset"), [("narrow", None), ("full", 60)])
def test_runner_clean_twin_passes(model, subset):
    be = CLEAN[model]()
    report = runner.run([be], expect=parse_expect([EXPECT[model]]), max_schemes=subset)
    assert report.ok, [o.message for o in report.failed[:3]]
    assert report.summary(be.name)[0] > 0


ADOPTION = '''
import pytest
from qcore.conformance import ConformanceTests
from tests.mutants import {cls}


class Test{cls}(ConformanceTests):
    max_schemes = {subset}

    @pytest.fixture
    def backend(self):
        return {cls}()

    @pytest.fixture
    def expected_support(self):
        return {expect!r}
'''


class _Failures:
    """pytest plugin: the failure text of every failed test."""

    def __init__(self):
        self.lines: list[str] = []

    def pytest_runtest_logreport(self, report):
        if report.failed:
            self.lines.append(str(report.longrepr))


def _pytest_route(tmp_path, cls: type, model: str, subset=None, stop_first=True) -> tuple[int, list[str]]:
    """Adopt the suite for `cls` in a fresh folder and run pytest in this process."""
    d = tmp_path / f"adopt_{cls.__name__.lower()}"
    d.mkdir()
    f = d / f"test_adopt_{cls.__name__.lower()}.py"
    f.write_text(textwrap.dedent(ADOPTION.format(cls=cls.__name__, expect=EXPECT[model], subset=subset)))
    rec = _Failures()
    args = [str(f), "-q", "-p", "no:cacheprovider", "--rootdir", str(d), "-W", "ignore"]
    rc = pytest.main(args + (["-x"] if stop_first else []), plugins=[rec])
    return int(rc), rec.lines


@pytest.mark.parametrize(("model", "bug", "cls", "what"),
                         [m for m, i in zip(MUTANTS, IDS) if i in PYTEST_ROUTE],
                         ids=[i for i in IDS if i in PYTEST_ROUTE])
def test_pytest_default_run_kills(tmp_path, model, bug, cls, what):
    rc, fails = _pytest_route(tmp_path, cls, model)
    assert rc == 1 and fails, f"{model} mutant '{bug}' ({what}) survived the pytest route"
    assert f"backend '{cls.name}' failed check" in fails[0], fails[0]


@pytest.mark.parametrize(("model", "subset"), [("narrow", None), ("full", 20)])
def test_pytest_clean_twin_passes(tmp_path, model, subset):
    rc, fails = _pytest_route(tmp_path, CLEAN[model], model, subset, stop_first=False)
    assert rc == 0, fails[:3]


class RefusesAll(ReferenceBackend):
    name = "refuses-all"

    def _supports(self, scheme):
        return Support.no("nothing is implemented yet")


def test_a_run_that_tested_nothing_fails_unless_declared_empty():
    report = runner.run([RefusesAll()], kinds=["case"], max_schemes=30)
    assert [o.check for o in report.failed] == ["tested-nothing"]
    assert "the run tested nothing" in report.failed[0].message
    assert runner.run([RefusesAll()], kinds=["case"], max_schemes=30, expect=parse_expect(["none"])).ok


def test_narrow_plugin_gets_every_supported_combination_tested():
    """The issue's narrow plugin: its two strata are tested by the default run (not 0 of 99)."""
    be = CLEAN["narrow"]()
    report = runner.run([be], kinds=["case"], expect=parse_expect([EXPECT["narrow"]]))
    passed = {o.scheme for o in report.outcomes if o.status == "passed"}
    assert any("/" not in s for s in passed) and any("block" in s for s in passed), passed


REFUSES_ALL = '''
import pytest
from qcore.conformance import ConformanceTests
from tests.conformance.test_mutants import RefusesAll


class TestRefusesAll(ConformanceTests):
    max_schemes = 12

    @pytest.fixture
    def backend(self):
        return RefusesAll()
'''


def test_pytest_route_fails_a_run_that_tested_nothing(tmp_path):
    f = tmp_path / "test_refuses_all.py"
    f.write_text(REFUSES_ALL)
    rec = _Failures()
    rc = pytest.main([str(f), "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), "-W", "ignore",
                      "-k", "tested_something"], plugins=[rec])
    assert rc == 1 and "the run tested nothing" in rec.lines[0], rec.lines
