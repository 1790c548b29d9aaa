"""Quad kernels: the fast path for the commonest layout (SPEC §2, §3).

Eligible (`geometry()`): codes packed along the last axis (or Native), lines of whole u32 words
of codes (`L % (32 / bits) == 0`), and either one scale for the tensor or one per block of
`B` elements along the last axis only, with `B` a power of two from 4 to 128 dividing `L`.
Then the tensor is a flat run of blocks: block `k` is elements `[k*B, (k+1)*B)`, scale slot `k`,
and its codes are one contiguous bit stream, the same bytes for PackedU32 and PackedNative.

A thread owns a *quad* of 4 consecutive elements: four coalesced f32 loads, and `4 * bits` bits
of codes. The `B / 4` lanes of a block take its max with warp shuffles (`group_max`) and round
its scale up redundantly; the `32 / (4 * bits)` lanes of a u32 word OR their bits together
(`group_or`) and the first stores the word. All index arithmetic on lane groups is shifts and
masks (every group size is a power of two): no 64-bit division in the loop. On the simulator
the group operations go through shared memory (kernels.py).
"""
from __future__ import annotations

import math

import numpy as np

from qcore.scheme import QuantScheme, StoreKind

from . import kernels as K
from .kernels import encode, put_le, round_up, scale_code

from numba import config, cuda, float32, int32, int64, uint32  # noqa: E402

if config.ENABLE_CUDASIM:  # shared-memory stand-ins, bound to this module's (swapped) `cuda`
    def group_max(v, width, sh):
        return K.sim_group(cuda, v, width, sh, max)

    def group_or(v, width, sh):
        return K.sim_group(cuda, v, width, sh, lambda p, q: p | q)
else:
    from .kernels import group_max, group_or

# QP layout (int64)
(Q_NQ, Q_LB, Q_LGW, Q_LLPW, Q_BITS, Q_MODE, Q_SDT, Q_SNB, Q_SOFF, Q_ISF, Q_MB, Q_BIAS, Q_TWO,
 Q_PERT) = range(14)
QP_LEN = 16
QUAD_GIVEN, QUAD_FUSED = 0, 1
QUAD_TPB = 256


def _log2(v: int) -> int:
    return int(v).bit_length() - 1


