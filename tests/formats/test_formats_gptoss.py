"""gpt-oss MXFP4 (`W.blocks` uint8 [..., G, 16] + `W.scales` uint8 [..., G]) <-> qcore mxfp4."""

import json
import os

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

import qcore
import qcore.formats as qf
from qcore.formats import UnrepresentableError
from tests.formats_util import assert_bits_equal, decode, get_backend
from tests.paths import DATA

# gpt-oss's FP4_VALUES (gpt_oss/torch/weights.py), indexed by the nibble
FP4_VALUES = np.array([+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def gptoss_decode(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """gpt-oss's `_get_mxfp4_tensor` in numpy: lut[low nibble], lut[high nibble] interleaved, then
    ldexp(., scale - 127); f32 instead of bf16 (every such value is exact in both)."""
    lo, hi = FP4_VALUES[blocks & 0x0F], FP4_VALUES[blocks >> 4]
    sub = np.stack([lo, hi], axis=-1).reshape(*blocks.shape[:-1], 32)
    out = np.ldexp(sub, (scales.astype(np.int32) - 127)[..., None]).astype(np.float32)
    return out.reshape(*blocks.shape[:-2], blocks.shape[-2] * 32)


def _checkpoint(path, sep=".", shape=(2, 3, 4), seed=0):
    """A checkpoint laid out as gpt-oss writes it: experts' weights as blocks/scales, a bf16 norm."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=shape + (16,), dtype=np.uint8)
    scales = rng.integers(110, 135, size=shape, dtype=np.uint8)
    norm = rng.standard_normal(8).astype(ml_dtypes.bfloat16)
    save_file({f"block.0.mlp.mlp1_weight{sep}blocks": blocks, f"block.0.mlp.mlp1_weight{sep}scales": scales,
               "block.0.norm.scale": norm}, str(path), metadata={"format": "pt"})
    return blocks, scales, norm


@pytest.mark.parametrize("sep", [".", "_"], ids=["openai", "transformers"])
@pytest.mark.parametrize("be_name", ["reference", "cuda"])
def test_reads_exactly_as_gpt_oss_decodes(tmp_path, request, sep, be_name):
    be = get_backend(be_name, request)
    blocks, scales, norm = _checkpoint(tmp_path / "m.safetensors", sep)
    assert qf.detect(tmp_path / "m.safetensors").name == "gpt-oss"
    ck = qf.read(tmp_path / "m.safetensors")
    d = ck.tensors["block.0.mlp.mlp1_weight"]
    assert d.scheme == qcore.scheme("mxfp4") and d.shape == (2, 3, 4 * 32)
    assert_bits_equal(decode(d, be), gptoss_decode(blocks, scales))
    assert np.array_equal(ck.tensors["block.0.norm.scale"].view(np.uint16), norm.view(np.uint16))
    assert ck.metadata["format"] == "pt"


@pytest.mark.parametrize("shape", [(64,), (3, 96), (2, 2, 32)], ids=str)
def test_writes_qcore_mxfp4_as_gpt_oss_blocks(tmp_path, shape):
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    q = qcore.quantize(x, "mxfp4", backend="reference")
    qf.write(tmp_path / "o.safetensors", {"w": q.to_data()}, "gpt-oss")
    with safe_open(str(tmp_path / "o.safetensors"), "np") as f:
        blocks, scales = f.get_tensor("w.blocks"), f.get_tensor("w.scales")
    codes = q.to_data().codes().reshape(*shape[:-1], shape[-1] // 32, 16, 2)
    assert blocks.shape == shape[:-1] + (shape[-1] // 32, 16) and blocks.dtype == np.uint8
    assert np.array_equal(blocks, codes[..., 0] | (codes[..., 1] << 4))   # element 2k low (gpt-oss)
    assert_bits_equal(q.numpy(), gptoss_decode(blocks, scales))


def test_spelling_of_names_survives_a_round_trip(tmp_path):
    _checkpoint(tmp_path / "a.safetensors", "_")
    qf.write(tmp_path / "b.safetensors", qf.read(tmp_path / "a.safetensors"), "gpt-oss")
    with safe_open(str(tmp_path / "b.safetensors"), "np") as f:
        assert sorted(f.keys()) == ["block.0.mlp.mlp1_weight_blocks", "block.0.mlp.mlp1_weight_scales",
                                    "block.0.norm.scale"]
        assert NAMES_KEY not in (f.metadata() or {})


NAMES_KEY = "gpt-oss.names"


def test_writing_puts_the_loaders_quantization_config_beside_the_file(tmp_path):
    """transformers' Mxfp4 loader dispatches on config.json's `quantization_config`; the modules
    whose tensors stay plain are named in `modules_to_not_convert`; other keys of an existing
    config.json are kept."""
    import json

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_oss", "num_hidden_layers": 1}))
    _checkpoint(tmp_path / "a.safetensors", ".")
    qf.write(tmp_path / "b.safetensors", qf.read(tmp_path / "a.safetensors"), "gpt-oss")
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "gpt_oss" and cfg["num_hidden_layers"] == 1
    assert cfg["quantization_config"] == {"quant_method": "mxfp4", "modules_to_not_convert": ["block.0.norm"]}


def _zero_scale_file(path, codes_nonzero: bool):
    blocks = np.zeros((2, 16), np.uint8)
    blocks[0, 3] = 0x21 if codes_nonzero else 0x88     # 0x88: two -0 codes, decode to -0 either way
    save_file({"w.blocks": blocks, "w.scales": np.array([0, 127], np.uint8)}, str(path))


def test_scale_byte_zero_with_a_nonzero_code_is_refused_by_default(tmp_path):
    _zero_scale_file(tmp_path / "z.safetensors", True)
    with pytest.raises(UnrepresentableError, match=r"tensor 'w': 1 block\(s\) have scale byte 0 and a non-zero code.*"
                                                   r"zero_scale=spec"):
        qf.read(tmp_path / "z.safetensors")
    d = qf.read(tmp_path / "z.safetensors", zero_scale="spec").tensors["w"]
    assert d.scales()[0] == np.float32(2.0 ** -127)   # decoded per docs/spec.md, schemes (UE8M0)


def test_scale_byte_zero_with_zero_codes_reads(tmp_path):
    _zero_scale_file(tmp_path / "z.safetensors", False)
    d = qf.read(tmp_path / "z.safetensors").tensors["w"]
    assert not np.any(qcore.backend("reference").from_data(d).numpy())


def test_writing_refuses_the_same_zero_scale_blocks(tmp_path):
    _zero_scale_file(tmp_path / "z.safetensors", True)
    d = qf.read(tmp_path / "z.safetensors", zero_scale="spec").tensors["w"]
    with pytest.raises(UnrepresentableError, match="scale byte 0"):
        qf.write(tmp_path / "o.safetensors", {"w": d}, "gpt-oss")
    qf.write(tmp_path / "o.safetensors", {"w": d}, "gpt-oss", zero_scale="spec")


@pytest.mark.parametrize("scheme,shape,match", [
    ("mxfp4", (2, 48), r"gpt-oss needs whole blocks of 32, got last dim 48"),
    ("nvfp4", (2, 64), r"gpt-oss holds mxfp4 blocks, got e2m1/block16:ue4m3"),
])
def test_what_gpt_oss_cannot_hold_is_refused(tmp_path, scheme, shape, match):
    d = qcore.quantize(np.ones(shape, np.float32), scheme, backend="reference").to_data()
    with pytest.raises(UnrepresentableError, match=match):
        qf.write(tmp_path / "o.safetensors", {"w": d}, "gpt-oss")


def test_bad_option_is_named():
    with pytest.raises(qcore.InputError, match=r"zero_scale must be one of refuse, spec, got 'maybe'"):
        qf.get("gpt-oss").with_options(zero_scale="maybe")
    with pytest.raises(qcore.InputError, match=r"takes option zero_scale \(refuse\|spec\), got colour"):
        qf.get("gpt-oss").with_options(colour="red")


def test_a_qcore_file_is_never_taken_for_gpt_oss(tmp_path):
    qcore.save(tmp_path / "q.safetensors", {"w.blocks": np.zeros((2, 16), np.uint8), "w.scales": np.zeros(2, np.uint8)})
    assert qf.detect(tmp_path / "q.safetensors").name == "qcore"


def test_mismatched_pair_is_not_gpt_oss(tmp_path):
    save_file({"w.blocks": np.zeros((2, 8), np.uint8), "w.scales": np.zeros(2, np.uint8)},
              str(tmp_path / "m.safetensors"))
    assert qf.detect(tmp_path / "m.safetensors").name == "qcore"
    with pytest.raises(UnrepresentableError, match=r"are not gpt-oss MXFP4"):
        qf.read(tmp_path / "m.safetensors", "gpt-oss")


# ------------------------------------------------- against transformers' own decode (torch, CPU)


@pytest.mark.filterwarnings("ignore:overflow encountered")   # scale byte 254 with code 6: inf on both sides
@pytest.mark.parametrize("be_name", ["reference", "cuda"])
def test_transformers_decode_matches_bit_for_bit(request, be_name):
    """tests/data/gptoss_mxfp4*.safetensors come from scripts/make_gptoss_fixture.py: transformers'
    `convert_moe_packed_tensors` output (bf16, axes 1 and 2 swapped), scale bytes 0, 1 and 254 included."""
    be = get_backend(be_name, request)
    ref = qf.read(os.path.join(DATA, "gptoss_mxfp4.ref.safetensors")).tensors
    with pytest.raises(UnrepresentableError, match="scale byte 0"):
        qf.read(os.path.join(DATA, "gptoss_mxfp4.safetensors"))
    ck = qf.read(os.path.join(DATA, "gptoss_mxfp4.safetensors"), zero_scale="spec")
    assert sorted(ck.tensors) == sorted(ref)
    for name, d in ck.tensors.items():
        got = be.to_numpy(be.dequantize(be.from_data(d), dtype=ml_dtypes.bfloat16)).swapaxes(1, 2)
        want = ref[name]
        assert got.shape == want.shape and want.dtype == ml_dtypes.bfloat16
        bad = got.view(np.uint16) != want.view(np.uint16)
        assert not bad.any(), f"{name}: {int(bad.sum())} of {bad.size} values differ"


# gpt-oss-20b's config.json ships these modules_to_not_convert patterns
GPT_OSS_PATTERNS = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def _transformers_checkpoint(path):
    """gpt-oss as transformers names it: the experts' mxfp4 weights beside their plain bf16 biases."""
    rng = np.random.default_rng(2)
    bf = lambda *s: rng.standard_normal(s).astype(ml_dtypes.bfloat16)  # noqa: E731
    exp = "model.layers.0.mlp.experts"
    save_file({f"{exp}.gate_up_proj_blocks": rng.integers(0, 256, (2, 8, 1, 16), dtype=np.uint8),
               f"{exp}.gate_up_proj_scales": rng.integers(118, 130, (2, 8, 1), dtype=np.uint8),
               f"{exp}.gate_up_proj_bias": bf(2, 8), f"{exp}.down_proj_bias": bf(2, 4),
               f"{exp}.down_proj_blocks": rng.integers(0, 256, (2, 4, 1, 16), dtype=np.uint8),
               f"{exp}.down_proj_scales": rng.integers(118, 130, (2, 4, 1), dtype=np.uint8),
               "model.layers.0.mlp.router.weight": bf(2, 32), "model.layers.0.self_attn.q_proj.weight": bf(32, 32),
               "model.embed_tokens.weight": bf(10, 32), "lm_head.weight": bf(10, 32), "model.norm.weight": bf(32)},
              str(path))


def test_config_never_lists_a_module_holding_mxfp4_weights(tmp_path):
    """The experts module holds mxfp4 weights and plain biases: it must match no pattern, or
    transformers' `should_convert_module` would leave the experts unconverted."""
    from qcore.formats.gptoss import should_convert

    _transformers_checkpoint(tmp_path / "a.safetensors")
    qf.write(tmp_path / "b.safetensors", qf.read(tmp_path / "a.safetensors"), "gpt-oss")
    got = json.loads((tmp_path / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    assert got == ["lm_head", "model.embed_tokens", "model.layers.0.mlp.router", "model.layers.0.self_attn.q_proj",
                   "model.norm"]
    assert should_convert("model.layers.0.mlp.experts", got)
    assert not should_convert("model.layers.0.self_attn.q_proj", got)


def test_config_keeps_the_sources_wildcard_patterns(tmp_path):
    """gpt-oss's own patterns come back as they were (other keys of its quantization_config too);
    a pattern that would match a module holding mxfp4 weights is dropped."""
    from qcore.formats.gptoss import should_convert

    _transformers_checkpoint(tmp_path / "a.safetensors")
    source = {"quant_method": "mxfp4", "modules_to_not_convert": GPT_OSS_PATTERNS + ["model.layers.0.mlp"]}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_oss", "quantization_config": source}))
    (tmp_path / "out").mkdir()
    qcore.convert(tmp_path / "a.safetensors", tmp_path / "q.safetensors", "qcore")  # carried through qcore's file
    qcore.convert(tmp_path / "q.safetensors", tmp_path / "out" / "b.safetensors", "gpt-oss")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert cfg == {"quant_method": "mxfp4", "modules_to_not_convert": GPT_OSS_PATTERNS}
    assert should_convert("model.layers.0.mlp.experts", cfg["modules_to_not_convert"])
    assert not should_convert("model.layers.7.self_attn", cfg["modules_to_not_convert"])


@pytest.mark.parametrize("module,pattern,converts", [
    ("model.layers.11.attn", "model.layers.1", True),  # a module boundary ends the match
    ("model.layers.1.attn", "model.layers.1", False),
    ("model.layers.11.self_attn", "model.layers.*.self_attn", False),  # a regex
    ("model.layers.0.mlp.gate_proj", "mlp.gate", True),
    ("model.decoder.layers.23.fc1", "fc1", False),  # a suffix
    ("model.layers.0.mlp.experts", "model.layers.0.mlp", False),  # a parent skips its children
])
def test_should_convert_is_transformers_rule(module, pattern, converts):
    """The examples of transformers 5.25's `should_convert_module` comments, and a parent module
    (checked against the function itself: the same answer on 120 module x pattern pairs)."""
    from qcore.formats.gptoss import should_convert

    assert should_convert(module, [pattern]) is converts


def test_a_source_pattern_that_could_hang_is_named(tmp_path):
    """A modules_to_not_convert pattern that is no regex bounded in time (nested repetition) is
    named when the config is written, not matched."""
    _transformers_checkpoint(tmp_path / "a.safetensors")
    source = {"quant_method": "mxfp4", "modules_to_not_convert": ["(model.+)+x"]}
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": source}))
    with pytest.raises(qcore.InvalidDataError, match=r"modules_to_not_convert pattern '\(model.\+\)\+x' is not a regex"):
        qf.write(tmp_path / "b.safetensors", qf.read(tmp_path / "a.safetensors"), "gpt-oss")
