"""The `cuda` backend's tensor-core GEMV at M = 1 over a weight's fragment-order copy (frag.py):
the copy, the kernel within the conformance suite's matmul bound, its range fallback, the copy
made again after quantize `out=`, and the cases that keep the FFMA GEMV."""
from __future__ import annotations

import numpy as np
import pytest

import qcore
from qcore.backend.reference import ReferenceBackend

from tests.cuda_cases import SIM, assert_f32_sums, sample_x

REF = ReferenceBackend()
from numba import cuda  # noqa: E402  (a module global for kernels defined here: conftest.py set the mode)

# The simulator's mma twin costs two block barriers per call: there the smallest weight the
# kernel takes (one strip, 16 k-tile pairs in 2 splits); on a GPU several strips, splits and
# a last block with fewer pairs than the others.
K_, N_ = (512, 128) if SIM else (8192 + 32 * 5, 1024)


def _bound(x, W):
    """The conformance suite's matmul bound (matmul_rel = 2): 2 K 2**-24 (|x| @ |W|)."""
    return 2 * x.shape[-1] * 2.0 ** -24 * (np.abs(x.astype(np.float64)) @ np.abs(W))


def _x(seed, k_=K_):
    x = sample_x((1, k_), seed=seed, scale=1.0)
    x.reshape(-1)[2] = 0.25  # (sample_x's 1e-30 would send its block to the FFMA fallback)
    return x


def _taken(be, x, qw):
    from qcore_cuda import paths

    before = paths.TAKEN["FragmentGemvMatmul"]
    got = be.to_numpy(be.matmul(x, qw))
    return got, paths.TAKEN["FragmentGemvMatmul"] - before


_TEXTS = ["q4s/block32:f16", "q4f/block64:f32", "q4s/block32:bf16", "q4s/block32:f16/tensor:f32", "q4s",
          "q4s/block128:ue8m0"]
# f16 scales with no global make an f16 copy of the scales; the others f32 (bf16, f32, E8M0,
# a two-level global multiplied in). On the simulator one of each copy (its mma twin costs two
# block barriers a call; test_fragment_copy_layout packs f16 scales there too).
_CASES = (["q4s/block32:f16/tensor:f32"] if SIM else _TEXTS)


@pytest.mark.parametrize("text", _CASES)
def test_fragment_gemv(cuda_backend, text):
    """x[1, K] @ w for 4-bit integer codes under each kind of scale: the backend takes the
    fragment GEMV, the result lies within the matmul bound of x @ dequantize(w), no block fell
    back to FFMA, and (on a GPU: the order of the k-split sums is the GPU's) a second call
    repeats it bit for bit."""
    from qcore_cuda import frag

    sch = qcore.scheme(text)
    assert frag.geometry((K_, N_), sch) is not None
    w = sample_x((K_, N_), seed=41)
    x = _x(42)
    qw = cuda_backend.from_data(REF.into_data(REF.quantize(w, text)))
    got, n = _taken(cuda_backend, x, qw)
    assert n == 1
    W = REF.dequantize(REF.quantize(w, text)).astype(np.float64)
    err = np.abs(got - x.astype(np.float64) @ W)
    bound = _bound(x, W)
    assert np.all(err <= bound), f"{int((err > bound).sum())} outputs past the bound, worst {np.max(err / bound):.3g}x"
    kind, Q = frag.geometry((K_, N_), sch)
    assert qw.data.cache.frag.size == frag.copy_words(Q, frag.half_scales(sch))
    st = qw.data.cache.gemv[1]
    assert st[1]._disp is frag.frag_kernel(frag.half_scales(sch))
    assert st[1]._args[6].copy_to_host()[-1] == 0, "fallback flag"
    if not SIM:
        again = cuda_backend.to_numpy(cuda_backend.matmul(x, qw))
        np.testing.assert_array_equal(again.view(np.uint32), got.view(np.uint32))


