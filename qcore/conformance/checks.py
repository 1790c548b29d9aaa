"""The conformance checks, as plain functions (no pytest needed).

Each `check_*` function takes the backend under test and a `Case` (see `cases.py`), compares the
backend with the `reference` backend, and raises `ConformanceFailure` (an `AssertionError`) on the
first disagreement. A failure message always names the backend, the check, the scheme text and
the shape, so the line alone tells what to rerun:

    backend 'ndarray' failed check 'quantize.codes' on q4s/block32:f16 shape (6, 40)
    [case q4s/block32:f16-6x40-normal-f32-0, input normal/f32 seed 123]: 1 of 240 differ;
    first at (0, 3): got 5 (0x05), want 4 (0x04)

`check_case` is the entry point that first asks `supports()`: a supported scheme must agree with
the reference bit for bit (`check_supported`); an unsupported one must be refused with
`UnsupportedSchemeError` at every entry point (`check_rejected`). Either way it returns an
`Outcome` whose status is PASSED, REJECTED (not supported, refused correctly: not a failure) or
FAILED.

What "agree" means (docs/spec.md, arithmetic and portable bytes): codes, stored scales, global
scale, payload bytes and dequantized floats are compared bit for bit (NaN = NaN only with the same
bits). Tensor ops are not fixed by the spec; they are compared with `Tolerances` (layout ops exact
by default, matmul within the f32 accumulation bound).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import ml_dtypes
import numpy as np

from qcore.spec import layout
from qcore.errors import InputError, InvalidDataError, QCoreError, UnsupportedSchemeError
from qcore.spec.arithmetic import round_offsets
from qcore.spec.payload import QuantizedData, offset_bytes, sections
from qcore.backend.protocol import QParams, QTensor
from qcore.spec.schemes import OffsetKind, QuantScheme, QuantValue, scheme as parse_scheme
from qcore.conformance.cases import Case, make_input, np_dtype
from qcore.conformance.inputs import grid_exponents
from qcore.conformance.invalid import with_code, with_valid_codes

__all__ = [
    "PASSED",
    "REJECTED",
    "FAILED",
    "Outcome",
    "ConformanceFailure",
    "Tolerances",
    "reference_backend",
    "check_supports",
    "check_case",
    "check_supported",
    "check_rejected",
    "check_bad_inputs",
    "check_payload_validation",
    "check_ops",
    "check_cross_backend",
    "check_views",
    "check_large",
    "check_decode_random",
    "random_payload",
    "compare_arrays",
    "compare_bytes",
    "compare_data",
    "assert_same_array",
    "assert_same_bytes",
    "assert_same_data",
]

PASSED = "passed"
REJECTED = "rejected"
FAILED = "failed"


class ConformanceFailure(AssertionError):
    """A backend disagreed with the spec or the reference. `.check` names the check,
    `.backend` the backend, `.scheme`/`.shape` the case."""

    def __init__(self, backend: str, check: str, where: str, detail: str,
                 scheme: str = "", shape: tuple[int, ...] | None = None):
        self.backend, self.check, self.detail = backend, check, detail
        self.scheme, self.shape = scheme, shape
        super().__init__(f"backend '{backend}' failed check '{check}' on {where}: {detail}")


@dataclass
class Outcome:
    """The result of one check on one case."""

    status: str  # PASSED, REJECTED or FAILED
    backend: str
    scheme: str
    check: str
    case: str = ""
    message: str = ""

    def __bool__(self) -> bool:
        return self.status != FAILED


@dataclass(frozen=True)
class Tolerances:
    """How closely tensor ops must match the reference (the spec fixes quantize/dequantize bit for
    bit, but not ops).

    `layout_atol`: max |difference| of dequantized floats after reshape/permute/slice/cat (default
    0: these ops only move codes and scales, or requantize with the same bit-exact kernels).
    `matmul_rel`: |got - want| <= matmul_rel * K * 2**-24 * (|x| @ |W|) elementwise, where W is the
    dequantized weight: the usual bound on reordering an f32 sum of K products, from both sides.
    """

    layout_atol: float = 0.0
    matmul_rel: float = 2.0


_REFERENCE = None


def reference_backend():
    """The `reference` backend (instantiated directly, so a broken registry cannot hide it)."""
    global _REFERENCE
    if _REFERENCE is None:
        from qcore.backend.reference import ReferenceBackend

        _REFERENCE = ReferenceBackend()
    return _REFERENCE


# --------------------------------------------------------------------------- context


@dataclass
class _Ctx:
    backend: Any
    case: Case | None = None
    scheme: QuantScheme | None = None
    shape: tuple[int, ...] | None = None

    @property
    def name(self) -> str:
        return str(getattr(self.backend, "name", type(self.backend).__name__))

    @property
    def scheme_text(self) -> str:
        if self.case is not None:
            return self.case.scheme
        return str(self.scheme) if self.scheme is not None else "?"

    def where(self) -> str:
        if self.case is not None:
            c = self.case
            return (f"{c.scheme} shape {c.shape} [case {c.id}, input {c.dist}/{c.dtype} "
                    f"seed {c.input_seed}]")
        return f"{self.scheme_text} shape {self.shape}"

    def fail(self, check: str, detail: str) -> ConformanceFailure:
        shape = self.case.shape if self.case is not None else self.shape
        return ConformanceFailure(self.name, check, self.where(), detail, self.scheme_text, shape)

    def call(self, check: str, fn: Callable[..., Any], *args, **kwargs) -> Any:
        """Run a backend call; any exception becomes a failure of `check`."""
        try:
            return fn(*args, **kwargs)
        except ConformanceFailure:
            raise
        except Exception as e:  # noqa: BLE001 - every exception is a finding here
            raise self.fail(check, f"raised {type(e).__name__}: {e}") from e


def _ctx(backend, case: Case) -> _Ctx:
    return _Ctx(backend, case, case.qscheme, case.shape)


# --------------------------------------------------------------------------- comparisons


def _fmt(v: Any) -> str:
    a = np.asarray(v)
    if a.dtype.kind == "f" or a.dtype.name == "bfloat16":
        bits = a.reshape(1).view(f"u{a.dtype.itemsize}")[0]
        return f"{float(a.astype(np.float64))!r} (0x{int(bits):0{2 * a.dtype.itemsize}x})"
    if a.dtype.kind in "iu":
        return f"{int(a)} (0x{int(a.astype(np.int64)) & ((1 << (8 * a.dtype.itemsize)) - 1):0{2 * a.dtype.itemsize}x})"
    return repr(v)


def compare_arrays(ctx: _Ctx, check: str, got: Any, want: np.ndarray, what: str = "values",
                   shape_alias: Iterable[tuple[int, ...]] = (), nan_equal: bool = False) -> None:
    """Bit-for-bit equality of two arrays (shape, dtype, every bit). Raises a failure with the
    mismatch count, the first index and both values. `nan_equal`: any NaN matches any NaN (NaN
    payloads are not specified once a NaN code is multiplied by a scale)."""
    try:
        g = np.asarray(got)
    except Exception as e:  # noqa: BLE001
        raise ctx.fail(check, f"{what}: result is not an array ({type(got).__name__}: {e})") from e
    w = np.asarray(want)
    if g.shape != w.shape and not (g.shape in shape_alias and w.size == g.size):
        raise ctx.fail(check, f"{what}: shape {g.shape}, want {w.shape}")
    g = g.reshape(w.shape)
    if g.dtype != w.dtype:
        raise ctx.fail(check, f"{what}: dtype {g.dtype}, want {w.dtype}")
    if w.size == 0:
        return
    gb = np.ascontiguousarray(g).view(f"u{w.dtype.itemsize}")
    wb = np.ascontiguousarray(w).view(f"u{w.dtype.itemsize}")
    bad = gb != wb
    if nan_equal and (w.dtype.kind == "f" or w.dtype.name == "bfloat16"):
        bad &= ~(np.isnan(g.astype(np.float32)) & np.isnan(w.astype(np.float32)))
    if bad.any():
        n = int(bad.sum())
        first = np.unravel_index(int(np.flatnonzero(bad.reshape(-1))[0]), w.shape)
        first = tuple(int(i) for i in first)
        raise ctx.fail(
            check,
            f"{n} of {w.size} {what} differ; first at {first}: got {_fmt(g[first])}, want {_fmt(w[first])}",
        )


def _section_of(offset: int, sec) -> str:
    bounds = (("values", sec.values), ("scales", sec.scales), ("global", sec.global_), ("table", sec.table))
    start = 0
    for name, size in bounds:
        if offset < start + size:
            return f"{name} section byte {offset - start}"
        start += size
    return "past the end"


def compare_bytes(ctx: _Ctx, check: str, got: bytes, want: bytes, shape, scheme: QuantScheme) -> None:
    """Payload bytes equal; on a mismatch, the count, the first offset and its section, in hex."""
    got, want = bytes(got), bytes(want)
    sec = sections(shape, scheme)
    if len(got) != len(want):
        raise ctx.fail(check, f"payload is {len(got)} bytes, want {len(want)}")
    if got != want:
        g = np.frombuffer(got, np.uint8)
        w = np.frombuffer(want, np.uint8)
        bad = np.flatnonzero(g != w)
        i = int(bad[0])
        raise ctx.fail(
            check,
            f"{bad.size} of {len(want)} payload bytes differ; first at offset {i} "
            f"({_section_of(i, sec)}): got 0x{g[i]:02x}, want 0x{w[i]:02x}; "
            f"got {got[i:i + 8].hex(' ')} want {want[i:i + 8].hex(' ')}",
        )


def compare_data(ctx: _Ctx, check: str, got: Any, want: QuantizedData) -> None:
    """Two `QuantizedData`: shape, scheme, then codes, scales, global, table (readable
    messages), then every payload byte (catches padding bits)."""
    if not isinstance(got, QuantizedData):
        raise ctx.fail(check, f"into_data returned {type(got).__name__}, want QuantizedData")
    if tuple(got.shape) != tuple(want.shape):
        raise ctx.fail(check, f"data shape {got.shape}, want {want.shape}")
    if got.scheme != want.scheme:
        raise ctx.fail(check, f"data scheme {got.scheme}, want {want.scheme}")
    compare_arrays(ctx, check + ".codes", got.codes(), want.codes(), "codes")
    compare_arrays(ctx, check + ".scales", got.scales(), want.scales(), "scales")
    gg, wg = got.global_scale(), want.global_scale()
    if (gg is None) != (wg is None) or (wg is not None and np.float32(gg).tobytes() != np.float32(wg).tobytes()):
        raise ctx.fail(check + ".global", f"global scale {gg!r}, want {wg!r}")
    compare_bytes(ctx, check + ".payload", got.payload, want.payload, want.shape, want.scheme)


def assert_same_array(got: Any, want: Any, what: str = "values", *, backend: str = "?",
                      check: str = "compare", nan_equal: bool = False) -> None:
    """For plugin authors' own tests: `got` equals `want` bit for bit (shape, dtype, every bit).
    Raises `ConformanceFailure` naming the mismatch count and the first differing element
    (index, got, want, in hex)."""
    compare_arrays(_Ctx(_Named(backend)), check, got, np.asarray(want), what, nan_equal=nan_equal)


def assert_same_bytes(got: bytes, want: bytes, shape: tuple[int, ...], scheme: QuantScheme | str, *,
                      backend: str = "?", check: str = "payload") -> None:
    """For plugin authors' own tests: two payloads of `scheme` on `shape` are the same bytes.
    Raises `ConformanceFailure` with the first differing byte offset, its section (values /
    scales / global / table) and the bytes around it, in hex."""
    s = parse_scheme(scheme)
    compare_bytes(_Ctx(_Named(backend), None, s, tuple(shape)), check, got, want, tuple(shape), s)


def assert_same_data(got: Any, want: QuantizedData, *, backend: str = "?", check: str = "data") -> None:
    """For plugin authors' own tests: two `QuantizedData` agree (shape, scheme, codes, scales,
    global, then every payload byte, padding bits included), reported as the suite does."""
    compare_data(_Ctx(_Named(backend), None, want.scheme, tuple(want.shape)), check, got, want)


@dataclass(frozen=True)
class _Named:
    name: str


def compare_params(ctx: _Ctx, check: str, got: Any, want: QParams) -> None:
    if not isinstance(got, QParams):
        raise ctx.fail(check, f"returned {type(got).__name__}, want QParams")
    alias = [(), (1,)] if np.asarray(want.scales).shape in ((), (1,)) else []
    compare_arrays(ctx, check + ".scales", np.asarray(got.scales), np.asarray(want.scales, np.float32),
                   "scales", shape_alias=alias)
    gg, wg = got.global_scale, want.global_scale
    if (gg is None) != (wg is None) or (wg is not None and np.float32(gg).tobytes() != np.float32(wg).tobytes()):
        raise ctx.fail(check + ".global", f"global scale {gg!r}, want {wg!r}")


def _host(ctx: _Ctx, check: str, be, y) -> np.ndarray:
    return ctx.call(check + " (to_numpy)", lambda: np.asarray(be.to_numpy(y)))


def _untouched(ctx: _Ctx, check: str, x: np.ndarray, before: bytes) -> None:
    if x.tobytes() != before:
        raise ctx.fail(check, "the call modified its input array in place")


# --------------------------------------------------------------------------- helpers


def explicit_params(case: Case, calibrated: QParams) -> QParams:
    """Explicit user parameters for a case: the calibrated scales times factors in
    {0, 0.37, 1, 2.9} (zero scales, clipping, headroom), nudged off the storable grid so they must
    be rounded up; a two-level global times 1.3."""
    rng = np.random.default_rng(case.input_seed ^ 0x5EED)
    s = np.asarray(calibrated.scales, np.float64)
    mult = rng.choice([0.0, 0.37, 1.0, 2.9], size=s.shape)
    raw = np.where(s > 0, s * mult * 1.0001, rng.uniform(0.01, 2.0, size=s.shape) * (mult > 0))
    raw = np.minimum(raw, 1e37).astype(np.float32)
    g = None
    if calibrated.global_scale is not None:
        g = float(np.float32(min(calibrated.global_scale * 1.3, 1e37)))
    return QParams(raw, g, _explicit_offsets(case, calibrated, rng))


def _explicit_offsets(case: Case, calibrated: QParams, rng) -> np.ndarray | None:
    """An affine scheme's explicit offsets (docs/spec.md, affine offsets): the calibrated MIN
    offsets nudged off their dtype's grid (so they must be rounded), or random zero points over the
    value's range."""
    s = case.qscheme
    if not s.affine:
        return None
    o = np.asarray(calibrated.offsets, np.float64)
    if s.offset.kind is OffsetKind.MIN:
        return (o * rng.choice([0.0, 1.0001, -0.5], size=o.shape) + rng.uniform(-1e-3, 1e-3, o.shape)).astype(np.float32)
    return rng.integers(int(s.traits.qmin), int(s.traits.qmax) + 1, size=o.shape).astype(np.float32)


