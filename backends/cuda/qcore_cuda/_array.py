"""Results of the `cuda` backend and the arrays a call reads and writes.

`QArray` is numba's `DeviceNDArray` (slicing, `copy_to_host`, `__cuda_array_interface__`)
plus the DLPack protocol (`__dlpack__`, `__dlpack_device__`), so torch (`torch.from_dlpack`,
`torch.as_tensor`), CuPy (`cupy.asarray`, `cupy.from_dlpack`) and JAX (`jax.dlpack.from_dlpack`)
take it without a copy; `.torch()` is the documented way back to a torch tensor. A result's
memory comes from the pool (`_pool.reserve`) in its call's stream order, and `QArray.fast` builds
the array without numba's layout bookkeeping (made lazily when a slice or a view needs it).

`DevView` is what a call needs of an input or `out=` array (pointer, shape, dtype, C order),
read from torch's attributes or `__cuda_array_interface__` without making a numba array.
"""
from __future__ import annotations

import ctypes
import sys
import threading
from typing import Any

import numpy as np

from qcore.errors import InputError

from . import _pool

KDL_CUDA = 2
_DL_CODES = {"i": 0, "u": 1, "f": 2, "b": 1}  # DLPack type codes (bool as uint8 bytes)


# ----------------------------------------------------------------------------- DLPack
class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int), ("dtype", _DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]
_alive: dict[int, tuple] = {}  # managed tensor address -> (struct, shape array, owner): kept until deleted
_alive_lock = threading.Lock()


@_DELETER
def _dl_deleter(addr: int) -> None:  # the consumer is done: drop the owner reference
    with _alive_lock:
        _alive.pop(addr, None)


_CAPSULE_DTOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype, _get_pointer.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_char_p]
_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_is_valid.restype, _is_valid.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_char_p]
_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype, _new_capsule.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


@_CAPSULE_DTOR
def _capsule_dtor(capsule: int) -> None:  # an unconsumed capsule (not renamed used_dltensor): delete here
    if _is_valid(capsule, b"dltensor"):
        _dl_deleter(_get_pointer(capsule, b"dltensor"))


def dlpack_capsule(ptr: int, shape: tuple, dtype: np.dtype, device_id: int, owner: Any) -> Any:
    """A DLPack `dltensor` capsule of a C-contiguous device buffer; `owner` lives until the
    consumer calls the deleter (or the capsule is dropped unconsumed)."""
    dtype = np.dtype(dtype)
    if dtype.kind not in _DL_CODES:
        raise InputError(f"DLPack export takes integer and float arrays, got {dtype}")
    nd = len(shape)
    shp = (ctypes.c_int64 * max(nd, 1))(*shape)
    m = _DLManagedTensor()
    m.dl_tensor.data = ptr or None
    m.dl_tensor.device = _DLDevice(KDL_CUDA, device_id)
    m.dl_tensor.ndim = nd
    m.dl_tensor.dtype = _DLDataType(_DL_CODES[dtype.kind], dtype.itemsize * 8, 1)
    m.dl_tensor.shape = ctypes.cast(shp, ctypes.POINTER(ctypes.c_int64))
    m.dl_tensor.strides = None  # NULL: C order (DLPack < 1.2 consumers read it so)
    m.dl_tensor.byte_offset = 0
    m.manager_ctx = None
    m.deleter = _dl_deleter
    addr = ctypes.addressof(m)
    with _alive_lock:
        _alive[addr] = (m, shp, owner)
    return _new_capsule(addr, b"dltensor", ctypes.cast(_capsule_dtor, ctypes.c_void_p))


def order_streams(producer: int, consumer: Any) -> None:
    """Make the consumer's stream wait for the producer's work (DLPack's `stream=` rule):
    an event recorded on the producer stream, waited on by the consumer's. None/-1: no wait;
    0 and 1 both name the legacy default stream."""
    if consumer is None or consumer == -1:
        return
    consumer = int(consumer)
    if (consumer in (0, 1) and producer == 0) or consumer == producer:
        return
    from cuda.bindings import driver as cu

    err, ev = cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
    if err == cu.CUresult.CUDA_SUCCESS:
        cu.cuEventRecord(ev, producer)
        cu.cuStreamWaitEvent(0 if consumer == 1 else consumer, ev, 0)
        cu.cuEventDestroy(ev)  # released once the wait has passed


