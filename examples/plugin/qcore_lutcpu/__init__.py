"""qcore-lutcpu: an example qcore plugin, a CPU backend for LOOKUP (table) schemes only.

    >>> import numpy as np, qcore
    >>> q = qcore.backend("lutcpu").quantize(np.linspace(-1, 1, 64, dtype=np.float32), "nf4")
"""
from .backend import LutCpuBackend

__all__ = ["LutCpuBackend"]
__version__ = "0.1.0"
