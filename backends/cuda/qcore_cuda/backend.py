"""The `cuda` backend: Numba-CUDA kernels for every non-LOOKUP scheme (docs/spec.md, backends).

A quantized tensor lives on the device as its portable payload (docs/spec.md, portable bytes):
one uint8 device array `[values][scales][global]` that the kernels write directly, so `into_data`
is one copy to the host and `from_data` one copy to the device. numba is imported lazily:
importing this module (and registering the backend) never touches a driver.
"""
from __future__ import annotations

import functools
import math
import os
import sys
from typing import Any

import ml_dtypes
import numpy as np

from qcore.spec import layout
from qcore.backend.activations import ACTIVATION_DTYPES, host_array
from qcore.spec.checks import check_input_dtype, check_output_dtype, to_f32
from qcore.errors import InputError
from qcore.spec.payload import QuantizedData, sections
from qcore.backend.base import BaseBackend
from qcore.backend.protocol import QParams, QTensor, Support
from qcore.spec.schemes import QuantScheme

from . import _array, _flags, _repeat, _streams
from ._compat import numba_cuda
from ._data import CudaData
from ._launch import Packed
from ._loader import kernels as _k
from ._memory import guard
from ._quiet import quiet
from ._state import CudaState, FastVerdict
from .paths import choose
from .paths.dequantize import DEQUANTIZE, DequantizeCall
from .paths.matmul import MATMUL, MatmulCall, packed_takes, run_packed
from .paths.quantize import QUANTIZE, QuantizeCall

__all__ = ["CudaBackend", "CudaData", "cuda_status"]


def no_device_reason(err: BaseException | None) -> str:
    """One clean clause for "no CUDA device": numba's driver text without its "Error at driver
    init:" wrapper and trailing punctuation, and the way out."""
    text = " ".join(str(err).split()) if err is not None else ""
    text = text.removeprefix("Error at driver init:").strip().rstrip(":;,. ")
    why = f" ({text})" if text else ""
    return f"no usable CUDA device{why}; NUMBA_ENABLE_CUDASIM=1 runs the (slow) CUDA simulator instead"


def cuda_status() -> tuple[bool, str]:
    """(available, why) without raising: GPU, simulator, or the reason neither works."""
    try:
        cuda = numba_cuda()
    except Exception as e:  # numba, numba-cuda or cuda-bindings missing
        return False, f"numba.cuda import failed: {type(e).__name__}: {e}"
    import numba

    try:
        if not cuda.is_available():
            try:
                cuda.get_current_device()
            except Exception as e:  # CudaSupportError (an ImportError): no driver
                return False, no_device_reason(e)
            return False, no_device_reason(None)
        if numba.config.ENABLE_CUDASIM:
            return True, "CUDA simulator (NUMBA_ENABLE_CUDASIM=1): correct but slow, for tests"
        dev = cuda.get_current_device()
        name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
        cc = ".".join(map(str, dev.compute_capability))
        return True, f"Numba-CUDA on {name} (compute capability {cc})"
    except Exception as e:
        return False, f"CUDA check failed: {type(e).__name__}: {' '.join(str(e).split())}"


_cuda = numba_cuda  # numba.cuda, first imported without numpy 2.5's warning (_compat)


def _shape_of(be: "CudaBackend", x: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in be._shape_dtype(x)[0])


def _numel(be: "CudaBackend", x: Any) -> int:
    return math.prod(_shape_of(be, x))


def _payload_bytes(be: "CudaBackend", x: Any, scheme: QuantScheme) -> int:
    return sections(_shape_of(be, x), scheme).total


_NUMBA_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.float64))  # device outputs numba has
_BF16 = np.dtype(ml_dtypes.bfloat16)
FAST_MIN_CC = (8, 9)  # cvt.rn.satfinite.e4m3x2 / .e5m2x2 and cvt.rn.f16x2.e4m3x2 (PTX ISA: sm_89+)


def fast_verdict(cc: tuple[int, int] | None, env: str | None) -> tuple[bool, str]:
    """(usable, why) for the fast kernels (fast.py, gemv.py) on a device of compute capability
    `cc` (None: the simulator) with `QCORE_CUDA_FAST` set to `env`. The fast kernels use the
    sm_89+ FP8 conversions (FP8 codes, UE4M3 scale words, FP8 decode) and sm_80's max.NaN, so
    GPUs below compute capability 8.9 (A100, V100, T4) take the general kernels (kernels.py),
    which write the same bytes on any GPU. `QCORE_CUDA_FAST=0` picks the general kernels anywhere
    (tests, debugging). The simulator runs the fast kernels' Python twins, so it always can."""
    if (env or "1").strip() == "0":
        return False, "general kernels only (QCORE_CUDA_FAST=0)"
    if cc is not None and tuple(cc) < FAST_MIN_CC:
        return False, (f"general kernels only: the fast kernels need compute capability "
                       f"{FAST_MIN_CC[0]}.{FAST_MIN_CC[1]}+ (FP8 conversions), this GPU has {cc[0]}.{cc[1]}")
    return True, "fast kernels"


def fast_kernels_usable() -> tuple[bool, str]:
    """`fast_verdict` for the current device and environment; never raises."""
    from numba import config

    try:
        cc = None if config.ENABLE_CUDASIM else tuple(_cuda().get_current_device().compute_capability)
    except Exception as e:  # no usable device: the general kernels (which will report it)
        return False, f"general kernels only: compute capability unknown ({type(e).__name__}: {e})"
    return fast_verdict(cc, os.environ.get("QCORE_CUDA_FAST"))


def _is_device_array(x: Any) -> bool:
    return hasattr(x, "__cuda_array_interface__") or (
        hasattr(x, "copy_to_host") and hasattr(x, "shape") and hasattr(x, "dtype")
    )


