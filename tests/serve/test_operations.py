"""Operating ``linnet serve``: it answers as loading until the model is ready, a load that fails ends the
process with its reason, a signal drains within ``--drain-timeout``, a step that fails mid-stream ends the
stream with an error chunk and ``[DONE]``, a prompt longer than a row is a 400 with both lengths, and 200
clients that hang up mid-stream leave no row held.

The subprocess tests run the real command with a fault put in its model loading (``LAUNCH``): a load
that waits for a file, one that fails, or a runner whose every step takes a little longer."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import pytest
from serve_helpers import CASE, FOX, running_server, wait_idle
from test_serve_command import free_port, logged

from linnet.backends import CacheShape, create_runner
from linnet.generation import Sampling, generate
from linnet.model import open_model
from linnet.serve import Engine
from linnet.serve.app import create_app

NAME = "tiny"
ROWS, POSITIONS = 4, 128

# `linnet serve` with faults from the environment: LOAD_GATE (a path: the load waits until it exists),
# LOAD_FAILS (a message: building the runner raises it), STEP_DELAY (seconds added to every runner step).
LAUNCH = """
import os, sys, time
import linnet.commands.serve as command
from linnet.cli import main

real = command.make_runner

def make_runner(*args, **kwargs):
    gate = os.environ.get("LOAD_GATE")
    while gate and not os.path.exists(gate):
        time.sleep(0.05)
    if os.environ.get("LOAD_FAILS"):
        raise RuntimeError(os.environ["LOAD_FAILS"])
    runner = real(*args, **kwargs)
    delay, step = float(os.environ.get("STEP_DELAY", "0")), runner.step
    def slow_step(*a, **k):
        time.sleep(delay)
        return step(*a, **k)
    if delay:
        runner.step = slow_step
    return runner

