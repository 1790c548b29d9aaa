"""The `ndarray` plugin (backends/ndarray): capability table, bit-exactness against `reference`,
explicit params, errors, determinism and tensor ops (docs/spec.md: arithmetic, portable bytes,
backends).

These tests are backend-specific; the shared conformance suite lives in qcore/conformance.
Test ids are `<scheme>-<shape>[-<dtype>]`, so a failing case can be pasted back into `-k`.
"""
from __future__ import annotations

import itertools
import os
from importlib.metadata import entry_points

import ml_dtypes
import numpy as np
import pytest

import qcore
from qcore import InputError, QParams, QTensor, UnsupportedSchemeError
from qcore.backend import registry
from qcore.spec.codecs import SCALE_SLOTS, SCALES, VALUES

if "ndarray" not in os.environ.get("QCORE_REQUIRE_BACKENDS", "").split(","):  # CI requires it: fail, not skip
    pytest.importorskip("qcore_ndarray", reason="the ndarray plugin is not installed: pip install -e backends/ndarray")

from qcore_ndarray import kernels  # noqa: E402
from qcore_ndarray.plan import make_plan  # noqa: E402

nd = qcore.backend("ndarray")
ref = qcore.backend("reference")
RNG = np.random.default_rng(20261129)


def _x(shape, dtype=np.float32, seed=0):
    """Normal data with a different magnitude per row, so block scales differ."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * np.exp(rng.uniform(-6, 6, size=shape[:1] + (1,) * (len(shape) - 1)))
    return x.astype(dtype)


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def assert_same_bits(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Bit-for-bit equality; on failure name the mismatch count, first index and both values."""
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    bad = _bits(got) != _bits(want)
    if bad.any():
        i = tuple(int(v) for v in np.argwhere(bad)[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.size} differ; first at {i}: "
            f"ndarray {got[i]!r} (0x{int(_bits(got)[i]):x}) vs reference {want[i]!r} (0x{int(_bits(want)[i]):x})"
        )


def assert_same_tensor(a: QTensor, b: QTensor, out_dtypes=(np.float32,)) -> None:
    """Payload bytes, codes, scales, global scale and dequantized floats all identical."""
    da, db = a.to_data(), b.to_data()
    assert_same_bits(da.codes(), db.codes(), "codes")
    assert_same_bits(da.scales(), db.scales(), "scales")
    assert da.global_scale() == db.global_scale() or (
        np.float32(da.global_scale()).tobytes() == np.float32(db.global_scale()).tobytes())
    assert da.payload == db.payload, "payload bytes differ although codes and scales agree"
    for dt in out_dtypes:
        assert_same_bits(a.dequantize(dt), b.dequantize(dt), f"dequantize({np.dtype(dt).name})")


# --------------------------------------------------------------------------- registration


def test_registered_through_the_qcore_entry_point_group():
    eps = {ep.name: ep.value for ep in entry_points(group="qcore")}
    assert eps.get("ndarray") == "qcore_ndarray"
    assert "ndarray" in qcore.backends()
    assert "ndarray" not in registry.plugin_errors()
    assert nd.priority == 20 and nd.available()
    assert "numba" in nd.describe()


def test_auto_ranks_ndarray_above_reference_for_q8_only():
    q8 = registry.supporting_backends("q8s/block32:f16")
    assert "ndarray" in q8 and q8.index("ndarray") < q8.index("reference")
    assert qcore.backend("auto").pick("q8s/block32:f16").priority >= nd.priority
    assert "ndarray" not in registry.supporting_backends("q4s/block32:f16")


# --------------------------------------------------------------------------- capability table

VALUE_NAMES = [v for v in VALUES if not VALUES[v].unsigned]  # unsigned values need an affine offset: below
ACCEPTED_VALUES = {"q8f", "q8s"}  # docs/spec.md, backends: its table


def _scheme_for(value: str, mode: str, level: str) -> qcore.QuantScheme:
    s = qcore.QuantScheme(value)
    if mode == "lookup":
        s = s.with_mode("lookup", list(np.linspace(-1, 1, 1 << VALUES[value].bits)))
    if level in ("block", "two_level"):
        s = s.per_block([4], "f16")
    if level == "two_level":
        s = s.per_tensor("f32")
    return s


