"""Where a model's tensors live: a single file, a sharded directory, an index file or a hub id.

A sharded checkpoint is a directory of `model-0000K-of-0000N.safetensors` files plus
`model.safetensors.index.json` (`{"metadata": {"total_size": ...}, "weight_map": {tensor: file}}`)
and other files (config.json, tokenizer, ...). `resolve` turns any of the accepted sources into a
`Checkpoint`: the shard files in order, which tensor is in which, and the other files to copy.
A Hugging Face hub id (`org/name`, optionally `@revision`) is looked up in the local hub cache
only (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`); nothing is
downloaded.
"""
from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Union

from qcore.errors import InputError, InvalidDataError, StorageError

__all__ = ["INDEX_NAME", "Checkpoint", "resolve", "hub_cache_dir", "parse_size", "shard_name", "link_root",
           "other_files", "MAX_SIZE"]

INDEX_NAME = "model.safetensors.index.json"
_INDEX_SUFFIX = ".safetensors.index.json"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")
PathLike = Union[str, "os.PathLike[str]"]


@dataclass
class Checkpoint:
    """A resolved source: `shards` (paths, in order) and, for a directory, its other files."""

    root: str                         # the directory holding the shards
    shards: list[str]                 # shard file names relative to root
    single_file: bool                 # the source was one .safetensors file (output: one file)
    index_name: str | None = None     # the index file's name, if the source had one
    index_metadata: dict = field(default_factory=dict)
    weight_map: dict[str, str] = field(default_factory=dict)  # from the index (may be empty)
    extras: list[str] = field(default_factory=list)           # other entries of root to copy

    def path(self, shard: str) -> str:
        return os.path.join(self.root, shard)

    @property
    def sharded(self) -> bool:
        return not self.single_file

    def other_files(self) -> list[str]:
        """The other files to copy along with the shards, relative to `root` (see `other_files`)."""
        return other_files(self.root, self.extras)

    def check_tensors(self, names: Mapping[str, Iterable[str]]) -> None:
        """Refuse shards that disagree with each other or with the index: a tensor in two shards, a
        tensor in another shard than the index says, a tensor the index names that no shard holds.
        `names` maps each shard to the tensor names its header holds. Every command checks this
        (quantize, dequantize, inspect), with the same InvalidDataError for the same checkpoint."""
        seen: dict[str, str] = {}
        for shard in self.shards:
            for name in sorted(names[shard]):
                if name in seen:
                    raise InvalidDataError(f"tensor '{name}' is in both {seen[name]} and {shard}; a checkpoint "
                                           "names each tensor once")
                seen[name] = shard
                if self.weight_map and self.weight_map.get(name, shard) != shard:
                    raise InvalidDataError(f"{self.index_name} puts tensor '{name}' in {self.weight_map[name]}, "
                                           f"but it is in {shard}")
        missing = sorted(set(self.weight_map) - set(seen))
        if missing:
            raise InvalidDataError(f"{self.index_name} names tensor '{missing[0]}', which no shard holds")


def hub_cache_dir() -> str:
    """The local Hugging Face hub cache directory (the same rule as huggingface_hub's)."""
    env = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if env:
        return os.path.expanduser(env)
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def _hub_snapshot(repo: str) -> str:
    repo_id, _, rev = repo.partition("@")
    rev = rev or "main"
    cache = hub_cache_dir()
    base = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    if not os.path.isdir(base):
        raise FileNotFoundError(2, f"not a file or directory, and hub model {repo_id!r} is not in the local hub "
                                   f"cache {cache} (download it first, e.g. `hf download {repo_id}`)", repo)
    ref = os.path.join(base, "refs", rev)
    commit = rev
    if os.path.isfile(ref):
        with open(ref, encoding="utf-8") as f:
            commit = f.read().strip()
    snap = os.path.join(base, "snapshots", commit)
    if not os.path.isdir(snap):
        raise FileNotFoundError(2, f"hub model {repo_id!r} has no snapshot for revision {rev!r} in {cache}", repo)
    return snap


def _extras(root: str, skip: set[str]) -> list[str]:
    return sorted(n for n in os.listdir(root) if n not in skip and not n.startswith(".")
                  and not n.endswith(".safetensors"))


def _check_shard(index: str, root: str, shard: str) -> None:
    """A shard an index names: a file name in the index's folder (never a path, `.` or `..`) of a
    readable regular file; else InvalidDataError or StorageError naming the index and the shard."""
    if shard in ("", ".", "..") or os.path.basename(shard) != shard or (os.altsep and os.altsep in shard):
        raise InvalidDataError(f"{index} names shard {shard!r}, which is not a file name in the index's folder; "
                               "an index names its shards by file name (e.g. model-00001-of-00004.safetensors)")
    from qcore.files.io import check_input_path

    try:
        check_input_path(os.path.join(root, shard))
    except StorageError as e:
        raise StorageError(e.errno, f"{index} names shard {shard}: {e}", e.filename) from None


def _from_index(path: str) -> Checkpoint:
    from qcore.files.io import check_input_path

    check_input_path(path)  # a regular file (a FIFO would block the read), else StorageError
    root, name = os.path.split(os.path.abspath(path))
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, nested too deep
        raise InvalidDataError(f"{path} is not a valid index file (JSON): {' '.join(str(e).split())}") from None
    except OSError as e:
        raise StorageError(e.errno, f"cannot read {path}: {e.strerror or e}", path) from None
    wmap = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wmap, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wmap.items()):
        raise InvalidDataError(f"{path}: an index file needs a 'weight_map' of tensor name -> shard file")
    shards = list(dict.fromkeys(sorted(wmap.values())))
    for s in shards:
        _check_shard(path, root, s)
    meta = doc.get("metadata") if isinstance(doc.get("metadata"), dict) else {}
    return Checkpoint(root, shards, False, name, dict(meta), dict(wmap), _extras(root, {name, *shards}))


