"""The cuda backend's paths: one small class per way of running an operation on the GPU.

Each path says whether it serves a call (`applies(call)`) and enqueues its kernels
(`launch(call)`); the backend builds the call (its tensors, plan and stream) and takes the
first path in the operation's list that applies. The lists, most specialised first:

* quantize (`quantize.py`): `FastQuantize` (fast.py, codes along the last axis, sm_89+),
  `TileQuantize` (kernels: one-level blocks B | 32 along the last axis, statistics and codes in
  one kernel), `FusedQuantize` (one pass per block, any layout), `StagedQuantize` (statistics,
  then scales, then codes, each stage on the fast, row, tile or general kernels that fit:
  given scales, two-level schemes, per-tensor scales);
* dequantize (`dequantize.py`): `FastDequantize`, `RowsDequantize`, `RoundedDequantize`
  (bfloat16 results no bf16 kernel writes), `GeneralDequantize`;
* linear (`linear.py`): `FusedGemmLinear` (fused.py, a GEMM that dequantizes as it multiplies;
  integer and mxfp4 weights at `FUSED_M` rows), `DequantizedGemmLinear` (bfloat16 from `LIBRARY_FROM_M` rows: the weight
  dequantized to bfloat16, then torch's GEMM), `MmaDecodeLinear` (k_decode_mma.py, one or two rows of
  bfloat16 / float16 x), `DecodeLinear` (k_decode.py, a few rows of x),
  `TensorCoreLinear` (linear.py), `TransposedLinear`;
  W8A8 (`fp8.py`: e4m3 x e4m3 on torch's `_scaled_mm`) is tried first for `act=` and quantized x;
* matmul (`matmul.py`): `TensorCoreMatmul` (tc.py, M >= 4), `GemvMatmul` (gemv.py),
  `GeneralMatmul` (kernels.k_matmul, any layout).

A path holds no state: what a tensor or a plan keeps between calls (decoded scales, packed
launches) lives in the tensor's `CudaData.cache` (`_data.TensorCache`) and the plan's
`_prepared.Prepared`, which the paths read through the call. `TAKEN` counts
the paths chosen, by class name (tests and benchmarks read it).
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Protocol, Sequence, TypeVar

__all__ = ["Path", "TAKEN", "choose"]

TAKEN: Counter = Counter()
"""How often each path was chosen in this process, by class name (e.g. `TAKEN["TileQuantize"]`);
a matmul whose launch is already packed skips the choice and is not counted."""


class Path(Protocol):
    """One way of running an operation: `applies(call)` decides, `launch(call)` enqueues."""

    name: str

    def applies(self, call: Any) -> bool: ...

    def launch(self, call: Any) -> None: ...


P = TypeVar("P", bound=Path)


def choose(paths: Sequence[P], call: Any) -> P:
    """The first path in `paths` that applies to `call` (the last of each list always applies)."""
    for path in paths:
        if path.applies(call):
            TAKEN[type(path).__name__] += 1
            return path
    raise AssertionError(f"no path applies: {[p.name for p in paths]}")  # the lists end in a catch-all
