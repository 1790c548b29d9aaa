"""transformers loads, runs and saves a folder written by `qcore quantize` (qcore.integrations.transformers).

The model is a tiny random Llama built from a transformers config (2 layers, hidden 256) with the
small word-level tokenizer in tests/data/tiny_llama, quantized with a mixed recipe: attention
q8s/block32:f16, MLP q4s/block32:f16, embeddings and norms kept.
"""
import json
import os
import shutil

import pytest

from tests.optional import need

torch = need("torch", "torch is not installed (pip install torch)")
transformers = need("transformers", "transformers is not installed (pip install transformers)")

import qcore  # noqa: E402
import qcore.integrations.transformers as qt  # noqa: E402
import qcore.nn as qnn  # noqa: E402
from qcore.files import io as qio
from qcore.cli.main import main  # noqa: E402
from tests.paths import DATA

TOKENIZER = os.path.join(DATA, "tiny_llama")
RULES = ["*.self_attn.*=q8s/block32:f16", "*.mlp.*=q4s/block32:f16"]
PROMPT = "hello world the model is fast"


def _tiny_llama(tok):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                   pad_token_id=tok.pad_token_id)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(float model folder, its `qcore quantize` output folder)."""
    root = tmp_path_factory.mktemp("llama")
    tok = transformers.AutoTokenizer.from_pretrained(TOKENIZER)
    src, out = str(root / "src"), str(root / "q")
    _tiny_llama(tok).save_pretrained(src)
    tok.save_pretrained(src)
    argv = ["quantize", src, out, "--no-stats"]
    for r in RULES:
        argv += ["--rule", r]
    assert main(argv) == 0
    return src, out


def _ids(folder):
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    return tok(PROMPT, return_tensors="pt").input_ids


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _with_dequantized_weights(src, qfolder):
    """The float model with each quantized tensor replaced by qcore's dequantize of its bytes."""
    plain = transformers.AutoModelForCausalLM.from_pretrained(src)
    loaded = qcore.load(os.path.join(qfolder, "model.safetensors"))
    params = dict(plain.named_parameters())
    for name, value in loaded.items():
        if isinstance(value, qcore.QTensor):
            params[name].data.copy_(value.dequantize(torch.float32))
    return plain


def test_quantize_writes_the_quantization_config_and_copies_the_tokenizer(folders):
    src, out = folders
    doc = json.load(open(os.path.join(out, "config.json")))["quantization_config"]
    assert doc["quant_method"] == "qcore" and doc["format_version"] == "1"
    assert doc["recipe"]["rules"] == [r.split("=") for r in RULES]
    assert doc["tensors"]["model.layers.1.self_attn.q_proj.weight"] == "q8s/block32:f16"
    assert doc["tensors"]["model.layers.0.mlp.down_proj.weight"] == "q4s/block32:f16"
    assert len(doc["tensors"]) == 14 and "model.embed_tokens.weight" not in doc["tensors"]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert open(os.path.join(out, name), "rb").read() == open(os.path.join(src, name), "rb").read()


def test_from_pretrained_runs_it_as_the_dequantized_model(folders):
    src, out = folders
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert isinstance(model.model.layers[0].mlp.up_proj, qnn.Linear)
    assert str(model.model.layers[1].self_attn.o_proj.scheme) == "q8s/block32:f16"
    assert type(model.lm_head) is torch.nn.Linear and model.lm_head.weight.dtype == torch.float32
    ids = _ids(out)
    want_model = _with_dequantized_weights(src, out)
    got, want = _logits(model, ids), _logits(want_model, ids)
    # `linear`'s contract (docs/spec.md): f32 sums of exact products, so only summation order differs
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (got - want).abs().max()
    gen = dict(max_new_tokens=8, do_sample=False)
    assert torch.equal(model.generate(ids, **gen), want_model.generate(ids, **gen))


def test_quantize_module_in_memory_gives_the_loaded_models_logits(folders):
    src, out = folders
    model = transformers.AutoModelForCausalLM.from_pretrained(src)
    qnn.quantize_module(model, None, rules=RULES)
    ids = _ids(out)
    assert torch.equal(_logits(model, ids), _logits(transformers.AutoModelForCausalLM.from_pretrained(out), ids))


def _files(folder):
    return {n: open(os.path.join(folder, n), "rb").read() for n in sorted(os.listdir(folder))}


@pytest.mark.parametrize("shard", [None, "300KB"])
def test_save_load_save_gives_the_same_files_qcore_reads(folders, tmp_path, shard):
    _, out = folders
    kw = {} if shard is None else {"max_shard_size": shard}
    transformers.AutoModelForCausalLM.from_pretrained(out).save_pretrained(tmp_path / "a", **kw)
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "a").save_pretrained(tmp_path / "b", **kw)
    first, second = _files(tmp_path / "a"), _files(tmp_path / "b")
    assert first == second
    assert (len([n for n in first if n.endswith(".safetensors")]) > 1) == (shard is not None)
    # every shard is a qcore file holding the bytes `qcore quantize` wrote
    want = qcore.load(os.path.join(out, "model.safetensors"))
    for name in (n for n in first if n.endswith(".safetensors")):
        info = qio.read_info(tmp_path / "a" / name)
        for e in info.entries:
            w = want[e.name]
            if e.quantized:
                assert e.scheme == w.scheme and e.source_dtype == "F32"
                got = qcore.load(tmp_path / "a" / name)[e.name]
                assert got.to_data().payload == w.to_data().payload
    doc = json.load(open(tmp_path / "a" / "config.json"))["quantization_config"]
    assert doc == json.load(open(os.path.join(out, "config.json")))["quantization_config"]


