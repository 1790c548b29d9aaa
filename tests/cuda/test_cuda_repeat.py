"""Repeat calls (backends/cuda/qcore_cuda/_repeat.py): a quantize or dequantize of a shape and
scheme that the fast kernels already served skips the checks and the path choice. What such a
call returns and raises must be what the whole way returns and raises: the reference's bytes,
InputError for a non-finite or strided x, InvalidDataError naming the element of a bad code.

Runs under the simulator (CI) on small tensors and on the GPU; the alignment case can only be
taken on a GPU (the simulator's arrays have no addresses), and says so where it checks less.
"""
from __future__ import annotations

import numpy as np
import pytest

from qcore.conformance.invalid import with_code
from qcore.errors import InputError, InvalidDataError
from qcore.backend.reference import ReferenceBackend
from qcore.spec.schemes import scheme as parse_scheme

from tests.cuda_cases import SIM, assert_same_floats, sample_x

pytest.importorskip("numba")
pytest.importorskip("qcore_cuda")

from numba import cuda  # noqa: E402
from qcore_cuda import _repeat  # noqa: E402

REF = ReferenceBackend()
FAST = ["q4s/block32:f16", "q8s/block32:f16", "e4m3/block32:f32", "q8s", "nvfp4"]  # one pass; two passes


@pytest.fixture
def be(cuda_backend):
    if not cuda_backend.state.fast.usable:
        pytest.skip(f"the fast kernels are off here ({cuda_backend.state.fast.why}): no call repeats")
    return cuda_backend


def _hits(op: str) -> int:
    return _repeat.HITS[op]


@pytest.mark.parametrize("text", FAST)
def test_repeat_calls_give_the_whole_ways_results(be, text):
    """The second and third quantize of a key are repeats and write the reference's bytes; the
    first dequantize of a tensor packs its launch, the next ones are repeats with the same
    floats."""
    x = sample_x((4, 64), seed=31)
    xd = cuda.to_device(x)
    first = be.quantize(xd, text)
    before = _hits("quantize")
    again = [be.quantize(xd, text) for _ in range(2)]
    assert _hits("quantize") == before + 2, "a repeated quantize took the whole way"
    want = REF.quantize(x, text).to_data()
    for q in [first, *again]:
        assert q.scheme == parse_scheme(text) and q.shape == (4, 64)
        assert q.to_data().payload == want.payload, f"{text}: a repeat wrote other bytes"
    y_want = REF.dequantize(REF.from_data(want))
    before = _hits("dequantize")
    ys = [be.dequantize(again[-1]) for _ in range(3)]
    assert _hits("dequantize") == before + 2, "a repeated dequantize took the whole way"
    for y in ys:
        assert_same_floats(y.copy_to_host(), y_want, f"{text} dequantize")


def test_repeat_keys_hold_shape_scheme_and_dtype(be):
    """Another shape, the scheme as another text, or float16 input are new keys: the whole way
    (then remembered), each with its own correct bytes."""
    text = "q4s/block32:f16"
    x = sample_x((8, 64), seed=32)
    be.quantize(cuda.to_device(x), text)
    for other, xin in ((text, sample_x((2, 128), seed=33)), ("Q4S/block32:f16", x), (text, x.astype(np.float16))):
        before = _hits("quantize")
        q = be.quantize(cuda.to_device(xin), other)
        assert _hits("quantize") == before, f"{other} on {xin.shape} {xin.dtype} was served as a repeat"
        assert q.to_data().payload == REF.quantize(xin.astype(np.float32), text).to_data().payload


def test_repeat_quantize_raises_for_non_finite_input_then_recovers(be):
    """A NaN reaching a repeat raises the whole way's InputError naming it; the statistics
    scratch is rebuilt and the next repeat is correct again (both one- and two-pass schemes)."""
    for text in ("q8s/block32:f16", "nvfp4"):
        x = sample_x((4, 64), seed=34)
        be.quantize(cuda.to_device(x), text)
        bad = x.copy()
        bad[2, 7] = np.nan
        before = _hits("quantize")
        with pytest.raises(InputError, match=r"nan at index \(2, 7\)"):
            be.quantize(cuda.to_device(bad), text)
        assert _hits("quantize") == before + 1, "the NaN case did not run as a repeat"
        q = be.quantize(cuda.to_device(x), text)
        assert q.to_data().payload == REF.quantize(x, text).to_data().payload, f"{text} after a NaN"


