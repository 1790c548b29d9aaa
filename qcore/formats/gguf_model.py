"""GGUF that llama.cpp loads: a transformers model folder's config.json and tokenizer as GGUF
key/values, and its tensors under llama.cpp's names.

`GGUFFormat.write` uses this when the checkpoint came from a model folder with a `config.json`
(`Contents.folder`); a single file, or a folder without `config.json`, is written as before
(`general.architecture = qcore`, the checkpoint's own names, no tokenizer).

The facts are llama.cpp's (`convert_hf_to_gguf.py`, `LlamaModel` and `TextModel`, and the gguf
package 0.19 it ships); the code is qcore's, driven by gguf's own tables:

- one `Architecture` row per config.json `model_type` qcore maps (llama, mistral, qwen2); any other
  is refused, naming it;
- the hyper-parameters `TextModel.set_gguf_parameters` and `LlamaModel.set_gguf_parameters` write
  (block count, context, embedding and feed-forward lengths, head counts, rope base, dimensions and
  linear scaling, RMS epsilon, vocabulary size), through `gguf.GGUFWriter`'s own `add_*` methods;
- tensor names through `gguf.TensorNameMap` (`get_type_and_name`, suffixes `.weight` / `.bias`),
  only names whose tensor kind is in `gguf.MODEL_TENSORS[arch]` and not in `MODEL_TENSOR_SKIP`,
  each with the shape llama.cpp's loader expects;
- llama's q/k rows permuted for its rotary layout (`LlamaModel.permute`: rows as
  `[head, 2, half]` -> `[head, half, 2]`). A GGUF quantized row holds whole blocks (blocks of 32
  run along the row), so the permutation moves the bytes of whole rows and is exact;
- 1-D f16/bf16 tensors (norms, biases) stored as F32, as `convert_hf_to_gguf` stores them (exact);
  a quantized 1-D tensor is refused (llama.cpp reads them as floats; a q/k bias's blocks would
  span the permuted rows);
- the tokenizer through gguf's vocab helpers: `tokenizer.model` with sentencepiece installed
  (`SentencePieceVocab`, model `llama`), else `tokenizer.json` with byte fallback
  (`LlamaHfVocab`, model `llama`), else a byte-level BPE `tokenizer.json` (`BpeVocab`, model
  `gpt2`, its pre-tokenizer named from `PRE_TOKENIZERS`), padded to `vocab_size` with `[PAD<i>]`
  tokens of type UNUSED; special token ids, merges and the chat template by `gguf.SpecialVocab`.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import ml_dtypes
import numpy as np

from qcore.errors import InvalidDataError
from qcore.spec.payload import QuantizedData
from qcore.formats.base import Tensor, UnrepresentableError, parse_json, short_repr

__all__ = ["ARCHITECTURES", "Architecture", "HParams", "ModelPlan", "PRE_TOKENIZERS", "Vocabulary", "plan"]

_CONVERT = "convert the model with llama.cpp's convert_hf_to_gguf.py instead"


@dataclass(frozen=True)
class Architecture:
    """A config.json `model_type` and how llama.cpp's converter writes it."""

    model_type: str
    arch: str
    """The `gguf.MODEL_ARCH` member (its text, e.g. `llama`, is `general.architecture`)."""
    permute_qk: bool
    """Whether q/k rows are permuted for llama.cpp's rotary layout (`LlamaModel.undo_permute`)."""


ARCHITECTURES: dict[str, Architecture] = {a.model_type: a for a in (
    Architecture("llama", "LLAMA", True),      # LlamaForCausalLM -> LlamaModel
    Architecture("mistral", "LLAMA", True),    # MistralForCausalLM -> LlamaModel
    Architecture("qwen2", "QWEN2", False),     # Qwen2ForCausalLM -> Qwen2Model (NEOX rope, no permute)
)}

# The byte-level BPE pre-tokenizers llama.cpp implements, by what tokenizer.json says
# (`pre_tokenizer`): `tokenizer.ggml.pre` names one of llama.cpp's built-in regex sets.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS: dict[str, Callable[[Mapping[str, Any]], bool]] = {
    # GPT-2's regex inside ByteLevel itself
    "gpt-2": lambda p: p.get("type") == "ByteLevel" and p.get("use_regex", True) and not p.get("add_prefix_space"),
    "llama-bpe": lambda p: _split_then_bytes(p, _LLAMA3_SPLIT),
    "qwen2": lambda p: _split_then_bytes(p, _QWEN2_SPLIT),
}
"""llama.cpp pre-tokenizer name -> test on tokenizer.json's `pre_tokenizer` object."""


