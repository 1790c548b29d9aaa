"""Tensor-core GEMV with the weight staged in shared memory: `out[m, n] = sum_k x[m, k] *
decode(w[k, n]) * e[k, n]`, for up to 16 rows of x per launch.

The arithmetic is `tc.py`'s (TF32 `mma.sync.m16n8k8`, `x * e` split into hi and lo, the FFMA
range fallback; its docstring has the precision argument); what differs is how the weight
reaches the warps. In `tc.py` each lane loads its own fragment words from global memory, 16
bytes of each of 4 rows per warp instruction, and the registers those loads need cap the bytes
in flight (~16 KB per SM, ~1 TB/s). Here a block owns a tile of `8 * gw` column groups (32
columns each: 512 columns at gw = 2) and streams its rows through a ring of `depth` stages in
shared memory with `cp.async`: a stage is `sr` rows of the tile (4 KB of codes: one 16-byte copy
per thread, a warp copying whole rows of 128 contiguous bytes or more), the rows' scales of the
tile and the rows' x values. No register holds a byte in flight, so `depth - 1` stages (~25 KB)
per block are in flight while the warps compute the oldest.

Stage layout (4-byte words): codes `[sr][rw + pad]` (rw = the tile row's words; the pad puts
the 4 rows a warp instruction reads in distinct banks), scales `[sr][tw + 1]` (tw slots: the
tile's blocks of at least 32 columns; a larger block or one scale per tensor uses slot 0), x
`[8 mg][sr + 4]`. Rows past the block's k-range, columns past N and slots past the row's end
are stored as zeros, so they add exact zeros (a zero x times a finite decoded code).

Warp w computes the tile's groups w * gw .. w * gw + gw - 1 over every row of the block's
k-range, in k order: its lanes read their fragment words from the stage (lane (g, t): rows
8s + t and 8s + t + 4, the word holding codes 4g..4g+3 of the group, as in tc.py). So a warp
ends with whole sums for its outputs (no sum across warps); with KS > 1 k-splits the blocks
write partial sums and the last block of a column-block adds them in split order (a counter
per column-block, after a fence), as in `gemv.py`: results do not depend on scheduling.

The loop, per stage i: wait for the thread's copies of stage i (`cp_wait(depth - 2)`), a
block barrier (every thread's copies visible; every warp done with stage i - 1), issue stage
i + depth - 1 into stage i - 1's slot, commit, compute stage i.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from . import fast, gemv
from .gemv import Q_K, Q_KS, Q_LB, Q_N, Q_NWR, Q_RPB, Q_TWO
from .intrin import abs_bits_m1, cp_async, cp_commit, cp_wait, f2u, fmax_nan, ldcg_f32, mma_tf32
from .tc import GROUP, HUGE, MAX_MB, SCR, TINY, WARPS, _exact_sums, tf32_hi

from numba import config, cuda, float32, int32, int64, uint32  # noqa: E402

GW = 2  # column groups per warp: a tile of 8 * GW groups (512 columns) per block
STAGE_BYTES = 4096  # code bytes per stage: one 16-byte copy per thread
MAX_DEPTH = 6  # ring stages
SMEM = 46 * 1024  # static shared memory per block the ring may take (48 KB less the rest)
REGS = 128  # register cap per thread
PER_SM = 2  # resident blocks per SM the grid is sized for
RED_LOADS = 32  # partial sums in flight per thread in the final sum
THREADS = 32 * WARPS


class Shape:
    """Compile-time sizes of a kernel variant (4-byte words unless named otherwise)."""

    def __init__(self, bits: int, gw: int, mg: int, sr: int | None = None, depth: int | None = None):
        self.tw = WARPS * gw  # column groups per tile
        self.rw = self.tw * bits  # code words per tile row
        self.rwp = self.rw + max(4, bits)  # row stride: rows t = 0..3 in distinct banks, 16-byte aligned
        sim = config.ENABLE_CUDASIM
        self.sr = sr or (8 if sim else max(8, STAGE_BYTES // (4 * self.rw)))  # rows per stage
        self.twp = self.tw + 1  # scale row stride
        self.xm = 8 * mg  # rows of x
        self.xst = self.sr + 4  # x row stride: rows 8q + g in distinct banks
        self.stage = (self.sr * self.rwp, self.sr * self.twp, self.xm * self.xst)
        self.depth = depth or (3 if sim else min(MAX_DEPTH, SMEM // (4 * sum(self.stage))))
        assert self.depth >= 2 and self.sr % 8 == 0


def copy_words(nwr: int) -> int:
    """Words per cp.async of codes: 16-byte copies where every row starts 16-byte aligned."""
    return 4 if nwr % 4 == 0 else 2 if nwr % 2 == 0 else 1


def config_for(m: int, Q: np.ndarray) -> tuple[int, int, int]:
    """(mg, gw, cw): groups of 8 rows of x per launch, column groups per warp, words per copy."""
    return (1 if m <= 8 else 2), GW, copy_words(int(Q[Q_NWR]))


def plan(Q: np.ndarray, kind: int, mg: int, gw: int = GW, sr: int | None = None,
         per_sm: int = PER_SM) -> tuple[np.ndarray, tuple[int, int], tuple[int, int]]:
    """(Q with KS/RPB, grid, block): tiles of 8 * gw groups x KS k-splits, about one wave of
    `per_sm` blocks per SM; rpb a multiple of the stage rows."""
    sh = Shape(fast.KIND_BITS[kind], gw, mg, sr)
    gx = -(-int(Q[Q_N]) // (sh.tw * GROUP))
    q = gemv.k_split(Q, gx, per_sm, 2 * sh.sr, sh.sr, sh.sr)
    return q, (gx, int(q[Q_KS])), (32, WARPS)


def _tcs_kernel(kind: int, mg: int, gw: int = GW, cw: int = 4, sr: int | None = None, depth: int | None = None):
    """The kernel for value kind `kind`, `mg` groups of 8 rows of x, `gw` column groups per warp,
    `cw` words per copy of codes (`copy_words`), `sr` rows per stage and `depth` stages (None:
    `Shape`'s choice)."""
    bits = fast.KIND_BITS[kind]
    pw = 32 // bits
    decode = fast.decoder(kind)
    is_e2m1 = kind == fast.KIND_E2M1
    sh_ = Shape(bits, gw, mg, sr, depth)
    tw, rw, rwp, sr, twp, xm, xst, depth = sh_.tw, sh_.rw, sh_.rwp, sh_.sr, sh_.twp, sh_.xm, sh_.xst, sh_.depth
    wstage, estage, xstage = sh_.stage
    ws_n, es_n, xs_n = depth * wstage, depth * estage, depth * xstage  # (array sizes must be single constants)
    tcols = tw * GROUP  # columns per tile
    cpr = rw // cw  # copies per tile row
    ncode, nsc, nxc = sr * cpr, sr * tw, xm * sr  # copies per stage: codes, scales, x
    nci, nsi, nxi = (-(-n // THREADS) for n in (ncode, nsc, nxc))
    copy_w, copy_1, wait = cp_async(cw), cp_async(1), cp_wait(depth - 2)
    nacc = gw * mg * 16
    nval = 2 * pw
    opt = tcols * xm // THREADS  # outputs per thread in the final sum
    rb = max(1, RED_LOADS // opt)  # partial sums per output per batch
    npv = opt * rb
    scr_n = SCR * WARPS if config.ENABLE_CUDASIM else 1
    exact_sums = _exact_sums(kind, mg, gw)
    tiny, huge = uint32(TINY), float32(HUGE)

    @cuda.jit(device=True, inline="always")
    def issue(x, w32, scales, ws, es, xs, d, k0, kb1, K, nwr, srow, lb, col0, tw0, nslr, m0, mc, tid):
        """Copies of rows [k0, k0 + sr) of the tile into stage slot d (zeros past the data)."""
        wb = d * int64(wstage)
        for it in range(nci):
            c = tid + int64(it * THREADS)
            if ncode % THREADS == 0 or c < int64(ncode):
                r = c // int64(cpr)
                ch = c - r * int64(cpr)
                k = k0 + r
                wcol = tw0 + ch * int64(cw)
                dst = wb + r * int64(rwp) + ch * int64(cw)
                if k < kb1 and wcol < nwr:
                    copy_w(ws, dst, w32, k * nwr + wcol)
                else:
                    for z in range(cw):
                        ws[dst + int64(z)] = uint32(0)
        eb = d * int64(estage)
        s0 = col0 >> lb
        for it in range(nsi):
            c = tid + int64(it * THREADS)
            if nsc % THREADS == 0 or c < int64(nsc):
                r = c // int64(tw)
                j = c - r * int64(tw)
                k = k0 + r
                dst = eb + r * int64(twp) + j
                if k < kb1 and j < nslr:
                    copy_1(es, dst, scales, k * srow + s0 + j)
                else:
                    es[dst] = float32(0.0)
        xb = d * int64(xstage)
        for it in range(nxi):
            c = tid + int64(it * THREADS)
            if nxc % THREADS == 0 or c < int64(nxc):
                m = c // int64(sr)
                r = c - m * int64(sr)
                k = k0 + r
                dst = xb + m * int64(xst) + r
                if k < kb1:  # rows of x past mc read row mc - 1 (their sums are not written)
                    copy_1(xs, dst, x, (m0 + min(m, mc - int64(1))) * K + k)
                else:
                    xs[dst] = float32(0.0)

    @cuda.jit(device=True, inline="always")
    def compute(ws, es, xs, d, acc, val, tab, g2, sh, scr, lane, base, lim, limu, wo, so, xo):
        """The mma of stage slot d: lane (g, t) reads rows 8s + t and 8s + t + 4, its group words
        wo[c], scale slots so[c] and x rows xo[q] (row offset + t)."""
        wb = d * int64(wstage)
        eb = d * int64(estage)
        xb = d * int64(xstage)
        for s in range(sr // 8):
            for c in range(gw):
                w0 = ws[wb + int64(8 * s * rwp) + wo[c]]
                w1 = ws[wb + int64((8 * s + 4) * rwp) + wo[c]]
                e0 = float32(g2 * es[eb + int64(8 * s * twp) + so[c]])  # g2 = 1 for one-level scales: exact
                e1 = float32(g2 * es[eb + int64((8 * s + 4) * twp) + so[c]])
                decode(w0 >> sh, tab, val, 0)
                decode(w1 >> sh, tab, val, pw)
                for q in range(mg):
                    x0 = xs[xb + xo[q] + int64(8 * s)]
                    x1 = xs[xb + xo[q] + int64(8 * s + 4)]
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

    def k_tcs(x, w32, scales, gbuf, lut, part, cnt, out, Q, m0, mc):
        tab = cuda.shared.array(16, float32)
        ws = cuda.shared.array(ws_n, uint32)
        es = cuda.shared.array(es_n, float32)
        xs = cuda.shared.array(xs_n, float32)
        scr = cuda.shared.array(scr_n, float32)
        last = cuda.shared.array(1, int32)
        acc = cuda.local.array(nacc, float32)
        val = cuda.local.array(nval, float32)
        wo = cuda.local.array(gw, int64)
        so = cuda.local.array(gw, int64)
        fofs = cuda.local.array(gw, int64)
        sofs = cuda.local.array(gw, int64)
        xo = cuda.local.array(mg, int64)
        xofs = cuda.local.array(mg, int64)
        pv = cuda.local.array(npv, float32)
        rs = cuda.local.array(opt, float32)
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
        srow = N >> lb  # scale slots per row (0 for one per tensor)
        g2 = gbuf[0] if Q[Q_TWO] != int64(0) else float32(1.0)
        bx = int64(cuda.blockIdx.x)
        by = int64(cuda.blockIdx.y)
        g = lane >> int64(2)
        t = lane & int64(3)
        sh = uint32((g * int64(4 * bits)) & int64(31))
        sh2 = uint32((t * int64(8 * bits)) & int64(31))
        col0 = bx * int64(tcols)
        tw0 = bx * int64(rw)
        nslr = int64(1)  # scale slots per tile row
        if srow > int64(0):
            nslr = min(max(int64(1), int64(tcols) >> lb), srow - (col0 >> lb))
        for c in range(gw):
            grp = warp * int64(gw) + int64(c)  # the group within the tile
            wo[c] = t * int64(rwp) + grp * int64(bits) + ((g * int64(bits)) >> int64(3))  # codes 4g..4g+3
            so[c] = t * int64(twp) + ((grp * int64(GROUP)) >> lb)
            gg = min(bx * int64(tw) + grp, (N >> int64(5)) - int64(1))  # (groups past N: their sums are not written)
            fofs[c] = gg * int64(bits) + ((t * int64(8 * bits)) >> int64(5))  # codes 8t..8t+7 (exact_sums)
            sofs[c] = (gg * int64(GROUP)) >> lb
        for q in range(mg):
            xo[q] = (int64(8 * q) + g) * int64(xst) + t
            xofs[q] = (m0 + min(int64(8 * q) + g, mc - int64(1))) * K
        for a in range(nacc):
            acc[a] = float32(0.0)
        lim[0] = float32(0.0)
        limu[0] = uint32(0xFFFFFFFF)
        base = warp * int64(SCR)
        kb0 = by * rpb
        kb1 = min(kb0 + rpb, K)
        nst = (kb1 - kb0 + int64(sr - 1)) // int64(sr)  # stages of this block
        for i in range(depth - 1):
            if int64(i) < nst:
                issue(x, w32, scales, ws, es, xs, int64(i), kb0 + int64(i * sr), kb1, K, nwr, srow, lb, col0, tw0,
                      nslr, m0, mc, tid)
            cp_commit()
        cuda.syncthreads()  # (the E2M1 table)
        d = int64(0)  # the slot computed next
        dn = int64(depth - 1)  # the slot issued next
        i = int64(0)
        while i < nst:
            wait()
            cuda.syncthreads()
            j = i + int64(depth - 1)
            if j < nst:
                issue(x, w32, scales, ws, es, xs, dn, kb0 + j * int64(sr), kb1, K, nwr, srow, lb, col0, tw0,
                      nslr, m0, mc, tid)
            cp_commit()
            compute(ws, es, xs, d, acc, val, tab, g2, sh, scr, lane, base, lim, limu, wo, so, xo)
            d = d + int64(1) if d + int64(1) < int64(depth) else int64(0)
            dn = dn + int64(1) if dn + int64(1) < int64(depth) else int64(0)
            i += int64(1)
        bad = not (lim[0] <= huge) or limu[0] < tiny
        if cuda.syncthreads_or(int32(1) if bad else int32(0)):
            # some x * e of the block outside the split's range: its sums again with FFMA
            exact_sums(x, w32, scales, tab, val, acc, g2, kb0, kb1, nwr, srow, fofs, sofs, xofs, sh2)
            if tid == int64(0):
                cnt[cuda.gridDim.x] = int32(1)  # the fallback flag (tests, diagnostics)
        # C rows g (hi) and g + 8 (lo) of tile j are x-row 8q + g, columns 4n + j (n = 2t, 2t + 1)
        for c in range(gw):
            gcol = col0 + (warp * int64(gw) + int64(c)) * int64(GROUP)
            for q in range(mg):
                orow = int64(8 * q) + g
                for j in range(4):
                    b = ((c * mg + q) * 4 + j) * 4
                    for e in range(2):
                        col = gcol + int64(j) + int64(4) * (int64(2) * t + int64(e))
                        if orow < mc and col < N:
                            v = float32(acc[b + e] + acc[b + 2 + e])
                            if ks == int64(1):
                                out[(m0 + orow) * N + col] = v
                            else:
                                part[(by * int64(MAX_MB) + orow) * N + col] = v
        if ks == int64(1):
            return
        cuda.threadfence()
        cuda.syncthreads()
        if tid == int64(0):
            last[0] = int32(1) if cuda.atomic.add(cnt, bx, int32(1)) == ks - int64(1) else int32(0)
        cuda.syncthreads()
        if last[0] == int32(1):  # the column-block's last finisher adds the KS partials in order
            for i2 in range(opt):
                rs[i2] = float32(0.0)
            b0 = int64(0)
            while b0 < ks:  # opt outputs x rb partials in flight, then added in split order
                for i2 in range(opt):
                    o = tid + int64(i2 * THREADS)
                    orow = o // int64(tcols)
                    col = col0 + (o - orow * int64(tcols))
                    ok = orow < mc and col < N
                    for r in range(rb):
                        pv[i2 * rb + r] = float32(0.0)
                        if ok and b0 + int64(r) < ks:
                            pv[i2 * rb + r] = ldcg_f32(part, ((b0 + int64(r)) * int64(MAX_MB) + orow) * N + col)
                for i2 in range(opt):
                    for r in range(rb):
                        if b0 + int64(r) < ks:
                            rs[i2] += pv[i2 * rb + r]
                b0 += int64(rb)
            for i2 in range(opt):
                o = tid + int64(i2 * THREADS)
                orow = o // int64(tcols)
                col = col0 + (o - orow * int64(tcols))
                if orow < mc and col < N:
                    out[(m0 + orow) * N + col] = rs[i2]
            if tid == int64(0):
                cnt[bx] = int32(0)

    return k_tcs


@lru_cache(maxsize=None)
def tcs_kernel(kind: int, mg: int, gw: int, cw: int):
    return fast.K._jit_regs(REGS)(_tcs_kernel(kind, mg, gw, cw))


SIG = gemv.SIG


def ptx_targets():
    """(name, python function, signature) of every variant the backend launches."""
    out = []
    for kind in range(len(fast.KIND_BITS)):
        for cw in sorted({copy_words(n * fast.KIND_BITS[kind] // 32) for n in (32, 64)}):
            out += [(f"k_tcs[{kind},{mg},{cw}]", _tcs_kernel(kind, mg, GW, cw), SIG) for mg in (1, 2)]
    return out


def buffers(Q: np.ndarray, kind: int, m: int):
    """(kernel, mb, Q as the kernel's tuple, grid, block, part, cnt) for m rows of x; cnt holds
    the column-block counters and, last, a flag the kernel sets when a block fell back to FFMA."""
    mg, gw, cw = config_for(m, Q)
    q, grid, block = plan(Q, kind, mg, gw)
    ks = int(q[Q_KS])
    part = cuda.device_array(ks * MAX_MB * int(q[Q_N]) if ks > 1 else 1, dtype=np.float32)  # (unused at KS = 1)
    cnt = cuda.to_device(np.zeros(grid[0] + 1, dtype=np.int32))  # + the fallback flag
    return tcs_kernel(kind, mg, gw, cw), 8 * mg, tuple(int(v) for v in q), grid, block, part, cnt
