"""Moving a checkpoint between formats: bytes rearranged where the target holds the source exactly.

`convert` never re-quantizes on its own. A quantized tensor the target cannot hold exactly, or
one the reader could not hold exactly (`Contents.refused`: the tool's decoded values), is an
`UnrepresentableError`, unless the caller names a scheme to re-quantize it with; then the tensor is
dequantized (or taken as the tool decoded it), quantized again, and the report gives its error
(SQNR and max |err| against the source's decoded values). Float and integer tensors are copied as
they are.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from qcore.files.checkpoint import check_apart
from qcore.spec.payload import QuantizedData
from qcore.spec.schemes import QuantScheme, scheme as parse_scheme
from qcore.formats.base import Contents, Format, PathLike, Tensor, UnrepresentableError, model_folder, read_checked
from qcore.formats.registry import detect, get

__all__ = ["ConvertReport", "TensorReport", "convert", "describe"]


def describe(value: Tensor) -> str:
    """Scheme text of a quantized tensor, dtype of a plain one."""
    return str(value.scheme) if isinstance(value, QuantizedData) else str(value.dtype)


@dataclass(frozen=True)
class TensorReport:
    """What happened to one tensor: `action` is 'rearranged' (quantized, bytes moved), 'copied'
    (float or integer tensor) or 'requantized' (with its error against the source's values)."""

    name: str
    shape: tuple[int, ...]
    source: str
    target: str
    action: str
    sqnr: float = math.inf
    max_err: float = 0.0


@dataclass
class ConvertReport:
    src: str
    dst: str
    src_format: str
    dst_format: str
    tensors: list[TensorReport] = field(default_factory=list)

    @property
    def lossless(self) -> bool:
        return all(t.action != "requantized" for t in self.tensors)


def _format(name: str | Format, options: Mapping[str, str] | None) -> Format:
    fmt = get(name) if isinstance(name, str) else name
    ok = fmt.available()
    if not ok:
        raise UnrepresentableError(f"format '{fmt.name}' is not available: {ok.reason}")
    return fmt.with_options(**dict(options or {}))


def convert(src: PathLike, dst: PathLike, to: str | Format, *, src_format: str | Format | None = None,
            requantize: QuantScheme | str | None = None, backend: Any = None,
            read_options: Mapping[str, str] | None = None,
            write_options: Mapping[str, str] | None = None) -> ConvertReport:
    """Read `src` (its format detected, or `src_format`) and write it to `dst` as format `to`.

    Every quantized tensor the target holds exactly moves byte for byte (rearranged, never
    re-quantized); codes the reader left as a plain array beside their scale are an
    `InvalidDataError` (`base.read_checked`), so "copied" is only ever a float or integer tensor
    and a report without re-quantized tensors is lossless. A tensor the target cannot hold, or one
    the reader refused (no qcore scheme holds the tool's values exactly, `Contents.refused`),
    raises `UnrepresentableError` before anything is written, unless `requantize` names a scheme:
    then it is quantized again on `backend` (None: $QCORE_BACKEND, else auto) from its decoded
    values (the refused one from the tool's own decode), and its error is in the report. A model
    folder (`src` a directory or its index) is passed to the writer as `Contents.folder`, so GGUF
    can write the model's config.json and tokenizer.
    """
    s, d = os.fspath(src), os.fspath(dst)
    check_apart(s, d, names=("SRC", "DST"))  # DST is not SRC, nor one of its shards
    reader = _format(src_format if src_format is not None else detect(s), read_options)
    writer = _format(to, write_options)
    if not writer.writable:
        raise UnrepresentableError(f"format '{writer.name}' is read-only in this qcore; convert to another format")
    target = parse_scheme(requantize) if requantize is not None else None
    # no quantized tensor passes as a plain array; those the reader refused only with a target
    contents = read_checked(reader, s, requantizing=target is not None)
    report = ConvertReport(s, d, reader.name, writer.name)
    out: dict[str, Tensor] = {}
    for name, value in contents.tensors.items():
        source = None
        if name in contents.refused:  # the tool's decoded values of a tensor no scheme holds exactly
            source = f"{describe(value)}, decoded by {reader.name}"
        else:
            ok = writer.check(name, value)
            if not ok and isinstance(value, QuantizedData) and value.scheme.low_order is not value.scheme:
                low = value.in_low_order()  # a field order the target lacks: the fields re-packed
                if writer.check(name, low):
                    value, ok = low, writer.check(name, low)
            if ok:
                action = "rearranged" if isinstance(value, QuantizedData) else "copied"
                out[name] = value
                report.tensors.append(TensorReport(name, tuple(value.shape), describe(value), describe(value), action))
                continue
            if target is None or not isinstance(value, QuantizedData):
                way = "; pass requantize=SCHEME (--requantize) to re-quantize it and report the error" \
                    if isinstance(value, QuantizedData) else ""   # a plain tensor's reason names its way out
                raise UnrepresentableError(
                    f"tensor '{name}' ({describe(value)}, shape {list(value.shape)}) cannot be written as "
                    f"{writer.name} exactly: {ok.reason}{way}"
                )
        out[name], row = _requantize(name, value, target, backend, source)
        again = writer.check(name, out[name])
        if not again:
            raise UnrepresentableError(
                f"tensor '{name}' requantized to {target} still cannot be written as {writer.name}: {again.reason}"
            )
        report.tensors.append(row)
    writer.write(d, Contents(out, dict(contents.metadata), writer.name, contents.folder or model_folder(s)))
    return report


def _requantize(name: str, value: Tensor, target: QuantScheme, backend: Any,
                source: str | None = None) -> tuple[QuantizedData, TensorReport]:
    """`value` (a payload, or the values a tool decoded) quantized as `target`, with its error
    (`Backend.error_stats`: the statistic `qcore.quantize_model` reports)."""
    from qcore.backend.registry import backend as get_backend

    be = get_backend(backend)
    x = be.from_data(value).numpy() if isinstance(value, QuantizedData) else np.asarray(value)
    q = be.quantize(x, target)
    sqnr, max_err = be.error_stats(x, q)
    return q.to_data(), TensorReport(name, tuple(value.shape), source or describe(value), str(target), "requantized", sqnr,
                             max_err)
