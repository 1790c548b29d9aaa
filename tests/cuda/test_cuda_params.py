"""The cuda kernels' parameter arrays, each declared once as a table (`qcore_cuda._params.ParamLayout`):
the index constants the kernels read, the host packing by field name and the signature types
all come from it."""
from __future__ import annotations

import numpy as np
import pytest

from qcore_cuda._params import ParamLayout


def _modules_and_layouts():
    """(module, its layouts) for every module that declares parameter arrays."""
    from qcore_cuda import fast, gemv, k_decode, layouts, linear

    return [(layouts, [layouts.P_LAYOUT, layouts.F_LAYOUT, layouts.RP_LAYOUT, layouts.TP_LAYOUT, layouts.MQ_LAYOUT,
                       layouts.OR_LAYOUT]),
            (fast, [fast.G_LAYOUT, fast.C_LAYOUT]), (gemv, [gemv.Q_LAYOUT]), (linear, [linear.LP_LAYOUT]),
            (k_decode, [k_decode.DL_LAYOUT])]


def test_each_layout_defines_its_index_constants_as_ints_in_its_module():
    """The constants the kernels read (numba folds module-level ints in) are the table's indices:
    fields in order, an array field spanning its entries, the length after them (or more:
    padding)."""
    for module, lays in _modules_and_layouts():
        for lay in lays:
            at = 0
            for f in lay.fields:
                value = getattr(module, f.name)
                assert type(value) is int and value == at, (lay.name, f.name, value, at)
                at += f.count
            assert getattr(module, lay.length_name) == lay.length >= at, lay.name


def test_no_two_layouts_share_a_constant_name():
    """A name means one index of one array (linear's were P_*, as the general kernels' P; now LP_*)."""
    seen: dict[str, str] = {}
    for _, lays in _modules_and_layouts():
        for lay in lays:
            for name in [f.name for f in lay.fields] + [lay.length_name]:
                assert name not in seen, f"{name} is in {seen.get(name)} and {lay.name}"
                seen[name] = lay.name
    assert len(seen) > 120


def test_the_known_lengths_and_padding_are_kept():
    """The arrays keep their sizes (F, TP and MQ end in three entries of zero padding)."""
    from qcore_cuda import fast, gemv, layouts, linear

    got = {lay.name: lay.length for _, lays in _modules_and_layouts() for lay in lays}
    assert got == {"P": 28 + 6 * layouts.MAXR, "F": 8, "RP": 16, "TP": 20, "MQ": 24, "OR": 16, "G": 10, "C": 4,
                   "Q": 8, "LP": 10, "DL": 9}
    assert (fast.G_LAYOUT.arg, fast.C_LAYOUT.arg, gemv.Q_LAYOUT.arg) == ("int64[::1]", "float32[::1]",
                                                                          "UniTuple(int64, 8)")
    assert linear.LP_LAYOUT.arg == "int64[::1]"


def test_pack_sets_fields_by_name_and_refuses_any_other():
    lay = ParamLayout("X", "int64", [("X_A", "a"), ("X_S", 3, "three entries"), ("X_B", "b")], length=7,
                      length_name="X_LEN")
    got = lay.pack(X_B=5, X_S=[1, 2], X_A=True)
    assert got.dtype == np.int64 and got.tolist() == [1, 1, 2, 0, 5, 0, 0]
    again = lay.replace(got, X_S=[9, 9, 9])
    assert again.tolist() == [1, 9, 9, 9, 5, 0, 0] and got.tolist() == [1, 1, 2, 0, 5, 0, 0]  # (a copy)
    with pytest.raises(TypeError, match="parameter layout X has no field X_C"):
        lay.pack(X_C=1)
    with pytest.raises(ValueError, match=r"X.X_S holds 3 entries, got 4"):
        lay.pack(X_S=[1, 2, 3, 4])
    f = ParamLayout("Y", "float32", [("Y_H", "h")], length_name="Y_LEN").pack(Y_H=0.1)
    assert f.dtype == np.float32 and f[0] == np.float32(0.1)  # (rounded to the array's type, as a store)


def test_define_refuses_a_name_bound_to_another_value():
    lay = ParamLayout("X", "int64", [("X_A", "a"), ("X_B", "b")], length_name="X_LEN")
    ns = {"X_A": 0}
    lay.define(ns)
    assert ns == {"X_A": 0, "X_B": 1, "X_LEN": 2}
    with pytest.raises(ValueError, match="X_B is already 7 here; layout X wants 1"):
        lay.define({"X_B": 7})
    with pytest.raises(ValueError, match="names X_A twice"):
        ParamLayout("X", "int64", [("X_A", "a"), ("X_A", "b")], length_name="X_LEN")


def test_signatures_spell_the_arrays_as_their_layouts_do():
    """The general kernels' signatures take each parameter array in its layout's type."""
    from qcore_cuda import kernels as K

    assert K.SIGNATURES["k_quant"][0].startswith(f"void(float32[::1], {K.P_LAYOUT.arg}, {K.F_LAYOUT.arg},")
    assert f", {K.MQ_LAYOUT.arg}, " in K.SIGNATURES["k_matmul"][0]
    assert K.SIGNATURES["k_reorder"] == [f"void(uint8[::1], uint8[::1], {K.OR_LAYOUT.arg})"]
