"""GPU benchmark of `linear` with a quantized weight on the `cuda` backend, against torch (one H200 run; needs torch).

    NUMBA_ENABLE_CUDASIM=0 python benchmarks/matmul.py [--out DIR] [--quick] [--m 1,16,256] [--shapes 8192x8192]
        [--schemes q4s/block32:f16,nvfp4] [--peers torch_bf16,torch_fp16] [--budget-s 420] [--reps 15]
        [--no-evict] [--hide-launch] [--max-call-ms 200] [--paths] [--f16] [--w8a8] [--orientation] [--host]
        [--dry-run]

For a linear layer's weight W [N, K] (out features, in features) and bfloat16 activations x [M, K]
(torch CUDA tensors) it times y = x @ W^T, y bfloat16 [M, N], for M in `MS` and (N, K) in `SHAPES`:

* qcore: for each scheme of `SCHEMES` the weight (float32, normal * 0.02) is quantized once per
  shape on the cuda backend (`qw = be.quantize(w, scheme)`, the float32 weight freed after); then
  the whole call `be.linear(x, qw)` (a result tensor per call) and `be.linear(x, qw, out=y)` (a
  preallocated bfloat16 y). A call that raises records its one-line message instead of a time;
* peers in the same run: torch bf16 `x @ wb.T` and fp16 dense; torch FP8 `torch._scaled_mm` with
  e4m3 weights and rowwise scales, use_fast_accum=True, x pre-quantized per row outside the timed
  call (M padded to a multiple of 16 where the unpadded call raises, said in the cell's note); the
  weight-only int4 kernel `torch._weight_int4pack_mm` (group 128, tinygemm layout) and
  `torch._weight_int8pack_mm` where torch has them for CUDA; torchao's int4 / int8 weight-only
  linear where torchao is installed; a peer that cannot run says why (`peer_setup`, the cells);
* per shape, a device copy of a bf16 [N, K] tensor (`dst.copy_(src)`): the bandwidth reference;
* `--paths`: each scheme's bfloat16 paths forced (the decode kernel at M <= 4, the tensor-core
  kernel, the fused Triton GEMM, and the weight dequantized to bfloat16 then torch's GEMM),
  whatever the plan picks at that M;
* `--f16`: each scheme's `linear` with float16 x as well (a float16 result; docs/spec.md's
  float16-weight rule), with torch fp16 dense in the same run (ratio `vs_torch_fp16`);
* `--w8a8`: W8A8, the weight and x in `W8A8` (e4m3, one f32 scale per row), x quantized per
  row inside the timed call (`be.linear(x, qw, act=W8A8)`);
* `--orientation`: each scheme's weight also quantized in the other orientation, W^T [K, N] with
  the scheme's blocks along N, and timed as `be.matmul(x, qkn)` (its float32 device result: the
  [K, N] form's fastest call; a bfloat16 result is rounded on the host). The target
  `nk_not_slower` compares the two: the [N, K] weight's plain `linear` against its [K, N] form;
* `--host`: each case's host time per call, 50 calls back to back with the GPU kept busy (a sleep
  kernel queued first: launches never wait for the device), median of 5 runs (`host_loop_us`,
  ratio `host_vs_torch_bf16`): the pace at which a model's forward can issue the calls. Where it
  passes the GPU time (`--hide-launch`), the host sets the pace.

Timing: CUDA events around each whole call (the GPU idle before it, so host time counts as a
user sees it; `--hide-launch` queues a GPU sleep first and times the GPU's span alone), the cases
of one (shape, M) cell taking turns call by call after `--warm-s` of untimed calls, medians of
`--reps` calls. Before every timed call a read of a 512 MiB buffer evicts the weight from L2 (as
benchmarks/gpu.py does; `--no-evict` leaves L2 as the previous call left it). Each case's first
call is checked against x.float() @ wb.float().T (`rel_err`: largest error over largest |ref|;
the schemes' rounding is in it) and timed alone: a case whose call takes over `--max-call-ms`
(a host path) is not timed, nor at larger M on shapes at least as large.

Each cell records us (median) and the ratios `vs_torch_bf16` = torch bf16 us / us (> 1: faster
than torch), `vs_torch_fp16` and `vs_torch_scaled_mm` (and for a plain `linear` with `--orientation`,
`vs_kn_matmul` = its scheme's [K, N] matmul us / us); `TARGETS` are evaluated on the plain
`be.linear(x, qw)` call and printed as met / missed / not measured. Shapes run in `SHAPES` order
(8192x8192 first: most targets are there), M ascending; once the wall time passes `--budget-s`
no new cell starts and the cells left are listed in `skipped` (the device run has a hard
10-minute limit, and the full grid may not fit in it).

Writes `matmul.json` into --out (rewritten after every cell, so a run cut short keeps what it
measured): `run` (runinfo.record), `cells`, `targets`, `skipped`; prints a table per shape
(rows: cases, columns: M, cells: us/ratio vs torch bf16).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import signal
import statistics
import sys
import time

import runinfo  # benchmarks/runinfo.py (this folder is on sys.path when the script runs)
from gpu import _host_loop_us, l2_flushes, samples_in_turn  # benchmarks/gpu.py: the same timing and L2 eviction

SCHEMES = ["q4s/block32:f16", "q4s/block128:bf16", "q8s/block32:f16", "q8s", "e4m3/block32:f32", "mxfp8", "mxfp4",
           "nvfp4"]
MS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
SHAPES = [(8192, 8192), (4096, 4096), (28672, 8192), (8192, 28672)]  # (N, K); the order they run in
QUICK_MS = [1, 16, 256, 2048]
QUICK_SHAPES = [(8192, 8192)]
# peers: torch_bf16 always runs (every ratio is against it)
PEERS = ["torch_bf16", "torch_fp16", "torch_scaled_mm", "torch_int4pack", "torch_int8pack", "torchao_int4wo",
         "torchao_int8wo"]
RATIO_PEERS = {"vs_torch_bf16": "torch_bf16", "vs_torch_fp16": "torch_fp16", "vs_torch_scaled_mm": "torch_scaled_mm"}
INT4_GROUP = 128  # group size of the int4 peers (as q4s/block128:bf16)
EVICT_BYTES = 512 * 2**20  # the buffer of benchmarks/gpu.py's l2_flushes
SUSPECT_REL_ERR = 0.25  # results farther from x @ wb.T (largest error / largest |ref|) are listed under the table

BITS = {"q4s": 4, "mxfp4": 4, "nvfp4": 4, "q8s": 8, "e4m3": 8, "mxfp8": 8}  # by the scheme text's first piece
# Each target: the plain `be.linear(x, qw)` cells (`case`: another case's) of the schemes of `bits`
# (None: every scheme; all of SCHEMES are weight-only) on `shapes` (None: all of SHAPES) at `m` (None:
# every M of the run), ratio `ratio` (default `vs_torch_bf16`) >= `min`; `measured_only`: over the
# cells the run has (a scheme, shape or M it did not run is not counted missing).
TARGETS = [
    {"name": "4bit_m1", "bits": 4, "shapes": ["8192x8192"], "m": [1], "min": 3.0,
     "description": "4-bit schemes (q4s*, mxfp4, nvfp4) at 8192x8192, M = 1: >= 3.0x torch bf16"},
    {"name": "4bit_m16", "bits": 4, "shapes": ["8192x8192"], "m": [16], "min": 2.5,
     "description": "4-bit schemes (q4s*, mxfp4, nvfp4) at 8192x8192, M = 16: >= 2.5x torch bf16"},
    {"name": "8bit_small_m", "bits": 8, "shapes": ["8192x8192"], "m": [1, 2, 4, 8, 16], "min": 1.7,
     "description": "8-bit weight-only schemes (q8s*, e4m3*, mxfp8) at 8192x8192, M = 1..16: >= 1.7x torch bf16"},
    {"name": "weight_only_large_m", "bits": None, "shapes": None, "m": [256, 512, 1024, 2048, 4096, 8192], "min": 0.9,
     "description": "every weight-only scheme, M = 256..8192, every shape: >= 0.9x torch bf16"},
    {"name": "nk_not_slower", "case": "linear", "ratio": "vs_kn_matmul", "bits": None, "shapes": None, "m": None,
     "measured_only": True,
     "min": 1.0, "description": "a weight [N, K] as checkpoints store it (`linear`) never slower than its [K, N] form "
                                "(`matmul` of the weight quantized as W^T, blocks along N), every scheme, shape and M "
                                "measured with --orientation: ratio to the [K, N] call >= 1.0"},
    {"name": "w8a8_large_m", "case": "w8a8", "bits": None, "shapes": None, "m": [1024, 2048, 4096, 8192], "min": 1.3,
     "description": "FP8 weights with FP8 activations (W8A8, x quantized per row in the call), M = 1024..8192, "
                    "every shape: >= 1.3x torch bf16"},
]
W8A8 = "e4m3/block32768:f32"
"""The W8A8 case's weight and activation scheme: e4m3 with one f32 scale per row (a block at least K)."""


