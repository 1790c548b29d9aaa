"""Fuzzing the readers of files from strangers (hypothesis): the foreign formats
(`qcore.formats.read` of bitsandbytes, torchao, compressed-tensors, gpt-oss and GGUF files), the
GGUF writer's carried metadata, the streaming safetensors reader (`qcore/files/stfile.py`) with the
model pipeline on top of it, and recipes (dicts, TOML files, rule text).

The property everywhere: only `QCoreError` subclasses escape, each with a one-line message; no
case allocates more than 8 MiB (tracemalloc; every input is a few KB, so a case that believed a
size claim would need gigabytes) or writes more than 64 KiB; what a reader accepts also decodes,
and what the GGUF writer writes reads back. Counts and switches as in tests/fuzzing.py
(`QCORE_FUZZ_EXAMPLES`, `QCORE_FUZZ_REPORT`); CI runs the defaults below.
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from safetensors.numpy import save_file

import qcore
import qcore.formats as qf
from qcore import QuantizedData
from qcore.model.recipe import Recipe, Rule, as_recipe
from qcore.backend.reference import ReferenceBackend
from qcore.files.stfile import Reader
from tests.fuzzing import (
    DEEP, HOSTILE, Stats, fuzz_settings, join_safetensors, mutate_bytes, mutate_json, mutate_json_text,
    mutate_st_header, only_qcore_errors, split_safetensors,
)

REF = ReferenceBackend()
OUT_LIMIT = 64 << 10


@pytest.fixture
def folder():
    d = tempfile.mkdtemp(prefix="qcore-fuzz-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _reset(folder: str, files: dict[str, bytes]) -> None:
    """`folder` holding exactly `files` (name -> bytes)."""
    for name in os.listdir(folder):
        p = os.path.join(folder, name)
        shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.unlink(p)
    for name, raw in files.items():
        with open(os.path.join(folder, name), "wb") as f:
            f.write(raw)


def _decode_all(ck, stats: Stats) -> None:
    """Every quantized tensor a reader accepted decodes on the reference (or is refused as data)."""
    for t in ck.tensors.values():
        if isinstance(t, QuantizedData) and t.nbytes < (1 << 20):
            only_qcore_errors(lambda: REF.from_data(t).numpy(), tally=stats)


def _read_and_decode(path: str, fmt: str, stats: Stats) -> None:
    """`qcore.formats.read` with the format detected, then named `fmt`; what it reads decodes."""
    for name in (None, fmt):
        ck = only_qcore_errors(qf.read, path, name, tally=stats)
        if ck is not None:
            _decode_all(ck, stats)


def _inspect_one_line(path: str, capsys) -> None:
    from qcore.cli.main import main

    rc = main(["inspect", path])
    _, err = capsys.readouterr()
    assert rc in (0, 1) and "Traceback" not in err, err[-2000:]
    assert rc == 0 or (len(err.strip().splitlines()) == 1 and err.startswith("qcore: error: ")), err[-2000:]


# ------------------------------------------------------------------------------ base files
X = np.random.default_rng(3).standard_normal((4, 64)).astype(np.float32)


def _read_folder(d: str) -> dict[str, bytes]:
    return {n: open(os.path.join(d, n), "rb").read() for n in sorted(os.listdir(d))}


def _bnb_double_quant() -> dict[str, bytes]:
    """bitsandbytes nf4 with double quant (as bitsandbytes lays it out; qcore writes single quant)."""
    state = {"quant_type": "nf4", "blocksize": 64, "dtype": "float32", "shape": [2, 64], "nested_blocksize": 256,
             "nested_dtype": "float32", "nested_offset": 0.5}
    tensors = {"w": np.arange(64, dtype=np.uint8).reshape(-1, 1),
               "w.quant_map": np.asarray(qcore.scheme("nf4").table, np.float32),
               "w.absmax": np.asarray([10, 200], np.uint8), "w.nested_absmax": np.full(1, 0.25, np.float32),
               "w.nested_quant_map": np.linspace(-1, 1, 256, dtype=np.float32),
               "w.quant_state.bitsandbytes__nf4": np.frombuffer(json.dumps(state).encode(), np.uint8)}
    with tempfile.TemporaryDirectory() as d:
        save_file(tensors, os.path.join(d, "m.safetensors"))
        return _read_folder(d)


@functools.lru_cache(maxsize=None)
def bases() -> dict[str, tuple[str, dict[str, bytes]]]:
    """id -> (format, the files of its folder), each written by qcore's own writer from a small
    quantized weight 'm.w' and a float 'm.b' (plus bitsandbytes' double quant, built by hand)."""
    out: dict[str, tuple[str, dict[str, bytes]]] = {"bitsandbytes-double": ("bitsandbytes", _bnb_double_quant())}
    made = [("bitsandbytes", "nf4", X), ("bitsandbytes", "q4s-lookup[nf4]/block64:f32:flat", X[:3, :50]),
            ("torchao", "nvfp4", X),
            ("compressed-tensors", "q4f/block32:f16/packed_u32", X),
            ("compressed-tensors", "q8f/block32:bf16/packed_u32/zero", X),
            ("compressed-tensors", "e4m3/block32:f16", X),
            ("compressed-tensors", "e2m1/block16:ue4m3/tensor:f32:recip/packed_native", X),
            ("gpt-oss", "mxfp4", X)]
    try:
        import gguf  # noqa: F401
        made += [("gguf", "q8s/block32:f16", X), ("gguf", "mxfp4", X), ("gguf", "q4_0", X),
                 ("gguf", "u4/block32:f16/min:f16", X)]
    except ImportError:
        pass
    for fmt, text, x in made:
        with tempfile.TemporaryDirectory() as d:
            src, dst = os.path.join(d, "src.safetensors"), os.path.join(d, "out")
            os.mkdir(dst)
            qcore.save(src, {"m.w": REF.quantize(x, text), "m.b": x[0]})
            qf.convert(src, os.path.join(dst, "m.gguf" if fmt == "gguf" else "m.safetensors"), fmt)
            out[f"{fmt}-{text}-{x.shape[0]}x{x.shape[1]}"] = (fmt, _read_folder(dst))
    return out


def _st_bases() -> list[str]:
    return sorted(k for k, (fmt, _) in bases().items() if fmt != "gguf")


def _gguf_bases() -> list[str]:
    return sorted(k for k, (fmt, _) in bases().items() if fmt == "gguf")


# ------------------------------------------------------------------------------ tensor contents
def _tensors(raw: bytes) -> tuple[dict, dict[str, bytes]]:
    """(header, name -> its data bytes) of a valid safetensors file."""
    head, body = split_safetensors(raw)
    return head, {n: body[e["data_offsets"][0]:e["data_offsets"][1]] for n, e in head.items() if n != "__metadata__"}


def _rebuild(head: dict, data: dict[str, bytes]) -> bytes:
    pos, body = 0, []
    for n, b in data.items():
        head[n]["data_offsets"] = [pos, pos + len(b)]
        body.append(b)
        pos += len(b)
    return join_safetensors(head, b"".join(body))


HOSTILE_ARRAYS = [  # (dtype name, numpy values) a tensor's contents may be replaced with
    ("F32", np.asarray([np.nan, np.inf], np.float32)), ("F32", np.zeros(0, np.float32)),
    ("F32", np.asarray([-1.0, 2.5, 1e38], np.float32)), ("I64", np.asarray([2**62, -1], np.int64)),
    ("I32", np.asarray([-2**31, 2**31 - 1, 0, 7], np.int32)), ("U8", np.arange(255, dtype=np.uint8)),
    ("F16", np.asarray([65504, -0.0], np.float16)), ("F64", np.asarray([1e300, np.nan], np.float64)),
    ("U8", np.frombuffer(DEEP.encode(), np.uint8)), ("U8", np.frombuffer(b'{"blocksize": 0}', np.uint8)),
]


def mutate_tensor(data, raw: bytes) -> bytes:
    """One tensor's contents changed: a JSON tensor (bitsandbytes' quant_state) mutated as a document;
    else replaced with hostile values, cut, doubled, or read as another dtype or shape."""
    head, blobs = _tensors(raw)
    name = data.draw(st.sampled_from(sorted(blobs)))
    e, blob = head[name], blobs[name]
    try:
        doc = json.loads(blob.decode()) if e["dtype"] == "U8" and blob[:1] in (b"{", b"[") else None
    except ValueError:
        doc = None
    how = data.draw(st.sampled_from(["json" if doc is not None else "replace", "replace", "cut", "double",
                                     "reshape", "redtype"]))
    if how == "json":
        blob = json.dumps(mutate_json(data, doc)).encode()
        e["shape"] = [len(blob)]
    elif how == "replace":
        e["dtype"], arr = data.draw(st.sampled_from(HOSTILE_ARRAYS))
        blob, e["shape"] = arr.tobytes(), list(arr.shape)
    elif how == "cut":
        blob = blob[: data.draw(st.integers(0, max(0, len(blob) - 1)))]
        e["dtype"], e["shape"] = "U8", [len(blob)]
    elif how == "double":
        blob += blob
        e["shape"] = [2 * e["shape"][0], *e["shape"][1:]] if e["shape"] else [2]
    elif how == "reshape":
        n = int(np.prod(e["shape"], dtype=np.int64))
        e["shape"] = data.draw(st.sampled_from([[n], [1, n], [n, 1], [1, 1, n], []] if n == 1 else [[n], [1, n], [n, 1],
                                                                                                    [1, 1, n]]))
    else:
        e["dtype"] = "U8"
        e["shape"] = [len(blob)]
    blobs[name] = blob
    return _rebuild(head, blobs)


def _metadata_json_mutation(data, raw: bytes) -> bytes:
    """A metadata value that holds JSON (torchao's tensor entries, `tensor_names`, ...) mutated."""
    head, body = split_safetensors(raw)
    meta = head.get("__metadata__") or {}
    if not meta:
        return mutate_st_header(data, raw)
    key = data.draw(st.sampled_from(sorted(meta)))
    meta[key] = mutate_json_text(data, meta[key])
    return join_safetensors(head, body)


# ------------------------------------------------------------------------------ foreign formats
def test_fuzz_format_readers(folder, capsys):
    """bitsandbytes (single and double quant, a partial last block), torchao NVFP4,
    compressed-tensors (int4, int8 zero points, FP8, NVFP4) and gpt-oss files with one field of
    their tensors, header, metadata or config.json mutated, or their bytes."""
    stats = Stats("format-readers")
    path = os.path.join(folder, "m.safetensors")

    @fuzz_settings(400)
    @given(st.data())
    def run(data):
        fmt, files = bases()[data.draw(st.sampled_from(_st_bases()))]
        files = dict(files)
        how = data.draw(st.sampled_from(["tensor", "tensor", "header", "metadata", "config", "bytes"]))
        raw = files["m.safetensors"]
        if how == "tensor":
            files["m.safetensors"] = mutate_tensor(data, raw)
        elif how == "header":
            files["m.safetensors"] = mutate_st_header(data, raw)
        elif how == "metadata":
            files["m.safetensors"] = _metadata_json_mutation(data, raw)
        elif how == "config" and "config.json" in files:
            text = mutate_json_text(data, files["config.json"].decode())
            files["config.json"] = text.encode("utf-8", "surrogatepass")  # a lone surrogate as its bytes
        else:
            files["m.safetensors"] = mutate_bytes(data, raw)
        _reset(folder, files)
        with stats.case():
            _read_and_decode(path, fmt, stats)
        if stats.cases % 25 == 0:
            _inspect_one_line(path, capsys)

    run()
    stats.report()


# GGUF: value type -> byte size of the scalar types (gguf's GGUFValueType numbering)
_GGUF_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def gguf_fields(raw: bytes) -> list[tuple[int, int, str]]:
    """(offset, byte size, what) of every count, length, type, dim and offset in a valid GGUF file
    (little-endian): the fields a size claim lives in."""
    out = [(4, 4, "version"), (8, 8, "tensor count"), (16, 8, "kv count")]
    n_tensors, n_kv = struct.unpack_from("<QQ", raw, 8)
    pos = 24

    def field(size: int, what: str) -> int:
        nonlocal pos
        out.append((pos, size, what))
        v = int.from_bytes(raw[pos:pos + size], "little")
        pos += size
        return v

    def value(vtype: int, what: str) -> None:
        nonlocal pos
        if vtype == _GGUF_STRING:
            n = field(8, f"{what} length")  # (not `pos += field(...)`: that adds to pos as it was before)
            pos += n
        elif vtype == _GGUF_ARRAY:
            item = field(4, f"{what} item type")
            for _ in range(field(8, f"{what} count")):
                value(item, f"{what} item")
        else:
            field(_GGUF_SCALAR[vtype], what)

    for _ in range(n_kv):
        value(_GGUF_STRING, "key")
        value(field(4, "kv type"), "kv value")
    for _ in range(n_tensors):
        value(_GGUF_STRING, "tensor name")
        for _ in range(field(4, "tensor n_dims")):
            field(8, "tensor dim")
        field(4, "tensor type")
        field(8, "tensor offset")
    return out


def mutate_gguf(data, raw: bytes) -> bytes:
    """One count, length, type, dim or offset set to a hostile value, or the bytes mutated."""
    if data.draw(st.integers(0, 3)) == 0:
        return mutate_bytes(data, raw)
    pos, size, _ = data.draw(st.sampled_from(gguf_fields(raw)))
    old = int.from_bytes(raw[pos:pos + size], "little")
    top = (1 << (8 * size)) - 1
    new = data.draw(st.sampled_from([0, 1, 2, 3, 13, 31, 39, old + 1, max(old - 1, 0), old * 2, 2**31 - 1, 2**31,
                                     top >> 1, top]))
    return raw[:pos] + (new & top).to_bytes(size, "little") + raw[pos + size:]


def gguf_array_past_end(raw: bytes) -> bool:
    """Whether a kv array of `raw` (any bytes) claims more items than the rest of the file can hold.

    Open defect: gguf's `GGUFReader` walks such a count item by item, appending an empty part for
    every item past the end (a 600-byte file whose kv type turned from STRING into ARRAY grew past
    20 GiB), and qcore's GGUF reader hands it the file unchecked
    (`test_gguf_kv_array_count_is_checked_against_the_file`). Until it checks, the reader target
    leaves these files to that test."""
    try:
        n_tensors, n_kv = struct.unpack_from("<QQ", raw, 8)
    except struct.error:
        return False
    pos = 24

    def skip(vtype: int) -> bool:  # True: an array past the end; pos moved over the value
        nonlocal pos
        if vtype == _GGUF_STRING:
            pos += 8 + struct.unpack_from("<Q", raw, pos)[0]
        elif vtype == _GGUF_ARRAY:
            item, count = struct.unpack_from("<IQ", raw, pos)
            pos += 12
            least = _GGUF_SCALAR.get(item, 12 if item == _GGUF_ARRAY else 8)
            if count * least > len(raw) - pos:
                return True
            return any(skip(item) for _ in range(count))
        else:
            pos += _GGUF_SCALAR[vtype]
        return pos > len(raw)

    try:
        for _ in range(min(n_kv, len(raw))):
            skip(_GGUF_STRING)
            vtype = struct.unpack_from("<I", raw, pos)[0]
            pos += 4
            if skip(vtype):
                return True
    except (struct.error, KeyError, OverflowError):  # not a GGUF file this far: the reader's to refuse
        return False
    return False


def test_fuzz_gguf_reader(folder, capsys):
    """GGUF files (Q8_0, MXFP4, Q4_0, Q4_1 with an F32 tensor and qcore's metadata) with one size,
    count, type, dim or offset field set to a hostile value, or their bytes mutated."""
    pytest.importorskip("gguf", reason="the gguf package is not installed (pip install 'qcore-quant[formats]')")
    stats = Stats("gguf-reader")
    path = os.path.join(folder, "m.gguf")

    @fuzz_settings(300)
    @given(st.data())
    def run(data):
        _, files = bases()[data.draw(st.sampled_from(_gguf_bases()))]
        raw = mutate_gguf(data, files["m.gguf"])
        _reset(folder, {"m.gguf": raw})
        with stats.case():
            _read_and_decode(path, "gguf", stats)
        if stats.cases % 25 == 0:
            _inspect_one_line(path, capsys)

    run()
    stats.report()


def test_fuzz_gguf_writer_metadata(folder):
    """`qcore convert --to gguf` of a qcore file whose carried `gguf.kv` (the metadata a GGUF read
    gives) is mutated: one-line errors, at most 64 KiB written, and what is written reads back."""
    pytest.importorskip("gguf", reason="the gguf package is not installed (pip install 'qcore-quant[formats]')")
    stats = Stats("gguf-writer")
    base_kv = qf.read(_gguf_source(folder)).metadata["gguf.kv"]
    q = REF.quantize(X, "q8s/block32:f16")
    src, out = os.path.join(folder, "src.safetensors"), os.path.join(folder, "out.gguf")
    qcore.save(src, {"m.w": q, "m.b": X[0]}, metadata={"gguf.kv": base_kv})
    head, body = split_safetensors(open(src, "rb").read())

    @fuzz_settings(300)
    @given(st.data())
    def run(data):
        head["__metadata__"]["gguf.kv"] = mutate_json_text(data, base_kv)  # any text JSON can escape
        _reset(folder, {"src.safetensors": join_safetensors(head, body)})
        with stats.case():
            done = only_qcore_errors(qf.convert, src, out, "gguf", tally=stats)
        if done is None:
            assert os.listdir(folder) == ["src.safetensors"], "a refused write left a file"
            return
        assert os.path.getsize(out) <= OUT_LIMIT, f"wrote {os.path.getsize(out)} bytes for 1 KB of tensors"
        back = qf.read(out)  # what the writer wrote, the reader reads
        assert back.tensors["m.w"].payload == q.to_data().payload

    run()
    stats.report()


def _string_kv_to_array(raw: bytes) -> bytes:
    """The fuzz case: the first kv's type STRING (8) turned into ARRAY (9), one bit, so its string
    length becomes the item type and its text the item count."""
    pos, size, what = next(f for f in gguf_fields(raw) if f[2] == "kv type")
    assert raw[pos] == _GGUF_STRING
    return raw[:pos] + bytes([_GGUF_ARRAY]) + raw[pos + 1:]


def test_gguf_kv_array_count_is_checked_against_the_file(tmp_path):
    """A kv array count beyond the file (here about 2**62 items in a 600-byte file) is a one-line
    InvalidDataError naming the count, found before anything is allocated. In a child capped at
    256 MiB of address space: gguf's reader appends a part per claimed item, and grew past 20 GiB
    uncapped (capped, the MemoryError it ends in is not the file's fault)."""
    pytest.importorskip("gguf", reason="the gguf package is not installed (pip install 'qcore-quant[formats]')")
    path = tmp_path / "m.gguf"
    path.write_bytes(_string_kv_to_array(bases()["gguf-q8s/block32:f16-4x64"][1]["m.gguf"]))
    assert gguf_array_past_end(path.read_bytes())
    code = ("import resource, sys\n"
            "resource.setrlimit(resource.RLIMIT_AS, (1 << 28, 1 << 28))\n"
            "import qcore, qcore.formats as qf\n"
            "try:\n    qf.read(sys.argv[1])\n"
            "except qcore.QCoreError as e:\n    print(type(e).__name__, e, sep=': ')\n")
    p = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.startswith("InvalidDataError: ") and "MemoryError" not in p.stdout, p.stdout
    assert "count" in p.stdout and len(p.stdout.splitlines()) == 1, p.stdout


def test_gguf_string_value_not_utf8_is_invalid_data(tmp_path):
    """One bit flipped in a string kv value (the fuzz case: 'llama' became b'\\xf1...'): a one-line
    InvalidDataError naming the key, not gguf's UnicodeDecodeError."""
    pytest.importorskip("gguf", reason="the gguf package is not installed (pip install 'qcore-quant[formats]')")
    raw = bytearray(bases()["gguf-q8s/block32:f16-4x64"][1]["m.gguf"])
    pos = next(p for p, size, what in gguf_fields(bytes(raw)) if what == "kv value length") + 8
    raw[pos] ^= 0x80
    path = tmp_path / "m.gguf"
    path.write_bytes(bytes(raw))
    with pytest.raises(qcore.InvalidDataError, match=r"m.gguf.*UTF-8") as e:
        qf.read(path)
    assert "\n" not in str(e.value)


def _gguf_source(folder: str) -> str:
    _, files = bases()["gguf-q8s/block32:f16-4x64"]
    path = os.path.join(folder, "base.gguf")
    with open(path, "wb") as f:
        f.write(files["m.gguf"])
    return path


# ------------------------------------------------------------------------------ streaming reader
def _plain_model() -> bytes:
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "m.safetensors")
        save_file({"layers.0.w": X, "layers.0.b": X[0].astype(np.float16), "norm": np.ones(8, np.float32),
                   "ids": np.arange(6, dtype=np.int64)}, p, metadata={"format": "pt"})
        return open(p, "rb").read()


