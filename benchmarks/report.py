"""Render docs/performance.md from the benchmarks' JSON results.

    python benchmarks/report.py                 # rewrite docs/performance.md from benchmarks/results/
    python benchmarks/report.py --check         # exit 1 if docs/performance.md is not what the JSON gives

`benchmarks/cpu.py --json` writes `cpu.json`, `benchmarks/gpu.py --out DIR` writes `gpu.json`,
`benchmarks/cli.py --json PATH` a whole-model run (kept as `cli*.json`, one file per run); copy
the run's file into `benchmarks/results/` and rerun this script. Every table states the
run's date, hardware, software and command from the file's `run` record, so the document holds
the latest figures only; git keeps earlier runs.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "performance.md"
NOTES = ROOT / "benchmarks" / "notes"
"""The document's prose beside the tables, one Markdown file per section (edit them there)."""


def _note(name: str) -> str:
    """The text of `benchmarks/notes/NAME.md`, as the document takes it."""
    return (NOTES / f"{name}.md").read_text(encoding="utf-8")


INTRO = _note("intro")

CPU_NOTES = _note("cpu")

GPU_NOTES = _note("gpu")

GEMV_NOTES = _note("gemv")

LINEAR_NOTES = _note("linear")


def _run_line(run: dict) -> str:
    parts = [f"Run of {run['date']} on {run['hardware']}", f"software: {run['software']}",
             f"command: `{run['command']}`"]
    line = "; ".join(parts) + "."
    if run.get("source"):
        line += f" {run['source']}"
    return line


def render_cpu(res: dict) -> str:
    """The CPU (ndarray) section from `benchmarks/cpu.py --json` output."""
    copy = next(r["gbs"] for r in res["rows"] if r["operation"] == "copy")
    lines = ["## CPU (ndarray backend)", "", _run_line(res["run"]), "",
             f"Input {tuple(res['shape'])} float32; median and best of {res['repeats']} runs.", "",
             "| operation | scheme | backend | threads | median ms | best ms | GB/s | % of copy |",
             "|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['operation']} | `{r['scheme']}` | {r['backend']} | {r['threads']} | "
                     f"{r['median_s'] * 1e3:.1f} | {r['best_s'] * 1e3:.1f} | {r['gbs']:.2f} | {100 * r['gbs'] / copy:.0f}% |")
    lines += ["", f"First call in a fresh process ({res['first_call_cache']}):", ""]
    lines += [f"- {k}: {v:.2f} s" for k, v in res["first_call_s"].items()]
    lines += [f"- in a new process with that cache filled: {res['warm_first_call_s']:.2f} s for all of them", "",
              "Peak memory of quantize (tracemalloc peak / input bytes): "
              + ", ".join(f"`{k}` {v:.3f}x" for k, v in res["peak_memory"].items()) + ".", "", CPU_NOTES]
    return "\n".join(lines)


CALL_NOTES = _note("calls")

GEMV_CALL_NOTES = _note("gemv_calls")


def _ratio_shown(f: float, bound: float) -> str:
    """A ratio against a lower bound, in two decimals, or three where two would round a miss up
    to the bound (a miss never reads as the bound)."""
    return f"{f:.3f}x" if f < bound <= round(f, 2) else f"{f:.2f}x"


def _table(cols: list, items: list) -> list[str]:
    """A markdown table: `cols` is [(header, cell(item) -> str)], one row per item."""
    return (["| " + " | ".join(h for h, _ in cols) + " |", "|" + "---|" * len(cols)]
            + ["| " + " | ".join(cell(it) for _, cell in cols) + " |" for it in items])


def _has_calls(res: dict, table: str, key: str) -> bool:
    """Whether the run measured the call columns (`out=`, host time, first call) of a table."""
    return bool(res[table]) and key in res[table][0]


def _gbs(key: str, copy: float | None = None):
    """The cell of GB/s figure `key` (`kern`, `api`, ...) for a (row, op) item, with its % of
    `copy` when given."""
    def cell(it) -> str:
        v = it[0][f"{it[1]}_{key}_gbs"]
        return f"{v:.0f}" if copy is None else f"{v:.0f} ({100 * v / copy:.0f}%)"
    return cell


