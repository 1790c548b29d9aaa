"""Trait tables for quantized values and scale dtypes (docs/spec.md, schemes and arithmetic).

One frozen row per value (`VALUES`) and per scale dtype (`SCALES`). Code reads the rows' fields;
it never tests which value or dtype it holds. A new format is one new row.

Everything here is plain numpy over float32 and its bit patterns, so the rules read as the
spec states them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable

import numpy as np

__all__ = [
    "ValueTraits",
    "ScaleTraits",
    "VALUES",
    "SCALES",
    "SCALE_IDS",
    "SCALE_ARRAYS",
    "SCALE_ROUNDS",
    "SCALE_SLOTS",
    "ScaleArrays",
    "ScaleSlot",
    "scale_slot_id",
    "CODE_RULES",
    "rule_codes",
    "code_rule_kernel",
    "f32_bits",
    "bits_f32",
    "minifloat_values",
]

F32_TINY = np.float32(1.17549435e-38)  # smallest normal f32, the floor of a two-level global scale


def f32_bits(x: np.ndarray) -> np.ndarray:
    """The IEEE bit patterns of a float32 array, as uint32."""
    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)


def bits_f32(b: np.ndarray) -> np.ndarray:
    """The float32 values of uint32 bit patterns."""
    return np.ascontiguousarray(b, dtype=np.uint32).view(np.float32)


# --------------------------------------------------------------------------- minifloats


def minifloat_values(exp_bits: int, man_bits: int, bias: int, n_finite: int) -> np.ndarray:
    """Magnitudes of the non-negative codes 0..n_finite-1 of a sign/exponent/mantissa format.

    Code c has exponent field c >> man_bits and mantissa field c & (2**man_bits - 1); exponent
    field 0 is subnormal (value f * 2**(1 - bias - man_bits)). The codes are in increasing
    order of value, so the table is sorted.
    """
    codes = np.arange(n_finite, dtype=np.int64)
    e = codes >> man_bits
    f = codes & ((1 << man_bits) - 1)
    normal = np.ldexp(1.0 + f / (1 << man_bits), e - bias)
    subnormal = np.ldexp(f.astype(np.float64), 1 - bias - man_bits)
    return np.where(e == 0, subnormal, normal).astype(np.float32)


@dataclass(frozen=True)
class ValueTraits:
    """One row of the value table: what a quantized value is and how it maps to and from f32.

    `qmin`/`qmax` bound the representable range, `half_range` is the spec's `h`, and for
    minifloats `magnitudes` lists the finite non-negative values by code (sign bit excluded).
    """

    name: str
    bits: int
    is_float: bool
    qmin: float
    qmax: float
    half_range: float
    exp_bits: int = 0
    man_bits: int = 0
    bias: int = 0
    n_finite: int = 0  # count of finite non-negative codes, minifloats only
    special: Callable[[np.ndarray], np.ndarray] | None = field(default=None, compare=False, repr=False)
    unsigned: bool = False  # integer codes 0 .. 2**bits - 1 (u8, u4, u2: docs/spec.md, affine offsets)

    @property
    def emax(self) -> int:
        """floor(log2(qmax)): the exponent of the largest value (E2M1 2, E4M3 8, E5M2 15, Q8 6,
        Q4 2, Q2 0), which the OCP MX scale rule subtracts (docs/spec.md, scale rounding rules)."""
        return int(np.floor(np.log2(self.qmax)))

    @property
    def sign_bit(self) -> int:
        return 1 << (self.bits - 1)

    @cached_property
    def magnitudes(self) -> np.ndarray:
        return minifloat_values(self.exp_bits, self.man_bits, self.bias, self.n_finite)

    @property
    def code_dtype(self) -> np.dtype:
        """Dtype of unpacked codes: int8 for signed integers, uint8 for minifloat codes and
        unsigned integers (docs/spec.md, portable bytes; affine offsets and unsigned values)."""
        return np.dtype(np.uint8 if self.is_float or self.unsigned else np.int8)

    # ----------------------------------------------------------------- encode / decode
    def encode(self, y: np.ndarray) -> np.ndarray:
        """Codes for f32 `y` = x / e (docs/spec.md, quantize): integers round half to even and clamp;
        minifloats saturate at ±max and round to the nearest value, ties to even mantissa."""
        y = np.asarray(y, dtype=np.float32)
        if not self.is_float:
            q = np.clip(np.rint(y), self.qmin, self.qmax)
            return q.astype(self.code_dtype)
        mags = self.magnitudes
        a = np.minimum(np.abs(y), np.float32(self.qmax))
        hi = np.searchsorted(mags, a, side="left")  # mags[hi-1] < a <= mags[hi]
        lo = np.maximum(hi - 1, 0)
        # Neighbouring minifloats lie within a factor 2, so these differences are exact (Sterbenz).
        d_lo = a - mags[lo]
        d_hi = mags[hi] - a
        pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))  # tie: the even code
        code = np.where(pick_hi, hi, lo).astype(np.uint8)
        sign = np.signbit(y).astype(np.uint8) << np.uint8(self.bits - 1)
        return code | sign

    def decode(self, codes: np.ndarray) -> np.ndarray:
        """f32 values of codes; NaN/inf codes of E4M3/E5M2 decode as NaN/inf."""
        codes = np.asarray(codes)
        if not self.is_float:
            return codes.astype(np.float32)
        return self.decode_table[codes.astype(np.uint8) & np.uint8((1 << self.bits) - 1)]

    @cached_property
    def decode_table(self) -> np.ndarray:
        """f32 value of every code 0 .. 2**bits - 1 (minifloats)."""
        half = 1 << (self.bits - 1)
        mags = np.full(half, np.nan, dtype=np.float32)
        mags[: self.n_finite] = self.magnitudes
        if self.special is not None:
            mags = self.special(mags)
        return np.concatenate([mags, -mags]).astype(np.float32)

    @cached_property
    def valid_fields(self) -> np.ndarray:
        """bool per stored field 0 .. 2**bits - 1: whether it means a value of this format.

        Integer fields below `qmin` (Q8S -128, Q4S -8, Q2S -2) and minifloat NaN/Inf codes are
        outside the value's set (docs/spec.md, invalid codes); quantize never writes them.
        """
        fields = np.arange(1 << self.bits)
        if self.is_float:
            return np.isfinite(self.decode_table)
        if self.unsigned:
            return np.ones(fields.shape, dtype=bool)
        signed = np.where(fields >= self.sign_bit, fields - (1 << self.bits), fields)
        return signed >= self.qmin


def _int_row(name: str, bits: int, full: bool) -> ValueTraits:
    qmax = (1 << (bits - 1)) - 1
    qmin = -qmax - 1 if full else -qmax
    return ValueTraits(name, bits, False, float(qmin), float(qmax), (qmax - qmin) / 2)


def _uint_row(name: str, bits: int) -> ValueTraits:
    qmax = (1 << bits) - 1
    return ValueTraits(name, bits, False, 0.0, float(qmax), qmax / 2, unsigned=True)


def _e5m2_specials(mags: np.ndarray) -> np.ndarray:
    out = mags.copy()
    out[0x7C] = np.inf  # IEEE: exponent all ones, mantissa 0
    return out


def _float_row(name, bits, exp_bits, man_bits, bias, n_finite, special=None) -> ValueTraits:
    mx = float(minifloat_values(exp_bits, man_bits, bias, n_finite)[-1])
    return ValueTraits(name, bits, True, -mx, mx, mx, exp_bits, man_bits, bias, n_finite, special)


VALUES: dict[str, ValueTraits] = {
    row.name: row
    for row in (
        _int_row("q8f", 8, True),
        _int_row("q8s", 8, False),
        _int_row("q4f", 4, True),
        _int_row("q4s", 4, False),
        _int_row("q2f", 2, True),
        _int_row("q2s", 2, False),
        _uint_row("u8", 8),
        _uint_row("u4", 4),
        _uint_row("u2", 2),
        # OCP E4M3FN: bias 7, no inf, only S.1111.111 is NaN -> finite codes 0..0x7E, max 448.
        _float_row("e4m3", 8, 4, 3, 7, 0x7F),
        # OCP E5M2: bias 15, IEEE inf/NaN -> finite codes 0..0x7B, max 57344.
        _float_row("e5m2", 8, 5, 2, 15, 0x7C, _e5m2_specials),
        # OCP FP4 E2M1: bias 1, codes 0..7 = 0, .5, 1, 1.5, 2, 3, 4, 6, no inf/NaN.
        _float_row("e2m1", 4, 2, 1, 1, 8),
    )
}


# --------------------------------------------------------------------------- scale dtypes
# Scale storage (docs/spec.md) rounds a raw scale UP to the scale dtype. Every dtype follows one
# rule, read from its row's numbers (`ScaleTraits.round_up`): clamp at `max_value`; at or below
# `least` give `least` (UE8M0 has no zero); below `grid_below` (the dtype's smallest normal, where
# its grid is uniform; for UE8M0 f32's smallest normal) round up to a multiple of `grid_quantum`;
# otherwise drop mantissa bits of the f32, rounding up: `(bits + round_add) & round_mask`. Kernels
# use the same numbers (`SCALE_ARRAYS`).

BF16_MAX = float(bits_f32(np.array([0x7F7F0000], dtype=np.uint32))[0])
UE8M0_MIN = float(np.float32(2.0**-127))


# storage: f32 (already representable) -> little-endian unsigned words; and back


def _enc_f32(s):
    return np.asarray(s, dtype="<f4").view("<u4")


def _dec_f32(u):
    return np.asarray(u, dtype="<u4").view("<f4").astype(np.float32)


def _enc_f16(s):
    return np.asarray(s, dtype=np.float32).astype("<f2").view("<u2")


def _dec_f16(u):
    return np.asarray(u, dtype="<u2").view("<f2").astype(np.float32)


def _enc_bf16(s):
    return (f32_bits(s) >> np.uint32(16)).astype("<u2")  # BF16 = top 16 bits of f32


def _dec_bf16(u):
    return bits_f32(np.asarray(u, dtype=np.uint32) << np.uint32(16))


def _enc_ue4m3(s):
    return VALUES["e4m3"].encode(np.asarray(s, dtype=np.float32)).astype(np.uint8)


def _dec_ue4m3(u):
    return VALUES["e4m3"].decode(np.asarray(u, dtype=np.uint8))


def _enc_ue8m0(s):
    # exponent field of 2**k; the subnormal 2**-127 (bits 0x00400000) has field 0 = byte 0.
    return (f32_bits(s) >> np.uint32(23)).astype(np.uint8)


def _dec_ue8m0(u):
    e = np.asarray(u, dtype=np.uint32)
    bits = np.where(e == 0, np.uint32(0x00400000), e << np.uint32(23))
    out = bits_f32(bits.astype(np.uint32)).copy()
    out[e == 255] = np.nan  # 0xFF is NaN (rejected by payload validation)
    return out


@dataclass(frozen=True)
class ScaleTraits:
    """One row of the scale-dtype table (docs/spec.md: schemes, scale storage, portable bytes).

    The numbers say everything the kernels need: the round-up rule (module comment above) and
    the stored word of a representable scale, `(f32 bits >> (23 - man_bits)) - ((127 - bias) <<
    man_bits)` for a normal value and `value / sub_quantum` below `sub_below`.
    """

    name: str
    nbytes: int
    max_value: float  # raw scales at or above it store as it (the largest value; f32: inf)
    man_bits: int  # mantissa bits of the stored word
    bias: int  # exponent bias of the stored word
    least: float = 0.0  # raw scales at or below it store as it (UE8M0 has no zero: 2**-127)
    sub_below: float = 0.0  # below it the dtype's values are a uniform grid (0: f32 rounding)
    sub_quantum: float = 0.0  # that grid's step
    encode: Callable[[np.ndarray], np.ndarray] = field(default=None, compare=False, repr=False)
    decode: Callable[[np.ndarray], np.ndarray] = field(default=None, compare=False, repr=False)
    grid_below: float = -1.0  # where rounding switches to the uniform grid (-1: sub_below)
    grid_quantum: float = -1.0  # and its step (-1: sub_quantum)
    signed: bool = False  # the word has a sign bit (its top bit), which signed scales use (docs/spec.md)

    def __post_init__(self) -> None:
        # Rounding and the stored word share the subnormal grid, except for UE8M0: its word has
        # no grid (2^-127 is byte 0), but below f32's smallest normal its values are the
        # multiples of 2^-127, which the bit rule (whole f32 binades) cannot round to.
        if self.grid_below < 0:
            object.__setattr__(self, "grid_below", self.sub_below)
        if self.grid_quantum < 0:
            object.__setattr__(self, "grid_quantum", self.sub_quantum)

    @property
    def round_add(self) -> int:
        """Added to the f32 bits before masking: rounds the dropped mantissa bits up."""
        return (1 << (23 - self.man_bits)) - 1

    @property
    def round_mask(self) -> int:
        """Keeps the sign, exponent and `man_bits` mantissa bits of an f32."""
        return (0xFFFFFFFF << (23 - self.man_bits)) & 0xFFFFFFFF

    @property
    def word_shift(self) -> int:
        return 23 - self.man_bits

    @property
    def word_rebias(self) -> int:
        return (127 - self.bias) << self.man_bits

    @property
    def word_sign(self) -> int:
        """The stored word's sign bit (0 for the sign-less UE8M0 and UE4M3)."""
        return 1 << (8 * self.nbytes - 1) if self.signed else 0

    @property
    def word_dtype(self) -> np.dtype:
        return np.dtype({1: "<u1", 2: "<u2", 4: "<u4"}[self.nbytes])

    def round_up(self, s: np.ndarray) -> np.ndarray:
        """Round raw non-negative f32 scales UP to this dtype (docs/spec.md, scale storage), as f32."""
        s = np.asarray(s, dtype=np.float32)
        b = f32_bits(s).astype(np.uint64)
        out = bits_f32(((b + np.uint64(self.round_add)) & np.uint64(self.round_mask)).astype(np.uint32))
        if self.grid_below > 0:
            q = np.float32(self.grid_quantum)
            with np.errstate(over="ignore", invalid="ignore"):
                grid = (np.ceil(s / q) * q).astype(np.float32)
            out = np.where(s < np.float32(self.grid_below), grid, out)
        out = np.where(s <= np.float32(self.least), np.float32(self.least), out)
        return np.where(s >= np.float32(self.max_value), np.float32(self.max_value), out).astype(np.float32)

    def round_nearest(self, s: np.ndarray) -> np.ndarray:
        """Round raw non-negative f32 scales to the NEAREST value of this dtype, ties to even
        (rule `rne`): on the f32 bits at the dtype's mantissa width, on the uniform grid below
        `grid_below`; raw scales at or above `max_value` give it, and the result is at least
        `least`. F32 is the identity, as for `round_up`."""
        s = np.asarray(s, dtype=np.float32)
        shift = 23 - self.man_bits
        if shift == 0:
            return s.copy()
        b = f32_bits(s).astype(np.uint64)
        half = np.uint64((1 << (shift - 1)) - 1)
        lsb = (b >> np.uint64(shift)) & np.uint64(1)
        out = bits_f32(((b + half + lsb) & np.uint64(self.round_mask)).astype(np.uint32))
        if self.grid_below > 0:
            q = np.float32(self.grid_quantum)
            with np.errstate(over="ignore", invalid="ignore"):
                grid = (np.rint(s / q) * q).astype(np.float32)  # s / q is exact (q a power of two)
            out = np.where(s < np.float32(self.grid_below), grid, out)
        out = np.maximum(out, np.float32(self.least))
        return np.where(s >= np.float32(self.max_value), np.float32(self.max_value), out).astype(np.float32)

    def round_mx(self, amax: np.ndarray, emax: int) -> np.ndarray:
        """The OCP MX rule (rule `mx`, power-of-two dtypes): `2^(floor(log2 amax) - emax)` from
        the statistic itself, exact on the f32 exponent field; `least` where that is below it
        (amax 0 or tiny)."""
        amax = np.asarray(amax, dtype=np.float32)
        e = (f32_bits(amax) >> np.uint32(23)).astype(np.int64) - int(emax)
        pow2 = bits_f32((np.maximum(e, 0) << 23).astype(np.uint32))
        return np.where(e >= 1, pow2, np.float32(self.least)).astype(np.float32)

    def store(self, s: np.ndarray) -> np.ndarray:
        """Round raw non-negative f32 scales up to this dtype; result decoded back to f32."""
        return self.round_up(np.asarray(s, dtype=np.float32))


