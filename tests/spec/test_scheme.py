"""Schemes as values (docs/spec.md, schemes): validity rules, presets and the text form."""
import itertools

import pytest

import qcore
from qcore import (
    Native, PackedNative, PackedU32, QuantMode, QuantScheme, QuantValue, ScaleDtype, SchemeError,
)
from qcore.spec.schemes import PRESETS, TABLES, base_scheme
from qcore.spec.validity import RULES
from tests.paths import ROOT


def all_valid_schemes():
    """A broad sample of valid schemes: every value x mode x level x store."""
    out = []
    levels = [
        lambda s: s,
        lambda s: s.per_tensor(ScaleDtype.F16),
        lambda s: s.per_tensor(ScaleDtype.UE8M0),
        lambda s: s.per_block([32], ScaleDtype.BF16),
        lambda s: s.per_block([4, 8], ScaleDtype.UE4M3),
        lambda s: s.per_block([3], ScaleDtype.F16).per_tensor(ScaleDtype.F32),
        lambda s: s.per_block([2, 2, 2], ScaleDtype.UE4M3).per_tensor(),
    ]
    for value in QuantValue:
        modes = [base_scheme(value)]
        if not value.traits.is_float and not value.traits.unsigned:
            tab = [float(i) - (1 << value.bits) / 2 + 0.5 for i in range(1 << value.bits)]
            modes.append(QuantScheme(value).with_mode(QuantMode.LOOKUP, tab))
        stores = [PackedU32(0), PackedU32(1)] + ([Native()] if value.bits == 8 else [PackedNative(0), PackedNative(2)])
        for base, level, store in itertools.product(modes, levels, stores):
            if base.affine and level(QuantScheme()).two_level:
                continue  # an affine offset takes one scale level (docs/spec.md, affine offsets)
            out.append(level(base).with_store(store))
    for text in ("u4/block32:f16/min:f16", "u8/tensor:bf16/min:f32/round:rne/codes:away", "q4f/block32:bf16/zero",
                 "u2/block4x8:f32/packed_native/zero", "q8s/block3:f16/zero/round:rne", "q4_1"):
        out.append(qcore.scheme(text))
    return out


VALID = all_valid_schemes()


@pytest.mark.parametrize("s", VALID, ids=str)
def test_text_round_trip(s):
    parsed = qcore.scheme(str(s))
    assert str(parsed) == str(s)
    if s.is_lookup and s.table_name is None:
        # A custom table is not in the text: it travels in the payload (docs/spec.md, schemes and portable bytes).
        assert parsed.table is None and parsed.with_mode("lookup", s.table) == s
    else:
        assert parsed == s and hash(parsed) == hash(s)


@pytest.mark.parametrize(
    "text",
    ["q8s", "q4s/block32:f16", "q4f/block2x16:bf16/packed_native", "q2s/packed_u32:1",
     "e2m1/block16:ue4m3/tensor:f32/packed_native", "q4s-lookup[nf4]/block64:f32"],
)
def test_spec_examples_print_canonically(text):
    assert str(qcore.scheme(text)) == text


def test_defaults():
    s = QuantScheme()
    assert s.value is QuantValue.Q8S and s.mode is QuantMode.SYMMETRIC
    assert s.store == Native() and s.block is None and s.tensor is None
    assert QuantScheme(QuantValue.Q4S).store == PackedU32(0)
    assert str(QuantScheme(QuantValue.Q2F)) == "q2f"


def test_default_store_omitted_and_explicit_other_store_printed():
    assert str(qcore.scheme("q4s/packed_u32:0")) == "q4s"
    assert str(qcore.scheme("q8s/native")) == "q8s"
    assert str(qcore.scheme("q8s/packed_u32")) == "q8s/packed_u32"


def test_leading_ones_dropped():
    assert qcore.scheme("q8s/block1x1x32:f16") == qcore.scheme("q8s/block32:f16")
    assert QuantScheme().per_block([1, 32]) == QuantScheme().per_block([32])


