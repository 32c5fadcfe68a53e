"""Helpers for the serving tests: a stop string that spans two tokens, and a real uvicorn server on a
free loopback port, run in a background thread."""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from linnet.backends import CacheShape, create_runner
from linnet.generation.text import TextStream
from linnet.loaded_model import LoadedModel
from linnet.serve import Engine
from linnet.serve.app import create_app
from linnet.tokenizer import Tokenizer

CASE = "qwen3-gqa3"  # its greedy text from FOX is mostly ASCII, good for stop strings
FOX = "The quick brown fox"


def stop_across_tokens(tokenizer: Tokenizer, token_ids: Sequence[int], whole: bool = False) -> tuple[str, str]:
    """A stop string made of the end of one token's text and the first character of the next's, and the
    text that generation with it must give (all the text before its first occurrence). The end is the
    last character, or with ``whole`` the token's whole text, where the stop string first occurs at its
    start: that token's text is then held back entirely."""
    stream = TextStream(tokenizer)
    pieces = [stream.feed(t) for t in token_ids]
    text, at = tokenizer.decode(token_ids), 0
    for before, after in zip(pieces, pieces[1:]):
        stop = (before if whole else before[-1:]) + after[:1]
        if before and after and stop.isprintable() and "\ufffd" not in stop and (not whole or text.index(stop) == at):
            return stop, text[:text.index(stop)]
        at += len(before)
    raise AssertionError(f"no two printable pieces in a row among {pieces}")


@contextmanager
def running_server(app) -> Iterator[str]:
    """Serve ``app`` with uvicorn on a free loopback port in a thread; yields its base URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@contextmanager
def eager_server(model: LoadedModel, name: str, rows: int, positions: int,
                 max_queue: int = 64) -> Iterator[tuple[Engine, str]]:
    """An engine over ``model`` on torch:eager, served on loopback: the engine and its base URL."""
    runner = create_runner("torch:eager", model.weights, CacheShape(rows, positions))
    engine = Engine(runner, model.tokenizer, max_queue=max_queue)
    with running_server(create_app(engine, name)) as url:
        yield engine, url


def openai_client(url: str):
    """The ``openai`` client of the server at ``url``, which never retries (a test sees every failure)."""
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def wait_idle(engine: Engine, timeout: float = 10.0) -> None:
    """Wait until no request holds a row or waits for one (cancellations take a step to land)."""
    deadline = time.monotonic() + timeout
    while engine.rows_busy or engine.queue_length:
        assert time.monotonic() < deadline, f"{engine.rows_busy} rows busy, {engine.queue_length} waiting"
        time.sleep(0.02)
