"""The row kernels: the block grid splits only the last canonical axis (or the scheme is
per-tensor) and codes pack along it (the `RP` geometry)."""
from __future__ import annotations

import math

from .devmath import *  # noqa: F401,F403
from .grids import jit_regs, launch, resident_blocks, sm_count  # noqa: F401
from .layouts import *  # noqa: F401,F403
from .intrin import f2u, fmax_nan, ld4, stb4, stb8, u2f
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
    """Row kernel, two modes: GIVEN (quantize with stored scales; codes of nf lanes OR into one word
    written by the word's first lane; docs/spec.md, arithmetic and portable bytes) and STATS
    (per-slot statistic by lane groups into stat[], and the max over slots into gbuf[1] for
    two-level). Calibrated one-level blocks go to k_tile_quant, which rounds each scale once per
    block."""
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


def launch_held(nslots: int, width: int, bf16: bool, held: int, regs: int) -> tuple[int, int]:
    """(blocks, threads) for a wide kernel holding `held` quads a thread (`make_wide_quant`) at
    `regs` registers a thread over slots of at most `width` elements: the fewest whole warps whose
    quads cover a slot (at least two, at most 1024 threads), a block per slot, as many per SM as
    its registers and warps allow (grid-stride past)."""
    if config.ENABLE_CUDASIM:
        return launch_wide(nslots)
    nq = -(-width // (8 if bf16 else 4))
    tpb = min(1024, max(64, 32 * -(-nq // (32 * held))))
    return max(1, min(nslots, sm_count() * resident_blocks(tpb // 32, regs))), tpb


@cuda.jit(device=True, inline="always")
def wide_value(x, xbf, i):
    """Element i of x as the wide kernels read it: float32 bits one per u32 word, or (xbf)
    bfloat16 bits two per word, low half first (their f32 values are exact)."""
    if xbf:
        return u2f((x[i >> int64(1)] >> (uint32(i & int64(1)) * uint32(16))) << uint32(16))
    return u2f(x[i])


@cuda.jit(device=True, inline="always")
def wide_pairs(xbf, base, cnt):
    """Whether a wide slot's elements are read a u32 word at a time, two bfloat16 per word: x is
    bfloat16 and the slot starts on a word (an odd count leaves one last element)."""
    return xbf and (base & int64(1)) == int64(0)


@cuda.jit(device=True, inline="always")
def wide_quads(xbf, base, cnt, out):
    """Whether a wide slot is read 16 bytes at a time (`wide_slot_max_quads`): its elements
    start and end on 16-byte boundaries of x (8 bfloat16 or 4 float32) and its codes on 8-byte
    (4-byte) boundaries of the payload; the caller's x starts on a 16-byte boundary."""
    per = int64(8) if xbf else int64(4)
    return base % per == int64(0) and cnt % per == int64(0) and out % per == int64(0)


@cuda.jit(device=True, inline="always")
def quad_span(xbf, base, cnt):
    """(x's u32 word where a `wide_quads` slot starts, its 16-byte quads): 8 bfloat16 or 4 float32
    a quad."""
    return (base >> int64(1)) if xbf else base, cnt >> int64(3) if xbf else cnt >> int64(2)


@cuda.jit(device=True, inline="always")
def finish_max(m, sh):
    """(the block's maximum of the threads' m, whether this thread's was not finite, which then
    counts as infinite): the end of the 16-byte max loops, whose `fmax_nan` keeps a NaN."""
    bad = not m <= float32(FLT_MAX)
    if bad:
        m = float32(math.inf)
    return block_max(m, sh), bad


@cuda.jit(device=True, inline="always")
def quad_absmax(a0, a1, a2, a3, xbf, m):
    """max(m, |x|) over the elements of four words of x (bfloat16 pairs where `xbf`), NaN as soon
    as one is NaN (`fmax_nan`)."""
    if xbf:
        hi = uint32(0xFFFF0000)
        m = fmax_nan(m, fmax_nan(abs(u2f(a0 << uint32(16))), abs(u2f(a0 & hi))))
        m = fmax_nan(m, fmax_nan(abs(u2f(a1 << uint32(16))), abs(u2f(a1 & hi))))
        m = fmax_nan(m, fmax_nan(abs(u2f(a2 << uint32(16))), abs(u2f(a2 & hi))))
        return fmax_nan(m, fmax_nan(abs(u2f(a3 << uint32(16))), abs(u2f(a3 & hi))))
    return fmax_nan(m, fmax_nan(fmax_nan(abs(u2f(a0)), abs(u2f(a1))), fmax_nan(abs(u2f(a2)), abs(u2f(a3)))))


@cuda.jit(device=True, inline="always")
def wide_slot_max_quads(x, xbf, base, cnt, sh):
    """`wide_slot_max` of a slot that `wide_quads` takes: 16-byte loads, two in flight per
    thread, adjacent across the thread block; |x| folded by `fmax_nan`, so a NaN or an infinity
    leaves a maximum that is not finite (which then counts as infinite)."""
    t = int64(cuda.threadIdx.x)
    tpb = int64(cuda.blockDim.x)
    w0, nq = quad_span(xbf, base, cnt)
    m = float32(0.0)
    q = t
    while q + tpb < nq:
        a0, a1, a2, a3 = ld4(x, w0 + int64(4) * q)
        b0, b1, b2, b3 = ld4(x, w0 + int64(4) * (q + tpb))
        m = quad_absmax(a0, a1, a2, a3, xbf, m)
        m = quad_absmax(b0, b1, b2, b3, xbf, m)
        q += int64(2) * tpb
    if q < nq:
        a0, a1, a2, a3 = ld4(x, w0 + int64(4) * q)
        m = quad_absmax(a0, a1, a2, a3, xbf, m)
    return finish_max(m, sh)


@cuda.jit(device=True, inline="always")
def finite_max_bits(bits, mb, bad):
    """(the larger of `mb` and |v|'s f32 bits, bad) for f32 bits `bits`: bits of non-negative
    floats order as the floats do; a non-finite v sets bad and counts as 0."""
    ab = bits & uint32(0x7FFFFFFF)
    if ab >= uint32(0x7F800000):
        return mb, True
    return max(mb, ab), bad


@cuda.jit(device=True, inline="always")
def pair_max_bits(word, mb, bad):
    """`finite_max_bits` over the two bfloat16 of one word (as f32 bits)."""
    mb, bad = finite_max_bits(word << uint32(16), mb, bad)
    return finite_max_bits(word & uint32(0xFFFF0000), mb, bad)


@cuda.jit(device=True, inline="always")
def block_max(m, sh):
    """max of every thread's m over the thread block: a warp shuffle, then the warps' maxima
    through shared memory (read by every thread; free again on return)."""
    t = int64(cuda.threadIdx.x)
    m = group_max(m, int64(32), sh)
    if t & int64(31) == int64(0):
        sh[t >> int64(5)] = m
    cuda.syncthreads()
    m = sh[0]
    for w in range(int64(1), (int64(cuda.blockDim.x) + int64(31)) >> int64(5)):
        m = max(m, sh[w])
    cuda.syncthreads()  # every thread has read the maxima before the next slot writes them
    return m


@cuda.jit(device=True, inline="always")
def wide_slot_max(x, xbf, base, cnt, sh):
    """(max |x| over elements [base, base + cnt), infinite where any element is not finite;
    whether this thread met a non-finite value) for the whole thread block: its threads stride
    over the slot (coalesced), four loads in flight each, bfloat16 a word (two elements) at a time
    (`wide_pairs`), the maximum kept as f32 bits; then `block_max`. A maximum is exact in any
    order."""
    t = int64(cuda.threadIdx.x)
    tpb = int64(cuda.blockDim.x)
    bad = False
    mb = uint32(0)
    if wide_pairs(xbf, base, cnt):
        w0 = base >> int64(1)
        nw = cnt >> int64(1)
        j = t
        while j + int64(3) * tpb < nw:
            a = x[w0 + j]
            b = x[w0 + j + tpb]
            c = x[w0 + j + int64(2) * tpb]
            d = x[w0 + j + int64(3) * tpb]
            mb, bad = pair_max_bits(a, mb, bad)
            mb, bad = pair_max_bits(b, mb, bad)
            mb, bad = pair_max_bits(c, mb, bad)
            mb, bad = pair_max_bits(d, mb, bad)
            j += int64(4) * tpb
        while j < nw:
            mb, bad = pair_max_bits(x[w0 + j], mb, bad)
            j += tpb
        if cnt & int64(1) and t == int64(0):
            mb, bad = finite_max_bits(f2u(wide_value(x, xbf, base + cnt - int64(1))), mb, bad)
    else:
        i = t
        while i + int64(3) * tpb < cnt:
            a = f2u(wide_value(x, xbf, base + i))
            b = f2u(wide_value(x, xbf, base + i + tpb))
            c = f2u(wide_value(x, xbf, base + i + int64(2) * tpb))
            d = f2u(wide_value(x, xbf, base + i + int64(3) * tpb))
            mb, bad = finite_max_bits(a, mb, bad)
            mb, bad = finite_max_bits(b, mb, bad)
            mb, bad = finite_max_bits(c, mb, bad)
            mb, bad = finite_max_bits(d, mb, bad)
            i += int64(4) * tpb
        while i < cnt:
            mb, bad = finite_max_bits(f2u(wide_value(x, xbf, base + i)), mb, bad)
            i += tpb
    m = u2f(mb)
    if bad:
        m = float32(math.inf)
    return block_max(m, sh), bad


@cuda.jit
def k_wide_stats(x, xbf, RP, stat, gstat, flag):
    """Row geometry, blocks wider than the row kernel's lane groups: max |x| per slot into
    stat[], a thread block per slot (`wide_slot_max`). Two-level: gstat[0] = max over slots.
    Non-finite x sets flag[0]."""
    sh = cuda.shared.array(ROW_TPB, float32)
    bad = False
    gm = float32(0.0)
    for sl in range(int64(cuda.blockIdx.x), RP[R_R] * RP[R_GL], int64(cuda.gridDim.x)):
        base, cnt, _ = wide_slot_where(RP, sl)
        m, b = wide_slot_max(x, xbf, base, cnt, sh)
        bad = bad or b
        if math.isinf(m):  # a non-finite x (flagged): 0 keeps the next kernels finite
            m = float32(0.0)
        if cuda.threadIdx.x == 0:
            stat[sl] = m
        gm = max(gm, m)
    if bad:
        flag[0] = int32(1)
    if RP[R_TWO] != 0 and cuda.threadIdx.x == 0:
        cuda.atomic.max(gstat, 0, gm)


@cuda.jit(device=True, inline="always")
def wide_slot_where(RP, sl):
    """(x's offset of wide slot `sl`, its element count, its offset in the values section)."""
    GL = RP[R_GL]
    line = sl // GL
    i0 = (sl % GL) * RP[R_B]
    return line * RP[R_L] + i0, min(RP[R_B], RP[R_L] - i0), line * RP[R_W] + i0


@cuda.jit(device=True, inline="always")
def wide_slot_scale_of(m, RP, F, stored, payload, sl):
    """(e, the reciprocal r where `fast_div_ok(e)` else 0) of slot `sl` from its maximum m (the
    block's): as k_scales s = max / h rounded by the slot's rule into stored[sl] and the scale
    bytes (docs/spec.md, scale storage). An infinite m (a non-finite x, `wide_slot_max`) gives
    codes 0 (e = 0 here) and a NaN scale, so that a product that does not wait for the flag
    (W8A8's `act`) gives NaN for its row (docs/spec.md, quantized activations)."""
    sdt = RP[R_SDT]
    nonfinite = math.isinf(m)
    e = float32(0.0) if nonfinite else round_scale(float32(m / F[F_H]), sdt)
    if cuda.threadIdx.x == 0:
        se = float32(math.nan) if nonfinite else e
        stored[sl] = se
        put_le(payload, RP[R_SOFF] + sl * RP[R_SNB], int64(scale_word(se, sdt)), RP[R_SNB])
    r = float32(0.0)
    if e != float32(0.0) and fast_div_ok(e):
        r = float32(float32(1.0) / e)
    return e, r


@cuda.jit(device=True, inline="always")
def wide_quotient(v, e, r, isf):
    """y = RN(v / e) of the spec's quantize (0 where e is 0): from the slot's reciprocal `r` as
    the fast kernels divide (`qdiv`; a minifloat's zero keeps v's sign), by `div.rn` where r is 0."""
    if r != float32(0.0):
        y = qdiv(v, e, r)
        if isf:
            y = float32(math.copysign(y, v))
        return y
    if e != float32(0.0):
        return float32(v / e)
    return float32(0.0)


@cuda.jit(device=True, inline="always")
def wide_y(bits, e, r, isf):
    """y = v / e (`wide_quotient`) of the element with f32 bits `bits`; a non-finite v (flagged
    by the slot's maximum) counts as 0."""
    v = u2f(bits)
    if not math.isfinite(v):
        v = float32(0.0)
    return wide_quotient(v, e, r, isf)


@cuda.jit(device=True, inline="always")
def code_int8(y, P):
    """The int8 code of y (P as `code_by_encode`'s): clamped to [qmin, qmax], then rounded half to
    even into the low mantissa bits (1.5 * 2**23)."""
    return f2u(min(max(y, P[2]), P[3]) + float32(MAGIC)) & uint32(0xFF)


@cuda.jit(device=True, inline="always")
def code_by_encode(y, P):
    """The 8-bit code of y (P = (isf, e4, qmin, qmax, fmax, mb, bias, bits)): integers by
    `code_int8`; FP8 by `encode`."""
    if P[0]:
        return uint32(encode(y, P[0], P[2], P[3], P[4], P[5], P[6], P[7]) & int64(0xFF))
    return code_int8(y, P)


def wide_kind(RP) -> int:
    """The value kind of a wide plan's parameters (host array) as `make_wide_quant`'s `only` takes
    it: 0 int8 codes, 1 E4M3, 2 E5M2 (the FP8 kind its mantissa bits say)."""
    return 0 if int(RP[R_ISF]) == 0 else 1 if int(RP[R_MB]) == 3 else 2


def make_wide_quant(code, pairs=None, held=0, only=None):
    """The wide quantize kernel (a Python function for `cuda.jit`) writing each 8-bit code as
    `code(y, P)` gives it: one-level row blocks wider than a warp of int8, E4M3 or E5M2 codes
    one per byte, calibrated by max |x|. Statistic (`wide_slot_max`), scale (`wide_slot_scale_of`)
    and codes of a slot by one thread block, x read twice (the second time mostly from L2), four
    loads in flight per thread, bfloat16 a word at a time (`wide_pairs`). `code_by_encode` gives
    `k_wide_quant`, the path of GPUs below the fast kernels'; `fast.k_wide_quant` converts in
    hardware. Given `pairs` (int8, E4M3 and E5M2 coders of two codes, `pair(hi, lo, P)` = code(lo)
    | code(hi) << 8: `fast.wide_quads_kernel`, for x on a 16-byte boundary, which the caller
    checks), a slot that `wide_quads` takes is read 16 bytes at a time (`wide_slot_max_quads`) and,
    where its scale has a reciprocal (`wide_slot_scale_of`'s r), its codes are written 4 or 8 bytes
    at a time by a loop per value kind (chosen once per slot): y = RN(x / e) by the reciprocal
    (`qdiv`) with x's sign, no finiteness check (a non-finite x makes the slot's scale 0, which
    has no reciprocal). The same bytes in fewer instructions. With `held` (> 0, with `pairs`), a
    slot that `wide_quads` takes and whose quads number at most `held` per thread is read once: each thread loads
    its quads into registers, all in flight together, takes their maximum and writes their codes
    from the registers (no second read of x); `launch_held` sizes the thread block so that the
    plan's slots fit. With `only` (0 int8, 1 E4M3, 2 E5M2: `wide_kind`) the kernel takes that
    value kind alone (the caller checks the scheme's): the kind is a constant, so the other kinds'
    loops are not compiled (a smaller kernel: fewer instruction fetches)."""
    quads = pairs is not None
    assert held == 0 or quads, "held quads need the pair coders"
    hn = max(1, 4 * held)  # (u32 words of x a thread holds; a constant)

    @cuda.jit(device=True, inline="always")
    def put_pair(payload, o, a, e, r, isf, P):
        """The codes of the two bfloat16 of word `a` into payload[o], payload[o + 1]."""
        payload[o] = code(wide_y(a << uint32(16), e, r, isf), P)
        payload[o + int64(1)] = code(wide_y(a & uint32(0xFFFF0000), e, r, isf), P)

    def quads_loop(pair):
        """The codes of a slot that `wide_quads` takes, its scale e with reciprocal r, two codes
        at a time by `pair`; two 16-byte loads in flight per thread."""

        @cuda.jit(device=True, inline="always")
        def y_of(bits, e, r):
            v = u2f(bits)
            return float32(math.copysign(qdiv(v, e, r), v))

        @cuda.jit(device=True, inline="always")
        def word_pair(a, e, r, P):
            """The codes of the two bfloat16 of word `a`, the low half's in the low byte."""
            return pair(y_of(a & uint32(0xFFFF0000), e, r), y_of(a << uint32(16), e, r), P)

        @cuda.jit(device=True, inline="always")
        def put_quad(payload, o, a0, a1, a2, a3, xbf, e, r, P):
            if xbf:
                stb8(payload, o, word_pair(a0, e, r, P) | (word_pair(a1, e, r, P) << uint32(16)),
                     word_pair(a2, e, r, P) | (word_pair(a3, e, r, P) << uint32(16)))
            else:
                stb4(payload, o, pair(y_of(a1, e, r), y_of(a0, e, r), P) |
                     (pair(y_of(a3, e, r), y_of(a2, e, r), P) << uint32(16)))

        @cuda.jit(device=True, inline="always")
        def put_quads(x, xbf, base, cnt, out, payload, e, r, P):
            t = int64(cuda.threadIdx.x)
            tpb = int64(cuda.blockDim.x)
            w0, nq = quad_span(xbf, base, cnt)
            ob = int64(8) if xbf else int64(4)
            q = t
            while q + tpb < nq:
                a0, a1, a2, a3 = ld4(x, w0 + int64(4) * q)
                b0, b1, b2, b3 = ld4(x, w0 + int64(4) * (q + tpb))
                put_quad(payload, out + ob * q, a0, a1, a2, a3, xbf, e, r, P)
                put_quad(payload, out + ob * (q + tpb), b0, b1, b2, b3, xbf, e, r, P)
                q += int64(2) * tpb
            if q < nq:
                a0, a1, a2, a3 = ld4(x, w0 + int64(4) * q)
                put_quad(payload, out + ob * q, a0, a1, a2, a3, xbf, e, r, P)

        @cuda.jit(device=True, inline="always")
        def put_held(hv, xbf, nq, out, payload, e, r, P):
            """The codes of the quads a thread holds (`held_max`) into the payload."""
            t = int64(cuda.threadIdx.x)
            tpb = int64(cuda.blockDim.x)
            ob = int64(8) if xbf else int64(4)
            for j in range(held):
                q = t + int64(j) * tpb
                if q < nq:
                    put_quad(payload, out + ob * q, hv[4 * j], hv[4 * j + 1], hv[4 * j + 2], hv[4 * j + 3], xbf, e, r,
                             P)

        return put_quads, put_held

    if quads:
        (quads_int, held_int), (quads_e4m3, held_e4m3), (quads_e5m2, held_e5m2) = (quads_loop(pair) for pair in pairs)
    else:
        @cuda.jit(device=True, inline="always")
        def no_quads(x, xbf, base, cnt, out, payload, e, r, P):
            """(never called: `vq` is False in a kernel without `pairs`)"""

        @cuda.jit(device=True, inline="always")
        def no_held(hv, xbf, nq, out, payload, e, r, P):
            """(never called: `hq` is False in a kernel without `pairs`)"""

        quads_int = quads_e4m3 = quads_e5m2 = no_quads
        held_int = held_e4m3 = held_e5m2 = no_held

    @cuda.jit(device=True, inline="always")
    def held_max(x, xbf, base, cnt, hv, sh):
        """`wide_slot_max_quads` of a slot of at most `held` quads a thread, its quads kept in
        `hv`: thread t holds quads t, t + tpb, ... (all loads issued before any is used; quads
        past the slot are zeros)."""
        t = int64(cuda.threadIdx.x)
        tpb = int64(cuda.blockDim.x)
        w0, nq = quad_span(xbf, base, cnt)
        for j in range(held):
            q = t + int64(j) * tpb
            a0 = a1 = a2 = a3 = uint32(0)
            if q < nq:
                a0, a1, a2, a3 = ld4(x, w0 + int64(4) * q)
            hv[4 * j], hv[4 * j + 1], hv[4 * j + 2], hv[4 * j + 3] = a0, a1, a2, a3
        m = float32(0.0)
        for j in range(held):
            m = quad_absmax(hv[4 * j], hv[4 * j + 1], hv[4 * j + 2], hv[4 * j + 3], xbf, m)
        return finish_max(m, sh)

    def k_wide_quant(x, xbf, RP, F, stored, payload, flag):
        sh = cuda.shared.array(ROW_TPB, float32)
        if only is None:
            isf = RP[R_ISF] != 0
            e4 = RP[R_MB] == 3
        else:
            isf, e4 = only != 0, only == 1  # (constants: the other kinds' branches are pruned)
        P = (isf, e4, F[F_QMIN], F[F_QMAX], F[F_FMAX], RP[R_MB], RP[R_BIAS], RP[R_BITS])
        hv = cuda.local.array(hn, uint32)
        t = int64(cuda.threadIdx.x)
        tpb = int64(cuda.blockDim.x)
        bad = False
        for sl in range(int64(cuda.blockIdx.x), RP[R_R] * RP[R_GL], int64(cuda.gridDim.x)):
            base, cnt, out = wide_slot_where(RP, sl)
            vq = quads and wide_quads(xbf, base, cnt, out)
            nq = quad_span(xbf, base, cnt)[1]
            hq = held > 0 and vq and nq <= int64(held) * tpb
            if hq:
                m, b = held_max(x, xbf, base, cnt, hv, sh)
            elif vq:
                m, b = wide_slot_max_quads(x, xbf, base, cnt, sh)
            else:
                m, b = wide_slot_max(x, xbf, base, cnt, sh)
            bad = bad or b
            e, r = wide_slot_scale_of(m, RP, F, stored, payload, sl)
            if hq and r != float32(0.0):
                if not isf:
                    held_int(hv, xbf, nq, out, payload, e, r, P)
                elif P[1]:
                    held_e4m3(hv, xbf, nq, out, payload, e, r, P)
                else:
                    held_e5m2(hv, xbf, nq, out, payload, e, r, P)
            elif vq and r != float32(0.0):
                if not isf:
                    quads_int(x, xbf, base, cnt, out, payload, e, r, P)
                elif P[1]:
                    quads_e4m3(x, xbf, base, cnt, out, payload, e, r, P)
                else:
                    quads_e5m2(x, xbf, base, cnt, out, payload, e, r, P)
            elif wide_pairs(xbf, base, cnt):
                w0 = base >> int64(1)
                nw = cnt >> int64(1)
                j = t
                while j + int64(3) * tpb < nw:
                    a0 = x[w0 + j]
                    a1 = x[w0 + j + tpb]
                    a2 = x[w0 + j + int64(2) * tpb]
                    a3 = x[w0 + j + int64(3) * tpb]
                    o = out + int64(2) * j
                    put_pair(payload, o, a0, e, r, isf, P)
                    put_pair(payload, o + int64(2) * tpb, a1, e, r, isf, P)
                    put_pair(payload, o + int64(4) * tpb, a2, e, r, isf, P)
                    put_pair(payload, o + int64(6) * tpb, a3, e, r, isf, P)
                    j += int64(4) * tpb
                while j < nw:
                    put_pair(payload, out + int64(2) * j, x[w0 + j], e, r, isf, P)
                    j += tpb
                if cnt & int64(1) and t == int64(0):
                    last = cnt - int64(1)
                    payload[out + last] = code(wide_y(f2u(wide_value(x, xbf, base + last)), e, r, isf), P)
            else:
                i = t
                while i + int64(3) * tpb < cnt:
                    v0 = f2u(wide_value(x, xbf, base + i))
                    v1 = f2u(wide_value(x, xbf, base + i + tpb))
                    v2 = f2u(wide_value(x, xbf, base + i + int64(2) * tpb))
                    v3 = f2u(wide_value(x, xbf, base + i + int64(3) * tpb))
                    payload[out + i] = code(wide_y(v0, e, r, isf), P)
                    payload[out + i + tpb] = code(wide_y(v1, e, r, isf), P)
                    payload[out + i + int64(2) * tpb] = code(wide_y(v2, e, r, isf), P)
                    payload[out + i + int64(3) * tpb] = code(wide_y(v3, e, r, isf), P)
                    i += int64(4) * tpb
                while i < cnt:
                    payload[out + i] = code(wide_y(f2u(wide_value(x, xbf, base + i)), e, r, isf), P)
                    i += tpb
        if bad:
            flag[0] = int32(1)

    return k_wide_quant


k_wide_quant = cuda.jit(make_wide_quant(code_by_encode))


@jit_regs(40)
def k_rows_dequant(words, RP, lut, scales, gbuf, out, flag):
    """Row kernel: out[line, c] = decode(field c of its word) * e, coalesced (the spec's
    dequantize). Four lines per step, loads first, so each thread keeps four loads in flight. A NaN
    from `lut` (a code outside the value's set: the spec's invalid codes) sets flag[0]."""
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
