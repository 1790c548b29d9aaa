"""The row kernels: the block grid splits only the last canonical axis (or the scheme is
per-tensor) and codes pack along it (the `RP` geometry)."""
from __future__ import annotations

import math

from .devmath import *  # noqa: F401,F403
from .grids import jit_regs, launch, sm_count  # noqa: F401
from .layouts import *  # noqa: F401,F403
from .intrin import f2u, u2f
from .scales import SCALE_IDS, round_scale, scale_word, word_scale  # noqa: F401

from numba import config, cuda, float32, float64, int32, int64, uint32  # noqa: E402,F401

ROW_TPB = 256


def launch_rows(L: int, R: int) -> tuple[tuple[int, int], int]:
    """((blocks along L, blocks over lines), threads) for the row kernels."""
    tpb = 32 if config.ENABLE_CUDASIM else ROW_TPB
    gx = -(-L // tpb)
    if config.ENABLE_CUDASIM:
        return (gx, max(1, min(R, 2))), tpb
    return (gx, max(1, min(R, 65535, -(-sm_count() * 16 // gx)))), tpb


@jit_regs(64)
def k_rows_quant(x, RP, F, stored, gbuf, words, payload, flag, stat):
    """Row kernel, two modes: GIVEN (quantize with stored scales; codes of nf lanes OR into one
    word written by the word's first lane, SPEC §2, §3) and STATS (per-slot statistic by lane
    groups into stat[], and the max over slots into gbuf[1] for two-level). Calibrated one-level
    blocks go to k_tile_quant, which rounds each scale once per block."""
    sh_f = cuda.shared.array(ROW_TPB, float32)
    sh_d = cuda.shared.array(ROW_TPB, float64)
    sh_i = cuda.shared.array(ROW_TPB, int64)
    R = RP[R_R]
    L = RP[R_L]
    W = RP[R_W]
    B = RP[R_B]
    GL = RP[R_GL]
    nf = RP[R_NF]
    bits = RP[R_BITS]
    mode = RP[R_MODE]
    two = RP[R_TWO] != 0
    isf = RP[R_ISF] != 0
    mb = RP[R_MB]
    bias = RP[R_BIAS]
    absmean = RP[R_METHOD] == 1
    qmin = F[F_QMIN]
    qmax = F[F_QMAX]
    fmax = F[F_FMAX]
    g = gbuf[0]
    c = int64(cuda.blockIdx.x) * int64(cuda.blockDim.x) + int64(cuda.threadIdx.x)
    valid = c < L
    f = c % nf
    wc = c // nf
    scol = c // B
    cnt = min(B, L - scol * B)
    shift = f * bits
    bad = False
    gm = float32(0.0)
    for line in range(int64(cuda.blockIdx.y), R, int64(cuda.gridDim.y)):
        v = float32(0.0)
        if valid:
            v = x[line * L + c]
            if not math.isfinite(v):  # flagged; 0 keeps the rest of the kernel finite
                bad = True
                v = float32(0.0)
        slot = line * GL + scol
        if mode == ROW_GIVEN:
            e = float32(0.0)
            if valid:
                e = stored[slot]
                if two:
                    e = two_level_e(g, e)
        else:  # ROW_STATS
            a = abs(v)
            if absmean:
                m = float32(group_sum(float64(a), B, sh_d) / float64(cnt))
            else:
                m = group_max(a, B, sh_f)
            if valid and c % B == 0:
                stat[slot] = m
            gm = max(gm, m)
            continue
        field = int64(0)
        if valid:
            y = float32(0.0)
            if e != float32(0.0):
                y = v / e
            field = encode(y, isf, qmin, qmax, fmax, mb, bias, bits) << shift
        word = group_or(field, nf, sh_i)
        if valid and f == 0:
            words[line * W + wc] = word
    if bad:
        flag[0] = int32(1)
    if mode == ROW_STATS and two:
        cuda.atomic.max(gbuf, 1, gm)




def launch_wide(nslots: int) -> tuple[int, int]:
    """(blocks, threads) for the wide kernels: a block per slot, up to 16 per SM (grid-stride past)."""
    if config.ENABLE_CUDASIM:
        return max(1, min(nslots, 2)), 32
    return max(1, min(nslots, sm_count() * 16)), ROW_TPB


@cuda.jit(device=True, inline="always")
def wide_value(x, xbf, i):
    """Element i of x as the wide kernels read it: float32 bits one per u32 word, or (xbf)
    bfloat16 bits two per word, low half first (their f32 values are exact)."""
    if xbf:
        return u2f((x[i >> int64(1)] >> (uint32(i & int64(1)) * uint32(16))) << uint32(16))
    return u2f(x[i])


@cuda.jit(device=True, inline="always")
def wide_slot_max(x, xbf, base, cnt, sh):
    """(max |x| over elements [base, base + cnt), whether this thread met a non-finite value,
    counted as 0) for the whole thread block: its threads stride over the elements (coalesced),
    then a tree in shared memory. A maximum is exact in any order: the statistic k_slot_stats
    gives, whose thread per slot walks a block of thousands of elements alone."""
    t = int64(cuda.threadIdx.x)
    tpb = int64(cuda.blockDim.x)
    bad = False
    m = float32(0.0)
    for i in range(t, cnt, tpb):
        v = wide_value(x, xbf, base + i)
        if not math.isfinite(v):
            bad = True
            v = float32(0.0)
        m = max(m, abs(v))
    sh[t] = m
    cuda.syncthreads()
    half = tpb // int64(2)
    while half > int64(0):
        if t < half:
            sh[t] = max(sh[t], sh[t + half])
        cuda.syncthreads()
        half //= int64(2)
    m = sh[0]
    cuda.syncthreads()  # every thread has read sh[0] before the next slot writes it
    return m, bad


@cuda.jit
def k_wide_stats(x, xbf, RP, stat, gstat, flag):
    """Row geometry, blocks wider than the row kernel's lane groups: max |x| per slot into
    stat[], a thread block per slot (`wide_slot_max`). Two-level: gstat[0] = max over slots.
    Non-finite x sets flag[0]."""
    sh = cuda.shared.array(ROW_TPB, float32)
    L = RP[R_L]
    B = RP[R_B]
    GL = RP[R_GL]
    bad = False
    gm = float32(0.0)
    for sl in range(int64(cuda.blockIdx.x), RP[R_R] * GL, int64(cuda.gridDim.x)):
        i0 = (sl % GL) * B
        m, b = wide_slot_max(x, xbf, (sl // GL) * L + i0, min(B, L - i0), sh)
        bad = bad or b
        if cuda.threadIdx.x == 0:
            stat[sl] = m
        gm = max(gm, m)
    if bad:
        flag[0] = int32(1)
    if RP[R_TWO] != 0 and cuda.threadIdx.x == 0:
        cuda.atomic.max(gstat, 0, gm)


@cuda.jit(device=True, inline="always")
def wide_slot_scale(x, xbf, RP, F, stored, payload, sl, sh):
    """The first half of a wide quantize slot, by the whole thread block: (x's offset of the slot,
    its element count, its offset in the values section, e, the slot's reciprocal r where
    `fast_div_ok(e)` else 0, whether this thread met a non-finite x). The maximum
    (`wide_slot_max`), then as k_scales s = max / h rounded by the slot's rule into stored[sl]
    and the scale bytes (SPEC §2.3)."""
    GL = RP[R_GL]
    line = sl // GL
    i0 = (sl % GL) * RP[R_B]
    base = line * RP[R_L] + i0
    cnt = min(RP[R_B], RP[R_L] - i0)
    m, bad = wide_slot_max(x, xbf, base, cnt, sh)
    sdt = RP[R_SDT]
    e = round_scale(float32(m / F[F_H]), sdt)
    if cuda.threadIdx.x == 0:
        stored[sl] = e
        put_le(payload, RP[R_SOFF] + sl * RP[R_SNB], int64(scale_word(e, sdt)), RP[R_SNB])
    r = float32(0.0)
    if e != float32(0.0) and fast_div_ok(e):
        r = float32(float32(1.0) / e)
    return base, cnt, line * RP[R_W] + i0, e, r, bad


@cuda.jit(device=True, inline="always")
def wide_quotient(v, e, r, isf):
    """y = RN(v / e) of SPEC §2.4 (0 where e is 0): from the slot's reciprocal `r` as the fast
    kernels divide (`qdiv`; a minifloat's zero keeps v's sign), by `div.rn` where r is 0."""
    if r != float32(0.0):
        y = qdiv(v, e, r)
        if isf:
            y = float32(math.copysign(y, v))
        return y
    if e != float32(0.0):
        return float32(v / e)
    return float32(0.0)


@cuda.jit
def k_wide_quant(x, xbf, RP, F, stored, payload, flag):
    """One-level row blocks wider than a warp of int8, E4M3 or E5M2 codes one per byte,
    calibrated by max |x|: statistic, scale and codes of a slot by one thread block, x read twice
    (the second time mostly from L2): `wide_slot_scale`, then each code from `wide_quotient`,
    integers by the 1.5 * 2**23 rounding, FP8 by `encode` (no sm_89 conversion: this kernel is
    also the path of older GPUs; `fast.k_wide_quant` converts in hardware)."""
    sh = cuda.shared.array(ROW_TPB, float32)
    isf = RP[R_ISF] != 0
    mb = RP[R_MB]
    bias = RP[R_BIAS]
    bits = RP[R_BITS]
    qmin = F[F_QMIN]
    qmax = F[F_QMAX]
    fmax = F[F_FMAX]
    t = int64(cuda.threadIdx.x)
    tpb = int64(cuda.blockDim.x)
    bad = False
    for sl in range(int64(cuda.blockIdx.x), RP[R_R] * RP[R_GL], int64(cuda.gridDim.x)):
        base, cnt, out, e, r, b = wide_slot_scale(x, xbf, RP, F, stored, payload, sl, sh)
        bad = bad or b
        for i in range(t, cnt, tpb):
            v = wide_value(x, xbf, base + i)
            if not math.isfinite(v):
                v = float32(0.0)
            y = wide_quotient(v, e, r, isf)
            if isf:
                c = encode(y, isf, qmin, qmax, fmax, mb, bias, bits)
            else:  # clamp, then round half to even into the low mantissa bits
                c = int64(f2u(min(max(y, qmin), qmax) + float32(MAGIC)))
            payload[out + i] = c & int64(0xFF)
    if bad:
        flag[0] = int32(1)


@jit_regs(40)
def k_rows_dequant(words, RP, lut, scales, gbuf, out, flag):
    """Row kernel: out[line, c] = decode(field c of its word) * e, coalesced (SPEC §2.6). Four
    lines per step, loads first, so each thread keeps four loads in flight. A NaN from `lut` (a
    code outside the value's set, SPEC v1.1 §3) sets flag[0]."""
    R = RP[R_R]
    L = RP[R_L]
    W = RP[R_W]
    B = RP[R_B]
    GL = RP[R_GL]
    nf = RP[R_NF]
    bits = RP[R_BITS]
    two = RP[R_TWO] != 0
    g = gbuf[0]
    if not two:
        g = float32(1.0)
    mask = (int64(1) << bits) - int64(1)
    c = int64(cuda.blockIdx.x) * int64(cuda.blockDim.x) + int64(cuda.threadIdx.x)
    gy = int64(cuda.gridDim.y)
    if c < L:
        wc = c // nf
        shift = (c % nf) * bits
        scol = c // B
        for l0 in range(int64(cuda.blockIdx.y), R, int64(4) * gy):
            l1 = l0 + gy
            l2 = l1 + gy
            l3 = l2 + gy
            w0 = int64(words[l0 * W + wc])
            e0 = scales[l0 * GL + scol]
            w1 = int64(0)
            w2 = int64(0)
            w3 = int64(0)
            e1 = float32(0.0)
            e2 = float32(0.0)
            e3 = float32(0.0)
            if l1 < R:
                w1 = int64(words[l1 * W + wc])
                e1 = scales[l1 * GL + scol]
            if l2 < R:
                w2 = int64(words[l2 * W + wc])
                e2 = scales[l2 * GL + scol]
            if l3 < R:
                w3 = int64(words[l3 * W + wc])
                e3 = scales[l3 * GL + scol]
            if two:  # e = g * s_b, one f32 multiply, or s_b / G (one-level: e = s)
                e0 = two_level_e(g, e0)
                e1 = two_level_e(g, e1)
                e2 = two_level_e(g, e2)
                e3 = two_level_e(g, e3)
            d0 = lut[(w0 >> shift) & mask]
            d1 = lut[(w1 >> shift) & mask]
            d2 = lut[(w2 >> shift) & mask]
            d3 = lut[(w3 >> shift) & mask]
            out[l0 * L + c] = d0 * e0
            if l1 < R:
                out[l1 * L + c] = d1 * e1
            if l2 < R:
                out[l2 * L + c] = d2 * e2
            if l3 < R:
                out[l3 * L + c] = d3 * e3
            if not (math.isfinite(d0) and math.isfinite(d1) and math.isfinite(d2) and math.isfinite(d3)):
                flag[0] = int32(1)  # lines past R read word 0, a real field: never a false alarm
