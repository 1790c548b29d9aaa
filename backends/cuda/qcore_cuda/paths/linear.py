"""`linear` on the cuda backend: x [..., K] @ dequantize(w [N, K]).T + bias, in x's dtype.

`run` reads x (torch, CuPy, numba device arrays, or host numpy with `ml_dtypes.bfloat16`), the
bias and `out=`, takes the first path of `LINEAR` that applies and hands the result back as the
caller gave x: a torch tensor for a torch x, else a device array (`QArray`), or a host
`ml_dtypes.bfloat16` array for a bfloat16 result without torch (numba has no bfloat16 device
dtype, as for `dequantize`). A float64 result is the f32 sums widened.

Paths:
- `FusedGemmLinear` (`fused.py`): bfloat16 x and result, a torch CUDA x of `FUSED_M` rows (48 to
  256, past 128 only on a Hopper GPU: between the tensor-core kernel's range and where dequantize
  + cuBLAS wins; only a weight whose 64-row tiles fill the GPU, `fused.fills`), an integer or
  mxfp4 weight (`fused.plan_takes`), Triton installed; a GEMM that dequantizes the weight's tiles
  to bfloat16 (the same rule as the next path) inside its main loop, in Triton or (Hopper, from
  65 rows) Gluon. Float16 x and result likewise from `FUSED_M`'s fewest rows with no upper bound,
  on any GPU (no library path takes them; a weight `fused.fills` rejects from
  `fused.SMALL_F16_FROM_M` rows), under docs/spec.md's float16-weight
  rule (the weight values times 2**p rounded to float16; p found once per weight from a bfloat16
  dequantize's largest magnitude, `fused.f16_shift`).
- `DequantizedGemmLinear`: bfloat16 x and result, a torch CUDA x of at least `LIBRARY_FROM_M`
  rows (prefill, batched serving): the weight dequantized to bfloat16 into a torch tensor (the
  fast dequantize kernel's bf16 variant, or float32 rounded once), then torch's GEMM (cuBLAS).
  docs/spec.md's bfloat16-weight rule allows the one rounding of each weight value; cuBLAS
  repeats its results bit for bit for the same shapes on the same GPU and library version.
- `MmaDecodeLinear` (`k_decode_mma.py`): at most `MMA_DECODE_MAX_M` rows (2) of bfloat16 or float16
  x on a weight whose 16-byte lane chunks each lie under one scale slot: the codes decoded into
  `mma.sync` pairs, B block-diagonal over the lane chunks so that each chunk's sum meets its own
  scale; bit-repeatable.
- `DecodeLinear` (`k_decode.py`): at most `DECODE_MAX_M` rows of x (decoding a token), the same
  weights as the tensor-core kernel: warps stream the weight's rows with 16-byte loads and add
  exact products on the CUDA cores (x staged in shared memory); bit-repeatable.
- `TensorCoreLinear` (`linear.py`): the weight's payload read as it is; bit-repeatable.
- `TransposedLinear`: any other weight. Its transpose ([K, N], `permute`: exact) is made once and
  kept with the weight, multiplied by the matmul paths in f32 (`CudaBackend.matmul`), and
  `k_finish` adds the bias and rounds once to the result dtype.

A repeat call of a shape, dtype and bias kind the weight has seen skips all this
(`paths.linear_repeat`).

The first `linear` of a tensor whose scheme has invalid codes (docs/spec.md) dequantizes it once
to check them, as a first dequantize does, so a bad code is an `InvalidDataError`, never a value.
"""
from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from qcore.backend.activations import ACTIVATION_DTYPES, product_dims, result_dtype
from qcore.errors import InputError
from qcore.backend.protocol import QTensor

from .. import _array, _streams
from .._data import NOT_YET
from .._launch import Packed
from . import choose

__all__ = ["LINEAR", "FUSED_M", "FUSED_ALL_KINDS", "LIBRARY_FROM_M", "DECODE_MAX_M", "MMA_DECODE_MAX_M", "LinearCall",
           "FusedGemmLinear", "DequantizedGemmLinear", "MmaDecodeLinear", "DecodeLinear", "TensorCoreLinear",
           "TransposedLinear", "same_kind_bias", "run", "rounded", "placeholders", "torch_dtype"]

_BF16 = np.dtype(ml_dtypes.bfloat16)
_F16, _F32, _F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)


