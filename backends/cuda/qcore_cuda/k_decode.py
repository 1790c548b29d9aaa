"""Decode `linear` (a few rows of x, M <= `MBS[-1]`) on the CUDA cores, over a weight [N, K] as
checkpoints store it: `y[m, n] = sum_k x[m, k] * decode(w[n, k]) * e[n, k] (+ bias[n])`, x in
bfloat16, float16 or float32, the result in float32, float16 or bfloat16. The weights it takes
are `linear.geometry`'s (the tensor-core kernel's): 2-, 4- and 8-bit integer and minifloat codes
packed along K in the low field order, K a multiple of 32, one scale for the tensor or blocks
along K of 16 * 2**j or at least K, two-level weights through their effective f32 scales.

At M = 1 a linear is a stream over the weight: its bytes are read once and each is used for a
few multiply-adds, so the kernel is built to keep the weight's loads in flight.

Work. A warp owns `RW` consecutive rows of the weight (a row group) at a time; lane l reads 16
contiguous bytes of each row with one `ld4` (a unit: 32 4-bit codes, one 32-k chunk, or 16 8-bit
codes, half of one), so a warp's load instruction covers 512 contiguous bytes of a row. Each lane
issues `U` units of each of its rows (`U * RW` 16-byte loads, and their scales) before it decodes
any of them; the loop over whole groups of `U` units has no bounds checks, the units left over go
one at a time. Blocks of `WARPS` warps; a persistent grid of at most `per_sm()` blocks per SM whose
warps take row groups in turn (rounds).

Scales (`scale_form`). A one-level weight of f16 or bf16 slots passes the payload's scales
section as uint16 (slot i's little-endian word at byte `soff + 2 i`; where the section starts at an
odd address, the f32 array below instead): half the scale bytes of f32 streamed, no f32 copy. Other
weights pass `es`, f32: the decoded scales (`k_general.k_decode_scales`), or a two-level weight's
effective scales. A word is widened where it is used: `cvt.f32.f16` (`f16_f32`) or the bf16 word as an
f32's top half. Both are exact, and for every finite word they give `scales.word_scale`'s bits
(subnormals, zeros and the sign bit of signed scales included: checked over all 2 x 65536 words).
A NaN or infinite scale word is invalid data, rejected when a payload is read (`QuantizedData`)
and never written by a quantize. So each `e` is the same f32: the same bits.

x in shared memory. A block stages x as float32 (exact for bfloat16 and float16 x) into `XS`
floats of shared memory, `SEGK` columns of each of the `mb` rows of x at a time (a segment: all
of K when `mb * K` fits, which is K <= 8192 at M = 1; else K in segments, each staged once per
round). Within a segment, the 32 units a warp reads per load instruction form a group of
`32 * UC` columns; lane l's unit holds columns `UC * l .. UC * l + UC - 1` of the group, which
are stored at `(j // 4) * 128 + 4 * l + j % 4` for column `UC * l + j`: at each step the
warp's lanes read 32 consecutive 16-byte words (`lds4`), one shared-memory wavefront per
quarter warp, no bank conflicts. The staging threads write in the same order, each loading
`STAGE_BATCH` quads of x before it stores any (one wait for the batch, not one per quad: the
weight's loads start only after the staging barrier).

Arithmetic (docs/spec.md, "Products with a quantized weight"). Each code is decoded to its exact
value in float32 (`fast.decoder`: byte permutes under 2**23 for integers, the FP8 conversions,
E2M1 by two byte-table permutes for every four codes under 2**22, its -0 read as +0, which no sum
starting at +0 can tell apart), so each term `x * value` is exact for 16-bit x (their product has
at most 19 significant bits) and an f32 FMA for float32 x. A unit's terms lie under one scale
slot; they are summed in f32 from k = 0 up (one FMA each, into a zeroed sum), then `acc += e *
sum` with e the slot's f32 effective scale ("Scales" above). A lane adds its units in increasing
k; the 32 lanes' sums are then added by a butterfly of warp shuffles (xor 16, 8, 4, 2, 1: every
lane ends with the same bits), the bias added in f32 and the result rounded once to the result
type. The order depends on the shapes only (K, the unit size), not on the grid, the segments or
the scheduling: results repeat bit for bit, and are the same whatever `WARPS`, `XS` or the SM
count. Nothing is added with atomics.

Under the simulator, which has no shuffles, the butterfly goes through shared memory with the
same additions in the same order; every warp of a block makes the same barrier calls (the rounds,
segments and reductions are uniform across the block; a warp without a row group in the last
round joins them with nothing to add).
"""
from __future__ import annotations

