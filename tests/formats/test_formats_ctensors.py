"""compressed-tensors (`pack-quantized` int4/int8, symmetric or with zero points, `float-quantized`
FP8, `mxfp4-` and `nvfp4-pack-quantized`, 2-D and fused-expert `[e, m, n]`) <-> qcore.

The checkpoint in tests/data/ctensors was written by compressed-tensors 0.20.0's own compressors,
and `expected.safetensors` holds its own decompressor's output (tests/data/ctensors/make_ctensors.py;
its `--check` mode runs the tool's code on a checkpoint qcore wrote)."""

import json
import os

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

import qcore
import qcore.formats as qf
from qcore.formats import UnrepresentableError
from qcore.formats.ctensors import CompressedTensorsFormat
from qcore.files.stfile import Reader
from tests.formats_util import BACKENDS, decode, get_backend
from tests.paths import DATA as TEST_DATA

DATA = os.path.join(TEST_DATA, "ctensors")
MODEL = os.path.join(DATA, "model.safetensors")
SCHEMES = {  # module weight -> the qcore scheme it reads as
    "layers.0.q_proj.weight": "q4f/block32:bf16",  # int4, group 32, bf16 scales
    "layers.0.k_proj.weight": "q4f/block64:f16",  # int4, channel (a row of 64), f16 scales
    "layers.0.v_proj.weight": "q8f/block16:f32/packed_u32",  # int8, group 16, f32 scales
    "layers.0.o_proj.weight": "e4m3/block64:bf16",  # fp8, channel
    "layers.0.up_proj.weight": "e4m3",  # fp8, tensor, f32 scale
    "layers.0.down_proj.weight": "e4m3/block8x16:bf16",  # fp8, 8 x 16 blocks
    "layers.0.gate_proj.weight": "mxfp4",  # mxfp4-pack-quantized: uint8 nibbles + E8M0 bytes
    # nvfp4-pack-quantized: nibbles + FP8 block scales + the reciprocal global (docs/spec.md, reciprocal global scale)
    "layers.1.gate_proj.weight": "e2m1/block16:ue4m3/tensor:f32:recip/packed_native",
    # fused experts [2, 8, n]: int4 groups of 32 and fp8 per channel, blocks along the last axis
    "layers.2.experts.w1.weight": "q4f/block32:bf16/packed_u32",
    "layers.2.experts.w2.weight": "e4m3/block32:bf16",
    # fused-expert FP4 [2, 4, 64]: mxfp4, and nvfp4 with the module's one [1] global
    "layers.3.experts.w1.weight": "mxfp4",
    "layers.3.experts.w2.weight": "e2m1/block16:ue4m3/tensor:f32:recip/packed_native",
    # asymmetric int (weight_zero_point): zero points as qcore's per-slot offsets (docs/spec.md, affine offsets)
    "layers.4.q_proj.weight": "q4f/block32:bf16/zero",  # int4, group 32, zero points packed down the rows
    "layers.4.k_proj.weight": "q8f/block64:f16/packed_u32/zero",  # int8, channel; 6 rows: a partly filled word
    "layers.4.v_proj.weight": "q4f/zero",  # int4, tensor: one f32 scale and one int8 zero point
    "layers.4.o_proj.weight": "q8f/block8x16:bf16/packed_u32/zero",  # int8, 8 x 16 blocks, int8 zero points
    "layers.5.experts.w1.weight": "q4f/block32:bf16/zero",  # fused experts [2, 12, 64], int4 group 32
}
SHAPES = {"layers.2.experts.w1.weight": (2, 8, 64), "layers.2.experts.w2.weight": (2, 8, 32),
          "layers.3.experts.w1.weight": (2, 4, 64), "layers.3.experts.w2.weight": (2, 4, 64),
          "layers.4.k_proj.weight": (6, 64), "layers.5.experts.w1.weight": (2, 12, 64)}
ASYM = [k for k, v in SCHEMES.items() if v.endswith("/zero")]
NV3 = "layers.3.experts.w2"  # the fused-expert nvfp4 module


def _arrays(path):
    with Reader(path) as r:
        return {n: r.read(n) for n in r.tensors}


def test_reads_as_qcore_schemes():
    ck = qf.read(MODEL)
    assert ck.format == "compressed-tensors" and qf.detect(MODEL).name == "compressed-tensors"
    got = {k: str(v.scheme) for k, v in ck.tensors.items() if isinstance(v, qcore.QuantizedData)}
    assert got == {k: str(qcore.scheme(v)) for k, v in SCHEMES.items()}
    for name, shape in SHAPES.items():
        assert ck.tensors[name].shape == shape, name
    assert ck.tensors["norm.weight"].dtype == ml_dtypes.bfloat16  # unquantized tensors pass through
    assert json.loads(ck.metadata["compressed-tensors.config"])["quant_method"] == "compressed-tensors"


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_is_the_tools_own(request, backend):
    """qcore's dequantize, rounded to the scale's dtype, equals compressed-tensors' decompress bit for bit."""
    be = get_backend(backend, request)
    want = _arrays(os.path.join(DATA, "expected.safetensors"))
    ck = qf.read(MODEL)
    for name in SCHEMES:
        d = ck.tensors[name]
        if not be.supports(d.scheme):
            continue
        got = decode(d, be).astype(want[name].dtype)
        assert got.shape == want[name].shape, (backend, name)
        assert got.view(np.uint8).tobytes() == want[name].view(np.uint8).tobytes(), (backend, name)


