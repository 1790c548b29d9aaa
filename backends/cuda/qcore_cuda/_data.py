"""`CudaData`: how the cuda backend holds a quantized tensor, and `TensorCache`: what it derives
from one once and keeps with it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from qcore.spec.schemes import QuantScheme

if TYPE_CHECKING:
    from qcore.backend.protocol import QTensor

    from ._launch import Packed
    from ._repeat import DequantizeRepeat, MatmulRepeat
    from .paths.linear_repeat import DequantizedRepeat, FusedRepeat, LinearRepeat
    from .paths.matmul import GeneralMatmulPlan

__all__ = ["CudaData", "TensorCache", "NOT_YET"]


class _NotYet:
    """A cached lookup not made yet (None is a lookup's answer: there is none)."""

    def __repr__(self) -> str:
        return "NOT_YET"


NOT_YET: Final = _NotYet()


@dataclass(eq=False)
class TensorCache:
    """What the backend derives from one tensor's payload, made once and kept with the tensor
    (`CudaData.cache`). The paths fill it; `CudaBackend.refresh_decoded` decodes the scales
    again into the same arrays after new bytes went into the payload (quantize `out=`)."""

    # ---- the payload
    codes_checked: bool = False
    """A dequantize found every code a value (`CudaData.codes_checked`; never for caller memory)."""
    caller_memory: bool = False
    """The payload is memory the caller passed (quantize's out= array): its codes are checked at
    every dequantize, and nothing is derived from them that a write would make stale."""
    code_flag: Any = None
    """The int32 flag the dequantize kernels set on a code outside the value's set (`_flags.new`)."""
    low: CudaData | None = None
    """Field orders: a copy of the payload with the values in the `low` order (`CudaBackend.kernel_data`)."""
    payload_view: Any = None
    """`_array.view_of(payload)`, for repeat quantize calls into this tensor (`_repeat`)."""
    # ---- decoded scales
    scales: tuple[Any, Any] | None = None
    """(float32 scales, gbuf: the global in gbuf[0]) decoded on the device (`CudaBackend.decoded_scales`)."""
    refresh: dict[tuple[bool, bool, bool], tuple[Packed, ...]] = field(default_factory=dict)
    """The packed launches that decode the scales again into the cached arrays, by which of
    `tc_scales`, `frag` and `linear_scales` they include (`CudaBackend.refresh_decoded`)."""
    # ---- dequantize
    dequant: Packed | None = None
    """The fast dequantize kernel's packed launch into float32 (only the output changes)."""
    dequant_bf16: Packed | None = None
    """The same into bfloat16 (its bits as u32 pairs)."""
    dequantize_repeat: DequantizeRepeat | None = None
    """What a repeat dequantize of this tensor launches (`_repeat.dequantize_again`)."""
    # ---- matmul: a weight [K, N]
    gemv_geometry: tuple | None | _NotYet = NOT_YET
    """(kind, Q) of the GEMV-family kernels (`gemv.geometry`), None where they do not take it."""
    gemv: dict[int, tuple[int, Packed]] = field(default_factory=dict)
    """The packed GEMV, tensor-core or fragment launch by rows of x m: (rows per launch, Packed)."""
    tc_scales: Any = None
    """The tensor-core kernels' scales by slot (`tc.slot_scales`)."""
    frag: Any = None
    """The fragment GEMV's copy of the codes and scales (`frag.pack`)."""
    general_matmul: dict[int, GeneralMatmulPlan] = field(default_factory=dict)
    """`kernels.k_matmul`'s geometry and arrays by rows of x m (`paths.matmul.GeneralMatmul`)."""
    matmul_repeats: dict[tuple[int, ...], MatmulRepeat | None] = field(default_factory=dict)
    """A repeat matmul's launch by x's shape (None: a product the packed launches do not serve)."""
    # ---- linear: a weight [N, K]
    linear_geometry: tuple | None | _NotYet = NOT_YET
    """(kind, P) of the tensor-core linear kernel (`linear.geometry`), None where it does not take it."""
    linear: dict[tuple, Packed] = field(default_factory=dict)
    """The tensor-core linear kernel's packed launch by (m, x type, result type, bias); the decode
    kernel's (k_decode.py) by ("decode", m, x type, result type, bias)."""
    linear_scales: Any = None
    """A two-level weight's effective scale per slot (`linear.k_effective`)."""
    fused_operands: tuple[Any, Any] | None = None
    """The fused GEMM's torch views of the code words (uint8) and the effective scales
    (`paths.linear.FusedGemmLinear`; not kept for caller memory)."""
    fused_f16: tuple[Any, float] | None | _NotYet = NOT_YET
    """The float16 fused GEMM's scales times 2**p and its 2**-p (docs/spec.md's float16-weight rule,
    p from the weight's largest magnitude: `fused.f16_shift`), None where p is out of range; not
    kept for caller memory, dropped when new bytes go into the payload (`forget_values`)."""
    fused_launches: dict[tuple[int, bool, bool], Any] = field(default_factory=dict)
    """The fused GEMM's launch (`fused.FusedLaunch`) by (rows of x, bias given, float16); not kept
    for caller memory."""
    linear_codes_checked: bool = False
    """A linear's first dequantize found every code a value (and the payload is not caller memory)."""
    transposed: QTensor | None = None
    """The weight's transpose [K, N], for the matmul paths (`paths.linear.TransposedLinear`)."""
    linear_repeats: dict[tuple, LinearRepeat | FusedRepeat | DequantizedRepeat] = field(default_factory=dict)
    """A repeat linear's launch by (x's torch dtype, x's shape, bias given) (`paths.linear_repeat.again`)."""

    def forget_values(self) -> None:
        """After new bytes went into the payload: drop what was derived from the weight's values
        themselves rather than decoded into arrays again (`CudaBackend.refresh_decoded`): the
        float16 fused GEMM's p, its launches, and the repeats of float16 x that may hold them."""
        if self.fused_f16 is not NOT_YET:
            self.fused_f16 = NOT_YET
            self.fused_launches = {k: v for k, v in self.fused_launches.items() if not k[2]}
        if self.linear_repeats:
            self.linear_repeats = {k: v for k, v in self.linear_repeats.items() if str(k[0]) != "torch.float16"}


@dataclass(frozen=True)
class CudaData:
    """A quantized tensor on the device: its portable payload as one uint8 device array, and
    what the backend derives from it once (`TensorCache`: decoded scales, packed launches,
    repeat calls)."""

    shape: tuple[int, ...]
    scheme: QuantScheme
    payload: Any  # numba device array, uint8, the portable bytes
    cache: TensorCache = field(default_factory=TensorCache, compare=False, repr=False)

    # The spec wants a payload's invalid codes found no later than its first dequantize. The payload
    # of memory the backend allocated changes only through the quantize kernels, which never write
    # an invalid code, so one clean check holds for the tensor's life and later dequantizes read no
    # flag (and wait for nothing). Memory the caller passed (quantize's out= array) can change under
    # the tensor: it is checked at every dequantize.
    def codes_checked(self) -> bool:
        """Whether a dequantize has found every code of this payload a value (and the payload
        is the backend's own memory)."""
        return self.cache.codes_checked

    def note_codes_checked(self) -> None:
        """A dequantize found no invalid code: remember it, unless the memory is the caller's."""
        if not self.cache.caller_memory:
            self.cache.codes_checked = True

    def mark_caller_memory(self) -> None:
        """The payload is memory the caller passed and may write: check its codes every time."""
        self.cache.caller_memory = True
        self.cache.codes_checked = False
