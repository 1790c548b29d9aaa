"""The general matmul kernel (any store and block layout; the `MQ` geometry): x @ dequantize(w)
with 8 output columns per thread, k-chunks summed in shared memory, f32 atomics into the output."""
from __future__ import annotations

import math

from .devmath import *  # noqa: F401,F403
from .grids import jit_regs, launch, sm_count  # noqa: F401
from .layouts import *  # noqa: F401,F403
from .scales import SCALE_IDS, round_scale, scale_word, word_scale  # noqa: F401

from numba import config, cuda, float32, float64, int32, int64, uint32  # noqa: E402,F401

MM_COLS = 8  # output columns per thread


MM_BDX, MM_BDY = 32, 8  # matmul block: 32 column groups x 8 k-slices (simulator: 8 x 4)
MM_SH = MM_COLS * MM_BDX * MM_BDY  # shared floats per block


@jit_regs(64)
def k_matmul(x, payload, p32, MQ, lut, scales, gbuf, out):
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
    M = MQ[MM_M]
    K = MQ[MM_K]
    N = MQ[MM_N]
    pa_n = MQ[MM_PA] == 1  # packing along N (or Native)
    nf = MQ[MM_NF]
    bits = MQ[MM_BITS]
    wb = MQ[MM_WB]
    rowb = MQ[MM_ROWB]
    bk = MQ[MM_BK]
    bn = MQ[MM_BN]
    g1 = MQ[MM_G1]
    chunk = MQ[MM_CHUNK]
    ng = MQ[MM_NG]
    two = MQ[MM_TWO] != 0
    fast = MQ[MM_FAST] != 0
    w32 = MQ[MM_W32] != 0
    same = MQ[MM_SAME] != 0
    isf = MQ[MM_ISF] != 0
    aff = MQ[MM_AFF]
    ns = MQ[MM_NS]
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
                        e = two_level_e(g, e)
                    xe = xv * e
                    for c in range(MM_COLS):
                        if not same:
                            e = scales[kb * g1 + sc[c]]
                            if two:
                                e = two_level_e(g, e)
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
                                e = two_level_e(g, e)
                            if aff != 0:  # affine offsets: the weight's value, then the product
                                acc[c] += xv * affine_value(lut[code], e, scales[ns + kb * g1 + sc[c]], aff)
                            else:
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
