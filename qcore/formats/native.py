"""qcore's own safetensors format (docs/format.md) as a checkpoint format: the hub of conversions.

Every valid `QuantizedData` and every numpy tensor safetensors stores is written exactly, so this
format accepts anything another format reads. Its detection accepts any safetensors file (a plain
one holds only float tensors), so it runs last.
"""
from __future__ import annotations

from qcore.files import io as qio
from qcore.errors import InvalidDataError
from qcore.spec.payload import QuantizedData
from qcore.backend.protocol import Support
from qcore.formats._st import array_support
from qcore.files.checkpoint import shard_files
from qcore.formats.base import Contents, Format, PathLike, Probe, Tensor

__all__ = ["QcoreFormat"]


class QcoreFormat(Format):
    name = "qcore"
    description = "qcore safetensors (portable payloads + qcore.* metadata); plain safetensors read as floats"
    priority = -100

    def detect(self, probe: Probe) -> bool:
        return probe.safetensors_header is not None

    def read(self, path: PathLike) -> Contents:
        tensors: dict[str, Tensor] = {}
        meta: dict[str, str] | None = None
        for p in shard_files(path):
            meta = dict(qio.read_info(p).metadata) if meta is None else meta
            for name, value in qio.load_data(p).items():
                if name in tensors:
                    raise InvalidDataError(f"{p}: tensor '{name}' is also in another shard")
                tensors[name] = value
        return Contents(tensors, meta or {}, self.name)

    def check(self, name: str, value: Tensor) -> Support:
        if isinstance(value, QuantizedData):
            return Support.yes()
        return array_support(value)

    def write(self, path: PathLike, contents: Contents) -> None:
        self.require(contents)
        qio.save(path, contents.tensors, contents.metadata)
