"""Which cases a run checks: strata of the scheme space, filled from what the backend supports.

A fixed sample of schemes misses a narrow backend entirely (a q8s-only plugin met none of its
schemes in a 99-scheme sample). So the space is cut into **strata**, one per
(value x mode, level kind, scale dtype, store kind), e.g. `q8s/block:f16/native`; each stratum
holds every scheme of the whole space with that key (block shapes 32, 4x8, 3x5 and 16, packing
axes 0 and 1, the presets). The strata are fixed, so pytest can parametrize over them before
any fixture exists; the concrete schemes are drawn *at run time* from the candidates the backend
under test says it supports:

- every candidate's `supports()` answer is checked against the author's expectation, if given;
- a stratum with supported candidates gets cases on two of them (rotating through block shapes
  and packing axes by stratum and seed): a `grid` input and a `bounds` input (see `inputs.py`),
  and on every third stratum a case with a classic distribution and input dtype;
- a stratum with refused candidates gets one rejection case (every entry point must raise
  `UnsupportedSchemeError`).

The scale rounding rules other than SPEC v1's round-up (`rne`, `mx`) add strata of their own, one
per (rule, level kind, scale dtype) whatever the value and store: every scheme of the space under
each rule that applies to it (not `rne` on F32 slots, where it is the identity). Signed scales and
the code rules (docs/spec.md) add strata per (rule, level kind): a code rule's (`codes:away`,
`codes:offset`; `codes:midpoint` on LOOKUP schemes) hold it with and without `rne` (and the integer
rules with signed scales), the `signed` ones signed scales under `up` and `rne`; the `q8_0` /
`q4_0` presets among them. Affine offsets add strata per (offset kind, level kind): `affine:zero/*`
(zero points on signed and unsigned values), `affine:min/*` (min offsets on unsigned values, with
llama.cpp's Q4_1 rules too). Field orders add `order:high/*` and `order:split/*` per packed store
kind, and blocks over the flattened tensor `flat/*` per level kind.

The per-scheme checks (bad input, ops, cross-backend, input kinds) run on coarser **groups**,
one per (value x mode, level kind), on one supported candidate each; the input kinds are the
maximum on the first / last element of the tensor and of every (edge) block, non-C-ordered
views, every output dtype, and a tensor past 2**20 elements. `--full` takes every candidate of
every stratum on every shape.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import lru_cache, partial
from typing import Any, Callable, Sequence

import numpy as np

from qcore.errors import SchemeError
from qcore.spec.parts import SIGNED_SCALE_DTYPES
from qcore.spec.schemes import (PRESETS, BlockLevel, CodeRule, FieldOrder, Offset, OffsetKind, QuantScheme,
                      QuantValue, ScaleDtype, ScaleRound, StoreKind)
from qcore.conformance import cases as C
from qcore.conformance import checks as K

__all__ = ["Settings", "Stratum", "level_kind", "is_v1_stratum", "strata", "groups", "group_of", "subset", "strata_subset", "stratum_cases",
           "check_stratum", "check_group", "tested_nothing", "supports_nothing", "whole_space", "rule_variant",
           "layout_variants"]

GROUP_KINDS = ("bad-input", "ops", "cross", "inputs")


@dataclass(frozen=True)
class Settings:
    """How much a run checks. `cases_per_stratum`: supported cases per stratum (default 2)."""

    full: bool = False
    seed: int = 0
    max_elements: int | None = None
    cases_per_stratum: int | None = None


def level_kind(s: QuantScheme) -> str:
    """'tensor', 'block', 'two-level' or 'two-level-recip' (a reciprocal global)."""
    if s.block is None:
        return "tensor"
    if s.tensor is None:
        return "block"
    return "two-level-recip" if s.reciprocal_global else "two-level"


@dataclass(frozen=True)
class Stratum:
    """Schemes sharing one key; `id` is the pytest id and the `--filter` text."""

    id: str
    index: int
    candidates: tuple[QuantScheme, ...] = field(repr=False)

    def __str__(self) -> str:
        return self.id


OTHER_ROUNDS = tuple(r for r in ScaleRound if r is not ScaleRound.UP)

RULE_VARIANTS: tuple[tuple[bool, ScaleRound, CodeRule], ...] = (
    (True, ScaleRound.UP, CodeRule.DIV), (True, ScaleRound.RNE, CodeRule.DIV),
    (False, ScaleRound.UP, CodeRule.AWAY), (False, ScaleRound.RNE, CodeRule.AWAY),
    (True, ScaleRound.UP, CodeRule.AWAY),
    (False, ScaleRound.UP, CodeRule.OFFSET), (True, ScaleRound.UP, CodeRule.OFFSET),
    (True, ScaleRound.RNE, CodeRule.OFFSET),
    (False, ScaleRound.UP, CodeRule.MIDPOINT), (False, ScaleRound.RNE, CodeRule.MIDPOINT),
)
"""(signed, scale rounding, code rule) of docs/spec.md's signed scales and code rules that the
space is taken under (the integer rules on integer values, `midpoint` on LOOKUP ones)."""


def rule_variant(s: QuantScheme, signed: bool, rule: ScaleRound, codes: CodeRule) -> QuantScheme | None:
    """`s` under one of `RULE_VARIANTS` (signed scales, a scale rounding rule, a code rule), or
    None where the scheme would be invalid or the same as `s` (rne on F32 scales)."""
    if rule is ScaleRound.RNE and s.slot_dtype is ScaleDtype.F32:
        return None  # rne on F32 is the identity
    try:
        return replace(s, signed=signed, scale_round=rule, code_rule=codes)
    except SchemeError:
        return None


_UNSIGNED = {8: QuantValue.U8, 4: QuantValue.U4, 2: QuantValue.U2}


def _affine_variants(s: QuantScheme) -> list[QuantScheme]:
    """docs/spec.md's affine offsets on a v1 scheme's level and store: a zero point on its value
    and on the unsigned value of its width, a min offset (in the slot dtype, or f32) on the
    unsigned value, and llama.cpp's Q4_1 rules on that; [] where an offset does not apply."""
    if s.traits.is_float or s.is_lookup or s.two_level or s.scale_round is not ScaleRound.UP:
        return []
    u = _UNSIGNED[s.bits]
    dt = s.slot_dtype if s.slot_dtype.value in SIGNED_SCALE_DTYPES else ScaleDtype.F32
    out = [replace(s, offset=Offset(OffsetKind.ZERO)), replace(s, value=u, offset=Offset(OffsetKind.ZERO)),
           replace(s, value=u, offset=Offset(OffsetKind.MIN, dt))]
    if s.slot_dtype is not ScaleDtype.F32:
        out.append(replace(out[-1], scale_round=ScaleRound.RNE, code_rule=CodeRule.OFFSET))
    out.append(replace(out[2], code_rule=CodeRule.AWAY))
    return out


