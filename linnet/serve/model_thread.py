"""The one thread that does a served model's work: the runner is built, warmed up and stepped there.

libgomp (torch's OpenMP) keeps a team of threads for every thread that runs parallel work, and once it
manages more threads than there are CPUs it spins only 100 rounds before a waiting thread sleeps,
instead of 1000: a process whose main thread built and warmed up a torch runner (oneDNN's weight
re-lay is parallel) and whose engine thread then stepped it ran every step ~17% slower (Qwen2.5-0.5B's
shapes, 16 rows, 2 threads: 123.7 / 116.5 against 99.6 / 106.4 ms; docs/NOTEBOOK.md). So a served
runner's whole life stays on this thread. A daemon thread, as the engine's always was: a process that
never stops its engine still exits.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class ModelThread:
    def __init__(self, name: str = "linnet-engine"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future:
        """Run ``fn(*args, **kwargs)`` on the thread, after the jobs before it; its future."""
        done: Future = Future()
        self._jobs.put((done, fn, args, kwargs))
        return done

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on the thread; waits, and returns its result or raises its error."""
        return self.submit(fn, *args, **kwargs).result()

    def close(self) -> None:
        """End the thread once the jobs already submitted are done."""
        self._jobs.put(None)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            done, fn, args, kwargs = job
            if done.set_running_or_notify_cancel():
                try:
                    done.set_result(fn(*args, **kwargs))
                except BaseException as e:  # handed to whoever waits on the future
                    done.set_exception(e)
