"""Planning a whole-model run before any tensor is read: what it checks first (`prepare_run`),
then from the source headers alone each tensor's scheme, stored dtype and shape, the output shard
it goes to, and each shard's run marker (`plan_shards`).

A plan is data: `PlannedShard`s of `PlannedTensor`s, frozen and picklable, so that a runner can
send a shard (or a consecutive group of its tensors, `PlannedShard.with_tensors`) to another
process or host (`qcore.model.shards`, `qcore.model.distributed`).
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import numpy as np

from qcore.errors import InputError
from qcore.spec.payload import sections
from qcore.spec.schemes import QuantScheme, scheme as parse_scheme
from qcore.backend.protocol import Backend, require_support
from qcore.files import io as qio
from qcore.files.checkpoint import INDEX_NAME, INDEX_SUFFIX, Checkpoint, parse_size, shard_name
from qcore.files.stfile import Reader, TensorHead, header_room, np_dtype
from qcore.model.reasons import Reason
from qcore.model.recipe import Recipe, RecipeLike, Rule, as_recipe
from qcore.model.results import TensorResult

__all__ = ["PlannedTensor", "PlannedShard", "prepare_run", "resolve_backend", "check_supports", "plan_shards",
           "consecutive_groups", "planned_schemes", "planned_work", "shard_metadata", "shard_header_room",
           "in_plan_order"]

T = TypeVar("T")


@dataclass(frozen=True)
class PlannedTensor:
    """One source tensor as the plan has it: where it comes from, what it becomes, where it goes."""

    name: str
    source: str                       # the source shard's file name
    head: TensorHead                  # its entry in the source header (dtype, shape, bytes)
    scheme: QuantScheme | None        # the scheme it is quantized to; None: kept as it is
    note: str                         # why it is kept ('' when quantized)
    reason_code: Reason | None        # `note` as a code
    out_dtype: str                    # the stored dtype ("U8" for a payload)
    out_shape: tuple[int, ...]        # the stored shape
    carried: Mapping[str, str] = field(default_factory=dict)  # qcore keys of a tensor quantized in the source
    shard: str = ""                   # the output shard's file name

    @property
    def out_bytes(self) -> int:
        return int(np.prod(self.out_shape, dtype=np.int64)) * np_dtype(self.out_dtype).itemsize


@dataclass(frozen=True)
class PlannedShard:
    """One output shard: its tensors in order, the source metadata it keeps and its run marker (a
    hash of what decides its bytes, which `resume` compares)."""

    name: str
    tensors: tuple[PlannedTensor, ...]
    user_meta: Mapping[str, str]
    marker: str = ""

    def with_tensors(self, group: Iterable[PlannedTensor]) -> PlannedShard:
        """This shard with only `group` (consecutive tensors of it): a part of the shard, written
        by `quantize_shard` and joined by `assemble_shard`."""
        return replace(self, tensors=tuple(group))

    @property
    def sources(self) -> list[str]:
        """The source shards its tensors come from, sorted."""
        return sorted({t.source for t in self.tensors})


def resolve_backend(backend: str | Backend | None) -> Backend:
    """`backend` itself, or the registered backend of that name (None: `$QCORE_BACKEND`, else auto)."""
    from qcore.backend.registry import backend as get

    return backend if isinstance(backend, Backend) else get(backend)


def check_supports(be: Backend, recipe: Recipe) -> None:
    """UnsupportedSchemeError, naming the backends that do, unless `be` supports every scheme of `recipe`."""
    for sch in recipe.schemes():
        require_support(be, sch)


def prepare_run(recipe: RecipeLike, rules: Any, backend: str | Backend | None, compare: Sequence[Any],
                max_shard_size: str | int | None) -> tuple[Recipe, Backend, list[QuantScheme], int | None]:
    """What a whole-model run checks before any work (every runner: qcore's format, an export,
    a distributed run): the recipe (it must quantize something), the backend supporting every
    scheme it and `compare` name, and the shard size limit. Returns (recipe, backend, compare
    schemes, limit in bytes)."""
    rc = as_recipe(recipe, rules=rules)
    if not rc.schemes():
        raise InputError("the recipe quantizes nothing: give a scheme (e.g. 'q8s') or rules PATTERN=SCHEME")
    be = resolve_backend(backend)
    check_supports(be, rc)
    cmp = [parse_scheme(s) for s in compare]
    check_supports(be, Recipe(None, tuple(Rule("*", s) for s in cmp)))
    limit = parse_size(max_shard_size) if max_shard_size is not None else None
    return rc, be, cmp, limit


def _planned(recipe: Recipe, source: str, head: TensorHead, info_entry: qio.Entry | None) -> PlannedTensor:
    """One source tensor planned: quantized in the source already (carried over), kept by the
    recipe, or quantized to the recipe's scheme."""
    if info_entry is not None and info_entry.quantized:
        keys = qio.quantized_keys(head.name, info_entry.scheme, info_entry.shape, info_entry.source_dtype)
        return PlannedTensor(head.name, source, head, None, f"already quantized ({info_entry.scheme})",
                             Reason.ALREADY_QUANTIZED, head.dtype, head.shape, keys)
    d = recipe.decide(head.name, head.shape, np_dtype(head.dtype))
    if d.scheme is None:
        return PlannedTensor(head.name, source, head, None, d.reason, d.reason_code, head.dtype, head.shape)
    return PlannedTensor(head.name, source, head, d.scheme, "", None, "U8", (sections(head.shape, d.scheme).total,))


