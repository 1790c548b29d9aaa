"""The general kernels: any rank, multi-dimensional blocks, packing along any axis (the `P`
geometry): statistics per tensor and per slot, scales, codes (a pass over runs, or one pass per
block where it fits), scale decoding, dequantize; input conversion and the error statistics."""
from __future__ import annotations

import math

from .devmath import *  # noqa: F401,F403
from .grids import jit_regs, launch, sm_count  # noqa: F401
from .layouts import *  # noqa: F401,F403
from .scales import SCALE_IDS, round_scale, scale_word, word_scale  # noqa: F401

from numba import config, cuda, float32, float64, int32, int64, uint32  # noqa: E402,F401


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
    noise[t] = sum (y - x)^2 (f64), mx[t] = max |y - x| (a NaN kept); the host adds up the grid's
    partials (the figures of `qcore.backend.stats.error_stats`)."""
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
        a = abs(d)
        if a > m or a != a:  # a NaN stays the max
            m = a
    sig[t] = s
    noise[t] = e2
    mx[t] = m


@cuda.jit
def k_tensor_stats(x, amax, asum, flag):
    """Per-tensor statistic: max |x| into amax[0] and sum |x| (f64) into asum[0] (the spec's
    calibration); flag[0] = 1 on any NaN/Inf. One shared-memory atomic per thread, one global per
    block."""
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
def k_fill2(a, v0, v1):
    """a[0], a[1] = v0, v1 (one thread): the presets of the per-tensor atomics below."""
    if cuda.grid(1) == 0:
        a[0] = v0
        a[1] = v1


@cuda.jit
def k_tensor_range(x, lohi, flag):
    """Per-tensor max x into lohi[0] and min x into lohi[1] (preset -inf / +inf; an affine
    per-tensor scheme, docs/spec.md, affine offsets), in parallel: shared-memory atomics per block,
    one global pair per block; flag[0] = 1 on NaN/Inf (counted as 0)."""
    sh = cuda.shared.array(2, float32)
    if cuda.threadIdx.x == 0:
        sh[0] = float32(-math.inf)
        sh[1] = float32(math.inf)
    cuda.syncthreads()
    hi = float32(-math.inf)
    lo = float32(math.inf)
    bad = False
    start, step = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, x.size, step):
        v = x[i]
        if not math.isfinite(v):
            bad = True
            v = float32(0.0)
        hi = max(hi, v)
        lo = min(lo, v)
    if bad:
        flag[0] = int32(1)
    cuda.atomic.max(sh, 0, hi)
    cuda.atomic.min(sh, 1, lo)
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        cuda.atomic.max(lohi, 0, sh[0])
        cuda.atomic.min(lohi, 1, sh[1])


@cuda.jit
def k_first_extreme(x, amax, first):
    """The first flat index whose |x| is amax[0] into first[0] (preset past the end): the signed
    extreme of a per-tensor signed scheme (docs/spec.md, signed scales) is x at it; non-finite x is
    skipped."""
    start, step = cuda.grid(1), cuda.gridsize(1)
    top = amax[0]
    for i in range(start, x.size, step):
        v = x[i]
        if math.isfinite(v) and abs(v) == top:
            cuda.atomic.min(first, 0, int64(i))
            return


@cuda.jit
def k_take_extreme(x, first, raw):
    """raw[0] = x[first[0]] (one thread), or 0 when no element matched (all non-finite)."""
    if cuda.grid(1) == 0:
        i = first[0]
        raw[0] = x[i] if i < x.size else float32(0.0)


@cuda.jit
def k_slot_stats(x, P, stat, gstat, flag):
    """Per block slot: max |x| or mean |x| (f64 sum, one f32 rounding) over its elements, edge
    blocks cropped (the spec's calibration); gstat[0] = max over slots (for two-level). Thread per
    slot, walking the block in row-major order, so that for signed scales (docs/spec.md) the
    statistic is the first element of largest |x|, with its sign. An affine scheme gets the slot's
    max x here and its min x at stat[nslots + slot]."""
    idx = cuda.local.array(MAXR, int64)
    ext = cuda.local.array(MAXR, int64)
    cr = P[M_CR]
    absmean = P[M_METHOD] == 1
    signed = P[M_SIGNED] != 0
    affine = P[M_AFFINE] != 0
    nslots = P[M_NSLOTS]
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
        m = float32(-1.0)  # below every |x|: the first element is the signed extreme until beaten
        sv = float32(0.0)
        lo = float32(math.inf)
        hi = float32(-math.inf)
        s = float64(0.0)
        off = xo
        for _ in range(cnt):
            v = x[off]
            if not math.isfinite(v):  # flagged; 0 keeps the rest of the kernel finite
                bad = True
                v = float32(0.0)
            a = abs(v)
            if a > m:  # strictly: the first of equal magnitudes keeps its sign
                sv = v
            m = max(m, a)
            lo = min(lo, v)
            hi = max(hi, v)
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
        stat[sl] = sv if signed else m
        if affine:  # affine offsets: the slot's max, and its min after the slots
            stat[sl] = hi
            stat[nslots + sl] = lo
        gm = max(gm, m)
    if bad:
        flag[0] = int32(1)
    if P[M_TWO] != 0:
        cuda.atomic.max(gstat, 0, gm)


@cuda.jit
def k_scales(raw, asum, P, F, stored, gbuf, payload):
    """Scale slots -> stored scales (f32) and their payload bytes (docs/spec.md, calibration to scale
    storage, portable bytes).

    MODE 0: raw = statistic per slot (per-tensor: amax in raw[0], f64 sum in asum[0]);
    s = stat / h, two-level s /= g (g from gbuf[1] = max statistic), rounded by the slot's rule.
    A reciprocal global (P[M_TWO] == 2, docs/spec.md, reciprocal global scale): G from the max
    statistic, s = G * s, and g = -G (`two_level_e` divides by it).
    MODE 1: raw = explicit stored scales (already rounded by the core), g in gbuf[0] (-G for a
    reciprocal global). Two-level: gbuf[0] = g and the f32 bytes of |g| follow the scales.
    Signed scales: h is qmin and the statistic signed; the magnitude is rounded, the sign
    kept. A code rule (code rules, P[M_CODES]): raw[sl] becomes the raw scale s, for `k_quant`.
    An affine offset: raw[sl] = max, raw[nslots + sl] = min (MODE 0) or the given stored
    offset (MODE 1); the offset goes into its section, and raw[nslots + sl] becomes what
    `k_quant` subtracts: the stored min (SPEC's division), the raw min (a code rule) or z.
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
        elif P[M_TWO] == 2:
            g = -reciprocal_g(gbuf[1], h, F[F_M])
        else:
            g = two_level_g(gbuf[1], h, F[F_M])
    affine = P[M_AFFINE]
    nslots = P[M_NSLOTS]
    start, step = cuda.grid(1), cuda.gridsize(1)
    for sl in range(start, nslots, step):
        if affine != 0:
            st = affine_slot(raw, sl, nslots, P, F, explicit, payload)
        elif explicit:
            st = raw[sl]
        else:
            if P[M_PERT] != 0 and P[M_METHOD] == 1:
                stat = float32(asum[0] / float64(P[M_N]))
            else:
                stat = raw[sl]
            s = float32(stat / h)
            if two:
                s = float32(s * -g) if g < float32(0.0) else float32(s / g)
            st = math.copysign(round_scale(abs(s), sdt), s)
            if P[M_CODES] != 0:
                raw[sl] = s
        stored[sl] = st
        put_le(payload, soff + sl * snb, int64(scale_word(st, sdt)), snb)
    if two and start == 0:
        gbuf[0] = g
        put_le(payload, P[M_GOFF], int64(scale_word(abs(g), int64(SDT_F32))), int64(4))


@cuda.jit
def k_quant(x, P, F, stored, gbuf, payload, flag, asum, raw):
    """Quantize and pack with given stored scales (docs/spec.md, effective scale, quantize, portable
    bytes). Thread per run of RL elements (whole words) along the run axis; e = s, or g * s_b (one
    f32 multiply). Under a code rule (docs/spec.md, code rules) the codes come from
    `x * (1 / raw[slot])` instead, the raw scales `k_scales` left there (or the given ones), through
    `codecs.code_rule_kernel`.

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
    rule = P[M_CODES]
    affine = P[M_AFFINE]
    nslots = P[M_NSLOTS]
    mask = (int64(1) << bits) - int64(1)
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
            e = two_level_e(g, e)
        rc = float32(0.0)
        if rule != 0:
            rc = rule_rcp(raw[sb + gi * gsr])
        o = float32(0.0)
        if affine != 0:
            o = raw[nslots + sb + gi * gsr]
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
                            e = two_level_e(g, e)
                        if rule != 0:
                            rc = rule_rcp(raw[sb + gi * gsr])
                        if affine != 0:
                            o = raw[nslots + sb + gi * gsr]
                    v = x[xo + (p0 + u) * xsr]
                    if not math.isfinite(v):  # flagged; 0 keeps the rest of the kernel finite
                        bad = True
                        v = float32(0.0)
                    y = float32(0.0)
                    if affine == AFFINE_MIN:
                        v = float32(v - o)
                    if affine == AFFINE_ZERO:
                        if e != float32(0.0):
                            y = v / e
                        word |= (zero_code(y, o, qmin, qmax) & mask) << (f * bits)
                    elif rule != 0:
                        if v != float32(0.0):
                            y = float32(v * rc)
                        word |= (rule_code(y, rule, qmin, qmax) & mask) << (f * bits)
                    else:
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
    """Calibrate and quantize one block slot per run, in one pass (docs/spec.md, calibration to
    quantize, portable bytes): the run is exactly the block (one-level, block along the run axis
    only, whole words per block)."""
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
        e = round_scale(float32(m / h), sdt)
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
    """Stored scale words -> float32 (and the two-level global into gbuf[0]; a reciprocal global
    as -G; an affine scheme's offsets into scales[nslots:])."""
    sdt = P[M_SDT]
    snb = P[M_SNB]
    soff = P[M_SOFF]
    nslots = P[M_NSLOTS]
    start, step = cuda.grid(1), cuda.gridsize(1)
    for sl in range(start, nslots, step):
        scales[sl] = word_scale(get_le(payload, soff + sl * snb, snb), sdt)
        if P[M_AFFINE] != 0:  # affine offsets: after the scales
            scales[nslots + sl] = read_offset(payload, sl, P)
    if start == 0:
        gbuf[0] = float32(1.0)
        if P[M_TWO] != 0:
            gbuf[0] = word_scale(get_le(payload, P[M_GOFF], int64(4)), int64(SDT_F32))
            if P[M_TWO] == 2:  # a reciprocal global: -G, which `two_level_e` divides by
                gbuf[0] = -gbuf[0]


@cuda.jit
def k_dequant(payload, P, lut, scales, gbuf, out, flag):
    """Unpack codes and scale: x' = decode(q) * e in f32 (affine offsets: `affine_value`), stored in
    out's dtype (the spec's dequantize).
    Thread per run, same runs as k_quant. `lut` holds NaN for codes outside the value's set
    (the spec's invalid codes); meeting one sets flag[0] and the host names the element."""
    r = P[M_RAX]
    nf = P[M_NF]
    bits = P[M_BITS]
    wb = P[M_WB]
    br = P[O_B + r]
    xsr = P[O_XS + r]
    wsr = P[O_WS + r]
    gsr = P[O_GS + r]
    two = P[M_TWO] != 0
    affine = P[M_AFFINE]
    nslots = P[M_NSLOTS]
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
            e = two_level_e(g, e)
        o = float32(0.0)
        if affine != 0:
            o = scales[nslots + sb + gi * gsr]
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
                            e = two_level_e(g, e)
                        if affine != 0:
                            o = scales[nslots + sb + gi * gsr]
                    d = lut[(word >> (f * bits)) & mask]
                    if not math.isfinite(d):
                        bad = True
                    out[xo + (p0 + u) * xsr] = affine_value(d, e, o, affine)
                    u += int64(1)
                    rem += int64(1)
    if bad:
        flag[0] = int32(1)


@cuda.jit
def k_zero_stats(asum, gbuf):
    """Zero the statistics scratch after the row path consumed it (one thread)."""
    asum[0] = float64(0.0)
    gbuf[1] = float32(0.0)
    gbuf[2] = float32(0.0)
