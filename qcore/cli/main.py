"""The `qcore` command line: backends, quantize, dequantize, inspect, convert, conformance, bench.

Thin by design: every rule lives in the library; this module parses arguments and hands each
command to its module (`qcore.cli.backends`, `quantize`, `inspect`, `convert`, `conformance`,
`bench`), which calls the library and prints tables. User mistakes print one line
(`qcore: error: ...`) and exit 2 (usage) or 1 (a `QCoreError` or an unreadable file); Ctrl-C
exits 130 and leaves no partial output file (`qcore.cli.interrupt` says what was left).
"""
from __future__ import annotations

import os
import signal
import sys
from typing import Sequence

from qcore import _signals
from qcore._version import __version__
from qcore.errors import QCoreError
from qcore.files import io as qio
from qcore.files.paths import check_input_path, is_url
from qcore.backend.stats import error_stats
from qcore.model.results import file_id
from qcore.cli import backends, bench, conformance, inspect, quantize
from qcore.cli.args import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK, EXIT_TERMINATED, EXIT_USAGE, Parser, UsageError
from qcore.cli.args import one_line as _one_line
from qcore.cli.convert import add_convert
from qcore.cli.interrupt import RUN as _RUN
from qcore.cli.interrupt import Terminated as _Terminated
from qcore.cli.interrupt import interrupted_message as _interrupted_message
from qcore.cli.interrupt import on_sigterm as _on_sigterm

__all__ = ["main", "error_stats"]


def _parser() -> Parser:
    p = Parser(prog="qcore", description="Quantize tensors in safetensors files with pluggable backends.")
    p.add_argument("--version", action="version", version=f"qcore {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True
    backends.add_parser(sub)
    quantize.add_parsers(sub)
    inspect.add_parser(sub)
    add_convert(sub)
    conformance.add_parser(sub)
    bench.add_parser(sub)
    return p


def _check_source(path: str) -> None:
    """Refuse, before any format is probed, a source that would block or never end: a FIFO, a
    device or a socket (reading waits for a writer, or goes on forever), and a checkpoint whose
    index is unreadable or names shards that are not files in its folder (an index naming `.`
    would be read again and again). Missing paths, hub ids and URLs are left to the command."""
    from qcore.files.checkpoint import INDEX_SUFFIX, resolve

    if is_url(path) or not os.path.exists(path):
        return
    if not os.path.isdir(path):
        check_input_path(path)  # a regular file, else StorageError naming it
        if path.endswith(INDEX_SUFFIX):
            resolve(path)
    elif any(name.endswith(INDEX_SUFFIX) for name in os.listdir(path)):
        resolve(path)


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
            return conformance.cmd_conformance(args, extra)
        if extra:
            raise UsageError(f"unrecognized arguments: {' '.join(extra)} (see 'qcore {args.command} --help')")
        if args.command in ("inspect", "convert"):  # (quantize and dequantize check theirs as they resolve it)
            _check_source(args.file if args.command == "inspect" else args.src)
        rc = int(args.func(args))
        _RUN.update(reported=True, rc=rc)
        return rc
    except SystemExit as e:  # --help, --version
        return e.code if isinstance(e.code, int) else (EXIT_OK if e.code is None else EXIT_ERROR)
    except UsageError as e:
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
