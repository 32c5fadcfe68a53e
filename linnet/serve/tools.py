"""Tool calls: the request's ``tools`` and ``tool_choice``, the model family's tool-call syntax (read from
its chat template), the grammar that enforces a call, and the parsers that turn output into ``tool_calls``.

The syntax is picked from the chat template's text: a template that writes ``<tool_call>`` is Hermes's (Qwen
2.5 and 3, Hermes, SmolLM3 and many others: ``<tool_call>{"name": .., "arguments": ..}</tool_call>``), one
that writes ``[TOOL_CALLS]`` is Mistral's (``[TOOL_CALLS][{"name": .., "arguments": ..}]``), and any other
template that reads ``tools`` gets Llama 3's bare JSON object (``{"name": .., "parameters": ..}``, and
``"arguments"`` is read as well). A template that never reads ``tools`` cannot show them to the model:
a request with tools is refused rather than answered as if it had none.
"""
from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from linnet.serve.engine import RequestError
from linnet.serve.grammar import GrammarSpec
from linnet.serve.tool_stream import (
    HERMES_CLOSE,
    HERMES_OPEN,
    MISTRAL_MARK,
    PYTHON_TAG,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    joined_calls,
)

ToolFormat = Literal["hermes", "mistral", "llama3_json"]
# Tool calls' JSON as models write it, no free whitespace (as grammar.JSON_OPTIONS)
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class _Fields(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class FunctionDefinition(_Fields):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Fields):
    type: Literal["function"]
    function: FunctionDefinition


class ChosenFunction(_Fields):
    name: str


class NamedToolChoice(_Fields):
    type: Literal["function"]
    function: ChosenFunction


class CalledFunction(_Fields):
    name: str
    arguments: str  # JSON text, as the API writes it


class ToolCallIn(_Fields):
    """A tool call of an assistant message sent back in the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ToolFields(BaseModel):
    """The chat request's tool fields (mixed into ``ChatBody``)."""

    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def tool_plan(self, chat_template: str | None) -> ToolPlan | None:
        """What the tools ask of this request, or None where it has none."""
        if not self.tools:
            if self.tool_choice not in (None, "none"):
                raise RequestError("tool_choice asks for a tool call, but the request has no tools", "tool_choice")
            return None
        names = [t.function.name for t in self.tools]
        if len(set(names)) != len(names):
            raise RequestError(f"tools: two tools share a name ({sorted(n for n in set(names) if names.count(n) > 1)})",
                               "tools")
        fmt = tool_format(chat_template or "")
        if fmt is None:
            raise RequestError("tools: this model's chat template does not take tools, so the model would never "
                               "see them", "tools")
        choice = self.tool_choice or "auto"
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise RequestError(f"tool_choice names the function {choice.function.name!r}, which is not among the "
                               f"tools ({names})", "tool_choice")
        return ToolPlan(fmt, tuple(self.tools), choice, self.parallel_tool_calls)


def tool_format(template: str) -> ToolFormat | None:
    """The tool-call syntax a chat template teaches its model (see the module's note), or None."""
    if HERMES_OPEN in template:
        return "hermes"
    if MISTRAL_MARK in template:
        return "mistral"
    if re.search(r"\btools\b", template):
        return "llama3_json"
    return None


