"""`lutcpu`: a CPU backend for LOOKUP schemes, in a few small numpy kernels.

qcore's `BaseBackend` does the contract work (parsing schemes, refusing unsupported ones with
`UnsupportedSchemeError`, checking shapes, dtypes and explicit params); this class fills in the
`_hooks`. The rules each kernel follows are docs/spec.md's arithmetic and portable bytes, cited
inline by name; the conformance suite checks them bit for bit against qcore's reference.

The backend keeps tensors unpacked (`LutTensor`: one uint8 index per element, f32 scales in the
block-grid shape), and packs them only when asked for portable bytes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from qcore import BaseBackend, QParams, QuantizedData, QuantScheme, StoreKind, Support
from qcore.spec.arithmetic import midpoint_codes, slot_effective, store_reciprocal
from qcore.spec.schemes import CodeRule
from qcore.spec.checks import raise_nonfinite, to_f32

__all__ = ["LutCpuBackend", "LutTensor"]

F32_TINY = np.float32(1.17549435e-38)


@dataclass
class LutTensor:
    """What a `QTensor.data` holds on this backend."""

    shape: tuple[int, ...]
    scheme: QuantScheme
    index: np.ndarray  # uint8, the tensor's shape: table indices
    scales: np.ndarray  # f32, block-grid shape (per-tensor: ()), stored (rounded-up) values
    global_scale: float | None
    table: np.ndarray  # f32, 2**bits entries


# ----------------------------------------------------------------------------- kernels


def _block(shape: tuple[int, ...], scheme: QuantScheme) -> tuple[int, ...] | None:
    """Block dims aligned to the trailing axes, padded with 1s to the tensor's rank."""
    if scheme.block is None:
        return None
    dims = scheme.block.dims
    return (1,) * (len(shape) - len(dims)) + dims


def slot_stat(x: np.ndarray, block: tuple[int, ...] | None, method: str) -> np.ndarray:
    """Per scale slot, max |x| or mean |x| (calibration; absmean sums in f64, rounds once)."""
    a = np.abs(x)
    if block is None:
        if method == "minmax":
            return np.float32(a.max()) if a.size else np.float32(0)
        return np.float32(a.sum(dtype=np.float64) / a.size) if a.size else np.float32(0)
    # Reduce one axis at a time with reduceat over the block starts: edge blocks are simply shorter.
    red = a.astype(np.float64) if method == "absmean" else a
    counts = np.ones((), np.int64)
    for axis, (d, b) in enumerate(zip(x.shape, block)):
        starts = np.arange(0, d, b)
        if d == 0:
            red = np.take(red, [], axis=axis)
            counts = np.multiply.outer(counts, np.zeros(0, np.int64))
            continue
        ufunc = np.maximum if method == "minmax" else np.add
        red = ufunc.reduceat(red, starts, axis=axis)
        counts = np.multiply.outer(counts, np.minimum(b, d - starts))
    if method == "minmax":
        return red.astype(np.float32)
    return (red / np.where(counts == 0, 1, counts)).astype(np.float32)


def raw_scales(x: np.ndarray, scheme: QuantScheme, table: np.ndarray, method: str) -> np.ndarray:
    """Calibration: the raw scale s = stat / max|table| per slot."""
    return (slot_stat(x, _block(x.shape, scheme), method) / np.float32(np.max(np.abs(table)))).astype(np.float32)


def calibrate(x: np.ndarray, scheme: QuantScheme, table: np.ndarray, method: str,
              raw: np.ndarray | None = None) -> QParams:
    """Calibration, two-level scales and scale storage: s = stat / max|table| (`raw`, when the
    caller has it); two-level divides by g; rounded into the dtype by the scheme's rule
    (`scheme.scale_rounding`: v1's round-up, or round to nearest even)."""
    if scheme.reciprocal_global:  # the global stored as 1/g (reciprocal global scale): qcore's own rule
        return store_reciprocal(slot_stat(x, _block(x.shape, scheme), method), scheme)
    s = raw_scales(x, scheme, table, method) if raw is None else raw
    g = None
    if scheme.two_level:
        top = np.float32(s.max()) if s.size else np.float32(0)
        m = np.float32(scheme.block.dtype.traits.max_value)  # M of the two-level scales: 448 or 65504
        g = np.maximum(np.float32(top / m), F32_TINY)
        s = (s / g).astype(np.float32)
    stored = scheme.scale_rounding.store(np.asarray(s, np.float32)).reshape(np.shape(s))
    return QParams(stored, None if g is None else float(g))


