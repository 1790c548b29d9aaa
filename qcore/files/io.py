"""Quantized tensors in standard safetensors files (format described in `docs/format.md`).

A quantized tensor is stored as its portable payload (docs/spec.md, portable bytes) in a 1-D U8
tensor under its own name; the header's `__metadata__` (a flat str->str map) carries what is needed
to read it back:

    qcore.format_version   "1"
    qcore.<name>.scheme    canonical scheme text, e.g. "q4s/block32:f16"
    qcore.<name>.shape     the logical shape as a JSON list, e.g. "[384, 1536]"
    qcore.<name>.dtype     optional: the source dtype it was quantized from, e.g. "BF16"
    qcore.recipe           optional: the recipe that chose the schemes (JSON, see qcore.model.recipe)
    qcore.run              optional: the whole-model run marker `--resume` checks (qcore.model.plan)

Any other tensor (floats that were not quantized, integer buffers) is stored as it is. The
`qcore.` prefix of the metadata is reserved; other keys are the caller's own metadata.

Writes are atomic (`qcore.files.paths.atomic_write`): the file is built under a temporary name in
the target's directory, flushed to disk and moved over the target with `os.replace`, so an
interrupted write leaves nothing.
Files are deterministic: the same tensors and metadata give the same bytes, whichever backend
quantized them.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from qcore.backend.protocol import Backend, QTensor
from qcore.errors import InputError, InvalidDataError, QCoreError
from qcore.files.checkpoint import resolve
from qcore.files.paths import PathLike
from qcore.files.stfile import (ST_DTYPES, open_checked, read_arrays, read_header, rewrite_header, st_dtype, storable,
                                 write_arrays)
from qcore.spec.payload import QuantizedData, sections
from qcore.spec.parts import INT64_MAX
from qcore.spec.schemes import QuantScheme, scheme as parse_scheme

__all__ = [
    "FORMAT_VERSION",
    "VERSION_KEY",
    "Entry",
    "FileInfo",
    "save",
    "load",
    "load_data",
    "read_info",
    "scheme_key",
    "shape_key",
    "dtype_key",
    "RECIPE_KEY",
    "RUN_KEY",
]

FORMAT_VERSION = "1"
PREFIX = "qcore."
VERSION_KEY = "qcore.format_version"
_SCHEME, _SHAPE, _DTYPE = ".scheme", ".shape", ".dtype"
RECIPE_KEY = "qcore.recipe"
RUN_KEY = "qcore.run"
_GLOBAL_KEYS = (VERSION_KEY, RECIPE_KEY, RUN_KEY)
_RESERVED_NAME = "__metadata__"


def scheme_key(name: str) -> str:
    """Metadata key holding the scheme text of quantized tensor `name`."""
    return f"{PREFIX}{name}{_SCHEME}"


def shape_key(name: str) -> str:
    """Metadata key holding the logical shape (JSON list) of quantized tensor `name`."""
    return f"{PREFIX}{name}{_SHAPE}"


def dtype_key(name: str) -> str:
    """Metadata key holding the source dtype (safetensors name) quantized tensor `name` came from."""
    return f"{PREFIX}{name}{_DTYPE}"


# ---------------------------------------------------------------------------------------- save
def _check_utf8(text: str, what: str) -> None:
    """InputError unless `text` encodes as UTF-8, as a safetensors header (UTF-8 JSON) must: a
    lone surrogate, which JSON's "\\ud800" reads as, does not."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InputError(f"{what} is not UTF-8 text ({e.reason} at position {e.start}); a safetensors header is "
                         "UTF-8 JSON: drop or replace that character") from None


def _as_entry(name: Any, value: Any) -> QuantizedData | np.ndarray:
    if not isinstance(name, str) or not name:
        raise InputError(f"tensor names must be non-empty strings, got {name!r}")
    _check_utf8(name, f"tensor name {name[:80]!r}")
    if name == _RESERVED_NAME:
        raise InputError(f"'{_RESERVED_NAME}' is reserved by safetensors; rename that tensor")
    if isinstance(value, QTensor):
        return value.to_data()
    if isinstance(value, QuantizedData):
        return value
    if isinstance(value, np.ndarray):
        if not storable(value.dtype):
            raise InputError(f"tensor '{name}' has dtype {value.dtype}, which safetensors cannot store")
        return value if value.flags.c_contiguous else value.copy(order="C")  # keeps 0-d arrays 0-d
    raise InputError(
        f"tensor '{name}' is a {type(value).__name__}; save takes QTensor, QuantizedData or numpy "
        "arrays (convert device arrays with backend.to_numpy)"
    )


