"""Fused dequantize-GEMV for small M: `out[m, n] = sum_k x[m, k] * decode(w[k, n]) * e[k, n]`.

Eligible (`geometry()`): a 2-D weight [K, N] on the fast layout (`fast.geometry`: codes along
N, per-tensor or power-of-two blocks along N) whose blocks span at least one u32 word of
codes (`B >= 32 / bits`), so a word's fields share one scale.

Block = BDX word-columns x BDY k-lanes (256 threads; `tuning(...).shape`: 16 x 16 at mb = 2
and for 2-bit codes at mb = 1, 32 x 8 otherwise); grid = (word-columns / BDX / wpt, KS k-splits),
one wave of `tuning(...).per_sm` blocks per SM. Thread (tx, ty) owns the columns of `wpt` consecutive u32
words (`WPT` = 2 at M <= 2: one 8-byte load per row, so a warp reads two rows of 128
contiguous bytes at 16 x 16, one row of 256 at 32 x 8) and the rows `k0 + ty + BDY j` of its
block's k-range. Per row: its words, its f32 scale(s) and x, each word decoded once and used
for up to `mb` rows of x. Rows go in steps
of `tuning(...).rows` (8 at M = 1 for 8-bit codes and 4-bit integers under one scale slot a
thread, else 4), with no bounds checks inside a step (the last rows of a thread go one at
a time); with `PREFETCH` two register sets alternate, so one step's loads are in flight while
the other step computes. Indices advance by addition.

Decoding (`fast.decoder`): byte permutes under 2**23 for integers, the FP8 conversions, E2M1's
table. Each weight is decoded to its exact code value before the multiply: decoding to an
offset form and taking the bias off from a sum of x * e at the end saves an instruction per
weight, but the two sums round apart, so a column of zero codes under a nonzero scale would sum
to a few ulps of sum(x e) instead of 0, beyond the conformance bound. `TUNING` holds the
choices per mb (`TUNING_BY_KIND` per mb and value kind where they differ), the fastest variants
of `benchmarks/gpu_tune.py` on the H200.

The BDY k-lanes are summed in shared memory (odd stride: no bank conflicts; `RED_CH`
accumulators per pass), each block writes its partial sums to `part[KS, mb, N]`, and the last
block of a column-block to finish (a counter per column-block, after a fence) adds the KS
partials in split order, with up to `RED_LOADS` loads per thread in flight: the result does not
depend on scheduling (no float atomics), and the counter is back at 0 for the next call.

M > mb runs as ceil(M / mb) launches, each reading the weight once more (mb = 8 for 4-bit codes
at M > 4, with the whole register file: `config_for`, `tuning`). From M = 4 on the backend takes
the tensor-core kernel (`tc.py`) where it applies. The geometry Q goes to
the kernel by value (a tuple of int64 parameters), not as a device array: a thread's first loads
then wait on no read of Q from memory.
"""
from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import numpy as np

from qcore.spec.schemes import QuantScheme

from . import fast
from ._params import ParamLayout
from .devmath import two_level_e
from .intrin import ld1, ld2, ld4, ldcg_f32

from numba import config, cuda, float32, int32, int64, uint32  # noqa: E402

BDX, BDY = 32, 8  # the default block shape, word-columns x k-lanes (`Tuning.shape`)
PREFETCH = True  # two register sets: one step's loads in flight while the other step computes
WPT = 2  # u32 words per thread and row at M <= 2 (one 8-byte load)
MB_WIDE = 8  # rows of x per launch for M > 4 (4-bit codes): 64 accumulators per thread


class Tuning(NamedTuple):
    """Per rows-of-x-per-launch (mb) choices, from `benchmarks/gpu_tune.py` on the H200."""

    rows: int  # rows of w per step (their loads are issued together)
    regs: int  # register cap per thread
    per_sm: int  # resident 256-thread blocks per SM the grid is sized for (128 registers allow 2)
    shape: tuple[int, int] = (BDX, BDY)  # word-columns x k-lanes per block (256 threads)


TUNING = {
    # M = 1: 8 rows per step (8-bit codes, 4-bit integers; TUNING_BY_KIND has the others)
    1: Tuning(8, 128, 2),
    # M = 2: 16 x 16 blocks halve the k-splits (8 for 8192 x 8192 4-bit codes) against 32 x 8
    2: Tuning(4, 128, 2, (16, 16)),
    4: Tuning(4, 128, 2),
    MB_WIDE: Tuning(4, 255, 1),  # 64 accumulators need the whole register file
}
# (mb, value kind) where another variant is the fastest (`gpu_tune.py --scheme`): at M = 1
# 2-bit codes and E2M1 go 4 rows per step, 2-bit codes in 16 x 16 blocks
TUNING_BY_KIND = {
    (1, fast.KIND_I2): Tuning(4, 128, 2, (16, 16)),
    (1, fast.KIND_E2M1): Tuning(4, 128, 2),
}
NARROW_ROWS = 4  # rows per step at most where a thread's words lie under several scale slots (8 spill there)


