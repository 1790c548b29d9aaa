"""Scheme features beyond SPEC v1 (the *(qcore)* subsections of docs/spec.md): what a backend opts in to.

A scheme that uses none of these features is a SPEC v1 scheme. Each feature is one row: its name
(the scheme text's part that shows it), its spec section, and the field it reads. A backend lists
the names it implements in `BaseBackend.scheme_features`, and `supports()` refuses a scheme that
uses any other one. A backend written before a feature existed therefore never claims it, even
where its `_supports` reads only the fields it knew about.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Iterable

from qcore.spec.schemes import CodeRule, FieldOrder, OffsetKind, QuantScheme, ScaleRound

__all__ = ["SchemeFeature", "FEATURES", "ALL_FEATURES", "scheme_features", "declared_features"]


@dataclass(frozen=True)
class SchemeFeature:
    """One feature beyond SPEC v1: `name` as a backend declares it, the docs/spec.md section
    (named by its heading, e.g. "code rules") and concept it belongs to, and `uses(scheme)`, the
    test on the scheme's fields."""

    name: str
    section: str
    concept: str
    uses: Callable[[QuantScheme], bool]

    def __str__(self) -> str:
        return self.name


def _offset(kind: OffsetKind) -> Callable[[QuantScheme], bool]:
    return lambda s: s.offset is not None and s.offset.kind is kind


FEATURES: dict[str, SchemeFeature] = {f.name: f for f in (
    SchemeFeature("round:rne", "scale rounding rules", "scale rounding rule",
                  lambda s: s.scale_round is ScaleRound.RNE),
    SchemeFeature("round:mx", "scale rounding rules", "scale rounding rule",
                  lambda s: s.scale_round is ScaleRound.MX),
    SchemeFeature("recip", "reciprocal global scale", "reciprocal global scale", lambda s: s.reciprocal_global),
    SchemeFeature("signed", "signed scales", "signed scales", lambda s: s.signed),
    SchemeFeature("codes:away", "code rules", "code rule", lambda s: s.code_rule is CodeRule.AWAY),
    SchemeFeature("codes:offset", "code rules", "code rule", lambda s: s.code_rule is CodeRule.OFFSET),
    SchemeFeature("codes:midpoint", "code rules", "code rule", lambda s: s.code_rule is CodeRule.MIDPOINT),
    SchemeFeature("unsigned", "affine offsets and unsigned values", "unsigned values (u8, u4, u2)",
                  lambda s: s.traits.unsigned),
    SchemeFeature("min", "affine offsets", "affine min offsets", _offset(OffsetKind.MIN)),
    SchemeFeature("zero", "affine offsets", "affine zero points", _offset(OffsetKind.ZERO)),
    SchemeFeature("order:high", "field orders", "field order", lambda s: s.field_order is FieldOrder.HIGH),
    SchemeFeature("order:split", "field orders", "field order", lambda s: s.field_order is FieldOrder.SPLIT),
    SchemeFeature("flat", "blocks over the flattened tensor", "blocks over the flattened tensor",
                  lambda s: s.flat_blocks),
)}
"""Every feature beyond SPEC v1, in a fixed order (a refusal names the first one a scheme uses)."""

ALL_FEATURES: frozenset[str] = frozenset(FEATURES)
"""What a backend that implements every extension declares (the reference backend)."""


@lru_cache(maxsize=4096)  # asked at every entry point; schemes are hashable values
def scheme_features(s: QuantScheme) -> tuple[SchemeFeature, ...]:
    """The features `s` uses, in `FEATURES` order; () for a SPEC v1 scheme."""
    return tuple(f for f in FEATURES.values() if f.uses(s))


def declared_features(names: Iterable[str], owner: str) -> frozenset[str]:
    """A backend's `scheme_features` as a frozenset of known names; `TypeError` naming `owner`
    (the backend class) for a str, a non-iterable or an unknown name."""
    if isinstance(names, (str, bytes)):
        raise TypeError(f"{owner}.scheme_features is the str {names!r}; declare a set of feature names, "
                        f"e.g. {{{names!r}}}")
    try:
        got = frozenset(names)
    except TypeError:
        raise TypeError(f"{owner}.scheme_features must be a set of feature names, got "
                        f"{type(names).__name__}; e.g. {{'flat', 'codes:away'}}") from None
    unknown = sorted(map(repr, got - ALL_FEATURES))
    if unknown:
        raise TypeError(f"{owner}.scheme_features names unknown feature(s) {', '.join(unknown)}; "
                        f"the features are {', '.join(FEATURES)} (qcore.spec.features)")
    return got
