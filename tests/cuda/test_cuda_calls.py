"""The `cuda` backend's calls: `out=` buffers, streams, interop, the memory pool, the disk cache,
and no numba warnings reaching users (backends/cuda/qcore_cuda: _array, _streams, _pool,
_diskcache, _quiet; docs/gpu.md "Calls").

Under the simulator (CI) the buffer and stream cases run on tiny tensors; the pool, DLPack,
torch/CuPy streams, the disk cache and numba's warnings exist only on a GPU, so those cases skip
there with the reason.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

import qcore
from qcore.conformance.invalid import with_code
from qcore.errors import InputError, InvalidDataError
from qcore.backend.reference import ReferenceBackend

from tests.cuda_cases import SIM, assert_same_floats, sample_x

pytest.importorskip("numba")
pytest.importorskip("qcore_cuda")

from numba import cuda  # noqa: E402

GPU_ONLY = pytest.mark.skipif(SIM, reason="needs a GPU: the simulator has no memory pool, DLPack, torch/CuPy "
                                          "streams, compiled kernels to cache, or numba launch warnings")
REF = ReferenceBackend()
W4 = "q4s/block32:f16"


@pytest.fixture
def be(cuda_backend):
    return cuda_backend


# ----------------------------------------------------------------------------- out=
@pytest.mark.parametrize("text", [W4, "q8s", "nvfp4"])
def test_dequantize_into_out(be, text):
    x = sample_x((4, 64), seed=1)
    q = be.quantize(x, text)
    want = REF.dequantize(REF.quantize(x, text))
    out = cuda.device_array((4, 64), dtype=np.float32)
    got = be.dequantize(q, out=out)
    assert got is out
    assert_same_floats(out.copy_to_host(), want, f"{text} into out=")
    flat16 = cuda.device_array(256, dtype=np.float16)  # the element count is enough; dtype from out
    be.dequantize(q, out=flat16)
    np.testing.assert_array_equal(flat16.copy_to_host().reshape(4, 64), want.astype(np.float16))


def test_dequantize_out_is_checked(be):
    q = be.quantize(sample_x((4, 64), seed=2), W4)
    for bad, msg in ((cuda.device_array((4, 32), np.float32), "shape"),
                     (cuda.device_array((4, 64), np.int32), "int32"),
                     (np.zeros((4, 64), np.float32), "device array")):
        with pytest.raises(InputError, match=msg):
            be.dequantize(q, out=bad)
    with pytest.raises(InputError, match="dtype"):
        be.dequantize(q, np.float16, out=cuda.device_array((4, 64), np.float32))


@pytest.mark.parametrize("m", [1, 3])
def test_matmul_into_out(be, m):
    w = sample_x((64, 64), seed=3)
    qw = be.quantize(w, W4)
    x = sample_x((m, 64), seed=4, scale=1.0)
    plain = be.to_numpy(be.matmul(cuda.to_device(x), qw))
    out = cuda.device_array((m, 64), dtype=np.float32)
    assert be.matmul(cuda.to_device(x), qw, out=out) is out
    assert_same_floats(out.copy_to_host(), plain, "matmul into out=")
    want = x.astype(np.float64) @ REF.dequantize(REF.quantize(w, W4)).astype(np.float64)
    np.testing.assert_allclose(plain, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    with pytest.raises(InputError, match="dtype"):
        be.matmul(cuda.to_device(x), qw, out=cuda.device_array((m, 64), np.float16))


def test_quantize_into_a_qtensor(be):
    """Quantizing into an existing QTensor overwrites its payload and refreshes what dequantize
    and matmul cached from the old one (decoded scales)."""
    x1, x2 = sample_x((64, 64), seed=5), sample_x((64, 64), seed=6, scale=0.1)
    q = be.quantize(x1, W4)
    v = cuda.to_device(sample_x((1, 64), seed=7, scale=1.0))
    be.dequantize(q)
    be.matmul(v, q)  # both cache the decoded scales of x1
    again = be.quantize(cuda.to_device(x2), W4, out=q)
    assert again is q
    assert be.into_data(q).payload == REF.into_data(REF.quantize(x2, W4)).payload
    W2 = REF.dequantize(REF.quantize(x2, W4))
    assert_same_floats(be.to_numpy(be.dequantize(q)), W2, "dequantize after quantize(out=q)")
    got = be.to_numpy(be.matmul(v, q))
    want = v.copy_to_host().astype(np.float64) @ W2.astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    with pytest.raises(InputError, match="shape and scheme"):
        be.quantize(sample_x((4, 64), seed=8), W4, out=q)
    with pytest.raises(InputError, match="shape and scheme"):
        be.quantize(x1, "q8s/block32:f16", out=q)


def test_quantize_into_a_byte_buffer(be):
    x = sample_x((4, 64), seed=9)
    want = REF.into_data(REF.quantize(x, "nvfp4")).payload
    buf = cuda.device_array(len(want), dtype=np.uint8)
    q = be.quantize(x, "nvfp4", out=buf)
    assert buf.copy_to_host().tobytes() == want
    assert be.into_data(q).payload == want
    with pytest.raises(InputError, match="shape"):
        be.quantize(x, "nvfp4", out=cuda.device_array(len(want) + 1, dtype=np.uint8))


@pytest.mark.parametrize("text", ["q4s/block32:f16", "e4m3", "q2s/packed_u32:1"])
def test_invalid_codes_raise_with_out_and_stream(be, text, monkeypatch):
    """dequantize into `out=` and on a given stream reads the tensor's invalid-code flag too
    (docs/spec.md, invalid codes): InvalidDataError naming the element, then the same tensor raises
    again and a clean one decodes; a scheme whose every code is a value reads nothing back."""
    x = sample_x((4, 64), seed=20)
    d = REF.quantize(x, text).to_data()
    field = int(np.flatnonzero(~d.scheme.valid_fields)[-1])
    q = be.from_data(with_code(d, (2, 9), field))
    out = cuda.device_array((4, 64), dtype=np.float32)
    st = cuda.stream()
    for kwargs in ({"out": out}, {"stream": st}, {"out": out, "stream": st}):
        with pytest.raises(InvalidDataError, match=r"element \(2, 9\)"):
            be.dequantize(q, **kwargs)
    y = be.dequantize(be.from_data(d), out=out, stream=st)
    st.synchronize()
    assert_same_floats(y.copy_to_host(), REF.dequantize(REF.from_data(d)), f"{text} after an invalid code")
    clean = be.quantize(x, "q4f/block32:f16")
    scratch = be.state.scratch
    seen, real = [], scratch.read_flag
    monkeypatch.setattr(scratch, "read_flag", lambda flag, s, ready=None: seen.append(flag) or real(flag, s, ready))
    be.dequantize(clean, out=out)
    assert seen == [], "a scheme without invalid codes read its flag back"


# ----------------------------------------------------------------------------- early flag reads
def _count_waits(monkeypatch, be) -> dict:
    """Count the stream synchronisations and the waits on each `_flags.Mark` (by role)."""
    from qcore_cuda import _flags, _scratch

    seen = {"stream": 0, "flag": 0, "tail": 0}
    sync, wait = _scratch.sync_stream, _flags.Mark.wait

    def counted_sync(handle):
        seen["stream"] += 1
        return sync(handle)

    def counted_wait(mark):
        seen["tail" if mark is be.state.scratch.tail_mark else "flag"] += 1
        return wait(mark)

    _scratch.sync_stream(0)  # (looks the driver call up before it is wrapped)
    be.state.scratch.wait_tail(None)  # an earlier test's early call: done before the counting starts
    monkeypatch.setattr(_scratch, "sync_stream", counted_sync)
    monkeypatch.setattr(_flags.Mark, "wait", counted_wait)
    return seen


@GPU_ONLY
@pytest.mark.parametrize("text", ["nvfp4", "q8s", "q4s/block32:f16"])
def test_two_pass_quantize_waits_for_its_max_pass_alone(be, text, monkeypatch):
    """The max pass flags every non-finite x, so a two-pass quantize on the default stream of x
    in the caller's device memory reads its flag after that pass and returns while the codes
    are written (the whole way and repeats); one-pass schemes, a host x (a temporary device
    copy) and a call on another stream wait for the stream. The bytes are the reference's."""
    x = sample_x((64, 256), seed=12)
    want = REF.quantize(x, text).to_data().payload
    seen = _count_waits(monkeypatch, be)
    two_pass = text != "q4s/block32:f16"
    for _ in range(3):
        q = be.quantize(cuda.to_device(x), text)
        assert q.to_data().payload == want, f"{text}: other bytes"
    assert seen == ({"stream": 0, "flag": 3, "tail": 0} if two_pass else {"stream": 3, "flag": 0, "tail": 0}), seen
    seen.update(stream=0, flag=0)
    assert be.quantize(x, text).to_data().payload == want
    assert seen == {"stream": 1, "flag": 0, "tail": 0}, f"a host x: {seen}"
    seen.update(stream=0)
    st = cuda.stream()
    q = be.quantize(cuda.to_device(x), text, stream=st)
    assert seen == {"stream": 1, "flag": 0, "tail": int(two_pass)}, f"another stream: {seen}"  # (after the tail)
    assert q.to_data().payload == want


