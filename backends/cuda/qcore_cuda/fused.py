"""A Triton GEMM that dequantizes the weight inside its main loop: `linear` for bfloat16 x and
result at prefill sizes (many rows of x), docs/spec.md's bfloat16-weight rule.

y[m, n] = round_bf16(sum_k x[m, k] * round_bf16(decode(q[n, k]) * e[n, k]) (+ bias[n])), the sum
in f32 on the tensor cores. A program computes one tile of `BN` weight rows by `BM` rows of x: per
`BK` columns of K it loads the tile's code bytes (one byte holds 1, 2 or 4 codes, element 0 in the
low bits: the `low` field order) and its f32 effective scales (one per slot: the decoded scales,
or a two-level weight's `k_effective` copy), decodes each code exactly to f32 (two's-complement
integers; E2M1, E4M3 and E5M2 by their bits), multiplies it by its scale (one f32 rounding) and
rounds the product to bfloat16 (nearest even): the weight value the rule allows. That tile [BN, BK]
is the A operand of `tl.dot` against x's tile transposed [BK, BM] (x read as it is, bfloat16),
accumulating in f32 over K in a fixed order, so results repeat bit for bit for the same shapes and
tile configuration. The bias is added in f32 and the sum rounded once to bfloat16.

The weight's bytes are read once per `BM` rows of x and never written in another form (the
dequantize-then-GEMM path writes and reads a bfloat16 copy of the whole weight per call).

Triton comes with torch's CUDA builds; `available()` says whether it imports. Under Triton's
interpreter (`TRITON_INTERPRET=1`, CPU tensors: the tests) the tile product runs in f32 on the same
bfloat16-exact values and the roundings to bfloat16 are done on the bits: the interpreter's
bfloat16 `tl.dot` gives wrong sums and its cast to bfloat16 cuts toward zero.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from . import fast
from .linear import LP_K, LP_LB, LP_N, LP_NSB, LP_WPR, parse_tune

__all__ = ["KINDS", "Tile", "TUNE_ENV", "available", "tile_for", "launch"]

KINDS = (fast.KIND_I8, fast.KIND_I4, fast.KIND_I2, fast.KIND_E4M3, fast.KIND_E5M2, fast.KIND_E2M1)
"""Value kinds (`fast.KINDS`) the kernel decodes: those of `linear.geometry`."""
TUNE_ENV = "QCORE_CUDA_FUSED_TUNE"
"""'BN,BM,BK,WARPS,STAGES,FORM' in the environment replaces `tile_for`'s choice (tuning runs)."""


@dataclass(frozen=True)
class Tile:
    """A launch configuration: weight rows `bn`, x rows `bm` and K columns `bk` per step of a
    program, its warps and software-pipeline stages."""

    bn: int
    bm: int
    bk: int
    warps: int
    stages: int
    form: int = 3


def tile_for(m: int) -> Tile:
    """The tile for m rows of x (or `TUNE_ENV`'s). Wide tiles keep the weight's decode per FLOP
    low; at few rows the x side narrows so that the programs still fill the GPU."""
    text = os.environ.get(TUNE_ENV)
    if text:
        return Tile(*parse_tune(TUNE_ENV, text, "BN,BM,BK,WARPS,STAGES,FORM"))
    return Tile(128, 128, 32, 8, 3, 3)


@lru_cache(maxsize=1)
def available() -> bool:
    """Whether Triton imports (it comes with torch's CUDA builds)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # (an install without a working compiler raises more than ImportError)
        return False
    return True


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def launch(kind: int, P: Any, x: Any, codes: Any, scales: Any, bias: Any, y: Any, tile: Tile | None = None) -> None:
    """y [M, N] = x [M, K] @ W^T (+ bias) for the weight of `linear.geometry`'s (kind, P): `codes`
    its values section as bytes (uint8, N rows of `LP_WPR` u32 words), `scales` one f32 per slot,
    `bias` [N] bfloat16 or None; x and y bfloat16 torch tensors, C-contiguous, on one device
    (CPU tensors under the interpreter); launched on torch's current stream."""
    m, k_ = x.shape
    n_ = int(P[LP_N])
    assert int(P[LP_K]) == k_ and tuple(y.shape) == (m, n_) and kind in KINDS
    nsb, lb = int(P[LP_NSB]), int(P[LP_LB])
    block = 0 if nsb <= 1 else 16 << lb
    t = tile or tile_for(m)
    per = 8 // fast.KIND_BITS[kind]
    if t.form == 4:  # (a field's product needs 16 columns; a step reads one or two scale slots)
        bk = max(16 * per, min(t.bk, 2 * block) if block else t.bk)
        t = replace(t, bk=bk) if k_ % bk == 0 and not (block and bk > 2 * block) else replace(t, form=3)
    if k_ % t.bk:  # (K is a multiple of 32: `linear.geometry`)
        t = replace(t, bk=32)
    if t.form == 4 and per > 1:  # (each step's columns grouped by field: k0 + PER * j + f at f * BK / PER + j)
        x = x.reshape(m, k_ // t.bk, t.bk // per, per).transpose(2, 3).contiguous().reshape(m, k_)
    grid = (-(-m // t.bm) * -(-n_ // t.bn),)
    from .k_fused import fused_linear

    fused_linear[grid](x, codes, scales, bias if bias is not None else y, y, m, n_, k_, 4 * int(P[LP_WPR]), nsb,
                       KIND=kind, BITS=fast.KIND_BITS[kind], B=block, HAS_BIAS=bias is not None,
                       BN=t.bn, BM=t.bm, BK=t.bk, FORM=t.form, INTERPRETED=_interpreted(), num_warps=t.warps,
                       num_stages=t.stages)
