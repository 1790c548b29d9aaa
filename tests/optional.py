"""Optional packages the tests use: skipped where absent, a failure where CI says it installed them."""
import importlib
import os

import pytest

# Which $QCORE_REQUIRE_* flag (set to 1 by scripts/test.sh) makes each package required.
FLAGS = {"torch": "QCORE_REQUIRE_TORCH", "transformers": "QCORE_REQUIRE_TRANSFORMERS",
         "compressed_tensors": "QCORE_REQUIRE_COMPRESSED_TENSORS", "triton": "QCORE_REQUIRE_TRITON"}


def need(module: str, reason: str):
    """`module`, imported; a missing one skips the test file, or fails it when its flag in `FLAGS`
    is 1 (CI installs it, so its absence is a broken install, not a condition to skip)."""
    if os.environ.get(FLAGS[module.split(".")[0]]) == "1":
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=reason)
