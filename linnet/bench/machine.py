"""What a run was measured on: the CPU, cores, memory, and the versions of everything measured.

Read without importing torch, so the parent never touches an accelerator the workers measure.
"""
from __future__ import annotations

import os
import platform
from importlib import metadata
from pathlib import Path


def cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def cores() -> int:
    """The cores this process may run on (what a container or taskset allows, not the host's count)."""
    return len(os.sched_getaffinity(0))


def versions() -> dict[str, str]:
    """In the order the pages list them; a package that is not installed is left out."""
    out = {}
    for label, package in (("Linnet", "linnet"), ("PyTorch", "torch"), ("transformers", "transformers")):
        try:
            out[label] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    out["Python"] = platform.python_version()
    return out
