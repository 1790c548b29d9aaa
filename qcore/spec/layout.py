"""Block grid, edge blocks and bit packing along an axis (docs/spec.md, calibration and portable bytes).

Backends follow these rules rather than inventing their own; the functions here are the
plain-numpy statement of them and are used by the reference backend and the payload codec.
"""
from __future__ import annotations

import functools
import math
from typing import Sequence

import numpy as np

from qcore.errors import InputError
from qcore.spec.parts import INT64_MAX
from qcore.spec.schemes import FieldOrder, QuantScheme, StoreKind

MAX_EXTENT_PRODUCT = 1 << 50
"""Largest product of a shape's non-zero extents (a thousand times the largest tensors in use):
numpy builds an array, even an empty one, only when that product times its item size fits int64,
and kernels add axes (codes per word) and wider items (float64) to it."""

__all__ = [
    "check_shape",
    "flat_form",
    "field_positions",
    "full_block",
    "block_extents",
    "grid_shape",
    "packing_axis",
    "fields_per_word",
    "words_shape",
    "values_nbytes",
    "scales_count",
    "expand_to_elements",
    "pack",
    "unpack",
    "reorder_values",
]


def check_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """A tensor shape: rank >= 1, non-negative ints (docs/spec.md, arithmetic)."""
    try:
        shape = tuple(int(d) for d in shape)
    except (TypeError, ValueError):
        raise InputError(f"shape must be a sequence of ints, got {shape!r}") from None
    if len(shape) < 1:
        raise InputError("tensors need rank >= 1, got a scalar; reshape it to (1,)")
    if any(d < 0 for d in shape):
        raise InputError(f"shape dims must be >= 0, got {shape}")
    if any(d > INT64_MAX for d in shape):
        raise InputError(f"shape dims must fit int64 (<= 2**63-1), got {shape}")
    if math.prod(d for d in shape if d) > MAX_EXTENT_PRODUCT:
        raise InputError(
            f"shape {shape} spans more than 2**50 elements (its non-zero extents multiplied), more than "
            "an array can index even when empty; no real tensor is this large"
        )
    return shape


def flat_form(shape: Sequence[int], scheme: QuantScheme) -> tuple[tuple[int, ...], QuantScheme]:
    """(shape, scheme) as kernels see them (docs/spec.md, flat blocks). A scheme with blocks over
    the flattened tensor stores a tensor of shape S as the 1-D tensor [prod(S)] of `scheme.unflat`;
    where S's last axis holds whole blocks, whole words and whole split groups, those bytes are
    also S under `scheme.unflat` (blocks [B] never cross a row, no word is padded), and that form
    is returned, so the 2-D kernels (matmul) apply. Other schemes pass through."""
    if not scheme.flat_blocks:
        return tuple(shape), scheme
    shape = tuple(int(d) for d in shape)
    inner = scheme.unflat
    last = shape[-1] if shape else 0
    st = inner.store
    if len(shape) > 1 and last and last % inner.block.dims[0] == 0 and last % fields_per_word(inner) == 0 and \
            (st.order is not FieldOrder.SPLIT or last % st.group == 0):
        return shape, inner
    return (math.prod(shape),), inner


