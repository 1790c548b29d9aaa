"""GGUF from a transformers model folder: the metadata llama.cpp's loader requires, read back with
gguf's own `GGUFReader` (llama.cpp itself runs in scripts/check_llama_cpp.py, not in CI).

The folders are made by hand (config.json, a byte-level BPE tokenizer.json, model.safetensors), so
these tests need neither transformers nor tokenizers."""
import json

import ml_dtypes
import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install 'qcore-quant[formats]')")
from gguf import GGMLQuantizationType as T  # noqa: E402

import qcore  # noqa: E402
import qcore.formats as qf  # noqa: E402
from qcore.cli.main import main  # noqa: E402
from qcore.formats import UnrepresentableError  # noqa: E402
from tests.formats_util import assert_bits_equal  # noqa: E402

# 2 layers, hidden 64, 4 query heads and 2 key/value heads of 16 (GQA), 96 FFN, 300 token rows
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
          "rms_norm_eps": 1e-5, "vocab_size": 300, "hidden_act": "silu", "bos_token_id": 0, "eos_token_id": 1,
          "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}, "tie_word_embeddings": False}
SPECIALS = ["<|bos|>", "<|eos|>"]


def _tokenizer_json(pre_tokenizer=None):
    """A byte-level BPE tokenizer.json as `tokenizers` saves it: 2 specials, 256 byte symbols, 2 merges."""
    byte_syms = list(gguf.vocab.bytes_to_unicode().values())
    vocab = {t: i for i, t in enumerate(SPECIALS + byte_syms + ["he", "Ġt"])}
    return {"version": "1.0", "added_tokens": [
                {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
                 "special": True} for i, t in enumerate(SPECIALS)],
            "normalizer": None,
            "pre_tokenizer": pre_tokenizer or {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                               "use_regex": True},
            "post_processor": None, "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                                                "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "byte_fallback": False, "ignore_merges": False,
                      "vocab": vocab, "merges": [["h", "e"], ["Ġ", "t"]]}}


def _tensors(cfg, rng, bias=False):
    """HF llama/qwen2 tensor names and shapes for `cfg`, random f32."""
    d, ff, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = d // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    out = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,), "lm_head.weight": (v, d)}
    for b in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{b}."
        out |= {p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                p + "self_attn.q_proj.weight": (q, d), p + "self_attn.k_proj.weight": (kv, d),
                p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, q),
                p + "mlp.gate_proj.weight": (ff, d), p + "mlp.up_proj.weight": (ff, d),
                p + "mlp.down_proj.weight": (d, ff)}
        if bias:
            out |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                    p + "self_attn.v_proj.bias": (kv,)}
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in out.items()}


def model_folder(path, cfg=None, scheme="q8_0", *, tokenizer=None, bias=False, tensors=None, drop=(), extra=None):
    """A model folder: config.json, tokenizer files and model.safetensors whose 2-D projections are
    quantized with `scheme` (None: all float)."""
    cfg = dict(CONFIG if cfg is None else cfg)
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "tokenizer.json").write_text(json.dumps(tokenizer or _tokenizer_json()))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": SPECIALS[0], "eos_token": SPECIALS[1],
                                                            "add_bos_token": True}))
    ts = _tensors(cfg, np.random.default_rng(0), bias) if tensors is None else tensors
    out = {}
    for name, x in ts.items():
        if name in drop:
            continue
        quantize = scheme is not None and x.ndim == 2 and "embed" not in name
        out[name] = qcore.quantize(x, scheme, backend="reference") if quantize else x
    out |= extra or {}
    qcore.save(path / "model.safetensors", out)
    return path


def _read(path):
    r = gguf.GGUFReader(str(path))
    return r, {k: f.contents() for k, f in r.fields.items()}, {t.name: t for t in r.tensors}


