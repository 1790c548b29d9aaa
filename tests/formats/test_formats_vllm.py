"""vLLM loads what qcore exports: the config.json and tensor names of a compressed-tensors export,
and the GGUF of a model folder, checked against the rules vLLM's loaders apply.

vLLM needs a CUDA build these machines lack, so the rules are restated here in our own code, each
citing the vLLM function it follows (vllm-project/vllm, read at the commits below; docs/formats.md,
"vLLM", has the same rules in prose):

- CT: `vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors.py` at
  be696453ee1b (`CompressedTensorsConfig._quantization_scheme_map_from_config`,
  `_get_scheme_from_parts`, `get_scheme`), and a later stored version of the same file that adds
  `_is_mxfp4` -> `CompressedTensorsW4A16Mxfp4` (the index gave no commit for it);
- UTILS: `.../compressed_tensors/utils.py` (`should_ignore_layer`, `find_matched_target`,
  `_match_fused_layer`; the version with `_handle_fused_layers`);
- the schemes' `create_weights`: `schemes/compressed_tensors_wNa16.py` (the `choose_mp_linear_kernel`
  version with `weight_zero_point`; 519b90d4648d has the same names without it),
  `compressed_tensors_w8a8_int8.py` at c45614b5d83b, `compressed_tensors_w8a8_fp8.py` at de4766a1b8c5
  (tensor, channel) and a later version with `BlockQuantScaleParameter`,
  `compressed_tensors_w4a16_nvfp4.py` at 17b6501a6ce9, `compressed_tensors_w4a16_mxfp4.py` at
  1a6da54818268;
- GGUF: `vllm/model_executor/model_loader/gguf_loader.py` at 80a1ccf88edd
  (`GGUFModelLoader._get_gguf_weights_map`, `load_model`), `vllm/model_executor/layers/quantization/
  gguf.py` at 5a6541db9bfa (the type sets `_fuse_mul_mat` serves), `weight_utils.py`
  (`gguf_quant_weights_iterator`: GGUF tensors not in the name map are skipped), and
  `models/llama.py` (`is_neox_style = False` for a GGUF whose `model_type` is `llama`).
"""
import json
import math
import os
import re
import shutil
import struct
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import pytest

import qcore
import qcore.formats as qf
from qcore.cli.main import main
from qcore.formats import Contents
from qcore.formats.ctensors import ACTIVATIONS_KEY
from tests.optional import need
from tests.paths import DATA

# --- compressed-tensors: the rules --------------------------------------------------------------

# UTILS `is_activation_quantization_format`: the formats whose config groups parse input_activations
# even when absent (later versions add nvfp4-pack-quantized)
ACTIVATION_FORMATS = ("naive-quantized", "int-quantized", "float-quantized", "nvfp4-pack-quantized")
WNA16_BITS = (4, 8)  # wNa16 `WNA16_SUPPORTED_TYPES_MAP` (uint4b8, uint8b128; uint4 / uint8 with zero points)
# UTILS `should_ignore_layer` / `_match_fused_layer` (FUSED_LAYER_NAME_MAPPING): vLLM's fused layers
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# safetensors dtype names of the torch dtypes `create_weights` registers
I32, I64, I8, U8, FP8, F32, F16, BF16 = "I32", "I64", "I8", "U8", "F8_E4M3", "F32", "F16", "BF16"
_FLOATS = (F32, BF16, F16)


class Refused(Exception):
    """vLLM refuses the module: the exception it raises, and where."""


@dataclass(frozen=True)
class Param:
    """A parameter a scheme's `create_weights` registers: vLLM's weight loader asserts the
    checkpoint tensor's shape and copies it into a parameter of `dtype` (a cast)."""

    dtype: str
    shape: tuple[int, ...]


