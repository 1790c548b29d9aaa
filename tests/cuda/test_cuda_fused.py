"""The cuda backend's fused Triton GEMM for `linear` at prefill sizes (`qcore_cuda/fused.py`): every
value kind and scale layout it reads, within docs/spec.md's bound with the bfloat16-weight term,
tails of N, K and M against the tile, bias, the same bits on a repeat. Without a GPU the kernel
runs in Triton's interpreter (tests/conftest.py sets `TRITON_INTERPRET`) on CPU tensors made
from the reference's portable bytes; on a GPU through `linear` itself."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from qcore.backend.reference import ReferenceBackend
from qcore.conformance.checks import product_bound
from qcore.spec.arithmetic import slot_effective

from tests.cuda_cases import SIM
from tests.optional import need

torch = need("torch", "the fused GEMM takes torch tensors")
need("triton", "the fused GEMM is a Triton kernel")

REF = ReferenceBackend()
BF16 = np.dtype(ml_dtypes.bfloat16)
# every value kind (8-, 4-, 2-bit integers, E4M3, E5M2, E2M1) under per-tensor, per-row, blocks of
# 16 (several slots a BK step), 32, 128 (one slot across steps), UE8M0 / UE4M3 / bf16 scales, two-level
SCHEMES = ["q4s/block32:f16", "q8s/block32:f16", "q2s/block32:f16", "q4f/block64:bf16", "q8s", "q2f/block16:bf16",
           "e4m3/block32:f32", "e5m2", "mxfp4", "mxfp8", "nvfp4", "q4s/block16:f16", "q8s/block128:ue8m0",
           "q4_0", "q4s/block256:f16"]


def _bf16(a: np.ndarray) -> "torch.Tensor":
    return torch.from_numpy(np.ascontiguousarray(a).view(np.uint16).copy()).view(torch.bfloat16)


def _case(text: str, n: int, k: int, m: int, bias: bool, seed: int = 0):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * np.exp2(rng.integers(-32, 1, (n, k)))).astype(np.float32)  # (minifloat subnormals)
    x = rng.standard_normal((m, k)).astype(BF16)
    b = rng.standard_normal(n).astype(BF16) if bias else None
    return w, x, b


def _check(y: np.ndarray, q, x: np.ndarray, b, label: str) -> None:
    W = np.asarray(REF.dequantize(q), np.float64)
    exact, bound = product_bound(x, W, b, BF16)
    err = np.abs(y.astype(np.float64) - exact)
    assert (err <= bound).all(), f"{label}: max err {err.max()} (bound there {bound.flat[err.argmax()]})"


@pytest.mark.skipif(not SIM, reason="on a GPU the same kernel runs through linear (the test below)")
@pytest.mark.parametrize("text", SCHEMES)
@pytest.mark.parametrize("n,k,m,bias", [(40, 96, 20, True), (16, 256, 3, False)])
@pytest.mark.parametrize("form", [1, 2])
def test_fused_kernel_is_within_the_bfloat16_weight_bound(text, n, k, m, bias, form):
    """The kernel over the reference's bytes and effective scales (Triton's interpreter): N, M
    and K past a tile's edge (tile 32 x 16 x 64), the result within the bound, the same bits
    from the launch's second call; with x the identity, each weight value rounded once to bfloat16."""
    from qcore_cuda import fused, linear

    w, x, b = _case(text, n, k, m, bias)
    q = REF.quantize(w, text)
    data = q.to_data()
    kind, P = linear.geometry((n, k), q.scheme)
    codes = torch.from_numpy(np.frombuffer(data.payload, np.uint8)[: n * int(P[linear.LP_WPR]) * 4].copy())
    g = data.global_scale() if q.scheme.two_level else None
    scales = torch.from_numpy(np.ascontiguousarray(slot_effective(data.scales(), g, q.scheme), np.float32).reshape(-1))
    tile = fused.Tile(32, 16, 64, 4, 1, form)
    runs, go = [], fused.FusedLaunch(kind, P, m, torch.device("cpu"), tile, b is not None)  # (one launch, called twice)
    for _ in range(2):
        y = torch.empty(m, n, dtype=torch.bfloat16)
        go(_bf16(x), codes, scales, None if b is None else _bf16(b), y)
        runs.append(y.view(torch.int16).numpy().copy())
    assert np.array_equal(runs[0], runs[1])
    _check(runs[0].view(np.uint16).view(BF16), q, x, b, f"{text} N={n} K={k} M={m}")
    # x = the identity: y = W^T, each weight value rounded to bfloat16 as the rule says (every code
    # decoded exactly, subnormal minifloats included)
    y = torch.empty(k, n, dtype=torch.bfloat16)
    fused.launch(kind, P, _bf16(np.eye(k, dtype=BF16)), codes, scales, None, y, tile)
    want = np.asarray(REF.dequantize(q), np.float32).astype(BF16).T
    assert np.array_equal(y.float().numpy(), want.astype(np.float32))  # (-0.0 == 0.0: a sum from +0)


def _f16_operands(q, codes_scales):
    """(scales times 2**p, 2**-p) as `paths.linear` makes them: p from the weight's largest
    magnitude in a bfloat16 dequantize."""
    from qcore_cuda import fused

    top = float(np.abs(np.asarray(REF.dequantize(q), np.float32).astype(BF16).astype(np.float32)).max())
    p = fused.f16_shift(top)
    return fused.f16_scales(codes_scales, p), 2.0 ** -p, p


