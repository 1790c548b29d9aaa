"""qcore.nn: a torch Linear over a quantized weight, and swapping a model's Linear layers by a recipe."""
import numpy as np
import pytest

from tests.optional import need

torch = need("torch", "torch is not installed (pip install torch)")

import qcore  # noqa: E402
import qcore.nn as qnn  # noqa: E402
from qcore.backend.registry import AutoBackend, device_of  # noqa: E402

REF = qcore.backend("reference")


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.SiLU(), torch.nn.Linear(96, 32, bias=False),
                               torch.nn.Linear(32, 7))


def test_quantize_module_swaps_by_the_recipe_rules_and_keeps_the_rest():
    m = _model()
    decided = qnn.quantize_module(m, "q8s", rules=["2.*=q4s/block32:f16", "3.*=keep"])
    assert decided["0.weight"] == qcore.scheme("q8s") and decided["2.weight"] == qcore.scheme("q4s/block32:f16")
    assert decided["3.weight"].startswith("kept: matches rule")
    assert isinstance(m[0], qnn.Linear) and isinstance(m[2], qnn.Linear) and type(m[3]) is torch.nn.Linear
    assert m[0].weight.dtype == torch.uint8 and not m[0].weight.requires_grad
    assert "scheme='q4s/block32:f16'" in repr(m[2])


def test_the_bytes_are_the_ones_quantize_gives_for_the_same_weight():
    m = _model()
    w = m[2].weight.detach().numpy().copy()
    qnn.quantize_module(m, "q4s/block32:f16")
    want = REF.quantize(w, "q4s/block32:f16").to_data().payload
    assert m[2].weight.numpy().tobytes() == want
    assert m[2].qweight.to_data().payload == want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_forward_is_the_backends_linear_in_the_callers_dtype(dtype):
    m = _model()
    qnn.quantize_module(m, "q4s/block32:f16")
    m = m.to(dtype)
    x = torch.randn(3, 5, 64).to(dtype)
    with torch.no_grad():
        y = m[0](x)
    assert y.dtype == dtype and tuple(y.shape) == (3, 5, 96)
    want = qcore.linear(x, m[0].qweight, m[0].bias)
    assert torch.equal(y, want)
    # and what the dequantized weight gives in float32 arithmetic
    plain = x.float() @ m[0].dequantized_weight().T + m[0].bias.float()
    assert torch.allclose(y.float(), plain, rtol=2e-2 if dtype != torch.float32 else 1e-5, atol=1e-2 if dtype != torch.float32 else 1e-5)


def test_gradients_reach_the_input_and_the_bias_never_the_codes():
    m = _model()
    qnn.quantize_module(m, "q8s/block32:f16")
    x = torch.randn(4, 64, requires_grad=True)
    m(x).square().sum().backward()
    # the same through plain float layers holding the dequantized weights
    plain = _model()
    for i in (0, 2, 3):
        plain[i].weight.data.copy_(m[i].dequantized_weight())
        if m[i].bias is not None:
            plain[i].bias.data.copy_(m[i].bias.detach())
    x2 = x.detach().clone().requires_grad_(True)
    plain(x2).square().sum().backward()
    assert torch.allclose(x.grad, x2.grad, rtol=1e-4, atol=1e-5)
    assert torch.allclose(m[0].bias.grad, plain[0].bias.grad, rtol=1e-4, atol=1e-5)
    assert m[0].weight.grad is None


def test_state_dict_round_trip_binds_the_new_bytes():
    m = _model()
    qnn.quantize_module(m, "q4s/block32:f16")
    other = _model(seed=1)
    qnn.quantize_module(other, "q4s/block32:f16")
    x = torch.randn(2, 64)
    with torch.no_grad():
        before = other(x)
        other.load_state_dict(m.state_dict())
        after, want = other(x), m(x)
    assert not torch.equal(before, after) and torch.equal(after, want)


def test_from_qtensor_and_its_errors():
    w = np.random.default_rng(0).standard_normal((12, 64)).astype(np.float32)
    q = REF.quantize(w, "q8s/block32:f16")
    layer = qnn.Linear.from_qtensor(q, torch.ones(12))
    assert (layer.in_features, layer.out_features) == (64, 12) and layer.qweight is q
    with pytest.raises(qcore.InputError, match="takes a QTensor weight, got ndarray"):
        qnn.Linear.from_qtensor(w)
    with pytest.raises(qcore.InputError, match=r"2-D \[out_features, in_features\], got shape \(64,\)"):
        qnn.Linear.from_qtensor(REF.quantize(w[0], "q8s"))
    with pytest.raises(qcore.InputError, match=r"bias has shape \(5,\); this layer has 12 output features"):
        qnn.Linear.from_qtensor(q, torch.ones(5))
    with pytest.raises(qcore.InputError, match="the recipe quantizes nothing"):
        qnn.quantize_module(_model(), None)


def test_a_payload_that_breaks_the_format_is_refused_on_use():
    layer = qnn.Linear(64, 4, "q8s/block32:f16", bias=False)
    layer.weight.data[-2:] = torch.tensor([0x00, 0x7E], dtype=torch.uint8)  # the last scale: f16 NaN
    with pytest.raises(qcore.InvalidDataError, match="scale slot 7 of q8s/block32:f16 is nan"):
        layer(torch.randn(1, 64))


def test_qtensor_dequantize_to_a_torch_dtype_gives_a_torch_tensor():
    w = np.random.default_rng(1).standard_normal((8, 32)).astype(np.float32)
    q = REF.quantize(torch.from_numpy(w), "q4s/block32:f16")
    t = q.dequantize(torch.bfloat16)
    assert isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16
    import ml_dtypes

    want = REF.dequantize(q, np.dtype(ml_dtypes.bfloat16))
    assert np.array_equal(t.view(torch.int16).numpy(), want.view(np.int16))
    assert torch.equal(q.dequantize(torch.float32), torch.from_numpy(q.numpy()))


def test_host_layers_pick_a_host_backend():
    be = AutoBackend().pick("q8s", device="cpu")
    assert device_of(be) == "cpu"
    assert qnn.backend_for(qcore.scheme("q4s/block32:f16"), torch.device("cpu")).name != "cuda"
    with pytest.raises(qcore.UnsupportedSchemeError, match="no available backend on mars supports"):
        AutoBackend().pick("q8s", device="mars")


def test_layers_on_a_named_backend_run_its_linear():
    """`backend=` picks the backend the layers run on (here the cuda backend, under the simulator in
    CI: torch CPU tensors in and out): the same results as its own `linear`, within `linear`'s bound
    (docs/spec.md, products with a quantized weight) of the host backend's."""
    try:
        be = qcore.backend("cuda")
    except qcore.QCoreError:
        pytest.skip("the cuda backend is not installed")
    if not be.available():
        pytest.skip("the cuda backend is not available here")
    m = _model()
    qnn.quantize_module(m, "q4s/block32:f16", backend="cuda")
    assert m[0].qweight.backend.name == "cuda"
    x = torch.randn(2, 64)
    with torch.no_grad():
        y = m[0](x)
        host = qnn.Linear.from_qtensor(m[0].qweight.to("reference"), m[0].bias)(x)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.float32
    assert torch.equal(y, torch.as_tensor(qcore.backend("cuda").to_numpy(be.linear(x, m[0].qweight, m[0].bias))))
    assert torch.allclose(y, host, rtol=1e-5, atol=1e-5)
