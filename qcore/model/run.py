"""Whole-model runs in qcore's format: quantize a checkpoint (file, sharded directory, index, cached
hub id) by a recipe, or dequantize one, writing one file or a folder of shards.

A quantize run checks its recipe and backend (`qcore.model.plan.prepare_run`), plans every output
shard from the source headers (`qcore.model.plan.plan_shards`), sets up the output
(`qcore.model.output`), then streams the tensors through `qcore.model.pipeline`. Each output
shard is written atomically (`qcore.files.io.atomic_write`) and carries a run marker (`qcore.run`:
a hash of the recipe, the shard's tensor list and the source headers); with `resume=True` an
existing shard with the same marker is kept and its tensors are not read again. The index file
(`model.safetensors.index.json`) is written last, with the new sizes.

A dequantize run has the source's structure and sets up its output the same way; one tensor is
in memory at a time.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from qcore.errors import InputError
from qcore.spec.payload import QuantizedData
from qcore.backend.protocol import Backend
from qcore.files import io as qio
from qcore.files.paths import atomic_write
from qcore.files.checkpoint import INDEX_NAME, check_apart, resolve, write_index
from qcore.files.paths import PathLike
from qcore.files.stfile import Reader, StreamWriter, header_room, np_dtype, st_dtype
from qcore.model.output import rows_index, run_output
from qcore.model.pipeline import stream_shards
from qcore.model.plan import PlannedShard, in_plan_order, plan_shards, planned_schemes, planned_work, prepare_run, \
    resolve_backend
from qcore.model.recipe import RecipeLike
from qcore.model.results import ModelResult, RunProgress, TensorResult
from qcore.model.shards import completed_shard, resumed_rows

__all__ = ["quantize_checkpoint", "dequantize_checkpoint"]


def quantize_checkpoint(src: PathLike, dst: PathLike, recipe: RecipeLike = None, backend: str | Backend | None = None,
                        *, rules: Sequence[str] = (), max_shard_size: int | str | None = None, resume: bool = False,
                        stats: bool = True, compare: Sequence[Any] = (),
                        on_plan: Callable[[int, int], None] | None = None,
                        on_tensor: Callable[[TensorResult], None] | None = None,
                        progress: RunProgress | None = None) -> ModelResult:
    """`quantize_model` of a checkpoint path in qcore's format (see `qcore.model.api.quantize_model`)."""
    t0 = time.perf_counter()
    rc, be, cmp, limit = prepare_run(recipe, rules, backend, compare, max_shard_size)
    ck = resolve(src)
    dst_s = os.fspath(dst)
    one_file = ck.single_file and limit is None
    check_apart(ck, dst_s, folder=not one_file)
    readers = {s: Reader(ck.path(s)) for s in ck.shards}
    try:
        shards, recipe_json = plan_shards(ck, rc, limit, readers)
        out = run_output(ck, dst_s, [s.name for s in shards], one_file=one_file,
                         index_name=(ck.index_name or INDEX_NAME) if ck.index_name or limit is not None else None)
        done_rows: list[TensorResult] = []
        resumed: list[str] = []
        todo: list[PlannedShard] = []
        for s in shards:
            prior = completed_shard(out.paths[s.name], s.marker) if resume else None
            if prior is None:
                todo.append(s)
                continue
            resumed.append(s.name)
            done_rows += resumed_rows(s, prior)
        out.plan_progress(progress, kept=resumed, resumable=True)
        if on_plan is not None:
            on_plan(*planned_work(todo))
        out.prepare(ck, planned_schemes(shards), recipe_json)
        rows = stream_shards(todo, out.paths, readers, be, recipe_json, stats, cmp, on_tensor)
    finally:
        for r in readers.values():
            r.close()
    ordered = in_plan_order(shards, done_rows + rows)
    files = [out.paths[s.name] for s in shards]
    if out.index is not None:
        write_index(out.index, rows_index(ck.index_metadata, ordered))
        files.append(out.index)
    return ModelResult(os.fspath(src), dst_s, rc, be.name, ordered, files, resumed, time.perf_counter() - t0)


def dequantize_checkpoint(src: PathLike, dst: PathLike, dtype: Any = None, backend: str | Backend | None = None, *,
                          progress: RunProgress | None = None) -> tuple[int, int]:
    """`dequantize_model` (see `qcore.model.api.dequantize_model`): (tensors dequantized, tensors written)."""
    ck = resolve(src)
    dst_s = os.fspath(dst)
    infos = {shard: qio.read_info(ck.path(shard)) for shard in ck.shards}
    ck.check_tensors({shard: [e.name for e in info.entries] for shard, info in infos.items()})
    out = run_output(ck, dst_s, ck.shards, one_file=ck.single_file, index_name=ck.index_name)
    check_apart(ck, dst_s, folder=not ck.single_file)
    out.plan_progress(progress)
    out.prepare(ck, None)  # config.json without qcore's quantization_config
    be = None
    n = total = 0
    data_bytes = 0
    for shard in ck.shards:
        info = infos[shard]
        with Reader(ck.path(shard)) as r:
            plan = []
            for e in info.entries:
                want = np.dtype(dtype) if dtype is not None else np_dtype(e.source_dtype or "F32")
                plan.append((e, want))
            meta = qio.qcore_header(info.metadata)
            room = header_room([(e.name, st_dtype(w) if e.quantized else e.dtype, e.shape) for e, w in plan], meta)

            def write(tmp: str, r: Reader = r, plan: list = plan, meta: dict = meta, room: int = room) -> None:
                nonlocal be, n, data_bytes
                with open(tmp, "wb") as f:
                    w = StreamWriter(f, room)
                    for e, want in plan:
                        a = r.read(e.name)
                        if e.quantized:
                            be = be or resolve_backend(backend)
                            q = be.from_data(QuantizedData(e.shape, e.scheme, a.tobytes()))
                            a = be.to_numpy(q.dequantize(want))
                            n += 1
                        w.add(e.name, a)
                        data_bytes += a.nbytes
                    w.finish(meta)

            atomic_write(out.paths[shard], write)
        total += len(plan)
    if out.index is not None and ck.index is not None:  # the source's index, as it is, with the new size
        write_index(out.index, ck.index.with_total_size(data_bytes))
    return n, total
