"""Where a whole-model run writes: one file, or a folder with the output shards, an index and the
source folder's other files (config.json with the output's `quantization_config`).

Every runner that writes a folder (qcore's format, dequantize, an export, a distributed run)
sets it up through here: the paths (`run_output`), what a stopped run's report needs
(`RunOutput.plan_progress`), the folder with its other files, config.json and no temporary file
a killed run left (`RunOutput.prepare`), and the index, written last (`rows_index`, `qcore.files.checkpoint.write_index`).
"""
from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from qcore import _signals
from qcore.spec.schemes import QuantScheme
from qcore.files import io as qio
from qcore.files.paths import atomic_write
from qcore.files.checkpoint import Checkpoint, index_doc, write_index
from qcore.files.hfconfig import CONFIG_NAME, quantization_config, write_config
from qcore.model.results import RunProgress, TensorResult

__all__ = ["RunOutput", "run_output", "extras_targets", "copy_extras", "remove_stale_temporaries", "rows_index"]


@dataclass(frozen=True)
class RunOutput:
    """The files a run writes for checkpoint `ck` at `dst`."""

    dst: str
    one_file: bool                   # one file at dst, else a folder
    paths: dict[str, str]            # output shard name -> its path
    index: str | None                # the index file's path; None when none is written
    extras: dict[str, str]           # the model folder's other files: source path -> path under dst
    config: str | None               # where the source's config.json goes (`prepare` writes it), or None

    def plan_progress(self, progress: RunProgress | None, *, kept: Sequence[str] = (),
                      resumable: bool = False) -> None:
        """Fill in `progress` (a folder's shards and index) before anything is written; `kept`
        are the names of the shards an earlier run completed."""
        if progress is not None and not self.one_file:
            progress.plan(list(self.paths.values()), self.index, kept=[self.paths[n] for n in kept],
                          resumable=resumable)

    def prepare(self, ck: Checkpoint, schemes: Mapping[str, QuantScheme] | None,
                recipe_json: str | None = None) -> None:
        """Make the folder, remove the temporary files a killed run left next to this run's files,
        copy the other files and write config.json with qcore's `quantization_config` for the
        quantized tensors `schemes` ({name: scheme}) chosen by `recipe_json` (`schemes` None:
        without one; another method's entry is kept)."""
        if not self.one_file:
            os.makedirs(self.dst, exist_ok=True)
        remove_stale_temporaries([*self.paths.values(), *([self.index] if self.index else []),
                                  *self.extras.values(), *([self.config] if self.config else [])])
        copy_extras(self.extras)
        if self.config is not None:
            entry = quantization_config(schemes, recipe_json) if schemes is not None else None
            write_config(ck.path(CONFIG_NAME), self.config, entry)


def run_output(ck: Checkpoint, dst: str, shards: Sequence[str], *, one_file: bool,
               index_name: str | None) -> RunOutput:
    """The output of a run writing `shards` (output shard names) from `ck` at `dst`: one file
    (`one_file`), else a folder with the shards, an index named `index_name` (None: none) and
    the source folder's other files."""
    paths = {shards[0]: dst} if one_file else {s: os.path.join(dst, s) for s in shards}
    index = os.path.join(dst, index_name) if not one_file and index_name else None
    extras = {} if one_file else extras_targets(ck, dst)
    config = extras.pop(ck.path(CONFIG_NAME), None)  # written with its quantization_config
    return RunOutput(dst, one_file, paths, index, extras, config)


def extras_targets(ck: Checkpoint, dst: str) -> dict[str, str]:
    """The model folder's other files to copy (`Checkpoint.other_files`: no links out of the folder,
    no devices or FIFOs, no loops), as {source path: path under dst}."""
    return {ck.path(rel): os.path.join(dst, rel) for rel in ck.other_files()}


def copy_extras(targets: Mapping[str, str]) -> None:
    """Copy the other files (`extras_targets`), each atomically."""
    for src, target in targets.items():
        os.makedirs(os.path.dirname(target), exist_ok=True)
        atomic_write(target, lambda tmp, src=src: shutil.copyfile(src, tmp))


_TEMP_TOKEN = r"\.(?:[a-z0-9_]{8}|[0-9a-f]{32})\.tmp"
"""The tail of a temporary file's name: `qcore.files.io`'s (tempfile's 8 characters) or a storage
upload's (a uuid): `.NAME.<token>.tmp` next to the file NAME it becomes."""


def remove_stale_temporaries(paths: Iterable[str]) -> None:
    """Remove the temporary files (`.NAME.<token>.tmp`) that a killed run (SIGKILL, a power cut)
    left next to the files `paths` this run writes: they are this run's to replace, and nothing
    else removes them. Other hidden files are left alone."""
    by_folder: dict[str, set[str]] = {}
    for p in paths:
        folder, name = os.path.split(os.path.abspath(p))
        by_folder.setdefault(folder, set()).add(name)
    for folder, names in by_folder.items():
        try:
            entries = os.listdir(folder)
        except OSError:  # not there yet: nothing stale
            continue
        stale = re.compile("|".join(rf"\.{re.escape(n)}{_TEMP_TOKEN}" for n in sorted(names)))
        for entry in entries:
            if stale.fullmatch(entry):
                with _signals.deferred():
                    try:
                        os.unlink(os.path.join(folder, entry))
                    except FileNotFoundError:
                        pass


def rows_index(metadata: Mapping[str, Any], rows: Iterable[TensorResult]) -> dict[str, Any]:
    """The index of a run's output from its rows: each tensor's shard, and the bytes written."""
    rows = list(rows)
    return index_doc(metadata, {r.name: r.file for r in rows}, sum(r.after for r in rows))