def test_per_tensor_f32_alone_is_the_default():
    assert QuantScheme().per_tensor(ScaleDtype.F32) == QuantScheme()
    assert str(qcore.scheme("q8s/tensor:f32")) == "q8s"
    assert str(qcore.scheme("q8s/tensor:ue8m0")) == "q8s/tensor:ue8m0"


def test_presets():
    assert str(PRESETS["nvfp4"]) == "e2m1/block16:ue4m3/tensor:f32/packed_native"
    assert str(PRESETS["mxfp4"]) == "e2m1/block32:ue8m0/packed_native"
    assert str(PRESETS["mxfp8"]) == "e4m3/block32:ue8m0"
    assert str(PRESETS["nf4"]) == "q4s-lookup[nf4]/block64:f32"
    assert qcore.scheme("NVFP4") == PRESETS["nvfp4"]
    assert len(TABLES["nf4"]) == 16 and TABLES["nf4"][7] == 0.0


def test_immutable_and_hashable():
    s = qcore.scheme("q4s/block32:f16")
    with pytest.raises(Exception):
        s.value = QuantValue.Q8S  # type: ignore[misc]
    assert len({s, qcore.scheme("q4s/block32:f16")}) == 1


def test_with_value_keeps_default_store_adaptive():
    s = QuantScheme().per_block([32], "f16").with_value("q4s")
    assert s.store == PackedU32(0)


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: QuantScheme(QuantValue.Q4S).with_store(Native()), r"Native store needs an 8-bit value, got q4s; use PackedU32"),
        (lambda: QuantScheme(QuantValue.E4M3).with_store(PackedNative(0)), r"PackedNative store needs a sub-byte value .* got e4m3; use Native"),
        (lambda: QuantScheme().per_block([32], "bf16").per_tensor(), r"two-level scales need block dtype f16 or ue4m3, got bf16"),
        (lambda: QuantScheme().per_block([32], "f16").per_tensor("f16"), r"two-level scales need tensor dtype f32, got f16"),
        (lambda: QuantScheme(QuantValue.E2M1).with_mode("lookup", [0.0] * 16), r"LOOKUP needs an integer value"),
        (lambda: QuantScheme(QuantValue.Q4S).with_mode("lookup", list(range(15))), r"exactly 16 entries, got 15"),
        (lambda: QuantScheme(QuantValue.Q2S).with_mode("lookup", [0, 2, 1, 3]), r"strictly increasing"),
        (lambda: QuantScheme(QuantValue.Q2S).with_mode("lookup", [0, 1, 2, float("nan")]), r"finite"),
        (lambda: QuantScheme(QuantValue.Q2S).with_mode("lookup", [0, 1, 2, 1e39]), r"finite"),
        (lambda: QuantScheme(QuantValue.Q2S).with_mode("lookup"), r"LOOKUP needs a table"),
        (lambda: QuantScheme().per_block([]), r"1 to 5 entries"),
        (lambda: QuantScheme().per_block([1, 2, 3, 4, 5, 6]), r"1 to 5 entries"),
        (lambda: QuantScheme().per_block([0]), r"positive ints"),
        (lambda: QuantScheme().per_block([32], "f64"), r"unknown scale dtype 'f64'"),
        (lambda: PackedU32(-1), r"packing axis must be an int >= 0"),
        (lambda: qcore.scheme("q9s"), r"unknown value 'q9s'"),
        (lambda: qcore.scheme("q8s/block32/block16"), r"block given twice"),
        (lambda: qcore.scheme("q8s/blockx"), r"unknown part 'blockx'"),
        (lambda: qcore.scheme("q4s-lookup[nope]"), r"unknown lookup table 'nope'"),
        (lambda: qcore.scheme(42), r"a scheme is text or a QuantScheme"),
    ],
)
def test_validity_errors_say_what_to_use(build, match):
    with pytest.raises(SchemeError, match=match):
        build()