def _qcore_file() -> bytes:
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "q.safetensors")
        qcore.save(p, {"w": REF.quantize(X, "q4s/block8:f16"), "b": X[0]})
        return open(p, "rb").read()


STREAM_BASES = [_plain_model(), _qcore_file()]


def test_fuzz_streaming_reader(folder):
    """`qcore.files.stfile.Reader` (the reader of `qcore quantize`) on safetensors files with a header field
    of any JSON type or the bytes mutated: every tensor read; then the model pipeline on the same file
    (`qcore.quantize_model` to q8s, reference backend)."""
    stats = Stats("stream-reader")
    path, out = os.path.join(folder, "m.safetensors"), os.path.join(folder, "out.safetensors")

    def read_all() -> None:
        with Reader(path) as r:
            for name in r.tensors:
                r.read(name)

    for raw in STREAM_BASES:  # (untraced: the modules these calls import on first use are loaded
        # here, so a case's peak is the case's own allocations, whatever ran before in this process)
        _reset(folder, {"m.safetensors": raw})
        read_all()
        qcore.quantize_model(path, out, "q8s/block32:f32", "reference", stats=False)

    @fuzz_settings(400)
    @given(st.data())
    def run(data):
        raw = data.draw(st.sampled_from(STREAM_BASES))
        raw = mutate_st_header(data, raw) if data.draw(st.booleans()) else mutate_bytes(data, raw)
        _reset(folder, {"m.safetensors": raw})
        with stats.case():
            only_qcore_errors(read_all, tally=stats)
            done = only_qcore_errors(qcore.quantize_model, path, out, "q8s/block32:f32", "reference", stats=False,
                                     tally=stats)
        if done is None:
            assert not [n for n in os.listdir(folder) if n != "m.safetensors"], os.listdir(folder)
        else:
            assert os.path.getsize(out) <= OUT_LIMIT

    run()
    stats.report()


