"""The spec's arithmetic (docs/spec.md, arithmetic) as plain numpy functions over whole arrays:
the one home of each rule.

The statistic per slot, the raw scale and its round-up to the scale dtype (through the trait
tables of `qcore.spec.codecs`), the two-level normalisation, the effective scale, encode and decode.
The `reference` backend is these functions in a row (`quantize`); the tensor ops (`qcore.backend.ops`)
and other backends call them for the steps they do not run in kernels. Clarity over speed:
full-size temporaries, one readable step per rule.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from qcore.spec import layout
from qcore.spec.checks import raise_nonfinite, to_f32
from qcore.spec.codecs import F32_TINY, SCALE_SLOTS, ScaleSlot, rule_codes, scale_slot_id
from qcore.errors import InputError
from qcore.spec.payload import QuantizedData
from qcore.spec.schemes import CodeRule, OffsetKind, QuantScheme

__all__ = [
    "QParams",
    "slot_statistic",
    "slot_range",
    "affine_params",
    "affine_codes",
    "round_offsets",
    "scaled_values",
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
    """Stored scales (rounded up, decoded to f32) in the block-grid shape, the two-level global,
    and an affine scheme's stored offsets (docs/spec.md, affine offsets: MIN values or ZERO
    points, f32, in the block-grid shape)."""

    scales: np.ndarray
    global_scale: float | None = None
    offsets: np.ndarray | None = None

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
            and (self.offsets is None) == (other.offsets is None)
            and (self.offsets is None or np.asarray(self.offsets, np.float32).tobytes()
                 == np.asarray(other.offsets, np.float32).tobytes())
        )

    __hash__ = None  # type: ignore[assignment]


def _blocked(x: np.ndarray, block: tuple[int, ...], fill: float = 0.0) -> np.ndarray:
    """Pad `x` with `fill` to whole blocks and view it as (g0, b0, g1, b1, ...)."""
    grid = [-(-d // b) for d, b in zip(x.shape, block)]
    padded = np.full([g * b for g, b in zip(grid, block)], fill, dtype=x.dtype)
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
    the slot (numpy's argmax; docs/spec.md, signed scales), with its sign; 0 for an empty slot."""
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
        require_method(scheme, method)
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


def slot_range(x: np.ndarray, scheme: QuantScheme) -> tuple[np.ndarray, np.ndarray]:
    """Per scale slot, (min x, max x) over its elements (signed; docs/spec.md, affine offsets);
    (0, 0) for an empty tensor."""
    grid = layout.grid_shape(x.shape, scheme)
    if x.size == 0:
        return np.zeros(grid, np.float32), np.zeros(grid, np.float32)
    block = layout.block_extents(x.shape, scheme)
    if block is None:
        return np.asarray(np.min(x), np.float32), np.asarray(np.max(x), np.float32)
    axes = tuple(range(1, 2 * len(block), 2))
    lo = np.min(_blocked(x, block, np.inf), axis=axes).astype(np.float32)
    hi = np.max(_blocked(x, block, -np.inf), axis=axes).astype(np.float32)
    return lo, hi


def affine_params(x: np.ndarray, scheme: QuantScheme) -> tuple[QParams, np.ndarray, np.ndarray]:
    """docs/spec.md, affine offsets: (stored params, raw scales, raw offsets) of an affine scheme.
    MIN: `s = (max - min) / (qmax - qmin)` by the scheme's rule, `m = min` rounded to nearest (ties
    to even) into its dtype. ZERO: the range widened to hold 0, `s` the same way, then
    `z = clamp(qmin - rint(lo / s_stored), qmin, qmax)` (0 where the stored scale is 0)."""
    lo, hi = slot_range(x, scheme)
    t = scheme.traits
    if scheme.offset.kind is OffsetKind.ZERO:
        lo, hi = np.minimum(lo, np.float32(0)), np.maximum(hi, np.float32(0))
    zero = np.float32(0)  # + 0: a zero min or max is +0, whichever zero an ordering met first
    lo, hi = (lo + zero).astype(np.float32), (hi + zero).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        raw = ((hi - lo).astype(np.float32) / np.float32(scheme.scale_divisor)).astype(np.float32)
    stored = round_scales(raw, scheme)
    if scheme.offset.kind is OffsetKind.MIN:
        return QParams(stored, None, round_offsets(lo, scheme)), raw, lo
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        q = np.rint((lo / stored).astype(np.float32))
        z = np.where(stored == 0, 0, np.clip(np.float32(t.qmin) - q, t.qmin, t.qmax)).astype(np.float32)
    return QParams(stored, None, z), raw, z