SCALES: dict[str, ScaleTraits] = {
    row.name: row
    for row in (
        # F32 is the identity (scale storage): no clamp, even for a raw scale that overflowed to inf.
        ScaleTraits("f32", 4, float("inf"), 23, 127, encode=_enc_f32, decode=_dec_f32, signed=True),
        ScaleTraits("f16", 2, 65504.0, 10, 15, sub_below=2.0**-14, sub_quantum=2.0**-24,
                    encode=_enc_f16, decode=_dec_f16, signed=True),
        # BF16 is the top half of an f32, subnormals included: the bit rule covers them.
        ScaleTraits("bf16", 2, BF16_MAX, 7, 127, encode=_enc_bf16, decode=_dec_bf16, signed=True),
        ScaleTraits("ue8m0", 1, 2.0**127, 0, 127, least=UE8M0_MIN, encode=_enc_ue8m0, decode=_dec_ue8m0,
                    grid_below=2.0**-126, grid_quantum=2.0**-127),
        ScaleTraits("ue4m3", 1, 448.0, 3, 7, sub_below=2.0**-6, sub_quantum=2.0**-9,
                    encode=_enc_ue4m3, decode=_dec_ue4m3),
    )
}

SCALE_IDS: tuple[str, ...] = tuple(SCALES)
"""Kernel id of each scale dtype: its index here (and in every `SCALE_ARRAYS` array)."""


