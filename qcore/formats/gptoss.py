"""gpt-oss MXFP4 checkpoints (openai/gpt-oss, transformers' `Mxfp4` integration).

Layout: each quantized weight `W` is two U8 tensors, `W.blocks` `[..., G, 16]` (element 2k in the
low nibble of byte k) and `W.scales` `[..., G]` (value = E2M1(nibble) * 2^(byte - 127)); the
transformers checkpoints spell the pair `W_blocks` / `W_scales`. That is qcore's `mxfp4` payload
for shape `[..., 32 G]` byte for byte (values section, then scales section), so reading and writing
only rename tensors. Other tensors (bf16 attention, norms, biases) pass through unchanged. Writing
also puts `quantization_config: {quant_method: mxfp4, modules_to_not_convert}` into the
`config.json` beside the file (other keys kept), which transformers and vLLM dispatch on.

`modules_to_not_convert` is matched by transformers' `should_convert_module`: a pattern skips a
module when it matches the module's name as a regex from the start up to a module boundary, or
is a suffix of it. A module that holds an mxfp4 weight must match no pattern, even where other
tensors of it are plain (the experts' biases): listed, transformers would leave the experts
unconverted. So the patterns written are the source's own (its config.json's, read into metadata
`gpt-oss.config`, gpt-oss's wildcards such as `model.layers.*.self_attn` kept as they are), less any
that would match a module holding an mxfp4 weight; without source patterns, the modules whose
tensors are all plain and that are no prefix of such a module.

Scale byte 0: the spec's UE8M0 (docs/spec.md, schemes) and the torch decode
(`ldexp(lut, byte - 127)`) give 2^-127; the triton kernels gpt-oss runs on GPUs (`triton_kernels`
`_upcast_from_mxfp`) shift the byte into the exponent field and get 0.0. A block with byte 0 and a
non-zero code therefore decodes differently (by less than 6 * 2^-127 per element), so by default
both directions refuse such a tensor; option `zero_scale=spec` accepts it (bytes unchanged, decoded
per SPEC).
"""
from __future__ import annotations

import json

from typing import Any, Mapping

import numpy as np

from qcore.errors import InputError, InvalidDataError
from qcore.files.io import VERSION_KEY
from qcore.spec.payload import QuantizedData
from qcore.backend.protocol import Support
from qcore._regex import bounded_regex
from qcore.formats import _mx
from qcore.files.hfconfig import config_beside, put_quantization_config
from qcore.files.stfile import write_arrays
from qcore.formats._st import array_support, carried, pop_json, read_arrays
from qcore.formats.base import Contents, Format, PathLike, Probe, Tensor, UnrepresentableError, short_repr

__all__ = ["GptOssFormat"]

NAMES_KEY = "gpt-oss.names"   # JSON {qcore name: [blocks key, scales key]}: restores the file's spelling
CONFIG_KEY = "gpt-oss.config"  # the source's quantization_config, JSON (its modules_to_not_convert patterns)
_SUFFIXES = ((".blocks", ".scales"), ("_blocks", "_scales"))
_ZERO_SCALE = ("refuse", "spec")


def _pairs(names: list[str]) -> dict[str, tuple[str, str]]:
    """{weight name: (blocks key, scales key)} for every blocks/scales pair in `names`."""
    have = set(names)
    out = {}
    for n in names:
        for b, s in _SUFFIXES:
            if n.endswith(b) and n[: -len(b)] + s in have:
                out[n[: -len(b)]] = (n, n[: -len(b)] + s)
    return out


def _key_pair(v: object) -> bool:
    """Whether `v` is what `read` keeps per weight in `gpt-oss.names`: two distinct non-empty keys."""
    return isinstance(v, list) and len(v) == 2 and all(isinstance(k, str) and k for k in v) and v[0] != v[1]


def should_convert(module: str, patterns: list[str]) -> bool:
    """transformers' `should_convert_module` (5.25): False when a pattern matches `module` as a regex
    from the start up to a module boundary ("layer.1" matches "layer.1.attn", not "layer.11.attn"),
    or is a suffix of it. A pattern that is not a valid regex matching in bounded time
    (`qcore._regex.bounded_regex`) is an `InvalidDataError`, as it is an error in transformers."""
    for key in patterns:
        rx = bounded_regex(rf"(?:{key})(?:(?<=\.)|(?=\.|$))")
        if rx is None:
            raise InvalidDataError(
                f"modules_to_not_convert pattern {short_repr(key)} is not a regex that matches in bounded time (the "
                "rule for qcore's regex recipe rules); fix it or drop it from the source's config.json")
        if rx.match(module) is not None or module.endswith(key):
            return False
    return True