def _tool_zero_points(zp: np.ndarray, bits: int, rows: int) -> np.ndarray:
    """The tool's `unpack_from_int32(zp, bits, ..., packed_dim=0)` spelled out word by word: word
    w of column g holds rows `w * 32 / bits + k` in bits `bits * k`, offset binary."""
    per = 32 // bits
    *lead, words, cols = zp.shape
    u = zp.view(np.uint32)
    out = np.zeros((*lead, rows, cols), np.int64)
    for idx in np.ndindex(*lead, words, cols):
        *e, w, g = idx
        for k in range(per):
            field = (int(u[idx]) >> (bits * k)) & ((1 << bits) - 1)
            if w * per + k < rows:
                out[(*e, w * per + k, g)] = field - (1 << (bits - 1))
            else:
                assert field == 0, idx  # the unused fields of a last, partly filled word
    return out


@pytest.mark.parametrize("name", ASYM)
@pytest.mark.parametrize("backend", BACKENDS)
def test_asymmetric_decode_is_the_tools_own(request, backend, name):
    """`(q - z) * scale` in the scale's dtype (the tool's decompress) is qcore's `f32(f32(q - z) * e)`
    rounded to that dtype, bit for bit, on every backend with the scheme (others skip, saying why)."""
    be = get_backend(backend, request)
    d = qf.read(MODEL).tensors[name]
    want = _arrays(os.path.join(DATA, "expected.safetensors"))[name]
    got = decode(d, be).astype(want.dtype)
    assert got.shape == want.shape and got.view(np.uint8).tobytes() == want.view(np.uint8).tobytes(), name
    assert np.any(d.offsets() != 0)  # the zero points take part: the tool's own, not all 0


def test_asymmetric_zero_points_are_the_tools():
    """The zero points qcore reads are the tool's: packed down the rows for group and channel
    (the 6-row int8 channel module and the 12-row 4-bit experts end in a partly filled word),
    int8 as they are for tensor and block; the codes are the symmetric case's."""
    ck, arrays = qf.read(MODEL), _arrays(MODEL)
    for name in ASYM:
        mod, d = name[: -len(".weight")], ck.tensors[name]
        zp = arrays[f"{mod}.weight_zero_point"]
        if zp.dtype == np.int32:
            want = _tool_zero_points(zp, d.scheme.bits, d.shape[-2])
        else:
            assert zp.dtype == np.int8, name
            want = zp.astype(np.int64)
        assert d.offsets().shape == tuple(qcore.spec.layout.grid_shape(d.shape, d.scheme)), name
        assert d.offsets().reshape(-1).tolist() == want.reshape(-1).tolist(), name
        lo, hi = d.scheme.traits.qmin, d.scheme.traits.qmax
        if d.scheme.bits == 4 and d.offsets().size > 8:  # the fixture's zero points reach both ends
            assert d.offsets().min() == lo and d.offsets().max() == hi, name
    assert arrays["layers.4.k_proj.weight_zero_point"].shape == (2, 1)  # ceil(6 * 8 / 32) words
    assert arrays["layers.5.experts.w1.weight_zero_point"].shape == (2, 2, 2)  # per expert, ceil(12 * 4 / 32)
    assert arrays["layers.4.v_proj.weight_zero_point"].shape == (1,)


