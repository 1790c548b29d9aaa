"""Device intrinsics numba does not expose: vector loads/stores, bit casts, NaN-propagating max,
the sm_89+ FP8 conversions and f16 bits (PTX ISA; `numba.cuda.extending.intrinsic`).

Each intrinsic has a plain-Python twin with the same results that the CUDA simulator runs
(`NUMBA_ENABLE_CUDASIM=1`), so the kernels in `fast.py` are one source for both.

* `ld4(a, i)` / `ld2(a, i)` / `st4(a, i, v0..v3)` / `st2(a, i, v0, v1)`: 16- and 8-byte
  accesses of `a[i..i+3]` (`a[i..i+1]`); `ld1(a, i)` is `a[i]` without the negative-index fix-up;
  `ld1_at(a, row, i)` is `a[row + i]` (4-byte elements) for an int64 `row` and the low 32 bits of
  `i`, its address one wide multiply-add of `i` onto the row's (which a loop over `i` computes once;
  an asm block LLVM sees no memory access in: only for data no thread writes during the kernel);
  `shr_u32(a, s)` is the low 32 bits of `a` shifted right by `s` (< 32) in 32-bit arithmetic;
  `ldcg_f32(a, i)` reads a float32 past L1 (`ld.global.cg`: data other blocks wrote); the caller guarantees the alignment (`i` a multiple of 4 (2) and a 16-byte
  aligned base) and the bounds: there is no wraparound and no bounds check.
* `stb4(a, i, w)` / `stb8(a, i, w0, w1)`: one or two u32 words (little-endian, w0 first) into
  the bytes `a[i..i+3]` (`a[i..i+7]`) of a uint8 array, one 4- or 8-byte store; the caller
  guarantees `i` a multiple of 4 (8) and a base aligned to as much.
* `lds4(a, i)` / `sts4(a, i, v0..v3)`: the 16-byte load / store of `a[i..i+3]` through the
  array's own (generic) pointer, for a shared-memory array (`ld4` and `st4` cast to the global
  space); the caller guarantees `i` a multiple of 4 and an array declared with `alignment=16`.
* `f2u(x)` / `u2f(u)`: float32 <-> uint32 bit patterns; `prmt(a, b, sel)`: byte permute
  (`prmt.b32`, byte k of the result is byte `sel >> 4k & 7` of `b:a`; `sel` a literal);
  `prmt_r(a, b, sel)`: the same with `sel` a register, nibble k's top bit honoured (set: byte k
  is the selected byte's top bit in all eight bits): an 8-entry byte table looked up by four
  3-bit fields at once.
* `fmax_nan(a, b)`: max that returns NaN when either is NaN (`max.NaN.f32`, sm_80+); with
  `abs` it folds a block's max |x| and its non-finite check into one instruction per element.
* `mul_rn(a, b)`: the f32 product rounded on its own (`mul.rn.f32`, which PTX never contracts
  into an fma with a following add): for `f32(q * e) + m` (docs/spec.md, affine offsets).
* `e4m3x2(hi, lo)` / `e5m2x2(hi, lo)`: two f32 -> two FP8 codes (hi in bits 8-15), round to
  nearest even, saturating (`cvt.rn.satfinite.e4m3x2.f32`, sm_89+), as the spec's quantize wants
  for |y| <= max (the kernels clamp first).
* `e4m3x2_f32(c)` / `e5m2x2_f32(c)`: the reverse, exact (`cvt.rn.f16x2.e4m3x2`, then f16 -> f32).
* `f16_bits(x)`: f32 -> f16 bits (round to nearest; exact for the already-rounded scales the
  kernels pass).
* `bitsel(m, a, b)`: `(a & m) | (b & ~m)`, and `and_xor(a, m, c)`: `(a & m) ^ c`, each one
  `lop3.b32` (immediate 0xCA and 0x6A; ptxas does not always find these merges itself).
* `abs_bits_m1(u)`: `(u & 0x7FFFFFFF) - 1` in u32 arithmetic (an f32's |bits| - 1: 0 wraps to
  the top), for a range check by one u32 minimum.
* `mma_tf32(a0..a3, b0, b1, c0..c3, scr, lane, base)`: one warp-wide
  `mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32` (the PTX ISA's m16n8k8 fragments): lane (g, t) =
  (lane >> 2, lane & 3) holds A[g][t], A[g+8][t], A[g][t+4], A[g+8][t+4] (16 x 8), B[t][g],
  B[t+4][g] (8 x 8) and C[g][2t], C[g][2t+1], C[g+8][2t], C[g+8][2t+1]; returns those of C + A B.
  Every lane of the warp must call it (it is a warp collective). The simulator's twin exchanges
  the fragments through `scr[base : base + 192]` (a shared f32 array, one slot per warp) with
  two block barriers, so under the simulator every thread of the block must call it the same
  number of times; the GPU ignores `scr`, `lane` and `base`.
* `mma_bf16(a0..a3, b0, b1, c0..c3, scr, lane, base)`: one warp-wide
  `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`; each A and B register holds two bf16
  (the lower k in the low half): lane (g, t) holds A[g][2t..2t+1], A[g+8][2t..2t+1],
  A[g][2t+8..2t+9], A[g+8][2t+8..2t+9] (16 x 16), B[2t..2t+1][g], B[2t+8..2t+9][g] (16 x 8),
  and C as in `mma_tf32`. The simulator's twin exchanges the fragments through
  `scr[base : base + 384]`, with the same rule for the block's threads.
* `code4_bf16x2(w)`: the 4-bit fields at bits 0-3 and 16-19 of `w`, stored offset by 8 (`c + 8`),
  as the bf16 pair (c_lo, c_hi) with c_lo in the low half: a `lop3` under the bf16 bits of 128
  and one `fma.rn.bf16x2` (exact). `code4s_bf16x2(w)` / `code4s_f16x2(w)`: the same for fields
  in two's complement (Q4), their offset folded into the `lop3` (`(w & m) ^ k`): one instruction
  less a pair than flipping the word first. `e2m1x2_bf16x2(w)`: the E2M1 codes at bits 0-3 and
  16-19 as a bf16 pair (exact; -0 for code 8): the bits under bf16's exponent and mantissa, times
  2**126 by one `fma.rn.bf16x2` (no conversion through f16; `e2m1x2_f16x2` is the f16 pair).
* `bf16x2_rn(hi, lo)`: two f32 rounded to nearest-even bf16, `hi` in the upper half
  (`cvt.rn.bf16x2.f32`); the caller passes finite values below bf16's largest.
* `f16x2_f32(u)`: the two f16 of `u` as f32 (low half first), exact.
* `f16_f32(u)`: the f16 in the low half of `u` as f32, exact (`cvt.f32.f16`: subnormals kept, the sign
  of a zero kept).
* `warp_sync()`: the warp's barrier (`bar.warp.sync`, and a memory fence for the compiler); the
  simulator's twin is a block barrier, so there every thread of the block must call it the same
  number of times.
* `ldsm4(a, i, scr, lane, base)`: one warp-wide `ldmatrix.sync.aligned.m8n8.x4.shared.b16` from
  the shared u32 array `a`: lane 8j + r gives the address `a[i]` of row r of matrix j (16 bytes,
  16-byte aligned), and lane (g, t) receives word t of row g of matrices 0..3. The simulator's twin
  exchanges the addresses through `scr[base : base + 32]` (as the mma twins do, two block
  barriers: every thread of the block calls it the same number of times); the GPU ignores `scr`,
  `lane` and `base`.
* Thread-block clusters (sm_90): `cluster_size()` is the launch's blocks per cluster (1 for a
  launch without clusters); `cluster_arrive()` / `cluster_wait()` are the two halves of the
  cluster-wide barrier (`barrier.cluster.arrive.relaxed`, then `wait`): arrive at a kernel's
  start and wait before the first access to another block's shared memory, and every block of
  the cluster has started by then.
* Sums that land in another block's shared memory without a cluster barrier (sm_90):
  `mbar_init_expect(mb, n)` (one thread of the receiving block, before its `cluster_arrive`)
  makes `mb[0]` (a shared int64) an mbarrier of one arrival that has arrived and expects `n`
  bytes, fenced for the cluster; `st_async_f32(sh, i, rank, v, mb)` stores `v` at `sh[i]` of the
  block of rank `rank` (`st.async`, no wait) and counts its 4 bytes on that block's `mb`;
  `mbar_try_wait(mb)` is whether the barrier's first phase is complete (every expected byte has
  landed and is visible to the caller). The simulator runs no clusters: size 1; its twins are
  a plain store into the block's own array, and complete.
"""
from __future__ import annotations

