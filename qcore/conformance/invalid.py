"""Conformance for invalid value codes (docs/spec.md, invalid codes).

Integer codes below `qmin` (Q8S -128, Q4S -8, Q2S -2) and E4M3/E5M2 NaN/Inf codes are not
values: quantize never writes them, and a payload that holds one must raise `InvalidDataError`
at `from_data` or, at the latest, at its first dequantize. `with_valid_codes` keeps random
payloads inside the value's set; `with_code` plants one bad code, for the conformance check
`checks.check_invalid_codes` that expects the error.
"""
from __future__ import annotations

import numpy as np

from qcore.spec import layout
from qcore.spec.payload import QuantizedData
from qcore.spec.schemes import QuantScheme

__all__ = ["with_valid_codes", "with_code"]


def with_valid_codes(values: bytes, shape: tuple[int, ...], s: QuantScheme, rng: np.random.Generator) -> bytes:
    """`values` (the payload's values section) with every invalid field replaced by a random valid
    one; padding bits of packed words are kept as they were (they are not elements)."""
    valid = s.valid_fields
    if valid.all() or len(values) == 0:
        return values
    fields = layout.unpack(np.frombuffer(values, np.uint8), shape, s).view(np.uint8) & np.uint8(len(valid) - 1)
    bad = ~valid[fields]
    if not bad.any():
        return values
    fields = fields.copy()
    fields[bad] = rng.choice(np.flatnonzero(valid).astype(np.uint8), size=int(bad.sum()))
    clean = layout.pack(fields.view(s.code_dtype), s)
    used = layout.pack(np.full(shape, len(valid) - 1, np.uint8).view(s.code_dtype), s)
    orig = np.frombuffer(values, np.uint8)
    return (clean | (orig & ~used)).tobytes()


def with_code(d: QuantizedData, index: tuple[int, ...], field: int) -> QuantizedData:
    """`d` with element `index` holding stored field `field` (everything else unchanged)."""
    fields = d.codes().view(np.uint8).copy()
    fields[index] = field
    values = layout.pack(fields.view(d.scheme.code_dtype), d.scheme).tobytes()
    return QuantizedData(d.shape, d.scheme, values + d.payload[len(d.values_bytes()):])
