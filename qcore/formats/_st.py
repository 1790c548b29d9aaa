"""What the safetensors-based formats share beyond `qcore.files.stfile`: reading every shard of a
checkpoint as arrays, whether a plain array can be written, and the JSON a writer carries in
metadata."""
from __future__ import annotations

import json
from typing import Any, Callable

import numpy as np

from qcore.backend.protocol import Support
from qcore.errors import InvalidDataError
from qcore.files.checkpoint import shard_files
from qcore.files.paths import PathLike
from qcore.files.stfile import read_arrays as read_file, storable
from qcore.formats.base import short_repr

__all__ = ["array_support", "carried", "pop_json", "read_arrays"]


def array_support(value: np.ndarray) -> Support:
    """Whether a safetensors-based format holds a plain array (its dtype is storable)."""
    if not storable(value.dtype):
        return Support.no(f"safetensors cannot store dtype {value.dtype}")
    return Support.yes()


def pop_json(meta: dict[str, str], key: str) -> dict:
    """Remove `key` from `meta` and return its JSON object ({} when absent or not JSON, text nested
    too deeply for Python's parser included)."""
    try:
        got = json.loads(meta.pop(key, "{}"))
    except (ValueError, RecursionError):
        return {}
    return got if isinstance(got, dict) else {}


def carried(table: dict, key: str, name: str, ok: Callable[[Any], bool], expected: str) -> Any:
    """The entry of tensor `name` in `table`, the JSON object a writer carries in metadata `key`
    (`pop_json`), or None when it has none; an entry a previous read cannot have written (`ok`
    false) is an `InvalidDataError` saying what was `expected`, before anything is written."""
    if name not in table:
        return None
    value = table[name]
    if not ok(value):
        raise InvalidDataError(
            f"metadata '{key}': the entry of tensor '{name}' must be {expected}, got {short_repr(value)}; "
            "drop the key or fix it")
    return value


def read_arrays(path: PathLike) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Every tensor of a safetensors file (or of every shard of an index, `shard_files`) as numpy,
    in file order, and the (first shard's) `__metadata__`."""
    out: dict[str, np.ndarray] = {}
    meta: dict[str, str] | None = None
    for p in shard_files(path):
        arrays, shard_meta = read_file(p)
        meta = shard_meta if meta is None else meta
        for name, a in arrays.items():
            if name in out:
                raise InvalidDataError(f"{p}: tensor '{name}' is also in another shard")
            out[name] = a
    return out, meta or {}