def _check_user_metadata(metadata: Any) -> dict[str, str]:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise InputError(f"metadata must be a dict of str -> str, got {type(metadata).__name__}")
    out: dict[str, str] = {}
    for k, v in metadata.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise InputError(f"metadata must map str -> str, got {k!r}: {v!r}")
        if k.startswith(PREFIX):
            raise InputError(f"metadata key {k!r} uses the reserved prefix '{PREFIX}'; pick another name")
        _check_utf8(k, "metadata key")
        _check_utf8(v, f"metadata value of key {k[:80]!r}")
        out[k] = v
    return out


def save(path: PathLike, tensors: Mapping[str, Any], metadata: Mapping[str, str] | None = None, *,
         source_dtypes: Mapping[str, Any] | None = None, recipe: str | None = None) -> None:
    """Write `tensors` (QTensor, QuantizedData or numpy arrays) to a safetensors file, atomically.

    Quantized tensors are written as their portable payload (U8) plus two metadata keys; numpy
    arrays are written unchanged. `metadata` is extra str->str header metadata (keys must not start
    with 'qcore.'). `source_dtypes` records the dtype each quantized tensor came from (so
    dequantizing restores it); `recipe` is the recipe's JSON. Nothing is written unless every
    tensor is valid.
    """
    if not isinstance(tensors, Mapping):
        raise InputError(f"save takes a dict of name -> tensor, got {type(tensors).__name__}")
    header = qcore_header({}, recipe)
    header.update(_check_user_metadata(metadata))
    arrays: dict[str, np.ndarray] = {}
    for name, value in tensors.items():
        entry = _as_entry(name, value)
        if isinstance(entry, QuantizedData):
            arrays[name] = np.frombuffer(entry.payload, dtype=np.uint8)
            header.update(quantized_keys(name, entry.scheme, entry.shape, (source_dtypes or {}).get(name)))
        else:
            arrays[name] = entry
    write_arrays(path, arrays, header)


def quantized_keys(name: str, sch: QuantScheme, shape: Any, source_dtype: Any = None) -> dict[str, str]:
    """The metadata keys of one quantized tensor (scheme, shape, and its source dtype if known)."""
    keys = {scheme_key(name): str(sch), shape_key(name): json.dumps([int(d) for d in shape])}
    if source_dtype is not None:
        keys[dtype_key(name)] = source_dtype if isinstance(source_dtype, str) else st_dtype(source_dtype)
    return keys


def qcore_header(user: Mapping[str, str] | None, recipe: str | None = None, run: str | None = None) -> dict[str, str]:
    """The file-level metadata qcore writes: format version, optional recipe and run marker, user keys."""
    header = {VERSION_KEY: FORMAT_VERSION}
    if recipe is not None:
        header[RECIPE_KEY] = recipe
    if run is not None:
        header[RUN_KEY] = run
    header.update(_check_user_metadata(user))
    return header


def _tensor_of_key(key: str) -> str | None:
    """The tensor a per-tensor qcore key (`qcore.NAME.scheme|shape|dtype`) names, else None."""
    if not key.startswith(PREFIX) or key in _GLOBAL_KEYS:
        return None
    for suffix in (_SCHEME, _SHAPE, _DTYPE):
        if key.endswith(suffix):
            return key[len(PREFIX):-len(suffix)]
    return None


def settle_metadata(path: PathLike) -> None:
    """Keep in the file's `__metadata__` only the qcore keys of the tensors it holds (and every
    other key), in sorted order, rewriting the header in place at its length (padded with spaces,
    as safetensors pads it). For a shard another writer gave the keys of every shard
    (transformers' `save_pretrained` writes one metadata map into each): afterwards it is a valid
    qcore file, and equal contents give equal bytes. `InvalidDataError` if the header is not a
    safetensors header."""
    p = os.fspath(path)
    with open(p, "r+b") as f:
        found = read_header(f)
        if found is None:
            raise InvalidDataError(f"{p}: not a safetensors file (its header does not parse)")
        n, head = found
        held = set(head) - {_RESERVED_NAME}
        meta = head.get(_RESERVED_NAME) or {}
        kept = {k: v for k, v in sorted(meta.items()) if _tensor_of_key(k) in (None, *held)}
        if kept:
            head[_RESERVED_NAME] = kept
        else:
            head.pop(_RESERVED_NAME, None)
        if not rewrite_header(f, n, head):  # only keys were dropped: never longer than the compact original
            raise InvalidDataError(f"{p}: its header is not in safetensors' compact form; cannot rewrite it in place")


