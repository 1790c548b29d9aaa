"""`qcore conformance`: run the conformance suite against backends (`qcore.conformance.runner`)."""
from __future__ import annotations

import argparse
from typing import Any

from qcore.errors import QCoreError

__all__ = ["add_parser", "cmd_conformance"]


def add_parser(sub: Any) -> None:
    s = sub.add_parser("conformance", help="run the conformance suite against a backend", add_help=False,
                       description="Run qcore's conformance suite against one or more backends.")
    s.add_argument("-h", "--help", action=_RunnerHelp, help="show every option of the runner and exit")
    s.add_argument("--backend", required=True, action="append", help="backend to check (repeatable)")
    s.add_argument("--full", action="store_true", help="run the full (slow) suite")
    s.set_defaults(func=cmd_conformance)


def cmd_conformance(args: argparse.Namespace, extra: list[str]) -> int:
    """The runner with `--backend`/`--full` and the arguments the `qcore` parser did not know (`extra`)."""
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

        rp = runner.parser()
        rp.prog = "qcore conformance"
        rp.print_help()
        parser.exit()
