"""torchao NVFP4 checkpoints (`torchao.prototype.mx_formats.NVFP4Tensor` state dicts in safetensors).

Layout (torchao 0.18.0, `prototype/safetensors/safetensors_support.py`), for weight `M.w`:

    M._w_qdata               uint8 [..., m, k / 2], element 2k in the LOW nibble (E2M1 codes)
    M._w_scale               float8_e4m3fn [..., m, k / 16] block scales, or the same bytes in
                             cuBLAS' blocked layout when `is_swizzled_scales` (128 x 4 tiles)
    M._w_per_tensor_scale    f32, shape () (absent: one level); shape (E, 1, 1) per expert
    M._w_act_per_tensor_scale  f32, the activations' scale (kept as a plain tensor)
    metadata[M.w]            JSON {"_type": "NVFP4Tensor", "_data": {attributes}, "_tensor_data_names"}
    metadata["tensor_names"] JSON list of every tensor, plain ones as {"_type": "Tensor"}

torchao decodes `e2m1(code) * (per_tensor_scale * f32(scale))` (`NVFP4Tensor.dequantize`), then
casts to `orig_dtype`: SPEC's two-level decode, `e = g * s_b` in one f32 multiply. So a weight reads
as qcore `nvfp4` (`e2m1/block16:ue4m3/tensor:f32/packed_native`) with the same value, scale and
global bytes, or as `e2m1/block16:ue4m3/packed_native` without a per-tensor scale; swizzled scales
are put back in row-major order. Writing does the reverse, with the attributes read (swizzling,
`orig_dtype`, `act_quant_kwargs`) kept in metadata `torchao.tensors`, so torchao's own file comes
back byte for byte; a tensor quantized in qcore gets torchao's defaults (`orig_dtype` float32).

Refused, with the reason: other torchao tensor types, per-expert scales (qcore has one global per
tensor), block sizes other than 16, and block scales that are negative or NaN (UE4M3 is unsigned).
Metadata that is not what torchao writes (`tensor_names` not a list of distinct names, an entry
not a JSON object, `_data` not an object, `_tensor_data_names` not a list of names, a listed
field missing) is an `InvalidDataError` naming the key and the field.
`model_config` (what `qcore quantize --format torchao` puts in config.json) is the
`quantization_config` transformers 5.25 writes for `TorchAoConfig(NVFP4WeightOnlyConfig(
use_dynamic_per_tensor_scale=...), modules_to_not_convert=[the Linear layers kept in float])`, key
for key (`TorchAoConfig.to_dict`, torchao's `config_to_dict`): the tensors `write` makes in qcore
(no activation quantization) are what that config makes, with a per-tensor scale (`nvfp4`) or
without (`e2m1/block16:ue4m3/packed_native`); a model with both is refused, since the config has one.
torchao's quantizer multiplies by the reciprocal scale; qcore's `nvfp4` quantize divides, so only
decoding is claimed bit-identical.
"""
from __future__ import annotations

import json
from typing import Any, Mapping

import numpy as np

from qcore.errors import InvalidDataError
from qcore.files.io import VERSION_KEY
from qcore.spec.payload import QuantizedData
from qcore.backend.protocol import Support
from qcore.spec.schemes import PRESETS, QuantScheme, scheme as parse_scheme
from qcore.formats import _nvfp4
from qcore.files.stfile import write_arrays
from qcore.formats._st import array_support, carried, pop_json, read_arrays
from qcore.formats._hfconfig import one_setting, skip_modules
from qcore.formats.base import Contents, Format, PathLike, Probe, Tensor, UnrepresentableError, parse_json, short_repr

__all__ = ["TorchaoFormat", "from_blocked", "to_blocked"]

