"""Prefix caching: a freed row keeps what it wrote, and a request whose prompt begins with it reads only the
rest, giving the tokens it gives read whole; sliding layers' rings keep a prefix only while they hold every
key the rest reads; a row is never shared between requests in flight."""
from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
from serve_helpers import CASE

from linnet.backends import CacheShape, create_runner
from linnet.backends.registry import get_backend
from linnet.model import open_model
from linnet.serve import Engine, Params
from linnet.serve.engine import SHARED_MIN

BACKEND = "reference:numpy"
# the engine's tests also run where a row's cache is laid out otherwise (ONNX Runtime's windows of host rows)
BACKENDS = ["reference:numpy", "torch:eager", "onnx:cpu"]
CHUNK = 4  # the ring tests' prefill chunk: rings of window + 3 slots in 64 positions


def prompt(n: int, seed: int) -> list[int]:
    return np.random.RandomState(seed).randint(5, 331, size=n).tolist()


def in_turn(engine: Engine, prompts: list[list[int]], new: int = 5) -> list:
    """Each prompt's completion, one request after another (each finds the rows the last ones left)."""
    return [engine.submit(p, Params(max_tokens=new, ignore_eos=True)).result() for p in prompts]


@contextmanager
def engines(model, shape: CacheShape, backend: str = BACKEND) -> Iterator[tuple[Engine, Engine]]:
    """Two running engines on runners of their own: with prefix caching and without."""
    reason = get_backend(backend).unavailable()
    if reason:
        pytest.skip(f"{backend}: {reason}")
    pair = (Engine(create_runner(backend, model.weights, shape), model.tokenizer),
            Engine(create_runner(backend, model.weights, shape), model.tokenizer, prefix_cache=False))
    for engine in pair:
        engine.start()
    try:
        yield pair
    finally:
        for engine in pair:
            engine.stop()


@pytest.mark.parametrize("backend", BACKENDS)
def test_reused_prefixes_give_the_same_tokens_and_count_as_cached(checkpoint_dir, backend):
    model = open_model(str(checkpoint_dir(CASE)))
    system = prompt(24, 1)
    first = system + prompt(6, 2)
    with engines(model, CacheShape(2, 96), backend) as (cached, plain):
        [opening] = in_turn(plain, [first])
        follow_up = first + opening.token_ids + prompt(4, 3)  # a second turn: the first's answer, then more
        other = system + prompt(5, 4)
        prompts = [first, follow_up, other, other]
        got = in_turn(cached, prompts)
        want = in_turn(plain, prompts)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    # the second turn finds all but the first answer's last token (never fed back); the same prompt all
    # but its last token (read again for the logits of the first new one)
    reused = [0, len(first) + 4, len(system), len(other) - 1]
    assert [r.cached_tokens for r in got] == reused and not any(r.cached_tokens for r in want)
    assert cached.metrics.cached_tokens == sum(reused)
    assert cached.metrics.prompt_tokens == sum(map(len, prompts)) - sum(reused)


def test_requests_in_flight_never_share_a_row(checkpoint_dir):
    """Three requests with one system prompt, admitted together: one takes the row that holds it, the
    others rows of their own, and each gives its tokens alone."""
    model = open_model(str(checkpoint_dir(CASE)))
    system = prompt(20, 5)
    prompts = [system + prompt(3 + i, 10 + i) for i in range(3)]
    with engines(model, CacheShape(3, 96)) as (cached, plain):
        want = in_turn(plain, prompts, new=6)
        in_turn(cached, [system + prompt(4, 9)])  # leaves the system prompt in a row
        with cached._cond:  # submitted together: admitted in one pass, before any of them ends
            requests = [cached.submit(p, Params(max_tokens=6, ignore_eos=True)) for p in prompts]
        got = [r.result() for r in requests]
    assert sorted(r.row for r in requests) == [0, 1, 2]
    assert [r.cached_tokens for r in got] == [len(system), 0, 0]
    assert [r.token_ids for r in got] == [r.token_ids for r in want]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_burst_sharing_a_long_prefix_reads_it_once(checkpoint_dir, backend):
    """Three requests with one system prompt of SHARED_MIN tokens or more, submitted together into empty rows:
    the first reads it, the others wait for that read and copy it into rows of their own; then a request
    that comes while they run copies it from a running row. Each gives the tokens it gives read whole."""
    model = open_model(str(checkpoint_dir(CASE)))
    system = prompt(SHARED_MIN + 6, 60)
    prompts = [system + prompt(3 + i, 70 + i) for i in range(4)]
    with engines(model, CacheShape(4, 128), backend) as (cached, plain):
        want = in_turn(plain, prompts, new=6)
        with cached._cond:  # submitted together: none holds the system prompt yet
            requests = [cached.submit(p, Params(max_tokens=50, ignore_eos=True)) for p in prompts[:3]]
        while not cached.metrics.generated_tokens:  # they run
            time.sleep(0.01)
        late = cached.submit(prompts[3], Params(max_tokens=6, ignore_eos=True))
        got = [r.result() for r in [*requests, late]]
    assert sorted(r.row for r in [*requests, late]) == [0, 1, 2, 3]
    assert [r.cached_tokens for r in got] == [0] + [len(system)] * 3
    assert cached.metrics.prompt_tokens == sum(map(len, prompts)) - 3 * len(system)
    assert [r.token_ids[:6] for r in got] == [r.token_ids for r in want]


