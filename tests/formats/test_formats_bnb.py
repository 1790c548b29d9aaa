"""bitsandbytes nf4 checkpoints: files written by bitsandbytes itself, and the documented layout."""
import json
import os

import ml_dtypes  # noqa: F401  (bfloat16 for the reference file)
import numpy as np
import pytest
from safetensors.numpy import save_file

import qcore
import qcore.formats as qf
from qcore import InvalidDataError
from qcore.formats import UnrepresentableError
from tests.formats_util import assert_bits_equal, decode, get_backend
from tests.paths import DATA

FIXTURE = os.path.join(DATA, "bnb_nf4.safetensors")          # made by scripts/make_bnb_fixture.py
REFERENCE = os.path.join(DATA, "bnb_nf4.ref.safetensors")    # bitsandbytes' dequantize_4bit of each weight
NF4 = np.asarray(qcore.scheme("nf4").table, np.float32)
WEIGHTS = ["layers.0.proj.weight", "layers.1.proj.weight", "layers.2.proj.weight", "layers.3.proj.weight"]


@pytest.fixture(scope="module")
def checkpoint():
    return qf.read(FIXTURE)


@pytest.fixture(scope="module")
def reference():
    return qf.read(REFERENCE).tensors


@pytest.mark.parametrize("name", WEIGHTS, ids=["f32", "f32-double-quant", "bf16-double-quant-block128", "f16"])
@pytest.mark.parametrize("be_name", ["reference", "lutcpu"])
def test_bitsandbytes_file_decodes_like_dequantize_4bit(request, checkpoint, reference, name, be_name):
    """qcore's decode cast to the layer's dtype equals bitsandbytes' own output bit for bit."""
    be = get_backend(be_name, request)
    d, want = checkpoint.tensors[name], reference[name]
    sup = be.supports(d.scheme)
    assert sup, sup.reason
    got = be.to_numpy(be.dequantize(be.from_data(d), dtype=want.dtype))
    assert got.dtype == want.dtype and got.shape == want.shape
    bad = got.view(np.uint8) != want.view(np.uint8)
    assert not bad.any(), f"{int(bad.sum())} bytes differ"


def test_bitsandbytes_file_is_detected_and_described(checkpoint):
    assert qf.detect(FIXTURE).name == "bitsandbytes"
    assert [checkpoint.tensors[n].scheme for n in WEIGHTS] == [qcore.scheme(s) for s in (
        "nf4", "nf4", "q4s-lookup[nf4]/block128:f32", "nf4")]
    assert json.loads(checkpoint.metadata["bitsandbytes.dtypes"])["layers.2.proj.weight"] == "bfloat16"
    assert checkpoint.tensors["layers.0.proj.bias"].dtype == np.float32      # other tensors pass through
    assert not any(".absmax" in k or "quant_state" in k for k in checkpoint.tensors)


ROWS = os.path.join(DATA, "bnb_nf4_rows.safetensors")          # blocks of 64 that cross rows
ROWS_REF = os.path.join(DATA, "bnb_nf4_rows.ref.safetensors")


@pytest.mark.parametrize("be_name", ["reference", "lutcpu"])
def test_blocks_that_cross_rows_decode_like_dequantize_4bit(request, be_name):
    """Layers of in_features 96 and 37 (an odd element count: a half byte at the end), blocks of 64
    over the flattened weight: read as blocks over the flattened tensor (docs/spec.md), decoded
    bit for bit as bitsandbytes' dequantize_4bit."""
    be = get_backend(be_name, request)
    ck, want = qf.read(ROWS), qf.read(ROWS_REF).tensors
    for name, shape in (("rows.weight", (4, 96)), ("odd.weight", (3, 37))):
        d = ck.tensors[name]
        assert d.scheme == qcore.scheme("q4s-lookup[nf4]/block64:f32:flat") and d.shape == shape
        assert_bits_equal(be.to_numpy(be.dequantize(be.from_data(d))), want[name])


