"""What the fuzz targets share (tests/test_fuzz.py, tests/test_fuzz_readers.py): the example
counts, the per-target record of cases, time and peak allocation, the property that only one-line
`QCoreError`s escape, and the mutators of JSON documents and safetensors files.

`QCORE_FUZZ_EXAMPLES=N` runs N examples per target instead of the CI default;
`QCORE_FUZZ_REPORT=path.jsonl` appends, per target, the cases run, the slowest case (wall clock
and CPU time: the CPU time is what the case itself cost on a shared machine), the largest peak
allocation and the errors seen by type. Time is recorded, not asserted (CI is shared).
"""
from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import struct
import time
import tracemalloc
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from qcore import QCoreError

MB = 1 << 20
PEAK_LIMIT = 8 * MB
DEEP = "[" * 5000 + "]" * 5000  # JSON nested deeper than Python's parser goes


def examples(ci_default: int) -> int:
    return int(os.environ.get("QCORE_FUZZ_EXAMPLES", ci_default))


def fuzz_settings(ci_default: int):
    return settings(max_examples=examples(ci_default), deadline=None, database=None, derandomize=False,
                    suppress_health_check=list(HealthCheck))


class Stats:
    """Cases run, slowest case, largest peak allocation and errors by type of one target."""

    def __init__(self, target: str, peak_limit: int = PEAK_LIMIT):
        self.target, self.cases, self.slowest, self.slowest_cpu, self.peak = target, 0, 0.0, 0.0, 0
        self.peak_limit = peak_limit
        self.errors: collections.Counter[str] = collections.Counter()

    @contextlib.contextmanager
    def case(self):
        tracemalloc.start()
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            dt, dc = time.perf_counter() - t0, time.process_time() - c0  # wall, and CPU (not others' load)
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            self.cases += 1
            self.slowest = max(self.slowest, dt)
            self.slowest_cpu = max(self.slowest_cpu, dc)
            self.peak = max(self.peak, peak)
            if self.cases % 1000 == 0:  # a long run that is stopped still tells how far it got
                self.report(final=False)
        assert peak <= self.peak_limit, f"{self.target}: a case allocated {peak / MB:.1f} MiB"

    def report(self, final: bool = True) -> None:
        path = os.environ.get("QCORE_FUZZ_REPORT")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps({"target": self.target, "cases": self.cases, "slowest_s": round(self.slowest, 4),
                                    "slowest_cpu_s": round(self.slowest_cpu, 4), "peak_bytes": self.peak,
                                    "errors": dict(self.errors), "final": final}) + "\n")


def only_qcore_errors(fn, *args, tally: Stats | None = None, **kwargs):
    """fn(...) or None when it raised a QCoreError with a one-line message; anything else fails
    the case. `tally` counts the errors by type."""
    try:
        return fn(*args, **kwargs)
    except QCoreError as e:
        text = str(e)
        assert "\n" not in text and text.strip(), f"{type(e).__name__} message is not one line: {text[:300]!r}"
        if tally is not None:
            tally.errors[type(e).__name__] += 1
        return None


# ------------------------------------------------------------------------------ JSON documents
HOSTILE_VALUES = [None, True, False, 0, -1, 1, 3, 2**31, 2**32, 2**33, 2**63 - 1, 2**63, 2**64, 2**70, -2**63,
                  10**400, 0.5, -0.0, 1e308, 1e-320, math.nan, math.inf, -math.inf, "", "x", "0", "-1", "nan",
                  "1e400", "\ud800", [], {}, [1], [-1, -1], [0], [[1]], [2**70], {"a": 1}, [None], ["a", "b"]]
HOSTILE = st.one_of(st.sampled_from(HOSTILE_VALUES), st.integers(), st.floats(), st.text(max_size=8),
                    st.lists(st.integers(-2, 2**40), max_size=4))


def _paths(doc: Any, here: tuple = ()) -> list[tuple]:
    """Every node of a JSON document as its path of keys and indices (the root is ())."""
    out = [here]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, here + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:16]):
            out += _paths(v, here + (i,))
    return out


def _at(doc: Any, path: tuple) -> Any:
    for p in path:
        doc = doc[p]
    return doc


def mutate_json(data, doc: Any) -> Any:
    """`doc` with one node replaced by a hostile value, removed, doubled or wrapped in a list, or
    a key added (a copy; the caller's document is left as it was)."""
    doc = json.loads(json.dumps(doc))
    path = data.draw(st.sampled_from(_paths(doc)))
    how = data.draw(st.sampled_from(["replace", "replace", "replace", "drop", "wrap", "double", "add"]))
    node = _at(doc, path)
    if how == "add" and isinstance(node, dict):
        node[data.draw(st.sampled_from(["x", "", "shape", "dtype", "blocksize", "_data", "weights", "0"]))] = \
            data.draw(HOSTILE)
        return doc
    if not path:
        return data.draw(HOSTILE) if how != "wrap" else [doc]
    parent, key = _at(doc, path[:-1]), path[-1]
    if how == "drop":
        del parent[key]
    elif how == "wrap":
        parent[key] = [node]
    elif how == "double" and isinstance(node, (int, float)) and not isinstance(node, bool):
        parent[key] = node * data.draw(st.sampled_from([2, -1, 2**20, 2**40, 0.5]))
    else:
        parent[key] = data.draw(HOSTILE)
    return doc


