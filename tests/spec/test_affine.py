"""Affine offsets and unsigned values (docs/spec.md): calibration against an independent
oracle, the decode's two f32 operations (never fused), payload and params validity, and the ops
(reshape, permute, slice, cat, matmul) on reference and cuda. GGUF Q4_1 against gguf itself is in
test_formats_gguf.py; every backend against the reference in the conformance suite's `affine:*`
strata."""
from __future__ import annotations

import numpy as np
import pytest

import qcore
from qcore.spec import arithmetic as A
from qcore.errors import InputError, InvalidDataError, SchemeError, UnsupportedSchemeError
from qcore.spec.payload import QuantizedData
from qcore.backend.protocol import QParams
from tests.formats_util import get_backend

BACKENDS = ["reference", "cuda"]


def _x(shape, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * rng.uniform(0.1, 5, shape[:-1] + (1,)) + rng.uniform(-2, 2)).astype(np.float32)


def _zero_point_oracle(x: np.ndarray, block: int, qmin: int, qmax: int, dtype=np.float32):
    """compressed-tensors' asymmetric rule, written out per block in Python floats rounded to f32:
    the range widened to hold 0, s = (hi - lo) / (qmax - qmin) rounded UP to the scale dtype
    (qcore's v1 rule), z = clamp(qmin - round(lo / s)), q = clamp(round(x / s) + z)."""
    f32 = np.float32
    rows = x.reshape(-1, block)
    scales, zs, codes = [], [], []
    for r in rows:
        lo, hi = min(f32(r.min()), f32(0)), max(f32(r.max()), f32(0))
        s = f32(f32(hi - lo) / f32(qmax - qmin))
        st = np.nextafter(s.astype(dtype), np.inf, dtype=dtype) if s.astype(dtype).astype(f32) < s else s.astype(dtype)
        st = f32(st)
        z = 0 if st == 0 else int(min(max(qmin - np.rint(f32(lo / st)), qmin), qmax))
        q = [0 + z if st == 0 else int(min(max(np.rint(f32(v / st)) + z, qmin), qmax)) for v in r]
        scales.append(st)
        zs.append(z)
        codes.append(q)
    return np.array(scales, f32), np.array(zs, f32), np.array(codes)


@pytest.mark.parametrize("text,qmin,qmax,dt", [("q4f/block16:f32/zero", -8, 7, np.float32),
                                                ("u4/block16:f16/zero", 0, 15, np.float16),
                                                ("u8/block16:f32/zero", 0, 255, np.float32)])
def test_zero_point_calibration_against_an_oracle(text, qmin, qmax, dt):
    x = _x((6, 64), 1)
    x[0, :16] = np.abs(x[0, :16]) + 1   # all positive: the range still holds 0, z = qmin
    x[1, :16] = -np.abs(x[1, :16]) - 1  # all negative: z = qmax
    x[2, :16] = 0
    q = A.quantize(x, qcore.scheme(text))
    s, z, codes = _zero_point_oracle(x, 16, qmin, qmax, dt)
    assert np.array_equal(q.scales().reshape(-1), s)
    assert np.array_equal(q.offsets().reshape(-1), z)
    assert np.array_equal(q.codes().reshape(-1, 16).astype(np.int64), codes)
    assert z[0] == qmin and z[4] == qmax  # blocks 0 of rows 0 and 1


def test_min_offset_decode_is_two_roundings_never_a_fused_multiply_add(request):
    """f32(255 * (1 + 2^-23)) - 255 = 2^-15 (the product rounds first); an fma would give
    255 * 2^-23. Both backends, the GPU included, where `mul_rn` keeps the product apart."""
    s = qcore.scheme("u8/min:f32")
    payload = bytes([255]) + np.float32(1 + 2**-23).tobytes() + np.float32(-255).tobytes()
    d = QuantizedData((1,), s, payload)
    want = np.float32(np.float32(255 * np.float32(1 + 2**-23)) - np.float32(255))
    assert want == np.float32(2.0**-15) and want != np.float32(255 * 2.0**-23)
    for be_name in BACKENDS:
        be = get_backend(be_name, request)
        got = np.asarray(be.to_numpy(be.dequantize(be.from_data(d))))
        assert got.tobytes() == np.array([want], np.float32).tobytes(), be_name


def test_offsets_in_the_payload_are_validated():
    s = qcore.scheme("q4f/block32:f16/zero")
    base = bytes(16) + np.float16(0.5).tobytes()
    assert QuantizedData((32,), s, base + np.int8(-8).tobytes()).offsets().tolist() == [-8.0]
    with pytest.raises(InvalidDataError, match=r"zero points must lie in the value's range \[-8, 7\]"):
        QuantizedData((32,), s, base + np.int8(8).tobytes())
    m = qcore.scheme("u4/block32:f16/min:bf16")
    with pytest.raises(InvalidDataError, match="min offsets must be finite"):
        QuantizedData((32,), m, base + np.array([0x7FC0], "<u2").tobytes())
    with pytest.raises(InvalidDataError, match="must be 19 bytes"):
        QuantizedData((32,), s, base)


