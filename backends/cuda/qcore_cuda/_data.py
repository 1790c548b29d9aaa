"""`CudaData`: how the cuda backend holds a quantized tensor."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from qcore.scheme import QuantScheme

__all__ = ["CudaData"]


@dataclass(frozen=True)
class CudaData:
    """A quantized tensor on the device: its portable payload as one uint8 device array, and
    what the backend derives from it once (decoded scales, packed launches, repeat calls)."""

    shape: tuple[int, ...]
    scheme: QuantScheme
    payload: Any  # numba device array, uint8, the SPEC §3 bytes
    cache: dict = field(default_factory=dict, compare=False, repr=False)
