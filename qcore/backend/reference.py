"""The `reference` backend: the spec's arithmetic step by step in plain numpy (`qcore.spec.arithmetic`).

This backend is the executable form of the spec; every other backend is compared with it bit for
bit. It runs every valid scheme, slowly, on the CPU.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from qcore.spec import arithmetic
from qcore.spec.checks import raise_nonfinite, to_f32
from qcore.spec.payload import QuantizedData
from qcore.spec.features import ALL_FEATURES
from qcore.backend.base import BaseBackend
from qcore.backend.protocol import QParams, Support
from qcore.spec.schemes import QuantScheme

__all__ = ["ReferenceBackend"]


class ReferenceBackend(BaseBackend):
    """Every valid scheme, plain readable numpy on the CPU: the executable spec."""

    name = "reference"
    priority = 0
    scheme_features = ALL_FEATURES  # every extension of docs/spec.md (qcore.spec.arithmetic, qcore.spec.layout)
    packs_field_orders = True  # qcore.spec.layout packs every field order (docs/spec.md, field orders)

    def available(self) -> bool:
        return True

    def describe(self) -> str:
        return "plain numpy on the CPU, the executable form of the spec's arithmetic (slow, for checking)"

    def _supports(self, scheme: QuantScheme) -> Support:
        return Support.yes()

    def _calibrate(self, x: Any, scheme: QuantScheme, method: str) -> QParams:
        x = to_f32(x)
        raise_nonfinite(x)
        return arithmetic.calibrate(x, scheme, method)

    def _quantize(self, x: Any, scheme: QuantScheme, params: QParams | None, method: str):
        return arithmetic.quantize(x, scheme, params, method)

    def _dequantize(self, data: QuantizedData, dtype: np.dtype) -> np.ndarray:
        return arithmetic.dequantize(data).astype(dtype)

    def _from_data(self, data: QuantizedData) -> QuantizedData:
        return data

    def _into_data(self, data: QuantizedData) -> QuantizedData:
        return data

    def to_numpy(self, array: Any) -> np.ndarray:
        return np.asarray(array)