def check_supports(backend, s: QuantScheme) -> Any:
    """`supports()` answers with a Support-like value: same answer for text and scheme, and a
    non-empty `.reason` when it says no. Returns the answer."""
    ctx = _Ctx(backend, None, s, None)
    ans = ctx.call("supports", backend.supports, s)
    ok = ctx.call("supports", bool, ans)
    if not ok:
        reason = getattr(ans, "reason", "")
        if not isinstance(reason, str) or not reason.strip():
            raise ctx.fail("supports", f"said no without a reason ({ans!r}); give Support.no('why')")
    if s.table is None or s.table_name is not None:  # custom tables do not survive the text form
        again = ctx.call("supports", backend.supports, str(s))
        if bool(again) != ok:
            raise ctx.fail("supports", f"supports({str(s)!r}) is {bool(again)} but supports(scheme) is {ok}")
    return ans


# --------------------------------------------------------------------------- the checks


def check_supported(backend, case: Case, reference=None) -> None:
    """A supported scheme: calibrate, quantize (calibrated and explicit params), dequantize,
    into_data and from_data agree with the reference bit for bit; from_data of the reference
    payload decodes identically; repeated runs are deterministic; inputs stay untouched."""
    ref = reference or reference_backend()
    ctx = _ctx(backend, case)
    s = case.qscheme
    x = case.input()
    before = x.tobytes()
    out_dt = np_dtype(case.out_dtype)

    r_params = ref.calibrate(x, s)
    r_q = ref.quantize(x, s)
    r_data = ref.into_data(r_q)
    r_y = np.asarray(ref.dequantize(r_q, dtype=out_dt))

    p = ctx.call("calibrate", backend.calibrate, x, s)
    compare_params(ctx, "calibrate", p, r_params)
    _untouched(ctx, "calibrate", x, before)

    q = ctx.call("quantize", backend.quantize, x, s)
    _untouched(ctx, "quantize", x, before)
    if not isinstance(q, QTensor):
        raise ctx.fail("quantize", f"returned {type(q).__name__}, want a qcore.QTensor")
    if tuple(q.shape) != case.shape or q.scheme != s:
        raise ctx.fail("quantize", f"QTensor has shape {q.shape} and scheme {q.scheme}")
    d = ctx.call("into_data", backend.into_data, q)
    compare_data(ctx, "quantize", d, r_data)
    parts = ctx.call("payload_parts", backend.payload_parts, q)  # the unjoined payload whole-model writes stream
    joined = b"".join(np.ascontiguousarray(p).reshape(-1).view(np.uint8).tobytes() for p in parts)
    if joined != d.payload:
        raise ctx.fail("payload_parts", f"the parts joined ({len(joined)} bytes) are not into_data's payload "
                                        f"({len(d.payload)} bytes)")

    y = _host(ctx, "dequantize", backend, ctx.call("dequantize", backend.dequantize, q, dtype=out_dt))
    compare_arrays(ctx, f"dequantize({case.out_dtype})", y, r_y, "dequantized values")
    if case.out_dtype != "f32":
        y32 = _host(ctx, "dequantize", backend, ctx.call("dequantize", backend.dequantize, q))
        compare_arrays(ctx, "dequantize(f32 default)", y32, np.asarray(ref.dequantize(r_q)), "dequantized values")

    # explicit params: the reference's own calibration, then off-grid values that need rounding
    # (under a code rule, given scales are their own raw scales: other codes)
    r_pc = ref.into_data(ref.quantize(x, s, params=r_params)) if s.reciprocal_codes else r_data
    qp = ctx.call("quantize(params)", backend.quantize, x, s, params=r_params)
    compare_data(ctx, "quantize(params=calibrated)", ctx.call("into_data", backend.into_data, qp), r_pc)
    ep = explicit_params(case, r_params)
    ep_before = np.asarray(ep.scales).tobytes()
    r_e = ref.into_data(ref.quantize(x, s, params=ep))
    qe = ctx.call("quantize(params)", backend.quantize, x, s, params=ep)
    compare_data(ctx, "quantize(params=explicit)", ctx.call("into_data", backend.into_data, qe), r_e)
    if np.asarray(ep.scales).tobytes() != ep_before:
        raise ctx.fail("quantize(params=explicit)", "the call modified params.scales in place")
    _untouched(ctx, "quantize(params)", x, before)
    if case.dist == "grid" and x.size:
        # every effective scale 2**j: exact ties at every decision point, two-level included
        js = grid_exponents(case.shape, s, case.input_seed)
        pp = QParams(np.ldexp(np.ones(js.shape), js).astype(np.float32), 1.0 if s.two_level else None,
                     np.zeros(js.shape, np.float32) if s.affine else None)
        qq = ctx.call("quantize(params=powers of two)", backend.quantize, x, s, params=pp)
        compare_data(ctx, "quantize(params=powers of two)", ctx.call("into_data", backend.into_data, qq),
                     ref.into_data(ref.quantize(x, s, params=pp)))

    # from_data of the reference payload decodes identically and round-trips to the same bytes
    q2 = ctx.call("from_data", backend.from_data, r_data)
    compare_data(ctx, "from_data->into_data", ctx.call("into_data", backend.into_data, q2), r_data)
    y2 = _host(ctx, "from_data->dequantize", backend,
               ctx.call("from_data->dequantize", backend.dequantize, q2, dtype=out_dt))
    compare_arrays(ctx, "from_data->dequantize", y2, r_y, "dequantized values")

    # the other built-in calibration method (docs/spec.md, calibration: absmean, f64 sum, one f32
    # rounding); signed scales and affine offsets take minmax only and refuse it (docs/spec.md)
    if s.signed or s.affine:
        _expect(ctx, "bad-input.absmean.calibrate", InputError,
                lambda: backend.calibrate(x, s, method="absmean"), x)
        _expect(ctx, "bad-input.absmean.quantize", InputError, lambda: backend.quantize(x, s, method="absmean"), x)
    else:
        pa = ctx.call("calibrate(absmean)", backend.calibrate, x, s, method="absmean")
        compare_params(ctx, "calibrate(absmean)", pa, ref.calibrate(x, s, method="absmean"))
        qa = ctx.call("quantize(absmean)", backend.quantize, x, s, method="absmean")
        compare_data(ctx, "quantize(absmean)", ctx.call("into_data", backend.into_data, qa),
                     ref.into_data(ref.quantize(x, s, method="absmean")))

    check_decode_random(backend, case, ref)
    check_invalid_codes(backend, case, ref)

    # non-finite input is refused here too (the full list is in check_bad_inputs)
    if x.size:
        nan = x.copy()
        nan.reshape(-1)[x.size // 2] = np.nan
        _expect(ctx, "bad-input.NaN.quantize", InputError, lambda: backend.quantize(nan, s), nan)
        inf = x.copy()
        inf.reshape(-1)[-1] = np.inf
        _expect(ctx, "bad-input.+Inf.calibrate", InputError, lambda: backend.calibrate(inf, s), inf)

    # determinism: the same call twice gives the same bits
    q3 = ctx.call("quantize", backend.quantize, x, s)
    compare_data(ctx, "deterministic.quantize", ctx.call("into_data", backend.into_data, q3), d)
    y3 = _host(ctx, "dequantize", backend, ctx.call("dequantize", backend.dequantize, q, dtype=out_dt))
    compare_arrays(ctx, "deterministic.dequantize", y3, y, "dequantized values")
    _untouched(ctx, "inputs-untouched", x, before)


def check_invalid_codes(backend, case, reference=None) -> None:
    """A payload of `case` with one code outside the value's set (the last element) raises
    `InvalidDataError` at `from_data` or at the first dequantize, naming that element; schemes
    whose every code is valid (Q8F/Q4F/Q2F, E2M1, LOOKUP) have nothing to check."""
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
                                    "InvalidDataError (docs/spec.md, invalid codes)")