def round_offsets(m: np.ndarray, scheme: QuantScheme) -> np.ndarray:
    """MIN offsets rounded to the nearest value of their dtype, ties to even, sign kept
    (affine offsets)."""
    slot = SCALE_SLOTS[scale_slot_id(scheme.offset.dtype.value, "rne", 0)]
    m = np.asarray(m, dtype=np.float32)
    return np.copysign(slot.store(np.abs(m)).reshape(m.shape), m).astype(np.float32)


def raw_scales(x: np.ndarray, scheme: QuantScheme, method: str = "minmax") -> np.ndarray:
    """Calibration (docs/spec.md, calibration) per slot: the raw f32 scale `s = stat / h`
    (`stat / 1` under the MX rule, `m / qmin` for signed scales), before any rounding."""
    stat = slot_statistic(x, scheme, method)
    return (stat / np.float32(scheme.scale_divisor)).astype(np.float32)


def calibrate(x: np.ndarray, scheme: QuantScheme, method: str = "minmax") -> QParams:
    """Calibration, two-level scales and scale storage (docs/spec.md): raw scale `s = stat / h`
    (`stat / 1` under the MX rule), two-level normalisation, rounded into the dtype by the
    scheme's rule (v1: up)."""
    if scheme.reciprocal_global:
        return store_reciprocal(slot_statistic(x, scheme, method), scheme)
    if scheme.affine:
        require_method(scheme, method)
        return affine_params(x, scheme)[0]
    return store_scales(raw_scales(x, scheme, method), scheme)


def require_method(scheme: QuantScheme, method: str) -> None:
    """The one home of which calibration methods a scheme takes: signed scales (the slot's signed
    extreme) and affine offsets (the slot's min and max; docs/spec.md) take minmax only."""
    if (scheme.signed or scheme.affine) and method != "minmax":
        raise InputError(f"{scheme} takes the minmax statistic (signed scales: the signed extreme; "
                         f"affine offsets: the slot's min and max; docs/spec.md), not {method!r}")


def round_scales(s: np.ndarray, scheme: QuantScheme, slot: ScaleSlot | None = None) -> np.ndarray:
    """Raw f32 scales rounded into the slot dtype by `slot` (default: the scheme's rule). Signed
    scales (docs/spec.md, signed scales) round their magnitude and keep their sign, -0 included."""
    slot = slot or scheme.scale_rounding
    s = np.asarray(s, dtype=np.float32)
    if not scheme.signed:
        return slot.store(s).reshape(s.shape)
    return np.copysign(slot.store(np.abs(s)).reshape(s.shape), s).astype(np.float32)


def reciprocal_global(top: np.float32, scheme: QuantScheme) -> np.float32:
    """docs/spec.md, reciprocal global scale: `G = f32(M * h) / max(top, tiny)` for the largest
    statistic `top`, or 1.0 where that overflows (an all-zero or tiny tensor), as
    compressed-tensors computes it."""
    m_h = np.float32(np.float32(scheme.block.dtype.traits.max_value) * np.float32(scheme.half_range))
    with np.errstate(over="ignore", divide="ignore"):
        g = np.float32(m_h / np.maximum(np.float32(top), F32_TINY))
    return g if np.isfinite(g) else np.float32(1.0)


def store_reciprocal(stat: np.ndarray, scheme: QuantScheme) -> QParams:
    """docs/spec.md, reciprocal global scale: the reciprocal global `G` from the largest
    statistic, then each block's raw scale `f32(G * f32(stat_b / h))` rounded into the block
    dtype by the scheme's rule."""
    stat = np.asarray(stat, dtype=np.float32)
    g = reciprocal_global(np.max(stat, initial=np.float32(0)), scheme)
    with np.errstate(over="ignore"):
        raw = (g * (stat / np.float32(scheme.half_range)).astype(np.float32)).astype(np.float32)
    stored = scheme.scale_rounding.store(raw).reshape(raw.shape)
    return QParams(stored, float(g))


