"""Tool calls read out of a model's output as it streams, sent as OpenAI's (and vLLM's) deltas: a call's first
delta carries its ``index``, ``id``, ``type`` and name with arguments "", the next ones (``index`` and
``function.arguments`` only) pieces of its arguments' JSON text as the model writes them. A whole output is read
by the same reader in one go, so a stream's pieces join to exactly the whole answer's ``arguments``.

How an output is read (each family's syntax is in ``tools``):

- Content is the text before the first call. Calls begin at the family's marker, or where the output opens
  with a JSON object or array (markers that are special tokens are not in the engine's text); a Hermes
  ``<tool_call>`` may follow text.
- From there the output is read as calls: JSON objects apart by blanks, commas, semicolons, brackets and
  markers. A call goes out once its name and the ``{`` that opens its ``"arguments"`` (or ``"parameters"``)
  are read; its arguments are that value's JSON text as the model wrote it. Arguments written as a JSON string
  that holds an object go out decoded, in one piece, once the string is whole; a call with neither key gets "{}".
- A Hermes block that holds no call is skipped; in the other families reading stops at the first thing that
  is not a call, and the rest is dropped (as text after a Hermes call is).
- An output where no call began is all content. A call cut off (``max_tokens``) keeps the arguments it sent.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from linnet.serve.tools import ToolPlan

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_MARK = "[TOOL_CALLS]"
PYTHON_TAG = "<|python_tag|>"  # Llama 3's mark of a call, which it may or may not write
_MARKS = (HERMES_OPEN, HERMES_CLOSE, MISTRAL_MARK, PYTHON_TAG)
_LONGEST_MARK = max(len(m) for m in _MARKS)
_ARGUMENT_KEYS = ("arguments", "parameters")
_BLANK = " \t\r\n"
_BETWEEN_CALLS = _BLANK + ",;"
_STRING_STOP = re.compile(r'["\\]')
_NESTED_STOP = re.compile(r'["{}\[\]]')
_SCALAR = re.compile(r"[^\s,}\]]*")
_SCALAR_FIRST = "-0123456789tfn"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def as_api(self, index: int | None = None) -> dict[str, Any]:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of call ``index``: its first (``id`` and ``name`` set, arguments "") or a piece of its arguments."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def as_api(self) -> dict[str, Any]:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def joined_calls(deltas: list[ToolCallDelta]) -> list[ToolCall]:
    """The calls that ``deltas`` make, their arguments pieces joined (as clients join them)."""
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        if delta.id is not None:
            calls[delta.index] = [delta.id, delta.name or "", ""]
        calls[delta.index][2] += delta.arguments
    return [ToolCall(*call) for call in calls.values()]


class _JsonValue:
    """How far one JSON value reaches, read as text comes: strings and brackets are followed, not checked
    (a call's arguments are sent as written; the grammar, where one forces the call, checks them)."""

    def __init__(self, text: str, at: int):
        self.start, self.kind = at, text[at]
        self.depth = 1 if self.kind in "{[" else 0
        self.in_string = self.kind == '"'
        self.pos = at + 1 if self.kind in '{["' else at  # read up to here
        self.end: int | None = None

    def advance(self, text: str) -> None:
        pos = self.pos
        while self.end is None and pos < len(text):
            if self.kind not in '{["':  # a number, true, false or null: it ends where something else begins
                pos = _SCALAR.match(text, pos).end()  # type: ignore[union-attr]  # matches even nothing
                self.end = pos if pos < len(text) else None
            elif self.in_string:
                found = _STRING_STOP.search(text, pos)
                if found is None:
                    pos = len(text)
                elif found.group() == "\\":
                    if found.end() == len(text):  # the escaped character has not come yet
                        pos = found.start()
                        break
                    pos = found.end() + 1
                else:
                    pos, self.in_string = found.end(), False
                    self.end = pos if self.depth == 0 else None
            else:
                found = _NESTED_STOP.search(text, pos)
                if found is None:
                    pos = len(text)
                    continue
                pos, mark = found.end(), found.group()
                if mark == '"':
                    self.in_string = True
                elif mark in "{[":
                    self.depth += 1
                else:
                    self.depth -= 1
                    self.end = pos if self.depth == 0 else None
        self.pos = pos


class _CallObject:
    """One JSON object, from its ``{``, read as a call as text comes: its name, and where its arguments are."""

    def __init__(self, at: int):
        self.pos = at + 1
        self.expect = "key"  # then "colon", "value", "next" (a comma or the closing brace)
        self.value: _JsonValue | None = None  # the key or value being read
        self.key: str | None = None
        self.name: str | None = None
        self.arguments: _JsonValue | None = None
        self.closed = self.broken = self.refused = False  # refused: a name or arguments no call has

    def advance(self, text: str) -> None:
        while not (self.closed or self.broken):
            if self.value is not None:
                self.value.advance(text)
                self.pos = self.value.pos
                if self.value.end is None:
                    return
                self._read(text, self.value)
                self.value = None
                continue
            while self.pos < len(text) and text[self.pos] in _BLANK:
                self.pos += 1
            if self.pos == len(text):
                return
            char = text[self.pos]
            if (self.expect == "key" and char == '"') or (self.expect == "value" and char in '{["' + _SCALAR_FIRST):
                self.value = _JsonValue(text, self.pos)
                if self.expect == "value" and self.key in _ARGUMENT_KEYS and self.arguments is None:
                    self.arguments = self.value
                    self.refused |= self.value.kind not in '{"'
            elif self.expect == "colon" and char == ":":
                self.expect, self.pos = "value", self.pos + 1
            elif self.expect == "next" and char == ",":
                self.expect, self.pos = "key", self.pos + 1
            elif self.expect in ("key", "next") and char == "}":
                self.closed, self.pos = True, self.pos + 1
            else:
                self.broken = True

    def _read(self, text: str, value: _JsonValue) -> None:
        literal = text[value.start:value.end]
        if self.expect == "key":
            key = _json(literal)
            self.key, self.expect = (key if isinstance(key, str) else None), "colon"
            self.broken = self.key is None
            return
        if self.key == "name" and self.name is None:
            name = _json(literal)
            self.name = name if isinstance(name, str) else None
            self.refused |= self.name is None
        self.expect = "next"


class ToolCallStream:
    """Splits an output into content and tool-call deltas as it comes (the module's note says how): ``feed``
    each piece of text, then ``finish``. Content before a call goes out at once, held back only while it could
    be the start of a call."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.text = ""
        self.sent = 0  # characters of ``text`` sent as content
        self.state = "text"  # "text" before a call, "calls" from where one may begin, "content" (no call: all text)
        self.pos = 0  # in "calls": where reading is
        self.object: _CallObject | None = None  # the object being read
        self.skipping = False  # Hermes: looking for the next <tool_call>
        self.stopped = False  # nothing more is read as calls
        self.calls = 0  # calls begun (sent)
        self._open = False  # the object's call has gone out
        self._arguments_sent = 0

    def feed(self, piece: str) -> tuple[str, list[ToolCallDelta]]:
        self.text += piece
        content = ""
        if self.state == "text":
            at = self.plan.call_start(self.text, final=False)
            if at is None:
                return self._release(), []
            if at < 0:
                return "", []
            self.state, self.pos = "calls", at
            if self.text[self.sent:at].strip():  # blank text before calls is dropped with them
                content, self.sent = self.text[self.sent:at], at
        if self.state == "content":
            return self._release(), []
        deltas = self._read()
        if self.stopped and not self.calls:  # what looked like calls is not: it is content after all
            self.state = "content"
            content += self._release()
        return content, deltas

    def finish(self) -> str:
        """The content still held back: none where calls were sent (what follows them is dropped)."""
        return "" if self.calls else self._release()

    def _release(self) -> str:
        content, self.sent = self.text[self.sent:], len(self.text)
        return content

    def _read(self) -> list[ToolCallDelta]:
        deltas: list[ToolCallDelta] = []
        while not self.stopped:
            current = self.object or self._next_object()
            if current is None:
                break
            current.advance(self.text)
            deltas += self._deltas(current)
            if not (current.closed or current.broken or (current.refused and not self._open)):
                break  # more of the object is to come
            self.pos, self.object = current.pos, None
            if current.broken or not self._open:
                self._stop()
            self._open = False
        return deltas

    def _next_object(self) -> _CallObject | None:
        text, pos = self.text, self.pos
        while pos < len(text):
            if self.skipping:
                at = text.find(HERMES_OPEN, pos)
                if at < 0:  # keep what may be the tag's start
                    pos = max(pos, len(text) - len(HERMES_OPEN) + 1)
                    break
                pos, self.skipping = at + len(HERMES_OPEN), False
                continue
            head = text[pos:pos + _LONGEST_MARK + 1]
            mark = next((m for m in _MARKS if head.startswith(m)), None)
            if text[pos] in _BETWEEN_CALLS or mark:
                pos += len(mark) if mark else 1
            elif any(m.startswith(head) for m in _MARKS):  # a marker may be on its way
                break
            elif text[pos] in "[]":  # Mistral's array of calls
                pos += 1
            elif text[pos] == "{":
                self.pos, self.object = pos, _CallObject(pos)
                return self.object
            else:
                self.pos = pos
                self._stop()
                return None
        self.pos = pos
        return None

    def _stop(self) -> None:
        """Something that is no call: Hermes skips to its next tag, the others read no further."""
        if self.plan.fmt == "hermes":
            self.skipping = True
        else:
            self.stopped = True

    def _deltas(self, current: _CallObject) -> list[ToolCallDelta]:
        arguments = current.arguments
        if not self._open:
            if current.name is None or current.refused:
                return []
            if arguments is None:  # a call written without arguments, once its object is whole
                return self._begin(current.name, "{}") if current.closed else []
            if arguments.kind == '"':  # arguments written as JSON text in a string
                if arguments.end is None:
                    return []
                written = _json(self.text[arguments.start:arguments.end])
                if not isinstance(written, str) or not isinstance(_json(written), dict):
                    current.refused = True
                    return []
                return self._begin(current.name, written)
            deltas = self._begin(current.name, "")
        else:
            deltas = []
        if arguments is not None and arguments.kind == "{":
            end = arguments.end if arguments.end is not None else arguments.pos
            piece = self.text[arguments.start + self._arguments_sent:end]
            if piece:
                deltas.append(ToolCallDelta(self.calls - 1, piece))
                self._arguments_sent += len(piece)
        return deltas

    def _begin(self, name: str, arguments: str) -> list[ToolCallDelta]:
        self._open, self._arguments_sent = True, 0
        self.calls += 1
        first = ToolCallDelta(self.calls - 1, "", self.plan.new_id(), name)
        return [first, ToolCallDelta(first.index, arguments)] if arguments else [first]


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None
