"""Kernel launches whose argument list is packed once (`Packed`).

numba's dispatcher types and packs every argument again on every launch, which for a GEMV of
11 arguments costs several times the kernel's own time in host time. A backend call that
launches the same kernel on the same buffers again (a cached GEMV state, a dequantize into a
fresh output) only changes a few device pointers and integers.
`Packed` launches through numba's dispatcher the first time (which compiles the kernel), then
keeps the kernel's packed argument list (numba's own `_Kernel._prepare_args`) and later only
swaps the pointers of the arrays and the values of the integers that change. The packed list is
also held as one C `void*[]` of ctypes values (`_RawLaunch`), so a launch is one `cuLaunchKernel`
through cuda-bindings (a few us of host time) with the argument array's address; where the driver
refuses that, `cuda.core.launch` takes the list as numba does.

numba-cuda has no public API for this, so its internals are used in one place only (the
"numba-cuda internals" section below), and `numba_internals_problems()` lists what changed in
them; a test calls it, so an upgrade that moves them fails that test instead of going slow
silently. At run time anything unexpected (the simulator, another numba-cuda layout, a swapped
array of another shape or dtype) takes the dispatcher path, so a launch is never wrong, at worst
as slow as the dispatcher. `QCORE_CUDA_PACKED=0` turns packing off.

A `Packed` made with `cluster=(cx, cy, cz)` launches its packed form in thread-block clusters of
that shape (`cuLaunchKernelEx` with the cluster attribute; cuda.core's `LaunchConfig(cluster=)`
where the driver refuses that). numba's dispatcher has no clusters, so the first launch, and any
launch that falls back to the dispatcher, runs without them: a kernel packed this way must give
the same results with clusters of one block (`intrin.cluster_size()` tells it which).
"""
from __future__ import annotations

import ctypes
import os
import threading
from typing import Any, Sequence

import numpy as np

from . import _array, _streams
from ._quiet import quiet

COUNTS = {"raw": 0, "cuda.core": 0, "dispatcher": 0}  # launches by path (benchmarks/gpu.py reports them)
ARRAY_PTR = 4  # offset of the data pointer in numba's packed array: meminfo, parent, size, itemsize, data, ...


# ----------------------------------------------------------------------------- numba-cuda internals
# Everything below up to `Packed` is the only code that touches numba-cuda's private names.


def _numba_flatten_args(kernel: Any, args: Sequence[Any]) -> tuple[list, list[tuple[int, int]]]:
    """numba's flat kernel argument list for `args` (ctypes values and ints, as it launches
    them) and the span of each argument in it: `_Kernel._prepare_args`, stream 0."""
    kargs: list = []
    spans = []
    for t, v in zip(kernel.argument_types, args):
        start = len(kargs)
        kernel._prepare_args(t, v, 0, [], kargs)
        spans.append((start, len(kargs)))
    return kargs, spans


def _numba_cufunc(kernel: Any) -> Any:
    """The compiled kernel's driver function for `cuda.core.launch`."""
    return kernel._codelibrary.get_cufunc().kernel


def _numba_default_stream() -> Any:
    """numba's default stream as a `cuda.core` stream."""
    from numba.cuda.cudadrv import driver

    return driver._to_core_stream(0)


def numba_internals_problems() -> list[str]:
    """What no longer matches in the numba-cuda internals `Packed` relies on (empty: all there).
    Needs the real `numba.cuda` (not the simulator); no GPU."""
    import inspect

    problems = []
    try:
        from numba.cuda import dispatcher
        from numba.cuda.codegen import CUDACodeLibrary
        from numba.cuda.cudadrv import driver
    except Exception as e:  # noqa: BLE001
        return [f"numba.cuda internals not importable: {type(e).__name__}: {e}"]
    kernel_cls = getattr(dispatcher, "_Kernel", None)
    if kernel_cls is None:
        return ["numba.cuda.dispatcher._Kernel is gone"]
    prep = getattr(kernel_cls, "_prepare_args", None)
    if prep is None:
        problems.append("_Kernel._prepare_args is gone")
    else:
        params = list(inspect.signature(prep).parameters)
        if params != ["self", "ty", "val", "stream", "retr", "kernelargs"]:
            problems.append(f"_Kernel._prepare_args takes {params}")
        try:
            src = inspect.getsource(prep)
        except (OSError, TypeError):
            src = ""
        order = [src.find(f"kernelargs.append({w})") for w in ("meminfo", "parent", "devary.size")]
        order.append(src.find("kernelargs.append(devary.ptr)"))
        if min(order) < 0 or order != sorted(order) or "itemsize" not in src[order[2]:order[3]]:
            problems.append("_Kernel._prepare_args no longer packs an array as meminfo, parent, size, "
                            f"itemsize, data pointer (ARRAY_PTR = {ARRAY_PTR})")
    if "argument_types" not in dir(kernel_cls):
        problems.append("_Kernel.argument_types is gone")
    if "self._codelibrary" not in inspect.getsource(kernel_cls):
        problems.append("_Kernel._codelibrary is gone")
    if not hasattr(CUDACodeLibrary, "get_cufunc"):
        problems.append("CUDACodeLibrary.get_cufunc is gone")
    if not hasattr(driver, "_to_core_stream"):
        problems.append("numba.cuda.cudadrv.driver._to_core_stream is gone")
    return problems


