"""Backends, named ``package:mode`` (``torch:inductor``, ``reference:numpy``), declared in ``registry``.

Each backend package turns the Linnet program into an artifact and a Runner; nothing above this seam
knows which one it is using.
"""
from __future__ import annotations

from typing import Any

from linnet.backends.registry import backend_ids, get_backend
from linnet.backends.runner import CacheShape, Decode, Prefill, RowResult, Runner


def create_runner(
    backend: str, weights: Any, cache: CacheShape = CacheShape(), dtype: str = "f32", **options: Any
) -> Runner:
    """A runner of ``backend`` (a registry id) over ``weights``, with a KV cache of ``cache``; ``options``
    are the backend's own."""
    return get_backend(backend).create(weights, cache, dtype, **options)


__all__ = ["CacheShape", "Decode", "Prefill", "RowResult", "Runner", "backend_ids", "create_runner"]
