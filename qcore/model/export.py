"""One step from a float checkpoint to another tool's format: `quantize_model(src, dst, recipe, format=FMT)`.

1. Plan: every tensor's scheme from the recipe, from the source headers alone (`qcore.model.plan`).
2. Check, before any quantization: the target writer must hold each planned tensor exactly
   (`Format.check` on a stand-in payload of the planned shape and scheme). A scheme it cannot hold
   is an `UnrepresentableError` naming the tensor and the schemes that writer holds on that shape
   (the presets and base schemes for which `check` passes), unless a `requantize` rule
   `FROM=TO` names it (FROM: scheme text, or a tensor-name glob / `re:` pattern as recipe rules
   have them): then the tensor is quantized straight to TO from the float source.
3. Quantize with the ordinary streaming pipeline into a hidden staging folder in qcore's format
   (`dst/.qcore-export`, the same shards; `qcore.model.run`).
4. Safetensors targets: each staged shard is read (one shard's tensors in memory), its tensors
   moved to the target byte for byte (`qcore.formats`; a field order the target lacks re-packed)
   and written, atomically, under the same name into `dst`, each with the metadata the target's
   shards share (`Format.shard_metadata` of every staged tensor, from the headers: torchao's list
   of the whole model); then the index (the target's tensor
   names), the other files of the model folder, and `config.json` last, with the target's
   `quantization_config` over every tensor of every shard (`Format.model_config`, also asked of
   the plan in step 2, so a model no one config describes is refused before any work). GGUF: the
   staged folder (with its config.json and tokenizer) is converted to one `.gguf` file
   (`qcore.formats.convert`), which holds the whole model in memory, as gguf's writer does.
5. The staging folder is removed. An interrupted run leaves complete files only and no
   config.json of the target, so the folder is not taken for a finished export.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from qcore.errors import InputError, SchemeError
from qcore.spec.payload import QuantizedData, sections
from qcore.spec.schemes import PRESETS, QuantScheme, QuantValue, base_scheme, scheme as parse_scheme
from qcore.files import io as qio
from qcore.files.paths import atomic_write, check_output_path
from qcore.files.checkpoint import INDEX_SUFFIX, Checkpoint, Contents, check_apart, index_doc, resolve, write_index
from qcore.files.stfile import Reader, np_dtype
from qcore.formats import base as fbase
from qcore.formats.registry import get as get_format
from qcore.files.hfconfig import CONFIG_NAME, export_config
from qcore.model.output import copy_extras, extras_targets, remove_stale_temporaries
from qcore.model.plan import PlannedTensor, plan_shards, prepare_run
from qcore.model.recipe import Recipe, Rule
from qcore.model.results import ModelResult, RunProgress, TensorResult
from qcore.model.run import quantize_checkpoint

__all__ = ["RequantizeRule", "export_model", "parse_requantize"]

STAGE = ".qcore-export"
"""The staging folder of a run (hidden, so a copy of the model folder's other files skips it)."""


@dataclass(frozen=True)
class RequantizeRule:
    """`FROM=TO`: tensors whose planned scheme is `scheme` (or whose name matches `pattern`) are
    quantized to `to` when the target format cannot hold their scheme."""

    text: str
    to: QuantScheme
    scheme: QuantScheme | None = None
    pattern: Rule | None = None

    def matches(self, name: str, planned: QuantScheme) -> bool:
        if self.scheme is not None:
            return self.scheme == planned
        return self.pattern is not None and self.pattern.matches(name)


def parse_requantize(items: Sequence[str]) -> list[RequantizeRule]:
    """`FROM=TO` texts (the last `=` splits): FROM is a scheme when it parses as one and holds no
    glob character, else a tensor-name pattern (glob, or `re:` and a regex, as recipe rules)."""
    out = []
    for text in items:
        if not isinstance(text, str) or "=" not in text:
            raise InputError(f"--requantize takes FROM=TO (FROM a scheme or a tensor-name pattern, TO a scheme), "
                             f"e.g. 'q4s/block32:f16=q4_0' or '*.mlp.*=q8_0', got {text!r}")
        left, _, right = text.rpartition("=")
        left, right = left.strip(), right.strip()
        to = parse_scheme(right)
        sch = None
        if not left.startswith("re:") and not any(c in left for c in "*?["):
            try:
                sch = parse_scheme(left)
            except SchemeError:
                sch = None
        out.append(RequantizeRule(text, to, sch, None if sch is not None else Rule(left, to)))
    return out


def probe(shape: Sequence[int], sch: QuantScheme) -> QuantizedData:
    """A payload of `shape` and `sch` with zero codes and scales (global 1, the scheme's table):
    what `Format.check` looks at (shape and scheme), without quantizing anything."""
    sec = sections(shape, sch)
    parts = [bytes(sec.values + sec.scales)]
    if sec.global_:
        parts.append(struct.pack("<f", 1.0))
    if sec.table:
        parts.append(np.asarray(sch.require_table(), dtype="<f4").tobytes())
    parts.append(bytes(sec.offsets))
    return QuantizedData(tuple(shape), sch, b"".join(parts))


def _holds(fmt: fbase.Format, name: str, value: QuantizedData) -> bool:
    """Whether `fmt` writes `value` exactly, in its own field order or re-packed in the low one."""
    if fmt.check(name, value):
        return True
    return value.scheme.low_order is not value.scheme and bool(fmt.check(name, value.in_low_order()))


def _candidates() -> dict[str, QuantScheme]:
    """The schemes offered in a refusal: every preset and every value's base scheme, per tensor,
    with blocks of 32 (f16 scales) and of 64 (f32 scales), as named texts."""
    out: dict[str, QuantScheme] = dict(PRESETS)
    for v in QuantValue:
        for suffix in ("", "/block32:f16", "/block64:f32"):  # the last: bitsandbytes' default blocks
            try:
                s = parse_scheme(str(base_scheme(v)) + suffix)
            except (SchemeError, InputError):
                continue
            out.setdefault(str(s), s)
    return out


def holdable(fmt: fbase.Format, name: str, shape: Sequence[int]) -> list[str]:
    """The candidate schemes (`_candidates`) that `fmt` holds exactly on a tensor of `shape`."""
    found = []
    for text, s in _candidates().items():
        try:
            ok = _holds(fmt, name, probe(shape, s))
        except (InputError, fbase.UnrepresentableError, ValueError):
            continue
        if ok:
            found.append(text)
    return found


def _likeness(s: QuantScheme, planned: QuantScheme) -> tuple[bool, bool, bool]:
    """How close a holdable scheme is to the planned one (the way out a refusal names first):
    the same value, the same blocks, the same bits."""
    return s.value is planned.value, s.block == planned.block, s.bits == planned.bits


def _pin(name: str) -> str:
    """A recipe pattern that names exactly tensor `name`."""
    return name if not any(c in name for c in "*?[") else "re:^" + re.escape(name) + "$"


def check_plan(fmt: fbase.Format, planned: Sequence[tuple[str, tuple[int, ...], QuantScheme]],
               rules: Sequence[RequantizeRule]) -> dict[str, tuple[QuantScheme, QuantScheme]]:
    """{name: (planned scheme, scheme to write)} of the tensors a `requantize` rule moves; an
    `UnrepresentableError` for the first tensor the target cannot hold and no rule names."""
    moved: dict[str, tuple[QuantScheme, QuantScheme]] = {}
    for name, shape, sch in planned:
        if _holds(fmt, name, probe(shape, sch)):
            continue
        rule = next((r for r in rules if r.matches(name, sch)), None)
        if rule is None:
            why = fmt.check(name, probe(shape, sch)).reason
            can = holdable(fmt, name, shape)
            near = max(can, key=lambda c: _likeness(parse_scheme(c), sch)) if can else "SCHEME"
            offer = f"{fmt.name} holds {', '.join(can)} on shape {list(shape)}" if can else \
                f"{fmt.name} holds none of qcore's presets on shape {list(shape)}"
            raise fbase.UnrepresentableError(
                f"tensor '{name}' ({sch}, shape {list(shape)}) cannot be written as {fmt.name} exactly ({why}); "
                f"{offer}; pass --requantize {sch}={near} (or a tensor pattern=SCHEME) "
                f"or change the recipe")
        if not _holds(fmt, name, probe(shape, rule.to)):
            raise fbase.UnrepresentableError(
                f"tensor '{name}' ({list(shape)}): --requantize {rule.text} gives {rule.to}, which {fmt.name} "
                f"cannot hold either ({fmt.check(name, probe(shape, rule.to)).reason}); "
                f"{fmt.name} holds {', '.join(holdable(fmt, name, shape)) or 'none of the presets'} on this shape")
        moved[name] = (sch, rule.to)
    return moved


def _stand_in(it: PlannedTensor) -> fbase.Tensor:
    """What a planned tensor looks like to a writer's checks, without its data: a payload probe of
    a 1-D quantized tensor (small), else an array of the source dtype and shape that takes no memory."""
    if it.scheme is not None and len(it.head.shape) <= 1:
        return probe(it.head.shape, it.scheme)
    dtype = np_dtype(it.head.dtype)
    return np.lib.stride_tricks.as_strided(np.zeros(1, dtype), tuple(it.head.shape), (0,) * len(it.head.shape))


def _target(fmt_name: str) -> fbase.Format:
    fmt = get_format(fmt_name)
    ok = fmt.available()
    if not ok:
        raise fbase.UnrepresentableError(f"format '{fmt.name}' is not available: {ok.reason}")
    if not fmt.writable:
        raise fbase.UnrepresentableError(f"format '{fmt.name}' is read-only in this qcore; export to another format")
    return fmt


def export_model(src: Any, dst: Any, recipe: Any, backend: Any, *, format: str,
                 requantize: Sequence[str] = (), rules: Sequence[str] = (), max_shard_size: Any = None,
                 stats: bool = True, on_plan: Callable[[int, int], None] | None = None,
                 on_tensor: Callable[[TensorResult], None] | None = None,
                 progress: RunProgress | None = None) -> ModelResult:
    """`quantize_model(..., format=FMT)`: see the module docstring. Returns the ModelResult of the
    quantization with `format`, `requantized` ({name: "FROM -> TO"}) and the target's files."""
    fmt = _target(format)
    moves = parse_requantize(requantize)
    rc, be, _, limit = prepare_run(recipe, rules, backend, (), max_shard_size)
    ck = resolve(src)
    dst_s = os.fspath(dst)
    gguf = fmt.name == "gguf"
    check_apart(ck, dst_s, folder=True)  # (a single file's folder too: the staged shard has its name)
    if gguf:
        check_output_path(dst_s)
    elif os.path.isfile(dst_s):
        raise InputError(f"{dst_s} is a file; a {fmt.name} export is a folder (shards, index, config.json)")

    readers = {s: Reader(ck.path(s)) for s in ck.shards}
    try:
        shards, _ = plan_shards(ck, rc, limit, readers)
    finally:
        for r in readers.values():
            r.close()
    planned = [(it.name, tuple(it.head.shape), it.scheme) for s in shards for it in s.tensors if it.scheme is not None]
    moved = check_plan(fmt, planned, moves)
    carried = [(it.name, tuple(json.loads(it.carried[qio.shape_key(it.name)])),
                parse_scheme(it.carried[qio.scheme_key(it.name)]))
               for s in shards for it in s.tensors if it.scheme is None and qio.scheme_key(it.name) in it.carried]
    check_plan(fmt, carried, ())  # quantized in the source already: no float values to quantize again
    stand_ins = {it.name: _stand_in(it) for s in shards for it in s.tensors if not it.carried}
    plain = [(n, a) for n, a in stand_ins.items() if not isinstance(a, QuantizedData)]
    if gguf and not ck.single_file:  # the model's GGUF names, shapes and tokenizer, checked before any work
        from qcore.formats import gguf_file, gguf_model

        gguf_model.plan(ck.root, stand_ins, gguf_file._gguf())
    for name, arr in plain:  # kept tensors: their dtype and shape must be storable too
        ok = fmt.check(name, arr)
        if not ok:
            raise fbase.UnrepresentableError(f"tensor '{name}' ({arr.dtype}, shape {list(arr.shape)}) is kept by the "
                                             f"recipe and cannot be written as {fmt.name}: {ok.reason}")
    layout = {n: (None, tuple(a.shape)) for n, a in plain}
    layout.update({n: (moved[n][1] if n in moved else sch, shape) for n, shape, sch in [*planned, *carried]})
    fmt.model_config(layout)  # one config must describe the model: refused now, not after the work
    if moved:
        rc = Recipe(rc.scheme, tuple(Rule(_pin(n), to) for n, (_, to) in moved.items()) + rc.rules,
                    rc.include_1d, rc.min_size, rc.keep)

    stage = os.path.join(os.path.dirname(os.path.abspath(dst_s)), "." + os.path.basename(dst_s) + STAGE) \
        if gguf else os.path.join(dst_s, STAGE)
    if os.path.isdir(stage):  # what an interrupted run left
        shutil.rmtree(stage)
    # the staged folder has the source folder's name (GGUF's general.name is the model folder's)
    staged = os.path.join(stage, os.path.basename(os.path.abspath(ck.root)))
    if ck.single_file and limit is None:
        staged = os.path.join(stage, os.path.basename(ck.shards[0]))
    if not gguf and os.path.isfile(os.path.join(dst_s, CONFIG_NAME)):
        os.remove(os.path.join(dst_s, CONFIG_NAME))  # an earlier export's: written again, last, when this one is done
    os.makedirs(stage, exist_ok=True)
    try:
        res = quantize_checkpoint(src, staged, rc, be, max_shard_size=limit, stats=stats, on_plan=on_plan,
                                  on_tensor=on_tensor)
        if gguf:
            from qcore.formats.convert import convert

            convert(staged, dst_s, fmt)
            files = [dst_s]
        else:
            files = _write_folder(fmt, ck, res, staged, dst_s, stage, progress)
    finally:  # a failed or interrupted run leaves the complete files of the target, never the staging folder
        shutil.rmtree(stage, ignore_errors=True)
    res.output, res.files = dst_s, files
    res.format = fmt.name
    res.requantized = {n: f"{a} -> {b}" for n, (a, b) in moved.items()}
    return res


def _write_folder(fmt: fbase.Format, ck: Checkpoint, res: ModelResult, staged: str, dst: str, stage: str,
                  progress: RunProgress | None) -> list[str]:
    """The staged qcore shards as `fmt` shards in `dst`, then the index, other files and config.json."""
    shard_files = [f for f in res.files if not f.endswith(INDEX_SUFFIX)]
    index_src = next((f for f in res.files if f.endswith(INDEX_SUFFIX)), None)
    outs = [os.path.join(dst, os.path.basename(f)) for f in shard_files]
    index = os.path.join(dst, os.path.basename(index_src)) if index_src else None
    extras = extras_targets(ck, dst) if not ck.single_file else {}
    config_src = ck.path(CONFIG_NAME) if not ck.single_file else None
    extras.pop(config_src, None)
    config_dst = os.path.join(dst, CONFIG_NAME)
    if progress is not None:
        progress.plan([*outs, config_dst], index)
    remove_stale_temporaries([*outs, *([index] if index else []), *extras.values(), config_dst])
    copy_extras(extras)
    layout: dict[str, tuple[QuantScheme | None, tuple[int, ...]]] = {}
    model = {e.name: (e.scheme, e.shape) for f in shard_files for e in qio.read_info(f).entries}  # headers only
    shared = {"format": "pt", **fmt.shard_metadata(model)}  # transformers reads "format"
    scratch = os.path.join(stage, "out")
    reader = get_format("qcore")
    for staged_file, out in zip(shard_files, outs):
        ck_in = fbase.read_checked(reader, staged_file)
        tensors: dict[str, fbase.Tensor] = {}
        for name, value in ck_in.tensors.items():
            if isinstance(value, QuantizedData) and not fmt.check(name, value):
                value = value.in_low_order()  # a field order the target lacks: the fields re-packed
            tensors[name] = value
            layout[name] = (value.scheme if isinstance(value, QuantizedData) else None, tuple(value.shape))
        os.makedirs(scratch, exist_ok=True)
        tmp = os.path.join(scratch, os.path.basename(out))
        fmt.write(tmp, Contents(tensors, dict(shared), fmt.name))
        del tensors, ck_in
        os.replace(tmp, out)
    if index is not None:  # the target's tensor names and sizes, the source index's metadata
        weight_map, total = {}, 0
        for out in outs:
            with Reader(out) as r:
                for name, head in r.tensors.items():
                    weight_map[name] = os.path.basename(out)
                    total += head.nbytes
        write_index(index, index_doc(ck.index_metadata, weight_map, total))
    export_config(config_src, config_dst, fmt.model_config(layout))
    return [*outs, *([index] if index else []), config_dst]

