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
from dataclasses import dataclass, field
from typing import Union

from .errors import InputError, InvalidDataError

__all__ = ["INDEX_NAME", "Checkpoint", "resolve", "hub_cache_dir", "parse_size", "shard_name"]

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


def _from_index(path: str) -> Checkpoint:
    root, name = os.path.split(os.path.abspath(path))
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except ValueError as e:
        raise InvalidDataError(f"{path} is not a valid index file (JSON): {e}") from None
    wmap = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wmap, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wmap.items()):
        raise InvalidDataError(f"{path}: an index file needs a 'weight_map' of tensor name -> shard file")
    shards = list(dict.fromkeys(sorted(wmap.values())))
    for s in shards:
        if os.path.basename(s) != s or not os.path.isfile(os.path.join(root, s)):
            raise FileNotFoundError(2, f"shard named by {name} is missing", os.path.join(root, s))
    meta = doc.get("metadata") if isinstance(doc.get("metadata"), dict) else {}
    return Checkpoint(root, shards, False, name, dict(meta), dict(wmap), _extras(root, {name, *shards}))


def resolve(src: PathLike) -> Checkpoint:
    """The checkpoint at `src`: a .safetensors file, an index file, a directory or a cached hub id."""
    p = os.fspath(src)
    if not os.path.exists(p):
        if _HUB_ID.match(p):
            p = _hub_snapshot(p)
        else:
            from .io import check_input_path

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
    from .io import check_input_path

    check_input_path(p)  # a readable regular file (not /dev/null), else StorageError naming it
    if p.endswith(".json"):
        return _from_index(p)
    root, name = os.path.split(os.path.abspath(p))
    return Checkpoint(root, [name], True)


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int) -> int:
    """Bytes from `5GB`, `500MiB`, `2e9` or an int (decimal units are powers of 10, as in HF)."""
    if isinstance(text, int) and not isinstance(text, bool):
        n = text
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
        unit = m.group(2).upper() if m else ""
        if not m or unit not in _UNITS:
            raise InputError(f"a size is a number with an optional unit (B, KB, MB, GB, KiB, MiB, GiB), got {text!r}")
        n = int(float(m.group(1)) * _UNITS[unit])
    if n <= 0:
        raise InputError(f"a size must be > 0 bytes, got {text!r}")
    return n


def shard_name(prefix: str, k: int, n: int) -> str:
    """`model-00001-of-00004.safetensors` (k counts from 1)."""
    return f"{prefix}-{k:05d}-of-{n:05d}.safetensors"
