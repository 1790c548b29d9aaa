"""The `qcore` command line: backends, quantize, dequantize, inspect, convert, conformance, bench.

Thin by design: every rule lives in the library; this module parses arguments, calls it and
prints tables. User mistakes print one line (`qcore: error: ...`) and exit 2 (usage) or 1
(a `QCoreError` or an unreadable file); Ctrl-C exits 130 and leaves no partial output file.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from typing import Any, Sequence

import numpy as np

from qcore import _signals
from qcore._version import __version__
from qcore.files import io as qio
from qcore.cli.console import console, escape, fmt_bytes, fmt_db, fmt_shape
from qcore.errors import InputError, QCoreError
from qcore.model.recipe import KEEP, Recipe, as_recipe
from qcore.model.results import file_id
from qcore.spec.scheme import PRESETS, Native, PackedNative, PackedU32, QuantMode, QuantScheme, QuantValue, ScaleDtype, base_scheme
from qcore.spec.scheme import scheme as parse_scheme
from qcore.backend.stats import error_stats


__all__ = ["main", "error_stats"]

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 1, 2, 130, 143


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage mistakes as one line instead of exiting."""

    def error(self, message: str):  # type: ignore[override]
        raise _UsageError(f"{message} (see '{self.prog} --help')")


# ------------------------------------------------------------------------------------ backends
def _registry():
    from qcore.backend import registry

    return registry


def _capability_rows() -> list[tuple[str, list[QuantScheme]]]:
    """Rows of the capability matrix: per value its default scheme; per level/store feature every
    valid scheme that uses it (a backend supports the feature if it supports any of them)."""
    rows: list[tuple[str, list[QuantScheme]]] = []
    for v in QuantValue:
        rows.append((v.name, [base_scheme(v)]))

    bases = [base_scheme(v) for v in QuantValue]
    for v in QuantValue:  # LOOKUP variants, so a table-only backend shows its levels and stores
        try:
            bases.append(QuantScheme(v).with_mode(QuantMode.LOOKUP, "nf4"))
        except QCoreError:
            continue

    def variants(make) -> list[QuantScheme]:
        out = []
        for base in bases:
            try:
                out.append(make(base))
            except QCoreError:
                continue
        return out

    for dt in ScaleDtype:
        rows.append((f"per_block {dt.name}", variants(lambda s, dt=dt: s.per_block([32], dt))))
    rows.append(("two-level", variants(lambda s: s.per_block([16], ScaleDtype.UE4M3).per_tensor(ScaleDtype.F32))))
    rows.append(("Native", variants(lambda s: s.with_store(Native()))))
    rows.append(("PackedU32", variants(lambda s: s.with_store(PackedU32(0)))))
    rows.append(("PackedNative", variants(lambda s: s.with_store(PackedNative(0)))))
    rows.append(("LOOKUP (nf4)", [PRESETS["nf4"]]))
    rows.append(("signed scales", variants(lambda s: s.per_block([32], ScaleDtype.F16).with_signed_scales())))
    rows.append(("affine min", variants(lambda s: s.per_block([32], ScaleDtype.F16).with_offset("min", "f16"))))
    rows.append(("affine zero point", variants(lambda s: s.per_block([32], ScaleDtype.F16).with_offset("zero"))))
    for name in ("nvfp4", "mxfp4", "mxfp8", "q8_0", "q4_0", "q4_1"):
        rows.append((f"preset {name}", [PRESETS[name]]))
    return rows


def _available(be: Any) -> bool:
    return _registry().is_available(be)


def _supports(be: Any, schemes: list[QuantScheme]) -> bool:
    for s in schemes:
        try:
            if be.supports(s):
                return True
        except Exception:
            continue
    return False


