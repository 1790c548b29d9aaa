"""What every `qcore` command shares: the exit statuses, and an argument parser that reports a
usage mistake as one line (`UsageError`) instead of exiting."""
from __future__ import annotations

import argparse

__all__ = ["EXIT_OK", "EXIT_ERROR", "EXIT_USAGE", "EXIT_INTERRUPTED", "EXIT_TERMINATED", "UsageError", "Parser",
           "one_line"]

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 1, 2, 130, 143


class UsageError(Exception):
    """A mistake in the command line: one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """argparse that reports usage mistakes as one line instead of exiting."""

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(f"{message} (see '{self.prog} --help')")


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__
