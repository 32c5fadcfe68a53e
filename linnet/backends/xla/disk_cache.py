"""Compiled XLA executables kept on disk, so that a second process loads what the first compiled.

``xla:jax`` uses JAX's persistent compilation cache; ``xla:stablehlo`` compiles its modules through the
PJRT client directly (no ``jax.jit``), so it keeps its own: the serialized executable under a key of
the module text and everything else that shapes the code XLA emits (jaxlib's version, the device,
the host CPU, ``XLA_FLAGS``). Both live under Linnet's cache directory (``$LINNET_CACHE``, default
``~/.cache/linnet``; ``off`` keeps nothing between runs). The files are trusted as Linnet's own: a
serialized executable is machine code, never to be loaded from anywhere else.
"""
from __future__ import annotations

import hashlib
import os
import platform
from collections.abc import Callable
from functools import cache
from pathlib import Path

import jax

from linnet.files import atomic_write
from linnet.weight_cache import cache_root


def directory() -> Path:
    return cache_root() / "xla"


def use_for_jit() -> None:
    """Every ``jax.jit`` compilation from now on is read from, or written to, the disk cache: also the
    small ones (the draw, the argmax), which JAX's defaults would skip for compiling in under a second.
    A folder per host CPU: JAX's key names the device kind ("cpu"), not its instruction sets."""
    cpu = hashlib.sha256(_cpu().encode()).hexdigest()[:16]
    jax.config.update("jax_compilation_cache_dir", str(directory() / "jax" / cpu))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def load_or_compile(text: str, client, devices, build: Callable[[], object]):
    """The executable of the StableHLO module ``text``: deserialized from disk when a process compiled
    it before, else ``build()`` (compiling it) and written for the next."""
    device = devices[0]
    identity = "\n".join((jax.__version__, device.platform, device.device_kind, str(len(devices)), _cpu(),
                          os.environ.get("XLA_FLAGS", ""), text))
    path = directory() / "stablehlo" / f"{hashlib.sha256(identity.encode()).hexdigest()}.bin"
    if path.exists():
        try:
            return client.deserialize_executable(path.read_bytes(), devices)
        except Exception:  # jaxlib's error for an executable it cannot load: compile it again, below
            pass
    executable = build()
    serialized = client.serialize_executable(executable)
    atomic_write(path, lambda tmp: tmp.write_bytes(serialized))
    return executable


@cache
def _cpu() -> str:
    """The host CPU's model and instruction sets, where Linux says (a cache directory shared between
    machines must not hand one CPU's code to another)."""
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine()
    return "\n".join(dict.fromkeys(line for line in info if line.startswith(("model name", "flags"))))
