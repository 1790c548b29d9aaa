"""Adopting qcore's conformance suite, file 1 of 2: say which backend to check."""
import pytest

from qcore.conformance import ConformanceFixtures


class LutCpuFixtures(ConformanceFixtures):
    @pytest.fixture
    def backend(self):
        from qcore_lutcpu import LutCpuBackend

        return LutCpuBackend()

    @pytest.fixture
    def expected_support(self):
        return lambda scheme: scheme.is_lookup  # LOOKUP schemes only, all of them
