"""The `qcore` command line: exit codes, one-line errors, outputs, atomic writes."""
import base64
import json
import math
import os
import re
import subprocess
import sys
import types

import numpy as np
import pytest
from safetensors.numpy import save_file

import qcore
from qcore.backend import registry
from qcore.files import io as qio
from qcore.cli.main import error_stats, main
from qcore.backend.reference import ReferenceBackend
from tests.doubles import Offline, Q8Only


def _x(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.fixture
def model(tmp_path):
    """A toy model file: two weights, a bias, an int buffer, a tiny weight."""
    path = tmp_path / "model.safetensors"
    save_file({
        "layer.0.weight": _x((16, 64), 1),
        "layer.0.bias": _x((64,), 2),
        "layer.1.weight": _x((8, 40), 3).astype(np.float16),
        "position_ids": np.arange(8, dtype=np.int64).reshape(1, 8),
        "tiny.weight": _x((2, 2), 4),
    }, str(path), metadata={"format": "pt"})
    return path


def run(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(err, pattern):
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("qcore: error: "), err
    assert re.search(pattern, lines[0]), lines[0]
    assert "Traceback" not in err




@pytest.fixture
def q8only():
    registry.reset()
    registry.register(Q8Only())
    yield
    registry.reset()


# ------------------------------------------------------------------------------ usage and errors
def test_help_and_version(capsys):
    rc, out, _ = run(capsys, "--help")
    assert rc == 0 and "quantize" in out and "conformance" in out
    rc, out, _ = run(capsys, "--version")
    assert rc == 0 and out.strip() == f"qcore {qcore.__version__}"


@pytest.mark.parametrize("argv,pattern", [
    ([], r"required: COMMAND"),
    (["frobnicate"], r"invalid choice: 'frobnicate'"),
    (["quantize", "a.safetensors", "b.safetensors"], r"--scheme"),
    (["inspect", "f.safetensors", "--bogus"], r"unrecognized arguments: --bogus"),
    (["quantize", "a", "b", "--scheme", "q8s", "--min-size", "ten"], r"invalid int value: 'ten'"),
    (["quantize", "a", "b", "--scheme", "q8s", "--group-size", "4KB"], r"--group-size splits shards into tasks"),
], ids=["no-command", "unknown-command", "missing-scheme", "unknown-flag", "bad-int", "group-size-alone"])
def test_usage_errors_exit_2_with_one_line(capsys, argv, pattern):
    rc, out, err = run(capsys, *argv)
    assert rc == 2
    assert_one_line_error(err, pattern)


def test_compare_needs_report(capsys, model, tmp_path):
    rc, _, err = run(capsys, "quantize", model, tmp_path / "o.safetensors", "--scheme", "q8s", "--compare", "q4s")
    assert rc == 2
    assert_one_line_error(err, r"--compare only adds schemes to a --report")


@pytest.mark.parametrize("argv,pattern", [
    (["quantize", "{model}", "{out}", "--scheme", "q5s"], r"unknown value 'q5s'; use one of q8f, q8s"),
    (["quantize", "{model}", "{out}", "--scheme", "q8s", "--backend", "nope"], r"no backend named 'nope'"),
    (["quantize", "{missing}", "{out}", "--scheme", "q8s"], r"nope\.safetensors: No such file"),
    (["quantize", "{model}", "{model}", "--scheme", "q8s"], r"OUT must differ from IN"),
    (["quantize", "{model}", "{out}", "--scheme", "q8s", "--report", "{tmp}/r.txt"], r"must end in \.png or \.html"),
    (["inspect", "{junk}"], r"is not a valid safetensors file"),
    (["dequantize", "{junk}", "{out}"], r"is not a valid safetensors file"),
    (["quantize", "{model}", "{tmp}/no/such/dir/o.safetensors", "--scheme", "q8s", "--backend", "reference"],
     r"No such file"),
], ids=["bad-scheme", "unknown-backend", "missing-input", "in-is-out", "report-suffix", "inspect-junk",
        "dequantize-junk", "missing-out-dir"])
def test_errors_exit_1_with_one_line(capsys, model, tmp_path, argv, pattern):
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"this is not a safetensors file")
    fill = dict(model=model, out=tmp_path / "out.safetensors", missing=tmp_path / "nope.safetensors", junk=junk,
                tmp=tmp_path)
    rc, out, err = run(capsys, *[a.format(**fill) for a in argv])
    assert rc == 1
    assert_one_line_error(err, pattern)
    assert not (tmp_path / "out.safetensors").exists()


def test_backend_that_rejects_the_scheme(capsys, model, tmp_path, q8only):
    rc, _, err = run(capsys, "quantize", model, tmp_path / "o.safetensors", "--scheme", "q4s/block32:f16",
                     "--backend", "q8only")
    assert rc == 1
    assert_one_line_error(err, r"backend 'q8only' does not support q4s/block32:f16: q4s is not an 8-bit integer "
                               r"value; backends that do: .*reference")
    assert not (tmp_path / "o.safetensors").exists()


# ------------------------------------------------------------------------------ quantize
def test_quantize_writes_quantized_file_and_table(capsys, model, tmp_path):
    out_path = tmp_path / "q.safetensors"
    rc, out, err = run(capsys, "quantize", model, out_path, "--scheme", "q4s/block32:f16", "--backend", "reference")
    assert rc == 0, err
    info = qio.read_info(out_path)
    kinds = {e.name: (str(e.scheme) if e.quantized else e.dtype) for e in info.entries}
    assert kinds == {
        "layer.0.weight": "q4s/block32:f16",
        "layer.1.weight": "q4s/block32:f16",
        "tiny.weight": "q4s/block32:f16",
        "layer.0.bias": "F32",          # 1-D: kept by default
        "position_ids": "I64",          # not a float dtype
    }
    assert info.metadata == {"format": "pt"}  # the input's own metadata travels
    # the file's payload is the reference quantization of the input, bit for bit
    src = qio.load_data(model)
    got = qio.load_data(out_path)
    for name in ("layer.0.weight", "layer.1.weight"):
        assert got[name] == qcore.quantize(src[name], "q4s/block32:f16", backend="reference").to_data()
    np.testing.assert_array_equal(got["layer.0.bias"], src["layer.0.bias"])
    # the table reports the SQNR we can recompute
    w = src["layer.0.weight"]
    y = qcore.backend("reference").from_data(got["layer.0.weight"]).numpy()
    sqnr, max_err = error_stats(w, y)
    row = next(line for line in out.splitlines() if "layer.0.weight" in line)
    assert f"{sqnr:.2f}" in row and f"{max_err:.3g}" in row and "(16, 64)" in row and "4.0 KiB" in row
    assert "int64 is not a float dtype" in out
    assert "1 1-D tensors kept as they are" in out
    assert re.search(r"wrote .*q\.safetensors: .* -> .* \(\d+\.\d\dx smaller\)", out)


def test_quantize_skip_min_size_and_include_1d(capsys, model, tmp_path):
    out_path = tmp_path / "q.safetensors"
    rc, out, err = run(capsys, "quantize", model, out_path, "--scheme", "q8s", "--backend", "reference",
                       "--skip", "layer.1.*", "--min-size", "10", "--include-1d", "--verbose")
    assert rc == 0, err
    q = {e.name for e in qio.read_info(out_path).entries if e.quantized}
    assert q == {"layer.0.weight", "layer.0.bias"}
    assert "matches rule 'layer.1.*'=keep" in out
    assert "4 elements < --min-size 10" in out


def test_quantize_keeps_tensors_the_scheme_cannot_take(capsys, tmp_path):
    bad = _x((4, 32))
    bad[1, 3] = np.nan
    src = tmp_path / "in.safetensors"
    save_file({"vec": _x((32,)), "mat": _x((4, 32)), "nan": bad}, str(src))
    out_path = tmp_path / "o.safetensors"
    rc, out, err = run(capsys, "quantize", src, out_path, "--scheme", "q4s/block2x16:f16", "--backend", "reference",
                       "--include-1d")
    assert rc == 0, err
    kinds = {e.name: e.quantized for e in qio.read_info(out_path).entries}
    assert kinds == {"vec": False, "mat": True, "nan": False}
    assert "block 2x16 has 2 dims but the tensor has rank 1" in out
    assert "(1, 3)" in out  # the NaN's index


def test_quantize_auto_backend(capsys, model, tmp_path, monkeypatch):
    monkeypatch.delenv("QCORE_BACKEND", raising=False)
    rc, out, err = run(capsys, "quantize", model, tmp_path / "q.safetensors", "--scheme", "q8s", "--min-size", "100")
    assert rc == 0, err
    assert "on auto" in out
    got = qio.load_data(tmp_path / "q.safetensors")
    src = qio.load_data(model)
    assert got["layer.0.weight"] == qcore.quantize(src["layer.0.weight"], "q8s", backend="reference").to_data()


def test_ctrl_c_during_quantize_leaves_no_file(capsys, model, tmp_path, monkeypatch):
    calls = []
    real = ReferenceBackend.quantize

    def interrupt_second(self, x, scheme, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, x, scheme, **kw)

    monkeypatch.setattr(ReferenceBackend, "quantize", interrupt_second)
    rc, _, err = run(capsys, "quantize", model, tmp_path / "q.safetensors", "--scheme", "q8s", "--backend", "reference")
    assert rc == 130
    assert err.strip().splitlines()[-1] == "qcore: interrupted; no output file was written"
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]