import os
from functools import lru_cache

import numpy as np

from . import fast, linear
from ._params import ParamLayout
from .intrin import f16_f32, f16x2_f32, ld1, ld2, ld4, lds4, sts4, u2f
from .linear import XT_BF16, XT_F16, XT_F32, store_out

from numba import config, cuda, float32, int32, int64, uint32  # noqa: E402

SIM = bool(config.ENABLE_CUDASIM)
TUNE_ENV = "QCORE_CUDA_DECODE_TUNE"
"""'WARPS,U,RW' in the environment replaces the defaults below on a GPU (tuning runs); read at
import."""
SC_F32, SC_F16, SC_BF16 = 0, 1, 2
"""Scale forms a kernel reads: the f32 effective scales, or the stored f16 or bf16 words."""
GPU_TUNE = (8, 4, 2)
"""The default tuning on a GPU (the simulator's is 2, 2, 2)."""
WARPS, U, RW = (2, 2, 2) if SIM else linear.parse_tune(TUNE_ENV, os.environ.get(TUNE_ENV, ",".join(map(str, GPU_TUNE))),
                                                         "WARPS,U,RW")
SPLIT_TARGETS = tuple((kind, xt, 1, 2) for kind in (fast.KIND_I4, fast.KIND_E2M1) for xt in (XT_BF16, XT_F16, XT_F32)) \
    + ((fast.KIND_E2M1, XT_BF16, 4, 2), (fast.KIND_I2, XT_BF16, 1, 2), (fast.KIND_I2, XT_BF16, 1, 4))
"""(kind, x type, mb, slots a unit) of the variants with units under several slots (4-bit codes
under blocks of 16, 2-bit under 32 or 16) `ptx_targets` compiles: each x type at M = 1 (the
decode path's default), nvfp4's largest variant, 2-bit codes at M = 1."""
MBS = (1, 2, 4)
"""Variants: rows of x per launch (a call of m rows takes the least that holds m)."""
STORED_SCALE_TARGETS = tuple((fast.KIND_I4, xt, mb, SC_F16) for xt in (XT_BF16, XT_F16, XT_F32) for mb in MBS) \
    + ((fast.KIND_I8, XT_BF16, 1, SC_BF16), (fast.KIND_I8, XT_F16, 4, SC_F16), (fast.KIND_I2, XT_BF16, 1, SC_F16),
       (fast.KIND_I4, XT_BF16, 1, SC_BF16))
