"""`qcore inspect`: the schemes, shapes, sizes, compression ratio, recipe and metadata of a file or
checkpoint (qcore's format, plain safetensors, or another tool's format read as qcore schemes)."""
from __future__ import annotations

import argparse
import json
import os
from typing import Any

from qcore.errors import QCoreError
from qcore.files import io as qio
from qcore.model.recipe import Recipe
from qcore.cli.args import EXIT_OK, one_line
from qcore.cli.console import console, fmt_bytes, fmt_shape

__all__ = ["add_parser", "cmd_inspect"]


def add_parser(sub: Any) -> None:
    s = sub.add_parser("inspect", help="schemes, shapes, sizes, compression ratio and recipe of a file or checkpoint")
    s.add_argument("file", metavar="FILE", help="a .safetensors file, checkpoint directory, index file or hub id")
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    s.set_defaults(func=cmd_inspect)


def cmd_inspect(args: argparse.Namespace) -> int:
    from rich.markup import escape  # scheme text such as q4s-lookup[nf4] is not rich markup
    from rich.table import Table

    from qcore.files.checkpoint import resolve
    from qcore.cli.convert import describe_checkpoint, format_of

    fmt = format_of(args.file)
    if fmt == "qcore":
        ck = resolve(args.file)
        infos = [qio.read_info(ck.path(s)) for s in ck.shards]
        ck.check_tensors({s: [e.name for e in info.entries] for s, info in zip(ck.shards, infos)})
        where = f"{len(infos)} shards in {ck.root}" if len(infos) > 1 else infos[0].path
    else:  # another tool's checkpoint, described as the qcore schemes it reads as
        infos = [describe_checkpoint(args.file)[0]]
        where = infos[0].path
    rows = []
    for info in infos:
        for e in info.entries:
            rows.append({
                "name": e.name,
                "file": os.path.basename(info.path),
                "kind": str(e.scheme) if e.quantized else e.dtype,
                "quantized": e.quantized,
                "shape": list(e.shape),
                "bytes": e.nbytes,
                "source_dtype": (e.source_dtype or "F32") if e.quantized else e.dtype,
                "source_bytes": e.source_nbytes,
                "ratio": (e.source_nbytes / e.nbytes) if e.nbytes else 1.0,
            })
    stored = sum(r["bytes"] for r in rows)
    source = sum(r["source_bytes"] for r in rows)
    recipes = sorted({i.recipe for i in infos if i.recipe})
    shown_recipes = [_stored_recipe(t) for t in recipes]
    versions = sorted({i.format_version for i in infos if i.format_version})
    summary = {
        "file": os.fspath(args.file),
        "format": fmt,
        "files": [i.path for i in infos],
        "format_version": versions[0] if versions else None,
        "file_size": sum(i.file_size for i in infos),
        "tensors": len(rows),
        "quantized": sum(r["quantized"] for r in rows),
        "schemes": sorted({r["kind"] for r in rows if r["quantized"]}),
        "stored_bytes": stored,
        "source_bytes": source,
        "ratio": source / stored if stored else 1.0,
        "recipe": shown_recipes[0][0] if len(shown_recipes) == 1 else [v for v, _ in shown_recipes] or None,
        "metadata": infos[0].metadata if infos else {},
    }
    if args.json:
        print(json.dumps({**summary, "entries": rows}, indent=1))
        return EXIT_OK
    out = console()
    kind = f"{fmt} checkpoint, read as qcore schemes" if fmt != "qcore" else \
        f"qcore format {summary['format_version'] or '- (plain safetensors)'}"
    out.print(f"[bold]{escape(where)}[/]  ({kind})")
    table = Table()
    cols = [("tensor", "left"), ("scheme / dtype", "left"), ("shape", "left"), ("stored", "right"),
            ("as source", "right"), ("ratio", "right")] + ([("file", "left")] if len(infos) > 1 else [])
    for col, just in cols:
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    for r in rows:
        kind = r["kind"] + (f" (from {r['source_dtype']})" if r["quantized"] else "")
        table.add_row(escape(r["name"]), escape(kind), fmt_shape(r["shape"]), fmt_bytes(r["bytes"]),
                      fmt_bytes(r["source_bytes"]), f"{r['ratio']:.2f}x", *([r["file"]] if len(infos) > 1 else []))
    table.add_section()
    table.add_row(f"total ({summary['quantized']} of {len(rows)} quantized)", escape(", ".join(summary["schemes"])),
                  "", fmt_bytes(stored), fmt_bytes(source), f"{summary['ratio']:.2f}x")
    out.print(table)
    out.print(f"file size {fmt_bytes(summary['file_size'])}; compression vs the source dtypes: "
              f"{summary['ratio']:.2f}x")
    for _, line in shown_recipes:
        out.print(line, markup=False)
    for k, v in sorted(summary["metadata"].items()):
        out.print(f"metadata {k} = {v}", markup=False)
    return EXIT_OK


def _stored_recipe(text: str) -> tuple[Any, str]:
    """A file's stored recipe (its `qcore.recipe` metadata) as inspect shows it: (its value in --json,
    its line in the table). Text that is not a valid recipe is shown as it is, with a note."""
    try:
        line = Recipe.from_json(text).describe()
    except (QCoreError, RecursionError) as e:
        shown = repr(text) if len(text) <= 200 else f"{text[:160]!r}... ({len(text)} characters)"
        return text, f"recipe (stored, not a valid recipe: {one_line(e)}): {shown}"
    return json.loads(text), f"recipe: {line}"
