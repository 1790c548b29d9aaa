"""Every kernel the backend launches, compiled without a GPU: the PTX numba makes, and where CUDA's
`ptxas` is at hand, what the GPU would run (registers, spills, SASS instruction count).

`targets()` is the one list of kernels with the signatures they are launched with: the general
kernels of kernels.py (each of its `SIGNATURES`), and the generated variants of fast.py, gemv.py,
tc.py, frag.py, linear.py and k_decode.py (their `ptx_targets()`). The CI test (`tests/cuda/test_cuda_platform.py`) compiles it for
sm_90 and sm_75; `scripts/kernel_stats.py` `assemble`s any of it once and prints its
`sass_stats`, which is how a kernel change can be sized before it reaches a GPU: every sm_90
instruction is 16 bytes, so the size of a kernel's `.text` section in the cubin is its
instruction count.

`disassemble` adds `nvdisasm` (CUDA's toolkit, or the `nvidia-cuda-nvdisasm` wheel that
`qcore-cuda[ptx]` installs): the SASS listing itself, and `sass_loops` the instructions of each
loop in it (the span of a backward branch), which is where a kernel spends its time.

Needs the real numba.cuda target (not the simulator) and NVRTC/NVVM (`qcore-cuda[ptx]`);
`assemble` also needs `ptxas` (CUDA's toolkit), no GPU.
"""
from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import tempfile
from collections import Counter
from typing import Any, NamedTuple

__all__ = ["Target", "targets", "to_ptx", "Cubin", "assemble", "SassStats", "sass_stats", "find_ptxas", "find_tool",
           "disassemble", "SassLoop", "sass_loops"]


class Target(NamedTuple):
    """A kernel as the backend launches it: `name` (`k_x#i` for the i-th signature of a general
    kernel, `k_x[params]` for a generated variant), its Python function and signature."""

    name: str
    pyfunc: Any
    signature: str
    general: bool  # one of kernels.py's general kernels (the path of GPUs below sm_89)
    max_registers: int | None = None  # the cap the backend compiles it with (ptxas -maxrregcount)


def targets() -> list[Target]:
    """Every kernel and signature the backend launches."""
    from . import fast, frag, gemv, k_decode, k_decode_mma, kernels as K, linear, tc

    out = [Target(f"{name}#{i}", getattr(K, name).py_func, sig, True, K.register_cap(getattr(K, name)))
           for name, sigs in K.SIGNATURES.items() for i, sig in enumerate(sigs)]
    out += [Target(name, fn, sig, False, regs)
            for name, fn, sig, regs in fast.ptx_targets() + gemv.ptx_targets() + tc.ptx_targets()
                                       + frag.ptx_targets() + linear.ptx_targets() + k_decode.ptx_targets()
                                       + k_decode_mma.ptx_targets()]
    return out


def to_ptx(target: Target, cc: tuple[int, int] = (9, 0)) -> str:
    """The PTX of `target` for compute capability `cc`."""
    from numba import cuda

    ptx, _ = cuda.compile_ptx(target.pyfunc, target.signature, cc=cc)
    return ptx


class SassStats(NamedTuple):
    """What ptxas made of one kernel."""

    registers: int  # per thread
    spill_bytes: int  # spill stores + loads
    instructions: int  # SASS instructions (`.text` bytes / 16)


def find_tool(name: str) -> str | None:
    """CUDA's tool `name` (`ptxas`, `nvdisasm`) on PATH, else in $CUDA_HOME/bin, /usr/local/cuda*/bin
    or the `bin` folder of NVIDIA's pip wheels (site-packages/nvidia/cu*/bin); None without one."""
    found = shutil.which(name)
    if found:
        return found
    roots = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"]
    if os.path.isdir("/usr/local"):
        roots += sorted((os.path.join("/usr/local", d) for d in os.listdir("/usr/local") if d.startswith("cuda-")),
                        reverse=True)
    try:
        import nvidia  # the namespace package of NVIDIA's wheels (nvidia-cuda-nvdisasm, ...)

        for base in getattr(nvidia, "__path__", []):
            roots += sorted((os.path.join(base, d) for d in os.listdir(base) if d.startswith("cu")), reverse=True)
    except ImportError:
        pass
    for root in roots:
        path = os.path.join(root, "bin", name) if root else ""
        if path and os.access(path, os.X_OK):
            return path
    return None


def find_ptxas() -> str | None:
    """`ptxas` (`find_tool`)."""
    return find_tool("ptxas")


_UNSUPPORTED = re.compile(r"Unsupported \.version (\d+\.\d+); current version is '(\d+\.\d+)'")


class Cubin(NamedTuple):
    """One PTX module assembled by ptxas (`assemble`)."""

    data: bytes  # the cubin (ELF)
    report: str  # ptxas's verbose output: registers and spills per kernel
    note: str  # "" or how the module's PTX ISA version was lowered


