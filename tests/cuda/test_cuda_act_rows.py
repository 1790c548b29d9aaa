"""W8A8's x quantized per row by Triton (`qcore_cuda.act_rows`, `k_act`): its bytes are the
reference's quantize of `x.float()` under `e4m3/block{K}:f32`, row by row. Without a GPU the kernel
runs in Triton's interpreter (tests/conftest.py sets `TRITON_INTERPRET`) on CPU tensors, coding on
the bits; on a GPU the same test runs the compiled kernel (`cvt.rn.satfinite`)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from qcore.backend.reference import ReferenceBackend
from qcore.spec.payload import sections
from qcore.spec.schemes import scheme as parse_scheme

from tests.cuda_cases import SIM
from tests.optional import need

torch = need("torch", "the kernel takes torch tensors")
need("triton", "the kernel is a Triton kernel")

REF = ReferenceBackend()


def _rows(k: int, seed: int) -> np.ndarray:
    """Rows of bfloat16 values (as f32) that reach every branch of the code: magnitudes 2**+-30,
    an all-zero row, a row of -0 and one tiny value (codes of signed zeros), subnormal codes and
    their ties, values at and past 448, a NaN row, an infinity row."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((10, k)) * np.exp2(rng.integers(-30, 31, (10, 1)))).astype(np.float32)
    x[1] = 0.0
    x[2] = -0.0
    x[2, 3] = 1e-30
    x[3, k // 2] = np.inf
    x[4, 1] = np.nan
    x[5] = rng.standard_normal(k) * 1e-3
    x[5, 0] = 448 * 2.0 ** -6 * 3  # (most codes subnormal)
    x[6, :4] = [448.0, 464.0, 462.0, -440.0]
    x[7] = np.arange(k) % 17 * 2.0 ** -9  # (a scale of 2**-9 / 448 * 16: subnormal ties)
    x[7, 0] = 16 * 2.0 ** -9
    return x.astype(ml_dtypes.bfloat16).astype(np.float32)


@pytest.mark.parametrize("k", [48, 256, 8192])  # (a block past the row; a power of two; the longest row taken)
def test_codes_and_scales_are_the_references_row_by_row(k):
    from qcore_cuda import act_rows

    x = _rows(k, k)
    dev = "cpu" if SIM else "cuda"
    xt = torch.from_numpy(x.astype(ml_dtypes.bfloat16).view(np.uint16).view(np.int16)).view(torch.bfloat16).to(dev)
    codes, scales = act_rows.ActRows(k, 448.0)(xt)
    assert codes.dtype == torch.float8_e4m3fn and tuple(codes.shape) == (len(x), k) and scales.dtype == torch.float32
    codes = codes.view(torch.uint8).cpu().numpy()
    scales = scales.cpu().numpy()
    text = f"e4m3/block{k}:f32"
    for r, row in enumerate(x):
        if not np.isfinite(row).all():  # (docs/spec.md, quantized activations: a NaN scale, codes 0)
            assert np.isnan(scales[r]) and not codes[r].any(), r
            continue
        q = REF.quantize(row[None], text)
        payload = np.frombuffer(q.to_data().payload, np.uint8)
        sec = sections(q.shape, q.scheme)
        assert np.array_equal(codes[r], payload[:k]), r
        assert scales[r:r + 1].tobytes() == payload[sec.values:sec.values + 4].tobytes(), r


@pytest.mark.parametrize("text,k,takes", [("e4m3/block64:f32", 64, True), ("e4m3/block64:f32/round:rne", 64, True),
                                          ("e4m3/block9000:f32", 9000, False), ("q8_0", 32, False),
                                          ("q4f/block32:f16/signed", 32, False)])
def test_the_kernel_takes_the_plain_rules_and_rows_it_holds(text, k, takes):
    """Round-up or nearest f32 scales of the maximum over h, codes by division, rows of at most
    `MAX_K`; not llama.cpp's code rules or signed scales."""
    from qcore_cuda import act_rows

    assert act_rows.takes(parse_scheme(text), k) is takes


_COMPILE = r"""
import json, sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from qcore_cuda import act_rows, k_act

out = []
for k in json.loads(sys.argv[1]):
    c = act_rows.ActRows(k, 448.0).const
    const = {"BLOCK": c["BLOCK"], "INTERPRETED": False}
    sig = {"x_ptr": "*bf16", "codes_ptr": "*fp8e4nv", "scales_ptr": "*fp32", "K": "i32", "h": "fp32"}
    src = ASTSource(fn=k_act.act_rows_e4m3, signature={**sig, **{n: "constexpr" for n in const}}, constexprs=const,
                    attrs={(i,): [["tt.divisibility", 16]] for i in range(4)})
    kern = compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": c["num_warps"]})
    ptx = kern.asm["ptx"]
    out.append({"k": k, "cvt": ptx.count("cvt.rn.satfinite.e4m3x2.f32"), "local": ptx.count(".local"),
                "v4_loads": ptx.count("ld.global.v4")})
print(json.dumps(out))
"""


def test_the_kernel_compiles_for_sm90_converting_in_hardware(tmp_path):
    """For rows of 4096 and 8192, the kernel compiles for sm_90 with Triton's own
    toolchain (no GPU needed; a process without the interpreter switch): E4M3 pairs converted by
    `cvt.rn.satfinite.e4m3x2.f32`, x read 16 bytes a load, nothing in local memory."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    r = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps([4096, 8192])], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    for c in json.loads(r.stdout.strip().splitlines()[-1]):
        assert c["cvt"] > 0 and c["local"] == 0 and c["v4_loads"] > 0, c