import numpy as np
from numba import config

if config.ENABLE_CUDASIM:
    from ._simfix import install as _install_simulator_fix

    _install_simulator_fix()  # one shared array per call site and block (see _simfix)

    import math

    def ld4(a, i):
        return a[i], a[i + 1], a[i + 2], a[i + 3]

    def ld2(a, i):
        return a[i], a[i + 1]

    def lds4(a, i):
        return a[i], a[i + 1], a[i + 2], a[i + 3]

    def sts4(a, i, v0, v1, v2, v3):
        a[i] = v0
        a[i + 1] = v1
        a[i + 2] = v2
        a[i + 3] = v3

    def ld1(a, i):
        return a[i]

    def ld1_at(a, row, i):
        return a[int(row) + (int(i) & 0xFFFFFFFF)]

    def ld4_at(a, row, i):
        j = int(row) + (int(i) & 0xFFFFFFFF)
        return a[j], a[j + 1], a[j + 2], a[j + 3]

    def shr_u32(a, s):
        return np.uint32((int(a) & 0xFFFFFFFF) >> int(s))

    def ldcg_f32(a, i):
        return a[i]

    def prmt(a, b, sel):
        src = int(a) & 0xFFFFFFFF | (int(b) & 0xFFFFFFFF) << 32
        return np.uint32(sum(((src >> (8 * ((sel >> (4 * k)) & 7))) & 0xFF) << (8 * k) for k in range(4)))

    def prmt_r(a, b, sel):
        src = int(a) & 0xFFFFFFFF | (int(b) & 0xFFFFFFFF) << 32
        out = 0
        for k in range(4):
            s = (int(sel) >> (4 * k)) & 0xF
            byte = (src >> (8 * (s & 7))) & 0xFF
            if s & 8:  # (sign mode: the selected byte's top bit in all eight)
                byte = 0xFF if byte & 0x80 else 0
            out |= byte << (8 * k)
        return np.uint32(out)

    def st4(a, i, v0, v1, v2, v3):
        a[i] = v0
        a[i + 1] = v1
        a[i + 2] = v2
        a[i + 3] = v3

    def st2(a, i, v0, v1):
        a[i] = v0
        a[i + 1] = v1

    def stb4(a, i, w):
        for k in range(4):
            a[i + k] = (int(w) >> (8 * k)) & 0xFF

    def stb8(a, i, w0, w1):
        stb4(a, i, w0)
        stb4(a, i + 4, w1)

    def f2u(x):
        return np.float32(x).view(np.uint32)

    def u2f(u):
        return np.uint32(np.int64(u) & 0xFFFFFFFF).view(np.float32)

    def fmax_nan(a, b):
        if math.isnan(a) or math.isnan(b):
            return np.float32(np.nan)
        return np.float32(max(a, b))

    def mul_rn(a, b):
        return np.float32(np.float32(a) * np.float32(b))

    def _fp8(v, mb, bias, fmax):
        if math.isnan(v):
            return 0x7F
        a = min(abs(float(v)), fmax)  # saturate (the kernels clamp before)
        sub = 2.0 ** (1 - bias)
        if a < sub:
            c = int(np.rint(a * 2.0 ** (bias + mb - 1)))
        else:
            m, e = math.frexp(a)
            c = ((e - 2 + bias) << mb) + int(np.rint(m * 2.0 ** (mb + 1)))
        if math.copysign(1.0, float(v)) < 0:
            c |= 0x80
        return c

    def _fp8_value(c, mb, bias):
        ex = (c >> mb) & ((1 << (7 - mb)) - 1)
        f = c & ((1 << mb) - 1)
        if mb == 3 and c & 0x7F == 0x7F:  # E4M3 (fn): S.1111.111 is NaN, no infinities
            v = math.nan
        elif mb == 2 and ex == 31:  # E5M2: IEEE-style infinities and NaNs
            v = math.inf if f == 0 else math.nan
        else:
            v = f * 2.0 ** (1 - bias - mb) if ex == 0 else (f + (1 << mb)) * 2.0 ** (ex - bias - mb)
        return np.float32(-v if c & 0x80 else v)

    def e4m3x2(hi, lo):
        return np.uint32((_fp8(hi, 3, 7, 448.0) << 8) | _fp8(lo, 3, 7, 448.0))

    def e5m2x2(hi, lo):
        return np.uint32((_fp8(hi, 2, 15, 57344.0) << 8) | _fp8(lo, 2, 15, 57344.0))

    def e4m3x2_f32(c):
        c = int(c)
        return _fp8_value(c & 0xFF, 3, 7), _fp8_value((c >> 8) & 0xFF, 3, 7)

    def e5m2x2_f32(c):
        c = int(c)
        return _fp8_value(c & 0xFF, 2, 15), _fp8_value((c >> 8) & 0xFF, 2, 15)

    def f16_bits(x):
        return np.uint32(np.float16(x).view(np.uint16))

    def _tf32_trunc(x):
        """What the tensor core reads of an f32 operand: its top 19 bits."""
        return np.uint32(np.float32(x).view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)

    def abs_bits_m1(u):
        return np.uint32((int(u) & 0x7FFFFFFF) - 1 & 0xFFFFFFFF)

    def bitsel(m, a, b):
        m, a, b = int(m) & 0xFFFFFFFF, int(a) & 0xFFFFFFFF, int(b) & 0xFFFFFFFF
        return np.uint32((a & m) | (b & ~m & 0xFFFFFFFF))

    def and_xor(a, m, c):
        return np.uint32(((int(a) & int(m)) ^ int(c)) & 0xFFFFFFFF)

    from numba import cuda as _cuda_sim  # swapped for the fake module inside device functions

    @_cuda_sim.jit(device=True)
    def _mma_exchange(scr, b, kd, a_cells, b_cells, c, g, t):
        """The mma twins' warp exchange: the lane's A cells ((row, k), value) of the 16 x kd A at
        scr[b:], its B cells ((k, n), value) of the kd x 8 B after it, a block barrier, its four
        C entries (C[g][2t], C[g][2t+1], C[g+8][2t], C[g+8][2t+1]) plus A B, a block barrier."""
        bo = b + 16 * kd
        for (r, k), v in a_cells:
            scr[b + r * kd + k] = v
        for (k, n), v in b_cells:
            scr[bo + k * 8 + n] = v
        _cuda_sim.syncthreads()
        out = []
        for r, n, cv in ((g, 2 * t, c[0]), (g, 2 * t + 1, c[1]), (g + 8, 2 * t, c[2]), (g + 8, 2 * t + 1, c[3])):
            s = float(cv) + sum(float(scr[b + r * kd + k]) * float(scr[bo + k * 8 + n]) for k in range(kd))
            out.append(np.float32(s))
        _cuda_sim.syncthreads()
        return out[0], out[1], out[2], out[3]

    @_cuda_sim.jit(device=True)
    def mma_tf32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, scr, lane, base):
        g, t = int(lane) >> 2, int(lane) & 3
        a_cells = [((r, k), _tf32_trunc(v))
                   for r, k, v in ((g, t, a0), (g + 8, t, a1), (g, t + 4, a2), (g + 8, t + 4, a3))]
        b_cells = [((t, g), _tf32_trunc(b0)), ((t + 4, g), _tf32_trunc(b1))]
        return _mma_exchange(scr, int(base), 8, a_cells, b_cells, (c0, c1, c2, c3), g, t)


    def _bf16_bits(v):
        u = int(np.float32(v).view(np.uint32))
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF

    def _bf16_value(b):
        return float(np.uint32((int(b) & 0xFFFF) << 16).view(np.float32))

    def code4_bf16x2(w):
        w = int(w)
        lo, hi = (w & 0xF) - 8, ((w >> 16) & 0xF) - 8
        return np.uint32(_bf16_bits(hi) << 16 | _bf16_bits(lo))

    def bf16x2_rn(hi, lo):
        return np.uint32(_bf16_bits(hi) << 16 | _bf16_bits(lo))

    def f16x2_f32(u):
        u = int(u)
        return (np.float32(np.uint16(u & 0xFFFF).view(np.float16)),
                np.float32(np.uint16((u >> 16) & 0xFFFF).view(np.float16)))

    def f16_f32(u):
        return np.float32(np.uint16(int(u) & 0xFFFF).view(np.float16))

    def cluster_size():
        return np.uint32(1)

    def cluster_arrive():
        return None

    def cluster_wait():
        return None

    def mbar_init_expect(mb, nbytes):
        return None

    def st_async_f32(sh, i, rank, v, mb):
        sh[i] = v  # (a cluster of one block: its own shared memory)

    def mbar_try_wait(mb):
        return True

    @_cuda_sim.jit(device=True)
    def warp_sync():
        _cuda_sim.syncthreads()

    @_cuda_sim.jit(device=True)
    def ldsm4(a, i, scr, lane, base):
        b, g, t = int(base), int(lane) >> 2, int(lane) & 3
        scr[b + int(lane)] = i  # (the row address this lane gives)
        _cuda_sim.syncthreads()
        out = tuple(a[int(scr[b + 8 * j + g]) + t] for j in range(4))
        _cuda_sim.syncthreads()
        return out

    @_cuda_sim.jit(device=True)
    def mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, scr, lane, base):
        g, t = int(lane) >> 2, int(lane) & 3
        a_cells = [((r, k + h), _bf16_value(int(v) >> (16 * h)))
                   for r, k, v in ((g, 2 * t, a0), (g + 8, 2 * t, a1), (g, 2 * t + 8, a2), (g + 8, 2 * t + 8, a3))
                   for h in range(2)]
        b_cells = [((k + h, g), _bf16_value(int(v) >> (16 * h))) for k, v in ((2 * t, b0), (2 * t + 8, b1))
                   for h in range(2)]
        return _mma_exchange(scr, int(base), 16, a_cells, b_cells, (c0, c1, c2, c3), g, t)

    def _f16_value(b):
        return float(np.uint16(int(b) & 0xFFFF).view(np.float16))

    def _f16_bits(v):
        return int(np.float16(v).view(np.uint16))

    def _pair_f16(lo, hi):
        return np.uint32(_f16_bits(hi) << 16 | _f16_bits(lo))

    @_cuda_sim.jit(device=True)
    def mma_f16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, scr, lane, base):
        g, t = int(lane) >> 2, int(lane) & 3
        a_cells = [((r, k + h), _f16_value(int(v) >> (16 * h)))
                   for r, k, v in ((g, 2 * t, a0), (g + 8, 2 * t, a1), (g, 2 * t + 8, a2), (g + 8, 2 * t + 8, a3))
                   for h in range(2)]
        b_cells = [((k + h, g), _f16_value(int(v) >> (16 * h))) for k, v in ((2 * t, b0), (2 * t + 8, b1))
                   for h in range(2)]
        return _mma_exchange(scr, int(base), 16, a_cells, b_cells, (c0, c1, c2, c3), g, t)

    def code4_f16x2(w):
        w = int(w)
        return _pair_f16((w & 0xF) - 8, ((w >> 16) & 0xF) - 8)

    def code4s_f16x2(w):
        return code4_f16x2(int(w) ^ 0x88888888)

    def code4s_bf16x2(w):
        return code4_bf16x2(int(w) ^ 0x88888888)

    def i8x2_f16x2(v):
        v = int(v)
        lo, hi = v & 0xFF, (v >> 16) & 0xFF
        return _pair_f16(lo - 256 if lo > 127 else lo, hi - 256 if hi > 127 else hi)

    def e4m3x2_f16x2(c):
        lo, hi = e4m3x2_f32(c)
        return _pair_f16(lo, hi)

    def e5m2x2_f16x2(c):
        lo, hi = e5m2x2_f32(c)
        return _pair_f16(lo, hi)

    _E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

    def _e2m1_pair(v):
        v = int(v)
        lo, hi = v & 0xF, (v >> 16) & 0xF
        return -_E2M1[lo & 7] if lo & 8 else _E2M1[lo], -_E2M1[hi & 7] if hi & 8 else _E2M1[hi]

    def e2m1x2_f16x2(v):
        return _pair_f16(*_e2m1_pair(v))

    def e2m1x2_bf16x2(v):
        lo, hi = _e2m1_pair(v)
        return np.uint32(_bf16_bits(hi) << 16 | _bf16_bits(lo))

    def f16x2_bf16x2(u):
        lo, hi = f16x2_f32(u)
        return bf16x2_rn(hi, lo)

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    _I16, _I32, _I64, _F32 = ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()

    def _gptr(context, builder, aryty, ary, idxty, idx, width, elt=None):
        """Global-space pointer to `width` elements at element idx of the array (no wraparound);
        with `elt` (an IR type), to `width` values of that type from there."""
        a = context.make_array(aryty)(context, builder, value=ary)
        i = context.cast(builder, idx, idxty, types.int64)
        elt = context.get_value_type(aryty.dtype) if elt is None else elt
        p = builder.gep(a.data, [i])
        vt = ir.VectorType(elt, width)
        return builder.addrspacecast(builder.bitcast(p, vt.as_pointer()), ir.PointerType(vt, 1)), vt

    def _load(n):
        def typer(typingctx, a, i):
            sig = types.UniTuple(a.dtype, n)(a, i)

            def codegen(context, builder, sig, args):
                p, _ = _gptr(context, builder, sig.args[0], args[0], sig.args[1], args[1], n)
                v = builder.load(p, align=4 * n)
                vals = [builder.extract_element(v, ir.Constant(_I32, k)) for k in range(n)]
                return context.make_tuple(builder, sig.return_type, vals)

            return sig, codegen

        return typer

    @intrinsic
    def ld4(typingctx, a, i):
        return _load(4)(typingctx, a, i)

    @intrinsic
    def ld2(typingctx, a, i):
        return _load(2)(typingctx, a, i)

    @intrinsic
    def lds4(typingctx, a, i):
        sig = types.UniTuple(a.dtype, 4)(a, i)

        def codegen(context, builder, sig, args):
            aty = sig.args[0]
            ary = context.make_array(aty)(context, builder, value=args[0])
            k = context.cast(builder, args[1], sig.args[1], types.int64)
            vt = ir.VectorType(context.get_value_type(aty.dtype), 4)
            p = builder.bitcast(builder.gep(ary.data, [k]), vt.as_pointer())  # (generic: NVVM infers shared)
            v = builder.load(p, align=16)
            vals = [builder.extract_element(v, ir.Constant(_I32, j)) for j in range(4)]
            return context.make_tuple(builder, sig.return_type, vals)

        return sig, codegen

    @intrinsic
    def sts4(typingctx, a, i, v0, v1, v2, v3):
        sig = types.void(a, i, v0, v1, v2, v3)

        def codegen(context, builder, sig, args):
            aty = sig.args[0]
            ary = context.make_array(aty)(context, builder, value=args[0])
            k = context.cast(builder, args[1], sig.args[1], types.int64)
            et = context.get_value_type(aty.dtype)
            vt = ir.VectorType(et, 4)
            v = ir.Constant(vt, ir.Undefined)
            for j in range(4):
                v = builder.insert_element(v, context.cast(builder, args[2 + j], sig.args[2 + j], aty.dtype),
                                           ir.Constant(_I32, j))
            builder.store(v, builder.bitcast(builder.gep(ary.data, [k]), vt.as_pointer()), align=16)  # (generic)

        return sig, codegen

    @intrinsic
    def ld1(typingctx, a, i):
        def codegen(context, builder, sig, args):
            p, _ = _gptr(context, builder, sig.args[0], args[0], sig.args[1], args[1], 1)
            return builder.extract_element(builder.load(p, align=a.dtype.bitwidth // 8), ir.Constant(_I32, 0))

        return a.dtype(a, i), codegen

    def _row_ptr(context, builder, sig, args):
        """(the address of element `row` of the array, the 32-bit element offset) of an `_at` load."""
        aty = sig.args[0]
        ary = context.make_array(aty)(context, builder, value=args[0])
        r = context.cast(builder, args[1], sig.args[1], types.int64)
        p = builder.ptrtoint(builder.gep(ary.data, [r], inbounds=True), _I64)  # (the row: loop-invariant)
        return p, builder.trunc(context.cast(builder, args[2], sig.args[2], types.uint64), _I32)

    @intrinsic
    def ld1_at(typingctx, a, row, i):
        """a[row + i] for a 16- or 32-bit array, i a 32-bit offset: one wide multiply-add onto the
        row's address (opaque to LLVM: no merging of the row into a 64-bit index)."""
        bits = a.dtype.bitwidth
        if bits not in (16, 32):
            return None

        def codegen(context, builder, sig, args):
            p, k = _row_ptr(context, builder, sig, args)
            if bits == 32:
                f = _asm(_I32, [_I64, _I32], "{ .reg .b64 a; mad.wide.u32 a, $2, 4, $1; ld.global.b32 $0, [a]; }",
                         "=r,l,r")
                return builder.bitcast(builder.call(f, [p, k]), context.get_value_type(sig.args[0].dtype))
            f = _asm(_I16, [_I64, _I32], "{ .reg .b64 a; mad.wide.u32 a, $2, 2, $1; ld.global.b16 $0, [a]; }",
                     "=h,l,r")
            return builder.call(f, [p, k])

        return a.dtype(a, row, i), codegen

    @intrinsic
    def ld4_at(typingctx, a, row, i):
        """a[row + i .. row + i + 3] of a u32 array (16 bytes, aligned), i a 32-bit offset: one wide
        multiply-add onto the row's address, then one 16-byte load."""
        if a.dtype != types.uint32:
            return None
        ret = types.UniTuple(types.uint32, 4)

        def codegen(context, builder, sig, args):
            p, k = _row_ptr(context, builder, sig, args)
            st = ir.LiteralStructType([_I32] * 4)
            f = _asm(st, [_I64, _I32], "{ .reg .b64 a; mad.wide.u32 a, $5, 4, $4; "
                                       "ld.global.v4.u32 {$0, $1, $2, $3}, [a]; }", "=r,=r,=r,=r,l,r")
            r = builder.call(f, [p, k])
            return context.make_tuple(builder, ret, [builder.extract_value(r, j) for j in range(4)])

        return ret(a, row, i), codegen

    @intrinsic
    def shr_u32(typingctx, a, s):
        def codegen(context, builder, sig, args):
            v = builder.trunc(context.cast(builder, args[0], sig.args[0], types.uint64), _I32)
            n = builder.trunc(context.cast(builder, args[1], sig.args[1], types.uint64), _I32)
            return builder.lshr(v, n)

        return types.uint32(a, s), codegen

    @intrinsic
    def ldcg_f32(typingctx, a, i):
        def codegen(context, builder, sig, args):
            aty = sig.args[0]
            ary = context.make_array(aty)(context, builder, value=args[0])
            p = builder.gep(ary.data, [context.cast(builder, args[1], sig.args[1], types.int64)])
            f = _asm(_F32, [p.type], "ld.global.cg.f32 $0, [$1];", "=f,l")
            return builder.call(f, [p])

        return types.float32(a, i), codegen

    def _store(n, words=False):
        """The typer of a store of n elements of the array at element i, or (`words`) of n u32
        words into its bytes from byte i."""
        def typer(typingctx, a, i, *vs):
            sig = types.void(a, i, *vs)

            def codegen(context, builder, sig, args):
                aty = sig.args[0]
                p, vt = _gptr(context, builder, aty, args[0], sig.args[1], args[1], n, _I32 if words else None)
                v = ir.Constant(vt, ir.Undefined)
                for k in range(n):
                    x = context.cast(builder, args[2 + k], sig.args[2 + k], types.uint32 if words else aty.dtype)
                    v = builder.insert_element(v, x, ir.Constant(_I32, k))
                builder.store(v, p, align=4 * n)

            return sig, codegen

        return typer

    @intrinsic
    def st4(typingctx, a, i, v0, v1, v2, v3):
        return _store(4)(typingctx, a, i, v0, v1, v2, v3)

    @intrinsic
    def st2(typingctx, a, i, v0, v1):
        return _store(2)(typingctx, a, i, v0, v1)

    @intrinsic
    def stb4(typingctx, a, i, w):
        return _store(1, words=True)(typingctx, a, i, w)

    @intrinsic
    def stb8(typingctx, a, i, w0, w1):
        return _store(2, words=True)(typingctx, a, i, w0, w1)

    @intrinsic
    def f2u(typingctx, x):
        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], _I32)

        return types.uint32(types.float32), codegen

    @intrinsic
    def u2f(typingctx, u):
        def codegen(context, builder, sig, args):
            v = context.cast(builder, args[0], sig.args[0], types.uint32)
            return builder.bitcast(v, _F32)

        return types.float32(u), codegen

    def _asm(ret, args, text, cons):
        return ir.InlineAsm(ir.FunctionType(ret, args), text, cons)

    def _f32_binary(text):
        """The typer of a two-operand f32 PTX instruction `text` ($0 = op($1, $2))."""
        def typer(typingctx, a, b):
            def codegen(context, builder, sig, args):
                return builder.call(_asm(_F32, [_F32, _F32], text, "=f,f,f"), list(args))

            return types.float32(types.float32, types.float32), codegen

        return typer

    @intrinsic
    def fmax_nan(typingctx, a, b):
        return _f32_binary("max.NaN.f32 $0, $1, $2;")(typingctx, a, b)

    @intrinsic
    def mul_rn(typingctx, a, b):
        return _f32_binary("mul.rn.f32 $0, $1, $2;")(typingctx, a, b)

    def _to_fp8(kind):
        def typer(typingctx, hi, lo):
            def codegen(context, builder, sig, args):
                f = _asm(_I32, [_F32, _F32],
                         "{ .reg .b16 t; cvt.rn.satfinite.%sx2.f32 t, $1, $2; cvt.u32.u16 $0, t; }" % kind,
                         "=r,f,f")
                return builder.call(f, list(args))

            return types.uint32(types.float32, types.float32), codegen

        return typer

    @intrinsic
    def e4m3x2(typingctx, hi, lo):
        return _to_fp8("e4m3")(typingctx, hi, lo)

    @intrinsic
    def e5m2x2(typingctx, hi, lo):
        return _to_fp8("e5m2")(typingctx, hi, lo)

    def _from_fp8(kind):
        def typer(typingctx, c):
            ret = types.UniTuple(types.float32, 2)

            def codegen(context, builder, sig, args):
                st = ir.LiteralStructType([_F32, _F32])
                f = _asm(st, [_I32],
                         "{ .reg .b16 a, l, h; .reg .b32 d; cvt.u16.u32 a, $2; "
                         "cvt.rn.f16x2.%sx2 d, a; mov.b32 {l, h}, d; "
                         "cvt.f32.f16 $0, l; cvt.f32.f16 $1, h; }" % kind, "=f,=f,r")
                c = context.cast(builder, args[0], sig.args[0], types.uint32)
                r = builder.call(f, [c])
                return context.make_tuple(builder, ret, [builder.extract_value(r, 0), builder.extract_value(r, 1)])

            return ret(c), codegen

        return typer

    @intrinsic
    def e4m3x2_f32(typingctx, c):
        return _from_fp8("e4m3")(typingctx, c)

    @intrinsic
    def e5m2x2_f32(typingctx, c):
        return _from_fp8("e5m2")(typingctx, c)

    @intrinsic
    def prmt(typingctx, a, b, sel):
        if not isinstance(sel, types.IntegerLiteral):
            return None
        k = sel.literal_value

        def codegen(context, builder, sig, args):
            f = _asm(_I32, [_I32, _I32], "prmt.b32 $0, $1, $2, %d;" % k, "=r,r,r")
            ca = context.cast(builder, args[0], sig.args[0], types.uint32)
            cb = context.cast(builder, args[1], sig.args[1], types.uint32)
            return builder.call(f, [ca, cb])

        return types.uint32(a, b, sel), codegen

    @intrinsic
    def prmt_r(typingctx, a, b, sel):
        def codegen(context, builder, sig, args):
            f = _asm(_I32, [_I32, _I32, _I32], "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r")
            return builder.call(f, [context.cast(builder, v, t, types.uint32) for v, t in zip(args, sig.args)])

        return types.uint32(a, b, sel), codegen

    @intrinsic
    def f16_bits(typingctx, x):
        def codegen(context, builder, sig, args):
            f = _asm(_I32, [_F32], "{ .reg .b16 h; cvt.rn.f16.f32 h, $1; cvt.u32.u16 $0, h; }", "=r,f")
            return builder.call(f, list(args))

        return types.uint32(types.float32), codegen

    @intrinsic
    def abs_bits_m1(typingctx, u):
        def codegen(context, builder, sig, args):
            v = context.cast(builder, args[0], sig.args[0], types.uint32)
            return builder.sub(builder.and_(v, ir.Constant(_I32, 0x7FFFFFFF)), ir.Constant(_I32, 1))

        return types.uint32(u), codegen

    def _lop3(lut):
        """The typer of `lop3.b32 $0, $1, $2, $3, lut` on three u32 operands."""
        def typer(typingctx, a, b, c):
            def codegen(context, builder, sig, args):
                f = _asm(_I32, [_I32] * 3, "lop3.b32 $0, $1, $2, $3, %d;" % lut, "=r,r,r,r")
                return builder.call(f, [context.cast(builder, v, t, types.uint32) for v, t in zip(args, sig.args)])

            return types.uint32(a, b, c), codegen

        return typer

    @intrinsic
    def bitsel(typingctx, m, a, b):  # lop3 operands (m, a, b) = (0xF0, 0xCC, 0xAA): (m & a) | (~m & b)
        return _lop3(0xCA)(typingctx, m, a, b)

    @intrinsic
    def and_xor(typingctx, a, m, c):  # (a & m) ^ c
        return _lop3(0x6A)(typingctx, a, m, c)

    def _mma(shape_types: str, operand):
        """The typer of a warp's `mma.sync.aligned.<shape_types>` with four 32-bit A registers, two B
        and four f32 C (`operand`: the numba type of the A and B registers, passed as bits)."""
        def typer(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, scr, lane, base):
            ret = types.UniTuple(types.float32, 4)
            sig = ret(*[operand] * 6, *[types.float32] * 4, scr, lane, base)

            def codegen(context, builder, sig, args):
                st = ir.LiteralStructType([_F32] * 4)
                f = _asm(st, [_I32] * 6 + [_F32] * 4,
                         "mma.sync.aligned.%s {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, "
                         "{$10, $11, $12, $13};" % shape_types, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
                ins = [builder.bitcast(a, _I32) for a in args[:6]] + list(args[6:10])
                r = builder.call(f, ins)
                return context.make_tuple(builder, ret, [builder.extract_value(r, k) for k in range(4)])

            return sig, codegen

        return typer

    @intrinsic
    def mma_tf32(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, scr, lane, base):
        return _mma("m16n8k8.row.col.f32.tf32.tf32.f32", types.float32)(
            typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, scr, lane, base)

    @intrinsic
    def mma_bf16(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, scr, lane, base):
        return _mma("m16n8k16.row.col.f32.bf16.bf16.f32", types.uint32)(
            typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, scr, lane, base)

    @intrinsic
    def mma_f16(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, scr, lane, base):
        return _mma("m16n8k16.row.col.f32.f16.f16.f32", types.uint32)(
            typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, scr, lane, base)

    def _u32_unary(text):
        """The typer of a u32 -> u32 PTX block `text` ($0 = f($1))."""
        def typer(typingctx, w):
            def codegen(context, builder, sig, args):
                return builder.call(_asm(_I32, [_I32], text, "=r,r"),
                                    [context.cast(builder, args[0], sig.args[0], types.uint32)])

            return types.uint32(w), codegen

        return typer

    @intrinsic
    def code4_f16x2(typingctx, w):  # 1024 + (c + 8), less 1032: exact
        return _u32_unary("{ .reg .b32 t, k; lop3.b32 t, $1, 0x000F000F, 0x64006400, 0xEA; "
                          "mov.b32 k, 0x64086408; sub.f16x2 $0, t, k; }")(typingctx, w)

    @intrinsic
    def code4s_f16x2(typingctx, w):  # 1024 + (c ^ 8) = 1024 + (c + 8), less 1032: exact
        return _u32_unary("{ .reg .b32 t, k; lop3.b32 t, $1, 0x000F000F, 0x64086408, 0x6A; "
                          "mov.b32 k, 0x64086408; sub.f16x2 $0, t, k; }")(typingctx, w)

    @intrinsic
    def i8x2_f16x2(typingctx, v):  # 1024 + (c + 128), less 1152: exact
        return _u32_unary("{ .reg .b32 t, k; lop3.b32 t, $1, 0x00FF00FF, 0x64806480, 0x6A; "
                          "mov.b32 k, 0x64806480; sub.f16x2 $0, t, k; }")(typingctx, v)

    def _fp8_f16x2(kind):
        return _u32_unary("{ .reg .b16 a; cvt.u16.u32 a, $1; cvt.rn.f16x2.%sx2 $0, a; }" % kind)

    @intrinsic
    def e4m3x2_f16x2(typingctx, c):
        return _fp8_f16x2("e4m3")(typingctx, c)

    @intrinsic
    def e5m2x2_f16x2(typingctx, c):
        return _fp8_f16x2("e5m2")(typingctx, c)

    @intrinsic
    def e2m1x2_f16x2(typingctx, v):  # (e1 e0 m) under f16's exponent and mantissa, times 2**14
        return _u32_unary("{ .reg .b32 a, b, t, k; shl.b32 a, $1, 9; shl.b32 b, $1, 12; "
                          "and.b32 t, a, 0x0E000E00; and.b32 b, b, 0x80008000; or.b32 t, t, b; "
                          "mov.b32 k, 0x74007400; mul.rn.f16x2 $0, t, k; }")(typingctx, v)

    @intrinsic
    def e2m1x2_bf16x2(typingctx, v):  # (e1 e0 m) under bf16's exponent and mantissa, times 2**126 (+ -0)
        return _u32_unary("{ .reg .b32 a, b, t, k, z; shl.b32 a, $1, 6; shl.b32 b, $1, 12; "
                          "and.b32 t, a, 0x01C001C0; and.b32 b, b, 0x80008000; or.b32 t, t, b; "
                          "mov.b32 k, 0x7E807E80; mov.b32 z, 0x80008000; fma.rn.bf16x2 $0, t, k, z; }")(typingctx, v)

    @intrinsic
    def f16x2_bf16x2(typingctx, u):  # exact for values bf16 holds
        return _u32_unary("{ .reg .b16 l, h; .reg .f32 fl, fh; mov.b32 {l, h}, $1; cvt.f32.f16 fl, l; "
                          "cvt.f32.f16 fh, h; cvt.rn.bf16x2.f32 $0, fh, fl; }")(typingctx, u)

    def _code4_bf16x2(lop3):
        """128 + (c + 8) under bf16 by `lop3` (its constant and function), less 136: exact."""
        return _u32_unary("{ .reg .b32 t, o, c; lop3.b32 t, $1, 0x000F000F, %s; mov.b32 o, 0x3F803F80; "
                          "mov.b32 c, 0xC308C308; fma.rn.bf16x2 $0, t, o, c; }" % lop3)

    @intrinsic
    def code4_bf16x2(typingctx, w):  # fields offset by 8: (w & m) | 128
        return _code4_bf16x2("0x43004300, 0xEA")(typingctx, w)

    @intrinsic
    def code4s_bf16x2(typingctx, w):  # two's complement fields: (w & m) ^ (128 + 8)
        return _code4_bf16x2("0x43084308, 0x6A")(typingctx, w)

    @intrinsic
    def bf16x2_rn(typingctx, hi, lo):
        def codegen(context, builder, sig, args):
            return builder.call(_asm(_I32, [_F32, _F32], "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f"), list(args))

        return types.uint32(types.float32, types.float32), codegen

    @intrinsic
    def f16x2_f32(typingctx, u):
        ret = types.UniTuple(types.float32, 2)

        def codegen(context, builder, sig, args):
            st = ir.LiteralStructType([_F32, _F32])
            f = _asm(st, [_I32], "{ .reg .b16 l, h; mov.b32 {l, h}, $2; cvt.f32.f16 $0, l; cvt.f32.f16 $1, h; }",
                     "=f,=f,r")
            r = builder.call(f, [context.cast(builder, args[0], sig.args[0], types.uint32)])
            return context.make_tuple(builder, ret, [builder.extract_value(r, 0), builder.extract_value(r, 1)])

        return ret(u), codegen

    @intrinsic
    def f16_f32(typingctx, u):
        def codegen(context, builder, sig, args):
            f = _asm(_F32, [_I32], "{ .reg .b16 l, h; mov.b32 {l, h}, $1; cvt.f32.f16 $0, l; }", "=f,r")
            return builder.call(f, [context.cast(builder, args[0], sig.args[0], types.uint32)])

        return types.float32(u), codegen

    @intrinsic
    def cluster_size(typingctx):
        def codegen(context, builder, sig, args):
            f = ir.InlineAsm(ir.FunctionType(_I32, []), "mov.u32 $0, %cluster_nctarank;", "=r", side_effect=True)
            return builder.call(f, [])

        return types.uint32(), codegen

    def _cluster_barrier(text: str):
        def typer(typingctx):
            def codegen(context, builder, sig, args):
                builder.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), text, "~{memory}", side_effect=True), [])
                return context.get_dummy_value()

            return types.void(), codegen

        return typer

    @intrinsic
    def cluster_arrive(typingctx):
        return _cluster_barrier("barrier.cluster.arrive.relaxed.aligned;")(typingctx)

    @intrinsic
    def cluster_wait(typingctx):
        return _cluster_barrier("barrier.cluster.wait.aligned;")(typingctx)

    def _generic_addr(builder, context, aryty, ary, idxty=None, idx=None):
        """The generic (u64) address of ary[idx] (no index: ary[0]), which the inline asm turns
        into a shared one."""
        a = context.make_array(aryty)(context, builder, value=ary)
        i = ir.Constant(_I64, 0) if idx is None else context.cast(builder, idx, idxty, types.int64)
        return builder.ptrtoint(builder.gep(a.data, [i]), _I64)

    @intrinsic
    def mbar_init_expect(typingctx, mb, nbytes):
        def codegen(context, builder, sig, args):
            f = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [_I64, _I32]),
                             "{ .reg .u64 g; .reg .u32 s; cvta.to.shared.u64 g, $0; cvt.u32.u64 s, g; "
                             "mbarrier.init.shared::cta.b64 [s], 1; "
                             "mbarrier.arrive.expect_tx.shared::cta.b64 _, [s], $1; "
                             "fence.mbarrier_init.release.cluster; }",
                             "l,r,~{memory}", side_effect=True)
            builder.call(f, [_generic_addr(builder, context, sig.args[0], args[0]),
                             context.cast(builder, args[1], sig.args[1], types.uint32)])
            return context.get_dummy_value()

        return types.void(mb, nbytes), codegen

    @intrinsic
    def st_async_f32(typingctx, sh, i, rank, v, mb):
        def codegen(context, builder, sig, args):
            f = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [_I64, _I64, _I32, _F32]),
                             "{ .reg .u64 g, h; .reg .u32 s, m, d, e; cvta.to.shared.u64 g, $0; cvt.u32.u64 s, g; "
                             "cvta.to.shared.u64 h, $1; cvt.u32.u64 m, h; "
                             "mapa.shared::cluster.u32 d, s, $2; mapa.shared::cluster.u32 e, m, $2; "
                             "st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [d], $3, [e]; }",
                             "l,l,r,f,~{memory}", side_effect=True)
            builder.call(f, [_generic_addr(builder, context, sig.args[0], args[0], sig.args[1], args[1]),
                             _generic_addr(builder, context, sig.args[4], args[4]),
                             context.cast(builder, args[2], sig.args[2], types.uint32),
                             context.cast(builder, args[3], sig.args[3], types.float32)])
            return context.get_dummy_value()

        return types.void(sh, i, rank, v, mb), codegen

    @intrinsic
    def warp_sync(typingctx):
        def codegen(context, builder, sig, args):
            builder.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), "bar.warp.sync -1;", "~{memory}",
                                      side_effect=True), [])
            return context.get_dummy_value()

        return types.void(), codegen

    @intrinsic
    def ldsm4(typingctx, a, i, scr, lane, base):
        sig = types.UniTuple(types.uint32, 4)(a, i, scr, lane, base)

        def codegen(context, builder, sig, args):
            f = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([_I32] * 4), [_I64]),
                             "{ .reg .u64 g; .reg .u32 s; cvta.to.shared.u64 g, $4; cvt.u32.u64 s, g; "
                             "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {$0, $1, $2, $3}, [s]; }",
                             "=r,=r,=r,=r,l,~{memory}", side_effect=True)
            r = builder.call(f, [_generic_addr(builder, context, sig.args[0], args[0], sig.args[1], args[1])])
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(r, k) for k in range(4)])

        return sig, codegen

    @intrinsic
    def mbar_try_wait(typingctx, mb):
        def codegen(context, builder, sig, args):
            f = ir.InlineAsm(ir.FunctionType(_I32, [_I64]),
                             "{ .reg .u64 g; .reg .u32 s; .reg .pred p; cvta.to.shared.u64 g, $1; cvt.u32.u64 s, g; "
                             "mbarrier.try_wait.parity.shared::cta.b64 p, [s], 0; selp.u32 $0, 1, 0, p; }",
                             "=r,l,~{memory}", side_effect=True)
            r = builder.call(f, [_generic_addr(builder, context, sig.args[0], args[0])])
            return builder.icmp_unsigned("!=", r, ir.Constant(_I32, 0))

        return types.boolean(mb), codegen
