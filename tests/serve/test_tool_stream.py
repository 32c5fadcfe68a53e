"""The incremental tool-call reader: each family's calls, split at every character boundary, come out as
OpenAI's deltas (a first with id and name, then argument pieces only) that join to the whole answer's calls;
what is no call stays content; a call cut off keeps what it sent; chunks never hold two deltas of one call."""
from __future__ import annotations

import json

import pytest
from test_tools import LLAMA3_TEMPLATE, MISTRAL_TEMPLATE, QWEN25_TEMPLATE, plan

from linnet.serve.tool_stream import ToolCallDelta, ToolCallStream, joined_calls
from linnet.serve.tools import ToolReplies

WEATHER_ARGS = '{"city": "Oslo", "days": 2}'
CALLS = [("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {"zone": "UTC"})]

SAMPLES = {
    "hermes": (QWEN25_TEMPLATE, 'Let me see.<tool_call>\n{"name": "get_weather", "arguments": ' + WEATHER_ARGS +
               '}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>',
               "Let me see."),
    "hermes-special-tags": (QWEN25_TEMPLATE, '\n{"name": "get_weather", "arguments": ' + WEATHER_ARGS + '}\n\n'
                            '{"name": "get_time", "arguments": {"zone": "UTC"}}\n', None),
    "hermes-arguments-first": (QWEN25_TEMPLATE, '<tool_call>\n{"arguments": ' + WEATHER_ARGS + ', "name": '
                               '"get_weather"}\n</tool_call><tool_call>{"name": "get_time", "parameters": '
                               '{"zone": "UTC"}}</tool_call>', None),
    "mistral": (MISTRAL_TEMPLATE, '[TOOL_CALLS][{"name": "get_weather", "arguments": ' + WEATHER_ARGS + '}, '
                '{"name": "get_time", "arguments": {"zone": "UTC"}}]', None),
    "mistral-string-arguments": (MISTRAL_TEMPLATE, ' [{"name": "get_weather", "arguments": ' + WEATHER_ARGS +
                                 '}, {"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}]', None),
    "llama3": (LLAMA3_TEMPLATE, '<|python_tag|>{"name": "get_weather", "parameters": ' + WEATHER_ARGS + '}; '
               '{"name": "get_time", "parameters": {"zone": "UTC"}}', None),
}


def streamed(p, pieces: list[str]) -> tuple[str, list[ToolCallDelta]]:
    stream, content, deltas = ToolCallStream(p), "", []
    for piece in pieces:
        text, new = stream.feed(piece)
        content += text
        deltas += new
    return content + stream.finish(), deltas


def check_delta_shapes(deltas: list[ToolCallDelta]) -> None:
    """Each call's first delta has its id and name and arguments ""; the others only arguments."""
    seen: set[int] = set()
    for delta in deltas:
        if delta.index in seen:
            assert delta.id is None and delta.name is None and delta.arguments
        else:
            assert delta.index == len(seen) and delta.id and delta.name and delta.arguments == ""
            seen.add(delta.index)


@pytest.mark.parametrize("name", list(SAMPLES))
def test_every_split_streams_the_whole_answer(name):
    template, text, content = SAMPLES[name]
    p = plan(template)
    whole_content, calls = p.parse(text)
    assert whole_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == CALLS
    assert calls[0].arguments == WEATHER_ARGS  # the arguments as the model wrote them
    splits = [[text[:k], text[k:]] for k in range(len(text) + 1)] + [list(text)]
    for pieces in splits:
        got_content, deltas = streamed(p, pieces)
        assert got_content == (content or "")
        check_delta_shapes(deltas)
        assert [(c.name, c.arguments) for c in joined_calls(deltas)] == [(c.name, c.arguments) for c in calls]
    # character by character, the first call's arguments come in as many pieces as characters (written before
    # the name, they go out with it, in one piece)
    _, deltas = streamed(p, list(text))
    pieces = sum(1 for d in deltas if d.index == 0 and d.id is None)
    assert pieces == (1 if name == "hermes-arguments-first" else len(WEATHER_ARGS))


def test_arguments_with_brackets_and_escapes_in_strings():
    args = '{"city": "a\\"}]{b", "note": "\\\\", "list": [1, {"x": null}], "days": 3}'
    text = '<tool_call>{"name": "get_weather", "arguments": ' + args + '}</tool_call> trailing words'
    p = plan(QWEN25_TEMPLATE)
    for k in range(len(text) + 1):
        content, deltas = streamed(p, [text[:k], text[k:]])
        assert content == "" and [(c.name, c.arguments) for c in joined_calls(deltas)] == [("get_weather", args)]


@pytest.mark.parametrize("template", [QWEN25_TEMPLATE, MISTRAL_TEMPLATE, LLAMA3_TEMPLATE])
def test_text_without_a_call_is_content(template):
    p = plan(template)
    for text in ["Paris is sunny.", "<tool_call>\n{not json}\n</tool_call>", '{"no": "name"}', "<tool_c",
                 '[1, 2] and text', '{"name": 5, "arguments": {}}', '{"name": "f", "arguments": [1]}', " \n",
                 '{"name": "f", "arguments": "not an object"}', '[TOOL_CALLS', '{"name": "get_weather", "argu']:
        assert p.parse(text) == (text, [])
        for pieces in [list(text), [text]]:
            assert streamed(p, pieces) == (text, [])


def test_json_that_is_no_call_streams_as_content_once_known():
    """Untagged JSON is held back while it may be a call, and goes out as soon as it cannot be."""
    stream = ToolCallStream(plan(LLAMA3_TEMPLATE))
    assert stream.feed('{"nam') == ("", [])
    assert stream.feed('ing": 1}') == ('{"naming": 1}', [])
    assert stream.feed(" more") == (" more", [])
    assert stream.finish() == ""


def test_what_follows_the_calls_is_dropped():
    mistral, hermes = plan(MISTRAL_TEMPLATE), plan(QWEN25_TEMPLATE)
    content, calls = mistral.parse('{"name": "get_time", "arguments": {"zone": "UTC"}} {"not": "a call"}')
    assert content is None and [(c.name, c.arguments) for c in calls] == [("get_time", '{"zone": "UTC"}')]
    # Hermes skips a block that holds no call, and the text after its calls
    content, calls = hermes.parse('<tool_call>{bad}</tool_call><tool_call>{"name": "get_time", "arguments": '
                                  '{"zone": "CET"}}</tool_call> Done.')
    assert content is None and [(c.name, c.arguments) for c in calls] == [("get_time", '{"zone": "CET"}')]
    content, calls = hermes.parse('<tool_call>{"name": "get_time"}</tool_call>')  # no arguments: "{}"
    assert [(c.name, c.arguments) for c in calls] == [("get_time", "{}")]


def chat_chunk(text: str | None, reason: str | None = None) -> dict:
    delta = {"content": text} if text is not None else {}
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": delta, "logprobs": {"content": []}, "finish_reason": reason}]}


def test_a_call_cut_off_keeps_what_it_sent():
    """max_tokens in the middle of the arguments: the stream has sent the call and its arguments so far, and
    the whole answer gives the same call; the finish reason stays "length"."""
    p = plan(QWEN25_TEMPLATE)
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os'
    content, calls = p.parse(text)
    assert content is None and [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Os')]
    replies = ToolReplies(p)
    chunks = [c for piece in ("<tool_call>\n", '{"name": "get_weather", ', '"arguments": {"ci', 'ty": "Os')
              for c in replies.chunk(chat_chunk(piece))]
    last = replies.last(chat_chunk(None, "length"))
    assert len(last) == 1 and last[0]["choices"][0]["finish_reason"] == "length"
    deltas = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls", ())]
    assert "".join(d["function"]["arguments"] for d in deltas) == '{"city": "Os'


def test_chunks_never_hold_two_deltas_of_one_call():
    """A piece that opens a call and carries arguments becomes two chunks: the first delta (arguments ""),
    then the arguments; a stopped call's finish reason becomes "tool_calls"."""
    replies = ToolReplies(plan(MISTRAL_TEMPLATE))
    text = '[TOOL_CALLS][{"name": "get_weather", "arguments": ' + WEATHER_ARGS + '}, {"name": "get_time", ' \
           '"arguments": {"zone": "UTC"}}]'
    chunks = replies.chunk(chat_chunk(text))
    assert [[d["index"] for d in c["choices"][0]["delta"]["tool_calls"]] for c in chunks] == [[0], [0, 1], [1]]
    assert chunks[0]["choices"][0]["delta"]["content"] == "" and chunks[0]["choices"][0]["logprobs"] is not None
    assert all(c["choices"][0]["logprobs"] is None and "content" not in c["choices"][0]["delta"] for c in chunks[1:])
    first = chunks[0]["choices"][0]["delta"]["tool_calls"][0]
    assert first["type"] == "function" and first["id"] and first["function"] == {"name": "get_weather",
                                                                                   "arguments": ""}
    assert chunks[1]["choices"][0]["delta"]["tool_calls"][0] == {"index": 0, "function": {"arguments": WEATHER_ARGS}}
    last = replies.last(chat_chunk(None, "stop"))
    assert len(last) == 1 and last[0]["choices"][0]["finish_reason"] == "tool_calls"
    plain = chat_chunk(text)  # a request without tools: chunks pass through as they are
    assert ToolReplies(None).chunk(plain) == [chat_chunk(text)] and ToolReplies(None).last(plain) == [plain]
