"""End-to-end `qcore quantize` of a checkpoint beside the I/O floor, in one run.

Usage (from the repository root, with qcore and the backend installed)::

    python benchmarks/cli.py                                   # 256 MiB, ndarray, q8s/block32:f16
    python benchmarks/cli.py --backend cuda --scheme nvfp4 --size-mib 1536 --tensors 24 --json out.json

It writes a float32 checkpoint of `--tensors` equal matrices (`--shards` files; 1 = one file) into
`--dir` (default a temporary directory), then, best of `--repeats`, measures

* qcore: `qcore.cli.main.main(["quantize", IN, OUT, "--scheme", S, "--backend", B])` in this process,
  after one warm-up run (JIT compilation, caches), with the per-tensor statistics unless
  `--no-stats`;
* the floor: safetensors alone reading every tensor of the same checkpoint (`safe_open`,
  `get_tensor`) and writing (`save_file`, then fsync, as qcore's atomic writes do) U8 tensors of
  the same sizes as qcore's output;

and, once, the peak resident memory of the command in a fresh process (`qcore.cli.main.main` in a
subprocess; its `VmHWM`, Linux) against the bound 3 x the largest tensor + 300 MB, and that
process's wall time (`cli_process_s`: interpreter start, imports and numba's cache load included). The files are in
the page cache for both timings (the checkpoint was just written and read), so the floor is the
copy-through-the-kernel speed of this machine. Prints a JSON document (also to `--json PATH`).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

import runinfo  # benchmarks/runinfo.py (this folder is on sys.path when the script runs)


def _make(path: str, n: int, rows: int, cols: int, shards: int) -> list[str]:
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    per = -(-n // shards)
    files = []
    if shards > 1:
        os.makedirs(path, exist_ok=True)
    wmap = {}
    for s in range(shards):
        names = range(s * per, min(n, (s + 1) * per))
        part = {f"layers.{k}.weight": rng.standard_normal((rows, cols), dtype=np.float32) for k in names}
        f = os.path.join(path, f"model-{s + 1:05d}-of-{shards:05d}.safetensors") if shards > 1 else path
        save_file(part, f)
        files.append(f)
        wmap.update({k: os.path.basename(f) for k in part})
        del part
    if shards > 1:
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as fh:
            json.dump({"metadata": {}, "weight_map": wmap}, fh)
    return files


def _floor(inputs: list[str], out_sizes: list[int], out: str) -> tuple[float, float]:
    """(read s, write s) with safetensors alone."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    t0 = time.perf_counter()
    for f in inputs:
        with safe_open(f, framework="np") as fh:
            for k in fh.keys():
                fh.get_tensor(k)
    t1 = time.perf_counter()
    arrays = {f"t{i}": np.zeros(n, np.uint8) for i, n in enumerate(out_sizes)}
    t2 = time.perf_counter()
    save_file(arrays, out)
    with open(out, "rb+") as fh:
        os.fsync(fh.fileno())
    t3 = time.perf_counter()
    return t1 - t0, t3 - t2