def random_payload(case: Case) -> QuantizedData:
    """A valid payload with random contents (as gguf-py's decode fuzz): every valid code pattern,
    including negative zero and set padding bits (invalid codes: no code outside the value's set,
    see `invalid.with_valid_codes`); random storable scales (zeros included; either sign for signed
    scales) and global; the scheme's table."""
    s = case.qscheme
    sec = sections(case.shape, s)
    rng = np.random.default_rng(case.input_seed ^ 0xF022)
    values = rng.integers(0, 256, size=sec.values, dtype=np.uint8).tobytes()
    values = with_valid_codes(values, case.shape, s, rng)
    grid = layout.grid_shape(case.shape, s)
    raw = np.exp2(rng.uniform(-20, 8, size=grid)) * (rng.random(size=grid) > 0.1)
    tr = s.slot_dtype.traits
    stored = tr.store(raw.astype(np.float32)).reshape(-1)
    if s.signed:  # either sign, -0 included (docs/spec.md, signed scales)
        stored = np.copysign(stored, rng.random(stored.shape) - 0.5).astype(np.float32)
    scales = np.ascontiguousarray(tr.encode(stored)).tobytes()
    parts = [values, scales]
    if s.two_level:
        parts.append(np.array([rng.uniform(1e-3, 4.0)], "<f4").tobytes())
    if s.is_lookup:
        parts.append(np.asarray(s.require_table(), "<f4").tobytes())
    if s.affine:  # MIN offsets of either sign and every binade; ZERO points over the value's range
        if s.offset.kind is OffsetKind.MIN:
            off = (np.exp2(rng.uniform(-20, 8, size=grid)) * rng.choice([-1.0, 0.0, 1.0], size=grid)).astype(np.float32)
            off = round_offsets(off, s)
        else:
            off = rng.integers(int(s.traits.qmin), int(s.traits.qmax) + 1, size=grid).astype(np.float32)
        parts.append(offset_bytes(off, s))
    return QuantizedData(case.shape, s, b"".join(parts))


