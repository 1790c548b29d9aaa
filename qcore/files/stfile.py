"""safetensors files: the one dtype table, header checks, readers and writers.

The format is an 8-byte little-endian header length N, N bytes of JSON header
(`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}`, offsets
relative to the end of the header, tensors back to back), then the tensor bytes.

- `ST_DTYPES`: safetensors dtype name <-> numpy dtype (`st_dtype`, `np_dtype`), for every reader
  and writer of qcore;
- `read_arrays`: a small file's tensors as numpy, its header checked by safetensors' own parser
  (`open_checked`); `write_arrays`: numpy arrays to a file, atomically, its `__metadata__` in
  sorted order, so equal inputs give equal files;
- `Reader`: a header parsed and checked here, and each tensor read straight into a fresh numpy
  array (`readinto`, one copy out of the page cache), for bounded memory on whole models;
- `StreamWriter`: the header's room reserved up front (`header_room`), tensors written as they
  come, the header filled in (padded with spaces, which JSON ignores) when the last one is written;
- `read_header` / `rewrite_header`: a header read as it is and rewritten in place at its length.

safetensors' own reader loads what `StreamWriter` writes (tests/model/test_model.py checks it bit for bit).
"""
from __future__ import annotations

import json
import math
import os
import reprlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from qcore.errors import InputError, InvalidDataError, QCoreError, StorageError
from qcore.files.paths import PathLike, atomic_write, check_input_path

__all__ = ["ST_DTYPES", "MAX_HEADER", "st_dtype", "np_dtype", "storable", "header_length", "read_header",
           "rewrite_header", "open_checked", "read_arrays", "write_arrays", "TensorHead", "Reader", "StreamWriter",
           "header_room"]

# safetensors dtype name -> numpy dtype (ml_dtypes for bfloat16 and the float8 types)
ST_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16), "I16": np.dtype(np.int16), "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32), "U64": np.dtype(np.uint64), "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16), "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "C64": np.dtype(np.complex64),
}
_BY_NP = {v: k for k, v in ST_DTYPES.items()}
_NUMPY_LACKS = frozenset({"F8_E4M3", "F8_E5M2", "F8_E8M0"})
"""dtypes whose numpy type lives in ml_dtypes and that safetensors' numpy loader cannot build:
`read_arrays` reads their bytes with `Reader`."""
MAX_HEADER = 100_000_000
"""The longest header safetensors reads, in bytes."""
_INT64_MAX = 2 ** 63 - 1
_CHUNK = 64 << 20
_METADATA = "__metadata__"


def _is_count(v: Any) -> bool:
    """A JSON integer in 0..2**63-1 (not a bool, float or string): a dimension or an offset."""
    return type(v) is int and 0 <= v <= _INT64_MAX


def _nbytes(dtype: str, shape: Sequence[int]) -> int:
    """Bytes of a tensor of `dtype` (a known safetensors name) and `shape`, in exact integers."""
    return math.prod(shape) * np_dtype(dtype).itemsize


def st_dtype(dtype: Any) -> str:
    """The safetensors name of a numpy dtype ("F32", "BF16", ...)."""
    dt = np.dtype(dtype)
    name = _BY_NP.get(dt)
    if name is None:
        name = next((k for k, v in ST_DTYPES.items() if v == dt), None)
    if name is None:
        raise InputError(f"dtype {dt} has no safetensors name; known: {', '.join(ST_DTYPES)}")
    return name


def np_dtype(name: str) -> np.dtype:
    """The numpy dtype of a safetensors dtype name."""
    try:
        return ST_DTYPES[name]
    except KeyError:
        raise InvalidDataError(
            f"safetensors dtype {name!r} is not one qcore reads; known: {', '.join(ST_DTYPES)}") from None


def storable(dtype: np.dtype) -> bool:
    """Whether safetensors stores arrays of `dtype` (numpy numbers and ml_dtypes' bfloat16/float8)."""
    return dtype.kind in "biufcV" and dtype.fields is None