def _op_columns(res: dict) -> list:
    """The scheme table's columns over (row, op) items; the call columns where the run has them."""
    c = res["copy"]["gbs"]
    calls = _has_calls(res, "rows", "q_api_out_gbs")

    def comp(it):
        return it[0].get(f"{it[1]}_compiled_gbs")

    cols = [("scheme", lambda it: f"`{it[0]['scheme']}`"),
            ("op", lambda it: "calibrate+quantize" if it[1] == "q" else "dequantize"),
            ("cuda kernels GB/s (% of copy)", _gbs("kern", c))]
    if calls:
        cols += [("cuda API call GB/s (% of copy)", _gbs("api", c)),
                 ("API call, out= GB/s (% of copy)", _gbs("api_out", c))]
    else:
        cols.append(("cuda API call GB/s", _gbs("api")))
    cols += [("torch eager GB/s", _gbs("eager")),
             ("torch.compile GB/s", lambda it: "-" if comp(it) is None else f"{comp(it):.0f}"),
             ("kernels vs compile",
              lambda it: "-" if comp(it) is None else f"{it[0][f'{it[1]}_kern_gbs'] / comp(it):.2f}x")]
    if calls and "fresh_process_q_s" in res["rows"][0]:
        cols.append(("first call, new process s (1st / 2nd child)",
                     lambda it: " / ".join(f"{t:.3f}" for t in it[0][f"fresh_process_{it[1]}_s"])))
    return cols


def _gemv_columns(res: dict) -> list:
    """The fused matmul table's columns; the call columns where the run has them."""
    calls = _has_calls(res, "gemv", "qcore_api_out")
    cols = [("M", lambda r: f"{r['m']}"),
            ("cuda kernels µs", lambda r: f"{1e3 * r['qcore_kern']:.1f}"),
            ("cuda API call µs", lambda r: f"{1e3 * r['qcore_api']:.1f}")]
    if calls:
        cols += [("API call, out= µs", lambda r: f"{1e3 * r['qcore_api_out']:.1f}"),
                 ("host µs (out=)", lambda r: f"{r['host_us']:.1f} ({r['host_us_out']:.1f})")]
    cols += [("torch fp16 GPU µs", lambda r: f"{1e3 * r['torch_fp16']:.1f}"),
             ("torch fp16 call µs", lambda r: f"{1e3 * r['torch_fp16_api']:.1f}")]
    if calls:
        cols.append(("torch fp16 host µs", lambda r: f"{r['torch_fp16_host_us']:.1f}"))
    if _has_calls(res, "gemv", "host_loop_us_out"):
        cols.append(("host µs back-to-back: qcore out= / torch",
                     lambda r: f"{r['host_loop_us_out']:.1f} / {r['torch_fp16_host_loop_us']:.1f}"))
    cols += [("speedup (GPU)", lambda r: f"{r['torch_fp16'] / r['qcore_kern']:.2f}x"),
             ("max rel err vs fp16", lambda r: f"{r['rel_err']:.1e}")]
    return cols


def _timing_counts(res: dict) -> str:
    """How many calls each median holds and the untimed warm-up before each timing, where the run
    recorded them."""
    t = res.get("timing")
    if not t:
        return ""
    return (f"; {t['api_iters']} per API-call column, in {t['api_rounds']} rounds over the schemes, "
            f"{t['iters']} per kernel and torch column; each timing after {t['warm_s']:g} s of untimed calls")


def render_gpu(res: dict) -> str:
    """The GPU (cuda) section from `benchmarks/gpu.py` output."""
    c = res["copy"]["gbs"]
    lines = ["## GPU (cuda backend)", "", _run_line(res["run"]), "",
             f"Input float32 [{res['shape'][0]}, {res['shape'][1]}] on the device; medians of the timed calls "
             f"(CUDA events{_timing_counts(res)}). Device-to-device copy: {res['copy']['ms']:.3f} ms = **{c:.0f} GB/s**.", ""]
    lines += _table(_op_columns(res), [(r, op) for r in res["rows"] for op in ("q", "dq")])
    notes = GPU_NOTES + (CALL_NOTES if _has_calls(res, "rows", "q_api_out_gbs") else "")
    lines += ["", notes, "### Fused matmul", "",
              "`x[M, 8192] @ w[8192, 8192]`, w in `q4s/block32:f16`, against torch fp16 `x @ w` (same run).", ""]
    lines += _table(_gemv_columns(res), res["gemv"])
    if _has_calls(res, "gemv", "qcore_api_out"):
        lines += ["", GEMV_CALL_NOTES.rstrip("\n")]
    if res.get("packed_launches"):
        counts = ", ".join(f"{k} {v}" for k, v in res["packed_launches"].items())
        lines += ["", f"Launches by path over the run (`qcore_cuda._launch.COUNTS`): {counts}."]
    if res.get("paths_taken"):
        taken = ", ".join(f"{k} {v}" for k, v in sorted(res["paths_taken"].items()))
        lines += ["", f"Paths chosen over the run (`qcore_cuda.paths.TAKEN`; a packed matmul skips the choice): "
                      f"{taken}."]
    if res.get("repeat_calls"):
        hits = ", ".join(f"{k} {v}" for k, v in sorted(res["repeat_calls"].items()))
        lines += ["", f"Calls served as repeats over the run (`qcore_cuda._repeat.HITS`: a shape and scheme "
                      f"already served, without the checks and the path choice): {hits}."]
    lines += ["", GEMV_NOTES]
    targets = gpu_targets(res)
    if targets:
        lines += ["", "### Call targets in this run", "",
                  "| target | this run | met |", "|---|---|---|"]
        lines += [f"| {name} | {got} | {'yes' if ok else '**no**'} |" for name, got, ok in targets]
        lines.append("")
    return "\n".join(lines)


