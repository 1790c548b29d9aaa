"""One unit per shard on Dask: byte-identical to the single-process run, on a LocalCluster of two
processes, with a worker killed mid-shard, resumed, and from/to a real S3-compatible server; shards
split into groups of tensors, one task each, assembled to the same bytes."""
import importlib
import importlib.util
import os
import random
import shutil
import signal
import socket
from types import SimpleNamespace

import pytest

from qcore.cli.main import main
from qcore.model.api import quantize_model
from tests.files.test_checkpoints import RULES, make_checkpoint



def need(module, reason):
    """The module, else a skip; with QCORE_REQUIRE_DISTRIBUTED=1 (CI) a missing module fails."""
    if os.environ.get("QCORE_REQUIRE_DISTRIBUTED") == "1":
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=reason)


distributed = need("distributed", "Dask distributed is not installed (pip install 'qcore-quant[distributed]')")
from qcore.model.distributed import quantize_model_distributed  # noqa: E402  (needs the optional extra)

SHARDS = [f"model-{k:05d}-of-00004.safetensors" for k in range(1, 5)]
GROUP = 3000  # source bytes per group: each shard of the test model (2.3-14.6 KB) splits into 3 or 4 groups


def tree(root):
    """Every file under root (relative name -> bytes)."""
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            out[os.path.relpath(p, root)] = open(p, "rb").read()
    return out


@pytest.fixture(scope="module")
def client():
    """A LocalCluster of 2 single-threaded worker processes, shared by this module's tests."""
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
                                  host="127.0.0.1") as cluster, distributed.Client(cluster) as c:
        yield c


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A 4-shard checkpoint and its single-process quantization (the reference bytes)."""
    root = tmp_path_factory.mktemp("dist")
    make_checkpoint(root / "src")
    quantize_model(root / "src", root / "single", "q8s", "reference", rules=RULES)
    return root, tree(root / "single")


def test_local_cluster_is_byte_identical(model, client, tmp_path):
    root, want = model
    shards = []
    res = quantize_model_distributed(root / "src", tmp_path / "out", "q8s", "reference", rules=RULES, cluster=client,
                                     on_shard=lambda name, k, n: shards.append((name, k, n)))
    assert tree(tmp_path / "out") == want
    assert sorted(s[0] for s in shards) == SHARDS and [s[1:] for s in shards] == [(k, 4) for k in range(1, 5)]
    assert [os.path.basename(f) for f in res.files] == SHARDS + ["model.safetensors.index.json"]
    assert res.before == sum(r.before for r in res.tensors) and res.resumed == []


def _kill_once_plugin(flag, victim, out):
    """A worker plugin that SIGKILLs its worker while it writes tensor `victim`, once; the flag file
    records what the destination directory `out` held at that moment."""

    class KillOnce(distributed.WorkerPlugin):
        def setup(self, worker):
            import qcore.files.stfile as st

            add = st.StreamWriter.add

            def killing_add(writer, name, array):
                if name == victim and not os.path.exists(flag):
                    with open(flag, "w") as f:
                        f.write("\n".join(sorted(os.listdir(out))))
                    os.kill(os.getpid(), signal.SIGKILL)  # the worker dies with a half-written shard
                return add(writer, name, array)

            st.StreamWriter.add = killing_add

    return KillOnce()


def test_killed_worker_shard_retried_elsewhere_then_resume(model, client, tmp_path):
    root, want = model
    flag = str(tmp_path / "killed")
    client.register_plugin(_kill_once_plugin(flag, "layers.1.mlp.weight", str(tmp_path / "out")), name="kill-once")
    try:
        res = quantize_model_distributed(root / "src", tmp_path / "out", "q8s", "reference", rules=RULES,
                                         cluster=client)
    finally:
        client.unregister_worker_plugin("kill-once")
    assert os.path.exists(flag), "the plugin did not kill a worker"
    at_kill = open(flag).read().split("\n")
    assert SHARDS[1] not in at_kill  # the half-written shard only ever had a temporary name
    assert any(n.startswith(f".{SHARDS[1]}.") and n.endswith(".tmp") for n in at_kill), at_kill
    assert tree(tmp_path / "out") == want  # no temporary file of the dead worker left either
    assert res.resumed == []
    # A rerun with resume redoes only the missing shard.
    os.unlink(tmp_path / "out" / SHARDS[2])
    res = quantize_model_distributed(root / "src", tmp_path / "out", "q8s", "reference", rules=RULES,
                                     cluster=client, resume=True)
    assert sorted(res.resumed) == [SHARDS[0], SHARDS[1], SHARDS[3]]
    assert tree(tmp_path / "out") == want


def test_cli_scheduler_prints_dashboard(model, client, tmp_path, capsys):
    """--scheduler and --group-size (every shard split into groups) from the command line."""
    root, want = model
    rules = [a for r in RULES for a in ("--rule", r)]
    assert main(["quantize", str(root / "src"), str(tmp_path / "out"), "--scheme", "q8s", "--backend", "reference",
                 *rules, "--scheduler", client.scheduler.address, "--group-size", f"{GROUP}B"]) == 0
    err = capsys.readouterr().err
    assert "Dask dashboard: http://" in err
    assert tree(tmp_path / "out") == want


def test_in_process_units_without_dask_cluster(model, tmp_path):
    root, want = model
    quantize_model_distributed(root / "src", tmp_path / "out", "q8s", "reference", rules=RULES)
    assert tree(tmp_path / "out") == want


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3():
    """A real S3-compatible HTTP server (moto's server mode) on 127.0.0.1, and s3fs options for it."""
    moto_server = need("moto.server", "moto[server] is not installed (pip install 'qcore-quant[distributed-test]')")
    need("s3fs", "s3fs is not installed (pip install 'qcore-quant[distributed]')")
    port = _free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    opts = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}",
                                                                     "region_name": "eu-west-1"}}
    try:
        yield opts
    finally:
        server.stop()


