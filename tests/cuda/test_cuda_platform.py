"""The `cuda` backend as installed: entry point, availability without a GPU, the sm_89 gate of
the fast kernels, and every kernel compiled to PTX for sm_90 (no driver needed)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

import qcore
from tests.paths import ROOT


def test_registered_through_entry_point(cuda_backend):
    """`cuda` is found through the `qcore` entry point group, priority 30, and `auto` picks it for
    the schemes it supports but not for LOOKUP; under numba's CUDA simulator it says so, and
    `auto` takes a CPU backend first (the simulator is minutes slower)."""
    from numba import config

    assert "cuda" in qcore.backends()
    be = qcore.backend("cuda")
    assert be.priority == 30 and be.available()
    assert be.simulated is bool(config.ENABLE_CUDASIM)
    auto = qcore.backend("auto")
    assert auto.pick("q4s/block32:f16").name == ("reference" if be.simulated else "cuda")
    assert auto.pick("nf4").name != "cuda"


def test_unavailable_without_gpu_or_simulator():
    """With CUDA disabled, the backend reports unavailable (never raises) and says why; using it
    raises BackendUnavailableError."""
    code = textwrap.dedent("""
        import numpy as np, qcore
        from qcore_cuda import CudaBackend
        be = CudaBackend()
        assert be.available() is False, be.describe()
        print("WHY:", be.describe())
        try:
            be.quantize(np.ones(4, np.float32), "q8s")
        except qcore.BackendUnavailableError as e:
            print("RAISED:", e)
    """)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["NUMBA_DISABLE_CUDA"] = "1"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "WHY:" in out.stdout and "NUMBA_DISABLE_CUDA" in out.stdout
    assert "RAISED: backend 'cuda' is not available" in out.stdout


PTX_PARTS = 4  # the compile list in parts of about equal cost, so parallel test workers share it
PTX_COST = {"k_wide_quant_quads_fast": 42.6, "k_wide_quant": 24.5, "k_wide_quant_fast": 18.8, "k_tc": 4.4,
            "k_gemv": 3.7, "k_frag": 3.7, "k_linear": 3.5, "k_decode_linear": 3.3, "k_decode_mma": 3.3,
            "k_fast_quant": 2.4, "k_wide_stats": 2.4, "k_scales": 1.8, "k_matmul": 1.5, "k_tile_quant": 1.4,
            "k_quant": 1.3, "k_quant_fused": 1.2, "k_convert_f16": 1.1}
"""Seconds of NVVM time per kernel by family (its variants' mean), from one single-process compile of
the default set on the 2-core CI machine kind (2026-12-07: 197 s in all; others 0.9 s or less, 0.5
assumed; k_wide_quant: its one sm_75 compile): `_ptx_parts` uses them only to balance the parts."""
ONE_FOR_ALL = {"k_wide_quant_quads_fast": "e4m3"}
"""Generated families of which the default set compiles one variant (the value named): their
variants differ only in device code that another kernel of the set compiles for every value. The
16-byte W8A8 quantize's variants per value kind differ in their pair coder alone (`fast.pair_int8`,
the E4M3 and E5M2 conversions), which `k_wide_quant_fast` compiles for every kind; e4m3 is W8A8's."""
PTX_ALL = os.environ.get("QCORE_PTX_ALL", "") not in ("", "0")
"""Compile every variant of the generated kernels; by default a covering set of them (below)."""

_COMPILE_PART = textwrap.dedent("""
    import json, sys
    names = set(json.loads(sys.argv[1]))
    try:
        from qcore_cuda import ptx as P
        n = 0
        newer = ("e4m3x2", "e5m2x2", "max.NaN")  # sm_89 FP8 conversions, sm_80 max.NaN
        for t in P.targets():
            name = t.name
            if name not in names:
                continue
            n += 1
            if t.general and name.endswith("#0"):  # the general kernels are the path of GPUs below 8.9:
                # nothing newer than sm_75 (checked on each one's first signature, compiled for
                # sm_75 alone: the same lowering; the others differ only in array dtypes, which
                # pull in no newer instruction, and compile for sm_90)
                ptx75 = P.to_ptx(t, cc=(7, 5))
                for f in newer:
                    if f in ptx75:
                        print("NEEDS_NEWER_GPU", name, f)
            elif "e4m3x2" in P.to_ptx(t, cc=(9, 0)):
                print("FP8", name)
    except Exception as e:
        if "DynamicLibNotFoundError" in type(e).__name__ or "libnvrtc" in str(e) or "libnvvm" in str(e):
            print("NOLIBS:", type(e).__name__, e)
            sys.exit(3)
        raise
    print("COMPILED", n)
""")


