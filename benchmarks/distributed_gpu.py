"""Multi-GPU run of the distributed quantize: benchmarks/distributed.py's measurement, sized to a short device lease.

Same checkpoint layout as the benchmark (`--shards` files of 4 float32 matrices [rows, 4096],
an index), generated in parallel (8 processes, seed (0, shard)) instead of one generator. The
warm-up (JIT, CUDA contexts in every process) runs on the first `warm` shards rather than on the
whole checkpoint; the single-process warm-up also calibrates the throughput, from which the number
of shards timed (<= --shards) is chosen to fit the deadline. Then one timed run each: single
process, LocalCUDACluster with 2 workers, with 1 worker; every cluster output is compared byte
for byte with the single-process one. The JSON is rewritten after every step.
"""
from __future__ import annotations

import importlib.util
import json
import multiprocessing as mp
import os
import platform
import shutil
import sys
import time

import numpy as np

T0 = time.perf_counter()
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") not in (HERE, os.path.join(ROOT, "benchmarks"))]

SHARDS = int(os.environ.get("SHARDS", 20))
SHARD_MIB = float(os.environ.get("SHARD_MIB", 1024))
COLS = 4096
SCHEME = os.environ.get("SCHEME", "q4s/block32:f16")
DEADLINE = float(os.environ.get("DEADLINE_S", 330))   # seconds after start by which all is done
WORK = os.environ.get("WORK", "/tmp/dist")
OUT = os.environ.get("OUT", "/tmp")
WARM = 2
BACKEND = os.environ.get("BACKEND", "cuda")

doc: dict = {"benchmark": "distributed_gpu (over benchmarks/distributed.py)", "backend": BACKEND,
             "scheme": SCHEME, "stats": False, "runs": [], "events": [],
             "machine": {"platform": platform.platform(), "python": sys.version.split()[0], "cpus": os.cpu_count()}}


def now() -> float:
    return round(time.perf_counter() - T0, 1)


def dump() -> None:
    with open(os.path.join(OUT, "dist.json"), "w") as f:
        f.write(json.dumps(doc, indent=1) + "\n")


def event(text: str) -> None:
    doc["events"].append(f"{now()} s: {text}")
    print(doc["events"][-1], flush=True)
    dump()


def rows() -> int:
    return max(1, int(SHARD_MIB * 2**20 / 4 / COLS / 4))


def name(s: int) -> str:
    return f"model-{s + 1:05d}-of-{SHARDS:05d}.safetensors"


def gen(s: int) -> int:
    from safetensors.numpy import save_file

    rng = np.random.default_rng([0, s])
    part = {f"layers.{s}.m{k}.weight": rng.standard_normal((rows(), COLS), dtype=np.float32) for k in range(4)}
    save_file(part, os.path.join(WORK, "all", name(s)))
    return sum(a.nbytes for a in part.values())


def subset(k: int) -> tuple[str, int]:
    """A checkpoint directory of the first k shards (symbolic links) and its source bytes."""
    d = os.path.join(WORK, f"src{k}")
    os.makedirs(d, exist_ok=True)
    wmap, total = {}, 0
    per = 4 * rows() * COLS * 4
    for s in range(k):
        if not os.path.exists(os.path.join(d, name(s))):
            os.symlink(os.path.join(WORK, "all", name(s)), os.path.join(d, name(s)))
        wmap.update({f"layers.{s}.m{m}.weight": name(s) for m in range(4)})
        total += per
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": wmap}, fh)
    return d, total


