"""Schemes under the extension rules of docs/spec.md on the cuda backend, beside a device copy
of the same bytes (needs torch).

    NUMBA_ENABLE_CUDASIM=0 python benchmarks/gpu_rules.py [--out DIR]

Schemes with signed scales, code rules or affine offsets run on the general kernels only
(docs/gpu.md "How it works"); a field order runs the v1 kernels and moves the fields in one more
pass (`k_reorder`), beside the same scheme in the `low` order; flat blocks whose rows hold whole
blocks are the v1 scheme's bytes. This measures what that costs: the whole `be.quantize(x, s)` and
`be.dequantize(q)` calls on a float32 [8192, 8192] torch tensor (256 MiB), median of 10 after a
warm-up, synchronised, against `torch`'s device copy of x in the same run, and a v1 scheme on the
fast kernels for comparison. Writes `gpu_rules.json` to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import runinfo  # benchmarks/runinfo.py (this folder is on sys.path when the script runs)

SCHEMES = ("q4s/block32:f16", "q4f/block32:f16/signed", "q4_0", "q8_0", "q4_1", "q4f/block128:bf16/zero",
           "q4f/tensor:bf16/zero", "q4f/signed", "q4s/block32:f16/packed_native",
           "q4s/block32:f16/packed_native/order:split32", "q4s/block32:f16/packed_native/order:high",
           "q4s/block32:f16:flat")


def _median_s(torch, fn, n=10) -> float:
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    import torch

    import qcore

    be = qcore.backend("cuda")
    x = torch.randn(8192, 8192, device="cuda")
    copy_s = _median_s(torch, lambda: x.clone())
    rows = []
    for s in SCHEMES:
        q = be.quantize(x, s)
        quant_s = _median_s(torch, lambda: be.quantize(x, s))
        deq_s = _median_s(torch, lambda: be.dequantize(q))
        rows.append({"scheme": s, "quantize_ms": 1e3 * quant_s, "dequantize_ms": 1e3 * deq_s,
                     "quantize_vs_copy": copy_s / quant_s, "dequantize_vs_copy": copy_s / deq_s})
        print(json.dumps(rows[-1]), flush=True)
    run = runinfo.record(f"{torch.cuda.get_device_name(0)}, {os.cpu_count()} CPUs",
                         f"{runinfo.python()}, torch {torch.__version__}",
                         "NUMBA_ENABLE_CUDASIM=0 python benchmarks/gpu_rules.py")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_rules.json"), "w") as f:
        json.dump({"run": run, "copy_ms": 1e3 * copy_s, "rows": rows}, f, indent=1)
    print(f"device copy of 256 MiB: {1e3 * copy_s:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