@lru_cache(maxsize=1)
def whole_space() -> tuple[QuantScheme, ...]:
    """Every scheme the sampler draws from, in a fixed order: the v1 space and presets, then each
    under the other scale rounding rules, signed scales and code rules, affine offsets, field
    orders and flat blocks, where they apply."""
    seen = dict.fromkeys(C.scheme_space(True))
    for p in C.SPACE_PRESETS:
        seen.setdefault(p)
    v1 = list(seen)
    for s in v1:  # the other scale rounding rules, where they apply and differ
        for rule in OTHER_ROUNDS:
            if rule is ScaleRound.RNE and s.slot_dtype is ScaleDtype.F32:
                continue
            try:
                seen.setdefault(s.with_scale_round(rule))
            except SchemeError:
                pass
    for p in PRESETS.values():  # q8_0, q4_0: after the v1 space and the rounding rules
        seen.setdefault(p)
    for s in v1:  # signed scales and the code rules, where they apply
        for variant in RULE_VARIANTS:
            v = rule_variant(s, *variant)
            if v is not None:
                seen.setdefault(v)
    for s in v1:  # affine offsets
        for v in _affine_variants(s):
            seen.setdefault(v)
    for s in v1:  # field orders and blocks over the flattened tensor
        for v in layout_variants(s):
            seen.setdefault(v)
    return tuple(seen)


def layout_variants(s: QuantScheme) -> list[QuantScheme]:
    """docs/spec.md's field orders and flat blocks on a v1 scheme: a packed store's fields HIGH and
    SPLIT (groups of max(16, 2n) elements, so lines end in a partial group), and a one-dim block
    level over the flattened tensor (packing axis 0); [] where neither applies."""
    out = []
    st = s.store
    if st.kind is not StoreKind.NATIVE:
        n = st.word_bits // s.bits
        out += [s.with_field_order(FieldOrder.HIGH), s.with_field_order(FieldOrder.SPLIT, max(16, 2 * n))]
    if s.block is not None and len(s.block.dims) == 1 and st.dim == 0:
        out.append(replace(s, block=BlockLevel(s.block.dims, s.block.dtype, True)))
    return out