def test_writes_the_tools_bytes_and_config(tmp_path):
    """qcore's writer gives back the tool's file tensor for tensor, and a config.json whose
    groups name each module with its strategy (the tool parses it: make_ctensors.py --check)."""
    out = tmp_path / "model.safetensors"
    report = qcore.convert(MODEL, out, "compressed-tensors")
    assert report.lossless and {t.action for t in report.tensors} == {"rearranged", "copied"}
    src, dst = _arrays(MODEL), _arrays(out)
    assert sorted(src) == sorted(dst)
    for name in src:
        assert (src[name].dtype, src[name].shape) == (dst[name].dtype, dst[name].shape), name
        assert src[name].tobytes() == dst[name].tobytes(), name
    cfg = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "compressed-tensors" and cfg["format"] == "mixed-precision"
    by_module = {t: g for g in cfg["config_groups"].values() for t in g["targets"]}
    assert by_module["layers.0.q_proj"]["weights"] == {"num_bits": 4, "type": "int", "symmetric": True,
                                                          "dynamic": False, "strategy": "group", "group_size": 32}
    assert by_module["layers.0.q_proj"]["format"] == "pack-quantized"
    assert by_module["layers.0.k_proj"]["weights"]["strategy"] == "channel"
    assert by_module["layers.0.up_proj"]["weights"]["strategy"] == "tensor"
    assert by_module["layers.0.down_proj"]["weights"]["block_structure"] == [8, 16]
    assert by_module["layers.0.o_proj"]["format"] == "float-quantized"
    assert by_module["layers.0.gate_proj"]["format"] == "mxfp4-pack-quantized"
    assert by_module["layers.0.gate_proj"]["weights"]["scale_dtype"] == "torch.uint8"
    assert by_module["layers.1.gate_proj"]["format"] == "nvfp4-pack-quantized"
    assert by_module["layers.1.gate_proj"]["weights"] == {
        "num_bits": 4, "type": "float", "symmetric": True, "group_size": 16, "strategy": "tensor_group",
        "dynamic": False, "scale_dtype": "torch.float8_e4m3fn"}
    assert by_module["layers.3.experts.w1"]["format"] == "mxfp4-pack-quantized"
    assert by_module[NV3]["format"] == "nvfp4-pack-quantized"
    assert by_module[NV3]["weights"] == by_module["layers.1.gate_proj"]["weights"]
    assert dst[f"{NV3}.weight_global_scale"].shape == (1,)  # one global for the module, as the tool writes it
    assert by_module["layers.4.q_proj"]["weights"] == {"num_bits": 4, "type": "int", "symmetric": False,
                                                       "dynamic": False, "strategy": "group", "group_size": 32}
    assert by_module["layers.4.q_proj"]["format"] == "pack-quantized"
    assert by_module["layers.4.k_proj"]["weights"] == {"num_bits": 8, "type": "int", "symmetric": False,
                                                       "dynamic": False, "strategy": "channel"}
    assert by_module["layers.4.v_proj"]["weights"]["strategy"] == "tensor"
    assert by_module["layers.4.o_proj"]["weights"]["block_structure"] == [8, 16]
    assert {by_module[n[: -len(".weight")]]["weights"]["symmetric"] for n in ASYM} == {False}
    assert by_module["layers.0.q_proj"] is not by_module["layers.4.q_proj"]  # their own groups


def test_through_qcore_format_and_back(tmp_path):
    """compressed-tensors -> qcore's own file -> compressed-tensors: the same tensors."""
    qcore.convert(MODEL, tmp_path / "q.safetensors", "qcore")
    (tmp_path / "ct").mkdir()
    qcore.convert(tmp_path / "q.safetensors", tmp_path / "ct" / "model.safetensors", "compressed-tensors")
    src, back = _arrays(MODEL), _arrays(tmp_path / "ct" / "model.safetensors")
    assert {n: a.tobytes() for n, a in src.items()} == {n: a.tobytes() for n, a in back.items()}


