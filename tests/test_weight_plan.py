"""Weight plans: fusions, folds and the cast give what torch computes, once per source and plan."""
from __future__ import annotations

import numpy as np
import pytest

from linnet.dtypes import DTYPES
from linnet.errors import LinnetError
from linnet.model import open_model
from linnet.weight_cache import cache_root
from linnet.weight_plan import WeightPlan, plan_weights
from linnet.weights import Weights

QKV = (("qkv", ("q", "k", "v")), ("gate_up", ("gate", "up")))
FOLDS = (("layer", "qkv", "attn_norm"), ("layer", "gate_up", "mlp_norm"), ("head", "lm_head", "norm"))


def in_memory(weights: Weights) -> Weights:
    return Weights(weights.spec, dict(weights))


def torch_reference(weights: Weights, dtype: str) -> dict[str, np.ndarray]:
    """torch's result for QKV and FOLDS: concatenated, multiplied in float32, rounded once to dtype."""
    torch = pytest.importorskip("torch")
    target = getattr(torch, DTYPES[dtype].hf)
    t = {name: torch.from_numpy(a.astype(np.float32)).to(getattr(torch, DTYPES[weights.spec.dtype].hf))
         for name, a in weights.items()}
    for i in range(weights.spec.num_layers):
        p = f"layers.{i}."
        t[p + "qkv"] = torch.cat([t.pop(p + n) for n in ("q", "k", "v")]).float() * t.pop(p + "attn_norm").float()
        t[p + "gate_up"] = torch.cat([t.pop(p + n) for n in ("gate", "up")]).float() * t.pop(p + "mlp_norm").float()
    t["lm_head"] = t["lm_head"].float() * t.pop("norm").float()
    return {name: tensor.to(target).float().numpy() for name, tensor in t.items()}


@pytest.mark.parametrize("checkpoint_dtype, dtype", [("float32", "f32"), ("float32", "bf16"), ("float32", "f16"),
                                                     ("bfloat16", "bf16"), ("bfloat16", "f32")])
def test_fused_folded_and_cast_as_torch_does(checkpoint_dtype, dtype, checkpoint_dir):
    weights = in_memory(open_model(str(checkpoint_dir("qwen3-gqa3", checkpoint_dtype))).weights)
    planned = plan_weights(weights, WeightPlan(dtype, QKV, FOLDS))
    expected = torch_reference(weights, dtype)
    assert set(planned) == set(expected)
    assert "layers.0.q" not in planned and "norm" not in planned and "layers.1.q_norm" in planned
    for name, array in planned.items():
        assert array.dtype == DTYPES[dtype].numpy, name
        assert array.flags.c_contiguous, name
        np.testing.assert_array_equal(array.astype(np.float32), expected[name], err_msg=name)


def test_a_plan_of_nothing_is_the_checkpoint(checkpoint_dir):
    weights = open_model(str(checkpoint_dir("qwen2-tied"))).weights
    planned = plan_weights(weights, WeightPlan("f32"))
    assert set(planned) == set(weights)
    assert all(np.array_equal(planned[name], weights[name]) for name in weights)


def test_converted_once_per_source_and_plan(checkpoint_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("LINNET_CACHE", str(tmp_path))  # a cache of its own: other tests convert these weights too
    weights = open_model(str(checkpoint_dir("llama-gqa3"))).weights
    files = lambda: set(cache_root().glob("*.safetensors"))  # noqa: E731
    before = files()
    first = plan_weights(weights, WeightPlan("bf16", QKV))
    after_first = files()
    again = plan_weights(weights, WeightPlan("bf16", QKV))
    assert files() == after_first and len(after_first - before) == 1
    assert not again["layers.0.qkv"].flags.writeable  # mapped from the cache
    assert all(np.array_equal(first[name], again[name]) for name in first)

    plan_weights(weights, WeightPlan("f16", QKV))  # another dtype: another file
    plan_weights(weights, WeightPlan("bf16", QKV[:1]))  # another fusion: another file
    assert len(files() - after_first) == 2

    plan_weights(in_memory(weights), WeightPlan("f32", QKV, FOLDS))  # no source: converted, not kept
    assert len(files() - after_first) == 2


def test_bad_plans_are_refused():
    with pytest.raises(LinnetError, match="unknown dtype 'f64'"):
        WeightPlan("f64")
    with pytest.raises(LinnetError, match="unknown weight-plan section 'body'"):
        WeightPlan("f32", folded=(("body", "q", "attn_norm"),))
