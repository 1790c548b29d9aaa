"""Checkpoint formats of other tools: detect, read, write and convert, bit-exactly or not at all.

Built in: `qcore` (qcore's own safetensors), `gpt-oss` (MXFP4 blocks/scales), `gguf` (Q8_0, MXFP4;
needs `pip install qcore-quant[formats]`), `compressed-tensors` (int4/int8, W8A8 int8, FP8, mxfp4,
nvfp4), `fp8` (DeepSeek/Qwen-style FP8 with `weight_scale_inv`), `torchao` (NVFP4) and
`bitsandbytes` (nf4). Other packages add formats
through the `qcore.formats` entry point group (see `registry`). What each format holds exactly, and
what it refuses, is in docs/formats.md.

>>> import qcore.formats as qf
>>> sorted(qf.formats())
['bitsandbytes', 'compressed-tensors', 'fp8', 'gguf', 'gpt-oss', 'qcore', 'torchao']
"""
from __future__ import annotations

from typing import Mapping

from qcore.formats.base import Contents, Format, FormatNotFoundError, PathLike, Probe, Tensor, UnrepresentableError, read_checked
from qcore.formats.convert import ConvertReport, TensorReport, convert, describe
from qcore.formats.registry import GROUP, detect, formats, get, plugin_errors, register, reset

__all__ = [
    "GROUP", "Contents", "ConvertReport", "Format", "FormatNotFoundError", "Probe", "Tensor",
    "TensorReport", "UnrepresentableError", "convert", "describe", "detect", "formats", "get",
    "plugin_errors", "read", "register", "reset", "write",
]


def read(path: PathLike, format: str | None = None, **options: str) -> Contents:
    """Read a file in `format` (None: detected) into qcore terms; exact or `UnrepresentableError`.
    A quantized tensor the reader leaves as a plain array (codes beside their scale) is an
    `InvalidDataError` (`base.read_checked`)."""
    fmt = get(format) if format is not None else detect(path)
    return read_checked(fmt.with_options(**options), path)


def write(path: PathLike, tensors: Mapping[str, Tensor] | Contents, format: str,
          metadata: Mapping[str, str] | None = None, **options: str) -> None:
    """Write tensors (`QuantizedData` or numpy) in `format`; refuses any it cannot hold exactly."""
    contents = tensors if isinstance(tensors, Contents) else Contents(dict(tensors), dict(metadata or {}), format)
    get(format).with_options(**options).write(path, contents)
