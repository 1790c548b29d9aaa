"""Per-tensor error statistics of a quantization: SQNR (dB) and max absolute error.

`tensor_stats(backend, x, q)` is the one entry point: a backend with an `error_stats(x, q)`
method computes them itself (on its device, fused with its dequantize); any other backend
dequantizes to host float32 and `error_stats` reduces in float32 chunks that stay in cache,
summing each chunk's dot products in float64 (as cheap as the dequantize itself).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from qcore.backend.protocol import QTensor

__all__ = ["error_stats", "tensor_stats", "sqnr_db"]

_CHUNK = 1 << 18  # elements per chunk: 1 MiB of float32, cache-sized


def sqnr_db(signal: float, noise: float) -> float:
    """10 log10(signal / noise); inf when the error is zero, -inf for a zero signal."""
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def error_stats(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(SQNR in dB, max |x - y|) of `y` approximating `x` (host arrays, any float dtype)."""
    xf = np.asarray(x).reshape(-1)
    yf = np.asarray(y).reshape(-1)
    signal = noise = 0.0
    max_err = 0.0
    buf = np.empty(min(_CHUNK, max(xf.size, 1)), dtype=np.float32)
    for i in range(0, xf.size, _CHUNK):
        xs = xf[i:i + _CHUNK]
        xs = xs if xs.dtype == np.float32 else xs.astype(np.float32)
        e = buf[:xs.size]
        np.subtract(yf[i:i + _CHUNK], xs, out=e, casting="unsafe")
        signal += float(np.dot(xs, xs))
        noise += float(np.dot(e, e))
        max_err = max(max_err, float(e.max()), -float(e.min()))
    return sqnr_db(signal, noise), max_err


def tensor_stats(backend: Any, x: Any, q: QTensor) -> tuple[float, float]:
    """(SQNR dB, max |err|) of QTensor `q` against its source `x`, at the backend's speed."""
    own = getattr(backend, "error_stats", None)
    if callable(own):
        return own(x, q)
    return error_stats(np.asarray(x), backend.to_numpy(backend.dequantize(q, np.float32)))
