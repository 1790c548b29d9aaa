"""The suite as shipped: `pytest --pyargs qcore.conformance --qcore-backend NAME` (repeatable;
default `reference`) checks installed backends by name, exactly as their own adoption files do."""
from __future__ import annotations

import pytest

from qcore.conformance.base import ConformanceFixtures, ConformanceTests, installed_backend


class CommandLineFixtures(ConformanceFixtures):
    """The backend comes from --qcore-backend."""

    def pytest_generate_tests(self, metafunc):
        if "qcore_backend_name" in metafunc.fixturenames:
            try:
                names = metafunc.config.getoption("qcore_backend") or ["reference"]
            except ValueError:  # plugin disabled: check the reference
                names = ["reference"]
            metafunc.parametrize("qcore_backend_name", names, scope="class")
        super().pytest_generate_tests(metafunc)

    @pytest.fixture
    def backend(self, qcore_backend_name):
        return installed_backend(qcore_backend_name)


class TestConformance(ConformanceTests, CommandLineFixtures):
    pass
