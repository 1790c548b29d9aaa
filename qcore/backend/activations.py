"""Activations of a product with a quantized weight (`matmul`, `linear`): the float arrays a host
backend reads (x, bias), the result dtype, and the result handed back in the caller's array kind.

A host backend reads numpy arrays (float16, bfloat16 as `ml_dtypes.bfloat16`, float32, float64)
and torch CPU tensors (bfloat16 included, read without a copy where torch allows); it returns a
numpy array, or a torch tensor when x was one. docs/spec.md ("Products with a quantized
weight") fixes the arithmetic; this module only moves arrays.
"""
from __future__ import annotations

import sys
from typing import Any

import ml_dtypes
import numpy as np

from qcore.spec.checks import INPUT_DTYPES
from qcore.errors import InputError

__all__ = ["ACTIVATION_DTYPES", "product_dims", "host_array", "host_activation", "host_bias", "result_dtype",
           "in_callers_kind", "torch_dtype_as_numpy", "as_torch", "out_dtype", "write_out"]

ACTIVATION_DTYPES = INPUT_DTYPES
"""x, bias and result dtypes of `matmul` and `linear`: float16, bfloat16, float32, float64."""

_NAMES = "float16, bfloat16, float32 or float64"
_BF16 = np.dtype(ml_dtypes.bfloat16)


def _torch() -> Any:
    return sys.modules.get("torch")


_WEIGHT_FORM = {"matmul": "[K, N]", "linear": "[N, K] (out features, in features)"}


def product_dims(what: str, x_shape: tuple[int, ...], w_shape: tuple[int, ...]) -> tuple[int, int]:
    """(K, N) of `matmul` (w [K, N]) or `linear` (w [N, K]) for x of `x_shape` [..., K], or an
    `InputError` naming what does not fit."""
    if len(w_shape) != 2:
        raise InputError(f"{what} needs a 2-D weight {_WEIGHT_FORM[what]}, got shape {tuple(w_shape)}")
    k_, n_ = w_shape if what == "matmul" else w_shape[::-1]
    if len(x_shape) < 1:
        raise InputError(f"{what} needs x of rank >= 1, got a scalar")
    if x_shape[-1] != k_:
        raise InputError(f"{what} shapes do not fit: x {tuple(x_shape)} against a weight {_WEIGHT_FORM[what]} = "
                         f"{tuple(w_shape)}; x's last axis must be K = {k_}")
    return k_, n_


def _torch_cpu(t: Any, what: str) -> np.ndarray:
    """A torch CPU tensor as numpy over the same memory where torch allows (bfloat16 as
    `ml_dtypes.bfloat16` bits)."""
    torch = _torch()
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(_BF16)
    try:
        return t.numpy()
    except TypeError:
        raise InputError(f"{what} has torch dtype {t.dtype}; pass {_NAMES}") from None


def host_array(x: Any) -> Any:
    """A torch CPU tensor as a numpy array (as `host_activation` reads it); anything else, a torch
    tensor on a device included (a device backend reads those), as it is."""
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor) and x.device.type == "cpu":
        return _torch_cpu(x, "input")
    return x


def host_activation(x: Any, what: str = "x") -> tuple[np.ndarray, bool]:
    """(x as a host numpy array in its own dtype, whether it came as a torch tensor). A torch
    tensor on another device, a non-float array or an unreadable object is an `InputError`."""
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise InputError(f"{what} is a torch tensor on {x.device}; this backend reads host arrays: "
                             f"pass {what}.cpu(), or use a backend on that device")
        return _torch_cpu(x, what), True
    try:
        arr = np.asarray(x)
    except (ValueError, TypeError, RecursionError) as e:
        raise InputError(f"{what} is not a rectangular array of numbers ({e}); pass a numpy array") from None
    if arr.dtype not in ACTIVATION_DTYPES:
        raise InputError(f"{what} has dtype {arr.dtype}; products take {_NAMES} activations")
    return arr, False


