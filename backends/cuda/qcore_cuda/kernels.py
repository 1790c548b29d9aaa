"""Numba-CUDA kernels of the `cuda` backend (docs/spec.md, arithmetic and portable bytes): the
general, row, tile and matmul kernels, gathered here for the backend and the paths (`K.k_quant`,
`K.launch`, ...).

By concern: `layouts.py` (the parameter arrays `P`, `F`, `RP`, `TP`, `MQ`, `OR`, one table each,
`_params.ParamLayout`, unique field names), `grids.py` (launch configuration: register caps, SM
count, grid-stride sizes), `devmath.py` (codes, words, group reductions), `scales.py` (the
round-up and scale words), and one module per kernel family: `k_general.py`, `k_rows.py`,
`k_tile.py`, `k_matmul.py`, `k_order.py` (docs/spec.md, field orders). The fast kernels are
in `fast.py`, the GEMV in `gemv.py`, the tensor-core GEMV in `tc.py`.

Kernels live at module level in modules that import `numba.cuda` at the top: the CUDA simulator
only swaps module-global names bound to `numba.cuda`, so kernels built in closures would not run
there (docs/numba-cuda.md). Every kernel is a grid-stride loop over work items (a run of
elements, a scale slot, ...), with 64-bit index arithmetic and one signature (`SIGNATURES`,
compiled for sm_90 and sm_75 by the tests). Minifloat codes are computed arithmetically with
`frexp`/`ldexp`, which are exact, so the same code runs in the simulator and on a GPU. Every
literal is cast (`int64(...)`, `float32(...)`): compiled numba and the simulator's NumPy scalars
promote differently otherwise.
"""
from __future__ import annotations

from .devmath import *  # noqa: E402,F401,F403
from .grids import jit_regs, launch, register_cap, resident_blocks, sm_count  # noqa: E402,F401
from .k_general import (  # noqa: E402,F401
    k_convert_f16, k_convert_f64, k_decode_scales, k_dequant, k_error_partials, k_fill2, k_first_extreme, k_quant,
    k_quant_fused, k_scales, k_slot_stats, k_take_extreme, k_tensor_range, k_tensor_stats, k_zero_stats,
)
from .k_order import k_reorder  # noqa: E402,F401
from .k_matmul import MM_BDX, MM_BDY, MM_COLS, MM_SH, k_matmul, k_zero, launch_matmul  # noqa: E402,F401
from .k_rows import (  # noqa: E402,F401
    ROW_TPB, code_int8, k_rows_dequant, k_rows_quant, k_wide_quant, k_wide_stats, launch_held, launch_rows,
    launch_wide, make_wide_quant, wide_kind,
)
from .k_tile import TILE_SH, TILE_SHW, TILE_WARPS, k_tile_quant, launch_tiles  # noqa: E402,F401
from .layouts import *  # noqa: E402,F401,F403

# Every kernel with every signature the backend launches it with (compiled for sm_90 by
# tests/cuda/test_cuda_platform.py::test_kernels_compile_for_sm90). The parameter arrays' types come
# from their layouts (layouts.py).
_P, _F, _RP, _TP, _MQ, _OR = (lay.arg for lay in (P_LAYOUT, F_LAYOUT, RP_LAYOUT, TP_LAYOUT, MQ_LAYOUT, OR_LAYOUT))
SIGNATURES: dict[str, list[str]] = {
    "k_convert_f16": ["void(float16[::1], float32[::1])"],
    "k_convert_f64": ["void(float64[::1], float32[::1])"],
    "k_tensor_stats": ["void(float32[::1], float32[::1], float64[::1], int32[::1])"],
    "k_error_partials": ["void(float32[::1], float32[::1], float64[::1], float64[::1], float32[::1])"],
    "k_slot_stats": [f"void(float32[::1], {_P}, float32[::1], float32[::1], int32[::1])"],
    "k_wide_stats": [f"void(uint32[::1], boolean, {_RP}, float32[::1], float32[::1], int32[::1])"],
    "k_wide_quant": [f"void(uint32[::1], boolean, {_RP}, {_F}, float32[::1], uint8[::1], int32[::1])"],
    "k_fill2": ["void(float32[::1], float32, float32)", "void(int64[::1], int64, int64)"],
    "k_tensor_range": ["void(float32[::1], float32[::1], int32[::1])"],
    "k_first_extreme": ["void(float32[::1], float32[::1], int64[::1])"],
    "k_take_extreme": ["void(float32[::1], int64[::1], float32[::1])"],
    "k_scales": [f"void(float32[::1], float64[::1], {_P}, {_F}, float32[::1], float32[::1], uint8[::1])"],
    "k_quant": [f"void(float32[::1], {_P}, {_F}, float32[::1], float32[::1], uint8[::1], int32[::1], float64[::1], "
                "float32[::1])"],
    "k_quant_fused": [f"void(float32[::1], {_P}, {_F}, uint8[::1], int32[::1])"],
    "k_decode_scales": [f"void(uint8[::1], {_P}, float32[::1], float32[::1])"],
    "k_dequant": [f"void(uint8[::1], {_P}, float32[::1], float32[::1], float32[::1], {t}[::1], int32[::1])"
                  for t in ("float32", "float16", "float64")],
    "k_matmul": [f"void(float32[::1], uint8[::1], uint32[::1], {_MQ}, float32[::1], float32[::1], float32[::1], "
                 "float32[::1])"],
    "k_zero": ["void(float32[::1])"],
    "k_reorder": [f"void(uint8[::1], uint8[::1], {_OR})"],
    "k_zero_stats": ["void(float64[::1], float32[::1])"],
    "k_tile_quant": [f"void(float32[::1], {_TP}, {_F}, uint32[::1], uint8[::1], uint8[::1], int32[::1], float32[::1], "
                     "float32[::1])"],
    "k_rows_quant": [f"void(float32[::1], {_RP}, {_F}, float32[::1], float32[::1], {w}[::1], uint8[::1], int32[::1], "
                     "float32[::1])" for w in ("uint32", "uint8")],
    "k_rows_dequant": [f"void({w}[::1], {_RP}, float32[::1], float32[::1], float32[::1], {t}[::1], int32[::1])"
                       for w in ("uint32", "uint8") for t in ("float32", "float16", "float64")],
}
