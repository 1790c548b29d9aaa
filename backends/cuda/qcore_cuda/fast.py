"""Fast kernels for the commonest layout: one code stream along the last axis (docs/spec.md,
arithmetic and portable bytes).

Eligible (`geometry()`): Native, or packing along the last axis; lines a multiple of 16
elements; one scale for the tensor, or one per block of `B` elements along the last axis only
(`B` a power of two dividing the line; calibrated one-level blocks 16 <= B <= 512); the input
16-byte aligned. The tensor is then a flat sequence of runs of 16 elements: run `t` is
elements `[16t, 16t + 16)`, its codes are `16 * bits` consecutive bits of the values section
(the same bytes for PackedU32 and PackedNative), and its scale slot is `16t >> log2(B)`.

One thread owns one run per loop step (the next run's four 16-byte loads are issued before this
run's codes, so they are in flight while it computes): four 16-byte loads, the run's max |x| with the
non-finite check folded in (`fmax_nan`), the block max over the `B / 16` lanes of the block
(warp shuffles), the block scale rounded up with integer operations on its bits, the codes,
and one 16- or 8-byte store of whole u32 words. The kernels are specialised per value kind
(`KINDS`), so the per-element work is a handful of instructions:

* integers: clamp, add 1.5 * 2**23 (round half to even, the code in the low mantissa bits);
* E4M3 / E5M2: the sm_89+ `cvt.rn.satfinite.e4m3x2.f32` conversion (two codes per
  instruction); E2M1: the least of three roundings of |y| (`e2m1_code`);
* the division `y = x / e` of the spec's quantize as `q = x * r`, `q + fma(-q, e, x) * r` with
  `r = 1 / e` rounded once per block: Markstein's correction, the correctly rounded quotient
  whenever e's significand is not all ones and nothing overflows or underflows; the kernels
  check that per block (`fast_div_ok`) and divide with `div.rn` otherwise;
  minifloat codes take the sign from x (the correction turns x = -0 into +0).

Dequantize is coalesced by units of 4 codes (a u32 of int8/FP8 codes, a u16 of 4-bit codes;
a u32 of 16 2-bit codes): lane l of a warp owns units `32j + l` of a chunk of
`32 * dq_units`, one warp per chunk, loads them and their scales first, then decodes
(int8/int4: byte permutes under the exponent of 2**23; FP8: the hardware conversion; E2M1: a
16-entry table in shared memory),
multiplies by the slot's f32 scale and writes each unit's 16 bytes with one store, so a warp's
store instruction covers 512 contiguous bytes. Modes of the quantize kernel (one kernel per value kind; the mode and the scale dtype are
uniform branches):

* `BLOCK`: calibrated one-level blocks: max over the block, then scale, codes (one pass);
* `TWO`: calibrated two-level: `gs[1]` holds the tensor's max |x| (pass 1, `k_amax`);
  `g = max(gmax / h / M, tiny)`, block scale rounded up from `(m_b / h) / g`, `e = g * s_b`;
* `TENSOR`: calibrated per-tensor: `e` rounded up from `gs[1] / h` (pass 1, `k_amax`);
* `GIVEN`: stored scales per slot in `stored` (explicit parameters, absmean); two-level
  `e = gs[0] * s_b`; here the division is `div.rn` (no bound on |x / e|).
"""
from __future__ import annotations

import math
import os
from functools import lru_cache

import numpy as np

from qcore.spec.schemes import QuantScheme, QuantValue, StoreKind

from . import kernels as K
from ._params import Field, ParamLayout
from .intrin import (and_xor, bf16x2_rn, bitsel, e4m3x2, e4m3x2_f32, e5m2x2, e5m2x2_f32, f2u, fmax_nan, ld1, ld4, prmt,
                     prmt_r, st2, st4, u2f)
from .scales import round_scale, scale_word
from .devmath import MAGIC, fast_div_ok, qdiv, two_level_e

from numba import config, cuda, float32, int32, int64, uint32  # noqa: E402

if config.ENABLE_CUDASIM:  # shared-memory stand-in, bound to this module's (swapped) `cuda`
    def group_max(v, width, sh):
        return K.sim_group(cuda, v, width, sh, max)
else:
    from .kernels import group_max

