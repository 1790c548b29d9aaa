"""The conformance suite against qcore's own `reference` backend (bad input, ops, payloads;
bit-exactness against itself is trivially true but keeps the harness honest). It must support
every scheme of the space."""
import pytest

from qcore.conformance import ConformanceTests, installed_backend


class TestReference(ConformanceTests):
    @pytest.fixture
    def backend(self):
        return installed_backend("reference")

    @pytest.fixture
    def expected_support(self):
        return "*"  # every scheme (a pattern, see qcore.conformance.expect)
