"""qcore-cuda: the `cuda` backend of qcore (Numba-CUDA kernels; docs/spec.md, backends).

Registered through the `qcore` entry point group. Importing this package does not import numba:
the backend reports a missing GPU through `available()` / `describe()`.
"""
from __future__ import annotations

import qcore

from ._pool import cached_bytes as pool_bytes
from ._pool import trim as trim_pool
from .backend import CudaBackend, CudaData, cuda_status

__all__ = ["CudaBackend", "CudaData", "cuda_status", "pool_bytes", "qcore_register_backends", "trim_pool"]


@qcore.hookimpl
def qcore_register_backends():
    return [CudaBackend()]
