"""Signal handlers set for a block and put back after it, and short sections that SIGINT/SIGTERM
must not split (creating, moving, removing a temp file).

`handling()` sets handlers for a block such that no signal, whenever it lands, leaves one of
them in place for the rest of the process. `deferred()` holds those signals at the Python level for the length of a `with` block and
delivers them when it ends, so a file move and the bookkeeping after it happen together or not
at all. Python runs signal handlers in the main thread only; elsewhere the block is a no-op.
"""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping

__all__ = ["HELD", "deferred", "handling"]

HELD = (signal.SIGINT, signal.SIGTERM)
"""The signals held back during a deferred section."""


@contextmanager
def handling(handlers: Mapping[int, Callable[[int, Any], None]]) -> Iterator[None]:
    """Answer the signals of `handlers` with them during the block, and put the handlers they
    replaced back after it (in the main thread; elsewhere the block runs as it is).

    A signal can land between any two steps, and raise, while the handlers go in or go back. Every
    old handler is read before any changes, so none of ours is ever taken for an old one; and one
    of ours that a signal leaves in place past the block puts every old handler back the first time
    it is called and answers that signal as the old handler would, so a process never keeps ours
    (a hold left behind would swallow every later Ctrl-C of a program that called qcore).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in handlers}
    block = {"open": True}
    ours: dict[int, Callable[[int, Any], None]] = {}

    def ours_for(handler: Callable[[int, Any], None]) -> Callable[[int, Any], None]:
        def answer(sig: int, frame: Any) -> None:
            if block["open"]:
                handler(sig, frame)
            else:  # one of ours still in place past the block (a signal cut the putting back short)
                _put_back(previous, ours, only_ours=True)
                _forward(previous[sig], sig, frame)
        return answer

    for sig, handler in handlers.items():
        ours[sig] = ours_for(handler)
    try:
        for sig in handlers:
            if not _install(sig, ours[sig]):
                del previous[sig]
        yield
    finally:
        block["open"] = False  # one store: from here a signal is answered as before the block
        _put_back(previous, ours, only_ours=False)


@contextmanager
def deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM during the block; re-raise the first one caught when it ends."""
    caught: list[int] = []

    def hold(sig: int, _frame: Any) -> None:
        caught.append(sig)

    try:
        with handling({sig: hold for sig in HELD}):
            yield
    finally:
        if caught:
            signal.raise_signal(caught[0])


def _install(sig: int, handler: Callable[[int, Any], None]) -> bool:
    """Set `handler` for `sig`; False where it cannot be set here (embedded interpreter, odd
    platform). (A function of its own: a `try` statement inside `handling`'s try/finally could, on
    CPython 3.11, let an exception raised at its line skip that `finally`.)"""
    try:
        signal.signal(sig, handler)
    except (ValueError, OSError):
        return False
    return True


def _put_back(previous: Mapping[int, Any], ours: Mapping[int, Any], only_ours: bool) -> None:
    """Set the old handlers again (None, a handler not set from Python: the default action); with
    `only_ours`, only where one of ours is still in place (not over one set since)."""
    for sig, handler in previous.items():
        if not only_ours or signal.getsignal(sig) is ours[sig]:
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)


def _forward(handler: Any, sig: int, frame: Any) -> None:
    """Answer `sig` as `handler` (what `signal.getsignal` gave) would have: call it, ignore the
    signal, or raise it again under the default action."""
    if callable(handler):
        handler(sig, frame)
    elif handler != signal.SIG_IGN:  # the default action (or a handler not set from Python)
        signal.raise_signal(sig)
