"""bitsandbytes 4-bit checkpoints (`Linear4bit` state dicts saved as safetensors), read and written.

Layout (bitsandbytes 0.50.2 `functional.py`, `QuantState.as_dict(packed=True)`), for weight `W`:

    W                                  uint8 (any storage dtype, read as bytes), 2 codes per byte,
                                       element 2k in the HIGH nibble, blocks over the flattened tensor
    W.absmax                           f32 [ceil(n / blocksize)]; with double quant uint8 codes
    W.quant_map                        f32 [16], the code table (NF4 for quant_type nf4)
    W.nested_absmax, W.nested_quant_map  double quant only: f32 per 256 absmax codes, 8-bit dynamic map
    W.quant_state.bitsandbytes__nf4    uint8 JSON {quant_type, blocksize, dtype, shape,
                                       nested_blocksize, nested_dtype, nested_offset}

bitsandbytes decodes `quant_map[code] * absmax` in f32 (then casts to `dtype`), which is SPEC's
LOOKUP decode with the table `quant_map`: qcore reads `W` as `q4s-lookup[nf4]/block<B>:f32` (or a
custom table when `quant_map` is not NF4), with nibbles swapped into SPEC's order. Double quant is
undone first, exactly as bitsandbytes does: `absmax = f32(nested_quant_map[code] *
nested_absmax[i // nested_blocksize]) + f32(nested_offset)`, which gives f32 absmax values.

Where the tensor is 1-D or its last dim is a multiple of the blocksize, the flattened blocks are
qcore's per-axis blocks and the scheme is the v1 one; otherwise (blocks that cross rows) it is
`q4s-lookup[nf4]/block<B>:f32:flat`, blocks over the flattened tensor (docs/spec.md, flat blocks).
Double quant can give a block a negative absmax: a block of zeros beside an outlier, whose absmax
(0 less the mean, quantized by the 8-bit dynamic map, the mean added back) lands below 0.
bitsandbytes decodes it all the same, `quant_map[code] * absmax`: -0.0 for a code of 0.0, the
other codes with their signs flipped. A block whose values that gives are all zeros is read
exactly as scale +0 with, per element, the code of a negative table entry where the value is -0.0
(`-t * +0 = -0`) and of a non-negative one where it is +0.0 (NF4: codes 0 and 7); a block with a
negative absmax and a non-zero value is refused (a LOOKUP table with scales >= 0 cannot flip its
signs): the reader gives bitsandbytes' decode of that tensor (in the layer's dtype) as refused
(`Contents.refused`), which `convert` re-quantizes when asked and otherwise reports. Refused too, with the reason: quant_type fp4 (its table holds +0 and -0 and is not
increasing, which LOOKUP excludes), and absmax values that are not finite. Every size in the quant_state
(`shape`, `blocksize`, `nested_blocksize`) is checked for its type and against the tensors the
file holds before anything is allocated: a bad one is an `InvalidDataError` naming the field.

Writing takes `q4s-lookup[nf4]/block<B>:f32` tensors (B a bitsandbytes blocksize, 64 ... 4096;
blocks along the last axis whose extent B divides, or a 1-D tensor) and `.../block<B>:f32:flat`
ones of any shape, in any store and field order, and writes the layout above without double
quant: the same codes and f32 absmax, so bitsandbytes decodes the same values.
`model_config` (what `qcore quantize --format bitsandbytes` puts in config.json) is the
`quantization_config` transformers 5.25 writes for `BitsAndBytesConfig(load_in_4bit=True,
bnb_4bit_quant_type="nf4", llm_int8_skip_modules=[the Linear layers kept in float])`, key for key
(`BitsAndBytesConfig.to_dict`): no double quant, uint8 storage (the `[n/2, 1]` bytes written), f32
compute (the decode's own precision). transformers loads 4-bit data only into `nn.Linear`
weights, so a quantized tensor that is not a 2-D `M.weight` is refused there.
A file bitsandbytes wrote without double quant comes back byte for byte. `dtype` in the state is
the layer's dtype recorded on read (`bitsandbytes.dtypes`), else float32. Other tables are
refused: bitsandbytes' CUDA kernels decode nf4 with their built-in table, not `quant_map`.
"""
from __future__ import annotations

