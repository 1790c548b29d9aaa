"""Backend discovery and selection (docs/spec.md, backends).

Plugins are found through the `qcore` entry point group and loaded one by one, so a broken
plugin is recorded (see `plugin_errors()`) instead of taking the others down.
Selection: `backend(name)`; no name -> `$QCORE_BACKEND`, else `auto`, which picks per scheme the
highest-priority available backend that supports it, a backend on a simulated device (the cuda
backend under numba's CUDA simulator, `NUMBA_ENABLE_CUDASIM=1`) only after every real one: the
simulator is correct but minutes slower than a CPU backend. Asked for by name, it is used.
"""
from __future__ import annotations

import difflib
import os
import threading
from importlib.metadata import entry_points
from typing import Any, Sequence

import numpy as np
import pluggy

from qcore import plugins
from qcore.backend import _builtin, hookspecs
from qcore.backend.protocol import (
    BACKEND_MEMBERS, BACKEND_METHODS, Backend, QParams, QTensor, Support, require_support, use_registry,
)
from qcore.errors import BackendNotFoundError, BackendUnavailableError, UnsupportedSchemeError
from qcore.spec.payload import QuantizedData
from qcore.spec.schemes import QuantScheme, scheme as parse_scheme

__all__ = [
    "ENV_VAR",
    "AutoBackend",
    "device_of",
    "backend",
    "backends",
    "registered",
    "plugin_errors",
    "disabled_plugins",
    "is_available",
    "supporting_backends",
    "require_support",
    "KNOWN_PLUGINS",
    "register",
    "reset",
]

ENV_VAR = "QCORE_BACKEND"
DISABLE_VAR = "QCORE_DISABLE_PLUGINS"
"""Comma-separated entry point names of plugins not to load, e.g. `QCORE_DISABLE_PLUGINS=cuda,lutcpu`."""
TIMEOUT_VAR = "QCORE_AVAILABLE_TIMEOUT"
"""Seconds a backend's first `available()` may take before it is reported and skipped (default 30)."""
_disabled: list[str] = []
_answered: set[str] = set()  # backends whose available() answered once in time: trusted after that
_hung: set[str] = set()      # backends whose available() did not answer in time: skipped



def _check_backend(obj: Any, origin: str) -> Backend:
    """A registrable backend: every member of qcore.Backend (`BACKEND_MEMBERS`), a non-empty str
    `name` (not 'auto'), an int `priority` and callable methods; else `TypeError` naming what is
    wrong."""
    lacks = plugins.missing(obj, BACKEND_MEMBERS)
    if lacks:
        raise TypeError(f"plugin {origin} returned {obj!r}, which lacks {', '.join(lacks)} of qcore.Backend "
                        "(qcore.BaseBackend has them all)")
    name, prio = obj.name, obj.priority
    if not isinstance(name, str) or not name or name == "auto" or name != name.strip():
        raise TypeError(f"plugin {origin} returned a backend named {name!r}; a name is a non-empty str, not 'auto'")
    if isinstance(prio, bool) or not isinstance(prio, (int, np.integer)):
        raise TypeError(f"plugin {origin}: backend '{name}' has priority {prio!r}; it must be an int")
    not_callable = [m for m in BACKEND_METHODS if not callable(getattr(obj, m))]
    if not_callable:
        raise TypeError(f"plugin {origin}: backend '{name}' has non-callable {', '.join(not_callable)}")
    return obj


def _disabled_names() -> list[str]:
    return [n.strip() for n in os.environ.get(DISABLE_VAR, "").split(",") if n.strip()]


def _discover(table: plugins.PluginTable[Backend]) -> dict[str, Backend]:
    """Every backend of the `qcore` entry point group's plugins (qcore's own `reference` from
    `_builtin` where no entry point gives it, as in a source tree), each checked on its own."""
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    found: dict[str, Backend] = {}
    _answered.clear()
    _hung.clear()
    disabled = _disabled_names()
    _disabled[:] = disabled
    eps = [ep for ep in entry_points(group=hookspecs.PROJECT) if ep.name not in disabled]
    if "reference" not in disabled and not any(ep.name == "reference" for ep in eps):
        pm.register(_builtin, name="reference")
    for ep, module in plugins.load_each(eps, table):
        pm.register(module, name=ep.name)
    impls = sorted(pm.hook.qcore_register_backends.get_hookimpls(),  # qcore's own first, then by name:
                   key=lambda i: (i.plugin_name != "reference", i.plugin_name))  # a duplicate loses
    for impl, result in plugins.isolated(impls, lambda i: i.plugin_name, lambda i: list(i.function() or []), table):
        for be in result:  # each backend on its own: a bad one does not take its siblings
            table.add(found, be, impl.plugin_name, "; this one was skipped")
    return found


_PLUGINS: plugins.PluginTable[Backend] = plugins.PluginTable("backend", _discover, _check_backend)


def _load() -> dict[str, Backend]:
    return _PLUGINS.table()


def register(be: Backend) -> None:
    """Add a backend by hand (tests, notebooks); entry points are the normal way."""
    _PLUGINS.register(be)


