"""Converted weights, stored once on disk and memory-mapped on every later load.

A conversion (GGUF dequantised, a backend's weight plan) is paid once; the result is saved as safetensors
under ``$LINNET_CACHE`` (default ``~/.cache/linnet``), keyed by the source files' identity and the
conversion: what it does and the source text of the code that does it, so that changed code never
reuses an old result; the least recently used entries go when the cache passes its budget
(``keep_within_budget``). The file is kept in the page cache as 2 MB folios where the kernel allows it, so
that every process maps it with huge pages.
"""
from __future__ import annotations

import hashlib
import mmap
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import ModuleType

import numpy as np

from linnet import files
from linnet.files import atomic_write, map_safetensors, save_aligned_safetensors


def cache_root() -> Path:
    """Where converted weights and generated modules live; ``LINNET_CACHE=off`` keeps nothing between runs."""
    root = os.environ.get("LINNET_CACHE", str(Path.home() / ".cache" / "linnet"))
    return Path(tempfile.gettempdir()) / "linnet-uncached" if root == "off" else Path(root)


DEFAULT_BUDGET_GB = 20.0
GROUPS = ("onnx", "compiled", "xla", "generated")  # folders of the cache whose children are its entries


def used(path: Path) -> None:
    """Mark a cache entry (a file or a folder) as just used: the budget removes the least recently used."""
    try:
        os.utime(path)
    except OSError:
        pass


def keep_within_budget(keep: Path) -> list[Path]:
    """Remove the least recently used cache entries until the cache holds at most ``$LINNET_CACHE_MAX_GB``
    (default 20; keys carry the code's identity, so every new version of Linnet writes new entries and
    the old ones would stay for ever). ``keep``, the entry just written, stays; so do entries still
    being written (dot-names). A process that maps a removed file keeps its mapping. Returns what went."""
    budget = float(os.environ.get("LINNET_CACHE_MAX_GB", DEFAULT_BUDGET_GB)) * 2**30
    root = cache_root()
    entries = [e for group in (root, *(root / g for g in GROUPS)) if group.is_dir()
               for e in group.iterdir() if not e.name.startswith(".") and not (group == root and e.name in GROUPS)]
    sizes = {e: _size(e) for e in entries}
    total, removed = sum(sizes.values()), []
    for entry in sorted(entries, key=_last_use):
        if total <= budget:
            break
        if entry.resolve() == Path(keep).resolve():
            continue
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        total -= sizes[entry]
        removed.append(entry)
    return removed


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _last_use(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


HUGE_PAGE = 2 << 20


def settle_in_huge_pages(path: Path) -> None:
    """Read what of ``path`` the page cache lacks as 2 MB folios, where the kernel can.

    One byte per 2 MB is read through a mapping advised ``MADV_HUGEPAGE`` and ``MADV_RANDOM``: each miss
    then reads one 2 MB folio (Linux 6.16+ on ext4, earlier on xfs), where plain read-ahead starts
    small. Processes that map the file later get huge-page mappings: fewer page faults on first touch
    and fewer TLB misses while decode streams the weights. Cached parts are left as they are (4-16 ms
    for 2 GB here); where huge pages are not supported the advice does nothing, and errors are ignored.
    """
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as view:
            view.madvise(mmap.MADV_HUGEPAGE)
            view.madvise(mmap.MADV_RANDOM)  # exactly one 2 MB folio per miss, no smaller read-ahead
            for offset in range(0, len(view), HUGE_PAGE):
                view[offset]
    except (OSError, ValueError, AttributeError):  # empty file, no mmap advice on this platform
        pass


def drop_from_page_cache(path: Path) -> None:
    """Write ``path`` out and drop it from the page cache, where the platform allows.

    A file just written sits in the page cache in the small folios its writes made, which the settle
    leaves as they are: decode then streams most of its weights through 4 KB pages, 6% slower per step
    on an Intel Xeon (docs/BENCH.md). Dropped, the settle reads it back as 2 MB folios, once.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    except (OSError, AttributeError):  # no posix_fadvise on this platform
        pass


def source_identity(paths: list[Path]) -> str:
    """Path, size and modification time of each file: cheap, and changes when a file is rewritten."""
    parts = []
    for p in sorted(paths):
        st = p.stat()
        parts.append(f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns}")
    return "|".join(parts)


def code_identity(*modules: ModuleType) -> str:
    """A digest of the modules' source files: a conversion's key changes whenever its code does."""
    digest = hashlib.sha256()
    for module in modules:
        assert module.__file__ is not None, f"{module.__name__} has no source file"
        digest.update(Path(module.__file__).read_bytes())
    return digest.hexdigest()[:16]


def cached_path(source: str, key: str) -> Path:
    """Where ``source`` converted as ``key`` says is kept."""
    # files.py writes the file's layout: a change to it is a new conversion too
    digest = hashlib.sha256(f"{source}\n{key}\n{code_identity(files)}".encode()).hexdigest()[:24]
    return cache_root() / f"{digest}.safetensors"


Built = Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]]


def _pairs(built: Built) -> Iterable[tuple[str, np.ndarray]]:
    return built.items() if isinstance(built, Mapping) else built


def cached_arrays(
    source: str | None, key: str, build: Callable[[], Built], settle: bool = True
) -> dict[str, np.ndarray]:
    """``build()``'s arrays, mapped read-only from the disk cache when ``source`` was converted as ``key``
    says before; ``source`` None (weights made in memory) or ``LINNET_CACHE=off``: built, not kept.
    ``build`` may return (name, array) pairs made one at a time: the file is then written as they come,
    each array freed once written. ``settle`` False: the file is not read ahead (a process that reads only
    its slices of the arrays)."""
    if source is None or os.environ.get("LINNET_CACHE") == "off":
        return dict(_pairs(build()))
    path = cached_path(source, key)
    if not path.is_file():
        metadata = {"source": source[:1000], "key": key}
        atomic_write(path, lambda tmp: save_aligned_safetensors(tmp, _pairs(build()), metadata))
        drop_from_page_cache(path)
        keep_within_budget(path)
    used(path)
    if settle:
        settle_in_huge_pages(path)
    return map_safetensors(path)