CAPABILITY = [
    (v, m, lvl)
    for v, m, lvl in itertools.product(VALUE_NAMES, ("symmetric", "lookup"), ("tensor", "block", "two_level"))
    if not (m == "lookup" and VALUES[v].is_float)  # LOOKUP on a minifloat is not a valid scheme
]


@pytest.mark.parametrize("value, mode, level", CAPABILITY, ids=[f"{v}-{m}-{lvl}" for v, m, lvl in CAPABILITY])
def test_capability_table(value, mode, level):
    s = _scheme_for(value, mode, level)
    sup = nd.supports(s)
    should = value in ACCEPTED_VALUES and mode == "symmetric"
    assert bool(sup) is should, f"{s}: {sup!r}"
    if should:
        return
    reason = "LOOKUP mode is not implemented" if mode == "lookup" else f"value {value} is not implemented"
    assert reason in sup.reason
    x = _x((4, 8))
    pattern = rf"backend 'ndarray' does not support {s.value}.*{reason}.*backends that do: .*reference"
    with pytest.raises(UnsupportedSchemeError, match=pattern):
        nd.quantize(x, s)
    with pytest.raises(UnsupportedSchemeError, match=pattern):
        nd.calibrate(x, s)
    with pytest.raises(UnsupportedSchemeError, match=pattern):
        nd.from_data(ref.quantize(x, s).to_data())
    # A tensor that claims to live here (as one built by hand would) is refused before its data is read.
    fake = QTensor(nd, s, x.shape, data=None)
    for call in (lambda: nd.dequantize(fake), lambda: nd.into_data(fake), lambda: nd.reshape(fake, (8, 4)),
                 lambda: nd.permute(fake, (1, 0)), lambda: nd.slice(fake, (slice(0, 2),)),
                 lambda: nd.cat([fake, fake]), lambda: nd.matmul(np.ones((2, 4), np.float32), fake)):
        with pytest.raises(UnsupportedSchemeError, match=pattern):
            call()


@pytest.mark.parametrize("text", ["q8s", "q8f/packed_u32", "q8s/packed_u32:2", "q8f/block2x3x4:bf16/packed_u32:1",
                                  "q8s/block1x2x1x2x2:ue8m0", "q8s/block8:ue4m3/tensor:f32", "q8s/tensor:f16"])
def test_every_store_level_and_scale_dtype_of_q8_is_supported(text):
    assert nd.supports(text), nd.supports(text)


def test_every_scale_dtype_is_supported():
    for dt in SCALES:
        assert nd.supports(f"q8s/block32:{dt}")
        assert nd.supports(f"q8f/tensor:{dt}")


# --------------------------------------------------------------------------- bit-exactness

SCHEMES = [
    "q8s", "q8f", "q8s/tensor:f16", "q8f/tensor:bf16", "q8s/tensor:ue8m0", "q8s/tensor:ue4m3",
    "q8s/block32:f16", "q8f/block32:ue8m0", "q8s/block4:f32", "q8f/block7:bf16", "q8s/block16:ue4m3",
    "q8s/block2x3:f16", "q8f/block3x1x4:ue8m0", "q8s/block1x2x3x2x2:bf16",
    "q8s/block4:ue4m3/tensor:f32", "q8f/block2x5:f16/tensor:f32",
    "q8s/packed_u32", "q8f/block4:f16/packed_u32", "q8s/packed_u32:1", "q8s/block3x4:ue8m0/packed_u32:1",
    "q8f/block2:ue4m3/tensor:f32/packed_u32:2",
]
# Shapes chosen for: empty, single element, primes (partial edge blocks everywhere), lengths just
# off multiples of 4 (PackedU32 padding), rank 1..5, a zero extent in the middle.
SHAPES = [(0,), (1,), (37,), (5, 7), (4, 33), (3, 0, 5), (3, 5, 9), (2, 3, 5, 7), (2, 3, 2, 5, 6)]
DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64]


