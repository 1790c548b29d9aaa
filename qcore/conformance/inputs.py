"""Scheme-aware inputs that separate every plausible kernel mistake from the spec (no pytest).

Random normal inputs rarely hit the points where a wrong kernel and the spec disagree: exact
ties, minifloat midpoints, scales on a round-up boundary, the block maximum on an edge element.
These generators put such points in every scale slot, so one case tells apart rounding rules,
clamps, scale rounding and block bookkeeping:

- `grid`: every slot's effective scale is an exact power of two `2**j` (j rotating over the
  binades the slot dtype can store), so `y = x / e` lands *exactly* on the value's decision
  points: every half-integer of the integer code range (both signs, up to the edge), every
  minifloat grid point and midpoint on every binade, every LOOKUP table entry and midpoint,
  +0.0 and -0.0. Each slot's `max |x|` (`h * 2**j`, alternating sign) sits on the slot's first,
  last or middle element in turn, and on the tensor's first and last elements.
- `bounds`: each slot takes one theme in turn: the raw scale `max|x| / h` exactly at a storable
  value of the slot dtype, one f32 ulp above it, one below it (under rule `rne`: at the midpoint
  between two storable values and one ulp either side; under `mx`, whose raw scale is `max|x|`
  itself: at a power of two and one ulp either side); a subnormal scale (f32-subnormal
  inputs included); a scale above the dtype's largest value (stored clamped, so codes saturate);
  an all-zero slot with -0.0 entries.
- `maxfirst` / `maxlast`: every slot's `max |x|` is *unique* and sits on the slot's first
  (`maxfirst`) or last (`maxlast`) element in row-major order, edge (partial) blocks included,
  so the tensor's first or last element is its slot's only maximum (a per-tensor scale's too):
  a reduction loop that starts one late or stops one early gets another scale. The other
  elements are below 0.9 of the maximum; every effective scale is a power of two.

`grid_exponents` gives the `j` of each slot, so the checks can also quantize with explicit
power-of-two parameters and get exact ties on two-level schemes (whose calibrated scales are not
powers of two).
"""
from __future__ import annotations

import math
import zlib

import numpy as np

from qcore.spec import layout
from qcore.spec.schemes import QuantScheme

__all__ = ["SCHEME_DISTRIBUTIONS", "decision_points", "grid_exponents", "scheme_input", "slot_ids"]

SCHEME_DISTRIBUTIONS = ("grid", "bounds", "maxfirst", "maxlast")
"""Distributions that need the scheme (see the module docstring); their inputs are f32."""

_F32 = np.float32
_BOUND_THEMES = ("at", "above", "below", "subnormal", "huge", "zero")

# binades each slot dtype stores exactly as a power of two, narrowed to keep every input finite
# and normal in f32 (x = u * 2**j with |u| <= 57344 and the smallest |u| about 2**-16)
_POW2_RANGE = {"f32": (-40, 40), "f16": (-24, 15), "bf16": (-40, 40), "ue8m0": (-40, 40), "ue4m3": (-9, 8)}
_TWO_LEVEL_RANGE = (-9, 8)  # block scales 2**j under a global 1.0: storable as F16 and UE4M3


def decision_points(s: QuantScheme) -> np.ndarray:
    """The values of `y = x / e` where encodings change or must hold, |y| <= h: integer values'
    half-integers (qmin + 0.5 ... qmax - 0.5); minifloat magnitudes and midpoints; LOOKUP table
    entries and midpoints; both signs, 0.0 and -0.0. Float32, unique, in a stable order."""
    h = _F32(s.half_range)
    if s.is_lookup:
        t = np.asarray(s.require_table(), np.float32)
        mids = ((t[:-1].astype(np.float64) + t[1:]) / 2).astype(np.float32)
        pts = np.concatenate([t, mids])
    elif s.traits.is_float:
        m = s.traits.magnitudes.astype(np.float64)
        mids = (m[:-1] + m[1:]) / 2
        pos = np.concatenate([m, mids]).astype(np.float32)
        pts = np.concatenate([pos, -pos])
    else:
        tr = s.traits
        pts = np.arange(tr.qmin + 0.5, tr.qmax, 1.0, dtype=np.float64).astype(np.float32)
    pts = pts[np.abs(pts) <= h]
    return np.concatenate([np.unique(pts), np.array([0.0, -0.0], np.float32)])


