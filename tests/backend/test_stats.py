"""The one error statistic (qcore.backend.stats.error_stats, Backend.error_stats): SQNR and max
|error| with float32 differences and float64 sums. The values a float32 sum of squares cannot hold
(|x| near 3e19: x**2 passes float32's 3.4e38) and NaN are the cases where implementations used
to differ; every backend gives the host's figures."""
import math

import numpy as np
import pytest

from qcore.backend.registry import AutoBackend
from qcore.backend.stats import error_stats, sqnr_db
from qcore.conformance import installed_backend


def _float64_figures(x, y):
    """The statistic in plain float64 numpy, from the float32 difference."""
    x32 = np.asarray(x, np.float32).reshape(-1)
    e = (np.asarray(y, np.float32).reshape(-1) - x32).astype(np.float64)
    return 10 * np.log10((x32.astype(np.float64) ** 2).sum() / (e ** 2).sum()), float(np.abs(e).max())


@pytest.mark.parametrize("magnitude", [3e19, 1e30, 3e38, 1e-25], ids=lambda m: f"{m:g}")
def test_squares_float32_cannot_hold_give_the_float64_figures(magnitude):
    """x**2 overflows float32 from |x| = 1.8e19 (and underflows below 1e-19); the sums are float64."""
    rng = np.random.default_rng(1)
    x = (rng.uniform(0.5, 1.0, 3000) * magnitude).astype(np.float32)
    y = (x * np.float32(1 - 2 ** -8)).astype(np.float32)
    sqnr, max_err = error_stats(x, y)
    want_sqnr, want_max = _float64_figures(x, y)
    assert math.isfinite(sqnr) and sqnr == pytest.approx(want_sqnr, abs=1e-9)
    assert max_err == want_max


def test_spans_more_than_one_chunk():
    rng = np.random.default_rng(2)
    x = rng.standard_normal(600_001).astype(np.float32)  # 2 full chunks of 2**18 and a partial one
    y = (x + rng.standard_normal(x.size).astype(np.float32) * 1e-3).astype(np.float32)
    sqnr, max_err = error_stats(x, y)
    want_sqnr, want_max = _float64_figures(x, y)
    assert sqnr == pytest.approx(want_sqnr, abs=1e-9) and max_err == want_max


@pytest.mark.parametrize("where", ["x", "y"])
@pytest.mark.parametrize("at", [0, 5, 299_999], ids=["first", "inside", "last-chunk"])
def test_a_nan_makes_both_figures_nan(where, at):
    x = np.linspace(-1, 1, 300_000, dtype=np.float32)
    y = x.copy()
    (x if where == "x" else y)[at] = np.nan
    sqnr, max_err = error_stats(x, y)
    assert math.isnan(sqnr) and math.isnan(max_err)


def test_zero_error_empty_and_zero_signal():
    x = np.float32([1, -2, 3])
    assert error_stats(x, x) == (math.inf, 0.0)
    assert error_stats(np.zeros(0, np.float32), np.zeros(0, np.float32)) == (math.inf, 0.0)
    assert error_stats(np.zeros(3, np.float32), x) == (-math.inf, 3.0)
    assert math.isnan(sqnr_db(math.nan, 1.0)) and math.isnan(sqnr_db(1.0, math.nan))


def test_arrays_of_different_sizes_are_refused():
    with pytest.raises(ValueError, match="one size, got 3 and 2"):
        error_stats(np.zeros(3), np.zeros(2))


@pytest.mark.parametrize("name", ["reference", "ndarray", "cuda"])
def test_every_backend_gives_the_host_figures_nan_included(name):
    """Backend.error_stats (the host default, ndarray's fused pass, cuda's kernel) gives the host
    statistic's figures; a NaN in x makes its max error NaN there too. `auto` forwards to the
    tensor's own backend."""
    be = installed_backend(name)
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((8, 64)) * 3e19).astype(np.float32)
    q = be.quantize(x, "q8s/block32:f32")
    sqnr, max_err = be.error_stats(x, q)
    want = error_stats(x, q.numpy())
    assert math.isfinite(sqnr) and sqnr == pytest.approx(want[0], abs=1e-6) and max_err == want[1]
    assert AutoBackend().error_stats(x, q) == (sqnr, max_err)
    bad = x.copy()
    bad[3, 7] = np.nan
    sqnr, max_err = be.error_stats(bad, q)
    assert math.isnan(sqnr) and math.isnan(max_err)
