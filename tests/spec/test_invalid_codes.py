"""Invalid codes (docs/spec.md): a payload holding a value code outside its value's set (Q8S/Q4S/Q2S
below qmin, E4M3/E5M2 NaN/Inf) raises `InvalidDataError` naming the first bad element, no later
than the first dequantize, on every backend; the backend stays usable and clean payloads still
decode.

The cuda cases run on the simulator with tiny shapes and cover its three dequantize kernels
(the fast kernel, the row kernel and the general one), each checked to have run.
"""
from __future__ import annotations

import numpy as np
import pytest

import qcore
from qcore import InvalidDataError, QuantizedData
from qcore.spec import layout
from qcore.backend.reference import ReferenceBackend

REF = ReferenceBackend()

# (scheme, bad field) per value with invalid codes; and values without any
BAD_FIELD = {"q8s": 0x80, "q4s": 0x8, "q2s": 0x2, "e4m3": 0x7F, "e5m2": 0x7C}
E4M3_NEG_NAN, E5M2_NAN = 0xFF, 0x7D


def _with_code(d: QuantizedData, index: tuple[int, ...], field: int) -> QuantizedData:
    """`d` with element `index` set to stored field `field` (through the core's pack)."""
    codes = d.codes().view(np.uint8).copy()
    codes[index] = field
    sch = d.scheme
    values = layout.pack(codes.view(sch.code_dtype), sch).tobytes()
    return QuantizedData(d.shape, sch, values + d.payload[len(d.values_bytes()):])


def _data(text: str, shape: tuple[int, ...]) -> QuantizedData:
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    return REF.quantize(x, text).to_data()


def test_valid_field_tables():
    """The value rows state exactly the codes quantize can write."""
    for name, bad in BAD_FIELD.items():
        s = qcore.scheme(name)
        assert not s.valid_fields[bad]
        assert s.valid_fields[0]
    assert qcore.scheme("e4m3").valid_fields.sum() == 254  # 256 minus +-NaN
    assert qcore.scheme("e5m2").valid_fields.sum() == 256 - 8  # exponent 31: +-Inf, 3 NaNs each
    for name in ("q8f", "q4f", "q2f", "e2m1", "nf4", "q4s-lookup[nf4]"):
        assert qcore.scheme(name).valid_fields.all(), name


def test_quantize_never_writes_invalid_codes():
    """Extremes, zeros, negative zero and huge/tiny values all give valid codes."""
    x = np.array([[0.0, -0.0, 1e-30, -1e-30, 3e38, -3e38, 1.0, -1.0]], dtype=np.float32)
    for text in ["q8s", "q4s", "q2s", "e4m3", "e5m2", "q8s/block2:ue8m0", "e4m3/block4:ue4m3/tensor:f32"]:
        assert REF.quantize(x, text).to_data().first_invalid_code() is None, text


CPU_CASES = [("reference", t) for t in ("q8s", "q4s/block8:f16", "q2s/packed_u32:1", "e4m3/native",
                                         "e5m2/block4:bf16", "q4s/packed_native", "e4m3/block8:ue8m0")]
CPU_CASES += [("ndarray", t) for t in ("q8s", "q8s/block4:f16", "q8s/block2x4:f16/tensor:f32", "q8s/packed_u32:1",
                                       "q8s/tensor:ue8m0")]  # ndarray: 8-bit integer values only


@pytest.mark.parametrize("backend,text", CPU_CASES, ids=[f"{b}-{t}" for b, t in CPU_CASES])
def test_cpu_backends_name_the_first_bad_element(text, backend):
    be = qcore.backend(backend)
    d = _data(text, (3, 8))
    value = text.split("/")[0]
    field = BAD_FIELD[value]
    bad = _with_code(_with_code(d, (2, 6), field), (1, 5), E4M3_NEG_NAN if value == "e4m3" else field)
    assert bad.first_invalid_code() == (1, 5)
    q = be.from_data(bad)
    with pytest.raises(InvalidDataError, match=r"element \(1, 5\) of .* holds code 0x[0-9a-f]+"):
        q.numpy()
    with pytest.raises(InvalidDataError):  # and again: no state was left behind
        q.numpy()
    assert np.array_equal(be.from_data(d).numpy(), REF.from_data(d).numpy())


def test_padding_bits_are_not_elements():
    """The unused fields of a padded word may hold anything (docs/spec.md, invalid codes)."""
    d = _data("q4s", (2, 3))  # 3 of 8 fields of each word used
    raw = bytearray(d.payload)
    raw[3] = 0x88  # fields 6, 7 of row 0: padding
    padded = QuantizedData(d.shape, d.scheme, bytes(raw))
    assert padded.first_invalid_code() is None
    assert np.array_equal(REF.from_data(padded).numpy(), REF.from_data(d).numpy())


def test_lookup_indices_are_all_valid():
    """LOOKUP payloads (reference and the lutcpu plugin) have no invalid codes: every index names
    a table entry, so every byte pattern decodes to finite values."""
    d = _data("nf4", (2, 64))
    raw = bytearray(d.payload)
    raw[: len(d.values_bytes())] = bytes(range(len(d.values_bytes())))
    every = QuantizedData(d.shape, d.scheme, bytes(raw))
    for name in ("reference", "lutcpu"):
        try:
            be = qcore.backend(name)
        except qcore.BackendNotFoundError:
            continue
        assert np.isfinite(be.from_data(every).numpy()).all()


