"""Quantization schemes as immutable values, their validity rules and text form (docs/spec.md, schemes)."""
from __future__ import annotations

import re
from dataclasses import dataclass, fields, replace
from typing import Any, Iterable, Sequence

import numpy as np

from qcore.errors import SchemeError
from qcore.spec.codecs import SCALE_SLOTS, ScaleSlot, ValueTraits, scale_slot_id
from qcore.spec.parts import (TABLES, BlockLevel, CodeRule, FieldOrder, Native,
                              Offset, OffsetKind, PackedNative, PackedU32, QuantMode, QuantStore, QuantValue,
                              ScaleDtype, ScaleRound, StoreKind, TensorLevel, _check_table, _coerce,
                              _NATIVE, _PACKED_U32_0, _normalize_dims, _parse_int)
from qcore.spec.validity import check_rules

__all__ = [
    "QuantValue",
    "QuantMode",
    "ScaleDtype",
    "ScaleRound",
    "CodeRule",
    "OffsetKind",
    "Offset",
    "StoreKind",
    "FieldOrder",
    "QuantStore",
    "Native",
    "PackedU32",
    "PackedNative",
    "BlockLevel",
    "TensorLevel",
    "QuantScheme",
    "TABLES",
    "PRESETS",
    "scheme",
    "base_scheme",
]