def mutate_json_text(data, text: str) -> str:
    """A JSON text mutated as a document, or replaced by hostile text (not JSON, nested too deep,
    a lone surrogate)."""
    if data.draw(st.integers(0, 9)) == 0:
        return data.draw(st.sampled_from([DEEP, "{", "[1", "", "null", "\ud800", "NaN", '{"a": 1, "a": 2}']))
    try:
        doc = json.loads(text)
    except ValueError:
        return data.draw(st.text(max_size=20))
    return json.dumps(mutate_json(data, doc))


# ------------------------------------------------------------------------------ safetensors bytes
def split_safetensors(raw: bytes) -> tuple[dict, bytes]:
    """(header as a dict, the data bytes) of a valid safetensors file."""
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def join_safetensors(head: dict, body: bytes) -> bytes:
    text = json.dumps(head).encode()
    return struct.pack("<Q", len(text)) + text + body


ST_DTYPES = ["U8", "I8", "F32", "F16", "BF16", "F64", "I32", "I64", "U64", "F8_E4M3", "F8_E5M2", "BOOL", "X9", "C64"]


def mutate_st_header(data, raw: bytes) -> bytes:
    """One header field of one tensor, or the metadata, set to a hostile value of any JSON type."""
    head, body = split_safetensors(raw)
    names = [k for k in head if k != "__metadata__"]
    what = data.draw(st.sampled_from(["dtype", "shape", "offsets", "entry", "metadata", "metadata-value",
                                      "rename", "drop", "swap-offsets"]))
    name = data.draw(st.sampled_from(names)) if names else None
    if what == "dtype" and name:
        head[name]["dtype"] = data.draw(st.one_of(st.sampled_from(ST_DTYPES), HOSTILE))
    elif what == "shape" and name:
        head[name]["shape"] = data.draw(st.one_of(st.lists(st.integers(-1, 2**70), max_size=4), HOSTILE,
                                                  st.lists(HOSTILE, max_size=3)))
    elif what == "offsets" and name:
        head[name]["data_offsets"] = data.draw(st.one_of(
            st.lists(st.integers(-1, 2**65), min_size=2, max_size=2), st.lists(HOSTILE, min_size=2, max_size=2),
            HOSTILE, st.lists(st.integers(0, 100), max_size=3)))
    elif what == "entry" and name:
        head[name] = data.draw(HOSTILE) if data.draw(st.booleans()) else mutate_json(data, head[name])
    elif what == "metadata":
        head["__metadata__"] = data.draw(HOSTILE)
    elif what == "metadata-value":
        meta = head.setdefault("__metadata__", {})
        if isinstance(meta, dict) and meta and data.draw(st.booleans()):
            meta[data.draw(st.sampled_from(sorted(meta)))] = data.draw(HOSTILE)
        elif isinstance(meta, dict):
            meta[data.draw(st.text(max_size=6))] = data.draw(HOSTILE)
    elif what == "rename" and name:
        head[data.draw(st.sampled_from(["", name + ".absmax", "__metadata__x", name.upper(), "a" * 300]))] = \
            head.pop(name)
    elif what == "drop" and name:
        del head[name]
    elif what == "swap-offsets" and len(names) > 1:
        a, b = data.draw(st.permutations(names))[:2]
        head[a]["data_offsets"], head[b]["data_offsets"] = head[b]["data_offsets"], head[a]["data_offsets"]
    return join_safetensors(head, body)


def mutate_bytes(data, raw: bytes) -> bytes:
    """Bit flips, truncation, inserted bytes, or a new 8-byte header length."""
    how = data.draw(st.sampled_from(["flip", "truncate", "insert", "length"]))
    b = bytearray(raw)
    if how == "flip":
        for _ in range(data.draw(st.integers(1, 8))):
            i = data.draw(st.integers(0, len(b) - 1))
            b[i] ^= 1 << data.draw(st.integers(0, 7))
    elif how == "truncate":
        b = b[: data.draw(st.integers(0, len(b) - 1))]
    elif how == "insert":
        i = data.draw(st.integers(0, len(b)))
        b[i:i] = data.draw(st.binary(min_size=1, max_size=16))
    else:
        b[:8] = struct.pack("<Q", data.draw(st.sampled_from([0, 1, 2**32, 2**63, 2**64 - 1, len(b)])))
    return bytes(b)
