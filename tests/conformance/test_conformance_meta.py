"""The conformance suite catches broken backends: each deliberately broken subclass of the
reference backend must fail with a message that names the scheme, the shape and the check."""
from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import qcore
from qcore.conformance import cases as C
from qcore.conformance import checks as K
from qcore.conformance import runner
from qcore.conformance.base import installed_backend, required_backends
from qcore.errors import UnsupportedSchemeError
from qcore.spec.payload import QuantizedData, sections
from qcore.backend.protocol import QParams, Support
from qcore.backend.reference import ReferenceBackend

CASE = C.Case("q4s/block32:f16", (6, 40), "normal", "f32", seed=0)
PACKED = C.Case("q2s/packed_u32", (3, 5, 37), "normal", "f32", seed=0)  # 37 % 16 -> padding bits


def _flip(d: QuantizedData, byte: int, bit: int = 0) -> QuantizedData:
    p = bytearray(d.payload)
    p[byte] ^= 1 << bit
    return QuantizedData(d.shape, d.scheme, bytes(p))


class FlipOneCodeBit(ReferenceBackend):
    """Flips the lowest bit of the first code of every tensor it quantizes."""

    name = "flip-code"

    def _quantize(self, x, scheme, params, method):
        d = super()._quantize(x, scheme, params, method)
        return _flip(d, 0) if d.codes().size else d