def cmd_backends(args: argparse.Namespace) -> int:
    from rich.table import Table

    reg = _registry()
    out = console()
    found = reg.registered()
    out.print("[bold]qcore backends[/]")
    table = Table()
    for col in ("name", "available", "priority", "description"):
        table.add_column(col)
    ordered = sorted(found.values(), key=lambda b: (-int(b.priority), b.name))
    avail = {}
    for be in ordered:
        ok = reg.is_available(be)  # never hangs: a backend whose available() does not answer is skipped
        if not ok and be.name in reg.plugin_errors():
            desc = reg.plugin_errors()[be.name]
        else:
            try:
                desc = be.describe()
            except Exception as e:
                desc = f"describe() failed: {type(e).__name__}: {e}"
        avail[be.name] = ok
        table.add_row(be.name, "[green]yes[/]" if ok else "[red]no[/]", str(be.priority), desc)
    out.print(table)
    env = os.environ.get(reg.ENV_VAR)
    out.print(f"selection: {reg.ENV_VAR}={env!r}" if env else
              f"selection: {reg.ENV_VAR} unset -> 'auto' (highest priority available backend per scheme)")
    errors = reg.plugin_errors()
    if errors:
        out.print("[red]plugins that failed to load, and backends skipped:[/]")
        for name, err in sorted(errors.items()):
            out.print(f"  {name}: {err}", markup=False)
    if reg.disabled_plugins():
        out.print(f"plugins disabled by {reg.DISABLE_VAR}: {', '.join(reg.disabled_plugins())}", markup=False)
    out.print("[bold]capability[/] (yes: supported; -: rejected with a reason; levels and stores: supported with some value)")
    cap = Table()
    cap.add_column("value / level / store")
    for be in ordered:
        cap.add_column(be.name if avail[be.name] else f"{be.name} (unavailable)", justify="center")
    for label, schemes in _capability_rows():
        cap.add_row(label, *["[green]yes[/]" if _supports(be, schemes) else "[dim]-[/]" for be in ordered])
    out.print(cap)
    return EXIT_OK


# ------------------------------------------------------------------------------------ quantize
def _progress(console):
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[done]}/{task.fields[count]} tensors"),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=not console.is_terminal,
    )


def _recipe(args: argparse.Namespace) -> Recipe:
    """The recipe from --recipe, then --scheme / --include-1d / --min-size, with --skip and --rule first."""
    base = Recipe.from_toml(args.recipe) if args.recipe else Recipe()
    rules = [f"{pat}={KEEP}" for pat in args.skip or []] + list(args.rule or [])
    rc = as_recipe(base, rules=rules)
    return Recipe(parse_scheme(args.scheme) if args.scheme else rc.scheme, rc.rules,
                  rc.include_1d or args.include_1d, args.min_size if args.min_size else rc.min_size, rc.keep)


def _runner(args: argparse.Namespace, err, on_shard) -> tuple[Any, dict[str, Any]]:
    """quantize_model, or the shard-per-unit runner for --cluster/--scheduler and storage URLs."""
    from qcore.model.api import quantize_model
    from qcore.files.storage import is_url

    if not (args.cluster or args.scheduler or is_url(args.input) or is_url(args.output)):
        if args.group_size:
            raise _UsageError("--group-size splits shards into tasks of a --cluster or --scheduler run "
                              "(or of a run on storage URLs); give one of them")
        return quantize_model, {}
    from qcore.model.distributed import quantize_model_distributed

    return quantize_model_distributed, {"cluster": args.cluster, "scheduler": args.scheduler, "on_shard": on_shard,
                                        "group_bytes": args.group_size,
                                        "log": lambda text: err.print(text, markup=False)}


