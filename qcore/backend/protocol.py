"""The `Backend` protocol and the values it trades in (docs/spec.md, backends and public API):
`Support`, `QParams`, `QTensor`.

`Backend` is the whole contract: every member a caller may use, the optional capabilities
(`device`, `simulated`, `out=`, `stream=`, `transpose`, `payload_parts`, `error_stats`, `adopt`)
included, so callers call them and never probe. `qcore.backend.base.BaseBackend` implements it
over a few hooks and gives each optional capability a default; a plugin that does not subclass it
implements every member (the registry refuses one that lacks any).

This module sits below the registry and never imports it: `qcore.backend.registry` hands over its
lookups (a backend by name, the backends that support a scheme) when it is imported
(`use_registry`), for `QTensor.to(name)` and `require_support`'s message.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import numpy as np

from qcore.errors import BackendNotFoundError, UnsupportedSchemeError
from qcore.spec.arithmetic import QParams
from qcore.spec.payload import QuantizedData, sections
from qcore.spec.schemes import QuantScheme, scheme as parse_scheme

__all__ = ["Support", "QParams", "QTensor", "Backend", "CALIBRATION_METHODS", "BACKEND_ATTRIBUTES",
           "BACKEND_METHODS", "BACKEND_MEMBERS", "require_support", "use_registry"]

CALIBRATION_METHODS = ("minmax", "absmean")


@dataclass(frozen=True)
class Support:
    """A capability answer: truthy when supported, else falsy with `.reason`."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok

    @classmethod
    def yes(cls) -> "Support":
        return cls(True)

    @classmethod
    def no(cls, reason: str) -> "Support":
        return cls(False, reason)

    def __repr__(self) -> str:
        return "Support(yes)" if self.ok else f"Support(no: {self.reason})"


# ---------------------------------------------------------------------- the registry's lookups
def _no_registry(name: str) -> "Backend":
    raise BackendNotFoundError(f"no backend registry is loaded to find '{name}'; import qcore first")


_by_name: Callable[[str], "Backend"] = _no_registry
_supporting: Callable[[QuantScheme], list[str]] = lambda scheme: []


def use_registry(by_name: Callable[[str], "Backend"], supporting: Callable[[QuantScheme], list[str]]) -> None:
    """Hand this module the registry's lookups: `by_name(name)` (what `QTensor.to(name)` moves to)
    and `supporting(scheme)` (the available backends that run a scheme, which `require_support`
    names). `qcore.backend.registry` calls it once, when it is imported."""
    global _by_name, _supporting
    _by_name, _supporting = by_name, supporting


def require_support(be: "Backend", scheme: QuantScheme | str) -> QuantScheme:
    """`scheme` parsed; UnsupportedSchemeError unless `be` supports it, naming the backends that
    do. The library and the CLI raise this one message."""
    scheme = parse_scheme(scheme)
    sup = be.supports(scheme)
    if not sup:
        others = [n for n in _supporting(scheme) if n != be.name]
        where = f"backends that do: {', '.join(others)}" if others else "no installed backend does"
        raise UnsupportedSchemeError(f"backend '{be.name}' does not support {scheme}: {sup.reason}; {where}")
    return scheme


# ---------------------------------------------------------------------- a quantized tensor
class QTensor:
    """A quantized tensor held by one backend; `data` is that backend's own representation."""

    __slots__ = ("backend", "scheme", "shape", "data")

    def __init__(self, backend: "Backend", scheme: QuantScheme, shape: Sequence[int], data: Any):
        self.backend = backend
        self.scheme = scheme
        self.shape = tuple(int(d) for d in shape)
        self.data = data

    @property
    def nbytes(self) -> int:
        """Size of the portable payload (docs/spec.md, portable bytes)."""
        return sections(self.shape, self.scheme).total

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dequantize(self, dtype: Any = np.float32) -> Any:
        """Decode (docs/spec.md, dequantize) to `dtype`: a numpy dtype gives the backend's array
        (numpy on a host backend, a device array on cuda), a torch dtype a torch tensor (on the CPU
        from a host backend, on the GPU from cuda: the backend's `device`)."""
        from qcore.backend.activations import as_torch, torch_dtype_as_numpy

        as_numpy = torch_dtype_as_numpy(dtype)
        if as_numpy is None:
            return self.backend.dequantize(self, dtype=dtype)
        y = self.backend.dequantize(self, dtype=as_numpy)
        t = as_torch(y)
        where = self.backend.device
        if isinstance(y, np.ndarray) and where != "cpu":  # (a dtype the device's arrays lack, bfloat16 on numba: on the host)
            t = t.to(where)
        return t

    def numpy(self, dtype: Any = np.float32) -> np.ndarray:
        """Dequantize and copy to a host numpy array."""
        return self.backend.to_numpy(self.dequantize(dtype))

    def to_data(self) -> QuantizedData:
        return self.backend.into_data(self)

    def to(self, backend: "str | Backend") -> "QTensor":
        """Move to another backend (a `Backend`, or its registered name) through the portable bytes."""
        if isinstance(backend, str):
            backend = _by_name(backend)
        return backend.from_data(self.to_data())

    @property
    def T(self) -> "QTensor":
        """The transpose (the axes reversed: `backend.transpose`, exact except for blocks over the
        flattened tensor, which it quantizes again)."""
        return self.backend.transpose(self)

    __array_ufunc__ = None  # numpy defers `x @ q` to `__rmatmul__`

    def __rmatmul__(self, x: Any) -> Any:
        """`x @ q`: `backend.matmul(x, q)` for a 2-D q [K, N] (f32 sums, float32 result)."""
        return self.backend.matmul(x, self)

    def __repr__(self) -> str:
        return f"QTensor(shape={self.shape}, scheme='{self.scheme}', backend='{self.backend.name}')"