TENSORS_KEY = "torchao.tensors"   # JSON {weight: its NVFP4Tensor attributes}: restores them on write
MODEL_KEY = "torchao.model"       # JSON {tensor: its torchao entry} of every shard of a model folder (shard_metadata)
NVFP4 = PRESETS["nvfp4"]
ONE_LEVEL = parse_scheme("e2m1/block16:ue4m3/packed_native")
BLOCK = _nvfp4.BLOCK
_FP8 = _nvfp4.FP8
_DEFAULTS = {"is_swizzled_scales": False, "use_triton_kernel": False, "act_quant_kwargs": None, "block_size": BLOCK,
             "orig_dtype": {"_type": "torch.dtype", "_data": "float32"}}


def _parts(name: str) -> tuple[str, str]:
    """torchao's key prefix of weight `name` ('M.w' -> 'M._w_'): its data tensors are prefix + field."""
    module, _, attr = name.rpartition(".")
    return f"{module}._{attr}_" if module else f"_{attr}_", attr


def from_blocked(blocked: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """The row-major [rows, cols] scales of cuBLAS' blocked layout (torchao's `from_blocked`):
    128 x 4 tiles, each stored as 32 x 16 with the four 32-row groups interleaved."""
    nrb, ncb = -(-rows // 128), -(-cols // 4)
    t = blocked.reshape(nrb * ncb, 32, 4, 4).transpose(0, 2, 1, 3).reshape(nrb, ncb, 128, 4)
    return t.transpose(0, 2, 1, 3).reshape(nrb * 128, ncb * 4)[:rows, :cols]


def to_blocked(scales: np.ndarray) -> np.ndarray:
    """The inverse of `from_blocked`: [rows, cols] scales padded with zeros to whole 128 x 4
    tiles, as a [32 * row tiles, 16 * column tiles] array (torchao's `to_blocked` shape)."""
    rows, cols = scales.shape
    nrb, ncb = -(-rows // 128), -(-cols // 4)
    padded = np.zeros((nrb * 128, ncb * 4), scales.dtype)
    padded[:rows, :cols] = scales
    t = padded.reshape(nrb, 128, ncb, 4).transpose(0, 2, 1, 3).reshape(nrb * ncb, 4, 32, 4)
    return t.transpose(0, 2, 1, 3).reshape(nrb * 32, ncb * 16)


def _read_weight(arrays: dict[str, np.ndarray], name: str, info: dict, where: str) -> tuple[QuantizedData, list]:
    """The qcore payload of one NVFP4Tensor and the keys it used."""
    prefix, _ = _parts(name)
    attrs, fields = _attributes(info, where), _field_names(info, where)
    if attrs.get("block_size", BLOCK) != BLOCK:
        raise UnrepresentableError(f"{where}: block_size {attrs.get('block_size')}; NVFP4 blocks are 16")
    try:
        qdata, scale = arrays[prefix + "qdata"], arrays[prefix + "scale"]
    except KeyError as e:
        raise InvalidDataError(f"{where}: lacks {e}") from None
    used = [prefix + f for f in fields if f != "act_per_tensor_scale"]
    if qdata.dtype != np.uint8 or qdata.ndim < 2 or scale.dtype != _FP8:
        raise UnrepresentableError(f"{where}: qdata {qdata.dtype} {list(qdata.shape)} and scale {scale.dtype} "
                                   f"{list(scale.shape)} are not NVFP4 (uint8 [..., m, k/2], float8_e4m3fn)")
    *lead, m, half = qdata.shape
    k = 2 * half
    if k % BLOCK:
        raise UnrepresentableError(f"{where}: {k} columns are not whole blocks of {BLOCK}")
    rows = int(np.prod(lead, dtype=np.int64)) * m
    words = _nvfp4.scale_words(scale, where)
    if attrs.get("is_swizzled_scales"):
        need = -(-rows // 128) * 128 * -(-(k // BLOCK) // 4) * 4
        if words.size != need:
            raise InvalidDataError(f"{where}: {words.size} swizzled scales; {rows} rows x {k // BLOCK} blocks need {need}")
        words = from_blocked(words.reshape(-1), rows, k // BLOCK)
    if words.size != rows * (k // BLOCK):
        raise InvalidDataError(f"{where}: {words.size} block scales; shape {[*lead, m, k]} needs {rows * (k // BLOCK)}")
    parts = [np.ascontiguousarray(qdata).tobytes(), np.ascontiguousarray(words).tobytes()]
    if "per_tensor_scale" in fields:
        if prefix + "per_tensor_scale" not in arrays:
            raise InvalidDataError(f"{where}: lacks '{prefix}per_tensor_scale', which '_tensor_data_names' lists")
        g = np.asarray(arrays[prefix + "per_tensor_scale"], np.float32)
        if g.ndim != 0:
            raise UnrepresentableError(
                f"{where}: a per-expert scale of shape {list(g.shape)}; qcore's nvfp4 has one per-tensor scale")
        parts.append(g.astype("<f4").tobytes())
        sch = NVFP4
    else:
        sch = ONE_LEVEL
    try:
        return QuantizedData((*lead, m, k), sch, b"".join(parts)), used
    except InvalidDataError as e:
        raise InvalidDataError(f"{where}: {e}") from None


def _attributes(info: dict, where: str) -> dict:
    """An NVFP4Tensor's `_data` (its attributes): a JSON object, {} when absent or null."""
    attrs = info.get("_data")
    if attrs is None:
        return {}
    if not isinstance(attrs, dict):
        raise InvalidDataError(f"{where}: '_data' must be a JSON object of NVFP4Tensor attributes, "
                               f"got {short_repr(attrs)}")
    return attrs


def _field_names(info: dict, where: str) -> list[str]:
    """An NVFP4Tensor's `_tensor_data_names`: a list of field names, [] when absent or null."""
    fields = info.get("_tensor_data_names")
    if fields is None:
        return []
    if not isinstance(fields, list) or not all(isinstance(f, str) for f in fields):
        raise InvalidDataError(f"{where}: '_tensor_data_names' must be a list of field names such as "
                               f"[\"per_tensor_scale\", \"qdata\", \"scale\"], got {short_repr(fields)}")
    return fields


def _kept_ok(attrs: Any) -> bool:
    """Whether `attrs` can be what `read` kept of a weight in `torchao.tensors`: its attributes,
    whose `block_size` (written as it is) can only be NVFP4's."""
    return isinstance(attrs, dict) and attrs.get("block_size", BLOCK) == BLOCK


def _listed(meta: dict[str, str], path: PathLike) -> dict[str, Any]:
    """The tensors `tensor_names` lists, each with its parsed metadata entry (both popped from
    `meta`): a list of distinct names, each with an entry of its own."""
    if "tensor_names" not in meta:
        raise InvalidDataError(f"{path}: lacks metadata 'tensor_names' (torchao's list of every tensor)")
    names = parse_json(meta.pop("tensor_names"), f"{path}: metadata 'tensor_names'")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
        raise InvalidDataError(f"{path}: metadata 'tensor_names' must be a list of distinct tensor names, "
                               f"got {short_repr(names)}")
    missing = next((n for n in names if n not in meta), None)
    if missing is not None:
        raise InvalidDataError(f"{path}: metadata 'tensor_names' lists {short_repr(missing)}, which has no "
                               "metadata entry (its torchao JSON)")
    return {n: parse_json(meta.pop(n), f"{path}: metadata {short_repr(n)}") for n in names}


def _entry(attrs: dict | None, two_level: bool, act_scale: bool) -> dict:
    """torchao's metadata entry of a weight (`flatten_tensor_state_dict`): NVFP4Tensor, its attributes
    (torchao's defaults where `attrs` lacks them) and its data fields; a plain tensor's when `attrs` is None."""
    if attrs is None:
        return {"_type": "Tensor"}
    attrs = {**_DEFAULTS, **attrs}
    order = ("is_swizzled_scales", "use_triton_kernel", "act_quant_kwargs", "block_size", "orig_dtype")
    fields = ["per_tensor_scale"] * two_level + ["act_per_tensor_scale"] * act_scale + ["qdata", "scale"]
    return {"_type": "NVFP4Tensor", "_data": {k: attrs[k] for k in order if k in attrs}, "_tensor_data_names": fields}


def shard_metadata(tensors: Mapping[str, tuple[Any, tuple[int, ...]]]) -> dict[str, str]:
    """`MODEL_KEY`: the entry of every tensor of the model ({name: (scheme or None, shape)}) as `write`
    writes it for a tensor made in qcore, so that each shard lists the whole model as transformers'
    `save_pretrained` does (transformers 5.25 merges the shards' metadata, `tensor_names` of the last
    shard winning, and loads only the tensors that list names)."""
    acts = {n for n in tensors if n.endswith("_act_per_tensor_scale")}
    model = {}
    for name, (sch, _) in tensors.items():
        if name in acts:
            continue
        prefix, _ = _parts(name)
        quantized = isinstance(sch, QuantScheme)
        model[name] = _entry({} if quantized else None, quantized and sch.two_level,
                             quantized and prefix + "act_per_tensor_scale" in tensors)
    return {MODEL_KEY: json.dumps(model)}


def _per_tensor_scale(name: str, sch: Any) -> bool:
    """Whether a tensor `write` gives has a per-tensor scale (NVFP4WeightOnlyConfig's
    `use_dynamic_per_tensor_scale`); a tensor it does not write is an `UnrepresentableError`."""
    s = sch.payload_form if isinstance(sch, QuantScheme) else None
    if s not in (NVFP4, ONE_LEVEL):
        raise UnrepresentableError(f"tensor '{name}' ({sch}) is not a torchao NVFP4 tensor ({NVFP4} or {ONE_LEVEL})")
    return s == NVFP4


def model_config(tensors: Mapping[str, tuple[Any, tuple[int, ...]]]) -> dict | None:
    """transformers' `TorchAoConfig(NVFP4WeightOnlyConfig(...)).to_dict()` for a model whose
    tensors are {name: (scheme or None, shape)} as `write` writes them; None when none is quantized."""
    settings = {n: _per_tensor_scale(n, s) for n, (s, _) in tensors.items() if s is not None}
    if not settings:
        return None
    two_level = one_setting(settings, "torchao", lambda t: f"use_dynamic_per_tensor_scale {t} "
                            f"({NVFP4 if t else ONE_LEVEL})")
    weight_only = {"_type": "NVFP4WeightOnlyConfig", "_version": 1,
                   "_data": {"use_dynamic_per_tensor_scale": two_level}}
    return {"quant_method": "torchao", "quant_type": {"default": weight_only},
            "modules_to_not_convert": skip_modules(tensors), "include_input_output_embeddings": False,
            "untie_embedding_weights": False}


class TorchaoFormat(Format):
    name = "torchao"
    description = "torchao NVFP4Tensor state dict (qdata + e4m3 scales + per-tensor scale, JSON metadata)"
    priority = 25

    def detect(self, probe: Probe) -> bool:
        meta = probe.metadata
        if VERSION_KEY in meta or "tensor_names" not in meta:
            return False
        try:
            names = json.loads(meta["tensor_names"])
            return isinstance(names, list) and any(
                json.loads(meta.get(n, "{}")).get("_type") == "NVFP4Tensor" for n in names)
        except (ValueError, AttributeError, TypeError, RecursionError):
            return False

    def read(self, path: PathLike) -> Contents:
        arrays, meta = read_arrays(path)
        infos = _listed(meta, path)
        tensors: dict[str, Tensor] = {}
        kept: dict[str, dict] = {}
        used: set[str] = set()
        for name, info in infos.items():
            where = f"{path}: torchao tensor {short_repr(name)}"
            if not isinstance(info, dict):
                raise InvalidDataError(f"{where}: its metadata must be a JSON object such as "
                                       f"{{\"_type\": \"Tensor\"}}, got {short_repr(info)}")
            kind = info.get("_type")
            if kind == "NVFP4Tensor":
                tensors[name], keys = _read_weight(arrays, name, info, where)
                used.update(keys)
                kept[name] = _attributes(info, where)
            elif kind == "Tensor":
                if name not in arrays:
                    raise InvalidDataError(f"{where} is listed but not in the file")
                tensors[name] = arrays[name]
                used.add(name)
            else:
                raise UnrepresentableError(f"{where}: {kind} is not read (qcore reads torchao's NVFP4Tensor)")
        for key, arr in arrays.items():  # activation scales and anything unlisted, as plain tensors
            if key not in used:
                tensors[key] = arr
        if kept:
            meta[TENSORS_KEY] = json.dumps(kept)  # key order kept: torchao's JSON comes back as it was
        return Contents(tensors, meta, self.name)

    def check(self, name: str, value: Tensor) -> Support:
        if isinstance(value, QuantizedData):
            s = value.scheme.payload_form
            if s not in (NVFP4, ONE_LEVEL):
                return Support.no(f"torchao holds NVFP4 ({NVFP4} or {ONE_LEVEL}), got {value.scheme}")
            if len(value.shape) < 2 or value.shape[-1] % BLOCK:
                return Support.no(f"NVFP4Tensor weights are [..., m, k] with k a multiple of {BLOCK}, got "
                                  f"{list(value.shape)}")
            return Support.yes()
        return array_support(value)

    def model_config(self, tensors: Mapping[str, tuple[Any, tuple[int, ...]]]) -> dict | None:
        return model_config(tensors)

    def shard_metadata(self, tensors: Mapping[str, tuple[Any, tuple[int, ...]]]) -> dict[str, str]:
        return shard_metadata(tensors)

    def write(self, path: PathLike, contents: Contents) -> None:
        self.require(contents)
        meta = dict(contents.metadata)
        kept = pop_json(meta, TENSORS_KEY)
        model = pop_json(meta, MODEL_KEY)
        arrays: dict[str, np.ndarray] = {}
        infos: dict[str, str] = {}
        act_keys: set[str] = set()
        for name, value in contents.tensors.items():
            if not isinstance(value, QuantizedData):
                arrays[name] = value
                continue
            prefix, _ = _parts(name)
            own = carried(kept, TENSORS_KEY, name, _kept_ok, f"a JSON object of NVFP4Tensor attributes (block_size "
                          f"{BLOCK} or absent)")
            attrs = {**_DEFAULTS, **(own or {})}
            *lead, m, k = value.shape
            words = value.scales().astype(np.float32)  # decoded UE4M3 values
            scale = words.astype(_FP8).reshape(*lead, m, k // BLOCK)
            if attrs.get("is_swizzled_scales"):
                scale = to_blocked(scale.reshape(-1, k // BLOCK))
            if value.scheme.two_level:
                arrays[prefix + "per_tensor_scale"] = np.asarray(value.global_scale(), np.float32)
            act_scale = prefix + "act_per_tensor_scale" in contents.tensors  # its data, not a listed tensor
            if act_scale:
                act_keys.add(prefix + "act_per_tensor_scale")
            arrays[prefix + "qdata"] = np.frombuffer(value.values_bytes(), np.uint8).reshape(*lead, m, k // 2)
            arrays[prefix + "scale"] = scale
            infos[name] = json.dumps(_entry(attrs, value.scheme.two_level, act_scale))
        listed = [n for n in contents.tensors if n not in act_keys]
        for name in listed:
            if name not in infos:
                infos[name] = json.dumps(_entry(None, False, False))
        # a shard of a model folder lists the whole model (`shard_metadata`), its own tensors as written here
        others = {n: json.dumps(e) for n, e in model.items() if n not in infos and n not in act_keys}
        names = [n for n in model if n not in act_keys] + [n for n in listed if n not in model]
        out_meta = {**meta, **others, **infos, "tensor_names": json.dumps(names)}
        write_arrays(path, arrays, out_meta)