def test_empty_tensors_take_the_whole_way(be):
    """A tensor without elements never launches, so it is never a repeat: the same (scale-only)
    bytes as the reference every time."""
    x = np.zeros((0, 64), np.float32)
    for text in ("q8s", "nvfp4", "q4s/block32:f16"):
        want = REF.quantize(x, text).to_data().payload
        for _ in range(2):
            assert be.quantize(cuda.to_device(x), text).to_data().payload == want, text


def test_repeat_quantize_reports_bad_arguments_as_the_whole_way(be):
    """An unhashable scheme or method given with a remembered x: the whole way's SchemeError or
    InputError, not a TypeError from the repeat table."""
    from qcore.errors import SchemeError

    xd = cuda.to_device(sample_x((4, 64), seed=43))
    be.quantize(xd, "q8s/block32:f16")
    with pytest.raises(SchemeError):
        be.quantize(xd, ["q8s/block32:f16"])
    with pytest.raises(InputError):
        be.quantize(xd, "q8s/block32:f16", method=["minmax"])


def test_repeat_quantize_refuses_strided_input(be):
    """A strided device view of a remembered shape gets the whole way's InputError."""
    text = "q4s/block32:f16"
    be.quantize(cuda.to_device(sample_x((4, 64), seed=35)), text)
    wide = cuda.to_device(sample_x((4, 128), seed=36))
    with pytest.raises(InputError, match="C-contiguous"):
        be.quantize(wide[:, ::2], text)


def test_repeat_quantize_of_misaligned_input(be):
    """x starting 4 bytes past a 16-byte boundary: the fast kernels' vector loads cannot read it,
    so the call takes the whole way (on a GPU; the simulator has no addresses) and is correct."""
    text = "q8s/block32:f16"
    x = sample_x((4, 64), seed=37)
    be.quantize(cuda.to_device(x), text)
    buf = cuda.to_device(np.concatenate([np.zeros(1, np.float32), x.reshape(-1)]))
    xm = buf[1:].reshape(4, 64)
    before = _hits("quantize")
    q = be.quantize(xm, text)
    if not SIM:
        assert _hits("quantize") == before, "a misaligned x was served by the fast kernels' repeat"
    assert q.to_data().payload == REF.quantize(x, text).to_data().payload


@pytest.mark.parametrize("text", ["q4s/block32:f16", "e4m3/block32:f32"])
def test_repeat_dequantize_raises_for_invalid_codes_then_recovers(be, text):
    """Bytes rewritten under a remembered tensor over the caller's memory (quantize's out=
    array) to hold an invalid code (docs/spec.md, invalid codes): the repeat reads the flag, raises
    InvalidDataError naming the element, re-zeroes the flag, and decodes the good bytes again
    afterwards."""
    x = sample_x((4, 64), seed=38)
    d = REF.quantize(x, text).to_data()
    buf = cuda.device_array(len(d.payload), np.uint8)
    q = be.quantize(cuda.to_device(x), text, out=buf)
    be.dequantize(q)
    be.dequantize(q)
    assert q.data.cache.dequantize_repeat is not None and not q.data.codes_checked()
    field = int(np.flatnonzero(~d.scheme.valid_fields)[-1])
    bad = with_code(d, (2, 9), field)
    buf.copy_to_device(np.frombuffer(bad.payload, np.uint8))
    before = _hits("dequantize")
    with pytest.raises(InvalidDataError, match=r"element \(2, 9\)"):
        be.dequantize(q)
    assert _hits("dequantize") == before + 1, "the invalid code was not met by a repeat"
    buf.copy_to_device(np.frombuffer(d.payload, np.uint8))
    assert_same_floats(be.dequantize(q).copy_to_host(), REF.dequantize(REF.from_data(d)), f"{text} after")


