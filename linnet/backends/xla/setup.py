"""Whether the XLA backends can run here, and the imports their load needs."""
from __future__ import annotations

import importlib.util


def unavailable(mode: str) -> str | None:
    if importlib.util.find_spec("jax") is None:
        return "JAX is not installed (pip install jax)"
    return None


def prepare(mode: str) -> None:
    import jax

    jax.devices()  # starts the PJRT client
