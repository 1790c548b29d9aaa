"""SIGINT/SIGTERM at any moment of `qcore quantize` / `qcore dequantize`: the output is the old
one, a complete new one, or absent; no temporary file is ever left; the message tells which.

In-process: a trace function counts the interpreter's line events inside qcore during one run
and sends a real signal to the process at the k-th event, for many k spread over the whole run
(imports are done; reading, quantizing, writing, moving the file into place, printing). The
signal goes through Python's handlers, so the sections `qcore._signals.deferred` protects are
tested as they run. `QCORE_INTERRUPT_POINTS` sets how many points per signal (CI: 24).

Out of process: the `qcore` command receives SIGINT/SIGTERM from outside at several delays from
its start, import time included (a traceback there was a bug). A SIGINT inside the interpreter's
own start-up (streams, `site` import: before the entry point runs) ends with Python's own "Fatal Python
error" text: out of qcore's reach, and nothing is written then.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from safetensors.numpy import save_file

import qcore
from _qcore_launch import main  # the `qcore` command's entry point (it wraps qcore.cli.main.main)

POINTS = int(os.environ.get("QCORE_INTERRUPT_POINTS", "24"))
QCORE_DIR = os.path.dirname(qcore.__file__)

MESSAGES = {
    "none": "qcore: interrupted; no output file was written",
    "old": "qcore: interrupted; {out} was left as it was",
    "new": "qcore: interrupted after {out} was written (it is complete)",
}


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "m.safetensors"
    rng = np.random.default_rng(0)
    save_file({"a.weight": rng.standard_normal((32, 64)).astype(np.float32),
               "b.weight": rng.standard_normal((16, 32)).astype(np.float32),
               "c.bias": rng.standard_normal(32).astype(np.float32)}, str(path))
    return path


def _count_events(argv) -> int:
    n = 0

    def tracer(frame, event, arg):
        nonlocal n
        if frame.f_code.co_filename.startswith(QCORE_DIR):
            if event == "line":
                n += 1
            return tracer
        return None

    sys.settrace(tracer)
    try:
        rc = main(argv)
    finally:
        sys.settrace(None)
    assert rc == 0
    return n


class _Terminated(Exception):
    """What the test's own SIGTERM handler raises."""


def _raise_terminated(sig, frame):
    raise _Terminated()


def _run_with_signal_at(argv, k: int, sig: int) -> tuple[int | None, bool]:
    """Run main(argv), sending `sig` to this process at qcore's k-th line event: (exit status, sent).

    SIGTERM is answered outside the command by this test's own handler (the process's default
    action would end the test run); the status is None where that handler answered it: the signal
    landed as the command was putting the process's handlers back, its work done."""
    n = 0
    sent = False

    def tracer(frame, event, arg):
        nonlocal n, sent
        if frame.f_code.co_filename.startswith(QCORE_DIR):
            if event == "line":
                n += 1
                # SIGTERM before the CLI installs its handler would end the command by this
                # process's handler (the out-of-process test sees the default action): send it at
                # the first line the command's handler is in place instead.
                if n >= k and not sent and (sig != signal.SIGTERM or signal.getsignal(sig) is not _raise_terminated):
                    sent = True
                    os.kill(os.getpid(), sig)
            return tracer
        return None

    old_term = signal.signal(signal.SIGTERM, _raise_terminated)
    sys.settrace(tracer)
    try:
        rc = main(argv)
    except _Terminated:
        rc = None
    finally:
        sys.settrace(None)
        signal.signal(signal.SIGTERM, old_term)
    return rc, sent


def _file_bytes(path) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


