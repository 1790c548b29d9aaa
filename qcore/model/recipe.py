"""Recipes: which scheme each tensor of a model gets, by ordered name patterns.

A recipe is a default scheme plus an ordered list of rules `PATTERN=SCHEME`; the first rule whose
pattern matches a tensor's name decides (`keep` leaves the tensor as it is). A pattern is a glob
(`*.mlp.*`, matched with `fnmatch.fnmatchcase`) unless it starts with `re:`, then the rest is a
regular expression searched in the name (`re:layers\\.(0|1)\\.`).

Before any rule, tensors that are not floats, 1-D tensors (biases, norms: `include_1d`
quantizes them) and tensors with fewer than `min_size` elements are kept. When no rule matches,
names that look like embeddings or norms (`DEFAULT_KEEP`; a rule naming them quantizes them) are
kept and everything else gets the default scheme (none: kept).

A recipe file is TOML:

    scheme = "q4s/block32:f16"        # default scheme
    include_1d = false
    min_size = 0
    [[rule]]
    pattern = "*.attention.*"
    scheme = "q8s"
    [[rule]]
    pattern = "re:^lm_head\\."
    scheme = "keep"

The recipe travels in each output file's metadata as JSON (`Recipe.to_json`), and `qcore inspect`
shows it.

Regex rules match in bounded time: a regex may not nest a repetition or an alternative (`|`)
inside a repetition (`(a+)+`, `(a|ab)*`: exponential time on a long name), may hold at most
`MAX_REGEX_CHOICES` repetitions of variable length (`*`, `+`, `?`, `{m,n}`), and is matched
against names of at most `MAX_REGEX_NAME` characters (a longer name meeting a regex rule is an
InputError; glob rules take any name).
"""
from __future__ import annotations

import fnmatch
import json
import os
import reprlib
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import numpy as np

from qcore._regex import MAX_REGEX_CHOICES, MAX_REGEX_NAME, REGEX_PREFIX, bounded_regex, compile_rule, shown
from qcore.errors import InputError, InvalidDataError, QCoreError, StorageError
from qcore.model.reasons import Reason
from qcore.spec.checks import INPUT_DTYPES
from qcore.spec.schemes import QuantScheme, scheme as parse_scheme

__all__ = ["KEEP", "DEFAULT_KEEP", "MAX_REGEX_NAME", "MAX_REGEX_CHOICES", "Rule", "Recipe", "Decision", "as_recipe",
           "bounded_regex"]

KEEP = "keep"
# Globs of tensor names kept by default: embeddings and normalisation weights are small and
# sensitive; a rule naming them explicitly still quantizes them.
DEFAULT_KEEP: tuple[str, ...] = ("*embed*", "*norm*", "*.ln_*", "*layernorm*")


def _short(value: Any) -> str:
    """`repr(value)` for a one-line message: text cut after 80 characters, other values shortened."""
    return shown(value) if isinstance(value, str) else reprlib.repr(value)


@dataclass(frozen=True)
class Rule:
    """One `PATTERN=SCHEME` rule; `scheme` None means keep."""

    pattern: str
    scheme: QuantScheme | None

    def __post_init__(self) -> None:
        if not isinstance(self.pattern, str) or not self.pattern:
            raise InputError(f"a recipe rule needs a non-empty pattern, got {_short(self.pattern)}")
        if self.pattern.startswith(REGEX_PREFIX):
            object.__setattr__(self, "_regex", compile_rule(self.pattern))
        else:
            object.__setattr__(self, "_regex", None)

    @classmethod
    def parse(cls, text: str) -> "Rule":
        """`PATTERN=SCHEME` (the last `=` splits, so regexes may hold `=`)."""
        if not isinstance(text, str) or "=" not in text:
            raise InputError(f"a rule is PATTERN=SCHEME (e.g. '*.mlp.*=q4s/block32:f16' or '*lm_head*=keep'), "
                             f"got {text!r}")
        pattern, _, sch = text.rpartition("=")
        return cls(pattern.strip(), _scheme_or_keep(sch.strip(), f"rule {text!r}"))

    def matches(self, name: str) -> bool:
        """Whether the rule names tensor `name`. A regex rule takes names of at most
        `MAX_REGEX_NAME` characters (a bound on its time), else InputError."""
        rx = self._regex  # type: ignore[attr-defined]
        if rx is None:
            return fnmatch.fnmatchcase(name, self.pattern)
        if len(name) > MAX_REGEX_NAME:
            raise InputError(f"tensor name {name[:40]!r}... is {len(name)} characters long; regex rules match names "
                             f"of at most {MAX_REGEX_NAME} characters, so that matching takes bounded time: name it "
                             f"with a glob rule instead of {self.pattern!r}")
        return bool(rx.search(name))

    @property
    def scheme_text(self) -> str:
        return KEEP if self.scheme is None else str(self.scheme)


@dataclass(frozen=True)
class Decision:
    """What a recipe decided for one tensor: a scheme (quantize) or None with the reason it is kept,
    as text and as a code (`qcore.model.reasons.Reason`)."""

    scheme: QuantScheme | None
    reason: str = ""
    reason_code: Reason | None = None