@pytest.mark.parametrize("text", ["q4s/block32:f16", "e4m3/block32:f32"])
def test_codes_are_checked_once_per_tensor_of_the_backends_memory(be, text, monkeypatch):
    """Invalid codes raise no later than a tensor's first dequantize (docs/spec.md). A tensor in
    the backend's own memory is read once: its first dequantize reads the flag, later ones (the
    whole way and repeats, quantize out= into it between them) read none, so they do not wait;
    a tensor made from bad bytes raises at every dequantize."""
    from qcore_cuda._scratch import Scratch

    reads = []
    real = Scratch.read_flag
    monkeypatch.setattr(Scratch, "read_flag",
                        lambda self, flag, s, ready=None: reads.append(1) or real(self, flag, s, ready))
    x = sample_x((4, 64), seed=40)
    d = REF.quantize(x, text).to_data()
    q = be.from_data(d)
    be.dequantize(q)
    assert len(reads) == 1 and q.data.codes_checked()
    be.quantize(cuda.to_device(x), text, out=q)  # the quantize kernels write only values
    reads.clear()
    ys = [be.dequantize(q), be.dequantize(q), be.dequantize(q, np.float16)]
    assert reads == [], "a checked tensor's dequantize read the flag"
    want = REF.dequantize(REF.from_data(d))
    assert_same_floats(ys[1].copy_to_host(), want, text)
    field = int(np.flatnonzero(~d.scheme.valid_fields)[-1])
    bad = be.from_data(with_code(d, (1, 3), field))
    for _ in range(2):
        with pytest.raises(InvalidDataError, match=r"element \(1, 3\)"):
            be.dequantize(bad)
    assert not bad.data.codes_checked()


@pytest.mark.parametrize("text", ["q4s/block32:f16", "q4s/block32:f16/packed_native/order:high"])
def test_repeat_matmul_gives_the_whole_ways_result(be, text):
    """A weight's second product with x of one shape launches the packed kernel directly, into a
    new array or out=, and gives the first call's floats bit for bit (a field order
    included); x of another shape or dtype takes the whole way. The simulator runs the field
    order at M = 1 only."""
    rng = np.random.default_rng(39)
    w = be.quantize(cuda.to_device(rng.standard_normal((64, 32)).astype(np.float32)), text)
    plain = "order" not in text
    for m in (1, 4) if plain or not SIM else (1,):  # (the simulator's tensor-core path is slow: one case)
        x = cuda.to_device(rng.standard_normal((m, 64)).astype(np.float32))
        first = be.matmul(x, w).copy_to_host()
        before = _hits("matmul")
        again = be.matmul(x, w).copy_to_host()
        out = cuda.device_array((m, 32), np.float32)
        into = be.matmul(x, w, out=out)
        assert into is out
        assert _hits("matmul") == before + 2, f"M={m}: a repeated matmul took the whole way"
        np.testing.assert_array_equal(again, first)
        np.testing.assert_array_equal(out.copy_to_host(), first)
    if not plain:
        return
    before = _hits("matmul")
    x3 = rng.standard_normal((3, 64)).astype(np.float32)
    for xin in (x3, x3.astype(np.float16)):
        be.matmul(cuda.to_device(xin), w)
    assert _hits("matmul") == before, "a new shape or dtype of x was served as a repeat"


def test_repeat_matmul_checks_out(be):
    """A wrong out= on a repeat gets the whole way's InputError."""
    rng = np.random.default_rng(40)
    w = be.quantize(cuda.to_device(rng.standard_normal((64, 64)).astype(np.float32)), "q4s/block32:f16")
    x = cuda.to_device(rng.standard_normal((1, 64)).astype(np.float32))
    be.matmul(x, w)
    with pytest.raises(InputError):
        be.matmul(x, w, out=cuda.device_array((1, 32), np.float32))


