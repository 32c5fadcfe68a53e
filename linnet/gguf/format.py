"""The GGUF container: metadata and tensor directory, read straight from a memory map.

``gguf.GGUFReader`` builds several numpy views per array item, which takes ~5 s for the 100k strings
of a typical vocabulary; this reader parses the same header in ~0.1 s and leaves the tensor bytes
mapped. It uses the ``gguf`` package's constants, and its quantisation code for the data itself.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from enum import IntEnum
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


MAX_DIMS = 4  # GGML_MAX_DIMS: llama.cpp's tensors have at most four dimensions
MAX_NESTING = 8  # arrays of arrays: a vocabulary is one level; deeper is a file built to exhaust the stack


class GGUFFile:
    """A GGUF file's metadata (``dict``) and tensors (``raw(name)``: the stored bytes as uint8 rows).

    Every count, type and size in the header is checked against the file before it is used: a file that
    is truncated or corrupt, or claims more than it holds (a 2^60-element tensor, a billion metadata
    keys), is a WeightError naming the file, the byte and the field, and nothing is allocated for a claim
    the file's size cannot back. Parsed metadata takes at most a small multiple of its bytes in the file.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:  # an empty file cannot be mapped; it fails as a short header
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if f.seek(0, 2) else b""
        except OSError as e:
            raise WeightError(f"cannot read {self.path}: {e.strerror or e}") from None
        self._field = "the header"
        try:
            self.metadata, self.tensors = self._parse()
        except _Corrupt as e:
            raise WeightError(f"{self.path} is not a readable GGUF file: {self._field}: {e}") from None
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
            raise _Corrupt("bad magic (not a GGUF file)")
        version = self._scalar("<I")
        if version not in (2, 3):
            raise _Corrupt(f"GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_kv = self._scalar("<Q"), self._scalar("<Q")
        metadata: dict[str, Any] = {}
        for i in range(n_kv):  # a count past the file's end fails at the end, having read only the file
            self._field = f"metadata key {i} of {n_kv}"
            key = self._string()
            self._field = f"metadata {key!r}"
            metadata[key] = self._value(self._type(GGUFValueType))
        infos = []
        for i in range(n_tensors):
            self._field = f"tensor info {i} of {n_tensors}"
            name = self._string()
            self._field = f"tensor {name!r}"
            n_dims = self._scalar("<I")
            if not 1 <= n_dims <= MAX_DIMS:
                raise _Corrupt(f"{n_dims} dimensions (GGUF tensors have 1 to {MAX_DIMS})")
            dims = [self._scalar("<Q") for _ in range(n_dims)]
            if min(dims) < 1:
                raise _Corrupt(f"dimensions {dims} include zero")
            infos.append((name, dims, self._type(GGMLQuantizationType), self._scalar("<Q")))
        self._field = "general.alignment"
        align = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if type(align) is not int or align < 1 or align & (align - 1):
            raise _Corrupt(f"{align!r} is not a power of two")
        start = -(-self._pos // align) * align
        tensors = {}
        for name, dims, qtype, offset in infos:
            self._field = f"tensor {name!r}"
            if name in tensors:
                raise _Corrupt("listed twice")
            if qtype not in GGML_QUANT_SIZES:
                raise _Corrupt(f"GGML type {qtype.name} has no known block size")
            block, size = GGML_QUANT_SIZES[qtype]
            if dims[0] % block:
                raise _Corrupt(f"row of {dims[0]} is not a whole number of {qtype.name} blocks of {block}")
            nbytes = dims[0] // block * size * prod(dims[1:])
            tensors[name] = TensorInfo(name, qtype, tuple(reversed(dims)), start + offset, nbytes)
        return metadata, tensors

    def _read(self, n: int) -> bytes:
        if self._pos + n > len(self._map):
            raise _Corrupt(f"needs {n} bytes at byte {self._pos}, past the end of the file "
                           f"({len(self._map)} bytes): truncated or corrupt")
        data = self._map[self._pos:self._pos + n]
        self._pos += n
        return data

    def _scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self._read(struct.calcsize(fmt)))[0]

    def _type(self, kind: type[IntEnum]) -> Any:
        type_id = self._scalar("<I")
        try:
            return kind(type_id)
        except ValueError:
            raise _Corrupt(f"unknown {kind.__name__} {type_id}") from None

    def _string(self) -> str:
        at = self._pos
        try:
            return self._read(self._scalar("<Q")).decode("utf-8")
        except UnicodeDecodeError:
            raise _Corrupt(f"the string at byte {at} is not UTF-8") from None

    def _value(self, vtype: GGUFValueType, depth: int = 0) -> Any:
        if vtype == GGUFValueType.STRING:
            return self._string()
        if vtype == GGUFValueType.ARRAY:
            if depth == MAX_NESTING:
                raise _Corrupt(f"arrays nested more than {MAX_NESTING} deep")
            item, count = self._type(GGUFValueType), self._scalar("<Q")
            if item in _SCALARS:  # numeric arrays in one read
                dtype = np.dtype(_SCALARS[item])
                return np.frombuffer(self._read(count * dtype.itemsize), dtype).tolist()
            if count > len(self._map) - self._pos:  # each item takes a byte at least
                raise _Corrupt(f"an array of {count} items, more than the file's remaining bytes")
            return [self._value(item, depth + 1) for _ in range(count)]
        return self._scalar(_SCALARS[vtype])


class _Corrupt(Exception):
    """A header that breaks the format; GGUFFile says which file and field."""