def link_root(root: str) -> str:
    """The folder that symlinks in the model folder `root` may point into: `root` itself (resolved),
    or for a hub cache snapshot (`models--ORG--NAME/snapshots/COMMIT`) its repository folder, whose
    `blobs/` hold the files every snapshot links to."""
    real = os.path.realpath(root)
    parent = os.path.dirname(real)
    if os.path.basename(parent) == "snapshots" and os.path.basename(os.path.dirname(parent)).startswith("models--"):
        return os.path.dirname(parent)
    return real


def _copyable(path: str, bound: str) -> bool:
    """A regular file (through any symlinks) whose real path is inside `bound`."""
    try:
        st = os.stat(path)
    except OSError:  # a dangling link, a loop of links
        return False
    if not stat.S_ISREG(st.st_mode):
        return False
    return os.path.commonpath([os.path.realpath(path), bound]) == bound


def other_files(root: str, names: Iterable[str]) -> list[str]:
    """The files to copy for the entries `names` of the model folder `root` (config, tokenizer, ...),
    as sorted paths relative to `root`: regular files, folders walked for theirs. A symlink is
    followed only to a regular file inside the model folder (`link_root`): links out of it, to
    devices (/dev/zero never ends), FIFOs (they block) or sockets, dangling links and links to
    folders (`sub/loop -> ..` would copy the model again and again) are skipped, so the copy
    ends and holds only the model's own files."""
    bound = link_root(root)
    out: list[str] = []
    for name in names:
        path = os.path.join(root, name)
        if os.path.islink(path) or not os.path.isdir(path):
            if _copyable(path, bound):
                out.append(name)
            continue
        for folder, dirs, files in os.walk(path):  # followlinks=False: a linked folder is not entered
            dirs.sort()
            out += [os.path.relpath(os.path.join(folder, f), root) for f in sorted(files)
                    if _copyable(os.path.join(folder, f), bound)]
    return sorted(out)


def resolve(src: PathLike) -> Checkpoint:
    """The checkpoint at `src`: a .safetensors file, an index file, a directory or a cached hub id."""
    p = os.fspath(src)
    if not os.path.exists(p):
        if _HUB_ID.match(p):
            p = _hub_snapshot(p)
        else:
            from qcore.files.io import check_input_path

            check_input_path(p)  # missing: StorageError naming the path
    if os.path.isdir(p):
        names = sorted(os.listdir(p))
        index = [n for n in names if n.endswith(_INDEX_SUFFIX)]
        if INDEX_NAME in index:
            return _from_index(os.path.join(p, INDEX_NAME))
        if len(index) == 1:
            return _from_index(os.path.join(p, index[0]))
        shards = [n for n in names if n.endswith(".safetensors") and os.path.isfile(os.path.join(p, n))]
        if not shards:
            raise InputError(
                f"directory {p} holds no .safetensors file and no {INDEX_NAME}; pass a checkpoint directory")
        return Checkpoint(os.path.abspath(p), shards, False, None, {}, {}, _extras(p, set(shards)))
    from qcore.files.io import check_input_path

    check_input_path(p)  # a readable regular file (not /dev/null), else StorageError naming it
    if p.endswith(".json"):
        return _from_index(p)
    root, name = os.path.split(os.path.abspath(p))
    return Checkpoint(root, [name], True)


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


MAX_SIZE = 2 ** 63 - 1
"""The largest size `parse_size` accepts, in bytes (8 EiB: any file a file system can hold)."""
_MAX_SIZE_TEXT = 100


def parse_size(text: str | int) -> int:
    """Bytes from `5GB`, `500MiB`, `2e9` or an int (decimal units are powers of 10, as in HF),
    computed exactly (no float rounding); 1 to `MAX_SIZE` bytes, else InputError."""
    if isinstance(text, int) and not isinstance(text, bool):
        n = text
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)(?:[eE]([0-9]+))?\s*([A-Za-z]*)\s*", str(text))
        unit = m.group(3).upper() if m else ""
        if not m or unit not in _UNITS or len(str(text)) > _MAX_SIZE_TEXT:
            raise InputError(f"a size is a number with an optional unit (B, KB, MB, GB, KiB, MiB, GiB), got "
                             f"{str(text)[:_MAX_SIZE_TEXT]!r}")
        value, exponent = Fraction(m.group(1)), m.group(2) or "0"
        if value and len(exponent.lstrip("0")) > 2:  # 10**100 and up: far past MAX_SIZE
            n = MAX_SIZE + 1
        else:
            n = int(value * 10 ** int(exponent) * _UNITS[unit])
    if n <= 0:
        raise InputError(f"a size must be > 0 bytes, got {text!r}")
    if n > MAX_SIZE:
        raise InputError(f"a size must be at most {MAX_SIZE} bytes (2**63-1, 8 EiB), got {str(text)[:40]!r}")
    return n


def shard_name(prefix: str, k: int, n: int) -> str:
    """`model-00001-of-00004.safetensors` (k counts from 1)."""
    return f"{prefix}-{k:05d}-of-{n:05d}.safetensors"
