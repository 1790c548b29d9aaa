"""numba's on-disk cache for the backend's kernels, so a new process does not compile them again.

Compiling a scheme's kernels takes about 3 s on the H200's host; numba's CUDA cache
(`cache=True`, the same store as `@cuda.jit(cache=True)`) saves each compiled kernel by
signature next to its source (`qcore_cuda/__pycache__`, or numba's user-wide cache directory
where that is read-only; `NUMBA_CACHE_DIR` moves it) and loads it in a later process. The keys
hold the kernel's bytecode, its closure (the value kind a factory built it for), the GPU's
compute capability and the numba-cuda version, so a kernel edited, built for another kind, or
compiled for another GPU is compiled again rather than loaded.

`enable()` turns the cache on for every kernel of kernels.py, fast.py, gemv.py and tc.py: the
module-level ones at once, the ones the factories build (`fast.quant_kernel`, ...) as they are
built. Not under the simulator (it runs Python, nothing to cache); `QCORE_CUDA_DISK_CACHE=0`
turns it off.
"""
from __future__ import annotations

import functools
import os
from types import ModuleType
from typing import Any, Callable

FACTORIES = {"fast": ("quant_kernel", "dequant_kernel"), "gemv": ("gemv_kernel",), "tc": ("tc_kernel",)}
_done: set[str] = set()


def _enable_one(d: Any) -> Any:
    """Turn on caching for one kernel dispatcher (not device functions, not twice)."""
    from numba.cuda.dispatcher import CUDADispatcher

    if isinstance(d, CUDADispatcher) and not d.targetoptions.get("device") and \
            not getattr(d, "_qcore_disk_cache", False):
        d.enable_caching()
        d._qcore_disk_cache = True
    return d


def _caching(factory: Callable) -> Callable:
    @functools.wraps(factory)
    def build(*args: Any) -> Any:
        return _enable_one(factory(*args))
    build._qcore_disk_cache = True  # type: ignore[attr-defined]
    return build


def enabled_by_env() -> bool:
    return os.environ.get("QCORE_CUDA_DISK_CACHE", "1").strip() != "0"


def enable(modules: dict[str, ModuleType]) -> None:
    """Cache the kernels of `modules` ({short name: module}) on disk; once per module."""
    from numba import config

    if config.ENABLE_CUDASIM or not enabled_by_env():
        return
    for name, mod in modules.items():
        if name in _done:
            continue
        for v in list(vars(mod).values()):
            _enable_one(v)
        for fname in FACTORIES.get(name, ()):
            f = getattr(mod, fname, None)
            if f is not None and not getattr(f, "_qcore_disk_cache", False):
                setattr(mod, fname, _caching(f))
        _done.add(name)
