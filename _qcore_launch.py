"""Entry point of the `qcore` command.

It catches Ctrl-C while the library is still being imported (numpy, safetensors, rich: tens of
milliseconds), which would otherwise print a KeyboardInterrupt traceback, then hands over to
`qcore.cli.main`, which handles interruption from there on. It lives outside the `qcore` package
because importing anything inside the package first imports the whole library.
"""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """`qcore.cli.main(argv)`, with a signal that lands outside its reach (while importing, or on
    its first or last lines) still ending in one true line and exit 130 (SIGINT) / 143 (SIGTERM)."""
    try:
        from qcore import cli

        cli._RUN.update(output=None, before=None, reported=False, rc=None)  # this run's, from here on
        return cli.main(argv)
    except KeyboardInterrupt as e:
        cli = sys.modules.get("qcore.cli")
        if cli is None:
            sys.stderr.write("qcore: interrupted; no output file was written\n")
            return 130
        if cli._RUN.get("reported"):  # the outcome was already printed: keep its exit status
            return int(cli._RUN["rc"])
        sys.stderr.write(cli._interrupted_message(cli._RUN["output"], cli._RUN["before"]) + "\n")
        return 143 if isinstance(e, cli._Terminated) else 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
