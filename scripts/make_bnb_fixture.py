"""Write tests/data/bnb_nf4*.safetensors with bitsandbytes' own code (needs torch and bitsandbytes).

    pip install torch bitsandbytes safetensors   # ran with torch 2.13.0+cpu, bitsandbytes 0.50.2, on CPU
    python scripts/make_bnb_fixture.py

bnb_nf4.safetensors: the state dict of a model of `bnb.nn.Linear4bit` layers, as
`Linear4bit._save_to_state_dict` writes it (`weight` plus `QuantState.as_dict(packed=True)` under
`weight.`), saved with safetensors. bnb_nf4.ref.safetensors: for each weight, what
`bitsandbytes.functional.dequantize_4bit` returns for it (in the layer's dtype), the values qcore's
reader must reproduce bit for bit. bnb_nf4_rows.safetensors: layers whose 64-blocks cross rows
(in_features 96, and 37 with an odd element count), which qcore reads as blocks over the flattened
tensor (docs/spec.md); bnb_nf4_rows.ref.safetensors: their `dequantize_4bit`.

    python scripts/make_bnb_fixture.py --quantize

writes bnb_nf4_quantize.safetensors: inputs `x.K` and what bitsandbytes' own `quantize_4bit`
makes of them (`w.K` packed codes, `absmax.K`), with each case's blocksize in the metadata:
ties at every midpoint, zero and tiny blocks, a partial last block, an odd element count and
an f16 input. qcore's `codes:midpoint` rule must write the same bytes.

    python scripts/make_bnb_fixture.py --negative

writes bnb_nf4_negative.safetensors: double-quant layers whose absmax comes back negative, as
bitsandbytes' own `quantize_4bit` with `compress_statistics` makes it where a row of zeros sits
beside an outlier (the zero blocks' absmax, 0 less the mean, quantized by the 8-bit dynamic map
and the mean added back, lands below 0); bnb_nf4_negative.ref.safetensors: their `dequantize_4bit`
(-0.0 for every element of such a block). bnb_nf4_flipped.safetensors: a layer whose small
non-zero blocks get a negative absmax beside a far larger outlier, so bitsandbytes decodes them
with flipped signs, which qcore re-quantizes only when asked; bnb_nf4_flipped.ref.safetensors: its
`dequantize_4bit`.

    python scripts/make_bnb_fixture.py --check FILE OUT

checks the other direction with bitsandbytes' own code: FILE is a state dict qcore wrote
(`qcore convert ... --to bitsandbytes`); every 4-bit weight in it is loaded as bitsandbytes loads
a saved layer (`QuantState.from_dict`) and decoded with `dequantize_4bit`; OUT (safetensors) gets
those values, which must equal qcore's decode bit for bit.
"""
import sys
import os

import bitsandbytes as bnb
import bitsandbytes.functional as F
import torch
from safetensors.torch import save_file

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "data")
# name: (out_features, in_features, dtype, double quant, blocksize)
LAYERS = {
    "layers.0.proj": (16, 128, torch.float32, False, 64),
    "layers.1.proj": (8, 64, torch.float32, True, 64),
    "layers.2.proj": (4, 256, torch.bfloat16, True, 128),
    "layers.3.proj": (8, 64, torch.float16, False, 64),
}


def layer(n_out: int, n_in: int, dtype: torch.dtype, double: bool, blocksize: int) -> torch.nn.Module:
    lin = bnb.nn.Linear4bit(n_in, n_out, bias=True, compute_dtype=dtype, compress_statistics=double,
                            quant_type="nf4", quant_storage=torch.uint8)
    w = torch.randn(n_out, n_in, dtype=torch.float32) * torch.rand(n_out, 1) * 0.2
    lin.weight = bnb.nn.Params4bit(w.to(dtype), requires_grad=False, compress_statistics=double,
                                   quant_type="nf4", blocksize=blocksize)
    lin.bias = torch.nn.Parameter(torch.zeros(n_out, dtype=dtype), requires_grad=False)
    return lin.to("cpu")  # Params4bit quantizes on its first move to a device


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({k.replace(".", "_"): layer(*v) for k, v in LAYERS.items()})
    state, ref = {}, {}
    for key, lin in model.items():
        name = key.replace("_", ".")
        assert lin.weight.quant_state is not None, "the layer was not quantized"
        for k, v in lin.state_dict().items():
            state[f"{name}.{k}"] = v.contiguous()
        ref[f"{name}.weight"] = F.dequantize_4bit(lin.weight.data, lin.weight.quant_state).contiguous()
    save_file(state, os.path.join(OUT, "bnb_nf4.safetensors"), metadata={"format": "pt"})
    save_file(ref, os.path.join(OUT, "bnb_nf4.ref.safetensors"))
    rows = layer(4, 96, torch.float32, False, 64)
    rows_state, rows_ref = {}, {}
    for name, lin in (("rows", rows), ("odd", layer(3, 37, torch.float32, False, 64))):
        rows_state.update({f"{name}.{k}": v.contiguous() for k, v in lin.state_dict().items()})
        rows_ref[f"{name}.weight"] = F.dequantize_4bit(lin.weight.data, lin.weight.quant_state).contiguous()
    save_file(rows_state, os.path.join(OUT, "bnb_nf4_rows.safetensors"), metadata={"format": "pt"})
    save_file(rows_ref, os.path.join(OUT, "bnb_nf4_rows.ref.safetensors"))
    print(f"wrote {len(state)} tensors; bitsandbytes {bnb.__version__}, torch {torch.__version__}")


