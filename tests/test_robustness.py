"""Hostile inputs and huge size claims (docs/spec.md, size claims): each reproduction ends in a typed
one-line error or a correct result, within a second and a few MB, on every installed backend.

Memory is measured with tracemalloc (numpy reports its buffers to it); a case that believed a
claim would allocate terabytes or hang.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import subprocess
import sys
import tracemalloc

import ml_dtypes
import numpy as np
import pytest
from safetensors import SafetensorError
from safetensors.numpy import save_file

import qcore
from qcore import InputError, InvalidDataError, QuantizedData, SchemeError, StorageError
from qcore.files import io as qio, paths, stfile
from qcore.cli.main import main

MB = 1 << 20


@contextlib.contextmanager
def bounded(max_bytes: int = 8 * MB):
    """Assert that the block allocates at most `max_bytes` (peak, numpy buffers included): the
    claims here are of terabytes, so a block that believed them would fail this, or hang. Time is
    not asserted (CI is shared); the fuzz run (scripts/fuzz.py) records the slowest case."""
    tracemalloc.start()
    try:
        yield
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak <= max_bytes, f"peak {peak / MB:.1f} MiB > {max_bytes / MB:.1f} MiB"


def _backends(scheme: str) -> list:
    """Every installed, available backend that supports `scheme` (cuda: the simulator in CI)."""
    out = []
    for name in ("reference", "ndarray", "cuda", "lutcpu"):
        try:
            be = qcore.backend(name)
        except qcore.QCoreError:
            continue
        if be.supports(scheme):
            out.append(be)
    return out


def _run(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _one_line(err: str, pattern: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qcore: error: "), err
    assert re.search(pattern, lines[0]), lines[0]


def _quantized_file(path, shape, scheme: str, payload: bytes, name: str = "w") -> None:
    """A qcore file whose header claims `shape` under `scheme` for `payload` (written raw)."""
    meta = {qio.VERSION_KEY: qio.FORMAT_VERSION, qio.scheme_key(name): scheme, qio.shape_key(name): json.dumps(shape)}
    save_file({name: np.frombuffer(payload, np.uint8).copy()}, str(path), metadata=meta)


# ------------------------------------------------------------------------------ empty but huge
@pytest.mark.parametrize("shape", [(1 << 40, 0), (0, 1 << 40), (1 << 50, 0), (0, 3, 1 << 48)])
@pytest.mark.parametrize("scheme", ["q8s", "q8s/block32:f16", "q4s/block4x8:bf16/packed_u32:1", "nf4"])
def test_empty_but_huge_decodes_in_constant_time(shape, scheme):
    s = qcore.scheme(scheme)
    if len(s.block.dims if s.block else ()) > len(shape):
        return
    sec = qcore.spec.payload.sections(shape, s)
    table = np.asarray(s.table or (), "<f4").tobytes()
    d = QuantizedData(shape, s, bytes(sec.total - len(table)) + table)
    for be in _backends(scheme):
        with bounded():
            y = be.from_data(d).numpy()
        assert y.shape == shape and y.size == 0, be.name


@pytest.mark.parametrize("shape", [((1 << 63) - 1, 0), (1 << 40, 1 << 30, 0), ((1 << 50) + 1, 0)])
def test_shapes_no_array_can_index_are_invalid(shape):
    with bounded(max_bytes=MB):
        with pytest.raises(InvalidDataError, match="more than 2\\*\\*50 elements"):
            QuantizedData(shape, "q8s", np.float32(1).tobytes())


def test_empty_but_huge_file_through_load_inspect_and_cli(tmp_path, capsys):
    """The issue's 200-byte file: shape [2**40, 0], an empty payload."""
    f = tmp_path / "huge.safetensors"
    _quantized_file(f, [1 << 40, 0], "q8s/block1x32:f32", b"")
    assert f.stat().st_size < 300
    with bounded():
        info = qio.read_info(f)
        y = qcore.load(f, backend="reference")["w"].numpy()
    assert info.entries[0].numel == 0 and y.shape == (1 << 40, 0)
    with bounded(max_bytes=16 * MB):
        rc, out, err = _run(capsys, "dequantize", f, tmp_path / "out.safetensors", "--backend", "reference")
    assert rc == 0, err
    rc, out, err = _run(capsys, "inspect", f, "--json")
    assert rc == 0 and json.loads(out)["entries"][0]["shape"] == [1 << 40, 0]


def test_calibrate_empty_but_huge_input():
    x = np.empty((1 << 40, 0), np.float32)
    for method in ("minmax", "absmean"):
        with bounded():
            p = qcore.backend("reference").calibrate(x, "q8s/block1x16:f32", method=method)
        assert np.asarray(p.scales).shape == (1 << 40, 0)


