"""The public entry points of whole-model work (re-exported by the `qcore` facade):
`quantize_model` (a checkpoint in qcore's format or, with `format=`, another tool's; or a dict),
`quantize_dict` and `dequantize_model`."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from qcore.errors import InputError
from qcore.spec.payload import QuantizedData
from qcore.backend.protocol import Backend, QTensor
from qcore.files import io as qio
from qcore.files.checkpoint import PathLike
from qcore.model.export import export_model
from qcore.model.plan import check_supports, resolve_backend
from qcore.model.recipe import RecipeLike, as_recipe
from qcore.model.results import RunProgress, TensorResult
from qcore.model.run import dequantize_checkpoint, quantize_checkpoint

__all__ = ["quantize_model", "quantize_dict", "dequantize_model"]


def quantize_dict(tensors: Mapping[str, Any], recipe: RecipeLike = None, backend: str | Backend | None = None, *,
                  rules: Sequence[str] = ()) -> dict[str, QTensor | np.ndarray]:
    """Quantize an in-memory state dict: name -> QTensor (chosen by the recipe) or the array as it was.

    Arrays the recipe keeps, or that the scheme cannot take (a block with more dims than the tensor,
    NaN/Inf), come back unchanged.
    """
    if not isinstance(tensors, Mapping):
        raise InputError(f"quantize_dict takes a dict of name -> array, got {type(tensors).__name__}")
    rc = as_recipe(recipe, rules=rules)
    be = resolve_backend(backend)
    check_supports(be, rc)
    out: dict[str, QTensor | np.ndarray] = {}
    for name, x in tensors.items():
        if isinstance(x, (QTensor, QuantizedData)):
            out[name] = x
            continue
        arr = np.asarray(x)
        d = rc.choose(name, arr.shape, arr.dtype)
        if d.scheme is None:
            out[name] = x
            continue
        try:
            out[name] = be.quantize(arr, d.scheme)
        except InputError:
            out[name] = x
    return out


def quantize_model(src: PathLike | Mapping[str, Any], dst: PathLike | None = None, recipe: RecipeLike = None,
                   backend: str | Backend | None = None, *, rules: Sequence[str] = (),
                   max_shard_size: int | str | None = None, resume: bool = False, stats: bool = True,
                   compare: Sequence[Any] = (), on_plan: Callable[[int, int], None] | None = None,
                   on_tensor: Callable[[TensorResult], None] | None = None,
                   progress: RunProgress | None = None, format: str = "qcore",
                   requantize: Sequence[str] = ()) -> Any:
    """Quantize a whole model by `recipe` (a Recipe, scheme text, a .toml path or a dict).

    `src` is a .safetensors file, a sharded checkpoint directory, its index file, a hub id in the
    local hub cache, or an in-memory dict (then the result is `quantize_dict`'s dict, also saved to
    `dst` if given). For files the output is one file when the source is one file (and no
    `max_shard_size`), else a directory with the same shards (or new ones of at most
    `max_shard_size` bytes, e.g. "5GB"), a rewritten index and the source directory's other files.
    `resume` keeps output shards a previous identical run completed. `stats` measures SQNR and max
    error per tensor; `compare` adds the SQNR of other schemes (not written). `on_plan(count, bytes)`
    is called once with the work to do, `on_tensor(row)` after each tensor. `progress` (a
    `RunProgress`) is filled with the output folder's files, to tell what a stopped run left. The
    temporary files a killed run left next to the files written are removed. Returns a ModelResult.

    `format` other than "qcore" ("compressed-tensors", "gguf", "gpt-oss", "bitsandbytes", "torchao", or
    a plugin's) writes that tool's checkpoint in the same step, each tensor in its recipe scheme
    (`qcore.model.export`): a scheme the format cannot hold exactly is an error before any work, unless
    a `requantize` rule "FROM=TO" (FROM a scheme or a tensor-name pattern) names it.
    """
    if format != "qcore":
        if isinstance(src, Mapping) or dst is None:
            raise InputError(f"format={format!r} exports a checkpoint path to dst; give both as paths")
        if resume or compare:
            raise InputError(f"format={format!r} takes neither resume nor compare; drop them")
        return export_model(src, dst, recipe, backend, format=format, requantize=requantize, rules=rules,
                            max_shard_size=max_shard_size, stats=stats, on_plan=on_plan, on_tensor=on_tensor,
                            progress=progress)
    if requantize:
        raise InputError("requantize (--requantize) applies to an export to another format (format=, --format)")
    if isinstance(src, Mapping):
        out = quantize_dict(src, recipe, backend, rules=rules)
        if dst is not None:
            dtypes = {n: np.asarray(src[n]).dtype for n, v in out.items() if isinstance(v, QTensor)}
            qio.save(dst, out, source_dtypes=dtypes, recipe=as_recipe(recipe, rules=rules).to_json())
        return out
    if dst is None:
        raise InputError("quantize_model of a file or directory needs dst, where to write the result")
    return quantize_checkpoint(src, dst, recipe, backend, rules=rules, max_shard_size=max_shard_size, resume=resume,
                               stats=stats, compare=compare, on_plan=on_plan, on_tensor=on_tensor, progress=progress)


def dequantize_model(src: PathLike, dst: PathLike, dtype: Any = None,
                     backend: str | Backend | None = None, *,
                     progress: RunProgress | None = None) -> tuple[int, int]:
    """Dequantize every quantized tensor of a file or checkpoint directory.

    Returns (tensors dequantized, tensors written).

    `dtype` None restores each tensor's recorded source dtype (float32 when none is recorded).
    The output has the source's structure (one file, or shards + index + other files), one
    tensor in memory at a time. The shards and the index are checked as `quantize_model` checks
    them, before anything is written; `progress` is filled as `quantize_model` fills it.
    """
    return dequantize_checkpoint(src, dst, dtype, backend, progress=progress)
