"""The conformance suite against the `cuda` backend (backends/cuda). By docs/spec.md, backends,
it supports everything except LOOKUP.

CI runs it under Numba's CUDA simulator, which pays per launched thread: small tensors, one case
per stratum, 12 strata and 12 groups keep it within minutes (tests/cuda/test_cuda_quantize.py runs
every value x level x store bit for bit there). On a GPU (`NUMBA_ENABLE_CUDASIM=0`) it runs
every stratum with the default cases; `--qcore-full` takes the whole space."""
import pytest

from qcore.conformance import ConformanceTests, installed_backend

from tests.cuda_cases import SIM


class TestCuda(ConformanceTests):
    max_elements = 320 if SIM else None
    cases_per_stratum = 1 if SIM else None  # the grid case
    max_schemes = 12 if SIM else None

    @pytest.fixture
    def backend(self):
        return installed_backend("cuda")

    @pytest.fixture
    def expected_support(self):
        return lambda s: not s.is_lookup