@pytest.mark.skipif(not SIM, reason="on a GPU the same kernel runs through linear (the test below)")
@pytest.mark.parametrize("text", ["q4s/block32:f16", "q2f/block16:bf16", "e5m2", "nvfp4"])
@pytest.mark.parametrize("mag", [0, 20, -20])
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # (x the identity, 2**20: inf)
@pytest.mark.parametrize("form", [1, 2])
def test_fused_kernel_in_float16_is_within_the_float16_weight_bound(text, mag, form):
    """The float16 launch (Triton's interpreter) for weights of magnitude 2**mag (2**20: past
    float16's range unless shifted; 2**-20: below its normal range): the result within docs/spec.md's
    bound with the float16-weight term, the same bits from a second call; with x the identity,
    each weight value `round_f16(W * 2**p)` times 2**-p, rounded to float16."""
    from qcore_cuda import fused, linear

    n, k, m = 40, 96, 20
    w, x, b = _case(text, n, k, m, True, seed=3)
    w = w * np.float32(2.0 ** mag)
    x = (x.astype(np.float32) * np.float32(2.0 ** (-mag if mag >= 0 else 12))).astype(np.float16)
    b = b.astype(np.float16)
    q = REF.quantize(w, text)
    data = q.to_data()
    kind, P = linear.geometry((n, k), q.scheme)
    codes = torch.from_numpy(np.frombuffer(data.payload, np.uint8)[: n * int(P[linear.LP_WPR]) * 4].copy())
    g = data.global_scale() if q.scheme.two_level else None
    scales = torch.from_numpy(np.ascontiguousarray(slot_effective(data.scales(), g, q.scheme), np.float32).reshape(-1))
    shifted, unscale, p = _f16_operands(q, scales)
    tile = fused.Tile(32, 16, 64, 4, 1, form)
    go = fused.FusedLaunch(kind, P, m, torch.device("cpu"), tile, True, True, unscale)
    runs = []
    for _ in range(2):
        y = torch.empty(m, n, dtype=torch.float16)
        go(torch.from_numpy(x), codes, shifted, torch.from_numpy(b), y)
        runs.append(y.numpy().copy())
    assert np.array_equal(runs[0].view(np.uint16), runs[1].view(np.uint16))
    W = np.asarray(REF.dequantize(q), np.float64)
    assert 2.0 ** 12 <= 2.0 ** p * np.abs(W).max() <= 2.0 ** 15
    exact, bound = product_bound(x, W, b, np.float16)
    err = np.abs(runs[0].astype(np.float64) - exact)
    assert (err <= bound).all(), f"{text} 2**{mag}: max err {err.max()} (bound there {bound.flat[err.argmax()]})"
    y = torch.empty(k, n, dtype=torch.float16)
    fused.launch(kind, P, torch.eye(k, dtype=torch.float16), codes, shifted, None, y, tile, unscale)
    W32 = np.asarray(REF.dequantize(q), np.float32)
    with np.errstate(over="ignore"):
        want = ((W32 * np.float32(2.0 ** p)).astype(np.float16).astype(np.float32) * np.float32(unscale)).astype(np.float16)
    assert np.array_equal(y.numpy().astype(np.float32), want.T.astype(np.float32))


def test_new_bytes_drop_what_a_float16_linear_derived_from_the_values():
    """`TensorCache.forget_values` (after `quantize(..., out=)` writes new bytes): the float16 p,
    the float16 launches and the repeats of float16 x go; the bfloat16 ones, whose scales are
    decoded again in place, stay."""
    from qcore_cuda._data import NOT_YET, TensorCache

    cache = TensorCache()
    cache.fused_f16 = ("scales times 2**p", 2.0 ** -13)
    cache.fused_launches = {(64, False, True): "f16", (64, False, False): "bf16"}
    cache.linear_repeats = {(torch.float16, (64, 256), False): "f16", (torch.bfloat16, (64, 256), False): "bf16"}
    cache.forget_values()
    assert cache.fused_f16 is NOT_YET
    assert list(cache.fused_launches.values()) == ["bf16"] and list(cache.linear_repeats.values()) == ["bf16"]


def test_the_float16_shift_keeps_the_largest_weight_in_range():
    """`fused.f16_shift`: 2**p * top in [2**13, 2**14); 0 for an all-zero weight; None for a
    non-finite top or |p| past `F16_SHIFT_MOST`. `fused.f16_scales`: scales times 2**p, a product
    past f32's range held at its largest finite value (0 * it stays 0)."""
    from qcore_cuda import fused

    for top in (1.0, 0.75, 2.0 ** -30, 3.0e9, 65504.0, 2.0 ** 14):
        p = fused.f16_shift(top)
        assert 2.0 ** 13 <= top * 2.0 ** p < 2.0 ** 14, (top, p)
    assert fused.f16_shift(0.0) == 0
    assert fused.f16_shift(float("inf")) is None and fused.f16_shift(2.0 ** -120) is None
    assert fused.f16_shift(2.0 ** 120) is None
    s = fused.f16_scales(torch.tensor([1.5, -2.0 ** 100, 2.0 ** -90], dtype=torch.float32), 60)
    assert s.tolist() == [1.5 * 2.0 ** 60, -float(torch.finfo(torch.float32).max), 2.0 ** -30]
    assert (s * 0).tolist() == [0.0, 0.0, 0.0]


STAGED_TILES = ["128,128,64,8,3,3", "64,256,64,4,4,3", "64,256,64,8,4,3"]
"""`fused.FORM_STAGED` tiles (`QCORE_CUDA_FUSED_TUNE`): two warpgroups over the weight's rows and a
ring of three; 64 x 256 on one warpgroup and a ring of four; the plan's past 128 rows, two
warpgroups over x's rows."""