def shape_text(shape) -> str:
    return f"{shape[0]}x{shape[1]}"


def scheme_bits(text: str):
    return BITS.get(text.split("/")[0])


def one_line(e: BaseException) -> str:
    """An exception as one line: its type and the first line of its message (at most 300 characters)."""
    msg = str(e).strip().splitlines()
    return (f"{type(e).__name__}: {msg[0] if msg else ''}")[:300]


# ------------------------------------------------------------------ peers (torch)
def fp8_rowwise(torch, a):
    """`a` [R, C] as e4m3 with one float32 scale per row ([R, 1]): a ~ q * scale."""
    s = (a.float().abs().amax(1, keepdim=True) / 448.0).clamp(min=1e-12)
    return (a.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn), s


def int4_groups(torch, wb, group):
    """wb [N, K] as tinygemm's asymmetric int4: codes [N, K] int32 in 0..15 and scales-and-zeros
    [K / group, N, 2] bf16, w ~ (q - 8) * scale + zero (torchao's convention for this kernel)."""
    n, k = wb.shape
    w = wb.float().view(n, k // group, group)
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    q = ((w - lo) / scale).round().clamp(0, 15).to(torch.int32).view(n, k)
    zero = lo + 8 * scale
    sz = torch.cat([scale.view(n, -1, 1), zero.view(n, -1, 1)], 2).transpose(0, 1).contiguous().to(torch.bfloat16)
    return q, sz


def rel_err(torch, got, ref) -> float:
    """Largest |got - ref| over largest |ref| (got as a torch tensor, first ref.shape[0] rows)."""
    g = got if isinstance(got, torch.Tensor) else torch.as_tensor(got, device="cuda")
    g = g.reshape(-1, ref.shape[-1])[: ref.shape[0]].float()
    return float((g - ref).abs().max() / ref.abs().max().clamp(min=1e-30))


def result_note(torch, got, m, n, dtype) -> str | None:
    """Where a call's result is not a CUDA torch tensor [M, N] of `dtype`, what it is."""
    if isinstance(got, torch.Tensor) and got.dtype == dtype and got.is_cuda and tuple(got.shape) == (m, n):
        return None
    return f"result {type(got).__name__} {getattr(got, 'dtype', '?')} {tuple(getattr(got, 'shape', ()))}"


class Shape:
    """One shape's weights (qcore's quantized ones and the peers'); at most one alive at a time."""

    def __init__(self, torch, be, n, k, schemes, peers, probe_x, kn_schemes=()):
        self.n, self.k, self.text = n, k, shape_text((n, k))
        self.setup_errors: dict = {}  # case name -> message (every M of this shape)
        self.notes: dict = {}
        self.weight_bytes: dict = {}
        self.first_quantize_s: dict = {}
        w = torch.randn(n, k, device="cuda") * 0.02
        self.qw: dict = {}
        for text in schemes:
            t0 = time.perf_counter()
            try:
                self.qw[text] = be.quantize(w, text)
                torch.cuda.synchronize()
                self.weight_bytes[text] = int(self.qw[text].nbytes)
            except Exception as e:  # noqa: BLE001 -- recorded per cell
                self.setup_errors[text] = "quantize: " + one_line(e)
            self.first_quantize_s[text] = time.perf_counter() - t0
        self.qkn: dict = {}  # scheme of `kn_schemes` -> the weight quantized as W^T [K, N] (`--orientation`)
        self.kn_errors: dict = {}
        for text in kn_schemes:
            try:
                self.qkn[text] = be.quantize(w.T.contiguous(), text)
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 -- recorded in the [K, N] cells
                self.kn_errors[text] = "quantize [K, N]: " + one_line(e)
        self.wb = w.to(torch.bfloat16)
        del w
        torch.cuda.empty_cache()
        self.weight_bytes["torch_bf16"] = self.wb.nbytes
        self.peer_fns: dict = {}  # peer -> fn(x-dict) -> result ; where the setup worked
        if "torch_fp16" in peers:
            self.wh = self.wb.half()
            self.weight_bytes["torch_fp16"] = self.wh.nbytes
        if "torch_scaled_mm" in peers:
            self._setup_scaled_mm(torch)
        if "torch_int4pack" in peers:
            self._setup_int4pack(torch, probe_x)
        if "torch_int8pack" in peers:
            self._setup_int8pack(torch, probe_x)
        for p in ("torchao_int4wo", "torchao_int8wo"):
            if p in peers:
                self._setup_torchao(torch, p, probe_x)

    def _setup_scaled_mm(self, torch):
        if not hasattr(torch, "_scaled_mm"):
            self.setup_errors["torch_scaled_mm"] = f"torch {torch.__version__} has no _scaled_mm"
            return
        try:
            self.wq8, sw = fp8_rowwise(torch, self.wb)
            self.sw8 = sw.view(1, -1).contiguous()  # [1, N]
            self.weight_bytes["torch_scaled_mm"] = self.wq8.nbytes + self.sw8.nbytes
        except Exception as e:  # noqa: BLE001
            self.setup_errors["torch_scaled_mm"] = one_line(e)

    def _setup_int4pack(self, torch, probe_x):
        """`torch._weight_int4pack_mm(x, packed, group, scales_and_zeros)`: the packed weight from
        `_convert_weight_to_int4pack(codes, inner_k_tiles)`, whose codes are uint8 [N, K / 2] (two
        codes a byte, the even column high) from torch 2.5 and int32 [N, K] before: both tried,
        the one whose probe product is right kept."""
        name = "torch_int4pack"
        if not (hasattr(torch, "_weight_int4pack_mm") and hasattr(torch, "_convert_weight_to_int4pack")):
            self.setup_errors[name] = f"torch {torch.__version__} lacks _weight_int4pack_mm or _convert_weight_to_int4pack"
            return
        errs, best = [], None
        try:
            q, sz = int4_groups(torch, self.wb, INT4_GROUP)
        except Exception as e:  # noqa: BLE001
            self.setup_errors[name] = one_line(e)
            return
        ref = probe_x.float() @ self.wb.float().T
        for packing in ("uint8 [N, K/2]", "int32 [N, K]"):
            try:
                src = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8) if packing.startswith("uint8") else q
                wp = torch._convert_weight_to_int4pack(src.contiguous(), 8)
                err = rel_err(torch, torch._weight_int4pack_mm(probe_x, wp, INT4_GROUP, sz), ref)
                if best is None or err < best[0]:
                    best = (err, packing, wp)
            except Exception as e:  # noqa: BLE001
                errs.append(f"{packing}: {one_line(e)}")
        del q
        if best is None or best[0] > 0.5:
            self.setup_errors[name] = "; ".join(errs) if best is None else \
                f"wrong product with either packing (rel_err {best[0]:.3g}); {'; '.join(errs)}"
            return
        self.wp4, self.sz4 = best[2], sz
        self.weight_bytes[name] = self.wp4.nbytes + self.sz4.nbytes
        self.notes[name] = f"group {INT4_GROUP}, inner_k_tiles 8, codes {best[1]}" + (f" ({'; '.join(errs)})" * bool(errs))
        self.peer_fns[name] = lambda x: torch._weight_int4pack_mm(x["bf16"], self.wp4, INT4_GROUP, self.sz4)

    def _setup_int8pack(self, torch, probe_x):
        """`torch._weight_int8pack_mm(x, w int8 [N, K], scales [N])` (symmetric per-row int8)."""
        name = "torch_int8pack"
        if not hasattr(torch, "_weight_int8pack_mm"):
            self.setup_errors[name] = f"torch {torch.__version__} has no _weight_int8pack_mm"
            return
        try:
            s = (self.wb.float().abs().amax(1) / 127).clamp(min=1e-12)
            w8 = (self.wb.float() / s[:, None]).round().clamp(-127, 127).to(torch.int8)
            s = s.to(torch.bfloat16)
            err = rel_err(torch, torch._weight_int8pack_mm(probe_x, w8, s), probe_x.float() @ self.wb.float().T)
            if err > 0.5:
                raise RuntimeError(f"wrong product (rel_err {err:.3g})")
        except Exception as e:  # noqa: BLE001
            self.setup_errors[name] = one_line(e)
            return
        self.w8, self.s8 = w8, s
        self.weight_bytes[name] = w8.nbytes + s.nbytes
        self.notes[name] = "per-row scales"
        self.peer_fns[name] = lambda x: torch._weight_int8pack_mm(x["bf16"], self.w8, self.s8)

    def _setup_torchao(self, torch, name, probe_x):
        """torchao's weight-only int4 (group 128) / int8 linear through `quantize_` on an nn.Linear
        (its newer config classes, or the older functions)."""
        try:
            import torchao
            from torchao.quantization import quantize_
        except ImportError:
            self.setup_errors[name] = "not installed"
            return
        except Exception as e:  # noqa: BLE001
            self.setup_errors[name] = "import: " + one_line(e)
            return
        try:
            import torchao.quantization as tq

            if name == "torchao_int4wo":
                cfg = tq.Int4WeightOnlyConfig(group_size=INT4_GROUP) if hasattr(tq, "Int4WeightOnlyConfig") \
                    else tq.int4_weight_only(group_size=INT4_GROUP)
            else:
                cfg = tq.Int8WeightOnlyConfig() if hasattr(tq, "Int8WeightOnlyConfig") else tq.int8_weight_only()
            lin = torch.nn.Linear(self.k, self.n, bias=False, device="cuda", dtype=torch.bfloat16)
            with torch.no_grad():
                lin.weight.copy_(self.wb)
            quantize_(lin, cfg)
            with torch.no_grad():
                err = rel_err(torch, lin(probe_x), probe_x.float() @ self.wb.float().T)
        except Exception as e:  # noqa: BLE001
            self.setup_errors[name] = one_line(e)
            return
        setattr(self, name, lin)
        version = getattr(torchao, "__version__", "?")
        self.notes[name] = f"torchao {version}, {type(cfg).__name__}; probe rel_err {err:.3g}"

        def fn(x, lin=lin):
            with torch.no_grad():
                return lin(x["bf16"])
        self.peer_fns[name] = fn