def _key(s: QuantScheme) -> str:
    if s.flat_blocks:
        return f"flat/{level_kind(s)}"
    if s.field_order is not FieldOrder.LOW:
        return f"order:{s.field_order}/{s.store.kind.value}"
    if s.offset is not None:
        return f"affine:{s.offset.kind}/{level_kind(s)}"
    if s.code_rule is not CodeRule.DIV:
        return f"codes:{s.code_rule}/{level_kind(s)}"
    if s.signed:
        return f"signed/{level_kind(s)}"
    if s.scale_round is not ScaleRound.UP:
        return f"round:{s.scale_round}/{level_kind(s)}:{s.slot_dtype}"
    return f"{C.value_label(s)}/{level_kind(s)}:{s.slot_dtype}/{s.store.kind.value}"


def is_v1_stratum(st: Stratum) -> bool:
    """A stratum of the space under SPEC v1's quantize rules (not a rule's own stratum)."""
    return not C.rules_label(st.candidates[0])


def _group_key(s: QuantScheme) -> str:
    return f"{C.value_label(s)}/{level_kind(s)}"


@lru_cache(maxsize=2)
def _cut(by_group: bool) -> tuple[Stratum, ...]:
    keyf = _group_key if by_group else _key
    out: dict[str, list[QuantScheme]] = {}
    for s in whole_space():
        if by_group and C.rules_label(s):
            continue  # the per-scheme checks run on v1's rules; the other rules have their strata
        out.setdefault(keyf(s), []).append(s)
    return tuple(Stratum(k, i, tuple(v)) for i, (k, v) in enumerate(out.items()))


def strata() -> list[Stratum]:
    """Every (value x mode, level kind, scale dtype, store kind) stratum of the space."""
    return list(_cut(False))


def groups() -> list[Stratum]:
    """Every (value x mode, level kind) group, for the per-scheme checks."""
    return list(_cut(True))


def subset(items: list, n: int | None) -> list:
    """An evenly spaced subset of `n` items (all when n is None or large)."""
    if n is None or n >= len(items):
        return items
    if n <= 0:
        return []
    step = len(items) / n
    return [items[int(i * step)] for i in range(n)]


def group_of(st: Stratum) -> str:
    """The group a stratum is drawn with by `strata_subset`: its (value x mode, level kind), or
    `round:RULE`, `signed`, `codes:RULE` for a rule's strata."""
    s = st.candidates[0]
    if s.flat_blocks:
        return "flat"
    if s.field_order is not FieldOrder.LOW:
        return "order"
    if s.offset is not None:
        return f"affine:{s.offset.kind}"
    if s.code_rule is not CodeRule.DIV:
        return f"codes:{s.code_rule}"
    if s.signed:
        return "signed"
    return f"round:{s.scale_round}" if s.scale_round is not ScaleRound.UP else _group_key(s)


def strata_subset(n: int | None) -> list[Stratum]:
    """`n` strata spread over the groups (all strata when n is None or large): one stratum of
    every (value x mode, level kind) group first, each group starting at a different scale dtype
    and store kind (the rules' groups once every v1 group has one), then a second of every group,
    and so on, the last round evenly spaced over the groups; returned in `strata()` order. With n >= the number of groups every group is
    checked, and the scale dtypes and store kinds turn over between groups."""
    every = strata()
    if n is None or n >= len(every):
        return every
    by_group: dict[str, list[Stratum]] = {}
    for st in every:
        by_group.setdefault(group_of(st), []).append(st)
    rotated = [members[g % len(members):] + members[:g % len(members)]
               for g, members in enumerate(by_group.values())]
    n_v1 = sum(is_v1_stratum(members[0]) for members in by_group.values())
    picked: list[Stratum] = []
    for r in range(max(map(len, rotated))):
        one_round = [members[r] for members in rotated if r < len(members)]
        want = max(n, 0) - len(picked)
        if r == 0 and want < len(one_round):  # the v1 groups first, the rules' groups once all have one
            picked += subset(one_round[:n_v1], want) + subset(one_round[n_v1:], want - n_v1)
        else:
            picked += subset(one_round, want)  # the last round evenly spaced
        if len(picked) >= n:
            break
    return sorted(picked, key=lambda st: st.index)


# --------------------------------------------------------------------------- drawing cases


def _case(s: QuantScheme, shape, dist: str, dtype: str, st: Settings, index: int, out: str = "f32") -> C.Case:
    return C.Case(str(s), tuple(shape), dist, dtype, st.seed, index, out, _parsed=s)


def _nonempty(s: QuantScheme, st: Settings, shapes=C.SHAPES) -> list[tuple[int, ...]]:
    return [sh for sh in C.shapes_for(s, shapes, st.max_elements) if math.prod(sh) > 0]


