"""Write the compressed-tensors test checkpoint with compressed-tensors' own code.

    pip install "compressed-tensors==0.20.0" torch   # (CPU torch is enough)
    python tests/data/ctensors/make_ctensors.py tests/data/ctensors

Writes `model.safetensors` (the modules as the tool's compressors store them, plus an
unquantized norm), `config.json` (the tool's quantization_config, one config group per module)
and `expected.safetensors` (each module's weight as the tool's decompressor gives it back).
tests/formats/test_formats_ctensors.py reads them with qcore and compares bit for bit.

Fused-expert weights `[e, m, n]`: the pack- and float-quantized compressors take them whole. The
MXFP4 and NVFP4 compressors of 0.20.0 take `[m, n]` only (`quantize_and_pack_fp4` raises "Expected
2D tensor", `decompress` unpacks `m, n = packed.shape`), so an FP4 expert weight goes through them
expert by expert and the parts are stacked: `weight_packed` `[e, m, n/2]`, `weight_scale`
`[e, m, n/G]` and, for NVFP4, the module's one `weight_global_scale` `[1]` (the shape the tool
gives a `tensor_group` global whatever the weight's rank: `initialize_qparams` registers
`torch.empty(1)`, `generate_gparam` returns `reshape([1])`), which every expert shares. The stacked
decompression is checked against the tool's own `dequantize` run on the whole `[e, m, n]` tensor.

Asymmetric int weights (`symmetric=False`): the scales and int8 zero points are the tool's own
`calculate_qparams` of each group's min and max in the weight's dtype, and its compressor quantizes
and packs them (`weight_zero_point` packed down the rows for group and channel, int8 for tensor and
block). Runs of 16 weights are shifted by -0.2 .. 0.2 (the tensor module by 0.1 more) so the zero
points reach both ends of the range and are not 0.

    python tests/data/ctensors/make_ctensors.py --check DIR

checks the other direction with the tool's code: DIR holds a `model.safetensors` and `config.json`
that qcore wrote (`qcore convert tests/data/ctensors/model.safetensors DIR/model.safetensors --to
compressed-tensors`); the tool parses the config and decompresses every module it names to the
values in `expected.safetensors`.
"""
from __future__ import annotations

import json
import os
import sys

import torch
from safetensors.torch import save_file

from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

FP4 = (MXFP4PackedCompressor, NVFP4PackedCompressor)
GLOBAL = "weight_global_scale"

# module -> (weight dtype, weight arguments, compressor, *shape) (shape: rows, cols, or experts, rows, cols)
MODULES = {
    "layers.0.q_proj": (torch.bfloat16, dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32),
                        PackedQuantizationCompressor, 16, 128),
    "layers.0.k_proj": (torch.float16, dict(num_bits=4, type="int", symmetric=True, strategy="channel"),
                        PackedQuantizationCompressor, 8, 64),
    "layers.0.v_proj": (torch.float32, dict(num_bits=8, type="int", symmetric=True, strategy="group", group_size=16),
                        PackedQuantizationCompressor, 8, 64),
    "layers.0.o_proj": (torch.bfloat16, dict(num_bits=8, type="float", symmetric=True, strategy="channel"),
                        FloatQuantizationCompressor, 16, 64),
    "layers.0.up_proj": (torch.float32, dict(num_bits=8, type="float", symmetric=True, strategy="tensor"),
                         FloatQuantizationCompressor, 8, 32),
    "layers.0.down_proj": (torch.bfloat16, dict(num_bits=8, type="float", symmetric=True, strategy="block",
                                                block_structure=[8, 16]), FloatQuantizationCompressor, 16, 64),
    "layers.0.gate_proj": (torch.bfloat16, dict(num_bits=4, type="float", symmetric=True, strategy="group",
                                                group_size=32, scale_dtype=torch.uint8),
                           MXFP4PackedCompressor, 8, 64),
    "layers.1.gate_proj": (torch.bfloat16, dict(num_bits=4, type="float", symmetric=True, strategy="tensor_group",
                                                group_size=16, scale_dtype=torch.float8_e4m3fn),
                           NVFP4PackedCompressor, 16, 64),
    "layers.2.experts.w1": (torch.bfloat16, dict(num_bits=4, type="int", symmetric=True, strategy="group",
                                                 group_size=32), PackedQuantizationCompressor, 2, 8, 64),
    "layers.2.experts.w2": (torch.bfloat16, dict(num_bits=8, type="float", symmetric=True, strategy="channel"),
                            FloatQuantizationCompressor, 2, 8, 32),
    # fused-expert FP4 weights [2, 4, 64]: MXFP4 and NVFP4 (one global for the module)
    "layers.3.experts.w1": (torch.bfloat16, dict(num_bits=4, type="float", symmetric=True, strategy="group",
                                                 group_size=32, scale_dtype=torch.uint8),
                            MXFP4PackedCompressor, 2, 4, 64),
    "layers.3.experts.w2": (torch.bfloat16, dict(num_bits=4, type="float", symmetric=True, strategy="tensor_group",
                                                 group_size=16, scale_dtype=torch.float8_e4m3fn),
                            NVFP4PackedCompressor, 2, 4, 64),
    # asymmetric int (weight_zero_point): group and channel zero points packed down the rows
    # (`pack_to_int32(zp, bits, packed_dim=0)`, 6 and 12 rows leave a partly filled word), tensor
    # and block ones int8 as they are
    "layers.4.q_proj": (torch.bfloat16, dict(num_bits=4, type="int", symmetric=False, strategy="group",
                                             group_size=32), PackedQuantizationCompressor, 16, 128),
    "layers.4.k_proj": (torch.float16, dict(num_bits=8, type="int", symmetric=False, strategy="channel"),
                        PackedQuantizationCompressor, 6, 64),
    "layers.4.v_proj": (torch.float32, dict(num_bits=4, type="int", symmetric=False, strategy="tensor"),
                        PackedQuantizationCompressor, 8, 64),
    "layers.4.o_proj": (torch.bfloat16, dict(num_bits=8, type="int", symmetric=False, strategy="block",
                                             block_structure=[8, 16]), PackedQuantizationCompressor, 16, 64),
    "layers.5.experts.w1": (torch.bfloat16, dict(num_bits=4, type="int", symmetric=False, strategy="group",
                                                 group_size=32), PackedQuantizationCompressor, 2, 12, 64),
}


