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
torchao's quantizer multiplies by the reciprocal scale; qcore's `nvfp4` quantize divides, so only
decoding is claimed bit-identical.
"""
from __future__ import annotations

import json

import numpy as np

from ..errors import InvalidDataError
from ..io import VERSION_KEY
from ..payload import QuantizedData
from ..protocol import Support
from ..scheme import PRESETS, scheme as parse_scheme
from . import _nvfp4
from ._st import array_support, pop_json, read_arrays, write_arrays
from .base import Checkpoint, Format, PathLike, Probe, Tensor, UnrepresentableError

__all__ = ["TorchaoFormat", "from_blocked", "to_blocked"]

TENSORS_KEY = "torchao.tensors"   # JSON {weight: its NVFP4Tensor attributes}: restores them on write
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
    attrs = info.get("_data") or {}
    fields = info.get("_tensor_data_names") or []
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
        g = np.asarray(arrays.get(prefix + "per_tensor_scale"), np.float32)
        if g.ndim != 0:
            raise UnrepresentableError(
                f"{where}: a per-expert scale of shape {list(g.shape)}; qcore's nvfp4 has one per-tensor scale")
        parts.append(g.astype("<f4").tobytes())
        sch = NVFP4
    else:
        sch = ONE_LEVEL
    return QuantizedData((*lead, m, k), sch, b"".join(parts)), used


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
        except (ValueError, AttributeError, TypeError):
            return False

    def read(self, path: PathLike) -> Checkpoint:
        arrays, meta = read_arrays(path)
        try:
            names = json.loads(meta.pop("tensor_names"))
            infos = {n: json.loads(meta.pop(n)) for n in names}
        except (KeyError, ValueError) as e:
            raise InvalidDataError(f"{path}: torchao metadata is not readable: {e}") from None
        tensors: dict[str, Tensor] = {}
        kept: dict[str, dict] = {}
        used: set[str] = set()
        for name in names:
            info = infos[name]
            kind = info.get("_type") if isinstance(info, dict) else None
            where = f"{path}: torchao tensor '{name}'"
            if kind == "NVFP4Tensor":
                tensors[name], keys = _read_weight(arrays, name, info, where)
                used.update(keys)
                kept[name] = info.get("_data") or {}
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
        return Checkpoint(tensors, meta, self.name)

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

    def write(self, path: PathLike, checkpoint: Checkpoint) -> None:
        self.require(checkpoint)
        meta = dict(checkpoint.metadata)
        kept = pop_json(meta, TENSORS_KEY)
        arrays: dict[str, np.ndarray] = {}
        infos: dict[str, str] = {}
        act_keys: set[str] = set()
        for name, value in checkpoint.tensors.items():
            if not isinstance(value, QuantizedData):
                arrays[name] = value
                continue
            prefix, _ = _parts(name)
            attrs = {**_DEFAULTS, **kept.get(name, {})}
            *lead, m, k = value.shape
            words = value.scales().astype(np.float32)  # decoded UE4M3 values
            scale = words.astype(_FP8).reshape(*lead, m, k // BLOCK)
            if attrs.get("is_swizzled_scales"):
                scale = to_blocked(scale.reshape(-1, k // BLOCK))
            fields = ["qdata", "scale"]
            if value.scheme.two_level:
                arrays[prefix + "per_tensor_scale"] = np.asarray(value.global_scale(), np.float32)
                fields.insert(0, "per_tensor_scale")
            if prefix + "act_per_tensor_scale" in checkpoint.tensors:  # its data, not a listed tensor
                fields.insert(1 if value.scheme.two_level else 0, "act_per_tensor_scale")
                act_keys.add(prefix + "act_per_tensor_scale")
            arrays[prefix + "qdata"] = np.frombuffer(value.values_bytes(), np.uint8).reshape(*lead, m, k // 2)
            arrays[prefix + "scale"] = scale
            order = ("is_swizzled_scales", "use_triton_kernel", "act_quant_kwargs", "block_size", "orig_dtype")
            data = {key: attrs[key] for key in order if key in attrs}
            infos[name] = json.dumps({"_type": "NVFP4Tensor", "_data": data, "_tensor_data_names": fields})
        listed = [n for n in checkpoint.tensors if n not in act_keys]
        for name in listed:
            if name not in infos:
                infos[name] = json.dumps({"_type": "Tensor"})
        out_meta = {**meta, **infos, "tensor_names": json.dumps(listed)}
        write_arrays(path, arrays, out_meta)

