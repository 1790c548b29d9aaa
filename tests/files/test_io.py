"""qcore.files.io: quantized tensors in safetensors files (docs/format.md)."""
import hashlib
import json
import os
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

import qcore
from qcore import (BackendNotFoundError, BackendUnavailableError, InputError, InvalidDataError, QuantizedData,
                   UnsupportedSchemeError)
from qcore.files import io as qio, stfile
from qcore.backend import registry
from tests.doubles import Q8Only
from tests.paths import ROOT

# Odd shapes on purpose: partial edge blocks, a packing run that does not fill its last word.
CASES = [
    ("q8s", (5, 7)),
    ("q4s/block32:f16", (3, 45)),
    ("q2s/packed_u32:1", (9, 4)),
    ("nvfp4", (2, 33)),
    ("mxfp8", (40,)),
    ("nf4", (7, 70)),
    ("q8f/block4x8:bf16", (6, 10)),
]
IDS = [f"{s}-{shape}" for s, shape in CASES]


def _x(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)




@pytest.fixture
def q8only():
    registry.reset()
    registry.register(Q8Only())
    yield registry.backend("q8only")
    registry.reset()


def available_backends():
    """The installed backends that `qcore.backend(name)` hands out (an unavailable one raises)."""
    out = []
    for name in qcore.backends():
        try:
            qcore.backend(name)
        except BackendUnavailableError:
            continue
        out.append(name)
    return out


# ------------------------------------------------------------------------------ round trips
@pytest.mark.parametrize("text,shape", CASES, ids=IDS)
def test_round_trip_is_bit_identical(tmp_path, text, shape):
    x = _x(shape)
    d = qcore.quantize(x, text, backend="reference").to_data()
    path = tmp_path / "t.safetensors"
    qcore.save(path, {"w": d})
    back = qio.load_data(path)["w"]
    assert isinstance(back, QuantizedData)
    assert back.shape == d.shape and str(back.scheme) == str(d.scheme)
    assert back.payload == d.payload, f"{sum(a != b for a, b in zip(back.payload, d.payload))} bytes differ"


@pytest.mark.parametrize("text,shape", CASES, ids=IDS)
def test_loads_on_every_backend_that_supports_it(tmp_path, text, shape):
    d = qcore.quantize(_x(shape), text, backend="reference").to_data()
    path = tmp_path / "t.safetensors"
    qcore.save(path, {"w": d})
    checked = 0
    for name in available_backends():
        be = qcore.backend(name)
        if not be.supports(text):
            continue
        q = qcore.load(path, backend=name)["w"]
        assert q.backend.name == name
        assert q.to_data() == d, f"backend {name} changed the payload of {text}"
        checked += 1
    assert checked >= 1  # reference supports every scheme


def test_written_on_one_backend_read_on_another(tmp_path, q8only):
    x = _x((17, 64))
    q = q8only.quantize(x, "q8s/block32:f16")
    qcore.save(tmp_path / "a.safetensors", {"w": q})
    back = qcore.load(tmp_path / "a.safetensors", backend="reference")["w"]
    assert back.backend.name == "reference"
    assert back.to_data() == q.to_data()
    np.testing.assert_array_equal(back.numpy(), q.numpy())


def test_auto_load_picks_a_backend_per_scheme(tmp_path, q8only):
    x = _x((4, 32))
    qcore.save(tmp_path / "m.safetensors", {"a": qcore.quantize(x, "q8s", backend="reference"),
                                             "b": qcore.quantize(x, "q4s", backend="reference")})
    got = qcore.load(tmp_path / "m.safetensors", backend="auto")
    assert got["a"].backend.name == "q8only"  # highest priority that supports q8s
    assert got["b"].backend.name != "q8only"


def test_named_backend_that_cannot_hold_a_scheme(tmp_path, q8only):
    qcore.save(tmp_path / "m.safetensors", {"w": qcore.quantize(_x((4, 32)), "q4s", backend="reference")})
    with pytest.raises(UnsupportedSchemeError, match=r"tensor 'w': backend 'q8only' does not support q4s.*reference"):
        qcore.load(tmp_path / "m.safetensors", backend="q8only")


def test_unknown_backend(tmp_path):
    qcore.save(tmp_path / "m.safetensors", {"w": qcore.quantize(_x((4, 32)), "q8s", backend="reference")})
    with pytest.raises(BackendNotFoundError, match="no backend named 'nope'"):
        qcore.load(tmp_path / "m.safetensors", backend="nope")


