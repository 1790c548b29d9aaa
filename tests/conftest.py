"""Shared test setup.

The cuda backend's tests run on Numba's CUDA simulator unless `NUMBA_ENABLE_CUDASIM` is set
already (`NUMBA_ENABLE_CUDASIM=0` on a GPU machine). numba reads the variable once, at
`import numba`, so this must run before anything imports numba (no numba class names in ini
warning filters: docs/numba-cuda.md).

Parallel workers (pytest-xdist) share one GPU: each keeps at most 1 GiB of freed device memory
cached (`QCORE_CUDA_POOL_KEEP`, unless set), not the default 1/8 of the device per process.

Under the simulator, Triton's kernels (the cuda backend's fused GEMM) run in Triton's interpreter
(`TRITON_INTERPRET=1`, unless set), which Triton reads when a kernel is defined.

`cuda_backend`: the installed, available `cuda` backend. It skips with the reason when the
backend or the simulator is missing, and FAILS instead when `QCORE_REQUIRE_CUDA=1` (CI).
"""
import os
import sys

import pytest

if "numba" not in sys.modules:
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("QCORE_CUDA_POOL_KEEP", "1G")
if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")  # (no GPU: Triton kernels run in its interpreter, on CPU tensors)
    # The simulator runs one OS thread per CUDA thread; its barriers busy-wait under the GIL, and
    # a shorter switch interval makes them 2-4x faster (docs/numba-cuda.md).
    sys.setswitchinterval(5e-4)


def pytest_report_header(config):
    mode = "simulator" if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0") else "real GPU"
    late = " (numba was imported before conftest: the variable had no effect)" if "numba" in sys.modules \
        and os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" and not _sim_active() else ""
    return f"qcore cuda tests: {mode}{late}; QCORE_REQUIRE_CUDA={os.environ.get('QCORE_REQUIRE_CUDA', '')!r}"


def _sim_active() -> bool:
    try:
        import numba

        return bool(numba.config.ENABLE_CUDASIM)
    except Exception:  # noqa: BLE001
        return False


@pytest.fixture(scope="session")
def cuda_backend():
    from qcore.conformance import installed_backend

    return installed_backend("cuda")


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="K/N",
                     help="run the K-th of N interleaved parts of the collected tests (K = 1..N): splits a "
                          "GPU run of the cuda tests over device calls with a time limit")
    parser.addoption("--shuffle", default=None, type=int, metavar="SEED",
                     help="run the collected tests in an order shuffled by SEED (the same in every xdist "
                          "worker): shows the tests do not depend on their order")


def pytest_collection_modifyitems(config, items):
    seed = config.getoption("--shuffle")
    if seed is not None:
        import random

        random.Random(seed).shuffle(items)
    spec = config.getoption("--shard")
    if not spec:
        return
    try:
        k, n = (int(v) for v in spec.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--shard wants K/N with 1 <= K <= N, got {spec!r}") from None
    if not 1 <= k <= n:
        raise pytest.UsageError(f"--shard wants K/N with 1 <= K <= N, got {spec!r}")
    keep = [it for i, it in enumerate(items) if i % n == k - 1]
    config.hook.pytest_deselected(items=[it for i, it in enumerate(items) if i % n != k - 1])
    items[:] = keep
