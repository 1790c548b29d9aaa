"""Numba-CUDA kernels of the `cuda` backend (SPEC §2, §3).

Kernels live at module level in a module that imports `numba.cuda` at the top: the CUDA
simulator only swaps module-global names bound to `numba.cuda`, so kernels built in closures
would not run there (docs/numba-cuda.md). `backend.py` imports this module lazily.

Every kernel is a grid-stride loop over work items (a run of elements, a scale slot, ...), with
64-bit index arithmetic; its launch config comes from `launch()`. Geometry travels in a small
int64 array `P` (layout below, built by `_plan.py`) and float constants in a float32 array `F`,
so each kernel has one signature (`SIGNATURES`, compiled for sm_90 by the tests).

Scales are rounded up and stored by `scales.py` (on the f32 bits, from the core's trait
numbers), as in the fast kernels; minifloat codes are computed arithmetically with
`frexp`/`ldexp`, which are exact, so the same code runs in the simulator and on a GPU. Every
literal is cast (`int64(...)`, `float32(...)`): compiled numba and the simulator's NumPy scalars
promote differently otherwise.
"""
from __future__ import annotations

import functools
import math

import numpy as np

# numba-cuda 0.30.4 registers `np.row_stack`, which numpy 2.5 removed, so no kernel compiles
# under numpy >= 2.5 without this alias (NVIDIA/numba-cuda#907, closed as won't-fix).
if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack

from qcore.codecs import F32_TINY  # noqa: E402

from .scales import SCALE_IDS, round_up, scale_word, word_scale  # noqa: E402

from numba import config, cuda, float32, float64, int32, int64, uint32  # noqa: E402

# ----------------------------------------------------------------------------- P layout
MAXR = 12  # canonical rank limit (after merging axes; see _plan.py)
(M_CR, M_RAX, M_RL, M_NF, M_BITS, M_WB, M_NRL, M_NRUNS, M_NSLOTS, M_N, M_PERT, M_TWO, M_SDT,
 M_SOFF, M_GOFF, M_METHOD, M_ISF, M_MB, M_BIAS, M_SNB, M_KFIRST, M_MODE) = range(22)
O_S = 24            # extents of the canonical axes
O_B = O_S + MAXR    # block extents (per-tensor: the extents themselves)
O_G = O_B + MAXR    # block-grid extents ceil(S / B)
O_XS = O_G + MAXR   # element strides (row-major)
O_WS = O_XS + MAXR  # word strides (row-major over the words shape)
O_GS = O_WS + MAXR  # slot strides (row-major over the grid)
P_LEN = O_GS + MAXR
# F layout
F_H, F_M, F_QMIN, F_QMAX, F_FMAX = range(5)
F_LEN = 8
SDT_F32 = SCALE_IDS.index("f32")  # the global scale of a two-level scheme is always F32
TINY = float(F32_TINY)  # smallest normal f32: floor of a two-level global scale (SPEC §2.2)


def _jit_regs(n: int):
    """`cuda.jit` capped at `n` registers per thread on a GPU (occupancy for the memory-bound
    kernels: uncapped, ptxas gives the tile kernel 110 and the matmul 133); the simulator
    rejects the keyword."""
    if config.ENABLE_CUDASIM:
        return cuda.jit
    return cuda.jit(max_registers=n)


@functools.lru_cache(maxsize=None)
def sm_count() -> int:
    """Streaming multiprocessors of the current device (read once per process; it only sizes
    grids, so a later device switch costs speed, never correctness). The simulator: 1."""
    if config.ENABLE_CUDASIM:
        return 1
    return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)


