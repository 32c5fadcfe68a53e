"""The OpenAI-compatible server, driven by the real ``openai`` client (and raw HTTP for the malformed
requests) against a real uvicorn server on a loopback port, on a tiny checkpoint (torch:eager, f32)."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from serve_helpers import CASE, FOX, eager_server, openai_client, running_server, stop_across_tokens, wait_idle

from linnet.backends import CacheShape, create_runner
from linnet.generation import generate
from linnet.model import open_model
from linnet.serve import Engine
from linnet.serve.app import create_app

NAME = "tiny-qwen3"
ROWS, POSITIONS = 8, 128


@pytest.fixture(scope="module")
def model(checkpoint_dir):
    return open_model(str(checkpoint_dir(CASE)))


@pytest.fixture(scope="module")
def reference(model):
    """generate() alone, on a runner of its own: what each request must give."""
    runner = create_runner("torch:eager", model.weights, CacheShape(1, POSITIONS))

    def alone(ids: list[int], max_tokens: int, ignore_eos: bool = True, stop: tuple[str, ...] = ()):
        return generate(runner, ids, max_tokens, tokenizer=model.tokenizer, eos_ids=[] if ignore_eos else None,
                        stop=stop)

    return alone


@pytest.fixture(scope="module")
def server(model):
    with eager_server(model, NAME, ROWS, POSITIONS, max_queue=64) as served:
        yield served


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server[1])


def test_completions_and_models(server, client, model, reference):
    ids = model.tokenizer.encode(FOX)
    want = reference(ids, 12)
    out = client.completions.create(model=NAME, prompt=FOX, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == want.text and out.choices[0].finish_reason == "length"
    usage = out.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (len(ids), 12, len(ids) + 12)
    by_ids = client.completions.create(model=NAME, prompt=ids, max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == want.text
    assert [m.id for m in client.models.list().data] == [NAME]


def test_chat_uses_the_chat_template(client, model, reference):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": FOX}]
    ids = model.tokenizer.encode_chat(messages)
    want = reference(ids, 10, ignore_eos=False)
    out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0)
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == want.text
    assert out.choices[0].finish_reason == want.finish_reason
    assert out.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_streaming_with_usage(client, model, reference, chat):
    messages = [{"role": "user", "content": FOX}]
    ids = model.tokenizer.encode_chat(messages) if chat else model.tokenizer.encode(FOX)
    want = reference(ids, 20)
    options = dict(model=NAME, max_tokens=20, temperature=0, stream=True, stream_options={"include_usage": True},
                   extra_body={"ignore_eos": True})
    if chat:
        chunks = list(client.chat.completions.create(messages=messages, **options))
        pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
        assert chunks[0].choices[0].delta.role == "assistant"
    else:
        chunks = list(client.completions.create(prompt=FOX, **options))
        pieces = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(pieces) == want.text and len([p for p in pieces if p]) > 1
    tokens = [c for c in chunks if c.choices and c.choices[0].finish_reason is None][1 if chat else 0:]
    assert len(tokens) == 20  # a chunk per token, its text empty while it has none to show (as vLLM's)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == len(ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_a_shared_prefix_is_reported_as_cached(server, client, model, reference):
    """A chat whose system prompt a free row still holds reads only the rest; the usage says how much it
    reused, whole and streamed, on both endpoints, and the answers are those read whole."""
    system = {"role": "system", "content": "Answer briefly about foxes."}
    turns = [[system, {"role": "user", "content": question}] for question in ("Who jumps?", "Who sleeps?")]
    ids = [model.tokenizer.encode_chat(messages) for messages in turns]
    shared = next(i for i, (a, b) in enumerate(zip(*ids)) if a != b)
    cached_before = metric(server[1], "linnet_prompt_tokens_cached_total")
    options = dict(model=NAME, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    first = client.chat.completions.create(messages=turns[0], **options)
    second = client.chat.completions.create(messages=turns[1], **options)
    assert [first.choices[0].message.content, second.choices[0].message.content] == \
        [reference(i, 6).text for i in ids]
    assert second.usage.prompt_tokens_details.cached_tokens == shared > 20
    again = list(client.chat.completions.create(messages=turns[1], stream=True,
                                                stream_options={"include_usage": True}, **options))
    assert "".join(c.choices[0].delta.content or "" for c in again if c.choices) == reference(ids[1], 6).text
    assert again[-1].usage.prompt_tokens_details.cached_tokens == len(ids[1]) - 1  # all but the last
    completion = client.completions.create(prompt=ids[1], **options)
    assert completion.usage.prompt_tokens_details.cached_tokens == len(ids[1]) - 1
    assert completion.choices[0].text == reference(ids[1], 6).text
    reused = sum(out.usage.prompt_tokens_details.cached_tokens for out in (first, second, again[-1], completion))
    assert metric(server[1], "linnet_prompt_tokens_cached_total") - cached_before == reused


def test_stop_strings_split_across_tokens(client, model, reference):
    ids = model.tokenizer.encode(FOX)
    stop, before = stop_across_tokens(model.tokenizer, reference(ids, 30).token_ids)
    options = dict(model=NAME, prompt=FOX, max_tokens=30, temperature=0, stop=[stop, "never-seen"],
                   extra_body={"ignore_eos": True})
    whole = client.completions.create(**options)
    assert whole.choices[0].text == before and whole.choices[0].finish_reason == "stop"
    pieces = [c.choices[0].text for c in client.completions.create(stream=True, **options)]
    assert "".join(pieces) == before  # the stop string's first half was held back, never sent


def test_a_token_whose_text_is_held_back_still_streams_a_chunk(client, model, reference):
    """A stop string made of one token's whole text and the next one's first character: that token's text is
    held back, yet its chunk goes out (empty), so a client sees every token as it comes."""
    ids = model.tokenizer.encode(FOX)
    stop, before = stop_across_tokens(model.tokenizer, reference(ids, 30).token_ids, whole=True)
    chunks = list(client.completions.create(model=NAME, prompt=FOX, max_tokens=30, temperature=0, stop=[stop],
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    tokens = [c.choices[0].text for c in chunks if c.choices and c.choices[0].finish_reason is None]
    assert "".join(tokens) == before and tokens[-1] == ""  # the token that completes the stop shows nothing
    assert len(tokens) == chunks[-1].usage.completion_tokens


def test_64_concurrent_streams_with_some_clients_disconnecting(server, model, reference):
    engine, url = server
    words = FOX.split()
    prompts = [" ".join(words[i % 4:]) + " " * (i % 3) for i in range(64)]
    leaving = set(range(0, 64, 4))  # these clients hang up after three chunks
    lengths = {i: 40 if i in leaving else 8 + i % 9 for i in range(64)}
    want = {i: reference(model.tokenizer.encode(prompts[i]), lengths[i]).text for i in range(64) if i not in leaving}
    before = metric(url, 'linnet_requests_total{finish_reason="cancelled"}')

    async def one(client: openai.AsyncOpenAI, i: int) -> str | None:
        stream = await client.completions.create(model=NAME, prompt=prompts[i], max_tokens=lengths[i],
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True})
        text = []
        async for chunk in stream:
            text.append(chunk.choices[0].text if chunk.choices else "")
            if i in leaving and len(text) == 3:
                await stream.close()
                return None
        return "".join(text)

    async def all_of_them() -> list[str | None]:
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    got = asyncio.run(all_of_them())
    assert {i: text for i, text in enumerate(got) if i not in leaving} == want
    wait_idle(engine)
    assert metric(url, "linnet_rows_busy") == 0 and metric(url, "linnet_queue_length") == 0
    assert metric(url, 'linnet_requests_total{finish_reason="cancelled"}') - before == len(leaving)
    # every row is free, holding only what its last request wrote (kept warm for prefix caching)
    assert engine.runner.lengths == [len(held) for held in engine._held]


BAD_REQUESTS = [
    ("/v1/completions", b'{"model": "tiny-qwen3", "prompt": "hi"', 400, None),  # malformed JSON
    ("/v1/completions", b'[1, 2]', 400, None),
    ("/v1/completions", {"prompt": "hi"}, 400, "model"),
    ("/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"model": NAME, "prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"model": NAME, "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 10**12}, 400, "max_tokens"),
    ("/v1/completions", {"model": NAME, "prompt": [7] * (POSITIONS + 1)}, 400, "prompt"),
    ("/v1/completions", {"model": NAME, "prompt": [7, 100000]}, 400, "prompt"),
    ("/v1/completions", {"model": NAME, "prompt": []}, 400, "prompt"),
    ("/v1/completions", {"model": NAME, "prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"model": NAME, "prompt": "hi", "n": ROWS + 1}, 400, "n"),
    ("/v1/completions", {"model": NAME, "prompt": "hi", "logprobs": 6}, 400, "logprobs"),
    ("/v1/completions", {"model": NAME, "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    ("/v1/chat/completions", {"model": NAME, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ("/v1/chat/completions", {"model": NAME, "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}],
                              "max_completion_tokens": 0}, 400, "max_tokens"),
    ("/v1/nowhere", {}, 404, None),
]


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS)
def test_a_bad_request_gets_a_4xx_and_the_server_goes_on(server, client, path, body, status, param):
    url = server[1]
    if isinstance(body, bytes):
        response = httpx.post(url + path, content=body, headers={"Content-Type": "application/json"})
    else:
        response = httpx.post(url + path, json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    ok = client.completions.create(model=NAME, prompt=FOX, max_tokens=3, temperature=0)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_bad_requests_through_the_openai_client(client):
    with pytest.raises(openai.BadRequestError, match="at most"):
        client.completions.create(model=NAME, prompt=FOX, max_tokens=POSITIONS)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "hi"}])


def test_health_and_metrics(server):
    url = server[1]
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    text = httpx.get(url + "/metrics").text
    for name in ("linnet_queue_length", "linnet_rows_busy", "linnet_generation_tokens_per_second",
                 "linnet_time_to_first_token_seconds_count"):
        assert f"# TYPE {name.removesuffix('_count')} " in text and f"\n{name} " in text
    assert metric(url, "linnet_rows") == ROWS


def test_the_api_key_is_required_when_set(model):
    runner = create_runner("torch:eager", model.weights, CacheShape(1, POSITIONS))
    with running_server(create_app(Engine(runner, model.tokenizer), NAME, api_key="sesame")) as url:
        for key in ("wrong", None):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            response = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "hi"}, headers=headers)
            assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=url + "/v1", api_key="sesame", max_retries=0)
        assert good.completions.create(model=NAME, prompt=FOX, max_tokens=2).usage.completion_tokens >= 1
        assert httpx.get(url + "/health").status_code == 200  # the probes stay open


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def test_clients_that_give_up_on_whole_answers_free_their_places(model):
    runner = create_runner("torch:eager", model.weights, CacheShape(1, POSITIONS))
    engine = Engine(runner, model.tokenizer)
    with running_server(create_app(engine, NAME)) as url:
        async def ask(client: openai.AsyncOpenAI) -> str:
            out = await client.completions.create(model=NAME, prompt=FOX, max_tokens=100, temperature=0,
                                                  extra_body={"ignore_eos": True})
            return out.choices[0].finish_reason

        async def give_up() -> list[str | None]:
            async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
                tasks = [asyncio.create_task(ask(client)) for _ in range(12)]  # one row: most wait in the queue
                await asyncio.sleep(0.3)
                for task in tasks:
                    task.cancel()  # the client closes the connection
                await asyncio.gather(*tasks, return_exceptions=True)
            return [None if task.cancelled() else task.result() for task in tasks]

        outcomes = asyncio.run(give_up())
        wait_idle(engine)
        gave_up = outcomes.count(None)
        assert gave_up >= 6  # 100 tokens each, one at a time: most requests were still waiting for the row
        cancelled = engine.metrics.requests["cancelled"]
        assert gave_up - 1 <= cancelled <= gave_up  # one may have finished just as its client left
        assert engine.metrics.requests["length"] + cancelled == 12
