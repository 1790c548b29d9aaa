"""What a whole-model run reports: a row per tensor, the run's outcome, and the files it writes
(for a caller that reports on a run that stopped early)."""
from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from qcore.model.reasons import Reason
from qcore.model.recipe import Recipe

__all__ = ["TensorResult", "ModelResult", "RunProgress", "FileId", "file_id"]


@dataclass
class TensorResult:
    """What happened to one tensor."""

    name: str
    shape: tuple[int, ...]
    source_dtype: str                 # safetensors dtype name of the source ("F32", "BF16", ...)
    before: int                       # bytes in the source dtype
    after: int                        # bytes written
    scheme: str = ""                  # '' when kept
    note: str = ""                    # why it was kept, or "resumed"
    sqnr: float = math.nan
    max_err: float = math.nan
    file: str = ""                    # output file it went to
    compare: dict[str, float] = field(default_factory=dict)
    reason_code: Reason | None = None  # `note` as a code (None when the run quantized it)

    @property
    def quantized(self) -> bool:
        return bool(self.scheme)


@dataclass
class ModelResult:
    """The outcome of `quantize_model`: a row per tensor, the files written and the shards resumed."""

    source: str
    output: str
    recipe: Recipe
    backend: str
    tensors: list[TensorResult]
    files: list[str]
    resumed: list[str]
    seconds: float
    format: str = "qcore"
    """The output's format (`format=` of `quantize_model`)."""
    requantized: dict[str, str] = field(default_factory=dict)
    """Tensors quantized to another scheme than the recipe's, because the format cannot hold
    that one (`requantize=`): {name: "FROM -> TO"}."""

    @property
    def before(self) -> int:
        return sum(t.before for t in self.tensors)

    @property
    def after(self) -> int:
        return sum(t.after for t in self.tensors)

    @property
    def ratio(self) -> float:
        """Compression against the source dtypes."""
        return self.before / self.after if self.after else math.inf


FileId = tuple[int, int, int]


def file_id(path: str | None) -> FileId | None:
    """What identifies the file at `path` now (inode, size, mtime), or None when there is none."""
    if not path:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


@dataclass
class RunProgress:
    """The files a whole-model run writes into its output folder and which of them are complete,
    for a caller that reports on a run that stopped early (Ctrl-C, SIGTERM, an error).

    Pass one to `quantize_model` or `dequantize_model` (`progress=`); the run fills in its plan
    before it writes anything. Every file is written atomically, so a file that changed since the
    plan is complete; a shard kept by `resume` is complete too. A one-file output has no plan
    (`planned` is False): the file is there whole or not at all.
    """

    shards: list[str] = field(default_factory=list)   # the output shards' paths, in order
    index: str | None = None                          # the index file's path, None when none is written
    kept: list[str] = field(default_factory=list)     # shards an earlier run completed (resume)
    resumable: bool = False                           # whether `resume=True` continues from the shards
    _before: dict[str, FileId | None] = field(default_factory=dict, repr=False)

    def plan(self, shards: Sequence[str], index: str | None, *, kept: Sequence[str] = (),
             resumable: bool = False) -> None:
        """Record the run's files and what was at each path before the run."""
        self._before = {p: file_id(p) for p in [*shards, *([index] if index else [])]}
        self.shards, self.index, self.kept, self.resumable = list(shards), index, list(kept), resumable

    @property
    def planned(self) -> bool:
        return bool(self._before)

    def complete(self) -> list[str]:
        """The shards and the index that are complete now: kept, or written since the plan."""
        return [p for p in self._before if p in self.kept or file_id(p) not in (None, self._before[p])]