def _torch_on_host(x: Any) -> bool:
    """Whether `x` is a torch tensor in host memory (a device kernel cannot write next to it)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor) and x.device.type == "cpu"


class CudaBackend(BaseBackend):
    """Numba-CUDA kernels; every scheme except LOOKUP (docs/spec.md, backends).

    Besides the Backend API, the paths (`paths/`) and the repeat calls (`_repeat.py`) use the
    device-level methods on this backend's tensors (`CudaData`) and arrays: `own`,
    `device_f32`, `kernel_data`, `decoded_scales`, `refresh_decoded`, `raise_if_bad_codes` and
    `launch_reorder`; and what it keeps between calls, `state` (`_state.CudaState`)."""

    name = "cuda"
    priority = 30
    # every extension of docs/spec.md but LOOKUP's midpoint code rule (cuda runs no LOOKUP scheme)
    scheme_features = {"round:rne", "round:mx", "recip", "signed", "codes:away", "codes:offset", "unsigned",
                       "min", "zero", "order:high", "order:split", "flat"}
    packs_field_orders = True  # k_order.k_reorder on the device (docs/spec.md, field orders)
    device = "cuda"  # where its tensors live (a torch device type: `qcore.Backend.device`)

    @functools.cached_property
    def _status(self) -> tuple[bool, str]:
        return cuda_status()

    @functools.cached_property
    def _checked_schemes(self) -> set:
        """Schemes `_own` has accepted for matmul's weight: later weights in them skip the check."""
        return set()

    @functools.cached_property
    def state(self) -> CudaState:
        """What this backend keeps between calls (`_state.CudaState`): the fast-kernel verdict
        (`fast_kernels_usable()`, read once), the device scratch and flags, the prepared plans
        and the repeat calls' decisions. The paths and the repeat calls read it."""
        return CudaState(FastVerdict(*fast_kernels_usable()))

    def available(self) -> bool:
        return self._status[0]

    @property
    def simulated(self) -> bool:
        """Whether the kernels run on numba's CUDA simulator (`NUMBA_ENABLE_CUDASIM=1`): correct,
        but minutes slower than a CPU backend, so `auto` tries it after every real one."""
        from numba import config

        return bool(config.ENABLE_CUDASIM)

    def describe(self) -> str:
        ok, why = self._status
        return f"{why}; {self.state.fast.why}" if ok else why

    def _supports(self, scheme: QuantScheme) -> Support:
        if scheme.is_lookup:
            return Support.no("LOOKUP (table) values have no cuda kernels; use the reference backend")
        return Support.yes()

    def own(self, q: Any) -> QTensor:
        """`q` checked as a tensor this backend runs: a QTensor of this backend (InputError
        otherwise, naming the way out) in a scheme it supports."""
        return self._own(q)

    # ------------------------------------------------------------------ inputs
    def _shape_dtype(self, x: Any) -> tuple[tuple[int, ...], np.dtype]:
        v = _array.view_of(x) if not isinstance(x, np.ndarray) else None
        if v is not None:
            return v.nd_shape, v.dtype
        if _is_device_array(x) and not isinstance(x, np.ndarray):
            cai = getattr(x, "__cuda_array_interface__", None)
            if cai is not None:
                return tuple(cai["shape"]), np.dtype(cai["typestr"])
            return tuple(x.shape), np.dtype(x.dtype)
        return super()._shape_dtype(x)

    def device_f32(self, x: Any, s: Any = _streams.DEFAULT):
        """A flat, contiguous float32 device array of `x`: zero-copy for contiguous float32 device
        arrays; float16/float64 device arrays are converted on the device (on stream `s`); host
        arrays copied."""
        cuda, K = _cuda(), _k()
        v = _array.view_of(x) if not isinstance(x, np.ndarray) else None
        if v is not None and v.dtype == np.float32:  # read in place: no numba array made
            return v.arg
        if _is_device_array(x) and not isinstance(x, np.ndarray):
            d = x if hasattr(x, "copy_to_host") else cuda.as_cuda_array(x)
            dt = check_input_dtype(d.dtype)
            if not d.is_c_contiguous():
                raise InputError("the cuda backend reads C-contiguous device arrays; pass x.contiguous() / a copy")
            flat = d.reshape(d.size)
            if dt == np.float32:
                return flat
            out = _array.empty((d.size,), np.float32, s)
            if d.size:
                kern = {np.dtype(np.float16): K.k_convert_f16, np.dtype(np.float64): K.k_convert_f64}.get(dt)
                if kern is None:
                    raise InputError(f"cuda device inputs of dtype {dt} are not read; convert to float32 first")
                _streams.on(kern, K.launch(d.size), s)(flat, out)
            return out
        return cuda.to_device(np.ascontiguousarray(to_f32(x)).reshape(-1), stream=s.numba)

    def _launch_quantize(self, xd, shape, scheme: QuantScheme, params: QParams | None, method: str, payload,
                         s: Any = _streams.DEFAULT):
        """Enqueue the quantize kernels writing `payload` on stream `s` (no host synchronisation):
        the first of `paths.QUANTIZE` that applies. Returns the mark after which the call's flag
        is final when that comes before its last kernel (`Scratch.early_marks`), else None."""
        pp = self.state.plans.get(shape, scheme, method)
        call = QuantizeCall(self, _k(), xd, shape, scheme, params, pp, payload, s)
        return choose(QUANTIZE, call).launch(call)

    def _run_quantize(self, x: Any, scheme: QuantScheme, params: QParams | None, method: str,
                      s: Any = _streams.DEFAULT, payload: Any = None):
        cuda = _cuda()
        shape = tuple(int(d) for d in self._shape_dtype(x)[0])
        xd = self.device_f32(x, s)
        if math.prod(shape) == 0:  # nothing to launch: qcore.spec.arithmetic builds the (scale-only) payload
            from qcore.spec import arithmetic

            data = arithmetic.quantize(np.zeros(shape, np.float32), scheme, params, method)
            got = np.frombuffer(data.payload, np.uint8).copy()
            if payload is None:
                return None, CudaData(shape, scheme, cuda.to_device(got, stream=s.numba))
            payload.copy_to_device(got, stream=s.numba)
            return None, CudaData(shape, scheme, payload)
        low = scheme.low_order  # the kernels pack the `low` order; k_reorder moves the fields (field orders)
        pl = self.state.plans.get(shape, low, method).plan
        if payload is None:
            payload, target = _array.empty_view((pl.total_nbytes,), np.dtype(np.uint8), s)
            target = target.arg
        else:
            target = payload
        low_target = target if low is scheme else _array.empty((pl.total_nbytes,), np.uint8, s)
        try:
            ready = self._launch_quantize(xd, shape, low, params, method, low_target, s)
        except BaseException:
            self.state.scratch.drop(s)  # the statistics may not have been consumed
            raise
        if low is not scheme:  # field orders: the fields moved into the scheme's order, the rest copied
            self.launch_reorder(low_target, target, shape, low, scheme, s)
        return (self.state.scratch.buffers(s).flag, xd, ready), CudaData(shape, scheme, payload)

    def launch_reorder(self, src, dst, shape: tuple[int, ...], src_scheme: QuantScheme, dst_scheme: QuantScheme,
                       s: Any = _streams.DEFAULT) -> None:
        """Enqueue k_reorder: dst = src's payload with the values' fields in dst_scheme's field order."""
        R, items = self.state.plans.order(shape, src_scheme, dst_scheme)
        if items:
            _streams.on(_k().k_reorder, _k().launch(items), s)(src, dst, R)

    def kernel_data(self, data: CudaData, s: Any = _streams.DEFAULT) -> CudaData:
        """`data` as the dequantize and matmul kernels read it: in the `low` field order. A tensor
        in another field order keeps a copy of its payload with the values re-packed, made once
        (and again when quantize `out=` rewrites the tensor)."""
        if data.scheme.store.order.value == "low":
            return data
        twin = data.cache.low
        if twin is None:
            low = data.scheme.low_order
            buf = _array.empty((int(data.payload.shape[0]),), np.uint8, s)
            self.launch_reorder(data.payload, buf, data.shape, data.scheme, low, s)
            twin = data.cache.low = CudaData(data.shape, low, buf)
        return twin

    @guard(lambda self, x, scheme, method: (f"calibrate a {_shape_of(self, x)} tensor",
                                             4 * _numel(self, x) + _payload_bytes(self, x, scheme)))
    def _calibrate(self, x: Any, scheme: QuantScheme, method: str) -> QParams:
        q = self._quantize(x, scheme, None, method)
        d = self._into_data(q)
        return QParams(d.scales(), d.global_scale(), d.offsets())

    @guard(lambda self, x, scheme, params, method, *_: (f"quantize a {_shape_of(self, x)} tensor to {scheme}",
                                                         4 * _numel(self, x) + _payload_bytes(self, x, scheme)))
    def _quantize(self, x: Any, scheme: QuantScheme, params: QParams | None, method: str,
                  s: Any = None, payload: Any = None) -> CudaData:
        if s is None:  # (the core's calls) the current stream of a torch or CuPy x, else the default
            s = _streams.resolve(None, x)
        check, data = self._run_quantize(x, scheme, params, method, s, payload)
        if check is not None:
            self.state.scratch.raise_if_flagged(check[0], check[1], data.shape, s, check[2])
        return data

    def calibrate(self, x: Any, scheme: QuantScheme | str, method: str = "minmax") -> QParams:
        with quiet():
            return super().calibrate(x, scheme, method)

    def quantize(self, x: Any, scheme: QuantScheme | str, *, params: QParams | None = None,
                 method: str = "minmax", out: Any = None, stream: Any = None) -> QTensor:
        """Quantize `x` (the spec's arithmetic), as every backend does, plus:

        * `out=`: write the payload into existing device memory, for loops that reuse it: a
          QTensor of this backend with the same shape and scheme (it is overwritten and returned;
          its cached decoded scales are refreshed), or a C-contiguous uint8 device array of the
          payload's byte length (`q.nbytes`), which the returned QTensor then uses.
        * `stream=`: the stream to run on (numba, torch or CuPy stream, or a cudaStream_t int);
          by default the current stream of a torch or CuPy `x`, else the default stream. The only
          wait is for that stream, then a 4-byte read of the non-finite flag; a two-pass scheme
          (per tensor, two-level) on the default stream with a float32 x on the device waits
          for its max pass alone and returns while the codes are written (docs/gpu.md).
        """
        if stream is None and params is None:
            q = _repeat.quantize_again(self, x, scheme, method, out)
            if q is not None:
                return q
        if out is None and stream is None:
            with quiet():
                q = super().quantize(x, scheme, params=params, method=method)
            if params is None:
                _repeat.remember_quantize(self, x, scheme, method, q)
            return q
        x = host_array(x)
        x_arg, scheme_arg, scheme = x, scheme, self._require(scheme)
        self._check_method(method, scheme)
        shape = self._check_input(x, scheme)
        if params is not None:
            params = self._check_params(params, shape, scheme)
        s = _streams.resolve(stream, x)
        x, inner, params = self._inner_call(x, shape, scheme, params)  # field orders, flat blocks: the hooks' form
        with quiet():
            target, payload = self._quantize_target(out, shape, scheme)
            data = self._quantize(x, inner, params, method, s, payload)
            if target is None and payload is not None:  # an out= array: the caller's memory
                data.mark_caller_memory()
            q = QTensor(self, scheme, shape, data) if target is None else target
            if target is not None:
                self.refresh_decoded(target.data, s)
        if stream is None and params is None:
            _repeat.remember_quantize(self, x_arg, scheme_arg, method, q)
        return q

    def _quantize_target(self, out: Any, shape: tuple, scheme: QuantScheme) -> tuple:
        """(QTensor or None, payload device array or None) for quantize's `out=`."""
        if out is None:
            return None, None
        if isinstance(out, QTensor):
            out = self._own(out)
            if tuple(out.shape) != tuple(shape) or out.scheme != scheme:
                raise InputError(f"quantize out= is a {out.scheme} QTensor of shape {tuple(out.shape)}; this call "
                                 f"makes {scheme} of shape {tuple(shape)}: pass a QTensor of that shape and scheme")
            return out, out.data.payload
        v = _array.check_out(out, (sections(shape, scheme).total,), (np.dtype(np.uint8),), "quantize")
        return None, v.numba()

    def refresh_decoded(self, data: CudaData, s: Any) -> None:
        """After new bytes went into a tensor's payload: decode its scales again into the arrays
        its cached launches point at (so those stay valid), through launches packed once per
        tensor and set of cached arrays (a loop that quantizes into one tensor pays a
        `cuLaunchKernel` each)."""
        data.cache.forget_values()  # (a linear's repeats live here, its kernels' data in the twin's)
        twin = data.cache.low
        if twin is not None:  # field orders: the kernels' copy, re-packed from the new bytes
            self.launch_reorder(data.payload, twin.payload, data.shape, data.scheme, twin.scheme, s)
            data = twin
        cache = data.cache
        if twin is not None:
            cache.forget_values()
        if cache.scales is None:
            return
        key = (cache.tc_scales is not None, cache.frag is not None, cache.linear_scales is not None)
        launches = cache.refresh.get(key)
        if launches is None:
            launches = cache.refresh[key] = self._refresh_launches(data)
        for launch in launches:
            launch(stream=s)

    def _refresh_launches(self, data: CudaData) -> tuple:
        """The packed launches that decode `data`'s scales into its cached arrays: the decoded
        scales (and global), then the tensor-core kernels' per-slot scales, the fragment GEMV's
        copy and a two-level weight's effective scales for `linear` where it has them."""
        K, plans = _k(), self.state.plans
        pp = plans.get(data.shape, data.scheme, "minmax")
        cache = data.cache
        scales, gbuf = cache.scales
        grid, block = K.launch(max(pp.plan.nslots, 1))
        launches = [Packed(K.k_decode_scales, grid, block, [data.payload, pp.P, scales, gbuf], dynamic=())]
        et = cache.tc_scales
        if et is not None:
            from . import tc

            (grid, block), args = tc.slot_scale_args(scales, gbuf, cache.gemv_geometry[1], et)
            launches.append(Packed(tc.k_slot_scales, grid, block, args, dynamic=()))
        fc = cache.frag
        if fc is not None:  # the fragment GEMV's copy of the codes and scales, packed again
            from . import frag

            for (grid, block), kern, args in frag.pack_launches(plans.code_words(data), scales, gbuf,
                                                                cache.gemv_geometry[1], frag.half_scales(data.scheme),
                                                                pp.plan.nslots, fc):
                launches.append(Packed(kern, grid, block, args, dynamic=()))
        es = cache.linear_scales
        if es is not None:  # (`paths.linear._effective_scales`' copy)
            from . import linear

            grid, block = K.launch(int(scales.size))
            launches.append(Packed(linear.k_effective, grid, block, [scales, gbuf, es, int(scales.size)], dynamic=()))
        return tuple(launches)

    # ------------------------------------------------------------------ dequantize
    def decoded_scales(self, data: CudaData, s: Any = _streams.DEFAULT):
        """Device float32 scales (and the global in gbuf[0]) of a payload, decoded once."""
        got = data.cache.scales
        if got is None:
            cuda, K = _cuda(), _k()
            pp = self.state.plans.get(data.shape, data.scheme, "minmax")
            nslots = pp.plan.nslots
            # the affine offsets follow the scales
            scales = cuda.device_array(max(nslots, 1) * (2 if data.scheme.affine else 1), dtype=np.float32)
            gbuf = cuda.device_array(1, dtype=np.float32)
            _streams.on(K.k_decode_scales, K.launch(nslots), s)(data.payload, pp.P, scales, gbuf)
            got = data.cache.scales = (scales, gbuf)
        return got

    def _launch_dequantize(self, data: CudaData, out, s: Any = _streams.DEFAULT) -> None:
        """Enqueue the dequantize kernels writing `out` (flat, C order) on stream `s`: the first
        of `paths.DEQUANTIZE` that applies."""
        data = self.kernel_data(data, s)
        scales, gbuf = self.decoded_scales(data, s)
        pp = self.state.plans.get(data.shape, data.scheme, "minmax")
        call = DequantizeCall(self, _k(), data, pp, out, scales, gbuf, self._code_flag(data), s, out.dtype == np.uint16)
        choose(DEQUANTIZE, call).launch(call)

    @staticmethod
    def _code_flag(data: CudaData):
        """The tensor's int32 flag (`_flags.new`), set by the dequantize kernels on a code outside
        the value's set (the spec's invalid codes); zero except between such a launch and `raise_if_bad_codes`."""
        flag = data.cache.code_flag
        if flag is None:
            flag = data.cache.code_flag = _flags.new()
        return flag

    def raise_if_bad_codes(self, data: CudaData, s: Any = _streams.DEFAULT) -> None:
        """Read the flag (`Scratch.read_flag`: 4 bytes, a wait for stream `s`); when set, re-zero it and
        let the core name the first bad element. A scheme whose every field is a value (q8f, q4f,
        q2f, e2m1) never sets it, and a tensor whose codes a dequantize has checked
        (`CudaData.codes_checked`) keeps them: no read, no wait."""
        if data.scheme.valid_fields.all() or data.codes_checked():
            return
        kd = self.kernel_data(data, s)
        flag = self._code_flag(kd)
        if self.state.scratch.read_flag(flag, s):
            _flags.clear(flag, s)
            self._into_data(kd).check_codes()
        else:
            data.note_codes_checked()

    @guard(lambda self, x, q: (f"measure the error of a {q.shape} {q.scheme} tensor", 8 * math.prod(q.shape)))
    def error_stats(self, x: Any, q: QTensor) -> tuple[float, float]:
        """(SQNR dB, max |err|) of `q` against `x` on the device (`Backend.error_stats`): dequantize
        into pool memory and reduce there (`k_error_partials`); only the grid's partial sums come back."""
        from qcore.backend.stats import sqnr_db

        K = _k()
        q = self._own(q)
        n = math.prod(q.shape)
        if n == 0:
            return sqnr_db(0.0, 0.0), 0.0
        with quiet():
            s = _streams.resolve(None, x)
            xd = self.device_f32(x, s)
            _, y = _array.empty_view((n,), np.dtype(np.float32), s)
            self._launch_dequantize(q.data, y.arg, s)
            self.raise_if_bad_codes(q.data, s)
            cfg = K.launch(n)
            parts = cfg[0] * cfg[1]
            sig, noise = (_array.empty((parts,), np.float64, s) for _ in range(2))
            mx = _array.empty((parts,), np.float32, s)
            _streams.on(K.k_error_partials, cfg, s)(xd, y.arg, sig, noise, mx)
            sig, noise, mx = (a.copy_to_host(stream=s.numba) for a in (sig, noise, mx))
            s.synchronize()  # the copies into pageable memory are done
        return sqnr_db(float(sig.sum()), float(noise.sum())), float(mx.max())

    @guard(lambda self, data, dtype, *_: (f"dequantize a {data.shape} {data.scheme} tensor to {dtype}",
                                          math.prod(data.shape) * max(4, dtype.itemsize)))
    def _dequantize(self, data: CudaData, dtype: np.dtype, out: Any = None, s: Any = _streams.DEFAULT) -> Any:
        n = math.prod(data.shape)
        if out is not None:
            v = _array.check_out(out, data.shape, (dtype,), "dequantize")
            if n:
                self._launch_dequantize(data, v.arg if dtype != _BF16 else _array.reinterpret(v.arg, np.uint16), s)
                self.raise_if_bad_codes(data, s)
            return out
        if not n:  # nothing to launch, whatever the other extents claim (the spec's size claims)
            return self._empty_output(tuple(data.shape), dtype, s)
        if dtype == _BF16:
            # numba has no bfloat16 device dtype: the bits made on the device, the array on the host
            bits = _array.empty((n,), np.uint16, s)
            self._launch_dequantize(data, bits, s)
            self.raise_if_bad_codes(data, s)
            return self.to_numpy(bits).view(_BF16).reshape(data.shape)
        res, v = _array.empty_view(tuple(data.shape), dtype, s)
        self._launch_dequantize(data, v.arg, s)
        self.raise_if_bad_codes(data, s)
        return res

    def dequantize(self, q: QTensor, dtype: Any = None, *, out: Any = None, stream: Any = None) -> Any:
        """`decode(q) * e` (the spec's dequantize) as a new device array (`QArray`: numba's array
        with DLPack; `.torch()` gives a torch tensor over it), or into `out=`, a C-contiguous torch,
        CuPy or numba device array of q's shape (or size) whose dtype (float32, float16, float64, or
        a torch bfloat16 tensor) is the result's; `out` is returned. A bfloat16 result without
        `out=` is made on the device and comes back as a host `ml_dtypes.bfloat16` array (numba has
        no bfloat16 device arrays). `stream=` as for `quantize` (default: the stream of a torch or
        CuPy `out`, else the default stream). `dtype` defaults to out's dtype, else float32. Where
        the scheme has invalid codes (docs/spec.md, invalid codes: Q8S/Q4S/Q2S, E4M3, E5M2), the
        tensor's first dequantize waits for that stream, after a 4-byte read of the invalid-code
        flag; later ones, other schemes, and tensors over a caller's out= array aside, return
        without waiting (`CudaData.codes_checked`)."""
        if stream is None and (dtype is None or dtype is np.float32):
            y = _repeat.dequantize_again(self, q, out)
            if y is not None:
                return y
        q = self._own(q)
        _k()  # the kernels, the memory pool and the disk cache, before the first allocation
        if dtype is None:
            dtype = _array.view_of(out).dtype if out is not None and _array.view_of(out) is not None else np.float32
        dt = check_output_dtype(dtype)
        with quiet(), self._naming_elements(q):
            y = self._dequantize(q.data, dt, out, _streams.resolve(stream, out))
        if stream is None and dt == np.float32:
            _repeat.remember_dequantize(self, q)
        return y if out is not None or tuple(y.shape) == q.shape else self._reshape_output(y, q.shape)

    def _reshape_output(self, y: Any, shape: tuple[int, ...]) -> Any:
        """A dequantized result in the tensor's shape (flat blocks): a QArray over the same memory."""
        from numba import config

        if config.ENABLE_CUDASIM or isinstance(y, np.ndarray):
            return y.reshape(shape)
        qa = _array.qarray_class()
        if isinstance(y, qa) and y.size:
            return qa.fast(tuple(shape), y.dtype, y.gpu_data, getattr(y, "_producer", 0))
        return y.reshape(shape)

    # ------------------------------------------------------------------ portable bytes
    def adopt(self, data: QuantizedData, payload: Any) -> QTensor:
        """A QTensor over device memory that already holds `data`'s payload: `payload` a flat
        uint8 torch, CuPy or numba device array of `len(data.payload)` bytes, read in place (no
        device copy; `qcore.nn.Linear` keeps its weight parameter as the payload this way).
        `data` is checked as `from_data` checks it; a scheme whose bytes this backend holds in
        another order (docs/spec.md's field orders, blocks over the flattened tensor) is copied
        as `from_data` copies it. The caller keeps the memory alive, and its bytes as `data`'s,
        for the tensor's life."""
        if not isinstance(data, QuantizedData):
            raise InputError(f"adopt takes a QuantizedData, got {type(data).__name__}")
        self._require(data.scheme)
        if self._inner_data(data) is not data:
            return self.from_data(data)
        v = _array.view_of(payload)
        if v is None or v.dtype != np.uint8 or v.size != len(data.payload):
            raise InputError(f"adopt takes the payload as a flat uint8 device array of {len(data.payload)} bytes, "
                             f"got {type(payload).__name__}"
                             + ("" if v is None else f" of {v.size} {v.dtype} elements"))
        arr = v.base if v._sim is not None else _cuda().as_cuda_array(v)
        return QTensor(self, data.scheme, data.shape, CudaData(data.shape, data.scheme, arr.reshape(v.size)))

    @guard(lambda self, data: (f"load a {data.shape} {data.scheme} payload", data.nbytes))
    def _from_data(self, data: QuantizedData) -> CudaData:
        buf = np.frombuffer(data.payload, dtype=np.uint8).copy()
        return CudaData(data.shape, data.scheme, _cuda().to_device(buf))

    def _into_data(self, data: CudaData) -> QuantizedData:
        return QuantizedData(data.shape, data.scheme, data.payload.copy_to_host().tobytes())

    def _payload_parts(self, data: CudaData) -> list[np.ndarray]:
        return [data.payload.copy_to_host()]  # (one copy from the device, none more)

    def _empty_output(self, shape: tuple[int, ...], dtype: np.dtype, s: Any = _streams.DEFAULT) -> Any:
        """An empty device array (bfloat16, which numba lacks: an empty host array)."""
        if dtype in _NUMBA_DTYPES:
            return _array.empty(shape, dtype, s)
        return np.zeros(shape, dtype=dtype)

    def to_numpy(self, array: Any) -> np.ndarray:
        if isinstance(array, np.ndarray):
            return array
        if hasattr(array, "copy_to_host"):
            return array.copy_to_host()
        if hasattr(array, "__cuda_array_interface__"):
            return _cuda().as_cuda_array(array).copy_to_host()
        return np.asarray(array)

    # ------------------------------------------------------------------ linear
    @guard(lambda self, x, w, *_a, **_k: (f"apply a {w.shape} {w.scheme} linear weight",
                                          4 * (_numel(self, x) // max(1, w.shape[-1]) * w.shape[0] + _numel(self, x))))
    def linear(self, x: Any, w: QTensor, bias: Any = None, *, out: Any = None, dtype: Any = None,
               stream: Any = None, act: Any = None) -> Any:
        """`x @ dequantize(w).T + bias` (docs/spec.md, "Products with a quantized weight") for a
        linear layer's weight `w` [N, K] as checkpoints store it and float `x` [..., K]: float16,
        bfloat16, float32 or float64, a torch, CuPy or numba device array or a host array.

        The result has x's dtype unless `dtype=` names another (or `out=` is given: a
        C-contiguous torch, CuPy or numba device array of the result's shape or size, float32,
        float16 or bfloat16 (torch), returned). It is a torch tensor for a torch x, else a device
        array (`QArray`); a bfloat16 result of a non-torch x comes back as a host
        `ml_dtypes.bfloat16` array. `stream=` as for `quantize`.

        Weights of 2-, 4- and 8-bit values with codes along K, K a multiple of 32 and one scale per
        tensor or blocks along K of 16 * 2**j (or at least K) take the tensor-core kernel
        (`linear.py`): the codes and 16-bit x exact as mma inputs, float32 x as three exact
        bfloat16 parts, the scales applied in f32 to each 32-k partial sum; results repeat bit
        for bit. Up to `paths.linear.DECODE_MAX_M` rows of x (decoding) the same weights take
        the decode kernel (`k_decode.py`: exact products on the CUDA cores, the scale applied
        to each unit's f32 sum, the same repeatability). Others are transposed once (kept with the weight) and go through `matmul`.
        bfloat16 x and result from `paths.linear.LIBRARY_FROM_M` rows of a torch CUDA x (bias
        bfloat16 or none) dequantize the weight to bfloat16 for the call and take torch's GEMM
        (docs/spec.md's bfloat16-weight rule), where that is faster than the kernels.

        `act=SCHEME` (e.g. `e4m3/block{K}:f32`) quantizes x per row on the device and multiplies by
        its decoded value; x may also be a QTensor of this backend (docs/spec.md, quantized
        activations; `_product_x`). An e4m3 weight with per-row (or per-tensor) f32 scales and
        per-row e4m3 activations with a bfloat16 result, from `LIBRARY_FROM_M` rows of a torch x,
        multiply code by code on torch's FP8 GEMM instead (`paths/fp8.py`, the FP8 accumulator rule
        of quantized activations); other calls with such activations and a bfloat16 torch x run
        x's codes (exact in bfloat16) on the kernels above and scale each row's f32 sums
        (`paths/act_codes.py`).
        """
        if _torch_on_host(x):
            return self._on_host_tensors(
                "linear", lambda xh, bh: self.linear(xh, w, bh, dtype=dtype, stream=stream, act=act), x, bias, out)
        if act is not None or isinstance(x, QTensor):
            from .paths import act_codes, fp8

            y = fp8.run(self, x, w, bias, act, out, dtype, stream)  # W8A8 on torch's FP8 GEMM, where it applies
            if y is None and act is not None:
                y = act_codes.run(self, x, w, bias, act, out, dtype, stream)  # x's codes on the weight-only kernels
            if y is not None:
                return y
            x, dtype = self._product_x("linear", x, w, act, dtype, stream)
        from .paths import linear as _linear_path
        from .paths.linear_repeat import again

        y = again(self, x, w, bias, out, dtype, stream)
        if y is not None:
            return y
        _k()  # the kernels, the memory pool and the disk cache, before the first allocation
        with quiet():
            return _linear_path.run(self, x, w, bias, out, dtype, stream)

    def _product_x(self, what: str, x: Any, w: QTensor, act: Any, dtype: Any, stream: Any = None) -> tuple[Any, Any]:
        """(x as the products read it, the result dtype) (docs/spec.md, quantized activations), on
        the device: a QTensor x dequantized here (float32); with `act`, x (read as float32, as
        `linear` reads it) quantized and dequantized by this backend's own kernels, `dtype=None`
        still meaning x's dtype, and a torch x handed on as a torch tensor over the decoded array,
        so the result is torch."""
        from qcore.backend import act as _act
        from qcore.backend.activations import as_torch, product_dims, torch_dtype_as_numpy

        w = self._own(w)
        if isinstance(x, QTensor):
            return self.dequantize(_act.given_x(self, what, x, w.shape, act), stream=stream), dtype
        torch = sys.modules.get("torch")
        is_torch = torch is not None and isinstance(x, torch.Tensor)
        shape, xdt = (tuple(x.shape), torch_dtype_as_numpy(x.dtype)) if is_torch else self._shape_dtype(x)
        if xdt is None or np.dtype(xdt) not in ACTIVATION_DTYPES:
            raise InputError(f"{what} needs a float x (float16, bfloat16, float32 or float64), got {xdt}")
        k_, _ = product_dims(what, shape, w.shape)
        scheme = _act.act_scheme(self, act, what, k_)
        if is_torch and x.dtype == torch.bfloat16:
            x = x.float()  # (read as float32: exact)
        elif isinstance(x, np.ndarray) and x.dtype != np.float32:
            x = x.astype(np.float32)  # (exact, or float64 rounded to nearest: as `linear` reads x)
        try:
            xd = self.dequantize(self.quantize(x, scheme, stream=stream), stream=stream)
        except InputError:
            xd = self._act_of_nonfinite(x, scheme, stream)
            if xd is None:  # refused for another reason
                raise
        return (as_torch(xd) if is_torch else xd), (xdt if dtype is None else dtype)

    def _act_of_nonfinite(self, x: Any, scheme: QuantScheme, stream: Any) -> Any | None:
        """`act`'s decoded x where `quantize` refused x (docs/spec.md, quantized activations: a
        non-finite x): read on the host, each row holding a non-finite value quantized as zeros and
        decoded as NaN, the decoded array back on the device; None where every value is finite."""
        from qcore.backend import act as _act

        torch = sys.modules.get("torch")
        host = x.float().cpu().numpy() if torch is not None and isinstance(x, torch.Tensor) else self.to_numpy(x)
        x32, bad = _act.finite_rows(np.asarray(host, np.float32))
        if bad is None:
            return None
        xd = _act.nan_rows(self.to_numpy(self.dequantize(self.quantize(x32, scheme, stream=stream), stream=stream)), bad)
        return _cuda().to_device(np.ascontiguousarray(xd, np.float32))

    def _on_host_tensors(self, what: str, call: Any, x: Any, bias: Any, out: Any) -> Any:
        """A product of a torch CPU x (a model kept on the CPU whose layers run here): x and a torch
        bias read as host arrays, the result copied back as a torch CPU tensor of its dtype."""
        from qcore.backend.activations import host_array, in_callers_kind

        if out is not None:
            raise InputError(f"{what} out= takes a device array; with a torch CPU x leave out= out")
        y = call(host_array(x), host_array(bias) if bias is not None else None)
        return in_callers_kind(self.to_numpy(y), True)

    # ------------------------------------------------------------------ fused matmul
    def matmul(self, x: Any, w: QTensor, *, out: Any = None, stream: Any = None, dtype: Any = np.float32,
               act: Any = None) -> Any:
        """`x @ dequantize(w)` with the weight dequantized inside the kernel.

        Orientation: `x` is float [..., K] (host or device), `w` a quantized [K, N] tensor on
        this backend (K = reduction axis, rows of w); the result is a float32 device array
        [..., N] (a `QArray`), accumulated in f32, or `out=`: a C-contiguous float32 torch, CuPy
        or numba device array of that shape (or size), returned. `stream=` as for `quantize`
        (default: the stream of a torch or CuPy `x`).

        Weights on the fast layout (codes along N; per-tensor or power-of-two blocks along N
        spanning a u32 word of codes) take the GEMV kernel (`gemv.py`), and from M = 4 on (N a
        multiple of 32, blocks of 32 columns or more, K >= 64 and a multiple of 4) the tensor-core
        kernel (`tc.py`: TF32 mma with x * e split in two, within the f32 accumulation bound):
        k-split partial sums added in a fixed order, so results repeat bit for bit. Other layouts
        take the general kernel: 8 output columns per thread, k-chunks summed in shared memory
        and added to the output with f32 atomics (the last bits may vary from run to run).

        `dtype=` other than float32 (None: x's dtype) rounds the f32 sums once to it, on the host
        for bfloat16 and float64 (a host array), on the device for float16.

        `act=` and a QTensor x: as for `linear` (docs/spec.md, quantized activations).
        """
        if _torch_on_host(x):
            return self._on_host_tensors(
                "matmul", lambda xh, _: self.matmul(xh, w, dtype=dtype, stream=stream, act=act), x, None, out)
        if act is not None or isinstance(x, QTensor):
            x, dtype = self._product_x("matmul", x, w, act, dtype, stream)
        if dtype is not np.float32 and (dtype is None or np.dtype(dtype) != np.float32):
            from qcore.backend.activations import result_dtype

            if out is not None:
                raise InputError("matmul out= is float32; leave dtype= out, or take linear(x, w_transposed, out=)")
            from .paths.linear import rounded

            y = self.matmul(x, w, stream=stream)
            dt = result_dtype(self._shape_dtype(x)[1] if not isinstance(x, np.ndarray) else x.dtype, dtype)
            return rounded(y, dt, _streams.resolve(stream, x))
        if stream is None:
            y = _repeat.matmul_again(self, x, w, out)
            if y is not None:
                return y
        y = self._matmul(x, w, out, stream)
        if stream is None:
            _repeat.remember_matmul(self, x, w)
        return y

    @guard(lambda self, x, w, *_: (f"multiply by a {w.shape} {w.scheme} weight",
                                   4 * (_numel(self, x) // max(1, w.shape[0]) * w.shape[-1] + _numel(self, x))))
    def _matmul(self, x: Any, w: QTensor, out: Any, stream: Any) -> Any:
        """`matmul` the whole way: the checks, the path choice or a packed launch."""
        if not (isinstance(w, QTensor) and w.backend is self and w.scheme in self._checked_schemes):
            w = self._own(w)  # the full check (backend, availability, scheme support), once per scheme
            self._checked_schemes.add(w.scheme)
        _k()  # the kernels, the memory pool and the disk cache, before the first allocation
        if len(w.shape) != 2:
            raise InputError(f"matmul needs a 2-D weight [K, N], got shape {w.shape}")
        if w.data.shape != w.shape:  # flat blocks that cross rows: the core's matmul
            return self._host_matmul(x, w, out, stream)
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16:
            x = x.float()  # (read as float32: exact)
        xv = _array.view_of(x)
        xshape, xdt = (xv.nd_shape, xv.dtype) if xv is not None else self._shape_dtype(x)
        if np.dtype(xdt) not in ACTIVATION_DTYPES:
            raise InputError(f"matmul needs a float x (float16, bfloat16, float32 or float64), got {xdt}")
        k_, n_ = w.shape
        if len(xshape) < 1 or xshape[-1] != k_:
            raise InputError(f"matmul shapes do not fit: x {tuple(xshape)} @ w {w.shape}")
        m = 1
        for d in xshape[:-1]:
            m *= d
        out_shape = tuple(xshape[:-1]) + (n_,)
        s = _streams.resolve(stream, x)
        if out is not None:
            ov = _array.check_out(out, out_shape, (np.dtype(np.float32),), "matmul")
            res = out
        elif m * n_:
            res, ov = _array.empty_view(out_shape, np.dtype(np.float32), s)
        else:
            return _array.empty(out_shape, np.float32, s)
        with quiet():
            if k_ == 0:
                ov.numba().copy_to_device(np.zeros(m * n_, np.float32), stream=s.numba)
                return res
            xd = xv.arg if xv is not None and xdt == np.float32 else self.device_f32(x, s)
            self._launch_matmul(xd, w.data, m, ov.arg, s)
        return res

    def _host_matmul(self, x: Any, w: QTensor, out: Any, stream: Any) -> Any:
        """`qcore.backend.ops.matmul` (the weight dequantized here, the product on the host), the result
        put on the device as `matmul` returns it: for weights no kernel reads in [K, N] form
        (blocks over the flattened tensor that cross rows, docs/spec.md)."""
        from qcore.backend import ops

        with quiet():
            y = np.ascontiguousarray(ops.matmul(self, self.to_numpy(x) if not isinstance(x, np.ndarray) else x, w),
                                     dtype=np.float32)
            s = _streams.resolve(stream, x)
            if out is not None:
                ov = _array.check_out(out, y.shape, (np.dtype(np.float32),), "matmul")
                ov.numba().copy_to_device(y.reshape(-1), stream=s.numba)
                s.synchronize()
                return out
            res = _array.empty(y.shape, np.float32, s)
            if y.size:
                res.copy_to_device(y, stream=s.numba)
                s.synchronize()
            return res

    def _launch_matmul(self, xd, data: CudaData, m: int, out, s: Any = _streams.DEFAULT) -> None:
        """Enqueue `out[m, N] = x[m, K] @ w` (x, out flat and C order) on stream `s`: a launch
        already packed for this weight and m at once (the host time of a decode step), else the
        first of `paths.MATMUL` that applies."""
        data = self.kernel_data(data, s)
        st = data.cache.gemv.get(m)
        if st is not None and packed_takes(xd):
            run_packed(st, xd, out, m, s)
            return
        scales, gbuf = self.decoded_scales(data, s)
        call = MatmulCall(self, _k(), xd, data, m, out, scales, gbuf, s)
        choose(MATMUL, call).launch(call)