def _cases():
    for text, shape in itertools.product(SCHEMES, SHAPES):
        sch = qcore.scheme(text)
        rank_needed = max(len(sch.block.dims) if sch.block else 1, sch.store.dim + 1)
        if len(shape) >= rank_needed:
            yield text, shape


CASES = list(_cases())


@pytest.mark.parametrize("text, shape", CASES, ids=[f"{t}-{s}".replace(" ", "") for t, s in CASES])
def test_bit_exact_calibrated(text, shape):
    x = _x(shape, seed=hash((text, shape)) % 1000)
    for method in ("minmax", "absmean"):
        assert nd.calibrate(x, text, method=method) == ref.calibrate(x, text, method=method), method
        assert_same_tensor(nd.quantize(x, text, method=method), ref.quantize(x, text, method=method))


DTYPE_CASES = [(t, s, d) for t in ("q8s", "q8f/block32:ue8m0", "q8s/block2x3:f16/tensor:f32")
               for s in ((5, 7), (3, 65)) for d in DTYPES]


@pytest.mark.parametrize("text, shape, dtype", DTYPE_CASES,
                         ids=[f"{t}-{s}-{np.dtype(d).name}".replace(" ", "") for t, s, d in DTYPE_CASES])
def test_bit_exact_input_and_output_dtypes(text, shape, dtype):
    x = _x(shape, dtype, seed=3)
    assert_same_tensor(nd.quantize(x, text), ref.quantize(x, text), out_dtypes=DTYPES)


def test_bit_exact_non_contiguous_and_list_inputs():
    x = _x((6, 40))
    assert_same_tensor(nd.quantize(x[:, ::3], "q8s/block4:f16"), ref.quantize(x[:, ::3], "q8s/block4:f16"))
    assert_same_tensor(nd.quantize(x.T, "q8f/block2x8:bf16"), ref.quantize(x.T, "q8f/block2x8:bf16"))
    assert_same_tensor(nd.quantize([[1.0, -2.5, 3.25]], "q8s"), ref.quantize([[1.0, -2.5, 3.25]], "q8s"))


@pytest.mark.parametrize("shape, text", [
    ((2, 3, 2, 2, 3, 5), "q8s/block2x3:f16/packed_u32:4"),  # packing axis among the leading axes
    ((3, 2, 2, 3, 2, 2, 5), "q8f/block2x1x2x5:ue4m3/tensor:f32/packed_u32:5"),
    ((2, 2, 2, 2, 2, 2, 2, 9), "q8s/block2x1x2x2x4:ue8m0/packed_u32:6"),  # 8 axes survive folding
])
def test_bit_exact_high_rank_folding(shape, text):
    x = _x(shape, seed=7)
    assert_same_tensor(nd.quantize(x, text), ref.quantize(x, text))


@pytest.mark.parametrize("text", ["q8s/block4:f16", "q8s/block4:ue4m3/tensor:f32", "q8f/block4:ue8m0", "q8s"])
def test_bit_exact_special_values(text):
    """Zeros (zero scales), tiny and huge magnitudes, ±0, values at rint ties."""
    tiny = np.float32(1e-44)
    x = np.float32([0, 0, 0, 0, -0.0, 0, tiny, -tiny, 3e38, -3e38, 1, 2,
                    0.5, 1.5, 2.5, -2.5, 1e-30, 3e-38, -1e-39, 5e-41, 127, -128, 254, 255])
    assert_same_tensor(nd.quantize(x, text), ref.quantize(x, text))
    assert_same_tensor(nd.quantize(x, text, method="absmean"), ref.quantize(x, text, method="absmean"))


