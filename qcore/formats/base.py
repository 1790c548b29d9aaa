"""What a checkpoint format is to qcore: a small class that detects, reads and writes one kind of file.

A format turns a file into `Contents` (`qcore.files.checkpoint`: tensor name -> `QuantizedData` or
numpy array, plus str -> str metadata) and back. Reading is exact or refused: a quantized tensor
becomes `QuantizedData` only when qcore's decode (docs/spec.md, dequantize) gives bit-identical values
to the tool's own dequantize; anything else raises `UnrepresentableError` naming the tensor, the rule
and the way out. Writing is the same promise in the other direction: `check(name, value)` says, before
any byte is written, whether the format holds a tensor exactly, and `write` refuses what `check`
rejects.
"""
from __future__ import annotations

import errno
import os
import reprlib
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

import numpy as np

from qcore.backend.protocol import Support
from qcore.errors import InputError, InvalidDataError, QCoreError, StorageError
from qcore.files.checkpoint import INDEX_SUFFIX, Contents, Tensor, shard_files
from qcore.files.paths import PathLike, parse_json
from qcore.files.stfile import read_header

__all__ = [
    "Contents",
    "Format",
    "FormatNotFoundError",
    "Probe",
    "Tensor",
    "UnrepresentableError",
    "model_folder",
    "parse_json",
    "read_checked",
    "refuse_unread_quantized",
    "short_repr",
    "unread_quantized",
]


class UnrepresentableError(QCoreError, ValueError):
    """A tensor cannot move between a file format and qcore without changing its values."""


class FormatNotFoundError(QCoreError, LookupError):
    """No checkpoint format is registered under a name, or none recognises a file."""


_REPR = reprlib.Repr()
_REPR.maxstring, _REPR.maxother = 200, 40


def short_repr(value: Any) -> str:
    """`repr(value)` cut to a few dozen characters and levels (`reprlib`): a value from a file, shown
    in a one-line message, whatever its size or nesting."""
    return _REPR.repr(value)


def model_folder(path: PathLike) -> str | None:
    """The transformers model folder a checkpoint path stands for: the path itself when it is a
    directory, the index's directory for a `*.safetensors.index.json`, else None (a single file)."""
    p = os.fspath(path)
    if os.path.isdir(p):
        return p
    return os.path.dirname(os.path.abspath(p)) if p.endswith(INDEX_SUFFIX) else None


def _missing(p: str) -> StorageError:
    """The error for a path that does not exist (an OSError with ENOENT, as `qcore.files.paths` raises)."""
    return StorageError(errno.ENOENT, f"{p}: No such file or directory (cannot read it)", p)


@dataclass(frozen=True)
class Probe:
    """What detection looks at: the first bytes of a file and, for safetensors, its header."""

    path: str
    magic: bytes
    safetensors_header: dict[str, Any] | None

    @classmethod
    def of(cls, path: PathLike) -> "Probe":
        """Probe a file; a sharded safetensors checkpoint (its index or folder) probes as one file
        whose header holds every shard's tensors and the first shard's metadata."""
        p = os.fspath(path)
        if not os.path.exists(p):
            raise _missing(p)
        files = shard_files(p)
        if files != [p]:
            probes = [cls.of(f) for f in files]
            header: dict[str, Any] = {"__metadata__": probes[0].metadata}
            for pr in probes:
                header.update((k, v) for k, v in (pr.safetensors_header or {}).items() if k != "__metadata__")
            return cls(p, probes[0].magic, header)
        return cls._of_file(p)

    @classmethod
    def _of_file(cls, p: str) -> "Probe":
        with open(p, "rb") as f:
            magic = f.read(8)
            f.seek(0)
            found = read_header(f)  # None: not a safetensors header (or not JSON, or nested too deeply)
        return cls(p, magic, found[1] if found is not None else None)

    @property
    def tensor_names(self) -> list[str]:
        """Tensor names of a safetensors header (empty for other files)."""
        return [k for k in (self.safetensors_header or {}) if k != "__metadata__"]

    @property
    def metadata(self) -> dict[str, str]:
        meta = (self.safetensors_header or {}).get("__metadata__")
        return dict(meta) if isinstance(meta, dict) else {}