# ----------------------------------------------------------------------------- kinds
KIND_I8, KIND_I4, KIND_I2, KIND_E4M3, KIND_E5M2, KIND_E2M1 = range(6)
KINDS = {
    QuantValue.Q8F: KIND_I8, QuantValue.Q8S: KIND_I8, QuantValue.Q4F: KIND_I4, QuantValue.Q4S: KIND_I4,
    QuantValue.Q2F: KIND_I2, QuantValue.Q2S: KIND_I2, QuantValue.E4M3: KIND_E4M3, QuantValue.E5M2: KIND_E5M2,
    QuantValue.E2M1: KIND_E2M1,
}
KIND_BITS = (8, 4, 2, 8, 8, 4)
MODE_BLOCK, MODE_TWO, MODE_TENSOR, MODE_GIVEN = range(4)
TPB = 256
DQ_UNITS = 8  # load units (`unit_codes`) of 4 codes in flight per thread (dequantize); 4 of 16 codes

G_LAYOUT = ParamLayout("G", "int64", [
    ("G_NRUNS", "runs of 16 elements"),
    ("G_LB", "log2 of the block (62 for one scale: every run's slot is 0)"),
    ("G_LGW", "log2 of the runs per block (B / 16, at least 1)"),
    ("G_MODE", "MODE_BLOCK, MODE_TWO, MODE_TENSOR or MODE_GIVEN"),
    ("G_SDT", "the slot dtype's id under the scheme's rounding rule (`scale_slot`)"),
    ("G_SNB", "bytes per stored scale"),
    ("G_SOFF", "byte offset of the scales section"),
    ("G_GOFF", "byte offset of the global scale"),
    ("G_TWO", "1: two-level"),
    ("G_QMIN", "the smallest valid integer code (dequantize flags codes below it); -2**62 for minifloats"),
], length_name="G_LEN")
"""G: the fast kernels' int64 geometry (`geometry`)."""
G_LAYOUT.define(globals())
C_LAYOUT = ParamLayout("C", "float32", [Field("C" + f.name[1:], f.doc) for f in K.F_LAYOUT.fields
                                         if f.name in ("F_H", "F_M", "F_QMIN", "F_QMAX")], length_name="C_LEN")
"""C: the fast kernels' float32 constants (`geometry`): C_H, C_M, C_QMIN, C_QMAX, as the general
kernels' F_H, F_M, F_QMIN, F_QMAX (layouts.py)."""
C_LAYOUT.define(globals())

MAGIC_HI = np.uint32(0x4B000000)  # the f32 bits of 2**23: a byte below it is an exact integer
FLT_MAX = 3.4028234663852886e38


def _log2(v: int) -> int:
    return int(v).bit_length() - 1