CALL_TARGET_SCHEMES = ("q8s/block32:f16", "q4s/block32:f16", "e4m3/block32:f32")
NVFP4 = "e2m1/block16:ue4m3/tensor:f32/packed_native"


def gpu_targets(res: dict) -> list[tuple[str, str, bool]]:
    """The call targets checked against one gpu.json: (target, figure, met). Empty for a
    results file from before the API-call columns."""
    if not _has_calls(res, "rows", "q_api_out_gbs"):
        return []
    copy = res["copy"]["gbs"]
    rows = {r["scheme"]: r for r in res["rows"]}
    out = []

    def share(scheme: str, op: str, bound: float) -> None:
        if scheme in rows:
            f = rows[scheme][f"{op}_api_gbs"] / copy
            name = "quantize" if op == "q" else "dequantize"
            out.append((f"`{scheme}` {name} call >= {bound:.2f}x copy", _ratio_shown(f, bound), f >= bound))

    for scheme in CALL_TARGET_SCHEMES:
        share(scheme, "q", 0.85)
        share(scheme, "dq", 0.85)
    share(NVFP4, "dq", 0.85)
    share("q8s", "q", 0.5)
    share(NVFP4, "q", 0.5)
    firsts = [max(r["fresh_process_q_s"][1], r["fresh_process_dq_s"][1]) for r in res["rows"]
              if r.get("fresh_process_q_s")]
    if firsts:
        out.append(("first call per scheme, new process (cache warm) <= 0.5 s", f"{max(firsts):.2f} s",
                    max(firsts) <= 0.5))
    gemv = {g["m"]: g for g in res["gemv"]}

    def worst(key: str) -> float | None:
        """The largest `key` over the matmul rows with M <= 16 (None: not in this file)."""
        got = [g[key] for g in res["gemv"] if g["m"] <= 16 and key in g]
        return max(got) if got else None

    for how, ours, theirs in (("one call after a synchronisation", "host_us", "torch_fp16_host_us"),
                              ("calls back-to-back (a decode step)", "host_loop_us_out", "torch_fp16_host_loop_us")):
        us, torch_us = worst(ours), worst(theirs)
        if us is not None:
            vs = f" (torch {torch_us:.1f})" if torch_us is not None else ""
            out.append((f"matmul host time per call, M <= 16, <= 25 µs: {how}", f"{us:.1f} µs{vs}", us <= 25))
    for m in (1, 4):
        if m in gemv and "qcore_api" in gemv[m]:
            g = gemv[m]
            out.append((f"matmul call at M = {m} faster than torch fp16's call",
                        f"{g['qcore_api'] * 1e3:.1f} vs {g['torch_fp16_api'] * 1e3:.1f} µs",
                        g["qcore_api"] < g["torch_fp16_api"]))
    if 1 in gemv:
        out.append(("M = 1 GEMV kernel >= 2.5x torch fp16", _ratio_shown(gemv[1]["speedup_kern"], 2.5),
                    gemv[1]["speedup_kern"] >= 2.5))
    return out


WHOLE_MODEL_NOTES = _note("whole_model")


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.0f} MiB"


