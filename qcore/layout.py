"""Block grid, edge blocks and bit packing along an axis (SPEC §2.1, §3).

Backends follow these rules rather than inventing their own; the functions here are the
plain-numpy statement of them and are used by the reference backend and the payload codec.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from .errors import InputError
from .scheme import INT64_MAX, QuantScheme, StoreKind

MAX_EXTENT_PRODUCT = 1 << 50
"""Largest product of a shape's non-zero extents (a thousand times the largest tensors in use):
numpy builds an array, even an empty one, only when that product times its item size fits int64,
and kernels add axes (codes per word) and wider items (float64) to it."""

__all__ = [
    "check_shape",
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
]


def check_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """A tensor shape: rank >= 1, non-negative ints (SPEC §2)."""
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


def full_block(shape: Sequence[int], scheme: QuantScheme) -> tuple[int, ...] | None:
    """Block dims padded with leading 1s to the tensor's rank; None when there is no block level."""
    if scheme.block is None:
        return None
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
    (SPEC v1.1 §3), so work sized by these extents costs no more than the tensor itself.
    """
    block = full_block(shape, scheme)
    if block is None:
        return None
    return tuple(max(1, min(b, d)) for d, b in zip(shape, block))


def grid_shape(shape: Sequence[int], scheme: QuantScheme) -> tuple[int, ...]:
    """Shape of the scale slots: `ceil(dim / block)` per axis; `()` for one per-tensor slot."""
    block = full_block(shape, scheme)
    if block is None:
        return ()
    return tuple(-(-d // b) for d, b in zip(shape, block))


def scales_count(shape: Sequence[int], scheme: QuantScheme) -> int:
    return math.prod(grid_shape(shape, scheme))


def packing_axis(shape: Sequence[int], scheme: QuantScheme) -> int | None:
    """Axis `rank - 1 - d` of a packed store; None for Native."""
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
    """The shape of the stored words: `shape` with the packing axis replaced by ceil(extent / n)."""
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
    block = block_extents(shape, scheme)
    per_slot = np.asarray(per_slot)
    if math.prod(shape) == 0:
        return np.zeros(tuple(shape), dtype=per_slot.dtype)
    if block is None:
        return np.broadcast_to(per_slot.reshape(()), tuple(shape))
    out = per_slot
    for axis, (d, b) in enumerate(zip(shape, block)):
        out = np.repeat(out, b, axis=axis)
        out = np.take(out, np.arange(d), axis=axis)
    return out


def pack(codes: np.ndarray, scheme: QuantScheme) -> np.ndarray:
    """Codes (shape of the tensor) -> stored words as a flat uint8 array (SPEC §3).

    Along the packing axis, runs of n codes fill one word; code k of a run goes to bits
    [k*bits, (k+1)*bits), code 0 lowest; the last word of each line is zero-padded.
    """
    codes = np.asarray(codes)
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
        [fields, np.zeros(fields.shape[:-1] + (padded - extent,), np.uint32)], axis=-1
    ).reshape(fields.shape[:-1] + (padded // n, n))
    shifts = (np.arange(n, dtype=np.uint32) * np.uint32(bits))
    words = np.bitwise_or.reduce(fields << shifts, axis=-1).astype(wdt)
    words = np.moveaxis(words, -1, axis)
    return np.ascontiguousarray(words).view(np.uint8).reshape(-1)


def unpack(buf: np.ndarray | bytes, shape: Sequence[int], scheme: QuantScheme) -> np.ndarray:
    """Stored words (bytes) -> codes of `shape`: int8 (sign-extended) for integer values,
    uint8 for minifloat codes and LOOKUP indices (SPEC §3)."""
    shape = tuple(shape)
    if math.prod(shape) == 0:
        return np.zeros(shape, dtype=scheme.code_dtype)
    raw = np.frombuffer(bytes(buf) if not isinstance(buf, np.ndarray) else buf.tobytes(), dtype=np.uint8)
    out_dtype = scheme.code_dtype
    signed = out_dtype == np.int8
    axis = packing_axis(shape, scheme)
    if axis is None:
        return raw.view(out_dtype).reshape(shape).copy()
    bits, n = scheme.bits, fields_per_word(scheme)
    wshape = words_shape(shape, scheme)
    words = raw.view(_word_dtype(scheme)).reshape(wshape).astype(np.uint32)
    words = np.moveaxis(words, axis, -1)
    shifts = np.arange(n, dtype=np.uint32) * np.uint32(bits)
    fields = (words[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    fields = fields.reshape(words.shape[:-1] + (words.shape[-1] * n,))[..., : shape[axis]]
    if signed:  # sign-extend a `bits`-wide two's-complement field
        fields = fields.astype(np.int32)
        fields = np.where(fields >= (1 << (bits - 1)), fields - (1 << bits), fields)
    return np.ascontiguousarray(np.moveaxis(fields, -1, axis)).astype(out_dtype)
