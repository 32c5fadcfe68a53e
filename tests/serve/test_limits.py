"""A server no request can stall: a body past the limit is refused (413) while it is read, a large body is
parsed and tokenised off the event loop (``/health`` answers meanwhile), input that JSON holds but text
cannot is a 400, and every 5xx carries the API's JSON error body."""
from __future__ import annotations

import threading
import time

import httpx
import pytest
from serve_helpers import CASE, running_server

from linnet.backends import CacheShape, create_runner
from linnet.model import open_model
from linnet.serve import Engine
from linnet.serve.app import create_app

NAME = "tiny"
LIMIT = 8 * 2**20


@pytest.fixture(scope="module")
def url(checkpoint_dir):
    model = open_model(str(checkpoint_dir(CASE)))
    engine = Engine(create_runner("torch:eager", model.weights, CacheShape(2, 128)), model.tokenizer)
    with running_server(create_app(engine, NAME, max_body=LIMIT)) as url:
        yield url


def error_of(response: httpx.Response) -> dict:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_a_body_declared_past_the_limit_is_refused_unread(url):
    started = time.monotonic()
    response = httpx.post(url + "/v1/completions", content=b'{"model": "tiny", "prompt": "' + b"a" * 50_000_000 + b'"}',
                          timeout=60)
    assert response.status_code == 413 and error_of(response)["code"] == "request_too_large"
    assert f"limit of {LIMIT} bytes" in error_of(response)["message"]
    assert time.monotonic() - started < 10
    assert httpx.get(url + "/health").status_code == 200


def test_a_chunked_body_is_refused_once_it_passes_the_limit(url):
    def chunks():
        for _ in range(50):
            yield b"a" * 2**20

    response = httpx.post(url + "/v1/completions", content=chunks(), timeout=60)  # no Content-Length
    assert response.status_code == 413 and error_of(response)["code"] == "request_too_large"


def test_health_answers_while_a_large_prompt_is_tokenised(url):
    """A 3.5 MB prompt takes seconds to tokenise here; the loop answers /health meanwhile (FastAPI's own
    body reading parsed it, and the route tokenised it, on the loop: /health waited for all of it)."""
    body = {"model": NAME, "prompt": "The quick brown fox jumps. " * 130_000}
    done: list[httpx.Response] = []
    big = threading.Thread(target=lambda: done.append(httpx.post(url + "/v1/completions", json=body, timeout=120)))
    started = time.monotonic()
    big.start()
    waits = []
    while big.is_alive():
        t = time.monotonic()
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        waits.append(time.monotonic() - t)
        time.sleep(0.05)
    took = time.monotonic() - started
    assert done[0].status_code == 400 and error_of(done[0])["param"] == "prompt"  # longer than a row
    assert took > 2, f"the large request took {took:.1f} s: too little to show anything"
    assert max(waits) < 1.0, f"/health waited {max(waits):.2f} s while a large request was read"


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", b'{"model": "tiny", "prompt": "\\ud800"}'),
    ("/v1/completions", b'{"model": "tiny", "prompt": ["ok", "\\udfff x"]}'),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}]}'),
    ("/v1/completions", b'{"model": "tiny", "prompt": "caf\xe9"}'),  # not UTF-8
])
def test_json_that_text_cannot_hold_is_a_400(url, path, body):
    response = httpx.post(url + path, content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    assert "not valid JSON" in error_of(response)["message"]


def test_a_server_error_has_the_json_body(checkpoint_dir):
    """A bug in a route (here the engine's submit failing) is a 500 with the API's error body."""
    model = open_model(str(checkpoint_dir(CASE)))
    engine = Engine(create_runner("torch:eager", model.weights, CacheShape(1, 64)), model.tokenizer)

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    engine.submit_choices = broken
    with running_server(create_app(engine, NAME)) as url:
        response = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "hi"})
        assert response.status_code == 500
        assert error_of(response)["type"] == "server_error"
        assert httpx.get(url + "/health").status_code == 200
