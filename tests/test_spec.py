"""ModelSpec from config.json: both transformers spellings, every shape, and clear rejections."""
from __future__ import annotations

import json
import math

import pytest

from linnet.errors import UnsupportedModel
from linnet.spec import RopeSpec, f32_decimal, load_spec, spec_from_hf_config

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
        ({"rope_scaling": {"rope_type": "proportional"}}, "rope type 'proportional' is not supported"),
        ({"use_sliding_window": True}, "use_sliding_window=True is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"num_key_value_heads": 3}, "not a multiple"),
        ({"torch_dtype": "float64"}, "dtype 'float64'"),
        ({"hidden_size": None}, "lacks required key 'hidden_size'"),
        # refused before a family's reader builds a list per layer (found by the config fuzzer)
        ({"num_hidden_layers": 2**40}, "num_hidden_layers: 1099511627776 layers is past Linnet's bound"),
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


# -- YaRN, LongRoPE, dynamic NTK ---------------------------------------------------------------------------------

LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
         "num_attention_heads": 4, "vocab_size": 100, "max_position_embeddings": 16384, "rms_norm_eps": 1e-5}
PHI3 = {**LLAMA, "architectures": ["Phi3ForCausalLM"], "partial_rotary_factor": 0.5}  # 8 rotary dims: 4 factors
LONGROPE = {"short_factor": [1.0, 1.1, 1.5, 2.0], "long_factor": [1.0, 4.0, 9.5, 16.0]}


def test_yarn_both_spellings():
    scaling = {"factor": 4.0, "original_max_position_embeddings": 4096}
    tf4 = spec_from_hf_config({**LLAMA, "rope_theta": 1e6, "rope_scaling": {"type": "yarn", **scaling}})
    tf5 = spec_from_hf_config({**LLAMA, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, **scaling}})
    assert tf4 == tf5
    assert tf4.rope == RopeSpec(1e6, "yarn", 4.0, original_max_positions=4096,
                                attention_factor=f32_decimal(0.1 * math.log(4) + 1))  # beta 32 and 1, truncated
    assert json.loads(json.dumps(tf4.to_dict()))["rope"]["kind"] == "yarn"


def test_yarn_optional_fields():
    rope = spec_from_hf_config({**LLAMA, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 1e4, "factor": 32.0, "original_max_position_embeddings": 4096,
        "beta_fast": 16, "beta_slow": 2, "truncate": False, "mscale": 1.0, "mscale_all_dim": 0.5}}).rope
    assert (rope.beta_fast, rope.beta_slow, rope.truncate) == (16.0, 2.0, False)
    assert rope.attention_factor == f32_decimal((0.1 * math.log(32) + 1) / (0.05 * math.log(32) + 1))
    # no factor: the growth of the context; 0 betas are the defaults (transformers' ``or``)
    rope = spec_from_hf_config({**LLAMA, "rope_theta": 1e4, "rope_scaling": {
        "rope_type": "yarn", "original_max_position_embeddings": 4096, "beta_fast": 0, "beta_slow": None}}).rope
    assert (rope.factor, rope.beta_fast, rope.beta_slow) == (4.0, 32.0, 1.0)


def test_longrope_as_phi3_writes_it():
    """Phi-3's config.json: type "longrope" (or "su"), original_max_position_embeddings at the top level,
    which wins over the section's; Phi3Config's 4096 where neither has it."""
    config = {**PHI3, "rope_theta": 1e4, "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
              "rope_scaling": {"type": "su", **LONGROPE, "original_max_position_embeddings": 8192}}
    rope = spec_from_hf_config(config).rope
    assert rope.kind == "longrope" and rope.original_max_positions == 4096
    assert rope.short_factors == (1.0, 1.1, 1.5, 2.0) and rope.long_factors == (1.0, 4.0, 9.5, 16.0)
    assert rope.attention_factor == f32_decimal(math.sqrt(1 + math.log(32) / math.log(4096)))
    del config["original_max_position_embeddings"]
    assert spec_from_hf_config(config).rope.original_max_positions == 4096  # Phi3Config's default
    llama = {**LLAMA, "rope_theta": 1e4, "head_dim": 8,
             "rope_scaling": {"rope_type": "longrope", **LONGROPE, "original_max_position_embeddings": 8192}}
    assert spec_from_hf_config(llama).rope.original_max_positions == 8192
    given = {**llama, "rope_scaling": {**llama["rope_scaling"], "attention_factor": 1.25, "factor": 3.0}}
    assert spec_from_hf_config(given).rope.attention_factor == 1.25
    assert spec_from_hf_config({**PHI3, "rope_theta": 1e4, "rope_scaling": {"type": "yarn", **LONGROPE}}).rope.kind \
        == "longrope"  # Phi3Config reads yarn as LongRoPE too


