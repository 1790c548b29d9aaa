"""Tuning runs of the cuda backend's `linear` kernels: each variant a `benchmarks/matmul.py` run of its own.

    NUMBA_ENABLE_CUDASIM=0 python benchmarks/linear_tune.py [--out DIR] [--decode 8,4,2 8,2,2 ...]
        [--tc 8,4 8,8 ...] [--fused off 128,128,32,8,3,2 ...] [--decode-m 1] [--tc-m 1,8,16]
        [--fused-m 64,256,2048] [--shapes 8192x8192] [--schemes ...] [--reps 10] [--budget-s 50]
        [--timeout-s 90] [--f16] [--dry-run]

The kernels' tunings are read when the backend is imported (`QCORE_CUDA_DECODE_TUNE` =
WARPS,U,RW for the decode kernel, k_decode.py; `QCORE_CUDA_LINEAR_TUNE` = WARPS,U for
the tensor-core kernel, linear.py; a fourth decode field sets the decode kernel's register cap,
`QCORE_CUDA_DECODE_REGS`, and with it its blocks a SM: `--decode 4,2,2,80`; a fifth its staging
order, `QCORE_CUDA_DECODE_LANES`: `--decode 8,4,2,128,0`; a third tensor-core field the tiles of w
a warp, `QCORE_CUDA_LINEAR_TILES` (0: the plan's choice): `--tc 8,4,2`, a fourth the most rows
of x of its wide form, `QCORE_CUDA_LINEAR_WIDE`: `--tc 8,4,0,0`, a fifth its register cap,
`QCORE_CUDA_LINEAR_REGS`, and with it its blocks a SM: `--tc 8,2,0,4,80`), so each variant runs
in a process of its own:
`benchmarks/matmul.py` with the variant in its environment, GPU time (`--hide-launch`), torch
bf16 as the peer in the same process, the weight evicted from L2 before each call. A tensor-core
variant runs with the decode path off (`QCORE_CUDA_LINEAR_DECODE_M=0`), so M = 1 takes it too.
A fused-GEMM variant (`QCORE_CUDA_FUSED_TUNE` = BN,BM,BK,WARPS,STAGES,FORM, fused.py) runs with
that path on from one row and for every value kind (`QCORE_CUDA_LINEAR_FUSED_M=1`,
`QCORE_CUDA_LINEAR_FUSED_KINDS=all`); its variant `off` (`QCORE_CUDA_LINEAR_FUSED_M=0`) runs the
paths that take each M otherwise (the tensor-core kernel, dequantize + cuBLAS), in the same table.
Without `--decode`, `--tc` or `--fused` the decode and tensor-core defaults run; naming any of them
runs only the kernels named (`--fused off 64,256,64,8,4,3` times the fused GEMM alone).

With `--f16` the runs time float16 x (`matmul.py --f16`, torch fp16 the peer) and the tables
read that case (`f16 x`, speed-up over torch fp16 dense): with `--fused off 128,128,64,8,3,2` the
fields form's wide tile against the tensor-core kernel float16 x takes without the fused GEMM.

Each run's `matmul.json` lands in `DIR/<kernel>-<variant>` (commas as dashes);
then one table per kernel: a row per variant, a column per (scheme, shape, M), each cell the plain
`linear` call's speed-up over torch bf16 in that variant's own run. `linear_tune.json` in DIR holds
the same (and each run's command, return code and wall time).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DECODE_ENV, TC_ENV, FUSED_ENV = "QCORE_CUDA_DECODE_TUNE", "QCORE_CUDA_LINEAR_TUNE", "QCORE_CUDA_FUSED_TUNE"
ENVS = {"decode": DECODE_ENV, "tc": TC_ENV, "fused": FUSED_ENV}
"""Each kernel's tuning variable."""
DECODE_VARIANTS = ["8,4,2", "8,2,2", "8,4,1", "4,4,2", "8,8,1"]
"""The decode kernel's default, fewer units in flight, one row a warp, fewer warps, more units."""
TC_VARIANTS = ["8,4", "8,8", "8,2", "16,4"]
"""The tensor-core kernel's default, more or fewer chunks in flight, more warps."""
FUSED_VARIANTS = ["off", "64,64,64,4,4,2", "64,128,64,4,4,3", "64,256,64,4,4,3", "128,256,64,8,4,3",
                  "64,32,64,4,4,2", "128,128,32,8,3,1", "128,128,64,8,3,3"]