@GPU_ONLY
def test_a_call_on_another_stream_waits_for_an_early_calls_tail(be, monkeypatch):
    """After a two-pass quantize returned with its codes still being written, a call on another
    stream first waits for that call's last kernels (the statistics scratch they share), one on
    the same stream does not; and a NaN found after the max pass waits for the stream before
    the scratch is rebuilt. All results are the reference's."""
    x = sample_x((512, 1024), seed=13)
    xd = cuda.to_device(x)
    want = REF.quantize(x, "nvfp4").to_data().payload
    other = cuda.stream()
    seen = _count_waits(monkeypatch, be)
    q1 = be.quantize(xd, "nvfp4")
    q2 = be.quantize(xd, "nvfp4")
    assert seen == {"stream": 0, "flag": 2, "tail": 0}, f"two early calls on one stream: {seen}"
    q3 = be.quantize(xd, "nvfp4", stream=other)
    assert seen["tail"] == 1, "a call on another stream did not wait for the early call's tail"
    assert q1.to_data().payload == q2.to_data().payload == q3.to_data().payload == want
    bad = x.copy()
    bad[300, 5] = np.nan
    be.quantize(xd, "nvfp4")
    with pytest.raises(InputError, match=r"nan at index \(300, 5\)"):
        be.quantize(cuda.to_device(bad), "nvfp4")
    assert be.quantize(xd, "nvfp4").to_data().payload == want, "after a NaN"