@dataclass(frozen=True)
class QuantScheme:
    """An immutable, hashable quantization scheme (docs/spec.md, schemes).

    Build with the builder methods, or parse text with `qcore.scheme(...)`:

    >>> QuantScheme().with_value(QuantValue.Q4S).per_block([32], ScaleDtype.F16)
    QuantScheme('q4s/block32:f16')
    """

    value: QuantValue = QuantValue.Q8S
    mode: QuantMode = QuantMode.SYMMETRIC
    table: tuple[float, ...] | None = None
    block: BlockLevel | None = None
    tensor: TensorLevel | None = None
    _store: QuantStore | None = None  # None = the default store for the value
    scale_round: ScaleRound = ScaleRound.UP
    signed: bool = False  # signed scales: slot scales may be negative; raw s = m / qmin
    code_rule: CodeRule = CodeRule.DIV
    offset: Offset | None = None  # affine offsets: an affine scheme's per-slot offset

    def __post_init__(self) -> None:
        value = _coerce(QuantValue, self.value, "value")
        mode = _coerce(QuantMode, self.mode, "mode")
        object.__setattr__(self, "value", value)
        object.__setattr__(self, "mode", mode)
        object.__setattr__(self, "scale_round", _coerce(ScaleRound, self.scale_round, "scale rounding rule"))
        object.__setattr__(self, "code_rule", _coerce(CodeRule, self.code_rule, "code rule"))
        object.__setattr__(self, "signed", bool(self.signed))
        # A per-tensor F32 level alone is the same as no level: normalise so both compare equal.
        if self.block is None and self.tensor == TensorLevel(ScaleDtype.F32):
            object.__setattr__(self, "tensor", None)
        if self._store is not None and self._store == self.default_store(value):
            object.__setattr__(self, "_store", None)
        if self.block is not None and not isinstance(self.block, BlockLevel):
            raise SchemeError(f"block must be a BlockLevel, got {self.block!r}; use per_block(dims, dtype)")
        if self.block is not None and self.block.flat:
            object.__setattr__(self, "block", replace(self.block, flat=True))
        if self.offset is not None and not isinstance(self.offset, Offset):
            raise SchemeError(f"offset must be an Offset, got {self.offset!r}; e.g. Offset('min', 'f16')")
        check_rules(self)
        if mode is QuantMode.LOOKUP and self.table is not None:
            object.__setattr__(self, "table", _check_table(self.table, self.value.bits))

    def __hash__(self) -> int:
        """The fields' hash, computed once (schemes key the backends' plan caches on every call)."""
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(tuple(getattr(self, f.name) for f in fields(self)))
            object.__setattr__(self, "_hash", h)
        return h

    def __reduce__(self):
        # the fields only: a cached hash is of this process (str hashes are salted per process)
        return (type(self), tuple(getattr(self, f.name) for f in fields(self)))

    # ------------------------------------------------------------------ derived facts
    @staticmethod
    def default_store(value: QuantValue) -> QuantStore:
        """`Native` for 8-bit values, `PackedU32(0)` for sub-byte ones."""
        return _NATIVE if value.bits == 8 else _PACKED_U32_0

    @property
    def store(self) -> QuantStore:
        return self._store if self._store is not None else self.default_store(self.value)

    @property
    def flat_blocks(self) -> bool:
        """Blocks over the row-major flattened tensor (docs/spec.md, flat blocks)."""
        return self.block is not None and self.block.flat

    @property
    def unflat(self) -> "QuantScheme":
        """The same scheme with ordinary blocks: a flat-block tensor of shape S is stored as the
        1-D tensor [prod(S)] of this scheme (docs/spec.md, flat blocks)."""
        return replace(self, block=replace(self.block, flat=False)) if self.flat_blocks else self

    @property
    def field_order(self) -> FieldOrder:
        """The packed store's field order (docs/spec.md, field orders); LOW for v1 and Native."""
        return FieldOrder.LOW if self._store is None else self._store.order

    @property
    def low_order(self) -> "QuantScheme":
        """The same scheme in the byte layout's field order (the same codes, packed element 0 lowest)."""
        if self._store is None or self._store.order is FieldOrder.LOW:
            return self
        return replace(self, _store=QuantStore(self._store.kind, self._store.dim))

    @property
    def traits(self) -> ValueTraits:
        return self.value.traits

    @property
    def bits(self) -> int:
        return self.value.bits

    @property
    def two_level(self) -> bool:
        return self.block is not None and self.tensor is not None

    @property
    def reciprocal_global(self) -> bool:
        """Two-level with the global stored as its reciprocal `G` (docs/spec.md, reciprocal global
        scale): `e = s_b / G`."""
        return self.two_level and self.tensor.reciprocal

    @property
    def slot_dtype(self) -> ScaleDtype:
        """Dtype of the stored scale slots: the block dtype, else the tensor dtype, else F32."""
        if self.block is not None:
            return self.block.dtype
        return self.tensor.dtype if self.tensor is not None else ScaleDtype.F32

    @property
    def payload_form(self) -> "QuantScheme":
        """This scheme under v1's rounding and code rules: the same payload layout and the same
        decode (the rules only decide how quantize picks scales and codes), so what formats
        compare against. Signed scales stay: they change which payloads are valid."""
        if self.scale_round is ScaleRound.UP and self.code_rule is CodeRule.DIV:
            return self
        return replace(self, scale_round=ScaleRound.UP, code_rule=CodeRule.DIV)

    @property
    def scale_divisor(self) -> float:
        """What the statistic is divided by for the raw scale (docs/spec.md,
        calibration): `h` (`half_range`), 1 under the MX rule, which rounds the statistic itself,
        or `qmin` for signed scales, whose statistic is the slot's signed extreme (docs/spec.md,
        signed scales)."""
        if self.signed:
            return self.traits.qmin
        if self.offset is not None:  # the span max - min over the codes' span (affine offsets)
            return self.traits.qmax - self.traits.qmin
        return 1.0 if self.scale_round is ScaleRound.MX else self.half_range

    @property
    def affine(self) -> bool:
        """A per-slot offset after the scale (docs/spec.md, affine offsets)."""
        return self.offset is not None

    @property
    def reciprocal_codes(self) -> bool:
        """Codes from `x * (1 / raw scale)` (docs/spec.md, code rules: AWAY, OFFSET) instead of `x / e`."""
        return self.code_rule is not CodeRule.DIV

    @property
    def scale_rounding(self) -> ScaleSlot:
        """The slot dtype with this scheme's rounding rule: `store(raw)` rounds raw scales."""
        return SCALE_SLOTS[self.scale_slot]

    @property
    def given_scale_rounding(self) -> ScaleSlot:
        """How scales a caller gives (`params=`) are rounded into the slot dtype: by the scheme's
        rule, except that under MX a given scale is already a scale (not a statistic) and is
        rounded down to a power of two (`2^floor(log2 s)`, the MX rule with emax 0)."""
        if self.scale_round is ScaleRound.MX:
            return SCALE_SLOTS[scale_slot_id(self.slot_dtype.value, "mx", 0)]
        return self.scale_rounding

    @property
    def scale_slot(self) -> int:
        """Kernel id of the slot dtype under this scheme's rounding rule (`codecs.SCALE_SLOTS`)."""
        return scale_slot_id(self.slot_dtype.value, self.scale_round.value, self.traits.emax)

    @property
    def code_dtype(self) -> np.dtype:
        """Dtype of unpacked codes: int8 for signed integer values, uint8 for minifloat codes,
        unsigned integers and LOOKUP indices (docs/spec.md, portable bytes)."""
        return np.dtype(np.uint8 if (self.is_lookup or self.traits.code_dtype == np.uint8) else np.int8)

    @property
    def valid_fields(self) -> np.ndarray:
        """bool per stored field 0 .. 2**bits - 1: whether a payload may hold it (docs/spec.md, invalid codes).

        LOOKUP indices are all valid (the table has 2**bits entries); otherwise the value's row.
        """
        if self.is_lookup:
            return np.ones(1 << self.bits, dtype=bool)
        return self.traits.valid_fields

    @property
    def is_lookup(self) -> bool:
        return self.mode is QuantMode.LOOKUP

    @property
    def table_name(self) -> str | None:
        for name, tab in TABLES.items():
            if self.table == tab:
                return name
        return None

    @property
    def half_range(self) -> float:
        """The spec's `h`: `(qmax - qmin) / 2`, or `max |table|` for LOOKUP."""
        if self.is_lookup:
            return float(np.max(np.abs(np.asarray(self.require_table(), dtype=np.float32))))
        return self.traits.half_range

    def require_table(self) -> tuple[float, ...]:
        if self.table is None:
            raise SchemeError(
                f"{self} has a custom table that is carried by a payload; "
                "give it with with_mode(QuantMode.LOOKUP, table=[...])"
            )
        return self.table

    # ------------------------------------------------------------------ builders
    def with_value(self, value: QuantValue | str) -> "QuantScheme":
        return replace(self, value=_coerce(QuantValue, value, "value"))

    def with_store(self, store: QuantStore) -> "QuantScheme":
        if not isinstance(store, QuantStore):
            raise SchemeError(f"store must be a QuantStore, got {store!r}; use Native(), PackedU32(d), PackedNative(d)")
        return replace(self, _store=store)

    def with_mode(self, mode: QuantMode | str, table: Sequence[float] | str | None = None) -> "QuantScheme":
        mode = _coerce(QuantMode, mode, "mode")
        if mode is QuantMode.LOOKUP:
            if table is None:
                raise SchemeError("LOOKUP needs a table; use with_mode(LOOKUP, table=[...]) or table='nf4'")
            if isinstance(table, str):
                if table not in TABLES:
                    raise SchemeError(f"unknown table {table!r}; use one of {sorted(TABLES)} or a list of floats")
                table = TABLES[table]
            return replace(self, mode=mode, table=tuple(table))
        return replace(self, mode=mode, table=None)

    def per_block(self, dims: int | Iterable[int], dtype: ScaleDtype | str = ScaleDtype.F32, *,
                  flat: bool = False) -> "QuantScheme":
        """One scale per block of `dims`; `flat=True` (one dim): blocks over the row-major
        flattened tensor (docs/spec.md, blocks over the flattened tensor)."""
        return replace(self, block=BlockLevel(_normalize_dims(dims), _coerce(ScaleDtype, dtype, "scale dtype"),
                                              bool(flat)))

    def with_field_order(self, order: FieldOrder | str, group: int = 0) -> "QuantScheme":
        """The same scheme with its packed fields in `order` (low, high, split with `group`
        elements per group; docs/spec.md, field orders)."""
        st = self.store
        return replace(self, _store=QuantStore(st.kind, st.dim, _coerce(FieldOrder, order, "field order"), group))

    def per_tensor(self, dtype: ScaleDtype | str = ScaleDtype.F32, *, reciprocal: bool = False) -> "QuantScheme":
        return replace(self, tensor=TensorLevel(_coerce(ScaleDtype, dtype, "scale dtype"), bool(reciprocal)))

    def with_scale_round(self, rule: ScaleRound | str) -> "QuantScheme":
        """The same scheme with scales rounded by `rule` (up, rne, mx); the payload layout is
        unchanged, only the stored scales (and so the codes) differ."""
        return replace(self, scale_round=_coerce(ScaleRound, rule, "scale rounding rule"))

    def with_signed_scales(self, signed: bool = True) -> "QuantScheme":
        """The same scheme with signed slot scales (docs/spec.md, signed scales): the raw scale is
        the slot's signed extreme over `qmin`, so that element codes as `qmin` (GGUF Q4_0)."""
        return replace(self, signed=bool(signed))

    def with_offset(self, kind: OffsetKind | str | None, dtype: ScaleDtype | str | None = None) -> "QuantScheme":
        """The same scheme with an affine offset (docs/spec.md, affine offsets): `min` (a float per
        slot, stored in `dtype`, default f32) or `zero` (an integer zero point per slot); None
        removes it."""
        return replace(self, offset=None if kind is None else Offset(kind, dtype))

    def with_code_rule(self, rule: CodeRule | str) -> "QuantScheme":
        """The same scheme with codes computed by `rule` (div, away, offset; docs/spec.md, code rules);
        the payload layout is unchanged."""
        return replace(self, code_rule=_coerce(CodeRule, rule, "code rule"))

    # ------------------------------------------------------------------ text
    def __str__(self) -> str:
        head = self.value.value
        if self.is_lookup:
            name = self.table_name
            head += "-lookup" + (f"[{name}]" if name else "")
        parts = [head]
        if self.block is not None:
            parts.append("block" + "x".join(map(str, self.block.dims)) + f":{self.block.dtype}"
                         + (":flat" if self.block.flat else ""))
        if self.tensor is not None:
            parts.append(f"tensor:{self.tensor.dtype}" + (":recip" if self.tensor.reciprocal else ""))
        if self._store is not None:
            default = self.default_store(self.value)
            if (self._store.kind, self._store.dim) != (default.kind, default.dim):
                parts.append(str(self._store))
        return "/".join(parts + self.rule_parts)

    @property
    def rule_parts(self) -> list[str]:
        """The text parts, after the store, of the rules beyond SPEC v1 (docs/spec.md: field orders,
        affine offsets, signed scales, scale rounding rules, code rules): the field order, the
        offset, `signed`, `round:RULE`, `codes:RULE`; [] for none."""
        parts = [self.store.order_text] if self.store.order_text else []
        if self.offset is not None:
            parts.append(str(self.offset))
        if self.signed:
            parts.append("signed")
        if self.scale_round is not ScaleRound.UP:
            parts.append(f"round:{self.scale_round}")
        if self.code_rule is not CodeRule.DIV:
            parts.append(f"codes:{self.code_rule}")
        return parts

    def __repr__(self) -> str:
        return f"QuantScheme({str(self)!r})"

    @classmethod
    def parse(cls, text: str) -> "QuantScheme":
        return scheme(text)