@pytest.mark.parametrize("text", ["q4_0", "q4s/block32:f16/packed_native/order:high",
                                  "q4s/block32:f16/packed_native/order:split32", "q4s/block32:f16:flat"])
def test_schemes_beyond_the_fast_kernels_always_go_the_whole_way(be, text):
    """A scheme the fast kernels do not serve alone (signed scales on the general kernels; a
    field order, which k_reorder moves after them; flat blocks in their 2-D form) is
    noted once as no repeat: later calls take the whole way, with the reference's bytes each
    time."""
    x = sample_x((4, 64), seed=41)
    want = REF.quantize(x, text).to_data().payload
    before = _hits("quantize")
    for _ in range(3):
        assert be.quantize(cuda.to_device(x), text).to_data().payload == want, text
    assert _hits("quantize") == before
    assert be.state.repeats[(text, "minmax", (4, 64))] is None


def test_tensors_holding_other_data_take_the_whole_way(be):
    """A QTensor that names the cuda backend but holds other data (the conformance suite's
    refusal check does this with a LOOKUP scheme): dequantize and matmul, with x on the device,
    refuse on the scheme as the whole way does, not on the data's type."""
    from qcore.errors import UnsupportedSchemeError
    from qcore.backend.protocol import QTensor

    d = REF.into_data(REF.quantize(sample_x((8, 64), seed=42), "nf4"))
    own = QTensor(be, d.scheme, d.shape, d)
    with pytest.raises(UnsupportedSchemeError):
        be.dequantize(own)
    with pytest.raises(UnsupportedSchemeError):
        be.matmul(cuda.to_device(np.ones((1, 8), np.float32)), own)


@pytest.mark.parametrize("text", ["q4s/block32:f16", "nvfp4", "e4m3/block32:ue4m3/tensor:f32"])
def test_repeat_quantize_into_a_tensor_refreshes_what_it_caches(be, text):
    """quantize(out=q) of a remembered key is a repeat: new x each time, the reference's bytes in
    q's own payload, and q's cached decoded scales follow them, so q's (repeat) dequantize and
    its matmul give the new tensor's floats and product, not the old ones (for the two-level
    E4M3 weight at M = 4, the tensor-core kernel's effective scales, new global included)."""
    rng = np.random.default_rng(44)
    xs = [rng.standard_normal((64, 32)).astype(np.float32) * (1 + 3 * i) for i in range(3)]
    q = be.quantize(cuda.to_device(xs[0]), text)
    payload = q.data.payload
    be.dequantize(q)
    be.dequantize(q)  # the dequantize launch is packed: later ones are repeats
    xm = cuda.to_device(rng.standard_normal((4, 64)).astype(np.float32))
    be.matmul(xm, q)  # the matmul's scales (and the tensor-core kernel's, at M = 4) are cached
    for x in xs[1:]:
        before = (_hits("quantize out="), _hits("dequantize"))
        got = be.quantize(cuda.to_device(x), text, out=q)
        assert got is q and q.data.payload is payload
        want = REF.quantize(x, text)
        assert q.to_data().payload == want.to_data().payload, f"{text}: out= wrote other bytes"
        assert_same_floats(be.dequantize(q).copy_to_host(), REF.dequantize(want), f"{text} dequantize after out=")
        assert (_hits("quantize out="), _hits("dequantize")) == (before[0] + 1, before[1] + 1), \
            "quantize out= or the dequantize after it took the whole way"
        fresh = be.quantize(cuda.to_device(x), text)
        np.testing.assert_array_equal(be.matmul(xm, q).copy_to_host(), be.matmul(xm, fresh).copy_to_host())