# ------------------------------------------------------------------ the run
def parse_list(text: str, conv=str) -> list:
    return [conv(t.strip()) for t in text.split(",") if t.strip()]


def parse_shape(text: str):
    n, k = text.lower().split("x")
    return int(n), int(k)


def plan(args):
    """(shapes, ms, schemes, peers) of this run from the flags."""
    shapes = [parse_shape(s) for s in parse_list(args.shapes)] if args.shapes else \
        (QUICK_SHAPES if args.quick else SHAPES)
    ms = sorted(set(parse_list(args.m, int))) if args.m else (QUICK_MS if args.quick else MS)
    schemes = parse_list(args.schemes) if args.schemes is not None else SCHEMES
    peers = parse_list(args.peers) if args.peers is not None else PEERS
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        raise SystemExit(f"unknown peers {unknown}; known: {','.join(PEERS)}")
    if "torch_bf16" not in peers:
        peers = ["torch_bf16"] + peers
    if args.f16 and "torch_fp16" not in peers:
        peers = peers + ["torch_fp16"]
    if any(m < 1 for m in ms) or any(n < 1 or k < 1 for n, k in shapes):
        raise SystemExit("M, N and K must be positive")
    return shapes, ms, schemes, peers


def case_names(schemes, peers, paths: bool = False, w8a8: bool = False, orientation: bool = False,
               f16: bool = False) -> list:
    """Every timed case of a cell as (case, scheme, peer, label); with `paths`, each scheme's
    bfloat16 paths forced as well ("[decode]": the decode kernel, k_decode.py, at M <= 4;
    "[mma-decode]": the tensor-core decode kernel, k_decode_mma.py, at M <= 2; "[kernel]": the
    tensor-core kernel; "[fused-gemm]": the Triton GEMM that dequantizes as it
    multiplies; "[dequantize-gemm]": the weight dequantized to bfloat16,
    then torch's GEMM), whatever the plan would pick at that M; with `orientation`, the scheme's
    [K, N] weight's `matmul` ("[K, N] matmul"); with `f16`, its `linear` of float16 x ("f16 x")."""
    out = []
    for s in schemes:
        out += [("linear", s, None, s), ("linear_out", s, None, s + " out=")]
        if paths:
            out += [("linear_decode", s, None, s + " [decode]"), ("linear_mma_decode", s, None, s + " [mma-decode]"),
                    ("linear_kernel", s, None, s + " [kernel]"),
                    ("linear_fused", s, None, s + " [fused-gemm]"), ("linear_gemm", s, None, s + " [dequantize-gemm]")]
        if orientation:
            out.append(("matmul_kn", s, None, s + " [K, N] matmul"))
        if f16:
            out.append(("linear_f16", s, None, s + " f16 x"))
    if w8a8:
        out.append(("w8a8", W8A8, None, "w8a8 (e4m3 per row, x quantized in the call)"))
    out += [("peer", None, p, p) for p in peers]
    return out


