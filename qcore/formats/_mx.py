"""qcore `mxfp4` payloads as OCP MX blocks: the byte facts gpt-oss and GGUF share.

A qcore `mxfp4` tensor of shape `[..., N]` with `N % 32 == 0` stores its values as
`[..., N/32, 16]` bytes (element 2k in the low nibble of byte k: PackedNative(0) in the byte
layout) followed by `[..., N/32]` UE8M0 scale bytes (docs/spec.md, schemes): both are plain MX
blocks, so formats move bytes and never re-quantize. A last dim that is not a multiple of 32 makes
qcore's edge block partial, which no fixed-block format holds.
"""
from __future__ import annotations

import numpy as np

from qcore.spec.payload import QuantizedData
from qcore.backend.protocol import Support
from qcore.spec.schemes import PRESETS

__all__ = ["MXFP4", "BLOCK", "check", "split", "join", "zero_scale_blocks"]

MXFP4 = PRESETS["mxfp4"]
BLOCK = 32


def check(value: object, target: str) -> Support:
    """Whether `value` is an mxfp4 tensor whose blocks are whole (last dim a multiple of 32)."""
    if not isinstance(value, QuantizedData) or value.scheme.payload_form != MXFP4:
        got = value.scheme if isinstance(value, QuantizedData) else f"a {value.dtype} array"
        return Support.no(f"{target} holds mxfp4 blocks, got {got}")
    if value.shape[-1] % BLOCK:
        return Support.no(
            f"{target} needs whole blocks of {BLOCK}, got last dim {value.shape[-1]} "
            f"(shape {list(value.shape)}); qcore's partial edge block has no {target} form"
        )
    return Support.yes()


def split(d: QuantizedData) -> tuple[np.ndarray, np.ndarray]:
    """(blocks uint8 `[..., G, 16]`, scales uint8 `[..., G]`) of an mxfp4 tensor with whole blocks."""
    lead, groups = d.shape[:-1], d.shape[-1] // BLOCK
    raw = np.frombuffer(d.payload, np.uint8)
    nv = int(np.prod(lead, dtype=np.int64)) * groups * 16
    return raw[:nv].reshape(*lead, groups, 16), raw[nv:].reshape(*lead, groups)


def join(blocks: np.ndarray, scales: np.ndarray) -> QuantizedData:
    """The qcore mxfp4 tensor of blocks `[..., G, 16]` (low nibble first) and scales `[..., G]`."""
    shape = (*blocks.shape[:-2], blocks.shape[-2] * BLOCK)
    payload = np.ascontiguousarray(blocks, np.uint8).tobytes() + np.ascontiguousarray(scales, np.uint8).tobytes()
    return QuantizedData(shape, MXFP4, payload)


def zero_scale_blocks(blocks: np.ndarray, scales: np.ndarray) -> int:
    """Blocks whose scale byte is 0 and that hold a non-zero code.

    The spec's schemes decode UE8M0 byte 0 as 2^-127, so such a block decodes to `v * 2^-127` in
    qcore, while a reader that shifts the byte into a float's exponent field (triton_kernels' MX
    upcast) gets 0.0. A block of only zero codes (E2M1 codes 0 and 8, i.e. +-0) decodes the same
    either way.
    """
    nonzero = (np.asarray(blocks) & np.uint8(0x77)).any(axis=-1)
    return int(np.count_nonzero(nonzero & (np.asarray(scales) == 0)))