def vllm_scheme(weights: dict, acts: dict | None, fmt: str) -> str:
    """The vLLM scheme class a config group selects (CT `_get_scheme_from_parts`), or `Refused`."""
    w = dict(weights)
    strategy, bits, kind, sym = w.get("strategy"), w.get("num_bits"), w.get("type"), w.get("symmetric", True)
    act_format = fmt in ACTIVATION_FORMATS
    # CT `_quantization_scheme_map_from_config`: an activation format without input_activations
    # asserts that the weights are float (W8A16 FP8 is the only such scheme)
    if (act_format or acts) and not acts and kind != "float":
        raise Refused(f"AssertionError in _quantization_scheme_map_from_config: format {fmt} with no "
                      "input_activations needs float weights")
    if acts is None or not (act_format or acts):
        acts = None
    if strategy == "tensor_group" and kind == "float" and bits == 4 and w.get("group_size") == 16 and sym \
            and acts is None:
        return "CompressedTensorsW4A16Fp4"  # `_is_nvfp4_format(weights) and input_quant is None`
    if strategy == "group" and kind == "float" and bits == 4 and w.get("group_size") == 32 and sym:
        return "CompressedTensorsW4A16Mxfp4"  # `_is_mxfp4` (later version)
    if strategy in ("channel", "group") and acts is None and not w.get("dynamic") \
            and fmt == "pack-quantized" and bits in WNA16_BITS:
        return "CompressedTensorsWNA16"  # `_is_wNa16_group_channel` + pack-quantized
    if act_format:
        static_weight = sym and not w.get("dynamic")
        if kind == "float" and static_weight and strategy in ("tensor", "channel", "block"):
            if acts is not None and acts.get("type") == "float" and (
                    acts.get("dynamic") or (acts.get("symmetric") and acts.get("strategy") == "tensor")):
                return "CompressedTensorsW8A8Fp8"  # `_is_fp8_w8a8` (W8A16Fp8 below compute capability 8.9)
            if strategy == "block":  # w8a16_fp8 `create_weights` (aa63715b2ba9): channel or tensor only
                raise Refused("ValueError in CompressedTensorsW8A16Fp8.create_weights: Unsupported weight "
                              "strategy=block")
            return "CompressedTensorsW8A16Fp8"  # `_is_fp8_w8a16`
        if acts is not None and bits == acts.get("num_bits") == 8 and strategy in ("tensor", "channel") and sym \
                and not w.get("dynamic"):
            if acts.get("strategy") == "tensor" and not acts.get("dynamic"):
                return "CompressedTensorsW8A8Int8"  # `_is_static_tensor_w8a8`
            if acts.get("strategy") == "token" and acts.get("dynamic"):
                return "CompressedTensorsW8A8Int8"  # `_is_dynamic_token_w8a8`
    raise Refused("NotImplementedError in _get_scheme_from_parts: No compressed-tensors compatible scheme "
                  f"was found ({fmt}, weights {strategy} {kind}{bits} symmetric={sym}, activations {acts})")