def check_decode_random(backend, case: Case, reference=None) -> None:
    """`from_data` of random (valid) bytes decodes like the reference: the same codes, scales
    and global back from `into_data` (padding bits are ignored on reading), and the same
    dequantized floats (any NaN matches any NaN)."""
    ref = reference or reference_backend()
    ctx = _ctx(backend, case)
    d = random_payload(case)
    q = ctx.call("decode-random.from_data", backend.from_data, d)
    back = ctx.call("decode-random.into_data", backend.into_data, q)
    if not isinstance(back, QuantizedData):
        raise ctx.fail("decode-random.into_data", f"returned {type(back).__name__}, want QuantizedData")
    compare_arrays(ctx, "decode-random.codes", back.codes(), d.codes(), "codes")
    compare_arrays(ctx, "decode-random.scales", back.scales(), d.scales(), "scales")
    if back.global_scale() != d.global_scale():
        raise ctx.fail("decode-random.global", f"global scale {back.global_scale()!r}, want {d.global_scale()!r}")
    with np.errstate(invalid="ignore", over="ignore"):
        want = np.asarray(ref.dequantize(ref.from_data(d)))
        y = _host(ctx, "decode-random.dequantize", backend,
                  ctx.call("decode-random.dequantize", backend.dequantize, q))
    compare_arrays(ctx, "decode-random.dequantize", y, want, "dequantized values", nan_equal=True)


def _expect(ctx: _Ctx, check: str, exc: type, fn: Callable[[], Any], *watch: np.ndarray,
            must_name: Sequence[str] = ()) -> None:
    """`fn()` must raise `exc` (a qcore error type; docs/spec.md, errors) and no other exception,
    and leave the arrays in `watch` untouched."""
    snaps = [w.tobytes() for w in watch]
    try:
        fn()
    except exc as e:
        msg = str(e)
        for name in must_name:
            if name not in msg:
                raise ctx.fail(check, f"{exc.__name__} message does not name {name!r}: {msg!r}") from e
    except Exception as e:  # noqa: BLE001
        raise ctx.fail(check, f"raised {type(e).__name__} ({e}), want {exc.__name__}") from e
    else:
        raise ctx.fail(check, f"returned normally, want {exc.__name__}")
    for w, b in zip(watch, snaps):
        if w.tobytes() != b:
            raise ctx.fail(check, "modified its input array in place before raising")


def check_rejected(backend, case: Case, reference=None) -> None:
    """An unsupported scheme: every entry point raises `UnsupportedSchemeError` naming the
    backend and the scheme, before touching data (even NaN input), and leaves inputs untouched."""
    ref = reference or reference_backend()
    ctx = _ctx(backend, case)
    s = case.qscheme
    x = case.input()
    r_params = ref.calibrate(x, s)
    r_q = ref.quantize(x, s)
    r_data = ref.into_data(r_q)
    r_before = r_data.payload
    bad = x.astype(np.float32)
    if bad.size:
        bad.reshape(-1)[0] = np.nan
    # A tensor that claims to live on this backend (its data is the reference's; a conforming
    # backend refuses on the scheme before looking at it).
    own = QTensor(backend, s, case.shape, r_data)
    names = [ctx.name, str(s)]
    U = UnsupportedSchemeError
    entries: list[tuple[str, Callable[[], Any]]] = [
        ("calibrate", lambda: backend.calibrate(x, s)),
        ("quantize", lambda: backend.quantize(x, s)),
        ("quantize(params)", lambda: backend.quantize(x, s, params=r_params)),
        ("quantize(NaN input)", lambda: backend.quantize(bad, s)),
        ("from_data", lambda: backend.from_data(r_data)),
        ("dequantize", lambda: backend.dequantize(own)),
        ("into_data", lambda: backend.into_data(own)),
    ]
    if s.table is None or s.table_name is not None:
        entries.append(("quantize(text scheme)", lambda: backend.quantize(x, str(s))))
    entries += [("reshape", lambda: backend.reshape(own, (-1,) + case.shape[1:])),
                ("permute", lambda: backend.permute(own, tuple(range(len(case.shape)))[::-1])),
                ("slice", lambda: backend.slice(own, (slice(0, 1),))),
                ("cat", lambda: backend.cat([own, own], 0)),
                ("matmul", lambda: backend.matmul(np.ones((1, case.shape[0]), np.float32), own))]
    for name, fn in entries:
        _expect(ctx, f"rejects.{name}", U, fn, x, bad, r_params.scales, must_name=names)
    if r_data.payload != r_before:
        raise ctx.fail("rejects.from_data", "modified the payload it was given")