# ----------------------------------------------------------------------------- streams
def test_calls_on_a_given_stream(be):
    x = sample_x((4, 64), seed=10)
    st = cuda.stream()
    q = be.quantize(cuda.to_device(x), W4, stream=st)
    y = be.dequantize(q, stream=st)
    st.synchronize()
    assert_same_floats(be.to_numpy(y), REF.dequantize(REF.quantize(x, W4)), "dequantize on a stream")
    with pytest.raises(InputError, match="stream="):
        be.dequantize(q, stream="default")


def test_stream_handles(be):
    """What `stream=` accepts: an int handle, torch's `.cuda_stream`, CuPy's `.ptr` (here each the
    default stream's 0), or None; anything else is an InputError naming the kinds."""

    class TorchLike:
        cuda_stream = 0

    class CupyLike:
        ptr = 0

    x = sample_x((4, 64), seed=11)
    want = REF.dequantize(REF.quantize(x, W4))
    for st in (0, TorchLike(), CupyLike(), None):
        q = be.quantize(cuda.to_device(x), W4, stream=st)
        assert_same_floats(be.to_numpy(be.dequantize(q, stream=st)), want, f"stream={st!r}")
    with pytest.raises(InputError, match="cudaStream_t"):
        be.quantize(cuda.to_device(x), W4, stream=object())


