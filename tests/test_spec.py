"""ModelSpec from config.json: both transformers spellings, every shape, and clear rejections."""
from __future__ import annotations

import json

import pytest

from linnet.errors import UnsupportedModel
from linnet.spec import load_spec, spec_from_hf_config

QWEN2_TF4 = {  # transformers 4 spelling, as Qwen2.5-0.5B-Instruct ships it
    "architectures": ["Qwen2ForCausalLM"], "hidden_size": 896, "intermediate_size": 4864,
    "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": None,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_sliding_window": False,
    "hidden_act": "silu", "bos_token_id": 151643, "eos_token_id": 151645,
}


def test_transformers4_qwen2():
    spec = spec_from_hf_config(QWEN2_TF4)
    assert (spec.head_dim, spec.num_kv_heads, spec.dtype) == (64, 2, "bf16")
    assert spec.qkv_bias and not spec.o_bias and not spec.qk_norm and spec.tie_word_embeddings
    assert spec.rope.theta == 1e6 and spec.rope.kind == "default"
    assert spec.eos_token_ids == (151645,)
    assert 494_000_000 < spec.parameter_count() < 495_000_000  # the seed page's 494.5M


def test_transformers5_spelling_gives_the_same_spec():
    tf5 = {k: v for k, v in QWEN2_TF4.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")}
    tf5.update(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, dtype="bfloat16")
    assert spec_from_hf_config(tf5) == spec_from_hf_config(QWEN2_TF4)


def test_qwen3_head_dim_and_qk_norm():
    config = {
        "architectures": ["Qwen3ForCausalLM"], "hidden_size": 2560, "intermediate_size": 9728,
        "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
        "tie_word_embeddings": True, "attention_bias": False, "torch_dtype": "bfloat16",
    }
    spec = spec_from_hf_config(config)
    assert spec.head_dim == 128 != spec.hidden_size // spec.num_heads
    assert spec.qk_norm and not spec.qkv_bias
    assert 4_000_000_000 < spec.parameter_count() < 4_050_000_000  # Qwen3-4B: 4.02B


def test_llama3_rope_scaling_both_spellings():
    base = {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 100, "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5,
    }
    scaling = {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    tf4 = spec_from_hf_config({**base, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **scaling}})
    tf5 = spec_from_hf_config({**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **scaling}})
    assert tf4 == tf5
    assert tf4.rope.kind == "llama3" and tf4.rope.factor == 32.0 and tf4.rope.original_max_positions == 8192


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["GemmaForCausalLM"]}, "architecture 'GemmaForCausalLM' is not supported"),
        ({"architectures": []}, "exactly one architecture"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn' is not supported"),
        ({"use_sliding_window": True}, "use_sliding_window=True is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"num_key_value_heads": 3}, "not a multiple"),
        ({"torch_dtype": "float64"}, "dtype 'float64'"),
        ({"hidden_size": None}, "lacks required key 'hidden_size'"),
    ],
)
def test_unsupported_configs_are_rejected_by_name(change, message):
    with pytest.raises(UnsupportedModel, match=message):
        spec_from_hf_config({**QWEN2_TF4, **change})


def test_missing_and_broken_config(tmp_path):
    with pytest.raises(UnsupportedModel, match="no config.json"):
        load_spec(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UnsupportedModel, match="not valid JSON"):
        load_spec(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(QWEN2_TF4))
    assert load_spec(tmp_path).hidden_size == 896