def check_case(backend, case: Case, reference=None) -> Outcome:
    """Ask `supports()`, then run `check_supported` or `check_rejected`; return an `Outcome`."""
    ctx = _ctx(backend, case)
    try:
        ok = bool(check_supports(backend, case.qscheme))
        if ok:
            check_supported(backend, case, reference)
            return Outcome(PASSED, ctx.name, case.scheme, "supported", case.id)
        check_rejected(backend, case, reference)
        return Outcome(REJECTED, ctx.name, case.scheme, "rejected", case.id)
    except ConformanceFailure as f:
        return Outcome(FAILED, ctx.name, case.scheme, f.check, case.id, str(f))


# --------------------------------------------------------------------------- bad input


def _nan_pattern(dtype_name: str, what: str) -> bytes:
    """Bytes of one stored scale that payload validation must refuse (docs/spec.md, portable bytes)."""
    table = {
        ("f32", "nan"): np.array([0x7FC00000], "<u4"), ("f32", "inf"): np.array([0x7F800000], "<u4"),
        ("f32", "negative"): np.array([0xBF800000], "<u4"),
        ("f16", "nan"): np.array([0x7E00], "<u2"), ("f16", "inf"): np.array([0x7C00], "<u2"),
        ("f16", "negative"): np.array([0xBC00], "<u2"),
        ("bf16", "nan"): np.array([0x7FC0], "<u2"), ("bf16", "inf"): np.array([0x7F80], "<u2"),
        ("bf16", "negative"): np.array([0xBF80], "<u2"),
        ("ue4m3", "nan"): np.array([0x7F], "<u1"), ("ue4m3", "negative"): np.array([0xB8], "<u1"),
        ("ue8m0", "nan"): np.array([0xFF], "<u1"),  # UE8M0 byte 255
    }
    arr = table.get((dtype_name, what))
    return b"" if arr is None else arr.tobytes()