def element_scales(p: QParams, shape: tuple[int, ...], scheme: QuantScheme) -> np.ndarray:
    """Effective scale: e = s (or g * s_b in one f32 multiply; s_b / G for a reciprocal global
    scale), gathered to every element."""
    s = slot_effective(p.scales, p.global_scale, scheme)
    block = _block(shape, scheme)
    if block is None:
        return np.broadcast_to(s.reshape(()), shape)
    return s[np.ix_(*(np.arange(d) // b for d, b in zip(shape, block)))]


def nearest(y: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Quantize, LOOKUP: the index minimising |y - table[i]| in f32; ties keep the lower index
    (a strict `<` while scanning the table upwards). `y` is first clamped to the table's range
    (docs/spec-choices.md): beyond it f32 distances would all round alike."""
    y = np.clip(y, table[0], table[-1]).astype(np.float32)
    best = np.full(y.shape, np.inf, np.float32)
    index = np.zeros(y.shape, np.uint8)
    for i, t in enumerate(table):
        d = np.abs(y - t)
        better = d < best
        best = np.where(better, d, best)
        index[better] = i
    return index


def pack(index: np.ndarray, scheme: QuantScheme) -> bytes:
    """Portable bytes: along axis rank-1-d, runs of n = word_bits/bits indices fill a little-endian
    word, element k in bits [k*bits, (k+1)*bits); the last word of a line is zero-padded."""
    if scheme.store.kind is StoreKind.NATIVE:
        return np.ascontiguousarray(index, np.uint8).tobytes()
    bits, word_bits = scheme.bits, scheme.store.word_bits
    n = word_bits // bits
    axis = index.ndim - 1 - scheme.store.dim
    v = np.moveaxis(index, axis, -1).astype(np.uint32)
    extent = v.shape[-1]
    words = -(-extent // n)
    v = np.concatenate([v, np.zeros(v.shape[:-1] + (words * n - extent,), np.uint32)], axis=-1)
    v = v.reshape(v.shape[:-1] + (words, n)) << (np.arange(n, dtype=np.uint32) * bits)
    w = np.bitwise_or.reduce(v, axis=-1) if n > 1 else v[..., 0]
    w = np.moveaxis(w, -1, axis).astype("<u4" if word_bits == 32 else "u1")
    return np.ascontiguousarray(w).tobytes()


def unpack(raw: bytes, shape: tuple[int, ...], scheme: QuantScheme) -> np.ndarray:
    """The inverse of `pack`: unsigned indices of `shape`."""
    if scheme.store.kind is StoreKind.NATIVE:
        return np.frombuffer(raw, np.uint8).reshape(shape).copy()
    bits, word_bits = scheme.bits, scheme.store.word_bits
    n = word_bits // bits
    axis = len(shape) - 1 - scheme.store.dim
    wshape = list(shape)
    wshape[axis] = -(-shape[axis] // n)
    w = np.frombuffer(raw, "<u4" if word_bits == 32 else "u1").reshape(wshape).astype(np.uint32)
    w = np.moveaxis(w, axis, -1)
    f = (w[..., None] >> (np.arange(n, dtype=np.uint32) * bits)) & np.uint32((1 << bits) - 1)
    f = f.reshape(w.shape[:-1] + (w.shape[-1] * n,))[..., : shape[axis]]
    return np.ascontiguousarray(np.moveaxis(f, -1, axis)).astype(np.uint8)


# ----------------------------------------------------------------------------- the backend


class LutCpuBackend(BaseBackend):
    """LOOKUP schemes (any integer value width, level, store and scale dtype) on the CPU."""

    name = "lutcpu"
    priority = 5  # below ndarray/cuda; the only accelerated choice for LOOKUP anyway
    # the scheme features beyond SPEC v1 these hooks implement (docs/plugins.md, "Scheme features"):
    # scales rounded by scheme.scale_rounding, the reciprocal global, bitsandbytes' midpoint codes;
    # field orders and flat blocks come from the core
    scheme_features = {"round:rne", "recip", "codes:midpoint", "order:high", "order:split", "flat"}

    def describe(self) -> str:
        return "LOOKUP (table) schemes on the CPU with numpy (example plugin qcore-lutcpu)"

    def _supports(self, scheme: QuantScheme) -> Support:
        if not scheme.is_lookup:
            return Support.no("lutcpu runs LOOKUP (table) schemes only; use ndarray or cuda for "
                              f"{scheme.value} in SYMMETRIC mode")
        return Support.yes()

    def _calibrate(self, x: Any, scheme: QuantScheme, method: str) -> QParams:
        x = to_f32(x)
        raise_nonfinite(x)
        return calibrate(x, scheme, np.asarray(scheme.require_table(), np.float32), method)

    def _quantize(self, x: Any, scheme: QuantScheme, params: QParams | None, method: str) -> LutTensor:
        x = to_f32(x)
        raise_nonfinite(x)
        table = np.asarray(scheme.require_table(), np.float32)
        raw = None
        if params is None:
            if scheme.code_rule is CodeRule.MIDPOINT:  # the rule codes from the raw scales
                raw = raw_scales(x, scheme, table, method)
            params = calibrate(x, scheme, table, method, raw)
        if scheme.code_rule is CodeRule.MIDPOINT:  # code rules: the core's statement of the rule
            index = midpoint_codes(x, np.asarray(params.scales if raw is None else raw, np.float32), scheme)
        else:
            e = element_scales(params, x.shape, scheme)
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                y = np.where(e == 0, np.float32(0), x / e).astype(np.float32)  # quantize: e == 0 -> 0
            index = nearest(y, table)
        return LutTensor(x.shape, scheme, index, np.asarray(params.scales, np.float32), params.global_scale, table)

    def _dequantize(self, data: LutTensor, dtype: np.dtype) -> np.ndarray:
        e = element_scales(QParams(data.scales, data.global_scale), data.shape, data.scheme)
        return (data.table[data.index] * e).astype(np.float32).astype(dtype)  # dequantize

    def _into_data(self, data: LutTensor) -> QuantizedData:
        s = data.scheme
        parts = [pack(data.index, s),
                 np.ascontiguousarray(s.slot_dtype.traits.encode(data.scales.reshape(-1))).tobytes()]
        if s.two_level:
            parts.append(np.asarray([data.global_scale], "<f4").tobytes())
        parts.append(data.table.astype("<f4").tobytes())
        return QuantizedData(data.shape, s, b"".join(parts))

    def _from_data(self, data: QuantizedData) -> LutTensor:
        s = data.scheme  # carries the payload's table
        return LutTensor(data.shape, s, unpack(data.values_bytes(), data.shape, s), data.scales(),
                         data.global_scale(), data.table())

    def to_numpy(self, array: Any) -> np.ndarray:
        return np.asarray(array)
