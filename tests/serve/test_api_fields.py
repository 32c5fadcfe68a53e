"""The rest of the OpenAI API in ``linnet serve``: logprobs (against transformers), ``n`` and ``best_of``, the
penalties, ``logit_bias``, ``min_tokens`` and ``echo``, streamed and whole; and every request field either
honoured, refused by name, or on the documented allow-list. The real ``openai`` client against a real
uvicorn server on loopback, on a tiny checkpoint (torch:eager, f32)."""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Literal

import httpx
import numpy as np
import pytest
import torch
import transformers
from serve_helpers import CASE, FOX, eager_server, openai_client

from linnet.backends import CacheShape, create_runner
from linnet.backends.runner import log_softmax
from linnet.model import open_model
from linnet.serve.protocol import ALLOWED_UNUSED, NOT_YET, ChatBody, CompletionBody

NAME = "tiny-qwen3"
ROWS, POSITIONS = 8, 128
NEW = 8
# The fields each request model honours (docs/SERVE.md); every other is in NOT_YET or ALLOWED_UNUSED.
HONOURED = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos",
            "stream", "stream_options", "n", "presence_penalty", "frequency_penalty", "repetition_penalty",
            "logit_bias", "min_tokens", "logprobs",
            # structured output (tests/serve/test_structured.py)
            "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar"}
HONOURED_COMPLETIONS = HONOURED | {"prompt", "echo", "best_of"}
HONOURED_CHAT = HONOURED | {"messages", "max_completion_tokens", "top_logprobs",
                            "tools", "tool_choice", "parallel_tool_calls"}  # tests/serve/test_tools.py
NOT_YET_VALUES = {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"},
                  "guided_json": {"type": "object"}, "guided_regex": "a+", "guided_choice": ["a", "b"],
                  "guided_grammar": "root ::= \"a\"", "suffix": "end",
                  "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
                  "tool_choice": "auto", "parallel_tool_calls": False}


@pytest.fixture(scope="module")
def model(checkpoint_dir):
    return open_model(str(checkpoint_dir(CASE)))


@pytest.fixture(scope="module")
def server(model):
    with eager_server(model, NAME, ROWS, POSITIONS) as (_, url):
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def greedy(model):
    """Greedy decoding by definition on a runner of its own, with ``adjust(logits, generated)`` applied to
    each step's logits first: the token ids the server must give."""
    runner = create_runner("torch:eager", model.weights, CacheShape(1, POSITIONS))

    def run(ids: list[int], n: int, adjust: Callable[[np.ndarray, list[int]], None] | None = None) -> list[int]:
        runner.reset(0)
        logits, out = runner.prefill(0, ids), []
        for _ in range(n):
            logits = logits.astype(np.float64)
            if adjust:
                adjust(logits, out)
            out.append(int(np.argmax(logits)))
            logits = runner.decode([out[-1]])[0]
        return out

    return run


