"""`linear` (a weight [N, K] as checkpoints store it) and the activation dtypes of `matmul`, on the
host backends, through the public API: results, result dtypes, bias, shapes, errors, and the
products' bound of docs/spec.md."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import qcore
from qcore.conformance.checks import product_bound
from tests.optional import need

BF16 = np.dtype(ml_dtypes.bfloat16)
SCHEMES = ["q8s", "q4s/block32:f16", "nvfp4", "mxfp8", "q4_1", "q8s/block16:f32:flat", "nf4"]


def _weight(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _x(shape, dtype, seed=1):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _within(y, x, W, bias, out_dtype):
    exact, bound = product_bound(np.asarray(x).reshape(-1, x.shape[-1]), W, bias, out_dtype)
    err = np.abs(np.asarray(y, np.float64).reshape(exact.shape) - exact)
    return bool((err <= bound).all())


@pytest.mark.parametrize("backend", ["reference", "ndarray"])
@pytest.mark.parametrize("text", SCHEMES)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16, np.float64])
def test_linear_within_the_bound_in_x_dtype(backend, text, dtype):
    be = qcore.backend(backend)
    if not be.supports(text):
        pytest.skip(f"{backend} does not run {text}")  # ndarray: Q8 values only (docs/spec.md, backends)
    q = be.quantize(_weight((40, 96)), text)
    W = np.asarray(be.dequantize(q), np.float64)
    x = _x((2, 3, 96), dtype)
    bias = _x((40,), np.float32, seed=5)
    y = be.linear(x, q, bias)
    assert y.shape == (2, 3, 40) and y.dtype == np.dtype(dtype)
    assert _within(y, x, W, bias, dtype)


def test_linear_is_matmul_of_the_transpose_and_module_level_names():
    q = qcore.quantize(_weight((24, 64)), "q4s/block32:f16", "reference")
    x = _x((5, 64), np.float32)
    y = qcore.linear(x, q)
    be = q.backend
    W = np.asarray(be.dequantize(q), np.float64)
    assert _within(y, x, W, None, np.float32) and _within(be.matmul(x, be.transpose(q)), x, W, None, np.float32)
    assert np.array_equal(qcore.matmul(x[:, :24], q), be.matmul(x[:, :24], q))


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16])
def test_result_dtype_follows_x_or_dtype(dtype):
    q = qcore.quantize(_weight((8, 32)), "q8s", "reference")
    x = _x((2, 32), dtype)
    assert qcore.linear(x, q).dtype == np.dtype(dtype)
    assert qcore.linear(x, q, dtype=np.float32).dtype == np.float32
    assert qcore.matmul(x[:, :8], q).dtype == np.float32  # matmul keeps its float32 default
    assert qcore.matmul(x[:, :8], q, dtype=None).dtype == np.dtype(dtype)


def test_one_rounding_to_the_result_dtype():
    q = qcore.quantize(_weight((16, 64)), "q8s/block32:f32", "reference")
    x = _x((4, 64), BF16)
    b = _x((16,), np.float32, seed=3)
    y32 = qcore.linear(x, q, b, dtype=np.float32)
    assert np.array_equal(qcore.linear(x, q, b).view(np.uint16), y32.astype(BF16).view(np.uint16))


def test_empty_extents():
    be = qcore.backend("reference")
    q = be.quantize(_weight((6, 0)), "q8s")
    b = np.arange(6, dtype=np.float32)
    assert np.array_equal(be.linear(np.zeros((2, 0), np.float32), q, b), np.tile(b, (2, 1)))
    q2 = be.quantize(_weight((6, 32)), "q8s")
    assert be.linear(np.zeros((0, 32), np.float16), q2).shape == (0, 6)


@pytest.mark.parametrize(("call", "match"), [
    (lambda q: qcore.linear(np.zeros((2, 31), np.float32), q), "x's last axis must be K = 32"),
    (lambda q: qcore.linear(np.zeros((2, 32), np.int32), q), "products take"),
    (lambda q: qcore.linear(np.zeros((2, 32), np.float32), q, np.zeros(7, np.float32)), "bias of shape"),
    (lambda q: qcore.linear(np.zeros((2, 32), np.float32), q, dtype=np.int8), "result can be"),
    (lambda q: qcore.linear(np.zeros((2, 32), np.float32), q.backend.reshape(q, (6, 4, 8))), "2-D weight"),
    (lambda q: qcore.linear(np.zeros((2, 32), np.float32), np.zeros((6, 32))), "QTensor"),
])
def test_errors_are_one_line_input_errors(call, match):
    q = qcore.quantize(_weight((6, 32)), "q8s", "reference")
    with pytest.raises(qcore.InputError, match=match):
        call(q)


def test_torch_tensors_in_and_out():
    torch = need("torch", "torch is not installed (pip install torch)")
    q = qcore.quantize(_weight((12, 32)), "q4s/block32:f16", "reference")
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    y = qcore.linear(x, q)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16 and tuple(y.shape) == (3, 12)
    want = qcore.linear(x.float().numpy().astype(BF16), q)
    assert np.array_equal(y.view(torch.int16).numpy(), want.view(np.int16))


def test_qtensor_transpose_and_x_at_q():
    q = qcore.quantize(_weight((24, 64)), "q8s/block32:f32", "reference")
    assert q.T.shape == (64, 24) and q.T.scheme == q.backend.transpose(q).scheme
    x = _x((3, 24), np.float32)
    y = x @ q  # numpy defers to QTensor.__rmatmul__: matmul with the weight as [K, N]
    assert isinstance(y, np.ndarray) and np.array_equal(y, q.backend.matmul(x, q))


def test_torch_cpu_tensors_quantize_in_place_of_numpy():
    torch = need("torch", "torch is not installed (pip install torch)")
    w = torch.randn(16, 64)
    for t, a in ((w, w.numpy()), (w.to(torch.bfloat16), w.to(torch.bfloat16).float().numpy().astype(BF16))):
        for backend in ("reference", "ndarray"):
            got = qcore.quantize(t, "q8s/block32:f32", backend).to_data()
            assert got == qcore.quantize(a, "q8s/block32:f32", backend).to_data()
    p = qcore.calibrate(w, "q4s/block32:f16", "reference")
    assert np.array_equal(p.scales, qcore.calibrate(w.numpy(), "q4s/block32:f16", "reference").scales)
    x = torch.randn(2, 16)
    q = qcore.quantize(w, "q8s", "reference")
    assert isinstance(x @ q, torch.Tensor)  # torch defers to QTensor.__rmatmul__ too


def test_load_takes_a_shard_folder_and_its_index(tmp_path):
    """qcore.load reads what the CLI reads: a folder of shards or its index, the shards checked."""
    import json

    be = qcore.backend("reference")
    a, b = be.quantize(_weight((8, 32)), "q8s"), _weight((4,), seed=3)
    qcore.save(tmp_path / "model-00001-of-00002.safetensors", {"a": a})
    qcore.save(tmp_path / "model-00002-of-00002.safetensors", {"b": b})
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                            "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    for src in (tmp_path, tmp_path / "model.safetensors.index.json"):
        got = qcore.load(src, backend="reference")
        assert sorted(got) == ["a", "b"] and got["a"].to_data() == a.to_data() and np.array_equal(got["b"], b)
    qcore.save(tmp_path / "model-00002-of-00002.safetensors", {"b": b, "a": a})
    with pytest.raises(qcore.InvalidDataError, match="'a' is in both"):
        qcore.load(tmp_path, backend="reference")


@pytest.mark.parametrize("backend", ["reference", "ndarray"])
def test_a_bad_code_is_invalid_data_in_the_products(backend):
    """A payload holding a code outside the value's set raises InvalidDataError naming the element
    from matmul and linear, as from a first dequantize (docs/spec.md, invalid codes)."""
    from qcore.spec.payload import QuantizedData

    ref = qcore.backend("reference")
    d = ref.into_data(ref.quantize(_weight((4, 32)), "q8s"))
    bad = bytearray(d.payload)
    bad[5] = 0x80  # -128: outside Q8S's codes
    q = qcore.backend(backend).from_data(QuantizedData(d.shape, d.scheme, bytes(bad)))
    for call in (lambda: qcore.linear(np.ones((1, 32), np.float32), q),
                 lambda: qcore.matmul(np.ones((1, 4), np.float32), q)):
        with pytest.raises(qcore.InvalidDataError, match=r"\(0, 5\)"):
            call()


# --------------------------------------------------------- W8A8: docs/spec.md, quantized activations

ACT = {"reference": "e4m3/block96:f32", "ndarray": "q8s/block96:f32", "cuda": "e4m3/block96:f32"}
"""Per-row activation schemes for K = 96, one each backend runs (ndarray: 8-bit integers only)."""


def _be(name, request):
    return request.getfixturevalue("cuda_backend") if name == "cuda" else qcore.backend(name)


def _decoded(x, act):
    """The quantized activations' xq: x read as float32, quantized under `act` and decoded, by the reference."""
    ref = qcore.backend("reference")
    return np.asarray(ref.dequantize(ref.quantize(np.asarray(x).astype(np.float32), act)))