def test_repeat_quantize_into_a_byte_array(be):
    """quantize(out=uint8 array of q.nbytes) of a remembered key is a repeat whose tensor holds
    that array's memory; an array of another length or dtype gets the whole way's InputError."""
    text = "q8s/block32:f16"
    x = sample_x((4, 64), seed=45)
    q = be.quantize(cuda.to_device(x), text)
    buf = cuda.device_array(q.nbytes, np.uint8)
    before = _hits("quantize out=")
    got = be.quantize(cuda.to_device(x), text, out=buf)
    assert _hits("quantize out=") == before + 1, "quantize into a byte array took the whole way"
    assert got.to_data().payload == REF.quantize(x, text).to_data().payload
    assert np.array_equal(buf.copy_to_host(), np.frombuffer(got.to_data().payload, np.uint8)), \
        "the tensor does not hold the array's memory"
    for bad in (cuda.device_array(q.nbytes + 1, np.uint8), cuda.device_array(q.nbytes // 4, np.float32)):
        with pytest.raises(InputError, match="quantize out="):
            be.quantize(cuda.to_device(x), text, out=bad)


def test_repeat_quantize_into_another_tensor_kind_takes_the_whole_way(be):
    """out= a tensor of another scheme or shape: the whole way's InputError, not a repeat."""
    text = "q4s/block32:f16"
    x = cuda.to_device(sample_x((4, 64), seed=46))
    be.quantize(x, text)
    for other in (be.quantize(x, "q8s/block32:f16"), be.quantize(cuda.to_device(sample_x((2, 64), seed=47)), text)):
        with pytest.raises(InputError, match="quantize out="):
            be.quantize(x, text, out=other)


def test_repeat_dequantize_into_out(be):
    """dequantize(out=float32 array) of a tensor whose launch is packed is a repeat (the same
    floats, out returned); a float16 out= takes the whole way and is right; a wrong shape gets
    the whole way's InputError."""
    text = "q4s/block32:f16"
    x = sample_x((4, 64), seed=48)
    q = be.quantize(cuda.to_device(x), text)
    want = REF.dequantize(REF.quantize(x, text))
    out = cuda.device_array((4, 64), np.float32)
    be.dequantize(q, out=out)
    before = _hits("dequantize out=")
    for _ in range(2):
        out.copy_to_device(np.full((4, 64), np.nan, np.float32))
        assert be.dequantize(q, out=out) is out
        assert_same_floats(out.copy_to_host(), want, "dequantize out=")
    assert _hits("dequantize out=") == before + 2, "a repeated dequantize out= took the whole way"
    half = cuda.device_array((4, 64), np.float16)
    be.dequantize(q, out=half)
    np.testing.assert_array_equal(half.copy_to_host(), want.astype(np.float16))
    assert _hits("dequantize out=") == before + 2, "a float16 out= was served as a float32 repeat"
    with pytest.raises(InputError, match="dequantize out="):
        be.dequantize(q, out=cuda.device_array((4, 32), np.float32))


@pytest.mark.skipif(SIM, reason="needs a GPU: the simulator takes no torch CUDA tensors")
@pytest.mark.parametrize("text", ["q4s/block32:f16", "q8s", "nvfp4"])  # one pass; two passes
def test_repeat_quantize_of_torch_x_launches_with_pointers(be, text, monkeypatch):
    """A repeat quantize of a float32 torch x into a new payload launches its packed kernels
    with plain pointers (`_repeat._quantize_torch`): the reference's bytes; a NaN raises the
    whole way's InputError naming it, and the next call, which packs the launches again for the
    new scratch, takes the pointers once more with the right bytes."""
    torch = pytest.importorskip("torch")
    took = []  # per call of `_quantize_torch`: whether it served the call ("raised" until it returns)

    def spy(*args):
        took.append("raised")
        q = inner(*args)
        took[-1] = q is not None
        return q

    inner = _repeat._quantize_torch
    monkeypatch.setattr(_repeat, "_quantize_torch", spy)
    x = sample_x((6, 160), seed=52)  # a shape of its own: the first call takes the whole way
    xt = torch.from_numpy(x).cuda()
    want = REF.quantize(x, text).to_data().payload
    assert [be.quantize(xt, text).to_data().payload for _ in range(3)] == [want] * 3
    assert took == [True, True], f"{text}: the repeats did not launch with pointers: {took}"
    bad = xt.clone()
    bad[1, 5] = float("nan")
    with pytest.raises(InputError, match=r"nan at index \(1, 5\)"):
        be.quantize(bad, text)
    assert [be.quantize(xt, text).to_data().payload for _ in range(2)] == [want] * 2, f"{text} after a NaN"
    assert took[2:] == ["raised", False, True], f"{text}: {took[2:]} (the NaN, a repack, pointers again)"


@pytest.mark.skipif(SIM, reason="needs a GPU: the simulator takes no torch CUDA tensors")
def test_repeat_calls_read_torch_tensors_as_pointers(be):
    """A float32 torch x (and out=) is read as plain pointers (`_array.torch_f32`): repeat
    quantizes, matmuls and dequantizes give the reference's bytes and the first call's floats,
    into a new array or an out= of the result's shape or size; a misaligned x takes the whole
    way and is right; a strided x, an out= of another size or dtype get the whole way's
    InputError."""
    torch = pytest.importorskip("torch")
    from qcore_cuda import _launch

    text = "q4s/block32:f16"
    x = sample_x((4, 64), seed=49)
    xt = torch.from_numpy(x).cuda()
    want = REF.quantize(x, text).to_data().payload
    be.quantize(xt, text)
    before, raw = _hits("quantize"), _launch.COUNTS["raw"]
    assert [be.quantize(xt, text).to_data().payload for _ in range(2)] == [want, want]
    assert _hits("quantize") == before + 2 and _launch.COUNTS["raw"] >= raw + 2
    buf = torch.zeros(1 + x.size, device="cuda")
    buf[1:] = xt.reshape(-1)
    xm = buf[1:].view(4, 64)  # 4 bytes past a 16-byte boundary
    before = _hits("quantize")
    assert be.quantize(xm, text).to_data().payload == want
    assert _hits("quantize") == before, "a misaligned torch x was served by the fast kernels' repeat"
    with pytest.raises(InputError, match="C-contiguous"):
        be.quantize(torch.from_numpy(sample_x((4, 128), seed=50)).cuda()[:, ::2], text)

    rng = np.random.default_rng(51)
    w = be.quantize(torch.from_numpy(rng.standard_normal((64, 32)).astype(np.float32)).cuda(), text)
    for m in (1, 4):
        xmm = torch.from_numpy(rng.standard_normal((m, 64)).astype(np.float32)).cuda()
        first = be.matmul(xmm, w).torch().clone()
        before = _hits("matmul")
        again = be.matmul(xmm, w).torch()
        out, flat = torch.full((m, 32), float("nan"), device="cuda"), torch.empty(m * 32, device="cuda")
        assert be.matmul(xmm, w, out=out) is out and be.matmul(xmm, w, out=flat) is flat
        assert _hits("matmul") == before + 3, f"M={m}: a repeated torch matmul took the whole way"
        for got in (again, out, flat.view(m, 32)):
            assert torch.equal(got, first)
        for bad in (torch.empty(m, 16, device="cuda"), torch.empty(m, 32, device="cuda", dtype=torch.float16)):
            with pytest.raises(InputError, match="matmul out="):
                be.matmul(xmm, w, out=bad)

    q = be.quantize(xt, text)
    want_y = torch.from_numpy(REF.dequantize(REF.quantize(x, text))).cuda()
    out = torch.empty(4, 64, device="cuda")
    be.dequantize(q, out=out)
    before = _hits("dequantize out=")
    for into in (torch.full((4, 64), float("nan"), device="cuda"), torch.empty(256, device="cuda")):
        assert be.dequantize(q, out=into) is into and torch.equal(into.view(4, 64), want_y)
    assert _hits("dequantize out=") == before + 2, "a repeated dequantize into a torch out= took the whole way"
    with pytest.raises(InputError, match="dequantize out="):
        be.dequantize(q, out=torch.empty(4, 32, device="cuda"))
