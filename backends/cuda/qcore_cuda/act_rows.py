"""x quantized per row to E4M3 by Triton for W8A8 `linear` (`k_act.act_rows_e4m3`): the codes and
scales as torch tensors, the operands `torch._scaled_mm` reads, with no payload around them.

The bytes are those of the backend's quantize of `x.float()` under `e4m3/block{B}:f32` (B >= K)
with `wait=False` (a row holding a non-finite x: codes 0 and a NaN scale). The GPU converts by
`cvt.rn.satfinite`; Triton's interpreter (the tests) codes on the bits (`k_act.e4m3_bits`)."""
from __future__ import annotations

import os
from functools import lru_cache
from typing import Any

from qcore.spec.parts import CodeRule, ScaleRound
from qcore.spec.schemes import QuantScheme

from .fused import KeptKernel, interpreted

__all__ = ["ENV", "MAX_K", "WARPS", "ActRows", "enabled", "takes", "for_row"]

ENV = "QCORE_CUDA_ACT_TRITON"
"""0 in the environment turns this path off (W8A8's x then goes through `quantize_bf16_rows`)."""

MAX_K = 8192
"""The longest row the kernel takes, read once and held in registers. Longer rows go to the
backend's own kernel, which was faster there (H100, 1024 rows of 28672: 49.2 against 58.4 us for
this kernel reading the row twice in chunks of 4096; docs/gpu.md, W8A8)."""


WARPS = 4
"""Warps of a program for rows of up to 4096 elements (8 for longer: H100, 1024 rows of 8192,
11.4 against 16.0 us on 4)."""


def enabled() -> bool:
    """Whether Triton is installed and the path is not switched off (`ENV`)."""
    if os.environ.get(ENV, "1") == "0":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def takes(scheme: QuantScheme, k: int) -> bool:
    """Whether the kernel writes `scheme`'s bytes for rows of k elements: at most `MAX_K`, the
    spec's plain calibration and code rule (round to nearest, the maximum over h), no signed or
    affine scales (the caller has checked e4m3 codes with one f32 scale a row)."""
    return (0 < k <= MAX_K and scheme.code_rule is CodeRule.DIV and scheme.scale_round in (ScaleRound.UP, ScaleRound.RNE)
            and not scheme.signed and scheme.offset is None and scheme.low_order is scheme)


class ActRows:
    """The launch for rows of K elements (at most `MAX_K`) under scale divisor h, decided once: the
    block (K up to a power of two), the warps. A call quantizes a bfloat16 torch tensor [m, K]
    (C-contiguous) on torch's current stream into (codes [m, K] `float8_e4m3fn`, scales [m] f32).
    Repeat calls launch the kernel Triton compiled at the first directly (`fused.KeptKernel`)."""

    def __init__(self, k: int, h: float) -> None:
        assert 0 < k <= MAX_K
        self.k, self.h = int(k), float(h)
        block = 1 << max(4, (self.k - 1).bit_length())
        self.const = dict(BLOCK=block, INTERPRETED=interpreted(), num_warps=WARPS if block <= 4096 else 8)
        self.kept = KeptKernel(self.const, 5)

    def __call__(self, x: Any) -> tuple[Any, Any]:
        import torch

        from . import k_act

        m = int(x.shape[0])
        assert x.dtype == torch.bfloat16 and tuple(x.shape) == (m, self.k) and x.is_contiguous()
        if x.is_cuda and x.device.index != torch.cuda.current_device():
            with torch.cuda.device(x.device):  # (Triton launches on the current device)
                return self(x)
        interp = self.const["INTERPRETED"]
        codes = torch.empty((m, self.k), dtype=torch.uint8 if interp else torch.float8_e4m3fn, device=x.device)
        scales = torch.empty((m,), dtype=torch.float32, device=x.device)
        self.kept.launch(k_act.act_rows_e4m3, (m,), (x, codes, scales, self.k, self.h), x.data_ptr() % 16 == 0)
        return (codes.view(torch.float8_e4m3fn) if interp else codes), scales


@lru_cache(maxsize=64)
def for_row(k: int, h: float, device: int) -> ActRows:
    """The launch for rows of k elements under scale divisor h on CUDA device `device` (its index;
    one launch per triple, kept: a compiled kernel belongs to one device)."""
    return ActRows(k, h)
