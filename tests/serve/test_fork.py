"""``n`` > 1 reads the prompt once and forks its rows (``Engine.submit_choices``, ``Prefill.forks``): each
choice gives the tokens it gives alone, with its own seed; choices that find no free row read the prompt
themselves; prompt logprobs come from the one read. And a stream that fails inside the app ends with an
error chunk and ``[DONE]``. The engine on torch:eager and onnx:cpu (which reads short prompts several rows
to a call), then the real ``openai`` client and raw httpx against a real server on loopback."""
from __future__ import annotations

import json
import re

import httpx
import numpy as np
import openai
import pytest
from serve_helpers import CASE, FOX, eager_server, openai_client, wait_idle

from linnet.backends import CacheShape, create_runner
from linnet.backends.registry import get_backend
from linnet.generation import Sampling
from linnet.model import open_model
from linnet.serve import CANCELLED, LENGTH, Engine, Params
from linnet.serve.protocol import Responder

POSITIONS, NEW = 64, 8
NAME = "tiny"


@pytest.fixture(scope="module")
def model(checkpoint_dir):
    return open_model(str(checkpoint_dir(CASE)))


def engine_on(model, backend: str, rows: int, **options) -> Engine:
    reason = get_backend(backend).unavailable()
    if reason:
        pytest.skip(f"{backend}: {reason}")
    return Engine(create_runner(backend, model.weights, CacheShape(rows, POSITIONS)), model.tokenizer, **options)


def prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.RandomState(seed).randint(5, 331, size=n).tolist()


def choices(seed: int | None, count: int, **fields) -> list[Params]:
    """``count`` choices drawn as the API's are: choice i with seed + i (greedy without a seed)."""
    def sampling(i: int) -> Sampling:
        return Sampling() if seed is None else Sampling(temperature=1.0, seed=seed + i)
    return [Params(max_tokens=NEW, ignore_eos=True, sampling=sampling(i), **fields) for i in range(count)]


def run(engine: Engine, ids: list[int], params: list[Params]):
    requests = engine.submit_choices(ids, params, [None] * len(params))
    return requests, [r.result() for r in requests]


@pytest.mark.parametrize("backend", ["torch:eager", "onnx:cpu"])
def test_choices_read_the_prompt_once_and_each_gives_its_tokens_alone(model, backend):
    engine = engine_on(model, backend, rows=4, prefix_cache=False).start()
    try:
        ids = prompt(9, seed=1)
        alone = [engine.submit(ids, p).result().token_ids for p in choices(21, 4)]
        before = engine.metrics.prompt_tokens
        requests, results = run(engine, ids, choices(21, 4))
        assert [r.token_ids for r in results] == alone and len({tuple(t) for t in alone}) > 1
        assert engine.metrics.prompt_tokens - before == len(ids)  # read once
        assert engine.metrics.forked_tokens == 3 * len(ids)
        assert sorted(r.row for r in requests) == [0, 1, 2, 3]
        assert all(r.prompt_tokens == len(ids) and r.cached_tokens == 0 for r in results)
        again = run(engine, ids, choices(21, 4))[1]
        assert [r.token_ids for r in again] == alone  # reproducible
        greedy_alone = engine.submit(ids, choices(None, 1)[0]).result().token_ids
        greedy = run(engine, ids, choices(None, 2))[1]
        assert [r.token_ids for r in greedy] == [greedy_alone] * 2
        assert engine.rows_busy == 0 and engine.queue_length == 0
    finally:
        engine.stop()


def test_choices_without_a_free_row_wait_and_read_the_prompt_themselves(model):
    engine = engine_on(model, "torch:eager", rows=2, prefix_cache=False).start()
    try:
        ids = prompt(7, seed=2)
        alone = [engine.submit(ids, p).result().token_ids for p in choices(5, 4)]
        before = engine.metrics.prompt_tokens
        _, results = run(engine, ids, choices(5, 4))
        assert [r.token_ids for r in results] == alone
        assert all(r.finish_reason == LENGTH for r in results)
        # choice 1 forked into the second row; choices 2 and 3 waited for rows, and read the prompt there
        assert engine.metrics.prompt_tokens - before == 3 * len(ids) and engine.metrics.forked_tokens == len(ids)
    finally:
        engine.stop()


