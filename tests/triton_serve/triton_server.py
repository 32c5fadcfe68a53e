"""A real ``tritonserver`` on free loopback ports, started as ``linnet.triton.server`` says (the stub
environment with NumPy 1, this Python's libpython), with the clients the tests drive it by."""
from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from linnet.triton import server


def missing() -> str | None:
    """Why a Triton server cannot run here, or None."""
    if importlib.util.find_spec("tritonclient") is None or importlib.util.find_spec("grpc") is None:
        return "tritonclient is not installed (pip install --no-deps tritonclient==2.73.0 grpcio python-rapidjson " \
               "geventhttpclient)"
    return server.missing()


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@contextmanager
def tritonserver(repository: Path, work: Path, timeout: float = 120.0) -> Iterator[tuple[str, str, str]]:
    """Run tritonserver on ``repository`` until every model is ready; yields its HTTP, gRPC and metrics
    addresses."""
    http, grpc, metrics = free_ports(3)
    log = work / "tritonserver.log"
    with open(log, "w") as out:
        process = subprocess.Popen(server.command(repository, work, http, grpc, metrics),
                                   env=server.environment(dict(os.environ)), stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)  # its group holds the Python backend's stubs too
    try:
        wait_ready(process, f"http://127.0.0.1:{http}", log, timeout)
        yield f"127.0.0.1:{http}", f"127.0.0.1:{grpc}", f"127.0.0.1:{metrics}"
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        try:  # a stub that outlived its server would hold its model's memory
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_ready(process: subprocess.Popen, url: str, log: Path, timeout: float) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"tritonserver exited with {process.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=2) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"tritonserver not ready after {timeout} s:\n{log.read_text()[-4000:]}")