def _module(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else name


def quantization_config(contents: Contents) -> dict:
    """The `quantization_config` transformers' Mxfp4 loader reads: `quant_method` mxfp4 and
    `modules_to_not_convert` patterns that match no module holding an mxfp4 weight (the source's
    own patterns from metadata `gpt-oss.config`, else the modules whose tensors are all plain);
    other keys of the source's config kept."""
    return config_of({n: isinstance(v, QuantizedData) for n, v in contents.tensors.items()},
                     pop_json(dict(contents.metadata), CONFIG_KEY))


def config_of(quantized_or_not: Mapping[str, bool], source: dict) -> dict:
    """`quantization_config` from which tensors are mxfp4 ({name: quantized?}) and the source's
    config (metadata `gpt-oss.config`, or {})."""
    quantized = {_module(n) for n, q in quantized_or_not.items() if q}
    patterns = source.get("modules_to_not_convert")
    if isinstance(patterns, list) and all(isinstance(p, str) for p in patterns):
        kept = [p for p in patterns if all(should_convert(q, [p]) for q in quantized)]
    else:
        plain = {_module(n) for n, q in quantized_or_not.items() if not q}
        kept = sorted(m for m in plain - quantized if all(should_convert(q, [m]) for q in quantized))
    return {**source, "quant_method": "mxfp4", "modules_to_not_convert": kept}


class GptOssFormat(Format):
    name = "gpt-oss"
    description = "gpt-oss MXFP4 safetensors (W.blocks uint8 [..., G, 16] + W.scales uint8 [..., G])"
    priority = 10

    def __init__(self, zero_scale: str = "refuse"):
        if zero_scale not in _ZERO_SCALE:
            raise InputError(f"gpt-oss option zero_scale must be one of {', '.join(_ZERO_SCALE)}, got {zero_scale!r}")
        self.zero_scale = zero_scale

    def with_options(self, **options: str) -> "GptOssFormat":
        unknown = set(options) - {"zero_scale"}
        if unknown:
            raise InputError(
                f"format 'gpt-oss' takes option zero_scale (refuse|spec), got {', '.join(sorted(unknown))}")
        return GptOssFormat(options.get("zero_scale", self.zero_scale))

    def detect(self, probe: Probe) -> bool:
        head = probe.safetensors_header or {}
        if VERSION_KEY in probe.metadata:  # a qcore file, whatever its tensors are called
            return False
        for blocks, scales in _pairs(probe.tensor_names).values():
            b, s = head[blocks], head[scales]
            b_shape, s_shape = list(b.get("shape", [])), list(s.get("shape", []))
            if b.get("dtype") == s.get("dtype") == "U8" and b_shape[:-1] == s_shape and b_shape[-1:] == [16]:
                return True
        return False

    def _zero_scale_ok(self, name: str, blocks: np.ndarray, scales: np.ndarray) -> None:
        n = _mx.zero_scale_blocks(blocks, scales)
        if n and self.zero_scale == "refuse":
            raise UnrepresentableError(
                f"tensor '{name}': {n} block(s) have scale byte 0 and a non-zero code, which SPEC decodes as "
                "2^-127 and triton's MX upcast as 0.0; pass option zero_scale=spec to keep the bytes "
                "and decode them per SPEC"
            )

    def read(self, path: PathLike) -> Contents:
        arrays, meta = read_arrays(path)
        pairs = _pairs(list(arrays))
        used = {k for pair in pairs.values() for k in pair}
        tensors: dict[str, Tensor] = {}
        names = {}
        for key, arr in arrays.items():
            if key not in used:
                tensors[key] = arr
                continue
            weight = next(w for w, pair in pairs.items() if key in pair)
            if weight in tensors:
                continue
            bkey, skey = pairs[weight]
            blocks, scales = arrays[bkey], arrays[skey]
            if blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.shape[:-1] != scales.shape \
                    or blocks.ndim < 2 or blocks.shape[-1] != 16:
                raise UnrepresentableError(
                    f"{path}: '{bkey}' {blocks.dtype} {list(blocks.shape)} and '{skey}' {scales.dtype} "
                    f"{list(scales.shape)} are not gpt-oss MXFP4 (uint8 [..., G, 16] and uint8 [..., G])"
                )
            self._zero_scale_ok(weight, blocks, scales)
            tensors[weight] = _mx.join(blocks, scales)
            names[weight] = [bkey, skey]
        meta = {**meta, NAMES_KEY: json.dumps(names, sort_keys=True)} if names else meta
        cfg = config_beside(path)
        if cfg is not None and cfg.get("quant_method") == "mxfp4":
            meta = {**meta, CONFIG_KEY: json.dumps(cfg, sort_keys=True)}
        return Contents(tensors, meta, self.name)

    def model_config(self, tensors: Mapping[str, tuple[Any, tuple[int, ...]]]) -> dict:
        return config_of({n: s is not None for n, (s, _) in tensors.items()}, {})

    def check(self, name: str, value: Tensor) -> Support:
        if isinstance(value, QuantizedData):
            return _mx.check(value, "gpt-oss")
        return array_support(value)

    def write(self, path: PathLike, contents: Contents) -> None:
        self.require(contents)
        config = quantization_config(contents)  # before any byte is written: its patterns may be refused
        meta = dict(contents.metadata)
        spelled = pop_json(meta, NAMES_KEY)
        meta.pop(CONFIG_KEY, None)
        arrays: dict[str, np.ndarray] = {}
        for name, value in contents.tensors.items():
            if isinstance(value, QuantizedData):
                blocks, scales = _mx.split(value)
                self._zero_scale_ok(name, blocks, scales)
                bkey, skey = carried(spelled, NAMES_KEY, name, _key_pair, "[blocks key, scales key], two distinct "
                                     "non-empty strings") or (name + ".blocks", name + ".scales")
                arrays[bkey], arrays[skey] = blocks, scales
            else:
                arrays[name] = value
        write_arrays(path, arrays, meta)
        put_quantization_config(path, config)
