"""Matmul paths: tensor-core, GEMV, general (x[M, K] @ dequantize(w)[K, N], f32 accumulation)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from .._array import DevView
from .._data import NOT_YET
from .._launch import Packed
from .._streams import on

__all__ = ["MATMUL", "MatmulCall", "FragmentGemvMatmul", "TensorCoreMatmul", "GemvMatmul", "GeneralMatmul",
           "GeneralMatmulPlan", "run_packed", "run_packed_values", "packed_aligned", "packed_takes"]


@dataclass
class MatmulCall:
    """One matmul launch: x (flat float32 [M, K] on the device), the weight (`data`: CudaData
    [K, N]), the flat output [M, N], the weight's decoded scales."""

    be: Any
    K: Any
    xd: Any
    data: Any
    m: int
    out: Any
    scales: Any
    gbuf: Any
    s: Any

    @cached_property
    def gemv_geometry(self) -> tuple | None:
        """(kind, Q) of the GEMV kernels for this weight (cached on it), None when its layout has
        none or the device lacks the fast kernels."""
        if not self.be.state.fast.usable or self.data.scheme.affine:  # affine offsets: the general kernel only
            return None
        from .. import gemv

        cache = self.data.cache
        if cache.gemv_geometry is NOT_YET:
            cache.gemv_geometry = gemv.geometry(self.data.shape, self.data.scheme)
        return cache.gemv_geometry

    @cached_property
    def gemv_ready(self) -> bool:
        """The fast layout kernels can take this call: a GEMV geometry and x aligned for them."""
        from .. import fast

        return self.gemv_geometry is not None and fast.aligned(self.xd)


def packed_aligned(ptr: int) -> bool:
    """Whether x's data at `ptr` suits a packed GEMV or tensor-core launch: on a 16-byte boundary
    (the kernels' vector loads)."""
    return ptr % 16 == 0


def packed_takes(xd: Any) -> bool:
    """Whether a packed GEMV or tensor-core launch takes x as it is: the backend's own view of
    it (`DevView`), `packed_aligned`."""
    return type(xd) is DevView and packed_aligned(xd.ptr)


def run_packed(st: tuple, xd: Any, out: Any, m: int, s: Any) -> None:
    """A packed GEMV or tensor-core launch (`(rows per launch, Packed)`) over x's m rows."""
    mb, launch = st
    if m <= mb:
        launch(xd, out, 0, m, stream=s)
        return
    for m0 in range(0, m, mb):
        launch(xd, out, m0, min(mb, m - m0), stream=s)


def run_packed_values(st: tuple, xptr: int, optr: int, m: int, handle: int) -> bool:
    """`run_packed` with plain device pointers for x and out (of the packed dtype and length: a
    repeat call's key fixes them) on the stream with raw `handle`; False when nothing was
    launched (the launch is not held as a C argument array: `Packed.launch_values`)."""
    mb, launch = st
    for m0 in range(0, m, mb):
        if not launch.launch_values((xptr, optr, m0, min(mb, m - m0)), handle):
            if m0:
                raise RuntimeError("the driver refused a GEMV launch after taking the first of the call's launches")
            return False
    return True


def _packed(c: MatmulCall, kern: Any, mb: int, q: Any, grid: Any, block: Any, part: Any, cnt: Any,
            extra: list, cluster: tuple | None = None) -> tuple:
    """Pack a GEMV-family launch once per (weight, m): x, out, m0 and the row count change from
    call to call (`dynamic`); the backend runs it directly on later calls (in thread-block
    clusters of shape `cluster`, if given: `_launch.Packed`)."""
    plans = c.be.state.plans
    pp = plans.get(c.data.shape, c.data.scheme, "minmax")
    args = [c.xd, plans.code_words(c.data), c.scales, c.gbuf, pp.lut, part, cnt, c.out, q, 0, mb] + extra
    st = c.data.cache.gemv[c.m] = (mb, Packed(kern, grid, block, args, dynamic=(0, 7, 9, 10), cluster=cluster))
    return st


def fragment_copy(be: Any, data: Any, scales: Any, gbuf: Any, Q: Any) -> Any:
    """A new fragment copy (`frag.pack`) of weight `data` with its decoded `scales` and global
    and GEMV geometry `Q`."""
    from .. import frag

    plans = be.state.plans
    nslots = plans.get(data.shape, data.scheme, "minmax").plan.nslots
    return frag.pack(plans.code_words(data), scales, gbuf, Q, frag.half_scales(data.scheme), nslots)


