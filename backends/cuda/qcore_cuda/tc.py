"""Tensor-core GEMV for 4 <= M <= 16: `out[m, n] = sum_k x[m, k] * decode(w[k, n]) * e[k, n]`.

The FFMA kernel (`gemv.py`) spends one FFMA per weight and row of x, and from M = 5 its
accumulators fill the register file (M = 8: 64 per thread, one block per SM); here
`mma.sync.m16n8k8` (TF32 in, f32 accumulate) does the products: a warp decodes each weight once
for up to 16 rows of x, so its time hardly grows with M where the FFMA kernel's grows in steps
of launches. At M <= 2 the FFMA kernel is faster (docs/performance.md has the current figures).

Precision. The scale varies along k, so it goes into the A operand: `v = x[m, k] * e[k, nb]`
(f32, rounded as the FFMA kernel rounds it), split as `hi` = v rounded to 11 significant bits
and `lo = v - hi` (exact), of which the tensor core reads the top 11 significant bits
(|v - hi - lo'| < 2**-21 |v|); hi is row m of A, lo row m + 8, so rows 0-7 of C sum x * e * code
over hi and rows 8-15 over lo, and the thread adds the two at the end. The codes (B) are exact in
TF32 (every value kind has at most 8 significant bits), so each product is exact and the error
is the split's 2**-21 per term plus the f32 accumulation: inside the conformance bound
(`matmul_rel * K * 2**-24 * (|x| @ |W|)`, K * 2**-23 for matmul_rel = 2) for K >= `MIN_K`. The
split needs the parts normal: a block where some nonzero |v| is below 2**-100 or above 2**100
(or not finite) recomputes its sums with FFMA in k order (`exact_sums`; the block barrier ORs
the flag, and the kernel sets `cnt[gridDim.x]`), so tiny, huge, infinite and NaN inputs get f32
FFMA sums, as from the FFMA kernel.

Layout. A 32-column group of a row is 32 * bits / 32 u32 words; lane (g, t) reads the word
holding codes 4g..4g+3 of the group (one u32 load, shifted to the low bits), so its B values
for tile j (j = 0..3) are column 4g + j: tile j is the columns {4g + j}, and C[r][n] of tile j is
column 4n + j. Each of `WARPS` warps of a block takes a contiguous k-range of the block's rows
(`rpb / WARPS`, a multiple of 8) for `GW` groups of columns and `MG` groups of 8 rows of x, in
register sets of `U` steps of 8 rows (two sets alternating: one set's loads in flight while the
other computes). In a set starting at row k, lane t takes the R = 2U consecutive rows
k + R t .. k + R t + R - 1, and step s feeds rows k + R t + 2s and + 2s + 1 to A/B positions t
and t + 4 (any bijection of a step's rows onto the 8 positions gives the same sums): so the
lane's R scales and R x values of a row of x are R / 4 vector loads each: a warp instruction then
touches a few cache lines instead of the 4 and 8 rows of per-step loads of rows k + t and
k + t + 4, which is what limited the kernel. The scales come in slot order and as effective
scales (`slot_scales`: [slots per row, K] of `two_level_e(g, s_b)`, built once per weight and
kept with it, so the loop multiplies no global scale and takes no branch for a reciprocal one),
where a lane's rows are consecutive; x's rows are consecutive already (K a multiple of 4: 16-byte aligned
rows). Weight words stay one u32 per row and group (4 rows per warp instruction). Rows past the block's
range read a row inside it and are zeroed, so every warp runs the same steps (the simulator's
mma twin needs every thread of the block at each call). The warps' sums meet in shared memory
and are added in warp order; with KS > 1 k-splits the blocks write partial sums and the last
block of a column-block adds them in split order (a counter per column-block, after a fence),
as in `gemv.py`: results do not depend on scheduling.

Eligible (`geometry`): the GEMV's (`gemv.geometry`) with N a multiple of 32, blocks of at
least 32 columns (or one scale for the tensor), K >= `MIN_K` and a multiple of 4; chosen for
`MIN_M <= M` (`use_for`).
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from . import fast, gemv
from .devmath import two_level_e
from .gemv import Q_BLOCK, Q_K, Q_KS, Q_LB, Q_N, Q_NWR, Q_RPB, Q_TWO
from .intrin import abs_bits_m1, f2u, fmax_nan, ld1, ld2, ld4, ldcg_f32, mma_tf32, u2f

from numba import config, cuda, float32, int32, int64, uint32  # noqa: E402

WARPS = 8  # warps per block, each a contiguous k-range of the block's rows
GROUP = 32  # columns per group: 4 tiles of 8
MIN_K = 64  # below, the FFMA kernel (the split's 2**-21 per term against the bound's K * 2**-23)
MIN_M = 4  # rows of x from which the backend takes this kernel (benchmarks/gpu_tune.py: the FFMA
# kernel is faster at M <= 2, this one from M = 4)
MAX_MB = 16  # rows of x per launch (two groups of 8)
SCR = 192  # simulator: f32 scratch per warp for the mma twin (A 16 x 8, B 8 x 8)
TINY = 0x0D800000 - 1  # |v| bits below 2**-100 (as |v| - 1, so that 0 wraps above)
HUGE = 2.0 ** 100  # |v| above, infinities and NaNs


U = {1: 4, 2: 2}  # steps (8 rows of w each) per register set, per mg (mg = 2 spills with 4)
GW = 1  # groups of 32 columns per block
REGS = 128  # register cap per thread
PER_SM = 2  # resident blocks per SM the grid is sized for


def geometry(shape: tuple[int, ...], scheme) -> tuple[int, np.ndarray] | None:
    """(kind, Q without KS/RPB) when this kernel applies to a [K, N] weight, else None."""
    gg = gemv.geometry(shape, scheme)
    return gg if gg is not None and applies(gg[1]) else None


def applies(Q: np.ndarray) -> bool:
    """Whether this kernel takes a weight of GEMV geometry Q (`gemv.geometry`)."""
    return not (int(Q[Q_N]) % GROUP or int(Q[Q_BLOCK]) < GROUP or int(Q[Q_K]) < MIN_K or int(Q[Q_K]) % 4)


def use_for(m: int) -> bool:
    return m >= MIN_M


def config_for(m: int, Q: np.ndarray) -> tuple[int, int]:
    """(mg, gw): groups of 8 rows of x per launch, groups of 32 columns per block."""
    mg = 1 if m <= 8 else 2
    gw = GW if int(Q[Q_N]) % (GW * GROUP) == 0 else 1
    return mg, gw


def plan(Q: np.ndarray, gw: int, per_sm: int = PER_SM) -> tuple[np.ndarray, tuple[int, int], tuple[int, int]]:
    """(Q with KS/RPB, grid, block): column-blocks of gw groups x KS k-splits, about one wave of
    `per_sm` blocks per SM; rpb a multiple of 8 * WARPS."""
    gx = int(Q[Q_N]) // (GROUP * gw)
    unit = 8 * WARPS
    q = gemv.k_split(Q, gx, per_sm, unit * 2, unit, unit)
    return q, (gx, int(q[Q_KS])), (32, WARPS)


def _tc_kernel(kind: int, mg: int, gw: int = GW, u: int | None = None):
    """The kernel for value kind `kind`, `mg` groups of 8 rows of x, `gw` column groups per block
    and `u` steps per register set."""
    u = u or (1 if config.ENABLE_CUDASIM else U[mg])  # (the simulator: the fewest mma calls)
    bits = fast.KIND_BITS[kind]
    pw = 32 // bits
    decode = fast.decoder(kind)
    is_e2m1 = kind == fast.KIND_E2M1
    ntile = gw * mg * 4  # C tiles per lane
    nacc = ntile * 4
    nout = gw * GROUP * mg * 8  # outputs per block
    opt = nout // (32 * WARPS)  # outputs per thread in the final sum
    red_n = nout * WARPS
    nval = 2 * pw
    nwd = max(1, bits // 4)  # words holding 8 codes (exact_sums)
    R = 2 * u  # rows per lane and register set: k + R t .. k + R t + R - 1
    vw = 4 if R % 4 == 0 else 2  # floats per vector load of scales and x (R is even)
    nw = R * gw  # words per register set
    ne = R * gw  # scales per register set
    nx = R * mg  # x values per register set
    scr_n = SCR * WARPS if config.ENABLE_CUDASIM else 1
    wpg = bits  # u32 words per group row
    tiny, huge = uint32(TINY), float32(HUGE)

    @cuda.jit(device=True, inline="always")
    def tf32_hi(v):
        """v rounded to 11 significant bits (half up in magnitude; v finite, below 2**127): three
        instructions, where `cvt.rna.tf32.f32` compiles to four plus a NaN/infinity select."""
        return u2f((f2u(v) + uint32(0x1000)) & uint32(0xFFFFE000))

    @cuda.jit(device=True, inline="always")
    def ldv(a, i, dst, j):
        """dst[j..j+vw) = a[i..i+vw) (one vector load)."""
        if vw == 4:
            dst[j], dst[j + 1], dst[j + 2], dst[j + 3] = ld4(a, i)
        else:
            dst[j], dst[j + 1] = ld2(a, i)

    def set_functions(masked: bool):
        """(load, compute) of one register set of `u` steps. Unmasked: every row of the set lies
        in the warp's range. Masked: rows at or past kw1 read row kw1 - 1 and count as zero."""

        @cuda.jit(device=True, inline="always")
        def load(w32, et, x, wv, ev, xv, kr, kw1, nwr, wofs, eofs, xofs):
            """The lane's rows kr .. kr + R - 1: words, effective scales (by slot, `slot_scales`) and x into
            wv/ev/xv; unmasked, the scales and x of the R rows come in vector loads."""
            wi = kr * nwr
            for i in range(R):
                r = int64(i)
                if masked:
                    r = min(kr + r, kw1 - int64(1)) - kr
                for c in range(gw):
                    wv[i * gw + c] = ld1(w32, wi + r * nwr + wofs[c])
                    if masked:
                        ev[c * R + i] = ld1(et, eofs[c] + kr + r)
                if masked:
                    for q in range(mg):
                        xv[q * R + i] = ld1(x, xofs[q] + kr + r)
            if not masked:
                for i in range(0, R, vw):
                    for c in range(gw):
                        ldv(et, eofs[c] + kr + int64(i), ev, c * R + i)
                    for q in range(mg):
                        ldv(x, xofs[q] + kr + int64(i), xv, q * R + i)

        @cuda.jit(device=True, inline="always")
        def compute(wv, ev, xv, acc, val, tab, kr, kw1, sh, scr, lane, base, lim, limu):
            """The mma of the set's `u` steps (step s: rows kr + 2s at A/B position t, kr + 2s + 1
            at t + 4); lim[0] = max |v| (NaN if any), limu[0] = min over v of (|v| bits - 1) as
            u32 (0 wraps above every nonzero |v|)."""
            for s in range(u):
                ok0 = True
                ok1 = True
                if masked:
                    ok0 = kr + int64(2 * s) < kw1
                    ok1 = kr + int64(2 * s + 1) < kw1
                for c in range(gw):
                    e0 = ev[c * R + 2 * s]  # effective scales (`slot_scales`)
                    e1 = ev[c * R + 2 * s + 1]
                    w0 = wv[(s * 2) * gw + c]
                    w1 = wv[(s * 2 + 1) * gw + c]
                    if masked:
                        w0 = w0 if ok0 else uint32(0)
                        w1 = w1 if ok1 else uint32(0)
                    decode(w0 >> sh, tab, val, 0)
                    decode(w1 >> sh, tab, val, pw)
                    for q in range(mg):
                        x0 = xv[q * R + 2 * s]
                        x1 = xv[q * R + 2 * s + 1]
                        if masked:
                            x0 = x0 if ok0 else float32(0.0)
                            x1 = x1 if ok1 else float32(0.0)
                        v0 = float32(x0 * e0)
                        v1 = float32(x1 * e1)
                        lim[0] = fmax_nan(lim[0], fmax_nan(abs(v0), abs(v1)))
                        limu[0] = min(limu[0], min(abs_bits_m1(f2u(v0)), abs_bits_m1(f2u(v1))))
                        h0 = tf32_hi(v0)
                        h1 = tf32_hi(v1)
                        l0 = float32(v0 - h0)  # exact; the tensor core reads its top 19 bits
                        l1 = float32(v1 - h1)
                        for j in range(4):
                            b = ((c * mg + q) * 4 + j) * 4
                            acc[b], acc[b + 1], acc[b + 2], acc[b + 3] = mma_tf32(
                                h0, l0, h1, l1, val[j], val[pw + j], acc[b], acc[b + 1], acc[b + 2], acc[b + 3],
                                scr, lane, base)

        return load, compute

    load_full, compute_full = set_functions(False)
    load_masked, compute_masked = set_functions(True)

    @cuda.jit(device=True, inline="always")
    def exact_sums(x, w32, scales, tab, val, acc, g2, kw0, kw1, nwr, srow, fofs, sofs, xofs, sh2):
        """The lane's outputs (C rows g of its tiles: x-rows 8q + g, columns 8t..8t+7 of each
        group) over the warp's rows [kw0, kw1) with FFMA in k order, into the hi slots of acc
        (the lo slots 0): the FFMA kernel's arithmetic, for blocks the split cannot take."""
        for a in range(nacc):
            acc[a] = float32(0.0)
        for k in range(kw0, kw1):
            for c in range(gw):
                e = two_level_e(g2, ld1(scales, k * srow + sofs[c]))
                for i in range(nwd):
                    decode(ld1(w32, k * nwr + fofs[c] + int64(i)) >> sh2, tab, val, i * pw)
                for q in range(mg):
                    xe = float32(ld1(x, xofs[q] + k) * e)
                    for j in range(4):
                        b = ((c * mg + q) * 4 + j) * 4
                        for h in range(2):
                            acc[b + h] = cuda.fma(xe, val[4 * h + j], acc[b + h])

    def k_tc(x, w32, scales, gbuf, lut, part, cnt, out, Q, m0, mc, et):
        tab = cuda.shared.array(16, float32)
        red = cuda.shared.array(red_n, float32)
        scr = cuda.shared.array(scr_n, float32)
        last = cuda.shared.array(1, int32)
        acc = cuda.local.array(nacc, float32)
        val = cuda.local.array(nval, float32)
        wa = cuda.local.array(nw, uint32)
        ea = cuda.local.array(ne, float32)
        xa = cuda.local.array(nx, float32)
        wb = cuda.local.array(nw, uint32)
        eb = cuda.local.array(ne, float32)
        xb = cuda.local.array(nx, float32)
        wofs = cuda.local.array(gw, int64)
        sofs = cuda.local.array(gw, int64)
        eofs = cuda.local.array(gw, int64)
        fofs = cuda.local.array(gw, int64)
        xofs = cuda.local.array(mg, int64)
        lim = cuda.local.array(1, float32)
        limu = cuda.local.array(1, uint32)
        lane = int64(cuda.threadIdx.x)
        warp = int64(cuda.threadIdx.y)
        tid = warp * int64(32) + lane
        if is_e2m1:
            if tid < int64(16):
                tab[tid] = lut[tid]
        K = Q[Q_K]
        N = Q[Q_N]
        nwr = Q[Q_NWR]
        lb = Q[Q_LB]
        ks = Q[Q_KS]
        rpb = Q[Q_RPB]
        srow = N >> lb
        g2 = gbuf[0] if Q[Q_TWO] != int64(0) else float32(1.0)
        bx = int64(cuda.blockIdx.x)
        by = int64(cuda.blockIdx.y)
        g = lane >> int64(2)
        t = lane & int64(3)
        sh = uint32((g * int64(4 * bits)) & int64(31))
        sh2 = uint32((t * int64(8 * bits)) & int64(31))
        for c in range(gw):
            grp = bx * int64(gw) + int64(c)
            wofs[c] = grp * int64(wpg) + ((g * int64(4 * bits)) >> int64(5))  # codes 4g..4g+3 of the group
            fofs[c] = grp * int64(wpg) + ((t * int64(8 * bits)) >> int64(5))  # codes 8t..8t+7 (exact_sums)
            sofs[c] = (grp * int64(GROUP)) >> lb
            eofs[c] = sofs[c] * K  # the group's slot in `slot_scales` order
        for q in range(mg):  # rows of x past mc read row mc - 1 (their sums are not written)
            xofs[q] = (m0 + min(int64(8 * q) + g, mc - int64(1))) * K
        for a in range(nacc):
            acc[a] = float32(0.0)
        lim[0] = float32(0.0)
        limu[0] = uint32(0xFFFFFFFF)
        base = warp * int64(SCR)
        kb0 = by * rpb
        kb1 = min(kb0 + rpb, K)
        rpw = rpb // int64(WARPS)
        kw0 = kb0 + warp * rpw  # this warp's rows: [kw0, kw1)
        kw1 = min(kw0 + rpw, kb1)  # (below kw0 for the last block's idle warps: every row masked)
        nset = (rpw + int64(8 * u - 1)) // int64(8 * u)  # the same for every warp (the simulator's mma)
        nfull = max(int64(0), min(nset, (kw1 - kw0) // int64(8 * u)))  # sets whose rows all lie in [kw0, kw1)
        k = kw0 + int64(R) * t  # the lane's first row of a set (its rows: k .. k + R - 1)
        cuda.syncthreads()
        if nfull > int64(0):
            load_full(w32, et, x, wa, ea, xa, k, kw1, nwr, wofs, eofs, xofs)
        st = int64(0)
        while st < nfull:  # whole sets, alternating between registers a and b
            if st + int64(1) < nfull:
                load_full(w32, et, x, wb, eb, xb, k + int64(8 * u), kw1, nwr, wofs, eofs, xofs)
            compute_full(wa, ea, xa, acc, val, tab, k, kw1, sh, scr, lane, base, lim, limu)
            k += int64(8 * u)
            st += int64(1)
            if st >= nfull:
                break
            if st + int64(1) < nfull:
                load_full(w32, et, x, wa, ea, xa, k + int64(8 * u), kw1, nwr, wofs, eofs, xofs)
            compute_full(wb, eb, xb, acc, val, tab, k, kw1, sh, scr, lane, base, lim, limu)
            k += int64(8 * u)
            st += int64(1)
        while st < nset:  # the rest, rows past kw1 zeroed
            load_masked(w32, et, x, wa, ea, xa, k, kw1, nwr, wofs, eofs, xofs)
            compute_masked(wa, ea, xa, acc, val, tab, k, kw1, sh, scr, lane, base, lim, limu)
            k += int64(8 * u)
            st += int64(1)
        bad = not (lim[0] <= huge) or limu[0] < tiny
        if cuda.syncthreads_or(int32(1) if bad else int32(0)):
            # some x * e of the block outside the split's range: its sums again with FFMA
            exact_sums(x, w32, scales, tab, val, acc, g2, kw0, kw1, nwr, srow, fofs, sofs, xofs, sh2)
            if tid == int64(0):
                cnt[cuda.gridDim.x] = int32(1)  # the fallback flag (tests, diagnostics)
        # this warp's sums per output: C rows g (hi) and g + 8 (lo) of tile j are x-row 8q + g,
        # columns 4n + j (n = 2t, 2t + 1) of group c
        for c in range(gw):
            for q in range(mg):
                for j in range(4):
                    b = ((c * mg + q) * 4 + j) * 4
                    orow = int64(8 * q) + g
                    for e in range(2):
                        ocol = int64(c * GROUP + j) + int64(4) * (int64(2) * t + int64(e))
                        red[warp * int64(nout) + orow * int64(gw * GROUP) + ocol] = float32(acc[b + e] + acc[b + 2 + e])
        cuda.syncthreads()
        for i in range(opt):  # the warps' sums in warp order
            o = tid + int64(i * 32 * WARPS)
            s = red[o]
            for w in range(1, WARPS):
                s += red[int64(w * nout) + o]
            red[o] = s
        cuda.syncthreads()
        if ks == int64(1):
            for i in range(opt):
                o = tid + int64(i * 32 * WARPS)
                orow = o // int64(gw * GROUP)
                col = bx * int64(gw * GROUP) + (o - orow * int64(gw * GROUP))
                if orow < mc:
                    out[(m0 + orow) * N + col] = red[o]
            return
        for i in range(opt):
            o = tid + int64(i * 32 * WARPS)
            orow = o // int64(gw * GROUP)
            col = bx * int64(gw * GROUP) + (o - orow * int64(gw * GROUP))
            if orow < mc:
                part[(by * int64(MAX_MB) + orow) * N + col] = red[o]
        cuda.threadfence()
        cuda.syncthreads()
        if tid == int64(0):
            last[0] = int32(1) if cuda.atomic.add(cnt, bx, int32(1)) == ks - int64(1) else int32(0)
        cuda.syncthreads()
        if last[0] == int32(1):  # the column-block's last finisher adds the KS partials in order
            for i in range(opt):
                o = tid + int64(i * 32 * WARPS)
                orow = o // int64(gw * GROUP)
                col = bx * int64(gw * GROUP) + (o - orow * int64(gw * GROUP))
                if orow < mc:
                    s = float32(0.0)
                    for b in range(ks):
                        s += ldcg_f32(part, (b * int64(MAX_MB) + orow) * N + col)
                    out[(m0 + orow) * N + col] = s
            if tid == int64(0):
                cnt[bx] = int32(0)

    return k_tc


@lru_cache(maxsize=None)
def tc_kernel(kind: int, mg: int, gw: int):
    return fast.K.jit_regs(REGS)(_tc_kernel(kind, mg, gw))


SIG = gemv.SIG[:-1] + ", float32[::1])"  # the GEMV's arguments, then the scales by slot


SLOT_SCALES_SIG = "void(float32[::1], float32[::1], float32[::1], int64, int64, int64, int64)"


@cuda.jit
def k_slot_scales(scales, gbuf, et, K, srow, n, two):
    """et[s * K + k] = two_level_e(g, scales[k * srow + s]) for the n = max(1, srow) * K entries
    (grid-stride); g = gbuf[0] for two-level scales (`two` != 0), else 1 (exact)."""
    g = gbuf[0] if two != int64(0) else float32(1.0)
    i = int64(cuda.grid(1))
    step = int64(cuda.gridsize(1))
    while i < n:
        s = i // K
        k = i - s * K
        et[i] = two_level_e(g, scales[k * srow + s])
        i += step


def slot_scale_args(scales, gbuf, Q: np.ndarray, et=None) -> tuple:
    """((grid, block), arguments) of `k_slot_scales` for a weight of GEMV geometry Q, writing `et`
    (None: a new array; the arguments' third)."""
    k_, srow = int(Q[Q_K]), int(Q[Q_N]) >> int(Q[Q_LB])
    n = max(1, srow) * k_
    if et is None:
        et = cuda.device_array(n, dtype=np.float32)
    return fast.K.launch(n), [scales, gbuf, et, k_, srow, n, int(Q[Q_TWO])]


def slot_scales(scales, gbuf, Q: np.ndarray):
    """The effective f32 scales of a [K, N] weight (the spec's effective scale: `g * s_b` for
    two-level scales, decoded and global from `scales` and `gbuf`) by slot: [slots per row, K] (one
    row of K for a scale per tensor), so that a lane's scales of consecutive rows are one vector load
    (the backend keeps it with the weight: 4 bytes per scale slot, as many as the decoded scales)."""
    cfg, args = slot_scale_args(scales, gbuf, Q)
    k_slot_scales[cfg](*args)
    return args[2]


def ptx_targets():
    """(name, python function, signature, register cap) of every variant the backend launches
    (`ptx.targets`)."""
    tc_kernels = [(f"k_tc[{kind},{mg}]", _tc_kernel(kind, mg), SIG, REGS)
                  for kind in range(len(fast.KIND_BITS)) for mg in (1, 2)]
    return tc_kernels + [("k_slot_scales", k_slot_scales.py_func, SLOT_SCALES_SIG,
                          fast.K.register_cap(k_slot_scales))]


def buffers(Q: np.ndarray, kind: int, m: int):
    """(kernel, mb, Q as the kernel's tuple, grid, block, part, cnt) for m rows of x; cnt holds
    the column-block counters and, last, a flag the kernel sets when a block fell back to FFMA."""
    mg, gw = config_for(m, Q)
    q, grid, block = plan(Q, gw)
    ks = int(q[Q_KS])
    part = cuda.device_array(ks * MAX_MB * int(q[Q_N]) if ks > 1 else 1, dtype=np.float32)  # (unused at KS = 1)
    cnt = cuda.to_device(np.zeros(grid[0] + 1, dtype=np.int32))  # + the fallback flag
    return tc_kernel(kind, mg, gw), 8 * mg, tuple(int(v) for v in q), grid, block, part, cnt