def hf_log_softmax(checkpoint_dir, ids: list[int]) -> np.ndarray:
    """transformers eager, f32: log-softmax of the logits at every position of ``ids``."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint_dir(CASE), dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1).numpy()


def completion(client, **kwargs):
    """A completion of FOX: greedy, NEW tokens, EOS ignored, unless ``kwargs`` say otherwise."""
    extra = {"ignore_eos": True, **kwargs.pop("extra_body", {})}
    return client.completions.create(**{"model": NAME, "prompt": FOX, "max_tokens": NEW, "temperature": 0, **kwargs},
                                     extra_body=extra)


# -- logprobs ----------------------------------------------------------------------------------------------
def test_completion_logprobs_are_the_models_log_softmax(client, model, greedy, checkpoint_dir):
    ids = model.tokenizer.encode(FOX)
    tokens = greedy(ids, NEW)
    want = hf_log_softmax(checkpoint_dir, ids + tokens)[len(ids) - 1:-1]  # the distribution of each new token
    out = completion(client, logprobs=5).choices[0]
    lp = out.logprobs
    assert out.text == model.tokenizer.decode(tokens)
    assert lp.tokens == [model.tokenizer.decode([t], skip_special_tokens=False) for t in tokens]
    np.testing.assert_allclose(lp.token_logprobs, want[np.arange(NEW), tokens], atol=1e-4)
    for row, top in zip(want, lp.top_logprobs):
        # the 5 most likely and, always, the drawn one (here the most likely: greedy), keyed by their text:
        # of tokens that read the same (bytes of a character, ids past the tokenizer's), the likeliest
        expected: dict[str, float] = {}
        for t in np.argsort(-row, kind="stable")[:5]:
            expected.setdefault(model.tokenizer.decode([int(t)], skip_special_tokens=False), row[t])
        assert top.keys() == expected.keys() and list(top.values()) == pytest.approx(list(expected.values()), abs=1e-4)
    assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))


def test_chat_top_logprobs_sorted_and_consistent(client, model, greedy, checkpoint_dir):
    messages = [{"role": "user", "content": FOX}]
    ids = model.tokenizer.encode_chat(messages)
    tokens = greedy(ids, NEW)
    want = hf_log_softmax(checkpoint_dir, ids + tokens)[len(ids) - 1:-1]
    out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=NEW, temperature=0, logprobs=True,
                                         top_logprobs=3, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == NEW
    for entry, token, row in zip(content, tokens, want):
        assert entry.token == model.tokenizer.decode([token], skip_special_tokens=False)
        assert entry.bytes == list(entry.token.encode())
        assert entry.logprob == pytest.approx(row[token], abs=1e-4)
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True) and len(tops) == 3
        assert tops == pytest.approx(np.sort(row)[::-1][:3], abs=1e-4)
        assert entry.top_logprobs[0].token == entry.token  # greedy draws the most likely
    plain = client.chat.completions.create(model=NAME, messages=messages, max_tokens=NEW, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == out.choices[0].message.content


# -- n, best_of, seeds, streaming -------------------------------------------------------------------------------
def test_n_with_a_seed_is_reproducible_and_choice_i_uses_seed_plus_i(client):
    def ask(**kwargs):
        return completion(client, temperature=1.0, **{"seed": 11, **kwargs})

    first, second = ask(n=4), ask(n=4)
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2, 3] and len(set(texts)) > 1
    assert [c.text for c in second.choices] == texts
    assert ask(seed=13).choices[0].text == texts[2]  # the documented rule: choice i draws with seed + i
    assert first.usage.completion_tokens == 4 * NEW


def test_streaming_equals_whole_with_choices_and_logprobs(client):
    options = dict(model=NAME, messages=[{"role": "user", "content": FOX}], max_tokens=NEW, temperature=1.0, seed=5,
                   n=3, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**options)
    texts, logprobs, reasons = {}, {}, {}
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **options))
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
        logprobs.setdefault(choice.index, []).extend(choice.logprobs.content if choice.logprobs else [])
        if choice.finish_reason:
            reasons[choice.index] = choice.finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 3 * NEW
    for c in whole.choices:
        assert texts[c.index] == c.message.content and reasons[c.index] == c.finish_reason
        streamed, want = logprobs[c.index], c.logprobs.content
        # the same tokens; their logprobs agree to float32 rounding (the rows ran in other batch sizes)
        assert [(e.token, [t.token for t in e.top_logprobs]) for e in streamed] == \
            [(e.token, [t.token for t in e.top_logprobs]) for e in want]
        np.testing.assert_allclose([[e.logprob] + [t.logprob for t in e.top_logprobs] for e in streamed],
                                   [[e.logprob] + [t.logprob for t in e.top_logprobs] for e in want], atol=1e-5)


def test_best_of_returns_the_choice_of_highest_cumulative_logprob(client):
    singles = [completion(client, temperature=1.0, seed=20 + i, logprobs=0).choices[0] for i in range(3)]
    best = max(singles, key=lambda c: sum(c.logprobs.token_logprobs))
    out = completion(client, temperature=1.0, seed=20, best_of=3)
    assert [c.text for c in out.choices] == [best.text] and out.choices[0].logprobs is None
    assert out.usage.completion_tokens == 3 * NEW  # every sequence generated counts
    two = completion(client, temperature=1.0, seed=20, best_of=3, n=2, logprobs=1)
    ranked = sorted(singles, key=lambda c: -sum(c.logprobs.token_logprobs))
    assert [c.text for c in two.choices] == [c.text for c in ranked[:2]] and [c.index for c in two.choices] == [0, 1]


def test_echo_puts_the_prompt_before_the_text(client):
    whole = completion(client, echo=True).choices[0].text
    assert whole == FOX + completion(client).choices[0].text
    streamed = "".join(c.choices[0].text for c in completion(client, echo=True, stream=True))
    assert streamed == whole


def test_echo_with_logprobs_scores_the_prompt(client, model, greedy, checkpoint_dir):
    """lm-eval's loglikelihood request: echo, logprobs, one new token; the prompt's tokens get the model's
    logprobs (the first none), then the new token's. Prefix caching never skips the prompt it scores."""
    ids = model.tokenizer.encode(FOX)
    new = greedy(ids, 1)
    want = hf_log_softmax(checkpoint_dir, ids + new)
    texts = [model.tokenizer.decode([t], skip_special_tokens=False) for t in ids + new]
    for _ in range(2):  # the second finds the prompt cached in a free row, and reads it all the same
        out = completion(client, echo=True, logprobs=2, max_tokens=1).choices[0]
        lp = out.logprobs
        assert out.text == FOX + model.tokenizer.decode(new) and lp.tokens == texts
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        np.testing.assert_allclose(lp.token_logprobs[1:], want[np.arange(len(ids)), ids[1:] + new], atol=1e-4)
        assert all(len(top) >= 1 and max(top.values()) == pytest.approx(row.max(), abs=1e-4)
                   for top, row in zip(lp.top_logprobs[1:], want))
        assert lp.text_offset[0] == 0 and lp.text_offset[-1] == len(FOX)
    chunks = list(completion(client, echo=True, logprobs=2, max_tokens=1, stream=True))
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)


