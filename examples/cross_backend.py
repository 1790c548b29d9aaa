"""Quantize on one backend, save, load on another: the bytes are identical everywhere.

Uses whatever is installed: `reference` always, `ndarray` and `cuda` when present. For every
scheme and every pair (writer, reader) of backends that support it, the tensor is quantized on
the writer, saved to a safetensors file, loaded on the reader, and compared byte for byte with the
writer's payload and with the reference backend's own quantization (the spec's bit-identity).

    python examples/cross_backend.py [--scheme q8s --scheme nvfp4 ...] [--rows 64]
"""
import argparse
import os
import tempfile

import numpy as np

import qcore
from qcore.backend import registry

SCHEMES = ["q8s", "q8f/block32:f16", "q4s/block32:bf16", "nvfp4", "mxfp8", "nf4"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scheme", action="append", help=f"schemes to try (default: {', '.join(SCHEMES)})")
    ap.add_argument("--rows", type=int, default=64)
    args = ap.parse_args(argv)

    names = [n for n, be in registry.registered().items() if be.available()]
    print(f"available backends: {', '.join(names)}")
    # Odd column count: the last block and the last packed word are partial.
    x = np.random.default_rng(0).standard_normal((args.rows, 200)).astype(np.float32)
    mismatches = 0
    with tempfile.TemporaryDirectory() as tmp:
        for text in args.scheme or SCHEMES:
            s = qcore.scheme(text)
            want = qcore.quantize(x, s, backend="reference").to_data()
            able = [n for n in names if qcore.backend(n).supports(s)]
            print(f"\n{s}  ({want.nbytes} bytes; backends: {', '.join(able)})")
            for writer in able:
                q = qcore.quantize(x, s, backend=writer)
                path = os.path.join(tmp, f"{writer}.safetensors")
                qcore.save(path, {"w": q})
                same_as_ref = q.to_data() == want
                for reader in able:
                    back = qcore.load(path, backend=reader)["w"]
                    ok = back.to_data() == want and same_as_ref
                    deq = np.array_equal(back.numpy(), q.numpy())
                    mismatches += (not ok) + (not deq)
                    print(f"  written on {writer:<9} read on {reader:<9} bytes identical: {ok}; "
                          f"dequantized identical: {deq}")
    print(f"\n{'all identical' if not mismatches else f'{mismatches} MISMATCHES'}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    raise SystemExit(main())
