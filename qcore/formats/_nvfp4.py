"""NVFP4 bytes as the tools store them (compressed-tensors, torchao), shared by their formats:
E2M1 nibbles in blocks of 16 along the last axis, each block's scale a float8_e4m3fn byte,
which is qcore's UE4M3 scale byte when it is not negative or NaN."""
from __future__ import annotations

import ml_dtypes
import numpy as np

from qcore.formats.base import UnrepresentableError

__all__ = ["BLOCK", "FP8", "scale_words"]

BLOCK = 16
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


def scale_words(scale: np.ndarray, where: str) -> np.ndarray:
    """The bytes of float8_e4m3fn block scales as qcore's UE4M3 scale words; refused when one is
    negative (sign bit set) or NaN (0x7F), which an unsigned scale cannot be."""
    words = np.ascontiguousarray(scale).view(np.uint8)
    if np.any(words >= 0x7F):
        raise UnrepresentableError(f"{where}: a block scale is negative or NaN, which UE4M3 cannot hold")
    return words
