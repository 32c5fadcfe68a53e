"""Under sampling the rejection rule leaves the target's distribution; a seed reproduces a run; a draft
of another tokenizer is refused by name."""
from __future__ import annotations

import json

import numpy as np
import pytest
from scipy.stats import chisquare

from linnet.backends import CacheShape, create_runner
from linnet.errors import UnsupportedModel
from linnet.generation import generate
from linnet.model import open_model
from linnet.sampling import Sampling, probabilities
from linnet.speculative import DraftModel, PromptLookup, Proposal, Speculator, check_same_tokenizer, verify

ALPHA = 1e-3  # each chi-square test's significance level: a correct rule fails it once in a thousand seeds
DRAWS = 20_000
SAMPLING = Sampling(temperature=1.5, top_k=40, top_p=0.95)
CONTEXT = [1, 5, 9, 17, 33]


@pytest.fixture(scope="module")
def model(checkpoint_dir):
    return open_model(str(checkpoint_dir("qwen3-gqa3")))


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """The p-value of ``counts`` drawn from ``probs``, tokens expected fewer than 5 times lumped together."""
    expected = probs * counts.sum()
    big = expected >= 5
    observed = np.append(counts[big], counts[~big].sum())
    expected = np.append(expected[big], expected[~big].sum())
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    return float(chisquare(observed, expected).pvalue)


@pytest.mark.parametrize("drafter", ["lookup", "draft"])
def test_the_rule_keeps_the_targets_distribution(model, drafter):
    """Two drafts, checked against the target's logits at the context and after each draft: the first
    token is distributed as p0, and the second, after a first token x, as p1(x) (where the rule stops
    after one token, the second is drawn from p1(x) as a plain step would). Prompt lookup proposes fixed
    tokens (q one-hot); the draft model's q proposes three tokens a position at odds far from p (a
    rare token half the time), so rejections and the residual max(0, p - q) both matter."""
    runner = create_runner("reference:numpy", model.weights, CacheShape(rows=1, positions=32))

    def target(*drafts: int) -> np.ndarray:
        return runner.prefill(0, [*CONTEXT, *drafts], all_logits=True)[-1 - len(drafts):]

    p0 = probabilities(target()[0], SAMPLING)
    ranked0 = np.argsort(-p0)
    x = int(ranked0[1])  # a likely token, not the likeliest: kept and rejected both often
    p1 = probabilities(target(x)[1], SAMPLING)
    ranked1 = np.argsort(-p1)
    if drafter == "lookup":
        support, weights = [[x], [int(ranked1[2])]], [[1.0], [1.0]]
    else:
        support = [[int(ranked0[0]), x, int(ranked0[30])], [int(ranked1[0]), int(ranked1[2]), int(ranked1[30])]]
        weights = [[0.2, 0.3, 0.5], [0.3, 0.2, 0.5]]
    q = np.zeros((2, p0.size))
    for i in range(2):
        q[i, support[i]] = weights[i]
    logits = {(a, b): target(a, b) for a in support[0] for b in support[1]}
    rng = np.random.default_rng(0)
    firsts, seconds = np.zeros(p0.size), np.zeros(p0.size)
    for _ in range(DRAWS):
        drafts = [int(rng.choice(p0.size, p=q[0])), int(rng.choice(p0.size, p=q[1]))]
        out = verify(logits[drafts[0], drafts[1]], Proposal(drafts, None if drafter == "lookup" else q), SAMPLING, rng)
        firsts[out[0]] += 1
        if out[0] == x:
            seconds[out[1] if len(out) > 1 else rng.choice(p1.size, p=p1)] += 1
    assert chi_square_p(firsts, p0) > ALPHA
    assert seconds.sum() > 1000 and chi_square_p(seconds, p1) > ALPHA
    # the test can fail: the drafts' own frequencies are far from p
    assert chi_square_p(firsts, 0.5 * (q[0] + p0)) < ALPHA


def test_greedy_rule_keeps_the_agreeing_prefix():
    logits = np.eye(5)[[3, 1, 4, 0]] * 10
    assert verify(logits, Proposal([3, 1, 2]), Sampling(), np.random.default_rng(0)) == [3, 1, 4]
    assert verify(logits, Proposal([2, 1, 4]), Sampling(), np.random.default_rng(0)) == [3]
    assert verify(logits, Proposal([3, 1, 4]), Sampling(), np.random.default_rng(0)) == [3, 1, 4, 0]


def test_a_seed_reproduces_a_speculative_run(model):
    runner = create_runner("torch:eager", model.weights, CacheShape(rows=1, positions=64))
    draft = create_runner("torch:eager", model.weights, CacheShape(rows=1, positions=64))
    sampling = Sampling(temperature=0.8, seed=7)
    for drafter in (lambda: PromptLookup(n=2), lambda: DraftModel(draft, model.spec.vocab_size)):
        runs = [generate(runner, CONTEXT * 3, 30, sampling, eos_ids=[],
                         speculator=Speculator(runner, drafter(), 5, sampling)).token_ids for _ in range(2)]
        other = generate(runner, CONTEXT * 3, 30, Sampling(temperature=0.8, seed=8), eos_ids=[],
                         speculator=Speculator(runner, drafter(), 5, Sampling(temperature=0.8, seed=8))).token_ids
        assert runs[0] == runs[1] != other


def test_ngram_proposes_what_followed_the_latest_longest_match():
    lookup = PromptLookup(n=3)
    rng, s = np.random.default_rng(0), Sampling()
    assert lookup.propose([7, 1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 2, 3], 3, s, rng).tokens == [4, 5, 2]
    assert lookup.propose([1, 2, 3, 4], 3, s, rng).tokens == []
    assert lookup.propose([5, 6, 5], 4, s, rng).tokens == [6, 5]


def test_a_draft_of_another_tokenizer_is_refused_by_name(model, checkpoint_dir, tmp_path):
    from tokenizers import Tokenizer, models

    other_dir = tmp_path / "other"
    other_dir.mkdir()
    for name in ("config.json", "model.safetensors"):
        (other_dir / name).write_bytes((checkpoint_dir("qwen3-gqa3") / name).read_bytes())
    Tokenizer(models.WordLevel({"<pad>": 0, "<s>": 1, "</s>": 2, "a": 3}, unk_token="<pad>")).save(
        str(other_dir / "tokenizer.json"))
    (other_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    other = open_model(str(other_dir))
    with pytest.raises(UnsupportedModel, match=f"draft model {other_dir}.*does not share the tokenizer"):
        check_same_tokenizer(model.tokenizer, other.tokenizer, str(model.path), str(other_dir))
    check_same_tokenizer(model.tokenizer, model.tokenizer, "a", "b")  # the same one passes
