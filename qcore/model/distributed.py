"""Quantize a checkpoint across processes, GPUs and hosts on Dask, with storage behind fsspec URLs.

Every scale qcore computes is per tensor, so the work splits without any collective: one planned
output shard is one unit (for an unchanged layout, one input shard in, one output shard out).
The client plans every shard from the source headers alone (`qcore.model.plan.plan_shards`, through
header stubs for remote sources, see `qcore.files.storage`), sends each unit to a Dask worker, and
writes the index and copies the other files once all shards are in. A worker stages the unit's
source shards (remote ones are downloaded to its scratch directory), runs
`qcore.model.shards.quantize_shard` (the single-process code: tensors stream through, so a unit's memory
is about three times its largest tensor whatever the shard's size) and puts the result at the
destination under a temporary name, then moves it onto the shard's name. The output bytes are
those of `qcore.quantize_model`.

A shard with more source bytes than a worker's memory limit (or than `group_bytes`) is split:
its tensors, in plan order, are cut into consecutive groups of at most that many source bytes
(`tensor_groups`), each group is a task of its own (`run_group`: it stages just its tensors'
bytes and writes a part file next to the shard under a temporary name,
`.NAME.part-K-of-N.<token>.tmp`), and an assembly task (`assemble_unit`, through
`qcore.model.shards.assemble_shard`) streams the parts in order into the shard, with the header and
metadata `quantize_shard` writes, moves it into place and deletes the parts. The groups' rows
come back from their tasks, so progress advances per group.

Faults: when a worker dies mid-task, Dask's scheduler runs the task again on another worker
(up to `distributed.scheduler.allowed-failures` times); the dead worker's temporary file never
carries a shard's name and is removed at the end of the run, failed or not. `resume=True` keeps
output shards an earlier run with the same plan completed (their run marker matches), so a failed
run is finished by running it again; a split shard that was not assembled is redone whole.

Without `cluster`, `scheduler` or `client` the units run in this process one after another (no
Dask needed; fsspec only for URLs).
"""
from __future__ import annotations

import os
import posixpath
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from qcore.errors import InputError
from qcore.files.checkpoint import INDEX_NAME, Checkpoint, check_apart, parse_size, resolve, write_index
from qcore.files.paths import PathLike
from qcore.files.stfile import Reader
from qcore.files.storage import Location, location
from qcore.files.hfconfig import CONFIG_NAME, quantization_config, write_config
from qcore.model.output import rows_index
from qcore.model.pipeline import IN_FLIGHT
from qcore.model.plan import (PlannedShard, PlannedTensor, consecutive_groups, in_plan_order, plan_shards,
                              planned_schemes, planned_work, prepare_run)
from qcore.model.recipe import RecipeLike
from qcore.model.results import ModelResult, TensorResult
from qcore.model.shards import assemble_shard, completed_shard, quantize_shard, resumed_rows

__all__ = ["Unit", "Part", "run_unit", "run_group", "assemble_unit", "split_unit", "tensor_groups",
           "quantize_model_distributed", "open_client"]

INTERPRETER_BYTES = 300 << 20   # a worker's own footprint beside a unit's tensors
KEY_PREFIX = "qcore-shard"
# A LocalCluster has one single-threaded worker process per core; Numba's parallel kernels (the
# ndarray backend) would otherwise start a thread per core in every one of them.
ONE_CORE_ENV = {"NUMBA_NUM_THREADS": "1"}


@dataclass
class Unit:
    """One output shard to write, or one group of a split shard's tensors: what a worker needs,
    picklable."""

    shard: PlannedShard               # the planned shard (its tensors, schemes, run marker)
    sources: dict[str, str]           # source shard name -> its path on the source filesystem
    source_url: str                   # the source location (filesystem and options come from it)
    out: str                          # the shard's path on the destination filesystem
    dest_url: str
    recipe_json: str
    backend: str
    stats: bool = True
    compare: list[str] = field(default_factory=list)
    storage_options: dict[str, Any] = field(default_factory=dict)

    @property
    def source_bytes(self) -> int:
        return sum(it.head.nbytes for it in self.shard.tensors)


@dataclass
class Part:
    """One group of a split shard's tensors, quantized: its part file on the destination, its rows."""

    path: str
    rows: list[TensorResult]


