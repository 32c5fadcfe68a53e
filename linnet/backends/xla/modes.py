"""The XLA backend's modes, each a runner class: ``jax`` (generated JAX) and ``stablehlo`` (Linnet's own)."""
from __future__ import annotations

from linnet.backends.runner import CacheShape, Runner
from linnet.backends.xla import distributed
from linnet.backends.xla.runner import JaxRunner
from linnet.backends.xla.stablehlo_runner import StableHloRunner
from linnet.errors import LinnetError
from linnet.weights import Weights

MODES = ("jax", "stablehlo")


def create(weights: Weights, cache: CacheShape = CacheShape(), dtype: str = "f32", mode: str = "jax",
           devices: int = 1, num_processes: int = 1, process_id: int = 0, coordinator: str | None = None,
           coordinator_timeout: int = distributed.DEFAULT_TIMEOUT_S) -> Runner:
    if num_processes > 1 and mode != "jax":
        raise LinnetError(f"xla:{mode} runs in one process; --num-processes is for xla:jax")
    if mode == "jax":
        if num_processes > 1:  # before anything starts JAX's client
            distributed.join(num_processes, process_id, coordinator, coordinator_timeout)
        return JaxRunner(weights, cache, dtype, devices, num_processes)
    if mode == "stablehlo":
        if devices != 1:
            raise LinnetError("xla:stablehlo runs on one device; --devices N is for xla:jax")
        return StableHloRunner(weights, cache, dtype)
    raise LinnetError(f"unknown xla mode {mode!r}; choose from {', '.join(MODES)}")
