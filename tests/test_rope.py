"""The rotary tables match transformers' rotary embeddings: plain, partial, with Llama 3 scaling, YaRN,
LongRoPE and dynamic NTK (the last two as transformers decodes token by token; linnet.rope says why); and
tiny models with the last three decode past their original context as transformers does."""
from __future__ import annotations

import importlib
import inspect
from dataclasses import replace

import numpy as np
import pytest
from checkpoints import CASE_IDS, CASES_BY_ID, Case, build_checkpoint, config_class, hf_config

from linnet.rope import inv_frequencies, rope_tables
from linnet.spec import RopeSpec, spec_from_hf_config

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")


def transformers_rotary(case_id: str):
    case = CASES_BY_ID[case_id]
    name = case.architecture.removesuffix("ForCausalLM")
    config = getattr(transformers, config_class(case))(**hf_config(case))
    module = importlib.import_module(type(config).__module__.replace(".configuration_", ".modeling_"))
    return config, getattr(module, f"{name}RotaryEmbedding")(config)


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_tables_match_transformers(case_id):
    config, rotary = transformers_rotary(case_id)
    spec = spec_from_hf_config(config.to_dict())
    positions = spec.max_positions
    cos, sin = rope_tables(spec, positions)
    # one table, or Gemma 3's two side by side: the global layers', then the sliding layers'
    tables = [()] if spec.local_rope is None else [("full_attention",), ("sliding_attention",)]
    width = spec.rotary_dim
    assert cos.dtype == sin.dtype == np.float32 and cos.shape == sin.shape == (positions, width * len(tables))
    for j, layer_type in enumerate(tables):
        with torch.no_grad():
            their_cos, their_sin = rotary(torch.zeros(1), torch.arange(positions)[None], *layer_type)
        np.testing.assert_allclose(cos[:, j * width:(j + 1) * width], their_cos[0].numpy(), atol=1e-6, rtol=0)
        np.testing.assert_allclose(sin[:, j * width:(j + 1) * width], their_sin[0].numpy(), atol=1e-6, rtol=0)
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


# -- YaRN, LongRoPE and dynamic NTK ---------------------------------------------------------------------------

LLAMA = dict(hidden_size=1024, num_attention_heads=8, head_dim=128, num_hidden_layers=1, vocab_size=10,
             intermediate_size=8, bos_token_id=1, eos_token_id=2, pad_token_id=0)
PHI3 = {**{k: v for k, v in LLAMA.items() if k != "head_dim"}, "hidden_size": 384, "num_attention_heads": 6,
        "partial_rotary_factor": 0.75}  # head_dim 64, 48 of it rotary


def rotary_of(name: str, **config):
    """transformers' config and rotary embedding of an architecture, and Linnet's spec of that config."""
    config = getattr(transformers, f"{name}Config")(**config)
    module = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
    spec = spec_from_hf_config({**config.to_dict(), "architectures": [f"{name}ForCausalLM"]})
    return spec, getattr(module, f"{name}RotaryEmbedding")(config)