KIND_FAMILIES = ("k_fast_dequant", "k_gemv", "k_tc")
"""Generated kernels whose first parameter is the value kind they decode: the decoding is the
fast module's device code, the same in each, so a kind compiled in one of them counts for all
(the fast dequantize kernels compile every kind)."""


def _param_keys(name: str) -> set[tuple[str, int, str]]:
    family, params = name[:-1].split("[")
    return {("kind" if i == 0 and family in KIND_FAMILIES else family, i, v)
            for i, v in enumerate(params.split(","))}


def _covering(names: list[str]) -> list[str]:
    """The generated variants `name[p0,p1,...]` cut to a set in which every value of every
    template parameter still appears at least once, and every family: family by family, the
    variants of one parameter (a kernel per kind: every kind in the fast kernels) all stay, then
    the variant that adds the most values not yet kept, until none adds one (GEMV 41 variants ->
    4, the decode kernel 78 -> 8); plain kernels (`name#signature`) all stay. Each variant costs
    seconds of NVVM time: CI compiles this set, a run with QCORE_PTX_ALL=1 all of them. A family of
    `ONE_FOR_ALL` keeps its one variant."""
    seen: set[tuple[str, int, str]] = set()
    keep = [n for n in names if "[" not in n]
    families: dict[str, list[str]] = {}
    for name in names:
        if "[" in name:
            families.setdefault(name.split("[")[0], []).append(name)
    for family, group in families.items():
        if family in ONE_FOR_ALL:
            keep.append(f"{family}[{ONE_FOR_ALL[family]}]")
            continue
        start = len(keep)
        single = [n for n in group if "," not in n]
        for name in single:
            seen |= _param_keys(name)
        keep += single
        left = [n for n in group if "," in n]
        while left:
            best = max(left, key=lambda n: len(_param_keys(n) - seen))  # (ties: the first listed)
            if not _param_keys(best) - seen and len(keep) > start:
                break  # (a family's first variant stays even where its values are all kept)
            seen |= _param_keys(best)
            keep.append(best)
            left.remove(best)
    return keep


def _ptx_names() -> list[str]:
    from qcore_cuda import ptx

    names = [t.name for t in ptx.targets()]
    return names if PTX_ALL else _covering(names)


def _ptx_cost(name: str) -> float:
    """A kernel's compile cost by its family (`PTX_COST`, else 0.5 s)."""
    return PTX_COST.get(re.split(r"[\[#]", name)[0], 0.5)


def _ptx_parts(names: list[str], parts: int = PTX_PARTS) -> list[list[str]]:
    """`names` in `parts` lists of about equal compile cost (`_ptx_cost`; longest first, each to
    the cheapest part so far)."""
    out: list[list[str]] = [[] for _ in range(parts)]
    load = [0.0] * parts
    for name in sorted(names, key=_ptx_cost, reverse=True):
        i = load.index(min(load))
        out[i].append(name)
        load[i] += _ptx_cost(name)
    return out


def test_ptx_parts_cover_the_list_once():
    """Every kernel of the compile list lands in exactly one part, and no part costs more than
    the cheapest by more than the dearest single kernel."""
    names = _ptx_names()
    parts = _ptx_parts(names)
    assert sorted(n for p in parts for n in p) == sorted(names)
    costs = [sum(_ptx_cost(n) for n in p) for p in parts]
    assert max(costs) - min(costs) <= max(PTX_COST.values())


