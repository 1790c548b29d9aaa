"""`linear` of the `cuda` backend (a weight [N, K] as checkpoints store it): the tensor-core kernel
(`qcore_cuda/linear.py`) for every value kind it decodes and each x type, M from 1 past the
n8 tile switch, odd N, the fallback for other layouts, bias, result dtypes, `out=`, device and
torch inputs; every result within docs/spec.md's products' bound, the tensor-core results bit
for bit the same from call to call."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from qcore.conformance.checks import product_bound
from qcore.errors import InputError
from qcore.spec.schemes import scheme as parse_scheme
from qcore.backend.reference import ReferenceBackend

from tests.cuda_cases import SIM

from numba import cuda  # noqa: E402  (conftest.py has set the simulator mode)

REF = ReferenceBackend()
BF16 = np.dtype(ml_dtypes.bfloat16)
XDT = {"bf16": BF16, "f16": np.dtype(np.float16), "f32": np.dtype(np.float32)}
# blocks of 16 (nvfp4, q4s/block16, q8s/block16, q2f/block16): two scale slots a chunk, the `split`
# variants; 2-bit codes widened to 4-bit ones as they are loaded
TC_SCHEMES = ["q4s/block32:f16", "q4f/block64:bf16", "q8s", "q8f/block32:f32", "e4m3/block32:f32", "e5m2", "mxfp8",
              "mxfp4", "q4_0", "q8s/block128:ue8m0", "nvfp4", "q4s/block16:f16", "q8s/block16:f32", "q2s/block32:f16",
              "q2f/block16:bf16", "q2s"]
OTHER_SCHEMES = ["q4_1", "q8s/block48:f32", "q4s/block128:f16:flat"]  # (flat blocks across rows)


def _weight(n, k, seed=0):
    return np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)


def _x(m, k, dt, seed=1):
    return np.random.default_rng(seed).standard_normal((m, k)).astype(dt)


def _host(be, y):
    return y if isinstance(y, np.ndarray) else be.to_numpy(y)


def _check(be, text, n, k, m, xt, bias=True, seed=0):
    w = _weight(n, k, seed)
    q = be.quantize(w, text)
    W = np.asarray(REF.dequantize(REF.quantize(w, text)), np.float64)
    x = _x(m, k, XDT[xt], seed + 1)
    b = _x(1, n, np.float32, seed + 2)[0] if bias else None
    y = _host(be, be.linear(x, q, b))
    assert y.dtype == XDT[xt] and y.shape == (m, n)
    exact, bound = product_bound(x, W, b, y.dtype)
    err = np.abs(y.astype(np.float64) - exact)
    assert (err <= bound).all(), f"{text} {xt} M={m}: max err {err.max()} (bound there {bound.flat[err.argmax()]})"
    return q, x, b, y


def _paths():
    from qcore_cuda.paths import TAKEN

    return dict(TAKEN)


# (scheme, x type, M): on the simulator a Latin square over the three x types and M in {1, 9, 17}
# (one, two and four n8 tiles of x);
# on a GPU every combination and more M.
_MS = [1, 9, 17] if SIM else [1, 5, 8, 9, 16, 17, 31, 33, 100]
_TC_CASES = ([(t, xt, _MS[(i + j) % 3]) for i, t in enumerate(TC_SCHEMES) for j, xt in enumerate(XDT)] if SIM
             else [(t, xt, m) for t in TC_SCHEMES for xt in XDT for m in _MS])


@pytest.mark.parametrize("text,xt,m", _TC_CASES)
def test_tensor_core_linear(cuda_backend, text, xt, m, monkeypatch):
    """The kernel's results lie within the bound (odd N: a partial 16-row tile), take the
    tensor-core path (at every M: the decode paths, k_decode.py and k_decode_mma.py, turned off), and repeat bit for
    bit."""
    from qcore_cuda.paths import linear as paths_linear

    monkeypatch.setattr(paths_linear, "DECODE_MAX_M", 0)
    monkeypatch.setattr(paths_linear, "MMA_DECODE_MAX_M", 0)
    before = _paths().get("TensorCoreLinear", 0)
    n, k = (20, 64) if SIM else (200, 1024)
    q, x, b, y = _check(cuda_backend, text, n, k, m, xt)
    assert _paths().get("TensorCoreLinear", 0) > before
    again = _host(cuda_backend, cuda_backend.linear(x, q, b))
    assert np.array_equal(again.view(np.uint8), y.view(np.uint8))


@pytest.mark.parametrize("text,m", [("q4f/block64:bf16", 9), ("q8s/block64:f16", 2)])
def test_a_rows_last_block_may_be_partial(cuda_backend, text, m):
    """K = 96 under blocks of 64: each row has two scale slots, the second over 32 columns
    (the tensor-core kernel at M = 9, the decode kernel at M = 2)."""
    _check(cuda_backend, text, 7, 96, m, "f32")


@pytest.mark.parametrize("text", OTHER_SCHEMES)
def test_other_layouts_take_the_transposed_matmul(cuda_backend, text):
    before = _paths().get("TransposedLinear", 0)
    _check(cuda_backend, text, 20, 64, 3, "bf16")
    assert _paths().get("TransposedLinear", 0) > before


@pytest.mark.parametrize("text", ["nvfp4", "q4s/block32:f16", "q4s/block32:f16/packed_native/order:high"])
def test_linear_after_new_bytes_go_into_the_weight(cuda_backend, text):
    """`quantize(..., out=q)` into a weight `linear` has read (its kernels' arrays made): the next
    `linear` gives the bits a fresh tensor of the new values gives (a two-level weight's effective
    scales, a field-order copy, decoded again)."""
    be = cuda_backend
    x = _x(4, 64, np.float32)
    q = be.quantize(_weight(32, 64, seed=2), text)
    be.linear(x, q)
    w2 = _weight(32, 64, seed=3) * np.float32(100.0)
    assert be.quantize(w2, text, out=q) is q
    assert np.array_equal(_host(be, be.linear(x, q)), _host(be, be.linear(x, be.quantize(w2, text))))


def test_k_not_a_multiple_of_32_and_k_zero(cuda_backend):
    _check(cuda_backend, "q8s/block16:f32", 12, 48, 2, "f16")
    q = cuda_backend.quantize(np.zeros((5, 0), np.float32), "q8s")
    b = np.arange(5, dtype=np.float32)
    y = _host(cuda_backend, cuda_backend.linear(np.zeros((2, 0), np.float32), q, b))
    assert np.array_equal(y, np.tile(b, (2, 1)))


def test_dtype_out_and_device_inputs(cuda_backend):
    be = cuda_backend
    q = be.quantize(_weight(24, 64), "q4s/block32:f16")
    x = _x(3, 64, np.float16)
    want = _host(be, be.linear(x, q))
    xd = cuda.to_device(x)
    y = be.linear(xd, q)
    assert np.array_equal(_host(be, y), want)  # a device x: a device result of x's dtype
    y32 = _host(be, be.linear(xd, q, dtype=np.float32))
    assert y32.dtype == np.float32 and np.array_equal(y32.astype(np.float16), want)
    out = cuda.device_array((3, 24), np.float32)
    assert be.linear(xd, q, out=out) is out and np.array_equal(out.copy_to_host(), y32)
    yb = be.linear(x, q, dtype=BF16)
    assert isinstance(yb, np.ndarray) and yb.dtype == BF16  # bfloat16 without torch: a host array
    y64 = _host(be, be.linear(x, q, dtype=np.float64))
    assert y64.dtype == np.float64 and np.array_equal(y64, y32.astype(np.float64))
    assert _host(be, be.matmul(x, be.transpose(q), dtype=np.float16)).dtype == np.float16


@pytest.mark.parametrize(("call", "match"), [
    (lambda be, q: be.linear(np.zeros((2, 63), np.float32), q), "x's last axis must be K = 64"),
    (lambda be, q: be.linear(np.zeros((2, 64), np.int8), q), "activations"),
    (lambda be, q: be.linear(np.zeros((2, 64), np.float32), q, np.zeros(3, np.float32)), "bias of shape"),
    (lambda be, q: be.linear(np.zeros((2, 64), np.float32), q, out=cuda.device_array((2, 8), np.float16),
                             dtype=np.float32), "out= has dtype float16"),
    (lambda be, q: be.linear(np.zeros((2, 64), np.float32), q, out=np.zeros((2, 8), np.float32)), "device array"),
])
def test_errors(cuda_backend, call, match):
    q = cuda_backend.quantize(_weight(8, 64), "q8s/block32:f16")
    with pytest.raises(InputError, match=match):
        call(cuda_backend, q)


def test_a_bad_code_is_invalid_data_not_a_value(cuda_backend):
    from qcore.errors import InvalidDataError
    from qcore.spec.payload import QuantizedData

    d = REF.into_data(REF.quantize(_weight(4, 32), "q8s"))
    bad = bytearray(d.payload)
    bad[5] = 0x80  # -128: outside Q8S's codes
    q = cuda_backend.from_data(QuantizedData(d.shape, d.scheme, bytes(bad)))
    with pytest.raises(InvalidDataError, match=r"\(0, 5\)"):
        cuda_backend.linear(np.ones((1, 32), np.float32), q)


@pytest.mark.skipif(SIM, reason="torch CUDA tensors need a GPU")
def test_torch_in_torch_out(cuda_backend):
    torch = pytest.importorskip("torch")
    be = cuda_backend
    q = be.quantize(_weight(256, 512), "q4s/block32:f16")
    x = torch.randn(4, 512, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(256, dtype=torch.bfloat16, device="cuda")
    y = be.linear(x, q, b)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16 and y.is_cuda
    host = x.float().cpu().numpy().astype(BF16)
    want = _host(be, be.linear(host, q, b.float().cpu().numpy()))
    assert np.array_equal(y.view(torch.int16).cpu().numpy(), want.view(np.int16))
    out = torch.empty(4, 256, dtype=torch.bfloat16, device="cuda")
    assert be.linear(x, q, b, out=out) is out and torch.equal(out, y)


@pytest.mark.skipif(SIM, reason="torch CUDA tensors need a GPU")
@pytest.mark.parametrize("dt", ["bfloat16", "float16", "float32"])
def test_repeat_calls_skip_the_path_choice_and_give_the_same_bits(cuda_backend, dt):
    """A repeat call (decode and tensor-core kernels: M = 1 and 3) chooses no path, launches the
    packed kernel with plain addresses (one raw launch), and gives the whole way's bits for new x,
    with and without a bias, into a new tensor or `out=`."""
    pytest.importorskip("torch")
    q = cuda_backend.quantize(_weight(128, 256), "q8s/block32:f16")
    for m in (1, 3):
        _repeat_case(cuda_backend, q, dt, m)


def _repeat_case(be, q, dt: str, m: int) -> None:
    """The test above for m rows of x."""
    import torch
    from qcore_cuda._launch import COUNTS
    from qcore_cuda.paths import TAKEN

    x = torch.randn(m, 256, dtype=getattr(torch, dt), device="cuda")
    b = torch.randn(128, dtype=torch.float32, device="cuda")
    for bias in (None, b):
        first = be.linear(x, q, bias)
        taken, raw = sum(TAKEN.values()), COUNTS["raw"]
        again = be.linear(x, q, bias)
        assert sum(TAKEN.values()) == taken  # the repeat call chose no path
        assert COUNTS["raw"] == raw + 1  # (one launch, of the C argument array)
        assert again.dtype == first.dtype and torch.equal(again, first)
        x2 = torch.randn(m, 256, dtype=getattr(torch, dt), device="cuda")
        want = be.linear(x2.cpu().numpy() if dt != "bfloat16" else x2.float().cpu().numpy().astype(BF16), q,
                         None if bias is None else bias.cpu().numpy())
        got = be.linear(x2, q, bias)  # new data through the repeat path
        assert np.array_equal(got.cpu().view(torch.int16 if dt != "float32" else torch.int32).numpy(),
                              _host(be, want).view(np.int16 if dt != "float32" else np.int32))
        out = torch.full_like(got, float("nan"))
        taken = sum(TAKEN.values())
        assert be.linear(x2, q, bias, out=out) is out  # (an out= of the result's dtype: the repeat too)
        assert sum(TAKEN.values()) == taken and torch.equal(out, got)


@pytest.mark.skipif(SIM, reason="torch CUDA tensors need a GPU")
@pytest.mark.parametrize("text", ["nvfp4", "q4_1", "q8s/block48:f32"])
@pytest.mark.parametrize("dt", ["bfloat16", "float16", "float32"])
def test_torch_x_on_the_transposed_matmul(cuda_backend, text, dt):
    torch = pytest.importorskip("torch")
    be = cuda_backend
    w = _weight(64, 96)
    q = be.quantize(w, text)
    W = np.asarray(REF.dequantize(REF.quantize(w, text)), np.float64)
    x = torch.randn(2, 3, 96, dtype=getattr(torch, dt), device="cuda")
    y = be.linear(x, q)
    assert isinstance(y, torch.Tensor) and y.dtype == x.dtype and tuple(y.shape) == (2, 3, 64)
    xh = x.float().cpu().numpy().reshape(6, 96).astype(XDT[{"bfloat16": "bf16", "float16": "f16", "float32": "f32"}[dt]])
    exact, bound = product_bound(xh, W, None, xh.dtype)
    assert (np.abs(y.float().cpu().numpy().reshape(6, 64) - exact) <= bound).all()


@pytest.mark.skipif(SIM, reason="torch CUDA tensors need a GPU")
@pytest.mark.parametrize("text", ["q4s/block32:f16", "q8s/block32:f16", "e4m3/block32:f32", "nvfp4", "q4_1",
                                  "q2s/block32:f16"])
@pytest.mark.parametrize("bias", [False, True])
def test_prefill_dequantizes_to_bfloat16_then_takes_torchs_gemm(cuda_backend, monkeypatch, text, bias):
    """bfloat16 x of at least LIBRARY_FROM_M rows, the fused GEMM off (q4_1: a weight it does not
    read): the weight rounded once to bfloat16, then torch's GEMM: the same bits as torch's own
    `linear` over the reference's dequantized weight rounded to bfloat16, within docs/spec.md's
    bound with the bfloat16-weight term, the same bits again on a repeat; fewer rows, float16 x, a
    float32 result or a float32 bias take the kernels that keep f32 weights."""
    torch = pytest.importorskip("torch")
    from qcore_cuda.paths import linear as paths_linear

    monkeypatch.setattr(paths_linear, "FUSED_M", (0, 0))
    be = cuda_backend
    m = paths_linear.LIBRARY_FROM_M + 3
    w = _weight(96, 256)
    q = be.quantize(w, text)
    W = np.asarray(REF.dequantize(REF.quantize(w, text)), np.float64)
    x = torch.randn(m, 256, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(96, dtype=torch.bfloat16, device="cuda") if bias else None
    before = _paths().get("DequantizedGemmLinear", 0)
    y = be.linear(x, q, b)
    assert _paths().get("DequantizedGemmLinear", 0) == before + 1
    wb = torch.from_numpy(W.astype(np.float32)).to("cuda").to(torch.bfloat16)
    assert torch.equal(y, torch.nn.functional.linear(x, wb, b))
    assert torch.equal(be.linear(x, q, b), y)  # (a repeat: the path not chosen again)
    assert _paths().get("DequantizedGemmLinear", 0) == before + 1
    xh = x.float().cpu().numpy().astype(BF16)
    bh = None if b is None else b.float().cpu().numpy().astype(BF16)
    exact, bound = product_bound(xh, W, bh, BF16)
    assert (np.abs(y.float().cpu().numpy() - exact) <= bound).all()
    for other in (lambda: be.linear(x[: m - 4], q, b), lambda: be.linear(x.half(), q),
                  lambda: be.linear(x, q, None if b is None else b.float()) if bias else be.linear(x, q, dtype=np.float32)):
        other()
        assert _paths().get("DequantizedGemmLinear", 0) == before + 1


@pytest.mark.skipif(SIM, reason="torch CUDA tensors need a GPU")
@pytest.mark.parametrize("text", ["q4s/block32:f16", "mxfp4", "q8s/block48:f32", "q4s/block16:f16:flat"])
def test_dequantize_into_a_torch_bfloat16_tensor(cuda_backend, text):
    """`dequantize(q, out=bfloat16 tensor)`: the reference's float32 values rounded to nearest even."""
    torch = pytest.importorskip("torch")
    be = cuda_backend
    w = _weight(64, 192)
    q = be.quantize(w, text)
    want = np.asarray(REF.dequantize(REF.quantize(w, text)), np.float32).astype(BF16)
    out = torch.empty(64, 192, dtype=torch.bfloat16, device="cuda")
    assert be.dequantize(q, out=out) is out
    assert np.array_equal(out.view(torch.int16).cpu().numpy(), want.view(np.int16))
    assert np.array_equal(be.dequantize(q, BF16).view(np.int16), want.view(np.int16))


@pytest.mark.parametrize("text", ["q4s/block32:f16", "q4s/block32:f16/packed_native/order:high"])
def test_adopt_reads_a_device_payload_in_place(cuda_backend, text):
    """`adopt(data, payload)`: a QTensor over the device bytes themselves (bytes written there
    before its first use are what it reads), equal to `from_data`'s; a scheme held in another
    byte order is copied; a payload of another length is an InputError."""
    be = cuda_backend
    rq, rq2 = REF.quantize(_weight(32, 64), text), REF.quantize(_weight(32, 64, seed=5), text)
    data = rq.to_data()
    dev = cuda.to_device(np.frombuffer(data.payload, np.uint8).copy())
    q = be.adopt(data, dev)
    in_place = "order" not in text
    if in_place:
        dev.copy_to_device(np.frombuffer(rq2.to_data().payload, np.uint8).copy())
    want = rq2 if in_place else rq
    assert np.array_equal(be.to_numpy(be.dequantize(q)), np.asarray(REF.dequantize(want)))
    assert q.to_data().payload == want.to_data().payload
    with pytest.raises(InputError, match="flat uint8 device array"):
        be.adopt(data, cuda.to_device(np.zeros(len(data.payload) - 1, np.uint8)))


@pytest.mark.skipif(SIM, reason="torch CUDA tensors need a GPU")
@pytest.mark.parametrize("wtext", ["e4m3/block{k}:f32", "e4m3"])
@pytest.mark.parametrize("given", [False, True])
@pytest.mark.parametrize("k", [256, 8192])
def test_w8a8_runs_code_by_code_on_torchs_fp8_gemm(cuda_backend, wtext, given, k):
    """An e4m3 weight (per-row or per-tensor f32 scales) and per-row e4m3 activations, a bfloat16
    result from LIBRARY_FROM_M rows: torch's `_scaled_mm` over both payloads, within the bound of
    docs/spec.md's quantized activations with the FP8 accumulator term against the reference's
    decoded x (K = 8192: 256 of the tensor core's 32-product groups in each sum); the same bits
    again; a float32 result or fewer rows take the decoded path."""
    torch = pytest.importorskip("torch")
    if not hasattr(torch, "_scaled_mm"):
        pytest.skip("this torch has no _scaled_mm")
    from qcore_cuda.paths import linear as paths_linear

    be = cuda_backend
    m, n, act, wtext = paths_linear.LIBRARY_FROM_M + 5, 48, f"e4m3/block{k}:f32", wtext.format(k=k)
    w = _weight(n, k)
    q = be.quantize(w, wtext)
    W = np.asarray(REF.dequantize(REF.quantize(w, wtext)), np.float64)
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    xh = x.float().cpu().numpy()
    xq = np.asarray(REF.dequantize(REF.quantize(xh, act)), np.float32)
    calls = []
    real = torch._scaled_mm
    try:
        torch._scaled_mm = lambda *a, **kw: (calls.append(1), real(*a, **kw))[1]
        y = be.linear(be.quantize(x.float(), act), q, dtype=BF16) if given else be.linear(x, q, act=act)
        again = be.linear(be.quantize(x.float(), act), q, dtype=BF16) if given else be.linear(x, q, act=act)
        assert len(calls) == 2
        assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16 and tuple(y.shape) == (m, n)
        assert torch.equal(y, again)
        exact, bound = product_bound(xq, W, None, BF16, fp8_codes=True)
        assert (np.abs(y.float().cpu().numpy() - exact) <= bound).all()
        be.linear(x, q, act=act, dtype=np.float32)
        be.linear(x[: m - 6], q, act=act)
        assert len(calls) == 2
    finally:
        torch._scaled_mm = real


@pytest.mark.skipif(SIM, reason="torch CUDA tensors need a GPU")
def test_w8a8_reads_a_bfloat16_x_as_it_is(cuda_backend):
    """W8A8 quantizes a bfloat16 x per row from its own bits: the product is, bit for bit, the one
    of x.float() quantized by `quantize` (the reference's bytes), exact ties included; a row
    holding a non-finite x gives NaN, the other rows what they give with it zeroed (docs/spec.md, quantized
    activations)."""
    torch = pytest.importorskip("torch")
    if not hasattr(torch, "_scaled_mm"):
        pytest.skip("this torch has no _scaled_mm")
    from qcore_cuda.paths import linear as paths_linear

    be = cuda_backend
    m, n, k, act = paths_linear.LIBRARY_FROM_M + 3, 32, 1024, "e4m3/block1024:f32"
    q = be.quantize(_weight(n, k), "e4m3/block1024:f32")
    x = (torch.randn(m, k, device="cuda") * 3).to(torch.bfloat16)
    x[0, :4] = torch.tensor([448.0, 1.0625, -1.1875, 0.0])  # a scale of 1: exact e4m3 ties
    xq = be.quantize(x.float(), act)
    assert xq.to_data().payload == REF.quantize(x.float().cpu().numpy(), act).to_data().payload
    assert torch.equal(be.linear(x, q, act=act), be.linear(xq, q, dtype=BF16))
    x[5, 7], x[6, 0] = float("nan"), float("inf")  # nothing waits to check x: those rows are NaN
    y, zeroed = be.linear(x, q, act=act), x.clone()
    zeroed[5:7] = 0
    assert torch.isnan(y[5:7]).all() and not torch.isnan(y[:5]).any()
    want = be.linear(zeroed, q, act=act)
    assert torch.equal(y[:5], want[:5]) and torch.equal(y[7:], want[7:])


@pytest.mark.skipif(SIM, reason="torch CUDA tensors need a GPU")
@pytest.mark.parametrize("wtext", ["e4m3/block256:f32", "q4s/block32:f16", "q8s"])
@pytest.mark.parametrize("m", [1, 5, 70])
@pytest.mark.parametrize("bias,xdt", [(False, "bfloat16"), (True, "bfloat16"), (False, "float32")])
def test_act_runs_the_codes_of_x_on_the_weight_only_kernels(cuda_backend, monkeypatch, wtext, m, bias, xdt):
    """Per-row e4m3 activations of a torch x where torch's FP8 GEMM does not take the call (one
    row, a few, a bias, another weight, a float32 x): x's codes on the bfloat16 kernels, each row's
    scale on its f32 sums, never the decoded path; within docs/spec.md's bound against the
    reference's `xq` (no FP8 accumulator term); in a bfloat16 x a row holding a NaN or an infinity
    gives NaN, the others what they give with it zeroed; the same bits again; a float32 result
    too."""
    torch = pytest.importorskip("torch")
    from qcore_cuda.backend import CudaBackend
    from qcore_cuda.paths import linear as paths_linear

    be = cuda_backend
    n, k, act = 48, 256, "e4m3/block256:f32"
    monkeypatch.setattr(CudaBackend, "_product_x", lambda *a, **kw: pytest.fail("took the decoded path"))
    w = _weight(n, k)
    q = be.quantize(w, wtext)
    W = np.asarray(REF.dequantize(REF.quantize(w, wtext)), np.float64)
    x = (torch.randn(m, k, device="cuda") * 3).to(getattr(torch, xdt))
    bad = [r for r in (1, 3) if r < m] if xdt == "bfloat16" else []
    for r, v in zip(bad, (float("nan"), float("inf"))):
        x[r, 7] = v
    b = (torch.randn(n, device="cuda")).to(torch.bfloat16) if bias else None
    y = be.linear(x, q, b, act=act)
    assert isinstance(y, torch.Tensor) and y.dtype == x.dtype and tuple(y.shape) == (m, n)
    assert torch.equal(y.view(torch.int16 if y.itemsize == 2 else torch.int32),
                       be.linear(x, q, b, act=act).view(torch.int16 if y.itemsize == 2 else torch.int32))  # (NaN rows too)
    xh = x.float().cpu().numpy()
    xh[bad] = 0
    xq = np.asarray(REF.dequantize(REF.quantize(xh, act)), np.float32)
    bh = None if b is None else b.float().cpu().numpy().astype(BF16)
    good = [r for r in range(m) if r not in bad]
    fp8_gemm = (wtext.startswith("e4m3") and m >= paths_linear.LIBRARY_FROM_M and not bias
                and xdt == "bfloat16")  # (`paths/fp8.py` takes it)
    for dt, got in ((np.dtype(getattr(ml_dtypes, xdt, np.float32)), y),
                    (np.dtype(np.float32), be.linear(x, q, b, act=act, dtype=np.float32))):
        got = got.float().cpu().numpy()
        assert np.isnan(got[bad]).all() and not np.isnan(got[good]).any()
        exact, bound = product_bound(xq, W, bh, dt, fp8_codes=fp8_gemm)  # (the FP8 GEMM's term for a bfloat16 y)
        assert (np.abs(got[good] - exact[good]) <= bound[good]).all(), dt


@pytest.mark.skipif(SIM, reason="torch CUDA tensors need a GPU")
@pytest.mark.parametrize("dt", ["float32", "float16", "bfloat16"])
def test_qtensor_dequantize_to_a_torch_dtype_stays_on_the_gpu(cuda_backend, dt):
    torch = pytest.importorskip("torch")
    q = cuda_backend.quantize(_weight(32, 64), "q4s/block32:f16")
    t = q.dequantize(getattr(torch, dt))
    assert isinstance(t, torch.Tensor) and t.is_cuda and t.dtype == getattr(torch, dt)
    want = np.asarray(REF.dequantize(REF.quantize(_weight(32, 64), "q4s/block32:f16")), np.float32)
    assert torch.equal(t.cpu(), torch.from_numpy(want).to(getattr(torch, dt)))


# (scheme, chunks per warp) over the GPU's chunk loop, whose loads differ by code width only: 8-bit
# (two words a lane) at 5 chunks a warp (two groups of two and a chunk alone), 2-bit (half a word a
# lane, widened) at 6 (three groups)
_LOOP_CASES = [("q8s/block64:f16", 5, 4), ("q2s/block32:f16", 6, 4), ("q4s/block32:f16", 5, 0),
               ("q4s/block32:f16", 5, 4), ("mxfp4", 9, 4), ("nvfp4", 3, 4)]


@pytest.mark.parametrize("text,cpw,wide_m", _LOOP_CASES)
def test_the_gpu_chunk_loop_gives_the_lockstep_bits(cuda_backend, monkeypatch, text, cpw, wide_m):
    """The GPU's chunk loop (groups of U chunks' loads, then their sums; the tail one by one), run
    under the simulator where K gives every warp the same chunks (`SIM_GPU_LOOP`), add the same terms in the
    same order as the simulator's lockstep loop: the same bits, for bf16 x at one n8 tile and f16
    x at three; K = 32 * `linear.WARPS` (2 under the simulator) * `cpw` chunks. With `WIDE_M` at
    4 the bf16 row of q4s and mxfp4 takes the wide form (groups of 2 U chunks through shared
    memory and `ldmatrix`, whose simulator twin exchanges the lanes' row addresses): one group
    and a tail, two groups and a tail."""
    from qcore_cuda import linear
    from qcore_cuda.paths import linear as paths_linear

    if not SIM:
        pytest.skip("the simulator's loop against the GPU's (a GPU runs only its own)")
    assert (linear.WARPS, linear.U) == (2, 2)
    monkeypatch.setattr(paths_linear, "DECODE_MAX_M", 0)
    monkeypatch.setattr(paths_linear, "MMA_DECODE_MAX_M", 0)
    monkeypatch.setattr(linear, "WIDE_M", wide_m)
    be, n = cuda_backend, 20
    for k in (32 * linear.WARPS * cpw,):
        w = _weight(n, k, 31)
        xs = {xt: _x(17, k, dt, 32) for xt, dt in XDT.items()}
        b = _x(1, n, np.float32, 33)[0]

        def run(loop):
            monkeypatch.setattr(linear, "SIM_GPU_LOOP", loop)
            q = be.quantize(w, text)  # (a fresh weight: the packed launch is kept with it)
            before = _paths().get("TensorCoreLinear", 0)
            out = [_host(be, be.linear(xs[xt][:m], q, b, dtype=np.float32)).view(np.uint32)
                   for xt, m in (("bf16", 1), ("f16", 17))]
            assert _paths().get("TensorCoreLinear", 0) == before + len(out)
            return out

        want = run(False)
        W = np.asarray(REF.dequantize(REF.quantize(w, text)), np.float64)
        exact, bound = product_bound(xs["f16"][:17], W, b, np.dtype(np.float32))
        assert (np.abs(want[1].view(np.float32).astype(np.float64) - exact) <= bound).all()
        got = run(True)
        for i, (g, e) in enumerate(zip(got, want)):
            assert np.array_equal(g, e), (text, k, i)


# (scheme, x type, M): two tiles of w a warp for each kind of chunk: 4-bit integers, 8-bit (two words a
# lane), FP8 and E2M1 decoders, 2-bit (widened), blocks of 16 (the `split` variants); one and two n8
# tiles of x, each x type
_TILE_CASES = [("q4s/block32:f16", "bf16", 1), ("q8s/block64:f16", "f16", 9), ("mxfp4", "f32", 3),
               ("e4m3/block32:f32", "bf16", 16), ("q2s/block32:f16", "f16", 2), ("nvfp4", "bf16", 10),
               ("q4s/block16:f16", "f32", 1)]


@pytest.mark.parametrize("text,xt,m", _TILE_CASES)
def test_two_tiles_of_w_a_warp_give_the_one_tile_bits(cuda_backend, monkeypatch, text, xt, m):
    """A warp over two 16-row tiles of w (`linear.TILES`: each chunk's B fragments of x
    serve all) adds the same terms in the same order as one tile a warp: the same bits, with N = 40
    leaving a block's last tiles partly or wholly past N, and within docs/spec.md's products'
    bound."""
    from qcore_cuda import linear
    from qcore_cuda.paths import linear as paths_linear

    monkeypatch.setattr(paths_linear, "DECODE_MAX_M", 0)
    monkeypatch.setattr(paths_linear, "MMA_DECODE_MAX_M", 0)
    be, n, k = cuda_backend, 40, 256
    kind = linear.geometry((n, k), parse_scheme(text))[0]
    w = _weight(n, k, 41)
    x = _x(m, k, XDT[xt], 42)
    b = _x(1, n, np.float32, 43)[0]
    got = {}
    for tiles in (1, 2):
        monkeypatch.setattr(linear, "TILES", tiles)
        assert linear.rt_for(kind, n, m) == tiles
        q = be.quantize(w, text)  # (a fresh weight: the packed launch is kept with it)
        before = _paths().get("TensorCoreLinear", 0)
        got[tiles] = _host(be, be.linear(x, q, b, dtype=np.float32))
        assert _paths().get("TensorCoreLinear", 0) == before + 1
    assert np.array_equal(got[1].view(np.uint32), got[2].view(np.uint32)), text
    W = np.asarray(REF.dequantize(REF.quantize(w, text)), np.float64)
    exact, bound = product_bound(x, W, b, np.dtype(np.float32))
    assert (np.abs(got[2].astype(np.float64) - exact) <= bound).all()


def test_a_tuning_past_the_shared_memory_is_a_one_line_error(monkeypatch):
    """Warps x tiles of w x rows of x whose sums pass 48 KB of shared memory (32 warps, two tiles,
    16 rows of x): the kernel is refused with the variables named, not left to fail at launch."""
    from qcore_cuda import fast, linear

    monkeypatch.setattr(linear, "WARPS", 32)
    with pytest.raises(ValueError, match="QCORE_CUDA_LINEAR_TILES.*48 KB"):
        linear.kernel(fast.KIND_I4, linear.XT_BF16, 2, rt=2)


def test_two_tiles_of_w_only_where_measured_faster(monkeypatch):
    """`linear.rt_for`: two 16-row tiles a warp for 4-bit codes in unsplit chunks at 5 to 16 rows
    of x where the blocks of 32 rows fill `RT_FILL` of the resident block slots, else one; `TILES` overrides
    wherever a two-tile variant exists (one or two n8 tiles of x)."""
    from qcore_cuda import fast, linear

    monkeypatch.setattr(linear, "TILES", 0)
    monkeypatch.setattr(linear, "WARPS", 8)  # (a GPU's default: two blocks of 128 registers a SM)
    monkeypatch.setattr(fast.K, "sm_count", lambda: 132)
    i4, e2m1, i8 = fast.KIND_I4, fast.KIND_E2M1, fast.KIND_I8
    assert linear.rt_for(i4, 8192, 5) == 2 and linear.rt_for(e2m1, 8192, 16) == 2  # 256 blocks of 264 slots
    assert linear.rt_for(i4, 4096, 16) == 1  # 128 blocks: half the GPU
    assert linear.rt_for(i4, 8192, 4) == 1 and linear.rt_for(i4, 8192, 17) == 1  # (outside RT_M)
    assert linear.rt_for(i8, 8192, 16) == 1  # (8-bit codes: slower with two)
    assert linear.rt_for(e2m1, 8192, 16, halves=True) == 1  # (blocks of 16: not timed)
    monkeypatch.setattr(linear, "TILES", 2)
    assert linear.rt_for(i8, 4096, 2) == 2 and linear.rt_for(i4, 8192, 17) == 1


def test_the_wide_form_takes_4_bit_codes_at_few_rows(monkeypatch):
    """`linear.wide_for`: 4-bit codes under blocks of 32 or more (q4*, mxfp4) at one tile of w and
    at most `WIDE_M` rows of x; not 8-bit or 2-bit codes, split chunks (blocks of 16) or two tiles."""
    from qcore_cuda import fast, linear

    monkeypatch.setattr(linear, "WIDE_M", 4)
    i4, e2m1 = fast.KIND_I4, fast.KIND_E2M1
    assert linear.wide_for(i4, 1, False, 1) and linear.wide_for(e2m1, 4, False, 1)
    assert not linear.wide_for(i4, 5, False, 1) and not linear.wide_for(i4, 2, False, 2)
    assert not linear.wide_for(e2m1, 2, True, 1)  # (nvfp4's split chunks)
    assert not linear.wide_for(fast.KIND_I8, 1, False, 1) and not linear.wide_for(fast.KIND_I2, 1, False, 1)
    monkeypatch.setattr(linear, "WIDE_M", 0)
    assert not linear.wide_for(i4, 1, False, 1)


@pytest.mark.parametrize("text", ["8", "8,4,2", "8,0", "8,x", ""])
def test_a_bad_tuning_is_a_one_line_error(text):
    """A kernel tuning from the environment (`linear.parse_tune`, read at import on a GPU): one
    positive integer per field, else a ValueError naming the variable and the fields."""
    from qcore_cuda import linear

    assert linear.parse_tune("QCORE_CUDA_LINEAR_TUNE", "16,2", "WARPS,U") == (16, 2)
    with pytest.raises(ValueError, match=r"QCORE_CUDA_LINEAR_TUNE=.*: write WARPS,U \(2 positive integers\)$"):
        linear.parse_tune("QCORE_CUDA_LINEAR_TUNE", text, "WARPS,U")
