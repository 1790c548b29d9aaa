"""qcore's own plugin: registers the `reference` backend through the `qcore` entry point group."""
from __future__ import annotations

from qcore.backend.hookspecs import hookimpl


@hookimpl
def qcore_register_backends():
    from qcore.backend.reference import ReferenceBackend

    return [ReferenceBackend()]