"""(kind, x type, mb, scale form) of the variants reading stored 16-bit scales `ptx_targets`
compiles (the others: f32 scales): every 4-bit one of f16 scales (q4s/block32:f16, q4_0), the 8-bit
and 2-bit kinds at the ends, bf16 scales. ptxas for sm_90 at the 128-register cap (8,4,2): 118-128
registers, no spills (I4, bf16 x, M = 1: 122, four more than with the f32 scales)."""
XS = 4096 if SIM else 8192
"""float32 words of x in shared memory per block (32 KB on a GPU: K up to 8192 at M = 1 in one
segment). On a GPU it holds `MBS[-1]` groups of the largest unit (4 x 2048 columns of 2-bit
codes); the simulator's holds two of those, so there 2-bit weights take the decode path up to M = 2
(`segment` 0: `DecodeLinear` does not apply)."""
REGS_ENV = "QCORE_CUDA_DECODE_REGS"
"""The register cap in the environment replaces `REGS` (tuning runs); read at import."""
REGS = 128 if SIM else int(os.environ.get(REGS_ENV, "128"))
"""ptxas's register cap (-maxrregcount) for the kernel; with `WARPS` it sets the blocks a SM holds
(`per_sm`)."""
STAGE_BATCH = 8 if REGS >= 96 else 4
"""Quads of x (4 elements) a thread loads before it stores them into shared memory, staging x
(read when a kernel is built): 8, or 4 under a cap below 96 registers (8 spill there)."""
LANES_ENV = "QCORE_CUDA_DECODE_LANES"
"""0 in the environment clears `LANES` (tuning runs); read at import."""
LANES = os.environ.get(LANES_ENV, "1") == "1"
"""Stage x with the lanes of a warp over 8 units' first 4 quads each (lane = 8 jq + ln in the low
bits): a warp's load instruction reads whole 32-byte sectors (bfloat16 x: 8 sectors, against 32
sectors a quarter used by consecutive units), and each lane stores its quad with one 16-byte
shared store, a quarter warp's 8 quads in distinct banks. The same floats in the same places: the
same bits (read when a kernel is built; docs/gpu.md has the timings)."""
FP8_KINDS = (fast.KIND_E4M3, fast.KIND_E5M2)
"""Kinds decoded by the sm_89+ FP8 conversions (`backend.FAST_MIN_CC`)."""
DL_LAYOUT = ParamLayout("DL", "int64", [
    ("DL_N", "rows of the weight (output columns)"),
    ("DL_K", "columns of the weight (the reduction extent)"),
    ("DL_M", "rows of x"),
    ("DL_NSB", "scale slots per row of the weight (0: one for the tensor)"),
    ("DL_LB", "half chunk (16 columns) -> slot shift (`linear.geometry`'s LP_LB)"),
    ("DL_WPR", "u32 words of codes per row"),
    ("DL_SEGK", "columns of x per staged segment (a multiple of the warp's group, `group`)"),
    ("DL_OT", "the result's type: linear.OT_F32, OT_F16 or OT_BF16"),
    ("DL_BIAS", "1: add the bias"),
], length_name="DL_LEN")
"""DL: the decode kernel's int64 parameters (`plan`)."""
DL_LAYOUT.define(globals())


def unit_codes(kind: int) -> int:
    """Codes per 16-byte unit (a lane's load): 32 of 4 bits, 16 of 8."""
    return 128 // fast.KIND_BITS[kind]


def group(kind: int) -> int:
    """Columns a warp's load instruction covers: 32 units."""
    return 32 * unit_codes(kind)


def mb_for(m: int) -> int:
    """Rows of x per launch for m rows: the least variant that holds m."""
    return next(v for v in MBS if v >= m)


