"""Repeat calls of `linear` on the cuda backend (`again`): a call with a torch CUDA x of a shape,
dtype and bias kind the weight has seen (x on a 16-byte boundary), no `dtype=` or `stream=`, no
`out=` or a torch `out=` of the result's dtype and size (on a 16-byte boundary), skips the checks
and the path choice of `paths.linear.run` and does what the path the first call took does: the
packed launch with plain addresses (decode, tensor-core kernel; `Packed.launch_values`); a result
tensor and the compiled kernel's launch (fused GEMM, `fused.FusedLaunch`); the weight's dequantize
into a bfloat16 tensor and torch's GEMM (dequantize + GEMM). `remember` keeps what a first call's
path made (`TensorCache.linear_repeats`); a weight whose payload is the caller's memory takes the
whole way every call (its bytes may change).
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from qcore.backend.protocol import QTensor

from .. import _array, _streams
from .linear import (DecodeLinear, DequantizedGemmLinear, FusedGemmLinear, LinearCall, MmaDecodeLinear,
                     TensorCoreLinear, placeholders, same_kind_bias)

__all__ = ["LinearRepeat", "FusedRepeat", "DequantizedRepeat", "remember", "again"]

_F32 = np.dtype(np.float32)


@dataclass(frozen=True)
class LinearRepeat:
    """A repeat call on the decode or tensor-core path (`again`): the packed launch, the result's
    shape, the element types and counts of the views of x and of the result, the placeholders
    and their device addresses."""

    launch: Any
    out_shape: tuple
    out_words: np.dtype
    n_out: int
    x_words: np.dtype
    n_x: int
    p32: Any
    p16: Any
    p32_ptr: int
    p16_ptr: int

    def run(self, be: Any, w: Any, x: Any, bias: Any, res: Any) -> Any:
        """`res` written, or None where the bias is not a float32 CUDA tensor [N] (the whole way).
        The launch takes plain addresses where it is held as a C argument array (x, the result
        and the bias have the packed dtypes and sizes: `again` checked them), else views."""
        torch = sys.modules.get("torch")
        bptr = self.p32_ptr
        if bias is not None:
            if (type(bias) is not torch.Tensor or bias.dtype != torch.float32 or not bias.is_cuda
                    or not bias.is_contiguous() or bias.numel() != self.out_shape[-1] or bias.dim() != 1):
                return None
            bptr = bias.data_ptr()
        optr = res.data_ptr()
        wide = self.out_words == _F32
        if self.launch.launch_values((x.data_ptr(), optr if wide else self.p32_ptr, self.p16_ptr if wide else optr,
                                      bptr), _streams.torch_handle(x.device.index)):
            return res
        bd = self.p32 if bias is None else _array.DevView(bptr, (bias.numel(),), _F32, bias)
        od = _array.DevView(optr, (self.n_out,), self.out_words, res)
        xd = _array.DevView(x.data_ptr(), (self.n_x,), self.x_words, x)
        self.launch(xd, od if wide else self.p32, self.p16 if wide else od, bd, stream=_streams.resolve(None, x))
        return res


@dataclass(frozen=True)
class FusedRepeat:
    """A repeat call on the fused GEMM (`again`): its launch (`fused.FusedLaunch`, which launches
    the compiled kernel directly after its first call), the weight's operands, the result's shape."""

    launch: Any
    codes: Any
    scales: Any
    out_shape: tuple

    def run(self, be: Any, w: Any, x: Any, bias: Any, res: Any) -> Any:
        """`res` written, or None where the bias is not of the kind the first call's was."""
        m, n, k = self.launch.m, self.launch.n, self.launch.k
        if not same_kind_bias(bias, x, n):
            return None
        self.launch(x.view(m, k), self.codes, self.scales, bias, res.view(m, n))
        return res


