"""qcore in one page: quantize a tensor, look inside, dequantize, measure the error, save and load.

    python examples/quickstart.py [--scheme q4s/block32:f16] [--rows 256]
"""
import argparse
import os
import tempfile

import numpy as np

import qcore


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scheme", default="q4s/block32:f16", help="scheme text (see docs/format.md)")
    ap.add_argument("--rows", type=int, default=256)
    args = ap.parse_args(argv)

    # 1. Some float32 weights, and a scheme: 4-bit symmetric ints, one F16 scale per block of 32.
    x = np.random.default_rng(0).standard_normal((args.rows, 384)).astype(np.float32)
    scheme = qcore.scheme(args.scheme)
    print(f"scheme {scheme}; backends installed: {', '.join(qcore.backends())}")

    # 2. Quantize. No backend named: $QCORE_BACKEND, else 'auto' (best available one for the scheme).
    q = qcore.quantize(x, scheme)
    print(f"quantized on '{q.backend.name}': {q}")

    # 3. Inspect the portable bytes (the same on every backend).
    d = q.to_data()
    print(f"payload {d.nbytes} bytes for {x.nbytes} bytes of float32 ({x.nbytes / d.nbytes:.2f}x smaller)")
    print(f"codes {d.codes().dtype} {d.codes().shape}, first row: {d.codes()[0, :8].tolist()} ...")
    print(f"scales {d.scales().dtype} {d.scales().shape}, first: {d.scales().reshape(-1)[:4].tolist()} ...")

    # 4. Dequantize and measure the error.
    y = q.numpy()
    err = y - x
    sqnr = 10 * np.log10(np.sum(x.astype(np.float64) ** 2) / np.sum(err.astype(np.float64) ** 2))
    print(f"dequantized {y.dtype} {y.shape}: SQNR {sqnr:.2f} dB, max |err| {np.max(np.abs(err)):.4f}")

    # 5. Save and load: a standard safetensors file; float tensors stay as they are.
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "weights.safetensors")
        qcore.save(path, {"w": q, "bias": np.zeros(384, np.float32)}, metadata={"source": "quickstart"})
        back = qcore.load(path)
        same = back["w"].to_data() == d
        print(f"saved {os.path.getsize(path)} bytes; loaded on '{back['w'].backend.name}', payload identical: {same}")
        if not same:
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
