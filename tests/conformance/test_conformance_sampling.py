"""The conformance suite's sampling, inputs and expectations: strata cover the whole scheme space,
inputs hit the spec's decision points exactly, `--expect` patterns mean what docs/plugins.md says,
and a failing case can be rerun by its id."""
from __future__ import annotations

import numpy as np
import pytest

import qcore
from qcore.conformance import cases as C
from qcore.conformance import runner
from qcore.conformance import sampling as S
from qcore.conformance.expect import as_expectation, parse_expect, scheme_label
from qcore.conformance.inputs import decision_points, grid_exponents, scheme_input, slot_ids
from qcore.errors import InputError
from qcore.spec.arithmetic import calibrate
from qcore.backend.reference import ReferenceBackend
from tests.mutants import NARROW_EXPECT, Narrow, NarrowRefusesBlocks


def test_strata_partition_the_whole_space_by_value_level_kind_dtype_and_store():
    space = set(C.scheme_space(full=True)) | set(C.SPACE_PRESETS)
    st = S.strata()
    v1 = [x for x in st if S.is_v1_stratum(x)]
    assert sorted(s for x in v1 for s in map(str, x.candidates)) == sorted(map(str, space))
    assert len({x.id for x in st}) == len(st)
    keys = {(C.value_label(s), S.level_kind(s), str(s.slot_dtype), s.store.kind.value) for s in space}
    assert len(keys) == len(v1) == 420
    for x in v1:  # each stratum with a block or a packing axis rotates over their variants
        if x.id.endswith("/native") and "/tensor:" in x.id:
            continue
        assert len({(s.block.dims if s.block else None, s.store.dim) for s in x.candidates}) >= 2, x.id


def test_rounding_rule_strata_hold_every_scheme_under_each_rule_that_differs():
    """The other scale rounding rules have strata per (rule, level kind, scale dtype), holding the
    whole space under the rule wherever it applies (not rne on F32 slots: the identity)."""
    space = set(C.scheme_space(full=True)) | set(C.SPACE_PRESETS)
    ruled = [x for x in S.strata() if x.id.startswith("round:")]
    got = {s for x in ruled for s in x.candidates}
    want = {s.with_scale_round("rne") for s in space if str(s.slot_dtype) != "f32"}
    want |= {s.with_scale_round("mx") for s in space
             if s.block is not None and s.tensor is None and str(s.block.dtype) == "ue8m0" and not s.is_lookup}
    assert got == want
    assert {x.id for x in ruled} >= {"round:mx/block:ue8m0", "round:rne/two-level:ue4m3", "round:rne/tensor:f16"}
    assert all(s.scale_round.value == "up" for g in S.groups() for s in g.candidates)


def test_signed_and_code_rule_strata_hold_the_space_under_each_variant():
    """Signed scales and code rules (docs/spec.md): strata per (rule, level kind) hold every scheme of
    the space under each (signed, rounding, code rule) variant that is valid, the q8_0 / q4_0
    presets among them, after the v1 and rounding strata; the per-scheme groups keep v1's rules."""
    space = set(C.scheme_space(full=True)) | set(C.SPACE_PRESETS)
    ruled = [x for x in S.strata() if x.id.split("/")[0] in ("signed", "codes:away", "codes:offset", "codes:midpoint")]
    got = {s for x in ruled for s in x.candidates}
    want = {v for s in space for var in S.RULE_VARIANTS if (v := S.rule_variant(s, *var)) is not None}
    assert got == want and qcore.PRESETS["q8_0"] in got and qcore.PRESETS["q4_0"] in got
    assert {x.id for x in ruled} == {f"{r}/{k}" for r in ("signed", "codes:away", "codes:offset", "codes:midpoint")
                                     for k in ("tensor", "block")}
    assert all(s.is_lookup for x in ruled if x.id.startswith("codes:midpoint") for s in x.candidates)
    assert min(x.index for x in ruled) > max(x.index for x in S.strata() if not x.id.startswith(
        ("signed", "codes:", "affine:", "order:", "flat/")))
    for x in ruled:
        assert all(s.signed for s in x.candidates) if x.id.startswith("signed") else \
            all(s.code_rule.value == x.id.split("/")[0][6:] for s in x.candidates)
    assert not any(s.signed or s.reciprocal_codes or s.affine for g in S.groups() for s in g.candidates)
    affine = {x.id: x for x in S.strata() if x.id.startswith("affine:")}
    assert set(affine) == {f"affine:{k}/{lv}" for k in ("min", "zero") for lv in ("tensor", "block")}
    assert qcore.PRESETS["q4_1"] in affine["affine:min/block"].candidates
    assert all(s.traits.unsigned for s in affine["affine:min/block"].candidates)
    assert {s.traits.unsigned for s in affine["affine:zero/block"].candidates} == {True, False}


