"""Decode `linear` on the tensor cores (a few rows of x, M <= `MBS[-1]`), over a weight [N, K] as
checkpoints store it: `y[m, n] = sum_k x[m, k] * decode(w[n, k]) * e[n, k] (+ bias[n])`, x in
bfloat16 or float16, the result in float32, float16 or bfloat16. It takes `linear.geometry`'s
weights whose 16-byte lane chunks (below) each lie under one scale slot: 4-bit codes under blocks
of 32 or more, 8-bit codes under any block, one scale a row or a tensor.

At one or two rows of x a linear is a stream over the weight, and the CUDA-core decode kernel
(`k_decode.py`) spends about four instructions a code (a permute, an add and an FMA, each on one
value). Here the codes go to `mma.sync.m16n8k16` as the A operand in pairs (`linear._decoder`:
about two instructions a pair), so a lane's instructions a code fall by half, while each lane still
loads 16 contiguous bytes of a row.

Work. A block of `WARPS` warps owns one tile of 16 rows of the weight; its warps split K into
contiguous ranges of super chunks (4 lane chunks, 64 bytes of a row). Lane (g, t) of a warp holds
rows g and g + 8 of the tile and reads, in super chunk s, the 16 bytes at byte 64 s + 16 t of each
row: its lane chunk (32 4-bit codes or 16 8-bit codes). The sum over k does not care which k sits
in which mma position as long as A and B agree: the lane's chunk feeds its A positions in every
mma step of the super chunk (`linear.py`'s pairs: codes (p, p + 4) of each 8-code group). A lane
loads `U` super chunks' code words and scales (a batch) before it uses any; a warp stages `SEG`
super chunks of x at a time, while its segment's first batch is in flight.

Scales, by the columns of B. The four lane chunks of an mma step lie under up to four different
scale slots (blocks of 32 4-bit codes: one slot a chunk), and a slot's scale multiplies the f32 sum
of its own terms only. So column n of B holds row m = n % 2 of x at the k of lane chunk t = n // 2
and zeros at every other chunk's k: C's column 2 t + m is then the sum of chunk t's terms for row m
of x, which is where lane (g, t)'s accumulators c0 .. c3 sit (rows g and g + 8, columns 2 t and
2 t + 1). A lane supplies B column g, so lanes with g // 2 == t and g % 2 < M read x, the others a
zero block: x is staged per warp into shared memory with each 8-k group's four B pairs already
permuted (one 16-byte shared load a group and lane, no permutes in the loop). After the super
chunk's mma steps (C zeroed at its start) each lane adds `e * c` in f32 for its two rows and
chunk: the scale multiplies the f32 sum of one slot's terms (docs/spec.md, "Products with a
quantized weight"; the tensor core's sums are the ones that spec's bound admits).

Order. A lane adds its super chunks in increasing k; the four lanes of a row (t) are added by
shuffles (xor 1, then 2), then the warps' sums in warp order through shared memory, the bias in
f32 and one rounding to the result type. The order depends on the shapes and the tuning only
(`WARPS` splits K): results repeat bit for bit. Nothing is added with atomics.

Every warp runs the same number of super chunks (its range rounded up to whole batches; a chunk past K
reads the row's last chunk against zeros of x), so that under the simulator every lane meets the
mma twin's barriers.
"""
from __future__ import annotations

import math
import os
from functools import lru_cache

import numpy as np

from . import fast, linear
from ._params import ParamLayout
from .intrin import f16_f32, ld1_at, ld2, ld4_at, lds4, mma_bf16, mma_f16, prmt, shr_u32, sts4, u2f, warp_sync
from .k_decode import SC_BF16, SC_F16, SC_F32
from .linear import XT_BF16, XT_F16, store_out

from numba import config, cuda, float32, int64, uint32  # noqa: E402

SIM = bool(config.ENABLE_CUDASIM)
TUNE_ENV = "QCORE_CUDA_DECODE_MMA_TUNE"
"""'WARPS,U,SEG' in the environment replaces the defaults below on a GPU (tuning runs); read at
import."""
GPU_TUNE = (4, 4, 16)
WARPS, U, SEG = (2, 2, 4) if SIM else linear.parse_tune(
    TUNE_ENV, os.environ.get(TUNE_ENV, ",".join(map(str, GPU_TUNE))), "WARPS,U,SEG")