def base_scheme(value: QuantValue | str) -> QuantScheme:
    """The simplest valid scheme of a value: `QuantScheme(value)`, or for an unsigned value (u8,
    u4, u2), which needs an affine offset, that with a zero point (docs/spec.md, affine offsets and
    unsigned values)."""
    value = _coerce(QuantValue, value, "value")
    return QuantScheme(value, offset=Offset(OffsetKind.ZERO) if value.traits.unsigned else None)


PRESETS: dict[str, QuantScheme] = {
    "nvfp4": QuantScheme(QuantValue.E2M1).per_block([16], ScaleDtype.UE4M3).per_tensor(ScaleDtype.F32)
    .with_store(PackedNative(0)),
    "mxfp4": QuantScheme(QuantValue.E2M1).per_block([32], ScaleDtype.UE8M0).with_store(PackedNative(0)),
    "mxfp8": QuantScheme(QuantValue.E4M3).per_block([32], ScaleDtype.UE8M0).with_store(Native()),
    "nf4": QuantScheme(QuantValue.Q4S).with_mode(QuantMode.LOOKUP, "nf4").per_block([64], ScaleDtype.F32),
    # llama.cpp's quantizers, bit for bit (docs/spec.md, signed scales and code rules; GGUF Q8_0 and Q4_0).
    "q8_0": QuantScheme(QuantValue.Q8S).per_block([32], ScaleDtype.F16).with_scale_round(ScaleRound.RNE)
    .with_code_rule(CodeRule.AWAY),
    "q4_0": QuantScheme(QuantValue.Q4F).per_block([32], ScaleDtype.F16).with_signed_scales()
    .with_scale_round(ScaleRound.RNE).with_code_rule(CodeRule.OFFSET),
    "q4_1": QuantScheme(QuantValue.U4, offset=Offset(OffsetKind.MIN, ScaleDtype.F16)).per_block([32], ScaleDtype.F16)
    .with_scale_round(ScaleRound.RNE).with_code_rule(CodeRule.OFFSET),
}