@dataclass
class LinearCall:
    """One `linear`: the weight `w` (its `data` in the `low` field order), x as given and as the
    kernels read it (`xd`: u32 pairs of 16-bit values for `xt` XT_BF16/XT_F16, float32 for XT_F32;
    None: no tensor-core form), m rows, the result type `ot` and arrays (`out32`, `out16`: one is a
    placeholder), the bias (f32 [N], or a placeholder), the stream; x's dtype, the result as
    `linear` returns it and the bias as the caller gave it; the float16 fused GEMM's operands once
    this call has found them (`FusedGemmLinear.f16_operands`)."""

    be: Any
    w: Any
    data: Any
    x: Any
    xd: Any
    xt: int | None
    m: int
    ot: int
    out32: Any
    out16: Any
    bias: Any
    s: Any
    xdt: np.dtype
    result: Any
    bias_given: Any
    fused_f16: Any = NOT_YET

    @property
    def has_bias(self) -> bool:
        return self.bias_given is not None


LIBRARY_FROM_M = int(os.environ.get("QCORE_CUDA_LINEAR_LIBRARY_M", "64"))
"""The fewest rows of x `DequantizedGemmLinear` takes (below it the tensor-core kernel, which
reads the payload as it is, is faster: benchmarks/matmul.py, docs/performance.md); the
environment variable of that name replaces it at import (benchmarks compare both paths)."""


def _fused_rows(text: str) -> tuple[int, int]:
    """`QCORE_CUDA_LINEAR_FUSED_M`: 'FROM,TO' (rows of x, both taken), 'FROM' (no upper bound) or '0' (never)."""
    try:
        parts = [int(p) for p in text.split(",")]
    except ValueError:
        parts = []
    if len(parts) not in (1, 2) or min(parts) < 0:
        raise ValueError(f"QCORE_CUDA_LINEAR_FUSED_M={text!r}: FROM,TO rows, FROM (no upper bound) or 0 (never)")
    return (parts[0], parts[1] if len(parts) == 2 else 1 << 62)


FUSED_M = _fused_rows(os.environ.get("QCORE_CUDA_LINEAR_FUSED_M", "48,256"))
"""(fewest, most) rows of x `FusedGemmLinear` takes (fewest 0: never); past `fused.FIELDS_MAX_M`
rows only where its staged form runs (a Hopper GPU). By measurement (H100, 8192 x 8192,
docs/performance.md): at M = 48..256 it beats the paths it replaces for the weights
`fused.plan_takes` names; the tensor-core kernel is faster up to M = 32, dequantize + cuBLAS from
M = 384. The environment variable of that name replaces it at import (benchmarks compare the
paths)."""


def _fused_all_kinds(text: str) -> bool:
    """`QCORE_CUDA_LINEAR_FUSED_KINDS`: 'int' (the default) or 'all'."""
    if text not in ("int", "all"):
        raise ValueError(f"QCORE_CUDA_LINEAR_FUSED_KINDS={text!r}: int (integer weights) or all")
    return text == "all"


FUSED_ALL_KINDS = _fused_all_kinds(os.environ.get("QCORE_CUDA_LINEAR_FUSED_KINDS", "int"))
"""`FusedGemmLinear` takes the weights `fused.plan_takes` names (integer codes, mxfp4) where
`fused.fills` allows, or with `QCORE_CUDA_LINEAR_FUSED_KINDS=all` at import every kind of
`fused.KINDS` and weight size (tuning runs)."""


def _half_library_call(c: LinearCall, dtypes: tuple[np.dtype, ...]) -> bool:
    """Whether a call suits a GEMM of 16-bit operands launched on torch's side (docs/spec.md's
    bfloat16-weight and float16-weight rules): x and result of one of `dtypes` (bfloat16, float16)
    as torch CUDA tensors, K > 0, a bias of `same_kind_bias` (contiguous, x's dtype) or none,
    torch's current stream (where torch and Triton launch)."""
    from .. import linear

    if c.xdt not in dtypes or c.ot != {_BF16: linear.OT_BF16, _F16: linear.OT_F16}[c.xdt] or c.data.shape != c.w.shape:
        return False
    if not (_is_torch(c.x) and c.x.is_cuda and _is_torch(c.result) and c.w.shape[1] > 0):
        return False
    if not same_kind_bias(c.bias_given, c.x, c.w.shape[0]):
        return False  # (a bias of another dtype would be rounded to x's first: the kernels add it in f32;
        # the fused GEMM reads the bias as contiguous elements)
    return c.s.handle == _streams.torch_handle(c.x.device.index)