# ----------------------------------------------------------------------------- warnings
def test_quiet_restores_numba_switches():
    from numba.cuda import config

    from qcore_cuda._quiet import quiet

    before = (config.CUDA_LOW_OCCUPANCY_WARNINGS, config.CUDA_WARN_ON_IMPLICIT_COPY)
    with quiet():
        with quiet():
            assert config.CUDA_LOW_OCCUPANCY_WARNINGS == 0
        assert config.CUDA_WARN_ON_IMPLICIT_COPY == 0
    assert (config.CUDA_LOW_OCCUPANCY_WARNINGS, config.CUDA_WARN_ON_IMPLICIT_COPY) == before


@GPU_ONLY
@pytest.mark.parametrize("text", ["nvfp4", "q8s", "q8s/block32:f16", "e2m1/block16:ue4m3/tensor:f32"])
def test_no_numba_warning_reaches_users(be, text):
    """Small grids (a per-tensor scale, a statistics reset) and first compiles warn nothing."""
    b = type(be)()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for shape in ((3, 32), (130, 64)):
            x = sample_x(shape, seed=11)
            q = b.quantize(cuda.to_device(x), text)
            b.dequantize(q)
            b.quantize(x, text, params=REF.calibrate(x, text))
        qw = b.quantize(sample_x((64, 64), seed=12), W4)
        b.matmul(cuda.to_device(sample_x((2, 64), seed=13)), qw)


@GPU_ONLY
def test_numba_warnings_stay_on_for_user_kernels(be):
    from numba.cuda.core.errors import NumbaPerformanceWarning

    be.quantize(sample_x((3, 32), seed=14), "q8s")

    @cuda.jit
    def k(a):
        a[0] = 1.0

    with pytest.warns(NumbaPerformanceWarning, match="Grid size"):
        k[1, 1](cuda.device_array(1, np.float32))


_STRICT_CALLS = """
import sys, warnings
import numpy as np
warnings.simplefilter("error")  # as pytest's `filterwarnings = error` does, after start-up
import qcore
from qcore_cuda import CudaBackend
x = np.linspace(-3, 3, 64 * 64, dtype=np.float32).reshape(64, 64)
ref = qcore.backend("reference")
want = ref.dequantize(ref.quantize(x, "q4s/block32:f16"))
if sys.argv[1] == "registry":  # the public API: the registry asks available() first
    q = qcore.quantize(x, "q4s/block32:f16", backend="cuda")
    y = q.numpy()
else:  # a backend made directly: its first call is the first use of numba
    be = CudaBackend()
    q = be.quantize(x, "q4s/block32:f16")
    y = be.to_numpy(be.dequantize(q))
    be.to_numpy(be.matmul(x[:2], q))
assert np.array_equal(y, want)
print("OK", np.__version__)
"""