def test_dequantize_writes_a_plain_model(folders, tmp_path):
    src, out = folders
    assert main(["dequantize", out, str(tmp_path / "d")]) == 0
    assert "quantization_config" not in json.load(open(tmp_path / "d" / "config.json"))
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "d")
    assert all(type(m) is not qnn.Linear for m in plain.modules())
    ids = _ids(out)
    assert torch.equal(_logits(plain, ids), _logits(_with_dequantized_weights(src, out), ids))


def test_model_dequantize_gives_plain_layers(folders):
    src, out = folders
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    model.dequantize()
    assert all(type(m) is not qnn.Linear for m in model.modules())
    assert getattr(model.config, "quantization_config", None) is None
    ids = _ids(out)
    assert torch.allclose(_logits(model, ids), _logits(_with_dequantized_weights(src, out), ids), rtol=1e-4, atol=1e-4)


def test_quantizing_while_loading_gives_the_clis_model(folders):
    src, out = folders
    recipe = {"rules": RULES}
    model = transformers.AutoModelForCausalLM.from_pretrained(src, quantization_config=qt.QcoreConfig(recipe=recipe))
    ids = _ids(out)
    assert torch.equal(_logits(model, ids), _logits(transformers.AutoModelForCausalLM.from_pretrained(out), ids))
    assert model.config.quantization_config.to_dict()["tensors"] == \
        json.load(open(os.path.join(out, "config.json")))["quantization_config"]["tensors"]


def test_a_quantized_embedding_is_decoded_at_load_and_saved_as_its_bytes(folders, tmp_path):
    src, _ = folders
    out = str(tmp_path / "q")
    assert main(["quantize", src, out, "--no-stats", "--rule", "model.embed_tokens.weight=q8s/block32:f16",
                 "--rule", "*.mlp.*=q4s/block32:f16"]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    emb = model.model.embed_tokens.weight
    assert emb.dtype == torch.float32
    want = qcore.load(os.path.join(out, "model.safetensors"))["model.embed_tokens.weight"]
    assert torch.equal(emb.detach(), want.dequantize(torch.float32).to(emb.device))  # (qcore.load's auto backend: cuda on a GPU)
    model.save_pretrained(tmp_path / "again")
    again = qcore.load(tmp_path / "again" / "model.safetensors")["model.embed_tokens.weight"]
    assert again.to_data().payload == want.to_data().payload


def _edit_config(folder, tmp_path, edit):
    dst = tmp_path / "edited"
    shutil.copytree(folder, dst)
    doc = json.load(open(dst / "config.json"))
    edit(doc["quantization_config"])
    json.dump(doc, open(dst / "config.json", "w"))
    return dst


def test_a_config_that_does_not_fit_the_model_is_refused(folders, tmp_path):
    _, out = folders
    bad = _edit_config(out, tmp_path, lambda q: q["tensors"].update({"model.layers.0.mlp.nope.weight": "q8s"}))
    with pytest.raises(qcore.InvalidDataError, match="names tensor 'model.layers.0.mlp.nope.weight', which this "
                                                     "model \\(LlamaForCausalLM\\) does not have"):
        transformers.AutoModelForCausalLM.from_pretrained(bad)


@pytest.mark.parametrize("edit, match", [
    (lambda q: q.update(format_version="2"), "format_version '2' is not supported"),
    (lambda q: q["tensors"].update({"model.layers.0.mlp.up_proj.weight": "q9z"}), "has a bad scheme"),
    (lambda q: q.update(tensors=["x"]), "needs 'tensors', an object of tensor name -> scheme text"),
])
def test_a_malformed_quantization_config_is_one_line(folders, tmp_path, edit, match):
    _, out = folders
    with pytest.raises(qcore.InvalidDataError, match=match):
        transformers.AutoModelForCausalLM.from_pretrained(_edit_config(out, tmp_path, edit))


def test_a_compressed_tensors_export_loads_through_transformers_own_loader(folders, tmp_path):
    """`qcore quantize --format compressed-tensors` with the mixed recipe: transformers loads the
    folder with compressed-tensors' own quantizer (not qcore's) and decompresses every Linear weight
    to qcore's decoded values, so the logits are those of qcore's dequantized model."""
    need("compressed_tensors", "compressed-tensors is not installed (pip install compressed-tensors)")
    src, out = folders
    ct = tmp_path / "ct"
    argv = ["quantize", src, str(ct), "--format", "compressed-tensors", "--no-stats", "--max-shard-size", "1MB"]
    for r in RULES:
        argv += ["--rule", r]
    assert main(argv) == 0
    assert json.load(open(ct / "config.json"))["quantization_config"]["quant_method"] == "compressed-tensors"
    assert len([n for n in os.listdir(ct) if n.endswith(".safetensors")]) > 1
    want = _with_dequantized_weights(src, out)
    ids = _ids(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(ct)  # compressed-tensors' own forward
    assert not any(isinstance(m, qnn.Linear) for m in model.modules())
    packed = {n.removesuffix(".weight_packed") for n, _ in model.named_parameters() if n.endswith(".weight_packed")}
    assert len(packed) == 14  # every Linear of the recipe runs quantized (8-bit and 4-bit groups)
    assert torch.allclose(_logits(model, ids), _logits(want, ids), rtol=1e-5, atol=1e-5)
    gen = dict(max_new_tokens=8, do_sample=False)
    assert torch.equal(model.generate(ids, **gen), want.generate(ids, **gen))
