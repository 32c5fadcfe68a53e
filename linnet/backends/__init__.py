"""Backends, named ``package:mode`` (``torch:eager``, ``torch:inductor``, ``torch:cudagraphs``).

Each backend package turns the Linnet program into an artifact and a Runner; nothing above this seam
knows which one it is using.
"""
from __future__ import annotations

from linnet.backends.runner import CacheShape, Runner
from linnet.errors import LinnetError
from linnet.weights import Weights

BACKENDS = ("torch:eager", "torch:inductor", "torch:cudagraphs")


def create_runner(
    backend: str, weights: Weights, cache: CacheShape = CacheShape(), dtype: str = "f32"
) -> Runner:
    package, _, mode = backend.partition(":")
    if package == "torch":
        from linnet.backends.torch.runner import TorchRunner

        return TorchRunner(weights, cache, dtype=dtype, mode=mode or "eager")
    raise LinnetError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