def _split_then_bytes(p: Mapping[str, Any], regex: str) -> bool:
    """A `Sequence` of a `Split` on `regex` (isolated) and a `ByteLevel` without its own regex."""
    seq = p.get("pretokenizers") if p.get("type") == "Sequence" else None
    if not isinstance(seq, list) or len(seq) != 2 or not all(isinstance(s, dict) for s in seq):
        return False
    split, level = seq
    return (split.get("type") == "Split" and split.get("pattern") == {"Regex": regex}
            and split.get("behavior") == "Isolated" and not split.get("invert")
            and level.get("type") == "ByteLevel" and not level.get("use_regex", True)
            and not level.get("add_prefix_space"))


@dataclass(frozen=True)
class HParams:
    """The hyper-parameters llama.cpp's llama/qwen2 loaders read, from config.json (named after
    their GGUF keys)."""

    block_count: int
    context_length: int
    embedding_length: int
    feed_forward_length: int
    head_count: int
    head_count_kv: int
    head_dim: int
    vocab_size: int
    rms_eps: float
    rope_theta: float | None
    rope_linear_factor: float | None
    """Linear rope scaling's factor, or None."""
    llama3_rope: Mapping[str, Any] | None
    """config.json's llama3 rope scaling object, or None."""


@dataclass(frozen=True)
class Vocabulary:
    """The tokenizer as GGUF holds it (`tokenizer.ggml.*`)."""

    model: str
    pre: str | None
    tokens: list[str | bytes]
    scores: list[float] | None
    types: list[int]
    special: Any
    """A `gguf.SpecialVocab` (special token ids, add_bos/eos flags, merges, chat template)."""


@dataclass
class ModelPlan:
    """What a model folder adds to a GGUF file: its key/values, names and row orders."""

    architecture: Architecture
    arch_name: str
    """`general.architecture`, e.g. `llama`."""
    name: str
    hparams: HParams
    vocab: Vocabulary
    names: dict[str, str] = field(default_factory=dict)
    """Checkpoint tensor name -> llama.cpp's name."""
    row_orders: dict[str, np.ndarray] = field(default_factory=dict)
    """Checkpoint tensor name -> its new row order (q/k of llama)."""
    extra: dict[str, np.ndarray] = field(default_factory=dict)
    """Tensors llama.cpp reads that the checkpoint lacks (llama3 `rope_freqs.weight`)."""

    def add_keys(self, w: Any, gguf: Any) -> None:
        """Write the model's key/values with `gguf.GGUFWriter` `w`'s own methods."""
        h = self.hparams
        w.add_name(self.name)
        w.add_block_count(h.block_count)
        w.add_context_length(h.context_length)
        w.add_embedding_length(h.embedding_length)
        w.add_feed_forward_length(h.feed_forward_length)
        w.add_head_count(h.head_count)
        w.add_head_count_kv(h.head_count_kv)
        if h.rope_theta is not None:
            w.add_rope_freq_base(h.rope_theta)
        w.add_layer_norm_rms_eps(h.rms_eps)
        w.add_vocab_size(h.vocab_size)
        w.add_rope_dimension_count(h.head_dim)
        if h.head_dim != h.embedding_length // h.head_count:
            w.add_key_length(h.head_dim)
            w.add_value_length(h.head_dim)
        if h.rope_linear_factor is not None:
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(h.rope_linear_factor)
        v = self.vocab
        w.add_tokenizer_model(v.model)
        if v.pre is not None:
            w.add_tokenizer_pre(v.pre)
        w.add_token_list(v.tokens)
        if v.scores is not None:
            w.add_token_scores(v.scores)
        w.add_token_types(v.types)
        v.special.add_to_gguf(w, quiet=True)

    def store(self, name: str, value: Tensor) -> Tensor:
        """The tensor as llama.cpp stores it: 1-D f16/bf16 as f32 (exact), others unchanged."""
        if isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype in (np.float16, ml_dtypes.bfloat16):
            return value.astype(np.float32)
        return value

    def reorder(self, name: str, data: np.ndarray) -> np.ndarray:
        """The GGUF data of tensor `name` (rows first) with its rows in llama.cpp's order."""
        order = self.row_orders.get(name)
        return data if order is None else np.ascontiguousarray(data[order])


