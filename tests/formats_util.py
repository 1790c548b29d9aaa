"""Helpers shared by tests/test_formats_*.py: bit-exact comparison and per-backend decoding."""
import numpy as np
import pytest

import qcore
from qcore import QuantizedData

BACKENDS = ["reference", "ndarray", "cuda"]


def get_backend(name: str, request) -> qcore.Backend:
    """The backend `name`; cuda through the conftest fixture (skips without the simulator, fails in CI)."""
    if name == "cuda":
        return request.getfixturevalue("cuda_backend")
    return qcore.backend(name)


def decode(d: QuantizedData, be) -> np.ndarray:
    """Dequantize portable bytes on `be` (skipping schemes it declares unsupported, with its reason)."""
    sup = be.supports(d.scheme)
    if not sup:
        pytest.skip(f"{be.name} does not support {d.scheme}: {sup.reason}")
    return be.to_numpy(be.dequantize(be.from_data(d)))


def assert_bits_equal(got: np.ndarray, want: np.ndarray, *, signed_zero: bool = True) -> None:
    """f32 values identical bit for bit; `signed_zero=False` counts -0.0 and +0.0 as one value."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape, (got.shape, want.shape)
    if not signed_zero:
        got, want = got + np.float32(0), want + np.float32(0)   # -0 + +0 = +0 (round to nearest)
    bad = got.view(np.uint32) != want.view(np.uint32)
    if bad.any():
        i = np.unravel_index(int(np.flatnonzero(bad)[0]), bad.shape)
        raise AssertionError(f"{int(bad.sum())} of {bad.size} values differ; first at {i}: "
                             f"qcore {got[i]!r} vs tool {want[i]!r}")
