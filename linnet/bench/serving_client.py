"""The load: streamed /v1/completions requests over HTTP, at most C in flight, timed at the client.

Each request's first token is the first streamed chunk carrying text (for a request whose tokens decode
to no text at all, its closing chunk); its inter-token latencies are the gaps between its text chunks (a
chunk is one token, unless the server holds back a piece of a character); its token count is the
server's own usage count.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

REQUEST_TIMEOUT_S = 3600.0  # a request waits behind the others in the queue: no time limit that matters


class ServingError(Exception):
    """A request failed: the server answered an error, or the stream ended without its usage."""


@dataclass(frozen=True)
class Timing:
    """One request as the client saw it, in seconds from when it was sent."""

    first_token_s: float
    chunk_gaps_s: list[float]
    completion_tokens: int
    prompt_tokens: int


@dataclass(frozen=True)
class Load:
    timings: list[Timing]
    wall_s: float  # from the first request sent to the last answered

    @property
    def completion_tokens(self) -> int:
        return sum(t.completion_tokens for t in self.timings)


def run_load(url: str, model: str, prompts: list[list[int] | str], new_tokens: int, concurrency: int,
             extra: dict[str, Any]) -> Load:
    return asyncio.run(_load(url, model, prompts, new_tokens, concurrency, extra))


async def _load(url: str, model: str, prompts: list[list[int] | str], new_tokens: int, concurrency: int,
                extra: dict[str, Any]) -> Load:
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        async def one(prompt: list[int] | str) -> Timing:
            async with gate:
                return await complete(client, model, prompt, new_tokens, extra)

        start = time.perf_counter()
        timings = await asyncio.gather(*(one(p) for p in prompts))
        return Load(list(timings), time.perf_counter() - start)


async def complete(client: httpx.AsyncClient, model: str, prompt: list[int] | str, new_tokens: int,
                   extra: dict[str, Any]) -> Timing:
    body = {"model": model, "prompt": prompt, "max_tokens": new_tokens, "stream": True, **extra}
    sent = time.perf_counter()
    arrivals: list[float] = []
    finished = usage = None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            answer = (await response.aread()).decode(errors="replace")
            raise ServingError(f"HTTP {response.status_code}: {answer[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data:"))
            if "error" in chunk:
                raise ServingError(f"the stream ended in an error: {chunk['error']}")
            choices = chunk.get("choices") or ()
            if any(choice.get("text") for choice in choices):
                arrivals.append(time.perf_counter())
            elif not arrivals and any(choice.get("finish_reason") for choice in choices):
                finished = time.perf_counter()
            usage = chunk.get("usage") or usage
    first = arrivals[0] if arrivals else finished
    if usage is None or first is None:
        raise ServingError("the stream ended without " + ("its usage counts" if first else "any token"))
    return Timing(first - sent, [b - a for a, b in zip(arrivals, arrivals[1:])],
                  usage["completion_tokens"], usage["prompt_tokens"])
