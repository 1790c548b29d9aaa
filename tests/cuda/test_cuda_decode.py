"""`linear` of the `cuda` backend at a few rows of x: the decode kernel (`qcore_cuda/k_decode.py`,
the path `DecodeLinear`) for every value kind it decodes, per-tensor scales, blocks of 16, 32, 64,
128 and at least K, a two-level weight, M = 1 up to its largest variant, K of one unit up to
several staged segments, odd N, bfloat16 / float16 / float32 x, with and without a bias, each
result dtype.

Every result lies within docs/spec.md's products' bound and repeats bit for bit. Where the
kernel's order of operations fixes the bits they are checked too: a row of x gives the same f32
sums alone and among other rows (each row's sums are its own, in the same order, whatever the
variant or the number of staged segments), and a float16 / bfloat16 result is the float32
result rounded once."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from qcore.backend.reference import ReferenceBackend

from tests.cuda_cases import SIM
from tests.cuda_cases import bits as _bits, host as _host, taken as _taken, within_bound as _within_bound

REF = ReferenceBackend()
BF16 = np.dtype(ml_dtypes.bfloat16)
XDT = {"bf16": BF16, "f16": np.dtype(np.float16), "f32": np.dtype(np.float32)}
# every value kind the kernel decodes; per-tensor, blocks of 16 / 32 / 64 / 128 (4-bit codes under
# blocks of 16: two slots a unit, the `split` variant), a block of at least K (per row), two-level
# (E2M1 under UE4M3 blocks of 32 and an f32 global; nvfp4's blocks of 16), MX
SCHEMES = ["q4s/block32:f16", "q4f/block64:bf16", "q8s", "q8f/block128:f32", "e4m3/block32:f32", "e5m2",
           "mxfp8", "mxfp4", "e2m1/block32:ue4m3/tensor:f32", "q4s/block4096:f16", "q8s/block32:ue8m0", "q4_0",
           "nvfp4", "q4s/block16:f16", "q8s/block16:bf16"]


@pytest.fixture(autouse=True)
def every_variant(monkeypatch):
    """The decode path at every M it has a variant for (1..4), whatever the default (the
    tensor-core decode path, tests/cuda/test_cuda_decode_mma.py, off)."""
    from qcore_cuda import k_decode
    from qcore_cuda.paths import linear as paths_linear

    monkeypatch.setattr(paths_linear, "DECODE_MAX_M", k_decode.MBS[-1])
    monkeypatch.setattr(paths_linear, "MMA_DECODE_MAX_M", 0)


def _weight(n, k, seed=0):
    return np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)


def _x(m, k, dt, seed=1):
    return np.random.default_rng(seed).standard_normal((m, k)).astype(dt)


# (scheme, x type, M, bias): on the simulator the x types, M and the bias in turn over the schemes
_MS = [1, 2, 3, 4]
_CASES = [(t, xt, _MS[(i + j) % 4], (i + j) % 2 == 0) for i, t in enumerate(SCHEMES)
          for j, xt in enumerate(XDT)] if SIM else \
    [(t, xt, m, b) for t in SCHEMES for xt in XDT for m in _MS for b in (False, True)]


@pytest.mark.parametrize("text,xt,m,bias", _CASES)
def test_decode_linear(cuda_backend, text, xt, m, bias):
    """Within the bound (odd N: a row group of one row), the decode path taken, the same bits
    again on a repeat call."""
    be = cuda_backend
    n, k = (7, 96) if SIM else (203, 1024)
    w = _weight(n, k)
    q = be.quantize(w, text)
    W = np.asarray(REF.dequantize(REF.quantize(w, text)), np.float64)
    x = _x(m, k, XDT[xt])
    b = _x(1, n, np.float32, 2)[0] if bias else None
    before = _taken("DecodeLinear")
    y = _host(be, be.linear(x, q, b))
    assert _taken("DecodeLinear") == before + 1
    assert y.dtype == XDT[xt] and y.shape == (m, n)
    _within_bound(x, W, b, y)
    assert np.array_equal(_bits(_host(be, be.linear(x, q, b))), _bits(y))


# 2-bit codes: a unit of 64 codes under four slots (blocks of 16), two (32) or one (128, per tensor);
# M = 1, 2 (the simulator's shared memory holds two rows of a 2048-column group)
_CASES_2BIT = [(t, xt, 1 + i % 2, i % 2 == 1) for i, (t, xt) in enumerate(
    [("q2f/block16:f16", "bf16"), ("q2s/block32:bf16", "f16"), ("q2s/block128:f32", "f32"), ("q2s", "bf16")])]


@pytest.mark.parametrize("text,xt,m,bias", _CASES_2BIT)
def test_decode_linear_two_bit(cuda_backend, text, xt, m, bias):
    """2-bit weights on the decode path: within the bound, the same bits again."""
    be = cuda_backend
    n, k = (5, 2112) if SIM else (203, 4160)  # (a whole group of 2048 columns and a tail)
    w = _weight(n, k, 21)
    q = be.quantize(w, text)
    W = np.asarray(REF.dequantize(REF.quantize(w, text)), np.float64)
    x = _x(m, k, XDT[xt], 22)
    b = _x(1, n, np.float32, 23)[0] if bias else None
    before = _taken("DecodeLinear")
    y = _host(be, be.linear(x, q, b))
    assert _taken("DecodeLinear") == before + 1
    _within_bound(x, W, b, y)
    assert np.array_equal(_bits(_host(be, be.linear(x, q, b))), _bits(y))


def test_two_bit_rows_not_16_byte_aligned_take_the_tensor_core_kernel(cuda_backend):
    """The decode kernel reads 16 bytes of a row at a time, so every row must start on 16 bytes:
    2-bit codes with K = 96 (24 bytes a row) take the tensor-core kernel at M = 1, K = 128 the
    decode kernel; both within the bound."""
    be = cuda_backend
    for k, path in ((96, "TensorCoreLinear"), (128, "DecodeLinear")):
        w = _weight(5, k, 41)
        q = be.quantize(w, "q2s/block32:f16")
        x = _x(1, k, BF16, 42)
        before = _taken(path)
        y = _host(be, be.linear(x, q))
        assert _taken(path) == before + 1, (k, path)
        _within_bound(x, np.asarray(REF.dequantize(REF.quantize(w, "q2s/block32:f16")), np.float64), None, y)


@pytest.mark.parametrize("text", ["q4s/block32:f16", "q8s/block64:f16", "e2m1/block32:ue8m0"])
@pytest.mark.parametrize("k", [32, 64, 1056] + ([] if SIM else [2080, 8192, 8224, 20000 // 32 * 32]))
def test_k_from_one_unit_to_several_segments_and_rows_alone_or_together(cuda_backend, text, k):
    """K of one 16-byte unit (32: one lane of 4-bit codes, two of 8-bit), two, and past a
    warp's group (1056 = 1024 + 32 for 4-bit codes: a whole U-step and a tail; for 8-bit a step of
    512 and more); on a GPU past one staged segment too. Each row of x gives the same f32 bits
    alone (M = 1) as among four (M = 4: another variant, and on the simulator from 1024 columns
    two staged segments), and a float16 / bfloat16 result is that f32 result rounded once."""
    be = cuda_backend
    n = 5
    w = _weight(n, k, 3)
    q = be.quantize(w, text)
    W = np.asarray(REF.dequantize(REF.quantize(w, text)), np.float64)
    x = _x(4, k, BF16, 4)
    b = _x(1, n, np.float32, 5)[0]
    before = _taken("DecodeLinear")
    y4 = _host(be, be.linear(x, q, b, dtype=np.float32))
    _within_bound(x, W, b, y4)
    for i in (0, 3):
        y1 = _host(be, be.linear(x[i:i + 1], q, b, dtype=np.float32))
        assert np.array_equal(_bits(y1[0]), _bits(y4[i])), (text, k, i)
    yb = _host(be, be.linear(x, q, b))
    assert yb.dtype == BF16 and np.array_equal(_bits(yb), _bits(y4.astype(BF16)))
    yh = _host(be, be.linear(x[:2], q, b, dtype=np.float16))
    assert np.array_equal(_bits(yh), _bits(y4[:2].astype(np.float16)))
    assert _taken("DecodeLinear") == before + 5


def test_segments_on_the_simulator_are_real(cuda_backend):
    """The simulator's shared memory holds 4 x 1024 columns: at M = 4 a 4-bit weight of 1056
    columns is staged in two segments (the test above then compares it with one segment)."""
    from qcore_cuda import fast, k_decode

    if not SIM:
        pytest.skip("the simulator's segment size")
    assert k_decode.segment(fast.KIND_I4, 1056, 4) == 1024 < 1056
    assert k_decode.segment(fast.KIND_I4, 1056, 1) == 2048


def test_only_a_few_rows_take_the_decode_path(cuda_backend, monkeypatch):
    """Past `DECODE_MAX_M` rows (and past the largest variant) the tensor-core kernel; with
    DECODE_MAX_M = 0 none; weights the kernel does not read (blocks over the flattened tensor
    across rows, affine offsets) the transposed matmul at any M."""
    from qcore_cuda import k_decode
    from qcore_cuda.paths import linear as paths_linear

    be = cuda_backend
    q = be.quantize(_weight(6, 64), "q4s/block32:f16")
    top = min(paths_linear.DECODE_MAX_M, k_decode.MBS[-1])
    for m, path in ((top, "DecodeLinear"), (top + 1, "TensorCoreLinear")):
        before = _taken(path)
        be.linear(_x(m, 64, np.float16), q)
        assert _taken(path) == before + 1, (m, path)
    monkeypatch.setattr(paths_linear, "DECODE_MAX_M", 0)
    before = _taken("TensorCoreLinear")
    be.linear(_x(1, 64, np.float16), q)
    assert _taken("TensorCoreLinear") == before + 1
    monkeypatch.undo()
    for text in ("q4s/block128:f16:flat", "q4_1"):
        before = _taken("TransposedLinear")
        be.linear(_x(1, 64, np.float32), be.quantize(_weight(6, 64), text))
        assert _taken("TransposedLinear") == before + 1, text


def test_zero_codes_sum_to_zero_and_x_is_read_exactly(cuda_backend):
    """A row of zero codes under a nonzero scale gives exactly the bias (each code is decoded to
    its exact value before the multiply); x of one nonzero column picks that column's weight
    times x exactly (the products are exact), in each x type."""
    be = cuda_backend
    n, k = 4, 64
    w = _weight(n, k, 7)
    w[1] = 0.0
    w[2, :32] = 0.0  # (a zero block among nonzero ones)
    q = be.quantize(w, "q4s/block32:f16")
    W = np.asarray(REF.dequantize(REF.quantize(w, "q4s/block32:f16")), np.float32)
    b = np.array([0.5, -1.25, 2.0, 0.0], np.float32)
    for dt in XDT.values():
        x = np.zeros((1, k), dt)
        x[0, 37] = 3
        y = _host(be, be.linear(x, q, b, dtype=np.float32))
        assert y[0, 1] == b[1]
        assert np.array_equal(y[0], (W[:, 37] * np.float32(3) + b).astype(np.float32)), dt


# (WARPS, U, RW) against the default (the simulator's 2, 2, 2): one unit a step, one row a warp
_TUNE = (2, 1, 1)


# (scheme, K, another tuning too): f16 and bf16 slots (the stored scales; q4_0's signed, blocks of
# 16's two slots a unit), UE8M0 slots and a two-level weight (the f32 scales)
_STORED16 = {"q4s/block32:f16": "SC_F16", "q8s/block64:bf16": "SC_BF16", "q4_0": "SC_F16", "q4s/block16:f16": "SC_F16"}
_FORM_CASES = [("q4s/block32:f16", 1056, True), ("q8s/block64:bf16", 64, True), ("q8s/block64:bf16", 1056, False),
               ("q4_0", 1056, False), ("q4s/block16:f16", 1056, False), ("e2m1/block32:ue8m0", 1056, False),
               ("mxfp8", 1056, False), ("e2m1/block32:ue4m3/tensor:f32", 1056, False)]


@pytest.mark.parametrize("text,k,tuned", _FORM_CASES)
def test_tunings_and_scale_forms_give_the_default_bits(cuda_backend, monkeypatch, text, k, tuned):
    """The kernel reads the stored f16 / bf16 scale words exactly where the weight is one-level
    with 16-bit slots (`scale_form`), else the f32 scales; the stored words give the f32 scales'
    bits (subnormal scales included), in each x type, with a bias, at M = 1 and up to K = 1056 at
    M = 4 (on the simulator two staged segments at K = 1056: 8-bit codes two whole steps of one
    unit in each). Another tuning (`k_decode.tune()`: U units a step, RW rows a warp) adds the
    same terms in the same order: the same bits."""
    from qcore_cuda import k_decode

    if not SIM:
        pytest.skip("the simulator's variants (a GPU compiles the tuning of its environment)")
    be = cuda_backend
    forms = []
    compiled = k_decode.kernel
    monkeypatch.setattr(k_decode, "kernel", lambda kind, xt, mb, sc=k_decode.SC_F32, nh=1:
                        forms.append(sc) or compiled(kind, xt, mb, sc, nh))
    n = 5
    w = _weight(n, k, 11)
    w[3] *= np.float32(1e-5)  # (subnormal f16 scales)
    w[4, : k // 2] *= np.float32(3e-37)  # (subnormal bf16 scales, zero f16 ones)
    b = _x(1, n, np.float32, 12)[0]
    xs = {xt: _x(4, k, dt, 13) for xt, dt in XDT.items()}

    def run(tn, form):
        for name, v in zip(("WARPS", "U", "RW"), tn):
            monkeypatch.setattr(k_decode, name, v)
        q = be.quantize(w, text)  # (a fresh weight: the packed launch is kept with it)
        before = _taken("DecodeLinear")
        out = [_bits(_host(be, be.linear(x[:1], q, b, dtype=np.float32))) for x in xs.values()]
        if k <= 1056:
            out.append(_bits(_host(be, be.linear(xs["bf16"], q, b, dtype=np.float32))))
        out.append(_bits(_host(be, be.linear(xs["f16"][:1], q, b))))
        assert _taken("DecodeLinear") == before + len(out)
        assert forms == [form] * len(out), (text, tn)
        forms.clear()
        return out

    stored = getattr(k_decode, _STORED16.get(text, "SC_F32"))
    default = k_decode.tune()
    want = run(default, stored)
    if tuned:
        got = run(_TUNE, stored)
        for i, (g, e) in enumerate(zip(got, want)):
            assert np.array_equal(g, e), (text, k, _TUNE, i)
    if stored != k_decode.SC_F32:  # the same weight through its decoded f32 scales
        monkeypatch.setattr(k_decode, "scale_form", lambda scheme, soff: k_decode.SC_F32)
        got = run(default, k_decode.SC_F32)
        for i, (g, e) in enumerate(zip(got, want)):
            assert np.array_equal(g, e), (text, k, "f32 scales", i)


@pytest.mark.parametrize("text,n,k,ms", [
    ("q4s/block32:f16", 9, 4096, (1, 4)),  # one segment at M = 1, four at M = 4; two rounds, whole steps
    ("q8s/block32:f16", 12, 1056, (1, 4)),  # units left over after the steps (and fewer than a step)
    ("q4s/block32:f16", 5, 5120, (1,)),  # two staged segments at M = 1 (the simulator's 4096 floats of x)
    ("q2s/block32:f16", 10, 2048, (1, 2)),  # 2-bit units (64 codes; the simulator's decode path to M = 2)
])
def test_the_staging_order_gives_the_same_bits(cuda_backend, monkeypatch, text, n, k, ms):
    """`k_decode.LANES` (x staged by lane groups, 16-byte shared stores) or not (consecutive
    units): the same floats of x in the same places, so the same bits, at one row of x and more."""
    from qcore_cuda import k_decode

    be = cuda_backend
    w = _weight(n, k, 21)
    x = _x(4, k, BF16, 22)
    got = {}
    for lanes in (False, True):
        monkeypatch.setattr(k_decode, "LANES", lanes)
        q = be.quantize(w, text)  # (a fresh weight: the packed launch is kept with it)
        before = _taken("DecodeLinear")
        got[lanes] = [_bits(_host(be, be.linear(x[:m], q, dtype=np.float32))) for m in ms]
        assert _taken("DecodeLinear") == before + len(ms)
    for a, b in zip(got[False], got[True]):
        assert np.array_equal(a, b), text


def test_the_grid_takes_the_blocks_an_sm_holds(monkeypatch):
    """`k_decode.per_sm`: the persistent grid's blocks a SM are as many as its registers (at the
    cap `REGS` a thread), shared memory (x's `XS` floats a block) and warps hold: two 8-warp blocks
    at 128 registers, four 4-warp ones, six at 80 registers (shared memory's limit too)."""
    from qcore_cuda import k_decode

    monkeypatch.setattr(k_decode, "XS", 8192)
    for warps, regs, want in ((8, 128, 2), (4, 128, 4), (4, 80, 6), (2, 64, 6), (8, 80, 3)):
        monkeypatch.setattr(k_decode, "WARPS", warps)
        monkeypatch.setattr(k_decode, "REGS", regs)
        assert k_decode.per_sm() == want, (warps, regs)
