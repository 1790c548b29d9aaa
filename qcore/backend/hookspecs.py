"""The plugin contract: one hook, `qcore_register_backends` (pluggy, entry point group `qcore`)."""
from __future__ import annotations

import pluggy

PROJECT = "qcore"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

__all__ = ["hookspec", "hookimpl", "qcore_register_backends", "PROJECT"]


@hookspec
def qcore_register_backends():  # type: ignore[empty-body]
    """Return the backends this plugin provides, as a list of `Backend` instances.

    Called once, when qcore first builds its registry. Each backend needs a unique `name`, an
    int `priority` (higher wins in `auto` selection) and the `qcore.Backend` protocol; subclass
    `qcore.BaseBackend` to get validation and error text for free. Do not touch a device here:
    report a missing one through `available()` / `describe()` instead.

    Register it in your distribution's metadata::

        [project.entry-points.qcore]
        mybackend = "my_package.plugin"     # a module with a @qcore.hookimpl function
    """