def tuning(mb: int, kind: int | None = None, one_scale: bool = True) -> Tuning:
    """The choices for `mb` rows of x per launch (the next tabled mb up), for value kind `kind`
    and (`one_scale`) a thread's words under one scale slot."""
    mb = min(k for k in TUNING if k >= mb)
    t = TUNING_BY_KIND.get((mb, kind), TUNING[mb])
    return t if one_scale or t.rows <= NARROW_ROWS else t._replace(rows=NARROW_ROWS)


RED_LOADS = 32  # partial sums in flight per thread in the final reduction
RED_CH = 32  # accumulators per pass of the k-lane sum (shared memory: 256 x 33 f32 at most)
Q_LAYOUT = ParamLayout("Q", "int64", [
    ("Q_K", "rows of the weight (the reduction extent)"),
    ("Q_N", "columns of the weight"),
    ("Q_NWR", "u32 words of codes per row"),
    ("Q_LB", "log2 of the columns per scale slot (fast.py's G_LB)"),
    ("Q_TWO", "1: two-level"),
    ("Q_KS", "k-splits (set per launch: `k_split`)"),
    ("Q_RPB", "rows per k-split (tc.py: the same; frag.py: k-tile pairs per block)"),
    ("Q_BLOCK", "columns under one scale"),
], length_name="Q_LEN", by_value=True)
"""Q: the GEMV-family kernels' geometry (gemv.py, tc.py, frag.py), taken by value (a tuple)."""
Q_LAYOUT.define(globals())


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
    Q = Q_LAYOUT.pack(Q_K=k_, Q_N=n_, Q_NWR=n_ * bits // 32, Q_LB=G[fast.G_LB], Q_TWO=G[fast.G_TWO],
                      Q_BLOCK=n_ if scheme.block is None else scheme.block.dims[0])  # (columns under one scale)
    return kind, Q


