"""Where the host time of the `cuda` backend's calls goes (cProfile; one H200 run; needs torch).

    NUMBA_ENABLE_CUDASIM=0 python benchmarks/gpu_profile.py [--out DIR]

Profiles 30 calibrate+quantize calls of a float32 torch tensor [65536, 4096] in q8s/block32:f16
and 300 fused matmul calls x[1, 8192] @ w[8192, 8192] (q4s/block32:f16, out= given), after a
warm-up, and prints the 15 functions with the most own time for each (also written to
`profile.txt` in --out). The GPU work is the same as in benchmarks/gpu.py; this shows the
Python and driver calls around it.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys


def _top(fn, n_calls: int, torch) -> str:
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n_calls):
        fn()
    torch.cuda.synchronize()
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(15)
    return buf.getvalue()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    import torch

    import qcore

    be = qcore.backend("cuda")
    x = torch.randn(65536, 4096, device="cuda")
    q = be.quantize(x, "q8s/block32:f16")
    w = be.quantize(torch.randn(8192, 8192, device="cuda"), "q4s/block32:f16")
    xm = torch.randn(1, 8192, device="cuda")
    out = torch.empty(1, 8192, device="cuda")
    for _ in range(3):
        be.quantize(x, "q8s/block32:f16", out=q)
        be.matmul(xm, w, out=out)
    text = "quantize x[65536, 4096] q8s/block32:f16, 30 calls\n" + \
        _top(lambda: be.quantize(x, "q8s/block32:f16"), 30, torch)
    text += "\nmatmul x[1, 8192] @ w q4s/block32:f16, out=, 300 calls\n" + \
        _top(lambda: be.matmul(xm, w, out=out), 300, torch)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "profile.txt"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