@pytest.mark.parametrize("backend", ["reference", "ndarray", "cuda"])
@pytest.mark.parametrize("act_block", [96, 32, 40])  # per row; whole blocks along K; an edge block (96 = 2 * 40 + 16)
@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_act_products_are_the_plain_products_of_the_decoded_x(backend, act_block, dtype, request):
    be, ref = _be(backend, request), qcore.backend("reference")
    act = ACT[backend].replace("block96", f"block{act_block}")
    w = be.quantize(_weight((40, 96)), "q8s/block32:f32")
    W = np.asarray(ref.dequantize(ref.quantize(_weight((40, 96)), "q8s/block32:f32")), np.float64)
    x, bias = _x((2, 3, 96), dtype), _x((40,), np.float32, seed=5)
    xq = _decoded(x, act)
    y = be.to_numpy(be.linear(x, w, bias, act=act))
    assert y.shape == (2, 3, 40) and y.dtype == np.dtype(dtype)  # x's dtype, as `linear`'s without act
    assert _within(y, xq, W, bias, dtype)
    assert not _within(y, x, W, bias, dtype)  # (the act was applied: x itself is far outside)
    ym = be.to_numpy(be.matmul(x, be.transpose(w), act=act))  # the same product as [K, N]
    assert ym.dtype == np.float32 and _within(ym, xq, W, None, np.float32)


