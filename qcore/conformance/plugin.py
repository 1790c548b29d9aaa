"""pytest plugin of the qcore conformance suite (entry point `pytest11: qcore_conformance`).

Loaded by every pytest run in an environment where qcore is installed, so it stays inert unless
asked: it imports nothing heavy, defines no autouse fixtures, and only adds options, a report
header line when a `--qcore-*` option is given, and a summary when conformance tests ran.

Options:
  --qcore-backend NAME   backend for `pytest --pyargs qcore.conformance` (repeatable; default
                         `reference`). Adopters' own test classes name their backend in a fixture.
  --qcore-expect P       what the backend is meant to support (as `qcore conformance --expect`),
                         where the adopter defines no `expected_support` fixture.
  --qcore-full           every supported scheme on every shape, instead of the default draw.
  --qcore-seed N         seed of the random inputs (default 0).
  --qcore-max-elements N cap on elements per tensor (lowers a class's `max_elements`).
  --qcore-max-schemes N  N strata spread over the groups (lowers a class's `max_schemes`).
"""
from __future__ import annotations

import pytest

OUTCOMES = pytest.StashKey[list]()
"""Where conformance tests record `checks.Outcome`s for the terminal summary."""


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("qcore", "qcore conformance suite")
    group.addoption("--qcore-backend", action="append", default=[], metavar="NAME",
                    help="backend to check with `pytest --pyargs qcore.conformance` (repeatable; "
                         "default: reference)")
    group.addoption("--qcore-expect", action="append", default=[], metavar="PATTERNS",
                    help="what the backend is meant to support, as `qcore conformance --expect` takes it "
                         "(patterns, @FILE, none, NAME=PATTERNS); used where no expected_support "
                         "fixture is defined")
    group.addoption("--qcore-full", action="store_true", default=False,
                    help="run every supported scheme of the space on every shape (slow)")
    group.addoption("--qcore-seed", type=int, default=0, metavar="N",
                    help="seed of the conformance inputs (default 0)")
    group.addoption("--qcore-max-elements", type=int, default=None, metavar="N",
                    help="at most N elements per conformance tensor")
    group.addoption("--qcore-max-schemes", type=int, default=None, metavar="N",
                    help="check N strata spread over the groups (and an evenly spaced N groups)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "qcore_conformance: a test of the qcore conformance suite (qcore.conformance)")


def pytest_report_header(config: pytest.Config) -> str | None:
    opts = ("qcore_backend", "qcore_full", "qcore_max_elements", "qcore_max_schemes")
    if not any(config.getoption(o, None) for o in opts):
        return None
    names = config.getoption("qcore_backend") or ["reference"]
    mode = "full space" if config.getoption("qcore_full") else "default draw from supports()"
    return (f"qcore conformance: backend(s) {', '.join(names)}; {mode}; "
            f"seed {config.getoption('qcore_seed')}")


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    outcomes = config.stash.get(OUTCOMES, None)
    if not outcomes:
        return
    per: dict[str, dict[str, set]] = {}
    for o in outcomes:
        d = per.setdefault(o.backend, {"passed": set(), "rejected": set(), "failed": set()})
        d[o.status].add(o.scheme)
    terminalreporter.section("qcore conformance")
    for name in sorted(per):
        d = per[name]
        failed = d["failed"]
        passed = d["passed"] - failed
        rejected = d["rejected"] - failed - passed
        terminalreporter.write_line(
            f"{name}: {len(passed)} schemes supported and conforming, {len(rejected)} rejected "
            f"correctly (not supported), {len(failed)} failed")
