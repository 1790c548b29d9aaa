"""The `quantization_config` entry of a model folder's `config.json` for a qcore checkpoint.

transformers (and other loaders) dispatch on `config.json`'s `quantization_config.quant_method`;
qcore's entry names the method, the file format version, the recipe that chose the schemes and
every quantized tensor's scheme, so a loader can shape each module before reading the bytes:

    "quantization_config": {
      "quant_method": "qcore",
      "format_version": "1",
      "recipe": {"scheme": "q4s/block32:f16", "rules": [...], ...},
      "tensors": {"model.layers.0.mlp.down_proj.weight": "q4s/block32:f16", ...}
    }

This module is plain Python (no torch, no transformers): `qcore quantize` writes the entry and
`qcore dequantize` removes it; `qcore.integrations.transformers` reads it.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from qcore.files import io as qio
from qcore.errors import InvalidDataError, QCoreError
from qcore.spec.scheme import QuantScheme, scheme as parse_scheme

__all__ = ["QUANT_METHOD", "CONFIG_NAME", "quantization_config", "tensor_schemes", "is_qcore",
           "write_config"]

QUANT_METHOD = "qcore"
"""The `quant_method` of a qcore checkpoint's `quantization_config`."""
CONFIG_NAME = "config.json"
"""The model folder's configuration file (transformers' name)."""
_KEY = "quantization_config"


def quantization_config(tensors: Mapping[str, QuantScheme | str], recipe: Mapping[str, Any] | str | None = None
                        ) -> dict[str, Any]:
    """The entry for a checkpoint whose quantized tensors are `tensors` (name -> scheme), chosen
    by `recipe` (its dict or canonical JSON; None when unknown)."""
    doc: dict[str, Any] = {"quant_method": QUANT_METHOD, "format_version": qio.FORMAT_VERSION}
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
    if version != qio.FORMAT_VERSION:
        raise InvalidDataError(f"{where}: qcore quantization_config format_version {version!r} is not supported "
                               f"(this qcore reads {qio.FORMAT_VERSION!r}); upgrade qcore")
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
        raw = (json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")

    def put(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(raw)

    os.makedirs(os.path.dirname(os.path.abspath(dst)), exist_ok=True)
    qio.atomic_write(dst, put)
