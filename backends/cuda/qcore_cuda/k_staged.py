"""The Gluon kernel of `fused.FORM_STAGED` (Triton's lower-level language, Hopper and later):
y [M, N] = x [M, K] @ W^T (+ bias), the weight tile decoded into shared memory and multiplied
from there by asynchronous `wgmma`, so that the decode of step i + 1 runs while the product of
step i is on the tensor cores.

A program computes BN weight rows by BM rows of x. Its warpgroups split the weight rows, 16 a
warp, or where there are fewer (8 warps on 64 rows) x's rows (`_x_groups`): each warpgroup then
multiplies the whole decoded tile by its half of x's tile, and all warps share the decode. Per
step of BK columns: x's tile [BM, BK] and the code bytes [BN, BK / PER] arrive by `cp.async` in
a ring of STAGES buffers (issued STAGES - 2 steps ahead); the warps load the bytes, decode each
field exactly (`k_fused.decode`), multiply by its f32 scale slot (loaded a step ahead) and round to bfloat16 (docs/spec.md's bfloat16-weight
rule), and store the tile in column order into one of two bfloat16 buffers; `wgmma` multiplies
that buffer by x's (both read from shared memory) into f32 sums, and the program waits for the
product of the step before (`warpgroup_mma_wait(1)`) before it issues the next. The copies and
the scales' loads are issued after the fence that makes the stored tile visible to `wgmma`: the
fence waits for the thread's earlier memory operations, so issued before it they would be waited
for there. Two barriers a step order the warps: a buffer is refilled only once every warpgroup's
product that read it is done. Rows past N or M read rows inside (their results are not stored);
K is a multiple of BK. The bias is added in f32 and each sum rounded once to bfloat16. Sums run in
a fixed order: results repeat bit for bit. With F16, x, the weight tile and y are float16 (docs/spec.md's
float16-weight rule: the scales given times 2**p, the sums times `unscale`, 2**-p, before the bias).

Imported on first use of that form (Gluon comes with Triton 3.5 and later)."""
from triton.experimental import gluon
from triton.runtime.jit import constexpr_function
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .k_fused import decode, scale_slots

_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
"""cp.async of a pointer tensor into shared memory (Triton 3.9 renamed Triton 3.6's builtin)."""
_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
"""A barrier of the program's threads (bar.sync; likewise renamed)."""


