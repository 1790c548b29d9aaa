"""Tensor-core GEMV at M = 1 for 4-bit integer codes, over a copy of the weight in mma fragment
order: `out[n] = sum_k x[k] * decode(w[k, n]) * e[k, n]`.

The FFMA kernel (`gemv.py`) spends a byte permute, an add and an FFMA per weight; here
`mma.sync.m16n8k16` (bf16 in, f32 accumulate) does the products, and a pair of codes costs one
`lop3` and one `fma.rn.bf16x2` (`intrin.code4_bf16x2`). The payload's [K, N] words hold 8
columns of one row, while an A fragment wants pairs along k, so the kernel reads a copy of the
codes and effective scales laid out in fragment order (`pack`, made once per weight and kept in
its cache: about as many bytes again as the payload).

Fragment copy. Columns go in strips of 128 (`STRIP`), rows in k-tiles of 16. A chunk holds one
strip's k-tile: 8 A tiles of 16 columns x 16 rows (256 u32: half h, lane, tile 4h + p), then the
tile's effective scales, 16 rows of each of the strip's four 32-column groups (f16 where the
scheme's scales are f16 with no global, else f32). Lane (g, t) of tile i holds the codes of
columns 16i + g and 16i + g + 8 at rows 4t .. 4t + 3 of the k-tile, offset by 8 (`c + 8`), pair r
(A register r) in bits 4r .. 4r + 3 and 16 + 4r .. 19 + 4r: A[m][kappa] is column 16i + m at row
`4t + kappa - 2t` for kappa in {2t, 2t + 1} and `4t + 2 + kappa - 2t - 8` for {2t + 8, 2t + 9}, so
a lane's four rows are consecutive and its x and scales are one vector load each. Chunks go
strip-major, so a warp walking k reads one contiguous stream (two 16-byte loads a lane per tile).

Precision. `v = x[k] * e[k, group]` (f32, as the FFMA kernel rounds it) enters B as two bf16
parts, `hi` = v rounded to 8 significant bits and `lo` = the rest rounded again (|v - hi - lo|
<= 2**-16 |v|), in B column 2j (hi) and 2j + 1 (lo) for the strip's group j: one B fragment
serves the strip's 8 tiles (tile i reads group i // 2's columns of C). The codes are exact in
bf16 and the tensor core's products exact, so each term is off by at most 2**-16 of itself plus
the f32 accumulation: inside the conformance bound (`matmul_rel * K * 2**-24 * (|x| @ |W|)`)
from K = `MIN_K`. The split needs normal parts: a block checks the range of its rows of x (a
thread's first 8 loaded during its warp's last mma step) against the range of |e| over the
weight (`k_frag_erange`, after the chunks in the copy); where some nonzero |x| * |e| may lie
below 2**-100 or above 2**100 (or x or e is not finite), it sums its columns again with FFMA in
k order from the payload (`exact_sums`), so tiny, huge, infinite and NaN inputs get the FFMA
kernel's arithmetic. The check is by ranges, so a block can fall back where no single product
leaves the range; the fallback is correct, only slower.

Grid: strips x KS k-splits (about `PER_SM` blocks of `WARPS` warps per SM); the warps of a block
split its k-tiles in pairs (each step loads two k-tiles: 2 KiB a warp) with two register sets
alternating, so one step's loads are in flight while the other computes. Under the simulator
every warp of a block runs the same steps (its mma twin needs every thread at each call): the
steps past a warp's range read the strip's first pair with B zero. The warps' sums meet in
shared memory in warp order. A strip's k-splits are launched as one thread-block cluster
(`cluster_dims`: up to `CLUSTER_MAX` splits, sm_90): the other splits store their sums into rank
0's shared memory (`st.async`, each counted on rank 0's mbarrier) and exit; rank 0 waits for the
mbarrier and adds them in split order. A launch without clusters (numba's first launch, more
splits, `CLUSTER_ENV=0`) writes partial sums and the last block of a strip to finish adds them
in the same order (a counter per strip, after a fence), as in `gemv.py`. Either way results
repeat bit for bit.

Eligible (`applies`): 4-bit integer codes on the GEMV's geometry with N a multiple of 128, scale
blocks of at least 32 columns (or one per tensor), K a multiple of 32 and at least `MIN_K`; M = 1.
"""
from __future__ import annotations

