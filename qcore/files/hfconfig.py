"""A model folder's `config.json` and its `quantization_config` entry: built, read and written.

transformers (and other loaders) dispatch on `config.json`'s `quantization_config.quant_method`.
qcore's entry names the method, the file format version, the recipe that chose the schemes and
every quantized tensor's scheme, so a loader can shape each module before reading the bytes:

    "quantization_config": {
      "quant_method": "qcore",
      "format_version": "1",
      "recipe": {"scheme": "q4s/block32:f16", "rules": [...], ...},
      "tensors": {"model.layers.0.mlp.down_proj.weight": "q4s/block32:f16", ...}
    }

This module is plain Python (no torch, no transformers): `qcore quantize` writes the entry
(`write_config`) and `qcore dequantize` removes it; `qcore.integrations.transformers` reads it.
Another tool's entry is written beside a converted file (`put_quantization_config`) or into an
exported folder (`export_config`) and read back (`config_beside`) by `qcore.formats`.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from qcore.errors import InputError, InvalidDataError, QCoreError
from qcore.files.io import FORMAT_VERSION
from qcore.files.paths import PathLike, atomic_write, parse_json
from qcore.spec.schemes import QuantScheme, scheme as parse_scheme

__all__ = ["QUANT_METHOD", "CONFIG_NAME", "quantization_config", "tensor_schemes", "is_qcore",
           "write_config", "put_quantization_config", "export_config", "config_beside"]

QUANT_METHOD = "qcore"
"""The `quant_method` of a qcore checkpoint's `quantization_config`."""
CONFIG_NAME = "config.json"
"""The model folder's configuration file (transformers' name)."""
_KEY = "quantization_config"


def quantization_config(tensors: Mapping[str, QuantScheme | str], recipe: Mapping[str, Any] | str | None = None
                        ) -> dict[str, Any]:
    """The entry for a checkpoint whose quantized tensors are `tensors` (name -> scheme), chosen
    by `recipe` (its dict or canonical JSON; None when unknown)."""
    doc: dict[str, Any] = {"quant_method": QUANT_METHOD, "format_version": FORMAT_VERSION}
    if recipe is not None:
        doc["recipe"] = json.loads(recipe) if isinstance(recipe, str) else dict(recipe)
    doc["tensors"] = {name: str(s) for name, s in sorted(tensors.items())}
    return doc


def is_qcore(doc: Any) -> bool:
    """Whether `doc` (a `quantization_config` value) is qcore's."""
    return isinstance(doc, Mapping) and doc.get("quant_method") == QUANT_METHOD


def tensor_schemes(doc: Mapping[str, Any], where: str = CONFIG_NAME) -> dict[str, QuantScheme]:
    """{tensor name: scheme} of a qcore `quantization_config`, checked: the format version this
    qcore reads, a `tensors` object of name -> scheme text that parses; else `InvalidDataError`
    naming `where` and the rule."""
    version = doc.get("format_version")
    if version != FORMAT_VERSION:
        raise InvalidDataError(f"{where}: qcore quantization_config format_version {version!r} is not supported "
                               f"(this qcore reads {FORMAT_VERSION!r}); upgrade qcore")
    tensors = doc.get("tensors")
    if not isinstance(tensors, Mapping) or not all(isinstance(k, str) and k and isinstance(v, str)
                                                   for k, v in tensors.items()):
        raise InvalidDataError(f"{where}: a qcore quantization_config needs 'tensors', an object of tensor name -> "
                               "scheme text")
    out: dict[str, QuantScheme] = {}
    for name, text in tensors.items():
        try:
            out[name] = parse_scheme(text)
        except QCoreError as e:
            raise InvalidDataError(f"{where}: tensor '{name}' has a bad scheme in quantization_config: {e}") from None
    return out


def write_config(src: str, dst: str, entry: Mapping[str, Any] | None) -> None:
    """Write the `config.json` at `src` to `dst` (atomically) with `entry` as its
    `quantization_config`, or, with `entry` None, without a qcore one (any other method's entry
    is kept). A `src` that is not a JSON object is copied as it is: qcore does not own it."""
    with open(src, "rb") as f:
        raw = f.read()
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        doc = None
    if isinstance(doc, dict):
        if entry is not None:
            doc[_KEY] = dict(entry)
        elif is_qcore(doc.get(_KEY)):
            del doc[_KEY]
        raw = _json_bytes(doc, ascii_only=False)
    os.makedirs(os.path.dirname(os.path.abspath(dst)), exist_ok=True)
    _put(dst, raw)


def put_quantization_config(path: PathLike, config: dict) -> str:
    """Put `config` as `quantization_config` into the `config.json` beside `path`, which loaders
    (transformers, vLLM) dispatch on; other keys of an existing config.json are kept and the file
    is replaced atomically. Returns the config's path."""
    cfg_path = os.path.join(os.path.dirname(os.path.abspath(os.fspath(path))), CONFIG_NAME)
    cfg: dict = {}
    if os.path.exists(cfg_path):
        try:
            with open(cfg_path, encoding="utf-8") as f:
                cfg = json.load(f)
        except (ValueError, RecursionError):  # not JSON, or nested too deeply for Python's parser
            raise InputError(f"{cfg_path} exists and is not JSON; move it away or fix it") from None
        if not isinstance(cfg, dict):
            raise InputError(f"{cfg_path} exists and is not a JSON object")
    cfg[_KEY] = config
    _put(cfg_path, _json_bytes(cfg))
    return cfg_path


def export_config(src: str | None, dst: str, entry: Mapping[str, Any] | None) -> None:
    """Write the config.json of an export to `dst`: the keys of the one at `src` (if any), with
    `entry` as its `quantization_config`; with `entry` None (the target has none), without the
    source's, qcore's or another method's. A `src` that is not JSON is an InvalidDataError."""
    cfg: dict[str, Any] = {}
    if src is not None and os.path.isfile(src):
        with open(src, "rb") as f:
            got = parse_json(f.read(), src)
        cfg = got if isinstance(got, dict) else {}
    cfg.pop(_KEY, None)
    if entry is not None:
        cfg[_KEY] = dict(entry)
    _put(dst, _json_bytes(cfg))


def config_beside(path: PathLike) -> dict | None:
    """The `quantization_config` of a `config.json` in the checkpoint's folder, if there is one
    (None when the file is missing or not JSON); a file nested deeper than Python's JSON parser
    goes is an `InvalidDataError` (a RecursionError otherwise)."""
    p = os.fspath(path)
    folder = p if os.path.isdir(p) else os.path.dirname(os.path.abspath(p))
    cfg_path = os.path.join(folder, CONFIG_NAME)
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f).get(_KEY)
        json.dumps(cfg)  # what `read` does with it: nested as deep as the parser allowed, it may not encode
    except (OSError, ValueError, AttributeError):
        return None
    except RecursionError:
        raise InvalidDataError(f"{cfg_path} is nested too deeply for Python's JSON parser, so its "
                               f"'{_KEY}' cannot be read; fix the file or move it away") from None
    return cfg if isinstance(cfg, dict) else None


def _json_bytes(doc: Any, ascii_only: bool = True) -> bytes:
    """A config.json's text: indented, keys sorted, a newline at the end."""
    return (json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=ascii_only) + "\n").encode("utf-8")


def _put(path: str, raw: bytes) -> None:
    def put(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(raw)

    atomic_write(path, put)