command.make_runner = make_runner
sys.exit(main(["serve", *sys.argv[1:]]))
"""


def launch(checkpoint: Path, *args: str, **faults: str) -> tuple[subprocess.Popen, str]:
    """``linnet serve CHECKPOINT`` (torch:eager, 2 rows x 128) with ``faults``; once its port answers."""
    port = free_port()
    log = tempfile.TemporaryFile("w+")
    process = subprocess.Popen([sys.executable, "-c", LAUNCH, str(checkpoint), "--backend", "torch:eager", "--rows",
                                "2", "--positions", "128", "--name", NAME, "--port", str(port), *args],
                               stdout=log, stderr=subprocess.STDOUT, text=True, env={**os.environ, **faults})
    process.log = log  # type: ignore[attr-defined]
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert process.poll() is None, f"linnet serve exited {process.returncode}: {logged(process)}"
        assert time.monotonic() < deadline, "linnet serve did not come up"
        try:
            httpx.get(url + "/health", timeout=60)
            return process, url
        except httpx.TransportError:
            time.sleep(0.1)


def wait_healthy(url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(url + "/health", timeout=60).status_code != 200:
        assert time.monotonic() < deadline, "the model did not load"
        time.sleep(0.1)


def test_health_says_loading_until_the_model_is_ready(checkpoint_dir, tmp_path):
    gate = tmp_path / "go"
    process, url = launch(checkpoint_dir(CASE), "--api-key", "k", LOAD_GATE=str(gate))
    try:
        health = httpx.get(url + "/health", timeout=60)
        assert health.status_code == 503 and health.json() == {"status": "loading"}
        assert health.headers["retry-after"]
        for path in ("/v1/models", "/v1/completions"):
            api = httpx.request("GET" if path == "/v1/models" else "POST", url + path, timeout=60)
            assert api.status_code == 503, path
            assert api.json()["error"]["message"].startswith("the model is loading")
            assert api.json()["error"]["code"] == "model_loading"
        assert httpx.get(url + "/", timeout=60).status_code == 200  # the chat page waits for the model itself
        with pytest.raises(openai.InternalServerError, match="the model is loading"):
            openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0).models.list()
        gate.touch()
        wait_healthy(url)
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        assert client.completions.create(model=NAME, prompt=FOX, max_tokens=3).usage.completion_tokens >= 1
        assert httpx.get(url + "/v1/models", timeout=60).status_code == 401  # the key holds once loaded
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    assert process.returncode == 0, logged(process)


def test_a_load_that_fails_ends_the_process_with_its_reason(checkpoint_dir):
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", LAUNCH, str(checkpoint_dir(CASE)), "--backend", "torch:eager",
                           "--positions", "128", "--port", str(free_port())],
                          env={**os.environ, "LOAD_FAILS": "no memory for the cache"},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1] == \
        "linnet: error: loading the model failed: RuntimeError: no memory for the cache"
    assert time.monotonic() - started < 60


def test_a_signal_while_loading_stops_at_once(checkpoint_dir, tmp_path):
    process, url = launch(checkpoint_dir(CASE), LOAD_GATE=str(tmp_path / "never"))
    assert httpx.get(url + "/health", timeout=60).status_code == 503
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=30)
    assert process.returncode == 0 and logged(process).splitlines()[-1] == "linnet serve: stopped (SIGTERM)"


def test_the_drain_ends_what_still_runs_at_its_deadline(checkpoint_dir):
    """Each step 100 ms longer: a 100-token stream would take 10 s, past --drain-timeout 1. At the deadline
    it ends with an error chunk and [DONE] (not cut off), and the process exits 0."""
    process, url = launch(checkpoint_dir(CASE), "--drain-timeout", "1", STEP_DELAY="0.1")
    try:
        wait_healthy(url)
        body = {"model": NAME, "prompt": FOX, "max_tokens": 100, "stream": True, "ignore_eos": True}
        lines: list[str] = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            for line in filter(None, response.iter_lines()):
                lines.append(line)
                if len(lines) == 2:
                    signalled = time.monotonic()
                    process.send_signal(signal.SIGTERM)
        assert response.status_code == 200, lines
        ended = time.monotonic() - signalled
        process.wait(timeout=30)
        exited = time.monotonic() - signalled
    finally:
        process.kill()
    *pieces, error, done = lines
    assert done == "data: [DONE]" and json.loads(error.removeprefix("data: "))["error"]["type"] == "server_error"
    assert 2 <= len(pieces) < 90
    assert 1 <= ended < 6 and exited < 60, (ended, exited)
    assert process.returncode == 0 and logged(process).splitlines()[-1] == "linnet serve: stopped (SIGTERM)"


@pytest.fixture(scope="module")
def model(checkpoint_dir):
    return open_model(str(checkpoint_dir(CASE)))


@pytest.fixture(scope="module")
def server(model):
    engine = Engine(create_runner("torch:eager", model.weights, CacheShape(ROWS, POSITIONS)), model.tokenizer)
    with running_server(create_app(engine, NAME)) as url:
        yield engine, url


def test_a_step_that_fails_mid_stream_sends_an_error_chunk_then_done(server, monkeypatch):
    engine, url = server
    step, calls = engine.runner.step, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) > 3:  # the prompt's step and two decode steps, then the fault
            raise RuntimeError("injected fault")
        return step(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "step", failing)
    body = {"model": NAME, "prompt": FOX, "max_tokens": 50, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line]
    *chunks, error, done = lines
    assert done == "[DONE]" and len(chunks) == 3  # a chunk per token sampled before the fault
    assert all(json.loads(c)["choices"][0]["text"] is not None for c in chunks)
    assert json.loads(error)["error"]["message"] == "the model step failed: injected fault"
    whole = httpx.post(url + "/v1/completions", json={**body, "stream": False})
    assert whole.status_code == 500 and "injected fault" in whole.json()["error"]["message"]
    monkeypatch.undo()
    wait_idle(engine)
    out = httpx.post(url + "/v1/completions", json={**body, "stream": False, "max_tokens": 5})
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 5


def test_a_prompt_longer_than_a_row_is_a_400_with_both_lengths(server, model):
    url = server[1]
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=NAME, prompt=[7] * (POSITIONS + 9), max_tokens=1)
    assert f"the prompt has {POSITIONS + 9} tokens, more than a cache row's {POSITIONS} positions" in str(error.value)
    assert error.value.code == "context_length_exceeded"
    long = "fox " * POSITIONS
    tokens = len(model.tokenizer.encode_chat([{"role": "user", "content": long}]))
    with pytest.raises(openai.BadRequestError, match=f"has {tokens} tokens, more than a cache row's {POSITIONS}"):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": long}])


def test_200_clients_that_hang_up_mid_stream_leave_no_row_held(server, model):
    """As vLLM's and llama.cpp's server suites do: 200 streams at once over 4 rows, each client hanging up
    after its role chunk (most still wait in the queue then) or after one to three tokens. Afterwards
    nothing is held or waits, every request was cancelled, and a fresh request answers at once, exactly."""
    engine, url = server
    before = engine.metrics.requests["cancelled"]

    async def one(client: httpx.AsyncClient, i: int) -> None:
        body = {"model": NAME, "messages": [{"role": "user", "content": f"{FOX} {i}"}], "max_tokens": 60,
                "ignore_eos": True, "stream": True}
        tokens = i % 4  # chunks of text it reads after the role chunk
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            chunks = 0
            async for line in response.aiter_lines():
                chunks += line.startswith("data: {")
                if chunks > tokens:
                    return  # leaving the block closes the connection mid-stream
        raise AssertionError(f"client {i}'s stream ended before it hung up")

    async def all_of_them() -> None:
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
            await asyncio.gather(*(one(client, i) for i in range(200)))

    asyncio.run(all_of_them())
    wait_idle(engine, timeout=30)
    assert engine.rows_busy == 0 and engine.queue_length == 0
    assert engine.metrics.requests["cancelled"] - before == 200
    ids = model.tokenizer.encode(FOX)
    want = generate(create_runner("torch:eager", model.weights, CacheShape(1, POSITIONS)), ids, 12, eos_ids=[],
                    tokenizer=model.tokenizer).text
    started = time.monotonic()
    out = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": FOX, "max_tokens": 12, "temperature": 0,
                                                    "ignore_eos": True})
    assert time.monotonic() - started < 5
    assert out.json()["choices"][0]["text"] == want


def test_the_same_seed_gives_the_same_answer_in_any_row(server, model):
    """A seeded request alone (row 0), then beside streams that hold rows 0-2 (row 3), then beside a
    differently seeded request of the same prompt: the same tokens every time, those generate() gives."""
    engine, url = server
    ids = model.tokenizer.encode(FOX)
    sampling = Sampling(temperature=1.0, top_p=0.9, seed=11)
    want = generate(create_runner("torch:eager", model.weights, CacheShape(1, POSITIONS)), ids, 16, sampling,
                    eos_ids=[], tokenizer=model.tokenizer).text
    body = {"model": NAME, "prompt": FOX, "max_tokens": 16, "temperature": 1.0, "top_p": 0.9, "seed": 11,
            "ignore_eos": True}

    async def beside(busy: list[dict]) -> list[str]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            async def ask(b: dict) -> str:
                return (await client.post("/v1/completions", json=b)).json()["choices"][0]["text"]
            others = [asyncio.create_task(ask(b)) for b in busy]
            await asyncio.sleep(0.2)  # they hold their rows now
            mine = await ask(body)
            return [mine, *await asyncio.gather(*others)]

    wait_idle(engine)
    alone = httpx.post(url + "/v1/completions", json=body).json()["choices"][0]["text"]
    crowded, *_ = asyncio.run(beside([{**body, "seed": None, "prompt": f"x{i} {FOX}", "max_tokens": 100}
                                      for i in range(3)]))
    paired = asyncio.run(beside([{**body, "seed": 12}]))
    assert alone == crowded == paired[0] == want
    assert paired[1] != want  # another seed, other tokens: the rows' generators are their own