def evaluate_targets(cells, schemes) -> list:
    """Each target of TARGETS with status met / missed / not measured: missed where a measured
    cell is below its ratio, not measured where none is below and some are missing (no time) or
    none was measured (a target of cells the run did not ask for);
    `status_out` the same for the `out=` calls."""
    by = {(c["case"], c["scheme"], c["shape"], c["m"]): c for c in cells
          if c["case"] in ("linear", "linear_out", "w8a8")}
    all_schemes = list(dict.fromkeys(list(SCHEMES) + list(schemes)))
    res = []
    for t in TARGETS:
        tshapes = t["shapes"] or [shape_text(s) for s in SHAPES]
        own = t.get("case")
        tschemes = [W8A8] if own == "w8a8" else \
            [s for s in all_schemes if s != W8A8 and scheme_bits(s) is not None and t["bits"] in (None, scheme_bits(s))]
        tms = t["m"] or sorted({c["m"] for c in cells if c["m"] is not None})
        ratio = t.get("ratio", "vs_torch_bf16")
        entry = {k: t[k] for k in ("name", "description", "min")}
        entry["shapes"], entry["schemes"], entry["m"], entry["ratio"] = tshapes, tschemes, tms, ratio
        for case, key in ((own, "status"),) if own else (("linear", "status"), ("linear_out", "status_out")):
            figures, missing = [], []
            for s in tschemes:
                for sh in tshapes:
                    for m in tms:
                        c = by.get((case, s, sh, m))
                        if c is None and t.get("measured_only"):
                            continue
                        r = None if c is None else c["ratios"].get(ratio)
                        if r is None:
                            missing.append({"scheme": s, "shape": sh, "m": m,
                                            "why": "not run" if c is None else (c["error"] or "no ratio")})
                        else:
                            figures.append({"scheme": s, "shape": sh, "m": m, "us": c["us"], "ratio": r,
                                            "ok": r >= t["min"]})
            status = "missed" if any(not f["ok"] for f in figures) else \
                ("not measured" if missing or not figures else "met")
            entry[key] = status
            if case != "linear_out":
                entry["figures"], entry["missing"] = figures, missing
                entry["worst"] = min(figures, key=lambda f: f["ratio"]) if figures else None
            else:
                entry["figures_out"], entry["missing_out"] = figures, missing
        res.append(entry)
    return res