@pytest.mark.parametrize("text", ["q8s", "q8s/block8:f32", "q8s/packed_u32:1"])
def test_true_division_not_reciprocal_multiply(text):
    """The spec's quantize rule: y = x / e. Near-ties where x * (1/e) rounds the other way must follow x / e."""
    e = np.float32(np.float32(3) / np.float32(127) * np.float32(1.0001))
    x = ((np.arange(-508, 508, dtype=np.float32) * np.float32(0.25) + np.float32(0.5)) * e).astype(np.float32)
    x = x.reshape(8, 127)
    recip = np.clip(np.rint(x * (np.float32(1) / e)), -127, 127)
    true = np.clip(np.rint(x / e), -127, 127)
    assert (recip != true).sum() > 0  # the data does tell the two apart
    grid = qcore.spec.layout.grid_shape(x.shape, qcore.scheme(text))
    q = nd.quantize(x, text, params=QParams(np.full(grid, e, np.float32)))
    assert_same_bits(q.to_data().codes(), true.astype(np.int8), "codes")


@pytest.mark.parametrize("slot", range(len(SCALE_SLOTS)),
                         ids=[f"{t.traits.name}-{t.rule}{t.emax if t.rule == 'mx' else ''}" for t in SCALE_SLOTS])
def test_round_scale_kernel_matches_codecs(slot):
    """kernels.round_scale_scalar (fused path) equals qcore.spec.codecs' numpy rule on every exponent,
    for every scale dtype under every rounding rule (`SCALE_SLOTS`)."""
    exps = np.arange(0, 255, dtype=np.uint32) << np.uint32(23)
    mants = np.array([0, 1, 0x1FFF, 0x2000, 0xFFFF, 0x10000, 0xFFFFF, 0x100000, 0x400000, 0x7FFFFF], np.uint32)
    bits = (exps[:, None] | mants[None, :]).reshape(-1)
    bits = np.concatenate([bits, RNG.integers(0, 0x7F800000, 20000, dtype=np.uint32)])
    s = bits.view(np.float32)
    got = kernels.round_scale_array(s, slot)
    assert_same_bits(got, SCALE_SLOTS[slot].store(s), f"slot {SCALE_SLOTS[slot]}")


def test_cached_kernels_are_keyed_on_the_codecs_tables():
    """The kernels freeze qcore.spec.codecs' tables in; numba's disk cache keys on kernels.py only, so
    each cached kernel's key also carries a hash of qcore/spec/codecs.py (an edit there, or an upgrade,
    compiles again instead of loading stale tables)."""
    import hashlib

    from qcore.spec import codecs

    want = ("qcore.spec.codecs", hashlib.sha256(open(codecs.__file__, "rb").read()).hexdigest())
    disp = kernels.round_scale_array
    sig = disp.signatures[0] if disp.signatures else None
    if sig is None:
        disp(np.float32([1.0]), 0)
        sig = disp.signatures[0]
    key = disp._cache._index_key(sig, disp.targetctx.codegen())
    assert key[-1] == want


# --------------------------------------------------------------------------- explicit params


@pytest.mark.parametrize("text", ["q8s", "q8f/block4:f16", "q8s/block2x3:ue8m0/packed_u32:1",
                                  "q8s/block4:ue4m3/tensor:f32", "q8f/tensor:bf16"])
def test_params_path_is_bit_exact(text):
    x = _x((5, 12), seed=5)
    grid = qcore.spec.layout.grid_shape(x.shape, qcore.scheme(text))
    sch = qcore.scheme(text)
    calibrated = ref.calibrate(x, text)
    chosen = QParams(RNG.uniform(0, 0.05, grid).astype(np.float32), 0.75 if sch.two_level else None)
    zeros = QParams(np.zeros(grid, np.float32), 0.0 if sch.two_level else None)
    # subnormal scales: x / e overflows to inf (-> qmin/qmax) and dequantized values are subnormal
    tiny = QParams(np.full(grid, 1e-45 if not sch.two_level else 3e-3, np.float32), 1e-42 if sch.two_level else None)
    for p in (calibrated, chosen, zeros, tiny):
        assert_same_tensor(nd.quantize(x, text, params=p), ref.quantize(x, text, params=p))


