"""`linear(x, w, act=e4m3/block{B}:f32)` (B >= K) on the cuda backend for a torch CUDA x where
torch's FP8 GEMM does not take the call (`fp8.run`: fewer rows, another weight, a bias, a result
of another dtype): x's codes on the weight-only kernels, each row's scale applied to its f32 sums
(docs/spec.md, quantized activations: a backend that multiplies codes by codes and applies the two
scales to the f32 sums is held to the bound against `xq`).

x is quantized per row as W8A8 quantizes it (`fp8.quantized_rows`: the bytes of
`quantize(x.float(), act)`; a bfloat16 x's row holding a non-finite value coded 0 under a NaN
scale); E4M3 codes are exact in bfloat16, so `linear(codes, w, dtype=float32)` takes the bfloat16
kernels of any weight (the decode kernel at one row, the tensor-core kernel, ...) and returns each
row's f32 sums with w's scales applied; `y = RN(sums * scale (+ bias))` in the result's dtype (x's
unless `dtype=`), one rounding from f32. Nothing waits for a bfloat16 x: a row with a NaN scale
gives NaN, bias included. Returns None (the caller takes the decoded path) unless x is a float16,
bfloat16 or float32 torch CUDA tensor on torch's current stream with at least one row, w a [N, K]
weight of this backend, a bias (if any) a torch tensor on x's device, the `act` scheme one E4M3
slot a row with f32 scales, torch has `float8_e4m3fn`, and there is no `out=`; or where
`quantize` refuses a float16 or float32 x (a non-finite value: the decoded path gives its rows
NaN)."""
from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np

from qcore.backend.activations import ACTIVATION_DTYPES
from qcore.backend.protocol import QTensor

from .. import _streams
from .fp8 import per_row_e4m3, quantized_rows
from .linear import torch_dtype

__all__ = ["run"]


def run(be: Any, x: Any, w: QTensor, bias: Any, act: Any, out: Any, dtype: Any, stream: Any) -> Any:
    """The product (module text), or None where this path does not apply."""
    from qcore.backend import act as _act

    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "float8_e4m3fn") or act is None or out is not None:
        return None
    if not (isinstance(x, torch.Tensor) and x.is_cuda and x.ndim >= 1
            and x.dtype in (torch.float16, torch.bfloat16, torch.float32)):
        return None
    if not isinstance(w, QTensor) or w.backend is not be or len(w.shape) != 2 or x.shape[-1] != w.shape[1]:
        return None
    k_ = int(w.shape[1])
    scheme = _act.act_scheme(be, act, "linear", k_)
    if not per_row_e4m3(scheme, k_, False):
        return None
    if bias is not None and not (isinstance(bias, torch.Tensor) and bias.device == x.device):
        return None
    lead = tuple(x.shape[:-1])
    m = math.prod(lead)
    if m == 0:
        return None
    s = _streams.resolve(stream, x)
    if s.handle != _streams.torch_handle(x.device.index):
        return None
    want = x.dtype
    if dtype is not None:
        try:
            dt = np.dtype(dtype)
        except TypeError:
            return None  # (the decoded path names the dtype)
        if dt not in ACTIVATION_DTYPES:
            return None
        want = torch_dtype(dt)
    codes, scales = quantized_rows(be, torch, x.reshape(m, k_), scheme, s, stream)
    if codes is None:
        return None
    sums = be.linear(codes.to(torch.bfloat16), w, dtype=np.float32, stream=stream)
    y = sums.mul_(scales.view(m, 1))
    if bias is not None:
        y = y.add_(bias.to(torch.float32))
    return y.to(want).view(*lead, int(w.shape[0]))

