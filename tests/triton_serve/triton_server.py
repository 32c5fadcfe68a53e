"""A real ``tritonserver`` (the one the PyPI package nvidia-pytriton ships) on free loopback ports.

Triton's Python-backend stub is built against NumPy 1 (its tensors come out garbled under NumPy 2), so the
model runs in the stub environment ``.venv/triton-stub``: NumPy 1.26 and ml_dtypes 0.5 over linnet's own
``.venv`` (docs/TRITON.md, "Running it"). The stub finds that Python through ``PATH``, and its
``libpython`` through ``LD_LIBRARY_PATH``.
"""
from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

STUB_ENV = Path(sys.prefix) / "triton-stub"


def missing() -> str | None:
    """Why a Triton server cannot run here, or None."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not (dist() / "bin" / "tritonserver").exists():
        return "tritonserver is not installed (pip install --no-deps nvidia-pytriton==0.7.0)"
    if importlib.util.find_spec("tritonclient") is None or importlib.util.find_spec("grpc") is None:
        return "tritonclient is not installed (pip install --no-deps tritonclient==2.73.0 grpcio python-rapidjson " \
               "geventhttpclient)"
    if not (STUB_ENV / "bin" / "python").exists():
        return f"no Python-backend stub environment at {STUB_ENV} (docs/TRITON.md, 'Running it')"
    return None


def dist() -> Path:
    return Path(importlib.util.find_spec("pytriton").submodule_search_locations[0]) / "tritonserver"


def backends_dir(where: Path) -> Path:
    """Triton's python backend with the stub for this Python's version, as links (pytriton copies them)."""
    python = where / "backends" / "python"
    python.mkdir(parents=True)
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        (python / name).symlink_to(dist() / "backends" / "python" / name)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    (python / "triton_python_backend_stub").symlink_to(dist() / "python_backend_stubs" / version /
                                                       "triton_python_backend_stub")
    return python.parent


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@contextmanager
def tritonserver(repository: Path, work: Path, timeout: float = 120.0) -> Iterator[tuple[str, str]]:
    """Run tritonserver on ``repository`` until every model is ready; yields (HTTP URL, gRPC address)."""
    http, grpc, metrics = free_ports(3)
    env = dict(os.environ, PATH=f"{STUB_ENV / 'bin'}:{os.environ['PATH']}",
               LD_LIBRARY_PATH=":".join(filter(None, [sysconfig.get_config_var("LIBDIR"),
                                                      os.environ.get("LD_LIBRARY_PATH")])))
    log = work / "tritonserver.log"
    command = [str(dist() / "bin" / "tritonserver"), "--model-repository", str(repository),
               "--backend-directory", str(backends_dir(work)), "--http-address", "127.0.0.1",
               "--http-port", str(http), "--grpc-address", "127.0.0.1", "--grpc-port", str(grpc),
               "--metrics-port", str(metrics), "--exit-timeout-secs", "10"]
    with open(log, "w") as out:
        server = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_ready(server, f"http://127.0.0.1:{http}", log, timeout)
        yield f"127.0.0.1:{http}", f"127.0.0.1:{grpc}"
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def wait_ready(server: subprocess.Popen, url: str, log: Path, timeout: float) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"tritonserver exited with {server.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=2) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"tritonserver not ready after {timeout} s:\n{log.read_text()[-4000:]}")