def _need_gluon() -> None:
    """Skip where Triton has no Gluon (before 3.5); else import the staged kernel, so that a
    kernel the installed Triton cannot build fails the test (`fused.staged_available` would fall
    back quietly)."""
    try:
        import triton.experimental.gluon  # noqa: F401
    except ImportError:
        pytest.skip("the staged form needs Triton's Gluon (Triton 3.5 or later)")
    from qcore_cuda import k_staged  # noqa: F401


def _plan_weight(text: str) -> tuple[str, int]:
    """A plan test's (scheme, weight rows): 8192 rows, which fill the GPU (`fused.fills`), or 96 for
    a scheme text ending in " small"."""
    scheme, _, small = text.partition(" ")
    return scheme, 96 if small else 8192


def _paths_taken(call) -> tuple[list[str], object]:
    """(the linear paths `call` took, by class name, in `paths.linear.LINEAR`'s order; its result)."""
    from qcore_cuda.paths import TAKEN
    from qcore_cuda.paths import linear as paths_linear

    names = [type(p).__name__ for p in paths_linear.LINEAR]
    before = [TAKEN[n] for n in names]
    y = call()
    return [n for n, b in zip(names, before) if TAKEN[n] != b], y


def _fused_on(monkeypatch, tune: str | None) -> tuple[int, int, int]:
    """The fused GEMM on for every kind and from 64 rows, in `tune`'s staged tile where given (a
    Hopper GPU with Gluon, else a skip); (M, N, K) of a case past its tiles' edges: the staged
    form's step is 64 columns (128 with 2-bit codes); without a tune, rows the fields form takes on
    any GPU (K = 352 sends the plan's staged tile to it on a Hopper GPU too)."""
    from qcore_cuda import fused
    from qcore_cuda.paths import linear as paths_linear

    monkeypatch.setattr(paths_linear, "FUSED_M", (64, 1 << 20))  # (on, whatever the default)
    monkeypatch.setattr(paths_linear, "FUSED_ALL_KINDS", True)
    if tune is None:
        return 64 + 45, 200, 352
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the staged form needs a Hopper GPU (wgmma)")
    _need_gluon()
    monkeypatch.setenv(fused.TUNE_ENV, tune)
    return 64 + 77, 200, 384