def stratum_cases(stratum: Stratum, supported: Sequence[QuantScheme], refused: Sequence[QuantScheme],
                  st: Settings) -> list[tuple[bool, C.Case]]:
    """(is supported, case) pairs of one stratum (see the module docstring)."""
    out: list[tuple[bool, C.Case]] = []
    i = stratum.index + st.seed
    if st.full:
        dists = ("grid", "bounds") + C.DISTRIBUTIONS
        r = 0
        for s in supported:
            for sh in C.shapes_for(s, C.FULL_SHAPES, st.max_elements):
                d = dists[r % len(dists)]
                dt = "f32" if d in ("grid", "bounds") else C.INPUT_DTYPES[r % len(C.INPUT_DTYPES)]
                out.append((True, _case(s, sh, d, dt, st, r, C.INPUT_DTYPES[r % len(C.INPUT_DTYPES)])))
                r += 1
        for s in refused:
            fit = _nonempty(s, st)
            if fit:
                out.append((False, _case(s, fit[0], "normal", "f32", st, 0)))
        return out
    n = st.cases_per_stratum if st.cases_per_stratum is not None else 2
    if supported:
        plan = [("grid", "f32", "f32"), ("bounds", "f32", C.INPUT_DTYPES[i % len(C.INPUT_DTYPES)])][:n]
        if (i % 3 == 0 and n >= 2) or n > 2:
            k = i // 3
            plan.append((C.DISTRIBUTIONS[k % len(C.DISTRIBUTIONS)], C.INPUT_DTYPES[(k + 1) % len(C.INPUT_DTYPES)],
                         C.INPUT_DTYPES[(k + 2) % len(C.INPUT_DTYPES)]))
        for j, (dist, dt, odt) in enumerate(plan):
            s = supported[(i + j) % len(supported)]
            # classic distributions also visit the empty shape and the single element
            fit = C.shapes_for(s, C.SHAPES, st.max_elements) if j >= 2 else _nonempty(s, st)
            if fit:
                out.append((True, _case(s, fit[(i + j) % len(fit)], dist, dt, st, j, odt)))
    if refused:
        s = refused[i % len(refused)]
        fit = _nonempty(s, st)
        if fit:
            out.append((False, _case(s, fit[i % len(fit)], "normal", "f32", st, 0)))
    return out


# --------------------------------------------------------------------------- running


def _name(backend) -> str:
    return str(getattr(backend, "name", type(backend).__name__))


def _support(backend, stratum: Stratum, expect: Callable[[QuantScheme], Any] | None
             ) -> tuple[list[QuantScheme], list[QuantScheme], K.Outcome | None]:
    """Split the candidates by `supports()`; a failure when supports() misbehaves or disagrees
    with the author's expectation."""
    sup, ref = [], []
    for s in stratum.candidates:
        try:
            ok = bool(K.check_supports(backend, s))
        except K.ConformanceFailure as f:
            return [], [], K.Outcome(K.FAILED, _name(backend), str(s), f.check, stratum.id, str(f))
        if expect is not None:
            want = expect(s)
            if want is not None and bool(want) != ok:
                msg = (f"backend '{_name(backend)}' failed check 'expected-support' on {s} "
                       f"[stratum {stratum.id}]: supports() says {ok}, the author expects {bool(want)}")
                return [], [], K.Outcome(K.FAILED, _name(backend), str(s), "expected-support", stratum.id, msg)
        (sup if ok else ref).append(s)
    return sup, ref, None


def _keep(case: C.Case, stratum: Stratum, case_filter: str | None) -> bool:
    return not case_filter or case_filter in stratum.id or case_filter in case.id or case_filter == case.scheme


def check_stratum(backend, stratum: Stratum, st: Settings, reference=None,
                  expect: Callable[[QuantScheme], Any] | None = None,
                  case_filter: str | None = None) -> list[K.Outcome]:
    """Every outcome of one stratum: the expectation check, then its cases (PASSED per supported
    case, REJECTED per rejection case, FAILED with the first disagreement)."""
    sup, refused, bad = _support(backend, stratum, expect)
    if bad is not None:
        return [bad]
    out = []
    for ok, case in stratum_cases(stratum, sup, refused, st):
        if not _keep(case, stratum, case_filter):
            continue
        check = K.check_supported if ok else K.check_rejected
        out.append(_run(backend, "supported" if ok else "rejected", case,
                        _then(partial(check, backend, case, reference), K.PASSED if ok else K.REJECTED)))
    return out


