"""Quantize paths: fast, tile, fused and staged (statistics -> scales -> codes)."""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable

import ml_dtypes
import numpy as np

from qcore.backend.protocol import QParams, QTensor
from qcore.spec.checks import raise_nonfinite
from qcore.spec.schemes import QuantScheme, QuantValue

from .. import _array
from .._data import CudaData
from .._launch import Packed
from .._loader import kernels
from .._prepared import FastGeometry, Prepared, value_words
from .._quiet import quiet
from .._scratch import Scratch
from .._streams import on

__all__ = ["QUANTIZE", "QuantizeCall", "FastQuantize", "fast_quant_launches", "fast_quant_held", "run_fast_quantize",
           "TileQuantize", "FusedQuantize", "WideQuantize", "run_wide_quantize", "quantize_bf16_rows", "wide_bytes",
           "StagedQuantize"]


@dataclass
class QuantizeCall:
    """One quantize launch: x (flat float32 on the device), the payload it writes, and what the
    backend prepared for this shape and scheme (`prepared`: plan, parameter arrays, fast-path
    geometry)."""

    be: Any  # the CudaBackend (its `state`: prepared plans, scratch)
    K: Any  # the kernels module
    xd: Any  # x: a DevView or a numba device array, flat float32
    shape: tuple[int, ...]
    scheme: QuantScheme
    params: QParams | None  # given scales, or None to calibrate
    prepared: Prepared
    payload: Any  # the payload: a DevView or a numba uint8 device array
    s: Any  # StreamRef

    @property
    def plan(self) -> Any:
        return self.prepared.plan

    @property
    def fast_geometry(self) -> FastGeometry | None:
        return self.prepared.fast

    @property
    def scratch(self) -> Scratch:
        return self.be.state.scratch

    @property
    def general_only(self) -> bool:
        """Signed scales, code rules and affine offsets (docs/spec.md) run on the general kernels
        only: `k_slot_stats` (the signed extreme; min and max), `k_scales`, `k_quant`."""
        return self.scheme.signed or self.scheme.reciprocal_codes or self.scheme.affine

    @cached_property
    def fast(self) -> bool:
        """The fast kernels serve the codes: a fast geometry, and x aligned for their vector loads."""
        from .. import fast

        return self.fast_geometry is not None and fast.aligned(self.xd) and not self.general_only

    @property
    def rows(self) -> bool:
        """The row kernels serve the codes (a row geometry, no fast path)."""
        return self.plan.RP is not None and not self.fast and not self.general_only

    @property
    def wide_stats(self) -> bool:
        """k_wide_stats computes the block maxima: a row geometry whose blocks are wider than the
        row kernel's lane groups, calibrated by max |x| (no sign, no offset: not `general_only`)."""
        pl = self.plan
        return self.params is None and pl.RP is not None and self.scheme.block is not None and \
            not pl.rows_stats and not self.general_only and int(pl.RP[self.K.R_METHOD]) == 0

    @property
    def tiles(self) -> bool:
        """The tile kernel computes the block statistics (calibrating, a tile geometry)."""
        return self.params is None and self.plan.TP is not None and not self.general_only

    @cached_property
    def qw32(self) -> Any:
        """The values section as uint32 words (the fast kernels' view of the payload)."""
        return _array.prefix(self.payload, self.plan.values_nbytes, np.uint32)

    def to_numba(self) -> None:
        """x and the payload as numba arrays, for the dispatcher launches (made once per call)."""
        if type(self.xd) is _array.DevView:
            self.xd = self.xd.numba()
        if self.fast and type(self.qw32) is _array.DevView:
            self.qw32 = self.qw32.numba()
        if type(self.payload) is _array.DevView:
            self.payload = self.payload.numba()


class FastQuantize:
    """fast.py: codes along the last axis, calibrated in-kernel. Block schemes take one pass
    over x (block maxima and codes); per-tensor and two-level ones take the tensor's max |x|
    first (a second pass). Packed launches (`_launch.Packed`), made once per plan."""

    name = "fast"

    def applies(self, c: QuantizeCall) -> bool:
        from .. import fast

        return c.fast and c.params is None and c.fast_geometry.mode != fast.MODE_GIVEN and \
            not c.scheme.reciprocal_global and not c.general_only  # its G comes from k_scales (staged)

    def launch(self, c: QuantizeCall) -> Any:
        fp = c.fast_geometry
        launches = fast_quant_launches(c.scratch, c.prepared, c.xd, c.qw32, c.payload, fp.G, s=c.s)
        return run_fast_quantize(launches, fp, c.xd, c.qw32, c.payload, c.s, c.scratch)


