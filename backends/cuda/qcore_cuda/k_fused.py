"""The Triton kernels of `fused` (its module text): imported on first use, when Triton reads its
interpreter switch (`TRITON_INTERPRET`).

Two forms of the main loop, `fused.FORM_FIELDS` and `fused.FORM_COLUMNS`; both compute
y [M, N] = x [M, K] @ W^T (+ bias) over tiles of BN weight rows by BM rows of x, K a multiple of
the step BK, rows past N or M read rows inside (their results are not stored), each step's weight
values `round_bf16(decode(code) * e)`; with F16, x, those values and y float16 and the values
`round_f16(decode(code) * e)` of scales e given times 2**p, the sums times `unscale` (2**-p)."""
import triton
import triton.language as tl

from . import fast

I8, I4, I2, E4M3, E5M2 = (tl.constexpr(k) for k in (fast.KIND_I8, fast.KIND_I4, fast.KIND_I2, fast.KIND_E4M3,
                                                    fast.KIND_E5M2))


@triton.jit
def decode(c, KIND: tl.constexpr):
    """Codes (int32, the field's bits) -> their values, f32, exact."""
    if KIND == I8:  # (two's complement: the code offset by 128 in 2**23's mantissa, minus 2**23 + 128)
        v = ((c ^ 0x80) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
    elif KIND == I4:
        v = ((c ^ 0x8) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
    elif KIND == I2:
        v = ((c ^ 0x2) | 0x4B000000).to(tl.float32, bitcast=True) - 8388610.0
    elif KIND == E4M3:  # s eeee mmm, bias 7 (codes S.1111.111 are invalid: checked before)
        e = (c >> 3) & 0xF
        mant = c & 0x7
        normal = (((e + 120) << 23) | (mant << 20)).to(tl.float32, bitcast=True)
        mag = tl.where(e == 0, mant.to(tl.float32) * 0.001953125, normal)  # (subnormals: m * 2**-9)
        v = tl.where((c & 0x80) != 0, -mag, mag)
    elif KIND == E5M2:  # s eeeee mm, bias 15 (exponent 31 is invalid: checked before)
        e = (c >> 2) & 0x1F
        mant = c & 0x3
        normal = (((e + 112) << 23) | (mant << 21)).to(tl.float32, bitcast=True)
        mag = tl.where(e == 0, mant.to(tl.float32) * 0.0000152587890625, normal)  # (m * 2**-16)
        v = tl.where((c & 0x80) != 0, -mag, mag)
    else:  # E2M1: s ee m, bias 1; the f32 bits built whole (e = 0: m * 0.5, 0x3F000000 or 0)
        e = (c >> 1) & 0x3
        bits = tl.where(e == 0, (c & 0x1) * 0x3F000000, ((e + 126) << 23) | ((c & 0x1) << 22))
        v = (bits | ((c & 0x8) << 28)).to(tl.float32, bitcast=True)
    return v


@triton.jit
def to_bf16(v, INTERPRETED: tl.constexpr):
    """f32 -> bfloat16, nearest even (finite v). The interpreter's own cast cuts toward zero, so
    there the rounding is done on the bits."""
    if INTERPRETED:
        u = v.to(tl.uint32, bitcast=True)
        u = u + 0x7FFF + ((u >> 16) & 1)
        r = (u >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        r = v.to(tl.bfloat16)
    return r


@triton.jit
def to_half(v, F16: tl.constexpr, INTERPRETED: tl.constexpr):
    """f32 -> float16 (F16) or bfloat16, nearest even (finite v; float16: numpy's cast under the
    interpreter, which rounds to nearest even)."""
    if F16:
        r = v.to(tl.float16)
    else:
        r = to_bf16(v, INTERPRETED)
    return r


@triton.jit
def dot(a, b, acc, INTERPRETED: tl.constexpr):
    """acc + a @ b, f32 sums of exact products of bfloat16 (or float16) values. The interpreter's
    bfloat16 `tl.dot` gives wrong sums, so there the same products run in f32."""
    if INTERPRETED:
        r = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        r = tl.dot(a, b, acc)
    return r


@triton.jit
def tile(M, N, BN: tl.constexpr, BM: tl.constexpr):
    """This program's weight rows and x rows, and the same clamped inside N and M (the rows
    past an edge read rows inside; their results are not stored). Programs that share a weight
    tile are consecutive, so they run together."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BM)
    rows = (pid // tiles_m) * BN + tl.arange(0, BN)
    xrows = (pid % tiles_m) * BM + tl.arange(0, BM)
    return rows, xrows, rows % N, xrows % M


@triton.jit
def scale_slots(s_ptrs, cj, k0, B: tl.constexpr, BK: tl.constexpr, PER: tl.constexpr):
    """The f32 scale slots of the step at column k0, for the code bytes' rows (`s_ptrs`) and byte
    columns (`cj`, each byte's first within the step): one a row (per row, or a block covering the
    step), two a row (blocks of half a step: byte j lies in the first for PER * j < B), or each
    byte's own (smaller blocks); broadcastable to the bytes' tile. (Also the staged form's, whose
    Gluon kernel calls it.)"""
    if B == 0:
        s = tl.load(s_ptrs)[:, None]
    elif B >= BK:
        s = tl.load(s_ptrs + k0 // B)[:, None]
    elif B * 2 == BK:
        s = tl.where(cj[None, :] * PER < B, tl.load(s_ptrs + k0 // B)[:, None], tl.load(s_ptrs + k0 // B + 1)[:, None])
    else:
        s = tl.load(s_ptrs[:, None] + ((k0 + cj * PER) // B)[None, :])
    return s


@triton.jit
def fused_fields(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, row_bytes, nsb, unscale,
                 KIND: tl.constexpr, BITS: tl.constexpr, B: tl.constexpr, HAS_BIAS: tl.constexpr, F16: tl.constexpr,
                 BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, INTERPRETED: tl.constexpr):
    """`FORM_FIELDS`: a step's code bytes [BN, BK / PER] are loaded once (contiguous, pipelined);
    field f of every byte (columns k0 + PER * j + f) is the A operand of its own product, against
    x's tile [BK / PER, BM] of the same columns (x given with each step's columns grouped by field:
    `fused.FusedLaunch`). A step reads one scale slot a row, or two (BK = 2 * B)."""
    PER: tl.constexpr = 8 // BITS
    J: tl.constexpr = BK // PER
    rows, xrows, rn, rm = tile(M, N, BN, BM)
    jj = tl.arange(0, J)
    w_ptrs = w_ptr + rn[:, None] * row_bytes + jj[None, :]
    x_ptrs = x_ptr + rm[None, :] * K + jj[:, None]
    s_ptrs = s_ptr + rn * nsb
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for k0 in range(0, K, BK):
        b = tl.load(w_ptrs).to(tl.int32)
        s = scale_slots(s_ptrs, jj, k0, B, BK, PER)  # (BK <= 2 * B: `fused.step_for`)
        for f in tl.static_range(PER):
            if BITS == 8:
                c = b
            else:
                c = (b >> (f * BITS)) & ((1 << BITS) - 1)
            acc = dot(to_half(decode(c, KIND) * s, F16, INTERPRETED), tl.load(x_ptrs + f * J), acc, INTERPRETED)
        w_ptrs += J
        x_ptrs += BK
    acc = acc * unscale
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn).to(tl.float32)[:, None]
    tl.store(y_ptr + xrows.to(tl.int64)[None, :] * N + rows[:, None], to_half(acc, F16, INTERPRETED),
             mask=(rows < N)[:, None] & (xrows < M)[None, :])


@triton.jit
def fused_columns(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, row_bytes, nsb, unscale,
                  KIND: tl.constexpr, BITS: tl.constexpr, B: tl.constexpr, HAS_BIAS: tl.constexpr, F16: tl.constexpr,
                  BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, INTERPRETED: tl.constexpr):
    """`FORM_COLUMNS`: x's tile [BM, BK] is the A operand and the weight's [BK, BN], in column
    order, the B operand: each element loads its code's byte and shifts its field out. Any step
    (scale slots of 16 columns included)."""
    PER: tl.constexpr = 8 // BITS
    rows, xrows, rn, rm = tile(M, N, BN, BM)
    kk = tl.arange(0, BK)
    w_ptrs = w_ptr + rn[None, :] * row_bytes + (kk // PER)[:, None]
    shift = ((kk % PER) * BITS)[:, None]
    x_ptrs = x_ptr + rm[:, None] * K + kk[None, :]
    if B == 0 or BK <= 2 * B:
        s_ptrs = s_ptr + rn * nsb
    else:
        s_ptrs = s_ptr + rn[None, :] * nsb + (kk // B)[:, None]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        b = tl.load(w_ptrs).to(tl.int32)
        if BITS == 8:
            c = b
        else:
            c = (b >> shift) & ((1 << BITS) - 1)
        if B == 0:
            s = tl.load(s_ptrs)[None, :]
        elif B >= BK:
            s = tl.load(s_ptrs + k0 // B)[None, :]
        elif BK == 2 * B:  # (two slots a step: one load of each, the first for k < B)
            s = tl.where(kk[:, None] < B, tl.load(s_ptrs + k0 // B)[None, :], tl.load(s_ptrs + k0 // B + 1)[None, :])
        else:
            s = tl.load(s_ptrs)
            s_ptrs += BK // B
        acc = dot(tl.load(x_ptrs), to_half(decode(c, KIND) * s, F16, INTERPRETED), acc, INTERPRETED)
        w_ptrs += BK // PER
        x_ptrs += BK
    acc = acc * unscale
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn).to(tl.float32)[None, :]
    tl.store(y_ptr + xrows.to(tl.int64)[:, None] * N + rows[None, :], to_half(acc, F16, INTERPRETED),
             mask=(xrows < M)[:, None] & (rows < N)[None, :])
