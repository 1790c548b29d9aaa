"""The streaming pipeline that writes planned output shards: a reader thread reads one source
tensor at a time, the calling thread quantizes it and measures its error, a writer thread appends
it to the current output shard (`qcore.files.stfile.StreamWriter`).

At most `IN_FLIGHT` source tensors are in flight (a semaphore), so peak memory is about three
times the largest tensor (two sources and one dequantized copy for the statistics) plus the
interpreter, whatever the model's size. An error in any stage, or an interruption, stops the
others; the writer's temporary file is removed before the error is raised.
"""
from __future__ import annotations

import math
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from qcore import _signals
from qcore.errors import InputError
from qcore.backend.protocol import Backend, QTensor
from qcore.files import io as qio
from qcore.files.paths import atomic_write
from qcore.files.stfile import Reader, StreamWriter
from qcore.model.plan import PlannedShard, PlannedTensor, shard_header_room, shard_metadata
from qcore.model.reasons import Reason
from qcore.model.results import TensorResult

__all__ = ["IN_FLIGHT", "stream_shards", "write_in_place"]

IN_FLIGHT = 2   # source tensors read ahead of the writer (the memory bound's factor)
_POLL = 0.1


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


def write_in_place(path: str, write: Callable[[str], None]) -> None:
    """Write `path` directly (a temporary name its caller owns), where `atomic_write` renames."""
    write(path)


def _quantize_row(be: Backend, x: np.ndarray, it: PlannedTensor, row: TensorResult, stats: bool,
                  compare: Sequence[Any]) -> list[np.ndarray] | None:
    """Quantize source tensor `x` by its planned scheme and fill in `row` (scheme, stored size,
    SQNR and max error, the compared schemes' SQNR): the payload's parts, or None when the scheme
    cannot take the data (NaN/Inf: the tensor is kept, `row.note` says why).

    A function of its own, so that no `try` statement sits inside `stream_shards`' try/finally: on
    CPython 3.11 an exception raised at such a statement's line (by a trace function, as the
    interrupt tests send signals) skips the enclosing `finally`, which joins the writer thread."""
    try:
        q: QTensor = be.quantize(x, it.scheme)
    except InputError as e:  # NaN/Inf and other data the scheme cannot take
        row.note, row.reason_code = f"kept: {e}", Reason.DATA_REFUSED
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


def stream_shards(todo: Sequence[PlannedShard], paths: dict[str, str], readers: dict[str, Reader], be: Backend,
                  recipe_json: str, stats: bool, compare: Sequence[Any],
                  on_tensor: Callable[[TensorResult], None] | None,
                  write_file: Callable[[str, Callable[[str], None]], None] = atomic_write) -> list[TensorResult]:
    """Write each planned shard of `todo` to `paths[shard.name]` (by `write_file`: atomically, or
    `write_in_place`) from the source `readers`; a row per tensor, in order, each also passed to
    `on_tensor` as it is done."""
    p = _Pipeline()
    rows: list[TensorResult] = []

    def read_all() -> None:
        for shard in todo:
            for it in shard.tensors:
                p.acquire()
                p.put(p.inbox, (it, readers[it.source].read(it.name)))
        p.put(p.inbox, _END)

    def write_all() -> None:
        for shard in todo:
            meta = shard_metadata(shard, recipe_json)
            room = shard_header_room(shard, recipe_json)

            def write(tmp: str, shard: PlannedShard = shard, meta: dict = meta, room: int = room) -> None:
                with open(tmp, "wb") as f:
                    w = StreamWriter(f, room)
                    for _ in shard.tensors:
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
                               note=it.note, file=it.shard, reason_code=it.reason_code)
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