# ------------------------------------------------------------------------------ block larger than the axis
@pytest.mark.parametrize("value,block", [("q4s", 4194304), ("q8s", 268435456), ("e4m3", 1 << 40)])
def test_block_larger_than_axis_costs_nothing(block, value):
    """Same bytes and same values as a block equal to the extent; memory of the tensor's order."""
    x = np.random.default_rng(0).standard_normal((3, 40)).astype(np.float32)
    for be in _backends(f"{value}/block{block}:f32"):
        same = be.quantize(x, f"{value}/block40:f32")  # also warms up (first-launch compilation)
        same.numpy()
        with bounded(max_bytes=2 * MB):
            q = be.quantize(x, f"{value}/block{block}:f32")
            y = q.numpy()
        assert q.to_data().payload == same.to_data().payload, be.name
        assert np.array_equal(y, same.numpy()), be.name


def test_tiny_file_with_a_gigantic_block_dequantizes_cheaply(tmp_path):
    """The issue's 192-byte file: q4s/block1073741824:f32, shape [8]."""
    x = np.linspace(-1, 1, 8, dtype=np.float32)
    d = qcore.backend("reference").quantize(x, "q4s/block1073741824:f32").to_data()
    f = tmp_path / "tiny.safetensors"
    qcore.save(f, {"w": d})
    for be in _backends("q4s/block1073741824:f32"):
        with bounded(max_bytes=2 * MB):
            y = qcore.load(f, backend=be)["w"].numpy()
        assert np.array_equal(y, qcore.backend("reference").from_data(d).numpy())


def test_block_dims_and_rank_rules_unchanged():
    """Clamping is only for the work: the scheme keeps its block, a block with more dims than the
    tensor is still an InputError (docs/spec.md, arithmetic)."""
    q = qcore.backend("reference").quantize(np.ones((3, 5), np.float32), "q8s/block64x64:f32")
    assert str(q.scheme) == "q8s/block64x64:f32" and q.to_data().scales().shape == (1, 1)
    with pytest.raises(InputError, match="has 2 dims but the tensor has rank 1"):
        qcore.backend("reference").quantize(np.ones(5, np.float32), "q8s/block64x64:f32")


# ------------------------------------------------------------------------------ numbers beyond int64
@pytest.mark.parametrize("text", [
    "q4s/block" + "9" * 5000,                 # more digits than int() converts
    "q4s/block99999999999999999999",          # "Maximum allowed dimension exceeded" in numpy
    "q4s/block9223372036854775808",           # 2**63
    "q4s/block32x" + "1" * 40,
    "q2s/packed_u32:" + "7" * 30,
])
def test_huge_numbers_in_scheme_text(text):
    with bounded(max_bytes=MB):
        with pytest.raises(SchemeError, match="exceeds int64"):
            qcore.scheme(text)


def test_int64_edge_in_scheme_text_is_accepted():
    assert qcore.scheme(f"q8s/block{(1 << 63) - 1}:f32").block.dims == ((1 << 63) - 1,)
    with pytest.raises(SchemeError, match="exceeds int64"):
        qcore.QuantScheme(qcore.QuantValue.Q8S).per_block([1 << 63])


def test_huge_block_on_the_cli_is_one_line(tmp_path, capsys):
    model = tmp_path / "m.safetensors"
    save_file({"w": np.ones((4, 8), np.float32)}, str(model))
    rc, _, err = _run(capsys, "quantize", model, tmp_path / "o.safetensors",
                      "--scheme", "q4s/block99999999999999999999")
    assert rc == 1
    _one_line(err, "exceeds int64")


@pytest.mark.parametrize("shape_text,why", [
    ("[" * 2000 + "]" * 2000, "nested"),
    (json.dumps([1 << 70, 0]), "2**70"),
    (json.dumps([(1 << 63), 0]), "2**63"),
    ("[" + "9" * 5000 + "]", "5000 digits"),
    ("[-1]", "negative"),
])
def test_hostile_shape_metadata(tmp_path, shape_text, why, capsys):
    f = tmp_path / "bad.safetensors"
    meta = {qio.VERSION_KEY: qio.FORMAT_VERSION, qio.scheme_key("w"): "q8s", qio.shape_key("w"): shape_text}
    save_file({"w": np.zeros(8, np.uint8)}, str(f), metadata=meta)
    for fn in (qio.read_info, qcore.load, qio.load_data):
        with bounded(max_bytes=4 * MB):
            with pytest.raises(InvalidDataError, match="must be a JSON list of one or more ints"):
                fn(f)
    rc, _, err = _run(capsys, "inspect", f)
    assert rc == 1
    _one_line(err, "qcore.w.shape")
    assert len(err) < 600  # the hostile text is cut short in the message


# ------------------------------------------------------------------------------ inputs
@pytest.mark.parametrize("x", [[[1.0], [1.0, 2.0]], [[1.0, [2.0]]], [["a", 1.0]], [object()]])
def test_ragged_or_odd_list_input_is_input_error(x):
    for be in _backends("q8s"):
        with pytest.raises(InputError):
            be.quantize(x, "q8s")
        with pytest.raises(InputError):
            be.calibrate(x, "q8s")


