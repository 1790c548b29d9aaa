"""Tuning runs for the cuda backend's fast kernels on a GPU (kernel variants side by side).

    NUMBA_ENABLE_CUDASIM=0 python benchmarks/gpu_tune.py [--out DIR] [--only gemv|dequant|quant] [--quick] [--m 4,8,16]
        [--iters 15] [--scheme TEXT ...] [--variants 0,1,5]

* GEMV `x[M, 8192] @ w[8192, 8192]`, w in q4s/block32:f16 (or each `--scheme`), the FFMA kernel
  (gemv.py): rows of x per launch (mb), u32 words per thread and row (wpt), rows per step, the
  prefetch pipeline, register cap, blocks per SM varied; and for M in `TC_M` the tensor-core
  kernel (tc.py: column groups per block, steps per register set, registers, blocks per SM).
  Each variant's result is checked against x @ dequantize(w) in f64 (largest error over the
  largest |result|, and over the conformance suite's matmul bound) and timed with CUDA events
  after an L2 flush (as in benchmarks/gpu.py), the variants of one M and torch's fp16 matmul
  taking turns call by call (`--iters` calls each, median); then M = 1 with K = 1024 (an eighth
  of the weight), whose time is mostly the fixed costs.
* Dequantize of 2**28 elements: units in flight per thread, each checked bit for bit; next to
  the ceilings of its memory traffic: a device-to-device copy, a 1 GiB fill (writes only) and
  torch's int8 -> float32 conversion (the same 1 : 4 mix of reads and writes as int8
  dequantize).
* Quantize of 2**28 elements (a [65536, 4096] float32 tensor): the fast quantize kernel's blocks
  per SM (`fast.QUANT_PER_SM`) for each value kind of `QUANT_SCHEMES`; a two-pass scheme is timed
  with its max pass (`fast.k_amax`) before it, as a call runs them. All grids of all schemes and
  a device copy take turns call by call, in three rounds; each grid's payload is checked
  against the default grid's.

Prints one JSON line per variant and writes gpu_tune.json into --out.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from gpu import _timer, _timers_in_turn, l2_flushes  # benchmarks/gpu.py (this script's directory is on sys.path)


def _time(torch, fn, flush=None):
    """Median ms of 15 calls, as benchmarks/gpu.py times the kernels (`flush`: its read eviction)."""
    return _timer(torch, fn, 15, hide_launch=True, flush=flush)


# GEMV variants: (mb, wpt, rows, prefetch, registers, blocks per SM, block shape as word-columns
# x k-lanes); Q by value as gemv.buffers passes it. M > mb runs ceil(M / mb) launches.
GEMV_VARIANTS = {  # the first of each M is the FFMA kernel's default for q4s/block32:f16 (gemv.config_for, gemv.tuning)
    1: [(1, 2, 8, True, 128, 2, (32, 8)), (1, 2, 4, True, 128, 2, (32, 8)), (1, 2, 8, True, 128, 2, (16, 16)),
        (1, 2, 4, True, 128, 2, (16, 16)), (1, 2, 4, True, 128, 4, (16, 8)), (1, 2, 8, True, 128, 4, (16, 8)),
        # 16-byte loads per thread-row: 4.0 SASS per weight in the main loop against 4.5 (ptxas), yet slower
        (1, 4, 2, True, 128, 2, (32, 8)), (1, 4, 4, True, 128, 2, (32, 8)), (1, 4, 2, True, 128, 2, (16, 16))],
    2: [(2, 2, 4, True, 128, 2, (16, 16)), (2, 2, 4, True, 128, 2, (32, 8)), (2, 1, 4, True, 128, 2, (32, 8))],
    4: [(4, 1, 4, True, 128, 2, (32, 8))],
    8: [(8, 1, 4, True, 255, 1, (32, 8)), (4, 1, 4, True, 128, 2, (32, 8))],
    16: [(8, 1, 4, True, 255, 1, (32, 8)), (4, 1, 4, True, 128, 2, (32, 8))],
    5: [(8, 1, 4, True, 255, 1, (32, 8))],  # M = 5 and 12 on the FFMA kernel, against the tensor-core kernel
    12: [(8, 1, 4, True, 255, 1, (32, 8))],
}
K1024 = {1: GEMV_VARIANTS[1][:1]}
# tensor-core kernel variants (tc.py): (column groups per block, steps per register set for
# mg = 1 and mg = 2 (None: tc.U), registers, blocks per SM); the first is the backend's default
# (tc.GW, tc.U, tc.REGS, tc.PER_SM)
TC_VARIANTS = [(1, None, None, 128, 2), (1, 2, 1, 128, 2), (1, 8, 4, 255, 1), (2, 2, 2, 128, 2)]
TC_M = (1, 2, 4, 5, 8, 12, 16)


def _empty_kernel(cuda):
    @cuda.jit
    def k_empty(out):
        if cuda.threadIdx.x == 0 and cuda.blockIdx.x == 0:
            out[0] = 1.0
    return k_empty


def tune_gemv(torch, cuda, be, res, flush, k_=8192, n_=8192, variants=None, quick=False, only_m=None, iters=15,
              text="q4s/block32:f16", pick=None):
    from qcore_cuda import gemv, tc
    from qcore_cuda.kernels import jit_regs

    torch.manual_seed(0)
    w = torch.randn(k_, n_, device="cuda")
    qw = be.quantize(cuda.as_cuda_array(w), text)
    data = qw.data
    scales, gbuf = be.decoded_scales(data)
    pp = be.state.plans.get(data.shape, data.scheme, "minmax")
    pl = pp.plan
    w32 = data.payload[: pl.values_nbytes].view(np.uint32)
    kind, Q = gemv.geometry(data.shape, data.scheme)
    wd = torch.as_tensor(be.to_numpy(be.dequantize(qw)), device="cuda").double()
    ms = variants or {**GEMV_VARIANTS, **{m: GEMV_VARIANTS.get(m, []) for m in TC_M}}
    if only_m:
        ms = {m: v for m, v in ms.items() if m in only_m}
    if pick is not None:  # these FFMA variants (indices into each M's list) and no tensor-core kernel
        ms = {m: [v[i] for i in pick if i < len(v)] for m, v in ms.items()}
    for m, vs in sorted(ms.items()):
        x = torch.randn(m, k_, device="cuda")
        xd = cuda.as_cuda_array(x).reshape(m * k_)
        want = x.double() @ wd  # exact to f64, against which every variant's error is shown
        bound = 2 * k_ * 2.0 ** -24 * (x.double().abs() @ wd.abs())  # the conformance suite's matmul bound
        x16, w16 = x.half(), w.half()
        runs = []
        if m == 1:  # the default's grid and block
            ke, eo = _empty_kernel(cuda), cuda.device_array(1, dtype=np.float32)
            _, eg, eb = gemv.plan(Q, vs[0][1], vs[0][5], vs[0][2], vs[0][6])
            runs.append(("empty kernel, same grid", lambda: ke[eg, eb](eo), None, {}))
        for mb, wpt, rows, prefetch, regs, per_sm, shape in (vs[:1] if quick else vs):
            meta = dict(scheme=text, mb=mb, wpt=wpt, rows=rows, prefetch=prefetch, regs=regs, per_sm=per_sm,
                        shape=list(shape))
            one = gemv.under_one_scale(kind, wpt, Q)
            try:
                kern = jit_regs(regs)(gemv._gemv_kernel(kind, mb, wpt, one, rows, prefetch, shape))
            except Exception as e:  # a variant that does not compile is reported, not fatal
                print(json.dumps({"m": m, **meta, "error": str(e)[:300]}), flush=True)
                continue
            q, grid, block = gemv.plan(Q, wpt, per_sm, rows, shape)
            qd = tuple(int(v) for v in q)
            part = cuda.device_array(int(q[gemv.Q_KS]) * mb * n_, dtype=np.float32)
            cnt = cuda.to_device(np.zeros(grid[0], dtype=np.int32))
            out = cuda.device_array(m * n_, dtype=np.float32)

            def run(kern=kern, grid=grid, block=block, qd=qd, part=part, cnt=cnt, out=out, mb=mb):
                for m0 in range(0, m, mb):
                    kern[grid, block](xd, w32, scales, gbuf, pp.lut, part, cnt, out, qd, m0, min(mb, m - m0))

            runs.append((f"mb{mb} wpt{wpt} rows{rows} {'prefetch' if prefetch else 'plain'} r{regs} x{per_sm} "
                          f"{shape[0]}x{shape[1]}",
                         run, out, dict(meta, grid=list(grid))))
        if variants is None and pick is None and m in TC_M and tc.geometry(data.shape, data.scheme) is not None:
            et = tc.slot_scales(scales, gbuf, Q)
            for gw, u1, u2, regs, per_sm in (TC_VARIANTS[:1] if quick else TC_VARIANTS):
                mg = 1 if m <= 8 else 2
                u = (u1 if mg == 1 else u2) or tc.U[mg]
                meta = dict(tc=True, mg=mg, gw=gw, u=u, regs=regs, per_sm=per_sm)
                try:
                    kern = jit_regs(regs)(tc._tc_kernel(kind, mg, gw, u))
                except Exception as e:
                    print(json.dumps({"m": m, **meta, "error": str(e)[:300]}), flush=True)
                    continue
                q, grid, block = tc.plan(Q, gw, per_sm)
                qd = tuple(int(v) for v in q)
                part = cuda.device_array(max(1, int(q[gemv.Q_KS]) * tc.MAX_MB * n_), dtype=np.float32)
                cnt = cuda.to_device(np.zeros(grid[0] + 1, dtype=np.int32))
                out = cuda.device_array(m * n_, dtype=np.float32)
                mb = 8 * mg

                def run(kern=kern, grid=grid, block=block, qd=qd, part=part, cnt=cnt, out=out, mb=mb):
                    for m0 in range(0, m, mb):
                        kern[grid, block](xd, w32, scales, gbuf, pp.lut, part, cnt, out, qd, m0, min(mb, m - m0), et)

                runs.append((f"tensor cores: mg{mg} gw{gw} u{u} r{regs} x{per_sm}", run, out,
                             dict(meta, grid=list(grid))))
        checked = []
        for name, run, out, meta in runs:
            try:
                run()
                err = None
                over = None
                if out is not None:
                    got = torch.as_tensor(out.copy_to_host().reshape(m, n_), device="cuda").double()
                    err = float((got - want).abs().max() / want.abs().max())
                    over = float(((got - want).abs() / bound).max())  # <= 1: inside the bound
            except Exception as e:  # e.g. too many resources for this GPU
                print(json.dumps({"m": m, "variant": name, "error": str(e)[:300]}), flush=True)
                continue
            checked.append((name, run, meta, err, over))
        # every variant and torch in turn, call by call: a slow stretch falls on all of them alike
        fns = {"torch fp16": lambda: x16 @ w16, **{name: run for name, run, *_ in checked}}
        ts = _timers_in_turn(torch, fns, iters, flush=flush, hide_launch=True)
        torch_t = ts["torch fp16"]
        for name, run, meta, err, over in checked:
            t = ts[name]
            r = {"m": m, "k": k_, "n": n_, "variant": name, **meta, "us": round(1e3 * t, 2),
                 "torch_fp16_us": round(1e3 * torch_t, 2), "speedup": round(torch_t / t, 3), "rel_err": err, "err_over_bound": over}
            res["gemv"].append(r)
            print(json.dumps(r), flush=True)


def tune_dequant(torch, cuda, be, res):
    from qcore_cuda import fast
    from qcore_cuda.kernels import jit_regs

    n = 2**28
    x = torch.randn(65536, 4096, device="cuda") * 3
    y = torch.empty_like(x)
    i8 = torch.randint(-128, 127, (n,), dtype=torch.int8, device="cuda")
    f32 = torch.empty(n, device="cuda")
    for name, fn, nb in [("copy 1 GiB f32", lambda: y.copy_(x), 2 * 4 * n), ("fill 1 GiB f32", lambda: y.fill_(1.0), 4 * n),
                         ("torch int8 -> f32", lambda: f32.copy_(i8), 5 * n)]:
        t = _time(torch, fn)
        r = {"scheme": "-", "variant": name, "ms": round(t, 4), "gbs": round(nb / t / 1e6, 1)}
        res["dequant"].append(r)
        print(json.dumps(r), flush=True)
    xd = cuda.as_cuda_array(x)
    out = cuda.device_array(n, dtype=np.float32)
    for text in ("q8s/block32:f16", "q4s/block32:f16", "e4m3/block32:f32", "nvfp4", "q8s"):
        q = be.quantize(xd, text)
        d = q.data
        pp = be.state.plans.get(d.shape, d.scheme, "minmax")
        fp = pp.fast
        sc, gb = be.decoded_scales(d)
        wv = fast.unit_view(d.payload[: pp.plan.values_nbytes], fp.kind)
        want = be.to_numpy(be.dequantize(q)).reshape(n)
        nb = d.payload.size + 4 * n
        grid = fast.launch_dequant(fp.nruns, fp.kind)
        for name, kern in [
            (f"units{fast.dq_units(fp.kind)} (default)", fast.dequant_kernel(fp.kind)),
            ("units4", jit_regs(64)(fast._dequant_kernel(fp.kind, 4))),
            ("scales loaded in the store loop", jit_regs(64)(fast._dequant_kernel(fp.kind, None, False))),
        ]:
            def run():
                kern[grid](wv, sc, gb, pp.lut, out, fp.G)

            run()
            ok = bool(np.array_equal(out.copy_to_host().view(np.uint32), want.view(np.uint32)))
            t = _time(torch, run)
            r = {"scheme": text, "variant": name, "ms": round(t, 4), "gbs": round(nb / t / 1e6, 1), "bit_exact": ok}
            res["dequant"].append(r)
            print(json.dumps(r), flush=True)


QUANT_SCHEMES = ("q4s/block32:f16", "q8s/block32:f16", "e4m3/block32:f32", "q8s",
                 "e2m1/block16:ue4m3/tensor:f32/packed_native")
QUANT_PER_SM = (2, 3, 4, 6, 8, 12)


def tune_quant(torch, cuda, be, res, iters=15):
    from qcore_cuda import _streams, fast
    from qcore_cuda._launch import Packed
    from qcore_cuda.paths.quantize import fast_quant_launches

    rows, cols = 65536, 4096
    n = rows * cols
    x = torch.randn(rows, cols, device="cuda")
    y = torch.empty_like(x)
    xf = cuda.as_cuda_array(x).reshape(n)
    amax_grid = fast.launch(n // 16, fast.AMAX_PER_SM)
    fs = be.state.scratch.buffers(_streams.DEFAULT).stats  # the statistics scratch: the max pass writes gs[1], never zeroed here
    fns, nbytes, meta = {"copy": lambda: y.copy_(x)}, {"copy": 2 * 4 * n}, {}
    for text in QUANT_SCHEMES:
        s = be._require(text)
        q = be.quantize(x, s)
        pp = be.state.plans.get((rows, cols), s, "minmax")
        fp = pp.fast
        packed = fast_quant_launches(be.state.scratch, pp, xf, None, None, fp.G, s=_streams.DEFAULT)[1]
        stored, flag, g_dev, c_dev = (packed._args[i] for i in (3, 5, 6, 7))  # device arrays, as the call passes them
        kern = fast.quant_kernel(fp.kind)
        want = None
        for per_sm in sorted(set(QUANT_PER_SM) | {fast.QUANT_PER_SM[fp.kind]}):
            pay = cuda.device_array(q.nbytes, dtype=np.uint8)
            args = (xf, pay[: int(pp.plan.values_nbytes)].view(np.uint32), pay, stored, fs, flag, g_dev, c_dev)
            # packed launches, as a call makes them (a few µs of host time each, hidden by the sleep)
            quant = Packed(kern, *fast.launch(n // 16, per_sm), list(args), dynamic=())
            amax = Packed(fast.k_amax, *amax_grid, [xf, fs, flag, n // 16], dynamic=()) if fp.two_pass else None

            def run(quant=quant, amax=amax):
                if amax is not None:
                    amax()
                quant()

            run()
            got = pay.copy_to_host()
            want = got if want is None else want
            label = f"{text} x{per_sm}"
            fns[label], nbytes[label] = run, (2 if fp.two_pass else 1) * 4 * n + q.nbytes
            meta[label] = {"scheme": text, "per_sm": per_sm, "default": per_sm == fast.QUANT_PER_SM[fp.kind],
                           "same_bytes": bool(np.array_equal(got, want))}
    for rnd in range(3):
        t = _timers_in_turn(torch, fns, iters, hide_launch=True)
        for label, ms in t.items():
            r = {"round": rnd, "label": label, **meta.get(label, {}), "us": round(ms * 1000, 1),
                 "gbs": round(nbytes[label] / ms / 1e6, 1)}
            res["quant"].append(r)
        print(json.dumps({label: round(ms * 1000, 1) for label, ms in t.items()}), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--only", choices=("gemv", "dequant", "quant"), help="run one of the three parts")
    ap.add_argument("--quick", action="store_true", help="each GEMV kernel's default per M only")
    ap.add_argument("--m", type=lambda t: [int(v) for v in t.split(",")], help="these M only (comma-separated)")
    ap.add_argument("--iters", type=int, default=15, help="timed calls per GEMV variant (median)")
    ap.add_argument("--scheme", action="append", help="the weight's scheme for the GEMV part (repeatable; "
                    "default q4s/block32:f16)")
    ap.add_argument("--variants", type=lambda t: [int(v) for v in t.split(",")],
                    help="these FFMA variants only (indices into each M's GEMV_VARIANTS, comma-separated), "
                         "no tensor-core kernel")
    args = ap.parse_args(argv)
    import torch
    from numba import config, cuda

    if config.ENABLE_CUDASIM:
        print("run with NUMBA_ENABLE_CUDASIM=0 on a GPU", file=sys.stderr)
        return 2
    import qcore

    be = qcore.backend("cuda")
    res = {"gemv": [], "dequant": [], "quant": []}
    flush = l2_flushes(torch)[0]
    if args.only == "quant":
        tune_quant(torch, cuda, be, res)
    elif args.only != "dequant":
        for text in args.scheme or ["q4s/block32:f16"]:
            tune_gemv(torch, cuda, be, res, flush, quick=args.quick, only_m=args.m, iters=args.iters, text=text,
                      pick=args.variants)
        tune_gemv(torch, cuda, be, res, flush, k_=1024, variants=K1024)  # 1/8 of the weight: the fixed costs
    if args.only in (None, "dequant"):
        tune_dequant(torch, cuda, be, res)
    if args.only is None:
        tune_quant(torch, cuda, be, res)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_tune.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
