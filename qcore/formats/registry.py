"""Format discovery: the built-in formats plus the `qcore.formats` entry point group.

An entry point names a `Format` subclass (or any callable returning a `Format` instance), e.g.
in a plugin's pyproject.toml:

    [project.entry-points."qcore.formats"]
    myformat = "my_pkg.formats:MyFormat"

Each entry point is loaded on its own, so a broken plugin is recorded (`plugin_errors()`) instead
of hiding the others; a plugin may not take a built-in format's name.
"""
from __future__ import annotations

import threading
from importlib.metadata import entry_points
from typing import Any

from qcore.formats.base import Format, FormatNotFoundError, PathLike, Probe

__all__ = ["GROUP", "detect", "formats", "get", "plugin_errors", "register", "reset"]

GROUP = "qcore.formats"
_lock = threading.RLock()
_registry: dict[str, Format] | None = None
_errors: dict[str, str] = {}


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
    fmt = obj() if isinstance(obj, type) or (callable(obj) and not hasattr(obj, "detect")) else obj
    missing = [m for m in ("name", "priority", "detect", "read", "check", "write", "available") if not hasattr(fmt, m)]
    if missing or not isinstance(getattr(fmt, "name", None), str) or not fmt.name:
        lacks = ", ".join(missing) or "a name"
        raise TypeError(f"entry point {origin} gave {fmt!r}, which lacks {lacks} of qcore.formats.Format")
    return fmt


def _load() -> dict[str, Format]:
    global _registry
    with _lock:
        if _registry is not None:
            return _registry
        found = {f.name: f for f in _builtins()}
        _errors.clear()
        for ep in entry_points(group=GROUP):
            try:
                fmt = _instance(ep.load(), f"'{ep.name}' ({ep.value})")
                if fmt.name in found:
                    raise ValueError(f"format name '{fmt.name}' is already taken")
                found[fmt.name] = fmt
            except Exception as e:  # one broken plugin must not hide the others
                _errors[ep.name] = f"{type(e).__name__}: {e}"
        _registry = found
        return found


def register(fmt: Format) -> None:
    """Add a format by hand (tests, notebooks); entry points are the normal way."""
    with _lock:
        reg = _load()
        fmt = _instance(fmt, "register()")
        if fmt.name in reg:
            raise ValueError(f"format name '{fmt.name}' is already taken")
        reg[fmt.name] = fmt


def reset() -> None:
    """Forget the registry so the next call rediscovers plugins."""
    global _registry
    with _lock:
        _registry = None


def plugin_errors() -> dict[str, str]:
    """Entry points of the `qcore.formats` group that failed to load, with the error."""
    _load()
    return dict(_errors)


def formats() -> dict[str, Format]:
    """Every registered format by name, in detection order (highest priority first)."""
    return dict(sorted(_load().items(), key=lambda kv: (-int(kv[1].priority), kv[0])))


def get(name: str) -> Format:
    """The format called `name`."""
    reg = _load()
    if name not in reg:
        hint = f" (its plugin failed to load: {_errors[name]})" if name in _errors else ""
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
