"""The OpenAI-compatible HTTP API (FastAPI) over an ``Engine``.

The engine thread never waits on HTTP: each request's events go to an ``asyncio.Queue`` of the event loop
through ``call_soon_threadsafe``. A client that goes away cancels its request, which frees its row. A stream
that fails, in the engine or here, ends with an error chunk and ``[DONE]``, never cut off.
"""
from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing, asynccontextmanager
from functools import partial
from typing import Any, cast

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from linnet.errors import LinnetError
from linnet.serve.body import DEFAULT_MAX_BODY, BodyLimit, BodyTooLarge, ValidationError, invalid, parsed
from linnet.serve.engine import Engine, Event, QueueFull, RequestError
from linnet.serve.engine import Request as Submitted
from linnet.serve.grammar import GrammarCompiler
from linnet.serve.logits import TokenLogprob
from linnet.serve.page import chat_page
from linnet.serve.protocol import (
    Answer,
    ChatBody,
    CompletionBody,
    GenerationBody,
    Responder,
    error_body,
    finish_reason,
)
from linnet.serve.tools import ToolPlan, ToolReplies

log = logging.getLogger("linnet.serve")


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.body = status, error_body(message, type_, param, code)


def create_app(engine: Engine, model_name: str, api_key: str | None = None,
               max_body: int = DEFAULT_MAX_BODY) -> FastAPI:
    """The app; it starts the engine's thread when it starts serving and stops it at shutdown. A body past
    ``max_body`` bytes is refused (413); bodies are parsed and tokenised off the event loop (``body``)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.stop)

    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise LinnetError("serving needs the model's tokenizer, and this engine has none")
    grammars = GrammarCompiler(tokenizer)  # structured output and forced tool calls
    app = FastAPI(title="Linnet", lifespan=lifespan)
    app.add_middleware(BodyLimit, limit=max_body)

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.encode(), api_key.encode()):
            raise APIError(401, "a valid API key is required: send the header 'Authorization: Bearer KEY'",
                           code="invalid_api_key")

    def check_model(body: GenerationBody) -> None:
        if body.model != model_name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body, status_code=e.status)

    @app.exception_handler(RequestValidationError)
    @app.exception_handler(ValidationError)
    async def invalid_body(request: Request, e: RequestValidationError | ValidationError) -> JSONResponse:
        message, param = invalid(list(e.errors()))
        return JSONResponse(error_body(message, param=param), status_code=400)

    @app.exception_handler(BodyTooLarge)
    async def body_too_large(request: Request, e: BodyTooLarge) -> JSONResponse:
        return e.response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(e.detail), code=str(e.status_code)), status_code=e.status_code)

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, e: ClientDisconnect) -> Response:
        """The client left while its body was read: no one to answer, nothing to log."""
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def server_error(request: Request, e: Exception) -> JSONResponse:
        """A bug: the client gets the API's error body (the traceback goes to the server's log)."""
        return JSONResponse(error_body(f"internal error: {type(e).__name__}", "server_error"), status_code=500)

    app.get("/", include_in_schema=False)(chat_page)  # the chat page, open as /health is: it holds no secret

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = engine.alive
        return JSONResponse({"status": "ok" if ok else "engine stopped"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        text = engine.metrics.prometheus(engine.queue_length, engine.rows_busy, engine.rows)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "linnet", "max_model_len": engine.runner.cache.positions}]}

    # Each route reads its body (``CompletionBody``, ``ChatBody``) itself: parsed and tokenised on a worker
    # thread by ``read_completion`` and ``read_chat``, not on the event loop as a declared body would be.
    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(request: Request) -> Any:
        body, ids = await parsed(request, read_completion)
        echo = "" if not body.echo else body.prompt if isinstance(body.prompt, str) else tokenizer.decode(ids)
        scored = ids if body.echo and body.logprobs is not None else ()  # the echo's tokens get logprobs too
        return await generate(body, ids, Responder(model_name, chat=False, tokenizer=tokenizer, echo=echo,
                                                   echo_ids=scored), request)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat(request: Request) -> Any:
        body, ids = await parsed(request, read_chat)
        return await generate(body, ids, Responder(model_name, chat=True, tokenizer=tokenizer), request)

    def read_completion(raw: bytes) -> tuple[CompletionBody, list[int]]:
        body = CompletionBody.model_validate_json(raw)
        check_model(body)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "one prompt per request: this server does not batch prompts", param="prompt")
            prompt = prompt[0]
        prepare_output(body)
        # what is left of a list is token ids (or nothing): a list of strings was one string above
        return body, tokenizer.encode(prompt) if isinstance(prompt, str) else cast(list[int], prompt)

    def read_chat(raw: bytes) -> tuple[ChatBody, list[int]]:
        body = ChatBody.model_validate_json(raw)
        check_model(body)
        try:
            plan = body.tool_plan(tokenizer.chat_template)
            ids = tokenizer.encode_chat([m.as_template_input() for m in body.messages],
                                        tools=plan.template_tools() if plan else None)
        except RequestError as e:
            raise APIError(400, str(e), param=e.param, code=e.code) from e
        except LinnetError as e:
            raise APIError(400, str(e), param="messages") from e
        prepare_output(body, plan)
        return body, ids

    def prepare_output(body: CompletionBody | ChatBody, plan: ToolPlan | None = None) -> None:
        """The grammar of each choice and the tool calls to read (``StructuredFields.prepare_output``)."""
        try:  # no more matchers than rows: more choices than that are refused (``generate``)
            body.prepare_output(grammars, min(body.choices, engine.rows), plan)
        except RequestError as e:
            raise APIError(400, str(e), param=e.param, code=e.code) from e

    async def generate(body: CompletionBody | ChatBody, ids: list[int], responder: Responder, request: Request) -> Any:
        """Submit the request's choices (``n``, or ``best_of``), each a request of the engine in a row of its own,
        the prompt read once (``Engine.submit_choices``: the others fork from the first's row); their events
        come back as (choice, event)."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        count = body.choices

        def deliver(choice: int, event: Event) -> None:  # on the engine's thread
            loop.call_soon_threadsafe(events.put_nowait, (choice, event))

        try:
            if count > engine.rows:
                name = "best_of" if count > body.n else "n"
                raise RequestError(f"{name} is {count}, but this server runs at most {engine.rows} sequences at once "
                                   "(its cache rows)", name)
            params = [body.request_params(i) for i in range(count)]
            handles = engine.submit_choices(ids, params, [partial(deliver, i) for i in range(count)])
        except (RequestError, QueueFull) as e:  # nothing was queued
            if isinstance(e, QueueFull):
                raise APIError(429, str(e), type_="server_busy", code="queue_full") from e
            raise APIError(400, str(e), param=e.param, code=e.code) from e
        if body.stream:
            return StreamingResponse(stream(body, responder, events, handles), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await whole(body, responder, events, handles, request)

    async def whole(body: GenerationBody, responder: Responder, events: asyncio.Queue[tuple[int, Event]],
                    handles: list[Submitted], request: Request) -> JSONResponse:
        async def gather() -> list[Answer]:
            texts: list[list[str]] = [[] for _ in handles]
            logprobs: list[list[TokenLogprob]] = [[] for _ in handles]
            prompt_logprobs: list[list[TokenLogprob]] = [[] for _ in handles]
            last: dict[int, Event] = {}
            while len(last) < len(handles):
                i, event = await events.get()
                texts[i].append(event.text)
                logprobs[i] += event.logprobs
                prompt_logprobs[i] += event.prompt_logprobs
                if event.finish_reason:
                    last[i] = event
            return [Answer("".join(texts[i]), last[i], logprobs[i], prompt_logprobs[i]) for i in range(len(handles))]

        async def client_gone() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        gathered, gone = asyncio.create_task(gather()), asyncio.create_task(client_gone())
        await asyncio.wait([gathered, gone], return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if not gathered.done():  # the client went away before the answer
            gathered.cancel()
            for handle in handles:
                handle.cancel()
            return JSONResponse(error_body("the client disconnected"), status_code=499)
        answers = gathered.result()
        failed = next((a.last for a in answers if finish_reason(a.last) == "error"), None)
        if failed is not None:
            return JSONResponse(error_body(failed.error or "generation failed", "server_error"), status_code=500)
        every = [a.last for a in answers]
        if len(answers) > body.n:  # best_of: the n of highest cumulative logprob, best first
            answers = sorted(answers, key=lambda a: -sum(t.logprob for t in a.logprobs or ()))[:body.n]
        if not body.wants_logprobs:
            answers = [Answer(a.text, a.last) for a in answers]
        return JSONResponse(ToolReplies(body.output_tools).whole(responder.whole_choices(answers, usage_of=every)))

    async def stream(body: GenerationBody, responder: Responder, events: asyncio.Queue[tuple[int, Event]],
                     handles: list[Submitted]) -> AsyncIterator[str]:
        try:
            async with aclosing(stream_chunks(body, responder, events, len(handles))) as chunks:
                async for chunk in chunks:
                    yield chunk
        except Exception as e:  # a bug here (a detokeniser, a tool parser): an error chunk, then [DONE]
            log.exception("a stream failed")
            yield sse(error_body(f"internal error: {type(e).__name__}", "server_error"))
        finally:  # the client went away (the server cancels this generator), or the stream ended
            for handle in handles:
                handle.cancel()
        yield "data: [DONE]\n\n"

    async def stream_chunks(body: GenerationBody, responder: Responder, events: asyncio.Queue[tuple[int, Event]],
                            count: int) -> AsyncGenerator[str, None]:
        """The stream's chunks of ``count`` choices, but its ``[DONE]``: an engine error is an error chunk."""
        include_usage, shown = body.include_usage, body.wants_logprobs
        replies = ToolReplies(body.output_tools)  # content that is tool calls, as tool-call deltas
        last: dict[int, Event] = {}
        if responder.chat:
            for i in range(count):
                yield sse(responder.chunk(None, role=True, include_usage=include_usage, index=i))
        while len(last) < count:
            i, event = await events.get()
            if event.finish_reason and finish_reason(event) == "error":
                yield sse(error_body(event.error or "generation failed", "server_error"))
                return
            # a chunk per token, its text empty while held back (as vLLM's); the echo's logprobs with the first
            if event.text or event.token_ids or event.prompt_logprobs:
                for chunk in replies.chunk(responder.chunk(event.text, include_usage=include_usage, index=i,
                                                           logprobs=event.logprobs if shown else None,
                                                           prompt_logprobs=event.prompt_logprobs)):
                    yield sse(chunk)
            if event.finish_reason:
                last[i] = event
                for chunk in replies.last(responder.chunk(None, finish_reason(event), include_usage=include_usage,
                                                          index=i)):
                    yield sse(chunk)
        if include_usage:
            yield sse(responder.usage_chunk([last[i] for i in range(count)]))

    return app


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
