"""compressed-tensors checkpoints (llm-compressor's output, which vLLM loads): `pack-quantized`
integers (symmetric or asymmetric), `int-quantized` int8 (W8A8), `float-quantized` FP8,
`mxfp4-pack-quantized` and `nvfp4-pack-quantized` weights.

Layout (compressed-tensors 0.20), per quantized module `M` of a safetensors file:

Weights are `[m, n]`, or `[..., m, n]` for fused experts (`[e, m, n]`; every format, with blocks
along the last axis: each shape below then gains the leading dims).

* `pack-quantized`: `M.weight_packed` int32 `[m, n / (32 / bits)]`, each word holding
  `32 / bits` codes, element k in bits `bits * k` (low bits first), stored as `q + 2^(bits-1)`
  (offset binary); `M.weight_scale` `[m, n / G]` (group), `[m, 1]` (channel) or `[1]` (tensor) in
  the model's float dtype; `M.weight_shape` int `[2]` = `[m, n]`. Dequantize: `q * scale`, in the
  scale's dtype. That is qcore's `q4f` / `q8f` on a `packed_u32` store along the last axis with
  each field's top bit flipped (offset binary to two's complement), blocks `(m / a, n / b)` for a
  scale of shape `[a, b]`, and the scale's dtype as qcore's scale dtype.
  qcore's symmetric `q4s` / `q8s` are written the same way: their codes (`[-7, 7]`,
  `[-127, 127]`) are a part of the int range, in the same fields, so the tool's `q * scale` is
  qcore's decode (read back they are `q4f` / `q8f`, the same values).
* asymmetric `pack-quantized` (`symmetric: false`): the same plus `M.weight_zero_point`, one
  signed zero point `z` per scale in the value's range (`[-8, 7]`, `[-128, 127]`; the tool's
  `calculate_qparams` rounds it to `zp_dtype`, int8 for int weights); dequantize `(q - z) *
  scale`, in the scale's dtype (`_dequantize`: `x_q.to(scale.dtype) - zero_point.to(scale.dtype)`,
  then `* scale`). For group and channel (the compressor's `PACK_ZP_STRATS`) it is packed with
  `pack_to_int32(zp, bits, packed_dim=0)`: int32 `[..., ceil(m * bits / 32), n / G]`, each word
  holding `32 / bits` consecutive rows of one column, row k in bits `bits * k`, offset binary
  `z + 2^(bits-1)`, the unused fields of a last, partly filled word 0; fused experts are packed
  expert by expert. For tensor and block it stays int8 in the scale's shape (`[1]`,
  `[m / bm, n / bn]`). That is qcore's `q4f` / `q8f` `.../zero` (docs/spec.md, affine offsets): the
  same values and scales, and the zero points as its offsets section, one int8 per slot in the
  grid's order. The tool infers int8 from `num_bits` / `type`, so the written config gives no
  `zp_dtype` (as its own `model_dump` does); a zero point not in that form (an unpacked one for
  group / channel, a packed one for tensor / block, bits set past the last row, an int8 one outside
  a 4-bit range) is refused, and so is one on a float weight (a float zero point, which qcore's
  integer zero points are not).
* `int-quantized` (the naive compressor's int format, W8A8's): `M.weight` int8 `[..., m, n]`, one
  code per byte whatever `num_bits` is (a 4-bit code is an int8 in [-8, 7]), `M.weight_scale` as
  above (or 2-D blocks), and with `symmetric: false` an int8 `M.weight_zero_point` in the scale's
  shape (never packed); dequantize `(q - z) * scale` in the scale's dtype. That is qcore's `q8f`
  on its native store (the int8 bytes as they are) with the same blocks, `/zero` with zero points.
  The activations' scheme (`input_activations` of the module's config group, W8A8's dynamic int8
  per token) is no part of the weight: it is kept per module in metadata
  `compressed-tensors.activations` and written back into the config group.
* `float-quantized`: `M.weight` float8_e4m3fn `[m, n]`, `M.weight_scale` as above (or 2-D blocks,
  `[m / bm, n / bn]`); dequantize `weight * scale`. That is qcore's `e4m3` with the same blocks.
* `mxfp4-pack-quantized`: `M.weight_packed` uint8 `[m, n / 2]` (element 2k in the low nibble),
  `M.weight_scale` uint8 `[m, n / 32]` (E8M0: `2^(byte - 127)`, decoded in bf16); that is qcore's
  `mxfp4` payload byte for byte, for fused experts `[e, m, n / 2]` + `[e, m, n / 32]` too (the MX
  blocks `[..., n / 32, 16]` of `_mx.join`). A scale byte of 255 (inf there, invalid in
  docs/spec.md, schemes) is refused.
* `nvfp4-pack-quantized`: `M.weight_packed` as mxfp4, `M.weight_scale` float8_e4m3fn `[m, n / 16]`
  and `M.weight_global_scale` f32 `[1]` = `448 * 6 / amax`, the reciprocal of the spec's global;
  dequantize `q * (scale / global_scale)`. That is qcore's `e2m1/block16:ue4m3/tensor:f32:recip/
  packed_native` (docs/spec.md, reciprocal global scale) byte for byte: values, scale bytes, then
  the global. The global is one per module whatever the weight's rank (the tool's
  `initialize_qparams` registers `torch.empty(1)` for a `tensor_group` weight, `generate_gparam`
  returns shape `[1]`), so a fused-expert `[e, m, n]` weight has one `[1]` global for all its
  experts, which is qcore's one global per tensor; a global of more than one value (one per
  expert, which 0.20 does not write) is refused. 0.20's FP4 compressors themselves take `[m, n]`
  only (`quantize_and_pack_fp4`: "Expected 2D tensor"); its `dequantize` takes `[e, m, n]` whole
  (tests/data/ctensors).

With f16/bf16 scales `q * scale` is exact in float32 (a code of at most 8 significant bits
times a scale of at most 11), so qcore's float32 dequantize rounded to the scale's dtype equals
the tool's product computed in that dtype; with f32 scales both are the same single f32
multiply. The same holds for `(q - z) * scale`: `|q - z|` is at most 255, 8 significant bits, so
the tool's difference in bf16 / f16 / f32 is exact and equals qcore's exact `f32(q - z)`; the
product of that and a scale of at most 11 significant bits is exact in f32, so rounding qcore's
`f32(f32(q - z) * e)` to the scale's dtype is the tool's one rounding of the same product
(tests/data/ctensors holds both, bit for bit). Activation scales (`M.input_scale`) and
unquantized tensors pass through as arrays. Writing puts the same tensors in a safetensors file
and the `quantization_config` a loader reads into the `config.json` beside it (`write_config`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable, Mapping

import ml_dtypes
import numpy as np

from qcore.spec import layout
from qcore.errors import InvalidDataError
from qcore.files.io import VERSION_KEY
from qcore.spec.payload import QuantizedData
from qcore.backend.protocol import Support
from qcore._regex import MAX_REGEX_CHOICES, bounded_regex
from qcore.spec.schemes import OffsetKind, PackedU32, QuantScheme, QuantValue, StoreKind, scheme as parse_scheme
from qcore.formats import _mx, _nvfp4
from qcore.files.hfconfig import config_beside, put_quantization_config
from qcore.files.stfile import write_arrays
from qcore.formats._st import array_support, carried, pop_json, read_arrays
from qcore.formats.base import Contents, Format, PathLike, Probe, Tensor, UnrepresentableError, short_repr

__all__ = ["CompressedTensorsFormat", "quantization_config", "write_config"]

NAMES_KEY = "compressed-tensors.names"  # JSON {qcore name: module prefix}: restores the file's spelling
ACTIVATIONS_KEY = "compressed-tensors.activations"  # JSON {qcore name: the module's input_activations}
CONFIG_KEY = "compressed-tensors.config"  # the source's quantization_config, JSON (kept through conversions)
PACKED, SCALE, SHAPE, ZERO, WEIGHT = "weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight"
_SCALE_DTYPES = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16", np.dtype(ml_dtypes.bfloat16): "bf16"}
_DTYPE_OF_SCALE = {name: dtype for dtype, name in _SCALE_DTYPES.items()}
_INT_VALUES = {4: QuantValue.Q4F, 8: QuantValue.Q8F}
# Integer values whose codes the tool's int weights hold as they are: q4f / q8f (the full range) and the
# symmetric q4s / q8s, whose codes ([-7, 7], [-127, 127]) lie inside it and are stored the same way
# (two's complement fields of packed_u32, int8 bytes of the native store), so `q * scale` is the same.
_INT_WRITABLE = (QuantValue.Q4F, QuantValue.Q8F, QuantValue.Q4S, QuantValue.Q8S)
_FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


@dataclass(frozen=True)
class _Kind:
    """What a qcore scheme is in compressed-tensors terms."""

    format: str  # "pack-quantized", "int-quantized", "float-quantized", "mxfp4-..." or "nvfp4-pack-quantized"
    bits: int
    type: str  # "int" or "float"


MXFP4_ARGS = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 32, "strategy": "group",
              "dynamic": False, "scale_dtype": "torch.uint8"}  # compressed-tensors' MXFP4 preset
NVFP4_ARGS = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16, "strategy": "tensor_group",
              "dynamic": False, "scale_dtype": "torch.float8_e4m3fn"}  # its NVFP4 preset (NVFP4A16)
NVFP4 = parse_scheme("e2m1/block16:ue4m3/tensor:f32:recip/packed_native")
GLOBAL = "weight_global_scale"
G_IDX = "weight_g_idx"
NV_BLOCK = _nvfp4.BLOCK


def _kind(s: QuantScheme) -> _Kind | None:
    if s.payload_form == _mx.MXFP4:
        return _Kind("mxfp4-pack-quantized", 4, "float")
    if s.payload_form == NVFP4:
        return _Kind("nvfp4-pack-quantized", 4, "float")
    if s.value in _INT_WRITABLE and not s.is_lookup and s.store.kind is StoreKind.PACKED_U32 and \
            s.store.dim == 0 and not s.two_level and not s.signed and \
            (s.offset is None or s.offset.kind is OffsetKind.ZERO):  # packed along the last axis
        return _Kind("pack-quantized", s.bits, "int")
    if s.value in _INT_WRITABLE and s.bits == 8 and not s.is_lookup and s.store.kind is StoreKind.NATIVE and \
            not s.two_level and not s.signed and \
            (s.offset is None or s.offset.kind is OffsetKind.ZERO):  # int8 codes as they are
        return _Kind("int-quantized", 8, "int")
    if s.value is QuantValue.E4M3 and s.store.kind is StoreKind.NATIVE and not s.two_level:
        return _Kind("float-quantized", 8, "float")
    return None


def written_scheme(s: QuantScheme, shape: tuple[int, ...], has_activations: bool) -> QuantScheme:
    """The scheme a weight is written in: an int8 weight on the native store with no
    `input_activations` (weight-only) goes as `pack-quantized` (the same codes, four to an int32
    word along the last axis), the form transformers decompresses beside other groups and vLLM runs
    as W8A16; `int-quantized` (int8 as it is) stays for W8A8 modules, which carry their activations."""
    kind = _kind(s)
    if kind is None or kind.format != "int-quantized" or has_activations or shape[-1] % 4:
        return s
    return s.with_store(PackedU32(0))


def _written(value: QuantizedData, has_activations: bool) -> QuantizedData:
    """`value` in `written_scheme`'s form (the same codes, scales and decode)."""
    packed = written_scheme(value.scheme, tuple(value.shape), has_activations)
    if packed is value.scheme:
        return value
    return QuantizedData.from_parts(value.shape, packed, value.codes(), value.scales(), value.global_scale(),
                                   value.offsets())