import os
from functools import lru_cache

import numpy as np

from numba import config, cuda, float32, int32, int64, uint32

from qcore.spec.schemes import QuantScheme, ScaleDtype

from . import fast, gemv
from .devmath import two_level_e
from .gemv import Q_K, Q_KS, Q_LB, Q_N, Q_NWR, Q_RPB, Q_TWO
from .intrin import (abs_bits_m1, bf16x2_rn, cluster_arrive, cluster_size, cluster_wait, code4_bf16x2, f16_bits,
                     f16x2_f32, f2u, fmax_nan, ld1, ld2, ld4, ldcg_f32, mbar_init_expect, mbar_try_wait, mma_bf16,
                     st_async_f32, u2f)

STRIP = 128  # columns per strip: 8 A tiles of 16, four 32-column scale groups
TILE_WORDS = 256  # u32 words of codes per chunk (8 tiles x 32 lanes)
WARPS = 8 if config.ENABLE_CUDASIM else 16  # warps per block (the simulator: half the threads a barrier)
PER_SM = 1  # resident blocks per SM the grid is sized for (128 registers)
RANGE_BLOCKS = 32  # blocks of `k_frag_erange`: each leaves its (max, min) of |e| in the copy's tail
RANGE_THREADS = 32 if config.ENABLE_CUDASIM else 256  # its threads per block (the simulator's cost is per thread)
CLUSTER_MAX = 8  # k-splits a strip may have to meet in one thread-block cluster (the portable cluster size)
REGS = 128
MIN_K = 512  # the split's 2**-16 per term is a quarter of the bound's K * 2**-23 here
SCR = 384  # simulator: f32 scratch per warp for the mma twin (A 16 x 16, B 16 x 8)
TINY = 2.0 ** -100  # a nonzero |x * e| below (or above HUGE, or not finite): the FFMA fallback
HUGE = 2.0 ** 100
ENV = "QCORE_CUDA_FRAGMENT_GEMV"  # "0": never make the fragment copy (the FFMA GEMV instead)
CLUSTER_ENV = "QCORE_CUDA_FRAGMENT_CLUSTERS"  # "0": k-splits meet through global memory only


def enabled() -> bool:
    """Whether the backend may make fragment copies (`ENV` unset or not "0")."""
    return os.environ.get(ENV, "1") != "0"


def half_scales(scheme: QuantScheme) -> bool:
    """Whether the copy's scales are f16: the scheme's scales are f16 with no global (so each
    effective scale is an f16 value), else f32."""
    return scheme.slot_dtype is ScaleDtype.F16 and not scheme.two_level


def chunk_words(half: bool) -> int:
    """u32 words per chunk: the codes, then 64 scales (f16 pairs or f32)."""
    return TILE_WORDS + (32 if half else 64)


def applies(kind: int, Q: np.ndarray) -> bool:
    """Whether this kernel takes a weight of value kind `kind` and GEMV geometry Q."""
    k_, n_ = int(Q[Q_K]), int(Q[Q_N])
    return (kind == fast.KIND_I4 and n_ % STRIP == 0 and int(Q[gemv.Q_BLOCK]) >= 32 and k_ % 32 == 0
            and k_ >= MIN_K)


def geometry(shape: tuple[int, ...], scheme: QuantScheme) -> tuple[int, np.ndarray] | None:
    """(kind, Q) when this kernel applies to a [K, N] weight, else None."""
    gg = gemv.geometry(shape, scheme)
    return gg if gg is not None and applies(*gg) else None


PACK_SIG = "void(uint32[::1], float32[::1], float32[::1], uint32[::1], int64, int64, int64, int64, int64)"