def fast_quant_launches(scratch: Scratch, pp: Prepared, xd: Any, qw32: Any, payload: Any, G: Any, gbuf: Any = None,
                        s: Any = None) -> tuple:
    """The fast path's (max pass, quantize, statistics reset) launches for this plan, scratch and
    `G` (calibrated or given mode), packed once (`_launch.Packed`, kept in `pp.fast_quant`): x and
    the payload change from call to call. Given explicit scales, `gbuf` is their device copy
    (new each call)."""
    from .. import fast

    asum, fs, flag = scratch.buffers(s)
    fp = pp.fast
    key = (id(G), gbuf is None)  # (`fast_quant_held` reads the calibrated one)
    got = pp.fast_quant.get(key)
    if got is None or got[0] is not flag:  # a new scratch after a non-finite input: pack again
        qgrid, qtpb = fast.launch(fp.nruns, fast.QUANT_PER_SM[fp.kind])
        agrid, atpb = fast.launch(fp.nruns, fast.AMAX_PER_SM)
        gb = fs if gbuf is None else gbuf
        got = pp.fast_quant[key] = (flag, (
            Packed(fast.k_amax, agrid, atpb, [xd, fs, flag, fp.nruns], dynamic=(0,)),
            Packed(fast.quant_kernel(fp.kind), qgrid, qtpb, [xd, qw32, payload, pp.stored, gb, flag, G, fp.C],
                   dynamic=(0, 1, 2, 4)),
            Packed(kernels().k_zero_stats, 1, 1, [asum, fs], dynamic=()),
        ))
    amax, quant, zero = got[1]
    if gbuf is None:
        return amax, quant, zero
    return amax, lambda x, w, p, stream=None: quant(x, w, p, gbuf, stream=stream), zero


def fast_quant_held(scratch: Scratch, pp: Prepared, s: Any) -> tuple | None:
    """The calibrated fast path's launches for this plan as `fast_quant_launches` packed them,
    each one the call takes held as a C argument array (`Packed.raw_packed`: launched with
    plain pointers), for the current scratch; else None (`fast_quant_launches` then packs
    them, with views)."""
    fp = pp.fast
    got = pp.fast_quant.get((id(fp.G), True))
    if got is None or got[0] is not scratch.buffers(s).flag:
        return None
    amax, quant, zero = got[1]
    if not quant.raw_packed or fp.two_pass and not (amax.raw_packed and zero.raw_packed):
        return None
    return got[1]


def run_fast_quantize(launches: tuple, fp: FastGeometry, xd: Any, qw32: Any, payload: Any, s: Any, scratch: Scratch,
                      ptrs: tuple[int, int] | None = None) -> Any:
    """Enqueue the fast path's packed launches (`fast_quant_launches`) for geometry `fp`: block
    schemes take one pass; per-tensor and two-level ones the tensor's max |x| first, and the
    statistics scratch is zeroed after. Returns, for those two passes, the mark after the max
    pass where the non-finite flag is final (`Scratch.early_marks`), else None: the call then
    waits for the stream. With `ptrs` (x's and the payload's device pointers, in the caller's
    memory and of the packed lengths: a repeat call's key fixes them) the launches take plain
    pointers (`Packed.launch_values`, each one held as a C argument array: `fast_quant_held`)
    and the views are not used; False then when the driver refused the first launch (nothing
    ran: the caller takes the views' way)."""
    amax, quant, zero = launches
    if ptrs is None:
        caller_x, xv, qv = type(xd) is _array.DevView, None, None
    else:
        caller_x, xv, qv = True, ptrs[:1], (ptrs[0], ptrs[1], ptrs[1])
    if not fp.two_pass:
        return None if _enqueue(quant, s, (xd, qw32, payload), qv) else False
    if not _enqueue(amax, s, (xd,), xv):  # pass 1: the tensor's max |x| into the scratch
        return False
    marks = scratch.early_marks(caller_x, s)
    if marks is not None:
        marks[0].record(s)
    ok = _enqueue(quant, s, (xd, qw32, payload), qv)
    ok = ok and _enqueue(zero, s, (), None if ptrs is None else ())  # the statistics scratch is consumed: zero it
    if not ok:
        raise RuntimeError("the driver refused a quantize launch after taking the call's first")
    if marks is not None:
        marks[1].record(s)
        return marks[0]
    return None


