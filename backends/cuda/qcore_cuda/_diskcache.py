"""numba's on-disk cache for the backend's kernels, so a new process does not compile them again.

Compiling a scheme's kernels takes about 3 s on the H200's host; numba's CUDA cache
(`cache=True`, the same store as `@cuda.jit(cache=True)`) saves each compiled kernel by
signature next to its source (`qcore_cuda/__pycache__`, or numba's user-wide cache directory
where that is read-only; `NUMBA_CACHE_DIR` moves it) and loads it in a later process. The keys
hold the kernel's bytecode, its closure (the value kind a factory built it for), the GPU's
compute capability and the numba-cuda version, so a kernel edited, built for another kind, or
compiled for another GPU is compiled again rather than loaded. numba hashes a factory kernel's
closure by pickling it, which for these closures (device functions over intrinsics) gives other
bytes in every process, so nothing would ever be found: here the closure's part of the key is
the factory and its arguments (`fast.dequant_kernel(3)`) plus the size and modification time of
every qcore_cuda source file and of `qcore/codecs.py`, whose numbers (`SCALE_ARRAYS`,
`F32_TINY`) the kernels compile in, so an edit anywhere in the package (intrin.py, say) or in
the core's trait table recompiles.

`enable()` turns the cache on for every kernel of kernels.py, fast.py, gemv.py and tc.py: the
module-level ones at once, the ones the factories build (`fast.quant_kernel`, ...) as they are
built. Not under the simulator (it runs Python, nothing to cache); `QCORE_CUDA_DISK_CACHE=0`
turns it off.
"""
from __future__ import annotations

import functools
import hashlib
import os
from types import ModuleType
from typing import Any, Callable

FACTORIES = {"fast": ("quant_kernel", "dequant_kernel"), "gemv": ("gemv_kernel",), "tc": ("tc_kernel",)}
_done: set[str] = set()


@functools.lru_cache(maxsize=1)
def _package_stamp() -> str:
    """Size and modification time of every source file of qcore_cuda and of qcore.codecs."""
    from qcore import codecs

    here = os.path.dirname(os.path.abspath(__file__))
    paths = [os.path.join(here, name) for name in sorted(os.listdir(here)) if name.endswith(".py")]
    parts = []
    for path in paths + [os.path.abspath(codecs.__file__)]:
        st = os.stat(path)
        parts.append(f"{os.path.basename(path)}:{st.st_size}:{st.st_mtime_ns}")
    return ";".join(parts)


def _enable_one(d: Any, token: str = "") -> Any:
    """Turn on caching for one kernel dispatcher (not device functions, not twice); `token`
    names what built it (a factory and its arguments), for the key's closure part."""
    from numba.cuda.dispatcher import CUDADispatcher

    if isinstance(d, CUDADispatcher) and not d.targetoptions.get("device") and \
            not getattr(d, "_qcore_disk_cache", False):
        d.enable_caching()
        cache = d._cache
        base = type(cache)._index_key
        closure = hashlib.sha256(f"{token}|{_package_stamp()}".encode()).hexdigest()

        def index_key(sig: Any, codegen: Any) -> tuple:
            key = base(cache, sig, codegen)  # (sig, magic, version, (code hash, closure hash)) [+ launch config]
            return key[:3] + ((key[3][0], closure),) + key[4:]

        cache._index_key = index_key
        d._qcore_disk_cache = True
    return d


def _caching(factory: Callable) -> Callable:
    @functools.wraps(factory)
    def build(*args: Any) -> Any:
        return _enable_one(factory(*args), f"{factory.__module__}.{factory.__qualname__}{args!r}")
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
        for k, v in list(vars(mod).items()):
            _enable_one(v, f"{mod.__name__}.{k}")
        for fname in FACTORIES.get(name, ()):
            f = getattr(mod, fname, None)
            if f is not None and not getattr(f, "_qcore_disk_cache", False):
                setattr(mod, fname, _caching(f))
        _done.add(name)
