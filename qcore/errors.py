"""The qcore error tree (docs/spec.md, errors).

Every error names the offending thing, the rule it broke and a way out.
"""
from __future__ import annotations

__all__ = [
    "QCoreError",
    "SchemeError",
    "UnsupportedSchemeError",
    "InvalidDataError",
    "InputError",
    "BackendNotFoundError",
    "BackendUnavailableError",
    "StorageError",
    "DeviceMemoryError",
]


class QCoreError(Exception):
    """Base of every error qcore raises on purpose."""


class SchemeError(QCoreError, ValueError):
    """A `QuantScheme` breaks a validity rule (docs/spec.md, validity rules), or its text does not
    parse."""


class UnsupportedSchemeError(QCoreError, NotImplementedError):
    """A backend was asked to handle a scheme its `supports()` rejects (docs/spec.md, backends)."""


class InvalidDataError(QCoreError, ValueError):
    """Portable bytes do not match what their shape and scheme require (docs/spec.md, portable
    bytes)."""


class InputError(QCoreError, ValueError):
    """An input tensor or explicit parameter is unusable (docs/spec.md, arithmetic)."""


class BackendNotFoundError(QCoreError, LookupError):
    """No backend is registered under the requested name."""


class BackendUnavailableError(QCoreError, RuntimeError):
    """The backend is installed, but its device or runtime is missing."""


class StorageError(QCoreError, OSError):
    """A file could not be read or written: missing, a directory or device, unreadable, disk
    full, read-only destination. Carries `errno` and `filename` like the `OSError` it replaces;
    its text is the one-line message alone."""

    def __str__(self) -> str:
        return str(self.strerror) if self.strerror else super().__str__()


class DeviceMemoryError(QCoreError, MemoryError):
    """A backend's device ran out of memory; the message names the size asked for. The backend
    stays usable for work that fits."""