def plan_shards(ck: Checkpoint, recipe: Recipe, max_shard_size: int | None,
                readers: Mapping[str, Reader]) -> tuple[list[PlannedShard], str]:
    """The output shards of `ck` (their tensors, schemes and run markers) and the recipe's JSON.

    Without `max_shard_size` the output has the source's shards; with it, new shards of at most
    that many stored bytes (a larger tensor is a shard of its own). `readers` need only the
    source headers (a header stub of a remote file will do).
    """
    readers = dict(readers)
    tensors: list[PlannedTensor] = []
    metas: dict[str, dict[str, str]] = {}
    ck.check_tensors({shard: list(readers[shard].tensors) for shard in ck.shards})
    for shard in ck.shards:
        r = readers[shard]
        info = qio.read_info(r.path)
        entries = {e.name: e for e in info.entries}
        metas[shard] = dict(info.metadata)
        tensors += [_planned(recipe, shard, head, entries.get(name)) for name, head in r.tensors.items()]
    if max_shard_size is None:
        groups = [(s, [t for t in tensors if t.source == s], metas[s]) for s in ck.shards]
    else:
        prefix = (ck.index_name or INDEX_NAME)[: -len(INDEX_SUFFIX)] if not ck.single_file \
            else os.path.splitext(ck.shards[0])[0]
        cut = consecutive_groups(tensors, lambda t: t.out_bytes, max_shard_size) or [[]]
        common = {k: v for k, v in metas[ck.shards[0]].items() if all(metas[s].get(k) == v for s in ck.shards)}
        groups = [(shard_name(prefix, k + 1, len(cut)), g, common) for k, g in enumerate(cut)]
    recipe_json = recipe.to_json()
    shards = []
    for name, group, meta in groups:
        shard = PlannedShard(name, tuple(replace(t, shard=name) for t in group), meta)
        shards.append(replace(shard, marker=_marker(shard, recipe_json, readers)))
    return shards, recipe_json


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


def _marker(shard: PlannedShard, recipe_json: str, readers: Mapping[str, Reader]) -> str:
    """Hash of what decides a shard's bytes: recipe, tensor list and placement, source headers."""
    h = hashlib.sha256()
    doc = {"format": qio.FORMAT_VERSION, "recipe": recipe_json, "shard": shard.name,
           "tensors": [[t.name, t.source] for t in shard.tensors],
           "sources": {s: [hashlib.sha256(readers[s].header_bytes).hexdigest(),
                           os.path.getsize(readers[s].path)] for s in shard.sources}}
    h.update(json.dumps(doc, sort_keys=True).encode())
    return h.hexdigest()


def shard_metadata(shard: PlannedShard, recipe_json: str) -> dict[str, str]:
    """Every metadata key the plan gives `shard` (those of tensors kept at run time are dropped later)."""
    meta = qio.qcore_header(shard.user_meta, recipe_json, shard.marker)
    for t in shard.tensors:
        meta.update(t.carried)
        if t.scheme is not None:
            meta.update(qio.quantized_keys(t.name, t.scheme, t.head.shape, t.head.dtype))
    return meta


def shard_header_room(shard: PlannedShard, recipe_json: str) -> int:
    """The header room reserved in `shard`'s file: enough for every planned tensor and key."""
    planned = [(t.name, t.out_dtype, t.out_shape) for t in shard.tensors]
    return header_room(planned, shard_metadata(shard, recipe_json))


def planned_schemes(shards: Sequence[PlannedShard]) -> dict[str, QuantScheme]:
    """{name: scheme} of every tensor the planned output holds quantized: quantized by the run,
    or already quantized in the source."""
    out: dict[str, QuantScheme] = {}
    for s in shards:
        for t in s.tensors:
            carried = t.carried.get(qio.scheme_key(t.name))
            if t.scheme is not None or carried is not None:
                out[t.name] = t.scheme if t.scheme is not None else parse_scheme(carried)
    return out


def planned_work(shards: Iterable[PlannedShard]) -> tuple[int, int]:
    """(tensors to quantize, their source bytes) in `shards`: what `on_plan` is told."""
    work = [t for s in shards for t in s.tensors if t.scheme is not None]
    return len(work), sum(t.head.nbytes for t in work)


def in_plan_order(shards: Sequence[PlannedShard], rows: Iterable[TensorResult]) -> list[TensorResult]:
    """`rows` (one per planned tensor, in any order) in the plan's order."""
    by_name = {r.name: r for r in rows}
    return [by_name[t.name] for s in shards for t in s.tensors]
