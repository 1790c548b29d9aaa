"""torchao NVFP4 checkpoints: files written by torchao itself (scripts/make_torchao_fixture.py), read
bit-identically on every backend, written back byte for byte; the swizzled scale layout."""
import json
import os

import ml_dtypes  # noqa: F401  (bfloat16 in the reference file)
import numpy as np
import pytest
from safetensors import safe_open

import qcore
import qcore.formats as qf
from qcore.formats import UnrepresentableError
from qcore.formats.torchao import from_blocked, to_blocked
from qcore.files.stfile import Reader
from tests.formats_util import decode, get_backend
from tests.paths import DATA

FIXTURE = os.path.join(DATA, "torchao_nvfp4.safetensors")        # torchao's flatten_tensor_state_dict + save_file
REFERENCE = os.path.join(DATA, "torchao_nvfp4.ref.safetensors")  # NVFP4Tensor.dequantize() of each weight
EXPERTS = os.path.join(DATA, "torchao_nvfp4_experts.safetensors")
WEIGHTS = {"layers.0.proj.weight": "nvfp4", "layers.1.proj.weight": "e2m1/block16:ue4m3/packed_native",
           "layers.2.proj.weight": "nvfp4", "layers.3.experts.weight": "nvfp4"}


@pytest.fixture(scope="module")
def checkpoint():
    return qf.read(FIXTURE)


@pytest.mark.parametrize("name", list(WEIGHTS), ids=["two-level", "one-level-f32", "swizzled", "3-d"])
@pytest.mark.parametrize("be_name", ["reference", "cuda"])
def test_torchao_file_decodes_like_nvfp4tensor_dequantize(request, checkpoint, name, be_name):
    """qcore's decode, cast to the weight's orig_dtype, equals torchao's `dequantize()` bit for bit."""
    be = get_backend(be_name, request)
    d = checkpoint.tensors[name]
    assert d.scheme == qcore.scheme(WEIGHTS[name])
    with safe_open(REFERENCE, "np") as f:
        want = f.get_tensor(name)
    got = decode(d, be).astype(want.dtype)  # torchao casts its f32 decode to orig_dtype (nearest even)
    assert got.shape == want.shape and got.tobytes() == want.tobytes()


def test_detected_and_other_tensors_kept(checkpoint):
    assert qf.detect(FIXTURE).name == "torchao"
    assert checkpoint.tensors["layers.0.proj.bias"].dtype == np.dtype(ml_dtypes.bfloat16)
    act = checkpoint.tensors["layers.0.proj._weight_act_per_tensor_scale"]
    assert act.shape == () and act.dtype == np.float32
    kept = json.loads(checkpoint.metadata["torchao.tensors"])
    assert kept["layers.2.proj.weight"]["is_swizzled_scales"] is True


def test_torchaos_file_comes_back_byte_for_byte(tmp_path):
    """Read and write again: every tensor (dtype, shape, bytes) and the whole metadata are
    torchao's, the swizzled scales re-swizzled and the activation scale listed as its data."""
    report = qf.convert(FIXTURE, tmp_path / "o.safetensors", "torchao")
    assert report.lossless
    a, b = Reader(FIXTURE), Reader(str(tmp_path / "o.safetensors"))
    with safe_open(FIXTURE, "np") as f, safe_open(str(tmp_path / "o.safetensors"), "np") as g:
        assert f.metadata() == g.metadata()
        assert sorted(f.keys()) == sorted(g.keys())
        for k in f.keys():
            x, y = a.read(k), b.read(k)
            assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), k


def test_qcore_nvfp4_is_written_with_torchaos_defaults(tmp_path):
    """A tensor quantized in qcore: torchao's key names and JSON, not swizzled, orig_dtype float32;
    the values, scales and global are the payload's bytes."""
    x = np.random.default_rng(2).standard_normal((8, 64)).astype(np.float32)
    q = qcore.quantize(x, "nvfp4/round:rne", backend="reference").to_data()
    qcore.save(tmp_path / "a.safetensors", {"m.w": q, "m.b": np.zeros(8, np.float32)})
    qf.convert(tmp_path / "a.safetensors", tmp_path / "o.safetensors", "torchao")
    with safe_open(str(tmp_path / "o.safetensors"), "np") as f:
        meta = f.metadata()
        assert sorted(json.loads(meta["tensor_names"])) == ["m.b", "m.w"]
        assert json.loads(meta["m.w"]) == {
            "_type": "NVFP4Tensor",
            "_data": {"is_swizzled_scales": False, "use_triton_kernel": False, "act_quant_kwargs": None,
                      "block_size": 16, "orig_dtype": {"_type": "torch.dtype", "_data": "float32"}},
            "_tensor_data_names": ["per_tensor_scale", "qdata", "scale"]}
        assert json.loads(meta["m.b"]) == {"_type": "Tensor"}
        assert f.get_tensor("m._w_per_tensor_scale").shape == ()
    back = qf.read(tmp_path / "o.safetensors").tensors["m.w"]
    assert back.payload == q.payload and back.scheme == qcore.scheme("nvfp4")


@pytest.mark.parametrize("rows,cols", [(1, 1), (130, 3), (128, 4), (300, 9)])
def test_blocked_layout_round_trips(rows, cols):
    s = np.arange(rows * cols, dtype=np.uint16).reshape(rows, cols)
    b = to_blocked(s)
    assert b.shape == (32 * -(-rows // 128), 16 * -(-cols // 4))
    assert np.array_equal(from_blocked(b.reshape(-1), rows, cols), s)


def test_blocked_layout_is_cublas_tile_order():
    """In a 128 x 4 tile, row r and column c sit at (r % 32, 4 * (r // 32) + c) of the 32 x 16
    stored tile (cuBLAS' block-scaling-factor layout, torchao's to_blocked)."""
    s = np.arange(128 * 4).reshape(128, 4)
    b = to_blocked(s)
    for r, c in [(0, 0), (1, 0), (31, 3), (32, 0), (97, 2), (127, 3)]:
        assert b[r % 32, 4 * (r // 32) + c] == s[r, c]


def test_per_expert_scales_are_refused():
    with pytest.raises(UnrepresentableError, match=r"per-expert scale of shape \[2, 1, 1\]"):
        qf.read(EXPERTS)


@pytest.mark.parametrize("text,shape,why", [("mxfp4", (2, 64), "torchao holds NVFP4"),
                                             ("nvfp4", (64,), r"\[\.\.\., m, k\]")])
def test_what_torchao_cannot_hold_is_refused(tmp_path, text, shape, why):
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    qcore.save(tmp_path / "a.safetensors", {"w": qcore.quantize(x, text, backend="reference")})
    with pytest.raises(UnrepresentableError, match=why):
        qf.convert(tmp_path / "a.safetensors", tmp_path / "o.safetensors", "torchao")
    assert not (tmp_path / "o.safetensors").exists()