def _block_text(shape: tuple[int, ...], scale_shape: tuple[int, ...], where: str) -> str:
    """qcore's block part for a weight `[..., m, n]` whose scale has `scale_shape`: one scale
    (tensor), `[..., m, n / b]` (group / channel: blocks of b along the last axis) or, for a 2-D
    weight, `[m / bm, n / bn]` (2-D blocks)."""
    if len(shape) < 2:
        raise UnrepresentableError(f"{where}: compressed-tensors weights are at least 2-D, got shape {list(shape)}")
    if int(np.prod(scale_shape, dtype=np.int64)) == 1:
        return "tensor"
    n = shape[-1]
    if len(shape) > 2:  # fused experts [e, m, n]: blocks along the last axis only
        b = scale_shape[-1] if tuple(scale_shape[:-1]) == tuple(shape[:-1]) else 0
        if not b or n % b:
            raise UnrepresentableError(
                f"{where}: a scale of shape {list(scale_shape)} does not tile the weight {list(shape)} into "
                "blocks along its last axis (the only blocks qcore reads on weights of more than 2 dims)")
        return f"block{n // b}"
    m = shape[0]
    a, b = scale_shape if len(scale_shape) == 2 else (0, 0)  # [m / bm, n / bn]
    if not a or not b or m % a or n % b:
        raise UnrepresentableError(
            f"{where}: a scale of shape {list(scale_shape)} does not tile the weight {list(shape)} into whole blocks "
            "(qcore's partial edge blocks have no compressed-tensors form)")
    bm, bn = m // a, n // b
    return f"block{bn}" if bm == 1 else f"block{bm}x{bn}"


