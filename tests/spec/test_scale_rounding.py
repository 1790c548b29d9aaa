"""The scale rounding rules (docs/spec.md, scale rounding rules): `up` (the v1 rule), `rne`, `mx`.

Each rule is checked against an independent oracle (numpy's and ml_dtypes' casts, which round to
nearest even; `np.frexp` for the MX exponent; an OCP MX quantizer written here), then through
the schemes, the payload, files and every backend. The kernels' scalar rule is pinned against
`qcore.spec.codecs` slot by slot in tests/spec/test_scale_rules.py and tests/backend/test_ndarray_backend.py."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import qcore
from qcore import QParams, SchemeError
from qcore.spec.codecs import SCALES, VALUES, bits_f32, f32_bits
from qcore.files.io import load_data
from qcore.spec.schemes import ScaleRound

REF = qcore.backend("reference")


def _raw(n: int = 20000, seed: int = 3) -> np.ndarray:
    """Non-negative finite f32 raw scales over every binade, random mantissas, and exact ties."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 0x7F800000, n, dtype=np.uint32)
    return bits_f32(bits).copy()


def _same(a, b, what: str) -> None:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    bad = np.flatnonzero(f32_bits(a) != f32_bits(b))
    assert bad.size == 0, f"{what}: {bad.size} differ, first got {a.flat[bad[0]]!r} want {b.flat[bad[0]]!r}"


# --------------------------------------------------------------------------- the rules themselves


def test_rne_f16_is_numpy_cast_saturated():
    s = np.concatenate([_raw(), np.float32([0, 65504, 65519, 65520, 1e30, 2.0**-25, 3 * 2.0**-26])])
    with np.errstate(over="ignore"):
        want = s.astype(np.float16).astype(np.float32)
    want = np.where(np.isinf(want), np.float32(65504), want)
    _same(SCALES["f16"].round_nearest(s), want, "f16 rne")


def test_rne_bf16_is_ml_dtypes_cast_saturated():
    s = _raw()
    bf = SCALES["bf16"].max_value
    with np.errstate(over="ignore"):
        want = s.astype(ml_dtypes.bfloat16).astype(np.float32)
    want = np.where(np.isinf(want), np.float32(bf), want)
    _same(SCALES["bf16"].round_nearest(s), want, "bf16 rne")


def test_rne_ue4m3_is_ml_dtypes_cast_saturated():
    s = np.concatenate([_raw(), np.float32([448, 463.9, 464, 465, 1e9, 2.0**-10, 3 * 2.0**-11])])
    with np.errstate(over="ignore", invalid="ignore"):
        want = s.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    want = np.where(~np.isfinite(want) | (s >= 448), np.float32(448), want)
    _same(SCALES["ue4m3"].round_nearest(s), want, "ue4m3 rne")


def test_rne_ue8m0_nearest_power_of_two():
    """Nearest power of two in [2^-127, 2^127]; a tie (1.5 * 2^k) goes to the even exponent field
    (the bit rule; ml_dtypes' e8m0 cast rounds ties up, docs/spec-choices.md), except below f32's
    smallest normal, where the values are the multiples 1 and 2 of 2^-127 and the tie goes to
    the even multiple, 2^-126."""
    s = np.concatenate([_raw(), np.float32([1.5, 3.0, 6.0, 0.75, 2.0**-127, 2.0**-130])])
    got = SCALES["ue8m0"].round_nearest(s)
    d = s.astype(np.float64)
    with np.errstate(divide="ignore"):
        k = np.floor(np.log2(np.maximum(d, 2.0**-149)))
    lo, hi = 2.0**k, 2.0 ** (k + 1)
    even_hi = ((k + 128) % 2 == 0) | (k == -127)  # hi's exponent field k + 128 even; the grid's even multiple
    pick_hi = (hi - d < d - lo) | ((hi - d == d - lo) & even_hi)
    want = np.clip(np.where(pick_hi, hi, lo), 2.0**-127, 2.0**127).astype(np.float32)
    _same(got, want, "ue8m0 rne")


def test_rne_f32_is_the_identity():
    s = _raw()
    _same(SCALES["f32"].round_nearest(s), s, "f32 rne")