def _refuse(folder: str, why: str) -> UnrepresentableError:
    return UnrepresentableError(f"{folder}: {why}; {_CONVERT}, or convert the weights file alone "
                                "(a GGUF without the model's key/values)")


def _int(cfg: Mapping[str, Any], key: str, where: str, required: bool = True) -> int | None:
    """config.json's positive integer `key`; None when it is absent and not `required`."""
    v = cfg.get(key)
    if v is None and required:
        raise InvalidDataError(f"{where}: '{key}' is missing; llama.cpp needs it")
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
        raise InvalidDataError(f"{where}: '{key}' must be a positive integer, got {short_repr(v)}")
    return v


def _hparams(cfg: Mapping[str, Any], where: str, folder: str) -> HParams:
    """The hyper-parameters llama.cpp's llama/qwen2 loaders read, from config.json."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise _refuse(folder, f"hidden_act {short_repr(cfg.get('hidden_act'))} is not SiLU, which llama.cpp's "
                              "llama and qwen2 graphs use")
    n_head = _int(cfg, "num_attention_heads", where)
    n_embd = _int(cfg, "hidden_size", where)
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise InvalidDataError(f"{where}: 'rope_scaling' must be an object, got {short_repr(rope)}")
    theta = cfg.get("rope_theta", rope.get("rope_theta"))
    if theta is not None and (isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0):
        raise InvalidDataError(f"{where}: 'rope_theta' must be a positive number, got {short_repr(theta)}")
    eps = cfg.get("rms_norm_eps")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
        raise InvalidDataError(f"{where}: 'rms_norm_eps' must be a number in (0, 1), got {short_repr(eps)}")
    rope_type = rope.get("rope_type", rope.get("type")) or "default"
    if rope_type not in ("default", "linear", "llama3"):
        raise _refuse(folder, f"rope scaling {short_repr(rope_type)} is not mapped (qcore maps default, linear "
                              "and llama3)")
    factor = rope.get("factor")
    if rope_type == "linear" and (isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0):
        raise InvalidDataError(f"{where}: linear rope scaling needs a positive 'factor', got {short_repr(factor)}")
    head_dim = _int(cfg, "head_dim", where, required=False) or n_embd // n_head
    if head_dim % 2:
        raise InvalidDataError(f"{where}: the head dimension {head_dim} is odd; rotary embeddings pair its elements")
    return HParams(
        block_count=_int(cfg, "num_hidden_layers", where), context_length=_int(cfg, "max_position_embeddings", where),
        embedding_length=n_embd, feed_forward_length=_int(cfg, "intermediate_size", where), head_count=n_head,
        head_count_kv=_int(cfg, "num_key_value_heads", where, required=False) or n_head, head_dim=head_dim,
        vocab_size=_int(cfg, "vocab_size", where), rms_eps=float(eps), rope_theta=theta,
        rope_linear_factor=float(factor) if rope_type == "linear" else None,
        llama3_rope=rope if rope_type == "llama3" else None)


def _llama3_rope_freqs(h: HParams) -> np.ndarray:
    """llama3 rope scaling's per-frequency factors (`LlamaModel.generate_extra_tensors`)."""
    rope, dim = h.llama3_rope or {}, h.head_dim
    base = h.rope_theta if h.rope_theta is not None else 10000.0
    freqs = (1.0 / (np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))).astype(np.float32)
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def _has_sentencepiece() -> bool:
    try:
        import sentencepiece  # noqa: F401
    except ImportError:
        return False
    return True


