"""A caching device-memory pool: CUDA's stream-ordered allocator, as a numba memory manager.

`cudaMalloc` per call costs 57 us for 64 KB and 280 us for 256 MB on the H200 (numba's
`device_array`), more than a dequantize of a small tensor or a whole GEMV. CUDA's
stream-ordered allocator (`cuMemAllocFromPoolAsync`, CUDA 11.2+) keeps freed blocks in a
memory pool and hands them out again in stream order, with no synchronisation. It is part of the
driver and reached through cuda-bindings, which numba-cuda already requires, so it adds no
dependency; RMM and CuPy's pool would add one (RMM: a large native library; CuPy: a second
array library) to do the same job. The pool is qcore's own (`cuMemPoolCreate`), so the device's
default pool, which torch or CuPy may use through `cudaMallocAsync`, keeps its settings. Its
release threshold (`keep_bytes()`: `QCORE_CUDA_POOL_KEEP`, else 1/8 of the device) bounds what
it keeps cached across a synchronisation: the driver's default, 0, would hand every block back
at each sync (a cudaMalloc per call again), and "never" would keep the peak of every process for
good, starving torch in the same process or another process on the same GPU. Below the working
set of a loop the threshold costs a remap per call (H200, one 1 GiB result held and one made per
call: a dequantize call takes 870 us with a 2 GiB threshold, 430 us with 8 GiB).
Processes that share a GPU set `QCORE_CUDA_POOL_KEEP` lower (the test suite's workers take 1G). `trim()` returns unused blocks now.

Two users of the pool:

* `PoolMemoryManager`, a numba External Memory Manager (EMM) plugin: numba allocations
  (`cuda.device_array`, `to_device`, the backend's scratch) come from the pool, allocated and
  freed in the default stream's order, as with RMM's numba plugin. `install()` sets it only when
  numba still has its own default manager (no `NUMBA_CUDA_MEMORY_MANAGER`, no
  `cuda.set_memory_manager` by the user), and never under the simulator; `QCORE_CUDA_POOL=0`
  leaves numba's manager alone.
* `reserve(nbytes, stream)` and `own(...)`: the backend's results (dequantize, matmul), allocated
  and freed in the order of the call's stream. Without the pool (opted out, or another manager installed)
  it asks numba's current manager, so a user's manager (RMM, say) serves them. The last result
  block dropped in the default stream's order stays as the device's spare (`_release`), so a loop
  that makes and drops one result per call reuses it with no driver call (each of
  `cuMemAllocFromPoolAsync` and `cuMemFreeAsync` costs 1.5-5 us of host time on the H200).
"""
from __future__ import annotations

import os
import threading
from typing import Any