@pytest.mark.parametrize("exc,rc", [(OSError(28, "No space left on device"), 1), (KeyboardInterrupt(), 130)],
                         ids=["disk-full", "ctrl-c"])
def test_failure_mid_write_leaves_no_file(capsys, model, tmp_path, monkeypatch, exc, rc):
    from qcore.files.stfile import StreamWriter

    def fail_at_the_header(self, metadata):  # every tensor written, the header not yet
        raise exc

    monkeypatch.setattr(StreamWriter, "finish", fail_at_the_header)
    got_rc, _, err = run(capsys, "quantize", model, tmp_path / "q.safetensors", "--scheme", "q8s", "--backend",
                         "reference")
    assert got_rc == rc
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]
    if rc == 1:
        assert_one_line_error(err, "No space left on device")


# ------------------------------------------------------------------------------ report
def test_report_html_and_png(capsys, model, tmp_path):
    pytest.importorskip("matplotlib", reason="reports need matplotlib (pip install 'qcore-quant[plot]')")
    rc, out, err = run(capsys, "quantize", model, tmp_path / "q.safetensors", "--scheme", "q8s", "--backend",
                       "reference", "--report", tmp_path / "r.html", "--compare", "q4s/block32:f16", "--compare", "nvfp4")
    assert rc == 0, err
    html = (tmp_path / "r.html").read_text()
    m = re.search(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    assert m and base64.b64decode(m.group(1)).startswith(b"\x89PNG\r\n\x1a\n")
    for label in ("q8s", "q4s/block32:f16", "nvfp4", "layer.0.weight", "layer.1.weight"):
        assert label in html
    rc, _, err = run(capsys, "quantize", model, tmp_path / "q2.safetensors", "--scheme", "q8s", "--backend",
                     "reference", "--report", tmp_path / "r.png")
    assert rc == 0, err
    assert (tmp_path / "r.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_report_without_matplotlib_is_a_clear_error(capsys, model, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    rc, _, err = run(capsys, "quantize", model, tmp_path / "q.safetensors", "--scheme", "q8s", "--backend",
                     "reference", "--report", tmp_path / "r.html")
    assert rc == 1
    assert_one_line_error(err, r"reports need matplotlib, which is not installed: pip install 'qcore-quant\[plot\]'")
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]  # checked before any work