def test_ptx_covering_set_keeps_every_parameter_value():
    """The default compile set holds every kernel, and every value each template parameter of a
    generated kernel takes in the full list (a family of `ONE_FOR_ALL`: its one variant)."""
    from qcore_cuda import ptx

    full = [t.name for t in ptx.targets()]
    cut = _covering(full)
    assert len(cut) < len(full)

    def params(names):
        return set().union(*(_param_keys(n) for n in names if "[" in n and n.split("[")[0] not in ONE_FOR_ALL))

    assert params(cut) == params(full)
    assert {n for n in cut if n.split("[")[0] in ONE_FOR_ALL} == {f"{f}[{v}]" for f, v in ONE_FOR_ALL.items()}
    assert {n.split("[")[0] for n in cut} == {n.split("[")[0] for n in full}
    kinds = {n[:-1].split("[")[1].split(",")[0] for n in full if n.startswith("k_fast_quant[")}
    fast = {n for n in cut if n.startswith("k_fast_")}
    assert {n for n in fast if "," not in n} == {f"k_fast_{op}[{k}]" for op in ("quant", "dequant") for k in kinds}
    assert any(n.endswith(",bf16]") for n in fast)  # the bfloat16 store once (its decode is the kind's, above)


@pytest.mark.parametrize("part", range(PTX_PARTS))
def test_kernels_compile_for_sm90(part):
    """Every kernel (the general ones with every signature the backend launches; the generated
    variants as `_covering`'s set, or all with QCORE_PTX_ALL=1), in `_ptx_parts`' parts, compiled to
    PTX for sm_90 by the real (non-simulator) numba target: catches what the simulator lets
    through (float16 atomics, NumPy ufuncs in kernels, int/float promotion). The general kernels
    compile with their first signature for sm_75 instead, without sm_80/sm_89 instructions
    (they are the path of older GPUs);
    the fast E4M3 kernels do use the FP8 conversion (which is why they are gated). Needs the
    NVRTC and NVVM libraries (`pip install "qcore-cuda[ptx]"`), no GPU. Skips without them,
    fails under QCORE_REQUIRE_PTX=1."""
    import json

    from qcore_cuda import fast as F

    mine = _ptx_parts(_ptx_names())[part]
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    out = subprocess.run([sys.executable, "-c", _COMPILE_PART, json.dumps(mine)], env=env,
                         capture_output=True, text=True, timeout=600)
    if out.returncode == 3:
        reason = f"NVRTC/NVVM libraries missing (pip install qcore-cuda[ptx]): {out.stdout.strip()[:300]}"
        if os.environ.get("QCORE_REQUIRE_PTX", "") not in ("", "0"):
            pytest.fail(reason + " (QCORE_REQUIRE_PTX=1)")
        pytest.skip(reason)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"COMPILED {len(mine)}" in out.stdout
    assert "NEEDS_NEWER_GPU" not in out.stdout, out.stdout
    e4m3 = f"k_fast_quant[{F.KIND_E4M3}]"
    if e4m3 in mine:
        assert f"FP8 {e4m3}" in out.stdout, out.stdout