@pytest.mark.parametrize("command", ["quantize", "dequantize"])
@pytest.mark.parametrize("old_output", [False, True], ids=["no-old-output", "old-output"])
def test_signals_at_many_points(tmp_path, model, capsys, command, old_output):
    work = tmp_path / "work"
    work.mkdir()
    src = model
    if command == "dequantize":
        src = tmp_path / "q.safetensors"
        assert main(["quantize", str(model), str(src), "--scheme", "q4s/block32:f16", "--backend", "reference"]) == 0
    out = work / "o.safetensors"
    argv = [command, str(src), str(out), "--backend", "reference"]
    if command == "quantize":
        argv += ["--scheme", "q4s/block32:f16"]
    total = _count_events(argv)
    fresh = out.read_bytes()  # what a complete run writes
    capsys.readouterr()
    old = b"old output, not a safetensors file"
    assert total > 200
    points = sorted({1 + (i * (total - 1)) // max(1, POINTS - 1) for i in range(POINTS)})
    seen = {"none": 0, "old": 0, "new": 0, "done": 0}
    for sig in (signal.SIGINT, signal.SIGTERM):
        for k in points:
            if old_output:
                out.write_bytes(old)
            elif out.exists():
                out.unlink()
            rc, sent = _run_with_signal_at(argv, k, sig)
            _, err = capsys.readouterr()
            assert sent or rc == 0, k  # runs differ by a few lines: the last points may fall after the end
            left = _file_bytes(out)
            assert sorted(os.listdir(work)) == (["o.safetensors"] if left is not None else []), (k, os.listdir(work))
            assert left in (None, old, fresh), k
            if rc in (0, None):  # the signal came after the command's work: after its last line
                assert left == fresh  # under the tracer, or as it put the process's handlers back
                seen["done"] += 1
                continue
            assert "Traceback" not in err
            assert rc == (130 if sig == signal.SIGINT else 143), (k, rc, err)
            state = "new" if left == fresh else ("old" if left == old else "none")
            # before OUT is known (argument parsing) "no output file was written" is the truth too
            allowed = {MESSAGES[state].format(out=out)} | ({MESSAGES["none"]} if state == "old" else set())
            assert err.strip().splitlines()[-1] in allowed, (k, err)
            seen[state] += 1
    assert sum(seen.values()) == 2 * len(points)
    # the sweep covers the run: interrupted before the write and after it
    assert seen["new"] + seen["done"] > 0 and seen["none" if not old_output else "old"] > 0, seen


def test_second_signal_during_cleanup_leaves_no_temp(tmp_path, capsys, monkeypatch):
    """A signal inside the deferred cleanup (temp file removal) waits until the file is gone."""
    from qcore.files import io as qio
    from qcore.model import pipeline as qpipeline
    from qcore.files import stfile

    model = tmp_path / "m.safetensors"  # more tensors than the pipeline holds between its stages
    rng = np.random.default_rng(1)
    n = 4 * qpipeline.IN_FLIGHT
    save_file({f"l{i}.weight": rng.standard_normal((16, 64)).astype(np.float32) for i in range(n)}, str(model))
    out = tmp_path / "o.safetensors"
    real = stfile.StreamWriter.add
    pipelines = []
    real_init = qpipeline._Pipeline.__init__

    def init(self):
        real_init(self)
        pipelines.append(self)

    interrupted = []

    def write_then_interrupt(self, name, array):  # the writer thread, inside the temp file
        real(self, name, array)
        if not interrupted:
            interrupted.append(name)
            os.kill(os.getpid(), signal.SIGINT)
            assert pipelines[0].stop.wait(30)  # the main thread took the signal and stopped the run
    real_unlink = os.unlink

    sent = []

    def unlink_with_signal(p, *a, **k):
        if str(p).endswith(".tmp") and not sent:
            sent.append(p)
            os.kill(os.getpid(), signal.SIGTERM)  # held until the removal is done
            time.sleep(0.2)  # (the removal runs on the writer thread: the run must wait for it)
        return real_unlink(p, *a, **k)

    monkeypatch.setattr(qpipeline._Pipeline, "__init__", init)
    monkeypatch.setattr(stfile.StreamWriter, "add", write_then_interrupt)
    monkeypatch.setattr(qio.os, "unlink", unlink_with_signal)
    rc = main(["quantize", str(model), str(out), "--scheme", "q8s", "--backend", "reference"])
    _, err = capsys.readouterr()
    assert rc in (130, 143) and sent
    assert sorted(os.listdir(tmp_path)) == ["m.safetensors"]
    assert err.strip().splitlines()[-1] == MESSAGES["none"]


def _before_any_qcore_code(err: str) -> bool:
    """A KeyboardInterrupt from Python's default handler, raised before the launcher could hold
    signals: while the console script runs its first lines (`import sys`, seen as "line 0" of
    the script with no source shown) or imports `_qcore_launch`, or that module's own first
    imports run (`import signal`), so every frame of ours (the console script, `_qcore_launch.py`,
    the qcore package) is a module-level line of the console script or of `_qcore_launch.py`
    (seen at 0.1-0.6 s on slow-starting or loaded machines); or a bare "KeyboardInterrupt" with no
    frame at all, which Python prints when it comes while its start-up imports run (their frames
    are the import machinery's, which Python leaves out: seen once at 0.05 s in CI). Frames in
    `main`, `_import_cli` or the qcore package mean the launcher was running, and a traceback there
    is a bug."""
    if err.strip() == "KeyboardInterrupt":
        return True
    frames = re.findall(r'File "([^"]+)", line \d+, in (\S+)', err)
    entry = [fn for f, fn in frames if f.endswith(("_qcore_launch.py", f"{os.sep}qcore"))]
    in_package = any(f"{os.sep}qcore{os.sep}" in f for f, _ in frames)
    return "KeyboardInterrupt" in err and bool(entry) and all(fn == "<module>" for fn in entry) and not in_package


_IGNORED_IN_IMPORTLIB = re.compile(
    r'Exception ignored in: <function _get_module_lock\.<locals>\.cb at 0x[0-9a-f]+>\n'
    r'Traceback \(most recent call last\):\n(  File "<frozen importlib\._bootstrap>", line \d+, in \w+\n)+'
    r'KeyboardInterrupt: ?\n?')
"""Python's import machinery swallowing a KeyboardInterrupt in a module lock's weakref callback
(it prints "Exception ignored" and goes on), before the launcher holds signals: no frame of ours."""

_IGNORED_IN_SITE = re.compile(
    r'Error processing line \d+ of [^\n]*\.pth:\n\n(?:  [^\n]*\n)*\nRemainder of file ignored\n?')
"""Python's start-up (site.py) reporting an exception from a `.pth` line, here a KeyboardInterrupt
while an editable install's finder imports, and going on without the rest of that file: no
frame of ours."""


def _drop_python_startup_noise(err: str) -> str:
    """err without the blocks Python printed for a KeyboardInterrupt it swallowed and went on
    from (`_IGNORED_IN_IMPORTLIB`, `_IGNORED_IN_SITE`)."""
    err = _IGNORED_IN_IMPORTLIB.sub("", err)
    return _IGNORED_IN_SITE.sub(lambda m: "" if "KeyboardInterrupt" in m.group(0) else m.group(0), err)



def _signal_lines(argv) -> list[int]:
    """The ordinals (among all qcore line events) of the line events a run spends in the code
    that installs or restores signal handlers (`qcore._signals`, the head and tail of `cli.main`)."""
    watched = (os.path.join(QCORE_DIR, "_signals.py"), os.path.join(QCORE_DIR, "cli", "main.py"))
    n, picked = 0, []

    def tracer(frame, event, arg):
        nonlocal n
        if frame.f_code.co_filename.startswith(QCORE_DIR):
            if event == "line":
                n += 1
                if frame.f_code.co_filename in watched and (frame.f_code.co_filename == watched[0]
                                                            or frame.f_code.co_name == "main"):
                    picked.append(n)
            return tracer
        return None

    sys.settrace(tracer)
    try:
        assert main(argv) == 0
    finally:
        sys.settrace(None)
    return picked


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_at_any_handler_change_leaves_the_handlers_as_they_were(tmp_path, model, capsys, sig):
    """A signal that lands while the command puts in its handlers, or puts the old ones back:
    afterwards a Ctrl-C and a SIGTERM are answered by the process's own handlers, which are then
    in place (a hold left behind would swallow every later Ctrl-C of a program that called `main`)."""
    out = tmp_path / "o.safetensors"
    argv = ["quantize", str(model), str(out), "--scheme", "q8s", "--backend", "reference"]
    old_term = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        points = _signal_lines(argv)
        assert len(points) > 20
        for k in points:
            rc, _ = _run_with_signal_at(argv, k, sig)
            capsys.readouterr()
            assert rc in (0, None, 130, 143), k
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(10)
            with pytest.raises(_Terminated):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(10)
            assert {s: signal.getsignal(s) for s in before} == before, k
    finally:
        signal.signal(signal.SIGTERM, old_term)

@pytest.mark.skipif(shutil.which("qcore") is None and not os.path.exists(os.path.join(os.path.dirname(sys.executable),
                                                                                    "qcore")),
                    reason="the qcore command is not installed")
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_the_command_from_outside(tmp_path, model, sig):
    """Signals from another process at several delays from start: no traceback, no temp file, a
    true message (or a clean finish when the signal comes after the end)."""
    exe = os.path.join(os.path.dirname(sys.executable), "qcore")
    if not os.path.exists(exe):
        exe = shutil.which("qcore")
    out = tmp_path / "o.safetensors"
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    for delay in (0.0, 0.02, 0.05, 0.1, 0.3, 0.6):
        if out.exists():
            out.unlink()
        p = subprocess.Popen([exe, "quantize", str(model), str(out), "--scheme", "q8s", "--backend", "reference"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        time.sleep(delay)
        p.send_signal(sig)
        _, err = p.communicate(timeout=60)
        err = _drop_python_startup_noise(err)  # Python went on: the run is judged as usual below
        if "Fatal Python error: init_" in err or _before_any_qcore_code(err):  # Python's own start-up
            assert not out.exists()
            continue
        assert "Traceback" not in err, (delay, err)
        assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")], delay
        if p.returncode == 0:
            assert out.exists()
            continue
        if p.returncode == -sig:  # killed by the default action: before the handlers were set (nothing
            if out.exists():      # written) or after they were restored on exit (the output complete)
                assert qcore.load(str(out), backend="reference"), delay
            continue
        assert p.returncode in (130, 143), (delay, p.returncode, err)
        last = err.strip().splitlines()[-1]
        if out.exists():
            assert last == MESSAGES["new"].format(out=out), (delay, err)
        else:
            assert last == MESSAGES["none"], (delay, err)


@pytest.mark.parametrize("sig,rc", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_signal_while_importing(tmp_path, model, sig, rc):
    """A signal that lands while the library is being imported (here: as numpy's import starts) is
    held until the import is done, then answered with one line and 130/143: never a traceback,
    an ImportError from numpy's C core, or death by the default action."""
    out = tmp_path / "o.safetensors"
    code = (
        "import builtins, os, signal, sys\n"
        "import _qcore_launch\n"
        "real = builtins.__import__\n"
        "def imp(name, *a, **k):\n"
        "    if name == 'numpy' and 'numpy' not in sys.modules:\n"
        f"        os.kill(os.getpid(), {int(sig)})\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = imp\n"
        f"sys.exit(_qcore_launch.main(['quantize', {str(model)!r}, {str(out)!r}, '--scheme', 'q8s']))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert p.returncode == rc, p.stderr
    assert p.stderr.strip().splitlines() == [MESSAGES["none"]]
    assert os.listdir(tmp_path) == ["m.safetensors"]


def test_a_signal_before_any_qcore_code_is_told_apart():
    """The pre-launcher window is recognised only when no function of ours is in the traceback."""
    script = ('Traceback (most recent call last):\n  File "/venv/bin/qcore", line 5, in <module>\n'
              '    from _qcore_launch import main\n  File "<frozen importlib._bootstrap>", line 1360, in '
              '_find_and_load\nKeyboardInterrupt\n')
    assert _before_any_qcore_code(script)
    imports = script.replace("KeyboardInterrupt\n", '  File "/src/_qcore_launch.py", line 10, in <module>\n'
                             '    import signal\n  File "/py/signal.py", line 5, in <module>\nKeyboardInterrupt\n')
    assert _before_any_qcore_code(imports)
    first_line = 'Traceback (most recent call last):\n  File "/venv/bin/qcore", line 0, in <module>\nKeyboardInterrupt\n'
    assert _before_any_qcore_code(first_line)
    ours = script.replace("KeyboardInterrupt\n", '  File "/src/_qcore_launch.py", line 20, in main\nKeyboardInterrupt\n')
    assert not _before_any_qcore_code(ours)
    lib = script.replace("KeyboardInterrupt\n", f'  File "/src{os.sep}qcore{os.sep}cli{os.sep}main.py", line 9, '
                         'in <module>\nKeyboardInterrupt\n')
    assert not _before_any_qcore_code(lib)


def test_startup_noise_filter_drops_only_swallowed_interrupts():
    """`_drop_python_startup_noise` removes site.py's report of a KeyboardInterrupt in a `.pth`
    line (Python went on), and keeps the same report of any other error and every other line."""
    def site_block(last: str) -> str:
        lines = ["Traceback (most recent call last):", '  File "<frozen site>", line 186, in addpackage', last]
        return ("Error processing line 1 of /v/site-packages/__editable__.qcore_cuda-0.1.0.pth:\n\n"
                + "".join("  " + line + "\n" for line in lines) + "\nRemainder of file ignored\n")

    interrupted, broken = site_block("KeyboardInterrupt"), site_block("ImportError: no module named x")
    assert _drop_python_startup_noise("a\n" + interrupted + "b\n") == "a\nb\n"
    assert _drop_python_startup_noise("a\n" + broken + "b\n") == "a\n" + broken + "b\n"


def test_the_command_in_another_thread_leaves_the_handlers_alone(tmp_path, model, capsys):
    """`main` off the main thread (a server's worker) runs, and sets no signal handler: Python
    allows that only in the main thread, and the process's handlers are the caller's."""
    import threading

    out = tmp_path / "o.safetensors"
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    got = []
    t = threading.Thread(target=lambda: got.append(
        main(["quantize", str(model), str(out), "--scheme", "q8s", "--backend", "reference"])))
    t.start()
    t.join(120)
    assert got == [0] and out.exists()
    assert {s: signal.getsignal(s) for s in before} == before