def cmd_quantize(args: argparse.Namespace) -> int:
    from rich.table import Table

    from qcore.backend.registry import backend as get_backend

    if args.min_size < 0:
        raise _UsageError("--min-size must be >= 0")
    if not (args.scheme or args.rule or args.recipe):
        raise _UsageError("give a scheme: --scheme SCHEME, --rule PATTERN=SCHEME or --recipe FILE.toml")
    recipe = _recipe(args)
    compare = [parse_scheme(s) for s in args.compare or []]
    be = get_backend(args.backend)
    for s in compare:
        _registry().require_support(be, s)
    if args.report:
        from qcore.cli import report

        report.require(args.report)
        if args.no_stats:
            raise _UsageError("--report draws the statistics that --no-stats skips; drop one of them")
    elif compare:
        raise _UsageError("--compare only adds schemes to a --report; give --report too")
    if os.path.abspath(args.input) == os.path.abspath(args.output):
        raise InputError("OUT must differ from IN; write elsewhere and move it if you want to replace IN")
    export = args.format != "qcore"
    if export and (args.resume or args.cluster or args.scheduler or args.report or "://" in args.input + args.output):
        raise _UsageError("--format writes another tool's checkpoint in one local run; --resume, --cluster, "
                          "--scheduler, --report and storage URLs go with --format qcore")
    if args.requantize and not export:
        raise _UsageError("--requantize FROM=TO goes with --format (the schemes a target format cannot hold)")
    if os.path.isfile(args.input) and "://" not in args.output and not export:
        qio.check_output_path(args.output)  # one file in, one file out: refuse a bad OUT before any work

    err = console(stderr=True)
    with _progress(err) as bar:
        title = f"quantize {recipe.scheme if not recipe.rules else 'by recipe'}"
        task = bar.add_task(title, total=1, done=0, count=0)
        done = [0]
        run, spread = _runner(args, err, lambda name, k, n: bar.update(task, description=f"{title} [{k}/{n} shards]"))
        progress = _track_progress() if not spread else None  # (the distributed runner reports by shard)

        def on_plan(count: int, nbytes: int) -> None:
            bar.update(task, total=nbytes or 1, count=count)

        def on_tensor(row) -> None:
            if row.quantized:
                done[0] += 1
                bar.update(task, advance=row.before, done=done[0])

        try:
            extra = {"format": args.format, "requantize": args.requantize or []} if export else {}
            res = run(args.input, args.output, recipe, be, max_shard_size=args.max_shard_size,
                      resume=args.resume, stats=not args.no_stats, compare=compare,
                      on_plan=on_plan, on_tensor=on_tensor, **({"progress": progress} if progress else spread),
                      **extra)
        except (QCoreError, OSError):  # (an interruption is reported by main, with what was left)
            kept = progress.complete() if progress is not None else os.path.isdir(args.output)
            if kept and os.path.isdir(args.output) and not export:  # complete shards are kept (resumable)
                print(f"qcore: complete shards in {args.output} are kept; the same command with --resume "
                      "continues from them", file=sys.stderr)
            raise

    q_rows = [r for r in res.tensors if r.quantized]
    if args.report:
        from qcore.cli import report

        names = [r.name for r in q_rows if not r.note]
        label = args.scheme if args.scheme and not recipe.rules else "recipe"
        series = {label: [r.sqnr for r in q_rows if not r.note],
                  **{t: [r.compare.get(str(s), math.nan) for r in q_rows if not r.note]
                     for t, s in zip(args.compare or [], compare)}}
        report.write(args.report, names, series, title=f"{os.path.basename(args.input)}: SQNR per tensor")

    out = console()
    what = str(recipe.scheme) if not recipe.rules else f"recipe: {recipe.describe()}"
    as_format = f", as {res.format}" if export else ""
    out.print(f"[bold]{args.input} -> {args.output}[/]  ({what} on {be.name}{as_format})", markup=True)
    table = Table()
    for col, just in (("tensor", "left"), ("shape", "left"), ("scheme / note", "left"), ("before", "right"),
                      ("after", "right"), ("SQNR dB", "right"), ("max |err|", "right")):
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    for r in res.tensors:
        if r.quantized and r.note:  # resumed: written by an earlier run
            table.add_row(r.name, fmt_shape(r.shape), f"{r.scheme} [dim]({r.note})[/]", fmt_bytes(r.before),
                          fmt_bytes(r.after), "", "")
        elif r.quantized:
            stats = ("", "") if args.no_stats else (fmt_db(r.sqnr), f"{r.max_err:.3g}")
            table.add_row(r.name, fmt_shape(r.shape), r.scheme, fmt_bytes(r.before), fmt_bytes(r.after), *stats)
        elif not args.verbose and r.note.startswith("kept: 1-D"):
            continue
        else:
            table.add_row(r.name, fmt_shape(r.shape), f"[dim]{escape(r.note)}[/]", fmt_bytes(r.before),
                          fmt_bytes(r.after), "", "")
    table.add_section()
    table.add_row(f"total ({len(q_rows)} of {len(res.tensors)} quantized)", "", "", fmt_bytes(res.before),
                  fmt_bytes(res.after), "", "")
    out.print(table)
    for name, change in getattr(res, "requantized", {}).items():
        out.print(f"requantized for {res.format}: {escape(name)}: {change}", markup=True)
    hidden = sum(1 for r in res.tensors if r.note.startswith("kept: 1-D"))
    if hidden and not args.verbose:
        out.print(f"{hidden} 1-D tensors kept as they are (not listed; --verbose lists them)")
    if res.resumed:
        out.print(f"resumed: {len(res.resumed)} shards already complete were kept: {', '.join(res.resumed)}",
                  markup=False)
    if len(res.files) > 1:
        out.print(f"wrote {len(res.files)} files to {args.output}", markup=False)
    out.print(f"wrote {args.output}: {fmt_bytes(res.before)} -> {fmt_bytes(res.after)} "
              f"({res.ratio:.2f}x smaller) in {res.seconds:.2f} s (sizes in the source dtypes)", markup=False)
    if args.report:
        out.print(f"wrote report {args.report}")
    return EXIT_OK


