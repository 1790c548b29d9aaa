"""GGUF Q8_0, Q4_0 and MXFP4 against the gguf package's own quantize, dequantize, reader and writer."""
import json

import ml_dtypes
import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install 'qcore-quant[formats]')")
from gguf import GGMLQuantizationType as T  # noqa: E402

import qcore  # noqa: E402
import qcore.formats as qf  # noqa: E402
from qcore.formats import UnrepresentableError  # noqa: E402
from tests.cuda_cases import SIM  # noqa: E402
from tests.formats_util import BACKENDS, assert_bits_equal, decode, get_backend  # noqa: E402

# Shapes: a 1-D row, several rows, a 3-D tensor with rows of 3 blocks (GGUF's ne order reverses them).
SHAPES = [(64,), (3, 64), (2, 5, 96)]


def _x(shape, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * rng.uniform(0.01, 50, size=shape[:-1] + (1,))).astype(np.float32)
    x.reshape(-1, 32)[0] = 0.0          # an all-zero block (scale 0)
    x.reshape(-1)[40] = 1e-30           # a tiny value in a block of its own kind
    return x


def _gguf_file(path, tensors, kv=None):
    """Write with gguf's own writer: {name: (numpy data, raw type or None)}."""
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in (kv or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, list):
            w.add_array(key, value)
        else:
            w.add_uint32(key, value)
    for name, (data, raw) in tensors.items():
        if raw is None:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ndarray holds 8-bit integers only (docs/spec.md, backends), so MXFP4 runs on reference and cuda
DECODERS = [pytest.param(kind, scheme, be, id=f"{kind.name}-{be}") for kind, scheme, bes in (
    (T.Q8_0, "q8s/block32:f16", BACKENDS), (T.Q4_0, "q4f/block32:f16/signed", ["reference", "cuda"]),
    (T.Q4_1, "u4/block32:f16/min:f16", ["reference", "cuda"]),
    (T.MXFP4, "mxfp4", ["reference", "cuda"])) for be in bes]


@pytest.mark.parametrize("kind,scheme,be_name", DECODERS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gguf_quantized_decodes_like_gguf_dequantize(tmp_path, request, kind, scheme, shape, be_name):
    be = get_backend(be_name, request)
    raw = gguf.quants.quantize(_x(shape), kind)
    path = _gguf_file(tmp_path / "m.gguf", {"w": (raw, kind)})
    d = qf.read(path).tensors["w"]
    assert d.shape == shape and d.scheme == qcore.scheme(scheme)
    # MXFP4 code 8 (E2M1 -0): ggml's doubled table gives +0, SPEC -0 (docs/formats.md)
    assert_bits_equal(decode(d, be), gguf.quants.dequantize(raw, kind), signed_zero=kind != T.MXFP4)


@pytest.mark.filterwarnings("ignore:overflow encountered")   # e = 254 with 6: inf in both
@pytest.mark.parametrize("be_name", ["reference", "cuda"])
def test_random_mxfp4_bytes_decode_like_gguf(tmp_path, request, be_name):
    """Every scale byte but 255 (NaN in SPEC) and every nibble, including e = 0 and 1 (subnormal scales)."""
    be = get_backend(be_name, request)
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, size=(4, 2 * 17), dtype=np.uint8)
    blocks.reshape(-1, 17)[:, 0] = rng.integers(0, 255, size=8)
    blocks.reshape(-1, 17)[:3, 0] = [0, 1, 254]
    d = qf.read(_gguf_file(tmp_path / "r.gguf", {"w": (blocks, T.MXFP4)})).tensors["w"]
    assert_bits_equal(decode(d, be), gguf.quants.dequantize(blocks, T.MXFP4), signed_zero=False)


