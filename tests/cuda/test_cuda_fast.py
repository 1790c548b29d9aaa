"""The fast kernels (qcore_cuda/fast.py) and the general kernels on the same layout, against
the reference bit for bit."""
from __future__ import annotations

import os

import numpy as np
import pytest

import qcore
from qcore.errors import InputError
from qcore.backend.reference import ReferenceBackend

from tests.cuda_cases import SIM, FLOAT_VALUES, INT_VALUES, sample_x, assert_same_bytes

REF = ReferenceBackend()
# numba after conftest.py has chosen the simulator or the GPU.
from numba import cuda  # noqa: E402


# The fast path (qcore_cuda/fast.py): lines of whole runs of 16 elements, codes along the last
# axis, per-tensor or power-of-two blocks along the last axis. Every value, every mode (BLOCK,
# TWO, TENSOR calibrated; GIVEN for explicit params, absmean and blocks under 16), dequantize.
QUAD_LEVELS = ["", "tensor:bf16", "block16:f16", "block32:ue8m0", "block128:f32", "block4:ue4m3/tensor:f32",
               "block32:f16/tensor:f32", "block8:bf16", "block512:ue4m3", "block64:f16/tensor:f32"]
# Sub-byte values with both stores (on the simulator: the stores alternate over the levels).
QUAD_SCHEMES = ["/".join(p for p in (v, lv, st) if p)
                for v in INT_VALUES + FLOAT_VALUES for i, lv in enumerate(QUAD_LEVELS)
                for st in ([""] if qcore.scheme(v).bits == 8 else ["", "packed_native"][i % 2:i % 2 + 1] if SIM
                           else ["", "packed_native"])]


@pytest.mark.parametrize("text", QUAD_SCHEMES)
def test_fast_path_bit_exact(cuda_backend, text):
    from qcore_cuda import fast

    shape = (2, 512)
    assert fast.geometry(shape, qcore.scheme(text)) is not None
    x = sample_x(shape, seed=len(text))
    x[1, 256:384] *= 1e-30  # tiny blocks: scale round-up near the bottom of each scale dtype
    for params, method in ((None, "minmax"), (REF.calibrate(x, text), "minmax"), (None, "absmean")):
        got = cuda_backend.into_data(cuda_backend.quantize(x, text, params=params, method=method))
        want = REF.into_data(REF.quantize(x, text, params=params, method=method))
        assert_same_bytes(got.payload, want.payload, f"fast payload of {text} (params={params is not None}, {method})")
    y = cuda_backend.to_numpy(cuda_backend.dequantize(cuda_backend.from_data(want)))
    np.testing.assert_array_equal(y.view(np.uint32), REF.dequantize(REF.from_data(want)).view(np.uint32))


# One scheme per value kind and mode of the fast layout, and a GEMV weight.
GENERAL_SCHEMES = ["q8s/block32:f16", "q4s/block32:f16", "q2f/block16:bf16/packed_native", "e4m3/block32:f32",
                   "e5m2/tensor:bf16", "nvfp4", "q8s", "q8f/block8:ue8m0", "e2m1/block32:ue8m0"]


@pytest.fixture(scope="module")
def general_backend():
    """A cuda backend that runs only the general kernels (QCORE_CUDA_FAST=0), as on a GPU below
    compute capability 8.9."""
    from qcore_cuda import CudaBackend

    old = os.environ.get("QCORE_CUDA_FAST")
    os.environ["QCORE_CUDA_FAST"] = "0"
    try:
        be = CudaBackend()
        assert be.describe().endswith("general kernels only (QCORE_CUDA_FAST=0)")
    finally:
        if old is None:
            del os.environ["QCORE_CUDA_FAST"]
        else:
            os.environ["QCORE_CUDA_FAST"] = old
    return be


@pytest.mark.parametrize("text", GENERAL_SCHEMES)
def test_general_kernels_on_the_fast_layout(cuda_backend, general_backend, text):
    """Without the fast kernels, tensors on their layout go through the general kernels: same
    bytes as reference (calibrated, given params, absmean), same dequantized bits, and a matmul
    without the GEMV kernel."""
    from qcore_cuda import fast
    from qcore_cuda.paths import TAKEN

    shape = (4, 64)
    s = qcore.scheme(text)
    assert fast.geometry(shape, s) is not None
    x = sample_x(shape, seed=len(text))
    before = TAKEN.copy()
    cuda_backend.dequantize(cuda_backend.quantize(x, text))
    assert "FastDequantize" in TAKEN - before  # the default backend takes the fast kernels
    before = TAKEN.copy()
    for params, method in ((None, "minmax"), (REF.calibrate(x, text), "minmax"), (None, "absmean")):
        got = general_backend.into_data(general_backend.quantize(x, text, params=params, method=method))
        want = REF.into_data(REF.quantize(x, text, params=params, method=method))
        assert_same_bytes(got.payload, want.payload, f"general payload of {text} (params={params is not None}, {method})")
    want = REF.into_data(REF.quantize(x, text))
    qw = general_backend.from_data(want)
    y = general_backend.to_numpy(general_backend.dequantize(qw))
    np.testing.assert_array_equal(y.view(np.uint32), REF.dequantize(REF.from_data(want)).view(np.uint32))
    xm = sample_x((2, 4), seed=3, scale=1.0)
    got = general_backend.to_numpy(general_backend.matmul(xm, qw))
    taken = set(TAKEN - before)
    assert not {"FastQuantize", "FastDequantize", "GemvMatmul", "TensorCoreMatmul"} & taken, taken
    assert "GeneralMatmul" in taken
    ref = xm.astype(np.float64) @ REF.dequantize(REF.from_data(want)).astype(np.float64)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


