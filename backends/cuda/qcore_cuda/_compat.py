"""numba-cuda 0.30.4 under numpy >= 2.5: what the backend does so that it works there and says
nothing to its users (docs/gpu.md, "numpy 2.5").

* numpy 2.5 removed `np.row_stack`, which numba-cuda registers, so no kernel compiles without
  the alias set when this module is imported (NVIDIA/numba-cuda#907, closed as won't-fix).
* numba-cuda's `npdatetime_helpers` evaluates `np.timedelta64("nat")` when it is imported,
  which numpy 2.5 reports as a DeprecationWarning. `numba_cuda()` imports `numba.cuda` and that
  module with this one warning ignored: neither the warning nor, where a user turns warnings into
  errors (`python -W error`, pytest's `filterwarnings = error`), a failed import reaches users.
  Once the module is imported its line never runs again, so later imports and compiles are quiet.

Importing this module imports numpy alone; `numba_cuda()` imports numba.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import warnings
from types import ModuleType

import numpy as np

if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack

# numpy >= 2.5's text for `np.timedelta64("nat")` (a regular expression for warnings.filterwarnings).
GENERIC_TIMEDELTA_WARNING = r"The 'generic' unit for NumPy timedelta is deprecated"
# The numba-cuda module whose import evaluates it (absent under the simulator and in other versions).
_TIMEDELTA_MODULE = "numba.cuda.np.npdatetime_helpers"


@functools.lru_cache(maxsize=None)
def numba_cuda() -> ModuleType:
    """`numba.cuda` (the simulator under NUMBA_ENABLE_CUDASIM=1), imported the first time with
    numpy 2.5's timedelta DeprecationWarning from inside numba-cuda ignored; raises what the
    import raises (numba, numba-cuda or cuda-bindings missing), and a later call tries again."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=GENERIC_TIMEDELTA_WARNING, category=DeprecationWarning)
        from numba import cuda

        # Absent from the simulator's numba.cuda, and from a numba-cuda that moved it.
        with contextlib.suppress(ImportError):
            importlib.import_module(_TIMEDELTA_MODULE)
    return cuda
