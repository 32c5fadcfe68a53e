"""The NumPy interpreter defines each op; the passes must keep the step's meaning under it."""
from __future__ import annotations

import numpy as np
import pytest
from checkpoints import CASE_IDS

from linnet.backends.reference.interpreter import run_step
from linnet.model import open_model
from linnet.program import build_program, fold_norm_weights, fuse_norm_linears, fuse_projections
from linnet.rope import rope_tables
from linnet.weight_plan import WeightPlan, plan_weights

POSITIONS = 16


def step(program, weights, tokens, positions):
    spec = program.spec
    shape = (1, spec.num_kv_heads, POSITIONS, spec.head_dim)
    caches = ([np.zeros(shape, np.float32)] * spec.num_layers, [np.zeros(shape, np.float32)] * spec.num_layers)
    cos, sin = rope_tables(spec, POSITIONS)
    inputs = {"tokens": tokens, "positions": positions, "rows": np.array([0]),
              "select": np.arange(tokens.shape[1])[None], "rope_cos": cos, "rope_sin": sin}
    return run_step(program, weights, inputs, caches)


@pytest.mark.parametrize("case", CASE_IDS)
def test_fused_and_folded_program_computes_the_plain_one(checkpoint_dir, case):
    weights = open_model(str(checkpoint_dir(case))).weights
    plain = build_program(weights.spec)
    passed = fold_norm_weights(fuse_norm_linears(fuse_projections(plain)))
    tokens = np.random.default_rng(0).integers(3, weights.spec.vocab_size, (1, 9))
    positions = np.arange(9)[None]
    want, want_k, _ = step(plain, plan_weights(weights, WeightPlan("f32")), tokens, positions)
    got, got_k, _ = step(passed, plan_weights(weights, WeightPlan("f32", passed.fused, passed.folded)),
                         tokens, positions)
    assert np.abs(got - want).max() <= 1e-5
    assert np.abs(got_k[-1] - want_k[-1]).max() <= 1e-5


def test_the_step_is_pure(checkpoint_dir):
    weights = open_model(str(checkpoint_dir("qwen2-tied"))).weights
    program = build_program(weights.spec)
    spec = program.spec
    caches = ([np.zeros((1, spec.num_kv_heads, POSITIONS, spec.head_dim), np.float32)] * spec.num_layers,) * 2
    cos, sin = rope_tables(spec, POSITIONS)
    inputs = {"tokens": np.array([[5, 6]]), "positions": np.array([[0, 1]]), "rows": np.array([0]),
              "select": np.array([[1]]), "rope_cos": cos, "rope_sin": sin}
    _, new_k, _ = run_step(program, plan_weights(weights, WeightPlan("f32")), inputs, caches)
    assert not caches[0][0].any() and new_k[0][0, :, :2].any() and not new_k[0][0, :, 2:].any()