def _then(fn: Callable[[], Any], status: str = K.PASSED) -> Callable[[], str]:
    """`fn()` (a check that raises on failure), then `status`."""
    def go() -> str:
        fn()
        return status
    return go


def _run(backend, check: str, case: C.Case, fn: Callable[[], str]) -> K.Outcome:
    name = _name(backend)
    try:
        # saturating casts (huge inputs dequantized to f16) are expected; results are compared bit
        # for bit, so numpy's overflow warnings would only be noise
        with np.errstate(over="ignore", invalid="ignore", under="ignore"):
            return K.Outcome(fn(), name, case.scheme, check, case.id)
    except K.ConformanceFailure as f:
        return K.Outcome(K.FAILED, name, case.scheme, f.check, case.id, str(f))
    except Exception as e:  # noqa: BLE001 - a crash inside the harness is still a failure to see
        return K.Outcome(K.FAILED, name, case.scheme, check, case.id,
                         f"backend '{name}' failed check '{check}' on {case.scheme} shape {case.shape} "
                         f"[case {case.id}]: {type(e).__name__}: {e}")


def check_group(backend, kind: str, group: Stratum, st: Settings, reference=None,
                tolerances: K.Tolerances | None = None, peers: Sequence[Any] = (),
                case_filter: str | None = None) -> list[K.Outcome]:
    """The per-scheme check `kind` ('bad-input', 'ops', 'cross' or 'inputs') on one group: on a
    supported candidate (every one with `full`), else a rejection check (none for 'cross' and
    'inputs'). 'inputs': the maximum unique on each slot's first / last element (`maxfirst`,
    `maxlast`, through every supported-scheme check), non-C-ordered views and every output
    dtype (`check_views`), and a tensor past 2**20 elements (`check_large`)."""
    sup, refused, bad = _support(backend, group, None)
    if bad is not None:
        return [bad]
    i = group.index + st.seed
    picked = list(sup) if st.full else ([sup[i % len(sup)]] if sup else [])
    out: list[K.Outcome] = []
    for s in picked:
        for case in C.scheme_cases(kind, False, st.seed, st.max_elements, schemes=[s]):
            if not _keep(case, group, case_filter):
                continue
            if kind == "bad-input":
                out.append(_run(backend, kind, case, _then(partial(K.check_bad_inputs, backend, case, reference))))
            elif kind == "ops":
                out.append(_run(backend, kind, case,
                                _then(partial(K.check_ops, backend, case, reference, tolerances))))
            elif kind == "inputs":
                if case.dist in ("maxfirst", "maxlast"):
                    fn = K.check_supported
                elif case.shape == C.LARGE_SHAPE:
                    fn = K.check_large
                else:
                    fn = K.check_views
                out.append(_run(backend, kind, case, _then(partial(fn, backend, case, reference))))
            else:
                for peer in peers:
                    try:
                        if not peer.supports(s):
                            continue
                    except Exception:  # noqa: BLE001 - a broken peer is checked in its own run
                        continue
                    out.append(_run(backend, f"cross:{_name(peer)}", case,
                                    _then(partial(K.check_cross_backend, backend, peer, case, reference))))
    if not sup and refused and kind not in ("cross", "inputs"):
        s = refused[i % len(refused)]
        for case in C.scheme_cases(kind, False, st.seed, st.max_elements, schemes=[s]):
            if _keep(case, group, case_filter):
                out.append(_run(backend, "rejected", case,
                                _then(partial(K.check_rejected, backend, case, reference), K.REJECTED)))
    return out


def supports_nothing(expect: Callable[[QuantScheme], Any] | None, schemes: Sequence[QuantScheme]) -> bool:
    """The author declared an empty support: an expectation that wants none of `schemes`."""
    if expect is None:
        return False
    if getattr(expect, "empty", False):
        return True
    return not any(expect(s) for s in schemes)


def tested_nothing(backend_name: str, outcomes: Sequence[K.Outcome], n_strata: int) -> K.Outcome:
    """The failure of a run in which no case of a supported scheme ran."""
    n_rej = len({o.scheme for o in outcomes if o.status == K.REJECTED})
    return K.Outcome(
        K.FAILED, backend_name, "(none)", "tested-nothing", "",
        f"backend '{backend_name}' failed check 'tested-nothing': the run tested nothing "
        f"(no supported scheme in {n_strata} strata; {n_rej} schemes refused). If the backend "
        "is meant to support nothing, declare it: --expect none, or expected_support returning "
        "False for every scheme; otherwise fix supports() or the filters (--filter, --max-elements)")
