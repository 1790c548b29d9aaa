"""Deliberately broken backends: each carries one bug a real kernel has had, and the conformance
suite's default run must catch every one of them (tests/conformance/test_mutants.py), while the clean twins
pass.

Two models, as plugin authors write backends:

- `Narrow`: a small third-party plugin in plain numpy, with its own arithmetic (no qcore maths):
  q8s only, F32 per-tensor or per-block scales, the Native store. Its author expects
  `NARROW_EXPECT`.
- `Full`: every scheme, the reference maths re-assembled from overridable steps (encode, scale
  rounding, statistic, bytes), so one step at a time can be broken. Its author expects
  everything.

`MUTANTS` lists (model, id, class, what the bug is); `docs/plugins.md` carries the kill table.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import ml_dtypes
import numpy as np

from qcore.spec import arithmetic
from qcore.spec import layout
from qcore.spec.checks import raise_nonfinite, to_f32
from qcore.spec.codecs import F32_TINY, bits_f32, f32_bits
from qcore.spec.payload import QuantizedData, sections
from qcore.errors import InputError
from qcore.backend.base import BaseBackend
from qcore.backend.protocol import QParams, QTensor, Support
from qcore.spec.arithmetic import decode, effective_scale, encode, slot_statistic, store_reciprocal
from qcore.backend.reference import ReferenceBackend
from qcore.spec.schemes import QuantScheme, QuantStore, ScaleDtype, StoreKind, TensorLevel

NARROW_EXPECT = "q8s/tensor:f32/native,q8s/block*:f32/native,q8s/block*:f32/native/flat"
"""What the narrow plugin's author says it supports (`--expect` patterns): its own schemes, and
their blocks over the flattened tensor, which the core runs on its hooks (docs/spec.md)."""
FULL_EXPECT = "*"
"""The full model supports every scheme."""


# =========================================================================== narrow plugin


@dataclass
class _Q:
    """The narrow plugin's tensor: int8 codes and f32 scales (block-grid shape)."""

    shape: tuple[int, ...]
    scheme: QuantScheme
    codes: np.ndarray
    scales: np.ndarray


