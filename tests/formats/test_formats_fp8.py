"""DeepSeek/Qwen-style FP8 (`X` float8_e4m3fn + `X_scale_inv`, `quant_method: fp8`) <-> qcore e4m3.

tests/data/fp8 was written with transformers 5.25.0's own `Fp8Quantize`, and `expected.safetensors`
holds its `Fp8Dequantize` output (DeepSeek-V3's `weight_dequant` rule for the grid with partial
blocks, which `Fp8Dequantize` does not take); tests/data/fp8/make_fp8.py, whose `--check` mode runs
the tool's decode on a checkpoint qcore wrote."""
import json
import os

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

import qcore
import qcore.formats as qf
from qcore import InvalidDataError
from qcore.cli.main import main
from qcore.formats import UnrepresentableError
from qcore.files.stfile import Reader
from tests.formats_util import BACKENDS, decode, get_backend
from tests.paths import DATA

DATA = os.path.join(DATA, "fp8")
MODEL = os.path.join(DATA, "model.safetensors")
SCHEMES = {  # weight -> the qcore scheme it reads as
    "model.layers.0.self_attn.q_proj.weight": "e4m3/block128x128:f32",  # [128, 256]: two blocks
    "model.layers.0.self_attn.k_proj.weight": "e4m3/block128x128:f32",  # [64, 64]: one partial block
    "model.layers.0.self_attn.o_proj.weight": "e4m3/block96:f32",  # per channel: scale [64, 1]
    "model.layers.0.mlp.experts.gate_up_proj": "e4m3/block96:f32",  # fused experts [2, 16, 96], per channel
    "model.layers.0.self_attn.v_proj.weight": "e4m3",  # per tensor: a scale of shape []
    "model.layers.0.mlp.down_proj.weight": "e4m3/block128x128:f32",  # [136, 40]: DeepSeek's ceil grid [2, 1]
    "model.layers.0.mlp.up_proj.weight": "e4m3/block32x64:ue8m0",  # scale_fmt ue8m0: float8_e8m0fnu scales
}
BLOCKED = [n for n, s in SCHEMES.items() if s == "e4m3/block128x128:f32"]


def _arrays(path):
    with Reader(str(path)) as r:
        return {n: r.read(n) for n in r.tensors}


def _copy(tmp_path, names=None, config=True):
    """The fixture (only the weights `names` and their scales, if given) in `tmp_path`, with its config."""
    arrays = _arrays(MODEL)
    if names is not None:
        arrays = {k: v for k, v in arrays.items() if k in names or k.removesuffix("_scale_inv") in names}
    save_file(arrays, str(tmp_path / "model.safetensors"))
    if config:
        (tmp_path / "config.json").write_text(open(os.path.join(DATA, "config.json")).read())
    return tmp_path / "model.safetensors"


def test_reads_as_qcore_e4m3():
    assert qf.detect(MODEL).name == "fp8"
    ck = qf.read(MODEL)
    got = {k: str(v.scheme) for k, v in ck.tensors.items() if isinstance(v, qcore.QuantizedData)}
    assert got == {k: str(qcore.scheme(v)) for k, v in SCHEMES.items()}
    assert ck.tensors["model.layers.0.mlp.down_proj.weight"].scales().shape == (2, 1)
    assert ck.tensors["model.layers.0.mlp.experts.gate_up_proj"].shape == (2, 16, 96)
    assert ck.tensors["model.layers.0.self_attn.q_proj.activation_scale"].dtype == np.float32  # passes through
    assert json.loads(ck.metadata["fp8.config"])["weight_block_size"] == [128, 128]


