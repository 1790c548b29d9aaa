"""Tuning runs for the cuda backend's fast kernels on a GPU (kernel variants side by side).

    NUMBA_ENABLE_CUDASIM=0 python benchmarks/gpu_tune.py [--out DIR]

* GEMV `x[M, 8192] @ w[8192, 8192]`, w in q4s/block32:f16: rows in flight per thread (unroll),
  u32 words per thread (wpt), register cap and blocks per SM varied, each checked against the
  default path's result, timed with CUDA events after an L2 flush (as in benchmarks/gpu.py).
* Dequantize of 2**28 elements: the run layout (16 consecutive elements per thread) against the
  word layout (lanes own consecutive u32 words of codes) with 4 or 8 words in flight.

Prints one JSON line per variant and writes gpu_tune.json into --out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import numpy as np


def _time(torch, fn, iters=15, flush=None):
    ts = []
    for i in range(iters + 2):
        if flush is not None:
            flush.zero_()
        torch.cuda.synchronize()
        torch.cuda._sleep(1_000_000)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        if i >= 2:
            ts.append(s.elapsed_time(e))
    return statistics.median(ts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--only", choices=("gemv", "dequant"), help="run one of the two parts")
    args = ap.parse_args(argv)
    import torch
    from numba import config, cuda

    if config.ENABLE_CUDASIM:
        print("run with NUMBA_ENABLE_CUDASIM=0 on a GPU", file=sys.stderr)
        return 2
    import qcore
    from qcore_cuda import fast, gemv
    from qcore_cuda.kernels import _jit_regs

    be = qcore.backend("cuda")
    res = {"gemv": [], "dequant": []}
    flush = torch.empty(512 * 2**20 // 4, device="cuda")
    K_ = N_ = 8192
    torch.manual_seed(0)
    w = torch.randn(K_, N_, device="cuda")
    qw = be.quantize(cuda.as_cuda_array(w), "q4s/block32:f16")
    data = qw.data
    scales, gbuf = be._decoded_scales(data)
    pp = be._prepared(data.shape, data.scheme, "minmax")
    w32 = data.payload[: pp["plan"].values_nbytes].view(np.uint32)
    kind, Q = gemv.geometry(data.shape, data.scheme)
    for m in (1, 2, 4, 16) if args.only != "dequant" else ():
        x = torch.randn(m, K_, device="cuda")
        xd = cuda.as_cuda_array(x).reshape(m * K_)
        want = torch.as_tensor(be.to_numpy(be.matmul(cuda.as_cuda_array(x), qw)), device="cuda")
        x16, w16 = x.half(), w.half()
        torch_t = _time(torch, lambda: x16 @ w16, flush=flush)
        # (kernel, rows per step, words per thread, pipeline stages, register cap, blocks per SM)
        # (rows per step, u32 words per thread, register cap, blocks per SM, prefetch the next step)
        variants = [(4, 2, 64, 4, False), (2, 2, 64, 4, True), (3, 2, 64, 4, True), (2, 2, 64, 8, True),
                    (4, 1, 64, 4, False), (2, 1, 64, 4, True), (4, 1, 64, 4, True)]
        for unroll, wpt, regs, per_sm, prefetch in variants:
            mb = gemv.config_for(kind, m, Q)[0] if wpt == 1 else 1
            if m > 1 and wpt > 1:
                continue
            try:
                kern = _jit_regs(regs)(gemv._gemv_kernel(kind, mb, wpt, unroll, prefetch))
            except Exception as e:  # a variant that does not compile is reported, not fatal
                print(json.dumps({"m": m, "unroll": unroll, "wpt": wpt, "regs": regs, "error": str(e)[:200]}))
                continue
            q, grid, block = gemv.plan(Q, wpt, per_sm)
            qd = cuda.to_device(q)
            part = cuda.device_array(int(q[gemv.Q_KS]) * mb * N_, dtype=np.float32)
            cnt = cuda.to_device(np.zeros(grid[0], dtype=np.int32))
            out = cuda.device_array(m * N_, dtype=np.float32)

            def run():
                for m0 in range(0, m, mb):
                    kern[grid, block](xd, w32, scales, gbuf, pp["lut"], part, cnt, out, qd, m0, min(mb, m - m0))

            try:
                run()
            except Exception as e:  # e.g. too much shared memory for this GPU
                print(json.dumps({"m": m, "unroll": unroll, "wpt": wpt, "error": str(e)[:200]}))
                continue
            got = torch.as_tensor(out.copy_to_host().reshape(m, N_), device="cuda")
            err = float((got - want).abs().max() / want.abs().max())
            t = _time(torch, run, flush=flush)
            r = {"m": m, "unroll": unroll, "wpt": wpt, "regs": regs, "per_sm": per_sm, "prefetch": prefetch, "mb": mb, "grid": list(grid), "us": 1e3 * t,
                 "rel_err_vs_default": err, "torch_fp16_us": None if torch_t is None else 1e3 * torch_t}
            res["gemv"].append(r)
            print(json.dumps(r), flush=True)

    n = 2**28
    x = torch.randn(65536, 4096, device="cuda") * 3
    xd = cuda.as_cuda_array(x)
    out = cuda.device_array(n, dtype=np.float32)
    for text in ("q8s/block32:f16", "q4s/block32:f16", "e4m3/block32:f32", "nvfp4", "q8s") if args.only != "gemv" else ():
        q = be.quantize(xd, text)
        d = q.data
        pp = be._prepared(d.shape, d.scheme, "minmax")
        fp = pp["fast"]
        sc, gb = be._decoded_scales(d)
        wv = d.payload[: pp["plan"].values_nbytes].view(np.uint32)
        want = be.to_numpy(be.dequantize(q)).reshape(n)
        nb = d.payload.size + 4 * n
        pw = 32 // fast.KIND_BITS[fp["kind"]]
        for name, kern, grid in [
            (f"words{fast.DQ_WORDS} (default)", fast.dequant_kernel(fp["kind"]), fast.launch_dequant(fp["nruns"], pw)),
            ("words4", _jit_regs(64)(fast._dequant_kernel(fp["kind"], 4)), fast.launch_dequant(fp["nruns"], pw)),
            (f"words{fast.DQ_WORDS}-grid8", fast.dequant_kernel(fp["kind"]), (132 * 8, 256)),
        ]:
            def run():
                kern[grid](wv, sc, gb, pp["lut"], out, fp["G"])

            run()
            ok = bool(np.array_equal(out.copy_to_host().view(np.uint32), want.view(np.uint32)))
            t = _time(torch, run)
            r = {"scheme": text, "variant": name, "ms": t, "gbs": nb / t / 1e6, "bit_exact": ok}
            res["dequant"].append(r)
            print(json.dumps(r), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_tune.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
