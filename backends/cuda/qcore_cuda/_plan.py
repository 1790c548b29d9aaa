"""Host-side geometry of the cuda kernels: a tensor shape + scheme -> the `P` / `F` arrays.

The kernels see a *canonical* shape: the tensor's axes after dropping extent-1 axes and merging
neighbours that the block grid and the payload layout treat alike (docs/spec.md, calibration
and portable bytes), so a [B, T, D] tensor with block [32] is a 2-D (B*T, D) problem and a
per-tensor scheme on a Native store is 1-D. Merging keeps the row-major order of elements,
scale slots and words:

* two block-1 axes merge into a block-1 axis;
* any axis merges with a right neighbour that one block spans whole (extent e, block e):
  extent s*e, block b*e;
* the packing axis never merges (each of its lines ends in a zero-padded word).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from qcore.spec import layout
from qcore.spec.codecs import CODE_RULES, scale_slot_id
from qcore.spec.payload import offset_nbytes
from qcore.spec.schemes import OffsetKind, QuantScheme, StoreKind

from . import kernels as K

RUN = 16  # elements per thread in the unfused kernels (rounded up to whole words)


@dataclass(frozen=True)
class Plan:
    """Everything the kernels need for one shape + scheme (all host-side numpy)."""

    P: np.ndarray  # int64[P_LEN]
    F: np.ndarray  # float32[F_LEN]
    fused: bool  # one-pass calibrate+quantize per block applies
    n: int  # elements
    nslots: int
    nruns: int
    values_nbytes: int
    total_nbytes: int
    RP: np.ndarray | None = None  # row-kernel geometry (int64[R_LEN]) when the layout allows
    tile_one_level: bool = False  # the tile kernel calibrates one-level blocks (B | 32, whole words)
    rows_stats: bool = False  # the row kernel can compute block statistics (B | 32)
    rows_shape: tuple[int, int] = (0, 0)  # (L, R)
    TP: np.ndarray | None = None  # tile-kernel geometry (int64[T_LEN]) for blocks B | 32 on the last axis


def _canonical(shape, block, pack):
    """[(extent, block, is_packing_axis)] after dropping and merging axes (module docstring)."""
    axes = []
    for i, (s, b) in enumerate(zip(shape, block)):
        pk = i == pack
        b = min(b, s)
        if s == 1 and not pk:
            continue
        if axes and not pk and not axes[-1][2]:
            s0, b0, _ = axes[-1]
            if b0 == 1 and b == 1:
                axes[-1] = (s0 * s, 1, False)
                continue
            if b == s:
                axes[-1] = (s0 * s, b0 * s, False)
                continue
        axes.append((s, b, pk))
    return axes or [(1, 1, False)]


def _row_major(ext):
    st = [1] * len(ext)
    for k in range(len(ext) - 2, -1, -1):
        st[k] = st[k + 1] * ext[k + 1]
    return st


def lut(scheme: QuantScheme) -> np.ndarray:
    """float32 value of every `bits`-wide field: two's-complement ints or minifloat codes; NaN
    for a field outside the value's set (docs/spec.md, invalid codes), which the dequantize
    kernels flag."""
    t = scheme.traits
    f = np.arange(1 << t.bits, dtype=np.int64)
    if t.is_float:
        values = np.asarray(t.decode_table, dtype=np.float32)
    else:
        half = 0 if t.unsigned else 1 << (t.bits - 1)  # unsigned values (affine offsets): the field itself
        values = ((f ^ half) - half).astype(np.float32)
    return np.ascontiguousarray(np.where(scheme.valid_fields, values, np.float32(np.nan)), dtype=np.float32)


def plan(shape: tuple[int, ...], scheme: QuantScheme, method: str = "minmax") -> Plan:
    """The kernel geometry of a non-empty tensor `shape` under `scheme`."""
    t = scheme.traits
    full = layout.full_block(shape, scheme)
    pack = layout.packing_axis(shape, scheme)
    block = tuple(full) if full is not None else tuple(shape)
    axes = _canonical(shape, block, pack)
    cr = len(axes)
    if cr > K.MAXR:
        raise ValueError(f"shape {shape} with {scheme} needs {cr} canonical axes; the cuda kernels take {K.MAXR}")
    S = [a[0] for a in axes]
    B = [a[1] for a in axes]
    G = [-(-s // b) for s, b in zip(S, B)]
    packed = scheme.store.kind is not StoreKind.NATIVE
    nf = layout.fields_per_word(scheme)
    wb = 4 if scheme.store.kind is StoreKind.PACKED_U32 else 1
    blocked = [k for k in range(cr) if B[k] > 1]
    if packed:
        r = next(k for k in range(cr) if axes[k][2])
    elif scheme.block is not None and len(blocked) == 1:
        r = blocked[0]
    else:
        r = cr - 1
    fused = (
        scheme.block is not None
        and not scheme.two_level
        and all(B[k] == 1 for k in range(cr) if k != r)
        and B[r] % nf == 0
    )
    rl = B[r] if fused else max(nf, RUN)
    W = list(S)
    W[r] = -(-S[r] // nf) if packed else S[r]
    nrl = -(-S[r] // rl)
    lines = math.prod(S) // S[r]
    nslots = math.prod(G)
    snb = scheme.slot_dtype.traits.nbytes
    values_nbytes = layout.values_nbytes(shape, scheme)
    soff = values_nbytes
    goff = soff + nslots * snb
    total = goff + (4 if scheme.two_level else 0) + nslots * offset_nbytes(scheme)  # affine offsets last
    sdt = scheme.scale_slot  # the slot dtype under the scheme's rounding rule
    absmean = 1 if method == "absmean" else 0
    affine = {}
    if scheme.offset is not None:  # affine offsets: their section follows the scales (no global, no table)
        is_min = scheme.offset.kind is OffsetKind.MIN
        affine = dict(M_AFFINE=K.AFFINE_MIN if is_min else K.AFFINE_ZERO, M_OOFF=goff, M_ONB=offset_nbytes(scheme),
                      # a MIN offset's dtype; a zero point's byte: int8 for a signed value, uint8 for an unsigned one
                      M_ODT=scale_slot_id(scheme.offset.dtype.value, "rne", 0) if is_min else not t.unsigned)
    n = math.prod(shape)
    P = K.P_LAYOUT.pack(
        M_CR=cr, M_RAX=r, M_RL=rl, M_NF=nf, M_BITS=t.bits, M_WB=wb, M_NRL=nrl, M_NRUNS=nrl * lines,
        M_NSLOTS=nslots, M_N=n, M_PERT=scheme.block is None,
        M_TWO=2 if scheme.reciprocal_global else int(scheme.two_level),  # 2: a reciprocal global scale (1/g)
        M_SDT=sdt, M_SOFF=soff, M_GOFF=goff, M_METHOD=absmean, M_ISF=t.is_float, M_MB=t.man_bits,
        M_BIAS=t.bias, M_SNB=snb, M_KFIRST=next((k for k in range(cr) if k != r), 0), M_SIGNED=scheme.signed,
        M_CODES=CODE_RULES.index(scheme.code_rule.value), **affine,
        O_S=S, O_B=B, O_G=G, O_XS=_row_major(S), O_WS=_row_major(W), O_GS=_row_major(G))
    F = K.F_LAYOUT.pack(
        F_H=scheme.scale_divisor,  # h, or 1 under the MX rule
        F_M=scheme.block.dtype.traits.max_value if scheme.two_level else 1.0,  # M of the spec's two-level scales
        F_QMIN=t.qmin, F_QMAX=t.qmax, F_FMAX=t.qmax)
    RP, TP, tile_one_level, rows_stats, rows_shape = None, None, False, False, (0, 0)
    last_packs = not packed or axes[-1][2]
    if r == cr - 1 and last_packs and (scheme.block is None or all(B[k] == 1 for k in range(cr - 1))):
        R, L, Wl = math.prod(S[:-1]), S[-1], W[-1]
        Bl = L if scheme.block is None else B[-1]
        rows_stats = scheme.block is not None and Bl <= 32 and 32 % Bl == 0  # lane groups: powers of two
        tile_one_level = rows_stats and not scheme.two_level and Bl % nf == 0
        Rb, Lb = R, Bl  # the row kernels' lines and block
        if scheme.block is None and not packed and R == 1:
            # per-tensor Native: every element shares slot 0, so any row split is the same tensor;
            # lines of a few thousand give each thread many elements
            for cols in (4096, 2048, 1024, 512, 256):
                if L % cols == 0 and L > cols:
                    Rb, L, Wl, Lb = L // cols, cols, cols, cols
                    break
        RP = K.RP_LAYOUT.pack(
            R_R=Rb, R_L=L, R_W=Wl, R_B=Lb, R_GL=0 if scheme.block is None else G[-1], R_NF=nf, R_BITS=t.bits,
            R_SDT=sdt, R_SNB=snb, R_SOFF=soff, R_TWO=scheme.two_level, R_ISF=t.is_float, R_MB=t.man_bits,
            R_BIAS=t.bias, R_METHOD=absmean)
        rows_shape = (L, Rb)
        if rows_stats and (Bl * t.bits) % 8 == 0 and (scheme.two_level or tile_one_level):
            line_bytes = int(W[-1]) * wb
            u32 = (Bl * t.bits) % 32 == 0 and line_bytes % 4 == 0
            tl = -(-L // (32 * Bl))
            TP = K.TP_LAYOUT.pack(
                T_R=Rb, T_L=L, T_B=Bl, T_TL=tl, T_NT=Rb * tl, T_BITS=t.bits, T_SDT=sdt, T_SNB=snb, T_SOFF=soff,
                T_GL=G[-1], T_ISF=t.is_float, T_MB=t.man_bits, T_BIAS=t.bias, T_METHOD=absmean,
                T_WL=line_bytes // 4 if u32 else line_bytes, T_U32=u32, T_MODE=2 if scheme.two_level else 1)
    return Plan(P, F, fused, n, nslots, nrl * lines, values_nbytes, total, RP, tile_one_level, rows_stats, rows_shape,
                TP)


def matmul_geometry(shape: tuple[int, int], scheme: QuantScheme, m: int, sim: bool = False) -> np.ndarray:
    """The `Q` array of k_matmul for a weight [K, N] and m rows of x."""
    k_, n_ = shape
    full = layout.full_block(shape, scheme) or (k_, n_)
    bk, bn = min(full[0], k_), min(full[1], n_)
    store = scheme.store
    if store.kind is StoreKind.NATIVE:
        pa, nf, wb, bits = 1, 1, 1, 8
    else:
        pa = 1 if layout.packing_axis(shape, scheme) == 1 else 0
        nf, wb, bits = layout.fields_per_word(scheme), store.word_bits // 8, scheme.bits
    ng = -(-n_ // K.MM_COLS)
    rowb = -(-n_ // nf) * wb
    # k rows per thread: the largest chunk that still gives ~2 waves of 2048 threads per SM
    # (the simulator takes 32 so that small tests span several chunks)
    chunk = 32
    for c in (256, 128, 64):
        if not sim and ng * m * -(-k_ // c) >= K.sm_count() * 2048:
            chunk = c
            break
    kc = -(-k_ // chunk)
    fast = pa == 1 and rowb * 8 // bits >= ng * K.MM_COLS and not scheme.affine  # affine offsets: the per-code path
    affine = {}
    if scheme.offset is not None:
        affine = dict(MM_AFF=K.AFFINE_MIN if scheme.offset.kind is OffsetKind.MIN else K.AFFINE_ZERO,
                      MM_NS=math.prod(layout.grid_shape(shape, scheme)))
    return K.MQ_LAYOUT.pack(
        MM_M=m, MM_K=k_, MM_N=n_, MM_PA=pa, MM_NF=nf, MM_BITS=bits, MM_WB=wb, MM_ROWB=rowb, MM_BK=bk, MM_BN=bn,
        MM_G1=-(-n_ // bn), MM_KC=kc, MM_CHUNK=chunk, MM_NG=ng, MM_TWO=scheme.two_level, MM_FAST=fast,
        MM_W32=fast and bits >= 4 and rowb % 4 == 0, MM_SAME=bn % K.MM_COLS == 0 or -(-n_ // bn) == 1,
        MM_ISF=scheme.traits.is_float, **affine)


def order_geometry(shape: tuple[int, ...], src: QuantScheme, dst: QuantScheme, tail: int = 0) -> np.ndarray:
    """The `R` array of k_reorder: the values section of `shape` packed by `src`, re-packed in
    `dst`'s field order (docs/spec.md, field orders; the two differ only in their store's order),
    and the `tail` bytes after it copied."""
    axis = layout.packing_axis(shape, src)
    words = layout.words_shape(shape, src)
    nf = layout.fields_per_word(src)
    group = src.store.group or dst.store.group
    return K.OR_LAYOUT.pack(
        OR_VB=layout.values_nbytes(shape, src), OR_TAIL=tail, OR_LOGN=nf.bit_length() - 1,
        OR_NL=math.prod(words) // words[axis], OR_NG=-(-shape[axis] // group) if group else 0,
        OR_NW=math.prod(words), OR_WL=words[axis], OR_IN=math.prod(words[axis + 1:]), OR_EXT=shape[axis],
        OR_NF=layout.fields_per_word(src), OR_BITS=src.bits, OR_WB=src.store.word_bits // 8,
        OR_SRC=K.ORDER_IDS.index(src.store.order.value), OR_SRCG=src.store.group,
        OR_DST=K.ORDER_IDS.index(dst.store.order.value), OR_DSTG=dst.store.group)
