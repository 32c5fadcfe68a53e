"""jax's report of a lost process, as one line.

When a process of a ``--num-processes`` job dies, jax's client in each of the others learns it from the
coordinator and ends its own process from a C++ thread: a glog FATAL line and a stack trace on file
descriptor 2, then SIGABRT, which no Python handler can catch (jaxlib's ``missed_heartbeat_callback`` would
take its place, but calling a Python one crashes jaxlib 0.10.2 with std::bad_cast). So this process's
stderr goes through a small filter process that passes every byte on as it comes, and writes one line in
place of that report. The process still ends as jax ends it (status 134), at once rather than never.
"""
from __future__ import annotations

import os
import subprocess
import sys

# The report's own words (jaxlib's client.h), and the line the coordination agent logs just before it.
_FILTER = r'''
import os, re, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C to the job is the job's: this ends at end of input
signal.signal(signal.SIGTERM, signal.SIG_IGN)
FATAL = b"JAX distributed service detected fatal errors"
BEFORE = b"Polled an error from coordination"
GLOG = re.compile(rb"[IWEF]\d{0,4}( |$)")  # what may begin a glog line
line = sys.argv[1].encode() + b"\n"
held, pending, dropping = b"", b"", False


def write(data):
    while data and not dropping:
        data = data[os.write(2, data):]


def take(text):
    global pending, dropping
    if FATAL in text:
        write(line)
        dropping = True  # the report and its stack trace
    elif BEFORE in text:
        pending = text  # dropped if the report follows, else written with the next line
    else:
        write(pending + text)
        pending = b""


while data := os.read(0, 65536):
    *lines, held = (held + data).split(b"\n")
    for text in lines:
        take(text + b"\n")
    if held and not pending and not GLOG.match(held):  # a partial line (a progress bar) goes on now
        write(held)
        held = b""
if held:
    take(held)
write(pending)
'''

_FILTERS: list[subprocess.Popen] = []


def one_line_when_lost(line: str) -> None:
    """From now on, this process's stderr (file descriptor 2, Python's and native code's) passes through
    the filter, which writes ``line`` in place of jax's report of a lost process."""
    sys.stderr.flush()
    stderr = os.dup(2)
    filtered = subprocess.Popen([sys.executable, "-c", _FILTER, line], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                stderr=stderr, close_fds=True)
    os.close(stderr)
    _FILTERS.append(filtered)  # held: a Popen collected while its process runs warns
    assert filtered.stdin is not None
    os.dup2(filtered.stdin.fileno(), 2)
    filtered.stdin.close()  # fd 2 now holds the pipe's only writing end: the filter ends when this process does