BREAKS = {  # per rule of qcore.spec.validity.RULES: a scheme that breaks it, and its message's start
    "native store": ("q4s/native", "Native store needs an 8-bit value"),
    "packed native store": ("q8s/packed_native", "PackedNative store needs a sub-byte value"),
    "split group": ("q4f/block32:f16/packed_native/order:split5", "a split group holds whole words of 2 fields"),
    "flat blocks: one dim": ("q8s/block4x8:f32:flat", "blocks over the flattened tensor take one dim"),
    "flat blocks: axis 0": ("q4s/block64:f32:flat/packed_u32:1", "blocks over the flattened tensor store it as one"),
    "two-level block dtype": ("q8s/block32:bf16/tensor:f32", "two-level scales need block dtype f16 or ue4m3"),
    "two-level tensor dtype": ("q8s/block32:f16/tensor:f16", "two-level scales need tensor dtype f32"),
    "reciprocal global": ("q8s/tensor:f32:recip", "a reciprocal global scale (tensor:f32:recip) needs a block"),
    "lookup value": ("e2m1-lookup[nf4]", "LOOKUP needs an integer value"),
    "mx rounding": ("e2m1/block32:f16/packed_native/round:mx", "scale rounding mx"),
    "signed scales": ("q4s/block32:f16/signed", "signed scales need a full-range integer value"),
    "affine offset": ("q4f/block32:f16/tensor:f32/zero", "an affine offset (zero) needs an integer value"),
    "min offset": ("q4f/block32:f16/min:f16", "a min offset is the value of code 0"),
    "unsigned value": ("u4/block32:f16", "unsigned values (u4) need an affine offset"),
    "code rule and zero point": ("q4f/block32:f16/zero/codes:away", "the code rules apply to min offsets"),
    "midpoint codes": ("q4s/block32:f16/codes:midpoint", "code rule midpoint needs a LOOKUP scheme"),
    "integer code rules": ("e4m3/block32:f16/codes:away", "code rule away needs an integer value"),
}


@pytest.mark.parametrize("name", sorted(BREAKS))
def test_each_validity_rule_refuses_a_scheme_that_breaks_it(name):
    text, message = BREAKS[name]
    with pytest.raises(SchemeError) as e:
        qcore.scheme(text)
    assert str(e.value).startswith(message), f"{text!r}: {e.value}"


def test_table_only_in_lookup_mode():
    with pytest.raises(SchemeError, match="a table is only meaningful with mode LOOKUP"):
        QuantScheme(QuantValue.Q4S, table=tuple(range(16)))


def test_every_validity_rule_has_a_breaking_example_and_a_docs_row():
    assert set(BREAKS) | {"table only in lookup"} == {r.name for r in RULES}
    text = (ROOT / "docs" / "spec.md").read_text(encoding="utf-8")
    rows = [line.split("|")[1:3] for line in text.splitlines() if line.startswith("| ")]
    table = [(a.strip(), b.strip()) for a, b in rows]
    assert [(r.name, r.requires) for r in RULES] == [t for t in table if t[0] in {r.name for r in RULES}]


def test_lookup_table_strictly_increasing_as_float32():
    # distinct in float64, equal after rounding to float32
    with pytest.raises(SchemeError, match="strictly increasing"):
        QuantScheme(QuantValue.Q2S).with_mode("lookup", [0.0, 1.0, 1.0 + 1e-12, 2.0])


def test_lookup_table_all_zero_rejected():
    # with 2**bits >= 4 entries, "strictly increasing" already excludes an all-zero table
    with pytest.raises(SchemeError, match="strictly increasing|all zero"):
        QuantScheme(QuantValue.Q2S).with_mode("lookup", [0.0, 0.0, 0.0, 0.0])


def test_custom_lookup_text_has_no_table_and_cannot_quantize():
    s = qcore.scheme("q4s-lookup/block32:f32")
    assert s.table is None and s.is_lookup
    with pytest.raises(SchemeError, match="custom table"):
        s.require_table()


def test_named_table_is_recognised_from_values():
    s = QuantScheme(QuantValue.Q4S).with_mode("lookup", list(TABLES["nf4"])).per_block([64])
    assert str(s) == "q4s-lookup[nf4]/block64:f32"
