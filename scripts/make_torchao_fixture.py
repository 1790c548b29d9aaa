"""Write tests/data/torchao_nvfp4*.safetensors with torchao's own code (needs torch and torchao).

    pip install torch torchao safetensors   # ran with torch 2.14.1, torchao 0.18.0, on the CPU
    python scripts/make_torchao_fixture.py

torchao_nvfp4.safetensors: a state dict of `NVFP4Tensor` weights (torchao.prototype.mx_formats),
flattened by torchao's `flatten_tensor_state_dict` and saved with safetensors, as torchao saves
quantized checkpoints: `<module>._weight_qdata`, `._weight_scale`, `._weight_per_tensor_scale`
and per-tensor JSON in the metadata. Weights: two-level bf16 (with a static activation scale),
one-level f32 (no per-tensor scale), swizzled block scales (rows not a multiple of 128), a 3-D weight with one per-tensor
scale, and a plain bias. torchao_nvfp4.ref.safetensors: `NVFP4Tensor.dequantize()` of each weight
(in its original dtype), what qcore's decode must reproduce bit for bit.
torchao_nvfp4_experts.safetensors: a 3-D weight with a scale per expert, which qcore refuses.

    python scripts/make_torchao_fixture.py --check FILE OUT

checks the other direction with torchao's code: FILE is a checkpoint qcore wrote (`qcore convert
... --to torchao`); torchao's `unflatten_tensor_state_dict` rebuilds its NVFP4Tensors and OUT
(safetensors) gets their `dequantize()`, which must equal qcore's decode bit for bit.
"""
import os
import sys

import torch
import torchao
from safetensors import safe_open
from safetensors.torch import save_file
from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale
from torchao.prototype.safetensors.safetensors_support import (
    flatten_tensor_state_dict,
    unflatten_tensor_state_dict,
)

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "data")


def nvfp4(shape, dtype, two_level=True, swizzled=False, per_expert=False, act_scale=None):
    w = (torch.randn(*shape) * torch.rand(*shape[:-1], 1) * 0.2).to(dtype)
    scale = None
    if two_level:
        if per_expert:
            scale = per_tensor_amax_to_scale(w.float().abs().amax(dim=(-2, -1), keepdim=True))
        else:
            scale = per_tensor_amax_to_scale(w.float().abs().amax())
    return NVFP4Tensor.to_nvfp4(w, per_tensor_scale=scale, is_swizzled_scales=swizzled, act_per_tensor_scale=act_scale)


def save(tensors, name):
    data, meta = flatten_tensor_state_dict(tensors)
    save_file(data, os.path.join(OUT, name), metadata=meta)


def main() -> None:
    torch.manual_seed(0)
    weights = {
        "layers.0.proj.weight": nvfp4((32, 64), torch.bfloat16, act_scale=torch.tensor(0.0125)),
        "layers.1.proj.weight": nvfp4((16, 128), torch.float32, two_level=False),
        "layers.2.proj.weight": nvfp4((130, 48), torch.bfloat16, swizzled=True),
        "layers.3.experts.weight": nvfp4((2, 16, 32), torch.bfloat16),
    }
    save({**weights, "layers.0.proj.bias": torch.zeros(32, dtype=torch.bfloat16)}, "torchao_nvfp4.safetensors")
    save_file({k: v.dequantize().contiguous() for k, v in weights.items()},
              os.path.join(OUT, "torchao_nvfp4.ref.safetensors"))
    save({"moe.experts.weight": nvfp4((2, 16, 32), torch.bfloat16, per_expert=True)},
         "torchao_nvfp4_experts.safetensors")
    print(f"wrote {len(weights)} NVFP4 weights; torchao {torchao.__version__}, torch {torch.__version__}")


def check(path: str, out: str) -> None:
    with safe_open(path, "pt") as f:
        data = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    tensors, _ = unflatten_tensor_state_dict(data, meta)
    decoded = {k: v.dequantize().contiguous() for k, v in tensors.items() if isinstance(v, NVFP4Tensor)}
    save_file(decoded, out)
    print(f"decoded {len(decoded)} NVFP4 weights with torchao {torchao.__version__}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--check"]:
        check(sys.argv[2], sys.argv[3])
    else:
        main()