@pytest.mark.parametrize("be_name", BACKENDS)
def test_random_q8_0_bytes_decode_like_gguf(tmp_path, request, be_name):
    """Random codes (-128 included: read as q8f) under random finite, non-negative f16 scales."""
    be = get_backend(be_name, request)
    rng = np.random.default_rng(2)
    blocks = rng.integers(0, 256, size=(3, 4 * 34), dtype=np.uint8)
    scales = np.abs(rng.standard_normal(12) * 10).astype(np.float16)
    scales[0] = 0
    blocks.reshape(-1, 34)[:, :2] = scales.view(np.uint8).reshape(-1, 2)
    blocks.reshape(-1, 34)[0, 2] = 0x80     # code -128
    d = qf.read(_gguf_file(tmp_path / "r.gguf", {"w": (blocks, T.Q8_0)})).tensors["w"]
    assert str(d.scheme) == "q8f/block32:f16"
    assert_bits_equal(decode(d, be), gguf.quants.dequantize(blocks, T.Q8_0))


@pytest.mark.parametrize("be_name", ["reference", "cuda"])
def test_random_q4_0_bytes_decode_like_gguf(tmp_path, request, be_name):
    """Every nibble under random finite f16 scales of both signs, -0 and 0 included."""
    be = get_backend(be_name, request)
    rng = np.random.default_rng(5)
    blocks = rng.integers(0, 256, size=(3, 4 * 18), dtype=np.uint8)
    scales = (rng.standard_normal(12) * 10).astype(np.float16)
    scales[:2] = [0.0, -0.0]
    blocks.reshape(-1, 18)[:, :2] = scales.view(np.uint8).reshape(-1, 2)
    d = qf.read(_gguf_file(tmp_path / "r.gguf", {"w": (blocks, T.Q4_0)})).tensors["w"]
    assert str(d.scheme) == "q4f/block32:f16/signed"
    assert_bits_equal(decode(d, be), gguf.quants.dequantize(blocks, T.Q4_0))


@pytest.mark.parametrize("be_name", ["reference", "cuda"])
def test_random_q4_1_bytes_decode_like_gguf(tmp_path, request, be_name):
    """Every nibble under random finite f16 scales (>= 0, as llama.cpp's `(max - min) / 15`) and mins
    of both signs, zeros included; a negative scale is refused as invalid data."""
    be = get_backend(be_name, request)
    rng = np.random.default_rng(6)
    blocks = rng.integers(0, 256, size=(3, 4 * 20), dtype=np.uint8)
    dm = (rng.standard_normal((12, 2)) * np.exp(rng.uniform(-6, 6, (12, 1)))).astype(np.float16)
    dm[:, 0] = np.abs(dm[:, 0])
    dm[0] = [0.0, -0.0]
    dm[1, 1] = 0.0
    blocks.reshape(-1, 20)[:, :4] = dm.view(np.uint8).reshape(-1, 4)
    d = qf.read(_gguf_file(tmp_path / "r.gguf", {"w": (blocks, T.Q4_1)})).tensors["w"]
    assert str(d.scheme) == "u4/block32:f16/min:f16"
    assert_bits_equal(decode(d, be), gguf.quants.dequantize(blocks, T.Q4_1))
    blocks.reshape(-1, 20)[5, 1] |= 0x80  # d < 0
    with pytest.raises(qcore.InvalidDataError, match=r"tensor 'w': scale slot 5 .* must be finite and >= 0"):
        qf.read(_gguf_file(tmp_path / "n.gguf", {"w": (blocks, T.Q4_1)}))


def test_q4_0_with_no_negative_scale_reads_as_a_v1_scheme(tmp_path):
    x = np.abs(_x((2, 64), 6))
    x.reshape(-1, 32)[:, 7] = -2 * x.max()   # every block's extreme negative: d = max / -8 > 0
    d = qf.read(_gguf_file(tmp_path / "p.gguf", {"w": (gguf.quants.quantize(x, T.Q4_0), T.Q4_0)})).tensors["w"]
    assert str(d.scheme) == "q4f/block32:f16"