def segment(kind: int, k: int, mb: int) -> int:
    """Columns of x per staged segment: as many whole groups as `XS` holds for `mb` rows, at
    most K's groups."""
    g = group(kind)
    return min((XS // mb) // g * g, -(-k // g) * g)


def per_sm() -> int:
    """Resident blocks per SM the persistent grid is sized for: as many as the SM's registers (at
    `REGS` a thread), shared memory (`XS` floats of x a block, and 1 KB the driver keeps) and
    warps hold; 2 at the default 8 warps of 128 registers."""
    return fast.K.resident_blocks(WARPS, REGS, 4 * XS + 16 * 4 + 4)


def tune() -> tuple[int, int, int]:
    """(WARPS, U, RW) as the module has them now (`kernel` compiles that variant)."""
    return WARPS, U, RW


def scale_form(scheme, soff: int) -> int:
    """The scales a kernel for `scheme`'s weight reads (module text, "Scales"): the stored 16-bit
    words (SC_F16, SC_BF16) for a one-level scheme of f16 or bf16 slots whose scales section starts
    at an even byte `soff`; else SC_F32 (the decoded or effective f32 scales)."""
    if scheme.two_level or soff % 2:
        return SC_F32
    return {"f16": SC_F16, "bf16": SC_BF16}.get(scheme.slot_dtype.value, SC_F32)


def plan(kind: int, P: np.ndarray, m: int, out_type: int, has_bias: bool) -> tuple[tuple, tuple[int], tuple[int]]:
    """(the kernel's DL tuple, grid, block) for `linear.geometry`'s P and m rows of x."""
    n_, k_ = int(P[linear.LP_N]), int(P[linear.LP_K])
    mb = mb_for(m)
    q = DL_LAYOUT.pack(DL_N=n_, DL_K=k_, DL_M=m, DL_NSB=int(P[linear.LP_NSB]), DL_LB=int(P[linear.LP_LB]),
                       DL_WPR=int(P[linear.LP_WPR]), DL_SEGK=segment(kind, k_, mb), DL_OT=out_type,
                       DL_BIAS=int(has_bias))
    blocks = -(-(-(-n_ // RW)) // WARPS)
    cap = 2 if SIM else fast.K.sm_count() * per_sm()
    return tuple(int(v) for v in q), (max(1, min(blocks, cap)),), (32 * WARPS,)


if SIM:
    @cuda.jit(device=True)
    def warp_sum(v, sh, tid):
        """The sum of v over the warp's lanes, every lane the same bits (module text): the
        butterfly through shared memory, the shuffles' additions in their order."""
        off = 16
        while off > 0:
            sh[tid] = v
            cuda.syncthreads()
            u = sh[tid ^ off]
            cuda.syncthreads()
            v = float32(v + u)
            off >>= 1
        return v
else:
    @cuda.jit(device=True, inline="always")
    def warp_sum(v, sh, tid):
        """The sum of v over the warp's lanes by a butterfly of shuffles (xor 16 .. 1): every lane
        ends with the same bits (each addition is of the same two values)."""
        for off in (16, 8, 4, 2, 1):
            v += cuda.shfl_xor_sync(0xFFFFFFFF, v, int32(off))
        return v


def unit_halves(kind: int) -> int:
    """16-column half chunks per unit: 1 (8-bit codes), 2 (4-bit), 4 (2-bit)."""
    return unit_codes(kind) // 16


def slots_per_unit(kind: int, P: np.ndarray) -> int:
    """Scale slots a unit of `linear.geometry`'s weight (`P`) holds: more than one where its blocks
    are shorter than a unit (4-bit codes under blocks of 16; 2-bit under blocks of 16 or 32)."""
    lb = int(P[linear.LP_LB])
    return 1 if lb >= 62 else max(1, unit_halves(kind) >> lb)


def _decode_kernel(kind: int, xt: int, mb: int, tn: tuple[int, int, int] | None = None, sc: int = SC_F32,
                   nh: int = 1, sb: int | None = None, lanes: bool | None = None):
    """The kernel for value kind `kind`, x type `xt` (linear.XT_*), `mb` rows of x, the tuning
    `tn` (WARPS, U, RW; default `tune()`), the scale form `sc` (SC_*: `es` float32, or
    the payload's stored scale words as uint16), `nh`, the scale slots a unit holds
    (`slots_per_unit`: its parts summed apart, each under its slot), the staging batch `sb`
    (default `STAGE_BATCH`) and the staging order `lanes` (default `LANES`)."""
    assert nh in (1, 2, 4) and nh <= unit_halves(kind), (kind, nh)
    WARPS, U, RW = tn or tune()  # (closure constants from here on)
    bits = fast.KIND_BITS[kind]
    pw = 32 // bits  # codes per u32 word
    qpw = pw // 4  # x quads per word
    uc = unit_codes(kind)
    grp = group(kind)
    gq = grp // 4  # x quads per group
    hshift = unit_halves(kind).bit_length() - 1  # unit -> its first 16-k half chunk
    wps = 4 // nh  # code words per slot of a unit
    decode = fast.decoder(kind, signed_zero=False)  # (sums from +0: an E2M1 -0 may read +0)
    nt = 32 * WARPS
    nacc = RW * mb
    nwv, nev, nval = 4 * U * RW, U * RW * nh, RW * pw  # (local array sizes: constants)
    align = None if SIM else 16  # (the simulator takes no alignment; lds4 needs 16 bytes)
    red_n = nt if SIM else 1
    x_f32, x_bf16 = xt == XT_F32, xt == XT_BF16  # (constants: numba prunes the other branches)
    s_f16, s_bf16 = sc == SC_F16, sc == SC_BF16
    ev_t = float32 if sc == SC_F32 else uint32  # (a stored word is widened where it is used)
    sb = STAGE_BATCH if sb is None else sb
    lanes = LANES if lanes is None else lanes
    jqh = (uc // 16).bit_length() - 1  # (lanes: bits of a unit's quad index above its low two)
    sv_t = float32 if x_f32 else uint32  # (x's words as a thread holds them while staging)
    nsv = 4 * sb

    @cuda.jit(device=True, inline="always")
    def quad_at(q, nq, k0, K, segk):
        """(x's element index of staging quad q, its float index in xs, whether x has it)."""
        if mb == 1:
            m = int64(0)
            qq = q
        else:
            m = q // nq
            qq = q - m * nq
        g = qq // int64(gq)
        rem = qq - g * int64(gq)
        if lanes:  # rem: ln_lo (3 bits), jq_lo (2), jq_hi (jqh), ln_hi (2)
            rest = rem >> int64(5)
            jq = ((rest & int64((1 << jqh) - 1)) << int64(2)) | ((rem >> int64(3)) & int64(3))
            ln = ((rest >> int64(jqh)) << int64(3)) | (rem & int64(7))
        else:
            jq = rem >> int64(5)
            ln = rem & int64(31)
        k = k0 + g * int64(grp) + ln * int64(uc) + jq * int64(4)
        d = m * segk + g * int64(grp) + jq * int64(128) + ln * int64(4)
        return m * K + k, d, k < K

    @cuda.jit(device=True, inline="always")
    def stage(x, xs, sv, k0, K, M, segk, tid):
        """Segment k0 of x's mb rows into xs (float32, the module text's order; zeros past K and
        for rows past M). A thread loads `STAGE_BATCH` quads (all in flight together) before it
        stores any."""
        seglen = min(segk, K - k0)
        nq = ((seglen + int64(grp - 1)) // int64(grp)) * int64(gq)
        nm = min(int64(mb), M) * nq  # (quads of x's rows; rows past M are zeros)
        q = tid
        while q < int64(mb) * nq:
            for b in range(sb):
                qb = q + int64(b * nt)
                i, d, inside = quad_at(qb, nq, k0, K, segk)
                w0 = w1 = w2 = w3 = sv_t(0)
                if qb < nm and inside:
                    if x_f32:
                        w0, w1, w2, w3 = ld4(x, i)
                    else:
                        w0, w1 = ld2(x, i >> int64(1))
                sv[4 * b], sv[4 * b + 1], sv[4 * b + 2], sv[4 * b + 3] = w0, w1, w2, w3
            for b in range(sb):
                qb = q + int64(b * nt)
                if qb < int64(mb) * nq:
                    i, d, inside = quad_at(qb, nq, k0, K, segk)
                    w0, w1, w2, w3 = sv[4 * b], sv[4 * b + 1], sv[4 * b + 2], sv[4 * b + 3]
                    if x_f32:
                        v0, v1, v2, v3 = w0, w1, w2, w3
                    elif x_bf16:
                        v0 = u2f(w0 << uint32(16))
                        v1 = u2f(w0 & uint32(0xFFFF0000))
                        v2 = u2f(w1 << uint32(16))
                        v3 = u2f(w1 & uint32(0xFFFF0000))
                    else:
                        v0, v1 = f16x2_f32(w0)
                        v2, v3 = f16x2_f32(w1)
                    if lanes:
                        sts4(xs, d, v0, v1, v2, v3)
                    else:
                        xs[d] = v0
                        xs[d + int64(1)] = v1
                        xs[d + int64(2)] = v2
                        xs[d + int64(3)] = v3
            q += int64(sb * nt)

    @cuda.jit(device=True, inline="always")
    def load_unit(w32, es, wv, ev, j, rows, u, wpr, nsb, lb):
        """Unit u of the group's rows into slot j: four code words and the scale of each of the
        unit's `nh` slots per row."""
        for r in range(RW):
            b = (j * RW + r) * 4
            wv[b], wv[b + 1], wv[b + 2], wv[b + 3] = ld4(w32, rows[r] * wpr + u * int64(4))
            si = rows[r] * nsb + ((u << int64(hshift)) >> lb)
            for h in range(nh):
                ev[(j * RW + r) * nh + h] = ld1(es, si + int64(h))  # (f32, or a u16 word)

    @cuda.jit(device=True, inline="always")
    def scale_in(ev, j, h, part, acc):
        """acc += e * part for every row and row of x, e the f32 scale of slot h of unit slot j."""
        for r in range(RW):
            v = ev[(j * RW + r) * nh + h]
            if s_f16:
                e = f16_f32(v)  # (exact: module text, "Scales")
            elif s_bf16:
                e = u2f(v << uint32(16))
            else:
                e = v
            for m in range(mb):
                acc[r * mb + m] += e * part[r * mb + m]

    @cuda.jit(device=True, inline="always")
    def use_unit(wv, ev, j, xs, xo, segk, tab, val, part, acc):
        """The terms of slot j's unit for every row and row of x: per row of x a zeroed f32 sum of
        the unit's products in k order, then acc += e * sum. `xo`: the lane's x offset (group, lane)."""
        for a in range(nacc):
            part[a] = float32(0.0)
        for wi in range(4):
            for r in range(RW):
                decode(wv[(j * RW + r) * 4 + wi], tab, val, r * pw)
            for q in range(qpw):
                for m in range(mb):
                    x0, x1, x2, x3 = lds4(xs, int64(m) * segk + xo + int64((wi * qpw + q) * 128))
                    for r in range(RW):
                        p = part[r * mb + m]
                        p = cuda.fma(x0, val[r * pw + 4 * q], p)
                        p = cuda.fma(x1, val[r * pw + 4 * q + 1], p)
                        p = cuda.fma(x2, val[r * pw + 4 * q + 2], p)
                        p = cuda.fma(x3, val[r * pw + 4 * q + 3], p)
                        part[r * mb + m] = p
            if nh > 1 and wi < 3 and (wi + 1) % wps == 0:  # a slot's part of the unit ends here
                scale_in(ev, j, (wi + 1) // wps - 1, part, acc)
                for a in range(nacc):
                    part[a] = float32(0.0)
        scale_in(ev, j, nh - 1, part, acc)

    def k_decode_linear(x, w32, es, bias, out32, out16, P):
        xs = cuda.shared.array(XS, float32, alignment=align)
        tab = cuda.shared.array(16, float32)  # (the decoder's table argument: no variant here reads it)
        red = cuda.shared.array(red_n, float32)
        acc = cuda.local.array(nacc, float32)
        part = cuda.local.array(nacc, float32)
        val = cuda.local.array(nval, float32)
        wv = cuda.local.array(nwv, uint32)
        ev = cuda.local.array(nev, ev_t)
        rows = cuda.local.array(RW, int64)
        sv = cuda.local.array(nsv, sv_t)
        tid = int64(cuda.threadIdx.x)
        warp = tid >> int64(5)
        lane = tid & int64(31)
        N = P[DL_N]
        K = P[DL_K]
        M = P[DL_M]
        nsb = P[DL_NSB]
        lb = P[DL_LB]
        wpr = P[DL_WPR]
        segk = P[DL_SEGK]
        ng = (N + int64(RW - 1)) // int64(RW)
        nseg = (K + segk - int64(1)) // segk
        bid = int64(cuda.blockIdx.x)
        nblk = int64(cuda.gridDim.x)
        rnd = int64(0)
        while (rnd * nblk + bid) * int64(WARPS) < ng:  # (uniform across the block)
            gi = (rnd * nblk + bid) * int64(WARPS) + warp
            ok = gi < ng
            for r in range(RW):
                rows[r] = min(gi * int64(RW) + int64(r), N - int64(1))
            for a in range(nacc):
                acc[a] = float32(0.0)
            for s in range(nseg):
                k0 = s * segk
                u0 = k0 // int64(uc)
                nus = min(segk, K - k0) // int64(uc)  # units of a row in this segment
                if rnd == int64(0) or nseg > int64(1):
                    cuda.syncthreads()  # (every warp is done with the previous segment)
                    stage(x, xs, sv, k0, K, M, segk, tid)
                    cuda.syncthreads()
                if ok:
                    i = int64(0)
                    while (i + int64(U)) * int64(32) <= nus:  # U units per row in flight, then their terms
                        for j in range(U):
                            load_unit(w32, es, wv, ev, j, rows, u0 + (i + int64(j)) * int64(32) + lane, wpr, nsb, lb)
                        for j in range(U):
                            use_unit(wv, ev, j, xs, (i + int64(j)) * int64(grp) + lane * int64(4), segk, tab, val,
                                     part, acc)
                        i += int64(U)
                    while i * int64(32) < nus:  # the units left, one at a time
                        if i * int64(32) + lane < nus:
                            load_unit(w32, es, wv, ev, 0, rows, u0 + i * int64(32) + lane, wpr, nsb, lb)
                            use_unit(wv, ev, 0, xs, i * int64(grp) + lane * int64(4), segk, tab, val, part, acc)
                        i += int64(1)
            for a in range(nacc):
                acc[a] = warp_sum(acc[a], red, tid)
            if ok:
                for a in range(nacc):  # lane a writes sum a (constant indices: acc stays in registers)
                    n = gi * int64(RW) + int64(a // mb)
                    m = int64(a % mb)
                    if lane == int64(a) and n < N and m < M:
                        v = acc[a]
                        if P[DL_BIAS] != int64(0):
                            v += bias[n]
                        store_out(out32, out16, m * N + n, v, P[DL_OT])
            rnd += int64(1)

    return k_decode_linear


def kernel(kind: int, xt: int, mb: int, sc: int = SC_F32, nh: int = 1):
    """The compiled variant for value kind `kind`, x type `xt`, `mb` rows of x, `tune()`, the
    scale form `sc` (`scale_form`) and `nh` slots a unit (`slots_per_unit`)."""
    return _kernel(kind, xt, mb, tune(), sc, nh, STAGE_BATCH, LANES)


@lru_cache(maxsize=None)
def _kernel(kind: int, xt: int, mb: int, tn: tuple[int, int, int], sc: int, nh: int, sb: int, lanes: bool):
    return fast.K.jit_regs(REGS)(_decode_kernel(kind, xt, mb, tn, sc, nh, sb, lanes))


def signature(xt: int, sc: int = SC_F32) -> str:
    """The launch signature: linear.py's (the same arguments, DL an int64 array in LP's place;
    the scales uint16 for a stored 16-bit form)."""
    assert DL_LAYOUT.arg == linear.LP_LAYOUT.arg
    return linear.signature(xt, "float32" if sc == SC_F32 else "uint16")


def ptx_targets():
    """(name, python function, signature, register cap) of every variant (`ptx.targets`)."""
    out = [(f"k_decode_linear[{kind},{xt},{mb}]", _decode_kernel(kind, xt, mb), signature(xt), REGS)
           for kind in linear.KINDS for xt in (XT_BF16, XT_F16, XT_F32) for mb in MBS]
    out += [(f"k_decode_linear[{kind},{xt},{mb},sc{sc}]", _decode_kernel(kind, xt, mb, sc=sc), signature(xt, sc), REGS)
            for kind, xt, mb, sc in STORED_SCALE_TARGETS]
    out += [(f"k_decode_linear[{kind},{xt},{mb},split{nh}]", _decode_kernel(kind, xt, mb, nh=nh), signature(xt), REGS)
            for kind, xt, mb, nh in SPLIT_TARGETS]
    out += [(f"k_decode_linear[{kind},{xt},{mb},sc{SC_F16},lanes{int(not LANES)}]",
             _decode_kernel(kind, xt, mb, sc=SC_F16, lanes=not LANES), signature(xt, SC_F16), REGS)
            for kind, xt, mb in ((fast.KIND_I4, XT_BF16, 1), (fast.KIND_I8, XT_F32, 4))]
    return out