# ----------------------------------------------------------------------------- QArray
_local = threading.local()


def context() -> Any:
    """numba's context on this thread (looked up once per thread)."""
    ctx = getattr(_local, "ctx", None)
    if ctx is None:
        from numba.cuda.cudadrv import devices

        ctx = _local.ctx = devices.get_context()
    return ctx


_QArray: Any = None


def qarray_class() -> Any:
    """`QArray`, made on first use (numba-cuda is imported lazily)."""
    global _QArray
    if _QArray is not None:
        return _QArray
    from numba.cuda.cudadrv.devicearray import DeviceNDArray, dummyarray

    class QArray(DeviceNDArray):
        """A numba device array with the DLPack protocol and a way to torch (see the module doc)."""

        @classmethod
        def fast(cls, shape: tuple, dtype: np.dtype, gpu_data: Any, producer: int = 0) -> "QArray":
            """A C-contiguous array over `gpu_data` (a non-empty allocation) written on the stream
            with handle `producer`. numba's own stream of the array stays the default one, so
            `copy_to_host()` waits for the data as for any numba array."""
            a = cls.__new__(cls)
            item = dtype.itemsize
            strides, acc = [], item
            for d in reversed(shape):
                strides.append(acc)
                acc *= d
            a.ndim, a.shape, a.strides, a.dtype = len(shape), shape, tuple(reversed(strides)), dtype
            a.size = acc // item
            a.alloc_size = acc
            a.gpu_data, a.stream, a._producer = gpu_data, 0, producer
            return a

        def __getattr__(self, name: str) -> Any:
            if name == "_dummy":  # numba's layout record, for views and slices: made when asked
                d = self.__dict__["_dummy"] = dummyarray.Array.from_desc(0, self.shape, self.strides,
                                                                          self.dtype.itemsize)
                return d
            raise AttributeError(name)

        def __dlpack__(self, *, stream: Any = None, max_version: Any = None, dl_device: Any = None,
                       copy: Any = None) -> Any:
            if copy:
                raise BufferError("QArray exports its own memory (copy=True is not offered)")
            if not self.is_c_contiguous():
                raise BufferError("DLPack export of a strided QArray view: take .copy_to_host() or a contiguous copy")
            order_streams(getattr(self, "_producer", 0), stream)
            ptr = self.__cuda_array_interface__["data"][0]
            return dlpack_capsule(ptr, self.shape, self.dtype, int(context().device.id), self)

        def __dlpack_device__(self) -> tuple[int, int]:
            return (KDL_CUDA, int(context().device.id))

        def torch(self) -> Any:
            """This array as a torch CUDA tensor over the same memory (no copy), in this thread's
            current torch stream's order."""
            import torch

            return torch.from_dlpack(self)

    _QArray = QArray
    return QArray


_SIM: list = []  # [numba's config.ENABLE_CUDASIM], read once: numba fixes it at import


def _simulated() -> bool:
    if not _SIM:
        from numba import config

        _SIM.append(bool(config.ENABLE_CUDASIM))
    return _SIM[0]


def empty_view(shape: tuple, dtype: np.dtype, stream: Any) -> tuple:
    """(result, DevView of it) for a non-empty result: `empty` without reading the new array's
    `__cuda_array_interface__` back. The view keeps the result alive (a caller may keep only
    the view)."""
    v = reserve(shape, dtype, stream)
    res = v.base = result(v, stream)
    return res, v


