"""What the GPU would run for the cuda backend's kernels, without a GPU: registers per thread,
spill bytes and SASS instructions of each kernel (numba's PTX assembled by CUDA's `ptxas`).

    python scripts/kernel_stats.py k_fast_quant k_gemv     # kernels whose names match (regex)
    python scripts/kernel_stats.py --list                  # the names
    python scripts/kernel_stats.py k_amax --arch sm_90 --json stats.json
    python scripts/kernel_stats.py 'k_gemv\[1,1,2,1\]' --loops --sass OUT   # + each loop, listings in OUT

Names are those of `qcore_cuda.ptx.targets()`: `k_x#i` for the i-th launch signature of a general
kernel, `k_x[params]` for a generated variant (`k_fast_quant[5]`: the E2M1 quantize kernel).
An instruction count compares two versions of a kernel before either reaches a GPU; it is not
a speed (a memory-bound kernel hides many instructions). `--loops` lists each loop of a kernel
(the span of a backward branch: where it spends its time) with its instructions by opcode, and
`--sass DIR` writes each kernel's SASS listing; both need `nvdisasm` (CUDA's toolkit, or the
`nvidia-cuda-nvdisasm` wheel of `qcore-cuda[ptx]`). Needs `qcore-cuda[ptx]` and ptxas
(PATH, $CUDA_HOME/bin or /usr/local/cuda*/bin); runs with NUMBA_ENABLE_CUDASIM unset.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("patterns", nargs="*", help="regular expressions; a kernel matching any is shown (default: all)")
    ap.add_argument("--arch", default="sm_90", help="ptxas target (default sm_90)")
    ap.add_argument("--list", action="store_true", help="print the kernel names and stop")
    ap.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    ap.add_argument("--loops", action="store_true", help="each loop's instructions by opcode (needs nvdisasm)")
    ap.add_argument("--sass", metavar="DIR", help="write each kernel's SASS listing into DIR (needs nvdisasm)")
    args = ap.parse_args(argv)
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
        print("kernel_stats: unset NUMBA_ENABLE_CUDASIM (the simulator compiles nothing)", file=sys.stderr)
        return 2
    from qcore_cuda import ptx

    chosen = [t for t in ptx.targets() if not args.patterns or any(re.search(p, t.name) for p in args.patterns)]
    if args.list:
        print("\n".join(t.name for t in chosen))
        return 0
    if not chosen:
        print(f"kernel_stats: no kernel matches {args.patterns} (see --list)", file=sys.stderr)
        return 2
    tool = ptx.find_ptxas()
    if tool is None:
        print("kernel_stats: ptxas not found (install CUDA's toolkit or put ptxas on PATH)", file=sys.stderr)
        return 2
    m = re.fullmatch(r"sm_(\d+)(\d)a?", args.arch)
    if m is None:
        print(f"kernel_stats: --arch {args.arch}: write it as sm_90, sm_75, ...", file=sys.stderr)
        return 2
    cc = (int(m.group(1)), int(m.group(2)))
    nvdisasm = ptx.find_tool("nvdisasm") if args.loops or args.sass else None
    if (args.loops or args.sass) and nvdisasm is None:
        print("kernel_stats: nvdisasm not found (pip install nvidia-cuda-nvdisasm, or CUDA's toolkit)", file=sys.stderr)
        return 2
    if args.sass:
        os.makedirs(args.sass, exist_ok=True)
    rows, notes = [], set()
    print(f"{'kernel':34s} {'regs/cap':>9s} {'spill B':>8s} {'SASS instructions':>18s}   ({args.arch}, {tool})")
    for t in chosen:
        cubin = ptx.assemble(ptx.to_ptx(t, cc=cc), args.arch, tool, t.max_registers)
        stats = ptx.sass_stats(cubin)
        notes.add(cubin.note)
        for s in stats.values():  # one entry function per module
            rows.append({"kernel": t.name, "max_registers": t.max_registers, "registers": s.registers,
                         "spill_bytes": s.spill_bytes, "instructions": s.instructions})
            cap = f"/{t.max_registers}" if t.max_registers else ""
            print(f"{t.name:34s} {str(s.registers) + cap:>9s} {s.spill_bytes:8d} {s.instructions:18d}", flush=True)
        if nvdisasm:
            sass = ptx.disassemble(cubin, nvdisasm)
            if args.sass:
                with open(os.path.join(args.sass, re.sub(r"[^A-Za-z0-9_.#,-]", "_", t.name) + ".sass"), "w") as f:
                    f.write(sass)
            if args.loops:
                for lp in ptx.sass_loops(sass):
                    mix = ", ".join(f"{op} {n}" for op, n in lp.opcodes.most_common(8))
                    print(f"  loop {lp.start:#06x}-{lp.end:#06x}: {lp.instructions} instructions ({mix})", flush=True)
    for note in sorted(n for n in notes if n):
        print(f"note: {note}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"arch": args.arch, "ptxas": tool, "notes": sorted(n for n in notes if n), "kernels": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
