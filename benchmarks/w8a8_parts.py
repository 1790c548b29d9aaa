"""Where a W8A8 `linear` call's GPU time goes (docs/gpu.md, W8A8; needs torch and a GPU).

    NUMBA_ENABLE_CUDASIM=0 python benchmarks/w8a8_parts.py [--shapes 4096x4096,8192x8192]
        [--m 1024,8192] [--reps 30] [--out DIR]

For each weight [N, K] (e4m3, one f32 scale per row) and M rows of bfloat16 x, in one run, the
functions taking turns call by call (`gpu.samples_in_turn`, the host launch hidden behind a GPU
sleep), median GPU microseconds of:

* `copy_x`: `x.clone()` (the bytes x's quantize reads, written once: a bandwidth yardstick);
* `quant_x`: x quantized per row as the call does it (`act_rows`, Triton), where Triton is
  installed and takes rows of K; `same_as_backend` says it wrote the bytes of the next one;
* `quant_x_backend`: the backend's own kernel, the call's path without Triton
  (`paths.quantize.quantize_bf16_rows`, x on a 16-byte boundary: the 16-byte kernel);
* `quant_x_words`: that kernel with x starting 4 bytes past a 16-byte boundary (the
  word-at-a-time kernel); `same_bytes` says both wrote the same payload;
* `mm_fast_accum` / `mm_promoted`: torch's `_scaled_mm` over the two payloads with
  `use_fast_accum` True (what the call runs) and False;
* `linear`: the whole `be.linear(x, w, act=...)` call; `torch_bf16`: `x @ W.T` in bfloat16.

Ratios in the same run: `quant_vs_copy` (copy_x / quant_x: 1 is the copy's pace) and
`linear_vs_torch_bf16` (torch_bf16 / linear: the W8A8 target is 1.3). Writes `w8a8_parts.json`
into --out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import runinfo  # benchmarks/runinfo.py (this folder is on sys.path when the script runs)


def _shape(text: str) -> tuple[int, int]:
    n, k = (int(v) for v in text.lower().split("x"))
    return n, k


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="4096x4096,8192x8192", help="weights N x K, comma-separated")
    ap.add_argument("--m", default="1024,8192", help="rows of x, comma-separated")
    ap.add_argument("--reps", type=int, default=30, help="timed calls of each function")
    ap.add_argument("--out", default=".", help="folder for w8a8_parts.json")
    args = ap.parse_args(argv)

    import torch

    from gpu import samples_in_turn  # benchmarks/gpu.py
    from qcore.spec.schemes import scheme as parse_scheme
    from qcore_cuda import CudaBackend, _streams, act_rows
    from qcore_cuda.paths import fp8
    from qcore_cuda.paths.quantize import quantize_bf16_rows

    be = CudaBackend()
    rows = []
    for n, k in (_shape(s) for s in args.shapes.split(",")):
        text = f"e4m3/block{k}:f32"
        act = parse_scheme(text)
        w = torch.randn(n, k, device="cuda")
        q = be.quantize(w, text)
        wb = w.bfloat16()
        b, sb = fp8._operands(torch, q, n, k)
        for m in (int(v) for v in args.m.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            off = torch.empty(m * k + 8, device="cuda", dtype=torch.bfloat16)[2:2 + m * k].view(m, k)
            off.copy_(x)  # 4 bytes past a 16-byte boundary
            s = _streams.resolve(None, x)
            xq, _ = quantize_bf16_rows(be, x, act, s, wait=False)
            xw, _ = quantize_bf16_rows(be, off, act, s, wait=False)
            a, sa = fp8._operands(torch, xq, m, k)

            def mm(fast, a=a, sa=sa, m=m, n=n):
                return torch._scaled_mm(a, b.t(), scale_a=sa.view(m, 1), scale_b=sb.view(1, n),
                                        out_dtype=torch.bfloat16, use_fast_accum=fast)

            fns = {"copy_x": lambda x=x: x.clone()}
            same_as_backend = None
            if act_rows.enabled() and act_rows.takes(act, k):
                launch = act_rows.for_row(k, act.scale_divisor, x.device.index)
                fns["quant_x"] = lambda x=x, launch=launch: launch(x)
                codes, scales = launch(x)
                same_as_backend = bool(torch.equal(codes.view(torch.uint8), a.view(torch.uint8))
                                       and torch.equal(scales.view(torch.int32), sa.view(torch.int32)))
            fns |= {
                "quant_x_backend": lambda x=x, s=s: quantize_bf16_rows(be, x, act, s, wait=False),
                "quant_x_words": lambda off=off, s=s: quantize_bf16_rows(be, off, act, s, wait=False),
                "mm_fast_accum": lambda: mm(True),
                "mm_promoted": lambda: mm(False),
                "linear": lambda x=x: be.linear(x, q, act=text),
                "torch_bf16": lambda x=x: x @ wb.T,
            }
            us = {key: round(1000 * statistics.median(v), 2)
                  for key, v in samples_in_turn(torch, fns, args.reps, hide_launch=True).items()}
            row = {"shape": f"{n}x{k}", "m": m, "us": us,
                   "same_bytes": xq.to_data().payload == xw.to_data().payload, "same_as_backend": same_as_backend,
                   "quant_vs_copy": round(us["copy_x"] / us.get("quant_x", us["quant_x_backend"]), 3),
                   "linear_vs_torch_bf16": round(us["torch_bf16"] / us["linear"], 3)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    command = "NUMBA_ENABLE_CUDASIM=0 python benchmarks/w8a8_parts.py " + " ".join(sys.argv[1:])
    res = {"run": runinfo.record(torch.cuda.get_device_name(), f"torch {torch.__version__}", command),
           "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "w8a8_parts.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
