"""The portable byte format (docs/spec.md, portable bytes): known-good payloads and validation of
untrusted bytes."""
import itertools

import numpy as np
import pytest

import qcore
from qcore import InvalidDataError, QuantizedData
from qcore.spec.payload import sections

NF4ISH = [-100, -10, -4, -2, -1, -.5, -.25, 0, .125, .25, .5, .75, 1, 2, 8, 42]


def test_q8s_native_known_payload():
    d = QuantizedData.from_parts((2, 3), qcore.scheme("q8s"), np.int8([0, 25, 51, 76, 102, 127]), np.float32(0.03937008))
    assert d.payload.hex(" ") == "00 19 33 4c 66 7f 85 42 21 3d"
    assert d.scales().shape == () and d.scales() == np.float32(0.03937008)


def test_two_level_known_payload():
    s = qcore.scheme("q8s/block4:ue4m3/tensor:f32")
    codes = np.int8([0, 25, 51, 76, 102, 127, -128, -1])
    d = QuantizedData.from_parts((8,), s, codes, np.float32([0.5, 0.125]), 3.0)
    assert len(d.payload) == 14
    assert d.payload[:8] == codes.tobytes()
    assert d.payload[8:10].hex(" ") == "30 20"
    assert d.payload[10:].hex(" ") == "00 00 40 40"
    assert d.global_scale() == 3.0
    np.testing.assert_array_equal(d.scales(), np.float32([0.5, 0.125]))


def test_q4s_packed_u32_element0_lowest_nibble():
    payload = np.array([0x0, 0x11111100], "<u4").tobytes() + np.float32(1).tobytes()
    d = QuantizedData((10,), "q4s", payload)
    np.testing.assert_array_equal(d.codes(), np.int8([0] * 10))  # ten elements: words hold 0..7 and 8..9
    d16 = QuantizedData((16,), "q4s", payload)
    np.testing.assert_array_equal(d16.codes(), np.int8([0] * 10 + [1] * 6))


def test_lookup_known_decode():
    payload = (np.array([0xFEDCBA98, 0x76543210], "<u4").tobytes() + np.float32(0.5).tobytes()
               + np.array(NF4ISH, "<f4").tobytes())
    d = QuantizedData((16,), "q4f-lookup", payload)
    assert d.scheme.table == tuple(float(np.float32(v)) for v in NF4ISH)
    y = qcore.backend("reference").from_data(d).numpy()
    np.testing.assert_array_equal(
        y, np.float32([0.0625, 0.125, 0.25, 0.375, 0.5, 1, 4, 21, -50, -5, -2, -1, -0.5, -0.25, -0.125, 0])
    )
    assert d.codes().dtype == np.uint8


def _random_codes(scheme, shape, rng):
    t = scheme.traits
    if scheme.is_lookup:
        return rng.integers(0, 1 << t.bits, shape).astype(np.uint8)
    if t.is_float:
        codes = rng.integers(0, 1 << t.bits, shape).astype(np.uint8)
        return codes
    return rng.integers(t.qmin, t.qmax + 1, shape).astype(scheme.code_dtype)


STORES = {8: ["native", "packed_u32", "packed_u32:1", "packed_u32:2"],
          4: ["packed_u32", "packed_u32:1", "packed_native", "packed_native:1", "packed_native:2"],
          2: ["packed_u32", "packed_u32:2", "packed_native", "packed_native:1"]}
PAIRS = [f"{v.value}{'-lookup' if lk else ''}/{st}" + ("/zero" if v.traits.unsigned else "")
         for v in qcore.QuantValue for lk in (False, True) if not (lk and (v.traits.is_float or v.traits.unsigned))
         for st in STORES[v.bits]]


@pytest.mark.parametrize("text", PAIRS)
@pytest.mark.parametrize("shape", [(3, 5, 33), (1, 1, 1), (2, 0, 7), (4, 9, 8)], ids=str)
def test_every_value_store_pair_round_trips_codes(text, shape):
    s = qcore.scheme(text)
    if s.is_lookup:
        s = s.with_mode("lookup", [float(i) for i in range(1 << s.bits)])
    rng = np.random.default_rng(abs(hash((text, shape))) % 2**32)
    codes = _random_codes(s, shape, rng)
    d = QuantizedData.from_parts(shape, s, codes, np.float32(0.25), offsets=np.float32(3) if s.affine else None)
    assert len(d.payload) == sections(shape, s).total
    np.testing.assert_array_equal(d.codes(), codes)
    assert d.codes().dtype == s.code_dtype
    # bytes -> data -> bytes is the identity
    assert QuantizedData(shape, str(s), d.payload).payload == d.payload