def main() -> None:
    shutil.rmtree(WORK, ignore_errors=True)
    os.makedirs(os.path.join(WORK, "all"))
    with mp.get_context("fork").Pool(8) as pool:
        total = sum(pool.map(gen, range(SHARDS)))
    doc.update(shards_written=SHARDS, shard_bytes=total // SHARDS, bytes_written=total)
    event(f"wrote {SHARDS} shards, {total / 1e9:.2f} GB")

    spec = importlib.util.spec_from_file_location("qbench_dist", os.path.join(ROOT, "benchmarks", "distributed.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    import qcore
    from qcore.model.distributed import open_client, quantize_model_distributed

    one_src, one_bytes = subset(1)
    t = time.perf_counter()
    qcore.quantize_model(one_src, os.path.join(WORK, "warm-single"), SCHEME, BACKEND, stats=False)
    t_warm = time.perf_counter() - t
    t = time.perf_counter()
    qcore.quantize_model(one_src, os.path.join(WORK, "calib-single"), SCHEME, BACKEND, stats=False)
    t_cal = time.perf_counter() - t
    rate = one_bytes / t_cal
    doc.update(single_warmup_s=round(t_warm, 2), single_calibration_s=round(t_cal, 2))
    event(f"single warm-up on 1 shard: {t_warm:.2f} s; again: {t_cal:.2f} s ({rate / 1e9:.2f} GB/s)")
    warm_src, warm_bytes = subset(WARM)

    # time left: one single + one 2-GPU + one 1-GPU run of k shards at `rate` (x3 for margin), two
    # cluster starts (~15 s guessed) with their warm-ups on WARM shards (+ JIT), the comparisons.
    per_shard = total / SHARDS
    left = DEADLINE - now() - 2 * (15 + WARM * per_shard / rate + (t_warm - t_cal)) - 10
    k = int(left / (per_shard / rate * 3.0))
    k = max(1, min(SHARDS, k))
    src, nbytes = subset(k)
    doc.update(shards=k, source_bytes=nbytes)
    event(f"timing {k} shards ({nbytes / 1e9:.2f} GB)")

    single_out = os.path.join(WORK, "single")
    t = time.perf_counter()
    qcore.quantize_model(src, single_out, SCHEME, BACKEND, stats=False)
    t = time.perf_counter() - t
    doc["runs"].append({"mode": "single-process", "workers": 1, "gpus": 1, "seconds": round(t, 3),
                        "GB_per_s": round(nbytes / t / 1e9, 3), "GB_per_s_per_gpu": round(nbytes / t / 1e9, 3)})
    event(f"single: {t:.2f} s")

    for n in (2, 1):
        if now() > DEADLINE - 15:
            event(f"skipped {n}-worker cluster: deadline")
            continue
        t0 = time.perf_counter()
        with open_client("local", backend=BACKEND, workers=n) as client:
            start = time.perf_counter() - t0
            info = client.scheduler_info()["workers"]
            n = len(info)
            tw = time.perf_counter()
            quantize_model_distributed(warm_src, os.path.join(WORK, f"warm{n}"), SCHEME, BACKEND, cluster=client,
                                       stats=False)
            tw = time.perf_counter() - tw
            event(f"cluster {n}: start {start:.1f} s, warm-up {tw:.1f} s")
            devs = client.run(lambda: os.environ.get("CUDA_VISIBLE_DEVICES"))
            out = os.path.join(WORK, f"cluster{n}")
            t = time.perf_counter()
            quantize_model_distributed(src, out, SCHEME, BACKEND, cluster=client, stats=False)
            t = time.perf_counter() - t
            same = bench._same(out, single_out)
            doc["runs"].append({"mode": "LocalCUDACluster", "workers": n, "gpus": n, "seconds": round(t, 3),
                                "GB_per_s": round(nbytes / t / 1e9, 3),
                                "GB_per_s_per_gpu": round(nbytes / t / 1e9 / n, 3),
                                "cluster_start_s": round(start, 2), "warmup_s": round(tw, 2),
                                "worker_CUDA_VISIBLE_DEVICES": sorted(map(str, devs.values())), "identical": same})
            event(f"cluster {n}: {t:.2f} s, identical={same}")
    by = {(r["mode"], r["workers"]): r for r in doc["runs"]}
    two, one = by.get(("LocalCUDACluster", 2)), by.get(("LocalCUDACluster", 1))
    single = by[("single-process", 1)]
    if two:
        doc["scaling_2gpu_vs_single"] = round(single["seconds"] / two["seconds"], 3)
        if one:
            doc["scaling_2gpu_vs_1gpu_cluster"] = round(one["seconds"] / two["seconds"], 3)
    event("done")
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
