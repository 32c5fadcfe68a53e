"""The listening socket, bound before the model loads, and a uvicorn server that drains on SIGINT and SIGTERM.

uvicorn binds its address only after the app is built: an address in use or a host that does not resolve
was reported after the "serving on" banner, with uvicorn's exit status 3. It also raises the signal that
stopped it again once it has shut down, so SIGTERM ended the process with status 143 however cleanly it
had drained.
"""
from __future__ import annotations

import contextlib
import errno
import signal
import socket
import threading
from collections.abc import Iterator
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


class DrainingServer(uvicorn.Server):
    """On SIGINT or SIGTERM: stop accepting, let the requests in flight finish (at most the config's
    ``timeout_graceful_shutdown``), stop the app, and return; ``stopped_by`` names the signal. A second
    SIGINT stops at once (uvicorn's force exit)."""

    stopped_by: str | None = None

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
