"""`Plans`: a backend's prepared plans, one `Prepared` per shape + scheme + method, built once.

A plan (`_plan.Plan`) is host geometry; `Prepared` adds what the kernels read on the device
(the parameter arrays, the scratch arrays of the staged quantize, the decode table, the fast
path's geometry) and the launches packed over them (`fast_quant`, `wide_quant`). `Plans` keeps
the 16 most recent, and the field-order kernel's plans (`order`), for one backend.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from qcore.spec import layout
from qcore.spec.payload import sections
from qcore.spec.schemes import QuantScheme

from ._compat import numba_cuda
from ._loader import kernels
from .layouts import M_WB

__all__ = ["FastGeometry", "Prepared", "Plans", "value_words"]


@dataclass(frozen=True, eq=False)
class FastGeometry:
    """The fast path's geometry of a prepared plan (`fast.geometry`), on the device."""

    kind: int  # fast.KIND_*
    G: Any  # int64[G_LEN]: the geometry in the plan's calibrated mode
    G_given: Any  # the same in given-scales mode (fast.MODE_GIVEN)
    C: Any  # float32[C_LEN]: the constants
    mode: int  # G[G_MODE]
    nruns: int  # G[G_NRUNS]
    two_pass: bool  # the tensor's max |x| first (every mode but MODE_BLOCK)


@dataclass(eq=False)
class Prepared:
    """One shape + scheme + method as the kernels read it (module text)."""

    plan: Any  # _plan.Plan (host)
    P: Any  # int64[P_LEN]: the general kernels' geometry
    F: Any  # float32[F_LEN]: their constants
    P_explicit: Any  # P in explicit-scales mode (M_MODE = 1)
    stored: Any  # float32[nslots]: the stored scales of the staged quantize
    raw: Any  # float32: its raw scales (nslots, or 2 nslots with the affine offsets after them; at least 2)
    first: Any  # int64[2]: a per-tensor signed extreme's index (signed scales)
    lut: Any  # float32: every field's value (`_plan.lut`), NaN for a field outside the value's set
    fast: FastGeometry | None = None  # None: the fast kernels do not take this layout (or are off)
    TP: Any = None  # int64[T_LEN]: the tile kernel's geometry, where it applies
    dummy32: Any = None  # uint32[1]: the tile kernel's word array where it writes bytes
    RP_given: Any = None  # int64[R_LEN]: the row kernels' geometry in ROW_GIVEN mode, where they apply
    RP_stats: Any = None  # the same in ROW_STATS mode
    fast_quant: dict = field(default_factory=dict)
    """The fast path's packed (max pass, quantize, statistics reset) launches, by (id of the G
    array, calibrated): (the scratch flag they were packed with, the three `Packed`)."""
    wide_quant: dict = field(default_factory=dict)
    """k_wide_quant's packed launch by (bf16 x, kernel, act's sink flag): (flag, `Packed`)."""


def value_words(payload: Any, plan: Any) -> Any:
    """A payload's values section as the general and row kernels' word array (`plan`: its
    `_plan.Plan`): uint32 words for PackedU32, else bytes."""
    if int(plan.P[M_WB]) == 4:
        return payload[: plan.values_nbytes].view(np.uint32)
    return payload[: plan.values_nbytes]


class Plans:
    """A backend's prepared plans (module text); `fast` is whether its fast kernels run."""

    def __init__(self, fast: bool) -> None:
        self.fast = fast

    @functools.lru_cache(maxsize=16)
    def get(self, shape: tuple[int, ...], scheme: QuantScheme, method: str) -> Prepared:
        """The plan and its device arrays for one shape + scheme + method, built once."""
        from . import _plan, fast

        cuda, K = numba_cuda(), kernels()
        pl = _plan.plan(shape, scheme, method)
        pp = Prepared(
            plan=pl, P=cuda.to_device(pl.P), F=cuda.to_device(pl.F),
            P_explicit=cuda.to_device(K.P_LAYOUT.replace(pl.P, M_MODE=1)),
            stored=cuda.device_array(pl.nslots, dtype=np.float32),
            raw=cuda.device_array(max(pl.nslots * (2 if scheme.affine else 1), 2), dtype=np.float32),  # affine offsets
            first=cuda.device_array(2, dtype=np.int64),  # a per-tensor signed extreme's index (signed scales)
            lut=cuda.to_device(_plan.lut(scheme)),
        )
        fg = fast.geometry(shape, scheme, method) if self.fast else None
        if fg is not None:  # the fast path (fast.py): calibrated mode and given-scales mode
            kind, G, C = fg
            Gg = fast.G_LAYOUT.replace(G, G_MODE=fast.MODE_GIVEN)
            pp.fast = FastGeometry(kind=kind, G=cuda.to_device(G), G_given=cuda.to_device(Gg), C=cuda.to_device(C),
                                   mode=int(G[fast.G_MODE]), nruns=int(G[fast.G_NRUNS]),
                                   two_pass=int(G[fast.G_MODE]) != fast.MODE_BLOCK)  # the tensor's max |x| first
        if pl.TP is not None:
            pp.TP = cuda.to_device(pl.TP)
            pp.dummy32 = cuda.device_array(1, dtype=np.uint32)
        if pl.RP is not None:
            pp.RP_given, pp.RP_stats = (cuda.to_device(K.RP_LAYOUT.replace(pl.RP, R_MODE=m))
                                        for m in (K.ROW_GIVEN, K.ROW_STATS))
        return pp

    def code_words(self, data: Any) -> Any:
        """A tensor's (`CudaData`) values section as u32 words: the codes the GEMV-family kernels read."""
        plan = self.get(data.shape, data.scheme, "minmax").plan
        return data.payload[: plan.values_nbytes].view(np.uint32)

    @functools.lru_cache(maxsize=64)
    def order(self, shape: tuple[int, ...], src: QuantScheme, dst: QuantScheme) -> tuple:
        """(device R array, threads' work items) of k_reorder for this shape and pair of field
        orders, the payload's bytes after the values copied with them."""
        from . import _plan

        K = kernels()
        total = sections(shape, src).total
        R = _plan.order_geometry(shape, src, dst, total - layout.values_nbytes(shape, src))
        split = "split" in (src.store.order.value, dst.store.order.value) and src.store.order != dst.store.order
        items = int(R[K.OR_NL] * R[K.OR_NG]) if split else int(R[K.OR_NW])
        return numba_cuda().to_device(R), max(items, int(R[K.OR_TAIL]))
