"""Scale round-up and scale words on the device (SPEC §1, §2.3, §3), for every cuda kernel.

The rule and its numbers live in `qcore.codecs` (`ScaleTraits`, one row per scale dtype); these
device functions index `qcore.codecs.SCALE_ARRAYS` by the scale dtype id (`SCALE_IDS` position)
and work on the f32 bits (`intrin.f2u` / `u2f`, which have simulator twins), so the fast, tile,
row and general kernels round and store scales with one piece of code.
"""
from __future__ import annotations

import math

from qcore.codecs import SCALE_ARRAYS, SCALE_IDS

from .intrin import f2u, u2f

from numba import cuda, float32, uint32  # noqa: E402

__all__ = ["SCALE_IDS", "round_up", "scale_word", "word_scale"]

# numba freezes module-level arrays into the kernels as constants.
_MAX = SCALE_ARRAYS.max_value
_LEAST = SCALE_ARRAYS.least
_SUB_BELOW = SCALE_ARRAYS.sub_below
_SUB_QUANTUM = SCALE_ARRAYS.sub_quantum
_ADD = SCALE_ARRAYS.round_add
_MASK = SCALE_ARRAYS.round_mask
_SHIFT = SCALE_ARRAYS.word_shift
_REBIAS = SCALE_ARRAYS.word_rebias


@cuda.jit(device=True, inline="always")
def round_up(s, sdt):
    """Round a raw scale `s >= 0` UP to scale dtype id `sdt`, never down (SPEC §2.3): the rule
    of `qcore.codecs.ScaleTraits.round_up` on the same numbers."""
    if s >= _MAX[sdt]:
        return float32(_MAX[sdt])
    if s <= _LEAST[sdt]:
        return float32(_LEAST[sdt])
    if s < _SUB_BELOW[sdt]:  # the uniform grid below the dtype's smallest normal (exact)
        q = _SUB_QUANTUM[sdt]
        return float32(float32(math.ceil(float32(s / q))) * q)
    return u2f((f2u(s) + _ADD[sdt]) & _MASK[sdt])


@cuda.jit(device=True, inline="always")
def scale_word(e, sdt):
    """The stored word (uint32) of a scale `e` already representable in dtype `sdt`."""
    if e < _SUB_BELOW[sdt]:
        return uint32(float32(e / _SUB_QUANTUM[sdt]))
    return uint32((f2u(e) >> _SHIFT[sdt]) - _REBIAS[sdt])


@cuda.jit(device=True, inline="always")
def word_scale(w, sdt):
    """float32 value of a stored scale word (inverse of `scale_word`; UE8M0's 0 is 2**-127)."""
    v = u2f((uint32(w) + _REBIAS[sdt]) << _SHIFT[sdt])
    if v < _SUB_BELOW[sdt]:
        v = float32(float32(w) * _SUB_QUANTUM[sdt])
    return max(v, float32(_LEAST[sdt]))