def test_s3_in_and_out_byte_identical(model, client, s3, tmp_path):
    import s3fs

    root, want = model
    fs = s3fs.S3FileSystem(**s3)
    fs.mkdir("ckpt")
    fs.put(str(root / "src") + "/", "ckpt/src", recursive=True)
    res = quantize_model_distributed("s3://ckpt/src", "s3://ckpt/out", "q8s", "reference", rules=RULES,
                                     cluster=client, storage_options=s3)
    assert res.files[0] == f"s3://ckpt/out/{SHARDS[0]}"
    fs.invalidate_cache()
    fs.get("ckpt/out/", str(tmp_path / "got") + "/", recursive=True)
    assert tree(tmp_path / "got") == want
    assert not [k for k in fs.find("ckpt/out") if k.endswith(".tmp")]
    # resume reads the remote shards' headers only
    fs.rm(f"ckpt/out/{SHARDS[0]}")
    res = quantize_model_distributed("s3://ckpt/src", "s3://ckpt/out", "q8s", "reference", rules=RULES,
                                     storage_options=s3, resume=True)
    assert sorted(res.resumed) == SHARDS[1:]
    fs.invalidate_cache()
    assert fs.cat(f"ckpt/out/{SHARDS[0]}") == want[SHARDS[0]]


def planned_units(src):
    """The units of a q8s run of the checkpoint at `src`, each naming its source shards."""
    from qcore.files.checkpoint import resolve
    from qcore.model.distributed import Unit
    from qcore.model.plan import plan_shards
    from qcore.model.recipe import as_recipe
    from qcore.files.stfile import Reader

    ck = resolve(src)
    readers = {s: Reader(ck.path(s)) for s in ck.shards}
    try:
        shards, rj = plan_shards(ck, as_recipe("q8s"), None, readers)
    finally:
        for r in readers.values():
            r.close()
    return [Unit(s, {n: ck.path(n) for n in ck.shards}, "", "", "", rj, "reference") for s in shards]


def test_tensor_over_worker_memory_limit_is_refused(model):
    """The plan is checked against the workers' memory limit before any unit starts."""
    from qcore.model.distributed import _check_memory
    from qcore.errors import InputError

    root, _ = model
    units = planned_units(root / "src")

    class Workers:
        def __init__(self, limit):
            self.limit = limit

        def scheduler_info(self):
            return {"workers": {"tcp://a": {"memory_limit": self.limit}, "tcp://b": {"memory_limit": 0}}}

    _check_memory(Workers(1 << 30), units)  # 1 GiB is plenty for 8 KiB tensors
    with pytest.raises(InputError, match=r"tensor 'layers\.\d\.mlp\.weight' \(8192 bytes\).*memory limit of 1000"):
        _check_memory(Workers(1000), units)


def test_cluster_argument_errors(model, tmp_path):
    from qcore.errors import InputError

    root, _ = model
    with pytest.raises(InputError, match="cluster must be 'local', a Dask Cluster or Client, got 'mars'"):
        quantize_model_distributed(root / "src", tmp_path / "a", "q8s", "reference", cluster="mars")
    with pytest.raises(InputError, match="not both"):
        quantize_model_distributed(root / "src", tmp_path / "b", "q8s", "reference", cluster="local",
                                   scheduler="tcp://127.0.0.1:1")