def same_kind_bias(bias: Any, x: Any, n: int) -> bool:
    """Whether a bias is one the 16-bit library paths take (`_half_library_call`, and their
    repeats: `paths.linear_repeat`): none, or a C-contiguous torch tensor [N] of x's dtype on x's
    device."""
    torch = _torch()
    return bias is None or (type(bias) is torch.Tensor and bias.dtype == x.dtype and bias.device == x.device
                            and bias.dim() == 1 and bias.numel() == n and bias.is_contiguous())


class FusedGemmLinear:
    """fused.py: a Triton GEMM that dequantizes the weight's tiles to bfloat16 as it multiplies
    (module text there), for the weights of the tensor-core kernel's geometry."""

    name = "fused-gemm"

    def applies(self, c: LinearCall) -> bool:
        from .. import fused

        lo, hi = FUSED_M
        if lo == 0 or not (lo <= c.m and (c.m <= hi or c.xdt == _F16)):
            return False  # (float16: no library path past the fused GEMM's rows)
        if not _half_library_call(c, (_BF16, _F16)) or c.x.data_ptr() % 16:
            return False  # (x's rows arrive by 16-byte copies in the staged form)
        g = TensorCoreLinear.geometry(c.data)
        if g is None or not fused.available():
            return False
        kind, block = g[0], fused.block_of(g[1])
        if not (FUSED_ALL_KINDS or fused.plan_takes(kind, block, c.m)):
            return False
        if not fused.plan_runs(c.m, kind, c.w.shape[1], block, c.x.device, c.xdt == _F16):
            return False
        if not (FUSED_ALL_KINDS or (c.xdt == _F16 and c.m >= fused.SMALL_F16_FROM_M)
                or fused.fills(c.w.shape[0])):
            return False  # (a weight too small to fill the GPU: the other paths were faster)
        return c.xdt != _F16 or self.f16_operands(c) is not None  # (p out of range: the tensor-core kernel)

    def launch(self, c: LinearCall) -> None:
        codes, scales = self.operands(c)
        self.prepared(c)(c.x.reshape(c.m, c.w.shape[1]), codes, scales, c.bias_given, c.result.view(c.m, c.w.shape[0]))

    @staticmethod
    def operands(c: LinearCall) -> tuple[Any, Any]:
        """The weight's code bytes and the scales x's dtype reads: `stored`'s, or for float16 x
        the effective scales times 2**p (`f16_operands`)."""
        codes, scales = FusedGemmLinear.stored(c)
        return (codes, FusedGemmLinear.f16_operands(c)[0]) if c.xdt == _F16 else (codes, scales)

    @staticmethod
    def stored(c: LinearCall) -> tuple[Any, Any]:
        """The weight's code bytes and effective scales as torch tensors on x's device (kept with
        the weight unless its payload is the caller's memory)."""
        cache = c.data.cache
        operands = cache.fused_operands
        if operands is None:
            torch = _torch()
            operands = (torch.as_tensor(c.be.state.plans.code_words(c.data), device=c.x.device).view(torch.uint8),
                        torch.as_tensor(_effective_scales(c), device=c.x.device))
            if not cache.caller_memory:
                cache.fused_operands = operands
        return operands

    @staticmethod
    def f16_operands(c: LinearCall) -> tuple[Any, float] | None:
        """(the effective scales times 2**p, 2**-p) of docs/spec.md's float16-weight rule, p from
        the weight's largest magnitude in a bfloat16 dequantize (`fused.f16_shift`), or None where
        p is out of range; found once and kept likewise (dropped when new bytes go into the
        payload: `TensorCache.forget_values`), and with the call (a weight over the caller's memory
        finds them once a call, not at each of the path's steps)."""
        from .. import fused

        cache = c.data.cache
        got = c.fused_f16 if c.fused_f16 is not NOT_YET else cache.fused_f16
        if got is NOT_YET:
            torch = _torch()
            wb = torch.empty(c.w.shape, dtype=torch.bfloat16, device=c.x.device)
            c.be.dequantize(c.w, _BF16, out=wb, stream=c.s)
            lo, hi = torch.aminmax(wb)
            p = fused.f16_shift(max(-float(lo), float(hi)))
            del wb
            got = None if p is None else (fused.f16_scales(FusedGemmLinear.stored(c)[1], p), 2.0 ** -p)
            if not cache.caller_memory:
                cache.fused_f16 = got
        c.fused_f16 = got
        return got

    @staticmethod
    def prepared(c: LinearCall) -> Any:
        """The `fused.FusedLaunch` for this weight, m rows, bias kind and x's dtype (kept likewise)."""
        from .. import fused

        f16 = c.xdt == _F16
        cache, key = c.data.cache, (c.m, c.has_bias, f16)
        go = cache.fused_launches.get(key)
        if go is None:
            kind, P = cache.linear_geometry
            go = fused.FusedLaunch(kind, P, c.m, c.x.device, has_bias=c.has_bias, f16=f16,
                                   unscale=FusedGemmLinear.f16_operands(c)[1] if f16 else 1.0)
            if not cache.caller_memory:
                cache.fused_launches[key] = go
        return go