def result_dtype(x_dtype: Any, dtype: Any) -> np.dtype:
    """The dtype of a product's result: `dtype` if given (one of `ACTIVATION_DTYPES`), else x's."""
    if dtype is None:
        return np.dtype(x_dtype)
    try:
        dt = np.dtype(dtype)
    except TypeError:
        torch = _torch()
        if torch is not None and isinstance(dtype, torch.dtype):
            dt = _BF16 if dtype == torch.bfloat16 else np.dtype(str(dtype).removeprefix("torch."))
        else:
            raise InputError(f"dtype={dtype!r} is not an array dtype; use {_NAMES}") from None
    if dt not in ACTIVATION_DTYPES:
        raise InputError(f"a product's result can be {_NAMES}, not {dt}")
    return dt


def host_bias(bias: Any, n: int) -> np.ndarray | None:
    """`bias` as host float32 [n] (None stays None): it is added to the f32 sums."""
    if bias is None:
        return None
    b, _ = host_activation(bias, "bias")
    if b.shape != (n,):
        raise InputError(f"bias has shape {b.shape}; linear with a weight of {n} output rows takes a bias of shape ({n},)")
    return b.astype(np.float32)


def in_callers_kind(y: np.ndarray, as_torch: bool) -> Any:
    """A host result as the caller passed x: a torch tensor over the same memory, or numpy."""
    if not as_torch:
        return y
    torch = _torch()
    y = np.ascontiguousarray(y)
    if y.dtype == _BF16:
        return torch.from_numpy(y.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(y)


def torch_dtype_as_numpy(dtype: Any) -> np.dtype | None:
    """The numpy dtype of a torch dtype (bfloat16 as `ml_dtypes.bfloat16`); None for anything
    that is not a torch dtype."""
    torch = _torch()
    if torch is None or not isinstance(dtype, torch.dtype):
        return None
    if dtype == torch.bfloat16:
        return _BF16
    return torch.empty(0, dtype=dtype).numpy().dtype


def as_torch(y: Any) -> Any:
    """A backend's array as a torch tensor over the same memory: a host numpy array on the CPU
    (`in_callers_kind`), a device array (`__cuda_array_interface__`) on its GPU."""
    if isinstance(y, np.ndarray):
        return in_callers_kind(y, True)
    torch = _torch()
    return torch.as_tensor(y, device="cuda")


def _host_out(out: Any, what: str) -> np.ndarray:
    """The caller's `out=` as a numpy array over its memory: a C-contiguous numpy array or torch
    CPU tensor, else an `InputError`."""
    torch = _torch()
    if torch is not None and isinstance(out, torch.Tensor):
        if out.device.type != "cpu":
            raise InputError(f"{what} out= is a torch tensor on {out.device}; this backend writes host arrays: "
                             "pass a CPU tensor or a numpy array, or use a backend on that device")
        if not out.is_contiguous():
            raise InputError(f"{what} out= must be C-contiguous")
        return _torch_cpu(out, f"{what} out=")
    if not isinstance(out, np.ndarray):
        raise InputError(f"{what} out= takes a numpy array or a torch CPU tensor on this backend, "
                         f"got {type(out).__name__}")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise InputError(f"{what} out= must be a writeable C-contiguous array")
    return out


def out_dtype(out: Any, what: str) -> np.dtype:
    """The numpy dtype of a host `out=` array (a torch bfloat16 tensor's as `ml_dtypes.bfloat16`)."""
    return _host_out(out, what).dtype


def write_out(y: Any, out: Any, what: str) -> Any:
    """A host result `y` (numpy, or torch on the CPU) written into the caller's `out=` (a
    C-contiguous numpy array or torch CPU tensor of y's size and dtype), which is returned; `y`
    itself when `out` is None. This is how a host backend takes `out=` (`qcore.BaseBackend`)."""
    if out is None:
        return y
    dst = _host_out(out, what)
    src = host_array(y)
    if dst.size != src.size or dst.dtype != src.dtype:
        raise InputError(f"{what} out= must hold the result's {src.size} {src.dtype} values (shape {src.shape}), "
                         f"got {dst.size} {dst.dtype} values (shape {dst.shape})")
    np.copyto(dst.reshape(src.shape), src)
    return out