SCALE_ROUNDS: tuple[str, ...] = ("up", "rne", "mx")
"""The scale rounding rules (docs/spec.md, scale rounding rules): `up` is SPEC v1's; `rne` rounds
to nearest, ties to even; `mx` is OCP MX's `2^(floor(log2 amax) - emax)` (UE8M0 scales only)."""


@dataclass(frozen=True)
class ScaleSlot:
    """A scale dtype with the rule that rounds raw scales into it: one row of the kernels'
    scale table (`SCALE_SLOTS`). `store(s)` is the rule over numpy arrays; for `mx`, `s` is the
    statistic itself (the scheme's scale divisor is 1) and `emax` the value's."""

    traits: ScaleTraits
    rule: str = "up"
    emax: int = 0

    def store(self, s: np.ndarray) -> np.ndarray:
        """Raw non-negative f32 scales rounded by this slot's rule, as f32."""
        s = np.asarray(s, dtype=np.float32)
        if self.rule == "mx":
            return self.traits.round_mx(s, self.emax)
        return _ROUNDERS[self.rule](self.traits, s)


_ROUNDERS = {"up": ScaleTraits.round_up, "rne": ScaleTraits.round_nearest}
MX_DTYPES = ("ue8m0",)
"""Scale dtypes the `mx` rule applies to (powers of two)."""