@dataclass(frozen=True)
class ToolPlan:
    fmt: ToolFormat
    tools: tuple[Tool, ...]
    choice: str | NamedToolChoice
    parallel: bool

    @property
    def parses(self) -> bool:
        """Whether the output is read for tool calls (``tool_choice`` "none" leaves it text)."""
        return self.choice != "none"

    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as Hugging Face chat templates take them (the API's own form)."""
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def grammar(self, literal: Callable[[str], str] = json.dumps) -> GrammarSpec | None:
        """For "required" or a named function: the family's call syntax around the tools' parameter schemas.
        ``literal`` writes a marker as a Lark terminal (``GrammarCompiler.literal``: a special token by id)."""
        if self.choice in ("auto", "none"):
            return None
        named = self.choice.function.name if isinstance(self.choice, NamedToolChoice) else None
        tools = [t for t in self.tools if named is None or t.function.name == named]
        many = self.parallel and named is None
        if self.fmt == "hermes":
            call = f'{literal(HERMES_OPEN)} "\\n" body "\\n" {literal(HERMES_CLOSE)}'
            repeat = ' ("\\n" call)*' if many else ""
            lark = f'start: call{repeat}\ncall: {call}\nbody: %json {json.dumps(_calls_schema(tools, "arguments"))}'
        elif self.fmt == "mistral":
            array = {"type": "array", "items": _calls_schema(tools, "arguments"), "minItems": 1,
                     **({} if many else {"maxItems": 1}), "x-guidance": _JSON_STYLE}
            lark = f'start: {literal(MISTRAL_MARK)} body\nbody: %json {json.dumps(array)}'
        else:  # Llama 3 writes one call, a bare JSON object
            lark = f'start: body\nbody: %json {json.dumps(_calls_schema(tools, "parameters"))}'
        return GrammarSpec("lark", lark, "tool_choice", strict=False)

    def new_id(self) -> str:
        # Mistral's templates refuse any tool_call_id but nine letters and digits
        if self.fmt == "mistral":
            return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
        return "call_" + secrets.token_hex(12)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The content (text before the first call; None where there is none) and the calls of a whole output,
        read as a stream is (``tool_stream``), so that a streamed answer's pieces join to these calls. Output in
        which no call begins is all content."""
        stream = ToolCallStream(self)
        content, deltas = stream.feed(text)
        content += stream.finish()
        calls = joined_calls(deltas)
        return (content if not calls or content.strip() else None) or None, calls

    def call_start(self, text: str, final: bool = True) -> int | None:
        """Where the first call begins in ``text``, or None. Not ``final``: -1 where the text so far could
        still turn out to begin one (blank, or ending in the start of a marker), so that text is held back.
        Calls begin at the family's marker, or at a JSON object or array that opens the output: markers that
        are special tokens are not in the text (the engine's text skips special tokens)."""
        stripped = text.lstrip()
        marks = {"hermes": (HERMES_OPEN,), "mistral": (MISTRAL_MARK,), "llama3_json": (PYTHON_TAG,)}[self.fmt]
        if stripped.startswith(("{", "[", *marks)):
            return len(text) - len(stripped)
        at = text.find(marks[0]) if self.fmt == "hermes" else -1  # Hermes models may write text before a call
        if at >= 0:
            return at
        if not final and (not stripped or any(stripped.startswith(m[:len(stripped)]) for m in marks)
                          or (self.fmt == "hermes" and any(text.endswith(HERMES_OPEN[:k])
                                                           for k in range(1, len(HERMES_OPEN))))):
            return -1
        return None


def _calls_schema(tools: list[Tool], arguments_key: str) -> dict[str, Any]:
    """A JSON schema of one call of any of ``tools``: its name, and arguments that follow its parameters."""
    options = [{"type": "object", "properties": {
        "name": {"const": t.function.name},
        arguments_key: t.function.parameters or {"type": "object", "properties": {}}},
        "required": ["name", arguments_key], "additionalProperties": False} for t in tools]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    # a tool's schema keyword that the library does not enforce is ignored unless the tool asks for strict
    lenient = not all(t.function.strict for t in tools)
    return {**schema, "x-guidance": {**_JSON_STYLE, "lenient": lenient}}


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """An API message as chat templates take it: an assistant's tool-call arguments as objects (Hugging Face
    templates write them with ``tojson``; JSON text would be written as one string)."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    out = []
    for call in calls:
        args = _json(call["function"]["arguments"])
        if not isinstance(args, dict):
            raise RequestError(f"messages: the arguments of tool call {call['id']!r} are not a JSON object",
                               "messages")
        out.append({**call, "function": {**call["function"], "arguments": args}})
    return {**message, "tool_calls": out}


class ToolReplies:
    """Turns a chat response's text into ``tool_calls`` where the request's tool plan reads calls (a plan of
    None passes everything through): whole responses (``whole``) and stream chunks, per choice (``chunk``,
    ``last``). A choice that made calls ends with finish_reason "tool_calls" (where it stopped by itself)."""

    def __init__(self, plan: ToolPlan | None):
        self.plan = plan
        self._streams: dict[int, ToolCallStream] = {}

    def whole(self, response: dict[str, Any]) -> dict[str, Any]:
        if self.plan is None:
            return response
        for choice in response["choices"]:
            message = choice["message"]
            content, calls = self.plan.parse(message["content"])
            if calls:
                message["content"] = content
                message["tool_calls"] = [c.as_api() for c in calls]
                choice["finish_reason"] = _reason(choice["finish_reason"])
        return response

    def chunk(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """A chunk with a piece of content: the piece as far as it is content, with the tool-call deltas it
        makes, in as many chunks as they need (``_with_deltas``)."""
        if self.plan is None:
            return [chunk]
        choice = chunk["choices"][0]
        text = choice["delta"].get("content")
        if text is None:
            return [chunk]
        stream = self._streams.setdefault(choice["index"], ToolCallStream(self.plan))
        content, deltas = stream.feed(text)
        choice["delta"]["content"] = content
        return _with_deltas(chunk, deltas)

    def last(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The choice's finishing chunk, after one with the content its stream held back, if any."""
        choice = chunk["choices"][0]
        stream = self._streams.get(choice["index"])
        if stream is None:
            return [chunk]
        content = stream.finish()
        held = [{**chunk, "choices": [{**choice, "delta": {"content": content}, "finish_reason": None}]}]
        if stream.calls:
            choice["finish_reason"] = _reason(choice["finish_reason"])
        return [*held, chunk] if content else [chunk]


def _with_deltas(chunk: dict[str, Any], deltas: list[ToolCallDelta]) -> list[dict[str, Any]]:
    """``chunk`` carrying ``deltas``, and after it chunks for those that would meet a delta of the same call in
    one chunk (a call's first delta and a piece of its arguments): clients merge a chunk's deltas by index."""
    groups: list[list[ToolCallDelta]] = [[]]
    for delta in deltas:
        if any(d.index == delta.index for d in groups[-1]):
            groups.append([])
        groups[-1].append(delta)
    choice = chunk["choices"][0]
    if groups[0]:
        choice["delta"]["tool_calls"] = [d.as_api() for d in groups[0]]
    more = [{**chunk, "choices": [{"index": choice["index"], "delta": {"tool_calls": [d.as_api() for d in group]},
                                   "logprobs": None, "finish_reason": None}]} for group in groups[1:]]
    return [chunk, *more]


def _reason(reason: str | None) -> str | None:
    # calls cut short by max_tokens keep "length"
    return "tool_calls" if reason == "stop" else reason
