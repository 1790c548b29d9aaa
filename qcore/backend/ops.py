"""Tensor ops on quantized tensors, shared by every backend (reshape, permute, slice, cat, matmul,
linear).

Where the layout allows, an op moves codes and scales and stays exact:

| op      | exact when                                                               |
|---------|--------------------------------------------------------------------------|
| permute | always (block dims are permuted with the axes)                           |
| reshape | per-tensor, or the trailing axes a block spans keep their extents        |
| slice   | per-tensor, or every start falls on a block edge (ends may cut a block)  |
| cat     | equal per-tensor scales / globals, and every part but the last fills     |
|         | whole blocks along the axis                                              |

Blocks over the flattened tensor (docs/spec.md, flat blocks) reshape exactly (the bytes do not
change) and requantize under the other ops unless the op leaves the tensor as it is.

Otherwise the op dequantizes, applies itself to the floats and requantizes with the same scheme
(calibrated afresh). `matmul` and `linear` never materialise the whole float weight.
"""
from __future__ import annotations

import operator
from dataclasses import replace
from typing import Any, Sequence

import numpy as np

from qcore.spec import layout
from qcore.backend.activations import host_activation, host_bias, in_callers_kind, product_dims, result_dtype
from qcore.backend.protocol import Backend, QTensor
from qcore.spec.arithmetic import QParams, decode, scaled_values
from qcore.errors import InputError
from qcore.spec.payload import QuantizedData
from qcore.spec.schemes import BlockLevel

__all__ = ["reshape", "permute", "slice_", "cat", "matmul", "linear"]


def _requantize(be: "Backend", q: "QTensor", fn) -> "QTensor":
    x = be.to_numpy(be.dequantize(q))
    return be.quantize(fn(x), q.scheme)


def _rebuild(be, scheme, shape, codes, scales, g, offsets=None) -> "QTensor":
    return be.from_data(QuantizedData.from_parts(tuple(shape), scheme, codes, scales, g, offsets))


def _on_grid(d: QuantizedData, fn) -> tuple[np.ndarray, np.ndarray | None]:
    """`fn` applied to the scales and to an affine scheme's offsets, which share the block grid."""
    o = d.offsets()
    return fn(d.scales()), (None if o is None else fn(o))


def reshape(be: "Backend", q: "QTensor", shape: Sequence[int]) -> "QTensor":
    try:
        shape = tuple(operator.index(d) for d in shape)
    except TypeError:
        raise InputError(f"reshape needs ints, got {shape!r}") from None
    try:
        new = np.empty(q.shape, dtype=np.uint8).reshape(shape).shape  # resolves -1, checks size
    except ValueError as e:
        raise InputError(f"cannot reshape {q.shape} to {shape}: {e}") from None
    layout.check_shape(new)
    if q.scheme.flat_blocks:  # flat blocks: the bytes are those of the flattened tensor, whatever its shape
        return be.from_data(QuantizedData(new, q.scheme, be.into_data(q).payload))
    block = q.scheme.block
    k = len(block.dims) if block else 0
    exact = block is None or (len(new) >= k and new[len(new) - k:] == q.shape[len(q.shape) - k:])
    try:
        layout.packing_axis(new, q.scheme)
    except InputError:
        exact = False
    if not exact:
        return _requantize(be, q, lambda x: x.reshape(new))
    d = be.into_data(q)
    grid = layout.grid_shape(new, q.scheme)
    scales, offsets = _on_grid(d, lambda a: a.reshape(grid))
    return _rebuild(be, q.scheme, new, d.codes().reshape(new), scales, d.global_scale(), offsets)


def permute(be: "Backend", q: "QTensor", axes: Sequence[int]) -> "QTensor":
    rank = len(q.shape)
    try:
        axes = tuple(operator.index(a) % rank if -rank <= operator.index(a) < rank else rank for a in axes)
    except TypeError:
        raise InputError(f"permute needs int axes, got {axes!r}") from None
    if sorted(axes) != list(range(rank)):
        raise InputError(f"axes {axes} are not a permutation of range({rank})")
    if q.scheme.flat_blocks:  # flat blocks follow the flattened order, which a permutation changes
        return q if axes == tuple(range(rank)) else _requantize(be, q, lambda x: np.transpose(x, axes))
    d = be.into_data(q)
    new_shape = tuple(q.shape[a] for a in axes)
    scheme = q.scheme
    scales, offsets = _on_grid(d, lambda a: a)
    if scheme.block is not None:
        full = layout.full_block(q.shape, scheme)
        dims = tuple(full[a] for a in axes)
        trimmed = dims
        while len(trimmed) > 1 and trimmed[0] == 1:
            trimmed = trimmed[1:]
        if len(trimmed) > 5:
            raise InputError(
                f"permuting {q.shape} by {axes} would need a {len(trimmed)}-dim block; blocks have at most 5"
            )
        scheme = replace(scheme, block=BlockLevel(trimmed, scheme.block.dtype))
        scales, offsets = _on_grid(d, lambda a: np.transpose(a, axes))
    return _rebuild(be, scheme, new_shape, np.transpose(d.codes(), axes), scales, d.global_scale(), offsets)