def test_a_prompt_read_over_several_steps_forks_at_its_last_chunk_and_holds_the_queue(model):
    # 20 prompt tokens at 8 a step: the choices and a later request wait while the first choice reads
    engine = engine_on(model, "torch:eager", rows=3, prefill_tokens=8)
    ids = prompt(20, seed=3)
    requests = engine.submit_choices(ids, choices(7, 3, prompt_logprobs=2), [None] * 3)
    later = engine.submit(prompt(5, seed=4), Params(max_tokens=NEW, ignore_eos=True))
    engine.start()
    try:
        results = [r.result() for r in requests]
        assert later.result().finish_reason == LENGTH
    finally:
        engine.stop()
    assert [r.row for r in requests] == [0, 1, 2]  # the later request took no row from a choice
    assert engine.metrics.forked_tokens == 2 * len(ids) and engine.metrics.prompt_tokens == len(ids) + 5
    scored = [[(t.token, t.logprob, t.top) for t in r.prompt_logprobs] for r in results]
    assert len(scored[0]) == len(ids) - 1 and scored[1] == scored[0] == scored[2]
    assert [t[0] for t in scored[0]] == ids[1:]


def test_a_first_choice_cancelled_before_it_runs_lets_the_others_run(model):
    engine = engine_on(model, "torch:eager", rows=3, prefix_cache=False)
    ids = prompt(6, seed=5)
    requests = engine.submit_choices(ids, choices(9, 3), [None] * 3)
    requests[0].cancel()
    engine.start()
    try:
        results = [r.result() for r in requests]
        alone = [engine.submit(ids, p).result().token_ids for p in choices(9, 3)[1:]]
    finally:
        engine.stop()
    assert results[0].finish_reason == CANCELLED
    assert [r.token_ids for r in results[1:]] == alone and engine.metrics.forked_tokens == 0


# -- the server ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(model):
    with eager_server(model, NAME, rows=4, positions=128) as served:
        yield served


def counters(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {name: float(value) for name, value in re.findall(r"^(linnet_prompt_tokens_\w+) (\S+)$", text, re.M)}


def test_n_choices_over_the_api_read_the_prompt_once(server, model):
    engine, url = server
    client = openai_client(url)
    wait_idle(engine)
    before = counters(url)
    ask = dict(model=NAME, prompt=FOX, max_tokens=NEW, temperature=1.0, seed=31, n=4, extra_body={"ignore_eos": True})
    out = client.completions.create(**ask)
    after = counters(url)
    length = len(model.tokenizer.encode(FOX))
    read = after["linnet_prompt_tokens_total"] - before["linnet_prompt_tokens_total"]
    cached = after["linnet_prompt_tokens_cached_total"] - before["linnet_prompt_tokens_cached_total"]
    assert read + cached == length and out.usage.prompt_tokens == length  # the prompt read once
    assert out.usage.prompt_tokens_details.cached_tokens == cached
    assert after["linnet_prompt_tokens_forked_total"] - before["linnet_prompt_tokens_forked_total"] == 3 * length
    texts = [c.text for c in out.choices]
    assert len(set(texts)) > 1 and [c.text for c in client.completions.create(**ask).choices] == texts
    single = client.completions.create(**{**ask, "n": 1, "seed": 33})
    assert single.choices[0].text == texts[2]  # choice i draws with seed + i, forked or not


@pytest.fixture
def failing_chunks(monkeypatch):
    """Responder.chunk raising at its third call: a bug in the app's own part of a stream."""
    real, calls = Responder.chunk, []

    def chunk(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected fault")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Responder, "chunk", chunk)
    return calls


def test_a_stream_that_fails_in_the_app_ends_with_an_error_chunk_then_done(server, failing_chunks):
    engine, url = server
    body = {"model": NAME, "prompt": FOX, "max_tokens": 20, "ignore_eos": True, "stream": True, "n": 2}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line]
    *chunks, error, done = lines
    assert done == "[DONE]" and len(chunks) == 2  # the chunks before the fault
    assert all(json.loads(c)["choices"][0]["text"] is not None for c in chunks)
    assert json.loads(error)["error"] == {"message": "internal error: RuntimeError", "type": "server_error",
                                          "param": None, "code": None}
    wait_idle(engine)  # both choices' rows freed


def test_the_openai_client_sees_an_app_side_stream_failure_as_an_error(server, failing_chunks):
    engine, url = server
    stream = openai_client(url).chat.completions.create(model=NAME, messages=[{"role": "user", "content": FOX}],
                                                        max_tokens=20, stream=True, extra_body={"ignore_eos": True})
    got = []
    with pytest.raises(openai.APIError, match="internal error: RuntimeError"):
        for chunk in stream:
            got.append(chunk)
    assert len(got) == 2  # the role chunk and the first token's, before the fault
    wait_idle(engine)
    out = openai_client(url).completions.create(model=NAME, prompt=FOX, max_tokens=1)  # whole: no chunks
    assert out.choices[0].finish_reason == "length"
