"""How the command line writes to a terminal or a pipe: a rich console and the formats of the
numbers in its tables. `qcore/cli/main.py` and the format commands (`qcore/cli/convert.py`) both
print through it."""
from __future__ import annotations

import math
import sys
from typing import Sequence

__all__ = ["console", "escape", "fmt_bytes", "fmt_db", "fmt_shape"]


def console(stderr: bool = False):
    """A rich Console on stdout (or stderr); 160 columns in a pipe, where rich would wrap tables at 80."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    wide = None if stream.isatty() else 160
    return Console(file=stream, width=wide, highlight=False, soft_wrap=True)


def fmt_bytes(n: float) -> str:
    """A byte count in B, KiB, MiB or GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def fmt_db(v: float) -> str:
    """An SQNR in dB; "exact" for an error-free tensor (infinite SQNR)."""
    return "exact" if math.isinf(v) else f"{v:.2f}"


def fmt_shape(shape: Sequence[int]) -> str:
    """A shape as Python writes a tuple: (3,), (2, 4)."""
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


def escape(text: str) -> str:
    """Text shown inside rich markup as it is (tensor names and notes may hold brackets)."""
    from rich.markup import escape as _escape

    return _escape(text)