def negative_absmax() -> None:
    def outlier_layer(rows: int, dtype: torch.dtype, outlier: float, zero_row: bool) -> torch.nn.Module:
        """[rows, 256] of N(0, 0.02) with an outlier in row 3 (its first block, or the whole row
        when there is no zero row) and row 5 all zeros."""
        torch.manual_seed(2)
        w = torch.randn(rows, 256) * 0.02
        if zero_row:
            w[3, :64], w[5] = outlier, 0.0
        else:
            w[3] = outlier
        lin = bnb.nn.Linear4bit(256, rows, bias=False, compute_dtype=dtype, compress_statistics=True,
                                quant_type="nf4", quant_storage=torch.uint8)
        lin.weight = bnb.nn.Params4bit(w.to(dtype), requires_grad=False, compress_statistics=True,
                                       quant_type="nf4", blocksize=64)
        return lin.to("cpu")

    def absmax(lin: torch.nn.Module) -> torch.Tensor:
        qs = lin.weight.quant_state
        return F.dequantize_blockwise(qs.absmax, qs.state2) + qs.offset

    for file, layers in (("bnb_nf4_negative", {"zero_row.f32": outlier_layer(16, torch.float32, 2.0, True),
                                               "zero_row.bf16": outlier_layer(16, torch.bfloat16, 3.0, True)}),
                         ("bnb_nf4_flipped", {"flipped": outlier_layer(8, torch.float32, 10.0, False)})):
        state, ref = {}, {}
        for name, lin in layers.items():
            assert (absmax(lin) < 0).any(), f"{name}: no negative absmax"
            state.update({f"{name}.{k}": v.contiguous() for k, v in lin.state_dict().items()})
            ref[f"{name}.weight"] = F.dequantize_4bit(lin.weight.data, lin.weight.quant_state).contiguous()
        save_file(state, os.path.join(OUT, f"{file}.safetensors"), metadata={"format": "pt"})
        save_file(ref, os.path.join(OUT, f"{file}.ref.safetensors"))
    print(f"wrote the negative-absmax layers; bitsandbytes {bnb.__version__}, torch {torch.__version__}")


def check(path: str, out: str) -> None:
    from safetensors.torch import load_file

    state = load_file(path)
    suffix = ".quant_state.bitsandbytes__nf4"
    decoded = {}
    for key in state:
        if key.endswith(suffix):
            w = key[: -len(suffix)]
            parts = {k[len(w) + 1:]: v for k, v in state.items() if k.startswith(w + ".")}
            qs = F.QuantState.from_dict(parts, device=torch.device("cpu"))
            decoded[w] = F.dequantize_4bit(state[w], qs).contiguous()
    save_file(decoded, out)
    print(f"decoded {len(decoded)} weights with bitsandbytes {bnb.__version__}")


def quantize_cases() -> None:
    import json

    torch.manual_seed(1)
    code = F.get_4bit_type("nf4", device="cpu").float()
    mids = (code[:-1] + code[1:]) / 2
    ties = torch.cat([mids, -mids, torch.tensor([1.0]), torch.zeros(64 - 31)])[:64]
    cases = {
        "rows": (torch.randn(8, 96) * torch.rand(8, 1) * 3, 64),
        "odd": (torch.randn(3, 37), 64),
        "flat": (torch.randn(1000), 128),
        "wide": (torch.randn(7, 100) * torch.rand(7, 1), 128),
        "ties": (torch.cat([ties * 2.5, ties * 0.75, -ties]), 64),
        "zero-tiny-huge": (torch.cat([torch.zeros(64), torch.randn(64) * 1e-39, torch.randn(64) * 1e30]), 64),
        "f16": (torch.randn(6, 64).half(), 64),
    }
    out, meta = {}, {}
    for name, (x, block) in cases.items():
        packed, st = F.quantize_4bit(x, blocksize=block, quant_type="nf4")
        out[f"x.{name}"], out[f"w.{name}"], out[f"absmax.{name}"] = x.contiguous(), packed.contiguous(), st.absmax
        meta[name] = block
    save_file(out, os.path.join(OUT, "bnb_nf4_quantize.safetensors"), metadata={"blocksizes": json.dumps(meta)})
    print(f"wrote {len(cases)} quantize cases; bitsandbytes {bnb.__version__}, torch {torch.__version__}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--check"]:
        check(sys.argv[2], sys.argv[3])
    elif sys.argv[1:2] == ["--quantize"]:
        quantize_cases()
    elif sys.argv[1:2] == ["--negative"]:
        negative_absmax()
    else:
        main()
