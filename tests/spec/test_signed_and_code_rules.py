"""Signed scales and the code rules (docs/spec.md): text form and validity, the signed
extreme, the rules' codes against independent oracles and against the kernels' one source, payload
validity, explicit params. Bit-identity with llama.cpp's quantizers is in test_formats_gguf.py;
every backend against the reference in the conformance suite's `signed/*` and `codes:*` strata."""
from __future__ import annotations

import math
from decimal import ROUND_HALF_UP, Decimal

import numpy as np
import pytest

import qcore
from qcore.spec import arithmetic as A
from qcore.spec.codecs import CODE_RULES, code_rule_kernel, rule_codes
from qcore.errors import InputError, InvalidDataError, SchemeError
from qcore.spec.payload import QuantizedData
from qcore.backend.protocol import QParams
from qcore.spec.schemes import CodeRule, QuantScheme, QuantValue, ScaleRound


@pytest.mark.parametrize("text", [
    "q4f/block32:f16/signed", "q8f/tensor:bf16/signed", "q2f/block4x8:f32/packed_native/signed/round:rne",
    "q8s/block32:f16/round:rne/codes:away", "q4f/block32:f16/signed/round:rne/codes:offset",
    "q4s/codes:offset", "e2m1/block16:ue4m3/tensor:f32/packed_native",
])
def test_text_form_round_trips(text):
    s = qcore.scheme(text)
    assert str(s) == text and qcore.scheme(str(s)) == s


def test_presets_are_llama_cpp_quantizers_and_builders_agree():
    q4 = QuantScheme(QuantValue.Q4F).per_block([32], "f16").with_signed_scales().with_scale_round("rne") \
        .with_code_rule("offset")
    assert qcore.scheme("q4_0") == q4 and str(q4) == "q4f/block32:f16/signed/round:rne/codes:offset"
    assert str(qcore.scheme("q8_0")) == "q8s/block32:f16/round:rne/codes:away"
    assert q4.payload_form == qcore.scheme("q4f/block32:f16/signed")  # the rules go, the sign stays
    assert q4.scale_divisor == -8.0 and q4.reciprocal_codes and not qcore.scheme("q4f").reciprocal_codes


@pytest.mark.parametrize("text,why", [
    ("q4s/block32:f16/signed", "full-range integer"), ("e2m1/block32:f32/signed", "full-range integer"),
    ("q4f-lookup[nf4]/block64:f32/signed", "unknown lookup table|full-range integer"),
    ("q4f/block32:ue8m0/signed", "f32/f16/bf16"), ("q4f/block16:f16/tensor:f32/signed", "one scale level"),
    ("q8f/block32:ue8m0/signed/round:mx", "signed|mx"),
    ("e4m3/block32:f32/codes:away", "integer value"), ("q4s-lookup[nf4]/block64:f32/codes:away", "integer value"),
    ("q4s/block16:f16/tensor:f32/codes:offset", "one scale level"), ("q8s/block32:ue8m0/round:mx/codes:away", "rne"),
    ("q8s/codes:nearest", "unknown code rule"), ("q8f/signed/signed", "given twice"),
])
def test_where_the_rules_do_not_apply_the_scheme_is_refused(text, why):
    with pytest.raises(SchemeError, match=why):
        qcore.scheme(text)


def _oracle_signed_extreme(x: np.ndarray, block: tuple[int, ...]) -> np.ndarray:
    """Per block, in plain Python: walk the block in row-major order, keep the first largest |x|."""
    grid = [math.ceil(d / b) for d, b in zip(x.shape, block)]
    out = np.zeros(grid, np.float32)
    for g in np.ndindex(*grid):
        best, val = -1.0, 0.0
        ranges = [range(gi * b, min((gi + 1) * b, d)) for gi, b, d in zip(g, block, x.shape)]
        for idx in np.ndindex(*[len(r) for r in ranges]):
            v = float(x[tuple(r[i] for r, i in zip(ranges, idx))])
            if abs(v) > best:
                best, val = abs(v), v
        out[g] = val
    return out


def test_signed_extreme_is_the_first_largest_magnitude_in_row_major_order():
    rng = np.random.default_rng(0)
    x = rng.integers(-3, 4, size=(7, 11)).astype(np.float32)  # many ties of magnitude, both signs
    for text, block in (("q4f/block3x5:f32/signed", (3, 5)), ("q4f/block4:f32/signed", (1, 4))):
        got = A.slot_statistic(x, qcore.scheme(text))
        assert np.array_equal(got, _oracle_signed_extreme(x, block)), text
    assert A.slot_statistic(np.array([2.0, -3.0, 3.0], np.float32), qcore.scheme("q4f/signed")) == -3.0
    assert A.slot_statistic(np.array([2.0, 3.0, -3.0], np.float32), qcore.scheme("q4f/signed")) == 3.0