@pytest.mark.parametrize("entry", ["registry", "direct"])
def test_no_warning_at_numbas_first_import_under_strict_filters(entry):
    """A fresh process that turns every warning into an error (`-W error`, then
    `simplefilter("error")` as pytest's `filterwarnings = error` does) quantizes, dequantizes and
    multiplies on the cuda backend: nothing numba or numba-cuda emits on first import or first
    compile reaches it. Under numpy >= 2.5 (the H200 image) numba-cuda's import warns about
    `np.timedelta64("nat")`, which unfiltered makes the backend unavailable there (qcore_cuda._compat);
    under the simulator the same calls run with numba.cuda's simulator import."""
    r = subprocess.run([sys.executable, "-W", "error", "-c", _STRICT_CALLS, entry], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "NUMBA_ENABLE_CUDASIM": "1" if SIM else "0"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("OK"), r.stdout


# ----------------------------------------------------------------------------- GPU: pool, interop
@GPU_ONLY
def test_results_come_from_the_pool(be):
    from qcore_cuda import _pool, pool_bytes

    q = be.quantize(sample_x((256, 256), seed=15), W4)
    assert _pool.active(), "the pool was not installed (numba's default manager was in place)"
    y = be.dequantize(q)
    held, used = next(iter(pool_bytes().values()))
    assert used >= y.nbytes and held >= used
    del y
    y2 = None
    for _ in range(3):  # freed blocks come back: the pool does not grow
        y2 = None
        y2 = be.dequantize(q)
    assert next(iter(pool_bytes().values()))[0] == held
    sliced = y2.reshape(256 * 256)[10:20]  # views keep the block alive without the parent
    want = y2.copy_to_host().reshape(-1)[10:20]
    del y2
    np.testing.assert_array_equal(sliced.copy_to_host(), want)


@GPU_ONLY
def test_a_dropped_default_stream_result_is_reused_as_the_spare(be):
    """The last result dropped in the default stream's order is the next one of its size (no
    driver call either way); another size, a side stream or `trim()` free it; results stay right."""
    from qcore_cuda import _pool

    q = be.quantize(sample_x((128, 256), seed=16), W4)
    want = be.dequantize(q).copy_to_host()
    y = be.dequantize(q)
    ptr = y.__cuda_array_interface__["data"][0]
    del y
    dev = cuda.current_context().device.id
    assert _pool.spare(dev) == (ptr, 128 * 256 * 4)
    y = be.dequantize(q)
    assert y.__cuda_array_interface__["data"][0] == ptr and _pool.spare(dev) is None
    np.testing.assert_array_equal(y.copy_to_host(), want)
    del y
    ctx = cuda.current_context()
    other, _ = _pool.reserve(64, 0, ctx)  # another size: the spare stays
    assert other != ptr and _pool.spare(dev) == (ptr, 128 * 256 * 4)
    _pool._release(other, 64, 0, dev)  # it takes the spare's place; the old spare goes back to the pool
    assert _pool.spare(dev) == (other, 64)
    _pool.trim()
    assert _pool.spare(dev) is None
    side = cuda.stream()
    y = be.dequantize(q, stream=side)
    side.synchronize()
    np.testing.assert_array_equal(y.copy_to_host(), want)
    yp = y.__cuda_array_interface__["data"][0]
    del y  # freed in the side stream's order, not kept
    assert (_pool.spare(dev) or (0, 0))[0] != yp
    _pool.trim()
    big = _pool._keep[dev] + 1  # larger than the pool keeps cached: freed, not kept
    _pool._release(_pool.reserve(big, 0, ctx)[0], big, 0, dev)
    assert _pool.spare(dev) is None


def test_the_spare_slot_hands_out_or_frees_each_block_once(monkeypatch):
    """The spare's bookkeeping without a GPU (the driver's free recorded): one block kept per
    device, the older one freed; a take of another size leaves it; side streams and blocks above
    the release threshold are freed at once; many threads dropping and taking lose none and
    free none twice."""
    import threading

    from qcore_cuda import _pool

    freed: list = []
    monkeypatch.setattr(_pool, "_free_async", lambda ptr, stream: freed.append(ptr))
    monkeypatch.setattr(_pool, "_spare", {})
    monkeypatch.setattr(_pool, "_keep", {0: 1000, 1: 1000})
    _pool._release(16, 100, 0, 0)
    _pool._release(32, 200, 0, 0)
    assert _pool.spare(0) == (32, 200) and freed == [16]
    assert _pool._take_spare(100, 0) == 0 and _pool.spare(0) == (32, 200)
    assert _pool._take_spare(200, 0) == 32 and _pool.spare(0) is None
    _pool._release(48, 100, 7, 0)  # a side stream: freed in its order
    _pool._release(64, 2000, 0, 0)  # above the threshold
    assert _pool.spare(0) is None and freed == [16, 48, 64]
    _pool._release(80, 100, 0, 1)
    _pool.drop_spares()
    assert _pool.spare(1) is None and freed[-1] == 80

    freed.clear()
    taken: list = []
    lock = threading.Lock()

    def worker(base: int) -> None:
        for i in range(2000):
            ptr = base + 16 * i
            _pool._release(ptr, 100 + i % 2, 0, 0)
            got = _pool._take_spare(100 + (i + 1) % 2, 0)
            if got:
                with lock:
                    taken.append(got)

    threads = [threading.Thread(target=worker, args=(k << 32,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _pool.drop_spares()
    ptrs = {(k << 32) + 16 * i for k in range(4) for i in range(2000)}
    assert len(freed) == len(set(freed)) and len(taken) == len(set(taken)) and not set(freed) & set(taken)
    assert set(freed) | set(taken) == ptrs


@GPU_ONLY
@pytest.mark.parametrize("env,manager", [({"QCORE_CUDA_POOL": "0"}, None), ({}, "user")])
def test_pool_leaves_other_managers_alone(env, manager):
    """`QCORE_CUDA_POOL=0`, or a numba memory manager the user set first: no pool; results still right."""
    user = textwrap.dedent("""
        from numba import cuda
        from numba.cuda.cudadrv.driver import NumbaCUDAMemoryManager
        class Mine(NumbaCUDAMemoryManager):
            pass
        cuda.set_memory_manager(Mine)
    """) if manager else ""
    code = user + textwrap.dedent("""
        import numpy as np, qcore
        from numba import cuda
        from qcore_cuda import _pool
        be = qcore.backend("cuda")
        x = np.linspace(-3, 3, 4096, dtype=np.float32).reshape(64, 64)
        y = be.to_numpy(be.dequantize(be.quantize(x, "q8s/block32:f16")))
        ref = qcore.backend("reference")
        assert np.array_equal(y, ref.dequantize(ref.quantize(x, "q8s/block32:f16")))
        print("POOL", _pool.active(), type(cuda.current_context().memory_manager).__name__)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "NUMBA_ENABLE_CUDASIM": "0", **env})
    assert r.returncode == 0, r.stderr[-2000:]
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("POOL")][0]
    assert line.split()[1] == "False", line
    if manager:
        assert line.split()[2] == "Mine", line


@GPU_ONLY
def test_results_go_to_torch_and_cupy_without_a_copy(be):
    torch = pytest.importorskip("torch")
    q = be.quantize(sample_x((64, 64), seed=16), W4)
    y = be.dequantize(q)
    want = y.copy_to_host()
    t = y.torch()
    assert t.data_ptr() == y.__cuda_array_interface__["data"][0] and t.shape == (64, 64)
    t2 = torch.from_dlpack(be.dequantize(q))
    assert torch.equal(t2.cpu(), torch.from_numpy(want))
    assert y.__dlpack_device__()[0] == 2
    del y
    assert torch.equal(t.cpu(), torch.from_numpy(want)), "the torch view outlived the QArray"
    cupy = pytest.importorskip("cupy")
    c = cupy.from_dlpack(be.dequantize(q))
    np.testing.assert_array_equal(cupy.asnumpy(c), want)


@GPU_ONLY
def test_torch_inputs_outputs_and_streams(be):
    """x and out as torch tensors, the call on torch's current (side) stream: same bits as the
    default-stream call."""
    torch = pytest.importorskip("torch")
    w = sample_x((256, 512), seed=17)
    qw = be.quantize(torch.from_numpy(w).cuda(), W4)
    x = torch.randn(4, 256, device="cuda")
    plain = be.matmul(x, qw).torch().clone()
    side = torch.cuda.Stream()
    out = torch.empty(4, 512, device="cuda")
    with torch.cuda.stream(side):
        got = be.matmul(x, qw, out=out)
        d = torch.empty(256, 512, device="cuda")
        be.dequantize(qw, out=d)
    side.synchronize()
    assert got is out and torch.equal(out, plain)
    assert torch.equal(d.cpu(), torch.from_numpy(REF.dequantize(REF.quantize(w, W4))))
    xq = torch.randn(64, 64, device="cuda")
    q = be.quantize(xq, "nvfp4", stream=side)
    assert be.into_data(q).payload == REF.into_data(REF.quantize(xq.cpu().numpy(), "nvfp4")).payload
    with torch.cuda.stream(side):  # x made on the side stream; quantize follows it, first call and repeat
        xs = torch.randn(96, 64, device="cuda")
        qs = [be.quantize(xs, W4) for _ in range(2)]
    want = REF.into_data(REF.quantize(xs.cpu().numpy(), W4)).payload
    assert [be.into_data(q).payload for q in qs] == [want, want]


@GPU_ONLY
def test_kernels_load_from_the_disk_cache(tmp_path):
    """A second process finds the first one's compiled kernels in numba's cache (NUMBA_CACHE_DIR),
    and loads them without numba-cuda's registry set-up (`_diskcache._load_without_refresh`: its
    imports, scipy's among them, were most of a first call), with the reference's results."""
    code = textwrap.dedent("""
        import sys
        import numpy as np, qcore
        from qcore_cuda import fast
        be = qcore.backend("cuda")
        x = np.linspace(-3, 3, 8192, dtype=np.float32).reshape(64, 128)
        q = be.quantize(x, "q4s/block32:f16")
        got = be.to_numpy(be.dequantize(q))
        ref = qcore.backend("reference")
        assert be.into_data(q).payload == ref.into_data(ref.quantize(x, "q4s/block32:f16")).payload
        assert np.array_equal(got, ref.dequantize(ref.quantize(x, "q4s/block32:f16")))
        print("REGISTRIES", int("numba.cuda.np.arraymath" in sys.modules))
        print("NVRTC", int("libnvrtc" in open("/proc/self/maps").read()))
        kinds = [fast.quant_kernel(k) for k in range(len(fast.KIND_BITS))] + \\
            [fast.dequant_kernel(k) for k in range(len(fast.KIND_BITS))]
        hits = sum(sum(k.stats.cache_hits.values()) for k in kinds)
        misses = sum(sum(k.stats.cache_misses.values()) for k in kinds)
        print("CACHE", hits, misses)
    """)
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "0", "NUMBA_CACHE_DIR": str(tmp_path)}
    runs, registries, nvrtc = [], [], []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 0, r.stderr[-2000:]
        runs.append([int(v) for v in [ln for ln in r.stdout.splitlines() if ln.startswith("CACHE")][0].split()[1:]])
        registries.append([ln for ln in r.stdout.splitlines() if ln.startswith("REGISTRIES")][0].split()[1])
        nvrtc.append([ln for ln in r.stdout.splitlines() if ln.startswith("NVRTC")][0].split()[1])
    assert runs[0][1] >= 2, f"the first process compiled nothing it could cache: {runs}"
    assert runs[1][0] >= 2 and runs[1][1] == 0, f"the second process compiled again: {runs}"
    assert registries == ["1", "0"], f"numba-cuda's registries loaded (compiling, loading): {registries}"
    assert nvrtc[1] == "0", "the second process loaded NVRTC (27 MiB), which compiles none of the kernels"


_CACHE_INTERNALS = """
import json
from numba.cuda.core import caching
from qcore_cuda._diskcache import numba_internals_problems
now = numba_internals_problems()
caching.Cache.load_overload = lambda self, sig, target_context: None  # what an upgrade might do
print(json.dumps([now, numba_internals_problems()]))
"""


def test_numba_cache_internals_the_disk_cache_relies_on():
    """The disk cache replaces numba-cuda's `Cache.load_overload` by its body without the refresh;
    this fails loudly when an upgrade changes that method. Real numba.cuda in a subprocess (the
    simulator has no cache); no GPU needed."""
    import json

    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    out = subprocess.run([sys.executable, "-c", _CACHE_INTERNALS], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    now, patched = json.loads(out.stdout.strip().splitlines()[-1])
    assert now == [], f"numba-cuda cache internals used by qcore_cuda._diskcache changed: {now}"
    assert any("no longer a refresh" in p for p in patched), patched


def test_pool_and_cache_are_inert_under_the_simulator():
    if not SIM:
        pytest.skip("the simulator case; on a GPU the pool and cache tests above run")
    from qcore_cuda import _diskcache, _pool, fast

    assert _pool.install() is False and not _pool.active()
    _diskcache.enable({"fast": fast})
    assert not getattr(fast.quant_kernel, "_qcore_disk_cache", False)
    assert qcore.backend("cuda").available()


def test_views_hold_results_without_cycles():
    """A DevView (what a launch reads of a result or an input) is no reference cycle: a result
    goes back to the pool as soon as its last reference does, not at the next gc run."""
    import gc
    import weakref

    from qcore_cuda._array import DevView

    class Result:
        pass

    res = Result()
    alive = weakref.ref(res)
    v = DevView(1024, (4, 2), np.dtype(np.float32), res)
    assert v.arg is v and v.size == 8 and v.__cuda_array_interface__["shape"] == (8,)
    gc.disable()
    try:
        del res, v
        assert alive() is None, "a DevView kept its result alive past its last reference"
    finally:
        gc.enable()


@pytest.mark.parametrize("text,want", [("512M", 512 << 20), ("2G", 2 << 30), ("1.5GiB", 3 << 29),
                                       ("1048576", 1 << 20), ("0", 0), ("2gb", 2 << 30)])
def test_pool_keep_setting_parses(text, want):
    from qcore_cuda._pool import parse_bytes

    assert parse_bytes(text) == want


@pytest.mark.parametrize("text", ["x", "-1", "G", "nan", "inf", "2Q"])
def test_pool_keep_setting_rejects_nonsense(text):
    from qcore_cuda._pool import parse_bytes

    with pytest.raises(qcore.errors.InputError, match="QCORE_CUDA_POOL_KEEP"):
        parse_bytes(text)


def test_pool_keep_default_is_bounded(monkeypatch):
    from qcore_cuda._pool import keep_bytes

    monkeypatch.delenv("QCORE_CUDA_POOL_KEEP", raising=False)
    assert keep_bytes(144 << 30) == 18 << 30 and keep_bytes(8 << 30) == 1 << 30
    monkeypatch.setenv("QCORE_CUDA_POOL_KEEP", "64M")
    assert keep_bytes(141 << 30) == 64 << 20


@GPU_ONLY
def test_pool_hands_memory_back_above_its_threshold():
    """After a synchronisation the pool keeps at most `QCORE_CUDA_POOL_KEEP` of freed blocks:
    another allocator (torch here, or another process on the GPU) gets the rest back."""
    code = textwrap.dedent("""
        import numpy as np, qcore
        from numba import cuda
        from qcore_cuda import pool_bytes
        be = qcore.backend("cuda")
        q = be.quantize(np.ones((4096, 8192), np.float32), "q8s/block32:f16")
        ys = [be.dequantize(q) for _ in range(4)]  # 4 x 128 MiB in use
        cuda.synchronize()
        held_busy = next(iter(pool_bytes().values()))[0]
        del ys
        cuda.synchronize()  # the release happens at a synchronisation
        held_idle, used_idle = next(iter(pool_bytes().values()))
        print("HELD", held_busy, held_idle, used_idle)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "NUMBA_ENABLE_CUDASIM": "0", "QCORE_CUDA_POOL_KEEP": "64M"})
    assert r.returncode == 0, r.stderr[-2000:]
    busy, idle, used = map(int, [ln for ln in r.stdout.splitlines() if ln.startswith("HELD")][0].split()[1:])
    assert busy >= 4 * 128 << 20, busy
    # the driver releases whole chunks: at least three of the four freed results went back
    assert busy - idle >= 3 * 128 << 20, (busy, idle, used)