"""Warps a block (each a range of K), super chunks a lane loads before it uses any of them (a
batch), super chunks of x a warp stages at a time (a multiple of U)."""
if SEG % U:
    raise ValueError(f"{TUNE_ENV}: SEG ({SEG}) must be a multiple of U ({U})")
REGS_ENV = "QCORE_CUDA_DECODE_MMA_REGS"
REGS = 128 if SIM else int(os.environ.get(REGS_ENV, "128"))
"""ptxas's register cap for the kernel (environment `QCORE_CUDA_DECODE_MMA_REGS`, tuning runs)."""
KINDS = (fast.KIND_I4, fast.KIND_E2M1, fast.KIND_I8, fast.KIND_E4M3, fast.KIND_E5M2)
"""Value kinds the kernel decodes (`linear._decoder`'s pairs; 2-bit codes, whose 16-byte chunk spans
64 codes, stay with the decode kernel)."""
MBS = (1, 2)
"""Rows of x a launch (B's columns hold 4 chunks x 2 rows)."""
SCR = 384  # simulator: f32 scratch per warp for the mma twin
DM_LAYOUT = ParamLayout("DM", "int64", [
    ("DM_N", "rows of the weight (output columns)"),
    ("DM_K", "columns of the weight (the reduction extent)"),
    ("DM_M", "rows of x"),
    ("DM_NSB", "scale slots per row of the weight (0: one for the tensor)"),
    ("DM_LB", "half chunk (16 columns) -> slot shift (`linear.geometry`'s LP_LB, at most 31: a 32-bit shift)"),
    ("DM_WPR", "u32 words of codes per row"),
    ("DM_SPW", "super chunks per warp"),
    ("DM_OT", "the result's type: linear.OT_F32, OT_F16 or OT_BF16"),
    ("DM_BIAS", "1: add the bias"),
], length_name="DM_LEN")
DM_LAYOUT.define(globals())


def chunk_codes(kind: int) -> int:
    """Codes in a lane chunk (16 bytes)."""
    return 128 // fast.KIND_BITS[kind]


def applies(kind: int, P: np.ndarray, xt: int, m: int) -> bool:
    """Whether the kernel takes this weight (`linear.geometry`'s kind and P) for x type `xt` and m
    rows: bf16 / f16 x, m <= 2, each lane chunk under one slot."""
    if kind not in KINDS or xt not in (XT_BF16, XT_F16) or m > MBS[-1]:
        return False
    lb = int(P[linear.LP_LB])
    halves = chunk_codes(kind) // 16  # 16-column halves a chunk
    return lb >= 62 or (1 << lb) >= halves


def mb_for(m: int) -> int:
    return next(v for v in MBS if v >= m)