def _scheme_or_keep(text: Any, where: str) -> QuantScheme | None:
    if isinstance(text, QuantScheme):
        return text
    if not isinstance(text, str) or not text:
        raise InputError(f"{where}: the scheme must be scheme text or '{KEEP}', got {text!r}")
    if text == KEEP:
        return None
    try:
        return parse_scheme(text)
    except QCoreError as e:
        raise type(e)(f"{where}: {e}") from None


@dataclass(frozen=True)
class Recipe:
    """An ordered rule list plus defaults; `choose` gives each tensor's scheme."""

    scheme: QuantScheme | None = None
    rules: tuple[Rule, ...] = ()
    include_1d: bool = False
    min_size: int = 0
    keep: tuple[str, ...] = field(default=DEFAULT_KEEP)

    def __post_init__(self) -> None:
        object.__setattr__(self, "scheme", None if self.scheme is None else _scheme_or_keep(self.scheme, "recipe"))
        object.__setattr__(self, "rules", tuple(r if isinstance(r, Rule) else Rule.parse(r) for r in self.rules))
        if not isinstance(self.min_size, int) or isinstance(self.min_size, bool) or self.min_size < 0:
            raise InputError(f"recipe min_size must be an int >= 0, got {self.min_size!r}")
        object.__setattr__(self, "keep", tuple(self.keep))

    # ------------------------------------------------------------------ deciding
    def choose(self, name: str, shape: Sequence[int], dtype: Any) -> Decision:
        """The scheme for tensor `name` (shape, numpy dtype), or None and why it is kept."""
        dt = np.dtype(dtype)
        if dt not in INPUT_DTYPES:
            return Decision(None, f"kept: {dt} is not a float dtype", Reason.NOT_FLOAT)
        if len(shape) < 2 and not self.include_1d:
            return Decision(None, "kept: 1-D (biases, norms; --include-1d quantizes them)", Reason.ONE_D)
        numel = int(np.prod(shape, dtype=np.int64))
        if numel < self.min_size:
            return Decision(None, f"kept: {numel} elements < --min-size {self.min_size}", Reason.MIN_SIZE)
        for rule in self.rules:
            if rule.matches(name):
                if rule.scheme is None:
                    return Decision(None, f"kept: matches rule {rule.pattern!r}={KEEP}", Reason.RULE_KEEP)
                return Decision(rule.scheme)
        for pat in self.keep:
            if fnmatch.fnmatchcase(name, pat):
                return Decision(None, f"kept: matches default keep {pat!r} (a --rule naming it quantizes it)",
                                Reason.DEFAULT_KEEP)
        if self.scheme is None:
            return Decision(None, "kept: no rule matches and the recipe has no default scheme", Reason.NO_RULE)
        return Decision(self.scheme)

    def decide(self, name: str, shape: Sequence[int], dtype: Any) -> Decision:
        """`choose`, then kept (with the reason) where the chosen scheme's blocks do not fit the
        shape (e.g. a block with more dims than the tensor): what a whole-model run quantizes."""
        d = self.choose(name, shape, dtype)
        if d.scheme is None:
            return d
        from qcore.spec.payload import sections

        try:
            sections(tuple(shape), d.scheme)
        except QCoreError as e:
            return Decision(None, f"kept: {e}", Reason.BLOCKS_DO_NOT_FIT)
        return d

    def schemes(self) -> list[QuantScheme]:
        """Every scheme the recipe may use (to check a backend's support before any work)."""
        out = [r.scheme for r in self.rules if r.scheme is not None]
        if self.scheme is not None:
            out.append(self.scheme)
        return list(dict.fromkeys(out))

    # ------------------------------------------------------------------ text forms
    def to_dict(self) -> dict[str, Any]:
        return {
            "scheme": KEEP if self.scheme is None else str(self.scheme),
            "rules": [[r.pattern, r.scheme_text] for r in self.rules],
            "include_1d": self.include_1d,
            "min_size": self.min_size,
            "keep": list(self.keep),
        }

    def to_json(self) -> str:
        """Canonical JSON (sorted keys, no spaces): stored in output metadata and hashed for --resume."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any], where: str = "recipe") -> "Recipe":
        if not isinstance(doc, Mapping):
            raise InputError(f"{where}: a recipe is a table of settings, got {type(doc).__name__}")
        known = {"scheme", "rules", "rule", "include_1d", "min_size", "keep"}
        extra = sorted(set(doc) - known)
        if extra:
            raise InputError(f"{where}: unknown recipe key {extra[0]!r}; known keys: {', '.join(sorted(known))}")
        items: list[Any] = []
        for key in ("rules", "rule"):
            given = doc.get(key, [])
            if not isinstance(given, (list, tuple)):
                raise InputError(f"{where}: {key} must be a list of rules ([[rule]] tables of pattern and scheme, "
                                 f"[pattern, scheme] pairs or 'PATTERN=SCHEME' texts), got {_short(given)}")
            items += list(given)
        rules: list[Rule] = []
        for item in items:
            if isinstance(item, Mapping):
                if set(item) != {"pattern", "scheme"}:
                    raise InputError(f"{where}: each [[rule]] needs exactly 'pattern' and 'scheme', got {sorted(item)}")
                where_rule = f"{where}: rule {_short(item['pattern'])}"
                rules.append(Rule(item["pattern"], _scheme_or_keep(item["scheme"], where_rule)))
            elif isinstance(item, (list, tuple)) and len(item) == 2:
                rules.append(Rule(item[0], _scheme_or_keep(item[1], f"{where}: rule {_short(item[0])}")))
            elif isinstance(item, str):
                rules.append(Rule.parse(item))
            else:
                raise InputError(f"{where}: a rule is {{pattern, scheme}}, [pattern, scheme] or 'PATTERN=SCHEME', "
                                 f"got {_short(item)}")
        include_1d = doc.get("include_1d", False)
        if not isinstance(include_1d, bool):
            raise InputError(f"{where}: include_1d must be true or false, got {_short(include_1d)}")
        keep = doc.get("keep", DEFAULT_KEEP)
        if not isinstance(keep, (list, tuple)) or not all(isinstance(k, str) for k in keep):
            raise InputError(f"{where}: keep must be a list of globs, got {_short(keep)}")
        min_size = doc.get("min_size", 0)
        if not isinstance(min_size, int) or isinstance(min_size, bool) or min_size < 0:
            raise InputError(f"{where}: min_size must be an int >= 0, got {_short(min_size)}")
        return cls(_scheme_or_keep(doc.get("scheme", KEEP), where), tuple(rules), include_1d, min_size, tuple(keep))

    @classmethod
    def from_json(cls, text: str) -> "Recipe":
        """A recipe stored as JSON (`to_json`); InvalidDataError when the text is not JSON."""
        try:
            doc = json.loads(text)
        except (ValueError, RecursionError) as e:
            why = "nested too deep" if isinstance(e, RecursionError) else " ".join(str(e).split())
            raise InvalidDataError(f"stored recipe is not JSON: {why}") from None
        return cls.from_dict(doc, "stored recipe")

    @classmethod
    def from_toml(cls, path: Union[str, "os.PathLike[str]"]) -> "Recipe":
        """Read a recipe file (see the module docstring for its keys)."""
        if sys.version_info >= (3, 11):
            import tomllib
        else:  # pragma: no cover - Python 3.10
            import tomli as tomllib
        from qcore.files.paths import check_input_path

        p = check_input_path(path)  # a readable regular file (a FIFO would block), else StorageError
        try:
            with open(p, "rb") as f:
                doc = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise InputError(f"recipe file {p} is not valid TOML: {' '.join(str(e).split())}") from None
        except UnicodeDecodeError as e:
            raise InputError(f"recipe file {p} is not UTF-8 text ({e.reason} at byte {e.start}); TOML files are "
                             "UTF-8: save it as UTF-8") from None
        except RecursionError:
            raise InputError(f"recipe file {p} is not valid TOML: arrays or tables nested too deep") from None
        except OSError as e:
            raise StorageError(e.errno, f"cannot read recipe file {p}: {e.strerror or e}", p) from None
        return cls.from_dict(doc, f"recipe file {p}")

    def describe(self) -> str:
        """One line for tables and logs."""
        parts = [f"{r.pattern}={r.scheme_text}" for r in self.rules]
        parts.append(f"default={KEEP if self.scheme is None else self.scheme}")
        if self.include_1d:
            parts.append("include_1d")
        if self.min_size:
            parts.append(f"min_size={self.min_size}")
        return ", ".join(parts)


RecipeLike = Union[Recipe, QuantScheme, str, Mapping[str, Any], None]


def as_recipe(recipe: RecipeLike, *, rules: Iterable[str] = ()) -> Recipe:
    """A Recipe from a Recipe, scheme (text), a `.toml` path or a dict (`Recipe.from_dict`).

    `rules` (`PATTERN=SCHEME` texts) go before the recipe's own rules, so the command line wins.
    """
    if isinstance(recipe, Recipe):
        base = recipe
    elif recipe is None:
        base = Recipe()
    elif isinstance(recipe, QuantScheme):
        base = Recipe(recipe)
    elif isinstance(recipe, str) and recipe.endswith(".toml"):
        base = Recipe.from_toml(recipe)
    elif isinstance(recipe, str):
        base = Recipe(_scheme_or_keep(recipe, "recipe"))
    elif isinstance(recipe, Mapping):
        base = Recipe.from_dict(recipe)
    else:
        raise InputError(f"a recipe is a Recipe, a scheme, a .toml path or a dict, got {type(recipe).__name__}")
    extra = tuple(Rule.parse(r) for r in rules)
    if not extra:
        return base
    return Recipe(base.scheme, extra + base.rules, base.include_1d, base.min_size, base.keep)
