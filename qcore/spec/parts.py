"""A scheme's parts as values: the value types, modes, scale dtypes, rounding and code rules,
offsets, stores and field orders, block and tensor levels, named lookup tables (docs/spec.md:
schemes). Each part checks itself; `qcore.spec.validity` holds the rules between parts."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from qcore.spec.codecs import SCALES, VALUES, ScaleTraits, ValueTraits
from qcore.errors import SchemeError


class QuantValue(enum.Enum):
    """What one quantized element is; `.traits` is its row in `codecs.VALUES`."""

    Q8F = "q8f"
    Q8S = "q8s"
    Q4F = "q4f"
    Q4S = "q4s"
    Q2F = "q2f"
    Q2S = "q2s"
    E4M3 = "e4m3"
    E5M2 = "e5m2"
    E2M1 = "e2m1"
    U8 = "u8"
    U4 = "u4"
    U2 = "u2"

    @property
    def traits(self) -> ValueTraits:
        return VALUES[self.value]

    @property
    def bits(self) -> int:
        return self.traits.bits

    def __str__(self) -> str:
        return self.value


class QuantMode(enum.Enum):
    """SYMMETRIC: codes are the value format itself. LOOKUP: codes index a table."""

    SYMMETRIC = "symmetric"
    LOOKUP = "lookup"


class ScaleDtype(enum.Enum):
    """How a scale is stored; `.traits` is its row in `codecs.SCALES`."""

    F32 = "f32"
    F16 = "f16"
    BF16 = "bf16"
    UE8M0 = "ue8m0"
    UE4M3 = "ue4m3"

    @property
    def traits(self) -> ScaleTraits:
        return SCALES[self.value]

    def __str__(self) -> str:
        return self.value


class ScaleRound(enum.Enum):
    """How a raw scale becomes a stored one (docs/spec.md, scale rounding rules): UP is SPEC v1's
    round-up; RNE rounds to the nearest value of the scale dtype, ties to even; MX is OCP MX's
    `2^(floor(log2 amax) - emax(value))` (one UE8M0 block level, symmetric values)."""

    UP = "up"
    RNE = "rne"
    MX = "mx"

    def __str__(self) -> str:
        return self.value


class CodeRule(enum.Enum):
    """How quantize turns `x` into codes (docs/spec.md, code rules). DIV is the spec's quantize
    rule: `y = x / e`, round half to even (LOOKUP: the nearest entry). AWAY and OFFSET (integer
    values) multiply by the reciprocal of the slot's raw scale and round as llama.cpp's
    quantizers do: half away from zero (Q8_0), or `trunc(y + c0 + 0.5) - c0` on offset codes
    (Q4_0, `c0 = -qmin`). MIDPOINT (LOOKUP) multiplies likewise and counts the table's f32
    midpoints below `y` (bitsandbytes' quantize_4bit)."""

    DIV = "div"
    AWAY = "away"
    OFFSET = "offset"
    MIDPOINT = "midpoint"

    def __str__(self) -> str:
        return self.value


SIGNED_SCALE_DTYPES = tuple(name for name, row in SCALES.items() if row.signed)
"""Scale dtypes with a sign bit (f32, f16, bf16), which signed scales (docs/spec.md, signed scales) may use."""


class OffsetKind(enum.Enum):
    """An affine scheme's per-slot offset (docs/spec.md, affine offsets). MIN: a float `m` added
    after the scale, `x = f32(f32(q * e) + m)` (GGUF Q4_1). ZERO: an integer zero point `z` in the
    value's range, `x = f32((q - z) * e)` (compressed-tensors / AWQ / GPTQ asymmetric)."""

    MIN = "min"
    ZERO = "zero"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Offset:
    """The offset part of an affine scheme: its kind and, for MIN, the float dtype it is stored in
    (F32, F16, BF16); a ZERO point is stored as one byte per slot."""

    kind: OffsetKind
    dtype: "ScaleDtype | None" = None

    def __post_init__(self) -> None:
        kind = _coerce(OffsetKind, self.kind, "offset kind")
        object.__setattr__(self, "kind", kind)
        if kind is OffsetKind.MIN:
            dtype = _coerce(ScaleDtype, self.dtype if self.dtype is not None else "f32", "offset dtype")
            if dtype.value not in SIGNED_SCALE_DTYPES:
                raise SchemeError(f"a min offset is stored as {'/'.join(SIGNED_SCALE_DTYPES)}, got {dtype}; "
                                  "e.g. u4/block32:f16/min:f16")
            object.__setattr__(self, "dtype", dtype)
        elif self.dtype is not None:
            raise SchemeError(f"a zero point is an integer of the value, stored in one byte; it takes no dtype, "
                              f"got {self.dtype}; write /zero")

    def __str__(self) -> str:
        return f"min:{self.dtype}" if self.kind is OffsetKind.MIN else "zero"


class StoreKind(enum.Enum):
    NATIVE = "native"
    PACKED_U32 = "packed_u32"
    PACKED_NATIVE = "packed_native"


class FieldOrder(enum.Enum):
    """Which element of a line each field of a packed word holds (docs/spec.md, field orders)."""

    LOW = "low"  # the byte layout: element k of a run of n in field k (element 0 in the lowest bits)
    HIGH = "high"  # element k of a run in field n - 1 - k (bitsandbytes: element 2k in the high nibble)
    SPLIT = "split"  # groups of G elements: word j of a group holds elements j, j + G/n, ... (GGUF)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class QuantStore:
    """Where codes live in the payload (docs/spec.md, portable bytes). `dim` is the packing axis
    counted from the end.

    PackedU32(d): 32/bits fields per little-endian u32 word along axis `rank - 1 - d`;
    PackedNative(d): 8/bits fields per byte. Element k of a run sits in bits [k*bits, (k+1)*bits):

        u32 word of Q4S, elements e0..e7:   | e7 | e6 | e5 | e4 | e3 | e2 | e1 | e0 |
                                            bit 31                          bit 0

    `order` (docs/spec.md, field orders) moves elements between the fields of a line: HIGH puts
    element 0 of a run in the highest field; SPLIT cuts the line into groups of `group` elements
    (the last may be shorter) and word j of a group holds its elements j, j + W, j + 2W, ... (W
    words per group).
    """

    kind: StoreKind
    dim: int = 0
    order: FieldOrder = FieldOrder.LOW
    group: int = 0  # SPLIT only: elements per group along the packing axis

    def __post_init__(self) -> None:
        if not isinstance(self.dim, (int, np.integer)) or isinstance(self.dim, bool) or self.dim < 0:
            raise SchemeError(f"packing axis must be an int >= 0, got {self.dim!r}; use e.g. PackedU32(0)")
        if self.dim > INT64_MAX:
            raise SchemeError(f"packing axis {self.dim} exceeds int64; use e.g. PackedU32(0)")
        if self.kind is StoreKind.NATIVE and self.dim != 0:
            raise SchemeError(f"Native store has no packing axis, got dim={self.dim}; use Native()")
        object.__setattr__(self, "dim", int(self.dim))
        order = _coerce(FieldOrder, self.order, "field order")
        object.__setattr__(self, "order", order)
        if order is not FieldOrder.LOW and self.kind is StoreKind.NATIVE:
            raise SchemeError(f"a field order ({order}) needs a packed store; Native holds one code per byte")
        g = self.group
        if isinstance(g, bool) or not isinstance(g, (int, np.integer)) or g < 0 or g > INT64_MAX:
            raise SchemeError(f"a split group is an int of elements, got {g!r}; e.g. order:split32")
        if (order is FieldOrder.SPLIT) != (g > 0):
            raise SchemeError(f"a split order takes a group size > 0 and the other orders none, got {order} "
                              f"with group {g}; e.g. order:split32")
        object.__setattr__(self, "group", int(g))

    @property
    def word_bits(self) -> int:
        return 32 if self.kind is StoreKind.PACKED_U32 else 8

    @property
    def order_text(self) -> str:
        """The order's text part: '' for LOW, 'order:high', 'order:split32'."""
        if self.order is FieldOrder.LOW:
            return ""
        return f"order:{self.order}" + (str(self.group) if self.order is FieldOrder.SPLIT else "")

    def __str__(self) -> str:
        if self.kind is StoreKind.NATIVE:
            return "native"
        return self.kind.value + (f":{self.dim}" if self.dim else "")


def Native() -> QuantStore:
    """One byte per element, row-major."""
    return QuantStore(StoreKind.NATIVE)


def PackedU32(dim: int = 0, order: FieldOrder | str = FieldOrder.LOW, group: int = 0) -> QuantStore:
    """32/bits fields per u32 word along axis `rank - 1 - dim` (fields in `order`: field orders)."""
    return QuantStore(StoreKind.PACKED_U32, dim, order, group)


def PackedNative(dim: int = 0, order: FieldOrder | str = FieldOrder.LOW, group: int = 0) -> QuantStore:
    """8/bits fields per byte along axis `rank - 1 - dim` (sub-byte values only; fields in
    `order`: field orders)."""
    return QuantStore(StoreKind.PACKED_NATIVE, dim, order, group)


@dataclass(frozen=True)
class BlockLevel:
    """One scale per block of `dims`, aligned to the trailing tensor axes. `flat` (docs/spec.md,
    blocks over the flattened tensor; one dim only): blocks of `dims[0]` consecutive elements of
    the row-major flattened tensor, which is then stored as the 1-D tensor of that length
    (bitsandbytes)."""

    dims: tuple[int, ...]
    dtype: ScaleDtype = ScaleDtype.F32
    flat: bool = False


@dataclass(frozen=True)
class TensorLevel:
    """One scale for the whole tensor. `reciprocal` (two-level only; docs/spec.md, reciprocal
    global scale): the stored global is `G = 1 / g`, and the effective scale `s_b / G`
    (compressed-tensors' NVFP4)."""

    dtype: ScaleDtype = ScaleDtype.F32
    reciprocal: bool = False


INT64_MAX = (1 << 63) - 1
"""Largest number a scheme or a file's metadata may hold (docs/spec.md, size claims)."""


def _parse_int(digits: str, what: str, text: str) -> int:
    """A decimal number of scheme text, refused beyond int64 before Python converts it (a number
    of thousands of digits would otherwise hit int()'s digit limit or cost quadratic time)."""
    digits = digits.lstrip("0") or "0"
    if len(digits) > 19 or int(digits) > INT64_MAX:
        shown = digits if len(digits) <= 24 else f"{digits[:12]}...({len(digits)} digits)"
        raise SchemeError(f"cannot parse scheme {text[:80]!r}: {what} {shown} exceeds int64; use a smaller {what}")
    return int(digits)


def _normalize_dims(dims: int | Iterable[int]) -> tuple[int, ...]:
    if isinstance(dims, (int, np.integer)):
        dims = (dims,)
    try:
        dims = tuple(dims)
    except TypeError:
        raise SchemeError(f"block dims must be ints, got {dims!r}; use e.g. per_block([32])") from None
    if not 1 <= len(dims) <= 5:
        raise SchemeError(f"block dims need 1 to 5 entries, got {list(dims)}; use e.g. per_block([32])")
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1:
            raise SchemeError(f"block dims must be positive ints, got {list(dims)}; use e.g. per_block([32])")
        if d > INT64_MAX:
            raise SchemeError(f"block dim {d} exceeds int64; use a block no larger than the tensor")
    dims = tuple(int(d) for d in dims)
    while len(dims) > 1 and dims[0] == 1:  # [1, 32] == [32]
        dims = dims[1:]
    return dims


NF4 = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)
TABLES: dict[str, tuple[float, ...]] = {"nf4": tuple(float(np.float32(v)) for v in NF4)}
"""Named lookup tables that travel by name in the text form (`q4s-lookup[nf4]`)."""


