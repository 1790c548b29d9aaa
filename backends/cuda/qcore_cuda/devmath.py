"""Device maths of the general, row, tile, fast and matmul kernels: minifloat codes by
frexp/ldexp (exact, so the simulator and a GPU agree), code encoding, the correctly rounded
division from a reciprocal (`qdiv`, `fast_div_ok`), little-endian words, the two-level
global scale, a run's origin in the `P` geometry, and reductions over aligned lane groups (warp
shuffles on a GPU, shared memory under the simulator)."""
from __future__ import annotations

import math

import numpy as np

from .layouts import *  # noqa: F401,F403  (the P layout's fields)
from .intrin import f2u, mul_rn
from .scales import round_scale, scale_word, word_scale  # noqa: F401
from qcore.spec.codecs import code_rule_kernel

from numba import config, cuda, float32, float64, int32, int64, uint32  # noqa: E402

rule_code = code_rule_kernel(cuda.jit(device=True, inline="always"))
"""The int64 code of `y` under a code rule (docs/spec.md, code rules): `qcore.spec.codecs`' one source."""

MAGIC = 12582912.0  # 1.5 * 2**23: y + MAGIC rounds y half-to-even into the low mantissa bits
P2_M60 = 8.673617379884035e-19
P2_120 = 1.329227995784916e36

if config.ENABLE_CUDASIM:
    def qdiv(x, e, r):
        """x / e, correctly rounded (the simulator divides; the GPU's Markstein form agrees)."""
        return float32(x / e)
else:
    @cuda.jit(device=True, inline="always")
    def qdiv(x, e, r):
        """RN(x / e) from r = RN(1 / e): Markstein's correction step, the correctly rounded
        quotient whenever `fast_div_ok(e)` (fast.py's module text)."""
        q = x * r
        return cuda.fma(cuda.fma(-q, e, x), r, q)


@cuda.jit(device=True, inline="always")
def fast_div_ok(e):
    """Whether qdiv(x, e, 1 / e) is RN(x / e) for every |x / e| the calibrated modes produce."""
    return e >= float32(P2_M60) and e <= float32(P2_120) and (f2u(e) & uint32(0x7FFFFF)) != uint32(0x7FFFFF)


@cuda.jit(device=True, inline="always")
def affine_value(d, e, o, kind):
    """x' of decoded value `d` with effective scale `e` and offset `o` (docs/spec.md, affine
    offsets): MIN `f32(f32(d * e) + o)` (the product rounded on its own: `mul_rn`, never an fma),
    ZERO `f32(f32(d - o) * e)`, else the spec's dequantize, `d * e`."""
    if kind == AFFINE_MIN:
        return float32(mul_rn(d, e) + o)
    if kind == AFFINE_ZERO:
        return float32(float32(d - o) * e)
    return d * e


@cuda.jit(device=True, inline="always")
def zero_code(y, z, qmin, qmax):
    """The zero-point code (affine offsets) of `y = x / e`: `clamp(rint(y) + z, qmin, qmax)` (y
    clamped first to a range that keeps the result, so that the integer conversion is safe)."""
    span = qmax - qmin
    q = int64(round(min(max(y, -span), span))) + int64(z)
    return min(max(q, int64(qmin)), int64(qmax))


@cuda.jit(device=True, inline="always")
def read_offset(payload, sl, P):
    """Slot `sl`'s stored offset as f32 (affine offsets): a MIN word of its dtype, or a ZERO byte
    (int8 when P[M_ODT] says the value is signed, else uint8)."""
    off = P[M_OOFF] + sl * P[M_ONB]
    if P[M_AFFINE] == AFFINE_MIN:
        return word_scale(get_le(payload, off, P[M_ONB]), P[M_ODT])
    b = int64(payload[off])
    if P[M_ODT] != 0 and b >= int64(128):
        b -= int64(256)
    return float32(b)