@pytest.mark.parametrize("be_name", BACKENDS)
def test_explicit_offsets(request, be_name):
    be = get_backend(be_name, request)
    x = _x((2, 32), 2)
    s = qcore.scheme("u4/block16:f32/min:f16")
    p = QParams(np.full((2, 2), 0.25, np.float32), None, np.array([[-1.0001, 0.0], [2.5, -3.0]], np.float32))
    got = be.into_data(be.quantize(x, s, params=p))
    ref = qcore.backend("reference").into_data(qcore.backend("reference").quantize(x, s, params=p))
    assert got.payload == ref.payload
    assert got.offsets().tolist() == [[np.float16(-1.0001), 0.0], [2.5, -3.0]]  # rounded into f16
    z = qcore.scheme("q4f/block16:f32/zero")
    for bad, why in ((None, "must give one offset per slot"), (np.zeros((2, 3)), "has shape"),
                     (np.full((2, 2), 0.5), "integers in \\[-8, 7\\]"), (np.full((2, 2), 8.0), "integers in"),
                     (np.full((2, 2), np.nan), "finite")):
        with pytest.raises(InputError, match=why):
            be.quantize(x, z, params=QParams(np.ones((2, 2), np.float32), None, bad))
    with pytest.raises(InputError, match="has no offsets"):
        be.quantize(x, "q4f/block16:f32", params=QParams(np.ones((2, 2), np.float32), None, np.zeros((2, 2))))
    with pytest.raises(InputError, match="takes the minmax statistic"):
        be.calibrate(x, z, method="absmean")


@pytest.mark.parametrize("be_name", BACKENDS)
@pytest.mark.parametrize("text", ["u4/block2x16:f16/min:f16", "q8f/block16:bf16/zero", "u2/block8:f32/packed_native/zero"])
def test_ops_carry_the_offsets(request, be_name, text):
    be = get_backend(be_name, request)
    ref = qcore.backend("reference")
    x = _x((4, 64), 3)
    q = be.quantize(x, text)
    y = np.asarray(be.to_numpy(be.dequantize(q)))
    assert np.array_equal(y, ref.dequantize(ref.quantize(x, text)))

    def deq(t):
        return np.asarray(be.to_numpy(be.dequantize(t)))

    assert np.array_equal(deq(be.reshape(q, (2, 2, 64))), y.reshape(2, 2, 64))
    assert np.array_equal(deq(be.slice(q, (slice(2, 4), slice(16, 48)))), y[2:4, 16:48])
    assert np.array_equal(deq(be.cat([q, q], axis=0)), np.concatenate([y, y]))
    if "x" not in text:
        assert np.array_equal(deq(be.permute(be.reshape(q, (2, 2, 64)), (1, 0, 2))), y.reshape(2, 2, 64).transpose(1, 0, 2))
    w = be.quantize(x.T.copy(), text)  # [64, 4] would split the blocks: a [K, N] weight of its own
    wf = np.asarray(be.to_numpy(be.dequantize(w)), np.float64)
    a = _x((3, 64), 4)
    got = np.asarray(be.to_numpy(be.matmul(a, w)), np.float64)
    want = a.astype(np.float64) @ wf
    assert np.allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(a).sum() * np.abs(wf).max())


def test_unsigned_values_need_an_offset_and_min_needs_unsigned():
    with pytest.raises(SchemeError, match="need an affine offset"):
        qcore.scheme("u4/block32:f16")
    with pytest.raises(SchemeError, match="needs an unsigned value"):
        qcore.scheme("q4f/block32:f16/min:f16")
    with pytest.raises(SchemeError, match="one scale level"):
        qcore.scheme("u4/block16:ue4m3/tensor:f32/zero")
    assert qcore.scheme("u4/block32:f16/min:f16").code_dtype == np.uint8
    assert str(qcore.scheme("q4_1")) == "u4/block32:f16/min:f16/round:rne/codes:offset"


def test_ndarray_runs_its_8_bit_values_with_zero_points_and_refuses_unsigned_ones():
    nd, ref = qcore.backend("ndarray"), qcore.backend("reference")
    x = _x((4, 64), 5)
    for text in ("q8f/block32:f32/zero", "q8s/block4x8:bf16/packed_u32/zero"):
        q = nd.quantize(x, text)
        assert nd.into_data(q) == ref.into_data(ref.quantize(x, text))
        assert np.array_equal(nd.to_numpy(nd.dequantize(q)), ref.dequantize(ref.quantize(x, text)))
        w = nd.quantize(x.T.copy(), text)
        assert np.array_equal(nd.matmul(x, w), ref.matmul(x, ref.from_data(nd.into_data(w))))
    sup = nd.supports("u8/block32:f32/min:f32")
    assert not sup and "does not declare the scheme feature unsigned" in sup.reason  # qcore.spec.features
    with pytest.raises(UnsupportedSchemeError):
        nd.quantize(np.ones((1, 32), np.float32), "u8/block32:f32/min:f32")
