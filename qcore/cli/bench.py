"""`qcore bench`: a quick quantize + dequantize throughput per backend and scheme."""
from __future__ import annotations

import argparse
import math
import time
from typing import Any

import numpy as np

from qcore.spec.schemes import scheme as parse_scheme
from qcore.cli.args import EXIT_OK, UsageError
from qcore.cli.console import console

__all__ = ["BENCH_SCHEMES", "add_parser", "cmd_bench"]

BENCH_SCHEMES = ("q8s", "q4s/block32:f16", "nvfp4")


def add_parser(sub: Any) -> None:
    s = sub.add_parser("bench", help="quick quantize+dequantize throughput per backend")
    s.add_argument("--backend", action="append", help="backend to measure (repeatable; default: all)")
    s.add_argument("--scheme", action="append", help=f"scheme (repeatable; default: {', '.join(BENCH_SCHEMES)})")
    s.add_argument("--size-mb", type=float, default=4.0, help="input size in MB of float32 (default 4)")
    s.add_argument("--repeat", type=int, default=3, help="timed runs per cell, best is shown (default 3)")
    s.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    from rich.table import Table

    from qcore.backend import registry as reg

    labels = list(args.scheme or BENCH_SCHEMES)
    schemes = [parse_scheme(s) for s in labels]
    if args.size_mb <= 0 or args.repeat < 1:
        raise UsageError("--size-mb must be > 0 and --repeat >= 1")
    found = reg.registered()
    names = args.backend or sorted(found, key=lambda n: (-int(found[n].priority), n))
    for n in names:
        if n not in found:
            reg.backend(n)  # raises BackendNotFoundError with the installed list
    n_el = max(256, int(args.size_mb * 1e6 / 4) // 256 * 256)
    x = np.random.default_rng(0).standard_normal((n_el // 256, 256)).astype(np.float32)
    out = console()
    out.print(f"[bold]quantize + dequantize throughput[/], GB/s of float32 input ({x.nbytes / 1e6:.2f} MB, "
              f"host to host, best of {args.repeat})")
    table = Table()
    table.add_column("backend")
    for label in labels:
        table.add_column(label, justify="right")
    notes = []
    for n in names:
        be = found[n]
        if not reg.is_available(be):
            table.add_row(n, *["unavailable"] * len(schemes))
            continue
        cells = []
        for s in schemes:
            sup = be.supports(s)
            if not sup:
                cells.append("-")
                notes.append(f"{n} / {s}: {sup.reason}")
                continue
            be.to_numpy(be.dequantize(be.quantize(x, s)))  # warm-up (JIT compilation, caches)
            best = math.inf
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                be.to_numpy(be.dequantize(be.quantize(x, s)))
                best = min(best, time.perf_counter() - t0)
            cells.append(f"{x.nbytes / best / 1e9:.3f}")
        table.add_row(n, *cells)
    out.print(table)
    for line in notes:
        out.print(f"  - {line}", markup=False)
    return EXIT_OK