def launch(n: int) -> tuple[int, int]:
    """(blocks, threads) for `n` work items of a grid-stride kernel; never 0 (callers skip n == 0).

    Under the simulator the cost is per launched thread, so the grid stays tiny (2 x 32) and the
    loops stride; on a GPU it is at most 16 blocks of 256 threads per SM.
    """
    if config.ENABLE_CUDASIM:
        return (max(1, min(2, -(-n // 32))), 32)
    tpb = 256
    return (max(1, min(-(-n // tpb), sm_count() * 16)), tpb)


# ----------------------------------------------------------------------------- device math
if config.ENABLE_CUDASIM:
    def ldexp(x, e):
        """x * 2**e; the simulator's math.ldexp refuses NumPy ints."""
        return np.float32(math.ldexp(float(x), int(e)))
else:
    @cuda.jit(device=True, inline="always")
    def ldexp(x, e):
        """x * 2**e (exact); libdevice ldexpf takes an int32 exponent."""
        return math.ldexp(x, int32(e))


@cuda.jit(device=True, inline="always")
def mf_code(a, mb, bias):
    """Code of `a >= 0` (finite) in a sign-less float with `mb` mantissa bits and `bias`:
    nearest value, ties to the even code, subnormals included (SPEC §2.5). Exact: frexp/ldexp
    move exponents only, and `round` is round-half-even."""
    if a < ldexp(float32(1.0), (int64(1) - bias)):
        return int64(round(ldexp(a, (bias + mb - int64(1)))))
    m, e = math.frexp(a)  # a = m * 2**e, m in [0.5, 1)
    q = int64(round(ldexp(m, (mb + int64(1)))))  # 2**mb .. 2**(mb+1) (carry = next binade)
    return ((int64(e) - int64(2) + bias) << mb) + q


@cuda.jit(device=True, inline="always")
def mf_value(c, mb, bias):
    """float32 value of code `c` of a sign-less float (inverse of `mf_code`)."""
    ex = c >> mb
    f = c & ((int64(1) << mb) - int64(1))
    if ex == 0:
        return float32(ldexp(float32(f), (int64(1) - bias - mb)))
    return float32(ldexp(float32(f + (int64(1) << mb)), ex - bias - mb))


@cuda.jit(device=True, inline="always")
def encode(y, isf, qmin, qmax, fmax, mb, bias, bits):
    """The `bits`-wide field of `y = x / e` (SPEC §2.5). Integers: clamp then round half to even
    (same as clamp(rint)); minifloats: saturate at ±max, nearest, ties to even, sign of y."""
    if isf:
        c = mf_code(min(abs(y), fmax), mb, bias)
        if math.copysign(float32(1.0), y) < float32(0.0):
            c |= int64(1) << (bits - int64(1))
        return c
    q = int64(round(min(max(y, qmin), qmax)))
    return q & ((int64(1) << bits) - int64(1))


@cuda.jit(device=True, inline="always")
def put_le(buf, off, word, nbytes):
    """Write the low `nbytes` bytes of `word` little-endian at byte `off`."""
    for i in range(nbytes):
        buf[off + i] = (word >> (int64(8) * i)) & int64(0xFF)


@cuda.jit(device=True, inline="always")
def get_le(buf, off, nbytes):
    w = int64(0)
    for i in range(nbytes):
        w |= int64(buf[off + i]) << (int64(8) * i)
    return w


@cuda.jit(device=True, inline="always")
def two_level_g(gstat, h, mx):
    """SPEC §2.2: g = max(max_b s_b / M, tiny); max_b(stat_b / h) == (max_b stat_b) / h exactly,
    since correctly rounded division by h > 0 is monotone."""
    return max(float32(float32(gstat / h) / mx), float32(TINY))


@cuda.jit(device=True, inline="always")
def run_origin(P, t):
    """Run `t` -> (x offset, word offset, slot base, position along the run axis, element count).

    A run is `RL` consecutive elements of one line along the run axis r (the packing axis, or
    the blocked/last axis for Native); the slot base sums the other axes' grid coordinates.
    """
    cr = P[M_CR]
    r = P[M_RAX]
    nrl = P[M_NRL]
    line = t // nrl
    j = t - line * nrl
    kfirst = P[M_KFIRST]
    xo = int64(0)
    wo = int64(0)
    sb = int64(0)
    k = cr - int64(1)
    while k >= kfirst:
        if k != r:
            if k == kfirst:
                i = line
            else:
                ext = P[O_S + k]
                i = line % ext
                line = line // ext
            xo += i * P[O_XS + k]
            wo += i * P[O_WS + k]
            sb += (i // P[O_B + k]) * P[O_GS + k]
        k -= int64(1)
    p0 = j * P[M_RL]
    cnt = min(P[M_RL], P[O_S + r] - p0)
    return xo, wo, sb, p0, cnt


# ----------------------------------------------------------------------------- kernels
@cuda.jit
def k_convert_f16(src, dst):
    """float16 -> float32 (exact)."""
    start, step = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, dst.size, step):
        dst[i] = float32(src[i])


@cuda.jit
def k_convert_f64(src, dst):
    """float64 -> float32 (round to nearest even, as numpy's astype)."""
    start, step = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, dst.size, step):
        dst[i] = float32(src[i])


@cuda.jit
def k_error_partials(x, y, sig, noise, mx):
    """Per-thread partial error statistics of `y` approximating `x` (grid-stride): sig[t] = sum x^2,
    noise[t] = sum (y - x)^2 (f64), mx[t] = max |y - x|; the host adds up the grid's partials."""
    t = cuda.grid(1)
    step = cuda.gridsize(1)
    s = float64(0.0)
    e2 = float64(0.0)
    m = float32(0.0)
    for i in range(t, x.size, step):
        xv = x[i]
        d = y[i] - xv
        s += float64(xv) * float64(xv)
        e2 += float64(d) * float64(d)
        m = max(m, abs(d))
    sig[t] = s
    noise[t] = e2
    mx[t] = m


@cuda.jit
def k_tensor_stats(x, amax, asum, flag):
    """Per-tensor statistic: max |x| into amax[0] and sum |x| (f64) into asum[0] (SPEC §2.1);
    flag[0] = 1 on any NaN/Inf. One shared-memory atomic per thread, one global per block."""
    sh_max = cuda.shared.array(1, float32)
    sh_sum = cuda.shared.array(1, float64)
    if cuda.threadIdx.x == 0:
        sh_max[0] = float32(0.0)
        sh_sum[0] = float64(0.0)
    cuda.syncthreads()
    m = float32(0.0)
    s = float64(0.0)
    bad = False
    start, step = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, x.size, step):
        v = x[i]
        if not math.isfinite(v):  # flagged; 0 keeps the rest of the kernel finite
            bad = True
            v = float32(0.0)
        a = abs(v)
        m = max(m, a)
        s += float64(a)
    if bad:
        flag[0] = int32(1)
    cuda.atomic.max(sh_max, 0, m)
    cuda.atomic.add(sh_sum, 0, s)
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        cuda.atomic.max(amax, 0, sh_max[0])
        cuda.atomic.add(asum, 0, sh_sum[0])


@cuda.jit
def k_slot_stats(x, P, stat, gstat, flag):
    """Per block slot: max |x| or mean |x| (f64 sum, one f32 rounding) over its elements, edge
    blocks cropped (SPEC §2.1); gstat[0] = max over slots (for two-level). Thread per slot."""
    idx = cuda.local.array(MAXR, int64)
    ext = cuda.local.array(MAXR, int64)
    cr = P[M_CR]
    absmean = P[M_METHOD] == 1
    start, step = cuda.grid(1), cuda.gridsize(1)
    gm = float32(0.0)
    bad = False
    for sl in range(start, P[M_NSLOTS], step):
        rem = sl
        xo = int64(0)
        cnt = int64(1)
        k = cr - int64(1)
        while k >= 0:
            g = rem % P[O_G + k]
            rem = rem // P[O_G + k]
            i0 = g * P[O_B + k]
            c = min(P[O_B + k], P[O_S + k] - i0)
            ext[k] = c
            idx[k] = int64(0)
            xo += i0 * P[O_XS + k]
            cnt *= c
            k -= int64(1)
        m = float32(0.0)
        s = float64(0.0)
        off = xo
        for _ in range(cnt):
            v = x[off]
            if not math.isfinite(v):  # flagged; 0 keeps the rest of the kernel finite
                bad = True
                v = float32(0.0)
            a = abs(v)
            m = max(m, a)
            s += float64(a)
            k = cr - int64(1)
            while k >= 0:  # odometer step over the box
                idx[k] += int64(1)
                off += P[O_XS + k]
                if idx[k] < ext[k]:
                    break
                off -= ext[k] * P[O_XS + k]
                idx[k] = int64(0)
                k -= int64(1)
        if absmean:
            m = float32(s / float64(cnt))
        stat[sl] = m
        gm = max(gm, m)
    if bad:
        flag[0] = int32(1)
    if P[M_TWO] != 0:
        cuda.atomic.max(gstat, 0, gm)


@cuda.jit
def k_scales(raw, asum, P, F, stored, gbuf, payload):
    """Scale slots -> stored scales (f32) and their payload bytes (SPEC §2.1-2.3, §3).

    MODE 0: raw = statistic per slot (per-tensor: amax in raw[0], f64 sum in asum[0]);
    s = stat / h, two-level s /= g (g from gbuf[1] = max statistic), round up.
    MODE 1: raw = explicit stored scales (already rounded by the core), g in gbuf[0].
    Two-level: gbuf[0] = g and its f32 bytes follow the scales.
    """
    sdt = P[M_SDT]
    snb = P[M_SNB]
    soff = P[M_SOFF]
    two = P[M_TWO] != 0
    explicit = P[M_MODE] == 1
    h = F[F_H]
    g = float32(0.0)
    if two:
        if explicit:
            g = gbuf[0]
        else:
            g = two_level_g(gbuf[1], h, F[F_M])
    start, step = cuda.grid(1), cuda.gridsize(1)
    for sl in range(start, P[M_NSLOTS], step):
        if explicit:
            st = raw[sl]
        else:
            if P[M_PERT] != 0 and P[M_METHOD] == 1:
                stat = float32(asum[0] / float64(P[M_N]))
            else:
                stat = raw[sl]
            s = float32(stat / h)
            if two:
                s = float32(s / g)
            st = round_up(s, sdt)
        stored[sl] = st
        put_le(payload, soff + sl * snb, int64(scale_word(st, sdt)), snb)
    if two and start == 0:
        gbuf[0] = g
        put_le(payload, P[M_GOFF], int64(scale_word(g, int64(SDT_F32))), int64(4))


@cuda.jit
def k_quant(x, P, F, stored, gbuf, payload, flag, asum):
    """Quantize and pack with given stored scales (SPEC §2.4-2.5, §3). Thread per run of RL
    elements (whole words) along the run axis; e = s, or g * s_b (one f32 multiply).

    The statistics scratch (asum[0], gbuf[1], gbuf[2]) is consumed by now (k_scales ran before,
    in stream order), so thread 0 zeroes it for the next call: no memset launch per call."""
    r = P[M_RAX]
    nf = P[M_NF]
    bits = P[M_BITS]
    wb = P[M_WB]
    br = P[O_B + r]
    xsr = P[O_XS + r]
    wsr = P[O_WS + r]
    gsr = P[O_GS + r]
    two = P[M_TWO] != 0
    isf = P[M_ISF] != 0
    mb = P[M_MB]
    bias = P[M_BIAS]
    qmin = F[F_QMIN]
    qmax = F[F_QMAX]
    fmax = F[F_FMAX]
    g = gbuf[0]
    bad = False
    start, step = cuda.grid(1), cuda.gridsize(1)
    if start == 0:
        asum[0] = float64(0.0)
        gbuf[1] = float32(0.0)
        gbuf[2] = float32(0.0)
    for t in range(start, P[M_NRUNS], step):
        xo, wo, sb, p0, cnt = run_origin(P, t)
        gi = p0 // br
        rem = p0 - gi * br
        e = stored[sb + gi * gsr]
        if two:
            e = g * e
        nw = (cnt + nf - int64(1)) // nf
        wi = p0 // nf
        u = int64(0)
        for w in range(nw):
            word = int64(0)
            for f in range(nf):
                if u < cnt:
                    if rem == br:
                        gi += int64(1)
                        rem = int64(0)
                        e = stored[sb + gi * gsr]
                        if two:
                            e = g * e
                    v = x[xo + (p0 + u) * xsr]
                    if not math.isfinite(v):  # flagged; 0 keeps the rest of the kernel finite
                        bad = True
                        v = float32(0.0)
                    y = float32(0.0)
                    if e != float32(0.0):
                        y = v / e
                    word |= encode(y, isf, qmin, qmax, fmax, mb, bias, bits) << (f * bits)
                    u += int64(1)
                    rem += int64(1)
            put_le(payload, (wo + (wi + w) * wsr) * wb, word, wb)
    if bad:
        flag[0] = int32(1)


@cuda.jit
def k_quant_fused(x, P, F, payload, flag):
    """Calibrate and quantize one block slot per run, in one pass (SPEC §2.1-2.5, §3): the run
    is exactly the block (one-level, block along the run axis only, whole words per block)."""
    r = P[M_RAX]
    nf = P[M_NF]
    bits = P[M_BITS]
    wb = P[M_WB]
    xsr = P[O_XS + r]
    wsr = P[O_WS + r]
    gsr = P[O_GS + r]
    isf = P[M_ISF] != 0
    mb = P[M_MB]
    bias = P[M_BIAS]
    sdt = P[M_SDT]
    snb = P[M_SNB]
    soff = P[M_SOFF]
    absmean = P[M_METHOD] == 1
    h = F[F_H]
    qmin = F[F_QMIN]
    qmax = F[F_QMAX]
    fmax = F[F_FMAX]
    rl = P[M_RL]
    bad = False
    start, step = cuda.grid(1), cuda.gridsize(1)
    for t in range(start, P[M_NRUNS], step):
        xo, wo, sb, p0, cnt = run_origin(P, t)
        base = xo + p0 * xsr
        m = float32(0.0)
        s = float64(0.0)
        for u in range(cnt):
            v = x[base + u * xsr]
            if not math.isfinite(v):  # flagged; 0 keeps the rest of the kernel finite
                bad = True
                v = float32(0.0)
            a = abs(v)
            m = max(m, a)
            s += float64(a)
        if absmean:
            m = float32(s / float64(cnt))
        e = round_up(float32(m / h), sdt)
        put_le(payload, soff + (sb + (p0 // rl) * gsr) * snb, int64(scale_word(e, sdt)), snb)
        nw = (cnt + nf - int64(1)) // nf
        wi = p0 // nf
        for w in range(nw):
            word = int64(0)
            for f in range(nf):
                u = w * nf + f
                if u < cnt:
                    v = x[base + u * xsr]
                    y = float32(0.0)
                    if e != float32(0.0) and math.isfinite(v):
                        y = v / e
                    word |= encode(y, isf, qmin, qmax, fmax, mb, bias, bits) << (f * bits)
            put_le(payload, (wo + (wi + w) * wsr) * wb, word, wb)
    if bad:
        flag[0] = int32(1)


@cuda.jit
def k_decode_scales(payload, P, scales, gbuf):
    """Stored scale words -> float32 (and the two-level global into gbuf[0])."""
    sdt = P[M_SDT]
    snb = P[M_SNB]
    soff = P[M_SOFF]
    start, step = cuda.grid(1), cuda.gridsize(1)
    for sl in range(start, P[M_NSLOTS], step):
        scales[sl] = word_scale(get_le(payload, soff + sl * snb, snb), sdt)
    if start == 0:
        gbuf[0] = float32(1.0)
        if P[M_TWO] != 0:
            gbuf[0] = word_scale(get_le(payload, P[M_GOFF], int64(4)), int64(SDT_F32))


@cuda.jit
def k_dequant(payload, P, lut, scales, gbuf, out, flag):
    """Unpack codes and scale: x' = decode(q) * e in f32, stored in out's dtype (SPEC §2.6).
    Thread per run, same runs as k_quant. `lut` holds NaN for codes outside the value's set
    (SPEC v1.1 §3); meeting one sets flag[0] and the host names the element."""
    r = P[M_RAX]
    nf = P[M_NF]
    bits = P[M_BITS]
    wb = P[M_WB]
    br = P[O_B + r]
    xsr = P[O_XS + r]
    wsr = P[O_WS + r]
    gsr = P[O_GS + r]
    two = P[M_TWO] != 0
    mask = (int64(1) << bits) - int64(1)
    g = gbuf[0]
    bad = False
    start, step = cuda.grid(1), cuda.gridsize(1)
    for t in range(start, P[M_NRUNS], step):
        xo, wo, sb, p0, cnt = run_origin(P, t)
        gi = p0 // br
        rem = p0 - gi * br
        e = scales[sb + gi * gsr]
        if two:
            e = g * e
        nw = (cnt + nf - int64(1)) // nf
        wi = p0 // nf
        u = int64(0)
        for w in range(nw):
            word = get_le(payload, (wo + (wi + w) * wsr) * wb, wb)
            for f in range(nf):
                if u < cnt:
                    if rem == br:
                        gi += int64(1)
                        rem = int64(0)
                        e = scales[sb + gi * gsr]
                        if two:
                            e = g * e
                    d = lut[(word >> (f * bits)) & mask]
                    if not math.isfinite(d):
                        bad = True
                    out[xo + (p0 + u) * xsr] = d * e
                    u += int64(1)
                    rem += int64(1)
    if bad:
        flag[0] = int32(1)


# ----------------------------------------------------------------------------- row kernels
# The common layout, coalesced: the block grid splits only the last canonical axis (or the
# scheme is per-tensor), and codes pack along that axis. The tensor is R lines of L elements;
# a thread owns one column c (consecutive threads, consecutive columns) and strides over lines,
# so every load and store of a warp is contiguous. Lanes of one block (B <= 32, B | 32) and of
# one word (nf lanes) combine through warp shuffles on a GPU; the simulator has no shuffles, so
# there the same group operations go through shared memory.
(R_R, R_L, R_W, R_B, R_GL, R_NF, R_BITS, R_MODE, R_SDT, R_SNB, R_SOFF, R_TWO, R_ISF, R_MB, R_BIAS,
 R_METHOD) = range(16)
R_LEN = 16
ROW_GIVEN, ROW_STATS = 0, 1
ROW_TPB = 256

def sim_group(cu, v, width, sh, op):
    """Simulator stand-in for a warp-shuffle reduction over aligned groups of `width` lanes,
    through shared memory. `cu` is the calling kernel module's `cuda`: the simulator swaps that
    name only in the module of the running kernel."""
    if width == 1:  # uniform across the block: no exchange needed
        return v
    tid = cu.threadIdx.x
    sh[tid] = v
    cu.syncthreads()
    b = tid - tid % width
    r = sh[b]
    for i in range(1, width):
        r = op(r, sh[b + i])
    cu.syncthreads()
    return r


if config.ENABLE_CUDASIM:
    def group_max(v, width, sh):
        """max of v over aligned groups of `width` lanes (simulator: through shared memory)."""
        return sim_group(cuda, v, width, sh, max)

    def group_sum(v, width, sh):
        return sim_group(cuda, v, width, sh, lambda p, q: p + q)

    def group_or(v, width, sh):
        return sim_group(cuda, v, width, sh, lambda p, q: p | q)
else:
    @cuda.jit(device=True, inline="always")
    def group_max(v, width, sh):
        """max of v over aligned groups of `width` lanes (width a power of two <= 32)."""
        off = width >> int64(1)
        while off > 0:
            v = max(v, cuda.shfl_xor_sync(0xFFFFFFFF, v, int32(off)))
            off >>= int64(1)
        return v

    @cuda.jit(device=True, inline="always")
    def group_sum(v, width, sh):
        off = width >> int64(1)
        while off > 0:
            v += cuda.shfl_xor_sync(0xFFFFFFFF, v, int32(off))
            off >>= int64(1)
        return v

    @cuda.jit(device=True, inline="always")
    def group_or(v, width, sh):
        off = width >> int64(1)
        while off > 0:
            v |= cuda.shfl_xor_sync(0xFFFFFFFF, v, int32(off))
            off >>= int64(1)
        return v


def launch_rows(L: int, R: int) -> tuple[tuple[int, int], int]:
    """((blocks along L, blocks over lines), threads) for the row kernels."""
    tpb = 32 if config.ENABLE_CUDASIM else ROW_TPB
    gx = -(-L // tpb)
    if config.ENABLE_CUDASIM:
        return (gx, max(1, min(R, 2))), tpb
    return (gx, max(1, min(R, 65535, -(-sm_count() * 16 // gx)))), tpb


@_jit_regs(64)
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
                    e = g * e
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


# Tile kernel: one-level blocks of B | 32 elements along the last axis. A warp takes a tile of
# 32 consecutive blocks of one line: coalesced loads into shared memory (padded: conflict-free
# both ways), then lane l owns block l: its statistic, its scale (rounded once per block, not
# once per element) and its codes, written as whole u32 words (or bytes) of the line.
(T_R, T_L, T_B, T_TL, T_NT, T_BITS, T_SDT, T_SNB, T_SOFF, T_GL, T_ISF, T_MB, T_BIAS, T_METHOD, T_WL,
 T_U32, T_MODE) = range(17)
T_LEN = 20
TILE_WARPS = 4  # warps per block on a GPU (the simulator runs one)
TILE_SH = TILE_WARPS * 33 * 32
TILE_SHW = TILE_WARPS * 33 * 8  # staged u32 words: up to 8 per block (B = 32, 8-bit codes)


@_jit_regs(64)
def k_tile_quant(x, TP, F, w32, w8, payload, flag, stat, gbuf):
    """Fused calibrate+quantize (MODE 1) or block statistics only (MODE 2: stat[slot], and the
    max over slots into gbuf[1] for two-level), one block per lane (SPEC §2.1-2.5, §3)."""
    sh = cuda.shared.array(TILE_SH, float32)
    shw = cuda.shared.array(TILE_SHW, uint32)
    L = TP[T_L]
    B = TP[T_B]
    TL = TP[T_TL]
    NT = TP[T_NT]
    bits = TP[T_BITS]
    sdt = TP[T_SDT]
    snb = TP[T_SNB]
    soff = TP[T_SOFF]
    GL = TP[T_GL]
    isf = TP[T_ISF] != 0
    mb = TP[T_MB]
    bias = TP[T_BIAS]
    absmean = TP[T_METHOD] == 1
    WL = TP[T_WL]  # stored units (u32 words or bytes) per line
    u32 = TP[T_U32] != 0
    stats_only = TP[T_MODE] == 2
    h = F[F_H]
    qmin = F[F_QMIN]
    qmax = F[F_QMAX]
    fmax = F[F_FMAX]
    tid = int64(cuda.threadIdx.x)
    lane = tid % int64(32)
    wid = tid // int64(32)
    nw = int64(cuda.blockDim.x) // int64(32)
    base = wid * int64(33 * 32)
    wbase = wid * int64(33 * 8)
    ubits = int64(32) if u32 else int64(8)
    fpu = ubits // bits  # fields per stored unit
    upb = (B * bits) // ubits  # stored units per block
    bad = False
    gm = float32(0.0)
    for tb in range(int64(cuda.blockIdx.x), (NT + nw - int64(1)) // nw, int64(cuda.gridDim.x)):
        t = tb * nw + wid
        live = t < NT
        line = t // TL
        t0 = (t - line * TL) * (B * int64(32))
        xrow = line * L
        for j in range(B):
            col = t0 + j * int64(32) + lane
            v = float32(0.0)
            if live and col < L:
                v = x[xrow + col]
                if not math.isfinite(v):  # flagged; 0 keeps the rest of the kernel finite
                    bad = True
                    v = float32(0.0)
            sh[base + j * int64(33) + lane] = v
        cuda.syncthreads()
        c0 = t0 + lane * B
        if live and c0 < L:
            cnt = min(B, L - c0)
            m = float32(0.0)
            s = float64(0.0)
            i0 = lane * B
            # B | 32, so the lane's block never crosses a padded row: its elements sit at
            # row + p (the padding offset (i0 + p) // 32 is the same for every p)
            row = base + i0 + (i0 >> int64(5))
            for p in range(B):
                a = abs(sh[row + p])
                m = max(m, a)
                s += float64(a)
            if absmean:
                m = float32(s / float64(cnt))
            slot = line * GL + t0 // B + lane
            if stats_only:
                stat[slot] = m
                gm = max(gm, m)
            else:
                e = round_up(float32(m / h), sdt)
                put_le(payload, soff + slot * snb, int64(scale_word(e, sdt)), snb)
                u0 = (c0 * bits) // ubits
                bits32 = uint32(bits)
                for q in range(upb):
                    if u0 + q < WL:
                        word = uint32(0)  # a stored unit is at most 32 bits: assemble in 32-bit
                        p = q * fpu
                        sa = uint32(0)
                        for f in range(fpu):
                            if p < cnt:
                                y = float32(0.0)
                                if e != float32(0.0):
                                    y = sh[row + p] / e
                                word |= uint32(encode(y, isf, qmin, qmax, fmax, mb, bias, bits)) << sa
                            p += int64(1)
                            sa += bits32
                        if u32:  # staged, stored coalesced below
                            k = lane * upb + q
                            shw[wbase + k + k // int64(32)] = word
                        else:
                            w8[line * WL + u0 + q] = word
        cuda.syncthreads()
        if u32 and live and not stats_only:
            ut = (t0 * bits) // ubits  # first word of the tile in its line
            for k in range(lane, int64(32) * upb, int64(32)):
                if ut + k < WL:
                    w32[line * WL + ut + k] = shw[wbase + k + k // int64(32)]
        cuda.syncthreads()
    if bad:
        flag[0] = int32(1)
    if stats_only:
        cuda.atomic.max(gbuf, 1, gm)


def launch_tiles(nt: int) -> tuple[int, int]:
    if config.ENABLE_CUDASIM:
        return (max(1, min(2, nt)), 32)
    nw = TILE_WARPS
    return (max(1, min(-(-nt // nw), sm_count() * 16)), 32 * nw)


@cuda.jit
def k_zero_stats(asum, gbuf):
    """Zero the statistics scratch after the row path consumed it (one thread)."""
    asum[0] = float64(0.0)
    gbuf[1] = float32(0.0)
    gbuf[2] = float32(0.0)


@_jit_regs(40)
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
            if two:  # e = g * s_b, one f32 multiply (one-level: e = s, no multiply)
                e0 = g * e0
                e1 = g * e1
                e2 = g * e2
                e3 = g * e3
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


# matmul geometry (int64 array Q)
(Q_M, Q_K, Q_N, Q_PA, Q_NF, Q_BITS, Q_WB, Q_ROWB, Q_BK, Q_BN, Q_G1, Q_KC, Q_CHUNK, Q_NG, Q_TWO,
 Q_FAST, Q_W32, Q_SAME, Q_ISF) = range(19)
Q_LEN = 20
MM_COLS = 8  # output columns per thread


MM_BDX, MM_BDY = 32, 8  # matmul block: 32 column groups x 8 k-slices (simulator: 8 x 4)
MM_SH = MM_COLS * MM_BDX * MM_BDY  # shared floats per block


@_jit_regs(64)
def k_matmul(x, payload, p32, Q, lut, scales, gbuf, out):
    """Fused dequantize-matmul: out[m, n] += sum over a k-tile of x[m, k] * decode(w[k, n]) * e
    (f32; `out` zeroed first). Block = (column groups) x (k-slices of `chunk` rows); thread
    (tx, ty) owns 8 columns and one k-slice, the slices are summed in shared memory and each
    block adds its 8 * blockDim.x columns to `out` with one atomic each. Consecutive tx read
    consecutive bytes of a weight row.

    FAST (codes packed along N, rows long enough): the 8 codes of a thread are one `bits`-byte
    little-endian word of the row (one or two u32 loads when W32), SAME: the 8 columns share a
    scale slot (one scale load per row); integer codes decode arithmetically, minifloats by
    table. Otherwise each code is fetched from its own byte (any store, any block)."""
    acc = cuda.local.array(MM_COLS, float32)
    sc = cuda.local.array(MM_COLS, int64)
    sh = cuda.shared.array(MM_SH, float32)
    M = Q[Q_M]
    K = Q[Q_K]
    N = Q[Q_N]
    pa_n = Q[Q_PA] == 1  # packing along N (or Native)
    nf = Q[Q_NF]
    bits = Q[Q_BITS]
    wb = Q[Q_WB]
    rowb = Q[Q_ROWB]
    bk = Q[Q_BK]
    bn = Q[Q_BN]
    g1 = Q[Q_G1]
    chunk = Q[Q_CHUNK]
    ng = Q[Q_NG]
    two = Q[Q_TWO] != 0
    fast = Q[Q_FAST] != 0
    w32 = Q[Q_W32] != 0
    same = Q[Q_SAME] != 0
    isf = Q[Q_ISF] != 0
    g = gbuf[0]
    mask = (int64(1) << bits) - int64(1)
    half = int64(1) << (bits - int64(1))
    tx = int64(cuda.threadIdx.x)
    ty = int64(cuda.threadIdx.y)
    bdx = int64(cuda.blockDim.x)
    bdy = int64(cuda.blockDim.y)
    cg = int64(cuda.blockIdx.x) * bdx + tx
    kc = int64(cuda.blockIdx.y) * bdy + ty
    n0 = cg * int64(MM_COLS)
    for c in range(MM_COLS):
        sc[c] = min(n0 + c, N - int64(1)) // bn
    k0 = kc * chunk
    k1 = min(K, k0 + chunk)
    me = (ty * bdx + tx) * int64(MM_COLS)
    for m in range(int64(cuda.blockIdx.z), M, int64(cuda.gridDim.z)):
        for c in range(MM_COLS):
            acc[c] = float32(0.0)
        if cg < ng and k0 < K:
            kb = k0 // bk
            krem = k0 - kb * bk
            for k in range(k0, k1):
                if krem == bk:
                    kb += int64(1)
                    krem = int64(0)
                xv = x[m * K + k]
                if fast:
                    if w32:
                        wi = (k * rowb + ((n0 * bits) >> int64(3))) >> int64(2)
                        word = int64(p32[wi])
                        if bits == 8:
                            word |= int64(p32[wi + int64(1)]) << int64(32)
                    else:
                        word = get_le(payload, k * rowb + ((n0 * bits) >> int64(3)), bits)
                    e = scales[kb * g1 + sc[0]]
                    if two:
                        e = g * e
                    xe = xv * e
                    for c in range(MM_COLS):
                        if not same:
                            e = scales[kb * g1 + sc[c]]
                            if two:
                                e = g * e
                            xe = xv * e
                        code = (word >> (int64(c) * bits)) & mask
                        if isf:
                            v = lut[code]
                        else:
                            v = float32(int32((code ^ half) - half))
                        acc[c] += xe * v
                else:
                    for c in range(MM_COLS):
                        n = n0 + c
                        if n < N:
                            if pa_n:
                                bitpos = n * bits
                                byte = k * rowb + (bitpos >> int64(3))
                            else:
                                f = k % nf
                                bitpos = f * bits
                                byte = ((k // nf) * N + n) * wb + (bitpos >> int64(3))
                            code = (int64(payload[byte]) >> (bitpos & int64(7))) & mask
                            e = scales[kb * g1 + sc[c]]
                            if two:
                                e = g * e
                            acc[c] += (xv * e) * lut[code]
                krem += int64(1)
        for c in range(MM_COLS):
            sh[me + c] = acc[c]
        cuda.syncthreads()
        if ty == 0 and cg < ng:
            for c in range(MM_COLS):
                tot = float32(0.0)
                for j in range(bdy):
                    tot += sh[(j * bdx + tx) * int64(MM_COLS) + c]
                if n0 + c < N:
                    cuda.atomic.add(out, m * N + n0 + c, tot)
        cuda.syncthreads()


@cuda.jit
def k_zero(a):
    start, step = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, a.size, step):
        a[i] = float32(0.0)


def launch_matmul(ng: int, kc: int, m: int) -> tuple[tuple[int, int, int], tuple[int, int]]:
    """(grid, block) of k_matmul: column groups x k-slices x rows of x."""
    bdx, bdy = (8, 4) if config.ENABLE_CUDASIM else (MM_BDX, MM_BDY)
    return (-(-ng // bdx), -(-kc // bdy), max(1, min(m, 65535))), (bdx, bdy)


# Every kernel with every signature the backend launches it with (compiled for sm_90 by
# tests/test_cuda_platform.py::test_kernels_compile_for_sm90).
_A = "{}[::1]"
SIGNATURES: dict[str, list[str]] = {
    "k_convert_f16": ["void(float16[::1], float32[::1])"],
    "k_convert_f64": ["void(float64[::1], float32[::1])"],
    "k_tensor_stats": ["void(float32[::1], float32[::1], float64[::1], int32[::1])"],
    "k_error_partials": ["void(float32[::1], float32[::1], float64[::1], float64[::1], float32[::1])"],
    "k_slot_stats": ["void(float32[::1], int64[::1], float32[::1], float32[::1], int32[::1])"],
    "k_scales": ["void(float32[::1], float64[::1], int64[::1], float32[::1], float32[::1], float32[::1], "
                 "uint8[::1])"],
    "k_quant": ["void(float32[::1], int64[::1], float32[::1], float32[::1], float32[::1], uint8[::1], "
                "int32[::1], float64[::1])"],
    "k_quant_fused": ["void(float32[::1], int64[::1], float32[::1], uint8[::1], int32[::1])"],
    "k_decode_scales": ["void(uint8[::1], int64[::1], float32[::1], float32[::1])"],
    "k_dequant": [f"void(uint8[::1], int64[::1], float32[::1], float32[::1], float32[::1], {t}[::1], int32[::1])"
                  for t in ("float32", "float16", "float64")],
    "k_matmul": ["void(float32[::1], uint8[::1], uint32[::1], int64[::1], float32[::1], float32[::1], "
                 "float32[::1], float32[::1])"],
    "k_zero": ["void(float32[::1])"],
    "k_zero_stats": ["void(float64[::1], float32[::1])"],
    "k_tile_quant": ["void(float32[::1], int64[::1], float32[::1], uint32[::1], uint8[::1], uint8[::1], int32[::1], "
                     "float32[::1], float32[::1])"],
    "k_rows_quant": [f"void(float32[::1], int64[::1], float32[::1], float32[::1], float32[::1], {w}[::1], uint8[::1], "
                     "int32[::1], float32[::1])" for w in ("uint32", "uint8")],
    "k_rows_dequant": [f"void({w}[::1], int64[::1], float32[::1], float32[::1], float32[::1], {t}[::1], int32[::1])"
                       for w in ("uint32", "uint8") for t in ("float32", "float16", "float64")],
}