# ------------------------------------------------------------------------------ recipes
BASE_RECIPE = {"scheme": "q4s/block32:f16", "rules": [["*.mlp.*", "q8s"], "re:^lm_head\\.=keep"],
               "rule": [{"pattern": "*attn*", "scheme": "nvfp4"}], "include_1d": False, "min_size": 0,
               "keep": ["*norm*"]}
BASE_TOML = b'''scheme = "q4s/block32:f16"
include_1d = false
min_size = 16
keep = ["*norm*", "*embed*"]
[[rule]]
pattern = "*.attention.*"
scheme = "q8s"
[[rule]]
pattern = "re:^lm_head\\\\."
scheme = "keep"
'''
TOML_LINES = [b'min_size = 5', b'min_size = -1', b'min_size = 1e400', b'keep = 5', b'rules = 5', b'rule = 5',
              b'include_1d = "yes"', b'scheme = 5', b'scheme = "q4s/block99999999999999999999"',
              b'[[rule]]\npattern = "re:^(a+)+$"\nscheme = "q8s"', b'[[rule]]\npattern = ""\nscheme = "q8s"',
              b'[[rule]]\npattern = "x"', b'[rule]\npattern = "x"\nscheme = "q8s"', b'x = [' * 40,
              b'\xff\xfe', b'\x00', b'a = "\\ud800"',
              b'[[rule]]\npattern = "re:a{99999999999999999999}"\nscheme = "q8s"',
              b'keep = ["[a-"]', b'unknown = 1', b'scheme = "keep"']
