"""Whole models: quantize a checkpoint (file, sharded directory, index, cached hub id) or a dict.

`quantize_model(src, dst, recipe, backend=...)` plans every output shard from the source headers
(which tensor gets which scheme, its stored size), then streams: a reader thread reads one tensor
at a time, the calling thread quantizes it and measures its error, a writer thread appends it to
the current output shard (`qcore.files.stfile.StreamWriter`). At most two source tensors are in flight
(a semaphore), so peak memory is about three times the largest tensor (two sources and one
dequantized copy for the statistics) plus the interpreter, whatever the model's size.

Each output shard is written atomically (`qcore.files.io.atomic_write`) and carries a run marker
(`qcore.run`: a hash of the recipe, the shard's tensor list and the source headers); with
`resume=True` an existing shard with the same marker is kept and its tensors are not read again.
The index file (`model.safetensors.index.json`) is written last, with the new sizes.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import queue
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, Union

import numpy as np

from qcore import _signals
from qcore.files import io as qio
from qcore.files.checkpoint import INDEX_NAME, Checkpoint, parse_size, resolve, shard_name
from qcore.errors import InputError, InvalidDataError, QCoreError
from qcore.integrations.config import CONFIG_NAME, quantization_config, write_config
from qcore.spec.payload import QuantizedData, sections
from qcore.backend.protocol import Backend, QTensor, require_support
from qcore.model.recipe import Decision, Recipe, RecipeLike, Rule, as_recipe
from qcore.spec.scheme import QuantScheme, scheme as parse_scheme
from qcore.files.stfile import Reader, StreamWriter, TensorHead, header_room, np_dtype, st_dtype

__all__ = ["TensorResult", "ModelResult", "RunProgress", "quantize_model", "quantize_dict", "dequantize_model",
           "plan_shards", "quantize_shard", "assemble_shard", "consecutive_groups", "resumed_rows",
           "completed_shard"]

PathLike = Union[str, "os.PathLike[str]"]
T = TypeVar("T")
IN_FLIGHT = 2   # source tensors read ahead of the writer (the memory bound's factor)
_POLL = 0.1


@dataclass
class TensorResult:
    """What happened to one tensor."""

    name: str
    shape: tuple[int, ...]
    source_dtype: str                 # safetensors dtype name of the source ("F32", "BF16", ...)
    before: int                       # bytes in the source dtype
    after: int                        # bytes written
    scheme: str = ""                  # '' when kept
    note: str = ""                    # why it was kept, or "resumed"
    sqnr: float = math.nan
    max_err: float = math.nan
    file: str = ""                    # output file it went to
    compare: dict[str, float] = field(default_factory=dict)

    @property
    def quantized(self) -> bool:
        return bool(self.scheme)


@dataclass
class ModelResult:
    """The outcome of `quantize_model`: a row per tensor, the files written and the shards resumed."""

    source: str
    output: str
    recipe: Recipe
    backend: str
    tensors: list[TensorResult]
    files: list[str]
    resumed: list[str]
    seconds: float
    format: str = "qcore"
    """The output's format (`format=` of `quantize_model`)."""
    requantized: dict[str, str] = field(default_factory=dict)
    """Tensors quantized to another scheme than the recipe's, because the format cannot hold
    that one (`requantize=`): {name: "FROM -> TO"}."""

    @property
    def before(self) -> int:
        return sum(t.before for t in self.tensors)

    @property
    def after(self) -> int:
        return sum(t.after for t in self.tensors)

    @property
    def ratio(self) -> float:
        """Compression against the source dtypes."""
        return self.before / self.after if self.after else math.inf


FileId = tuple[int, int, int]