@pytest.mark.skipif(SIM, reason="torch CUDA tensors need a GPU")
@pytest.mark.parametrize("text", SCHEMES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tune", [None] + STAGED_TILES)
def test_prefill_linear_takes_the_fused_gemm(cuda_backend, monkeypatch, text, bias, tune):
    """bfloat16 x through `linear` with the fused GEMM on for every kind, in its default tile and
    in the staged form (a Hopper GPU: the Gluon kernel): N, K and M past its tiles' edges, within
    the bound, the same bits on a repeat; with x the identity, each weight value rounded once to
    bfloat16."""
    from qcore_cuda import fused, linear
    from qcore_cuda.paths import TAKEN

    staged = tune is not None
    be, (m, n, k) = cuda_backend, _fused_on(monkeypatch, tune)
    w, x, b = _case(text, n, k, m, bias)
    q, qd = REF.quantize(w, text), be.quantize(w, text)
    xt, bt = _bf16(x).cuda(), (None if b is None else _bf16(b).cuda())
    before, staged_before = TAKEN["FusedGemmLinear"], fused.LAUNCHED[fused.FORM_STAGED]
    y = be.linear(xt, qd, bt)
    assert TAKEN["FusedGemmLinear"] == before + 1
    kind, P = linear.geometry((n, k), q.scheme)  # (a tile past shared memory, 2-bit's 64 x 256: the fields form)
    assert fused.LAUNCHED[fused.FORM_STAGED] == staged_before + (
        staged and fused.step_for(fused.tile_for(m), kind, k, fused.block_of(P)).form == fused.FORM_STAGED)
    assert torch.equal(be.linear(xt, qd, bt).view(torch.int16), y.view(torch.int16))
    _check(y.view(torch.int16).cpu().numpy().view(np.uint16).view(BF16), q, x, b, f"{text} M={m}")
    want = np.asarray(REF.dequantize(q), np.float32).astype(BF16).T  # (x = the identity: y = W^T)
    if not staged:  # (K rows of x, past the fields form's: its tile named, as the plan has none there)
        monkeypatch.setenv(fused.TUNE_ENV, "64,64,64,4,4,2")
    y = be.linear(_bf16(np.eye(k, dtype=BF16)).cuda(), qd)
    assert TAKEN["FusedGemmLinear"] == before + 2  # (the repeat above skipped the path choice)
    assert np.array_equal(y.float().cpu().numpy(), want.astype(np.float32))


def _f16_case(text: str, n: int, k: int, m: int, mag: int, seed: int = 0):
    """A weight of magnitude 2**mag, float16 x scaled so that the results stay in float16's range, a
    float16 bias."""
    w, x, b = _case(text, n, k, m, True, seed)
    w = w * np.float32(2.0 ** mag)
    x = (x.astype(np.float32) * np.float32(2.0 ** (-mag if mag >= 0 else 12))).astype(np.float16)
    return w, x, b.astype(np.float16)


def _check16(y: "torch.Tensor", q, x: np.ndarray, b, label: str) -> None:
    W = np.asarray(REF.dequantize(q), np.float64)
    exact, bound = product_bound(x, W, b, np.float16)
    err = np.abs(y.cpu().numpy().astype(np.float64) - exact)
    assert (err <= bound).all(), f"{label}: max err {err.max()} (bound there {bound.flat[err.argmax()]})"


@pytest.mark.skipif(SIM, reason="torch CUDA tensors need a GPU")
@pytest.mark.parametrize("text", ["q4s/block32:f16", "q8s", "q2f/block16:bf16", "e5m2", "mxfp4", "nvfp4", "q4_0"])
@pytest.mark.parametrize("mag", [0, 20, -20])
@pytest.mark.parametrize("tune", [None] + STAGED_TILES)
def test_float16_linear_takes_the_fused_gemm(cuda_backend, monkeypatch, text, mag, tune):
    """float16 x through `linear` with the fused GEMM on for every kind (docs/spec.md's
    float16-weight rule), weights of magnitude 1, 2**20 and 2**-20, in the default tile and in the
    staged form (a Hopper GPU): a float16 result within the bound with the float16-weight term,
    the same bits on a repeat."""
    from qcore_cuda.paths import TAKEN

    be, (m, n, k) = cuda_backend, _fused_on(monkeypatch, tune)
    w, x, b = _f16_case(text, n, k, m, mag)
    q, qd = REF.quantize(w, text), be.quantize(w, text)
    xt, bt = torch.from_numpy(x).cuda(), torch.from_numpy(b).cuda()
    before = TAKEN["FusedGemmLinear"]
    y = be.linear(xt, qd, bt)
    assert TAKEN["FusedGemmLinear"] == before + 1 and y.dtype == torch.float16
    assert torch.equal(be.linear(xt, qd, bt).view(torch.int16), y.view(torch.int16))
    _check16(y, q, x, b, f"{text} 2**{mag} M={m}")


@pytest.mark.skipif(SIM, reason="torch CUDA tensors need a GPU")
def test_float16_linear_after_new_bytes_go_into_the_weight(cuda_backend):
    """`quantize(..., out=q)` into a weight the float16 fused GEMM has read: the next `linear`
    finds p again (a weight 2**24 times larger would overflow float16 under the old p), within the
    bound for the new values; a repeat of the first call's shape too."""
    from qcore_cuda.paths import TAKEN

    be, text, m, n, k = cuda_backend, "q4s/block32:f16", 200, 192, 512
    w, x, b = _f16_case(text, n, k, m, 0, seed=7)
    qd = be.quantize(w, text)
    xt, bt = torch.from_numpy(x).cuda(), torch.from_numpy(b).cuda()
    before = TAKEN["FusedGemmLinear"]
    be.linear(xt, qd, bt)
    be.linear(xt, qd, bt)
    w2, x2, _ = _f16_case(text, n, k, m, 24, seed=8)
    assert be.quantize(w2, text, out=qd) is qd
    x2t = torch.from_numpy(x2).cuda()
    y = be.linear(x2t, qd, bt)
    assert TAKEN["FusedGemmLinear"] == before + 2  # (the first call's, then this one's: the repeat was dropped)
    _check16(y, REF.quantize(w2, text), x2, b, f"{text} after new bytes")
    assert torch.isfinite(y).all()


@pytest.mark.skipif(SIM, reason="torch CUDA tensors need a GPU")
@pytest.mark.parametrize("text,m,path", [("q4s/block32:f16", 48, "FusedGemmLinear"),
                                         ("q4s/block32:f16", 384, "FusedGemmLinear"),
                                         ("q8s/block32:f16", 2048, "FusedGemmLinear"),
                                         ("mxfp4", 512, "FusedGemmLinear"),
                                         ("q4s/block32:f16", 32, "TensorCoreLinear"),
                                         ("nvfp4", 256, "TensorCoreLinear"),
                                         ("e4m3/block32:f32", 256, "TensorCoreLinear"),
                                         ("q4s/block32:f16 small", 64, "TensorCoreLinear"),
                                         ("q4s/block32:f16 small", 65, "FusedGemmLinear")])
def test_the_default_plan_takes_the_fused_gemm_for_float16_from_48_rows(cuda_backend, text, m, path):
    """float16 x and result: the fused GEMM takes integer and mxfp4 weights that fill the GPU (8192
    rows) from 48 rows (64 for mxfp4) with no upper bound, on any GPU (no library path takes
    float16: docs/spec.md's bfloat16-weight rule is bfloat16's), and smaller weights (96 rows)
    from 65 rows; the rest the tensor-core kernel."""
    text, n = _plan_weight(text)
    w, x, _ = _f16_case(text, n, 256, m, 0)
    qd = cuda_backend.quantize(w, text)
    taken, y = _paths_taken(lambda: cuda_backend.linear(torch.from_numpy(x).cuda(), qd))
    assert taken == [path]
    _check16(y, REF.quantize(w, text), x, None, f"{text} M={m}")


@pytest.mark.skipif(SIM, reason="torch CUDA tensors need a GPU")
@pytest.mark.parametrize("text,m", [("q4s/block32:f16", 64), ("q4s/block32:f16", 200), ("q8s/block32:f16", 128),
                                    ("q4s/block32:f16", 640)])
def test_repeat_linear_calls_launch_what_the_first_call_made(cuda_backend, monkeypatch, text, m):
    """A repeat `linear` (same x shape, dtype and bias kind) on the fused GEMM (the compiled kernel
    launched directly, `fused.FusedLaunch`) or on dequantize + GEMM (M = 640: the packed dequantize
    launch) skips the path choice and gives the bits the whole way gives (a call with `stream=`
    takes it), for new x and bias values, into a new tensor or `out=`; an x or a bias off a 16-byte
    boundary, or a bias of another dtype, still gives them; a strided bias is read as it is."""
    from qcore_cuda import fused
    from qcore_cuda.paths import TAKEN, linear_repeat
    from qcore_cuda.paths import linear as paths_linear

    names = {type(p).__name__ for p in paths_linear.LINEAR}

    def chosen():  # (the linear paths chosen so far; a dequantize inside one counts its own)
        return {k_: v for k_, v in TAKEN.items() if k_ in names}

    monkeypatch.setattr(fused, "FILL_MIN", 0.0)  # (a small weight on the fused GEMM at 64+ rows)
    be = cuda_backend
    n, k = 192, 512
    w, x, b = _case(text, n, k, m, True, seed=5)
    qd = be.quantize(w, text)
    xt, bt = _bf16(x).cuda(), _bf16(b).cuda()
    fused_path = m <= 256

    def whole(x_, b_):  # (stream= given: the whole way, the path chosen again)
        return be.linear(x_, qd, b_, stream=torch.cuda.current_stream())

    first = be.linear(xt, qd, bt)
    assert torch.equal(first.view(torch.int16), whole(xt, bt).view(torch.int16))
    taken, launched = chosen(), fused.LAUNCHED.copy()
    rng = np.random.default_rng(6)
    for _ in range(3):
        x2 = _bf16(rng.standard_normal((m, k)).astype(BF16)).cuda()
        b2 = _bf16(rng.standard_normal(n).astype(BF16)).cuda()
        y = be.linear(x2, qd, b2)
        assert chosen() == taken  # (no path chosen: the repeat)
        out = torch.full_like(y, float("nan"))
        assert be.linear(x2, qd, b2, out=out) is out and chosen() == taken  # (out=: the repeat too)
        assert torch.equal(y.view(torch.int16), whole(x2, b2).view(torch.int16))
        assert torch.equal(out.view(torch.int16), y.view(torch.int16))
        taken = chosen()
    if fused_path:
        assert sum(fused.LAUNCHED.values()) - sum(launched.values()) == 9
        assert all(go.kept.compiled is not None for go in qd.data.cache.fused_launches.values())
    # x and bias off a 16-byte boundary (views 2 bytes in), and a float32 bias: the same bits as the whole way
    xs = torch.empty(m * k + 1, dtype=torch.bfloat16, device="cuda")[1:].view(m, k)
    xs.copy_(xt)
    bs = torch.empty(n + 1, dtype=torch.bfloat16, device="cuda")[1:]
    bs.copy_(bt)
    for x_, b_ in [(xs, bt), (xt, bs), (xt, bt.float())]:
        assert torch.equal(be.linear(x_, qd, b_).view(torch.int16), whole(x_, b_).view(torch.int16))
    strided = torch.empty(2 * n, dtype=torch.bfloat16, device="cuda")[::2]  # (a bias the GEMMs cannot read as it is)
    strided.copy_(bt)
    ys = be.linear(xt, qd, strided)
    _check(ys.view(torch.int16).cpu().numpy().view(np.uint16).view(BF16), REF.quantize(w, text), x, b,
           f"{text} M={m}, strided bias")
    assert torch.equal(be.linear(xt, qd, bt).view(torch.int16), first.view(torch.int16))
    rep = qd.data.cache.linear_repeats[(torch.bfloat16, xt.shape, True)]
    assert type(rep) is (linear_repeat.FusedRepeat if fused_path else linear_repeat.DequantizedRepeat)
    assert fused_path or rep.dequantize is not None  # (the packed bfloat16 dequantize launch)


_COMPILE = r"""
import json, os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from qcore_cuda import fast, fused, k_fused

sig = {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*fp32", "b_ptr": "*bf16", "y_ptr": "*bf16", "M": "i32", "N": "i32",
       "K": "i32", "row_bytes": "i32", "nsb": "i32", "unscale": "fp32"}
bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
out = []
for kind, block, tile, *f16 in json.loads(sys.argv[1]):
    f16 = bool(f16 and f16[0])
    t = fused.step_for(fused.Tile(*tile) if tile else fused.tile_for(128), kind, 1 << 12, block)  # (default: the plan's)
    const = {"KIND": kind, "BITS": fast.KIND_BITS[kind], "B": block, "HAS_BIAS": True, "F16": f16, "BN": t.bn,
             "BM": t.bm, "BK": t.bk}
    half = "*fp16" if f16 else "*bf16"
    sig = {**sig, "x_ptr": half, "b_ptr": half, "y_ptr": half}
    if t.form == fused.FORM_STAGED:
        from triton.experimental.gluon._runtime import GluonASTSource
        from qcore_cuda import k_staged

        const |= {"STAGES": t.stages, "num_warps": t.warps}
        src = GluonASTSource(fn=k_staged.fused_staged, signature={**sig, **{c: "constexpr" for c in const}},
                             constexprs=const, attrs={(i,): [["tt.divisibility", 16]] for i in range(10)})
        options = {"num_warps": t.warps}
    else:
        const["INTERPRETED"] = False
        fn = k_fused.fused_fields if t.form == fused.FORM_FIELDS else k_fused.fused_columns
        src = ASTSource(fn=fn, signature={**sig, **{c: "constexpr" for c in const}}, constexprs=const,
                        attrs={(i,): [["tt.divisibility", 16]] for i in range(9)})
        options = {"num_warps": t.warps, "num_stages": t.stages}
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        res = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
        sass = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    out.append({"kind": kind, "block": block, "form": t.form, "f16": f16,
                "wgmma": k.asm["ptx"].count("wgmma.mma_async"),
                "regs": int(re.search(r"REG:(\d+)", res).group(1)), "stack": int(re.search(r"STACK:(\d+)", res).group(1)),
                "hgmma": len(re.findall(r"\bHGMMA\.", sass)), "depbar": len(re.findall(r"WARPGROUP\.DEPBAR", sass))})
print(json.dumps(out))
"""


def _compiled(cases: list, tmp_path) -> list[dict]:
    """`_COMPILE` over (kind, block, tile or None) in a process without the interpreter switch."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    r = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(cases)], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_fused_kernel_compiles_for_sm90_without_spills(tmp_path):
    """The default plan's tile's kernel for every value kind (one scale slot a step, two, per row;
    both forms; bfloat16 and float16) compiles for sm_90 with Triton's own toolchain, no GPU needed, its product on
    wgmma and nothing in local memory (ptxas's stack frame 0: no spills; in a process without the
    interpreter switch)."""
    from qcore_cuda import fast

    cases = [(fast.KIND_I4, 32, None), (fast.KIND_I8, 32, None), (fast.KIND_I2, 0, None), (fast.KIND_E4M3, 128, None),
             (fast.KIND_E5M2, 0, None), (fast.KIND_E2M1, 16, None), (fast.KIND_I2, 16, None),  # (FORM_COLUMNS)
             (fast.KIND_I4, 32, None, True), (fast.KIND_I2, 16, None, True)]  # (float16)
    for c in _compiled(cases, tmp_path):
        assert c["wgmma"] > 0 and c["stack"] == 0, c


def test_staged_kernel_compiles_for_sm90_with_its_products_in_flight(tmp_path):
    """The staged form's Gluon kernel for every value kind and scale layout (one slot a step, two,
    four: a gather, per row) compiles for sm_90 with no spills and its `wgmma`s asynchronous: fewer
    warpgroup waits than products in the code (ptxas serializes them where it cannot keep the
    accumulators apart), in tiles of 8 warps and of 4, 128 x 256 included, and 8 warps on 64 weight
    rows (x's rows split between the warpgroups); bfloat16 and float16."""
    from qcore_cuda import fast, fused

    _need_gluon()
    wide, narrow, big = ([128, 128, 64, 8, 3, fused.FORM_STAGED], [64, 256, 64, 4, 4, fused.FORM_STAGED],
                         [128, 256, 64, 8, 3, fused.FORM_STAGED])
    split_x = [64, 256, 64, 8, 4, fused.FORM_STAGED]  # (the plan's past 128 rows: two warpgroups over x's rows)
    cases = [(fast.KIND_I4, 32, wide), (fast.KIND_E2M1, 16, wide), (fast.KIND_E2M1, 32, narrow), (fast.KIND_I8, 32, wide),
             (fast.KIND_E4M3, 128, narrow), (fast.KIND_E5M2, 0, wide), (fast.KIND_I2, 0, wide), (fast.KIND_I4, 16, big),
             (fast.KIND_I8, 32, big), (fast.KIND_I4, 32, split_x), (fast.KIND_E2M1, 32, split_x),
             (fast.KIND_I4, 32, narrow, True), (fast.KIND_E2M1, 32, wide, True), (fast.KIND_I8, 32, split_x, True)]
    for c in _compiled(cases, tmp_path):
        assert c["form"] == fused.FORM_STAGED and c["wgmma"] > 0 and c["stack"] == 0, c
        assert c["depbar"] < c["hgmma"], c


def test_a_launch_repeats_its_first_calls_kernel_with_every_argument_in_order(monkeypatch):
    """`fused.FusedLaunch`: after a first call with every tensor on a 16-byte boundary it launches
    the kernel the JIT returned directly, on the current stream, with the kernel's parameters in
    order (tensors, sizes, then the constants by name) as the JIT does; a call with a tensor off a
    16-byte boundary goes through the JIT again (its specialization assumed the boundary). A stand-in
    kernel and compiled kernel record the calls (no GPU or compiler needed)."""
    from qcore_cuda import fused, linear

    calls = []

    class Compiled:
        function, packed_metadata = "fn", "meta"

        def launch_metadata(self, grid, stream, *args):
            return None

        def run(self, g0, g1, g2, stream, function, packed, meta, enter, leave, *args):
            calls.append(("direct", (g0, g1, g2), stream, args))

    class Kernel:  # (fused_columns' parameters)
        arg_names = ["x_ptr", "w_ptr", "s_ptr", "b_ptr", "y_ptr", "M", "N", "K", "row_bytes", "nsb", "unscale", "KIND",
                     "BITS", "B", "HAS_BIAS", "F16", "BN", "BM", "BK", "INTERPRETED"]

        def __getitem__(self, grid):
            def jit(*args, **const):
                calls.append(("jit", grid, args, const))
                return Compiled()
            return jit

    class Ptr:
        def __init__(self, p):
            self.p = p

        def data_ptr(self):
            return self.p

    n, k, m = 96, 256, 20
    kind, P = linear.geometry((n, k), REF.quantize(np.ones((n, k), np.float32), "q8s/block32:f16").scheme)
    go = fused.FusedLaunch(kind, P, m, torch.device("cpu"), fused.Tile(32, 16, 64, 4, 1, fused.FORM_COLUMNS), True)
    monkeypatch.setattr(go, "kernel", Kernel())
    import triton.runtime

    class Driver:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device):
            return 1234

    monkeypatch.setattr(triton.runtime.driver, "_active", Driver())  # (what `driver.active` returns)
    x, w, sc, b, y = (Ptr(256 * i) for i in range(1, 6))
    x.shape, y.shape = (m, k), (m, n)
    go(x, w, sc, b, y)
    go(x, w, sc, b, y)
    off = Ptr(256 * 7 + 2)
    off.shape = (m, k)
    go(off, w, sc, b, y)
    go(x, w, sc, b, y)
    assert [c[0] for c in calls] == ["jit", "direct", "jit", "direct"]
    _, grid, args, const = calls[0]
    order = dict(zip(Kernel.arg_names, list(args) + [None] * len(const)))
    order.update(const)
    want = tuple(order[a] for a in Kernel.arg_names)
    assert calls[1] == ("direct", (grid[0], 1, 1), 1234, want)
    assert want[:5] == (x, w, sc, b, y) and want[5:11] == go.sizes and want[11:16] == (kind, 8, 32, True, False)


