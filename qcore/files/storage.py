"""Checkpoint files behind fsspec URLs (local paths, `s3://`, `gs://`, ...), seen through local files.

qcore's readers and writers work on local files (`os.preadv`, memory maps, `os.replace`), so
remote storage is reached through three local stand-ins:

- a *header stub*: the first 8 + N bytes of a safetensors file (its header), extended to the
  remote file's size as a sparse file. Planning (`qcore.files.checkpoint.resolve`, `qcore.files.io.read_info`,
  the run markers, which hash the header and the size) reads only that, so a remote checkpoint is
  planned exactly as a local one, without downloading tensors;
- a *staged shard*: a whole input shard downloaded to a worker's scratch directory, or, for a
  task that needs only some of its tensors, a header stub with just those tensors' bytes filled in;
- an *upload*: an output file written locally, put under a temporary key next to its destination
  (`.NAME.<token>.tmp`, `temp_path`) and moved onto the final key, so no partial file is ever
  visible under a shard's name. On object stores the move is a server-side copy, which appears
  whole or not at all. Files that are temporary by name (the parts of a split shard) are put
  there directly (`put`).

Local paths (and `file://` URLs) skip all of this: they are used in place.
Credentials and endpoints come from fsspec's usual configuration (environment variables such as
`AWS_ACCESS_KEY_ID`, `FSSPEC_S3_ENDPOINT_URL`, or `storage_options`).
"""
from __future__ import annotations

import os
import posixpath
import uuid
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from qcore.errors import InputError
from qcore.files.checkpoint import other_files
from qcore.files.paths import atomic_write, is_url
from qcore.files.stfile import Reader, header_length

__all__ = ["Location", "is_url", "location", "HEADER_PREFIX_LEN", "TMP_SUFFIX"]

HEADER_PREFIX_LEN = 8
TMP_SUFFIX = ".tmp"
_CHUNK = 64 << 20           # bytes a ranged read fetches at a time


def _fsspec() -> Any:
    try:
        import fsspec
    except ImportError:
        raise InputError("storage URLs need fsspec (and s3fs for s3://, gcsfs for gs://): "
                         "pip install 'qcore-quant[distributed]'") from None
    return fsspec