def reset() -> None:
    """Forget the registry so the next call rediscovers plugins."""
    _PLUGINS.reset()


def registered() -> dict[str, Backend]:
    """Every registered backend by name, available or not."""
    return dict(_load())


def plugin_errors() -> dict[str, str]:
    """Plugins whose entry point or hook failed, and backends skipped (malformed, duplicate name,
    `available()` hanging), with the error."""
    _load()
    return _PLUGINS.errors()


def disabled_plugins() -> list[str]:
    """Plugin names excluded by `$QCORE_DISABLE_PLUGINS` at the last discovery."""
    _load()
    return list(_disabled)


def backends() -> list[str]:
    """Names of the registered backends, sorted."""
    return sorted(_load())


def _by_priority() -> list[Backend]:
    return plugins.by_priority(_load().values())


def _simulated(be: Backend) -> bool:
    """Whether `be` says it runs on a simulated device (`Backend.simulated` is True; the cuda
    backend's is numba's CUDA simulator setting); a broken property counts as a real device."""
    try:
        return be.simulated is True
    except Exception:  # noqa: BLE001 - a broken plugin's property
        return False


def device_of(be: Backend) -> str:
    """Where `be` keeps its tensors: `Backend.device` (a torch device type such as "cuda"; "cpu"
    for host backends), "cpu" where a broken plugin's is not a str."""
    try:
        where = be.device
    except Exception:  # noqa: BLE001 - a broken plugin's property
        return "cpu"
    return where if isinstance(where, str) else "cpu"


def _auto_order() -> list[Backend]:
    """The backends `auto` tries, in order: by priority, those on a simulated device last."""
    return sorted(_by_priority(), key=_simulated)  # stable: priority order within real and simulated ones


def _timeout_s() -> float:
    try:
        return max(0.01, float(os.environ.get(TIMEOUT_VAR, "30")))
    except ValueError:
        return 30.0


def _safe_available(be: Backend) -> bool:
    """`be.available()`, False when it raises. Its first answer is awaited at most
    `$QCORE_AVAILABLE_TIMEOUT` seconds (in a daemon thread); a backend that does not answer is
    reported in `plugin_errors()` and counts as unavailable from then on."""
    name = str(getattr(be, "name", "?"))
    if name in _hung:
        return False
    if name in _answered:
        try:
            return bool(be.available())
        except Exception:
            return False
    box: list[Any] = []

    def ask() -> None:
        try:
            box.append(bool(be.available()))
        except BaseException as e:  # noqa: BLE001 - reported as unavailable
            box.append(e)

    t = threading.Thread(target=ask, name=f"qcore-available-{name}", daemon=True)
    t.start()
    t.join(_timeout_s())
    if not box:
        with _PLUGINS.lock:
            _hung.add(name)
            _PLUGINS.note(name, f"available() did not answer within {_timeout_s():g} s; backend skipped "
                        f"(raise {TIMEOUT_VAR} if its device is slow to start)")
        return False
    _answered.add(name)
    return box[0] is True


def is_available(be: Backend) -> bool:
    """Whether `be` is available, never raising or hanging (see `_safe_available`)."""
    return _safe_available(be)


def supporting_backends(scheme: QuantScheme | str) -> list[str]:
    """Available backends whose `supports(scheme)` is truthy, highest priority first."""
    scheme = parse_scheme(scheme)
    out = []
    for be in _by_priority():
        try:
            if _safe_available(be) and be.supports(scheme):
                out.append(be.name)
        except Exception:
            continue
    return out


KNOWN_PLUGINS = {"ndarray": "qcore-ndarray", "cuda": "qcore-cuda"}
"""Backends of this project's own plugin distributions: the name to install for each."""


def _not_found(name: str, installed: list[str]) -> str:
    """One line for an unknown backend name: a close installed name if there is one (a typo),
    else the plugin that provides it (for this project's own backends) or where plugins come
    from. Never a guessed package name: that could install someone else's project."""
    listed = f"installed: {', '.join(installed) or 'none'}, or 'auto'"
    errors = _PLUGINS.errors()
    if name in errors:
        return f"no backend named '{name}' (its plugin failed to load: {errors[name]}); {listed}"
    close = difflib.get_close_matches(name, [*installed, "auto", *KNOWN_PLUGINS], n=1, cutoff=0.6)
    if close and close[0] != name:
        return f"no backend named '{name}'; did you mean '{close[0]}'? ({listed})"
    if name in KNOWN_PLUGINS:
        return f"no backend named '{name}': pip install {KNOWN_PLUGINS[name]} provides it ({listed})"
    return f"no backend named '{name}'; {listed}; other backends come from plugins (docs/plugins.md)"