def plan(kind: int, P: np.ndarray, m: int, out_type: int, has_bias: bool) -> tuple[tuple, tuple[int], tuple[int]]:
    """(the kernel's DM tuple, grid, block) for `linear.geometry`'s P and m rows of x."""
    n_, k_ = int(P[linear.LP_N]), int(P[linear.LP_K])
    nsc = -(-(k_ // chunk_codes(kind)) // 4)
    spw = -(-(-(-nsc // WARPS)) // U) * U  # (a multiple of U: a warp's batches never reach the next warp's range)
    q = DM_LAYOUT.pack(DM_N=n_, DM_K=k_, DM_M=m, DM_NSB=int(P[linear.LP_NSB]), DM_LB=min(int(P[linear.LP_LB]), 31),
                       DM_WPR=int(P[linear.LP_WPR]), DM_SPW=spw, DM_OT=out_type, DM_BIAS=int(has_bias))
    return tuple(int(v) for v in q), (-(-n_ // 16),), (32 * WARPS,)


def _kernel_fn(kind: int, xt: int, mb: int, sc: int = SC_F32, tn: tuple[int, int, int] | None = None):
    """The kernel for value kind `kind`, x type `xt`, `mb` rows of x, scale form `sc`, tuning `tn`."""
    WARPS_, U_, SEG_ = tn or (WARPS, U, SEG)
    uc = chunk_codes(kind)
    G = uc // 8  # 8-code groups a lane chunk
    bits = fast.KIND_BITS[kind]
    gw = 1 if bits == 4 else 2  # code words a group
    hpc = uc // 16  # 16-column halves a lane chunk
    pairs = linear._decoder(kind, xt != XT_F16)
    mma = mma_f16 if xt == XT_F16 else mma_bf16
    sc_words = 4 * G * mb * 4  # u32 words of x a super chunk
    seg_words = SEG_ * sc_words  # u32 words of a warp's staged segment
    zw = G * mb * 4  # u32 words of the warp's zero block (a lane chunk's entries)
    xw_n = WARPS_ * (seg_words + zw)
    s_f16, s_bf16 = sc == SC_F16, sc == SC_BF16
    ev_t = float32 if sc == SC_F32 else uint32
    scr_n = SCR * WARPS_ if SIM else 1
    red_n = WARPS_ * 16 * mb
    align = None if SIM else 16
    assert SEG_ % U_ == 0, (SEG_, U_)
    nwv = U_ * 8
    nev = U_ * 2
    SB = math.gcd(4, (SEG_ * 4 * G * mb) // 32)  # x entries a lane loads before it stores them
    nsv = 4 * SB
    qsh_n = 32 * WARPS_ if SIM else 1

    @cuda.jit(device=True, inline="always")
    def widen(v):
        if s_f16:
            return f16_f32(v)
        if s_bf16:
            return u2f(v << uint32(16))
        return v

    ne = SEG_ * 4 * G * mb  # entries of a segment: 16 bytes each (group i of chunk t of row m)
    assert ne % (32 * SB) == 0, (ne, SB)

    @cuda.jit(device=True, inline="always")
    def stage(x, xw, sv, wbase, lane, s0, K, M):
        """Super chunks s0 .. s0 + SEG of x's mb rows into the warp's words at wbase: entry
        ((sl * 4 + t) * G + i) * mb + m holds group i of chunk t of row m as its four B pairs
        (zeros past K and for rows past M). A lane loads `SB` entries before it stores any."""
        e0 = lane
        while e0 < int64(ne):
            for b in range(SB):
                e = e0 + int64(32 * b)
                m = e % int64(mb)
                r = e // int64(mb)
                i = r % int64(G)
                ch = r // int64(G)  # (segment-local chunk)
                k = (s0 * int64(4) + ch) * int64(uc) + i * int64(8)
                x0 = x1 = x2 = x3 = uint32(0)
                if k < K and m < M:
                    xi = (m * K + k) >> int64(1)
                    x0, x1 = ld2(x, xi)
                    x2, x3 = ld2(x, xi + int64(2))
                sv[4 * b], sv[4 * b + 1], sv[4 * b + 2], sv[4 * b + 3] = x0, x1, x2, x3
            for b in range(SB):
                x0, x1, x2, x3 = sv[4 * b], sv[4 * b + 1], sv[4 * b + 2], sv[4 * b + 3]
                sts4(xw, wbase + (e0 + int64(32 * b)) * int64(4), prmt(x0, x2, 0x5410), prmt(x0, x2, 0x7632),
                     prmt(x1, x3, 0x5410), prmt(x1, x3, 0x7632))
            e0 += int64(32 * SB)

    if SIM:
        @cuda.jit(device=True)
        def quad_sum(v, sh, tid):
            """v + the xor-1 lane's, then + the xor-2 lane's (the shuffles' additions in their order)."""
            for off in (1, 2):
                sh[tid] = v
                cuda.syncthreads()
                u = sh[tid ^ off]
                cuda.syncthreads()
                v = float32(v + u)
            return v
    else:
        @cuda.jit(device=True, inline="always")
        def quad_sum(v, sh, tid):
            """v + the xor-1 lane's, then + the xor-2 lane's: every lane of the quad the same bits."""
            v += cuda.shfl_xor_sync(0xFFFFFFFF, v, 1)
            v += cuda.shfl_xor_sync(0xFFFFFFFF, v, 2)
            return v

    @cuda.jit(device=True, inline="always")
    def load_slot(w32, es, wv, ev, u, sc, oa, ob, sa, sb_, tmax, ut, lb):
        """Super chunk `sc`'s code words (16 bytes of each of the lane's rows) and scales into slot u
        (32-bit offsets onto the rows' addresses; a chunk past K: the row's last, against zeros)."""
        c4 = min(sc << uint32(2), tmax)
        b = u * 8
        wv[b], wv[b + 1], wv[b + 2], wv[b + 3] = ld4_at(w32, oa, c4 << uint32(2))
        wv[b + 4], wv[b + 5], wv[b + 6], wv[b + 7] = ld4_at(w32, ob, c4 << uint32(2))
        hs = shr_u32((c4 + ut) * uint32(hpc), lb)
        ev[2 * u] = ld1_at(es, sa, hs)
        ev[2 * u + 1] = ld1_at(es, sb_, hs)

    @cuda.jit(device=True, inline="always")
    def use_slot(xw, wv, ev, u, xj, acc, scr, lane, base):
        """Slot u's terms: each group's two mma steps into sums zeroed at the super chunk's start
        (B from x's staged entries at xj, or the zero block), then acc += e * sums (f32)."""
        c0 = c1 = c2 = c3 = float32(0.0)
        b = u * 8
        for i in range(G):
            b0, b1, b2, b3 = lds4(xw, xj + int64(i * mb * 4))
            pa0, pa1, pa2, pa3 = pairs(wv[b + gw * i], wv[b + gw * i + gw - 1])
            pb0, pb1, pb2, pb3 = pairs(wv[b + 4 + gw * i], wv[b + 4 + gw * i + gw - 1])
            c0, c1, c2, c3 = mma(pa0, pb0, pa1, pb1, b0, b1, c0, c1, c2, c3, scr, lane, base)
            c0, c1, c2, c3 = mma(pa2, pb2, pa3, pb3, b2, b3, c0, c1, c2, c3, scr, lane, base)
        ea = widen(ev[2 * u])
        eb = widen(ev[2 * u + 1])
        acc[0] += ea * c0
        acc[1] += ea * c1
        acc[2] += eb * c2
        acc[3] += eb * c3

    def k_decode_mma(x, w32, es, bias, out32, out16, P):
        xw = cuda.shared.array(xw_n, uint32, alignment=align)
        scr = cuda.shared.array(scr_n, float32)
        red = cuda.shared.array(red_n, float32)
        wv = cuda.local.array(nwv, uint32)
        ev = cuda.local.array(nev, ev_t)
        acc = cuda.local.array(4, float32)
        sv = cuda.local.array(nsv, uint32)
        qsh = cuda.shared.array(qsh_n, float32)
        tid = int64(cuda.threadIdx.x)
        warp = tid >> int64(5)
        lane = tid & int64(31)
        g = lane >> int64(2)
        t = lane & int64(3)
        base = warp * int64(SCR)
        N = P[DM_N]
        K = P[DM_K]
        M = P[DM_M]
        nsb = P[DM_NSB]
        lb = P[DM_LB]
        wpr = P[DM_WPR]
        spw = P[DM_SPW]
        r0 = int64(cuda.blockIdx.x) * int64(16)
        ra = min(r0 + g, N - int64(1))
        rb = min(r0 + g + int64(8), N - int64(1))
        wbase = warp * int64(seg_words + zw)
        zero = wbase + int64(seg_words)
        for z in range(lane * 4, zw, 128):  # (the warp's zero block: what lanes outside B's diagonal read)
            sts4(xw, zero + int64(z), uint32(0), uint32(0), uint32(0), uint32(0))
        on = (g >> int64(1)) == t and (g & int64(1)) < int64(mb)
        xo = ((t * int64(G)) * int64(mb) + (g & int64(1))) * int64(4)  # (the lane's entry at sl = 0, i = 0)
        xb = wbase + xo if on else zero  # (a lane off the diagonal reads the zero block at every step)
        xs = int64(sc_words) if on else int64(0)
        nch = K // int64(uc)  # (lane chunks of a row: K is a multiple of 32)
        te = min(t, nch - int64(1))  # (the lane's chunk offset; a lane past a row of fewer than 4 chunks: its last)
        oa = ra * wpr + te * int64(4)  # (the lane's first code word in each of its rows)
        ob = rb * wpr + te * int64(4)
        sa = ra * nsb
        sb_ = rb * nsb
        tmax = uint32(nch - int64(1) - te)  # (the last chunk of a row, less the lane's offset)
        ut = uint32(te)
        for a in range(4):
            acc[a] = float32(0.0)
        s_first = warp * spw
        sl = int64(0)
        while sl < spw:  # segments of the warp's range
            s0 = s_first + sl
            j0 = int64(0)
            while j0 < int64(SEG_) and sl + j0 < spw:  # (spw and SEG: multiples of U)
                for u in range(U_):  # U super chunks' code words and scales in flight
                    load_slot(w32, es, wv, ev, u, uint32(s0 + j0) + uint32(u), oa, ob, sa, sb_, tmax, ut, lb)
                if j0 == int64(0):  # (the segment's x, staged while the first loads are in flight)
                    warp_sync()
                    stage(x, xw, sv, wbase, lane, s0, K, M)
                    warp_sync()
                for u in range(U_):
                    use_slot(xw, wv, ev, u, xb + (j0 + int64(u)) * xs, acc, scr, lane, base)
                j0 += int64(U_)
            sl += int64(SEG_)
        for a in range(4):  # the row's four lanes (t), in a fixed order
            acc[a] = quad_sum(acc[a], qsh, tid)
        if t == int64(0):
            for m in range(mb):
                red[(warp * int64(16) + g) * int64(mb) + int64(m)] = acc[m]
                red[(warp * int64(16) + g + int64(8)) * int64(mb) + int64(m)] = acc[2 + m]
        cuda.syncthreads()
        if tid < int64(16 * mb):
            rr = tid // int64(mb)
            m = tid - rr * int64(mb)
            v = red[tid]
            for w in range(1, WARPS_):
                v += red[int64(w * 16 * mb) + tid]
            n = r0 + rr
            if n < N and m < M:
                if P[DM_BIAS] != int64(0):
                    v += bias[n]
                store_out(out32, out16, m * N + n, v, P[DM_OT])

    return k_decode_mma


def kernel(kind: int, xt: int, mb: int, sc: int = SC_F32):
    return _kernel(kind, xt, mb, sc, (WARPS, U, SEG), REGS)


@lru_cache(maxsize=None)
def _kernel(kind: int, xt: int, mb: int, sc: int, tn: tuple[int, int, int], regs: int):
    return fast.K.jit_regs(regs)(_kernel_fn(kind, xt, mb, sc, tn))


def signature(xt: int, sc: int = SC_F32) -> str:
    assert DM_LAYOUT.arg == linear.LP_LAYOUT.arg
    return linear.signature(xt, "float32" if sc == SC_F32 else "uint16")


PTX_TARGETS = tuple((kind, XT_BF16, 1, SC_F32) for kind in KINDS) \
    + ((fast.KIND_I4, XT_F16, 1, SC_F32), (fast.KIND_E2M1, XT_F16, 2, SC_F32), (fast.KIND_I8, XT_BF16, 2, SC_F32),
       (fast.KIND_I4, XT_BF16, 1, SC_F16), (fast.KIND_I4, XT_BF16, 2, SC_F16), (fast.KIND_I4, XT_F16, 1, SC_F16),
       (fast.KIND_I8, XT_BF16, 1, SC_BF16), (fast.KIND_I8, XT_F16, 2, SC_F16))
"""(kind, x type, mb, scale form) of the variants `ptx_targets` compiles: every kind at one row of
bfloat16 x with f32 scales, then float16 x, two rows, and the stored 16-bit scales of the 4- and
8-bit integer kinds (the other variants differ from these by constants only)."""


def ptx_targets():
    """(name, python function, signature, register cap) of the variants of `PTX_TARGETS` (`ptx.targets`)."""
    return [(f"k_decode_mma[{kind},{xt},{mb},sc{sc}]", _kernel_fn(kind, xt, mb, sc), signature(xt, sc), REGS)
            for kind, xt, mb, sc in PTX_TARGETS]