def vllm_params(cls: str, w: dict, acts: dict | None, out: int, inp: int, model_dtype: str) -> dict[str, Param]:
    """The checkpoint tensors (suffix -> Param) of one `[out, inp]` module under scheme `cls`, as
    the scheme's `create_weights` registers them."""
    strategy = w.get("strategy")
    if cls == "CompressedTensorsWNA16":  # wNa16 `create_weights`
        pack = 32 // w["num_bits"]
        groups = 1 if strategy == "channel" else inp // w["group_size"]
        params = {"weight_packed": Param(I32, (out, inp // pack)),
                  "weight_scale": Param(model_dtype, (out, groups)),  # params_dtype: the model's dtype
                  "weight_shape": Param(I64, (2,))}
        if not w.get("symmetric", True):
            params["weight_zero_point"] = Param(I32, (out // pack, groups))  # rows floor-divided
        return params
    if cls in ("CompressedTensorsW4A16Fp4", "CompressedTensorsW4A16Mxfp4"):  # w4a16_nvfp4 / _mxfp4
        block, scale = (16, FP8) if cls.endswith("Fp4") else (32, U8)
        params = {"weight_packed": Param(U8, (out, inp // 2)), "weight_scale": Param(scale, (out, inp // block))}
        if cls.endswith("Fp4"):
            params["weight_global_scale"] = Param(F32, (1,))  # PerTensorScaleParameter, one per shard
        return params
    code = FP8 if "Fp8" in cls else I8  # w8a8_fp8 / w8a8_int8 `create_weights`
    if strategy == "channel":
        scale = Param(F32, (out, 1))
    elif strategy == "block":
        bn, bk = w["block_structure"]
        scale = Param(F32, (math.ceil(out / bn), math.ceil(inp / bk)))
    else:
        scale = Param(F32, (1,))
    params = {"weight": Param(code, (out, inp)), "weight_scale": scale}
    if acts is not None and not acts.get("dynamic"):
        params["input_scale"] = Param(F32, (1,))
        if code == I8 and not acts.get("symmetric", True):
            params["input_zero_point"] = Param(I8, (1,))
    return params


def _exact_cast(src: str, dst: str) -> bool:
    """Whether copying a `src` tensor into a `dst` parameter keeps every value (f16 and bf16 widen
    to f32 exactly; any other change of dtype rounds or reinterprets)."""
    return src == dst or (src in _FLOATS and dst == F32)


def _matches(name: str, target: str) -> bool:
    """UTILS `_is_equal_or_regex_match` (without the class-name `check_contains` form)."""
    return bool(re.match(target[3:], name)) if target.startswith("re:") else name == target


def vllm_layer_group(layer: str, config: dict) -> str | None:
    """The config group vLLM gives one of its Linear layers (`model.layers.0.self_attn.qkv_proj`):
    None when ignored (UTILS `should_ignore_layer`), else the group of the target
    `find_matched_target` finds; `Refused` where vLLM raises."""
    parent, proj = layer.rsplit(".", 1)
    shards = [f"{parent}.{s}" for s in FUSED.get(proj, (proj,))]
    ignore = config.get("ignore", [])
    ignored = {any(_matches(s, t) for t in ignore) for s in shards}
    if len(ignored) > 1:
        raise Refused(f"ValueError in should_ignore_layer: Found a different quantization schemes for "
                      f"{shards} in {layer}")
    if ignored == {True}:
        return None
    group_of = {t: g for g, grp in config["config_groups"].items() for t in grp["targets"]}
    # find_matched_target: the layer's own name, else (fused) the first target that names a shard;
    # that one group then sizes every shard's parameters (the shards must share it)
    hit = next((t for t in group_of if _matches(layer, t)), None)
    if hit is None and proj in FUSED and all(s in group_of for s in shards):
        hit = next(t for t in group_of if t in shards)
    if hit is None and proj in FUSED:  # `_handle_fused_layers`: retried as q_proj / up_proj
        unfused = f"{parent}.{'q_proj' if proj == 'qkv_proj' else 'up_proj'}"
        hit = next((t for t in group_of if _matches(unfused, t)), None)
    if hit is None:
        raise Refused(f"ValueError in find_matched_target: Unable to find matching target for {layer} in the "
                      "compressed-tensors config")
    groups = {group_of.get(s) or next((group_of[t] for t in group_of if _matches(s, t)), None) for s in shards}
    if len(groups) > 1:
        raise Refused(f"{layer}: its shards {shards} are in config groups {sorted(map(str, groups))}; vLLM sizes "
                      f"them all by {group_of[hit]}'s scheme")
    return group_of[hit]


def _header(path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """A safetensors file's tensors: name -> (dtype, shape)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        head = json.loads(f.read(n))
    return {k: (v["dtype"], tuple(v["shape"])) for k, v in head.items() if k != "__metadata__"}


def vllm_check(folder, layers: list[str], shapes: dict[str, tuple[int, int]]) -> dict[str, str]:
    """What vLLM makes of a compressed-tensors folder (config.json + model.safetensors) for a model
    with Linear `layers` (vLLM's names, fused): layer -> scheme class, "unquantized" or
    "refused: ...". A loadable layer whose tensors are not exactly its parameters (name, shape, a
    dtype copied without loss) fails the assertion with the list."""
    config = json.loads((folder / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"  # the registry key vLLM dispatches on
    model_dtype = {"float16": F16, "bfloat16": BF16, "float32": F32}[config.get("torch_dtype", "float32")]
    tensors = _header(folder / "model.safetensors")
    out, bad = {}, []
    for layer in layers:
        try:
            group = vllm_layer_group(layer, qc)
            if group is None:
                out[layer] = "unquantized"
                continue
            g = qc["config_groups"][group]
            fmt = g.get("format") or qc["format"]
            cls = vllm_scheme(g["weights"], g.get("input_activations"), fmt)
        except Refused as e:
            out[layer] = f"refused: {e}"
            continue
        out[layer] = cls
        parent, proj = layer.rsplit(".", 1)
        for shard in (f"{parent}.{s}" for s in FUSED.get(proj, (proj,))):
            want = vllm_params(cls, g["weights"], g.get("input_activations"), *shapes[shard], model_dtype)
            have = {k[len(shard) + 1:]: v for k, v in tensors.items() if k.startswith(shard + ".")}
            for suffix in sorted(set(want) | set(have)):
                w, h = want.get(suffix), have.get(suffix)
                if w is None or h is None:
                    bad.append(f"{shard}.{suffix}: {'not a parameter of ' + cls if w is None else 'missing'}")
                elif h[1] != w.shape and not (w.shape == (1,) and h[1] == ()):
                    bad.append(f"{shard}.{suffix}: shape {list(h[1])}, {cls} registers {list(w.shape)}")
                elif not _exact_cast(h[0], w.dtype):
                    bad.append(f"{shard}.{suffix}: {h[0]} copied into a {w.dtype} parameter changes values")
    if bad:
        raise AssertionError("\n".join(bad))
    return out


# --- compressed-tensors: a tiny llama, quantized by qcore, converted -------------------------------

HIDDEN, KV, FFN, LAYERS = 128, 64, 128, 2
MODULES = {"self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (KV, HIDDEN), "self_attn.v_proj": (KV, HIDDEN),
           "self_attn.o_proj": (HIDDEN, HIDDEN), "mlp.gate_proj": (FFN, HIDDEN), "mlp.up_proj": (FFN, HIDDEN),
           "mlp.down_proj": (HIDDEN, FFN)}
SHAPES = {f"model.layers.{b}.{m}": s for b in range(LAYERS) for m, s in MODULES.items()}
# vLLM's LlamaForCausalLM Linear layers (q/k/v and gate/up fused); lm_head is a ParallelLMHead,
# which CompressedTensorsConfig.get_quant_method leaves unquantized
LAYERS_VLLM = [f"model.layers.{b}.{m}" for b in range(LAYERS)
               for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")]
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
         "intermediate_size": FFN, "num_hidden_layers": LAYERS, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 256, "torch_dtype": "float16"}
W8A8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}  # the preset's
FP8_DYNAMIC = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}


def export(tmp_path, scheme: str, *, model_dtype="float16", acts=None, plain=(), per_module=None):
    """qcore-quantize a tiny llama's projections with `scheme` (`per_module` overrides some; `plain`
    leaves some float), write it as a qcore file, `qcore convert` it to compressed-tensors in a
    folder holding the model's config.json, and return that folder. With `acts` (the modules'
    input_activations, which a qcore file does not carry) the checkpoint is written to
    compressed-tensors directly, the activations in its metadata as a W8A8 file's reader leaves them."""
    rng = np.random.default_rng(7)
    ref = qcore.backend("reference")
    tensors, meta = {"model.embed_tokens.weight": rng.standard_normal((256, HIDDEN)).astype(np.float32),
                     "model.norm.weight": np.ones(HIDDEN, np.float32),
                     "lm_head.weight": rng.standard_normal((256, HIDDEN)).astype(np.float32)}, {}
    for name, shape in SHAPES.items():
        x = rng.standard_normal(shape).astype(np.float32)
        text = (per_module or {}).get(name.rsplit(".", 1)[-1], scheme)
        tensors[name + ".weight"] = x if name.endswith(plain) else ref.into_data(ref.quantize(x, text))
        if acts is not None and not name.endswith(plain):
            meta[name + ".weight"] = acts
    src, dst = tmp_path / "qcore", tmp_path / "vllm"
    src.mkdir()
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps({**LLAMA, "torch_dtype": model_dtype}))
    if meta:  # the activation scheme travels as metadata (what reading a W8A8 checkpoint gives)
        qf.write(dst / "model.safetensors", Contents(tensors, {ACTIVATIONS_KEY: json.dumps(meta)}),
                 "compressed-tensors")
    else:
        qcore.save(src / "model.safetensors", tensors)
        assert main(["convert", str(src / "model.safetensors"), str(dst / "model.safetensors"),
                     "--to", "compressed-tensors"]) == 0
    return dst


# qcore scheme -> (model dtype, activations, the vLLM scheme class every layer gets)
LOADS = {
    "q4f/block32:f16": ("float16", None, "CompressedTensorsWNA16"),  # W4A16 group 32
    "q4f/block128:bf16": ("bfloat16", None, "CompressedTensorsWNA16"),  # W4A16 channel (a row of 128)
    "q8f/block32:f16/packed_u32": ("float16", None, "CompressedTensorsWNA16"),  # W8A16 group 32
    "q8s/block32:f16": ("float16", None, "CompressedTensorsWNA16"),  # int8 weight only: written pack-quantized
    "q4f/block32:f16/zero": ("float16", None, "CompressedTensorsWNA16"),  # asymmetric W4A16, zero points
    "q8f/block128:f32": ("float16", W8A8, "CompressedTensorsW8A8Int8"),  # int-quantized, dynamic per token
    "e4m3/block128:f32": ("float16", None, "CompressedTensorsW8A16Fp8"),  # FP8 per channel, weight only
    "e4m3": ("float16", FP8_DYNAMIC, "CompressedTensorsW8A8Fp8"),  # FP8 per tensor, dynamic activations
    "e4m3/block64x64:f32": ("float16", FP8_DYNAMIC, "CompressedTensorsW8A8Fp8"),  # FP8 2-D blocks
    "mxfp4": ("bfloat16", None, "CompressedTensorsW4A16Mxfp4"),
    "e2m1/block16:ue4m3/tensor:f32:recip/packed_native": ("bfloat16", None, "CompressedTensorsW4A16Fp4"),
}


@pytest.mark.parametrize("scheme", list(LOADS))
def test_every_layer_gets_its_vllm_scheme_and_the_tensors_it_registers(tmp_path, scheme):
    model_dtype, acts, cls = LOADS[scheme]
    folder = export(tmp_path, scheme, model_dtype=model_dtype, acts=acts)
    assert vllm_check(folder, LAYERS_VLLM, SHAPES) == {layer: cls for layer in LAYERS_VLLM}


def test_the_check_names_a_tensor_vllm_would_not_load(tmp_path):
    """The rules can fail: a missing `weight_shape`, a transposed scale and a stray tensor are named."""
    from safetensors.numpy import load_file, save_file
    folder = export(tmp_path, "q4f/block32:f16")
    arrays = load_file(folder / "model.safetensors")
    m = "model.layers.0.mlp.down_proj"
    del arrays[f"{m}.weight_shape"]
    arrays[f"{m}.weight_scale"] = np.ascontiguousarray(arrays[f"{m}.weight_scale"].T)
    arrays[f"{m}.weight_g_idx"] = np.zeros(FFN, np.int32)
    save_file(arrays, folder / "model.safetensors")
    with pytest.raises(AssertionError) as e:
        vllm_check(folder, LAYERS_VLLM, SHAPES)
    assert str(e.value).splitlines() == [
        f"{m}.weight_g_idx: not a parameter of CompressedTensorsWNA16",
        f"{m}.weight_scale: shape [4, 128], CompressedTensorsWNA16 registers [128, 4]",
        f"{m}.weight_shape: missing"]


# qcore scheme -> the exception vLLM raises (docs/formats.md, "vLLM": what it refuses)
REFUSED = {
    "q4f": "NotImplementedError",  # pack-quantized per tensor: WNA16 takes group / channel only
    "e4m3/block32:f32": "NotImplementedError",  # FP8 groups along the row: tensor, channel or block only
    "e4m3/block64x64:f32": "ValueError",  # FP8 2-D blocks weight only: W8A16Fp8 takes channel / tensor
}


@pytest.mark.parametrize("scheme", list(REFUSED))
def test_what_vllm_refuses_is_refused_by_its_rules(tmp_path, scheme):
    got = vllm_check(export(tmp_path, scheme), LAYERS_VLLM, SHAPES)
    assert {v.split(" ")[1] for v in got.values()} == {REFUSED[scheme]}


@pytest.mark.parametrize("scheme", sorted(set(LOADS) | set(REFUSED)))
def test_config_groups_parse_as_compressed_tensors_quantization_args(tmp_path, scheme):
    """vLLM parses each group's `weights` and `input_activations` with compressed-tensors'
    `QuantizationArgs.model_validate` (CT `_quantization_scheme_map_from_config`; vLLM pins
    compressed-tensors 0.13.0, whose QuantizationArgs forbids unknown keys)."""
    ct = need("compressed_tensors.quantization", "compressed-tensors is not installed (vLLM parses config groups with it)")
    model_dtype, acts, _ = LOADS.get(scheme, ("float16", None, None))
    qc = json.loads((export(tmp_path, scheme, model_dtype=model_dtype, acts=acts) / "config.json").read_text())
    for group in qc["quantization_config"]["config_groups"].values():
        weights = ct.QuantizationArgs.model_validate(group["weights"])
        assert (weights.num_bits, weights.strategy) == (group["weights"]["num_bits"], group["weights"]["strategy"])
        if group.get("input_activations"):
            ct.QuantizationArgs.model_validate(group["input_activations"])


def test_wna16_scales_are_the_models_dtype_or_vllm_rounds_them(tmp_path):
    """wNa16 registers `weight_scale` in the model's dtype: f32 scales (or bf16 ones in an f16
    model) are rounded on load, so the export loads but no longer decodes to qcore's values."""
    with pytest.raises(AssertionError, match="weight_scale: F32 copied into a F16 parameter"):
        vllm_check(export(tmp_path, "q4f/block32:f32"), LAYERS_VLLM, SHAPES)


def test_mixed_schemes_keep_fused_shards_in_one_group(tmp_path):
    """A recipe with 8-bit attention and 4-bit MLP: q/k/v share a group, gate/up another."""
    folder = export(tmp_path, "q4f/block32:f16", per_module={n: "q8f/block32:f16/packed_u32" for n in
                                                             ("q_proj", "k_proj", "v_proj", "o_proj")})
    got = vllm_check(folder, LAYERS_VLLM, SHAPES)
    assert set(got.values()) == {"CompressedTensorsWNA16"}
    groups = json.loads((folder / "config.json").read_text())["quantization_config"]["config_groups"]
    assert sorted(len(g["targets"]) for g in groups.values()) == [6, 8]


def test_fused_shards_of_different_schemes_are_what_vllm_cannot_load(tmp_path):
    """vLLM sizes q/k/v (gate/up) by one group's scheme: a recipe that splits them cannot load."""
    folder = export(tmp_path, "q4f/block32:f16", per_module={"k_proj": "q8f/block32:f16/packed_u32"})
    got = vllm_check(folder, LAYERS_VLLM, SHAPES)
    assert got["model.layers.0.self_attn.qkv_proj"].startswith("refused: model.layers.0.self_attn.qkv_proj: its "
                                                               "shards")
    assert got["model.layers.0.self_attn.o_proj"] == "CompressedTensorsWNA16"


def test_a_linear_left_in_float_is_ignored(tmp_path):
    """vLLM's find_matched_target raises for a Linear no group targets: the writer names it in `ignore`."""
    got = vllm_check(export(tmp_path, "q4f/block32:f16", plain=("down_proj",)), LAYERS_VLLM, SHAPES)
    assert got["model.layers.0.mlp.down_proj"] == "unquantized"


def test_the_tools_w8a8_checkpoint_passes_through_qcore_to_vllms_schemes(tmp_path):
    """compressed-tensors' own W8A8 file (tests/data/ctensors_w8a8), read and written by qcore,
    keeps what vLLM dispatches on: per channel and per tensor int8 weights become W8A8Int8, the
    group / asymmetric / 2-D block ones are refused as they were before the round trip."""
    data = os.path.join(DATA, "ctensors_w8a8")
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(os.path.join(data, "config.json"), out / "config.json")
    assert main(["convert", os.path.join(data, "model.safetensors"), str(out / "model.safetensors"),
                 "--to", "compressed-tensors"]) == 0
    before = json.loads(open(os.path.join(data, "config.json")).read())["quantization_config"]
    after = json.loads((out / "config.json").read_text())["quantization_config"]

    def dispatch(qc):
        got = {}
        for g in qc["config_groups"].values():
            for t in g["targets"]:
                try:
                    got[t] = vllm_scheme(g["weights"], g.get("input_activations"), g.get("format") or qc["format"])
                except Refused as e:
                    got[t] = str(e).split(" ")[0]
        return got

    assert dispatch(after) == dispatch(before)
    assert "CompressedTensorsW8A8Int8" in dispatch(after).values()


# --- GGUF: vLLM's GGUF loader on a model folder qcore converted -----------------------------------

# gguf.py `UNQUANTIZED_TYPES | DEQUANT_TYPES`: the types `_fuse_mul_mat` runs at 5a6541db9bfa
# (later versions add MXFP4; docs/formats.md, vLLM)
VLLM_GGUF_TYPES = {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q8_1", "Q2_K", "Q3_K", "Q4_K",
                   "Q5_K", "Q6_K", "IQ1_M", "IQ1_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_XS",
                   "IQ4_NL"}


@pytest.fixture
def gguf_folder():
    """gguf, and tests/formats/test_formats_gguf_model.py's model folders (a tiny Llama by hand)."""
    gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install 'qcore-quant[formats]')")
    from tests.formats.test_formats_gguf_model import CONFIG, model_folder
    return gguf, CONFIG, model_folder


@pytest.mark.parametrize("scheme", ["q8_0", "q4_0", "q4_1", None, "mxfp4"],
                         ids=["q8_0", "q4_0", "q4_1", "f32", "mxfp4"])
def test_gguf_tensor_types_are_ones_vllm_runs(tmp_path, gguf_folder, scheme):
    gguf, _, model_folder = gguf_folder
    qf.convert(model_folder(tmp_path / "tiny", scheme=scheme), tmp_path / "out.gguf", "gguf")
    types = {t.tensor_type.name for t in gguf.GGUFReader(str(tmp_path / "out.gguf")).tensors}
    assert (types <= VLLM_GGUF_TYPES) == (scheme != "mxfp4"), sorted(types - VLLM_GGUF_TYPES)


@pytest.mark.parametrize("model_type,permuted", [("llama", True), ("mistral", True), ("qwen2", False)])
def test_gguf_config_names_and_rope_layout_are_what_vllm_reads(tmp_path, gguf_folder, model_type, permuted):
    """vLLM takes the HF config from the GGUF through transformers, builds the transformers model
    on the meta device and maps each of its parameter names through gguf's TensorNameMap for the
    config's `model_type` (GGUFModelLoader._get_gguf_weights_map); every parameter must find its
    GGUF tensor, or vLLM leaves it unloaded (lm_head may be absent: vLLM then ties it)."""
    transformers = need("transformers", "transformers reads the GGUF's config for vLLM")
    torch = need("torch", "transformers builds the meta model with torch")
    gguf, CONFIG, model_folder = gguf_folder
    cfg = {**CONFIG, "model_type": model_type, "architectures": [f"{model_type.title()}ForCausalLM"]}
    folder = model_folder(tmp_path / "tiny", cfg, scheme="q8_0", bias=model_type == "qwen2")  # qwen2: q/k/v biases
    qf.convert(folder, tmp_path / "out.gguf", "gguf")
    hf = transformers.AutoConfig.from_pretrained(tmp_path, gguf_file="out.gguf")
    # a mistral folder is llama in GGUF (llama.cpp's converter does the same), so vLLM treats it as llama
    assert hf.model_type == ("qwen2" if model_type == "qwen2" else "llama")
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "max_position_embeddings", "rms_norm_eps"):
        assert getattr(hf, key) == pytest.approx(cfg[key]), key
    # llama.py: a GGUF llama runs GPT-J-style rotary (is_neox_style False), which is what the q/k row
    # permutation of llama.cpp's converter (and qcore's) is for; qwen2 keeps NEOX and unpermuted rows
    assert (hf.model_type == "llama") == permuted
    arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == hf.model_type)  # else RuntimeError
    name_map = gguf.get_tensor_name_map(arch, hf.num_hidden_layers)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    have = {t.name for t in gguf.GGUFReader(str(tmp_path / "out.gguf")).tensors}
    wanted = {}
    for hf_name in model.state_dict():
        base, suffix = hf_name.rsplit(".", 1)
        wanted[f"{name_map.get_name(base)}.{suffix}"] = hf_name
    missing = sorted(hf_name for g, hf_name in wanted.items() if g not in have and hf_name != "lm_head.weight")
    assert not missing
    assert "output.weight" in have   # lm_head present: vLLM keeps tie_word_embeddings as config.json says
    assert have - set(wanted) <= {"rope_freqs.weight"}   # skipped by gguf_quant_weights_iterator


def test_gguf_tokenizer_is_one_transformers_builds_for_vllm(tmp_path, gguf_folder):
    """vLLM's tokenizer for a GGUF file is transformers' conversion of `tokenizer.ggml.*`."""
    transformers = need("transformers", "transformers converts the GGUF tokenizer for vLLM")
    _, _, model_folder = gguf_folder
    qf.convert(model_folder(tmp_path / "tiny", scheme="q8_0"), tmp_path / "out.gguf", "gguf")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="out.gguf")
    assert tok.bos_token == "<|bos|>" and tok("he t")["input_ids"] == [0, 258, 259]
    assert tok.convert_ids_to_tokens([258, 259]) == ["he", "Ġt"]
    # transformers 4.x (vLLM pins < 5) names the bos token as eos for every llama GGUF
    # (`GGUFLlamaConverter`: `eos_token = proto.tokens[proto.bos_token_id]`); 5.x reads eos_token_id
    major = int(transformers.__version__.split(".")[0])
    assert tok.eos_token == ("<|bos|>" if major < 5 else "<|eos|>")


_ = ml_dtypes  # bfloat16 / float8 dtypes registered with numpy for the safetensors files above
