"""``linnet serve``: an OpenAI-compatible HTTP server over the engine's fixed cache rows."""
from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
from dataclasses import replace
from typing import TYPE_CHECKING, cast

from linnet.backends.runner import Runner
from linnet.commands._cache import check_cache_memory, check_positions
from linnet.commands._checks import port, size, text, whole
from linnet.commands._common import (
    RAY_FLAGS,
    add_model_argument,
    add_runner_arguments,
    check_process_arguments,
    make_runner,
    onnx_when_fastest,
)
from linnet.commands._speculate import add_speculation_arguments, open_draft, serving_speculation
from linnet.errors import LinnetError
from linnet.loaded_model import LoadedModel
from linnet.model import open_model
from linnet.serve.engine import STEP_PROMPT_TOKENS, Engine
from linnet.serve.lockstep import LeaderRunner, follow_calls
from linnet.tokenizer import Tokenizer

if TYPE_CHECKING:
    from fastapi import FastAPI


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_model_argument(parser)
    add_runner_arguments(parser)
    parser.add_argument("--rows", type=whole(1), default=64, help="cache rows: requests generating at once")
    parser.add_argument("--positions", type=whole(2), default=640, help="positions per row: prompt + new tokens")
    parser.add_argument("--max-queue", type=whole(0), default=256, help="requests that may wait for a row")
    parser.add_argument("--prefill-tokens", type=whole(1), default=STEP_PROMPT_TOKENS,
                        help="prompt tokens a step reads over all rows (default %(default)s, vLLM's CPU server's); "
                        "fewer delay running streams less, more read a burst of prompts sooner")
    parser.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                        help="read every prompt whole, rather than reusing a prefix a free row still holds")
    parser.add_argument("--host", type=text, default="127.0.0.1", help="address to listen on (default: loopback only)")
    parser.add_argument("--port", type=port, default=8000)
    parser.add_argument("--api-key", type=text, default=os.environ.get("LINNET_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 (default: $LINNET_API_KEY, if set)")
    parser.add_argument("--name", type=text, help="the model name clients send (default: MODEL as given)")
    parser.add_argument("--max-body", type=size, default="4M", metavar="SIZE",
                        help="the largest request body, in bytes or with k, M or G (default: %(default)s); a larger "
                        "one is refused (413) before it is read")
    parser.add_argument("--drain-timeout", type=whole(0), default=30, metavar="SECONDS",
                        help="on SIGINT or SIGTERM, how long the requests in flight may take to finish; those still "
                        "running then end with an error their clients are sent (default: %(default)s)")
    add_speculation_arguments(parser.add_argument_group("speculative decoding"), serving=True)
    ray = parser.add_argument_group("replicas through Ray Serve (pip install 'linnet[ray]'; docs/SCALE.md)")
    ray.add_argument("--replicas", type=whole(1), metavar="N",
                     help="serve N replicas of the engine, routed by prompt prefix")
    ray.add_argument("--ray-address", type=text, metavar="ADDRESS",
                     help="join this Ray cluster (default: start a local Ray)")
    ray.add_argument("--min-replicas", type=whole(1), metavar="N",
                     help="autoscale on queue length, from this many replicas ...")
    ray.add_argument("--max-replicas", type=whole(1), metavar="N", help="... to this many")
    ray.add_argument("--router", choices=("prefix", "round-robin"),
                     help="send a request to the replica holding its prompt's prefix (prefix, the default), or to "
                     "the replicas in turn (round-robin)")
    parser.set_defaults(func=handle, backend=None)  # None: default_backend()


def default_backend(dtype: str = "f32") -> str:
    """onnx:cpu where it is the fastest ready (``onnx_when_fastest``): its products of many rows ran 2.5x
    torch:eager's in the same bench (SmolLM2 on 2 cores, 339 against 134 tok/s; docs/SERVE.md); else
    torch:eager."""
    return onnx_when_fastest(dtype) or "torch:eager"


def handle(args: argparse.Namespace) -> int:
    try:
        from linnet.serve.listen import listen
    except ModuleNotFoundError as e:
        raise LinnetError(f"linnet serve needs {e.name}: pip install 'linnet[serve]'") from None

    check_process_arguments(args)
    if args.num_processes > 1 and args.process_id:  # no server here: process 0's calls, made again
        return follow(args)
    if any(getattr(args, name) for name in RAY_FLAGS):
        from linnet.ray.launch import serve_with_ray

        return serve_with_ray(args)
    with listen(args.host, args.port) as listener:  # before the model loads: a taken port or unknown host fails now
        return load_and_serve(args, listener)


def load_and_serve(args: argparse.Namespace, listener: socket.socket) -> int:
    """Check the model and the flags (a mistake fails here, before anything answers), then serve: the
    server answers at once, as loading (``linnet.serve.loading``), while the runner is built and warmed up
    off the event loop; a load that fails ends the process with its error."""
    model, draft = open_checked(args)
    return serve(model, draft, args.name or args.model, args, listener)


def open_checked(args: argparse.Namespace) -> tuple[LoadedModel, LoadedModel | None]:
    """The model ``args`` name and the draft model ``--speculate`` names (or None), with the flags checked
    against them (the default backend filled in)."""
    serving_speculation(args)  # its flags refused first, before anything loads or warns
    args.backend = args.backend or default_backend(args.dtype)
    model = open_model(args.model)
    if model.tokenizer is None:
        raise LinnetError(f"{model.path} has no tokenizer.json; linnet serve needs one")
    draft = open_draft(args, model)
    check_positions("--positions", args.positions, model.spec)
    check_cache_memory(model.spec, args.dtype, args.backend, args.rows, args.positions, "--rows or --positions")
    if draft is not None:
        check_positions("--positions", args.positions, draft.spec)
        check_cache_memory(draft.spec, args.dtype, args.backend, args.rows, args.positions,
                           "--rows or --positions (the draft model's cache has as many)")
    check_chat_fits(model.tokenizer, args.positions)  # a warning: after every refusal
    return model, draft


def build_engine(model: LoadedModel, args: argparse.Namespace, draft: LoadedModel | None = None) -> Engine:
    """The engine ``args`` ask for, its runner (and ``draft``'s, speculating) built and warmed up, ready to
    start."""
    from linnet.serve.model_thread import ModelThread

    thread = ModelThread()  # the runner is built, warmed up and stepped on one thread (linnet.serve.model_thread)
    runner = thread.run(make_runner, model, args, args.positions, rows=args.rows)
    if getattr(args, "num_processes", 1) > 1:  # process 0 of several: each call the engine makes, every process makes
        runner = cast(Runner, thread.run(lead, runner))
    speculation = serving_speculation(args)
    if speculation is not None and draft is not None:  # a row per target row, warmed up as the target is
        drafting = thread.run(make_runner, draft, args, args.positions, rows=args.rows)
        thread.run(drafting.warm_up)
        speculation = replace(speculation, draft=drafting)
    engine = Engine(runner, model.tokenizer, max_queue=args.max_queue, prefill_tokens=args.prefill_tokens,
                    thread=thread, prefix_cache=args.prefix_cache, speculation=speculation)
    try:
        engine.warm_up()
    except BaseException:
        if isinstance(runner, LeaderRunner):  # the load fails, and the server with it: the followers end too
            runner.stop_followers()
        raise
    return engine


def serve(model: LoadedModel, draft: LoadedModel | None, name: str, args: argparse.Namespace,
          listener: socket.socket) -> int:
    """Serve until SIGINT or SIGTERM, then drain: no new connections, the requests in flight finish (or end
    with an error after ``--drain-timeout`` seconds), and the process exits 0 with a line saying why it
    stopped. ``draft``: the draft model of ``--speculate MODEL``, or None."""
    import uvicorn

    from linnet.serve.app import create_app
    from linnet.serve.listen import DrainingServer
    from linnet.serve.loading import LoadingApp

    engines: list[Engine] = []

    def load() -> FastAPI:
        engine = build_engine(model, args, draft)
        engines.append(engine)
        host = f"[{args.host}]" if ":" in args.host else args.host  # an IPv6 address, as a URL writes it
        print(f"linnet serve: {name} on {args.backend} {args.dtype}, {args.rows} rows x {args.positions} positions, "
              f"load {engine.runner.load_time:.2f} s; http://{host}:{args.port}/v1", file=sys.stderr, flush=True)
        return create_app(engine, name, args.api_key, max_body=args.max_body)

    async def stop_generating() -> None:  # the drain's deadline: the requests still running end, told why
        for engine in engines:
            await asyncio.to_thread(engine.stop)

    def failed(error: BaseException) -> None:
        server.should_exit = True

    app = LoadingApp(load, on_failure=failed)
    server = DrainingServer(uvicorn.Config(app, log_level="warning"), args.drain_timeout, stop_generating)
    try:
        server.run(sockets=[listener])
    finally:  # the engine has stopped (or never started): no call follows
        for engine in engines:
            if isinstance(engine.runner, LeaderRunner):
                engine.runner.stop_followers()
    if app.error is not None:
        if isinstance(app.error, LinnetError):
            raise app.error
        raise LinnetError(f"loading the model failed: {type(app.error).__name__}: {app.error}") from app.error
    print(f"linnet serve: stopped ({server.stopped_by or 'the server ended'})", file=sys.stderr, flush=True)
    return 0


def lead(runner: Runner) -> LeaderRunner:
    """Process 0's runner, its calls sent to the other processes (``linnet.serve.lockstep``)."""
    from linnet.backends.xla.channel import CoordinatorChannel

    return LeaderRunner(runner, CoordinatorChannel())


def follow(args: argparse.Namespace) -> int:
    """Process I > 0 of ``--num-processes``: build the same runner, then make process 0's calls on it until
    process 0 stops; no port is opened here."""
    from linnet.backends.xla.channel import CoordinatorChannel

    runner = make_runner(open_checked(args)[0], args, args.positions, rows=args.rows)
    label = f"linnet serve: process {args.process_id} of {args.num_processes}"
    print(f"{label} follows process 0", file=sys.stderr, flush=True)
    try:
        follow_calls(runner, CoordinatorChannel(), label)
    except LinnetError as e:
        raise LinnetError(f"{label}: {e}") from None
    print(f"{label}: stopped (process 0 stopped)", file=sys.stderr, flush=True)
    return 0


def check_chat_fits(tokenizer: Tokenizer, positions: int) -> None:
    """Say so, once, when a row cannot hold the chat template around an empty message and a token of the
    answer: every chat request would be refused. Not an error: completions of short prompts (a benchmark's
    token ids) still fit."""
    if tokenizer.chat_template is None:
        return
    try:
        least = len(tokenizer.encode_chat([{"role": "user", "content": ""}]))
    except LinnetError:  # a template that refuses an empty message: each request is checked as it comes
        return
    if least >= positions:
        print(f"linnet serve: warning: --positions {positions} holds no chat request (the chat template around an "
              f"empty message takes {least} tokens; {least + 1} would hold one); only /v1/completions can answer",
              file=sys.stderr, flush=True)
