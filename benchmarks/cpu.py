"""CPU throughput of the `ndarray` backend (docs/spec.md: arithmetic, portable bytes).

Usage (from the repository root, with qcore and backends/ndarray installed)::

    python benchmarks/cpu.py                      # print the table
    python benchmarks/cpu.py --json               # also write benchmarks/results/cpu.json
    python benchmarks/report.py                   # then render docs/performance.md from it

Everything runs in one process on a 64M-element float32 input (8192 x 8192, 256 MiB). Each row
is the median (and best) of `--repeats` runs; GB/s counts input + output bytes:

* calibrate+quantize: float32 input + payload (codes and scales);
* dequantize: payload + float32 output;
* `np.copyto` of the same input: read + write, the memory ceiling on this machine.

The `reference` backend runs on a smaller input (`--ref-size`, default 4M elements) because it
is plain numpy with full-size temporaries. `torch.quantize_per_tensor` (qint8) is measured when
torch imports; torch is not a qcore dependency (docs/performance.md says how to add it). numba's first-call time is measured with an empty cache directory (a cold compile)
unless `--warm-cache` is given. Peak memory of quantize is tracemalloc's peak (numpy reports its
buffers to tracemalloc) over the input's size.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import runinfo  # benchmarks/runinfo.py (this folder is on sys.path when the script runs)

SCHEMES = ["q8s", "q8s/block32:f16", "q8f/block32:ue8m0"]


def _timed(fn, repeats: int) -> tuple[float, float]:
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), min(ts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=8192, help="side of the square float32 input (default 8192 = 64M)")
    ap.add_argument("--ref-size", type=int, default=2048, help="side for the reference backend (default 2048 = 4M)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--warm-cache", action="store_true", help="keep numba's on-disk cache (first call = cache load)")
    ap.add_argument("--json", nargs="?", const="benchmarks/results/cpu.json", default=None, metavar="PATH",
                    help="write the results as JSON (default path: benchmarks/results/cpu.json)")
    args = ap.parse_args(argv)

    if not args.warm_cache:  # must happen before numba is imported
        os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="qcore-nb-cold-")

    import numba
    import numpy as np

    import qcore

    nd = qcore.backend("ndarray")
    ref = qcore.backend("reference")
    threads = numba.get_num_threads()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.size, args.size), dtype=np.float32)
    n_in = x.nbytes

    # -- first call (cold compile unless --warm-cache)
    first: dict[str, float] = {}
    qs = {}
    for text in SCHEMES:
        t0 = time.perf_counter()
        qs[text] = nd.quantize(x, text)
        first[f"quantize {text}"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        nd.dequantize(qs[text])
        first[f"dequantize {text}"] = time.perf_counter() - t0

    # -- the same first calls in a new process, whose numba cache the calls above have filled
    probe = ("import time, numpy as np, qcore; x = np.ones((64, 64), np.float32); be = qcore.backend('ndarray'); "
             f"t = time.perf_counter(); [be.dequantize(be.quantize(x, s)) for s in {SCHEMES!r}]; "
             "print(time.perf_counter() - t)")
    warm_first = float(subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True,
                                      text=True, env=dict(os.environ)).stdout.strip())

    # -- cases: (operation, scheme, backend, threads, callable, bytes moved). Repeats run
    # round-robin over a group of cases, so a burst of load from other processes hits every row
    # of the group alike.
    y = np.empty_like(x)
    cases: list[tuple] = [("copy", "np.copyto f32", "numpy", 1, lambda: np.copyto(y, x), 2 * n_in)]

    def with_threads(fn, nthreads):
        def run():
            numba.set_num_threads(nthreads)
            try:
                fn()
            finally:
                numba.set_num_threads(threads)
        return run

    for text in SCHEMES:
        q, nb = qs[text], qs[text].nbytes
        cases.append(("calibrate+quantize", text, "ndarray", threads, lambda t=text: nd.quantize(x, t), n_in + nb))
        cases.append(("dequantize", text, "ndarray", threads, lambda q=q: nd.dequantize(q), nb + n_in))
    q8 = qs["q8s"]
    cases.append(("calibrate+quantize", "q8s", "ndarray", 1, with_threads(lambda: nd.quantize(x, "q8s"), 1),
                  n_in + q8.nbytes))
    cases.append(("dequantize", "q8s", "ndarray", 1, with_threads(lambda: nd.dequantize(q8), 1), q8.nbytes + n_in))

    torch_note = "torch not importable: no torch rows"
    torch_cases: list[tuple] = []
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        import warnings

        warnings.filterwarnings("ignore", category=UserWarning)  # quantize_per_tensor is deprecated in 2.13
        torch_note = f"torch {torch.__version__}"
        xt = torch.from_numpy(x)
        scale = float(np.abs(x).max() / np.float32(127))
        qt = torch.quantize_per_tensor(xt, scale, 0, torch.qint8)
        torch_threads = torch.get_num_threads()

        def torch_threads_of(fn, nthreads):
            def run():
                torch.set_num_threads(nthreads)
                try:
                    fn()
                finally:
                    torch.set_num_threads(torch_threads)
            return run

        for nthreads in sorted({1, torch_threads}):
            torch_cases += [
                ("quantize (scale given)", "qint8 per-tensor", "torch", nthreads,
                 torch_threads_of(lambda: torch.quantize_per_tensor(xt, scale, 0, torch.qint8), nthreads),
                 n_in + n_in // 4),
                ("calibrate+quantize", "qint8 per-tensor", "torch", nthreads,
                 torch_threads_of(lambda: torch.quantize_per_tensor(xt, float(xt.abs().max()) / 127, 0,
                                                                    torch.qint8), nthreads),
                 n_in + n_in // 4),
                ("dequantize", "qint8 per-tensor", "torch", nthreads,
                 torch_threads_of(lambda: qt.dequantize(), nthreads), n_in // 4 + n_in),
            ]

    # -- reference backend, smaller input, fewer repeats
    xr = x[: args.ref_size, : args.ref_size].copy()
    ref_label = f"reference ({xr.size / 2**20:g}M elements)"
    ref_cases = []
    for text in SCHEMES:
        q = ref.quantize(xr, text)
        ref_cases.append(("calibrate+quantize", text, ref_label, 1, lambda t=text: ref.quantize(xr, t),
                          xr.nbytes + q.nbytes))
        ref_cases.append(("dequantize", text, ref_label, 1, lambda q=q: ref.dequantize(q), q.nbytes + xr.nbytes))

    rows: list[tuple] = []  # (what, scheme, backend, threads, median_s, best_s, nbytes)
    for group in (cases, torch_cases):  # torch's own thread pool runs apart from numba's
        times: list[list[float]] = [[] for _ in group]
        for _ in range(args.repeats):
            for i, case in enumerate(group):
                t0 = time.perf_counter()
                case[4]()
                times[i].append(time.perf_counter() - t0)
        for case, ts in zip(group, times):
            rows.append(case[:4] + (statistics.median(ts), min(ts), case[5]))
    for case in ref_cases:
        med, best = _timed(case[4], max(3, args.repeats // 5))
        rows.append(case[:4] + (med, best, case[5]))
    del y, qs, q8

    # -- peak memory of quantize (tracemalloc sees numpy's buffers)
    peaks = {}
    for text in SCHEMES:
        tracemalloc.start()
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        q = nd.quantize(x, text)
        peaks[text] = (tracemalloc.get_traced_memory()[1] - base) / n_in
        tracemalloc.stop()
        del q

    argv_text = " ".join(sys.argv[1:] if argv is None else argv)
    pythonpath = os.environ.get("PYTHONPATH")
    command = (f"PYTHONPATH={pythonpath} " if pythonpath else "") + f"python benchmarks/cpu.py {argv_text}".rstrip()
    res = {
        "run": runinfo.record(runinfo.cpus(), f"{runinfo.python()}, numba {numba.__version__} ({threads} threads), "
                                              f"numpy {np.__version__}, {torch_note}", command),
        "shape": list(x.shape), "repeats": args.repeats,
        "rows": [{"operation": what, "scheme": text, "backend": be, "threads": th, "median_s": med, "best_s": best,
                  "bytes": nbytes, "gbs": nbytes / med / 1e9} for what, text, be, th, med, best, nbytes in rows],
        "first_call_cache": "warm on-disk cache" if args.warm_cache else "empty numba cache: compile included",
        "first_call_s": first, "warm_first_call_s": warm_first, "peak_memory": peaks,
    }
    from report import render_cpu  # benchmarks/report.py: the one renderer of docs/performance.md

    print(render_cpu(res))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
        print(f"wrote {args.json}; python benchmarks/report.py renders docs/performance.md from "
              "benchmarks/results/", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
