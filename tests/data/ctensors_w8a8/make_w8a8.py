"""Write the compressed-tensors `int-quantized` (W8A8) test checkpoint with compressed-tensors' own code.

    pip install "compressed-tensors==0.20.0" torch   # (CPU torch is enough)
    python tests/data/ctensors_w8a8/make_w8a8.py tests/data/ctensors_w8a8

Writes `model.safetensors` (each module's `weight` int8 and `weight_scale`, plus `weight_zero_point`
for the asymmetric one, as the tool's `IntQuantizationCompressor` stores them; a static activation
scale and an unquantized norm), `config.json` (format `int-quantized`, one config group per
module, each with its `input_activations`: W8A8's dynamic int8 per token from the tool's preset,
a static per-tensor one) and `expected.safetensors` (each module's weight as the tool's
decompressor gives it back). tests/formats/test_formats_ctensors.py reads them with qcore and compares bit
for bit. A 4-bit int-quantized weight is stored one int8 per code, in [-8, 7].
"""
from __future__ import annotations

import json
import os
import sys

import torch
from safetensors.torch import save_file

from compressed_tensors.compressors.naive_quantized.base import IntQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.quant_scheme import INT8_W8A8

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "ctensors"))
from make_ctensors import asym_params  # noqa: E402  (the sibling generator's parameters)

STATIC = dict(num_bits=8, type="int", strategy="tensor", symmetric=True, dynamic=False)
# module -> (weight dtype, weight arguments (None: W8A8's), input activations (None: W8A8's), *shape)
MODULES = {
    "layers.0.q_proj": (torch.bfloat16, None, None, 16, 64),  # the W8A8 preset: int8 channel, dynamic per token
    "layers.0.k_proj": (torch.float16, dict(num_bits=8, type="int", symmetric=True, strategy="group",
                                            group_size=16), None, 8, 64),
    "layers.0.v_proj": (torch.float32, dict(num_bits=8, type="int", symmetric=True, strategy="tensor"), None, 8, 32),
    "layers.0.o_proj": (torch.bfloat16, dict(num_bits=8, type="int", symmetric=False, strategy="channel"),
                        None, 6, 64),  # asymmetric: an int8 zero point per row, not packed
    "layers.0.up_proj": (torch.bfloat16, dict(num_bits=8, type="int", symmetric=True, strategy="block",
                                              block_structure=[8, 16]), None, 16, 64),
    "layers.0.down_proj": (torch.bfloat16, dict(num_bits=4, type="int", symmetric=True, strategy="group",
                                                group_size=32), STATIC, 8, 64),  # int4 codes in int8
    "layers.1.experts.w1": (torch.bfloat16, None, None, 2, 8, 64),  # fused experts [2, 8, 64], int8 channel
}


def qparams(w: torch.Tensor, args: QuantizationArgs) -> dict:
    """The tool's own `calculate_qparams` of each strategy's min and max, in the weight's dtype
    (make_ctensors.py's `asym_params`); a symmetric weight keeps its scale only."""
    params = asym_params(w, args)
    if args.symmetric:
        params.pop("weight_zero_point")
    return params


def main(out: str) -> None:
    torch.manual_seed(0)
    model, expected, groups = {}, {}, {}
    for i, (name, (dtype, wargs, aargs, *shape)) in enumerate(MODULES.items()):
        weights = INT8_W8A8["weights"] if wargs is None else QuantizationArgs(**wargs)
        acts = INT8_W8A8["input_activations"] if aargs is None else QuantizationArgs(**aargs)
        scheme = QuantizationScheme(targets=[name], weights=weights, input_activations=acts)
        w = torch.randn(*shape) * 0.05
        if not weights.symmetric:  # rows shifted so the zero points are not 0
            w = w + torch.linspace(-0.1, 0.1, shape[-2])[:, None]
        w = w.to(dtype)
        sd = IntQuantizationCompressor.compress({"weight": w, **qparams(w, weights)}, scheme)
        assert sd["weight"].dtype == torch.int8, sd["weight"].dtype
        model.update({f"{name}.{k}": v.contiguous() for k, v in sd.items()})
        back = IntQuantizationCompressor.decompress({k: v.clone() for k, v in sd.items()}, scheme)
        expected[f"{name}.weight"] = back["weight"].contiguous()
        groups[f"group_{i}"] = {"targets": [name], "weights": weights.model_dump(mode="json"),
                                "input_activations": acts.model_dump(mode="json"), "output_activations": None}
        if not acts.dynamic:  # a static activation scale, which qcore passes through as an array
            model[f"{name}.input_scale"] = torch.tensor([0.0125], dtype=torch.float32)
    model["norm.weight"] = torch.ones(64, dtype=torch.bfloat16)
    os.makedirs(out, exist_ok=True)
    save_file(model, os.path.join(out, "model.safetensors"))
    save_file(expected, os.path.join(out, "expected.safetensors"))
    config = {"quantization_config": {"quant_method": "compressed-tensors", "format": "int-quantized",
                                      "quantization_status": "compressed", "config_groups": groups,
                                      "ignore": ["lm_head"]}}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


def check(folder: str) -> None:
    """Decompress every module of the qcore-written checkpoint in `folder` with the tool's code,
    its config parsed by the tool, and compare with `expected.safetensors` bit for bit."""
    from safetensors.torch import load_file

    from compressed_tensors.quantization import QuantizationConfig

    with open(os.path.join(folder, "config.json")) as f:
        cfg = QuantizationConfig.model_validate(json.load(f)["quantization_config"])
    sd = load_file(os.path.join(folder, "model.safetensors"))
    want = load_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "expected.safetensors"))
    done = 0
    for group in cfg.config_groups.values():
        assert (group.format or cfg.format) == "int-quantized", group.format
        assert group.input_activations is not None, group
        for mod in group.targets:
            local = {k[len(mod) + 1:]: v for k, v in sd.items() if k.startswith(mod + ".")}
            local.pop("input_scale", None)
            got = IntQuantizationCompressor.decompress(local, group)["weight"]
            exp = want[f"{mod}.weight"]
            assert got.dtype == exp.dtype and torch.equal(got.view(torch.uint8), exp.view(torch.uint8)), mod
            done += 1
    assert done == len(MODULES), (done, len(MODULES))
    print(f"compressed-tensors {cfg.format}: {done} modules decompressed bit for bit")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--check"]:
        check(sys.argv[2])
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__)))
