"""Scale rounding and scale words on the device (docs/spec.md: schemes, scale storage,
portable bytes), for every cuda kernel.

The rules and their numbers live in `qcore.spec.codecs` (`ScaleSlot`: a scale dtype with its
rounding rule; one row of `SCALE_SLOTS` each); these device functions index
`qcore.spec.codecs.SCALE_ARRAYS` by slot id (a dtype's round-up slot is its `SCALE_IDS` position; the
other rules' rows repeat the dtype's numbers, so `scale_word` and `word_scale` read the same
for them) and work on the f32 bits (`intrin.f2u` / `u2f`, which have simulator twins), so the
fast, tile, row and general kernels round and store scales with one piece of code.
"""
from __future__ import annotations

from qcore.spec.codecs import SCALE_ARRAYS, SCALE_IDS, scale_round_kernel

from .intrin import f2u, u2f

from numba import cuda, float32, uint32  # noqa: E402

__all__ = ["SCALE_IDS", "round_scale", "scale_word", "word_scale"]

# numba freezes module-level arrays into the kernels as constants.
_LEAST = SCALE_ARRAYS.least
_SUB_BELOW = SCALE_ARRAYS.sub_below
_SUB_QUANTUM = SCALE_ARRAYS.sub_quantum
_SHIFT = SCALE_ARRAYS.word_shift
_REBIAS = SCALE_ARRAYS.word_rebias
_SIGN = SCALE_ARRAYS.word_sign


round_scale = scale_round_kernel(cuda.jit(device=True, inline="always"), f2u, u2f)
"""Round a raw scale `s >= 0` into scale slot `slot` (a `qcore.spec.codecs.SCALE_SLOTS` id: the
dtype and its rounding rule: scale storage): `qcore.spec.codecs`' one kernel source, compiled for
the device. A dtype's v1 (round-up) slot id is its `SCALE_IDS` position."""


@cuda.jit(device=True, inline="always")
def scale_word(e, sdt):
    """The stored word (uint32) of a scale `e` already representable in dtype `sdt`; a negative
    `e` (docs/spec.md, signed scales; -0 included) sets the word's sign bit."""
    b = f2u(e)
    a = u2f(b & uint32(0x7FFFFFFF))
    if a < _SUB_BELOW[sdt]:
        w = uint32(float32(a / _SUB_QUANTUM[sdt]))
    else:
        w = uint32((f2u(a) >> _SHIFT[sdt]) - _REBIAS[sdt])
    if b >> uint32(31):
        w |= _SIGN[sdt]
    return w


@cuda.jit(device=True, inline="always")
def word_scale(w, sdt):
    """float32 value of a stored scale word (inverse of `scale_word`; UE8M0's 0 is 2**-127); the
    word's sign bit (f32, f16, bf16) gives a negative scale."""
    w = uint32(w)
    sign = uint32(w & _SIGN[sdt])
    w = uint32(w ^ sign)
    v = u2f((w + _REBIAS[sdt]) << _SHIFT[sdt])
    if v < _SUB_BELOW[sdt]:
        v = float32(float32(w) * _SUB_QUANTUM[sdt])
    v = max(v, float32(_LEAST[sdt]))
    if sign != uint32(0):
        v = -v
    return v
