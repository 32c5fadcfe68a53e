"""The OpenAI API's request bodies (strictly typed) and the response objects Linnet answers with."""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from linnet.sampling import SEED_MAX, Sampling
from linnet.serve.engine import CANCELLED, ERROR, Event, Params, RequestError

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the OpenAI completions API's default; chat fills the row


class Body(BaseModel):
    # Strict: "5" is not 5. Unknown fields are ignored, as OpenAI-compatible servers do.
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(Body):
    include_usage: bool = False


class GenerationBody(Body):
    """What completions and chat share: the model, sampling, stopping and streaming."""

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
    n: int = 1
    user: str | None = None
    # Accepted at their defaults only: Linnet does not implement them.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    logprobs: Any = None

    def params(self, max_tokens: int | None) -> Params:
        for name in ("presence_penalty", "frequency_penalty", "logit_bias", "logprobs"):
            if getattr(self, name) not in (None, 0.0, False, {}):
                raise RequestError(f"{name} is not supported by this server", name, "unsupported_parameter")
        if self.n != 1:
            raise RequestError("n must be 1: this server returns one choice per request", "n")
        sampling = Sampling(self.temperature, max(self.top_k, 0), self.top_p, self.seed)  # fields checked above
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return Params(max_tokens, sampling, stop, tuple(self.stop_token_ids), self.ignore_eos)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionBody(GenerationBody):
    prompt: str | list[int] | list[str]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def request_params(self) -> Params:
        for name in ("echo", "suffix", "best_of"):
            if getattr(self, name) not in (None, False, 1):
                raise RequestError(f"{name} is not supported by this server", name, "unsupported_parameter")
        return self.params(COMPLETIONS_DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens)


class TextPart(Body):
    type: Literal["text"]
    text: str


class Message(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_input(self) -> dict[str, str]:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or ())
        return {"role": self.role, "content": content}


class ChatBody(GenerationBody):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None  # the newer name of max_tokens

    def request_params(self) -> Params:
        return self.params(self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens)


# -- responses --------------------------------------------------------------------------------------
def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def finish_reason(event: Event) -> str | None:
    return event.finish_reason if event.finish_reason not in (ERROR, CANCELLED) else "error"


def usage(event: Event) -> dict[str, Any]:
    return {"prompt_tokens": event.prompt_tokens, "completion_tokens": event.completion_tokens,
            "total_tokens": event.prompt_tokens + event.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": event.cached_tokens}}


class Responder:
    """Builds one request's response objects: whole, or as stream chunks."""

    def __init__(self, model: str, chat: bool):
        self.model, self.chat = model, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _object(self, kind: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def whole(self, text: str, last: Event) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text}
        choice |= {"logprobs": None, "finish_reason": finish_reason(last)}
        return self._object("chat.completion" if self.chat else "text_completion", [choice], usage=usage(last))

    def chunk(self, text: str | None, reason: str | None = None, role: bool = False,
              include_usage: bool = False) -> dict[str, Any]:
        """A stream chunk with a piece of text (or, for chat, the assistant's role) and, last, a reason."""
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
            choice = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text or ""}
        choice |= {"logprobs": None, "finish_reason": reason}
        extra = {"usage": None} if include_usage else {}
        return self._object("chat.completion.chunk" if self.chat else "text_completion", [choice], **extra)

    def usage_chunk(self, last: Event) -> dict[str, Any]:
        return self._object("chat.completion.chunk" if self.chat else "text_completion", [], usage=usage(last))
