"""The XLA backend's modes, each a runner class: ``jax`` (generated JAX) and ``stablehlo`` (Linnet's own)."""
from __future__ import annotations

from linnet.backends.runner import CacheShape, Runner
from linnet.backends.xla.runner import JaxRunner
from linnet.backends.xla.stablehlo_runner import StableHloRunner
from linnet.errors import LinnetError
from linnet.weights import Weights

MODES = ("jax", "stablehlo")


def create(weights: Weights, cache: CacheShape = CacheShape(), dtype: str = "f32", mode: str = "jax",
           devices: int = 1) -> Runner:
    if mode == "jax":
        return JaxRunner(weights, cache, dtype, devices)
    if mode == "stablehlo":
        if devices != 1:
            raise LinnetError("xla:stablehlo runs on one device; --devices N is for xla:jax")
        return StableHloRunner(weights, cache, dtype)
    raise LinnetError(f"unknown xla mode {mode!r}; choose from {', '.join(MODES)}")
