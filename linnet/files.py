"""Files in and out: written whole or not at all, and safetensors mapped as NumPy arrays without copies."""
from __future__ import annotations

import json
import mmap
import os
import secrets
import shutil
import struct
from collections.abc import Callable, Collection
from contextlib import suppress
from math import prod
from pathlib import Path

import numpy as np

from linnet.dtypes import BY_HF, BY_SAFETENSORS
from linnet.errors import LinnetError, WeightError


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> Path:
    """``write(tmp)`` makes a file or directory at ``tmp``, a fresh name beside ``path``, which is then
    renamed to ``path`` (replacing a file or an empty directory): readers see all of it or nothing, and a
    failure leaves nothing behind. An OSError (full disk, unwritable directory) becomes a LinnetError."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            with suppress(OSError):  # never made, or its directory could not be
                tmp.unlink()
        if isinstance(e, OSError):  # the user's to fix, not a bug: no traceback
            raise LinnetError(f"cannot write to {path}: {e.strerror or e}") from None
        raise
    return path


ALIGNMENT = 64  # a cache line, and a multiple of every vector width


def save_aligned_safetensors(path: Path, arrays: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    """A safetensors file whose tensors start on 64-byte boundaries, wherever their sizes allow.

    safetensors' own writer starts the data at 8 bytes past a multiple of 8, so mapped weights land
    8-byte aligned: inductor then compiles the decode loops for unaligned inputs (3% slower per step in
    an A/B on an AMD EPYC, docs/NOTEBOOK.md). Here the header is padded with spaces, as the format allows,
    and tensors whose byte size is a multiple of 64 come first; any reader of the format reads the file.
    """
    order = sorted(arrays, key=lambda n: (arrays[n].nbytes % ALIGNMENT != 0, n))
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name in order:
        a = arrays[name]
        header[name] = {"dtype": BY_HF[a.dtype.name].safetensors, "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % ALIGNMENT)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name in order:
            f.write(np.ascontiguousarray(arrays[name]).view(np.uint8).data)


def map_safetensors(path: Path, names: Collection[str] | None = None) -> dict[str, np.ndarray]:
    """The tensors of a safetensors file named in ``names`` (all when None), as read-only arrays over a map
    of the file. safetensors' own NumPy loader copies, and refuses bf16."""
    with open(path, "rb") as f:  # an empty file cannot be mapped; it fails as a short header
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if f.seek(0, 2) else b""
    try:
        (size,) = struct.unpack_from("<Q", data)
        header = json.loads(data[8:8 + size])
        start = 8 + size
        arrays = {}
        for name, info in header.items():
            if name == "__metadata__" or (names is not None and name not in names):
                continue
            if info["dtype"] not in BY_SAFETENSORS:
                raise WeightError(f"{path}: tensor {name!r} has dtype {info['dtype']}; "
                                  f"Linnet reads {', '.join(BY_SAFETENSORS)}")
            dtype, (begin, end) = BY_SAFETENSORS[info["dtype"]].numpy, info["data_offsets"]
            count = prod(info["shape"])
            if end - begin != count * dtype.itemsize or start + end > len(data):
                raise ValueError(f"tensor {name!r} needs bytes {start + begin}-{start + end}, the file has {len(data)}")
            arrays[name] = np.frombuffer(data, dtype, count, start + begin).reshape(info["shape"])
    except (struct.error, ValueError, KeyError, TypeError, AttributeError) as e:  # a header of the wrong shape
        raise WeightError(f"cannot read {path} (truncated or not safetensors): {e}") from None
    return arrays
