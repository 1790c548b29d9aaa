"""`ParamLayout`: one kernel parameter array, declared once as a table of named fields.

The kernels read their geometry and constants from small int64 / float32 arrays (`P`, `F`, `RP`,
`TP`, `MQ`, `OR` in layouts.py; fast.py's `G` and `C`; gemv.py's `Q`; linear.py's `LP`) at fixed
indices. A `ParamLayout` is the one place an array's fields are listed, in order, each with what
it holds. From it come:

* the index constants the kernels read (`define`: `M_CR = 0`, ... and the length `P_LEN`),
  written as plain module-level ints, which numba folds in as compile-time constants;
* the host-side packing (`pack`: a new array from named values; `replace`: a copy with some
  fields changed), which refuses a name the table does not have;
* the array's part of a kernel signature (`arg`: `int64[::1]`, or `UniTuple(int64, n)` for an
  array the kernel takes by value).

A field of `count` > 1 holds that many entries (P's per-axis extents, `MAXR` each); `pack` takes
a sequence for it, padded with zeros. Entries past the last field up to `length` are padding
(zero), kept so that the arrays keep their sizes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

__all__ = ["Field", "ParamLayout"]


@dataclass(frozen=True)
class Field:
    """One field of a parameter array: the name of its index constant, what it holds, and how
    many entries it spans."""

    name: str
    doc: str
    count: int = 1


class ParamLayout:
    """One kernel parameter array (module text): `name` (as the kernels call it), element type
    `dtype` ("int64" or "float32"), `fields` (`Field`s or (name, doc) / (name, count, doc)
    tuples, in index order), `length` (at least the fields' span; more is zero padding),
    `length_name` (the constant of the length), `by_value` (the kernel takes it as a tuple)."""

    def __init__(self, name: str, dtype: str, fields: Sequence[Field | tuple], *, length_name: str,
                 length: int | None = None, by_value: bool = False) -> None:
        self.name = name
        self.dtype = np.dtype(dtype)
        self.fields = tuple(f if isinstance(f, Field) else Field(f[0], f[-1], *f[1:-1]) for f in fields)
        self.index: dict[str, int] = {}
        at = 0
        for f in self.fields:
            if f.name in self.index or f.name == length_name:
                raise ValueError(f"parameter layout {name} names {f.name} twice")
            self.index[f.name] = at
            at += f.count
        if length is not None and length < at:
            raise ValueError(f"parameter layout {name} has {at} entries, more than its length {length}")
        self.length = at if length is None else length
        self.length_name = length_name
        self.by_value = by_value
        self._count = {f.name: f.count for f in self.fields}

    def define(self, namespace: dict) -> None:
        """Bind each field's index, and the length under `length_name`, as ints in `namespace`
        (a module's globals: the kernels' compile-time constants); a name bound there to another
        value is refused."""
        for name, value in [*self.index.items(), (self.length_name, self.length)]:
            if namespace.get(name, value) != value:
                raise ValueError(f"{name} is already {namespace[name]} here; layout {self.name} wants {value}")
            namespace[name] = value

    def pack(self, **values: Any) -> np.ndarray:
        """A new host array of `length` with the named fields set, the others zero."""
        return self.replace(np.zeros(self.length, dtype=self.dtype), copy=False, **values)

    def replace(self, array: np.ndarray, copy: bool = True, **values: Any) -> np.ndarray:
        """`array` (a copy, unless `copy=False`) with the named fields set: a value for a
        one-entry field, a sequence of at most `count` values for the others (the rest of the
        field keeps what it held)."""
        out = array.copy() if copy else array
        for name, v in values.items():
            i = self.index.get(name)
            if i is None:
                raise TypeError(f"parameter layout {self.name} has no field {name}")
            n = self._count[name]
            if n == 1:
                out[i] = v
            else:
                v = list(v)
                if len(v) > n:
                    raise ValueError(f"{self.name}.{name} holds {n} entries, got {len(v)}")
                out[i:i + len(v)] = v
        return out

    @property
    def arg(self) -> str:
        """The array's type in a kernel signature: a C-contiguous device array, or a by-value tuple."""
        base = {np.dtype(np.int64): "int64", np.dtype(np.float32): "float32"}[self.dtype]
        return f"UniTuple({base}, {self.length})" if self.by_value else f"{base}[::1]"

    def describe(self) -> str:
        """The table as text: index, name, entries and meaning of each field."""
        rows = [f"{self.name} ({self.dtype.name}[{self.length}], {self.length_name}):"]
        rows += [f"  {self.index[f.name]:3d} {f.name:10s}{f' x{f.count}' if f.count > 1 else ''}  {f.doc}"
                 for f in self.fields]
        return "\n".join(rows)

    def __repr__(self) -> str:
        return f"ParamLayout({self.name!r}, {self.dtype.name}, {len(self.fields)} fields, length {self.length})"