# -- penalties, bias, min_tokens ---------------------------------------------------------------------------------
def presence_frequency(presence: float, frequency: float):
    def adjust(logits, out):
        for token in set(out):
            logits[token] -= out.count(token) * frequency + presence
    return adjust


def repetition(penalty: float, prompt: list[int]):
    def adjust(logits, out):
        seen = np.array(sorted(set(prompt) | set(out)))
        logits[seen] = np.where(logits[seen] > 0, logits[seen] / penalty, logits[seen] * penalty)
    return adjust


@pytest.mark.parametrize("field,value,definition", [
    ("presence_penalty", 2.0, lambda ids: presence_frequency(2.0, 0.0)),
    ("frequency_penalty", 1.5, lambda ids: presence_frequency(0.0, 1.5)),
    ("presence_penalty", -2.0, lambda ids: presence_frequency(-2.0, 0.0)),
    ("repetition_penalty", 1.8, lambda ids: repetition(1.8, ids)),
], ids=["presence", "frequency", "negative-presence", "repetition"])
def test_penalties_change_tokens_as_defined(client, model, greedy, field, value, definition):
    ids = model.tokenizer.encode(FOX)
    n = 24
    want = greedy(ids, n, definition(ids))
    assert want != greedy(ids, n)  # the penalty bites on this prompt: the test can fail
    extra = {field: value} if field == "repetition_penalty" else {}
    kwargs = {} if extra else {field: value}
    out = completion(client, max_tokens=n, extra_body=extra, **kwargs)
    assert out.choices[0].text == model.tokenizer.decode(want)


def test_the_largest_frequency_penalty_stops_repeats(client, model, greedy):
    ids = model.tokenizer.encode(FOX)
    plain = greedy(ids, 40)
    assert len(set(plain)) < len(plain)  # greedy repeats itself here
    # a repeat's logit drops 2 per use: with this model's logits' spread, far fewer repeats
    want = greedy(ids, 40, presence_frequency(2.0, 2.0))
    out = completion(client, max_tokens=40, presence_penalty=2.0, frequency_penalty=2.0)
    assert out.choices[0].text == model.tokenizer.decode(want)
    assert len(want) - len(set(want)) < len(plain) - len(set(plain))


def test_logit_bias_forces_a_token_and_logprobs_stay_the_models(client, model):
    forced = model.tokenizer.encode(" fox")[-1]
    out = completion(client, logit_bias={str(forced): 100}, logprobs=1).choices[0]
    assert out.text == model.tokenizer.decode([forced] * NEW)
    assert all(lp < -0.5 for lp in out.logprobs.token_logprobs)  # the model's, not the biased distribution's
    banned = completion(client, max_tokens=1).choices[0].text
    first = model.tokenizer.encode(FOX + banned)[len(model.tokenizer.encode(FOX)):]
    unbiased = completion(client, max_tokens=1, logit_bias={str(first[0]): -100}).choices[0].text
    assert unbiased != banned


def test_min_tokens_bans_the_stop_ids_until_reached(client, model, greedy):
    ids = model.tokenizer.encode(FOX)
    first = greedy(ids, 1)[0]
    early = completion(client, max_tokens=10, extra_body={"ignore_eos": False, "stop_token_ids": [first]})
    assert early.choices[0].finish_reason == "stop" and early.usage.completion_tokens == 1

    def ban(logits, out):
        if len(out) < 4:
            logits[[first, *model.tokenizer.eos_ids]] = -np.inf

    held = completion(client, max_tokens=10, extra_body={"ignore_eos": False, "stop_token_ids": [first],
                                                         "min_tokens": 4})
    want = greedy(ids, 10, ban)
    ends = [i for i, t in enumerate(want) if t in (first, *model.tokenizer.eos_ids)]
    want = want[:ends[0]] if ends else want  # the first stop id or EOS, banned before 4 tokens, ends it
    assert held.usage.completion_tokens >= 4 and held.choices[0].text == model.tokenizer.decode(want)