@pytest.mark.parametrize("offset", [0, 1, 2, 4])
@pytest.mark.parametrize("text", ["q8s/block32:f16", "nvfp4", "e4m3"])
def test_fast_path_unaligned_device_input(cuda_backend, text, offset):
    """A device view starting `offset` floats into its allocation: 16-byte aligned views take
    the fast kernels, the others the general ones; both bit-exact (on a GPU; the simulator has
    no alignment)."""

    x = sample_x((2, 64), seed=offset)
    base = cuda.to_device(np.concatenate([np.zeros(offset, np.float32), x.reshape(-1)]))
    view = base[offset:].reshape(2, 64)
    got = cuda_backend.into_data(cuda_backend.quantize(view, text))
    want = REF.into_data(REF.quantize(x, text))
    assert_same_bytes(got.payload, want.payload, f"{text} from a view at +{offset} floats")
    out = cuda_backend.to_numpy(cuda_backend.dequantize(cuda_backend.from_data(want)))
    np.testing.assert_array_equal(out.view(np.uint32), REF.dequantize(REF.from_data(want)).view(np.uint32))


@pytest.mark.parametrize("shape, text", [((2, 36), "q4s/block4:f16"), ((2, 64), "q4s/block2x32:f16"),
                                         ((2, 64), "q4s/packed_u32:1"), ((2, 64), "q8s/block48:f16"),
                                         ((0, 64), "q8s"), ((2, 64), "nf4")])
def test_fast_path_not_taken_when_layout_differs(shape, text):
    from qcore_cuda import fast

    assert fast.geometry(shape, qcore.scheme(text)) is None


@pytest.mark.parametrize("text", ["q4s/block32:f16", "q8s", "nvfp4", "e4m3/block32:f32", "q8s/block8:f16"])
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_fast_path_flags_non_finite(cuda_backend, text, bad):
    x = np.ones((2, 64), np.float32)
    x[1, 33] = bad
    with pytest.raises(InputError, match=r"(inf|nan) at index \(1, 33\)"):
        cuda_backend.quantize(x, text)
    q = cuda_backend.quantize(np.ones((2, 64), np.float32), text)  # the scratch is clean afterwards
    assert_same_bytes(cuda_backend.into_data(q).payload, REF.into_data(REF.quantize(np.ones((2, 64), np.float32), text)).payload,
                      f"{text} after a non-finite input")


@pytest.mark.parametrize("text", ["nvfp4", "q8s", "e4m3/tensor:bf16", "q4s/block32:f16"])
def test_fast_quantize_over_several_grid_strides(cuda_backend, text):
    """More runs than the grid has threads, and a last warp of runs only partly inside the
    tensor: every thread takes several steps, each loading the next step's run first. The bytes
    are the reference's, and a NaN in the first and in the last run is found (one and two
    passes)."""
    from qcore_cuda import fast

    grid, tpb = max(fast.launch(1 << 40, n) for n in (*fast.QUANT_PER_SM, fast.AMAX_PER_SM))  # the quantize and max passes
    runs = 2 * grid * tpb + 32 * 3 + 11  # two whole strides of each, then three warps and 11 runs
    cols = 32 * 3 if SIM else 32 * 35  # lines of whole 32-blocks, not of whole warps of runs
    rows = -(-runs * 16 // cols)
    assert fast.geometry((rows, cols), qcore.scheme(text)) is not None and (rows * cols // 16) % 32
    x = sample_x((rows, cols), seed=7)
    got = cuda_backend.into_data(cuda_backend.quantize(cuda.to_device(x), text))
    assert_same_bytes(got.payload, REF.into_data(REF.quantize(x, text)).payload, f"{text} over {rows * cols // 16} runs")
    for at in ((0, 3), (rows - 1, cols - 1)):
        bad = x.copy()
        bad[at] = np.nan
        with pytest.raises(InputError, match=rf"nan at index \({at[0]}, {at[1]}\)"):
            cuda_backend.quantize(cuda.to_device(bad), text)