def assemble(ptx: str, arch: str = "sm_90", ptxas: str | None = None, max_registers: int | None = None) -> Cubin:
    """One PTX module assembled under the register cap the backend compiles it with
    (`Target.max_registers`). numba's NVVM may write a newer PTX ISA `.version` than the
    `ptxas` at hand reads; the module is then assembled as the version that ptxas names (the
    note says so), which holds as long as it uses nothing newer."""
    ptxas = ptxas or find_ptxas()
    if ptxas is None:
        raise FileNotFoundError("ptxas not found (CUDA toolkit: PATH, $CUDA_HOME/bin or /usr/local/cuda*/bin)")
    note = ""
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        for _ in range(2):
            with open(src, "w") as f:
                f.write(ptx)
            cap = [f"-maxrregcount={max_registers}"] if max_registers else []
            run = subprocess.run([ptxas, f"-arch={arch}", "-v", *cap, src, "-o", cubin], capture_output=True,
                                 text=True)
            m = _UNSUPPORTED.search(run.stderr)
            if run.returncode == 0 or m is None:
                break
            ptx = re.sub(r"^\.version \d+\.\d+", f".version {m.group(2)}", ptx, count=1, flags=re.M)
            note = f"PTX .version {m.group(1)} assembled as {m.group(2)} (this ptxas)"
        if run.returncode != 0:
            raise RuntimeError(f"ptxas failed: {run.stderr.strip()[-2000:]}")
        with open(cubin, "rb") as f:
            return Cubin(f.read(), run.stderr, note)


def sass_stats(cubin: Cubin) -> dict[str, SassStats]:
    """{kernel symbol: SassStats} of an assembled module."""
    sizes = _text_sizes(cubin.data)
    regs: dict[str, tuple[int, int]] = {}
    current = None
    for line in cubin.report.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            current = m.group(1)
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and current:
            regs[current] = (regs.get(current, (0, 0))[0], int(m.group(1)) + int(m.group(2)))
        m = re.search(r"Used (\d+) registers", line)
        if m and current:
            regs[current] = (int(m.group(1)), regs.get(current, (0, 0))[1])
    return {name: SassStats(regs.get(name, (0, 0))[0], regs.get(name, (0, 0))[1], size // 16)
            for name, size in sizes.items()}


def disassemble(cubin: Cubin, nvdisasm: str | None = None) -> str:
    """The SASS listing of an assembled module's code (`nvdisasm -c`)."""
    nvdisasm = nvdisasm or find_tool("nvdisasm")
    if nvdisasm is None:
        raise FileNotFoundError("nvdisasm not found (CUDA toolkit, or pip install nvidia-cuda-nvdisasm)")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin.data)
        run = subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"nvdisasm failed: {run.stderr.strip()[-2000:]}")
    return run.stdout


class SassLoop(NamedTuple):
    """The span of one backward branch in a SASS listing: a loop body (an outer loop's span holds
    its inner loops)."""

    start: int  # address of the branch target
    end: int  # address of the branch
    opcodes: Counter  # instructions by opcode (without modifiers: LDG.E.64 counts as LDG)

    @property
    def instructions(self) -> int:
        return sum(self.opcodes.values())


_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[0-9T]\s+)?([A-Z][A-Z0-9_]*)[^;]*;")


def sass_loops(sass: str) -> list[SassLoop]:
    """The loops of a SASS listing (`disassemble`), innermost (shortest) first. A branch names its
    target by address (`0x1a30`) or by label (nvdisasm's `` `(.L_x_2) ``, a line `.L_x_2:`
    before the target instruction)."""
    insns = []  # (address, opcode, text)
    labels: dict[str, int] = {}
    pending: list[str] = []
    for line in sass.splitlines():
        lab = re.match(r"^(\.L\w+):", line)
        if lab:
            pending.append(lab.group(1))
            continue
        m = _SASS_LINE.search(line)
        if m:
            addr = int(m.group(1), 16)
            labels.update((name, addr) for name in pending)
            pending.clear()
            insns.append((addr, m.group(2), m.group(0)))
    loops = []
    for addr, op, text in insns:
        if op != "BRA":
            continue
        t = re.search(r"`\((\.L\w+)\)|\b0x([0-9a-f]+)\s*;", text)
        start = (labels.get(t.group(1)) if t.group(1) else int(t.group(2), 16)) if t else None
        if start is not None and start < addr:  # (start == addr: the trap after the kernel's exit)
            loops.append(SassLoop(start, addr, Counter(o for a, o, _ in insns if start <= a <= addr)))
    return sorted(loops, key=lambda lp: (lp.instructions, lp.start))


def _text_sizes(elf: bytes) -> dict[str, int]:
    """{kernel symbol: bytes of its `.text.<symbol>` section} of a 64-bit little-endian ELF cubin."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2:
        raise ValueError("not a 64-bit ELF file")
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    names_off = headers[shstrndx][4]
    out = {}
    for name_off, _type, _flags, _addr, _off, size, *_ in headers:
        end = elf.index(b"\0", names_off + name_off)
        name = elf[names_off + name_off:end].decode()
        if name.startswith(".text."):
            out[name[len(".text."):]] = size
    return out
