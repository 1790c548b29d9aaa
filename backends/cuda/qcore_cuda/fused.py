"""A GEMM that dequantizes the weight inside its main loop (Triton; Gluon on a Hopper GPU): `linear`
for bfloat16 x and result at prefill sizes (many rows of x), docs/spec.md's bfloat16-weight rule.

y[m, n] = round_bf16(sum_k x[m, k] * round_bf16(decode(q[n, k]) * e[n, k]) (+ bias[n])), the sum
in f32 on the tensor cores. A program computes one tile of `BN` weight rows by `BM` rows of x: per
step of `BK` columns it loads the tile's code bytes (one byte holds 1, 2 or 4 codes, element 0 in
the low bits: the `low` field order) and its f32 effective scales (one per slot: the decoded
scales, or a two-level weight's `k_effective` copy), decodes each code exactly to f32 (integers by
the 2**23 exponent trick; E2M1, E4M3 and E5M2 by their bits), multiplies it by its scale (one f32
rounding) and rounds the product to bfloat16 (nearest even): the weight value the rule allows. The
tile of those values meets x's (read as it is, bfloat16) in `tl.dot`, f32 sums over K in an order
fixed by the shapes and the tile, so results repeat bit for bit. The bias is added in f32 and the
sum rounded once to bfloat16.

For float16 x and result (docs/spec.md's float16-weight rule) the same kernels run in float16: the
scales come times 2**p (`f16_scales`, `f16_shift`: p from the weight's largest magnitude, so every value
`round_f16(decode(q) * e * 2**p)` lies within float16's range), the tile product in float16, and
the f32 sums are multiplied by `unscale` = 2**-p before the bias is added and the sum rounded to
float16.

Two forms of the loop (k_fused.py): `FORM_FIELDS` loads each code byte once and takes each field
of the bytes (every PER-th column) as its own product, against x's columns grouped by field (a
copy of x made per call with each step's columns reordered); `FORM_COLUMNS` builds the weight
tile in column order, each element loading its byte (any step, blocks of 16 with 2-bit codes
included). `FORM_STAGED` (k_staged.py, Gluon, a Hopper GPU) decodes each step's tile into shared
memory in column order and multiplies it from there by asynchronous `wgmma`, the decode of the next
step overlapping the product of this one; x is read as it is. `tile_for` picks the form and tile
by rows of x; `step_for` falls back from the staged form to the fields form and from that to the
columns form where a step cannot be formed. `FusedLaunch` holds one weight's launch for m rows of
x (tile, grid, kernel, constants) and, after its first call, the kernel Triton's JIT compiled,
which later calls launch directly (`paths.linear` keeps one per weight, rows and bias kind).

The weight's bytes are read once per `BM` rows of x and never written in another form (the
dequantize-then-GEMM path writes and reads a bfloat16 copy of the whole weight per call).

Triton comes with torch's CUDA builds; `available()` says whether it imports. Under Triton's
interpreter (`TRITON_INTERPRET=1`, CPU tensors: the tests) the tile product runs in f32 on the same
bfloat16-exact values and the roundings to bfloat16 are done on the bits: the interpreter's
bfloat16 `tl.dot` gives wrong sums and its cast to bfloat16 cuts toward zero.
"""
from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from . import fast
from .grids import sm_count
from .linear import LP_K, LP_LB, LP_N, LP_NSB, LP_WPR, parse_tune

__all__ = ["KINDS", "INT_KINDS", "FORM_COLUMNS", "FORM_FIELDS", "FORM_STAGED", "STAGED_SHARED", "LAUNCHED", "Tile",
           "TUNE_ENV", "FIELDS_MAX_M", "available", "staged_available", "staged_ready", "step_for",
           "tile_for", "block_of", "F16_SHIFT_MOST", "f16_shift", "f16_scales", "PLAN_FROM_M", "FILL_MIN", "fills",
           "SMALL_F16_FROM_M", "plan_takes", "plan_tile", "plan_runs", "FusedLaunch", "launch"]

