"""The `cuda` backend: Numba-CUDA kernels for every non-LOOKUP scheme (SPEC §4).

A quantized tensor lives on the device as its portable payload (SPEC §3): one uint8 device
array `[values][scales][global]` that the kernels write directly, so `into_data` is one copy to
the host and `from_data` one copy to the device. numba is imported lazily: importing this module
(and registering the backend) never touches a driver.
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from qcore.checks import check_input_dtype, raise_nonfinite, to_f32
from qcore.errors import InputError
from qcore.payload import QuantizedData, sections
from qcore.protocol import BaseBackend, QParams, QTensor, Support
from qcore.scheme import QuantScheme

from ._launch import Packed
from ._memory import guard

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
        from numba import cuda
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


@functools.lru_cache(maxsize=None)
def _k():
    from numba import config

    from . import kernels

    if config.ENABLE_CUDASIM:
        # The simulator runs one OS thread per CUDA thread and its barriers busy-wait under the
        # GIL; a shorter switch interval makes them 2-4x faster (docs/numba-cuda.md).
        # Only ever under the simulator, a testing mode.
        import sys
        import warnings

        sys.setswitchinterval(min(sys.getswitchinterval(), 5e-4))
        # The simulator evaluates masked-off lanes with NumPy scalars (0/0 of an empty group,
        # x / e overflowing to inf before the clamp), which NumPy reports as RuntimeWarnings;
        # a GPU computes the same values silently.
        warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"qcore_cuda\.")
    return kernels


def _cuda():
    from numba import cuda

    return cuda


def _shape_of(be: "CudaBackend", x: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in be._shape_dtype(x)[0])


def _numel(be: "CudaBackend", x: Any) -> int:
    return math.prod(_shape_of(be, x))


def _payload_bytes(be: "CudaBackend", x: Any, scheme: QuantScheme) -> int:
    return sections(_shape_of(be, x), scheme).total


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


def fast_aligned(a: Any) -> bool:
    """Whether the fast kernels' 16-byte vector accesses fit `a` (a numba device array)."""
    from . import fast

    return fast.aligned(a)


def _is_device_array(x: Any) -> bool:
    return hasattr(x, "__cuda_array_interface__") or (
        hasattr(x, "copy_to_host") and hasattr(x, "shape") and hasattr(x, "dtype")
    )


@dataclass(frozen=True)
class CudaData:
    """A quantized tensor on the device: its portable payload as one uint8 device array."""

    shape: tuple[int, ...]
    scheme: QuantScheme
    payload: Any  # numba device array, uint8, the SPEC §3 bytes
    cache: dict = field(default_factory=dict, compare=False, repr=False)  # decoded scales, matmul buffers