class DequantizedGemmLinear:
    """The weight dequantized to bfloat16 per call, then torch's GEMM (module text)."""

    name = "dequantize-gemm"

    def applies(self, c: LinearCall) -> bool:
        return c.m >= LIBRARY_FROM_M and _half_library_call(c, (_BF16,))

    def launch(self, c: LinearCall) -> None:
        self.gemm(c.be, c.w, c.x, c.bias_given, c.result, c.s)

    @staticmethod
    def gemm(be: Any, w: Any, x: Any, bias: Any, y: Any, s: Any) -> None:
        """y = x @ W^T (+ bias): the weight dequantized into a bfloat16 tensor on stream `s`
        (torch's current one), then torch's GEMM; x, y and bias bfloat16 torch tensors."""
        wb = _torch().empty(w.shape, dtype=_torch().bfloat16, device=x.device)
        be.dequantize(w, _BF16, out=wb, stream=s)
        DequantizedGemmLinear.multiply(x, wb, bias, y)

    @staticmethod
    def multiply(x: Any, wb: Any, bias: Any, y: Any) -> None:
        """y = x @ wb^T (+ bias) by torch's GEMM, wb the bfloat16 weight [N, K]."""
        torch = _torch()
        n_, k_ = wb.shape
        x2, y2 = x.reshape(-1, k_), y.view(-1, n_)
        if bias is None:
            torch.mm(x2, wb.t(), out=y2)
        else:
            torch.addmm(bias, x2, wb.t(), out=y2)


DECODE_MAX_M = int(os.environ.get("QCORE_CUDA_LINEAR_DECODE_M", "1"))
"""The most rows of x `DecodeLinear` takes (at most `k_decode.MBS[-1]`, 4; 0: never); the environment
variable of that name replaces it at import (benchmarks compare the paths). One row by
measurement (docs/gpu.md): the kernel reads the weight once whatever M, but its FMAs per code grow
with M, and from M = 2 the tensor-core kernel is faster (H200, 8192 x 8192 q8s/block32:f16: 43.5
against 31.7 us at M = 2; 23.6 against ~31 us at M = 1 for q4s/block32:f16)."""
MMA_DECODE_MAX_M = int(os.environ.get("QCORE_CUDA_LINEAR_MMA_DECODE_M", "2"))
"""The most rows of x `MmaDecodeLinear` takes (at most `k_decode_mma.MBS[-1]`, 2; 0: never); the
environment variable of that name replaces it at import. Where that path applies it runs before
`DecodeLinear` (faster at one row and than the tensor-core kernel at two: docs/gpu.md)."""


class MmaDecodeLinear:
    """k_decode_mma.py: one or two rows of bfloat16 / float16 x, the codes decoded into tensor-core
    pairs (module text there)."""

    name = "mma-decode-linear"

    @staticmethod
    def key(c: LinearCall) -> tuple:
        """The packed launch's key in the weight's `cache.linear`."""
        return ("mma-decode", c.m, c.xt, c.ot, c.has_bias)

    def applies(self, c: LinearCall) -> bool:
        from .. import k_decode_mma

        if c.xt is None or c.m > MMA_DECODE_MAX_M:
            return False
        g = TensorCoreLinear.geometry(c.data)
        return g is not None and k_decode_mma.applies(g[0], g[1], c.xt, c.m) and _streamable(c, g, self.key(c))

    def launch(self, c: LinearCall) -> None:
        from .. import k_decode_mma

        _launch_streaming(c, self.key(c), lambda kind, P, sc: (
            k_decode_mma.kernel(kind, c.xt, k_decode_mma.mb_for(c.m), sc),
            *k_decode_mma.plan(kind, P, c.m, c.ot, c.has_bias)))


