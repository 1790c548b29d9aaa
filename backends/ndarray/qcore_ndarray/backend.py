"""The `ndarray` backend: Q8F/Q8S on numpy arrays with numba CPU kernels (docs/spec.md, backends).

Capability (the spec's backends table): the 8-bit integer values Q8F and Q8S, symmetric mode, every
level (per-tensor, per-block up to 5-D, two-level), every store valid for an 8-bit value (Native,
PackedU32(d)) and every scale dtype. Everything else gets `Support.no(reason)`, and
`qcore.BaseBackend` turns that into `UnsupportedSchemeError` at every entry point.

Results are bit-identical to the `reference` backend. The paths, by scheme:

| scheme                        | passes over x                                               |
|-------------------------------|-------------------------------------------------------------|
| per-block, calibrated         | one: per block statistic, round up, quantize (MODE_FUSED)   |
| per-tensor, calibrated        | two: statistic over x, then quantize (MODE_APPLY)           |
| two-level, calibrated         | two: block statistics (MODE_STATS), then quantize           |
| explicit params               | one: quantize with the non-finite check fused in            |

The two-level normalisation and the round-up of whole scale grids use `qcore.spec.codecs` (numpy,
small arrays) in the order the spec's two-level scales and scale storage fix; the fused path rounds
up inside the kernel with `kernels.round_scale_scalar`, which the tests pin against
`qcore.spec.codecs` bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from qcore.spec import arithmetic
from qcore.spec import layout
from qcore.backend import ops
from qcore.backend.activations import write_out
from qcore.spec.arithmetic import slot_effective, store_reciprocal, store_scales
from qcore.spec.checks import raise_nonfinite, to_f32
from qcore.spec.codecs import CODE_RULES
from qcore.errors import InvalidDataError
from qcore.spec.payload import QuantizedData, offset_bytes
from qcore.backend.base import BaseBackend
from qcore.backend.protocol import QParams, QTensor, Support
from qcore.spec.schemes import QuantScheme, StoreKind

from .plan import TASK_ELEMENTS, Plan, make_plan

__all__ = ["NdarrayBackend", "NdQuantized", "SUPPORTED_STORES"]

SUPPORTED_STORES = frozenset({StoreKind.NATIVE, StoreKind.PACKED_U32})
"""Stores the kernels write; with an 8-bit value these are all the valid ones (docs/spec.md, validity rules)."""


@dataclass(frozen=True, eq=False)
class NdQuantized:
    """`QTensor.data` of this backend: the payload's value bytes, stored scales, global scale.

    `values` is exactly the `[values]` section of the portable bytes (flat uint8); `scales` are the
    stored (rounded-up) scales decoded to f32 in the block-grid shape; `global_scale` is the
    two-level f32, else None; `offsets` an affine scheme's stored offsets (docs/spec.md, affine
    offsets), else None.
    """

    shape: tuple[int, ...]
    scheme: QuantScheme
    values: np.ndarray
    scales: np.ndarray
    global_scale: float | None
    offsets: np.ndarray | None = None


def _kernels():
    """The numba kernels, imported on first use so that `import qcore` stays fast."""
    from . import kernels

    return kernels


def _checked_f32(x: Any) -> np.ndarray:
    """Input as float32, NaN/Inf refused (the core's check)."""
    x = to_f32(x)
    raise_nonfinite(x)
    return x


def _flat_f32(x: Any) -> np.ndarray:
    """Input as a flat, C-contiguous float32 array (no copy for contiguous float32, the spec's arithmetic)."""
    return np.ascontiguousarray(to_f32(x)).reshape(-1)


class NdarrayBackend(BaseBackend):
    """Q8F/Q8S at every level, store and scale dtype; numpy in and out, numba kernels inside."""

    name = "ndarray"
    priority = 20
    # the extensions of docs/spec.md for its 8-bit values: the rounding rules and code rules in its
    # kernels, signed scales and zero points through qcore.spec.arithmetic, field orders and flat
    # blocks through the core; not unsigned values, min offsets or LOOKUP's midpoint rule
    scheme_features = {"round:rne", "round:mx", "recip", "signed", "codes:away", "codes:offset", "zero",
                       "order:high", "order:split", "flat"}

    # ------------------------------------------------------------------ capability
    def available(self) -> bool:
        try:
            import numba  # noqa: F401
        except ImportError:
            return False
        return True

    def describe(self) -> str:
        try:
            import numba
        except ImportError as e:
            return f"needs numba ({e}); pip install numba"
        return f"numba {numba.__version__} CPU kernels on {numba.get_num_threads()} threads; Q8F/Q8S only"

    def _supports(self, scheme: QuantScheme) -> Support:
        """The spec's backends table: Q8F and Q8S, symmetric, any level, store and scale dtype."""
        if scheme.is_lookup:
            return Support.no("LOOKUP mode is not implemented (only symmetric q8f and q8s are)")
        t = scheme.traits
        if t.is_float or t.bits != 8 or t.unsigned:
            return Support.no(f"value {scheme.value} is not implemented (only the 8-bit integers q8f and q8s are)")
        if scheme.store.kind not in SUPPORTED_STORES:
            return Support.no(f"store {scheme.store} is not implemented (native and packed_u32 are)")
        return Support.yes()

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _effective(scales: np.ndarray, g: float | None, scheme: QuantScheme) -> np.ndarray:
        """Per slot `e = s`, `e = f32(g * s_b)` (the spec's effective scale) or `e = f32(s_b / G)`
        (a reciprocal global scale, docs/spec.md): `qcore.spec.arithmetic.slot_effective`, flat, at
        least one entry."""
        e = slot_effective(scales, g, scheme).reshape(-1)
        return e if e.size else np.zeros(1, np.float32)

    @staticmethod
    def _store(stat: np.ndarray, scheme: QuantScheme):
        """Stored scales from the slots' statistics (the core's rules: `qcore.spec.arithmetic`)."""
        if scheme.reciprocal_global:
            return store_reciprocal(stat, scheme)
        return store_scales((stat / np.float32(scheme.scale_divisor)).astype(np.float32), scheme)

    def _stats(self, flat: np.ndarray, plan: Plan, scheme: QuantScheme, method: str) -> np.ndarray:
        """Per-slot statistic (the spec's calibration) in the grid shape; raises InputError on NaN/Inf."""
        k = _kernels()
        mcode = k.METHOD_CODES[method]
        if plan.grid == ():
            mb, total = k.tensor_stats(flat, flat.view(np.uint32), mcode, TASK_ELEMENTS)
            if int(mb) >= 0x7F800000:
                raise_nonfinite(flat.reshape(plan.shape))
            if method == "minmax":
                return np.asarray(np.uint32(mb)).view(np.float32).reshape(())
            n = flat.size
            return np.asarray(np.float32(total / n) if n else np.float32(0), dtype=np.float32)
        stats = np.zeros(plan.nslots, np.float32)
        self._run_blocks(flat, plan, scheme, k.MODE_STATS, mcode, stats, None, None, check=True)
        return stats.reshape(plan.grid)

    def _run_blocks(self, flat, plan: Plan, scheme: QuantScheme, mode: int, mcode: int,
                    scales_out: np.ndarray | None, escales: np.ndarray | None,
                    values: np.ndarray | None, check: bool, rule: int = 0) -> None:
        k = _kernels()
        t = scheme.traits
        bad = np.zeros(plan.ntasks, np.uint8)
        dummy_f = np.zeros(1, np.float32)
        k.quantize_blocks(
            flat, flat.view(np.uint32), *plan.args(), mode, mcode, check,
            np.float32(scheme.scale_divisor), np.float32(t.qmin), np.float32(t.qmax),
            scheme.scale_slot,
            dummy_f if escales is None else escales,
            dummy_f if scales_out is None else scales_out,
            np.zeros(1, np.int8) if values is None else values.view(np.int8),
            bad,
            plan.log2_block,
            rule,
        )
        if bad.any():
            raise_nonfinite(flat.reshape(plan.shape))

    # ------------------------------------------------------------------ hooks
    def _calibrate(self, x: Any, scheme: QuantScheme, method: str) -> QParams:
        if scheme.signed or scheme.affine:  # signed scales, affine offsets: the core's signed extreme, min and max
            return arithmetic.calibrate(_checked_f32(x), scheme, method)
        flat = _flat_f32(x)
        plan = make_plan(np.shape(x), scheme)
        stat = self._stats(flat, plan, scheme, method)
        return self._store(stat, scheme)

    def _quantize(self, x: Any, scheme: QuantScheme, params: QParams | None, method: str) -> NdQuantized:
        if scheme.signed or scheme.affine:  # signed scales, affine offsets: the core's arithmetic
            return self._from_data(arithmetic.quantize(_checked_f32(x), scheme, params, method))
        if scheme.reciprocal_codes:  # code rules: the kernels' code rule, from the raw scales' reciprocals
            return self._quantize_rule(x, scheme, params, method)
        k = _kernels()
        flat = _flat_f32(x)
        shape = tuple(np.shape(x))
        plan = make_plan(shape, scheme)
        values = (np.zeros if plan.padded else np.empty)(plan.values_nbytes, np.uint8)
        mcode = k.METHOD_CODES[method]
        if params is None and plan.grid != () and not scheme.two_level:
            stored = np.zeros(plan.nslots, np.float32)
            self._run_blocks(flat, plan, scheme, k.MODE_FUSED, mcode, stored, None, values, check=True)
            return NdQuantized(shape, scheme, values, stored.reshape(plan.grid), None)
        check = params is not None  # the calibration pass has already checked x otherwise
        if params is None:
            params = self._store(self._stats(flat, plan, scheme, method), scheme)
        stored = np.asarray(params.scales, dtype=np.float32).reshape(plan.grid)
        e = self._effective(stored, params.global_scale, scheme)
        self._run_blocks(flat, plan, scheme, k.MODE_APPLY, mcode, None, e, values, check=check)
        return NdQuantized(shape, scheme, values, stored, params.global_scale)

    def _quantize_rule(self, x: Any, scheme: QuantScheme, params: QParams | None, method: str) -> NdQuantized:
        """The code rules (docs/spec.md) on the kernels: the statistics pass, raw scales `stat / h`
        (given scales are their own raw scales) stored by the scheme's rule, then MODE_APPLY with
        the raw scales' reciprocals (0 for a zero scale) and the rule's id."""
        k = _kernels()
        flat = _flat_f32(x)
        shape = tuple(np.shape(x))
        plan = make_plan(shape, scheme)
        values = (np.zeros if plan.padded else np.empty)(plan.values_nbytes, np.uint8)
        if params is None:
            raw = (self._stats(flat, plan, scheme, method) / np.float32(scheme.scale_divisor)).astype(np.float32)
            stored = store_scales(raw, scheme).scales
        else:
            raw = stored = np.asarray(params.scales, dtype=np.float32)
        with np.errstate(divide="ignore", over="ignore"):
            rcp = np.where(raw == 0, np.float32(0), np.float32(1) / raw).astype(np.float32).reshape(-1)
        self._run_blocks(flat, plan, scheme, k.MODE_APPLY, k.METHOD_CODES[method], None,
                         rcp if rcp.size else np.zeros(1, np.float32), values, check=params is not None,
                         rule=CODE_RULES.index(scheme.code_rule.value))
        return NdQuantized(shape, scheme, values, np.asarray(stored, np.float32).reshape(plan.grid), None)

    def error_stats(self, x: Any, q: QTensor) -> tuple[float, float]:
        """(SQNR dB, max |err|) of `q` against `x` (`Backend.error_stats`): the dequantize kernel,
        then one parallel pass over x and the result (`kernels.error_partials`)."""
        from qcore.backend.stats import sqnr_db

        q = self._own(q)
        xf = _flat_f32(x)
        if xf.size == 0:
            return sqnr_db(0.0, 0.0), 0.0
        y = self._dequantize(q.data, np.dtype(np.float32)).reshape(-1)
        signal, noise, maxima = _kernels().error_partials(xf, y, TASK_ELEMENTS)
        return sqnr_db(float(signal), float(noise)), float(np.max(maxima))

    def _dequantize(self, data: NdQuantized, dtype: np.dtype) -> np.ndarray:
        if data.scheme.affine:  # affine offsets: the core's decode
            return arithmetic.dequantize(self._into_data(data)).astype(dtype)
        k = _kernels()
        plan = make_plan(data.shape, data.scheme)
        y = np.empty(plan.size, np.float32)
        if plan.size:
            e = self._effective(data.scales, data.global_scale, data.scheme)
            codes = data.values.view(np.int8)
            codes.flags.writeable = False  # one compiled signature for owned and from_data bytes
            bad = np.zeros(plan.ntasks, np.uint8)
            k.dequantize_blocks(codes, *plan.args(), e, y, np.int8(data.scheme.traits.qmin), bad)
            if bad.any():  # a code outside the value's set: the core names the first one
                self._into_data(data).check_codes()
        y = y.reshape(data.shape)
        return y if dtype == np.float32 else y.astype(dtype)

    def _into_data(self, data: NdQuantized) -> QuantizedData:
        return QuantizedData(data.shape, data.scheme, b"".join(p.tobytes() for p in self._payload_parts(data)))

    def _payload_parts(self, data: NdQuantized) -> list[np.ndarray]:
        """Codes (the values array itself, no copy), encoded scales, the global scale."""
        tr = data.scheme.slot_dtype.traits
        parts = [np.ascontiguousarray(data.values).reshape(-1).view(np.uint8),
                 np.ascontiguousarray(tr.encode(data.scales.reshape(-1))).reshape(-1).view(np.uint8)]
        if data.global_scale is not None:
            parts.append(np.asarray([data.global_scale], dtype="<f4").view(np.uint8))
        if data.offsets is not None:
            parts.append(np.frombuffer(offset_bytes(data.offsets, data.scheme), np.uint8))
        return parts

    def _from_data(self, data: QuantizedData) -> NdQuantized:
        n = layout.values_nbytes(data.shape, data.scheme)
        values = np.frombuffer(data.payload, dtype=np.uint8, count=n)
        return NdQuantized(data.shape, data.scheme, values, data.scales(), data.global_scale(), data.offsets())

    def to_numpy(self, array: Any) -> np.ndarray:
        return np.asarray(array)

    # ------------------------------------------------------------------ ops
    MATMUL_ROWS = 1024
    """Rows of w dequantized per step: the same steps as `qcore.backend.ops.matmul`, so the f32 sums
    (and so the results) are identical to every other backend's."""

    def _row_bands(self, w: Any, rows_per_step: int) -> Any:
        """(r0, r1, rows r0..r1 of the 2-D weight dequantized to float32) for bands of
        `rows_per_step` rows (whole blocks) by the numba kernel straight from the stored bytes: the
        values of `qcore.backend.ops`' own bands, faster. A band holding an invalid code raises the core's
        `InvalidDataError`, naming the weight's first invalid code."""
        data: NdQuantized = w.data
        sch = data.scheme
        rows, cols = w.shape
        block = layout.full_block(w.shape, sch)
        br = block[0] if block else 1
        step = max(br, (rows_per_step // br) * br)
        row_bytes = layout.values_nbytes((1, cols), sch)  # codes of one row of w
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            scales = data.scales if block is None else data.scales[r0 // br: -(-r1 // br)]
            band = NdQuantized((r1 - r0, cols), sch, data.values[r0 * row_bytes: r1 * row_bytes], scales,
                               data.global_scale)
            try:
                yield r0, r1, self._dequantize(band, np.dtype(np.float32))
            except InvalidDataError:
                self._into_data(data).check_codes()  # the first invalid code of the whole weight
                raise

    def _bands_apply(self, w: Any) -> bool:
        """Whether `_row_bands` reads `w`: a 2-D weight of a non-affine scheme in its own shape
        whose rows are whole stored lines (Native store, or words packed along axis 0)."""
        sch = w.data.scheme
        return (not sch.affine and len(w.shape) == 2 and w.data.shape == w.shape
                and (sch.store.kind is StoreKind.NATIVE or sch.store.dim == 0))

    def matmul(self, x: Any, w: Any, *, dtype: Any = np.float32, act: Any = None, out: Any = None,
               stream: Any = None) -> Any:
        """`x @ dequantize(w)` for float x [..., K] and w [K, N], `MATMUL_ROWS` rows of w at a time
        (whole blocks) dequantized by the numba kernel (`_row_bands`), so the full float weight never
        exists; the core's `qcore.backend.ops.matmul` does the rest (checks, activation and result
        dtypes, its own decode for weights `_row_bands` does not read). `act=` and a QTensor x:
        `BaseBackend._product_x` (docs/spec.md, quantized activations); `out=` as `BaseBackend` writes
        it (`stream=` ignored: this backend runs on the calling thread)."""
        w = self._own(w)
        x, dtype = self._product_x("matmul", x, w, act, dtype)
        bands = self._row_bands if self._bands_apply(w) else None
        return write_out(ops.matmul(self, x, w, self.MATMUL_ROWS, dtype=dtype, bands=bands), out, "matmul")

    def linear(self, x: Any, w: Any, bias: Any = None, *, dtype: Any = None, act: Any = None, out: Any = None,
               stream: Any = None) -> Any:
        """`x @ dequantize(w).T + bias` for a weight [N, K]: as `matmul`, bands of N rows."""
        w = self._own(w)
        x, dtype = self._product_x("linear", x, w, act, dtype)
        bands = self._row_bands if self._bands_apply(w) else None
        return write_out(ops.linear(self, x, w, bias, self.MATMUL_ROWS, dtype=dtype, bands=bands), out, "linear")
