"""The documents that are generated or point elsewhere stay true to their sources."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_performance_doc_is_rendered_from_the_results():
    """docs/performance.md is exactly what benchmarks/report.py renders from benchmarks/results/."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "report.py"), "--check"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_relative_links_in_docs_resolve():
    """Every relative markdown link in README, ARCHITECTURE, CHANGELOG and docs/ names a file
    that exists."""
    files = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
    missing = []
    for f in files:
        if not f.exists():
            missing.append(str(f.relative_to(ROOT)))
            continue
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", f.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (f.parent / target).exists():
                missing.append(f"{f.relative_to(ROOT)} -> {target}")
    assert not missing, missing