@pytest.mark.parametrize("backend", ["reference", "ndarray", "cuda"])
@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_act_rows_holding_a_non_finite_x_give_nan(backend, dtype, request):
    """act= does not refuse a non-finite x: its rows give NaN (bias included), every other row
    the bits it has with those rows all zeros (docs/spec.md, quantized activations)."""
    be = _be(backend, request)
    w = be.quantize(_weight((40, 96)), "q8s/block32:f32")
    x, bias = _x((2, 4, 96), dtype), _x((40,), np.float32, seed=5)
    x[0, 1, 7], x[1, 3, 95], x[1, 0, 0] = np.nan, np.inf, -np.inf
    bad = np.zeros((2, 4), bool)
    bad[0, 1] = bad[1, 3] = bad[1, 0] = True
    zeroed = np.where(bad[..., None], np.zeros((), dtype), x)
    for call in (lambda v: be.linear(v, w, bias, act=ACT[backend]),
                 lambda v: be.matmul(v, be.transpose(w), act=ACT[backend])):
        y, want = be.to_numpy(call(x)), be.to_numpy(call(zeroed))
        assert np.isnan(y[bad].astype(np.float32)).all()
        assert np.array_equal(y[~bad], want[~bad])
    with pytest.raises(qcore.InputError, match="finite values"):
        be.quantize(x.astype(np.float32), ACT[backend])  # quantize itself still refuses it


@pytest.mark.parametrize("backend", ["reference", "ndarray", "cuda"])
def test_a_quantized_x_is_its_decoded_value(backend, request):
    be = _be(backend, request)
    w = be.quantize(_weight((24, 96)), "q8s/block32:f32")
    x = _x((5, 96), np.float32)
    xt = be.quantize(x, ACT[backend])
    y = be.to_numpy(qcore.linear(xt, w))
    assert y.dtype == np.float32  # the decoded x is float32
    assert np.array_equal(y, be.to_numpy(qcore.linear(be.to_numpy(be.dequantize(xt)), w)))
    assert np.array_equal(y, be.to_numpy(qcore.linear(x, w, act=ACT[backend])))  # act= is exactly this
    assert np.array_equal(be.to_numpy(be.linear(xt, w, act=ACT[backend])), y)  # x's own scheme: accepted
    assert be.to_numpy(qcore.matmul(be.quantize(x[:, :24], "q8s/block24:f32"), w)).shape == (5, 96)  # w as [K, N]


