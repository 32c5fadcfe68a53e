"""The OpenAI API's request bodies (strictly typed) and the response objects Linnet answers with."""
from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from linnet.backends.runner import MAX_TOP_LOGPROBS
from linnet.errors import LinnetError
from linnet.sampling import SEED_MAX, Sampling
from linnet.serve.engine import CANCELLED, ERROR, Event, Params, RequestError
from linnet.serve.logits import Penalties, TokenLogprob
from linnet.serve.structured import StructuredFields
from linnet.serve.tools import ToolCallIn, ToolFields, template_message
from linnet.tokenizer import Tokenizer

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the OpenAI completions API's default; chat fills the row
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API's bound on logprobs

# Fields clients send that change nothing about the answer: accepted and unused (docs/SERVE.md).
ALLOWED_UNUSED = ("user", "metadata", "store", "service_tier")
# Fields of the API this server does not implement yet: a request that sets one is refused by name.
NOT_YET = ("suffix",)


class Body(BaseModel):
    # Strict: "5" is not 5. An unknown field is refused (a request's top level names it: ``GenerationBody``).
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(Body):
    include_usage: bool = False


def unsupported(name: str, why: str = "") -> RequestError:
    return RequestError(f"{name} is not supported by this server{why}", name, "unsupported_parameter")


class GenerationBody(Body, StructuredFields):
    """What completions and chat share: the model, sampling, stopping and streaming. Unknown fields are kept
    (``extra="allow"``) only to be refused by name in ``params``; nothing is ignored without a word."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str
    max_tokens: int | None = None
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # vLLM's extension; 0 and -1 keep every token
    seed: int | None = Field(None, ge=0, le=SEED_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = []  # vLLM's extension
    ignore_eos: bool = False  # vLLM's extension
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)  # at most the engine's rows (``linnet.serve.app``)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)  # vLLM's extension
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    min_tokens: int = Field(0, ge=0)  # vLLM's extension
    # ALLOWED_UNUSED
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # structured output: response_format, structured_outputs, guided_* (``StructuredFields``)

    def params(self, max_tokens: int | None, logprobs: int | None, choice: int = 0) -> Params:
        """The engine's parameters for choice ``choice`` (0..n-1): a seed s gives choice i the seed s + i."""
        for name in self.model_extra or {}:
            raise unsupported(name, " (not a field of this API that it knows)")
        for name in NOT_YET:
            if getattr(self, name, None) is not None:
                raise unsupported(name)
        if self.seed is not None and self.seed + choice > SEED_MAX:
            raise RequestError(f"seed + {choice} (the seed of choice {choice}) passes 2^63 - 1", "seed")
        seed = None if self.seed is None else self.seed + choice
        sampling = Sampling(self.temperature, max(self.top_k, 0), self.top_p, seed)  # fields checked above
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        penalties = Penalties(self.presence_penalty, self.frequency_penalty, self.repetition_penalty)
        return Params(max_tokens, sampling, stop, tuple(self.stop_token_ids), self.ignore_eos, logprobs, penalties,
                      self.token_biases(), self.min_tokens, self.constraint(choice))

    def token_biases(self) -> tuple[tuple[int, float], ...]:
        biases = []
        for key, bias in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise RequestError(f"logit_bias keys are token ids written as decimal strings, got {key!r}",
                                   "logit_bias")
            biases.append((int(key), bias))
        return tuple(biases)

    @property
    def choices(self) -> int:
        """How many sequences the request generates (``best_of`` of them, where it is larger than ``n``)."""
        return self.n

    @property
    def wants_logprobs(self) -> bool:
        """Whether the answer shows logprobs (the engine may compute them for ``best_of`` alone)."""
        return False

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionBody(GenerationBody):
    prompt: str | list[int] | list[str]
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    suffix: str | None = None  # NOT_YET

    @property
    def choices(self) -> int:
        return max(self.n, self.best_of or 1)

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    def request_params(self, choice: int = 0) -> Params:
        if self.best_of is not None and self.best_of < self.n:
            raise RequestError(f"best_of ({self.best_of}) must be at least n ({self.n})", "best_of")
        if self.best_of is not None and self.best_of > 1 and self.stream:
            raise RequestError("best_of cannot be streamed: the best choices are known only at the end", "best_of")
        # best_of ranks its sequences by their logprobs, so they are computed even where not asked for
        logprobs = 0 if self.logprobs is None and self.choices > self.n else self.logprobs
        params = self.params(COMPLETIONS_DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens, logprobs,
                             choice)
        # echo with logprobs scores the prompt too (as lm-eval's loglikelihood requests ask)
        return replace(params, prompt_logprobs=self.logprobs) if self.echo and self.logprobs is not None else params


