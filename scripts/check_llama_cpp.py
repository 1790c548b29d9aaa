"""Live check: llama.cpp itself loads the GGUF files `qcore convert DIR out.gguf --to gguf` writes.

For each model of `PRE` (llama, mistral and qwen2 with a byte-level BPE made with `tokenizers`
under Llama 3's, GPT-2's and Qwen2's pre-tokenizer; mistral-spm with a SentencePiece BPE with
byte fallback, tokenizer.model beside its tokenizer.json; llama-hf with that tokenizer.json alone),
a tiny random model made with transformers is saved with `save_pretrained`; then for each preset
(f32 = the float model as it is, q8_0, q4_0, q4_1, mxfp4):

1. `qcore quantize DIR Q --scheme PRESET`, `qcore convert Q out.gguf --to gguf`;
2. `qcore dequantize Q D` and transformers runs the dequantized model on a token sequence (f32);
3. llama-cpp-python loads out.gguf and evaluates the same tokens (`logits_all`); its tokenizer
   must give transformers' token ids for a text.

Tolerance: llama.cpp's CPU matmul of Q8_0/Q4_0/Q4_1/MXFP4 weights quantizes the activations to
8 bits per block of 32 (`vec_dot_type` Q8_0/Q8_1), so its logits differ from the dequantized
model's by that activation rounding; the f32 export has no such step and must agree to float
rounding. Each run reports the max |logit difference| relative to the max |logit| and the argmax
agreement, and fails over `--tol` (default 1e-4 for f32, 5e-2 for quantized presets); for scale,
`weights_rel_diff` is the same measure between the float model and its dequantized weights (both
in transformers), the format's own error.

Needs torch, transformers, tokenizers, sentencepiece and llama-cpp-python (`pip install
llama-cpp-python`, a source build with cmake; not part of CI). Prints one JSON object per run and a summary line.

    python scripts/check_llama_cpp.py [--work DIR] [--arch llama] [--preset q8_0] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

import numpy as np

PRESETS = ("f32", "q8_0", "q4_0", "q4_1", "mxfp4")
TEXT = ["The quick brown fox jumps over the lazy dog. ", "Quantization maps floats to codes and scales. ",
        "llama.cpp loads GGUF files; qcore writes them. ", "Numbers 12345 and 2026, tabs\tand newlines\n"] * 25


def _sentencepiece(folder: str, keep_model: bool) -> None:
    """A SentencePiece BPE with byte fallback trained on TEXT (Llama 2 / Mistral style), saved by
    transformers' LlamaTokenizer (tokenizer.model and tokenizer.json); `keep_model` False removes
    tokenizer.model, leaving the byte-fallback tokenizer.json alone."""
    import io

    import sentencepiece as spm
    from transformers import LlamaTokenizer

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(TEXT), model_writer=buf, model_type="bpe", vocab_size=400,
                                   byte_fallback=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, split_digits=True,
                                   character_coverage=1.0, normalization_rule_name="identity", minloglevel=2)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "tokenizer.model"), "wb") as f:
        f.write(buf.getvalue())
    LlamaTokenizer.from_pretrained(folder).save_pretrained(folder)
    if not keep_model:
        os.remove(os.path.join(folder, "tokenizer.model"))


def _tokenizer(folder: str, pre: str) -> None:
    """A byte-level BPE trained on TEXT whose pre-tokenizer is llama.cpp's `pre` (gpt-2, llama-bpe,
    qwen2), or a SentencePiece one (`spm`: with tokenizer.model; `hf-spm`: its tokenizer.json only)."""
    if pre in ("spm", "hf-spm"):
        return _sentencepiece(folder, pre == "spm")
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from qcore.formats.gguf_model import _LLAMA3_SPLIT, _QWEN2_SPLIT

    tok = Tokenizer(models.BPE())
    if pre == "gpt-2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        split = pre_tokenizers.Split(Regex(_LLAMA3_SPLIT if pre == "llama-bpe" else _QWEN2_SPLIT),
                                     behavior="isolated", invert=False)
        tok.pre_tokenizer = pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                     use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=["<|bos|>", "<|eos|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXT, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>").save_pretrained(folder)


PRE = {"llama": "llama-bpe", "mistral": "gpt-2", "qwen2": "qwen2", "mistral-spm": "spm", "llama-hf": "hf-spm"}
"""The tokenizer each model gets: a byte-level BPE with one of llama.cpp's pre-tokenizers, or
SentencePiece (read by gguf's SentencePieceVocab; `hf-spm`: by LlamaHfVocab from tokenizer.json)."""


def make_model(arch: str, folder: str, seed: int = 0) -> None:
    """A tiny random `arch` model (2 layers, hidden 128, GQA 4/2 heads) and its tokenizer in `folder`."""
    import torch
    import transformers as tf

    common = dict(vocab_size=400, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                  bos_token_id=0, eos_token_id=1, tie_word_embeddings=False, initializer_range=0.08)
    config, model = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM), "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
                     "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM)}[arch.split("-")[0]]
    torch.manual_seed(seed)
    m = model(config(**common)).eval()
    with torch.no_grad():   # non-trivial norms and biases, so a misplaced one shows
        for name, p in m.named_parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    m.save_pretrained(folder)
    _tokenizer(folder, PRE[arch])


