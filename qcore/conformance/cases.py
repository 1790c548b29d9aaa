"""The conformance scheme space, shapes and inputs, as data (no pytest, no backend).

A `Case` is fully defined by its fields and prints as a readable id that can be pasted into
`pytest -k`, `qcore conformance --filter` or `qcore conformance --case` (`Case.from_id`):

    q4s/block32:f16/packed_native:1-6x40-grid-f32-f32-0

The space (docs/spec.md, schemes) is every value x both modes (LOOKUP for integer values only) x
every level (per-tensor in each scale dtype; blocks [32], [4, 8] and [3, 5] in each scale dtype;
two-level with F16 and UE4M3 block scales) x every valid store (packing axis 0 and 1), plus the
presets. `sampling.py` cuts it into strata and draws each run's cases from what the backend
supports; `inputs.py` adds the scheme-aware `grid` and `bounds` inputs to the distributions here.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Iterator

import ml_dtypes
import numpy as np

from qcore.errors import QCoreError
from qcore.conformance.inputs import SCHEME_DISTRIBUTIONS, scheme_input
from qcore.spec.schemes import PRESETS, QuantScheme, QuantStore, StoreKind, scheme as parse_scheme

__all__ = [
    "VALUE_MODES",
    "LEVELS",
    "RECIP_LEVELS",
    "SPACE_PRESETS",
    "rules_label",
    "STORES_8BIT",
    "STORES_SUBBYTE",
    "head_bits",
    "SHAPES",
    "FULL_SHAPES",
    "DISTRIBUTIONS",
    "INPUT_DTYPES",
    "Case",
    "lookup_table",
    "conformance_scheme",
    "make_input",
    "np_dtype",
    "OPS_SHAPES",
    "LARGE_SHAPE",
    "EDGE_SHAPES",
    "scheme_cases",
    "scheme_space",
    "shapes_for",
    "cases",
    "level_label",
    "store_label",
    "value_label",
]

# --------------------------------------------------------------------------- scheme axes


def lookup_table(bits: int) -> tuple[float, ...]:
    """A custom (not named) LOOKUP table of 2**bits entries: non-uniform and asymmetric, so the
    half-range `max |table|` comes from the negative end and ties are not symmetric."""
    n = 1 << bits
    u = np.linspace(-1.0, 0.8, n)
    t = np.sign(u) * np.abs(u) ** 1.5
    return tuple(float(v) for v in t.astype(np.float32))


# Text heads; a custom table is attached in `_with_head`. q4s uses the named nf4 table (it travels
# by name), the other integer values a custom table (it travels in the payload).
VALUE_MODES: tuple[str, ...] = (
    "q8f", "q8s", "q4f", "q4s", "q2f", "q2s", "e4m3", "e5m2", "e2m1",
    "q8f-lookup", "q8s-lookup", "q4f-lookup", "q4s-lookup[nf4]", "q2f-lookup", "q2s-lookup",
)
"""Every value in SYMMETRIC mode, and every integer value in LOOKUP mode."""

_DTYPES = ("f32", "f16", "bf16", "ue8m0", "ue4m3")
LEVELS: tuple[str, ...] = (
    # per-tensor in each scale dtype ("" = the default, one f32 per-tensor scale)
    "", "tensor:f16", "tensor:bf16", "tensor:ue8m0", "tensor:ue4m3",
    # one block level in each scale dtype: a 1-D block, a 2-D block, and a 2-D block whose odd
    # extents leave partial edge blocks on every shape below
    *(f"block32:{d}" for d in _DTYPES),
    *(f"block4x8:{d}" for d in _DTYPES),
    *(f"block3x5:{d}" for d in _DTYPES),
    # two-level (NVFP4-like): F16 or UE4M3 block scales under one f32 global
    "block16:ue4m3/tensor:f32", "block32:f16/tensor:f32",
    "block4x8:ue4m3/tensor:f32", "block3x5:f16/tensor:f32",
)
"""Scale levels, as text parts of a scheme."""

RECIP_LEVELS: tuple[str, ...] = (
    "block16:ue4m3/tensor:f32:recip", "block4x8:ue4m3/tensor:f32:recip",
    "block32:f16/tensor:f32:recip", "block3x5:f16/tensor:f32:recip",
)
"""Two-level scales whose global is stored as its reciprocal (docs/spec.md, reciprocal global
scale; compressed-tensors' NVFP4). They come after the SPEC v1 space, so its strata keep their
order and indices."""

STORES_8BIT = ("native", "packed_u32", "packed_u32:1")
STORES_SUBBYTE = ("packed_u32", "packed_u32:1", "packed_native", "packed_native:1")
"""Every valid store for 8-bit and for sub-byte values (packing axis 0 and 1)."""


def head_bits(head: str) -> int:
    """The bit width of a scheme head's value (`q4s-lookup` -> 4)."""
    return parse_scheme(head.split("-")[0]).bits


def conformance_scheme(text: str) -> QuantScheme:
    """Parse scheme text; a custom-table LOOKUP head (`q4f-lookup`, no `[name]`) gets the suite's
    own `lookup_table(bits)`, so a case's text alone reproduces it."""
    head, _, rest = text.partition("/")
    if head.endswith("-lookup"):
        base = parse_scheme(head[: -len("-lookup")] + ("/" + rest if rest else ""))
        return base.with_mode("lookup", lookup_table(base.bits))
    return parse_scheme(text)


def _build(head: str, level: str, store: str) -> QuantScheme:
    s = conformance_scheme("/".join(p for p in (head, level) if p))
    kind, _, dim = store.partition(":")
    return s.with_store(QuantStore(StoreKind(kind), int(dim or 0)))


def value_label(s: QuantScheme) -> str:
    """Row label of the capability matrix: the value and mode."""
    if not s.is_lookup:
        return s.value.value
    return f"{s.value.value}-lookup" + (f"[{s.table_name}]" if s.table_name else "")


def level_label(s: QuantScheme) -> str:
    """The level part of a scheme's text ('tensor:f32' when it has the default one)."""
    parts = []
    if s.block is not None:
        parts.append("block" + "x".join(map(str, s.block.dims)) + f":{s.block.dtype}")
    if s.tensor is not None:
        parts.append(f"tensor:{s.tensor.dtype}" + (":recip" if s.tensor.reciprocal else ""))
    return "/".join(parts) or "tensor:f32"


def store_label(s: QuantScheme) -> str:
    st = s.store
    return st.kind.value + (f":{st.dim}" if st.dim else "")


def rules_label(s: QuantScheme) -> str:
    """The rules beyond SPEC v1's that a scheme uses (docs/spec.md: scale rounding rules, signed
    scales, code rules, affine offsets, field orders, flat blocks), as its text parts joined by
    '/': '' for none, e.g. 'signed/round:rne/codes:offset', 'min:f16/round:rne',
    'flat/order:high'."""
    return "/".join((["flat"] if s.flat_blocks else []) + s.rule_parts)


SPACE_PRESETS: tuple[QuantScheme, ...] = tuple(p for p in PRESETS.values() if not rules_label(p))
"""The presets under v1's quantize rules, part of the enumerated space; the others (`q8_0`,
`q4_0`) join the rules' strata (`sampling`)."""


def scheme_space(full: bool = False) -> list[QuantScheme]:
    """The enumerated schemes. `full`: the whole product (about 1,600 schemes). Default: a
    covering sample of about 120 in which every value x mode meets every valid store, every level
    appears at least three times, the presets are included, and every value x mode meets one
    reciprocal-global level."""
    out: list[QuantScheme] = []
    seen: set[QuantScheme] = set()

    def add(s: QuantScheme) -> None:
        if s not in seen:
            seen.add(s)
            out.append(s)

    if full:
        for head in VALUE_MODES:
            stores = STORES_8BIT if head_bits(head) == 8 else STORES_SUBBYTE
            for level in LEVELS:
                for store in stores:
                    add(_build(head, level, store))
    else:
        i = 0
        for head in VALUE_MODES:  # every value x mode x store, levels rotating
            stores = STORES_8BIT if head_bits(head) == 8 else STORES_SUBBYTE
            for store in stores:
                add(_build(head, LEVELS[(i * 7) % len(LEVELS)], store))
                i += 1
        for j, level in enumerate(LEVELS):  # every level with two more values, default store
            for k in (0, 1):
                head = VALUE_MODES[(j * 4 + k * 7) % len(VALUE_MODES)]
                stores = STORES_8BIT if head_bits(head) == 8 else STORES_SUBBYTE
                add(_build(head, level, stores[(j + k) % len(stores)]))
    for p in SPACE_PRESETS:
        add(p)
    for i, head in enumerate(VALUE_MODES):  # the reciprocal global, after the v1 space
        stores = STORES_8BIT if head_bits(head) == 8 else STORES_SUBBYTE
        for j, level in enumerate(RECIP_LEVELS):
            for k, store in enumerate(stores):
                if full or (k == 0 and j == i % len(RECIP_LEVELS)):  # the sample: one level per value
                    add(_build(head, level, store))
    return out


# --------------------------------------------------------------------------- shapes

SHAPES: tuple[tuple[int, ...], ...] = (
    (6, 40),      # rank 2: 40 = 32 + 8 and 6 = 4 + 2 leave partial blocks; 40 % 16 = 8 partial u32 word
    (67,),        # rank 1, prime: partial block32, partial word on every packing
    (3, 5, 37),   # rank 3, odd extents: partial blocks on both block axes, partial words
    (1,),         # a single element
    (0, 8),       # empty: every section but scales/global/table is empty
    (2, 64),      # whole blocks and whole words everywhere
)
"""Default shapes, in rotation order; each scheme takes the first few that fit it."""

FULL_SHAPES: tuple[tuple[int, ...], ...] = SHAPES + (
    (17, 1),          # packing axis 1 over an odd extent, blocks wider than the tensor
    (2, 3, 4, 33),    # rank 4
    (64, 96),         # larger: many blocks, many words
)
"""Extra shapes added by --full."""


def shapes_for(s: QuantScheme, shapes=SHAPES, max_elements: int | None = None) -> list[tuple[int, ...]]:
    """The shapes from `shapes` that `s` can quantize: rank >= block rank, rank > packing axis,
    and at most `max_elements` elements."""
    need = max(len(s.block.dims) if s.block is not None else 1,
               s.store.dim + 1 if s.store.kind is not StoreKind.NATIVE else 1)
    return [sh for sh in shapes
            if len(sh) >= need and (max_elements is None or math.prod(sh) <= max_elements)]


# --------------------------------------------------------------------------- inputs

INPUT_DTYPES = ("f32", "f16", "bf16", "f64")
_NP_DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16, "f64": np.float64}