def field_positions(extent: int, n: int, order: FieldOrder, group: int = 0) -> np.ndarray:
    """int64 [ceil(extent / n), n]: the element (position along the packing axis) that field f of
    word j of a line holds, or `extent` for a padding field (docs/spec.md, field orders).

    LOW (the byte layout): j*n + f. HIGH: j*n + n-1-f. SPLIT with groups of G elements: the line is
    cut into groups (the last may be shorter, L elements, W = ceil(L / n) words); word j of a group
    holds its elements j, j + W, ..., j + (n-1)W, field f the element f*W + j."""
    words = -(-extent // n)
    j = np.arange(words, dtype=np.int64)[:, None]
    f = np.arange(n, dtype=np.int64)[None, :]
    if order is FieldOrder.LOW:
        p = j * n + f
    elif order is FieldOrder.HIGH:
        p = j * n + (n - 1 - f)
    else:
        gw = group // n  # words per whole group
        g, jj = j // gw, j % gw
        length = np.minimum(group, extent - g * group)
        w = -(-length // n)
        p = g * group + f * w + jj
        p = np.where(f * w + jj < length, p, extent)
    return np.where(p < extent, p, extent)


def full_block(shape: Sequence[int], scheme: QuantScheme) -> tuple[int, ...] | None:
    """Block dims padded with leading 1s to the tensor's rank; None when there is no block level.
    Blocks over the flattened tensor have per-axis dims only in `flat_form`'s shape."""
    if scheme.block is None:
        return None
    if scheme.flat_blocks:
        flat_shape, inner = flat_form(shape, scheme)
        if flat_shape != tuple(shape):
            raise ValueError(f"{scheme} on {tuple(shape)} has no per-axis blocks: take layout.flat_form first")
        return full_block(shape, inner)
    dims = scheme.block.dims
    if len(dims) > len(shape):
        raise InputError(
            f"block {'x'.join(map(str, dims))} has {len(dims)} dims but the tensor has rank {len(shape)} "
            f"(shape {tuple(shape)}); use a block with at most {len(shape)} dims"
        )
    return (1,) * (len(shape) - len(dims)) + tuple(dims)


def block_extents(shape: Sequence[int], scheme: QuantScheme) -> tuple[int, ...] | None:
    """`full_block` with each dim clamped to its axis extent (at least 1); None per-tensor.

    A block larger than its axis covers the same elements as a block equal to the extent
    (docs/spec.md, size claims), so work sized by these extents costs no more than the tensor itself.
    """
    block = full_block(shape, scheme)
    if block is None:
        return None
    return tuple(max(1, min(b, d)) for d, b in zip(shape, block))


def grid_shape(shape: Sequence[int], scheme: QuantScheme) -> tuple[int, ...]:
    """Shape of the scale slots: `ceil(dim / block)` per axis; `()` for one per-tensor slot;
    `(ceil(prod / B),)` for blocks over the flattened tensor, whatever `flat_form` gives."""
    if scheme.flat_blocks:
        return (-(-math.prod(shape) // scheme.block.dims[0]),)
    block = full_block(shape, scheme)
    if block is None:
        return ()
    return tuple(-(-d // b) for d, b in zip(shape, block))


def scales_count(shape: Sequence[int], scheme: QuantScheme) -> int:
    return math.prod(grid_shape(shape, scheme))


def packing_axis(shape: Sequence[int], scheme: QuantScheme) -> int | None:
    """Axis `rank - 1 - d` of a packed store; None for Native. (Blocks over the flattened
    tensor pack `flat_form`'s shape.)"""
    store = scheme.store
    if store.kind is StoreKind.NATIVE:
        return None
    if store.dim >= len(shape):
        raise InputError(
            f"packing axis {store.dim} of {scheme} needs rank > {store.dim}, got shape {tuple(shape)}; "
            f"use {store.kind.value}:0"
        )
    return len(shape) - 1 - store.dim


def fields_per_word(scheme: QuantScheme) -> int:
    """`n`: codes per u32 (PackedU32), per byte (PackedNative) or 1 (Native)."""
    if scheme.store.kind is StoreKind.NATIVE:
        return 1
    return scheme.store.word_bits // scheme.bits


def words_shape(shape: Sequence[int], scheme: QuantScheme) -> tuple[int, ...]:
    """The shape of the stored words: `shape` with the packing axis replaced by ceil(extent / n)
    (of `flat_form`'s shape under blocks over the flattened tensor)."""
    shape, scheme = flat_form(shape, scheme)
    axis = packing_axis(shape, scheme)
    if axis is None:
        return tuple(shape)
    n = fields_per_word(scheme)
    out = list(shape)
    out[axis] = -(-out[axis] // n)
    return tuple(out)


def _word_dtype(scheme: QuantScheme) -> np.dtype:
    return np.dtype("<u4" if scheme.store.kind is StoreKind.PACKED_U32 else "<u1")


def values_nbytes(shape: Sequence[int], scheme: QuantScheme) -> int:
    return math.prod(words_shape(shape, scheme)) * _word_dtype(scheme).itemsize


def expand_to_elements(per_slot: np.ndarray, shape: Sequence[int], scheme: QuantScheme) -> np.ndarray:
    """Broadcast one value per scale slot to every element it covers (edge blocks cropped).

    An empty shape gives an empty array at once, however large its other extents.
    """
    per_slot = np.asarray(per_slot)
    if math.prod(shape) == 0:
        return np.zeros(tuple(shape), dtype=per_slot.dtype)
    if scheme.flat_blocks:
        inner_shape, inner = flat_form(shape, scheme)
        return expand_to_elements(per_slot.reshape(grid_shape(inner_shape, inner)), inner_shape,
                                  inner).reshape(tuple(shape))
    block = block_extents(shape, scheme)
    if block is None:
        return np.broadcast_to(per_slot.reshape(()), tuple(shape))
    out = per_slot
    for axis, (d, b) in enumerate(zip(shape, block)):
        out = np.repeat(out, b, axis=axis)
        out = np.take(out, np.arange(d), axis=axis)
    return out


def pack(codes: np.ndarray, scheme: QuantScheme) -> np.ndarray:
    """Codes (shape of the tensor) -> stored words as a flat uint8 array (docs/spec.md, portable bytes).

    Along the packing axis, runs of n codes fill one word; code k of a run goes to bits
    [k*bits, (k+1)*bits), code 0 lowest; the last word of each line is zero-padded.
    """
    codes = np.asarray(codes)
    if scheme.flat_blocks:
        shape, scheme = flat_form(codes.shape, scheme)
        codes = codes.reshape(shape)
    axis = packing_axis(codes.shape, scheme)
    if codes.size == 0:
        return np.zeros(0, dtype=np.uint8)
    if axis is None:
        return np.ascontiguousarray(codes).view(np.uint8).reshape(-1)
    bits, n = scheme.bits, fields_per_word(scheme)
    wdt = _word_dtype(scheme)
    fields = codes.view(np.uint8).astype(np.uint32) & np.uint32((1 << bits) - 1)
    fields = np.moveaxis(fields, axis, -1)
    extent = fields.shape[-1]
    padded = -(-extent // n) * n
    fields = np.concatenate(
        [fields, np.zeros(fields.shape[:-1] + (padded - extent + 1,), np.uint32)], axis=-1)
    if scheme.store.order is FieldOrder.LOW:
        fields = fields[..., :padded].reshape(fields.shape[:-1] + (padded // n, n))
    else:  # field orders: field f of word j holds element field_positions[j, f] (`extent`: the zero pad)
        fields = fields[..., field_positions(extent, n, scheme.store.order, scheme.store.group)]
    shifts = (np.arange(n, dtype=np.uint32) * np.uint32(bits))
    words = np.bitwise_or.reduce(fields << shifts, axis=-1).astype(wdt)
    words = np.moveaxis(words, -1, axis)
    return np.ascontiguousarray(words).view(np.uint8).reshape(-1)


@functools.lru_cache(maxsize=None)
def _byte_fields(bits: int, signed: bool) -> np.ndarray:
    """[256, 8 // bits]: the `bits`-wide fields of each byte value, lowest first (the byte layout's
    order), sign-extended two's complement when `signed` (int8), else uint8."""
    shifts = np.arange(8 // bits, dtype=np.int32) * bits
    fields = (np.arange(256, dtype=np.int32)[:, None] >> shifts) & ((1 << bits) - 1)
    if signed:
        fields = np.where(fields >= 1 << (bits - 1), fields - (1 << bits), fields)
    return fields.astype(np.int8 if signed else np.uint8)


def unpack(buf: np.ndarray | bytes, shape: Sequence[int], scheme: QuantScheme) -> np.ndarray:
    """Stored words (bytes) -> codes of `shape`: int8 (sign-extended) for integer values,
    uint8 for minifloat codes and LOOKUP indices (docs/spec.md, portable bytes)."""
    shape = tuple(shape)
    if math.prod(shape) == 0:
        return np.zeros(shape, dtype=scheme.code_dtype)
    if scheme.flat_blocks:
        inner_shape, inner = flat_form(shape, scheme)
        return unpack(buf, inner_shape, inner).reshape(shape)
    raw = np.frombuffer(bytes(buf) if not isinstance(buf, np.ndarray) else buf.tobytes(), dtype=np.uint8)
    out_dtype = scheme.code_dtype
    signed = out_dtype == np.int8
    axis = packing_axis(shape, scheme)
    if axis is None:
        return raw.view(out_dtype).reshape(shape).copy()
    bits, n = scheme.bits, fields_per_word(scheme)
    wshape = words_shape(shape, scheme)
    extent = shape[axis]
    if scheme.store.order is FieldOrder.LOW and 8 % bits == 0:
        # Fields never straddle a byte, and a little-endian word's bytes come low first: each
        # byte gives its 8 / bits fields in order, from one table (the words' fields, as below).
        line = np.ascontiguousarray(np.moveaxis(raw.view(_word_dtype(scheme)).reshape(wshape), axis, -1))
        by_byte = _byte_fields(bits, signed)[line.view(np.uint8)]
        fields = by_byte.reshape(line.shape[:-1] + (-1,))[..., :extent]
        return np.ascontiguousarray(np.moveaxis(fields, -1, axis)).astype(out_dtype, copy=False)
    words = raw.view(_word_dtype(scheme)).reshape(wshape).astype(np.uint32)
    words = np.moveaxis(words, axis, -1)
    shifts = np.arange(n, dtype=np.uint32) * np.uint32(bits)
    fields = (words[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    if scheme.store.order is FieldOrder.LOW:
        fields = fields.reshape(words.shape[:-1] + (words.shape[-1] * n,))[..., :extent]
    else:  # field orders: element field_positions[j, f] is in field f of word j (padding goes to `extent`)
        pos = field_positions(extent, n, scheme.store.order, scheme.store.group)
        line = np.zeros(words.shape[:-1] + (extent + 1,), np.uint32)
        line[..., pos] = fields
        fields = line[..., :extent]
    if signed:  # sign-extend a `bits`-wide two's-complement field
        fields = fields.astype(np.int32)
        fields = np.where(fields >= (1 << (bits - 1)), fields - (1 << bits), fields)
    return np.ascontiguousarray(np.moveaxis(fields, -1, axis)).astype(out_dtype)


def reorder_values(payload: bytes, shape: Sequence[int], src: QuantScheme, dst: QuantScheme) -> bytes:
    """`payload` (of `shape` under `src`) with its values section packed as `dst` packs it: the
    same codes, the fields in `dst`'s order (docs/spec.md, field orders); the other sections as
    they are. `src` and `dst` differ only in their store's field order."""
    n = values_nbytes(shape, src)
    codes = unpack(np.frombuffer(payload, np.uint8, count=n), shape, src)
    return pack(codes, dst).tobytes() + bytes(payload[n:])