@cuda.jit(device=True, inline="always")
def affine_slot(raw, sl, n, P, F, explicit, payload):
    """`k_scales` for one slot of a scheme with affine offsets (docs/spec.md); returns the stored scale.

    raw[sl], raw[n + sl] hold (max, min) when calibrating, (stored scale, stored offset) when
    given. Writes the offset word, leaves the raw scale in raw[sl] (code rules) and in raw[n + sl]
    what `k_quant` subtracts: the stored min, the raw min under a code rule, or z."""
    kind = P[M_AFFINE]
    qmin = F[F_QMIN]
    qmax = F[F_QMAX]
    if explicit:
        st = raw[sl]
        o = raw[n + sl]
        keep = o
    else:
        hi = raw[sl]
        lo = raw[n + sl]
        if kind == AFFINE_ZERO:
            lo = min(lo, float32(0.0))
            hi = max(hi, float32(0.0))
        lo = float32(lo + float32(0.0))  # a zero is +0 (affine offsets), as in qcore.spec.arithmetic.affine_params
        hi = float32(hi + float32(0.0))
        s = float32(float32(hi - lo) / F[F_H])
        st = round_scale(s, P[M_SDT])
        raw[sl] = s
        if kind == AFFINE_MIN:
            o = math.copysign(round_scale(abs(lo), P[M_ODT]), lo)
            keep = lo if P[M_CODES] != 0 else o
        else:
            z = float32(0.0)
            if st != float32(0.0):
                z = float32(min(max(qmin - float32(round(float32(lo / st))), qmin), qmax))
            o = z
            keep = z
    if kind == AFFINE_MIN:
        put_le(payload, P[M_OOFF] + sl * P[M_ONB], int64(scale_word(o, P[M_ODT])), P[M_ONB])
    else:
        put_le(payload, P[M_OOFF] + sl, int64(o) & int64(0xFF), int64(1))
    raw[n + sl] = keep
    return st


@cuda.jit(device=True, inline="always")
def rule_rcp(s):
    """The reciprocal `f32(1 / s)` of a raw scale that a code rule multiplies by; 0 where s == 0."""
    if s == float32(0.0):
        return float32(0.0)
    return float32(float32(1.0) / s)

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
    """Code of `a >= 0` (finite) in a sign-less float with `mb` mantissa bits and `bias`: nearest
    value, ties to the even code, subnormals included (the spec's quantize). Exact: frexp/ldexp move
    exponents only, and `round` is round-half-even."""
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
    """The `bits`-wide field of `y = x / e` (the spec's quantize). Integers: clamp then round half to
    even (same as clamp(rint)); minifloats: saturate at ±max, nearest, ties to even, sign of y."""
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
    """Two-level scales: g = max(max_b s_b / M, tiny); max_b(stat_b / h) == (max_b stat_b) / h
    exactly, since correctly rounded division by h > 0 is monotone."""
    return max(float32(float32(gstat / h) / mx), float32(TINY))


FLT_MAX = float(np.finfo(np.float32).max)


@cuda.jit(device=True, inline="always")
def reciprocal_g(gstat, h, mx):
    """docs/spec.md, reciprocal global scale: G = f32(M * h) / max(max_b stat_b, tiny), or 1 where
    that overflows (qcore.spec.arithmetic.reciprocal_global)."""
    big = float32(float32(mx * h) / max(gstat, float32(TINY)))
    if not big <= float32(FLT_MAX):
        return float32(1.0)
    return big


@cuda.jit(device=True, inline="always")
def two_level_e(g, s):
    """The spec's two-level effective scale: `g * s_b` (one f32 multiply). A negative `g` carries a
    reciprocal global `-g = G` (reciprocal global scale; `k_decode_scales` and `k_scales` put it
    there): `s_b / G` (one f32 division)."""
    if g < float32(0.0):
        return float32(s / float32(-g))
    return float32(g * s)


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


def sim_group(cu, v, width, sh, op):
    """Simulator stand-in for a warp-shuffle reduction over aligned groups of `width` lanes,
    through shared memory. `cu` is the caller's `cuda`, which the simulator has swapped for the
    running kernel's fake module (in the kernel's module, and in a device function's while it
    runs)."""
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
    # Device functions under the simulator too: calling one swaps this module's `cuda` for the
    # running kernel's fake module (the kernels that call them live in other modules).
    @cuda.jit(device=True)
    def group_max(v, width, sh):
        """max of v over aligned groups of `width` lanes (simulator: through shared memory)."""
        return sim_group(cuda, v, width, sh, max)

    @cuda.jit(device=True)
    def group_sum(v, width, sh):
        return sim_group(cuda, v, width, sh, lambda p, q: p + q)

    @cuda.jit(device=True)
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
