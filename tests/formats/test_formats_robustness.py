"""Checkpoint formats on malformed input (defects a fuzz campaign found): every size or count a file
claims is checked against the file before anything is allocated or written, and a bad field is one
one-line `InvalidDataError` naming the tensor (or metadata key) and the field, never a plain Python
error, a MemoryError or a huge output.

Each file is built the way tests/test_formats_*.py build valid ones, small and in tmp_path, with
one field corrupted.
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

import qcore
import qcore.formats as qf
from qcore import InvalidDataError, QCoreError
from qcore.cli.main import main
from qcore.files.stfile import Reader

MB = 1 << 20
NF4 = np.asarray(qcore.scheme("nf4").table, np.float32)
DEEP = "[" * 100_000 + "]" * 100_000  # 200 KB of JSON nested deeper than Python's parser goes


def _one_line(e: BaseException) -> str:
    text = str(e)
    assert "\n" not in text, text
    return text


def _arrays(path) -> dict[str, np.ndarray]:
    with Reader(str(path)) as r:
        return {n: r.read(n) for n in r.tensors}


def _metadata(path) -> dict[str, str]:
    with safe_open(str(path), "np") as f:
        return dict(f.metadata() or {})


# ------------------------------------------------------------------------------------- GGUF writer
@pytest.fixture
def gguf():
    return pytest.importorskip("gguf", reason="the gguf package is not installed (pip install 'qcore-quant[formats]')")


def _with_kv(tmp_path, kv, name="src.safetensors") -> str:
    """A qcore file of one small float tensor whose metadata carries `gguf.kv` (a JSON text or value)."""
    path = str(tmp_path / name)
    text = kv if isinstance(kv, str) else json.dumps(kv)
    qcore.save(path, {"w": np.zeros((1, 32), np.float32)}, metadata={"gguf.kv": text})
    return path


@pytest.mark.parametrize("alignment,vtype", [(2**17, "UINT32"), (0, "UINT32"), (3, "UINT32"), (48, "UINT32"),
                                             (32, "STRING"), (32, "UINT64")],
                         ids=["131072", "zero", "three", "48", "as-string", "as-uint64"])
def test_gguf_alignment_from_metadata_is_checked_before_writing(tmp_path, gguf, alignment, vtype):
    """`general.alignment` pads every tensor: it must be a UINT32 power of two (gguf's reader and
    llama.cpp require both) of at most 65536; else nothing is written. (Values of 2**30 and more run
    in a capped child below: a regression would pad to gigabytes.)"""
    src = _with_kv(tmp_path, [["general.alignment", vtype, None, str(alignment) if vtype == "STRING" else alignment]])
    with pytest.raises(InvalidDataError, match=r"metadata 'gguf.kv': key 'general.alignment'") as e:
        qcore.convert(src, tmp_path / "out.gguf", "gguf")
    assert "power of two" in _one_line(e.value) or "UINT32" in str(e.value)
    assert sorted(os.listdir(tmp_path)) == ["src.safetensors"]  # no output, no temp file left behind


@pytest.mark.parametrize("alignment", [1, 64, 2**16])
def test_gguf_alignment_from_metadata_within_bounds_is_kept(tmp_path, gguf, alignment):
    src = _with_kv(tmp_path, [["general.alignment", "UINT32", None, alignment]])
    qcore.convert(src, tmp_path / "out.gguf", "gguf")
    r = gguf.GGUFReader(str(tmp_path / "out.gguf"))
    assert r.alignment == alignment and r.data_offset % alignment == 0
    assert os.path.getsize(tmp_path / "out.gguf") <= 2 * alignment + 4096


def _limits() -> None:  # in the child: 1 GiB of address space, 16 MiB files (qcore's convert needs ~200 MB)
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 * MB, 16 * MB))


def _capped(code: str, *args: str) -> subprocess.CompletedProcess:
    """Run Python `code` with `args` in a child whose memory and file sizes are capped (`_limits`),
    for inputs that made qcore allocate or write gigabytes: even a regression ends in a second."""
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120,
                          preexec_fn=_limits, env={**os.environ, "QCORE_BACKEND": "reference"})


@pytest.mark.parametrize("alignment", [2**30, 2**31])
def test_cli_gguf_huge_alignment_is_one_line_error_fast(tmp_path, gguf, alignment):
    """The fuzz case: `general.alignment = 2**30` in a ~300-byte file made `qcore convert --to gguf`
    run 96 s, peak at 9 GiB and write 2 GiB, exit 0."""
    src = _with_kv(tmp_path, [["general.architecture", "STRING", None, "llama"],
                              ["general.alignment", "UINT32", None, alignment]])
    assert os.path.getsize(src) < 512
    p = _capped("import sys; from qcore.cli.main import main; sys.exit(main())",
                "convert", src, str(tmp_path / "out.gguf"), "--to", "gguf")
    assert p.returncode == 1, p.stdout + p.stderr
    assert p.stderr.strip().splitlines() == [
        "qcore: error: metadata 'gguf.kv': key 'general.alignment' must be a power of two from 1 to 65536 "
        f"(gguf's default is 32), got {alignment}; drop it to use the default"]
    assert sorted(os.listdir(tmp_path)) == ["src.safetensors"]


BAD_KV = [  # (gguf.kv JSON value, what the message names)
    ({"general.name": "x"}, r"must be a JSON list of \[key, type, item type or null, value\]"),
    ([["general.name", "STRING"]], r"entry 0 must be \[key, type, item type or null, value\]"),
    ([[5, "STRING", None, "x"]], r"entry 0 must be \[key"),
    ([["a.key", "NOPE", None, 1]], r"key 'a.key': unknown GGUF value type 'NOPE'"),
    ([["a.key", "UINT8", None, 300]], r"key 'a.key': 300 is not a GGUF UINT8 value"),
    ([["a.key", "INT32", None, 1.5]], r"key 'a.key': 1.5 is not a GGUF INT32 value"),
    ([["a.key", "UINT32", None, True]], r"key 'a.key': True is not a GGUF UINT32 value"),
    ([["a.key", "FLOAT32", None, 1e300]], r"key 'a.key': 1e\+300 is not a GGUF FLOAT32 value"),
    ([["a.key", "BOOL", None, 1]], r"key 'a.key': 1 is not a GGUF BOOL value"),
    ([["a.key", "STRING", None, 5]], r"key 'a.key': 5 is not a GGUF STRING value"),
    ([["a.key", "STRING", None, "\ud800"]], r"key 'a.key': .* is not a GGUF STRING value"),
    ([["general.architecture", "STRING", None, 5]], r"key 'general.architecture': 5 is not a GGUF STRING value"),
    ([["general.architecture", "UINT32", None, 5]], r"key 'general.architecture' must be a STRING"),
    ([["a.key", "ARRAY", "INT32", ["a"]]], r"key 'a.key': item 0, 'a', is not a GGUF INT32 value"),
    ([["a.key", "ARRAY", "INT32", 5]], r"key 'a.key': an ARRAY value must be a JSON list, got 5"),
    ([["a.key", "ARRAY", "ARRAY", [[1]]]], r"key 'a.key': item type 'ARRAY' is not a GGUF scalar or STRING"),
    ([["a.key", "UINT32", None, 1], ["a.key", "UINT32", None, 2]], r"key 'a.key' appears twice"),
]


@pytest.mark.parametrize("kv,match", BAD_KV, ids=[f"kv{i}" for i in range(len(BAD_KV))])
def test_gguf_malformed_kv_entries_are_invalid_data(tmp_path, gguf, kv, match):
    """Entries the source file carried that gguf's writer cannot pack as they claim: KeyError, ValueError,
    struct.error, TypeError, OverflowError and UnicodeEncodeError before; one InvalidDataError now."""
    src = _with_kv(tmp_path, kv)
    with pytest.raises(InvalidDataError, match=match) as e:
        qcore.convert(src, tmp_path / "out.gguf", "gguf")
    assert _one_line(e.value).startswith("metadata 'gguf.kv'")
    assert sorted(os.listdir(tmp_path)) == ["src.safetensors"]


def test_gguf_kv_nested_too_deeply_is_invalid_data(tmp_path, gguf):
    src = _with_kv(tmp_path, DEEP)
    with pytest.raises(InvalidDataError, match=r"metadata 'gguf.kv' is not JSON \(nested too deeply"):
        qcore.convert(src, tmp_path / "out.gguf", "gguf")


def test_cli_gguf_malformed_kv_is_one_line(tmp_path, gguf, capsys):
    src = _with_kv(tmp_path, [["a.key", "NOPE", None, 1]])
    assert main(["convert", src, str(tmp_path / "out.gguf"), "--to", "gguf"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == ["qcore: error: metadata 'gguf.kv': key 'a.key': unknown GGUF value type 'NOPE'; "
                                "expected one of UINT8, INT8, UINT16, INT16, UINT32, INT32, UINT64, INT64, FLOAT32, "
                                "FLOAT64, BOOL, STRING, ARRAY"]


def test_gguf_empty_array_is_dropped_as_gguf_add_array_does(tmp_path, gguf):
    """A GGUF file may hold an empty array (gguf's reader reads one), which gguf's writer cannot
    pack ("Empty array"): it is left out, as `GGUFWriter.add_array` leaves it out; the rest is kept."""
    src = _with_kv(tmp_path, [["a.empty", "ARRAY", "ARRAY", []], ["a.list", "ARRAY", "INT32", [1, 2]],
                              ["a.name", "STRING", None, "x"]])
    qcore.convert(src, tmp_path / "out.gguf", "gguf")
    fields = gguf.GGUFReader(str(tmp_path / "out.gguf")).fields
    assert "a.empty" not in fields
    assert fields["a.list"].contents() == [1, 2] and fields["a.name"].contents() == "x"


# ----------------------------------------------------------------------------------- bitsandbytes
def _bnb_file(path, state: dict, nested: dict | None = None) -> str:
    """A [2, 64] nf4 weight 'w' in bitsandbytes' layout (blocksize 64), its quant_state updated by
    `state`; with `nested` (sizes of nested_absmax), double quant: 2 absmax codes."""
    packed = np.arange(64, dtype=np.uint8).reshape(-1, 1)
    full = {"quant_type": "nf4", "blocksize": 64, "dtype": "float32", "shape": [2, 64]}
    tensors = {"w": packed, "w.quant_map": NF4}
    if nested is None:
        tensors["w.absmax"] = np.asarray([1.0, 2.0], np.float32)
    else:
        full.update(nested_blocksize=256, nested_dtype="float32", nested_offset=0.5)
        tensors["w.absmax"] = np.asarray([10, 200], np.uint8)
        tensors["w.nested_absmax"] = np.full(nested.get("size", 1), 0.25, np.float32)
        tensors["w.nested_quant_map"] = np.linspace(-1, 1, 256, dtype=np.float32)
    full.update(state)
    tensors["w.quant_state.bitsandbytes__nf4"] = np.frombuffer(json.dumps(full).encode(), np.uint8)
    save_file(tensors, str(path))
    return str(path)


def _peak(fn):
    """(fn(), its peak traced allocation in bytes)."""
    tracemalloc.start()
    try:
        return fn(), tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_bnb_huge_nested_blocksize_allocates_nothing_extra(tmp_path):
    """A `nested_blocksize` far beyond the absmax codes (consistent: 2 codes, one nested absmax):
    `2**28` in a 7 KB file allocated 1 GiB (2**24 here: 64 MiB, should this come back); the same
    absmax comes out of a few bytes now, as with the usual 256."""
    want = qf.read(_bnb_file(tmp_path / "a.safetensors", {}, nested={})).tensors["w"]
    path = _bnb_file(tmp_path / "b.safetensors", {"nested_blocksize": 2**24}, nested={})
    got, peak = _peak(lambda: qf.read(path).tensors["w"])
    assert peak < 8 * MB, f"{peak / MB:.0f} MiB"
    assert got.payload == want.payload


def test_bnb_nested_blocksize_is_checked_against_the_nested_absmax(tmp_path):
    """`nested_blocksize = 2**33` with 2 nested absmax values (2 codes need 1): a plain MemoryError
    (64 GiB asked for) before; now the count is checked before anything is allocated. In a capped
    child: a regression must not find a machine with 64 GiB to fill."""
    path = _bnb_file(tmp_path / "m.safetensors", {"nested_blocksize": 2**33}, nested={"size": 2})
    p = _capped("import sys, qcore, qcore.formats as qf\n"
                "try:\n    qf.read(sys.argv[1])\n"
                "except qcore.QCoreError as e:\n    print(type(e).__name__, e, sep=': ')", path)
    assert p.returncode == 0 and p.stderr == "", p.stderr
    assert p.stdout == (f"InvalidDataError: {path}: bitsandbytes tensor 'w': double quant of 'w': 2 absmax codes in "
                        "blocks of 8589934592 (quant_state 'nested_blocksize') need 1 nested absmax values and a "
                        "256-entry map, got 2 and 256\n")


BAD_STATE = [  # (quant_state fields, double quant?, the field the message names)
    ({"blocksize": 0}, False, "blocksize"),
    ({"blocksize": -64}, False, "blocksize"),
    ({"blocksize": 64.5}, False, "blocksize"),
    ({"blocksize": True}, False, "blocksize"),
    ({"blocksize": "64"}, False, "blocksize"),
    ({"blocksize": 2**70}, False, "blocksize"),
    ({"shape": 5}, False, "shape"),
    ({"shape": [-2, -64]}, False, "shape"),
    ({"shape": [-1, -128]}, False, "shape"),
    ({"shape": ["a"]}, False, "shape"),
    ({"shape": [2.0, 64.0]}, False, "shape"),
    ({"shape": []}, False, "shape"),
    ({"shape": [2**70]}, False, "shape"),
    ({"shape": [2**32, 2**32, 64]}, False, "shape"),
    ({"nested_blocksize": 0}, True, "nested_blocksize"),
    ({"nested_blocksize": -1}, True, "nested_blocksize"),
    ({"nested_blocksize": "x"}, True, "nested_blocksize"),
    ({"nested_blocksize": 1.5}, True, "nested_blocksize"),
    ({"nested_offset": "abc"}, True, "nested_offset"),
    ({"nested_offset": [1]}, True, "nested_offset"),
    ({"nested_offset": None}, True, "nested_offset"),
    ({"nested_offset": 1e300}, True, "nested_offset"),
    ({"nested_offset": 10**400}, True, "nested_offset"),
]


@pytest.mark.parametrize("state,nested,field", BAD_STATE, ids=[f"{next(iter(s))}={s[next(iter(s))]!r}"[:40]
                                                               for s, _, _ in BAD_STATE])
def test_bnb_malformed_quant_state_fields_are_invalid_data(tmp_path, state, nested, field):
    path = _bnb_file(tmp_path / "m.safetensors", state, nested={} if nested else None)
    with pytest.raises(InvalidDataError, match=rf"m.safetensors: bitsandbytes tensor 'w': .*quant_state '{field}'") \
            as e:
        qf.read(path)
    _one_line(e.value)


def test_bnb_quant_state_nested_too_deeply_is_invalid_data(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"w": np.zeros((1, 1), np.uint8), "w.absmax": np.ones(1, np.float32), "w.quant_map": NF4,
               "w.quant_state.bitsandbytes__nf4": np.frombuffer(DEEP.encode(), np.uint8)}, str(path))
    with pytest.raises(InvalidDataError, match=r"'w.quant_state.bitsandbytes__nf4' is not JSON \(nested too deeply"):
        qf.read(path)


# ---------------------------------------------------------------------------------------- torchao
@pytest.fixture
def torchao_file(tmp_path):
    """(arrays, metadata, a writer of a variant) of a small torchao NVFP4 file that qcore wrote."""
    x = np.random.default_rng(2).standard_normal((8, 64)).astype(np.float32)
    q = qcore.quantize(x, "nvfp4", backend="reference").to_data()
    qcore.save(tmp_path / "a.safetensors", {"m.w": q, "m.b": np.zeros(8, np.float32)})
    qf.convert(tmp_path / "a.safetensors", tmp_path / "t.safetensors", "torchao")
    arrays, meta = _arrays(tmp_path / "t.safetensors"), _metadata(tmp_path / "t.safetensors")

    def variant(meta_update=None, drop=()) -> str:
        path = str(tmp_path / "v.safetensors")
        save_file({k: v for k, v in arrays.items() if k not in drop}, path, metadata={**meta, **(meta_update or {})})
        return path

    return arrays, meta, variant


def _info(meta, **update) -> str:
    return json.dumps({**json.loads(meta["m.w"]), **update})


TORCHAO_BAD = [  # (metadata update or a tensor to drop, what the message says)
    (lambda m: {"m.w": _info(m, _data="abc")}, r"torchao tensor 'm.w': '_data' must be a JSON object"),
    (lambda m: {"m.w": _info(m, _data=[1])}, r"torchao tensor 'm.w': '_data' must be a JSON object"),
    (lambda m: {"tensor_names": json.dumps([["m.w"], "m.b"])}, r"metadata 'tensor_names' must be a list of "
                                                               r"distinct tensor names, got \[\['m.w'\], 'm.b'\]"),
    (lambda m: {"tensor_names": json.dumps(5)}, r"metadata 'tensor_names' must be a list"),
    (lambda m: {"tensor_names": json.dumps({"m.w": 1})}, r"metadata 'tensor_names' must be a list"),
    (lambda m: {"tensor_names": json.dumps(["m.w", 7])}, r"metadata 'tensor_names' must be a list"),
    (lambda m: {"tensor_names": json.dumps(["m.w", "m.w", "m.b"])}, r"metadata 'tensor_names' must be a list of "
                                                                    r"distinct"),
    (lambda m: {"tensor_names": json.dumps(["m.w", "m.b", "m.x"])}, r"metadata 'tensor_names' lists 'm.x', which "
                                                                    r"has no metadata entry"),
    (lambda m: {"tensor_names": "[1"}, r"metadata 'tensor_names' is not JSON"),
    (lambda m: {"m.w": _info(m, _tensor_data_names="qdata")}, r"torchao tensor 'm.w': '_tensor_data_names' must be "
                                                              r"a list of field names"),
    (lambda m: {"m.w": _info(m, _tensor_data_names=5)}, r"'_tensor_data_names' must be a list of field names"),
    (lambda m: {"m.w": _info(m, _tensor_data_names=[1])}, r"'_tensor_data_names' must be a list of field names"),
    (lambda m: {"m.b": json.dumps([1])}, r"torchao tensor 'm.b': its metadata must be a JSON object such as "
                                              r"\{\"_type\": \"Tensor\"\}, got \[1\]"),
    (lambda m: {"m.b": DEEP}, r"metadata 'm.b' is not JSON \(nested too deeply"),
    ("m._w_per_tensor_scale", r"torchao tensor 'm.w': lacks 'm._w_per_tensor_scale', which '_tensor_data_names' "
                              r"lists"),
]


@pytest.mark.parametrize("bad,match", TORCHAO_BAD, ids=[f"case{i}" for i in range(len(TORCHAO_BAD))])
def test_torchao_malformed_metadata_is_invalid_data(torchao_file, bad, match):
    arrays, meta, variant = torchao_file
    path = variant(drop=(bad,)) if isinstance(bad, str) else variant(bad(meta))
    with pytest.raises(InvalidDataError, match=match) as e:
        qf.read(path, "torchao")
    assert _one_line(e.value).startswith(path)


def test_torchao_writer_checks_the_attributes_it_carries(tmp_path, torchao_file):
    """`torchao.tensors` (the attributes kept from a read) must hold an object per weight, whose
    block_size (written as it is) is NVFP4's 16: a list was a TypeError, 32 a file torchao misreads."""
    ck = qf.read(tmp_path / "t.safetensors")
    for bad, shown in (([1], r"\[1\]"), ({"block_size": 32}, r"\{'block_size': 32\}")):
        ck.metadata["torchao.tensors"] = json.dumps({"m.w": bad})
        with pytest.raises(InvalidDataError, match=r"metadata 'torchao.tensors': the entry of tensor 'm.w' must be a "
                                                   r"JSON object of NVFP4Tensor attributes \(block_size 16 or "
                                                   rf"absent\), got {shown}") as e:
            qf.write(tmp_path / "o.safetensors", ck, "torchao")
        _one_line(e.value)
        assert not (tmp_path / "o.safetensors").exists()


# ----------------------------------------------------------------------------- compressed-tensors
@pytest.fixture
def ct_file(tmp_path):
    """(arrays, a writer of a variant) of a small int4 pack-quantized module 'l' that qcore wrote."""
    x = np.random.default_rng(2).standard_normal((4, 64)).astype(np.float32)
    q = qcore.quantize(x, "q4f/block32:f16/packed_u32", backend="reference").to_data()
    qf.write(tmp_path / "m.safetensors", {"l.weight": q}, "compressed-tensors")
    arrays = _arrays(tmp_path / "m.safetensors")
    assert arrays["l.weight_shape"].tolist() == [4, 64]

    def variant(**update) -> str:
        save_file({**arrays, **update}, str(tmp_path / "m.safetensors"))
        return str(tmp_path / "m.safetensors")

    return arrays, variant


@pytest.mark.parametrize("shape", [[np.nan, 64.0], [4.0, np.inf], [4.0, -np.inf], [4.5, 64.0], [-4, 64],
                                   [True, True]], ids=["nan", "inf", "-inf", "fraction", "negative", "bool"])
def test_ctensors_weight_shape_must_be_whole_numbers(ct_file, shape):
    arrays, variant = ct_file
    path = variant(**{"l.weight_shape": np.asarray(shape)})
    with pytest.raises(InvalidDataError, match=r"module 'l': weight_shape must hold whole numbers >= 0") as e:
        qf.read(path, "compressed-tensors")
    _one_line(e.value)


def test_ctensors_whole_float_weight_shape_reads(ct_file):
    arrays, variant = ct_file
    assert qf.read(variant(**{"l.weight_shape": np.asarray([4.0, 64.0])})).tensors["l.weight"].shape == (4, 64)


def test_ctensors_config_json_nested_too_deeply_is_invalid_data(tmp_path, ct_file):
    (tmp_path / "config.json").write_text('{"quantization_config": ' + DEEP + "}")
    with pytest.raises(InvalidDataError, match=r"config.json is nested too deeply for Python's JSON parser, so its "
                                               r"'quantization_config' cannot be read") as e:
        qf.read(tmp_path / "m.safetensors", "compressed-tensors")
    _one_line(e.value)


def test_ctensors_writer_checks_the_module_names_it_carries(tmp_path, ct_file):
    ck = qf.read(tmp_path / "m.safetensors")
    ck.metadata["compressed-tensors.names"] = json.dumps({"l.weight": 5})
    (tmp_path / "o").mkdir()
    with pytest.raises(InvalidDataError, match=r"metadata 'compressed-tensors.names': the entry of tensor 'l.weight' "
                                               r"must be a module name \(a non-empty string\), got 5"):
        qf.write(tmp_path / "o" / "m.safetensors", ck, "compressed-tensors")
    assert os.listdir(tmp_path / "o") == []


def test_gpt_oss_writer_checks_the_names_it_carries(tmp_path):
    q = qcore.quantize(np.ones((2, 32), np.float32), "mxfp4", backend="reference").to_data()
    qcore.save(tmp_path / "a.safetensors", {"w": q}, metadata={"gpt-oss.names": json.dumps({"w": ["only-one"]})})
    (tmp_path / "o").mkdir()
    with pytest.raises(InvalidDataError, match=r"metadata 'gpt-oss.names': the entry of tensor 'w' must be "
                                               r"\[blocks key, scales key\]"):
        qcore.convert(tmp_path / "a.safetensors", tmp_path / "o" / "m.safetensors", "gpt-oss")
    assert os.listdir(tmp_path / "o") == []


# ------------------------------------------------------------------------ JSON nested too deeply
def test_a_safetensors_header_nested_too_deeply_is_not_detected(tmp_path):
    """Detection parses the header itself: a RecursionError escaped `qf.read` before."""
    header = ('{"a":' * 5000 + "1" + "}" * 5000).encode()
    (tmp_path / "d.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(QCoreError) as e:
        qf.read(tmp_path / "d.safetensors")
    _one_line(e.value)


@pytest.mark.parametrize("key,to", [("bitsandbytes.dtypes", "bitsandbytes"), ("torchao.tensors", "torchao"),
                                    ("compressed-tensors.names", "compressed-tensors"),
                                    ("gpt-oss.names", "gpt-oss")])
def test_carried_metadata_nested_too_deeply_is_not_json(tmp_path, key, to):
    """Writers take the JSON they carry in metadata as absent when it is not JSON (`_st.pop_json`),
    text nested too deeply included (a RecursionError before)."""
    qcore.save(tmp_path / "a.safetensors", {"w": np.ones((2, 64), np.float32)}, metadata={key: DEEP})
    (tmp_path / "o").mkdir()
    qcore.convert(tmp_path / "a.safetensors", tmp_path / "o" / "m.safetensors", to)
    assert np.array_equal(qf.read(tmp_path / "o" / "m.safetensors", to).tensors["w"], np.ones((2, 64), np.float32))


def test_a_missing_source_is_a_storage_error(tmp_path):
    """qcore.convert and qcore.formats.read of a path that does not exist raise StorageError (a
    QCoreError and an OSError with ENOENT), not a bare FileNotFoundError."""
    import errno

    import qcore.formats as qf

    for call in (lambda: qcore.convert(tmp_path / "nope", tmp_path / "out.gguf", to="gguf"),
                 lambda: qf.read(tmp_path / "nope.safetensors")):
        with pytest.raises(qcore.StorageError, match="No such file") as e:
            call()
        assert e.value.errno == errno.ENOENT


@pytest.mark.parametrize("name", [".", ".."])
def test_an_index_naming_its_own_folder_is_invalid_data(tmp_path, name):
    """An index whose weight_map names "." or ".." is refused, not followed (it recursed without end)."""
    import qcore.formats as qf

    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": name}}))
    with pytest.raises(qcore.InvalidDataError, match="must name shard files"):
        qf.read(tmp_path)
