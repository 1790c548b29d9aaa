"""Quantize a multi-shard checkpoint single-process and as one Dask unit per shard.

Usage (from the repository root, with qcore-quant[distributed] and the backend installed)::

    python benchmarks/distributed.py                                    # 8 x 64 MiB shards, ndarray
    python benchmarks/distributed.py --workers 1 --workers 2 --json out.json
    python benchmarks/distributed.py --backend cuda --scheme nvfp4 --shards 8 --shard-mib 512   # one worker per GPU

It writes a float32 checkpoint of `--shards` files of `--shard-mib` MiB (matrices of 4096 columns)
into `--dir` (default a temporary directory), then measures, best of `--repeats` after one warm-up
run (JIT compilation, page cache):

* single: `qcore.quantize_model(IN, OUT, scheme, backend)` in this process;
* cluster, for each `--workers N`: `qcore.model.distributed.quantize_model_distributed` on the
  cluster `--cluster local` starts (`qcore.model.distributed.open_client`: N single-threaded worker
  processes, one Numba thread each; for `--backend cuda` dask-cuda's LocalCUDACluster, by
  default one worker per visible GPU), started beforehand (its start-up time is reported apart).

Each run's output is compared byte for byte with the single-process one. Throughput is source
bytes (float32) per second. Prints a JSON document (also to `--json PATH`) with the machine.
"""
from __future__ import annotations

import argparse
import filecmp
import json
import os
import platform
import shutil
import sys
import tempfile
import time

import numpy as np

# Run as a script, this file's folder comes first on sys.path, and its name would hide Dask's
# `distributed` package (here and in the worker processes, which inherit sys.path).
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]


def _make(path: str, shards: int, shard_mib: float, cols: int) -> int:
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    rows = max(1, int(shard_mib * 2**20 / 4 / cols / 4))  # four matrices per shard
    os.makedirs(path, exist_ok=True)
    wmap, total = {}, 0
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {f"layers.{s}.m{k}.weight": rng.standard_normal((rows, cols), dtype=np.float32) for k in range(4)}
        save_file(part, os.path.join(path, name))
        total += sum(a.nbytes for a in part.values())
        wmap.update({k: name for k in part})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": wmap}, fh)
    return total


def _same(a: str, b: str) -> bool:
    names = sorted(os.listdir(a))
    return names == sorted(os.listdir(b)) and all(filecmp.cmp(os.path.join(a, n), os.path.join(b, n), shallow=False)
                                                  for n in names)


def _best(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, default=8, help="input shards (default 8)")
    ap.add_argument("--shard-mib", type=float, default=64, help="MiB of float32 per shard (default 64)")
    ap.add_argument("--cols", type=int, default=4096, help="columns of each matrix (default 4096)")
    ap.add_argument("--scheme", default="q8s/block32:f16")
    ap.add_argument("--backend", default="ndarray")
    ap.add_argument("--workers", type=int, action="append",
                    help="cluster sizes to run (repeatable; default: 2, or one per GPU for cuda)")
    ap.add_argument("--no-stats", action="store_true", help="skip the per-tensor statistics")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs of each, best is reported (default 2)")
    ap.add_argument("--dir", default=None, help="working directory (default: a temporary one, removed after)")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the JSON document here")
    args = ap.parse_args(argv)

    import qcore
    from qcore.model.distributed import open_client, quantize_model_distributed

    work = args.dir or tempfile.mkdtemp(prefix="qcore-bench-dist-")
    try:
        src = os.path.join(work, "src")
        nbytes = _make(src, args.shards, args.shard_mib, args.cols)
        kw = {"stats": not args.no_stats}
        single_out = os.path.join(work, "single")
        t = _best(lambda: qcore.quantize_model(src, single_out, args.scheme, args.backend, **kw), args.repeats)
        runs = [{"mode": "single-process", "workers": 1, "seconds": round(t, 3),
                 "MB_per_s": round(nbytes / t / 1e6, 1)}]
        cuda = args.backend == "cuda"
        for n in args.workers or [None if cuda else 2]:
            t0 = time.perf_counter()
            with open_client("local", backend=args.backend, workers=n) as client:
                start = time.perf_counter() - t0
                n = len(client.scheduler_info()["workers"])
                out = os.path.join(work, f"cluster{n}")
                t = _best(lambda: quantize_model_distributed(src, out, args.scheme, args.backend, cluster=client,
                                                             **kw), args.repeats)
                runs.append({"mode": "LocalCUDACluster" if cuda else "LocalCluster", "workers": n,
                             "seconds": round(t, 3), "MB_per_s": round(nbytes / t / 1e6, 1),
                             "cluster_start_s": round(start, 2), "identical": _same(out, single_out)})
        doc = {"benchmark": "distributed", "backend": args.backend, "scheme": args.scheme,
               "shards": args.shards, "source_bytes": nbytes, "stats": not args.no_stats, "runs": runs,
               "machine": {"platform": platform.platform(), "python": sys.version.split()[0],
                           "cpus": os.cpu_count()}}
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(doc, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return doc


if __name__ == "__main__":
    main()