def fmt_us(us) -> str:
    return f"{us:.1f}" if us < 1000 else f"{us:.0f}"


def table(cells, shape: str, ms, labels, key: str = "us") -> str:
    """Rows: cases, columns: M, each cell `us/ratio vs torch bf16` (err: an error, slow: not timed);
    `key` "host_loop_us": the host per call back to back (`--host`) instead."""
    got = {(c["label"], c["m"]): c for c in cells if c["shape"] == shape and c["m"] is not None}
    cols = [m for m in ms if any((lb, m) in got for lb in labels)]
    if not cols:
        return f"{shape}: nothing measured"
    w = max(len(lb) for lb in labels) + 1
    copy = [c for c in cells if c["shape"] == shape and c["case"] == "copy" and c["us"]]
    if key != "us":
        got = {k: c for k, c in got.items() if c.get(key)}
        lines = [f"{shape}  host us per call, back to back (/ torch bf16's over ours)",
                 " " * w + "".join(f"{'M=' + str(m):>14}" for m in cols)]
        for lb in labels:
            row = [(fmt_us(c[key]) + f"/{c['ratios'].get('host_vs_torch_bf16', 0):.2f}x") if (c := got.get((lb, m)))
                   else "-" for m in cols]
            lines.append(f"{lb:<{w}}" + "".join(f"{v:>14}" for v in row))
        return "\n".join(lines)
    head = f"{shape}  (us / speed-up vs torch bf16)" + (
        f"; copy of a bf16 [N, K]: {fmt_us(copy[0]['us'])} us, {copy[0]['gbs']:.0f} GB/s" if copy else "")
    lines = [head, " " * w + "".join(f"{'M=' + str(m):>14}" for m in cols)]
    for lb in labels:
        row = []
        for m in cols:
            c = got.get((lb, m))
            if c is None:
                row.append("-")
            elif c["us"] is None:
                row.append("slow" if c.get("slow") else "err")
            else:
                r = c["ratios"].get("vs_torch_bf16")
                row.append(fmt_us(c["us"]) + (f"/{r:.2f}x" if r is not None else ""))
        lines.append(f"{lb:<{w}}" + "".join(f"{v:>14}" for v in row))
    errs = {}
    for c in cells:
        if c["shape"] == shape and c["error"]:
            errs.setdefault((c["label"], c["error"]), []).append(c["m"])
        elif c["shape"] == shape and (c.get("result") or (c.get("rel_err") or 0) > SUSPECT_REL_ERR):
            r = c.get("rel_err")
            what = (c.get("result") or "result") + ("" if r is None else f", rel_err {r:.3g}")
            errs.setdefault((c["label"], what), []).append(c["m"])
    for (lb, e), m in errs.items():
        lines.append(f"  {lb} at M={','.join(str(v) for v in m if v is not None) or 'all'}: {e}")
    return "\n".join(lines)


def commit() -> str | None:
    """The checkout's commit (with `+dirty` where tracked files differ), or None where git has none."""
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001
        return None
    return (head + "+dirty" * bool(dirty)) or None


