"""Live check: transformers' own compressed-tensors loader loads the folder `qcore quantize --format
compressed-tensors` writes in one step, and runs it like qcore's dequantized model.

1. A tiny random Llama (transformers' LlamaConfig: 2 layers, hidden 256) is saved with
   `save_pretrained`, with the word-level tokenizer of tests/data/tiny_llama.
2. `quantize_model(..., format="compressed-tensors")` with a mixed recipe (attention
   `q8s/block32:f16`, MLP and lm_head `q4s/block32:f16`), shards of at most 1MB; the same recipe
   in qcore's format, then `dequantize_model` (float32).
3. transformers loads both (`AutoModelForCausalLM.from_pretrained`; the export through
   compressed-tensors, which decompresses on a CPU); every linear weight of the export must equal
   qcore's decode (float32), and the logits on a tokenized text must agree within `--tol`
   (relative to the max |logit|).

Needs torch, transformers and compressed-tensors (not part of CI). Prints one JSON object.

    PYTHONPATH=. python scripts/check_transformers_ctensors.py [--work DIR] [--tol 1e-2]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
TOKENIZER = os.path.join(HERE, "..", "tests", "data", "tiny_llama")
RECIPE = dict(recipe="q4s/block32:f16", rules=["*self_attn*=q8s/block32:f16"])
TEXT = "the model weights are quantized to codes and scales . hello world , qcore runs fast on the cpu"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default=None, help="folder for the models (default: a temporary one)")
    p.add_argument("--tol", type=float, default=1e-2, help="max |logit difference| / max |logit| (default 1e-2)")
    args = p.parse_args(argv)

    import compressed_tensors
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    import qcore

    work = args.work or tempfile.mkdtemp(prefix="qcore-ct-")
    src, ct, q, d = (os.path.join(work, n) for n in ("float", "ct", "q", "deq"))
    for path in (ct, q, d):
        shutil.rmtree(path, ignore_errors=True)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(src)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(TOKENIZER, f), src)

    qcore.quantize_model(src, ct, backend="reference", format="compressed-tensors", max_shard_size="1MB", **RECIPE)
    qcore.quantize_model(src, q, backend="reference", **RECIPE)
    qcore.dequantize_model(q, d, backend="reference")

    ids = AutoTokenizer.from_pretrained(src)(TEXT, return_tensors="pt")["input_ids"]
    exported = AutoModelForCausalLM.from_pretrained(ct, dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        a = exported(ids).logits.float().numpy()
        b = reference(ids).logits.float().numpy()

    # every quantized weight as the tool decompressed it, against qcore's decode (float32)
    ref_sd = {k: v.float().numpy() for k, v in reference.state_dict().items()}
    exp_sd = {k: v.float().numpy() for k, v in exported.state_dict().items() if k in ref_sd}
    linear = [k for k in ref_sd if k.endswith("_proj.weight") or k == "lm_head.weight"]
    weights_exact = all(np.array_equal(exp_sd[k], ref_sd[k]) for k in linear)
    rel = float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
    out = {"torch": torch.__version__, "transformers": transformers.__version__,
           "compressed_tensors": compressed_tensors.__version__, "qcore": qcore.__version__,
           "shards": len([f for f in os.listdir(ct) if f.endswith(".safetensors")]),
           "quantization_format": json.load(open(os.path.join(ct, "config.json")))["quantization_config"]["format"],
           "linear_weights": len(linear), "weights_equal_qcore_decode": weights_exact,
           "logits_rel_diff": rel, "argmax_agree": float(np.mean(a.argmax(-1) == b.argmax(-1))), "tol": args.tol}
    print(json.dumps(out))
    return 0 if weights_exact and rel <= args.tol else 1


if __name__ == "__main__":
    sys.exit(main())