def render_whole_models(runs: list[dict]) -> str:
    """The `qcore quantize` against the I/O floor section, from `benchmarks/cli.py --json` files."""
    lines = ["## Whole models: `qcore quantize` against the I/O floor", ""]
    lines += [f"- {_run_line(r['run'])}" for r in runs]
    lines += ["", "| backend | scheme | statistics | input | qcore s | floor s (read + write) | qcore / floor | "
              "peak RSS | set-up alone | RSS bound |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['backend']} | `{r['scheme']}` | {'yes' if r['stats'] else 'no'} | "
                     f"{r['input_bytes'] / 2**20:.0f} MiB in {r['tensors']} tensors {tuple(r['shape'])} | "
                     f"{r['qcore_s']:.3f} | {r['floor_s']:.3f} ({r['floor_read_s']:.3f} + {r['floor_write_s']:.3f}) | "
                     f"{r['ratio_to_floor']:.2f}x | {r['peak_rss_bytes'] / 2**20:.0f} MiB | "
                     f"{_mib(r.get('baseline_rss_bytes'))} | {r['rss_bound_bytes'] / 2**20:.0f} MiB |")
    lines += ["", WHOLE_MODEL_NOTES]
    over = [f"{r['backend']} `{r['scheme']}`" for r in runs if not r["within_rss_bound"]]
    lines.append("Every row is within its RSS bound." if not over else
                 f"Over the RSS bound: {', '.join(over)}.")
    lines.append("")
    return "\n".join(lines)


def render_pool(res: dict) -> str:
    """The memory pool's release threshold section, from `benchmarks/gpu_pool.py` output."""
    lines = ["## Memory pool: release threshold against a loop's working set", "",
             f"{_run_line(res['run'])}" if "run" in res else f"Command: `{res['command']}`.", "",
             "A 1 GiB float32 tensor dequantized (`q4s/block32:f16`) in a loop while one earlier result stays "
             "alive; median wall time of a call, synchronised before each, in a fresh process per "
             "`QCORE_CUDA_POOL_KEEP`.", "",
             "| QCORE_CUDA_POOL_KEEP | dequantize call µs | pool holds |", "|---|---|---|"]
    lines += [f"| {r['keep']} | {r['dequantize_call_us']:.0f} | {r['pool_reserved_bytes'] / 2**30:.2f} GiB |"
              for r in res["rows"]]
    lines += ["", "Below the loop's working set the driver takes a freed block back at each synchronisation "
              "and the next call maps it again.", ""]
    return "\n".join(lines)


def render_calls(res: dict) -> str:
    """Where a whole call's time goes, from `benchmarks/gpu_calls.py`."""
    lines = ["## GPU: where a call's time goes", "", _run_line(res["run"]), "",
             "Repeat calls (1 GiB float32 torch tensors [65536, 4096]; matmul `x[M, 8192] @ w[8192, 8192]`, w in "
             "`q4s/block32:f16`), the GPU idle before each; medians. **API call**: between two CUDA events around "
             "the call, as in the GPU table above. **host**: before the first launch, waiting for the stream before "
             "the flag read, and from there to the return. **GPU**: from the start event to the first launch, the "
             "launches, and from the last launch to the end event (recorded by the host after the call returns). "
             f"Two events recorded back to back with no call between them: {res['events_alone_us']:.1f} µs.", "",
             "| call | API call µs | host: before launch | host: wait | host: after wait | GPU: idle before | "
             "GPU: kernels | GPU: after |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['call']} | {r['api_us']:.1f} | {r['host_before_launch_us']:.1f} | {r['host_wait_us']:.1f} | "
              f"{r['host_after_wait_us']:.1f} | {r['gpu_idle_before_us']:.1f} | {r['kernels_us']:.1f} | "
              f"{r['gpu_after_us']:.1f} |" for r in res["rows"]]
    lines += ["", CALLS_NOTES]
    return "\n".join(lines)


CALLS_NOTES = _note("call_split")


def render_rules(res: dict) -> str:
    """Schemes under the extension rules on the general kernels, from `benchmarks/gpu_rules.py`."""
    lines = ["## GPU: schemes under the extension rules (docs/spec.md)", "",
             _run_line(res["run"]), "",
             f"The whole call on a float32 [8192, 8192] torch tensor (256 MiB), median of 10, synchronised; "
             f"ratio to torch's device copy of x in the same run ({res['copy_ms']:.3f} ms). The first row is a v1 "
             "scheme on the fast kernels; those with signed scales, code rules or affine offsets quantize on "
             "the general kernels, and the affine ones (`q4_1`, `/zero`) decode there too (the others' decode "
             "is v1's, on the fast kernels). The `packed_native` rows compare a field order (the v1 kernels, "
             "then `k_reorder`; decode from a re-packed copy made once per tensor) with the `low` order, and "
             "the `:flat` row (flat blocks) is a tensor whose rows hold whole blocks: the v1 scheme's bytes.", "",
             "| scheme | quantize ms | quantize / copy | dequantize ms | dequantize / copy |", "|---|---|---|---|---|"]
    lines += [f"| `{r['scheme']}` | {r['quantize_ms']:.3f} | {r['quantize_vs_copy']:.2f}x | {r['dequantize_ms']:.3f} | "
              f"{r['dequantize_vs_copy']:.2f}x |" for r in res["rows"]]
    lines.append("")
    return "\n".join(lines)


