"""The conformance runner without pytest: `qcore conformance --backend NAME [--full] [--seed N]`.

`main(argv) -> int` is what the `qcore conformance` command calls. It runs every check of the
suite on each backend (cases, bad input, ops, cross-backend), shows a progress bar, then prints a
capability matrix per backend and one summary line each:

    ndarray: 145 schemes supported and conforming, 410 rejected correctly (not supported), 0 failed

The cases are drawn per backend from what it supports (`sampling`); `--expect` states what it is
meant to support (`expect`), so a backend that refuses a scheme its author expects fails here as
under pytest. Exit status, as the other `qcore` commands: 0 when nothing failed, 1 when any check
failed (a run that tested no supported scheme fails too, unless `--expect none`) or a backend or
expectation is wrong (unknown or unavailable backend, a scheme pattern that does not parse), 2
for a usage error (an unknown check kind, a malformed case id, nothing left to check). Errors are one line on stderr,
`qcore conformance: error: ...`. "Not supported" is an outcome, not a failure.

    usage: qcore conformance --backend NAME [--backend NAME ...] [--full] [--seed N]
                             [--expect [NAME=]PATTERNS|@FILE|none] [--case ID] [-x]
                             [--max-elements N] [--max-schemes N] [--cases-per-stratum N]
                             [--filter TEXT] [--checks case,bad-input,ops,cross,inputs]
                             [--max-failures N] [--no-progress]

`run(backends, ...)` is the same without argument parsing or printing; it returns a `Report`.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

from qcore.conformance import cases as C
from qcore.conformance import checks as K
from qcore.conformance import sampling as S
from qcore.conformance.expect import parse_expect, per_backend

__all__ = ["main", "parser", "run", "run_cases", "plan", "Report", "CHECK_KINDS"]

CHECK_KINDS = ("case", "bad-input", "ops", "cross", "inputs")


@dataclass
class Report:
    """Every outcome of a run, by backend."""

    outcomes: list[K.Outcome] = field(default_factory=list)
    schemes: dict[str, Any] = field(default_factory=dict)  # scheme text -> QuantScheme

    @property
    def failed(self) -> list[K.Outcome]:
        return [o for o in self.outcomes if o.status == K.FAILED]

    @property
    def ok(self) -> bool:
        return not self.failed

    def scheme_status(self, backend: str) -> dict[str, str]:
        """Per scheme: failed if any check failed, else passed (supported) or rejected."""
        out: dict[str, str] = {}
        rank = {K.FAILED: 2, K.PASSED: 1, K.REJECTED: 0}
        for o in self.outcomes:
            if o.backend != backend:
                continue
            cur = out.get(o.scheme)
            if cur is None or rank[o.status] > rank[cur]:
                out[o.scheme] = o.status
        return out

    def summary(self, backend: str) -> tuple[int, int, int]:
        st = self.scheme_status(backend)
        vals = list(st.values())
        return vals.count(K.PASSED), vals.count(K.REJECTED), vals.count(K.FAILED)

    def summary_line(self, backend: str) -> str:
        p, r, f = self.summary(backend)
        return (f"{backend}: {p} schemes supported and conforming, {r} rejected correctly "
                f"(not supported), {f} failed")

    @property
    def backends(self) -> list[str]:
        seen: dict[str, None] = {}
        for o in self.outcomes:
            seen.setdefault(o.backend, None)
        return list(seen)


def plan(full: bool = False, seed: int = 0, max_elements: int | None = None,
         max_schemes: int | None = None, kinds: Iterable[str] = CHECK_KINDS) -> list[tuple[str, S.Stratum]]:
    """The (check kind, stratum or group) pairs of a run, in order. `max_schemes`: that many
    strata spread over the groups (`sampling.strata_subset`), and an evenly spaced subset of
    that many groups. The cases themselves are drawn per backend
    at run time, from what it supports (`sampling`)."""
    kinds = list(kinds)
    items: list[tuple[str, S.Stratum]] = []
    if "case" in kinds:
        items += [("case", s) for s in S.strata_subset(max_schemes)]
    for kind in S.GROUP_KINDS:
        if kind in kinds:
            items += [(kind, g) for g in S.subset(S.groups(), max_schemes)]
    return items


def run(backends: Sequence[Any], *, full: bool = False, seed: int = 0, max_elements: int | None = None,
        max_schemes: int | None = None, filter: str | None = None, kinds: Iterable[str] = CHECK_KINDS,
        peers: Sequence[Any] | None = None, reference=None, tolerances: K.Tolerances | None = None,
        expect: Callable[[Any], Any] | None = None, cases_per_stratum: int | None = None,
        max_failures: int | None = None,
        progress: Callable[[str, int], None] | None = None) -> Report:
    """Run the suite on `backends` (Backend objects). `peers`: backends to exchange payloads with
    (default: the other backends given). `expect`: what the backends are meant to support
    (`expect.Expectation` or `scheme -> bool`, or a mapping backend name -> one).
    `max_failures`: stop a backend's run after that many failures. A backend's run that tested
    no supported scheme fails ('tested-nothing') unless `expect` declares an empty support.
    `progress(backend_name, n_done)` is called per item."""
    ref = reference or K.reference_backend()
    tol = tolerances or K.Tolerances()
    st = S.Settings(full, seed, max_elements, cases_per_stratum)
    items = plan(full, seed, max_elements, max_schemes, kinds)
    report = Report()
    for _, stratum in items:
        for s in stratum.candidates:
            report.schemes.setdefault(str(s), s)
    for be in backends:
        others = [p for p in (peers if peers is not None else backends) if p is not be and p.name != be.name]
        mine: list[K.Outcome] = []
        want = expect.get(be.name) if isinstance(expect, Mapping) else expect
        for i, (kind, stratum) in enumerate(items):
            if kind == "case":
                mine += S.check_stratum(be, stratum, st, ref, want, filter)
            else:
                mine += S.check_group(be, kind, stratum, st, ref, tol, others, filter)
            if progress is not None:
                progress(be.name, i + 1)
            if max_failures is not None and sum(o.status == K.FAILED for o in mine) >= max_failures:
                break
        cands = [s for _, stratum in items for s in stratum.candidates]
        # nothing ran on a supported scheme: no case passed or failed (a run whose every case
        # failed did test something, and its failures say what)
        if not any(o.status in (K.PASSED, K.FAILED) for o in mine) and not S.supports_nothing(want, cands):
            mine.append(S.tested_nothing(str(be.name), mine, len(items)))
        report.outcomes += mine
    return report


def run_cases(backends: Sequence[Any], case_ids: Sequence[str], *, seed: int = 0, reference=None) -> Report:
    """Rerun single cases by id (`Case.from_id`), e.g. the one a failure line printed."""
    report = Report()
    for text in case_ids:
        case = C.Case.from_id(text, seed)
        report.schemes.setdefault(case.scheme, case.qscheme)
        for be in backends:
            report.outcomes.append(K.check_case(be, case, reference))
    return report


# --------------------------------------------------------------------------- printing


def _level_kind(s) -> str:
    if s.block is None:
        return "tensor"
    dims = "x".join(map(str, s.block.dims))
    return f"2L{dims}" if s.tensor is not None else f"b{dims}"


_MARK = {K.PASSED: "[green]✓[/]", K.REJECTED: "[dim]–[/]", K.FAILED: "[bold red]✗[/]"}


def _cell(statuses: list[str] | None) -> str:
    if statuses is None:
        return " "  # the store is not valid for this value
    if not statuses:
        return "[dim]·[/]"
    if K.FAILED in statuses:
        return _MARK[K.FAILED]
    if len(set(statuses)) == 1:
        return _MARK[statuses[0]]
    return "[yellow]◐[/]"


def matrix_tables(report: Report, backend: str):
    """rich Tables: value x level x store (one mark per store in each cell) and a count of
    schemes per scale slot dtype."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    st = report.scheme_status(backend)
    cells: dict[tuple[str, str, str], list[str]] = defaultdict(list)
    dtypes: dict[str, list[str]] = defaultdict(list)
    rows: dict[str, int] = {}
    cols: dict[str, None] = {}
    for text, status in st.items():
        s = report.schemes.get(text)
        if s is None:  # a whole-run failure ('tested-nothing'): listed with the failures
            continue
        row, col, store = C.value_label(s), _level_kind(s), C.store_label(s)
        rows[row] = s.bits
        cols.setdefault(col, None)
        cells[(row, col, store)].append(status)
        dtypes[str(s.slot_dtype)].append(status)
    row_order = [m for m in C.VALUE_MODES if m in rows] + [r for r in rows if r not in C.VALUE_MODES]
    col_order = sorted(cols, key=lambda c: (0 if c == "tensor" else 1 if c.startswith("b") else 2,
                                            len(c), c))
    t = Table(title=f"{backend}: value x level (b = block, 2L = two-level; scale dtypes merged)",
              caption="one mark per store: 8-bit values native, packed_u32, packed_u32:1; "
                      "sub-byte values packed_u32, packed_u32:1, packed_native, packed_native:1\n"
                      "✓ passed  – rejected (not supported)  ◐ mixed  ✗ failed  · not in this run",
              box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False)
    t.add_column("value", style="bold", no_wrap=True)
    for c in col_order:
        t.add_column(c, justify="left", no_wrap=True, min_width=max(4, len(c)))
    for r in row_order:
        stores = C.STORES_8BIT if rows[r] == 8 else C.STORES_SUBBYTE
        t.add_row(escape(r), *("".join(_cell(cells.get((r, c, k), [])) for k in stores)
                               for c in col_order))
    d = Table(title=f"{backend}: schemes by scale slot dtype", box=box.SIMPLE_HEAD)
    d.add_column("scale dtype", style="bold")
    for h in ("passed", "rejected", "failed"):
        d.add_column(h, justify="right")
    for name in ("f32", "f16", "bf16", "ue8m0", "ue4m3"):
        v = dtypes.get(name, [])
        d.add_row(name, str(v.count(K.PASSED)), str(v.count(K.REJECTED)),
                  f"[bold red]{v.count(K.FAILED)}[/]" if v.count(K.FAILED) else "0")
    return t, d