def test_s3_single_file_in_process(model, s3, tmp_path):
    """One file in, one file out, through URLs, without a cluster (fsspec only)."""
    import s3fs

    root, _ = model
    fs = s3fs.S3FileSystem(**s3)
    fs.mkdir("one")
    fs.put(str(root / "src" / SHARDS[0]), f"one/{SHARDS[0]}")  # the run marker names the source file
    quantize_model(root / "src" / SHARDS[0], tmp_path / "want.safetensors", "q8s", "reference", rules=RULES)
    res = quantize_model_distributed(f"s3://one/{SHARDS[0]}", "s3://one/out.safetensors", "q8s", "reference",
                                     rules=RULES, storage_options=s3)
    assert res.files == ["s3://one/out.safetensors"]
    fs.invalidate_cache()
    assert fs.cat("one/out.safetensors") == (tmp_path / "want.safetensors").read_bytes()
    assert sorted(fs.ls("one")) == [f"one/{SHARDS[0]}", "one/out.safetensors"]  # no temporary key left


def test_cluster_local_starts_and_closes_its_own_cluster(model, tmp_path):
    """cluster="local" (what --cluster local runs): a LocalCluster of its own, one worker here."""
    root, want = model
    said = []
    quantize_model_distributed(root / "src", tmp_path / "out", "q8s", "reference", rules=RULES, cluster="local",
                               workers=1, log=said.append)
    assert tree(tmp_path / "out") == want
    assert len(said) == 1 and said[0].startswith("Dask dashboard: http")


def test_cuda_local_cluster_needs_dask_cuda(model, tmp_path, cuda_backend):
    """--cluster local with the cuda backend is dask-cuda's LocalCUDACluster; without it, a clear error."""
    from qcore.errors import InputError

    if importlib.util.find_spec("dask_cuda") is not None:
        pytest.skip("dask-cuda is installed: this checks the message shown without it")
    root, _ = model
    with pytest.raises(InputError, match=r"dask-cuda: pip install 'qcore-quant\[distributed-cuda\]'"):
        quantize_model_distributed(root / "src", tmp_path / "out", "q8s", cuda_backend, cluster="local")


# ------------------------------------------------------------------------ shards split into groups
def test_tensor_groups_keep_order_limit_and_every_tensor_once():
    from qcore.model.distributed import tensor_groups

    def groups_of(sizes, limit):
        items = [SimpleNamespace(name=f"t{k}", head=SimpleNamespace(nbytes=n)) for k, n in enumerate(sizes)]
        groups = tensor_groups(SimpleNamespace(tensors=items), limit)
        assert [it for g in groups for it in g] == items  # every tensor exactly once, in plan order
        for g, after in zip(groups, groups[1:] + [None]):
            size = sum(it.head.nbytes for it in g)
            assert g and (size <= limit or len(g) == 1)  # under the limit, or one tensor over it alone
            assert after is None or size + after[0].head.nbytes > limit  # a group ends only when it must
        return [[it.head.nbytes for it in g] for g in groups]

    assert groups_of([5, 3, 2, 10, 1, 1, 4, 6, 0, 7], 6) == [[5], [3, 2], [10], [1, 1, 4], [6, 0], [7]]
    assert groups_of([], 6) == []
    rng = random.Random(0)
    for _ in range(300):
        groups_of([rng.randrange(0, 12) for _ in range(rng.randrange(0, 15))], rng.randrange(1, 15))


def test_split_unit_keeps_the_shard_and_narrows_its_sources(model):
    from qcore.model.distributed import split_unit

    root, _ = model
    unit = planned_units(root / "src")[0]
    assert split_unit(unit, None) == [unit] and split_unit(unit, unit.source_bytes) == [unit]
    groups = split_unit(unit, GROUP)
    assert len(groups) > 2
    assert [it.name for g in groups for it in g.shard.tensors] == [it.name for it in unit.shard.tensors]
    assert {(g.shard.name, g.shard.marker, g.out) for g in groups} == {(unit.shard.name, unit.shard.marker, unit.out)}
    assert all(list(g.sources) == [SHARDS[0]] for g in groups)


def test_assembly_run_again_keeps_the_shard(model, tmp_path):
    """Dask runs a finished task again when the worker holding its result dies: an assembly whose
    shard is complete (and whose parts are gone) leaves the shard as it is."""
    import dataclasses

    from qcore.model.distributed import assemble_unit, run_group, run_unit, split_unit

    root, _ = model
    whole, out = tmp_path / "whole", tmp_path / "out"
    whole.mkdir()
    out.mkdir()
    unit = planned_units(root / "src")[0]
    run_unit(dataclasses.replace(unit, out=str(whole / SHARDS[0]), dest_url=str(whole)))
    unit = dataclasses.replace(unit, out=str(out / SHARDS[0]), dest_url=str(out))
    groups = split_unit(unit, GROUP)
    parts = [run_group(g, k, len(groups)) for k, g in enumerate(groups, 1)]
    assemble_unit(unit, parts)
    assert sorted(os.listdir(out)) == [SHARDS[0]]  # the parts are removed
    assemble_unit(unit, parts)  # again, its parts gone
    assert (out / SHARDS[0]).read_bytes() == (whole / SHARDS[0]).read_bytes()


