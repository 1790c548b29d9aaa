"""Dequantize paths: fast, rows, general; bfloat16 results through the fast kernel's bf16 variant,
or any other path's float32 rounded once by `linear.k_finish`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .._launch import Packed
from .._prepared import Prepared, value_words
from .._streams import on
from . import choose

__all__ = ["DEQUANTIZE", "DequantizeCall", "FastDequantize", "RowsDequantize", "GeneralDequantize",
           "RoundedDequantize"]


@dataclass
class DequantizeCall:
    """One dequantize launch: the tensor (`data`: CudaData), the flat C-order output, and what
    the backend prepared for its shape and scheme; the decoded scales and the invalid-code
    flag are the tensor's own (its cache). A bfloat16 result (`bf16`) is written as its bits:
    `out` is then a flat uint16 array."""

    be: Any
    K: Any
    data: Any
    prepared: Prepared
    out: Any  # DevView or numba device array, flat
    scales: Any  # decoded float32 scales on the device
    gbuf: Any  # the decoded global scale, gbuf[0]
    flag: Any  # int32 device flag (invalid code)
    s: Any
    bf16: bool = False

    @property
    def plan(self) -> Any:
        return self.prepared.plan

    def out_numba(self) -> Any:
        """The output as a numba array (a view of a torch/CuPy out= becomes numba's array of it)."""
        if not hasattr(self.out, "copy_to_host"):
            from numba import cuda

            self.out = cuda.as_cuda_array(self.out)
        return self.out


class FastDequantize:
    """fast.py's dequantize kernel: codes along the last axis, float32 output aligned for its
    vector stores; one packed launch per tensor (only the output changes between calls)."""

    name = "fast"

    def applies(self, c: DequantizeCall) -> bool:
        from .. import fast

        return c.prepared.fast is not None and c.out.dtype == (np.uint16 if c.bf16 else np.float32) and \
            fast.aligned(c.out) and not c.data.scheme.affine  # affine offsets: the general kernel only

    def launch(self, c: DequantizeCall) -> None:
        from .. import _array, fast

        cache = c.data.cache
        out = _array.reinterpret(c.out, np.uint32) if c.bf16 else c.out  # (bf16 pairs as u32 words)
        launch = cache.dequant_bf16 if c.bf16 else cache.dequant
        if launch is None:
            fp, pl = c.prepared.fast, c.plan
            grid, block = fast.launch_dequant(fp.nruns, fp.kind)
            units = fast.unit_view(c.data.payload[: pl.values_nbytes], fp.kind)
            kernel = fast.dequant_kernel(fp.kind, True) if c.bf16 else fast.dequant_kernel(fp.kind)
            launch = Packed(kernel, grid, block, [units, c.scales, c.gbuf, c.prepared.lut, out, fp.G, c.flag],
                            dynamic=(4,))
            if c.bf16:
                cache.dequant_bf16 = launch
            else:
                cache.dequant = launch
        launch(out, stream=c.s)


class RowsDequantize:
    """kernels.k_rows_dequant: codes along another axis than the last (a warp per row group)."""

    name = "rows"

    def applies(self, c: DequantizeCall) -> bool:
        return c.plan.RP is not None and not c.data.scheme.affine and not c.bf16

    def launch(self, c: DequantizeCall) -> None:
        K, pp, pl = c.K, c.prepared, c.plan
        words = value_words(c.data.payload, pl)
        on(K.k_rows_dequant, K.launch_rows(*pl.rows_shape), c.s)(
            words, pp.RP_given, pp.lut, c.scales, c.gbuf, c.out_numba(), c.flag)


class RoundedDequantize:
    """A bfloat16 result no bf16 kernel writes: the float32 result of the path that serves the
    tensor, into pool memory, then `linear.k_finish` rounds it once to nearest even."""

    name = "rounded"

    def applies(self, c: DequantizeCall) -> bool:
        return c.bf16

    def launch(self, c: DequantizeCall) -> None:
        from dataclasses import replace

        from .. import _array, linear
        from ..fast import K
        from .linear import placeholders

        n = int(c.out.size)
        y32 = _array.empty((n,), np.float32, c.s)
        inner = replace(c, out=y32, bf16=False)
        choose(DEQUANTIZE, inner).launch(inner)
        p32, _ = placeholders(c.s)
        on(linear.k_finish, K.launch(n), c.s)(y32, p32, p32, c.out, n, 1, linear.OT_BF16, 0)


class GeneralDequantize:
    """kernels.k_dequant: any layout, runs of elements per thread."""

    name = "general"

    def applies(self, c: DequantizeCall) -> bool:
        return True  # (a bfloat16 result stops at RoundedDequantize, before this)

    def launch(self, c: DequantizeCall) -> None:
        K, pp = c.K, c.prepared
        on(K.k_dequant, K.launch(c.plan.nruns), c.s)(
            c.data.payload, pp.P, pp.lut, c.scales, c.gbuf, c.out_numba(), c.flag)


DEQUANTIZE = (FastDequantize(), RowsDequantize(), RoundedDequantize(), GeneralDequantize())
"""The dequantize paths in the order the backend tries them."""