KINDS = (fast.KIND_I8, fast.KIND_I4, fast.KIND_I2, fast.KIND_E4M3, fast.KIND_E5M2, fast.KIND_E2M1)
"""Value kinds (`fast.KINDS`) the kernels decode: those of `linear.geometry`."""
INT_KINDS = (fast.KIND_I8, fast.KIND_I4, fast.KIND_I2)
"""The integer kinds (`plan_takes`)."""
FORM_COLUMNS, FORM_FIELDS, FORM_STAGED = 1, 2, 3
"""The loop's forms (module text; `FORM_STAGED`: k_staged.py)."""
STAGED_SHARED = 227 * 1024
"""The most shared memory a program of `FORM_STAGED` may take (a Hopper SM's limit for one block):
its x and code-byte rings and two bfloat16 tiles."""
LAUNCHED: Counter = Counter()
"""How often each loop form ran in this process (`FusedLaunch`; the tests read it)."""
TUNE_ENV = "QCORE_CUDA_FUSED_TUNE"
"""'BN,BM,BK,WARPS,STAGES,FORM' in the environment replaces `tile_for`'s choice (tuning runs)."""


@dataclass(frozen=True)
class Tile:
    """A launch configuration: weight rows `bn`, x rows `bm` and K columns `bk` per step of a
    program, its warps, software-pipeline stages and loop form."""

    bn: int
    bm: int
    bk: int
    warps: int
    stages: int
    form: int = FORM_FIELDS


FIELDS_MAX_M = 128
"""The most rows of x the plan gives the fields form (`tile_for`); more take the staged form, so
the plan takes this GEMM past them only where that form runs (`staged_ready`)."""


def tile_for(m: int, staged: bool = True) -> Tile:
    """The tile for m rows of x (or `TUNE_ENV`'s), the fastest of those timed at each size (H100,
    8192 x 8192, docs/performance.md): the fields form's 64 x 64 up to 64 rows, then where `staged`
    (a Hopper GPU with Gluon: `staged_ready`) the staged form's 64 weight rows by 128 rows of x on
    four warps up to 128 rows and by 256 on eight beyond, in steps of 64 columns, a ring of four;
    where not, the fields form's 64 x 64 up to `FIELDS_MAX_M` rows and 128 x 128 beyond (tuning
    runs)."""
    text = os.environ.get(TUNE_ENV)
    if text:
        t = Tile(*parse_tune(TUNE_ENV, text, "BN,BM,BK,WARPS,STAGES,FORM"))
        if t.form not in (FORM_COLUMNS, FORM_FIELDS, FORM_STAGED):
            raise ValueError(f"{TUNE_ENV}={text!r}: FORM is {FORM_COLUMNS} (columns), {FORM_FIELDS} (fields) or "
                             f"{FORM_STAGED} (staged)")
        return t
    if m <= (64 if staged else FIELDS_MAX_M):  # (65 to 80 rows: two of the fields form's row tiles)
        return Tile(64, 64, 64, 4, 4)
    if not staged:
        return Tile(128, 128, 64, 8, 3)
    return Tile(64, 128, 64, 4, 4, FORM_STAGED) if m <= 128 else Tile(64, 256, 64, 8, 4, FORM_STAGED)


def block_of(P: Any) -> int:
    """The scale block's columns of `linear.geometry`'s P (0: one slot a row or for the tensor)."""
    nsb, lb = int(P[LP_NSB]), int(P[LP_LB])
    return 0 if nsb <= 1 else 16 << lb


PLAN_FROM_M = {fast.KIND_I8: 48, fast.KIND_I4: 48, fast.KIND_I2: 48, fast.KIND_E2M1: 64}
"""The fewest rows of x at which the plan (`paths.linear.FusedGemmLinear`) takes this GEMM, per
value kind it takes (`plan_takes`): where it was timed faster than the paths it replaces (H100,
docs/performance.md; E2M1 at 48 rows: the tensor-core kernel)."""


FILL_MIN = 0.9
"""The fewest 64-row weight tiles per SM (`fills`) at which the plan takes this GEMM for bfloat16 x
(the tensor-core kernel and dequantize + cuBLAS are the alternatives)."""


SMALL_F16_FROM_M = 65
"""The fewest rows of float16 x at which the plan takes this GEMM for a weight `fills` rejects (no
library path takes float16; the tensor-core kernel is faster below). H100, 4096 x 4096,
q4s/block32:f16, float16 x (docs/performance.md): the tensor-core kernel 30.0 / 32.5 / 59.0 /
112.7 us at M = 48 / 64 / 128 / 256 against 44.2 / 44.1 / 41.3 / 48.1 us here."""