@pytest.mark.parametrize("scheme,kind", [("q8s/block32:f16", T.Q8_0), ("q4_0", T.Q4_0), ("q4s/block32:f16", T.Q4_0),
                                         ("q4_1", T.Q4_1), ("u4/block32:f16/min:f16", T.Q4_1), ("mxfp4", T.MXFP4)],
                         ids=["Q8_0", "Q4_0", "q4s-as-Q4_0", "Q4_1", "u4-min-as-Q4_1", "MXFP4"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_qcore_writes_gguf_that_gguf_reads_back(tmp_path, scheme, kind, shape):
    q = qcore.quantize(_x(shape, 3), scheme, backend="reference")
    path = tmp_path / "out.gguf"
    qf.write(path, {"w": q.to_data(), "norm": np.linspace(-1, 1, 8, dtype=np.float32)}, "gguf")
    r = gguf.GGUFReader(str(path))
    t = {t.name: t for t in r.tensors}
    assert t["w"].tensor_type == kind and tuple(reversed(t["w"].shape.tolist())) == shape
    assert t["norm"].tensor_type == T.F32
    assert r.fields["general.quantization_version"].contents() == 2
    got = gguf.quants.dequantize(np.asarray(t["w"].data), kind).reshape(shape)
    assert_bits_equal(q.numpy(), got, signed_zero=kind != T.MXFP4)


def test_qcore_encoding_of_gguf_blocks_is_gguf_bytes(tmp_path):
    """Read then write: every byte of the tensor data is the one gguf's quantizer wrote."""
    x = _x((4, 128), 4)
    src = {"q8": (gguf.quants.quantize(x, T.Q8_0), T.Q8_0), "mx": (gguf.quants.quantize(x, T.MXFP4), T.MXFP4),
           "q4": (gguf.quants.quantize(x, T.Q4_0), T.Q4_0), "q41": (gguf.quants.quantize(x, T.Q4_1), T.Q4_1)}
    a = _gguf_file(tmp_path / "a.gguf", src)
    qf.write(tmp_path / "b.gguf", qf.read(a), "gguf")
    back = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(str(tmp_path / "b.gguf")).tensors}
    for name, (raw, _) in src.items():
        assert back[name].tobytes() == raw.tobytes(), name


def test_float_tensors_and_metadata_pass_through(tmp_path):
    x = _x((2, 32), 5)
    kv = {"general.name": "tiny", "tiny.context_length": 128, "tiny.rope_theta": 0.5, "tiny.list": [1, 2, 3]}
    a = _gguf_file(tmp_path / "a.gguf", {
        "f32": (x, None), "f16": (x.astype(np.float16), None),
        "bf16": (x.astype(ml_dtypes.bfloat16).view(np.uint16), T.BF16), "i32": (np.arange(6, dtype=np.int32), None),
    }, kv)
    ck = qf.read(a)
    assert ck.tensors["bf16"].dtype == ml_dtypes.bfloat16 and ck.tensors["bf16"].shape == (2, 32)
    assert np.array_equal(ck.tensors["bf16"].astype(np.float32), x.astype(ml_dtypes.bfloat16).astype(np.float32))
    assert ck.tensors["f16"].dtype == np.float16 and ck.tensors["i32"].tolist() == list(range(6))
    qf.write(tmp_path / "b.gguf", ck, "gguf")
    r = gguf.GGUFReader(str(tmp_path / "b.gguf"))
    for key, value in kv.items():
        assert r.fields[key].contents() == value, key
    assert r.fields["general.architecture"].contents() == "llama"
    types = {t.name: t.tensor_type for t in r.tensors}
    assert types == {"f32": T.F32, "f16": T.F16, "bf16": T.BF16, "i32": T.I32}


def test_unsupported_gguf_type_is_refused_with_the_type(tmp_path):
    raw = gguf.quants.quantize(_x((2, 64)), T.Q5_1)
    path = _gguf_file(tmp_path / "q5.gguf", {"w": (raw, T.Q5_1)})
    with pytest.raises(UnrepresentableError, match=r"tensor 'w': GGUF type Q5_1 has no exact qcore scheme"):
        qf.read(path)


@pytest.mark.parametrize("scheme,shape,match", [
    ("q4s/block32:bf16", (2, 64), r"GGUF holds qcore q8s/block32:f16 \(Q8_0\), 4-bit .* got q4s/block32:bf16"),
    ("q4f/block32:f16/signed", (2, 48), r"Q4_0 needs whole blocks of 32 along the last dim, got \[2, 48\]"),
    ("q4s/block16:f16", (2, 64), r"got q4s/block16:f16"),
    ("u4/block32:f16/min:bf16", (2, 64), r"got u4/block32:f16/min:bf16"),
    ("u4/block32:f16/zero", (2, 64), r"got u4/block32:f16/zero"),
    ("q4_1", (2, 48), r"Q4_1 needs whole blocks of 32 along the last dim"),
    ("q8s/block32:f16", (2, 40), r"Q8_0 needs whole blocks of 32 along the last dim, got \[2, 40\]"),
    ("mxfp4", (2, 48), r"GGUF MXFP4 needs whole blocks of 32, got last dim 48"),
    ("q8s/block16:f16", (2, 64), r"got q8s/block16:f16"),
    ("mxfp4", (1, 1, 1, 1, 32), r"at most 4 dims"),
])
def test_what_gguf_cannot_hold_is_refused_before_writing(tmp_path, scheme, shape, match):
    d = qcore.quantize(np.ones(shape, np.float32), scheme, backend="reference").to_data()
    assert not qf.get("gguf").check("w", d)
    with pytest.raises(UnrepresentableError, match=match):
        qf.write(tmp_path / "x.gguf", {"w": d}, "gguf")
    assert not (tmp_path / "x.gguf").exists()


def test_long_tensor_name_is_refused():
    d = qcore.quantize(np.ones((1, 32), np.float32), "mxfp4", backend="reference").to_data()
    assert qf.get("gguf").check("x" * 63, d)
    assert qf.get("gguf").check("x" * 64, d).reason == "GGUF tensor names are shorter than 64 bytes; rename it"


def test_kv_metadata_travels_as_json(tmp_path):
    a = _gguf_file(tmp_path / "a.gguf", {"w": (np.zeros((1, 32), np.float32), None)}, {"general.name": "x"})
    kv = json.loads(qf.read(a).metadata["gguf.kv"])
    assert ["general.name", "STRING", None, "x"] in kv


def test_a_file_with_the_magic_but_no_gguf_is_invalid_data(tmp_path):
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + b"\xff" * 20)
    with pytest.raises(qcore.InvalidDataError, match=r"bad.gguf is not a readable GGUF file"):
        qf.read(tmp_path / "bad.gguf")


