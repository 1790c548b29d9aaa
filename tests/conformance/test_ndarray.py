"""The conformance suite against the `ndarray` backend (backends/ndarray). By docs/spec.md,
backends, it supports Q8F and Q8S in every level, store and scale dtype, and rejects everything
else."""
import pytest

from qcore.conformance import ConformanceTests, installed_backend


class TestNdarray(ConformanceTests):
    @pytest.fixture
    def backend(self):
        return installed_backend("ndarray")

    @pytest.fixture
    def expected_support(self):
        return lambda s: s.value.value in ("q8f", "q8s") and not s.is_lookup