def _scheme_for(value: QuantValue, shape: tuple[int, ...], scale: np.ndarray, where: str,
                zero: bool = False, packed: bool = True) -> QuantScheme:
    """The qcore scheme of a weight of `value` codes whose scale is `scale`; integer codes are on
    `packed_u32` when `packed` (pack-quantized), else on the native store (int-quantized's int8)."""
    sdt = _SCALE_DTYPES.get(scale.dtype)
    if sdt is None:
        raise UnrepresentableError(f"{where}: scale dtype {scale.dtype} is not f32, f16 or bf16")
    block = _block_text(shape, tuple(scale.shape), where)
    store = "/packed_u32" if packed and value in (QuantValue.Q4F, QuantValue.Q8F) else ""
    return parse_scheme(f"{value.value}/{block}:{sdt}{store}{'/zero' if zero else ''}")


def _zero_packed(s: QuantScheme) -> bool:
    """Whether the tool packs this scheme's zero points into int32 (pack-quantized's `PACK_ZP_STRATS`:
    group and channel, i.e. blocks along the last axis) rather than keeping them int8 (tensor, block,
    and every int-quantized weight)."""
    return s.store.kind is StoreKind.PACKED_U32 and s.block is not None and \
        not (len(s.block.dims) == 2 and s.block.dims[0] > 1)