def test_rne_scales_are_the_scales_llama_cpp_stores_for_q8_0():
    """`q8s/block32:f16/round:rne` rounds `amax / 127` to f16 as ggml's Q8_0 quantizer does (gguf-py's
    `quants.quantize`, its numpy twin): the same scale bytes; `up` (SPEC v1) differs."""
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((64, 256)) * np.exp(rng.uniform(-5, 5, (64, 1)))).astype(np.float32)
    blocks = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0).reshape(-1, 34)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32).reshape(-1)
    ref = qcore.backend("reference")
    rne = ref.into_data(ref.quantize(x, "q8s/block32:f16/round:rne")).scales().reshape(-1)
    up = ref.into_data(ref.quantize(x, "q8s/block32:f16")).scales().reshape(-1)
    assert np.array_equal(rne.view(np.uint32), d.view(np.uint32))
    assert not np.array_equal(up, d)


# Inputs that hit the quantizers' edges: ties at every half step of the reciprocal, zero blocks,
# blocks whose extreme is positive, negative or tied in magnitude, huge and tiny blocks.
def _edge_x(seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((16, 256)) * np.exp(rng.uniform(-8, 8, (16, 1)))).astype(np.float32)
    b = x.reshape(-1, 32)
    b[0] = 0.0
    b[1] = np.arange(-16, 16) / 2                              # y on half steps: ties for every rule
    b[2, :] = 0.25; b[2, 3] = -1.0; b[2, 9] = 1.0              # tied extremes: the first one's sign
    b[3, :] = -0.5; b[3, 0] = 4.0; b[3, 1] = -4.0
    b[4] = np.linspace(-127, 127, 32) * np.float32(1e-3)      # half steps of q8 at a non-power-of-two d
    b[5] *= np.float32(1e-6)                                   # f16 subnormal scales
    b[6] *= np.float32(1e5)                                    # scales beyond f16's max
    return x


