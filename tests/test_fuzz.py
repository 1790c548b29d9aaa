"""Fuzzing as tests (hypothesis): scheme text, `QuantizedData`, `from_data` on every backend,
`qcore.load` / `read_info` / `qcore inspect` on mutated files and headers.

The property everywhere: only `QCoreError` subclasses escape, and no case allocates more than a
few MB (tracemalloc; the inputs are at most a few KB, so a case that believed a size claim would
need gigabytes). Decoding also agrees with the reference, bit for bit, on every backend.

Examples per target: CI defaults below (5,330 cases in all, about 20 s on an idle 2-core
machine; cuda under its simulator gets tiny shapes and few examples). `QCORE_FUZZ_EXAMPLES=N` and
`QCORE_FUZZ_REPORT=path.jsonl` as in tests/fuzzing.py (the long run of docs/robustness.md). The
foreign formats, the GGUF writer, the streaming reader and recipes are tests/test_fuzz_readers.py.
"""
from __future__ import annotations

import json
import os
import struct
import tempfile

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

import qcore
from qcore import InvalidDataError, QCoreError, QuantizedData, SchemeError
from qcore.files import io as qio
from qcore.spec.payload import sections
from qcore.backend.reference import ReferenceBackend
from tests.fuzzing import Stats, fuzz_settings, mutate_bytes, only_qcore_errors

REF = ReferenceBackend()
_settings = fuzz_settings


# ------------------------------------------------------------------------------ strategies
VALUES = ["q8s", "q8f", "q4s", "q4f", "q2s", "q2f", "e4m3", "e5m2", "e2m1"]
DTYPES = ["f32", "f16", "bf16", "ue8m0", "ue4m3"]
NUM_TEXT = st.one_of(st.integers(0, 70).map(str), st.integers(0, 2**70).map(str),
                     st.integers(1, 6000).map(lambda n: "9" * n), st.just("0" * 30 + "7"),
                     st.sampled_from(["", "-1", "1e3"]))
HEAD = st.one_of(st.sampled_from(VALUES + ["nf4", "nvfp4", "mxfp4", "mxfp8", "q5s", "lookup", "NF4", " q8s "]),
                 st.sampled_from(VALUES).map(lambda v: v + "-lookup"),
                 st.tuples(st.sampled_from(VALUES), st.sampled_from(["nf4", "x", "", "nf4]"])).map(
                     lambda t: f"{t[0]}-lookup[{t[1]}]"))
BLOCK = st.tuples(st.lists(NUM_TEXT, min_size=1, max_size=6),
                  st.one_of(st.none(), st.sampled_from(DTYPES + ["f8"]))).map(lambda t: "block" + "x".join(t[0]) + (f":{t[1]}" if t[1] else ""))
TENSOR = st.one_of(st.none(), st.sampled_from(DTYPES + ["u8"])).map(lambda d: "tensor" + (f":{d}" if d else ""))
STORE = st.tuples(st.sampled_from(["native", "packed_u32", "packed_native", "packed"]),
                  st.one_of(st.none(), NUM_TEXT)).map(lambda t: t[0] + (f":{t[1]}" if t[1] is not None else ""))
JUNK = st.text(max_size=12)
SCHEME_TEXT = st.one_of(
    st.tuples(HEAD, st.lists(st.one_of(BLOCK, TENSOR, STORE, JUNK), max_size=4)).map(lambda t: "/".join([t[0], *t[1]])),
    st.text(max_size=60),
)

VALID_SCHEMES = [
    "q8s", "q8f/block4:f16", "q8s/block2x4:f16/tensor:f32", "q8s/packed_u32:1",
    "q4s/block4:f16", "q4f/block2x2:bf16/packed_native:1", "q2s/packed_u32:1", "q2f/block3:ue8m0",
    "e4m3", "e4m3/block4:ue8m0", "e5m2/block2x3:f32", "e2m1/block4:ue4m3/tensor:f32/packed_native",
    "nvfp4", "mxfp8", "nf4", "q4s-lookup[nf4]/block4:f32", "q8s/tensor:ue8m0", "q4s/block16:f32",
]
SMALL_SHAPE = st.lists(st.integers(0, 6), min_size=1, max_size=3).map(tuple)
ANY_SHAPE = st.lists(st.one_of(st.integers(0, 9), st.sampled_from([0, 2**40, 2**50, 2**63, 2**70, -1])),
                     max_size=4).map(tuple)


# ------------------------------------------------------------------------------ scheme text
def test_fuzz_scheme_text():
    stats = Stats("scheme-text")

    @_settings(2000)
    @given(SCHEME_TEXT)
    def run(text):
        with stats.case():
            s = only_qcore_errors(qcore.scheme, text)
            if s is None:
                with pytest.raises(SchemeError):
                    qcore.scheme(text)
                return
            again = qcore.scheme(str(s))  # the canonical text parses back to the same scheme
            assert again == s and str(again) == str(s)

    run()
    stats.report()


