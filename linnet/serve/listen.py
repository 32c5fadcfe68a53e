"""The listening socket, bound before the model loads, and a uvicorn server that drains on SIGINT and SIGTERM.

uvicorn binds its address only after the app is built: an address in use or a host that does not resolve
was reported after the "serving on" banner, with uvicorn's exit status 3. It also raises the signal that
stopped it again once it has shut down, so SIGTERM ended the process with status 143 however cleanly it
had drained.
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import math
import signal
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator
from types import FrameType

import uvicorn

from linnet.errors import LinnetError

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (as uvicorn would bind it: IPv6 where the host has a colon); a host
    that does not resolve, an address in use or one this machine does not have is a LinnetError."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        address = socket.getaddrinfo(host or None, port, family, socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][4]
    except (socket.gaierror, UnicodeError, ValueError) as e:  # ValueError: a NUL in the name
        reason = e.strerror if isinstance(e, socket.gaierror) else str(e)
        raise LinnetError(f"--host {host!r} does not resolve to an address: {reason}") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a port in TIME_WAIT is free
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise LinnetError(f"--port {port}: {host}:{port} is already in use (another server?); choose "
                              "another port") from None
        raise LinnetError(f"cannot listen on --host {host!r} --port {port}: {e.strerror}") from None
    return sock


# After the drain's deadline has ended the requests still running, how long their answers may take to
# close (an error chunk and [DONE] for a stream) before uvicorn cancels them mid-answer.
CLOSING_S = 5.0


class DrainingServer(uvicorn.Server):
    """On SIGINT or SIGTERM: stop accepting, let the requests in flight finish for at most ``drain_s``
    seconds, then call ``at_deadline`` (``linnet serve`` stops its engine there, which ends each request
    still running with an error its client is told of), stop the app, and return; ``stopped_by`` names the
    signal. A second SIGINT stops at once (uvicorn's force exit)."""

    stopped_by: str | None = None

    def __init__(self, config: uvicorn.Config, drain_s: float,
                 at_deadline: Callable[[], Awaitable[None]] | None = None):
        config.timeout_graceful_shutdown = math.ceil(drain_s + CLOSING_S)  # the backstop: uvicorn cancels
        super().__init__(config)
        self.drain_s, self.at_deadline = drain_s, at_deadline

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        deadline = asyncio.get_running_loop().call_later(self.drain_s, self._deadline) if self.at_deadline else None
        try:
            await super().shutdown(sockets)
        finally:
            if deadline is not None:
                deadline.cancel()

    def _deadline(self) -> None:
        assert self.at_deadline is not None
        self._ending = asyncio.ensure_future(self.at_deadline())  # held: a task nobody holds may be collected

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():  # only the main thread takes signals
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in STOP_SIGNALS}
        try:
            yield
        finally:  # unlike uvicorn's own, the signal is not raised again: the server drained, the exit is 0
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.stopped_by = self.stopped_by or signal.Signals(sig).name
        super().handle_exit(sig, frame)
        # Stop accepting now: uvicorn's main loop sees should_exit at its next tick, up to 0.1 s (longer on a
        # busy machine) later, and a connection made in between would be served during the drain.
        for server in getattr(self, "servers", ()):
            server.get_loop().call_soon_threadsafe(server.close)
