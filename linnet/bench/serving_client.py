"""The load: streamed requests over HTTP, at most C in flight, timed at the client.

A request is an OpenAI ``/v1/completions`` stream, or Triton's ``generate_stream`` (``/v2/models/NAME/
generate_stream``, server-sent events, one per response of a decoupled model such as ``linnet triton``'s:
``prompt_ids`` in, ``text_output``, ``token_ids``, ``finish_reason`` and the token counts out). Each
request's first token is the first streamed chunk that carries a token: text, or, with its text empty, a
chunk before the closing one (vLLM and ``linnet serve`` stream a chunk per token, with empty text while the
token is a piece of a character, a special token or text held back for a stop string; Triton's responses name
their ``token_ids``). Counting only chunks with text timed a random-weight model's first token late: most
ids of a 151936-token vocabulary read with a 49152-token tokenizer have no text, so the first text came
tokens, or the whole answer, after the first token. Its inter-token latencies are the gaps between those
chunks; its token counts are the server's own usage counts (with the prompt tokens it found cached, where it
says: OpenAI's ``prompt_tokens_details.cached_tokens``).
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import httpx

REQUEST_TIMEOUT_S = 3600.0  # a request waits behind the others in the queue: no time limit that matters
OPENAI, TRITON = "openai", "triton"  # the streaming APIs a load speaks


class ServingError(Exception):
    """A request failed: the server answered an error, or the stream ended without its usage."""


@dataclass(frozen=True)
class Timing:
    """One request as the client saw it, in seconds from when it was sent."""

    first_token_s: float
    chunk_gaps_s: list[float]
    completion_tokens: int
    prompt_tokens: int
    cached_tokens: int | None = None  # prompt tokens the server did not compute again; None: it did not say
    text: str = ""  # the answer's text as streamed (OpenAI's API only)


@dataclass(frozen=True)
class Load:
    timings: list[Timing]
    wall_s: float  # from the first request sent to the last answered

    @property
    def completion_tokens(self) -> int:
        return sum(t.completion_tokens for t in self.timings)


def run_load(url: str, model: str, prompts: Sequence[list[int] | str], new_tokens: int, concurrency: int,
             extra: dict[str, Any], api: str = OPENAI, follows: Sequence[int | None] | None = None) -> Load:
    """Send ``prompts`` in the order given, each once fewer than ``concurrency`` are in flight and, where
    ``follows`` names an earlier request for it (a conversation's previous turn), once that one has finished;
    the requests after it wait behind it, so the order sent is always the order given."""
    if follows is not None and (len(follows) != len(prompts)
                                or any(f is not None and not 0 <= f < i for i, f in enumerate(follows))):
        raise ValueError("follows needs one entry a prompt, each None or the index of an earlier prompt")
    return asyncio.run(_load(url, model, prompts, new_tokens, concurrency, extra, api, follows))


async def _load(url: str, model: str, prompts: Sequence[list[int] | str], new_tokens: int, concurrency: int,
                extra: dict[str, Any], api: str, follows: Sequence[int | None] | None) -> Load:
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        async def one(prompt: list[int] | str) -> Timing:
            try:
                return await complete(client, api, model, prompt, new_tokens, extra)
            finally:
                gate.release()

        start = time.perf_counter()
        sent: list[asyncio.Task[Timing]] = []
        for i, prompt in enumerate(prompts):
            previous = follows[i] if follows is not None else None
            if previous is not None:
                await asyncio.wait([sent[previous]])
            if any(task.done() and task.exception() is not None for task in sent):
                break  # a request failed: gather raises its error, with nothing more sent
            await gate.acquire()
            sent.append(asyncio.create_task(one(prompt)))
        timings = await asyncio.gather(*sent)
        return Load(list(timings), time.perf_counter() - start)


async def complete(client: httpx.AsyncClient, api: str, model: str, prompt: list[int] | str, new_tokens: int,
                   extra: dict[str, Any]) -> Timing:
    path, body = request(api, model, prompt, new_tokens, extra)
    sent = time.perf_counter()
    arrivals: list[float] = []
    pieces: list[str] = []
    finished = usage = None
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            answer = (await response.aread()).decode(errors="replace")
            raise ServingError(f"HTTP {response.status_code}: {answer[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data:"))
            if "error" in chunk:
                raise ServingError(f"the stream ended in an error: {chunk['error']}")
            token, finish, counts = read_chunk(api, chunk)
            if token:
                arrivals.append(time.perf_counter())
            elif not arrivals and finish:
                finished = time.perf_counter()
            usage = counts or usage
            pieces += [choice.get("text") or "" for choice in chunk.get("choices") or ()]
    first = arrivals[0] if arrivals else finished
    if usage is None or first is None:
        raise ServingError("the stream ended without " + ("its usage counts" if first else "any token"))
    details: Any = cast(dict[str, Any], usage).get("prompt_tokens_details") or {}  # OpenAI's, not Triton's
    cached = details.get("cached_tokens")
    return Timing(first - sent, [b - a for a, b in zip(arrivals, arrivals[1:])],
                  usage["completion_tokens"], usage["prompt_tokens"], cached, "".join(pieces))


def request(api: str, model: str, prompt: list[int] | str, new_tokens: int,
            extra: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The path and JSON body of one streamed request."""
    if api == TRITON:
        return f"/v2/models/{model}/generate_stream", {"prompt_ids": prompt, "max_tokens": new_tokens, **extra}
    return "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": new_tokens, "stream": True, **extra}


def read_chunk(api: str, chunk: dict[str, Any]) -> tuple[bool, bool, dict[str, int] | None]:
    """Whether a streamed chunk carries a token, whether it ends the request, and the usage counts it gives."""
    if api == TRITON:  # every response has every output; the counts are filled in the last one
        finish = bool(chunk.get("finish_reason"))
        counts = {key: single(chunk[key]) for key in ("completion_tokens", "prompt_tokens")} if finish else None
        return bool(chunk.get("text_output") or chunk.get("token_ids")), finish, counts
    choices = chunk.get("choices") or ()
    # A chunk with text, or one with empty text that does not close the stream (a token whose text is not out
    # yet); a closing chunk with empty text carries no token (linnet serve's, after the last token's chunk).
    token = any(choice.get("text") or ("text" in choice and not choice.get("finish_reason")) for choice in choices)
    return token, any(choice.get("finish_reason") for choice in choices), chunk.get("usage")


def single(value: int | list[int]) -> int:
    """A one-element output, which Triton's JSON gives as the value or as a list of it."""
    return int(value[0] if isinstance(value, list) else value)
