"""Structured output: the grammar wrapper (linnet.serve.grammar) on real tokenizers, driven by random
logits as a random-weight model would give, and the server with the real ``openai`` client on a tiny
random checkpoint, whose output is garbage except where the grammar forces it."""
from __future__ import annotations

import json
import re
import threading
from typing import Literal

import httpx
import numpy as np
import pydantic
import pytest
from serve_helpers import CASE, eager_server, openai_client

from linnet.model import open_model
from linnet.serve.engine import RequestError
from linnet.serve.grammar import GrammarCompiler, GrammarSpec
from linnet.serve.structured import StructuredFields

NAME = "tiny-qwen3"
ROWS, POSITIONS = 4, 128
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pet": {"enum": ["cat", "dog"]}}, "required": ["name", "age", "pet"], "additionalProperties": False}


class Person(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=6)
    age: int = pydantic.Field(ge=0, le=120)
    pet: Literal["cat", "dog"]


@pytest.fixture(scope="module")
def model(checkpoint_dir):
    return open_model(str(checkpoint_dir(CASE)))


@pytest.fixture(scope="module")
def compiler(model):
    return GrammarCompiler(model.tokenizer)


def walk(constraint, vocab: int, eos_ids, seed: int = 0, steps: int = 200) -> tuple[list[int], bool]:
    """Draw tokens by argmax of masked random logits until the grammar is finished or an EOS is drawn;
    the tokens (the EOS not among them) and whether it ended by itself."""
    rng, out = np.random.default_rng(seed), []
    for _ in range(steps):
        logits = rng.standard_normal(vocab).astype(np.float32)
        constraint.mask(logits)
        token = int(np.argmax(logits))
        assert np.isfinite(logits[token]), "the mask left no token"
        constraint.accept(token)
        if token in eos_ids:
            return out, True
        out.append(token)
        if constraint.finished:
            return out, True
    return out, False


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("spec, check", [
    (GrammarSpec("json_schema", PERSON, "guided_json"), lambda text: Person.model_validate_json(text)),
    (GrammarSpec("regex", r"[0-9]{3}-[a-z]{2,4}", "guided_regex"),
     lambda text: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text) or pytest.fail(text)),
    (GrammarSpec("choice", ["brown fox", "lazy dog", "ünïcode ✓"], "guided_choice"),
     lambda text: text in ("brown fox", "lazy dog", "ünïcode ✓") or pytest.fail(text)),
    (GrammarSpec("grammar", 'root ::= "fox" ("," [a-c])*', "guided_grammar"),
     lambda text: re.fullmatch(r"fox(,[a-c])*", text) or pytest.fail(text)),
], ids=["json", "regex", "choice", "gbnf"])
def test_random_logits_follow_the_grammar(model, compiler, spec, check, seed):
    tok = model.tokenizer
    vocab = model.spec.vocab_size
    tokens, ended = walk(compiler.constraint(spec), vocab, tok.eos_ids, seed)
    assert ended
    check(tok.decode(tokens))


def test_logit_rows_past_the_tokenizer_are_masked(model, compiler):
    constraint = compiler.constraint(GrammarSpec("regex", "[a-z]+", "guided_regex"))
    logits = np.zeros(model.tokenizer.vocab_size + 40, np.float32)
    constraint.mask(logits)
    assert np.all(np.isneginf(logits[model.tokenizer.vocab_size:]))
    allowed = np.flatnonzero(np.isfinite(logits))
    assert allowed.size and all(re.fullmatch("[a-z]+", model.tokenizer.decode([t])) for t in allowed)


def test_each_request_gets_its_own_matcher(model, compiler):
    spec = GrammarSpec("choice", ["fox", "dog"], "guided_choice")
    first, second = compiler.constraint(spec), compiler.constraint(spec)
    fox = model.tokenizer.encode("fox", add_special_tokens=False)
    for t in fox:
        first.accept(t)
    assert first.finished and not second.finished


@pytest.mark.parametrize("fields, param, words", [
    ({"guided_json": {"type": "objekt"}}, "guided_json", "objekt"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"},
                                                                  "strict": True}}}, "response_format", "strin"),
    ({"guided_regex": "(a|b"}, "guided_regex", "unclosed group"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar", "missing"),
    ({"structured_outputs": {"json": "[1, 2"}}, "structured_outputs", "structured_outputs.json"),
    ({"guided_choice": []}, "guided_choice", "at least one"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "response_format",
     "response_format and guided_regex"),
])
def test_what_cannot_compile_is_a_request_error_naming_it(compiler, fields, param, words):
    with pytest.raises(RequestError) as e:
        spec = StructuredFields.model_validate(fields).grammar_spec()
        assert spec is not None
        compiler.constraint(spec)
    assert e.value.param == param and words in str(e.value)