_HEAD = re.compile(r"^(?P<value>[a-z0-9]+)(?P<lookup>-lookup(\[(?P<table>[a-z0-9_]+)\])?)?$")
_BLOCK = re.compile(r"^block(?P<dims>\d+(x\d+)*)(:(?P<dtype>(?!flat$)[a-z0-9]+))?(?P<flat>:flat)?$")
_ORDER = re.compile(r"^order:(?P<order>low|high|split)(?P<group>\d+)?$")
_TENSOR = re.compile(r"^tensor(:(?P<dtype>[a-z0-9]+))?(?P<recip>:recip)?$")
_STORE = re.compile(r"^(?P<kind>native|packed_u32|packed_native)(:(?P<dim>\d+))?$")
_ROUND = re.compile(r"^round:(?P<rule>[a-z0-9]+)$")
_SIGNED = re.compile(r"^signed$")
_OFFSET = re.compile(r"^(?P<kind>min|zero)(:(?P<dtype>[a-z0-9]+))?$")
_CODES = re.compile(r"^codes:(?P<rule>[a-z0-9]+)$")

_PARTS = (("block", _BLOCK), ("tensor", _TENSOR), ("store", _STORE), ("order", _ORDER), ("round", _ROUND),
          ("offset", _OFFSET), ("signed", _SIGNED), ("codes", _CODES))