"""The fused GEMM off (the paths that take each M otherwise), `fused.tile_for`'s tiles (fields,
then staged), the staged form's widest, fewer x rows, the columns form, a ring of three."""
SCHEMES = "q4s/block32:f16,q8s/block32:f16,mxfp4,nvfp4"
TUNE_FIELDS = {"decode": 3, "tc": 2}
"""Fields of each kernel's tuning variable; a variant's further fields set `MORE_ENVS`."""
MORE_ENVS = {"decode": ("QCORE_CUDA_DECODE_REGS", "QCORE_CUDA_DECODE_LANES"),
             "tc": ("QCORE_CUDA_LINEAR_TILES", "QCORE_CUDA_LINEAR_WIDE", "QCORE_CUDA_LINEAR_REGS")}
"""A variant's fields past the tuning: the decode kernel's register cap (k_decode.REGS, which sets
its blocks a SM and staging batch), its staging order (k_decode.LANES: 0 or 1); the tensor-core
kernel's tiles of w a warp (linear.TILES), the most rows of x of its wide form (linear.WIDE_M) and
its register cap (linear.REGS, which sets its blocks a SM)."""


def runs(args) -> list[dict]:
    """Every variant's run: kernel, variant, environment additions, output folder, command."""
    out = []
    for kernel, variants, m in (("decode", args.decode, args.decode_m), ("tc", args.tc, args.tc_m),
                                ("fused", args.fused, args.fused_m)):
        for v in variants:
            folder = os.path.join(args.out, f"{kernel}-{v.replace(',', '-')}")
            fields = v.split(",")
            n = TUNE_FIELDS.get(kernel, len(fields))
            more = MORE_ENVS.get(kernel, ())
            if len(fields) > n + len(more):
                raise SystemExit(f"--{kernel} {v}: at most {n + len(more)} fields (the tuning, then "
                                 f"{', '.join(more) or 'nothing'})")
            extra = {ENVS[kernel]: ",".join(fields[:n]), "NUMBA_ENABLE_CUDASIM": "0"}
            extra.update(zip(more, fields[n:]))
            if kernel == "tc":
                extra["QCORE_CUDA_LINEAR_DECODE_M"] = "0"
            if kernel == "fused":
                extra = ({"NUMBA_ENABLE_CUDASIM": "0", "QCORE_CUDA_LINEAR_FUSED_M": "0"} if v == "off" else
                         {**extra, "QCORE_CUDA_LINEAR_FUSED_M": "1", "QCORE_CUDA_LINEAR_FUSED_KINDS": "all"})
            cmd = [sys.executable, os.path.join(HERE, "matmul.py"), "--m", m, "--shapes", args.shapes, "--schemes",
                   args.schemes, "--peers", "torch_bf16", "--hide-launch", "--reps", str(args.reps), "--budget-s",
                   str(args.budget_s), "--out", folder] + (["--f16"] if args.f16 else [])
            out.append({"kernel": kernel, "variant": v, "env": extra, "out": folder, "cmd": cmd})
    return out


def ratios(matmul_json: dict, f16: bool = False) -> dict:
    """(scheme, shape, M) -> the plain `linear` call's speed-up over torch bf16 (with `f16`: the
    float16-x call's over torch fp16), of one run."""
    case, peer = ("linear_f16", "vs_torch_fp16") if f16 else ("linear", "vs_torch_bf16")
    return {(c["scheme"], c["shape"], c["m"]): c["ratios"][peer] for c in matmul_json.get("cells", [])
            if c.get("case") == case and c.get("ratios", {}).get(peer) is not None}


