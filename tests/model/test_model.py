"""The whole-model Python API, the streamed safetensors writer, statistics and the memory bound."""
import json
import os
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

import qcore
from qcore.files import io as qio
from qcore.backend.registry import AutoBackend
from qcore.backend.stats import error_stats, sqnr_db
from qcore.files.stfile import Reader, StreamWriter, header_room


def _x(shape, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def test_quantize_dict_and_model_of_a_mapping(tmp_path):
    sd = {"layers.0.weight": _x((8, 64), 1), "layers.0.bias": _x((64,), 2), "embed.weight": _x((4, 64), 3),
          "ids": np.arange(4)}
    out = qcore.quantize_dict(sd, "q8s", backend="reference")
    assert isinstance(out["layers.0.weight"], qcore.QTensor)
    assert out["layers.0.weight"].to_data() == qcore.quantize(sd["layers.0.weight"], "q8s", "reference").to_data()
    assert all(out[k] is sd[k] for k in ("layers.0.bias", "embed.weight", "ids"))  # kept as they were
    # the same through quantize_model, saved with the recipe and the source dtypes
    got = qcore.quantize_model(sd, tmp_path / "q.safetensors", {"scheme": "q8s", "rules": [["embed*", "q8s"]]},
                               backend="reference")
    assert isinstance(got["embed.weight"], qcore.QTensor)
    info = qio.read_info(tmp_path / "q.safetensors")
    assert json.loads(info.recipe)["rules"] == [["embed*", "q8s"]]
    assert {e.name: e.source_dtype for e in info.entries if e.quantized} == {"layers.0.weight": "F32",
                                                                             "embed.weight": "F32"}


def test_quantize_model_rejects_an_unsupported_scheme_before_work(tmp_path):
    save_file({"w": _x((4, 32))}, str(tmp_path / "m.safetensors"))
    with pytest.raises(qcore.UnsupportedSchemeError, match="backend 'ndarray' does not support"):
        qcore.quantize_model(tmp_path / "m.safetensors", tmp_path / "o.safetensors", "nf4", backend="ndarray")
    assert not (tmp_path / "o.safetensors").exists()


def test_stream_writer_reads_back_bit_identically_with_safetensors(tmp_path):
    tensors = {"f32": _x((3, 5)), "bf16": _x((4, 4), 1).astype(ml_dtypes.bfloat16), "f16": _x((7,), 2, np.float16),
               "i64": np.arange(6, dtype=np.int64).reshape(2, 3), "empty": np.zeros((0, 4), np.float32),
               "scalar": np.array(2.5, np.float32), "u8": np.arange(9, dtype=np.uint8)}
    meta = {"qcore.format_version": "1", "format": "pt"}
    room = header_room([(k, qcore.files.stfile.st_dtype(v.dtype), v.shape) for k, v in tensors.items()], meta)
    path = tmp_path / "s.safetensors"
    with open(path, "wb") as f:
        w = StreamWriter(f, room)
        for k, v in tensors.items():
            w.add(k, v)
        w.finish(meta)
    got = load_file(str(path))
    for k, v in tensors.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and got[k].tobytes() == v.tobytes(), k
    with safe_open(str(path), framework="np") as f:
        assert f.metadata() == meta
    with Reader(path) as r:  # and our reader reads safetensors' own files
        assert list(r.tensors) == list(tensors)
        assert all(r.read(k).tobytes() == v.tobytes() for k, v in tensors.items())


def test_reader_rejects_bad_files(tmp_path):
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 20)
    with pytest.raises(qcore.InvalidDataError, match="header length"):
        Reader(tmp_path / "junk.safetensors")


def test_error_stats_match_float64():
    x = _x((300, 1000), 5)
    y = (x + _x((300, 1000), 6) * 1e-3).astype(np.float32)
    sqnr, mx = error_stats(x, y)
    e = y.astype(np.float64) - x
    assert sqnr == pytest.approx(10 * np.log10((x.astype(np.float64) ** 2).sum() / (e ** 2).sum()), abs=1e-3)
    assert mx == pytest.approx(np.abs(e).max(), rel=1e-6)
    assert error_stats(x, x)[0] == float("inf")