def geometry(shape: tuple[int, ...], scheme: QuantScheme, method: str = "minmax"):
    """(kind, G int64[G_LEN], C float32[C_LEN]) of the fast kernels, or None when not eligible.
    G[G_MODE] is the calibrated mode; the caller switches to MODE_GIVEN for given scales."""
    kind = KINDS.get(scheme.value)
    n = math.prod(shape)
    if kind is None or scheme.is_lookup or n == 0 or len(shape) == 0:
        return None
    store = scheme.store
    if store.kind is not StoreKind.NATIVE and store.dim != 0:
        return None
    L = shape[-1]
    if L % 16:
        return None
    t = scheme.traits
    if scheme.block is not None:
        if len(scheme.block.dims) != 1:
            return None
        B = scheme.block.dims[0]
        if B < 4 or B > 512 or B & (B - 1) or L % B:
            return None
        lb, lgw = _log2(B), _log2(max(B // 16, 1))
        mode = MODE_TWO if scheme.two_level else MODE_BLOCK
        if B < 16 or method != "minmax":
            mode = MODE_GIVEN  # the calibrated modes take block maxima over whole runs
    else:
        lb, lgw = 62, 0  # every run's slot is 0
        mode = MODE_TENSOR if method == "minmax" else MODE_GIVEN
    snb = scheme.slot_dtype.traits.nbytes
    soff = n * t.bits // 8
    nslots = 1 if scheme.block is None else n >> lb
    G = G_LAYOUT.pack(
        G_NRUNS=n // 16, G_LB=lb, G_LGW=lgw, G_MODE=mode, G_TWO=scheme.two_level,
        G_QMIN=int(t.qmin) if not t.is_float else -(1 << 62),  # dequantize flags codes below it (invalid codes)
        G_SDT=scheme.scale_slot,  # the slot dtype under the scheme's rounding rule
        G_SNB=snb, G_SOFF=soff, G_GOFF=soff + nslots * snb)
    C = C_LAYOUT.pack(
        C_H=scheme.scale_divisor,  # h, or 1 under the MX rule
        C_M=scheme.block.dtype.traits.max_value if scheme.two_level else 1.0,  # M of the spec's two-level scales
        C_QMIN=t.qmin, C_QMAX=t.qmax)
    return kind, G, C


def dq_units(kind: int) -> int:
    """Load units in flight per thread in the dequantize kernel: `DQ_UNITS` units of 4 codes, or
    4 of 16 codes (2-bit: 8 would not unroll, its arrays would go to local memory)."""
    return DQ_UNITS if unit_codes(kind) == 4 else 4


def launch_dequant(nruns: int, kind: int) -> tuple[int, int]:
    """(blocks, threads) of the dequantize kernel: a warp per chunk of 32 * `dq_units` units
    (measured faster than fewer warps striding over chunks, `benchmarks/gpu_tune.py`); 2 x 32
    threads striding on the simulator."""
    nch = -(-(nruns * 16 // unit_codes(kind)) // (32 * dq_units(kind)))
    if config.ENABLE_CUDASIM:
        return (max(1, min(2, nch)), 32)
    return (max(1, -(-nch // (TPB // 32))), TPB)


# k_fast_quant's 256-thread blocks per SM, by value kind: the fastest of 2, 3, 4, 6, 8 and 12
# (`benchmarks/gpu_tune.py --only quant`; figures in docs/gpu.md). Four blocks of its 64
# registers fill an SM; E2M1 codes (more arithmetic per element) gain from blocks queued
# behind the resident ones, the other kinds do not.
QUANT_PER_SM = (3, 3, 3, 3, 3, 12)
AMAX_PER_SM = 8  # k_amax blocks per SM (22 registers: all resident at once)


def launch(nruns: int, per_sm: int) -> tuple[int, int]:
    """(blocks, threads) of a grid-stride kernel over `nruns` runs: `per_sm` 256-thread blocks
    per SM on a GPU (`QUANT_PER_SM[kind]` for the quantize kernel, `AMAX_PER_SM` for the max
    pass); 2 x 32 on the simulator."""
    if config.ENABLE_CUDASIM:
        return (max(1, min(2, -(-nruns // 32))), 32)
    return (max(1, min(-(-nruns // TPB), K.sm_count() * per_sm)), TPB)


def aligned(a) -> bool:
    """Whether a device array's data starts on a 16-byte boundary (the vector accesses need it)."""
    if config.ENABLE_CUDASIM:
        return True
    ptr = getattr(a, "ptr", None)  # a DevView's pointer, without its interface dict
    return (ptr if type(ptr) is int else a.__cuda_array_interface__["data"][0]) % 16 == 0


# ----------------------------------------------------------------------------- scale words
@cuda.jit(device=True, inline="always")
def put_word(payload, off, w, nb):
    """Little-endian bytes of a u32 word at payload[off], nb = 1, 2 or 4."""
    payload[off] = w & uint32(0xFF)
    if nb > 1:
        payload[off + int64(1)] = (w >> uint32(8)) & uint32(0xFF)
    if nb > 2:
        payload[off + int64(2)] = (w >> uint32(16)) & uint32(0xFF)
        payload[off + int64(3)] = (w >> uint32(24)) & uint32(0xFF)


@cuda.jit(device=True, inline="always")
def e2m1_code(y):
    """E2M1 code of y (the spec's quantize): saturate at 6, nearest, ties to the even code, sign of y.

    The E2M1 values of a = min(|y|, 6) are q / 2 (code q) on [0, 2], q (code q + 2) on [2, 4]
    and 2q (code q + 4) on [4, 6]. Adding 1.5 * 2**23 (plus 0, 2 or 4) rounds each
    form's q half-to-even into the low mantissa bits: 2a, a + 2 and a / 2 + 4 (one fma, an
    add, one fma, the additions exact but for that rounding). On each range its own form is the
    least of the three (2a <= a + 2 iff a <= 2, a + 2 <= a / 2 + 4 iff a <= 4), and an even offset
    keeps ties on even codes; so the code is the low 3 bits of the minimum, and the sign bit
    comes from y with one bit select."""
    a = min(abs(y), float32(6.0))
    t = min(min(cuda.fma(a, float32(2.0), float32(MAGIC)), a + float32(MAGIC + 2.0)),
            cuda.fma(a, float32(0.5), float32(MAGIC + 4.0)))
    return bitsel(uint32(0x7), f2u(t), f2u(y) >> uint32(28))


@cuda.jit(device=True, inline="always")
def load_run(x, t, v):
    """The 16 elements of run t of x into v: four 16-byte loads."""
    for j in range(4):
        a0, a1, a2, a3 = ld4(x, (t << int64(4)) + int64(4 * j))
        v[4 * j] = a0
        v[4 * j + 1] = a1
        v[4 * j + 2] = a2
        v[4 * j + 3] = a3


# ----------------------------------------------------------------------------- kernels
def _quant_kernel(kind: int):
    """The quantize kernel of one value kind (module docstring); kind is a compile-time constant."""
    bits = KIND_BITS[kind]
    nw = bits // 2  # u32 words per run of 16 codes
    per_word = 32 // bits
    is_int = kind <= KIND_I2
    mask = np.uint32((1 << bits) - 1)
    k_e4m3, k_e5m2 = kind == KIND_E4M3, kind == KIND_E5M2

    def k_fast_quant(x, w32, payload, stored, gs, flag, G, C):
        sh = cuda.shared.array(TPB, float32)  # the simulator's stand-in for shuffles
        v = cuda.local.array(16, float32)
        y = cuda.local.array(16, float32)
        wd = cuda.local.array(4, uint32)
        nruns = G[G_NRUNS]
        lb = G[G_LB]
        lgw = G[G_LGW]
        mode = G[G_MODE]
        sdt = G[G_SDT]
        snb = G[G_SNB]
        soff = G[G_SOFF]
        two = G[G_TWO] != int64(0)
        h = C[C_H]
        qmin = C[C_QMIN]
        qmax = C[C_QMAX]
        gw = int64(1) << lgw
        g = gs[0]
        et = float32(0.0)
        if mode == MODE_TWO:
            g = max(float32(float32(gs[1] / h) / C[C_M]), float32(K.TINY))
        elif mode == MODE_TENSOR:
            et = round_scale(float32(gs[1] / h), sdt)
        start = int64(cuda.blockIdx.x) * int64(cuda.blockDim.x) + int64(cuda.threadIdx.x)
        stride = int64(cuda.gridDim.x) * int64(cuda.blockDim.x)
        if start == int64(0):  # the tensor-level words
            if mode == MODE_TWO:
                put_word(payload, G[G_GOFF], f2u(g), int64(4))
            elif mode == MODE_TENSOR:
                put_word(payload, soff, scale_word(et, sdt), snb)
        end = (nruns + int64(31)) & ~int64(31)  # whole warps iterate together (shuffles)
        bad = False
        nv = cuda.local.array(16, float32)  # the next run's x, loaded before this run's codes
        if start < nruns:
            load_run(x, start, nv)
        for t in range(start, end, stride):
            valid = t < nruns
            base = t << int64(4)
            m = float32(0.0)
            for k in range(16):
                v[k] = nv[k] if valid else float32(0.0)
            tn = t + stride
            if tn < nruns:
                load_run(x, tn, nv)
            if valid:
                for j in range(4):
                    m = fmax_nan(m, fmax_nan(fmax_nan(abs(v[4 * j]), abs(v[4 * j + 1])),
                                             fmax_nan(abs(v[4 * j + 2]), abs(v[4 * j + 3]))))
            if not m <= float32(FLT_MAX):  # NaN or Inf: flagged (the call raises InputError)
                bad = True
                m = float32(0.0)
            e = et
            if mode == MODE_BLOCK or mode == MODE_TWO:
                m = group_max(m, gw, sh)
                s = float32(m / h)
                if mode == MODE_TWO:
                    s = float32(s / g)
                sb = round_scale(s, sdt)
                e = sb
                if mode == MODE_TWO:
                    e = two_level_e(g, sb)
                if valid and (t & (gw - int64(1))) == int64(0):
                    put_word(payload, soff + (t >> lgw) * snb, scale_word(sb, sdt), snb)
            if mode == MODE_GIVEN:
                if lb >= int64(4):
                    e = float32(0.0)
                    if valid:
                        e = ld1(stored, base >> lb)
                        if two:
                            e = two_level_e(g, e)
                    for k in range(16):
                        y[k] = float32(0.0)
                        if e != float32(0.0):
                            y[k] = float32(v[k] / e)
                else:  # blocks shorter than a run: a scale per element
                    for k in range(16):
                        ek = float32(0.0)
                        if valid:
                            ek = stored[(base + int64(k)) >> lb]
                            if two:
                                ek = two_level_e(g, ek)
                        y[k] = float32(0.0)
                        if ek != float32(0.0):
                            y[k] = float32(v[k] / ek)
            elif fast_div_ok(e):
                r = float32(float32(1.0) / e)
                for k in range(16):
                    y[k] = qdiv(v[k], e, r)
                    if not is_int:  # the sign of a zero quotient is x's (the fma sum of -0 and +0 is +0)
                        y[k] = float32(math.copysign(y[k], v[k]))
            else:
                for k in range(16):
                    y[k] = float32(0.0)
                    if e != float32(0.0):
                        y[k] = float32(v[k] / e)
            # codes -> whole u32 words
            if is_int:
                for j in range(nw):
                    w = uint32(0)
                    for i in range(per_word):
                        c = f2u(min(max(y[j * per_word + i], qmin), qmax) + float32(MAGIC)) & mask
                        w |= c << uint32(i * bits)
                    wd[j] = w
            elif k_e4m3:
                for j in range(4):
                    wd[j] = e4m3x2(y[4 * j + 1], y[4 * j]) | (e4m3x2(y[4 * j + 3], y[4 * j + 2]) << uint32(16))
            elif k_e5m2:
                for j in range(4):
                    wd[j] = e5m2x2(y[4 * j + 1], y[4 * j]) | (e5m2x2(y[4 * j + 3], y[4 * j + 2]) << uint32(16))
            else:  # E2M1
                for j in range(2):
                    w = uint32(0)
                    for i in range(8):
                        w |= e2m1_code(y[8 * j + i]) << uint32(4 * i)
                    wd[j] = w
            if valid:
                if nw == 4:
                    st4(w32, t << int64(2), wd[0], wd[1], wd[2], wd[3])
                elif nw == 2:
                    st2(w32, t << int64(1), wd[0], wd[1])
                else:
                    w32[t] = wd[0]
        if bad:
            flag[0] = int32(1)

    return k_fast_quant


E2M1_POS = tuple(np.uint32(int.from_bytes(bytes(64 + int(2 * v) for v in half), "little"))
                 for half in ((0.0, 0.5, 1.0, 1.5), (2.0, 3.0, 4.0, 6.0)))
"""E2M1 codes 0-7 as bytes 64 + 2 v (two words, an 8-entry `prmt_r` table)."""
E2M1_NEG = tuple(np.uint32(int.from_bytes(bytes(64 - int(2 * v) for v in half), "little"))
                 for half in ((0.0, 0.5, 1.0, 1.5), (2.0, 3.0, 4.0, 6.0)))
"""E2M1 codes 8-15 (the same magnitudes, negative) as bytes 64 + 2 v."""
MAGIC_22 = np.uint32(0x4A800000)  # the f32 bits of 2**22: a byte o below it reads 2**22 + o / 2
E2M1_BIAS = np.float32(4194304.0 + 32.0)  # 2**22 + 64 / 2


def decoder(kind: int, signed_zero: bool = True):
    """Device function decode(w, tab, val, off): the `32 / bits` fields of u32 word `w` as
    float32 into val[off:]; integers by sign-flip + exponent magic (exact), FP8 by the hardware
    conversion, E2M1 from the 16-entry table `tab` (shared memory), or where the sign of a zero
    does not matter (`signed_zero` False: values only summed into sums that start at +0) by two
    byte-table permutes for every four codes under 2**22 (E2M1 code 8 then reads +0; no shared memory)."""
    bits = KIND_BITS[kind]
    per_word = 32 // bits
    is_int = kind <= KIND_I2
    mask = np.uint32((1 << bits) - 1)
    sign = np.uint32(sum(1 << (bits - 1 + bits * i) for i in range(per_word)))  # sign bit of every field
    bias = np.float32(8388608.0 + 2.0 ** (bits - 1))  # 2**23 + 2**(bits-1)
    k_e4m3, k_e5m2 = kind == KIND_E4M3, kind == KIND_E5M2
    p0, p1, n0, n1 = E2M1_POS + E2M1_NEG

    @cuda.jit(device=True, inline="always")
    def e2m1_bytes(w):
        """Bytes 64 + 2 v of the four E2M1 codes in bits 0-15 of w: codes 0-7 from the positive
        table (a negative code's selector has its top bit set: 0, as no table byte has its top
        bit), codes 8-15 from the negative one (the top bits flipped)."""
        return prmt_r(p0, p1, w) | prmt_r(n0, n1, w ^ uint32(0x8888))

    @cuda.jit(device=True, inline="always")
    def bytes_under(x, magic, less, val, off, step):
        """The four bytes of x, each under the f32 exponent bits of `magic` (an exact value), less
        `less`, into val[off], val[off + step], val[off + 2 step], val[off + 3 step]."""
        val[off] = u2f(prmt(x, magic, 0x7650)) - less
        val[off + step] = u2f(prmt(x, magic, 0x7651)) - less
        val[off + 2 * step] = u2f(prmt(x, magic, 0x7652)) - less
        val[off + 3 * step] = u2f(prmt(x, magic, 0x7653)) - less

    @cuda.jit(device=True, inline="always")
    def decode(w, tab, val, off):
        if is_int and bits == 8:  # byte k under the exponent 0x4B: one byte permute per field
            bytes_under(w ^ sign, MAGIC_HI, bias, val, off, 1)
        elif is_int and bits == 4:  # even fields are the low nibbles of the bytes, odd the high
            lo = and_xor(w, uint32(0x0F0F0F0F), uint32(0x08080808))  # (w ^ sign) & 0x0F0F0F0F
            hi = and_xor(w >> uint32(4), uint32(0x0F0F0F0F), uint32(0x08080808))
            bytes_under(lo, MAGIC_HI, bias, val, off, 2)
            bytes_under(hi, MAGIC_HI, bias, val, off + 1, 2)
        elif is_int:
            w = w ^ sign
            for i in range(per_word):
                val[off + i] = u2f(((w >> uint32(i * bits)) & mask) | uint32(0x4B000000)) - bias
        elif k_e4m3:
            val[off], val[off + 1] = e4m3x2_f32(w)
            val[off + 2], val[off + 3] = e4m3x2_f32(w >> uint32(16))
        elif k_e5m2:
            val[off], val[off + 1] = e5m2x2_f32(w)
            val[off + 2], val[off + 3] = e5m2x2_f32(w >> uint32(16))
        elif not signed_zero:  # E2M1, bytes 64 + 2 v under 2**22 (half steps): exact
            bytes_under(e2m1_bytes(w), MAGIC_22, E2M1_BIAS, val, off, 1)
            bytes_under(e2m1_bytes(w >> uint32(16)), MAGIC_22, E2M1_BIAS, val, off + 4, 1)
        else:
            for i in range(8):
                val[off + i] = tab[(w >> uint32(4 * i)) & uint32(0xF)]

    return decode


def unit_codes(kind: int) -> int:
    """Codes per load unit of the dequantize kernel: 4 for 8- and 4-bit codes (a u32 or a u16,
    so one lane's output is one 16-byte store), 16 for 2-bit codes (a u32)."""
    return 16 if KIND_BITS[kind] == 2 else 4


def unit_dtype(kind: int) -> type:
    """The dequantize kernel's load unit: u16 for 4-bit codes, else u32 (`unit_codes`)."""
    return np.uint16 if KIND_BITS[kind] == 4 else np.uint32


def unit_view(values, kind: int):
    """The values section of a payload (uint8 device array) as the dequantize kernel's units."""
    return values.view(unit_dtype(kind))


def _dequant_kernel(kind: int, R: int | None = None, preload: bool = True, bf16: bool = False):
    """Dequantize, coalesced by units of `unit_codes(kind)` codes (`unit_view`): lane l of a
    warp owns units `c*32R + 32j + l` (j < R) of chunk c, so each 16-byte store instruction
    writes 512 contiguous bytes; R units and their scales are loaded before any is used (the
    compiler cannot move a scale load above a store to `out`: they may alias, so a load in the
    store loop waits a memory latency per unit whose scale is in a new line; `preload=False`
    is that order, kept for `benchmarks/gpu_tune.py`).

    `bf16`: `out` is the result's bfloat16 bits as u32 pairs (element 2i in the low half of
    word i), each f32 value `decode(q) * e` rounded once to nearest even (`cvt.rn.bf16x2.f32`);
    a unit of 4 codes is one 8-byte store."""
    upc = unit_codes(kind)
    R = R or dq_units(kind)
    lupc = _log2(upc)
    decode = decoder(kind)
    use_tab = kind == KIND_E2M1

    def k_fast_dequant(units, scales, gbuf, lut, out, G, flag):
        tab = cuda.shared.array(16, float32)
        wv = cuda.local.array(R, uint32)
        ev = cuda.local.array(R, float32)
        val = cuda.local.array(16, float32)
        if use_tab:
            if cuda.threadIdx.x < 16:
                tab[cuda.threadIdx.x] = lut[cuda.threadIdx.x]
            cuda.syncthreads()
        nut = G[G_NRUNS] * int64(16 // upc)  # units in the tensor
        lb = G[G_LB]
        two = G[G_TWO] != int64(0)
        qlo = float32(G[G_QMIN])
        bad = False
        g = gbuf[0]
        gt = int64(cuda.blockIdx.x) * int64(cuda.blockDim.x) + int64(cuda.threadIdx.x)
        lane = gt & int64(31)
        nwarps = (int64(cuda.gridDim.x) * int64(cuda.blockDim.x)) >> int64(5)
        nch = (nut + int64(32 * R - 1)) // int64(32 * R)
        for ch in range(gt >> int64(5), nch, nwarps):
            u0 = ch * int64(32 * R) + lane
            for j in range(R):  # the units and their scales (one per unit when lb >= lupc), before any store
                u = u0 + int64(32 * j)
                wv[j] = uint32(0)
                ev[j] = float32(0.0)
                if u < nut:
                    wv[j] = uint32(ld1(units, u))
                    if preload and lb >= int64(lupc):
                        ev[j] = ld1(scales, (u << int64(lupc)) >> lb)
            for j in range(R):
                u = u0 + int64(32 * j)
                if u < nut:
                    decode(wv[j], tab, val, 0)
                    for i in range(upc):  # invalid codes: below qmin, or a NaN/Inf minifloat code
                        if val[i] < qlo or not math.isfinite(val[i]):
                            bad = True
                    base = u << int64(lupc)
                    if lb >= int64(lupc):
                        e = ev[j] if preload else ld1(scales, base >> lb)
                        if two:
                            e = two_level_e(g, e)
                        for i in range(upc):
                            val[i] = val[i] * e
                    else:
                        for i in range(upc):
                            ek = ld1(scales, (base + int64(i)) >> lb)
                            if two:
                                ek = two_level_e(g, ek)
                            val[i] = val[i] * ek
                    if bf16:
                        for i in range(upc // 4):
                            st2(out, (base >> int64(1)) + int64(2 * i), bf16x2_rn(val[4 * i + 1], val[4 * i]),
                                bf16x2_rn(val[4 * i + 3], val[4 * i + 2]))
                    else:
                        for i in range(upc // 4):
                            st4(out, base + int64(4 * i), val[4 * i], val[4 * i + 1], val[4 * i + 2], val[4 * i + 3])
        if bad:
            flag[0] = int32(1)

    return k_fast_dequant


AMAX_UNROLL = 4  # vector loads per thread per step of k_amax


def k_amax_py(x, gs, flag, nruns):
    """Pass 1 of the TWO and TENSOR modes: gs[1] = max |x| over the tensor, flag on NaN/Inf."""
    shm = cuda.shared.array(1, float32)
    if cuda.threadIdx.x == 0:
        shm[0] = float32(0.0)
    cuda.syncthreads()
    m = float32(0.0)
    # x as 16-byte vectors, a warp's loads of one step adjacent (512 contiguous bytes), each
    # thread with AMAX_UNROLL loads in flight
    nvec = nruns * int64(4)
    stride = int64(cuda.gridDim.x) * int64(cuda.blockDim.x)
    t = int64(cuda.blockIdx.x) * int64(cuda.blockDim.x) + int64(cuda.threadIdx.x)
    while t < nvec:
        for j in range(AMAX_UNROLL):
            i = t + int64(j) * stride
            if i < nvec:
                a0, a1, a2, a3 = ld4(x, i << int64(2))
                m = fmax_nan(m, fmax_nan(fmax_nan(abs(a0), abs(a1)), fmax_nan(abs(a2), abs(a3))))
        t += stride * int64(AMAX_UNROLL)
    if not m <= float32(FLT_MAX):
        flag[0] = int32(1)
        m = float32(0.0)
    cuda.atomic.max(shm, 0, m)
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        cuda.atomic.max(gs, 1, shm[0])


code_int8 = K.code_int8  # (the int8 code rule's one home: kernels.code_int8)


@cuda.jit(device=True, inline="always")
def code_in_hardware(y, P):
    """`kernels.code_by_encode` with the sm_89 conversions: E4M3 / E5M2 by `cvt.rn.satfinite`
    (saturating at the largest value, as the spec's quantize wants, the sign of a zero kept)."""
    if not P[0]:
        return code_int8(y, P)
    if P[1]:
        return e4m3x2(float32(0.0), y) & uint32(0xFF)
    return e5m2x2(float32(0.0), y) & uint32(0xFF)


@cuda.jit(device=True, inline="always")
def pair_int8(hi, lo, P):
    """Two int8 codes (lo's in the low byte) as `code_in_hardware` writes them."""
    return code_int8(lo, P) | (code_int8(hi, P) << uint32(8))


@cuda.jit(device=True, inline="always")
def pair_e4m3(hi, lo, P):
    """Two E4M3 codes (lo's in the low byte): one `cvt.rn.satfinite.e4m3x2.f32`."""
    return e4m3x2(hi, lo)


@cuda.jit(device=True, inline="always")
def pair_e5m2(hi, lo, P):
    """Two E5M2 codes (lo's in the low byte): one `cvt.rn.satfinite.e5m2x2.f32`."""
    return e5m2x2(hi, lo)


k_wide_quant_py = K.make_wide_quant(code_in_hardware)
WIDE_HELD_ENV = "QCORE_CUDA_WIDE_HELD"
"""An integer in the environment replaces `WIDE_HELD` (0: the 16-byte wide kernel reads x twice, as
the max and then the codes; tuning runs); read at import."""
WIDE_HELD = int(os.environ.get(WIDE_HELD_ENV, "8"))
"""16-byte quads of x a thread of the 16-byte wide kernel holds in registers (`K.make_wide_quant`'s
`held`; `K.launch_held` sizes its blocks)."""


def wide_quads_py(only: int):
    """The 16-byte wide kernel's Python function (`K.make_wide_quant` with the pair coders and
    `WIDE_HELD`) for value kind `only` (`K.wide_kind`) alone: the other kinds' loops are not
    compiled, a smaller kernel (ptxas for sm_90, E4M3: 4632 SASS instructions against 7432 for
    one kernel of the three kinds; docs/gpu.md, W8A8, has the timings)."""
    return K.make_wide_quant(code_in_hardware, pairs=(pair_int8, pair_e4m3, pair_e5m2), held=WIDE_HELD, only=only)


JIT_REGS = 64  # register cap of the fast kernels
_jit = K.jit_regs(JIT_REGS)
WIDE_REGS_ENV = "QCORE_CUDA_WIDE_REGS"
"""An integer in the environment replaces `WIDE_REGS` (tuning runs); read at import."""
WIDE_REGS = int(os.environ.get(WIDE_REGS_ENV, str(JIT_REGS)))
"""Register cap of the 16-byte wide kernels (`K.launch_held` fits its blocks a SM to it)."""
_wide_jit = K.jit_regs(WIDE_REGS)
k_amax = _jit(k_amax_py)
k_wide_quant = _jit(k_wide_quant_py)


@lru_cache(maxsize=None)
def wide_quads_kernel(only: int):
    """The 16-byte wide kernel for value kind `only` (`K.wide_kind`): x and the payload on 16-byte
    boundaries, which the caller checks."""
    return _wide_jit(wide_quads_py(only))


@lru_cache(maxsize=None)
def quant_kernel(kind: int):
    return _jit(_quant_kernel(kind))


@lru_cache(maxsize=None)
def dequant_kernel(kind: int, bf16: bool = False):
    """The dequantize kernel of value kind `kind`, writing float32 or (`bf16`) bfloat16 bits."""
    return _jit(_dequant_kernel(kind, bf16=bf16))


QUANT_SIG = (f"void(float32[::1], uint32[::1], uint8[::1], float32[::1], float32[::1], int32[::1], {G_LAYOUT.arg}, "
             f"{C_LAYOUT.arg})")
DEQUANT_SIG = f"void({{}}[::1], float32[::1], float32[::1], float32[::1], {{}}[::1], {G_LAYOUT.arg}, int32[::1])"
AMAX_SIG = "void(float32[::1], float32[::1], int32[::1], int64)"
WIDE_SIG = K.SIGNATURES["k_wide_quant"][0]  # (kernels.k_wide_quant's arguments)


def ptx_targets():
    """(name, python function, signature, register cap) of every fast kernel (`ptx.targets`)."""
    out = [("k_amax", k_amax_py, AMAX_SIG, JIT_REGS), ("k_wide_quant_fast", k_wide_quant_py, WIDE_SIG, JIT_REGS),
           *((f"k_wide_quant_quads_fast[{name}]", wide_quads_py(only), WIDE_SIG, WIDE_REGS)
             for only, name in enumerate(("int8", "e4m3", "e5m2")))]
    for kind in range(len(KIND_BITS)):
        out.append((f"k_fast_quant[{kind}]", _quant_kernel(kind), QUANT_SIG, JIT_REGS))
        out.append((f"k_fast_dequant[{kind}]", _dequant_kernel(kind),
                    DEQUANT_SIG.format(unit_dtype(kind).__name__, "float32"), JIT_REGS))
        out.append((f"k_fast_dequant[{kind},bf16]", _dequant_kernel(kind, bf16=True),
                    DEQUANT_SIG.format(unit_dtype(kind).__name__, "uint32"), JIT_REGS))
    return out