def _enqueue(launch: Any, s: Any, views: tuple, values: tuple | None) -> bool:
    """One packed launch on stream `s`: with its views, or with plain `values` when given
    (`Packed.launch_values`: False if the driver refused it)."""
    if values is None:
        launch(*views, stream=s)
        return True
    return launch.launch_values(values, s.handle)


class TileQuantize:
    """kernels.k_tile_quant: one-level blocks B | 32 along the last axis of a layout the fast
    kernels do not take; a warp per tile computes statistics, scales and codes in one kernel."""

    name = "tile"

    def applies(self, c: QuantizeCall) -> bool:
        return c.tiles and not c.scheme.two_level

    def launch(self, c: QuantizeCall) -> None:
        c.to_numba()
        _tile_kernel(c)


class FusedQuantize:
    """kernels.k_quant_fused: one pass per block over x (statistic, scale, codes), any layout
    the plan can walk block by block."""

    name = "fused"

    def applies(self, c: QuantizeCall) -> bool:
        return c.params is None and c.plan.fused and not c.rows and not c.scheme.reciprocal_global and \
            not c.general_only

    def launch(self, c: QuantizeCall) -> None:
        c.to_numba()
        K, pp = c.K, c.prepared
        on(K.k_quant_fused, K.launch(c.plan.nruns), c.s)(c.xd, pp.P, pp.F, c.payload, c.scratch.buffers(c.s).flag)


class WideQuantize:
    """k_rows.k_wide_quant: one-level blocks wider than a warp along rows (`wide_stats`), 8-bit
    codes one per byte (e4m3 or int8 per row: what W8A8 quantizes x with): maximum, scale and
    codes of a slot by one thread block, in one launch."""

    name = "wide"

    def applies(self, c: QuantizeCall) -> bool:
        return c.wide_stats and wide_bytes(c.K, c.plan, c.scheme)

    def launch(self, c: QuantizeCall) -> None:
        c.to_numba()
        run_wide_quantize(c.be, c.K, c.prepared, _array.reinterpret(c.xd, np.uint32), False, c.payload,
                          c.scratch.buffers(c.s).flag, c.s)


WIDE_VALUES = frozenset({QuantValue.Q8S, QuantValue.Q8F, QuantValue.E4M3, QuantValue.E5M2})
"""The value kinds k_wide_quant encodes (int8 by rounding, FP8 by `encode`)."""


def wide_bytes(K: Any, plan: Any, scheme: QuantScheme) -> bool:
    """Whether k_wide_quant writes this plan's codes: one level, int8 or FP8 codes one per byte."""
    RP = plan.RP
    return not scheme.two_level and scheme.value in WIDE_VALUES and int(RP[K.R_BITS]) == 8 and \
        int(RP[K.R_NF]) == 1 and int(plan.P[K.M_WB]) != 4


def run_wide_quantize(be: Any, K: Any, prepared: Prepared, x_words: Any, bf16: bool, payload: Any, flag: Any,
                      s: Any, sink: bool = False) -> None:
    """Enqueue the wide quantize kernel over `x_words` (float32 bits, or bfloat16 pairs where
    `bf16`) into `payload`: `fast.k_wide_quant` (the sm_89 conversions) where the backend runs
    the fast kernels, its 16-byte form for the plan's value kind (`fast.wide_quads_kernel`) where
    x and the payload start on 16-byte boundaries too, else `kernels.k_wide_quant`; a launch packed
    once per plan, form of kernel, kind of x and kind of flag (`_launch.Packed`, kept in
    `prepared.wide_quant`, so a repeat call picks nothing again): the stream's scratch flag, or
    where `sink` the backend's flag that nothing reads (`Scratch.act_sink`)."""
    from .. import fast

    if not be.state.fast.usable:
        form = "general"
    elif fast.aligned(x_words) and fast.aligned(payload):
        form = "quads"
    else:
        form = "fast"
    key = (bf16, form, sink)
    got = prepared.wide_quant.get(key)
    if got is None or got[0] is not flag:  # a new scratch after a non-finite input: pack again
        plan = prepared.plan
        if form == "quads":
            kernel = fast.wide_quads_kernel(K.wide_kind(plan.RP))
            grid, tpb = (K.launch_held(plan.nslots, int(plan.RP[K.R_B]), bf16, fast.WIDE_HELD, fast.WIDE_REGS)
                         if fast.WIDE_HELD else K.launch_wide(plan.nslots))
        else:
            kernel = K.k_wide_quant if form == "general" else fast.k_wide_quant
            grid, tpb = K.launch_wide(plan.nslots)
        got = prepared.wide_quant[key] = (flag, Packed(kernel, grid, tpb, [x_words, bf16, prepared.RP_given,
                                                                           prepared.F, prepared.stored, payload, flag],
                                                       dynamic=(0, 5)))
    got[1](x_words, payload, stream=s)