def software(torch, np) -> str:
    from importlib import metadata

    def ver(dist):
        for d in (dist, dist.replace("-", "_")):
            try:
                return metadata.version(d)
            except Exception:  # noqa: BLE001
                pass
        return "?"
    return (f"{runinfo.python()}, numpy {np.__version__}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
            f"numba {ver('numba')}, numba-cuda {ver('numba-cuda')}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                    help="folder for matmul.json (default: benchmarks/results)")
    ap.add_argument("--quick", action="store_true", help=f"M {QUICK_MS} and shape 8192x8192 only")
    ap.add_argument("--m", help=f"comma-separated M (default {MS})")
    ap.add_argument("--shapes", help="comma-separated NxK (out x in features), default "
                    + ",".join(shape_text(s) for s in SHAPES))
    ap.add_argument("--schemes", help="comma-separated qcore schemes (default: SCHEMES); '' for none")
    ap.add_argument("--peers", help=f"comma-separated peers of {','.join(PEERS)} (torch_bf16 always runs)")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="no new cell starts once the run's wall time passes this (default 420 s); the rest is listed "
                         "as skipped")
    ap.add_argument("--reps", type=int, default=15, help="timed calls per case (median; default 15)")
    ap.add_argument("--warm-s", type=float, default=0.2,
                    help="seconds of untimed calls before a cell's timing (default 0.2)")
    ap.add_argument("--evict", action=argparse.BooleanOptionalAction, default=True,
                    help="read a 512 MiB buffer before every timed call (L2 eviction; default on)")
    ap.add_argument("--hide-launch", action="store_true",
                    help="queue a ~1 ms GPU sleep before each timed call: GPU time alone, host launch hidden")
    ap.add_argument("--max-call-ms", type=float, default=200.0,
                    help="a case whose check call (and a second one) takes longer is not timed (a host path), nor at "
                         "larger M (default 200)")
    ap.add_argument("--w8a8", action="store_true",
                    help=f"also time W8A8: weight and x in {W8A8}, x quantized per row in the call (act=)")
    ap.add_argument("--paths", action="store_true",
                    help="also time each scheme's bfloat16 paths forced (decode kernel at M <= 4, tensor-core kernel, "
                         "fused Triton GEMM, dequantize + GEMM)")
    ap.add_argument("--f16", action="store_true",
                    help="also time each scheme's linear with float16 x (float16 result), with torch_fp16 as a peer")
    ap.add_argument("--orientation", action="store_true",
                    help="also time each scheme's weight quantized as W^T [K, N] (blocks along N) through matmul: "
                         "the target nk_not_slower")
    ap.add_argument("--host", action="store_true",  # (module text)
                    help="also time the host per call of each case, 50 calls back to back with the GPU kept busy "
                         "(a model's forward: launches never wait for the device); median of 5 runs")
    ap.add_argument("--dry-run", action="store_true", help="list the cells and targets and exit (no GPU needed)")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    shapes, ms, schemes, peers = plan(args)
    cases = case_names(schemes, peers, args.paths, args.w8a8, args.orientation, args.f16)
    command = "NUMBA_ENABLE_CUDASIM=0 python benchmarks/matmul.py " + shlex.join(sys.argv[1:] if argv is None else argv)

    if args.dry_run:
        print(f"shapes (N x K, in this order): {', '.join(shape_text(s) for s in shapes)}")
        print(f"M: {ms}")
        print(f"cases per cell ({len(cases)}): " + ", ".join(c[3] for c in cases))
        print(f"plus a bf16 [N, K] copy per shape; {len(shapes) * len(ms)} cells, "
              f"{len(shapes) * len(ms) * len(cases)} timed cases; budget {args.budget_s:.0f} s")
        print(f"timing: {args.reps} reps, warm {args.warm_s} s, L2 eviction {'on' if args.evict else 'off'}, "
              f"{'launch hidden' if args.hide_launch else 'whole calls'}, max call {args.max_call_ms} ms")
        for t in TARGETS:
            print(f"target {t['name']}: {t['description']}")
        print(f"would write {os.path.join(args.out, 'matmul.json')}")
        return 0

    import numpy as np
    import torch
    from numba import config

    if config.ENABLE_CUDASIM:
        print("run with NUMBA_ENABLE_CUDASIM=0 on a GPU", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("needs torch with CUDA and a GPU", file=sys.stderr)
        return 2
    import qcore

    be = qcore.backend("cuda")
    res = {"run": runinfo.record(f"1x {torch.cuda.get_device_name()}, {os.cpu_count()} CPUs", software(torch, np),
                                 command),
           "commit": commit(), "device": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
           "describe": None, "schemes": schemes, "peers": peers, "shapes": [shape_text(s) for s in shapes], "ms": ms,
           "timing": {"reps": args.reps, "warm_s": args.warm_s, "evict_bytes": EVICT_BYTES if args.evict else 0,
                      "hide_launch": args.hide_launch, "max_call_ms": args.max_call_ms, "budget_s": args.budget_s,
                      "host": args.host,
                      "statistic": "median us of whole calls between CUDA events"},
           "ratio_keys": RATIO_PEERS, "notes": {"torch_scaled_mm": "e4m3 x and w, rowwise float32 scales, bf16 out, "
                                                "use_fast_accum=True; x quantized outside the timed call"},
           "copy": {}, "cells": [], "targets": [], "skipped": [], "peer_setup": {}, "complete": False}
    try:
        res["describe"] = be.describe()
    except Exception as e:  # noqa: BLE001
        res["describe"] = one_line(e)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "matmul.json")

    def save():
        res["wall_s"] = time.perf_counter() - t_start
        res["targets"] = evaluate_targets(res["cells"], schemes)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(res, f, indent=1)
        os.replace(tmp, path)

    def on_term(signum, frame):  # a timeout's SIGTERM: the finally below still writes the JSON
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_term)

    flush = l2_flushes(torch)[0] if args.evict else None
    torch.manual_seed(0)
    slow: dict = {}  # label -> (m, n * k, ms, shape): not timed at M >= m on shapes with N * K >= n * k
    labels = [c[3] for c in cases]
    try:
        for n, k in shapes:
            sh = shape_text((n, k))
            if time.perf_counter() - t_start > args.budget_s:
                res["skipped"] += [{"shape": sh, "m": m, "why": "budget"} for m in ms]
                continue
            t0 = time.perf_counter()
            probe_x = torch.randn(16, k, device="cuda").to(torch.bfloat16)
            S = Shape(torch, be, n, k, schemes + ([W8A8] if args.w8a8 else []), peers, probe_x,
                      schemes if args.orientation else ())
            del probe_x
            res["peer_setup"][sh] = {"errors": dict(S.setup_errors), "notes": dict(S.notes),
                                     "quantize_s": S.first_quantize_s, "weight_bytes": dict(S.weight_bytes),
                                     "setup_s": time.perf_counter() - t0}
            src = S.wb.clone()
            dst = torch.empty_like(src)
            ct = statistics.median(samples_in_turn(torch, {"copy": lambda: dst.copy_(src)}, args.reps, warm_s=args.warm_s,
                                                   flush=flush, hide_launch=args.hide_launch)["copy"])
            res["copy"][sh] = {"us": 1e3 * ct, "gbs": 2 * src.nbytes / ct / 1e6, "bytes": src.nbytes}
            res["cells"].append({"case": "copy", "scheme": None, "peer": "copy", "label": "copy bf16 [N, K]",
                                 "shape": sh, "n": n, "k": k, "m": None, "us": 1e3 * ct, "ratios": {}, "error": None,
                                 "gbs": 2 * src.nbytes / ct / 1e6})
            print(f"{sh}: setup {time.perf_counter() - t0:.1f} s; copy bf16 [N, K] {1e3 * ct:.1f} us "
                  f"({2 * src.nbytes / ct / 1e6:.0f} GB/s)", flush=True)
            for name, e in S.setup_errors.items():
                print(f"  {name}: {e}", flush=True)
            del src, dst
            for m in ms:
                if time.perf_counter() - t_start > args.budget_s:
                    res["skipped"].append({"shape": sh, "m": m, "why": "budget"})
                    continue
                tc = time.perf_counter()
                res["cells"] += run_cell(torch, be, S, m, cases, args, flush, slow)
                save()
                print(f"  {sh} M={m}: {time.perf_counter() - tc:.1f} s (run {time.perf_counter() - t_start:.0f} s)",
                      file=sys.stderr, flush=True)
            print(table(res["cells"], sh, ms, labels), flush=True)
            if args.host:
                print(table(res["cells"], sh, ms, labels, "host_loop_us"), flush=True)
            del S
            gc.collect()
            torch.cuda.empty_cache()
        res["complete"] = not res["skipped"]
    except BaseException as e:  # noqa: BLE001 -- a CUDA error or a timeout: keep what was measured
        res["aborted"] = one_line(e)
        print(f"aborted: {res['aborted']}", file=sys.stderr, flush=True)
    finally:
        done = {(c["shape"], c["m"]) for c in res["cells"]} | {(c["shape"], c["m"]) for c in res["skipped"]}
        res["skipped"] += [{"shape": shape_text(s), "m": m, "why": "not reached: " + res["aborted"]}
                           for s in shapes for m in ms if (shape_text(s), m) not in done and "aborted" in res]
        save()
    print_targets(res["targets"])
    if res["skipped"]:
        print(f"skipped {len(res['skipped'])} cells: " + ", ".join(f"{s['shape']} M={s['m']}" for s in res["skipped"]))
    print(f"wrote {path} ({res['wall_s']:.0f} s)", file=sys.stderr)
    return 1 if "aborted" in res else 0


