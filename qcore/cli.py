"""The `qcore` command line: backends, quantize, dequantize, inspect, convert, conformance, bench.

Thin by design: every rule lives in the library; this module parses arguments, calls it and
prints tables. User mistakes print one line (`qcore: error: ...`) and exit 2 (usage) or 1
(a `QCoreError` or an unreadable file); Ctrl-C exits 130 and leaves no partial output file.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from . import __version__
from . import io as qio
from .checks import INPUT_DTYPES
from .errors import InputError, QCoreError, UnsupportedSchemeError
from .payload import QuantizedData
from .scheme import PRESETS, Native, PackedNative, PackedU32, QuantMode, QuantScheme, QuantValue, ScaleDtype
from .scheme import scheme as parse_scheme

__all__ = ["main"]

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage mistakes as one line instead of exiting."""

    def error(self, message: str):  # type: ignore[override]
        raise _UsageError(f"{message} (see '{self.prog} --help')")


# --------------------------------------------------------------------------------------- output
def _console(stderr: bool = False):
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    wide = None if stream.isatty() else 160  # rich would wrap tables at 80 columns in a pipe
    return Console(file=stream, width=wide, highlight=False, soft_wrap=True)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _fmt_db(v: float) -> str:
    return "exact" if math.isinf(v) else f"{v:.2f}"


def _shape(shape: Sequence[int]) -> str:
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


