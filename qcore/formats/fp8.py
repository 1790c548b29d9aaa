"""DeepSeek/Qwen-style FP8 checkpoints (`quantization_config.quant_method = "fp8"`), read and written.

Layout (DeepSeek-V3's `inference/kernel.py` `weight_dequant`; transformers 5.25's finegrained FP8
integration, `Fp8Dequantize`), for a weight `X` (`M.weight`; fused experts spell it
`M.experts.gate_up_proj`):

    X              float8_e4m3fn [..., m, n]
    X_scale_inv    float32 (bf16, f16, and float8_e8m0fnu for `scale_fmt: ue8m0`, read too):
                   [..., ceil(m / bm), ceil(n / bn)], one per bm x bn block (`weight_block_size`
                   of the config, [128, 128] in DeepSeek-V3 and Qwen3; partial blocks at the
                   bottom and right edges), [..., m, 1] per channel, or one value ([] or [1])
                   per tensor
    config.json    quantization_config {quant_method: fp8, activation_scheme, fmt: e4m3,
                   weight_block_size: [bm, bn] or null}

Despite its name the scale multiplies: both decode `f32(X) * f32(scale)` in one f32 multiply per
element (then cast to the model's dtype; an E8M0 scale is `2^(byte - 127)`), which is SPEC's
decode of qcore's `e4m3` with the same blocks and the stored scale dtype: `e4m3/block<bm>x<bn>:f32`
(edge blocks partial as DeepSeek's grid has them), `e4m3/block<n>:f32` per channel, `e4m3` per
tensor, `:ue8m0` for E8M0; the FP8 bytes are the values section as they are. The blocks come from
the config's `weight_block_size` when the scale's grid is `ceil` of the weight by it (DeepSeek's
kernel and vLLM use the config); otherwise from the grid itself when it divides the weight
(`Fp8Dequantize`'s rule: block = weight / grid); a grid that is neither is refused. Activation
scales (`M.activation_scale`, `M.input_scale`) and other tensors pass through as arrays. Refused,
with the reason: scales that are negative, NaN or infinite (docs/spec.md, arithmetic; an E8M0 byte
of 255 is NaN), other scale dtypes, and weights of fewer than 2 dims.

Writing takes `e4m3` tensors with f32 scales on the native store, all with the same 2-D blocks
(`weight_block_size`) or all per tensor (`weight_block_size: null`), and puts the config beside
the file (other keys of an existing config.json and of the quantization_config read are kept).
Per-channel scales have no `weight_block_size` form, so they are not written.
"""
from __future__ import annotations

import json
import math

import ml_dtypes
import numpy as np

from qcore.files.io import VERSION_KEY
from qcore.spec.payload import QuantizedData
from qcore.backend.protocol import Support
from qcore.spec.schemes import QuantScheme, QuantValue, StoreKind, scheme as parse_scheme
from qcore.files.hfconfig import config_beside, put_quantization_config
from qcore.files.stfile import write_arrays
from qcore.formats._st import array_support, pop_json, read_arrays
from qcore.formats.base import Contents, Format, PathLike, Probe, Tensor, UnrepresentableError, short_repr

__all__ = ["Fp8Format", "SCALE_SUFFIX"]

SCALE_SUFFIX = "_scale_inv"
CONFIG_KEY = "fp8.config"  # the source's quantization_config, JSON (kept through conversions)
_FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
_SCALE_DTYPES = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16", np.dtype(ml_dtypes.bfloat16): "bf16",
                 np.dtype(ml_dtypes.float8_e8m0fnu): "ue8m0"}  # E8M0: transformers' scale_fmt ue8m0


def _config_block(cfg: dict | None) -> tuple[int, int] | None:
    """The config's `weight_block_size` [bm, bn] (two positive integers), else None."""
    b = (cfg or {}).get("weight_block_size")
    if isinstance(b, list) and len(b) == 2 and all(isinstance(d, int) and not isinstance(d, bool) and d > 0
                                                   for d in b):
        return int(b[0]), int(b[1])
    return None


