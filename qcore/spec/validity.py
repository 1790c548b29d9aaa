"""The rules between a scheme's parts, as one table (docs/spec.md: schemes, validity rules).

Each part checks itself when it is built (`qcore.spec.parts`); these rules say which parts go
together. `QuantScheme` runs them in table order after normalising its fields, and raises
`SchemeError` with the first broken rule's message, which names the way out. A rule is data: its
name (the docs' table lists the same names in the same order), what it requires in words, the
test that the scheme keeps it, and the message when it does not.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from qcore.errors import SchemeError
from qcore.spec.codecs import MX_DTYPES
from qcore.spec.parts import (SIGNED_SCALE_DTYPES, CodeRule, FieldOrder, OffsetKind, QuantMode, ScaleDtype, ScaleRound,
                              StoreKind)

if TYPE_CHECKING:
    from qcore.spec.schemes import QuantScheme

__all__ = ["Rule", "RULES", "check_rules"]


@dataclass(frozen=True)
class Rule:
    """One validity rule: `keeps(s)` is False for a scheme `s` that breaks it, then
    `message(s)` is the SchemeError's text."""

    name: str
    requires: str
    keeps: Callable[[QuantScheme], bool]
    message: Callable[[QuantScheme], str]


def _symmetric_int(s: QuantScheme) -> bool:
    return not s.value.traits.is_float and s.mode is QuantMode.SYMMETRIC


def _one_level_up_or_rne(s: QuantScheme) -> bool:
    return not s.two_level and s.scale_round is not ScaleRound.MX


def _split_fields(s: QuantScheme) -> int:
    return s.store.word_bits // s.value.bits


