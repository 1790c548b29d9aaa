"""`CudaData`: how the cuda backend holds a quantized tensor."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from qcore.spec.scheme import QuantScheme

__all__ = ["CudaData"]


@dataclass(frozen=True)
class CudaData:
    """A quantized tensor on the device: its portable payload as one uint8 device array, and
    what the backend derives from it once (decoded scales, packed launches, repeat calls)."""

    shape: tuple[int, ...]
    scheme: QuantScheme
    payload: Any  # numba device array, uint8, the SPEC §3 bytes
    cache: dict = field(default_factory=dict, compare=False, repr=False)

    # SPEC v1.1 §3 wants a payload's invalid codes found no later than its first dequantize. The
    # payload of memory the backend allocated changes only through the quantize kernels, which
    # never write an invalid code, so one clean check holds for the tensor's life and later
    # dequantizes read no flag (and wait for nothing). Memory the caller passed (quantize's out=
    # array) can change under the tensor: it is checked at every dequantize.
    def codes_checked(self) -> bool:
        """Whether a dequantize has found every code of this payload a value (and the payload
        is the backend's own memory)."""
        return self.cache.get("codes checked", False)

    def note_codes_checked(self) -> None:
        """A dequantize found no invalid code: remember it, unless the memory is the caller's."""
        if not self.cache.get("caller memory", False):
            self.cache["codes checked"] = True

    def mark_caller_memory(self) -> None:
        """The payload is memory the caller passed and may write: check its codes every time."""
        self.cache["caller memory"] = True
        self.cache.pop("codes checked", None)