# ---------------------------------------------------------------------------------- dequantize
_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": "bfloat16", "float64": np.float64}


def cmd_dequantize(args: argparse.Namespace) -> int:
    import ml_dtypes

    from qcore.model.api import dequantize_model

    dtype = None
    if args.dtype is not None:
        dtype = np.dtype(ml_dtypes.bfloat16) if args.dtype == "bfloat16" else np.dtype(_DTYPES[args.dtype])
    if os.path.isfile(args.input):
        qio.check_output_path(args.output)  # before any work
    n, total = dequantize_model(args.input, args.output, dtype, backend=args.backend, progress=_track_progress())
    to = dtype if dtype is not None else "their source dtypes"
    console().print(f"wrote {args.output}: {n} of {total} tensors dequantized to {to}")
    return EXIT_OK


# ------------------------------------------------------------------------------------- inspect
def cmd_inspect(args: argparse.Namespace) -> int:
    from rich.markup import escape  # scheme text such as q4s-lookup[nf4] is not rich markup
    from rich.table import Table

    from qcore.files.checkpoint import resolve
    from qcore.cli.convert import format_of, read_info as read_foreign_info

    fmt = format_of(args.file)
    if fmt == "qcore":
        ck = resolve(args.file)
        infos = [qio.read_info(ck.path(s)) for s in ck.shards]
        ck.check_tensors({s: [e.name for e in info.entries] for s, info in zip(ck.shards, infos)})
        where = f"{len(infos)} shards in {ck.root}" if len(infos) > 1 else infos[0].path
    else:  # another tool's checkpoint, described as the qcore schemes it reads as
        infos = [read_foreign_info(args.file)[0]]
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
    """A file's stored recipe (`qcore.model.recipe` metadata) as inspect shows it: (its value in --json,
    its line in the table). Text that is not a valid recipe is shown as it is, with a note."""
    try:
        line = Recipe.from_json(text).describe()
    except (QCoreError, RecursionError) as e:
        shown = repr(text) if len(text) <= 200 else f"{text[:160]!r}... ({len(text)} characters)"
        return text, f"recipe (stored, not a valid recipe: {_one_line(e)}): {shown}"
    return json.loads(text), f"recipe: {line}"


# --------------------------------------------------------------------------------- conformance
def cmd_conformance(args: argparse.Namespace, extra: list[str]) -> int:
    try:
        from qcore.conformance import runner
    except ImportError as e:
        raise QCoreError(
            f"the conformance runner (qcore.conformance.runner) is not available in this install: {e}"
        ) from None
    argv = [a for name in args.backend for a in ("--backend", name)] + (["--full"] if args.full else []) + list(extra)
    rc = runner.main(argv)
    return int(rc or 0)


