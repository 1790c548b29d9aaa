"""SPEC §2 (Arithmetic) as plain numpy functions over whole arrays: the one home of each rule.

The statistic per slot, the raw scale and its round-up to the scale dtype (through the trait
tables of `qcore.codecs`), the two-level normalisation, the effective scale, encode and decode.
The `reference` backend is these functions in a row (`quantize`); the tensor ops (`qcore.ops`)
and other backends call them for the steps they do not run in kernels. Clarity over speed:
full-size temporaries, one readable step per rule.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import layout
from .checks import raise_nonfinite, to_f32
from .codecs import F32_TINY, ScaleSlot, rule_codes
from .errors import InputError
from .payload import QuantizedData
from .scheme import QuantScheme

__all__ = [
    "QParams",
    "slot_statistic",
    "raw_scales",
    "round_scales",
    "calibrate",
    "store_scales",
    "store_reciprocal",
    "reciprocal_global",
    "slot_effective",
    "effective_scale",
    "encode",
    "decode",
    "quantize_codes",
    "quantize",
    "dequantize",
]


@dataclass(frozen=True)
class QParams:
    """Stored scales (rounded up, decoded to f32) in the block-grid shape, and the two-level global."""

    scales: np.ndarray
    global_scale: float | None = None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, QParams):
            return NotImplemented
        a, b = np.asarray(self.scales, np.float32), np.asarray(other.scales, np.float32)
        return (
            a.shape == b.shape
            and a.tobytes() == b.tobytes()
            and (self.global_scale is None) == (other.global_scale is None)
            and (self.global_scale is None or np.float32(self.global_scale).tobytes()
                 == np.float32(other.global_scale).tobytes())
        )

    __hash__ = None  # type: ignore[assignment]


def _blocked(x: np.ndarray, block: tuple[int, ...]) -> np.ndarray:
    """Pad `x` with zeros to whole blocks and view it as (g0, b0, g1, b1, ...)."""
    grid = [-(-d // b) for d, b in zip(x.shape, block)]
    padded = np.zeros([g * b for g, b in zip(grid, block)], dtype=x.dtype)
    padded[tuple(slice(0, d) for d in x.shape)] = x
    inter = [v for gb in zip(grid, block) for v in gb]
    return padded.reshape(inter)


def _slot_counts(shape: tuple[int, ...], block: tuple[int, ...]) -> np.ndarray:
    """How many elements each slot really holds (edge blocks may be partial)."""
    counts = np.ones((), dtype=np.int64)
    for d, b in zip(shape, block):
        g = -(-d // b)
        per_axis = np.minimum(b, d - np.arange(g) * b)
        counts = np.multiply.outer(counts, per_axis)
    return counts


def signed_extreme(x: np.ndarray, scheme: QuantScheme) -> np.ndarray:
    """Per scale slot, the element of largest `|x|`, the first such in row-major order within
    the slot (numpy's argmax; docs/spec.md E3), with its sign; 0 for an empty slot."""
    block = layout.block_extents(x.shape, scheme)
    if x.size == 0:
        return np.zeros(layout.grid_shape(x.shape, scheme), dtype=np.float32)
    if block is None:
        flat = x.reshape(-1)
        return np.asarray(flat[np.argmax(np.abs(flat))], dtype=np.float32)
    b = _blocked(x, block)  # (g0, b0, g1, b1, ...); the zero padding never beats a real element
    nd = len(block)
    b = b.transpose([2 * i for i in range(nd)] + [2 * i + 1 for i in range(nd)])
    grid = b.shape[:nd]
    flat = b.reshape(grid + (-1,))
    first = np.argmax(np.abs(flat), axis=-1)[..., None]
    return np.take_along_axis(flat, first, axis=-1)[..., 0].astype(np.float32)


def slot_statistic(x: np.ndarray, scheme: QuantScheme, method: str = "minmax") -> np.ndarray:
    """Per scale slot: `max |x|` (minmax) or `mean |x|` (absmean, f64 sum, one f32 rounding);
    for signed scales the slot's signed extreme (`signed_extreme`, minmax only)."""
    if scheme.signed:
        if method != "minmax":
            raise InputError(f"{scheme} has signed scales, which take the minmax statistic (the signed "
                             f"extreme), not {method!r}")
        return signed_extreme(x, scheme)
    a = np.abs(x)
    block = layout.block_extents(x.shape, scheme)
    if a.size == 0:  # O(1) whatever the extents claim: every slot holds nothing
        return np.zeros(layout.grid_shape(x.shape, scheme), dtype=np.float32)
    if block is None:
        if method == "minmax":
            return np.asarray(np.max(a, initial=np.float32(0)), dtype=np.float32)
        n = a.size
        return np.asarray(np.float32(a.sum(dtype=np.float64) / n) if n else np.float32(0))
    b = _blocked(a, block)
    reduce_axes = tuple(range(1, b.ndim, 2))
    if method == "minmax":
        return np.max(b, axis=reduce_axes, initial=np.float32(0)).astype(np.float32)
    sums = b.sum(axis=reduce_axes, dtype=np.float64)
    return (sums / _slot_counts(x.shape, block)).astype(np.float32)


def raw_scales(x: np.ndarray, scheme: QuantScheme, method: str = "minmax") -> np.ndarray:
    """SPEC §2.1 per slot: the raw f32 scale `s = stat / h` (`stat / 1` under the MX rule,
    `m / qmin` for signed scales), before any rounding."""
    stat = slot_statistic(x, scheme, method)
    return (stat / np.float32(scheme.scale_divisor)).astype(np.float32)


def calibrate(x: np.ndarray, scheme: QuantScheme, method: str = "minmax") -> QParams:
    """SPEC §2.1-2.3: raw scale `s = stat / h` (`stat / 1` under the MX rule), two-level
    normalisation, rounded into the dtype by the scheme's rule (v1: up)."""
    if scheme.reciprocal_global:
        return store_reciprocal(slot_statistic(x, scheme, method), scheme)
    return store_scales(raw_scales(x, scheme, method), scheme)


def round_scales(s: np.ndarray, scheme: QuantScheme, slot: ScaleSlot | None = None) -> np.ndarray:
    """Raw f32 scales rounded into the slot dtype by `slot` (default: the scheme's rule). Signed
    scales (docs/spec.md E3) round their magnitude and keep their sign, -0 included."""
    slot = slot or scheme.scale_rounding
    s = np.asarray(s, dtype=np.float32)
    if not scheme.signed:
        return slot.store(s).reshape(s.shape)
    return np.copysign(slot.store(np.abs(s)).reshape(s.shape), s).astype(np.float32)


def reciprocal_global(top: np.float32, scheme: QuantScheme) -> np.float32:
    """docs/spec.md E2: `G = f32(M * h) / max(top, tiny)` for the largest statistic `top`, or 1.0
    where that overflows (an all-zero or tiny tensor), as compressed-tensors computes it."""
    m_h = np.float32(np.float32(scheme.block.dtype.traits.max_value) * np.float32(scheme.half_range))
    with np.errstate(over="ignore", divide="ignore"):
        g = np.float32(m_h / np.maximum(np.float32(top), F32_TINY))
    return g if np.isfinite(g) else np.float32(1.0)


def store_reciprocal(stat: np.ndarray, scheme: QuantScheme) -> QParams:
    """docs/spec.md E2: the reciprocal global `G` from the largest statistic, then each block's
    raw scale `f32(G * f32(stat_b / h))` rounded into the block dtype by the scheme's rule."""
    stat = np.asarray(stat, dtype=np.float32)
    g = reciprocal_global(np.max(stat, initial=np.float32(0)), scheme)
    with np.errstate(over="ignore"):
        raw = (g * (stat / np.float32(scheme.half_range)).astype(np.float32)).astype(np.float32)
    stored = scheme.scale_rounding.store(raw).reshape(raw.shape)
    return QParams(stored, float(g))


def store_scales(s: np.ndarray, scheme: QuantScheme, g: np.float32 | None = None) -> QParams:
    """Round raw scales into the slot dtype by the scheme's rule; two-level first divides by
    the global `g` (§2.2)."""
    s = np.asarray(s, dtype=np.float32)
    if scheme.reciprocal_global:
        raise ValueError(f"{scheme} takes its reciprocal global from the statistics: use store_reciprocal")
    if scheme.two_level and g is None:
        M = np.float32(scheme.block.dtype.traits.max_value)  # M: 448 (UE4M3) or 65504 (F16)
        top = np.max(s, initial=np.float32(0))
        g = np.maximum(np.float32(top / M), F32_TINY)
        s = (s / g).astype(np.float32)
    return QParams(round_scales(s, scheme), float(g) if scheme.two_level else None)


def slot_effective(scales: np.ndarray, global_scale: float | None, scheme: QuantScheme) -> np.ndarray:
    """SPEC §2.4 per slot: `e = s`, `e = g * s_b` (one f32 multiply), or with a reciprocal global
    `e = s_b / G` (one f32 division, docs/spec.md E2)."""
    s = np.asarray(scales, dtype=np.float32)
    if not scheme.two_level:
        return s
    g = np.float32(global_scale)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return ((s / g) if scheme.reciprocal_global else (g * s)).astype(np.float32)


def effective_scale(params: QParams, shape: tuple[int, ...], scheme: QuantScheme) -> np.ndarray:
    """SPEC §2.4: the slot's effective scale (`slot_effective`), broadcast to every element."""
    return layout.expand_to_elements(slot_effective(params.scales, params.global_scale, scheme), shape, scheme)


def _lookup_nearest(y: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Index minimising |y - table[i]| in f32; ties go to the lower index (argmin's first hit).

    `y` is clamped to [table[0], table[-1]] first, which leaves the exact minimiser unchanged;
    without it, a `y` far outside the table would round every f32 distance to the same value and
    pick index 0 whatever its sign (docs/spec-choices.md).
    """
    y = np.clip(y, table[0], table[-1]).astype(np.float32)
    out = np.empty(y.shape, dtype=np.uint8)
    flat_y, flat_o = y.reshape(-1), out.reshape(-1)
    step = max(1, (1 << 22) // table.size)
    for i in range(0, flat_y.size, step):
        d = np.abs(flat_y[i : i + step, None] - table[None, :])
        flat_o[i : i + step] = np.argmin(d, axis=1)
    return out


def encode(y: np.ndarray, scheme: QuantScheme) -> np.ndarray:
    """Codes of `y = x / e` (SPEC §2.5)."""
    if scheme.is_lookup:
        return _lookup_nearest(y, np.asarray(scheme.require_table(), dtype=np.float32))
    return scheme.traits.encode(y)


def decode(codes: np.ndarray, scheme: QuantScheme) -> np.ndarray:
    """f32 values of codes: the value format, or `table[i]` for LOOKUP (SPEC §2.6)."""
    if scheme.is_lookup:
        return np.asarray(scheme.require_table(), dtype=np.float32)[codes.astype(np.intp)]
    return scheme.traits.decode(codes)


def quantize_codes(x: np.ndarray, e: np.ndarray, scheme: QuantScheme) -> np.ndarray:
    """`y = x / e` then encode; where `e == 0` every code is the encoding of 0."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        y = np.where(e == 0, np.float32(0), x / e).astype(np.float32)
    return encode(y, scheme)


def reciprocal_codes(x: np.ndarray, raw: np.ndarray, scheme: QuantScheme) -> np.ndarray:
    """docs/spec.md E4: `y = f32(x * r)` with `r = f32(1 / s)` of each slot's raw scale `s`
    (0 where `s == 0`; `y = 0` where `x == 0`), coded by the scheme's code rule."""
    raw = np.asarray(raw, dtype=np.float32)
    with np.errstate(divide="ignore", over="ignore"):
        r = np.where(raw == 0, np.float32(0), np.float32(1) / raw).astype(np.float32)
    r = layout.expand_to_elements(r, x.shape, scheme)
    with np.errstate(invalid="ignore", over="ignore"):
        y = np.where(x == 0, np.float32(0), x * r).astype(np.float32)
    t = scheme.traits
    return rule_codes(y, scheme.code_rule.value, t.qmin, t.qmax)


def quantize(x: np.ndarray, scheme: QuantScheme, params: QParams | None = None,
             method: str = "minmax") -> QuantizedData:
    """SPEC §2.1-2.5 in a row: f32 input checked finite, scales calibrated unless given, codes
    (`x / e`, or under a code rule from the reciprocal of the raw scale: given scales are
    their own raw scales)."""
    x = to_f32(x)
    raise_nonfinite(x)
    raw = None
    if params is None:
        if scheme.reciprocal_global:
            params = calibrate(x, scheme, method)
        else:
            raw = raw_scales(x, scheme, method)
            params = store_scales(raw, scheme)
    if scheme.reciprocal_codes:
        codes = reciprocal_codes(x, params.scales if raw is None else raw, scheme)
    else:
        codes = quantize_codes(x, effective_scale(params, x.shape, scheme), scheme)
    return QuantizedData.from_parts(x.shape, scheme, codes, params.scales, params.global_scale)


def dequantize(data: QuantizedData) -> np.ndarray:
    """SPEC §2.6: `x' = decode(q) * e` in f32; invalid codes (SPEC v1.1 §3) raise
    `InvalidDataError` instead of decoding to NaN or an out-of-range value."""
    data.check_codes()
    params = QParams(data.scales(), data.global_scale())
    e = effective_scale(params, data.shape, data.scheme)
    with np.errstate(over="ignore"):  # a valid huge scale times a code may exceed f32: inf, as the spec computes
        return (decode(data.codes(), data.scheme) * e).astype(np.float32)
