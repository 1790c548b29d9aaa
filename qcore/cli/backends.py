"""`qcore backends`: the installed backends, their availability and a capability matrix."""
from __future__ import annotations

import argparse
import os
from typing import Any

from qcore.errors import QCoreError
from qcore.spec.schemes import PRESETS, Native, PackedNative, PackedU32, QuantMode, QuantScheme, QuantValue, ScaleDtype
from qcore.spec.schemes import base_scheme
from qcore.cli.args import EXIT_OK
from qcore.cli.console import console

__all__ = ["add_parser", "cmd_backends"]


def add_parser(sub: Any) -> None:
    s = sub.add_parser("backends", help="installed backends, availability and capability matrix")
    s.set_defaults(func=cmd_backends)


def _capability_rows() -> list[tuple[str, list[QuantScheme]]]:
    """Rows of the capability matrix: per value its default scheme; per level/store feature every
    valid scheme that uses it (a backend supports the feature if it supports any of them)."""
    rows: list[tuple[str, list[QuantScheme]]] = []
    for v in QuantValue:
        rows.append((v.name, [base_scheme(v)]))

    bases = [base_scheme(v) for v in QuantValue]
    for v in QuantValue:  # LOOKUP variants, so a table-only backend shows its levels and stores
        try:
            bases.append(QuantScheme(v).with_mode(QuantMode.LOOKUP, "nf4"))
        except QCoreError:
            continue

    def variants(make) -> list[QuantScheme]:
        out = []
        for base in bases:
            try:
                out.append(make(base))
            except QCoreError:
                continue
        return out

    for dt in ScaleDtype:
        rows.append((f"per_block {dt.name}", variants(lambda s, dt=dt: s.per_block([32], dt))))
    rows.append(("two-level", variants(lambda s: s.per_block([16], ScaleDtype.UE4M3).per_tensor(ScaleDtype.F32))))
    rows.append(("Native", variants(lambda s: s.with_store(Native()))))
    rows.append(("PackedU32", variants(lambda s: s.with_store(PackedU32(0)))))
    rows.append(("PackedNative", variants(lambda s: s.with_store(PackedNative(0)))))
    rows.append(("LOOKUP (nf4)", [PRESETS["nf4"]]))
    rows.append(("signed scales", variants(lambda s: s.per_block([32], ScaleDtype.F16).with_signed_scales())))
    rows.append(("affine min", variants(lambda s: s.per_block([32], ScaleDtype.F16).with_offset("min", "f16"))))
    rows.append(("affine zero point", variants(lambda s: s.per_block([32], ScaleDtype.F16).with_offset("zero"))))
    for name in ("nvfp4", "mxfp4", "mxfp8", "q8_0", "q4_0", "q4_1"):
        rows.append((f"preset {name}", [PRESETS[name]]))
    return rows


def _supports(be: Any, schemes: list[QuantScheme]) -> bool:
    for s in schemes:
        try:
            if be.supports(s):
                return True
        except Exception:
            continue
    return False


def cmd_backends(args: argparse.Namespace) -> int:
    from rich.table import Table

    from qcore.backend import registry as reg

    out = console()
    found = reg.registered()
    out.print("[bold]qcore backends[/]")
    table = Table()
    for col in ("name", "available", "priority", "description"):
        table.add_column(col)
    ordered = sorted(found.values(), key=lambda b: (-int(b.priority), b.name))
    avail = {}
    for be in ordered:
        ok = reg.is_available(be)  # never hangs: a backend whose available() does not answer is skipped
        if not ok and be.name in reg.plugin_errors():
            desc = reg.plugin_errors()[be.name]
        else:
            try:
                desc = be.describe()
            except Exception as e:
                desc = f"describe() failed: {type(e).__name__}: {e}"
        avail[be.name] = ok
        table.add_row(be.name, "[green]yes[/]" if ok else "[red]no[/]", str(be.priority), desc)
    out.print(table)
    env = os.environ.get(reg.ENV_VAR)
    out.print(f"selection: {reg.ENV_VAR}={env!r}" if env else
              f"selection: {reg.ENV_VAR} unset -> 'auto' (highest priority available backend per scheme)")
    errors = reg.plugin_errors()
    if errors:
        out.print("[red]plugins that failed to load, and backends skipped:[/]")
        for name, err in sorted(errors.items()):
            out.print(f"  {name}: {err}", markup=False)
    if reg.disabled_plugins():
        out.print(f"plugins disabled by {reg.DISABLE_VAR}: {', '.join(reg.disabled_plugins())}", markup=False)
    out.print("[bold]capability[/] (yes: supported; -: rejected with a reason; levels and stores: supported with some value)")
    cap = Table()
    cap.add_column("value / level / store")
    for be in ordered:
        cap.add_column(be.name if avail[be.name] else f"{be.name} (unavailable)", justify="center")
    for label, schemes in _capability_rows():
        cap.add_row(label, *["[green]yes[/]" if _supports(be, schemes) else "[dim]-[/]" for be in ordered])
    out.print(cap)
    return EXIT_OK
