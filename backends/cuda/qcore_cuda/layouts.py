"""The parameter arrays the general, row, tile, matmul and field-order kernels take, one table
each (`_params.ParamLayout`): `P` (int64, the general kernels' geometry: `M_*` fields, `O_*`
per-axis extents and strides), `F` (float32 constants, `F_*`), `RP` (row kernels, `R_*`), `TP`
(tile kernel, `T_*`), `MQ` (the general matmul's geometry, `MM_*`) and `OR` (the field-order
kernel, `OR_*`). Each table defines its index constants here as module-level ints (and the
length, `P_LEN`, ...), which the kernels read; `_plan.py` packs the arrays by field name
(`P_LAYOUT.pack(M_CR=...)`). fast.py's `G` / `C`, gemv.py's `Q` and linear.py's `LP` layouts
live with their kernels.
"""
from __future__ import annotations

from qcore.spec.codecs import F32_TINY, SCALE_IDS

from ._params import ParamLayout

MAXR = 12  # canonical rank limit (after merging axes; see _plan.py)

P_LAYOUT = ParamLayout("P", "int64", [
    ("M_CR", "canonical rank: axes after dropping and merging (at most MAXR)"),
    ("M_RAX", "the run axis: the packing axis, or the blocked (else last) axis of a Native store"),
    ("M_RL", "elements per run (a block along the run axis when fused, else whole words of at least RUN)"),
    ("M_NF", "fields (codes) per word"),
    ("M_BITS", "bits per code"),
    ("M_WB", "bytes per word: 4 for PackedU32, else 1"),
    ("M_NRL", "runs per line along the run axis"),
    ("M_NRUNS", "runs in the tensor"),
    ("M_NSLOTS", "scale slots"),
    ("M_N", "elements"),
    ("M_PERT", "1: one scale for the tensor"),
    ("M_TWO", "1: two-level; 2: two-level with a reciprocal global scale"),
    ("M_SDT", "the slot dtype's id under the scheme's rounding rule (`scale_slot`)"),
    ("M_SOFF", "byte offset of the scales section"),
    ("M_GOFF", "byte offset of the global scale (two-level) or of the offsets section (affine offsets)"),
    ("M_METHOD", "calibration: 0 minmax, 1 absmean"),
    ("M_ISF", "1: minifloat values"),
    ("M_MB", "the value's mantissa bits"),
    ("M_BIAS", "the value's exponent bias"),
    ("M_SNB", "bytes per stored scale"),
    ("M_KFIRST", "the first canonical axis other than the run axis (where a run's line index starts)"),
    ("M_MODE", "0: calibrate; 1: explicit scales (given, in `raw`)"),
    ("M_SIGNED", "1: signed scales"),
    ("M_CODES", "the code rule's id (code rules, `codecs.CODE_RULES`)"),
    ("M_AFFINE", "0, or an affine offset: AFFINE_MIN or AFFINE_ZERO; the decoded scales (and `raw`) hold "
                 "the offsets after the scales, [nslots:2 nslots]"),
    ("M_OOFF", "byte offset of the offsets section (affine offsets)"),
    ("M_ODT", "a MIN offset's dtype id (round to nearest); for ZERO, 1 when the zero-point byte is signed"),
    ("M_ONB", "bytes per stored affine offset"),
    ("O_S", MAXR, "extents of the canonical axes"),
    ("O_B", MAXR, "block extents (per-tensor: the extents themselves)"),
    ("O_G", MAXR, "block-grid extents ceil(S / B)"),
    ("O_XS", MAXR, "element strides (row-major)"),
    ("O_WS", MAXR, "word strides (row-major over the words shape)"),
    ("O_GS", MAXR, "slot strides (row-major over the grid)"),
], length_name="P_LEN")
P_LAYOUT.define(globals())

F_LAYOUT = ParamLayout("F", "float32", [
    ("F_H", "h: the scale divisor (1 under the MX rule)"),
    ("F_M", "M of the spec's two-level scales: the block scale dtype's max for two-level schemes, else 1"),
    ("F_QMIN", "the value's smallest code value"),
    ("F_QMAX", "the value's largest code value"),
    ("F_FMAX", "the value's largest magnitude (= qmax)"),
], length=8, length_name="F_LEN")  # (three entries of padding)
F_LAYOUT.define(globals())
SDT_F32 = SCALE_IDS.index("f32")  # the global scale of a two-level scheme is always F32
TINY = float(F32_TINY)  # smallest normal f32: floor of a two-level global scale (docs/spec.md, two-level scales)