def tensor_groups(shard: PlannedShard, limit: int) -> list[list[PlannedTensor]]:
    """A planned shard's tensors in plan order, cut into consecutive groups of at most `limit`
    source bytes (a tensor larger than `limit` is a group of its own)."""
    return consecutive_groups(shard.tensors, lambda it: it.head.nbytes, limit)


def split_unit(unit: Unit, limit: int | None) -> list[Unit]:
    """The units of `unit`'s tensor groups when its source bytes exceed `limit`, else `[unit]`.

    A group's unit has the shard's name, run marker and output path, with just the group's
    tensors and the source shards they come from.
    """
    if not limit or unit.source_bytes <= limit:
        return [unit]
    return [replace(unit, shard=unit.shard.with_tensors(group),
                    sources={n: p for n, p in unit.sources.items() if any(it.source == n for it in group)})
            for group in tensor_groups(unit.shard, limit)]


def run_unit(unit: Unit, scratch: str | None = None) -> list[TensorResult]:
    """Write `unit`'s output shard (on whatever process runs this); its rows, one per tensor."""
    return _write(unit, unit.out, scratch, part=False)


def run_group(unit: Unit, k: int, n: int, scratch: str | None = None) -> Part:
    """Quantize group `k` of `n` of a split shard (`unit` from `split_unit`) into a part file next to
    the shard, under a temporary name of this call's own (`.NAME.part-K-of-N.<token>.tmp`)."""
    dst = location(unit.dest_url, unit.storage_options)
    path = dst.temp_path(unit.out, f"part-{k:05d}-of-{n:05d}.{uuid.uuid4().hex}")
    try:
        return Part(path, _write(unit, path, scratch, part=True))
    except BaseException:
        dst.remove([path])
        raise


def assemble_unit(unit: Unit, parts: Sequence[Part], scratch: str | None = None) -> None:
    """Write a split shard from its groups' parts, in order (`qcore.model.shards.assemble_shard`), move it
    onto the shard's name whole, then delete the parts.

    Idempotent: Dask runs a task again when the worker holding its result dies, and by then the
    parts may be gone; a shard this run already completed (its run marker matches) is left as it is.
    """
    dst = location(unit.dest_url, unit.storage_options)
    paths = [p.path for p in parts]
    with _workdir(scratch) as work:
        if _prior(dst, unit.out, unit.shard.marker, os.path.join(work, "stub")) is None:
            out = unit.out if dst.local else os.path.join(work, "out")
            assemble_shard(unit.shard, _fetched(dst, paths, work), out, unit.recipe_json)
            if not dst.local:
                dst.upload(out, unit.out)
    dst.remove(paths)


def _write(unit: Unit, target: str, scratch: str | None, part: bool) -> list[TensorResult]:
    """Quantize `unit` into `target` on the destination; its rows.

    Sources are staged in a scratch directory: whole shards, or for a part just its tensors'
    bytes. A local destination is written in place (a part directly: its name is temporary; a
    shard atomically); a remote one is written in scratch, then put (a part) or uploaded.
    """
    dst = location(unit.dest_url, unit.storage_options)
    with _workdir(scratch) as work:
        local = _staged_sources(unit, os.path.join(work, "in"), whole=not part)
        out = target if dst.local else os.path.join(work, "out")
        rows = quantize_shard(unit.shard, local, out, unit.recipe_json, unit.backend, stats=unit.stats,
                              compare=unit.compare, atomic=not part)
        if not dst.local:
            (dst.put if part else dst.upload)(out, target)
        return rows


def _staged_sources(unit: Unit, directory: str, whole: bool) -> dict[str, str]:
    """Each source shard of `unit` as a local file (remote ones downloaded into `directory`): whole,
    or holding just the header and `unit`'s tensors."""
    src = location(unit.source_url, unit.storage_options)
    local = {}
    for name, path in unit.sources.items():
        staged = os.path.join(directory, name)
        needed = [it.name for it in unit.shard.tensors if it.source == name]
        local[name] = src.stage(path, staged) if whole else src.stage_tensors(path, staged, needed)
    return local


def _fetched(dst: Location, paths: Sequence[str], work: str) -> Iterator[str]:
    """Each part as a local file, in order: in place when local, else downloaded to `work` and
    deleted once the next one is asked for (scratch holds one part at a time)."""
    for k, path in enumerate(paths):
        local = dst.stage(path, os.path.join(work, f"part-{k}"))
        yield local
        if local != path:
            os.unlink(local)