class FragmentGemvMatmul:
    """frag.py: bf16 mma at M = 1 over a copy of a 4-bit integer weight in fragment order (made
    once per weight and kept with it; not for a payload in the caller's memory, which the
    caller may write), x * e split in two (within the f32 accumulation bound); k-split partial
    sums added in a fixed order, so results repeat bit for bit."""

    name = "fragment-gemv"

    def applies(self, c: MatmulCall) -> bool:
        from .. import frag

        return (c.m == 1 and c.gemv_ready and frag.enabled() and frag.applies(*c.gemv_geometry)
                and not c.data.cache.caller_memory)

    def launch(self, c: MatmulCall) -> None:
        from .. import frag

        cache = c.data.cache
        st = cache.gemv.get(c.m)
        if st is None:
            half = frag.half_scales(c.data.scheme)
            if cache.frag is None:
                cache.frag = fragment_copy(c.be, c.data, c.scales, c.gbuf, c.gemv_geometry[1])
            kern, mb, q, grid, block, part, cnt = frag.buffers(c.gemv_geometry[1], half)
            st = _packed(c, kern, mb, q, grid, block, part, cnt, [cache.frag], frag.cluster_dims(grid))
        run_packed(st, c.xd, c.out, c.m, c.s)


class TensorCoreMatmul:
    """tc.py: TF32 mma with x * e split in two (within the f32 accumulation bound), from
    M = tc.MIN_M, for weights whose N, blocks and K suit it; k-split partial sums added in a
    fixed order, so results repeat bit for bit."""

    name = "tensor-core"

    def applies(self, c: MatmulCall) -> bool:
        from .. import tc

        return c.gemv_ready and tc.use_for(c.m) and tc.applies(c.gemv_geometry[1])

    def launch(self, c: MatmulCall) -> None:
        from .. import tc

        cache = c.data.cache
        st = cache.gemv.get(c.m)
        if st is None:
            kind, Q = c.gemv_geometry
            kern, mb, q, grid, block, part, cnt = tc.buffers(Q, kind, c.m)
            if cache.tc_scales is None:
                cache.tc_scales = tc.slot_scales(c.scales, c.gbuf, Q)
            st = _packed(c, kern, mb, q, grid, block, part, cnt, [cache.tc_scales])
        run_packed(st, c.xd, c.out, c.m, c.s)


class GemvMatmul:
    """gemv.py: FFMA over the weight's u32 code words, for weights on the fast layout (codes
    along N; per-tensor or power-of-two blocks along N spanning a word); M rows per launch up
    to the variant's limit."""

    name = "gemv"

    def applies(self, c: MatmulCall) -> bool:
        return c.gemv_ready

    def launch(self, c: MatmulCall) -> None:
        from .. import gemv

        st = c.data.cache.gemv.get(c.m)
        if st is None:
            kind, Q = c.gemv_geometry
            st = _packed(c, *gemv.buffers(Q, kind, c.m), [])
        run_packed(st, c.xd, c.out, c.m, c.s)


@dataclass(frozen=True)
class GeneralMatmulPlan:
    """`kernels.k_matmul`'s arguments for one weight and m rows of x, made once (kept in the
    weight's `TensorCache.general_matmul`)."""

    Q: Any  # int64[MM_LEN] on the device (`_plan.matmul_geometry`)
    launch: tuple  # (grid, block) (`K.launch_matmul`)
    lut: Any  # the value table (`Prepared.lut`)
    p32: Any  # the values section as u32 words, or a 1-word placeholder where the kernel reads bytes


class GeneralMatmul:
    """kernels.k_matmul: any layout; 8 output columns per thread, k-chunks summed in shared
    memory and added to the zeroed output with f32 atomics (the last bits may vary from run to
    run)."""

    name = "general"

    def applies(self, c: MatmulCall) -> bool:
        return True

    def launch(self, c: MatmulCall) -> None:
        from numba import config, cuda

        from .. import _plan

        K, data, be = c.K, c.data, c.be
        mm = data.cache.general_matmul.get(c.m)
        if mm is None:
            pp = be.state.plans.get(data.shape, data.scheme, "minmax")
            Q = _plan.matmul_geometry(data.shape, data.scheme, c.m, sim=bool(config.ENABLE_CUDASIM))
            nb4 = pp.plan.values_nbytes // 4
            p32 = data.payload[: nb4 * 4].view(np.uint32) if Q[K.MM_W32] and nb4 else \
                cuda.device_array(1, dtype=np.uint32)
            mm = data.cache.general_matmul[c.m] = GeneralMatmulPlan(
                Q=cuda.to_device(Q), launch=K.launch_matmul(int(Q[K.MM_NG]), int(Q[K.MM_KC]), c.m), lut=pp.lut,
                p32=p32)
        out = c.out if hasattr(c.out, "copy_to_host") else cuda.as_cuda_array(c.out)
        xd = c.xd if hasattr(c.xd, "copy_to_host") else cuda.as_cuda_array(c.xd)
        on(K.k_zero, K.launch(out.size), c.s)(out)
        on(K.k_matmul, mm.launch, c.s)(xd, data.payload, mm.p32, mm.Q, mm.lut, c.scales, c.gbuf, out)


MATMUL = (FragmentGemvMatmul(), TensorCoreMatmul(), GemvMatmul(), GeneralMatmul())
"""The matmul paths in the order the backend tries them."""
