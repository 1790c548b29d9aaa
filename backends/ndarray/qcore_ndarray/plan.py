"""The canonical 8-axis view the kernels work on (the block grid and the value layout of
docs/spec.md).

`make_plan(shape, scheme)` folds a tensor of any rank into eight axes, so one compiled kernel
serves every rank, block shape and store:

* adjacent axes merge when neither is the packing axis and either the second lies inside one
  block (`block >= extent`) or both have block 1; merging keeps the row-major order of
  elements, of stored bytes and of scale slots, so slot and byte offsets are unchanged;
* the block grid and edge blocks come from `qcore.spec.layout` (`full_block`, `grid_shape`);
* the value bytes follow `qcore.spec.layout.words_shape`: Native is row-major bytes; PackedU32(d)
  is row-major u32 words over the shape with the packing axis `rank - 1 - d` replaced by
  `ceil(extent / 4)`, element i of that axis in byte `i % 4` of word `i // 4`.

Leading block-1 axes split by the packing axis give at most three groups, and a block spans
at most five trailing axes, so eight axes always suffice.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from qcore.spec import layout
from qcore.spec.schemes import QuantScheme

__all__ = ["Plan", "make_plan", "NAXES", "TASK_ELEMENTS"]

NAXES = 8
TASK_ELEMENTS = 1 << 14
"""About how many elements one parallel task handles (a few L1/L2-sized blocks)."""


def _row_major(dims: list[int]) -> list[int]:
    st, acc = [0] * len(dims), 1
    for k in range(len(dims) - 1, -1, -1):
        st[k] = acc
        acc *= dims[k]
    return st


@dataclass(frozen=True)
class Plan:
    """Kernel arguments for one shape and scheme; arrays are int64[8]."""

    shape: tuple[int, ...]
    grid: tuple[int, ...]  # the scheme's block grid (scales' shape); () per-tensor
    values_nbytes: int
    padded: bool  # stored words have padding bytes (must start zeroed)
    shp: np.ndarray
    blk: np.ndarray
    grd: np.ndarray
    xst: np.ndarray
    ost: np.ndarray
    gst: np.ndarray
    pa: int
    npw: int
    chunk: int  # blocks along axis 7 per task
    rows: int  # task rows (grid of axes 0..6) per task, > 1 only when one chunk spans axis 7

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def log2_block(self) -> int:
        """k when blocks are 2^k (k >= 1) elements along axis 7 only, else -1 (kernels' fast path)."""
        b = int(self.blk[-1])
        if self.grid == () or any(int(v) != 1 for v in self.blk[:-1]) or b < 2 or b & (b - 1):
            return -1
        return b.bit_length() - 1

    @property
    def nslots(self) -> int:
        return math.prod(self.grid)

    def args(self) -> tuple:
        """The layout arguments shared by every block kernel, in kernel order."""
        return (self.shp, self.blk, self.grd, self.xst, self.ost, self.gst, self.pa, self.npw, self.chunk,
                self.rows)

    @property
    def ntasks(self) -> int:
        """Parallel tasks of the block kernels (at least 1): row groups x chunks along axis 7."""
        n_outer = math.prod(int(g) for g in self.grd[:7])
        return max(1, -(-n_outer // self.rows) * -(-int(self.grd[7]) // self.chunk))


def make_plan(shape: tuple[int, ...], scheme: QuantScheme) -> Plan:
    """Fold `shape` under `scheme` into the kernels' 8-axis view (see module docstring).

    Per-tensor schemes get a partition into tasks of about `TASK_ELEMENTS` elements (whole
    trailing axes, then runs of the next one) as their blocks, and all-zero slot strides: every
    element uses slot 0.
    """
    shape = tuple(int(d) for d in shape)
    rank = len(shape)
    full = layout.full_block(shape, scheme)
    per_tensor = full is None
    blocks = [1] * rank if per_tensor else list(full)
    pack_axis = layout.packing_axis(shape, scheme)
    npw = layout.fields_per_word(scheme)

    axes: list[list] = []  # [extent, block, is_packing_axis]
    for k, (d, b) in enumerate(zip(shape, blocks)):
        b = max(1, min(b, d))
        is_pack = k == pack_axis
        if axes and not is_pack and not axes[-1][2]:
            d0, b0, _ = axes[-1]
            if b >= d:  # the new axis lies inside one block: slots do not change
                axes[-1] = [d0 * d, max(1, b0 * d), False]
                continue
            if b0 == 1 and b == 1:
                axes[-1] = [d0 * d, 1, False]
                continue
        axes.append([d, b, is_pack])
    if len(axes) > NAXES:  # cannot happen (module docstring); guard the kernels anyway
        raise RuntimeError(f"ndarray plan for {shape} under {scheme} needs {len(axes)} axes > {NAXES}")
    axes = [[1, 1, False]] * (NAXES - len(axes)) + axes
    shp = [a[0] for a in axes]
    blk = [a[1] for a in axes]
    pa = next((k for k, a in enumerate(axes) if a[2]), -1)

    if per_tensor:  # partition into tasks of about TASK_ELEMENTS, whole trailing axes first
        room = TASK_ELEMENTS
        for k in range(NAXES - 1, -1, -1):
            blk[k] = max(1, min(shp[k], room))
            room //= max(1, shp[k])
            if room < 2:
                break
    grd = [-(-d // b) for d, b in zip(shp, blk)]
    gst = [0] * NAXES if per_tensor else _row_major(grd)
    xst = _row_major(shp)
    if pa < 0:
        ost = xst
    else:
        words = list(shp)
        words[pa] = -(-shp[pa] // npw)
        word_bytes = scheme.store.word_bits // 8
        ost = [s * word_bytes for s in _row_major(words)]
    per_task = math.prod(min(b, d) for b, d in zip(blk[:-1], shp[:-1])) * max(1, min(blk[-1], shp[-1]))
    chunk = max(1, TASK_ELEMENTS // max(1, per_task))
    rows = 1
    if chunk >= grd[-1]:  # one chunk covers axis 7: let a task take several task rows instead
        rows = max(1, TASK_ELEMENTS // max(1, per_task * grd[-1]))

    as_arr = lambda v: np.asarray(v, dtype=np.int64)  # noqa: E731
    nbytes = layout.values_nbytes(shape, scheme)
    return Plan(
        shape=shape,
        grid=layout.grid_shape(shape, scheme),
        values_nbytes=nbytes,
        padded=nbytes != math.prod(shape),
        shp=as_arr(shp), blk=as_arr(blk), grd=as_arr(grd), xst=as_arr(xst), ost=as_arr(ost),
        gst=as_arr(gst), pa=pa, npw=npw, chunk=chunk, rows=rows,
    )