def test_layout_strata_hold_each_packed_or_one_dim_block_scheme_in_field_orders_and_flat_blocks():
    """Field orders and flat blocks (docs/spec.md): `order:high` / `order:split` per packed store kind
    hold every packed scheme of the space in that order (split groups of max(16, 2n)), `flat/*` every
    one-dim block scheme with its blocks over the flattened tensor; they come last and stay out of
    the groups."""
    space = set(C.scheme_space(full=True)) | set(C.SPACE_PRESETS)
    layout_strata = {x.id: x for x in S.strata() if x.id.startswith(("order:", "flat/"))}
    assert set(layout_strata) == {f"order:{o}/{k}" for o in ("high", "split") for k in ("packed_u32", "packed_native")} \
        | {f"flat/{lv}" for lv in ("block", "two-level", "two-level-recip")}
    got = {s for x in layout_strata.values() for s in x.candidates}
    assert got == {v for s in space for v in S.layout_variants(s)}
    packed = [s for s in space if s.store.kind.value != "native"]
    assert {s.with_field_order("high") for s in packed} <= got
    assert all(s.flat_blocks and len(s.block.dims) == 1 for s in layout_strata["flat/block"].candidates)
    assert all(s.store.group == max(16, 2 * s.store.word_bits // s.bits)
               for s in layout_strata["order:split/packed_u32"].candidates)
    assert min(x.index for x in layout_strata.values()) > max(
        x.index for x in S.strata() if not x.id.startswith(("order:", "flat/")))
    assert not any(s.flat_blocks or s.field_order.value != "low" for g in S.groups() for s in g.candidates)


def test_bounds_inputs_aim_at_each_rules_boundaries():
    """`bounds` slots under rne aim the raw scale at a midpoint between storable values (and an ulp
    either side); under mx, whose raw scale is amax itself, at a power of two."""
    for text, check in (("q8s/block32:f16/round:rne", "tie"), ("q8s/block32:ue8m0/round:mx", "pow2")):
        s = qcore.scheme(text)
        hits = 0
        for seed in range(6):
            x = scheme_input((4, 192), "bounds", s, seed)
            amax = np.abs(x).reshape(-1, 32).max(1)
            raw = (amax / np.float32(s.scale_divisor)).astype(np.float32)
            if check == "tie":  # an ulp either side rounds to different storable values
                rne = s.slot_dtype.traits.round_nearest
                hits += int(np.sum((raw > 0) & (rne(np.nextafter(raw, np.float32(np.inf)))
                                                != rne(np.nextafter(raw, np.float32(0))))))
            else:
                hits += int(np.sum((raw > 0) & (np.frexp(raw)[0] == 0.5)))
        assert hits >= 3, (text, hits)


def test_supported_strata_get_two_separating_cases_and_refused_ones_one():
    x = next(s for s in S.strata() if s.id == "q4s/block:f16/packed_native")
    got = S.stratum_cases(x, list(x.candidates), [], S.Settings())
    assert [c.dist for _, c in got][:2] == ["grid", "bounds"] and all(ok for ok, _ in got)
    assert len({c.scheme for _, c in got}) >= 2  # two different block shapes / packing axes
    got = S.stratum_cases(x, [], list(x.candidates), S.Settings())
    assert len(got) == 1 and not got[0][0]


def test_decision_points_are_every_tie_and_midpoint():
    q8s = decision_points(qcore.scheme("q8s"))
    ties = np.arange(-126.5, 127, 1.0)
    assert set(ties) <= set(q8s.tolist()) and 127.5 not in q8s and -127.5 not in q8s
    e2m1 = decision_points(qcore.scheme("e2m1"))
    assert {0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, 6.0}.issubset(set(e2m1.tolist()))
    assert np.signbit(e2m1[-1]) and e2m1[-1] == 0  # -0.0


@pytest.mark.parametrize("text", ["q8s/block4x8:ue4m3", "q4f/block3x5:f16/packed_native:1", "e4m3/block32:ue8m0",
                                  "q2s-lookup/tensor:bf16/packed_u32"])
def test_grid_input_puts_y_exactly_on_decision_points(text):
    s = C.conformance_scheme(text)
    shape = (6, 40)
    x = scheme_input(shape, "grid", s, 7)
    p = calibrate(x, s)
    js = grid_exponents(shape, s, 7)
    assert np.array_equal(np.asarray(p.scales, np.float64), np.ldexp(1.0, js))  # e = 2**j exactly
    y = x.reshape(-1).astype(np.float64) / np.ldexp(1.0, js.reshape(-1))[slot_ids(shape, s)]
    assert set(y.tolist()) <= set(decision_points(s).astype(np.float64).tolist()) | {s.half_range, -s.half_range}
    assert abs(y[0]) == abs(y[-1]) == np.float32(s.half_range)  # the maximum on the first and last elements


@pytest.mark.parametrize("text", ["q8s", "q8s/block32:f32", "q4f/block3x5:f16/packed_native:1",
                                  "e2m1/block16:ue4m3/tensor:f32", "q8s/block32:f32:flat"])
@pytest.mark.parametrize("dist", ["maxfirst", "maxlast"])
def test_edge_max_inputs_put_each_slots_only_maximum_on_its_first_or_last_element(text, dist):
    s = C.conformance_scheme(text)
    shape = C.EDGE_SHAPES[0]
    x = scheme_input(shape, dist, s, 11).reshape(-1).astype(np.float64)
    slots = slot_ids(shape, s)
    for k in np.unique(slots):
        members = np.flatnonzero(slots == k)
        a = np.abs(x[members])
        edge = -1 if dist == "maxlast" else 0
        assert a[edge] > 0 and (np.delete(a, edge if edge >= 0 else a.size - 1) < a[edge]).all()
    assert np.abs(x[-1 if dist == "maxlast" else 0]) == np.abs(x[slots == slots[-1 if dist == "maxlast" else 0]]).max()


def test_input_kinds_views_hold_the_same_values_in_other_memory_orders():
    from qcore.conformance.checks import input_views

    x = C.make_input((3, 5, 7), "normal", "f32", 1)
    views = dict(input_views(x))
    assert set(views) == {"fortran", "transposed", "step-axis0", "step-last-axis", "negative-strides"}
    for v in views.values():
        assert not v.flags.c_contiguous and np.array_equal(v, x)
    cases = list(C.scheme_cases("inputs", schemes=[qcore.scheme("q8s/block3x5:f32")]))
    assert [c.dist for c in cases] == ["maxlast", "maxfirst", "normal", "normal"]
    assert cases[-1].shape == C.LARGE_SHAPE and np.prod(C.LARGE_SHAPE) > 2 ** 20
    assert [c.dist for c in C.scheme_cases("inputs", max_elements=1000, schemes=[qcore.scheme("q8s")])] == \
        ["maxlast", "maxfirst", "normal"]


def test_bounds_input_puts_raw_scales_on_and_around_storable_values():
    s = qcore.scheme("q8s/block4x8:f16")
    x = scheme_input((24, 64), "bounds", s, 3)
    raw = (calibrate(x, qcore.scheme("q8s/block4x8:f32")).scales).reshape(-1)  # max / h, unrounded
    tr = s.slot_dtype.traits
    stored = tr.store(raw)
    at = raw == stored
    assert (at & (raw > 2.0 ** -14) & (raw < 65504)).any()  # exactly storable: must not move
    below_next = tr.store(np.nextafter(raw, np.float32(0))) == stored
    assert (~at & (tr.store(np.nextafter(raw, np.float32(0))) < stored)).any()  # one ulp above a boundary
    assert (~at & below_next & (raw > 0)).any()
    assert (raw > 65504).any() and (raw == 0).any() and ((raw > 0) & (raw < 2.0 ** -14)).any()


def test_expect_patterns():
    e = parse_expect([NARROW_EXPECT])
    yes = ["q8s", "q8s/block32:f32", "q8s/block4x8:f32"]
    no = ["q8s/block32:f16", "q8s/block32:f16/tensor:f32", "q8f", "q8s/packed_u32", "q8s-lookup"]
    assert all(e(C.conformance_scheme(t)) for t in yes) and not any(e(C.conformance_scheme(t)) for t in no)
    assert scheme_label(qcore.scheme("nvfp4")) == "e2m1/block16:ue4m3/tensor:f32/packed_native"
    lookup = parse_expect(["*-lookup*", "!q2*"])
    assert lookup(qcore.scheme("nf4")) and not lookup(C.conformance_scheme("q2s-lookup"))
    assert not lookup(qcore.scheme("q4s"))
    assert parse_expect(["none"]).empty and parse_expect([]) is None
    assert as_expectation([]).empty and as_expectation("q8s")(qcore.scheme("q8s/block32:bf16"))
    with pytest.raises(InputError, match="cannot be read"):
        parse_expect(["@/no/such/file"])
    with pytest.raises(InputError, match="'none' and also"):
        parse_expect(["none,q8s"])


def test_support_file(tmp_path):
    f = tmp_path / "support.txt"
    f.write_text("# narrow plugin\nq8s/tensor:f32/native\nq8s/block*:f32/native  # blocks\n")
    e = parse_expect([f"@{f}"])
    assert e.patterns == ("q8s/tensor:f32/native", "q8s/block*:f32/native")


def _register(monkeypatch, be):
    from qcore.backend import registry

    real_backend, real_registered = registry.backend, registry.registered
    monkeypatch.setattr(registry, "backend", lambda n=None: be if n == be.name else real_backend(n))
    monkeypatch.setattr(registry, "registered", lambda: {**real_registered(), be.name: be})


def test_cli_expect_fails_a_backend_refusing_what_its_author_expects(monkeypatch, capsys):
    from qcore.cli import main as cli

    _register(monkeypatch, NarrowRefusesBlocks())
    argv = ["conformance", "--backend", "narrow-refuses-blocks", "--no-progress", "--checks", "case"]
    assert cli.main(argv + ["-x"]) == 0  # without an expectation, refusing is allowed
    assert cli.main(argv + ["--expect", NARROW_EXPECT, "-x"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "failed check 'expected-support' on q8s/block" in out and "the author expects True" in out, out


def test_cli_case_reruns_one_case(monkeypatch, capsys):
    _register(monkeypatch, Narrow())
    assert runner.main(["--backend", "narrow", "--case", "q8s/block3x5:f32-6x40-grid-f32-f32-0"]) == 0
    assert "narrow: 1 schemes supported and conforming" in " ".join(capsys.readouterr().out.split())
    assert runner.main(["--backend", "narrow", "--case", "q8s-6x40-nope"]) == 2


def test_case_ids_round_trip():
    x = S.strata()[100]
    for _, c in S.stratum_cases(x, list(x.candidates), list(x.candidates), S.Settings(seed=5)):
        again = C.Case.from_id(c.id, 5)
        assert again == c and again.input().tobytes() == c.input().tobytes()


def test_max_elements_and_empty_shapes_in_strata():
    st = S.Settings(max_elements=64)
    for x in S.strata()[::17]:
        for _, c in S.stratum_cases(x, list(x.candidates), [], st):
            assert np.prod(c.shape) <= 64


def test_reference_default_run_over_a_slice_of_strata_passes():
    report = runner.run([ReferenceBackend()], max_schemes=24, kinds=["case"])
    assert report.ok, [o.message for o in report.failed[:2]]


def test_expect_per_backend_on_the_command_line():
    from qcore.conformance.expect import per_backend as _expectations

    e = _expectations(["ndarray=q8f,q8s", "lutcpu=*-lookup*"], ["ndarray", "lutcpu"])
    assert e["ndarray"](qcore.scheme("q8s/block32:bf16")) and not e["ndarray"](qcore.scheme("nf4"))
    assert e["lutcpu"](qcore.scheme("nf4")) and not e["lutcpu"](qcore.scheme("q8s"))
    with pytest.raises(InputError, match="does not check"):
        _expectations(["cuda=q8s"], ["ndarray"])


def test_strata_subset_spreads_over_groups():
    """A cap on strata keeps every (value x mode, level kind) group once it allows one each, turns
    the scale dtypes and store kinds over between groups, and spreads a smaller cap evenly."""
    from qcore.conformance import sampling as S

    rules = {"round:rne", "round:mx", "signed", "codes:away", "codes:offset", "codes:midpoint", "affine:min",
             "affine:zero", "order", "flat"}
    groups = {g.id for g in S.groups()} | rules
    assert S.strata_subset(None) == S.strata()
    v1 = [s for s in S.strata() if S.is_v1_stratum(s)]
    for n in (len(groups), len(groups) + 13, 150):
        sub = S.strata_subset(n)
        assert len(sub) == n and len(set(sub)) == n
        assert {S.group_of(s) for s in sub} == groups
        assert {s.id.split(":")[0] for s in sub if s in v1} == groups - rules
        assert {s.id.rsplit("/", 1)[1] for s in sub if s in v1} == {s.id.rsplit("/", 1)[1] for s in v1}
        assert len({s.id.split(":")[1].split("/")[0] for s in sub if s in v1}) == 5  # the five scale dtypes
    few = S.strata_subset(6)
    assert len({S.group_of(s) for s in few}) == 6  # six groups spread over the space, not the first group's
    assert len({s.id.split("/")[0] for s in few}) >= 5  # (the reciprocal-global groups repeat values)
