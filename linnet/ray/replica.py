"""One Ray Serve replica: ``linnet serve``'s engine and its FastAPI app, in a Ray actor.

The ingress hands each HTTP request over as a ``Forwarded`` and the replica runs it through the very app
``linnet serve`` serves (``create_app``), at the ASGI level, yielding the app's response messages as they
come: streaming, errors, usage and cancellation are that app's own. A caller that goes away (Ray cancels
the call) cancels the app's request, which frees its row.
"""
from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator, MutableMapping
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from linnet.serve.engine import Engine

REPLICA_HEADER = b"x-linnet-replica"


@dataclass(frozen=True)
class Forwarded:
    """An HTTP request as the ingress read it, with the text its prompt starts with (for the router)."""
    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    prefix_text: str = ""


def load_engine(args: argparse.Namespace) -> Engine:
    """The engine ``linnet serve`` builds for ``args`` (its parsed options), warmed up and ready to start."""
    from linnet.commands.serve import build_engine, open_checked

    model, draft = open_checked(args)
    return build_engine(model, args, draft)


class LinnetReplica:
    """The replica deployment's class (``linnet.ray.deployment`` wraps it in ``serve.deployment``)."""

    def __init__(self, options: dict[str, Any]):
        from ray import serve

        from linnet.serve.app import create_app

        args = argparse.Namespace(**options)
        self.engine = load_engine(args)
        # each response names its replica (x-linnet-replica): which one served what, for people and tests
        tag = serve.get_replica_context().replica_id.unique_id.encode()
        app = create_app(self.engine, args.name or args.model, args.api_key, max_body=args.max_body)
        self.served = tagged(app, tag)
        self.engine.start()  # what the app's lifespan would do; Ray, not uvicorn, drives this app

    async def forward(self, request: Forwarded) -> AsyncIterator[MutableMapping[str, Any]]:
        """Run ``request`` through the app; yield its ASGI send messages (the response start, then the body)."""
        messages: asyncio.Queue[MutableMapping[str, Any] | None] = asyncio.Queue()
        gone = asyncio.Event()
        body_read = False

        async def receive() -> dict[str, Any]:
            nonlocal body_read
            if not body_read:
                body_read = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await gone.wait()  # the app watches for a disconnect: it comes when the caller cancels
            return {"type": "http.disconnect"}

        async def send(message: MutableMapping[str, Any]) -> None:
            await messages.put(message)

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": request.method, "scheme": "http", "path": request.path,
                 "raw_path": request.path.encode(), "query_string": request.query_string, "root_path": "",
                 "headers": request.headers, "client": None, "server": None, "state": {}}
        task = asyncio.ensure_future(self.served(scope, receive, send))
        task.add_done_callback(lambda _: messages.put_nowait(None))
        try:
            ended = False
            while not ended and (message := await messages.get()) is not None:
                if message["type"] == "http.response.body":
                    # the body parts that came while the last one was relayed go as one: a Ray call a part cost
                    # more than a tiny model's decode step, and the stream fell behind the engine
                    parts, more = [message.get("body", b"")], message.get("more_body", False)
                    while more and not messages.empty():
                        following = messages.get_nowait()
                        if following is None:
                            ended = True
                            break
                        parts.append(following.get("body", b""))
                        more = following.get("more_body", False)
                    message = {"type": "http.response.body", "body": b"".join(parts), "more_body": more}
                yield message
            task.result()  # an error the app let out (it answers its own errors, so a bug): raised to the caller
        finally:  # the caller went away (Ray cancels this generator), or the response ended
            gone.set()
            task.cancel()

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine stopped is replaced."""
        if not self.engine.alive:
            raise RuntimeError("the engine stopped")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.stop()


def tagged(app: ASGIApp, tag: bytes) -> ASGIApp:
    """``app`` with ``x-linnet-replica: tag`` on every response."""
    async def with_tag(scope: Scope, receive: Receive, send: Send) -> None:
        async def send_tagged(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (REPLICA_HEADER, tag)]}
            await send(message)

        await app(scope, receive, send_tagged)

    return with_tag