def test_dynamic_starts_at_max_position_embeddings():
    rope = spec_from_hf_config({**LLAMA, "rope_theta": 1e4, "rope_scaling": {"type": "dynamic", "factor": 2.0}}).rope
    assert rope == RopeSpec(1e4, "dynamic", 2.0, original_max_positions=16384)


@pytest.mark.parametrize(("config", "message"), [
    ({**LLAMA, "rope_theta": 1e4, "rope_scaling": {"rope_type": "yarn", "factor": -4.0}},
     "config.json: rope_scaling: factor: expected a finite, positive number, got -4.0"),
    ({**LLAMA, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "beta_fast": "x"}},
     "config.json: rope_parameters: beta_fast: expected a finite, positive number, got 'x'"),
    ({**LLAMA, "rope_theta": 1e4, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "truncate": "no"}},
     "rope_scaling: truncate: expected true or false, got 'no'"),
    ({**LLAMA, "rope_theta": 1e4, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "attention_factor": 0}},
     "rope_scaling: attention_factor: expected a finite, positive number, got 0"),
    ({**LLAMA, "rope_theta": 1e4, "rope_scaling": {"type": "yarn", "factor": 2.0, "mscale": 1, "mscale_all_dim": -1}},
     "rope_scaling: mscale_all_dim: expected a finite, positive number, got -1"),
    ({**LLAMA, "rope_theta": 1e4, "original_max_position_embeddings": 0, "rope_scaling": {"type": "yarn", "factor": 2}},
     "config.json: original_max_position_embeddings: expected a positive integer, got 0"),
    ({**LLAMA, "rope_theta": 1e4, "rope_scaling": {"type": "yarn", "original_max_position_embeddings": 1.5}},
     "rope_scaling: original_max_position_embeddings: expected a positive integer, got 1.5"),
    ({**PHI3, "rope_theta": 1e4, "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 4}},
     "config.json: rope_scaling lacks required key 'long_factor'"),
    ({**PHI3, "rope_theta": 1e4, "rope_scaling": {"type": "longrope", **LONGROPE, "long_factor": [1, 2, "3", 4]}},
     r"rope_scaling: long_factor\[2\]: expected a finite, positive number, got '3'"),
    ({**PHI3, "rope_theta": 1e4, "rope_scaling": {"type": "longrope", **LONGROPE, "short_factor": 2.0}},
     "rope_scaling: short_factor: expected a list, got 2.0"),
    ({**PHI3, "rope_theta": 1e4, "rope_scaling": {"type": "longrope", **LONGROPE, "short_factor": [1.0] * 8}},
     "longrope short_factor has 8 entries; the 8 rotary dims need 4"),
    ({**LLAMA, "rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}},
     "config.json: rope_parameters lacks required key 'factor'"),
    ({**LLAMA, "rope_theta": 1e4, "rope_scaling": {"rope_type": 3}}, "rope_scaling: rope_type: expected a string"),
], ids=["factor", "beta", "truncate", "attention", "mscale", "top-original", "original", "long-missing",
        "long-entry", "short-not-list", "short-length", "dynamic-factor", "type"])
def test_rope_scaling_errors_name_the_field(config, message):
    with pytest.raises(UnsupportedModel, match=message):
        spec_from_hf_config(config)