# ------------------------------------------------------------------------------ files and paths
def test_directory_or_device_as_input_names_the_path(tmp_path, capsys):
    for p, why in ((tmp_path, "is a directory"), ("/dev/null", "not a regular file"),
                   (tmp_path / "missing.safetensors", "No such file")):
        for fn in (qio.read_info, qio.load_data):
            with pytest.raises(StorageError, match=re.escape(str(p)) + ".*" + why):
                fn(p)
        # qcore.load and the commands take a checkpoint directory too: an empty one is named with
        # what it lacks
        cli_why = "holds no .safetensors file" if p == tmp_path else why
        with pytest.raises(qcore.InputError if p == tmp_path else StorageError, match=re.escape(str(p)) + ".*" + cli_why):
            qcore.load(p)
        for cmd in (["inspect", p], ["dequantize", p, tmp_path / "o.safetensors"],
                    ["quantize", p, tmp_path / "o.safetensors", "--scheme", "q8s"]):
            rc, _, err = _run(capsys, *cmd)
            assert rc == 1
            _one_line(err, re.escape(str(p)) + ".*" + cli_why)


def test_missing_output_directory_fails_before_any_work(tmp_path, capsys, monkeypatch):
    model = tmp_path / "m.safetensors"
    save_file({"w": np.ones((4, 8), np.float32)}, str(model))
    called = []
    monkeypatch.setattr(qio, "load_data", lambda *a, **k: called.append(a))
    out = tmp_path / "no" / "such" / "o.safetensors"
    for cmd in (["quantize", model, out, "--scheme", "q8s"], ["dequantize", model, out]):
        rc, _, err = _run(capsys, *cmd)
        assert rc == 1 and not called
        _one_line(err, re.escape(str(out)) + ".*directory .* does not exist")
        assert ".tmp" not in err
    rc, _, err = _run(capsys, "quantize", model, tmp_path, "--scheme", "q8s")
    _one_line(err, "it is a directory")


def test_plain_f8_tensors_round_trip(tmp_path):
    a = np.linspace(-4, 4, 12, dtype=np.float32).reshape(3, 4)
    tensors = {"e4m3": a.astype(ml_dtypes.float8_e4m3fn), "e5m2": a.astype(ml_dtypes.float8_e5m2),
               "bf16": a.astype(ml_dtypes.bfloat16)}
    f = tmp_path / "f8.safetensors"
    qcore.save(f, tensors)
    back = qcore.load(f)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and back[k].tobytes() == v.tobytes(), k
    assert {e.dtype for e in qio.read_info(f).entries} == {"F8_E4M3", "F8_E5M2", "BF16"}


# ------------------------------------------------------------------------------ disk full, read-only
def _save_raises(monkeypatch, exc):
    def fail(arrays, tmp, metadata=None):
        with open(tmp, "wb") as f:
            f.write(b"x" * 1000)
        raise exc
    monkeypatch.setattr(stfile, "save_file", fail)  # the safetensors writer qcore.save calls


@pytest.mark.parametrize("exc,pattern", [
    (SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                     'message: "No space left on device" })'), "No space left on device"),
    (OSError(errno.ENOSPC, "No space left on device"), "No space left on device"),
    (OSError(errno.EROFS, "Read-only file system"), "Read-only file system"),
], ids=["safetensors-enospc", "oserror-enospc", "erofs"])
def test_write_failures_are_one_storage_error(tmp_path, monkeypatch, exc, pattern):
    _save_raises(monkeypatch, exc)
    out = tmp_path / "o.safetensors"
    with pytest.raises(StorageError, match=re.escape(str(out)) + ".*" + pattern):
        qcore.save(out, {"w": np.ones(4, np.float32)})
    assert os.listdir(tmp_path) == []


def test_read_only_destination_before_any_temp_file(tmp_path, monkeypatch, capsys):
    model = tmp_path / "m.safetensors"
    save_file({"w": np.ones((4, 8), np.float32)}, str(model))

    def erofs(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr(paths.tempfile, "mkstemp", erofs)
    rc, _, err = _run(capsys, "quantize", model, tmp_path / "o.safetensors", "--scheme", "q8s",
                      "--backend", "reference")
    assert rc == 1
    _one_line(err, "Read-only file system; nothing was written")
    assert sorted(os.listdir(tmp_path)) == ["m.safetensors"]


@contextlib.contextmanager
def _tiny_tmpfs(path, size: str, ro: bool = False):
    path.mkdir()
    opts = f"size={size}" + (",ro" if ro else "")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)


@pytest.mark.skipif(sys.platform != "linux", reason="tmpfs mounts are Linux only")
def test_real_disk_full_and_read_only_mounts(tmp_path, capsys):
    """A real ENOSPC (a 64 KiB tmpfs) and a real read-only mount: one error line, nothing left."""
    model = tmp_path / "m.safetensors"
    save_file({"w": np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)}, str(model))
    with _tiny_tmpfs(tmp_path / "full", "64k") as d:
        rc, _, err = _run(capsys, "quantize", model, d / "o.safetensors", "--scheme", "q8s", "--backend", "reference")
        assert rc == 1
        _one_line(err, "No space left on device")
        assert os.listdir(d) == []
    with _tiny_tmpfs(tmp_path / "ro", "64k", ro=True) as d:
        rc, _, err = _run(capsys, "quantize", model, d / "o.safetensors", "--scheme", "q8s", "--backend", "reference")
        assert rc == 1
        _one_line(err, "o.safetensors")
        assert os.listdir(d) == []
