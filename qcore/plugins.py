"""Plugin discovery shared by qcore's registries (backends: `qcore.backend.registry`, formats:
`qcore.formats.registry`).

A `PluginTable` is a name -> plugin table built on first use (under a lock) by its registry's
`discover` function, refreshed by `reset()`, extended by hand with `register()`. Every entry
point is loaded on its own (`load_each`): one that fails to import (`SystemExit` included; only
`KeyboardInterrupt` passes) is recorded under its entry point name and hides no other, as is a
plugin object that lacks a member of the contract or takes a name already taken (`add`). The
errors read back as `errors()`: one line per plugin, several faults joined by "; ".
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Generic, Iterable, Iterator, Protocol, TypeVar

__all__ = ["Plugin", "PluginTable", "isolated", "load_each", "missing", "fault", "by_priority"]


class Plugin(Protocol):
    """What a registry's plugins have in common: a name and a priority."""

    name: str
    priority: int


T = TypeVar("T", bound=Plugin)
I = TypeVar("I")
R = TypeVar("R")


def fault(e: BaseException) -> str:
    """How a plugin's exception is reported: `Type: message`."""
    return f"{type(e).__name__}: {e}"


def missing(obj: Any, members: Iterable[str]) -> list[str]:
    """The members of a contract that `obj` lacks (in the contract's order)."""
    return [m for m in members if not hasattr(obj, m)]


def by_priority(plugins: Iterable[T]) -> list[T]:
    """Highest `priority` first, ties by name: the order `auto` and format detection try them."""
    return sorted(plugins, key=lambda p: (-int(p.priority), p.name))


class PluginTable(Generic[T]):
    """A lazily discovered, thread-safe name -> plugin table with one error line per plugin.

    `discover(table)` returns the table's contents, calling `table.note` / `table.add` for what it
    skips; `check(obj, origin)` returns the plugin `obj` stands for (an instance), or raises
    `TypeError` naming what is wrong with it; `kind` names a plugin in messages ("backend")."""

    def __init__(self, kind: str, discover: Callable[["PluginTable[T]"], dict[str, T]],
                 check: Callable[[Any, str], T]):
        self.kind = kind
        self.lock = threading.RLock()
        self._discover = discover
        self._check = check
        self._table: dict[str, T] | None = None
        self._errors: dict[str, str] = {}

    def table(self) -> dict[str, T]:
        """The table (discovered on first use, after `reset`)."""
        with self.lock:
            if self._table is None:
                self._errors.clear()
                self._table = self._discover(self)
            return self._table

    def errors(self) -> dict[str, str]:
        """Plugin name -> what went wrong with it, at the last discovery and since (a copy; no
        discovery of its own)."""
        with self.lock:
            return dict(self._errors)

    def note(self, origin: str, message: str) -> None:
        """Record a fault of plugin `origin` (joined to its earlier ones)."""
        with self.lock:
            self._errors[origin] = f"{self._errors[origin]}; {message}" if origin in self._errors else message

    def add(self, found: dict[str, T], obj: Any, origin: str, taken: str = "", label: str | None = None) -> bool:
        """Check `obj` (named `label`, default `origin`, in the check's message) and add it to
        `found` under its name; a malformed plugin or a taken name is noted under `origin` (with
        `taken` after the "already taken" message) instead."""
        try:
            plugin = self._check(obj, label or origin)
            if plugin.name in found:
                raise ValueError(f"{self.kind} name '{plugin.name}' is already taken{taken}")
        except Exception as e:  # noqa: BLE001 - reported, the others go on
            self.note(origin, fault(e))
            return False
        found[plugin.name] = plugin
        return True

    def register(self, obj: Any) -> None:
        """Add a plugin by hand (tests, notebooks); entry points are the normal way."""
        with self.lock:
            table = self.table()
            plugin = self._check(obj, "register()")
            if plugin.name in table:
                raise ValueError(f"{self.kind} name '{plugin.name}' is already taken")
            table[plugin.name] = plugin

    def reset(self) -> None:
        """Forget the table so the next use discovers plugins again."""
        with self.lock:
            self._table = None


def isolated(items: Iterable[I], origin: Callable[[I], str], call: Callable[[I], R],
             table: PluginTable) -> Iterator[tuple[I, R]]:
    """(item, call(item)) for each of `items` whose call returns; one that raises is noted in
    `table` under `origin(item)` and skipped (a `SystemExit` too; a `KeyboardInterrupt` stops)."""
    for item in items:
        try:
            result = call(item)
        except BaseException as e:  # one broken plugin must not hide the others
            if isinstance(e, KeyboardInterrupt):
                raise
            table.note(origin(item), fault(e))
            continue
        yield item, result


def load_each(eps: Iterable[Any], table: PluginTable) -> Iterator[tuple[Any, Any]]:
    """(entry point, what it loads) for each of `eps` that loads (`isolated`, under its name)."""
    return isolated(eps, lambda ep: ep.name, lambda ep: ep.load(), table)