def _expected_copy(be, qw, k_, n_):
    """The chunks of a q4s/block32:f16 [k_, n_] weight's fragment copy, built on the host from the
    module text: for lane (g, t) of tile i of chunk (strip, k-tile), the codes of columns
    16i + g (pairs r = 0, 2) and 16i + g + 8 (r = 1, 3) at rows 4t + h (r < 2) and 4t + 2 + h
    (r >= 2), offset by 8, in bits 4r + 16h; after the codes the chunk's effective scales in
    f16, row-minor per 32-column group. Also the decoded scales [k_, n_ / 32]."""
    scales, _ = be.decoded_scales(qw.data)
    S = scales.copy_to_host().reshape(k_, n_ // 32)
    W = be.to_numpy(be.dequantize(qw))
    codes = np.rint(W / np.repeat(S, 32, axis=1)).astype(np.int64) + 8
    strips, nkt = n_ // 128, k_ // 16
    o = np.arange(256)
    lane, tile = (o & 127) >> 2, (o >> 7) * 4 + (o & 3)
    g, t = lane >> 2, lane & 3
    st, kt = np.arange(strips)[:, None, None], np.arange(nkt)[None, :, None]
    words = np.zeros((strips, nkt, 256), dtype=np.uint32)
    for r in range(4):
        for h in range(2):
            row = kt * 16 + 4 * t + h + (2 if r >= 2 else 0)
            col = st * 128 + 16 * tile + g + (8 if r & 1 else 0)
            words |= (codes[row, col] << (4 * r + 16 * h)).astype(np.uint32)
    sc = S.reshape(nkt, 16, strips, 4).transpose(2, 0, 3, 1).astype(np.float16)  # [strip, k-tile, group, row]
    chunks = np.concatenate([words, np.ascontiguousarray(sc).view(np.uint32).reshape(strips, nkt, 32)], axis=2)
    return chunks.reshape(-1), S


def _pack_now(be, qw, Q):
    from qcore_cuda.paths.matmul import fragment_copy

    return fragment_copy(be, qw.data, *be.decoded_scales(qw.data), Q)


def test_fragment_copy_layout(cuda_backend):
    """`frag.pack` writes the copy the module text describes (`_expected_copy`), word for word,
    then per block of `k_frag_erange` the bits of max |e| and of min nonzero |e| minus 1."""
    from qcore_cuda import frag, gemv

    k_, n_ = 64, 256  # (below MIN_K, which only the kernel needs: the GEMV geometry packs the same)
    text = "q4s/block32:f16"
    qw = cuda_backend.from_data(REF.into_data(REF.quantize(sample_x((k_, n_), seed=43), text)))
    kind, Q = gemv.geometry((k_, n_), qcore.scheme(text))
    got = _pack_now(cuda_backend, qw, Q).copy_to_host()
    want, S = _expected_copy(cuda_backend, qw, k_, n_)
    assert got.size == want.size + 2 * frag.RANGE_BLOCKS
    np.testing.assert_array_equal(got[:want.size], want)
    tail = got[want.size:].reshape(-1, 2)
    assert tail[:, 0].max() == np.abs(S).max().view(np.uint32)
    assert tail[:, 1].min() == np.abs(S[S != 0]).min().view(np.uint32) - 1


@pytest.mark.parametrize("case, text", [("nan", "q4s/block32:f16")] if SIM else [
    (c, t) for c in ("tiny", "huge", "nan", "inf") for t in ("q4s/block32:f32", "q4s/block32:f16")])
def test_fragment_gemv_range_fallback(cuda_backend, case, text):
    """Where x * e leaves [2**-100, 2**100] (subnormal x, huge products, NaN, infinity), the block
    sums its columns again with FFMA in k order: results within the matmul bound of the f64 sum,
    NaN and infinity where the f32 sum has them, and the kernel's fallback flag set; for f32 and
    f16 copies of the scales (two kernel variants). (The simulator runs one case, f16: the cases
    share the kernel's one test of the range; test_fragment_gemv runs an f32 copy there.)"""
    from qcore_cuda import frag

    w = sample_x((K_, N_), seed=44)
    x = _x(45)
    if case == "tiny":
        x = (x * 1e-39).astype(np.float32)
    elif case == "huge":
        x = (x * 2.0 ** 110).astype(np.float32)
    elif case == "nan":
        x[0, 7] = np.nan
    else:
        x[0, K_ - 1] = np.inf
    qw = cuda_backend.from_data(REF.into_data(REF.quantize(w, text)))
    got, n = _taken(cuda_backend, x, qw)
    assert n == 1
    st = qw.data.cache.gemv[1]
    cnt = st[1]._args[6]
    assert cnt.copy_to_host()[-1] == 1, "fallback flag"
    got = got.astype(np.float64)
    W = REF.dequantize(REF.quantize(w, text)).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        want = (x.astype(np.float64) @ W).astype(np.float32).astype(np.float64)
        bound = _bound(x, W)
    assert_f32_sums(got, want, bound, case)
    assert frag.half_scales(qcore.scheme(text)) is text.endswith("f16")


def test_fragment_copy_follows_quantize_out(cuda_backend):
    """quantize(out=w) of new weights into a tensor that holds a fragment copy packs the copy
    again from the new codes and decoded scales (`_expected_copy`); on a GPU the copy comes from
    a matmul and the next matmul reads the new weights. (The simulator puts a copy in the cache
    as the path does, for a smaller weight: its pack and mma twins cost seconds per call.)"""
    from qcore_cuda import gemv

    text = "q4s/block32:f16"
    k_, n_ = (64, 128) if SIM else (K_, N_)
    x = _x(46, k_)
    w1, w2 = sample_x((k_, n_), seed=47), sample_x((k_, n_), seed=48, scale=0.5)
    qw = cuda_backend.quantize(w1, text)
    if SIM:
        qw.data.cache.gemv_geometry = gemv.geometry((k_, n_), qcore.scheme(text))  # (as `MatmulCall` keeps it)
        qw.data.cache.frag = _pack_now(cuda_backend, qw, qw.data.cache.gemv_geometry[1])
    else:
        _, n = _taken(cuda_backend, x, qw)
        assert n == 1
    before = qw.data.cache.frag.copy_to_host()
    cuda_backend.quantize(w2, text, out=qw)
    want, _ = _expected_copy(cuda_backend, qw, k_, n_)
    got = qw.data.cache.frag.copy_to_host()
    assert not np.array_equal(before[:want.size], want)
    np.testing.assert_array_equal(got[:want.size], want)
    if not SIM:
        y = cuda_backend.to_numpy(cuda_backend.matmul(x, qw)).astype(np.float64)
        W = REF.dequantize(REF.quantize(w2, text)).astype(np.float64)
        assert np.all(np.abs(y - x.astype(np.float64) @ W) <= _bound(x, W))


def test_fragment_gemv_not_taken(cuda_backend, monkeypatch):
    """The FFMA GEMV keeps: M = 2, 8-bit codes, K below `MIN_K` or not a multiple of 32, N not a
    multiple of 128, 16-column blocks, and every weight while QCORE_CUDA_FRAGMENT_GEMV=0."""
    from qcore_cuda import frag

    for shape, text in [((K_, N_), "q8s/block32:f16"), ((256, N_), "q4s/block32:f16"),
                        ((K_ + 16, N_), "q4s/block32:f16"), ((K_, N_ + 64), "q4s/block32:f16"),
                        ((K_, N_), "q4s/block16:f16")]:
        assert frag.geometry(shape, qcore.scheme(text)) is None, (shape, text)
    w = sample_x((K_, N_), seed=49)
    qw = cuda_backend.quantize(w, "q4s/block32:f16")
    x2 = sample_x((2, K_), seed=50, scale=1.0)
    _, n = _taken(cuda_backend, x2, qw)
    assert n == 0
    monkeypatch.setenv(frag.ENV, "0")
    qw2 = cuda_backend.quantize(w, "q4s/block32:f16")
    got, n = _taken(cuda_backend, _x(51), qw2)
    assert n == 0 and qw2.data.cache.frag is None


def test_fragment_gemv_cluster_dims(monkeypatch):
    """A strip's k-splits are launched as one thread-block cluster for 2 to `CLUSTER_MAX` splits
    on a GPU; without clusters for one split, more splits, under the simulator, and while
    QCORE_CUDA_FRAGMENT_CLUSTERS=0."""
    from qcore_cuda import frag

    monkeypatch.setattr(frag.config, "ENABLE_CUDASIM", False)
    assert frag.cluster_dims((64, 1)) is None
    assert frag.cluster_dims((64, 2)) == (1, 2, 1)
    assert frag.cluster_dims((8, frag.CLUSTER_MAX)) == (1, frag.CLUSTER_MAX, 1)
    assert frag.cluster_dims((8, frag.CLUSTER_MAX + 1)) is None
    monkeypatch.setenv(frag.CLUSTER_ENV, "0")
    assert frag.cluster_dims((64, 2)) is None
    monkeypatch.delenv(frag.CLUSTER_ENV)
    monkeypatch.setattr(frag.config, "ENABLE_CUDASIM", True)
    assert frag.cluster_dims((64, 2)) is None


@pytest.mark.skipif(SIM, reason="thread-block clusters need a GPU (sm_90); the simulator runs none")
def test_fragment_gemv_clusters_give_the_counter_sums(cuda_backend, monkeypatch):
    """Packed launches run a strip's k-splits as one cluster (their sums meet in rank 0's shared
    memory); numba's first launch of the kernel has no clusters and takes the counter path. Both
    give the same result bit for bit, within the matmul bound, and so does a weight whose launches
    have no clusters (QCORE_CUDA_FRAGMENT_CLUSTERS=0)."""
    from qcore_cuda import _launch, frag

    k_, n_ = K_, 4096  # 32 strips: 4 k-splits, the last with fewer pairs than the others
    w = sample_x((k_, n_), seed=53)
    x = _x(54, k_)
    W = REF.dequantize(REF.quantize(w, "q4s/block32:f16")).astype(np.float64)
    results = {}
    for clusters in (True, False):
        if not clusters:
            monkeypatch.setenv(frag.CLUSTER_ENV, "0")
        qw = cuda_backend.from_data(REF.into_data(REF.quantize(w, "q4s/block32:f16")))
        first, n = _taken(cuda_backend, x, qw)  # the dispatcher: no clusters
        assert n == 1
        st = qw.data.cache.gemv[1][1]
        ks = st._grid[1]
        raw_before = _launch.COUNTS["raw"]
        again = cuda_backend.to_numpy(cuda_backend.matmul(x, qw))
        assert _launch.COUNTS["raw"] == raw_before + 1, "the second launch was not the packed one"
        if clusters:
            assert 2 <= ks <= frag.CLUSTER_MAX and st._cluster == (1, ks, 1)
            assert st._raw._config not in (None, False), "the packed launch did not run in clusters"
        else:
            assert st._cluster is None and st._raw._config is None
        np.testing.assert_array_equal(again.view(np.uint32), first.view(np.uint32))
        assert np.all(np.abs(again - x.astype(np.float64) @ W) <= _bound(x, W))
        results[clusters] = again
    np.testing.assert_array_equal(results[True].view(np.uint32), results[False].view(np.uint32))