class DecodeLinear:
    """k_decode.py: a few rows of x, warps streaming the weight's rows (module text there)."""

    name = "decode-linear"

    @staticmethod
    def key(c: LinearCall) -> tuple:
        """The packed launch's key in the weight's `cache.linear`."""
        return ("decode", c.m, c.xt, c.ot, c.has_bias)

    def applies(self, c: LinearCall) -> bool:
        from .. import k_decode

        if c.xt is None or c.m > min(DECODE_MAX_M, k_decode.MBS[-1]):
            return False
        g = TensorCoreLinear.geometry(c.data)
        return (g is not None  # (x's shared memory holds a group)
                and k_decode.segment(g[0], c.data.shape[1], k_decode.mb_for(c.m)) > 0
                and _streamable(c, g, self.key(c)))

    def launch(self, c: LinearCall) -> None:
        from .. import k_decode

        _launch_streaming(c, self.key(c), lambda kind, P, sc: (
            k_decode.kernel(kind, c.xt, k_decode.mb_for(c.m), sc, k_decode.slots_per_unit(kind, P)),
            *k_decode.plan(kind, P, c.m, c.ot, c.has_bias)))


def _streamable(c: LinearCall, g: tuple, key: tuple) -> bool:
    """Whether a decode kernel (`k_decode`, `k_decode_mma`: 16-byte loads of each row's code words)
    reads the weight of `linear.geometry` g: FP8 codes only with the sm_89+ conversions; every row
    16-byte aligned (2-bit codes: K % 64 == 0) and the code words on a 16-byte boundary, checked
    until a launch is kept under `key`."""
    from .. import fast, k_decode, linear

    if g[0] in k_decode.FP8_KINDS and not c.be.state.fast.usable:
        return False
    if key in c.data.cache.linear:
        return True
    return int(g[1][linear.LP_WPR]) % 4 == 0 and fast.aligned(c.be.state.plans.code_words(c.data))


def _launch_streaming(c: LinearCall, key: tuple, build: Any) -> None:
    """Launch a decode kernel (`k_decode`, `k_decode_mma`: x, the code words, the scales in
    `_decode_scales`' form, the bias, the results, its parameters) through the packed launch kept
    under `key` in the weight's `cache.linear`, made at the first call from `build(kind, P, scale
    form)` -> (kernel, parameter tuple, grid, block)."""
    st = c.data.cache.linear.get(key)
    if st is None:
        from numba import cuda

        kind, P = c.data.cache.linear_geometry
        prepared = c.be.state.plans.get(c.data.shape, c.data.scheme, "minmax")
        sc, scales = _decode_scales(c, prepared)
        kern, q, grid, block = build(kind, P, sc)
        args = [c.xd, c.be.state.plans.code_words(c.data), scales, c.bias, c.out32, c.out16,
                cuda.to_device(np.asarray(q, np.int64))]
        st = c.data.cache.linear[key] = Packed(kern, grid, block, args, dynamic=(0, 4, 5, 3))
    st(c.xd, c.out32, c.out16, c.bias, stream=c.s)


class TensorCoreLinear:
    """linear.py: mma over the payload as it is (module text there)."""

    name = "tensor-core-linear"

    @staticmethod
    def key(c: LinearCall) -> tuple:
        """The packed launch's key in the weight's `cache.linear`."""
        return (c.m, c.xt, c.ot, c.has_bias)

    @staticmethod
    def geometry(data: Any) -> tuple | None:
        """`linear.geometry` of the weight's kernel data, kept with it."""
        from .. import linear

        if data.cache.linear_geometry is NOT_YET:
            data.cache.linear_geometry = linear.geometry(data.shape, data.scheme)
        return data.cache.linear_geometry

    def applies(self, c: LinearCall) -> bool:
        return c.xt is not None and self.geometry(c.data) is not None

    def launch(self, c: LinearCall) -> None:
        from .. import linear

        key = self.key(c)
        st = c.data.cache.linear.get(key)
        if st is None:
            from numba import cuda

            kind, P = c.data.cache.linear_geometry
            nb = linear.nb_for(c.m)
            rt = linear.rt_for(kind, c.data.shape[0], c.m, linear.split(P))
            q, grid, block = linear.plan(P, c.m, nb, c.ot, c.has_bias, rt)
            wide = linear.wide_for(kind, c.m, linear.split(P), rt)
            args = [c.xd, c.be.state.plans.code_words(c.data), _effective_scales(c), c.bias, c.out32, c.out16,
                    cuda.to_device(np.asarray(q, np.int64))]
            st = c.data.cache.linear[key] = Packed(linear.kernel(kind, c.xt, nb, linear.split(P), rt, wide), grid,
                                                   block, args, dynamic=(0, 4, 5, 3))
        st(c.xd, c.out32, c.out16, c.bias, stream=c.s)


