"""Quantize a checkpoint across processes, GPUs and hosts on Dask, with storage behind fsspec URLs.

Every scale qcore computes is per tensor, so the work splits without any collective: one planned
output shard is one unit (for an unchanged layout, one input shard in, one output shard out).
The client plans every shard from the source headers alone (`qcore.model.plan_shards`, through
header stubs for remote sources, see `qcore.storage`), sends each unit to a Dask worker, and
writes the index and copies the other files once all shards are in. A worker stages the unit's
source shards (remote ones are downloaded to its scratch directory), runs
`qcore.model.quantize_shard` (the single-process code: tensors stream through, so a unit's memory
is about three times its largest tensor whatever the shard's size) and puts the result at the
destination under a temporary name, then moves it onto the shard's name. The output bytes are
those of `qcore.quantize_model`.

Faults: when a worker dies mid-unit, Dask's scheduler runs the unit again on another worker
(up to `distributed.scheduler.allowed-failures` times); the dead worker's temporary file never
carries a shard's name and is removed at the end. `resume=True` keeps output shards an earlier
run with the same plan completed (their run marker matches), so a failed run is finished by
running it again.

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
from dataclasses import dataclass, field
from typing import Any

from .checkpoint import INDEX_NAME, Checkpoint, resolve
from .errors import InputError
from .model import (IN_FLIGHT, ModelResult, PathLike, TensorResult, _write_index,
                    completed_shard, plan_shards, prepare_run, quantize_shard, resumed_rows)
from .recipe import RecipeLike
from .stfile import Reader
from .storage import Location, location

__all__ = ["Unit", "run_unit", "quantize_model_distributed", "open_client"]

INTERPRETER_BYTES = 300 << 20   # a worker's own footprint beside a unit's tensors
KEY_PREFIX = "qcore-shard"
# A LocalCluster has one single-threaded worker process per core; Numba's parallel kernels (the
# ndarray backend) would otherwise start a thread per core in every one of them.
ONE_CORE_ENV = {"NUMBA_NUM_THREADS": "1"}


@dataclass
class Unit:
    """One output shard to write: what a worker needs, picklable."""

    shard: Any                        # qcore.model planned shard (its tensors, schemes, run marker)
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
        return sum(it.head.nbytes for it in self.shard.items)


def run_unit(unit: Unit, scratch: str | None = None) -> list[TensorResult]:
    """Write `unit`'s output shard (on whatever process runs this); its rows, one per tensor."""
    src = location(unit.source_url, unit.storage_options)
    dst = location(unit.dest_url, unit.storage_options)
    work = tempfile.mkdtemp(prefix="qcore-unit-", dir=scratch or _scratch_dir())
    try:
        local = {name: src.stage(path, os.path.join(work, "in", name)) for name, path in unit.sources.items()}
        out = unit.out if dst.local else os.path.join(work, "out", os.path.basename(unit.out))
        if not dst.local:
            os.makedirs(os.path.dirname(out), exist_ok=True)
        rows = quantize_shard(unit.shard, local, out, unit.recipe_json, unit.backend, stats=unit.stats,
                              compare=unit.compare)
        if not dst.local:
            dst.upload(out, unit.out)
        return rows
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