class TextPart(Body):
    type: Literal["text"]
    text: str


class Message(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool's: the call it answers
    # An earlier answer sent back as the client holds it (the openai client's message objects carry these):
    # accepted and unused, as the answer's content says it all; an audio or function-call answer, which this
    # server never gives, is refused.
    parsed: Any = None  # the content as ``chat.completions.parse`` read it
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: None = None
    function_call: None = None

    def as_template_input(self) -> dict[str, Any]:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or ())
        message: dict[str, Any] = {"role": self.role, "content": content}
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return template_message(message)


class ChatBody(GenerationBody, ToolFields):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None  # the newer name of max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # tools, tool_choice, parallel_tool_calls (``ToolFields``)

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs

    def request_params(self, choice: int = 0) -> Params:
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs set to true", "top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self.params(max_tokens, logprobs, choice)


# -- responses --------------------------------------------------------------------------------------
def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def finish_reason(event: Event) -> str | None:
    return event.finish_reason if event.finish_reason not in (ERROR, CANCELLED) else "error"


def usage(last: Sequence[Event]) -> dict[str, Any]:
    """A request's usage from its choices' last events: the prompt counted once, every choice's tokens."""
    prompt, completion = last[0].prompt_tokens, sum(e.completion_tokens for e in last)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": last[0].cached_tokens}}


@dataclass
class Answer:
    """One choice's whole outcome: its text, its last event, its tokens' logprobs (None: not asked for)."""

    text: str
    last: Event
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # echo with logprobs: the prompt's


