"""Scheme features beyond SPEC v1 are opt-in (qcore/spec/features.py, docs/plugins.md "Scheme
features"): a backend that does not declare one is refused the schemes that use it, by
`supports()`, `auto` and the conformance suite, and certified on the rest."""
from __future__ import annotations

import pytest

import qcore
from qcore import UnsupportedSchemeError
from qcore.backend import registry
from qcore.conformance import checks as K
from qcore.conformance import runner, sampling
from qcore.conformance.expect import parse_expect
from qcore.spec.features import ALL_FEATURES, FEATURES, declared_features, scheme_features
from qcore.backend.base import BaseBackend
from qcore.backend.protocol import Support
from qcore.spec.schemes import ScaleDtype, StoreKind, scheme
from tests.mutants import Narrow

V1_EXPECT = "q8s/tensor:f32/native,q8s/block*:f32/native"
"""What the v1 plugin's author expects: its SPEC v1 schemes only."""

# one scheme per feature, each using that feature alone where the spec allows it
ONE_EACH = {
    "round:rne": "q8s/block32:f16/round:rne",
    "round:mx": "e2m1/block32:ue8m0/packed_native/round:mx",
    "recip": "e2m1/block16:ue4m3/tensor:f32:recip/packed_native",
    "signed": "q4f/block32:f16/signed",
    "codes:away": "q8s/block32:f32/codes:away",
    "codes:offset": "q4f/block32:f16/codes:offset",
    "codes:midpoint": "nf4/codes:midpoint",
    "min": "u4/block32:f16/min:f16",
    "zero": "q8s/block32:f32/zero",
    "order:high": "q4s/order:high",
    "order:split": "q4s/packed_native/order:split32",
    "flat": "q8s/block32:f32:flat",
}


class V1Narrow(Narrow):
    """The narrow plugin of tests/mutants.py as its author wrote it for SPEC v1: `_supports`
    reads the fields v1 has and nothing else, so its own answer is yes for q8s F32 schemes
    under the code rules and zero points (affine offsets), which its v1 arithmetic does not implement,
    and no declaration."""

    name = "v1-narrow"
    scheme_features = frozenset()

    def _supports(self, s):
        if s.value.value != "q8s" or s.is_lookup:
            return Support.no("v1-narrow runs symmetric q8s only; use reference")
        if s.two_level or s.slot_dtype is not ScaleDtype.F32 or s.store.kind is not StoreKind.NATIVE:
            return Support.no("v1-narrow stores one level of F32 scales in the Native store only")
        return Support.yes()


class V1NarrowDeclares(V1Narrow):
    """The same plugin declaring features its arithmetic does not implement: tested on them."""

    name = "v1-narrow-declares"
    scheme_features = {"codes:away", "flat"}


def test_every_feature_has_a_scheme_that_uses_it_alone():
    assert set(ONE_EACH) | {"unsigned"} == set(FEATURES)
    for name, text in ONE_EACH.items():
        used = {f.name for f in scheme_features(scheme(text))}
        assert used == ({name, "unsigned"} if name == "min" else {name}), text
    assert scheme_features(scheme("q4s/block32:f16/packed_native")) == ()
    assert {f.name for f in scheme_features(scheme("q4_1"))} == {"unsigned", "min", "round:rne", "codes:offset"}


def test_undeclared_feature_is_refused_with_a_reason():
    be = V1Narrow()
    s = scheme("q8s/block32:f32/codes:away")
    assert be._supports(s)  # the plugin's own hook would claim it
    sup = be.supports(s)
    assert not sup
    assert sup.reason == ("backend 'v1-narrow' does not declare the scheme feature codes:away (code rule; "
                          "docs/spec.md, code rules) in its scheme_features; use a scheme without it or a backend that "
                          "declares it (qcore backends)")
    assert be.supports("q8s/block32:f32")
    for text in ("q8s/block32:f32/zero", "q8s/block32:f32:flat"):
        assert not be.supports(text) and "does not declare the scheme feature" in be.supports(text).reason
    with pytest.raises(UnsupportedSchemeError, match=r"does not declare the scheme feature codes:away"):
        be.quantize([[1.0, 2.0]], s)


def test_declared_features_are_asked_of_the_hook():
    be = V1NarrowDeclares()
    assert be.supports("q8s/block32:f32/codes:away")
    assert be.supports("q8s/block32:f32:flat")
    assert not be.supports("q8s/block32:f32/zero")


def test_plugin_without_declaration_is_refused_the_extensions_and_certified_on_the_rest():
    be = V1Narrow()
    report = runner.run([be], expect=parse_expect([V1_EXPECT]))
    assert report.ok, [o.message for o in report.failed[:3]]
    status = report.scheme_status(be.name)
    ext = {t: st for t, st in status.items() if scheme_features(report.schemes[t])}
    assert ext and set(ext.values()) == {K.REJECTED}, ext
    assert report.summary(be.name)[0] > 0  # certified on its v1 schemes


def test_plugin_with_the_declaration_is_tested_on_those_schemes():
    be = V1NarrowDeclares()
    flat = runner.run([be], filter="flat/")
    assert flat.ok, [o.message for o in flat.failed[:3]]
    passed = [t for t, st in flat.scheme_status(be.name).items() if st == K.PASSED]
    assert passed and all(flat.schemes[t].flat_blocks for t in passed)  # the core runs them on its hooks
    away = runner.run([be], filter="codes:away/", max_failures=1)
    assert away.failed, "a declared code rule its arithmetic ignores must fail, not be refused"
    assert "backend 'v1-narrow-declares' failed check" in away.failed[0].message


def test_auto_skips_a_backend_that_does_not_declare_the_feature():
    class Eager(V1Narrow):
        name = "v1-eager"
        priority = 99

    registry.reset()
    try:
        registry.register(Eager())
        auto = qcore.backend("auto")
        assert auto.pick("q8s/block32:f32").name == "v1-eager"
        assert auto.pick("q8s/block32:f32/codes:away").name != "v1-eager"
    finally:
        registry.reset()


def test_the_declaration_is_checked_when_the_class_is_made():
    with pytest.raises(TypeError, match=r"Odd.scheme_features names unknown feature\(s\) 'codes:awy'; the "
                                        r"features are round:rne, round:mx, recip"):
        class Odd(V1Narrow):
            scheme_features = {"codes:awy"}
    with pytest.raises(TypeError, match=r"Text.scheme_features is the str 'flat'; declare a set"):
        class Text(V1Narrow):
            scheme_features = "flat"
    assert declared_features(["flat", "flat"], "X") == frozenset({"flat"})
    assert BaseBackend.scheme_features == frozenset()


def _hooks_run(be, s) -> bool:
    inner = s.unflat if be.packs_field_orders else s.unflat.low_order
    return bool(be._supports(inner))


@pytest.mark.parametrize("name", ["reference", "ndarray", "lutcpu", "cuda"])
def test_builtin_backends_declare_what_their_hooks_run(name):
    """Each built-in backend declares exactly the features of the schemes its `_supports` takes
    in the conformance space (about 9,700 schemes): nothing it runs is refused, nothing it
    refuses anyway is declared."""
    be = registry.registered().get(name)
    if be is None:
        pytest.skip(f"backend {name} is not installed")
    run = {f.name for s in sampling.whole_space() if _hooks_run(be, s) for f in scheme_features(s)}
    assert set(be.scheme_features) == run
    assert name != "reference" or be.scheme_features == ALL_FEATURES
