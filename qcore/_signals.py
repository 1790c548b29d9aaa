"""Short sections that SIGINT/SIGTERM must not split (creating, moving, removing a temp file).

`deferred()` holds those signals at the Python level for the length of a `with` block and
delivers them when it ends, so a file move and the bookkeeping after it happen together or not
at all. Python runs signal handlers in the main thread only; elsewhere the block is a no-op.
"""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator

__all__ = ["HELD", "deferred"]

HELD = (signal.SIGINT, signal.SIGTERM)
"""The signals held back during a deferred section."""


@contextmanager
def deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM during the block; re-raise the first one caught when it ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {}
    for sig in HELD:
        try:
            previous[sig] = signal.signal(sig, lambda s, _f: caught.append(s))
        except (ValueError, OSError):  # not settable here (embedded interpreter, odd platform)
            pass
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        if caught:
            signal.raise_signal(caught[0])