def test_float_and_other_tensors_stay_as_they_are(tmp_path):
    arrays = {
        "f32": _x((3, 4)),
        "f16": _x((5,)).astype(np.float16),
        "bf16": _x((2, 3)).astype(ml_dtypes.bfloat16),
        "f64": _x((2,)).astype(np.float64),
        "ids": np.arange(6, dtype=np.int64).reshape(1, 6),
        "scalar": np.array(3.5, dtype=np.float32),
        "noncontig": _x((4, 6))[:, ::2],
    }
    qcore.save(tmp_path / "f.safetensors", arrays)
    back = qcore.load(tmp_path / "f.safetensors", backend="reference")
    assert list(back) == sorted(arrays)
    for k, a in arrays.items():
        assert back[k].dtype == a.dtype and back[k].shape == a.shape, k
        assert back[k].tobytes() == a.tobytes(order="C"), k


def test_empty_tensor(tmp_path):
    d = qcore.quantize(np.zeros((0, 32), np.float32), "q4s/block32:f16", backend="reference").to_data()
    qcore.save(tmp_path / "e.safetensors", {"e": d})
    assert qio.load_data(tmp_path / "e.safetensors")["e"] == d


def test_plain_safetensors_file_loads_as_arrays(tmp_path):
    save_file({"w": _x((2, 2))}, str(tmp_path / "plain.safetensors"), metadata={"format": "pt"})
    got = qcore.load(tmp_path / "plain.safetensors")
    assert isinstance(got["w"], np.ndarray)
    info = qio.read_info(tmp_path / "plain.safetensors")
    assert info.format_version is None and info.metadata == {"format": "pt"}


# ------------------------------------------------------------------------------ the header
def _header(path) -> dict:
    raw = open(path, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n])


def test_header_keys_are_documented_ones(tmp_path):
    q = qcore.quantize(_x((3, 45)), "q4s/block32:f16", backend="reference")
    qcore.save(tmp_path / "h.safetensors", {"layer.w": q, "layer.b": _x((45,))}, metadata={"model": "toy"})
    head = _header(tmp_path / "h.safetensors")
    assert head["__metadata__"] == {
        "model": "toy",
        "qcore.format_version": "1",
        "qcore.layer.w.scheme": "q4s/block32:f16",
        "qcore.layer.w.shape": "[3, 45]",
    }
    assert list(head["__metadata__"]) == sorted(head["__metadata__"])
    assert head["layer.w"]["dtype"] == "U8" and head["layer.w"]["shape"] == [q.nbytes]
    assert head["layer.b"]["dtype"] == "F32"
    info = qio.read_info(tmp_path / "h.safetensors")
    (b, w) = info.entries
    assert (w.name, w.quantized, w.shape, w.nbytes, str(w.scheme)) == ("layer.w", True, (3, 45), q.nbytes, "q4s/block32:f16")
    assert (b.name, b.quantized, b.dtype, b.shape) == ("layer.b", False, "F32", (45,))
    assert info.metadata == {"model": "toy"}


def test_same_input_same_bytes_across_processes(tmp_path):
    """safetensors writes its metadata map in hash order; qcore sorts it, so files are reproducible."""
    script = textwrap.dedent("""
        import sys, numpy as np, qcore
        x = np.linspace(-1, 1, 96, dtype=np.float32).reshape(3, 32)
        qcore.save(sys.argv[1], {f"t{i}": qcore.quantize(x, "q8s", backend="reference") for i in range(8)},
                   metadata={f"k{i}": str(i) for i in range(8)})
    """)
    digests = set()
    for i in range(3):
        p = tmp_path / f"{i}.safetensors"
        subprocess.run([sys.executable, "-c", script, str(p)], check=True)
        digests.add(hashlib.sha256(p.read_bytes()).hexdigest())
    assert len(digests) == 1


# ------------------------------------------------------------------------------ bad files
def _write_raw(path, tensors, metadata):
    save_file(tensors, str(path), metadata=metadata)
    return path


def _good(tmp_path):
    d = qcore.quantize(_x((3, 45)), "q4s/block32:f16", backend="reference").to_data()
    return d, np.frombuffer(d.payload, np.uint8).copy()


