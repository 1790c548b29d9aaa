"""Sharded checkpoints in and out: same shards, rewritten index, other files copied, hub ids, --resume."""
import json
import os

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import qcore
from qcore.files import io as qio
from qcore.cli.main import main
from qcore.model.api import dequantize_model, quantize_model
from qcore.backend.reference import ReferenceBackend

RULES = ["*.mlp.*=q4s/block32:f16"]  # mlp weights 4-bit, the rest q8s; norms, biases, embeddings kept


def _x(shape, seed, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def make_checkpoint(root, n_shards=4, rows=8, cols=64, dtype=np.float32):
    """A fake HF checkpoint: n shards + index + config.json + a tokenizer folder."""
    root.mkdir(parents=True, exist_ok=True)
    tensors, wmap = {}, {}
    for k in range(n_shards):
        name = f"model-{k + 1:05d}-of-{n_shards:05d}.safetensors"
        part = {
            f"layers.{k}.attn.weight": _x((rows, cols), 10 * k, dtype),
            f"layers.{k}.mlp.weight": _x((cols, rows * 4), 10 * k + 1, dtype),
            f"layers.{k}.norm.weight": _x((cols,), 10 * k + 2, dtype),
        }
        if k == 0:
            part["embed_tokens.weight"] = _x((16, cols), 99, dtype)
        save_file(part, str(root / name), metadata={"format": "pt"})
        tensors.update(part)
        wmap.update({t: name for t in part})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 1}, "weight_map": wmap}))
    (root / "config.json").write_text('{"model_type": "toy"}')
    (root / "tok").mkdir(exist_ok=True)
    (root / "tok" / "vocab.txt").write_text("a\nb\n")
    return tensors


def expected_scheme(name):
    if name.endswith("norm.weight") or name.startswith("embed"):
        return None
    return "q4s/block32:f16" if ".mlp." in name else "q8s"


def check_output(out, src, backend):
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted({v for v in index["weight_map"].values()})
    assert shards == [f"model-{k:05d}-of-00004.safetensors" for k in range(1, 5)]
    assert index["metadata"]["total_size"] == sum(qio.read_info(out / s).file_size - 8 - _header_len(out / s)
                                                  for s in shards)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "toy"
    assert config["quantization_config"]["tensors"] == {
        t: expected_scheme(t) for t in index["weight_map"] if expected_scheme(t) is not None}
    assert (out / "tok" / "vocab.txt").read_text() == "a\nb\n"
    for shard in shards:
        got = qcore.load(out / shard, backend=backend)
        assert set(got) == {t for t, s in index["weight_map"].items() if s == shard}
        for name, v in got.items():
            want = expected_scheme(name)
            if want is None:
                assert isinstance(v, np.ndarray) and v.tobytes() == src[name].tobytes(), name
            else:
                ref = qcore.quantize(src[name], want, backend="reference").to_data()
                assert v.to_data() == ref, name  # bit-identical to the reference quantization


def _header_len(path):
    with open(path, "rb") as f:
        return int.from_bytes(f.read(8), "little")


@pytest.mark.parametrize("backend", ["reference", "ndarray"])
def test_four_shards_quantize_to_four_shards(tmp_path, backend):
    if backend == "ndarray":
        pytest.importorskip("qcore_ndarray", reason="the ndarray backend is not installed")
    src = make_checkpoint(tmp_path / "ck")
    # ndarray does 8-bit values only: the 4-bit rule goes to q8s there, the check follows the recipe used
    rules = RULES if backend == "reference" else ["*.mlp.*=q8s"]
    res = quantize_model(tmp_path / "ck", tmp_path / "out", "q8s", backend, rules=rules)
    assert len([f for f in res.files if f.endswith(".safetensors")]) == 4
    assert res.ratio > 1
    if backend == "reference":
        check_output(tmp_path / "out", src, "reference")
    else:
        got = qcore.load(tmp_path / "out" / "model-00002-of-00004.safetensors", backend="ndarray")
        w = got["layers.1.mlp.weight"]
        assert w.to_data() == qcore.quantize(src["layers.1.mlp.weight"], "q8s", backend="reference").to_data()


