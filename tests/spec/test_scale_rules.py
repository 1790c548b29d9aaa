"""One home for the scale rules (docs/spec.md: scale storage, portable bytes and the scale rounding
rules): the numbers in `qcore.spec.codecs.SCALE_ARRAYS` give the same rounding and the same
stored words as the slot rows (`SCALE_SLOTS`: every scale dtype under every rule), and the cuda
device functions built on them (`qcore_cuda.scales`) agree with both, bit for bit."""
import numpy as np
import pytest

from qcore.spec.codecs import SCALE_ARRAYS, SCALE_IDS, SCALE_SLOTS, SCALES, bits_f32, f32_bits

SLOTS = range(len(SCALE_SLOTS))
SLOT_IDS = [f"{t.traits.name}-{t.rule}{t.emax if t.rule == 'mx' else ''}" for t in SCALE_SLOTS]


def _raw_scales(n_random: int = 3000) -> np.ndarray:
    """Non-negative finite f32 raw scales: every exponent with edge mantissas, plus random bits."""
    exps = np.arange(0, 255, dtype=np.uint32) << np.uint32(23)
    mants = np.array([0, 1, 0x1FFF, 0x2000, 0xFFFF, 0x10000, 0xFFFFF, 0x100000, 0x400000, 0x7FFFFF], np.uint32)
    bits = (exps[:, None] | mants[None, :]).reshape(-1)
    rng = np.random.default_rng(7)
    return bits_f32(np.concatenate([bits, rng.integers(0, 0x7F800000, n_random, dtype=np.uint32)]))


def _word(e: np.ndarray, i: int) -> np.ndarray:
    """The kernels' word formula, in numpy (see `ScaleTraits`)."""
    A = SCALE_ARRAYS
    normal = (f32_bits(e).astype(np.int64) >> int(A.word_shift[i])) - int(A.word_rebias[i])
    with np.errstate(divide="ignore", invalid="ignore"):
        sub = (e / A.sub_quantum[i]).astype(np.int64) if A.sub_quantum[i] else normal
    return np.where(e < A.sub_below[i], sub, normal)


@pytest.mark.parametrize("slot", SLOTS, ids=SLOT_IDS)
def test_word_formula_matches_the_trait_row(slot):
    """`(bits >> shift) - rebias` (normal) or `e / quantum` (below the smallest normal) is the
    byte pattern `ScaleTraits.encode` stores, for every scale each rule can produce."""
    row = SCALE_SLOTS[slot]
    tr = row.traits
    e = row.store(_raw_scales())
    e = e[np.isfinite(e)]
    assert np.array_equal(f32_bits(tr.decode(tr.encode(e))), f32_bits(e)), "a rule produced an unstorable scale"
    want = tr.encode(e).astype(np.int64)
    np.testing.assert_array_equal(_word(e, slot), want)


def test_arrays_follow_the_rows():
    from qcore.spec.codecs import SCALE_ROUNDS

    for i, row in enumerate(SCALE_SLOTS):
        tr = row.traits
        assert SCALE_ARRAYS.round_add[i] == tr.round_add and SCALE_ARRAYS.round_mask[i] == tr.round_mask
        assert np.float32(SCALE_ARRAYS.max_value[i]) == np.float32(tr.max_value)
        assert SCALE_ARRAYS.nbytes[i] == tr.nbytes
        assert SCALE_ROUNDS[SCALE_ARRAYS.rule[i]] == row.rule and SCALE_ARRAYS.emax[i] == row.emax
    for i, name in enumerate(SCALE_IDS):  # a dtype's v1 slot is its SCALE_IDS position
        assert SCALE_SLOTS[i].traits is SCALES[name] and SCALE_SLOTS[i].rule == "up"
    assert not SCALE_ARRAYS.max_value.flags.writeable  # frozen into kernels: never edited in place


# ----------------------------------------------------------------------------- cuda device functions
numba = pytest.importorskip("numba")
qcore_cuda = pytest.importorskip("qcore_cuda")

from numba import cuda  # noqa: E402


def _kernel():
    from qcore_cuda.scales import round_scale, scale_word, word_scale

    @cuda.jit
    def k_scales(s, sdt, up, words, back):
        start = cuda.grid(1)
        for j in range(start, s.size, cuda.gridsize(1)):
            r = round_scale(s[j], sdt)
            up[j] = r
            w = scale_word(r, sdt)
            words[j] = w
            back[j] = word_scale(w, sdt)

    return k_scales


@pytest.mark.parametrize("slot", SLOTS, ids=SLOT_IDS)
def test_cuda_scale_functions_match_codecs(cuda_backend, slot):
    """The device rounding, word and its inverse (used by every cuda kernel) on a few hundred
    raw scales, against `qcore.spec.codecs`, for every scale dtype under every rule."""
    s = _raw_scales(200)[::5].copy()
    row = SCALE_SLOTS[slot]
    tr = row.traits
    up, words, back = (cuda.device_array(s.size, dt) for dt in (np.float32, np.uint32, np.float32))
    _kernel()[2, 32](cuda.to_device(s), slot, up, words, back)
    want = row.store(s)
    np.testing.assert_array_equal(f32_bits(up.copy_to_host()), f32_bits(want))
    np.testing.assert_array_equal(words.copy_to_host(), tr.encode(want).astype(np.uint32))
    np.testing.assert_array_equal(f32_bits(back.copy_to_host()), f32_bits(tr.decode(tr.encode(want))))
