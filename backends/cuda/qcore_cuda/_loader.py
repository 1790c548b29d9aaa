"""`kernels()`: the kernels module, loaded once with the process settings its mode wants."""
from __future__ import annotations

import functools

from ._compat import numba_cuda

__all__ = ["kernels"]


@functools.lru_cache(maxsize=None)
def kernels():
    """The kernels module (`kernels.py`), first imported here: under the simulator with a
    shorter switch interval and the masked lanes' RuntimeWarnings off; on a GPU with the disk
    cache of compiled kernels and the memory pool installed."""
    numba_cuda()  # numba.cuda's first import, quiet under numpy 2.5 (_compat)
    from numba import config

    from . import kernels

    if config.ENABLE_CUDASIM:
        # The simulator runs one OS thread per CUDA thread and its barriers busy-wait under the
        # GIL; a shorter switch interval makes them 2-4x faster (docs/numba-cuda.md).
        # Only ever under the simulator, a testing mode.
        import sys
        import warnings

        sys.setswitchinterval(min(sys.getswitchinterval(), 5e-4))
        # The simulator evaluates masked-off lanes with NumPy scalars (0/0 of an empty group,
        # x / e overflowing to inf before the clamp), which NumPy reports as RuntimeWarnings;
        # a GPU computes the same values silently.
        warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"qcore_cuda\.")
    else:
        from . import _diskcache, _pool, fast, gemv, tc

        _diskcache.enable({"kernels": kernels, "fast": fast, "gemv": gemv, "tc": tc})
        _pool.install()
    return kernels
