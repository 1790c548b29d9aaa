"""Tensor ops on quantized tensors (qcore.backend.ops), on the reference backend."""
import numpy as np
import pytest

import qcore
from qcore import InputError

ref = qcore.backend("reference")
RNG = np.random.default_rng(11)
X = RNG.standard_normal((6, 64)).astype(np.float32)


@pytest.mark.parametrize("text", ["q8s", "q4s/block32:f16", "nvfp4", "e4m3/block2x8:bf16/packed_u32:1"])
def test_permute_is_exact(text):
    q = ref.quantize(X, text)
    t = ref.permute(q, (1, 0))
    assert t.shape == (64, 6)
    np.testing.assert_array_equal(t.numpy(), q.numpy().T)
    np.testing.assert_array_equal(ref.transpose(t).numpy(), q.numpy())


def test_permute_moves_block_dims():
    t = ref.permute(ref.quantize(X, "q4s/block32:f16"), (1, 0))
    assert str(t.scheme) == "q4s/block32x1:f16"


@pytest.mark.parametrize("text, new, exact", [
    ("q8s", (12, 32), True), ("q8s", (-1,), True), ("q4s/block32:f16", (3, 2, 64), True),
    ("q4s/block32:f16", (12, 32), False),
])
def test_reshape(text, new, exact):
    q = ref.quantize(X, text)
    r = ref.reshape(q, new)
    want = q.numpy().reshape(new)
    if exact:
        np.testing.assert_array_equal(r.numpy(), want)
    else:  # requantized with the same scheme
        assert str(r.scheme) == text
        np.testing.assert_array_equal(r.numpy(), ref.quantize(want, text).numpy())


def test_reshape_bad_size():
    with pytest.raises(InputError, match="cannot reshape"):
        ref.reshape(ref.quantize(X, "q8s"), (5, 5))


@pytest.mark.parametrize("text, index, exact", [
    ("q8s", (slice(1, 4), slice(3, 50)), True),
    ("q4s/block32:f16", (slice(1, 4), slice(32, 64)), True),
    ("q4s/block32:f16", (slice(0, 6), slice(0, 40)), True),
    ("q4s/block32:f16", (slice(0, 2), slice(5, 40)), False),
])
def test_slice(text, index, exact):
    q = ref.quantize(X, text)
    s = ref.slice(q, index)
    want = q.numpy()[index]
    if exact:
        np.testing.assert_array_equal(s.numpy(), want)
    else:
        np.testing.assert_array_equal(s.numpy(), ref.quantize(want, text).numpy())


def test_slice_step_refused():
    with pytest.raises(InputError, match="steps other than 1"):
        ref.slice(ref.quantize(X, "q8s"), (slice(0, 6, 2),))


@pytest.mark.parametrize("text", ["q4s/block32:f16", "q8s/block16:f16/tensor:f32"])
def test_cat_block_aligned_is_exact(text):
    a = ref.quantize(X[:, :32], text) if "tensor" not in text else None
    parts = [ref.slice(ref.quantize(X, text), (slice(None), slice(0, 32))),
             ref.slice(ref.quantize(X, text), (slice(None), slice(32, 64)))]
    c = ref.cat(parts, axis=1)
    np.testing.assert_array_equal(c.numpy(), ref.quantize(X, text).numpy())
    del a


def test_cat_unequal_per_tensor_scales_requantizes():
    a, b = ref.quantize(X[:3], "q8s"), ref.quantize(X[3:] * 2, "q8s")
    c = ref.cat([a, b], axis=0)
    want = np.concatenate([a.numpy(), b.numpy()])
    np.testing.assert_array_equal(c.numpy(), ref.quantize(want, "q8s").numpy())


def test_cat_mismatched_schemes_refused():
    with pytest.raises(InputError, match="cat needs one scheme"):
        ref.cat([ref.quantize(X, "q8s"), ref.quantize(X, "q4s")])


@pytest.mark.parametrize("text", ["q8s", "q4s/block32:f16", "nvfp4", "q2f/block4x8:bf16", "nf4"])
def test_matmul_matches_dequantized_product(text):
    w = ref.quantize(RNG.standard_normal((64, 24)).astype(np.float32), text)
    x = RNG.standard_normal((3, 64)).astype(np.float32)
    got = ref.matmul(x, w)
    want = x @ w.numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_matmul_in_small_steps_matches():
    from qcore.backend import ops

    w = ref.quantize(RNG.standard_normal((96, 8)).astype(np.float32), "q4s/block32:f16")
    x = RNG.standard_normal((2, 96)).astype(np.float32)
    np.testing.assert_allclose(ops.matmul(ref, x, w, rows_per_step=1), x @ w.numpy(), rtol=1e-5, atol=1e-5)


def test_matmul_shape_errors():
    w = ref.quantize(X, "q8s")
    with pytest.raises(InputError, match="shapes do not fit"):
        ref.matmul(np.ones((2, 5), np.float32), w)
