"""The serving engine on every registered backend: concurrent requests of different lengths give the
tokens each gives alone, rows are reused and freed on cancel, the queue refuses past its bound."""
from __future__ import annotations

import threading

import numpy as np
import pytest
from serve_helpers import CASE, FOX, stop_across_tokens

from linnet.backends import CacheShape, create_runner
from linnet.backends.registry import backends, get_backend
from linnet.errors import LinnetError
from linnet.generation import Sampling, generate
from linnet.model import open_model
from linnet.serve import CANCELLED, LENGTH, STOP, Engine, Params, QueueFull, RequestError

ROWS, POSITIONS = 3, 64
SLOW = ("torch:inductor", "torch:cudagraphs")  # inductor compiles for minutes in a fresh process
ALL_BACKENDS = [pytest.param(b.id, marks=[pytest.mark.slow] if b.id in SLOW else [], id=b.id) for b in backends()]


def make_runner(checkpoint_dir, backend: str, rows: int = ROWS, positions: int = POSITIONS):
    reason = get_backend(backend).unavailable()
    if reason:
        pytest.skip(f"{backend}: {reason}")
    model = open_model(str(checkpoint_dir(CASE)))
    return create_runner(backend, model.weights, CacheShape(rows, positions)), model.tokenizer


def prompt(n: int, seed: int) -> list[int]:
    return np.random.RandomState(seed).randint(5, 331, size=n).tolist()


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_concurrent_requests_give_the_tokens_each_gives_alone(checkpoint_dir, backend):
    runner, tokenizer = make_runner(checkpoint_dir, backend)
    # (prompt length, seed, new tokens): more requests than rows, one prompt long enough to be chunked
    specs = [(5, 1, 9), (30, 2, 6), (3, 3, 12), (11, 4, 4), (7, 5, 8), (2, 6, 5), (17, 7, 10)]
    alone = [generate(runner, prompt(n, s), new, eos_ids=[]).token_ids for n, s, new in specs]

    engine = Engine(runner, tokenizer, prefill_tokens=8)  # the 30-token prompt takes four steps
    requests = [engine.submit(prompt(n, s), Params(max_tokens=new, ignore_eos=True)) for n, s, new in specs]
    engine.start()
    try:
        results = [r.result() for r in requests]
    finally:
        engine.stop()
    assert [r.token_ids for r in results] == alone
    assert all(r.finish_reason == LENGTH and r.completion_tokens == len(r.token_ids) for r in results)
    # asked again, a request gives the completion it gave; its events, read once, are not read twice
    assert requests[0].result() is results[0]
    with pytest.raises(LinnetError, match="read already"):
        next(requests[0].events())
    rows = [r.row for r in requests]
    assert set(rows) <= set(range(ROWS)) and len(rows) > ROWS  # seven requests took turns in three rows
    assert engine.rows_busy == 0 and engine.queue_length == 0


@pytest.mark.parametrize("budget, steps_to_first_tokens", [(None, 1), (12, 3)])
def test_a_burst_of_prompts_reads_within_the_step_budget(checkpoint_dir, budget, steps_to_first_tokens):
    """By default a burst of prompts is read in one step (vLLM's 2048 tokens a step); a smaller budget
    spreads the same prompts over steps, at most that many prompt tokens in each."""
    runner, tokenizer = make_runner(checkpoint_dir, "reference:numpy")
    engine = Engine(runner, tokenizer, **({} if budget is None else {"prefill_tokens": budget}))
    fed: dict[int, int] = {}  # engine step -> prompt tokens its runner calls read
    step = runner.step
    def counted(prefill=(), decode=(), **kw):
        fed[engine.metrics.steps] = fed.get(engine.metrics.steps, 0) + sum(len(p.tokens) for p in prefill)
        return step(prefill=prefill, decode=decode, **kw)
    runner.step = counted
    requests = [engine.submit(prompt(n, s), Params(max_tokens=1, ignore_eos=True))
                for n, s in ((9, 1), (14, 2), (5, 3))]
    engine.start()
    try:
        assert all(r.result().completion_tokens == 1 for r in requests)
    finally:
        engine.stop()
    assert sum(fed.values()) == 28 and max(fed.values()) <= (budget or 2048)
    assert len([n for n in fed.values() if n]) == steps_to_first_tokens


