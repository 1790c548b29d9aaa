"""`CudaState`: what one cuda backend keeps between calls, which its paths read and write."""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from ._prepared import Plans
from ._scratch import Scratch

if TYPE_CHECKING:
    from ._repeat import QuantizeRepeat

__all__ = ["FastVerdict", "CudaState"]


class FastVerdict(NamedTuple):
    """Whether the fast kernels (fast.py, gemv.py, tc.py, ...) run here, and why
    (`backend.fast_verdict`)."""

    usable: bool
    why: str


class CudaState:
    """A backend's state between calls: `fast`, the fast-kernel verdict (read once); `scratch`,
    its device scratch and flags; `plans`, its prepared plans; `repeats`, its quantize calls'
    decisions (`_repeat.QuantizeRepeat`, or None for a key the fast kernels alone do not serve)
    by (scheme as given, method, shape)."""

    def __init__(self, fast: FastVerdict) -> None:
        self.fast = fast
        self.scratch = Scratch()
        self.plans = Plans(fast.usable)
        self.repeats: dict[tuple, QuantizeRepeat | None] = {}
