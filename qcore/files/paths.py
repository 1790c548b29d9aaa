"""Local files, read and written safely: the lowest module of the files room.

- `check_input_path`: a readable regular file, else one `StorageError` naming it (a FIFO would
  block a read, /dev/zero never ends);
- `check_output_path`: a path whose folder exists and is writable, and that is not a folder;
- `atomic_write`: a file is built under a temporary name next to its target (`.NAME.<8
  characters>.tmp`), flushed to disk and moved over the target with `os.replace`, so an
  interrupted write leaves nothing;
- `parse_json`: JSON text from a file, or one `InvalidDataError` line (deep nesting included).
"""
from __future__ import annotations

import errno
import json
import os
import stat
import tempfile
from typing import Any, Callable, Union

from safetensors import SafetensorError

from qcore import _signals
from qcore.errors import InputError, InvalidDataError, QCoreError, StorageError

__all__ = ["PathLike", "is_url", "check_input_path", "check_output_path", "atomic_write", "parse_json"]

PathLike = Union[str, "os.PathLike[str]"]


def is_url(path: PathLike) -> bool:
    """True for `proto://...` other than `file://` (those need fsspec, `qcore.files.storage`)."""
    p = os.fspath(path)
    return "://" in p and not p.startswith("file://")


def check_input_path(path: PathLike) -> str:
    """A readable regular file, else `StorageError` naming the path (missing, a directory, a
    device such as /dev/null, no permission). Returns the path as text."""
    try:
        p = os.fspath(path)
    except TypeError:
        raise InputError(f"a file path is a str or os.PathLike, got {type(path).__name__}") from None
    try:
        st = os.stat(p)
    except OSError as e:
        raise StorageError(e.errno, f"{p}: {e.strerror} (cannot read it)", p) from None
    if stat.S_ISDIR(st.st_mode):
        raise StorageError(errno.EISDIR, f"cannot read {p}: it is a directory; name a .safetensors file", p)
    if not stat.S_ISREG(st.st_mode):
        raise StorageError(errno.ENODEV, f"cannot read {p}: not a regular file; name a .safetensors file", p)
    if not os.access(p, os.R_OK):
        raise StorageError(errno.EACCES, f"cannot read {p}: permission denied", p)
    return p


def check_output_path(path: PathLike) -> str:
    """Refuse, before any work, an output path that cannot be written: its directory missing or
    not a directory, not writable, or the path itself a directory. Returns the path as text."""
    p = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(p))
    if not os.path.isdir(directory):
        raise StorageError(errno.ENOENT, f"cannot write {p}: directory {directory} does not exist "
                                         "(No such file or directory); create it first", p)
    if os.path.isdir(p):
        raise StorageError(errno.EISDIR, f"cannot write {p}: it is a directory; name a file inside it", p)
    if not os.access(directory, os.W_OK | os.X_OK):
        raise StorageError(errno.EACCES, f"cannot write {p}: directory {directory} is not writable "
                                         "(read-only or no permission); write elsewhere", p)
    return p


def parse_json(text: str | bytes, what: str) -> Any:
    """`json.loads(text)`, or a one-line `InvalidDataError` saying `what` is not JSON; text nested
    deeper than Python's parser goes (its RecursionError, a few KB of brackets) included."""
    try:
        return json.loads(text)
    except RecursionError:
        raise InvalidDataError(f"{what} is not JSON (nested too deeply for Python's JSON parser)") from None
    except ValueError as e:  # UnicodeDecodeError included
        raise InvalidDataError(f"{what} is not JSON ({' '.join(str(e).split())})") from None


# ---------------------------------------------------------------------------------- atomic writes
def atomic_write(path: PathLike, write: Callable[[str], Any], finish: Callable[[Any], Any] | None = None) -> None:
    """Run `write(tmp)` on a temp file next to `path`, then `finish(f)` on it open for update
    (if given), fsync it, then `os.replace` it into place.

    Any exception (KeyboardInterrupt included) removes the temp file and leaves `path` untouched;
    creating, moving and removing the temp file are not split by SIGINT/SIGTERM (`_signals`).
    Write failures (disk full, read-only) become one `StorageError`.
    """
    path = os.fspath(path)
    check_output_path(path)
    directory = os.path.dirname(os.path.abspath(path))
    tmp: str | None = None
    try:  # (no `try` statement inside: see _make_temp)
        with _signals.deferred():
            tmp = _make_temp(path, directory)
        _fill_temp(path, tmp, write, finish)
        with _signals.deferred():
            _move_into_place(tmp, path)
            tmp = None
    except BaseException:
        if tmp is not None:
            with _signals.deferred():
                _remove_quietly(tmp)
        raise
    _fsync_dir(directory)


def _storage_error(path: str, e: BaseException) -> StorageError:
    """One-line `StorageError` for a failed write of `path` (OSError or safetensors' own error)."""
    code = getattr(e, "errno", None)
    text = getattr(e, "strerror", None) or " ".join(str(e).split())
    if code is None:  # safetensors wraps the OS error in its message: find the errno it names
        for name, num in (("StorageFull", errno.ENOSPC), ("No space left", errno.ENOSPC),
                          ("ReadOnlyFilesystem", errno.EROFS), ("PermissionDenied", errno.EACCES)):
            if name in text:
                code, text = num, os.strerror(num)
                break
    return StorageError(code or errno.EIO, f"cannot write {path}: {text}; nothing was written", path)


# The steps of `atomic_write`, each a function of its own so that no `try` statement sits
# inside its try/except: on CPython 3.11 an exception raised at such a statement's line (by a
# trace function, as the interrupt tests send signals) skips the enclosing handler, which
# removes the temporary file.
def _make_temp(path: str, directory: str) -> str:
    """A new empty temporary file next to `path` (`.NAME.<8 characters>.tmp`)."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    except OSError as e:
        raise _storage_error(path, e) from None
    os.close(fd)
    return tmp


def _fill_temp(path: str, tmp: str, write, finish) -> None:
    """Run `write(tmp)` and `finish(f)`, flush the file to disk and give it the default mode."""
    try:
        write(tmp)
        with open(tmp, "r+b") as f:
            if finish is not None:
                finish(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _default_mode())
    except (OSError, SafetensorError) as e:
        if isinstance(e, QCoreError):
            raise
        raise _storage_error(path, e) from None


def _move_into_place(tmp: str, path: str) -> None:
    try:
        os.replace(tmp, path)
    except OSError as e:
        raise _storage_error(path, e) from None


def _remove_quietly(tmp: str) -> None:
    try:
        os.unlink(tmp)
    except OSError:
        pass


def _default_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some platforms cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
