"""The GGUF container: metadata and tensor directory, read straight from a memory map.

``gguf.GGUFReader`` builds several numpy views per array item, which takes ~5 s for the 100k strings
of a typical vocabulary; this reader parses the same header in ~0.1 s and leaves the tensor bytes
mapped. It uses the ``gguf`` package's constants, and its quantisation code for the data itself.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType

from linnet.errors import WeightError

_SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order (GGUF lists dimensions innermost first)
    offset: int  # absolute, in the file
    nbytes: int


class GGUFFile:
    """A GGUF file's metadata (``dict``) and tensors (``raw(name)``: the stored bytes as uint8 rows)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:  # an empty file cannot be mapped; it fails as a short header
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if f.seek(0, 2) else b""
        try:
            self.metadata, self.tensors = self._parse()
        except (struct.error, UnicodeDecodeError, ValueError) as e:
            raise WeightError(f"{self.path} is not a readable GGUF file (truncated or corrupt): {e}") from None
        for info in self.tensors.values():
            if info.offset + info.nbytes > len(self._map):
                raise WeightError(
                    f"{self.path} is truncated: tensor {info.name!r} needs bytes up to "
                    f"{info.offset + info.nbytes}, the file has {len(self._map)}"
                )

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes, shaped ``[*outer dims, bytes per row]`` as ``gguf.quants.dequantize`` expects."""
        info = self.tensors[name]
        data = np.frombuffer(self._map, np.uint8, info.nbytes, info.offset)
        return data.reshape(*info.shape[:-1], -1)

    # -- parsing -----------------------------------------------------------------------------
    def _parse(self) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
        self._pos = 0
        if self._read(4) != b"GGUF":
            raise ValueError("bad magic (not a GGUF file)")
        version = self._scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_kv = self._scalar("<Q"), self._scalar("<Q")
        metadata = {}
        for _ in range(n_kv):
            key = self._string()
            metadata[key] = self._value(GGUFValueType(self._scalar("<I")))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = [self._scalar("<Q") for _ in range(self._scalar("<I"))]
            infos.append((name, dims, self._scalar("<I"), self._scalar("<Q")))
        align = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        start = -(-self._pos // align) * align
        tensors = {}
        for name, dims, type_id, offset in infos:
            qtype = _quant_type(name, type_id)
            block, size = GGML_QUANT_SIZES[qtype]
            if dims[0] % block:
                raise ValueError(f"tensor {name!r} row of {dims[0]} is not a whole number of {qtype.name} blocks")
            nbytes = dims[0] // block * size * prod(dims[1:])
            tensors[name] = TensorInfo(name, qtype, tuple(reversed(dims)), start + offset, nbytes)
        return metadata, tensors

    def _read(self, n: int) -> bytes:
        if self._pos + n > len(self._map):
            raise ValueError(f"unexpected end of file at byte {self._pos}")
        data = self._map[self._pos:self._pos + n]
        self._pos += n
        return data

    def _scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        return self._read(self._scalar("<Q")).decode("utf-8")

    def _value(self, vtype: GGUFValueType) -> Any:
        if vtype == GGUFValueType.STRING:
            return self._string()
        if vtype == GGUFValueType.ARRAY:
            item, count = GGUFValueType(self._scalar("<I")), self._scalar("<Q")
            if item in _SCALARS:  # numeric arrays in one read
                dtype = np.dtype(_SCALARS[item])
                return np.frombuffer(self._read(count * dtype.itemsize), dtype).tolist()
            return [self._value(item) for _ in range(count)]
        return self._scalar(_SCALARS[vtype])


def _quant_type(name: str, type_id: int) -> GGMLQuantizationType:
    try:
        return GGMLQuantizationType(type_id)
    except ValueError:
        raise WeightError(f"tensor {name!r} has GGML type id {type_id}, which Linnet does not know") from None
