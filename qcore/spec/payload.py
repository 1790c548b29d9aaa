"""Portable bytes: `QuantizedData` = shape + scheme + payload (docs/spec.md, portable bytes).

Layout, little-endian, dense, no padding between sections:

    [values][scales: one per slot, row-major over the block grid][global f32][table f32 x 2**bits]

The payload length is fully determined by shape and scheme; anything else is `InvalidDataError`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np

from qcore.spec import layout
from qcore.errors import InputError, InvalidDataError, SchemeError
from qcore.spec.schemes import OffsetKind, QuantScheme, scheme as parse_scheme, _check_table

__all__ = ["QuantizedData", "Sections", "sections", "offset_nbytes", "offset_bytes"]


@dataclass(frozen=True)
class Sections:
    """Byte offsets of the payload's sections for one shape and scheme."""

    values: int
    scales: int
    global_: int
    table: int
    offsets: int = 0  # an affine scheme's per-slot offsets, last (docs/spec.md, affine offsets)

    @property
    def total(self) -> int:
        return self.values + self.scales + self.global_ + self.table + self.offsets


def sections(shape: Sequence[int], scheme: QuantScheme) -> Sections:
    """The size of each payload section (bytes) for `shape` and `scheme`."""
    return Sections(
        values=layout.values_nbytes(shape, scheme),
        scales=layout.scales_count(shape, scheme) * scheme.slot_dtype.traits.nbytes,
        global_=4 if scheme.two_level else 0,
        table=4 * (1 << scheme.bits) if scheme.is_lookup else 0,
        offsets=layout.scales_count(shape, scheme) * offset_nbytes(scheme),
    )


def offset_nbytes(scheme: QuantScheme) -> int:
    """Bytes of one stored offset (docs/spec.md, affine offsets): the MIN dtype's, 1 for a ZERO
    point, 0 when the scheme is not affine."""
    if scheme.offset is None:
        return 0
    return scheme.offset.dtype.traits.nbytes if scheme.offset.kind is OffsetKind.MIN else 1


def offset_bytes(offsets: np.ndarray, scheme: QuantScheme) -> bytes:
    """The offsets section of stored offsets (already representable): MIN words of its dtype,
    ZERO points one byte each."""
    o = np.asarray(offsets, dtype=np.float32).reshape(-1)
    if scheme.offset.kind is OffsetKind.MIN:
        return np.ascontiguousarray(scheme.offset.dtype.traits.encode(o)).tobytes()
    return o.astype(np.int16).astype(np.uint8 if scheme.traits.unsigned else np.int8).tobytes()


