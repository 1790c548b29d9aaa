"""`qcore.convert` / `qcore convert`: lossless moves between GGUF MXFP4, gpt-oss MXFP4 and qcore mxfp4."""
import json

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

import qcore
import qcore.formats as qf
from qcore import InputError
from qcore.backend.stats import error_stats
from qcore.cli.main import main
from qcore.formats import UnrepresentableError

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install 'qcore-quant[formats]')")
from gguf import GGMLQuantizationType as T  # noqa: E402
from tests.paths import ROOT


def _x(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _gguf_model(path):
    """A small model as llama.cpp's gguf writer makes it: MXFP4 experts, Q8_0 attention, F32 norm."""
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    w.add_string("general.name", "tiny")
    w.add_uint32("gpt-oss.block_count", 1)
    w.add_tensor("blk.0.ffn_up_exps.weight", gguf.quants.quantize(_x((2, 3, 64), 1), T.MXFP4), raw_dtype=T.MXFP4)
    w.add_tensor("blk.0.attn_q.weight", gguf.quants.quantize(_x((4, 32), 2), T.Q8_0), raw_dtype=T.Q8_0)
    w.add_tensor("blk.0.attn_norm.weight", _x((32,), 3))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _tensor_bytes(path):
    return {t.name: (t.tensor_type, np.asarray(t.data).tobytes()) for t in gguf.GGUFReader(str(path)).tensors}


def test_qcore_mxfp4_round_trips_through_gguf_and_gpt_oss(tmp_path):
    """qcore -> GGUF -> gpt-oss -> qcore: the same payload bytes, never re-quantized."""
    q = {"experts": qcore.quantize(_x((2, 3, 96)), "mxfp4", backend="reference").to_data(),
         "router": qcore.quantize(_x((4, 32)), "mxfp4", backend="reference").to_data(),
         "norm": _x((32,))}
    qcore.save(tmp_path / "a.safetensors", q)
    steps = [("a.safetensors", "b.gguf", "gguf"), ("b.gguf", "c.safetensors", "gpt-oss"),
             ("c.safetensors", "d.safetensors", "qcore")]
    for src, dst, fmt in steps:
        report = qcore.convert(tmp_path / src, tmp_path / dst, fmt)
        assert report.lossless and {t.action for t in report.tensors} == {"rearranged", "copied"}
    assert [qf.detect(tmp_path / n).name for n in ("b.gguf", "c.safetensors")] == ["gguf", "gpt-oss"]
    back = qcore.load(tmp_path / "d.safetensors", backend="reference")
    for name in ("experts", "router"):
        assert back[name].to_data().payload == q[name].payload, name
    assert np.array_equal(back["norm"], q["norm"])


def test_a_scale_rounding_rule_converts_losslessly(tmp_path):
    """mxfp4 quantized under the OCP MX rule and Q8_0 under rne: the same payload layout as v1's
    schemes, so every format takes them byte for byte; the files hold no rule, so they read back
    as the v1 scheme with the same bytes."""
    q = {"experts": qcore.quantize(_x((4, 64), 4), "mxfp4/round:mx", backend="reference").to_data(),
         "attn": qcore.quantize(_x((4, 64), 5), "q8s/block32:f16/round:rne", backend="reference").to_data()}
    qcore.save(tmp_path / "a.safetensors", q)
    for fmt, names in (("gguf", ("experts", "attn")), ("compressed-tensors", ("experts",)), ("gpt-oss", ("experts",))):
        keep = {n: q[n] for n in names}
        qcore.save(tmp_path / f"src-{fmt}.safetensors", keep)
        dst = tmp_path / (f"{fmt}.gguf" if fmt == "gguf" else f"{fmt}-dir")
        if fmt != "gguf":
            dst.mkdir()
            dst = dst / "model.safetensors"
        report = qcore.convert(tmp_path / f"src-{fmt}.safetensors", dst, fmt)
        assert report.lossless, fmt
        back = qf.get(fmt).read(dst).tensors
        for n in names:
            got = back[n] if n in back else next(v for k, v in back.items() if k.startswith(n))
            assert got.payload == q[n].payload and got.scheme == q[n].scheme.payload_form, (fmt, n)


def test_gguf_model_round_trips_through_gpt_oss_and_qcore(tmp_path):
    """GGUF (written by gguf) -> qcore -> GGUF: the same tensor bytes and key-values. The Q8_0 tensor
    cannot go to gpt-oss (MXFP4 only), so that leg carries the MXFP4 experts alone."""
    src = _gguf_model(tmp_path / "m.gguf")
    qcore.convert(src, tmp_path / "m.safetensors", "qcore")
    qcore.convert(tmp_path / "m.safetensors", tmp_path / "back.gguf", "gguf")
    assert _tensor_bytes(tmp_path / "back.gguf") == _tensor_bytes(src)
    r = gguf.GGUFReader(str(tmp_path / "back.gguf"))
    assert r.fields["general.name"].contents() == "tiny" and r.fields["general.architecture"].contents() == "gpt-oss"

    experts = {k: v for k, v in qf.read(src).tensors.items() if k.startswith("blk.0.ffn")}
    qf.write(tmp_path / "e.gguf", experts, "gguf")
    qcore.convert(tmp_path / "e.gguf", tmp_path / "e.safetensors", "gpt-oss")
    qcore.convert(tmp_path / "e.safetensors", tmp_path / "e2.safetensors", "qcore")
    qcore.convert(tmp_path / "e2.safetensors", tmp_path / "e2.gguf", "gguf")
    name = "blk.0.ffn_up_exps.weight"
    assert _tensor_bytes(tmp_path / "e2.gguf")[name] == _tensor_bytes(src)[name]


def test_gpt_oss_round_trips_through_gguf_and_qcore(tmp_path):
    rng = np.random.default_rng(5)
    blocks = rng.integers(0, 256, size=(2, 4, 3, 16), dtype=np.uint8)
    scales = rng.integers(100, 140, size=(2, 4, 3), dtype=np.uint8)
    save_file({"model.layers.0.mlp.experts.down_proj_blocks": blocks,
               "model.layers.0.mlp.experts.down_proj_scales": scales}, str(tmp_path / "a.safetensors"))
    qcore.convert(tmp_path / "a.safetensors", tmp_path / "b.gguf", "gguf")
    qcore.convert(tmp_path / "b.gguf", tmp_path / "c.safetensors", "qcore")
    qcore.convert(tmp_path / "c.safetensors", tmp_path / "d.safetensors", "gpt-oss")
    with safe_open(str(tmp_path / "d.safetensors"), "np") as f:
        got = {k: f.get_tensor(k) for k in f.keys()}
    # names spelled as the source did (carried in metadata through GGUF and qcore)
    assert np.array_equal(got["model.layers.0.mlp.experts.down_proj_blocks"], blocks)
    assert np.array_equal(got["model.layers.0.mlp.experts.down_proj_scales"], scales)


def test_what_the_target_cannot_hold_is_refused_unless_requantize(tmp_path):
    src = _gguf_model(tmp_path / "m.gguf")
    with pytest.raises(UnrepresentableError, match=r"tensor 'blk.0.attn_q.weight' \(q8s/block32:f16, shape \[4, 32\]\) "
                                                   r"cannot be written as gpt-oss exactly: .*--requantize"):
        qcore.convert(src, tmp_path / "o.safetensors", "gpt-oss")
    assert not (tmp_path / "o.safetensors").exists()
    report = qcore.convert(src, tmp_path / "o.safetensors", "gpt-oss", requantize="mxfp4", backend="reference")
    rows = {t.name: t for t in report.tensors}
    q = rows["blk.0.attn_q.weight"]
    assert q.action == "requantized" and q.target == str(qcore.scheme("mxfp4")) and 5 < q.sqnr < 40
    assert rows["blk.0.ffn_up_exps.weight"].action == "rearranged" and not report.lossless
    assert qf.read(tmp_path / "o.safetensors").tensors["blk.0.attn_q.weight"].scheme == qcore.scheme("mxfp4")
    # the statistic qcore.quantize_model reports (qcore.backend.stats), of the source's decoded values
    ref = qcore.backend("reference")
    x = ref.from_data(qf.read(src).tensors["blk.0.attn_q.weight"]).numpy()
    y = ref.from_data(qf.read(tmp_path / "o.safetensors").tensors["blk.0.attn_q.weight"]).numpy()
    assert (q.sqnr, q.max_err) == error_stats(x, y)


def test_same_path_is_refused(tmp_path):
    src = _gguf_model(tmp_path / "m.gguf")
    with pytest.raises(InputError, match="DST must differ from SRC"):
        qcore.convert(src, src, "gguf")


def test_cli_convert_and_inspect(tmp_path, capsys):
    src = _gguf_model(tmp_path / "m.gguf")
    assert main(["convert", str(src), str(tmp_path / "m.safetensors"), "--to", "qcore"]) == 0
    out = capsys.readouterr().out
    assert "(gguf) ->" in out and "lossless (bytes rearranged, nothing re-quantized)" in out
    assert main(["inspect", str(src), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == "gguf" and info["schemes"] == sorted([str(qcore.scheme("mxfp4")), "q8s/block32:f16"])
    assert main(["inspect", str(src)]) == 0
    assert "gguf checkpoint, read as qcore schemes" in capsys.readouterr().out


def test_cli_convert_errors_are_one_line(tmp_path, capsys):
    src = _gguf_model(tmp_path / "m.gguf")
    assert main(["convert", str(src), str(tmp_path / "o.safetensors"), "--to", "gpt-oss"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("qcore: error: tensor 'blk.0.attn_q.weight'")
    assert main(["convert", str(src), str(tmp_path / "o.safetensors"), "--to", "onnx"]) == 1
    err = capsys.readouterr().err
    assert "no checkpoint format named 'onnx'; registered: bitsandbytes, compressed-tensors, fp8, gguf, gpt-oss, qcore" in err
    assert main(["convert", str(src), str(tmp_path / "o.safetensors"), "--to", "qcore", "--to-option", "x"]) == 1
    assert "--to-option takes KEY=VALUE, got 'x'" in capsys.readouterr().err


def test_cli_requantize_reports_the_error(tmp_path, capsys):
    src = _gguf_model(tmp_path / "m.gguf")
    assert main(["convert", str(src), str(tmp_path / "o.safetensors"), "--to", "gpt-oss", "--requantize", "mxfp4",
                 "--backend", "reference"]) == 0
    out = capsys.readouterr().out
    assert "requantized" in out and "1 re-quantized" in out


def test_a_plain_tensor_the_target_cannot_hold_is_refused_even_with_requantize(tmp_path):
    qcore.save(tmp_path / "a.safetensors", {"w": np.zeros((2, 2), np.uint16)})
    with pytest.raises(UnrepresentableError, match=r"tensor 'w' \(uint16, shape \[2, 2\]\) cannot be written as gguf "
                                                   r"exactly: GGUF has no type for dtype uint16; cast it to float32$"):
        qcore.convert(tmp_path / "a.safetensors", tmp_path / "b.gguf", "gguf", requantize="q8s/block32:f16")


def test_docs_formats_commands_run_as_written(tmp_path):
    """The bash block at the top of docs/formats.md, run as written (its pip line aside) in a scratch dir."""
    import os
    import re
    import subprocess
    import sys

    doc = os.path.join(ROOT, "docs", "formats.md")
    block = re.search(r"```bash\n(.*?)```", open(doc, encoding="utf-8").read(), re.S).group(1)
    script = "\n".join(line for line in block.splitlines() if not line.startswith("pip install"))
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
           "QCORE_BACKEND": "reference"}
    p = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, capture_output=True, text=True,
                       env=env, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("lossless (bytes rearranged, nothing re-quantized)") == 4
    assert "cannot be written as gpt-oss exactly" in p.stderr and "1 re-quantized" in p.stdout
    a = qcore.load(tmp_path / "tiny.safetensors", backend="reference")["w"].to_data()
    assert qcore.load(tmp_path / "tiny.back.safetensors", backend="reference")["w"].to_data().payload == a.payload


def _sharded_gpt_oss(folder):
    """gpt-oss as transformers shards it: an index, and a blocks/scales pair split over two shards."""
    rng = np.random.default_rng(7)
    blocks = rng.integers(0, 256, size=(2, 3, 2, 16), dtype=np.uint8)
    scales = rng.integers(110, 135, size=(2, 3, 2), dtype=np.uint8)
    folder.mkdir()
    w = "model.layers.0.mlp.experts.down_proj"
    save_file({w + "_blocks": blocks, "model.norm.weight": _x((8,))}, str(folder / "model-00001-of-00002.safetensors"),
              metadata={"format": "pt"})
    save_file({w + "_scales": scales}, str(folder / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    index = {"metadata": {"total_size": blocks.nbytes + scales.nbytes + 32},
             "weight_map": {w + "_blocks": "model-00001-of-00002.safetensors",
                            "model.norm.weight": "model-00001-of-00002.safetensors",
                            w + "_scales": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return w, blocks, scales


@pytest.mark.parametrize("which", ["folder", "index"])
def test_sharded_checkpoint_converts_as_one(tmp_path, which, capsys):
    w, blocks, scales = _sharded_gpt_oss(tmp_path / "m")
    src = tmp_path / "m" if which == "folder" else tmp_path / "m" / "model.safetensors.index.json"
    assert qf.detect(src).name == "gpt-oss"
    qcore.convert(src, tmp_path / "m.gguf", "gguf")
    qcore.convert(tmp_path / "m.gguf", tmp_path / "back.safetensors", "gpt-oss")
    with safe_open(str(tmp_path / "back.safetensors"), "np") as f:
        assert np.array_equal(f.get_tensor(w + "_blocks"), blocks)
        assert np.array_equal(f.get_tensor(w + "_scales"), scales)
    assert main(["inspect", str(src)]) == 0
    assert "gpt-oss checkpoint" in capsys.readouterr().out


def test_sharded_qcore_checkpoint_reads_as_one(tmp_path):
    (tmp_path / "q").mkdir()
    a = qcore.quantize(_x((2, 64)), "mxfp4", backend="reference").to_data()
    qcore.save(tmp_path / "q" / "a.safetensors", {"a": a})
    qcore.save(tmp_path / "q" / "b.safetensors", {"b": _x((4,))})
    (tmp_path / "q" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "a.safetensors", "b": "b.safetensors"}}))
    ck = qf.read(tmp_path / "q")
    assert ck.format == "qcore" and ck.tensors["a"] == a and ck.tensors["b"].shape == (4,)


def test_bad_index_and_missing_index(tmp_path):
    (tmp_path / "bad.safetensors.index.json").write_text("{}")
    with pytest.raises(qcore.InvalidDataError, match=r"not a safetensors index"):
        qf.read(tmp_path / "bad.safetensors.index.json")
    (tmp_path / "empty").mkdir()
    with pytest.raises(qcore.StorageError, match="No such file"):
        qf.detect(tmp_path / "empty")