def run_cell(torch, be, S, m, cases, args, flush, slow) -> list:
    """The cells of one (shape, M): every case checked by one call, then the working ones timed in turn."""
    n, k, sh = S.n, S.k, S.text
    x = {"bf16": torch.randn(m, k, device="cuda").to(torch.bfloat16)}
    if hasattr(S, "wh"):
        x["f16"] = x["bf16"].half()
    y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    ref = x["bf16"].float() @ S.wb.float().T
    fns, cells = {}, {}
    for case, scheme, peer, label in cases:
        name = scheme or peer
        cell = {"case": case, "scheme": scheme, "peer": peer, "label": label, "shape": sh, "n": n, "k": k, "m": m,
                "us": None, "us_min": None, "ratios": {}, "error": None, "rel_err": None,
                "weight_bytes": S.weight_bytes.get(name)}
        if S.notes.get(name):
            cell["note"] = S.notes[name]
        cells[label] = cell
        if name in S.setup_errors:
            cell["error"] = S.setup_errors[name]
            continue
        hit = slow.get(label)
        if hit is not None and m >= hit[0] and n * k >= hit[1]:
            cell["error"], cell["slow"] = f"not timed: one call took {hit[2]:.0f} ms at {hit[3]}, M={hit[0]}", True
            continue
        fn = make_fn(torch, be, S, case, scheme, peer, x, y, m, cell)
        if fn is None:
            continue
        try:  # the check: a call (the first may compile), again where it was slow
            for attempt in range(2):
                t0 = time.perf_counter()
                got = fn()
                torch.cuda.synchronize()
                call_ms = 1e3 * (time.perf_counter() - t0)
                if attempt == 0:
                    cell["first_call_ms"] = call_ms
                if call_ms <= args.max_call_ms:
                    break
            if case == "linear_out":
                got = y if got is None else got
        except Exception as e:  # noqa: BLE001 -- recorded, the run goes on
            cell["error"] = one_line(e)
            try:
                torch.cuda.synchronize()
            except Exception as e2:  # noqa: BLE001 -- a sticky CUDA error: nothing after this can run
                raise RuntimeError(f"CUDA context lost after {label} at {sh} M={m}: {one_line(e2)}") from e
            continue
        try:  # what came back: a result that is not bf16 [M, N] or far from x @ wb.T is noted, and still timed
            note = None if case == "matmul_kn" else result_note(  # (matmul: a float32 device array)
                torch, got, got.shape[0] if peer == "torch_scaled_mm" else m, n,
                torch.float16 if peer == "torch_fp16" or case == "linear_f16" else torch.bfloat16)
            if note:
                cell["result"] = note
            cell["rel_err"] = rel_err(torch, got, ref)
        except Exception as e:  # noqa: BLE001
            cell["result"] = (cell.get("result", "") + "; rel_err: " + one_line(e)).lstrip("; ")
        del got
        if call_ms > args.max_call_ms:
            cell["error"], cell["slow"] = f"not timed: one call took {call_ms:.0f} ms (> --max-call-ms)", True
            slow[label] = (m, n * k, call_ms, sh)
            continue
        fns[label] = fn
    ts, tries = {}, 0
    while fns:  # a case that raises while timed (its check passed) is dropped with its message, the rest timed again
        try:
            ts = samples_in_turn(torch, fns, args.reps, flush=flush, hide_launch=args.hide_launch, warm_s=args.warm_s)
            break
        except Exception as e:  # noqa: BLE001
            torch.cuda.synchronize()  # a sticky CUDA error raises here and ends the run (its JSON kept)
            tries += 1
            bad = next((lb for lb, fn in fns.items() if _raises(torch, fn)), None)
            if bad is None and tries < 3:
                continue  # no case raises alone: timed again
            for lb in [bad] if bad else list(fns):
                cells[lb]["error"] = "while timed: " + one_line(e)
                del fns[lb]
    for label, v in ts.items():
        cells[label]["us"] = 1e3 * statistics.median(v)
        cells[label]["us_min"] = 1e3 * min(v)
    peer_us = {c["peer"]: c["us"] for c in cells.values() if c["peer"] and c["us"]}
    for c in cells.values():
        if c["us"]:
            for key, p in RATIO_PEERS.items():
                if peer_us.get(p):
                    c["ratios"][key] = peer_us[p] / c["us"]
            if c["weight_bytes"]:
                c["weight_gbs"] = c["weight_bytes"] / c["us"] / 1e3
    if args.host:  # (host per call back to back, each case in turn; the GPU busy ahead of the calls)
        for label, fn in fns.items():
            if cells[label]["us"]:
                cells[label]["host_loop_us"] = _host_loop_us(torch, fn, calls=50, rounds=5)
        host_peer = {c["peer"]: c["host_loop_us"] for c in cells.values() if c["peer"] and c.get("host_loop_us")}
        for c in cells.values():
            if c.get("host_loop_us") and host_peer.get("torch_bf16"):
                c["ratios"]["host_vs_torch_bf16"] = host_peer["torch_bf16"] / c["host_loop_us"]
    kn_us = {c["scheme"]: c["us"] for c in cells.values() if c["case"] == "matmul_kn" and c["us"]}
    for c in cells.values():
        if c["case"] == "linear" and c["us"] and kn_us.get(c["scheme"]):
            c["ratios"]["vs_kn_matmul"] = kn_us[c["scheme"]] / c["us"]
    del x, y, ref
    return list(cells.values())