# ------------------------------------------------------------------------------ dequantize, inspect
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_dequantize(capsys, model, tmp_path, dtype):
    q_path, d_path = tmp_path / "q.safetensors", tmp_path / "d.safetensors"
    assert run(capsys, "quantize", model, q_path, "--scheme", "nvfp4", "--backend", "reference")[0] == 0
    rc, out, err = run(capsys, "dequantize", q_path, d_path, "--backend", "reference", "--dtype", dtype)
    assert rc == 0, err
    assert f"3 of 5 tensors dequantized to {dtype}" in out
    got = qio.load_data(d_path)
    want = qcore.load(q_path, backend="reference")["layer.0.weight"].numpy(np.dtype(dtype))
    assert got["layer.0.weight"].dtype == np.dtype(dtype)
    assert got["layer.0.weight"].tobytes() == want.tobytes()
    assert got["position_ids"].dtype == np.int64


def test_inspect_table_and_json(capsys, model, tmp_path):
    q_path = tmp_path / "q.safetensors"
    assert run(capsys, "quantize", model, q_path, "--scheme", "q8s", "--backend", "reference")[0] == 0
    rc, out, err = run(capsys, "inspect", q_path)
    assert rc == 0, err
    assert "qcore format 1" in out and "metadata format = pt" in out
    row = next(line for line in out.splitlines() if "layer.0.weight" in line)
    assert "q8s" in row and "(16, 64)" in row and "3.98x" in row  # 1024 B + one f32 scale vs 4096 B
    rc, out, _ = run(capsys, "inspect", q_path, "--json")
    assert rc == 0
    doc = json.loads(out)
    entries = {e["name"]: e for e in doc["entries"]}
    assert entries["layer.0.weight"]["bytes"] == 16 * 64 + 4
    assert entries["layer.0.weight"]["source_bytes"] == 16 * 64 * 4
    assert entries["layer.1.weight"]["source_bytes"] == 8 * 40 * 2  # float16 source: ratio against 2 bytes
    assert entries["layer.1.weight"]["source_dtype"] == "F16"
    assert doc["schemes"] == ["q8s"] and doc["quantized"] == 3 and doc["tensors"] == 5
    assert math.isclose(doc["ratio"], doc["source_bytes"] / doc["stored_bytes"])
    assert doc["recipe"]["scheme"] == "q8s"
    assert doc["file_size"] == os.path.getsize(q_path)


