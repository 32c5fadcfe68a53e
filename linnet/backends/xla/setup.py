"""Whether the XLA backends can run here, their threads, and the imports their load needs."""
from __future__ import annotations

import importlib.util
import os

from linnet.errors import LinnetError


def unavailable(mode: str) -> str | None:
    if importlib.util.find_spec("jax") is None:
        return "JAX is not installed (pip install jax)"
    return None


def set_threads(n: int) -> None:
    """Keep this process on ``n`` of the CPUs it may use. XLA's CPU client takes no thread count (jaxlib
    0.10: no flag, no client option): it sizes its thread pools from the CPUs the process may run on
    when JAX starts the client, so this must come first (``--threads`` is applied before the runner)."""
    if not hasattr(os, "sched_setaffinity"):
        raise LinnetError("--threads for the XLA backends needs CPU affinity (Linux); leave it out here")
    allowed = sorted(os.sched_getaffinity(0))
    if not 1 <= n <= len(allowed):
        raise LinnetError(f"--threads {n}: this process may run on {len(allowed)} CPUs")
    os.sched_setaffinity(0, allowed[:n])


def prepare(mode: str) -> None:
    import jax

    jax.devices()  # starts the PJRT client