# RP: the row kernels (k_rows.py)
# The common layout, coalesced: the block grid splits only the last canonical axis (or the
# scheme is per-tensor), and codes pack along that axis. The tensor is R lines of L elements;
# a thread owns one column c (consecutive threads, consecutive columns) and strides over lines,
# so every load and store of a warp is contiguous. Lanes of one block (B <= 32, B | 32) and of
# one word (nf lanes) combine through warp shuffles on a GPU; the simulator has no shuffles, so
# there the same group operations go through shared memory.
RP_LAYOUT = ParamLayout("RP", "int64", [
    ("R_R", "lines"),
    ("R_L", "elements per line"),
    ("R_W", "stored units (words or bytes) per line"),
    ("R_B", "block extent along the line (per-tensor: the line)"),
    ("R_GL", "scale slots per line (0: one scale for the tensor)"),
    ("R_NF", "fields (codes) per word"),
    ("R_BITS", "bits per code"),
    ("R_MODE", "ROW_GIVEN (codes from stored scales) or ROW_STATS (block statistics too)"),
    ("R_SDT", "the slot dtype's id (as M_SDT)"),
    ("R_SNB", "bytes per stored scale"),
    ("R_SOFF", "byte offset of the scales section"),
    ("R_TWO", "1: two-level"),
    ("R_ISF", "1: minifloat values"),
    ("R_MB", "the value's mantissa bits"),
    ("R_BIAS", "the value's exponent bias"),
    ("R_METHOD", "calibration: 0 minmax, 1 absmean"),
], length_name="R_LEN")
RP_LAYOUT.define(globals())
ROW_GIVEN, ROW_STATS = 0, 1

# TP: the tile kernel (k_tile.py)
# Tile kernel: one-level blocks of B | 32 elements along the last axis. A warp takes a tile of
# 32 consecutive blocks of one line: coalesced loads into shared memory (padded: conflict-free
# both ways), then lane l owns block l: its statistic, its scale (rounded once per block, not
# once per element) and its codes, written as whole u32 words (or bytes) of the line.
TP_LAYOUT = ParamLayout("TP", "int64", [
    ("T_R", "lines"),
    ("T_L", "elements per line"),
    ("T_B", "block extent along the line"),
    ("T_TL", "tiles (of 32 blocks) per line"),
    ("T_NT", "tiles"),
    ("T_BITS", "bits per code"),
    ("T_SDT", "the slot dtype's id (as M_SDT)"),
    ("T_SNB", "bytes per stored scale"),
    ("T_SOFF", "byte offset of the scales section"),
    ("T_GL", "scale slots per line"),
    ("T_ISF", "1: minifloat values"),
    ("T_MB", "the value's mantissa bits"),
    ("T_BIAS", "the value's exponent bias"),
    ("T_METHOD", "calibration: 0 minmax, 1 absmean"),
    ("T_WL", "stored units (u32 words or bytes) per line"),
    ("T_U32", "1: the line is written as whole u32 words"),
    ("T_MODE", "1: statistics, scales and codes (one level); 2: block statistics only (two-level)"),
], length=20, length_name="T_LEN")  # (three entries of padding)
TP_LAYOUT.define(globals())

# MQ: the general matmul kernel (k_matmul.py)
MQ_LAYOUT = ParamLayout("MQ", "int64", [
    ("MM_M", "rows of x"),
    ("MM_K", "the reduction extent (rows of w)"),
    ("MM_N", "columns of w"),
    ("MM_PA", "1: codes packed along N (or a Native store); 0: along K"),
    ("MM_NF", "fields (codes) per word"),
    ("MM_BITS", "bits per code"),
    ("MM_WB", "bytes per word"),
    ("MM_ROWB", "bytes per row of codes (packing along N)"),
    ("MM_BK", "block extent along K"),
    ("MM_BN", "block extent along N"),
    ("MM_G1", "block-grid columns ceil(N / BN)"),
    ("MM_KC", "k-chunks"),
    ("MM_CHUNK", "rows of w per k-chunk"),
    ("MM_NG", "column groups of MM_COLS"),
    ("MM_TWO", "1: two-level"),
    ("MM_FAST", "1: a thread's codes come from whole words of its row"),
    ("MM_W32", "1: those words are read as u32 loads"),
    ("MM_SAME", "1: a thread's 8 columns share a scale slot"),
    ("MM_ISF", "1: minifloat values"),
    ("MM_AFF", "P's M_AFFINE (affine offsets)"),
    ("MM_NS", "scale slots (the affine offsets follow them)"),
], length=24, length_name="MM_LEN")  # (three entries of padding)
MQ_LAYOUT.define(globals())

AFFINE_MIN, AFFINE_ZERO = 1, 2  # P[M_AFFINE]

# OR: the field-order kernel (k_order.py). The values section is `lines` lines of WL words along
# the packing axis, with IN words between neighbours of a line (the axes after it).
OR_LAYOUT = ParamLayout("OR", "int64", [
    ("OR_NW", "words of the values section"),
    ("OR_WL", "words per line along the packing axis"),
    ("OR_IN", "words between neighbours of a line (the axes after the packing axis)"),
    ("OR_EXT", "the packing axis's extent"),
    ("OR_NF", "fields per word"),
    ("OR_BITS", "bits per field"),
    ("OR_WB", "bytes per word"),
    ("OR_SRC", "the source's field order (an index of ORDER_IDS)"),
    ("OR_SRCG", "its split group"),
    ("OR_DST", "the destination's field order"),
    ("OR_DSTG", "its split group"),
    ("OR_VB", "bytes of the values section"),
    ("OR_TAIL", "bytes after it (copied as they are)"),
    ("OR_LOGN", "log2 of the fields per word"),
    ("OR_NL", "lines (the other axes' extents multiplied)"),
    ("OR_NG", "groups of the split side per line"),
], length_name="OR_LEN")
OR_LAYOUT.define(globals())
ORDER_IDS = ("low", "high", "split")  # OR_SRC / OR_DST: FieldOrder values by index