def test_inspect_plain_file(capsys, model):
    rc, out, _ = run(capsys, "inspect", model)
    assert rc == 0 and "plain safetensors" in out


# ------------------------------------------------------------------------------ backends, bench, conformance
def test_backends_lists_capabilities(capsys, q8only):
    rc, out, err = run(capsys, "backends")
    assert rc == 0, err
    assert "reference" in out and "q8only" in out and "capability" in out
    header = next(line for line in out.splitlines() if "value / level / store" in line)
    cols = [c.strip() for c in re.split(r"[┃│|]", header) if c.strip()]
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in re.split(r"[┃│|]", line) if c.strip()]
        if len(cells) == len(cols):
            rows[cells[0]] = dict(zip(cols[1:], cells[1:]))
    assert rows["Q8S"]["q8only"] == "yes" and rows["Q4S"]["q8only"] == "-"
    assert rows["Q4S"]["reference"] == "yes" and rows["LOOKUP (nf4)"]["q8only"] == "-"
    assert rows["per_block UE8M0"]["q8only"] == "yes"  # q8s/block32:ue8m0 is an 8-bit integer scheme


def test_backends_reports_plugin_errors(capsys, monkeypatch):
    monkeypatch.setattr(registry, "plugin_errors", lambda: {"broken": "ImportError: no module named broken_dep"})
    rc, out, _ = run(capsys, "backends")
    assert rc == 0
    assert "plugins that failed to load" in out and "broken: ImportError: no module named broken_dep" in out


def test_bench(capsys, q8only):
    rc, out, err = run(capsys, "bench", "--size-mb", "0.05", "--repeat", "1", "--backend", "reference",
                       "--backend", "q8only", "--scheme", "q8s", "--scheme", "q4s")
    assert rc == 0, err
    ref = next(line for line in out.splitlines() if "│ reference" in line)
    assert len(re.findall(r"\d+\.\d{3}", ref)) == 2
    q8 = next(line for line in out.splitlines() if "│ q8only" in line)
    assert len(re.findall(r"\d+\.\d{3}", q8)) == 1 and " - " in q8
    assert "q8only / q4s: q4s is not an 8-bit integer value" in out