def test_a_prompts_first_token_goes_out_before_the_next_prompt_is_read(checkpoint_dir):
    """Prompts read in one step each give their first token as soon as they are read, not at the step's end."""
    runner, tokenizer = make_runner(checkpoint_dir, "reference:numpy")
    engine = Engine(runner, tokenizer)
    firsts: dict[int, list[int]] = {}  # request -> the rows' cached lengths when its first token arrived
    done = [threading.Event() for _ in range(3)]

    def on_event(i: int, event) -> None:
        firsts.setdefault(i, list(runner.lengths))
        if event.finish_reason:
            done[i].set()

    for i, (n, s) in enumerate(((9, 1), (14, 2), (5, 3))):
        engine.submit(prompt(n, s), Params(max_tokens=2, ignore_eos=True), on_event=lambda e, i=i: on_event(i, e))
    engine.start()
    try:
        assert all(d.wait(60) for d in done)
    finally:
        engine.stop()
    assert [firsts[i] for i in range(3)] == [[9, 0, 0], [9, 14, 0], [9, 14, 5]]


def test_a_request_that_comes_while_prompts_are_read_joins_that_reading(checkpoint_dir):
    """A decodes; B comes, and while B's prompt is read C comes: C is read in that same step, before its
    decode call, rather than a whole step later; each gives the tokens it gives alone."""
    runner, tokenizer = make_runner(checkpoint_dir, "reference:numpy")
    specs = [(9, 1, 4), (14, 2, 3), (5, 3, 2)]  # A, B, C: (prompt length, seed, new tokens)
    alone = [generate(runner, prompt(n, s), new, eos_ids=[]).token_ids for n, s, new in specs]
    engine = Engine(runner, tokenizer)
    calls, requests, step = [], [], runner.step

    def submit(i):
        return engine.submit(prompt(*specs[i][:2]), Params(max_tokens=specs[i][2], ignore_eos=True))

    def recorded(prefill=(), decode=(), **kw):
        calls.append((engine.metrics.steps, "prefill" if prefill else "decode", [x.row for x in prefill or decode]))
        if decode and len(requests) == 1 or prefill and prefill[0].row == 1 and len(requests) == 2:
            requests.append(submit(len(requests)))  # B while A decodes, C while B's prompt is read
        return step(prefill=prefill, decode=decode, **kw)

    runner.step = recorded
    requests.append(submit(0))
    engine.start()
    try:
        first = requests[0].result()  # B and C are submitted, on the engine thread, before A's last token
        results = [first] + [r.result() for r in requests[1:]]
    finally:
        engine.stop()
    assert [r.token_ids for r in results] == alone
    b_step = next(s for s, kind, rows in calls if kind == "prefill" and rows == [1])
    assert [(kind, rows) for s, kind, rows in calls if s == b_step] == [("prefill", [1]), ("prefill", [2]),
                                                                        ("decode", [0])]


def test_the_step_budget_must_be_positive(checkpoint_dir):
    runner, tokenizer = make_runner(checkpoint_dir, "reference:numpy")
    with pytest.raises(LinnetError, match="prefill_tokens must be at least 1"):
        Engine(runner, tokenizer, prefill_tokens=0)


def test_the_warm_up_runs_every_shape_a_step_will_run(checkpoint_dir):
    """A decode size first met under load would compile there, stalling every row (seen: 48 s)."""
    runner, tokenizer = make_runner(checkpoint_dir, "reference:numpy", rows=5)
    shapes, forward = [], runner._forward
    runner._forward = lambda t, p, r, s: shapes.append((t.shape, s is None)) or forward(t, p, r, s)
    Engine(runner, tokenizer).warm_up()
    assert {n for (n, length), every in shapes if length == 1 and every} == set(runner.decode_sizes()) == {1, 4, 5}
    assert any(length > 1 and not every for (_, length), every in shapes)  # a prompt chunk
    assert runner.lengths == [0] * 5  # on the scratch position: no row was touched


