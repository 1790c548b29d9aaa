"""GGUF files (llama.cpp), through the `gguf` package's own reader and writer (pip install qcore-quant[formats]).

Quantized GGUF types with an exact qcore scheme (facts from gguf 0.19.0 `quants.py`):

- **Q8_0** -> `q8s/block32:f16` (`q8f/block32:f16` when a code is -128, which Q8S excludes). A
  block is `[d f16][32 x int8]`, value `int8 * f32(d)`: the same f32 product as the spec's
  dequantize once the f16 scales move from the blocks into their own section.
- **Q4_0** -> `q4f/block32:f16/signed` (docs/spec.md, signed scales; `q4f/block32:f16` when no
  scale is negative). A block is `[d f16][16 B]`, byte j holding element j (low nibble) and element
  j + 16 (high nibble) as `q + 8`; value `(nibble - 8) * f32(d)`, where llama.cpp's `d = max / -8`
  is negative whenever the block's extreme is positive. `nibble ^ 8` is the Q4F code; the nibbles
  move to the byte layout's order (element 2k low). Any 4-bit integer scheme with f16 blocks of 32
  along the last axis writes as Q4_0 (its codes are within Q4F's); the `q4_0` preset quantizes as
  llama.cpp does, bit for bit, but for near-zero blocks (docs/formats.md).
- **Q4_1** -> `u4/block32:f16/min:f16` (docs/spec.md, affine offsets). A block is
  `[d f16][m f16][16 B]`, the nibbles unsigned codes in Q4_0's split-half order; value
  `f32(q * f32(d)) + f32(m)`, the affine offsets' MIN offset. The `q4_1` preset quantizes as
  llama.cpp does, bit for bit, but for near-zero blocks: where `f32(1 / s)` of the raw scale
  overflows (`0 < s <= 2^-128`), gguf's codes are casts of ±inf/NaN (undefined in C) and qcore's
  its rule's; both decode to zeros (the same holds for the `q8_0` and `q4_0` presets).
- **MXFP4** -> `mxfp4`. A block is `[e u8][16 B]` where byte j holds element j (low nibble) and
  element j + 16 (high nibble); value = doubled E2M1 * 2^(e - 128) = E2M1 * 2^(e - 127), including
  e = 0 and 1 (`ggml_e8m0_to_fp32_half`). Nibble j is the E2M1 code itself; only the order moves.
  One difference in sign only: ggml's doubled table gives code 8 (E2M1 -0) as +0.0, SPEC as -0.0.

Blocks run along GGUF's first dimension (ne[0], the row), which is numpy's (and qcore's) last axis,
so the block grid is qcore's `block32` on the last axis. Float and integer tensors (F32, F16, BF16,
F64, I8..I64) pass through as numpy arrays. Every other type (Q5_x, K-quants, IQ*, ...) is
refused: qcore has no 5-bit values, no super-blocks and no codebooks. Key-value metadata is kept as JSON under `gguf.kv`, so GGUF -> qcore -> GGUF restores it;
a checkpoint's other metadata travels in GGUF string keys `qcore.metadata.<key>`.

`gguf.kv` is read back from whatever file the checkpoint came from, so the writer checks it before
writing a byte: every entry `[key, type, item type or null, value]` must be a value of the GGUF type
it names (in range, a UTF-8 string, a list of one item type), each key once, `general.architecture`
a STRING and `general.alignment` a UINT32 power of two of at most 65536 (it pads every tensor, and
gguf's own writer would pad to any UINT32 it is given); anything else is an `InvalidDataError`
naming the key. An empty array is left out, as gguf's `add_array` leaves it out (its writer
cannot pack one; gguf's reader reads one with no item type).
"""
from __future__ import annotations

import json
import mmap
import os
import struct
from typing import Any, Mapping

import ml_dtypes
import numpy as np