def _file_id(path: str) -> FileId | None:
    """What identifies the file at `path` now (inode, size, mtime), or None when there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


@dataclass
class RunProgress:
    """The files a whole-model run writes into its output folder and which of them are complete,
    for a caller that reports on a run that stopped early (Ctrl-C, SIGTERM, an error).

    Pass one to `quantize_model` or `dequantize_model` (`progress=`); the run fills in its plan
    before it writes anything. Every file is written atomically, so a file that changed since the
    plan is complete; a shard kept by `resume` is complete too. A one-file output has no plan
    (`planned` is False): the file is there whole or not at all.
    """

    shards: list[str] = field(default_factory=list)   # the output shards' paths, in order
    index: str | None = None                          # the index file's path, None when none is written
    kept: list[str] = field(default_factory=list)     # shards an earlier run completed (resume)
    resumable: bool = False                           # whether `resume=True` continues from the shards
    _before: dict[str, FileId | None] = field(default_factory=dict, repr=False)

    def plan(self, shards: Sequence[str], index: str | None, *, kept: Sequence[str] = (),
             resumable: bool = False) -> None:
        """Record the run's files and what was at each path before the run."""
        self._before = {p: _file_id(p) for p in [*shards, *([index] if index else [])]}
        self.shards, self.index, self.kept, self.resumable = list(shards), index, list(kept), resumable

    @property
    def planned(self) -> bool:
        return bool(self._before)

    def complete(self) -> list[str]:
        """The shards and the index that are complete now: kept, or written since the plan."""
        return [p for p in self._before if p in self.kept or _file_id(p) not in (None, self._before[p])]


# ------------------------------------------------------------------------------------ planning
@dataclass
class _Item:
    name: str
    source: str                      # source shard file name
    head: TensorHead
    scheme: Any                      # QuantScheme or None (kept)
    note: str
    out_dtype: str
    out_shape: tuple[int, ...]
    carried: dict[str, str]          # qcore keys of an already quantized source tensor
    shard: str = ""                  # output shard file name

    @property
    def out_bytes(self) -> int:
        return int(np.prod(self.out_shape, dtype=np.int64)) * np_dtype(self.out_dtype).itemsize


@dataclass
class _OutShard:
    name: str
    items: list[_Item]
    user_meta: dict[str, str]
    marker: str = ""


def _backend(backend: str | Backend | None) -> Backend:
    from qcore.backend.registry import backend as get

    return backend if isinstance(backend, Backend) else get(backend)


def _check_supports(be: Backend, recipe: Recipe) -> None:
    for sch in recipe.schemes():
        require_support(be, sch)


def _decide(recipe: Recipe, head: TensorHead, info_entry: qio.Entry | None) -> tuple[Any, str, str, tuple, dict]:
    """(scheme or None, note, stored dtype, stored shape, carried qcore keys) for one source tensor."""
    if info_entry is not None and info_entry.quantized:
        keys = qio.quantized_keys(head.name, info_entry.scheme, info_entry.shape, info_entry.source_dtype)
        return None, f"already quantized ({info_entry.scheme})", head.dtype, head.shape, keys
    d: Decision = recipe.decide(head.name, head.shape, np_dtype(head.dtype))
    if d.scheme is None:
        return None, d.reason, head.dtype, head.shape, {}
    return d.scheme, "", "U8", (sections(head.shape, d.scheme).total,), {}


def _plan(ck: Checkpoint, recipe: Recipe, max_shard_size: int | None,
          readers: dict[str, Reader]) -> tuple[list[_OutShard], str]:
    items: list[_Item] = []
    metas: dict[str, dict[str, str]] = {}
    ck.check_tensors({shard: list(readers[shard].tensors) for shard in ck.shards})
    for shard in ck.shards:
        r = readers[shard]
        info = qio.read_info(r.path)
        entries = {e.name: e for e in info.entries}
        metas[shard] = dict(info.metadata)
        for name, head in r.tensors.items():
            sch, note, dt, shape, carried = _decide(recipe, head, entries.get(name))
            items.append(_Item(name, shard, head, sch, note, dt, shape, carried))
    prefix = (ck.index_name or INDEX_NAME)[: -len(".safetensors.index.json")] if not ck.single_file \
        else os.path.splitext(ck.shards[0])[0]
    if max_shard_size is None:
        out = [_OutShard(s, [i for i in items if i.source == s], metas[s]) for s in ck.shards]
    else:
        groups = consecutive_groups(items, lambda it: it.out_bytes, max_shard_size) or [[]]
        common = {k: v for k, v in metas[ck.shards[0]].items() if all(metas[s].get(k) == v for s in ck.shards)}
        out = [_OutShard(shard_name(prefix, k + 1, len(groups)), g, common) for k, g in enumerate(groups)]
    for s in out:
        for it in s.items:
            it.shard = s.name
    return out, prefix


def consecutive_groups(items: Sequence[T], size: Callable[[T], int], limit: int) -> list[list[T]]:
    """`items` in their order, cut into consecutive groups whose `size`s sum to at most `limit`.

    An item larger than `limit` is a group of its own. No items, no groups.
    """
    groups: list[list[T]] = []
    total = 0
    for it in items:
        n = size(it)
        if not groups or total + n > limit:
            groups.append([])
            total = 0
        groups[-1].append(it)
        total += n
    return groups