def _vocabulary(folder: str, n_vocab: int, gguf: Any) -> Vocabulary:
    """The tokenizer of `folder` through gguf's vocab helpers, in convert_hf_to_gguf's order."""
    path = Path(folder)
    tj_path = path / "tokenizer.json"
    tj = parse_json(tj_path.read_bytes(), str(tj_path)) if tj_path.is_file() else None
    model_json = tj.get("model") if isinstance(tj, dict) else None
    pre = None
    if (path / "tokenizer.model").is_file() and (_has_sentencepiece() or tj is None):
        if not _has_sentencepiece():
            raise _refuse(folder, "its tokenizer.model needs the sentencepiece package (pip install sentencepiece)")
        vocab, model, pre = gguf.SentencePieceVocab(path), "llama", "default"
    elif isinstance(model_json, dict) and model_json.get("type") == "BPE" and model_json.get("byte_fallback"):
        vocab, model = gguf.LlamaHfVocab(path), "llama"       # Llama 2 / Mistral fast tokenizers
    elif isinstance(model_json, dict) and model_json.get("type") == "BPE":
        try:
            vocab, model = gguf.BpeVocab(path), "gpt2"
        except FileNotFoundError:
            raise _refuse(folder, "tokenizer.json is a BPE without byte fallback whose decoder is not ByteLevel, "
                                  "which no llama.cpp tokenizer reads") from None
        pt = tj.get("pre_tokenizer") if isinstance(tj.get("pre_tokenizer"), dict) else {}
        pre = next((name for name, test in PRE_TOKENIZERS.items() if test(pt)), None)
        if pre is None:
            raise _refuse(folder, f"tokenizer.json's pre-tokenizer ({short_repr(pt.get('type'))}) is not one qcore "
                                  f"names for llama.cpp ({', '.join(PRE_TOKENIZERS)})")
    elif tj is not None:
        raise _refuse(folder, f"tokenizer.json's model {short_repr(model_json and model_json.get('type'))} is not "
                              "a BPE, which qcore maps (SentencePiece needs tokenizer.model)")
    else:
        raise _refuse(folder, "it has no tokenizer.json or tokenizer.model; llama.cpp needs the tokenizer")
    tokens: list[str | bytes] = []
    scores: list[float] = []
    types: list[int] = []
    for text, score, kind in vocab.all_tokens():
        tokens.append(text)
        scores.append(float(score))
        types.append(int(kind))
    if model == "gpt2":  # convert_hf_to_gguf's get_vocab_base: added tokens CONTROL if special, else USER_DEFINED
        for added in tj.get("added_tokens") or []:
            if isinstance(added, dict) and isinstance(added.get("id"), int) and 0 <= added["id"] < len(types):
                kind = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
                types[added["id"]] = int(kind)
    if len(tokens) > n_vocab:
        raise InvalidDataError(f"{folder}: the tokenizer has {len(tokens)} tokens, more than config.json's "
                               f"vocab_size {n_vocab}, the rows of the embedding llama.cpp reads")
    for i in range(len(tokens), n_vocab):   # convert_hf_to_gguf pads the same way
        tokens.append(f"[PAD{i}]")
        scores.append(-1000.0)
        types.append(int(gguf.TokenType.UNUSED))
    special = gguf.SpecialVocab(path, load_merges=model == "gpt2", n_vocab=n_vocab)
    if model == "gpt2" and not special.merges:
        raise InvalidDataError(f"{tj_path}: a BPE tokenizer without merges; llama.cpp's gpt2 tokenizer needs them")
    return Vocabulary(model, pre, tokens, scores if model == "llama" else None, types, special)


def _expected_shapes(h: HParams, gguf: Any) -> dict[Any, tuple[int, ...]]:
    """The weight shape (numpy order, [out, in]) llama.cpp's loader checks, by tensor kind."""
    M = gguf.MODEL_TENSOR
    d, ff, v = h.embedding_length, h.feed_forward_length, h.vocab_size
    q, kv = h.head_count * h.head_dim, h.head_count_kv * h.head_dim
    return {M.TOKEN_EMBD: (v, d), M.OUTPUT: (v, d), M.OUTPUT_NORM: (d,), M.ATTN_NORM: (d,), M.ATTN_Q: (q, d),
            M.ATTN_K: (kv, d), M.ATTN_V: (kv, d), M.ATTN_OUT: (d, q), M.FFN_NORM: (d,), M.FFN_GATE: (ff, d),
            M.FFN_UP: (ff, d), M.FFN_DOWN: (d, ff)}


_REQUIRED_GLOBAL = ("TOKEN_EMBD", "OUTPUT_NORM")
_REQUIRED_BLOCK = ("ATTN_NORM", "ATTN_Q", "ATTN_K", "ATTN_V", "ATTN_OUT", "FFN_NORM", "FFN_GATE", "FFN_UP", "FFN_DOWN")