def test_signed_scale_makes_the_extreme_qmin_and_saturates_the_other_side():
    x = np.array([[1.0, -0.25, 0.5, 0.0, -1.0, 0.125, 0.0, 0.0]], np.float32)
    for text, qmin, qmax in (("q4f/block8:f32/signed", -8, 7), ("q8f/block8:f16/signed", -128, 127)):
        q = A.quantize(x, qcore.scheme(text))
        assert q.scales()[0, 0] == np.float32(1.0 / qmin)        # the first extreme (+1) is positive
        codes = q.codes()[0]
        assert codes[0] == qmin and codes[4] == qmax             # -1 would be -qmin: saturates
        back = A.dequantize(q)
        assert back[0, 0] == 1.0 and back[0, 4] == np.float32(qmax / qmin)


def test_signed_zero_block_stores_minus_zero_as_llama_cpp_does():
    q = A.quantize(np.zeros((1, 32), np.float32), qcore.scheme("q4_0"))
    assert np.signbit(q.scales()[0, 0]) and q.scales()[0, 0] == 0   # 0 / -8 = -0
    assert not np.signbit(A.quantize(np.zeros((1, 32), np.float32), qcore.scheme("q8_0")).scales()[0, 0])


@pytest.mark.parametrize("rule", ["away", "offset"])
@pytest.mark.parametrize("value", ["q8f", "q8s", "q4f", "q4s", "q2f", "q2s"])
def test_rule_codes_against_an_independent_oracle(rule, value):
    t = qcore.scheme(value).traits
    halves = np.arange(2 * t.qmin - 4, 2 * t.qmax + 5) / 2
    rng = np.random.default_rng(1)
    y = np.concatenate([halves, np.nextafter(halves, np.inf), np.nextafter(halves, -np.inf),
                        rng.uniform(t.qmin - 3, t.qmax + 3, 500), [0.0, -0.0, 1e30, -1e30]]).astype(np.float32)
    got = rule_codes(y, rule, t.qmin, t.qmax)
    for yi, g in zip(y.tolist(), got.tolist()):
        if rule == "away":   # nearest, halves away from zero, then clamp (decimal arithmetic, exact)
            want = int(Decimal(min(max(yi, t.qmin), t.qmax)).quantize(Decimal(1), rounding=ROUND_HALF_UP))
        else:                # llama.cpp: trunc of the f32 sum y + (-qmin + 0.5), clamped to the codes
            c0 = -int(t.qmin)
            s = float(np.float32(np.float32(yi) + np.float32(c0 + 0.5)))
            want = int(min(max(math.trunc(s), 0), t.qmax - t.qmin)) - c0
        assert g == want, (yi, g, want)


def test_the_kernels_one_source_is_the_numpy_rule():
    numba = pytest.importorskip("numba", reason="numba is not installed")
    rule_code = code_rule_kernel(numba.njit)
    rng = np.random.default_rng(2)
    y = np.concatenate([np.arange(-300, 301) / 2, rng.uniform(-200, 200, 2000), [1e30, -1e30, np.nan]])
    y = y.astype(np.float32)
    for value in ("q8f", "q8s", "q4f", "q2s"):
        t = qcore.scheme(value).traits
        for rule in ("away", "offset"):
            want = rule_codes(y, rule, t.qmin, t.qmax).astype(np.int64)
            got = np.array([rule_code(v, CODE_RULES.index(rule), t.qmin, t.qmax) for v in y], np.int64)
            assert np.array_equal(got, want), (value, rule)


def test_codes_come_from_the_raw_scale_not_the_stored_one():
    """f16 rounding moves the stored scale; the rule's codes use 1 / raw (llama.cpp's `id`)."""
    x = np.linspace(-1, 1, 32, dtype=np.float32).reshape(1, 32) * np.float32(1.2345)
    s = qcore.scheme("q8s/block32:f16/round:rne/codes:away")
    raw = np.float32(np.abs(x).max() / np.float32(127))
    assert np.float16(raw).astype(np.float32) != raw
    codes = A.quantize(x, s).codes()
    want = rule_codes(np.where(x == 0, 0, x * np.float32(1 / raw)).astype(np.float32), "away", -127, 127)
    assert np.array_equal(codes, want)
    # given params are their own raw scales
    p = QParams(np.array([[0.01]], np.float32))
    r = np.float32(1) / np.float16(0.01).astype(np.float32)
    got = qcore.backend("reference").quantize(x, s, params=p).to_data().codes()
    assert np.array_equal(got, rule_codes((x * r).astype(np.float32), "away", -127, 127))