def _coerce(enum_cls, v, what: str):
    if isinstance(v, enum_cls):
        return v
    if isinstance(v, str):
        try:
            return enum_cls(v.lower())
        except ValueError:
            pass
    choices = ", ".join(m.value for m in enum_cls)
    raise SchemeError(f"unknown {what} {v!r}; use one of {choices}")


_NATIVE = QuantStore(StoreKind.NATIVE)
_PACKED_U32_0 = QuantStore(StoreKind.PACKED_U32, 0)


def _check_table(table, bits: int) -> tuple[float, ...]:
    try:
        with np.errstate(invalid="ignore"):  # NaN entries (from a payload) are refused just below
            arr = np.asarray(table, dtype=np.float64)
    except (TypeError, ValueError):
        raise SchemeError(f"LOOKUP table must be a list of floats, got {table!r}") from None
    n = 1 << bits
    if arr.ndim != 1 or arr.size != n:
        raise SchemeError(f"LOOKUP table for a {bits}-bit value needs exactly {n} entries, got {arr.size}")
    with np.errstate(over="ignore"):
        f = arr.astype(np.float32)
    if not np.all(np.isfinite(f)):
        raise SchemeError("LOOKUP table entries must be finite float32 values")
    if not np.all(np.diff(f) > 0):
        raise SchemeError("LOOKUP table must be strictly increasing (as float32)")
    if not np.any(f != 0):
        raise SchemeError("LOOKUP table must not be all zero")
    return tuple(float(v) for v in f)