def backend(name: str | None = None) -> Backend:
    """The backend called `name`; None -> `$QCORE_BACKEND`, else `auto`."""
    if name is None:
        name = os.environ.get(ENV_VAR) or "auto"
    if isinstance(name, str) and name == "auto":
        return AutoBackend()
    if not isinstance(name, str):
        if isinstance(name, Backend):
            return name
        raise BackendNotFoundError(f"a backend is named by a string, got {name!r}")
    reg = _load()
    if name not in reg:
        raise BackendNotFoundError(_not_found(name, sorted(reg)))
    be = reg[name]
    if not _safe_available(be):
        try:
            why = _PLUGINS.errors()[name] if name in _hung else be.describe()
        except Exception as e:  # noqa: BLE001
            why = f"describe() failed: {type(e).__name__}: {e}"
        raise BackendUnavailableError(
            f"backend '{name}' is installed but not available: {why}; "
            f"use one of {', '.join(n for n in sorted(reg) if _safe_available(reg[n]))} or 'auto'"
        )
    return be


class AutoBackend:
    """Per scheme, the highest-priority available backend that supports it. Whatever it makes
    lives on the backend it picked, so every call on a QTensor (dequantize, the ops, the products,
    `payload_parts`, `error_stats`) goes to `q.backend`, and whole-model runs under `auto` take
    that backend's fast paths."""

    name = "auto"
    priority = -1
    device = "cpu"
    """`auto` holds no tensors of its own: each QTensor's `q.backend.device` says where it lives."""
    simulated = False

    def pick(self, scheme: QuantScheme | str, device: str | None = None) -> Backend:
        """The first available backend of `_auto_order` that supports `scheme`; with `device`
        ("cpu", "cuda"), only among backends that keep their tensors there (`device_of`)."""
        scheme = parse_scheme(scheme)
        for be in _auto_order():
            if device is not None and device_of(be) != device:
                continue
            try:
                ok = _safe_available(be) and be.supports(scheme)
            except Exception:  # a broken plugin's supports(): not a candidate
                continue
            if ok:
                return be
        where = f" on {device}" if device is not None else ""
        raise UnsupportedSchemeError(f"no available backend{where} supports {scheme}; installed: {', '.join(backends())}")

    def available(self) -> bool:
        return True

    def describe(self) -> str:
        order = ", ".join(b.name + (" (simulated)" if _simulated(b) else "") for b in _auto_order()
                          if _safe_available(b))
        return f"picks per scheme among: {order}"

    def supports(self, scheme: QuantScheme | str) -> Support:
        names = supporting_backends(scheme)
        return Support.yes() if names else Support.no("no available backend supports it")

    def calibrate(self, x: Any, scheme: QuantScheme | str, method: str = "minmax") -> QParams:
        return self.pick(scheme).calibrate(x, scheme, method)

    def quantize(self, x: Any, scheme: QuantScheme | str, *, params: QParams | None = None,
                 method: str = "minmax", out: Any = None, stream: Any = None) -> QTensor:
        be = out.backend if isinstance(out, QTensor) else self.pick(scheme)
        return be.quantize(x, scheme, params=params, method=method, out=out, stream=stream)

    def dequantize(self, q: QTensor, dtype: Any = None, *, out: Any = None, stream: Any = None) -> Any:
        return q.backend.dequantize(q, dtype, out=out, stream=stream)

    def from_data(self, data: QuantizedData) -> QTensor:
        return self.pick(data.scheme).from_data(data)

    def into_data(self, q: QTensor) -> QuantizedData:
        return q.backend.into_data(q)

    def to_numpy(self, array: Any) -> np.ndarray:
        for be in _by_priority():
            try:
                return be.to_numpy(array)
            except Exception:
                continue
        return np.asarray(array)

    def reshape(self, q: QTensor, shape: Sequence[int]) -> QTensor:
        return q.backend.reshape(q, shape)

    def permute(self, q: QTensor, axes: Sequence[int]) -> QTensor:
        return q.backend.permute(q, axes)

    def transpose(self, q: QTensor) -> QTensor:
        return q.backend.transpose(q)

    def slice(self, q: QTensor, index) -> QTensor:
        return q.backend.slice(q, index)

    def cat(self, qs: Sequence[QTensor], axis: int = 0) -> QTensor:
        return qs[0].backend.cat(qs, axis)

    def matmul(self, x: Any, w: QTensor, *, dtype: Any = np.float32, act: Any = None, out: Any = None,
               stream: Any = None) -> Any:
        return w.backend.matmul(x, w, dtype=dtype, act=act, out=out, stream=stream)

    def linear(self, x: Any, w: QTensor, bias: Any = None, *, dtype: Any = None, act: Any = None,
               out: Any = None, stream: Any = None) -> Any:
        return w.backend.linear(x, w, bias, dtype=dtype, act=act, out=out, stream=stream)

    def payload_parts(self, q: QTensor) -> list[np.ndarray]:
        return q.backend.payload_parts(q)

    def error_stats(self, x: Any, q: QTensor) -> tuple[float, float]:
        return q.backend.error_stats(x, q)

    def adopt(self, data: QuantizedData, payload: Any) -> QTensor:
        return self.pick(data.scheme).adopt(data, payload)

    def __repr__(self) -> str:
        return "<AutoBackend>"


use_registry(backend, supporting_backends)  # QTensor.to(name) and require_support's message (qcore.backend.protocol)
