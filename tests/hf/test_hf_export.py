"""``linnet export hf``: what it writes, transformers loads, and computes the logits Linnet computes, for
every family (packed tensors packed again, Gemma's 1 + w norms stored as w; a mixture of experts in the
layout its checkpoints are published in, a tensor per expert where they hold one).

Tolerance: f32 on both sides, same operations in a different order; 1e-4 absolute on logits of ~5-15,
as in the backend conformance suite. transformers runs eager attention, which has the softcaps and windows.
"""
from __future__ import annotations

import json
from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest
import torch
from checkpoints import CASE_IDS, CASES_BY_ID, MOE_CASE_IDS, Case, build_checkpoint
from safetensors import safe_open

from linnet.backends import CacheShape, create_runner
from linnet.errors import LinnetError
from linnet.hf import export as hf_export
from linnet.hf.export import export_hf
from linnet.model import open_model
from linnet.names import hf_name
from linnet.spec import MoeSpec, load_spec, spec_from_hf_config

transformers = pytest.importorskip("transformers")

PROMPT = [1, 17, 250, 3, 99, 42, 7, 300, 12, 5]


def transformers_logits(out) -> np.ndarray:
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return hf.eval()(torch.tensor([PROMPT])).logits[0].numpy()


def linnet_logits(model) -> np.ndarray:
    runner = create_runner("reference:numpy", model.weights, CacheShape(1, 32))
    return runner.prefill(0, PROMPT, all_logits=True)


@pytest.mark.parametrize("case", CASE_IDS + MOE_CASE_IDS)
def test_transformers_loads_the_export(case, checkpoint_dir, tmp_path):
    model = open_model(str(checkpoint_dir(case)))
    out = export_hf(model, tmp_path / "out", "f32")

    assert load_spec(out) == replace(model.spec, eos_token_ids=model.eos_ids)  # config.json lists every EOS id
    np.testing.assert_allclose(transformers_logits(out), linnet_logits(model), atol=1e-4, rtol=0)

    with safe_open(str(out / "model.safetensors"), "numpy") as f:  # tied stays tied
        assert (hf_name(model.spec, "lm_head") in f.keys()) == (not model.spec.tie_word_embeddings)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    text = "Héllo wörld, the quick brown fox."
    assert tokenizer(text)["input_ids"] == model.tokenizer.encode(text)
    messages = [{"role": "user", "content": "Hi there"}]
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == \
        model.tokenizer.render_chat(messages)


@pytest.mark.parametrize("case", MOE_CASE_IDS)
def test_experts_are_written_as_transformers_saves_them(case, checkpoint_dir, tmp_path):
    """The published layout (a tensor per expert, Granite-MoE's input_linear, gpt-oss's fused gate_up_proj),
    which vLLM and transformers 4 read too, not transformers 5's module names: the tensors save_pretrained
    wrote, and their values."""
    saved = checkpoint_dir(case)
    out = export_hf(open_model(str(saved)), tmp_path / "out", "f32")
    with safe_open(str(out / "model.safetensors"), "numpy") as ours, \
            safe_open(str(saved / "model.safetensors"), "numpy") as theirs:
        assert set(ours.keys()) == set(theirs.keys())
        for name in theirs.keys():
            np.testing.assert_array_equal(ours.get_tensor(name), theirs.get_tensor(name), err_msg=name)


def test_config_and_generation_config(checkpoint_dir, tmp_path):
    model = open_model(str(checkpoint_dir("llama-mqa-tied-rope3")))
    out = export_hf(model, tmp_path / "out", "bf16")
    config = json.loads((out / "config.json").read_text())
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}
    assert config["rope_scaling"] == rope  # transformers 4.x
    assert config["rope_parameters"] == {**rope, "rope_theta": 500000.0}  # transformers 5.x
    assert config["rope_theta"] == 500000.0
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    assert config["attention_bias"] is True and config["tie_word_embeddings"] is True
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [2, 4]  # config's </s> and the tokenizer's <|im_end|>
    loaded = transformers.AutoConfig.from_pretrained(out)
    assert loaded.rope_parameters["rope_type"] == "llama3" and loaded.head_dim == 12
    with safe_open(str(out / "model.safetensors"), "numpy") as f:
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "BF16"
    back = open_model(str(out)).weights
    for name, array in model.weights.items():  # rounded to nearest even, as torch rounds
        np.testing.assert_array_equal(back[name], array.astype(ml_dtypes.bfloat16), err_msg=name)


