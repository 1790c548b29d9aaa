"""Choose a backend at runtime: ask what is installed and what each one supports, prefer the fast
ones, fall back gracefully, and let users override with $QCORE_BACKEND.

    python examples/pick_backend.py [--prefer cuda,ndarray] [--scheme q8s --scheme nvfp4 ...]
"""
import argparse
import os

import numpy as np

import qcore
from qcore.backend import registry


def pick(scheme, prefer):
    """The first preferred backend that is installed, available and supports `scheme`; else auto."""
    for name in prefer:
        try:
            be = qcore.backend(name)  # BackendNotFoundError / BackendUnavailableError if not usable
        except (qcore.BackendNotFoundError, qcore.BackendUnavailableError) as e:
            print(f"  {name}: skipped ({type(e).__name__})")
            continue
        support = be.supports(scheme)  # a capability query: data, not an exception
        if support:
            return be
        print(f"  {name}: skipped, it does not support {scheme}: {support.reason}")
    auto = qcore.backend("auto")
    print(f"  falling back to auto -> '{auto.pick(scheme).name}'")
    return auto.pick(scheme)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefer", default="cuda,ndarray", help="comma-separated backend names, best first")
    ap.add_argument("--scheme", action="append", help="schemes to place (default: q8s, q4s/block32:f16, nf4)")
    ap.add_argument("--rows", type=int, default=64, help="rows of the (rows, 128) test tensor")
    args = ap.parse_args(argv)
    schemes = [qcore.scheme(s) for s in (args.scheme or ["q8s", "q4s/block32:f16", "nf4"])]
    prefer = [n for n in args.prefer.split(",") if n]

    print("installed backends (highest priority first):")
    for be in sorted(registry.registered().values(), key=lambda b: -b.priority):
        state = "available" if be.available() else "NOT available"
        print(f"  {be.name:<10} priority {be.priority:>3}  {state}: {be.describe()}")
    for name, err in registry.plugin_errors().items():
        print(f"  {name}: plugin failed to load: {err}")

    print("\ncapability query, per scheme:")
    for s in schemes:
        answers = {n: qcore.backend(n).supports(s) for n in registry.supporting_backends(s)}
        rejected = {n: b.supports(s) for n, b in registry.registered().items() if n not in answers}
        print(f"  {s}: supported by {', '.join(answers) or 'none'}"
              + "".join(f"; {n} says no: {r.reason}" for n, r in rejected.items()))

    x = np.random.default_rng(0).standard_normal((args.rows, 128)).astype(np.float32)
    print(f"\npreferring {prefer}, with graceful fallback:")
    for s in schemes:
        print(f" {s}:")
        be = pick(s, prefer)
        q = be.quantize(x, s)
        print(f"  -> quantized on '{q.backend.name}', {q.nbytes} bytes")

    print("\n'auto' picks the highest-priority available backend that supports each scheme:")
    auto = qcore.backend("auto")
    for s in schemes:
        print(f"  {s} -> {auto.pick(s).name}")

    print(f"\n$QCORE_BACKEND overrides the default (now {os.environ.get('QCORE_BACKEND')!r}):")
    old = os.environ.get("QCORE_BACKEND")
    try:
        os.environ["QCORE_BACKEND"] = "reference"
        q = qcore.quantize(x, schemes[0])  # no backend named -> $QCORE_BACKEND
        print(f"  QCORE_BACKEND=reference: qcore.quantize ran on '{q.backend.name}'")
        if q.backend.name != "reference":
            return 1
    finally:
        if old is None:
            os.environ.pop("QCORE_BACKEND", None)
        else:
            os.environ["QCORE_BACKEND"] = old
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