def _read_zero(zp: np.ndarray, s: QuantScheme, grid: tuple[int, ...], where: str) -> bytes:
    """qcore's offsets section (affine offsets: one int8 per slot) of the tool's `weight_zero_point`:
    for group / channel int32 `[..., ceil(m * bits / 32), G]`, the signed zero points of each
    column of the `[..., m, G]` grid packed down the rows as `pack_to_int32(zp, bits,
    packed_dim=0)` writes them (element k of a word in bits `bits * k`, offset binary `z + 2^(bits-1)`,
    the last word's unused fields 0); for tensor / block int8 in the scale's shape, as they are."""
    bits, zp = s.bits, np.asarray(zp)
    qmin, qmax = int(s.traits.qmin), int(s.traits.qmax)
    if _zero_packed(s):
        *lead, m, g = grid
        per = 32 // bits
        words = -(-m // per)
        want = (*lead, words, g)
        if zp.dtype != np.int32 or tuple(zp.shape) != want:
            raise UnrepresentableError(
                f"{where}: {ZERO} is {zp.dtype} {list(zp.shape)}; for group / channel scales {list(grid)} "
                f"compressed-tensors packs the {bits}-bit zero points down the rows into int32 {list(want)}")
        w = np.ascontiguousarray(zp).view(np.uint32)
        fields = (w[..., :, None, :] >> (np.arange(per, dtype=np.uint32) * bits)[:, None]) & np.uint32((1 << bits) - 1)
        fields = fields.reshape(*lead, words * per, g)
        if fields[..., m:, :].any():
            raise UnrepresentableError(f"{where}: {ZERO} has non-zero bits past its {m} rows (the tool writes 0 there)")
        z = fields[..., :m, :].astype(np.int16) - (1 << (bits - 1))
    else:
        if zp.dtype != np.int8 or zp.size != int(np.prod(grid, dtype=np.int64)):
            raise UnrepresentableError(
                f"{where}: {ZERO} is {zp.dtype} {list(zp.shape)}; for tensor / block scales and int-quantized "
                f"weights compressed-tensors keeps one int8 zero point per scale "
                f"({int(np.prod(grid, dtype=np.int64))})")
        z = zp.astype(np.int16)
        if z.size and (z.min() < qmin or z.max() > qmax):
            raise UnrepresentableError(f"{where}: a zero point outside the {bits}-bit range [{qmin}, {qmax}]")
    return np.ascontiguousarray(z.reshape(-1).astype(np.int8)).tobytes()


def _write_zero(value: QuantizedData, scale_shape: tuple[int, ...]) -> np.ndarray:
    """The tool's `weight_zero_point` of a `q4f` / `q8f` `/zero` tensor (the inverse of `_read_zero`)."""
    s = value.scheme
    z = value.offsets().astype(np.int16)
    if not _zero_packed(s):
        return z.astype(np.int8).reshape(scale_shape)
    bits = s.bits
    per = 32 // bits
    *lead, m, g = z.shape
    words = -(-m // per)
    fields = np.zeros((*lead, words * per, g), np.uint32)
    fields[..., :m, :] = (z + (1 << (bits - 1))).astype(np.uint32)
    fields = fields.reshape(*lead, words, per, g) << (np.arange(per, dtype=np.uint32) * bits)[:, None]
    return np.bitwise_or.reduce(fields, axis=-2).view(np.int32)


def _scales_f32(scale: np.ndarray, where: str) -> np.ndarray:
    s = np.asarray(scale).astype(np.float32)
    if not np.all(np.isfinite(s)) or np.any(s < 0):
        raise UnrepresentableError(f"{where}: scales must be finite and >= 0 (docs/spec.md, arithmetic), "
                                   "got a negative or non-finite one")
    return s


def _weight_shape(a: np.ndarray | None, where: str) -> tuple[int, ...]:
    """The weight's `[..., m, n]` that `weight_shape` holds (int64, as the tool writes it; whole
    floats are read too): 2 or more whole numbers >= 0, checked against `weight_packed` by the caller."""
    if a is None or np.asarray(a).size < 2:
        raise UnrepresentableError(f"{where}: no {SHAPE} of 2 or more dims beside {PACKED}")
    v = np.asarray(a).reshape(-1)
    whole = v.dtype.kind in "iu" or (v.dtype.kind == "f" and bool(np.all(np.isfinite(v)))
                                     and bool(np.all(v == np.floor(v))))
    if not whole or bool(np.any(v < 0)):
        raise InvalidDataError(f"{where}: {SHAPE} must hold whole numbers >= 0 (the weight's [..., m, n]), got "
                               f"{v.dtype} {short_repr(v.tolist())}")
    return tuple(int(d) for d in v)


def _flip(words: np.ndarray, bits: int) -> np.ndarray:
    """u32 words with each `bits`-wide field's top bit flipped: compressed-tensors' offset-binary
    fields (`q + 2^(bits-1)`) <-> qcore's two's-complement `packed_u32` fields, both low bits first."""
    mask = sum(1 << (bits * k + bits - 1) for k in range(32 // bits))
    return np.ascontiguousarray(words).view(np.uint32) ^ np.uint32(mask)


def _modules(names: list[str]) -> dict[str, str]:
    """{module prefix: "pack" | "naive"} for every quantized module whose tensors are in `names`
    (`weight_packed`, or a `weight` of int8 / FP8 codes, beside a `weight_scale`)."""
    have = set(names)
    out = {}
    for n in names:
        for suffix, kind in (("." + PACKED, "pack"), ("." + WEIGHT, "naive")):
            if n.endswith(suffix) and n[: -len(suffix)] + "." + SCALE in have:
                out[n[: -len(suffix)]] = kind
    return out


def _input_activations(cfg: dict, mod: str) -> dict | None:
    """The `input_activations` of the config group that targets module `mod`, or None.

    Targets match as compressed-tensors' `match_name` has it: `re:PATTERN` by `re.match` (a pattern
    that is not valid or not bounded in time, `qcore._regex.bounded_regex`, is an `InvalidDataError`), any
    other target by the exact module name. A target that starts with a capital letter is a class name
    (`Linear`, W8A8's target); a file has no module classes, so it is taken to match every
    quantized module, after every group that names the module."""
    groups = cfg.get("config_groups")
    if not isinstance(groups, dict) or not isinstance(mod, str):
        return None
    by_name = by_class = None
    for group in groups.values():
        targets = group.get("targets") if isinstance(group, dict) else None
        for t in targets if isinstance(targets, list) else []:
            if not isinstance(t, str):
                continue
            if t.startswith("re:"):
                rx = bounded_regex(t[3:])
                if rx is None:
                    raise InvalidDataError(
                        f"config.json: config group target {short_repr(t)} is not a regex that matches in bounded "
                        "time (the rule for qcore's regex recipe rules: valid, no repetition or | inside a "
                        f"repetition, at most {MAX_REGEX_CHOICES} variable repetitions); fix it or drop it")
                hit = rx.match(mod) is not None
            else:
                hit = t == mod
            if hit and by_name is None:
                by_name = group
            elif t[:1].isupper() and by_class is None:
                by_class = group
    acts = (by_name or by_class or {}).get("input_activations")
    return acts if isinstance(acts, dict) else None


def quantization_config(contents: Contents) -> dict:
    """The `quantization_config` of `config.json` for the quantized tensors of a checkpoint
    (one config group per distinct weight argument set and activation scheme, targeting its modules
    by name); a module's `input_activations` are the ones read (metadata `compressed-tensors.activations`)."""
    plain = [n for n, v in contents.tensors.items()
             if not isinstance(v, QuantizedData) and v.ndim == 2 and v.dtype.kind == "f"]
    return config_of({n: (v.scheme, tuple(v.shape)) for n, v in contents.tensors.items()
                      if isinstance(v, QuantizedData)}, pop_json(dict(contents.metadata), ACTIVATIONS_KEY), plain)


def ignored_modules(quantized: Iterable[str], plain_2d: Iterable[str]) -> list[str]:
    """The modules of `ignore`: each module with a 2-D float `M.weight` kept in float and no
    quantized tensor (a loader that quantizes every Linear a group does not target, vLLM's
    `find_matched_target`, needs them named; a kept embedding or head named too is harmless)."""
    owners = {_module(n) for n in quantized}
    return sorted({_module(n) for n in plain_2d if n.endswith(".weight")} - owners)


def config_of(quantized: Mapping[str, tuple[QuantScheme, tuple[int, ...]]], acts_of: dict,
              plain_2d: Iterable[str] = ()) -> dict:
    """`quantization_config` from the tensors' schemes and shapes alone ({name: (scheme, shape)}),
    each module's `input_activations` ({name: JSON object}) and the names of the 2-D float
    tensors kept as they are (`ignore`)."""
    groups: dict[str, dict] = {}
    formats = set()
    for name, (s, shape) in quantized.items():
        s = written_scheme(s, shape, acts_of.get(name) is not None)
        kind = _kind(s)
        if kind is None:
            continue
        formats.add(kind.format)
        args: dict = {"num_bits": kind.bits, "type": kind.type, "symmetric": s.offset is None, "dynamic": False}
        if kind.format == "mxfp4-pack-quantized":
            args = dict(MXFP4_ARGS)
        elif kind.format == "nvfp4-pack-quantized":
            args = dict(NVFP4_ARGS)
        elif s.block is None:
            args["strategy"] = "tensor"
        else:
            dims = s.block.dims
            if len(dims) == 2 and dims[0] > 1:
                args.update(strategy="block", block_structure=[int(dims[0]), int(dims[1])])
            elif int(dims[-1]) == shape[-1]:
                args["strategy"] = "channel"
            else:
                args.update(strategy="group", group_size=int(dims[-1]))
        acts = carried(acts_of, ACTIVATIONS_KEY, name, lambda v: isinstance(v, dict), "a JSON object (the "
                       "module's input_activations)")
        key = json.dumps([args, acts], sort_keys=True)
        group = groups.setdefault(key, {"targets": [], "weights": args, "input_activations": acts,
                                        "output_activations": None, "format": kind.format})
        group["targets"].append(_module(name))
    fmt = formats.pop() if len(formats) == 1 else "mixed-precision"
    config_groups = {f"group_{i}": g for i, g in enumerate(groups.values())}
    if fmt != "mixed-precision":
        for g in config_groups.values():
            g.pop("format")
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": config_groups, "ignore": ignored_modules(quantized, plain_2d)}


def _fp4_shape(packed: np.ndarray, scale: np.ndarray, block: int) -> tuple[int, ...] | None:
    """The weight shape `[..., m, n]` of FP4 nibbles `[..., m, n/2]` whose scales are `[..., m, n/block]`
    (2-D, or fused experts `[e, m, n]`), else None."""
    if packed.ndim < 2 or not packed.shape[-2] or not packed.shape[-1]:
        return None
    shape = (*packed.shape[:-1], 2 * packed.shape[-1])
    if shape[-1] % block or tuple(scale.shape) != (*shape[:-1], shape[-1] // block):
        return None
    return shape


def _read_nvfp4(packed: np.ndarray, scale: np.ndarray, g: np.ndarray, where: str) -> QuantizedData:
    g = np.asarray(g)
    if g.size != 1:  # the tool gives a tensor_group module one [1] global whatever the weight's rank
        raise UnrepresentableError(
            f"{where}: a {GLOBAL} of shape {list(g.shape)} ({g.size} values, e.g. one per expert); qcore's nvfp4 has "
            f"one global per tensor, which is what compressed-tensors 0.20 writes ([1] per module, also for "
            f"fused experts [e, m, n])")
    shape = _fp4_shape(packed, scale, NV_BLOCK)
    if packed.dtype != np.uint8 or scale.dtype != _FP8 or shape is None or g.dtype != np.float32:
        raise UnrepresentableError(f"{where}: {PACKED} {packed.dtype} {list(packed.shape)}, {SCALE} {scale.dtype} "
                                   f"{list(scale.shape)} and {GLOBAL} {g.dtype} are not nvfp4 ([..., m, n/2] uint8, "
                                   "[..., m, n/16] float8_e4m3fn, one f32)")
    words = _nvfp4.scale_words(scale, where)
    gv = g.astype(np.float32).reshape(())
    if not (np.isfinite(gv) and gv > 0):
        raise UnrepresentableError(f"{where}: {GLOBAL} is {float(gv)}; a reciprocal global must be finite and > 0")
    parts = [np.ascontiguousarray(packed).tobytes(), words.tobytes(), gv.astype("<f4").tobytes()]
    return QuantizedData(shape, NVFP4, b"".join(parts))


def _module(name: str) -> str:
    return name[: -len(".weight")] if name.endswith(".weight") else name


def write_config(path: PathLike, contents: Contents) -> str:
    """Put `quantization_config` into the `config.json` beside `path` (`qcore.files.hfconfig.put_quantization_config`)."""
    return put_quantization_config(path, quantization_config(contents))


class CompressedTensorsFormat(Format):
    name = "compressed-tensors"
    description = ("compressed-tensors safetensors (llm-compressor, vLLM): pack-quantized int4/int8 "
                   "(symmetric or with zero points), int-quantized int8 (W8A8), float-quantized FP8, mxfp4- and "
                   "nvfp4-pack-quantized "
                   "weights; config.json quantization_config")
    priority = 10

    def detect(self, probe: Probe) -> bool:
        if VERSION_KEY in probe.metadata:
            return False
        head = probe.safetensors_header or {}
        for mod, kind in _modules(probe.tensor_names).items():
            dtype = head[f"{mod}.{PACKED if kind == 'pack' else WEIGHT}"].get("dtype")
            if (kind, dtype) in (("pack", "I32"), ("pack", "U8"), ("naive", "F8_E4M3"), ("naive", "I8")):
                return True
        return False

    def read(self, path: PathLike) -> Contents:
        arrays, meta = read_arrays(path)
        modules = _modules(list(arrays))
        used: set[str] = set()
        tensors: dict[str, Tensor] = {}
        names: dict[str, str] = {}
        for mod, kind in modules.items():
            where = f"{path}: module '{mod}'"
            zp = arrays.get(f"{mod}.{ZERO}")
            codes = arrays[f"{mod}.{PACKED if kind == 'pack' else WEIGHT}"]
            if zp is not None and codes.dtype != (np.int32 if kind == "pack" else np.int8):
                raise UnrepresentableError(
                    f"{where} is asymmetric ({mod}.{ZERO}) and not an int weight: a float weight's zero point "
                    "is a float, which qcore's zero points (integers of the value; docs/spec.md, affine "
                    "offsets) are not; only pack-quantized int4 / int8 and int-quantized weights are read "
                    "with zero points")
            if f"{mod}.{G_IDX}" in arrays:
                raise UnrepresentableError(
                    f"{where} has {mod}.{G_IDX} (activation ordering: column k takes the scale of group g_idx[k]), "
                    "which qcore's blocks of consecutive columns cannot hold")
            scale = arrays[f"{mod}.{SCALE}"]
            if kind == "pack" and arrays[f"{mod}.{PACKED}"].dtype == np.uint8:  # FP4: mxfp4 or nvfp4
                name = f"{mod}.weight"
                tensors[name] = self._read_fp4(mod, arrays, where)
                names[name] = mod
                used |= {f"{mod}.{PACKED}", f"{mod}.{SCALE}", f"{mod}.{GLOBAL}"}  # the global is in the payload
                continue
            if kind == "pack":
                shape = _weight_shape(arrays.get(f"{mod}.{SHAPE}"), where)
                packed = arrays[f"{mod}.{PACKED}"]
                words = packed.shape[-1] if packed.ndim == len(shape) else 0
                bits = 32 * words // shape[-1] if words and shape[-1] else 0
                if bits not in _INT_VALUES or -(-shape[-1] // (32 // bits)) != words or \
                        tuple(packed.shape[:-1]) != shape[:-1]:
                    raise UnrepresentableError(f"{where}: {PACKED} {list(packed.shape)} is neither 4- nor 8-bit "
                                               f"codes of a {list(shape)} weight")
                if packed.dtype != np.int32 or shape[-1] % (32 // bits):
                    raise UnrepresentableError(
                        f"{where}: {PACKED} must be int32 and {shape[-1]} columns whole words of {32 // bits} "
                        f"codes (qcore's packed_u32 has no partly filled word); got {packed.dtype}")
                sch = _scheme_for(_INT_VALUES[bits], shape, scale, where, zero=zp is not None)
                values = _flip(packed, bits).tobytes()  # qcore's values section, word for word
                used |= {f"{mod}.{PACKED}", f"{mod}.{SHAPE}", f"{mod}.{SCALE}", f"{mod}.{ZERO}"}
            else:  # int-quantized int8 or float-quantized FP8: one code per byte, as qcore's native store
                w = arrays[f"{mod}.{WEIGHT}"]
                value = {_FP8: QuantValue.E4M3, np.dtype(np.int8): QuantValue.Q8F}.get(w.dtype)
                if value is None or w.ndim < 2:
                    raise UnrepresentableError(f"{where}: {WEIGHT} is {w.dtype} {list(w.shape)}, not float8_e4m3fn "
                                               "(float-quantized) or int8 (int-quantized) of 2 or more dims")
                shape = tuple(w.shape)
                sch = _scheme_for(value, shape, scale, where, zero=zp is not None, packed=False)
                values = np.ascontiguousarray(w).view(np.uint8).tobytes()  # E4M3 codes / int8 codes are the bytes
                used |= {f"{mod}.{WEIGHT}", f"{mod}.{SCALE}", f"{mod}.{ZERO}"}
            name = f"{mod}.weight"
            words = sch.slot_dtype.traits.encode(_scales_f32(scale, where).reshape(-1))
            offsets = b"" if zp is None else _read_zero(zp, sch, tuple(layout.grid_shape(shape, sch)), where)
            tensors[name] = QuantizedData(shape, sch, values + np.ascontiguousarray(words).tobytes() + offsets)
            names[name] = mod
        for key, arr in arrays.items():
            if key not in used:
                if key in tensors:
                    raise UnrepresentableError(f"{path}: tensor '{key}' collides with a quantized module's name")
                tensors[key] = arr
        cfg = config_beside(path)
        if cfg is not None:
            meta = {**meta, CONFIG_KEY: json.dumps(cfg, sort_keys=True)}
            acts = {name: a for name, mod in names.items() if (a := _input_activations(cfg, mod)) is not None}
            if acts:
                meta = {**meta, ACTIVATIONS_KEY: json.dumps(acts, sort_keys=True)}
        if names:
            meta = {**meta, NAMES_KEY: json.dumps(names, sort_keys=True)}
        return Contents(tensors, meta, self.name)

    @staticmethod
    def _read_fp4(mod: str, arrays: dict[str, np.ndarray], where: str) -> QuantizedData:
        """`mxfp4-pack-quantized` as qcore's mxfp4 and `nvfp4-pack-quantized` as qcore's nvfp4 with a
        reciprocal global (docs/spec.md, reciprocal global scale), bytes unchanged."""
        packed, scale = arrays[f"{mod}.{PACKED}"], arrays[f"{mod}.{SCALE}"]
        if f"{mod}.{GLOBAL}" in arrays:
            return _read_nvfp4(packed, scale, arrays[f"{mod}.{GLOBAL}"], where)
        if scale.dtype != np.uint8:
            raise UnrepresentableError(f"{where}: an FP4 weight with {scale.dtype} scales and no {GLOBAL} "
                                       "is neither mxfp4 (uint8 E8M0 scales) nor nvfp4")
        shape = _fp4_shape(packed, scale, _mx.BLOCK)
        if shape is None:
            raise UnrepresentableError(f"{where}: {PACKED} uint8 {list(packed.shape)} and {SCALE} uint8 "
                                       f"{list(scale.shape)} are not mxfp4 ([..., m, n/2] and [..., m, n/32])")
        if (scale == 255).any():
            raise UnrepresentableError(f"{where}: an E8M0 scale byte of 255, which compressed-tensors decodes as "
                                       "inf and qcore holds invalid (docs/spec.md, schemes)")
        *lead, n = shape  # MX blocks [..., n/32, 16] and their scale bytes [..., n/32]: qcore's payload as it is
        return _mx.join(packed.reshape(*lead, n // _mx.BLOCK, _mx.BLOCK // 2), scale)

    def check(self, name: str, value: Tensor) -> Support:
        if isinstance(value, QuantizedData):
            s = value.scheme
            if s.payload_form in (_mx.MXFP4, NVFP4) and len(value.shape) < 2:
                return Support.no(f"compressed-tensors weights are at least 2-D, got shape {list(value.shape)}")
            if s.payload_form == _mx.MXFP4:  # [m, n] or fused experts [..., m, n], blocks along the last axis
                return _mx.check(value, "compressed-tensors")
            if s.payload_form == NVFP4:  # the same shapes, one global for the whole tensor as the tool has it
                if value.shape[-1] % NV_BLOCK:
                    return Support.no(f"compressed-tensors nvfp4 weights are [..., m, n] with n a multiple of "
                                      f"{NV_BLOCK}, got {list(value.shape)}")
                return Support.yes()
            if _kind(s) is None:
                hint = ""
                if s.traits.unsigned and s.offset is not None and s.offset.kind is OffsetKind.ZERO:
                    half = 1 << (s.bits - 1)
                    hint = (f"; its int codes and zero points are signed: {s.value.value}'s q and z are "
                            f"q{s.bits}f's q + {half} and z + {half}, the same values")
                return Support.no(f"compressed-tensors holds q4f/q8f/q4s/q8s (packed_u32 along the last axis; "
                                  f"symmetric, or asymmetric with zero points: .../zero), q8f/q8s on the native store "
                                  f"(int-quantized), "
                                  f"e4m3 weights with f32/f16/bf16 scales (not "
                                  f"signed), mxfp4 and nvfp4 with a reciprocal global ({NVFP4}), got {s}{hint}")
            if len(value.shape) < 2:
                return Support.no(f"compressed-tensors weights are at least 2-D, got shape {list(value.shape)}")
            if len(value.shape) > 2 and s.block is not None and len(s.block.dims) > 1:
                return Support.no(f"on weights of more than 2 dims compressed-tensors blocks run along the last "
                                  f"axis, got {s} on {list(value.shape)}")
            m, n = value.shape[-2:]
            dims = (1, 1) if s.block is None else (1, *s.block.dims)[-2:]
            if m % dims[0] or n % dims[1]:
                return Support.no(f"blocks {list(dims)} do not tile shape {list(value.shape)} (partial edge blocks)")
            if _kind(s).format == "pack-quantized" and n % (32 // s.bits):
                return Support.no(f"{n} columns leave a partly filled int32 word")
            return Support.yes()
        return array_support(value)

    def model_config(self, tensors: Mapping[str, tuple[QuantScheme | None, tuple[int, ...]]]) -> dict:
        return config_of({n: (s, shape) for n, (s, shape) in tensors.items() if s is not None}, {},
                         [n for n, (s, shape) in tensors.items() if s is None and len(shape) == 2])

    def write(self, path: PathLike, contents: Contents) -> None:
        self.require(contents)
        config = quantization_config(contents)  # before any byte is written: its metadata may be refused
        meta = dict(contents.metadata)
        spelled = pop_json(meta, NAMES_KEY)
        meta.pop(CONFIG_KEY, None)
        meta.pop(ACTIVATIONS_KEY, None)
        arrays: dict[str, np.ndarray] = {}
        acts_of = pop_json(dict(contents.metadata), ACTIVATIONS_KEY)
        for name, value in contents.tensors.items():
            if not isinstance(value, QuantizedData):
                arrays[name] = value
                continue
            mod = carried(spelled, NAMES_KEY, name, lambda v: isinstance(v, str) and v != "",
                          "a module name (a non-empty string)") or _module(name)
            value = _written(value, acts_of.get(name) is not None)
            s = value.scheme
            *lead, n = value.shape  # [m, n] or fused experts [..., m, n]
            if s.payload_form == _mx.MXFP4:
                blocks, scales = _mx.split(value)
                arrays[f"{mod}.{PACKED}"] = blocks.reshape(*lead, n // 2)
                arrays[f"{mod}.{SCALE}"] = scales
                continue
            if s.payload_form == NVFP4:
                arrays[f"{mod}.{PACKED}"] = np.frombuffer(value.values_bytes(), np.uint8).reshape(*lead, n // 2)
                arrays[f"{mod}.{SCALE}"] = value.scales().astype(_FP8).reshape(*lead, n // NV_BLOCK)
                arrays[f"{mod}.{GLOBAL}"] = np.asarray([value.global_scale()], np.float32)  # [1], as the tool's
                continue
            sdt = _DTYPE_OF_SCALE[s.slot_dtype.value]
            scales = value.scales()  # the block grid ([..., m, n / b] or [m / bm, n / bn]); per-tensor: shape ()
            scale = scales.reshape(1) if s.block is None else scales
            fmt = _kind(s).format
            if fmt == "pack-quantized":
                words = np.frombuffer(value.values_bytes(), np.uint32).reshape(*lead, n * s.bits // 32)
                arrays[f"{mod}.{PACKED}"] = _flip(words, s.bits).view(np.int32)
                arrays[f"{mod}.{SHAPE}"] = np.array(value.shape, dtype=np.int64)
            elif fmt == "int-quantized":
                arrays[f"{mod}.{WEIGHT}"] = value.codes().reshape(value.shape).astype(np.int8)
            else:
                arrays[f"{mod}.{WEIGHT}"] = value.codes().reshape(value.shape).view(_FP8)
            if s.offset is not None:
                arrays[f"{mod}.{ZERO}"] = _write_zero(value, scale.shape)
            arrays[f"{mod}.{SCALE}"] = scale.astype(sdt)
        write_arrays(path, arrays, meta)
        put_quantization_config(path, config)