@pytest.mark.parametrize("name", list(SCHEMES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_is_the_tools_own(request, backend, name):
    """qcore's f32 dequantize is transformers' `Fp8Dequantize` (DeepSeek's `weight_dequant` for the
    partial grid) bit for bit, and cast to bf16 it is the tool's bf16 output."""
    be = get_backend(backend, request)
    want = _arrays(os.path.join(DATA, "expected.safetensors"))
    got = decode(qf.read(MODEL).tensors[name], be)
    assert got.dtype == np.float32 and got.view(np.uint32).tobytes() == want[name].view(np.uint32).tobytes(), name
    if name + ".bf16" in want:
        assert got.astype(ml_dtypes.bfloat16).view(np.uint16).tobytes() == want[name + ".bf16"].view(np.uint16).tobytes()


def test_without_the_config_the_grid_that_divides_gives_the_blocks(tmp_path):
    """Without config.json a grid that divides the weight gives blocks of weight / grid, as
    `Fp8Dequantize` derives them: the [136, 40] weight's [2, 1] grid is then 68 x 40 blocks."""
    ck = qf.read(_copy(tmp_path, config=False))
    assert str(ck.tensors["model.layers.0.mlp.down_proj.weight"].scheme) == "e4m3/block68x40:f32"
    assert str(ck.tensors["model.layers.0.self_attn.q_proj.weight"].scheme) == "e4m3/block128x128:f32"


@pytest.mark.parametrize("scale,why", [
    (np.ones((3, 1), np.float32), r"a scale grid \[3, 1\] neither divides the weight \[136, 40\]"),
    (np.ones(2, np.float32), r"a scale of shape \[2\] is not one per block"),
    (np.full((2, 1), -1.0, np.float32), r"scale 0 is -1.0; SPEC scales are finite and >= 0"),
    (np.full((2, 1), np.nan, np.float32), r"scale 0 is nan"),
    (np.ones((2, 1), np.uint8), r"scale dtype uint8 is not f32, f16, bf16 or float8_e8m0fnu"),
    (np.full((2, 1), 255, np.uint8).view(ml_dtypes.float8_e8m0fnu), r"scale 0 is nan"),  # E8M0 byte 255
])
def test_scales_it_cannot_place_or_hold_are_refused(tmp_path, scale, why):
    arrays = _arrays(MODEL)
    arrays["model.layers.0.mlp.down_proj.weight_scale_inv"] = scale
    save_file(arrays, str(tmp_path / "model.safetensors"))
    with pytest.raises(UnrepresentableError, match=r"tensor 'model.layers.0.mlp.down_proj.weight': " + why):
        qf.read(tmp_path / "model.safetensors")


def test_an_fp8_file_with_an_e5m2_weight_is_refused(tmp_path):
    arrays = _arrays(MODEL)
    arrays["model.layers.0.self_attn.q_proj.weight"] = arrays["model.layers.0.self_attn.q_proj.weight"].view(
        ml_dtypes.float8_e5m2)
    save_file(arrays, str(tmp_path / "model.safetensors"))
    with pytest.raises(UnrepresentableError, match="the weight is float8_e5m2 .128, 256.; the fp8 format holds "
                                                   "float8_e4m3fn"):
        qf.read(tmp_path / "model.safetensors")


def test_round_trip_through_qcore_gives_the_files_bytes_and_config(tmp_path):
    """fp8 -> qcore's file -> fp8 gives the tensors byte for byte and `weight_block_size` [128, 128]
    (transformers decodes what qcore wrote: make_fp8.py --check)."""
    src = _copy(tmp_path, names=BLOCKED + ["model.norm.weight"])
    assert qcore.convert(src, tmp_path / "q.safetensors", "qcore").lossless
    (tmp_path / "out").mkdir()
    report = qcore.convert(tmp_path / "q.safetensors", tmp_path / "out" / "model.safetensors", "fp8")
    assert report.lossless and {t.action for t in report.tensors} == {"rearranged", "copied"}
    a, b = _arrays(src), _arrays(tmp_path / "out" / "model.safetensors")
    assert {n: (v.dtype, v.shape, v.tobytes()) for n, v in a.items()} == \
        {n: (v.dtype, v.shape, v.tobytes()) for n, v in b.items()}
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert cfg == {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}


def test_writing_needs_one_block_size(tmp_path):
    """The config has one weight_block_size: per-channel scales and mixed blocks are refused."""
    with pytest.raises(UnrepresentableError, match="per-channel scales have no weight_block_size form"):
        qcore.convert(MODEL, tmp_path / "o.safetensors", "fp8")
    ref = qcore.backend("reference")
    x = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    mixed = {"a": ref.into_data(ref.quantize(x, "e4m3/block32x32:f32")),
             "b": ref.into_data(ref.quantize(x, "e4m3/block16x64:f32"))}
    with pytest.raises(UnrepresentableError, match=r"one weight_block_size for every weight, got \[16, 64\], \[32, 32\]"):
        qf.write(tmp_path / "o.safetensors", mixed, "fp8")


def test_inspect_shows_the_schemes(capsys):
    assert main(["inspect", MODEL]) == 0
    out = capsys.readouterr().out
    assert "(fp8 checkpoint, read as qcore schemes)" in out and "e4m3/block128x128:f32" in out


def test_an_fp8_weight_whose_scale_the_reader_leaves_is_not_plain(tmp_path):
    """Forced through qcore's own reader, the fp8 file's codes are not passed on as plain arrays."""
    with pytest.raises(InvalidDataError, match=r"tensor 'model.layers.0.mlp.down_proj.weight' \(float8_e4m3fn "
                                               r"\[136, 40\]\) beside 'model.layers.0.mlp.down_proj.weight_scale_inv'"):
        qf.read(MODEL, "qcore")