def test_staged_tiles_fall_back_where_they_cannot_run():
    """`fused.step_for`: a staged tile runs as the fields form where it cannot be formed: no
    Hopper GPU or Gluon, K not a multiple of its step (64 columns; 128 with 2-bit codes), or
    buffers past a block's shared memory."""
    from qcore_cuda import fast, fused

    t = fused.Tile(128, 128, 64, 8, 3, fused.FORM_STAGED)
    assert fused.step_for(t, fast.KIND_I4, 4096, 32).form == fused.FORM_STAGED
    assert fused.step_for(t, fast.KIND_I2, 4096, 0).bk == 128
    assert fused.step_for(t, fast.KIND_I4, 4096, 32, staged_ok=False).form == fused.FORM_FIELDS
    assert fused.step_for(t, fast.KIND_I4, 4096 + 32, 32).form != fused.FORM_STAGED
    big = fused.Tile(128, 256, 64, 8, 3, fused.FORM_STAGED)  # (2-bit: steps of 128 columns, 274 KiB)
    assert fused.step_for(big, fast.KIND_I2, 4096, 0).form != fused.FORM_STAGED
    split_x = fused.Tile(64, 256, 64, 8, 4, fused.FORM_STAGED)  # (8 warps on 64 weight rows: x's rows split)
    assert fused.step_for(split_x, fast.KIND_I4, 4096, 32).form == fused.FORM_STAGED
    assert fused.step_for(fused.Tile(64, 128, 64, 8, 4, fused.FORM_STAGED), fast.KIND_I4, 4096, 32).form == \
        fused.FORM_STAGED
    assert fused.step_for(fused.Tile(64, 64, 64, 8, 4, fused.FORM_STAGED), fast.KIND_I4, 4096, 32).form != \
        fused.FORM_STAGED  # (32 rows of x a warpgroup: not a tile the kernel takes)


