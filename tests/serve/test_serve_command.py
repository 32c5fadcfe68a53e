"""`linnet serve` as users run it: a subprocess on a loopback port, answering the openai client, ended by
Ctrl-C; with no MODEL it serves the default model."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
from serve_helpers import CASE

from linnet.commands.serve import default_backend


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve(*args: str, timeout: float = 120.0) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "linnet", "serve", *args, "--port", str(port)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise AssertionError(f"linnet serve exited {process.returncode}: {process.stdout.read()}")
        assert time.monotonic() < deadline, "linnet serve did not come up"
        try:
            if httpx.get(url + "/health").status_code == 200:
                return process, url
        except httpx.TransportError:
            time.sleep(0.2)


def interrupt(process: subprocess.Popen) -> str:
    process.send_signal(signal.SIGINT)
    output, _ = process.communicate(timeout=30)
    assert process.returncode == 0, output
    return output


def test_serve_a_checkpoint_then_ctrl_c(checkpoint_dir):
    path = str(checkpoint_dir(CASE))
    process, url = serve(path, "--rows", "2", "--positions", "128", "--name", "tiny", "--api-key", "k")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert out.usage.completion_tokens >= 1
    finally:
        output = interrupt(process)
    assert f"tiny on {default_backend()} f32, 2 rows x 128 positions" in output  # onnx:cpu where installed


def test_the_default_model_serves_with_no_model_argument():
    process, url = serve("--rows", "2", "--positions", "256", timeout=300)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        (model,) = client.models.list().data
        out = client.chat.completions.create(model=model.id, messages=[{"role": "user", "content": "Hi!"}],
                                             max_tokens=8, temperature=0)
        assert out.choices[0].message.content.strip()
    finally:
        interrupt(process)


@pytest.mark.parametrize("args,message", [
    (["--positions", "100000"], "linnet: error: --positions 100000 is more than the model's 256"),
    (["--rows", "0"], "linnet: error: argument --rows: must be at least 1, got 0"),
])
def test_usage_mistakes_are_one_line(checkpoint_dir, args, message):
    done = subprocess.run([sys.executable, "-m", "linnet", "serve", str(checkpoint_dir(CASE)), *args],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip().splitlines()[0].startswith(message)