def _raises(torch, fn) -> bool:
    try:
        fn()
        torch.cuda.synchronize()
        return False
    except Exception:  # noqa: BLE001
        return True


def make_fn(torch, be, S, case, scheme, peer, x, y, m, cell):
    """The timed call of one case (None where it cannot be made: the cell's error says why)."""
    if case == "linear":
        qw = S.qw[scheme]
        return lambda: be.linear(x["bf16"], qw)
    if case == "linear_out":
        qw = S.qw[scheme]
        return lambda: be.linear(x["bf16"], qw, out=y)
    if case == "linear_f16":
        qw = S.qw[scheme]
        return lambda: be.linear(x["f16"], qw)
    if case == "w8a8":
        qw = S.qw[scheme]
        return lambda: be.linear(x["bf16"], qw, act=W8A8)
    if case == "matmul_kn":
        if scheme in S.kn_errors:
            cell["error"] = S.kn_errors[scheme]
            return None
        qkn = S.qkn[scheme]
        return lambda: be.matmul(x["bf16"], qkn)
    if case in ("linear_decode", "linear_mma_decode", "linear_kernel", "linear_gemm", "linear_fused"):
        from qcore_cuda import k_decode, k_decode_mma
        from qcore_cuda.paths import linear as linear_paths

        if case == "linear_decode" and m > k_decode.MBS[-1]:
            cell["error"] = f"the decode kernel takes M <= {k_decode.MBS[-1]}"
            return None
        if case == "linear_mma_decode" and m > k_decode_mma.MBS[-1]:
            cell["error"] = f"the tensor-core decode kernel takes M <= {k_decode_mma.MBS[-1]}"
            return None
        qw, never = S.qw[scheme], 1 << 62
        # (FUSED_M, FUSED_ALL_KINDS, LIBRARY_FROM_M, DECODE_MAX_M, MMA_DECODE_MAX_M): the one path the case forces
        off = (0, 0)
        force = {"linear_decode": (off, False, never, k_decode.MBS[-1], 0), "linear_kernel": (off, False, never, 0, 0),
                 "linear_mma_decode": (off, False, never, 0, k_decode_mma.MBS[-1]),
                 "linear_gemm": (off, False, 1, 0, 0), "linear_fused": ((1, never), True, never, 0, 0)}[case]
        names = ("FUSED_M", "FUSED_ALL_KINDS", "LIBRARY_FROM_M", "DECODE_MAX_M", "MMA_DECODE_MAX_M")

        def forced():  # (stream= given: a repeat call's kept plan is neither used nor made)
            keep = [getattr(linear_paths, n) for n in names]
            for n, v in zip(names, force):
                setattr(linear_paths, n, v)
            try:
                return be.linear(x["bf16"], qw, stream=torch.cuda.current_stream())
            finally:
                for n, v in zip(names, keep):
                    setattr(linear_paths, n, v)
        return forced
    if peer == "torch_bf16":
        wb = S.wb
        return lambda: x["bf16"] @ wb.T
    if peer == "torch_fp16":
        wh = S.wh
        return lambda: x["f16"] @ wh.T
    if peer == "torch_scaled_mm":
        return scaled_mm_fn(torch, S, x, m, cell)
    return (lambda f=S.peer_fns[peer]: f(x)) if peer in S.peer_fns else None


def scaled_mm_fn(torch, S, x, m, cell):
    """`torch._scaled_mm(xq, wq.T, scale_a, scale_b, out_dtype=bf16, use_fast_accum=True)` with xq
    e4m3 [M, K] and its rowwise scales [M, 1] made here (outside the timed call), wq e4m3 [N, K]
    with scales [1, N]; M padded to a multiple of 16 (zero rows) where the unpadded call raises."""
    wq, sw = S.wq8, S.sw8

    def call(xq, sx):
        r = torch._scaled_mm(xq, wq.T, scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16, use_fast_accum=True)
        return r[0] if isinstance(r, tuple) else r  # torch < 2.4 returned (out, amax)

    xq, sx = fp8_rowwise(torch, x["bf16"])
    tries = [(xq, sx)]
    mp = -(-m // 16) * 16
    if mp != m:
        xqp = torch.zeros(mp, xq.shape[1], device="cuda", dtype=torch.uint8).view(torch.float8_e4m3fn)
        xqp[:m] = xq
        sxp = torch.ones(mp, 1, device="cuda")
        sxp[:m] = sx
        tries.append((xqp, sxp))
    errs = []
    for a, sa in tries:
        try:
            call(a, sa)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            errs.append(f"M={a.shape[0]}: {one_line(e)}")
            continue
        if a.shape[0] != m:
            cell["note"] = f"M padded to {a.shape[0]} (unpadded: {errs[0]})"
        return lambda a=a, sa=sa: call(a, sa)
    cell["error"] = "; ".join(errs)[:600]
    return None


def print_targets(targets) -> None:
    for t in targets:
        w = t.get("worst")
        fig = f"; worst {w['ratio']:.2f}x ({w['scheme']}, {w['shape']}, M={w['m']})" if w else ""
        out = f" (out=: {t['status_out']})" if "status_out" in t else ""
        print(f"target {t['name']}: {t['status'].upper()}{out} -- {t['description']}{fig}; "
              f"{len(t['figures'])} measured, {len(t['missing'])} missing")
        per = {}
        for f in t["figures"]:
            per.setdefault(f["scheme"], []).append(f["ratio"])
        for s, rs in per.items():
            bad = sum(r < t["min"] for r in rs)
            below = f" ({bad} below {t['min']}x)" if bad else ""
            print(f"    {s:<22} {min(rs):.2f}x..{max(rs):.2f}x{below}")


if __name__ == "__main__":
    sys.exit(main())
