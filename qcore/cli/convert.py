"""The `qcore convert` command and the format hook of `qcore inspect` (kept here so cli.py stays thin)."""
from __future__ import annotations

import argparse
import math
import os
from typing import Any

from qcore.cli.console import console, escape, fmt_db, fmt_shape
from qcore.errors import InputError
from qcore.files import io as qio
from qcore.files.checkpoint import INDEX_SUFFIX, shard_files
from qcore.files.stfile import ST_DTYPES, st_dtype
from qcore.formats.base import FormatNotFoundError, read_checked, refuse_unread_quantized
from qcore.formats.convert import convert
from qcore.formats.registry import detect, formats, get
from qcore.spec.payload import QuantizedData

__all__ = ["add_convert", "cmd_convert", "format_of", "describe_checkpoint"]

# Metadata keys a format keeps for itself (restoring its file); inspect does not print them.
_PRIVATE = ("gguf.kv", "gpt-oss.names", "bitsandbytes.dtypes")


def format_of(path: str) -> str:
    """The name of the format `path` is in; "qcore" for qcore files, plain safetensors, and paths no
    format claims (qcore's own reader then says what is wrong with them). A qcore or plain
    safetensors file whose plain tensors hold quantized codes beside their scale is an
    `InvalidDataError` here (`base.refuse_unread_quantized`), before a command describes them."""
    try:
        name = detect(path).name
    except (FormatNotFoundError, OSError):
        return "qcore"
    if name == "qcore":
        plain: dict[str, tuple[str, tuple[int, ...]]] = {}
        for p in shard_files(path):
            plain.update((e.name, (ST_DTYPES[e.dtype].name if e.dtype in ST_DTYPES else e.dtype, tuple(e.shape)))
                         for e in qio.read_info(p).entries if e.scheme is None)
        refuse_unread_quantized(plain, path, name)
    return name


def describe_checkpoint(path: str) -> tuple[qio.FileInfo, str]:
    """`qio.read_info` for a qcore file; for another tool's checkpoint, the same description of what
    qcore reads from it (schemes, logical shapes, payload sizes; every tensor read), and the
    format's name."""
    try:
        fmt = detect(path)
    except FormatNotFoundError:  # qcore's own reader says what is wrong with the file
        fmt = get("qcore")
    if fmt.name == "qcore" and os.path.isfile(path) and not os.fspath(path).endswith(INDEX_SUFFIX):
        return qio.read_info(path), fmt.name
    contents = read_checked(fmt, path)
    entries = []
    for name, v in contents.tensors.items():
        if isinstance(v, QuantizedData):
            entries.append(qio.Entry(name, "U8", v.shape, v.nbytes, v.scheme))
        else:
            dtype = st_dtype(v.dtype) if v.dtype in ST_DTYPES.values() else v.dtype.name
            entries.append(qio.Entry(name, dtype, tuple(v.shape), v.nbytes))
    meta = {k: v for k, v in contents.metadata.items() if k not in _PRIVATE}
    size = sum(os.path.getsize(f) for f in shard_files(path))
    return qio.FileInfo(os.fspath(path), None, entries, meta, size), fmt.name


def _options(pairs: list[str] | None, flag: str) -> dict[str, str]:
    out = {}
    for p in pairs or []:
        key, sep, value = p.partition("=")
        if not sep or not key:
            raise InputError(f"{flag} takes KEY=VALUE, got {p!r}")
        out[key] = value
    return out


def add_convert(sub: Any) -> None:
    """Register `qcore convert` on the CLI's subparsers."""
    names = ", ".join(formats())
    s = sub.add_parser(
        "convert", help="move a checkpoint between formats (bytes rearranged, never re-quantized unasked)",
        description="Convert SRC to format FORMAT at DST. A quantized tensor the target holds exactly moves "
                    "byte for byte; one it cannot hold is refused unless --requantize names a scheme.",
        epilog=f"formats read: {names}")
    s.add_argument("src", metavar="SRC", help="input file (format detected, or --from)")
    s.add_argument("dst", metavar="DST", help="output file (written atomically)")
    writable = ", ".join(n for n, f in formats().items() if f.writable)
    s.add_argument("--to", required=True, metavar="FORMAT", help=f"target format: {writable}")
    s.add_argument("--from", dest="src_format", metavar="FORMAT", help="source format (default: detected)")
    s.add_argument("--requantize", metavar="SCHEME",
                   help="re-quantize tensors the target cannot hold exactly to SCHEME (error reported per tensor)")
    s.add_argument("--backend", default=None, help="backend for --requantize (default: $QCORE_BACKEND, else auto)")
    s.add_argument("--from-option", action="append", metavar="KEY=VALUE", help="reader option (repeatable)")
    s.add_argument("--to-option", action="append", metavar="KEY=VALUE", help="writer option (repeatable)")
    s.set_defaults(func=cmd_convert)


def cmd_convert(args: argparse.Namespace) -> int:
    from rich.table import Table

    report = convert(args.src, args.dst, args.to, src_format=args.src_format, requantize=args.requantize,
                     backend=args.backend, read_options=_options(args.from_option, "--from-option"),
                     write_options=_options(args.to_option, "--to-option"))
    out = console()
    out.print(f"[bold]{escape(report.src)} ({report.src_format}) -> {escape(report.dst)} ({report.dst_format})[/]")
    table = Table()
    for col, just in (("tensor", "left"), ("shape", "left"), ("source", "left"), ("written as", "left"),
                      ("action", "left"), ("SQNR dB", "right"), ("max |err|", "right")):
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    for t in report.tensors:
        re = t.action == "requantized"
        table.add_row(escape(t.name), fmt_shape(t.shape), escape(t.source), escape(t.target), t.action,
                      fmt_db(t.sqnr) if re else "", f"{t.max_err:.3g}" if re and not math.isnan(t.max_err) else "")
    out.print(table)
    n_re = sum(t.action == "requantized" for t in report.tensors)
    out.print(f"wrote {report.dst}: {len(report.tensors)} tensors, "
              + ("lossless (bytes rearranged, nothing re-quantized)" if n_re == 0 else f"{n_re} re-quantized"))
    return 0
