"""The soak: a real ``linnet serve`` of a tiny checkpoint under minutes of mixed requests (whole and
streamed completions and chats, clients that hang up mid-answer, malformed and oversized bodies, probes),
more at once than it has rows. Afterwards no row is held, nothing waits, the process's memory is back
within a bound of what it took once warm, and a greedy request answers as it did at the start.
``LINNET_SOAK_S`` sets the load's length (default 180 s)."""
from __future__ import annotations

import asyncio
import os
import random
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from serve_helpers import CASE
from test_fuzz_api import REFERENCE, check_error, settled
from test_serve_command import interrupt, serve

NAME = REFERENCE["model"]
DURATION_S = float(os.environ.get("LINNET_SOAK_S", "180"))
CLIENTS = 12  # against 4 rows and a queue of 4: some requests are refused (429), as under real load
MIB = 2**20


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


async def one(client: httpx.AsyncClient, rng: random.Random, seen: Counter) -> None:
    """A request of a random kind; a client that leaves does so after a random wait or a few chunks."""
    kind = rng.choice(["whole", "stream", "chat", "leave", "leave-stream", "bad", "large", "probe"])
    text = rng.choice(["The quick brown fox", "Once upon a time", "é😀 ünïcödé", "a " * 40])
    chat = {"model": NAME, "messages": [{"role": "user", "content": text}], "max_tokens": rng.randint(1, 30)}
    completion = {"model": NAME, "prompt": text, "max_tokens": rng.randint(1, 40), "temperature": rng.random(),
                  "seed": rng.randint(0, 2**63 - 1), "ignore_eos": rng.random() < 0.5}
    if kind == "probe":
        response = await client.get(rng.choice(["/health", "/metrics", "/v1/models"]))
    elif kind == "bad":
        response = await client.post("/v1/completions", content=rng.choice([b"{", b'{"model": 5}', b'"\\ud800"']))
    elif kind == "large":
        response = await client.post("/v1/completions", content=b'{"prompt": "' + b"a" * (2 * MIB) + b'"}')
    elif kind in ("stream", "leave-stream"):
        chunks = rng.randint(1, 5) if kind == "leave-stream" else None
        async with client.stream("POST", "/v1/completions", json={**completion, "stream": True}) as response:
            if response.status_code >= 400:
                await response.aread()
            else:
                async for got, _ in enumerate_async(response.aiter_lines()):
                    if chunks is not None and got >= chunks:
                        break  # hang up mid-stream
    elif kind == "leave":
        task = asyncio.ensure_future(client.post("/v1/chat/completions", json={**chat, "max_tokens": 60}))
        await asyncio.sleep(rng.uniform(0, 0.3))
        task.cancel()
        seen[kind] += 1
        return
    else:
        path, body = ("/v1/chat/completions", chat) if kind == "chat" else ("/v1/completions", completion)
        response = await client.post(path, json=body)
    assert response.status_code < 500, (kind, response.status_code)
    if response.status_code >= 400:
        check_error(response)
    seen[f"{kind} {response.status_code}"] += 1


async def enumerate_async(items: AsyncIterator[str]) -> AsyncIterator[tuple[int, str]]:
    n = 0
    async for item in items:
        n += 1
        yield n, item


async def load(url: str, seconds: float) -> Counter:
    seen: Counter = Counter()
    deadline = asyncio.get_running_loop().time() + seconds

    async def client_loop(n: int) -> None:
        rng = random.Random(n)
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            while asyncio.get_running_loop().time() < deadline:
                try:
                    await one(client, rng, seen)
                except asyncio.CancelledError:
                    raise
                except httpx.TransportError:  # this client's own hang-up, seen from its side
                    seen["transport error"] += 1

    await asyncio.gather(*(client_loop(n) for n in range(CLIENTS)))
    return seen


@pytest.mark.slow
def test_soak(checkpoint_dir):
    process, url = serve(str(checkpoint_dir(CASE)), "--rows", "4", "--positions", "128", "--max-queue", "4",
                         "--max-body", "1M", "--name", NAME)
    try:
        before = httpx.post(url + "/v1/completions", json=REFERENCE).json()["choices"][0]["text"]
        asyncio.run(load(url, min(20.0, DURATION_S)))  # warm: every kind of request, every code path, once
        settled(url)
        warm = rss(process.pid)
        seen = asyncio.run(load(url, DURATION_S))
        settled(url)
        after = rss(process.pid)
        print(f"soak: {warm / MIB:.0f} MiB warm, {after / MIB:.0f} MiB after {DURATION_S:.0f} s: {dict(seen)}")
        assert seen["transport error"] < sum(seen.values()) / 10, seen
        assert {k.split()[0] for k in seen} >= {"whole", "stream", "chat", "leave", "bad", "large", "probe"}, seen
        assert after <= warm * 1.25 + 64 * MIB, f"{warm / MIB:.0f} MiB warm, {after / MIB:.0f} MiB after: {seen}"
        assert httpx.post(url + "/v1/completions", json=REFERENCE).json()["choices"][0]["text"] == before
    finally:
        interrupt(process)