@pytest.mark.skipif(SIM, reason="torch CUDA tensors need a GPU")
@pytest.mark.parametrize("text,m,path", [("q4s/block32:f16", 64, "FusedGemmLinear"), ("q8s", 128, "FusedGemmLinear"),
                                         ("q4s/block32:f16", 256, "FusedGemmLinear"), ("mxfp4", 64, "FusedGemmLinear"),
                                         ("mxfp4", 48, "TensorCoreLinear"),
                                         ("q4s/block32:f16", 32, "TensorCoreLinear"),
                                         ("q4s/block32:f16", 384, "DequantizedGemmLinear"),
                                         ("nvfp4", 64, "DequantizedGemmLinear"),
                                         ("q2s/block32:f16", 256, "DequantizedGemmLinear"),
                                         ("e4m3/block32:f32", 128, "DequantizedGemmLinear"),
                                         ("q4s/block32:f16 small", 128, "DequantizedGemmLinear"),
                                         ("q4s/block32:f16 small", 48, "TensorCoreLinear")])
def test_the_default_plan_takes_the_fused_gemm_where_it_was_timed_faster(cuda_backend, text, m, path):
    """With the defaults (`paths.linear.FUSED_M`, `fused.plan_takes`, `fused.fills`): the fused GEMM
    takes integer and mxfp4 weights that fill the GPU (8192 rows) at 48..256 rows of bfloat16 x
    (past 128 on a Hopper GPU; elsewhere dequantize + cuBLAS there), its staged form from 65 rows
    on a Hopper GPU; fewer rows the tensor-core kernel, more rows, nvfp4, an 8-bit minifloat
    weight, a staged tile past shared memory (2-bit codes' steps of 128 columns at 256 rows) or a
    weight too small to fill the GPU (96 rows) dequantize + cuBLAS (from 64 rows; the tensor-core
    kernel below)."""
    from qcore_cuda import fused

    text, n = _plan_weight(text)
    w, x, _ = _case(text, n, 256, m, False)
    qd = cuda_backend.quantize(w, text)
    hopper = fused.staged_ready(torch.device("cuda"))
    if path == "FusedGemmLinear" and m > fused.FIELDS_MAX_M and not hopper:
        path = "DequantizedGemmLinear"
    staged_before = fused.LAUNCHED[fused.FORM_STAGED]
    assert _paths_taken(lambda: cuda_backend.linear(_bf16(x).cuda(), qd))[0] == [path]
    staged = path == "FusedGemmLinear" and m > 64 and hopper
    assert fused.LAUNCHED[fused.FORM_STAGED] == staged_before + staged