def test_config_json_keeps_the_models_other_keys(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": {"old": 1}}))
    qcore.convert(MODEL, tmp_path / "model.safetensors", "compressed-tensors")
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["quantization_config"]["quant_method"] == "compressed-tensors"


def test_quantized_by_qcore_writes_as_compressed_tensors(tmp_path):
    """A model quantized by qcore in a scheme compressed-tensors holds loads as the tool's layout."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    ref = qcore.backend("reference")
    q = ref.quantize(w, "q4f/block32:bf16")
    qf.write(tmp_path / "m.safetensors", {"blk.weight": ref.into_data(q)}, "compressed-tensors")
    arrays = _arrays(tmp_path / "m.safetensors")
    assert arrays["blk.weight_packed"].dtype == np.int32 and arrays["blk.weight_packed"].shape == (8, 8)
    assert arrays["blk.weight_scale"].dtype == ml_dtypes.bfloat16 and arrays["blk.weight_scale"].shape == (8, 2)
    assert list(arrays["blk.weight_shape"]) == [8, 64]
    back = qf.read(tmp_path / "m.safetensors").tensors["blk.weight"]
    assert back == ref.into_data(q)


@pytest.mark.parametrize("text", ["mxfp4", "e2m1/block16:ue4m3/tensor:f32:recip/packed_native/round:rne"])
@pytest.mark.parametrize("shape", [(2, 4, 64), (2, 3, 2, 96)])
def test_fused_expert_fp4_quantized_by_qcore_writes_as_the_tools_layout(tmp_path, text, shape):
    """A qcore mxfp4 / nvfp4 (reciprocal global) tensor of more than 2 dims writes as nibbles
    `[..., m, n/2]`, scales `[..., m, n/G]` and one `[1]` global, and reads back byte for byte."""
    ref = qcore.backend("reference")
    x = np.random.default_rng(6).standard_normal(shape).astype(np.float32)
    x *= np.exp2(np.arange(shape[0], dtype=np.float32) * 3).reshape(-1, *([1] * (len(shape) - 1)))
    d = ref.into_data(ref.quantize(x, text))
    qf.write(tmp_path / "m.safetensors", {"e.weight": d}, "compressed-tensors")
    arrays = _arrays(tmp_path / "m.safetensors")
    *lead, n = shape
    group = 32 if text == "mxfp4" else 16
    assert arrays["e.weight_packed"].dtype == np.uint8 and arrays["e.weight_packed"].shape == (*lead, n // 2)
    assert arrays["e.weight_scale"].shape == (*lead, n // group)
    assert arrays["e.weight_packed"].tobytes() == d.values_bytes()
    if text == "mxfp4":
        assert arrays["e.weight_scale"].dtype == np.uint8 and "e.weight_global_scale" not in arrays
    else:
        assert arrays["e.weight_scale"].dtype == ml_dtypes.float8_e4m3fn
        assert arrays["e.weight_global_scale"].shape == (1,)
        assert arrays["e.weight_global_scale"].tobytes() == np.float32(d.global_scale()).tobytes()
    back = qf.read(tmp_path / "m.safetensors").tensors["e.weight"]
    assert back.shape == shape and back.payload == d.payload and back.scheme == d.scheme.payload_form


def test_the_nvfp4_global_is_the_tensors_own(tmp_path):
    """The global of an nvfp4 module is read into its tensor, not kept beside it as an array, so a
    tensor replaced in the checkpoint is written with its own global, not the file's old one."""
    ck = qf.read(MODEL)
    assert not [k for k in ck.tensors if k.endswith("weight_global_scale")]
    ref = qcore.backend("reference")
    x = np.random.default_rng(7).standard_normal((2, 4, 64)).astype(np.float32) * 100
    new = ref.into_data(ref.quantize(x, SCHEMES[f"{NV3}.weight"]))
    ck.tensors[f"{NV3}.weight"] = new
    qf.write(tmp_path / "m.safetensors", ck, "compressed-tensors")
    got = _arrays(tmp_path / "m.safetensors")[f"{NV3}.weight_global_scale"]
    old = _arrays(MODEL)[f"{NV3}.weight_global_scale"]
    assert got.tobytes() == np.float32(new.global_scale()).tobytes() != old.tobytes()
    assert qf.read(tmp_path / "m.safetensors").tensors[f"{NV3}.weight"] == new


def test_per_expert_nvfp4_globals_are_refused(tmp_path):
    """compressed-tensors 0.20 gives an nvfp4 module one [1] global whatever the weight's rank;
    a global per expert (equal or not) is not one qcore global, so it is refused with the reason."""
    arrays = _arrays(MODEL)
    g = arrays[f"{NV3}.weight_global_scale"]
    for per_expert in (np.concatenate([g, g * 2]), np.concatenate([g, g]).reshape(2, 1)):
        bad = {**arrays, f"{NV3}.weight_global_scale": per_expert}
        save_file(bad, str(tmp_path / "pe.safetensors"))
        with pytest.raises(UnrepresentableError, match=r"weight_global_scale of shape \[2.*one global per tensor"):
            qf.read(tmp_path / "pe.safetensors", "compressed-tensors")


def test_fused_expert_fp4_scales_that_do_not_match_are_refused(tmp_path):
    """3-D mxfp4 / nvfp4 scales that are not one per block of the weight, and a 3-D E8M0 byte 255."""
    arrays = _arrays(MODEL)
    for key, value, why in (
            ("layers.3.experts.w1.weight_scale", arrays["layers.3.experts.w1.weight_scale"].reshape(2, 8, 1),
             "are not mxfp4"),
            ("layers.3.experts.w1.weight_scale", arrays["layers.3.experts.w1.weight_scale"][0], "are not mxfp4"),
            (f"{NV3}.weight_scale", arrays[f"{NV3}.weight_scale"].reshape(2, 8, 2), "are not nvfp4"),
            (f"{NV3}.weight_packed", arrays[f"{NV3}.weight_packed"].reshape(8, 32), "are not nvfp4")):
        save_file({**arrays, key: np.ascontiguousarray(value)}, str(tmp_path / "bad.safetensors"))
        with pytest.raises(UnrepresentableError, match=why):
            qf.read(tmp_path / "bad.safetensors", "compressed-tensors")
    scale = arrays["layers.3.experts.w1.weight_scale"].copy()
    scale[1, 3, 1] = 255
    save_file({**arrays, "layers.3.experts.w1.weight_scale": scale}, str(tmp_path / "ff.safetensors"))
    with pytest.raises(UnrepresentableError, match="255"):
        qf.read(tmp_path / "ff.safetensors", "compressed-tensors")


@pytest.mark.parametrize("text,shape,zp_shape,zp_dtype,strategy", [
    ("q4f/block32:bf16/zero", (12, 64), (2, 2), np.int32, "group"),  # 12 rows: a partly filled word
    ("q8f/block64:f16/packed_u32/zero", (6, 64), (2, 1), np.int32, "channel"),
    ("q4f/zero", (8, 64), (1,), np.int8, "tensor"),
    ("q8f/block8x16:bf16/packed_u32/zero", (16, 64), (2, 4), np.int8, "block"),
    ("q4f/block32:bf16/zero", (2, 12, 64), (2, 2, 2), np.int32, "group"),  # fused experts
    ("q4f/block64:f32/zero", (3, 2, 8, 64), (3, 2, 1, 1), np.int32, "channel"),
])
def test_asymmetric_quantized_by_qcore_writes_as_the_tools_layout(tmp_path, text, shape, zp_shape, zp_dtype,
                                                                   strategy):
    """A qcore `/zero` tensor writes the tool's `weight_zero_point` (packed down the rows for group /
    channel, int8 for tensor / block) and a `symmetric: false` config group, and reads back byte for
    byte; `(q - z) * scale` from the written arrays, as the tool computes it, is qcore's decode."""
    ref = qcore.backend("reference")
    x = np.random.default_rng(8).standard_normal(shape).astype(np.float32)
    x += np.random.default_rng(9).choice([-2.0, 0.0, 2.0, 4.0], size=(*shape[:-1], 1)).astype(np.float32)
    d = ref.into_data(ref.quantize(x, text))
    assert np.any(d.offsets() != 0)
    qf.write(tmp_path / "m.safetensors", {"e.weight": d}, "compressed-tensors")
    arrays = _arrays(tmp_path / "m.safetensors")
    zp = arrays["e.weight_zero_point"]
    assert zp.dtype == zp_dtype and zp.shape == zp_shape
    z = _tool_zero_points(zp, d.scheme.bits, shape[-2]) if zp_dtype == np.int32 else zp.astype(np.int64)
    assert z.reshape(-1).tolist() == d.offsets().reshape(-1).tolist()
    back = qf.read(tmp_path / "m.safetensors").tensors["e.weight"]
    assert back.shape == shape and back.payload == d.payload and back.scheme == d.scheme
    cfg = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    args = cfg["config_groups"]["group_0"]["weights"]
    assert args["symmetric"] is False and args["strategy"] == strategy and cfg["format"] == "pack-quantized"
    # the tool's decompress: unpacked codes (offset binary - 2^(bits-1)), (q - z) * scale in the scale's dtype
    bits, scale = d.scheme.bits, arrays["e.weight_scale"]
    u = arrays["e.weight_packed"].view(np.uint32)
    q = np.stack([(u >> np.uint32(bits * k)) & np.uint32((1 << bits) - 1) for k in range(32 // bits)], -1)
    q = q.reshape(shape).astype(np.int64) - (1 << (bits - 1))
    grid = tuple(qcore.spec.layout.grid_shape(shape, d.scheme))
    zz, ss = z.reshape(grid).astype(np.float32), scale.astype(np.float32).reshape(grid)
    if strategy == "block":
        zz, ss = (np.repeat(np.repeat(a, 8, 0), 16, 1) for a in (zz, ss))
    elif strategy != "tensor":
        zz, ss = (np.repeat(a, shape[-1] // grid[-1], -1) for a in (zz, ss))
    tool = ((q - zz).astype(np.float32) * ss).astype(scale.dtype)  # exact in f32, one rounding
    mine = ref.to_numpy(ref.dequantize(ref.from_data(d))).astype(scale.dtype)
    assert tool.view(np.uint8).tobytes() == mine.view(np.uint8).tobytes()


@pytest.mark.parametrize("module,value,why", [
    ("layers.0.o_proj", np.zeros((16, 1), ml_dtypes.float8_e4m3fn), "float weight's zero point"),  # FP8
    ("layers.0.gate_proj", np.zeros((8, 2), np.int8), "float weight's zero point"),  # mxfp4
    ("layers.4.q_proj", np.zeros((16, 4), np.int8), r"packs the 4-bit zero points down the rows into int32 \[2, 4\]"),
    ("layers.4.q_proj", np.zeros((16, 4), np.int32), r"int32 \[2, 4\]"),  # unpacked int32
    ("layers.4.k_proj", "pad", "non-zero bits past its 6 rows"),
    ("layers.4.v_proj", np.array([8], np.int8), r"outside the 4-bit range \[-8, 7\]"),
    ("layers.4.v_proj", np.array([1], np.int32), "keeps one int8 zero point per scale"),
    ("layers.4.o_proj", np.zeros((2, 1), np.int32), "keeps one int8 zero point per scale"),  # packed block zp
])
def test_zero_points_not_in_the_tools_form_are_refused(tmp_path, module, value, why):
    """What compressed-tensors 0.20 does not write, or qcore cannot write back byte for byte: a zero
    point on a float weight (FP8's is a float), one packed where the tool keeps int8 or the other way
    round, bits set past the last row of a packed one, a 4-bit zero point outside [-8, 7]."""
    arrays = _arrays(MODEL)
    key = f"{module}.weight_zero_point"
    if isinstance(value, str):
        value = arrays[key].copy()
        value[1, 0] |= np.int32(1 << 16)  # rows 6 and 7 of a word that holds rows 4 .. 7
    save_file({**arrays, key: value}, str(tmp_path / "z.safetensors"))
    with pytest.raises(UnrepresentableError, match=why):
        qf.read(tmp_path / "z.safetensors", "compressed-tensors")


def test_bad_nvfp4_parts_and_scale_byte_255_are_refused(tmp_path):
    """An nvfp4 module whose global is zero (a reciprocal global must be > 0) or whose FP8 block
    scale is negative, and an E8M0 byte of 255 (inf there, invalid in SPEC): refused with the reason."""
    arrays = _arrays(MODEL)
    for key, value, why in (("layers.1.gate_proj.weight_global_scale", np.zeros(1, np.float32), "finite and > 0"),
                            ("layers.1.gate_proj.weight_scale", None, "negative or NaN")):
        bad = dict(arrays)
        if value is None:
            value = arrays[key].copy()
            value.view(np.uint8)[0, 0] = 0xB8  # -1.0 in E4M3
        bad[key] = value
        save_file(bad, str(tmp_path / "nv.safetensors"))
        with pytest.raises(UnrepresentableError, match=why):
            qf.read(tmp_path / "nv.safetensors", "compressed-tensors")
    arrays["layers.0.gate_proj.weight_scale"] = arrays["layers.0.gate_proj.weight_scale"].copy()
    arrays["layers.0.gate_proj.weight_scale"][0, 0] = 255
    save_file(arrays, str(tmp_path / "ff.safetensors"))
    with pytest.raises(UnrepresentableError, match="255"):
        qf.read(tmp_path / "ff.safetensors", "compressed-tensors")


@pytest.mark.parametrize("text,shape,why", [
    ("q4f/block8x4:bf16/packed_u32:1", (8, 64), "holds q4f/q8f"),  # packed down the columns
    ("nvfp4", (4, 64), "holds q4f/q8f"),  # two-level with SPEC's multiplied global, not the reciprocal
    ("u4/block32:bf16/zero", (4, 64), "q4f's q + 8 and z + 8"),  # the tool's codes and zero points are signed
    ("u8/block32:f16/packed_u32/zero", (4, 64), "q8f's q + 128"),
    ("u4/block32:f16/min:f16", (4, 64), "holds q4f/q8f"),  # a min offset (GGUF Q4_1) is no zero point
    ("q4f/block32:f16/signed", (4, 64), "not signed"),  # negative scales, which the reader refuses
    ("q4f/block2x32:bf16/zero", (2, 4, 64), "along the last axis"),
    ("q4f/block12:bf16/zero", (4, 36), "partly filled"),
    ("mxfp4", (4, 48), "whole blocks"),  # a partial MX block
    ("mxfp4", (2, 4, 48), "whole blocks"),  # fused experts with a partial MX block
    ("mxfp4", (64,), "at least 2-D"),
    ("e2m1/block16:ue4m3/tensor:f32:recip/packed_native", (2, 4, 40), "multiple of 16"),  # a partial block
    ("e2m1/block16:ue4m3/tensor:f32:recip/packed_native", (64,), "at least 2-D"),
    ("q4f/block2x32:bf16/packed_u32", (2, 4, 64), "along the last axis"),  # 2-D blocks on fused experts
    ("q4f/block32:bf16/packed_u32", (64,), "at least 2-D"),
    ("q4f/block12:bf16", (4, 36), "partly filled"),  # 36 columns: 4.5 words
])
def test_what_it_cannot_hold_is_refused(text, shape, why):
    ref = qcore.backend("reference")
    x = np.random.default_rng(4).standard_normal(shape).astype(np.float32)
    sup = CompressedTensorsFormat().check("w", ref.into_data(ref.quantize(x, text)))
    assert not sup and why in sup.reason, sup.reason


def test_a_qcore_file_is_not_taken_for_compressed_tensors(tmp_path):
    ref = qcore.backend("reference")
    qcore.save(str(tmp_path / "q.safetensors"), {"w": ref.quantize(np.ones((4, 64), np.float32), "e4m3")})
    assert qf.detect(tmp_path / "q.safetensors").name == "qcore"



def test_inspect_and_convert_on_the_command_line(tmp_path, capsys):
    from qcore.cli.main import main

    assert main(["inspect", MODEL]) == 0
    out = capsys.readouterr().out
    assert "compressed-tensors" in out and "q4f/block32:bf16" in out
    assert main(["convert", MODEL, str(tmp_path / "m.safetensors"), "--to", "compressed-tensors"]) == 0
    assert (tmp_path / "config.json").exists() and "lossless" in capsys.readouterr().out


def test_mxfp4_moves_between_gpt_oss_compressed_tensors_and_gguf(tmp_path):
    """The same MX blocks in three tools' files: gpt-oss -> compressed-tensors -> GGUF -> gpt-oss
    gives back the first file's bytes, and no step re-quantizes."""
    pytest.importorskip("gguf")
    ref = qcore.backend("reference")
    w = np.random.default_rng(5).standard_normal((8, 64)).astype(np.float32)
    qf.write(tmp_path / "g.safetensors", {"l.weight": ref.into_data(ref.quantize(w, "mxfp4"))}, "gpt-oss")
    (tmp_path / "ct").mkdir()
    steps = [("g.safetensors", "ct/model.safetensors", "compressed-tensors"), ("ct/model.safetensors", "m.gguf", "gguf"),
             ("m.gguf", "back.safetensors", "gpt-oss")]
    for src, dst, to in steps:
        assert qcore.convert(tmp_path / src, tmp_path / dst, to).lossless, (src, to)
    first, back = _arrays(tmp_path / "g.safetensors"), _arrays(tmp_path / "back.safetensors")
    assert {n: a.tobytes() for n, a in first.items()} == {n: a.tobytes() for n, a in back.items()}


# --- int-quantized (W8A8): tests/data/ctensors_w8a8, written by the tool's IntQuantizationCompressor ---

W8A8 = os.path.join(TEST_DATA, "ctensors_w8a8", "model.safetensors")
W8A8_SCHEMES = {  # module weight -> the qcore scheme it reads as: int8 codes on the native store
    "layers.0.q_proj.weight": "q8f/block64:bf16",  # the W8A8 preset: int8 per channel (a row of 64)
    "layers.0.k_proj.weight": "q8f/block16:f16",  # group 16
    "layers.0.v_proj.weight": "q8f",  # tensor: one f32 scale
    "layers.0.o_proj.weight": "q8f/block64:bf16/zero",  # asymmetric channel: int8 zero points, not packed
    "layers.0.up_proj.weight": "q8f/block8x16:bf16",  # 8 x 16 blocks
    "layers.0.down_proj.weight": "q8f/block32:bf16",  # num_bits 4: int8 codes in [-8, 7], as the tool stores them
    "layers.1.experts.w1.weight": "q8f/block64:bf16",  # fused experts [2, 8, 64]
}


def test_int_quantized_reads_as_q8f_with_the_activation_scheme_in_metadata():
    """A W8A8 checkpoint is compressed-tensors (not plain arrays): int8 weights as q8f on the native
    store, the static activation scale and the norm as arrays, each module's input_activations from
    its config group in metadata."""
    assert qf.detect(W8A8).name == "compressed-tensors"
    ck = qf.read(W8A8)
    got = {k: str(v.scheme) for k, v in ck.tensors.items() if isinstance(v, qcore.QuantizedData)}
    assert got == {k: str(qcore.scheme(v)) for k, v in W8A8_SCHEMES.items()}
    assert ck.tensors["layers.1.experts.w1.weight"].shape == (2, 8, 64)
    assert ck.tensors["layers.0.down_proj.input_scale"].dtype == np.float32
    acts = json.loads(ck.metadata["compressed-tensors.activations"])
    assert set(acts) == set(W8A8_SCHEMES)
    assert acts["layers.0.q_proj.weight"] == {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                              "dynamic": True, "group_size": None}  # W8A8: dynamic per token
    assert acts["layers.0.down_proj.weight"]["strategy"] == "tensor" and not acts["layers.0.down_proj.weight"]["dynamic"]
    codes = ck.tensors["layers.0.down_proj.weight"].codes()
    assert codes.min() >= -8 and codes.max() <= 7  # the 4-bit module's int8 codes
    assert np.any(ck.tensors["layers.0.o_proj.weight"].offsets() != 0)


@pytest.mark.parametrize("name", list(W8A8_SCHEMES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_int_quantized_decode_is_the_tools_own(request, backend, name):
    """`(q - z) * scale` in the scale's dtype (IntQuantizationCompressor.decompress) is qcore's decode
    rounded to that dtype, bit for bit, on every backend with the scheme (others skip, saying why)."""
    be = get_backend(backend, request)
    want = _arrays(os.path.join(os.path.dirname(W8A8), "expected.safetensors"))[name]
    got = decode(qf.read(W8A8).tensors[name], be).astype(want.dtype)
    assert got.shape == want.shape and got.view(np.uint8).tobytes() == want.view(np.uint8).tobytes(), name


def test_int_quantized_writes_back_the_tools_bytes_and_activations(tmp_path):
    """compressed-tensors -> qcore's file -> compressed-tensors gives the tool's tensors byte for byte
    and config groups of format int-quantized with each module's input_activations (the tool decodes
    them: make_w8a8.py --check)."""
    qcore.convert(W8A8, tmp_path / "q.safetensors", "qcore")
    (tmp_path / "ct").mkdir()
    report = qcore.convert(tmp_path / "q.safetensors", tmp_path / "ct" / "model.safetensors", "compressed-tensors")
    assert report.lossless
    src, back = _arrays(W8A8), _arrays(tmp_path / "ct" / "model.safetensors")
    assert {n: (a.dtype, a.shape, a.tobytes()) for n, a in src.items()} == \
        {n: (a.dtype, a.shape, a.tobytes()) for n, a in back.items()}
    cfg = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    want = json.loads(open(os.path.join(os.path.dirname(W8A8), "config.json")).read())["quantization_config"]
    assert cfg["format"] == "int-quantized"
    got = {t: g for g in cfg["config_groups"].values() for t in g["targets"]}
    for group in want["config_groups"].values():
        (mod,) = group["targets"]
        assert got[mod]["input_activations"] == group["input_activations"], mod
        bits = {**group["weights"], "num_bits": 8}  # a 4-bit module's int8 codes are written as num_bits 8
        assert got[mod]["weights"] == {k: bits[k] for k in got[mod]["weights"]}, mod


def test_int_quantized_class_and_regex_targets_give_the_activations(tmp_path):
    """Config groups that target modules by regex (`re:`) or by class name (`Linear`, W8A8's target)
    give those modules their input_activations: a name match first, a class name for the rest."""
    for f in ("model.safetensors", "expected.safetensors"):
        (tmp_path / f).write_bytes(open(os.path.join(os.path.dirname(W8A8), f), "rb").read())
    static = {"num_bits": 8, "type": "int", "strategy": "tensor", "symmetric": True, "dynamic": False}
    dynamic = {"num_bits": 8, "type": "int", "strategy": "token", "symmetric": True, "dynamic": True}
    groups = {"group_0": {"targets": ["Linear"], "input_activations": dynamic},
              "group_1": {"targets": ["re:.*experts.*", "lm_head"], "input_activations": static}}
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"config_groups": groups}}))
    acts = json.loads(qf.read(tmp_path / "model.safetensors").metadata["compressed-tensors.activations"])
    assert acts["layers.1.experts.w1.weight"] == static and acts["layers.0.q_proj.weight"] == dynamic


@pytest.mark.parametrize("target", ["re:(a+)+$", "re:(["], ids=["exponential", "invalid"])
def test_a_target_regex_that_could_hang_or_is_invalid_is_named(tmp_path, target):
    """A config group's `re:` target is matched only when it is valid and bounded in time (the rule
    of qcore's regex recipe rules); otherwise reading names it."""
    (tmp_path / "model.safetensors").write_bytes(open(W8A8, "rb").read())
    groups = {"group_0": {"targets": [target], "input_activations": {"num_bits": 8}}}
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"config_groups": groups}}))
    with pytest.raises(qcore.InvalidDataError, match=r"config group target .* is not a regex that matches in bounded"):
        qf.read(tmp_path / "model.safetensors")


