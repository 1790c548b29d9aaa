#!/usr/bin/env bash
# The long robustness run of docs/robustness.md: N hypothesis cases per CPU fuzz target
# (tests/test_fuzz.py and tests/test_fuzz_readers.py: 10 targets), the cuda target on its simulator,
# and a dense signal sweep of `qcore quantize`/`dequantize`. Niced: it shares the machine with other work.
#   usage: scripts/fuzz.sh [N] [POINTS]     (defaults: 25000 cases per target, 200 signal points)
# Per-target counts, the slowest case and the largest allocation go to $QCORE_FUZZ_REPORT
# (default /tmp/qcore-fuzz-report.jsonl), one JSON line per target.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${QCORE_VENV:-.venv}/bin/python"
N="${1:-25000}"
POINTS="${2:-200}"
export QCORE_FUZZ_REPORT="${QCORE_FUZZ_REPORT:-/tmp/qcore-fuzz-report.jsonl}"
export NUMBA_ENABLE_CUDASIM=1
: > "$QCORE_FUZZ_REPORT"
QCORE_FUZZ_EXAMPLES="$N" nice -n 19 "$PY" -m pytest -q -p no:cacheprovider tests/test_fuzz.py \
    tests/test_fuzz_readers.py -k "not cuda"
QCORE_FUZZ_EXAMPLES="$(( N / 100 > 30 ? N / 100 : 30 ))" nice -n 19 "$PY" -m pytest -q -p no:cacheprovider \
    tests/test_fuzz.py -k cuda
QCORE_INTERRUPT_POINTS="$POINTS" nice -n 19 "$PY" -m pytest -q -p no:cacheprovider tests/test_interrupt.py
"$PY" - "$QCORE_FUZZ_REPORT" <<'PYEOF'
import json, sys
last = {}
for line in open(sys.argv[1]):  # progress lines every 1000 cases, then a final one per target
    r = json.loads(line)
    last[r["target"]] = r
rows = list(last.values())
for r in rows:
    errors = ", ".join(f"{n} {k}" for k, n in sorted(r.get("errors", {}).items()))
    print(f"{r['target']:>16}: {r['cases']:>7} cases, slowest {r['slowest_s'] * 1e3:7.1f} ms wall "
          f"({r.get('slowest_cpu_s', 0) * 1e3:6.1f} ms CPU), peak {r['peak_bytes'] / 1024:8.1f} KiB"
          + (f"; errors: {errors}" if errors else ""))
print(f"{'total':>16}: {sum(r['cases'] for r in rows):>7} cases")
PYEOF
