"""No quantized tensor passes as a plain array: codes beside their scale that no reader decodes are
a one-line `InvalidDataError` naming them (`qcore.formats.read`, `qcore.convert`, `qcore convert`,
`qcore inspect`), so a conversion that reports "lossless" moved only what crossed bit for bit."""
import os

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

import qcore
import qcore.formats as qf
from qcore import InvalidDataError
from qcore.cli.main import main
from tests.paths import DATA

F8 = ml_dtypes.float8_e4m3fn

# layout -> (the file's tensors, the codes and the scale the error names); each is a layout qcore has
# no reader for, so the file is detected as a plain safetensors file (or the reader leaves it)
UNREAD = {
    "fp8-e5m2-weight-scale": ({"m.weight": np.zeros((4, 32), ml_dtypes.float8_e5m2),
                               "m.weight_scale": np.ones((4, 1), np.float32)}, "m.weight", "m.weight_scale"),
    "modelopt-nvfp4": ({"m.weight": np.zeros((4, 16), np.uint8), "m.weight_scale": np.ones((4, 2), F8),
                        "m.weight_scale_2": np.ones((), np.float32)}, "m.weight", "m.weight_scale"),
    "gptq": ({"m.qweight": np.zeros((8, 64), np.int32), "m.scales": np.ones((1, 64), np.float16),
              "m.qzeros": np.zeros((1, 8), np.int32)}, "m.qweight", "m.scales"),
    "bnb-without-quant-state": ({"w": np.zeros((32, 1), np.uint8), "w.absmax": np.ones(1, np.float32)},
                                "w", "w.absmax"),
    "llm-int8": ({"m.weight": np.zeros((4, 64), np.int8), "m.weight.SCB": np.ones(4, np.float32)},
                 "m.weight", "m.weight.SCB"),
    "fp8-scale-inv-e5m2": ({"m.weight": np.zeros((4, 32), ml_dtypes.float8_e5m2),
                            "m.weight_scale_inv": np.ones((1, 1), np.float32)}, "m.weight", "m.weight_scale_inv"),
}


def _file(tmp_path, layout):
    tensors, codes, scale = UNREAD[layout]
    path = tmp_path / "model.safetensors"
    save_file({**tensors, "norm.weight": np.ones(32, np.float32)}, str(path))
    return path, codes, scale


@pytest.mark.parametrize("layout", list(UNREAD))
def test_read_and_convert_refuse_codes_no_reader_decodes(tmp_path, layout):
    path, codes, scale = _file(tmp_path, layout)
    with pytest.raises(InvalidDataError, match=rf"tensor '{codes}' \(.*\) beside '{scale}' is a quantized tensor"):
        qf.read(path)
    with pytest.raises(InvalidDataError, match=rf"tensor '{codes}'"):
        qcore.convert(path, tmp_path / "out.safetensors", "qcore")
    assert not (tmp_path / "out.safetensors").exists()


@pytest.mark.parametrize("command", ["inspect", "convert"])
def test_the_command_line_says_so_in_one_line(tmp_path, capsys, command):
    path, codes, _ = _file(tmp_path, "gptq")
    args = [command, str(path)] + ([str(tmp_path / "o.safetensors"), "--to", "qcore"] if command == "convert" else [])
    assert main(args) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"qcore: error: {path}: tensor '{codes}' (int32 [8, 64])"), err


def test_a_qcore_file_holding_such_arrays_is_refused_too(tmp_path):
    """A qcore file whose plain arrays are int8 codes and their scale (as an older convert of a W8A8
    checkpoint left them) is refused the same way, whichever format reads it."""
    qcore.save(str(tmp_path / "q.safetensors"), {"m.weight": np.ones((4, 64), np.int8),
                                                 "m.weight_scale": np.ones((4, 1), ml_dtypes.bfloat16)})
    with pytest.raises(InvalidDataError, match="tensor 'm.weight' .* beside 'm.weight_scale'"):
        qf.read(tmp_path / "q.safetensors")


def test_integer_and_float8_tensors_without_a_scale_are_plain(tmp_path):
    """Integer tensors without a scale named for them (a position table, an activation zero point
    beside its own scale) and float tensors beside a scale read as arrays, as before."""
    save_file({"pos_ids": np.arange(8, dtype=np.int32), "m.input_zero_point": np.zeros(1, np.int8),
               "m.input_scale": np.ones(1, np.float32), "m.weight": np.ones((4, 8), ml_dtypes.bfloat16),
               "m.weight_scale": np.ones((4, 1), np.float32), "e.weight": np.zeros((4, 8), F8)},
              str(tmp_path / "p.safetensors"))
    ck = qf.read(tmp_path / "p.safetensors")
    assert ck.format == "qcore" and all(isinstance(v, np.ndarray) for v in ck.tensors.values())


@pytest.mark.parametrize("src", ["ctensors_w8a8", "fp8"])
def test_to_gguf_is_refused_not_reported_lossless(tmp_path, capsys, src):
    """W8A8 int8 and DeepSeek FP8 weights are read as q8f / e4m3, which GGUF does not hold: `--to gguf`
    names the first such tensor (before, they crossed as plain int8 / float8 arrays, "lossless")."""
    pytest.importorskip("gguf", reason="the gguf package is not installed (pip install 'qcore-quant[formats]')")
    path = os.path.join(DATA, src, "model.safetensors")
    assert main(["convert", path, str(tmp_path / "o.gguf"), "--to", "gguf"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot be written as gguf exactly" in err and "lossless" not in err
    assert not (tmp_path / "o.gguf").exists()
    assert main(["convert", path, str(tmp_path / "o.gguf"), "--to", "gguf", "--from", "qcore"]) == 1
    assert "is a quantized tensor in a layout the qcore reader does not decode" in capsys.readouterr().err