def _decode_scales(c: LinearCall, prepared: Any) -> tuple[int, Any]:
    """(`k_decode`'s scale form, the scales it reads) for the weight's prepared plan: the payload's
    stored f16 or bf16 scale words as uint16 where `k_decode.scale_form` takes them and the
    section's device address is even, else `_effective_scales`."""
    from numba import config

    from .. import k_decode
    from ..layouts import M_NSLOTS, M_SOFF

    P = prepared.plan.P
    soff, nslots = int(P[M_SOFF]), int(P[M_NSLOTS])
    sc = k_decode.scale_form(c.data.scheme, soff)
    if sc != k_decode.SC_F32:
        words = c.data.payload[soff: soff + 2 * nslots].view(np.uint16)
        if config.ENABLE_CUDASIM or words.__cuda_array_interface__["data"][0] % 2 == 0:
            return sc, words
    return k_decode.SC_F32, _effective_scales(c)


def _effective_scales(c: LinearCall) -> Any:
    """One f32 effective scale per slot: the decoded scales, or for a two-level weight
    `linear.k_effective`'s copy, made once and kept with the weight."""
    from .. import linear
    from ..fast import K

    scales, gbuf = c.be.decoded_scales(c.data, c.s)
    if not c.data.scheme.two_level:
        return scales
    es = c.data.cache.linear_scales
    if es is None:
        es = c.data.cache.linear_scales = _array.empty((int(scales.size),), np.float32, c.s)
        _streams.on(linear.k_effective, K.launch(int(scales.size)), c.s)(scales, gbuf, es, int(scales.size))
    return es


class TransposedLinear:
    """Any weight: its transpose, made once and kept, through the matmul paths; then `k_finish`."""

    name = "transposed-matmul"

    def applies(self, c: LinearCall) -> bool:
        return True

    def launch(self, c: LinearCall) -> None:
        from .. import linear
        from ..fast import K

        n_, k_ = c.w.shape
        y32 = c.out32 if c.ot == linear.OT_F32 and not c.has_bias else _array.empty((c.m * n_,), np.float32, c.s)
        if k_ == 0:
            _streams.on(K.k_zero, K.launch(c.m * n_), c.s)(y32)
        elif c.data.shape != c.w.shape:  # blocks over the flattened tensor that cross rows: the core's sums
            from qcore.backend import ops

            host = ops.linear(c.be, c.be.to_numpy(_f32_source(c.x)) if not isinstance(c.x, np.ndarray) else c.x, c.w,
                              dtype=np.float32)
            _array.view_of(y32).numba().copy_to_device(np.ascontiguousarray(host).reshape(-1), stream=c.s.numba)
        else:
            wt = c.data.cache.transposed
            if wt is None:  # (the payload's own form: a flat-block tensor's transpose would requantize)
                wt = c.data.cache.transposed = c.be.transpose(QTensor(c.be, c.data.scheme, c.data.shape, c.data))
            xf = _f32_source(c.x)  # (matmul reads every x kind; a torch bfloat16 one widened here)
            c.be.matmul(xf.reshape(c.m, k_), wt, out=y32, stream=c.s.handle)
        if y32 is not c.out32:
            _streams.on(linear.k_finish, K.launch(c.m * n_), c.s)(y32, c.bias, c.out32, c.out16, c.m * n_, n_, c.ot,
                                                                   int(c.has_bias))


LINEAR = (FusedGemmLinear(), DequantizedGemmLinear(), MmaDecodeLinear(), DecodeLinear(), TensorCoreLinear(),
          TransposedLinear())
"""The linear paths in the order the backend tries them."""


# ----------------------------------------------------------------------------- the call
def _torch() -> Any:
    return sys.modules.get("torch")


def _is_torch(x: Any) -> bool:
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


def torch_dtype(dt: np.dtype) -> Any:
    """The torch dtype of numpy dtype `dt` (ml_dtypes' bfloat16 included)."""
    torch = _torch()
    return torch.bfloat16 if dt == _BF16 else getattr(torch, dt.name)


def _np_dtype(x: Any) -> np.dtype:
    """x's element type, bfloat16 included (torch's, or numpy's with ml_dtypes)."""
    if _is_torch(x):
        return _BF16 if x.dtype == _torch().bfloat16 else np.dtype(str(x.dtype).removeprefix("torch."))
    v = _array.view_of(x) if not isinstance(x, np.ndarray) else None
    if v is not None:
        return v.dtype
    return np.asarray(x).dtype


def _shape(x: Any) -> tuple[int, ...]:
    if _is_torch(x):
        return tuple(x.shape)
    v = _array.view_of(x) if not isinstance(x, np.ndarray) else None
    return v.nd_shape if v is not None else tuple(np.shape(x))


