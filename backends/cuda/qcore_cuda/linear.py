"""Tensor-core `linear` over a weight [N, K] as checkpoints store it (codes along K, scale blocks
along K): `y[m, n] = sum_k x[m, k] * decode(w[n, k]) * e[n, k] (+ bias[n])`, x in bfloat16,
float16 or float32, the result in float32, float16 or bfloat16.

Arithmetic (docs/spec.md, "Products with a quantized weight"). The codes of every 2-, 4- and 8-bit
value kind are exact in float16 and in bfloat16, so the weight is the A operand of
`mma.sync.m16n8k16` in x's type (bf16 or f16, f32 accumulate) with no scale in it: each product is
exact. A 32-k chunk of a row lies under one scale slot (blocks along K of 32 * 2**j, a block of at
least K, or one scale for the tensor) or, under blocks of 16, two; its two mma steps sum into zeroed
accumulators and the thread then adds `e * partial` (f32) to its sums: the scale multiplies the f32
sum of one block's terms, as the spec allows. Under blocks of 16 (nvfp4's) a chunk holds two slots:
lanes t = 0, 1 hold its first 16 codes, lanes 2 and 3 the second (below), so the chunk takes each
half in turn, its two mma steps with B zero in the other half's lanes (A is finite: a decoded code),
then `acc += e * partial` with that half's slot (a `split` variant: four mma steps per chunk). `e`
is read as one f32 per slot: the decoded scales, or for a two-level weight its effective scales
(`k_effective`, made once and kept with the weight). float32 x enters as three bfloat16 parts per
element, each the next 8 significant bits of x, cut by truncation (`x = hi + mid + lo` exactly for
normal parts; truncation never rounds up past the largest float), and the three mma products add
into the same accumulators. Nothing is added with atomics: the warps' sums meet in shared memory and
are added in warp order, so results repeat bit for bit.

Fragments. Lane (g, t) of a warp holds rows g and g + 8 of the block's 16-row tile; in chunk c
it reads the u32 word(s) of codes 8t .. 8t + 7 of the chunk (one word of 4-bit codes, two of
8-bit), so a warp instruction reads 16 rows x 16 (or 32) contiguous bytes. The sum over k does
not care which k sits in which mma position, as long as A and B agree: position pair p of the
lane (A/B register halves) is codes (8t + p, 8t + p + 4), p = 0..3, which is one shift of a
word of 4-bit codes (`code4_bf16x2` and friends read bits 0-3 and 16-19) and one byte permute of
two words of 8-bit codes; step 0 of the chunk takes pairs 0 and 1, step 1 pairs 2 and 3. 2-bit
codes: lanes t = 2i and 2i + 1 read word i of the chunk's two and take its low and high 16 bits,
widened to a word of 4-bit codes (`widen2`: the same values), which the 4-bit decoders read. B is
x's rows m0 + 8j + g (j < NB), whose 8 values at the same k are one 16-byte load, permuted into
the same pairs. `U` chunks' code words are loaded before any of them is used, so a warp keeps
U * 16 bytes per row in flight; the loop over whole groups of U chunks has no bounds checks (a
warp's last chunks run one by one), and the lane's offsets into its rows of w, of the scales and
of x are computed once: a chunk's scale slot is found in 32-bit arithmetic and read by one wide
multiply-add onto its row's address (`ld1_at`).

The wide form (`wide_for`: 4-bit codes in unsplit chunks, one tile of w, few rows of x) keeps 2 U
chunks in flight and loads them whole: a lane of a load instruction reads 16 contiguous bytes (one
chunk) of one of the group's rows, so at U = 4 a warp instruction reads 4 rows x 128 bytes (the
direct loads: 8 rows x 16 bytes), stores them to the warp's part of shared memory (chunk u of row
g of a matrix at 16-byte slot g ^ (u << swz), so neither the stores nor `ldmatrix` meet a bank
conflict) and takes them back with `ldmatrix` (`ldsm4`: a matrix is one chunk of 8 rows, whose row
g's word t goes to lane (g, t), the lane's word of the direct loads). The same words, the same bits.

Tiles of w (`rt_for`). A warp takes RT = 1 or 2 tiles of 16 rows of w (rows 16 r + g and 16 r + g + 8
of the block's for lane (g, t)); each chunk's B pairs of x are loaded once and multiplied with
every tile, so x's reads through L1 (at M = 16 four times the weight's bytes with one tile) are
divided by RT. Each output's terms, their order and its scale steps are those of one tile: the
same bits. With two tiles a lane keeps U / 2 chunks in flight per row (the same code words as
one tile at U).

Grid: (ceil(N / (16 RT)), ceil(M / (8 NB))) blocks (NB = 1, 2 or 4: `nb_for`) of `WARPS` warps; the warps split
the chunks of K into contiguous ranges (`plan`). Under the simulator every warp runs the same number of steps
(its mma twin needs every thread of the block at each call); steps past a warp's range read
chunk 0 with B zero.

Eligible (`applies`): a 2-D weight of 2-, 4- or 8-bit integer or minifloat codes (Q8*, Q4*, Q2*,
E4M3, E5M2, E2M1; no offsets, no lookup table) in the `low` field order, packed along K (Native, or
packed along the last axis), K a multiple of 32, one scale for the tensor, or blocks that span
one row each along K: 16 * 2**j elements, or at least K. Slots are found from 16-column halves
of a chunk: half h of row n lies in slot `n * NSB + (h >> LB)`.
"""
from __future__ import annotations