# ---------------------------------------------------------------------------------------- read
@dataclass(frozen=True)
class Entry:
    """One tensor of a file as the header describes it (no data read)."""

    name: str
    dtype: str                      # safetensors dtype as stored ("U8" for quantized tensors)
    shape: tuple[int, ...]          # logical shape (quantized: the tensor's, not the payload's)
    nbytes: int                     # bytes stored in the file
    scheme: QuantScheme | None = None
    source_dtype: str | None = None  # quantized: the dtype it came from, if recorded ("BF16", ...)

    @property
    def quantized(self) -> bool:
        return self.scheme is not None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def source_nbytes(self) -> int:
        """Bytes of the tensor in its source dtype (quantized without a recorded dtype: float32)."""
        if not self.quantized:
            return self.nbytes
        return self.numel * _itemsize(self.source_dtype or "F32", 4)


@dataclass(frozen=True)
class FileInfo:
    """What `read_info` finds in a file's header."""

    path: str
    format_version: str | None       # None: a plain safetensors file, not written by qcore
    entries: list[Entry] = field(default_factory=list)
    metadata: dict[str, str] = field(default_factory=dict)   # the caller's own keys
    file_size: int = 0
    recipe: str | None = None        # the recipe JSON (qcore.model.recipe), if recorded
    run: str | None = None           # the whole-model run marker (qcore.run), if recorded


def _itemsize(dtype: str, default: int) -> int:
    """Bytes per element of a safetensors dtype, `default` for a name qcore does not know."""
    return ST_DTYPES[dtype].itemsize if dtype in ST_DTYPES else default


def _parse_shape(text: str, name: str, where: str) -> tuple[int, ...]:
    try:
        v = json.loads(text) if len(text) < 4096 else None  # a shape is short; refuse deep nesting early
    except (ValueError, RecursionError):
        v = None
    if not isinstance(v, list) or not v or not all(type(d) is int and 0 <= d <= INT64_MAX for d in v):
        shown = repr(text) if len(text) <= 80 else f"{text[:60]!r}... ({len(text)} characters)"
        raise InvalidDataError(
            f"{where}: key '{shape_key(name)}' must be a JSON list of one or more ints in 0..2**63-1, got {shown}"
        )
    return tuple(v)


def _quantized_index(meta: dict[str, str], names: set[str], where: str) -> tuple[str | None, dict, dict, dict]:
    """Split header metadata into (format version, {name: (scheme, shape)}, user metadata,
    {name: source dtype})."""
    version = meta.get(VERSION_KEY)
    user = {k: v for k, v in meta.items() if not k.startswith(PREFIX)}
    ours = {k: v for k, v in meta.items() if k.startswith(PREFIX) and k not in _GLOBAL_KEYS}
    if version is None:
        if ours:
            raise InvalidDataError(f"{where}: has qcore keys ({next(iter(ours))!r}) but no '{VERSION_KEY}'")
        return None, {}, user, {}
    if version != FORMAT_VERSION:
        raise InvalidDataError(
            f"{where}: qcore format version {version!r} is not supported (this qcore reads "
            f"{FORMAT_VERSION!r}); upgrade qcore"
        )
    schemes: dict[str, str] = {}
    shapes: dict[str, str] = {}
    dtypes: dict[str, str] = {}
    for k, v in ours.items():
        if k.endswith(_SCHEME):
            schemes[k[len(PREFIX):-len(_SCHEME)]] = v
        elif k.endswith(_SHAPE):
            shapes[k[len(PREFIX):-len(_SHAPE)]] = v
        elif k.endswith(_DTYPE):
            dtypes[k[len(PREFIX):-len(_DTYPE)]] = v
        else:
            raise InvalidDataError(f"{where}: unknown metadata key {k!r} (qcore format {FORMAT_VERSION})")
    index = {}
    for name in sorted(set(schemes) | set(shapes)):
        if name not in schemes or name not in shapes:
            missing = scheme_key(name) if name not in schemes else shape_key(name)
            raise InvalidDataError(f"{where}: tensor '{name}' lacks the metadata key '{missing}'")
        if name not in names:
            raise InvalidDataError(f"{where}: metadata describes tensor '{name}', which the file does not hold")
        try:
            sch = parse_scheme(schemes[name])
        except QCoreError as e:
            raise InvalidDataError(f"{where}: tensor '{name}' has a bad scheme: {e}") from None
        index[name] = (sch, _parse_shape(shapes[name], name, where))
    for name, dt in dtypes.items():
        if name not in index:
            raise InvalidDataError(f"{where}: key '{dtype_key(name)}' names no quantized tensor")
        if dt not in ST_DTYPES:
            raise InvalidDataError(f"{where}: key '{dtype_key(name)}' must be a safetensors dtype, got {dt!r}")
    return version, index, user, dtypes


