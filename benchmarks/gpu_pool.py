"""The memory pool's release threshold against a loop's working set (cuda backend; needs torch).

    NUMBA_ENABLE_CUDASIM=0 python benchmarks/gpu_pool.py [--out DIR]

Dequantizes a 1 GiB float32 tensor (q4s/block32:f16) in a loop while one earlier result stays
alive, so the pool holds 2 GiB of results plus the payload: the median wall time of a call
(synchronised before each) in a fresh process per `QCORE_CUDA_POOL_KEEP` value (2G, 8G, and
the default, 1/8 of the device). Below the working set the driver takes the freed block back
at each synchronisation and the next call maps it again. Writes `gpu_pool.json` to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import runinfo  # benchmarks/runinfo.py (this folder is on sys.path when the script runs)

CHILD = r"""
import statistics, time, torch, qcore
from qcore_cuda import pool_bytes
be = qcore.backend("cuda")
x = torch.randn(65536, 4096, device="cuda")
q = be.quantize(x, "q4s/block32:f16")
held = be.dequantize(q)
torch.cuda.synchronize()
ts = []
for _ in range(20):
    torch.cuda.synchronize()
    t0 = time.perf_counter(); y = be.dequantize(q); ts.append(time.perf_counter() - t0)
    del y
torch.cuda.synchronize()
print("RESULT", 1e6 * statistics.median(ts[2:]), pool_bytes()[0][0])
"""


def _gpu_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001
        return "GPU"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    rows = []
    for keep in ("2G", "8G", None):
        env = {k: v for k, v in os.environ.items() if k != "QCORE_CUDA_POOL_KEEP"}
        env["NUMBA_ENABLE_CUDASIM"] = "0"
        if keep is not None:
            env["QCORE_CUDA_POOL_KEEP"] = keep
        r = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300)
        line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT")]
        if not line:
            raise SystemExit(r.stderr[-2000:])
        us, reserved = line[0].split()[1:]
        rows.append({"keep": keep or "default (1/8 of the device)", "dequantize_call_us": float(us),
                     "pool_reserved_bytes": int(reserved)})
        print(json.dumps(rows[-1]), flush=True)
    run = runinfo.record(f"{_gpu_name()}, {os.cpu_count()} CPUs", runinfo.python(),
                         "NUMBA_ENABLE_CUDASIM=0 python benchmarks/gpu_pool.py")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_pool.json"), "w") as f:
        json.dump({"run": run, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
