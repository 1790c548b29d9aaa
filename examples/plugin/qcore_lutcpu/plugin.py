"""Registers the `lutcpu` backend with qcore (entry point group `qcore`)."""
import qcore


@qcore.hookimpl
def qcore_register_backends():
    from .backend import LutCpuBackend

    return [LutCpuBackend()]