def test_a_cancelled_request_frees_its_row_at_once(checkpoint_dir):
    runner, tokenizer = make_runner(checkpoint_dir, "torch:eager", rows=1)
    engine = Engine(runner, tokenizer).start()
    try:
        long = engine.submit(prompt(4, 1), Params(max_tokens=None, ignore_eos=True))
        events = long.events()
        first = next(events)
        assert first.finish_reason is None and engine.rows_busy == 1
        long.cancel()
        last = list(events)[-1]
        assert last.finish_reason == CANCELLED and last.completion_tokens < POSITIONS - 4
        # the row is free, and holds what the request wrote (prefix caching): all its tokens but the last
        assert engine.rows_busy == 0 and runner.lengths == [4 + last.completion_tokens - 1]
        after = engine.submit(prompt(6, 2), Params(max_tokens=5, ignore_eos=True)).result()
        assert after.token_ids == generate(runner, prompt(6, 2), 5, eos_ids=[]).token_ids
        waiting = engine.submit(prompt(3, 3), Params(max_tokens=None, ignore_eos=True))
        queued = engine.submit(prompt(3, 4), Params(max_tokens=3))
        queued.cancel()  # while it waits for the row
        assert queued.result().finish_reason == CANCELLED
        waiting.cancel()
        assert waiting.result().finish_reason == CANCELLED
    finally:
        engine.stop()
    assert engine.rows_busy == 0 and engine.queue_length == 0


def test_the_queue_refuses_cleanly_when_full(checkpoint_dir):
    runner, tokenizer = make_runner(checkpoint_dir, "torch:eager", rows=2)
    engine = Engine(runner, tokenizer, max_queue=3)  # not started: nothing leaves the queue yet
    accepted = [engine.submit(prompt(4, i), Params(max_tokens=3)) for i in range(2 + 3)]  # rows + queue
    with pytest.raises(QueueFull, match="all 2 rows are busy and 5 requests wait"):
        engine.submit(prompt(4, 9), Params(max_tokens=3))
    assert engine.metrics.refused == 1
    engine.start()
    try:
        assert all(r.result().completion_tokens >= 1 for r in accepted)
        assert engine.submit(prompt(4, 9), Params(max_tokens=3)).result().finish_reason in (STOP, LENGTH)
    finally:
        engine.stop()


def test_requests_that_cannot_run_are_refused_at_submit(checkpoint_dir):
    runner, tokenizer = make_runner(checkpoint_dir, "reference:numpy")
    engine = Engine(runner, tokenizer)
    cases = [([], Params(), "prompt", "empty"),
             ([5, 331], Params(), "prompt", "0..330"),
             (prompt(65, 1), Params(), "prompt", "more than a cache row's 64"),
             (prompt(4, 1), Params(max_tokens=0), "max_tokens", "at least 1"),
             (prompt(4, 1), Params(max_tokens=62), "max_tokens", "at most 61 new tokens")]
    for ids, params, param, message in cases:
        with pytest.raises(RequestError, match=message) as error:
            engine.submit(ids, params)
        assert error.value.param == param
    assert engine.queue_length == 0


def test_stop_ids_stop_strings_and_seeded_sampling(checkpoint_dir):
    runner, tokenizer = make_runner(checkpoint_dir, "torch:eager")
    ids = tokenizer.encode(FOX)
    free = generate(runner, ids, 20, eos_ids=[]).token_ids
    sampling = Sampling(temperature=1.0, top_p=0.9, top_k=50, seed=5)
    sampled = generate(runner, ids, 12, sampling, eos_ids=[]).token_ids
    engine = Engine(runner, tokenizer).start()
    try:
        by_id = engine.submit(ids, Params(max_tokens=20, ignore_eos=True, stop_ids=(free[3],))).result()
        cut = free.index(free[3])
        assert by_id.token_ids == free[:cut] and by_id.finish_reason == STOP
        assert by_id.completion_tokens == cut + 1  # the stop id was sampled, though not returned

        stop, before = stop_across_tokens(tokenizer, free)
        by_text = engine.submit(ids, Params(max_tokens=20, ignore_eos=True, stop=(stop,))).result()
        assert by_text.text == before and by_text.finish_reason == STOP

        seeded = engine.submit(ids, Params(max_tokens=12, sampling=sampling, ignore_eos=True)).result()
        assert seeded.token_ids == sampled
    finally:
        engine.stop()


def test_without_max_tokens_a_request_fills_its_row(checkpoint_dir):
    runner, tokenizer = make_runner(checkpoint_dir, "reference:numpy", rows=1)
    engine = Engine(runner, tokenizer).start()
    try:
        out = engine.submit(prompt(10, 3), Params(max_tokens=None, ignore_eos=True)).result()
    finally:
        engine.stop()
    assert out.finish_reason == LENGTH and out.completion_tokens == len(out.token_ids) == POSITIONS - 10 + 1
    assert engine.metrics.generated_tokens == out.completion_tokens and engine.metrics.prompt_tokens == 10