def _enabled() -> bool:
    from numba import config

    return not config.ENABLE_CUDASIM and os.environ.get("QCORE_CUDA_PACKED", "1").strip() != "0"


def _ptr(a: Any) -> int:
    return int(a.__cuda_array_interface__["data"][0])


class Packed:
    """Launches of `dispatcher[griddim, blockdim](*args)` where only the arguments at positions
    `dynamic` change between calls: `packed(*values)` launches with those positions replaced
    (contiguous 1-D device arrays of the first call's dtype and length, or integers). Values for
    the first k dynamic positions may be given; the others keep the values they were packed with.
    No reference to a passed value outlives the call."""

    def __init__(self, dispatcher: Any, griddim: tuple, blockdim: tuple, args: Sequence[Any],
                 dynamic: Sequence[int], cluster: tuple | None = None):
        self._disp = dispatcher
        self._grid, self._block = griddim, blockdim
        self._cluster = cluster  # blocks per cluster of the packed launches (None: no clusters)
        self._args = list(args)
        self._dynamic = tuple(dynamic)
        self._state: Any = None  # None: not packed yet; False: dispatcher only; else the packed launch
        self._lock = threading.Lock()  # threads sharing a tensor: one swap-and-launch at a time
        self._raw: _RawLaunch | None = None  # the packed list as a C argument array, once packed
        self._raw_pos: tuple = ()  # where each dynamic value goes in it

    @property
    def packed(self) -> bool:
        """Whether launches after the first go through the packed argument list (else numba's
        dispatcher: not launched yet, the simulator, packing off or not possible)."""
        return isinstance(self._state, tuple)

    def held(self) -> list[Any]:
        """The values this launch keeps at its dynamic positions between calls: all None, so a
        caller's arrays are freed when the caller drops them."""
        return [self._args[i] for i in self._dynamic]

    def __call__(self, *values: Any, stream: Any = None) -> None:
        """Launch with `values` at the first dynamic positions, on `stream` (a `_streams.StreamRef`;
        None: the default stream)."""
        s = _streams.DEFAULT if stream is None else stream
        with self._lock:
            raw = self._raw
            if raw is not None and self._swap_views(raw, values) and raw(s.handle):  # the common case
                COUNTS["raw"] += 1
                return
            args = self._args
            passed = self._dynamic[: len(values)]
            for i, v in zip(passed, values):
                args[i] = v
            try:
                if self._state is None:
                    COUNTS["dispatcher"] += 1
                    with quiet():
                        self._disp[self._grid, self._block, s.numba](*args)  # compiles on first use
                    self._state = self._pack(args) if _enabled() else False
                    if self._state:
                        self._raw = _RawLaunch.build(self._state[3], self._grid, self._block, self._state[4],
                                                     self._cluster)
                        self._raw_pos = tuple(pos for _, _, pos, _ in self._swaps)
                elif self._state is False or not self._swap(values):
                    COUNTS["dispatcher"] += 1
                    with quiet():
                        self._disp[self._grid, self._block, s.numba](*args)
                elif self._raw is not None and self._raw(s.handle):
                    COUNTS["raw"] += 1
                else:
                    COUNTS["cuda.core"] += 1
                    launch, _, config, kernel, kargs = self._state
                    launch(s.core, config, kernel, *kargs)
            finally:
                for i in passed:  # hold no reference to the caller's arrays (a 1 GiB output, say)
                    args[i] = None

    @property
    def raw_packed(self) -> bool:
        """Whether `launch_values` can launch (the packed list is held as a C argument array)."""
        return self._raw is not None

    def launch_values(self, values: Sequence[int], handle: int) -> bool:
        """Launch with plain values at the first dynamic positions (an array's device pointer as
        an int, an int for an integer) on the stream with raw `handle`, without the checks
        `__call__` makes: for callers whose arrays have the packed dtype and length by
        construction (a repeat call, whose key fixes them). False, with nothing launched, where
        the list is not packed as a C array or the driver refuses it; the caller then takes
        `__call__` with views."""
        raw = self._raw
        if raw is None:
            return False
        with self._lock:
            vals = raw._values
            for pos, v in zip(self._raw_pos, values):
                vals[pos].value = v
            if not raw(handle):
                return False
        COUNTS["raw"] += 1
        return True

    # ------------------------------------------------------------------ packing
    def _pack(self, args: list) -> Any:
        """(launch, stream, config, kernel, kernelargs) and the positions to swap, or False."""
        try:
            from cuda.core import LaunchConfig, launch

            if any(isinstance(a, np.ndarray) for a in args):
                return False  # a host array is copied to a temporary device buffer on each launch
            d = self._disp
            argtypes = tuple(d.typeof_pyval(a) for a in args)
            kernel = d.overloads.get(argtypes)
            if kernel is None or getattr(kernel, "debug", False) or getattr(kernel, "cooperative", False):
                return False
            kargs, spans = _numba_flatten_args(kernel, args)
            swaps = []
            for i in self._dynamic:
                a, b = spans[i]
                v = args[i]
                if hasattr(v, "__cuda_array_interface__"):
                    if len(v.shape) != 1 or b - a < ARRAY_PTR + 1 or kargs[a + ARRAY_PTR] != _ptr(v):
                        return False  # not the layout this module knows
                    swaps.append((i, "array", a + ARRAY_PTR, (np.dtype(v.dtype), tuple(v.shape))))
                elif isinstance(v, (int, np.integer)) and b - a == 1 and isinstance(kargs[a], ctypes._SimpleCData):
                    swaps.append((i, "int", a, type(kargs[a])))
                else:
                    return False
            self._swaps = swaps
            grid, extra = self._grid, {}
            if self._cluster is not None:  # cuda.core counts the grid in clusters
                grid = tuple(g // c for g, c in zip(_dim3(grid), _dim3(self._cluster)))
                extra = {"cluster": _dim3(self._cluster)}
            try:
                config = LaunchConfig(grid=grid, block=self._block, shmem_size=0, is_cooperative=False, **extra)
            except TypeError:  # cuda.core < 1.0 spells it cooperative_launch
                config = LaunchConfig(grid=grid, block=self._block, shmem_size=0, cooperative_launch=False, **extra)
            return launch, _numba_default_stream(), config, _numba_cufunc(kernel), kargs
        except Exception:  # any other numba-cuda: the dispatcher path
            return False

    def _swap_views(self, raw: "_RawLaunch", values: Sequence[Any]) -> bool:
        """`_swap` for the backend's own values (DevViews of the packed dtype and length, ints),
        written into the C argument array only; False for anything else (`_swap` then looks at
        it, and writes both forms). The packed list itself is left behind, which only the
        cuda.core path reads, after `_swap`."""
        vals = raw._values
        for (_, kind, pos, what), v in zip(self._swaps, values):
            if kind == "array":
                if type(v) is not _array.DevView or (v.dtype is not what[0] and v.dtype != what[0]) or \
                        v.shape != what[1]:
                    return False
                vals[pos].value = v.ptr
            elif type(v) is int:
                vals[pos].value = v
            else:
                return False
        return True

    def _swap(self, values: Sequence[Any]) -> bool:
        """Write the new values into the packed list; False (dispatcher path) if one does not fit."""
        kargs = self._state[4]
        new = []
        for (i, kind, pos, what), v in zip(self._swaps, values):
            if kind == "array":
                if type(v) is _array.DevView:  # the backend's own views: C order by construction
                    if v.dtype != what[0] or v.shape != what[1]:
                        return False
                    new.append((pos, v.ptr))
                    continue
                cai = getattr(v, "__cuda_array_interface__", None)
                if cai is None or (np.dtype(v.dtype), tuple(v.shape)) != what or \
                        cai.get("strides") not in (None, (what[0].itemsize,)):
                    return False  # packed as a contiguous 1-D array of this dtype and length
                new.append((pos, int(cai["data"][0])))
            else:
                if not isinstance(v, (int, np.integer)):
                    return False
                new.append((pos, what(int(v))))
        raw = self._raw
        for pos, v in new:
            kargs[pos] = v
            if raw is not None:
                raw.set(pos, v)
        return True


class _RawLaunch:
    """One packed argument list as ctypes values and a `void*[]` of their addresses: a launch is
    `cuLaunchKernel(kernel, grid, block, 0, stream, params)`, and a swap writes a value in place.
    The kernel is numba's `CUkernel` (cuda.core's library kernel), which `cuLaunchKernel` takes
    for a `CUfunction` in the current context (CUDA 12+). With `cluster`, a launch is
    `cuLaunchKernelEx` with a launch configuration (the cluster attribute) made once."""

    def __init__(self, fn: int, grid: tuple, block: tuple, values: list, cluster: tuple | None = None):
        from cuda.bindings import driver as cu

        self._cu = cu
        self._launch = cu.cuLaunchKernel
        self._ok = cu.CUresult.CUDA_SUCCESS
        self._fn = fn
        self._dims = _dim3(grid) + _dim3(block)
        self._config = None if cluster is None else _cluster_config(cu, self._dims, cluster)
        self._values = values
        self._params = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.addressof(v) for v in values])
        self._addr = ctypes.addressof(self._params)

    @classmethod
    def build(cls, kernel: Any, grid: Any, block: Any, kargs: list,
              cluster: tuple | None = None) -> "_RawLaunch | None":
        """The C form of a packed list (numba's ints are 8-byte values, its ctypes values kept as
        their own type), or None where anything does not fit (the cuda.core path then)."""
        try:
            values = []
            for v in kargs:
                if isinstance(v, ctypes._SimpleCData):
                    values.append(type(v)(v.value))
                elif isinstance(v, (bool, np.bool_)):
                    values.append(ctypes.c_bool(bool(v)))
                elif isinstance(v, (int, np.integer)):
                    v = int(v)
                    values.append(ctypes.c_uint64(v) if v >= 2**63 else ctypes.c_int64(v))
                else:
                    return None
            return cls(int(kernel.handle), grid, block, values, cluster)
        except Exception:
            return None

    def set(self, pos: int, v: Any) -> None:
        """Write the swapped value at `pos` (an int pointer or a ctypes integer) in place."""
        self._values[pos].value = v.value if isinstance(v, ctypes._SimpleCData) else int(v)

    def __call__(self, stream: int) -> bool:
        """Launch on the stream handle; False if the driver refuses it (no current context on this
        thread, a driver without `CUkernel` launches): the caller then launches through cuda.core."""
        cfg = self._config
        if cfg is not None:
            if cfg is False:
                return False
            try:
                cfg.hStream = stream
                return self._cu.cuLaunchKernelEx(cfg, self._fn, self._addr, 0)[0] == self._ok
            except Exception:  # noqa: BLE001 - bindings that want these values otherwise: cuda.core's path from now on
                self._config = False
                return False
        gx, gy, gz, bx, by, bz = self._dims
        return self._launch(self._fn, gx, gy, gz, bx, by, bz, 0, stream, self._addr, 0)[0] == self._ok


def _dim3(d: Any) -> tuple:
    """A launch dimension (an int or a tuple of up to three) as three ints."""
    d = (d,) if isinstance(d, int) else tuple(d)
    return d + (1,) * (3 - len(d))


def _cluster_config(cu: Any, dims: tuple, cluster: tuple) -> Any:
    """A `CUlaunchConfig` for grid and block `dims` (six ints) in clusters of shape `cluster` (the
    stream is set at each launch; no dynamic shared memory)."""
    cfg = cu.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ, cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = dims
    cfg.sharedMemBytes = 0
    attr = cu.CUlaunchAttribute()
    attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = _dim3(cluster)
    cfg.attrs = [attr]
    cfg.numAttrs = 1
    return cfg