# ------------------------------------------------------------------------------ QuantizedData
def _payload_for(data, shape, text) -> bytes:
    """Random bytes of the right length when shape and scheme allow one, else any short bytes."""
    try:
        n = sections(qcore.spec.layout.check_shape(shape), qcore.scheme(text)).total
    except QCoreError:
        n = None
    if n is None or n > 4096:
        return data.draw(st.binary(max_size=300))
    exact = data.draw(st.booleans())
    if exact:
        return data.draw(st.binary(min_size=n, max_size=n))
    return data.draw(st.binary(max_size=n + 8))


def test_fuzz_quantized_data():
    stats = Stats("quantized-data")

    @_settings(1500)
    @given(st.data(), ANY_SHAPE, st.one_of(st.sampled_from(VALID_SCHEMES), SCHEME_TEXT))
    def run(data, shape, text):
        payload = _payload_for(data, shape, text)
        with stats.case():
            d = only_qcore_errors(QuantizedData, shape, text, payload)
            if d is None:
                return
            assert len(d.payload) == d.nbytes
            y = only_qcore_errors(lambda: REF.from_data(d).numpy())
            if y is None:  # only an invalid value code may stop the decode of valid-length bytes
                assert d.first_invalid_code() is not None
                return
            assert y.shape == d.shape and y.dtype == np.float32

    run()
    stats.report()


# ------------------------------------------------------------------------------ from_data, every backend
def _cpu_backends():
    out = []
    for name in ("ndarray", "lutcpu"):
        try:
            out.append(qcore.backend(name))
        except QCoreError:
            pass
    return out


def _decode_agrees(be, d: QuantizedData) -> None:
    """`be` decodes `d` exactly like the reference, or both raise InvalidDataError."""
    try:
        want = REF.from_data(d).numpy()
    except InvalidDataError:
        want = None
    try:
        got = be.from_data(d).numpy()
    except InvalidDataError:
        assert want is None, f"{be.name} refused what the reference decodes: {d}"
        return
    assert want is not None, f"{be.name} decoded what the reference refuses (docs/spec.md, invalid codes): {d}"
    assert got.shape == want.shape
    assert np.array_equal(got, want, equal_nan=True), f"{be.name} differs from the reference on {d}"
    assert be.into_data(be.from_data(d)).codes().tobytes() == d.codes().tobytes()


def _random_data(data, shapes, schemes) -> QuantizedData:
    shape = data.draw(shapes)
    text = data.draw(st.sampled_from(schemes))
    s = qcore.scheme(text)
    assume(len(s.block.dims) <= len(shape) if s.block else True)
    assume(s.store.kind.value == "native" or s.store.dim < len(shape))
    sec = sections(shape, s)
    body = data.draw(st.binary(min_size=sec.values, max_size=sec.values))
    # scales: random storable values (zeros, tiny, huge) so most payloads are valid
    grid = qcore.spec.layout.grid_shape(shape, s)
    raw = np.asarray(data.draw(st.lists(st.sampled_from([0.0, 1e-30, 2**-20, 0.37, 1.0, 3.5, 1e4, 3e38]),
                                        min_size=int(np.prod(grid)), max_size=int(np.prod(grid)))), np.float32)
    tr = s.slot_dtype.traits
    parts = [body, np.ascontiguousarray(tr.encode(tr.store(raw))).tobytes()]
    if s.two_level:
        parts.append(struct.pack("<f", data.draw(st.sampled_from([0.0, 1e-38, 0.5, 7.0]))))
    if s.is_lookup:
        parts.append(np.asarray(s.require_table(), "<f4").tobytes())
    return QuantizedData(shape, s, b"".join(parts))


def test_fuzz_from_data_cpu_backends():
    stats = Stats("from-data-cpu")
    backends = _cpu_backends()
    x = np.ones((2, 4), np.float32)
    for be in backends:  # compile first (numba): a first-call JIT is not the case's allocation
        for text in VALID_SCHEMES:
            if be.supports(text):
                be.from_data(REF.quantize(x, text).to_data()).numpy()

    @_settings(1000)
    @given(st.data())
    def run(data):
        d = _random_data(data, SMALL_SHAPE, VALID_SCHEMES)
        with stats.case():
            for be in backends:
                if be.supports(d.scheme):
                    _decode_agrees(be, d)

    run()
    stats.report()


def test_fuzz_from_data_cuda(cuda_backend):
    """The simulator pays per thread: tiny shapes, few examples."""
    stats = Stats("from-data-cuda")

    @_settings(30)
    @given(st.data())
    def run(data):
        d = _random_data(data, st.lists(st.integers(1, 4), min_size=1, max_size=2).map(tuple),
                         [s for s in VALID_SCHEMES if "lookup" not in s and s != "nf4"] + ["q4s/block16:f32"])
        _decode_agrees(cuda_backend, d)
        stats.cases += 1

    run()
    stats.report()