# ------------------------------------------------------------------------------------------ header
def header_length(prefix: bytes, size: int, where: str) -> int:
    """N, the header length a file of `size` bytes starts with (`prefix`, its first 8 bytes),
    checked: the file holds it and safetensors reads it (`MAX_HEADER`); else InvalidDataError
    naming `where`."""
    if len(prefix) != 8:
        raise InvalidDataError(f"{where} is not a valid safetensors file: {size} bytes is too short for a header")
    n = int.from_bytes(prefix, "little")
    if n > min(MAX_HEADER, size - 8):
        raise InvalidDataError(f"{where} is not a valid safetensors file: header length {n} does not fit in a "
                               f"{size}-byte file")
    return n


def read_header(f: BinaryIO) -> tuple[int, dict] | None:
    """(header length, parsed header) of the safetensors file open at its start, or None when the
    header does not parse as a JSON object (nothing checked beyond that: see `Reader`)."""
    raw = f.read(8)
    n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
    text = f.read(n) if 0 < n <= min(MAX_HEADER, os.fstat(f.fileno()).st_size - 8) else b""
    try:
        head = json.loads(text.decode("utf-8")) if len(text) == n else None
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    return (n, head) if isinstance(head, dict) else None


def rewrite_header(f: BinaryIO, n: int, head: dict) -> bool:
    """Write `head` in compact JSON over the header of `n` bytes, padded with spaces as safetensors
    pads it, keeping every byte outside it; False (nothing written) when it would not fit."""
    new = json.dumps(head, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    if len(new) > n:
        return False
    f.seek(8)
    f.write(new + b" " * (n - len(new)))
    return True


def _sort_metadata(f: BinaryIO) -> None:
    """Sort the `__metadata__` keys in place, so equal inputs give equal files.

    safetensors writes its metadata map in hash order; the rewrite keeps every byte outside the
    header and keeps the header's length, or leaves the file as it is.
    """
    found = read_header(f)
    if found is None or not isinstance(found[1].get(_METADATA), dict):
        return
    n, head = found
    head[_METADATA] = dict(sorted(head[_METADATA].items()))
    rewrite_header(f, n, head)


# ------------------------------------------------------------------------------- small files
def open_checked(path: PathLike) -> Any:
    """safetensors' own reader (`safe_open`, numpy) on `path`, its header checked by it; a bad
    file is one InvalidDataError, an unreadable one a StorageError, each naming the path."""
    p = check_input_path(path)
    try:
        return safe_open(p, framework="np")
    except SafetensorError as e:
        raise InvalidDataError(f"{p} is not a valid safetensors file: {' '.join(str(e).split())}") from None
    except OSError as e:
        raise StorageError(e.errno, f"cannot read {p}: {e.strerror or e}", p) from None
    except Exception as e:  # the Rust layer raises a few other types on bad headers
        raise InvalidDataError(f"{p} is not a valid safetensors file: {e}") from None


def read_arrays(path: PathLike, check: Callable[[dict[str, str], list[str]], Any] | None = None
                ) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Every tensor of one safetensors file as numpy, in file order, and its `__metadata__`
    (`open_checked`). `check(metadata, names)` runs on the header before any tensor is read."""
    p = os.fspath(path)
    out: dict[str, np.ndarray] = {}
    raw: Reader | None = None  # for the float8 tensors safetensors' numpy loader cannot make
    try:
        with open_checked(p) as f:
            meta = dict(f.metadata() or {})
            names = list(f.keys())
            if check is not None:
                check(meta, names)
            for name in names:
                try:
                    if str(f.get_slice(name).get_dtype()) in _NUMPY_LACKS:
                        raw = raw or Reader(p)
                        out[name] = raw.read(name)
                    else:
                        out[name] = f.get_tensor(name)
                except QCoreError:
                    raise
                except Exception as e:
                    raise InvalidDataError(f"{p}: cannot read tensor '{name}': {e}") from None
    finally:
        if raw is not None:
            raw.close()
    return out, meta


def write_arrays(path: PathLike, arrays: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None
                 ) -> None:
    """Write numpy arrays to a safetensors file atomically (`qcore.files.paths.atomic_write`), with
    str -> str metadata in sorted order (equal inputs, equal bytes)."""
    for name, a in arrays.items():
        if not storable(a.dtype):
            raise InputError(f"tensor '{name}' has dtype {a.dtype}, which safetensors cannot store")
    data = {k: np.ascontiguousarray(v).reshape(np.shape(v)) for k, v in arrays.items()}  # 0-d stays 0-d
    meta = dict(metadata or {}) or None
    atomic_write(path, lambda tmp: save_file(data, tmp, metadata=meta), _sort_metadata)


# ----------------------------------------------------------------------------------- streaming
@dataclass(frozen=True)
class TensorHead:
    """One tensor as a header describes it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class Reader:
    """A safetensors file's header, and its tensors read one at a time into fresh arrays."""

    def __init__(self, path: PathLike):
        self.path = os.fspath(path)
        self._f: BinaryIO = open(self.path, "rb", buffering=0)
        try:
            self.header_bytes, self.tensors, self.metadata = self._parse()
        except BaseException:
            self._f.close()
            raise

    def _bad(self, why: str) -> InvalidDataError:
        return InvalidDataError(f"{self.path} is not a valid safetensors file: {why}")

    def _parse(self) -> tuple[bytes, dict[str, TensorHead], dict[str, str]]:
        size = os.fstat(self._f.fileno()).st_size
        n = header_length(self._f.read(8), size, self.path)
        text = self._f.read(n)
        try:
            head = json.loads(text.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise self._bad(f"header is not JSON ({e})") from None
        if not isinstance(head, dict):
            raise self._bad("header is not a JSON object")
        meta = head.pop(_METADATA, None) or {}
        if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
            raise self._bad("__metadata__ must map str -> str")
        self._start = 8 + n
        tensors: dict[str, TensorHead] = {}
        for name, e in head.items():
            t = self._head(name, e)
            if not t.end <= size - self._start or t.nbytes != _nbytes(t.dtype, t.shape):
                raise self._bad(f"tensor '{name}' ({t.dtype} {list(t.shape)}, {_nbytes(t.dtype, t.shape)} bytes) "
                                f"has data_offsets [{t.begin}, {t.end}] in {size - self._start} data bytes")
            tensors[name] = t
        ordered = dict(sorted(tensors.items(), key=lambda kv: kv[1].begin))
        return text, ordered, meta

    def _head(self, name: str, e: Any) -> TensorHead:
        """One header entry checked for its types, as safetensors' own parser does: a known dtype
        name, a shape of ints in 0..2**63-1, two ordered int offsets; else InvalidDataError."""
        fields = e if isinstance(e, dict) else {}
        dtype, shape, offsets = fields.get("dtype"), fields.get("shape"), fields.get("data_offsets")
        if not (isinstance(dtype, str) and isinstance(shape, list) and all(_is_count(d) for d in shape)
                and isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
            raise self._bad(f"tensor '{name}' needs a dtype name, a shape of ints and two int data_offsets "
                            f"(each 0..2**63-1), got {reprlib.repr(e)}")
        if dtype not in ST_DTYPES:
            raise self._bad(f"tensor '{name}' has dtype {dtype!r}, not one qcore reads; known: {', '.join(ST_DTYPES)}")
        if math.prod(d for d in shape if d) * ST_DTYPES[dtype].itemsize > _INT64_MAX:
            raise self._bad(f"tensor '{name}' has shape {shape}: no array of it can be indexed (its dimensions "
                            "other than 0 multiply past 2**63-1 bytes)")
        begin, end = offsets
        if begin > end:
            raise self._bad(f"tensor '{name}' has data_offsets [{begin}, {end}]: the end is before the start")
        return TensorHead(name, dtype, tuple(shape), begin, end)

    def read(self, name: str) -> np.ndarray:
        """Tensor `name` as a new numpy array (its own dtype and shape)."""
        t = self.tensors[name]
        arr = np.empty(t.shape, dtype=np_dtype(t.dtype))
        view = memoryview(arr.reshape(-1).view(np.uint8))
        pos, got = self._start + t.begin, 0
        while got < t.nbytes:
            n = os.preadv(self._f.fileno(), [view[got:got + _CHUNK]], pos + got) if hasattr(os, "preadv") \
                else self._pread(view[got:got + _CHUNK], pos + got)
            if n <= 0:
                raise self._bad(f"tensor '{name}' ends past the end of the file")
            got += n
        return arr

    def _pread(self, buf: memoryview, offset: int) -> int:  # pragma: no cover - platforms without preadv
        data = os.pread(self._f.fileno(), len(buf), offset)
        buf[:len(data)] = data
        return len(data)

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _entry(dtype: str, shape: Sequence[int], begin: int, end: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": [int(d) for d in shape], "data_offsets": [begin, end]}


def _header_json(entries: Mapping[str, dict[str, Any]], metadata: Mapping[str, str]) -> bytes:
    head: dict[str, Any] = {_METADATA: dict(sorted(metadata.items()))} if metadata else {}
    head.update(entries)
    return json.dumps(head, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def header_room(planned: Iterable[tuple[str, str, Sequence[int]]], metadata: Mapping[str, str]) -> int:
    """Bytes to reserve for a header of these (name, dtype, shape) entries and metadata.

    Offsets are counted at 20 digits (any 64-bit offset), so the real header never needs more;
    rounded up to a multiple of 8 so the tensor bytes start aligned.
    """
    big = 10 ** 19
    entries = {name: _entry(dt, shape, big, big) for name, dt, shape in planned}
    n = len(_header_json(entries, metadata)) + 8
    return (n + 7) // 8 * 8


class StreamWriter:
    """Write one safetensors file tensor by tensor into an open binary file.

    `room` is the header's reserved size (`header_room`); tensors follow in the order they are
    added. `finish()` writes the header into its room. The caller owns atomicity (the file is a
    temporary one, see `qcore.files.paths.atomic_write`).
    """

    def __init__(self, f: BinaryIO, room: int):
        self._f = f
        self._room = room
        self._entries: dict[str, dict[str, Any]] = {}
        self._pos = 0
        f.seek(8 + room)

    def add(self, name: str, array: np.ndarray | Sequence[np.ndarray]) -> None:
        """Append `array` (numpy, C order) under `name`; a list of arrays is written back to back
        as one U8 tensor of their bytes (a payload in its parts, `Backend.payload_parts`)."""
        if name in self._entries or name == _METADATA:
            raise InputError(f"tensor name '{name}' is used twice or reserved in one safetensors file")
        if isinstance(array, np.ndarray):
            a = array if array.flags.c_contiguous else array.copy(order="C")  # (keeps 0-d arrays 0-d)
            parts, dtype, shape = [a], st_dtype(a.dtype), a.shape
        else:
            parts = [np.ascontiguousarray(p) for p in array]
            dtype, shape = "U8", (sum(p.nbytes for p in parts),)
        n = 0
        for a in parts:
            if a.nbytes:
                self._f.write(memoryview(a.reshape(-1).view(np.uint8)))
            n += a.nbytes
        self._entries[name] = _entry(dtype, shape, self._pos, self._pos + n)
        self._pos += n

    def finish(self, metadata: Mapping[str, str]) -> None:
        """Write the header (entries in the order added, metadata sorted) into the reserved room."""
        text = _header_json(self._entries, metadata)
        if len(text) > self._room:
            raise InputError(f"safetensors header of {len(text)} bytes exceeds the {self._room} bytes reserved "
                             "for it (the plan named fewer tensors or less metadata than were written)")
        self._f.seek(0)
        self._f.write(self._room.to_bytes(8, "little"))
        self._f.write(text + b" " * (self._room - len(text)))
        self._f.seek(8 + self._room + self._pos)