from qcore.files.paths import atomic_write
from qcore.errors import InvalidDataError
from qcore.spec.payload import QuantizedData
from qcore.backend.protocol import Support
from qcore.spec.schemes import QuantScheme, ScaleDtype, scheme as parse_scheme
from qcore.formats import _mx, gguf_model
from qcore.formats.base import Contents, Format, PathLike, Probe, Tensor, UnrepresentableError, parse_json, short_repr

__all__ = ["GGUFFormat"]

KV_KEY = "gguf.kv"      # JSON list of [key, value type, array item type or null, value]
META_PREFIX = "qcore.metadata."   # GGUF string keys holding the other str -> str metadata of a checkpoint
Q8_SCHEMES = (parse_scheme("q8s/block32:f16"), parse_scheme("q8f/block32:f16"))
Q4_SCHEMES = (parse_scheme("q4f/block32:f16/signed"), parse_scheme("q4f/block32:f16"))
"""Q4_0 is read as the first, or the second when no scale is negative."""
_MAX_DIMS = 4           # GGML_MAX_DIMS
_MAX_NAME = 64          # GGML_MAX_NAME, the terminating NUL included
_QUANTIZATION_VERSION = 2
MAX_ALIGNMENT = 1 << 16
"""The largest `general.alignment` written: every tensor is padded to it (gguf's default is 32)."""
_NUMBERS = {"UINT8": "B", "INT8": "b", "UINT16": "H", "INT16": "h", "UINT32": "I", "INT32": "i",
            "UINT64": "Q", "INT64": "q", "FLOAT32": "f", "FLOAT64": "d"}
"""GGUF's numeric value types and their `struct` formats (gguf's `GGUFWriter._simple_value_packing`)."""
_VALUE_TYPES = (*_NUMBERS, "BOOL", "STRING", "ARRAY")
_INSTALL = "the gguf package is not installed; pip install 'qcore-quant[formats]' (or gguf)"

# numpy dtype <-> GGUF plain type (by name, so importing this module does not need gguf)
_PLAIN = {
    "F32": np.dtype(np.float32), "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16),
    "F64": np.dtype(np.float64), "I8": np.dtype(np.int8), "I16": np.dtype(np.int16),
    "I32": np.dtype(np.int32), "I64": np.dtype(np.int64),
}


def _gguf():
    try:
        import gguf
    except ImportError:
        raise UnrepresentableError(_INSTALL) from None
    return gguf


def _q8_read(raw: np.ndarray, shape: tuple[int, ...]) -> QuantizedData:
    blocks = raw.reshape(-1, 34)
    codes = np.ascontiguousarray(blocks[:, 2:])
    scales = np.ascontiguousarray(blocks[:, :2])
    sch = Q8_SCHEMES[1] if (codes.view(np.int8) == -128).any() else Q8_SCHEMES[0]
    return QuantizedData(shape, sch, codes.tobytes() + scales.tobytes())


def _q8_write(d: QuantizedData) -> np.ndarray:
    n = d.shape[-1] // 32
    nblocks = int(np.prod(d.shape[:-1], dtype=np.int64)) * n
    raw = np.frombuffer(d.payload, np.uint8)
    codes = raw[: nblocks * 32].reshape(nblocks, 32)
    scales = raw[nblocks * 32:].reshape(nblocks, 2)
    return np.concatenate([scales, codes], axis=1).reshape(*d.shape[:-1], n * 34)


def _q4_read(raw: np.ndarray, shape: tuple[int, ...]) -> QuantizedData:
    blocks = raw.reshape(-1, 18)
    d = blocks[:, :2]
    nib = _split_halves(blocks[:, 2:]) ^ np.uint8(8)                                      # Q4F codes, 0..31
    packed = nib[:, 0::2] | (nib[:, 1::2] << np.uint8(4))                                 # byte layout: 2k low
    signed = (d.view("<u2") & np.uint16(0x8000)).any()
    return QuantizedData(shape, Q4_SCHEMES[0 if signed else 1], packed.tobytes() + np.ascontiguousarray(d).tobytes())