import json
import math
from typing import Any, Mapping

import ml_dtypes
import numpy as np

from qcore.errors import InputError, InvalidDataError, SchemeError
from qcore.spec.layout import check_shape
from qcore.spec.payload import QuantizedData
from qcore.backend.protocol import Support
from qcore.spec.schemes import PRESETS, QuantMode, QuantScheme, QuantValue, ScaleDtype
from qcore.files.stfile import write_arrays
from qcore.formats._st import array_support, pop_json, read_arrays
from qcore.formats._hfconfig import one_setting, skip_modules
from qcore.formats.base import Contents, Format, PathLike, Probe, Tensor, UnrepresentableError, parse_json, short_repr

__all__ = ["BnbNF4Format"]

STATE_SUFFIX = ".quant_state.bitsandbytes__"
DTYPES_KEY = "bitsandbytes.dtypes"   # JSON {name: original dtype}, what bitsandbytes casts to
_NF4 = np.asarray(PRESETS["nf4"].table, np.float32)
_NF4_ZERO = int(np.argmin(np.abs(_NF4)))  # index 7
_F32_MAX = float(np.finfo(np.float32).max)
_PARTS = (".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map")
_LAYER_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
                 "float16": np.dtype(np.float16)}  # quant_state 'dtype': what dequantize_4bit casts to
BLOCKSIZES = (64, 128, 256, 512, 1024, 2048, 4096)
"""bitsandbytes' 4-bit blocksizes that qcore writes."""


def _state(arr: np.ndarray, where: str) -> dict:
    try:
        text = np.ascontiguousarray(arr).view(np.uint8).tobytes().decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidDataError(f"{where} is not JSON (not UTF-8 text)") from None
    st = parse_json(text, where)
    if not isinstance(st, dict):
        raise InvalidDataError(f"{where} is not a JSON object")
    return st


def _positive(st: dict, key: str, default: int | None = None) -> int:
    """A positive integer field of the quant_state (`blocksize`, `nested_blocksize`)."""
    v = st[key] if default is None else st.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise InvalidDataError(f"quant_state '{key}' must be a positive integer, got {short_repr(v)}")
    return v