REGEX_PIECES = ["a", ".", "\\w", "\\d", "[ab]", "[^a]", "(", ")", "(?:", "|", "*", "+", "?", "*?", "{2}", "{2,5}",
                "{0,}", "{99999999999999999999}", "{4294967296}", "\\1", "(?=", "(?!", "(?<=a)", "(?P<n>", "(?P=n)",
                "^", "$", "(?i)", "\\", "[", "]", "{", "(?(1)a|b)", "\\b", "a++", "(?>", "\\u0041"]
PATTERN = st.one_of(
    st.lists(st.sampled_from(REGEX_PIECES), min_size=1, max_size=12).map(lambda p: "re:" + "".join(p)),
    st.text(max_size=20), st.sampled_from(["*", "*.mlp.*", "re:", "", "=", "[", "re:" + "a" * 5000]))
RULE_SCHEME = st.one_of(st.sampled_from(["q8s", "keep", "nvfp4", "q4s/block32:f16", "nope", "", "KEEP",
                                         "q4s/block99999999999999999999", "q8s/codes:away"]), st.text(max_size=12))
NAMES = st.one_of(st.text(max_size=40), st.sampled_from(["lm_head.weight", "model.layers.0.mlp.up.weight",
                                                         "a" * 256, "a" * 255 + "!", "a" * 257, "", "\x00"]),
                  st.integers(1, 300).map(lambda n: "a" * n))


