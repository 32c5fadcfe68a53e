"""The server while its model loads: it answers at once, and hands every request to the real app once
the model is ready.

``linnet serve`` binds its port before the model loads (a taken port fails at once), then builds the
runner and warms it up, which takes seconds to minutes. Until then a client that connected saw nothing:
an orchestrator's probe could not tell loading from hung. Here ``/health`` answers 503
``{"status": "loading"}``, the API 503 with an error body that says the model is loading, and ``/`` the
chat page (which waits for the model itself).
"""
from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from fastapi import FastAPI
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from linnet.serve.page import chat_page
from linnet.serve.protocol import error_body

RETRY_AFTER_S = 5  # what a loading server asks a client to wait before it tries again


class LoadingApp:
    """An ASGI app that runs ``load`` (which returns the real app) on a thread of its own once the server
    has started; until it returns, answers as a loading server; then passes every request to that app,
    whose lifespan (the engine's start and stop) it enters then. A ``load`` that fails calls ``on_failure``
    with the error (``linnet serve`` stops the server, and exits with the error)."""

    def __init__(self, load: Callable[[], FastAPI], on_failure: Callable[[BaseException], None]):
        self._load, self._on_failure = load, on_failure
        self.app: FastAPI | None = None
        self.error: BaseException | None = None
        self._exits = contextlib.AsyncExitStack()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if self.app is not None:
            return await self.app(scope, receive, send)
        if scope["type"] == "http":
            await loading_response(scope["path"])(scope, receive, send)
        # a websocket: not served (closing the scope without accepting refuses it)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        loading: asyncio.Task | None = None
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                loading = asyncio.create_task(self._load_then_serve())
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if loading is not None and not loading.done():
                    loading.cancel()  # stopped while loading: the loading thread is a daemon, left behind
                await self._exits.aclose()  # the app's own shutdown: its engine finishes what runs and stops
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _load_then_serve(self) -> None:
        try:
            app = await asyncio.wrap_future(on_daemon_thread(self._load))
            await self._exits.enter_async_context(app.router.lifespan_context(app))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # anything: the process must end, and say why
            self.error = e
            self._on_failure(e)
            return
        self.app = app


def loading_response(path: str) -> Response:
    if path == "/health":
        return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
    if path == "/":
        return chat_page()
    return JSONResponse(error_body("the model is loading; try again when /health answers 200", "server_error",
                                   code="model_loading"),
                        status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})


def on_daemon_thread(fn: Callable[[], Any]) -> Future:
    """``fn()`` on a daemon thread: a server stopped while loading exits without waiting for the load
    (``asyncio.to_thread``'s threads are joined at exit)."""
    done: Future = Future()

    def work() -> None:
        try:
            done.set_result(fn())
        except BaseException as e:  # handed to whoever waits on the future
            done.set_exception(e)

    threading.Thread(target=work, name="linnet-load", daemon=True).start()
    return done
