"""benchmarks/matmul.py judges its targets from the cells it measured, and benchmarks/linear_tune.py
plans and tabulates its runs (no GPU: synthetic cells)."""
import argparse
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _bench(name):
    """The benchmark script `benchmarks/<name>.py` as a module (its folder on sys.path while imported)."""
    import importlib

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


@pytest.fixture(scope="module")
def matmul():
    return _bench("matmul")


def _cell(case, scheme, m, us, **ratios):
    return {"case": case, "scheme": scheme, "shape": "8192x8192", "m": m, "us": us, "ratios": ratios, "error": None}


def _target(matmul, cells, name):
    return next(t for t in matmul.evaluate_targets(cells, ["nvfp4"]) if t["name"] == name)


def test_the_orientation_target_compares_linear_with_the_kn_matmul(matmul):
    """`nk_not_slower`: met where every plain linear cell measured is at least as fast as its
    scheme's [K, N] matmul, missed where one is slower, not measured without `--orientation`;
    it reads every M the run measured, and leaves the torch targets to their own ratio."""
    cells = [_cell("linear", "nvfp4", 1, 20.0, vs_torch_bf16=2.0, vs_kn_matmul=1.5),
             _cell("linear", "nvfp4", 256, 100.0, vs_torch_bf16=0.5, vs_kn_matmul=1.0)]
    t = _target(matmul, cells, "nk_not_slower")
    assert t["status"] == "met" and t["m"] == [1, 256] and t["ratio"] == "vs_kn_matmul"
    assert {f["m"] for f in t["figures"]} == {1, 256} and t["worst"]["ratio"] == 1.0
    assert "status_out" not in t
    cells[1]["ratios"]["vs_kn_matmul"] = 0.98
    assert _target(matmul, cells, "nk_not_slower")["status"] == "missed"
    for c in cells:
        del c["ratios"]["vs_kn_matmul"]
    assert _target(matmul, cells, "nk_not_slower")["status"] == "not measured"
    assert _target(matmul, cells, "4bit_m1")["worst"]["ratio"] == 2.0


def test_a_target_of_no_measured_cell_is_not_measured(matmul):
    """A run without the cells a target reads (W8A8 alone: no weight-only `linear`, no `[K, N]`
    matmul) leaves those targets not measured, not met."""
    cells = [_cell("w8a8", matmul.W8A8, 1024, 100.0, vs_torch_bf16=1.5)]
    assert _target(matmul, cells, "nk_not_slower")["status"] == "not measured"
    assert _target(matmul, cells, "w8a8_large_m")["status"] == "not measured"  # (the other shapes: not run)


def test_orientation_adds_one_kn_case_per_scheme(matmul):
    names = matmul.case_names(["q4s/block32:f16", "nvfp4"], ["torch_bf16"], orientation=True)
    assert [n[3] for n in names if n[0] == "matmul_kn"] == ["q4s/block32:f16 [K, N] matmul", "nvfp4 [K, N] matmul"]
    assert not [n for n in matmul.case_names(["nvfp4"], ["torch_bf16"]) if n[0] == "matmul_kn"]


def test_f16_adds_one_float16_case_per_scheme_and_the_fp16_peer(matmul):
    names = matmul.case_names(["q4s/block32:f16", "nvfp4"], ["torch_bf16"], f16=True)
    assert [n[3] for n in names if n[0] == "linear_f16"] == ["q4s/block32:f16 f16 x", "nvfp4 f16 x"]
    assert not [n for n in matmul.case_names(["nvfp4"], ["torch_bf16"]) if n[0] == "linear_f16"]
    args = matmul.argparse.Namespace(shapes="8192x8192", m="16", schemes="nvfp4", peers="torch_bf16", quick=False,
                                     f16=True)
    assert matmul.plan(args)[3] == ["torch_bf16", "torch_fp16"]


@pytest.fixture(scope="module")
def linear_tune():
    return _bench("linear_tune")


