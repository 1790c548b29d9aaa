"""One step from a float checkpoint to another tool's format: `qcore quantize --format` and
`quantize_model(format=...)` (qcore/model/export.py). Every tensor keeps its recipe scheme, bit for bit:
the export read back by qcore decodes to what qcore's own output of the same recipe decodes to."""
import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import save_file

import qcore
import qcore.formats as qf
from qcore.cli.main import main
from qcore.model.export import STAGE
from qcore.formats import UnrepresentableError
from qcore.spec.payload import QuantizedData
from qcore.backend.registry import backend as get_backend
from tests.optional import need
from tests.paths import DATA

TOKENIZER = os.path.join(DATA, "tiny_llama")
BE = get_backend("reference")
MIXED = dict(recipe="q4s/block32:f16", rules=["*self_attn*=q8s/block32:f16"])


def float_folder(path, d=64, ff=96, layers=2):
    """A transformers-like folder: config.json, the tiny tokenizer and one float32 model.safetensors
    with llama's tensor names (attention d x d, MLP ff x d, norms 1-D)."""
    rng = np.random.default_rng(0)
    shapes = {"model.embed_tokens.weight": (128, d), "model.norm.weight": (d,), "lm_head.weight": (128, d)}
    for b in range(layers):
        p = f"model.layers.{b}."
        shapes |= {p + "input_layernorm.weight": (d,), p + "self_attn.q_proj.weight": (d, d),
                   p + "self_attn.o_proj.weight": (d, d), p + "mlp.up_proj.weight": (ff, d),
                   p + "mlp.down_proj.weight": (d, ff)}
    path.mkdir()
    save_file({k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()},
              str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": d}))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(TOKENIZER, f), path / f)
    return path


def decoded(path):
    """{name: float32 values} of every tensor of a checkpoint read by qcore (quantized ones decoded)."""
    ck = qf.read(path)
    return {n: BE.from_data(v).numpy() if isinstance(v, QuantizedData) else np.asarray(v)
            for n, v in ck.tensors.items()}, ck


def test_a_mixed_recipe_keeps_every_scheme_in_sharded_compressed_tensors(tmp_path):
    src = float_folder(tmp_path / "m")
    res = qcore.quantize_model(src, tmp_path / "ct", backend="reference", format="compressed-tensors",
                               max_shard_size="20KB", **MIXED)
    qcore.quantize_model(src, tmp_path / "q", backend="reference", max_shard_size="20KB", **MIXED)
    got, ck = decoded(tmp_path / "ct")
    want, _ = decoded(tmp_path / "q")
    assert sorted(got) == sorted(want)
    for name in want:  # every tensor decodes bit for bit to qcore's own output of the recipe
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    bits = {n: v.scheme.bits for n, v in ck.tensors.items() if isinstance(v, QuantizedData)}
    assert {b for n, b in bits.items() if "self_attn" in n} == {8} and {b for n, b in bits.items() if "mlp" in n} == {4}
    assert res.format == "compressed-tensors" and res.requantized == {}

    out = tmp_path / "ct"
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 2 and not (out / STAGE).exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    assert "model.layers.0.mlp.up_proj.weight_packed" in index["weight_map"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama"  # the source's keys kept
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"
    targets = {t: (g["weights"]["num_bits"], g["weights"]["symmetric"]) for g in qc["config_groups"].values()
               for t in g["targets"]}
    assert targets["model.layers.1.self_attn.o_proj"] == (8, True)
    assert targets["model.layers.1.mlp.down_proj"] == (4, True)
    assert len(targets) == len(bits)  # every quantized module of every shard
    assert (out / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("scheme", ["q4s/block32:f16", "q4s", "q8s", "q8s/block16:bf16", "q8s/block64:f32"])
def test_symmetric_int_schemes_write_to_compressed_tensors_with_the_same_values(tmp_path, scheme):
    x = np.random.default_rng(1).standard_normal((24, 64)).astype(np.float32)  # 24 rows: not a power of 2
    q = qcore.quantize(x, scheme, backend="reference").to_data()
    qf.write(tmp_path / "m.safetensors", {"a.weight": q}, "compressed-tensors")
    back = qf.read(tmp_path / "m.safetensors").tensors["a.weight"]
    assert back.scheme.value.value == ("q4f" if q.scheme.bits == 4 else "q8f")
    np.testing.assert_array_equal(BE.from_data(back).numpy(), BE.from_data(q).numpy())


def test_a_scheme_the_format_cannot_hold_is_one_line_naming_the_tensor_and_what_it_holds(tmp_path, capsys):
    src = float_folder(tmp_path / "m")
    rc = main(["quantize", str(src), str(tmp_path / "ct"), "--scheme", "q4_0", "--format", "compressed-tensors",
               "--backend", "reference"])
    err = capsys.readouterr().err.strip()
    assert rc != 0 and len(err.splitlines()) == 1
    assert "tensor 'lm_head.weight' (q4f/block32:f16/signed" in err  # the first planned tensor, in file order
    assert "compressed-tensors holds " in err and "q4s/block32:f16" in err
    assert "--requantize q4f/block32:f16/signed/round:rne/codes:offset=q4f" in err  # a holdable scheme, same bits
    assert not (tmp_path / "ct").exists()  # refused from the plan, before any work


def test_requantize_by_scheme_and_by_pattern_quantizes_from_the_float_source(tmp_path, capsys):
    src = float_folder(tmp_path / "m")
    rc = main(["quantize", str(src), str(tmp_path / "ct"), "--scheme", "q4_0", "--rule", "*down_proj*=nf4",
               "--format", "compressed-tensors", "--requantize", "q4_0=q4s/block32:f16",
               "--requantize", "re:down_proj=q8s", "--backend", "reference"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "requantized for compressed-tensors: model.layers.1.mlp.down_proj.weight: q4s-lookup" in out
    got, ck = decoded(tmp_path / "ct")
    x = {n: a for n, a in zip(*_load(src / "model.safetensors"))}
    for name, to in (("model.layers.0.mlp.down_proj.weight", "q8s"), ("lm_head.weight", "q4s/block32:f16")):
        # straight from the float source: what quantizing it to TO gives, never a second quantization
        np.testing.assert_array_equal(got[name], BE.from_data(qcore.quantize(x[name], to, backend="reference")
                                                             .to_data()).numpy(), err_msg=name)


def _load(path):
    from safetensors.numpy import load_file

    d = load_file(str(path))
    return list(d), list(d.values())


def test_a_requantize_target_the_format_cannot_hold_is_refused(tmp_path):
    src = float_folder(tmp_path / "m")
    with pytest.raises(UnrepresentableError, match=r"--requantize q4_0=nf4 gives .* which compressed-tensors cannot "
                                                   r"hold either"):
        qcore.quantize_model(src, tmp_path / "ct", "q4_0", backend="reference", format="compressed-tensors",
                             requantize=["q4_0=nf4"])


@pytest.mark.parametrize("fmt,scheme", [("gpt-oss", "mxfp4"), ("bitsandbytes", "q4s-lookup[nf4]/block64:f32:flat"),
                                        ("torchao", "nvfp4"), ("compressed-tensors", "nvfp4:recip")])
def test_each_safetensors_format_holds_the_recipe_scheme_bit_for_bit(tmp_path, fmt, scheme):
    if scheme == "nvfp4:recip":
        scheme = "e2m1/block16:ue4m3/tensor:f32:recip/packed_native"
    src = float_folder(tmp_path / "m")
    qcore.quantize_model(src, tmp_path / "out", scheme, backend="reference", format=fmt)
    qcore.quantize_model(src, tmp_path / "q", scheme, backend="reference")
    got, _ = decoded(tmp_path / "out")
    want, _ = decoded(tmp_path / "q")
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_an_interrupted_export_claims_nothing(tmp_path, monkeypatch):
    src = float_folder(tmp_path / "m")
    fmt = qf.get("compressed-tensors")
    real, calls = type(fmt).write, []

    def failing(self, path, checkpoint):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real(self, path, checkpoint)

    monkeypatch.setattr(type(fmt), "write", failing)
    with pytest.raises(KeyboardInterrupt):
        qcore.quantize_model(src, tmp_path / "ct", backend="reference", format="compressed-tensors",
                             max_shard_size="20KB", **MIXED)
    out = tmp_path / "ct"
    assert not (out / "config.json").exists() and not (out / "model.safetensors.index.json").exists()
    assert not (out / STAGE).exists()
    assert [p.name for p in out.glob("*.safetensors")] == [os.path.basename(calls[0])]  # complete shards only


def test_gguf_in_one_step_equals_quantize_then_convert(tmp_path):
    pytest.importorskip("gguf", reason="the gguf package is not installed (pip install 'qcore-quant[formats]')")
    from tests.formats.test_formats_gguf_model import model_folder

    src = model_folder(tmp_path / "m", scheme=None)
    assert main(["quantize", str(src), str(tmp_path / "one.gguf"), "--scheme", "q8_0", "--format", "gguf",
                 "--backend", "reference"]) == 0
    (tmp_path / "two").mkdir()  # the qcore folder has the source's name: GGUF's general.name is the folder's
    assert main(["quantize", str(src), str(tmp_path / "two" / "m"), "--scheme", "q8_0", "--backend", "reference"]) == 0
    assert main(["convert", str(tmp_path / "two" / "m"), str(tmp_path / "two.gguf"), "--to", "gguf"]) == 0
    assert (tmp_path / "one.gguf").read_bytes() == (tmp_path / "two.gguf").read_bytes()
    assert not any(p.name.endswith(STAGE) for p in tmp_path.iterdir())


def test_a_source_tensor_already_quantized_is_checked_too(tmp_path):
    src = float_folder(tmp_path / "m")
    x = np.random.default_rng(2).standard_normal((64, 64)).astype(np.float32)
    qcore.save(src / "extra.safetensors", {"extra.weight": qcore.quantize(x, "q4_1", backend="reference")})
    with pytest.raises(UnrepresentableError, match=r"^tensor 'extra.weight' \(u4/block32:f16/min:f16"):
        qcore.quantize_model(src, tmp_path / "ct", "q4s/block32:f16", backend="reference", format="compressed-tensors")
    assert not (tmp_path / "ct").exists()


def test_an_earlier_exports_config_goes_until_the_new_one_is_complete(tmp_path, monkeypatch):
    src = float_folder(tmp_path / "m")
    qcore.quantize_model(src, tmp_path / "ct", backend="reference", format="compressed-tensors", **MIXED)
    assert (tmp_path / "ct" / "config.json").exists()
    monkeypatch.setattr(type(qf.get("compressed-tensors")), "write", lambda *a: (_ for _ in ()).throw(OSError("full")))
    with pytest.raises(OSError, match="full"):
        qcore.quantize_model(src, tmp_path / "ct", backend="reference", format="compressed-tensors", **MIXED)
    assert not (tmp_path / "ct" / "config.json").exists()


@pytest.mark.parametrize("extra", [["--resume"], ["--cluster", "local"], ["--report", "r.html"]])
def test_format_is_one_local_run(tmp_path, capsys, extra):
    src = float_folder(tmp_path / "m")
    rc = main(["quantize", str(src), str(tmp_path / "ct"), "--scheme", "q8s", "--format", "compressed-tensors", *extra])
    assert rc != 0 and "go with --format qcore" in capsys.readouterr().err
    assert not (tmp_path / "ct").exists()


# What transformers 5.25 writes for these configs (`BitsAndBytesConfig.to_dict`, `TorchAoConfig.to_dict`), key for
# key; the kept Linear layers (here the attention output, by rule) and the kept embedding are left in float.
KEPT = ["model.embed_tokens", "model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj"]
BNB_CONFIG = {"quant_method": "bitsandbytes", "_load_in_8bit": False, "_load_in_4bit": True, "llm_int8_threshold": 6.0,
              "llm_int8_skip_modules": KEPT, "llm_int8_enable_fp32_cpu_offload": False,
              "llm_int8_has_fp16_weight": False, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": False,
              "bnb_4bit_compute_dtype": "float32", "bnb_4bit_quant_storage": "uint8", "load_in_4bit": True,
              "load_in_8bit": False}


def torchao_config(per_tensor_scale):
    return {"quant_method": "torchao", "quant_type": {"default": {
        "_type": "NVFP4WeightOnlyConfig", "_version": 1, "_data": {"use_dynamic_per_tensor_scale": per_tensor_scale}}},
        "modules_to_not_convert": KEPT, "include_input_output_embeddings": False, "untie_embedding_weights": False}


@pytest.mark.parametrize("fmt,scheme,want", [
    ("bitsandbytes", "q4s-lookup[nf4]/block64:f32:flat", BNB_CONFIG),
    ("torchao", "nvfp4", torchao_config(True)),
    ("torchao", "e2m1/block16:ue4m3/packed_native", torchao_config(False)),
], ids=["bitsandbytes-nf4", "torchao-nvfp4", "torchao-one-level"])
def test_bitsandbytes_and_torchao_exports_carry_the_config_transformers_writes(tmp_path, fmt, scheme, want):
    src = float_folder(tmp_path / "m")
    qcore.quantize_model(src, tmp_path / "out", scheme, backend="reference", format=fmt, rules=["*o_proj*=keep"],
                         max_shard_size="20KB")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["quantization_config"] == want and cfg["model_type"] == "llama"


def test_a_tied_output_embedding_is_left_in_float(tmp_path):
    # no lm_head.weight in the checkpoint: transformers ties lm_head to the kept embedding, and a 4-bit lm_head
    # would run on its float weight (bitsandbytes: "quantization state not initialized")
    src = float_folder(tmp_path / "m")
    from safetensors.numpy import load_file

    tensors = load_file(str(src / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(src / "model.safetensors"))
    qcore.quantize_model(src, tmp_path / "bnb", "q4s-lookup[nf4]/block64:f32:flat", backend="reference",
                         format="bitsandbytes")
    cfg = json.loads((tmp_path / "bnb" / "config.json").read_text())
    assert cfg["quantization_config"]["llm_int8_skip_modules"] == ["lm_head", "model.embed_tokens"]


def test_every_torchao_shard_lists_the_whole_model_as_transformers_save_pretrained_does(tmp_path):
    # transformers merges the shards' metadata (the last shard's `tensor_names` wins) and loads only the
    # tensors listed there; qcore reads the folder through its first shard's list
    from safetensors import safe_open

    src = float_folder(tmp_path / "m")
    qcore.quantize_model(src, tmp_path / "ao", "nvfp4", backend="reference", format="torchao", max_shard_size="20KB")
    qcore.quantize_model(src, tmp_path / "q", "nvfp4", backend="reference")
    shards = sorted((tmp_path / "ao").glob("*.safetensors"))
    metas = []
    for shard in shards:
        with safe_open(str(shard), "np") as f:
            metas.append(f.metadata())
    assert len(shards) > 2 and all(m == metas[0] for m in metas)
    got, _ = decoded(tmp_path / "ao")
    want, _ = decoded(tmp_path / "q")
    assert sorted(json.loads(metas[0]["tensor_names"])) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_one_torchao_config_cannot_describe_tensors_with_and_without_a_per_tensor_scale(tmp_path):
    src = float_folder(tmp_path / "m")
    with pytest.raises(UnrepresentableError) as e:
        qcore.quantize_model(src, tmp_path / "ao", "nvfp4", backend="reference", format="torchao",
                             rules=["*up_proj*=e2m1/block16:ue4m3/packed_native"])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("one torchao quantization_config describes the whole model")
    assert "'model.layers.0.mlp.up_proj.weight', 'model.layers.1.mlp.up_proj.weight' need " \
           "use_dynamic_per_tensor_scale False" in msg
    assert not (tmp_path / "ao").exists()  # refused from the plan, before any work


def test_bitsandbytes_refuses_a_quantized_tensor_transformers_cannot_load_as_a_linear_weight(tmp_path, capsys):
    src = float_folder(tmp_path / "m")
    rc = main(["quantize", str(src), str(tmp_path / "bnb"), "--scheme", "q4s-lookup[nf4]/block64:f32:flat",
               "--rule", "*norm*=q4s-lookup[nf4]/block64:f32:flat", "--include-1d", "--format", "bitsandbytes",
               "--backend", "reference"])
    err = capsys.readouterr().err.strip()
    assert rc != 0 and len(err.splitlines()) == 1
    assert "tensor 'model.layers.0.input_layernorm.weight' (q4s-lookup[nf4]/block64:f32:flat, shape [64]): " \
           "transformers loads bitsandbytes 4-bit data only into the 2-D weight of a Linear layer" in err
    assert not (tmp_path / "bnb").exists()


def _bnb_decode(weight):
    from bitsandbytes.functional import dequantize_4bit

    return dequantize_4bit(weight.data, weight.quant_state)


# format -> (scheme, the tool's package, its decode of a loaded weight, max |logit difference| / max |logit|)
ENGINES = {
    # torchao decodes to f32 (`e2m1 * (g * s)`) and multiplies in f32: only the order of the sums differs.
    # bitsandbytes' CPU Linear4bit on a host with AVX-512 BF16 runs a fused kernel that casts the activations
    # and absmax to bfloat16 (backends/cpu/ops.py, "cpu fused op only support bf16"): bf16 rounding, 2**-8
    "bitsandbytes": ("q4s-lookup[nf4]/block64:f32", "bitsandbytes", _bnb_decode, 2e-2),
    "torchao": ("nvfp4", "torchao", lambda w: w.dequantize(), 1e-5),
}


@pytest.mark.parametrize("tied", [False, True], ids=["lm_head", "tied"])
@pytest.mark.parametrize("fmt", sorted(ENGINES))
def test_transformers_loads_a_one_step_export_as_the_quantized_model(tmp_path, fmt, tied):
    """`from_pretrained` of the export (transformers' own bitsandbytes / torchao path, on the CPU) holds the
    tool's tensors, which the tool decodes to qcore's values bit for bit, and gives the logits of the float
    model with every quantized weight replaced by qcore's decode of it. `tied`: the output embedding is the input
    embedding's weight (no `lm_head.weight` in the checkpoint), which must stay a float Linear."""
    scheme, package, tool_decode, tol = ENGINES[fmt]
    torch = need("torch", "torch is not installed")
    transformers = need("transformers", "transformers is not installed")
    pytest.importorskip("accelerate", reason="transformers' bitsandbytes and torchao loaders need accelerate")
    pytest.importorskip(package, reason=f"{package} is not installed (CI does not install it; docs/formats.md "
                                        "records the live check)")
    tok = transformers.AutoTokenizer.from_pretrained(TOKENIZER)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=tied)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "src")
    tok.save_pretrained(tmp_path / "src")
    # lm_head kept: on a host with AVX-512 BF16, bitsandbytes' CPU Linear4bit repacks its weight at the first
    # forward and asserts out_features % 32 == 0 (`_convert_weight_packed_for_cpu`); this vocabulary has 87 words
    qcore.quantize_model(tmp_path / "src", tmp_path / "out", scheme, backend="reference", format=fmt,
                         rules=["*o_proj*=keep", "lm_head.weight=keep"], max_shard_size="400KB")
    assert len(list((tmp_path / "out").glob("*.safetensors"))) > 2  # sharded
    ids = tok("hello world the model is fast", return_tensors="pt").input_ids

    want_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "src")
    params = dict(want_model.named_parameters())
    qcore_values, ck = decoded(tmp_path / "out")
    quantized = [n for n, v in ck.tensors.items() if isinstance(v, QuantizedData)]
    assert len(quantized) == 12  # q, k, v, gate, up and down of each of the 2 layers
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", device_map="cpu")
    loaded = dict(model.named_parameters())
    for name in quantized:
        params[name].data.copy_(torch.from_numpy(qcore_values[name]))
        w = loaded[name]
        assert type(w).__name__ in ("Params4bit", "NVFP4Tensor"), name  # loaded as the tool's tensor
        got = tool_decode(w).float().numpy()
        np.testing.assert_array_equal(got, qcore_values[name], err_msg=name)  # the tool's decode, bit for bit
    for kept in ("model.layers.0.self_attn.o_proj", "lm_head"):
        assert type(model.get_submodule(kept).weight).__name__ == "Parameter"  # left in float (the config's list)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    with torch.no_grad():
        got, want = model(ids).logits, want_model(ids).logits
    diff, scale = float((got - want).abs().max()), float(want.abs().max())
    assert diff <= tol * scale, f"{fmt}: max |logit difference| {diff} > {tol} * max |logit| {scale}"


def test_a_kept_module_whose_name_would_catch_a_quantized_one_is_listed_escaped():
    # transformers' should_convert_module also matches a pattern as a suffix and its dots as any character:
    # the kept 'model.layers.0.mlp.up_proj' would leave the quantized 'vision_model.layers.0.mlp.up_proj' in float
    from qcore.spec.schemes import scheme as parse_scheme

    nf4 = parse_scheme("q4s-lookup[nf4]/block64:f32")
    layout = {"model.layers.0.mlp.up_proj.weight": (None, (8, 64)), "lm_head.weight": (nf4, (8, 64)),
              "vision_model.layers.0.mlp.up_proj.weight": (nf4, (8, 64)),
              "model.layers.0.mlp.gate.weight": (None, (8, 64))}
    got = qf.get("bitsandbytes").model_config(layout)["llm_int8_skip_modules"]
    assert got == ["model.layers.0.mlp.gate", r"model\.layers\.0\.mlp\.up_proj"]
