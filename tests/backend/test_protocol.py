"""The backend contract (qcore.backend.protocol.Backend): every member declared, BaseBackend's
default for each optional capability (device, simulated, out=, stream=, transpose, payload_parts,
error_stats, adopt), the registry requiring all of them, and `auto` forwarding them."""
import numpy as np
import pytest
from safetensors.numpy import save_file

import qcore
from qcore import Backend, BaseBackend, InputError
from qcore.backend import registry
from qcore.backend.protocol import BACKEND_ATTRIBUTES, BACKEND_MEMBERS, BACKEND_METHODS
from qcore.backend.reference import ReferenceBackend
from qcore.backend.registry import AutoBackend
from qcore.backend.stats import error_stats

REF = qcore.backend("reference")
W = np.linspace(-1, 1, 6 * 32, dtype=np.float32).reshape(6, 32)  # linear weight [N=6, K=32]
X = np.linspace(-2, 3, 3 * 32, dtype=np.float32).reshape(3, 32)


@pytest.fixture
def fresh_registry():
    registry.reset()
    yield registry
    registry.reset()


def test_the_contract_lists_every_member_and_base_backend_has_them_all():
    assert BACKEND_ATTRIBUTES == ("name", "priority", "device", "simulated")
    for capability in ("transpose", "payload_parts", "error_stats", "adopt", "linear"):
        assert capability in BACKEND_METHODS
    assert BACKEND_MEMBERS == BACKEND_ATTRIBUTES + BACKEND_METHODS
    for be in (REF, AutoBackend()):
        assert isinstance(be, Backend)
        assert all(hasattr(be, m) for m in BACKEND_MEMBERS)
    assert (REF.device, REF.simulated) == ("cpu", False)
    assert all(hasattr(BaseBackend, m) for m in BACKEND_MEMBERS)


def test_a_plugin_backend_lacking_a_member_is_refused_naming_them(fresh_registry):
    class Duck:  # the methods of docs/spec.md's backends alone, none of the optional capabilities
        name, priority = "duck", 1

        def __getattr__(self, attr):
            if attr in BACKEND_METHODS[:9]:
                return lambda *a, **k: None
            raise AttributeError(attr)

    with pytest.raises(TypeError, match=r"lacks device, simulated, .*payload_parts, error_stats, adopt of "
                                        r"qcore.Backend \(qcore.BaseBackend has them all\)"):
        registry.register(Duck())
    assert "duck" not in qcore.backends()


def test_host_out_is_written_and_returned():
    q = REF.quantize(W, "q8s/block32:f16")
    out = np.empty((6, 32), np.float32)
    assert REF.dequantize(q, out=out, stream=object()) is out  # stream= is a device backend's: ignored here
    np.testing.assert_array_equal(out, q.numpy())
    half = np.empty(6 * 32, np.float16)  # dtype: out's; shape: q's size
    assert REF.dequantize(q, out=half) is half and np.array_equal(half, q.numpy().astype(np.float16).reshape(-1))
    y = np.empty((3, 6), np.float32)
    assert qcore.linear(X, q, out=y) is y and np.array_equal(y, REF.linear(X, q))
    m = np.empty((3, 6), np.float32)
    assert qcore.matmul(X, REF.transpose(q), out=m) is m and np.array_equal(m, REF.matmul(X, q.T))
    for bad, why in ((np.empty((3, 5), np.float32), r"must hold the result's 18 float32 values \(shape \(3, 6\)\), "
                                                     r"got 15 float32"),
                     (np.empty((3, 6), np.float64), "got 18 float64 values"),
                     (np.empty((6, 3), np.float32).T, "C-contiguous"),
                     ([0.0] * 18, "takes a numpy array or a torch CPU tensor on this backend, got list")):
        with pytest.raises(InputError, match=why):
            REF.linear(X, q, out=bad)


def test_host_out_takes_a_torch_cpu_tensor():
    torch = pytest.importorskip("torch")
    q = REF.quantize(W, "q8s/block32:f16")
    out = torch.empty((3, 6), dtype=torch.bfloat16)
    xt = torch.from_numpy(X).to(torch.bfloat16)
    assert REF.linear(xt, q, out=out) is out and torch.equal(out, REF.linear(xt, q))
    y = torch.empty(6, 32)
    assert REF.dequantize(q, out=y) is y and np.array_equal(y.numpy(), q.numpy())


def test_quantize_out_is_the_qtensor_given_the_new_data():
    q = REF.quantize(W, "q8s/block32:f16")
    again = REF.quantize(W * 2, "q8s/block32:f16", out=q, stream=None)
    assert again is q and q.to_data() == REF.quantize(W * 2, "q8s/block32:f16").to_data()
    with pytest.raises(InputError, match=r"quantize out= takes a QTensor of backend 'reference' with shape \(6, 32\) "
                                         r"and scheme q4s/block32:f16, got QTensor"):
        REF.quantize(W, "q4s/block32:f16", out=q)


def test_adopt_payload_parts_and_error_stats_defaults():
    q = REF.quantize(W, "q4s/block32:f16/order:high")  # a field order (docs/spec.md) the parts carry moved
    d = q.to_data()
    assert REF.adopt(d, np.frombuffer(d.payload, np.uint8)).to_data() == d
    assert b"".join(p.tobytes() for p in REF.payload_parts(q)) == d.payload
    assert REF.error_stats(W, q) == error_stats(W, q.numpy())


class _Counting(ReferenceBackend):
    """The reference maths, counting the capability calls a whole-model run makes."""

    name = "counting"
    priority = 1000
    calls: list = []

    def payload_parts(self, q):
        self.calls.append("payload_parts")
        return super().payload_parts(q)

    def error_stats(self, x, q):
        self.calls.append("error_stats")
        return super().error_stats(x, q)


def test_auto_forwards_the_capabilities_so_whole_model_runs_take_the_fast_paths(fresh_registry, tmp_path,
                                                                                   monkeypatch):
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    registry.register(_Counting())
    _Counting.calls.clear()
    save_file({"a.weight": W, "b.weight": W[::-1].copy()}, str(tmp_path / "m.safetensors"))
    res = qcore.quantize_model(tmp_path / "m.safetensors", tmp_path / "q.safetensors", "q8s/block32:f16")
    assert sorted(_Counting.calls) == ["error_stats"] * 2 + ["payload_parts"] * 2
    q = AutoBackend().quantize(W, "q8s/block32:f16")
    assert q.backend.name == "counting" and b"".join(p.tobytes() for p in AutoBackend().payload_parts(q)) == \
        q.to_data().payload
    assert [r.sqnr for r in res.tensors if r.scheme] == [error_stats(W, q.numpy())[0]] * 2
    assert AutoBackend().transpose(q).shape == (32, 6)


def test_qtensor_to_a_name_goes_through_the_registry():
    q = REF.quantize(W, "q8s")
    assert q.to("ndarray").backend.name == "ndarray" and q.to("ndarray").to_data() == q.to_data()
    with pytest.raises(qcore.BackendNotFoundError, match="no backend named 'nope'"):
        q.to("nope")