def slot_ids(shape: tuple[int, ...], s: QuantScheme) -> np.ndarray:
    """The scale slot (row-major index into the block grid) of every element, flattened."""
    grid = layout.grid_shape(shape, s)
    ids = np.arange(math.prod(grid), dtype=np.int64).reshape(grid)
    return np.asarray(layout.expand_to_elements(ids, shape, s)).reshape(-1)


def _rng(shape, s: QuantScheme, seed: int, what: str) -> np.random.Generator:
    return np.random.default_rng([seed & 0xFFFFFFFF, zlib.crc32(f"{s}|{shape}|{what}".encode())])


def grid_exponents(shape: tuple[int, ...], s: QuantScheme, seed: int) -> np.ndarray:
    """Per slot (block-grid shape), the `j` of the `grid` input's effective scale `2**j`."""
    grid = layout.grid_shape(shape, s)
    n = math.prod(grid)
    lo, hi = _TWO_LEVEL_RANGE if s.two_level else _POW2_RANGE[s.slot_dtype.value]
    start = int(_rng(shape, s, seed, "j").integers(0, hi - lo + 1))
    js = lo + (start + 7 * np.arange(n)) % (hi - lo + 1)
    return js.reshape(grid).astype(np.int64)


def _max_positions(slots: np.ndarray, nslots: int, rot: int) -> list[tuple[int, int]]:
    """(slot, flat index) where each slot's maximum goes: its first, last or middle element in
    turn, plus the tensor's first and last elements."""
    out = []
    order = np.argsort(slots, kind="stable")
    bounds = np.searchsorted(slots[order], np.arange(nslots + 1))
    for k in range(nslots):
        members = order[bounds[k]:bounds[k + 1]]
        if members.size:
            pick = (members[0], members[-1], members[members.size // 2])[(k + rot) % 3]
            out.append((k, int(pick)))
    if slots.size:
        out += [(int(slots[0]), 0), (int(slots[-1]), slots.size - 1)]
    return out


def _grid(shape, s: QuantScheme, seed: int) -> np.ndarray:
    n = math.prod(shape)
    rng = _rng(shape, s, seed, "grid")
    pts = decision_points(s)
    u = pts[(rng.permutation(max(n, 1))[:n] + int(rng.integers(0, pts.size))) % pts.size]
    slots = slot_ids(shape, s)
    js = grid_exponents(shape, s, seed).reshape(-1)
    e = np.ldexp(np.ones(js.size), js)[slots]
    x = u.astype(np.float64) * e
    h = float(_F32(s.half_range))
    for i, (k, pos) in enumerate(_max_positions(slots, js.size, int(rng.integers(0, 3)))):
        x[pos] = (h if i % 2 == 0 else -h) * float(np.ldexp(1.0, int(js[k])))
    return x.astype(np.float32).reshape(shape)


def _storable(s: QuantScheme, rng: np.random.Generator) -> float:
    """A storable scale of the slot dtype in a random normal binade (not the largest)."""
    tr = s.slot_dtype.traits
    lo, hi = _POW2_RANGE[s.slot_dtype.value]
    raw = _F32(np.ldexp(rng.uniform(1.0, 2.0), int(rng.integers(lo + 2 if lo > -20 else -20, min(hi, 20)))))
    return float(tr.store(np.array([raw], np.float32))[0])


def _tie(s: QuantScheme, v: float) -> float:
    """Under rule `rne`, the midpoint between storable `v` and the next storable value (exact in
    f32: the scale dtypes have fewer mantissa bits); `v` itself under the other rules."""
    if s.scale_round.value != "rne":
        return v
    tr = s.slot_dtype.traits
    nxt = tr.round_up(np.array([np.nextafter(_F32(v), _F32(np.inf))], np.float32))[0]
    return float((_F32(v) + nxt) / _F32(2)) if np.isfinite(nxt) and nxt <= tr.max_value else v


def _target_scale(s: QuantScheme, theme: str, rng: np.random.Generator) -> float:
    """The raw scale `max|x| / h` a `bounds` slot aims at."""
    tr = s.slot_dtype.traits
    if theme in ("at", "above", "below"):
        v = _F32(_tie(s, _storable(s, rng)))
        if theme == "above":
            v = np.nextafter(v, _F32(np.inf))
        elif theme == "below":
            v = np.nextafter(v, _F32(0))
        return float(v)
    if theme == "subnormal":
        tiny = {"f16": 2.0 ** -14, "ue4m3": 2.0 ** -6, "ue8m0": 2.0 ** -127}.get(s.slot_dtype.value, 2.0 ** -126)
        return float(_F32(tiny * rng.uniform(0.05, 0.95)))
    if theme == "huge":
        return float(_F32(min(tr.max_value * rng.uniform(1.0, 1.5), 1e36)))
    return 0.0


def _max_for_scale(target: float, h: float) -> float:
    """An f32 `m` with `f32(m / h) == target` when one exists near `target * h`."""
    t, hh = _F32(target), _F32(h)
    if t == 0:
        return 0.0
    c = _F32(min(float(target) * float(h), float(np.finfo(np.float32).max) / 2))
    up = dn = c
    for _ in range(6):
        for m in (up, dn):
            with np.errstate(over="ignore", under="ignore"):
                if _F32(m / hh) == t:
                    return float(m)
        up, dn = np.nextafter(up, _F32(np.inf)), np.nextafter(dn, _F32(0))
    return float(c)


def _bounds(shape, s: QuantScheme, seed: int) -> np.ndarray:
    n = math.prod(shape)
    rng = _rng(shape, s, seed, "bounds")
    slots = slot_ids(shape, s)
    nslots = math.prod(layout.grid_shape(shape, s))
    h = float(_F32(s.scale_divisor))
    rot = int(rng.integers(0, len(_BOUND_THEMES)))
    maxes = np.array([_max_for_scale(_target_scale(s, _BOUND_THEMES[(k + rot) % len(_BOUND_THEMES)], rng), h)
                      for k in range(nslots)], np.float64)
    m = maxes[slots]
    x = rng.uniform(-1.0, 1.0, n) * m
    x[rng.random(n) < 0.1] = -0.0
    for i, (k, pos) in enumerate(_max_positions(slots, nslots, rot)):
        x[pos] = maxes[k] if i % 2 == 0 else -maxes[k]
    with np.errstate(under="ignore"):
        return x.astype(np.float32).reshape(shape)


def _edge_max(shape, s: QuantScheme, seed: int, last: bool) -> np.ndarray:
    n = math.prod(shape)
    rng = _rng(shape, s, seed, "maxlast" if last else "maxfirst")
    slots = slot_ids(shape, s)
    js = grid_exponents(shape, s, seed).reshape(-1)
    m = float(_F32(s.half_range)) * np.ldexp(np.ones(js.size), js)
    x = rng.uniform(-0.9, 0.9, n) * m[slots]
    order = np.argsort(slots, kind="stable")
    bounds = np.searchsorted(slots[order], np.arange(js.size + 1))
    for k in range(js.size):
        members = order[bounds[k]:bounds[k + 1]]
        if members.size:
            x[members[-1] if last else members[0]] = m[k] if k % 2 == 0 else -m[k]
    return x.astype(np.float32).reshape(shape)


def scheme_input(shape: tuple[int, ...], dist: str, s: QuantScheme, seed: int) -> np.ndarray:
    """The f32 input of distribution `dist` ('grid', 'bounds', 'maxfirst' or 'maxlast') for
    scheme `s` on `shape`."""
    shape = tuple(shape)
    if math.prod(shape) == 0:
        return np.zeros(shape, np.float32)
    if dist in ("maxfirst", "maxlast"):
        out = _edge_max(shape, s, seed, dist == "maxlast")
    else:
        out = _grid(shape, s, seed) if dist == "grid" else _bounds(shape, s, seed)
    assert np.all(np.isfinite(out)), (dist, str(s), shape)
    return out
