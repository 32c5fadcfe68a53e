"""Speculative decoding in the serving engine (``--speculate ngram|MODEL``): the tokens are the engine's own
without it, over rows that speculate beside rows that do not, rows that end inside a run of kept drafts
and a row that fills its cache, by prompt lookup and by a draft model; it applies only while few rows are
busy, and never to a row whose logits are worked on the host or whose seed must reproduce its tokens."""
from __future__ import annotations

import pytest
from serve_helpers import CASE, stop_across_tokens

from linnet.backends import CacheShape, create_runner
from linnet.backends.registry import get_backend
from linnet.errors import LinnetError
from linnet.model import open_model
from linnet.sampling import Sampling
from linnet.serve import Engine, Params
from linnet.serve.speculation import Speculation

POSITIONS = 64
# prompts that repeat themselves, so prompt lookup has something to propose
LOOPING = [1, 5, 9, 17, 33, 5, 9, 17, 40, 41, 42, 5, 9, 17, 33, 8]
OTHER = [7, 30, 31, 32, 7, 30, 31, 12, 13, 7, 30, 31, 32]


@pytest.fixture(scope="module")
def model(checkpoint_dir):
    return open_model(str(checkpoint_dir(CASE)))


def runner_for(model, backend: str, rows: int):
    reason = get_backend(backend).unavailable()
    if reason:
        pytest.skip(f"{backend}: {reason}")
    return create_runner(backend, model.weights, CacheShape(rows, POSITIONS))


def serve_all(runner, tokenizer, requests, speculation: Speculation | None):
    """Each (prompt, params)'s completion, all submitted at once; and the engine's metrics."""
    engine = Engine(runner, tokenizer, speculation=speculation)
    submitted = [engine.submit(prompt, params) for prompt, params in requests]
    engine.start()
    try:
        return [r.result() for r in submitted], engine.metrics
    finally:
        engine.stop()


@pytest.mark.parametrize("backend", ["reference:numpy", "torch:eager", "onnx:cpu"])
@pytest.mark.parametrize("rows_setting", [4, 2])
def test_greedy_tokens_are_the_engines_own(model, backend, rows_setting):
    runner = runner_for(model, backend, rows=4)
    tokenizer = model.tokenizer
    whole = Params(max_tokens=40, ignore_eos=True)
    plain_runs, _ = serve_all(runner, tokenizer, [(LOOPING, whole)], None)
    plain = plain_runs[0].token_ids
    # a stop string and a stop id that end the request inside what speculation would have kept
    stop_text, _ = stop_across_tokens(tokenizer, plain[6:12])
    requests = [
        (LOOPING, whole),
        (LOOPING, Params(max_tokens=40, ignore_eos=True, stop=(stop_text,))),
        (OTHER, Params(max_tokens=30, stop_ids=(plain[9],), ignore_eos=True)),
        (OTHER, Params(max_tokens=20, ignore_eos=True, logit_bias=((3, 1.5),))),  # worked on the host: decodes
        (LOOPING, Params(max_tokens=POSITIONS - len(LOOPING) + 1, ignore_eos=True)),  # fills its row to the end
        (OTHER, Params(max_tokens=7, ignore_eos=True)),  # ends mid-draft on max_tokens
    ]
    expected, _ = serve_all(runner, tokenizer, requests, None)
    got, metrics = serve_all(runner, tokenizer, requests, Speculation(draft_tokens=6, rows=rows_setting))
    for e, g in zip(expected, got):
        assert (g.token_ids, g.text, g.finish_reason, g.completion_tokens) == \
            (e.token_ids, e.text, e.finish_reason, e.completion_tokens)
    assert 0 < metrics.accepted_tokens <= metrics.drafted_tokens
    assert metrics.generated_tokens == sum(e.completion_tokens for e in expected)


def test_rows_that_must_not_speculate_do_not(model):
    runner = runner_for(model, "reference:numpy", rows=2)
    speculation = Speculation(draft_tokens=6)
    seeded = Params(max_tokens=30, ignore_eos=True, sampling=Sampling(temperature=0.8, seed=7))
    logprobs = Params(max_tokens=30, ignore_eos=True, logprobs=2)
    for params in (seeded, logprobs):  # a seed reproduces its tokens whether or not the server speculates
        plain, _ = serve_all(runner, model.tokenizer, [(LOOPING, params)], None)
        got, metrics = serve_all(runner, model.tokenizer, [(LOOPING, params)], speculation)
        assert got[0].token_ids == plain[0].token_ids and got[0].logprobs == plain[0].logprobs
        assert metrics.drafted_tokens == 0
    unseeded = Params(max_tokens=30, ignore_eos=True, sampling=Sampling(temperature=0.01))
    got, metrics = serve_all(runner, model.tokenizer, [(LOOPING, unseeded)], speculation)
    assert metrics.drafted_tokens > 0 and len(got[0].token_ids) == 30


def test_past_the_busy_rows_it_decodes_as_without(model):
    """Three rows busy against a setting of two: nothing is drafted until one ends."""
    runner = runner_for(model, "reference:numpy", rows=3)
    same = Params(max_tokens=12, ignore_eos=True)
    _, metrics = serve_all(runner, model.tokenizer, [(LOOPING, same)] * 3, Speculation(draft_tokens=6, rows=2))
    assert metrics.drafted_tokens == 0


