"""The matrix-product rate and each serving row's share of it (linnet.bench.arithmetic)."""
from __future__ import annotations

import math

import pytest
import torch
import transformers

from linnet.bench import arithmetic
from linnet.bench.harness import importable_here, worker_environment
from linnet.model import open_spec
from linnet.results import Machine, Metric, Row


@pytest.mark.parametrize("case", ["llama-gqa3", "qwen2-tied"])
def test_flops_per_token_are_two_per_weight_of_every_matrix_transformers_multiplies_by(checkpoint_dir, case):
    path = checkpoint_dir(case)
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert arithmetic.flops_per_token(open_spec(str(path))) == 2 * weights


def test_the_rate_is_measured_in_a_process_of_its_own_in_each_dtype():
    env = importable_here(worker_environment(1, "passive"))
    for dtype in ("f32", "bf16"):
        samples = arithmetic.measure_apart(env, dtype, size=256, passes=2)
        assert len(samples) == 2 and all(math.isfinite(s) and s > 0 for s in samples)


def test_a_serving_row_gets_its_share_of_the_rate_and_a_row_not_run_gets_none(checkpoint_dir):
    spec = open_spec(str(checkpoint_dir("llama-gqa3")))
    ran = Row("serve:torch:eager", "Serving", "linnet serve", metrics={"serve_tok_s": Metric(100.0)})
    skipped = Row("vllm:serve", "Serving", "vLLM", not_run="no vLLM")
    gflop = arithmetic.flops_per_token(spec) / 1e9
    arithmetic.add_notes([ran, skipped], spec, gflop_s=400 * gflop, dtype="f32")  # 100 tok/s is a quarter
    assert arithmetic.share(ran) == "25%"
    assert ran.notes[0].endswith("of the f32 matrix-product rate measured in this run")
    assert skipped.notes == [] and arithmetic.share(skipped) == "–"
    assert arithmetic.measured(Machine(None, matmul_gflop_s=Metric(123.4))) == " · matrix products 123 GFLOP/s"