def test_conformance_is_forwarded_to_the_runner(capsys, monkeypatch):
    seen = []
    fake = types.ModuleType("qcore.conformance.runner")
    fake.main = lambda argv: seen.append(argv) or 3
    monkeypatch.setitem(sys.modules, "qcore.conformance.runner", fake)
    import qcore.conformance as conf

    monkeypatch.setattr(conf, "runner", fake, raising=False)
    rc, _, _ = run(capsys, "conformance", "--backend", "reference", "--backend", "ndarray", "--full", "--seed", "7")
    assert rc == 3
    assert seen == [["--backend", "reference", "--backend", "ndarray", "--full", "--seed", "7"]]


def test_conformance_without_runner_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "qcore.conformance.runner", None)
    import qcore.conformance as conf

    monkeypatch.delattr(conf, "runner", raising=False)
    rc, _, err = run(capsys, "conformance", "--backend", "reference")
    assert rc == 1
    assert_one_line_error(err, r"the conformance runner \(qcore.conformance.runner\) is not available")


# ------------------------------------------------------------------------------ as a real process
def test_conformance_runs_the_real_runner(capsys):
    pytest.importorskip("qcore.conformance.runner", reason="the conformance runner is not in this install")
    rc, out, err = run(capsys, "conformance", "--backend", "reference", "--max-schemes", "2", "--max-elements", "64",
                       "--checks", "case", "--no-progress")
    assert rc == 0, out + err
    assert "reference" in out


def test_subprocess_no_tty(model, tmp_path):
    """The installed entry point, output piped (no TTY): progress must not crash, errors stay one line."""
    env = {**os.environ, "QCORE_BACKEND": "reference"}
    cmd = [sys.executable, "-c", "import sys; from qcore.cli.main import main; sys.exit(main())"]
    p = subprocess.run(cmd + ["quantize", str(model), str(tmp_path / "q.safetensors"), "--scheme", "q8s"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "layer.0.weight" in p.stdout and "Traceback" not in p.stderr
    p = subprocess.run(cmd + ["inspect", str(tmp_path / "missing.safetensors")], capture_output=True, text=True,
                       env=env, timeout=120)
    assert p.returncode == 1
    assert p.stderr.strip().splitlines() == [f"qcore: error: {tmp_path / 'missing.safetensors'}: No such file or directory (cannot read it)"]


def test_progress_bar_on_a_terminal(capsys, model, tmp_path, monkeypatch):
    """With a terminal the live bar runs (over tensors and bytes) and still ends with the table."""
    import io as _io

    from rich.console import Console

    from qcore.cli import quantize as cli_quantize

    term = _io.StringIO()
    real = cli_quantize.console
    monkeypatch.setattr(cli_quantize, "console",
                        lambda stderr=False: Console(file=term, force_terminal=True, width=120)
                        if stderr else real(stderr))
    rc, out, err = run(capsys, "quantize", model, tmp_path / "q.safetensors", "--scheme", "q8s", "--backend",
                       "reference")
    assert rc == 0, err
    assert "3/3 tensors" in term.getvalue() and "quantize q8s" in term.getvalue()
    assert "layer.0.weight" in out




def test_unavailable_backend(capsys, model, tmp_path):
    registry.reset()
    registry.register(Offline())
    try:
        rc, _, err = run(capsys, "quantize", model, tmp_path / "o.safetensors", "--scheme", "q8s", "--backend",
                         "offline")
        assert rc == 1
        assert_one_line_error(err, r"backend 'offline' is installed but not available: no device found")
        rc, out, _ = run(capsys, "backends")
        assert rc == 0
        assert re.search(r"offline\s+│ no\s+│ 99\s+│ no device found", out)
        assert "offline (unavailable)" in out
    finally:
        registry.reset()
    assert not (tmp_path / "o.safetensors").exists()


def test_conformance_help_lists_every_runner_option(capsys):
    """`qcore conformance --help` shows every option the runner takes, not a few of them."""
    from qcore.conformance import runner

    assert main(["conformance", "--help"]) == 0
    out = capsys.readouterr().out
    options = re.findall(r"(?<![\w-])(--?[a-z][a-z0-9-]*)", runner.parser().format_help())
    assert options and all(o in out for o in options), [o for o in options if o not in out]