def test_more_drafts_than_a_chunk_holds_are_refused(model):
    runner = runner_for(model, "reference:numpy", rows=1)
    with pytest.raises(LinnetError, match="--draft-tokens must be 1 to"):
        Engine(runner, model.tokenizer, speculation=Speculation(draft_tokens=runner.prefill_chunk))


def test_a_step_checks_every_speculating_row_in_one_call_within_one_rows_check(model, monkeypatch):
    """Three rows speculating: each verify call holds at most draft_tokens + 1 positions in all (the drafts
    shared out), and rows without drafts are checked there by their last token rather than decoded in a
    second call; the tokens are the engine's own without speculation."""
    runner = runner_for(model, "reference:numpy", rows=3)
    requests = [(LOOPING, Params(max_tokens=24, ignore_eos=True)), (OTHER, Params(max_tokens=24, ignore_eos=True)),
                ([3, 4, 5, 6, 7, 8], Params(max_tokens=24, ignore_eos=True))]
    expected, _ = serve_all(runner, model.tokenizer, requests, None)
    checks, left = [], []
    verify, speculate = runner.verify, Engine._speculate
    monkeypatch.setattr(runner, "verify", lambda chunks: checks.append(sorted(map(len, chunks.values())))
                        or verify(chunks))

    def speculate_and_keep(engine, decode):
        verified, rest = speculate(engine, decode)
        left.extend(rest if verified else [])  # rows a step with a check left to decode
        return verified, rest

    monkeypatch.setattr(Engine, "_speculate", speculate_and_keep)
    got, metrics = serve_all(runner, model.tokenizer, requests, Speculation(draft_tokens=6, rows=3))
    assert [g.token_ids for g in got] == [e.token_ids for e in expected]
    assert metrics.drafted_tokens > 0 and not left
    assert all(sum(lengths) <= 6 + 1 for lengths in checks)
    each = Speculation(draft_tokens=6).drafts_each(3)
    assert max(max(lengths) for lengths in checks if len(lengths) == 3) == 1 + each
    assert any(lengths[0] == 1 and lengths[-1] > 1 for lengths in checks)  # a row without drafts beside one with


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    """Another random model of the target's tokenizer and vocabulary (most of its drafts rejected)."""
    from checkpoints import CASES_BY_ID, build_checkpoint

    return open_model(str(build_checkpoint(CASES_BY_ID[CASE], tmp_path_factory.mktemp("draft"), seed=1)))


@pytest.mark.parametrize("backend", ["reference:numpy", "onnx:cpu"])
@pytest.mark.parametrize("drafter", ["same", "other"])
def test_a_draft_model_gives_the_engines_own_tokens(model, other_model, backend, drafter):
    """Target row r drafts on draft row r: requests of different prompts side by side, one ending mid-draft,
    a later request in a row another left (the draft row read again from its start), a greedy one beside a
    sampled one whose drafts the rejection rule checks against their q."""
    runner = runner_for(model, backend, rows=2)
    draft_model = model if drafter == "same" else other_model
    draft = create_runner(backend, draft_model.weights, CacheShape(2, POSITIONS))
    requests = [(LOOPING, Params(max_tokens=30, ignore_eos=True)), (OTHER, Params(max_tokens=7, ignore_eos=True)),
                (OTHER, Params(max_tokens=25, ignore_eos=True)), (LOOPING, Params(max_tokens=20, ignore_eos=True))]
    expected, _ = serve_all(runner, model.tokenizer, requests, None)
    got, metrics = serve_all(runner, model.tokenizer, requests, Speculation(draft_tokens=4, draft=draft))
    assert [g.token_ids for g in got] == [e.token_ids for e in expected]
    assert 0 <= metrics.accepted_tokens <= metrics.drafted_tokens and metrics.drafted_tokens > 0
    if drafter == "same":  # the target's own weights: its drafts are the target's greedy tokens (but for near
        assert metrics.accepted_tokens >= 0.9 * metrics.drafted_tokens  # ties a one-token step breaks otherwise)
    else:  # rejected drafts: the draft row goes back to the target's token each time
        assert metrics.accepted_tokens < metrics.drafted_tokens
    sampled = Params(max_tokens=20, ignore_eos=True, sampling=Sampling(temperature=0.9))
    (out,), metrics = serve_all(runner, model.tokenizer, [(LOOPING, sampled)], Speculation(draft_tokens=4, draft=draft))
    assert len(out.token_ids) == 20 and metrics.drafted_tokens > 0


def test_a_draft_runner_smaller_than_the_target_is_refused(model):
    runner = runner_for(model, "reference:numpy", rows=2)
    small = create_runner("reference:numpy", model.weights, CacheShape(1, POSITIONS))
    with pytest.raises(LinnetError, match="the draft model's runner has 1 rows of 64 positions; it needs the "
                                          "target's 2 of 64"):
        Engine(runner, model.tokenizer, speculation=Speculation(draft=small))
