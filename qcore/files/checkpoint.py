"""Checkpoints: where a model's tensors live, their index file, and what a reader found in them.

A sharded checkpoint is a directory of `model-0000K-of-0000N.safetensors` files plus
`model.safetensors.index.json` (`{"metadata": {"total_size": ...}, "weight_map": {tensor: file}}`)
and other files (config.json, tokenizer, ...).

- `resolve` turns any accepted source (a .safetensors file, a directory, an index file, a hub id)
  into a `Checkpoint`: the shard files in order, which tensor is in which, and the other files to
  copy. A Hugging Face hub id (`org/name`, optionally `@revision`) is looked up in the local hub
  cache only (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`); nothing is
  downloaded. `shard_files` is the simpler rule format readers take (transformers' own layout).
- `read_index` is the one parser of index files (`Index`), `write_index` the one writer.
- `check_apart` refuses an output that would overwrite its input.
- `Contents` is what a format reads from a checkpoint and writes back (`qcore.formats`).
"""
from __future__ import annotations

import copy
import json
import os
import re
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Union

import numpy as np

from qcore.errors import InputError, InvalidDataError, QCoreError, StorageError
from qcore.files.paths import PathLike, atomic_write, check_input_path, is_url, parse_json
from qcore.spec.payload import QuantizedData

__all__ = ["INDEX_NAME", "INDEX_SUFFIX", "Checkpoint", "Contents", "Index", "Tensor", "check_apart", "resolve",
           "read_index", "index_doc", "write_index", "shard_files", "hub_cache_dir", "parse_size", "shard_name",
           "link_root", "other_files", "MAX_SIZE"]

INDEX_NAME = "model.safetensors.index.json"
INDEX_SUFFIX = ".safetensors.index.json"
_SINGLE_NAME = "model.safetensors"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")

Tensor = Union[QuantizedData, np.ndarray]


# ------------------------------------------------------------------------------------ index files
@dataclass(frozen=True)
class Index:
    """An index file as `read_index` found it: its document, and the parts of it qcore reads."""

    path: str
    doc: dict[str, Any]                # the whole JSON object, other top-level keys included
    weight_map: dict[str, str]         # tensor name -> shard file name, in the file's order
    metadata: dict[str, Any]           # its "metadata" object ({} when it has none)

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    @property
    def root(self) -> str:
        """The folder the index and its shards are in."""
        return os.path.dirname(os.path.abspath(self.path))

    @property
    def shards(self) -> list[str]:
        """The shard file names, in the order the weight map first names them."""
        return list(dict.fromkeys(self.weight_map.values()))

    def with_total_size(self, total: int) -> dict[str, Any]:
        """The document as it is (other keys, the map's order), with `metadata.total_size` = `total`."""
        doc = copy.deepcopy(self.doc)
        if not isinstance(doc.get("metadata"), dict):
            doc["metadata"] = {}
        doc["metadata"]["total_size"] = total
        return doc


def read_index(path: PathLike) -> Index:
    """The index file at `path`, checked before any shard is read: a readable regular file (a FIFO
    would block), a JSON object (text nested too deeply for Python's parser included), a non-empty
    `weight_map` of tensor name -> shard file name, each shard a file name in the index's folder
    (never a path, `.` or `..`) of a readable regular file. `InvalidDataError` or `StorageError`,
    one line naming the index, otherwise."""
    p = check_input_path(path)
    try:
        with open(p, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise StorageError(e.errno, f"cannot read {p}: {e.strerror or e}", p) from None
    doc = parse_json(raw, f"index file {p}")
    wmap = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wmap, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wmap.items()):
        raise InvalidDataError(f"{p}: not a safetensors index (JSON with a 'weight_map' of tensor name -> shard file)")
    if not wmap:
        raise InvalidDataError(f"{p}: 'weight_map' must name shard files in the index's folder; it names none")
    index = Index(p, doc, dict(wmap), dict(doc["metadata"]) if isinstance(doc.get("metadata"), dict) else {})
    for shard in index.shards:
        _check_shard(p, index.root, shard)
    return index


def _check_shard(index: str, root: str, shard: str) -> None:
    """A shard an index names: a file name in the index's folder of a readable regular file."""
    if shard in ("", ".", "..") or os.path.basename(shard) != shard or (os.altsep and os.altsep in shard):
        raise InvalidDataError(f"{index}: 'weight_map' must name shard files in the index's folder, got {shard!r}; "
                               "an index names its shards by file name (e.g. model-00001-of-00004.safetensors)")
    try:
        check_input_path(os.path.join(root, shard))
    except StorageError as e:
        raise StorageError(e.errno, f"{index} names shard {shard}: {e}", e.filename) from None


