"""The Triton kernel quantizing bfloat16 activations per row to E4M3 (W8A8 `linear`'s x; imported
on first use, when Triton reads its interpreter switch `TRITON_INTERPRET`).

The spec's quantize of `x.float()` under `e4m3/block{B}:f32` with B >= K (one slot a row), the
bytes `WideQuantize`'s kernel writes with `wait=False`: m = max |x| of the row, its scale
e = RN(m / h) (f32: stored as is), each code RN_e4m3(RN(x / e)) saturated at the largest value
(a zero keeps x's sign), every code 0 where e is 0. A row holding a non-finite x gets codes 0 and
a NaN scale (docs/spec.md, quantized activations: its products are NaN)."""
import triton
import triton.language as tl


@triton.jit
def e4m3_bits(y):
    """RN_e4m3(y) saturated at 448 (finite y), the code's bits as int32: exponent and top three
    fraction bits of f32 rounded to nearest even on the bits; below 2**-6 the subnormal's
    fraction m = RN(|y| * 2**9) by adding 2**23. What `cvt.rn.satfinite.e4m3x2.f32` gives, in
    operations the interpreter runs as the GPU does."""
    u = y.to(tl.uint32, bitcast=True)
    sign = ((u >> 24) & 0x80).to(tl.int32)
    a = tl.minimum(tl.abs(y), 448.0)
    au = a.to(tl.uint32, bitcast=True)
    normal = (((au + 0x7FFFF + ((au >> 20) & 1)) >> 20) - 960).to(tl.int32)
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    return sign | tl.where(a < 0.015625, sub, normal)


@triton.jit
def act_rows_e4m3(x_ptr, codes_ptr, scales_ptr, K, h, BLOCK: tl.constexpr, INTERPRETED: tl.constexpr):
    """Row `program_id` of x [rows, K] (bfloat16, K <= BLOCK: the row read once, held in
    registers) into codes [rows, K] (`*fp8e4nv`, or `*u8` INTERPRETED: then coded on the bits)
    and scales [rows] (f32)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(x_ptr + row * K + offs, mask=mask, other=0.0).to(tl.float32)
    a = tl.abs(x)
    m = tl.max(tl.where(a == a, a, float("inf")), axis=0)  # (infinite for a NaN or an infinity)
    bad = m == float("inf")
    e = tl.where(bad, 0.0, tl.math.div_rn(m, h))
    tl.store(scales_ptr + row, tl.where(bad, float("nan"), e))
    ez = e == 0.0
    y = tl.where(ez, 0.0, tl.math.div_rn(x, tl.where(ez, 1.0, e)))
    if INTERPRETED:
        tl.store(codes_ptr + row * K + offs, e4m3_bits(y).to(tl.uint8), mask=mask)
    else:
        tl.store(codes_ptr + row * K + offs, y.to(tl.float8e4nv), mask=mask)