def test_empty_tensor_has_no_codes_to_check():
    d = QuantizedData((1 << 40, 0), "q8s", np.float32(1.0).tobytes())
    assert d.first_invalid_code() is None


# ------------------------------------------------------------------------------ cuda (simulator)
# (scheme, shape, which kernel): the fast kernel (rows of 16k, power-of-two blocks), the row
# kernel (blocks splitting the last axis only), and the general kernel (2-D block, packing axis 1)
CUDA_CASES = [
    ("q8s/block16:f16", (2, 32), "fast"),
    ("e4m3", (2, 16), "fast"),
    ("q4s/block8:f32", (3, 8), "rows"),
    ("e5m2/block4:bf16", (3, 12), "rows"),
    ("q2s/block2x4:f32/packed_u32:1", (4, 4), "general"),
    ("e4m3/block2x2:ue8m0/native", (4, 6), "general"),
]


@pytest.mark.parametrize("text,shape,path", CUDA_CASES, ids=[f"{c[0]}-{c[2]}" for c in CUDA_CASES])
def test_cuda_flags_invalid_codes_in_its_kernels(cuda_backend, monkeypatch, text, shape, path):
    from qcore_cuda import fast
    from qcore_cuda import kernels as K

    ran = []

    def spy(name, real):
        class Spy:
            def __getitem__(self, cfg):
                launch = real[cfg]

                def go(*a):
                    ran.append(name)
                    return launch(*a)
                return go
        return Spy()

    monkeypatch.setattr(K, "k_dequant", spy("general", K.k_dequant))
    monkeypatch.setattr(K, "k_rows_dequant", spy("rows", K.k_rows_dequant))
    real_fast = fast.dequant_kernel
    monkeypatch.setattr(fast, "dequant_kernel", lambda *a: (ran.append("fast"), real_fast(*a))[1])

    d = _data(text, shape)
    value = text.split("/")[0]
    idx = (shape[0] - 1, shape[1] - 2)
    bad = _with_code(d, idx, E5M2_NAN if value == "e5m2" else BAD_FIELD[value])
    q = cuda_backend.from_data(bad)
    with pytest.raises(InvalidDataError, match=rf"element \({idx[0]}, {idx[1]}\) of"):
        q.numpy()
    assert path in ran, (path, ran)
    with pytest.raises(InvalidDataError):
        q.numpy(np.float16)
    # the backend stays usable, and a clean tensor decodes bit for bit
    assert np.array_equal(cuda_backend.from_data(d).numpy(), REF.from_data(d).numpy())


def test_cuda_kernels_keep_their_ptx_signatures():
    """The dequantize kernels gained the flag argument in their compiled signatures too (the
    sm_90 compile of every signature is tests/cuda/test_cuda_platform.py::test_kernels_compile_for_sm90)."""
    pytest.importorskip("qcore_cuda")
    from qcore_cuda import fast
    from qcore_cuda import kernels as K

    assert all(sig.endswith("int32[::1])") for sig in K.SIGNATURES["k_dequant"] + K.SIGNATURES["k_rows_dequant"])
    assert fast.DEQUANT_SIG.endswith("int32[::1])")


# ------------------------------------------------------------------------------ the conformance check
class DecodesAnything(ReferenceBackend):
    """A backend that forgot the spec's invalid codes (docs/spec.md): it decodes them."""

    name = "decodes-anything"

    def _dequantize(self, data, dtype):
        with np.errstate(invalid="ignore"):
            x = qcore.spec.arithmetic.decode(data.codes(), data.scheme)
            e = qcore.spec.arithmetic.effective_scale(qcore.QParams(data.scales(), data.global_scale()), data.shape,
                                                data.scheme)
            return (x * e).astype(dtype)


@pytest.mark.parametrize("text", ["q8s", "q4s/block4:f16", "e4m3", "e5m2/block2x2:bf16", "q2s/packed_native"])
def test_conformance_check_invalid_codes(text):
    from qcore.conformance.cases import Case
    from qcore.conformance.checks import ConformanceFailure
    from qcore.conformance.checks import check_invalid_codes

    case = Case(text, (3, 4))
    check_invalid_codes(REF, case)  # the reference conforms
    with pytest.raises(ConformanceFailure, match=r"decoded without InvalidDataError \(docs/spec.md, invalid codes\)"):
        check_invalid_codes(DecodesAnything(), case)


def test_conformance_random_payloads_hold_only_valid_codes():
    from qcore.conformance.cases import Case
    from qcore.conformance.checks import random_payload

    for text in ("q8s", "q4s/packed_u32:1", "e4m3/block4:ue8m0", "e5m2", "q2s/block2:f16/packed_native"):
        for seed in range(5):
            d = random_payload(Case(text, (5, 7), seed=seed))
            assert d.first_invalid_code() is None, (text, seed)