def test_split_shards_on_local_cluster_are_byte_identical(model, client, tmp_path):
    """Several groups per shard, each its own task, assembled: the single-process bytes and rows."""
    root, want = model
    single = quantize_model(root / "src", tmp_path / "single", "q8s", "reference", rules=RULES)
    shards, rows = [], []
    with distributed.get_task_stream(client) as tasks:
        res = quantize_model_distributed(root / "src", tmp_path / "out", "q8s", "reference", rules=RULES,
                                         cluster=client, group_bytes=GROUP, on_tensor=rows.append,
                                         on_shard=lambda name, k, n: shards.append((name, k, n)))
    assert tree(tmp_path / "out") == want  # shards and index; no part file left
    assert repr(res.tensors) == repr(single.tensors)  # (repr: NaN statistics compare equal)
    assert sorted(r.name for r in rows) == sorted(r.name for r in single.tensors)
    assert sorted(s[0] for s in shards) == SHARDS and [s[1:] for s in shards] == [(k, 4) for k in range(1, 5)]
    parts = [t["key"] for t in tasks.data if "-part-" in str(t["key"])]
    assert len(parts) >= 3 * len(SHARDS), parts


def _fail_once_plugin(flag, victim):
    """A worker plugin that raises while tensor `victim` is written, once (the flag file records it)."""

    class FailOnce(distributed.WorkerPlugin):
        def setup(self, worker):
            import qcore.files.stfile as st

            add = st.StreamWriter.add

            def failing_add(writer, name, array):
                if name == victim and not os.path.exists(flag):
                    open(flag, "w").close()
                    raise RuntimeError(f"injected failure writing {name}")
                return add(writer, name, array)

            st.StreamWriter.add = failing_add

    return FailOnce()


def test_killed_or_failing_group_leaves_no_partial_shard(model, client, tmp_path):
    root, want = model
    out = tmp_path / "out"
    killed, failed = str(tmp_path / "killed"), str(tmp_path / "failed")

    def run(**kw):
        return quantize_model_distributed(root / "src", out, "q8s", "reference", rules=RULES, group_bytes=GROUP,
                                          **kw)

    # A worker killed while writing a group's part: the group runs again elsewhere.
    client.register_plugin(_kill_once_plugin(killed, "layers.1.mlp.weight", str(out)), name="kill-group")
    try:
        run(cluster=client)
    finally:
        client.unregister_worker_plugin("kill-group")
    at_kill = open(killed).read().split("\n")
    assert SHARDS[1] not in at_kill  # the part had a temporary name; the shard did not exist yet
    assert any(n.startswith(f".{SHARDS[1]}.part-") and n.endswith(".tmp") for n in at_kill), at_kill
    assert tree(out) == want  # the dead worker's part was removed
    # A group that raises stops the run: no shard is visible half-written; resume finishes it.
    shutil.rmtree(out)
    client.register_plugin(_fail_once_plugin(failed, "layers.1.mlp.weight"), name="fail-group")
    try:
        with pytest.raises(RuntimeError, match="injected failure writing layers.1.mlp.weight"):
            run(cluster=client)
    finally:
        client.unregister_worker_plugin("fail-group")
    got = tree(out)
    assert SHARDS[1] not in got
    assert all(got[n] == want[n] for n in got if n.endswith(".safetensors"))  # what is visible is whole
    res = run(resume=True)  # in this process, group by group
    assert SHARDS[1] not in res.resumed and tree(out) == want


def test_s3_split_shards_byte_identical(model, client, s3, tmp_path):
    """Groups read only their tensors' bytes from S3, and their parts are assembled into the shards."""
    import s3fs

    from qcore.files.stfile import Reader
    from qcore.files.storage import location

    root, want = model
    fs = s3fs.S3FileSystem(**s3)
    fs.mkdir("split")
    fs.put(str(root / "src") + "/", "split/src", recursive=True)
    quantize_model_distributed("s3://split/src", "s3://split/out", "q8s", "reference", rules=RULES,
                               cluster=client, storage_options=s3, group_bytes=11000)  # the first shard splits
    fs.invalidate_cache()
    fs.get("split/out/", str(tmp_path / "got") + "/", recursive=True)
    assert tree(tmp_path / "got") == want
    assert not [k for k in fs.find("split/out") if k.endswith(".tmp")]
    staged = location("s3://split/src", s3).stage_tensors(f"split/src/{SHARDS[1]}", str(tmp_path / "staged"),
                                                          ["layers.1.mlp.weight"])
    with Reader(staged) as part, Reader(root / "src" / SHARDS[1]) as whole:
        assert (part.read("layers.1.mlp.weight") == whole.read("layers.1.mlp.weight")).all()
        assert not part.read("layers.1.attn.weight").any()  # not downloaded: a hole in the sparse file