def test_linear_tune_runs_each_variant_in_its_own_environment(linear_tune, tmp_path):
    """benchmarks/linear_tune.py: a matmul.py run per variant with the kernel's tuning variable
    (the tensor-core runs with the decode path off, the fused GEMM's on from one row for every kind, or `off`),
    and a table of each run's own ratios."""
    plan = linear_tune.runs(argparse.Namespace(
        out=str(tmp_path), decode=["8,4,2"], tc=["8,8"], fused=["off", "128,128,32,8,3,2"], decode_m="1", tc_m="1,16",
        fused_m="256", shapes="8192x8192", schemes="nvfp4", reps=10, budget_s=50.0, f16=False))
    assert [(r["kernel"], r["env"]) for r in plan] == [
        ("decode", {"QCORE_CUDA_DECODE_TUNE": "8,4,2", "NUMBA_ENABLE_CUDASIM": "0"}),
        ("tc", {"QCORE_CUDA_LINEAR_TUNE": "8,8", "NUMBA_ENABLE_CUDASIM": "0", "QCORE_CUDA_LINEAR_DECODE_M": "0"}),
        ("fused", {"NUMBA_ENABLE_CUDASIM": "0", "QCORE_CUDA_LINEAR_FUSED_M": "0"}),
        ("fused", {"QCORE_CUDA_FUSED_TUNE": "128,128,32,8,3,2", "NUMBA_ENABLE_CUDASIM": "0",
                   "QCORE_CUDA_LINEAR_FUSED_M": "1", "QCORE_CUDA_LINEAR_FUSED_KINDS": "all"})]
    assert plan[3]["cmd"][plan[3]["cmd"].index("--m") + 1] == "256"
    assert plan[1]["out"].endswith("tc-8-8") and plan[1]["cmd"][plan[1]["cmd"].index("--m") + 1] == "1,16"
    cells = [{"case": "linear", "scheme": "nvfp4", "shape": "8192x8192", "m": 1, "ratios": {"vs_torch_bf16": 1.5}},
             {"case": "linear_out", "scheme": "nvfp4", "shape": "8192x8192", "m": 1, "ratios": {"vs_torch_bf16": 9.0}},
             {"case": "peer", "scheme": None, "shape": "8192x8192", "m": 1, "ratios": {"vs_torch_bf16": 1.0}}]
    got = linear_tune.ratios({"cells": cells})
    assert got == {("nvfp4", "8192x8192", 1): 1.5}
    text = linear_tune.tables([{**plan[0], "rc": 0, "ratios": got}, {**plan[1], "rc": 1, "ratios": {}}])
    assert "8,4,2" in text and "1.50x" in text and "(rc 1)" in text.splitlines()[-1]


def test_linear_tune_runs_only_the_kernels_named(linear_tune, tmp_path, capsys):
    """Without --decode, --tc or --fused the decode and tensor-core defaults run; naming one kernel
    runs that kernel's variants alone (`--dry-run` lists the runs)."""
    def listed(*argv):
        assert linear_tune.main(["--out", str(tmp_path), "--dry-run", *argv]) == 0
        return [line for line in capsys.readouterr().out.splitlines() if line.strip()]

    everything = listed()
    assert len(everything) == len(linear_tune.DECODE_VARIANTS) + len(linear_tune.TC_VARIANTS)
    fused = listed("--fused", "off", "64,256,64,8,4,3")
    assert len(fused) == 2 and all("QCORE_CUDA_LINEAR_FUSED_M=" in line for line in fused)
    assert not any("QCORE_CUDA_DECODE_TUNE" in line or "QCORE_CUDA_LINEAR_TUNE" in line for line in fused)
    assert listed("--tc", "8,4") == [line for line in everything if "QCORE_CUDA_LINEAR_TUNE=8,4 " in line]