@pytest.mark.parametrize("value", sorted(VALUES))
def test_mx_rule_is_floor_log2_amax_minus_emax(value):
    emax = VALUES[value].emax
    assert emax == int(np.floor(np.log2(VALUES[value].qmax)))
    amax = np.concatenate([_raw(5000), np.float32([0, 1, 6, 7.99, 8, 448, 2.0**-140, 2.0**127])])
    _, e = np.frexp(amax.astype(np.float64))  # amax = m * 2^e, 0.5 <= m < 1: floor(log2 amax) = e - 1
    want = np.where(amax > 0, np.clip(2.0 ** (e - 1 - emax), 2.0**-127, 2.0**127), 2.0**-127).astype(np.float32)
    _same(SCALES["ue8m0"].round_mx(amax, emax), want, f"mx {value}")


def test_emax_of_every_value():
    assert {k: v.emax for k, v in VALUES.items()} == {
        "q8f": 6, "q8s": 6, "q4f": 2, "q4s": 2, "q2f": 0, "q2s": 0, "e4m3": 8, "e5m2": 15, "e2m1": 2,
        "u8": 7, "u4": 3, "u2": 1}  # (unsigned values take no mx rule: affine offsets only)


# --------------------------------------------------------------------------- schemes


@pytest.mark.parametrize("text", ["q4s/block32:f16/round:rne", "nvfp4/round:rne", "mxfp4/round:mx",
                                  "e4m3/block32:ue8m0/round:mx", "q8s/tensor:bf16/round:rne",
                                  "q4s-lookup[nf4]/block64:f16/round:rne"])
def test_text_round_trips(text):
    s = qcore.scheme(text)
    assert qcore.scheme(str(s)) == s and "round:" in str(s)
    assert s != qcore.scheme(str(s).replace("/round:rne", "").replace("/round:mx", ""))


def test_up_is_the_default_and_is_not_written():
    s = qcore.scheme("q4s/block32:f16")
    assert s.scale_round is ScaleRound.UP and str(s) == "q4s/block32:f16"
    assert qcore.scheme("q4s/block32:f16/round:up") == s
    assert s.with_scale_round("rne").with_scale_round("up") == s


@pytest.mark.parametrize("text", ["q4s/block32:f16/round:mx", "nvfp4/round:mx", "q8s/round:mx",
                                  "q4s-lookup[nf4]/block64:ue8m0/round:mx", "e2m1/tensor:ue8m0/round:mx"])
def test_mx_needs_one_ue8m0_block_level_and_a_symmetric_value(text):
    with pytest.raises(SchemeError, match="needs one block level of ue8m0"):
        qcore.scheme(text)


def test_unknown_rule_and_repeated_part():
    with pytest.raises(SchemeError, match="unknown scale rounding rule 'half'"):
        qcore.scheme("q4s/block32:f16/round:half")
    with pytest.raises(SchemeError, match="given twice"):
        qcore.scheme("q4s/block32:f16/round:rne/round:up")


# --------------------------------------------------------------------------- through the reference


def _x(shape=(8, 128), seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * np.exp(rng.uniform(-6, 6, (shape[0], 1)))).astype(np.float32)


def test_rne_scales_are_the_nearest_of_the_raw_scales():
    x = _x()
    p = REF.calibrate(x, "q4s/block32:f16/round:rne")
    raw = (np.abs(x).reshape(8, 4, 32).max(-1) / np.float32(7)).astype(np.float32)
    _same(p.scales, raw.astype(np.float16).astype(np.float32), "calibrated f16 scales")


def _ocp_mx(x: np.ndarray, value: str, block: int = 32) -> np.ndarray:
    """OCP MX (v1.0 §6.3) written from the spec: per block X = floor(log2 amax) - emax(elem),
    P = x / 2^X rounded to the element format (nearest, ties to even, saturating), value P * 2^X."""
    t = VALUES[value]
    xb = x.reshape(-1, block).astype(np.float64)
    amax = np.abs(xb).max(1, keepdims=True)
    _, e = np.frexp(amax)
    X = np.where(amax > 0, np.maximum(e - 1 - t.emax, -127), -127)
    y = np.clip(xb / 2.0**X, -t.qmax, t.qmax).astype(np.float32)
    mags = t.magnitudes.astype(np.float64)
    a = np.abs(y).astype(np.float64)
    i = np.abs(a[..., None] - mags).argmin(-1)  # nearest; ties: the even code (mantissa lsb 0)
    d = np.abs(a[..., None] - mags)
    tie = np.sort(d, -1)[..., 1] == np.sort(d, -1)[..., 0]
    i = np.where(tie & (i % 2 == 1), i + 1, i)
    return (np.sign(y) * mags[i] * 2.0**X).astype(np.float32).reshape(x.shape)


