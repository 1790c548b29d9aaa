"""Where a whole `cuda` backend call's time goes beyond its kernels (one H200 run; needs torch).

    NUMBA_ENABLE_CUDASIM=0 python benchmarks/gpu_calls.py [--out DIR] [--iters N]

benchmarks/gpu.py times a whole call between two CUDA events, the GPU idle before it. This
script splits that span for quantize, quantize into an existing tensor (`out=`), dequantize
(1 GiB float32 torch tensors, [65536, 4096]) and the fused matmul `x[M, 8192] @ w[8192, 8192]`
(q4s/block32:f16, M = 1 and 4, `out=`), each repeat call of one shape and scheme:

* `host_before_launch_us`: wall time from the call's start to its first kernel launch (Python,
  the pool, the packed launch's argument swap);
* `host_wait_us`: the wait for the call's stream before the flag is read (0 where the call
  reads no flag: dequantize of a scheme whose every code is a value);
* `host_after_wait_us`: from the end of that wait to the call's return;
* `gpu_idle_before_us` / `kernels_us` / `gpu_after_us`: on the GPU (events recorded inside the
  call next to its first and last launch), from the start event to the first launch, the
  launches, and from the last launch to the end event, which the host records after the call
  returns;
* `events_alone_us`: the two events with no call between them (what the measurement itself
  adds to any call, torch's too).

`api_us` and the host columns come from calls without the inner events (each event record costs
host time), the GPU columns from calls with them. Medians of `--iters` calls, the GPU synchronised before
each. Writes `gpu_calls.json` into --out; `benchmarks/report.py` renders it into
docs/performance.md (copied to `benchmarks/results/`).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import runinfo  # benchmarks/runinfo.py (this folder is on sys.path when the script runs)

SCHEMES = ["q8s/block32:f16", "q4s/block32:f16", "e4m3/block32:f32", "e2m1/block16:ue4m3/tensor:f32/packed_native"]
MATMUL_SCHEME = "q4s/block32:f16"


class Probe:
    """Wraps the backend's raw kernel launch and flag read to note when they happen (host clock)
    and, when `events` is on, records CUDA events next to the first and last launch."""

    def __init__(self, torch):
        from qcore_cuda import _launch, _scratch

        self.torch, self.marks, self.events = torch, {}, False
        self.first, self.last = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        launch, read_flag = _launch._RawLaunch.__call__, _scratch.Scratch.read_flag
        probe = self

        def noted_launch(raw, stream):
            if "launch" not in probe.marks:
                probe.marks["launch"] = time.perf_counter()
                if probe.events:
                    probe.first.record()
            ok = launch(raw, stream)
            if probe.events:
                probe.last.record()
            return ok

        def noted_read_flag(be, flag, s, ready=None):
            probe.marks["wait0"] = time.perf_counter()
            try:
                return read_flag(be, flag, s, ready)
            finally:
                probe.marks["wait1"] = time.perf_counter()

        _launch._RawLaunch.__call__ = noted_launch
        _scratch.Scratch.read_flag = noted_read_flag

    def split(self, fn, iters: int) -> dict:
        """The phases of fn() (module docstring), medians in µs."""
        torch = self.torch
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        for ev in (start, end, self.first, self.last):  # torch makes an event at its first record
            ev.record()
        cols: dict = {}
        for events in (False, True):
            self.events = events
            for i in range(iters + 3):
                torch.cuda.synchronize()
                self.marks.clear()
                start.record()
                t0 = time.perf_counter()
                fn()
                t1 = time.perf_counter()
                end.record()
                end.synchronize()
                if i < 3 or "launch" not in self.marks:
                    continue
                m = self.marks
                got = {} if events else {
                    "api_us": start.elapsed_time(end) * 1e3,
                    "host_before_launch_us": (m["launch"] - t0) * 1e6,
                    "host_wait_us": (m.get("wait1", t1) - m.get("wait0", t1)) * 1e6,
                    "host_after_wait_us": (t1 - m.get("wait1", t1)) * 1e6 if "wait1" in m else 0.0,
                    "host_call_us": (t1 - t0) * 1e6}
                if events:
                    got.update(gpu_idle_before_us=start.elapsed_time(self.first) * 1e3,
                               kernels_us=self.first.elapsed_time(self.last) * 1e3,
                               gpu_after_us=self.last.elapsed_time(end) * 1e3)
                for k, v in got.items():
                    cols.setdefault(k, []).append(v)
        self.events = False
        return {k: round(statistics.median(v), 1) for k, v in cols.items()}


def events_alone(torch, iters: int) -> float:
    """µs between two events recorded back to back, the GPU idle (median)."""
    s, e = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    ts = []
    for _ in range(iters):
        torch.cuda.synchronize()
        s.record()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) * 1e3)
    return round(statistics.median(ts), 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--iters", type=int, default=40)
    args = ap.parse_args(argv)
    import torch

    import qcore

    be = qcore.backend("cuda")
    probe = Probe(torch)
    torch.manual_seed(0)
    x = torch.randn(65536, 4096, device="cuda") * 3
    rows = []

    def add(what: str, fn) -> None:
        fn()  # the first call takes the whole way and packs the launches; the timed ones repeat it
        torch.cuda.synchronize()
        row = {"call": what, **probe.split(fn, args.iters)}
        rows.append(row)
        print(json.dumps(row), flush=True)

    for s in SCHEMES:
        q = be.quantize(x, s)
        add(f"quantize `{s}`", lambda s=s: be.quantize(x, s))
        add(f"quantize `{s}`, out=", lambda s=s, q=q: be.quantize(x, s, out=q))
        add(f"dequantize `{s}`", lambda q=q: be.dequantize(q))
        del q
    w = be.quantize(torch.randn(8192, 8192, device="cuda"), MATMUL_SCHEME)
    for m in (1, 4):
        xm = torch.randn(m, 8192, device="cuda")
        y = torch.empty(m, 8192, device="cuda")
        add(f"matmul M = {m}, out=", lambda xm=xm, y=y: be.matmul(xm, w, out=y))
    import numba_cuda

    res = {"run": runinfo.record(f"1x {torch.cuda.get_device_name()}, {os.cpu_count()} CPUs",
                                 f"{runinfo.python()}, numba-cuda {numba_cuda.__version__}, torch {torch.__version__}",
                                 "NUMBA_ENABLE_CUDASIM=0 python benchmarks/gpu_calls.py " + " ".join(argv or sys.argv[1:])),
           "events_alone_us": events_alone(torch, args.iters), "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_calls.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"events alone: {res['events_alone_us']} µs; wrote {os.path.join(args.out, 'gpu_calls.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