def _q4_fits(s: QuantScheme) -> bool:
    """A 4-bit integer scheme with one f16 scale per 32 elements of the last axis: Q4_0 holds it."""
    b = s.block
    return (s.bits == 4 and not s.traits.is_float and not s.traits.unsigned and not s.is_lookup and not s.affine
            and s.tensor is None and b is not None and b.dims == (32,) and b.dtype is ScaleDtype.F16)


def _q41_fits(s: QuantScheme) -> bool:
    """u4 with one f16 scale and one f16 min offset per 32 elements of the last axis: Q4_1 holds it."""
    return s.value.value == "u4" and s.tensor is None and s.block is not None and s.block.dims == (32,) \
        and s.block.dtype is ScaleDtype.F16 and s.offset is not None and str(s.offset) == "min:f16"


def _q4_write(d: QuantizedData) -> np.ndarray:
    nib = (d.codes().reshape(-1, 32).view(np.uint8) & np.uint8(0x0F)) ^ np.uint8(8)   # Q4F code -> q + 8
    qs = _join_halves(nib)
    scales = d.scales().reshape(-1, 1).astype(np.float16).view(np.uint8)              # exact: f16 values, -0 kept
    return np.concatenate([scales, qs], axis=1).reshape(*d.shape[:-1], d.shape[-1] // 32 * 18)


Q4_1_SCHEME = parse_scheme("u4/block32:f16/min:f16")


def _split_halves(qs: np.ndarray) -> np.ndarray:
    """ggml's 16 bytes of 32 nibbles (byte j: element j low, element j + 16 high) -> the 32 fields."""
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=1)


def _join_halves(nib: np.ndarray) -> np.ndarray:
    """32 fields per row -> ggml's 16 bytes (inverse of `_split_halves`)."""
    return nib[:, :16] | (nib[:, 16:] << np.uint8(4))


def _q41_read(raw: np.ndarray, shape: tuple[int, ...]) -> QuantizedData:
    blocks = raw.reshape(-1, 20)
    nib = _split_halves(blocks[:, 4:])
    packed = nib[:, 0::2] | (nib[:, 1::2] << np.uint8(4))                                  # byte layout: 2k low
    d, m = np.ascontiguousarray(blocks[:, :2]), np.ascontiguousarray(blocks[:, 2:4])
    return QuantizedData(shape, Q4_1_SCHEME, packed.tobytes() + d.tobytes() + m.tobytes())


