"""The `run` record each benchmark writes beside its figures: the date, hardware, software and
command of the run, which report.py prints above the run's table (docs state the figures with
the command and hardware that produced them). Imported by the benchmark scripts, which run with
this folder on `sys.path`."""
from __future__ import annotations

import datetime
import os
import platform


def record(hardware: str, software: str, command: str) -> dict:
    """The run record: today's UTC date and the three given strings."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"), "hardware": hardware,
            "software": software, "command": command}


def cpus() -> str:
    """This machine's processor and CPU count, for a CPU benchmark's `hardware`."""
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"


def python() -> str:
    """"Python X.Y.Z", the start of every `software` string."""
    return f"Python {platform.python_version()}"