def _marker(shard: _OutShard, recipe_json: str, readers: dict[str, Reader]) -> str:
    """Hash of what decides a shard's bytes: recipe, tensor list and placement, source headers."""
    h = hashlib.sha256()
    sources = sorted({it.source for it in shard.items})
    doc = {"format": qio.FORMAT_VERSION, "recipe": recipe_json, "shard": shard.name,
           "tensors": [[it.name, it.source] for it in shard.items],
           "sources": {s: [hashlib.sha256(readers[s].header_bytes).hexdigest(),
                           os.path.getsize(readers[s].path)] for s in sources}}
    h.update(json.dumps(doc, sort_keys=True).encode())
    return h.hexdigest()


def _shard_metadata(shard: _OutShard, recipe_json: str) -> dict[str, str]:
    """Every metadata key the plan gives `shard` (those of tensors kept at run time are dropped later)."""
    meta = qio.qcore_header(shard.user_meta, recipe_json, shard.marker)
    for it in shard.items:
        meta.update(it.carried)
        if it.scheme is not None:
            meta.update(qio.quantized_keys(it.name, it.scheme, it.head.shape, it.head.dtype))
    return meta


def _header_room(shard: _OutShard, recipe_json: str) -> int:
    """The header room reserved in `shard`'s file: enough for every planned tensor and key."""
    planned = [(it.name, it.out_dtype, it.out_shape) for it in shard.items]
    return header_room(planned, _shard_metadata(shard, recipe_json))


# ------------------------------------------------------------------------------------ pipeline
class _Stopped(Exception):
    """Another stage failed or the run was interrupted."""