@contextmanager
def _workdir(scratch: str | None) -> Iterator[str]:
    """A fresh directory under `scratch` (default: Dask's temporary-directory), removed afterwards."""
    work = tempfile.mkdtemp(prefix="qcore-unit-", dir=scratch or _scratch_dir())
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _scratch_dir() -> str:
    try:
        import dask

        d = dask.config.get("temporary-directory", None)
    except ImportError:
        d = None
    return d or tempfile.gettempdir()


# ------------------------------------------------------------------------------------ the cluster
def _distributed() -> Any:
    try:
        import distributed
    except ImportError:
        raise InputError("a cluster run needs Dask: pip install 'qcore-quant[distributed]' "
                         "(or run without --cluster/--scheduler)") from None
    return distributed


@contextmanager
def open_client(cluster: Any = None, scheduler: str | None = None, backend: str = "",
                workers: int | None = None) -> Iterator[Any]:
    """A Dask client for `scheduler` (an address), `cluster` ("local", a Cluster or a Client).

    "local" starts a LocalCluster of single-threaded worker processes (`workers` of them, default
    one per core, each with one Numba thread), or for the cuda backend dask-cuda's LocalCUDACluster (one worker per visible
    GPU). What this opens it closes; a Client or Cluster passed in is left running.
    """
    dd = _distributed()
    with ExitStack() as stack:
        if scheduler is not None and cluster is not None:
            raise InputError("give a scheduler address or a cluster, not both")
        if scheduler is not None:
            client = stack.enter_context(dd.Client(scheduler))
        elif isinstance(cluster, dd.Client):
            client = cluster
        elif cluster == "local":
            if backend == "cuda":
                try:
                    from dask_cuda import LocalCUDACluster
                except ImportError:
                    raise InputError("--cluster local with the cuda backend starts one worker per GPU with "
                                     "dask-cuda: pip install 'qcore-quant[distributed-cuda]'") from None
                c = stack.enter_context(LocalCUDACluster(n_workers=workers))
            else:
                c = stack.enter_context(dd.LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                                                        env=dict(ONE_CORE_ENV)))
            client = stack.enter_context(dd.Client(c))
        elif cluster is not None and hasattr(cluster, "scheduler_address"):
            client = stack.enter_context(dd.Client(cluster))
        else:
            raise InputError(f"cluster must be 'local', a Dask Cluster or Client, got {cluster!r}")
        yield client


def _memory_limit(client: Any) -> int:
    """The smallest memory limit among the client's workers, in bytes; 0 when none has one."""
    limits = [w.get("memory_limit") or 0 for w in client.scheduler_info().get("workers", {}).values()]
    return min((m for m in limits if m), default=0)


def _check_memory(client: Any, units: Sequence[Unit]) -> None:
    """Refuse a plan whose largest tensor does not fit a worker's memory limit."""
    limit = _memory_limit(client)
    if not limit or not units:
        return
    big = max((it for u in units for it in u.shard.tensors), key=lambda it: it.head.nbytes)
    need = (IN_FLIGHT + 1) * big.head.nbytes + INTERPRETER_BYTES
    if need > limit:
        raise InputError(f"tensor '{big.name}' ({big.head.nbytes} bytes) needs about {need} bytes on a worker "
                         f"(3 x the tensor + {INTERPRETER_BYTES >> 20} MiB), over the workers' memory limit of "
                         f"{limit}; start workers with a larger --memory-limit")


# ------------------------------------------------------------------------------------ the run
def _source(src: str, opts: Mapping[str, Any], stubs: str) -> tuple[Checkpoint, Location, str]:
    """The checkpoint to plan (local, or header stubs of a remote one), its location and real root."""
    loc = location(src, opts)
    if loc.local:
        ck = resolve(loc.path)
        return ck, loc, ck.root
    path = loc.path.rstrip("/")
    if loc.isdir(path):
        loc.mirror_headers(stubs)
        return resolve(stubs), loc, path
    if not loc.exists(path):
        raise FileNotFoundError(2, "No such file", src)
    root, name = path.rsplit("/", 1) if "/" in path else ("", path)
    if name.endswith(".json"):
        location(loc.fs.unstrip_protocol(root), opts).mirror_headers(stubs)
    else:
        loc.header_stub(path, os.path.join(stubs, name))
    return resolve(os.path.join(stubs, name)), loc, root


