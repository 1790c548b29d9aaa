"""Input checks shared by every backend (docs/spec.md, arithmetic): dtypes, finiteness, explicit parameters."""
from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from qcore.errors import InputError

__all__ = [
    "INPUT_DTYPES",
    "OUTPUT_DTYPES",
    "check_input_dtype",
    "check_output_dtype",
    "to_f32",
    "first_nonfinite",
    "raise_nonfinite",
    "check_finite",
]

INPUT_DTYPES = tuple(np.dtype(t) for t in (np.float16, ml_dtypes.bfloat16, np.float32, np.float64))
"""Inputs qcore quantizes; each is converted to float32 first."""
OUTPUT_DTYPES = INPUT_DTYPES
"""Dtypes `dequantize(..., dtype=)` can return."""

_NAMES = "float16, bfloat16, float32 or float64"


def check_input_dtype(dtype: Any) -> np.dtype:
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise InputError(f"input dtype {dtype!r} is not an array dtype; quantize {_NAMES} arrays") from None
    if dt not in INPUT_DTYPES:
        raise InputError(f"input dtype {dt} cannot be quantized; convert to {_NAMES} first")
    return dt


def check_output_dtype(dtype: Any) -> np.dtype:
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise InputError(f"output dtype {dtype!r} is not an array dtype; use {_NAMES}") from None
    if dt not in OUTPUT_DTYPES:
        raise InputError(f"cannot dequantize to {dt}; use {_NAMES}")
    return dt


def to_f32(x: Any) -> np.ndarray:
    """A host array of a supported float dtype, converted to float32 (a no-op for float32)."""
    if not isinstance(x, np.ndarray) and hasattr(x, "__array__") is False and not isinstance(x, (list, tuple)):
        raise InputError(f"cannot quantize a {type(x).__name__}; pass a numpy array")
    try:
        arr = np.asarray(x)
    except (ValueError, TypeError, RecursionError) as e:  # ragged or mixed nested lists
        raise InputError(f"input is not a rectangular array of numbers ({e}); pass a numpy array") from None
    check_input_dtype(arr.dtype)
    if arr.ndim < 1:
        raise InputError("tensors need rank >= 1, got a scalar; reshape it to (1,)")
    with np.errstate(over="ignore"):  # float64 beyond the f32 range becomes inf: reported as such
        return arr.astype(np.float32, copy=False)


def first_nonfinite(x: np.ndarray) -> tuple[int, ...] | None:
    """Index of the first NaN or ±Inf in row-major order, or None."""
    bad = ~np.isfinite(x)
    if not bad.any():
        return None
    flat = int(np.flatnonzero(bad.reshape(-1))[0])
    return tuple(int(i) for i in np.unravel_index(flat, x.shape))


def raise_nonfinite(x: np.ndarray) -> None:
    """Raise `InputError` naming the first non-finite element of host array `x`."""
    idx = first_nonfinite(x)
    if idx is not None:
        v = x[idx]
        raise InputError(
            f"input has {v} at index {idx}; quantization needs finite values: replace or mask them first"
        )


check_finite = raise_nonfinite
