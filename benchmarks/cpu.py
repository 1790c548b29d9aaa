"""CPU throughput of the `ndarray` backend (issue 3; SPEC §2 arithmetic, §3 bytes).

Usage (from the repository root, with qcore and backends/ndarray installed)::

    python benchmarks/cpu.py                      # print the table
    python benchmarks/cpu.py --write-docs         # also replace '## CPU (ndarray)' in docs/performance.md

Everything runs in one process on a 64M-element float32 input (8192 x 8192, 256 MiB). Each row
is the median (and best) of `--repeats` runs; GB/s counts input + output bytes:

* calibrate+quantize: float32 input + payload (codes and scales);
* dequantize: payload + float32 output;
* `np.copyto` of the same input: read + write, the memory ceiling on this machine.

The `reference` backend runs on a smaller input (`--ref-size`, default 4M elements) because it
is plain numpy with full-size temporaries. `torch.quantize_per_tensor` (qint8) is measured when
torch imports; torch is not a qcore dependency (see docs/performance.md for how the figure was
taken). numba's first-call time is measured with an empty cache directory (a cold compile)
unless `--warm-cache` is given. Peak memory of quantize is tracemalloc's peak (numpy reports its
buffers to tracemalloc) over the input's size.
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

SCHEMES = ["q8s", "q8s/block32:f16", "q8f/block32:ue8m0"]
HEADING = "## CPU (ndarray)"


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
    ap.add_argument("--write-docs", nargs="?", const="docs/performance.md", default=None, metavar="PATH")
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

    copy_gbs = rows[0][6] / rows[0][4] / 1e9
    argv_text = " ".join(sys.argv[1:] if argv is None else argv)
    pythonpath = os.environ.get("PYTHONPATH")
    command = (f"PYTHONPATH={pythonpath} " if pythonpath else "") + f"python benchmarks/cpu.py {argv_text}".rstrip()
    lines = [
        f"Command: `{command}` "
        f"({platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, numba {numba.__version__} "
        f"with {threads} threads, numpy {np.__version__}, {torch_note}). Input {x.shape} float32 "
        f"({n_in >> 20} MiB); median and best of {args.repeats} runs; GB/s = (input + output bytes) / median.",
        "",
        "| operation | scheme | backend | threads | median ms | best ms | GB/s | % of copy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for what, text, be, th, med, best, nbytes in rows:
        gbs = nbytes / med / 1e9
        lines.append(f"| {what} | `{text}` | {be} | {th} | {med * 1e3:.1f} | {best * 1e3:.1f} | {gbs:.2f} | "
                     f"{100 * gbs / copy_gbs:.0f}% |")
    lines += ["", "First call in a fresh process ("
              + ("warm on-disk cache" if args.warm_cache else "empty numba cache: compile included") + "):", ""]
    lines += [f"- {k}: {v:.2f} s" for k, v in first.items()]
    lines += [f"- then, in a new process with that cache filled: {warm_first:.2f} s for all six first calls "
              "(cache load)"]
    lines += ["", "Peak memory of quantize (tracemalloc peak / input bytes):", ""]
    lines += [f"- `{k}`: {v:.3f}x" for k, v in peaks.items()]

    def gbs(what, text, be, th):
        for r in rows:
            if r[:4] == (what, text, be, th):
                return r[6] / r[4] / 1e9
        return None

    lines += ["", "Targets of issue 3, checked from the medians above:", ""]
    for text in SCHEMES:
        q_pct = 100 * gbs("calibrate+quantize", text, "ndarray", threads) / copy_gbs
        d_pct = 100 * gbs("dequantize", text, "ndarray", threads) / copy_gbs
        lines.append(f"- `{text}`: quantize {q_pct:.0f}% and dequantize {d_pct:.0f}% of copy's GB/s "
                     f"(target >= 50%): {'met' if min(q_pct, d_pct) >= 50 else 'NOT met'}")
    t1 = gbs("quantize (scale given)", "qint8 per-tensor", "torch", 1)
    ours1 = gbs("calibrate+quantize", "q8s", "ndarray", 1)
    if t1:
        lines.append(f"- one thread, `q8s` calibrate+quantize vs torch `quantize_per_tensor` with the scale given: "
                     f"{ours1 / t1:.2f}x (target >= 1.0x): {'met' if ours1 >= t1 else 'NOT met'}")
    else:
        lines.append("- torch comparison: torch not importable in this run")
    worst = max(peaks.values())
    lines.append(f"- peak memory of quantize {worst:.2f}x the input (target <= 1.5x): "
                 f"{'met' if worst <= 1.5 else 'NOT met'}")
    lines += [
        "",
        "Notes:",
        "",
        "- GB/s counts bytes moved once: f32 input plus payload for quantize, payload plus f32 output for "
        "dequantize. Per-tensor calibrate+quantize reads x twice (statistic, then codes), so its memory traffic "
        "is about 1.8x what the column counts; per-block single-level schemes read x once (fused).",
        "- calibrate+quantize includes calibration; torch's `quantize (scale given)` row does not (its "
        "`calibrate+quantize` row adds `abs().max()`, which makes a full-size temporary).",
        "- The reference backend is measured on a smaller input (its full-size temporaries make 64M slow); its GB/s "
        "is still comparable.",
        "- The machine is shared (other jobs run beside the benchmark): medians swing by 2-10x when they do. "
        "Repeats run round-robin so every row sees the same conditions; rerun when the machine is idle for "
        "clean figures.",
        "- torch is not a qcore dependency. For the torch rows: `pip install --target /tmp/torchpkg torch==2.13.0` "
        "(CPU wheel), then `PYTHONPATH=/tmp/torchpkg python benchmarks/cpu.py`.",
    ]
    text_out = "\n".join(lines)
    print(text_out)

    if args.write_docs:
        path = Path(args.write_docs)
        old = path.read_text() if path.exists() else "# Performance\n"
        section = f"{HEADING}\n\n{text_out}\n"
        pat = re.compile(rf"^{re.escape(HEADING)}\n.*?(?=^## |\Z)", re.S | re.M)
        new = pat.sub(lambda m: section + "\n", old) if pat.search(old) else old.rstrip("\n") + "\n\n" + section
        path.write_text(new)
        print(f"\nwrote {HEADING!r} in {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
