"""What a run was measured on: the CPU, cores, memory, and the versions of everything measured.

Read without importing torch, so the parent never touches an accelerator the workers measure.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from linnet.errors import LinnetError


def _proc_field(path: str, key: str) -> str | None:
    """What follows the colon on the first line of a /proc file that starts with ``key``; None without one."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str | None:
    return _proc_field("/proc/cpuinfo", "model name") or platform.processor() or None


# The vector units that set a CPU's product rate, widest first. The VMs drawn here share a model name
# ("AMD EPYC") across generations with and without AVX-512, whose f32 products differ by about 2x.
VECTOR_UNITS = (("avx512f", "AVX-512"), ("amx_tile", "AMX"))


def cpu_flags() -> set[str]:
    return set((_proc_field("/proc/cpuinfo", "flags") or "").split())


def vector_units(flags: set[str]) -> list[str]:
    """AVX-512 and AMX where present, else AVX2 where present: ``["AVX-512", "AMX"]``, ``["AVX2"]``."""
    units = [name for flag, name in VECTOR_UNITS if flag in flags]
    return units or (["AVX2"] if "avx2" in flags else [])


def cpu() -> str:
    """The CPU as results name it: "AMD EPYC (AVX2), 2 cores", "Intel Xeon (AVX-512, AMX), 2 cores"."""
    units = ", ".join(vector_units(cpu_flags()))
    return f"{cpu_model()}{f' ({units})' if units else ''}, {cores()} cores"


def memory_gib() -> float | None:
    total = _proc_field("/proc/meminfo", "MemTotal:")  # "24576000 kB"
    return round(int(total.split()[0]) / 2**20, 1) if total else None


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


def run_measurement(module: str, args: list[str], env: dict[str, str], what: str, log: Any) -> list[float]:
    """``python -m module args`` in a process of its own with ``env`` (started as the workers or servers
    are), whose last line is a JSON list of samples; ``what`` names it in the progress line and errors."""
    print(f"linnet bench: measuring the {what} ...", file=log, flush=True)
    done = subprocess.run([sys.executable, "-P", "-m", module, *args], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise LinnetError(f"measuring the {what} failed: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])
