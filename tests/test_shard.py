"""`--shard K/N` (tests/conftest.py): the N parts are disjoint and together are the whole run;
`--shuffle SEED`: the same tests in another order, the same order for the same seed."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _ids(*args):
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "tests/backend/test_ops.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "NUMBA_ENABLE_CUDASIM": "1"})
    return out.returncode, [line for line in out.stdout.splitlines() if "::" in line], out.stdout + out.stderr


def test_shards_partition_the_run():
    rc, whole, _ = _ids()
    assert rc == 0 and whole
    parts = [_ids("--shard", f"{k}/3") for k in (1, 2, 3)]
    assert all(rc == 0 for rc, _, _ in parts)
    ids = [i for _, p, _ in parts for i in p]
    assert sorted(ids) == sorted(whole) and len(set(ids)) == len(ids)
    assert all(p for _, p, _ in parts)


def test_bad_shard_is_a_usage_error():
    rc, _, text = _ids("--shard", "4/3")
    assert rc != 0 and "--shard wants K/N" in text


def test_shuffle_reorders_the_same_tests():
    _, whole, _ = _ids()
    _, one, _ = _ids("--shuffle", "7")
    _, again, _ = _ids("--shuffle", "7")
    assert sorted(one) == sorted(whole) and one != whole and again == one