SCALE_SLOTS: tuple[ScaleSlot, ...] = (
    tuple(ScaleSlot(SCALES[n], "up") for n in SCALE_IDS)
    + tuple(ScaleSlot(SCALES[n], "rne") for n in SCALE_IDS)
    + tuple(ScaleSlot(SCALES[n], "mx", e) for n in MX_DTYPES
            for e in sorted({v.emax for v in VALUES.values() if not v.unsigned}))
)
"""Kernel id of each (scale dtype, rule[, emax]): its index here. The first rows are the `up`
rows in `SCALE_IDS` order, so a dtype's `SCALE_IDS` position is its v1 slot id."""


_SLOT_IDS = {(slot.traits.name, slot.rule, slot.emax): i for i, slot in enumerate(SCALE_SLOTS)}


def scale_slot_id(dtype: str, rule: str = "up", emax: int = 0) -> int:
    """The `SCALE_SLOTS` index of scale dtype `dtype` rounded by `rule` (emax only for `mx`)."""
    try:
        return _SLOT_IDS[(dtype, rule, emax if rule == "mx" else 0)]
    except KeyError:
        raise KeyError(f"no scale slot for dtype {dtype!r} with rule {rule!r} (emax {emax})") from None


@dataclass(frozen=True)
class ScaleArrays:
    """The `SCALE_SLOTS` rows' numbers as arrays indexed by slot id, for kernels."""

    max_value: np.ndarray  # float32
    least: np.ndarray  # float32
    sub_below: np.ndarray  # float32
    sub_quantum: np.ndarray  # float32
    grid_below: np.ndarray  # float32: rounding's uniform grid (sub_below but for UE8M0)
    grid_quantum: np.ndarray  # float32
    round_add: np.ndarray  # uint32
    round_mask: np.ndarray  # uint32
    word_shift: np.ndarray  # uint32
    word_rebias: np.ndarray  # uint32
    word_sign: np.ndarray  # uint32: the word's sign bit, 0 for sign-less dtypes
    nbytes: np.ndarray  # int64
    rule: np.ndarray  # int32: position in SCALE_ROUNDS
    emax: np.ndarray  # int32: the value's emax (rule mx)


