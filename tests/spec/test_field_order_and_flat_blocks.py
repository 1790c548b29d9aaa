"""Field orders and blocks over the flattened tensor (docs/spec.md): the text form and
its refusals, the field rule against independent statements of the formats' layouts (GGUF's
split halves, bitsandbytes' high-first nibbles), the cuda field-order kernel against the
reference's re-packing, the flattened bytes against the 1-D tensor's, and every backend against the
reference (payload bytes, decode, explicit params, ops, matmul, invalid codes named in the
tensor's own shape). The conformance suite's `order:*` and `flat/*` strata check the rest."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import qcore
from qcore.spec import layout
from qcore.errors import InputError, InvalidDataError, SchemeError
from qcore.spec.payload import QuantizedData
from qcore.backend.protocol import QParams
from qcore.spec.schemes import FieldOrder, PackedNative, PackedU32, QuantScheme, QuantValue, ScaleDtype
from tests.formats_util import get_backend

REF = qcore.backend("reference")


def _x(shape, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * rng.uniform(0.1, 4, shape[:-1] + (1,))).astype(np.float32)


# ----------------------------------------------------------------------------- text form

@pytest.mark.parametrize("text", [
    "q4s/order:high", "q4s/packed_native/order:split32", "q2s/packed_u32:1/order:split32",
    "q8s/packed_u32/order:high", "q4f/block32:f16/packed_native/order:split32/signed/round:rne/codes:offset",
    "q8s/block64:f32:flat", "q4s-lookup[nf4]/block64:f32:flat/packed_native/order:high",
    "e2m1/block16:ue4m3:flat/tensor:f32:recip/packed_native",
])
def test_text_round_trips(text):
    s = qcore.scheme(text)
    assert str(s) == text and qcore.scheme(str(s)) == s


@pytest.mark.parametrize("text,want", [
    ("q4_0/packed_native/order:split32", "q4f/block32:f16/packed_native/order:split32/signed/round:rne/codes:offset"),
    ("nf4/block64:f32:flat/packed_native/order:high", "q4s-lookup[nf4]/block64:f32:flat/packed_native/order:high"),
    ("nf4/block128:f32", "q4s-lookup[nf4]/block128:f32"),
    ("mxfp4/round:mx", "e2m1/block32:ue8m0/packed_native/round:mx"),
])
def test_a_preset_takes_more_parts(text, want):
    assert str(qcore.scheme(text)) == want


def test_a_preset_part_given_twice_is_refused():
    with pytest.raises(SchemeError, match="given twice"):
        qcore.scheme("nf4/round:rne/round:up")


def test_builders_and_defaults():
    s = QuantScheme(QuantValue.Q4S).per_block([64], ScaleDtype.F32, flat=True).with_store(PackedNative(0, "high"))
    assert str(s) == "q4s/block64:f32:flat/packed_native/order:high"
    assert s.unflat == qcore.scheme("q4s/block64:f32/packed_native/order:high")
    assert s.low_order == qcore.scheme("q4s/block64:f32:flat/packed_native")
    assert qcore.scheme("q4s/order:low") == qcore.scheme("q4s")  # the byte layout's order is the default
    assert qcore.scheme("q4s/block32:flat") == qcore.scheme("q4s/block32:f32:flat")
    assert qcore.scheme("q4s").with_field_order("split", 16) == QuantScheme(QuantValue.Q4S).with_store(
        PackedU32(0, FieldOrder.SPLIT, 16))


@pytest.mark.parametrize("text,needle", [
    ("q8s/order:high", "packed store"),
    ("q4s/order:split8", "multiple of 8 from 16"),
    ("q4s/packed_native/order:split3", "multiple of 2"),
    ("q4s/order:split", "names its group"),
    ("q4s/order:high16", "names its group"),
    ("q4s/order:sideways", "unknown part"),
    ("q4s/block4x8:f32:flat", "one dim"),
    ("q4s/block32:f32:flat/packed_u32:1", "packing axis is 0"),
    ("q4s/order:high/order:high", "given twice"),
])
def test_invalid_text_is_refused(text, needle):
    with pytest.raises(SchemeError, match=needle):
        qcore.scheme(text)


# ----------------------------------------------------------------------------- the field rule

@pytest.mark.parametrize("n,group", [(2, 4), (2, 32), (4, 16), (8, 16), (8, 24), (16, 32)])
@pytest.mark.parametrize("extent", [1, 2, 7, 31, 32, 33, 64, 95])
def test_field_positions_place_every_element_once(n, group, extent):
    for order, g in ((FieldOrder.LOW, 0), (FieldOrder.HIGH, 0), (FieldOrder.SPLIT, group)):
        pos = layout.field_positions(extent, n, order, g)
        assert pos.shape == (-(-extent // n), n)
        real = pos[pos < extent]
        assert sorted(real.tolist()) == list(range(extent))  # a permutation, padding apart
        assert (pos == extent).sum() == pos.size - extent


def test_split32_is_ggufs_block_layout():
    """GGUF Q4_0 / Q4_1 / MXFP4: in each block of 32, byte j holds element j (low nibble) and
    element j + 16 (high nibble)."""
    codes = np.random.default_rng(0).integers(-8, 8, (3, 96)).astype(np.int8)
    got = layout.pack(codes, qcore.scheme("q4s/packed_native/order:split32"))
    u = (codes.astype(np.uint8) & 0xF).reshape(3, 3, 2, 16)
    want = (u[:, :, 0, :] | (u[:, :, 1, :] << 4)).reshape(-1)
    assert np.array_equal(got, want)


def test_high_is_bitsandbytes_nibbles():
    """bitsandbytes: element 2k in the high nibble of byte k (and a last half byte zero)."""
    codes = np.random.default_rng(1).integers(0, 16, 9).astype(np.uint8)
    s = qcore.scheme("q4s-lookup[nf4]/packed_native/order:high")
    padded = np.append(codes, 0)
    assert np.array_equal(layout.pack(codes, s), (padded[0::2] << 4) | padded[1::2])
    assert np.array_equal(layout.unpack(layout.pack(codes, s), (9,), s), codes)


def test_split_with_a_partial_last_group():
    """A line of 20 under split16 in bytes: a group of 16 (8 words: j, j + 8) and one of 4
    (2 words: j, j + 2)."""
    pos = layout.field_positions(20, 2, FieldOrder.SPLIT, 16)
    assert pos.tolist() == [[j, j + 8] for j in range(8)] + [[16, 18], [17, 19]]
    pos = layout.field_positions(19, 2, FieldOrder.SPLIT, 16)  # 3 left: 2 words, one pad field
    assert pos[-2:].tolist() == [[16, 18], [17, 19]]


REORDER_SCHEMES = [
    "q4s/block16:f16/packed_native/order:split32", "q4s/packed_native/order:high", "q4s/order:split24",
    "q4s/order:high", "q2s/packed_native:1/order:split8", "q2s/packed_u32/order:split48", "q8s/packed_u32/order:split8",
    "q8s/packed_u32:1/order:high", "e2m1/block16:ue4m3/tensor:f32/packed_native/order:split16",
]
REORDER_CASES = [(t, sh) for t in REORDER_SCHEMES for sh in [(3, 37), (5, 3, 20), (3, 64), (1,)]
                 if qcore.scheme(t).store.dim < len(sh)]  # the packing axis within the shape


@pytest.mark.parametrize("text,shape", REORDER_CASES, ids=[f"{t}-{'x'.join(map(str, sh))}" for t, sh in REORDER_CASES])
def test_cuda_reorder_kernel_moves_fields_as_the_reference_does(text, shape, request):
    """`k_reorder` both ways between the byte layout's order and the scheme's (whole and partial groups,
    packing axes 0 and 1, bytes and u32 words, a values section that ends inside a u32 and one
    shorter than a u32), the bytes after the values copied, against `layout.reorder_values`."""
    be = get_backend("cuda", request)
    from numba import cuda

    s = qcore.scheme(text)
    d = REF.quantize(_x(shape, 2), s).to_data()
    low = d.in_low_order()
    for src, dst in ((low, d), (d, low)):
        out = cuda.to_device(np.full(len(src.payload), 0xAB, np.uint8))
        be.launch_reorder(cuda.to_device(np.frombuffer(src.payload, np.uint8).copy()), out, shape, src.scheme,
                           dst.scheme)
        assert out.copy_to_host().tobytes() == dst.payload


# ----------------------------------------------------------------------------- flattened blocks

@pytest.mark.parametrize("text", ["q4s/block64:f32:flat/packed_native/order:high", "q8s/block32:f16:flat",
                                  "e2m1/block16:ue4m3:flat/tensor:f32/packed_native", "q4s/block8:f16:flat"])
@pytest.mark.parametrize("shape", [(3, 37), (5, 64), (2, 3, 8), (70,)])
def test_flat_bytes_are_the_flattened_tensors(text, shape):
    s = qcore.scheme(text)
    x = _x(shape, 3)
    d = REF.quantize(x, s).to_data()
    flat = REF.quantize(x.reshape(-1), s.unflat).to_data()
    assert d.payload == flat.payload
    assert d.scales().shape == layout.grid_shape(shape, s) == (-(-x.size // s.block.dims[0]),)
    assert d.codes().shape == shape
    f_shape, f_scheme = layout.flat_form(shape, s)
    if f_shape == shape:  # rows of whole blocks, words and groups: also the 2-D scheme's bytes
        assert REF.quantize(x, f_scheme).to_data().payload == d.payload
        assert len(shape) == 1 or shape[-1] % s.block.dims[0] == 0


def test_flat_explicit_params_take_the_flat_grid():
    s = qcore.scheme("q4s/block16:f32:flat")
    x = _x((4, 32), 4)
    p = REF.calibrate(x, s)
    assert p.scales.shape == (8,)
    assert REF.quantize(x, s, params=p).to_data() == REF.quantize(x, s).to_data()
    with pytest.raises(InputError, match="block grid"):
        REF.quantize(x, s, params=QParams(p.scales.reshape(4, 2)))


# ----------------------------------------------------------------------------- every backend

CASES = [  # (scheme, backends beside reference that run its value)
    ("q4s/block32:f16/packed_native/order:split32", ("cuda",)),
    ("q4s/block16:f16/order:split16", ("cuda",)),
    ("q2s/packed_u32:1/order:split32", ("cuda",)),
    ("q4f/block32:f16/packed_native/order:split32/signed/round:rne/codes:offset", ("cuda",)),
    ("u4/block32:f16/packed_native/order:split32/min:f16/round:rne/codes:offset", ("cuda",)),
    ("e2m1/block16:ue4m3/tensor:f32/packed_native/order:high", ("cuda",)),
    ("q8s/packed_u32/order:high", ("cuda", "ndarray")),
    ("q8s/block64:f32:flat", ("cuda", "ndarray")),
    ("q8s/block32:f16:flat/packed_u32/order:split8", ("cuda", "ndarray")),
    ("q4s/block64:f32:flat/packed_native/order:high", ("cuda",)),
    ("q4s-lookup[nf4]/block64:f32:flat/packed_native/order:high", ("lutcpu",)),
]


BACKEND_CASES = [(text, name) for text, backends in CASES for name in backends]


@pytest.mark.parametrize("text,name", BACKEND_CASES, ids=[f"{n}-{t}" for t, n in BACKEND_CASES])
def test_backends_write_and_read_the_references_bytes(text, name, request):
    be = get_backend(name, request)
    s = qcore.scheme(text)
    assert be.supports(s)
    for shape in [(3, 37), (4, 64)] + ([(70,)] if s.store.dim == 0 and name != "cuda" else []):
        x = _x(shape, 5)
        want = REF.quantize(x, s).to_data()
        ref_y = REF.dequantize(REF.from_data(want))
        q = be.quantize(x, s)
        assert q.to_data().payload == want.payload, shape
        y = be.to_numpy(be.dequantize(q))
        assert y.shape == shape and np.array_equal(y, ref_y)
        assert np.array_equal(be.to_numpy(be.dequantize(be.from_data(want))), ref_y)
        p = REF.calibrate(x, s)
        assert be.quantize(x, s, params=p).to_data().payload == want.payload
        if len(shape) == 2:
            xx = _x((3, shape[0]), 6)
            np.testing.assert_allclose(be.to_numpy(be.matmul(xx, q)), xx @ ref_y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["reference", "cuda"])
def test_ops_on_flat_blocks(name, request):
    be = get_backend(name, request)
    s = qcore.scheme("q4s/block16:f16:flat/packed_native/order:high")
    x = _x((6, 20), 7)
    q = be.quantize(x, s)
    r = be.reshape(q, (4, 30))  # exact: the bytes do not change
    assert r.shape == (4, 30) and r.to_data().payload == q.to_data().payload
    y = be.to_numpy(be.dequantize(q))
    t = be.permute(q, (1, 0))  # requantized from the floats
    assert t.to_data() == REF.quantize(np.ascontiguousarray(y.T), s).to_data()
    assert be.permute(q, (0, 1)) is q
    sl = be.slice(q, (slice(1, 4),))
    assert sl.to_data() == REF.quantize(y[1:4], s).to_data()


@pytest.mark.parametrize("name", ["reference", "cuda", "ndarray"])
def test_invalid_codes_are_named_in_the_tensors_shape(name, request):
    be = get_backend(name, request)
    s = qcore.scheme("q8s/block32:f32:flat" if name == "ndarray" else "q4s/block32:f32:flat/packed_native/order:high")
    d = REF.quantize(_x((3, 37), 8), s).to_data()
    raw = bytearray(d.payload)
    if s.bits == 8:
        raw[40] = 0x80  # element 40 = (1, 3): -128 is below q8s's qmin
    else:
        raw[20] = (raw[20] & 0x0F) | 0x80  # byte 20's high nibble: element 40 under high-first
    bad = QuantizedData(d.shape, s, bytes(raw))
    with pytest.raises(InvalidDataError, match=r"element \(1, 3\) of " + str(s).replace("[", r"\[")):
        be.to_numpy(be.dequantize(be.from_data(bad)))


def test_convert_repacks_an_order_the_target_lacks(tmp_path):
    """GGUF holds Q4_0 in its own split halves; a qcore tensor in `order:split32` (or any order)
    converts to it with its fields re-packed, and reads back as the same codes and scales."""
    pytest.importorskip("gguf")
    import qcore.formats as qf

    s = qcore.scheme("q4_0").with_store(PackedNative(0, "split", 32))
    d = REF.quantize(_x((4, 64), 9), s).to_data()
    low = d.in_low_order()
    assert low.scheme == qcore.scheme("q4_0").with_store(PackedNative(0)) and low.payload != d.payload
    assert np.array_equal(low.codes(), d.codes()) and np.array_equal(low.scales(), d.scales())
    qcore.save(tmp_path / "a.safetensors", {"w": REF.from_data(d)})
    report = qf.convert(tmp_path / "a.safetensors", tmp_path / "a.gguf", "gguf")
    assert report.lossless
    back = qf.read(tmp_path / "a.gguf").tensors["w"]
    assert np.array_equal(back.codes(), d.codes()) and np.array_equal(back.scales(), d.scales())


@pytest.mark.parametrize("text", ["q4s/block16:f16/packed_native/order:split32", "q2s/block4:f32/packed_u32:1/order:high",
                                  "q8s/block8x4:f32/packed_u32/order:split8"])
@pytest.mark.parametrize("name", ["reference", "cuda"])
def test_ops_keep_a_field_order(text, name, request):
    """reshape, permute, slice and cat move codes and scales (exact where the layout allows) and
    keep the scheme's field order; cuda's results are the reference's bytes."""
    be = get_backend(name, request)
    s = qcore.scheme(text)
    x = _x((8, 48), 10)
    q, r = be.quantize(x, s), REF.quantize(x, s)
    y = REF.dequantize(r)
    cases = [  # (op, the same op on the floats where it is exact here: blocks whole along the cuts)
        (lambda b, t: b.reshape(t, (4, 96)), None),  # the last extent changes: requantized
        (lambda b, t: b.permute(t, (1, 0)), lambda a: a.T),
        (lambda b, t: b.slice(t, (slice(0, 8), slice(16, 48))), lambda a: a[0:8, 16:48]),
        (lambda b, t: b.cat([t, t], axis=0), lambda a: np.concatenate([a, a], axis=0)),
    ]
    for op, on_floats in cases:
        got, want = op(be, q).to_data(), op(REF, r).to_data()
        assert got == want and got.scheme.store.order == s.store.order
        if on_floats is not None:
            assert np.array_equal(REF.dequantize(REF.from_data(want)), on_floats(y))


