"""qcore-ndarray: the `ndarray` backend plugin of qcore (docs/spec.md, backends).

Q8F and Q8S quantization of numpy arrays with numba CPU kernels, bit-identical to qcore's
`reference` backend. qcore finds it through the `qcore` entry point group, exactly as it would
find any outside plugin::

    [project.entry-points.qcore]
    ndarray = "qcore_ndarray"
"""
from __future__ import annotations

import qcore

__all__ = ["qcore_register_backends"]
__version__ = "0.1.0"


@qcore.hookimpl
def qcore_register_backends():
    """Register the `ndarray` backend (priority 20). Imports no numba: kernels load on first use."""
    from .backend import NdarrayBackend

    return [NdarrayBackend()]