def _pack_kernel(half: bool):
    cw = chunk_words(half)

    def k_frag_pack(w32, scales, gbuf, frag, K, N, lb, two, n):
        """frag[i] for the n words of the copy (grid-stride): codes of chunk i // cw (strip, k-tile)
        in fragment order, then its effective scales (module text)."""
        g2 = gbuf[0] if two != int64(0) else float32(1.0)
        nwr = N >> int64(3)
        srow = N >> lb
        nkt = K >> int64(4)
        i = int64(cuda.grid(1))
        step = int64(cuda.gridsize(1))
        while i < n:
            c = i // int64(cw)
            o = i - c * int64(cw)
            strip = c // nkt
            kt = c - strip * nkt
            if o < int64(TILE_WORDS):
                r = o & int64(127)
                lane = r >> int64(2)
                tile = (o >> int64(7)) * int64(4) + (r & int64(3))
                g = lane >> int64(2)
                t = lane & int64(3)
                col = strip * int64(STRIP) + tile * int64(16) + g
                k0 = kt * int64(16) + t * int64(4)
                word = uint32(0)
                for j in range(8):  # pair r = j >> 1 ... see the module text: (row, column) per field
                    pr = j >> 1
                    hi_half = j & 1
                    kk = k0 + int64(hi_half) + (int64(2) if pr >= 2 else int64(0))
                    cc = col + (int64(8) if (pr & 1) == 1 else int64(0))
                    code = (w32[kk * nwr + (cc >> int64(3))] >> uint32((cc & int64(7)) * int64(4))) & uint32(15)
                    word |= ((code ^ uint32(8)) << uint32(4 * pr + 16 * hi_half))
                frag[i] = word
            else:
                s = o - int64(TILE_WORDS)
                if half:  # two f16 per word: entries 2s, 2s + 1
                    v = uint32(0)
                    for h in range(2):
                        j = s * int64(2) + int64(h)
                        grp = j >> int64(4)
                        k = kt * int64(16) + (j & int64(15))
                        e = two_level_e(g2, scales[k * srow + ((strip * int64(STRIP) + grp * int64(32)) >> lb)])
                        v |= f16_bits(e) << uint32(16 * h)
                    frag[i] = v
                else:
                    grp = s >> int64(4)
                    k = kt * int64(16) + (s & int64(15))
                    frag[i] = f2u(two_level_e(g2, scales[k * srow + ((strip * int64(STRIP) + grp * int64(32)) >> lb)]))
            i += step

    return k_frag_pack


@lru_cache(maxsize=None)
def pack_kernel(half: bool):
    return cuda.jit(_pack_kernel(half))