def test_linear_tune_fields_past_a_tuning_set_their_own_variables(linear_tune, tmp_path):
    """A decode variant's fourth field is the register cap (`QCORE_CUDA_DECODE_REGS`), its fifth
    the staging order; a tensor-core variant's third the tiles of w a
    warp (`QCORE_CUDA_LINEAR_TILES`), its fourth the rows of its wide form (`QCORE_CUDA_LINEAR_WIDE`),
    its fifth the register cap (`QCORE_CUDA_LINEAR_REGS`); a field past those is a one-line error."""
    plan = linear_tune.runs(argparse.Namespace(
        out=str(tmp_path), decode=["4,2,2,80", "8,4,2,128,0"], tc=["8,4,2", "8,4,0,0", "8,2,0,4,80"], fused=[], decode_m="1", tc_m="16",
        fused_m="256", shapes="8192x8192", schemes="nvfp4", reps=10, budget_s=50.0, f16=False))
    assert plan[0]["env"] == {"QCORE_CUDA_DECODE_TUNE": "4,2,2", "QCORE_CUDA_DECODE_REGS": "80",
                              "NUMBA_ENABLE_CUDASIM": "0"}
    assert plan[1]["env"] == {"QCORE_CUDA_DECODE_TUNE": "8,4,2", "QCORE_CUDA_DECODE_REGS": "128",
                              "QCORE_CUDA_DECODE_LANES": "0",
                              "NUMBA_ENABLE_CUDASIM": "0"}
    assert plan[2]["env"] == {"QCORE_CUDA_LINEAR_TUNE": "8,4", "QCORE_CUDA_LINEAR_TILES": "2",
                              "NUMBA_ENABLE_CUDASIM": "0", "QCORE_CUDA_LINEAR_DECODE_M": "0"}
    assert plan[3]["env"] == {"QCORE_CUDA_LINEAR_TUNE": "8,4", "QCORE_CUDA_LINEAR_TILES": "0",
                              "QCORE_CUDA_LINEAR_WIDE": "0", "NUMBA_ENABLE_CUDASIM": "0",
                              "QCORE_CUDA_LINEAR_DECODE_M": "0"}
    assert plan[4]["env"] == {"QCORE_CUDA_LINEAR_TUNE": "8,2", "QCORE_CUDA_LINEAR_TILES": "0",
                              "QCORE_CUDA_LINEAR_WIDE": "4", "QCORE_CUDA_LINEAR_REGS": "80",
                              "NUMBA_ENABLE_CUDASIM": "0", "QCORE_CUDA_LINEAR_DECODE_M": "0"}
    assert plan[0]["out"].endswith("decode-4-2-2-80")
    with pytest.raises(SystemExit, match="at most 5 fields"):
        linear_tune.runs(argparse.Namespace(
            out=str(tmp_path), decode=["8,4,2,128,1,0"], tc=[], fused=[], decode_m="1", tc_m="16", fused_m="256",
            shapes="8192x8192", schemes="nvfp4", reps=10, budget_s=50.0, f16=False))
    with pytest.raises(SystemExit, match="at most 5 fields"):
        linear_tune.runs(argparse.Namespace(
            out=str(tmp_path), decode=[], tc=["8,4,0,0,128,1"], fused=[], decode_m="1", tc_m="16", fused_m="256",
            shapes="8192x8192", schemes="nvfp4", reps=10, budget_s=50.0, f16=False))


def test_linear_tune_f16_times_float16_x_against_torch_fp16(linear_tune, tmp_path):
    """`--f16`: each run passes --f16 to matmul.py, and the tables read the float16-x case's ratio
    to torch fp16."""
    plan = linear_tune.runs(argparse.Namespace(
        out=str(tmp_path), decode=[], tc=[], fused=["off"], decode_m="1", tc_m="1", fused_m="1024",
        shapes="8192x8192", schemes="q4s/block32:f16", reps=10, budget_s=50.0, f16=True))
    assert plan[0]["cmd"][-1] == "--f16"
    cells = [{"case": "linear", "scheme": "q4s/block32:f16", "shape": "8192x8192", "m": 1024,
              "ratios": {"vs_torch_bf16": 0.7, "vs_torch_fp16": 0.7}},
             {"case": "linear_f16", "scheme": "q4s/block32:f16", "shape": "8192x8192", "m": 1024,
              "ratios": {"vs_torch_bf16": 0.5, "vs_torch_fp16": 0.49}}]
    assert linear_tune.ratios({"cells": cells}, f16=True) == {("q4s/block32:f16", "8192x8192", 1024): 0.49}
    assert "torch fp16, float16 x" in linear_tune.tables([{**plan[0], "rc": 0, "ratios": {}}], f16=True)