def _rotary_order(rows: int, n_head: int) -> np.ndarray:
    """`LlamaModel.permute`'s row order: rows as [head, 2, half] read as [head, half, 2]."""
    return np.arange(rows).reshape(n_head, 2, rows // n_head // 2).swapaxes(1, 2).reshape(-1)


def plan(folder: str, tensors: Mapping[str, Tensor], gguf: Any) -> ModelPlan | None:
    """What `folder`'s config.json and tokenizer make of `tensors` in GGUF, or None when the folder
    has no config.json. Everything is checked here, before a byte is written."""
    cfg_path = os.path.join(folder, "config.json")
    if not os.path.isfile(cfg_path):
        return None
    with open(cfg_path, "rb") as f:
        cfg = parse_json(f.read(), cfg_path)
    if not isinstance(cfg, dict):
        raise InvalidDataError(f"{cfg_path} must be a JSON object, got {short_repr(cfg)}")
    model_type = cfg.get("model_type")
    row = ARCHITECTURES.get(model_type) if isinstance(model_type, str) else None
    if row is None:
        raise _refuse(folder, f"config.json's model_type {short_repr(model_type)} has no llama.cpp mapping in qcore "
                              f"(it maps {', '.join(ARCHITECTURES)})")
    h = _hparams(cfg, cfg_path, folder)
    arch = gguf.MODEL_ARCH[row.arch]
    M = gguf.MODEL_TENSOR
    tmap = gguf.get_tensor_name_map(arch, h.block_count)
    allowed = set(gguf.MODEL_TENSORS[arch]) - set(gguf.MODEL_TENSOR_SKIP.get(arch, ()))
    shapes = _expected_shapes(h, gguf)
    out = ModelPlan(row, gguf.MODEL_ARCH_NAMES[arch], os.path.basename(os.path.abspath(folder)), h,
                    _vocabulary(folder, h.vocab_size, gguf))
    seen: dict[str, str] = {}
    for name, value in tensors.items():
        found = tmap.get_type_and_name(name, try_suffixes=(".weight", ".bias"))
        if found is None or found[0] not in allowed:
            raise _refuse(folder, f"tensor '{name}' has no {out.arch_name} name in llama.cpp (gguf's TensorNameMap)")
        kind, new = found
        if new in seen:
            raise InvalidDataError(f"{folder}: tensors '{seen[new]}' and '{name}' both map to llama.cpp's '{new}'")
        seen[new] = name
        want = shapes.get(kind)
        if want is not None and new.endswith(".bias"):
            want = want[:1]
        if want is not None and tuple(value.shape) != want:
            raise InvalidDataError(f"{folder}: tensor '{name}' has shape {list(value.shape)}, but config.json "
                                   f"makes llama.cpp's '{new}' {list(want)}")
        if isinstance(value, QuantizedData) and len(value.shape) == 1:
            raise UnrepresentableError(
                f"tensor '{name}' is a quantized 1-D tensor; llama.cpp reads norms and biases as F32 (and a q/k "
                "bias's blocks span the rows its rotary permutation moves); keep them unquantized (quantize "
                "without --include-1d)")
        out.names[name] = new
        if row.permute_qk and kind in (M.ATTN_Q, M.ATTN_K):
            heads = h.head_count if kind == M.ATTN_Q else h.head_count_kv
            out.row_orders[name] = _rotary_order(value.shape[0], heads)
    missing = [gguf.TENSOR_NAMES[M[k]] + ".weight" for k in _REQUIRED_GLOBAL]
    missing += [gguf.TENSOR_NAMES[M[k]].format(bid=b) + ".weight" for b in range(h.block_count) for k in _REQUIRED_BLOCK]
    missing = [m for m in missing if m not in seen]
    if missing:
        raise InvalidDataError(f"{folder}: llama.cpp needs tensor {missing[0]} (and {len(missing) - 1} more missing), "
                               "which no tensor of the checkpoint maps to")
    if h.llama3_rope is not None:
        out.extra[gguf.TENSOR_NAMES[M.ROPE_FREQS] + ".weight"] = _llama3_rope_freqs(h)
    return out

