"""torch:inductor compiles its few shapes once (in warm_up): no recompiles per decode step, prompt length,
number of rows decoding, or request."""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from linnet.backends import CacheShape, create_runner
from linnet.errors import BackendUnavailable
from linnet.model import open_model


def test_no_recompiles_after_the_first_calls(checkpoint_dir):
    runner = create_runner("torch:inductor", open_model(str(checkpoint_dir("qwen2-tied"))).weights,
                           CacheShape(rows=2, positions=64))
    runner.warm_up()  # a prompt chunk and every decode size: the shapes a request meets
    compiled = sum(counters["stats"].values()), dict(counters["frames"])
    runner.prefill(0, list(range(3, 10)))
    runner.decode([5, 0], active=[True, False])
    for length in (12, 30, 4):  # new prompt lengths and rows: the dynamic prefill graph serves them all
        runner.prefill(length % 2, list(range(3, 3 + length)))
        for _ in range(3):
            runner.decode([7, 8])
    assert (sum(counters["stats"].values()), dict(counters["frames"])) == compiled


def test_each_runner_compiles_apart(checkpoint_dir):
    # dynamo limits recompiles per code object: with one shared, a second model's shapes would exceed a limit
    # of 1 (and in general, a process could hold only 8 compiled models).
    with torch._dynamo.config.patch(recompile_limit=1):
        for case in ("qwen2-tied", "llama-gqa3"):
            weights = open_model(str(checkpoint_dir(case))).weights
            runner = create_runner("torch:inductor", weights, CacheShape(rows=1, positions=32))
            runner.prefill(0, list(range(3, 10)))
            runner.decode([5])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_cudagraphs_without_cuda_is_reported_unavailable(checkpoint_dir):
    weights = open_model(str(checkpoint_dir("qwen2-tied"))).weights
    with pytest.raises(BackendUnavailable, match="torch:cudagraphs cannot run here: CUDA graphs need a CUDA GPU"):
        create_runner("torch:cudagraphs", weights, CacheShape(1, 32))