def _device_bits(x: Any, dt: np.dtype, s: Any) -> Any:
    """A device array of x's raw elements (flat, `dt`-sized words), read in place where x is on
    the device already."""
    from numba import cuda

    if _is_torch(x):
        if not x.is_cuda:
            raise InputError(f"x is a torch tensor on {x.device}; the cuda backend reads CUDA tensors or host arrays")
        if not x.is_contiguous():
            raise InputError("the cuda backend reads C-contiguous device arrays; pass x.contiguous() / a copy")
        return _array.DevView(x.data_ptr(), (x.numel(),), np.dtype(dt), x)
    v = _array.view_of(x) if not isinstance(x, np.ndarray) else None
    if v is not None:
        return v.arg if v._sim is not None else _array.DevView(v.ptr, (v.size,), np.dtype(dt), v.base)
    host = np.ascontiguousarray(x).reshape(-1)
    return cuda.to_device(host.view(dt), stream=s.numba)


def _kernel_x(be: Any, x: Any, xdt: np.dtype, n: int, s: Any) -> tuple[Any, int | None]:
    """(x as the tensor-core kernel reads it, its XT) or (None, None) where it cannot: 16-bit x as
    u32 pairs on a 16-byte boundary, float32 (and float64, rounded) as float32."""
    from .. import linear

    if xdt in (_BF16, _F16):
        if n % 2:
            return None, None
        d = _array.reinterpret(_device_bits(x, np.dtype(np.uint16), s), np.dtype(np.uint32))
        if type(d) is _array.DevView and d.ptr % 16:
            return None, None
        return d, (linear.XT_BF16 if xdt == _BF16 else linear.XT_F16)
    d = be.device_f32(_f32_source(x), s)
    if type(d) is _array.DevView and d.ptr % 16:
        return None, None
    return d, linear.XT_F32


def _f32_source(x: Any) -> Any:
    """x in a form `CudaBackend.device_f32` reads (a torch bfloat16 tensor widened by torch)."""
    if _is_torch(x) and x.dtype == _torch().bfloat16:
        return x.float()
    return x


def placeholders(s: Any) -> tuple[Any, Any]:
    """One-element float32 and uint16 device arrays for the kernel's unused arguments."""
    from numba import cuda

    global _PLACE
    if _PLACE is None:
        _PLACE = (cuda.device_array(1, np.float32), cuda.device_array(1, np.uint16))
    return _PLACE


_PLACE: tuple | None = None


def _device_bias(be: Any, bias: Any, n: int, s: Any) -> Any:
    """The bias as a float32 device array [n] (read in place when it is one already)."""
    if _is_torch(bias):
        if tuple(bias.shape) != (n,):
            raise InputError(f"bias has shape {tuple(bias.shape)}; linear with a weight of {n} output rows takes a "
                             f"bias of shape ({n},)")
        if bias.dtype not in (_torch().float16, _torch().bfloat16, _torch().float32, _torch().float64):
            raise InputError(f"bias has dtype {bias.dtype}; pass float16, bfloat16, float32 or float64")
        return be.device_f32(bias.float().contiguous() if bias.is_cuda else bias.float().numpy(), s)
    shape, dt = _shape(bias), _np_dtype(bias)
    if shape != (n,):
        raise InputError(f"bias has shape {shape}; linear with a weight of {n} output rows takes a bias of shape ({n},)")
    if dt not in ACTIVATION_DTYPES:
        raise InputError(f"bias has dtype {dt}; pass float16, bfloat16, float32 or float64")
    return be.device_f32(bias, s)