def test_sharded_export_loads(checkpoint_dir, tmp_path):
    model = open_model(str(checkpoint_dir("qwen3-gqa3")))
    out = export_hf(model, tmp_path / "out", "f32", shard_bytes=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    assert all((out / s).stat().st_size < 40_000 + 70_000 for s in shards)  # one tensor may overflow a shard
    np.testing.assert_allclose(transformers_logits(out), linnet_logits(open_model(str(out))), atol=1e-4, rtol=0)


# Rope scaling, as config.json writes it back. The prompt stays inside the original context of LongRoPE and
# dynamic NTK (transformers' prefill of a longer one rotates early positions otherwise: linnet.rope), which
# tests/test_rope.py decodes past.
SCALED = [
    Case("llama-yarn-betas", "LlamaForCausalLM", dict(
        CASES_BY_ID["llama-gqa3"].config, rope_theta=50.0, rope_scaling=dict(rope_type="yarn", factor=4.0,
            original_max_position_embeddings=8, beta_fast=8, beta_slow=2, truncate=False))),
    Case("phi3-longrope", "Phi3ForCausalLM", dict(
        CASES_BY_ID["phi3-partial"].config, original_max_position_embeddings=16, rope_scaling=dict(
            rope_type="longrope", short_factor=[1.0, 1.3, 2.1, 3.0], long_factor=[1.5, 4.0, 9.0, 20.0]))),
    Case("llama-dynamic", "LlamaForCausalLM", dict(
        CASES_BY_ID["llama-gqa3"].config, max_position_embeddings=32,
        rope_scaling=dict(rope_type="dynamic", factor=2.0))),
]


@pytest.mark.parametrize("case", SCALED, ids=[case.id for case in SCALED])
def test_rope_scaling_is_written_back(case, tmp_path):
    model = open_model(str(build_checkpoint(case, tmp_path / "in")))
    out = export_hf(model, tmp_path / "out", "f32")
    assert load_spec(out) == replace(model.spec, eos_token_ids=model.eos_ids)
    theirs = transformers.AutoConfig.from_pretrained(out).to_dict()  # as transformers reads it
    assert spec_from_hf_config({**theirs, "architectures": [case.architecture]}).rope == model.spec.rope
    np.testing.assert_allclose(transformers_logits(out), linnet_logits(model), atol=1e-4, rtol=0)


@pytest.mark.parametrize("case, change, message", [
    ("llama-gqa3", dict(o_bias=True), r"o_bias=True \(it would read back as False\)"),  # one attention_bias
    ("llama-gqa3", dict(architecture="GraniteForCausalLM"), "cannot express head_dim 16"),  # hidden / heads is 8
    ("stablelm-parallel", dict(mlp_bias=True), r"mlp_bias=True \(it would read back as False\)"),
    # Mixtral's config renormalises the top k; its experts are intermediate_size wide
    ("mixtral-top2of5", dict(moe=MoeSpec(5, 2, 104)), r"moe.normalize=False \(it would read back as True\)"),
    ("mixtral-top2of5", dict(moe=MoeSpec(5, 2, 64, normalize=True)), r"moe.size=64 \(it would read back as 104\)"),
])
def test_what_config_json_cannot_express_is_refused(case, change, message, checkpoint_dir, tmp_path):
    model = open_model(str(checkpoint_dir(case)))
    with pytest.raises(LinnetError, match=message):
        export_hf(replace(model, spec=replace(model.spec, **change)), tmp_path / "out", "f32")
    assert list(tmp_path.iterdir()) == []


def test_unwritable_target_is_a_clear_error(checkpoint_dir, tmp_path):
    model = open_model(str(checkpoint_dir("qwen2-tied")))
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(LinnetError, match="cannot write"):
        export_hf(model, blocker / "out", "f32")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(LinnetError, match="not an empty directory"):
        export_hf(model, tmp_path / "full", "f32")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "full"]


def test_failed_export_leaves_nothing(checkpoint_dir, tmp_path, monkeypatch):
    model = open_model(str(checkpoint_dir("qwen2-tied")))

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hf_export, "save_file", full_disk)
    with pytest.raises(LinnetError, match="No space left"):
        export_hf(model, tmp_path / "out", "f16")
    assert list(tmp_path.iterdir()) == []