def test_cuda_simulator_tiny_checkpoint(tmp_path, cuda_backend):
    src = make_checkpoint(tmp_path / "ck", n_shards=4, rows=2, cols=32)
    quantize_model(tmp_path / "ck", tmp_path / "out", "q8s", cuda_backend, rules=RULES, stats=False)
    check_output(tmp_path / "out", src, "reference")
    got = qcore.load(tmp_path / "out" / "model-00003-of-00004.safetensors", backend=cuda_backend)
    assert got["layers.2.attn.weight"].to_data() == qcore.quantize(src["layers.2.attn.weight"], "q8s",
                                                                   backend="reference").to_data()


def test_index_file_and_cli(tmp_path, capsys):
    src = make_checkpoint(tmp_path / "ck")
    rc = main([
        "quantize", str(tmp_path / "ck" / "model.safetensors.index.json"), str(tmp_path / "out"), "--scheme", "q8s",
        "--rule", RULES[0], "--backend", "reference"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "wrote 5 files to" in out
    check_output(tmp_path / "out", src, "reference")
    rc = main(["inspect", str(tmp_path / "out")])
    out, _ = capsys.readouterr()
    assert rc == 0 and "4 shards in" in out and "recipe: *.mlp.*=q4s/block32:f16, default=q8s" in out


def test_hub_id_from_local_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    snap = cache / "models--org--toy" / "snapshots" / "abc123"
    src = make_checkpoint(snap)
    (cache / "models--org--toy" / "refs").mkdir()
    (cache / "models--org--toy" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    quantize_model("org/toy", tmp_path / "out", "q8s", "reference", rules=RULES)
    check_output(tmp_path / "out", src, "reference")
    with pytest.raises(FileNotFoundError, match="not in the local hub cache"):
        quantize_model("org/missing", tmp_path / "o2", "q8s", "reference")


def test_max_shard_size_reshards(tmp_path):
    src = make_checkpoint(tmp_path / "ck")
    res = quantize_model(tmp_path / "ck", tmp_path / "out", "q8s", "reference", max_shard_size=1200)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 4 and shards[0].endswith(f"-of-{len(shards):05d}.safetensors")
    seen = {}
    for s in shards:
        data = qio.load_data(tmp_path / "out" / s)
        seen.update(data)
        sizes = [v.nbytes for v in data.values()]
        assert sum(sizes) <= 1200 or len(sizes) == 1
    assert set(seen) == set(src) and len(res.tensors) == len(src)
    # a single file with --max-shard-size becomes a directory too
    save_file({"a.weight": _x((8, 64), 1), "b.weight": _x((8, 64), 2)}, str(tmp_path / "one.safetensors"))
    quantize_model(tmp_path / "one.safetensors", tmp_path / "one_out", "q8s", "reference", max_shard_size="600B")
    assert sorted(os.listdir(tmp_path / "one_out")) == [
        "model.safetensors.index.json", "one-00001-of-00002.safetensors", "one-00002-of-00002.safetensors"]


def test_interrupted_run_keeps_complete_shards_and_resumes(tmp_path, monkeypatch):
    make_checkpoint(tmp_path / "ck")
    full = quantize_model(tmp_path / "ck", tmp_path / "full", "q8s", "reference", rules=RULES)
    real = ReferenceBackend.quantize
    seen = []

    def stop_in_third_shard(self, x, scheme, **kw):
        seen.append(1)
        if len(seen) == 5:  # two weights per shard: the fifth is in shard 3
            raise KeyboardInterrupt
        return real(self, x, scheme, **kw)

    monkeypatch.setattr(ReferenceBackend, "quantize", stop_in_third_shard)
    with pytest.raises(KeyboardInterrupt):
        quantize_model(tmp_path / "ck", tmp_path / "out", "q8s", "reference", rules=RULES)
    left = sorted(os.listdir(tmp_path / "out"))
    assert [f for f in left if f.endswith(".safetensors")] == ["model-00001-of-00004.safetensors",
                                                               "model-00002-of-00004.safetensors"]
    assert not [f for f in left if f.endswith(".tmp")] and "model.safetensors.index.json" not in left
    for f in ["model-00001-of-00004.safetensors", "model-00002-of-00004.safetensors"]:
        qio.load_data(tmp_path / "out" / f)  # complete and valid
    monkeypatch.setattr(ReferenceBackend, "quantize", real)
    done = quantize_model(tmp_path / "ck", tmp_path / "out", "q8s", "reference", rules=RULES, resume=True)
    assert done.resumed == ["model-00001-of-00004.safetensors", "model-00002-of-00004.safetensors"]
    for f in full.files:
        name = os.path.basename(f)
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "full" / name).read_bytes(), name
    # another recipe changes the run marker: nothing is resumed
    again = quantize_model(tmp_path / "ck", tmp_path / "out", "q8s", "reference", resume=True)
    assert again.resumed == []


def test_dtypes_kept_and_ratios_agree(tmp_path, capsys):
    save_file({"w16": _x((8, 64), 1, np.float16), "wbf": _x((8, 64), 2).astype(ml_dtypes.bfloat16),
               "w32": _x((8, 64), 3)}, str(tmp_path / "m.safetensors"))
    rc = main(["quantize", str(tmp_path / "m.safetensors"), str(tmp_path / "q.safetensors"), "--scheme", "q8s",
               "--backend", "reference"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    ratio_q = out.split("(")[-2].split("x smaller")[0]
    rc = main(["inspect", str(tmp_path / "q.safetensors"), "--json"])
    doc = json.loads(capsys.readouterr()[0])
    assert f"{doc['ratio']:.2f}" == ratio_q  # the same figure in quantize and inspect
    assert {e["name"]: e["source_dtype"] for e in doc["entries"]} == {"w16": "F16", "wbf": "BF16", "w32": "F32"}
    n, total = dequantize_model(tmp_path / "q.safetensors", tmp_path / "d.safetensors", backend="reference")
    assert (n, total) == (3, 3)
    got = load_file(str(tmp_path / "d.safetensors"))
    assert got["w16"].dtype == np.float16 and got["wbf"].dtype == ml_dtypes.bfloat16 and got["w32"].dtype == np.float32
    back = qcore.load(tmp_path / "q.safetensors", backend="reference")
    assert got["wbf"].tobytes() == back["wbf"].numpy(ml_dtypes.bfloat16).tobytes()


def test_dequantize_sharded_directory(tmp_path):
    make_checkpoint(tmp_path / "ck", dtype=np.float16)
    quantize_model(tmp_path / "ck", tmp_path / "q", "q8s", "reference")
    n, total = dequantize_model(tmp_path / "q", tmp_path / "d", backend="reference")
    assert n == 8 and total == 13
    assert (tmp_path / "d" / "config.json").exists()
    index = json.loads((tmp_path / "d" / "model.safetensors.index.json").read_text())
    for shard in set(index["weight_map"].values()):
        for v in load_file(str(tmp_path / "d" / shard)).values():
            assert v.dtype == np.float16


def test_config_json_says_which_tensors_are_quantized_and_dequantize_removes_it(tmp_path):
    """config.json's quantization_config (what transformers dispatches on) names the method, the
    format version, the recipe and every quantized tensor's scheme; the model's other keys are kept;
    `dequantize` writes the config without it."""
    make_checkpoint(tmp_path / "ck")
    (tmp_path / "ck" / "config.json").write_text('{"model_type": "toy", "hidden_size": 64}')
    quantize_model(tmp_path / "ck", tmp_path / "q", "q8s", "reference", rules=RULES, stats=False)
    doc = json.loads((tmp_path / "q" / "config.json").read_text())
    qc = doc.pop("quantization_config")
    assert doc == {"model_type": "toy", "hidden_size": 64}
    assert qc["quant_method"] == "qcore" and qc["format_version"] == "1"
    assert qc["recipe"] == json.loads(qcore.Recipe("q8s", tuple(RULES)).to_json())
    assert qc["tensors"] == {f"layers.{k}.{part}.weight": "q4s/block32:f16" if part == "mlp" else "q8s"
                             for k in range(4) for part in ("attn", "mlp")}
    # a quantized checkpoint quantized again keeps its tensors' schemes (they are carried, not redone)
    quantize_model(tmp_path / "q", tmp_path / "q2", "q8s", "reference", stats=False)
    assert json.loads((tmp_path / "q2" / "config.json").read_text())["quantization_config"]["tensors"] == qc["tensors"]
    dequantize_model(tmp_path / "q", tmp_path / "d", backend="reference")
    assert json.loads((tmp_path / "d" / "config.json").read_text()) == {"model_type": "toy", "hidden_size": 64}


@pytest.mark.parametrize("text", ["not json {", "[1, 2]"])
def test_a_config_json_that_is_not_an_object_is_copied_as_it_is(tmp_path, text):
    make_checkpoint(tmp_path / "ck")
    (tmp_path / "ck" / "config.json").write_text(text)
    quantize_model(tmp_path / "ck", tmp_path / "q", "q8s", "reference", stats=False)
    assert (tmp_path / "q" / "config.json").read_text() == text


def test_dequantize_keeps_another_methods_quantization_config(tmp_path):
    make_checkpoint(tmp_path / "ck")
    quantize_model(tmp_path / "ck", tmp_path / "q", "q8s", "reference", stats=False)
    other = {"model_type": "toy", "quantization_config": {"quant_method": "fp8"}}
    (tmp_path / "q" / "config.json").write_text(json.dumps(other))
    dequantize_model(tmp_path / "q", tmp_path / "d", backend="reference")
    assert json.loads((tmp_path / "d" / "config.json").read_text()) == other


def test_cli_interrupt_of_a_directory_says_resume(tmp_path, capsys, monkeypatch):
    make_checkpoint(tmp_path / "ck")
    real = ReferenceBackend.quantize
    seen = []

    def stop_third(self, x, scheme, **kw):
        seen.append(1)
        if len(seen) == 3:
            raise KeyboardInterrupt
        return real(self, x, scheme, **kw)

    monkeypatch.setattr(ReferenceBackend, "quantize", stop_third)
    rc = main(["quantize", str(tmp_path / "ck"), str(tmp_path / "out"), "--scheme", "q8s", "--backend", "reference"])
    err = capsys.readouterr()[1]
    assert rc == 130
    assert "complete shards in" in err and "--resume" in err
    monkeypatch.setattr(ReferenceBackend, "quantize", real)
    rc = main(["quantize", str(tmp_path / "ck"), str(tmp_path / "out"), "--scheme", "q8s", "--backend", "reference",
               "--resume"])
    out = capsys.readouterr()[0]
    assert rc == 0 and "resumed: 1 shards already complete were kept: model-00001-of-00004.safetensors" in out


def test_already_quantized_tensors_travel_with_their_keys(tmp_path):
    save_file({"w": _x((8, 64), 1), "v": _x((8, 64), 2)}, str(tmp_path / "m.safetensors"))
    quantize_model(tmp_path / "m.safetensors", tmp_path / "q.safetensors", "q4s/block32:f16", "reference",
                   rules=["v=keep"])
    res = quantize_model(tmp_path / "q.safetensors", tmp_path / "q2.safetensors", "q8s", "reference")
    assert {t.name: (t.scheme, t.note) for t in res.tensors} == {
        "w": ("", "already quantized (q4s/block32:f16)"), "v": ("q8s", "")}
    first, second = qio.load_data(tmp_path / "q.safetensors"), qio.load_data(tmp_path / "q2.safetensors")
    assert second["w"] == first["w"]  # the same QuantizedData, scheme and source dtype kept
    assert {e.name: e.source_dtype for e in qio.read_info(tmp_path / "q2.safetensors").entries} == {"w": "F32",
                                                                                                      "v": "F32"}


# ------------------------------------------------------------- the one index parser, and OUT != IN
# Every reader of an index (the whole-model runs, inspect, the format readers and convert) goes
# through `qcore.files.checkpoint.read_index`, so each refusal below is the same for all of them.
def _readers_of(path, tmp_path):
    """Each way a checkpoint's index is read, as a call."""
    import qcore.formats as qf

    return {
        "quantize_model": lambda: quantize_model(path, tmp_path / "q", "q8s", "reference"),
        "dequantize_model": lambda: dequantize_model(path, tmp_path / "d", backend="reference"),
        "load": lambda: qcore.load(path, backend="reference"),
        "formats.read": lambda: qf.read(path),
        "convert": lambda: qcore.convert(path, tmp_path / "c.safetensors", "qcore"),
    }


@pytest.mark.parametrize("text,match", [
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ("{not json", "is not JSON"),
    ('{"weight_map": {}}', "names none"),
    ('{"weight_map": {"a.weight": 3}}', "not a safetensors index"),
], ids=["deeply-nested", "not-json", "empty-weight-map", "not-a-weight-map"])
def test_a_bad_index_is_one_line_for_every_reader(tmp_path, capsys, text, match):
    """A deeply nested index gives the library's one-line error (it leaked a RecursionError from
    the format readers), and an empty weight map is refused everywhere (quantize took it)."""
    make_checkpoint(tmp_path / "ck", n_shards=2)
    (tmp_path / "ck" / "model.safetensors.index.json").write_text(text)
    for via, call in _readers_of(tmp_path / "ck", tmp_path).items():
        with pytest.raises(qcore.InvalidDataError, match=match) as e:
            call()
        assert "model.safetensors.index.json" in str(e.value) and "\n" not in str(e.value), via
    assert main(["inspect", str(tmp_path / "ck")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("qcore: error: ") and "\n" not in err and match in err, err


def test_an_index_naming_a_missing_shard_is_a_storage_error_for_every_reader(tmp_path):
    make_checkpoint(tmp_path / "ck", n_shards=2)
    (tmp_path / "ck" / "model-00002-of-00002.safetensors").unlink()
    for via, call in _readers_of(tmp_path / "ck", tmp_path).items():
        with pytest.raises(qcore.StorageError, match="names shard model-00002-of-00002.safetensors") as e:
            call()
        assert "model.safetensors.index.json" in str(e.value), via


def test_dequantize_rewrites_the_source_index_as_it_is(tmp_path):
    """The index of a dequantized folder is the source's (its other keys, its map's order) with
    the new total size: the bytes of the shards' tensors."""
    make_checkpoint(tmp_path / "ck", n_shards=2)
    quantize_model(tmp_path / "ck", tmp_path / "q", "q8s", "reference", stats=False)
    index = tmp_path / "q" / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc = {"note": "kept", "weight_map": dict(reversed(doc["weight_map"].items())), "metadata": {"format": "pt"}}
    index.write_text(json.dumps(doc))
    dequantize_model(tmp_path / "q", tmp_path / "d", backend="reference")
    got = json.loads((tmp_path / "d" / "model.safetensors.index.json").read_text())
    shards = sorted(set(doc["weight_map"].values()))
    total = sum(os.path.getsize(tmp_path / "d" / s) - 8 - _header_len(tmp_path / "d" / s) for s in shards)
    assert got == {**doc, "metadata": {"format": "pt", "total_size": total}}
    assert list(got) == list(doc) and list(got["weight_map"]) == list(doc["weight_map"])


def test_an_output_that_is_the_input_through_a_link_is_refused(tmp_path, capsys):
    """OUT must differ from IN through symlinks too: a link to the input file, a link to the input
    folder, and (convert) one of an index's shards; nothing is written."""
    save_file({"w": _x((8, 64), 1)}, str(tmp_path / "m.safetensors"))
    quantize_model(tmp_path / "m.safetensors", tmp_path / "q.safetensors", "q8s", "reference")
    (tmp_path / "link.safetensors").symlink_to(tmp_path / "m.safetensors")
    (tmp_path / "qlink.safetensors").symlink_to(tmp_path / "q.safetensors")
    make_checkpoint(tmp_path / "ck", n_shards=2)
    (tmp_path / "cklink").symlink_to(tmp_path / "ck")
    before = {p: p.read_bytes() for p in [tmp_path / "m.safetensors", tmp_path / "q.safetensors",
                                          *sorted((tmp_path / "ck").glob("*.safetensors"))]}
    shard = tmp_path / "cklink" / "model-00001-of-00002.safetensors"
    calls = [
        lambda: quantize_model(tmp_path / "m.safetensors", tmp_path / "link.safetensors", "q8s", "reference"),
        lambda: quantize_model(tmp_path / "ck", tmp_path / "cklink", "q8s", "reference"),
        lambda: quantize_model(tmp_path / "ck", shard, "q8s", "reference", format="compressed-tensors"),
        lambda: dequantize_model(tmp_path / "q.safetensors", tmp_path / "qlink.safetensors", backend="reference"),
    ]
    for call in calls:
        with pytest.raises(qcore.InputError, match="^OUT must differ from IN;"):
            call()
    with pytest.raises(qcore.InputError, match="^DST must differ from SRC;"):
        qcore.convert(tmp_path / "ck" / "model.safetensors.index.json", shard, "qcore")
    assert main(["quantize", str(tmp_path / "ck"), str(shard), "--scheme", "q8s"]) == 1
    assert capsys.readouterr().err.strip() == \
        "qcore: error: OUT must differ from IN; write elsewhere and move it if you want to replace IN"
    assert {p: p.read_bytes() for p in before} == before
