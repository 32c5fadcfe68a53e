"""``linnet serve`` over two processes on loopback (``--num-processes 2``, xla:jax, one CPU device each):
process 0 serves, process 1 follows its runner calls; the openai client's answers equal one process's, and
SIGTERM to process 0 ends both with status 0. The flags refused where they cannot apply."""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import openai
import pytest
from serve_helpers import CASE, FOX

from linnet.commands._common import check_process_arguments
from linnet.errors import LinnetError

FLAGS = ["--backend", "xla:jax", "--rows", "4", "--positions", "64", "--name", "tiny"]
PROMPTS = [FOX, "hello there, how", "one two three four"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(model: str, port: int, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    log = tempfile.TemporaryFile("w+")  # not a pipe: a process that logged more than a pipe holds would block
    process = subprocess.Popen([sys.executable, "-m", "linnet", "serve", model, *FLAGS, "--port", str(port), *extra],
                               stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
    process.log = log  # type: ignore[attr-defined]
    return process


def logged(process: subprocess.Popen) -> str:
    process.log.seek(0)  # type: ignore[attr-defined]
    return process.log.read()  # type: ignore[attr-defined]


def wait_ready(url: str, processes: list[subprocess.Popen], timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        for process in processes:
            assert process.poll() is None, f"exited {process.returncode}: {logged(process)}"
        assert time.monotonic() < deadline, "linnet serve did not come up"
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)


def answers(url: str) -> dict[str, list[str]]:
    """Greedy completions of two prompts sent at once (one batched step reads both), a streamed one, and a
    sampled one with a seed."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def complete(prompt: str, **extra) -> str:
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=10, **extra).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        together = list(pool.map(lambda p: complete(p, temperature=0), PROMPTS[:2]))
    stream = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=10, temperature=0, stream=True)
    streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    sampled = complete(FOX, temperature=1.0, seed=7)
    return {"together": together, "streamed": [streamed], "sampled": [sampled]}


@pytest.mark.slow
def test_two_processes_serve_the_answers_of_one_then_sigterm_ends_both(checkpoint_dir):
    model = str(checkpoint_dir(CASE))  # 6 heads, 2 kv heads: one kv head per process
    alone_port, port, coordinator = free_port(), free_port(), f"127.0.0.1:{free_port()}"
    joined = ["--num-processes", "2", "--coordinator", coordinator, "--coordinator-timeout", "120"]
    alone = start(model, alone_port)
    # the same --port for both: a follower that opened it would fail, as the port is process 0's
    leader = start(model, port, *joined, "--process-id", "0")
    follower = start(model, port, *joined, "--process-id", "1")
    try:
        wait_ready(f"http://127.0.0.1:{alone_port}", [alone])
        expected = answers(f"http://127.0.0.1:{alone_port}")
        wait_ready(f"http://127.0.0.1:{port}", [leader, follower])
        assert answers(f"http://127.0.0.1:{port}") == expected
        assert all(expected["together"]) and len(set(expected["together"])) == 2  # text, and not the same twice
        leader.send_signal(signal.SIGTERM)
        assert leader.wait(timeout=60) == 0, logged(leader)
        assert follower.wait(timeout=60) == 0, logged(follower)
    finally:
        for process in (alone, leader, follower):
            if process.poll() is None:
                process.kill()
                process.wait()
            print(logged(process))  # shown when the test fails
    lines = logged(follower).splitlines()
    assert "linnet serve: process 1 of 2 follows process 0" in lines
    assert lines[-1] == "linnet serve: process 1 of 2: stopped (process 0 stopped)"
    assert "linnet serve: stopped (SIGTERM)" in logged(leader)
    assert "http://" not in logged(follower)  # it served nothing


@pytest.mark.slow
def test_a_follower_that_loses_process_0_exits_not_hangs(checkpoint_dir):
    model = str(checkpoint_dir(CASE))
    port, coordinator = free_port(), f"127.0.0.1:{free_port()}"
    joined = ["--num-processes", "2", "--coordinator", coordinator, "--coordinator-timeout", "120"]
    leader = start(model, port, *joined, "--process-id", "0")
    follower = start(model, port, *joined, "--process-id", "1")
    try:
        wait_ready(f"http://127.0.0.1:{port}", [leader, follower])
        leader.kill()
        assert follower.wait(timeout=60) != 0  # jax's client ends it (SIGABRT)
    finally:
        for process in (leader, follower):
            if process.poll() is None:
                process.kill()
                process.wait()
    lost = (f"linnet: error: --num-processes 2: process 1 lost the others: a process of the job, or process 0 (the "
            f"coordinator at {coordinator}), stopped answering; this process ends with it")
    deadline = time.monotonic() + 10  # the filter that writes it (linnet.backends.xla.lost_process) may end after
    while logged(follower).splitlines()[-1:] != [lost] and time.monotonic() < deadline:
        time.sleep(0.1)
    lines = logged(follower).splitlines()
    assert lines[-1] == lost, lines[-5:]
    assert not any("Check failure" in line or line.startswith("F1") for line in lines)  # jax's report, replaced


def namespace(backend: str, **extra) -> argparse.Namespace:
    return argparse.Namespace(command="serve", num_processes=2, process_id=0, coordinator="127.0.0.1:1",
                              backend=backend, devices=1, **extra)


def test_serve_takes_several_processes_with_xla_jax_only():
    check_process_arguments(namespace("xla:jax"))  # no longer refused
    with pytest.raises(LinnetError, match=r"^--num-processes runs xla:jax across processes; give --backend xla:jax, "
                                          r"not torch:eager$"):
        check_process_arguments(namespace("torch:eager"))
    with pytest.raises(LinnetError, match=r"^--num-processes runs one model across processes, --replicas replicas of "
                                          r"it through Ray Serve; give one or the other$"):
        check_process_arguments(namespace("xla:jax", replicas=2))
    with pytest.raises(LinnetError, match=r"^linnet bench runs in one process; --num-processes is for linnet run and "
                                          r"linnet serve \(xla:jax\)$"):
        check_process_arguments(argparse.Namespace(command="bench", num_processes=2))
