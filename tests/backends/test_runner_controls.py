"""Per-row controls in the batched step: a row whose control adjusts its logits draws from the adjusted
logits on the host (greedy: their argmax), reports logprobs of the model's own logits, and leaves the rows
beside it drawing where the model runs, as without controls."""
from __future__ import annotations

import numpy as np
import pytest

from linnet.backends import CacheShape, Decode, Prefill, create_runner
from linnet.backends.registry import get_backend
from linnet.backends.runner import NO_TOKENS, OK, Control, log_softmax, top_logprobs
from linnet.errors import LinnetError
from linnet.model import open_model
from linnet.sampling import Sampling

CASE = "qwen3-gqa3"
BACKENDS = ["reference:numpy", "onnx:cpu", "torch:eager", "xla:jax"]
PROMPTS = {0: [5, 17, 44, 90, 3], 1: [7, 7, 120, 9], 2: [300, 11, 64, 250, 8, 19]}


@pytest.fixture(scope="module")
def weights(checkpoint_dir):
    return open_model(str(checkpoint_dir(CASE))).weights


def make_runner(weights, backend: str):
    reason = get_backend(backend).unavailable()
    if reason:
        pytest.skip(f"{backend}: {reason}")
    return create_runner(backend, weights, CacheShape(3, 32))


def plain_step(runner, decode_tokens=None, **kwargs):
    """Prefill every prompt afresh, then (with ``decode_tokens``) one decode step."""
    for row in PROMPTS:
        runner.reset(row)
    first = runner.step(prefill=[Prefill(row, ids) for row, ids in PROMPTS.items()], logits=True, **kwargs)
    if decode_tokens is None:
        return first
    return runner.step(decode=[Decode(row, t) for row, t in decode_tokens.items()], logits=True, **kwargs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_adjusted_rows_draw_the_adjusted_argmax_and_report_raw_logprobs(weights, backend):
    runner = make_runner(weights, backend)
    plain = plain_step(runner)
    raw = {row: plain[row].logits for row in PROMPTS}
    forced = 123  # row 1: logit_bias +100 on one id forces it
    banned = int(np.argmax(raw[2]))  # row 2: its argmax masked out leaves the runner-up

    def bias(logits: np.ndarray) -> None:
        logits[forced] += 100.0

    def ban(logits: np.ndarray) -> None:
        logits[banned] = -np.inf

    controls = {1: Control(bias, logprobs=3), 2: Control(ban), 0: Control(logprobs=5)}
    got = plain_step(runner, controls=controls)
    assert got[0].token == plain[0].token  # logprobs alone: still drawn where the model runs
    assert got[1].token == forced
    assert got[2].token == int(np.argsort(-raw[2].astype(np.float64), kind="stable")[1])
    assert got[2].logprob is None and got[2].top_logprobs == []
    for row, count in [(0, 5), (1, 3)]:
        want = log_softmax(raw[row])
        assert got[row].logprob == pytest.approx(want[got[row].token], abs=1e-5)  # the model's, not the adjusted
        tops = got[row].top_logprobs
        assert [t for t, _ in tops] == [int(t) for t in np.argsort(-want, kind="stable")[:count]]
        assert [lp for _, lp in tops] == sorted((lp for _, lp in tops), reverse=True)
        np.testing.assert_allclose([lp for _, lp in tops], want[[t for t, _ in tops]], atol=1e-5)
        np.testing.assert_array_equal(got[row].logits, raw[row])  # logits=True gives the unadjusted ones

    # the next step: the rows decode on, the control's row again from its adjusted logits
    decoded = plain_step(runner, {row: got[row].token for row in PROMPTS}, controls={1: Control(bias)})
    assert decoded[1].token == forced and all(r.status == OK for r in decoded.values())


@pytest.mark.parametrize("backend", ["reference:numpy", "onnx:cpu"])
def test_seeded_host_draws_repeat_and_a_fully_masked_row_fails_alone(weights, backend):
    runner = make_runner(weights, backend)
    sampling = {row: Sampling(temperature=1.5, seed=7) for row in PROMPTS}

    def flatten(logits: np.ndarray) -> None:  # near-uniform: a seeded draw shows its stream
        logits *= 0.01

    def nothing_left(logits: np.ndarray) -> None:
        logits[:] = -np.inf

    controls = {0: Control(flatten), 1: Control(flatten), 2: Control(nothing_left)}
    draws = []
    for _ in range(2):
        out = plain_step(runner, sampling=sampling, controls=controls)
        tokens = [out[0].token]
        for _ in range(4):
            out = runner.step(decode=[Decode(0, tokens[-1])], sampling=sampling, controls=controls)
            tokens.append(out[0].token)
        draws.append(tokens)
    assert draws[0] == draws[1] and len(set(draws[0])) > 1  # reproducible, and drawn, not argmax
    first = plain_step(runner, sampling=sampling, controls=controls)
    assert first[0].status == first[1].status == OK and first[0].token == draws[0][0]
    assert first[2].status == NO_TOKENS and first[2].token is None and "masked" in first[2].message


def test_top_logprobs_helper_and_control_bounds():
    logprobs = np.log(np.array([0.1, 0.4, 0.1, 0.4]))
    assert [t for t, _ in top_logprobs(logprobs, 3)] == [1, 3, 0]  # ties: the lower id first
    assert top_logprobs(logprobs, 0) == [] and len(top_logprobs(logprobs, 10)) == 4
    with pytest.raises(LinnetError, match="logprobs must be in 0..20"):
        Control(logprobs=21)


@pytest.mark.parametrize("backend", ["reference:numpy", "onnx:cpu"])
def test_a_scored_prompt_reports_each_tokens_logprob_across_chunks(weights, backend):
    runner = make_runner(weights, backend)
    ids = PROMPTS[2]
    runner.reset(0)
    every = runner.prefill(0, ids, all_logits=True)  # [T, vocab]: the logits after each position
    want = [(t, log_softmax(every[i])[t]) for i, t in enumerate(ids[1:])]
    runner.reset(0)
    first = runner.step(prefill=[Prefill(0, ids[:4], 0, sample=False, prompt_logprobs=2)])[0]
    rest = runner.step(prefill=[Prefill(0, ids[4:], 4, prompt_logprobs=2), Prefill(1, PROMPTS[1])])
    got = first.prompt_logprobs + rest[0].prompt_logprobs
    assert [t for t, _, _ in got] == [t for t, _ in want]  # the second chunk's first from the first's last logits
    np.testing.assert_allclose([lp for _, lp, _ in got], [lp for _, lp in want], atol=1e-5)
    assert all(len(top) == 2 and top[0][1] >= top[1][1] for _, _, top in got)
    assert rest[0].token == int(np.argmax(every[-1])) and rest[1].prompt_logprobs == []
