"""Quantized activations of a product (docs/spec.md, quantized activations):
`linear(x, w, act=SCHEME)` and `matmul(x, w, act=SCHEME)` multiply the weight by
`dequantize(quantize(x, act))`, and a QTensor x by its decoded value. This module holds the rules
(which schemes an `act` may be, what a QTensor x must be); `BaseBackend` and the device backends
compose the backend's own quantize, dequantize and product (`matmul`, `linear`) around them.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from qcore.errors import InputError, SchemeError, UnsupportedSchemeError
from qcore.backend.activations import product_dims
from qcore.backend.protocol import QTensor, require_support
from qcore.spec.schemes import QuantScheme, scheme as parse_scheme

__all__ = ["act_scheme", "finite_rows", "given_x", "nan_rows"]


def _across_rows(scheme: QuantScheme) -> str | None:
    """Why `scheme` would let one row of x change another row's quantized values, or None: its
    every scale slot must lie in one row (a single block dim along the last axis)."""
    if scheme.block is None:
        return "per tensor (one scale over every row of x)"
    if scheme.tensor is not None:
        return "with a tensor-level global scale over every row of x (two-level)"
    if scheme.block.flat:
        return "in blocks over the flattened tensor (:flat), which cross rows"
    if len(scheme.block.dims) != 1:
        return f"in {len(scheme.block.dims)}-D blocks {list(scheme.block.dims)}, which span rows"
    return None


def act_scheme(be: Any, act: Any, what: str, k: int) -> QuantScheme:
    """`act` parsed and checked for a `what` product of reduction length `k` on backend `be`: its
    scale slots lie in single rows of x (else `SchemeError`) and `be` runs it (else
    `UnsupportedSchemeError` naming the backends that do)."""
    scheme = parse_scheme(act)
    why = _across_rows(scheme)
    if why is not None:
        raise SchemeError(f"{what} act={scheme} quantizes x {why}; a product's activations take "
                          f"blocks along K inside each row, e.g. e4m3/block{k}:f32 (one scale per row)")
    try:
        return require_support(be, scheme)
    except UnsupportedSchemeError as e:
        raise UnsupportedSchemeError(f"{what} act={scheme}: {e}") from None


def finite_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """(x with every row holding a NaN or an infinity set to zeros, a boolean mask over x's rows
    marking them, or None where every value is finite): what `act` quantizes of a non-finite x,
    whose rows then give NaN (docs/spec.md, quantized activations; `nan_rows`)."""
    finite = np.isfinite(x)
    if finite.all():
        return x, None
    bad = ~finite.all(axis=-1)
    return np.where(bad[..., None], np.zeros((), x.dtype), x), bad


def nan_rows(xd: np.ndarray, bad: np.ndarray | None) -> np.ndarray:
    """The decoded x `xd` with the rows `finite_rows` marked set to NaN (a copy), so that each of
    their results is NaN; `xd` itself where none is marked."""
    if bad is None:
        return xd
    out = np.array(xd, copy=True)
    out[bad] = np.nan
    return out


def given_x(be: Any, what: str, x: QTensor, w_shape: tuple[int, ...], act: Any) -> QTensor:
    """A QTensor x of a `what` product on backend `be`, checked: on `be` (else `q.to(...)`), its
    last axis K of the weight `w_shape`, and `act`, if given, its own scheme."""
    if x.backend is not be and x.backend.name != be.name:
        raise InputError(f"{what}'s quantized x lives on backend '{x.backend.name}'; move it with x.to('{be.name}')")
    product_dims(what, x.shape, w_shape)
    if act is not None and parse_scheme(act) != x.scheme:
        raise InputError(f"{what} x is already quantized as {x.scheme}, not act={parse_scheme(act)}; "
                         "leave act= out for a quantized x")
    return be._own(x)
