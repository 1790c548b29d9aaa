"""Defects a fuzz campaign found in the command line and the whole-model paths, each checked
through public behaviour: special files as inputs, hostile safetensors headers and index files,
the truth of the message after an interrupted run into a folder, the other files of a model
folder (symlinks), stored recipes that are not JSON, sizes and recipes that overflowed or hung,
stale temporary files, and `auto` under the CUDA simulator."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
from safetensors.numpy import save_file

import qcore
from qcore import InputError, InvalidDataError, StorageError
from qcore.backend import registry
from qcore.files import checkpoint as qck
from qcore.model import api as qapi
from qcore.model import run as qmodel
from qcore.cli.main import main
from qcore.model.recipe import Recipe, Rule
from qcore.backend.reference import ReferenceBackend
from qcore.files.stfile import Reader

CLI = [sys.executable, "-c", "import sys; from qcore.cli.main import main; sys.exit(main())"]
SHARDS = [f"model-{k:05d}-of-00004.safetensors" for k in range(1, 5)]
INDEX = "model.safetensors.index.json"


def _x(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def run(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def one_line_error(err: str, pattern: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qcore: error: "), err
    assert re.search(pattern, lines[0]), lines[0]
    assert "Traceback" not in err
    return lines[0]


def make_checkpoint(root, n_shards=4):
    """A sharded checkpoint: n shards of two weights, an index, config.json and a tokenizer folder."""
    root.mkdir(parents=True, exist_ok=True)
    wmap = {}
    for k in range(n_shards):
        name = f"model-{k + 1:05d}-of-{n_shards:05d}.safetensors"
        part = {f"layers.{k}.attn.weight": _x((8, 64), 10 * k), f"layers.{k}.mlp.weight": _x((64, 32), 10 * k + 1)}
        save_file(part, str(root / name))
        wmap.update({t: name for t in part})
    (root / INDEX).write_text(json.dumps({"metadata": {"total_size": 1}, "weight_map": wmap}))
    (root / "config.json").write_text('{"model_type": "toy"}')
    (root / "tok").mkdir(exist_ok=True)
    (root / "tok" / "vocab.txt").write_text("a\nb\n")
    return root


def write_raw(path, header: dict, data: bytes = b"\0" * 16) -> None:
    """A safetensors file with exactly this header JSON (hostile values included)."""
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


# ------------------------------------------------------------------ FIFOs as inputs
@pytest.mark.parametrize("command", [["inspect"], ["convert", "--to", "qcore"]], ids=["inspect", "convert"])
def test_inspect_and_convert_refuse_a_fifo(tmp_path, command):
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    argv = [command[0], str(fifo)] + ([str(tmp_path / "o.safetensors")] + command[1:] if len(command) > 1 else [])
    try:
        p = subprocess.run(CLI + argv, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"qcore {command[0]} blocked on a FIFO")
    assert p.returncode == 1, p.stderr
    one_line_error(p.stderr, r"not a regular file")
    assert not (tmp_path / "o.safetensors").exists()


# ------------------------------------------------------------------ the streaming reader
HOSTILE_HEADERS = {
    "string-offsets": {"a": {"dtype": "F32", "shape": [4], "data_offsets": ["0", "16"]}},
    "huge-shape": {"a": {"dtype": "F32", "shape": [2 ** 70], "data_offsets": [0, 16]}},
    "list-dtype": {"a": {"dtype": ["F32"], "shape": [4], "data_offsets": [0, 16]}},
    "float-shape": {"a": {"dtype": "F32", "shape": [4.0], "data_offsets": [0, 16]}},
    "bool-offsets": {"a": {"dtype": "F32", "shape": [4], "data_offsets": [False, 16]}},
    "three-offsets": {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8, 16]}},
    "negative-dim": {"a": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}},
    "entry-not-a-table": {"a": [1, 2, 3]},
}


@pytest.mark.parametrize("header", list(HOSTILE_HEADERS.values()), ids=list(HOSTILE_HEADERS))
def test_streaming_reader_says_invalid_data_for_hostile_headers(tmp_path, capsys, header):
    f = tmp_path / "bad.safetensors"
    write_raw(f, header)
    with pytest.raises(InvalidDataError, match="not a valid safetensors file"):
        Reader(f)
    rc, _, err = run(capsys, "quantize", f, tmp_path / "o.safetensors", "--scheme", "q8s", "--backend", "reference")
    assert rc == 1
    one_line_error(err, r"is not a valid safetensors file")
    with pytest.raises(InvalidDataError):
        qcore.load(f, backend="reference")  # the same verdict as `load` and `inspect`


# ------------------------------------------------------------------ interrupted runs into a folder
def _interrupt_at_quantize_call(monkeypatch, k: int, sig: int) -> None:
    real = ReferenceBackend.quantize
    calls = []

    def stop(self, x, scheme, **kw):
        calls.append(1)
        if len(calls) == k:
            os.kill(os.getpid(), sig)
            time.sleep(1)  # the handler raises here, on the main thread
        return real(self, x, scheme, **kw)

    monkeypatch.setattr(ReferenceBackend, "quantize", stop)


@pytest.mark.parametrize("sig,rc", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("k", [1, 3, 6, 8])
def test_interrupted_folder_output_message_is_true(tmp_path, capsys, monkeypatch, sig, rc, k):
    ck = make_checkpoint(tmp_path / "ck")
    out = tmp_path / "out"
    _interrupt_at_quantize_call(monkeypatch, k, sig)
    got, _, err = run(capsys, "quantize", ck, out, "--scheme", "q8s", "--backend", "reference", "--no-stats")
    assert got == rc, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    written = [s for s in SHARDS if (out / s).exists()]
    assert len(written) < 4 and not (out / INDEX).exists()
    assert "it is complete" not in last, (written, err)
    assert f"{len(written)} of 4 shards" in last, (written, last)
    assert "--resume" in last
    assert not [f for f in os.listdir(out) if f.endswith(".tmp")]


@pytest.mark.parametrize("command", ["quantize", "dequantize"])
def test_signals_at_many_points_of_a_folder_run_tell_the_truth(tmp_path, capsys, command):
    """A signal at many points of a run into a folder: the last line says complete exactly when
    every shard and the index are there, else how many shards are (as the folder shows)."""
    from tests.test_interrupt import POINTS, _count_events, _run_with_signal_at

    ck = make_checkpoint(tmp_path / "ck")
    src = ck
    if command == "dequantize":
        src = tmp_path / "q"
        qcore.quantize_model(ck, src, "q8s", "reference")
    out = tmp_path / "out"
    argv = [command, str(src), str(out), "--backend", "reference"] + (["--scheme", "q8s", "--no-stats"]
                                                                       if command == "quantize" else [])
    total = _count_events(argv)
    capsys.readouterr()
    points = sorted({1 + (i * (total - 1)) // max(1, POINTS - 1) for i in range(POINTS)})
    told = set()
    for sig in (signal.SIGINT, signal.SIGTERM):
        for k in points:
            if out.exists():
                shutil.rmtree(out)
            rc, sent = _run_with_signal_at(argv, k, sig)
            last = capsys.readouterr()[1].strip().splitlines()[-1] if rc else ""
            if rc == 0:
                continue
            assert rc in (130, 143) and sent, (k, rc, last)
            shards = [s for s in SHARDS if (out / s).exists()]
            whole = len(shards) == 4 and (out / INDEX).exists()
            if last.endswith("(it is complete)"):
                assert whole, (k, last)
                told.add("complete")
            elif " is incomplete (" in last:
                assert f"({len(shards)} of 4 shards complete, not its index)" in last, (k, shards, last)
                told.add("incomplete")
            else:
                assert not out.exists() or not os.listdir(out), (k, last)
                told.add("nothing")
            assert not [f for _, _, fs in os.walk(out) for f in fs if f.endswith(".tmp")], k
    assert {"incomplete", "nothing"} <= told, told


def test_folder_interrupted_before_its_index_is_not_complete(tmp_path, capsys, monkeypatch):
    ck = make_checkpoint(tmp_path / "ck")
    real = qck.atomic_write

    def stop_at_the_index(path, write):
        if path.endswith(".safetensors.index.json"):
            raise KeyboardInterrupt
        return real(path, write)

    monkeypatch.setattr(qck, "atomic_write", stop_at_the_index)
    rc, _, err = run(capsys, "quantize", ck, tmp_path / "out", "--scheme", "q8s", "--backend", "reference")
    assert rc == 130
    last = err.strip().splitlines()[-1]
    assert "it is complete" not in last and "4 of 4 shards" in last and "index" in last, last


def test_folder_interrupted_after_the_run_is_complete(tmp_path, capsys, monkeypatch):
    ck = make_checkpoint(tmp_path / "ck")
    real = qapi.quantize_model

    def finish_then_stop(*a, **k):
        real(*a, **k)
        raise KeyboardInterrupt  # as if Ctrl-C came while the table was printed

    monkeypatch.setattr(qapi, "quantize_model", finish_then_stop)
    rc, _, err = run(capsys, "quantize", ck, tmp_path / "out", "--scheme", "q8s", "--backend", "reference")
    assert rc == 130
    assert err.strip().splitlines()[-1] == f"qcore: interrupted after {tmp_path / 'out'} was written (it is complete)"


def test_interrupted_folder_dequantize_message_is_true(tmp_path, capsys, monkeypatch):
    ck = make_checkpoint(tmp_path / "ck")
    qcore.quantize_model(ck, tmp_path / "q", "q8s", "reference")
    real = qmodel.atomic_write
    seen = []

    def stop_at_third(path, write):
        if str(path).endswith(".safetensors"):
            seen.append(path)
            if len(seen) == 3:  # shards 1 and 2 written, then the third
                raise KeyboardInterrupt
        return real(path, write)

    monkeypatch.setattr(qmodel, "atomic_write", stop_at_third)
    rc, _, err = run(capsys, "dequantize", tmp_path / "q", tmp_path / "d", "--backend", "reference")
    assert rc == 130
    last = err.strip().splitlines()[-1]
    assert "it is complete" not in last and "2 of 4 shards" in last, last


# ------------------------------------------------------------------ the other files of a model folder
def test_other_files_skip_links_out_of_the_folder_and_loops(tmp_path, capsys):
    ck = make_checkpoint(tmp_path / "ck")
    (ck / "tok" / "loop").symlink_to("..")          # a loop back to the model folder
    (ck / "self").symlink_to(".")
    (tmp_path / "secret.txt").write_text("outside")
    (ck / "secret.txt").symlink_to(tmp_path / "secret.txt")  # a regular file outside the folder
    (ck / "device.json").symlink_to("/dev/null")     # a device (as /dev/zero, which never ends)
    os.mkfifo(ck / "pipe")                           # a FIFO: copying it would block
    (ck / "pipe.json").symlink_to("pipe")
    (ck / "generation.json").symlink_to("config.json")  # a link inside the folder: copied
    rc, _, err = run(capsys, "quantize", ck, tmp_path / "out", "--scheme", "q8s", "--backend", "reference",
                     "--no-stats")
    assert rc == 0, err
    got = sorted(os.path.relpath(os.path.join(d, f), tmp_path / "out")
                 for d, _, files in os.walk(tmp_path / "out") for f in files)
    assert got == sorted(["config.json", "generation.json", INDEX, *SHARDS, os.path.join("tok", "vocab.txt")])
    assert (tmp_path / "out" / "generation.json").read_text() == '{"model_type": "toy"}'


def test_hub_snapshot_links_into_its_blobs_are_copied(tmp_path, monkeypatch):
    """A hub cache snapshot is made of links into the repository's blobs/: those are the model's files."""
    repo = tmp_path / "hub" / "models--org--toy"
    ck = make_checkpoint(repo / "snapshots" / "abc")
    (repo / "blobs").mkdir()
    for name in ["config.json", "tok/vocab.txt"]:
        blob = repo / "blobs" / name.replace("/", "_")
        os.replace(ck / name, blob)
        (ck / name).symlink_to(os.path.relpath(blob, (ck / name).parent))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    qcore.quantize_model("org/toy", tmp_path / "out", "q8s", "reference", stats=False)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "toy"
    assert (tmp_path / "out" / "tok" / "vocab.txt").read_text() == "a\nb\n"


# ------------------------------------------------------------------ stored recipe that is not JSON
@pytest.mark.parametrize("recipe", ["{not json", '{"rules": 5}', "[1, 2]", "[" * 5000], ids=["not-json", "bad-rules",
                                                                                             "a-list", "deep"])
def test_inspect_shows_a_stored_recipe_that_is_not_valid(tmp_path, capsys, recipe):
    f = tmp_path / "m.safetensors"
    save_file({"w": _x((4, 8), 1)}, str(f), metadata={"qcore.format_version": "1", "qcore.recipe": recipe})
    rc, out, err = run(capsys, "inspect", f)
    assert rc == 0 and "Traceback" not in err, err
    assert re.search(r"recipe \(stored, not a valid recipe: .*\)", out), out
    rc, out, err = run(capsys, "inspect", f, "--json")
    assert rc == 0, err
    assert json.loads(out)["recipe"] == recipe  # the stored text, as it is


# ------------------------------------------------------------------ file errors are typed
@pytest.mark.parametrize("shard,error", [
    ("missing.safetensors", StorageError), ("../m.safetensors", InvalidDataError),
    ("/abs/m.safetensors", InvalidDataError), (".", InvalidDataError), ("", InvalidDataError),
    ("sub/m.safetensors", InvalidDataError), ("..", InvalidDataError),
], ids=["missing", "parent", "absolute", "dot", "empty", "subfolder", "dotdot"])
def test_index_naming_a_bad_shard(tmp_path, capsys, shard, error):
    ck = tmp_path / "ck"
    ck.mkdir()
    save_file({"a.weight": _x((4, 8), 1)}, str(ck / "m.safetensors"))
    save_file({"a.weight": _x((4, 8), 1)}, str(tmp_path / "m.safetensors"))
    (ck / INDEX).write_text(json.dumps({"weight_map": {"a.weight": shard}}))
    with pytest.raises(error, match=INDEX) as e:
        qcore.quantize_model(ck, tmp_path / "out", "q8s", "reference")
    assert "\n" not in str(e.value)
    with pytest.raises(error, match=INDEX):
        qcore.dequantize_model(ck, tmp_path / "d", backend="reference")
    for argv in (["inspect", ck], ["convert", ck, tmp_path / "o.safetensors", "--to", "qcore"]):
        rc, _, err = run(capsys, *argv)
        assert rc == 1
        one_line_error(err, re.escape(INDEX))


# ------------------------------------------------------------------ sizes and recipes
@pytest.mark.parametrize("size", ["1e400", "1e308GB", "99999999999999999999TiB", "1e99999999999999999999"])
def test_huge_max_shard_size_is_one_line(tmp_path, capsys, size):
    f = tmp_path / "m.safetensors"
    save_file({"w": _x((4, 8), 1)}, str(f))
    rc, _, err = run(capsys, "quantize", f, tmp_path / "out", "--scheme", "q8s", "--backend", "reference",
                     "--max-shard-size", size)
    assert rc == 1
    one_line_error(err, r"size .*at most")


@pytest.mark.parametrize("text,pattern", [
    (b"scheme = \"q8s\"\n# \xff\xfe not utf-8\n", r"not UTF-8"),
    (b"scheme = \"q8s\"\nkeep = 5\n", r"keep must be a list of globs"),
    (b"scheme = \"q8s\"\nrules = 5\n", r"rules must be a list"),
    (b"scheme = \"q8s\"\nrule = 5\n", r"rule must be a list"),
    (b"scheme = \"q8s\"\n[rule]\npattern = \"a\"\nscheme = \"keep\"\n", r"rule must be a list"),
], ids=["not-utf8", "keep-int", "rules-int", "rule-int", "rule-table"])
def test_bad_recipe_files_are_one_line(tmp_path, capsys, text, pattern):
    f = tmp_path / "m.safetensors"
    save_file({"w": _x((4, 8), 1)}, str(f))
    r = tmp_path / "r.toml"
    r.write_bytes(text)
    rc, _, err = run(capsys, "quantize", f, tmp_path / "o.safetensors", "--recipe", r, "--backend", "reference")
    assert rc == 1
    one_line_error(err, pattern)


def test_recipe_file_that_is_a_fifo_is_refused(tmp_path):
    f = tmp_path / "m.safetensors"
    save_file({"w": _x((4, 8), 1)}, str(f))
    os.mkfifo(tmp_path / "r.toml")
    try:
        p = subprocess.run(CLI + ["quantize", str(f), str(tmp_path / "o.safetensors"), "--recipe",
                                  str(tmp_path / "r.toml")], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("qcore quantize --recipe blocked on a FIFO")
    assert p.returncode == 1, p.stderr
    one_line_error(p.stderr, r"not a regular file")


def test_regex_with_a_huge_repeat_count_is_one_line(tmp_path, capsys):
    f = tmp_path / "m.safetensors"
    save_file({"w": _x((4, 8), 1)}, str(f))
    rc, _, err = run(capsys, "quantize", f, tmp_path / "o.safetensors", "--scheme", "q8s", "--backend", "reference",
                     "--rule", "re:a{99999999999999999999}=keep")
    assert rc == 1
    one_line_error(err, r"not a valid regular expression")


@pytest.mark.parametrize("pattern", [r"re:^(a+)+$", r"re:(\w*\.)*x", r"re:(a|ab)*c", r"re:(?:x{2,})+",
                                     r"re:.*.*.*.*x"])
def test_regex_rules_that_could_take_exponential_time_are_refused(pattern):
    t0 = time.perf_counter()
    with pytest.raises(InputError, match=r"bounded time"):
        Rule.parse(f"{pattern}=keep")
    assert time.perf_counter() - t0 < 1


def test_regex_rules_match_in_bounded_time(tmp_path, capsys):
    f = tmp_path / "m.safetensors"
    save_file({"a" * 30 + ".weight": _x((4, 8), 1), "b.weight": _x((4, 8), 2)}, str(f))
    t0 = time.perf_counter()
    rc, _, err = run(capsys, "quantize", f, tmp_path / "o.safetensors", "--scheme", "q8s", "--backend", "reference",
                     "--rule", "re:^(a+)+$=keep")
    assert time.perf_counter() - t0 < 30
    assert rc == 1
    one_line_error(err, r"nests a repetition")
    # ordinary regex rules are untouched
    for text in (r"re:^model\.layers\.\d+\.mlp\.(gate|up)_proj", r"re:layers\.(0|1)\.", r"re:.*mlp.*",
                 r"re:^lm_head=keep", r"re:(ab)+c", r"re:x{2,5}"):
        Rule.parse(text if "=" in text else f"{text}=q8s")


def test_long_names_and_regex_rules(tmp_path):
    rule = Rule.parse(r"re:mlp\..*weight=keep")
    rc = Recipe("q8s", (rule,))
    assert rc.choose("x.mlp.w.weight", (4, 8), np.float32).scheme is None
    with pytest.raises(InputError, match=r"characters long"):
        rc.choose("mlp." + "a" * 5000, (4, 8), np.float32)


# ------------------------------------------------------------------ stale temporaries and index checks
def test_resume_removes_stale_temporaries(tmp_path, capsys):
    ck = make_checkpoint(tmp_path / "ck")
    out = tmp_path / "out"
    rc, _, err = run(capsys, "quantize", ck, out, "--scheme", "q8s", "--backend", "reference")
    assert rc == 0, err
    stale = [out / f".{SHARDS[1]}.k1ll3d0a.tmp", out / f".{INDEX}.zz_9abcd.tmp", out / ".config.json.abcdefgh.tmp",
             out / "tok" / ".vocab.txt.q1w2e3r4.tmp"]
    for p in stale:
        p.write_bytes(b"partial")
    mine = out / ".notes.tmp"  # not a temporary of any file the run writes: left alone
    mine.write_text("keep me")
    (out / SHARDS[2]).unlink()
    rc, out_text, err = run(capsys, "quantize", ck, out, "--scheme", "q8s", "--backend", "reference", "--resume")
    assert rc == 0, err
    assert "resumed: 3 shards" in out_text
    assert [p for p in stale if p.exists()] == []
    assert mine.read_text() == "keep me"


@pytest.mark.parametrize("case", ["missing-from-shard", "in-two-shards"])
def test_inspect_and_dequantize_reject_indexes_quantize_rejects(tmp_path, capsys, case):
    ck = make_checkpoint(tmp_path / "ck", n_shards=2)
    index = json.loads((ck / INDEX).read_text())
    if case == "missing-from-shard":
        index["weight_map"]["ghost.weight"] = SHARDS[0].replace("00004", "00002")
    else:
        save_file({"layers.0.attn.weight": _x((8, 64), 0), "layers.1.attn.weight": _x((8, 64), 10),
                   "layers.1.mlp.weight": _x((64, 32), 11)}, str(ck / "model-00002-of-00002.safetensors"))
    (ck / INDEX).write_text(json.dumps(index))
    with pytest.raises(InvalidDataError) as want:
        qcore.quantize_model(ck, tmp_path / "q", "q8s", "reference")
    message = str(want.value)
    with pytest.raises(InvalidDataError) as got:
        qcore.dequantize_model(ck, tmp_path / "d", backend="reference")
    assert str(got.value) == message
    rc, _, err = run(capsys, "inspect", ck)
    assert rc == 1
    assert one_line_error(err, ".") == f"qcore: error: {message}"


# ------------------------------------------------------------------ auto under the CUDA simulator
class _Simulated(ReferenceBackend):
    """A backend on a simulated device: correct, and far slower than the CPU backends."""

    name = "simdev"
    priority = 99
    simulated = True


@pytest.fixture
def fresh_registry():
    registry.reset()
    yield registry
    registry.reset()


def test_auto_prefers_a_real_backend_over_a_simulated_one(fresh_registry, monkeypatch):
    registry.register(_Simulated())
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    assert qcore.backend("auto").pick("q8s").name != "simdev"
    assert qcore.quantize(np.float32([1, 2]), "q8s").backend.name != "simdev"
    assert qcore.backend("simdev").name == "simdev"  # asked for by name: still given
    monkeypatch.setenv(registry.ENV_VAR, "simdev")
    assert qcore.backend().name == "simdev"


def test_auto_skips_the_cuda_simulator(fresh_registry, monkeypatch, capsys, tmp_path):
    if "cuda" not in registry.registered() or not registry.is_available(registry.registered()["cuda"]):
        pytest.skip("the cuda backend is not installed or not available")
    import numba

    if not numba.config.ENABLE_CUDASIM:
        pytest.skip("a real GPU: auto picks cuda there")
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    auto = qcore.backend("auto")
    assert auto.pick("q4s/block32:f16").name == "reference"
    assert auto.pick("q8s").name in ("ndarray", "reference")
    assert "cuda" in auto.describe() and auto.describe().index("cuda") > auto.describe().index("reference")
    assert qcore.backend("cuda").name == "cuda"
    monkeypatch.setenv(registry.ENV_VAR, "cuda")
    assert qcore.backend().name == "cuda"
