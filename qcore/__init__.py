"""qcore: tensor quantization schemes as data, one portable byte format, pluggable backends.

>>> import numpy as np, qcore
>>> q = qcore.quantize(np.linspace(-1, 1, 64, dtype=np.float32), "q4s/block32:f16", backend="reference")
>>> q.to_data().nbytes
36
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import numpy as np

from qcore._version import __version__
from qcore.errors import (
    BackendNotFoundError,
    BackendUnavailableError,
    DeviceMemoryError,
    InputError,
    InvalidDataError,
    QCoreError,
    SchemeError,
    StorageError,
    UnsupportedSchemeError,
)

if TYPE_CHECKING:  # the names of the annotations below
    from qcore.backend.protocol import Backend, QParams, QTensor
    from qcore.spec.schemes import QuantScheme

_HOMES = {
    **dict.fromkeys(["PRESETS", "BlockLevel", "Native", "PackedNative", "PackedU32", "QuantMode", "QuantScheme",
                     "QuantStore", "QuantValue", "ScaleDtype", "ScaleRound", "StoreKind", "TensorLevel", "scheme"],
                    "qcore.spec.schemes"),
    "QuantizedData": "qcore.spec.payload",
    **dict.fromkeys(["Backend", "QParams", "QTensor", "Support"], "qcore.backend.protocol"),
    "BaseBackend": "qcore.backend.base",
    "hookimpl": "qcore.backend.hookspecs",
    "backends": "qcore.backend.registry",
    "Recipe": "qcore.model.recipe",
}
"""Where each re-exported name lives. They are imported when first used (`__getattr__`), so that
importing one low module (`qcore.spec.schemes`, which runs this file first) does not import the
registry, the recipes or the files they need."""

__all__ = [
    "__version__",
    # schemes
    "QuantScheme", "QuantValue", "QuantMode", "QuantStore", "StoreKind", "ScaleDtype", "ScaleRound",
    "BlockLevel", "TensorLevel", "Native", "PackedU32", "PackedNative", "PRESETS", "scheme",
    # data and backends
    "QuantizedData", "QParams", "QTensor", "Support", "Backend", "BaseBackend", "hookimpl",
    "backend", "backends", "quantize", "dequantize", "calibrate", "matmul", "linear", "save", "load", "convert",
    # whole models
    "Recipe", "quantize_model", "quantize_dict", "dequantize_model",
    # errors
    "QCoreError", "SchemeError", "UnsupportedSchemeError", "InvalidDataError", "InputError",
    "BackendNotFoundError", "BackendUnavailableError", "StorageError", "DeviceMemoryError",
]


# `backend` is a function of the facade and the name of the `qcore.backend` package: the package is
# imported first, so that the import system (which sets a package as an attribute of its parent
# when it is first imported) never puts it in the function's place later.
importlib.import_module("qcore.backend")


def backend(name: str | None = None) -> Backend:
    """The backend called `name`; None -> `$QCORE_BACKEND`, else `auto` (`qcore.backend.registry.backend`)."""
    from qcore.backend.registry import backend as get

    return get(name)


def quantize(x: Any, scheme: QuantScheme | str, backend: str | Backend | None = None, *,
             params: QParams | None = None, method: str = "minmax") -> QTensor:
    """Quantize `x` on `backend` (None -> $QCORE_BACKEND, else auto)."""
    from collections.abc import Mapping

    from qcore.backend.protocol import Backend
    from qcore.backend.registry import backend as get

    if isinstance(x, Mapping):
        raise InputError("qcore.quantize takes one tensor, got a dict; for a state dict use "
                         "qcore.quantize_dict(tensors, recipe) (or quantize_model for files)")

    be = get(backend) if not isinstance(backend, Backend) else backend
    return be.quantize(x, scheme, params=params, method=method)


def calibrate(x: Any, scheme: QuantScheme | str, backend: str | Backend | None = None, *,
              method: str = "minmax") -> QParams:
    """Scales for `x` under `scheme` on `backend`."""
    from qcore.backend.protocol import Backend
    from qcore.backend.registry import backend as get

    be = get(backend) if not isinstance(backend, Backend) else backend
    return be.calibrate(x, scheme, method)


def dequantize(q: QTensor, dtype: Any = np.float32) -> Any:
    """Dequantize on the tensor's own backend."""
    from qcore.backend.protocol import QTensor

    if not isinstance(q, QTensor):
        raise InputError(f"dequantize takes a QTensor, got {type(q).__name__}")
    return q.dequantize(dtype)


def matmul(x: Any, w: QTensor, **options: Any) -> Any:
    """`x @ dequantize(w)` for x [..., K] and a quantized w [K, N], on w's backend (options:
    `Backend.matmul`'s: `dtype=`, `act=` (x quantized per row first; x may also be a QTensor;
    docs/spec.md, quantized activations), `out=` (an array to write the result into), `stream=` (a
    device's))."""
    from qcore.backend.protocol import QTensor

    if not isinstance(w, QTensor):
        raise InputError(f"matmul takes a QTensor weight, got {type(w).__name__}")
    return w.backend.matmul(x, w, **options)


def linear(x: Any, w: QTensor, bias: Any = None, **options: Any) -> Any:
    """`x @ dequantize(w).T + bias` for x [..., K] and a linear layer's quantized weight w [N, K]
    as checkpoints store it, on w's backend; the result has x's dtype unless `dtype=` says
    otherwise (`out=`, `stream=`: as for `matmul`). docs/spec.md, products with a quantized weight.
    `act=SCHEME` (e.g. `e4m3/block{K}:f32`, W8A8) multiplies by `dequantize(quantize(x, act))`;
    x may also be a QTensor of w's backend (docs/spec.md, quantized activations)."""
    from qcore.backend.protocol import QTensor

    if not isinstance(w, QTensor):
        raise InputError(f"linear takes a QTensor weight, got {type(w).__name__}")
    return w.backend.linear(x, w, bias, **options)


def save(path, tensors, metadata=None) -> None:
    """Write quantized and float tensors to a safetensors file (see `qcore.files.io`)."""
    from qcore.files.io import save as _save

    _save(path, tensors, metadata)


def load(path, backend: str | Backend | None = None):
    """Read a file written by `save`; quantized tensors land on `backend`."""
    from qcore.files.io import load as _load

    return _load(path, backend)


def quantize_model(src, dst=None, recipe=None, backend: str | Backend | None = None, **options):
    """Quantize a whole model (file, sharded directory, index, cached hub id, or a dict); see `qcore.model.api`."""
    from qcore.model.api import quantize_model as _quantize_model

    return _quantize_model(src, dst, recipe, backend, **options)


def quantize_dict(tensors, recipe=None, backend: str | Backend | None = None, **options):
    """Quantize an in-memory dict of arrays by a recipe: name -> QTensor or the array kept; see `qcore.model.api`."""
    from qcore.model.api import quantize_dict as _quantize_dict

    return _quantize_dict(tensors, recipe, backend, **options)


def dequantize_model(src, dst, dtype: Any = None, backend: str | Backend | None = None):
    """Dequantize a quantized file or checkpoint, to each tensor's source dtype by default; see `qcore.model.api`."""
    from qcore.model.api import dequantize_model as _dequantize_model

    return _dequantize_model(src, dst, dtype, backend)


def convert(src, dst, to: str, **options):
    """Convert a checkpoint between formats (see `qcore.formats.convert`): bytes rearranged where
    `to` holds a tensor exactly, re-quantized only with `requantize=SCHEME`, refused otherwise."""
    from qcore.formats import convert as _convert

    return _convert(src, dst, to, **options)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'qcore' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
