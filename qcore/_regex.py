"""Regular expressions that match in bounded time: the rule for qcore's `re:` recipe rules, and
for the regexes a loader's config hands over (compressed-tensors targets, gpt-oss module names).

A regex may not nest a repetition or an alternative (`|`) inside a repetition (`(a+)+`,
`(a|ab)*`: exponential time on a long name), may hold at most `MAX_REGEX_CHOICES` repetitions of
variable length (`*`, `+`, `?`, `{m,n}`), and is matched against names of at most
`MAX_REGEX_NAME` characters.
"""
from __future__ import annotations

import re
from typing import Any

from qcore.errors import InputError

try:  # the parser of the `re` module, to check a regex's shape (sre_parse before Python 3.11)
    from re import _constants as _sre
    from re import _parser as _sre_parse
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants as _sre  # type: ignore[no-redef]
    import sre_parse as _sre_parse  # type: ignore[no-redef]

__all__ = ["REGEX_PREFIX", "MAX_REGEX_NAME", "MAX_REGEX_CHOICES", "bounded_regex", "compile_rule", "shown"]

REGEX_PREFIX = "re:"
MAX_REGEX_NAME = 256
"""The longest tensor name a regex rule is matched against (real names have about 100 characters)."""
MAX_REGEX_CHOICES = 3
"""The most repetitions of variable length (`*`, `+`, `?`, `{m,n}`) a regex rule may hold."""
_REPEATS = {_sre.MAX_REPEAT, _sre.MIN_REPEAT} | {getattr(_sre, "POSSESSIVE_REPEAT", _sre.MAX_REPEAT)}


def shown(pattern: str) -> str:
    """A pattern quoted for a message, cut after 80 characters."""
    return repr(pattern) if len(pattern) <= 100 else f"{pattern[:80]!r}... ({len(pattern)} characters)"


def _nested(pattern: str) -> InputError:
    return InputError(f"recipe pattern {shown(pattern)} nests a repetition or an alternative (|) inside a repetition "
                      "(as (a+)+ or (a|ab)* do), which can take exponential time on a long name; regex rules must "
                      "match in bounded time: write it without the nesting (a character class such as [ab]+ "
                      "often does)")


def _choices(parsed: Any, pattern: str, repeated: bool = False) -> int:
    """The repetitions of variable length in a parsed regex; `_nested` when one, or an alternative,
    sits inside a repetition (`repeated`): the shapes that backtrack exponentially."""
    count = 0
    for op, av in parsed:
        if op in _REPEATS:
            lo, hi, sub = av
            if repeated and hi > lo:
                raise _nested(pattern)
            count += (hi > lo) + _choices(sub, pattern, repeated or hi > 1)
        elif op == _sre.BRANCH:
            if repeated:
                raise _nested(pattern)
            count += sum(_choices(alt, pattern, repeated) for alt in av[1])
        elif op == _sre.SUBPATTERN:
            count += _choices(av[-1], pattern, repeated)
        elif op in (_sre.ASSERT, _sre.ASSERT_NOT):
            count += _choices(av[1], pattern, repeated)
        elif op == getattr(_sre, "ATOMIC_GROUP", None):
            count += _choices(av, pattern, repeated)
        elif op == _sre.GROUPREF_EXISTS:
            count += sum(_choices(alt, pattern, repeated) for alt in av[1:] if alt is not None)
    return count


def compile_rule(pattern: str) -> re.Pattern[str]:
    """The regex of a `re:` rule (`pattern` with its prefix), refused (InputError) unless it is
    valid and matches in bounded time (see the module docstring)."""
    text = pattern[len(REGEX_PREFIX):]
    try:
        rx = re.compile(text)
        parsed = _sre_parse.parse(text)
    except (re.error, OverflowError, ValueError, RecursionError) as e:
        why = "nested too deep" if isinstance(e, RecursionError) else " ".join(str(e).split())
        raise InputError(f"recipe pattern {shown(pattern)} is not a valid regular expression: {why}") from None
    try:
        n = _choices(parsed, pattern)
    except RecursionError:
        raise InputError(f"recipe pattern {shown(pattern)} nests groups too deep to check that it matches in bounded "
                         "time; write it with fewer nested groups") from None
    if n > MAX_REGEX_CHOICES:
        raise InputError(f"recipe pattern {shown(pattern)} has {n} repetitions of variable length (*, +, ?, {{m,n}}); "
                         f"regex rules may hold {MAX_REGEX_CHOICES}, so that they match in bounded time: use a "
                         "glob, or drop a leading or trailing .* (a regex is searched anywhere in the name)")
    return rx


def bounded_regex(text: str) -> re.Pattern[str] | None:
    """`text` compiled when it is a valid regex that matches in bounded time by the rules of regex
    recipe rules (module docstring), else None: how a regex read from a file (a loader's config)
    is vetted before qcore matches names with it."""
    try:
        return compile_rule(REGEX_PREFIX + text)
    except InputError:
        return None