def store_scales(s: np.ndarray, scheme: QuantScheme, g: np.float32 | None = None) -> QParams:
    """Round raw scales into the slot dtype by the scheme's rule; two-level first divides by
    the global `g` (two-level scales)."""
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
    """The effective scale (docs/spec.md) per slot: `e = s`, `e = g * s_b` (one f32 multiply), or
    with a reciprocal global `e = s_b / G` (one f32 division; reciprocal global scale)."""
    s = np.asarray(scales, dtype=np.float32)
    if not scheme.two_level:
        return s
    g = np.float32(global_scale)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return ((s / g) if scheme.reciprocal_global else (g * s)).astype(np.float32)


def effective_scale(params: QParams, shape: tuple[int, ...], scheme: QuantScheme) -> np.ndarray:
    """Each element's effective scale (docs/spec.md): its slot's `slot_effective`, broadcast."""
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
    """Codes of `y = x / e` (docs/spec.md, quantize)."""
    if scheme.is_lookup:
        return _lookup_nearest(y, np.asarray(scheme.require_table(), dtype=np.float32))
    return scheme.traits.encode(y)


def decode(codes: np.ndarray, scheme: QuantScheme) -> np.ndarray:
    """f32 values of codes: the value format, or `table[i]` for LOOKUP (docs/spec.md, dequantize)."""
    if scheme.is_lookup:
        return np.asarray(scheme.require_table(), dtype=np.float32)[codes.astype(np.intp)]
    return scheme.traits.decode(codes)


def quantize_codes(x: np.ndarray, e: np.ndarray, scheme: QuantScheme) -> np.ndarray:
    """`y = x / e` then encode; where `e == 0` every code is the encoding of 0."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        y = np.where(e == 0, np.float32(0), x / e).astype(np.float32)
    return encode(y, scheme)


def reciprocal_codes(x: np.ndarray, raw: np.ndarray, scheme: QuantScheme,
                     raw_offsets: np.ndarray | None = None) -> np.ndarray:
    """docs/spec.md, code rules: `y = f32(x * r)` with `r = f32(1 / s)` of each slot's raw scale
    `s` (0 where `s == 0`; `y = 0` where `x == 0`), coded by the scheme's code rule. With a MIN
    offset (affine offsets) `x` is first `f32(x - lo)`, lo the slot's raw minimum."""
    raw = np.asarray(raw, dtype=np.float32)
    with np.errstate(divide="ignore", over="ignore"):
        r = np.where(raw == 0, np.float32(0), np.float32(1) / raw).astype(np.float32)
    r = layout.expand_to_elements(r, x.shape, scheme)
    if raw_offsets is not None:
        with np.errstate(over="ignore", invalid="ignore"):
            x = (x - layout.expand_to_elements(np.asarray(raw_offsets, np.float32), x.shape, scheme)).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        y = np.where(x == 0, np.float32(0), x * r).astype(np.float32)
    t = scheme.traits
    return rule_codes(y, scheme.code_rule.value, t.qmin, t.qmax)


MIDPOINT_FLOOR = np.float32(1e-38)
"""The least raw scale the midpoint rule divides by (bitsandbytes' `absmax.clamp(min=1e-38)`)."""


def midpoint_codes(x: np.ndarray, raw: np.ndarray, scheme: QuantScheme) -> np.ndarray:
    """docs/spec.md, code rules: `midpoint` (LOOKUP; bitsandbytes' quantize_4bit): per slot
    `s = max(raw scale, 1e-38)`; `y = f32(x * f32(1 / s))` in a slot that holds a whole block,
    `f32(x / s)` in a partial one; `y` clamped to the table's range; the code is the number of
    midpoints `f32((t[i] + t[i+1]) / 2)` below `y` (a tie takes the lower entry)."""
    table = np.asarray(scheme.require_table(), np.float32)
    mids = ((table[:-1] + table[1:]) / np.float32(2)).astype(np.float32)
    s = np.maximum(np.asarray(raw, np.float32), MIDPOINT_FLOOR)
    r = (np.float32(1) / s).astype(np.float32)
    block = layout.block_extents(x.shape, scheme)
    whole = np.ones(np.shape(s), bool) if block is None else _slot_counts(x.shape, block) == math.prod(block)
    with np.errstate(over="ignore"):
        y = np.where(layout.expand_to_elements(whole, x.shape, scheme),
                     x * layout.expand_to_elements(r, x.shape, scheme),
                     x / layout.expand_to_elements(s, x.shape, scheme)).astype(np.float32)
    y = np.clip(y, table[0], table[-1])
    return np.searchsorted(mids, y, side="left").astype(np.uint8)