DISTRIBUTIONS: tuple[str, ...] = (
    "normal",     # N(0, 1)
    "outliers",   # N(0, 1) with a few entries x 1000: most codes small, clipping-free max
    "ties",       # half-integers k/2 with one exact max: rint ties, minifloat midpoints
    "rows",       # each row scaled by 2**k, k in [-20, 20] (f16: [-6, 6]): scales across binades
    "tiny",       # N(0, 1) x 1e-39 .. subnormal f32 scales, F16/UE4M3 subnormal round-up
    "huge",       # N(0, 1) x 1e4 .. the largest finite of the dtype / 2: saturating scales
    "zeros",      # all zero: zero scales, the encoding of 0, UE8M0's 2**-127
    "constant",   # one repeated negative value: the max is negative
)


def make_input(shape: tuple[int, ...], dist: str, dtype: str, seed: int) -> np.ndarray:
    """A seeded input of `shape`, distribution `dist`, dtype `dtype` ('f32', 'f16', 'bf16', 'f64');
    every element is finite in that dtype."""
    rng = np.random.default_rng(seed)
    n = math.prod(shape)
    npdt = _NP_DTYPES[dtype]
    x = rng.standard_normal(n)
    if dist == "outliers":
        k = max(1, n // 50)
        x[rng.integers(0, max(n, 1), size=k) if n else []] *= 1000.0
    elif dist == "ties":
        x = rng.integers(-16, 17, size=n) / 2.0
        if n:
            x[rng.integers(0, n)] = 8.0
    elif dist == "rows":
        rows = shape[0] if shape and shape[0] else 1
        span = 6 if dtype == "f16" else 20
        k = rng.integers(-span, span + 1, size=rows).astype(np.float64)
        x = (x.reshape(rows, -1) * np.exp2(k)[:, None]).reshape(-1) if n else x
    elif dist == "tiny":
        x = x * (1e-39 if dtype in ("f32", "f64", "bf16") else 1e-7)
    elif dist == "huge":
        top = float(ml_dtypes.finfo(npdt).max) if dtype != "f64" else float(np.finfo(np.float32).max)
        x = x / max(1.0, float(np.max(np.abs(x)))) * top / 2 if n else x
    elif dist == "zeros":
        x = np.zeros(n)
    elif dist == "constant":
        x = np.full(n, -rng.uniform(0.1, 10.0))
    lim = float(ml_dtypes.finfo(npdt).max if dtype != "f64" else np.finfo(np.float32).max) / 2
    out = np.clip(x, -lim, lim).reshape(shape).astype(npdt)
    assert np.all(np.isfinite(out.astype(np.float64))), (dist, dtype)
    return out


@dataclass(frozen=True)
class Case:
    """One conformance case: a scheme on a shape with a seeded input.

    `index` distinguishes repeated draws of the same scheme, shape and distribution.
    """

    scheme: str
    shape: tuple[int, ...]
    dist: str = "normal"
    dtype: str = "f32"
    seed: int = 0
    index: int = 0
    out_dtype: str = "f32"
    _parsed: QuantScheme | None = field(default=None, compare=False, repr=False)

    @property
    def qscheme(self) -> QuantScheme:
        if self._parsed is not None:
            return self._parsed
        return conformance_scheme(self.scheme)

    @property
    def shape_text(self) -> str:
        return "x".join(map(str, self.shape))

    @property
    def id(self) -> str:
        """Readable id: scheme text, shape, input, output dtype, draw; pasteable into -k,
        `--filter` and `qcore conformance --case` (see `from_id`)."""
        return f"{self.scheme}-{self.shape_text}-{self.dist}-{self.dtype}-{self.out_dtype}-{self.index}"

    @classmethod
    def from_id(cls, text: str, seed: int = 0) -> "Case":
        """The case whose `id` is `text` (with the run's `seed`): reruns one failing case."""
        from qcore.errors import InputError

        try:
            scheme, shape, dist, dtype, out, index = text.strip().rsplit("-", 5)
            shp = tuple(int(d) for d in shape.split("x"))
            s = conformance_scheme(scheme)
            if dist not in DISTRIBUTIONS + SCHEME_DISTRIBUTIONS or dtype not in INPUT_DTYPES or out not in INPUT_DTYPES:
                raise ValueError(dist)
            return cls(scheme, shp, dist, dtype, seed, int(index), out, _parsed=s)
        except (ValueError, QCoreError) as e:
            raise InputError(f"case id {text!r} is not SCHEME-SHAPE-DIST-DTYPE-OUT-INDEX ({e}); "
                             "copy it from a failure line, e.g. 'q8s-6x40-grid-f32-f32-0'") from None

    def describe(self) -> str:
        """The line a failure prints: everything needed to rerun the case."""
        return (f"scheme={self.scheme} shape={self.shape} input={self.dist}/{self.dtype} "
                f"seed={self.input_seed}")

    @property
    def input_seed(self) -> int:
        return (self.seed * 1_000_003 + zlib.crc32(self.id.encode())) & 0xFFFFFFFF

    def input(self) -> np.ndarray:
        """The case's input array (fresh each call, the same bytes every time)."""
        if self.dist in SCHEME_DISTRIBUTIONS:
            return scheme_input(self.shape, self.dist, self.qscheme, self.input_seed).astype(np_dtype(self.dtype))
        return make_input(self.shape, self.dist, self.dtype, self.input_seed)

    def __str__(self) -> str:
        return self.id


def cases(full: bool = False, seed: int = 0, max_elements: int | None = None,
          shapes_per_scheme: int | None = None, schemes: list[QuantScheme] | None = None) -> Iterator[Case]:
    """Every case of the run, in a stable order.

    Default: each scheme on `shapes_per_scheme` (2) of the default shapes that fit, rotating so
    that every shape (the empty one and the single element included) is used; distributions and
    input dtypes rotate too. `full`: every scheme on every shape that fits. `max_elements` caps
    the shapes (for slow backends, e.g. a simulator). (The suite itself draws its cases per
    stratum, see `sampling.py`; this fixed sample is kept for callers that want one.)
    """
    space = scheme_space(full) if schemes is None else schemes
    shapes = FULL_SHAPES if full else SHAPES
    per = shapes_per_scheme if shapes_per_scheme is not None else (len(shapes) if full else 2)
    r = 0
    for si, s in enumerate(space):
        fit = shapes_for(s, shapes, max_elements)
        if not fit:
            continue
        picked = [fit[(si + k) % len(fit)] for k in range(min(per, len(fit)))]
        for sh in picked:
            for d in range(1):
                dist = DISTRIBUTIONS[r % len(DISTRIBUTIONS)]
                dtype = INPUT_DTYPES[(r // len(DISTRIBUTIONS) + r) % len(INPUT_DTYPES)]
                out_dtype = INPUT_DTYPES[(r * 3 + 1) % len(INPUT_DTYPES)] if r % 3 == 0 else "f32"
                r += 1
                yield Case(str(s), sh, dist, dtype, seed, d, out_dtype, _parsed=s)


def np_dtype(name: str):
    """numpy dtype of 'f32', 'f16', 'bf16', 'f64'."""
    return np.dtype(_NP_DTYPES[name])


LARGE_SHAPE: tuple[int, ...] = (1025, 1024)
"""The `inputs` group check's large tensor: 1,049,600 elements, past 2**20 (and past every
2**16 chunk), with partial blocks on 4x8 and 3x5 and a partial row of 16-element chunks."""

EDGE_SHAPES: tuple[tuple[int, ...], ...] = ((3, 5, 37), (67,), (6, 40))
"""Shapes of the `maxfirst` / `maxlast` inputs (first that fits): (3, 5, 37) leaves partial
(edge) blocks on every block shape of the space."""


OPS_SHAPES: tuple[tuple[int, ...], ...] = ((8, 40), (4, 16), (2, 4))
"""Matrix shapes for the ops checks (first that fits `max_elements`): 8 x 40 crosses block and
word edges (40 = 32 + 8) and is a valid matmul weight [K, N]."""


def scheme_cases(kind: str, full: bool = False, seed: int = 0, max_elements: int | None = None,
                 schemes: list[QuantScheme] | None = None) -> Iterator[Case]:
    """One case per scheme for the per-scheme checks: `kind` 'ops' (a matrix from `OPS_SHAPES`,
    normal f32 input), 'bad-input' / 'cross' (the first non-empty default shape that fits), or
    'inputs' (per scheme: `maxfirst` and `maxlast` inputs on the first of `EDGE_SHAPES` that
    fits, a normal input for the views and output dtypes, and a `LARGE_SHAPE` tensor where
    `max_elements` allows)."""
    space = scheme_space(full) if schemes is None else schemes
    for s in space:
        if kind == "inputs":
            edge = [sh for sh in shapes_for(s, EDGE_SHAPES, max_elements)]
            if edge:
                yield Case(str(s), edge[0], "maxlast", "f32", seed, 0, "f32", _parsed=s)
                yield Case(str(s), edge[0], "maxfirst", "f32", seed, 0, "f32", _parsed=s)
                yield Case(str(s), edge[0], "normal", "f32", seed, 1, "f32", _parsed=s)
            for sh in shapes_for(s, (LARGE_SHAPE,), max_elements):
                yield Case(str(s), sh, "normal", "f32", seed, 0, "f32", _parsed=s)
            continue
        if kind == "ops":
            fit = shapes_for(s, OPS_SHAPES, max_elements)
            dist, dtype = "normal", "f32"
        else:
            fit = [sh for sh in shapes_for(s, SHAPES, max_elements) if math.prod(sh) > 0]
            dist, dtype = ("ties", "f32") if kind == "cross" else ("normal", "f16")
        if fit:
            yield Case(str(s), fit[0], dist, dtype, seed, 0, "f32", _parsed=s)
