"""Write the DeepSeek/Qwen-style FP8 test checkpoint with transformers' own FP8 code.

    pip install "transformers==5.25.0" torch   # (CPU torch is enough)
    python tests/data/fp8/make_fp8.py tests/data/fp8

Writes `model.safetensors` (float8_e4m3fn weights, each with its f32 `X_scale_inv` as transformers'
`Fp8Quantize` makes them: 128 x 128 blocks, a weight smaller than one block, per-channel scales
`[m, 1]` (and `[e, m, 1]` of a fused-expert weight), a per-tensor scale of shape `[]`, float8_e8m0fnu scales (`scale_fmt: ue8m0`, 32 x 64
blocks that the grid gives), and
128 x 128 blocks of a `[136, 40]` weight whose grid `[2, 1]` ends in partial blocks, as
DeepSeek-V3's checkpoints have them where a dim is not a multiple of 128; plus an activation scale and a bf16 norm), `config.json`
(`quant_method: fp8`, `weight_block_size: [128, 128]`) and `expected.safetensors`: each weight
as transformers' `Fp8Dequantize` gives it back (f32, and bf16 for the k_proj as `*.bf16`).
`Fp8Dequantize` takes grids that divide the weight only, so the `[136, 40]` weight's expected
values are DeepSeek-V3's `weight_dequant` (`inference/kernel.py`: per 128 x 128 tile,
`x.to(float32) * s`, masked at the edges), spelled in torch here because its triton kernel needs
a GPU. tests/formats/test_formats_fp8.py reads them with qcore and compares bit for bit.
"""
from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import torch
from safetensors.torch import save_file
from transformers.integrations.finegrained_fp8 import Fp8Dequantize, Fp8Quantize

BLOCK = [128, 128]
# name -> (shape, block size Fp8Quantize uses (None: the config's), dtype of the source weight)
WEIGHTS = {
    "model.layers.0.self_attn.q_proj.weight": ((128, 256), None, torch.bfloat16),  # two 128 x 128 blocks
    "model.layers.0.self_attn.k_proj.weight": ((64, 64), (64, 64), torch.bfloat16),  # smaller than one block
    "model.layers.0.self_attn.o_proj.weight": ((64, 96), (1, 96), torch.bfloat16),  # per channel: [64, 1]
    "model.layers.0.mlp.experts.gate_up_proj": ((2, 16, 96), (1, 96), torch.bfloat16),  # fused experts, per channel
    "model.layers.0.self_attn.v_proj.weight": ((32, 64), "tensor", torch.float32),  # one scale of shape []
    "model.layers.0.mlp.down_proj.weight": ((136, 40), "partial", torch.bfloat16),  # DeepSeek's ceil grid [2, 1]
    "model.layers.0.mlp.up_proj.weight": ((64, 128), "ue8m0", torch.bfloat16),  # E8M0 scales, 32 x 64 blocks
}


def quantize(w: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' `Fp8Quantize` of `w` with `block` ([bm, bn]); for "partial", the weight padded
    with zeros to whole 128 x 128 tiles, quantized, and cut back (the scales keep the ceil grid)."""
    if block == "partial":
        m, n = w.shape
        pm, pn = -(-m // BLOCK[0]) * BLOCK[0], -(-n // BLOCK[1]) * BLOCK[1]
        padded = torch.zeros(pm, pn, dtype=w.dtype)
        padded[:m, :n] = w
        q, s = quantize(padded, BLOCK)
        return q[:m, :n].contiguous(), s
    if block == "tensor":
        q, s = quantize(w, tuple(w.shape))
        return q, s.reshape(())
    fmt = "ue8m0" if block == "ue8m0" else None  # transformers' scale_fmt: power-of-two float8_e8m0fnu scales
    cfg = SimpleNamespace(weight_block_size=[32, 64] if fmt else list(block or BLOCK), scale_fmt=fmt)
    out = Fp8Quantize(SimpleNamespace(quantization_config=cfg))._quantize_one("x.weight", w)
    return out["x.weight"], out["x.weight_scale_inv"]


def deepseek_weight_dequant(x: torch.Tensor, s: torch.Tensor, block: int = 128) -> torch.Tensor:
    """DeepSeek-V3 `weight_dequant_kernel`: program (i, j) loads the tile rows i*block .. and
    columns j*block .. (masked to the weight), `x.to(float32) * s[i, j]`, stores it."""
    m, n = x.shape
    y = torch.empty(m, n, dtype=torch.float32)
    for i in range(-(-m // block)):
        for j in range(-(-n // block)):
            tile = x[i * block:(i + 1) * block, j * block:(j + 1) * block].to(torch.float32)
            y[i * block:(i + 1) * block, j * block:(j + 1) * block] = tile * s[i, j]
    return y


def main(out: str) -> None:
    torch.manual_seed(0)
    model, expected = {}, {}
    deq = Fp8Dequantize(hf_quantizer=None)
    for name, (shape, block, dtype) in WEIGHTS.items():
        w = (torch.randn(*shape) * 0.05).to(dtype)
        w.view(-1)[:7] = torch.tensor([0.0, -0.0, 1e-9, 3.0, -3.0, 0.02, -0.02], dtype=dtype)  # zeros, a tiny one
        q, s = quantize(w, block)
        scale_key = name + "_scale_inv"
        model[name], model[scale_key] = q, s
        if block == "partial":
            expected[name] = deepseek_weight_dequant(q, s)
        else:
            expected[name] = deq._dequantize_one(q, s, output_dtype=torch.float32)
    name = "model.layers.0.self_attn.k_proj.weight"
    expected[name + ".bf16"] = deq._dequantize_one(model[name], model[name + "_scale_inv"], output_dtype=torch.bfloat16)
    model["model.layers.0.self_attn.q_proj.activation_scale"] = torch.tensor([0.5], dtype=torch.float32)
    model["model.norm.weight"] = torch.ones(64, dtype=torch.bfloat16)
    os.makedirs(out, exist_ok=True)
    save_file(model, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    save_file(expected, os.path.join(out, "expected.safetensors"))
    config = {"model_type": "deepseek_v3",
              "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                      "weight_block_size": BLOCK}}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


def check(folder: str) -> None:
    """Dequantize every weight of WEIGHTS that the qcore-written checkpoint in `folder` holds with
    transformers' `Fp8Dequantize` (DeepSeek's rule for the partial grid) and compare with
    `expected.safetensors`; its config.json must give the same weight_block_size."""
    from safetensors.torch import load_file

    sd = load_file(os.path.join(folder, "model.safetensors"))
    want = load_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "expected.safetensors"))
    with open(os.path.join(folder, "config.json")) as f:
        assert json.load(f)["quantization_config"]["weight_block_size"] == BLOCK
    deq = Fp8Dequantize(hf_quantizer=None)
    names = [n for n in WEIGHTS if n in sd]
    assert names and all(n + "_scale_inv" in sd for n in names), sorted(sd)
    for name in names:
        q, s = sd[name], sd[name + "_scale_inv"]
        partial = WEIGHTS[name][1] == "partial"
        got = deepseek_weight_dequant(q, s) if partial else deq._dequantize_one(q, s, output_dtype=torch.float32)
        assert torch.equal(got.view(torch.int32), want[name].view(torch.int32)), name
    print(f"fp8: {len(names)} weights dequantized bit for bit")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--check"]:
        check(sys.argv[2])
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__)))