def render_linear(res: dict, separate: bool = False, moved: tuple[set, set] = (set(), set())) -> str:
    """`linear` with a quantized [N, K] weight against torch, from `benchmarks/matmul.py`;
    `separate`: a run of some cases on their own (`matmul_*.json`), as a subsection; `moved`: the
    cells (case label, shape, M) and target names such runs hold, which this table leaves to them
    (a cell shows "below")."""
    timing = res.get("timing", {})
    how = ("GPU time of each call, its host launch hidden behind a GPU sleep" if timing.get("hide_launch")
           else "whole calls between CUDA events")
    moved_cells, targets = moved
    head = ["## GPU: `linear` with a quantized weight [N, K] against torch", ""] if not separate else \
        [f"### {_run_title(res)}: {res['run']['date']}, {res['run']['hardware']}", ""]
    lines = head + [_run_line(res["run"]), "",
             f"y = x @ W^T for bfloat16 x [M, K] (torch CUDA tensors) and a weight [N, K] (out x in features), "
             f"the result bfloat16; {how}, median of {timing.get('reps', '?')}"
             + (", the weight evicted from L2 before each call" if timing.get("evict_bytes") else "")
             + ". A cell is microseconds / speed-up over torch bf16 dense `x @ W.T` in the same run (above 1: "
               "faster). qcore rows are `be.linear(x, qw)` on the cuda backend (docs/gpu.md, `linear`)."
             + (" Cases timed in a run of their own are in the subsections below." if moved_cells else ""), ""]
    if not separate:
        lines += [LINEAR_NOTES.strip(), ""]
    cells = [c for c in res["cells"] if c.get("m") is not None]
    for shape in res.get("shapes", sorted({c["shape"] for c in cells})):
        rows = [c for c in cells if c["shape"] == shape and not c.get("label", "").endswith("out=")]
        ms = sorted({c["m"] for c in rows})
        if not ms:
            continue
        names = list(dict.fromkeys(c["label"] for c in rows))
        lines += [f"**{shape}** (N x K)", "", "| case | " + " | ".join(f"M={m}" for m in ms) + " |",
                  "|---|" + "---|" * len(ms)]
        for name in names:
            row = []
            for m in ms:
                c = next((c for c in rows if c["label"] == name and c["m"] == m), None)
                if (name, shape, m) in moved_cells:
                    row.append("below")
                elif c is None or c.get("us") is None:
                    row.append("-" if c is None or not c.get("error") else "error")
                else:
                    r = c.get("ratios", {}).get("vs_torch_bf16")
                    row.append(f"{c['us']:.1f} / {r:.2f}x" if r else f"{c['us']:.1f}")
            lines.append(f"| {name} | " + " | ".join(row) + " |")
        lines.append("")
        if timing.get("host"):
            lines += _host_table(rows, names, ms, shape)
    lines += ["Targets (the plain call's ratio to torch bf16, or to the reference a target names):", ""]
    for t in res.get("targets", []):
        if t["name"] in targets or separate and t["status"] == "not measured":
            continue
        worst = t.get("worst") or {}
        fig = f"; worst {worst['ratio']:.2f}x ({worst['scheme']}, M = {worst['m']})" if worst.get("ratio") else ""
        lines.append(f"- {t['description']}: **{t['status']}**{fig}")
    lines.append("")
    return "\n".join(lines)


def _host_table(rows: list, names: list, ms: list, shape: str) -> list:
    """A `--host` run's host time per call back to back (`host_loop_us`), as table lines."""
    lines = [f"Host time per call, {shape}: 50 calls back to back with the GPU kept busy, median of 5 runs; "
             "a cell is microseconds / torch bf16's host time over ours (below 1: more host time than torch's). "
             "Where it passes the GPU time above, the host sets the pace of back-to-back calls.", "",
             "| case | " + " | ".join(f"M={m}" for m in ms) + " |", "|---|" + "---|" * len(ms)]
    for name in names:
        row = []
        for m in ms:
            c = next((c for c in rows if c["label"] == name and c["m"] == m), None)
            h = None if c is None else c.get("host_loop_us")
            r = None if c is None else c.get("ratios", {}).get("host_vs_torch_bf16")
            row.append("-" if h is None else (f"{h:.1f} / {r:.2f}x" if r else f"{h:.1f}"))
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    return lines + [""]