def _check_memory(client: Any, units: Sequence[Unit]) -> None:
    """Refuse a plan whose largest tensor does not fit a worker's memory limit."""
    limits = [w.get("memory_limit") or 0 for w in client.scheduler_info().get("workers", {}).values()]
    limit = min((m for m in limits if m), default=0)
    if not limit or not units:
        return
    big = max((it for u in units for it in u.shard.items), key=lambda it: it.head.nbytes)
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
                               storage_options: Mapping[str, Any] | None = None,
                               on_plan: Callable[[int, int], None] | None = None,
                               on_tensor: Callable[[TensorResult], None] | None = None,
                               on_shard: Callable[[str, int, int], None] | None = None,
                               log: Callable[[str], None] | None = None) -> ModelResult:
    """`qcore.quantize_model` with one unit per output shard, on a Dask cluster, and fsspec URLs.

    `src` and `dst` are local paths or URLs (`s3://bucket/model`, `gs://...`; `storage_options`
    go to fsspec). `cluster` is "local", a Dask Cluster or Client; `scheduler` an existing
    scheduler's address; with neither the units run here one by one. The other arguments are
    `quantize_model`'s; `on_plan(count, bytes)` and `on_tensor(row)` are called on this process
    as shards finish, `on_shard(name, done, total)` after each shard, `log(text)` with the
    dashboard link. The output is byte-identical to `quantize_model`'s.
    """
    t0 = time.perf_counter()
    opts = dict(storage_options or {})
    rc, be, cmp, limit = prepare_run(recipe, rules, backend, compare, max_shard_size)
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
            needed = sorted({it.source for it in s.items})
            units.append(Unit(s, {n: ck.path(n) if sloc.local else posixpath.join(sroot, n) for n in needed},
                              sloc.url if not sloc.local else ck.root, outs[s.name], dloc.url, recipe_json,
                              be.name, stats, [str(c) for c in cmp], opts))
        if on_plan is not None:
            work = [i for u in units for i in u.shard.items if i.scheme is not None]
            on_plan(len(work), sum(i.head.nbytes for i in work))

        if not one_file:
            for name in ck.extras:
                dloc.upload_tree(ck.path(name), dloc.join(name))
        rows = _run(units, cluster, scheduler, be.name, workers, on_tensor, on_shard, say)
        dloc.remove(dloc.leftovers(list(outs.values())))

        by_name = {r.name: r for r in done_rows + rows}
        ordered = [by_name[i.name] for s in shards for i in s.items]
        files = [outs[s.name] for s in shards]
        if not one_file and (ck.index_name or limit is not None):
            name = ck.index_name or INDEX_NAME
            local_index = dloc.join(name) if dloc.local else os.path.join(stubs, name)
            _write_index(local_index, ck, {r.name: r.file for r in ordered}, sum(r.after for r in ordered))
            if not dloc.local:
                dloc.upload(local_index, dloc.join(name))
            files.append(dloc.join(name))
    return ModelResult(os.fspath(src), os.fspath(dst), rc, be.name, ordered,
                       [f if dloc.local else dloc.fs.unstrip_protocol(f) for f in files], resumed,
                       time.perf_counter() - t0)


def _check_apart(ck: Checkpoint, sloc: Location, dloc: Location, one_file: bool) -> None:
    if not (sloc.local and dloc.local):
        return
    d = os.path.abspath(dloc.path)
    if d in {os.path.abspath(ck.path(s)) for s in ck.shards} or (not one_file and d == os.path.abspath(ck.root)):
        raise InputError("OUT must differ from IN; write elsewhere and move it if you want to replace IN")


def _prior(dloc: Location, out: str, marker: str, stub: str) -> Any:
    """The completed output shard at `out` (read through a header stub when remote), or None."""
    if dloc.local:
        return completed_shard(out, marker)
    return completed_shard(stub, marker) if dloc.header_stub(out, stub) else None


def _run(units: list[Unit], cluster: Any, scheduler: str | None, backend: str, workers: int | None,
         on_tensor: Callable[[TensorResult], None] | None, on_shard: Callable[[str, int, int], None] | None,
         say: Callable[[str], None]) -> list[TensorResult]:
    rows: list[TensorResult] = []

    def finished(unit: Unit, got: list[TensorResult], k: int) -> None:
        rows.extend(got)
        if on_tensor is not None:
            for r in got:
                on_tensor(r)
        if on_shard is not None:
            on_shard(unit.shard.name, k, len(units))

    if cluster is None and scheduler is None:
        for k, u in enumerate(units, 1):
            finished(u, run_unit(u), k)
        return rows
    if not units:
        return rows
    dd = _distributed()
    with open_client(cluster, scheduler, backend, workers) as client:
        say(f"Dask dashboard: {client.dashboard_link}")
        _check_memory(client, units)
        token = uuid.uuid4().hex[:8]
        futures = {client.submit(run_unit, u, key=f"{KEY_PREFIX}-{token}-{u.shard.name}", pure=False): u
                   for u in units}
        try:
            for k, fut in enumerate(dd.as_completed(list(futures)), 1):
                finished(futures[fut], fut.result(), k)
        finally:
            client.cancel(list(futures))
    return rows