class Responder:
    """Builds one request's response objects: whole, or as stream chunks, for choices 0..n-1. Logprobs name
    each token by its text (decoded alone, special tokens kept) and its UTF-8 bytes, as vLLM does: a
    token that is part of a character shows as U+FFFD."""

    def __init__(self, model: str, chat: bool, tokenizer: Tokenizer | None = None, echo: str = "",
                 echo_ids: Sequence[int] = ()):
        self.model, self.chat, self.tokenizer = model, chat, tokenizer
        self.echo = echo  # completions' echo: the prompt's text, before each choice's text
        self.echo_ids = echo_ids  # and its tokens, where the echo's logprobs are shown
        self._scored: set[int] = set()  # choices whose prompt logprobs went out
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self._offsets: dict[int, int] = {}  # choice -> where its next token begins in its text (text_offset)
        self._echoed: set[int] = set()  # choices whose first stream chunk (with the echo) went out

    def _object(self, kind: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def whole(self, text: str, last: Event, logprobs: list[TokenLogprob] | None = None) -> dict[str, Any]:
        """A whole response of one choice."""
        return self.whole_choices([Answer(text, last, logprobs)])

    def whole_choices(self, answers: Sequence[Answer], usage_of: Sequence[Event] | None = None) -> dict[str, Any]:
        """A whole response of ``answers`` as choices 0..; usage over ``usage_of`` (default: the answers')."""
        choices = [self.whole_choice(i, a) for i, a in enumerate(answers)]
        return self._object("chat.completion" if self.chat else "text_completion", choices,
                            usage=usage(usage_of or [a.last for a in answers]))

    def whole_choice(self, index: int, answer: Answer) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {"index": index, "message": {"role": "assistant", "content": answer.text}}
        else:
            choice = {"index": index, "text": self.echo + answer.text}
        return choice | {"logprobs": self.logprobs(index, answer.logprobs, answer.prompt_logprobs),
                         "finish_reason": finish_reason(answer.last)}

    def chunk(self, text: str | None, reason: str | None = None, role: bool = False, include_usage: bool = False,
              index: int = 0, logprobs: Sequence[TokenLogprob] | None = None,
              prompt_logprobs: Sequence[TokenLogprob] = ()) -> dict[str, Any]:
        """A stream chunk of choice ``index`` with a piece of text (or, for chat, the assistant's role), its
        tokens' logprobs where asked and, last, a reason. A completion's first chunk carries its echo."""
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
            choice: dict[str, Any] = {"index": index, "delta": delta}
        else:
            echo = "" if index in self._echoed else self.echo
            self._echoed.add(index)
            choice = {"index": index, "text": echo + (text or "")}
        choice |= {"logprobs": self.logprobs(index, logprobs, prompt_logprobs), "finish_reason": reason}
        extra = {"usage": None} if include_usage else {}
        return self._object("chat.completion.chunk" if self.chat else "text_completion", [choice], **extra)

    def usage_chunk(self, last: Event | Sequence[Event]) -> dict[str, Any]:
        events = [last] if isinstance(last, Event) else list(last)
        return self._object("chat.completion.chunk" if self.chat else "text_completion", [], usage=usage(events))

    # -- logprobs --------------------------------------------------------------------------------------
    def logprobs(self, index: int, tokens: Sequence[TokenLogprob] | None,
                 prompt: Sequence[TokenLogprob] = ()) -> dict[str, Any] | None:
        """The choice's logprobs object for ``tokens`` (chat: ``content``; completions: the legacy lists, after
        those of the echoed prompt, whose tokens after the first are ``prompt``)."""
        if tokens is None:
            return None
        if self.chat:
            return {"content": [self._chat_entry(t) for t in tokens], "refusal": None}
        texts: list[str] = []
        token_logprobs: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        if self.echo_ids and index not in self._scored:
            # echo: the prompt's tokens first, the first with no logprob (nothing comes before it)
            self._scored.add(index)
            texts.append(self._text(self.echo_ids[0]))
            token_logprobs.append(None)
            tops.append(None)
            offsets.append(0)
            self._offsets[index] = len(texts[0])
            self._legacy(index, prompt, texts, token_logprobs, tops, offsets)
            self._offsets[index] = len(self.echo)  # the answer's tokens: from where its text begins
        self._legacy(index, tokens, texts, token_logprobs, tops, offsets)
        return {"tokens": texts, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}

    def _legacy(self, index: int, tokens: Sequence[TokenLogprob], texts: list[str],
                token_logprobs: list[float | None], tops: list[dict[str, float] | None], offsets: list[int]) -> None:
        """The legacy completions logprobs of ``tokens``, appended. Its top_logprobs hold the top alternatives
        and, always, the drawn token (OpenAI's "up to logprobs + 1"), keyed by text: of tokens that read the
        same, the likelier one is kept. ``text_offset``: where each token's text begins, running on."""
        at = self._offsets.get(index, len(self.echo))
        for t in tokens:
            text = self._text(t.token)
            top: dict[str, float] = {}
            for i, lp in (*t.top, (t.token, t.logprob)):
                top.setdefault(self._text(i), lp)
            texts.append(text)
            token_logprobs.append(t.logprob)
            tops.append(top)
            offsets.append(at)
            at += len(text)
        self._offsets[index] = at

    def _chat_entry(self, t: TokenLogprob) -> dict[str, Any]:
        text = self._text(t.token)
        return {"token": text, "logprob": t.logprob, "bytes": list(text.encode()),
                "top_logprobs": [{"token": (alt := self._text(i)), "logprob": lp, "bytes": list(alt.encode())}
                                 for i, lp in t.top]}

    def _text(self, token: int) -> str:
        if self.tokenizer is None:
            raise LinnetError("logprobs name tokens by their text, and this responder has no tokenizer")
        return self.tokenizer.decode([token], skip_special_tokens=False)