@dataclass(frozen=True, eq=True)
class QuantizedData:
    """A quantized tensor in the portable byte format; validated on construction.

    `scheme` may be given as text; for a LOOKUP scheme whose table travels in the payload
    (`q4s-lookup/...`), `.scheme` carries the table read from the payload.
    """

    shape: tuple[int, ...]
    scheme: QuantScheme
    payload: bytes = field(repr=False)

    def __post_init__(self) -> None:
        try:
            sch = parse_scheme(self.scheme)
        except SchemeError as e:
            raise InvalidDataError(f"payload scheme is not valid: {e}") from None
        try:
            shape = layout.check_shape(self.shape)
            sec = sections(shape, sch)
        except InputError as e:
            raise InvalidDataError(f"payload shape {self.shape!r} does not fit {sch}: {e}") from None
        payload = bytes(self.payload)
        if len(payload) != sec.total:
            raise InvalidDataError(
                f"payload of {sch} with shape {shape} must be {sec.total} bytes "
                f"(values {sec.values} + scales {sec.scales} + global {sec.global_} + table {sec.table}), "
                f"got {len(payload)}"
            )
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "payload", payload)
        object.__setattr__(self, "_sec", sec)
        if sch.is_lookup:
            tab = np.frombuffer(payload, dtype="<f4", count=1 << sch.bits, offset=sec.total - sec.table)
            try:
                checked = _check_table(tab, sch.bits)
            except SchemeError as e:
                raise InvalidDataError(f"payload table of {sch} is bad: {e}") from None
            if sch.table is not None and sch.table != checked:
                raise InvalidDataError(
                    f"payload table differs from the named table of {sch}; "
                    f"write the scheme as {sch.value}-lookup to carry a custom table"
                )
            sch = replace(sch, table=checked)
        object.__setattr__(self, "scheme", sch)
        scales = self.scales()
        bad = ~np.isfinite(scales) if sch.signed else ~np.isfinite(scales) | np.signbit(scales)
        if bad.any():
            i = int(np.flatnonzero(bad.reshape(-1))[0])
            raw = self._scale_words().reshape(-1)[i]
            raise InvalidDataError(
                f"scale slot {i} of {sch} is {scales.reshape(-1)[i]} (stored word 0x{int(raw):x}); "
                + ("signed scales must be finite" if sch.signed else "scales must be finite and >= 0")
            )
        g = self.global_scale()
        if g is not None and (not math.isfinite(g) or math.copysign(1.0, g) < 0):
            raise InvalidDataError(f"global scale of {sch} is {g}; it must be finite and >= 0")
        if sch.offset is not None:
            off = self.offsets()
            if sch.offset.kind is OffsetKind.MIN:
                bad = ~np.isfinite(off)
                why = "min offsets must be finite"
            else:
                bad = (off < sch.traits.qmin) | (off > sch.traits.qmax)
                why = f"zero points must lie in the value's range [{int(sch.traits.qmin)}, {int(sch.traits.qmax)}]"
            if bad.any():
                i = int(np.flatnonzero(bad.reshape(-1))[0])
                raise InvalidDataError(f"offset slot {i} of {sch} is {off.reshape(-1)[i]}; {why}")
        if g is not None and sch.reciprocal_global and not g > 0:
            raise InvalidDataError(f"reciprocal global scale of {sch} is {g}; it must be > 0 (e = s_b / G)")

    # ------------------------------------------------------------------ views
    @property
    def nbytes(self) -> int:
        return len(self.payload)

    @property
    def _offsets(self) -> tuple[int, int, int]:
        sec: Sections = self._sec  # type: ignore[attr-defined]
        return sec.values, sec.values + sec.scales, sec.values + sec.scales + sec.global_

    def values_bytes(self) -> bytes:
        return self.payload[: self._offsets[0]]

    def _scale_words(self) -> np.ndarray:
        a, b, _ = self._offsets
        tr = self.scheme.slot_dtype.traits
        return np.frombuffer(self.payload[a:b], dtype=tr.word_dtype)

    def codes(self) -> np.ndarray:
        """Unpacked codes in the tensor's shape: int8 for integers, uint8 for minifloat codes and
        LOOKUP indices."""
        return layout.unpack(np.frombuffer(self.values_bytes(), np.uint8), self.shape, self.scheme)

    def first_invalid_code(self) -> tuple[int, ...] | None:
        """Index of the first element whose stored field is outside the value's set (invalid
        codes: Q8S/Q4S/Q2S below qmin, E4M3/E5M2 NaN/Inf), row-major; None when all are valid.

        Padding bits of a packed word are not elements and are ignored.
        """
        valid = self.scheme.valid_fields
        if valid.all() or math.prod(self.shape) == 0:
            return None
        fields = self.codes().view(np.uint8) & np.uint8(len(valid) - 1)
        bad = ~valid[fields]
        if not bad.any():
            return None
        flat = int(np.argmax(bad.reshape(-1)))
        return tuple(int(i) for i in np.unravel_index(flat, self.shape))

    def check_codes(self) -> None:
        """Raise `InvalidDataError` naming the first invalid value code (see `first_invalid_code`);
        a payload found valid is not read again (it is immutable)."""
        if getattr(self, "_codes_valid", False):
            return
        idx = self.first_invalid_code()
        if idx is None:
            object.__setattr__(self, "_codes_valid", True)
            return
        field_ = int(self.codes()[idx].view(np.uint8)) & ((1 << self.scheme.bits) - 1)
        t = self.scheme.traits
        why = f"an integer below qmin {int(t.qmin)}" if not t.is_float else "a NaN/Inf code, not a value"
        raise InvalidDataError(
            f"element {idx} of {self.scheme} (shape {self.shape}) holds code 0x{field_:x}, {why}; "
            "quantize never writes it, so the payload is corrupt: re-create it from the float tensor"
        )

    def scales(self) -> np.ndarray:
        """Stored scales decoded to float32, in the block-grid shape (per-tensor: shape ())."""
        tr = self.scheme.slot_dtype.traits
        return tr.decode(self._scale_words()).astype(np.float32).reshape(layout.grid_shape(self.shape, self.scheme))

    def global_scale(self) -> float | None:
        """The two-level f32 global scale, or None."""
        if not self.scheme.two_level:
            return None
        _, b, _ = self._offsets
        return float(np.frombuffer(self.payload, "<f4", count=1, offset=b)[0])

    def offsets(self) -> np.ndarray | None:
        """An affine scheme's per-slot offsets (docs/spec.md, affine offsets) in the block-grid
        shape: MIN as float32, ZERO points as float32 integers; None for other schemes."""
        sch = self.scheme
        if sch.offset is None:
            return None
        sec: Sections = self._sec  # type: ignore[attr-defined]
        start = sec.total - sec.offsets
        grid = layout.grid_shape(self.shape, sch)
        if sch.offset.kind is OffsetKind.MIN:
            tr = sch.offset.dtype.traits
            words = np.frombuffer(self.payload, tr.word_dtype, offset=start)
            return tr.decode(words).astype(np.float32).reshape(grid)
        dt = np.uint8 if sch.traits.unsigned else np.int8
        return np.frombuffer(self.payload, dt, offset=start).astype(np.float32).reshape(grid)

    def table(self) -> np.ndarray | None:
        """The LOOKUP table as float32, or None."""
        if not self.scheme.is_lookup:
            return None
        return np.asarray(self.scheme.table, dtype=np.float32)

    def in_low_order(self) -> "QuantizedData":
        """The same tensor with its values in the byte layout's field order (docs/spec.md, field
        orders): the same codes, scales and decode; `self` when it is in that order already."""
        low = self.scheme.low_order
        if low is self.scheme:
            return self
        shape, src = layout.flat_form(self.shape, self.scheme)
        return QuantizedData(self.shape, low, layout.reorder_values(self.payload, shape, src, src.low_order))

    # ------------------------------------------------------------------ building
    @classmethod
    def from_parts(
        cls,
        shape: Sequence[int],
        scheme: QuantScheme,
        codes: np.ndarray,
        scales: np.ndarray,
        global_scale: float | None = None,
        offsets: np.ndarray | None = None,
    ) -> "QuantizedData":
        """Assemble the payload from unpacked codes, stored (already rounded) scales, the global
        and an affine scheme's stored offsets."""
        scheme = parse_scheme(scheme)
        tr = scheme.slot_dtype.traits
        parts = [
            layout.pack(np.asarray(codes, dtype=scheme.code_dtype).reshape(shape), scheme).tobytes(),
            np.ascontiguousarray(tr.encode(np.asarray(scales, dtype=np.float32).reshape(-1))).tobytes(),
        ]
        if scheme.two_level:
            parts.append(np.asarray([global_scale], dtype="<f4").tobytes())
        if scheme.is_lookup:
            parts.append(np.asarray(scheme.require_table(), dtype="<f4").tobytes())
        if scheme.offset is not None:
            parts.append(offset_bytes(np.asarray(offsets, dtype=np.float32), scheme))
        return cls(tuple(shape), scheme, b"".join(parts))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, QuantizedData):
            return NotImplemented
        return (self.shape, str(self.scheme), self.payload) == (other.shape, str(other.scheme), other.payload)

    def __hash__(self) -> int:
        return hash((self.shape, str(self.scheme), self.payload))

    def __repr__(self) -> str:
        return f"QuantizedData(shape={self.shape}, scheme='{self.scheme}', nbytes={self.nbytes})"
