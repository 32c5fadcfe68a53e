"""Files in and out: written whole or not at all, with the user's umask, and read back with errors that
name the file and the field; safetensors mapped as NumPy arrays without copies."""
from __future__ import annotations

import json
import mmap
import os
import secrets
import shutil
import struct
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import contextmanager, suppress
from math import prod
from pathlib import Path
from typing import Any, BinaryIO, TypeGuard

import numpy as np

from linnet.dtypes import BY_HF, BY_SAFETENSORS
from linnet.errors import LinnetError, WeightError


def check_output(path: str | Path, force: bool = False) -> None:
    """Every command that writes follows one rule: a path that holds something (a file, or a directory
    with anything in it) is replaced only when the user says ``--force``."""
    path = Path(path)
    if force or not (path.exists() or path.is_symlink()):
        return
    what = "already exists"
    if path.is_dir() and not path.is_symlink():
        with suppress(OSError):
            if not any(path.iterdir()):
                return
        what = "already exists and is not an empty directory"
    raise LinnetError(f"{path} {what}; choose another output, or pass --force to replace it")


def atomic_write(path: str | Path, write: Callable[[Path], object]) -> Path:
    """``write(tmp)`` makes a file or directory at ``tmp``, a fresh name beside ``path``, which then takes
    ``path``'s place, replacing whatever is there: readers see all of it or nothing, and a failure or a
    Ctrl-C leaves nothing behind (and ``path`` as it was). What ``write`` made gets the modes the user's
    umask gives (safetensors' writer makes 0600 files). An OSError (full disk, unwritable directory)
    becomes a LinnetError naming ``path``: the user's to fix, not a bug."""
    path = Path(path)
    tmp = _beside(path, "tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        _apply_umask(tmp)
        _replace(tmp, path)
    except BaseException as e:
        _remove(tmp)
        if isinstance(e, OSError):
            raise LinnetError(f"cannot write to {path}: {e.strerror or e}") from None
        raise
    return path


def _beside(path: Path, what: str) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.{what}")


def _replace(new: Path, path: Path) -> None:
    """``new`` renamed to ``path``; a directory (or a file where a directory was) moves the old one aside
    first, since a rename replaces only a file or an empty directory, and puts it back if the swap fails."""
    if not path.is_dir() and not new.is_dir() or not (path.exists() or path.is_symlink()):
        os.replace(new, path)
        return
    old = _beside(path, "old")
    os.replace(path, old)
    try:
        os.replace(new, path)
    except BaseException:
        os.replace(old, path)
        raise
    _remove(old)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with suppress(OSError):  # never made, or its directory could not be
            path.unlink()


def umask() -> int:
    """The process's umask, read without changing it where Linux says it (a set-and-restore races threads)."""
    with suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _apply_umask(path: Path) -> None:
    """Files 0666 and directories (and executables) 0777, less the umask: what the user's tools would make."""
    mask = umask()
    for p in [path, *(path.rglob("*") if path.is_dir() else ())]:
        if p.is_symlink():
            continue
        executable = p.is_dir() or p.stat().st_mode & 0o100
        os.chmod(p, (0o777 if executable else 0o666) & ~mask)


@contextmanager
def naming(path: str | Path) -> Iterator[None]:
    """A LinnetError raised while reading ``path`` names it (its field is the raiser's to name)."""
    try:
        yield
    except LinnetError as e:
        if str(path) in str(e) or Path(path).name in str(e):
            raise
        raise type(e)(f"{path}: {e}") from None


def read_json(path: Path, error: type[LinnetError] = LinnetError) -> Any:
    """A JSON file's data; unreadable, not UTF-8, not JSON or nested past Python's limit: ``error`` naming it."""
    try:
        return json.loads(Path(path).read_bytes().decode("utf-8"))
    except OSError as e:
        raise error(f"cannot read {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise error(f"{path}: not valid JSON: {e}") from None
    except RecursionError:
        raise error(f"{path}: nested too deeply to read") from None


ALIGNMENT = 64  # a cache line, and a multiple of every vector width


HEADER_ROOM = (2 << 20) - 8  # the header's room before the data, which so starts on a 2 MB boundary


def save_aligned_safetensors(path: Path, arrays: Iterable[tuple[str, np.ndarray]], metadata: dict[str, str]) -> None:
    """A safetensors file of ``arrays`` (name, array pairs, each made when the writer asks for it), whose
    tensors start on 64-byte boundaries wherever their sizes allow.

    safetensors' own writer starts the data at 8 bytes past a multiple of 8, so mapped weights land
    8-byte aligned: inductor then compiles the decode loops for unaligned inputs (3% slower per step in
    an A/B on an AMD EPYC, docs/NOTEBOOK.md). Here the header is padded with spaces, as the format allows,
    and tensors whose byte size is a multiple of 64 come first; any reader of the format reads the file.
    Each array is written as it comes and let go, so a conversion never holds more than one converted array
    (Qwen3 4B's: 8 GB) in memory, and its bytes are written once: the data starts past room kept for the
    header (``HEADER_ROOM``), and only the arrays of other sizes wait in a side file to go last. A header
    larger than the room (tens of thousands of tensors) has the file put together again behind it.
    """
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0  # the data written so far, from the data's start
    later: list[tuple[str, int, int]] = []  # (name, start in the side file, size)
    side = path.with_name(path.name + ".data")
    try:
        with open(path, "wb") as out, open(side, "w+b") as rest:
            out.seek(8 + HEADER_ROOM)
            for name, a in arrays:
                header[name] = {"dtype": BY_HF[a.dtype.name].safetensors, "shape": list(a.shape)}
                data = np.ascontiguousarray(a).view(np.uint8).data
                if a.nbytes % ALIGNMENT == 0:
                    header[name]["data_offsets"] = [offset, offset + a.nbytes]
                    out.write(data)
                    offset += a.nbytes
                else:
                    later.append((name, rest.tell(), a.nbytes))
                    rest.write(data)
                del a, data  # let go before the next is made
            for name, start, size in sorted(later):
                header[name]["data_offsets"] = [offset, offset + size]
                _copy(rest, start, size, out, side)
                offset += size
            text = json.dumps(header, separators=(",", ":")).encode()
            if len(text) <= HEADER_ROOM:
                out.seek(0)
                out.write(struct.pack("<Q", HEADER_ROOM) + text + b" " * (HEADER_ROOM - len(text)))
                return
        _put_behind(path, text, 8 + HEADER_ROOM, offset)
    finally:
        with suppress(FileNotFoundError):
            side.unlink()


def _copy(source: BinaryIO, start: int, size: int, out: BinaryIO, name: Path) -> None:
    """``size`` bytes of the open file ``source`` from ``start`` appended to ``out``, 64 MiB at a time."""
    source.seek(start)
    while size:
        piece = source.read(min(size, 1 << 26))
        if not piece:  # the file cut short under us: never loop on it
            raise OSError(f"{name} ended {size} bytes short")
        out.write(piece)
        size -= len(piece)


def _put_behind(path: Path, text: bytes, start: int, size: int) -> None:
    """Rewrite ``path`` as the header ``text`` (padded to 64 bytes) and the ``size`` bytes it held from ``start``."""
    text += b" " * (-(8 + len(text)) % ALIGNMENT)
    whole = path.with_name(path.name + ".whole")
    try:
        with open(path, "rb") as data, open(whole, "wb") as out:
            out.write(struct.pack("<Q", len(text)) + text)
            _copy(data, start, size, out, path)
        os.replace(whole, path)
    finally:
        with suppress(FileNotFoundError):
            whole.unlink()


def map_safetensors(path: Path, names: Collection[str] | None = None) -> dict[str, np.ndarray]:
    """The tensors of a safetensors file named in ``names`` (all when None), as read-only arrays over a map
    of the file. safetensors' own NumPy loader copies, and refuses bf16. Every header field is checked
    before an array is made: a broken file is a WeightError naming the file, the tensor and the field."""
    try:
        with open(path, "rb") as f:  # an empty file cannot be mapped; it fails as a short header
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if f.seek(0, 2) else b""
    except OSError as e:
        raise WeightError(f"cannot read {path}: {e.strerror or e}") from None

    def fail(message: str) -> WeightError:
        return WeightError(f"cannot read {path}: {message}")

    if len(data) < 8:
        raise fail(f"not a safetensors file: {len(data)} bytes, too short for the header's length")
    (size,) = struct.unpack_from("<Q", data)
    if size > len(data) - 8:
        raise fail(f"not a safetensors file, or truncated: a header of {size} bytes, the file has {len(data)}")
    try:
        header = json.loads(bytes(data[8:8 + size]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise fail(f"not a safetensors file: its header is not JSON ({type(e).__name__})") from None
    if not isinstance(header, dict):
        raise fail("not a safetensors file: its header is not a JSON object")
    start = 8 + size
    arrays = {}
    for name, info in header.items():
        if name == "__metadata__" or (names is not None and name not in names):
            continue
        dtype, shape, (begin, end) = _tensor_entry(info, fail, f"tensor {name!r}")
        count = prod(shape)
        if end - begin != count * dtype.itemsize:
            raise fail(f"tensor {name!r}: data_offsets span {end - begin} bytes, its shape {shape} "
                       f"in {dtype.name} needs {count * dtype.itemsize}")
        if start + end > len(data):
            raise fail(f"tensor {name!r}: data_offsets reach byte {start + end}, the file has {len(data)}: "
                       "truncated")
        arrays[name] = np.frombuffer(data, dtype, count, start + begin).reshape(shape)
    return arrays


def _tensor_entry(info: Any, fail: Callable[[str], WeightError], where: str
                  ) -> tuple[np.dtype, list[int], tuple[int, int]]:
    """A header entry's dtype, shape and offsets, each checked for type and range."""
    if not isinstance(info, dict):
        raise fail(f"{where}: expected an object with dtype, shape and data_offsets")
    dtype = info.get("dtype")
    if not isinstance(dtype, str) or dtype not in BY_SAFETENSORS:
        raise fail(f"{where} has dtype {dtype}; Linnet reads {', '.join(BY_SAFETENSORS)}")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not _naturals(shape):
        raise fail(f"{where}: shape {shape!r} is not a list of non-negative integers")
    if not _naturals(offsets) or len(offsets) != 2 or offsets[0] > offsets[1]:
        raise fail(f"{where}: data_offsets {offsets!r} is not [begin, end] with 0 <= begin <= end")
    return BY_SAFETENSORS[dtype].numpy, shape, (offsets[0], offsets[1])


def _naturals(value: Any) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(type(v) is int and v >= 0 for v in value)