# ------------------------------------------------------------------------------ files and headers
def _base_files() -> list[bytes]:
    x = np.random.default_rng(7).standard_normal((4, 16)).astype(np.float32)
    out = []
    with tempfile.TemporaryDirectory() as d:
        for i, tensors in enumerate([
            {"w": REF.quantize(x, "q4s/block8:f16"), "b": x[0]},
            {"a": REF.quantize(x, "nvfp4"), "e": REF.quantize(x[:2], "e4m3/block4:ue8m0"),
             "n": REF.quantize(x, "nf4")},
            {"q": REF.quantize(x, "q8s/block2x4:f32")},
        ]):
            p = os.path.join(d, f"{i}.safetensors")
            qcore.save(p, tensors, metadata={"k": "v"})
            out.append(open(p, "rb").read())
    return out


BASE_FILES = _base_files()
SHAPE_TEXT = st.one_of(st.just("[" * 3000 + "]" * 3000), st.lists(st.integers(-2, 2**70), max_size=3).map(json.dumps),
                       st.text(max_size=20), st.integers(1, 6000).map(lambda n: "[" + "9" * n + "]"))


def _mutate_header(data, raw: bytes) -> bytes:
    n = struct.unpack("<Q", raw[:8])[0]
    head = json.loads(raw[8:8 + n])
    body = raw[8 + n:]
    names = [k for k in head if k != "__metadata__"]
    meta = head.setdefault("__metadata__", {})
    what = data.draw(st.sampled_from(["scheme", "shape", "dtype", "tshape", "offsets", "version", "drop", "extra"]))
    name = data.draw(st.sampled_from(names))
    if what == "scheme" and f"qcore.{name}.scheme" in meta:
        meta[f"qcore.{name}.scheme"] = data.draw(SCHEME_TEXT)
    elif what == "shape" and f"qcore.{name}.shape" in meta:
        meta[f"qcore.{name}.shape"] = data.draw(SHAPE_TEXT)
    elif what == "dtype":
        head[name]["dtype"] = data.draw(st.sampled_from(["U8", "F32", "F8_E4M3", "BF16", "I64", "X9", "BOOL"]))
    elif what == "tshape":
        head[name]["shape"] = data.draw(st.lists(st.integers(0, 2**40), max_size=3))
    elif what == "offsets":
        head[name]["data_offsets"] = data.draw(st.lists(st.integers(0, 2**64 - 1), min_size=2, max_size=2))
    elif what == "version":
        meta["qcore.format_version"] = data.draw(st.sampled_from(["2", "", "1.0"]))
    elif what == "drop":
        meta.pop(data.draw(st.sampled_from(sorted(meta))), None)
    else:
        key = data.draw(st.sampled_from(["qcore.x.scheme", "qcore.zzz", "qcore.w.shape"]))
        meta[key] = data.draw(st.text(max_size=10))
    text = json.dumps(head).encode()
    return struct.pack("<Q", len(text)) + text + body


def _exercise_file(path: str) -> None:
    """Every reader on `path`: only QCoreError may escape; what loads must also decode."""
    only_qcore_errors(qio.read_info, path)
    loaded = only_qcore_errors(qcore.load, path, backend="reference")
    if loaded:
        for v in loaded.values():
            if isinstance(v, qcore.QTensor):
                only_qcore_errors(v.numpy)


def test_fuzz_files_and_headers(capsys):
    stats = Stats("files")
    tmp = tempfile.mkdtemp(prefix="qcore-fuzz-")
    path = os.path.join(tmp, "f.safetensors")
    for raw in BASE_FILES:  # (untraced: the modules the readers import on first use are loaded here, so
        # a case's peak is the case's own allocations, whatever ran before in this process)
        with open(path, "wb") as f:
            f.write(raw)
        _exercise_file(path)

    @_settings(800)
    @given(st.data())
    def run(data):
        raw = data.draw(st.sampled_from(BASE_FILES))
        raw = _mutate_header(data, raw) if data.draw(st.booleans()) else mutate_bytes(data, raw)
        with open(path, "wb") as f:
            f.write(raw)
        with stats.case():
            _exercise_file(path)
        if stats.cases % 25 == 0:  # the CLI too, on some of them: one line, exit 0 or 1
            from qcore.cli.main import main

            rc = main(["inspect", path])
            _, err = capsys.readouterr()
            assert rc in (0, 1) and "Traceback" not in err
            assert rc == 0 or (len(err.strip().splitlines()) == 1 and err.startswith("qcore: error: "))

    try:
        run()
    finally:
        os.unlink(path) if os.path.exists(path) else None
        os.rmdir(tmp)
    stats.report()
