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
every qcore_cuda source file and of `qcore/spec/codecs.py`, whose numbers (`SCALE_ARRAYS`,
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
    """Size and modification time of every source file of qcore_cuda and of qcore.spec.codecs."""
    from qcore.spec import codecs

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
            # (sig, magic, version, (code hash, closure hash)) [+ launch config]
            key = base(cache, sig, _CompilersCodegen(codegen))
            return key[:3] + ((key[3][0], closure),) + key[4:]

        cache._index_key = index_key
        cache.load_overload = functools.partial(_load_without_refresh, cache)
        d._qcore_disk_cache = True
    return d


@functools.lru_cache(maxsize=1)
def _compilers() -> tuple | None:
    """The versions of the libraries that compile the kernels (NVVM, and nvJitLink where numba
    links with it), both loaded already by numba-cuda's availability check and `cuda.jit`; None
    where cuda-bindings cannot say."""
    try:
        from cuda.bindings import nvvm

        ours: tuple = ("nvvm", tuple(nvvm.version()), tuple(nvvm.ir_version()))
    except Exception:  # noqa: BLE001
        return None
    try:
        from numba.cuda.cudadrv.driver import _have_nvjitlink

        if _have_nvjitlink():
            from cuda.bindings import nvjitlink

            ours += ("nvjitlink", tuple(nvjitlink.version()))
    except Exception:  # noqa: BLE001
        pass
    return ours


class _CompilersCodegen:
    """numba's codegen as the cache key sees it, with the compilers' versions in its
    `magic_tuple` where numba puts NVRTC's version as the toolkit's: NVRTC compiles none of these
    kernels, and loading it only for the key costs every process 27 MiB of resident memory."""

    def __init__(self, codegen: Any):
        self._codegen = codegen

    def magic_tuple(self) -> tuple:
        ours = _compilers()
        if ours is None:
            return self._codegen.magic_tuple()
        from numba.cuda.cudadrv import devices

        return (ours, devices.get_context().device.compute_capability)


def _load_without_refresh(cache: Any, sig: Any, target_context: Any) -> Any:
    """numba's `Cache.load_overload` without its `target_context.refresh()`. The refresh loads
    every typing and lowering registry of numba-cuda (imports of about 0.5 s on the H200's host,
    scipy.linalg among them, and their memory) before the first kernel a process loads; a kernel
    rebuilt from the cache is launched without any of them, and a compilation refreshes the
    contexts itself when one is needed."""
    from numba.cuda.utils import numba_target_override

    with numba_target_override():
        with cache._guard_against_spurious_io_errors():
            return cache._load_overload(sig, target_context)
    return None  # the guard swallowed an I/O error: not found


def numba_internals_problems() -> list[str]:
    """What no longer matches in the numba-cuda cache internals used here (empty: all there)."""
    import inspect

    try:
        from numba.cuda.core.caching import Cache
        from numba.cuda.utils import numba_target_override  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return [f"numba.cuda's cache is not importable: {type(e).__name__}: {e}"]
    problems = [f"Cache.{name} is gone" for name in ("_index_key", "_load_overload",
                                                      "_guard_against_spurious_io_errors")
                if not hasattr(Cache, name)]
    try:
        key_src = inspect.getsource(Cache._index_key)
    except (OSError, TypeError):
        key_src = ""
    if "codegen.magic_tuple()" not in key_src:
        problems.append("Cache._index_key no longer takes the codegen's magic_tuple()")
    try:
        src = inspect.getsource(Cache.load_overload)
    except (OSError, TypeError):
        src = ""
    if "refresh()" not in src or "self._load_overload(sig, target_context)" not in src:
        problems.append("Cache.load_overload is no longer a refresh followed by _load_overload")
    return problems


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
