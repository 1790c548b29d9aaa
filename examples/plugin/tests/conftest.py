"""Adopting qcore's conformance suite, file 1 of 2: which backend, and what it should support."""
import pytest


@pytest.fixture
def qcore_backend():
    from qcore_lutcpu import LutCpuBackend

    return LutCpuBackend()


@pytest.fixture
def qcore_expected_support():
    return lambda scheme: scheme.is_lookup  # every LOOKUP scheme, nothing else
