"""Keep numba's performance warnings about the backend's own launches from its users.

numba warns "Grid size N will likely result in GPU under-utilization" for grids under 128
blocks, and about host arrays passed to kernels. The backend launches small grids on purpose
(a one-block statistics reset, the per-tensor scale of nvfp4); the warning says nothing a user
can act on. `quiet()` turns numba's two switches off while a backend call runs and puts back what
the user had; nested and concurrent calls share one count, so the first to enter saves and the
last to leave restores. A user kernel launched by another thread during a backend call may
miss such a warning; nothing else changes.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

_lock = threading.Lock()
_depth = [0]
_saved: list = []
_SWITCHES = ("CUDA_LOW_OCCUPANCY_WARNINGS", "CUDA_WARN_ON_IMPLICIT_COPY")


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    from numba.cuda import config

    with _lock:
        if _depth[0] == 0:
            _saved[:] = [getattr(config, k, 0) for k in _SWITCHES]
            for k in _SWITCHES:
                setattr(config, k, 0)
        _depth[0] += 1
    try:
        yield
    finally:
        with _lock:
            _depth[0] -= 1
            if _depth[0] == 0:
                for k, v in zip(_SWITCHES, _saved):
                    setattr(config, k, v)