def test_int_quantized_with_activation_ordering_is_refused(tmp_path):
    """A `weight_g_idx` (activation ordering) maps columns to scales out of order: refused, not passed on."""
    arrays = _arrays(W8A8)
    arrays["layers.0.k_proj.weight_g_idx"] = (np.arange(64, dtype=np.int32) * 7) % 4
    save_file(arrays, str(tmp_path / "g.safetensors"))
    with pytest.raises(UnrepresentableError, match="weight_g_idx .activation ordering"):
        qf.read(tmp_path / "g.safetensors")


def test_a_weight_only_int8_weight_on_the_native_store_writes_as_pack_quantized(tmp_path):
    """Without input_activations an int8 weight is weight-only: written pack-quantized (the same
    codes in int32 words), the form transformers decompresses beside other groups and vLLM runs as
    W8A16; a W8A8 module (with its activations) stays int-quantized (the tool's fixture tests)."""
    ref = qcore.backend("reference")
    x = np.random.default_rng(8).standard_normal((4, 64)).astype(np.float32)
    d = ref.into_data(ref.quantize(x, "q8f/block32:bf16/zero"))
    qf.write(tmp_path / "model.safetensors", {"l.weight": d}, "compressed-tensors")
    arrays = _arrays(tmp_path / "model.safetensors")
    assert arrays["l.weight_packed"].dtype == np.int32 and arrays["l.weight_zero_point"].shape == (1, 2)  # packed rows
    cfg = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert cfg["format"] == "pack-quantized" and cfg["config_groups"]["group_0"]["weights"]["num_bits"] == 8
    back = qf.read(tmp_path / "model.safetensors").tensors["l.weight"]
    assert str(back.scheme) == "q8f/block32:bf16/packed_u32/zero"
    assert np.array_equal(back.codes(), d.codes()) and np.array_equal(back.scales(), d.scales())
    assert np.array_equal(ref.dequantize(ref.from_data(back)), ref.dequantize(ref.from_data(d)))