# ---------------------------------------------------------------------- the contract
@runtime_checkable
class Backend(Protocol):
    """What every backend offers (docs/spec.md, backends and public API). `qcore.BaseBackend`
    implements all of it over a few hooks, with a default for each optional capability (the
    members from `device` on)."""

    name: str
    """Unique registered name (not 'auto')."""
    priority: int
    """Higher wins in `auto` selection (cuda 30, ndarray 20, reference 0)."""
    device: str
    """Where this backend keeps its tensors, as a torch device type: "cpu" for a host backend
    (the default), "cuda" for the cuda backend. `QTensor.dequantize(torch dtype)` returns a torch
    tensor there, and `qcore.nn` picks among the backends on a weight's device."""
    simulated: bool
    """Whether the device is a simulator (cuda under numba's CUDA simulator): correct but slower
    than any host backend, so `auto` tries it after every real one (default False)."""

    def available(self) -> bool:
        """Whether the backend can run here (device present, libraries loaded); never raises."""
        ...

    def describe(self) -> str:
        """One line: what it runs on, or why it is not available."""
        ...

    def supports(self, scheme: QuantScheme | str) -> Support:
        """Whether it runs `scheme`: a `Support`, falsy with a reason when not."""
        ...

    def calibrate(self, x: Any, scheme: QuantScheme | str, method: str = "minmax") -> QParams:
        """The stored scales of `x` under `scheme` (docs/spec.md: calibration to scale storage)."""
        ...

    def quantize(self, x: Any, scheme: QuantScheme | str, *, params: QParams | None = None,
                 method: str = "minmax", out: Any = None, stream: Any = None) -> QTensor:
        """Quantize `x` (docs/spec.md, arithmetic), calibrated or with explicit `params`. `out=`: a
        QTensor of this backend with the same shape and scheme, overwritten and returned (a device
        backend also takes its own payload memory); `stream=`: a device backend's stream to run on
        (a host backend runs on the calling thread and ignores it)."""
        ...

    def dequantize(self, q: QTensor, dtype: Any = None, *, out: Any = None, stream: Any = None) -> Any:
        """`decode(q) * e` in f32, cast to `dtype` (docs/spec.md, dequantize; None: out's dtype,
        else float32), as this backend's array, or written into `out=` (an array of this backend's
        kind with q's size and the result's dtype), which is returned. `stream=` as for
        `quantize`."""
        ...

    def from_data(self, data: QuantizedData) -> QTensor:
        """Load validated portable bytes (docs/spec.md, portable bytes) onto this backend."""
        ...

    def into_data(self, q: QTensor) -> QuantizedData:
        """The portable bytes of `q`."""
        ...

    def to_numpy(self, array: Any) -> np.ndarray:
        """One of this backend's arrays as a host numpy array."""
        ...

    def reshape(self, q: QTensor, shape: Sequence[int]) -> QTensor:
        """`q` in another shape (exact where the blocks allow, `qcore.backend.ops`)."""
        ...

    def permute(self, q: QTensor, axes: Sequence[int]) -> QTensor:
        """`q` with its axes permuted."""
        ...

    def transpose(self, q: QTensor) -> QTensor:
        """`q` with its axes reversed (`QTensor.T`)."""
        ...

    def slice(self, q: QTensor, index: Sequence[slice]) -> QTensor:
        """A slice of `q`, one `slice` per leading axis."""
        ...

    def cat(self, qs: Sequence[QTensor], axis: int = 0) -> QTensor:
        """`qs` joined along `axis`."""
        ...

    def matmul(self, x: Any, w: QTensor, *, dtype: Any = np.float32, act: Any = None, out: Any = None,
               stream: Any = None) -> Any:
        """`x @ dequantize(w)` for float x [..., K] and w [K, N] (docs/spec.md, products with a
        quantized weight; quantized activations for `act=`); `out=` and `stream=` as for
        `dequantize`."""
        ...

    def linear(self, x: Any, w: QTensor, bias: Any = None, *, dtype: Any = None, act: Any = None,
               out: Any = None, stream: Any = None) -> Any:
        """`x @ dequantize(w).T + bias` for a linear layer's weight w [N, K] (docs/spec.md,
        products with a quantized weight and quantized activations); `out=` and `stream=` as for
        `dequantize`."""
        ...

    def payload_parts(self, q: QTensor) -> list[np.ndarray]:
        """The portable bytes of `q` as host uint8 arrays in payload order, not joined (their
        concatenation is `into_data(q).payload`), for writers that stream a payload to a file."""
        ...

    def error_stats(self, x: Any, q: QTensor) -> tuple[float, float]:
        """(SQNR dB, max |x - dequantize(q)|) of `q` against its source `x`
        (`qcore.backend.stats.error_stats`'s figures, computed where the backend likes)."""
        ...

    def adopt(self, data: QuantizedData, payload: Any) -> QTensor:
        """A QTensor of `data` over `payload`, memory of this backend's device that already holds
        data's payload bytes (read in place where the backend can, else copied as `from_data`)."""
        ...


BACKEND_ATTRIBUTES: tuple[str, ...] = tuple(Backend.__annotations__)
"""The contract's attributes: name, priority, device, simulated."""
BACKEND_METHODS: tuple[str, ...] = tuple(n for n, v in vars(Backend).items() if callable(v) and not n.startswith("_"))
"""The contract's methods, in the order above."""
BACKEND_MEMBERS: tuple[str, ...] = BACKEND_ATTRIBUTES + BACKEND_METHODS
"""Every member of the contract (what the registry requires of a plugin's backend)."""