@pytest.mark.parametrize("text,ok", [
    ("nf4/codes:midpoint", True), ("q4s-lookup[nf4]/tensor:f16/round:rne/codes:midpoint", True),
    ("q4s/block32:f32/codes:midpoint", False), ("q4s-lookup[nf4]/block16:ue4m3/tensor:f32/codes:midpoint", False),
    ("nf4/codes:away", False),
])
def test_the_midpoint_rule_is_for_lookup_schemes_with_one_level(text, ok):
    if ok:
        assert qcore.scheme(text).code_rule.value == "midpoint"
    else:
        with pytest.raises(SchemeError):
            qcore.scheme(text)


def test_the_midpoint_rule_divides_in_partial_blocks_and_takes_the_lower_entry_at_a_tie():
    """The `midpoint` code rule (docs/spec.md, code rules), against a statement written out here:
    whole blocks multiply by f32(1 / s), a partial block divides by s, y is clamped to the table,
    and the code counts the f32 midpoints below y."""
    s = qcore.scheme("nf4/block8:f32:flat/codes:midpoint")
    t = np.asarray(s.table, np.float32)
    mids = ((t[:-1] + t[1:]) / np.float32(2)).astype(np.float32)
    x = np.concatenate([mids[:7], [np.float32(1)],                    # a whole block on its midpoints (s = 1)
                        np.float32([0.1, -0.7, 2.9])]).astype(np.float32)  # a partial block
    codes = REF.quantize(x, s).to_data().codes()
    want = []
    for blk, whole in ((x[:8], True), (x[8:], False)):
        m = np.float32(np.abs(blk).max())
        r = np.float32(np.float32(1) / m)
        for v in blk:
            y = np.float32(v * r) if whole else np.float32(v / m)
            y = min(max(y, t[0]), t[-1])
            want.append(int(np.sum(mids < y)))
    assert codes.tolist() == want
    assert codes[:7].tolist() == list(range(7))  # y on a midpoint: the lower entry
