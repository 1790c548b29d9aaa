"""The tile kernel: one-level blocks of B | 32 elements along the last axis (the `TP` geometry);
a warp per tile of 32 blocks, through shared memory."""
from __future__ import annotations

import math

from .devmath import *  # noqa: F401,F403
from .grids import jit_regs, launch, sm_count  # noqa: F401
from .layouts import *  # noqa: F401,F403
from .scales import SCALE_IDS, round_scale, scale_word, word_scale  # noqa: F401

from numba import config, cuda, float32, float64, int32, int64, uint32  # noqa: E402,F401

TILE_WARPS = 4  # warps per block on a GPU (the simulator runs one)
TILE_SH = TILE_WARPS * 33 * 32
TILE_SHW = TILE_WARPS * 33 * 8  # staged u32 words: up to 8 per block (B = 32, 8-bit codes)


@jit_regs(64)
def k_tile_quant(x, TP, F, w32, w8, payload, flag, stat, gbuf):
    """Fused calibrate+quantize (MODE 1) or block statistics only (MODE 2: stat[slot], and the
    max over slots into gbuf[1] for two-level), one block per lane (docs/spec.md, calibration to
    quantize, portable bytes)."""
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
                e = round_scale(float32(m / h), sdt)
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