@constexpr_function
def _spread(rows, cols, vec, warps):
    """A blocked layout of [rows, cols] (row-major) with `vec` consecutive elements a thread
    where the tile allows, each element held by one thread."""
    per_thread = max(1, min(vec, rows * cols // (32 * warps)))
    tpw_c = max(1, min(32, cols // per_thread))
    return gl.BlockedLayout([1, per_thread], [32 // tpw_c, tpw_c], [warps, 1], [1, 0])


@constexpr_function
def _x_groups(bn, warps):
    """The warpgroups that split x's rows: 1 where the weight rows give each warp 16, else all of
    them (8 warps on 64 weight rows: two warpgroups, each the whole decoded tile by half of x's
    rows)."""
    return 1 if bn >= 16 * warps else warps // 4


@gluon.jit
def _fields(b, s, KIND: gl.constexpr, BITS: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, DT: gl.constexpr):
    """Code bytes b [BN, BK / PER] (int32) and their scales -> the weight values [BN, BK] in column
    order (byte j's field f is column PER * j + f), of type DT (bfloat16 or float16)."""
    if BITS == 8:
        w = (decode(b, KIND) * s).to(DT)
    elif BITS == 4:
        w = gl.reshape(gl.join((decode(b & 0xF, KIND) * s).to(DT), (decode((b >> 4) & 0xF, KIND) * s).to(DT)),
                       [BN, BK])
    else:  # (fields 0..3: join(join(f0, f2), join(f1, f3)) flattens to f0 f1 f2 f3)
        f0 = (decode(b & 0x3, KIND) * s).to(DT)
        f1 = (decode((b >> 2) & 0x3, KIND) * s).to(DT)
        f2 = (decode((b >> 4) & 0x3, KIND) * s).to(DT)
        f3 = (decode((b >> 6) & 0x3, KIND) * s).to(DT)
        w = gl.reshape(gl.join(gl.join(f0, f2), gl.join(f1, f3)), [BN, BK])
    return w


@gluon.jit
def fused_staged(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, row_bytes, nsb, unscale,
                 KIND: gl.constexpr, BITS: gl.constexpr, B: gl.constexpr, HAS_BIAS: gl.constexpr, F16: gl.constexpr,
                 BN: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                 num_warps: gl.constexpr):
    DT: gl.constexpr = gl.float16 if F16 else gl.bfloat16
    PER: gl.constexpr = 8 // BITS
    JB: gl.constexpr = BK // PER
    pid = gl.program_id(0)
    tiles_m = gl.cdiv(M, BM)
    row0 = (pid // tiles_m) * BN
    xrow0 = (pid % tiles_m) * BM

    WGX: gl.constexpr = _x_groups(BN, num_warps)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps // WGX, WGX],
                                                  instr_shape=[16, BM // WGX, 16])
    a_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, BK], DT)
    x_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BK], DT)
    c_shared: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    x_copy: gl.constexpr = _spread(BM, BK, 8, num_warps)  # (16-byte copies)
    c_layout: gl.constexpr = _spread(BN, JB, 16, num_warps)  # (the code bytes: copied and decoded in one layout)

    x_smem = gl.allocate_shared_memory(DT, [STAGES, BM, BK], x_shared)
    c_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, BN, JB], c_shared)
    a_smem = gl.allocate_shared_memory(DT, [2, BN, BK], a_shared)

    xr = xrow0 + gl.arange(0, BM, layout=gl.SliceLayout(1, x_copy))
    xk = gl.arange(0, BK, layout=gl.SliceLayout(0, x_copy))
    x_ptrs = x_ptr + (xr % M).to(gl.int64)[:, None] * K + xk[None, :]
    cr = (row0 + gl.arange(0, BN, layout=gl.SliceLayout(1, c_layout))) % N
    cj = gl.arange(0, JB, layout=gl.SliceLayout(0, c_layout))
    c_ptrs = w_ptr + cr.to(gl.int64)[:, None] * row_bytes + cj[None, :]
    s_ptrs = s_ptr + cr.to(gl.int64) * nsb

    steps = K // BK
    gl.assume(steps > 0)  # (no path around the loop: ptxas then keeps the products in flight, where a
    # zero-trip path's zeroed accumulators made it serialize them)
    for p in gl.static_range(STAGES - 2):
        _async_load(x_smem.index(p), x_ptrs + p * BK)
        _async_load(c_smem.index(p), c_ptrs + p * JB)
        async_copy.commit_group()
    s = scale_slots(s_ptrs, cj, 0, B, BK, PER)
    acc = gl.zeros((BN, BM), dtype=gl.float32, layout=mma)
    for i in range(steps):
        async_copy.wait_group(STAGES - 3)  # (this thread's copies of step i have landed)
        _barrier()  # (every thread's have; every warpgroup waited for its product i - 2)
        b = c_smem.index(i % STAGES).load(c_layout).to(gl.int32)
        a_smem.index(i % 2).store(_fields(b, s, KIND, BITS, BN, BK, DT))
        fence_async_shared()  # (a wait for this thread's memory operations before it: the copies and
        # the scales' loads below are issued after it, to run across the product)
        s = scale_slots(s_ptrs, cj, gl.minimum(i + 1, steps - 1) * BK, B, BK, PER)
        nxt = i + STAGES - 2  # (into the buffers of step i - 2, whose product is done)
        src = gl.minimum(nxt, steps - 1)  # (past the last step: a copy of it into a buffer never read)
        _async_load(x_smem.index(nxt % STAGES), x_ptrs + src * BK)
        _async_load(c_smem.index(nxt % STAGES), c_ptrs + src * JB)
        async_copy.commit_group()
        _barrier()  # (the whole tile stored before any warpgroup's product reads it)
        acc = warpgroup_mma(a_smem.index(i % 2), x_smem.index(i % STAGES).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    async_copy.wait_group(0)

    out_layout: gl.constexpr = gl.BlockedLayout([8, 1], [4, 8], [1, num_warps], [0, 1])  # (y's rows along N)
    out = gl.convert_layout(acc, out_layout) * unscale
    orow = row0 + gl.arange(0, BN, layout=gl.SliceLayout(1, out_layout))
    ocol = xrow0 + gl.arange(0, BM, layout=gl.SliceLayout(0, out_layout))
    if HAS_BIAS:
        out = out + gl.load(b_ptr + orow % N).to(gl.float32)[:, None]
    gl.store(y_ptr + ocol.to(gl.int64)[None, :] * N + orow[:, None], out.to(DT),
             mask=(orow < N)[:, None] & (ocol < M)[None, :])
