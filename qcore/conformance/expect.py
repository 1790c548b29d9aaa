"""What a backend is *meant* to support, stated by its author (no pytest).

Without it the suite can only trust `supports()`, and a backend that refuses what it should
handle passes. An expectation is a set of scheme patterns, matched against a scheme's full label
`VALUE/LEVEL[/LEVEL]/STORE` in which every part is spelled out:

    q8s/tensor:f32/native             q8s, one per-tensor F32 scale, one byte per code
    q8s/block32:f32/native            ... one F32 scale per block of 32
    e2m1/block16:ue4m3/tensor:f32/packed_native      nvfp4
    q4f-lookup/block4x8:f16/packed_u32:1             custom-table LOOKUP, packing axis 1

A pattern is `fnmatch`-style per `/`-separated part and must have as many parts as the label,
so `q8s/block*:f32/native` matches every single-level F32 block scheme of q8s in the Native
store and no two-level one. A pattern without `/` matches the value part alone (`q8s`,
`*-lookup*`). `!PATTERN` removes what it matches from the patterns before it. `none` declares an
empty support (the backend is meant to refuse everything; the "tested nothing" failure is then
off). A support file (`@path`) holds one pattern per line; `#` starts a comment.

The rules beyond SPEC v1 follow the store as more parts (`q8s/block32:f32/native/flat`,
`q4s/block32:f16/packed_native/order:high`). A backend supports them only where it declares the
feature (`BaseBackend.scheme_features`); two come from the core once declared: blocks over the
flattened tensor (`flat`), and field orders (`order:high`, `order:split`; docs/spec.md)
for a backend that leaves them to the core, so patterns that name such a backend's schemes part
by part should name these forms too.

    qcore conformance --backend mine --expect 'q8s/tensor:f32/native,q8s/block*:f32/native'
    qcore conformance --backend mine --expect @tests/support.txt
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from qcore.errors import InputError
from qcore.spec.schemes import QuantScheme
from qcore.conformance.cases import level_label, rules_label, store_label, value_label

__all__ = ["Expectation", "as_expectation", "parse_expect", "per_backend", "scheme_label"]


def scheme_label(s: QuantScheme) -> str:
    """`VALUE/LEVEL/STORE` with every part explicit (the default level and store included), then
    the quantize rules beyond v1's, as the scheme text writes them (`.../signed/round:rne`)."""
    rules = rules_label(s)
    return f"{value_label(s)}/{level_label(s)}/{store_label(s)}" + (f"/{rules}" if rules else "")


def _match(pattern: str, label: str) -> bool:
    parts = label.split("/")
    pp = pattern.split("/")
    if len(pp) == 1:
        return fnmatch.fnmatchcase(parts[0], pp[0])
    return len(pp) == len(parts) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(parts, pp))


@dataclass(frozen=True)
class Expectation:
    """A scheme predicate from patterns (see the module docstring). `empty`: declared to support
    nothing."""

    patterns: tuple[str, ...] = ()
    empty: bool = False

    def __call__(self, s: QuantScheme) -> bool:
        label = scheme_label(s)
        want = False
        for p in self.patterns:
            if p.startswith("!"):
                want = want and not _match(p[1:], label)
            else:
                want = want or _match(p, label)
        return want

    def __str__(self) -> str:
        return "none" if self.empty else ",".join(self.patterns)


def parse_expect(items: Iterable[str]) -> Expectation | None:
    """`--expect` values: comma-separated patterns, `@FILE` support files, or `none`. Returns
    None when nothing was given."""
    pats: list[str] = []
    empty = False
    given = False
    for item in items:
        given = True
        if item.startswith("@"):
            path = Path(item[1:])
            try:
                text = path.read_text()
            except OSError as e:
                raise InputError(f"--expect support file {str(path)!r} cannot be read ({e.strerror}); "
                                 "give a file of scheme patterns, one a line") from None
            words = [ln.split("#", 1)[0].strip() for ln in text.splitlines()]
        else:
            words = [w.strip() for w in item.split(",")]
        for w in words:
            if not w:
                continue
            if w.lower() == "none":
                empty = True
            else:
                pats.append(w)
    if not given:
        return None
    if empty and pats:
        raise InputError(f"--expect says 'none' and also gives patterns ({', '.join(pats)}); give one or the other")
    return Expectation(tuple(pats), empty)


def as_expectation(obj: Any) -> Callable[[QuantScheme], bool] | None:
    """What an `expected_support` fixture may return: None, a `scheme -> bool` callable, an
    `Expectation`, a pattern string, or a list of patterns."""
    if obj is None or callable(obj):
        return obj
    if isinstance(obj, str):
        return parse_expect([obj])
    if isinstance(obj, (list, tuple)):
        return parse_expect([str(o) for o in obj]) or Expectation((), True)
    raise InputError(f"expected_support must be a callable, a pattern string or a list of patterns, "
                     f"got {type(obj).__name__}; e.g. 'q8s/tensor:f32/native' or lambda s: s.bits == 8")


def per_backend(items: Sequence[str], names: Sequence[str]) -> Expectation | dict[str, Expectation | None] | None:
    """`--expect` values for a run of the backends `names`: `PATTERNS` apply to every backend,
    `NAME=PATTERNS` to one. Returns one expectation, or one per backend name."""
    shared = [i for i in items if "=" not in i]
    mine: dict[str, list[str]] = {}
    for i in items:
        if "=" in i:
            name, _, pats = i.partition("=")
            if name.strip() not in names:
                raise InputError(f"--expect {i!r} names backend {name.strip()!r}, which this run does not "
                                 f"check ({', '.join(names)}); use NAME=PATTERNS with a --backend NAME")
            mine.setdefault(name.strip(), []).append(pats)
    if not mine:
        return parse_expect(shared)
    return {n: parse_expect(mine.get(n, []) + shared) for n in names}
