"""Keep numba's performance warnings about the backend's own launches from its users.

numba warns "Grid size N will likely result in GPU under-utilization" for grids under 128
blocks, and about host arrays passed to kernels. The backend launches small grids on purpose
(a one-block statistics reset, the per-tensor scale of nvfp4); the warning says nothing a user
can act on. `quiet` (a context manager) turns numba's two switches off while a backend call runs
and puts back what the user had; nested and concurrent calls share one count, so the first to
enter saves and the last to leave restores. A user kernel launched by another thread during a
backend call may miss such a warning; nothing else changes.
"""
from __future__ import annotations

import threading
from typing import Any

from ._compat import numba_cuda

_SWITCHES = ("CUDA_LOW_OCCUPANCY_WARNINGS", "CUDA_WARN_ON_IMPLICIT_COPY")


class _Quiet:
    """The context manager (one instance, `quiet`): cheap enough for every call (~1 us)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._saved: tuple = ()
        self._config: Any = None

    def __call__(self) -> "_Quiet":
        return self

    def __enter__(self) -> None:
        cfg = self._config
        if cfg is None:
            numba_cuda()  # numba.cuda's first import, quiet under numpy 2.5 (_compat)
            from numba.cuda import config

            cfg = self._config = config
        with self._lock:
            if self._depth == 0:
                self._saved = tuple(getattr(cfg, k, 0) for k in _SWITCHES)
                for k in _SWITCHES:
                    setattr(cfg, k, 0)
            self._depth += 1

    def __exit__(self, *exc: Any) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                for k, v in zip(_SWITCHES, self._saved):
                    setattr(self._config, k, v)


quiet = _Quiet()
