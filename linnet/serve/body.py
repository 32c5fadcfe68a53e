"""A request's body: at most ``max_body`` bytes, refused (413) while it is read, and parsed off the event loop.

FastAPI reads a declared body model on the event loop, then parses and validates it there: one 50 MB body
held every other client, ``/health`` included, for 29 s. Here the body is read by the loop only up to the
limit, and parsing (pydantic's JSON reader, which also refuses a lone surrogate such as ``"\\ud800"``:
no text holds one) and tokenising run on a worker thread, so the loop keeps serving the other streams.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from linnet.serve.protocol import error_body

T = TypeVar("T")
DEFAULT_MAX_BODY = 4 * 2**20  # a whole cache row of 128k token ids as JSON is about 1 MB


class BodyTooLarge(Exception):
    def __init__(self, limit: int):
        super().__init__(f"the request body is larger than this server's limit of {limit} bytes "
                         "(linnet serve --max-body)")

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(str(self), code="request_too_large"), status_code=413)


class BodyLimit:
    """ASGI middleware: a body that declares more than ``limit`` bytes is refused before it is read; one
    that sends more than it declared (or declares nothing, chunked) is refused when the limit is passed."""

    def __init__(self, app: ASGIApp, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            return await BodyTooLarge(self.limit).response()(scope, receive, send)
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:  # raised inside the route's read: the app's handler answers 413
                raise BodyTooLarge(self.limit)
            return message

        await self.app(scope, limited, send)


async def parsed(request: Request, parse: Callable[[bytes], T]) -> T:
    """``parse(body)`` on a worker thread, once the loop has read the body."""
    return await asyncio.to_thread(parse, await request.body())


def invalid(errors: list[Any]) -> tuple[str, str | None]:
    """A validation error's first complaint as a message and the field it names (``param``)."""
    first = errors[0]
    where = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        reason = first.get("ctx", {}).get("error", first["msg"])
        if "surrogate" in reason or "hex escape" in reason:  # jiter's words for a lone "\ud800"
            reason += " (a \\ud800-\\udfff escape is half of a surrogate pair; alone it is no text)"
        return f"the body is not valid JSON: {reason}", None
    return f"{'.'.join(where) or 'body'}: {first['msg']}", where[0] if where else None


__all__ = ["DEFAULT_MAX_BODY", "BodyLimit", "BodyTooLarge", "ValidationError", "invalid", "parsed"]