def fills(n: int) -> bool:
    """Whether a weight of n rows fills the GPU with this GEMM's 64-row tiles: at least `FILL_MIN`
    tiles per SM of the current device (`grids.sm_count`). By measurement (H100, 132 SMs, 64 to
    256 rows of bfloat16 x, q4s/block32:f16, q8s/block32:f16, mxfp4, docs/performance.md): 8192
    rows (128 tiles) 0.56-0.62x torch bf16 against 0.38-0.42x for dequantize + cuBLAS; 4096 rows
    (64 tiles) at most 0.50x, every tile timed, against 0.47-0.53x; at 48 rows there 0.37-0.38x
    against the tensor-core kernel's 0.52x (mxfp4, the same run)."""
    return -(-n // 64) >= FILL_MIN * sm_count()


def plan_takes(kind: int, block: int, m: int) -> bool:
    """Whether the plan takes this GEMM for m rows of x and weights of `kind` with scale blocks of
    `block` columns: integer codes, and E2M1 codes in blocks of 32 or more (mxfp4), from
    `PLAN_FROM_M` rows (`paths.linear.FUSED_M` bounds the rest). Not E2M1 in blocks of 16 (nvfp4: a
    scale gathered per code byte, slower in the same runs) nor the 8-bit minifloats (not timed)."""
    if kind == fast.KIND_E2M1 and block < 32:
        return False
    return m >= PLAN_FROM_M.get(kind, 1 << 62)


def plan_tile(m: int, kind: int, k: int, block: int, device: Any) -> Tile:
    """The tile `FusedLaunch` runs without a tile given: `tile_for`'s, through `step_for`."""
    staged = staged_ready(device)
    return step_for(tile_for(m, staged), kind, k, block, staged)


def plan_runs(m: int, kind: int, k: int, block: int, device: Any, f16: bool = False) -> bool:
    """Whether `plan_tile` runs as timed: any form up to `FIELDS_MAX_M` rows of x, past them only
    the staged form for bfloat16 x (the fields form was slower there than dequantize + cuBLAS),
    any form for float16 x (no library path; the fields form's 128 x 128 tile 2.6-3.5x faster than
    the tensor-core kernel at 256-2048 rows on an H100, docs/performance.md), and any form where
    `TUNE_ENV` names the tile (tuning runs take it as it falls)."""
    return (m <= FIELDS_MAX_M or f16 or bool(os.environ.get(TUNE_ENV))
            or plan_tile(m, kind, k, block, device).form == FORM_STAGED)


F16_SHIFT_MOST = 100
"""The largest |p| `f16_shift` gives (2**p and 2**-p normal f32 values)."""


def f16_shift(top: float) -> int | None:
    """p of docs/spec.md's float16-weight rule for a weight whose largest magnitude is `top` to
    within 2**-8 (a bfloat16 dequantize's largest): 2**p * top in [2**13, 2**14), so 2**p * max|W|
    lies in [2**12, 2**15]; 0 for an all-zero weight; None where |p| would pass `F16_SHIFT_MOST`
    (the kernels then do not take the weight in float16)."""
    if top == 0.0:
        return 0
    if not math.isfinite(top):
        return None
    p = 14 - math.frexp(top)[1]
    return p if abs(p) <= F16_SHIFT_MOST else None


def f16_scales(scales: Any, p: int) -> Any:
    """The effective scales (a torch f32 tensor) times 2**p, as the float16 launches read them:
    exact in f32 (a product below f32's normal range makes values far below float16's smallest).
    A product past f32's range is held at its largest finite value: only a slot whose codes all
    decode to 0 can have one (a nonzero code is at least 2**-16, and 2**p * |W| <= 2**15), and
    0 * inf would be NaN."""
    import torch

    big = float(torch.finfo(torch.float32).max)
    return torch.clamp(scales * (2.0 ** p), -big, big)


@lru_cache(maxsize=1)
def available() -> bool:
    """Whether Triton imports (it comes with torch's CUDA builds)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # (an install without a working compiler raises more than ImportError)
        return False
    return True


def interpreted() -> bool:
    """Whether Triton runs its kernels in its interpreter (`TRITON_INTERPRET`: the tests, on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@lru_cache(maxsize=1)
def staged_available() -> bool:
    """Whether `FORM_STAGED`'s Gluon kernel imports (Triton 3.5 and later)."""
    try:
        from . import k_staged  # noqa: F401
    except Exception:  # (an older Triton lacks Gluon or one of the Hopper builtins the kernel takes)
        return False
    return True


def staged_ready(device: Any) -> bool:
    """Whether `FORM_STAGED` runs for x on this torch device: a Hopper GPU (`wgmma` is sm_90's
    alone), outside the interpreter, with the kernel importable."""
    return (device.type == "cuda" and not interpreted() and _capability(device)[0] == 9
            and staged_available())


def step_for(t: Tile, kind: int, k: int, block: int, staged_ok: bool = True) -> Tile:
    """The tile `FusedLaunch` runs for a weight of `kind` with K columns and scale blocks of `block`
    columns (0: one slot a row or for the tensor): `FORM_STAGED` where `staged_ok` (a Hopper GPU,
    Gluon), its step dividing K with at least 32 code bytes a row, its x rows a power of two from
    64 to 256, its weight rows 16 a warp (or 64 of them on 8 warps, x's rows then split between
    two warpgroups, at least 128) and its buffers within `STAGED_SHARED`; else
    `FORM_FIELDS`, a step of at least 16 columns a field and at most two scale slots, dividing K;
    else `FORM_COLUMNS`, whose step divides K (K is a multiple of 32: `linear.geometry`)."""
    per = 8 // fast.KIND_BITS[kind]
    if t.form == FORM_STAGED:
        bk = max(t.bk, 32 * per)
        shared = t.stages * (t.bm * bk * 2 + t.bn * bk // per) + 2 * t.bn * bk * 2
        rows_ok = t.bn % (16 * t.warps) == 0 or (t.bn == 64 and t.bm >= 16 * t.warps)  # (k_staged._x_groups)
        if (staged_ok and k % bk == 0 and t.bm in (64, 128, 256) and rows_ok
                and t.warps in (4, 8) and t.stages >= 3 and shared <= STAGED_SHARED):
            return replace(t, bk=bk)
        t = replace(t, form=FORM_FIELDS)
    if t.form == FORM_FIELDS:
        bk = max(16 * per, min(t.bk, 2 * block) if block else t.bk)
        if k % bk == 0 and not (block and bk > 2 * block):
            return replace(t, bk=bk)
        t = replace(t, form=FORM_COLUMNS)
    return t if k % t.bk == 0 else replace(t, bk=32)


class FusedLaunch:
    """The GEMM for one weight's (kind, P) of `linear.geometry` and m rows of x, decided once: the
    plan's tile (`plan_tile`, or `step_for` of `tile`), its grid, kernel and constants. A call
    launches it on torch's current stream. The first call goes through Triton's JIT (argument
    specialization, compile cache) and keeps the compiled kernel; later calls whose five tensors
    start on 16-byte boundaries, as the first call's did, launch that kernel directly, as the JIT
    would (the same kernel and arguments; Triton's launch hooks still called): a repeat call's
    host time is then the launch's alone."""

    def __init__(self, kind: int, P: Any, m: int, device: Any, tile: Tile | None = None,
                 has_bias: bool = False, f16: bool = False, unscale: float = 1.0) -> None:
        assert kind in KINDS
        self.m, self.n, self.k = m, int(P[LP_N]), int(P[LP_K])
        block = block_of(P)
        t = step_for(tile, kind, self.k, block, staged_ready(device)) if tile else plan_tile(m, kind, self.k, block,
                                                                                              device)
        self.tile = t
        self.grid = (-(-m // t.bm) * -(-self.n // t.bn),)
        self.sizes = (m, self.n, self.k, 4 * int(P[LP_WPR]), int(P[LP_NSB]), float(unscale))  # (and the
        # sums' multiplier: positional, after the sizes)
        self.per = 8 // fast.KIND_BITS[kind]
        self.regroup = t.form == FORM_FIELDS and self.per > 1  # (each step's column k0 + PER * j + f moved
        # to k0 + f * BK / PER + j: a copy of x per call)
        const = dict(KIND=kind, BITS=fast.KIND_BITS[kind], B=block, HAS_BIAS=has_bias, F16=f16, BN=t.bn, BM=t.bm,
                     BK=t.bk)
        if t.form == FORM_STAGED:
            from . import k_staged

            self.kernel, self.const = k_staged.fused_staged, const | dict(STAGES=t.stages, num_warps=t.warps)
        else:
            from . import k_fused

            self.kernel = k_fused.fused_fields if t.form == FORM_FIELDS else k_fused.fused_columns
            self.const = const | dict(INTERPRETED=interpreted(), num_warps=t.warps, num_stages=t.stages)
        self.kept = KeptKernel(self.const, 5 + len(self.sizes))  # (the five tensors and the sizes, by position)

    def __call__(self, x: Any, codes: Any, scales: Any, bias: Any, y: Any) -> None:
        """y [m, N] = x [m, K] @ W^T (+ bias): `codes` the weight's values section as bytes (uint8,
        N rows of `LP_WPR` u32 words), `scales` one f32 per slot (times 2**p for float16: the
        module text), `bias` [N] of x's dtype or None (as the launch was made: `has_bias`); x and
        y bfloat16 (float16 for a launch made with `f16`) torch tensors, C-contiguous, on one
        device (CPU tensors under the interpreter)."""
        assert tuple(x.shape) == (self.m, self.k) and tuple(y.shape) == (self.m, self.n)
        LAUNCHED[self.tile.form] += 1
        if self.regroup:
            bk, per = self.tile.bk, self.per
            x = x.reshape(self.m, self.k // bk, bk // per, per).transpose(2, 3).contiguous().reshape(self.m, self.k)
        tensors = (x, codes, scales, bias if bias is not None else y, y)
        self.kept.launch(self.kernel, self.grid, tensors + self.sizes, all(a.data_ptr() % 16 == 0 for a in tensors))


class KeptKernel:
    """A Triton kernel's launches with constants `const` after `given` arguments passed by
    position: the first call whose tensors start on 16-byte boundaries goes through the JIT
    (argument specialization, compile cache) and its compiled kernel is kept; later such calls
    launch it directly (`launch_compiled`: the same kernel and arguments, Triton's launch hooks
    still called), so a repeat's host time is the launch's. A call with a tensor off a boundary
    goes through the JIT (its specialization differs)."""

    def __init__(self, const: dict, given: int) -> None:
        self.const, self.given = const, given
        self.compiled: Any = None  # (the JIT's kernel, once a call with aligned tensors made it)
        self.tail: tuple = ()  # (the constants in the kernel's parameter order, after the given arguments)

    def launch(self, kernel: Any, grid: tuple, args: tuple, aligned: bool) -> None:
        """`kernel[grid](*args, **const)` on torch's current stream, directly where it can be."""
        if self.compiled is not None and aligned:
            launch_compiled(self.compiled, grid, args + self.tail)
            return
        compiled = kernel[grid](*args, **self.const)
        if aligned and self.compiled is None:
            tail = launch_tail(kernel, compiled, self.given, self.const)
            if tail is not None:
                self.compiled, self.tail = compiled, tail


def launch_tail(kernel: Any, compiled: Any, given: int, const: dict) -> tuple | None:
    """The values of `kernel`'s parameters after its first `given` (passed by position) from
    `const`, in order, for `launch_compiled`; None where `compiled` cannot be launched directly
    (the interpreter's kernel, or a parameter past `given` that `const` lacks)."""
    names = list(getattr(kernel, "arg_names", ()))
    rest = names[given:]
    if (len(names) < given or any(r not in const for r in rest)
            or not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata", "launch_metadata"))):
        return None
    return tuple(const[r] for r in rest)


def launch_compiled(compiled: Any, grid: tuple, args: tuple) -> None:
    """A kernel Triton's JIT compiled, launched with every parameter's value in order on the
    current device's current stream (torch's), as `JITFunction.run` launches it."""
    from triton import knobs
    from triton.runtime import driver

    device = driver.active.get_current_device()
    stream = driver.active.get_current_stream(device)
    meta = compiled.launch_metadata(grid, stream, *args)
    compiled.run(grid[0], 1, 1, stream, compiled.function, compiled.packed_metadata, meta,
                 knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *args)


def launch(kind: int, P: Any, x: Any, codes: Any, scales: Any, bias: Any, y: Any, tile: Tile | None = None,
           unscale: float = 1.0) -> None:
    """y [M, N] = x [M, K] @ W^T (+ bias) for the weight of `linear.geometry`'s (kind, P) through a
    `FusedLaunch` made for this call (the plan's tile, or `tile` through `step_for`; float16 where
    x is); the arguments as its call takes them."""
    import torch

    FusedLaunch(kind, P, x.shape[0], x.device, tile, bias is not None, x.dtype == torch.float16,
                unscale)(x, codes, scales, bias, y)


@lru_cache(maxsize=None)
def _capability(device: Any) -> tuple[int, int]:
    import torch

    return torch.cuda.get_device_capability(device)