def _recipe_input(data, folder: str):
    """A recipe in one of its forms: a dict, a TOML file's path, a scheme with rules, stored JSON."""
    kind = data.draw(st.sampled_from(["dict", "toml", "rules", "json"]))
    if kind == "dict":
        doc = mutate_json(data, BASE_RECIPE) if data.draw(st.integers(0, 4)) else data.draw(HOSTILE)
        return lambda: as_recipe(doc)
    if kind == "toml":
        text = BASE_TOML
        for _ in range(data.draw(st.integers(1, 3))):
            how = data.draw(st.sampled_from(["line", "line", "cut", "flip"]))
            if how == "line":
                text = text + b"\n" + data.draw(st.sampled_from(TOML_LINES)) + b"\n"
            elif how == "cut":
                text = text[: data.draw(st.integers(0, len(text)))]
            elif text:
                i = data.draw(st.integers(0, len(text) - 1))
                text = text[:i] + bytes([text[i] ^ (1 << data.draw(st.integers(0, 7)))]) + text[i + 1:]
        path = os.path.join(folder, "r.toml")
        with open(path, "wb") as f:
            f.write(text)
        return lambda: as_recipe(path)
    if kind == "rules":
        rules = [f"{p}={s}" for p, s in data.draw(st.lists(st.tuples(PATTERN, RULE_SCHEME), min_size=1, max_size=3))]
        rules += data.draw(st.lists(st.text(max_size=10), max_size=1))
        return lambda: as_recipe(data.draw(RULE_SCHEME), rules=rules)
    text = mutate_json_text(data, Recipe.from_dict(BASE_RECIPE).to_json())
    return lambda: Recipe.from_json(text)