def test_params_are_checked_by_the_base_class():
    with pytest.raises(InputError, match="params.scales must be finite and >= 0"):
        nd.quantize(_x((4, 8)), "q8s/block4", params=QParams(np.full((4, 2), -1.0, np.float32)))
    with pytest.raises(InputError, match="block grid"):
        nd.quantize(_x((4, 8)), "q8s/block4", params=QParams(np.ones((4, 3), np.float32)))


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("text", ["q8s", "q8s/block4:f16", "q8f/block2x2:ue4m3/tensor:f32",
                                  "q8s/block3:bf16/packed_u32:1"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_non_finite_input_names_the_first_index(text, bad):
    x = _x((4, 9))
    x[2, 5] = bad
    x[3, 1] = np.nan
    msg = rf"input has {bad} at index \(2, 5\); quantization needs finite values"
    with pytest.raises(InputError, match=msg):
        nd.quantize(x, text)
    with pytest.raises(InputError, match=msg):
        nd.calibrate(x, text, method="absmean")
    with pytest.raises(InputError, match=msg):
        nd.quantize(x, text, params=ref.calibrate(np.nan_to_num(x, posinf=1, neginf=1), text))


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
def test_float64_overflow_is_reported_as_inf():
    x = np.zeros((2, 3))
    x[1, 2] = 1e300  # becomes inf in float32 (docs/spec.md, arithmetic: inputs are converted to f32 first)
    with pytest.raises(InputError, match=r"input has inf at index \(1, 2\)"):
        nd.quantize(x, "q8s")


@pytest.mark.parametrize("text, shape, match", [
    ("q8s/block2x2x2", (8,), "block 2x2x2 has 3 dims but the tensor has rank 1"),
    ("q8s/packed_u32:2", (4, 4), "packing axis 2 of q8s/packed_u32:2 needs rank > 2"),
])
def test_shape_errors(text, shape, match):
    with pytest.raises(InputError, match=match):
        nd.quantize(np.ones(shape, np.float32), text)


def test_scalar_and_integer_inputs_are_refused():
    with pytest.raises(InputError, match="rank >= 1"):
        nd.quantize(np.float32(1.0), "q8s")
    with pytest.raises(InputError, match="cannot be quantized"):
        nd.quantize(np.ones(4, np.int32), "q8s")


# --------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("text", ["q8s", "q8s/block32:f16", "q8s/block8:ue4m3/tensor:f32"])
def test_deterministic_across_runs_and_thread_counts(text):
    import numba

    x = _x((64, 3000), seed=11)  # enough slots for many parallel tasks
    first = nd.quantize(x, text, method="absmean").to_data()
    assert nd.quantize(x, text, method="absmean").to_data() == first
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one_thread = nd.quantize(x, text, method="absmean").to_data()
    finally:
        numba.set_num_threads(before)
    assert one_thread == first


# --------------------------------------------------------------------------- portable bytes and ops


def test_from_data_and_moves_between_backends():
    x = _x((6, 70))
    for text in ("q8s/block2x32:f16/packed_u32:1", "q8f/block16:ue4m3/tensor:f32"):
        d = ref.quantize(x, text).to_data()
        q = nd.from_data(d)
        assert q.backend is nd and q.to_data() == d
        assert_same_bits(q.dequantize(), ref.from_data(d).dequantize(), "from_data")
        assert q.to("reference").to_data() == d


OPS_X = _x((6, 64), seed=2)


@pytest.mark.parametrize("text", ["q8s", "q8s/block32:f16", "q8f/block2x8:ue8m0/packed_u32:1",
                                  "q8s/block16:ue4m3/tensor:f32"])
def test_ops_match_reference(text):
    a, b = nd.quantize(OPS_X, text), ref.quantize(OPS_X, text)
    assert_same_tensor(nd.permute(a, (1, 0)), ref.permute(b, (1, 0)))
    assert_same_tensor(nd.reshape(a, (3, 2, 64)), ref.reshape(b, (3, 2, 64)))
    assert_same_tensor(nd.reshape(a, (12, 32)), ref.reshape(b, (12, 32)))  # may requantize
    assert_same_tensor(nd.slice(a, (slice(2, 4), slice(0, 32))), ref.slice(b, (slice(2, 4), slice(0, 32))))
    assert_same_tensor(nd.slice(a, (slice(1, 5), slice(3, 40))), ref.slice(b, (slice(1, 5), slice(3, 40))))
    assert_same_tensor(nd.cat([a, a], axis=0), ref.cat([b, b], axis=0))
    for q in (nd.permute(a, (1, 0)), nd.slice(a, (slice(2, 4),)), nd.cat([a, a], 0)):
        assert q.backend is nd
    w_nd, w_ref = nd.permute(a, (1, 0)), ref.permute(b, (1, 0))  # [64, 6]
    xm = _x((3, 64), seed=9)
    assert_same_bits(nd.matmul(xm, w_nd), ref.matmul(xm, w_ref), "matmul")


@pytest.mark.parametrize("text", ["q8s", "q8f/block32:ue8m0", "q8s/block64x8:f16/packed_u32",
                                  "q8s/block16:ue4m3/tensor:f32", "q8s/packed_u32:1"])
def test_matmul_in_row_steps_matches_reference(text):
    """K = 2100 spans three 1024-row steps and a partial one; the f32 sums match bit for bit."""
    w = _x((2100, 24), seed=4)
    xm = _x((2, 3, 2100), seed=5)
    got = nd.matmul(xm, nd.quantize(w, text))
    assert_same_bits(got, ref.matmul(xm, ref.quantize(w, text)), "matmul")
    np.testing.assert_allclose(got, xm @ ref.quantize(w, text).numpy(), rtol=1e-4, atol=1e-2)


def test_matmul_errors_come_from_the_core():
    w = nd.quantize(_x((8, 4)), "q8s")
    with pytest.raises(InputError, match=r"matmul shapes do not fit"):
        nd.matmul(np.ones((2, 5), np.float32), w)
    with pytest.raises(InputError, match="matmul needs a 2-D weight"):
        nd.matmul(np.ones((2, 4), np.float32), nd.quantize(_x((2, 4, 4)), "q8s"))


def test_plan_folds_to_eight_axes():
    p = make_plan((2, 3, 4, 5), qcore.scheme("q8s/block5"))
    assert list(p.shp) == [1] * 7 + [120] and list(p.blk[-1:]) == [5]
    p = make_plan((2, 3, 4, 5), qcore.scheme("q8s/block2x5/packed_u32:2"))
    assert list(p.shp[-3:]) == [2, 3, 20] and p.pa == 6  # the packing axis is never merged


# --------------------------------------------------------------------------- random schemes

from hypothesis import given, settings, strategies as st  # noqa: E402


@st.composite
def _scheme_and_shape(draw):
    rank = draw(st.integers(1, 5))
    shape = tuple(draw(st.lists(st.integers(0, 7), min_size=rank, max_size=rank)))
    s = qcore.QuantScheme(draw(st.sampled_from(["q8s", "q8f"])))
    level = draw(st.sampled_from(["tensor", "block", "two_level"]))
    if level != "tensor":
        k = draw(st.integers(1, rank))
        dims = draw(st.lists(st.integers(1, 5), min_size=k, max_size=k))
        dt = draw(st.sampled_from(["f16", "ue4m3"] if level == "two_level" else list(SCALES)))
        s = s.per_block(dims, dt)
        if level == "two_level":
            s = s.per_tensor("f32")
    else:
        s = s.per_tensor(draw(st.sampled_from(list(SCALES))))
    if draw(st.booleans()):
        s = s.with_store(qcore.PackedU32(draw(st.integers(0, rank - 1))))
    return s, shape


@settings(max_examples=60, deadline=None)
@given(case=_scheme_and_shape(), seed=st.integers(0, 2**16), method=st.sampled_from(["minmax", "absmean"]))
def test_random_schemes_and_shapes_are_bit_exact(case, seed, method):
    """Any Q8 scheme on any small shape: the 8-axis folding, edge blocks and packing agree."""
    s, shape = case
    x = _x(shape, seed=seed) if shape else np.zeros(shape, np.float32)
    assert_same_tensor(nd.quantize(x, s, method=method), ref.quantize(x, s, method=method))