def _out_sizes(out: str) -> list[int]:
    from qcore.files.checkpoint import resolve
    from qcore.files.io import read_info

    ck = resolve(out)
    return [e.nbytes for s in ck.shards for e in read_info(ck.path(s)).entries]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=float, default=256, help="checkpoint size in MiB of float32 (default 256)")
    ap.add_argument("--tensors", type=int, default=16, help="number of equal matrices (default 16)")
    ap.add_argument("--cols", type=int, default=4096, help="columns of each matrix (default 4096)")
    ap.add_argument("--shards", type=int, default=1, help="files (1: one .safetensors file; default 1)")
    ap.add_argument("--scheme", default="q8s/block32:f16")
    ap.add_argument("--backend", default="ndarray")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs of each, best is reported (default 2)")
    ap.add_argument("--no-stats", action="store_true", help="run qcore with --no-stats")
    ap.add_argument("--dir", default=None, help="working directory (default: a temporary one, removed after)")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the JSON document here")
    args = ap.parse_args(argv)

    from qcore.cli.main import main as qcore_main

    work = args.dir or tempfile.mkdtemp(prefix="qcore-bench-cli-")
    os.makedirs(work, exist_ok=True)
    rows = max(1, int(args.size_mib * 2**20 / 4 / args.tensors / args.cols))
    src = os.path.join(work, "model" if args.shards > 1 else "model.safetensors")
    out = os.path.join(work, "out" if args.shards > 1 else "out.safetensors")
    try:
        inputs = _make(src, args.tensors, rows, args.cols, args.shards)
        cmd = ["quantize", src, out, "--scheme", args.scheme, "--backend", args.backend] + \
            (["--no-stats"] if args.no_stats else [])

        def run_qcore() -> float:
            t0 = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()):
                rc = qcore_main(cmd)
            if rc != 0:
                raise SystemExit(f"qcore quantize failed with exit status {rc}")
            return time.perf_counter() - t0

        run_qcore()  # warm-up: JIT compilation, page cache
        sizes = _out_sizes(out)
        floor_out = os.path.join(work, "floor.safetensors")
        _floor(inputs, sizes, floor_out)
        q_times, floors = [], []
        for _ in range(args.repeats):
            floors.append(_floor(inputs, sizes, floor_out))
            q_times.append(run_qcore())
        best_floor = min(floors, key=sum)
        # peak memory of the command as a user runs it (a fresh process)
        # (the child's own high-water mark: ru_maxrss of children would count the forked parent)
        probe = ("import sys; from qcore.cli.main import main; rc = main(sys.argv[1:]); "
                 "print(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1], "
                 "file=sys.stderr); sys.exit(rc)")
        env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM" or v == "1"}
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-c", probe, *cmd], capture_output=True, text=True, env=env)
        cli_s = time.perf_counter() - t0
        if p.returncode != 0:
            raise SystemExit(p.stderr)
        peak = int(p.stderr.strip().splitlines()[-1]) * 1024
        # the same process's fixed cost: Python, qcore and the backend set up (a CUDA context for
        # cuda), with one tiny tensor quantized; the streaming adds what is above it
        base_probe = ("import numpy as np, qcore, sys; be = qcore.backend(sys.argv[1]); "
                      "be.quantize(np.ones((1, 256), np.float32), sys.argv[2]); "
                      "print(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1])")
        b = subprocess.run([sys.executable, "-c", base_probe, args.backend, args.scheme], capture_output=True,
                           text=True, env=env)
        if b.returncode != 0:
            raise SystemExit(b.stderr)
        baseline = int(b.stdout.strip().splitlines()[-1]) * 1024
        largest = rows * args.cols * 4
        total_in = args.tensors * largest
        import numba

        argv_text = " ".join(sys.argv[1:] if argv is None else argv)
        doc = {
            "run": runinfo.record(runinfo.cpus(), f"{runinfo.python()}, numba {numba.__version__}, numpy {np.__version__}",
                                  f"python benchmarks/cli.py {argv_text}".rstrip()),
            "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}",
            "backend": args.backend,
            "scheme": args.scheme,
            "stats": not args.no_stats,
            "input_bytes": total_in,
            "output_bytes": sum(sizes),
            "tensors": args.tensors,
            "shape": [rows, args.cols],
            "shards": args.shards,
            "qcore_s": min(q_times),
            "qcore_runs_s": q_times,
            "floor_s": sum(best_floor),
            "floor_read_s": best_floor[0],
            "floor_write_s": best_floor[1],
            "ratio_to_floor": min(q_times) / sum(best_floor),
            "qcore_GBps": total_in / min(q_times) / 1e9,
            "cli_process_s": cli_s,
            "peak_rss_bytes": peak,
            "rss_bound_bytes": 3 * largest + 300 * 10**6,
            "within_rss_bound": peak <= 3 * largest + 300 * 10**6,
            "baseline_rss_bytes": baseline,
            "peak_above_baseline_bytes": peak - baseline,
        }
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(doc, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(f"qcore {doc['qcore_s']:.2f} s vs floor {doc['floor_s']:.2f} s (read {doc['floor_read_s']:.2f} + write "
          f"{doc['floor_write_s']:.2f}): {doc['ratio_to_floor']:.2f}x the floor; peak RSS "
          f"{peak / 2**20:.0f} MiB (bound {doc['rss_bound_bytes'] / 2**20:.0f} MiB; the set-up alone "
          f"{baseline / 2**20:.0f} MiB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