@dataclass
class Location:
    """A directory or file on some filesystem: `fs` (an fsspec filesystem, None for local) and `path`."""

    url: str
    path: str
    fs: Any = None
    storage_options: dict[str, Any] = field(default_factory=dict)

    @property
    def local(self) -> bool:
        return self.fs is None

    def join(self, *names: str) -> str:
        return os.path.join(self.path, *names) if self.local else posixpath.join(self.path, *names)

    def exists(self, path: str) -> bool:
        return os.path.exists(path) if self.local else bool(self.fs.exists(path))

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path) if self.local else bool(self.fs.isdir(path))

    def makedirs(self, path: str) -> None:
        if self.local:
            os.makedirs(path, exist_ok=True)
        else:
            self.fs.makedirs(path, exist_ok=True)

    def temp_path(self, path: str, tag: str) -> str:
        """A temporary name next to `path`: `.NAME.<tag>.tmp`, never a shard's name, and one that
        `leftovers` finds."""
        split, join = (os.path.split, os.path.join) if self.local else (posixpath.split, posixpath.join)
        directory, name = split(path)
        return join(directory, f".{name}.{tag}{TMP_SUFFIX}")

    # ------------------------------------------------------------------ stand-ins for remote files
    def header_stub(self, path: str, local: str) -> bool:
        """Write `path`'s safetensors header to `local`, sized as the remote file (sparse).

        Returns False when `path` does not exist. Local paths need no stub (callers use them).
        """
        try:
            size = int(self.fs.size(path))
        except FileNotFoundError:
            return False
        with self.fs.open(path, "rb", block_size=1 << 20) as f:
            raw = f.read(HEADER_PREFIX_LEN)
            head = f.read(header_length(raw, size, self.fs.unstrip_protocol(path)))
        os.makedirs(os.path.dirname(local) or ".", exist_ok=True)
        with open(local, "wb") as out:
            out.write(raw + head)
            out.truncate(size)
        return True

    def mirror_headers(self, local_dir: str) -> None:
        """Make `local_dir` a stand-in for this directory: header stubs of its .safetensors files,
        full copies of its other files (config, tokenizer, index)."""
        base = self.path.rstrip("/")
        for remote, info in sorted(self.fs.find(base, detail=True, withdirs=False).items()):
            rel = posixpath.relpath(remote, base)
            if any(part.startswith(".") for part in rel.split("/")):
                continue
            local = os.path.join(local_dir, *rel.split("/"))
            if rel.endswith(".safetensors"):
                self.header_stub(remote, local)
            else:
                os.makedirs(os.path.dirname(local), exist_ok=True)
                self.fs.get_file(remote, local)

    def stage(self, path: str, local: str) -> str:
        """The local path holding `path`'s bytes: `path` itself when local, else a download to `local`."""
        if self.local:
            return path
        os.makedirs(os.path.dirname(local) or ".", exist_ok=True)
        self.fs.get_file(path, local)
        return local

    def stage_tensors(self, path: str, local: str, names: Collection[str]) -> str:
        """The local path holding `path`'s header and the bytes of tensors `names`: `path` itself when
        local, else a header stub (`header_stub`) with those tensors' byte ranges downloaded into it."""
        if self.local:
            return path
        if not self.header_stub(path, local):
            raise FileNotFoundError(2, "No such file", self.fs.unstrip_protocol(path))
        with Reader(local) as r:
            start = HEADER_PREFIX_LEN + len(r.header_bytes)
            ranges = [(start + r.tensors[n].begin, start + r.tensors[n].end) for n in names]
        with open(local, "r+b") as out:
            for begin, end in sorted(ranges):
                for at in range(begin, end, _CHUNK):
                    out.seek(at)
                    out.write(self.fs.cat_file(path, start=at, end=min(at + _CHUNK, end)))
        return local

    def put(self, local: str, path: str) -> None:
        """Put the local file `local` at `path` as it is: for a path that is temporary by name."""
        if self.local:
            os.replace(local, path)
        else:
            self.fs.put_file(local, path)

    def upload(self, local: str, path: str) -> None:
        """Put the finished local file `local` at `path` whole: a temporary key, then a move."""
        if self.local:
            os.replace(local, path)
            return
        tmp = self.temp_path(path, uuid.uuid4().hex)
        self.fs.put_file(local, tmp)
        try:
            self.fs.mv(tmp, path)
        except BaseException:
            self.fs.rm(tmp)
            raise

    def upload_tree(self, local: str, path: str) -> None:
        """Copy a local file or directory tree (an entry of a model folder) to `path`, each file
        through `upload`: the files `qcore.files.checkpoint.other_files` names, so no link out of the
        model folder, to a device or FIFO, or to a folder (a loop) is followed."""
        root, name = os.path.split(os.path.abspath(local))
        for rel in other_files(root, [name]):
            parts = rel.split(os.sep)[1:]
            target = os.path.join(path, *parts) if self.local else posixpath.join(path, *parts)
            self._copy(os.path.join(root, rel), target)

    def _copy(self, src: str, path: str) -> None:
        if self.local:
            import shutil

            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            atomic_write(path, lambda tmp: shutil.copyfile(src, tmp))
        else:
            self.upload(src, path)

    def leftovers(self, paths: list[str]) -> list[str]:
        """Temporary files (`.NAME.*.tmp`) next to the given paths, as a killed writer leaves them."""
        found: list[str] = []
        for p in paths:
            if self.local:
                import glob

                d, name = os.path.split(p)
                found += glob.glob(os.path.join(d, f".{glob.escape(name)}.*{TMP_SUFFIX}"))
            else:
                d, name = posixpath.split(p)
                found += list(self.fs.glob(posixpath.join(d, f".{name}.*{TMP_SUFFIX}")))
        return found

    def remove(self, paths: list[str]) -> None:
        for p in paths:
            try:
                os.unlink(p) if self.local else self.fs.rm(p)
            except FileNotFoundError:
                pass


def location(url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> Location:
    """The filesystem and path of `url` (a local path, `file://...`, `s3://bucket/key`, ...)."""
    u = os.fspath(url)
    opts = dict(storage_options or {})
    if u.startswith("file://"):
        u = u[len("file://"):]
    if not is_url(u):
        return Location(u, u, None, opts)
    fsspec = _fsspec()
    try:
        fs, path = fsspec.core.url_to_fs(u, **opts)
    except (ImportError, ValueError) as e:
        raise InputError(f"storage URL {u!r} cannot be opened: {e} (install the fsspec driver for its protocol, "
                         "e.g. s3fs for s3://, gcsfs for gs://)") from None
    return Location(u, path, fs, opts)