def read_info(path: PathLike) -> FileInfo:
    """Describe a file from its header alone: tensors, schemes, logical shapes, stored sizes.

    Checks every quantized entry's stored size against its scheme and shape (docs/spec.md, portable
    bytes).
    """
    p = os.fspath(path)
    with open_checked(p) as f:
        meta = f.metadata() or {}
        names = list(f.keys())
        version, index, user, dtypes = _quantized_index(meta, set(names), p)
        entries = []
        for name in names:
            sl = f.get_slice(name)
            dtype, stored_shape = str(sl.get_dtype()), tuple(int(d) for d in sl.get_shape())
            nbytes = math.prod(stored_shape) * _itemsize(dtype, 1)
            if name in index:
                sch, shape = index[name]
                _check_stored(p, name, dtype, stored_shape, sch, shape)
                entries.append(Entry(name, dtype, shape, nbytes, sch, dtypes.get(name)))
            else:
                entries.append(Entry(name, dtype, stored_shape, nbytes))
    return FileInfo(p, version, entries, user, os.path.getsize(p), meta.get(RECIPE_KEY), meta.get(RUN_KEY))


def _check_stored(where: str, name: str, dtype: str, stored_shape: tuple[int, ...],
                  sch: QuantScheme, shape: tuple[int, ...]) -> None:
    if dtype != "U8" or len(stored_shape) != 1:
        raise InvalidDataError(
            f"{where}: quantized tensor '{name}' must be stored as 1-D U8, got {dtype} {list(stored_shape)}"
        )
    try:
        want = sections(shape, sch).total
    except QCoreError as e:
        raise InvalidDataError(f"{where}: tensor '{name}': shape {list(shape)} does not fit {sch}: {e}") from None
    if stored_shape[0] != want:
        raise InvalidDataError(
            f"{where}: tensor '{name}' ({sch}, shape {list(shape)}) needs a {want}-byte payload, "
            f"the file holds {stored_shape[0]} bytes"
        )


def load_data(path: PathLike) -> dict[str, QuantizedData | np.ndarray]:
    """Read a file into portable values: `QuantizedData` for quantized tensors, numpy otherwise.

    Needs no backend. A plain safetensors file (no qcore metadata) loads as numpy arrays.
    """
    p = os.fspath(path)
    index: dict[str, tuple[QuantScheme, tuple[int, ...]]] = {}

    def check(meta: dict[str, str], names: list[str]) -> None:  # the metadata, before any tensor is read
        index.update(_quantized_index(meta, set(names), p)[1])

    arrays, _ = read_arrays(p, check)
    out: dict[str, QuantizedData | np.ndarray] = {}
    for name, arr in arrays.items():
        if name in index:
            sch, shape = index[name]
            _check_stored(p, name, st_dtype(arr.dtype), arr.shape, sch, shape)
            try:
                out[name] = QuantizedData(shape, sch, arr.tobytes())
            except InvalidDataError as e:
                raise InvalidDataError(f"{p}: tensor '{name}': {e}") from None
        else:
            out[name] = arr
    return out


def load(path: PathLike, backend: str | Backend | None = None) -> dict[str, QTensor | np.ndarray]:
    """Read a file written by `save`, or any checkpoint the `qcore` command takes (a folder of
    shards, its `*.safetensors.index.json`, a hub id in the local cache): quantized tensors become
    QTensors on `backend`.

    `backend` None -> `$QCORE_BACKEND`, else `auto` (per scheme, the best available backend that
    supports it). Float tensors come back as numpy arrays. The payload bytes are loaded as they are,
    so `q.to_data()` gives the same bytes on every backend. Shards are checked against each other
    and their index as `qcore quantize` checks them (a tensor in two shards, a missing one).
    """
    from qcore.backend.registry import backend as get_backend

    try:
        ck = resolve(path)
    except TypeError:
        raise InputError(f"a file path is a str or os.PathLike, got {type(path).__name__}") from None
    parts = {shard: load_data(ck.path(shard)) for shard in ck.shards}
    if ck.sharded:
        ck.check_tensors({shard: list(d) for shard, d in parts.items()})
    data = {name: v for d in parts.values() for name, v in d.items()}
    be = get_backend(backend)
    out: dict[str, QTensor | np.ndarray] = {}
    for name, d in data.items():
        if isinstance(d, QuantizedData):
            try:
                out[name] = be.from_data(d)
            except QCoreError as e:
                raise type(e)(f"tensor '{name}': {e}") from None
        else:
            out[name] = d
    return out