class CudaBackend(BaseBackend):
    """Numba-CUDA kernels; every scheme except LOOKUP (SPEC §4)."""

    name = "cuda"
    priority = 30

    @functools.cached_property
    def _status(self) -> tuple[bool, str]:
        return cuda_status()

    @functools.cached_property
    def _fast(self) -> tuple[bool, str]:
        """`fast_kernels_usable()`, read once per backend instance."""
        return fast_kernels_usable()

    def available(self) -> bool:
        return self._status[0]

    def describe(self) -> str:
        ok, why = self._status
        return f"{why}; {self._fast[1]}" if ok else why

    def _supports(self, scheme: QuantScheme) -> Support:
        if scheme.is_lookup:
            return Support.no("LOOKUP (table) values have no cuda kernels; use the reference backend")
        return Support.yes()

    # ------------------------------------------------------------------ inputs
    def _shape_dtype(self, x: Any) -> tuple[tuple[int, ...], np.dtype]:
        if _is_device_array(x) and not isinstance(x, np.ndarray):
            cai = getattr(x, "__cuda_array_interface__", None)
            if cai is not None:
                return tuple(cai["shape"]), np.dtype(cai["typestr"])
            return tuple(x.shape), np.dtype(x.dtype)
        return super()._shape_dtype(x)

    def _device_f32(self, x: Any):
        """A flat, contiguous float32 device array of `x`: zero-copy for contiguous float32 device
        arrays; float16/float64 device arrays are converted on the device; host arrays copied."""
        cuda, K = _cuda(), _k()
        if _is_device_array(x) and not isinstance(x, np.ndarray):
            d = x if hasattr(x, "copy_to_host") else cuda.as_cuda_array(x)
            dt = check_input_dtype(d.dtype)
            if not d.is_c_contiguous():
                raise InputError("the cuda backend reads C-contiguous device arrays; pass x.contiguous() / a copy")
            flat = d.reshape(d.size)
            if dt == np.float32:
                return flat
            out = cuda.device_array(d.size, dtype=np.float32)
            if d.size:
                kern = {np.dtype(np.float16): K.k_convert_f16, np.dtype(np.float64): K.k_convert_f64}.get(dt)
                if kern is None:
                    raise InputError(f"cuda device inputs of dtype {dt} are not read; convert to float32 first")
                kern[K.launch(d.size)](flat, out)
            return out
        return cuda.to_device(np.ascontiguousarray(to_f32(x)).reshape(-1))

    def _raise_if_flagged(self, flag, xd, shape) -> None:
        if int(flag.copy_to_host()[0]):
            self.__dict__.pop("_scr", None)  # fresh scratch (and flag) for the next call
            raise_nonfinite(xd.copy_to_host().reshape(shape))

    # ------------------------------------------------------------------ quantize
    def _scratch(self):
        """Persistent zeroed scratch on the device: f64 sum, f32 [g, max statistic, amax, -],
        int32 non-finite flag. k_quant re-zeroes the statistics after use; the flag is only
        ever set on an error, after which the scratch is rebuilt."""
        scr = self.__dict__.get("_scr")
        if scr is None:
            z = _cuda().to_device(np.zeros(4, dtype=np.float64))
            scr = self.__dict__["_scr"] = (z[0:1], z[1:3].view(np.float32), z[3:4].view(np.int32))
        return scr

    @functools.lru_cache(maxsize=16)
    def _prepared(self, shape: tuple[int, ...], scheme: QuantScheme, method: str):
        """Plan and its device arrays for one shape + scheme + method, built once."""
        from . import _plan

        cuda, K = _cuda(), _k()
        pl = _plan.plan(shape, scheme, method)
        P_explicit = pl.P.copy()
        P_explicit[K.M_MODE] = 1
        pp = dict(
            plan=pl, P=cuda.to_device(pl.P), F=cuda.to_device(pl.F), P_explicit=cuda.to_device(P_explicit),
            stored=cuda.device_array(pl.nslots, dtype=np.float32),
            raw=cuda.device_array(pl.nslots, dtype=np.float32),
            lut=cuda.to_device(_plan.lut(scheme)),
        )
        from . import fast

        fg = fast.geometry(shape, scheme, method) if self._fast[0] else None
        if fg is not None:  # the fast path (fast.py): calibrated mode and given-scales mode
            kind, G, C = fg
            Gg = G.copy()
            Gg[fast.G_MODE] = fast.MODE_GIVEN
            pp["fast"] = dict(kind=kind, G=cuda.to_device(G), G_given=cuda.to_device(Gg), C=cuda.to_device(C),
                              mode=int(G[fast.G_MODE]), nruns=int(G[fast.G_NRUNS]))
        if pl.TP is not None:
            pp["TP"] = cuda.to_device(pl.TP)
            pp["dummy32"] = cuda.device_array(1, dtype=np.uint32)
        if pl.RP is not None:
            for mode in (K.ROW_GIVEN, K.ROW_STATS):
                rp = pl.RP.copy()
                rp[K.R_MODE] = mode
                pp[("RP", mode)] = cuda.to_device(rp)
        return pp

    @staticmethod
    def _words(payload, pl):
        """The values section as the kernels' word array: uint32 for PackedU32, else bytes."""
        if int(pl.P[_k().M_WB]) == 4:
            return payload[: pl.values_nbytes].view(np.uint32)
        return payload[: pl.values_nbytes]

    def _fast_quant_launches(self, pp: dict, fp: dict, xd, qw32, payload, G, gbuf=None) -> tuple:
        """The fast path's (max pass, quantize, statistics reset) launches for this plan, scratch and
        `G` (calibrated or given mode), packed once (`_launch.Packed`): x and the payload change
        from call to call. Given explicit scales, `gbuf` is their device copy (new each call)."""
        from . import fast

        asum, fs, flag = self._scratch()
        key = ("fast_quant", id(G), gbuf is None)
        got = pp.get(key)
        if got is None or got[0] is not flag:  # a new scratch after a non-finite input: pack again
            qgrid, qtpb = fast.launch(fp["nruns"])
            gb = fs if gbuf is None else gbuf
            got = pp[key] = (flag, (
                Packed(fast.k_amax, qgrid, qtpb, [xd, fs, flag, fp["nruns"]], dynamic=(0,)),
                Packed(fast.quant_kernel(fp["kind"]), qgrid, qtpb, [xd, qw32, payload, pp["stored"], gb, flag, G,
                                                                    fp["C"]], dynamic=(0, 1, 2, 4)),
                Packed(_k().k_zero_stats, 1, 1, [asum, fs], dynamic=()),
            ))
        amax, quant, zero = got[1]
        if gbuf is None:
            return amax, quant, zero
        return amax, lambda x, w, p: quant(x, w, p, gbuf), zero

    def _launch_quantize(self, xd, shape, scheme: QuantScheme, params: QParams | None, method: str, payload):
        """Enqueue the quantize kernels writing `payload` (no host synchronisation)."""
        cuda, K = _cuda(), _k()
        n = int(np.prod(shape))
        pp = self._prepared(shape, scheme, method)
        pl = pp["plan"]
        asum, fs, flag = self._scratch()
        gbuf, P, F = fs, pp["P"], pp["F"]
        fp = pp.get("fast")
        fast_path = fp is not None and fast_aligned(xd)
        if fast_path:
            from . import fast

            qw32 = payload[: pl.values_nbytes].view(np.uint32)
            if params is None and fp["mode"] != fast.MODE_GIVEN:
                amax, quant, zero = self._fast_quant_launches(pp, fp, xd, qw32, payload, fp["G"])
                if fp["mode"] != fast.MODE_BLOCK:  # pass 1: the tensor's max |x| into gbuf[1]
                    amax(xd)
                quant(xd, qw32, payload)
                if fp["mode"] != fast.MODE_BLOCK:  # the statistics scratch is consumed: zero it
                    zero()
                return
        rows = pl.RP is not None and not fast_path
        if rows:
            words = self._words(payload, pl)
            grid, tpb = K.launch_rows(*pl.rows_shape)
        tiles = params is None and pl.TP is not None
        if tiles:
            w8 = payload[: pl.values_nbytes]
            w32 = w8.view(np.uint32) if pl.TP[K.T_U32] else pp["dummy32"]
            tgrid, ttpb = K.launch_tiles(int(pl.TP[K.T_NT]))
            if not scheme.two_level:
                K.k_tile_quant[tgrid, ttpb](xd, pp["TP"], F, w32, w8, payload, flag, pp["raw"], gbuf)
                return
        if params is None and pl.fused and not rows:
            K.k_quant_fused[K.launch(pl.nruns)](xd, P, F, payload, flag)
            return
        if params is not None:
            P = pp["P_explicit"]
            raw = cuda.to_device(np.ascontiguousarray(params.scales, dtype=np.float32).reshape(-1))
            gbuf = cuda.to_device(np.array([params.global_scale or 0.0, 0, 0, 0], dtype=np.float32))
        elif scheme.block is None:
            raw = fs[2:3]
            K.k_tensor_stats[K.launch(n)](xd, raw, asum, flag)
        else:
            raw = pp["raw"]
            if tiles:
                K.k_tile_quant[tgrid, ttpb](xd, pp["TP"], F, w32, w8, payload, flag, raw, gbuf)
            elif rows and pl.rows_stats:
                K.k_rows_quant[grid, tpb](xd, pp[("RP", K.ROW_STATS)], F, pp["stored"], gbuf, words, payload, flag,
                                          raw)
            else:
                K.k_slot_stats[K.launch(pl.nslots)](xd, P, raw, fs[1:2], flag)
        K.k_scales[K.launch(pl.nslots)](raw, asum, P, F, pp["stored"], gbuf, payload)
        if fast_path:
            _, quant, zero = self._fast_quant_launches(pp, fp, xd, qw32, payload, fp["G_given"], gbuf)
            quant(xd, qw32, payload)
            if params is None:  # the statistics scratch is consumed: zero it for the next call
                zero()
        elif rows:
            K.k_rows_quant[grid, tpb](xd, pp[("RP", K.ROW_GIVEN)], F, pp["stored"], gbuf, words, payload, flag,
                                      raw)
            if params is None:  # the statistics scratch is consumed: zero it for the next call
                K.k_zero_stats[1, 1](asum, gbuf)
        else:
            K.k_quant[K.launch(pl.nruns)](xd, P, F, pp["stored"], gbuf, payload, flag, asum)

    def _run_quantize(self, x: Any, scheme: QuantScheme, params: QParams | None, method: str):
        cuda = _cuda()
        shape = tuple(int(d) for d in self._shape_dtype(x)[0])
        xd = self._device_f32(x)
        if int(np.prod(shape)) == 0:  # nothing to launch: the reference builds the (scale-only) payload
            from qcore import arithmetic

            data = arithmetic.quantize(np.zeros(shape, np.float32), scheme, params, method)
            return None, CudaData(shape, scheme, cuda.to_device(np.frombuffer(data.payload, np.uint8).copy()))
        pl = self._prepared(shape, scheme, method)["plan"]
        payload = cuda.device_array(pl.total_nbytes, dtype=np.uint8)
        try:
            self._launch_quantize(xd, shape, scheme, params, method, payload)
        except BaseException:
            self.__dict__.pop("_scr", None)  # the statistics may not have been consumed
            raise
        return (self._scratch()[2], xd), CudaData(shape, scheme, payload)

    @guard(lambda self, x, scheme, method: (f"calibrate a {_shape_of(self, x)} tensor",
                                             4 * _numel(self, x) + _payload_bytes(self, x, scheme)))
    def _calibrate(self, x: Any, scheme: QuantScheme, method: str) -> QParams:
        q = self._quantize(x, scheme, None, method)
        d = self._into_data(q)
        return QParams(d.scales(), d.global_scale())

    @guard(lambda self, x, scheme, params, method: (f"quantize a {_shape_of(self, x)} tensor to {scheme}",
                                                     4 * _numel(self, x) + _payload_bytes(self, x, scheme)))
    def _quantize(self, x: Any, scheme: QuantScheme, params: QParams | None, method: str) -> CudaData:
        check, data = self._run_quantize(x, scheme, params, method)
        if check is not None:
            self._raise_if_flagged(check[0], check[1], data.shape)
        return data

    # ------------------------------------------------------------------ dequantize
    def _decoded_scales(self, data: CudaData):
        """Device float32 scales (and the global in gbuf[0]) of a payload, decoded once."""
        got = data.cache.get("scales")
        if got is None:
            cuda, K = _cuda(), _k()
            pp = self._prepared(data.shape, data.scheme, "minmax")
            nslots = pp["plan"].nslots
            scales = cuda.device_array(max(nslots, 1), dtype=np.float32)
            gbuf = cuda.device_array(1, dtype=np.float32)
            K.k_decode_scales[K.launch(nslots)](data.payload, pp["P"], scales, gbuf)
            got = data.cache["scales"] = (scales, gbuf)
        return got

    def _launch_dequantize(self, data: CudaData, out) -> None:
        K = _k()
        pp = self._prepared(data.shape, data.scheme, "minmax")
        pl = pp["plan"]
        scales, gbuf = self._decoded_scales(data)
        flag = self._code_flag(data)
        fp = pp.get("fast")
        if fp is not None and out.dtype == np.float32 and fast_aligned(out):
            from . import fast

            launch = data.cache.get("dequant")
            if launch is None:  # the output changes from call to call; the rest is packed once
                grid, block = fast.launch_dequant(fp["nruns"], fp["kind"])
                units = fast.unit_view(data.payload[: pl.values_nbytes], fp["kind"])
                launch = data.cache["dequant"] = Packed(fast.dequant_kernel(fp["kind"]), grid, block,
                                                        [units, scales, gbuf, pp["lut"], out, fp["G"], flag],
                                                        dynamic=(4,))
            launch(out)
        elif pl.RP is not None:
            grid, tpb = K.launch_rows(*pl.rows_shape)
            K.k_rows_dequant[grid, tpb](self._words(data.payload, pl), pp[("RP", K.ROW_GIVEN)], pp["lut"], scales,
                                        gbuf, out, flag)
        else:
            K.k_dequant[K.launch(pl.nruns)](data.payload, pp["P"], pp["lut"], scales, gbuf, out, flag)

    @staticmethod
    def _code_flag(data: CudaData):
        """The tensor's int32 device flag, set by the dequantize kernels on a code outside the
        value's set (SPEC v1.1 §3); zero except between such a launch and `_raise_if_bad_codes`."""
        flag = data.cache.get("code_flag")
        if flag is None:
            flag = data.cache["code_flag"] = _cuda().to_device(np.zeros(1, dtype=np.int32))
        return flag

    def _raise_if_bad_codes(self, data: CudaData) -> None:
        """Read the flag (4 bytes); when set, re-zero it and let the core name the first bad element."""
        flag = self._code_flag(data)
        if int(flag.copy_to_host()[0]):
            flag.copy_to_device(np.zeros(1, dtype=np.int32))
            self._into_data(data).check_codes()

    @guard(lambda self, x, q: (f"measure the error of a {q.shape} {q.scheme} tensor", 8 * math.prod(q.shape)))
    def error_stats(self, x: Any, q: QTensor) -> tuple[float, float]:
        """(SQNR dB, max |err|) of `q` against `x` on the device (qcore.stats.tensor_stats calls it):
        dequantize into device memory and reduce there; only the grid's partial sums come back."""
        from qcore.stats import sqnr_db

        cuda, K = _cuda(), _k()
        q = self._own(q)
        xd = self._device_f32(x)
        n = int(xd.size)
        if n == 0:
            return sqnr_db(0.0, 0.0), 0.0
        y = cuda.device_array(n, dtype=np.float32)
        self._launch_dequantize(q.data, y)
        self._raise_if_bad_codes(q.data)
        blocks, tpb = K.launch(n)
        sig, noise = (cuda.device_array(blocks * tpb, dtype=np.float64) for _ in range(2))
        mx = cuda.device_array(blocks * tpb, dtype=np.float32)
        K.k_error_partials[blocks, tpb](xd, y, sig, noise, mx)
        return sqnr_db(float(sig.copy_to_host().sum()), float(noise.copy_to_host().sum())), \
            float(mx.copy_to_host().max())

    @guard(lambda self, data, dtype: (f"dequantize a {data.shape} {data.scheme} tensor to {dtype}",
                                      math.prod(data.shape) * max(4, dtype.itemsize)))
    def _dequantize(self, data: CudaData, dtype: np.dtype) -> Any:
        cuda = _cuda()
        n = int(np.prod(data.shape))
        if dtype not in (np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.float64)):
            # bfloat16 has no numba device dtype: dequantize to f32 on the device, round on the host
            return self.to_numpy(self._dequantize(data, np.dtype(np.float32))).astype(dtype)
        out = cuda.device_array(n, dtype=dtype)
        if n:
            self._launch_dequantize(data, out)
            self._raise_if_bad_codes(data)
        return out.reshape(data.shape)

    # ------------------------------------------------------------------ portable bytes
    @guard(lambda self, data: (f"load a {data.shape} {data.scheme} payload", data.nbytes))
    def _from_data(self, data: QuantizedData) -> CudaData:
        buf = np.frombuffer(data.payload, dtype=np.uint8).copy()
        return CudaData(data.shape, data.scheme, _cuda().to_device(buf))

    def _into_data(self, data: CudaData) -> QuantizedData:
        return QuantizedData(data.shape, data.scheme, data.payload.copy_to_host().tobytes())

    def _payload_parts(self, data: CudaData) -> list[np.ndarray]:
        return [data.payload.copy_to_host()]  # (one copy from the device, none more)

    def _empty_output(self, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        """An empty device array (bfloat16, which numba lacks: an empty host array)."""
        if dtype in (np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.float64)):
            return _cuda().device_array(0, dtype=dtype).reshape(shape)
        return np.zeros(shape, dtype=dtype)

    def to_numpy(self, array: Any) -> np.ndarray:
        if isinstance(array, np.ndarray):
            return array
        if hasattr(array, "copy_to_host"):
            return array.copy_to_host()
        if hasattr(array, "__cuda_array_interface__"):
            return _cuda().as_cuda_array(array).copy_to_host()
        return np.asarray(array)

    # ------------------------------------------------------------------ fused matmul
    @guard(lambda self, x, w: (f"multiply by a {w.shape} {w.scheme} weight",
                               4 * (_numel(self, x) // max(1, w.shape[0]) * w.shape[-1] + _numel(self, x))))
    def matmul(self, x: Any, w) -> Any:
        """`x @ dequantize(w)` with the weight dequantized inside the kernel.

        Orientation: `x` is float [..., K] (host or device), `w` a quantized [K, N] tensor on
        this backend (K = reduction axis, rows of w); the result is a float32 device array
        [..., N], accumulated in f32.

        Weights on the fast layout (codes along N; per-tensor or power-of-two blocks along N
        spanning a u32 word of codes) take the GEMV kernel (`gemv.py`), and from M = 4 on (N a
        multiple of 32, blocks of 32 columns or more, K >= 64 and a multiple of 4) the tensor-core
        kernel (`tc.py`: TF32 mma with x * e split in two, within the f32 accumulation bound):
        k-split partial sums added in a fixed order, so results repeat bit for bit. Other layouts
        take the general kernel: 8 output columns per thread, k-chunks summed in shared memory
        and added to the output with f32 atomics (the last bits may vary from run to run).
        """
        w = self._own(w)
        if len(w.shape) != 2:
            raise InputError(f"matmul needs a 2-D weight [K, N], got shape {w.shape}")
        cuda = _cuda()
        xshape, xdt = self._shape_dtype(x)
        if np.dtype(xdt).kind != "f":
            raise InputError(f"matmul needs a float x, got {xdt}")
        k_, n_ = w.shape
        if len(xshape) < 1 or xshape[-1] != k_:
            raise InputError(f"matmul shapes do not fit: x {tuple(xshape)} @ w {w.shape}")
        m = int(np.prod(xshape[:-1]))
        out_shape = tuple(xshape[:-1]) + (n_,)
        out = cuda.device_array(m * n_, dtype=np.float32)
        if m == 0 or n_ == 0:
            return out.reshape(out_shape)
        if k_ == 0:
            return cuda.to_device(np.zeros(m * n_, np.float32)).reshape(out_shape)
        xd = self._device_f32(x)
        self._launch_matmul(xd, w.data, m, out)
        return out.reshape(out_shape)

    def _launch_gemv(self, xd, data: CudaData, m: int, out, scales, gbuf) -> bool:
        """The GEMV kernels when the weight's layout allows them (tc.py for M >= tc.MIN_M where
        it applies, else gemv.py); False otherwise."""
        from . import gemv, tc

        if not self._fast[0]:
            return False
        if "gemv" not in data.cache:
            data.cache["gemv"] = gemv.geometry(data.shape, data.scheme)
        gg = data.cache["gemv"]
        if gg is None or not fast_aligned(xd):
            return False
        key = ("gemv", m)
        st = data.cache.get(key)
        if st is None:
            kind, Q = gg
            pp = self._prepared(data.shape, data.scheme, "minmax")
            extra = []
            if tc.use_for(m) and tc.applies(Q):
                kern, mb, q, grid, block, part, cnt = tc.buffers(Q, kind, m)
                if "tc_scales" not in data.cache:
                    data.cache["tc_scales"] = tc.slot_scales(scales, Q)
                extra = [data.cache["tc_scales"]]
            else:
                kern, mb, q, grid, block, part, cnt = gemv.buffers(Q, kind, m)
            w32 = data.payload[: pp["plan"].values_nbytes].view(np.uint32)
            # x, out, m0 and the row count change from call to call; the rest is packed once
            st = data.cache[key] = (mb, Packed(kern, grid, block, [xd, w32, scales, gbuf, pp["lut"], part, cnt, out, q,
                                                                   0, mb] + extra, dynamic=(0, 7, 9, 10)))
        mb, launch = st
        for m0 in range(0, m, mb):
            launch(xd, out, m0, min(mb, m - m0))
        return True

    def _launch_matmul(self, xd, data: CudaData, m: int, out) -> None:
        from . import _plan

        cuda, K = _cuda(), _k()
        scales, gbuf = self._decoded_scales(data)
        if self._launch_gemv(xd, data, m, out, scales, gbuf):
            return
        key = ("matmul", m)
        mm = data.cache.get(key)
        if mm is None:
            from numba import config

            pl = self._prepared(data.shape, data.scheme, "minmax")["plan"]
            Q = _plan.matmul_geometry(data.shape, data.scheme, m, sim=bool(config.ENABLE_CUDASIM))
            nb4 = pl.values_nbytes // 4
            p32 = data.payload[: nb4 * 4].view(np.uint32) if Q[K.Q_W32] and nb4 else \
                cuda.device_array(1, dtype=np.uint32)
            mm = data.cache[key] = dict(
                Q=cuda.to_device(Q), launch=K.launch_matmul(int(Q[K.Q_NG]), int(Q[K.Q_KC]), m),
                lut=self._prepared(data.shape, data.scheme, "minmax")["lut"], p32=p32,
            )
        K.k_zero[K.launch(out.size)](out)
        grid, block = mm["launch"]
        K.k_matmul[grid, block](xd, data.payload, mm["p32"], mm["Q"], mm["lut"], scales, gbuf, out)