def test_packed_native_axis1_layout():
    """q4s/packed_native:1 on (3, 2): runs go down axis 0; element k of a run in bits [4k, 4k+4)."""
    s = qcore.scheme("q4s/packed_native:1")
    codes = np.int8([[1, 2], [3, 4], [5, -1]])
    d = QuantizedData.from_parts((3, 2), s, codes, np.float32(1))
    # words shape (ceil(3/2), 2) = (2, 2): [[1|3<<4, 2|4<<4], [5, 0xF]]
    assert d.payload[:4] == bytes([0x31, 0x42, 0x05, 0x0F])


@pytest.mark.parametrize(
    "text, shape, mutate, match",
    [
        ("q8s", (4,), lambda p: p[:-1], r"must be 8 bytes .* got 7"),
        ("q8s", (4,), lambda p: p + b"\0", r"must be 8 bytes .* got 9"),
        ("q8s", (4,), lambda p: p[:4] + np.float32(np.nan).tobytes(), r"scale slot 0 .* finite and >= 0"),
        ("q8s", (4,), lambda p: p[:4] + np.float32(-1).tobytes(), r"scale slot 0 .* finite and >= 0"),
        ("q8s", (4,), lambda p: p[:4] + np.float32(np.inf).tobytes(), r"scale slot 0"),
        ("q8s/block2:ue8m0", (4,), lambda p: p[:5] + b"\xff", r"scale slot 1 .*0xff"),
        ("q8s/block2:ue4m3", (4,), lambda p: p[:5] + b"\x7f", r"scale slot 1"),
        ("q8s/block2:ue4m3", (4,), lambda p: p[:5] + b"\xb0", r"scale slot 1"),
        ("q8s/block2:f16/tensor:f32", (4,), lambda p: p[:-4] + np.float32(np.nan).tobytes(), r"global scale"),
        ("q2s-lookup", (4,), lambda p: p[:-16] + np.float32([0, 2, 1, 3]).tobytes(), r"table .* strictly increasing"),
        ("q2s-lookup", (4,), lambda p: p[:-4], r"must be 24 bytes"),
    ],
)
def test_invalid_payloads(text, shape, mutate, match):
    s = qcore.scheme(text)
    if s.is_lookup:
        s = s.with_mode("lookup", [0, 1, 2, 3])
    d = QuantizedData.from_parts(shape, s, np.zeros(shape, s.code_dtype),
                                 np.ones(qcore.spec.layout.grid_shape(shape, s), np.float32),
                                 1.0 if s.two_level else None)
    with pytest.raises(InvalidDataError, match=match):
        QuantizedData(shape, text, mutate(d.payload))


def test_named_table_must_match_payload_table():
    s = qcore.scheme("nf4")
    d = QuantizedData.from_parts((64,), s, np.zeros(64, np.uint8), np.float32([1]))
    bad = d.payload[:-4] + np.float32(1.5).tobytes()
    with pytest.raises(InvalidDataError, match="differs from the named table"):
        QuantizedData((64,), "nf4", bad)


@pytest.mark.parametrize("shape, text, match", [
    ((), "q8s", "rank >= 1"), ((4,), "q8s/block2x2", "block 2x2 has 2 dims"),
    ((4,), "q4s/packed_u32:1", "packing axis 1"), ((4,), "q4s/blah", "payload scheme is not valid"),
])
def test_bad_shape_or_scheme_is_invalid_data(shape, text, match):
    with pytest.raises(InvalidDataError, match=match):
        QuantizedData(shape, text, b"")


def test_random_bytes_decode_without_crashing():
    """Decode fuzz (as gguf-py does): a right-length payload with valid scales decodes, or, when a
    code is outside the value's set (docs/spec.md, invalid codes), raises InvalidDataError naming it."""
    rng = np.random.default_rng(3)
    for text, shape in itertools.product(["e4m3/packed_u32", "e5m2", "q4f/packed_native:1", "q2s"], [(5, 7)]):
        s = qcore.scheme(text)
        sec = sections(shape, s)
        vals = rng.integers(0, 256, sec.values, dtype=np.uint8).tobytes()
        d = QuantizedData(shape, text, vals + np.float32(0.5).tobytes())
        q = qcore.backend("reference").from_data(d)
        if d.first_invalid_code() is not None:
            with pytest.raises(InvalidDataError, match=r"element \(\d+, \d+\) of"):
                q.numpy()
            continue
        y = q.numpy()
        assert y.shape == shape and np.isfinite(y).all()
