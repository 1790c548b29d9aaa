"""`BaseBackend`: the shared half of every backend (docs/spec.md, backends and public API).

A backend supplies kernels and a `supports()` declaration; `BaseBackend` does everything else
once for all of them: scheme parsing, the capability check at every entry point, shape and
parameter validation, the error text, the tensor ops and products (`qcore.backend.ops`), and a
default for each optional capability of `qcore.backend.protocol.Backend`. Plugins subclass it and
fill in the `_underscore` hooks.
"""
from __future__ import annotations

import abc
import contextlib
import math
import sys
from typing import Any, Sequence

import numpy as np

from qcore.backend import act as _act
from qcore.backend import ops
from qcore.backend.activations import host_activation, host_array, in_callers_kind, out_dtype, product_dims, write_out
from qcore.backend.protocol import CALIBRATION_METHODS, QParams, QTensor, Support, require_support
from qcore.backend.stats import error_stats
from qcore.errors import BackendUnavailableError, InputError, InvalidDataError
from qcore.spec import arithmetic, layout
from qcore.spec.checks import check_input_dtype, check_output_dtype
from qcore.spec.codecs import F32_TINY
from qcore.spec.features import declared_features, scheme_features
from qcore.spec.payload import QuantizedData, sections
from qcore.spec.schemes import OffsetKind, QuantScheme, scheme as parse_scheme

__all__ = ["BaseBackend", "empty_params"]


def empty_params(shape: tuple[int, ...], scheme: QuantScheme) -> QParams:
    """The calibration of an empty tensor (docs/spec-choices.md): every slot's statistic is 0,
    so zero scales stored in the slot dtype; two-level `g` is its floor 1.17549435e-38."""
    zeros = np.zeros(layout.grid_shape(shape, scheme), dtype=np.float32)
    stored = scheme.scale_rounding.store(zeros).reshape(zeros.shape)
    if scheme.reciprocal_global:  # G for an all-zero tensor (reciprocal global scale)
        return QParams(stored, 1.0)
    if scheme.affine:  # every slot's offset 0 (affine offsets)
        return QParams(stored, None, zeros.copy())
    return QParams(stored, float(F32_TINY) if scheme.two_level else None)


