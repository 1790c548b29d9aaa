"""The parameter arrays the general, row, tile and matmul kernels take, one layout each, with
unique names: `P` (int64, the general kernels' geometry: `M_*` fields, `O_*` offsets of the
per-axis extents and strides), `F` (float32 constants, `F_*`), `RP` (row kernels, `R_*`), `TP`
(tile kernel, `T_*`) and `MQ` (the general matmul's geometry, `MM_*`). `_plan.py` fills them;
the kernels read them. (fast.py's `G_*`/`C_*` and gemv.py's `Q_*` layouts live with their
kernels.)
"""
from __future__ import annotations

from qcore.spec.codecs import F32_TINY, SCALE_IDS

# P: the general kernels' geometry
MAXR = 12  # canonical rank limit (after merging axes; see _plan.py)
(M_CR, M_RAX, M_RL, M_NF, M_BITS, M_WB, M_NRL, M_NRUNS, M_NSLOTS, M_N, M_PERT, M_TWO, M_SDT,
 M_SOFF, M_GOFF, M_METHOD, M_ISF, M_MB, M_BIAS, M_SNB, M_KFIRST, M_MODE,
 M_SIGNED, M_CODES, M_AFFINE, M_OOFF, M_ODT, M_ONB) = range(28)
# M_SIGNED: signed scales (E3); M_CODES: code rule id (E4, codecs.CODE_RULES); M_AFFINE: 0, or an
# offset (E5) 1 MIN / 2 ZERO, with the offsets section's byte offset M_OOFF, a MIN dtype's slot id
# M_ODT (round to nearest; for ZERO: 1 when the zero point byte is signed) and word bytes M_ONB. An affine scheme's decoded scales array holds
# the offsets after the scales ([nslots:2 nslots]), as its `raw` array does while quantizing.
O_S = 28            # extents of the canonical axes
O_B = O_S + MAXR    # block extents (per-tensor: the extents themselves)
O_G = O_B + MAXR    # block-grid extents ceil(S / B)
O_XS = O_G + MAXR   # element strides (row-major)
O_WS = O_XS + MAXR  # word strides (row-major over the words shape)
O_GS = O_WS + MAXR  # slot strides (row-major over the grid)
P_LEN = O_GS + MAXR
# F: float32 constants of the general, row and tile kernels
F_H, F_M, F_QMIN, F_QMAX, F_FMAX = range(5)
F_LEN = 8
SDT_F32 = SCALE_IDS.index("f32")  # the global scale of a two-level scheme is always F32
TINY = float(F32_TINY)  # smallest normal f32: floor of a two-level global scale (SPEC §2.2)

# RP: the row kernels (k_rows.py)
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

# TP: the tile kernel (k_tile.py)
# Tile kernel: one-level blocks of B | 32 elements along the last axis. A warp takes a tile of
# 32 consecutive blocks of one line: coalesced loads into shared memory (padded: conflict-free
# both ways), then lane l owns block l: its statistic, its scale (rounded once per block, not
# once per element) and its codes, written as whole u32 words (or bytes) of the line.
(T_R, T_L, T_B, T_TL, T_NT, T_BITS, T_SDT, T_SNB, T_SOFF, T_GL, T_ISF, T_MB, T_BIAS, T_METHOD, T_WL,
 T_U32, T_MODE) = range(17)
T_LEN = 20

# MQ: the general matmul kernel (k_matmul.py), int64
(MM_M, MM_K, MM_N, MM_PA, MM_NF, MM_BITS, MM_WB, MM_ROWB, MM_BK, MM_BN, MM_G1, MM_KC, MM_CHUNK, MM_NG, MM_TWO,
 MM_FAST, MM_W32, MM_SAME, MM_ISF, MM_AFF, MM_NS) = range(21)  # MM_AFF: P's M_AFFINE; MM_NS: slots (offsets after)
MM_LEN = 24

AFFINE_MIN, AFFINE_ZERO = 1, 2  # P[M_AFFINE]

# OR: the field-order kernel (k_order.py), int64. The values section is `lines` lines of WL
# words along the packing axis, with IN words between neighbours of a line (the axes after it).
# OR_VB: bytes of the values section, OR_TAIL: bytes after it (copied as they are), OR_LOGN:
# log2 of the fields per word, OR_NL: lines (the other axes' extents multiplied), OR_NG: groups of
# the split side per line.
(OR_NW, OR_WL, OR_IN, OR_EXT, OR_NF, OR_BITS, OR_WB, OR_SRC, OR_SRCG, OR_DST, OR_DSTG, OR_VB, OR_TAIL, OR_LOGN,
 OR_NL, OR_NG) = range(16)
OR_LEN = 16
ORDER_IDS = ("low", "high", "split")  # OR_SRC / OR_DST: FieldOrder values by index
