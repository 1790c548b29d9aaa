"""Write tests/data/gptoss_mxfp4*.safetensors with transformers' own MXFP4 decode (needs torch, transformers).

    pip install torch transformers safetensors   # ran with torch 2.13.0+cpu, transformers 5.24.0, on CPU
    python scripts/make_gptoss_fixture.py

gptoss_mxfp4.safetensors: experts' weights as gpt-oss checkpoints store them in transformers'
spelling (`*_blocks` uint8 [E, R, G, 16], `*_scales` uint8 [E, R, G]). gptoss_mxfp4.ref.safetensors:
what `transformers.integrations.mxfp4.convert_moe_packed_tensors` returns for each (bf16, axes 1 and
2 swapped, as transformers hands them to the model). `gate_up_proj` has scale bytes 0, 1 and 254 in
some blocks: the torch decode gives byte 0 SPEC's 2^-127, which qcore reads with zero_scale=spec.
"""
import os

import torch
import transformers
from safetensors.torch import save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "data")
PREFIX = "model.layers.0.mlp.experts."


def main() -> None:
    g = torch.Generator().manual_seed(0)
    tensors, ref = {}, {}
    for name, (e, r, groups) in {"down_proj": (2, 3, 2), "gate_up_proj": (2, 4, 3)}.items():
        blocks = torch.randint(0, 256, (e, r, groups, 16), dtype=torch.uint8, generator=g)
        scales = torch.randint(112, 136, (e, r, groups), dtype=torch.uint8, generator=g)
        if name == "gate_up_proj":
            scales[0, 0, :3] = torch.tensor([0, 1, 254], dtype=torch.uint8)
        tensors[f"{PREFIX}{name}_blocks"], tensors[f"{PREFIX}{name}_scales"] = blocks, scales
        ref[PREFIX + name] = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=torch.bfloat16)
    save_file(tensors, os.path.join(OUT, "gptoss_mxfp4.safetensors"), metadata={"format": "pt"})
    save_file(ref, os.path.join(OUT, "gptoss_mxfp4.ref.safetensors"))
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")


if __name__ == "__main__":
    main()