def test_blocks_that_cross_rows_come_back_byte_for_byte(tmp_path):
    report = qf.convert(ROWS, tmp_path / "o.safetensors", "bitsandbytes")
    assert report.lossless
    got, meta = _tensors(tmp_path / "o.safetensors")
    want, want_meta = _tensors(ROWS)
    assert meta == want_meta and got.keys() == want.keys()
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and got[k].tobytes() == v.tobytes(), k


# ----------------------------------------------------------- the documented layout, written here
def bnb_quantize(x: np.ndarray, blocksize: int, table=NF4):
    """bitsandbytes' quantize_4bit in numpy: absmax per `blocksize` of the flattened tensor, code =
    nearest table entry of x * (1 / absmax), element 2k in the high nibble."""
    flat = x.reshape(-1).astype(np.float32)
    n = flat.size
    pad = np.zeros(-(-n // blocksize) * blocksize, np.float32)
    pad[:n] = flat
    absmax = np.abs(pad.reshape(-1, blocksize)).max(axis=1)
    y = pad.reshape(-1, blocksize) * (np.float32(1) / np.where(absmax == 0, 1, absmax))[:, None]
    codes = np.abs(y[..., None] - table).argmin(-1).astype(np.uint8).reshape(-1)[:n]
    codes = np.concatenate([codes, np.zeros(n % 2, np.uint8)])
    packed = (codes[0::2] << 4) | codes[1::2]
    return packed.reshape(-1, 1), absmax.astype(np.float32)


def bnb_dequantize(packed: np.ndarray, absmax: np.ndarray, shape, blocksize: int, table=NF4) -> np.ndarray:
    """bitsandbytes' dequantize_4bit in numpy: table[code] * absmax[block] in f32."""
    b = packed.reshape(-1)
    codes = np.stack([b >> 4, b & 0x0F], axis=1).reshape(-1)[: int(np.prod(shape))]
    per = np.repeat(absmax, blocksize)[: codes.size]
    return (table[codes] * per).astype(np.float32).reshape(shape)


def _write(path, name, packed, absmax, shape, blocksize, quant_type="nf4", table=NF4, extra=None):
    state = {"quant_type": quant_type, "blocksize": blocksize, "dtype": "float32", "shape": list(shape)}
    state.update((extra or {}).pop("state", {}))
    tensors = {name: packed, f"{name}.absmax": absmax, f"{name}.quant_map": table,
               f"{name}.quant_state.bitsandbytes__{quant_type}": np.frombuffer(json.dumps(state).encode(), np.uint8)}
    tensors.update(extra or {})
    save_file(tensors, str(path))
    return path


@pytest.mark.parametrize("shape,blocksize", [((100,), 64), ((3, 128), 64), ((2, 2, 256), 256)], ids=str)
def test_documented_layout_decodes_exactly(tmp_path, shape, blocksize):
    """1-D with a partial last block (and an odd byte), rows of whole blocks, a 3-D tensor."""
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    packed, absmax = bnb_quantize(x, blocksize)
    d = qf.read(_write(tmp_path / "m.safetensors", "w", packed, absmax, shape, blocksize)).tensors["w"]
    assert_bits_equal(decode(d, qcore.backend("reference")), bnb_dequantize(packed, absmax, shape, blocksize))


def test_custom_quant_map_travels_as_a_lookup_table(tmp_path):
    table = np.linspace(-1, 1, 16, dtype=np.float32)
    x = np.random.default_rng(1).standard_normal((2, 64)).astype(np.float32)
    packed, absmax = bnb_quantize(x, 64, table)
    d = qf.read(_write(tmp_path / "m.safetensors", "w", packed, absmax, (2, 64), 64, table=table)).tensors["w"]
    assert str(d.scheme) == "q4s-lookup/block64:f32"
    assert_bits_equal(decode(d, qcore.backend("reference")), bnb_dequantize(packed, absmax, (2, 64), 64, table))


def test_fp4_is_refused_with_the_reason(tmp_path):
    packed, absmax = bnb_quantize(np.ones(64, np.float32), 64)
    path = _write(tmp_path / "m.safetensors", "w", packed, absmax, (64,), 64, quant_type="fp4")
    with pytest.raises(UnrepresentableError, match=r"quant_type 'fp4' is not read .* only nf4 is read"):
        qf.read(path)


def test_wrong_absmax_count_is_invalid_data(tmp_path):
    packed, absmax = bnb_quantize(np.ones((2, 64), np.float32), 64)
    path = _write(tmp_path / "m.safetensors", "w", packed, absmax[:1], (2, 64), 64)
    with pytest.raises(InvalidDataError, match=r"'w' has 1 absmax values; shape \[2, 64\] needs 2"):
        qf.read(path)


def test_missing_part_is_named(tmp_path):
    packed, absmax = bnb_quantize(np.ones(64, np.float32), 64)
    path = _write(tmp_path / "m.safetensors", "w", packed, absmax, (64,), 64)
    from safetensors.numpy import load_file
    t = load_file(str(path))
    del t["w.quant_map"]
    save_file(t, str(path))
    with pytest.raises(InvalidDataError, match=r"bitsandbytes tensor 'w': lacks 'w.quant_map'"):
        qf.read(path)


def _tensors(path):
    from safetensors import safe_open

    with safe_open(str(path), "np") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def test_a_file_bitsandbytes_wrote_comes_back_byte_for_byte(tmp_path):
    """Read and write again: every tensor of the layers without double quant (weight, absmax,
    quant_map, the quant state's JSON bytes) and every other tensor equals bitsandbytes' own;
    the double-quant layers come back with their f32 absmax (double quant undone) and decode to
    bitsandbytes' values."""
    report = qf.convert(FIXTURE, tmp_path / "o.safetensors", "bitsandbytes")
    assert report.lossless
    got, meta = _tensors(tmp_path / "o.safetensors")
    want, want_meta = _tensors(FIXTURE)
    assert meta == want_meta == {"format": "pt"}
    double = ("layers.1.", "layers.2.")
    for k, v in want.items():
        if k.startswith(double) and (".absmax" in k or ".nested_" in k or "quant_state" in k):
            continue
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and got[k].tobytes() == v.tobytes(), k
    assert not any(".nested_" in k for k in got)
    back = qf.read(tmp_path / "o.safetensors")
    reference = qf.read(REFERENCE).tensors
    ref = qcore.backend("reference")
    for name in WEIGHTS:
        d = back.tensors[name]
        dtype = json.loads(back.metadata["bitsandbytes.dtypes"])[name]
        y = ref.dequantize(ref.from_data(d), dtype=np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else dtype)
        assert_bits_equal(np.asarray(y), reference[name])


def test_qcore_nf4_writes_what_bitsandbytes_decodes(tmp_path):
    """A tensor qcore quantized to nf4 is written in bitsandbytes' layout, which its documented
    decode (`bnb_dequantize`: high nibble first, quant_map[code] * absmax) turns into qcore's values."""
    x = np.random.default_rng(4).standard_normal((6, 128)).astype(np.float32)
    q = qcore.quantize(x, "nf4", backend="reference")
    qcore.save(tmp_path / "a.safetensors", {"w": q, "b": np.zeros(6, np.float32)})
    qf.convert(tmp_path / "a.safetensors", tmp_path / "o.safetensors", "bitsandbytes")
    t, _ = _tensors(tmp_path / "o.safetensors")
    state = json.loads(t["w.quant_state.bitsandbytes__nf4"].tobytes())
    assert state == {"quant_type": "nf4", "blocksize": 64, "dtype": "float32", "shape": [6, 128]}
    assert t["w"].shape == (384, 1) and t["w.absmax"].dtype == np.float32
    assert_bits_equal(bnb_dequantize(t["w"].reshape(-1), t["w.absmax"], (6, 128), 64),
                      np.asarray(qcore.dequantize(q)))
    assert qf.detect(tmp_path / "o.safetensors").name == "bitsandbytes"


@pytest.mark.parametrize("text", ["q4s-lookup[nf4]/block64:f32:flat", "q4s-lookup[nf4]/block64:f32:flat/packed_native/order:high",
                                  "q4s-lookup[nf4]/block128:f32:flat/packed_native"])
def test_flat_nf4_of_any_shape_is_written_as_bitsandbytes_lays_it_out(tmp_path, text):
    """Blocks over the flattened tensor (docs/spec.md) are bitsandbytes' own blocks: any shape is
    written, whatever qcore's store and field order, and decodes (documented layout) to qcore's values."""
    x = np.random.default_rng(5).standard_normal((5, 39)).astype(np.float32)
    q = qcore.quantize(x, text, backend="reference")
    qcore.save(tmp_path / "a.safetensors", {"w": q})
    qf.convert(tmp_path / "a.safetensors", tmp_path / "o.safetensors", "bitsandbytes")
    t, _ = _tensors(tmp_path / "o.safetensors")
    block = qcore.scheme(text).block.dims[0]
    assert json.loads(t["w.quant_state.bitsandbytes__nf4"].tobytes())["blocksize"] == block
    assert_bits_equal(bnb_dequantize(t["w"], t["w.absmax"], (5, 39), block), np.asarray(qcore.dequantize(q)))
    back = qf.read(tmp_path / "o.safetensors").tensors["w"]
    assert back.scheme == qcore.scheme(f"q4s-lookup[nf4]/block{block}:f32:flat")
    assert np.array_equal(back.codes(), q.to_data().codes()) and np.array_equal(back.scales(), q.to_data().scales())


@pytest.mark.parametrize("text,shape,why", [
    ("q4s-lookup[nf4]/block32:f32", (2, 64), "blocksizes are 64"),
    ("nf4", (2, 96), "must be a multiple of 64, or the blocks over the flattened tensor"),
    ("q4s-lookup[nf4]/block64:f16", (2, 64), "q4s-lookup\\[nf4\\]/block<B>:f32"),
    ("q4s/block64:f32", (2, 64), "holds nf4"),
])
def test_what_bitsandbytes_cannot_hold_is_refused(tmp_path, text, shape, why):
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    qcore.save(tmp_path / "a.safetensors", {"w": qcore.quantize(x, text, backend="reference")})
    with pytest.raises(UnrepresentableError, match=why):
        qf.convert(tmp_path / "a.safetensors", tmp_path / "o.safetensors", "bitsandbytes")
    assert not (tmp_path / "o.safetensors").exists()


QUANTIZE = os.path.join(DATA, "bnb_nf4_quantize.safetensors")  # bitsandbytes' quantize_4bit, scripts/make_bnb_fixture.py --quantize


@pytest.mark.parametrize("be_name", ["reference", "lutcpu"])
def test_codes_midpoint_writes_bitsandbytes_quantize_bytes(tmp_path, request, be_name):
    """`nf4/block<B>:f32:flat/packed_native/order:high/codes:midpoint` (docs/spec.md: code rules, field
    orders, flat blocks) quantizes as bitsandbytes 0.50.2's own quantize_4bit: written in its
    layout, every case's packed codes and absmax equal the tool's bytes (ties at every midpoint,
    zero, subnormal and huge blocks, partial last blocks, an odd count, an f16 input)."""
    be = get_backend(be_name, request)
    from safetensors import safe_open

    with safe_open(QUANTIZE, "np") as f:
        blocks = json.loads(f.metadata()["blocksizes"])
        t = {k: f.get_tensor(k) for k in f.keys()}
    tensors = {}
    for name, block in blocks.items():
        s = qcore.scheme(f"nf4/block{block}:f32:flat/packed_native/order:high/codes:midpoint")
        tensors[name] = be.quantize(t[f"x.{name}"], s)
    qcore.save(tmp_path / "q.safetensors", tensors)
    qf.convert(tmp_path / "q.safetensors", tmp_path / "b.safetensors", "bitsandbytes")
    got, _ = _tensors(tmp_path / "b.safetensors")
    for name in blocks:
        assert got[name].tobytes() == t[f"w.{name}"].tobytes(), name
        assert got[f"{name}.absmax"].tobytes() == t[f"absmax.{name}"].astype("<f4").tobytes(), name


NEGATIVE = os.path.join(DATA, "bnb_nf4_negative.safetensors")  # scripts/make_bnb_fixture.py --negative


@pytest.mark.parametrize("name", ["zero_row.f32.weight", "zero_row.bf16.weight"])
@pytest.mark.parametrize("be_name", ["reference", "lutcpu"])
def test_a_negative_absmax_on_a_block_of_zeros_decodes_as_bitsandbytes(request, name, be_name):
    """Double quant left the zero row's blocks with a negative absmax (bitsandbytes 0.50.2's own
    file: a row of zeros beside an outlier); bitsandbytes decodes them to -0.0, and so does qcore,
    bit for bit, the rest of the tensor included."""
    be = get_backend(be_name, request)
    d = qf.read(NEGATIVE).tensors[name]
    want = qf.read(os.path.join(DATA, "bnb_nf4_negative.ref.safetensors")).tensors[name]
    got = decode(d, be).astype(want.dtype)
    assert got.view(np.uint8).tobytes() == want.view(np.uint8).tobytes(), name
    zeros = want.reshape(-1, 64).astype(np.float32)
    negative_zero_blocks = np.flatnonzero(np.all(np.signbit(zeros) & (zeros == 0), axis=1))
    assert negative_zero_blocks.size == 4  # the zero row's four blocks: -0.0 everywhere
    assert np.all(d.scales().reshape(-1)[negative_zero_blocks] == 0)


def test_a_negative_absmax_written_back_decodes_the_same(tmp_path):
    """Written as bitsandbytes (no double quant), those blocks carry absmax +0 and the code of -1.0,
    whose product is -0.0 again: the file reads back to the same payload."""
    qcore.convert(NEGATIVE, tmp_path / "b.safetensors", "bitsandbytes")
    a, b = qf.read(NEGATIVE).tensors, qf.read(tmp_path / "b.safetensors").tensors
    assert all(a[n].payload == b[n].payload for n in a if isinstance(a[n], qcore.QuantizedData))


FLIPPED = os.path.join(DATA, "bnb_nf4_flipped.safetensors")  # scripts/make_bnb_fixture.py --negative


def test_a_negative_absmax_with_non_zero_codes_is_refused_naming_the_tensor(tmp_path):
    """Beside a far larger outlier row, small blocks get a negative absmax and keep their codes:
    bitsandbytes decodes them with flipped signs, which no scale >= 0 holds: reading and converting
    without a scheme to re-quantize it refuse the tensor, saying how to go on."""
    why = (r"bitsandbytes tensor 'flipped.weight': 21 block\(s\) have a negative absmax after double quant and "
           r"non-zero codes .* pass requantize=SCHEME \(--requantize\)")
    with pytest.raises(UnrepresentableError, match=why):
        qf.read(FLIPPED)
    with pytest.raises(UnrepresentableError, match=why):
        qcore.convert(FLIPPED, tmp_path / "o.safetensors", "qcore")
    assert not (tmp_path / "o.safetensors").exists()


def test_a_tensor_with_flipped_signs_is_requantized_from_bitsandbytes_decode(tmp_path, capsys):
    """The reader hands over bitsandbytes' own decode of that tensor (`Contents.refused`), bit for
    bit its dequantize_4bit; --requantize quantizes only that tensor from it and reports the error."""
    from qcore.cli.main import main

    ck = qf.get("bitsandbytes").read(FLIPPED)
    want = qf.read(os.path.join(DATA, "bnb_nf4_flipped.ref.safetensors")).tensors["flipped.weight"]
    assert set(ck.refused) == {"flipped.weight"}
    assert ck.tensors["flipped.weight"].tobytes() == want.tobytes() and ck.tensors["flipped.weight"].dtype == want.dtype
    report = qcore.convert(FLIPPED, tmp_path / "o.safetensors", "bitsandbytes", requantize="nf4/block64:f32")
    (row,) = report.tensors
    assert not report.lossless and row.action == "requantized" and row.source == "float32, decoded by bitsandbytes"
    assert 20 < row.sqnr < np.inf
    got = decode(qf.read(tmp_path / "o.safetensors").tensors["flipped.weight"], qcore.backend("reference"))
    assert np.max(np.abs(got - want)) == pytest.approx(row.max_err)
    assert main(["convert", FLIPPED, str(tmp_path / "c.safetensors"), "--to", "qcore", "--requantize", "nf4"]) == 0
    assert "1 re-quantized" in capsys.readouterr().out
    assert main(["inspect", FLIPPED]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "21 block(s) have a negative absmax" in err