BAD = [
    ("version", lambda u8: ({"w": u8}, {"qcore.format_version": "2", "qcore.w.scheme": "q4s/block32:f16",
                                        "qcore.w.shape": "[3, 45]"}), r"format version '2' is not supported"),
    ("no-version", lambda u8: ({"w": u8}, {"qcore.w.scheme": "q4s/block32:f16", "qcore.w.shape": "[3, 45]"}),
     r"has qcore keys .* but no 'qcore.format_version'"),
    ("no-shape", lambda u8: ({"w": u8}, {"qcore.format_version": "1", "qcore.w.scheme": "q4s/block32:f16"}),
     r"tensor 'w' lacks the metadata key 'qcore.w.shape'"),
    ("bad-shape", lambda u8: ({"w": u8}, {"qcore.format_version": "1", "qcore.w.scheme": "q4s/block32:f16",
                                          "qcore.w.shape": "3x45"}), r"'qcore.w.shape' must be a JSON list"),
    ("bad-scheme", lambda u8: ({"w": u8}, {"qcore.format_version": "1", "qcore.w.scheme": "q5s",
                                           "qcore.w.shape": "[3, 45]"}), r"tensor 'w' has a bad scheme"),
    ("short", lambda u8: ({"w": u8[:-1]}, {"qcore.format_version": "1", "qcore.w.scheme": "q4s/block32:f16",
                                           "qcore.w.shape": "[3, 45]"}), r"needs a \d+-byte payload, the file holds \d+"),
    ("wrong-dtype", lambda u8: ({"w": u8.view(np.int8)}, {"qcore.format_version": "1",
                                                          "qcore.w.scheme": "q4s/block32:f16",
                                                          "qcore.w.shape": "[3, 45]"}), r"must be stored as 1-D U8, got I8"),
    ("missing-tensor", lambda u8: ({"v": u8}, {"qcore.format_version": "1", "qcore.w.scheme": "q4s/block32:f16",
                                               "qcore.w.shape": "[3, 45]"}), r"describes tensor 'w', which the file does not hold"),
    ("unknown-key", lambda u8: ({"w": u8}, {"qcore.format_version": "1", "qcore.w.scheme": "q4s/block32:f16",
                                            "qcore.w.shape": "[3, 45]", "qcore.w.zero": "1"}), r"unknown metadata key 'qcore.w.zero'"),
]


@pytest.mark.parametrize("make,match", [(m, r) for _, m, r in BAD], ids=[b[0] for b in BAD])
def test_bad_metadata(tmp_path, make, match):
    _, u8 = _good(tmp_path)
    tensors, meta = make(u8)
    path = _write_raw(tmp_path / "bad.safetensors", tensors, meta)
    with pytest.raises(InvalidDataError, match=match):
        qio.load_data(path)
    with pytest.raises(InvalidDataError, match=match):
        qio.read_info(path)


def test_bad_scale_in_payload(tmp_path):
    d, u8 = _good(tmp_path)
    scales_at = len(d.values_bytes())
    u8[scales_at:scales_at + 2] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)
    path = _write_raw(tmp_path / "nan.safetensors", {"w": u8}, {"qcore.format_version": "1",
                                                              "qcore.w.scheme": "q4s/block32:f16",
                                                              "qcore.w.shape": "[3, 45]"})
    with pytest.raises(InvalidDataError, match=r"tensor 'w': scale slot 0 of q4s/block32:f16 is nan"):
        qio.load_data(path)


@pytest.mark.parametrize("blob", [b"", b"\x00" * 4, b"not a safetensors file at all", b"\xff" * 64],
                         ids=["empty", "short", "text", "huge-header-length"])
def test_not_a_safetensors_file(tmp_path, blob):
    p = tmp_path / "junk.safetensors"
    p.write_bytes(blob)
    with pytest.raises(InvalidDataError, match="is not a valid safetensors file"):
        qcore.load(p)