def corrupt_payloads(d: QuantizedData) -> list[tuple[str, bytes]]:
    """Payloads that must be refused with `InvalidDataError`: truncated, extended, a NaN / inf /
    negative scale (UE8M0: byte 255), a NaN or negative global, a table out of order or with NaN."""
    p = d.payload
    s = d.scheme
    sec = sections(d.shape, s)
    out: list[tuple[str, bytes]] = []
    if p:
        out.append(("truncated by 1 byte", p[:-1]))
    out.append(("extended by 1 byte", p + b"\x00"))
    out.append(("extended by 4 bytes", p + b"\x00" * 4))
    if sec.scales:
        off = sec.values
        for what in ("nan", "inf", "negative"):
            pat = _nan_pattern(s.slot_dtype.value, what)
            if pat:
                label = "UE8M0 scale byte 255" if s.slot_dtype.value == "ue8m0" else f"{what} scale"
                out.append((label, p[:off] + pat + p[off + len(pat):]))
    if sec.global_:
        off = sec.values + sec.scales
        for what, val in (("NaN global scale", np.nan), ("negative global scale", -1.0),
                          ("inf global scale", np.inf)):
            out.append((what, p[:off] + np.array([val], "<f4").tobytes() + p[off + 4:]))
    if sec.table:
        off = sec.total - sec.table
        tab = np.frombuffer(p, "<f4", count=sec.table // 4, offset=off).copy()
        rev = tab[::-1].copy()
        out.append(("table out of order", p[:off] + rev.tobytes()))
        tab2 = tab.copy()
        tab2[1] = np.nan
        out.append(("table with NaN", p[:off] + tab2.tobytes()))
    return out


def check_payload_validation(backend, case: Case, reference=None) -> None:
    """Loading corrupted portable bytes raises `InvalidDataError` (docs/spec.md, portable bytes),
    never another error. (The payload is corrupted from the backend's own output; loading =
    building the `QuantizedData` and calling `from_data`.)"""
    ctx = _ctx(backend, case)
    s = case.qscheme
    x = case.input()
    d = ctx.call("into_data", backend.into_data, ctx.call("quantize", backend.quantize, x, s))
    text = parse_scheme(str(s))  # a custom table then travels in the payload
    for label, raw in corrupt_payloads(d):
        _expect(ctx, f"bad-payload.{label}", InvalidDataError,
                lambda: backend.from_data(QuantizedData(d.shape, text, raw)))


def check_bad_inputs(backend, case: Case, reference=None) -> None:
    """Bad input raises the spec's error type (docs/spec.md, errors) and nothing else, leaving
    inputs untouched: NaN/±Inf (and f64 values that overflow f32), wrong dtypes, scalars, packing
    axis >= rank, block rank > tensor rank, bad explicit params, bad output dtype / method; and bad
    payloads (`check_payload_validation`)."""
    ref = reference or reference_backend()
    ctx = _ctx(backend, case)
    s = case.qscheme
    x = case.input()
    I = InputError
    r_params = ref.calibrate(x, s)
    if x.size:
        for label, val in (("NaN", np.nan), ("+Inf", np.inf), ("-Inf", -np.inf)):
            bad = x.copy()
            bad.reshape(-1)[x.size // 2] = val
            _expect(ctx, f"bad-input.{label}.quantize", I, lambda: backend.quantize(bad, s), bad)
            _expect(ctx, f"bad-input.{label}.calibrate", I, lambda: backend.calibrate(bad, s), bad)
            _expect(ctx, f"bad-input.{label}.quantize(params)", I,
                    lambda: backend.quantize(bad, s, params=r_params), bad)
        big = x.astype(np.float64)
        big.reshape(-1)[-1] = 1e300  # finite in f64, inf once converted to f32
        with np.errstate(over="ignore"):  # the f64 -> f32 cast may warn before InputError
            _expect(ctx, "bad-input.f64-overflows-f32", I, lambda: backend.quantize(big, s), big)
    for dt in (np.int32, np.int8, np.uint8, np.bool_, np.complex64):
        wrong = np.zeros(case.shape, dtype=dt)
        _expect(ctx, f"bad-input.dtype-{np.dtype(dt).name}.quantize", I, lambda: backend.quantize(wrong, s), wrong)
        _expect(ctx, f"bad-input.dtype-{np.dtype(dt).name}.calibrate", I, lambda: backend.calibrate(wrong, s), wrong)
    _expect(ctx, "bad-input.scalar", I, lambda: backend.quantize(np.float32(1.0), s))
    _expect(ctx, "bad-input.rank-0-array", I, lambda: backend.quantize(np.array(1.0, np.float32), s))
    # rank too small for the packing axis / the block
    if s.store.dim >= 1:
        short = np.ones((3,) * s.store.dim, np.float32)
        _expect(ctx, "bad-input.packing-axis>=rank", I, lambda: backend.quantize(short, s), short)
    if s.block is not None and len(s.block.dims) >= 2:
        short = np.ones((3,) * (len(s.block.dims) - 1), np.float32)
        _expect(ctx, "bad-input.block-rank>tensor-rank", I, lambda: backend.quantize(short, s), short)
    # bad explicit params
    grid = layout.grid_shape(case.shape, s)
    sc = np.asarray(r_params.scales, np.float32).reshape(grid)
    g = r_params.global_scale
    bad_params = []
    if sc.size:
        for label, val in (("NaN", np.nan), ("negative", -1.0), ("inf", np.inf)):
            b = sc.copy()
            b.reshape(-1)[0] = val
            bad_params.append((f"{label} scale", QParams(b, g)))
    bad_params.append(("wrong shape", QParams(np.ones(tuple(grid) + (2,), np.float32), g)))
    if s.two_level:
        bad_params += [("missing global", QParams(sc, None)), ("NaN global", QParams(sc, float("nan"))),
                       ("negative global", QParams(sc, -1.0))]
    else:
        bad_params.append(("unexpected global", QParams(sc, 1.0)))
    for label, bp in bad_params:
        _expect(ctx, f"bad-params.{label}", I, lambda: backend.quantize(x, s, params=bp), x)
    q = ctx.call("quantize", backend.quantize, x, s)
    for dt in (np.int32, np.uint8, np.complex64):
        _expect(ctx, f"bad-input.dequantize-dtype-{np.dtype(dt).name}", I, lambda: backend.dequantize(q, dtype=dt))
    _expect(ctx, "bad-input.method", I, lambda: backend.calibrate(x, s, method="percentile"), x)
    check_payload_validation(backend, case, ref)


# --------------------------------------------------------------------------- input kinds


def input_views(x: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """Views holding `x`'s values whose memory order is not C order: Fortran order (transposed
    in memory), steps along the first and the last axis of a bigger array, negative strides
    (every axis reversed), and a transposed view of `x`'s transpose."""
    out: list[tuple[str, np.ndarray]] = []
    if x.ndim >= 2:
        out.append(("fortran", np.asfortranarray(x)))
        out.append(("transposed", np.ascontiguousarray(np.swapaxes(x, 0, -1)).swapaxes(0, -1)))
    big = np.zeros((2 * x.shape[0],) + x.shape[1:], x.dtype)
    big[::2] = x
    big[1::2] = x[::-1] if x.shape[0] else x
    out.append(("step-axis0", big[::2]))
    wide = np.zeros(x.shape[:-1] + (3 * x.shape[-1],), x.dtype)
    wide[..., ::3] = x
    wide[..., 1::3] = -x
    out.append(("step-last-axis", wide[..., ::3]))
    rev = (slice(None, None, -1),) * x.ndim
    out.append(("negative-strides", np.ascontiguousarray(x[rev])[rev]))
    return out


def check_views(backend, case: Case, reference=None) -> None:
    """The case's input given as non-C-ordered views (`input_views`) quantizes (calibrated, and
    with explicit params) to the reference's quantize of the C-ordered array, leaving the view
    untouched; and the tensor dequantizes to every output dtype (f32, f16, bf16, f64) as the
    reference's does."""
    ref = reference or reference_backend()
    ctx = _ctx(backend, case)
    s = case.qscheme
    x = np.ascontiguousarray(case.input())
    r_q = ref.quantize(x, s)
    r_data = ref.into_data(r_q)
    r_params = ref.calibrate(x, s)
    for label, v in input_views(x):
        assert np.array_equal(np.ascontiguousarray(v), x)  # a view of the same values
        before = np.ascontiguousarray(v).tobytes()
        check = f"quantize(view {label})"
        p = ctx.call(f"calibrate(view {label})", backend.calibrate, v, s)
        compare_params(ctx, f"calibrate(view {label})", p, r_params)
        q = ctx.call(check, backend.quantize, v, s)
        compare_data(ctx, check, ctx.call(check, backend.into_data, q), r_data)
        qp = ctx.call(check, backend.quantize, v, s, params=r_params)
        compare_data(ctx, f"quantize(params, view {label})", ctx.call(check, backend.into_data, qp), r_data)
        if np.ascontiguousarray(v).tobytes() != before:
            raise ctx.fail(check, "the call modified its input view in place")
    q = ctx.call("quantize", backend.quantize, x, s)
    for dt in ("f32", "f16", "bf16", "f64"):
        out = np_dtype(dt)
        y = _host(ctx, f"dequantize({dt})", backend, ctx.call(f"dequantize({dt})", backend.dequantize, q, dtype=out))
        compare_arrays(ctx, f"dequantize({dt})", y, np.asarray(ref.dequantize(r_q, dtype=out)), "dequantized values")


def check_large(backend, case: Case, reference=None) -> None:
    """A tensor past 2**20 elements (grid, index and chunking bugs show only past some tens of
    thousands): calibrate, quantize (codes, scales, payload) and dequantize agree with the
    reference bit for bit."""
    ref = reference or reference_backend()
    ctx = _ctx(backend, case)
    s = case.qscheme
    x = case.input()
    r_q = ref.quantize(x, s)
    compare_params(ctx, "calibrate", ctx.call("calibrate", backend.calibrate, x, s), ref.calibrate(x, s))
    q = ctx.call("quantize", backend.quantize, x, s)
    compare_data(ctx, "quantize", ctx.call("into_data", backend.into_data, q), ref.into_data(r_q))
    out = np_dtype(case.out_dtype)
    y = _host(ctx, "dequantize", backend, ctx.call("dequantize", backend.dequantize, q, dtype=out))
    compare_arrays(ctx, f"dequantize({case.out_dtype})", y, np.asarray(ref.dequantize(r_q, dtype=out)),
                   "dequantized values")


# --------------------------------------------------------------------------- ops


def _result(fn):
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001
        return None, e


def _same_tensor(ctx: _Ctx, check: str, be, got: Any, ref, want: QTensor, tol: Tolerances) -> None:
    if not isinstance(got, QTensor):
        raise ctx.fail(check, f"returned {type(got).__name__}, want a QTensor")
    if tuple(got.shape) != tuple(want.shape) or got.scheme != want.scheme:
        raise ctx.fail(check, f"result has shape {got.shape} scheme {got.scheme}, "
                              f"want shape {want.shape} scheme {want.scheme}")
    y = _host(ctx, check, be, ctx.call(check + " (dequantize)", be.dequantize, got))
    w = np.asarray(ref.dequantize(want))
    if tol.layout_atol == 0:
        compare_arrays(ctx, check, y, w, "dequantized values")
        return
    if y.shape != w.shape:
        raise ctx.fail(check, f"dequantized shape {y.shape}, want {w.shape}")
    err = np.abs(y.astype(np.float64) - w)
    if err.size and not (err <= tol.layout_atol).all():
        i = np.unravel_index(int(np.argmax(err)), err.shape)
        raise ctx.fail(check, f"{int((err > tol.layout_atol).sum())} values off by more than "
                              f"{tol.layout_atol}; worst at {tuple(map(int, i))}: got {y[i]!r}, want {w[i]!r}")


def check_ops(backend, case: Case, reference=None, tolerances: Tolerances | None = None) -> None:
    """`reshape`, `permute`, `slice`, `cat` and `matmul` against the reference within
    `tolerances`; where the reference raises a qcore error, the backend raises the same type."""
    ref = reference or reference_backend()
    tol = tolerances or Tolerances()
    ctx = _ctx(backend, case)
    s = case.qscheme
    x = case.input()
    x2 = make_input(case.shape, "normal", "f32", case.input_seed + 1)
    q = ctx.call("quantize", backend.quantize, x, s)
    q2 = ctx.call("quantize", backend.quantize, x2, s)
    rq, rq2 = ref.quantize(x, s), ref.quantize(x2, s)
    shape = case.shape
    rank = len(shape)
    plans: list[tuple[str, Callable[[Any, Any, Any], Any]]] = [
        ("reshape(split)", lambda b, t, t2: b.reshape(t, (1,) + shape)),
        ("reshape(flat)", lambda b, t, t2: b.reshape(t, (-1,))),
        ("reshape(swap)", lambda b, t, t2: b.reshape(t, shape[::-1])),
        ("permute(reverse)", lambda b, t, t2: b.permute(t, tuple(range(rank))[::-1])),
        ("slice(head)", lambda b, t, t2: b.slice(t, (slice(0, max(1, shape[0] // 2)),))),
        ("slice(inner)", lambda b, t, t2: b.slice(t, tuple(slice(1, max(1, d - 1)) for d in shape))),
        ("cat(axis 0)", lambda b, t, t2: b.cat([t, t2], 0)),
        ("cat(last axis)", lambda b, t, t2: b.cat([t, t2], -1)),
    ]
    for name, fn in plans:
        check = f"ops.{name}"
        want, werr = _result(lambda: fn(ref, rq, rq2))
        got, gerr = _result(lambda: fn(backend, q, q2))
        if werr is not None:
            if not isinstance(werr, QCoreError):
                raise werr  # the reference itself broke: a core bug, not the backend's
            if gerr is None or type(gerr) is not type(werr):
                raise ctx.fail(check, f"reference raised {type(werr).__name__} ({werr}); backend "
                                      + ("returned normally" if gerr is None else f"raised {type(gerr).__name__}: {gerr}"))
            continue
        if gerr is not None:
            raise ctx.fail(check, f"raised {type(gerr).__name__}: {gerr}")
        _same_tensor(ctx, check, backend, got, ref, want, tol)
    if rank == 2:
        check_products(ctx, backend, ref, case, q, rq, tol)


_BF16 = np.dtype(ml_dtypes.bfloat16)
_UNIT_ROUNDOFF = {"float32": (2.0 ** -24, 2.0 ** -150), "float16": (2.0 ** -11, 2.0 ** -25),
                  "bfloat16": (2.0 ** -8, 2.0 ** -134), "float64": (0.0, 0.0)}
"""Result dtype -> (unit roundoff u, half the smallest subnormal d) of the products' bound."""


def product_bound(x: np.ndarray, W: np.ndarray, bias: np.ndarray | None, out_dtype: Any,
                  rel: float = 2.0, fp8_codes: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(exact y* = x @ W^T + bias in float64, the bound on |y - y*|) of docs/spec.md's products
    for x [M, K], the dequantized weight W [N, K] (float64) and the result dtype; for bfloat16 x,
    result and bias (or none), with the bfloat16-weight rule's term, and for float16 ones the
    float16-weight rule's (`max|W|` over W); with `fp8_codes` (x and W
    decoded e4m3, a bfloat16 result), with the quantized activations' FP8 accumulator term."""
    x64 = x.astype(np.float32).astype(np.float64)
    K = W.shape[1]
    b = np.zeros(W.shape[0]) if bias is None else bias.astype(np.float32).astype(np.float64)
    exact = x64 @ W.T + b
    T = np.abs(x64) @ np.abs(W).T
    a = rel * max(K, 1) * 2.0 ** -24 * T + 2.0 ** -24 * np.abs(b)
    u, d = _UNIT_ROUNDOFF[np.dtype(out_dtype).name]
    bound = a + u * (np.abs(exact) + a) + d
    if x.dtype == _BF16 and np.dtype(out_dtype) == _BF16 and (bias is None or bias.dtype == _BF16):
        bound = bound + 2.0 ** -6 * T + 2.0 ** -133 * np.abs(x64).sum(axis=-1, keepdims=True)
    f16 = np.dtype(np.float16)
    if x.dtype == f16 and np.dtype(out_dtype) == f16 and (bias is None or bias.dtype == f16):
        top = float(np.abs(W).max()) if W.size else 0.0
        bound = bound + 2.0 ** -10 * T + 2.0 ** -36 * top * np.abs(x64).sum(axis=-1, keepdims=True)
    if fp8_codes and np.dtype(out_dtype) == _BF16:
        bound = bound + (2.0 ** -8 + K * 2.0 ** -18) * T
    return exact, bound


def _check_product(ctx: _Ctx, check: str, backend, got: Any, err: Any, x: np.ndarray, W: np.ndarray,
                   bias: np.ndarray | None, out_dtype: Any, tol: Tolerances, fp8_codes: bool = False) -> None:
    if err is not None:
        raise ctx.fail(check, f"raised {type(err).__name__}: {err}")
    y = _host(ctx, check, backend, got)
    want_shape = x.shape[:-1] + (W.shape[0],)
    if y.shape != want_shape:
        raise ctx.fail(check, f"shape {y.shape}, want {want_shape}")
    if y.dtype != np.dtype(out_dtype):
        raise ctx.fail(check, f"result dtype {y.dtype}, want {np.dtype(out_dtype)} (docs/spec.md: the result dtype)")
    exact, bound = product_bound(x, W, bias, out_dtype, tol.matmul_rel, fp8_codes)
    e = np.abs(y.astype(np.float64) - exact)
    over = ~(e <= bound)
    if over.any():
        i = tuple(map(int, np.unravel_index(int(np.argmax(np.where(over, e - bound, -np.inf))), e.shape)))
        raise ctx.fail(check, f"{int(over.sum())} of {e.size} outputs exceed the f32 accumulation bound "
                              f"(docs/spec.md's products, with one rounding to the result dtype); "
                              f"worst at {i}: got {y[i]!r}, want {exact[i]!r}, bound {bound[i]:.3g}")


def _refused_alike(ctx: _Ctx, check: str, werr: Any, gerr: Any) -> bool:
    """Whether the reference refused a product (then the backend must raise the same type)."""
    if werr is None:
        return False
    if not isinstance(werr, QCoreError):
        raise werr  # the reference itself broke: a core bug, not the backend's
    if gerr is None or type(gerr) is not type(werr):
        raise ctx.fail(check, f"reference raised {type(werr).__name__}; backend "
                              + ("returned normally" if gerr is None else f"raised {type(gerr).__name__}: {gerr}"))
    return True


def check_products(ctx: _Ctx, backend, ref, case: Case, q: QTensor, rq: QTensor, tol: Tolerances) -> None:
    """`matmul` and `linear` with the case's 2-D tensor as the weight, in both orientations (as
    [K, N] for matmul, as [N, K] for linear), with float32, float16 and bfloat16 x and a bias,
    within docs/spec.md's bound for each result dtype; float16 x also with a weight of values
    near 2**-20 (below float16's normal range: the float16-weight rule's shift, x times 2**12);
    where the reference raises a qcore error, the backend raises the same type."""
    rows, cols = case.shape
    side = cols if cols <= 256 else 64  # a square weight: an untransposed product passes no other case
    xs = make_input((side, side), "normal", "f32", case.input_seed + 30)
    sq = ctx.call("quantize", backend.quantize, xs, case.qscheme)
    rsq = ref.quantize(xs, case.qscheme)
    xsmall = make_input((rows, cols), "normal", "f32", case.input_seed + 31) * np.float32(2.0 ** -20)
    smq = ctx.call("quantize", backend.quantize, xsmall, case.qscheme)
    rsmq = ref.quantize(xsmall, case.qscheme)
    weights = {"": (q, rq, np.asarray(ref.dequantize(rq), np.float64)),
               "square": (sq, rsq, np.asarray(ref.dequantize(rsq), np.float64)),
               "small": (smq, rsmq, np.asarray(ref.dequantize(rsmq), np.float64))}
    plans = [("ops.matmul", "f32", "", None), ("ops.matmul[bf16]", "bf16", "", None),
             ("ops.matmul[square]", "f32", "square", None)]
    plans += [(f"ops.linear[{dt}]", dt, "", None) for dt in ("f32", "f16", "bf16")]
    plans += [("ops.linear[bias]", "f32", "", rows), ("ops.linear[square]", "bf16", "square", side),
              ("ops.linear[f16, small weight]", "f16", "small", None)]
    for i, (check, dt, which, nbias) in enumerate(plans):
        qw, rw, W = weights[which]
        is_matmul = check.startswith("ops.matmul")
        x = make_input((3, W.shape[0] if is_matmul else W.shape[1]), "normal", dt, case.input_seed + 2 + i)
        if which == "small":  # (results in float16's normal range)
            x = (x.astype(np.float32) * np.float32(2.0 ** 12)).astype(x.dtype)
        bias = None if nbias is None else make_input((nbias,), "normal", "f32", case.input_seed + 20)
        if is_matmul:
            want, werr = _result(lambda: ref.matmul(x, rw))
            got, gerr = _result(lambda: backend.matmul(x, qw))
            Wt = W.T
        else:
            want, werr = _result(lambda: ref.linear(x, rw, bias))
            got, gerr = _result(lambda: backend.linear(x, qw, bias))
            Wt = W
        if _refused_alike(ctx, check, werr, gerr):
            continue
        out_dtype = np.float32 if is_matmul else x.dtype
        _check_product(ctx, check, backend, got, gerr, x, Wt, bias, out_dtype, tol)
    check_activation_products(ctx, backend, ref, case, q, rq, weights[""][2], tol)


_ACT_SCHEMES = ("e4m3/block{k}:f32", "q8s/block{k}:f32")
"""Activation schemes a product's `act=` check tries, first the backend runs: per-token FP8, else
per-row int8 (docs/spec.md, quantized activations)."""


def _act_for(backend, k: int, block: int | None = None) -> str | None:
    for text in _ACT_SCHEMES:
        act = text.format(k=max(1, block or k))
        if backend.supports(act):
            return act
    return None


def check_activation_products(ctx: _Ctx, backend, ref, case: Case, q: QTensor, rq: QTensor, W: np.ndarray,
                              tol: Tolerances) -> None:
    """`linear` / `matmul` with `act=` (x quantized per row, and per block of about a third of K)
    and with a QTensor x (docs/spec.md, quantized activations): the product of the reference's
    decoded x (`dequantize(quantize(x, act))`, bit-exact across backends) within the products'
    bound, in their result dtype (x's for `linear`, float32 for `matmul`, float32 for a QTensor x).
    A backend that runs neither activation scheme is not checked here."""
    rows, cols = case.shape
    bias = make_input((rows,), "normal", "f32", case.input_seed + 21)
    plans = [("ops.linear[act]", "linear", "bf16", cols, None, False),
             ("ops.linear[act, blocks]", "linear", "f32", cols, max(1, -(-cols // 3)), False),
             ("ops.matmul[act]", "matmul", "f16", rows, None, False),
             ("ops.linear[quantized x]", "linear", "f32", cols, None, True)]
    for i, (check, what, dt, k, block, given) in enumerate(plans):
        act = _act_for(backend, k, block)
        if act is None:
            continue
        x = make_input((3, k), "normal", dt, case.input_seed + 40 + i)
        x32 = x.astype(np.float32)
        xq = np.asarray(ref.dequantize(ref.quantize(x32, act)), np.float32)
        b = bias if what == "linear" else None
        check = f"{check}({act})"
        if given:
            xt = ctx.call(check + " (quantize x)", backend.quantize, x32, act)
            _, werr = _result(lambda: ref.linear(ref.quantize(x32, act), rq, b))
            got, gerr = _result(lambda: backend.linear(xt, q, b))
            out_dtype = np.float32
        elif what == "linear":
            _, werr = _result(lambda: ref.linear(x, rq, b, act=act))
            got, gerr = _result(lambda: backend.linear(x, q, b, act=act))
            out_dtype = x.dtype
        else:
            _, werr = _result(lambda: ref.matmul(x, rq, act=act))
            got, gerr = _result(lambda: backend.matmul(x, q, act=act))
            out_dtype = np.float32
        if _refused_alike(ctx, check, werr, gerr):
            continue
        fp8 = parse_scheme(act).value is QuantValue.E4M3 and case.qscheme.value is QuantValue.E4M3
        _check_product(ctx, check, backend, got, gerr, xq, W if what == "linear" else W.T, b, out_dtype, tol, fp8)
    act = _act_for(backend, cols)
    if act is not None:
        check_nonfinite_activations(ctx, backend, q, bias, act, make_input((3, cols), "normal", "bf16",
                                                                           case.input_seed + 47))


def check_nonfinite_activations(ctx: _Ctx, backend, q: QTensor, bias: np.ndarray, act: str, x: np.ndarray) -> None:
    """`linear(x, q, bias, act=)` of an x whose middle row holds a NaN and an infinity
    (docs/spec.md, quantized activations: a non-finite x): no error, that row's results all NaN,
    the other rows the same bits as with that row all zeros."""
    check = f"ops.linear[act, non-finite x]({act})"
    bad = x.copy()
    bad[1, 0], bad[1, -1] = np.nan, np.inf
    zeroed = x.copy()
    zeroed[1] = 0
    y = _host(ctx, check, backend, ctx.call(check, backend.linear, bad, q, bias, act=act)).astype(np.float32)
    want = _host(ctx, check, backend, ctx.call(check, backend.linear, zeroed, q, bias, act=act)).astype(np.float32)
    if not np.isnan(y[1]).all():
        raise ctx.fail(check, f"{int((~np.isnan(y[1])).sum())} of row 1's {y.shape[1]} results are not NaN; "
                              "a row of x holding a non-finite value gives NaN")
    same = np.array_equal(y[[0, 2]].view(np.uint32), want[[0, 2]].view(np.uint32))
    if not same:
        raise ctx.fail(check, "rows 0 and 2 differ from the call with row 1 zeroed; a non-finite row of x "
                              "changes no other row")


# --------------------------------------------------------------------------- cross-backend


def check_cross_backend(backend, peer, case: Case, reference=None) -> None:
    """A payload made by `backend` loads on `peer` (and back): both re-emit the same bytes and
    dequantize to the reference's floats. Run only where both support the scheme."""
    ref = reference or reference_backend()
    ctx = _ctx(backend, case)
    pctx = _Ctx(peer, case, case.qscheme, case.shape)
    s = case.qscheme
    x = case.input()
    want_y = np.asarray(ref.dequantize(ref.quantize(x, s)))
    peer_name = getattr(peer, "name", "?")
    for src, dst, sctx, dctx in ((backend, peer, ctx, pctx), (peer, backend, pctx, ctx)):
        src_name, dst_name = getattr(src, "name", "?"), getattr(dst, "name", "?")
        check = f"cross-backend.{src_name}->{dst_name}"
        d = sctx.call(check + " (quantize)", lambda: src.into_data(src.quantize(x, s)))
        moved = dctx.call(check + " (from_data)", dst.from_data, d)
        compare_data(ctx, check, ctx.call(check, dst.into_data, moved), d)
        y = _host(ctx, check, dst, ctx.call(check, dst.dequantize, moved))
        compare_arrays(ctx, check + ".dequantize", y, want_y, "dequantized values")
    del peer_name
