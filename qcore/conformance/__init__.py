"""qcore's conformance suite: a scheme means the same bytes on every backend.

It checks a backend against the `reference` backend (the executable SPEC) over an enumerated
scheme space (every value x mode x level x store, see `cases.py`), cut into strata from which each
run draws the schemes the backend says it supports (`sampling.py`), on inputs built to separate
every plausible kernel mistake (`inputs.py`), optionally against what its author expects it to
support (`expect.py`):

- **supported** schemes: `calibrate`, `quantize` (calibrated and explicit params), `dequantize`,
  `into_data`, `from_data` agree with the reference bit for bit, and runs are deterministic;
- **unsupported** schemes: every entry point raises `UnsupportedSchemeError` and touches nothing;
  "not supported" is its own outcome, not a failure (like ggml's test-backend-ops); a scheme
  that uses a feature beyond SPEC v1 the backend does not declare (`BaseBackend.scheme_features`)
  is one of these;
- **bad input / bad payloads** raise the spec's error types (docs/spec.md, errors) and nothing else;
- **ops** (reshape, permute, slice, cat, matmul) match the reference within `Tolerances`;
- **cross-backend**: a payload made by one backend loads on every other that supports it.

Three ways to run it:

1. From your own tests (pytest), like pandas' extension tests and fsspec's abstract tests::

       @pytest.fixture                                 # conftest.py
       def qcore_backend():
           return MyBackend()

       from qcore.conformance import ConformanceTests  # test_conformance.py
       class TestMine(ConformanceTests):
           pass

   (or override the `backend` fixture on the class; see `base.py` and docs/plugins.md).

   Knobs for slow backends (class attributes): `max_elements`, `max_schemes`,
   `cases_per_stratum`, `full`. Optional fixtures: `expected_support` (or a conftest
   `qcore_expected_support`), `tolerances`,
   `peer_backends`, `reference`. Options: `--qcore-full`, `--qcore-seed N`,
   `--qcore-max-elements N`, `--qcore-max-schemes N`.
2. Against installed backends by name: `pytest --pyargs qcore.conformance --qcore-backend NAME`.
3. Without pytest, with a capability matrix: `qcore conformance --backend NAME [--expect ...]
   [--full] [--seed N]` (`qcore.conformance.runner.main(argv)`), or the functions in `checks`
   directly; `assert_same_array` / `assert_same_bytes` / `assert_same_data` report a mismatch as
   the suite does (first differing element, or byte offset and payload section).

In CI, `QCORE_REQUIRE_BACKENDS=a,b` (or `all`) and `QCORE_REQUIRE_CUDA=1` turn "backend not
installed / not available" from a skip into a failure (`installed_backend`).
"""
from __future__ import annotations

from typing import Any

__all__ = [
    # pytest side (imports pytest when first used)
    "ConformanceFixtures", "ConformanceTests", "BaseSchemeTests", "BaseBadInputTests",
    "BaseOpsTests", "BaseCrossBackendTests", "BaseInputKindTests", "installed_backend", "required_backends",
    # plain functions
    "Case", "cases", "scheme_space", "check_case", "check_supported", "check_rejected",
    "check_bad_inputs", "check_ops", "check_cross_backend", "ConformanceFailure", "Outcome",
    "Tolerances", "PASSED", "REJECTED", "FAILED",
    # byte-compare helpers for plugin authors' own tests (ConformanceFailure on a mismatch)
    "assert_same_array", "assert_same_bytes", "assert_same_data",
    # what to test: strata drawn from supports(), the author's expectation
    "Stratum", "strata", "groups", "Expectation", "parse_expect", "scheme_label",
]

_WHERE = {
    **{n: "base" for n in ("ConformanceFixtures", "ConformanceTests", "BaseSchemeTests",
                           "BaseBadInputTests", "BaseOpsTests", "BaseCrossBackendTests", "BaseInputKindTests",
                           "installed_backend", "required_backends")},
    **{n: "cases" for n in ("Case", "cases", "scheme_space")},
    **{n: "checks" for n in ("check_case", "check_supported", "check_rejected", "check_bad_inputs",
                             "check_ops", "check_cross_backend", "ConformanceFailure", "Outcome",
                             "Tolerances", "PASSED", "REJECTED", "FAILED", "assert_same_array",
                             "assert_same_bytes", "assert_same_data")},
    **{n: "sampling" for n in ("Stratum", "strata", "groups")},
    **{n: "expect" for n in ("Expectation", "parse_expect", "scheme_label")},
}


def __getattr__(name: str) -> Any:  # lazy: `qcore.conformance.plugin` must import cheaply
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'qcore.conformance' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".{mod}", __name__), name)


def __dir__() -> list[str]:
    return sorted(__all__)
