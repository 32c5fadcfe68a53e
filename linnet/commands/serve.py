"""``linnet serve``: an OpenAI-compatible HTTP server over the engine's fixed cache rows."""
from __future__ import annotations

import argparse
import os
import sys

from linnet.commands._checks import whole
from linnet.commands._common import add_model_argument, add_runner_arguments, make_runner, onnx_when_fastest
from linnet.errors import LinnetError
from linnet.model import open_model
from linnet.serve.engine import STEP_PROMPT_TOKENS


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
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    parser.add_argument("--port", type=whole(1), default=8000)
    parser.add_argument("--api-key", default=os.environ.get("LINNET_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 (default: $LINNET_API_KEY, if set)")
    parser.add_argument("--name", help="the model name clients send (default: MODEL as given)")
    parser.set_defaults(func=handle, backend=None)  # None: default_backend()


def default_backend(dtype: str = "f32") -> str:
    """onnx:cpu where it is the fastest ready (``onnx_when_fastest``): its products of many rows ran 2.5x
    torch:eager's in the same bench (SmolLM2 on 2 cores, 339 against 134 tok/s; docs/SERVE.md); else
    torch:eager."""
    return onnx_when_fastest(dtype) or "torch:eager"


def handle(args: argparse.Namespace) -> int:
    import uvicorn

    from linnet.serve.app import create_app
    from linnet.serve.engine import Engine
    from linnet.serve.model_thread import ModelThread

    args.backend = args.backend or default_backend(args.dtype)
    model = open_model(args.model)
    if model.tokenizer is None:
        raise LinnetError(f"{model.path} has no tokenizer.json; linnet serve needs one")
    if args.positions > model.spec.max_positions:
        raise LinnetError(f"--positions {args.positions} is more than the model's {model.spec.max_positions}")
    thread = ModelThread()  # the runner is built, warmed up and stepped on one thread (linnet.serve.model_thread)
    runner = thread.run(make_runner, model, args, args.positions, rows=args.rows)
    engine = Engine(runner, model.tokenizer, max_queue=args.max_queue, prefill_tokens=args.prefill_tokens,
                    thread=thread)
    engine.warm_up()
    name = args.name or args.model
    print(f"linnet serve: {name} on {args.backend} {args.dtype}, {args.rows} rows x {args.positions} positions, "
          f"load {runner.load_time:.2f} s; http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    uvicorn.run(create_app(engine, name, args.api_key), host=args.host, port=args.port, log_level="warning")
    return 0