MEMORY_SCRIPT = textwrap.dedent("""
    import sys, numpy as np, qcore
    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key)) * 1024
    qcore.quantize_model({"w": np.ones((64, 64), np.float32)}, None, "q8s", backend="reference")  # warm up
    base = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the high-water mark (VmHWM) to the current resident set
    qcore.quantize_model(sys.argv[1], sys.argv[2], "q8s", backend="reference")
    print(base, status("VmHWM"))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status and clear_refs (Linux)")
def test_peak_memory_is_bounded_by_the_largest_tensor(tmp_path):
    """12 tensors of 8 MiB (96 MiB): the run may add at most 3 x 8 MiB + 40 MiB to the resident set.

    Loading the whole model (96 MiB plus its quantized copy) would break the bound."""
    n, rows = 12, 2048
    (tmp_path / "src").mkdir()
    rng = np.random.default_rng(0)
    for k in range(n):
        save_file({f"layers.{k}.weight": rng.standard_normal((rows, 1024), dtype=np.float32)},
                  str(tmp_path / "src" / f"model-{k + 1:05d}-of-{n:05d}.safetensors"))
    p = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(tmp_path / "src"), str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    base, peak = map(int, p.stdout.split())
    largest = rows * 1024 * 4
    grew = peak - base
    assert grew <= 3 * largest + (40 << 20), (grew / 2**20, largest / 2**20)
    assert len(os.listdir(tmp_path / "out")) == n


@pytest.mark.parametrize("scheme", ["q8s", "nvfp4"])
def test_cuda_error_stats_on_the_device_match_the_host(cuda_backend, scheme):
    x = _x((4, 64), 7)
    q = cuda_backend.quantize(x, scheme)
    sqnr, mx = cuda_backend.error_stats(x, q)
    want = error_stats(x, q.numpy())
    assert sqnr == pytest.approx(want[0], abs=1e-4) and mx == pytest.approx(want[1], rel=1e-6)
    assert AutoBackend().error_stats(x, q) == (sqnr, mx)  # whole-model runs under auto use it


def test_quantize_of_a_dict_points_at_quantize_dict():
    with pytest.raises(qcore.InputError, match=r"for a state dict use qcore.quantize_dict"):
        qcore.quantize({"w": _x((2, 32))}, "q8s", backend="reference")


def test_a_shard_assembled_from_parts_is_the_whole_shard(tmp_path):
    """quantize_shard of consecutive groups, then assemble_shard: the bytes of quantize_shard of the
    whole shard, with every kind of tensor (quantized, kept by the plan, kept at run time for a NaN,
    already quantized in the source) and the metadata merged from the parts."""
    from qcore.files.checkpoint import resolve
    from qcore.model.plan import consecutive_groups, plan_shards
    from qcore.model.shards import assemble_shard, quantize_shard
    from qcore.model.recipe import as_recipe

    nan = _x((8, 64), 4)
    nan[0, 0] = np.nan
    save_file({"a": _x((8, 64), 1), "nan": nan, "b": _x((16, 64), 2), "norm": _x((64,), 3), "c": _x((4, 64), 5)},
              str(tmp_path / "m.safetensors"))
    qcore.quantize_model(tmp_path / "m.safetensors", tmp_path / "src.safetensors", "q8s", "reference",
                         rules=["b=keep", "c=keep"])  # 'a' is quantized in the source
    src = str(tmp_path / "src.safetensors")
    with Reader(src) as r:
        (shard,), recipe_json = plan_shards(resolve(src), as_recipe("q4s/block32:f16"), None, {"src.safetensors": r})
    whole = quantize_shard(shard, {"src.safetensors": src}, tmp_path / "whole", recipe_json, "reference")
    assert {r.name: bool(r.scheme) for r in whole} == {"a": False, "nan": False, "b": True, "norm": False, "c": True}
    rows, parts = [], []
    for k, group in enumerate(consecutive_groups(shard.tensors, lambda it: it.head.nbytes, 2100)):
        parts.append(tmp_path / f"part{k}")
        rows += quantize_shard(shard.with_tensors(group), {"src.safetensors": src}, parts[-1], recipe_json,
                               "reference", atomic=False)
    assert len(parts) >= 3
    assemble_shard(shard, parts, tmp_path / "assembled", recipe_json)
    assert (tmp_path / "assembled").read_bytes() == (tmp_path / "whole").read_bytes()
    assert {e.name for e in qio.read_info(tmp_path / "assembled").entries if e.quantized} == {"a", "b", "c"}
    assert repr(rows) == repr(whole)
    with pytest.raises(qcore.InvalidDataError, match="not the planned"):
        assemble_shard(shard, parts[::-1], tmp_path / "reversed", recipe_json)
    assert not (tmp_path / "reversed").exists()


@pytest.mark.parametrize("scheme", ["q8s", "q8s/block32:f16", "q8f/block4x8:ue8m0"])
def test_ndarray_error_stats_match_the_host(scheme):
    """The ndarray backend's own statistics pass (parallel, one read of x and of the dequantized
    values) gives the host's figures; `auto` forwards to it."""
    be = qcore.backend("ndarray")
    x = _x((37, 300), 11)
    q = be.quantize(x, scheme)
    sqnr, mx = be.error_stats(x, q)
    want = error_stats(x, q.numpy())
    assert sqnr == pytest.approx(want[0], abs=1e-4) and mx == want[1]
    assert AutoBackend().error_stats(x, q) == (sqnr, mx)
    assert be.error_stats(np.zeros((0, 32), np.float32), be.quantize(np.zeros((0, 32), np.float32), scheme)) \
        == (sqnr_db(0.0, 0.0), 0.0)
