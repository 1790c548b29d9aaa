"""Entry point of the `qcore` command.

It holds Ctrl-C and SIGTERM while the library is imported (numpy, safetensors, rich: tens of
milliseconds) and answers one that came then with one line and exit 130/143, then hands over to
`qcore.cli.main.main`, which handles interruption from there on. It lives outside the `qcore` package
because importing anything inside the package first imports the whole library.
"""
from __future__ import annotations

import signal
import sys
from types import ModuleType


def main(argv: list[str] | None = None) -> int:
    """`qcore.cli.main.main(argv)`, with a signal that lands outside its reach (while importing, or on
    its first or last lines) still ending in one true line and exit 130 (SIGINT) / 143 (SIGTERM)."""
    try:
        cli, held = _import_cli()
        if held is not None:  # a signal came while importing: nothing was started
            sys.stderr.write("qcore: interrupted; no output file was written\n")
            return 143 if held == signal.SIGTERM else 130
        cli._RUN.update(output=None, before=None, reported=False, rc=None)  # this run's, from here on
        return cli.main(argv)
    except KeyboardInterrupt as e:
        cli = sys.modules.get("qcore.cli.main")
        if cli is None:
            sys.stderr.write("qcore: interrupted; no output file was written\n")
            return 130
        if cli._RUN.get("reported"):  # the outcome was already printed: keep its exit status
            return int(cli._RUN["rc"])
        sys.stderr.write(cli._interrupted_message(cli._RUN["output"], cli._RUN["before"]) + "\n")
        return 143 if isinstance(e, cli._Terminated) else 130


def _import_cli() -> "tuple[ModuleType, int | None]":
    """(`qcore.cli.main`, the first signal that came during its import, or None).

    SIGINT/SIGTERM are held while the library is imported: a KeyboardInterrupt raised inside an
    extension module's initialisation can surface as an ImportError (numpy's C core does this), so a
    signal is taken after the import instead.
    """
    caught: list[int] = []
    # every old handler read before any changes, and a signal listed as held before its hold goes
    # in: a signal that lands between two steps cannot leave a hold behind for the process
    # (`qcore._signals.handling` does the same for the library; it cannot be imported yet)
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    held: list[int] = []
    try:
        for sig in previous:
            held.append(sig)
            try:
                signal.signal(sig, lambda s, _f: caught.append(s))
            except (ValueError, OSError):  # not the main thread, or not settable here
                held.remove(sig)
        from qcore.cli import main as cli
    finally:
        for sig in held:
            signal.signal(sig, signal.SIG_DFL if previous[sig] is None else previous[sig])
    return cli, (caught[0] if caught else None)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