RULES: tuple[Rule, ...] = (
    Rule("native store", "Native holds an 8-bit value",
         lambda s: s.store.kind is not StoreKind.NATIVE or s.value.bits == 8,
         lambda s: f"Native store needs an 8-bit value, got {s.value}; use PackedU32(0) or PackedNative(0)"),
    Rule("packed native store", "PackedNative holds a sub-byte value (4 or 2 bits)",
         lambda s: s.store.kind is not StoreKind.PACKED_NATIVE or s.value.bits != 8,
         lambda s: f"PackedNative store needs a sub-byte value (4 or 2 bits), got {s.value}; use Native()"),
    Rule("split group", "a split order's group is a multiple of the fields per word n, at least 2n",
         lambda s: s.store.order is not FieldOrder.SPLIT
         or (s.store.group % _split_fields(s) == 0 and s.store.group >= 2 * _split_fields(s)),
         lambda s: f"a split group holds whole words of {_split_fields(s)} fields and at least two: a multiple of "
                   f"{_split_fields(s)} from {2 * _split_fields(s)} up, got order:split{s.store.group} for {s.value} "
                   f"in {s.store.kind.value}; e.g. order:split{16 * _split_fields(s)}"),
    Rule("flat blocks: one dim", "blocks over the flattened tensor have one dim",
         lambda s: s.block is None or not s.block.flat or len(s.block.dims) == 1,
         lambda s: f"blocks over the flattened tensor take one dim, got {'x'.join(map(str, s.block.dims))}; "
                   "e.g. block64:f32:flat"),
    Rule("flat blocks: axis 0", "blocks over the flattened tensor pack along axis 0",
         lambda s: s.block is None or not s.block.flat or s.store.dim == 0,
         lambda s: f"blocks over the flattened tensor store it as one line: the packing axis is 0, got {s.store}; "
                   f"drop ':{s.store.dim}'"),
    Rule("two-level block dtype", "two-level block scales are f16 or ue4m3",
         lambda s: not s.two_level or s.block.dtype in (ScaleDtype.F16, ScaleDtype.UE4M3),
         lambda s: f"two-level scales need block dtype f16 or ue4m3, got {s.block.dtype}; "
                   "use per_block(dims, UE4M3) + per_tensor(F32)"),
    Rule("two-level tensor dtype", "a two-level global scale is f32",
         lambda s: not s.two_level or s.tensor.dtype is ScaleDtype.F32,
         lambda s: f"two-level scales need tensor dtype f32, got {s.tensor.dtype}; use per_tensor(F32)"),
    Rule("reciprocal global", "a reciprocal global scale has a block level under it",
         lambda s: s.two_level or s.tensor is None or not s.tensor.reciprocal,
         lambda s: f"a reciprocal global scale (tensor:f32:recip) needs a block level under it, got {s}; "
                   "e.g. e2m1/block16:ue4m3/tensor:f32:recip/packed_native"),
    Rule("lookup value", "LOOKUP takes an integer value (its bit width sizes the table)",
         lambda s: s.mode is not QuantMode.LOOKUP or not s.value.traits.is_float,
         lambda s: f"LOOKUP needs an integer value (its bit width sizes the table), got {s.value}; use q4s or q8s"),
    Rule("table only in lookup", "a table comes with mode LOOKUP only",
         lambda s: s.mode is QuantMode.LOOKUP or s.table is None,
         lambda s: "a table is only meaningful with mode LOOKUP; use with_mode(LOOKUP, table)"),
    Rule("mx rounding", "round:mx takes one block level of ue8m0 scales and a symmetric value",
         lambda s: s.scale_round is not ScaleRound.MX or (
             s.block is not None and s.tensor is None and s.block.dtype.value in MX_DTYPES
             and s.mode is QuantMode.SYMMETRIC),
         lambda s: f"scale rounding mx (OCP MX: 2^(floor(log2 amax) - emax)) needs one block level of "
                   f"{'/'.join(MX_DTYPES)} scales and a symmetric value, got {s}; e.g. e2m1/block32:ue8m0/round:mx"),
    Rule("signed scales", "signed scales take a full-range integer value (q8f, q4f, q2f), symmetric mode, one "
                          "scale level of f32, f16 or bf16, rounding up or rne",
         lambda s: not s.signed or (
             _symmetric_int(s) and s.value.traits.qmin == -s.value.traits.qmax - 1 and _one_level_up_or_rne(s)
             and s.slot_dtype.value in SIGNED_SCALE_DTYPES),
         lambda s: f"signed scales need a full-range integer value (q8f, q4f, q2f), symmetric mode, one scale level "
                   f"of {'/'.join(SIGNED_SCALE_DTYPES)} and rounding up or rne, got {s}; e.g. q4f/block32:f16/signed"),
    Rule("affine offset", "an offset takes an integer value in symmetric mode, one scale level, unsigned "
                          "scales, rounding up or rne",
         lambda s: s.offset is None or (_symmetric_int(s) and _one_level_up_or_rne(s) and not s.signed),
         lambda s: f"an affine offset ({s.offset}) needs an integer value in symmetric mode, one scale level, "
                   f"unsigned scales and rounding up or rne, got {s}; e.g. u4/block32:f16/min:f16"),
    Rule("min offset", "a min offset (the value of code 0) takes an unsigned value (u8, u4, u2)",
         lambda s: s.offset is None or s.offset.kind is not OffsetKind.MIN or s.value.traits.unsigned,
         lambda s: f"a min offset is the value of code 0: it needs an unsigned value (u8, u4, u2), got {s}; "
                   f"e.g. u4/block32:f16/min:f16, or a zero point: {s.value}/.../zero"),
    Rule("unsigned value", "an unsigned value has an offset (min or zero)",
         lambda s: not s.value.traits.unsigned or s.offset is not None,
         lambda s: f"unsigned values ({s.value}) need an affine offset (/min:DTYPE or /zero), got {s}; "
                   "e.g. u4/block32:f16/min:f16"),
    Rule("code rule and zero point", "the code rules apply to min offsets, not to zero points",
         lambda s: s.code_rule is CodeRule.DIV or s.offset is None or s.offset.kind is not OffsetKind.ZERO,
         lambda s: f"the code rules apply to min offsets, not to zero points, got {s}"),
    Rule("midpoint codes", "codes:midpoint takes a LOOKUP scheme with one scale level, rounding up or rne",
         lambda s: s.code_rule is not CodeRule.MIDPOINT or (s.mode is QuantMode.LOOKUP and _one_level_up_or_rne(s)),
         lambda s: f"code rule midpoint needs a LOOKUP scheme with one scale level and rounding up or rne, got "
                   f"{s}; e.g. nf4/block64:f32:flat/packed_native/order:high/codes:midpoint"),
    Rule("integer code rules", "codes:away and codes:offset take an integer value, symmetric mode, one scale "
                               "level, rounding up or rne",
         lambda s: s.code_rule in (CodeRule.DIV, CodeRule.MIDPOINT) or (_symmetric_int(s) and _one_level_up_or_rne(s)),
         lambda s: f"code rule {s.code_rule} needs an integer value, symmetric mode, one scale level and rounding "
                   f"up or rne, got {s}; e.g. q8s/block32:f16/round:rne/codes:away"),
)
"""Every rule between a scheme's parts, in the order `check_rules` tries them."""


def check_rules(scheme: QuantScheme) -> None:
    """Raise SchemeError with the message of the first rule in `RULES` that `scheme` breaks."""
    for rule in RULES:
        if not rule.keeps(scheme):
            raise SchemeError(rule.message(scheme))
