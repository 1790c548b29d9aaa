"""qcore.plugins: the discovery both registries share (backends, formats). Each entry point loads
on its own, a fault is one line under the plugin's name, and the table is built once until reset."""
import pytest

from qcore import plugins


class _EP:
    def __init__(self, name, obj):
        self.name, self._obj = name, obj

    def load(self):
        if isinstance(self._obj, BaseException):
            raise self._obj
        return self._obj


class _Thing:
    def __init__(self, name, priority=0):
        self.name, self.priority = name, priority


def _check(obj, origin):
    if not isinstance(obj, _Thing):
        raise TypeError(f"{origin} gave {obj!r}, which lacks {', '.join(plugins.missing(obj, ('name', 'priority')))}")
    return obj


def _table(eps, built=None):
    def discover(table):
        if built is not None:
            built.append(1)
        found = {"core": _Thing("core", 5)}
        for ep, obj in plugins.load_each(eps, table):
            table.add(found, obj, ep.name, "; this one was skipped")
        return found

    return plugins.PluginTable("widget", discover, _check)


def test_each_entry_point_loads_on_its_own_and_faults_are_recorded():
    eps = [_EP("ok", _Thing("ok", 9)), _EP("boom", ImportError("needs libfoo")), _EP("exits", SystemExit(3)),
           _EP("thief", _Thing("core")), _EP("odd", object()), _EP("late", _Thing("late", -1))]
    table = _table(eps)
    assert list(table.table()) == ["core", "ok", "late"]
    errors = table.errors()
    assert errors["boom"] == "ImportError: needs libfoo" and errors["exits"] == "SystemExit: 3"
    assert errors["thief"] == "ValueError: widget name 'core' is already taken; this one was skipped"
    assert errors["odd"].startswith("TypeError: odd gave <object") and "lacks name, priority" in errors["odd"]
    assert [p.name for p in plugins.by_priority(table.table().values())] == ["ok", "core", "late"]
    table.note("ok", "first")
    table.note("ok", "second")
    assert table.errors()["ok"] == "first; second"


def test_keyboard_interrupt_is_not_swallowed():
    with pytest.raises(KeyboardInterrupt):
        _table([_EP("ctrl-c", KeyboardInterrupt())]).table()


def test_built_once_registered_by_hand_and_reset():
    built = []
    table = _table([], built)
    table.table()
    table.table()
    table.register(_Thing("mine"))
    assert "mine" in table.table() and built == [1]
    with pytest.raises(ValueError, match="widget name 'mine' is already taken"):
        table.register(_Thing("mine"))
    with pytest.raises(TypeError, match="register\\(\\) gave"):
        table.register(42)
    table.reset()
    assert "mine" not in table.table() and built == [1, 1]