def reserve(shape: tuple, dtype: np.dtype, stream: Any) -> "DevView":
    """A DevView over new memory for a non-empty result of `shape` and `dtype` in `stream`'s order,
    to launch into before the result exists; `result()` then makes it. This puts the result's
    Python objects after the launch, while the kernels run."""
    if _simulated():
        return view_of(empty(shape, dtype, stream))  # its base is the result
    n = 1
    for d in shape:
        n *= d
    ptr, owner = _pool.reserve(n * dtype.itemsize, stream.handle, context())
    return DevView(ptr, shape, dtype, owner, None, n)


def result(v: "DevView", stream: Any) -> Any:
    """The QArray owning a `reserve()`d view's memory (which it frees when collected)."""
    if v._sim is not None:
        return v.base
    mem = v.base
    if mem is None:
        mem = _pool.own(v.ptr, v.shape[0] * v.dtype.itemsize, stream.handle, context())
    return (_QArray or qarray_class()).fast(v.nd_shape, v.dtype, mem, stream.handle)


def empty(shape: tuple, dtype: Any, stream: Any) -> Any:
    """An uninitialised C-contiguous QArray from the pool, in `stream`'s (a StreamRef) order
    (under the simulator: numba's simulated array)."""
    dtype = np.dtype(dtype)
    if _simulated():
        from numba import cuda

        return cuda.device_array(tuple(shape), dtype=dtype)
    cls = qarray_class()
    n = 1
    for d in shape:
        n *= d
    if n == 0:  # numba's own constructor makes the NULL buffer of an empty array
        strides, acc = [], dtype.itemsize
        for d in reversed(shape):
            strides.append(acc)
            acc *= max(d, 1)
        return cls(tuple(shape), tuple(reversed(strides)), dtype)
    return result(reserve(tuple(shape), dtype, stream), stream)


# ----------------------------------------------------------------------------- inputs / outputs
class DevView:
    """A device array as a launch needs it: `__cuda_array_interface__` (1-D, C order), `dtype`,
    `shape` (flat), `ptr`, `nd_shape` and the object it came from (kept while the call runs).
    `arg` is what a launch takes: the view itself on a GPU, the flat simulator array under the
    simulator (whose arrays have no `__cuda_array_interface__`)."""

    __slots__ = ("dtype", "shape", "ptr", "base", "nd_shape", "_sim")

    def __init__(self, ptr: int, nd_shape: tuple, dtype: np.dtype, base: Any, sim: Any = None, n: int = -1):
        if n < 0:
            n = 1
            for d in nd_shape:
                n *= d
        self.ptr, self.dtype, self.shape, self.nd_shape, self.base = ptr, dtype, (n,), nd_shape, base
        self._sim = sim  # never the view itself: a reference cycle would keep `base` (a result) alive until gc

    @property
    def __cuda_array_interface__(self) -> dict:
        """Made when asked (numba's `as_cuda_array`, a dispatcher launch): a packed launch reads
        `ptr`, `dtype` and `shape` alone."""
        return {"data": (self.ptr, False), "shape": self.shape, "strides": None, "typestr": self.dtype.str,
                "version": 3}

    @property
    def arg(self) -> Any:
        return self if self._sim is None else self._sim

    @property
    def size(self) -> int:
        return self.shape[0]

    def numba(self) -> Any:
        """numba's device array of this view (flat)."""
        if self._sim is not None:
            return self._sim
        from numba import cuda

        return cuda.as_cuda_array(self)


_TORCH_DT: dict = {}


def _torch_view(x: Any) -> DevView | None:
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(x, torch.Tensor):
        return None
    if not x.is_cuda:
        return None
    dt = _TORCH_DT.get(x.dtype)
    if dt is None:
        try:
            dt = _TORCH_DT[x.dtype] = np.dtype(str(x.dtype).removeprefix("torch."))
        except TypeError:
            raise InputError(f"cuda device inputs of dtype {x.dtype} are not read; convert to float32 first") from None
    if not x.is_contiguous():
        raise InputError("the cuda backend reads C-contiguous device arrays; pass x.contiguous() / a copy")
    return DevView(x.data_ptr(), tuple(x.shape), dt, x)


