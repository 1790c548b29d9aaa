"""W8A8 `linear` on the cuda backend: an e4m3 weight times e4m3 activations, code by code, on
torch's FP8 GEMM (`torch._scaled_mm`), the two per-row scales applied to the f32 sums in its
epilogue (docs/spec.md, quantized activations: the FP8 accumulator rule).

`run` serves `linear(x, w, act=e4m3/block{B}:f32)` (B >= K: one f32 scale per row of x), or x a
QTensor of such a scheme on this backend, and returns None (the caller takes the decoded path of
quantized activations) unless all of these hold:

* w is e4m3 `[N, K]`, codes one per byte, with one f32 scale per row (blocks along K of at
  least K) or one for the tensor;
* x is a torch CUDA tensor (float16, bfloat16 or float32) on torch's current stream, or such a
  QTensor, with at least `linear_paths.LIBRARY_FROM_M` rows;
* the result is bfloat16 (x's dtype, or `dtype=`), there is no bias and no `out=`;
* K and N are multiples of 16 (the FP8 GEMM's alignment) and torch has `_scaled_mm` and
  `float8_e4m3fn`.

x is quantized with the spec's arithmetic (the same codes and scales every backend gives): a
C-contiguous bfloat16 x by Triton where it is installed (`act_rows`, codes and scales straight into
torch tensors), else by the backend's own kernel (a bfloat16 x read as it is,
`paths.quantize.quantize_bf16_rows`). Nothing waits for
x's non-finite flag: a row of x holding a NaN or an infinity gets a NaN scale, so its results are
NaN, as the spec's quantized activations want (a float16 or float32 x quantized by `quantize`, which
refuses it, goes to the decoded path, which does the same). Both payloads are read in place as torch
tensors: the codes as `float8_e4m3fn` [M, K] and [N, K] (the weight's transpose is the column-major
operand `_scaled_mm` wants), the scales as f32 [M, 1] and [1, N]. `use_fast_accum=True` (`FAST_ACCUM`):
the tensor core's own sums, never promoted to f32 along K, which is what the spec's FP8 accumulator
rule bounds (each group of 32 products cut to 14 bits, the running sum kept with 13 fraction bits).
"""
from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np

from qcore.errors import InputError
from qcore.spec.payload import sections
from qcore.backend.protocol import QTensor
from qcore.spec.schemes import QuantScheme, QuantValue, ScaleDtype, StoreKind, scheme as parse_scheme

from .. import _streams, act_rows
from .quantize import quantize_bf16_rows

__all__ = ["FAST_ACCUM", "per_row_e4m3", "quantized_rows", "run"]

FAST_ACCUM = True
"""`_scaled_mm`'s `use_fast_accum`: True keeps the FP8 tensor core's sums as they are (the FP8
accumulator rule of docs/spec.md bounds them); False has cuBLAS promote them to f32 every few
groups (inside the same bound, slower: docs/performance.md)."""


def per_row_e4m3(scheme: QuantScheme, k: int, per_tensor: bool) -> bool:
    """Whether `scheme` holds e4m3 codes one per byte with one f32 scale per row of K elements
    (or, where `per_tensor`, one scale for the tensor)."""
    if scheme.value is not QuantValue.E4M3 or scheme.affine or scheme.two_level or scheme.is_lookup:
        return False
    if scheme.store.kind is not StoreKind.NATIVE or scheme.slot_dtype is not ScaleDtype.F32:
        return False
    b = scheme.block
    if b is None:
        return per_tensor
    return not b.flat and all(d == 1 for d in b.dims[:-1]) and b.dims[-1] >= k


def _torch_bytes(torch: Any, payload: Any, start: int, nbytes: int) -> Any:
    """Bytes [start, start + nbytes) of a device payload as a torch uint8 tensor (no copy)."""
    return torch.as_tensor(payload, device="cuda")[start:start + nbytes]