def _cli(*args: str) -> None:
    from qcore.cli.main import main

    rc = main(list(args))
    if rc not in (0, None):
        raise SystemExit(f"qcore {' '.join(args)} exited {rc}")


def reference_logits(arch: str, folder: str, weights: str, tokens: list[int]) -> np.ndarray:
    """transformers' f32 logits of the model in `folder` with the tensors of `weights` (safetensors)."""
    import torch
    import transformers as tf
    from safetensors.numpy import load_file

    m = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    state = {k: torch.from_numpy(np.asarray(v, np.float32)) for k, v in load_file(weights).items()}
    missing, unexpected = m.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if "rotary" not in k]:
        raise SystemExit(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        return m(torch.tensor([tokens])).logits[0].numpy().astype(np.float64)


def llama_cpp_logits(path: str, tokens: list[int], text: str) -> tuple[np.ndarray, list[int]]:
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=128, n_batch=128, logits_all=True, n_threads=1, verbose=False, seed=0,
                type_k=0, type_v=0)   # an f32 KV cache (GGML_TYPE_F32; the default f16 one rounds k and v)
    llm.eval(tokens)
    logits = np.array(llm.scores[: len(tokens)], dtype=np.float64)
    ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
    return logits, ids


def run(arch: str, preset: str, work: str, tol: float | None) -> dict[str, Any]:
    from transformers import AutoTokenizer

    src = os.path.join(work, arch)
    if not os.path.isdir(src):
        make_model(arch, src)
    text = "The lazy dog maps 2026 floats to codes; qcore writes them.\n"
    tok = AutoTokenizer.from_pretrained(src)
    hf_ids = tok.encode(text, add_special_tokens=False)
    tokens = [tok.bos_token_id or 0, *hf_ids]
    out = os.path.join(work, f"{arch}-{preset}.gguf")
    if preset == "f32":
        _cli("convert", src, out, "--to", "gguf")
        weights = os.path.join(src, "model.safetensors")
    else:
        q, d = os.path.join(work, f"{arch}-{preset}"), os.path.join(work, f"{arch}-{preset}-deq")
        for p in (q, d):
            if os.path.exists(p):
                import shutil
                shutil.rmtree(p)
        _cli("quantize", src, q, "--scheme", preset, "--no-stats")
        _cli("convert", q, out, "--to", "gguf")
        _cli("dequantize", q, d, "--dtype", "float32")
        weights = os.path.join(d, "model.safetensors")
    ref = reference_logits(arch, src, weights, tokens)
    got, cpp_ids = llama_cpp_logits(out, tokens, text)
    scale = float(np.max(np.abs(ref)))
    rel = float(np.max(np.abs(got - ref))) / scale
    # the format's own effect, for scale: the float model against its dequantized weights
    float_ref = reference_logits(arch, src, os.path.join(src, "model.safetensors"), tokens)
    weight_rel = float(np.max(np.abs(float_ref - ref))) / scale
    limit = tol if tol is not None else (1e-4 if preset == "f32" else 5e-2)
    row = {"arch": arch, "preset": preset, "pre": PRE[arch], "tokens": len(tokens), "max_abs_logit": scale, "max_rel_diff": rel,
           "weights_rel_diff": weight_rel,
           "argmax_agree": float(np.mean(np.argmax(got, 1) == np.argmax(ref, 1))), "tol": limit,
           "tokenizer_agrees": cpp_ids == hf_ids, "ok": rel <= limit and cpp_ids == hf_ids}
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", help="working folder (default: a temporary one)")
    ap.add_argument("--arch", action="append", choices=tuple(PRE),
                    help="model and tokenizer (default: all; mistral-spm needs sentencepiece)")
    ap.add_argument("--preset", action="append", choices=PRESETS)
    ap.add_argument("--tol", type=float, help="max |logit diff| / max |logit| (default 1e-4 f32, 5e-2 quantized)")
    ap.add_argument("--json", help="write the versions and rows as JSON here (benchmarks/results/llama_cpp.json)")
    a = ap.parse_args(argv)
    import llama_cpp
    import qcore
    import transformers

    versions = {"llama_cpp_python": llama_cpp.__version__, "transformers": transformers.__version__,
                "qcore": qcore.__version__}
    print(json.dumps(versions), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = a.work or tmp
        os.makedirs(work, exist_ok=True)
        rows = [run(arch, preset, work, a.tol) for arch in a.arch or tuple(PRE)
                for preset in a.preset or PRESETS]
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": "python scripts/check_llama_cpp.py", "versions": versions, "rows": rows}, f, indent=1)
    bad = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(bad)} passed, {len(bad)} failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