"""The parts of a scheme's text after the value, by kind (each at most once)."""

_EXAMPLES = "e.g. 'q8s', 'q4s/block32:f16', 'e2m1/block16:ue4m3/tensor:f32/packed_native', 'nf4'"


def _part_kind(piece: str, text: str) -> str:
    for what, rx in _PARTS:
        if rx.match(piece):
            return what
    raise SchemeError(f"cannot parse scheme {text!r}: unknown part {piece!r}; {_EXAMPLES}")


def _over_preset(name: str, extra: list[str], text: str) -> str:
    """A preset's text with `extra` parts put over it: each replaces the preset's part of its
    kind or joins it ('nf4/block128:f32', 'q4_0/packed_native/order:split32')."""
    parts = str(PRESETS[name]).split("/")
    kinds = [None] + [_part_kind(p, text) for p in parts[1:]]
    given: set[str] = set()
    for piece in extra:
        what = _part_kind(piece, text)
        if what in given:
            raise SchemeError(f"cannot parse scheme {text!r}: {what} given twice")
        given.add(what)
        if what in kinds:
            parts[kinds.index(what)] = piece
        else:
            parts.append(piece)
            kinds.append(what)
    return "/".join(parts)


def scheme(text: str | QuantScheme) -> QuantScheme:
    """Parse the text form of a scheme (docs/spec.md, schemes), or pass a `QuantScheme` through.

    >>> str(scheme("q4s/block32:f16"))
    'q4s/block32:f16'
    """
    if isinstance(text, QuantScheme):
        return text
    got = _PARSED.get(text) if isinstance(text, str) else None
    if got is None:
        got = _parse(text)
        if len(_PARSED) >= _PARSED_MAX:
            _PARSED.clear()
        _PARSED[text] = got
    return got


