"""The rotary tables match transformers' rotary embeddings: plain, partial, and with Llama 3 scaling."""
from __future__ import annotations

import importlib

import numpy as np
import pytest
from checkpoints import CASE_IDS, CASES_BY_ID, hf_config

from linnet.rope import inv_frequencies, rope_tables
from linnet.spec import RopeSpec, spec_from_hf_config

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")


def transformers_rotary(case_id: str):
    case = CASES_BY_ID[case_id]
    name = case.architecture.removesuffix("ForCausalLM")
    config = getattr(transformers, f"{name}Config")(**hf_config(case))
    module = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
    return config, getattr(module, f"{name}RotaryEmbedding")(config)


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_tables_match_transformers(case_id):
    config, rotary = transformers_rotary(case_id)
    spec = spec_from_hf_config(config.to_dict())
    positions = spec.max_positions
    cos, sin = rope_tables(spec, positions)
    assert cos.dtype == sin.dtype == np.float32 and cos.shape == sin.shape == (positions, spec.rotary_dim)
    with torch.no_grad():
        their_cos, their_sin = rotary(torch.zeros(1), torch.arange(positions)[None])
    np.testing.assert_allclose(cos, their_cos[0].numpy(), atol=1e-6, rtol=0)
    np.testing.assert_allclose(sin, their_sin[0].numpy(), atol=1e-6, rtol=0)
    assert (spec.rope.kind == "llama3") == (case_id == "llama-mqa-tied-rope3")


def test_llama3_scaling_of_llama_3_1():
    """Long wavelengths slowed 8x, short ones kept, the band blended: the frequencies transformers computes."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                  original_max_position_embeddings=8192)
    config = transformers.LlamaConfig(hidden_size=4096, num_attention_heads=32, head_dim=128,
                                      max_position_embeddings=131072, rope_parameters=params)
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    rope = RopeSpec(500000.0, "llama3", 8.0, 1.0, 4.0, 8192)
    ours = inv_frequencies(rope, 128)
    np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-6)
    plain = inv_frequencies(RopeSpec(500000.0), 128)
    assert ours[0] == plain[0] and ours[-1] == np.float32(plain[-1] / 8)
