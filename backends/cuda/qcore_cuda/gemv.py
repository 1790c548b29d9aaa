"""Fused dequantize-GEMV for small M: `out[m, n] = sum_k x[m, k] * decode(w[k, n]) * e[k, n]`.

Eligible (`geometry()`): a 2-D weight [K, N] on the fast layout (`fast.geometry`: codes along
N, per-tensor or power-of-two blocks along N) whose blocks span at least one u32 word of
codes (`B >= 32 / bits`), so a word's fields share one scale.

Block = 32 word-columns x 8 k-lanes (256 threads); grid = (word-columns / 32 / WPT, KS
k-splits). Thread (tx, ty) owns the columns of `WPT` consecutive u32 words (2 for M = 1: one
8-byte load per row, a warp reads 256 contiguous bytes) and the rows `k0 + ty + 8j` of its
block's k-range: per row its words, one f32 scale, x, each word decoded once
(`fast.decoder`: byte permutes for int8/int4) and used for up to `MB` rows of x (registers:
`MB * 32 / bits * WPT` accumulators). Rows go in steps of `UNROLL`; the next step's loads are
issued before the current step is computed (PREFETCH), so loads stay in flight. The choices
come from `benchmarks/gpu_tune.py` on the H200 (docs/performance.md). The 8 k-lanes are summed in shared memory, each block writes its partial sums to
`part[KS, MB, N]`, and the last block of a column-block to finish (a counter per column-block,
after a fence) adds the KS partials in a fixed order: the result does not depend on
scheduling (no float atomics), and the counter is back at 0 for the next call.

M > MB runs as ceil(M / MB) launches, each reading the weight once more.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from qcore.scheme import QuantScheme

from . import fast
from .intrin import ld1, ld2, ld4, ldcg_f32

from numba import config, cuda, float32, int32, int64, uint32  # noqa: E402

BDX, BDY = 32, 8
UNROLL = 2  # rows per step (a step's loads are in flight while the previous step computes)
PREFETCH = True
WPT = 2  # u32 words per thread and row (one 8-byte load)
RED_UNROLL = 8  # partial sums in flight in the final reduction
# Q (int64) layout
Q_K, Q_N, Q_NWR, Q_LB, Q_TWO, Q_KS, Q_RPB, Q_BLOCK = range(8)
Q_LEN = 8
SMS = 132  # H200; only sizes the grid (any GPU runs it)


def geometry(shape: tuple[int, ...], scheme: QuantScheme) -> tuple[int, np.ndarray] | None:
    """(kind, Q without KS/RPB) for a [K, N] weight, or None when the GEMV kernel does not apply."""
    if len(shape) != 2:
        return None
    fg = fast.geometry(shape, scheme)
    if fg is None:
        return None
    kind, G, _ = fg
    bits = fast.KIND_BITS[kind]
    if scheme.block is not None and scheme.block.dims[0] < 32 // bits:
        return None
    k_, n_ = shape
    Q = np.zeros(Q_LEN, dtype=np.int64)
    Q[Q_K], Q[Q_N], Q[Q_NWR] = k_, n_, n_ * bits // 32
    Q[Q_LB], Q[Q_TWO] = G[fast.G_LB], G[fast.G_TWO]
    Q[Q_BLOCK] = n_ if scheme.block is None else scheme.block.dims[0]  # columns under one scale
    return kind, Q


def config_for(kind: int, m: int, Q: np.ndarray) -> tuple[int, int]:
    """(mb, wpt) for m rows of x: M = 1 reads two u32 words per thread and row (8-byte loads);
    larger M one word, with up to 4 rows of x per launch (at most 32 accumulators per thread).
    Chosen by `benchmarks/gpu_tune.py` on the H200 (docs/performance.md)."""
    pw = 32 // fast.KIND_BITS[kind]
    if m == 1:
        return 1, (WPT if int(Q[Q_NWR]) % WPT == 0 else 1)
    return min(4, 32 // pw, 1 << (m - 1).bit_length()), 1


def plan(Q: np.ndarray, wpt: int = 1, per_sm: int = 4) -> tuple[np.ndarray, tuple[int, int], tuple[int, int]]:
    """(Q with KS/RPB, grid, block): one wave of resident 256-thread blocks (`per_sm` per SM)."""
    q = Q.copy()
    k_ = int(q[Q_K])
    gx = -(-int(q[Q_NWR]) // (BDX * wpt))
    if config.ENABLE_CUDASIM:
        ks = max(1, min(2, -(-k_ // 16)))
    else:
        ks = max(1, min(-(-k_ // (BDY * UNROLL * 2)), (SMS * per_sm) // gx))
    rpb = -(-k_ // ks)
    rpb = -(-rpb // BDY) * BDY
    ks = -(-k_ // rpb)
    q[Q_KS], q[Q_RPB] = ks, rpb
    return q, (gx, ks), (BDX, BDY)


def _gemv_kernel(kind: int, mb: int, wpt: int = WPT, unroll: int = UNROLL, prefetch: bool = PREFETCH):
    bits = fast.KIND_BITS[kind]
    pw = 32 // bits
    cpt = pw * wpt  # columns per thread
    na = cpt * mb  # accumulators per thread
    red_n = BDY * BDX * na
    nwv = unroll * wpt
    decode = fast.decoder(kind)
    is_e2m1 = kind == fast.KIND_E2M1

    @cuda.jit(device=True, inline="always")
    def load_rows(w32, scales, x, wv, ev, xv, k, kb1, nwr, wcol, N, col0, lb, one_scale, xrow):
        """Words, scales and x of rows k + 8u (u < unroll) into wv / ev / xv (zeros past kb1)."""
        for u in range(unroll):
            kk = k + int64(BDY * u)
            if kk < kb1:
                wi = kk * nwr + wcol
                if wpt == 1:
                    wv[u] = ld1(w32, wi)
                elif wpt == 2:
                    wv[2 * u], wv[2 * u + 1] = ld2(w32, wi)
                else:
                    wv[4 * u], wv[4 * u + 1], wv[4 * u + 2], wv[4 * u + 3] = ld4(w32, wi)
                if one_scale:
                    ev[u * wpt] = ld1(scales, (kk * N + col0) >> lb)
                else:
                    for i in range(wpt):
                        ev[u * wpt + i] = ld1(scales, (kk * N + col0 + int64(i * pw)) >> lb)
                xv[u] = ld1(x, xrow + kk)
            else:
                for i in range(wpt):
                    wv[u * wpt + i] = uint32(0)
                    ev[u * wpt + i] = float32(0.0)
                xv[u] = float32(0.0)

    def k_gemv(x, w32, scales, gbuf, lut, part, cnt, out, Q, m0, mc):
        tab = cuda.shared.array(16, float32)
        red = cuda.shared.array(red_n, float32)
        last = cuda.shared.array(1, int32)
        acc = cuda.local.array(na, float32)
        val = cuda.local.array(pw, float32)
        wv = cuda.local.array(nwv, uint32)
        ev = cuda.local.array(nwv, float32)
        xv = cuda.local.array(unroll, float32)
        wv2 = cuda.local.array(nwv, uint32)
        ev2 = cuda.local.array(nwv, float32)
        xv2 = cuda.local.array(unroll, float32)
        pv = cuda.local.array(RED_UNROLL, float32)
        tx = int64(cuda.threadIdx.x)
        ty = int64(cuda.threadIdx.y)
        tid = ty * int64(BDX) + tx
        if is_e2m1:
            if tid < int64(16):
                tab[tid] = lut[tid]
        K = Q[Q_K]
        N = Q[Q_N]
        nwr = Q[Q_NWR]
        lb = Q[Q_LB]
        two = Q[Q_TWO] != int64(0)
        ks = Q[Q_KS]
        rpb = Q[Q_RPB]
        one_scale = Q[Q_BLOCK] >= int64(cpt)  # the thread's columns share a scale slot
        g = gbuf[0]
        bx = int64(cuda.blockIdx.x)
        by = int64(cuda.blockIdx.y)
        wcol = (bx * int64(BDX) + tx) * int64(wpt)
        col0 = wcol * int64(pw)
        kb0 = by * rpb
        kb1 = min(kb0 + rpb, K)
        for a in range(na):
            acc[a] = float32(0.0)
        cuda.syncthreads()
        if wcol < nwr:
            k = kb0 + ty
            step = int64(BDY * unroll)
            if prefetch and k < kb1:
                load_rows(w32, scales, x, wv2, ev2, xv2, k, kb1, nwr, wcol, N, col0, lb, one_scale, m0 * K)
            while k < kb1:
                if prefetch:  # this step's rows were loaded during the last; start the next step's
                    for i in range(nwv):
                        wv[i] = wv2[i]
                        ev[i] = ev2[i]
                    for u in range(unroll):
                        xv[u] = xv2[u]
                    if k + step < kb1:
                        load_rows(w32, scales, x, wv2, ev2, xv2, k + step, kb1, nwr, wcol, N, col0, lb, one_scale,
                                  m0 * K)
                else:  # loads first: words, scales and x of `unroll` rows in flight
                    load_rows(w32, scales, x, wv, ev, xv, k, kb1, nwr, wcol, N, col0, lb, one_scale, m0 * K)
                for u in range(unroll):
                    if k + int64(BDY * u) >= kb1:
                        break
                    for i in range(wpt):
                        e = ev[u * wpt] if one_scale else ev[u * wpt + i]
                        if two:
                            e = float32(g * e)
                        decode(wv[u * wpt + i], tab, val, 0)
                        for m in range(mb):
                            if m < mc:
                                if m == 0:
                                    xe = float32(xv[u] * e)
                                else:
                                    xe = float32(ld1(x, (m0 + int64(m)) * K + k + int64(BDY * u)) * e)
                                for c in range(pw):
                                    acc[m * cpt + i * pw + c] = cuda.fma(xe, val[c], acc[m * cpt + i * pw + c])
                k += step
        # sum the 8 k-lanes: red[ty][tx][a]
        for a in range(na):
            red[(ty * int64(BDX) + tx) * int64(na) + int64(a)] = acc[a]
        cuda.syncthreads()
        j = tid
        while j < int64(BDX * na):
            s = float32(0.0)
            for y in range(BDY):
                s += red[int64(y * BDX * na) + j]
            t = j // int64(na)
            a = j - t * int64(na)
            m = a // int64(cpt)
            col = (bx * int64(BDX) + t) * int64(cpt) + (a - m * int64(cpt))
            if m < mc and col < N:
                part[(by * int64(mb) + m) * N + col] = s
            j += int64(BDX * BDY)
        cuda.threadfence()
        cuda.syncthreads()
        if tid == int64(0):
            last[0] = int32(1) if cuda.atomic.add(cnt, bx, int32(1)) == ks - int64(1) else int32(0)
        cuda.syncthreads()
        if last[0] == int32(1):  # the column-block's last finisher adds the KS partials in order
            j = tid
            while j < int64(BDX * na):
                t = j // int64(na)
                a = j - t * int64(na)
                m = a // int64(cpt)
                col = (bx * int64(BDX) + t) * int64(cpt) + (a - m * int64(cpt))
                if m < mc and col < N:
                    s = float32(0.0)
                    b = int64(0)
                    while b < ks:  # RED_UNROLL loads in flight, then added in order (deterministic)
                        for r in range(RED_UNROLL):
                            pv[r] = float32(0.0)
                            if b + int64(r) < ks:
                                pv[r] = ldcg_f32(part, ((b + int64(r)) * int64(mb) + m) * N + col)
                        for r in range(RED_UNROLL):
                            if b + int64(r) < ks:
                                s += pv[r]
                        b += int64(RED_UNROLL)
                    out[(m0 + m) * N + col] = s
                j += int64(BDX * BDY)
            if tid == int64(0):
                cnt[bx] = int32(0)

    return k_gemv


@lru_cache(maxsize=None)
def gemv_kernel(kind: int, mb: int, wpt: int):
    """64 registers (4 blocks per SM): measured faster than 128 even where 32 accumulators
    spill a few values to (L1-cached) local memory."""
    return fast.K._jit_regs(64)(_gemv_kernel(kind, mb, wpt))


SIG = ("void(float32[::1], uint32[::1], float32[::1], float32[::1], float32[::1], float32[::1], int32[::1], "
       "float32[::1], int64[::1], int64, int64)")


def ptx_targets():
    """(name, python function, signature) of every GEMV variant `config_for` picks, for the
    compile_ptx test."""
    out = []
    for kind in range(len(fast.KIND_BITS)):
        Q = np.zeros(Q_LEN, dtype=np.int64)
        Q[Q_NWR] = 2
        for mb, wpt in sorted({config_for(kind, m, Q) for m in (1, 2, 3, 4, 5, 16)} | {(1, 1)}):
            out.append((f"k_gemv[{kind},{mb},{wpt}]", _gemv_kernel(kind, mb, wpt), SIG))
    return out


def buffers(Q: np.ndarray, kind: int, m: int):
    """(kernel, mb, Q, grid, block, part, cnt) for m rows of x; part holds the largest launch's
    partial sums, cnt the zeroed column-block counters."""
    mb, wpt = config_for(kind, m, Q)
    q, grid, block = plan(Q, wpt)
    part = cuda.device_array(max(1, int(q[Q_KS]) * mb * int(q[Q_N])), dtype=np.float32)
    cnt = cuda.to_device(np.zeros(grid[0], dtype=np.int32))
    return gemv_kernel(kind, mb, wpt), mb, cuda.to_device(q), grid, block, part, cnt
