"""One planned output shard at a time: the units a runner spreads over processes or hosts
(`qcore.model.distributed`). Plan every output shard once (`qcore.model.plan.plan_shards`), then
write each one on its own from its planned description (picklable): whole (`quantize_shard`), or
as consecutive groups of its tensors joined afterwards (`assemble_shard`). A shard an earlier
identical run completed is found by its run marker (`completed_shard`) and reported as resumed
(`resumed_rows`)."""
from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from qcore.errors import InputError, InvalidDataError, QCoreError
from qcore.spec.schemes import scheme as parse_scheme
from qcore.backend.protocol import Backend
from qcore.files import io as qio
from qcore.files.paths import atomic_write
from qcore.files.checkpoint import PathLike
from qcore.files.stfile import Reader, StreamWriter
from qcore.model.pipeline import stream_shards, write_in_place
from qcore.model.plan import PlannedShard, resolve_backend, shard_header_room
from qcore.model.reasons import Reason
from qcore.model.results import TensorResult

__all__ = ["quantize_shard", "assemble_shard", "resumed_rows", "completed_shard"]


def quantize_shard(shard: PlannedShard, sources: Mapping[str, PathLike], out_path: PathLike, recipe_json: str,
                   backend: str | Backend | None = None, *, stats: bool = True, compare: Sequence[Any] = (),
                   on_tensor: Callable[[TensorResult], None] | None = None,
                   atomic: bool = True) -> list[TensorResult]:
    """Write one planned output shard to `out_path` (atomically) from its source files.

    `sources` maps each source shard name the plan uses to a local file with its bytes (a sparse
    file holding the header and just this shard's tensors will do). The bytes written are those
    `quantize_model` writes for the same shard. `shard` may be a consecutive group of a planned
    shard's tensors (`shard.with_tensors(group)`): its file is then a part for `assemble_shard`.
    `atomic=False` writes `out_path` directly, for a temporary name the caller owns.
    """
    needed = shard.sources
    missing = [n for n in needed if n not in sources]
    if missing:
        raise InputError(f"quantize_shard of {shard.name} needs source shard {missing[0]}; "
                         "pass its local path in sources")
    readers = {n: Reader(sources[n]) for n in needed}
    try:
        return stream_shards([shard], {shard.name: os.fspath(out_path)}, readers, resolve_backend(backend),
                             recipe_json, stats, [parse_scheme(s) for s in compare], on_tensor,
                             atomic_write if atomic else write_in_place)
    finally:
        for r in readers.values():
            r.close()


def assemble_shard(shard: PlannedShard, parts: Iterable[PathLike], out_path: PathLike, recipe_json: str) -> None:
    """Write planned output shard `shard` to `out_path` (atomically) from its parts.

    `parts` are the files `quantize_shard` wrote for consecutive groups of the shard's tensors, in
    order (an iterable, so a caller can fetch each one as it is reached). Their tensors are copied
    one at a time and their metadata merged: the bytes are those `quantize_shard` writes for the
    whole shard.
    """
    meta: dict[str, str] = {}
    room = shard_header_room(shard, recipe_json)

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
            planned = [t.name for t in shard.tensors]
            if names != planned:
                raise InvalidDataError(f"the parts of {shard.name} hold tensors {names}, not the planned {planned}")
            w.finish(meta)

    atomic_write(os.fspath(out_path), write)


def resumed_rows(shard: PlannedShard, prior: qio.FileInfo) -> list[TensorResult]:
    """The rows of a shard an earlier identical run completed (`completed_shard`)."""
    planned = {t.name: t for t in shard.tensors}
    rows = []
    for e in prior.entries:
        t = planned[e.name]
        rows.append(TensorResult(e.name, t.head.shape, t.head.dtype, t.head.nbytes, e.nbytes,
                                 str(e.scheme) if e.quantized and not t.carried else "",
                                 "resumed" if not t.carried else t.note, file=shard.name,
                                 reason_code=Reason.RESUMED if not t.carried else t.reason_code))
    return rows


def completed_shard(path: PathLike, marker: str) -> qio.FileInfo | None:
    """The output shard at `path` (or its header stub) if a run with the same marker completed it."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        return None
    try:
        info = qio.read_info(path)
    except (QCoreError, OSError):
        return None
    return info if info.run == marker else None