def copy_words(Q: np.ndarray, half: bool) -> int:
    """u32 words of a weight's fragment copy: its chunks, then `RANGE_BLOCKS` pairs (max |e| bits,
    min nonzero |e| bits - 1) of `k_frag_erange`."""
    return (int(Q[Q_N]) // STRIP) * (int(Q[Q_K]) // 16) * chunk_words(half) + 2 * RANGE_BLOCKS


ERANGE_SIG = "void(float32[::1], float32[::1], uint32[::1], int64, int64, int64)"


@cuda.jit
def k_frag_erange(scales, gbuf, frag, nslots, two, off):
    """frag[off + 2b], frag[off + 2b + 1] = the bits of max |e| and of min nonzero |e| minus 1
    (u32; NaN above every number) over block b's share of the effective scales (grid-stride)."""
    sh = cuda.shared.array(2, uint32)
    tid = int64(cuda.threadIdx.x)
    if tid == int64(0):
        sh[0] = uint32(0)
        sh[1] = uint32(0xFFFFFFFF)
    cuda.syncthreads()
    g2 = gbuf[0] if two != int64(0) else float32(1.0)
    emax = float32(0.0)
    emin = uint32(0xFFFFFFFF)
    i = int64(cuda.grid(1))
    while i < nslots:
        e = abs(two_level_e(g2, scales[i]))
        emax = fmax_nan(emax, e)
        emin = min(emin, abs_bits_m1(f2u(e)))
        i += int64(cuda.gridsize(1))
    cuda.atomic.max(sh, 0, f2u(emax))
    cuda.atomic.min(sh, 1, emin)
    cuda.syncthreads()
    if tid == int64(0):
        b = int64(cuda.blockIdx.x)
        frag[off + b * int64(2)] = sh[0]
        frag[off + b * int64(2) + int64(1)] = sh[1]


def pack_launches(w32, scales, gbuf, Q: np.ndarray, half: bool, nslots: int, frag=None) -> list:
    """[((grid, block), kernel, arguments)] of the launches that write the fragment copy `frag`
    of a [K, N] weight (codes `w32`, its `nslots` decoded scales and global; None: a new array,
    the first launch's fourth argument): the chunks, then the range of |e|."""
    k_, n_ = int(Q[Q_K]), int(Q[Q_N])
    n = copy_words(Q, half) - 2 * RANGE_BLOCKS
    if frag is None:
        frag = cuda.device_array(copy_words(Q, half), dtype=np.uint32)
    two = int(Q[Q_TWO])
    return [(fast.K.launch(n), pack_kernel(half), [w32, scales, gbuf, frag, k_, n_, int(Q[Q_LB]), two, n]),
            (((RANGE_BLOCKS,), (RANGE_THREADS,)), k_frag_erange, [scales, gbuf, frag, max(1, nslots), two, n])]


def pack(w32, scales, gbuf, Q: np.ndarray, half: bool, nslots: int):
    """The fragment copy of a [K, N] weight (module text)."""
    launches = pack_launches(w32, scales, gbuf, Q, half, nslots)
    for (grid, block), kern, args in launches:
        kern[grid, block](*args)
    return launches[0][2][3]


def plan(Q: np.ndarray, per_sm: int = PER_SM) -> tuple[np.ndarray, tuple[int, int], tuple[int, int]]:
    """(Q with KS (k-splits) and RPB (k-tile pairs per block), grid, block): strips x KS, about one
    wave of `per_sm` blocks per SM, at least one pair per warp (under the simulator at most 2
    splits: its cost is per launched thread)."""
    strips = int(Q[Q_N]) // STRIP
    pairs = int(Q[Q_K]) // 32
    if config.ENABLE_CUDASIM:
        ks = max(1, min(2, pairs // WARPS))
    else:
        ks = max(1, min(pairs // WARPS, (fast.K.sm_count() * per_sm) // strips))
    ppb = -(-pairs // ks)
    q = gemv.Q_LAYOUT.replace(Q, Q_KS=-(-pairs // ppb), Q_RPB=ppb)
    return q, (strips, int(q[Q_KS])), (32 * WARPS, 1)


def _frag_kernel(half: bool):
    cw = chunk_words(half)
    scr_n = SCR * WARPS if config.ENABLE_CUDASIM else 1
    red_n = WARPS * STRIP
    nt = 32 * WARPS
    tiny, huge = float32(TINY), float32(HUGE)
    masked = bool(config.ENABLE_CUDASIM)  # every warp the same steps (the simulator's mma twin)
    cstep = 2 * cw  # u32 words per pair of k-tiles
    tail = chunk_words(half)  # (the range pairs follow the chunks: `copy_words`)
    xch_n = (CLUSTER_MAX - 1) * STRIP

    @cuda.jit(device=True, inline="always")
    def load(frag, x, wv, xv, ev, ci, xi, lane, g, t):
        """Two k-tiles from chunk ci (and ci + cw): the lane's code words, x and scales."""
        for u in range(2):
            c = ci + int64(u * cw)
            wv[8 * u], wv[8 * u + 1], wv[8 * u + 2], wv[8 * u + 3] = ld4(frag, c + lane * int64(4))
            wv[8 * u + 4], wv[8 * u + 5], wv[8 * u + 6], wv[8 * u + 7] = ld4(frag, c + int64(128) + lane * int64(4))
            xv[4 * u], xv[4 * u + 1], xv[4 * u + 2], xv[4 * u + 3] = ld4(x, xi + int64(16 * u))
            if half:
                ev[4 * u], ev[4 * u + 1] = ld2(frag, c + int64(TILE_WORDS) + (g >> int64(1)) * int64(8) + t * int64(2))
            else:
                ev[4 * u], ev[4 * u + 1], ev[4 * u + 2], ev[4 * u + 3] = ld4(
                    frag, c + int64(TILE_WORDS) + (g >> int64(1)) * int64(16) + t * int64(4))

    @cuda.jit(device=True, inline="always")
    def compute(wv, xv, ev, acc, part, ok, scr, lane, base):
        """The mma of two k-tiles; `ok` False: the step lies past the warp's range (B zero)."""
        for u in range(2):
            if half:
                e0, e1 = f16x2_f32(ev[4 * u])
                e2, e3 = f16x2_f32(ev[4 * u + 1])
            else:
                e0, e1, e2, e3 = u2f(ev[4 * u]), u2f(ev[4 * u + 1]), u2f(ev[4 * u + 2]), u2f(ev[4 * u + 3])
            v0 = float32(xv[4 * u] * e0)
            v1 = float32(xv[4 * u + 1] * e1)
            v2 = float32(xv[4 * u + 2] * e2)
            v3 = float32(xv[4 * u + 3] * e3)
            if masked and not ok:
                v0 = v1 = v2 = v3 = float32(0.0)
            h01 = bf16x2_rn(v1, v0)
            h23 = bf16x2_rn(v3, v2)
            l01 = bf16x2_rn(float32(v1 - u2f(h01 & uint32(0xFFFF0000))), float32(v0 - u2f(h01 << uint32(16))))
            l23 = bf16x2_rn(float32(v3 - u2f(h23 & uint32(0xFFFF0000))), float32(v2 - u2f(h23 << uint32(16))))
            b0 = l01 if part else h01  # B columns 2j + 1: the rest of v, rounded again
            b1 = l23 if part else h23
            for i in range(8):
                w = wv[8 * u + i]
                acc[4 * i], acc[4 * i + 1], acc[4 * i + 2], acc[4 * i + 3] = mma_bf16(
                    code4_bf16x2(w), code4_bf16x2(w >> uint32(4)), code4_bf16x2(w >> uint32(8)),
                    code4_bf16x2(w >> uint32(12)), b0, b1, acc[4 * i], acc[4 * i + 1], acc[4 * i + 2],
                    acc[4 * i + 3], scr, lane, base)

    @cuda.jit(device=True, inline="always")
    def step(frag, x, wn, xn, en, wc, xc, ec, acc, part_b, s, nreal, ci, xi, ci0, xi0, lane, g, t, scr, base):
        """Step s of the pipeline, not the last: pair s + 1's loads into set n (its chunk and x
        indices from s and the warp's first pair's `ci`, `xi`; masked: a step past the warp's
        range reads the strip's first pair), then set c's mma of pair s."""
        nci, nxi = ci + (s + int64(1)) * cstep, xi + (s + int64(1)) * int64(32)
        if masked and s + int64(1) >= nreal:
            nci, nxi = ci0, xi0
        load(frag, x, wn, xn, en, nci, nxi, lane, g, t)
        compute(wc, xc, ec, acc, part_b, s < nreal, scr, lane, base)

    @cuda.jit(device=True, inline="always")
    def last_step(x, xn, wc, xc, ec, acc, part_b, ok, xr, xr_on, scr, lane, base):
        """The warp's last step: the thread's first 8 rows of x for the block's range check into
        set n's x (from `xr`, when `xr_on`), so that their wait overlaps the last mma; then set
        c's mma."""
        if xr_on:
            xn[0], xn[1], xn[2], xn[3] = ld4(x, xr)
            xn[4], xn[5], xn[6], xn[7] = ld4(x, xr + int64(4))
        compute(wc, xc, ec, acc, part_b, ok, scr, lane, base)

    @cuda.jit(device=True, inline="always")
    def x_range(xmax, xmin, a):
        """(max |x|, min nonzero |x| bits - 1) with a folded in (NaN: max NaN)."""
        return fmax_nan(xmax, abs(a)), min(xmin, abs_bits_m1(f2u(a)))

    @cuda.jit(device=True, inline="always")
    def exact_sums(x, w32, scales, g2, col, k0, k1, nwr, srow, lb, xoff):
        """Column `col` over rows [k0, k1) with FFMA in k order: the FFMA kernel's arithmetic."""
        s = float32(0.0)
        sh = uint32((col & int64(7)) * int64(4))
        for k in range(k0, k1):
            e = two_level_e(g2, ld1(scales, k * srow + (col >> lb)))
            c = ((ld1(w32, k * nwr + (col >> int64(3))) >> sh) & uint32(15)) ^ uint32(8)
            s = cuda.fma(float32(ld1(x, xoff + k) * e), u2f(c | uint32(0x4B000000)) - float32(8388616.0), s)
        return s

    def k_frag(x, w32, scales, gbuf, lut, part, cnt, out, Q, m0, mc, frag):
        red = cuda.shared.array(red_n, float32)
        scr = cuda.shared.array(scr_n, float32)
        last = cuda.shared.array(1, int32)
        rng = cuda.shared.array(4, uint32)  # max |x| bits, min nonzero |x| bits - 1, the same of |e|
        xch = cuda.shared.array(xch_n, float32)  # rank 0 of a cluster: the other k-splits' sums
        mbar = cuda.shared.array(1, int64)  # rank 0 of a cluster: complete when those sums have landed
        acc = cuda.local.array(32, float32)
        wa = cuda.local.array(16, uint32)
        xa = cuda.local.array(8, float32)
        ea = cuda.local.array(8, uint32)
        wb = cuda.local.array(16, uint32)
        xb = cuda.local.array(8, float32)
        eb = cuda.local.array(8, uint32)
        tid = int64(cuda.threadIdx.x)
        warp = tid >> int64(5)
        lane = tid & int64(31)
        g = lane >> int64(2)
        t = lane & int64(3)
        part_b = (g & int64(1)) == int64(1)
        K = Q[Q_K]
        N = Q[Q_N]
        ks = Q[Q_KS]
        ppb = Q[Q_RPB]
        nkt = K >> int64(4)
        strip = int64(cuda.blockIdx.x)
        by = int64(cuda.blockIdx.y)
        xoff = m0 * K
        p0 = by * ppb  # the block's k-tile pairs [p0, p1)
        p1 = min(p0 + ppb, K >> int64(5))
        ppw = (ppb + int64(WARPS - 1)) // int64(WARPS)
        w0 = min(p0 + warp * ppw, p1)  # this warp's pairs [w0, w1)
        w1 = min(w0 + ppw, p1)
        nreal = w1 - w0
        nst = ppw if masked else nreal  # steps (masked: the same for every warp)
        if ks > int64(1) and int64(cluster_size()) == ks:
            if by == int64(0) and tid == int64(0):  # expects the other splits' 4 * STRIP bytes each
                mbar_init_expect(mbar, uint32(4 * STRIP) * uint32(ks - int64(1)))
            cluster_arrive()  # (waited for before the sums meet: every block of the cluster has started)
        for a in range(32):
            acc[a] = float32(0.0)
        if tid == int64(0):
            rng[0] = uint32(0)
            rng[1] = uint32(0xFFFFFFFF)
            rng[2] = uint32(0)
            rng[3] = uint32(0xFFFFFFFF)
        base = warp * int64(SCR)
        ci = (strip * nkt + w0 * int64(2)) * int64(cw)
        xi = xoff + w0 * int64(32) + t * int64(4)
        ci0 = strip * nkt * int64(cw)  # (masked steps read the strip's first pair, with B zero)
        xi0 = xoff + t * int64(4)
        if nst > int64(0):
            load(frag, x, wa, xa, ea, ci if nreal > int64(0) else ci0, xi if nreal > int64(0) else xi0, lane, g, t)
        # for the split's check: |e|'s range over the weight (`k_frag_erange`, after the chunks)
        emax = uint32(0)
        emin = uint32(0xFFFFFFFF)
        if tid < int64(RANGE_BLOCKS):
            emax, emin = ld2(frag, (N // int64(STRIP)) * nkt * int64(tail) + tid * int64(2))
        # and the block's x range: 8 rows a thread in two vector loads per pass of 8 * nt rows,
        # the first pass's loads in the warp's last step (before the loop, their wait delayed the
        # pipeline's second loads; after it, they added their whole wait to the block's end)
        k = p0 * int64(32) + tid * int64(8)
        xr_on = k < p1 * int64(32)
        s = int64(0)
        while s + int64(1) < nst:  # pairs alternate between register sets a and b
            step(frag, x, wb, xb, eb, wa, xa, ea, acc, part_b, s, nreal, ci, xi, ci0, xi0, lane, g, t, scr, base)
            if s + int64(2) >= nst:
                break
            step(frag, x, wa, xa, ea, wb, xb, eb, acc, part_b, s + int64(1), nreal, ci, xi, ci0, xi0, lane, g, t,
                 scr, base)
            s += int64(2)
        in_b = (nst & int64(1)) == int64(1)  # the last pair (nst - 1) is in set a, and x's rows go to b
        if nst > int64(0):
            if in_b:
                last_step(x, xb, wa, xa, ea, acc, part_b, nst - int64(1) < nreal, xoff + k, xr_on, scr, lane, base)
            else:
                last_step(x, xa, wb, xb, eb, acc, part_b, nst - int64(1) < nreal, xoff + k, xr_on, scr, lane, base)
        xmax = float32(0.0)
        xmin = uint32(0xFFFFFFFF)
        if nst > int64(0) and xr_on:  # the first pass, loaded by the last step
            for j in range(8):
                xmax, xmin = x_range(xmax, xmin, xb[j] if in_b else xa[j])
            k += int64(8 * nt)
        while k < p1 * int64(32):
            a0, a1, a2, a3 = ld4(x, xoff + k)
            a4, a5, a6, a7 = ld4(x, xoff + k + int64(4))
            for a in (a0, a1, a2, a3, a4, a5, a6, a7):
                xmax, xmin = x_range(xmax, xmin, a)
            k += int64(8 * nt)
        cuda.syncthreads()  # (rng initialised)
        cuda.atomic.max(rng, 0, f2u(xmax))
        cuda.atomic.min(rng, 1, xmin)
        if tid < int64(RANGE_BLOCKS):
            cuda.atomic.max(rng, 2, emax)
            cuda.atomic.min(rng, 3, emin)
        # tile i's outputs: lanes t = i // 2 hold C[g][2t] + C[g][2t + 1] (column 16i + g) and
        # C[g + 8][..] (column 16i + g + 8)
        for i in range(8):
            if int64(i >> 1) == t:
                red[warp * int64(STRIP) + int64(i * 16) + g] = float32(acc[4 * i] + acc[4 * i + 1])
                red[warp * int64(STRIP) + int64(i * 16) + g + int64(8)] = float32(acc[4 * i + 2] + acc[4 * i + 3])
        cuda.syncthreads()
        # some nonzero |x * e| of the block may lie outside [2**-100, 2**100] (or x, e not finite)
        fallback = not (u2f(rng[0]) * u2f(rng[2]) <= huge) or (
            rng[1] != uint32(0xFFFFFFFF) and rng[3] != uint32(0xFFFFFFFF)
            and u2f(rng[1] + uint32(1)) * u2f(rng[3] + uint32(1)) < tiny)
        col = strip * int64(STRIP) + tid
        v = float32(0.0)
        if tid < int64(STRIP):
            if fallback:  # some x * e of the block outside the split's range: FFMA in k order
                g2 = gbuf[0] if Q[Q_TWO] != int64(0) else float32(1.0)
                v = exact_sums(x, w32, scales, g2, col, p0 * int64(32), p1 * int64(32), Q[Q_NWR],
                               N >> Q[Q_LB], Q[Q_LB], xoff)
            else:
                v = red[tid]
                for w in range(1, WARPS):
                    v += red[int64(w * STRIP) + tid]
        if fallback and tid == int64(0):
            cnt[cuda.gridDim.x] = int32(1)  # the fallback flag (tests, diagnostics)
        if ks == int64(1):
            if tid < int64(STRIP):
                out[m0 * N + col] = v
            return
        if int64(cluster_size()) == ks:  # the strip's k-splits are one cluster: sums via rank 0's shared memory
            cluster_wait()
            if by > int64(0):
                if tid < int64(STRIP):
                    st_async_f32(xch, (by - int64(1)) * int64(STRIP) + tid, uint32(0), v, mbar)
                return
            if tid < int64(STRIP):
                while not mbar_try_wait(mbar):
                    pass
                s2 = float32(0.0)  # (0 + v, as the counter path adds: -0 becomes +0 either way)
                s2 += v
                for b in range(1, ks):
                    s2 += xch[(b - int64(1)) * int64(STRIP) + tid]
                out[m0 * N + col] = s2
            return
        if tid < int64(STRIP):
            part[by * N + col] = v
        cuda.threadfence()
        cuda.syncthreads()
        if tid == int64(0):
            last[0] = int32(1) if cuda.atomic.add(cnt, strip, int32(1)) == ks - int64(1) else int32(0)
        cuda.syncthreads()
        if last[0] == int32(1):  # the strip's last finisher adds the KS partials in order
            if tid < int64(STRIP):
                s2 = float32(0.0)
                for b in range(ks):
                    s2 += ldcg_f32(part, b * N + col)
                out[m0 * N + col] = s2
            if tid == int64(0):
                cnt[strip] = int32(0)

    return k_frag


@lru_cache(maxsize=None)
def frag_kernel(half: bool):
    return fast.K.jit_regs(REGS)(_frag_kernel(half))


SIG = gemv.SIG[:-1] + ", uint32[::1])"  # the GEMV's arguments, then the fragment copy


def ptx_targets():
    """(name, python function, signature, register cap) of every variant (`ptx.targets`)."""
    return ([(f"k_frag[{int(h)}]", _frag_kernel(h), SIG, REGS) for h in (True, False)]
            + [(f"k_frag_pack[{int(h)}]", _pack_kernel(h), PACK_SIG, None) for h in (True, False)]
            + [("k_frag_erange", k_frag_erange.py_func, ERANGE_SIG, None)])


def cluster_dims(grid: tuple) -> tuple | None:
    """The thread-block clusters a launch of grid `grid` (strips x KS) runs in: one cluster per
    strip, (1, KS, 1), for 2 <= KS <= `CLUSTER_MAX` on a GPU (their sums meet in rank 0's shared
    memory); None (the k-splits meet through global memory) under the simulator, for one split or
    more than `CLUSTER_MAX`, or with `CLUSTER_ENV` set to "0"."""
    ks = int(grid[1])
    if config.ENABLE_CUDASIM or not 2 <= ks <= CLUSTER_MAX or os.environ.get(CLUSTER_ENV, "1") == "0":
        return None
    return (1, ks, 1)


def buffers(Q: np.ndarray, half: bool):
    """(kernel, mb, Q as the kernel's tuple, grid, block, part, cnt); cnt holds the strip counters
    and, last, a flag the kernel sets when a block fell back to FFMA."""
    q, grid, block = plan(Q)
    ks = int(q[Q_KS])
    part = cuda.device_array(ks * int(q[Q_N]) if ks > 1 else 1, dtype=np.float32)
    cnt = cuda.to_device(np.zeros(grid[0] + 1, dtype=np.int32))
    return frag_kernel(half), 1, tuple(int(v) for v in q), grid, block, part, cnt
