"""Property tests (hypothesis): random shapes and schemes on the reference backend."""
import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

import qcore
from qcore import Native, PackedNative, PackedU32, QuantScheme, QuantValue, ScaleDtype
from qcore.spec.schemes import base_scheme

ref = qcore.backend("reference")
DTYPES = list(ScaleDtype)


@st.composite
def cases(draw):
    rank = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=rank, max_size=rank)))
    value = draw(st.sampled_from(list(QuantValue)))
    s = base_scheme(value)  # unsigned values with a zero point (docs/spec.md, affine offsets)
    if not value.traits.is_float and not value.traits.unsigned and draw(st.booleans()):
        n = 1 << value.bits
        steps = draw(st.lists(st.floats(0.125, 4.0, width=32), min_size=n, max_size=n))
        table = np.cumsum(np.float32(steps)) - np.float32(sum(steps) / 2)
        s = s.with_mode("lookup", [float(t) for t in table])
    level = draw(st.sampled_from(["none", "tensor", "block"] + ([] if s.affine else ["two"])))
    bdims = draw(st.lists(st.integers(1, 5), min_size=1, max_size=rank))
    if level == "tensor":
        s = s.per_tensor(draw(st.sampled_from(DTYPES)))
    elif level == "block":
        s = s.per_block(bdims, draw(st.sampled_from(DTYPES)))
    elif level == "two":
        s = s.per_block(bdims, draw(st.sampled_from([ScaleDtype.F16, ScaleDtype.UE4M3]))).per_tensor()
    d = draw(st.integers(0, rank - 1))
    stores = [PackedU32(d)] + ([Native()] if value.bits == 8 else [PackedNative(d)])
    s = s.with_store(draw(st.sampled_from(stores)))
    seed = draw(st.integers(0, 2**31))
    mag = draw(st.sampled_from([1e-3, 1.0, 1e3]))
    x = (np.random.default_rng(seed).standard_normal(shape) * mag).astype(np.float32)
    return s, x


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_round_trip_codes_range_and_error_bound(case):
    s, x = case
    q = ref.quantize(x, s)
    d = q.to_data()
    assert ref.from_data(d).to_data() == d
    assert qcore.QuantizedData(d.shape, str(d.scheme), d.payload) == d
    codes = d.codes()
    t = s.traits
    if s.is_lookup:
        assert codes.max(initial=0) < (1 << t.bits)
    elif not t.is_float:
        assert codes.min(initial=0) >= t.qmin and codes.max(initial=0) <= t.qmax
    if not t.is_float and not s.is_lookup and x.size:
        from qcore.spec.arithmetic import effective_scale

        e = effective_scale(qcore.QParams(d.scales(), d.global_scale()), x.shape, s)
        err = np.abs(q.numpy() - x)
        # e/2, plus a few f32 ulps of x for the rounding of x / e (full-range y may reach 127.5000x);
        # a zero point (docs/spec.md, affine offsets) rounds z too: one step
        bound = e * np.float32(1.0 if s.affine else 0.5) + 4 * np.finfo(np.float32).eps * np.abs(x) + 1e-30
        over = err > bound
        if over.any():  # docs/spec.md, scale storage: a raw scale past its dtype's largest value
            # stores as that value (one level; a two-level global keeps the block scales in range), so codes clip
            level = s.block if s.block is not None else s.tensor
            assert s.block is None or s.tensor is None, "a two-level scheme clipped codes"
            assert np.all(e[over] >= np.float32(level.dtype.traits.max_value)), "codes clipped under a scale in range"
            assert np.all(np.isin(codes.reshape(x.shape)[over], (t.qmin, t.qmax))), "a clipped value is not an end code"


def test_saturated_scale_clips_codes():
    """The case that showed the error bound above needs the saturation branch: max |x| / h past
    UE4M3's 448 stores 448, and the values beyond 448 * qmax take the end codes."""
    x = np.array([[125.730225, -132.10486, 640.42267, 104.900116],
                  [-535.6694, 361.59506, 1304.0, 947.08093]], np.float32)
    d = ref.quantize(x, "q2f/tensor:ue4m3").to_data()
    assert d.scales().item() == 448.0
    codes = d.codes().reshape(x.shape)
    assert codes[1, 2] == codes[1, 3] == 1 and codes[1, 0] == -1  # 1304 and 947 clip; -535.7 rounds


@st.composite
def layout_cases(draw):
    """A random case of field orders or flat blocks (docs/spec.md): a packed store in a random field
    order, or a one-dim block level over the flattened tensor (or both)."""
    s, x = draw(cases())
    st_ = s.store
    if st_.kind.value != "native" and draw(st.booleans()):
        n = st_.word_bits // s.bits
        order = draw(st.sampled_from(["high", "split"]))
        s = s.with_field_order(order, n * draw(st.integers(2, 6)) if order == "split" else 0)
    if s.block is not None and len(s.block.dims) == 1 and st_.dim == 0 and draw(st.booleans()):
        s = s.per_block(s.block.dims, s.block.dtype, flat=True)
        if s.tensor is not None:
            s = s.per_tensor(s.tensor.dtype, reciprocal=s.tensor.reciprocal)
    return s, x


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout_cases())
def test_field_orders_and_flat_blocks_keep_the_codes_and_values(case):
    """A field order changes only where fields sit: the same codes and values as the byte layout's
    order, re-packed both ways losslessly. Flat blocks are the flattened tensor's bytes."""
    s, x = case
    try:
        d = ref.quantize(x, s).to_data()
    except qcore.InputError:  # a block or packing axis the shape cannot take
        return
    low = ref.quantize(x, s.low_order).to_data()
    assert d.in_low_order() == low
    assert np.array_equal(d.codes(), low.codes()) and np.array_equal(ref.dequantize(ref.from_data(d)),
                                                                      ref.dequantize(ref.from_data(low)))
    assert ref.from_data(d).to_data() == d and qcore.QuantizedData(d.shape, str(d.scheme), d.payload) == d
    if s.flat_blocks:
        assert d.payload == ref.quantize(x.reshape(-1), s.unflat).to_data().payload