class FlipPaddingBit(ReferenceBackend):
    """Sets a padding bit of the first packed line: codes decode the same, bytes differ."""

    name = "flip-padding"

    def _quantize(self, x, scheme, params, method):
        d = super()._quantize(x, scheme, params, method)
        return _flip(d, 36 // 16 * 4 + 3, 7)  # u32 word 2 holds codes 32..36 + padding bits 10..31


class ScalesRoundedDown(ReferenceBackend):
    """Stores block scales one F16 step too small (rounds down instead of up)."""

    name = "round-down"

    def _calibrate(self, x, scheme, method):
        p = super()._calibrate(x, scheme, method)
        s = np.asarray(p.scales, np.float32).copy()
        s.reshape(-1)[0] = np.float32(np.float16(s.reshape(-1)[0]) - np.float16(s.reshape(-1)[0]) * np.float16(2 ** -10))
        return QParams(s, p.global_scale)


class DequantOneUlp(ReferenceBackend):
    """Dequantizes the last element one ulp high."""

    name = "ulp"

    def _dequantize(self, data, dtype):
        y = super()._dequantize(data, np.dtype(np.float32)).copy()
        if y.size:
            y.reshape(-1)[-1] = np.nextafter(y.reshape(-1)[-1], np.float32(np.inf))
        return y.astype(dtype)


class Nondeterministic(ReferenceBackend):
    """Every second quantize flips a code bit."""

    name = "flaky"

    def __init__(self):
        self._n = itertools.count()

    def _quantize(self, x, scheme, params, method):
        d = super()._quantize(x, scheme, params, method)
        return _flip(d, 0) if next(self._n) % 2 else d


class WritesInput(ReferenceBackend):
    """Zeroes the first element of the caller's array after quantizing."""

    name = "writes-input"

    def _quantize(self, x, scheme, params, method):
        d = super()._quantize(x, scheme, params, method)
        if isinstance(x, np.ndarray) and x.size:
            x.reshape(-1)[0] = 0
        return d


class Only8Bit(ReferenceBackend):
    """Supports 8-bit values only, and refuses the others correctly."""

    name = "only8"

    def _supports(self, scheme):
        return Support.yes() if scheme.bits == 8 else Support.no("sub-byte values are not implemented")


class ValueErrorOnUnsupported(Only8Bit):
    """Says no to sub-byte schemes but then raises ValueError instead of UnsupportedSchemeError."""

    name = "valueerror"

    def _require(self, scheme):
        s = qcore.scheme(scheme)
        if s.bits != 8:
            raise ValueError(f"cannot do {s}")
        return super()._require(s)


class AnonymousRefusal(Only8Bit):
    """Refuses with UnsupportedSchemeError, but the message names neither backend nor scheme."""

    name = "anonymous"

    def _require(self, scheme):
        s = qcore.scheme(scheme)
        if s.bits != 8:
            raise UnsupportedSchemeError("not supported")
        return super()._require(s)


class TypeErrorOnNaN(ReferenceBackend):
    """Raises TypeError (not InputError) for non-finite input."""

    name = "typeerror"

    def _quantize(self, x, scheme, params, method):
        if not np.all(np.isfinite(np.asarray(x, np.float32))):
            raise TypeError("nan!")
        return super()._quantize(x, scheme, params, method)


class SloppyMatmul(ReferenceBackend):
    """matmul off by 1e-3."""

    name = "sloppy-matmul"

    def matmul(self, x, w):
        return super().matmul(x, w) + np.float32(1e-3)


def _failure(fn, *args) -> K.ConformanceFailure:
    with pytest.raises(K.ConformanceFailure) as info:
        fn(*args)
    return info.value


def _names_case(msg: str, case: C.Case) -> None:
    assert case.scheme in msg and str(case.shape) in msg, msg


def test_one_flipped_code_bit_fails_quantize_codes():
    f = _failure(K.check_supported, FlipOneCodeBit(), CASE)
    assert f.check == "quantize.codes" and f.backend == "flip-code"
    msg = str(f)
    _names_case(msg, CASE)
    assert "'quantize.codes'" in msg and "1 of 240 codes differ; first at (0, 0)" in msg, msg
    assert "got " in msg and "want " in msg and "(0x" in msg, msg


def test_flipped_padding_bit_fails_on_payload_bytes():
    f = _failure(K.check_supported, FlipPaddingBit(), PACKED)
    assert f.check == "quantize.payload", str(f)
    assert "values section byte 11" in str(f) and "got 0x80, want 0x00" in str(f), str(f)
    _names_case(str(f), PACKED)


def test_scale_rounded_down_fails_calibrate():
    f = _failure(K.check_supported, ScalesRoundedDown(), CASE)
    assert f.check == "calibrate.scales", str(f)
    assert "first at (0, 0)" in str(f)
    _names_case(str(f), CASE)


def test_one_ulp_off_dequantize_fails():
    f = _failure(K.check_supported, DequantOneUlp(), CASE)
    assert f.check.startswith("dequantize("), str(f)
    assert "1 of 240 dequantized values differ; first at (5, 39)" in str(f), str(f)


def test_nondeterminism_is_caught():
    f = _failure(K.check_supported, Nondeterministic(), CASE)
    assert f.check.startswith("quantize") or f.check.startswith("deterministic"), str(f)


def test_writing_into_the_input_is_caught():
    f = _failure(K.check_supported, WritesInput(), CASE)
    assert f.check == "quantize" and "modified its input" in str(f), str(f)


def test_value_error_on_unsupported_scheme_fails_with_scheme_and_check():
    case = C.Case("q4s/block32:f16", (6, 40))
    out = K.check_case(ValueErrorOnUnsupported(), case)
    assert out.status == K.FAILED and not out
    assert out.check == "rejects.calibrate", out.message
    assert "raised ValueError (cannot do q4s/block32:f16), want UnsupportedSchemeError" in out.message
    _names_case(out.message, case)


def test_refusal_must_name_backend_and_scheme():
    out = K.check_case(AnonymousRefusal(), C.Case("q2f", (67,)))
    assert out.status == K.FAILED and "does not name 'anonymous'" in out.message, out.message


def test_not_supported_is_its_own_outcome_not_a_failure():
    be = Only8Bit()
    rejected = K.check_case(be, C.Case("e2m1/block32:ue8m0/packed_native", (6, 40)))
    passed = K.check_case(be, C.Case("e4m3/block32:ue8m0", (6, 40)))
    assert (rejected.status, passed.status) == (K.REJECTED, K.PASSED)
    assert rejected and passed


def test_type_error_on_nan_input_fails_bad_input():
    f = _failure(K.check_bad_inputs, TypeErrorOnNaN(), CASE)
    assert f.check == "bad-input.NaN.quantize", str(f)
    assert "raised TypeError (nan!), want InputError" in str(f)
    _names_case(str(f), CASE)


def test_sloppy_matmul_fails_ops():
    case = next(C.scheme_cases("ops", schemes=[qcore.scheme("q8s/block32:f32")]))
    f = _failure(K.check_ops, SloppyMatmul(), case)
    assert f.check == "ops.matmul" and "accumulation bound" in str(f), str(f)


def test_cross_backend_catches_a_bad_loader():
    class BadLoader(ReferenceBackend):
        name = "bad-loader"

        def _from_data(self, data):
            return _flip(data, 0)

    f = _failure(K.check_cross_backend, ReferenceBackend(), BadLoader(), CASE)
    assert f.check == "cross-backend.reference->bad-loader.codes", str(f)


def test_reference_passes_every_check_on_a_sample():
    be = ReferenceBackend()
    report = runner.run([be], max_schemes=12)
    assert report.ok, [o.message for o in report.failed]
    assert report.summary("reference")[0] >= 12  # every stratum draws two schemes or more


def test_runner_reports_a_broken_backend():
    report = runner.run([FlipOneCodeBit()], max_schemes=6, kinds=["case"])
    assert not report.ok
    msgs = [o.message for o in report.failed]
    assert all("failed check 'quantize.codes'" in m for m in msgs), msgs
    p, _, f = report.summary("flip-code")
    assert f >= 6  # every stratum's non-empty cases fail


class PartsOutOfOrder(ReferenceBackend):
    """Right into_data bytes, but payload_parts gives the scales before the codes."""

    name = "parts-out-of-order"

    def _payload_parts(self, data):
        parts = super()._payload_parts(data)
        sec = sections(data.shape, data.scheme)
        whole = parts[0]
        return [whole[sec.values:], whole[:sec.values]]


def test_runner_fails_payload_parts_out_of_order():
    report = runner.run([PartsOutOfOrder()], max_schemes=6, kinds=["case"])
    msgs = [o.message for o in report.failed]
    assert msgs and all("failed check 'payload_parts'" in m for m in msgs if "tested-nothing" not in m), msgs


def test_runner_main_exit_status(capsys):
    assert runner.main(["--backend", "reference", "--max-schemes", "4", "--no-progress"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "schemes supported and conforming, 0 rejected correctly (not supported), 0 failed" in out
    assert runner.main(["--backend", "no-such-backend", "--no-progress"]) == 1  # a bad backend, as in the CLI
    assert runner.main(["--backend", "reference", "--checks", "bogus"]) == 2


def test_runner_main_fails_on_a_broken_registered_backend(monkeypatch, capsys):
    from qcore.backend import registry

    broken = FlipOneCodeBit()
    real_backend, real_registered = registry.backend, registry.registered
    monkeypatch.setattr(registry, "backend", lambda n=None: broken if n == "flip-code" else real_backend(n))
    monkeypatch.setattr(registry, "registered", lambda: {**real_registered(), "flip-code": broken})
    rc = runner.main(["--backend", "flip-code", "--max-schemes", "3", "--no-progress", "--checks", "case"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "FAILED backend 'flip-code' failed check 'quantize.codes' on q8f" in " ".join(out.split()), out
    assert "flip-code: 0 schemes supported and conforming, 0 rejected correctly (not supported)" \
        in " ".join(out.split())


# ----------------------------------------------------------------------------- the case data


def test_default_sample_covers_every_value_mode_store_and_level():
    space = C.scheme_space()
    got = {(C.value_label(s), C.store_label(s)) for s in space}
    for head in C.VALUE_MODES:
        stores = C.STORES_8BIT if C.head_bits(head) == 8 else C.STORES_SUBBYTE
        for st in stores:
            assert (head, st) in got, (head, st)
    levels = {C.level_label(s) for s in space}
    for lv in C.LEVELS:
        assert (lv or "tensor:f32") in levels, lv
    assert all(p in space for p in C.SPACE_PRESETS)
    assert set(C.SPACE_PRESETS) == {p for p in qcore.PRESETS.values() if not C.rules_label(p)}


def test_full_space_is_the_whole_product():
    space = C.scheme_space(full=True)
    n = sum(len(C.LEVELS) * len(C.STORES_8BIT if C.head_bits(h) == 8 else C.STORES_SUBBYTE)
            for h in C.VALUE_MODES)
    recip = sum(len(C.RECIP_LEVELS) * len(C.STORES_8BIT if C.head_bits(h) == 8 else C.STORES_SUBBYTE)
                for h in C.VALUE_MODES)
    presets = sum(p not in space[:n] for p in C.SPACE_PRESETS)
    assert len(space) == n + presets + recip
    assert all(s.reciprocal_global for s in space[n + presets:])  # after the v1 space
    assert len(set(space)) == len(space)


def test_case_ids_are_unique_and_reproduce_the_case():
    items = list(C.cases())
    assert len({c.id for c in items}) == len(items)
    for c in items:
        again = C.Case(c.scheme, c.shape, c.dist, c.dtype, c.seed, c.index, c.out_dtype)
        assert again.qscheme == c.qscheme
        assert again.input().tobytes() == c.input().tobytes()


def test_max_elements_caps_every_shape():
    assert all(np.prod(c.shape) <= 64 for c in C.cases(max_elements=64))
    assert all(np.prod(c.shape) <= 64 for c in C.scheme_cases("ops", max_elements=64))


# ----------------------------------------------------------------------------- adoption


def test_missing_backend_skips_unless_required(monkeypatch):
    monkeypatch.delenv("QCORE_REQUIRE_BACKENDS", raising=False)
    monkeypatch.delenv("QCORE_REQUIRE_CUDA", raising=False)
    with pytest.raises(pytest.skip.Exception, match="backend 'nope' not installed"):
        installed_backend("nope")
    monkeypatch.setenv("QCORE_REQUIRE_BACKENDS", "reference,nope")
    with pytest.raises(pytest.fail.Exception, match=r"required by \$QCORE_REQUIRE_BACKENDS"):
        installed_backend("nope")
    monkeypatch.setenv("QCORE_REQUIRE_BACKENDS", "")
    monkeypatch.setenv("QCORE_REQUIRE_CUDA", "1")
    assert required_backends() == {"cuda"}
    monkeypatch.setenv("QCORE_REQUIRE_CUDA", "0")
    assert required_backends() == set()
    assert installed_backend("reference").name == "reference"


ADOPTER = '''
import numpy as np
import pytest
from qcore.conformance import ConformanceFixtures, ConformanceTests
from qcore.spec.payload import QuantizedData
from qcore.backend.reference import ReferenceBackend


class Broken(ReferenceBackend):
    name = "broken"

    def _quantize(self, x, scheme, params, method):
        d = super()._quantize(x, scheme, params, method)
        p = bytearray(d.payload)
        p[0] ^= 1
        return QuantizedData(d.shape, d.scheme, bytes(p))


class BrokenFixtures(ConformanceFixtures):
    max_schemes = 2
    max_elements = 64

    @pytest.fixture
    def backend(self):
        return Broken()


class TestBroken(ConformanceTests, BrokenFixtures):
    pass


class TestForgotBackend(ConformanceTests):
    max_schemes = 1
'''


def test_pytest_adoption_fails_loudly(tmp_path):
    (tmp_path / "test_adopter.py").write_text(textwrap.dedent(ADOPTER))
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE",
                        "test_adopter.py", "-k", "test_scheme"],
                       cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    out = " ".join(r.stdout.split())
    assert r.returncode == 1, out
    assert "backend 'broken' failed check 'quantize.codes' on q8f shape (" in out, out
    assert "the 'backend' fixture must be overridden" in out, out
    # both sampled strata (q8f per-tensor, e5m2 two-level) fail on a non-empty case
    assert "broken: 0 schemes supported and conforming, 0 rejected correctly (not supported), 2 failed" in out, out


CONFTEST_STYLE = '''
import pytest
from qcore.backend.protocol import Support
from qcore.backend.reference import ReferenceBackend


class Only8Bit(ReferenceBackend):
    name = "only8"

    def _supports(self, scheme):
        return Support.yes() if scheme.bits == 8 else Support.no("sub-byte values are not implemented")


@pytest.fixture
def qcore_backend():
    return Only8Bit()


@pytest.fixture
def qcore_expected_support():
    return lambda scheme: True  # claims everything: the sub-byte refusals must fail
'''


def test_conftest_style_adoption_and_expected_support(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST_STYLE)
    (tmp_path / "test_it.py").write_text(
        "from qcore.conformance import ConformanceTests\n\n\n"
        "class TestOnly8(ConformanceTests):\n    max_schemes = 6\n    max_elements = 64\n")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "test_scheme"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    out = " ".join(r.stdout.split())
    assert r.returncode == 1, out
    assert "backend 'only8' failed check 'expected-support' on q2" in out, out
    assert "supports() says False, the author expects True" in out, out


def test_runner_errors_are_one_line(capsys):
    """The error for an unknown backend is one unwrapped line, however narrow the terminal."""
    import os

    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "40"
    try:
        assert runner.main(["--backend", "no-such-backend", "--no-progress"]) == 1
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("qcore conformance: error: no backend named 'no-such-backend'"), err