def _q41_write(d: QuantizedData) -> np.ndarray:
    qs = _join_halves(d.codes().reshape(-1, 32))
    f16 = [a.reshape(-1, 1).astype(np.float16).view(np.uint8) for a in (d.scales(), d.offsets())]  # exact
    return np.concatenate([*f16, qs], axis=1).reshape(*d.shape[:-1], d.shape[-1] // 32 * 20)


def _mx_read(raw: np.ndarray, shape: tuple[int, ...]) -> QuantizedData:
    blocks = raw.reshape(-1, 17)
    e, qs = blocks[:, 0], blocks[:, 1:]
    codes = _split_halves(qs)                                                  # elements 0..15, 16..31
    packed = codes[:, 0::2] | (codes[:, 1::2] << np.uint8(4))                  # byte layout: element 2k low
    lead = (*shape[:-1], shape[-1] // 32)
    return _mx.join(packed.reshape(*lead, 16), e.reshape(lead))


def _mx_write(d: QuantizedData) -> np.ndarray:
    packed, e = _mx.split(d)
    packed = packed.reshape(-1, 16)
    codes = np.empty((packed.shape[0], 32), np.uint8)
    codes[:, 0::2], codes[:, 1::2] = packed & np.uint8(0x0F), packed >> np.uint8(4)
    qs = _join_halves(codes)
    blocks = np.concatenate([e.reshape(-1, 1), qs], axis=1)
    return blocks.reshape(*d.shape[:-1], d.shape[-1] // 32 * 17)


def _encode(value: Tensor, T: Any) -> tuple[np.ndarray, Any]:
    """A tensor as GGUF data (rows first: numpy's first axis) and its GGML type; None for a plain
    dtype gguf's writer maps itself, BF16 as its uint16 words."""
    if isinstance(value, QuantizedData):
        if value.scheme.payload_form in Q8_SCHEMES:
            return _q8_write(value), T.Q8_0
        if _q4_fits(value.scheme):
            return _q4_write(value), T.Q4_0
        if _q41_fits(value.scheme):
            return _q41_write(value), T.Q4_1
        return _mx_write(value), T.MXFP4
    kind = next(k for k, dt in _PLAIN.items() if dt == value.dtype)
    data = np.ascontiguousarray(value)
    return (data.view(np.uint16), T.BF16) if kind == "BF16" else (data, None)


def _is_value(vtype: str, value: Any) -> bool:
    """Whether `value` (from JSON) is a value of GGUF scalar or STRING type `vtype` that gguf's
    writer packs as it is: a UTF-8 encodable str, a bool, or a number in the type's range."""
    if vtype == "STRING":
        if not isinstance(value, str):
            return False
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate, which JSON's \uXXXX escapes can spell
            return False
        return True
    if vtype == "BOOL":
        return isinstance(value, bool)
    fmt = _NUMBERS.get(vtype)
    if fmt is None or isinstance(value, bool) or not isinstance(value, int if fmt not in "fd" else (int, float)):
        return False
    try:
        struct.pack("<" + fmt, value)
    except (struct.error, OverflowError):
        return False
    return True


def _kv_entry(what: str, i: int, entry: Any) -> tuple[str, str, str | None, Any]:
    """One checked entry `[key, type, item type or null, value]` of `gguf.kv`."""
    if not (isinstance(entry, list) and len(entry) == 4 and isinstance(entry[0], str) and entry[0]
            and _is_value("STRING", entry[0])):
        raise InvalidDataError(f"{what}: entry {i} must be [key, type, item type or null, value] with a non-empty "
                               f"UTF-8 key, got {short_repr(entry)}")
    key, vtype, sub, value = entry
    where = f"{what}: key {short_repr(key)}"
    if vtype not in _VALUE_TYPES:
        raise InvalidDataError(f"{where}: unknown GGUF value type {short_repr(vtype)}; expected one of "
                               f"{', '.join(_VALUE_TYPES)}")
    if vtype != "ARRAY":
        if not _is_value(vtype, value):
            raise InvalidDataError(f"{where}: {short_repr(value)} is not a GGUF {vtype} value")
        return key, vtype, None, value
    if not isinstance(value, list):
        raise InvalidDataError(f"{where}: an ARRAY value must be a JSON list, got {short_repr(value)}")
    if value and (sub not in _VALUE_TYPES or sub == "ARRAY"):
        raise InvalidDataError(f"{where}: item type {short_repr(sub)} is not a GGUF scalar or STRING type "
                               "(qcore carries no nested arrays)")
    bad = next((j for j, x in enumerate(value) if not _is_value(sub, x)), None)
    if bad is not None:
        raise InvalidDataError(f"{where}: item {bad}, {short_repr(value[bad])}, is not a GGUF {sub} value")
    return key, vtype, sub, value


def _kv_entries(metadata: Mapping[str, str]) -> list[tuple[str, str, str | None, Any]]:
    """The GGUF key-value pairs that metadata `gguf.kv` carries (JSON written by `read`, but read
    back from any file), each checked to be what gguf's writer packs as it claims, before anything
    is written; an empty array is left out, as gguf's `add_array` does."""
    what = f"metadata '{KV_KEY}'"
    kv = parse_json(metadata.get(KV_KEY, "[]"), what)
    if not isinstance(kv, list):
        raise InvalidDataError(f"{what} must be a JSON list of [key, type, item type or null, value], "
                               f"got {short_repr(kv)}")
    out: list[tuple[str, str, str | None, Any]] = []
    seen: set[str] = set()
    for i, entry in enumerate(kv):
        key, vtype, sub, value = _kv_entry(what, i, entry)
        where = f"{what}: key {short_repr(key)}"
        if key in seen:
            raise InvalidDataError(f"{where} appears twice; a GGUF file holds each key once")
        seen.add(key)
        if key == "general.architecture" and vtype != "STRING":
            raise InvalidDataError(f"{where} must be a STRING, got {vtype}")
        if key == "general.alignment":
            if vtype != "UINT32":  # gguf's reader and llama.cpp read it as UINT32 only
                raise InvalidDataError(f"{where} must be a UINT32 (as gguf's reader and llama.cpp read it), "
                                       f"got {vtype}")
            if value & (value - 1) or not 1 <= value <= MAX_ALIGNMENT:
                raise InvalidDataError(f"{where} must be a power of two from 1 to {MAX_ALIGNMENT} (gguf's default "
                                       f"is 32), got {value}; drop it to use the default")
        if vtype == "ARRAY" and not value:
            continue
        out.append((key, vtype, sub, value))
    return out


def _jsonable(v: Any) -> Any:
    if isinstance(v, (bytes, bytearray)):
        return v.decode("utf-8", "replace")
    if isinstance(v, list):
        return [_jsonable(x) for x in v]
    return v


# GGUF value types (gguf's GGUFValueType numbers) -> bytes of one scalar; STRING (8) is a u64 length
# and its bytes, ARRAY (9) a u32 item type, a u64 count and the items.
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_LEAST_BYTES = {**_SCALAR_BYTES, _STRING: 8, _ARRAY: 12}  # the fewest bytes one item of a type takes


def check_kv_bounds(path: str) -> None:
    """Walk a little-endian GGUF file's key/value section with every length and count checked
    against the bytes left (an array's count times its items' fewest bytes included), before
    gguf's reader, which builds a part per claimed item; `InvalidDataError` naming the key and
    the count otherwise. Files of another byte order or a short header are left to the reader."""
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size < 24:
            return
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            magic, version, _n_tensors, n_kv = struct.unpack_from("<4sIQQ", mm, 0)
            if magic != b"GGUF" or not 1 <= version <= 0xFFFF:
                return
            pos = 24

            def need(n: int, what: str) -> None:
                if n < 0 or n > size - pos:
                    raise InvalidDataError(f"{path}: {what} needs {n} bytes at offset {pos}, the file has "
                                           f"{max(0, size - pos)} left (a count or length past the end)")

            def u(fmt: str, what: str) -> int:
                nonlocal pos
                need(struct.calcsize(fmt), what)
                (v,) = struct.unpack_from(fmt, mm, pos)
                pos += struct.calcsize(fmt)
                return v

            def value(vtype: int, key: str, depth: int) -> None:
                nonlocal pos
                if vtype in _SCALAR_BYTES:
                    need(_SCALAR_BYTES[vtype], f"key {key!r}")
                    pos += _SCALAR_BYTES[vtype]
                elif vtype == _STRING:
                    n = u("<Q", f"key {key!r} string length")
                    need(n, f"key {key!r} string of {n} bytes")
                    pos += n
                elif vtype == _ARRAY and depth < 2:
                    item = u("<I", f"key {key!r} array type")
                    count = u("<Q", f"key {key!r} array count")
                    if item not in _LEAST_BYTES:
                        raise InvalidDataError(f"{path}: key {key!r} is an array of unknown value type {item}")
                    if count > (size - pos) // _LEAST_BYTES[item]:
                        raise InvalidDataError(f"{path}: key {key!r} claims an array of {count} items, more than "
                                               f"the {size - pos} bytes left can hold")
                    if item in _SCALAR_BYTES:
                        pos += count * _SCALAR_BYTES[item]
                    else:
                        for _ in range(count):
                            value(item, key, depth + 1)
                else:
                    raise InvalidDataError(f"{path}: key {key!r} has value type {vtype}, which GGUF does not define")

            if n_kv > (size - pos) // 13:  # a key/value takes at least 13 bytes
                raise InvalidDataError(f"{path}: claims {n_kv} key/values, more than the file can hold")
            for _ in range(n_kv):
                n = u("<Q", "a key's length")
                need(n, f"a key of {n} bytes")
                key = bytes(mm[pos:pos + min(n, 200)]).decode("utf-8", "replace")
                pos += n
                value(u("<I", f"key {key!r} value type"), key, 0)


class GGUFFormat(Format):
    name = "gguf"
    description = "GGUF (llama.cpp): Q8_0, Q4_0, Q4_1 and MXFP4 tensors exactly, F32/F16/BF16/ints as they are"
    priority = 20

    def available(self) -> Support:
        try:
            import gguf  # noqa: F401
        except ImportError:
            return Support.no(_INSTALL)
        return Support.yes()

    def detect(self, probe: Probe) -> bool:
        return probe.magic[:4] == b"GGUF"

    # ------------------------------------------------------------------------------ read
    def read(self, path: PathLike) -> Contents:
        gguf = _gguf()
        p = os.fspath(path)
        check_kv_bounds(p)  # gguf's reader walks every claimed array item: counts checked first
        try:
            reader = gguf.GGUFReader(p)
        except Exception as e:  # the reader raises ValueError/struct errors on a bad file
            raise InvalidDataError(f"{p} is not a readable GGUF file: {type(e).__name__}: {e}") from None
        if reader.byte_order == "S":
            raise UnrepresentableError(f"{p} is a big-endian GGUF file; qcore reads little-endian GGUF only")
        T = gguf.GGMLQuantizationType
        kv = []
        meta: dict[str, str] = {}
        for key, f in reader.fields.items():
            if key.startswith("GGUF."):
                continue
            try:
                value = f.contents()
            except UnicodeDecodeError:
                raise InvalidDataError(f"{p}: key '{key}' holds a string that is not UTF-8 (GGUF strings are "
                                       "UTF-8)") from None
            if key.startswith(META_PREFIX) and f.types and f.types[0].name == "STRING":
                meta[key[len(META_PREFIX):]] = value
                continue
            types = [t.name for t in f.types]
            sub = types[-1] if types[0] == "ARRAY" else None
            if types[0] == "ARRAY" and len(types) > 2:
                raise UnrepresentableError(f"{p}: key '{key}' is a nested array, which qcore does not carry")
            kv.append([key, types[0], sub, _jsonable(value)])
        tensors: dict[str, Tensor] = {}
        for t in reader.tensors:
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            kind = t.tensor_type
            raw = np.asarray(t.data)
            try:
                if kind == T.Q8_0:
                    tensors[t.name] = _q8_read(raw.view(np.uint8), shape)
                elif kind == T.Q4_0:
                    tensors[t.name] = _q4_read(raw.view(np.uint8), shape)
                elif kind == T.Q4_1:
                    tensors[t.name] = _q41_read(raw.view(np.uint8), shape)
                elif kind == T.MXFP4:
                    tensors[t.name] = _mx_read(raw.view(np.uint8), shape)
                elif kind.name in _PLAIN:
                    tensors[t.name] = np.ascontiguousarray(raw).view(_PLAIN[kind.name]).reshape(shape)
                else:
                    raise UnrepresentableError(
                        f"GGUF type {kind.name} has no exact qcore scheme (qcore reads Q8_0, Q4_0, Q4_1, MXFP4, "
                        "F32, F16, BF16, F64, I8..I64); requantize the model to one of them with llama.cpp first"
                    )
            except (InvalidDataError, UnrepresentableError) as e:
                raise type(e)(f"{p}: tensor '{t.name}': {e}") from None
        return Contents(tensors, {**meta, KV_KEY: json.dumps(kv)}, self.name)

    # ----------------------------------------------------------------------------- write
    def check(self, name: str, value: Tensor) -> Support:
        if len(name.encode("utf-8")) >= _MAX_NAME:
            return Support.no(f"GGUF tensor names are shorter than {_MAX_NAME} bytes; rename it")
        if len(value.shape) > _MAX_DIMS:
            return Support.no(f"GGUF tensors have at most {_MAX_DIMS} dims, got shape {list(value.shape)}")
        if isinstance(value, QuantizedData):
            if value.scheme.payload_form in Q8_SCHEMES:
                if value.shape[-1] % 32:
                    return Support.no(f"Q8_0 needs whole blocks of 32 along the last dim, got {list(value.shape)}")
                return Support.yes()
            kind = "Q4_0" if _q4_fits(value.scheme) else "Q4_1" if _q41_fits(value.scheme) else None
            if kind is not None:
                if value.shape[-1] % 32:
                    return Support.no(f"{kind} needs whole blocks of 32 along the last dim, got {list(value.shape)}")
                return Support.yes()
            if value.scheme.payload_form == _mx.MXFP4:
                return _mx.check(value, "GGUF MXFP4")
            return Support.no(
                f"GGUF holds qcore q8s/block32:f16 (Q8_0), 4-bit integers with f16 blocks of 32 such as "
                f"q4f/block32:f16/signed (Q4_0), u4/block32:f16/min:f16 (Q4_1) and mxfp4 (MXFP4) exactly, got "
                f"{value.scheme}; requantize to one of them (presets q8_0, q4_0, q4_1, mxfp4)"
            )
        if value.dtype not in _PLAIN.values():
            return Support.no(f"GGUF has no type for dtype {value.dtype}; cast it to float32")
        return Support.yes()

    def write(self, path: PathLike, contents: Contents) -> None:
        """Write every tensor; with `contents.folder` holding a config.json, as a model llama.cpp
        loads (`gguf_model`: its architecture's key/values, tokenizer and tensor names)."""
        gguf = _gguf()
        self.require(contents)
        T, V = gguf.GGMLQuantizationType, gguf.GGUFValueType
        model = gguf_model.plan(contents.folder, contents.tensors, gguf) if contents.folder else None
        kv = _kv_entries(contents.metadata)
        if model is not None:  # the model's own key/values replace those carried from another GGUF file
            kv = [e for e in kv if e[0] == "general.alignment"]
        arch = model.arch_name if model is not None else next((v for k, _, _, v in kv if k == "general.architecture"),
                                                             "qcore")
        alignment = next((v for k, _, _, v in kv if k == "general.alignment"), None)

        def write(tmp: str) -> None:
            w = gguf.GGUFWriter(tmp, arch)
            if alignment is not None:
                w.data_alignment = int(alignment)
            if model is not None:
                model.add_keys(w, gguf)
            for key, vtype, sub, value in kv:
                if key == "general.architecture":
                    continue
                w.add_key_value(key, value, V[vtype], V[sub] if sub else None)
            for key, value in sorted(contents.metadata.items()):
                if key != KV_KEY:
                    w.add_string(META_PREFIX + key, value)
            quantized = False
            for name, value in contents.tensors.items():
                if model is not None:
                    value = model.store(name, value)
                data, kind = _encode(value, T)
                quantized = quantized or isinstance(value, QuantizedData)
                if model is not None:
                    name, data = model.names[name], model.reorder(name, data)
                if kind is None:
                    w.add_tensor(name, data)   # the writer maps F16/F32/F64/I8..I64 from the dtype
                elif kind == T.BF16:
                    w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)
                else:
                    w.add_tensor(name, data, raw_dtype=kind)
            for name, data in (model.extra if model is not None else {}).items():
                w.add_tensor(name, data)
            if quantized and not any(k == "general.quantization_version" for k, *_ in kv):
                w.add_uint32("general.quantization_version", _QUANTIZATION_VERSION)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
            w.close()

        atomic_write(path, write)
