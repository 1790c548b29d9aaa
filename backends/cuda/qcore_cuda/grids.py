"""Launch configuration shared by the general, row, tile and matmul kernels: the register cap
(`jit_regs`), the device's SM count, the blocks a SM holds (`resident_blocks`), and `launch(n)`
for a grid-stride kernel over n items."""
from __future__ import annotations

import functools

# numba-cuda 0.30.4 under numpy >= 2.5 (the `np.row_stack` alias): every kernel module imports
# this one before numba compiles anything.
from . import _compat  # noqa: F401

from numba import config, cuda  # noqa: E402


def jit_regs(n: int):
    """`cuda.jit` capped at `n` registers per thread on a GPU (occupancy for the memory-bound
    kernels: uncapped, ptxas gives the tile kernel 110 and the matmul 133); the simulator
    rejects the keyword."""
    if config.ENABLE_CUDASIM:
        return cuda.jit
    return cuda.jit(max_registers=n)


def register_cap(kernel) -> int | None:
    """The `jit_regs` cap a kernel dispatcher was made with (None: uncapped, or the simulator's)."""
    return getattr(kernel, "targetoptions", {}).get("max_registers")


@functools.lru_cache(maxsize=None)
def sm_count() -> int:
    """Streaming multiprocessors of the current device (read once per process; it only sizes
    grids, so a later device switch costs speed, never correctness). The simulator: 1."""
    if config.ENABLE_CUDASIM:
        return 1
    return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)


SM_REGS, SM_SMEM, SM_WARPS = 65536, 228 * 1024, 64
"""A SM's registers, shared memory (bytes) and resident warps (compute capability 8.0-9.0)."""


def resident_blocks(warps: int, regs: int, smem: int = 0) -> int:
    """Blocks of `warps` warps at `regs` registers a thread and `smem` bytes of shared memory a
    block that a SM holds at once (the driver keeps 1 KB a block besides): at least 1."""
    return max(1, min(SM_REGS // (32 * warps * regs), SM_SMEM // (smem + 1024), SM_WARPS // warps))


def launch(n: int) -> tuple[int, int]:
    """(blocks, threads) for `n` work items of a grid-stride kernel; never 0 (callers skip n == 0).

    Under the simulator the cost is per launched thread, so the grid stays tiny (2 x 32) and the
    loops stride; on a GPU it is at most 16 blocks of 256 threads per SM.
    """
    if config.ENABLE_CUDASIM:
        return (max(1, min(2, -(-n // 32))), 32)
    tpb = 256
    return (max(1, min(-(-n // tpb), sm_count() * 16)), tpb)
