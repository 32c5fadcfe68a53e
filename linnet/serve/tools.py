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

ToolFormat = Literal["hermes", "mistral", "llama3_json"]
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_MARK = "[TOOL_CALLS]"
PYTHON_TAG = "<|python_tag|>"  # Llama 3's mark of a call, which it may or may not write
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
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def as_api(self, index: int | None = None) -> dict[str, Any]:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


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
        """The content (text before the first call; None where there is none) and the calls of a whole output.
        Output that holds no well-formed call is all content."""
        start = self.call_start(text)
        calls = [] if start is None else [ToolCall(self.new_id(), n, a) for n, a in _read_calls(self.fmt, text[start:])]
        if not calls:
            return text or None, []
        return text[:start] if text[:start].strip() else None, calls

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


def _read_calls(fmt: ToolFormat, text: str) -> list[tuple[str, str]]:
    """(name, arguments as JSON text) of each call in ``text``, which begins where the first does. Hermes's
    tagged calls are read one by one (a malformed one is skipped); untagged JSON must be calls throughout."""
    text = text.strip()
    if fmt == "hermes" and text.startswith(HERMES_OPEN):
        blocks = re.finditer(re.escape(HERMES_OPEN) + r"(.*?)(?:" + re.escape(HERMES_CLOSE) + r"|$)", text, re.DOTALL)
        return [call for block in blocks for call in _calls([_json(block.group(1))])]
    for mark in (MISTRAL_MARK, PYTHON_TAG):
        text = text.removeprefix(mark)
    objects = _json_values(text)
    calls = _calls(objects)
    return calls if objects and len(calls) == len(objects) else []


def _calls(objects: list[Any]) -> list[tuple[str, str]]:
    calls = []
    for obj in objects:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as JSON text already
            args = _json(args)
        if isinstance(args, dict):
            calls.append((obj["name"], json.dumps(args, ensure_ascii=False)))
    return calls


def _json_values(text: str) -> list[Any]:
    """The JSON values that make up ``text`` (arrays flattened), apart by blanks, commas or semicolons (Llama 3.2
    separates calls with semicolons); [] where anything else is there."""
    decoder, at = json.JSONDecoder(), 0
    values: list[Any] = []
    while True:
        while at < len(text) and (text[at].isspace() or text[at] in ",;"):
            at += 1
        if at == len(text):
            return values
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return []
        values += value if isinstance(value, list) else [value]


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


class ToolCallStream:
    """Splits a streamed output into content and tool calls as it comes: text before a call goes out at once
    (held back only while it could be the start of a call's marker); a Hermes call goes out whole when its
    closing tag comes; other calls, and anything unfinished, at the end."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.text = ""
        self.sent = 0  # characters of ``text`` sent as content
        self.start: int | None = None  # where the calls begin, once known
        self.calls_sent = 0

    def feed(self, piece: str) -> tuple[str, list[ToolCall]]:
        self.text += piece
        if self.start is None:
            at = self.plan.call_start(self.text, final=False)
            if at is None:
                content, self.sent = self.text[self.sent:], len(self.text)
                return content, []
            if at < 0:
                return "", []
            self.start = at
            content, self.sent = self.text[self.sent:at], at
            return content if content.strip() else "", self._closed_calls()
        return "", self._closed_calls()

    def _closed_calls(self) -> list[ToolCall]:
        if self.plan.fmt != "hermes" or self.start is None:
            return []
        end = self.text.rfind(HERMES_CLOSE)
        found = _read_calls("hermes", self.text[self.start:end + len(HERMES_CLOSE)]) if end > self.start else []
        new = [ToolCall(self.plan.new_id(), name, args) for name, args in found[self.calls_sent:]]
        self.calls_sent += len(new)
        return new

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is left: the remaining calls, or, where the output held no well-formed call, its held text."""
        if self.start is not None:
            found = _read_calls(self.plan.fmt, self.text[self.start:])
            if found:
                new = [ToolCall(self.plan.new_id(), name, args) for name, args in found[self.calls_sent:]]
                self.calls_sent += len(new)
                return "", new
        if self.calls_sent:
            return "", []
        content, self.sent = self.text[self.sent:], len(self.text)
        return content, []


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

    def chunk(self, chunk: dict[str, Any]) -> dict[str, Any]:
        """A chunk with a piece of content: the piece as far as it is content, and the calls it completes."""
        if self.plan is None:
            return chunk
        choice = chunk["choices"][0]
        text = choice["delta"].get("content")
        if text is None:
            return chunk
        stream = self._streams.setdefault(choice["index"], ToolCallStream(self.plan))
        sent = stream.calls_sent
        content, calls = stream.feed(text)
        choice["delta"]["content"] = content
        if calls:
            choice["delta"]["tool_calls"] = [c.as_api(sent + k) for k, c in enumerate(calls)]
        return chunk

    def last(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The choice's finishing chunk, after one with what its stream held back (content, or calls)."""
        choice = chunk["choices"][0]
        stream = self._streams.get(choice["index"])
        if stream is None:
            return [chunk]
        sent = stream.calls_sent
        content, calls = stream.finish()
        out = []
        if content or calls:
            delta: dict[str, Any] = {"content": content} if content else {}
            if calls:
                delta["tool_calls"] = [c.as_api(sent + k) for k, c in enumerate(calls)]
            out.append({**chunk, "choices": [{**choice, "delta": delta, "finish_reason": None}]})
        if stream.calls_sent:
            choice["finish_reason"] = _reason(choice["finish_reason"])
        return [*out, chunk]


def _reason(reason: str | None) -> str | None:
    # calls cut short by max_tokens keep "length"
    return "tool_calls" if reason == "stop" else reason
