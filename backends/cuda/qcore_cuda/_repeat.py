"""Repeat calls: quantize and dequantize of a shape and scheme already served, without the
checks and the path choice that the first such call made.

A call through `BaseBackend` parses the scheme, asks whether this backend supports it, checks x's
dtype, shape and layout, works out the hooks' form (field orders, flat blocks) and the plan, and
picks a path: several hundred Python operations, all of them before the first kernel starts. Their
outcome depends only on the scheme as given, the method and x's shape (the dtype and alignment are
checked again), so after a call that took the fast kernels the backend keeps what it decided in a
`QuantizeRepeat` (`CudaState.repeats`, keyed by `(scheme as given, method, shape)`), a tensor keeps
its `DequantizeRepeat` in its cache (`TensorCache.dequantize_repeat`) and a weight its
`MatmulRepeat` per shape of x (`TensorCache.matmul_repeats`). A later call that matches allocates
its result (or takes `out=`: a float32 array, or for quantize a tensor of the same shape and scheme
or a uint8 array of the payload's length), launches the same packed kernels and reads the flag (a
dequantize only until one read has found the tensor's codes valid: `CudaData.codes_checked`);
anything else (another dtype, a misaligned x, `params=`, `stream=`, an `out=` of another kind, a
failed allocation) takes the whole way, which raises what it should.

A float32 torch CUDA tensor, as x or as a float32 out=, is read through `_array.torch_f32` (its
pointer, shape and device, a few of torch's C attributes) rather than the generic `view_of`, and
a repeat matmul with such an x launches with plain pointers (`Packed.launch_values`), the
dtypes and lengths being fixed by the key (docs/gpu.md, "Repeat calls").
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from qcore.backend.protocol import QTensor
from qcore.spec.schemes import QuantScheme

from . import _array, _streams
from ._data import CudaData
from .paths import TAKEN
from .paths.matmul import packed_aligned, packed_takes, run_packed, run_packed_values
from ._prepared import Prepared
from .paths.quantize import (QUANTIZE, FastQuantize, QuantizeCall, fast_quant_held, fast_quant_launches,
                              run_fast_quantize)

__all__ = ["HITS", "QuantizeRepeat", "DequantizeRepeat", "MatmulRepeat", "quantize_again", "remember_quantize",
           "dequantize_again", "remember_dequantize", "matmul_again", "remember_matmul"]

_F32, _U8, _U32 = np.dtype(np.float32), np.dtype(np.uint8), np.dtype(np.uint32)
HITS: Counter = Counter()  # calls served here, by operation (tests and benchmarks read it)
MAX_REPEATS = 256  # distinct (scheme, method, shape) keys kept per backend; the table is cleared when full


@dataclass(frozen=True)
class QuantizeRepeat:
    """What a quantize call of one (scheme as given, method, shape) decided: the scheme, the
    plan's byte counts and its fast geometry (`prepared`), whose packed launches
    `paths.quantize.fast_quant_launches` keeps."""

    scheme: QuantScheme
    shape: tuple[int, ...]
    prepared: Prepared
    nbytes: int  # the payload
    values_nbytes: int  # its values section (the fast kernels' u32 words)
    aligned: Any  # fast.aligned: x suits the fast kernels' vector loads (fast.py imports numba, so not here)


@dataclass(frozen=True)
class DequantizeRepeat:
    """A tensor's packed fast dequantize launch (only the output changes), the shape of its
    result and whether its scheme has invalid codes to look for (docs/spec.md, invalid codes)."""

    launch: Any
    shape: tuple[int, ...]
    has_invalid_codes: bool


@dataclass(frozen=True)
class MatmulRepeat:
    """A weight's packed GEMV or tensor-core launch for one shape of x (`paths.matmul.run_packed`),
    x's row count and the result's shape."""

    packed: tuple
    m: int
    out_shape: tuple[int, ...]


def quantize_again(be: Any, x: Any, scheme: Any, method: str, out: Any = None) -> QTensor | None:
    """`be.quantize(x, scheme, method=method, out=out)` for a key a fast call has served, or None
    (the caller then takes the whole way). The launches come first; the result's objects are
    made while the kernels run. A float32 torch x is read without its generic view
    (`_array.torch_f32`), and into a new payload launched with plain pointers (`_quantize_torch`)."""
    t = _array.torch_f32(x)
    if t is not None:
        if out is None:
            try:
                rep = be.state.repeats.get((scheme, method, t[1]))
            except TypeError:  # an unhashable scheme or method: the whole way names the mistake
                return None
            q = None if rep is None else _quantize_torch(be, rep, x, t)
            if q is not None:
                return q
        v = _array.DevView(t[0], t[1], _F32, x)
    else:
        try:
            v = _array.view_of(x)
        except Exception:  # noqa: BLE001 - the whole way raises the proper error
            return None
        if v is None or v.dtype != _F32:
            return None
    try:
        rep = be.state.repeats.get((scheme, method, v.nd_shape))
    except TypeError:  # an unhashable scheme or method: the whole way names the mistake
        return None
    if rep is None or not rep.aligned(v):
        return None
    s = _streams.resolve(None, x) if t is None else _streams.torch_stream(t[2])
    pv = _payload_target(be, out, rep, s)
    if pv is None:
        return None
    xd, pd = v.arg, pv.arg  # (the simulator's arrays under the simulator)
    qw32 = _array.prefix(pd, rep.values_nbytes, _U32)
    fp, scratch = rep.prepared.fast, be.state.scratch
    try:
        ready = run_fast_quantize(fast_quant_launches(scratch, rep.prepared, xd, qw32, pd, fp.G, s=s), fp, xd, qw32,
                                  pd, s, scratch)
        if type(out) is QTensor:  # its decoded scales follow the new bytes
            be.refresh_decoded(out.data, s)
    except BaseException:
        scratch.drop(s)  # the statistics may not have been consumed
        if out is None:
            _array.result(pv, s)  # (dropped: the memory goes back to the pool)
        raise
    TAKEN["FastQuantize"] += 1
    if out is None:
        HITS["quantize"] += 1
        q = QTensor(be, rep.scheme, rep.shape, CudaData(rep.shape, rep.scheme, _array.result(pv, s)))
    elif type(out) is QTensor:
        HITS["quantize out="] += 1
        q = out
    else:
        HITS["quantize out="] += 1
        data = CudaData(rep.shape, rep.scheme, pv.numba())
        data.mark_caller_memory()
        q = QTensor(be, rep.scheme, rep.shape, data)
    scratch.raise_if_flagged(scratch.buffers(s).flag, xd, rep.shape, s, ready)
    return q


def _quantize_torch(be: Any, rep: QuantizeRepeat, x: Any, t: tuple) -> QTensor | None:
    """The repeat quantize of torch x (read by `_array.torch_f32`: `t`) into a new payload, the
    launches packed already taking plain pointers (`paths.quantize.fast_quant_held`), on x's
    torch stream; None where the views' way must look (a misaligned x, launches not packed yet
    or not held as C argument arrays, a failed allocation, a driver that refused the launch)."""
    xptr, _, dev = t
    if xptr % 16:  # (fast.aligned; torch_f32 reads no simulated array)
        return None
    s = _streams.torch_stream(dev)
    fp, scratch = rep.prepared.fast, be.state.scratch
    launches = fast_quant_held(scratch, rep.prepared, s)
    if launches is None:
        return None
    try:
        pv = _array.reserve((rep.nbytes,), _U8, s)
    except Exception:  # noqa: BLE001 - out of memory: the whole way trims the pool
        return None
    try:
        ready = run_fast_quantize(launches, fp, None, None, None, s, scratch, (xptr, pv.ptr))
    except BaseException:
        scratch.drop(s)  # the statistics may not have been consumed
        _array.result(pv, s)  # (dropped: the memory goes back to the pool)
        raise
    if ready is False:  # nothing ran
        _array.result(pv, s)
        return None
    TAKEN["FastQuantize"] += 1
    HITS["quantize"] += 1
    q = QTensor(be, rep.scheme, rep.shape, CudaData(rep.shape, rep.scheme, _array.result(pv, s)))
    scratch.raise_if_flagged(scratch.buffers(s).flag, x, rep.shape, s, ready)
    return q


def _payload_target(be: Any, out: Any, rep: QuantizeRepeat, s: Any) -> Any:
    """A view of the payload to write for `out` (None: new memory, `_array.reserve`; a QTensor of
    this backend, shape and scheme: its payload; a uint8 device array of the payload's length),
    or None for anything the whole way must look at."""
    try:
        if out is None:
            return _array.reserve((rep.nbytes,), _U8, s)
        if type(out) is QTensor:
            data = out.data
            if out.backend is not be or type(data) is not CudaData or out.shape != rep.shape or \
                    data.shape != rep.shape or (out.scheme is not rep.scheme and out.scheme != rep.scheme) or \
                    data.scheme != rep.scheme:
                return None
            pv = data.cache.payload_view
            if pv is None:
                pv = data.cache.payload_view = _array.view_of(data.payload)
            return pv if pv is not None and pv.size == rep.nbytes else None
        return _array.check_out(out, (rep.nbytes,), (_U8,), "quantize")
    except Exception:  # noqa: BLE001 - out of memory, a bad out=: the whole way trims the pool or explains
        return None


def remember_quantize(be: Any, x: Any, scheme_arg: Any, method: str, q: QTensor) -> None:
    """After a whole-way quantize that returned `q`: keep its decisions for the key when the
    fast kernels served it with nothing the key leaves out (x float32 on the device, the
    scheme in its own form)."""
    state = be.state
    if not state.fast.usable:
        return
    try:
        v = _array.view_of(x)
    except Exception:  # noqa: BLE001
        return
    from . import fast

    key = (scheme_arg, method, q.shape)
    repeats = state.repeats
    if v is None or v.dtype != _F32 or key in repeats or not fast.aligned(v):  # (an aligned x may come)
        return
    if len(repeats) >= MAX_REPEATS:
        repeats.clear()
    repeats[key] = None  # not served by the fast kernels alone: no repeat (and no second look)
    if q.scheme.flat_blocks or q.scheme.low_order is not q.scheme or \
            math.prod(q.shape) == 0:
        return  # flat blocks' other form; field orders (k_reorder moves them after the kernels); no elements
    pp = state.plans.get(q.shape, q.scheme, method)
    call = QuantizeCall(be, None, v, q.shape, q.scheme, None, pp, None, _streams.DEFAULT)
    if not isinstance(QUANTIZE[0], FastQuantize) or not QUANTIZE[0].applies(call):
        return
    pl = pp.plan
    repeats[key] = QuantizeRepeat(q.scheme, q.shape, pp, int(pl.total_nbytes), int(pl.values_nbytes),
                                      fast.aligned)


def dequantize_again(be: Any, q: Any, out: Any = None) -> Any:
    """`be.dequantize(q, out=out)` (float32: a new array, or `out` on its stream) for a tensor
    whose fast dequantize launch is packed, or None."""
    if type(q) is not QTensor or q.backend is not be or type(q.data) is not CudaData:
        return None
    rep = q.data.cache.dequantize_repeat
    if rep is None or q.shape != rep.shape:
        return None
    try:
        if out is None:
            s = _streams.DEFAULT
            ov = _array.reserve(rep.shape, _F32, s)
        elif (ot := _torch_out(out, rep.shape)) is not None:
            ov, s = ot[0], _streams.torch_stream(ot[1])
        else:
            s = _streams.resolve(None, out)
            ov = _array.check_out(out, rep.shape, (_F32,), "dequantize")
    except Exception:  # noqa: BLE001 - out of memory, a bad out=: the whole way trims the pool or explains
        return None
    try:
        rep.launch(ov.arg, stream=s)
    finally:
        res = _array.result(ov, s) if out is None else out
    TAKEN["FastDequantize"] += 1
    HITS["dequantize" if out is None else "dequantize out="] += 1
    if rep.has_invalid_codes and not q.data.codes_checked():
        be.raise_if_bad_codes(q.data, s)  # reads the flag; re-zeroes it and names the element, or notes the check
    return res


def remember_dequantize(be: Any, q: QTensor) -> None:
    """After a whole-way float32 dequantize of `q` (into a new array or `out=`): keep its packed fast
    launch (FastDequantize made it) when q needs no other form (field orders, flat blocks)."""
    data = q.data
    if type(data) is not CudaData:
        return
    launch = data.cache.dequant
    if launch is None or data.cache.dequantize_repeat is not None or q.shape != data.shape or q.scheme != data.scheme or \
            be.kernel_data(data) is not data:
        return
    data.cache.dequantize_repeat = DequantizeRepeat(launch, q.shape, not data.scheme.valid_fields.all())


def matmul_again(be: Any, x: Any, w: Any, out: Any) -> Any:
    """`be.matmul(x, w, out=out)` (the stream x's) for a weight and shape of x whose launch is
    packed, x float32 on the device and 16-byte aligned; else None. A float32 torch x (and
    out=) is read as plain pointers (`_matmul_torch`), anything else through its DevView."""
    if type(w) is not QTensor or w.backend is not be or type(w.data) is not CudaData:
        return None
    t = _array.torch_f32(x)
    if t is not None:
        rep = w.data.cache.matmul_repeats.get(t[1])
        if rep is None:
            return None
        y = _matmul_torch(rep, t, out)
        if y is not None:
            return y
    try:
        v = _array.view_of(x)
    except Exception:  # noqa: BLE001
        return None
    if v is None or v.dtype != _F32 or not packed_takes(v):
        return None
    rep = w.data.cache.matmul_repeats.get(v.nd_shape)
    if rep is None:
        return None
    s = _streams.resolve(None, x)
    try:
        ov = _array.reserve(rep.out_shape, _F32, s) if out is None else \
            _array.check_out(out, rep.out_shape, (_F32,), "matmul")
    except Exception:  # noqa: BLE001 - the whole way explains a bad out= or a full device
        return None
    try:
        run_packed(rep.packed, v.arg, ov.arg, rep.m, s)
    finally:
        res = _array.result(ov, s) if out is None else out
    HITS["matmul"] += 1
    return res


def _matmul_torch(rep: MatmulRepeat, t: tuple, out: Any) -> Any:
    """The packed launch for x read by `_array.torch_f32` (`t`), with plain pointers, into a new
    result or a float32 torch `out=` of the result's shape or size, on x's torch stream; None
    where the DevView path must look (a misaligned x, another out=, a launch not held as a C
    argument array, a failed allocation)."""
    xptr, _, dev = t
    if not packed_aligned(xptr) or not rep.packed[1].raw_packed:
        return None
    s = _streams.torch_stream(dev)
    if out is None:
        try:
            ov = _array.reserve(rep.out_shape, _F32, s)
        except Exception:  # noqa: BLE001 - out of memory: the whole way trims the pool
            return None
    else:
        ot = _torch_out(out, rep.out_shape)
        if ot is None:
            return None
        ov = ot[0]
    try:
        ok = run_packed_values(rep.packed, xptr, ov.ptr, rep.m, s.handle)
    finally:
        res = _array.result(ov, s) if out is None else out  # (dropped if nothing ran: back to the pool)
    if not ok:
        return None
    HITS["matmul"] += 1
    return res


def _torch_out(out: Any, shape: tuple) -> tuple | None:
    """(DevView, device index) of a float32 torch `out=` of `shape` or of its element count, read
    by `_array.torch_f32`; None for anything else (`_array.check_out` looks at it)."""
    o = _array.torch_f32(out)
    if o is None:
        return None
    n = math.prod(shape)
    if o[1] != shape and out.numel() != n:
        return None
    return _array.DevView(o[0], o[1], _F32, out, None, n), o[2]


def remember_matmul(be: Any, x: Any, w: QTensor) -> None:
    """After a whole-way matmul: keep the weight's packed launch for x's shape when the call
    could take it again as it is (x float32 on the device; the weight in [K, N] form)."""
    try:
        v = _array.view_of(x)
    except Exception:  # noqa: BLE001
        return
    if v is None or v.dtype != _F32 or type(w.data) is not CudaData or len(v.nd_shape) < 1:
        return
    key = v.nd_shape
    repeats = w.data.cache.matmul_repeats
    if key in repeats:
        return
    repeats[key] = None  # a product the packed launches do not serve: no repeat, no second look
    if w.data.shape != w.shape:
        return
    m = math.prod(v.nd_shape[:-1])
    packed = be.kernel_data(w.data).cache.gemv.get(m)
    if packed is not None:
        repeats[key] = MatmulRepeat(packed, m, tuple(v.nd_shape[:-1]) + (w.shape[1],))