_lock = threading.Lock()  # install(): it makes numba's context, whose manager then asks pool_for()
_pool_lock = threading.Lock()
_pools: dict[int, Any] = {}  # device id -> CUmemoryPool
_keep: dict[int, int] = {}  # device id -> its pool's release threshold (`keep_bytes`)
_state = {"installed": False, "decided": False}
DEFAULT_KEEP_FRACTION = 8  # the release threshold's default: 1/8 of the device
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_bytes(text: str) -> int:
    """`"512M"`, `"2G"`, `"1048576"`, `"1.5GiB"` -> bytes (binary units)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1:] if t[-1:] in _UNITS and t[-1:] else ""
    try:
        value = float(t[: len(t) - len(unit)])
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        from qcore.errors import InputError

        raise InputError(f"QCORE_CUDA_POOL_KEEP={text!r}: expected a size such as 512M, 2G or 0")
    return int(value * _UNITS[unit])


def keep_from_env() -> int | None:
    """`QCORE_CUDA_POOL_KEEP` in bytes, None when unset; a malformed value raises InputError."""
    env = os.environ.get("QCORE_CUDA_POOL_KEEP", "").strip()
    return parse_bytes(env) if env else None


def keep_bytes(total: int) -> int:
    """The pool's release threshold on a device of `total` bytes: what it keeps cached across a
    synchronisation. `QCORE_CUDA_POOL_KEEP` (bytes, or with K/M/G) if set, else 1/8 of the device."""
    env = keep_from_env()
    return env if env is not None else total // DEFAULT_KEEP_FRACTION


def enabled_by_env() -> bool:
    """`QCORE_CUDA_POOL=0` turns the pool off (numba's manager, cudaMalloc per allocation)."""
    return os.environ.get("QCORE_CUDA_POOL", "1").strip() != "0"


def _check(res: Any) -> Any:
    """cuda-bindings returns (CUresult, value...): raise on an error, return the value(s)."""
    from cuda.bindings import driver as cu

    err, *vals = res if isinstance(res, tuple) else (res,)
    if err != cu.CUresult.CUDA_SUCCESS:
        from numba.cuda.cudadrv.driver import CudaAPIError

        raise CudaAPIError(err, f"memory pool call failed: {err.name}")
    return vals[0] if len(vals) == 1 else tuple(vals)


def pool_for(device_id: int) -> Any:
    """qcore's pool on a device, created on first use (release threshold: `keep_bytes`)."""
    pool = _pools.get(device_id)
    if pool is None:
        from cuda.bindings import driver as cu

        with _pool_lock:
            pool = _pools.get(device_id)
            if pool is None:
                props = cu.CUmemPoolProps()
                props.allocType = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
                props.handleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
                props.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                props.location.id = device_id
                pool = _check(cu.cuMemPoolCreate(props))
                dev = _check(cu.cuDeviceGet(device_id))
                keep = keep_bytes(int(_check(cu.cuDeviceTotalMem(dev))))
                _check(cu.cuMemPoolSetAttribute(pool, cu.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                                                cu.cuuint64_t(keep)))
                _keep[device_id] = keep
                _pools[device_id] = pool
    return pool


def _alloc_async(nbytes: int, pool: Any, stream: int) -> tuple:
    global _alloc_async
    from cuda.bindings import driver as cu

    _alloc_async = cu.cuMemAllocFromPoolAsync  # looked up once
    return _alloc_async(nbytes, pool, stream)


def _mem_free_async(ptr: int, stream: int) -> tuple:
    global _mem_free_async
    from cuda.bindings import driver as cu

    _mem_free_async = cu.cuMemFreeAsync  # looked up once
    return _mem_free_async(ptr, stream)


def _free_async(ptr: int, stream: int) -> None:
    """The finalizer of a pool block: back to the pool in `stream`'s order. At interpreter exit
    the context may be gone; the driver frees the pool with it, so errors are ignored."""
    try:
        _mem_free_async(ptr, stream)
    except Exception:
        pass


# The last result block dropped in the default stream's order, per device: (pointer, bytes).
# A loop that makes and drops a result of one size per call (the commonest use) then reuses it
# without a driver call either way: a later reserve of that size in the default stream's order
# takes it, since the default stream orders its new work after all the work on the block. One
# block, no larger than the pool's release threshold (it is cached memory like the pool's own),
# freed when another takes its place, by `trim()` and before an out-of-memory retry. Each
# device's slot is a list changed only by single appends and pops, which are atomic: blocks
# are dropped on any thread, and a finalizer must not take a lock that the thread it
# interrupts may hold. Every block that leaves a slot is either handed out or freed, once.
_spare: dict[int, list[tuple[int, int]]] = {}


def spare(device: int) -> tuple[int, int] | None:
    """The device's spare block (pointer, bytes), or None."""
    try:
        return _spare[device][-1]
    except (KeyError, IndexError):
        return None


def _release(ptr: int, nbytes: int, stream: int, device: int) -> None:
    """A result block its owner dropped: kept as the device's spare (default stream), else freed."""
    if stream != 0 or nbytes > _keep.get(device, 0):
        _free_async(ptr, stream)
        return
    slot = _spare.get(device)
    if slot is None:
        slot = _spare.setdefault(device, [])
    slot.append((ptr, nbytes))
    while len(slot) > 1:  # the older block goes back to the pool
        try:
            old = slot.pop(0)
        except IndexError:  # another thread emptied it meanwhile
            break
        _free_async(old[0], 0)


def _take_spare(nbytes: int, device: int) -> int:
    """The device's spare block if it has `nbytes`, taken out of the slot (0: none)."""
    slot = _spare.get(device)
    if not slot:
        return 0
    try:
        got = slot.pop()
    except IndexError:  # another thread took it
        return 0
    if got[1] == nbytes:
        return got[0]
    _release(got[0], got[1], 0, device)  # not this size: it stays the spare
    return 0


def drop_spares() -> None:
    """Free the spare blocks (`trim`, an out-of-memory retry)."""
    for slot in list(_spare.values()):
        while slot:
            try:
                got = slot.pop()
            except IndexError:
                break
            _free_async(got[0], 0)


def _alloc_raw(pool: Any, nbytes: int, stream: int) -> int:
    err, ptr = _alloc_async(nbytes, pool, stream)
    if not err:  # CUDA_SUCCESS
        return int(ptr)
    from cuda.bindings import driver as cu

    if err == cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY:  # cached blocks of other sizes: give them back, retry
        drop_spares()
        _check(cu.cuStreamSynchronize(stream))
        _check(cu.cuMemPoolTrimTo(pool, 0))
        err, ptr = cu.cuMemAllocFromPoolAsync(nbytes, pool, stream)
    if err != cu.CUresult.CUDA_SUCCESS:
        _check((err, None))
    return int(ptr)


def _base():
    from numba.cuda.cudadrv.driver import GetIpcHandleMixin, HostOnlyCUDAMemoryManager

    return GetIpcHandleMixin, HostOnlyCUDAMemoryManager


def _manager_class():
    """`PoolMemoryManager`, built on first use (numba-cuda is imported lazily)."""
    global PoolMemoryManager
    if PoolMemoryManager is not None:
        return PoolMemoryManager
    mixin, host_only = _base()
    from numba.cuda.cudadrv.driver import MemoryInfo

    class _PoolMemoryManager(mixin, host_only):
        """numba EMM plugin: device allocations from qcore's stream-ordered pool (default stream)."""

        def initialize(self) -> None:
            self._pool = pool_for(int(self.context.device.id))

        def memalloc(self, size: int):
            pool = getattr(self, "_pool", None) or pool_for(int(self.context.device.id))
            return _owned(self.context, _alloc_raw(pool, max(int(size), 1), 0), size, 0)

        def get_memory_info(self):
            from cuda.bindings import driver as cu

            free, total = _check(cu.cuMemGetInfo())
            return MemoryInfo(free=free, total=total)

        @property
        def interface_version(self) -> int:
            return 1

    PoolMemoryManager = _PoolMemoryManager
    return PoolMemoryManager


PoolMemoryManager: Any = None


_live: dict[int, Any] = {}  # pointer -> its AutoFreePointer while any view of it lives


def _owned(ctx: Any, ptr: int, size: int, stream: int) -> Any:
    """numba's ownership for a pool block, as its own manager does it: an AutoFreePointer kept
    here while views (`OwnedPointer`s: arrays, slices, reshapes) refer to it; the last one gone
    frees the block in `stream`'s order."""
    from cuda.bindings import driver as cu
    from numba.cuda.cudadrv.driver import AutoFreePointer

    def free() -> None:
        _live.pop(ptr, None)
        _free_async(ptr, stream)

    mem = AutoFreePointer(ctx, cu.CUdeviceptr(ptr), size, finalizer=free)
    _live[ptr] = mem
    return mem.own()


def _numba_manager_is_default() -> bool:
    from numba.cuda.cudadrv import driver

    if str(getattr(driver.config, "CUDA_MEMORY_MANAGER", "default")) != "default":
        return False
    cur = driver._memory_manager
    return cur is None or cur is driver.NumbaCUDAMemoryManager or cur is PoolMemoryManager


def install() -> bool:
    """Make the pool numba's memory manager where nobody chose another; once per process.
    A context numba has already made (the user used numba first) gets the pool too, if it still
    has numba's default manager; its earlier allocations keep their own finalizers. Returns
    whether the pool serves the backend."""
    if _state["decided"]:
        return _state["installed"]
    with _lock:
        if _state["decided"]:
            return _state["installed"]
        from numba import config

        ok = False
        if not config.ENABLE_CUDASIM and enabled_by_env():
            keep_from_env()  # a malformed setting is the user's to fix, not a reason to drop the pool
            try:
                from numba import cuda
                from numba.cuda.cudadrv import driver

                if _numba_manager_is_default():
                    cls = _manager_class()
                    cuda.set_memory_manager(cls)
                    ctx = cuda.current_context()
                    if type(ctx.memory_manager) is driver.NumbaCUDAMemoryManager:
                        old = ctx.memory_manager
                        mm = cls(context=ctx)
                        mm.initialize()
                        ctx.memory_manager = mm
                        old.deallocations.clear()  # numba's pending frees, now
                    ok = isinstance(ctx.memory_manager, cls)
            except Exception:  # a driver without memory pools: numba's manager stays
                ok = False
        _state["installed"], _state["decided"] = ok, True
        return ok


def active() -> bool:
    """Whether the backend allocates from the pool (`install()` succeeded)."""
    return _state["installed"]


_block_class: Any = None


def _block() -> Any:
    """`PoolBlock`: numba's MemoryPointer for one result's pool block, made without numba's
    bookkeeping (no finalizer registry, no reference counts): the block goes back to the pool in
    its stream's order when the object is collected. Views (slices, reshapes) are numba
    MemoryPointers that hold it as their owner, so it outlives them."""
    global _block_class
    if _block_class is None:
        from numba.cuda.cudadrv.driver import MemoryPointer

        class PoolBlock(MemoryPointer):
            __slots__ = ()

            @classmethod
            def make(cls, ctx: Any, ptr: int, size: int, stream: int, device: int) -> "PoolBlock":
                b = cls.__new__(cls)
                d = b.__dict__
                d["context"], d["device_pointer"], d["handle"] = ctx, ptr, ptr
                d["size"] = d["_cuda_memsize_"] = size
                d["is_managed"], d["refct"], d["_owner"], d["_stream"] = False, 1, None, stream
                d["_device"] = device
                return b

            def free(self) -> None:  # numba frees views' owners through refct, never reaching 0 here
                pass

            def __del__(self) -> None:
                try:
                    _release(self.device_pointer, self.size, self._stream, self._device)
                except Exception:  # noqa: BLE001 - at interpreter exit the module may be gone
                    pass

        _block_class = PoolBlock
    return _block_class


def reserve(nbytes: int, stream: int, ctx: Any) -> tuple[int, Any]:
    """(device pointer, owner) of `nbytes` for a result. From the pool the owner is None: the
    caller may launch into the memory first and make its owner after (`own`), which frees it.
    Without the pool, numba's current manager's MemoryPointer."""
    if not _state["installed"]:
        mem = ctx.memalloc(nbytes)
        return int(mem.device_pointer), mem
    dev = ctx.device.id
    if stream == 0 and _spare:
        ptr = _take_spare(nbytes or 1, dev)
        if ptr:
            return ptr, None
    pool = _pools.get(dev) or pool_for(int(dev))
    return _alloc_raw(pool, nbytes or 1, stream), None


def own(ptr: int, nbytes: int, stream: int, ctx: Any) -> Any:
    """The MemoryPointer owning a pool block from `reserve`: when the object is collected the
    block goes back to the pool in `stream`'s order (in the default stream's, it is kept as the
    device's spare block first, `_release`)."""
    return (_block_class or _block()).make(ctx, ptr, nbytes or 1, stream, ctx.device.id)


def trim(keep_bytes: int = 0) -> None:
    """Give the pool's unused blocks back to the driver, keeping at most `keep_bytes` cached
    (after the work that freed them has finished: synchronise first to free the most). The
    spare blocks go back first."""
    from cuda.bindings import driver as cu

    drop_spares()
    for pool in list(_pools.values()):
        _check(cu.cuMemPoolTrimTo(pool, int(keep_bytes)))


def cached_bytes() -> dict[int, tuple[int, int]]:
    """{device id: (bytes the pool holds from the driver, bytes in use)}."""
    from cuda.bindings import driver as cu

    out = {}
    for dev, pool in _pools.items():
        held = _check(cu.cuMemPoolGetAttribute(pool, cu.CUmemPool_attribute.CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT))
        used = _check(cu.cuMemPoolGetAttribute(pool, cu.CUmemPool_attribute.CU_MEMPOOL_ATTR_USED_MEM_CURRENT))
        out[dev] = (int(held), int(used))
    return out
