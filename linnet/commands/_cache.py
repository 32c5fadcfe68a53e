"""KV-cache sizes checked before anything is allocated: against the model's maximum positions, and against
the memory where the cache would live. Too large a cache used to be a MemoryError trace after seconds of
loading (``serve --rows 100000``: 46 GiB), or, below the kernel's limit, a machine driven into swap."""
from __future__ import annotations

import sys
from pathlib import Path

from linnet.errors import LinnetError
from linnet.spec import ModelSpec

CPU_ONLY = ("reference:numpy", "onnx:cpu")  # backends whose cache is in host memory wherever a GPU is


def check_positions(flag: str, positions: int, spec: ModelSpec) -> None:
    if positions > spec.max_positions:
        raise LinnetError(f"{flag} {positions} is more than the model's {spec.max_positions} positions")


def cache_bytes(spec: ModelSpec, dtype: str, rows: int, positions: int) -> int:
    """The keys and values of ``rows`` cache rows of ``positions``, as ``linnet info`` counts a row's."""
    from linnet.backends.runner import Runner
    from linnet.program import build_program
    from linnet.program.rings import ring_caches

    program = ring_caches(build_program(spec, dtype), positions, Runner.prefill_chunk, positions)
    return rows * program.cache_bytes_per_row(positions)


def check_cache_memory(spec: ModelSpec, dtype: str, backend: str | None, rows: int, positions: int,
                       flags: str) -> None:
    """Refuse a cache larger than the memory free where ``backend`` keeps it; ``flags`` names what sets it."""
    needed = cache_bytes(spec, dtype, rows, positions)
    free, where = free_memory(backend)
    if needed > free:
        raise LinnetError(f"the KV cache of {rows} row{'s' * (rows != 1)} x {positions} positions in {dtype} needs "
                          f"{gib(needed)} ({needed:,} bytes), more than the {gib(free)} {where}; lower {flags}")


def free_memory(backend: str | None) -> tuple[int, str]:
    """Bytes free where ``backend`` (None: the default one) keeps its cache, and a phrase naming the place."""
    from linnet.commands._common import torch_sees_gpu

    if backend not in CPU_ONLY and torch_sees_gpu():
        import torch

        return torch.cuda.mem_get_info()[0], "free on the GPU"
    return host_available(), "this machine has available"


def host_available() -> int:
    """Memory the kernel can give without swapping (MemAvailable), within the container's limit (cgroup v2)."""
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:  # not Linux: nothing to check against
        return sys.maxsize
    fields = dict(line.split(":", 1) for line in lines if ":" in line)
    available = int(fields["MemAvailable"].split()[0]) * 1024
    cgroup = Path("/sys/fs/cgroup")
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            available = min(available, int(limit) - int((cgroup / "memory.current").read_text()))
    except (OSError, ValueError):  # no cgroup v2 here: MemAvailable is the bound
        pass
    return available


def gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"
