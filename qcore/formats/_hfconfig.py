"""What transformers' quantizers read from a model's `quantization_config`, shared by the writers
whose tensors describe themselves (bitsandbytes, torchao): the model-wide settings all quantized
tensors must agree on, and the Linear layers to leave in float.

transformers 5.25 replaces (bitsandbytes, `replace_with_bnb_linear`) or loads as quantized
(torchao, `param_needs_quantization`) every `nn.Linear` except those `get_modules_to_not_convert`
returns: the config's list when it has one (`llm_int8_skip_modules`, `modules_to_not_convert`),
else its own default (the output embedding), each matched by `should_convert_module`.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Hashable, Mapping

from qcore.formats.base import UnrepresentableError
from qcore.formats.gptoss import should_convert

__all__ = ["one_setting", "skip_modules"]

_NAMED = 3  # tensors named per setting in a refusal
OUTPUT_EMBEDDING = "lm_head"
"""The output embedding's module in transformers' *ForCausalLM classes (`get_output_embeddings`)."""


def _module(name: str) -> str:
    return name[: -len(".weight")]


def skip_modules(tensors: Mapping[str, tuple[Any, tuple[int, ...]]]) -> list[str]:
    """The modules a loader must leave in float: each `M.weight` kept 2-D and plain (a Linear kept
    in float; an embedding or norm named too is harmless), sorted. A name that as transformers'
    pattern would also catch a quantized module (`should_convert`: a suffix, or `.` as any
    character) is written escaped (`re.escape`), which matches that module alone. `lm_head` is named
    too when the model has no tensor of it: its weight is tied to the input embedding (transformers'
    own default list names it; with a list it adds none), and replaced by a 4-bit Linear it would
    run on the embedding's float weight."""
    quantized = [_module(n) for n, (s, _) in tensors.items() if s is not None and n.endswith(".weight")]
    plain = {_module(n) for n, (s, shape) in tensors.items() if s is None and len(shape) == 2 and n.endswith(".weight")}
    if not any(n.startswith(OUTPUT_EMBEDDING + ".") for n in tensors):
        plain.add(OUTPUT_EMBEDDING)
    out = []
    for m in sorted(plain - set(quantized)):
        out.append(m if all(should_convert(q, [m]) for q in quantized) else re.escape(m))
    return out


def one_setting(settings: Mapping[str, Hashable], target: str, describe: Callable[[Hashable], str]) -> Hashable:
    """The one model-wide setting every quantized tensor needs ({name: setting}); tensors that need
    different ones are an `UnrepresentableError` naming them, since one `quantization_config`
    describes the whole model. `describe(setting)` says what a setting is."""
    groups: dict[Hashable, list[str]] = {}
    for name, setting in settings.items():
        groups.setdefault(setting, []).append(name)
    if len(groups) > 1:
        parts = []
        for setting, names in groups.items():
            shown = ", ".join(f"'{n}'" for n in names[:_NAMED]) + (f" and {len(names) - _NAMED} more"
                                                                   if len(names) > _NAMED else "")
            parts.append(f"{shown} need {describe(setting)}")
        raise UnrepresentableError(
            f"one {target} quantization_config describes the whole model, but {'; '.join(parts)}; "
            "quantize them all one way (--rule / --requantize) or write single files with qcore convert")
    return next(iter(groups))