def quantize_bf16_rows(be: Any, x: Any, scheme: QuantScheme, s: Any,
                       wait: bool = True) -> tuple[QTensor, Callable[[], None]] | None:
    """`be.quantize(x.float(), scheme)` for x [rows, L] (L even) on stream `s`, a C-contiguous
    torch bfloat16 CUDA tensor or a device array of bfloat16 bits (uint16), read as it is: bfloat16
    values are exact in float32, so `WideQuantize`'s kernel reading x's bits writes the same bytes,
    without the float32 copy. Returns (the QTensor, `check`), or None where that path does not take
    the scheme (`WideQuantize.applies`). Nothing waits: `check()` waits for the stream and raises
    InputError naming x's first non-finite element, so a caller queues its next kernels first. With
    `wait=False` nothing is checked (`check()` does nothing): a slot holding a non-finite x gets a
    NaN scale, as `act` wants (docs/spec.md, quantized activations)."""
    shape = tuple(int(d) for d in x.shape)
    if len(shape) != 2 or shape[1] % 2 or 0 in shape or scheme.low_order is not scheme:
        return None
    K, scratch = kernels(), be.state.scratch
    torch = sys.modules.get("torch")
    is_torch = torch is not None and isinstance(x, torch.Tensor)
    words = _array.reinterpret(_array.view_of(x.view(torch.int32) if is_torch else x), np.uint32)
    call = QuantizeCall(be, K, words, shape, scheme, None, be.state.plans.get(shape, scheme, "minmax"), None, s)
    if not WideQuantize().applies(call):
        return None
    payload, target = _array.empty_view((call.plan.total_nbytes,), np.dtype(np.uint8), s)
    flag = scratch.buffers(s).flag if wait else scratch.act_sink
    with quiet():
        run_wide_quantize(be, K, call.prepared, words.arg, True, target.arg, flag, s, sink=not wait)

    def check() -> None:
        if not wait:
            return
        if scratch.read_flag(flag, s):
            scratch.drop(s)
            host = x.float().cpu().numpy() if is_torch else \
                _array.view_of(x).numba().copy_to_host().view(ml_dtypes.bfloat16).astype(np.float32).reshape(shape)
            raise_nonfinite(host)

    return QTensor(be, scheme, shape, CudaData(shape, scheme, payload)), check


