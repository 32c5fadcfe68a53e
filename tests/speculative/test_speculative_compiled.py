"""Compiled backends compile speculation's checks in the warm-up (``warm_up(verify=...)``), not in a
request: every shape a check of up to K + 1 tokens in up to R rows takes, and nothing new afterwards;
their greedy tokens stay the target's."""
from __future__ import annotations

import pytest
from test_speculative_greedy import PROMPT  # a prompt that repeats itself

from linnet.backends import CacheShape, create_runner
from linnet.generation import generate
from linnet.model import open_model
from linnet.speculative import PromptLookup, Speculator

DRAFTS = 6


def compiled_shapes(runner) -> float:
    """What the backend has compiled so far: XLA's executables, or inductor's compile seconds."""
    if runner.name == "xla:jax":
        return runner._step._cache_size()
    if runner.name == "xla:stablehlo":
        return len(runner.executables)
    return runner.compile_time


@pytest.mark.parametrize("backend", [
    "xla:jax", "xla:stablehlo",
    pytest.param("torch:inductor", marks=pytest.mark.slow),  # each shape is an AOTInductor package build
])
def test_checks_compile_in_the_warm_up(backend, checkpoint_dir):
    model = open_model(str(checkpoint_dir("qwen3-gqa3")))
    runner = create_runner(backend, model.weights, CacheShape(rows=2, positions=64))
    runner.warm_up(verify=(2, DRAFTS + 1))
    warmed = compiled_shapes(runner)
    plain = generate(runner, PROMPT, 30, eos_ids=[]).token_ids
    speculator = Speculator(runner, PromptLookup(n=3), DRAFTS)
    out = generate(runner, PROMPT, 30, eos_ids=[], speculator=speculator)
    assert out.token_ids == plain and speculator.accepted > 0
    for width in range(2, DRAFTS + 2):  # two rows checked in one call, chunks of every width
        runner.reset(0)
        runner.reset(1)
        runner.prefill(0, PROMPT[:5])
        runner.prefill(1, PROMPT[:9])
        runner.verify({0: PROMPT[5:5 + width], 1: PROMPT[9:9 + max(2, width - 1)]})
    assert compiled_shapes(runner) == warmed


def test_xla_pads_a_check_to_a_power_of_two_not_a_prompt_chunk(checkpoint_dir):
    model = open_model(str(checkpoint_dir("qwen3-gqa3")))
    runner = create_runner("xla:jax", model.weights, CacheShape(rows=1, positions=64))
    assert runner.all_logits_lengths(DRAFTS + 1) == (2, 4, 8)
    assert runner.verify_shapes(3, DRAFTS + 1) == [(1, 2), (1, 4), (1, 8)]  # one row: the cache has one
    assert runner.all_logits_lengths(40) == (2, 4, 8, 16, 32, runner.padded_length)