@pytest.mark.parametrize("value,text", [("e2m1", "mxfp4/round:mx"), ("e4m3", "mxfp8/round:mx")])
def test_mx_matches_an_ocp_quantizer(value, text):
    x = _x((16, 256), seed=5)
    x[0, :32] = 0.0
    x[1, :32] = np.float32(6.0)  # amax a power of two times emax's value
    got = REF.dequantize(REF.quantize(x, text))
    _same(np.abs(got), np.abs(_ocp_mx(x, value)), f"{text} vs OCP MX")


def test_mx_given_scales_are_floored_to_powers_of_two():
    x = _x((2, 64))
    grid = (2, 2)
    s = "mxfp4/round:mx"
    q = REF.quantize(x, s, params=QParams(np.full(grid, 3.9, np.float32)))
    assert np.all(REF.into_data(q).scales() == np.float32(2.0))
    q = REF.quantize(x, "q4s/block32:f16/round:rne", params=QParams(np.full(grid, 1.00048828125, np.float32)))
    assert np.all(REF.into_data(q).scales() == np.float32(1.0))  # the tie goes to the even f16


def test_rules_change_scales_not_the_layout(tmp_path):
    x = _x()
    for text in ("q4s/block32:f16/round:rne", "mxfp4/round:mx"):
        base = text.split("/round:")[0]
        d, d_up = REF.into_data(REF.quantize(x, text)), REF.into_data(REF.quantize(x, base))
        assert len(d.payload) == len(d_up.payload) and d.payload != d_up.payload
        assert d.scheme == qcore.scheme(text)  # the payload keeps the rule
        back = qcore.QuantizedData(d.shape, str(d.scheme), d.payload)
        assert back.scheme == d.scheme
        path = tmp_path / "m.safetensors"
        qcore.save(path, {"w": REF.quantize(x, text)})
        loaded = load_data(path)["w"]
        assert loaded.scheme == qcore.scheme(text) and loaded.payload == d.payload


def test_empty_tensor_under_each_rule():
    for text in ("q4s/block32:f16/round:rne", "mxfp4/round:mx", "nvfp4/round:rne"):
        d = REF.into_data(REF.quantize(np.zeros((0, 32), np.float32), text))
        assert d.shape == (0, 32)


# --------------------------------------------------------------------------- every backend


RULE_SCHEMES = ["q8s/block32:f16/round:rne", "q8f/block4x8:bf16/round:rne", "q8s/tensor:ue4m3/round:rne",
                "q8s/block32:ue8m0/round:mx", "q8s/block16:ue4m3/tensor:f32/round:rne",
                "q4s/block32:f16/round:rne", "e4m3/block32:ue8m0/round:mx", "mxfp4/round:mx",
                "nvfp4/round:rne", "e5m2/block3x5:ue8m0/round:rne", "q4s/block32:f16/packed_u32:1/round:rne"]


@pytest.mark.parametrize("name", ["ndarray", "cuda"])
def test_backends_match_the_reference(name, request):
    """Bit-identical payloads on the kernels' paths (fast, tile, general, two-level, per-tensor);
    the cuda backend under the simulator in CI, on the GPU on a GPU machine."""
    be = qcore.backend(name)
    if not be.available():
        pytest.skip(f"backend {name} is not available here: {be.describe()}")
    shapes = [(4, 64), (6, 40)] if name == "cuda" else [(8, 256), (6, 40), (67,)]
    ran = 0
    for text in RULE_SCHEMES:
        if not be.supports(text):
            continue
        for shape in shapes:
            s = qcore.scheme(text)
            if s.block is not None and len(s.block.dims) > len(shape):
                continue
            x = _x(shape, seed=len(text) + len(shape))
            want = REF.into_data(REF.quantize(x, text)).payload
            got = be.into_data(be.quantize(x, text)).payload
            assert got == want, f"{name} {text} {shape}"
            ran += 1
    assert ran >= 6