class Narrow(BaseBackend):
    """q8s with F32 per-tensor or per-block scales in the Native store, in plain numpy."""

    name = "narrow"
    priority = 1
    scheme_features = {"flat"}  # blocks over the flattened tensor: the core's, on its hooks

    def _supports(self, s: QuantScheme) -> Support:
        if s.value.value != "q8s" or s.is_lookup:
            return Support.no("narrow runs symmetric q8s only; use reference")
        if s.two_level or s.slot_dtype is not ScaleDtype.F32:
            return Support.no("narrow stores one level of F32 scales only")
        if s.store.kind is not StoreKind.NATIVE:
            return Support.no("narrow writes the Native store only")
        if s.reciprocal_codes or s.affine:
            return Support.no("narrow codes by SPEC v1's x / e only, without offsets")
        return Support.yes()

    # ---------------------------------------------------------------- steps (mutation points)
    def _check(self, x: np.ndarray) -> None:
        raise_nonfinite(x)

    def _round(self, y: np.ndarray) -> np.ndarray:
        return np.rint(y)

    def _clamp(self, q: np.ndarray) -> np.ndarray:
        return np.clip(q, -127, 127)

    def _divide(self, stat: np.ndarray) -> np.ndarray:
        return (stat / np.float32(127.0)).astype(np.float32)

    def _statistic_input(self, a: np.ndarray) -> np.ndarray:
        return a

    def _scale_dtype(self) -> str:
        return "<f4"

    def _kernel(self, s: QuantScheme) -> None:
        """Hook for a kernel that is missing for some scheme."""

    # ---------------------------------------------------------------- blocks
    @staticmethod
    def _block(shape, s: QuantScheme) -> tuple[int, ...]:
        if s.block is None:
            return tuple(shape)
        return (1,) * (len(shape) - len(s.block.dims)) + s.block.dims

    def _reduce(self, a: np.ndarray, s: QuantScheme, method: str) -> np.ndarray:
        b = self._block(a.shape, s)
        grid = [-(-d // k) for d, k in zip(a.shape, b)]
        pad = np.zeros([g * k for g, k in zip(grid, b)], np.float32)
        pad[tuple(slice(0, d) for d in a.shape)] = a
        v = pad.reshape([x for gk in zip(grid, b) for x in gk])
        axes = tuple(range(1, v.ndim, 2))
        if method == "minmax":
            out = v.max(axis=axes, initial=np.float32(0)).astype(np.float32)
        else:
            cnt = np.ones((), np.int64)
            for d, k, g in zip(a.shape, b, grid):
                cnt = np.multiply.outer(cnt, np.minimum(k, d - np.arange(g) * k))
            out = (v.sum(axis=axes, dtype=np.float64) / np.maximum(cnt, 1)).astype(np.float32)
        return out.reshape(grid) if s.block is not None else out.reshape(())

    def _expand(self, scales: np.ndarray, shape, s: QuantScheme) -> np.ndarray:
        if s.block is None:
            return np.broadcast_to(np.asarray(scales, np.float32).reshape(()), shape)
        out = np.asarray(scales, np.float32)
        for ax, (d, k) in enumerate(zip(shape, self._block(shape, s))):
            out = np.repeat(out, k, axis=ax)[(slice(None),) * ax + (slice(0, d),)]
        return out

    # ---------------------------------------------------------------- hooks
    def _calibrate(self, x: Any, s: QuantScheme, method: str) -> QParams:
        x = to_f32(x)
        self._check(x)
        self._kernel(s)
        stat = self._reduce(self._statistic_input(np.abs(x)), s, method)
        return QParams(self._divide(stat), None)

    def _quantize(self, x: Any, s: QuantScheme, params: QParams | None, method: str) -> _Q:
        x = to_f32(x)
        self._check(x)
        p = params or self._calibrate(x, s, method)
        scales = np.asarray(p.scales, np.float32)
        e = self._expand(scales, x.shape, s)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            y = np.where(e == 0, np.float32(0), x / e).astype(np.float32)
        q = self._clamp(self._round(y)).astype(np.int8)
        return _Q(tuple(x.shape), s, q, scales)

    def _dequantize(self, q: _Q, dtype: np.dtype) -> np.ndarray:
        y = (q.codes.astype(np.float32) * self._expand(q.scales, q.shape, q.scheme)).astype(np.float32)
        with np.errstate(over="ignore"):
            return y.astype(dtype)

    def _into_data(self, q: _Q) -> QuantizedData:
        sc = np.ascontiguousarray(q.scales.reshape(-1).astype(self._scale_dtype())).tobytes()
        return QuantizedData(q.shape, q.scheme, q.codes.tobytes() + sc)

    def _from_data(self, d: QuantizedData) -> _Q:
        d.check_codes()  # invalid codes (docs/spec.md): a code outside the value's set is invalid data
        n = math.prod(d.shape)
        raw = d.payload
        codes = np.frombuffer(raw, np.int8, count=n).reshape(d.shape).copy()
        grid = layout.grid_shape(d.shape, d.scheme)
        scales = np.frombuffer(raw, self._scale_dtype(), offset=n).astype(np.float32).reshape(grid)
        return _Q(tuple(d.shape), d.scheme, codes, scales)


class NarrowHalfAway(Narrow):
    name = "narrow-half-away"

    def _round(self, y):
        return np.trunc(y + np.copysign(np.float32(0.5), y))


class NarrowHalfUp(Narrow):
    name = "narrow-half-up"

    def _round(self, y):
        return np.floor(y + np.float32(0.5))


class NarrowTruncate(Narrow):
    name = "narrow-truncate"

    def _round(self, y):
        return np.trunc(y)


class NarrowClamp128(Narrow):
    name = "narrow-clamp-128"

    def _clamp(self, q):
        return np.clip(q, -128, 127)


class NarrowBigEndianScales(Narrow):
    name = "narrow-big-endian"

    def _scale_dtype(self):
        return ">f4"


class NarrowNoNonfiniteCheck(Narrow):
    name = "narrow-no-nonfinite"

    def _check(self, x):
        pass


class NarrowRefusesBlocks(Narrow):
    name = "narrow-refuses-blocks"

    def _supports(self, s):
        if s.block is not None:
            return Support.no("blocks are not implemented yet")
        return super()._supports(s)


class NarrowClaimsAndRaises(Narrow):
    name = "narrow-claims-raises"

    def _kernel(self, s):
        if s.block is not None and len(s.block.dims) > 1:
            raise NotImplementedError("2-D blocks: kernel not written")


class NarrowEdgeOffByOne(Narrow):
    name = "narrow-edge-off-by-one"

    def _statistic_input(self, a):
        a = a.copy()
        if a.size:
            a.reshape(-1)[-1] = 0  # the reduction loop stops one element early
        return a


class NarrowMaxSkipsLast(Narrow):
    """A per-tensor scale's max|x| (the minmax statistic only) skips the tensor's last element;
    absmean and per-block scales are right. It passed the default run before the `maxlast`
    inputs (its one maximum was never the last element alone)."""

    name = "narrow-max-skips-last"

    def _reduce(self, a, s, method):
        if method == "minmax" and s.block is None and a.size > 1:
            a = a.copy()
            a.reshape(-1)[-1] = 0
        return super()._reduce(a, s, method)


CHUNK = 1 << 16


class NarrowChunkTail(Narrow):
    """The kernel runs in chunks of 2**16 elements, one chunk per 'thread block', and a tensor
    of more than one chunk drops the partial chunk at its end (its codes stay 0): right on every
    tensor below 65,537 elements."""

    name = "narrow-chunk-tail"

    def _quantize(self, x, s, params, method):
        q = super()._quantize(x, s, params, method)
        n = q.codes.size
        if n > CHUNK:
            flat = q.codes.reshape(-1)
            flat[n // CHUNK * CHUNK:] = 0
        return q


def _memory_order(x):
    """The elements in the order they sit in memory (what a kernel reading the buffer from the
    data pointer sees), shaped as x."""
    a = np.asarray(x)
    return a if a.flags.c_contiguous else a.ravel(order="K").reshape(a.shape)


class _ReadsMemoryOrder:
    """Mixin: calibrate and quantize read a non-contiguous input in memory order instead of through
    its strides (the bug of the `*-memory-order` mutants, on either model)."""

    def _calibrate(self, x, s, method):
        return super()._calibrate(_memory_order(x), s, method)

    def _quantize(self, x, s, params, method):
        return super()._quantize(_memory_order(x), s, params, method)


class NarrowMemoryOrder(_ReadsMemoryOrder, Narrow):
    """Reads a non-contiguous input in memory order instead of through its strides."""

    name = "narrow-memory-order"


def _cast_truncating(y: np.ndarray, dtype) -> np.ndarray:
    """f32 -> f16 / bf16 rounding toward zero (bits dropped) instead of to nearest even."""
    dt = np.dtype(dtype)
    y = np.asarray(y, np.float32)
    if dt == np.dtype(ml_dtypes.bfloat16):
        return bits_f32(f32_bits(y) & np.uint32(0xFFFF0000)).astype(dt)
    if dt == np.float16:
        with np.errstate(over="ignore", invalid="ignore"):
            r = y.astype(np.float16)
            over = np.abs(r.astype(np.float32)) > np.abs(y)
            return np.where(over, np.nextafter(r, np.float16(0)), r).astype(np.float16)
    return y.astype(dt)


class NarrowTruncatingCast(Narrow):
    """Dequantize to float16 truncates the f32 result instead of rounding it to nearest even
    (bfloat16 and float64 are right). It passed the default run before every group dequantized
    to every output dtype."""

    name = "narrow-truncating-cast"

    def _dequantize(self, q, dtype):
        y = super()._dequantize(q, np.float32)
        return _cast_truncating(y, dtype) if np.dtype(dtype) == np.float16 else y.astype(dtype)


class NarrowReciprocal(Narrow):
    name = "narrow-reciprocal"

    def _divide(self, stat):
        return (stat * (np.float32(1) / np.float32(127.0))).astype(np.float32)


class NarrowFlushToZero(Narrow):
    name = "narrow-ftz"

    def _divide(self, stat):
        s = super()._divide(stat)
        return np.where(s < np.float32(2.0 ** -126), np.float32(0), s).astype(np.float32)


# =========================================================================== full model


class Full(ReferenceBackend):
    """Every scheme; the reference maths assembled from steps that mutants override."""

    name = "full"
    priority = 1

    # ---------------------------------------------------------------- steps (mutation points)
    def _check(self, x):
        raise_nonfinite(x)

    def _encode(self, y, s: QuantScheme):
        return encode(y, s)

    def _round_scales(self, s_raw: np.ndarray, s: QuantScheme) -> np.ndarray:
        return s.scale_rounding.store(s_raw).reshape(np.shape(s_raw))

    def _raw_scale(self, stat: np.ndarray, s: QuantScheme) -> np.ndarray:
        return (stat / np.float32(s.scale_divisor)).astype(np.float32)

    def _statistic_input(self, x: np.ndarray) -> np.ndarray:
        return x

    def _kernel(self, s: QuantScheme) -> None:
        """Hook for a kernel that is missing for some scheme."""

    def _write(self, d: QuantizedData) -> QuantizedData:
        return d

    def _read(self, d: QuantizedData) -> QuantizedData:
        return d

    def _effective(self, params: QParams, shape, s: QuantScheme) -> np.ndarray:
        return effective_scale(params, shape, s)

    # ---------------------------------------------------------------- hooks
    def _params(self, x: np.ndarray, s: QuantScheme, method: str) -> QParams:
        if s.reciprocal_global:  # reciprocal global scale: the core's rule (no mutation point of its own)
            return store_reciprocal(slot_statistic(self._statistic_input(x), s, method), s)
        if s.signed or s.affine:  # signed scales, affine offsets: likewise
            return arithmetic.calibrate(self._statistic_input(x), s, method)
        raw = self._raw_scale(slot_statistic(self._statistic_input(x), s, method), s)
        g = None
        if s.two_level:
            top = np.max(raw, initial=np.float32(0))
            g = np.maximum(np.float32(top / np.float32(s.block.dtype.traits.max_value)), F32_TINY)
            raw = (raw / g).astype(np.float32)
        return QParams(self._round_scales(np.asarray(raw, np.float32), s), float(g) if g is not None else None)

    def _calibrate(self, x, s, method):
        x = to_f32(x)
        self._check(x)
        self._kernel(s)
        return self._params(x, s, method)

    def _quantize(self, x, s, params, method):
        x = to_f32(x)
        self._check(x)
        self._kernel(s)
        if s.reciprocal_codes or s.affine:  # code rules, affine offsets: the core's (no mutation point of their own)
            return arithmetic.quantize(x, s, params, method)
        if params is None:
            params = self._params(x, s, method)
        e = np.asarray(effective_scale(params, x.shape, s))
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            y = np.where(e == 0, np.float32(0), x / e).astype(np.float32)
        codes = self._encode(y, s)
        return QuantizedData.from_parts(x.shape, s, codes, params.scales, params.global_scale)

    def _dequantize(self, d, dtype):
        d.check_codes()  # invalid codes (docs/spec.md)
        if d.scheme.affine:  # affine offsets: the core's decode (no mutation point of its own)
            return arithmetic.dequantize(d).astype(dtype)
        e = self._effective(QParams(d.scales(), d.global_scale()), d.shape, d.scheme)
        with np.errstate(over="ignore", invalid="ignore"):
            return (decode(d.codes(), d.scheme) * e).astype(np.float32).astype(dtype)

    def _into_data(self, d):
        return self._write(d)

    def _from_data(self, d):
        return self._read(d)


def _int(s: QuantScheme) -> bool:
    return not s.traits.is_float and not s.is_lookup


def _nudge(y: np.ndarray, toward: np.ndarray) -> np.ndarray:
    return np.nextafter(y.astype(np.float32), toward.astype(np.float32))


class FullHalfAway(Full):
    """Ties away from zero (integers); minifloat and LOOKUP ties to the larger magnitude."""

    name = "full-half-away"

    def _encode(self, y, s):
        if _int(s):
            return np.clip(np.trunc(y + np.copysign(np.float32(0.5), y)), s.traits.qmin, s.traits.qmax).astype(np.int8)
        return encode(_nudge(y, np.copysign(np.inf, y)), s)


class FullHalfUp(Full):
    """Ties toward +inf."""

    name = "full-half-up"

    def _encode(self, y, s):
        if _int(s):
            return np.clip(np.floor(y + np.float32(0.5)), s.traits.qmin, s.traits.qmax).astype(np.int8)
        return encode(_nudge(y, np.full_like(y, np.inf)), s)


class FullTruncate(Full):
    """Rounds toward zero."""

    name = "full-truncate"

    def _encode(self, y, s):
        if _int(s):
            return np.clip(np.trunc(y), s.traits.qmin, s.traits.qmax).astype(np.int8)
        c = encode(y, s)
        v = decode(c, s)
        with np.errstate(invalid="ignore"):
            over = np.abs(v) > np.abs(y)
        if s.is_lookup:  # step the index toward the table entry nearest zero
            toward = np.where(v > 0, -1, 1)
            return np.where(over, c.astype(np.int16) + toward, c).astype(c.dtype)
        mag_mask = s.traits.sign_bit - 1
        mag = c & mag_mask
        return np.where(over & (mag > 0), (c & ~np.uint8(mag_mask) & 0xFF) | (mag - 1), c).astype(c.dtype)


class FullClampBelowQmin(Full):
    """Symmetric integer codes clamped at -2**(bits-1) (q8s: -128) instead of -qmax."""

    name = "full-clamp-128"

    def _encode(self, y, s):
        if _int(s) and s.traits.qmin == -s.traits.qmax:
            return np.clip(np.rint(y), s.traits.qmin - 1, s.traits.qmax).astype(np.int8)
        return encode(y, s)


def _swap_section(d: QuantizedData, what: str, fn) -> QuantizedData:
    sec = sections(d.shape, d.scheme)
    p = bytearray(d.payload)
    lo, hi = {"values": (0, sec.values), "scales": (sec.values, sec.values + sec.scales),
              "global": (sec.values + sec.scales, sec.values + sec.scales + sec.global_)}[what]
    p[lo:hi] = fn(bytes(p[lo:hi]), d.scheme)
    return QuantizedData(d.shape, d.scheme, bytes(p))


def _byteswap_scales(b: bytes, s: QuantScheme) -> bytes:
    n = s.slot_dtype.traits.nbytes
    return np.frombuffer(b, f"<u{n}").byteswap().tobytes() if n > 1 else b


class FullBigEndianScales(Full):
    """Scales (and the global) written big-endian, and read back the same way."""

    name = "full-big-endian"

    def _write(self, d):
        d = _swap_section(d, "scales", _byteswap_scales)
        return _swap_section(d, "global", lambda b, s: b[::-1]) if d.scheme.two_level else d

    _read = _write


def _swap_nibbles(b: bytes, s: QuantScheme) -> bytes:
    if s.bits != 4 or s.store.kind is StoreKind.NATIVE:
        return b
    a = np.frombuffer(b, np.uint8)
    return ((a << 4) | (a >> 4)).astype(np.uint8).tobytes()


class FullSwappedNibbles(Full):
    """4-bit packed stores with the two fields of every byte swapped."""

    name = "full-swapped-nibbles"

    def _write(self, d):
        return _swap_section(d, "values", _swap_nibbles)

    _read = _write


_NEAREST = {"f16": np.float16, "bf16": ml_dtypes.bfloat16, "ue4m3": ml_dtypes.float8_e4m3fn}


class FullScaleRoundNearest(Full):
    """Scales rounded to the nearest storable value instead of up."""

    name = "full-scale-nearest"

    def _round_scales(self, s_raw, s):
        d = s.slot_dtype.value
        tr = s.slot_dtype.traits
        x = np.minimum(np.asarray(s_raw, np.float32), np.float32(tr.max_value))
        with np.errstate(divide="ignore", over="ignore"):
            if d in _NEAREST:
                out = x.astype(_NEAREST[d]).astype(np.float32)
            elif d == "ue8m0":
                out = np.exp2(np.rint(np.log2(np.maximum(x, np.float32(2.0 ** -127))))).astype(np.float32)
            else:
                out = x
        return np.asarray(out, np.float32).reshape(np.shape(s_raw))


_ROUND_UP = {"f16": (0x2000, 0xFFFFE000), "bf16": (0x10000, 0xFFFF0000),
             "ue4m3": (0x100000, 0xFFF00000), "ue8m0": (0x800000, 0xFF800000)}


class FullRoundUpOffByOne(Full):
    """Round-up adds one too many (`bits + 2**k` instead of `2**k - 1`): a scale that is already
    storable is bumped to the next value."""

    name = "full-round-up-off-by-one"

    def _round_scales(self, s_raw, s):
        good = super()._round_scales(s_raw, s)
        d = s.slot_dtype.value
        if d not in _ROUND_UP:
            return good
        add, mask = _ROUND_UP[d]
        b = f32_bits(np.asarray(s_raw, np.float32)).astype(np.uint64)
        bumped = bits_f32(((b + np.uint64(add)) & np.uint64(mask)).astype(np.uint32)).reshape(np.shape(s_raw))
        tr = s.slot_dtype.traits
        raw = np.asarray(s_raw)
        normal = (raw > 0) & (raw < np.float32(tr.max_value) / 2) & (good > np.float32(2.0 ** -6))
        return np.where(normal, bumped, good).astype(np.float32)


class FullNoNonfiniteCheck(Full):
    name = "full-no-nonfinite"

    def _check(self, x):
        pass


class FullRefusesTwoLevel(Full):
    """Refuses two-level schemes its author expects it to run."""

    name = "full-refuses-two-level"

    def _supports(self, s):
        return Support.no("two-level scales are not implemented yet") if s.two_level else Support.yes()


class FullClaimsAndRaises(Full):
    """Says yes to packing axis 1 but has no kernel for it."""

    name = "full-claims-raises"

    def _kernel(self, s):
        if s.store.dim == 1:
            raise NotImplementedError("packing along axis 1: kernel not written")


class FullEdgeOffByOne(Full):
    """The statistic skips the tensor's last element (a loop bound one short)."""

    name = "full-edge-off-by-one"

    def _statistic_input(self, x):
        x = x.copy()
        if x.size:
            x.reshape(-1)[-1] = 0
        return x


class FullChunkIndexWrap(Full):
    """The element index wraps at 2**16 when the kernel looks up an element's effective scale
    (a 16-bit index): right on every tensor up to 65,536 elements."""

    name = "full-chunk-index-wrap"

    def _quantize(self, x, s, params, method):
        x = np.asarray(x)
        if x.size <= CHUNK or s.reciprocal_codes or s.affine:
            return super()._quantize(x, s, params, method)
        x = to_f32(x)
        if params is None:
            params = self._params(x, s, method)
        e = np.asarray(effective_scale(params, x.shape, s), np.float32).reshape(-1)
        e = e[np.arange(e.size) % CHUNK].reshape(x.shape)  # e[i mod 2**16]
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            y = np.where(e == 0, np.float32(0), x / e).astype(np.float32)
        return QuantizedData.from_parts(x.shape, s, self._encode(y, s), params.scales, params.global_scale)


class FullMemoryOrder(_ReadsMemoryOrder, Full):
    """Reads a non-contiguous input in memory order instead of through its strides."""

    name = "full-memory-order"


class FullTruncatingCast(Full):
    """Dequantize to float16 / bfloat16 truncates the f32 result instead of rounding it."""

    name = "full-truncating-cast"

    def _dequantize(self, d, dtype):
        return _cast_truncating(super()._dequantize(d, np.float32), dtype)


class FullWrongPackingAxis(Full):
    """Packs along the last axis whatever the store's packing axis (and unpacks the same way)."""

    name = "full-wrong-packing-axis"

    def _write(self, d):
        s = d.scheme
        if s.store.kind is StoreKind.NATIVE or s.store.dim == 0:
            return d
        flat = s.with_store(QuantStore(s.store.kind, 0))
        sec = sections(d.shape, s)
        vals = layout.pack(d.codes(), flat).tobytes()
        vals = (vals + bytes(sec.values))[: sec.values]
        return QuantizedData(d.shape, s, vals + d.payload[sec.values:])

    def _read(self, d):
        s = d.scheme
        if s.store.kind is StoreKind.NATIVE or s.store.dim == 0:
            return d
        flat = s.with_store(QuantStore(s.store.kind, 0))
        sec = sections(d.shape, s)
        nflat = layout.values_nbytes(d.shape, flat)
        raw = (d.payload[: sec.values] + bytes(nflat))[:nflat]
        codes = layout.unpack(raw, d.shape, flat)
        return QuantizedData.from_parts(d.shape, s, codes, d.scales(), d.global_scale())


class FullF16AsBf16(Full):
    """F16 scale slots hold BF16 bit patterns."""

    name = "full-f16-as-bf16"

    def _write(self, d):
        if d.scheme.slot_dtype is not ScaleDtype.F16:
            return d
        return _swap_section(d, "scales", lambda b, s: (f32_bits(np.frombuffer(b, "<f2").astype(np.float32))
                                                        >> np.uint32(16)).astype("<u2").tobytes())

    def _read(self, d):
        if d.scheme.slot_dtype is not ScaleDtype.F16:
            return d
        return _swap_section(d, "scales", lambda b, s: bits_f32(np.frombuffer(b, "<u2").astype(np.uint32)
                                                                << np.uint32(16)).astype("<f2").tobytes())


class FullGlobalIgnored(Full):
    """Two-level dequantize multiplies by the block scale only, forgetting the global."""

    name = "full-global-ignored"

    def _effective(self, params, shape, s):
        if s.two_level:
            return layout.expand_to_elements(np.asarray(params.scales, np.float32), shape, s)
        return super()._effective(params, shape, s)


class FullPaddingGarbage(Full):
    """The unused bits of every partial packed word are left set (ones) instead of zero."""

    name = "full-padding-garbage"

    def _write(self, d):
        s = d.scheme
        if s.store.kind is StoreKind.NATIVE or not math.prod(d.shape):
            return d
        ones = np.full(d.shape, -1 if s.code_dtype == np.int8 else (1 << s.bits) - 1).astype(s.code_dtype)
        used = np.frombuffer(layout.pack(ones, s).tobytes(), np.uint8)
        return _swap_section(d, "values", lambda b, _s: (np.frombuffer(b, np.uint8) | ~used).astype(np.uint8).tobytes())


class FullFlushToZero(Full):
    """Raw scales below the smallest normal f32 are flushed to zero (a GPU's FTZ mode)."""

    name = "full-ftz"

    def _raw_scale(self, stat, s):
        r = super()._raw_scale(stat, s)
        return np.where(r < np.float32(2.0 ** -126), np.float32(0), r).astype(np.float32)


class FullReciprocal(Full):
    """The raw scale as `stat * (1/h)` instead of `stat / h`."""

    name = "full-reciprocal"

    def _raw_scale(self, stat, s):
        return (stat * (np.float32(1) / np.float32(s.half_range))).astype(np.float32)


class FullLinearUntransposed(Full):
    """`linear` multiplies by the weight as [K, N] (no transpose): right only where the weight is
    square and symmetric, wrong shape elsewhere."""

    name = "full-linear-untransposed"

    def linear(self, x, w, bias=None, *, dtype=None, act=None):
        if w.shape[0] == w.shape[1]:
            return self.matmul(x, w, dtype=None, act=act)
        return super().linear(x, w, bias, dtype=dtype, act=act)


class FullLinearDropsBias(Full):
    """`linear` ignores its bias."""

    name = "full-linear-drops-bias"

    def linear(self, x, w, bias=None, *, dtype=None, act=None):
        return super().linear(x, w, None, dtype=dtype, act=act)


class FullLinearF32Result(Full):
    """`linear` returns float32 whatever x's dtype (the sums are right)."""

    name = "full-linear-f32-result"

    def linear(self, x, w, bias=None, *, dtype=None, act=None):
        return super().linear(x, w, bias, dtype=np.float32, act=act)


class FullLinearBf16Sums(Full):
    """`linear` rounds each dequantized weight to bfloat16 before the product for every x dtype
    (docs/spec.md allows that shortcut, a library GEMM over a bfloat16 weight, only where x and
    the result are bfloat16)."""

    name = "full-linear-bf16-sums"

    def linear(self, x, w, bias=None, *, dtype=None):
        xa = np.asarray(x)
        wb = self.to_numpy(self.dequantize(w)).astype(ml_dtypes.bfloat16).astype(np.float32)
        y = xa.astype(np.float32) @ wb.T + (0 if bias is None else np.asarray(bias, np.float32))
        return y.astype(xa.dtype if dtype is None else dtype)


class FullLinearF16Unshifted(Full):
    """`linear` of float16 x and result rounds each dequantized weight to float16 as it is: docs/spec.md's
    float16-weight rule scales the weight by 2**p first, so that its values stay inside float16's range
    and above its subnormals."""

    name = "full-linear-f16-unshifted"

    def linear(self, x, w, bias=None, *, dtype=None, act=None):
        xa = np.asarray(x)
        if xa.dtype != np.float16 or dtype not in (None, np.float16) or act is not None:
            return super().linear(x, w, bias, dtype=dtype, act=act)
        wh = self.to_numpy(self.dequantize(w)).astype(np.float16).astype(np.float32)
        y = xa.astype(np.float32) @ wh.T + (0 if bias is None else np.asarray(bias, np.float32))
        return y.astype(np.float16)


class FullActIgnored(Full):
    """`linear` and `matmul` ignore `act=`: x enters the product unquantized (docs/spec.md, quantized activations)."""

    name = "full-act-ignored"

    def linear(self, x, w, bias=None, *, dtype=None, act=None):
        return super().linear(x, w, bias, dtype=dtype)

    def matmul(self, x, w, *, dtype=np.float32, act=None):
        return super().matmul(x, w, dtype=dtype)


class FullActPerTensor(Full):
    """`act=` quantizes x with one scale over the whole x (the act scheme's value and scale dtype
    per tensor), not one per row: every row then depends on the batch's largest |x|."""

    name = "full-act-per-tensor"

    def linear(self, x, w, bias=None, *, dtype=None, act=None):
        if act is None:
            return super().linear(x, w, bias, dtype=dtype)
        xa = np.asarray(x)
        s = QuantScheme.parse(act) if isinstance(act, str) else act
        per_tensor = replace(s, block=None, tensor=TensorLevel(s.block.dtype))
        xq = self.dequantize(self.quantize(xa.astype(np.float32), per_tensor))
        return super().linear(xq, w, bias, dtype=xa.dtype if dtype is None else dtype)


class FullActRefusesNonfinite(Full):
    """`act=` refuses an x holding a NaN or an infinity, as `quantize` does, where docs/spec.md
    (quantized activations) gives that row NaN results."""

    name = "full-act-refuses-nonfinite"

    def linear(self, x, w, bias=None, *, dtype=None, act=None):
        if act is not None and not isinstance(x, QTensor) and not np.isfinite(np.asarray(x, np.float32)).all():
            raise InputError("input has a non-finite value; quantization needs finite values")
        return super().linear(x, w, bias, dtype=dtype, act=act)


MUTANTS: list[tuple[str, str, type, str]] = [
    ("narrow", "half-away", NarrowHalfAway, "rounds half away from zero"),
    ("narrow", "half-up", NarrowHalfUp, "rounds half up"),
    ("narrow", "truncate", NarrowTruncate, "truncates"),
    ("narrow", "clamp-128", NarrowClamp128, "q8s codes clamped at -128"),
    ("narrow", "big-endian-scales", NarrowBigEndianScales, "scales written big-endian"),
    ("narrow", "no-nonfinite-check", NarrowNoNonfiniteCheck, "NaN/Inf input accepted"),
    ("narrow", "refuses-expected", NarrowRefusesBlocks, "refuses per-block schemes it is expected to run"),
    ("narrow", "claims-and-raises", NarrowClaimsAndRaises, "says yes to 2-D blocks, then raises"),
    ("narrow", "edge-off-by-one", NarrowEdgeOffByOne, "statistic skips the last element"),
    ("narrow", "reciprocal-scale", NarrowReciprocal, "scale = max * (1/h)"),
    ("narrow", "max-skips-last", NarrowMaxSkipsLast, "per-tensor max|x| skips the last element"),
    ("narrow", "chunk-tail", NarrowChunkTail, "drops the partial 2**16 chunk of a larger tensor"),
    ("narrow", "memory-order", NarrowMemoryOrder, "reads a strided view in memory order"),
    ("narrow", "truncating-cast", NarrowTruncatingCast, "dequantize truncates to f16"),
    ("narrow", "flush-to-zero", NarrowFlushToZero, "subnormal scales flushed to zero"),
    ("full", "half-away", FullHalfAway, "rounds half away from zero"),
    ("full", "half-up", FullHalfUp, "rounds half up"),
    ("full", "truncate", FullTruncate, "truncates"),
    ("full", "clamp-128", FullClampBelowQmin, "symmetric codes clamped at -2**(bits-1)"),
    ("full", "big-endian-scales", FullBigEndianScales, "scales and global big-endian"),
    ("full", "swapped-nibbles", FullSwappedNibbles, "4-bit fields of each byte swapped"),
    ("full", "scale-round-nearest", FullScaleRoundNearest, "scales rounded to nearest, not up"),
    ("full", "round-up-off-by-one", FullRoundUpOffByOne, "storable scales bumped up one step"),
    ("full", "no-nonfinite-check", FullNoNonfiniteCheck, "NaN/Inf input accepted"),
    ("full", "refuses-expected", FullRefusesTwoLevel, "refuses two-level schemes it is expected to run"),
    ("full", "claims-and-raises", FullClaimsAndRaises, "says yes to packing axis 1, then raises"),
    ("full", "edge-off-by-one", FullEdgeOffByOne, "statistic skips the last element"),
    ("full", "chunk-index-wrap", FullChunkIndexWrap, "element index wraps at 2**16"),
    ("full", "memory-order", FullMemoryOrder, "reads a strided view in memory order"),
    ("full", "truncating-cast", FullTruncatingCast, "dequantize truncates to f16/bf16"),
    ("full", "wrong-packing-axis", FullWrongPackingAxis, "packs along axis 0 for packing axis 1"),
    ("full", "f16-as-bf16", FullF16AsBf16, "F16 scale slots hold BF16 bits"),
    ("full", "global-ignored", FullGlobalIgnored, "two-level dequantize forgets the global"),
    ("full", "padding-garbage", FullPaddingGarbage, "padding bits of partial words set"),
    ("full", "flush-to-zero", FullFlushToZero, "subnormal raw scales flushed to zero"),
    ("full", "reciprocal-scale", FullReciprocal, "raw scale = stat * (1/h)"),
    ("full", "linear-untransposed", FullLinearUntransposed, "linear uses a square weight untransposed"),
    ("full", "linear-drops-bias", FullLinearDropsBias, "linear ignores its bias"),
    ("full", "linear-f32-result", FullLinearF32Result, "linear returns float32 for any x"),
    ("full", "linear-bf16-weights", FullLinearBf16Sums, "linear rounds the dequantized weight to bfloat16"),
    ("full", "linear-f16-unshifted", FullLinearF16Unshifted, "linear rounds the weight to float16 unscaled"),
    ("full", "act-ignored", FullActIgnored, "linear and matmul ignore act="),
    ("full", "act-refuses-nonfinite", FullActRefusesNonfinite, "act= refuses a non-finite x"),
    ("full", "act-per-tensor", FullActPerTensor, "linear's act= quantizes x per tensor, not per row"),
]
"""(model, bug id, class, the bug) of every mutant."""

CLEAN = {"narrow": Narrow, "full": Full}
EXPECT = {"narrow": NARROW_EXPECT, "full": FULL_EXPECT}
