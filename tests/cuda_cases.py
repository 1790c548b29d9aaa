"""Shared cases and byte-compare helpers of the cuda backend's tests (tests/test_cuda_*.py).

CI runs those tests on Numba's CUDA simulator (tests/conftest.py), with small tensors: the
simulator pays per launched thread. On a GPU (`NUMBA_ENABLE_CUDASIM=0`) the same tests also run
larger shapes. Test ids are the scheme text plus the shape, e.g. `q4s/block32:f16-(5, 70)`.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

import qcore


SIM = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")

INT_VALUES = ["q8f", "q8s", "q4f", "q4s", "q2f", "q2s"]
FLOAT_VALUES = ["e4m3", "e5m2", "e2m1"]
SCALE_DTYPES = ["f32", "f16", "bf16", "ue8m0", "ue4m3"]


def _levels():
    """Scale levels: per-tensor in every dtype, block32 in every dtype, a 2-D block, two-level."""
    out = [""] + [f"tensor:{d}" for d in SCALE_DTYPES if d != "f32"]
    out += [f"block32:{d}" for d in SCALE_DTYPES]
    out += ["block4x8:bf16", "block3:f32", "block16:ue4m3/tensor:f32", "block16:f16/tensor:f32"]
    return out


def _stores(value):
    if qcore.scheme(value).bits == 8:
        return [""]
    return ["", "packed_native", "packed_u32:1", "packed_native:1"]


def _schemes():
    out = []
    for v in INT_VALUES + FLOAT_VALUES:
        for lv in _levels():
            for st in _stores(v):
                out.append("/".join(p for p in (v, lv, st) if p))
    return out


SCHEMES = _schemes()
# Shapes, picked on purpose: ragged lengths (not multiples of 8, 16 or 32), partial edge blocks
# on every blocked axis, rank 1 to 4, a single element, and empty tensors (no launch at all).
SHAPES_A = [(5, 70), (3, 4, 33), (2, 3, 5, 17), (33, 9), (6, 40)]
SHAPES_B = [(70,), (1, 1), (0, 8), (3, 1), (7, 0, 3), (129,)]
# On a GPU the same schemes also run these (more than one wave of runs, odd extents).
SHAPES_GPU = [(257, 1031), (4, 33, 130)]


def _fits(shape, text):
    s = qcore.scheme(text)
    rank = len(shape)
    if s.block is not None and len(s.block.dims) > rank:
        return False
    return s.store.dim < rank


def _on_simulator(text: str) -> bool:
    """Whether a bit-exact case of `text` runs on the simulator: every 8-bit scheme; of the four
    stores of a sub-byte value at one level, two, the other two at the next level."""
    parts = text.split("/")
    stores = _stores(parts[0])
    if len(stores) == 1:
        return True
    store = parts[-1] if parts[-1] in stores else ""
    level = "/".join(parts[1:len(parts) - (1 if store else 0)])
    return (_levels().index(level) + stores.index(store)) % 2 == 0


def bit_exact_cases():
    """Every scheme on shapes of both lists, and on a GPU also the large ones. On the simulator,
    one shape each (the lists taking turns) and half of the sub-byte stores (`_on_simulator`)."""
    cases = []
    for i, text in enumerate(SCHEMES):
        if SIM and not _on_simulator(text):
            continue
        picks = [SHAPES_A[i % len(SHAPES_A)], SHAPES_B[i % len(SHAPES_B)]]
        if SIM:
            picks = picks[i % 2:i % 2 + 1]
        else:
            picks += SHAPES_GPU
        for shape in picks:
            if not _fits(shape, text):
                shape = (6, 40)
            cases.append(pytest.param(text, shape, id=f"{text}-{shape}"))
    return cases


def sample_x(shape, seed=0, scale=3.0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * scale).astype(np.float32)
    if x.size > 3:  # exact zeros, a tiny value and an exact tie to exercise rounding edges
        flat = x.reshape(-1)
        flat[0] = 0.0
        flat[1] = -0.0
        flat[2] = np.float32(1e-30)
    return x


def assert_same_bytes(got: bytes, want: bytes, what: str) -> None:
    """Bit-exact comparison; on failure: count of differing bytes, the first index, both values."""
    a, b = np.frombuffer(got, np.uint8), np.frombuffer(want, np.uint8)
    if a.shape != b.shape:
        pytest.fail(f"{what}: {a.size} bytes, reference has {b.size}")
    bad = np.flatnonzero(a != b)
    if bad.size:
        i = int(bad[0])
        pytest.fail(f"{what}: {bad.size} of {a.size} bytes differ; first at byte {i}: "
                    f"cuda 0x{a[i]:02x}, reference 0x{b[i]:02x}")


def assert_same_floats(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Equal bit patterns, except that any NaN equals any NaN (NaN codes of E4M3/E5M2)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    ub = {2: np.uint16, 4: np.uint32, 8: np.uint64}[got.dtype.itemsize]
    g, w = got.reshape(-1), want.reshape(-1)
    gn, wn = np.isnan(g.astype(np.float64)), np.isnan(w.astype(np.float64))
    bad = np.flatnonzero((g.view(ub) != w.view(ub)) & ~(gn & wn))
    if bad.size:
        i = int(bad[0])
        pytest.fail(f"{what}: {bad.size} of {g.size} values differ; first at flat index {i}: "
                    f"cuda {g[i]!r} (0x{int(g.view(ub)[i]):x}), reference {w[i]!r} (0x{int(w.view(ub)[i]):x})")


def assert_f32_sums(got, want, bound, what) -> None:
    """A matmul result against the f32 rounding of the f64 sum `want`: NaN and infinity where it
    has them (the same infinities), elsewhere within `bound` (the conformance suite's)."""
    fin = np.isfinite(want)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    np.testing.assert_array_equal(got[np.isinf(want)], want[np.isinf(want)])
    assert np.all(np.abs(got[fin] - want[fin]) <= bound[fin]), what


# ----------------------------------------------------------------------------- `linear` checks
def taken(name: str) -> int:
    """How often the cuda backend chose the path class `name` in this process (`paths.TAKEN`)."""
    from qcore_cuda.paths import TAKEN

    return TAKEN.get(name, 0)


def host(be, y):
    """A backend result as a host numpy array."""
    return y if isinstance(y, np.ndarray) else be.to_numpy(y)


def within_bound(x, W, b, y):
    """Assert `y` (x @ W.T + b in y's dtype) lies within docs/spec.md's products' bound."""
    from qcore.conformance.checks import product_bound

    exact, bound = product_bound(x, W, b, y.dtype)
    err = np.abs(y.astype(np.float64) - exact)
    assert (err <= bound).all(), f"max err {err.max()} (bound there {bound.flat[err.argmax()]})"


def bits(a):
    """The unsigned-integer view of a float array's elements (bit-for-bit compares)."""
    a = np.ascontiguousarray(a)
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])