_TORCH_F32: list = []  # [torch.Tensor, torch.float32] once torch is imported (on a GPU)


def torch_f32(x: Any) -> tuple | None:
    """(data pointer, shape, device index) of a C-contiguous float32 torch CUDA tensor (of the
    class itself, not a subclass), else None: what a repeat call (`_repeat`) needs of such an
    input or output, read without a DevView. The shape is torch's `Size`, a tuple."""
    t = _TORCH_F32
    if not t:
        torch = sys.modules.get("torch")
        if torch is None or _simulated():
            return None
        t.extend((torch.Tensor, torch.float32))
    if type(x) is not t[0] or x.dtype is not t[1] or not x.is_cuda or not x.is_contiguous():
        return None
    return x.data_ptr(), x.shape, x.get_device()


def view_of(x: Any) -> DevView | None:
    """A DevView of a C-contiguous device array (torch, CuPy, numba, anything with
    `__cuda_array_interface__`), None for host data; InputError for a strided device array."""
    v = _torch_view(x)
    if v is not None or type(x) is np.ndarray:
        return v
    cai = getattr(x, "__cuda_array_interface__", None)
    if cai is None:
        if _is_sim_array(x):
            if not x.is_c_contiguous():
                raise InputError("the cuda backend reads C-contiguous device arrays; pass x.contiguous() / a copy")
            return DevView(0, tuple(x.shape), np.dtype(x.dtype), x, sim=x.reshape(x.size))
        return None
    shape, dt = tuple(cai["shape"]), np.dtype(cai["typestr"])
    strides = cai.get("strides")
    if strides is not None:
        want, acc = [], dt.itemsize
        for d in reversed(shape):
            want.append(acc)
            acc *= d
        if any(s != w for s, w, d in zip(strides, reversed(want), shape) if d > 1):
            raise InputError("the cuda backend reads C-contiguous device arrays; pass x.contiguous() / a copy")
    return DevView(int(cai["data"][0] or 0), shape, dt, x)


def _is_sim_array(x: Any) -> bool:
    return _simulated() and hasattr(x, "copy_to_host") and hasattr(x, "dtype")


def prefix(a: Any, nbytes: int, dtype: Any) -> Any:
    """The first `nbytes` of a flat uint8 device array as `dtype` elements: a DevView of a
    DevView (no numba slicing), else numba's slice and view."""
    if type(a) is DevView:
        if not isinstance(dtype, np.dtype):
            dtype = np.dtype(dtype)
        n = nbytes // dtype.itemsize
        return DevView(a.ptr, (n,), dtype, a.base, None, n)
    return a[:nbytes].view(dtype)


def reinterpret(d: Any, dtype: Any) -> Any:
    """`d` (a flat device array or DevView on a GPU, a flat simulator array) as elements of
    `dtype`: the same bytes, no copy."""
    dtype = np.dtype(dtype)
    if type(d) is DevView and d._sim is not None:
        sim = d._sim.view(dtype)
        return DevView(0, tuple(sim.shape), dtype, d.base, sim=sim)
    if type(d) is DevView:
        return DevView(d.ptr, (d.size * d.dtype.itemsize // dtype.itemsize,), dtype, d.base)
    return d.view(dtype)


def check_out(out: Any, shape: tuple, dtypes: tuple, what: str) -> DevView:
    """`out=`: a C-contiguous device array of `shape` (or its element count) and one of `dtypes`."""
    v = view_of(out)
    if v is None:
        raise InputError(f"{what} out= must be a device array (torch, CuPy, numba), got {type(out).__name__}; "
                         "leave it out to get a new one")
    n = 1
    for d in shape:
        n *= d
    if v.nd_shape != tuple(shape) and v.size != n:
        raise InputError(f"{what} out= has shape {v.nd_shape}, the result has shape {tuple(shape)}; "
                         "pass an array of that shape (or of that many elements)")
    if v.dtype not in dtypes:
        raise InputError(f"{what} out= has dtype {v.dtype}; it takes {', '.join(str(d) for d in dtypes)}")
    return v
