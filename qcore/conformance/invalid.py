"""Conformance for SPEC v1.1 §3 invalid value codes.

Integer codes below `qmin` (Q8S -128, Q4S -8, Q2S -2) and E4M3/E5M2 NaN/Inf codes are not
values: quantize never writes them, and a payload that holds one must raise `InvalidDataError`
at `from_data` or, at the latest, at its first dequantize. `with_valid_codes` keeps random
payloads inside the value's set; `check_invalid_codes` plants one bad code and expects the error.
"""
from __future__ import annotations

import numpy as np

from .. import layout
from ..errors import InvalidDataError
from ..payload import QuantizedData
from ..scheme import QuantScheme

__all__ = ["with_valid_codes", "with_code", "check_invalid_codes"]


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


def check_invalid_codes(backend, case, reference=None) -> None:
    """A payload of `case` with one code outside the value's set (the last element) raises
    `InvalidDataError` at `from_data` or at the first dequantize, naming that element; schemes
    whose every code is valid (Q8F/Q4F/Q2F, E2M1, LOOKUP) have nothing to check."""
    from .checks import _ctx, random_payload

    s = case.qscheme
    invalid = np.flatnonzero(~s.valid_fields)
    if invalid.size == 0 or 0 in case.shape:
        return
    ctx = _ctx(backend, case)
    index = tuple(d - 1 for d in case.shape)
    bad = with_code(random_payload(case), index, int(invalid[-1]))
    try:
        q = backend.from_data(bad)
        np.asarray(backend.to_numpy(backend.dequantize(q)))
    except InvalidDataError as e:
        if str(index) not in str(e):
            raise ctx.fail("invalid-codes", f"InvalidDataError does not name element {index}: {e}") from e
        return
    except Exception as e:  # noqa: BLE001 - any other exception is a finding
        raise ctx.fail("invalid-codes", f"raised {type(e).__name__} ({e}), want InvalidDataError") from e
    raise ctx.fail("invalid-codes", f"code 0x{int(invalid[-1]):x} at element {index} decoded without "
                                    "InvalidDataError (SPEC v1.1 §3)")