def tables(done: list[dict], f16: bool = False) -> str:
    """One table per kernel: a row per variant, a column per (scheme, shape, M) any run measured."""
    lines = []
    for kernel in ENVS:
        mine = [r for r in done if r["kernel"] == kernel]
        cols = sorted({k for r in mine for k in r["ratios"]}, key=lambda k: (k[0], k[1], k[2]))
        if not mine:
            continue
        wv = max(12, max(len(r["variant"]) for r in mine) + 2)
        lines.append(f"{kernel} ({ENVS[kernel]}): speed-up over torch " + ("fp16, float16 x" if f16 else "bf16"))
        lines.append("variant".ljust(wv) + "".join(f"{s} {sh} M={m}".rjust(max(14, len(f'{s} {sh} M={m}') + 2))
                                                  for s, sh, m in cols))
        for r in mine:
            cells = []
            for s, sh, m in cols:
                w = max(14, len(f"{s} {sh} M={m}") + 2)
                v = r["ratios"].get((s, sh, m))
                cells.append((f"{v:.2f}x" if v is not None else "-").rjust(w))
            lines.append(r["variant"].ljust(wv) + "".join(cells) + (f"  (rc {r['rc']})" if r["rc"] else ""))
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results", "linear_tune"), help="folder of the runs")
    ap.add_argument("--decode", nargs="*", help=f"{DECODE_ENV} values (none: skip; default {' '.join(DECODE_VARIANTS)} "
                                                "where no kernel is named)")
    ap.add_argument("--tc", nargs="*", help=f"{TC_ENV} values (none: skip; default {' '.join(TC_VARIANTS)} where no "
                                            "kernel is named)")
    ap.add_argument("--fused", nargs="*", help=f"{FUSED_ENV} values, or off (none, the default: skip; "
                                               f"e.g. {' '.join(FUSED_VARIANTS)})")
    ap.add_argument("--decode-m", default="1", help="M of the decode runs (default 1)")
    ap.add_argument("--tc-m", default="1,8,16", help="M of the tensor-core runs (default 1,8,16)")
    ap.add_argument("--fused-m", default="64,256,2048", help="M of the fused-GEMM runs (default 64,256,2048)")
    ap.add_argument("--shapes", default="8192x8192", help="NxK, comma-separated (default 8192x8192)")
    ap.add_argument("--schemes", default=SCHEMES, help=f"comma-separated (default {SCHEMES})")
    ap.add_argument("--reps", type=int, default=10, help="timed calls per case (default 10)")
    ap.add_argument("--budget-s", type=float, default=50.0, help="each run's --budget-s (default 50)")
    ap.add_argument("--timeout-s", type=float, default=90.0, help="each run's wall-time limit (default 90)")
    ap.add_argument("--f16", action="store_true", help="time float16 x against torch fp16 (matmul.py --f16)")
    ap.add_argument("--dry-run", action="store_true", help="print the runs and exit")
    args = ap.parse_args(argv)
    named = any(v is not None for v in (args.decode, args.tc, args.fused))
    args.decode = args.decode if args.decode is not None else ([] if named else DECODE_VARIANTS)
    args.tc = args.tc if args.tc is not None else ([] if named else TC_VARIANTS)
    args.fused = args.fused or []
    plan = runs(args)
    if args.dry_run:
        for r in plan:
            env = " ".join(f"{k}={v}" for k, v in r["env"].items())
            print(f"{env} {' '.join(r['cmd'])}")
        return 0
    os.makedirs(args.out, exist_ok=True)
    done = []
    for r in plan:
        t0 = time.perf_counter()
        try:
            rc = subprocess.run(r["cmd"], env={**os.environ, **r["env"]}, timeout=args.timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        path = os.path.join(r["out"], "matmul.json")
        got = {}
        if os.path.exists(path):
            with open(path) as f:
                got = ratios(json.load(f), args.f16)
        done.append({**r, "rc": rc, "wall_s": time.perf_counter() - t0, "ratios": got})
        print(f"{r['kernel']} {r['variant']}: rc {rc}, {len(got)} cells, {done[-1]['wall_s']:.0f} s", flush=True)
    print(tables(done, args.f16))
    res = [{k: v for k, v in r.items() if k != "ratios"} | {"ratios": [{"scheme": s, "shape": sh, "m": m, "ratio": v}
                                                                    for (s, sh, m), v in r["ratios"].items()]}
           for r in done]
    with open(os.path.join(args.out, "linear_tune.json"), "w") as f:
        json.dump({"runs": res}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
