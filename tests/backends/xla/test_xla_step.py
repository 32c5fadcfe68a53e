"""The batched-step checks that test_step.py runs on the quick backends, run on both XLA backends:
sampling drawn on the device, full rows, split prompts, and only token ids leaving the device."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
import test_step  # noqa: E402

XLA = ["xla:jax", "xla:stablehlo"]
CHECKS = [
    test_step.test_a_prompt_split_over_steps_matches_one_prefill,
    test_step.test_a_full_row_reports_it_and_its_neighbours_go_on,
    test_step.test_seeded_sampling_is_the_same_through_step_and_generate,
    test_step.test_top_k_and_top_p_restrict_the_draw,
    test_step.test_a_decode_step_brings_back_token_ids_not_logits,
]


@pytest.mark.parametrize("check", CHECKS, ids=[c.__name__.removeprefix("test_") for c in CHECKS])
@pytest.mark.parametrize("backend", XLA)
def test_batched_step(checkpoint_dir, backend, check):
    check(checkpoint_dir, backend)


@pytest.mark.parametrize("backend", XLA)
def test_a_request_never_recompiles(checkpoint_dir, backend):
    """After a first request (a prefill, a sampled and a greedy decode), requests of other lengths in other
    rows compile nothing: not the step, not the draw, not one small op."""
    import jax.monitoring

    from linnet.backends import Decode, Prefill
    from linnet.generation import Sampling

    runner = test_step.make_runner(checkpoint_dir, backend)
    first = runner.step(prefill=[Prefill(0, test_step.prompt(5, 1))], sampling={0: Sampling(1.0, seed=1)})
    out = runner.step(decode=[Decode(0, first[0].token)], sampling={0: Sampling(1.0, seed=1)})
    runner.step(decode=[Decode(0, out[0].token)])
    compiles, modules = [], len(getattr(runner, "executables", ()))

    def listener(event, duration, **_):
        if event.endswith("backend_compile_duration"):
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        for row, length in ((1, 12), (2, 30), (0, 3)):
            out = runner.step(prefill=[Prefill(row, test_step.prompt(length, row))], sampling={row: Sampling(0.8)})
            for _ in range(3):
                out = runner.step(decode=[Decode(row, out[row].token)])
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == []
    assert len(getattr(runner, "executables", ())) == modules