def _scale_arrays() -> ScaleArrays:
    rows = [slot.traits for slot in SCALE_SLOTS]

    def col(attr: str, dtype) -> np.ndarray:
        a = np.array([getattr(r, attr) for r in rows], dtype=dtype)
        a.setflags(write=False)
        return a

    def frozen(a: np.ndarray) -> np.ndarray:
        a.setflags(write=False)
        return a

    f32, u32 = np.float32, np.uint32
    return ScaleArrays(col("max_value", f32), col("least", f32), col("sub_below", f32), col("sub_quantum", f32),
                       col("grid_below", f32), col("grid_quantum", f32), col("round_add", u32), col("round_mask", u32), col("word_shift", u32),
                       col("word_rebias", u32), col("word_sign", u32), col("nbytes", np.int64),
                       frozen(np.array([SCALE_ROUNDS.index(t.rule) for t in SCALE_SLOTS], np.int32)),
                       frozen(np.array([t.emax for t in SCALE_SLOTS], np.int32)))


SCALE_ARRAYS = _scale_arrays()


def scale_round_kernel(jit: Callable, f2u: Callable, u2f: Callable) -> Callable:
    """The scale rounding of `ScaleSlot.store` (scale storage and the scale rounding rules) as one
    scalar function for the kernels: `round_scale(s, slot)` rounds a raw f32 scale `s >= 0` (for
    rule `mx`: the statistic) into the scale slot with id `slot` (`SCALE_SLOTS` position), reading
    this module's `SCALE_ARRAYS`. Every kernel backend compiles this one source with its own
    compiler: `jit` (numba's `njit(inline="always")` for the CPU,
    `cuda.jit(device=True, inline="always")` for the GPU) and its f32 <-> u32 bit casts (`f2u`,
    `u2f`). The tests pin it against `ScaleSlot.store` for every slot."""
    import math

    from numba import float32, int32, uint32

    top, least = SCALE_ARRAYS.max_value, SCALE_ARRAYS.least
    grid_below, grid_quantum = SCALE_ARRAYS.grid_below, SCALE_ARRAYS.grid_quantum
    add, mask, shift = SCALE_ARRAYS.round_add, SCALE_ARRAYS.round_mask, SCALE_ARRAYS.word_shift
    rule, emax = SCALE_ARRAYS.rule, SCALE_ARRAYS.emax
    up, mx = SCALE_ROUNDS.index("up"), SCALE_ROUNDS.index("mx")
    two23 = np.float32(2.0**23)

    def round_scale(s, slot):
        s = float32(s)
        r = rule[slot]
        if r == mx:  # 2^(floor(log2 s) - emax), exact on the exponent field of the statistic s
            e = int32(f2u(s) >> uint32(23)) - emax[slot]
            if e < 1:
                return float32(least[slot])
            return u2f(uint32(e) << uint32(23))
        if s >= top[slot]:  # the dtype's largest value (F32: inf stays inf)
            return float32(top[slot])
        if s <= least[slot]:  # the smallest positive scale
            return float32(least[slot])
        if s < grid_below[slot]:  # the uniform grid below the smallest normal (exact)
            q = grid_quantum[slot]
            y = float32(s / q)
            if r == up:
                return float32(float32(math.ceil(y)) * q)
            return float32(float32(float32(y + two23) - two23) * q)  # nearest, ties to even (y < 2^22)
        b = f2u(s)
        if r == up:
            return u2f(uint32((b + add[slot]) & mask[slot]))  # up to the next representable, on the bits
        if add[slot] == 0:  # F32: the identity
            return s
        b = uint32((b + (add[slot] >> uint32(1)) + ((b >> shift[slot]) & uint32(1))) & mask[slot])  # ties to even
        return max(u2f(b), float32(least[slot]))

    return jit(round_scale)


