"""The backend room: the contract (`protocol`: Support, QParams, QTensor, Backend), `BaseBackend`
(`base`), the reference backend, tensor ops and products, the error statistic, and the plugin
registry, which hands `protocol` its lookups when it is imported (below, so they are in place
whenever any module of the room is)."""
from qcore.backend import registry as _registry  # noqa: F401