def _own_cells(res: dict) -> set:
    """The qcore cells (case label, shape, M) of a `benchmarks/matmul.py` run (its peers' rows
    left out)."""
    peers = set(res.get("peers", [])) | {"torch_bf16"}
    return {(c["label"], c["shape"], c["m"]) for c in res["cells"]
            if c.get("m") is not None and c.get("label") not in peers}


def _run_title(res: dict) -> str:
    """A separate run's heading: its schemes (the forced paths and `out=` folded in) and its M."""
    cells = _own_cells(res)
    cases = sorted({label.split(" [")[0].removesuffix(" out=") for label, _, _ in cells})
    ms = sorted({m for _, _, m in cells})
    return f"{', '.join(cases)} at M = {', '.join(map(str, ms))}"


def render_inference(runs: list[dict]) -> str:
    """transformers' `generate()` on a qcore checkpoint against the float model, from
    `benchmarks/inference.py` (one table per device)."""
    lines = ["## Running models: `generate()` through transformers", ""]
    for res in runs:
        cfg = res["config"]
        lines += [_run_line(res["run"]), "",
                  f"A random Llama (preset `{res['preset']}`: {cfg['num_hidden_layers']} layers, hidden "
                  f"{cfg['hidden_size']}, MLP {cfg['intermediate_size']}, vocabulary {cfg['vocab_size']}) on "
                  f"{res['device']}; a prompt of {res['prompt']} tokens, then {res['new_tokens']} greedy new tokens, "
                  f"median of {res['repeats']}. The qcore model is the `qcore quantize` output (rules "
                  + ", ".join(f"`{r}`" for r in res["recipe_rules"]) + ") loaded by `from_pretrained` through "
                  "`qcore.integrations.transformers`; weights are the parameters and buffers on the device; a "
                  "GPU's peak memory is the model's weights plus the most its calls allocated on top.", "",
                  "| model | batch | tokens/s | vs float | weights | peak memory |", "|---|---|---|---|---|---|"]
        for r in res["rows"]:
            peak = f"{r['peak_bytes'] / 2**20:.0f} MiB" if r.get("peak_bytes") else "-"
            lines.append(f"| {r['model']} | {r['batch']} | {r['tokens_per_s']:.1f} | {r['vs_float']:.2f}x | "
                         f"{r['weights_bytes'] / 2**20:.1f} MiB | {peak} |")
        lines.append("")
    return "\n".join(lines)


def render(results: Path = RESULTS) -> str:
    """The whole document: the intro, then a section per results file present."""
    parts = [INTRO]
    for name, fn in (("cpu.json", render_cpu), ("gpu.json", render_gpu), ("gpu_pool.json", render_pool),
                     ("gpu_calls.json", render_calls), ("gpu_rules.json", render_rules)):
        path = results / name
        if path.exists():
            parts.append(fn(json.loads(path.read_text())))
    path = results / "matmul.json"
    if path.exists():  # with the runs of some cases on their own (`matmul_*.json`) as its subsections
        runs = [json.loads(p.read_text()) for p in sorted(results.glob("matmul_*.json"))]
        cells = set().union(*(_own_cells(r) for r in runs))
        names = {t["name"] for r in runs for t in r.get("targets", []) if t["status"] != "not measured"}
        parts.append(render_linear(json.loads(path.read_text()), moved=(cells, names)))
        parts += [render_linear(r, separate=True) for r in runs]
    whole = sorted(results.glob("cli*.json"))
    if whole:
        parts.append(render_whole_models([json.loads(p.read_text()) for p in whole]))
    runs = sorted(results.glob("inference_*.json"))
    if runs:
        parts.append(render_inference([json.loads(p.read_text()) for p in runs]))
    return "\n".join(parts).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--out", type=Path, default=DOC)
    ap.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    args = ap.parse_args(argv)
    text = render(args.results)
    if args.check:
        if not args.out.exists() or args.out.read_text() != text:
            print(f"{args.out} is not what {args.results} renders: run python benchmarks/report.py", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