import os
from functools import lru_cache

import numpy as np

from qcore.spec.schemes import QuantScheme, StoreKind

from . import fast
from ._params import ParamLayout
from .devmath import two_level_e
from .intrin import (code4s_bf16x2, code4s_f16x2, e2m1x2_bf16x2, e2m1x2_f16x2, e4m3x2_f16x2, e5m2x2_f16x2, f16_bits,
                     f16x2_bf16x2, f2u, i8x2_f16x2, ld1, ld1_at, ld2, ld4, ldsm4, mma_bf16, mma_f16, prmt, shr_u32,
                     sts4, u2f, warp_sync)

from numba import config, cuda, float32, int64, uint16, uint32  # noqa: E402

XT_BF16, XT_F16, XT_F32 = range(3)
"""x's type as the kernel reads it: bfloat16 or float16 bits (u32 pairs), float32 (split in three)."""
OT_F32, OT_F16, OT_BF16 = range(3)
"""The result's type: float32, or float16 / bfloat16 bits."""
KINDS = (fast.KIND_I8, fast.KIND_I4, fast.KIND_I2, fast.KIND_E4M3, fast.KIND_E5M2, fast.KIND_E2M1)
"""Value kinds (`fast.KINDS`) the kernel decodes."""
TUNE_ENV = "QCORE_CUDA_LINEAR_TUNE"
"""'WARPS,U' in the environment replaces the defaults below on a GPU (tuning runs); read at import."""


def parse_tune(env: str, text: str, fields: str) -> tuple[int, ...]:
    """A kernel's tuning from the value `text` of the environment variable `env`: one positive
    integer per comma-separated name of `fields` ('WARPS,U'); a one-line ValueError otherwise."""
    n = len(fields.split(","))
    try:
        v = tuple(int(t) for t in text.split(","))
    except ValueError:
        v = ()
    if len(v) != n or min(v) < 1:
        raise ValueError(f"{env}={text!r}: write {fields} ({n} positive integers)")
    return v


WARPS, U = (2, 2) if config.ENABLE_CUDASIM else parse_tune(TUNE_ENV, os.environ.get(TUNE_ENV, "8,4"), "WARPS,U")
"""Warps a block and chunks in flight a lane: 8, 4 on a GPU; under the simulator 2, 2 (its cost is
per thread, and two warps still add their sums across warps)."""
SIM_GPU_LOOP = False
"""Under the simulator, compile the GPU's chunk loop instead of the simulator's lockstep one (tests:
with K giving every warp the same number of chunks, its mma twin meets every thread at each call)."""
NBS = (1, 2, 4)
"""Variants: x rows per pass, in n8 tiles (8, 16 or 32 rows)."""
SCR = 384  # simulator: f32 scratch per warp for the mma twin
REGS_ENV = "QCORE_CUDA_LINEAR_REGS"
"""The register cap in the environment replaces `REGS` on a GPU (tuning runs); read at import."""
REGS = 128 if config.ENABLE_CUDASIM else int(os.environ.get(REGS_ENV, "128") or 128)
"""ptxas's register cap (-maxrregcount) for every variant; with `WARPS` it sets the blocks a SM holds
(at 128 and 8 warps: two, 16 warps a SM)."""
LP_LAYOUT = ParamLayout("LP", "int64", [
    ("LP_N", "rows of the weight (output columns)"),
    ("LP_K", "columns of the weight (the reduction extent)"),
    ("LP_M", "rows of x (set per launch: `plan`)"),
    ("LP_NSB", "scale slots per row of the weight (0: one for the tensor)"),
    ("LP_LB", "half chunk (16 columns) -> slot shift (0: blocks of 16; 62: one slot per row or tensor)"),
    ("LP_TWO", "1: two-level"),
    ("LP_WPR", "u32 words of codes per row"),
    ("LP_CPW", "chunks per warp (set per launch)"),
    ("LP_OT", "the result's type: OT_F32, OT_F16 or OT_BF16 (set per launch)"),
    ("LP_BIAS", "1: add the bias (set per launch)"),
], length_name="LP_LEN")
"""LP: the linear kernel's int64 parameters (`geometry`, completed per launch by `plan`)."""
LP_LAYOUT.define(globals())


