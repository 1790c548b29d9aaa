"""Run-of-16 kernel: the fast quantize path for the commonest layout (SPEC §2, §3).

Eligible (`geometry()`): codes packed along the last axis (or Native), lines a multiple of 16
elements, and either one scale for the tensor or one per block of `B` elements along the last
axis only, `B` a power of two dividing the line (calibrated one-level blocks: 16 <= B <= 512;
given scales, two-level: B >= 4). Then the tensor is a flat sequence of blocks: block `k` is
elements `[k*B, (k+1)*B)`, scale slot `k`, and the codes are one contiguous bit stream, the same
bytes for PackedU32 and PackedNative.

A thread owns 16 consecutive elements: their max, then over the `B / 16` lanes of the block with
warp shuffles (`group_max`; a shared-memory stand-in on the simulator), the block's scale
rounded up (redundantly in each lane, the first writes it), and `16 * bits` bits of codes,
stored as `bits / 2` whole u32 words. Index arithmetic is shifts and masks: every group size is
a power of two, so there is no 64-bit division in the loop.
"""
from __future__ import annotations

import math

import numpy as np

from qcore.scheme import QuantScheme, StoreKind

from . import kernels as K
from .kernels import encode, put_le, round_up, scale_code

from numba import config, cuda, float32, int32, int64, uint32  # noqa: E402

if config.ENABLE_CUDASIM:  # shared-memory stand-in, bound to this module's (swapped) `cuda`
    def group_max(v, width, sh):
        return K.sim_group(cuda, v, width, sh, max)
else:
    from .kernels import group_max

# QP layout (int64)
(Q_NQ, Q_LB, Q_LGW, _Q_UNUSED, Q_BITS, Q_MODE, Q_SDT, Q_SNB, Q_SOFF, Q_ISF, Q_MB, Q_BIAS, Q_TWO,
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
    if L % 16:  # lines of whole 16-element runs, hence whole u32 words of codes (16 * bits / 32)
        return None
    QP = np.zeros(QP_LEN, dtype=np.int64)
    if scheme.block is not None:
        if len(scheme.block.dims) != 1:
            return None
        B = scheme.block.dims[0]
        if B < 4 or B > 512 or B & (B - 1) or L % B:
            return None
        if not scheme.two_level and (method != "minmax" or B < 16):
            return None  # the fused mode takes block maxima, over whole threads' runs
        QP[Q_LB] = _log2(B)
        QP[Q_LGW] = _log2(max(B // 16, 1))
    else:
        QP[Q_PERT] = 1
    from ._plan import SDT_IDS

    QP[Q_NQ] = n // 16  # threads' runs of 16 elements
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


@K._jit_regs(64)
def k_quad_quant(x, QP, F, stored, gbuf, w32, payload, flag):
    """Quantize 16 consecutive elements per thread: FUSED (block max over the thread's values,
    then over the `B / 16` lanes of the block by shuffles; the scale rounded up and written by
    the block's first lane; codes: one pass) or GIVEN (stored scales per element's slot;
    per-tensor slot 0; two-level `e = g * s_b`). The 16 codes (`16 * bits` bits) accumulate in
    two 64-bit registers and leave as `bits / 2` whole u32 words: no lane exchange for codes."""
    sh_f = cuda.shared.array(QUAD_TPB, float32)
    v = cuda.local.array(16, float32)
    nt = QP[Q_NQ]
    lb = QP[Q_LB]
    lgw = QP[Q_LGW]
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
    nw = bits >> int64(1)  # u32 words per thread: 16 * bits / 32
    h = F[K.F_H]
    qmin = F[K.F_QMIN]
    qmax = F[K.F_QMAX]
    fmax = F[K.F_FMAX]
    g = gbuf[0]
    start = int64(cuda.blockIdx.x) * int64(cuda.blockDim.x) + int64(cuda.threadIdx.x)
    stride = int64(cuda.gridDim.x) * int64(cuda.blockDim.x)
    end = (nt + int64(31)) & ~int64(31)  # whole warps iterate together (shuffles need all lanes)
    bad = False
    for t in range(start, end, stride):
        valid = t < nt
        base = t << int64(4)
        m = float32(0.0)
        for k in range(16):
            a = float32(0.0)
            if valid:
                a = x[base + k]
                if not math.isfinite(a):  # flagged; 0 keeps the rest of the kernel finite
                    bad = True
                    a = float32(0.0)
            v[k] = a
            m = max(m, abs(a))
        e = float32(0.0)
        if fused:
            m = group_max(m, gw, sh_f)
            e = round_up(float32(m / h), sdt)
            if valid and (t & (gw - int64(1))) == int64(0):
                put_le(payload, soff + (t >> lgw) * snb, scale_code(e, sdt), snb)
        elif valid and pert:
            e = stored[0]
            if two:
                e = g * e
        lo = int64(0)
        hi = int64(0)
        for k in range(16):
            ek = e
            if not fused and not pert and valid:
                ek = stored[(base + k) >> lb]
                if two:
                    ek = g * ek
            y = float32(0.0)
            if ek != float32(0.0):
                y = v[k] / ek
            f = encode(y, isf, qmin, qmax, fmax, mb, bias, bits)
            pos = k * bits
            if pos < int64(64):
                lo |= f << pos
            else:
                hi |= f << (pos - int64(64))
        if valid:
            wbase = t * nw
            for j in range(nw):
                src = lo
                if j >= int64(2):
                    src = hi
                w32[wbase + j] = uint32((src >> ((j & int64(1)) * int64(32))) & int64(0xFFFFFFFF))
    if bad:
        flag[0] = int32(1)


SIGNATURES: dict[str, list[str]] = {
    "k_quad_quant": ["void(float32[::1], int64[::1], float32[::1], float32[::1], float32[::1], uint32[::1], "
                     "uint8[::1], int32[::1])"],
}