def nvfp4_params(w: torch.Tensor, args: QuantizationArgs) -> dict:
    """The tool's own NVFP4 parameters: its global scale (`generate_gparam`, 448 * 6 / amax) and
    block scales (`calculate_qparams`: amax_b / 6 * global, cast to FP8)."""
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    g = generate_gparam(w.float().min(), w.float().max()).reshape(1)  # one [1] global, whatever the rank
    *lead, m, n = w.shape
    blocks = w.float().reshape(*lead, m, n // args.group_size, args.group_size)
    scale, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), args, global_scale=g)
    return {"weight_scale": scale, GLOBAL: g}


def _per_expert(fn, sd: dict, scheme: QuantizationScheme, stacked: tuple[str, ...]) -> dict:
    """`fn` (the tool's FP4 compress or decompress, which take [m, n] only) run on each expert of
    [e, m, n] tensors, the module's one global passed to every expert; the `stacked` outputs stacked."""
    e = sd["weight" if "weight" in sd else "weight_packed"].shape[0]
    parts = [fn({k: v if k == GLOBAL else v[i] for k, v in sd.items()}, scheme) for i in range(e)]
    out = {k: torch.stack([p[k] for p in parts]) for k in stacked}
    if GLOBAL in sd:
        assert all(torch.equal(p[GLOBAL], sd[GLOBAL]) for p in parts)
        out[GLOBAL] = sd[GLOBAL]
    return out


def compress(compressor, sd: dict, scheme: QuantizationScheme) -> dict:
    if compressor in FP4 and sd["weight"].ndim > 2:
        return _per_expert(compressor.compress, sd, scheme, ("weight_packed", "weight_scale"))
    return compressor.compress(sd, scheme)