@pytest.mark.filterwarnings("ignore:overflow encountered")   # gguf-py's f16 cast of a huge d
@pytest.mark.parametrize("preset,kind,bes", [("q8_0", T.Q8_0, BACKENDS), ("q4_0", T.Q4_0, ["reference", "cuda"]),
                                             ("q4_1", T.Q4_1, ["reference", "cuda"])], ids=["q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_presets_encode_as_llama_cpp_does(tmp_path, request, preset, kind, bes, seed):
    """The `q8_0` / `q4_0` / `q4_1` presets (docs/spec.md: signed scales, code rules, affine offsets)
    write the bytes gguf-py's quantizer writes, block for block, except where its f16 scale or min
    overflows to inf (qcore saturates at ±65504; the codes are the same)."""
    x = _edge_x(seed)
    head = 4 if kind == T.Q4_1 else 2  # the f16 fields before a block's codes
    want = gguf.quants.quantize(x, kind).reshape(-1, {T.Q8_0: 34, T.Q4_0: 18, T.Q4_1: 20}[kind])
    want_f16 = want[:, :head].copy().view(np.float16)
    finite = np.isfinite(want_f16).all(axis=1)
    assert finite.sum() >= want.shape[0] - 8
    for be_name in bes:
        if be_name == "cuda" and SIM and seed:  # the simulator takes seed 0 (every edge block); a GPU all
            continue
        be = get_backend(be_name, request)
        d = be.into_data(be.quantize(x, preset))
        qf.write(tmp_path / f"{be_name}.gguf", {"w": d}, "gguf")
        got = np.asarray(gguf.GGUFReader(str(tmp_path / f"{be_name}.gguf")).tensors[0].data).reshape(want.shape)
        assert np.array_equal(got[finite], want[finite]), be_name
        assert np.array_equal(got[:, head:], want[:, head:]), be_name
        got_f16 = got[:, :head].copy().view(np.float16)
        sat = np.where(np.isfinite(want_f16), want_f16, np.float16(65504) * np.sign(want_f16.astype(np.float32)))
        assert np.array_equal(got_f16, sat.astype(np.float16)), be_name


def test_mx_rule_gives_gguf_mxfp4_scale_bytes_but_not_all_its_codes(tmp_path):
    """`mxfp4/round:mx` stores the scale bytes of gguf-py's MXFP4 quantizer (OCP's floor rule);
    its codes are an argmin over f32 errors with ties to the lower table index, so some differ
    from SPEC's nearest-even E2M1 (docs/formats.md): qcore claims the scales, not the codes."""
    x = _edge_x(0)
    want = gguf.quants.quantize(x, T.MXFP4).reshape(-1, 17)
    ref = qcore.backend("reference")
    qf.write(tmp_path / "m.gguf", {"w": ref.into_data(ref.quantize(x, "mxfp4/round:mx"))}, "gguf")
    got = np.asarray(gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors[0].data).reshape(want.shape)
    assert np.array_equal(got[:, 0], want[:, 0])
    assert not np.array_equal(got[:, 1:], want[:, 1:])


def _near_zero_blocks():
    """One block of 32 per scale: a fixed random shape scaled so that its extreme is 1.37 * 2^k, for
    k from -149 (f32's least subnormal) to -100, plus a block with an exact zero."""
    base = np.random.default_rng(7).standard_normal(32).astype(np.float32)
    base /= np.abs(base).max()
    rows = [(base * np.float32(1.37 * 2.0 ** k)).astype(np.float32) for k in range(-149, -99)]
    with_zero = rows[20].copy()
    with_zero[5] = 0.0
    return np.stack(rows + [with_zero])


def _raw_scale(blocks, kind):
    """The f32 raw scale s each gguf-py quantizer takes the reciprocal of."""
    if kind == T.Q8_0:
        return (np.abs(blocks).max(axis=1) / np.float32(127)).astype(np.float32)
    if kind == T.Q4_0:
        m = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=1)[:, None], axis=1)[:, 0]
        return np.abs(m / np.float32(-8)).astype(np.float32)
    return ((blocks.max(axis=1) - blocks.min(axis=1)) / np.float32(15)).astype(np.float32)


@pytest.mark.filterwarnings("ignore:invalid value encountered", "ignore:overflow encountered")
@pytest.mark.parametrize("preset,kind,bes", [("q8_0", T.Q8_0, BACKENDS), ("q4_0", T.Q4_0, ["reference", "cuda"]),
                                             ("q4_1", T.Q4_1, ["reference", "cuda"])], ids=["q8_0", "q4_0", "q4_1"])