def _number(st: dict, key: str) -> float:
    """A finite float32 number field of the quant_state (`nested_offset`)."""
    v = st[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not abs(v) <= _F32_MAX:  # NaN, inf, 10**400 too
        raise InvalidDataError(f"quant_state '{key}' must be a finite float32 number, got {short_repr(v)}")
    return float(v)


def _shape(st: dict) -> tuple[int, ...]:
    """The quant_state's `shape`: a list of integers >= 0 that spans a tensor qcore can hold."""
    v = st["shape"]
    if not isinstance(v, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in v):
        raise InvalidDataError(f"quant_state 'shape' must be a list of integers >= 0, got {short_repr(v)}")
    try:
        return check_shape(v)
    except InputError as e:
        raise InvalidDataError(f"quant_state 'shape' {short_repr(v)}: {e}") from None


def _absmax(arrays: dict[str, np.ndarray], w: str, st: dict) -> np.ndarray:
    """Per-block f32 absmax, with double quant undone the way bitsandbytes does it."""
    absmax = arrays[w + ".absmax"]
    if w + ".nested_absmax" not in arrays:
        if absmax.dtype != np.float32:
            raise UnrepresentableError(f"absmax of '{w}' is {absmax.dtype}; bitsandbytes 4-bit absmax is float32")
        return absmax.reshape(-1)
    codes = absmax.reshape(-1).view(np.uint8)
    nested = arrays[w + ".nested_absmax"].astype(np.float32).reshape(-1)
    table = arrays[w + ".nested_quant_map"].astype(np.float32).reshape(-1)
    nb = _positive(st, "nested_blocksize", 256)
    offset = _number(st, "nested_offset")
    need = -(-codes.size // nb)
    if nested.size != need or table.size != 256:
        raise InvalidDataError(
            f"double quant of '{w}': {codes.size} absmax codes in blocks of {nb} (quant_state 'nested_blocksize') "
            f"need {need} nested absmax values and a 256-entry map, got {nested.size} and {table.size}"
        )
    per = nested[np.arange(codes.size) // nb]  # one per code: no array of nb-sized blocks, whatever nb claims
    return (table[codes] * per).astype(np.float32) + np.float32(offset)


def _tensor(arrays: dict[str, np.ndarray], w: str, st: dict) -> QuantizedData:
    quant_type = st.get("quant_type")
    if quant_type != "nf4":
        raise UnrepresentableError(
            f"quant_type {quant_type!r} is not read (bitsandbytes fp4's table holds +0 and -0 and is not "
            "increasing, which a LOOKUP table cannot be); only nf4 is read"
        )
    shape = _shape(st)
    block = _positive(st, "blocksize")
    crosses_rows = len(shape) > 1 and shape[-1] % block != 0  # then blocks over the flattened tensor
    table = arrays[w + ".quant_map"].astype(np.float32).reshape(-1)
    try:
        sch = QuantScheme(QuantValue.Q4S).per_block([block], ScaleDtype.F32, flat=crosses_rows)
    except SchemeError as e:
        raise InvalidDataError(f"quant_state 'blocksize' {block} is no qcore block: {e}") from None
    try:
        sch = sch.with_mode(QuantMode.LOOKUP, "nf4" if np.array_equal(table, _NF4) else tuple(table.tolist()))
    except SchemeError as e:
        raise UnrepresentableError(f"its quant_map is not a LOOKUP table: {e}") from None
    n = math.prod(shape)  # exact: the bytes below are checked against it before any array is made
    packed = np.ascontiguousarray(arrays[w]).view(np.uint8).reshape(-1)
    if packed.size != -(-n // 2):
        raise InvalidDataError(f"'{w}' holds {packed.size} bytes; shape {list(shape)} needs {-(-n // 2)}")
    codes = np.empty(packed.size * 2, np.uint8)
    codes[0::2], codes[1::2] = packed >> np.uint8(4), packed & np.uint8(0x0F)   # element 2k high
    absmax = _absmax(arrays, w, st)
    if absmax.size != -(-n // block):
        raise InvalidDataError(f"'{w}' has {absmax.size} absmax values; shape {list(shape)} needs {-(-n // block)}")
    codes, absmax = _zero_blocks(codes[:n], absmax, table, block)
    return QuantizedData.from_parts(shape, sch, codes.reshape(shape), absmax)


class _SignsFlipped(UnrepresentableError):
    """A tensor no LOOKUP scheme holds exactly; `values` is bitsandbytes' f32 decode of it (flat)."""

    def __init__(self, message: str, values: np.ndarray):
        super().__init__(message)
        self.values = values


def _zero_blocks(codes: np.ndarray, absmax: np.ndarray, table: np.ndarray,
                 block: int) -> tuple[np.ndarray, np.ndarray]:
    """The codes and absmax with every block of a negative (or -0) absmax put in SPEC's terms: the
    values bitsandbytes decodes there, `f32(table[code] * absmax)`, must all be zeros, which scale
    +0 holds with a negative table entry's code where the value is -0.0 and a non-negative one's
    where it is +0.0; a non-zero value (its sign flipped by the absmax) is `_SignsFlipped`, which
    carries bitsandbytes' decode of the whole tensor."""
    negative = np.signbit(absmax) & np.isfinite(absmax)   # a non-finite absmax is refused as invalid data
    if not negative.any():
        return codes, absmax
    block_of = np.arange(codes.size) // block
    sel = negative[block_of]
    values = table[codes[sel]] * absmax[block_of[sel]]  # bitsandbytes' f32 product, element by element
    flipped = np.unique(block_of[sel][values != 0])
    if flipped.size:
        b = int(flipped[0])
        raise _SignsFlipped(
            f"{flipped.size} block(s) have a negative absmax after double quant and non-zero codes (block {b}: "
            f"absmax {float(absmax[b])!r}), which bitsandbytes decodes with their signs flipped and a LOOKUP "
            "table with scales >= 0 holds only for blocks of zeros; pass requantize=SCHEME (--requantize) to "
            "re-quantize this tensor from bitsandbytes' decoded values",
            table[codes] * absmax[block_of])
    below = np.flatnonzero(table < 0)
    at_or_above = np.flatnonzero(~np.signbit(table))
    if not below.size or not at_or_above.size:
        raise UnrepresentableError("a block of zeros with a negative absmax needs a table with a negative and a "
                                   "non-negative entry (for -0.0 and +0.0 at scale 0)")
    codes = codes.copy()
    codes[sel] = np.where(np.signbit(values), below[0], at_or_above[0]).astype(np.uint8)
    return codes, np.where(negative, np.float32(0), absmax).astype(np.float32)


def _write_check(value: QuantizedData) -> Support:
    s = value.scheme.payload_form
    if not (s.is_lookup and s.table_name == "nf4" and s.block is not None and len(s.block.dims) == 1
            and s.tensor is None and s.block.dtype is ScaleDtype.F32):
        return Support.no(f"bitsandbytes holds nf4 as q4s-lookup[nf4]/block<B>:f32, got {value.scheme}")
    block = s.block.dims[0]
    if block not in BLOCKSIZES:
        return Support.no(f"bitsandbytes blocksizes are {', '.join(map(str, BLOCKSIZES))}, got {block}")
    if not s.flat_blocks and len(value.shape) > 1 and value.shape[-1] % block:
        return Support.no(f"bitsandbytes blocks run over the flattened tensor: the last dim of {list(value.shape)} "
                          f"must be a multiple of {block}, or the blocks over the flattened tensor "
                          f"(q4s-lookup[nf4]/block{block}:f32:flat)")
    return Support.yes()


def _write_tensor(name: str, value: QuantizedData, dtype: str) -> dict[str, np.ndarray]:
    """The state dict entries of one nf4 weight (no double quant), as bitsandbytes writes them."""
    codes = value.codes().reshape(-1).astype(np.uint8)
    if codes.size % 2:  # bitsandbytes quantizes a zero into the half byte left over: NF4's 0.0
        codes = np.concatenate([codes, np.asarray([_NF4_ZERO], np.uint8)])
    packed = (codes[0::2] << np.uint8(4)) | codes[1::2]  # element 2k in the HIGH nibble
    state = {"quant_type": "nf4", "blocksize": value.scheme.block.dims[0], "dtype": dtype,
             "shape": [int(d) for d in value.shape]}
    return {name: packed.reshape(-1, 1),
            name + ".absmax": np.ascontiguousarray(value.scales(), np.float32).reshape(-1),
            name + ".quant_map": _NF4.copy(),
            name + STATE_SUFFIX + "nf4": np.frombuffer(json.dumps(state).encode("utf-8"), np.uint8).copy()}


def _setting(name: str, sch: QuantScheme | None, shape: tuple[int, ...]) -> tuple[str, bool, str]:
    """(bnb_4bit_quant_type, bnb_4bit_use_double_quant, bnb_4bit_quant_storage) of a tensor `write`
    gives: nf4, no double quant, uint8 bytes; a tensor it does not write, or one transformers
    cannot load as a Linear4bit weight, is an `UnrepresentableError`."""
    s = sch.payload_form if isinstance(sch, QuantScheme) else None
    if s is None or not (s.is_lookup and s.table_name == "nf4"):
        raise UnrepresentableError(f"tensor '{name}' ({sch}) is not a bitsandbytes nf4 tensor")
    if len(shape) != 2 or not name.endswith(".weight"):
        raise UnrepresentableError(
            f"tensor '{name}' ({sch}, shape {list(shape)}): transformers loads bitsandbytes 4-bit data only into "
            "the 2-D weight of a Linear layer (M.weight); keep it in float (--keep) or write single files with "
            "qcore convert")
    return "nf4", False, "uint8"


def model_config(tensors: Mapping[str, tuple[Any, tuple[int, ...]]]) -> dict | None:
    """transformers' `BitsAndBytesConfig(...).to_dict()` for a model whose tensors are
    {name: (scheme or None, shape)} as `write` writes them; None when none is quantized."""
    settings = {n: _setting(n, s, shape) for n, (s, shape) in tensors.items() if s is not None}
    if not settings:
        return None
    quant_type, double_quant, storage = one_setting(
        settings, "bitsandbytes", lambda st: f"bnb_4bit_quant_type {st[0]}, double quant {st[1]}, storage {st[2]}")
    return {"quant_method": "bitsandbytes", "_load_in_8bit": False, "_load_in_4bit": True,
            "llm_int8_threshold": 6.0, "llm_int8_skip_modules": skip_modules(tensors),
            "llm_int8_enable_fp32_cpu_offload": False, "llm_int8_has_fp16_weight": False,
            "bnb_4bit_quant_type": quant_type, "bnb_4bit_use_double_quant": double_quant,
            "bnb_4bit_compute_dtype": "float32", "bnb_4bit_quant_storage": storage,
            "load_in_4bit": True, "load_in_8bit": False}


class BnbNF4Format(Format):
    name = "bitsandbytes"
    description = "bitsandbytes 4-bit state dict (nf4, optional double quant on read)"
    priority = 30

    def check(self, name: str, value: Tensor) -> Support:
        if isinstance(value, QuantizedData):
            return _write_check(value)
        return array_support(value)

    def model_config(self, tensors: Mapping[str, tuple[Any, tuple[int, ...]]]) -> dict | None:
        return model_config(tensors)

    def write(self, path: PathLike, contents: Contents) -> None:
        self.require(contents)
        meta = dict(contents.metadata)
        dtypes = pop_json(meta, DTYPES_KEY)
        meta.setdefault("format", "pt")
        arrays: dict[str, np.ndarray] = {}
        for name, value in contents.tensors.items():
            if isinstance(value, QuantizedData):
                arrays.update(_write_tensor(name, value, str(dtypes.get(name, "float32"))))
            else:
                arrays[name] = value
        write_arrays(path, arrays, meta)

    def detect(self, probe: Probe) -> bool:
        return any(STATE_SUFFIX in n for n in probe.tensor_names)

    def read(self, path: PathLike) -> Contents:
        arrays, meta = read_arrays(path)
        weights = {k.split(STATE_SUFFIX)[0]: k for k in arrays if STATE_SUFFIX in k}
        owned = {w + s for w in weights for s in _PARTS} | set(weights.values())
        tensors: dict[str, Tensor] = {}
        dtypes = {}
        refused: dict[str, str] = {}
        for key, arr in arrays.items():
            if key in owned:
                continue
            if key not in weights:
                tensors[key] = arr
                continue
            st = _state(arrays[weights[key]], f"{path}: '{weights[key]}'")
            try:
                tensors[key] = _tensor(arrays, key, st)
            except _SignsFlipped as e:  # bitsandbytes' own decode, cast to the layer's dtype as it does
                layer = _LAYER_DTYPES.get(str(st.get("dtype", "float32")), np.dtype(np.float32))
                tensors[key] = e.values.reshape(_shape(st)).astype(layer)
                refused[key] = f"{path}: bitsandbytes tensor '{key}': {e}"
            except (KeyError, InvalidDataError, UnrepresentableError) as e:
                what = f"lacks {e}" if isinstance(e, KeyError) else str(e)
                raise (InvalidDataError if isinstance(e, KeyError) else type(e))(
                    f"{path}: bitsandbytes tensor '{key}': {what}") from None
            dtypes[key] = str(st.get("dtype", "float32"))
        missing = sorted(set(weights) - set(tensors))
        if missing:
            raise InvalidDataError(
                f"{path}: '{weights[missing[0]]}' describes tensor '{missing[0]}', which the file lacks")
        if dtypes:
            meta = {**meta, DTYPES_KEY: json.dumps(dtypes, sort_keys=True)}
        return Contents(tensors, meta, self.name, refused=refused)
