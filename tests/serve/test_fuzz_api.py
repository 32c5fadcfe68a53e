"""The API fuzzer: Hypothesis writes requests after the request models (``CompletionBody``, ``ChatBody``:
each field absent, of its own type in and out of range, or any other JSON value; text with lone
surrogates; now and then bytes that are no JSON at all) and sends them to a real ``linnet serve`` of a tiny
checkpoint. No answer may be a 5xx; every 4xx carries the OpenAI error body; a 200 is a whole completion or
a stream that ends in ``[DONE]``. Afterwards the server still answers a greedy request exactly as before,
with every row free.
"""
from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serve_helpers import CASE
from test_serve_command import interrupt, serve

NAME = "tiny"
REFERENCE = {"model": NAME, "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}

SURROGATES = st.sampled_from(["\ud800", "\udfff", "a\udc80b", "\ud83d"])
LEAVES = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=8))
ANY_JSON = st.recursive(LEAVES, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                          st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                        max_leaves=8)


def text(max_size: int = 30) -> st.SearchStrategy[str]:
    plain = st.text(max_size=max_size)
    return st.one_of(plain, plain, st.tuples(plain, SURROGATES, plain).map("".join))


# Each field: values a request may well send (VALID: mostly in range, text with lone surrogates included)
# and values it should not (WRONG: out of range, of another type, any JSON).
VALID: dict[str, st.SearchStrategy[Any]] = {
    "model": st.just(NAME),
    "max_tokens": st.one_of(st.none(), st.integers(1, 40)),
    "temperature": st.one_of(st.floats(0, 2), st.sampled_from([0, 1e-300, 5e-324, 100])),
    "top_p": st.floats(1e-9, 1),
    "top_k": st.integers(-1, 400),
    "seed": st.integers(0, 2**63 - 1),
    "stop": st.one_of(text(4), st.lists(text(4), max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, 400), max_size=3),
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "n": st.just(1),
    "prompt": st.one_of(text(), st.lists(st.integers(0, 330), min_size=1, max_size=70), st.lists(text(), max_size=1)),
    "messages": st.lists(st.fixed_dictionaries({
        "role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]),
        "content": st.one_of(text(), st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text()}),
                                              max_size=2), st.none())}), min_size=1, max_size=3),
    "max_completion_tokens": st.one_of(st.none(), st.integers(1, 40)),
}
WRONG: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from(["other", "", NAME.upper()]),
    "max_tokens": st.one_of(st.integers(-3, 0), st.integers(60, 2**64), st.just("5")),
    "temperature": st.one_of(st.floats(-1, 0, exclude_max=True), st.floats(100, 1e308, exclude_min=True)),
    "top_p": st.one_of(st.floats(-1, 0), st.floats(1, 2, exclude_min=True)),
    "top_k": st.integers(-(2**64), -2),
    "seed": st.one_of(st.integers(-(2**64), -1), st.integers(2**63, 2**70)),
    "stop_token_ids": st.lists(st.integers(-(2**64), 2**64), min_size=1, max_size=3),
    "n": st.integers(0, 3).filter(lambda n: n != 1),
    "prompt": st.one_of(st.lists(st.integers(-(2**40), 2**40), max_size=70), st.lists(text(), min_size=2),
                        st.just([]), st.just("")),
    "messages": st.one_of(st.just([]), st.lists(st.fixed_dictionaries({"role": text(8), "content": ANY_JSON}),
                                                max_size=2)),
    "logprobs": st.one_of(st.booleans(), st.integers(1, 5)),
    "presence_penalty": st.floats(-2, 2).filter(bool),
    "echo": st.just(True),
}
REQUIRED = {"/v1/completions": ("model", "prompt"), "/v1/chat/completions": ("model", "messages")}
OPTIONAL = [k for k in VALID if k not in ("model", "prompt", "messages")]


@st.composite
def body(draw: st.DrawFn, path: str) -> dict[str, Any]:
    """A request that is valid but for at most a few faults: a field of the wrong kind or range, a field
    that is any JSON value, a required field left out."""
    fields = {k: draw(VALID[k]) for k in REQUIRED[path]}
    fields |= {k: draw(VALID[k]) for k in draw(st.lists(st.sampled_from(OPTIONAL), unique=True, max_size=5))}
    for k in draw(st.lists(st.sampled_from(sorted(WRONG)), unique=True, max_size=2)):
        fields[k] = draw(st.one_of(WRONG[k], WRONG[k], ANY_JSON))
    if draw(st.integers(0, 9)) == 0:
        del fields[draw(st.sampled_from(sorted(fields)))]
    return fields


def request() -> st.SearchStrategy[tuple[str, bytes]]:
    as_json = st.sampled_from(sorted(REQUIRED)).flatmap(lambda path: st.tuples(st.just(path), body(path)))
    anything = st.tuples(st.sampled_from(sorted(REQUIRED)), ANY_JSON)
    encoded = st.one_of(as_json, as_json, as_json, anything).map(
        lambda pb: (pb[0], json.dumps(pb[1]).encode()))  # a lone surrogate goes out as a \ud800 escape
    return st.one_of(encoded, encoded, encoded, st.tuples(st.sampled_from(sorted(REQUIRED)), st.binary(max_size=40)))


@pytest.fixture(scope="module")
def server(checkpoint_dir):
    process, url = serve(str(checkpoint_dir(CASE)), "--rows", "3", "--positions", "64", "--name", NAME,
                         "--max-body", "64k")
    try:
        yield url
    finally:
        interrupt(process)


def check_error(response: httpx.Response) -> None:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], response.text


def check(url: str, path: str, content: bytes) -> None:
    with httpx.stream("POST", url + path, content=content, headers={"Content-Type": "application/json"},
                      timeout=60) as response:
        raw = response.read()
    assert response.status_code < 500, (response.status_code, raw[:300])
    if response.status_code >= 400:
        check_error(response)
    elif response.headers["content-type"].startswith("text/event-stream"):
        events = [line.removeprefix("data: ") for line in raw.decode().split("\n\n") if line]
        assert events[-1] == "[DONE]", events[-1]
        for event in events[:-1]:
            assert "choices" in json.loads(event) or "error" in json.loads(event)
    else:
        answer = response.json()
        assert answer["choices"][0]["finish_reason"] in ("stop", "length"), answer


def settled(url: str) -> None:
    """Every row free and no request waiting (a stream's cancellation takes a step to land)."""
    deadline = time.monotonic() + 30
    while True:
        metrics = httpx.get(url + "/metrics").text
        busy = [line for line in metrics.splitlines() if line.startswith(("linnet_rows_busy ", "linnet_queue_length "))]
        if all(line.endswith(" 0") or line.endswith(" 0.0") for line in busy):
            return
        assert time.monotonic() < deadline, busy
        time.sleep(0.1)


def fuzz(url: str, examples: int) -> None:
    before = httpx.post(url + "/v1/completions", json=REFERENCE).json()["choices"][0]["text"]

    @settings(max_examples=examples, derandomize=True, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(request())
    def send(path_and_body: tuple[str, bytes]) -> None:
        check(url, *path_and_body)

    send()
    settled(url)
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    assert httpx.post(url + "/v1/completions", json=REFERENCE).json()["choices"][0]["text"] == before


def test_generated_requests(server):
    fuzz(server, examples=80)


@pytest.mark.slow
def test_generated_requests_at_length(server):
    fuzz(server, examples=1500)