@pytest.mark.parametrize("text,want", [("48,128", (48, 128)), ("1", (1, 1 << 62)), ("0", (0, 1 << 62))])
def test_fused_rows_read_from_the_environment(text, want):
    """`QCORE_CUDA_LINEAR_FUSED_M`: FROM,TO; FROM alone has no upper bound; 0 is never; anything
    else a one-line error naming the variable."""
    from qcore_cuda.paths import linear as paths_linear

    assert paths_linear._fused_rows(text) == want


@pytest.mark.parametrize("text", ["", "a,b", "1,2,3", "-1"])
def test_bad_fused_rows_are_refused(text):
    from qcore_cuda.paths import linear as paths_linear

    with pytest.raises(ValueError, match="QCORE_CUDA_LINEAR_FUSED_M"):
        paths_linear._fused_rows(text)


def test_fused_kinds_read_from_the_environment():
    """`QCORE_CUDA_LINEAR_FUSED_KINDS`: int or all; anything else a one-line error naming it."""
    from qcore_cuda.paths import linear as paths_linear

    assert paths_linear._fused_all_kinds("all") and not paths_linear._fused_all_kinds("int")
    with pytest.raises(ValueError, match="QCORE_CUDA_LINEAR_FUSED_KINDS='al'"):
        paths_linear._fused_all_kinds("al")