def test_truncated_file(tmp_path):
    qcore.save(tmp_path / "t.safetensors", {"w": qcore.quantize(_x((64, 64)), "q8s", backend="reference")})
    raw = (tmp_path / "t.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(raw[: len(raw) - 100])
    with pytest.raises(InvalidDataError, match="is not a valid safetensors file"):
        qcore.load(tmp_path / "cut.safetensors")


def test_missing_file(tmp_path):
    with pytest.raises(qcore.StorageError, match="nope.safetensors") as e:
        qcore.load(tmp_path / "nope.safetensors")
    assert isinstance(e.value, FileNotFoundError.__mro__[1]) and e.value.errno == 2  # an OSError, ENOENT


# ------------------------------------------------------------------------------ save errors and atomicity
@pytest.mark.parametrize("tensors,metadata,match", [
    ([1, 2], None, r"save takes a dict of name -> tensor, got list"),
    ({"": np.zeros(2)}, None, r"tensor names must be non-empty strings"),
    ({"__metadata__": np.zeros(2)}, None, r"'__metadata__' is reserved"),
    ({"w": [1.0, 2.0]}, None, r"tensor 'w' is a list; save takes QTensor, QuantizedData or numpy arrays"),
    ({"w": np.array(["a"], dtype=object)}, None, r"tensor 'w' has dtype object"),
    ({"w": np.zeros(2)}, {"qcore.mine": "x"}, r"metadata key 'qcore.mine' uses the reserved prefix"),
    ({"w": np.zeros(2)}, {"k": 1}, r"metadata must map str -> str"),
    # a lone surrogate (what JSON's "\ud800" reads as) has no UTF-8 form: UnicodeEncodeError escaped before
    ({"w": np.zeros(2)}, {"k": "a\ud800"}, r"metadata value of key 'k' is not UTF-8 text \(surrogates not allowed "
                                           r"at position 1\); a safetensors header is UTF-8 JSON"),
    ({"w": np.zeros(2)}, {"\udcff": "v"}, r"metadata key is not UTF-8 text"),
    ({"w\ud800": np.zeros(2)}, None, r"tensor name 'w\\ud800' is not UTF-8 text"),
], ids=["not-a-dict", "empty-name", "reserved-name", "list", "object-dtype", "reserved-key", "non-str-value",
        "surrogate-value", "surrogate-key", "surrogate-name"])
def test_save_rejects_bad_input_and_writes_nothing(tmp_path, tensors, metadata, match):
    with pytest.raises(InputError, match=match):
        qcore.save(tmp_path / "out.safetensors", tensors, metadata)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("exc", [RuntimeError("disk on fire"), KeyboardInterrupt()], ids=["error", "ctrl-c"])
def test_interrupted_write_leaves_nothing(tmp_path, monkeypatch, exc):
    real = stfile.save_file

    def half_then_fail(arrays, tmp, metadata=None):
        real(arrays, tmp, metadata=metadata)
        with open(tmp, "r+b") as f:
            f.truncate(os.path.getsize(tmp) // 2)
        raise exc

    monkeypatch.setattr(stfile, "save_file", half_then_fail)  # the safetensors writer qcore.save calls
    with pytest.raises(type(exc)):
        qcore.save(tmp_path / "out.safetensors", {"w": _x((8, 8))})
    assert os.listdir(tmp_path) == []


def test_interrupted_overwrite_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "out.safetensors"
    qcore.save(path, {"w": _x((8, 8))})
    before = path.read_bytes()

    def fail(arrays, tmp, metadata=None):
        open(tmp, "wb").write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(stfile, "save_file", fail)
    with pytest.raises(KeyboardInterrupt):
        qcore.save(path, {"w": _x((8, 8), seed=1)})
    assert os.listdir(tmp_path) == ["out.safetensors"]
    assert path.read_bytes() == before


# ------------------------------------------------------------------------------ docs/format.md
DOC = os.path.join(ROOT, "docs", "format.md")


def test_doc_snippet_decodes_a_file_without_qcore(tmp_path, monkeypatch):
    import re

    code = re.search(r"```python\n(import json.*?)```", open(DOC).read(), re.S).group(1)
    q = qcore.quantize(_x((5, 7)), "q8s", backend="reference")
    monkeypatch.chdir(tmp_path)
    qcore.save("model.q8s.safetensors", {"w": q})
    ns: dict = {}
    exec(code, ns)
    np.testing.assert_array_equal(ns["w"], q.numpy())


def test_doc_example_header_sizes(tmp_path):
    x = _x((384, 1536))
    qcore.save(tmp_path / "ex.safetensors", {
        "encoder.layer.0.output.dense.weight": qcore.quantize(x, "q4s/block32:f16", backend="reference"),
        "encoder.layer.0.intermediate.dense.weight": qcore.quantize(x.T.copy(), "nvfp4", backend="reference"),
        "encoder.layer.0.output.dense.bias": np.zeros(384, np.float32),
    }, metadata={"format": "pt"})
    head = _header(tmp_path / "ex.safetensors")
    doc = open(DOC).read()
    for name, entry in head.items():
        if name != "__metadata__":
            assert f'"{name}":' in doc and f'"shape": {entry["shape"]}' in doc
            assert f'"data_offsets": {entry["data_offsets"]}' in doc
    for k, v in head["__metadata__"].items():
        assert f'"{k}": "{v}"' in doc
