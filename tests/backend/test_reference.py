"""The spec's arithmetic (docs/spec.md, arithmetic) on the reference backend: calibration, two-level
scales, quantize/dequantize, errors."""
import ml_dtypes
import numpy as np
import pytest

import qcore
from qcore import InputError, QParams, SchemeError

ref = qcore.backend("reference")


def test_q8s_per_tensor_known_payload():
    x = np.float32([0, 1, 2, 3, 4, 5]).reshape(2, 3)
    q = ref.quantize(x, "q8s")
    d = q.to_data()
    np.testing.assert_array_equal(d.codes().reshape(-1), np.int8([0, 25, 51, 76, 102, 127]))
    assert d.scales() == np.float32(5) / np.float32(127)
    assert d.payload[:6].hex(" ") == "00 19 33 4c 66 7f"


def test_two_level_calibration_by_hand():
    x = np.float32([1, 2, 3, 4, 100, 0, 0, 0])
    s = "q8s/block4:ue4m3/tensor:f32"
    p = ref.calibrate(x, s)
    s_b = np.float32([4, 100]) / np.float32(127)
    g = np.float32(s_b.max() / np.float32(448))
    expected = qcore.spec.codecs.SCALES["ue4m3"].store((s_b / g).astype(np.float32))
    assert p.global_scale == float(g)
    np.testing.assert_array_equal(p.scales, expected)
    q = ref.quantize(x, s)
    e = (np.float32(g) * expected).astype(np.float32)
    want = np.clip(np.rint(x / np.repeat(e, 4)), -127, 127).astype(np.int8)
    np.testing.assert_array_equal(q.to_data().codes(), want)


def test_two_level_all_zero_global_floor():
    p = ref.calibrate(np.zeros(32, np.float32), "nvfp4")
    assert p.global_scale == float(np.float32(1.17549435e-38))
    np.testing.assert_array_equal(p.scales, np.zeros(2, np.float32))


def test_partial_edge_blocks_and_grid_shape():
    x = np.arange(5 * 7, dtype=np.float32).reshape(5, 7) - 17
    p = ref.calibrate(x, "q8s/block2x3:f32")
    assert p.scales.shape == (3, 3)
    assert p.scales[2, 2] == np.float32(np.abs(x[4:, 6:]).max()) / np.float32(127)


def test_absmean_uses_float64_sum_and_true_counts():
    x = np.float32([1, -2, 3, 10])
    p = ref.calibrate(x, "q8s/block3", method="absmean")
    np.testing.assert_array_equal(p.scales, np.float32([2, 10]) / np.float32(127))


def test_lookup_nearest_ties_lower_and_zero_scale():
    s = qcore.QuantScheme(qcore.QuantValue.Q2S).with_mode("lookup", [-1, 0, 1, 2])
    x = np.float32([0.5, 1.5, -0.5, 3, -7])
    q = ref.quantize(x, s, params=QParams(np.float32(1)))
    np.testing.assert_array_equal(q.to_data().codes(), np.uint8([1, 2, 0, 3, 0]))
    z = ref.quantize(x, s, params=QParams(np.float32(0)))
    np.testing.assert_array_equal(z.to_data().codes(), np.uint8([1] * 5))  # entry nearest 0


def test_nf4_preset_round_trip():
    x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    q = ref.quantize(x, "nf4")
    y = q.numpy()
    assert np.abs(y - x).max() <= np.abs(x).max() * 0.2


@pytest.mark.parametrize("value", ["e4m3", "e5m2", "e2m1", "q4s", "q2f"])
def test_zero_scale_gives_plus_zero_codes(value):
    x = np.float32([-1, 0, 3])
    q = ref.quantize(x, value, params=QParams(np.float32(0)))
    assert np.all(q.to_data().codes() == 0)
    np.testing.assert_array_equal(q.numpy(), np.zeros(3, np.float32))


def test_negative_zero_input_keeps_minifloat_sign():
    q = ref.quantize(np.float32([-0.0, 1.0]), "e4m3")
    assert q.to_data().codes()[0] == 0x80


def test_e4m3_saturation_with_explicit_scale():
    x = np.float32([300, 449, -449, 1e4, -1e4, 1e30, -1e30])
    y = ref.quantize(x, "e4m3", params=QParams(np.float32(1))).numpy()
    np.testing.assert_array_equal(y, np.float32([288, 448, -448, 448, -448, 448, -448]))