def decompress(compressor, sd: dict, scheme: QuantizationScheme) -> torch.Tensor:
    """The tool's decompressed weight. An [e, m, n] FP4 weight is decompressed expert by expert and
    checked against the tool's `dequantize` run on the whole 3-D tensor (the body of its
    `decompress` without the 2-D unpacking)."""
    sd = {k: v.clone() for k, v in sd.items()}
    if compressor not in FP4 or sd["weight_packed"].ndim == 2:
        return compressor.decompress(sd, scheme)["weight"]
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    got = _per_expert(compressor.decompress, sd, scheme, ("weight",))["weight"]
    packed = sd["weight_packed"]
    *lead, m, half = packed.shape
    x = unpack_fp4_from_uint8(packed.reshape(-1, half), packed.numel() // half, 2 * half).reshape(*lead, m, 2 * half)
    whole = dequantize(x_q=x, scale=compressor._decompress_scale(sd["weight_scale"], x.dtype), args=scheme.weights,
                       global_scale=sd.get(GLOBAL), dtype=x.dtype)
    assert got.dtype == whole.dtype and torch.equal(got.view(torch.uint8), whole.view(torch.uint8))
    return got


def asym_params(w: torch.Tensor, args: QuantizationArgs) -> dict:
    """The tool's own asymmetric parameters: min / max per the strategy's groups, in the weight's
    dtype, through its `calculate_qparams` (scale `(max - min) / (qmax - qmin)`, int8 zero point
    `qmin - min / scale` clamped and rounded)."""
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    *lead, m, n = w.shape
    if args.strategy == "group":
        g = w.reshape(*lead, m, n // args.group_size, args.group_size)
        lo, hi = g.amin(-1), g.amax(-1)
    elif args.strategy == "channel":
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    elif args.strategy == "block":
        bm, bn = args.block_structure
        b = w.reshape(m // bm, bm, n // bn, bn)
        lo, hi = b.amin((1, 3)), b.amax((1, 3))
    else:
        lo, hi = w.amin(), w.amax()
    scale, zp = calculate_qparams(lo, hi, args)
    assert scale.dtype == w.dtype and zp.dtype == torch.int8
    return {"weight_scale": scale, "weight_zero_point": zp}


def scales_for(w: torch.Tensor, args: QuantizationArgs) -> torch.Tensor:
    """amax / qmax per the strategy's groups, in the weight's dtype (how the scale is chosen does
    not matter here: the test is about the stored bytes and their decode)."""
    qmax = 7.0 if args.type == "int" and args.num_bits == 4 else 127.0 if args.type == "int" else \
        6.0 if args.num_bits == 4 else 448.0
    a = w.abs().float()
    *lead, m, n = w.shape
    if args.strategy == "group":
        s = a.reshape(*lead, m, n // args.group_size, args.group_size).amax(-1)
    elif args.strategy == "channel":
        s = a.amax(-1, keepdim=True)
    elif args.strategy == "block":
        bm, bn = args.block_structure
        s = a.reshape(m // bm, bm, n // bn, bn).amax((1, 3))
    else:
        s = a.amax().reshape(1)
    s = s.clamp(min=1e-6) / qmax
    if args.num_bits == 4 and args.type == "float":  # MX: a power of two (the compressor stores its exponent)
        s = torch.exp2(torch.ceil(torch.log2(s)))
    return s.to(w.dtype)


def main(out: str) -> None:
    torch.manual_seed(0)
    model, expected, groups = {}, {}, {}
    for i, (name, (dtype, wargs, compressor, *shape)) in enumerate(MODULES.items()):
        args = QuantizationArgs(**wargs)
        scheme = QuantizationScheme(targets=[name], weights=args)
        w = torch.randn(*shape) * 0.05
        if compressor in FP4 and len(shape) == 3:  # magnitudes spread over experts, rows and blocks of 16 (x 2^k)
            e, m, n = shape
            k = torch.randint(-4, 5, (e, m, n // 16, 1)).float()
            w = w * torch.exp2(k).expand(e, m, n // 16, 16).reshape(shape)
        if not args.symmetric:  # runs of 16 shifted by -0.2 .. 0.2: zero points from qmin (all > 0) to qmax (all < 0)
            *lead, m, n = shape
            k = torch.randint(-2, 3, (*lead, m, n // 16, 1)).float() * 0.1
            w = w + k.expand(*lead, m, n // 16, 16).reshape(shape) + (0.1 if args.strategy == "tensor" else 0.0)
        w = w.to(dtype)
        if compressor is NVFP4PackedCompressor:
            params = nvfp4_params(w, args)
        elif not args.symmetric:
            params = asym_params(w, args)
        else:
            params = {"weight_scale": scales_for(w, args)}
        sd = compress(compressor, {"weight": w, **params}, scheme)
        model.update({f"{name}.{k}": v.contiguous() for k, v in sd.items()})
        expected[f"{name}.weight"] = decompress(compressor, sd, scheme).contiguous()
        groups[f"group_{i}"] = {"targets": [name], "weights": args.model_dump(mode="json"),
                                "input_activations": None, "output_activations": None}
    model["norm.weight"] = torch.ones(64, dtype=torch.bfloat16)
    os.makedirs(out, exist_ok=True)
    save_file(model, os.path.join(out, "model.safetensors"))
    save_file(expected, os.path.join(out, "expected.safetensors"))
    config = {"quantization_config": {"quant_method": "compressed-tensors", "format": "mixed-precision",
                                      "quantization_status": "compressed", "config_groups": groups, "ignore": []}}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


def check(folder: str) -> None:
    from safetensors.torch import load_file

    from compressed_tensors.quantization import QuantizationConfig

    with open(os.path.join(folder, "config.json")) as f:
        cfg = QuantizationConfig.model_validate(json.load(f)["quantization_config"])
    sd = load_file(os.path.join(folder, "model.safetensors"))
    want = load_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "expected.safetensors"))
    done = 0
    for group in cfg.config_groups.values():
        fmt = group.format or cfg.format
        compressor = {"pack-quantized": PackedQuantizationCompressor, "float-quantized": FloatQuantizationCompressor,
                      "mxfp4-pack-quantized": MXFP4PackedCompressor,
                      "nvfp4-pack-quantized": NVFP4PackedCompressor}[fmt]
        for mod in group.targets:
            local = {k[len(mod) + 1:]: v for k, v in sd.items() if k.startswith(mod + ".")}
            got = decompress(compressor, local, group)
            exp = want[f"{mod}.weight"]
            assert got.dtype == exp.dtype and torch.equal(got.view(torch.uint8), exp.view(torch.uint8)), mod
            done += 1
    assert done == len(MODULES), (done, len(MODULES))
    print(f"compressed-tensors {cfg.format}: {done} modules decompressed bit for bit")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--check"]:
        check(sys.argv[2])
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__)))
