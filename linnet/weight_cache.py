"""Converted weights, stored once on disk and memory-mapped on every later load.

A backend that wants another layout or dtype than the checkpoint's (transposed matrices, f16) pays the
conversion once; the result is saved as safetensors under ``$LINNET_CACHE`` (default
``~/.cache/linnet``), keyed by the source files' identity and the conversion's name. The file is kept
in the page cache as 2 MB folios where the kernel allows it, so that every process maps it with huge pages.
"""
from __future__ import annotations

import hashlib
import mmap
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def cache_root() -> Path:
    """Where converted weights and generated modules live; ``LINNET_CACHE=off`` keeps nothing between runs."""
    root = os.environ.get("LINNET_CACHE", str(Path.home() / ".cache" / "linnet"))
    return Path(tempfile.gettempdir()) / "linnet-uncached" if root == "off" else Path(root)


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


def cached_path(source: str, conversion: str) -> Path:
    """Where ``source`` converted by ``conversion`` is kept."""
    key = hashlib.sha256(f"{source}\n{conversion}".encode()).hexdigest()[:24]
    return cache_root() / f"{key}.safetensors"


def cached_tensors(
    source: str | None, conversion: str, build: Callable[[], dict[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """``build()``'s tensors, from the disk cache when this source was converted this way before."""
    if source is None or os.environ.get("LINNET_CACHE") == "off":
        return build()
    path = cached_path(source, conversion)
    if not path.is_file():
        tensors = {name: t.contiguous() for name, t in build().items()}
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata={"source": source[:1000], "conversion": conversion})
            os.replace(tmp, path)  # a crash mid-write never leaves a half file under the real name
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        del tensors
        drop_from_page_cache(path)
    settle_in_huge_pages(path)
    with safe_open(str(path), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}
