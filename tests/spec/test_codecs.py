"""Value and scale-dtype trait tables (docs/spec.md, schemes and arithmetic): round-up, minifloat rounding."""
import ml_dtypes
import numpy as np
import pytest

from qcore.spec.codecs import SCALES, VALUES

S = np.array([0.5, 0.3, 1 / 3, 500, 1e-3, 7.7e-4], dtype=np.float32)


@pytest.mark.parametrize(
    "dtype, expected",
    [
        ("f32", S),
        ("f16", [0.5, 0.30004883, 0.3334961, 500, 0.0010004044, 0.000770092]),
        ("bf16", [0.5, 0.30078125, 0.33398438, 500, 0.0010070801, 0.00077056885]),
        ("ue4m3", [0.5, 0.3125, 0.34375, 448, 0.001953125, 0.001953125]),
        ("ue8m0", [0.5, 0.5, 0.5, 512, 2.0**-9, 2.0**-10]),
    ],
)
def test_scale_round_up_known_values(dtype, expected):
    got = SCALES[dtype].store(S)
    np.testing.assert_array_equal(got, np.asarray(expected, dtype=np.float32))


NARROW = {"f16": np.float16, "bf16": ml_dtypes.bfloat16, "ue4m3": ml_dtypes.float8_e4m3fn}


@pytest.mark.parametrize("dtype", sorted(SCALES))
def test_round_up_is_smallest_representable_at_or_above(dtype):
    """Never rounds down (docs/spec.md, scale storage); result is representable; it is the next value up."""
    rng = np.random.default_rng(1)
    s = np.concatenate([
        np.exp(rng.uniform(-30, 30, 4000)).astype(np.float32),
        np.float32([0, 2.0**-24, 2.0**-25, 2.0**-14, 2.0**-9, 2.0**-10, 2.0**-6, 447.9, 448, 449, 65504, 65505,
                    1e38, 3.3e38, 2.0**-127, 2.0**-126, 2.0**127, 2.0**-149]),
    ])
    tr = SCALES[dtype]
    r = tr.store(s)
    assert r.dtype == np.float32
    under_max = s <= np.float32(tr.max_value)
    assert np.all(r[under_max] >= s[under_max])
    assert np.all(r <= np.float32(tr.max_value))
    # representable: survives encode/decode unchanged
    np.testing.assert_array_equal(tr.decode(tr.encode(r)), r)
    if dtype in NARROW:  # the next value down in the narrow type is below s: r is the smallest
        nt = NARROW[dtype]
        inside = (s > 0) & (s < np.float32(tr.max_value))
        below = np.nextafter(r.astype(nt), nt(0)).astype(np.float32)
        assert np.all(below[inside] < s[inside])


def test_zero_scale_stays_zero_except_ue8m0():
    for name, tr in SCALES.items():
        z = tr.store(np.float32([0.0]))[0]
        assert z == (2.0**-127 if name == "ue8m0" else 0.0)


def test_ue8m0_is_power_of_two_at_or_above():
    s = np.float32([1.0, 1.5, 3.0, 0.75, 2.0**-127, 2.0**-126 * 0.75, 2.0**127, 3e38])
    np.testing.assert_array_equal(
        SCALES["ue8m0"].store(s), np.float32([1, 2, 4, 1, 2.0**-127, 2.0**-126, 2.0**127, 2.0**127])
    )
    assert list(SCALES["ue8m0"].encode(np.float32([1.0, 2.0**-127, 2.0**127]))) == [127, 0, 254]


def test_e2m1_rounding_facts():
    y = np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 7, 100])
    v = VALUES["e2m1"]
    np.testing.assert_array_equal(v.decode(v.encode(y)), np.float32([0, 1, 1, 2, 2, 4, 4, 6, 6]))
    np.testing.assert_array_equal(v.decode(v.encode(-y)), -np.float32([0, 1, 1, 2, 2, 4, 4, 6, 6]))
    assert v.encode(np.float32([6.0]))[0] == 0b0111 and v.encode(np.float32([-6.0]))[0] == 0b1111


def test_e4m3_saturates():
    v = VALUES["e4m3"]
    y = np.float32([300, 449, -449, 1e4, -1e4, 1e30, -1e30])
    np.testing.assert_array_equal(v.decode(v.encode(y)), np.float32([288, 448, -448, 448, -448, 448, -448]))


def test_sign_bit_is_sign_of_y():
    for name in ("e4m3", "e5m2", "e2m1"):
        v = VALUES[name]
        assert v.encode(np.float32([-0.0]))[0] == v.sign_bit
        assert v.encode(np.float32([-1e-30]))[0] == v.sign_bit
        assert v.encode(np.float32([0.0]))[0] == 0


ML = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2, "e2m1": ml_dtypes.float4_e2m1fn}


@pytest.mark.parametrize("name", sorted(ML))
def test_minifloat_encode_matches_ml_dtypes_after_clamp(name):
    """Cross-check with ml_dtypes (round to nearest even) on values clamped to ±max first."""
    v = VALUES[name]
    rng = np.random.default_rng(7)
    y = np.concatenate([
        rng.standard_normal(20000).astype(np.float32) * np.float32(v.qmax / 3),
        np.exp(rng.uniform(-25, 12, 20000)).astype(np.float32) * rng.choice([-1, 1], 20000).astype(np.float32),
        (v.decode_table[np.isfinite(v.decode_table)]),  # every value exactly
    ]).astype(np.float32)
    mids = np.float32((v.magnitudes[1:] + v.magnitudes[:-1]) / 2)  # every tie
    y = np.concatenate([y, mids, -mids])
    clamped = np.clip(y, -v.qmax, v.qmax).astype(np.float32)
    ref = clamped.astype(ML[name]).astype(np.float32)
    ours = v.decode(v.encode(y))
    np.testing.assert_array_equal(ours, ref)


@pytest.mark.parametrize("name", sorted(ML))
def test_decode_table_matches_ml_dtypes(name):
    v = VALUES[name]
    codes = np.arange(1 << v.bits, dtype=np.uint8)
    ref = codes.view(ML[name]).astype(np.float32) if v.bits == 8 else \
        np.array([np.uint8(c) for c in codes], dtype=np.uint8).view(ML[name]).astype(np.float32)
    ours = v.decode(codes)
    np.testing.assert_array_equal(np.isnan(ours), np.isnan(ref))
    np.testing.assert_array_equal(ours[~np.isnan(ours)], ref[~np.isnan(ref)])


@pytest.mark.parametrize("name", ["q8f", "q8s", "q4f", "q4s", "q2f", "q2s"])
def test_integer_encode_rounds_half_to_even_and_clamps(name):
    v = VALUES[name]
    y = np.float32([0.5, 1.5, 2.5, -0.5, -1.5, 1000, -1000])
    expected = np.clip(np.float32([0, 2, 2, 0, -2, 1000, -1000]), v.qmin, v.qmax)
    np.testing.assert_array_equal(v.encode(y).astype(np.float32), expected)


@pytest.mark.parametrize(
    "name, qmin, qmax, h",
    [("q8f", -128, 127, 127.5), ("q8s", -127, 127, 127), ("q4f", -8, 7, 7.5), ("q4s", -7, 7, 7),
     ("q2f", -2, 1, 1.5), ("q2s", -1, 1, 1), ("e4m3", -448, 448, 448), ("e5m2", -57344, 57344, 57344),
     ("e2m1", -6, 6, 6)],
)
def test_value_ranges(name, qmin, qmax, h):
    v = VALUES[name]
    assert (v.qmin, v.qmax, v.half_range) == (qmin, qmax, h)
