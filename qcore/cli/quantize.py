"""`qcore quantize` and `qcore dequantize`: whole models, with a progress bar and a table of what
happened to each tensor (`qcore.model.api`; `qcore.model.distributed` for a cluster or URLs)."""
from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any

import numpy as np

from qcore.errors import InputError, QCoreError
from qcore.spec.schemes import scheme as parse_scheme
from qcore.files import io as qio
from qcore.files.checkpoint import check_apart
from qcore.files.paths import check_output_path, is_url
from qcore.model.reasons import Reason
from qcore.model.recipe import KEEP, Recipe, as_recipe
from qcore.model.results import ModelResult
from qcore.cli.args import EXIT_OK, UsageError
from qcore.cli.console import console, escape, fmt_bytes, fmt_db, fmt_shape
from qcore.cli.interrupt import track_progress

__all__ = ["add_parsers", "cmd_quantize", "cmd_dequantize"]

_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": "bfloat16", "float64": np.float64}


def add_parsers(sub: Any) -> None:
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

    if not (args.cluster or args.scheduler or is_url(args.input) or is_url(args.output)):
        if args.group_size:
            raise UsageError("--group-size splits shards into tasks of a --cluster or --scheduler run "
                             "(or of a run on storage URLs); give one of them")
        return quantize_model, {}
    from qcore.model.distributed import quantize_model_distributed

    return quantize_model_distributed, {"cluster": args.cluster, "scheduler": args.scheduler, "on_shard": on_shard,
                                        "group_bytes": args.group_size,
                                        "log": lambda text: err.print(text, markup=False)}


def cmd_quantize(args: argparse.Namespace) -> int:
    from qcore.backend import registry

    if args.min_size < 0:
        raise UsageError("--min-size must be >= 0")
    if not (args.scheme or args.rule or args.recipe):
        raise UsageError("give a scheme: --scheme SCHEME, --rule PATTERN=SCHEME or --recipe FILE.toml")
    recipe = _recipe(args)
    compare = [parse_scheme(s) for s in args.compare or []]
    be = registry.backend(args.backend)
    for s in compare:
        registry.require_support(be, s)
    if args.report:
        from qcore.cli import report

        report.require(args.report)
        if args.no_stats:
            raise UsageError("--report draws the statistics that --no-stats skips; drop one of them")
    elif compare:
        raise UsageError("--compare only adds schemes to a --report; give --report too")
    check_apart(args.input, args.output)  # before any work (the library checks it again, knowing the output's form)
    export = args.format != "qcore"
    if export and (args.resume or args.cluster or args.scheduler or args.report or "://" in args.input + args.output):
        raise UsageError("--format writes another tool's checkpoint in one local run; --resume, --cluster, "
                         "--scheduler, --report and storage URLs go with --format qcore")
    if args.requantize and not export:
        raise UsageError("--requantize FROM=TO goes with --format (the schemes a target format cannot hold)")
    if os.path.isfile(args.input) and "://" not in args.output and not export:
        check_output_path(args.output)  # one file in, one file out: refuse a bad OUT before any work

    err = console(stderr=True)
    with _progress(err) as bar:
        title = f"quantize {recipe.scheme if not recipe.rules else 'by recipe'}"
        task = bar.add_task(title, total=1, done=0, count=0)
        done = [0]
        run, spread = _runner(args, err, lambda name, k, n: bar.update(task, description=f"{title} [{k}/{n} shards]"))
        progress = track_progress() if not spread else None  # (the distributed runner reports by shard)

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

    if args.report:
        _write_report(args, recipe, compare, res)
    _print_result(args, recipe, be.name, export, res)
    return EXIT_OK


def _write_report(args: argparse.Namespace, recipe: Recipe, compare: list, res: ModelResult) -> None:
    """The SQNR report of the tensors this run quantized (resumed ones were measured by another)."""
    from qcore.cli import report

    measured = [r for r in res.tensors if r.quantized and r.reason_code is not Reason.RESUMED]
    label = args.scheme if args.scheme and not recipe.rules else "recipe"
    series = {label: [r.sqnr for r in measured],
              **{t: [r.compare.get(str(s), math.nan) for r in measured] for t, s in zip(args.compare or [], compare)}}
    report.write(args.report, [r.name for r in measured], series,
                 title=f"{os.path.basename(args.input)}: SQNR per tensor")


def _print_result(args: argparse.Namespace, recipe: Recipe, backend: str, export: bool, res: ModelResult) -> None:
    """The table of every tensor (1-D ones kept only with --verbose) and the summary lines."""
    from rich.table import Table

    out = console()
    what = str(recipe.scheme) if not recipe.rules else f"recipe: {recipe.describe()}"
    as_format = f", as {res.format}" if export else ""
    out.print(f"[bold]{args.input} -> {args.output}[/]  ({what} on {backend}{as_format})", markup=True)
    table = Table()
    for col, just in (("tensor", "left"), ("shape", "left"), ("scheme / note", "left"), ("before", "right"),
                      ("after", "right"), ("SQNR dB", "right"), ("max |err|", "right")):
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    for r in res.tensors:
        if r.quantized and r.reason_code is Reason.RESUMED:  # written by an earlier run
            table.add_row(r.name, fmt_shape(r.shape), f"{r.scheme} [dim]({r.note})[/]", fmt_bytes(r.before),
                          fmt_bytes(r.after), "", "")
        elif r.quantized:
            stats = ("", "") if args.no_stats else (fmt_db(r.sqnr), f"{r.max_err:.3g}")
            table.add_row(r.name, fmt_shape(r.shape), r.scheme, fmt_bytes(r.before), fmt_bytes(r.after), *stats)
        elif not args.verbose and r.reason_code is Reason.ONE_D:
            continue
        else:
            table.add_row(r.name, fmt_shape(r.shape), f"[dim]{escape(r.note)}[/]", fmt_bytes(r.before),
                          fmt_bytes(r.after), "", "")
    table.add_section()
    n_quantized = sum(r.quantized for r in res.tensors)
    table.add_row(f"total ({n_quantized} of {len(res.tensors)} quantized)", "", "", fmt_bytes(res.before),
                  fmt_bytes(res.after), "", "")
    out.print(table)
    for name, change in res.requantized.items():
        out.print(f"requantized for {res.format}: {escape(name)}: {change}", markup=True)
    hidden = sum(1 for r in res.tensors if r.reason_code is Reason.ONE_D)
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


# ---------------------------------------------------------------------------------- dequantize
def cmd_dequantize(args: argparse.Namespace) -> int:
    import ml_dtypes

    from qcore.model.api import dequantize_model

    dtype = None
    if args.dtype is not None:
        dtype = np.dtype(ml_dtypes.bfloat16) if args.dtype == "bfloat16" else np.dtype(_DTYPES[args.dtype])
    if os.path.isfile(args.input):
        check_output_path(args.output)  # before any work
    n, total = dequantize_model(args.input, args.output, dtype, backend=args.backend, progress=track_progress())
    to = dtype if dtype is not None else "their source dtypes"
    console().print(f"wrote {args.output}: {n} of {total} tensors dequantized to {to}")
    return EXIT_OK