class _RunnerHelp(argparse.Action):
    """`qcore conformance --help`: the runner's own help (every option it takes), as `qcore
    conformance`; the other arguments go to the runner as they are."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        from qcore.conformance import runner

        rp = runner._parser()
        rp.prog = "qcore conformance"
        rp.print_help()
        parser.exit()


# --------------------------------------------------------------------------------------- bench
BENCH_SCHEMES = ("q8s", "q4s/block32:f16", "nvfp4")


def cmd_bench(args: argparse.Namespace) -> int:
    from rich.table import Table

    reg = _registry()
    labels = list(args.scheme or BENCH_SCHEMES)
    schemes = [parse_scheme(s) for s in labels]
    if args.size_mb <= 0 or args.repeat < 1:
        raise _UsageError("--size-mb must be > 0 and --repeat >= 1")
    found = reg.registered()
    names = args.backend or sorted(found, key=lambda n: (-int(found[n].priority), n))
    for n in names:
        if n not in found:
            reg.backend(n)  # raises BackendNotFoundError with the installed list
    n_el = max(256, int(args.size_mb * 1e6 / 4) // 256 * 256)
    x = np.random.default_rng(0).standard_normal((n_el // 256, 256)).astype(np.float32)
    out = console()
    out.print(f"[bold]quantize + dequantize throughput[/], GB/s of float32 input ({x.nbytes / 1e6:.2f} MB, "
              f"host to host, best of {args.repeat})")
    table = Table()
    table.add_column("backend")
    for label in labels:
        table.add_column(label, justify="right")
    notes = []
    for n in names:
        be = found[n]
        if not _available(be):
            table.add_row(n, *["unavailable"] * len(schemes))
            continue
        cells = []
        for s in schemes:
            sup = be.supports(s)
            if not sup:
                cells.append("-")
                notes.append(f"{n} / {s}: {sup.reason}")
                continue
            be.to_numpy(be.dequantize(be.quantize(x, s)))  # warm-up (JIT compilation, caches)
            best = math.inf
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                be.to_numpy(be.dequantize(be.quantize(x, s)))
                best = min(best, time.perf_counter() - t0)
            cells.append(f"{x.nbytes / best / 1e9:.3f}")
        table.add_row(n, *cells)
    out.print(table)
    for line in notes:
        out.print(f"  - {line}", markup=False)
    return EXIT_OK


# -------------------------------------------------------------------------------------- parser
def _parser() -> _Parser:
    p = _Parser(prog="qcore", description="Quantize tensors in safetensors files with pluggable backends.")
    p.add_argument("--version", action="version", version=f"qcore {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    s = sub.add_parser("backends", help="installed backends, availability and capability matrix")
    s.set_defaults(func=cmd_backends)

    s = sub.add_parser("quantize", help="quantize the float tensors of a model (file, sharded directory, hub id)",
                       description="Quantize IN (a .safetensors file, a sharded checkpoint directory, its "
                                   "model.safetensors.index.json, or a hub id in the local hub cache) by a recipe and "
                                   "write OUT (one file for one file, else a directory with the same shards, index and "
                                   "other files), each file atomically. Kept as they are: tensors that are not floats, "
                                   "1-D ones, embeddings and norms unless a rule names them, --min-size.")
    s.add_argument("input", metavar="IN", help="input: .safetensors file, checkpoint directory, index file, hub id, "
                   "or a storage URL (s3://..., see docs/distributed.md)")
    s.add_argument("output", metavar="OUT", help="output file (one-file input) or directory, or a URL")
    s.add_argument("--scheme", help="default scheme, e.g. q8s, q4s/block32:f16, nvfp4, nf4")
    s.add_argument("--rule", action="append", metavar="PATTERN=SCHEME",
                   help="per-tensor scheme, first match wins (repeatable): glob or re:REGEX, SCHEME or 'keep'; "
                        "e.g. '*.mlp.*=q4s/block32:f16', 're:^lm_head=keep'")
    s.add_argument("--recipe", metavar="FILE.toml", help="recipe file: scheme, [[rule]] pattern/scheme, include_1d, "
                                                         "min_size (--scheme and --rule go before it)")
    s.add_argument("--backend", default=None, help="backend name or 'auto' (default: $QCORE_BACKEND, else auto)")
    s.add_argument("--skip", action="append", metavar="PATTERN",
                   help="glob of tensor names to keep as they are (repeatable; same as --rule PATTERN=keep)")
    s.add_argument("--min-size", type=int, default=0, metavar="N",
                   help="keep tensors with fewer than N elements as they are")
    s.add_argument("--include-1d", action="store_true", help="also quantize 1-D tensors (biases, norms)")
    s.add_argument("--max-shard-size", metavar="SIZE", help="write new shards of at most SIZE (e.g. 5GB, 500MiB)")
    s.add_argument("--format", default="qcore", metavar="FORMAT",
                   help="write OUT in this format in the same step: qcore (default), compressed-tensors, gpt-oss, "
                        "bitsandbytes, torchao (a folder: shards, index, config.json, tokenizer) or gguf (one file); "
                        "each tensor keeps its recipe scheme, one the format cannot hold exactly is an error")
    s.add_argument("--requantize", action="append", metavar="FROM=TO",
                   help="with --format: quantize tensors whose scheme (FROM a scheme) or name (FROM a glob or "
                        "re:REGEX) the format cannot hold to scheme TO instead, from the float source (repeatable)")
    s.add_argument("--resume", action="store_true",
                   help="keep output shards an interrupted identical run completed (checked by their run marker)")
    s.add_argument("--no-stats", action="store_true", help="skip the per-tensor SQNR and max error")
    s.add_argument("--report", metavar="FILE", help="write an SQNR report (.html or .png; needs matplotlib)")
    s.add_argument("--compare", action="append", metavar="SCHEME",
                   help="also measure this scheme in the report (repeatable; not written to OUT)")
    s.add_argument("-v", "--verbose", action="store_true", help="list every tensor kept as it is")
    s.add_argument("--cluster", choices=["local"], help="one unit per shard on a Dask LocalCluster (one worker per "
                   "GPU for --backend cuda); needs qcore-quant[distributed], see docs/distributed.md")
    s.add_argument("--scheduler", metavar="ADDRESS", help="one unit per shard on the Dask cluster at ADDRESS "
                   "(e.g. tcp://10.0.0.1:8786)")
    s.add_argument("--group-size", metavar="SIZE", help="with --cluster/--scheduler: split a shard with more than "
                   "SIZE of source (e.g. 4GB) into tasks of consecutive tensors, assembled at the end (default: "
                   "the workers' memory limit)")
    s.set_defaults(func=cmd_quantize)

    s = sub.add_parser("dequantize", help="turn quantized tensors back into floats (their source dtype by default)")
    s.add_argument("input", metavar="IN", help="quantized file or checkpoint directory")
    s.add_argument("output", metavar="OUT")
    s.add_argument("--backend", default=None, help="backend name or 'auto' (default: $QCORE_BACKEND, else auto)")
    s.add_argument("--dtype", default=None, choices=sorted(_DTYPES),
                   help="output float dtype (default: each tensor's recorded source dtype, else float32)")
    s.set_defaults(func=cmd_dequantize)

    s = sub.add_parser("inspect", help="schemes, shapes, sizes, compression ratio and recipe of a file or checkpoint")
    s.add_argument("file", metavar="FILE", help="a .safetensors file, checkpoint directory, index file or hub id")
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    s.set_defaults(func=cmd_inspect)

    from qcore.cli.convert import add_convert

    add_convert(sub)

    s = sub.add_parser("conformance", help="run the conformance suite against a backend", add_help=False,
                       description="Run qcore's conformance suite against one or more backends.")
    s.add_argument("-h", "--help", action=_RunnerHelp, help="show every option of the runner and exit")
    s.add_argument("--backend", required=True, action="append", help="backend to check (repeatable)")
    s.add_argument("--full", action="store_true", help="run the full (slow) suite")
    s.set_defaults(func=cmd_conformance)

    s = sub.add_parser("bench", help="quick quantize+dequantize throughput per backend")
    s.add_argument("--backend", action="append", help="backend to measure (repeatable; default: all)")
    s.add_argument("--scheme", action="append", help=f"scheme (repeatable; default: {', '.join(BENCH_SCHEMES)})")
    s.add_argument("--size-mb", type=float, default=4.0, help="input size in MB of float32 (default 4)")
    s.add_argument("--repeat", type=int, default=3, help="timed runs per cell, best is shown (default 3)")
    s.set_defaults(func=cmd_bench)
    return p


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so the same cleanup runs (exit status 128 + 15)."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise _Terminated()


def _interrupted_message(output: str | None, before: tuple[int, int, int] | None) -> str:
    """Say what the interruption left: OUT written, OUT as it was, or nothing; for a folder, how
    many of its shards are complete and whether its index is written."""
    progress = _RUN.get("progress")
    if output and progress is not None and progress.planned:
        return _folder_message(output, progress)
    after = file_id(output)
    if after is not None and after != before:
        if os.path.isdir(output):  # a folder whose files were not tracked (a distributed run)
            return (f"qcore: interrupted; {output} may be incomplete: the same command with --resume keeps the "
                    "complete shards in it and writes the rest")
        return f"qcore: interrupted after {output} was written (it is complete)"
    if before is not None:
        return f"qcore: interrupted; {output} was left as it was"
    return "qcore: interrupted; no output file was written"


def _folder_message(output: str, progress: Any) -> str:
    """What an interrupted run left in its output folder (a `qcore.model.results.RunProgress`): complete
    only when every shard and the index are; else how many shards are, and the way on."""
    done = set(progress.complete())
    shards = sum(p in done for p in progress.shards)
    index_done = progress.index is None or progress.index in done
    if shards == len(progress.shards) and index_done:
        return f"qcore: interrupted after {output} was written (it is complete)"
    left = f"{shards} of {len(progress.shards)} shards complete"
    if progress.index is not None:
        left += ", and its index" if index_done else ", not its index"
    way = ("the same command with --resume keeps the complete shards in it and writes the rest" if progress.resumable
           else "the same command writes it whole")
    return f"qcore: interrupted; {output} is incomplete ({left}): {way}"


def _track_progress() -> Any:
    """A `qcore.model.results.RunProgress` for this run, where `_interrupted_message` finds it."""
    from qcore.model.results import RunProgress

    progress = RunProgress()
    _RUN["progress"] = progress
    return progress


_INDEX_SUFFIX = ".safetensors.index.json"


def _check_source(path: str) -> None:
    """Refuse, before any format is probed, a source that would block or never end: a FIFO, a
    device or a socket (reading waits for a writer, or goes on forever), and a checkpoint whose
    index is unreadable or names shards that are not files in its folder (an index naming `.`
    would be read again and again). Missing paths, hub ids and URLs are left to the command."""
    from qcore.files.checkpoint import resolve
    from qcore.files.storage import is_url

    if is_url(path) or not os.path.exists(path):
        return
    if not os.path.isdir(path):
        qio.check_input_path(path)  # a regular file, else StorageError naming it
        if path.endswith(_INDEX_SUFFIX):
            resolve(path)
    elif any(name.endswith(_INDEX_SUFFIX) for name in os.listdir(path)):
        resolve(path)


_RUN: dict[str, Any] = {"output": None, "before": None, "reported": False, "rc": None, "progress": None}
"""The running command's OUT, what was at OUT before, whether its outcome was reported (with
which exit status), and the files of a folder OUT (`qcore.model.results.RunProgress`): a module value,
so that the `qcore` entry point (`_qcore_launch`) can report truthfully on a signal that lands
on the first or last lines of `main`."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 ok, 1 error, 2 usage, 130 interrupted, 143 terminated).

    SIGTERM is handled like Ctrl-C (in the main thread): the temporary file goes, OUT is the old
    one or the new one. The process's SIGTERM handler is put back when the command ends.
    """
    with _signals.handling({signal.SIGTERM: _on_sigterm}):
        return _run(argv)


def _run(argv: Sequence[str] | None) -> int:
    """`main` inside its SIGTERM handler."""
    try:  # the first statement: a signal at any later point ends in one line and exit 130/143
        _RUN.update(output=None, before=None, reported=False, rc=None, progress=None)
        argv = list(sys.argv[1:] if argv is None else argv)
        args, extra = _parser().parse_known_args(argv)
        out = getattr(args, "output", None)
        _RUN.update(output=out, before=file_id(out))  # one step: a signal sees both or neither
        if args.command == "conformance":
            return cmd_conformance(args, extra)
        if extra:
            raise _UsageError(f"unrecognized arguments: {' '.join(extra)} (see 'qcore {args.command} --help')")
        if args.command in ("inspect", "convert"):  # (quantize and dequantize check theirs as they resolve it)
            _check_source(args.file if args.command == "inspect" else args.src)
        rc = int(args.func(args))
        _RUN.update(reported=True, rc=rc)
        return rc
    except SystemExit as e:  # --help, --version
        return e.code if isinstance(e.code, int) else (EXIT_OK if e.code is None else EXIT_ERROR)
    except _UsageError as e:
        print(f"qcore: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt as e:
        print(_interrupted_message(_RUN["output"], _RUN["before"]), file=sys.stderr)
        rc = EXIT_TERMINATED if isinstance(e, _Terminated) else EXIT_INTERRUPTED
        _RUN.update(reported=True, rc=rc)
        return rc
    except QCoreError as e:
        print(f"qcore: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_ERROR
    except OSError as e:
        where = f"{e.filename}: " if getattr(e, "filename", None) else ""
        print(f"qcore: error: {where}{e.strerror or _one_line(e)}", file=sys.stderr)
        return EXIT_ERROR
    except (MemoryError, RecursionError) as e:
        print(f"qcore: error: out of {'memory' if isinstance(e, MemoryError) else 'stack'} "
              f"({_one_line(e)}); try a smaller input or a backend with less memory use", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