def test_strict_refuses_what_the_library_would_not_enforce(compiler):
    schema = {"type": "string", "format": "no-such-format"}
    with pytest.raises(RequestError, match="no-such-format"):
        compiler.constraint(GrammarSpec("json_schema", schema, "guided_json", strict=True))
    compiler.constraint(GrammarSpec("json_schema", schema, "guided_json", strict=False))  # ignored, as asked


def test_smollm2_json_schema():
    """The default model's real 49,152-token vocabulary: a schema-valid object from random logits."""
    from linnet.default_model import DEFAULT_MODEL

    smol = open_model(DEFAULT_MODEL)
    tokens, ended = walk(GrammarCompiler(smol.tokenizer).constraint(GrammarSpec("json_schema", PERSON, "guided_json")),
                         smol.spec.vocab_size, smol.tokenizer.eos_ids)
    assert ended
    Person.model_validate_json(smol.tokenizer.decode(tokens))


# -- through the server ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(model):
    with eager_server(model, NAME, ROWS, POSITIONS, max_queue=16) as served:
        yield served


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server[1])


USER = [{"role": "user", "content": "The quick brown fox"}]


def test_parse_with_a_pydantic_model(client):
    out = client.chat.completions.parse(model=NAME, messages=USER, response_format=Person, max_tokens=100, seed=1)
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(out.choices[0].message.parsed, Person)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_json_schema_and_json_object(client, stream):
    formats = [{"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
               {"type": "json_object"}]
    for response_format in formats:
        kwargs = dict(model=NAME, messages=USER, response_format=response_format, max_tokens=100, temperature=0)
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                stream=True, **kwargs) if c.choices)
        else:
            text = client.chat.completions.create(**kwargs).choices[0].message.content
        if response_format["type"] == "json_schema":
            Person.model_validate_json(text)
        else:
            assert isinstance(json.loads(text), dict)


def test_regex_choice_and_grammar_on_both_endpoints(client):
    regex = r"[0-9]{2}:[0-9]{2} (am|pm)"
    chat = client.chat.completions.create(model=NAME, messages=USER, max_tokens=20, extra_body={"guided_regex": regex})
    assert re.fullmatch(regex, chat.choices[0].message.content) and chat.choices[0].finish_reason == "stop"
    plain = client.completions.create(model=NAME, prompt="The quick", max_tokens=20,
                                      extra_body={"structured_outputs": {"regex": regex}})
    assert re.fullmatch(regex, plain.choices[0].text)
    for seed in range(3):
        pick = client.chat.completions.create(model=NAME, messages=USER, max_tokens=20, seed=seed,
                                              extra_body={"guided_choice": ["cat", "dog", "fox"]})
        assert pick.choices[0].message.content in ("cat", "dog", "fox")
    gbnf = client.chat.completions.create(model=NAME, messages=USER, max_tokens=20,
                                          extra_body={"guided_grammar": 'root ::= "x=" [0-9] [0-9]?'})
    assert re.fullmatch(r"x=[0-9]{1,2}", gbnf.choices[0].message.content)


def test_each_choice_follows_the_grammar(client):
    out = client.chat.completions.create(model=NAME, messages=USER, max_tokens=20, n=3, seed=7,
                                         extra_body={"guided_regex": "(fox|dog)[0-9]{1,3}"})
    assert len(out.choices) == 3
    assert all(re.fullmatch("(fox|dog)[0-9]{1,3}", c.message.content) for c in out.choices)


def test_invalid_schema_is_a_400_naming_the_problem(server):
    url = server[1]
    body = {"model": NAME, "messages": USER, "guided_json": {"type": "objekt"}}
    response = httpx.post(url + "/v1/chat/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "guided_json" and "objekt" in error["message"]
    both = httpx.post(url + "/v1/chat/completions", json={**body, "guided_json": {"type": "object"},
                                                            "guided_regex": "a+"})
    assert both.status_code == 400 and "guided_json and guided_regex" in both.json()["error"]["message"]


def test_constrained_rows_do_not_stall_the_others(server, client):
    """A constrained and an unconstrained request at once: both finish, the free one with all its tokens."""
    results: dict[str, object] = {}

    def free() -> None:
        results["free"] = client.completions.create(model=NAME, prompt="The quick brown fox", max_tokens=60,
                                                    extra_body={"ignore_eos": True})

    def constrained() -> None:
        results["json"] = client.chat.completions.create(
            model=NAME, messages=USER, max_tokens=100,
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})

    threads = [threading.Thread(target=f) for f in (free, constrained)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results["free"].usage.completion_tokens == 60  # type: ignore[attr-defined]
    Person.model_validate_json(results["json"].choices[0].message.content)  # type: ignore[attr-defined]