class _Pipeline:
    """Reader thread -> caller (quantize, statistics) -> writer thread, with errors carried over."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.slots = threading.Semaphore(IN_FLIGHT)
        self.inbox: queue.Queue = queue.Queue()
        self.outbox: queue.Queue = queue.Queue(maxsize=IN_FLIGHT)

    def thread(self, fn: Callable[[], None]) -> threading.Thread:
        def body() -> None:
            try:
                fn()
            except _Stopped:
                pass
            except BaseException as e:  # carried to the caller, which re-raises it
                self.errors.append(e)
                self.stop.set()

        t = threading.Thread(target=body, daemon=True)
        t.start()
        return t

    def get(self, q: queue.Queue) -> Any:
        """The next item; what was queued before a stop is still delivered (so a shard whose
        tensors were all computed is finished), then `_Stopped`."""
        while True:
            try:
                return q.get(timeout=_POLL) if not self.stop.is_set() else q.get_nowait()
            except queue.Empty:
                if self.stop.is_set():
                    raise _Stopped from None

    def put(self, q: queue.Queue, item: Any) -> None:
        while True:
            if self.stop.is_set():
                raise _Stopped
            try:
                q.put(item, timeout=_POLL)
                return
            except queue.Full:
                continue

    def acquire(self) -> None:
        while not self.slots.acquire(timeout=_POLL):
            if self.stop.is_set():
                raise _Stopped


_END = object()


def _in_place(path: str, write: Callable[[str], None]) -> None:
    """Write `path` directly (a temporary name its caller owns), where `qio.atomic_write` renames."""
    write(path)


def _quantize_row(be: Backend, x: np.ndarray, it: _Item, row: TensorResult, stats: bool,
                  compare: Sequence[Any]) -> list[np.ndarray] | None:
    """Quantize source tensor `x` by its planned scheme and fill in `row` (scheme, stored size,
    SQNR and max error, the compared schemes' SQNR): the payload's parts, or None when the scheme
    cannot take the data (NaN/Inf: the tensor is kept, `row.note` says why).

    A function of its own, so that no `try` statement sits inside `_stream`'s try/finally: on
    CPython 3.11 an exception raised at such a statement's line (by a trace function, as the
    interrupt tests send signals) skips the enclosing `finally`, which joins the writer thread."""
    try:
        q: QTensor = be.quantize(x, it.scheme)
    except InputError as e:  # NaN/Inf and other data the scheme cannot take
        row.note = f"kept: {e}"
        return None
    payload = be.payload_parts(q)  # unjoined: streamed to the file without a joined copy
    row.scheme, row.after = str(it.scheme), sum(part.nbytes for part in payload)
    if stats:
        row.sqnr, row.max_err = be.error_stats(x, q)
    for s in compare:
        try:
            row.compare[str(s)] = be.error_stats(x, be.quantize(x, s))[0]
        except InputError:
            row.compare[str(s)] = math.nan
    return payload


def _stream(todo: list[_OutShard], paths: dict[str, str], readers: dict[str, Reader], be: Backend,
            recipe_json: str, stats: bool, compare: Sequence[Any],
            on_tensor: Callable[[TensorResult], None] | None,
            write_file: Callable[[str, Callable[[str], None]], None] = qio.atomic_write) -> list[TensorResult]:
    p = _Pipeline()
    rows: list[TensorResult] = []

    def read_all() -> None:
        for shard in todo:
            for it in shard.items:
                p.acquire()
                p.put(p.inbox, (it, readers[it.source].read(it.name)))
        p.put(p.inbox, _END)

    def write_all() -> None:
        for shard in todo:
            meta = _shard_metadata(shard, recipe_json)
            room = _header_room(shard, recipe_json)

            def write(tmp: str, shard: _OutShard = shard, meta: dict = meta, room: int = room) -> None:
                with open(tmp, "wb") as f:
                    w = StreamWriter(f, room)
                    for _ in shard.items:
                        name, arr, release, fell_back = p.get(p.outbox)
                        w.add(name, arr)  # (a payload comes as a list of its parts)
                        del arr
                        if release:
                            p.slots.release()
                        if fell_back:  # planned quantized, kept (NaN/Inf): its keys go
                            for k in (qio.scheme_key(name), qio.shape_key(name), qio.dtype_key(name)):
                                meta.pop(k, None)
                    w.finish(meta)

            write_file(paths[shard.name], write)

    reader = writer = None
    try:
        with _signals.deferred():  # a signal cannot land between a thread's start and its handle
            reader = p.thread(read_all)
            writer = p.thread(write_all)
        while True:
            msg = p.get(p.inbox)
            if msg is _END:
                break
            it, x = msg
            row = TensorResult(it.name, it.head.shape, it.head.dtype, it.head.nbytes, it.head.nbytes,
                               note=it.note, file=it.shard)
            out, release, fell_back = x, True, it.scheme is not None  # until it is quantized
            payload = _quantize_row(be, x, it, row, stats, compare) if it.scheme is not None else None
            if payload is not None:
                out, release, fell_back = payload, False, False
                x = None
                p.slots.release()
            p.put(p.outbox, (it.name, out, release, fell_back))
            del out, x
            rows.append(row)
            if on_tensor is not None:
                on_tensor(row)
        while writer.is_alive():  # the last shard's tail and header
            writer.join(_POLL)
    except _Stopped:  # a thread failed: its error is raised below
        pass
    finally:
        p.stop.set()  # frees a blocked reader or writer (an interrupt, an error here)
        with _signals.deferred():  # a second signal waits until the writer has removed its temp file
            for t in (reader, writer):
                if t is not None:
                    t.join()
    if p.errors:
        raise p.errors[0]
    return rows


# ------------------------------------------------------------------------------------ API
def quantize_dict(tensors: Mapping[str, Any], recipe: RecipeLike = None, backend: str | Backend | None = None, *,
                  rules: Sequence[str] = ()) -> dict[str, QTensor | np.ndarray]:
    """Quantize an in-memory state dict: name -> QTensor (chosen by the recipe) or the array as it was.

    Arrays the recipe keeps, or that the scheme cannot take (a block with more dims than the tensor,
    NaN/Inf), come back unchanged.
    """
    if not isinstance(tensors, Mapping):
        raise InputError(f"quantize_dict takes a dict of name -> array, got {type(tensors).__name__}")
    rc = as_recipe(recipe, rules=rules)
    be = _backend(backend)
    _check_supports(be, rc)
    out: dict[str, QTensor | np.ndarray] = {}
    for name, x in tensors.items():
        if isinstance(x, (QTensor, QuantizedData)):
            out[name] = x
            continue
        arr = np.asarray(x)
        d = rc.choose(name, arr.shape, arr.dtype)
        if d.scheme is None:
            out[name] = x
            continue
        try:
            out[name] = be.quantize(arr, d.scheme)
        except InputError:
            out[name] = x
    return out


def _extras_targets(ck: Checkpoint, dst: str) -> dict[str, str]:
    """The model folder's other files to copy (`Checkpoint.other_files`: no links out of the folder,
    no devices or FIFOs, no loops), as {source path: path under dst}."""
    return {ck.path(rel): os.path.join(dst, rel) for rel in ck.other_files()}


def _copy_extras(targets: Mapping[str, str]) -> None:
    """Copy the other files (`_extras_targets`), each atomically."""
    for src, target in targets.items():
        os.makedirs(os.path.dirname(target), exist_ok=True)
        qio.atomic_write(target, lambda tmp, src=src: shutil.copyfile(src, tmp))


_TEMP_TOKEN = r"\.(?:[a-z0-9_]{8}|[0-9a-f]{32})\.tmp"
"""The tail of a temporary file's name: `qcore.files.io`'s (tempfile's 8 characters) or a storage
upload's (a uuid): `.NAME.<token>.tmp` next to the file NAME it becomes."""


def _remove_stale_temporaries(paths: Iterable[str]) -> None:
    """Remove the temporary files (`.NAME.<token>.tmp`) that a killed run (SIGKILL, a power cut)
    left next to the files `paths` this run writes: they are this run's to replace, and nothing
    else removes them. Other hidden files are left alone."""
    by_folder: dict[str, set[str]] = {}
    for p in paths:
        folder, name = os.path.split(os.path.abspath(p))
        by_folder.setdefault(folder, set()).add(name)
    for folder, names in by_folder.items():
        try:
            entries = os.listdir(folder)
        except OSError:  # not there yet: nothing stale
            continue
        stale = re.compile("|".join(rf"\.{re.escape(n)}{_TEMP_TOKEN}" for n in sorted(names)))
        for entry in entries:
            if stale.fullmatch(entry):
                with _signals.deferred():
                    try:
                        os.unlink(os.path.join(folder, entry))
                    except FileNotFoundError:
                        pass


def _write_index(path: str, ck: Checkpoint, weight_map: dict[str, str], total: int) -> None:
    doc = {"metadata": {**ck.index_metadata, "total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    text = json.dumps(doc, indent=2) + "\n"
    qio.atomic_write(path, lambda tmp: open(tmp, "w", encoding="utf-8").write(text))


def prepare_run(recipe: RecipeLike, rules: Any, backend: str | Backend | None, compare: Sequence[Any],
                max_shard_size: str | int | None) -> tuple[Recipe, Backend, list[QuantScheme], int | None]:
    """What a whole-model run checks before any work, for this module and `qcore.model.distributed`:
    the recipe (it must quantize something), the backend supporting every scheme it and `compare`
    name, and the shard size limit. Returns (recipe, backend, compare schemes, limit in bytes)."""
    rc = as_recipe(recipe, rules=rules)
    if not rc.schemes():
        raise InputError("the recipe quantizes nothing: give a scheme (e.g. 'q8s') or rules PATTERN=SCHEME")
    be = _backend(backend)
    _check_supports(be, rc)
    cmp = [parse_scheme(s) for s in compare]
    _check_supports(be, Recipe(None, tuple(Rule("*", s) for s in cmp)))
    limit = parse_size(max_shard_size) if max_shard_size is not None else None
    return rc, be, cmp, limit


def quantize_model(src: PathLike | Mapping[str, Any], dst: PathLike | None = None, recipe: RecipeLike = None,
                   backend: str | Backend | None = None, *, rules: Sequence[str] = (),
                   max_shard_size: int | str | None = None, resume: bool = False, stats: bool = True,
                   compare: Sequence[Any] = (), on_plan: Callable[[int, int], None] | None = None,
                   on_tensor: Callable[[TensorResult], None] | None = None,
                   progress: RunProgress | None = None, format: str = "qcore",
                   requantize: Sequence[str] = ()) -> Any:
    """Quantize a whole model by `recipe` (a Recipe, scheme text, a .toml path or a dict).

    `src` is a .safetensors file, a sharded checkpoint directory, its index file, a hub id in the
    local hub cache, or an in-memory dict (then the result is `quantize_dict`'s dict, also saved to
    `dst` if given). For files the output is one file when the source is one file (and no
    `max_shard_size`), else a directory with the same shards (or new ones of at most
    `max_shard_size` bytes, e.g. "5GB"), a rewritten index and the source directory's other files.
    `resume` keeps output shards a previous identical run completed. `stats` measures SQNR and max
    error per tensor; `compare` adds the SQNR of other schemes (not written). `on_plan(count, bytes)`
    is called once with the work to do, `on_tensor(row)` after each tensor. `progress` (a
    `RunProgress`) is filled with the output folder's files, to tell what a stopped run left. The
    temporary files a killed run left next to the files written are removed. Returns a ModelResult.

    `format` other than "qcore" ("compressed-tensors", "gguf", "gpt-oss", "bitsandbytes", "torchao", or
    a plugin's) writes that tool's checkpoint in the same step, each tensor in its recipe scheme
    (`qcore.model.export`): a scheme the format cannot hold exactly is an error before any work, unless
    a `requantize` rule "FROM=TO" (FROM a scheme or a tensor-name pattern) names it.
    """
    if format != "qcore":
        if isinstance(src, Mapping) or dst is None:
            raise InputError(f"format={format!r} exports a checkpoint path to dst; give both as paths")
        if resume or compare:
            raise InputError(f"format={format!r} takes neither resume nor compare; drop them")
        from qcore.model.export import export_model

        return export_model(src, dst, recipe, backend, format=format, requantize=requantize, rules=rules,
                            max_shard_size=max_shard_size, stats=stats, on_plan=on_plan, on_tensor=on_tensor,
                            progress=progress)
    if requantize:
        raise InputError("requantize (--requantize) applies to an export to another format (format=, --format)")
    if isinstance(src, Mapping):
        out = quantize_dict(src, recipe, backend, rules=rules)
        if dst is not None:
            dtypes = {n: np.asarray(src[n]).dtype for n, v in out.items() if isinstance(v, QTensor)}
            qio.save(dst, out, source_dtypes=dtypes, recipe=as_recipe(recipe, rules=rules).to_json())
        return out
    if dst is None:
        raise InputError("quantize_model of a file or directory needs dst, where to write the result")
    t0 = time.perf_counter()
    rc, be, cmp, limit = prepare_run(recipe, rules, backend, compare, max_shard_size)
    ck = resolve(src)
    dst_s = os.fspath(dst)
    one_file = ck.single_file and limit is None
    if os.path.abspath(dst_s) in {os.path.abspath(ck.path(s)) for s in ck.shards} or \
            (not one_file and os.path.abspath(dst_s) == os.path.abspath(ck.root)):
        raise InputError("OUT must differ from IN; write elsewhere and move it if you want to replace IN")
    readers = {s: Reader(ck.path(s)) for s in ck.shards}
    try:
        shards, recipe_json = plan_shards(ck, rc, limit, readers)
        if one_file:
            paths = {shards[0].name: dst_s}
        else:
            paths = {s.name: os.path.join(dst_s, s.name) for s in shards}
        index = os.path.join(dst_s, ck.index_name or INDEX_NAME) \
            if not one_file and (ck.index_name or limit is not None) else None
        done_rows: list[TensorResult] = []
        resumed: list[str] = []
        todo: list[_OutShard] = []
        for s in shards:
            prior = _completed(paths[s.name], s.marker) if resume else None
            if prior is None:
                todo.append(s)
                continue
            resumed.append(s.name)
            done_rows += resumed_rows(s, prior)
        extras = {} if one_file else _extras_targets(ck, dst_s)
        config = extras.pop(ck.path(CONFIG_NAME), None)  # written with its quantization_config
        if progress is not None and not one_file:
            progress.plan([paths[s.name] for s in shards], index, kept=[paths[n] for n in resumed], resumable=True)
        if on_plan is not None:
            work = [i for s in todo for i in s.items if i.scheme is not None]
            on_plan(len(work), sum(i.head.nbytes for i in work))
        if not one_file:
            os.makedirs(dst_s, exist_ok=True)
        _remove_stale_temporaries([*paths.values(), *([index] if index else []), *extras.values(),
                                   *([config] if config else [])])
        _copy_extras(extras)
        if config is not None:
            write_config(ck.path(CONFIG_NAME), config, quantization_config(planned_schemes(shards), recipe_json))
        rows = _stream(todo, paths, readers, be, recipe_json, stats, cmp, on_tensor)
    finally:
        for r in readers.values():
            r.close()
    by_name = {r.name: r for r in done_rows + rows}
    ordered = [by_name[i.name] for s in shards for i in s.items]
    files = [paths[s.name] for s in shards]
    if index is not None:
        _write_index(index, ck, {r.name: r.file for r in ordered}, sum(r.after for r in ordered))
        files.append(index)
    return ModelResult(os.fspath(src), dst_s, rc, be.name, ordered, files, resumed, time.perf_counter() - t0)


def _header_len(path: str) -> int:
    with open(path, "rb") as f:
        return int.from_bytes(f.read(8), "little")


def _completed(path: str, marker: str) -> qio.FileInfo | None:
    """The output shard at `path` if a previous run with the same marker completed it."""
    if not os.path.isfile(path):
        return None
    try:
        info = qio.read_info(path)
    except (QCoreError, OSError):
        return None
    return info if info.run == marker else None


# ------------------------------------------------------------------------- per-shard entry points
# The units a runner spreads over processes or hosts (qcore.model.distributed): plan every output shard
# once, then quantize each one on its own from the planned description (picklable).
def planned_schemes(shards: Sequence[_OutShard]) -> dict[str, QuantScheme]:
    """{name: scheme} of every tensor the planned output holds quantized: quantized by the run,
    or already quantized in the source."""
    out: dict[str, QuantScheme] = {}
    for s in shards:
        for it in s.items:
            carried = it.carried.get(qio.scheme_key(it.name))
            if it.scheme is not None or carried is not None:
                out[it.name] = it.scheme if it.scheme is not None else parse_scheme(carried)
    return out


def plan_shards(ck: Checkpoint, recipe: Recipe, max_shard_size: int | None,
                readers: Mapping[str, Reader]) -> tuple[list[_OutShard], str]:
    """The output shards of `ck` (their tensors, schemes and run markers) and the recipe's JSON.

    `readers` need only the source headers (a header stub of a remote file will do).
    """
    shards, _ = _plan(ck, recipe, max_shard_size, dict(readers))
    recipe_json = recipe.to_json()
    for s in shards:
        s.marker = _marker(s, recipe_json, dict(readers))
    return shards, recipe_json


def quantize_shard(shard: _OutShard, sources: Mapping[str, PathLike], out_path: PathLike, recipe_json: str,
                   backend: str | Backend | None = None, *, stats: bool = True, compare: Sequence[Any] = (),
                   on_tensor: Callable[[TensorResult], None] | None = None,
                   atomic: bool = True) -> list[TensorResult]:
    """Write one planned output shard to `out_path` (atomically) from its source files.

    `sources` maps each source shard name the plan uses to a local file with its bytes (a sparse
    file holding the header and just this shard's tensors will do). The bytes written are those
    `quantize_model` writes for the same shard. `shard` may be a consecutive group of a planned
    shard's tensors (`dataclasses.replace(shard, items=group)`): its file is then a part for
    `assemble_shard`. `atomic=False` writes `out_path` directly, for a temporary name the caller
    owns.
    """
    needed = sorted({it.source for it in shard.items})
    missing = [n for n in needed if n not in sources]
    if missing:
        raise InputError(f"quantize_shard of {shard.name} needs source shard {missing[0]}; "
                         "pass its local path in sources")
    readers = {n: Reader(sources[n]) for n in needed}
    try:
        return _stream([shard], {shard.name: os.fspath(out_path)}, readers, _backend(backend), recipe_json, stats,
                       [parse_scheme(s) for s in compare], on_tensor, qio.atomic_write if atomic else _in_place)
    finally:
        for r in readers.values():
            r.close()


def assemble_shard(shard: _OutShard, parts: Iterable[PathLike], out_path: PathLike, recipe_json: str) -> None:
    """Write planned output shard `shard` to `out_path` (atomically) from its parts.

    `parts` are the files `quantize_shard` wrote for consecutive groups of the shard's tensors, in
    order (an iterable, so a caller can fetch each one as it is reached). Their tensors are copied
    one at a time and their metadata merged: the bytes are those `quantize_shard` writes for the
    whole shard.
    """
    meta: dict[str, str] = {}
    room = _header_room(shard, recipe_json)

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            w = StreamWriter(f, room)
            names: list[str] = []
            for part in parts:
                with Reader(part) as r:
                    meta.update(r.metadata)
                    for name in r.tensors:
                        w.add(name, r.read(name))
                        names.append(name)
            planned = [it.name for it in shard.items]
            if names != planned:
                raise InvalidDataError(f"the parts of {shard.name} hold tensors {names}, not the planned {planned}")
            w.finish(meta)

    qio.atomic_write(os.fspath(out_path), write)


def resumed_rows(shard: _OutShard, prior: qio.FileInfo) -> list[TensorResult]:
    """The rows of a shard an earlier identical run completed (`completed_shard`)."""
    planned = {i.name: i for i in shard.items}
    rows = []
    for e in prior.entries:
        it = planned[e.name]
        rows.append(TensorResult(e.name, it.head.shape, it.head.dtype, it.head.nbytes, e.nbytes,
                                 str(e.scheme) if e.quantized and not it.carried else "",
                                 "resumed" if not it.carried else it.note, file=shard.name))
    return rows


def completed_shard(path: PathLike, marker: str) -> qio.FileInfo | None:
    """The output shard at `path` (or its header stub) if a run with the same marker completed it."""
    return _completed(os.fspath(path), marker)


# ------------------------------------------------------------------------------------ dequantize
def dequantize_model(src: PathLike, dst: PathLike, dtype: Any = None,
                     backend: str | Backend | None = None, *,
                     progress: RunProgress | None = None) -> tuple[int, int]:
    """Dequantize every quantized tensor of a file or checkpoint directory.

    Returns (tensors dequantized, tensors written).

    `dtype` None restores each tensor's recorded source dtype (float32 when none is recorded).
    The output has the source's structure (one file, or shards + index + other files), one
    tensor in memory at a time. The shards and the index are checked as `quantize_model` checks
    them, before anything is written; `progress` is filled as `quantize_model` fills it.
    """
    ck = resolve(src)
    dst_s = os.fspath(dst)
    infos = {shard: qio.read_info(ck.path(shard)) for shard in ck.shards}
    ck.check_tensors({shard: [e.name for e in info.entries] for shard, info in infos.items()})
    outs = {shard: dst_s if ck.single_file else os.path.join(dst_s, shard) for shard in ck.shards}
    if any(os.path.abspath(outs[s]) == os.path.abspath(ck.path(s)) for s in ck.shards):
        raise InputError("OUT must differ from IN; write elsewhere and move it if you want to replace IN")
    index = os.path.join(dst_s, ck.index_name) if ck.index_name else None
    extras = {} if ck.single_file else _extras_targets(ck, dst_s)
    config = extras.pop(ck.path(CONFIG_NAME), None)  # written without qcore's quantization_config
    if progress is not None and not ck.single_file:
        progress.plan(list(outs.values()), index)
    if not ck.single_file:
        os.makedirs(dst_s, exist_ok=True)
    _remove_stale_temporaries([*outs.values(), *([index] if index else []), *extras.values(),
                               *([config] if config else [])])
    _copy_extras(extras)
    if config is not None:
        write_config(ck.path(CONFIG_NAME), config, None)
    be = None
    n = total = 0
    for shard in ck.shards:
        info = infos[shard]
        out_path = outs[shard]
        with Reader(ck.path(shard)) as r:
            plan = []
            for e in info.entries:
                want = np.dtype(dtype) if dtype is not None else np_dtype(e.source_dtype or "F32")
                plan.append((e, want))
            meta = qio.qcore_header(info.metadata)
            room = header_room([(e.name, st_dtype(w) if e.quantized else e.dtype, e.shape) for e, w in plan], meta)

            def write(tmp: str, r: Reader = r, plan: list = plan, meta: dict = meta, room: int = room) -> None:
                nonlocal be, n
                with open(tmp, "wb") as f:
                    w = StreamWriter(f, room)
                    for e, want in plan:
                        a = r.read(e.name)
                        if e.quantized:
                            be = be or _backend(backend)
                            q = be.from_data(QuantizedData(e.shape, e.scheme, a.tobytes()))
                            a = be.to_numpy(q.dequantize(want))
                            n += 1
                        w.add(e.name, a)
                    w.finish(meta)

            qio.atomic_write(out_path, write)
        total += len(plan)
    if index is not None:
        with open(os.path.join(ck.root, ck.index_name), encoding="utf-8") as f:
            doc = json.load(f)
        size = sum(os.path.getsize(os.path.join(dst_s, s)) - 8 - _header_len(os.path.join(dst_s, s))
                   for s in ck.shards)
        if not isinstance(doc.get("metadata"), dict):
            doc["metadata"] = {}
        doc["metadata"]["total_size"] = size
        text = json.dumps(doc, indent=2) + "\n"
        qio.atomic_write(index, lambda tmp: open(tmp, "w", encoding="utf-8").write(text))
    return n, total