def parser() -> argparse.ArgumentParser:
    """The runner's command line (`qcore conformance` shows its help)."""
    p = argparse.ArgumentParser(
        prog="qcore conformance",
        description="Check backends against the reference, bit for bit, over the scheme space.")
    p.add_argument("--backend", action="append", required=True, metavar="NAME",
                   help="backend to check (repeatable; 'all' = every installed, available backend)")
    p.add_argument("--full", action="store_true", help="the whole scheme space on every shape (slow)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument("--max-elements", type=int, default=None, metavar="N", help="cap tensor sizes")
    p.add_argument("--max-schemes", type=int, default=None, metavar="N",
                   help="an evenly spaced subset of N strata (and N groups)")
    p.add_argument("--filter", default=None, metavar="TEXT",
                   help="only strata and cases whose id contains TEXT (ids are printed with failures)")
    p.add_argument("--checks", default=",".join(CHECK_KINDS),
                   help=f"comma-separated subset of {','.join(CHECK_KINDS)}")
    p.add_argument("--max-failures", type=int, default=20, metavar="N", help="failure messages to print")
    p.add_argument("--expect", action="append", default=[], metavar="PATTERNS",
                   help="what the backend is meant to support: comma-separated scheme patterns "
                        "(e.g. 'q8s/tensor:f32/native,q8s/block*:f32/native'), @FILE (one pattern a "
                        "line) or 'none'; NAME=PATTERNS for one backend of the run; repeatable "
                        "(see qcore.conformance.expect)")
    p.add_argument("--case", action="append", default=[], metavar="ID",
                   help="rerun just this case id (as printed in a failure line); repeatable")
    p.add_argument("--cases-per-stratum", type=int, default=None, metavar="N",
                   help="supported cases per stratum (default 2, plus a classic input on every third)")
    p.add_argument("-x", "--exitfirst", action="store_true", help="stop a backend's run at its first failure")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _error(err: Any, message: Any, status: int) -> int:
    """One line on stderr (never wrapped to the terminal's width), as the `qcore` CLI prints errors."""
    err.print(f"qcore conformance: error: {message}", soft_wrap=True, markup=False, highlight=False)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """`qcore conformance`: run, print the capability matrix, return 0 (ok), 1 (failures), 2 (usage)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from qcore.backend import registry
    from qcore.errors import QCoreError

    console = Console()
    err = Console(stderr=True)
    try:
        args = parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as e:
        return int(e.code) if isinstance(e.code, int) else 2
    kinds = [k.strip() for k in args.checks.split(",") if k.strip()]
    bad = [k for k in kinds if k not in CHECK_KINDS]
    if bad:
        return _error(err, f"unknown check kind(s) {bad}; use {','.join(CHECK_KINDS)}", 2)
    names = []
    for n in args.backend:
        names += [x for x in n.split(",") if x]
    if "all" in names:
        names = [n for n in registry.backends() if _available(registry.registered()[n])]
    try:
        bes = [registry.backend(n) for n in names]
    except QCoreError as e:
        return _error(err, e, 1)
    peers = [b for n, b in registry.registered().items() if n != "reference" and _available(b)]
    try:
        expect = per_backend(args.expect, names)
    except QCoreError as e:  # a scheme pattern that does not parse: a bad scheme
        return _error(err, e, 1)
    try:
        for c in args.case or ():
            C.Case.from_id(c, args.seed)
    except QCoreError as e:  # a malformed case id: usage
        return _error(err, e, 2)
    started = time.perf_counter()
    if args.case:
        console.print(f"qcore conformance: {len(args.case)} case(s) on {', '.join(names)} (seed {args.seed})")
        report = run_cases(bes, args.case, seed=args.seed)
    else:
        items = plan(args.full, args.seed, args.max_elements, args.max_schemes, kinds)
        if not items:
            return _error(err, "nothing to check; see --max-schemes / --checks", 2)
        console.print(f"qcore conformance: {len(items)} strata and groups per backend "
                      f"({'full space' if args.full else 'default sample'}, seed {args.seed}"
                      f"{', with expectations' if expect else ''}) on {', '.join(names)}")
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console, disable=args.no_progress,
                      transient=False) as prog:
            tasks = {n: prog.add_task(f"[bold]{n}[/]", total=len(items)) for n in names}
            report = run(bes, full=args.full, seed=args.seed, max_elements=args.max_elements,
                         max_schemes=args.max_schemes, filter=args.filter, kinds=kinds, peers=peers,
                         expect=expect, cases_per_stratum=args.cases_per_stratum,
                         max_failures=1 if args.exitfirst else None,
                         progress=lambda n, i: prog.update(tasks[n], completed=i))
    elapsed = time.perf_counter() - started
    for n in names:
        t, d = matrix_tables(report, n)
        console.print(t, width=max(console.width, 100), crop=False)
        console.print(d)
    fails = report.failed
    for o in fails[: args.max_failures]:
        console.print(f"[bold red]FAILED[/] {escape(o.message)}", highlight=False, soft_wrap=True)
    if len(fails) > args.max_failures:
        console.print(f"... and {len(fails) - args.max_failures} more failures")
    for n in names:
        line = report.summary_line(n)
        console.print(("[bold red]" if report.summary(n)[2] else "[bold green]") + line + "[/]")
    console.print(f"ran in {elapsed:.1f} s")
    return 1 if fails else 0


def _available(be) -> bool:
    try:
        return bool(be.available())
    except Exception:  # noqa: BLE001
        return False


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