def _outputs(x: Any, out: Any, shape: tuple[int, ...], dt: np.dtype, s: Any) -> tuple:
    """(result, its float32 form or None, its 16-bit words or None, finish): the arrays the
    kernels write for a result of `shape` and `dt`, and a function that turns the written
    result into what `linear` returns."""
    n = math.prod(shape)
    if out is not None:
        if dt == _F64:
            raise InputError("linear out= takes float32, float16 or bfloat16 arrays; leave it out for float64")
        if _is_torch(out):
            if not out.is_cuda or not out.is_contiguous():
                raise InputError("linear out= must be a C-contiguous CUDA tensor")
            odt = _np_dtype(out)
            if tuple(out.shape) != shape and out.numel() != n:
                raise InputError(f"linear out= has shape {tuple(out.shape)}, the result has shape {shape}")
            v = _array.DevView(out.data_ptr(), (n,), odt, out)
        else:
            v = _array.check_out(out, shape, (_F32, _F16), "linear")
            odt = v.dtype
        if odt != dt:
            raise InputError(f"linear out= has dtype {odt}, the result's is {dt}; pass dtype={odt} or an out= of {dt}")
        words = v.arg if odt == _F32 else _array.reinterpret(v.arg if v._sim is not None else v, np.dtype(np.uint16))
        return out, (words if odt == _F32 else None), (None if odt == _F32 else words), lambda r: r
    wide = dt == _F64
    kdt = _F32 if wide else dt
    if _is_torch(x):
        torch = _torch()
        res = torch.empty(shape, dtype=torch_dtype(kdt), device=x.device)
        v = _array.DevView(res.data_ptr(), (n,), np.dtype(np.uint16) if kdt != _F32 else _F32, res)
        return res, (v if kdt == _F32 else None), (None if kdt == _F32 else v), \
            ((lambda r: r.double()) if wide else (lambda r: r))
    if kdt == _BF16:
        buf = _array.empty((n,), np.uint16, s)
        return buf, None, buf, lambda r: r.copy_to_host().view(_BF16).reshape(shape)
    res, v = _array.empty_view(shape, kdt, s)
    words = v.arg if kdt == _F32 else _array.reinterpret(v.arg if v._sim is not None else v, np.dtype(np.uint16))

    def widen(r: Any) -> Any:
        from numba import cuda

        return cuda.to_device(r.copy_to_host().astype(np.float64))

    return res, (words if kdt == _F32 else None), (None if kdt == _F32 else words), (widen if wide else (lambda r: r))


def _check_codes_once(be: Any, w: Any, s: Any) -> None:
    """A tensor whose scheme has invalid codes is dequantized once before its first product, so a
    bad code raises `InvalidDataError` (docs/spec.md, invalid codes) as at a first dequantize."""
    if w.scheme.valid_fields.all() or w.data.codes_checked() or w.data.cache.linear_codes_checked:
        return
    be.dequantize(w, _F16, stream=s)
    w.data.cache.linear_codes_checked = not w.data.cache.caller_memory


def run(be: Any, x: Any, w: Any, bias: Any, out: Any, dtype: Any, stream: Any) -> Any:
    """`CudaBackend.linear` (module text)."""
    from .. import linear

    w = be.own(w)
    xshape, xdt = _shape(x), _np_dtype(x)
    if xdt not in ACTIVATION_DTYPES:
        raise InputError(f"x has dtype {xdt}; products take float16, bfloat16, float32 or float64 activations")
    k_, n_ = product_dims("linear", xshape, w.shape)
    if dtype is None and out is not None:
        dtype = _np_dtype(out)
    dt = result_dtype(xdt, dtype)
    m = math.prod(xshape[:-1])
    s = _streams.resolve(stream, x)
    res, out32, out16, finish = _outputs(x, out, tuple(xshape[:-1]) + (n_,), dt, s)
    if m * n_ == 0:
        return finish(res)
    p32, p16 = placeholders(s)
    bias_d = p32 if bias is None else _device_bias(be, bias, n_, s)
    ot = {_F32: linear.OT_F32, _F16: linear.OT_F16, _BF16: linear.OT_BF16}[_F32 if dt == _F64 else dt]
    _check_codes_once(be, w, s)
    data = be.kernel_data(w.data, s)
    # x in the kernel's form only where the kernel takes the weight (the fallback reads x itself)
    xd, xt = _kernel_x(be, x, xdt, m * k_, s) if k_ and TensorCoreLinear.geometry(data) else (None, None)
    call = LinearCall(be, w, data, x, xd, xt, m, ot, p32 if out32 is None else out32,
                      p16 if out16 is None else out16, bias_d, s, xdt, res, bias)
    path = choose(LINEAR, call)
    path.launch(call)
    if out is None and dtype is None and stream is None:
        from .linear_repeat import remember

        remember(call, path, x, tuple(xshape[:-1]) + (n_,), bias)
    return finish(res)


def rounded(y: Any, dt: np.dtype, s: Any) -> Any:
    """A float32 device result `y` rounded once to `dt`: float16 on the device (`k_finish`), the
    others on the host (bfloat16, which numba's arrays lack, and float64)."""
    from .. import linear
    from ..fast import K

    if dt == _F32:
        return y
    if dt != _F16 or not y.size:
        return y.copy_to_host().astype(dt)
    res, v = _array.empty_view(tuple(y.shape), _F16, s)
    p32, _ = placeholders(s)
    words = _array.reinterpret(v.arg if v._sim is not None else v, np.dtype(np.uint16))
    _streams.on(linear.k_finish, K.launch(y.size), s)(y.reshape(y.size), p32, p32, words, y.size, y.size,
                                                       linear.OT_F16, 0)
    return res