def test_explicit_params_are_rounded_up_like_calibrated():
    q = ref.quantize(np.float32([1, 2]), "q8s/tensor:ue8m0", params=QParams(np.float32(0.3)))
    assert q.to_data().scales() == np.float32(0.5)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32, np.float64])
def test_input_dtypes_convert_to_f32_first(dtype):
    x = np.float32([0.1, -0.7, 3.3]).astype(dtype)
    a = ref.quantize(x, "q8s/block2:f16").to_data()
    b = ref.quantize(x.astype(np.float32), "q8s/block2:f16").to_data()
    assert a == b


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32, np.float64])
def test_dequantize_dtypes(dtype):
    q = ref.quantize(np.float32([0.1, -0.7, 3.3]), "q8s")
    y = q.dequantize(dtype)
    assert y.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(y, q.dequantize().astype(dtype))


def test_empty_tensors():
    for text in ["q8s", "q4s/block32:f16", "nvfp4", "q2s/packed_u32:1"]:
        x = np.zeros((0, 3, 64), np.float32)
        q = ref.quantize(x, text)
        assert q.numpy().shape == (0, 3, 64)
        assert ref.from_data(q.to_data()).to_data() == q.to_data()


@pytest.mark.parametrize(
    "x, text, kwargs, match",
    [
        (np.float32([1, np.nan, 2]), "q8s", {}, r"nan at index \(1,\)"),
        (np.float32([[1, 2], [np.inf, 0]]), "q4s/block2:f16", {}, r"inf at index \(1, 0\)"),
        (np.float32(3.0), "q8s", {}, r"rank >= 1"),
        (np.int32([1, 2]), "q8s", {}, r"input dtype int32 cannot be quantized"),
        (np.float32([1, 2]), "q8s/block2x2", {}, r"block 2x2 has 2 dims but the tensor has rank 1"),
        (np.float32([1, 2]), "q4s/packed_u32:1", {}, r"packing axis 1 .* needs rank > 1"),
        (np.float32([1, 2]), "q8s", {"method": "mse"}, r"unknown calibration method 'mse'"),
        (np.float32([1, 2]), "q8s", {"params": QParams(np.float32(np.nan))}, r"finite and >= 0"),
        (np.float32([1, 2]), "q8s", {"params": QParams(np.float32(-1))}, r"finite and >= 0"),
        (np.float32([1, 2]), "q8s/block1", {"params": QParams(np.float32([1]))}, r"block grid \(2,\)"),
        (np.float32([1, 2]), "q8s/block1:f16/tensor:f32", {"params": QParams(np.float32([1, 1]))}, r"global_scale must be a finite float"),
        (np.float32([1, 2]), "q8s", {"params": QParams(np.float32(1), 2.0)}, r"global_scale must be None"),
        ("text", "q8s", {}, r"cannot read a str"),
    ],
)
def test_input_errors(x, text, kwargs, match):
    with pytest.raises(InputError, match=match):
        ref.quantize(x, text, **kwargs)


def test_input_untouched():
    x = np.float32([1.5, -2.25, 3.0])
    before = x.copy()
    ref.quantize(x, "q4s/block2:f16")
    np.testing.assert_array_equal(x, before)


def test_custom_lookup_from_text_cannot_quantize():
    with pytest.raises(SchemeError, match="custom table"):
        ref.quantize(np.float32([1, 2]), "q4s-lookup")


def test_qtensor_surface():
    x = np.random.default_rng(1).standard_normal((4, 40)).astype(np.float32)
    q = qcore.quantize(x, "q4s/block32:f16", backend="reference")
    assert q.shape == (4, 40) and q.backend.name == "reference" and str(q.scheme) == "q4s/block32:f16"
    assert q.nbytes == len(q.to_data().payload) == 4 * 5 * 4 + 4 * 2 * 2  # 5 u32 words per row of 40, 2 f16 scales
    assert q.to("reference").to_data() == q.to_data()
    np.testing.assert_array_equal(qcore.dequantize(q), q.numpy())
    assert "q4s/block32:f16" in repr(q)


def test_lookup_far_outside_table_saturates_to_the_nearest_end():
    s = qcore.scheme("nf4")
    x = np.float32([1.0, 3.0, -2.0] + [0.0] * 61)
    q = ref.quantize(x, s, params=QParams(np.float32([1e-8])))
    assert list(q.to_data().codes()[:3]) == [15, 15, 0]
