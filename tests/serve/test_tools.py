"""Tool calls: the syntax picked from the chat template, the parsers of each family's calls (whole and
streamed), the grammar that forces a call, and the round trip through the server with the real ``openai``
client on a tiny random checkpoint given Qwen 2.5's tool template."""
from __future__ import annotations

import json
import shutil
from typing import Any

import httpx
import openai
import pytest
from serve_helpers import CASE, eager_server, openai_client, running_server
from test_structured import walk

from linnet.backends import CacheShape, create_runner
from linnet.model import open_model
from linnet.serve import Engine
from linnet.serve.app import create_app
from linnet.serve.engine import RequestError
from linnet.serve.grammar import GrammarCompiler
from linnet.serve.tools import ToolFields, tool_format

NAME = "tiny-qwen-tools"
ROWS, POSITIONS = 2, 2048

# Qwen 2.5 Instruct's chat template (tools, tool calls and tool responses), as its tokenizer_config has it.
QWEN25_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] }}{%- else %}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.' }}{%- endif %}{{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the "
    "user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}"
    "{%- for tool in tools %}{{- \"\\n\" }}{{- tool | tojson }}{%- endfor %}{{- \"\\n</tools>\\n\\nFor each "
    "function call, return a json object with function name and arguments within <tool_call></tool_call> XML "
    "tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call>"
    "<|im_end|>\\n\" }}{%- else %}{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + "
    "messages[0]['content'] + '<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by "
    "Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}{%- if (message.role == \"user\") or (message.role == \"system\" and not "
    "loop.first) or (message.role == \"assistant\" and not message.tool_calls) %}{{- '<|im_start|>' + "
    "message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- elif message.role == \"assistant\" %}"
    "{{- '<|im_start|>' + message.role }}{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}{%- set tool_call = "
    "tool_call.function %}{%- endif %}{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}"
    "{{- '\", \"arguments\": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- elif message.role == \"tool\" %}{%- if (loop.index0 == 0) or "
    "(messages[loop.index0 - 1].role != \"tool\") %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}{%- if loop.last or "
    "(messages[loop.index0 + 1].role != \"tool\") %}{{- '<|im_end|>\\n' }}{%- endif %}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city <today>",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}


def check_weather(arguments: str) -> None:
    args = json.loads(arguments)
    assert set(args) == {"city", "days"} and args["city"] in ("Paris", "Oslo") and 1 <= args["days"] <= 7


def check_call(call: Any) -> None:
    """A call of either tool whose arguments follow its parameters."""
    if call.function.name == "get_weather":
        check_weather(call.function.arguments)
    else:
        assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")


def plan(fmt_template: str, choice: Any = "auto", parallel: bool = True):
    fields = ToolFields.model_validate({"tools": [WEATHER, TIME], "tool_choice": choice,
                                        "parallel_tool_calls": parallel})
    return fields.tool_plan(fmt_template)


MISTRAL_TEMPLATE = "{% for m in messages %}{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}{% endif %}" \
                   "{% if m.tool_calls %}[TOOL_CALLS]{% endif %}{% endfor %}"
LLAMA3_TEMPLATE = "{% if tools %}Respond in the format {\"name\": function name, \"parameters\": dictionary}." \
                  "{{ tools | tojson }}{% endif %}<|python_tag|>"


