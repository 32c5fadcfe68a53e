"""`linnet serve` as users run it: a subprocess on a loopback port, answering the openai client, ended by
Ctrl-C; with no MODEL it serves the default model."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import tempfile
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
    log = tempfile.TemporaryFile("w+")  # not a pipe: a server that logged more than a pipe holds would block
    process = subprocess.Popen([sys.executable, "-m", "linnet", "serve", *args, "--port", str(port)],
                               stdout=log, stderr=subprocess.STDOUT, text=True)
    process.log = log  # type: ignore[attr-defined]
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise AssertionError(f"linnet serve exited {process.returncode}: {logged(process)}")
        assert time.monotonic() < deadline, "linnet serve did not come up"
        try:
            if httpx.get(url + "/health").status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)  # not listening yet, or 503 while the model loads


def logged(process: subprocess.Popen) -> str:
    """What the server wrote to stdout and stderr so far."""
    process.log.seek(0)  # type: ignore[attr-defined]
    return process.log.read()  # type: ignore[attr-defined]


def interrupt(process: subprocess.Popen) -> str:
    process.send_signal(signal.SIGINT)
    process.wait(timeout=30)
    output = logged(process)
    assert process.returncode == 0, output
    return output


def test_serve_a_checkpoint_then_ctrl_c(checkpoint_dir):
    path = str(checkpoint_dir(CASE))
    process, url = serve(path, "--rows", "2", "--positions", "128", "--name", "tiny", "--api-key", "k",
                         "--no-prefix-cache")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        for _ in range(2):  # the same prompt again: read whole, without prefix caching
            out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4)
            assert out.usage.completion_tokens >= 1 and out.usage.prompt_tokens_details.cached_tokens == 0
    finally:
        output = interrupt(process)
    assert f"tiny on {default_backend()} f32, 2 rows x 128 positions" in output  # onnx:cpu where installed


def test_a_draft_model_speculates_in_a_served_request(checkpoint_dir):
    """``--speculate MODEL`` (here the target's own checkpoint: the same tokenizer, its drafts kept): a
    greedy completion over HTTP is the server's own tokens without it, and the drafts show in /metrics."""
    from linnet.backends import CacheShape, create_runner
    from linnet.model import open_model
    from linnet.serve import Engine, Params

    path = str(checkpoint_dir(CASE))
    process, url = serve(path, "--rows", "2", "--positions", "128", "--name", "tiny", "--speculate", path,
                         "--draft-tokens", "4", "--backend", "reference:numpy")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        out = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=24, temperature=0,
                                        extra_body={"ignore_eos": True})
        metrics = httpx.get(url + "/metrics").text
    finally:
        interrupt(process)
    drafted = [line for line in metrics.splitlines() if line.startswith("linnet_speculative_draft_tokens_total ")]
    assert drafted and float(drafted[0].split()[1]) > 0
    model = open_model(path)
    engine = Engine(create_runner("reference:numpy", model.weights, CacheShape(1, 128)), model.tokenizer)
    plain = engine.submit(model.tokenizer.encode("The quick brown fox"), Params(max_tokens=24, ignore_eos=True))
    engine.start()
    try:
        assert out.choices[0].text == plain.result().text
    finally:
        engine.stop()


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
    (["--positions", "64", "--speculate", "other-model"],
     "linnet: error: no such model file or directory, and no registry model named 'other-model'"),
    (["--positions", "64", "--speculate", "other-model", "--ngram", "3"],
     "linnet: error: --ngram applies to --speculate ngram, not to a draft model"),
    (["--positions", "64", "--speculate-rows", "2"], "linnet: error: --speculate-rows only applies with --speculate"),
    (["--positions", "64", "--speculate", "ngram", "--draft-tokens", "999"],
     "linnet: error: --draft-tokens must be 1 to"),
])
def test_usage_mistakes_are_one_line(checkpoint_dir, args, message):
    done = subprocess.run([sys.executable, "-m", "linnet", "serve", str(checkpoint_dir(CASE)), *args],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip().splitlines()[0].startswith(message)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_drains_the_requests_in_flight_then_exits_0(checkpoint_dir, sig):
    """The stream that is running when the signal comes is answered whole; the server then takes no new
    connection, and the process exits 0 with a line naming the signal."""
    process, url = serve(str(checkpoint_dir(CASE)), "--rows", "2", "--positions", "128", "--name", "tiny")
    try:
        body = {"model": "tiny", "prompt": "The quick", "max_tokens": 100, "stream": True, "ignore_eos": True,
                "temperature": 0}
        lines = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            for line in filter(None, response.iter_lines()):
                lines.append(line)
                if len(lines) == 2:  # generating: now the signal
                    process.send_signal(sig)
        *pieces, last = lines
        assert last == "data: [DONE]" and '"finish_reason": "length"' in pieces[-1]
        assert len(pieces) == 101  # every token's chunk, then the last one's reason
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health")
        process.wait(timeout=60)
        output = logged(process)
    finally:
        process.kill()
    assert process.returncode == 0, output
    assert output.splitlines()[-1] == f"linnet serve: stopped ({sig.name})"


@pytest.mark.parametrize("where", ["taken", "unresolvable"])
def test_an_address_it_cannot_listen_on_is_one_line_before_the_banner(where):
    """Checked before the model loads (here the default model, which would take seconds), not reported by
    uvicorn after the "serving on" banner."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        host = "127.0.0.1" if where == "taken" else "no.such.host.invalid"
        done = subprocess.run([sys.executable, "-m", "linnet", "serve", "--host", host, "--port", str(port)],
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith("linnet: error: ") and ("already in use" if where == "taken" else "does not resolve") in line


def test_a_row_too_short_for_any_chat_is_said_at_start(checkpoint_dir):
    """--positions 10 cannot hold the chat template: a warning says so (it used to start without a word),
    chat requests are refused, and completions of short prompts still answer."""
    process, url = serve(str(checkpoint_dir(CASE)), "--rows", "1", "--positions", "10", "--name", "tiny")
    try:
        chat = httpx.post(url + "/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user",
                                                                                           "content": "hi"}]})
        assert chat.status_code == 400 and chat.json()["error"]["param"] == "prompt"
        done = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert done.status_code == 200
    finally:
        output = interrupt(process)
    assert "linnet serve: warning: --positions 10 holds no chat request (the chat template around an empty " \
           "message takes" in output
