"""The field-order kernel (docs/spec.md, field orders): the values section of a payload packed in
one field order, re-packed in another. The quantize, dequantize and matmul kernels pack and read the
`low` order (LOW); a scheme in HIGH or SPLIT order runs them on a LOW copy of its values and this
kernel moves the fields, on the device, in the stream's order.

The rule is `qcore.spec.layout.field_positions` (the reference's statement), written here per field;
tests/spec/test_field_order_and_flat_blocks.py checks the kernel against `qcore.spec.layout.reorder_values`
in both directions over stores, widths, packing axes, groups and partial groups.
"""
from __future__ import annotations

from numba import cuda, int32, int64

from .devmath import get_le, put_le
from .layouts import (OR_BITS, OR_DST, OR_DSTG, OR_EXT, OR_IN, OR_LOGN, OR_NF, OR_NG, OR_NL, OR_NW, OR_SRC, OR_SRCG,
                      OR_TAIL, OR_VB, OR_WB, OR_WL)

LOW, HIGH, SPLIT = 0, 1, 2  # layouts.ORDER_IDS


@cuda.jit(device=True, inline="always")
def reversed_fields(w, nf, bits, mask):
    """A word with its fields in reverse order (LOW <-> HIGH)."""
    r = int64(0)
    for f in range(nf):
        r |= ((w >> (int64(f) * bits)) & mask) << ((nf - int64(1) - f) * bits)
    return r


@cuda.jit
def k_reorder(src, dst, R):
    """dst = src with the values' fields moved from order R[OR_SRC] to R[OR_DST], and the
    R[OR_TAIL] bytes after the values copied.

    LOW <-> HIGH keeps every element in its word: a thread per word reverses its fields. With a
    SPLIT side, a thread per (line, group) of that side builds the group's words: a field's
    element is at most a group away, so its index arithmetic stays within the group (int32)
    and the group's words are read from cache. (One side is always LOW: the backend moves fields
    between the kernels' order and a scheme's.)"""
    nf = R[OR_NF]
    bits = R[OR_BITS]
    wb = R[OR_WB]
    mask = (int64(1) << bits) - int64(1)
    so = R[OR_SRC]
    do = R[OR_DST]
    start, step = cuda.grid(1), cuda.gridsize(1)
    vb = R[OR_VB]
    for i in range(start, R[OR_TAIL], step):
        dst[vb + i] = src[vb + i]
    if so != SPLIT and do != SPLIT:
        for t in range(start, R[OR_NW], step):
            w = get_le(src, t * wb, wb)
            if so != do:
                w = reversed_fields(w, nf, bits, mask)
            put_le(dst, t * wb, w, wb)
        return
    wl = R[OR_WL]
    inner = R[OR_IN]
    extent = R[OR_EXT]
    logn = R[OR_LOGN]
    group = R[OR_SRCG] if so == SPLIT else R[OR_DSTG]
    other_high = (do if so == SPLIT else so) == HIGH  # the non-split side's order
    ng = R[OR_NG]
    gw = group >> logn  # words of a whole group
    nf32 = int32(nf)
    for t in range(start, R[OR_NL] * ng, step):
        line = t // ng
        g = t - line * ng
        outer = line
        ii = int64(0)
        if inner != 1:
            outer = line // inner
            ii = line - outer * inner
        base = outer * wl * inner + ii  # word 0 of the line
        e0 = g * group  # the group's first element
        length = int32(min(group, extent - e0))
        w = (length + nf32 - int32(1)) >> int32(logn)  # its words
        w0 = g * gw  # its first word, on either side (a group fills whole words on both)
        for q in range(w):
            word = int64(0)
            for f in range(nf32):
                if do == SPLIT:  # field f of split word q: element f*w + q of the group
                    r = int32(f) * w + int32(q)
                    if r < length:
                        wq = r >> int32(logn)
                        fq = r - (wq << int32(logn))
                        if other_high:
                            fq = nf32 - int32(1) - fq
                        v = (get_le(src, (base + (w0 + int64(wq)) * inner) * wb, wb) >> (int64(fq) * bits)) & mask
                        word |= v << (int64(f) * bits)
                else:  # field f of (low or high) word q: element q*n + f (or n-1-f) of the group
                    fl = int32(f)
                    if other_high:
                        fl = nf32 - int32(1) - fl
                    r = int32(q) * nf32 + fl
                    if r < length:
                        wq = r % w
                        fq = r // w
                        v = (get_le(src, (base + (w0 + int64(wq)) * inner) * wb, wb) >> (int64(fq) * bits)) & mask
                        word |= v << (int64(f) * bits)
            put_le(dst, (base + (w0 + int64(q)) * inner) * wb, word, wb)
