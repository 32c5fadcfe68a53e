"""Converted weights, stored once on disk and memory-mapped on every later load.

A backend that wants another layout or dtype than the checkpoint's (transposed matrices, f16) pays the
conversion once; the result is saved as safetensors under ``$LINNET_CACHE`` (default
``~/.cache/linnet``), keyed by the source files' identity and the conversion's name.
"""
from __future__ import annotations

import hashlib
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


def source_identity(paths: list[Path]) -> str:
    """Path, size and modification time of each file: cheap, and changes when a file is rewritten."""
    parts = []
    for p in sorted(paths):
        st = p.stat()
        parts.append(f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns}")
    return "|".join(parts)


def cached_tensors(
    source: str | None, conversion: str, build: Callable[[], dict[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """``build()``'s tensors, from the disk cache when this source was converted this way before."""
    if source is None or os.environ.get("LINNET_CACHE") == "off":
        return build()
    key = hashlib.sha256(f"{source}\n{conversion}".encode()).hexdigest()[:24]
    path = cache_root() / f"{key}.safetensors"
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
    with safe_open(str(path), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}
