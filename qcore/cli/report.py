"""Error report of a quantization run: SQNR per tensor per scheme, as PNG or HTML (matplotlib).

matplotlib is an optional dependency (`pip install 'qcore-quant[plot]'`); without it, `require()` and
`write()` raise a `QCoreError` saying so. HTML reports embed the PNG as base64, plus the numbers.
"""
from __future__ import annotations

import base64
import html
import io as _io
import math
import os
from typing import Mapping, Sequence

from qcore.errors import InputError, QCoreError

__all__ = ["FORMATS", "require", "write", "png_bytes"]

FORMATS = (".png", ".html", ".htm")
EXACT_DB = 150.0  # where an exact (error-free) tensor is drawn; labelled "exact"


def require(path: str | os.PathLike) -> str:
    """Check the report path's format and that matplotlib is importable; return the suffix."""
    suffix = os.path.splitext(os.fspath(path))[1].lower()
    if suffix not in FORMATS:
        raise InputError(f"report {os.fspath(path)!r} must end in .png or .html, got {suffix or 'no suffix'!r}")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise QCoreError("reports need matplotlib, which is not installed: pip install 'qcore-quant[plot]'") from None
    return suffix


def png_bytes(tensors: Sequence[str], sqnr: Mapping[str, Sequence[float]], title: str) -> bytes:
    """A horizontal grouped bar chart: one row per tensor, one bar per scheme (SQNR in dB)."""
    from matplotlib.figure import Figure

    k = max(1, len(sqnr))
    n = max(1, len(tensors))
    fig = Figure(figsize=(9, 1.2 + 0.22 * n * max(1, k * 0.6)), dpi=100)
    ax = fig.add_subplot(1, 1, 1)
    h = 0.8 / k
    for j, (name, values) in enumerate(sqnr.items()):
        ys = [i + (j - (k - 1) / 2) * h for i in range(len(tensors))]
        xs = [EXACT_DB if math.isinf(v) else v for v in values]
        ax.barh(ys, xs, height=h, label=name)
    ax.set_yticks(range(len(tensors)))
    ax.set_yticklabels(tensors, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("SQNR (dB, higher is better)")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    if sqnr:
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    buf = _io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _html(png: bytes, tensors: Sequence[str], sqnr: Mapping[str, Sequence[float]], title: str) -> str:
    def cell(v: float) -> str:
        return "exact" if math.isinf(v) else f"{v:.2f}"

    head = "".join(f"<th>{html.escape(s)}</th>" for s in sqnr)
    rows = "\n".join(
        f"<tr><td>{html.escape(t)}</td>" + "".join(f"<td>{cell(v[i])}</td>" for v in sqnr.values()) + "</tr>"
        for i, t in enumerate(tensors)
    )
    b64 = base64.b64encode(png).decode("ascii")
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:2px 8px;text-align:right}}td:first-child{{text-align:left}}</style>
</head><body>
<h1>{html.escape(title)}</h1>
<p>Signal-to-quantization-noise ratio per tensor, in dB (higher is better; "exact" means no error).</p>
<img alt="SQNR per tensor" src="data:image/png;base64,{b64}">
<table><tr><th>tensor</th>{head}</tr>
{rows}
</table>
</body></html>
"""


def write(path: str | os.PathLike, tensors: Sequence[str], sqnr: Mapping[str, Sequence[float]],
          title: str = "qcore quantization error") -> None:
    """Write the report to `path` (.png or .html), atomically."""
    from qcore.files.paths import atomic_write

    suffix = require(path)
    for name, values in sqnr.items():
        if len(values) != len(tensors):
            raise InputError(f"report: scheme {name} has {len(values)} values for {len(tensors)} tensors")
    png = png_bytes(tensors, sqnr, title)
    data = png if suffix == ".png" else _html(png, tensors, sqnr, title).encode("utf-8")

    def put(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data)

    atomic_write(path, put)