def test_fuzz_recipes(folder):
    """Recipes from mutated dicts, TOML files (hostile lines, cut, bit flips, non-UTF-8), rule text
    (regexes from a grammar of repetitions, groups, alternatives, back references, lookarounds and
    huge counts) and stored JSON; what parses decides tensor names of up to 300 characters and
    round-trips through its JSON."""
    stats = Stats("recipes")

    @fuzz_settings(600)
    @given(st.data())
    def run(data):
        make = _recipe_input(data, folder)
        names = data.draw(st.lists(NAMES, min_size=1, max_size=4))
        with stats.case():
            r = only_qcore_errors(make, tally=stats)
            if r is None:
                return
            for name in names:
                only_qcore_errors(r.choose, name, (4, 64), np.float32, tally=stats)
            assert Recipe.from_json(r.to_json()).to_json() == r.to_json()

    run()
    stats.report()


def test_fuzz_rule_parse_direct():
    """`Rule.parse` on any text: a rule or a one-line InputError."""
    stats = Stats("rule-text")

    @fuzz_settings(300)
    @given(st.one_of(st.tuples(PATTERN, RULE_SCHEME).map("=".join), st.text(max_size=40)))
    def run(text):
        with stats.case():
            only_qcore_errors(Rule.parse, text, tally=stats)

    run()
    stats.report()
