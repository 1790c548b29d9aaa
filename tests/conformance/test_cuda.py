"""The conformance suite against the `cuda` backend (backends/cuda), which CI runs under Numba's
CUDA simulator: small tensors and one case per stratum keep it within minutes; run
`pytest tests/conformance/test_cuda.py --qcore-full` on a GPU for the whole space.
SPEC §4: it supports everything except LOOKUP."""
import pytest

from qcore.conformance import ConformanceTests, installed_backend


class TestCuda(ConformanceTests):
    max_elements = 320  # the simulator pays per launched thread
    cases_per_stratum = 1  # the grid case: still every supported stratum

    @pytest.fixture
    def backend(self):
        return installed_backend("cuda")

    @pytest.fixture
    def expected_support(self):
        return lambda s: not s.is_lookup