def error_stats(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(SQNR in dB, max |x - y|) computed in float64; SQNR is inf when the error is zero."""
    x64 = np.asarray(x, dtype=np.float64).reshape(-1)
    err = np.asarray(y, dtype=np.float64).reshape(-1) - x64
    noise = float(np.dot(err, err))
    signal = float(np.dot(x64, x64))
    max_err = float(np.max(np.abs(err))) if err.size else 0.0
    if noise == 0.0:
        return math.inf, max_err
    if signal == 0.0:
        return -math.inf, max_err
    return 10.0 * math.log10(signal / noise), max_err


# ------------------------------------------------------------------------------------ backends
def _registry():
    from . import registry

    return registry


def _capability_rows() -> list[tuple[str, list[QuantScheme]]]:
    """Rows of the capability matrix: per value its default scheme; per level/store feature every
    valid scheme that uses it (a backend supports the feature if it supports any of them)."""
    rows: list[tuple[str, list[QuantScheme]]] = []
    for v in QuantValue:
        rows.append((v.name, [QuantScheme(v)]))

    bases = [QuantScheme(v) for v in QuantValue]
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
    for name in ("nvfp4", "mxfp4", "mxfp8"):
        rows.append((f"preset {name}", [PRESETS[name]]))
    return rows


def _available(be: Any) -> bool:
    try:
        return bool(be.available())
    except Exception:
        return False


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
    out = _console()
    found = reg.registered()
    out.print("[bold]qcore backends[/]")
    table = Table()
    for col in ("name", "available", "priority", "description"):
        table.add_column(col)
    ordered = sorted(found.values(), key=lambda b: (-int(b.priority), b.name))
    avail = {}
    for be in ordered:
        try:
            ok = bool(be.available())
        except Exception as e:
            ok = False
            desc = f"available() failed: {type(e).__name__}: {e}"
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
        out.print("[red]plugins that failed to load:[/]")
        for name, err in sorted(errors.items()):
            out.print(f"  {name}: {err}", markup=False)
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
@dataclass
class _Row:
    name: str
    shape: tuple[int, ...]
    before: int
    after: int
    note: str = ""
    scheme: str = ""
    sqnr: float = math.nan
    max_err: float = math.nan

    @property
    def quantized(self) -> bool:
        return bool(self.scheme)


def _is_float(a: np.ndarray) -> bool:
    return a.dtype in INPUT_DTYPES


def _plan(name: str, value: Any, args: argparse.Namespace) -> str:
    """Why `name` is kept as it is ('' = quantize it)."""
    if isinstance(value, QuantizedData):
        return f"already quantized ({value.scheme})"
    if not _is_float(value):
        return f"kept: {value.dtype} is not a float dtype"
    for pat in args.skip or []:
        if fnmatch.fnmatchcase(name, pat):
            return f"kept: matches --skip {pat!r}"
    if value.ndim < 2 and not args.include_1d:
        return "kept: 1-D (biases, norms; --include-1d quantizes them)"
    if value.size < args.min_size:
        return f"kept: {value.size} elements < --min-size {args.min_size}"
    return ""


def _check_backend_supports(be: Any, sch: QuantScheme) -> None:
    sup = be.supports(sch)
    if not sup:
        others = _registry().supporting_backends(sch)
        where = f"backends that do: {', '.join(others)}" if others else "no installed backend does"
        raise UnsupportedSchemeError(f"backend '{be.name}' does not support {sch}: {sup.reason}; {where}")


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


def cmd_quantize(args: argparse.Namespace) -> int:
    from rich.table import Table

    from .registry import backend as get_backend

    sch = parse_scheme(args.scheme)
    compare = [parse_scheme(s) for s in args.compare or []]
    if args.min_size < 0:
        raise _UsageError("--min-size must be >= 0")
    be = get_backend(args.backend)
    for s in [sch, *compare]:
        _check_backend_supports(be, s)
    if args.report:
        from . import report

        report.require(args.report)
    elif compare:
        raise _UsageError("--compare only adds schemes to a --report; give --report too")
    if os.path.abspath(args.input) == os.path.abspath(args.output):
        raise InputError("OUT must differ from IN; write elsewhere and move it if you want to replace IN")

    info = qio.read_info(args.input)
    tensors = qio.load_data(args.input)
    plan = {name: _plan(name, v, args) for name, v in tensors.items()}
    todo = [n for n, why in plan.items() if not why]
    total = sum(tensors[n].nbytes for n in todo)
    err = _console(stderr=True)
    out_tensors: dict[str, Any] = {}
    rows: list[_Row] = []
    compare_sqnr: dict[str, list[float]] = {t: [] for t in args.compare or []}
    with _progress(err) as bar:
        task = bar.add_task(f"quantize {sch}", total=total or 1, done=0, count=len(todo))
        done = 0
        for name, value in tensors.items():
            if isinstance(value, QuantizedData):
                rows.append(_Row(name, value.shape, value.nbytes, value.nbytes, plan[name]))
                out_tensors[name] = value
                continue
            if plan[name]:
                rows.append(_Row(name, value.shape, value.nbytes, value.nbytes, plan[name]))
                out_tensors[name] = value
                continue
            try:
                q = be.quantize(value, sch)
            except InputError as e:  # e.g. a block with more dims than the tensor, NaN/Inf
                rows.append(_Row(name, value.shape, value.nbytes, value.nbytes, f"kept: {e}"))
                out_tensors[name] = value
            else:
                d = q.to_data()
                sqnr, max_err = error_stats(value, q.numpy())
                rows.append(_Row(name, value.shape, value.nbytes, d.nbytes, "", str(sch), sqnr, max_err))
                out_tensors[name] = d
                for t, s in zip(args.compare or [], compare):
                    try:
                        y = be.quantize(value, s).numpy()
                        compare_sqnr[t].append(error_stats(value, y)[0])
                    except InputError:
                        compare_sqnr[t].append(math.nan)
            done += 1
            bar.update(task, advance=value.nbytes, done=done)
    qio.save(args.output, out_tensors, metadata=info.metadata)

    q_rows = [r for r in rows if r.quantized]
    if args.report:
        from . import report

        names = [r.name for r in q_rows]
        series = {args.scheme: [r.sqnr for r in q_rows], **compare_sqnr}
        report.write(args.report, names, series, title=f"{os.path.basename(args.input)}: SQNR per tensor")

    out = _console()
    out.print(f"[bold]{args.input} -> {args.output}[/]  ({sch} on {be.name})")
    table = Table()
    for col, just in (("tensor", "left"), ("shape", "left"), ("scheme / note", "left"), ("before", "right"),
                      ("after", "right"), ("SQNR dB", "right"), ("max |err|", "right")):
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    for r in rows:
        if r.quantized:
            table.add_row(r.name, _shape(r.shape), r.scheme, _fmt_bytes(r.before), _fmt_bytes(r.after),
                          _fmt_db(r.sqnr), f"{r.max_err:.3g}")
        elif not args.verbose and r.note.startswith("kept: 1-D"):
            continue
        else:
            table.add_row(r.name, _shape(r.shape), f"[dim]{r.note}[/]", _fmt_bytes(r.before),
                          _fmt_bytes(r.after), "", "")
    before, after = sum(r.before for r in rows), sum(r.after for r in rows)
    table.add_section()
    table.add_row(f"total ({len(q_rows)} of {len(rows)} quantized)", "", "", _fmt_bytes(before),
                  _fmt_bytes(after), "", "")
    out.print(table)
    hidden = sum(1 for r in rows if r.note.startswith("kept: 1-D"))
    if hidden and not args.verbose:
        out.print(f"{hidden} 1-D tensors kept as they are (not listed; --verbose lists them)")
    ratio = before / after if after else math.inf
    out.print(f"wrote {args.output}: {_fmt_bytes(before)} -> {_fmt_bytes(after)} ({ratio:.2f}x smaller)")
    if args.report:
        out.print(f"wrote report {args.report}")
    return EXIT_OK


# ---------------------------------------------------------------------------------- dequantize
_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": "bfloat16", "float64": np.float64}


def cmd_dequantize(args: argparse.Namespace) -> int:
    import ml_dtypes

    dtype = np.dtype(ml_dtypes.bfloat16) if args.dtype == "bfloat16" else np.dtype(_DTYPES[args.dtype])
    info = qio.read_info(args.input)
    loaded = qio.load(args.input, backend=args.backend)
    out: dict[str, Any] = {}
    n = 0
    for name, v in loaded.items():
        if isinstance(v, np.ndarray):
            out[name] = v
        else:
            out[name] = v.numpy(dtype)
            n += 1
    qio.save(args.output, out, metadata=info.metadata)
    _console().print(f"wrote {args.output}: {n} of {len(out)} tensors dequantized to {dtype}")
    return EXIT_OK


# ------------------------------------------------------------------------------------- inspect
def cmd_inspect(args: argparse.Namespace) -> int:
    from rich.markup import escape  # scheme text such as q4s-lookup[nf4] is not rich markup
    from rich.table import Table

    from .formats.cli import read_info

    info, fmt = read_info(args.file)
    rows = []
    for e in info.entries:
        as_f32 = e.numel * 4 if (e.quantized or e.dtype.startswith(("F", "BF"))) else e.nbytes
        rows.append({
            "name": e.name,
            "kind": str(e.scheme) if e.quantized else e.dtype,
            "quantized": e.quantized,
            "shape": list(e.shape),
            "bytes": e.nbytes,
            "f32_bytes": as_f32,
            "ratio": (as_f32 / e.nbytes) if e.nbytes else 1.0,
        })
    stored = sum(r["bytes"] for r in rows)
    as_f32 = sum(r["f32_bytes"] for r in rows)
    summary = {
        "file": info.path,
        "format": fmt,
        "format_version": info.format_version,
        "file_size": info.file_size,
        "tensors": len(rows),
        "quantized": sum(r["quantized"] for r in rows),
        "schemes": sorted({r["kind"] for r in rows if r["quantized"]}),
        "stored_bytes": stored,
        "f32_bytes": as_f32,
        "ratio": as_f32 / stored if stored else 1.0,
        "metadata": info.metadata,
    }
    if args.json:
        print(json.dumps({**summary, "entries": rows}, indent=1))
        return EXIT_OK
    out = _console()
    kind = f"{fmt} checkpoint, read as qcore schemes" if fmt != "qcore" else \
        f"qcore format {info.format_version or '- (plain safetensors)'}"
    out.print(f"[bold]{info.path}[/]  ({kind})")
    table = Table()
    for col, just in (("tensor", "left"), ("scheme / dtype", "left"), ("shape", "left"), ("stored", "right"),
                      ("as f32", "right"), ("ratio", "right")):
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    for r in rows:
        table.add_row(escape(r["name"]), escape(r["kind"]), _shape(r["shape"]), _fmt_bytes(r["bytes"]),
                      _fmt_bytes(r["f32_bytes"]), f"{r['ratio']:.2f}x")
    table.add_section()
    table.add_row(f"total ({summary['quantized']} of {len(rows)} quantized)", escape(", ".join(summary["schemes"])),
                  "",
                  _fmt_bytes(stored), _fmt_bytes(as_f32), f"{summary['ratio']:.2f}x")
    out.print(table)
    out.print(f"file size {_fmt_bytes(info.file_size)}; compression vs float32: {summary['ratio']:.2f}x")
    for k, v in sorted(info.metadata.items()):
        out.print(f"metadata {k} = {v}", markup=False)
    return EXIT_OK


# --------------------------------------------------------------------------------- conformance
def cmd_conformance(args: argparse.Namespace, extra: list[str]) -> int:
    try:
        from .conformance import runner
    except ImportError as e:
        raise QCoreError(
            f"the conformance runner (qcore.conformance.runner) is not available in this install: {e}"
        ) from None
    argv = [a for name in args.backend for a in ("--backend", name)] + (["--full"] if args.full else []) + list(extra)
    rc = runner.main(argv)
    return int(rc or 0)


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
    out = _console()
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

    s = sub.add_parser("quantize", help="quantize the float tensors of a safetensors file",
                       description="Quantize every float tensor of IN (except 1-D ones, --skip matches and "
                                   "tensors smaller than --min-size) and write OUT atomically.")
    s.add_argument("input", metavar="IN", help="input .safetensors file")
    s.add_argument("output", metavar="OUT", help="output .safetensors file (written atomically)")
    s.add_argument("--scheme", required=True, help="scheme text, e.g. q8s, q4s/block32:f16, nvfp4, nf4")
    s.add_argument("--backend", default=None, help="backend name or 'auto' (default: $QCORE_BACKEND, else auto)")
    s.add_argument("--skip", action="append", metavar="PATTERN",
                   help="glob of tensor names to keep as they are (repeatable), e.g. '*embeddings*'")
    s.add_argument("--min-size", type=int, default=0, metavar="N",
                   help="keep tensors with fewer than N elements as they are")
    s.add_argument("--include-1d", action="store_true", help="also quantize 1-D tensors (biases, norms)")
    s.add_argument("--report", metavar="FILE", help="write an SQNR report (.html or .png; needs matplotlib)")
    s.add_argument("--compare", action="append", metavar="SCHEME",
                   help="also measure this scheme in the report (repeatable; not written to OUT)")
    s.add_argument("-v", "--verbose", action="store_true", help="list every tensor kept as it is")
    s.set_defaults(func=cmd_quantize)

    s = sub.add_parser("dequantize", help="turn quantized tensors back into floats")
    s.add_argument("input", metavar="IN")
    s.add_argument("output", metavar="OUT")
    s.add_argument("--backend", default=None, help="backend name or 'auto' (default: $QCORE_BACKEND, else auto)")
    s.add_argument("--dtype", default="float32", choices=sorted(_DTYPES), help="output float dtype")
    s.set_defaults(func=cmd_dequantize)

    s = sub.add_parser("inspect", help="schemes, shapes, sizes and compression ratio of a file")
    s.add_argument("file", metavar="FILE")
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    s.set_defaults(func=cmd_inspect)

    from .formats.cli import add_convert

    add_convert(sub)

    s = sub.add_parser("conformance", help="run the conformance suite against a backend",
                       description="Run qcore's conformance suite against one or more backends.",
                       epilog="Other arguments go to the runner (qcore.conformance.runner), e.g. --seed N, "
                              "--max-elements N, --max-schemes N, --filter TEXT, --checks case,bad-input,ops,cross, "
                              "--no-progress.")
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


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 ok, 1 error, 2 usage, 130 interrupted)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args, extra = _parser().parse_known_args(argv)
        if args.command == "conformance":
            return cmd_conformance(args, extra)
        if extra:
            raise _UsageError(f"unrecognized arguments: {' '.join(extra)} (see 'qcore {args.command} --help')")
        return int(args.func(args))
    except SystemExit as e:  # --help, --version
        return e.code if isinstance(e.code, int) else (EXIT_OK if e.code is None else EXIT_ERROR)
    except _UsageError as e:
        print(f"qcore: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("qcore: interrupted; no output file was written", file=sys.stderr)
        return EXIT_INTERRUPTED
    except QCoreError as e:
        print(f"qcore: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_ERROR
    except OSError as e:
        where = f"{e.filename}: " if getattr(e, "filename", None) else ""
        print(f"qcore: error: {where}{e.strerror or _one_line(e)}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