def _operands(torch: Any, q: QTensor, rows: int, k: int) -> tuple[Any, Any]:
    """(codes as float8_e4m3fn [rows, k], scales as f32 [rows]) of a per-row (or per-tensor) e4m3
    QTensor on the cuda backend, over its payload."""
    sec = sections(q.shape, q.scheme)
    payload = q.data.payload
    codes = _torch_bytes(torch, payload, 0, rows * k).view(torch.float8_e4m3fn).view(rows, k)
    scales = _torch_bytes(torch, payload, sec.values, sec.scales).view(torch.float32)
    return codes, (scales.expand(rows).contiguous() if scales.numel() == 1 else scales)


def run(be: Any, x: Any, w: QTensor, bias: Any, act: Any, out: Any, dtype: Any, stream: Any) -> Any:
    """The W8A8 product (module text), or None where it does not apply."""
    from qcore.backend import act as _act

    from .linear import LIBRARY_FROM_M

    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
        return None
    if bias is not None or out is not None or not isinstance(w, QTensor) or w.backend is not be:
        return None
    if len(w.shape) != 2 or w.data.shape != w.shape:
        return None
    n_, k_ = w.shape
    if k_ % 16 or n_ % 16 or not per_row_e4m3(w.scheme, k_, per_tensor=True):
        return None
    given = isinstance(x, QTensor)
    want = None if dtype is None else np.dtype(dtype)
    if given:
        if x.backend is not be or x.ndim < 1 or x.shape[-1] != k_ or not per_row_e4m3(x.scheme, k_, False):
            return None
        if act is not None and parse_scheme(act) != x.scheme:
            return None  # (the decoded path names the mismatch)
        lead = x.shape[:-1]
    else:
        if not (isinstance(x, torch.Tensor) and x.is_cuda and x.dtype in (torch.float16, torch.bfloat16, torch.float32)):
            return None
        if act is None or x.ndim < 1 or x.shape[-1] != k_:
            return None
        scheme = _act.act_scheme(be, act, "linear", k_)
        if not per_row_e4m3(scheme, k_, False):
            return None
        if want is None and x.dtype != torch.bfloat16:
            return None
        lead = tuple(x.shape[:-1])
    if want is not None and want.name != "bfloat16":
        return None
    m = math.prod(lead)
    if m < LIBRARY_FROM_M:
        return None
    device = torch.device("cuda", torch.cuda.current_device()) if given else x.device
    s = _streams.resolve(stream, None if given else x)
    if s.handle != _streams.torch_handle(device.index):
        return None
    w = be.own(w)
    b, sb = _operands(torch, w, n_, k_)
    if given:
        a, sa = _operands(torch, be.own(x), m, k_)
    else:
        a, sa = quantized_rows(be, torch, x.reshape(m, k_), scheme, s, stream)
        if a is None:
            return None
    y = torch._scaled_mm(a, b.t(), scale_a=sa.view(m, 1), scale_b=sb.view(1, n_), out_dtype=torch.bfloat16,
                         use_fast_accum=FAST_ACCUM)
    return y.view(*lead, n_)


def quantized_rows(be: Any, torch: Any, x2: Any, scheme: QuantScheme, s: Any, stream: Any) -> tuple[Any, Any]:
    """(codes [m, K] float8_e4m3fn, scales [m] f32) of x2 [m, K] quantized per row under `scheme`:
    a C-contiguous bfloat16 x2 by Triton (`act_rows`) where it is installed and takes the scheme
    and K, else by the backend's own kernel; (None, None) for a float16 / float32 x holding a non-finite
    value (the decoded path gives its rows NaN)."""
    m, k_ = (int(d) for d in x2.shape)
    contiguous_bf16 = x2.dtype == torch.bfloat16 and x2.is_contiguous()
    if contiguous_bf16 and act_rows.takes(scheme, k_) and act_rows.enabled():
        return act_rows.for_row(k_, scheme.scale_divisor, x2.device.index)(x2)
    got = quantize_bf16_rows(be, x2, scheme, s, wait=False) if contiguous_bf16 else None
    if got is not None:
        xq = got[0]  # nothing waits: a row holding a non-finite x has a NaN scale
    else:
        try:
            xq = be.quantize(x2.float() if x2.dtype == torch.bfloat16 else x2, scheme, stream=stream)
        except InputError:
            return None, None
    return _operands(torch, xq, m, k_)
