"""Tokens per second of transformers' `generate()` on a qcore checkpoint against the float model.

Usage (from the repository root, with qcore, torch and transformers installed)::

    python benchmarks/inference.py --preset small --device cpu --json      # benchmarks/results/inference_cpu.json
    python benchmarks/inference.py --preset 1b --device cuda --json        # benchmarks/results/inference_cuda.json
    python benchmarks/report.py                                            # then render docs/performance.md

A random Llama is built from a transformers config (no download: `--preset` picks the shape),
saved in the float dtype (float32 on the CPU, bfloat16 on a GPU), quantized by `qcore.quantize_model`
with the recipe (default: attention q8s/block32:f16, MLP q4s/block32:f16, embeddings, head and
norms kept) and loaded through `qcore.integrations.transformers`. Both models then run greedy
`generate()` of `--new-tokens` tokens (exactly: `min_new_tokens` too) after a prompt of
`--prompt` random token ids, at each `--batch` size, `--repeats` times in turn; a row is the
median. tokens/s counts generated tokens (batch x new tokens) over the call's wall time. The
weights' bytes are the parameters' and buffers' on the device; on a GPU a model's peak is its
weights' bytes plus the most `torch.cuda.max_memory_allocated` rose above what was allocated
before its call (the two models share the GPU; the other's weights are not counted). Both models generate the same way (a check
that the quantized one runs, not a quality measure: a random model's tokens are noise).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import runinfo  # benchmarks/runinfo.py (this folder is on sys.path when the script runs)

PRESETS = {
    # the tests' shape (tests/integrations/test_transformers.py)
    "tiny": dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
    # a 0.1B model: minutes on a small CPU
    "small": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=6,
                  num_attention_heads=12, num_key_value_heads=4),
    # the shape of Llama 3.2 1B
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True, rope_theta=500000.0),
}
RULES = ["*.self_attn.*=q8s/block32:f16", "*.mlp.*=q4s/block32:f16"]


def _weights_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def _generate_s(torch, model, ids, new_tokens: int, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0)
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    assert out.shape[1] == ids.shape[1] + new_tokens
    return elapsed


def run(args: argparse.Namespace) -> dict:
    import torch
    import transformers

    import qcore
    import qcore.integrations.transformers  # noqa: F401 - registers the "qcore" method

    device = args.device
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(max_position_embeddings=args.prompt + args.new_tokens + 8, bos_token_id=1,
                                   eos_token_id=2, pad_token_id=0, **PRESETS[args.preset])
    with tempfile.TemporaryDirectory(prefix="qcore-inference-") as tmp:
        src, qdir = os.path.join(tmp, "float"), os.path.join(tmp, "qcore")
        transformers.LlamaForCausalLM(cfg).to(dtype).save_pretrained(src)
        qcore.quantize_model(src, qdir, None, args.backend, rules=args.rule, stats=False)
        models = {
            f"torch {str(dtype).removeprefix('torch.')}": transformers.AutoModelForCausalLM.from_pretrained(
                src, dtype=dtype).to(device).eval(),
            "qcore (" + ", ".join(args.rule) + ")": transformers.AutoModelForCausalLM.from_pretrained(
                qdir, dtype=dtype).to(device).eval(),
        }
        backends = sorted({m.qweight.backend.name for _, m in qcore.nn.quantized_linears(list(models.values())[1])})
    rows = []
    gen = torch.Generator().manual_seed(1)
    for batch in args.batch:
        ids = torch.randint(3, cfg.vocab_size, (batch, args.prompt), generator=gen).to(device)
        for m in models.values():  # warm: first calls bind weights, compile kernels, fill caches
            _generate_s(torch, m, ids, 2, device)
        times: dict[str, list[float]] = {name: [] for name in models}
        peaks: dict[str, int] = {}
        for _ in range(args.repeats):
            for name, m in models.items():
                if device == "cuda":  # (both models are on the GPU: a model's peak is its own weights and what its call adds)
                    torch.cuda.synchronize()
                    held = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                times[name].append(_generate_s(torch, m, ids, args.new_tokens, device))
                if device == "cuda":
                    peak = torch.cuda.max_memory_allocated() - held + _weights_bytes(m)
                    peaks[name] = max(peaks.get(name, 0), peak)
        base = None
        for name, m in models.items():
            tps = batch * args.new_tokens / statistics.median(times[name])
            base = base or tps
            rows.append({"model": name, "batch": batch, "tokens_per_s": tps, "vs_float": tps / base,
                         "weights_bytes": _weights_bytes(m), "peak_bytes": peaks.get(name)})
            print(f"{name:50s} batch {batch:3d}: {tps:10.1f} tokens/s ({tps / base:.2f}x), "
                  f"weights {_weights_bytes(m) / 2**20:.1f} MiB", file=sys.stderr)
    hardware = runinfo.cpus() if device == "cpu" else torch.cuda.get_device_name()
    software = (f"{runinfo.python()}, torch {torch.__version__}, transformers {transformers.__version__}, "
                f"qcore backends: {', '.join(backends)}")
    command = "python benchmarks/inference.py " + " ".join(sys.argv[1:])
    return {"run": runinfo.record(hardware, software, command), "preset": args.preset, "config": PRESETS[args.preset],
            "device": device, "prompt": args.prompt, "new_tokens": args.new_tokens, "repeats": args.repeats,
            "recipe_rules": args.rule, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="small")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--backend", default=None, help="qcore backend for quantizing (default: auto)")
    ap.add_argument("--rule", action="append", default=None, help="recipe rules PATTERN=SCHEME (default: %s)" % RULES)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="write benchmarks/results/inference_DEVICE.json")
    args = ap.parse_args(argv)
    args.rule = args.rule or RULES
    res = run(args)
    if args.json:
        out = Path(__file__).resolve().parent / "results" / f"inference_{args.device}.json"
        out.write_text(json.dumps(res, indent=1) + "\n")
        print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