class BaseBackend(abc.ABC):
    """Shared logic of every backend: checks first, then the backend's `_hooks`.

    Subclasses set `name` and `priority` and implement `available`, `describe`, `_supports`,
    `_calibrate`, `_quantize`, `_dequantize`, `_from_data`, `_into_data`, `to_numpy`, and may
    override `_shape_dtype` (for device arrays) and the tensor ops. Hooks receive a parsed,
    supported scheme, checked shapes and rounded explicit parameters; `_calibrate` and
    `_quantize` must raise `InputError` for non-finite inputs (see `qcore.spec.checks`).

    Every optional capability of `Backend` has its host default here: `device` "cpu",
    `simulated` False, `out=` written from a host result, `stream=` ignored, `payload_parts` from
    `_payload_parts`, `error_stats` on the host, `adopt` as `from_data`. A device backend
    overrides the ones it does faster.
    """

    name: str = "?"
    priority: int = 0
    device: str = "cpu"
    """Where this backend keeps its tensors (a torch device type; `Backend.device`)."""
    simulated: bool = False
    """Whether the device is a simulator (`Backend.simulated`)."""
    scheme_features: frozenset[str] = frozenset()
    """The scheme features beyond SPEC v1 (`qcore.spec.features`: `round:rne`, `codes:away`, `zero`,
    `flat`, ...) that this backend implements; `supports()` refuses a scheme that uses any other
    one before `_supports` is asked. None by default, so a backend written for SPEC v1 never
    claims a later feature; a subclass lists its own (a set of names, checked when the class is
    made)."""
    packs_field_orders: bool = False
    """Whether the hooks pack fields in every order (docs/spec.md, field orders). When False they
    see each scheme in the byte layout's order (`scheme.low_order`, the same codes), and the
    portable bytes are moved into the scheme's order at `into_data` / `from_data`
    (`layout.reorder_values`)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.scheme_features = declared_features(cls.scheme_features, cls.__qualname__)

    # ------------------------------------------------------------------ capability
    def available(self) -> bool:
        return True

    def describe(self) -> str:
        return self.name

    @abc.abstractmethod
    def _supports(self, scheme: QuantScheme) -> Support:
        """Declare capability as data: `Support.yes()` or `Support.no(reason)`."""

    def supports(self, scheme: QuantScheme | str) -> Support:
        """Whether this backend handles `scheme` (a `Support`: truthy, or falsy with `.reason`).
        A scheme that uses a feature beyond SPEC v1 this backend does not declare in
        `scheme_features` is refused here. Blocks over the flattened tensor (docs/spec.md) are the
        core's: a backend is asked about the same scheme with ordinary blocks; a field order
        (field orders) likewise unless the backend packs it itself (`packs_field_orders`)."""
        scheme = parse_scheme(scheme)
        undeclared = [f for f in scheme_features(scheme) if f.name not in self.scheme_features]
        if undeclared:
            f = undeclared[0]
            where = f"docs/spec.md, {f.section}" if f.concept == f.section else \
                f"{f.concept}; docs/spec.md, {f.section}"
            return Support.no(
                f"backend '{self.name}' does not declare the scheme feature {f.name} ({where}) in its "
                "scheme_features; use a scheme without it or a backend that declares it (qcore backends)")
        scheme = scheme.unflat
        return self._supports(scheme if self.packs_field_orders else scheme.low_order)

    # ------------------------------------------------------------------ what the hooks see
    def _inner(self, shape: tuple[int, ...], scheme: QuantScheme) -> tuple[tuple[int, ...], QuantScheme]:
        """The shape and scheme the hooks see for a tensor: `layout.flat_form` (flat blocks), in
        the byte layout's field order unless this backend packs the others (field orders).
        Identity for most schemes."""
        if scheme.flat_blocks:
            shape, scheme = layout.flat_form(shape, scheme)
        return shape, (scheme if self.packs_field_orders else scheme.low_order)

    def _inner_call(self, x: Any, shape: tuple[int, ...], scheme: QuantScheme,
                    params: QParams | None = None) -> tuple[Any, QuantScheme, QParams | None]:
        """`x`, the scheme and explicit params as the hooks take them (`_inner`)."""
        ishape, inner = self._inner(shape, scheme)
        if ishape != shape:
            x = self._reshape_input(x, ishape)
        if params is not None and inner.block != scheme.block:
            params = self._regrid(params, layout.grid_shape(ishape, inner))
        return x, inner, params

    def _reshape_input(self, x: Any, shape: tuple[int, ...]) -> Any:
        """`x` (already checked) viewed in `shape`, for blocks over the flattened tensor;
        override for arrays without `.reshape`."""
        return x.reshape(shape) if hasattr(x, "reshape") else np.asarray(x).reshape(shape)

    def _reshape_output(self, y: Any, shape: tuple[int, ...]) -> Any:
        """A dequantized result viewed in the tensor's shape (flat blocks)."""
        return y.reshape(shape)

    @staticmethod
    def _regrid(p: QParams, grid: tuple[int, ...]) -> QParams:
        """The same parameters with their slots in `grid`'s shape (the same row-major order)."""
        return QParams(np.asarray(p.scales).reshape(grid), p.global_scale,
                       None if p.offsets is None else np.asarray(p.offsets).reshape(grid))

    def _outer_data(self, d: QuantizedData, shape: tuple[int, ...], scheme: QuantScheme) -> QuantizedData:
        """The hooks' portable bytes `d` as the tensor's own: its shape and scheme, the values'
        fields moved into the scheme's order (field orders); `d` itself for most schemes."""
        if d.shape == shape and d.scheme == scheme:
            return d
        payload = d.payload
        if d.scheme.store != scheme.unflat.store:
            payload = layout.reorder_values(payload, d.shape, d.scheme, scheme.unflat)
        return QuantizedData(shape, scheme, payload)

    def _inner_data(self, data: QuantizedData) -> QuantizedData:
        """Portable bytes as the hooks take them (the inverse of `_outer_data`)."""
        shape, inner = self._inner(data.shape, data.scheme)
        if shape == data.shape and inner == data.scheme:
            return data
        flat_shape, flat_scheme = layout.flat_form(data.shape, data.scheme)
        payload = data.payload
        if inner.store != flat_scheme.store:
            payload = layout.reorder_values(payload, flat_shape, flat_scheme, inner)
        return QuantizedData(shape, inner, payload)

    def _require(self, scheme: QuantScheme | str) -> QuantScheme:
        """Parse, then refuse before touching data: unavailable device or unsupported scheme."""
        scheme = parse_scheme(scheme)
        if not self.available():
            raise BackendUnavailableError(
                f"backend '{self.name}' is not available: {self.describe()}; "
                "pick another with qcore.backend(name) or leave it to 'auto'"
            )
        return require_support(self, scheme)

    # ------------------------------------------------------------------ input checks
    def _shape_dtype(self, x: Any) -> tuple[tuple[int, ...], np.dtype]:
        """Shape and dtype of an input without copying it (override for device arrays)."""
        if isinstance(x, (np.ndarray, np.generic)):
            return np.shape(x), x.dtype
        if isinstance(x, (list, tuple, int, float)):
            try:
                a = np.asarray(x)
            except (ValueError, TypeError, RecursionError) as e:  # ragged or mixed nested lists
                raise InputError(
                    f"input list is not a rectangular array of numbers ({e}); pass a numpy array"
                ) from None
            if a.dtype == object or a.dtype.kind in "USV":
                raise InputError(f"input list holds {a.dtype} items, not numbers; pass a float numpy array")
            if a.dtype.kind in "iub":
                raise InputError(f"input holds {a.dtype} values; quantize float arrays")
            return a.shape, np.dtype(np.float64)
        raise InputError(f"backend '{self.name}' cannot read a {type(x).__name__}; pass a numpy array")

    def _check_input(self, x: Any, scheme: QuantScheme) -> tuple[int, ...]:
        shape, dtype = self._shape_dtype(x)
        check_input_dtype(dtype)
        shape = layout.check_shape(shape)
        layout.grid_shape(shape, scheme)  # block rank <= tensor rank
        layout.packing_axis(shape, scheme)  # packing axis < rank
        if scheme.is_lookup:
            scheme.require_table()
        return shape

    def _check_params(self, params: Any, shape: tuple[int, ...], scheme: QuantScheme) -> QParams:
        """Explicit user parameters: finite, >= 0, grid-shaped; rounded up like calibrated ones."""
        if not isinstance(params, QParams):
            raise InputError(f"params must be a QParams, got {type(params).__name__}")
        grid = layout.grid_shape(shape, scheme)
        try:
            s = np.asarray(params.scales, dtype=np.float64)
        except (TypeError, ValueError):
            raise InputError(f"params.scales must be numbers, got {params.scales!r}") from None
        if grid == () and s.size == 1:
            s = s.reshape(())
        if s.shape != grid:
            raise InputError(
                f"params.scales has shape {s.shape} but {scheme} on shape {shape} has block grid {grid}"
            )
        if not np.all(np.isfinite(s)) or (not scheme.signed and (np.any(s < 0) or np.any(np.signbit(s)))):
            raise InputError("params.scales must be finite and >= 0 (any sign for signed scales); "
                             "calibrate() gives valid ones")
        if np.any(s > np.finfo(np.float32).max):
            raise InputError("params.scales overflow float32; give scales <= 3.4e38")
        g = params.global_scale
        if scheme.two_level:
            if g is None or not isinstance(g, (int, float, np.floating, np.integer)) or not math.isfinite(g) \
                    or g < 0 or abs(g) > np.finfo(np.float32).max or math.copysign(1.0, g) < 0:
                raise InputError(f"{scheme} is two-level: params.global_scale must be a finite float >= 0, got {g!r}")
            g = float(np.float32(g))
            if scheme.reciprocal_global and not g > 0:
                raise InputError(f"{scheme} stores a reciprocal global: params.global_scale must be > 0, got {g!r}")
        elif g is not None:
            raise InputError(f"{scheme} has one scale level: params.global_scale must be None, got {g!r}")
        stored = arithmetic.round_scales(s.astype(np.float32), scheme, scheme.given_scale_rounding).reshape(grid)
        return QParams(stored, g, self._check_offsets(params.offsets, grid, scheme))

    @staticmethod
    def _check_offsets(offsets: Any, grid: tuple[int, ...], scheme: QuantScheme) -> np.ndarray | None:
        """An affine scheme's explicit offsets (docs/spec.md, affine offsets): grid-shaped; MIN
        finite (rounded to nearest into its dtype), ZERO integers in the value's range."""
        if not scheme.affine:
            if offsets is not None:
                raise InputError(f"{scheme} has no offsets: params.offsets must be None")
            return None
        if offsets is None:
            raise InputError(f"{scheme} is affine: params.offsets must give one offset per slot (grid {grid})")
        try:
            o = np.asarray(offsets, dtype=np.float64)
        except (TypeError, ValueError):
            raise InputError(f"params.offsets must be numbers, got {offsets!r}") from None
        if grid == () and o.size == 1:
            o = o.reshape(())
        if o.shape != grid:
            raise InputError(f"params.offsets has shape {o.shape} but {scheme} has block grid {grid}")
        if not np.all(np.isfinite(o)) or np.any(np.abs(o) > np.finfo(np.float32).max):
            raise InputError("params.offsets must be finite float32 values")
        if scheme.offset.kind is OffsetKind.MIN:
            return arithmetic.round_offsets(o.astype(np.float32), scheme)
        t = scheme.traits
        if np.any(o != np.rint(o)) or np.any(o < t.qmin) or np.any(o > t.qmax):
            raise InputError(f"zero points must be integers in [{int(t.qmin)}, {int(t.qmax)}] for {scheme}")
        return o.astype(np.float32)

    @staticmethod
    def _check_method(method: str, scheme: QuantScheme | None = None) -> str:
        if method not in CALIBRATION_METHODS:
            raise InputError(f"unknown calibration method {method!r}; use one of {CALIBRATION_METHODS}")
        if scheme is not None:
            arithmetic.require_method(scheme, method)
        return method

    def _own(self, q: Any) -> QTensor:
        if not isinstance(q, QTensor):
            raise InputError(f"expected a QTensor, got {type(q).__name__}")
        if q.backend is not self and q.backend.name != self.name:
            raise InputError(f"QTensor lives on backend '{q.backend.name}'; move it with q.to('{self.name}')")
        self._require(q.scheme)
        return q

    # ------------------------------------------------------------------ entry points
    def calibrate(self, x: Any, scheme: QuantScheme | str, method: str = "minmax") -> QParams:
        """Scales for `x` under `scheme` (calibration, scale storage): stored, rounded up, grid-shaped."""
        x = host_array(x)
        scheme = self._require(scheme)
        self._check_method(method, scheme)
        shape = self._check_input(x, scheme)
        if math.prod(shape) == 0:
            return empty_params(shape, scheme)
        x, inner, _ = self._inner_call(x, shape, scheme)
        p = self._calibrate(x, inner, method)
        return p if inner.block == scheme.block else self._regrid(p, layout.grid_shape(shape, scheme))

    def quantize(self, x: Any, scheme: QuantScheme | str, *, params: QParams | None = None,
                 method: str = "minmax", out: Any = None, stream: Any = None) -> QTensor:
        """Quantize `x` (calibrated, or with explicit `params`; docs/spec.md, arithmetic): a numpy
        array, a torch CPU tensor (read in place where torch allows, bfloat16 included), or the
        backend's own arrays. `out=`: a QTensor of this backend with x's shape and this scheme,
        given the new data and returned. `stream=` is a device backend's; this one runs on the
        calling thread."""
        if out is not None:  # checked before any work
            self._check_quantize_out(out, x, scheme)
            out.data = self.quantize(x, scheme, params=params, method=method).data
            return out
        x = host_array(x)
        scheme = self._require(scheme)
        self._check_method(method, scheme)
        shape = self._check_input(x, scheme)
        if params is not None:
            params = self._check_params(params, shape, scheme)
        if math.prod(shape) == 0:  # nothing to read: O(1) whatever the other extents claim (size claims)
            p = params or empty_params(shape, scheme)
            codes = np.zeros(shape, dtype=scheme.code_dtype)
            return self.from_data(QuantizedData.from_parts(shape, scheme, codes, p.scales, p.global_scale, p.offsets))
        x, inner, params = self._inner_call(x, shape, scheme, params)
        return QTensor(self, scheme, shape, self._quantize(x, inner, params, method))

    def dequantize(self, q: QTensor, dtype: Any = None, *, out: Any = None, stream: Any = None) -> Any:
        """`decode(q) * e` in f32, cast to `dtype` (docs/spec.md, dequantize; None: out's dtype,
        else float32). An empty tensor gives an empty array at once, whatever its other extents
        claim (size claims). `out=`: a C-contiguous numpy array or torch CPU tensor of q's size and
        the result's dtype, written and returned. `stream=` as for `quantize`."""
        q = self._own(q)
        dtype = check_output_dtype(out_dtype(out, "dequantize") if dtype is None and out is not None else
                                   np.float32 if dtype is None else dtype)
        if math.prod(q.shape) == 0:
            y = self._empty_output(q.shape, dtype)
        else:
            with self._naming_elements(q):
                y = self._dequantize(q.data, dtype)
            y = y if tuple(y.shape) == q.shape else self._reshape_output(y, q.shape)
        return y if out is None else write_out(self.to_numpy(y), out, "dequantize")

    def _check_quantize_out(self, out: Any, x: Any, scheme: QuantScheme | str) -> None:
        """`quantize`'s `out=` must be a QTensor of this backend with x's shape and the scheme."""
        scheme = parse_scheme(scheme)
        shape = tuple(self._shape_dtype(host_array(x))[0])
        if not isinstance(out, QTensor) or out.backend is not self or out.shape != shape or out.scheme != scheme:
            got = repr(out) if isinstance(out, QTensor) else type(out).__name__
            raise InputError(f"quantize out= takes a QTensor of backend '{self.name}' with shape {shape} and "
                             f"scheme {scheme}, got {got}; leave out= out for a new one")

    @contextlib.contextmanager
    def _naming_elements(self, q: QTensor):
        """An invalid code that the hooks found in their form of `q` (field orders, flat blocks) is
        named as an element of `q` itself: its index in q's shape, q's scheme."""
        try:
            yield
        except InvalidDataError:
            if self._inner(q.shape, q.scheme) != (q.shape, q.scheme):
                self.into_data(q).check_codes()
            raise

    def _empty_output(self, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        """This backend's empty array of `shape` (override for device arrays)."""
        return np.zeros(shape, dtype=dtype)

    def from_data(self, data: QuantizedData) -> QTensor:
        """Load portable bytes onto this backend."""
        if not isinstance(data, QuantizedData):
            raise InputError(f"from_data takes a QuantizedData, got {type(data).__name__}")
        self._require(data.scheme)
        inner = self._inner_data(data)
        try:
            held = self._from_data(inner)
        except InvalidDataError:
            if inner is not data:  # name the element in the tensor's own shape (field orders, flat blocks)
                data.check_codes()
            raise
        return QTensor(self, data.scheme, data.shape, held)

    def into_data(self, q: QTensor) -> QuantizedData:
        """The portable bytes of `q`."""
        q = self._own(q)
        return self._outer_data(self._into_data(q.data), q.shape, q.scheme)

    def payload_parts(self, q: QTensor) -> list[np.ndarray]:
        """The portable bytes of `q` as host uint8 arrays in payload order, not joined: their
        concatenation is `into_data(q).payload`. For writers that stream a payload to a file
        (`qcore.quantize_model`) without the copies a `bytes` object costs."""
        q = self._own(q)
        if q.scheme.store.order is not self._inner(q.shape, q.scheme)[1].store.order:
            parts = [np.frombuffer(self.into_data(q).payload, np.uint8)]  # fields moved (field orders)
        else:
            parts = self._payload_parts(q.data)
        want = sections(q.shape, q.scheme).total
        got = sum(int(p.nbytes) for p in parts)
        if got != want:
            raise RuntimeError(f"backend '{self.name}' gave {got} payload bytes for {q.scheme} {q.shape}, "
                               f"not {want}")
        return parts

    def error_stats(self, x: Any, q: QTensor) -> tuple[float, float]:
        """(SQNR dB, max |x - dequantize(q)|) of `q` against its source `x`: dequantized to host
        float32 and `qcore.backend.stats.error_stats`. A device backend overrides it to reduce
        where the tensor lives (the same figures)."""
        q = self._own(q)
        return error_stats(np.asarray(host_array(x)), self.to_numpy(self.dequantize(q, np.float32)))

    def adopt(self, data: QuantizedData, payload: Any) -> QTensor:
        """A QTensor of `data` whose payload `payload` already holds (`Backend.adopt`). A host
        backend keeps its own copy: `from_data(data)`; a device backend overrides it to read device
        memory in place."""
        return self.from_data(data)

    # ------------------------------------------------------------------ tensor ops
    def reshape(self, q: QTensor, shape: Sequence[int]) -> QTensor:
        q = self._own(q)
        return ops.reshape(self, q, shape)

    def permute(self, q: QTensor, axes: Sequence[int]) -> QTensor:
        q = self._own(q)
        return ops.permute(self, q, axes)

    def transpose(self, q: QTensor) -> QTensor:
        """Reverse the axes (`permute` with the axes reversed)."""
        return self.permute(q, tuple(range(len(q.shape)))[::-1])

    def slice(self, q: QTensor, index: Sequence[slice] | slice) -> QTensor:
        q = self._own(q)
        return ops.slice_(self, q, index)

    def cat(self, qs: Sequence[QTensor], axis: int = 0) -> QTensor:
        qs = [self._own(q) for q in qs]
        return ops.cat(self, qs, axis)

    def _host_x(self, x: Any) -> Any:
        """x as the core's products read it: numpy arrays and torch tensors as they are, anything
        else through `to_numpy` (a device backend's own arrays)."""
        torch = sys.modules.get("torch")
        if isinstance(x, np.ndarray) or (torch is not None and isinstance(x, torch.Tensor)):
            return x
        return self.to_numpy(x)

    def _product_x(self, what: str, x: Any, w: QTensor, act: Any, dtype: Any) -> tuple[Any, Any]:
        """(x as the core's products read it, the result dtype) (docs/spec.md, quantized
        activations): a QTensor x is its decoded value (float32); with `act`, x is read as float32
        (as `matmul` and `linear` read it), quantized under `act` by this backend, and decoded (a
        row holding a non-finite value decoded as NaN), and `dtype=None` keeps meaning x's own
        dtype; a torch x stays torch, so the result comes back as x came."""
        if isinstance(x, QTensor):
            return self.to_numpy(self.dequantize(_act.given_x(self, what, x, w.shape, act))), dtype
        x = self._host_x(x)
        if act is None:
            return x, dtype
        xa, as_torch = host_activation(x)
        k_, _ = product_dims(what, xa.shape, w.shape)
        scheme = _act.act_scheme(self, act, what, k_)
        x32, bad = _act.finite_rows(xa.astype(np.float32, copy=False))
        xd = _act.nan_rows(self.to_numpy(self.dequantize(self.quantize(x32, scheme))), bad)
        return in_callers_kind(xd, as_torch), (xa.dtype if dtype is None else dtype)

    def matmul(self, x: Any, w: QTensor, *, dtype: Any = np.float32, act: Any = None, out: Any = None,
               stream: Any = None) -> Any:
        """`x @ dequantize(w)` for float `x` [..., K] and quantized `w` [K, N], block by block, f32
        sums rounded once to `dtype` (default float32; None: x's dtype). `act=SCHEME` quantizes x
        per row first, and x may be a QTensor (docs/spec.md, quantized activations). `out=` and
        `stream=` as for `dequantize`."""
        w = self._own(w)
        x, dtype = self._product_x("matmul", x, w, act, dtype)
        return write_out(ops.matmul(self, x, w, dtype=dtype), out, "matmul")

    def linear(self, x: Any, w: QTensor, bias: Any = None, *, dtype: Any = None, act: Any = None,
               out: Any = None, stream: Any = None) -> Any:
        """`x @ dequantize(w).T + bias` for float `x` [..., K] (float16, bfloat16, float32,
        float64; numpy or torch) and a linear layer's weight `w` [N, K] as checkpoints store it;
        f32 sums, bias added in f32, one rounding to `dtype` (default: x's dtype), returned as x
        came (numpy or torch) (docs/spec.md, products with a quantized weight). `act=SCHEME`
        (e.g. `e4m3/block{K}:f32`) multiplies by `dequantize(quantize(x, act))` instead of x, and
        x may be a QTensor [..., K] of this backend (docs/spec.md, quantized activations). `out=`
        and `stream=` as for `dequantize`."""
        w = self._own(w)
        x, dtype = self._product_x("linear", x, w, act, dtype)
        return write_out(ops.linear(self, x, w, bias, dtype=dtype), out, "linear")

    # ------------------------------------------------------------------ hooks
    @abc.abstractmethod
    def _calibrate(self, x: Any, scheme: QuantScheme, method: str) -> QParams:
        """Stored scales for input `x` (calibration, two-level scales, scale storage)."""

    @abc.abstractmethod
    def _quantize(self, x: Any, scheme: QuantScheme, params: QParams | None, method: str) -> Any:
        """This backend's representation of quantized `x`; `params` are rounded, or None."""

    @abc.abstractmethod
    def _dequantize(self, data: Any, dtype: np.dtype) -> Any:
        """`decode * e` in f32, cast to `dtype`, as this backend's array."""

    @abc.abstractmethod
    def _from_data(self, data: QuantizedData) -> Any:
        """This backend's representation of validated portable bytes."""

    @abc.abstractmethod
    def _into_data(self, data: Any) -> QuantizedData:
        """The portable bytes of this backend's representation."""

    def _payload_parts(self, data: Any) -> list[np.ndarray]:
        """`_into_data`'s payload as host uint8 arrays in order; override to skip the join."""
        return [np.frombuffer(self._into_data(data).payload, dtype=np.uint8)]

    def to_numpy(self, array: Any) -> np.ndarray:
        return np.asarray(array)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} '{self.name}'>"