class StagedQuantize:
    """Everything else, in three stages on the call's stream: the statistics (or the given
    scales copied up), `k_scales` (raw -> stored scales and their words), the codes. Each stage
    runs on the kernels that fit the layout: statistics on the tile, row or general kernels
    (`k_tensor_stats` for one per-tensor scale; `k_wide_stats` for blocks wider than a warp along
    rows), codes on the fast, row or general kernels."""

    name = "staged"

    def applies(self, c: QuantizeCall) -> bool:
        return True

    def launch(self, c: QuantizeCall) -> None:
        c.to_numba()
        raw, gbuf, P = self.statistics(c)
        K, pp = c.K, c.prepared
        asum = c.scratch.buffers(c.s).asum
        on(K.k_scales, K.launch(c.plan.nslots), c.s)(raw, asum, P, pp.F, pp.stored, gbuf, c.payload)
        self.codes(c, raw, P, gbuf)

    @staticmethod
    def statistics(c: QuantizeCall) -> tuple[Any, Any, Any]:
        """Stage 1: (raw scales, global/statistics buffer, parameter array) for `k_scales`."""
        from numba import cuda

        K, pp, pl, s = c.K, c.prepared, c.plan, c.s
        asum, fs, flag = c.scratch.buffers(c.s)
        if c.params is not None:  # given scales (and affine offsets after them): copied up, explicit mode
            given = [np.asarray(c.params.scales, dtype=np.float32).reshape(-1)]
            if c.scheme.affine:
                given.append(np.asarray(c.params.offsets, dtype=np.float32).reshape(-1))
            raw = cuda.to_device(np.ascontiguousarray(np.concatenate(given)), stream=s.numba)
            g = c.params.global_scale or 0.0
            if c.scheme.reciprocal_global:  # -G: the kernels' sign for a reciprocal global (two_level_e)
                g = -g
            gbuf = cuda.to_device(np.array([g, 0, 0, 0], dtype=np.float32), stream=s.numba)
            return raw, gbuf, pp.P_explicit
        if c.scheme.block is None and not c.general_only:  # one per-tensor scale
            raw = fs[2:3]
            on(K.k_tensor_stats, K.launch(math.prod(c.shape)), s)(c.xd, raw, asum, flag)
            return raw, fs, pp.P
        # per-tensor signed scales, code rules and affine offsets: in parallel into the plan's own raw array
        if c.scheme.block is None:
            raw, n = pp.raw, math.prod(c.shape)
            if c.scheme.affine:  # max and min (affine offsets)
                on(K.k_fill2, (1, 1), s)(raw, np.float32(-np.inf), np.float32(np.inf))
                on(K.k_tensor_range, K.launch(n), s)(c.xd, raw, flag)
                return raw, fs, pp.P
            on(K.k_fill2, (1, 1), s)(raw, np.float32(0), np.float32(0))
            on(K.k_tensor_stats, K.launch(n), s)(c.xd, raw, asum, flag)  # max |x|, sum |x|
            if c.scheme.signed:  # the first element of that magnitude, with its sign (signed scales)
                first = pp.first
                on(K.k_fill2, (1, 1), s)(first, np.int64(n), np.int64(n))
                on(K.k_first_extreme, K.launch(n), s)(c.xd, raw, first)
                on(K.k_take_extreme, (1, 1), s)(c.xd, first, raw)
            return raw, fs, pp.P
        raw = pp.raw
        if c.tiles:  # two-level: the kernel stops at the statistics (its TP mode)
            _tile_kernel(c)
        elif c.rows and pl.rows_stats:
            on(K.k_rows_quant, K.launch_rows(*pl.rows_shape), s)(
                c.xd, pp.RP_stats, pp.F, pp.stored, fs, value_words(c.payload, pl), c.payload,
                flag, raw)
        elif c.wide_stats:
            on(K.k_wide_stats, K.launch_wide(pl.nslots), s)(_array.reinterpret(c.xd, np.uint32), False,
                                                             pp.RP_given, raw, fs[1:2], flag)
        else:
            on(K.k_slot_stats, K.launch(pl.nslots), s)(c.xd, pp.P, raw, fs[1:2], flag)
        return raw, fs, pp.P

    @staticmethod
    def codes(c: QuantizeCall, raw: Any, P: Any, gbuf: Any) -> None:
        """Stage 3: the codes from the stored scales, on the fast, row or general kernels."""
        K, pp, pl, s = c.K, c.prepared, c.plan, c.s
        asum, fs, flag = c.scratch.buffers(c.s)
        calibrated = c.params is None
        if c.fast:
            fp = c.fast_geometry
            _, quant, zero = fast_quant_launches(c.scratch, pp, c.xd, c.qw32, c.payload, fp.G_given, gbuf, c.s)
            quant(c.xd, c.qw32, c.payload, stream=s)
            if calibrated:  # the statistics scratch is consumed: zero it for the next call
                zero(stream=s)
        elif c.rows:
            on(K.k_rows_quant, K.launch_rows(*pl.rows_shape), s)(
                c.xd, pp.RP_given, pp.F, pp.stored, gbuf, value_words(c.payload, pl), c.payload,
                flag, raw)
            if calibrated:
                on(K.k_zero_stats, (1, 1), s)(asum, gbuf)
        else:
            on(K.k_quant, K.launch(pl.nruns), s)(c.xd, P, pp.F, pp.stored, gbuf, c.payload, flag, asum, raw)


def _tile_kernel(c: QuantizeCall) -> None:
    """kernels.k_tile_quant on the call: block statistics into `prepared.raw`, and for one-level
    schemes the scales and codes too (the mode is in TP)."""
    K, pp, pl = c.K, c.prepared, c.plan
    _, fs, flag = c.scratch.buffers(c.s)
    w8 = c.payload[: pl.values_nbytes]
    w32 = w8.view(np.uint32) if pl.TP[K.T_U32] else pp.dummy32
    on(K.k_tile_quant, K.launch_tiles(int(pl.TP[K.T_NT])), c.s)(c.xd, pp.TP, pp.F, w32, w8, c.payload, flag,
                                                                pp.raw, fs)


QUANTIZE = (FastQuantize(), TileQuantize(), FusedQuantize(), WideQuantize(), StagedQuantize())
"""The quantize paths in the order the backend tries them."""
