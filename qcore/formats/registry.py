"""Format discovery: the built-in formats plus the `qcore.formats` entry point group.

An entry point names a `Format` subclass (or any callable returning a `Format` instance), e.g.
in a plugin's pyproject.toml:

    [project.entry-points."qcore.formats"]
    myformat = "my_pkg.formats:MyFormat"

Each entry point is loaded on its own, so a broken plugin is recorded (`plugin_errors()`) instead
of hiding the others; a plugin may not take a built-in format's name.
"""
from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any

from qcore import plugins
from qcore.formats.base import Format, FormatNotFoundError, PathLike, Probe

__all__ = ["GROUP", "detect", "formats", "get", "plugin_errors", "register", "reset"]

GROUP = "qcore.formats"
_MEMBERS = ("name", "priority", "detect", "read", "check", "write", "available")
"""What a format plugin must have (`qcore.formats.Format`)."""


def _builtins() -> list[Format]:
    from qcore.formats.bnb import BnbNF4Format
    from qcore.formats.ctensors import CompressedTensorsFormat
    from qcore.formats.fp8 import Fp8Format
    from qcore.formats.gguf_file import GGUFFormat
    from qcore.formats.gptoss import GptOssFormat
    from qcore.formats.native import QcoreFormat
    from qcore.formats.torchao import TorchaoFormat

    return [QcoreFormat(), GptOssFormat(), GGUFFormat(), BnbNF4Format(), CompressedTensorsFormat(), Fp8Format(),
            TorchaoFormat()]


def _instance(obj: Any, origin: str) -> Format:
    """The format an entry point names: a `Format` instance, or a class / callable making one."""
    fmt = obj() if isinstance(obj, type) or (callable(obj) and not hasattr(obj, "detect")) else obj
    lacks = plugins.missing(fmt, _MEMBERS)
    if lacks or not isinstance(fmt.name, str) or not fmt.name:
        raise TypeError(f"entry point {origin} gave {fmt!r}, which lacks {', '.join(lacks) or 'a name'} "
                        "of qcore.formats.Format")
    return fmt


def _discover(table: plugins.PluginTable[Format]) -> dict[str, Format]:
    """The built-in formats, then each entry point of the group (none may take a taken name)."""
    found = {f.name: f for f in _builtins()}
    for ep, obj in plugins.load_each(entry_points(group=GROUP), table):
        table.add(found, obj, ep.name, label=f"'{ep.name}' ({ep.value})")
    return found


_PLUGINS: plugins.PluginTable[Format] = plugins.PluginTable("format", _discover, _instance)


def _load() -> dict[str, Format]:
    return _PLUGINS.table()


def register(fmt: Format) -> None:
    """Add a format by hand (tests, notebooks); entry points are the normal way."""
    _PLUGINS.register(fmt)


def reset() -> None:
    """Forget the registry so the next call rediscovers plugins."""
    _PLUGINS.reset()


def plugin_errors() -> dict[str, str]:
    """Entry points of the `qcore.formats` group that failed to load, with the error."""
    _load()
    return _PLUGINS.errors()


def formats() -> dict[str, Format]:
    """Every registered format by name, in detection order (highest priority first)."""
    return {f.name: f for f in plugins.by_priority(_load().values())}


def get(name: str) -> Format:
    """The format called `name`."""
    reg = _load()
    errors = _PLUGINS.errors()
    if name not in reg:
        hint = f" (its plugin failed to load: {errors[name]})" if name in errors else ""
        raise FormatNotFoundError(
            f"no checkpoint format named '{name}'{hint}; registered: {', '.join(sorted(reg))}"
        )
    return reg[name]


def detect(path: PathLike) -> Format:
    """The format of the file at `path` (the first registered format, by priority, that detects it)."""
    probe = Probe.of(path)
    for fmt in formats().values():
        try:
            if fmt.detect(probe):
                return fmt
        except Exception:  # a plugin's detect must not break detection of the others
            continue
    raise FormatNotFoundError(
        f"{probe.path}: no registered checkpoint format recognises this file "
        f"(registered: {', '.join(formats())}); name one with --from"
    )