def test_payload_sign_is_valid_only_for_signed_scales():
    codes = np.zeros(32, np.uint8).tobytes()[:16]
    neg = np.array([-0.5], "<f2").tobytes()
    d = QuantizedData((32,), qcore.scheme("q4f/block32:f16/signed"), codes + neg)
    assert d.scales()[0] == -0.5
    assert QuantizedData((32,), qcore.scheme("q4f/block32:f16/signed"),
                         codes + np.array([-0.0], "<f2").tobytes()).scales()[0] == 0
    with pytest.raises(InvalidDataError, match="scales must be finite and >= 0"):
        QuantizedData((32,), qcore.scheme("q4f/block32:f16"), codes + neg)
    with pytest.raises(InvalidDataError, match="signed scales must be finite"):
        QuantizedData((32,), qcore.scheme("q4f/block32:f16/signed"), codes + np.array([-np.inf], "<f2").tobytes())


@pytest.mark.parametrize("be_name", ["reference", "ndarray", "cuda"])
def test_explicit_signed_params_and_absmean(request, be_name):
    from tests.formats_util import get_backend

    be = get_backend(be_name, request)
    text = "q8f/block4:bf16/signed" if be_name == "ndarray" else "q4f/block4:bf16/signed"
    s = qcore.scheme(text)
    x = np.array([[0.5, -1.0, 0.25, 2.0, 1.0, 1.0, -3.0, 0.0]], np.float32)
    p = QParams(np.array([[-0.25, 0.5]], np.float32))
    got = be.into_data(be.quantize(x, s, params=p))
    ref = qcore.backend("reference")
    assert got.payload == ref.into_data(ref.quantize(x, s, params=p)).payload
    assert got.scales().tolist() == [[-0.25, 0.5]]
    with pytest.raises(InputError, match="finite and >= 0"):
        be.quantize(x, s.with_signed_scales(False), params=p)
    with pytest.raises(InputError, match="takes the minmax statistic"):
        be.calibrate(x, s, method="absmean")
    with pytest.raises(InputError, match="takes the minmax statistic"):
        be.quantize(np.zeros((0, 8), np.float32), s, method="absmean")


def test_rules_are_enum_members_with_their_text():
    assert [r.value for r in CodeRule] == list(CODE_RULES)
    assert qcore.scheme("q8s/block32:f16/round:rne").scale_round is ScaleRound.RNE


@pytest.mark.parametrize("be_name", ["reference", "cuda"])
def test_an_all_zero_slot_takes_its_first_zeros_sign(request, be_name):
    """The signed extreme of zeros is the first element (numpy's argmax, llama.cpp's): -0 there
    gives the scale -0 / qmin = +0, +0 gives -0."""
    from tests.formats_util import get_backend

    be = get_backend(be_name, request)
    x = np.zeros((2, 32), np.float32)
    x[0, 0] = -0.0
    x[1, 5] = -0.0
    s = be.into_data(be.quantize(x, "q4_0")).scales().reshape(-1)
    assert not np.signbit(s[0]) and np.signbit(s[1])


@pytest.mark.parametrize("be_name", ["reference", "cuda"])
def test_per_tensor_signed_and_affine_statistics(request, be_name):
    """One scale for the whole tensor (the cuda backend's parallel per-tensor path): the first
    element of largest |x| with its sign, and the min / max of an affine scheme."""
    from tests.formats_util import get_backend

    be = get_backend(be_name, request)
    x = np.zeros((3, 50), np.float32)
    x[1, 7], x[2, 3], x[0, 40] = 3.0, -3.0, 2.0  # the first of the two magnitudes 3 is +3
    assert be.into_data(be.quantize(x, "q4f/signed")).scales() == np.float32(3.0 / -8)
    x[1, 7] = -3.0
    assert be.into_data(be.quantize(x, "q4f/signed")).scales() == np.float32(3.0 / 8)
    z = np.zeros((3, 50), np.float32)
    z[0, 0] = -0.0  # zeros: the first element's sign, -0 / -8 = +0
    assert not np.signbit(be.into_data(be.quantize(z, "q4f/signed")).scales())
    d = be.into_data(be.quantize(x + np.float32(5), "u4/min:f32"))
    assert d.offsets() == np.float32(2.0) and d.scales() == np.float32(np.float32(5) / np.float32(15))