def test_the_plan_tiles_by_rows_of_x(monkeypatch):
    """`fused.tile_for`: the fields form's 64 x 64 up to 64 rows, then on a Hopper GPU the staged
    form's 64 weight rows by 128 rows of x on 4 warps up to 128 and by 256 on 8 beyond; elsewhere
    the fields form (64 x 64 up to `FIELDS_MAX_M`, 128 x 128 beyond); the tune variable replaces
    the choice."""
    from qcore_cuda import fused

    monkeypatch.delenv(fused.TUNE_ENV, raising=False)
    assert fused.tile_for(64) == fused.Tile(64, 64, 64, 4, 4, fused.FORM_FIELDS)
    assert fused.tile_for(65) == fused.Tile(64, 128, 64, 4, 4, fused.FORM_STAGED)
    assert fused.tile_for(129) == fused.Tile(64, 256, 64, 8, 4, fused.FORM_STAGED)
    assert fused.tile_for(128, staged=False) == fused.Tile(64, 64, 64, 4, 4, fused.FORM_FIELDS)
    assert fused.tile_for(129, staged=False).form == fused.FORM_FIELDS
    monkeypatch.setenv(fused.TUNE_ENV, "128,256,64,8,4,3")
    assert fused.tile_for(1) == fused.Tile(128, 256, 64, 8, 4, fused.FORM_STAGED)


def test_the_plan_needs_a_weight_that_fills_the_gpu(monkeypatch):
    """`fused.fills`: at least `FILL_MIN` 64-row weight tiles per SM (on a 132-SM GPU: 8192 rows
    fill it, 4096 do not; the edge at 119 tiles)."""
    from qcore_cuda import fused

    monkeypatch.setattr(fused, "sm_count", lambda: 132)
    assert fused.fills(8192) and fused.fills(28672) and fused.fills(119 * 64)
    assert not fused.fills(4096) and not fused.fills(118 * 64)
    assert fused.SMALL_F16_FROM_M == 65


def test_the_plan_takes_integer_and_mxfp4_weights():
    """`fused.plan_takes`: integer codes with any scales from 48 rows of x, E2M1 in blocks of 32
    or more (mxfp4) from 64; not nvfp4's blocks of 16 nor the 8-bit minifloats; `block_of` reads
    the block from the kernel geometry."""
    from qcore_cuda import fast, fused, linear

    def takes(text, m):
        q = REF.quantize(np.ones((16, 256), np.float32), text)
        kind, P = linear.geometry((16, 256), q.scheme)
        return fused.plan_takes(kind, fused.block_of(P), m)

    assert all(takes(t, 48) for t in ("q4s/block32:f16", "q8s", "q2s/block32:f16", "q4_0"))
    assert takes("mxfp4", 64) and not takes("mxfp4", 48) and not takes("q8s", 47)
    assert not any(takes(t, 128) for t in ("nvfp4", "e4m3/block32:f32", "mxfp8", "e5m2"))
    assert not fused.plan_takes(fast.KIND_E2M1, 16, 128)


def test_past_the_fields_rows_the_plan_needs_the_staged_form(monkeypatch):
    """`fused.plan_runs`: up to `FIELDS_MAX_M` rows any form; past them only where the staged form
    runs (not on the CPU, whose tiles are the fields form's; not where its step does not divide
    K), unless x is float16 or the tune variable names the tile."""
    from qcore_cuda import fast, fused

    cpu = torch.device("cpu")
    monkeypatch.delenv(fused.TUNE_ENV, raising=False)
    assert fused.plan_runs(fused.FIELDS_MAX_M, fast.KIND_I4, 4096, 32, cpu)
    assert not fused.plan_runs(fused.FIELDS_MAX_M + 1, fast.KIND_I4, 4096, 32, cpu)
    assert fused.plan_runs(fused.FIELDS_MAX_M + 1, fast.KIND_I4, 4096, 32, cpu, f16=True)  # (float16: any form)
    monkeypatch.setenv(fused.TUNE_ENV, "64,64,64,4,4,2")
    assert fused.plan_runs(fused.FIELDS_MAX_M + 1, fast.KIND_I4, 4096, 32, cpu)