def quantize_model_distributed(src: PathLike, dst: PathLike, recipe: RecipeLike = None, backend: str | Any = None,
                               *, rules: Sequence[str] = (), max_shard_size: int | str | None = None,
                               resume: bool = False, stats: bool = True, compare: Sequence[Any] = (),
                               cluster: Any = None, scheduler: str | None = None, workers: int | None = None,
                               group_bytes: int | str | None = None,
                               storage_options: Mapping[str, Any] | None = None,
                               on_plan: Callable[[int, int], None] | None = None,
                               on_tensor: Callable[[TensorResult], None] | None = None,
                               on_shard: Callable[[str, int, int], None] | None = None,
                               log: Callable[[str], None] | None = None) -> ModelResult:
    """`qcore.quantize_model` with one unit per output shard, on a Dask cluster, and fsspec URLs.

    `src` and `dst` are local paths or URLs (`s3://bucket/model`, `gs://...`; `storage_options`
    go to fsspec). `cluster` is "local", a Dask Cluster or Client; `scheduler` an existing
    scheduler's address; with neither the units run here one by one. A shard with more than
    `group_bytes` of source (e.g. "4GB"; on a cluster, by default, the workers' memory limit) is
    written by a task per consecutive group of its tensors and an assembly task. The other
    arguments are `quantize_model`'s; `on_plan(count, bytes)` and `on_tensor(row)` are called on this process
    as shards finish, `on_shard(name, done, total)` after each shard, `log(text)` with the
    dashboard link. The output is byte-identical to `quantize_model`'s.
    """
    t0 = time.perf_counter()
    opts = dict(storage_options or {})
    rc, be, cmp, limit = prepare_run(recipe, rules, backend, compare, max_shard_size)
    group_limit = parse_size(group_bytes) if group_bytes is not None else None
    say = log or (lambda text: None)

    with tempfile.TemporaryDirectory(prefix="qcore-plan-") as stubs, ExitStack() as stack:
        ck, sloc, sroot = _source(os.fspath(src), opts, os.path.join(stubs, "src"))
        dloc = location(dst, opts)
        one_file = ck.single_file and limit is None
        _check_apart(ck, sloc, dloc, one_file)
        readers = {s: stack.enter_context(Reader(ck.path(s))) for s in ck.shards}
        shards, recipe_json = plan_shards(ck, rc, limit, readers)
        stack.close()
        out_dir = dloc.path if not one_file else os.path.dirname(dloc.path.rstrip("/"))
        outs = {s.name: dloc.path if one_file else dloc.join(s.name) for s in shards}
        if out_dir:
            dloc.makedirs(out_dir)

        done_rows: list[TensorResult] = []
        resumed: list[str] = []
        units: list[Unit] = []
        for s in shards:
            prior = _prior(dloc, outs[s.name], s.marker, os.path.join(stubs, "dst", s.name)) if resume else None
            if prior is not None:
                resumed.append(s.name)
                done_rows += resumed_rows(s, prior)
                continue
            units.append(Unit(s, {n: ck.path(n) if sloc.local else posixpath.join(sroot, n) for n in s.sources},
                              sloc.url if not sloc.local else ck.root, outs[s.name], dloc.url, recipe_json,
                              be.name, stats, [str(c) for c in cmp], opts))
        if on_plan is not None:
            on_plan(*planned_work(u.shard for u in units))

        if not one_file:
            for name in ck.extras:
                if name == CONFIG_NAME and os.path.isfile(ck.path(name)):  # with its quantization_config
                    local = dloc.join(name) if dloc.local else os.path.join(stubs, name)
                    write_config(ck.path(name), local, quantization_config(planned_schemes(shards), recipe_json))
                    if not dloc.local:
                        dloc.upload(local, dloc.join(name))
                    continue
                dloc.upload_tree(ck.path(name), dloc.join(name))
        try:
            rows = _run(units, cluster, scheduler, be.name, workers, group_limit, on_tensor, on_shard, say)
        finally:
            dloc.remove(dloc.leftovers(list(outs.values())))

        ordered = in_plan_order(shards, done_rows + rows)
        files = [outs[s.name] for s in shards]
        if not one_file and (ck.index_name or limit is not None):
            name = ck.index_name or INDEX_NAME
            local_index = dloc.join(name) if dloc.local else os.path.join(stubs, name)
            write_index(local_index, rows_index(ck.index_metadata, ordered))
            if not dloc.local:
                dloc.upload(local_index, dloc.join(name))
            files.append(dloc.join(name))
    return ModelResult(os.fspath(src), os.fspath(dst), rc, be.name, ordered,
                       [f if dloc.local else dloc.fs.unstrip_protocol(f) for f in files], resumed,
                       time.perf_counter() - t0)


