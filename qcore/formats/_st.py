"""Plain safetensors reading and writing shared by the safetensors-based formats."""
from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Callable, Mapping

import ml_dtypes  # noqa: F401  (registers bfloat16/float8 with numpy, so safetensors can read them)
import numpy as np
from safetensors.numpy import save_file

from qcore.files import io as qio
from qcore.errors import InputError, InvalidDataError, QCoreError
from qcore.files.stfile import Reader
from qcore.formats.base import PathLike, shards, short_repr

if TYPE_CHECKING:
    from qcore.backend.protocol import Support

__all__ = ["array_support", "carried", "config_beside", "pop_json", "put_quantization_config", "read_arrays", "storable",
           "write_arrays"]

_FLOAT8 = ("F8_E4M3", "F8_E5M2", "F8_E8M0")  # read by qcore's own reader (ml_dtypes' float8 types)


def storable(dtype: np.dtype) -> bool:
    """Whether safetensors stores arrays of `dtype` (numpy numbers and ml_dtypes' bfloat16/float8)."""
    return dtype.kind in "biufcV" and dtype.fields is None


def array_support(value: np.ndarray) -> "Support":
    """Whether a safetensors-based format holds a plain array (its dtype is storable)."""
    from qcore.backend.protocol import Support

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
    """Every tensor of a safetensors file (or of every shard of an index) as numpy, in file order,
    and the (first shard's) `__metadata__`."""
    out: dict[str, np.ndarray] = {}
    meta: dict[str, str] | None = None
    for p in shards(path):
        raw: Reader | None = None  # for the float8 tensors safetensors' numpy loader cannot make
        try:
            with qio._open(p) as f:
                meta = dict(f.metadata() or {}) if meta is None else meta
                for name in f.keys():
                    if name in out:
                        raise InvalidDataError(f"{p}: tensor '{name}' is also in another shard")
                    try:
                        if f.get_slice(name).get_dtype() in _FLOAT8:
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
    return out, meta or {}


def write_arrays(path: PathLike, arrays: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> None:
    """Write numpy arrays to a safetensors file atomically, with str -> str metadata."""
    for name, a in arrays.items():
        if not storable(a.dtype):
            raise InputError(f"tensor '{name}' has dtype {a.dtype}, which safetensors cannot store")
    data = {k: np.ascontiguousarray(v).reshape(np.shape(v)) for k, v in arrays.items()}  # 0-d stays 0-d
    meta = dict(metadata) or None
    qio.atomic_write(path, lambda tmp: save_file(data, tmp, metadata=meta))


def put_quantization_config(path: PathLike, config: dict) -> str:
    """Put `config` as `quantization_config` into the `config.json` beside `path`, which loaders
    (transformers, vLLM) dispatch on; other keys of an existing config.json are kept and the file
    is replaced atomically. Returns the config's path."""
    cfg_path = os.path.join(os.path.dirname(os.path.abspath(os.fspath(path))), "config.json")
    cfg: dict = {}
    if os.path.exists(cfg_path):
        try:
            with open(cfg_path, encoding="utf-8") as f:
                cfg = json.load(f)
        except ValueError:
            raise InputError(f"{cfg_path} exists and is not JSON; move it away or fix it") from None
        if not isinstance(cfg, dict):
            raise InputError(f"{cfg_path} exists and is not a JSON object")
    cfg["quantization_config"] = config
    text = json.dumps(cfg, indent=2, sort_keys=True) + "\n"

    def put(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    qio.atomic_write(cfg_path, put)
    return cfg_path


def config_beside(path: PathLike) -> dict | None:
    """The `quantization_config` of a `config.json` in the checkpoint's folder, if there is one
    (None when the file is missing or not JSON); a file nested deeper than Python's JSON parser
    goes is an `InvalidDataError` (a RecursionError otherwise)."""
    p = os.fspath(path)
    folder = p if os.path.isdir(p) else os.path.dirname(os.path.abspath(p))
    cfg_path = os.path.join(folder, "config.json")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f).get("quantization_config")
        json.dumps(cfg)  # what `read` does with it: nested as deep as the parser allowed, it may not encode
    except (OSError, ValueError, AttributeError):
        return None
    except RecursionError:
        raise InvalidDataError(f"{cfg_path} is nested too deeply for Python's JSON parser, so its "
                               "'quantization_config' cannot be read; fix the file or move it away") from None
    return cfg if isinstance(cfg, dict) else None