def geometry(shape: tuple[int, ...], scheme: QuantScheme) -> tuple[int, np.ndarray] | None:
    """(value kind, P without M, CPW, OT and the bias flag) for a [N, K] weight, or None when
    the kernel does not apply (module text)."""
    if len(shape) != 2 or scheme.affine or scheme.is_lookup:
        return None
    kind = fast.KINDS.get(scheme.value)
    if kind not in KINDS:
        return None
    n_, k_ = shape
    if k_ % 32 or k_ == 0 or n_ == 0:
        return None
    store = scheme.store
    if store.kind is not StoreKind.NATIVE and store.dim != 0:
        return None
    if store.order.value != "low":  # (the backend hands kernels the `low` order: `kernel_data`)
        return None
    if scheme.block is None:
        nsb, lb = 0, 62
    else:
        if scheme.block.flat:
            return None
        dims = scheme.block.dims
        if len(dims) == 2 and dims[0] != 1:
            return None
        b = dims[-1]
        if b >= k_:
            nsb, lb = 1, 62
        elif b % 16 == 0 and (b // 16) & (b // 16 - 1) == 0:  # (a row's last block may be partial)
            nsb, lb = -(-k_ // b), (b // 16).bit_length() - 1
        else:
            return None
    return kind, LP_LAYOUT.pack(LP_N=n_, LP_K=k_, LP_WPR=k_ * fast.KIND_BITS[kind] // 32,
                                LP_TWO=1 if scheme.two_level else 0, LP_NSB=nsb, LP_LB=lb)


def split(P: np.ndarray) -> bool:
    """Whether a 32-k chunk of `geometry`'s weight holds two scale slots (blocks of 16): the
    kernels' `split` variants."""
    return int(P[LP_LB]) == 0


def plan(P: np.ndarray, m: int, nb: int, out_type: int, has_bias: bool,
         rt: int = 1) -> tuple[tuple, tuple[int, int], tuple[int]]:
    """(P as the kernel's tuple, grid, block) for m rows of x with `nb` n8 tiles per pass and `rt`
    16-row tiles of w a warp."""
    nch = int(P[LP_K]) // 32
    q = LP_LAYOUT.replace(P, LP_M=m, LP_CPW=-(-nch // WARPS), LP_OT=out_type, LP_BIAS=int(has_bias))
    grid = (-(-int(q[LP_N]) // (16 * rt)), -(-m // (8 * nb)))
    return tuple(int(v) for v in q), grid, (32 * WARPS,)


def nb_for(m: int) -> int:
    """n8 tiles per pass for m rows of x: the fewest that hold m, at most four."""
    return 1 if m <= 8 else 2 if m <= 16 else 4


TILES_ENV = "QCORE_CUDA_LINEAR_TILES"
"""1 or 2 in the environment: the 16-row tiles of w a warp wherever two-tile variants exist,
whatever `rt_for` would pick (tuning runs); read at import."""
TILES = int(os.environ.get(TILES_ENV, "0") or 0)
if TILES not in (0, 1, 2):
    raise ValueError(f"{TILES_ENV}={TILES}: write 1 or 2")
RT_NBS = (1, 2)
"""n8 tiles of x of the two-tile variants (four n8 tiles with two tiles of w pass the register
cap)."""
RT_KINDS = (fast.KIND_I4, fast.KIND_E2M1)
"""Value kinds that take two tiles by default. By measurement (H100, below): 4-bit codes gain from
5 rows of x on; 8-bit codes (two words a lane a chunk) lose at every M, 2-bit are not timed."""
RT_M = (5, 16)
"""Rows of x (first, last) that take two tiles by default: at 2 and 4 rows they lost on 28672 x 8192."""
RT_FILL = 0.9
"""Two tiles of w a warp only where their blocks fill at least this many of the GPU's resident
block slots (`grids.resident_blocks` a SM): fewer, larger blocks leave SMs idle on a small weight."""


WIDE_ENV = "QCORE_CUDA_LINEAR_WIDE"
"""The most rows of x of the wide form in the environment (0: never), replacing `WIDE_M` at import."""
_WIDE_TEXT = os.environ.get(WIDE_ENV, "4")
if not _WIDE_TEXT.isdigit():
    raise ValueError(f"{WIDE_ENV}={_WIDE_TEXT!r}: write the most rows of x for the wide form (0: never)")
WIDE_M = int(_WIDE_TEXT)
"""The most rows of x that take the wide form (`wide_for`)."""


def wide_for(kind: int, m: int, halves: bool, rt: int) -> bool:
    """Whether the wide form runs: 4-bit codes under blocks of 32 or more (`RT_KINDS`, chunks not
    split) at one tile of w and at most `WIDE_M` rows of x. Its lanes keep 2 U chunks of their rows
    in flight (8 at the default U: 16 rows x 128 bytes a warp), loaded 16 contiguous bytes a lane
    (a warp's load instruction reads 4 rows x 128 bytes, where the direct loads read 8 rows x 16
    bytes), stored in shared memory and taken back as the A fragments by `ldmatrix`: the same words
    in the same lanes, the same bits. By measurement (H100, docs/gpu.md): q4s and mxfp4 6-16% faster
    at 2 and 4 rows of x; slower at 16 rows, and 8-bit codes through shared memory at every M timed."""
    return kind in RT_KINDS and not halves and rt == 1 and m <= WIDE_M


def rt_for(kind: int, n: int, m: int, halves: bool = False) -> int:
    """16-row tiles of w a warp for value kind `kind`, N = n, m rows of x and `split` chunks or not
    (`halves`): two for the kinds of `RT_KINDS` at `RT_M` rows where the blocks of 32 rows fill the
    GPU (`RT_FILL`) and chunks are not split (blocks of 16: not timed, and their two-tile variants
    spill at two n8 tiles), else one;
    `TILES` overrides wherever the x tiles allow two (`RT_NBS`). Each chunk's B fragments of x then
    serve 32 rows of w, halving x's reads through L1. H100, `QCORE_CUDA_LINEAR_TILES=1` against
    `=2`, `NUMBA_ENABLE_CUDASIM=0 python benchmarks/matmul.py --schemes
    q4s/block32:f16,q8s/block32:f16,mxfp4 --peers torch_bf16 --hide-launch --reps 15 --m 2,4,8,16
    --shapes 8192x8192,28672x8192` (docs/gpu.md has the figures)."""
    if nb_for(m) not in RT_NBS:
        return 1
    if TILES:
        return TILES
    ok = kind in RT_KINDS and RT_M[0] <= m <= RT_M[1] and not halves
    slots = fast.K.resident_blocks(WARPS, REGS) * fast.K.sm_count()
    return 2 if ok and -(-n // 32) >= RT_FILL * slots else 1


_TO_F16X2 = {fast.KIND_I4: code4s_f16x2, fast.KIND_E2M1: e2m1x2_f16x2, fast.KIND_I8: i8x2_f16x2,
             fast.KIND_E4M3: e4m3x2_f16x2, fast.KIND_E5M2: e5m2x2_f16x2}
"""Value kind -> the intrinsic that decodes a pair of its codes to an f16 pair (4-bit codes from
bits 0-3 and 16-19, Q4 in two's complement; int8 from bytes 0 and 2; FP8 from bytes 0 and 1)."""


def _pair_decoder(kind: int, bf: bool):
    """A pair of codes -> the pair of values in x's 16-bit type (exact)."""
    if kind == fast.KIND_I4 and bf:
        return code4s_bf16x2  # (straight to bf16: one lop3 and one fma)
    if kind == fast.KIND_E2M1 and bf:
        return e2m1x2_bf16x2  # (straight to bf16: no conversions through f16 and f32)
    to_f16 = _TO_F16X2[kind]
    if not bf:
        return to_f16

    @cuda.jit(device=True, inline="always")
    def to_bf16(v):
        return f16x2_bf16x2(to_f16(v))

    return to_bf16


def _decoder(kind: int, bf: bool):
    """A device function: a row's code word(s) of one chunk -> its four A pairs (module text)."""
    conv = _pair_decoder(kind, bf)
    if fast.KIND_BITS[kind] == 4:
        @cuda.jit(device=True, inline="always")
        def pairs(w0, w1):  # nibbles p and p + 4 of w0
            return conv(w0), conv(w0 >> uint32(4)), conv(w0 >> uint32(8)), conv(w0 >> uint32(12))

        return pairs
    if kind == fast.KIND_I8:
        @cuda.jit(device=True, inline="always")
        def pairs(w0, w1):  # bytes p of w0 and w1 into bytes 0 and 2
            return (conv(prmt(w0, w1, 0x4400)), conv(prmt(w0, w1, 0x5511)), conv(prmt(w0, w1, 0x6622)),
                    conv(prmt(w0, w1, 0x7733)))

        return pairs

    @cuda.jit(device=True, inline="always")
    def pairs(w0, w1):  # bytes p of w0 and w1 into bytes 0 and 1
        return conv(prmt(w0, w1, 0x40)), conv(prmt(w0, w1, 0x51)), conv(prmt(w0, w1, 0x62)), conv(prmt(w0, w1, 0x73))

    return pairs


@cuda.jit(device=True, inline="always")
def widen2(h):
    """The eight 2-bit two's-complement codes in bits 0-15 of h (code i at bits 2i, 2i + 1) as a
    word of 4-bit two's-complement codes (code i in nibble i, its sign bit copied into bits 2
    and 3): the same values, which the 4-bit pair decoders read."""
    x = h & uint32(0xFFFF)
    x = (x | (x << uint32(8))) & uint32(0x00FF00FF)
    x = (x | (x << uint32(4))) & uint32(0x0F0F0F0F)
    x = (x | (x << uint32(2))) & uint32(0x33333333)
    s = x & uint32(0x22222222)
    return x | (s << uint32(1)) | (s << uint32(2))


@cuda.jit(device=True, inline="always")
def _trunc_bf16(v):
    """v's top 16 bits (bfloat16, cut toward zero) as an f32."""
    return u2f(f2u(v) & uint32(0xFFFF0000))


@cuda.jit(device=True, inline="always")
def _split_pair(lo, hi, part):
    """Part `part` (0 hi, 1 mid, 2 lo) of the three-way bfloat16 split of (lo, hi), as a pair."""
    a, b = lo, hi
    for _ in range(part):
        a = a - _trunc_bf16(a)
        b = b - _trunc_bf16(b)
    return (f2u(b) & uint32(0xFFFF0000)) | (f2u(a) >> uint32(16))


def _linear_kernel(kind: int, xt: int, nb: int, halves: bool = False, sim_gpu_loop: bool | None = None,
                   rt: int = 1, wide: bool = False):
    """The kernel for value kind `kind`, x type `xt`, `nb` n8 tiles of x per pass; `halves`: the
    `split` variant (blocks of 16: a chunk's halves under their own slots); `sim_gpu_loop`
    (default `SIM_GPU_LOOP`); `rt` 16-row tiles of w a warp (each chunk's B used for all); `wide`
    the wide form (`wide_for`: 2 U chunks in flight, loaded through shared memory)."""
    sim = bool(config.ENABLE_CUDASIM)
    bits = fast.KIND_BITS[kind]
    assert not wide or (bits == 4 and rt == 1 and not halves), (kind, rt, halves)
    bf = xt != XT_F16
    mma = mma_f16 if xt == XT_F16 else mma_bf16
    nxs = 3 if xt == XT_F32 else 1
    mt = 8 * nb
    masked = sim and not (SIM_GPU_LOOP if sim_gpu_loop is None else sim_gpu_loop)
    scr_n = SCR * WARPS if sim else 1
    red_n = WARPS * 16 * rt * mt
    if 4 * red_n > 48 * 1024:  # (a tuning's warps x tiles x rows of x: numba's static shared memory)
        raise ValueError(f"{TUNE_ENV}/{TILES_ENV}: {WARPS} warps x {rt} tiles of w x {mt} rows of x pass 48 KB of "
                         "shared memory for the warps' sums")
    nt = 32 * WARPS
    pairs = _decoder(fast.KIND_I4 if bits == 2 else kind, bf)  # (2-bit codes widened to 4: `widen2`)
    uf = 2 * U if wide else 2 if halves and nb == 4 and U > 2 else max(1, U // rt)  # chunks in flight (two for
    # split nb = 4, U / rt for rt tiles of w: the same code words in flight a lane, no spills)
    acc_n, bx_n, w_n = 4 * nb, 4 * nxs * nb, 2 * uf  # (per tile; local array sizes: constants)
    acc_all, w_all = acc_n * rt, w_n * rt

    ws = 2 if bits == 8 else 1  # u32 words of a lane's 8 codes (2-bit: half of one, widened)
    cw = 2 if bits == 2 else 4 * ws  # u32 words of a row's 32-code chunk
    ldm = wide and not masked  # (the group's words through shared memory: `load_group`)
    nld = uf // 2 if ldm else 1  # 16-byte loads a lane a group (16 rows x uf chunks x 16 bytes / 512)
    swz = 3 - (uf.bit_length() - 1)  # (chunk u of a row at 16-byte slot g ^ (u << swz): no bank conflicts)
    shw_n = WARPS * 64 * uf if ldm else 1  # u32 words: 16 rows x uf chunks x 4 a warp
    salign = None if sim else 16
    raw_n = 4 * nld

    @cuda.jit(device=True, inline="always")
    def load1(w32, i, sh):
        """The lane's word of 8 codes at word i: 2-bit codes (bits `sh` .. `sh` + 15 of the
        word) widened to a word of 4-bit codes (`widen2`)."""
        if bits == 2:
            return widen2(ld1(w32, i) >> sh)
        return ld1(w32, i)

    @cuda.jit(device=True, inline="always")
    def load_x(x, bx, o, xo, cc, mk):
        """The B pairs of one row of x at chunk cc into bx[o .. o + 4 nxs), masked by `mk` (all
        ones, or zero in the lanes outside a split chunk's half); `xo` is the lane's offset into
        the row at chunk 0, or -1 for a row past M (zeros)."""
        if xo < int64(0):
            for i in range(4 * nxs):
                bx[o + i] = uint32(0)
            return
        if xt == XT_F32:
            xi = xo + cc * int64(32)
            v0, v1, v2, v3 = ld4(x, xi)
            v4, v5, v6, v7 = ld4(x, xi + int64(4))
            for s in range(nxs):
                bx[o + 4 * s] = _split_pair(v0, v4, s) & mk
                bx[o + 4 * s + 1] = _split_pair(v1, v5, s) & mk
                bx[o + 4 * s + 2] = _split_pair(v2, v6, s) & mk
                bx[o + 4 * s + 3] = _split_pair(v3, v7, s) & mk
        else:
            x0, x1, x2, x3 = ld4(x, xo + cc * int64(16))
            bx[o] = prmt(x0, x2, 0x5410) & mk
            bx[o + 1] = prmt(x0, x2, 0x7632) & mk
            bx[o + 2] = prmt(x1, x3, 0x5410) & mk
            bx[o + 3] = prmt(x1, x3, 0x7632) & mk

    @cuda.jit(device=True, inline="always")
    def steps(pa0, pa1, pa2, pa3, pb0, pb1, pb2, pb3, bx, tmp, scr, lane, base):
        """The chunk's two mma steps (A the rows' pairs, B `bx`) into zeroed sums `tmp`."""
        for i in range(4 * nb):
            tmp[i] = float32(0.0)
        for j in range(nb):
            for s in range(nxs):
                b = 4 * nxs * j + 4 * s
                tmp[4 * j], tmp[4 * j + 1], tmp[4 * j + 2], tmp[4 * j + 3] = mma(
                    pa0, pb0, pa1, pb1, bx[b], bx[b + 1], tmp[4 * j], tmp[4 * j + 1], tmp[4 * j + 2],
                    tmp[4 * j + 3], scr, lane, base)
                tmp[4 * j], tmp[4 * j + 1], tmp[4 * j + 2], tmp[4 * j + 3] = mma(
                    pa2, pb2, pa3, pb3, bx[b + 2], bx[b + 3], tmp[4 * j], tmp[4 * j + 1], tmp[4 * j + 2],
                    tmp[4 * j + 3], scr, lane, base)

    @cuda.jit(device=True, inline="always")
    def scaled(ea, eb, tmp, acc, r):
        """acc of tile r += e * sums (f32), rows g (`ea`) and g + 8 (`eb`)."""
        for j in range(nb):
            a = r * acc_n + 4 * j
            acc[a] += ea * tmp[4 * j]
            acc[a + 1] += ea * tmp[4 * j + 1]
            acc[a + 2] += eb * tmp[4 * j + 2]
            acc[a + 3] += eb * tmp[4 * j + 3]

    @cuda.jit(device=True, inline="always")
    def tile_terms(es, wa, wb, i, r, sra, srb, h0, h, bx, tmp, acc, scr, lane, base):
        """Tile r's part of a chunk (or of a split chunk's half h): its rows' words at wa, wb
        [r * w_n + i ..], two mma steps against `bx` into zeroed sums, then `acc += e * sums`."""
        o = r * w_n + i
        pa0, pa1, pa2, pa3 = pairs(wa[o], wa[o + 1])
        pb0, pb1, pb2, pb3 = pairs(wb[o], wb[o + 1])
        steps(pa0, pa1, pa2, pa3, pb0, pb1, pb2, pb3, bx, tmp, scr, lane, base)
        scaled(ld1_at(es, sra[r], h0 + uint32(h)), ld1_at(es, srb[r], h0 + uint32(h)), tmp, acc, r)

    @cuda.jit(device=True, inline="always")
    def chunk(x, es, cc, wa, wb, i, sra, srb, lb, xo, bx, tmp, acc, scr, lane, base):
        """One 32-k chunk, code words at wa, wb [r * w_n + i ..] for tile r: x's B pairs once, then
        per tile the rows' codes, two mma steps into zeroed sums and `acc += e * sums` (f32); a
        split chunk (`halves`) does so for each half, x read for each with zeros in the other
        half's lanes (the same registers: no masked copies)."""
        h0 = shr_u32(uint32(cc) << uint32(1), lb)  # (the slot of the chunk's first half: 32-bit, `lb` < 32)
        if halves:
            hi = (lane >> int64(1)) & int64(1)  # (t >> 1: the half this lane's codes lie in)
            for h in range(2):
                mk = uint32(0xFFFFFFFF) if hi == int64(h) else uint32(0)
                for j in range(nb):
                    load_x(x, bx, 4 * nxs * j, xo[j], cc, mk)
                for r in range(rt):
                    tile_terms(es, wa, wb, i, r, sra, srb, h0, h, bx, tmp, acc, scr, lane, base)
        else:
            for j in range(nb):
                load_x(x, bx, 4 * nxs * j, xo[j], cc, uint32(0xFFFFFFFF))
            for r in range(rt):
                tile_terms(es, wa, wb, i, r, sra, srb, h0, 0, bx, tmp, acc, scr, lane, base)

    @cuda.jit(device=True, inline="always")
    def load_chunk(w32, wa, wb, i, c, wra, wrb, sh):
        """The code word(s) of chunk c of the lane's two rows of each tile r into wa[r * w_n + i],
        wb[r * w_n + i] (and the next for 8-bit codes)."""
        o = c * int64(cw)
        for r in range(rt):
            ri = r * w_n + i
            if ws == 1:
                wa[ri] = load1(w32, wra[r] + o, sh)
                wb[ri] = load1(w32, wrb[r] + o, sh)
            else:
                wa[ri], wa[ri + 1] = ld2(w32, wra[r] + o)
                wb[ri], wb[ri + 1] = ld2(w32, wrb[r] + o)

    @cuda.jit(device=True, inline="always")
    def slot(mi, gg):
        """The first u32 word (in a warp's part of `shw`) of row gg of matrix mi = h uf + u: chunk u
        of row 8 h + gg of the group's 16."""
        return (mi * 8 + (gg ^ (((mi % uf) << swz) & 7))) * 4

    @cuda.jit(device=True, inline="always")
    def put(wa, wb, mi, v):
        """Matrix mi's word (`slot`) into the lane's words of its row half and chunk."""
        o = 2 * (mi % uf)
        if mi // uf:
            wb[o] = v
        else:
            wa[o] = v

    @cuda.jit(device=True, inline="always")
    def load_group(w32, wa, wb, c, wra, wrb, sh, shw, lrow, lsl, ladr, raw, scr, lane, base):
        """The code words of chunks c .. c + uf - 1 of the lane's two rows (of each tile); in the
        wide form (`ldm`) the warp's 16 rows x uf chunks loaded 16 bytes a lane, stored in shared
        memory (a warp barrier before and after) and taken back by `ldmatrix` as each lane's words."""
        if not ldm:
            for u in range(uf):
                load_chunk(w32, wa, wb, u * 2, c + int64(u), wra, wrb, sh)
            return
        for s in range(nld):
            raw[4 * s], raw[4 * s + 1], raw[4 * s + 2], raw[4 * s + 3] = ld4(w32, lrow[s] + c * int64(4))
        warp_sync()  # (every lane has taken the previous group's words)
        for s in range(nld):
            sts4(shw, lsl[s], raw[4 * s], raw[4 * s + 1], raw[4 * s + 2], raw[4 * s + 3])
        warp_sync()
        for p in range(nld):
            v0, v1, v2, v3 = ldsm4(shw, ladr[p], scr, lane, base)
            put(wa, wb, 4 * p, v0)
            put(wa, wb, 4 * p + 1, v1)
            put(wa, wb, 4 * p + 2, v2)
            put(wa, wb, 4 * p + 3, v3)

    @cuda.jit(device=True, inline="always")
    def use_group(x, es, wa, wb, c, sra, srb, lb, xo, bx, tmp, acc, scr, lane, base):
        """The sums of chunks c .. c + uf - 1 (`load_group`'s words), in k order."""
        for u in range(uf):
            chunk(x, es, c + int64(u), wa, wb, u * 2, sra, srb, lb, xo, bx, tmp, acc, scr, lane, base)

    def k_linear(x, w32, es, bias, out32, out16, P):
        red = cuda.shared.array(red_n, float32)
        scr = cuda.shared.array(scr_n, float32)
        acc = cuda.local.array(acc_all, float32)
        tmp = cuda.local.array(acc_n, float32)
        bx = cuda.local.array(bx_n, uint32)
        shw = cuda.shared.array(shw_n, uint32, alignment=salign)
        lrow = cuda.local.array(nld, int64)
        lsl = cuda.local.array(nld, int64)
        ladr = cuda.local.array(nld, int64)
        raw = cuda.local.array(raw_n, uint32)
        wa = cuda.local.array(w_all, uint32)
        wb = cuda.local.array(w_all, uint32)
        xo = cuda.local.array(nb, int64)
        wra = cuda.local.array(rt, int64)
        wrb = cuda.local.array(rt, int64)
        sra = cuda.local.array(rt, int64)
        srb = cuda.local.array(rt, int64)
        tid = int64(cuda.threadIdx.x)
        warp = tid >> int64(5)
        lane = tid & int64(31)
        g = lane >> int64(2)
        t = lane & int64(3)
        N = P[LP_N]
        K = P[LP_K]
        M = P[LP_M]
        lb = uint32(min(P[LP_LB], int64(31)))  # (62: one slot; a 32-bit shift reads at most 31)
        cpw = P[LP_CPW]
        n0 = int64(cuda.blockIdx.x) * int64(16 * rt)
        m0 = int64(cuda.blockIdx.y) * int64(mt)
        lw = (t >> int64(1)) if bits == 2 else t * int64(ws)  # (2-bit: lanes 2i, 2i + 1 share word i)
        sh = uint32(16) * uint32(t & int64(1)) if bits == 2 else uint32(0)  # (and take its halves)
        for r in range(rt):  # tile r: rows n0 + 16 r + g and + 8
            ra = min(n0 + int64(16 * r) + g, N - int64(1))
            rb = min(n0 + int64(16 * r + 8) + g, N - int64(1))
            wra[r] = ra * P[LP_WPR] + lw  # the lane's code words at chunk 0
            wrb[r] = rb * P[LP_WPR] + lw
            sra[r] = ra * P[LP_NSB]  # the rows' first scale slots
            srb[r] = rb * P[LP_NSB]
        for j in range(nb):  # the lane's offset into its row of x at chunk 0 (-1: past M)
            m = m0 + int64(8 * j) + g
            if m >= M:
                xo[j] = int64(-1)
            elif xt == XT_F32:
                xo[j] = m * K + t * int64(8)
            else:
                xo[j] = m * (K >> int64(1)) + t * int64(4)
        if ldm:
            sho = warp * int64(64 * uf)  # (the warp's part of shw)
            for s in range(nld):  # load s: row q of the group's 16, chunk u, 16 bytes (4 words)
                q = (int64(32 * s) + lane) // int64(uf)
                u = lane % int64(uf)
                lrow[s] = min(n0 + q, N - int64(1)) * P[LP_WPR] + u * int64(4)
                lsl[s] = sho + slot((q >> int64(3)) * int64(uf) + u, q & int64(7))
                ladr[s] = sho + slot(int64(4 * s) + (lane >> int64(3)), lane & int64(7))  # (ldmatrix p = s)
        nch = K >> int64(5)
        c0 = warp * cpw
        c1 = min(c0 + cpw, nch)
        base = warp * int64(SCR)
        for i in range(acc_all):
            acc[i] = float32(0.0)
        if masked:  # the simulator: every warp the same steps (past its range: chunk 0, B zero)
            for s in range(cpw):
                c = c0 + s
                ok = c < c1
                cc = c if ok else int64(0)
                load_chunk(w32, wa, wb, 0, cc, wra, wrb, sh)
                if not ok:
                    for j in range(nb):
                        xo[j] = int64(-1)
                chunk(x, es, cc, wa, wb, 0, sra, srb, lb, xo, bx, tmp, acc, scr, lane, base)
        else:
            c = c0
            while c + int64(uf) <= c1:  # U chunks' code words in flight, then their sums
                load_group(w32, wa, wb, c, wra, wrb, sh, shw, lrow, lsl, ladr, raw, scr, lane, base)
                use_group(x, es, wa, wb, c, sra, srb, lb, xo, bx, tmp, acc, scr, lane, base)
                c += int64(uf)
            while c < c1:
                load_chunk(w32, wa, wb, 0, c, wra, wrb, sh)
                chunk(x, es, c, wa, wb, 0, sra, srb, lb, xo, bx, tmp, acc, scr, lane, base)
                c += int64(1)
        # C of w tile r, x tile j: lane (g, t) holds rows 16 r + g, + 8 and columns 8j + 2t, + 1
        wo = warp * int64(16 * rt * mt)
        for r in range(rt):
            for j in range(nb):
                a = r * acc_n + 4 * j
                col = int64(8 * j) + t * int64(2)
                ga = (int64(16 * r) + g) * int64(mt) + col
                gb = ga + int64(8 * mt)
                red[wo + ga] = acc[a]
                red[wo + ga + int64(1)] = acc[a + 1]
                red[wo + gb] = acc[a + 2]
                red[wo + gb + int64(1)] = acc[a + 3]
        cuda.syncthreads()
        idx = tid
        while idx < int64(16 * rt * mt):
            row = idx // int64(mt)
            col = idx - row * int64(mt)
            n = n0 + row
            m = m0 + col
            if n < N and m < M:
                v = red[idx]
                for w in range(1, WARPS):
                    v += red[int64(w * 16 * rt * mt) + idx]
                if P[LP_BIAS] != int64(0):
                    v += bias[n]
                store_out(out32, out16, m * N + n, v, P[LP_OT])
            idx += int64(nt)

    return k_linear


@cuda.jit(device=True, inline="always")
def _bf16_rn_bits(v):
    """v rounded to nearest-even bfloat16, as bits (NaN stays NaN)."""
    u = f2u(v)
    if (u & uint32(0x7FFFFFFF)) > uint32(0x7F800000):
        return (u >> uint32(16)) | uint32(0x40)
    return (u + uint32(0x7FFF) + ((u >> uint32(16)) & uint32(1))) >> uint32(16)


@cuda.jit(device=True, inline="always")
def store_out(out32, out16, o, v, ot):
    """Result element o = the f32 sum v rounded once to the result type `ot` (OT_F32: out32;
    OT_F16, OT_BF16: their bits in out16, nearest even): the one rounding of every linear kernel."""
    if ot == int64(OT_F32):
        out32[o] = v
    elif ot == int64(OT_F16):
        out16[o] = uint16(f16_bits(v))
    else:
        out16[o] = uint16(_bf16_rn_bits(v))


def kernel(kind: int, xt: int, nb: int, halves: bool = False, rt: int = 1, wide: bool = False):
    """The compiled variant for value kind `kind`, x type `xt`, `nb` n8 tiles per pass, `split`
    chunks or not (`halves`), `rt` tiles of w a warp, the wide form or not (`wide_for`), and under
    the simulator `SIM_GPU_LOOP` as it is now, at the tuning (`WARPS`, `U`) as it is now."""
    return _kernel(kind, xt, nb, halves, SIM_GPU_LOOP, rt, wide, (WARPS, U))


@lru_cache(maxsize=None)
def _kernel(kind: int, xt: int, nb: int, halves: bool, sim_gpu_loop: bool, rt: int, wide: bool,
            tn: tuple[int, int]):
    """(`tn`: the tuning `_linear_kernel` reads, in the key so that another tuning builds anew)"""
    return fast.K.jit_regs(REGS)(_linear_kernel(kind, xt, nb, halves, sim_gpu_loop, rt, wide))


def signature(xt: int, scales: str = "float32", tail: str = "") -> str:
    """The launch signature for x type `xt`: x, the code words, the scales (array of `scales`), the
    bias, the two results and the parameters, then `tail` (further arguments, each after a comma)."""
    xs = "float32" if xt == XT_F32 else "uint32"
    return (f"void({xs}[::1], uint32[::1], {scales}[::1], float32[::1], float32[::1], uint16[::1], "
            f"{LP_LAYOUT.arg}{tail})")


SPLIT_TARGETS = (tuple((kind, xt, nb) for kind in (fast.KIND_I4, fast.KIND_E2M1) for xt in (XT_BF16, XT_F16, XT_F32)
                       for nb in NBS)
                 + tuple((kind, XT_BF16, 1) for kind in (fast.KIND_I8, fast.KIND_E4M3, fast.KIND_I2)))
"""(kind, x type, nb) of the `split` variants `ptx_targets` compiles: every one of the 4-bit kinds
(nvfp4 and int4 under blocks of 16), one each of the 8-bit and 2-bit kinds (the same code, other
decoders)."""


def _variants():
    return ([(f"k_linear[{kind},{xt},{nb}]", _linear_kernel(kind, xt, nb), signature(xt), REGS)
             for kind in KINDS for xt in (XT_BF16, XT_F16, XT_F32) for nb in NBS]
            + [(f"k_linear[{kind},{xt},{nb},split]", _linear_kernel(kind, xt, nb, True), signature(xt), REGS)
               for kind, xt, nb in SPLIT_TARGETS]
            + [(f"k_linear[{kind},{xt},{nb},rt2]", _linear_kernel(kind, xt, nb, rt=2), signature(xt), REGS)
               for kind in KINDS for xt in (XT_BF16, XT_F16, XT_F32) for nb in RT_NBS]
            + [(f"k_linear[{kind},{xt},{nb},split,rt2]", _linear_kernel(kind, xt, nb, True, rt=2), signature(xt),
                REGS) for kind, xt, nb in SPLIT_TARGETS if nb in RT_NBS]
            + [(f"k_linear[{kind},{xt},1,wide]", _linear_kernel(kind, xt, 1, wide=True), signature(xt), REGS)
               for kind in RT_KINDS for xt in (XT_BF16, XT_F16, XT_F32)])


EFFECTIVE_SIG = "void(float32[::1], float32[::1], float32[::1], int64)"


@cuda.jit
def k_effective(scales, gbuf, es, n):
    """es[i] = the effective scale of slot i of a two-level weight (`two_level_e` of its global
    and block scale; grid-stride): made once per weight, so the linear kernel reads one f32 per
    slot and multiplies no global."""
    i = int64(cuda.grid(1))
    while i < n:
        es[i] = two_level_e(gbuf[0], scales[i])
        i += int64(cuda.gridsize(1))


FINISH_SIG = "void(float32[::1], float32[::1], float32[::1], uint16[::1], int64, int64, int64, int64)"


@cuda.jit
def k_finish(y, bias, out32, out16, n, cols, ot, has_bias):
    """out[i] = y[i] (+ bias[i % cols]) rounded once to the result type `ot` (grid-stride over n):
    the end of a `linear` whose f32 sums came from another kernel."""
    i = int64(cuda.grid(1))
    while i < n:
        v = y[i]
        if has_bias != int64(0):
            v += bias[i % cols]
        store_out(out32, out16, i, v, ot)
        i += int64(cuda.gridsize(1))


def ptx_targets():
    """(name, python function, signature, register cap) of every variant and the finishing kernel
    (`ptx.targets`)."""
    return _variants() + [("k_finish", k_finish.py_func, FINISH_SIG, None),
                          ("k_effective", k_effective.py_func, EFFECTIVE_SIG, None)]