def _check_apart(ck: Checkpoint, sloc: Location, dloc: Location, one_file: bool) -> None:
    if not (sloc.local and dloc.local):
        return
    check_apart(ck, dloc.path, folder=not one_file)


def _prior(dloc: Location, out: str, marker: str, stub: str) -> Any:
    """The completed output shard at `out` (read through a header stub when remote), or None."""
    if dloc.local:
        return completed_shard(out, marker)
    return completed_shard(stub, marker) if dloc.header_stub(out, stub) else None


@dataclass
class _Progress:
    """The rows as tasks report them, passed on to `on_tensor`, and the shards finished (`on_shard`)."""

    shards: int
    on_tensor: Callable[[TensorResult], None] | None
    on_shard: Callable[[str, int, int], None] | None
    rows: list[TensorResult] = field(default_factory=list)
    finished: int = 0

    def report(self, unit: Unit, result: Part | list[TensorResult] | None) -> None:
        """What a task returned: a group's part (its rows), a unit's rows (then its shard is in), or
        nothing from an assembly (its shard is in)."""
        got = result.rows if isinstance(result, Part) else result or []
        self.rows.extend(got)
        if self.on_tensor is not None:
            for r in got:
                self.on_tensor(r)
        if not isinstance(result, Part):
            self.finished += 1
            if self.on_shard is not None:
                self.on_shard(unit.shard.name, self.finished, self.shards)


def _run_here(unit: Unit, limit: int | None, progress: _Progress) -> None:
    """Write one unit's shard in this process: whole, or group by group and then assembled."""
    groups = split_unit(unit, limit)
    if len(groups) < 2:
        progress.report(unit, run_unit(unit))
        return
    parts: list[Part] = []
    for k, group in enumerate(groups, 1):
        parts.append(run_group(group, k, len(groups)))
        progress.report(unit, parts[-1])
    progress.report(unit, assemble_unit(unit, parts))


def _submit(client: Any, units: Sequence[Unit], limit: int | None) -> dict[Any, Unit]:
    """One task per unit, or for a split one a task per group and an assembly that waits on them;
    every future with the unit it is for."""
    token = uuid.uuid4().hex[:8]
    futures: dict[Any, Unit] = {}
    for u in units:
        key = f"{KEY_PREFIX}-{token}-{u.shard.name}"
        groups = split_unit(u, limit)
        if len(groups) < 2:
            futures[client.submit(run_unit, u, key=key, pure=False)] = u
            continue
        parts = [client.submit(run_group, g, k, len(groups), key=f"{key}-part-{k}", pure=False)
                 for k, g in enumerate(groups, 1)]
        futures.update(dict.fromkeys(parts, u))
        futures[client.submit(assemble_unit, u, parts, key=key, pure=False)] = u
    return futures


def _run(units: list[Unit], cluster: Any, scheduler: str | None, backend: str, workers: int | None,
         group_bytes: int | None, on_tensor: Callable[[TensorResult], None] | None,
         on_shard: Callable[[str, int, int], None] | None, say: Callable[[str], None]) -> list[TensorResult]:
    """Write every unit's shard, here or on the cluster; the rows. A shard over `group_bytes` of
    source (on a cluster, by default, over the workers' memory limit) is written in groups."""
    progress = _Progress(len(units), on_tensor, on_shard)
    if cluster is None and scheduler is None:
        for u in units:
            _run_here(u, group_bytes, progress)
        return progress.rows
    if not units:
        return progress.rows
    dd = _distributed()
    with open_client(cluster, scheduler, backend, workers) as client:
        say(f"Dask dashboard: {client.dashboard_link}")
        _check_memory(client, units)
        futures = _submit(client, units, group_bytes or _memory_limit(client))
        try:
            for fut in dd.as_completed(list(futures)):
                progress.report(futures[fut], fut.result())
                fut.release()  # done: a worker lost later must not make Dask run it again
        finally:
            client.cancel(list(futures))
    return progress.rows
