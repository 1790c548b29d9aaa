"""What the `qcore` command says when a signal stops it: OUT written, OUT as it was, or nothing;
for a folder, how many of its shards are complete and whether its index is written.

`RUN` is a module value, so that the `qcore` entry point (`_qcore_launch`, through
`qcore.cli.main`) can report truthfully on a signal that lands on the first or last lines of
`qcore.cli.main.main`.
"""
from __future__ import annotations

import os
from typing import Any

from qcore.model.results import FileId, RunProgress, file_id

__all__ = ["RUN", "Terminated", "on_sigterm", "interrupted_message", "track_progress"]

RUN: dict[str, Any] = {"output": None, "before": None, "reported": False, "rc": None, "progress": None}
"""The running command's OUT, what was at OUT before, whether its outcome was reported (with
which exit status), and the files of a folder OUT (`qcore.model.results.RunProgress`)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so the same cleanup runs (exit status 128 + 15)."""


def on_sigterm(signum: int, frame: Any) -> None:
    raise Terminated()


def interrupted_message(output: str | None, before: FileId | None) -> str:
    """Say what the interruption left: OUT written, OUT as it was, or nothing; for a folder, how
    many of its shards are complete and whether its index is written."""
    progress = RUN.get("progress")
    if output and progress is not None and progress.planned:
        return _folder_message(output, progress)
    after = file_id(output)
    if after is not None and after != before:
        if os.path.isdir(output):  # a folder whose files were not tracked (a distributed run)
            return (f"qcore: interrupted; {output} may be incomplete: the same command with --resume keeps the "
                    "complete shards in it and writes the rest")
        return f"qcore: interrupted after {output} was written (it is complete)"
    if before is not None:
        return f"qcore: interrupted; {output} was left as it was"
    return "qcore: interrupted; no output file was written"


def _folder_message(output: str, progress: RunProgress) -> str:
    """What an interrupted run left in its output folder: complete only when every shard and the
    index are; else how many shards are, and the way on."""
    done = set(progress.complete())
    shards = sum(p in done for p in progress.shards)
    index_done = progress.index is None or progress.index in done
    if shards == len(progress.shards) and index_done:
        return f"qcore: interrupted after {output} was written (it is complete)"
    left = f"{shards} of {len(progress.shards)} shards complete"
    if progress.index is not None:
        left += ", and its index" if index_done else ", not its index"
    way = ("the same command with --resume keeps the complete shards in it and writes the rest" if progress.resumable
           else "the same command writes it whole")
    return f"qcore: interrupted; {output} is incomplete ({left}): {way}"


def track_progress() -> RunProgress:
    """A `RunProgress` for this run, where `interrupted_message` finds it."""
    progress = RunProgress()
    RUN["progress"] = progress
    return progress
