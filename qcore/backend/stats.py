"""The error statistic of a quantization: SQNR (dB) and max absolute error, one definition.

`error_stats(x, y)` is it, on host arrays: x read as float32 (as every backend reads its input),
e = y - x in float32, the sums of x**2 and e**2 in float64 (no overflow for any float32 input), and
max |e| with NaN propagated (a NaN in x or y makes the max error NaN, and the SQNR NaN). It reads
cache-sized chunks, so it costs about as much as the dequantize itself.

`Backend.error_stats(x, q)` gives these figures for a QTensor: `BaseBackend`'s default
dequantizes to the host and calls `error_stats`; ndarray and cuda compute the same sums in one
fused pass (float32 e, float64 sums), so their results differ from the host's only in the order
of the additions. `qcore.quantize_model`, `qcore.convert(requantize=)` and the CLI report them.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["error_stats", "sqnr_db"]

_CHUNK = 1 << 18  # elements per chunk: 1 MiB of float32, cache-sized


def sqnr_db(signal: float, noise: float) -> float:
    """10 log10(signal / noise); inf when the error is zero, -inf for a zero signal, NaN when
    either sum is NaN."""
    if math.isnan(signal) or math.isnan(noise):
        return math.nan
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def error_stats(x: Any, y: Any) -> tuple[float, float]:
    """(SQNR in dB, max |y - x|) of `y` approximating `x` (host arrays of one size, any float
    dtype): float32 differences, float64 sums, NaN propagated (module docstring)."""
    xf = np.asarray(x).reshape(-1)
    yf = np.asarray(y).reshape(-1)
    if xf.size != yf.size:
        raise ValueError(f"error_stats compares arrays of one size, got {xf.size} and {yf.size} elements")
    n = min(_CHUNK, max(xf.size, 1))
    e, wide = np.empty(n, np.float32), np.empty(n, np.float64)
    signal = noise = 0.0
    max_err = np.float32(0.0)
    for i in range(0, xf.size, _CHUNK):
        xs = xf[i:i + _CHUNK].astype(np.float32, copy=False)
        m = xs.size
        np.subtract(yf[i:i + _CHUNK], xs, out=e[:m], casting="unsafe")
        signal += float(np.multiply(xs, xs, out=wide[:m], dtype=np.float64).sum())  # squares in float64
        noise += float(np.multiply(e[:m], e[:m], out=wide[:m], dtype=np.float64).sum())
        max_err = np.maximum(max_err, np.max(np.abs(e[:m], out=e[:m])))  # np.maximum keeps a NaN
    return sqnr_db(signal, noise), float(max_err)

