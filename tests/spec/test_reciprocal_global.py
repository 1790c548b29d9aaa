"""The reciprocal global scale (`tensor:f32:recip`, docs/spec.md): the two-level global stored
as `G = 1 / g`, effective scale `s_b / G`, as compressed-tensors' NVFP4 stores it."""
from __future__ import annotations

import numpy as np
import pytest

import qcore
from qcore import InputError, InvalidDataError, QParams, SchemeError

REF = qcore.backend("reference")
NVFP4R = "e2m1/block16:ue4m3/tensor:f32:recip/packed_native"


def _x(shape=(8, 64), seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * np.exp(rng.uniform(-4, 4, (shape[0], 1)))).astype(np.float32)


def test_text_and_validation():
    s = qcore.scheme(NVFP4R)
    assert s.reciprocal_global and str(s) == NVFP4R and qcore.scheme(str(s)) == s
    assert s != qcore.scheme("nvfp4") and s.payload_form == s  # a different decode: not a rule
    assert qcore.scheme("nvfp4").per_tensor("f32", reciprocal=True) == s
    with pytest.raises(SchemeError, match="needs a block level under it"):
        qcore.scheme("q8s/tensor:f32:recip")


def test_calibration_follows_compressed_tensors_arithmetic():
    """G = f32(448 * 6) / amax; block scale f32(G * f32(amax_b / 6)) rounded into UE4M3; effective
    scale f32(s_b / G): written out here in numpy, step by step."""
    x = _x()
    s = qcore.scheme(NVFP4R + "/round:rne")
    p = REF.calibrate(x, s)
    amax = np.float32(np.abs(x).max())
    G = np.float32(np.float32(448.0 * 6.0) / amax)
    assert np.float32(p.global_scale) == G
    stat = np.abs(x).reshape(8, 4, 16).max(-1).astype(np.float32)
    raw = (G * (stat / np.float32(6.0)).astype(np.float32)).astype(np.float32)
    import ml_dtypes

    want = raw.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)  # nearest even, as the tool casts
    assert np.array_equal(p.scales, want)
    d = REF.into_data(REF.quantize(x, s))
    e = (d.scales() / np.float32(d.global_scale())).astype(np.float32)
    codes = d.codes().reshape(8, 4, 16)
    lut = np.float32([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])
    y = (lut[codes] * e[..., None]).astype(np.float32).reshape(8, 64)
    assert np.array_equal(np.asarray(REF.dequantize(REF.from_data(d))).view(np.uint32), y.view(np.uint32))


def test_all_zero_and_empty_tensors_take_g_one():
    for x in (np.zeros((2, 32), np.float32), np.zeros((0, 32), np.float32)):
        d = REF.into_data(REF.quantize(x, NVFP4R))
        assert d.global_scale() == 1.0


def test_a_zero_reciprocal_global_is_invalid():
    d = REF.into_data(REF.quantize(_x(), NVFP4R))
    bad = d.payload[:-4] + np.float32(0).tobytes()
    with pytest.raises(InvalidDataError, match="must be > 0"):
        qcore.QuantizedData(d.shape, NVFP4R, bad)
    with pytest.raises(InputError, match="must be > 0"):
        REF.quantize(_x(), NVFP4R, params=QParams(np.ones((8, 4), np.float32), 0.0))


@pytest.mark.parametrize("text", ["q8s/block32:f16/tensor:f32:recip", "q8f/block16:ue4m3/tensor:f32:recip/round:rne",
                                  "q8s/block4x8:ue4m3/tensor:f32:recip/packed_u32"])
def test_ndarray_matches_the_reference(text):
    nd = qcore.backend("ndarray")
    x = _x((16, 64), seed=3)
    d = REF.into_data(REF.quantize(x, text))
    assert nd.into_data(nd.quantize(x, text)).payload == d.payload
    assert np.array_equal(nd.dequantize(nd.from_data(d)), REF.dequantize(REF.from_data(d)))


CUDA_CASES = [(NVFP4R + "/round:rne", (4, 64)),  # the fast kernels (codes along the last axis), GEMV
              ("q8s/block32:f16/tensor:f32:recip", (6, 64)),  # the fast kernels, 8-bit codes
              ("q4f/block4x8:ue4m3/tensor:f32:recip/packed_u32:1", (6, 40))]  # the general kernels


@pytest.mark.parametrize("text,shape", CUDA_CASES, ids=[t for t, _ in CUDA_CASES])
def test_cuda_matches_the_reference(cuda_backend, text, shape):
    """Calibrated and explicit quantize, dequantize, from_data and matmul on the cuda paths: the
    reference's bytes and values (the conformance suite covers every layout on a GPU)."""
    be = cuda_backend
    s = qcore.scheme(text)
    x = _x(shape, seed=len(text))
    d = REF.into_data(REF.quantize(x, text))
    assert be.into_data(be.quantize(x, text)).payload == d.payload
    p = REF.calibrate(x, text)
    assert be.into_data(be.quantize(x, text, params=p)).payload == d.payload
    want = np.asarray(REF.dequantize(REF.from_data(d)))
    assert np.array_equal(be.to_numpy(be.dequantize(be.from_data(d))).view(np.uint32), want.view(np.uint32))
    if s.block is not None and len(s.block.dims) == 1:
        xm = _x((2, shape[0]), seed=9)
        got = be.to_numpy(be.matmul(xm, be.from_data(d)))
        np.testing.assert_allclose(got, xm @ want, rtol=2e-5, atol=1e-5 * float(np.abs(xm @ want).max()))


@pytest.mark.parametrize("m", [1, 4])
def test_cuda_matmul_paths_divide_by_the_global(cuda_backend, m):
    """The GEMV (M = 1) and tensor-core (M = 4 on a GPU) matmul kernels with a reciprocal global:
    within the suite's matmul bound of x @ dequantize(w)."""
    be = cuda_backend
    w = _x((64, 64), seed=11)
    d = REF.into_data(REF.quantize(w, "q8s/block32:f16/tensor:f32:recip"))
    wq = np.asarray(REF.dequantize(REF.from_data(d)), np.float64)
    x = _x((m, 64), seed=12)
    got = be.to_numpy(be.matmul(x, be.from_data(d))).astype(np.float64)
    want = x.astype(np.float64) @ wq
    bound = 64 * np.finfo(np.float32).eps * (np.abs(x).astype(np.float64) @ np.abs(wq))
    assert np.all(np.abs(got - want) <= bound + 1e-30)