_PARSED: dict[str, QuantScheme] = {}  # text -> scheme: a scheme is an immutable value, parsed once per text
_PARSED_MAX = 1024


def _parse(text: Any) -> QuantScheme:
    if not isinstance(text, str):
        raise SchemeError(f"a scheme is text or a QuantScheme, got {type(text).__name__}; {_EXAMPLES}")
    t = text.strip().lower()
    if t in PRESETS:
        return PRESETS[t]
    pieces = t.split("/")
    if pieces[0] in PRESETS and len(pieces) > 1:  # 'mxfp4/round:mx', 'q4_0/packed_native/order:split32'
        return scheme(_over_preset(pieces[0], pieces[1:], text))
    m = _HEAD.match(pieces[0])
    if not m:
        raise SchemeError(f"cannot parse scheme {text!r}: bad value {pieces[0]!r}; {_EXAMPLES}")
    kwargs: dict = {"value": _coerce(QuantValue, m["value"], "value")}
    if m["lookup"]:
        kwargs["mode"] = QuantMode.LOOKUP
        if m["table"]:
            if m["table"] not in TABLES:
                raise SchemeError(f"unknown lookup table {m['table']!r} in {text!r}; known: {sorted(TABLES)}")
            kwargs["table"] = TABLES[m["table"]]
    seen: set[str] = set()
    for piece in pieces[1:]:
        what = _part_kind(piece, text)
        pm = dict(_PARTS)[what].match(piece)
        if what in seen:
            raise SchemeError(f"cannot parse scheme {text!r}: {what} given twice")
        seen.add(what)
        if what == "block":
            dtype = _coerce(ScaleDtype, pm["dtype"] or "f32", "scale dtype")
            dims = [_parse_int(d, "block dim", text) for d in pm["dims"].split("x")]
            kwargs["block"] = BlockLevel(_normalize_dims(dims), dtype, bool(pm["flat"]))
        elif what == "tensor":
            kwargs["tensor"] = TensorLevel(_coerce(ScaleDtype, pm["dtype"] or "f32", "scale dtype"), bool(pm["recip"]))
        elif what == "round":
            kwargs["scale_round"] = _coerce(ScaleRound, pm["rule"], "scale rounding rule")
        elif what == "offset":
            kwargs["offset"] = Offset(pm["kind"], pm["dtype"])
        elif what == "signed":
            kwargs["signed"] = True
        elif what == "codes":
            kwargs["code_rule"] = _coerce(CodeRule, pm["rule"], "code rule")
        elif what == "order":
            if (pm["order"] == "split") != bool(pm["group"]):
                raise SchemeError(f"cannot parse scheme {text!r}: {piece!r}; a split order names its group "
                                  "(order:split32), the others none (order:high)")
            order = (FieldOrder(pm["order"]), _parse_int(pm["group"], "split group", text) if pm["group"] else 0)
        else:
            kwargs["_store"] = QuantStore(StoreKind(pm["kind"]), _parse_int(pm["dim"] or "0", "packing axis", text))
    if "order" in seen:
        st = kwargs.get("_store") or QuantScheme.default_store(kwargs["value"])
        kwargs["_store"] = QuantStore(st.kind, st.dim, *order)
    return QuantScheme(**kwargs)