def index_doc(metadata: Mapping[str, Any], weight_map: Mapping[str, str], total_size: int) -> dict[str, Any]:
    """A new index document: `metadata` with `total_size`, the weight map sorted by tensor name."""
    return {"metadata": {**metadata, "total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}


def write_index(path: PathLike, doc: Mapping[str, Any]) -> None:
    """Write an index document (`index_doc`, `Index.with_total_size`) to `path`, atomically."""
    text = json.dumps(doc, indent=2) + "\n"

    def put(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    atomic_write(path, put)


# ----------------------------------------------------------------------------------- checkpoints
@dataclass
class Checkpoint:
    """Where a source's tensors are (`resolve`): `shards` (paths, in order) and, for a directory,
    its index and other files."""

    root: str                         # the directory holding the shards
    shards: list[str]                 # shard file names relative to root
    single_file: bool                 # the source was one .safetensors file (output: one file)
    index: Index | None = None        # the index file, if the source had one
    extras: list[str] = field(default_factory=list)           # other entries of root to copy

    @property
    def index_name(self) -> str | None:
        return self.index.name if self.index is not None else None

    @property
    def index_metadata(self) -> dict[str, Any]:
        return dict(self.index.metadata) if self.index is not None else {}

    @property
    def weight_map(self) -> dict[str, str]:
        """From the index ({} without one)."""
        return self.index.weight_map if self.index is not None else {}

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


@dataclass
class Contents:
    """The tensors of a checkpoint in qcore's terms, as a format reads them (`Format.read`) and
    writes them (`Format.write`), and the metadata a writer needs to restore it.

    `metadata` is a flat str -> str map (what a qcore safetensors file can carry); a format keeps
    its own facts under keys starting with its name and a dot (e.g. `gguf.kv`), so a conversion
    through qcore's format and back loses nothing.
    """

    tensors: dict[str, Tensor] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    format: str = ""
    folder: str | None = None
    """The model folder the tensors were read from (a transformers checkpoint directory with its
    `config.json` and tokenizer files), or None for a single file; a writer may read the model's
    hyper-parameters and tokenizer from it (GGUF does)."""
    refused: dict[str, str] = field(default_factory=dict)
    """Quantized tensors no qcore scheme holds exactly, name -> the reason: `tensors[name]` then holds
    the values the tool's own decode gives, which only a re-quantization may use (`read_checked`)."""


# ------------------------------------------------------------------------------------- resolving
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
    index = read_index(path)
    shards = sorted(index.shards)
    return Checkpoint(index.root, shards, False, index, _extras(index.root, {index.name, *shards}))


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
            check_input_path(p)  # missing: StorageError naming the path
    if os.path.isdir(p):
        names = sorted(os.listdir(p))
        index = [n for n in names if n.endswith(INDEX_SUFFIX)]
        if INDEX_NAME in index:
            return _from_index(os.path.join(p, INDEX_NAME))
        if len(index) == 1:
            return _from_index(os.path.join(p, index[0]))
        shards = [n for n in names if n.endswith(".safetensors") and os.path.isfile(os.path.join(p, n))]
        if not shards:
            raise InputError(
                f"directory {p} holds no .safetensors file and no {INDEX_NAME}; pass a checkpoint directory")
        return Checkpoint(os.path.abspath(p), shards, False, None, _extras(p, set(shards)))
    check_input_path(p)  # a readable regular file (not /dev/null), else StorageError naming it
    if p.endswith(".json"):
        return _from_index(p)
    root, name = os.path.split(os.path.abspath(p))
    return Checkpoint(root, [name], True)


def shard_files(path: PathLike) -> list[str]:
    """The files a format reader takes for `path`: the shards an index names (`*.safetensors.index.json`,
    or a folder holding `model.safetensors.index.json`, as transformers writes them; `read_index`), in
    the order its weight map first names them; a folder's one `model.safetensors` when it has no
    index; else the path itself."""
    p = os.fspath(path)
    index = os.path.join(p, INDEX_NAME) if os.path.isdir(p) else p
    single = os.path.join(p, _SINGLE_NAME)
    if os.path.isdir(p) and not os.path.exists(index) and os.path.isfile(single):
        return [single]
    if not index.endswith(INDEX_SUFFIX):
        return [p]
    return [os.path.join(os.path.dirname(index), n) for n in read_index(index).shards]


# ------------------------------------------------------------------------------ OUT must differ
_APART = "{out} must differ from {src}; write elsewhere and move it if you want to replace {src}"


def _same(a: str, b: str) -> bool:
    """Whether paths `a` and `b` name one file or folder: the same real path (symlinks and `..`
    resolved), or, both existing, the same inode (a hard link, a bind mount)."""
    if is_url(a) or is_url(b):
        return os.path.abspath(a) == os.path.abspath(b)
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return False


def check_apart(source: Checkpoint | PathLike, out: PathLike, *, folder: bool = False,
                names: tuple[str, str] = ("IN", "OUT")) -> None:
    """Refuse, before any work, an output that would overwrite what it reads: `out` is the source
    path, one of its shards or, when `folder` (the output is a folder of shards), the source's
    folder, each compared through symlinks and `..`. `source` is a resolved `Checkpoint`, or a
    path: then a folder, index or hub id that resolves adds its shards (one that does not is
    left to the command, which reports it). `names` are what the message calls the input and the
    output (the CLI's IN and OUT, `qcore convert`'s SRC and DST). InputError."""
    src_name, out_name = names
    o = os.fspath(out)
    if not isinstance(source, Checkpoint):
        s = os.fspath(source)
        if _same(s, o):
            raise InputError(_APART.format(src=src_name, out=out_name))
        if is_url(s):
            return
        try:
            source = resolve(s)
        except (QCoreError, OSError):  # not a checkpoint: the command says what is wrong with it
            return
    targets = [source.path(shard) for shard in source.shards] + ([source.root] if folder else [])
    if any(_same(t, o) for t in targets):
        raise InputError(_APART.format(src=src_name, out=out_name))


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