# -- every field: honoured, not yet (refused by name) or allowed and unused -------------------------------------------
def test_every_request_field_is_honoured_refused_or_allowed():
    for body, honoured in [(CompletionBody, HONOURED_COMPLETIONS), (ChatBody, HONOURED_CHAT)]:
        for name in body.model_fields:
            assert (name in honoured) + (name in NOT_YET) + (name in ALLOWED_UNUSED) == 1, (body.__name__, name)
    assert set(NOT_YET) <= set(NOT_YET_VALUES)


def post(server: str, path: str, **fields) -> httpx.Response:
    base = {"model": NAME, "max_tokens": 2}
    base |= {"messages": [{"role": "user", "content": "hi"}]} if path == "chat" else {"prompt": "hi"}
    return httpx.post(f"{server}/v1/{'chat/completions' if path == 'chat' else 'completions'}", json=base | fields,
                      timeout=60)


@pytest.mark.parametrize("name", sorted(NOT_YET_VALUES))
def test_fields_not_implemented_yet_are_refused_by_name(server, name):
    path = "chat" if name in ChatBody.model_fields and name not in CompletionBody.model_fields else "completions"
    response = post(server, path, **{name: NOT_YET_VALUES[name]})
    if name in NOT_YET:
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == name and name in error["message"]
    else:  # implemented since: then it must not be ignored either, which its own tests check
        assert response.status_code in (200, 400)


@pytest.mark.parametrize("path,fields,param", [
    ("completions", {"functions": []}, "functions"),  # unknown: refused, never ignored
    ("chat", {"function_call": "auto"}, "function_call"),
    ("chat", {"messages": [{"role": "user", "content": "hi", "colour": "red"}]}, "messages"),
    ("completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {"99999": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("completions", {"logprobs": 6}, "logprobs"),
    ("completions", {"best_of": 2, "stream": True}, "best_of"),
    ("completions", {"best_of": 2, "n": 3}, "best_of"),
    ("completions", {"best_of": ROWS + 1}, "best_of"),
    ("chat", {"n": ROWS + 1}, "n"),
    ("chat", {"n": 0}, "n"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"logprobs": 3}, "logprobs"),
    ("chat", {"presence_penalty": 2.5}, "presence_penalty"),
    ("chat", {"frequency_penalty": -3}, "frequency_penalty"),
    ("chat", {"repetition_penalty": 0}, "repetition_penalty"),
    ("chat", {"min_tokens": 3}, "min_tokens"),  # more than max_tokens
    ("chat", {"seed": 2**63 - 1, "n": 2}, "seed"),
])
def test_bad_fields_are_refused_by_name(server, path, fields, param):
    response = post(server, path, **fields)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize("path", ["completions", "chat"])
def test_allowed_fields_change_nothing(server, path):
    plain = post(server, path, temperature=0)
    allowed = post(server, path, temperature=0, user="u1", metadata={"k": "v"}, store=False, service_tier="auto")
    assert plain.status_code == allowed.status_code == 200, allowed.text
    key = "message" if path == "chat" else "text"
    assert json.dumps(allowed.json()["choices"][0][key]) == json.dumps(plain.json()["choices"][0][key])


def test_an_answer_sent_back_as_the_openai_client_holds_it_is_taken(server, client):
    """``chat.completions.parse`` adds ``parsed`` to the message object a client appends to its conversation."""
    import pydantic

    class Answer(pydantic.BaseModel):
        word: Literal["yes", "no"]

    first = client.chat.completions.parse(model=NAME, messages=[{"role": "user", "content": "A word?"}],
                                          response_format=Answer, max_tokens=64, temperature=0)
    message = first.choices[0].message
    assert message.parsed is not None
    again = client.chat.completions.create(
        model=NAME, max_tokens=4, temperature=0,
        messages=[{"role": "user", "content": "A word?"}, message, {"role": "user", "content": "Another?"}])
    assert again.choices[0].message.content is not None
    refused = post(server, "chat", messages=[{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "x", "audio": {"id": "a"}}])
    assert refused.status_code == 400 and "audio" in refused.json()["error"]["message"]


def test_logprob_helper_is_a_log_softmax():
    logits = np.array([1.0, 2.0, -np.inf, 0.5], dtype=np.float32)
    got = log_softmax(logits)
    assert np.exp(got).sum() == pytest.approx(1.0) and got[2] == -np.inf