def test_kernel_stats_sizes_kernels_without_a_gpu(tmp_path):
    """scripts/kernel_stats.py (over `qcore_cuda.ptx`): registers, spill bytes and SASS
    instructions of kernels, from numba's PTX assembled by CUDA's ptxas, no GPU. Checked on the
    max pass and the E2M1 quantize kernel, whose sizes differ by an order of magnitude."""
    import json
    from pathlib import Path

    from qcore_cuda import ptx

    if ptx.find_ptxas() is None:
        pytest.skip("no ptxas on this machine (CUDA's toolkit): kernel_stats needs it")
    script = ROOT / "scripts" / "kernel_stats.py"
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    out = subprocess.run([sys.executable, str(script), "^k_amax$", r"^k_fast_quant\[5\]$", "--json",
                          str(tmp_path / "s.json")], env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0 and ("libnvvm" in out.stderr or "libnvrtc" in out.stderr):
        if os.environ.get("QCORE_REQUIRE_PTX", "") not in ("", "0"):
            pytest.fail("NVRTC/NVVM libraries missing (QCORE_REQUIRE_PTX=1)")
        pytest.skip("NVRTC/NVVM libraries missing (pip install qcore-cuda[ptx])")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {r["kernel"]: r for r in json.loads((tmp_path / "s.json").read_text())["kernels"]}
    assert set(rows) == {"k_amax", "k_fast_quant[5]"}, out.stdout
    assert all(r["registers"] > 0 and r["spill_bytes"] >= 0 for r in rows.values()), rows
    assert 10 * rows["k_amax"]["instructions"] < rows["k_fast_quant[5]"]["instructions"], rows
    assert "k_fast_quant[5]" in out.stdout and "SASS instructions" in out.stdout


def test_kernel_stats_lists_loops_and_sass(tmp_path):
    """scripts/kernel_stats.py --loops --sass (nvdisasm, from `qcore-cuda[ptx]`): the max pass's
    grid-stride loop shows its 16-byte loads and its max instructions, and its listing is written."""
    from pathlib import Path

    from qcore_cuda import ptx

    if ptx.find_ptxas() is None:
        pytest.skip("no ptxas on this machine (CUDA's toolkit): kernel_stats needs it")
    if ptx.find_tool("nvdisasm") is None:
        if os.environ.get("QCORE_REQUIRE_PTX", "") not in ("", "0"):
            pytest.fail("nvdisasm missing (QCORE_REQUIRE_PTX=1; qcore-cuda[ptx] installs nvidia-cuda-nvdisasm)")
        pytest.skip("no nvdisasm (pip install nvidia-cuda-nvdisasm)")
    script = ROOT / "scripts" / "kernel_stats.py"
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    out = subprocess.run([sys.executable, str(script), "^k_amax$", "--loops", "--sass", str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0 and ("libnvvm" in out.stderr or "libnvrtc" in out.stderr):
        if os.environ.get("QCORE_REQUIRE_PTX", "") not in ("", "0"):
            pytest.fail("NVRTC/NVVM libraries missing (QCORE_REQUIRE_PTX=1)")
        pytest.skip("NVRTC/NVVM libraries missing (pip install qcore-cuda[ptx])")
    assert out.returncode == 0, out.stderr[-3000:]
    loops = [line for line in out.stdout.splitlines() if line.strip().startswith("loop 0x")]
    assert any("LDG" in line and "FMNMX" in line for line in loops), out.stdout
    assert "LDG.E.128" in (tmp_path / "k_amax.sass").read_text()


def test_sass_loops_reads_labels_and_addresses():
    """`ptx.sass_loops`: a backward branch to a label or to an address spans a loop (innermost
    first); forward branches and the trap after the exit do not."""
    from qcore_cuda.ptx import sass_loops

    listing = """
        /*0000*/                   S2R R0, SR_TID.X ;
        /*0010*/               @P0 BRA `(.L_x_1) ;
.L_x_0:
        /*0020*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0030*/                   FMNMX R8, |R4|, R8, !PT ;
        /*0040*/                   FFMA R9, R5, R6, R9 ;
        /*0050*/               @P1 BRA 0x40 ;
        /*0060*/              @!P2 BRA `(.L_x_0) ;
.L_x_1:
        /*0070*/                   EXIT ;
.L_x_2:
        /*0080*/                   BRA `(.L_x_2) ;
"""
    loops = sass_loops(listing)
    assert [(lp.start, lp.end, lp.instructions) for lp in loops] == [(0x40, 0x50, 2), (0x20, 0x60, 5)]
    assert loops[1].opcodes == {"LDG": 1, "FMNMX": 1, "FFMA": 1, "BRA": 2}


@pytest.mark.parametrize("cc, env, usable", [((9, 0), None, True), ((8, 9), "1", True), ((12, 0), "", True),
                                             ((8, 6), None, False), ((8, 0), None, False), ((7, 5), None, False),
                                             ((9, 0), "0", False), (None, None, True), (None, "0", False)])
def test_fast_kernels_need_sm89(cc, env, usable):
    """The fast kernels use sm_89+ FP8 conversions: older GPUs (A100 = 8.0, T4 = 7.5) and
    QCORE_CUDA_FAST=0 get the general kernels, and the reason says which; the simulator (cc None)
    runs the fast kernels' twins."""
    from qcore_cuda.backend import fast_verdict

    ok, why = fast_verdict(cc, env)
    assert ok is usable
    if not usable:
        assert why.startswith("general kernels only")
        if env != "0":
            assert f"{cc[0]}.{cc[1]}" in why and "8.9" in why
