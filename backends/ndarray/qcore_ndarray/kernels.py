"""Numba CPU kernels of the `ndarray` backend (docs/spec.md, arithmetic and portable bytes).

All kernels work on the canonical 8-axis view that `qcore_ndarray.plan` builds from a shape and
a scheme: eight extents `shp`, block dims `blk` (per-tensor: a partition of the last axis whose
slots all share scale 0), the block grid `grd`, element strides of the float tensor `xst`, byte
strides of the stored values `ost`, slot strides `gst`, and the packing axis `pa` (-1 for
Native). Axis 7 is the contiguous one.

Along a packing axis (PackedU32) element i lands in word `i // npw`, byte `i % npw` of that
little-endian word (8-bit fields: field k sits in bits [8k, 8k+8), i.e. byte k, as in the portable
bytes). Output bytes are written directly in that layout; padding bytes stay as allocated (zeros).

Numeric rules, in the order the spec's arithmetic fixes them (all float32, every literal cast
explicitly so numba never promotes to float64):

* statistic per slot: `amax = max |x|` as the max of the f32 bit patterns with the sign cleared
  (monotone for finite floats; a pattern >= 0x7F800000 is a NaN or Inf, so the same reduction is
  the non-finite check), or `absmean` = f64 sum of |x| over the slot's real elements, divided by
  their count, rounded once to f32;
* raw scale `s = f32(stat) / f32(h)`, rounded into the scale slot (`round_scale_scalar`: the dtype
  and its rounding rule, the spec's scale storage);
* `y = x / e` as a true f32 division (never a reciprocal multiply), `q = clamp(rint(y))`
  computed as `rint(clamp(y))` (identical: the bounds are integers and rint is monotone);
  `e == 0` gives code 0;
* dequantize `x' = f32(q) * e`.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from qcore.spec.codecs import SCALE_IDS, code_rule_kernel, scale_round_kernel

__all__ = [
    "SCALE_CODES",
    "MODE_STATS",
    "MODE_FUSED",
    "MODE_APPLY",
    "METHOD_CODES",
    "round_scale_scalar",
    "round_scale_array",
    "tensor_stats",
    "quantize_blocks",
    "dequantize_blocks",
]

SCALE_CODES = {name: i for i, name in enumerate(SCALE_IDS)}
"""Scale dtype (ScaleDtype value) -> its round-up slot id (`qcore.spec.codecs.SCALE_SLOTS`); a
scheme's own slot, with its rounding rule, is `QuantScheme.scale_slot`."""
METHOD_CODES = {"minmax": 0, "absmean": 1}

MODE_STATS = 0  # per slot: write the statistic (amax or mean |x|) to scales_out, no codes
MODE_FUSED = 1  # per slot: statistic -> raw scale -> round up -> quantize the block (one read)
MODE_APPLY = 2  # quantize with the given effective scale per slot

_ABS = np.uint32(0x7FFFFFFF)
_INF_BITS = np.uint32(0x7F800000)


@intrinsic
def _f32_bits(typingctx, x):
    """Bit pattern of a float32 scalar, as uint32 (a plain bitcast)."""
    sig = types.uint32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