def _norm_index(index, shape) -> list[tuple[int, int]]:
    if isinstance(index, slice):
        index = (index,)
    index = tuple(index)
    if len(index) > len(shape):
        raise InputError(f"slice has {len(index)} entries for rank {len(shape)}")
    out = []
    for i, d in enumerate(shape):
        s = index[i] if i < len(index) else slice(None)
        if not isinstance(s, slice):
            raise InputError(f"slice entries must be slice objects (rank is kept), got {s!r}")
        start, stop, step = s.indices(d)
        if step != 1:
            raise InputError(f"slice steps other than 1 are not supported, got {s}; permute or requantize instead")
        out.append((start, max(start, stop)))
    return out


def slice_(be: "Backend", q: "QTensor", index) -> "QTensor":
    bounds = _norm_index(index, q.shape)
    sl = tuple(slice(a, b) for a, b in bounds)
    new_shape = tuple(b - a for a, b in bounds)
    if q.scheme.flat_blocks:  # a slice of the flattened blocks is no tensor's flattening
        return q if new_shape == q.shape else _requantize(be, q, lambda x: x[sl])
    block = layout.full_block(q.shape, q.scheme)
    if block is not None:
        aligned = all(a % bl == 0 for (a, _), bl in zip(bounds, block))  # a cut end keeps its block's scale
        if not aligned:
            return _requantize(be, q, lambda x: x[sl])
    d = be.into_data(q)
    grid_sl = tuple(slice(a // bl, -(-b // bl)) for (a, b), bl in zip(bounds, block)) if block else ()
    scales, offsets = _on_grid(d, lambda a: a[grid_sl] if block is not None else a)
    return _rebuild(be, q.scheme, new_shape, d.codes()[sl], scales, d.global_scale(), offsets)


def cat(be: "Backend", qs: Sequence["QTensor"], axis: int = 0) -> "QTensor":
    if not qs:
        raise InputError("cat needs at least one tensor")
    scheme, rank = qs[0].scheme, len(qs[0].shape)
    if any(q.scheme != scheme for q in qs):
        raise InputError(f"cat needs one scheme, got {sorted({str(q.scheme) for q in qs})}; requantize first")
    if not -rank <= axis < rank:
        raise InputError(f"axis {axis} out of range for rank {rank}")
    axis %= rank
    for q in qs:
        if len(q.shape) != rank or any(q.shape[i] != qs[0].shape[i] for i in range(rank) if i != axis):
            raise InputError(f"cat shapes differ off axis {axis}: {[q.shape for q in qs]}")
    if scheme.flat_blocks:  # flat blocks: requantized (the parts' flattened blocks do not join up in general)
        x = np.concatenate([be.to_numpy(be.dequantize(q)) for q in qs], axis=axis)
        return be.quantize(x, scheme)
    datas = [be.into_data(q) for q in qs]
    block = layout.full_block(qs[0].shape, scheme)
    globals_ = {np.float32(d.global_scale()).tobytes() for d in datas} if scheme.two_level else {b""}
    if block is None:
        exact = len({d.scales().tobytes() for d in datas}) == 1 and len(
            {b"" if d.offsets() is None else d.offsets().tobytes() for d in datas}) == 1
    else:
        exact = len(globals_) == 1 and all(q.shape[axis] % block[axis] == 0 for q in qs[:-1])
    if not exact:
        x = np.concatenate([be.to_numpy(be.dequantize(q)) for q in qs], axis=axis)
        return be.quantize(x, scheme)
    codes = np.concatenate([d.codes() for d in datas], axis=axis)
    scales = datas[0].scales() if block is None else np.concatenate([d.scales() for d in datas], axis=axis)
    offsets = None
    if scheme.affine:
        offsets = datas[0].offsets() if block is None else np.concatenate([d.offsets() for d in datas], axis=axis)
    return _rebuild(be, scheme, codes.shape, codes, scales, datas[0].global_scale(), offsets)


def _row_bands(be: "Backend", w: "QTensor", rows_per_step: int):
    """(r0, r1, rows r0..r1 of the 2-D weight `w` dequantized to float32) for bands of about
    `rows_per_step` rows (whole blocks along axis 0), so the full float weight never exists; one
    band of the whole weight where blocks over the flattened tensor cross rows. A payload
    holding an invalid code raises `InvalidDataError` first."""
    d = be.into_data(w)
    d.check_codes()  # a code outside the value's set is InvalidDataError, never a value (invalid codes)
    codes, scales, g, offsets = d.codes(), d.scales(), d.global_scale(), d.offsets()
    scheme = w.scheme
    rows, cols = w.shape
    if scheme.flat_blocks:  # blocks over the flattened tensor
        shape_i, scheme = layout.flat_form(w.shape, scheme)
        if shape_i != w.shape:  # blocks cross rows: the weight is dequantized whole
            yield 0, rows, be.to_numpy(be.dequantize(w)).astype(np.float32, copy=False)
            return
        grid = layout.grid_shape(shape_i, scheme)
        scales, offsets = scales.reshape(grid), None if offsets is None else offsets.reshape(grid)
    block = layout.full_block(w.shape, scheme)
    br = block[0] if block else 1
    step = max(br, (rows_per_step // br) * br)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        sel = (...,) if block is None else slice(r0 // br, -(-r1 // br))  # per-tensor: the 0-d scale
        sub = QParams(scales[sel], g, None if offsets is None else offsets[sel])
        yield r0, r1, scaled_values(decode(codes[r0:r1], scheme), sub, (r1 - r0, cols), scheme)


def _product(be: "Backend", what: str, x: Any, w: "QTensor", dtype: Any, rows_per_step: int,
             bias: Any = None, bands: Any = None) -> Any:
    """The f32 sums of `matmul` (bands of K rows of w [K, N], added) or `linear` (bands of N rows
    of w [N, K], side by side), the bias, one rounding to the result dtype, in x's array kind.
    `bands(w, rows_per_step)` gives the weight's (r0, r1, float32 rows) (default `_row_bands`: the
    core's decode; a backend passes its own kernel's, the same values)."""
    xa, as_torch = host_activation(x)
    k_, n_ = product_dims(what, xa.shape, w.shape)
    out_dt = result_dtype(xa.dtype, dtype)
    b = host_bias(bias, n_)
    x32 = xa.astype(np.float32, copy=False)
    out = np.zeros(xa.shape[:-1] + (n_,), dtype=np.float32)
    for r0, r1, wf in (bands(w, rows_per_step) if bands is not None else _row_bands(be, w, rows_per_step)):
        if what == "matmul":
            out += x32[..., r0:r1] @ wf
        else:
            out[..., r0:r1] = x32 @ wf.T
    if b is not None:
        out += b
    return in_callers_kind(out.astype(out_dt, copy=False), as_torch)


def matmul(be: "Backend", x: Any, w: "QTensor", rows_per_step: int = 1024, *,
           dtype: Any = np.float32, bands: Any = None) -> Any:
    """`x @ dequantize(w)` for float x [..., K] and w [K, N] with f32 accumulation, dequantizing
    `rows_per_step` rows of w at a time (rounded to whole blocks), so the full float weight never
    exists; the f32 sums are rounded once to `dtype` (default float32; None: x's dtype). `bands`:
    see `_product`."""
    return _product(be, "matmul", x, w, dtype, rows_per_step, bands=bands)


def linear(be: "Backend", x: Any, w: "QTensor", bias: Any = None, rows_per_step: int = 1024, *,
           dtype: Any = None, bands: Any = None) -> Any:
    """`x @ dequantize(w).T + bias` for float x [..., K] and a linear layer's weight w [N, K] (as
    checkpoints store it): f32 accumulation, bias added in f32, one rounding to `dtype` (default:
    x's dtype); `rows_per_step` rows of w dequantized at a time, so the full float weight never
    exists (docs/spec.md, "Products with a quantized weight"). `bands`: see `_product`."""
    return _product(be, "linear", x, w, dtype, rows_per_step, bias, bands)
