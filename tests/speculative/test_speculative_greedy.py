"""Greedy speculation gives the target's own tokens exactly, on every uncompiled backend, both drafters."""
from __future__ import annotations

import pytest

from linnet.backends import CacheShape, create_runner
from linnet.generation import generate
from linnet.model import open_model
from linnet.sampling import Sampling
from linnet.speculative import DraftModel, PromptLookup, Speculator

BACKENDS = ["reference:numpy", "torch:eager", "onnx:cpu"]
# a prompt that repeats itself, so prompt lookup has something to propose
PROMPT = [1, 5, 9, 17, 33, 5, 9, 17, 40, 41, 42, 5, 9, 17, 33, 8]


@pytest.fixture(scope="module")
def target(checkpoint_dir):
    return open_model(str(checkpoint_dir("qwen3-gqa3")))


@pytest.fixture(scope="module")
def drafts(checkpoint_dir, tmp_path_factory):
    """The target itself (every draft kept) and another random model of its tokenizer (most rejected)."""
    from checkpoints import CASES_BY_ID, build_checkpoint

    other = build_checkpoint(CASES_BY_ID["llama-gqa3"], tmp_path_factory.mktemp("draft"), seed=1)
    return {"same": open_model(str(checkpoint_dir("qwen3-gqa3"))), "other": open_model(str(other))}


def speculative(runner, drafter, most, prompt, new, **kw):
    speculator = Speculator(runner, drafter, most, kw.get("sampling", Sampling()))
    return generate(runner, prompt, new, speculator=speculator, **kw), speculator


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("drafter", ["ngram", "same", "other"])
def test_greedy_tokens_are_the_targets(backend, drafter, target, drafts):
    runner = create_runner(backend, target.weights, CacheShape(rows=1, positions=64))
    plain = generate(runner, PROMPT, 40, eos_ids=[]).token_ids
    if drafter == "ngram":
        chosen = PromptLookup(n=3)
    else:
        chosen = DraftModel(create_runner(backend, drafts[drafter].weights, CacheShape(rows=1, positions=64)),
                            target.spec.vocab_size)
    out, spec = speculative(runner, chosen, 6, PROMPT, 40, eos_ids=[])
    assert out.token_ids == plain
    assert spec.verified > 0
    if drafter == "other":
        assert spec.accepted < spec.drafted  # rejections: the going back was exercised
    else:
        assert spec.accepted > 0  # runs of kept drafts


@pytest.mark.parametrize("backend", ["reference:numpy", "torch:eager"])
def test_rows_finishing_mid_draft_and_a_cache_just_large_enough(backend, target):
    """EOS inside a run of kept drafts, max_new_tokens inside one, and a cache of exactly the positions
    the request needs, which drafts must not run past."""
    new = 30
    runner = create_runner(backend, target.weights, CacheShape(rows=1, positions=len(PROMPT) + new - 1))
    plain = generate(runner, PROMPT, new, eos_ids=[]).token_ids
    out, spec = speculative(runner, PromptLookup(), 8, PROMPT, new, eos_ids=[])
    assert out.token_ids == plain and spec.accepted > 0
    for eos in sorted(set(plain[3:]))[:4]:
        expected = generate(runner, PROMPT, new, eos_ids=[eos])
        got, _ = speculative(runner, PromptLookup(), 8, PROMPT, new, eos_ids=[eos])
        assert (got.token_ids, got.finish_reason) == (expected.token_ids, expected.finish_reason) == (
            plain[:plain.index(eos)], "stop")
    for most in range(1, 12):
        got, _ = speculative(runner, PromptLookup(), 8, PROMPT, most, eos_ids=[])
        assert got.token_ids == plain[:most]


def test_sliding_ring_caches_going_back(checkpoint_dir):
    """A model whose every layer slides over 5 tokens, with rings sized for a chunk of 8: verifying
    chunks of up to 8 and going back after rejections keeps the tokens the target's."""
    model = open_model(str(checkpoint_dir("mistral-window5")))
    runner = create_runner("torch:eager", model.weights, CacheShape(rows=1, positions=96, chunk=8))
    assert runner.rings  # the rings are what this test is about
    plain = generate(runner, PROMPT, 60, eos_ids=[]).token_ids
    for drafter in (PromptLookup(n=2), DraftModel(create_runner("torch:eager", model.weights, CacheShape(
            rows=1, positions=96, chunk=8)), model.spec.vocab_size)):
        out, spec = speculative(runner, drafter, 7, PROMPT, 60, eos_ids=[])
        assert out.token_ids == plain and spec.accepted > 0
    # the draft model (the target's own weights: every draft kept) on a request that shares the first 60
    # of the 75 tokens its row held: going back 15 > the chunk of 8, its rings no longer hold the window
    # before position 60, so it must read the prompt again (else its drafts go wrong and are rejected)
    second = [*PROMPT, *plain][:60] + [77, 78, 79]
    plain = generate(runner, second, 30, eos_ids=[]).token_ids
    out, spec = speculative(runner, drafter, 7, second, 30, eos_ids=[])
    assert out.token_ids == plain and spec.accepted == spec.drafted > 0


def test_draft_tokens_must_leave_the_chunk_room(target):
    runner = create_runner("reference:numpy", target.weights, CacheShape(rows=1, positions=64, chunk=8))
    with pytest.raises(Exception, match="--draft-tokens must be 1 to 7"):
        Speculator(runner, PromptLookup(), 8, Sampling())