def decoded_tables(rotary, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin as transformers computes them decoding one token at a time (its rope updates run per call)."""
    with torch.no_grad():
        rows = [rotary(torch.zeros(1), torch.tensor([[p]])) for p in range(positions)]
    return tuple(torch.cat([row[i][0] for row in rows]).numpy() for i in (0, 1))


@pytest.mark.parametrize("params", [
    # Qwen-style: 4x past a 4096-token pretraining context; the default attention factor 0.1 ln 4 + 1
    dict(rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=4096),
    # untruncated ramp between other betas; attention factor from mscale / mscale_all_dim
    dict(rope_type="yarn", rope_theta=10000.0, factor=32.0, original_max_position_embeddings=512, beta_fast=16,
         beta_slow=2, truncate=False, mscale=1.0, mscale_all_dim=0.7),
    # no factor: max_position_embeddings / original; an attention factor given
    dict(rope_type="yarn", rope_theta=500000.0, factor=None, original_max_position_embeddings=2048,
         attention_factor=1.3),
], ids=["qwen", "untruncated-mscale", "implicit-factor"])
def test_yarn_tables_match_transformers(params):
    spec, rotary = rotary_of("Llama", **LLAMA, max_position_embeddings=16384, rope_parameters=params)
    assert spec.rope.kind == "yarn" and spec.rope.attention_factor != 1.0
    positions = 8192  # both sides of the original context (yarn's frequencies are the same for every position)
    cos, sin = rope_tables(spec, positions)
    with torch.no_grad():
        their_cos, their_sin = rotary(torch.zeros(1), torch.arange(positions)[None])
    np.testing.assert_allclose(cos, their_cos[0].numpy(), atol=1e-6, rtol=0)
    np.testing.assert_allclose(sin, their_sin[0].numpy(), atol=1e-6, rtol=0)


# float32 angles (position x frequency, up to 300 x 10) that torch's vectorised products round by CPU: on an AVX-512
# EPYC, 4 of LongRoPE's 14,400 entries were 1.04e-6 off (its scaled values reach 1.13)
ANGLES_BY_CPU = 2e-6


def test_longrope_tables_match_transformers_decoding():
    """Short factors below the original context, long ones from it on: transformers decoding token by token.
    Its prefill of a sequence longer than the original context takes the long factors for every position."""
    rng = np.random.RandomState(0)
    short, long = (1 + rng.rand(24)).tolist(), (1 + 10 * rng.rand(24)).tolist()
    spec, rotary = rotary_of("Phi3", **PHI3, max_position_embeddings=512, original_max_position_embeddings=128,
                             rope_scaling=dict(type="longrope", short_factor=short, long_factor=long))
    assert spec.rotary_dim == 48 and spec.rope.original_max_positions == 128
    positions = 300
    cos, sin = rope_tables(spec, positions)
    their_cos, their_sin = decoded_tables(rotary, positions)
    np.testing.assert_allclose(cos, their_cos, atol=ANGLES_BY_CPU, rtol=0)
    np.testing.assert_allclose(sin, their_sin, atol=ANGLES_BY_CPU, rtol=0)
    assert np.abs(cos * np.sqrt(1 + np.log(4) / np.log(128)) / spec.rope.attention_factor).max() > 1  # scaled
    with torch.no_grad():
        prefill_cos = rotary(torch.zeros(1), torch.arange(positions)[None])[0][0].numpy()
    np.testing.assert_allclose(prefill_cos[128:], cos[128:], atol=ANGLES_BY_CPU, rtol=0)
    assert np.abs(prefill_cos[:128] - cos[:128]).max() > 0.1  # the documented difference


def test_dynamic_tables_match_transformers_decoding():
    """Plain frequencies up to max_position_embeddings, then a base grown for each position. The base is a
    float32 power, which torch's powf and Linnet's correctly rounded one put up to an ulp apart: angles
    agree within ~1e-7 x position, hence the looser tolerance past the original context."""
    spec, rotary = rotary_of("Llama", **LLAMA, max_position_embeddings=64,
                             rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=3.0))
    assert spec.rope.kind == "dynamic" and spec.rope.original_max_positions == 64
    positions = 200
    cos, sin = rope_tables(spec, positions)
    their_cos, their_sin = decoded_tables(rotary, positions)
    plain_cos, _ = rope_tables(replace(spec, rope=RopeSpec(spec.rope.theta)), positions)
    np.testing.assert_array_equal(cos[:64], plain_cos[:64])
    np.testing.assert_allclose(cos[:64], their_cos[:64], atol=1e-6, rtol=0)
    np.testing.assert_allclose(cos, their_cos, atol=5e-5, rtol=0)
    np.testing.assert_allclose(sin, their_sin, atol=5e-5, rtol=0)
    assert np.abs(cos[64:] - plain_cos[64:]).max() > 0.1


def test_rows_do_not_depend_on_the_table_length():
    for rope in (RopeSpec(10000.0, "dynamic", 2.0, original_max_positions=16),
                 RopeSpec(10000.0, "longrope", original_max_positions=16, attention_factor=1.2,
                          short_factors=(1.0, 2.0, 3.0, 4.0), long_factors=(5.0, 6.0, 7.0, 8.0))):
        spec = spec_from_hf_config({**hf_config(CASES_BY_ID["llama-gqa3"]), "head_dim": 8, "rope_theta": 1e4})
        spec = replace(spec, rope=rope)
        long_cos, _ = rope_tables(spec, 40)
        for n in (10, 16, 17, 33):
            np.testing.assert_array_equal(rope_tables(spec, n)[0], long_cos[:n])


# -- whole models, decoding past the original context -----------------------------------------------------------

SCALED_CASES = [
    # rotary on 8 of 16 dims: 4 factors a set; the original context 16 of 64
    Case("phi3-longrope", "Phi3ForCausalLM", dict(
        CASES_BY_ID["phi3-partial"].config, max_position_embeddings=64, original_max_position_embeddings=16,
        rope_scaling=dict(rope_type="longrope", short_factor=[1.0, 1.3, 2.1, 3.0], long_factor=[1.5, 4.0, 9.0, 20.0]))),
    # a ramp over dims 0-4 of 8 (theta 50, original context 16)
    Case("llama-yarn", "LlamaForCausalLM", dict(
        CASES_BY_ID["llama-gqa3"].config, max_position_embeddings=64, rope_theta=50.0,
        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16))),
    # dynamic NTK from max_position_embeddings 16 on
    Case("llama-dynamic", "LlamaForCausalLM", dict(
        CASES_BY_ID["llama-gqa3"].config, max_position_embeddings=16,
        rope_scaling=dict(rope_type="dynamic", factor=2.0))),
]


@pytest.mark.parametrize("case", SCALED_CASES, ids=[c.id for c in SCALED_CASES])
def test_decoding_past_the_original_context_matches_transformers(case, tmp_path):
    """A 6-token prompt, then 34 tokens decoded one at a time (teacher-forced): every step's logits agree
    with transformers' (eager, its KV cache) within the conformance suite's f32 tolerance."""
    from linnet.backends import CacheShape, create_runner
    from linnet.model import open_model

    build_checkpoint(case, tmp_path)
    tokens = np.random.RandomState(1).randint(3, 331, size=40).tolist()
    prompt, decoded = tokens[:6], tokens[6:]
    model = getattr(transformers, case.architecture).from_pretrained(tmp_path, dtype=torch.float32).eval()
    # the KV cache, filled in place; transformers 5.25 renamed the argument past_key_values to cache
    cache = {"cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values":
             transformers.DynamicCache()}
    with torch.no_grad():
        theirs = [model(torch.tensor([ids]), use_cache=True, **cache).logits[0, -1].numpy()
                  for ids in [prompt, *([t] for t in decoded[:-1])]]

    loaded = open_model(str(tmp_path))
    assert loaded.spec.rope.kind == case.config["rope_scaling"]["rope_type"]
    runner = create_runner("reference:numpy", loaded.weights, CacheShape(1, 48))
    ours = [runner.prefill(0, prompt)] + [runner.decode([token])[0] for token in decoded[:-1]]
    np.testing.assert_allclose(np.array(ours), np.array(theirs), atol=1e-4, rtol=0)
