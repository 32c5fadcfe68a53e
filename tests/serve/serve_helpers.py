"""Helpers for the serving tests: a stop string that spans two tokens, and a real uvicorn server on a
free loopback port, run in a background thread."""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from linnet.generation.text import TextStream
from linnet.serve import Engine
from linnet.tokenizer import Tokenizer

CASE = "qwen3-gqa3"  # its greedy text from FOX is mostly ASCII, good for stop strings
FOX = "The quick brown fox"


def stop_across_tokens(tokenizer: Tokenizer, token_ids: Sequence[int]) -> tuple[str, str]:
    """A two-character stop string made of the end of one token's text and the start of the next's, and
    the text that generation with it must give (all the text before its first occurrence)."""
    stream = TextStream(tokenizer)
    pieces = [stream.feed(t) for t in token_ids]
    text = tokenizer.decode(token_ids)
    for before, after in zip(pieces, pieces[1:]):
        stop = before[-1:] + after[:1]
        if len(stop) == 2 and stop.isprintable() and "\ufffd" not in stop:
            return stop, text[:text.index(stop)]
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


def wait_idle(engine: Engine, timeout: float = 10.0) -> None:
    """Wait until no request holds a row or waits for one (cancellations take a step to land)."""
    deadline = time.monotonic() + timeout
    while engine.rows_busy or engine.queue_length:
        assert time.monotonic() < deadline, f"{engine.rows_busy} rows busy, {engine.queue_length} waiting"
        time.sleep(0.02)