def _rotary(x, heads):
    """llama.cpp's convert_hf_to_gguf `LlamaModel.permute` of rows, in numpy."""
    return x.reshape(heads, 2, x.shape[0] // heads // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def test_llama_folder_writes_the_keys_names_and_tokenizer_llama_cpp_reads(tmp_path):
    src = model_folder(tmp_path / "tiny")
    report = qf.convert(src, tmp_path / "out.gguf", "gguf")
    assert report.lossless
    _, kv, ts = _read(tmp_path / "out.gguf")
    assert kv["general.architecture"] == "llama"
    assert {k: kv[k] for k in kv if k.startswith("llama.")} == pytest.approx({
        "llama.block_count": 2, "llama.context_length": 128, "llama.embedding_length": 64,
        "llama.feed_forward_length": 96, "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2,
        "llama.rope.freq_base": 500000.0, "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.vocab_size": 300,
        "llama.rope.dimension_count": 16})
    # the tokenizer: gpt2 BPE with llama.cpp's gpt2 pre-tokenizer, padded to vocab_size rows
    assert kv["tokenizer.ggml.model"] == "gpt2" and kv["tokenizer.ggml.pre"] == "gpt-2"
    tokens, types = kv["tokenizer.ggml.tokens"], kv["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == 300
    assert tokens[:3] == ["<|bos|>", "<|eos|>", "!"] and tokens[258:261] == ["he", "Ġt", "[PAD260]"]
    assert types[:3] == [gguf.TokenType.CONTROL, gguf.TokenType.CONTROL, gguf.TokenType.NORMAL]
    assert set(types[260:]) == {gguf.TokenType.UNUSED}
    assert kv["tokenizer.ggml.merges"] == ["h e", "Ġ t"]
    assert (kv["tokenizer.ggml.bos_token_id"], kv["tokenizer.ggml.eos_token_id"]) == (0, 1)
    assert kv["tokenizer.ggml.add_bos_token"] is True
    # names through gguf's TensorNameMap, shapes in GGUF's ne order (reversed), norms F32
    want = {"token_embd.weight": ([64, 300], T.F32), "output.weight": ([64, 300], T.Q8_0),
            "output_norm.weight": ([64], T.F32)}
    for b in range(2):
        want |= {f"blk.{b}.attn_norm.weight": ([64], T.F32), f"blk.{b}.ffn_norm.weight": ([64], T.F32),
                 f"blk.{b}.attn_q.weight": ([64, 64], T.Q8_0), f"blk.{b}.attn_k.weight": ([64, 32], T.Q8_0),
                 f"blk.{b}.attn_v.weight": ([64, 32], T.Q8_0), f"blk.{b}.attn_output.weight": ([64, 64], T.Q8_0),
                 f"blk.{b}.ffn_gate.weight": ([64, 96], T.Q8_0), f"blk.{b}.ffn_up.weight": ([64, 96], T.Q8_0),
                 f"blk.{b}.ffn_down.weight": ([96, 64], T.Q8_0)}
    assert {n: (t.shape.tolist(), t.tensor_type) for n, t in ts.items()} == want


@pytest.mark.parametrize("scheme,kind", [("q8_0", T.Q8_0), ("q4_0", T.Q4_0), ("q4_1", T.Q4_1), ("mxfp4", T.MXFP4),
                                         (None, T.F32)], ids=["q8_0", "q4_0", "q4_1", "mxfp4", "f32"])
def test_llama_q_and_k_rows_are_permuted_exactly(tmp_path, scheme, kind):
    """gguf's decode of the written attn_q / attn_k equals llama.cpp's permutation of qcore's
    decoded q_proj / k_proj, bit for bit: whole quantized rows move, nothing is re-quantized."""
    src = model_folder(tmp_path / "tiny", scheme=scheme)
    qf.convert(src, tmp_path / "out.gguf", "gguf")
    ck = qf.read(src)
    _, _, ts = _read(tmp_path / "out.gguf")

    def decoded(value):
        return value if isinstance(value, np.ndarray) else qcore.backend("reference").from_data(value).numpy()

    for hf, gg, heads in (("self_attn.q_proj", "attn_q", 4), ("self_attn.k_proj", "attn_k", 2),
                          ("self_attn.v_proj", "attn_v", None)):
        x = decoded(ck.tensors[f"model.layers.1.{hf}.weight"])
        t = ts[f"blk.1.{gg}.weight"]
        assert t.tensor_type == kind
        got = gguf.quants.dequantize(np.asarray(t.data), kind).reshape(x.shape)
        assert_bits_equal(got, x if heads is None else _rotary(x, heads), signed_zero=kind != T.MXFP4)


def test_qwen2_keeps_rows_and_stores_biases_as_f32(tmp_path):
    cfg = {**CONFIG, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "rope_theta": 1e6}
    cfg.pop("rope_parameters")
    src = model_folder(tmp_path / "qw", cfg, bias=True)
    qf.convert(src, tmp_path / "out.gguf", "gguf")
    _, kv, ts = _read(tmp_path / "out.gguf")
    assert kv["general.architecture"] == "qwen2" and kv["qwen2.rope.freq_base"] == 1e6
    bias = qf.read(src).tensors["model.layers.0.self_attn.q_proj.bias"]
    t = ts["blk.0.attn_q.bias"]
    assert t.tensor_type == T.F32 and np.array_equal(np.asarray(t.data), bias)   # NEOX rope: no permutation


def _split_bytes(regex):
    """tokenizer.json's `pre_tokenizer` of Llama 3 / Qwen2 as `tokenizers` saves it."""
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}


@pytest.mark.parametrize("pre,name", [
    (_split_bytes(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+"), "llama-bpe"),
    (_split_bytes(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+"), "qwen2"),
], ids=["llama-bpe", "qwen2"])
def test_the_pre_tokenizer_is_named_from_tokenizer_json(tmp_path, pre, name):
    qf.convert(model_folder(tmp_path / "m", tokenizer=_tokenizer_json(pre)), tmp_path / "out.gguf", "gguf")
    assert _read(tmp_path / "out.gguf")[1]["tokenizer.ggml.pre"] == name


def test_mistral_is_written_as_llama_and_bf16_norms_as_f32(tmp_path):
    cfg = {**CONFIG, "model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": 4096}
    ts = _tensors(cfg, np.random.default_rng(1))
    ts["model.norm.weight"] = ts["model.norm.weight"].astype(ml_dtypes.bfloat16)
    src = model_folder(tmp_path / "mi", cfg, tensors=ts)
    qf.convert(src, tmp_path / "out.gguf", "gguf")
    _, kv, out = _read(tmp_path / "out.gguf")
    assert kv["general.architecture"] == "llama"
    t = out["output_norm.weight"]
    assert t.tensor_type == T.F32 and np.array_equal(np.asarray(t.data), ts["model.norm.weight"].astype(np.float32))


def test_llama3_rope_scaling_adds_rope_freqs_and_linear_scaling_its_keys(tmp_path):
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    qf.convert(model_folder(tmp_path / "l3", {**CONFIG, "rope_parameters": rope}), tmp_path / "l3.gguf", "gguf")
    t = _read(tmp_path / "l3.gguf")[2]["rope_freqs.weight"]
    assert t.tensor_type == T.F32 and t.shape.tolist() == [8]
    assert np.asarray(t.data)[0] == 1.0 and np.asarray(t.data)[-1] == 8.0   # high frequencies kept, low scaled
    linear = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    qf.convert(model_folder(tmp_path / "li", {**CONFIG, "rope_parameters": linear}), tmp_path / "li.gguf", "gguf")
    kv = _read(tmp_path / "li.gguf")[1]
    assert kv["llama.rope.scaling.type"] == "linear" and kv["llama.rope.scaling.factor"] == 2.0


def test_a_folder_without_config_json_keeps_the_plain_export(tmp_path):
    src = model_folder(tmp_path / "tiny")
    (src / "config.json").unlink()
    qf.convert(src, tmp_path / "out.gguf", "gguf")
    _, kv, ts = _read(tmp_path / "out.gguf")
    assert kv["general.architecture"] == "qcore" and "model.layers.0.self_attn.q_proj.weight" in ts
    assert not any(k.startswith("tokenizer.") for k in kv)


def _cfg(**change):
    return {**CONFIG, **change}


REFUSALS = [
    pytest.param(dict(cfg=_cfg(model_type="gpt2")), UnrepresentableError,
                 r"config.json's model_type 'gpt2' has no llama.cpp mapping in qcore \(it maps llama, mistral, qwen2\)",
                 id="architecture"),
    pytest.param(dict(cfg=_cfg(hidden_act="gelu")), UnrepresentableError, r"hidden_act 'gelu' is not SiLU",
                 id="activation"),
    pytest.param(dict(cfg=_cfg(rope_parameters={"rope_type": "yarn", "factor": 4.0})), UnrepresentableError,
                 r"rope scaling 'yarn' is not mapped", id="rope-yarn"),
    pytest.param(dict(extra={"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)}),
                 UnrepresentableError, r"tensor 'model.layers.0.self_attn.rotary_emb.inv_freq' has no llama name",
                 id="unmapped-tensor"),
    pytest.param(dict(drop=("model.layers.1.mlp.up_proj.weight",)), qcore.InvalidDataError,
                 r"llama.cpp needs tensor blk.1.ffn_up.weight \(and 0 more missing\)", id="missing-tensor"),
    pytest.param(dict(cfg=_cfg(intermediate_size=128)), qcore.InvalidDataError,
                 r"tensor 'model.layers.0.mlp.down_proj.weight' has shape \[64, 96\], but config.json makes "
                 r"llama.cpp's 'blk.0.ffn_down.weight' \[64, 128\]", id="shape"),
    pytest.param(dict(tokenizer=_tokenizer_json({"type": "Whitespace"})), UnrepresentableError,
                 r"tokenizer.json's pre-tokenizer \('Whitespace'\) is not one qcore names for llama.cpp", id="pre"),
    pytest.param(dict(cfg=_cfg(vocab_size=200)), qcore.InvalidDataError,
                 r"the tokenizer has 260 tokens, more than config.json's vocab_size 200", id="vocab"),
    pytest.param(dict(cfg={k: v for k, v in CONFIG.items() if k != "max_position_embeddings"}),
                 qcore.InvalidDataError, r"config.json: 'max_position_embeddings' is missing; llama.cpp needs it",
                 id="no-context-length"),
    pytest.param(dict(cfg=_cfg(num_hidden_layers="2")), qcore.InvalidDataError,
                 r"'num_hidden_layers' must be a positive integer, got '2'", id="bad-config"),
]


@pytest.mark.parametrize("kw,error,match", REFUSALS)
def test_what_llama_cpp_would_not_load_is_refused_in_one_line(tmp_path, kw, error, match):
    """Each folder has CONFIG's tensors, with one thing changed."""
    src = model_folder(tmp_path / "m", **{"tensors": _tensors(CONFIG, np.random.default_rng(0)), **kw})
    with pytest.raises(error, match=match) as e:
        qf.convert(src, tmp_path / "out.gguf", "gguf")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "out.gguf").exists()


def test_no_tokenizer_and_a_quantized_bias_are_refused(tmp_path):
    src = model_folder(tmp_path / "m")
    (src / "tokenizer.json").unlink()
    with pytest.raises(UnrepresentableError, match=r"it has no tokenizer.json or tokenizer.model; llama.cpp needs"):
        qf.convert(src, tmp_path / "out.gguf", "gguf")
    ts = _tensors(CONFIG, np.random.default_rng(2), bias=True)
    src = model_folder(tmp_path / "b", tensors=ts, extra={
        "model.layers.0.self_attn.q_proj.bias": qcore.quantize(ts["model.layers.0.self_attn.q_proj.bias"], "q8_0",
                                                               backend="reference")})
    with pytest.raises(UnrepresentableError, match=r"tensor 'model.layers.0.self_attn.q_proj.bias' is a quantized "
                                                   r"1-D tensor; llama.cpp reads norms and biases as F32"):
        qf.convert(src, tmp_path / "out.gguf", "gguf")


def test_cli_converts_a_model_folder_and_refuses_an_unmapped_one(tmp_path, capsys):
    src = model_folder(tmp_path / "tiny", scheme="q4_0")
    assert main(["convert", str(src), str(tmp_path / "out.gguf"), "--to", "gguf"]) == 0
    assert "lossless" in capsys.readouterr().out
    assert _read(tmp_path / "out.gguf")[1]["general.architecture"] == "llama"
    bad = model_folder(tmp_path / "bad", _cfg(model_type="phi3"))
    assert main(["convert", str(bad), str(tmp_path / "bad.gguf"), "--to", "gguf"]) != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("qcore: error: ") and "model_type 'phi3' has no llama.cpp mapping" in err
    assert len(err.splitlines()) == 1


def test_a_model_gguf_read_and_written_again_keeps_every_key_and_tensor(tmp_path):
    """GGUF -> qcore -> GGUF: the key/values travel in `gguf.kv`, the tensors as bytes."""
    qf.convert(model_folder(tmp_path / "m", scheme="q4_1"), tmp_path / "a.gguf", "gguf")
    qf.convert(tmp_path / "a.gguf", tmp_path / "b.gguf", "gguf")
    (ra, kva, ta), (rb, kvb, tb) = _read(tmp_path / "a.gguf"), _read(tmp_path / "b.gguf")
    assert kva == kvb
    assert list(ta) == list(tb)
    assert all(np.array_equal(np.asarray(ta[n].data), np.asarray(tb[n].data)) for n in ta)


def test_a_sharded_folder_or_its_index_converts_as_the_model(tmp_path):
    """Two shards and `model.safetensors.index.json`, as transformers writes a larger model: the
    folder and the index path both give the llama GGUF."""
    src = model_folder(tmp_path / "sh")
    tensors = qcore.load(src / "model.safetensors")
    (src / "model.safetensors").unlink()
    names = list(tensors)
    shard_of = {n: f"model-0000{1 + (i % 2)}-of-00002.safetensors" for i, n in enumerate(names)}
    for shard in sorted(set(shard_of.values())):
        qcore.save(src / shard, {n: tensors[n] for n in names if shard_of[n] == shard})
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": shard_of}))
    for i, path in enumerate((src, src / "model.safetensors.index.json")):
        qf.convert(path, tmp_path / f"{i}.gguf", "gguf")
        _, kv, ts = _read(tmp_path / f"{i}.gguf")
        assert kv["general.architecture"] == "llama" and len(ts) == 21 and "blk.1.attn_q.weight" in ts


def test_tied_embeddings_leave_output_out(tmp_path):
    """`tie_word_embeddings`: no lm_head in the checkpoint, no `output.weight` in the file (llama.cpp
    then reads `token_embd` for the output)."""
    src = model_folder(tmp_path / "t", _cfg(tie_word_embeddings=True), drop=("lm_head.weight",))
    qf.convert(src, tmp_path / "out.gguf", "gguf")
    ts = _read(tmp_path / "out.gguf")[2]
    assert "output.weight" not in ts and "token_embd.weight" in ts and len(ts) == 20