def test_a_short_shared_prefix_is_read_again_rather_than_waited_for(checkpoint_dir):
    model = open_model(str(checkpoint_dir(CASE)))
    system = prompt(SHARED_MIN - 1, 61)
    prompts = [system + prompt(3 + i, 80 + i) for i in range(2)]
    with engines(model, CacheShape(2, 128)) as (cached, _):
        with cached._cond:
            requests = [cached.submit(p, Params(max_tokens=4, ignore_eos=True)) for p in prompts]
        assert [r.result().cached_tokens for r in requests] == [0, 0]


def test_a_request_without_a_prefix_spares_the_rows_freed_last(checkpoint_dir):
    """Unrelated prompts fill the empty rows first, then replace the row freed longest ago: the follow-ups
    of the conversations served last find their prefixes, the oldest's is gone."""
    model = open_model(str(checkpoint_dir(CASE)))
    firsts = [prompt(12, 20 + i) for i in range(4)]
    with engines(model, CacheShape(3, 96)) as (cached, _):
        requests = []
        for p in firsts:  # one after another, each finding the rows the last ones left
            requests.append(cached.submit(p, Params(max_tokens=5, ignore_eos=True)))
            requests[-1].result()
        answers = [r.result() for r in requests]  # each completion again, as it was
        follow_ups = [p + a.token_ids + prompt(3, 30 + i) for i, (p, a) in enumerate(zip(firsts, answers))]
        got = in_turn(cached, follow_ups[1:] + follow_ups[:1])
    assert [r.row for r in requests] == [0, 1, 2, 0]  # empty rows first, then the oldest
    # the second, third and fourth conversations find theirs; the first's row went to the fourth
    assert [r.cached_tokens for r in got] == [len(p) + 4 for p in firsts[1:]] + [0]


def test_a_spare_row_does_not_widen_the_running_rows_span(checkpoint_dir):
    """With a request running in row 3, an unrelated one takes row 2, next to it, not row 0, freed longest
    ago: ONNX Runtime's CPU runner steps every row between the lowest and the highest running one."""
    model = open_model(str(checkpoint_dir(CASE)))
    with engines(model, CacheShape(4, 96)) as (cached, _):
        for i in range(3):  # rows 0, 1 and 2 hold a prompt each
            cached.submit(prompt(8, 40 + i), Params(max_tokens=2, ignore_eos=True)).result()
        running = cached.submit(prompt(8, 50), Params(max_tokens=80, ignore_eos=True))
        next(running.events())  # its first token: it runs
        other = cached.submit(prompt(8, 51), Params(max_tokens=2, ignore_eos=True))
        other.result()
        running.cancel()
    assert (running.row, other.row) == (3, 2)


RING_CASES = ("mistral-window5", "gemma2-softcap-window6")


@pytest.mark.parametrize("case", RING_CASES)
def test_a_ring_keeps_a_prefix_exactly_while_it_holds_every_key_read_after_it(checkpoint_dir, case):
    """A row that wrote 30 positions through rings of N slots (window W, chunks of C = N - W + 1) keeps its
    first m where m >= 30 - C: below that, forcing the keep gives other logits than reading it all."""
    model = open_model(str(checkpoint_dir(case)))
    ring = create_runner(BACKEND, model.weights, CacheShape(1, 64, chunk=CHUNK))
    full = create_runner(BACKEND, model.weights, CacheShape(1, 64))
    [(slots, window)] = ring.rings
    assert slots == window + CHUNK - 1 < 30
    written, rest = prompt(30, 1), prompt(6, 2)
    for keep in range(1, 31):
        ring.reset(0)
        ring.prefill(0, written)
        keeps = ring.can_keep(0, keep)
        assert keeps == (keep >= 30 - CHUNK)
        ring.lengths[0] = keep  # forced where it may not: the refusal must be needed
        got = ring.prefill(0, rest, start=keep, all_logits=True)
        full.reset(0)
        want = full.prefill(0, written[:keep] + rest, all_logits=True)[keep:]
        assert bool(np.abs(got - want).max() <= 1e-4) == keeps, keep
    ring.reset(0)
    ring.prefill(0, written)
    with pytest.raises(Exception, match="cannot keep its first 10"):
        ring.reset(0, keep=10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_engine_reuses_only_what_the_ring_still_holds(checkpoint_dir, backend):
    model = open_model(str(checkpoint_dir("mistral-window5")))
    first = prompt(20, 3)
    with engines(model, CacheShape(1, 64, chunk=CHUNK), backend) as (cached, plain):
        [opening] = in_turn(plain, [first], new=6)  # the row then holds 25 positions
        follow_up = first + opening.token_ids + prompt(3, 4)  # keeps all 25: the ring holds the last C's keys
        elsewhere = first[:10] + prompt(5, 6)  # shares 10 the ring has lost
        prompts = [first, follow_up, elsewhere]
        want = in_turn(plain, prompts, new=6)
        got = in_turn(cached, prompts, new=6)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert [r.cached_tokens for r in got] == [0, 25, 0]
