"""Why a whole-model run's row carries a note: a code beside the text that says it.

A recipe's `Decision`, a planned tensor and a `TensorResult` carry both: the text for people
(`reason`, `note`) and a `Reason` for code that branches on it (the CLI hides the 1-D tensors
unless --verbose, and shows resumed ones apart). The text may change; the codes do not.
"""
from __future__ import annotations

from enum import Enum

__all__ = ["Reason"]


class Reason(Enum):
    """Why a tensor was kept as it is, or (RESUMED) written by an earlier run."""

    NOT_FLOAT = "not-float"                  # not a float dtype
    ONE_D = "one-d"                          # 1-D (biases, norms), and the recipe does not include them
    MIN_SIZE = "min-size"                    # fewer elements than the recipe's min_size
    RULE_KEEP = "rule-keep"                  # a rule PATTERN=keep names it
    DEFAULT_KEEP = "default-keep"            # a default keep glob (embeddings, norms) names it, no rule does
    NO_RULE = "no-rule"                      # no rule names it and the recipe has no default scheme
    BLOCKS_DO_NOT_FIT = "blocks-do-not-fit"  # the chosen scheme's blocks do not fit its shape
    ALREADY_QUANTIZED = "already-quantized"  # quantized in the source: carried over as it is
    DATA_REFUSED = "data-refused"            # the scheme cannot take its values (NaN/Inf)
    RESUMED = "resumed"                      # in a shard an earlier identical run completed (resume)