CODE_RULES = ("div", "away", "offset", "midpoint")  # midpoint: LOOKUP only (no kernel backend runs LOOKUP)
"""Code rules by kernel id (docs/spec.md, code rules): the quantize rule's `x / e` (0), then the
reciprocal rules."""


def rule_codes(y: np.ndarray, rule: str, qmin: float, qmax: float) -> np.ndarray:
    """Integer codes (int8) of `y = f32(x * (1 / raw scale))` under code rule `rule`
    (docs/spec.md, code rules), whole arrays: `away` rounds half away from zero and clamps to
    [qmin, qmax]; `offset` is `clamp(trunc(f32(y + f32(c0 + 0.5))), 0, qmax - qmin) - c0` with
    `c0 = -qmin` (llama.cpp's `trunc(x * id + 8.5)` for Q4_0). NaN (never from finite input)
    codes as 0. `code_rule_kernel` is the same rule per element for the kernels."""
    y = np.nan_to_num(np.asarray(y, dtype=np.float32), nan=0.0)
    if rule == "away":
        a = np.abs(np.clip(y, np.float32(qmin), np.float32(qmax)))
        fl = np.floor(a)
        q = fl + (a - fl >= np.float32(0.5))  # a - floor(a) is exact: half away from zero, exactly
        return (np.copysign(q, y)).astype(np.int8)
    if rule == "offset":
        c0 = np.float32(-qmin)
        t = (y + np.float32(c0 + np.float32(0.5))).astype(np.float32)
        t = np.clip(t, np.float32(0), np.float32(qmax - qmin))
        return (np.trunc(t) - c0).astype(np.int8)
    raise ValueError(f"unknown integer code rule {rule!r}; use one of {CODE_RULES[1:3]}")


def code_rule_kernel(jit: Callable) -> Callable:
    """`rule_codes` as one scalar function for the kernels: `rule_code(y, rule, qmin, qmax)` ->
    the int64 code (signed) of f32 `y` under rule id `rule` (`CODE_RULES` position, 1 or 2).
    Every kernel backend compiles this one source with its own `jit`; the tests pin it against
    `rule_codes`."""
    import math

    from numba import float32, int64

    away = CODE_RULES.index("away")
    half = np.float32(0.5)

    def rule_code(y, rule, qmin, qmax):
        y = float32(y)
        if y != y:  # NaN
            return int64(0)
        if rule == away:
            a = abs(min(max(y, float32(qmin)), float32(qmax)))
            fl = float32(math.floor(a))
            q = int64(fl)
            if float32(a - fl) >= half:
                q += int64(1)
            return -q if y < float32(0.0) else q
        c0 = float32(-qmin)
        t = float32(y + float32(c0 + half))
        t = min(max(t, float32(0.0)), float32(qmax - qmin))
        return int64(t) - int64(c0)  # int64() truncates toward zero; t >= 0

    return jit(rule_code)