def quantize(x: np.ndarray, scheme: QuantScheme, params: QParams | None = None,
             method: str = "minmax") -> QuantizedData:
    """Calibration to quantize (docs/spec.md, arithmetic) in a row: f32 input checked finite,
    scales calibrated unless given, codes (`x / e`, or under a code rule from the reciprocal of
    the raw scale: given scales are their own raw scales)."""
    x = to_f32(x)
    raise_nonfinite(x)
    raw = raw_off = None
    if params is None:
        if scheme.reciprocal_global:
            params = calibrate(x, scheme, method)
        elif scheme.affine:
            require_method(scheme, method)
            params, raw, raw_off = affine_params(x, scheme)
        else:
            raw = raw_scales(x, scheme, method)
            params = store_scales(raw, scheme)
    if scheme.code_rule is CodeRule.MIDPOINT:
        codes = midpoint_codes(x, params.scales if raw is None else raw, scheme)
    elif scheme.reciprocal_codes:
        codes = reciprocal_codes(x, params.scales if raw is None else raw, scheme,
                                 (params.offsets if raw_off is None else raw_off) if scheme.affine else None)
    elif scheme.affine:
        codes = affine_codes(x, params, scheme)
    else:
        codes = quantize_codes(x, effective_scale(params, x.shape, scheme), scheme)
    return QuantizedData.from_parts(x.shape, scheme, codes, params.scales, params.global_scale, params.offsets)


def affine_codes(x: np.ndarray, params: QParams, scheme: QuantScheme) -> np.ndarray:
    """docs/spec.md, affine offsets, under the spec's division: MIN `y = f32(f32(x - m) / e)` then
    the quantize rule's rounding and clamp; ZERO `clamp(rint(f32(x / e)) + z, qmin, qmax)`; y = 0
    where e = 0."""
    e = effective_scale(params, x.shape, scheme)
    o = layout.expand_to_elements(np.asarray(params.offsets, np.float32), x.shape, scheme)
    t = scheme.traits
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if scheme.offset.kind is OffsetKind.MIN:
            y = np.where(e == 0, np.float32(0), ((x - o).astype(np.float32) / e)).astype(np.float32)
            return encode(y, scheme)
        y = np.where(e == 0, np.float32(0), x / e).astype(np.float32)
        return np.clip(np.rint(y) + o, t.qmin, t.qmax).astype(scheme.code_dtype)


def dequantize(data: QuantizedData) -> np.ndarray:
    """Dequantize (docs/spec.md): `x' = decode(q) * e` in f32; invalid codes (docs/spec.md, invalid
    codes) raise `InvalidDataError` instead of decoding to NaN or an out-of-range value."""
    data.check_codes()
    params = QParams(data.scales(), data.global_scale(), data.offsets())
    return scaled_values(decode(data.codes(), data.scheme), params, data.shape, data.scheme)


def scaled_values(q: np.ndarray, params: QParams, shape: tuple[int, ...], scheme: QuantScheme) -> np.ndarray:
    """The dequantize rule's product of decoded values `q` and their effective scales
    (`x' = q * e`), or for an affine scheme (docs/spec.md, affine offsets) its two f32 operations
    in order: MIN `f32(q * e) + m`, ZERO `f32(q - z) * e`."""
    e = effective_scale(params, shape, scheme)
    with np.errstate(over="ignore", invalid="ignore"):  # a valid huge scale times a code may exceed f32: inf
        if not scheme.affine:
            return (q * e).astype(np.float32)
        o = layout.expand_to_elements(np.asarray(params.offsets, np.float32), shape, scheme)
        if scheme.offset.kind is OffsetKind.MIN:
            return ((q * e).astype(np.float32) + o).astype(np.float32)
        return ((q - o).astype(np.float32) * e).astype(np.float32)
