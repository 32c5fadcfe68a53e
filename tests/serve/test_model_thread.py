"""A served runner lives on one thread: built, warmed up and stepped there (linnet.serve.model_thread)."""
from __future__ import annotations

import threading

import pytest
from serve_helpers import CASE

from linnet.backends import CacheShape, create_runner
from linnet.errors import LinnetError
from linnet.model import open_model
from linnet.serve import Engine, ModelThread, Params


def test_jobs_run_in_order_on_one_thread_and_errors_reach_the_caller():
    thread = ModelThread(name="test-model-thread")
    seen = []
    futures = [thread.submit(lambda i=i: seen.append((i, threading.current_thread().name)) or i) for i in range(5)]
    assert [f.result(timeout=10) for f in futures] == list(range(5))
    assert seen == [(i, "test-model-thread") for i in range(5)]
    with pytest.raises(LinnetError, match="no such backend"):
        thread.run(lambda: (_ for _ in ()).throw(LinnetError("no such backend")))
    assert thread.run(lambda: 7) == 7  # an error does not end the thread
    thread.close()


def test_the_engine_warms_up_and_steps_on_the_thread_that_built_its_runner(checkpoint_dir):
    weights = open_model(str(checkpoint_dir(CASE))).weights
    thread = ModelThread()
    runner = thread.run(create_runner, "reference:numpy", weights, CacheShape(2, 32))
    builder = thread.run(threading.get_ident)
    used = set()
    forward = runner._forward
    runner._forward = lambda *args: used.add(threading.get_ident()) or forward(*args)
    engine = Engine(runner, thread=thread)
    engine.warm_up()
    engine.start()
    engine.submit([5, 6, 7], Params(max_tokens=3, ignore_eos=True)).result()
    engine.stop()
    assert used == {builder} and builder != threading.get_ident()
    assert thread.run(lambda: "still open") == "still open"  # a thread it was given is the caller's to close
    thread.close()