def test_presets_differ_from_gguf_only_where_its_reciprocal_overflows(tmp_path, request, preset, kind, bes):
    """docs/formats.md, near-zero blocks: the presets write gguf-py's bytes for every block whose raw
    scale s has a finite f32 reciprocal; where `f32(1 / s)` is inf (0 < s <= 2^-128) gguf's codes
    are integer casts of ±inf or NaN (undefined in C) and qcore's are its rule's (±inf clamps to
    the end codes, an exact zero is coded as 0). The f16 scale is 0 there, so both decode to
    zeros (signs may differ); every backend writes the same bytes."""
    x = _near_zero_blocks()
    size = {T.Q8_0: 34, T.Q4_0: 18, T.Q4_1: 20}[kind]
    want = gguf.quants.quantize(x, kind).reshape(-1, size)
    s = _raw_scale(x, kind)
    overflow = (s > 0) & (s <= np.float32(2.0 ** -128))
    with np.errstate(divide="ignore", over="ignore"):
        assert np.array_equal(overflow, (s > 0) & np.isinf(np.float32(1) / s))   # the threshold, exactly
    assert 10 <= overflow.sum() < len(s) - 10
    first = None
    for be_name in bes:
        be = get_backend(be_name, request)
        d = be.into_data(be.quantize(x, preset))
        qf.write(tmp_path / f"{be_name}.gguf", {"w": d}, "gguf")
        got = np.asarray(gguf.GGUFReader(str(tmp_path / f"{be_name}.gguf")).tensors[0].data).reshape(want.shape)
        assert np.array_equal(got[~overflow], want[~overflow]), be_name
        first = got if first is None else first
        assert np.array_equal(got, first), be_name          # one rule on every backend
        dec = gguf.quants.dequantize(got.reshape(-1), kind).reshape(x.shape)
        assert_bits_equal(dec, gguf.quants.dequantize(want.reshape(-1), kind).reshape(x.shape), signed_zero=False)
        assert not dec[overflow].any()
    codes = first[overflow][:, {T.Q8_0: 2, T.Q4_0: 2, T.Q4_1: 4}[kind]:]
    if kind == T.Q8_0:   # ±127 for a non-zero element, 0 for an exact zero
        want_codes = np.where(x[overflow] == 0, 0, np.sign(x[overflow]) * 127).astype(np.int8).view(np.uint8)
        assert np.array_equal(codes, want_codes)


@pytest.mark.filterwarnings("ignore:invalid value encountered", "ignore:divide by zero", "ignore:overflow encountered")
def test_mx_rule_scale_bytes_are_gguf_bytes_down_to_two_to_the_minus_125(tmp_path):
    """`mxfp4/round:mx` takes OCP's `floor(log2 amax) - 2 + 127` as gguf-py does for amax >= 2^-125;
    below, that number is negative, gguf-py's uint8 cast wraps it (255, 254, ... on x86-64: a huge
    scale under which every code is 0), and qcore stores byte 0 (2^-127), the least UE8M0 scale,
    which keeps the block's values on the E2M1 grid of 2^-127."""
    x = _near_zero_blocks()[:-1]
    amax = np.abs(x).max(axis=1)
    want = gguf.quants.quantize(x, T.MXFP4).reshape(-1, 17)
    ref = qcore.backend("reference")
    q = ref.quantize(x, "mxfp4/round:mx")
    qf.write(tmp_path / "m.gguf", {"w": ref.into_data(q)}, "gguf")
    got = np.asarray(gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors[0].data).reshape(want.shape)
    low = amax < np.float32(2.0 ** -125)
    assert 10 <= low.sum() < len(amax) - 10
    assert np.array_equal(got[~low, 0], want[~low, 0])
    assert np.array_equal(got[~low, 0], (np.floor(np.log2(amax[~low])) + 125).astype(np.uint8))
    assert not got[low, 0].any()
    assert np.abs(q.numpy()[low] - x[low]).max() <= 2.0 ** -128   # half an E2M1 step at scale 2^-127