def geometry(shape: tuple[int, ...], scheme: QuantScheme, method: str = "minmax") -> np.ndarray | None:
    """The QP array of the quad kernels for `shape` + `scheme`, or None when not eligible."""
    t = scheme.traits
    n = math.prod(shape)
    if n == 0 or scheme.is_lookup:
        return None
    store = scheme.store
    if store.kind is not StoreKind.NATIVE and store.dim != 0:
        return None
    L = shape[-1]
    if L % (32 // t.bits):  # every line is whole u32 words of codes: one contiguous bit stream
        return None
    QP = np.zeros(QP_LEN, dtype=np.int64)
    if scheme.block is not None:
        if len(scheme.block.dims) != 1:
            return None
        B = scheme.block.dims[0]
        if B < 4 or B > 128 or B & (B - 1) or L % B:
            return None
        if method != "minmax" and not scheme.two_level:
            return None  # the fused mode takes block maxima only
        QP[Q_LB] = _log2(B)
        QP[Q_LGW] = _log2(B // 4)
    else:
        QP[Q_PERT] = 1
    from ._plan import SDT_IDS

    QP[Q_NQ] = n // 4
    QP[Q_LLPW] = _log2(32 // (4 * t.bits))
    QP[Q_BITS] = t.bits
    QP[Q_MODE] = QUAD_GIVEN
    QP[Q_SDT] = SDT_IDS.index(scheme.slot_dtype.value)
    QP[Q_SNB] = scheme.slot_dtype.traits.nbytes
    QP[Q_SOFF] = n * t.bits // 8
    QP[Q_ISF] = t.is_float
    QP[Q_MB] = t.man_bits
    QP[Q_BIAS] = t.bias
    QP[Q_TWO] = scheme.two_level
    return QP


def launch(nq: int) -> tuple[int, int]:
    """(blocks, threads): a few waves on a GPU; two 32-thread blocks on the simulator."""
    if config.ENABLE_CUDASIM:
        return (max(1, min(2, -(-nq // 32))), 32)
    return (max(1, min(-(-nq // QUAD_TPB), 132 * 8)), QUAD_TPB)


@cuda.jit(device=True, inline="always")
def _field(v, e, isf, qmin, qmax, fmax, mb, bias, bits):
    """The code field of one element: y = v / e (true f32 division), or 0 when e == 0."""
    y = float32(0.0)
    if e != float32(0.0):
        y = v / e
    return encode(y, isf, qmin, qmax, fmax, mb, bias, bits)


@K._jit_regs(64)
def k_quad_quant(x, QP, F, stored, gbuf, w32, payload, flag):
    """Quantize quads: FUSED (block max by lane groups, scale rounded up and written by the
    block's first lane, codes: one pass) or GIVEN (stored scales; per-tensor slot 0; two-level
    `e = g * s_b`). Codes of a u32 word's lanes OR together; its first lane stores it."""
    sh_f = cuda.shared.array(QUAD_TPB, float32)
    sh_i = cuda.shared.array(QUAD_TPB, int64)
    nq = QP[Q_NQ]
    lb = QP[Q_LB]
    lgw = QP[Q_LGW]
    llpw = QP[Q_LLPW]
    bits = QP[Q_BITS]
    fused = QP[Q_MODE] == QUAD_FUSED
    sdt = QP[Q_SDT]
    snb = QP[Q_SNB]
    soff = QP[Q_SOFF]
    isf = QP[Q_ISF] != 0
    mb = QP[Q_MB]
    bias = QP[Q_BIAS]
    two = QP[Q_TWO] != 0
    pert = QP[Q_PERT] != 0
    gw = int64(1) << lgw
    lpw = int64(1) << llpw
    qbits = bits * int64(4)
    h = F[K.F_H]
    qmin = F[K.F_QMIN]
    qmax = F[K.F_QMAX]
    fmax = F[K.F_FMAX]
    g = gbuf[0]
    start = int64(cuda.blockIdx.x) * int64(cuda.blockDim.x) + int64(cuda.threadIdx.x)
    stride = int64(cuda.gridDim.x) * int64(cuda.blockDim.x)
    end = (nq + int64(31)) & ~int64(31)  # whole warps iterate together (shuffles need all lanes)
    bad = False
    for q in range(start, end, stride):
        valid = q < nq
        v0 = float32(0.0)
        v1 = float32(0.0)
        v2 = float32(0.0)
        v3 = float32(0.0)
        if valid:
            i = q << int64(2)
            v0 = x[i]
            v1 = x[i + int64(1)]
            v2 = x[i + int64(2)]
            v3 = x[i + int64(3)]
            if not (math.isfinite(v0) and math.isfinite(v1) and math.isfinite(v2) and math.isfinite(v3)):
                bad = True  # flagged; zeros keep the rest of the kernel finite
                if not math.isfinite(v0):
                    v0 = float32(0.0)
                if not math.isfinite(v1):
                    v1 = float32(0.0)
                if not math.isfinite(v2):
                    v2 = float32(0.0)
                if not math.isfinite(v3):
                    v3 = float32(0.0)
        if fused:
            m = max(max(abs(v0), abs(v1)), max(abs(v2), abs(v3)))
            m = group_max(m, gw, sh_f)
            e = round_up(float32(m / h), sdt)
            if valid and (q & (gw - int64(1))) == int64(0):
                put_le(payload, soff + (q >> lgw) * snb, scale_code(e, sdt), snb)
        else:
            e = float32(0.0)
            if valid:
                if pert:
                    e = stored[0]
                else:
                    e = stored[(q << int64(2)) >> lb]
                if two:
                    e = g * e
        f = _field(v0, e, isf, qmin, qmax, fmax, mb, bias, bits)
        f |= _field(v1, e, isf, qmin, qmax, fmax, mb, bias, bits) << bits
        f |= _field(v2, e, isf, qmin, qmax, fmax, mb, bias, bits) << (bits * int64(2))
        f |= _field(v3, e, isf, qmin, qmax, fmax, mb, bias, bits) << (bits * int64(3))
        if not valid:
            f = int64(0)
        word = group_or(f << ((q & (lpw - int64(1))) * qbits), lpw, sh_i)
        if valid and (q & (lpw - int64(1))) == int64(0):
            w32[q >> llpw] = uint32(word)
    if bad:
        flag[0] = int32(1)


@K._jit_regs(40)
def k_quad_dequant(w32, QP, lut, scales, gbuf, out):
    """out[4q + k] = decode(field k of quad q) * e (SPEC §2.6); `scales` decoded, f32."""
    nq = QP[Q_NQ]
    lb = QP[Q_LB]
    llpw = QP[Q_LLPW]
    bits = QP[Q_BITS]
    two = QP[Q_TWO] != 0
    pert = QP[Q_PERT] != 0
    lpw = int64(1) << llpw
    qbits = bits * int64(4)
    mask = (int64(1) << bits) - int64(1)
    g = gbuf[0]
    start = int64(cuda.blockIdx.x) * int64(cuda.blockDim.x) + int64(cuda.threadIdx.x)
    stride = int64(cuda.gridDim.x) * int64(cuda.blockDim.x)
    for q in range(start, nq, stride):
        part = int64(w32[q >> llpw]) >> ((q & (lpw - int64(1))) * qbits)
        if pert:
            e = scales[0]
        else:
            e = scales[(q << int64(2)) >> lb]
        if two:
            e = g * e
        i = q << int64(2)
        out[i] = lut[part & mask] * e
        out[i + int64(1)] = lut[(part >> bits) & mask] * e
        out[i + int64(2)] = lut[(part >> (bits * int64(2))) & mask] * e
        out[i + int64(3)] = lut[(part >> (bits * int64(3))) & mask] * e


SIGNATURES: dict[str, list[str]] = {
    "k_quad_quant": ["void(float32[::1], int64[::1], float32[::1], float32[::1], float32[::1], uint32[::1], "
                     "uint8[::1], int32[::1])"],
    "k_quad_dequant": [f"void(uint32[::1], int64[::1], float32[::1], float32[::1], float32[::1], {t}[::1])"
                       for t in ("float32", "float16", "float64")],
}