@dataclass(frozen=True)
class DequantizedRepeat:
    """A repeat call on dequantize + torch's GEMM (`again`): the result's shape, and the weight's
    packed bfloat16 dequantize launch (`FastDequantize`'s, only the output changes) where that
    kernel served the first call and the codes are checked (None: `CudaBackend.dequantize`)."""

    out_shape: tuple
    dequantize: Any = None

    def run(self, be: Any, w: Any, x: Any, bias: Any, res: Any) -> Any:
        """`res` written, or None where the bias is not of the kind the first call's was."""
        if not same_kind_bias(bias, x, w.shape[0]):
            return None
        s = _streams.resolve(None, x)
        if self.dequantize is None:
            DequantizedGemmLinear.gemm(be, w, x, bias, res, s)
            return res
        torch = sys.modules.get("torch")
        wb = torch.empty(w.shape, dtype=torch.bfloat16, device=x.device)
        self.dequantize(_array.reinterpret(_array.DevView(wb.data_ptr(), (wb.numel(),), np.dtype(np.uint16), wb),
                                           np.dtype(np.uint32)), stream=s)
        DequantizedGemmLinear.multiply(x, wb, bias, res)
        return res


def remember(c: LinearCall, path: Any, x: Any, out_shape: tuple, bias: Any) -> None:
    """Keep what `again` needs after a call with a torch CUDA x (bfloat16, float16 or float32, on a
    16-byte boundary) on the fused GEMM, dequantize + GEMM, or the decode or tensor-core kernel
    (its packed launch; a float32 CUDA bias or none), unless the payload is the caller's memory
    (checked on every call)."""
    from .. import linear

    torch = sys.modules.get("torch")
    if (torch is None or type(x) is not torch.Tensor or not x.is_cuda or c.data.cache.caller_memory
            or x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or x.data_ptr() % 16):
        return  # (`again` serves x on a 16-byte boundary alone: the path chosen for such an x)
    key = (x.dtype, x.shape, bias is not None)
    repeats = c.w.data.cache.linear_repeats
    if type(path) is FusedGemmLinear:
        repeats[key] = FusedRepeat(path.prepared(c), *path.operands(c), out_shape)
        return
    if type(path) is DequantizedGemmLinear:
        w = c.w
        checked = w.scheme.valid_fields.all() or w.data.codes_checked() or w.data.cache.linear_codes_checked
        repeats[key] = DequantizedRepeat(out_shape, c.data.cache.dequant_bf16 if checked else None)
        return
    if type(path) not in (MmaDecodeLinear, DecodeLinear, TensorCoreLinear) or (
            bias is not None and not (type(bias) is torch.Tensor and bias.dtype == torch.float32 and bias.is_cuda)):
        return
    st = c.data.cache.linear.get(path.key(c))
    if st is None:
        return
    wide = c.ot == linear.OT_F32
    x_words = _F32 if c.xt == linear.XT_F32 else np.dtype(np.uint32)
    n_out = math.prod(out_shape)
    p32, p16 = placeholders(c.s)
    repeats[key] = LinearRepeat(
        st, out_shape, _F32 if wide else np.dtype(np.uint16), n_out, x_words,
        x.numel() if c.xt == linear.XT_F32 else x.numel() // 2, p32, p16,
        *(a.__cuda_array_interface__["data"][0] for a in (p32, p16)))


def again(be: Any, x: Any, w: Any, bias: Any, out: Any, dtype: Any, stream: Any) -> Any:
    """A repeat call's result (module text), or None when the call needs the whole way."""
    if dtype is not None or stream is not None or type(w) is not QTensor or w.backend is not be:
        return None
    plans = w.data.cache.linear_repeats
    torch = sys.modules.get("torch")
    if not plans or torch is None or type(x) is not torch.Tensor:
        return None
    p = plans.get((x.dtype, x.shape, bias is not None))
    if p is None or not x.is_cuda or not x.is_contiguous() or x.data_ptr() % 16:
        return None
    if out is None:
        res = torch.empty(p.out_shape, dtype=x.dtype, device=x.device)
    elif (type(out) is torch.Tensor and out.dtype == x.dtype and out.device == x.device and out.is_contiguous()
          and out.numel() == math.prod(p.out_shape) and out.data_ptr() % 16 == 0):
        res = out  # (an out= of the result's dtype: the path the call without it took)
    else:
        return None
    return p.run(be, w, x, bias, res)