def config_for(kind: int, m: int, Q: np.ndarray) -> tuple[int, int, bool]:
    """(mb, wpt, one_scale) for m rows of x. M = 1, and M = 2 of 8- and 4-bit codes, read `WPT`
    u32 words per thread and row (8-byte loads; fewer where the row's word count is not a
    multiple); otherwise one word, with up to 4 rows of x per launch (at most 32 accumulators
    per thread), or, for M > 4 rows of 4-bit codes, `MB_WIDE` (64 accumulators, `tuning`).
    The fastest variants of `benchmarks/gpu_tune.py` on the H200. `one_scale`: the
    thread's columns of a row lie under one scale slot (blocks of at least `wpt` words)."""
    pw = 32 // fast.KIND_BITS[kind]
    if m == 1 or (m == 2 and pw <= 8):
        mb, wpt = m, WPT
        while int(Q[Q_NWR]) % wpt:
            wpt //= 2
    elif m > 4 and pw == 8:
        mb, wpt = MB_WIDE, 1
    else:
        mb, wpt = min(4, 32 // pw, 1 << (m - 1).bit_length()), 1
    return mb, wpt, under_one_scale(kind, wpt, Q)


def under_one_scale(kind: int, wpt: int, Q: np.ndarray) -> bool:
    """Whether a thread's `wpt` words of a row lie under one scale slot (blocks of at least
    `wpt` words)."""
    return int(Q[Q_BLOCK]) >= wpt * (32 // fast.KIND_BITS[kind])


def plan(Q: np.ndarray, wpt: int = 1, per_sm: int = TUNING[4].per_sm, rows: int = TUNING[4].rows,
         shape: tuple[int, int] = (BDX, BDY)) -> tuple[np.ndarray, tuple[int, int], tuple[int, int]]:
    """(Q with KS/RPB, grid, block): one wave of resident blocks of `shape` (word-columns x
    k-lanes), `per_sm` per SM."""
    bdx, bdy = shape
    gx = -(-int(Q[Q_NWR]) // (bdx * wpt))
    q = k_split(Q, gx, per_sm, bdy * rows * 2, 16, bdy)
    return q, (gx, int(q[Q_KS])), (bdx, bdy)


def k_split(Q: np.ndarray, gx: int, per_sm: int, min_rows: int, sim_rows: int, align: int) -> np.ndarray:
    """Q with KS/RPB for `gx` column-blocks: KS k-splits of RPB rows (a multiple of `align`), as
    many as fill one wave of `per_sm` blocks per SM with at least `min_rows` rows each (under the
    simulator at most 2, of at least `sim_rows`: the cost there is per launched thread)."""
    k_ = int(Q[Q_K])
    if config.ENABLE_CUDASIM:
        ks = max(1, min(2, -(-k_ // sim_rows)))
    else:
        ks = max(1, min(-(-k_ // min_rows), (fast.K.sm_count() * per_sm) // gx))
    rpb = -(-(-(-k_ // ks)) // align) * align
    return Q_LAYOUT.replace(Q, Q_KS=-(-k_ // rpb), Q_RPB=rpb)


def _gemv_kernel(kind: int, mb: int, wpt: int = WPT, one_scale: bool = True, rows: int | None = None,
                 prefetch: bool = PREFETCH, shape: tuple[int, int] | None = None):
    """The GEMV kernel for value kind `kind`, `mb` rows of x per launch, `wpt` u32 words per
    thread and row (`one_scale`: under one scale slot, else one slot per word), `rows` rows per
    step, (`prefetch`) two register sets that alternate: one step's loads are in flight while
    the other step computes, and blocks of `shape` (word-columns x k-lanes; both default to
    `tuning(mb, kind, one_scale)`'s)."""
    t = tuning(mb, kind, one_scale)
    rows = rows or t.rows
    BDX, BDY = shape or t.shape  # this variant's block, under the module text's names
    bits = fast.KIND_BITS[kind]
    pw = 32 // bits
    cpt = pw * wpt  # columns per thread
    na = cpt * mb  # accumulators per thread
    rch = min(na, RED_CH)  # accumulators per pass of the k-lane sum
    red_n = BDY * BDX * (rch + 1)
    nbuf = rows * wpt
    nxr = rows * mb  # (local array sizes must be single constants)
    ipt = -(-(BDX * na) // (BDX * BDY))  # output items per thread in the final reduction
    rb = max(1, RED_LOADS // ipt)  # partials per item per batch (ipt * rb loads in flight)
    npv = ipt * rb
    decode = fast.decoder(kind)
    is_e2m1 = kind == fast.KIND_E2M1

    @cuda.jit(device=True, inline="always")
    def load_row(w32, scales, x, wv, ev, xv, u, wi, si, xi, xoff, col0, lb):
        """Row u of a step: the thread's words at wi, its scales in row-slot si, x at xi."""
        b = u * wpt
        if wpt == 1:
            wv[b] = ld1(w32, wi)
        elif wpt == 2:
            wv[b], wv[b + 1] = ld2(w32, wi)
        else:
            wv[b], wv[b + 1], wv[b + 2], wv[b + 3] = ld4(w32, wi)
        if one_scale:
            ev[b] = ld1(scales, si + (col0 >> lb))
        else:
            for i in range(wpt):
                ev[b + i] = ld1(scales, si + ((col0 + int64(i * pw)) >> lb))
        for m in range(mb):
            xv[u * mb + m] = ld1(x, xi + xoff[m])

    @cuda.jit(device=True, inline="always")
    def compute_row(wv, ev, xv, acc, val, tab, xe, u, g, two):
        """acc[m, column] += x[m] * e * decode(word) for row u of a step."""
        for i in range(wpt):
            if i == 0 or not one_scale:
                e = ev[u * wpt] if one_scale else ev[u * wpt + i]
                if two:
                    e = two_level_e(g, e)
                for m in range(mb):
                    xe[m] = float32(xv[u * mb + m] * e)
            decode(wv[u * wpt + i], tab, val, 0)
            for m in range(mb):
                for c in range(pw):
                    acc[m * cpt + i * pw + c] = cuda.fma(xe[m], val[c], acc[m * cpt + i * pw + c])

    @cuda.jit(device=True, inline="always")
    def load_step(w32, scales, x, wv, ev, xv, wi, si, xi, dw, ds, xoff, col0, lb):
        """The `rows` rows of a step starting at word index wi (rows dw words apart)."""
        for u in range(rows):
            load_row(w32, scales, x, wv, ev, xv, u, wi + int64(u) * dw, si + int64(u) * ds, xi + int64(u * BDY),
                     xoff, col0, lb)

    @cuda.jit(device=True, inline="always")
    def compute_step(wv, ev, xv, acc, val, tab, xe, g, two):
        for u in range(rows):
            compute_row(wv, ev, xv, acc, val, tab, xe, u, g, two)

    @cuda.jit(device=True, inline="always")
    def next_step(w32, scales, x, wn, en, xn, wc, ec, xc, acc, val, tab, xe, wi, si, xi, dw, ds, xoff, col0, lb,
                  g, two, load):
        """Advance to the next step and (`load`) issue its loads into set n, then compute set c:
        one half of the prefetch pipeline. Returns the next step's indices."""
        wi += int64(rows) * dw
        si += int64(rows) * ds
        xi += int64(rows * BDY)
        if load:
            load_step(w32, scales, x, wn, en, xn, wi, si, xi, dw, ds, xoff, col0, lb)
        compute_step(wc, ec, xc, acc, val, tab, xe, g, two)
        return wi, si, xi

    def k_gemv(x, w32, scales, gbuf, lut, part, cnt, out, Q, m0, mc):
        tab = cuda.shared.array(16, float32)
        red = cuda.shared.array(red_n, float32)
        last = cuda.shared.array(1, int32)
        acc = cuda.local.array(na, float32)
        val = cuda.local.array(pw, float32)
        xe = cuda.local.array(mb, float32)
        xoff = cuda.local.array(mb, int64)
        wa = cuda.local.array(nbuf, uint32)
        ea = cuda.local.array(nbuf, float32)
        xa = cuda.local.array(nxr, float32)
        wb = cuda.local.array(nbuf, uint32)
        eb = cuda.local.array(nbuf, float32)
        xb = cuda.local.array(nxr, float32)
        pv = cuda.local.array(npv, float32)
        rs = cuda.local.array(ipt, float32)
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
        srow = N >> lb  # scale slots per row (0 for one per tensor)
        g = gbuf[0]
        bx = int64(cuda.blockIdx.x)
        by = int64(cuda.blockIdx.y)
        wcol = (bx * int64(BDX) + tx) * int64(wpt)
        col0 = wcol * int64(pw)
        kb0 = by * rpb
        kb1 = min(kb0 + rpb, K)
        for m in range(mb):  # rows of x past mc read row mc - 1 (their sums are not written)
            xoff[m] = int64(min(m, mc - int64(1))) * K
        for a in range(na):
            acc[a] = float32(0.0)
        cuda.syncthreads()
        k = kb0 + ty
        if wcol < nwr and k < kb1:
            nrow = (kb1 - k + int64(BDY - 1)) // int64(BDY)  # this thread's rows: k, k + BDY, ...
            nstep = nrow // int64(rows)
            dw = int64(BDY) * nwr
            ds = int64(BDY) * srow
            wi = k * nwr + wcol
            si = k * srow
            xi = m0 * K + k
            if prefetch:  # steps alternate between register sets a and b
                if nstep > int64(0):
                    load_step(w32, scales, x, wa, ea, xa, wi, si, xi, dw, ds, xoff, col0, lb)
                s = int64(0)
                while s < nstep:
                    wi, si, xi = next_step(w32, scales, x, wb, eb, xb, wa, ea, xa, acc, val, tab, xe, wi, si, xi, dw,
                                           ds, xoff, col0, lb, g, two, s + int64(1) < nstep)
                    if s + int64(1) >= nstep:
                        s += int64(1)
                        break
                    wi, si, xi = next_step(w32, scales, x, wa, ea, xa, wb, eb, xb, acc, val, tab, xe, wi, si, xi, dw,
                                           ds, xoff, col0, lb, g, two, s + int64(2) < nstep)
                    s += int64(2)
            else:
                for s in range(nstep):
                    load_step(w32, scales, x, wa, ea, xa, wi, si, xi, dw, ds, xoff, col0, lb)
                    compute_step(wa, ea, xa, acc, val, tab, xe, g, two)
                    wi += int64(rows) * dw
                    si += int64(rows) * ds
                    xi += int64(rows * BDY)
            for r in range(nrow - nstep * int64(rows)):  # the last rows, one at a time
                load_row(w32, scales, x, wa, ea, xa, 0, wi, si, xi, xoff, col0, lb)
                compute_row(wa, ea, xa, acc, val, tab, xe, 0, g, two)
                wi += dw
                si += ds
                xi += int64(BDY)
        # sum the 8 k-lanes, rch accumulators per pass: red[ty][tx][a - a0]
        for a0 in range(0, na, rch):
            for a in range(a0, min(a0 + rch, na)):
                red[(ty * int64(BDX) + tx) * int64(rch + 1) + int64(a - a0)] = acc[a]  # odd stride: no bank conflicts
            cuda.syncthreads()
            nc = min(rch, na - a0)
            j = tid
            while j < int64(BDX * nc):
                s = float32(0.0)
                t = j // int64(nc)
                ac = j - t * int64(nc)
                for y in range(BDY):
                    s += red[(int64(y * BDX) + t) * int64(rch + 1) + ac]
                a = ac + int64(a0)
                m = a // int64(cpt)
                col = (bx * int64(BDX) + t) * int64(cpt) + (a - m * int64(cpt))
                if m < mc and col < N:
                    part[(by * int64(mb) + m) * N + col] = s
                j += int64(BDX * BDY)
            cuda.syncthreads()
        cuda.threadfence()
        cuda.syncthreads()
        if tid == int64(0):
            last[0] = int32(1) if cuda.atomic.add(cnt, bx, int32(1)) == ks - int64(1) else int32(0)
        cuda.syncthreads()
        if last[0] == int32(1):  # the column-block's last finisher adds the KS partials in order
            b = int64(0)
            for i in range(ipt):
                rs[i] = float32(0.0)
            while b < ks:  # loads of ipt items x rb partials in flight, then added in split order
                for i in range(ipt):
                    j = tid + int64(i * BDX * BDY)
                    t = j // int64(na)
                    a = j - t * int64(na)
                    m = a // int64(cpt)
                    col = (bx * int64(BDX) + t) * int64(cpt) + (a - m * int64(cpt))
                    ok = j < int64(BDX * na) and m < mc and col < N
                    for r in range(rb):
                        pv[i * rb + r] = float32(0.0)
                        if ok and b + int64(r) < ks:
                            pv[i * rb + r] = ldcg_f32(part, ((b + int64(r)) * int64(mb) + m) * N + col)
                for i in range(ipt):
                    for r in range(rb):
                        if b + int64(r) < ks:
                            rs[i] += pv[i * rb + r]
                b += int64(rb)
            for i in range(ipt):
                j = tid + int64(i * BDX * BDY)
                t = j // int64(na)
                a = j - t * int64(na)
                m = a // int64(cpt)
                col = (bx * int64(BDX) + t) * int64(cpt) + (a - m * int64(cpt))
                if j < int64(BDX * na) and m < mc and col < N:
                    out[(m0 + m) * N + col] = rs[i]
            if tid == int64(0):
                cnt[bx] = int32(0)

    return k_gemv


@lru_cache(maxsize=None)
def gemv_kernel(kind: int, mb: int, wpt: int, one_scale: bool):
    """The kernel for `config_for`'s choice, under `tuning`'s register cap."""
    return fast.K.jit_regs(tuning(mb, kind, one_scale).regs)(_gemv_kernel(kind, mb, wpt, one_scale))


SIG = ("void(float32[::1], uint32[::1], float32[::1], float32[::1], float32[::1], float32[::1], int32[::1], "
       f"float32[::1], {Q_LAYOUT.arg}, int64, int64)")


def ptx_targets():
    """(name, python function, signature, register cap) of every GEMV variant `config_for` picks
    (`ptx.targets`)."""
    out = []
    for kind in range(len(fast.KIND_BITS)):
        cfgs = set()
        for nwr in (1, 2, 4):
            for block in (32 // fast.KIND_BITS[kind], 1 << 20):
                Q = Q_LAYOUT.pack(Q_NWR=nwr, Q_BLOCK=block)
                cfgs |= {config_for(kind, m, Q) for m in (1, 2, 3, 4, 5, 16)}
        for mb, wpt, one in sorted(cfgs):
            out.append((f"k_gemv[{kind},{mb},{wpt},{int(one)}]", _gemv_kernel(kind, mb, wpt, one), SIG,
                        tuning(mb, kind, one).regs))
    return out


def buffers(Q: np.ndarray, kind: int, m: int):
    """(kernel, mb, Q, grid, block, part, cnt) for m rows of x (Q as the kernel's by-value tuple);
    part holds the largest launch's partial sums, cnt the zeroed column-block counters."""
    mb, wpt, one = config_for(kind, m, Q)
    t = tuning(mb, kind, one)
    q, grid, block = plan(Q, wpt, t.per_sm, t.rows, t.shape)
    part = cuda.device_array(max(1, int(q[Q_KS]) * mb * int(q[Q_N])), dtype=np.float32)
    cnt = cuda.to_device(np.zeros(grid[0], dtype=np.int32))
    return gemv_kernel(kind, mb, wpt, one), mb, tuple(int(v) for v in q), grid, block, part, cnt
