"""The lockstep in one process: an engine over a ``LeaderRunner``, and a follower thread making its calls on a
second runner of the same checkpoint through an in-memory channel; the two runners end in the same state."""
from __future__ import annotations

import queue
import threading

import numpy as np
import pytest
from serve_helpers import CASE

from linnet.backends import CacheShape, create_runner
from linnet.backends.runner import Decode, Prefill
from linnet.errors import LinnetError
from linnet.model import open_model
from linnet.sampling import Sampling
from linnet.serve import Engine, Params
from linnet.serve.lockstep import LeaderRunner, follow_calls

ROWS, POSITIONS = 3, 64


class QueueChannel:
    def __init__(self) -> None:
        self.messages: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self.sent = 0
        self.barrier = threading.Barrier(2)

    def send(self, message: bytes) -> None:
        self.sent += 1
        self.messages.put(message)

    def receive(self, timeout_s: float) -> bytes | None:
        try:
            return self.messages.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def wait_for_all(self, name: str, timeout_s: float) -> None:
        self.barrier.wait(timeout_s)


@pytest.fixture
def pair(checkpoint_dir):
    model = open_model(str(checkpoint_dir(CASE)))
    runners = [create_runner("reference:numpy", model.weights, CacheShape(ROWS, POSITIONS)) for _ in range(2)]
    channel = QueueChannel()
    follower = threading.Thread(target=follow_calls, args=(runners[1], channel, "follower"), daemon=True)
    follower.start()
    leader = LeaderRunner(runners[0], channel)
    yield leader, runners, model.tokenizer, channel
    leader.stop_followers()
    follower.join(timeout=10)
    assert not follower.is_alive()


def test_the_follower_makes_every_call_and_ends_in_the_leaders_state(pair):
    leader, (first, second), tokenizer, _ = pair
    seeds: list[list[dict]] = [[], []]  # each runner's sampled rows' seeds, step by step
    for runner, seen in zip((first, second), seeds):
        def step(*args, _step=runner.step, _seen=seen, **kwargs):
            _seen.append({row: s.seed for row, s in (kwargs.get("sampling") or {}).items() if not s.greedy})
            return _step(*args, **kwargs)
        runner.step = step  # type: ignore[method-assign]
    engine = Engine(leader, tokenizer, prefill_tokens=8)  # type: ignore[arg-type]
    engine.warm_up()
    params = [Params(max_tokens=6, ignore_eos=True),
              Params(max_tokens=5, ignore_eos=True, sampling=Sampling(temperature=1.0)),  # no seed: given one
              Params(max_tokens=4, ignore_eos=True, logit_bias=((5, 100.0),))]  # adjusted on the host
    requests = [engine.submit(list(range(3 + 4 * i, 14 + 4 * i)), p) for i, p in enumerate(params)]
    engine.start()
    try:
        results = [r.result() for r in requests]
    finally:
        engine.stop()
        leader.stop_followers()  # returns once the follower has made every call before the stop
    assert results[2].token_ids == [5] * 4  # process 0's adjust ran; the follower's stand-in did not matter
    assert first.lengths == second.lengths and any(first.lengths)
    # the seedless sampled request drew from one seed, the same in both (device backends' draws' keys)
    assert seeds[0] == seeds[1]
    given = {seed for step in seeds[0] for seed in step.values()}
    assert len(given) == 1 and None not in given
    # the same caches: the same logits for the next token of every row that holds some
    held = [row for row in range(ROWS) if first.lengths[row]]
    outs = [runner.step(decode=[Decode(row, 7) for row in held], logits=True) for runner in (first, second)]
    for row in held:
        np.testing.assert_array_equal(outs[0][row].logits, outs[1][row].logits)


def test_a_call_the_follower_could_not_read_is_refused_before_it_is_sent(pair):
    leader, _, _, channel = pair
    with pytest.raises(LinnetError, match=r"^linnet serve across processes cannot send step: its arguments hold a "
                                          r"numpy\..*, which the lockstep does not send"):
        leader.step(prefill=[Prefill(0, np.array([1, 2, 3]))])
    assert channel.sent == 0


def test_queries_run_in_process_0_alone_and_a_set_attribute_is_set_in_both(pair):
    leader, (first, second), _, channel = pair
    assert leader.can_keep(0, 0) and leader.decode_sizes() == first.decode_sizes()
    assert channel.sent == 0
    leader.prefill_chunk = 16
    leader.reset(0)
    assert channel.sent == 2 and first.prefill_chunk == 16
    leader.stop_followers()  # returns once the follower has read the stop, after the calls before it
    assert second.prefill_chunk == 16
    with pytest.raises(LinnetError, match="the followers have stopped"):
        leader.reset(0)
