"""GPU benchmark of the `cuda` backend (one run on an H200; needs torch with CUDA).

    NUMBA_ENABLE_CUDASIM=0 python benchmarks/gpu.py [--out DIR] [--no-compile] [--quick] [--no-fresh]

For a 256M-element float32 tensor [65536, 4096] it measures, with CUDA events and medians:

* a device-to-device copy of the input (torch `copy_`): the bandwidth ceiling;
* calibrate+quantize and dequantize (to float32) of five schemes on the cuda backend, as
  - `api`: the whole `be.quantize(x, s)` / `be.dequantize(q)` call on the torch tensor (a result
    from the memory pool, the launches, the 4-byte flag read back: non-finite input for
    quantize, invalid code for dequantize where the scheme has them),
  - `api_out`: the whole call into existing memory (`be.quantize(x, s, out=q)`,
    `be.dequantize(q, out=y)`),
  - `kernels`: the kernel launches alone into preallocated buffers, timed behind a GPU sleep so
    that Python launch latency is hidden (what the GPU spends);
  the API calls are timed in `API_ROUNDS` rounds over the schemes (their host time swings with
  the lent machine's host, in stretches of tens of ms), every timing after `WARM_S` of untimed
  calls;
* torch doing the same maths, eager and `torch.compile`d (same bytes in and out; torch rounds
  scales to nearest where qcore rounds up, which costs the same);
* GB/s = (bytes read + bytes written) / time: input f32 + payload for quantize, the reverse for
  dequantize;
* the first quantize and dequantize of each scheme in a fresh process (a child process that
  takes the schemes in turn, after CUDA is set up; run twice: the first child may compile, the
  second finds the kernels in numba's disk cache);
* the fused GEMV / small-M matmul x[M, 8192] @ w[8192, 8192] with w in q4s/block32:f16 (x a torch
  tensor), against torch fp16 `x @ w`: the kernels, the whole call (with and without `out=`),
  and the host time of one call (`host_us`: the call's wall time while the GPU is kept busy, so
  no launch waits; the shapes and torch's calls take turns in runs of 50). Before every timed
  call a read of a 512 MiB buffer evicts the weight
  from L2 (the 36 MB quantized weight would otherwise stay in the 60 MB L2) and leaves L2
  holding clean lines, as in a decode step that has just read other layers' weights; M = 1 is
  also timed after a 512 MiB *write*, which leaves L2 full of dirty lines that the timed kernel
  must write back first (a model step whose previous layer wrote its activations).

Writes `gpu.json` into --out and prints its tables; `benchmarks/report.py` renders
docs/performance.md from it (copied to `benchmarks/results/gpu.json`).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

import runinfo  # benchmarks/runinfo.py (this folder is on sys.path when the script runs)

ROWS, COLS = 65536, 4096  # 2**28 elements
SCHEMES = [
    "q8s/block32:f16",
    "q4s/block32:f16",
    "e4m3/block32:f32",
    "e2m1/block16:ue4m3/tensor:f32/packed_native",  # nvfp4
    "q8s",
]


def l2_flushes(torch):
    """(read, write) L2 evictions over one 512 MiB buffer: `read()` leaves L2 holding clean
    lines (a decode step's state after reading other layers' weights), `write()` leaves it full
    of dirty lines that the next kernel must write back first."""
    buf = torch.zeros(512 * 2**20 // 4, device="cuda")
    return (lambda: buf.sum()), (lambda: buf.zero_())


def _timer(torch, fn, iters, warmup=2, hide_launch=False, flush=None):
    """Median ms of fn() over iters, CUDA events around each call (`_timers_in_turn` of fn alone)."""
    return _timers_in_turn(torch, {"fn": fn}, iters, warmup, flush, hide_launch)["fn"]


WARM_S = 0.2  # seconds of untimed calls before each timing: the host and GPU at their working clocks
API_ROUNDS = 3  # rounds over the schemes in which the API-call columns are timed


def _timers_in_turn(torch, fns: dict, iters, warmup=2, flush=None, hide_launch=False) -> dict:
    """Median ms of each of `fns` (label -> fn) over iters (`samples_in_turn`)."""
    return {k: statistics.median(v) for k, v in samples_in_turn(torch, fns, iters, warmup, flush, hide_launch).items()}


def samples_in_turn(torch, fns: dict, iters, warmup=2, flush=None, hide_launch=False, warm_s: float = WARM_S) -> dict:
    """The ms of each of `fns` (label -> fn) in iters calls, CUDA events around each call, the
    functions taking turns call by call: a slow stretch of the host falls on each of them alike,
    so their ratios hold within one run. `flush()` runs before each call (an L2 eviction,
    `l2_flushes`); with `hide_launch` a sleep kernel keeps the GPU busy while the host enqueues.
    Untimed calls run first for `warm_s` seconds (and at least `warmup` rounds), so that the
    first functions timed after an idle stretch (the fresh-process children, a compilation) are
    not timed while the host and the GPU come back to their working clocks. The two events are
    made (and recorded once) before the loop: torch creates a CUDA event at its first record,
    which would otherwise land inside the timed span after fn()."""
    ts: dict = {k: [] for k in fns}
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    e.record()
    end = time.perf_counter() + warm_s
    while time.perf_counter() < end:
        for fn in fns.values():
            if flush is not None:
                flush()
            fn()
        torch.cuda.synchronize()
    for i in range(warmup + iters):
        for k, fn in fns.items():
            if flush is not None:
                flush()
            torch.cuda.synchronize()
            if hide_launch:
                torch.cuda._sleep(2_000_000)  # ~1 ms: the GPU is busy while the host enqueues
            s.record()
            fn()
            e.record()
            e.synchronize()
            if i >= warmup:
                ts[k].append(s.elapsed_time(e))
    return ts


def _host_us(torch, fns: dict, iters=200, warmup=20, rounds=4) -> dict:
    """Median host (wall) time in us of one call of each of `fns` (label -> fn), with the GPU
    kept busy (a sleep kernel queued first) so that launches never wait for the device. The
    functions take turns in `rounds` rounds, each a run of `warmup / rounds` untimed and then
    `iters / rounds` timed calls of one function: a slow stretch of the host falls on all of
    them alike instead of on one, and within a run the calls repeat as a loop's would."""
    ts: dict = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            for i in range(warmup // rounds + iters // rounds):
                torch.cuda.synchronize()
                torch.cuda._sleep(1_000_000)
                t0 = time.perf_counter()
                fn()
                if i >= warmup // rounds:
                    ts[k].append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return {k: 1e6 * statistics.median(v) for k, v in ts.items()}


def _host_loop_us(torch, fn, calls=100, rounds=9):
    """Host (wall) time per call of `calls` back-to-back fn() calls in us (a decode step's
    matmuls, one after the other), with the GPU kept busy so that launches never wait; median of
    `rounds`. `_host_us` times one call just after a synchronisation, with the host's caches cold."""
    ts = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        torch.cuda._sleep(40_000_000)  # ~20 ms of GPU time ahead of the calls
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        ts.append((time.perf_counter() - t0) / calls)
    torch.cuda.synchronize()
    return 1e6 * statistics.median(ts)


FIRST_CALL = """
import sys, time
import numpy as np
from numba import cuda
import qcore
cuda.current_context()
be = qcore.backend("cuda")
x = cuda.to_device(np.random.default_rng(0).standard_normal((256, 4096)).astype(np.float32))
cuda.synchronize()
for text in sys.argv[1:]:
    t0 = time.perf_counter()
    q = be.quantize(x, text)
    cuda.synchronize()
    t1 = time.perf_counter()
    be.dequantize(q)
    cuda.synchronize()
    t2 = time.perf_counter()
    print("FIRST", text, t1 - t0, t2 - t1, flush=True)
"""


def first_calls(schemes):
    """{scheme: [(quantize s, dequantize s) in child 1, in child 2]}: the first calls of each scheme
    in a fresh process; the first child may compile (empty disk cache), the second loads."""
    import subprocess

    out = {t: [] for t in schemes}
    for _ in range(2):
        try:
            r = subprocess.run([sys.executable, "-c", FIRST_CALL, *schemes], capture_output=True, text=True,
                               env={**os.environ, "NUMBA_ENABLE_CUDASIM": "0"}, timeout=240)
            stdout = r.stdout
        except subprocess.TimeoutExpired as e:
            stdout = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        for ln in stdout.splitlines():
            if ln.startswith("FIRST"):
                _, text, q, dq = ln.split()
                out[text].append((float(q), float(dq)))
    for t in schemes:
        out[t] += [(float("nan"), float("nan"))] * (2 - len(out[t]))
    return out


def _torch_fns(torch):
    """torch versions of the same maths: (quantize(x) -> tensors, dequantize(*tensors) -> f32)."""
    E2M1_EDGES = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], device="cuda")
    E2M1_LUT = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], device="cuda")

    def q_int_block(x, h, lo, hi, pack4):
        xb = x.view(-1, 32)
        s = (xb.abs().amax(1, keepdim=True) / h).half()
        q = torch.round(xb / s.float()).clamp(lo, hi).to(torch.int8)
        if pack4:
            q = q.view(-1, 2)
            q = (q[:, 0].to(torch.uint8) & 0xF) | (q[:, 1].to(torch.uint8) << 4)
        return q, s

    def dq_int_block(q, s, pack4):
        if pack4:
            lo = (q & 0xF).to(torch.int8)
            hi = (q >> 4).to(torch.int8)
            lo = (lo ^ 8) - 8
            hi = (hi ^ 8) - 8
            q = torch.stack([lo, hi], 1)
        return (q.view(-1, 32).float() * s.float()).view(ROWS, COLS)

    def q_e4m3(x):
        xb = x.view(-1, 32)
        s = xb.abs().amax(1, keepdim=True) / 448.0
        return (xb / s).clamp(-448, 448).to(torch.float8_e4m3fn), s

    def dq_e4m3(q, s):
        return (q.float() * s).view(ROWS, COLS)

    def q_nvfp4(x):
        xb = x.view(-1, 16)
        sb = xb.abs().amax(1, keepdim=True) / 6.0
        g = torch.clamp(sb.max() / 448.0, min=1.17549435e-38)
        sbq = (sb / g).to(torch.float8_e4m3fn)
        y = xb / (g * sbq.float())
        c = torch.bucketize(y.abs(), E2M1_EDGES).to(torch.uint8) | ((y < 0).to(torch.uint8) << 3)
        c = c.view(-1, 2)
        return c[:, 0] | (c[:, 1] << 4), sbq, g

    def dq_nvfp4(p, sbq, g):
        c = torch.stack([p & 0xF, p >> 4], 1).view(-1, 16).long()
        return (E2M1_LUT[c] * (g * sbq.float())).view(ROWS, COLS)

    def q_q8_tensor(x):
        s = x.abs().amax() / 127.0
        return torch.round(x / s).clamp(-127, 127).to(torch.int8), s

    def dq_q8_tensor(q, s):
        return q.float() * s

    return {
        SCHEMES[0]: (lambda x: q_int_block(x, 127.0, -127, 127, False), lambda q, s: dq_int_block(q, s, False)),
        SCHEMES[1]: (lambda x: q_int_block(x, 7.0, -7, 7, True), lambda q, s: dq_int_block(q, s, True)),
        SCHEMES[2]: (q_e4m3, dq_e4m3),
        SCHEMES[3]: (q_nvfp4, dq_nvfp4),
        SCHEMES[4]: (q_q8_tensor, dq_q8_tensor),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile (~18 s per graph)")
    ap.add_argument("--quick", action="store_true", help="fewer iterations")
    ap.add_argument("--no-fresh", action="store_true", help="skip the first calls in fresh processes (~30 s)")
    args = ap.parse_args(argv)
    import torch
    from numba import config, cuda

    if config.ENABLE_CUDASIM:
        print("run with NUMBA_ENABLE_CUDASIM=0 on a GPU", file=sys.stderr)
        return 2
    import qcore

    be = qcore.backend("cuda")
    iters = 5 if args.quick else 15
    n = ROWS * COLS
    import numba_cuda

    res = {"run": runinfo.record(f"1x {torch.cuda.get_device_name()}",
                                 f"numba-cuda {numba_cuda.__version__}, numpy {np.__version__}, torch {torch.__version__}",
                                 "NUMBA_ENABLE_CUDASIM=0 python benchmarks/gpu.py "
                                 + " ".join(sys.argv[1:] if argv is None else argv)),
           "device": torch.cuda.get_device_name(), "describe": be.describe(), "shape": [ROWS, COLS], "n": n, "rows": [],
           "timing": {"iters": iters, "api_iters": API_ROUNDS * iters, "api_rounds": API_ROUNDS, "warm_s": WARM_S}}
    torch.manual_seed(0)
    x = torch.randn(ROWS, COLS, device="cuda") * 3
    xd = cuda.as_cuda_array(x)
    xflat = xd.reshape(n)  # what the API hands the kernels (zero-copy)
    y = torch.empty_like(x)
    t = _timer(torch, lambda: y.copy_(x), iters)
    copy_gbs = 2 * 4 * n / t / 1e6
    res["copy"] = {"ms": t, "gbs": copy_gbs}
    print(f"copy: {t:.3f} ms, {copy_gbs:.0f} GB/s", flush=True)
    tfns = _torch_fns(torch)
    fresh = {t: [(float("nan"), float("nan"))] * 2 for t in SCHEMES} if args.no_fresh else first_calls(SCHEMES)
    print("first calls in fresh processes:", json.dumps(fresh), flush=True)

    api_fns: dict = {}  # scheme -> its API calls (label -> fn), timed after the loop
    for text in SCHEMES:
        s = qcore.scheme(text)
        fc = fresh[text]
        t0 = time.time()
        q = be.quantize(x, s)  # compiles the kernels once (or loads them from the disk cache)
        compile_s = time.time() - t0
        nbytes = q.nbytes
        row = {"scheme": text, "payload_bytes": nbytes, "first_call_s": compile_s,
               "fresh_process_q_s": [f[0] for f in fc], "fresh_process_dq_s": [f[1] for f in fc]}
        be.dequantize(q)
        yt = torch.empty_like(x)
        api_fns[text] = {"q_api": lambda s=s: be.quantize(x, s), "q_api_out": lambda s=s, q=q: be.quantize(x, s, out=q),
                         "dq_api": lambda q=q: be.dequantize(q), "dq_api_out": lambda q=q, yt=yt: be.dequantize(q, out=yt)}
        payload = cuda.device_array(nbytes, dtype=np.uint8)
        row["q_kern"] = _timer(torch, lambda: be._launch_quantize(xflat, (ROWS, COLS), s, None, "minmax", payload),
                               iters, hide_launch=True)
        out = cuda.device_array(n, dtype=np.float32)
        row["dq_kern"] = _timer(torch, lambda: be._launch_dequantize(q.data, out), iters, hide_launch=True)
        qf, dqf = tfns[text]
        parts = qf(x)
        row["q_eager"] = _timer(torch, lambda: qf(x), iters)
        row["dq_eager"] = _timer(torch, lambda: dqf(*parts), iters)
        if not args.no_compile:
            t0 = time.time()
            cq, cdq = torch.compile(qf), torch.compile(dqf)
            parts = cq(x)
            cdq(*parts)
            row["compile_s"] = time.time() - t0
            row["q_compiled"] = _timer(torch, lambda: cq(x), iters)
            row["dq_compiled"] = _timer(torch, lambda: cdq(*parts), iters)
        res["rows"].append(row)
        del q, yt, payload, out, parts
    # The API calls, in API_ROUNDS rounds over the schemes: a slow stretch of the lent host (tens of
    # ms) reaches one round's samples of a column rather than all of them, and the median passes over it.
    api_samples: dict = {text: {} for text in SCHEMES}
    for _ in range(API_ROUNDS):
        for text in SCHEMES:
            for k, v in samples_in_turn(torch, api_fns[text], iters).items():
                api_samples[text].setdefault(k, []).extend(v)
    del api_fns
    for row in res["rows"]:
        row.update({k: statistics.median(v) for k, v in api_samples[row["scheme"]].items()})
        moved = 4 * n + row["payload_bytes"]  # x and the payload, read one way and written the other
        for k in [k for k in row if k.startswith(("q_", "dq_")) and not k.endswith("_gbs")]:
            row[k + "_gbs"] = moved / row[k] / 1e6
        print(json.dumps(row), flush=True)

    # fused GEMV / small-M matmul
    K_, N_ = 8192, 8192
    w = torch.randn(K_, N_, device="cuda")
    qw = be.quantize(cuda.as_cuda_array(w), "q4s/block32:f16")
    w16 = be.to_numpy(be.dequantize(qw))
    w16 = torch.from_numpy(w16).to("cuda").half()
    flush, flush_dirty = l2_flushes(torch)
    res["gemv"] = []
    ms = (1, 2, 4, 8, 16)
    xs = {m: torch.randn(m, K_, device="cuda") for m in ms}
    outs = {m: torch.empty(m, N_, device="cuda") for m in ms}
    x16s = {m: xs[m].half() for m in ms}
    for m in ms:  # each shape's packed launch is made before the host times are taken
        be.matmul(xs[m], qw), be.matmul(xs[m], qw, out=outs[m]), x16s[m] @ w16
    host = _host_us(torch, {**{(m, "host_us"): (lambda m=m: be.matmul(xs[m], qw)) for m in ms},
                            **{(m, "host_us_out"): (lambda m=m: be.matmul(xs[m], qw, out=outs[m])) for m in ms},
                            **{(m, "torch_fp16_host_us"): (lambda m=m: x16s[m] @ w16) for m in ms}})
    for m in ms:
        xm, xm16, ot = xs[m], x16s[m], outs[m]
        xmd = cuda.as_cuda_array(xm)
        xmflat = xmd.reshape(m * K_)
        got = torch.as_tensor(be.matmul(xm, qw), device="cuda")
        want = xm16.float() @ w16.float()
        err = float((got - want).abs().max() / want.abs().max())
        outm = cuda.device_array(m * N_, dtype=np.float32)
        r = {"m": m, "rel_err": err}
        r.update(_timers_in_turn(torch, {"qcore_api": lambda: be.matmul(xm, qw),
                                         "qcore_api_out": lambda: be.matmul(xm, qw, out=ot),
                                         "torch_fp16_api": lambda: xm16 @ w16}, 3 * iters, flush=flush))
        r.update({k: host[(m, k)] for k in ("host_us", "host_us_out", "torch_fp16_host_us")})
        r["host_loop_us_out"] = _host_loop_us(torch, lambda: be.matmul(xm, qw, out=ot))
        r["torch_fp16_host_loop_us"] = _host_loop_us(torch, lambda: xm16 @ w16)
        r["qcore_kern"] = _timer(torch, lambda: be._launch_matmul(xmflat, qw.data, m, outm), iters, hide_launch=True,
                                 flush=flush)
        r["torch_fp16"] = _timer(torch, lambda: xm16 @ w16, iters, hide_launch=True, flush=flush)
        if m == 1:  # with dirty lines to write back first (module docstring)
            r["qcore_kern_dirty_l2"] = _timer(torch, lambda: be._launch_matmul(xmflat, qw.data, m, outm), iters,
                                              hide_launch=True, flush=flush_dirty)
            r["torch_fp16_dirty_l2"] = _timer(torch, lambda: xm16 @ w16, iters, hide_launch=True, flush=flush_dirty)
        r["speedup_kern"] = r["torch_fp16"] / r["qcore_kern"]
        r["speedup_api"] = r["torch_fp16_api"] / r["qcore_api"]
        r["speedup_api_out"] = r["torch_fp16_api"] / r["qcore_api_out"]
        res["gemv"].append(r)
        print(json.dumps(r), flush=True)

    from qcore_cuda import _launch, _repeat, paths

    res["paths_taken"] = dict(paths.TAKEN)  # which path served the calls (qcore_cuda/paths)
    res["repeat_calls"] = dict(_repeat.HITS)  # calls that skipped the checks (qcore_cuda/_repeat.py)
    res["packed_launches"] = dict(_launch.COUNTS)  # raw: cuLaunchKernel; cuda.core: its fallback
    print("packed launches by path:", res["packed_launches"], flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu.json"), "w") as f:
        json.dump(res, f, indent=1)
    from report import render_gpu  # benchmarks/report.py: the one renderer of docs/performance.md

    print(render_gpu(res))
    print(f"wrote {os.path.join(args.out, 'gpu.json')}: copy it to benchmarks/results/ and run "
          "python benchmarks/report.py to update docs/performance.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