@intrinsic
def _bits_f32(typingctx, b):
    """float32 with bit pattern `b` (uint32)."""
    sig = types.float32(types.uint32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


# numba freezes the rule's numbers (qcore.spec.codecs.SCALE_ARRAYS) into the compiled kernels; its
# on-disk cache keys on this file, so after editing qcore.spec.codecs' table clear __pycache__ (the
# tests pin the result against qcore.spec.codecs).
round_scale_scalar = scale_round_kernel(njit(inline="always"), _f32_bits, _bits_f32)
rule_code = code_rule_kernel(njit(inline="always"))
"""The int64 code of `y` under a code rule (docs/spec.md, code rules): `qcore.spec.codecs`' one source."""
"""Round a raw scale `s >= 0` (f32) into scale slot `sdt` (`qcore.spec.codecs.SCALE_SLOTS`: the
dtype and its rounding rule, the spec's scale storage), as f32: `qcore.spec.codecs`' one kernel
source, compiled for the CPU."""


@njit(cache=True)
def round_scale_array(s, sdt):
    """`round_scale_scalar` over a float32 array (used by tests to pin it against qcore.spec.codecs)."""
    out = np.empty_like(s)
    for i in range(s.size):
        out[i] = round_scale_scalar(s[i], sdt)
    return out



# Inner loops run over slices from index 0: numba then drops its negative-index wraparound
# select and LLVM's loop vectorizer turns them into SIMD code (offset indexing stays scalar).


@njit(cache=True, inline="always")
def _amax_bits(xb):
    """max of the |x| bit patterns of a uint32 slice (0 when empty)."""
    m = np.uint32(0)
    for j in range(xb.size):
        m = max(m, xb[j] & _ABS)
    return m


@njit(cache=True, inline="always")
def _abs_sum(x):
    """f64 sum of |x| over a float32 slice (absmean, the spec's calibration)."""
    sm = 0.0
    for j in range(x.size):
        sm += np.float64(abs(x[j]))
    return sm


@njit(cache=True, inline="always")
def _encode_contig(xs, os, e, qmin, qmax, rule):
    """os = clamp(rint(xs / e)) as int8; e == 0 gives code 0 (the spec's quantize). Under a code
    rule (`rule` > 0, docs/spec.md, code rules) `e` is the reciprocal of the raw scale:
    y = f32(x * e), coded by `rule_code`."""
    if rule != 0:
        for j in range(xs.size):
            v = xs[j]
            y = np.float32(0.0) if v == np.float32(0.0) else np.float32(v * e)
            os[j] = np.int8(rule_code(y, rule, qmin, qmax))
    elif e == np.float32(0.0):
        for j in range(xs.size):
            os[j] = np.int8(0)
    else:
        for j in range(xs.size):
            y = xs[j] / e
            y = min(max(y, qmin), qmax)
            os[j] = np.int8(np.rint(y))


@njit(cache=True)
def _encode_strided(xs, out, ob, istr, e, qmin, qmax, rule):
    """As `_encode_contig`, writing code j to out[ob + j * istr] (packing axis not last)."""
    for j in range(xs.size):
        if rule != 0:
            v = xs[j]
            y = np.float32(0.0) if v == np.float32(0.0) else np.float32(v * e)
            out[ob + j * istr] = np.int8(rule_code(y, rule, qmin, qmax))
        elif e == np.float32(0.0):
            out[ob + j * istr] = np.int8(0)
        else:
            y = xs[j] / e
            y = min(max(y, qmin), qmax)
            out[ob + j * istr] = np.int8(np.rint(y))


@njit(cache=True, inline="always")
def _decode_contig(cs, ys, e, qmin):
    """ys = f32(cs) * e (the spec's dequantize); returns 1 when a code is below `qmin` (an invalid
    code)."""
    low = 0
    for j in range(cs.size):
        c = cs[j]
        if c < qmin:
            low = 1
        ys[j] = np.float32(c) * e
    return low


@njit(cache=True)
def _decode_strided(codes, ob, istr, ys, e, qmin):
    """As `_decode_contig`, reading code j from codes[ob + j * istr] (packing axis not last)."""
    low = 0
    for j in range(ys.size):
        c = codes[ob + j * istr]
        if c < qmin:
            low = 1
        ys[j] = np.float32(c) * e
    return low


# --------------------------------------------------------------------------- per-tensor statistic


@njit(parallel=True, cache=True)
def tensor_stats(x, xb, method, chunk):
    """One pass over flat f32 `x` (and its uint32 view `xb`): the max |x| bit pattern and, for
    absmean, the f64 sum of |x| (the spec's calibration). A max pattern >= 0x7F800000 means
    non-finite input.
    """
    n = x.size
    nch = (n + chunk - 1) // chunk
    mbs = np.zeros(max(nch, 1), np.uint32)
    sums = np.zeros(max(nch, 1), np.float64)
    for c in prange(nch):
        i0 = c * chunk
        i1 = min(n, i0 + chunk)
        mbs[c] = _amax_bits(xb[i0:i1])
        if method == 1:
            sums[c] = _abs_sum(x[i0:i1])
    return mbs.max(), sums.sum()


@njit(parallel=True, cache=True)
def error_partials(x, y, chunk):
    """One pass over flat f32 `x` and its dequantized `y`: per chunk, the f64 sums of x**2 and of
    e**2 with e = y - x in f32 (as numpy subtracts), and max |e| (a NaN kept: the figures of
    `qcore.backend.stats.error_stats`); the sums added, the per-chunk maxima as an array (numba's
    own `max()` of an array passes over a NaN: the caller takes numpy's)."""
    n = x.size
    nch = (n + chunk - 1) // chunk
    sig = np.zeros(max(nch, 1), np.float64)
    noise = np.zeros(max(nch, 1), np.float64)
    mx = np.zeros(max(nch, 1), np.float32)
    for c in prange(nch):
        i0 = c * chunk
        i1 = min(n, i0 + chunk)
        s = 0.0
        z = 0.0
        m = np.float32(0.0)
        for i in range(i0, i1):
            xi = x[i]
            e = np.float32(y[i] - xi)
            s += np.float64(xi) * np.float64(xi)
            z += np.float64(e) * np.float64(e)
            a = abs(e)
            if a > m or a != a:  # a NaN stays the max
                m = a
        sig[c] = s
        noise[c] = z
        mx[c] = m
    return sig.sum(), noise.sum(), mx


# --------------------------------------------------------------------------- block kernels


@njit(cache=True)
def _max_lines(shp, blk):
    """Most lines (along axis 7) one block can cover: the size of a task's line tables."""
    n = 1
    for k in range(7):
        n *= max(1, min(shp[k], blk[k]))
    return n


@njit(cache=True)
def _lines(r, shp, blk, grd, xst, ost, gst, pa, npw, scratch, xline, oline):
    """For task row `r` (flat index over the grid of axes 0..6): the slot index of its first
    block and the number of lines its blocks cover; the float offset / byte offset of each line
    (along axis 7) go to xline / oline. `scratch` is int64[28] of per-task working space."""
    g = scratch[0:7]
    lo = scratch[7:14]
    cnt = scratch[14:21]
    idx = scratch[21:28]
    rem = r
    for k in range(6, -1, -1):
        g[k] = rem % grd[k]
        rem //= grd[k]
    nl = 1
    sb = 0
    for k in range(7):
        lo[k] = g[k] * blk[k]
        cnt[k] = min(shp[k], lo[k] + blk[k]) - lo[k]
        nl *= cnt[k]
        sb += g[k] * gst[k]
        idx[k] = 0
    for line in range(nl):
        xo = 0
        oo = 0
        for k in range(7):
            i = lo[k] + idx[k]
            xo += i * xst[k]
            if k == pa:
                oo += (i // npw) * ost[k] + (i % npw)
            else:
                oo += i * ost[k]
        xline[line] = xo
        oline[line] = oo
        k = 6
        while k >= 0:  # odometer over the block's lines
            idx[k] += 1
            if idx[k] < cnt[k]:
                break
            idx[k] = 0
            k -= 1
    return sb, nl


@njit(cache=True, inline="always")
def _encode_lines(x, out, xline, oline, j0, j1, istr, e, qmin, qmax, rule):
    """q = clamp(rint(x / e)) (or the code rule's, `_encode_contig`) for one block's lines,
    written as int8 at their byte offsets."""
    for line in range(xline.size):
        xo = xline[line]
        oo = oline[line]
        if istr == 1:
            _encode_contig(x[xo + j0:xo + j1], out[oo + j0:oo + j1], e, qmin, qmax, rule)
        else:
            _encode_strided(x[xo + j0:xo + j1], out, oo + j0 * istr, istr, e, qmin, qmax, rule)


# --------------------------------------------------------------------------- fused fast path
# Blocks of 2^k elements along the contiguous axis (e.g. block32). Per-block loops of 32 are too
# short for LLVM's loop vectorizer (its reductions get no vector epilogue), so a task works on
# its run of whole blocks with long loops instead: a max tree over the |x| bit patterns (block
# maxima) -> scales -> a spreading tree (one scale per element) -> one division loop. The
# arithmetic per element is the same as the general path; only the loop shape differs.


@njit(cache=True)
def _max2(src, dst, n, mask):
    """dst[i] = max(src[2i] & mask, src[2i+1] & mask) for i < n: one level of the max tree."""
    for i in range(n):
        dst[i] = max(src[2 * i] & mask, src[2 * i + 1] & mask)


@njit(cache=True)
def _max4(src, dst, n, mask):
    """dst[i] = max of src[4i .. 4i+3] & mask for i < n: two levels of the max tree at once."""
    for i in range(n):
        dst[i] = max(max(src[4 * i] & mask, src[4 * i + 1] & mask), max(src[4 * i + 2] & mask, src[4 * i + 3] & mask))


@njit(cache=True)
def _spread2(src, dst, n):
    """dst[2i] = dst[2i+1] = src[i] for i < n: spreads one scale per block to its elements."""
    for i in range(n):
        v = src[i]
        dst[2 * i] = v
        dst[2 * i + 1] = v


@njit(cache=True)
def _spread4(src, dst, n):
    """dst[4i .. 4i+3] = src[i] for i < n."""
    for i in range(n):
        v = src[i]
        dst[4 * i] = v
        dst[4 * i + 1] = v
        dst[4 * i + 2] = v
        dst[4 * i + 3] = v


@njit(cache=True, error_model="numpy")
def _encode_per_element(xs, es, os, qmin, qmax):
    """os[j] = clamp(rint(xs[j] / es[j])), 0 where es[j] == 0 (true f32 division, the spec's
    quantize). The numpy error model keeps numba from raising on the (discarded) division by
    zero."""
    for j in range(xs.size):
        e = es[j]
        nz = e != np.float32(0.0)
        y = xs[j] / (e if nz else np.float32(1.0))
        y = min(max(y, qmin), qmax)
        os[j] = np.int8(np.rint(y)) if nz else np.int8(0)


@njit(cache=True)
def _fused_pow2(x, xb, out, x0, o0, nblocks, logb, h, qmin, qmax, sdt, scales_out, slot0, slot_step):
    """MODE_FUSED (minmax) for `nblocks` whole blocks of 2^logb contiguous elements starting at
    float offset x0 / byte offset o0. Returns False on a non-finite input."""
    m = nblocks << logb
    a = np.empty(m, np.uint32)
    b = np.empty(m, np.uint32)
    # Block maxima of the |x| bit patterns: tree levels of 4 (two halvings) while they fit, then
    # one of 2; level 0 reads x and clears the sign bits, later levels ping-pong between a and b.
    k = m
    left = logb
    lev = 0
    while left > 0:
        step = 2 if left >= 2 else 1
        k >>= step
        if lev == 0:
            src = xb[x0:x0 + m]
            mask = _ABS
        elif lev % 2 == 1:
            src = a
            mask = np.uint32(0xFFFFFFFF)
        else:
            src = b
            mask = np.uint32(0xFFFFFFFF)
        dst = a if lev % 2 == 0 else b
        if step == 2:
            _max4(src, dst, k, mask)
        else:
            _max2(src, dst, k, mask)
        lev += 1
        left -= step
    maxima = a if lev % 2 == 1 else b
    ea = (b if lev % 2 == 1 else a).view(np.float32)
    eb = maxima.view(np.float32)
    if _amax_bits(maxima[:nblocks]) >= _INF_BITS:  # a NaN/Inf somewhere in these blocks
        return False
    for g in range(nblocks):
        ea[g] = round_scale_scalar(np.float32(_bits_f32(maxima[g]) / h), sdt)
    for g in range(nblocks):
        scales_out[slot0 + g * slot_step] = ea[g]
    # One scale per element: the same levels, spreading (the maxima buffer is free again).
    k = nblocks
    left = logb
    while left > 0:
        step = 2 if left >= 2 else 1
        if step == 2:
            _spread4(ea, eb, k)
        else:
            _spread2(ea, eb, k)
        k <<= step
        ea, eb = eb, ea
        left -= step
    _encode_per_element(x[x0:x0 + m], ea, out[o0:o0 + m], qmin, qmax)
    return True


@njit(cache=True, inline="always")
def _quantize_row(r, c, x, xb, shp, blk, grd, xst, ost, gst, pa, npw, chunk, mode, method, check,
                  h, qmin, qmax, sdt, escales, scales_out, out, logb, istr, scratch, xtab, otab, rule):
    """One task row `r` (grid of axes 0..6), chunk `c` of its blocks along axis 7; see
    `quantize_blocks`. Returns False on a non-finite input."""
    g7n = grd[7]
    b7 = blk[7]
    d7 = shp[7]
    sb, nl = _lines(r, shp, blk, grd, xst, ost, gst, pa, npw, scratch, xtab, otab)
    xline = xtab[:nl]
    oline = otab[:nl]
    ga = c * chunk
    gb = min(g7n, ga + chunk)
    if mode == 1 and method == 0 and logb > 0 and nl == 1 and istr == 1:
        gf = min(gb, d7 >> logb)  # whole blocks; a partial edge block takes the general path
        if gf > ga:
            if not _fused_pow2(x, xb, out, xline[0] + ga * b7, oline[0] + ga * b7, gf - ga, logb, h,
                               qmin, qmax, sdt, scales_out, sb + ga * gst[7], gst[7]):
                return False
            ga = gf
    for g7 in range(ga, gb):
        j0 = g7 * b7
        j1 = min(d7, j0 + b7)
        slot = sb + g7 * gst[7]
        if mode != 2 or check:
            mb = np.uint32(0)
            for line in range(nl):
                xo = xline[line]
                mb = max(mb, _amax_bits(xb[xo + j0:xo + j1]))
            if mb >= _INF_BITS:
                return False
        if mode == 2:
            e = escales[slot]
        else:
            if method == 1:
                sm = 0.0
                for line in range(nl):
                    xo = xline[line]
                    sm += _abs_sum(x[xo + j0:xo + j1])
                stat = np.float32(sm / np.float64(nl * (j1 - j0)))
            else:
                stat = _bits_f32(np.uint32(mb))
            if mode == 0:
                scales_out[slot] = stat
                continue
            e = round_scale_scalar(np.float32(stat / h), sdt)
            scales_out[slot] = e
        _encode_lines(x, out, xline, oline, j0, j1, istr, e, qmin, qmax, rule)
    return True


@njit(parallel=True, cache=True)
def quantize_blocks(x, xb, shp, blk, grd, xst, ost, gst, pa, npw, chunk, rows, mode, method, check,
                    h, qmin, qmax, sdt, escales, scales_out, out, bad, logb, rule):
    """Block-wise pass over flat f32 `x` (the spec's calibration to quantize).

    mode MODE_STATS: `scales_out[slot]` = the slot statistic. MODE_FUSED: statistic -> raw scale
    `stat / h` -> round up to `sdt` -> `scales_out[slot]`, then quantize the block while it is in
    cache. MODE_APPLY: quantize with `escales[slot]` (with `check`, scan the block for NaN/Inf
    first). Codes go to `out` (int8 view of the stored value bytes). A task (`rows` task rows x
    `chunk` blocks along axis 7) that meets a non-finite value sets `bad[task]` and stops.
    `logb` >= 1 when the plan allows the fused fast path (blocks of 2^logb along axis 7 only,
    contiguous codes), else -1. `rule` > 0: MODE_APPLY under a code rule (docs/spec.md, code rules), with
    `escales` the reciprocals of the raw scales.
    """
    n_outer = 1
    for k in range(7):
        n_outer *= grd[k]
    n_chunks = (grd[7] + chunk - 1) // chunk
    n_groups = (n_outer + rows - 1) // rows
    istr = 1 if pa == 7 else ost[7]
    maxl = _max_lines(shp, blk)
    for t in prange(n_groups * n_chunks):
        rg = t // n_chunks
        c = t - rg * n_chunks
        scratch = np.empty(28, np.int64)
        xtab = np.empty(maxl, np.int64)
        otab = np.empty(maxl, np.int64)
        for r in range(rg * rows, min(n_outer, rg * rows + rows)):
            if not _quantize_row(r, c, x, xb, shp, blk, grd, xst, ost, gst, pa, npw, chunk, mode, method, check,
                                 h, qmin, qmax, sdt, escales, scales_out, out, logb, istr, scratch, xtab, otab,
                                 rule):
                bad[t] = 1
                break


@njit(parallel=True, cache=True)
def dequantize_blocks(codes, shp, blk, grd, xst, ost, gst, pa, npw, chunk, rows, escales, y, qmin, bad):
    """`y = f32(q) * e` block by block (the spec's dequantize), reading the stored value bytes as
    int8.

    A task that meets a code below `qmin` (Q8S -128, an invalid code) sets `bad[task]`; the host
    then names the element."""
    n_outer = 1
    for k in range(7):
        n_outer *= grd[k]
    g7n = grd[7]
    n_chunks = (g7n + chunk - 1) // chunk
    n_groups = (n_outer + rows - 1) // rows
    istr = 1 if pa == 7 else ost[7]
    b7 = blk[7]
    d7 = shp[7]
    maxl = _max_lines(shp, blk)
    for t in prange(n_groups * n_chunks):
        rg = t // n_chunks
        c = t - rg * n_chunks
        scratch = np.empty(28, np.int64)
        xtab = np.empty(maxl, np.int64)
        otab = np.empty(maxl, np.int64)
        for r in range(rg * rows, min(n_outer, rg * rows + rows)):
            sb, nl = _lines(r, shp, blk, grd, xst, ost, gst, pa, npw, scratch, xtab, otab)
            for g7 in range(c * chunk, min(g7n, c * chunk + chunk)):
                j0 = g7 * b7
                j1 = min(d7, j0 + b7)
                e = escales[sb + g7 * gst[7]]
                for line in range(nl):
                    xo = xtab[line]
                    oo = otab[line]
                    if istr == 1:
                        low = _decode_contig(codes[oo + j0:oo + j1], y[xo + j0:xo + j1], e, qmin)
                    else:
                        low = _decode_strided(codes, oo + j0 * istr, istr, y[xo + j0:xo + j1], e, qmin)
                    if low:
                        bad[t] = 1


# --------------------------------------------------------------------------- numba's disk cache
# numba keys a cached kernel on its own file and bytecode; the scale and value tables it freezes
# in come from qcore.spec.codecs, so an edit or upgrade there alone would load stale kernels. Each
# cached kernel's key also holds a hash of qcore/spec/codecs.py's bytes.


def _key_on_codecs() -> None:
    import hashlib

    from numba.core.dispatcher import Dispatcher

    from qcore.spec import codecs

    with open(codecs.__file__, "rb") as f:
        stamp = hashlib.sha256(f.read()).hexdigest()
    for fn in list(globals().values()):
        cache = getattr(fn, "_cache", None) if isinstance(fn, Dispatcher) else None
        base = getattr(type(cache), "_index_key", None)
        if base is None or getattr(cache, "_qcore_keyed", False):
            continue

        def index_key(sig, codegen, cache=cache, base=base):
            return base(cache, sig, codegen) + (("qcore.spec.codecs", stamp),)

        cache._index_key = index_key
        cache._qcore_keyed = True


_key_on_codecs()
