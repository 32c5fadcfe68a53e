"""Running a real ``tritonserver`` (the one the PyPI package nvidia-pytriton ships) on a ``linnet triton``
repository, as the tests and ``linnet bench-serve`` do.

Triton's Python-backend stub is built against NumPy 1 (its tensors come out garbled under NumPy 2), so the
model runs in the stub environment ``STUB_ENV``: NumPy 1.26 and ml_dtypes 0.5 over linnet's own environment
(docs/TRITON.md, "Running it"). The stub finds that Python through ``PATH``, and its ``libpython`` through
``LD_LIBRARY_PATH``.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import sysconfig
from pathlib import Path

STUB_ENV = Path(sys.prefix) / "triton-stub"
PYTHON_VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"


def missing() -> str | None:
    """Why tritonserver cannot host a linnet model here, or None."""
    if importlib.util.find_spec("pytriton") is None or not (dist() / "bin" / "tritonserver").exists():
        return "tritonserver is not installed (pip install --no-deps nvidia-pytriton==0.7.0)"
    if not stub().exists():
        return f"tritonserver has no Python-backend stub for Python {PYTHON_VERSION}"
    if not (STUB_ENV / "bin" / "python").exists():
        return f"no Python-backend stub environment at {STUB_ENV} (docs/TRITON.md, 'Running it')"
    return None


def dist() -> Path:
    """pytriton's copy of Triton: bin/tritonserver, its backends and the stubs (found without importing
    pytriton, whose client needs packages the server does not)."""
    found = importlib.util.find_spec("pytriton")
    assert found is not None and found.submodule_search_locations, "pytriton is not installed"
    return Path(found.submodule_search_locations[0]) / "tritonserver"


def stub() -> Path:
    return dist() / "python_backend_stubs" / PYTHON_VERSION / "triton_python_backend_stub"


def backends_dir(where: Path) -> Path:
    """Triton's python backend with the stub for this Python's version, as links under ``where``."""
    python = where / "backends" / "python"
    python.mkdir(parents=True)
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        (python / name).symlink_to(dist() / "backends" / "python" / name)
    (python / "triton_python_backend_stub").symlink_to(stub())
    return python.parent


def command(repository: Path, work: Path, http: int, grpc: int, metrics: int) -> list[str]:
    """tritonserver on ``repository``, listening on loopback only (by default it takes every address)."""
    return [str(dist() / "bin" / "tritonserver"), "--model-repository", str(repository),
            "--backend-directory", str(backends_dir(work)), "--http-address", "127.0.0.1",
            "--http-port", str(http), "--grpc-address", "127.0.0.1", "--grpc-port", str(grpc),
            "--metrics-address", "127.0.0.1", "--metrics-port", str(metrics), "--exit-timeout-secs", "10"]


def environment(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the stub environment's Python first on PATH and this Python's libpython on LD_LIBRARY_PATH."""
    return {**env, "PATH": os.pathsep.join([str(STUB_ENV / "bin"), *filter(None, [env.get("PATH")])]),
            "LD_LIBRARY_PATH": os.pathsep.join(filter(None, [sysconfig.get_config_var("LIBDIR"),
                                                             env.get("LD_LIBRARY_PATH")]))}