@pytest.mark.parametrize("backend", ["reference", "ndarray"])
def test_act_keeps_torch_in_torch_out(backend):
    torch = need("torch", "torch is not installed (pip install torch)")
    be = qcore.backend(backend)
    w = be.quantize(_weight((12, 96)), "q8s/block32:f32")
    x = torch.randn(3, 96, dtype=torch.bfloat16)
    y = be.linear(x, w, act=ACT[backend])
    assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16
    want = be.linear(x.float().numpy().astype(BF16), w, act=ACT[backend])
    assert np.array_equal(y.view(torch.int16).numpy(), want.view(np.int16))


def test_act_on_cuda_of_a_torch_cpu_x(cuda_backend):
    torch = need("torch", "torch is not installed (pip install torch)")
    w = cuda_backend.quantize(_weight((12, 96)), "q8s/block32:f32")
    x = torch.randn(3, 96)
    y = cuda_backend.linear(x, w, act=ACT["cuda"])
    assert isinstance(y, torch.Tensor) and y.device.type == "cpu" and y.dtype == torch.float32
    assert np.array_equal(y.numpy(), cuda_backend.to_numpy(cuda_backend.linear(x.numpy(), w, act=ACT["cuda"])))


@pytest.mark.parametrize(("act", "error", "match"), [
    ("e4m3", qcore.SchemeError, r"act=e4m3 quantizes x per tensor .* e\.g\. e4m3/block96:f32"),
    ("nvfp4", qcore.SchemeError, "tensor-level global scale over every row"),
    ("q8s/block16:f32:flat", qcore.SchemeError, "blocks over the flattened tensor"),
    ("q8s/block2x32:f32", qcore.SchemeError, "2-D blocks"),
    ("e4m3/block96:f32", qcore.UnsupportedSchemeError, "act=e4m3/block96:f32: backend 'ndarray' does not support "
                                                       ".*backends that do: .*reference"),
])
def test_act_schemes_outside_rows_or_the_backend_are_refused(act, error, match):
    w = qcore.quantize(_weight((8, 96)), "q8s", "ndarray")
    with pytest.raises(error, match=match):
        qcore.linear(_x((2, 96), np.float32), w, act=act)


@pytest.mark.parametrize(("make_x", "act", "match"), [
    (lambda: qcore.quantize(_x((2, 64), np.float32), "q8s/block64:f32", "reference"), None,
     "x's last axis must be K = 96"),
    (lambda: qcore.quantize(_x((2, 96), np.float32), "q8s/block96:f32", "ndarray"), None,
     r"x lives on backend 'ndarray'; move it with x.to\('reference'\)"),
    (lambda: qcore.quantize(_x((2, 96), np.float32), "q8s/block96:f32", "reference"), "q8s/block32:f32",
     "already quantized as q8s/block96:f32, not act=q8s/block32:f32"),
    (lambda: _x((2, 95), np.float32), "q8s/block95:f32", "x's last axis must be K = 96"),
])
def test_quantized_x_errors_are_one_line_input_errors(make_x, act, match):
    w = qcore.quantize(_weight((8, 96)), "q8s", "reference")
    with pytest.raises(qcore.InputError, match=match):
        qcore.linear(make_x(), w, act=act)


def test_act_through_auto_and_empty_rows():
    w = qcore.quantize(_weight((8, 96)), "q8s/block32:f32", "reference")
    x = _x((4, 96), np.float16)
    auto = qcore.backend("auto")
    assert np.array_equal(auto.linear(x, w, act="q8s/block96:f32"), qcore.linear(x, w, act="q8s/block96:f32"))
    assert qcore.linear(np.zeros((0, 96), np.float16), w, act="e4m3/block96:f32").shape == (0, 8)