class Format:
    """Base of a checkpoint format; subclasses set the class fields and override the methods.

    Detection runs the registered formats from the highest `priority` down and takes the first
    whose `detect` is true, so a format that accepts any safetensors file (qcore's own) has the
    lowest priority.
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    priority: ClassVar[int] = 0

    def available(self) -> Support:
        """Whether the packages this format needs are installed (a reason when they are not)."""
        return Support.yes()

    def detect(self, probe: Probe) -> bool:
        """True when the file looks like this format (header only, no tensor data read)."""
        raise NotImplementedError

    def read(self, path: PathLike) -> Contents:
        """Every tensor of the file, quantized ones as `QuantizedData` (exact or refused)."""
        raise NotImplementedError(f"format '{self.name}' cannot read files")

    def check(self, name: str, value: Tensor) -> Support:
        """Whether `write` can store `value` exactly (no value changes); a reason when not."""
        return Support.no(f"format '{self.name}' cannot write files")

    def write(self, path: PathLike, contents: Contents) -> None:
        """Write every tensor (all must pass `check`), atomically."""
        raise NotImplementedError(f"format '{self.name}' cannot write files")

    def model_config(self, tensors: Mapping[str, tuple[Any, tuple[int, ...]]]) -> dict | None:
        """The `quantization_config` a loader reads from a model folder's config.json for a model
        whose tensors are {name: (QuantScheme, shape)} (scheme None: a plain tensor), over every
        shard at once; None when this format has none. `qcore.model.export` writes it."""
        return None

    def shard_metadata(self, tensors: Mapping[str, tuple[Any, tuple[int, ...]]]) -> dict[str, str]:
        """Metadata that every shard of a model folder carries, from the whole model's tensors
        ({name: (QuantScheme or None, shape)}, as `model_config`); {} when this format has none.
        `qcore.model.export` puts it into each shard's `Contents.metadata` for `write`."""
        return {}

    def with_options(self, **options: str) -> "Format":
        """A copy of this format with reader/writer options set (`qcore convert --option K=V`)."""
        if options:
            raise InputError(
                f"format '{self.name}' takes no options, got {', '.join(sorted(options))}; drop them"
            )
        return self

    @property
    def writable(self) -> bool:
        return type(self).write is not Format.write

    def require(self, contents: Contents) -> None:
        """Raise `UnrepresentableError` for the first tensor `check` rejects."""
        for name, value in contents.tensors.items():
            ok = self.check(name, value)
            if not ok:
                raise UnrepresentableError(f"tensor '{name}' cannot be written as {self.name}: {ok.reason}")

    def __repr__(self) -> str:
        return f"<format {self.name}>"


# The dtypes quantized codes are stored in (int8 / uint8 / int32 words, float8, 4-bit ml_dtypes).
_CODE_DTYPES = frozenset({"int8", "uint8", "int32", "uint32", "int4", "uint4", "float4_e2m1fn", "float8_e4m3fn",
                          "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e4m3b11fnuz"})
# How a scale tensor is named beside the codes `X` it belongs to, as the tools spell it:
# compressed-tensors / ModelOpt `M.weight_scale` (`_scale_2`), DeepSeek `M.weight_scale_inv`,
# bitsandbytes `W.absmax` and LLM.int8 `M.weight.SCB`, and `X.scale(s)` / `X_scales`.
_SCALE_SUFFIXES = ("_scale", "_scale_inv", "_scale_2", "_scales", ".scale", ".scales", ".absmax", ".SCB")
# Codes whose scales are named by replacing the end of their name: gpt-oss `W.blocks` + `W.scales`,
# GPTQ / AWQ `M.qweight` + `M.scales`.
_SCALE_RENAMES = (("blocks", "scales"), ("qweight", "scales"))


def unread_quantized(plain: Mapping[str, str]) -> tuple[str, str] | None:
    """(codes, scale) names of the first plain tensor that holds quantized codes no reader decoded,
    given the plain tensors' numpy dtype names: a tensor of a code dtype (int8, uint8, int32,
    float8, 4-bit) beside a scale named as the tools name one (`X_scale`, `X_scale_inv`, `X.absmax`,
    `W.blocks` + `W.scales`, ...); None if there is none."""
    for name, dtype in plain.items():
        if dtype not in _CODE_DTYPES:
            continue
        companions = [name + suffix for suffix in _SCALE_SUFFIXES]
        companions += [name[: -len(end)] + new for end, new in _SCALE_RENAMES if name.endswith(end)]
        for c in companions:
            if c in plain and c != name:
                return name, c
    return None


def refuse_unread_quantized(plain: Mapping[str, tuple[str, tuple[int, ...]]], path: PathLike, reader: str) -> None:
    """Raise `InvalidDataError` when `unread_quantized` finds codes among the plain tensors
    ({name: (numpy dtype name, shape)}) that the `reader` format left undecoded."""
    found = unread_quantized({n: d for n, (d, _) in plain.items()})
    if found is not None:
        codes, scale = found
        dtype, shape = plain[codes]
        raise InvalidDataError(
            f"{os.fspath(path)}: tensor '{codes}' ({dtype} {list(shape)}) beside '{scale}' is a quantized tensor "
            f"in a layout the {reader} reader does not decode; qcore does not pass it on as a plain array "
            f"(name the format that holds it with --from, if qcore has one)")


def read_checked(fmt: Format, path: PathLike, *, requantizing: bool = False) -> Contents:
    """`fmt.read(path)`, and no quantized tensor passed on as a plain array: codes beside their
    scale that the reader left as arrays (`unread_quantized`) are an `InvalidDataError` naming them,
    so a layout no reader knows never crosses a conversion as if it were plain tensors; a tensor
    the reader refused (`Contents.refused`) is its `UnrepresentableError`, unless `requantizing`
    (the caller re-quantizes those from the tool's decoded values)."""
    contents = fmt.read(path)
    refused = getattr(contents, "refused", None) or {}
    if refused and not requantizing:
        raise UnrepresentableError(next(iter(refused.values())))
    plain = {n: (v.dtype.name, tuple(v.shape)) for n, v in contents.tensors.items()
             if isinstance(v, np.ndarray) and n not in refused}
    refuse_unread_quantized(plain, path, fmt.name)
    return contents
