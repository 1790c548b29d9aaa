"""qcore.formats registry: built-ins, detection order, the `qcore.formats` entry point group."""
import numpy as np
import pytest
from safetensors.numpy import save_file

import qcore.formats as qf
from qcore.formats import Format, FormatNotFoundError, registry
from qcore import InputError
from qcore.backend.protocol import Support


class Toy(Format):
    """A format recognising files that start with b'TOY!'."""

    name = "toy"
    priority = 50

    def detect(self, probe):
        return probe.magic[:4] == b"TOY!"


class _EP:
    def __init__(self, name, obj, value="pkg:Obj"):
        self.name, self.value, self._obj = name, value, obj

    def load(self):
        if isinstance(self._obj, Exception):
            raise self._obj
        return self._obj


@pytest.fixture
def plugins(monkeypatch):
    """Replace the entry points of the group with a list the test fills, and reload the registry."""
    eps = []
    monkeypatch.setattr(registry, "entry_points", lambda group: list(eps) if group == registry.GROUP else [])
    registry.reset()
    yield eps
    registry.reset()


def test_builtins_in_detection_order():
    assert list(qf.formats()) == ["bitsandbytes", "torchao", "gguf", "compressed-tensors", "fp8", "gpt-oss", "qcore"]
    assert all(f.description for f in qf.formats().values())
    assert [n for n, f in qf.formats().items() if f.writable] == [
        "bitsandbytes", "torchao", "gguf", "compressed-tensors", "fp8", "gpt-oss", "qcore"]


def test_detects_each_kind_of_file(tmp_path):
    save_file({"w": np.zeros(4, np.float32)}, str(tmp_path / "plain.safetensors"))
    (tmp_path / "a.gguf").write_bytes(b"GGUF" + b"\0" * 20)
    (tmp_path / "junk.bin").write_bytes(b"\x01\x02")
    assert qf.detect(tmp_path / "plain.safetensors").name == "qcore"
    assert qf.detect(tmp_path / "a.gguf").name == "gguf"
    with pytest.raises(FormatNotFoundError, match=r"junk.bin: no registered checkpoint format recognises this file"):
        qf.detect(tmp_path / "junk.bin")


def test_unknown_name():
    with pytest.raises(FormatNotFoundError, match=r"no checkpoint format named 'nope'; registered: bitsandbytes, compressed-tensors, fp8, gguf"):
        qf.get("nope")


def test_plugin_from_entry_point_is_found_and_detects(tmp_path, plugins):
    plugins.append(_EP("toy", Toy))
    assert "toy" in qf.formats() and list(qf.formats())[:2] == ["toy", "bitsandbytes"]
    (tmp_path / "m.toy").write_bytes(b"TOY!....")
    assert qf.detect(tmp_path / "m.toy").name == "toy"
    assert not qf.get("toy").writable and not qf.get("toy").check("w", np.zeros(1))


def test_broken_plugins_are_recorded_not_fatal(plugins):
    class Thief(Toy):
        name = "gguf"

    plugins.extend([_EP("bad", ImportError("no module named foo")), _EP("thief", Thief), _EP("empty", object())])
    assert set(qf.formats()) == {"bitsandbytes", "compressed-tensors", "fp8", "gguf", "gpt-oss", "qcore", "torchao"}
    errors = qf.plugin_errors()
    assert errors["bad"] == "ImportError: no module named foo"
    assert errors["thief"] == "ValueError: format name 'gguf' is already taken"
    assert "lacks" in errors["empty"]


def test_register_by_hand(plugins):
    qf.register(Toy())
    assert qf.get("toy").name == "toy"
    with pytest.raises(ValueError, match="already taken"):
        qf.register(Toy())


def test_converting_to_a_read_only_format_is_refused(plugins, tmp_path):
    """A format that only reads (Toy defines no write) is refused as a target before anything is written."""
    qf.register(Toy())
    save_file({"w": np.zeros(4, np.float32)}, str(tmp_path / "a.safetensors"))
    with pytest.raises(qf.UnrepresentableError, match="format 'toy' is read-only in this qcore"):
        qf.convert(tmp_path / "a.safetensors", tmp_path / "o.toy", "toy")
    assert not (tmp_path / "o.toy").exists()


def test_a_format_without_options_names_them():
    with pytest.raises(InputError, match=r"format 'qcore' takes no options"):
        qf.get("qcore").with_options(x="1")


def test_support_reason_of_base_class():
    assert Format().check("w", np.zeros(1)) == Support.no("format '' cannot write files")


def test_gguf_without_the_gguf_package_says_how_to_install(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "gguf", None)      # import gguf -> ImportError
    fmt = qf.get("gguf")
    assert not fmt.available() and "pip install 'qcore-quant[formats]'" in fmt.available().reason
    (tmp_path / "a.gguf").write_bytes(b"GGUF" + b"\0" * 20)
    with pytest.raises(qf.UnrepresentableError, match=r"format 'gguf' is not available: the gguf package is not"):
        qf.convert(tmp_path / "a.gguf", tmp_path / "b.safetensors", "qcore")