def _block(shape: tuple[int, ...], grid: tuple[int, ...], config: tuple[int, int] | None,
           where: str) -> tuple[int, int] | None:
    """The (bm, bn) blocks of a weight `[..., m, n]` whose scale has shape `grid`; None per tensor.

    A grid of the weight's rank is the config's blocks where it is their ceil grid, one scale per
    row where it is `[..., m, 1]`, else blocks of `weight / grid` where that divides; a scale of
    shape `[]` or `[1]` is one per tensor."""
    *lead, m, n = shape
    if len(grid) == len(shape) and list(grid[:-2]) == lead:
        a, b = grid[-2:]
        if config is not None and a == -(-m // config[0]) and b == -(-n // config[1]):
            return config
        if a == m and b == 1:
            return 1, n
        if a and b and m % a == 0 and n % b == 0:
            return m // a, n // b
        raise UnrepresentableError(
            f"{where}: a scale grid {list(grid)} neither divides the weight {list(shape)} nor is its ceil by the "
            f"config's weight_block_size {list(config) if config else None}, so its blocks are unknown")
    if len(grid) <= 1 and math.prod(grid) == 1:
        return None
    raise UnrepresentableError(f"{where}: a scale of shape {list(grid)} is not one per block of the weight "
                               f"{list(shape)} ([..., ceil(m / bm), ceil(n / bn)]), nor one per tensor ([] or [1])")


def _scheme(block: tuple[int, int] | None, sdt: str) -> QuantScheme:
    if block is None:
        return parse_scheme(f"e4m3/tensor:{sdt}")
    bm, bn = block
    return parse_scheme(f"e4m3/block{bn}:{sdt}" if bm == 1 else f"e4m3/block{bm}x{bn}:{sdt}")


def _read_weight(w: np.ndarray, scale: np.ndarray, config: tuple[int, int] | None, where: str) -> QuantizedData:
    if w.dtype != _FP8 or w.ndim < 2:
        raise UnrepresentableError(f"{where}: the weight is {w.dtype} {list(w.shape)}; the fp8 format holds "
                                   "float8_e4m3fn weights of 2 or more dims")
    sdt = _SCALE_DTYPES.get(scale.dtype)
    if sdt is None:
        raise UnrepresentableError(f"{where}: scale dtype {scale.dtype} is not f32, f16, bf16 or float8_e8m0fnu")
    sch = _scheme(_block(tuple(w.shape), tuple(scale.shape), config, where), sdt)
    s = scale.astype(np.float32).reshape(-1)
    if not np.all(np.isfinite(s)) or np.any(s < 0):
        bad = int(np.flatnonzero(~(np.isfinite(s) & (s >= 0)))[0])
        raise UnrepresentableError(f"{where}: scale {bad} is {float(s[bad])}; SPEC scales are finite and >= 0")
    words = sch.slot_dtype.traits.encode(s)
    return QuantizedData(tuple(w.shape), sch, np.ascontiguousarray(w).view(np.uint8).tobytes()
                         + np.ascontiguousarray(words).tobytes())


def _write_block(value: QuantizedData) -> tuple[int, int] | None:
    """The `weight_block_size` a written tensor needs (None: per tensor)."""
    s = value.scheme
    return None if s.block is None else (int(s.block.dims[0]), int(s.block.dims[1]))


class Fp8Format(Format):
    name = "fp8"
    description = ("DeepSeek/Qwen-style FP8 safetensors (X float8_e4m3fn + X_scale_inv, blocks of "
                   "weight_block_size, per channel or per tensor); config.json quant_method fp8")
    priority = 10

    def detect(self, probe: Probe) -> bool:
        if VERSION_KEY in probe.metadata:
            return False
        head = probe.safetensors_header or {}
        return any(n + SCALE_SUFFIX in head and isinstance(head[n], dict) and head[n].get("dtype") == "F8_E4M3"
                   for n in probe.tensor_names)

    def read(self, path: PathLike) -> Contents:
        arrays, meta = read_arrays(path)
        cfg = config_beside(path)
        config = _config_block(cfg)
        if cfg is not None and "weight_block_size" in cfg and cfg["weight_block_size"] is not None and config is None:
            raise UnrepresentableError(f"{path}: config.json weight_block_size is "
                                       f"{short_repr(cfg['weight_block_size'])}, not two positive integers")
        weights = {n for n in arrays if n + SCALE_SUFFIX in arrays}
        scales = {n + SCALE_SUFFIX for n in weights}
        tensors: dict[str, Tensor] = {}
        for name, arr in arrays.items():
            if name in scales and name not in weights:
                continue
            if name in weights:
                tensors[name] = _read_weight(arr, arrays[name + SCALE_SUFFIX], config, f"{path}: tensor '{name}'")
            else:
                tensors[name] = arr
        if cfg is not None:
            meta = {**meta, CONFIG_KEY: json.dumps(cfg, sort_keys=True)}
        return Contents(tensors, meta, self.name)

    def check(self, name: str, value: Tensor) -> Support:
        if not isinstance(value, QuantizedData):
            return array_support(value)
        s = value.scheme
        if s.value is not QuantValue.E4M3 or s.store.kind is not StoreKind.NATIVE or s.two_level or s.signed \
                or s.offset is not None or s.flat_blocks or s.slot_dtype.value != "f32" or len(value.shape) < 2:
            return Support.no(f"the fp8 format holds e4m3 weights of 2 or more dims with f32 scales per "
                              f"bm x bn block or per tensor (e4m3/block128x128:f32, e4m3), got {s} on "
                              f"{list(value.shape)}")
        if s.block is not None and len(s.block.dims) != 2:
            return Support.no(f"the fp8 format's blocks are 2-D (weight_block_size [bm, bn]), got {s}; per-channel "
                              f"scales have no weight_block_size form")
        return Support.yes()

    def write(self, path: PathLike, contents: Contents) -> None:
        self.require(contents)
        meta = dict(contents.metadata)
        cfg = pop_json(meta, CONFIG_KEY)
        blocks = {_write_block(v) for v in contents.tensors.values() if isinstance(v, QuantizedData)}
        if len(blocks) > 1:
            raise UnrepresentableError(
                f"the fp8 format's config has one weight_block_size for every weight, got "
                f"{', '.join(sorted(str(list(b)) if b else 'per tensor' for b in blocks))}; re-quantize to one")
        arrays: dict[str, np.ndarray] = {}
        for name, value in contents.tensors.items():
            if not isinstance(value, QuantizedData):
                arrays[name] = value
                continue
            arrays[name] = value.codes().reshape(value.shape).view(_FP8)
            arrays[name + SCALE_SUFFIX] = np.asarray(value.scales(), np.float32)  # the grid; per tensor: shape ()
        write_arrays(path, arrays, meta)
        block = next(iter(blocks)) if blocks else None
        config = {"activation_scheme": "dynamic", "fmt": "e4m3", **cfg, "quant_method": "fp8",
                  "weight_block_size": list(block) if block else None}
        put_quantization_config(path, config)