def test_the_format_comes_from_the_template():
    assert tool_format(QWEN25_TEMPLATE) == "hermes"
    assert tool_format(MISTRAL_TEMPLATE) == "mistral"
    assert tool_format(LLAMA3_TEMPLATE) == "llama3_json"
    assert tool_format("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    with pytest.raises(RequestError, match="does not take tools") as e:
        plan("{{ messages }}")
    assert e.value.param == "tools"


@pytest.mark.parametrize("fields, param, words", [
    ({"tool_choice": "required"}, "tool_choice", "no tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "share a name"),
])
def test_tool_fields_refused_by_name(fields, param, words):
    with pytest.raises(RequestError, match=words) as e:
        ToolFields.model_validate(fields).tool_plan(QWEN25_TEMPLATE)
    assert e.value.param == param


def test_whole_output_parses_into_content_and_calls():
    """The reader itself (streamed, split anywhere, and whole) is tested in test_tool_stream.py."""
    p = plan(QWEN25_TEMPLATE)
    content, calls = p.parse('Let me see.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
                             '"days": 2}}\n</tool_call>')
    assert content == "Let me see." and [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Oslo", "days": 2}')]
    assert calls[0].id.startswith("call_") and p.parse("Paris is sunny.") == ("Paris is sunny.", [])


@pytest.fixture(scope="module")
def tool_model(checkpoint_dir, tmp_path_factory):
    """The tiny checkpoint with Qwen 2.5's tool template."""
    directory = tmp_path_factory.mktemp("tools") / "model"
    shutil.copytree(checkpoint_dir(CASE), directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": QWEN25_TEMPLATE}))
    return open_model(str(directory))


@pytest.mark.parametrize("template", [QWEN25_TEMPLATE, MISTRAL_TEMPLATE, LLAMA3_TEMPLATE],
                         ids=["hermes", "mistral", "llama3"])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_the_grammar_forces_a_valid_call(tool_model, template, choice):
    tok = tool_model.tokenizer
    p = plan(template, choice, parallel=False)
    compiler = GrammarCompiler(tok)
    spec = p.grammar(compiler.literal)
    assert spec is not None
    for seed in range(3):
        tokens, ended = walk(compiler.constraint(spec), tool_model.spec.vocab_size, tok.eos_ids, seed, steps=300)
        assert ended
        content, calls = p.parse(tok.decode(tokens))
        assert content is None and len(calls) == 1
        if isinstance(choice, dict):
            assert calls[0].name == "get_weather"
        check_call(openai.types.chat.ChatCompletionMessageToolCall.model_validate(calls[0].as_api()))


def test_a_special_token_marker_is_forced_as_that_token(tool_model, tmp_path):
    """Mistral's [TOOL_CALLS] is a special token: the grammar writes it as that token (not its spelling), the
    engine's text skips it, and the untagged JSON array left is read as the calls."""
    from tokenizers import AddedToken

    from linnet.tokenizer import Tokenizer

    tok = tool_model.tokenizer
    hf = type(tok.hf).from_str(tok.hf.to_str())
    hf.add_special_tokens([AddedToken("[TOOL_CALLS]", special=True)])
    mistral = Tokenizer(hf, tok.eos_ids, MISTRAL_TEMPLATE)
    mark = hf.token_to_id("[TOOL_CALLS]")
    compiler = GrammarCompiler(mistral)
    assert compiler.literal("[TOOL_CALLS]") == f"<[{mark}]>" and compiler.literal("<tool_call>") == '"<tool_call>"'
    p = plan(MISTRAL_TEMPLATE, "required")
    tokens, ended = walk(compiler.constraint(p.grammar(compiler.literal)), mistral.vocab_size, tok.eos_ids, 1, 300)
    assert ended and tokens[0] == mark
    content, calls = p.parse(mistral.decode(tokens))
    assert content is None and calls
    for call in calls:
        check_call(openai.types.chat.ChatCompletionMessageToolCall.model_validate(call.as_api()))


# -- through the server ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tool_model):
    with eager_server(tool_model, NAME, ROWS, POSITIONS, max_queue=16) as served:
        yield served


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server[1])


QUESTION = [{"role": "user", "content": "The weather in Oslo?"}]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_forced_call_round_trips_through_a_tool_message(client, tool_model, choice):
    out = client.chat.completions.create(model=NAME, messages=QUESTION, tools=[WEATHER, TIME], tool_choice=choice,
                                         parallel_tool_calls=False, max_tokens=120, seed=3)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls" and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    check_call(call)
    if isinstance(choice, dict):
        assert call.function.name == "get_weather"
    history = [*QUESTION, message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    again = client.chat.completions.create(model=NAME, messages=history, tools=[WEATHER, TIME], max_tokens=5,
                                           temperature=0)
    assert again.usage.prompt_tokens == len(tool_model.tokenizer.encode_chat(
        [QUESTION[0], {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": json.loads(call.function.arguments)}}]},
         {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}],
        tools=[WEATHER, TIME]))
    rendered = tool_model.tokenizer.render_chat(history[:1] + [
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                          "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "sunny, 21 C"}], tools=[WEATHER])
    assert '"arguments": {"city": "Oslo"}' in rendered and "<tool_response>\nsunny, 21 C" in rendered
    assert "<today>" in rendered  # tojson as transformers writes it, not HTML-escaped


def tool_deltas(chunks: list[Any]) -> list[Any]:
    return [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]


def test_forced_call_streams_its_arguments_in_pieces(client):
    """As OpenAI and vLLM stream a call: a first delta with its id, type and name (arguments ""), then deltas
    of the arguments only, which join to the whole answer's arguments for the same seeded request; the
    ``openai`` SDK's stream helper joins them the same way."""
    request = {"model": NAME, "messages": QUESTION, "tools": [WEATHER], "tool_choice": "required",
               "parallel_tool_calls": False, "max_tokens": 120, "seed": 5}
    whole = client.chat.completions.create(**request)
    call = whole.choices[0].message.tool_calls[0]
    check_weather(call.function.arguments)
    chunks = list(client.chat.completions.create(**request, stream=True))
    first, *pieces = tool_deltas(chunks)
    assert first.index == 0 and first.id and first.type == "function"
    assert first.function.name == "get_weather" and first.function.arguments == ""
    assert len(pieces) > 1 and all(d.index == 0 and d.id is None and d.type is None and d.function.name is None
                                   for d in pieces)
    assert "".join(d.function.arguments for d in pieces) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    with client.chat.completions.stream(**request) as stream:
        final = stream.get_final_completion()
    assert [c.function.arguments for c in final.choices[0].message.tool_calls] == [call.function.arguments]


def test_a_call_cut_off_by_max_tokens_streams_what_it_has(client):
    """max_tokens that ends inside the arguments: the whole answer and the stream both give the call with its
    arguments as far as they came, and finish_reason "length"."""
    request = {"model": NAME, "messages": QUESTION, "tools": [WEATHER], "tool_choice": "required",
               "parallel_tool_calls": False, "seed": 7}
    tokens = client.chat.completions.create(**request, max_tokens=120).usage.completion_tokens
    for max_tokens in range(tokens - 1, 0, -1):  # the longest cut that breaks the arguments
        whole = client.chat.completions.create(**request, max_tokens=max_tokens)
        calls = whole.choices[0].message.tool_calls or []
        if calls and calls[0].function.arguments and not _is_json(calls[0].function.arguments):
            break
    else:
        pytest.fail("no max_tokens cut the arguments")
    assert whole.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(**request, max_tokens=max_tokens, stream=True))
    first, *pieces = tool_deltas(chunks)
    assert first.function.name == calls[0].function.name
    assert "".join(d.function.arguments for d in pieces) == calls[0].function.arguments
    assert chunks[-1].choices[0].finish_reason == "length"


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def test_auto_and_none_leave_text_as_content(client):
    for choice in ("auto", "none"):
        out = client.chat.completions.create(model=NAME, messages=QUESTION, tools=[WEATHER], tool_choice=choice,
                                             max_tokens=8, temperature=0)
        message = out.choices[0].message
        assert not message.tool_calls and message.content  # the random model writes no call
        assert out.choices[0].finish_reason in ("stop", "length")


def test_tools_with_a_template_without_them_are_refused(server, checkpoint_dir):
    plain = open_model(str(checkpoint_dir(CASE)))
    runner = create_runner("torch:eager", plain.weights, CacheShape(1, 64))
    with running_server(create_app(Engine(runner, plain.tokenizer), NAME)) as url:
        response = httpx.post(url + "/v1/chat/completions", json={"model": NAME, "messages": QUESTION,
                                                                  "tools": [WEATHER]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools"
    both = httpx.post(server[1] + "/v1/chat/completions", json={
        "model": NAME, "messages": QUESTION, "tools": [WEATHER], "tool_choice": "required",
        "response_format": {"type": "json_object"}})
    assert both.status_code == 400 and "tool_choice" in both.json()["error"]["message"]
