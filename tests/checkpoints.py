"""Tiny random-weight checkpoints, built with transformers (fixed seeds), covering shapes that break naive code."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TOKENIZER_VOCAB = 300  # tiny byte-level BPE trained on the fly; model vocabularies are larger and odd


@dataclass(frozen=True)
class Case:
    id: str
    architecture: str
    config: dict[str, Any] = field(default_factory=dict)


BASE = dict(
    vocab_size=331,  # odd on purpose
    hidden_size=48,
    intermediate_size=104,
    num_hidden_layers=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,  # some families' defaults lie outside the tiny vocabulary
)

CASES = [
    # head_dim 16 != 48/6; GQA ratio 3; untied head
    Case("llama-gqa3", "LlamaForCausalLM", dict(num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                                                 tie_word_embeddings=False)),
    # MQA, tied head, llama3 rope scaling, attention bias on q/k/v/o
    Case("llama-mqa-tied-rope3", "LlamaForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True, attention_bias=True,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=64), rope_theta=500000.0)),
    # qkv bias, GQA ratio 2, tied head (as Qwen2.5-0.5B)
    Case("qwen2-tied", "Qwen2ForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2,
                                                 tie_word_embeddings=True, rope_theta=1000000.0)),
    # q/k norm, head_dim 32 != 48/6, GQA ratio 3, untied
    Case("qwen3-gqa3", "Qwen3ForCausalLM", dict(num_attention_heads=6, num_key_value_heads=2, head_dim=32,
                                                 tie_word_embeddings=False, rope_theta=1000000.0)),
    # MQA, tied (as Qwen3-4B)
    Case("qwen3-mqa-tied", "Qwen3ForCausalLM", dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                                                     tie_word_embeddings=True)),
]

# The families beyond Llama, each in its awkward shapes: windows shorter than the prompts, softcaps that
# bite, rotary on part of the head, parallel residuals, multipliers far from 1.
FAMILY_CASES = [
    # every layer slides over 5 tokens; GQA 2
    Case("mistral-window5", "MistralForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                                        sliding_window=5, tie_word_embeddings=False)),
    # multipliers: embedding x4, residual x0.5, attention scale 0.3 (not 1/sqrt(16)), logits / 3; biases
    Case("granite-multipliers", "GraniteForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, embedding_multiplier=4.0, residual_multiplier=0.5,
        attention_multiplier=0.3, logits_scaling=3.0, attention_bias=True, mlp_bias=True, tie_word_embeddings=True)),
    # norms after each sublayer, q/k norms over the whole projection; GQA 3
    Case("olmo2-gqa3", "Olmo2ForCausalLM", dict(num_attention_heads=6, num_key_value_heads=2,
                                                 tie_word_embeddings=False)),
    # the second layer without rotary; tied
    Case("smollm3-nope", "SmolLM3ForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2,
                                                     no_rope_layers=[1, 0], tie_word_embeddings=True)),
    # sliding (6 tokens) then global; softcaps of 2 on scores and 3 on logits; 1 + w norms; GELU-tanh;
    # a query scale from query_pre_attn_scalar 24 (not head_dim 16)
    Case("gemma2-softcap-window6", "Gemma2ForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=6,
        layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=24,
        attn_logit_softcapping=2.0, final_logit_softcapping=3.0, hidden_activation="gelu_pytorch_tanh")),
    # a global layer between two sliding ones (5 tokens); q/k norms (1 + w); the sliding layers' rope of
    # base 500, the global layers' of base 100 with linear scaling by 8; the default query_pre_attn_scalar
    # (256, not head_dim 16). Three layers, a query scale of 1/16: six layers (Gemma 3's default pattern) and
    # head_dim's scale compound transformers' own 16-bit rounding past the conformance budget
    Case("gemma3-local-rope", "Gemma3ForCausalLM", dict(
        num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=5,
        rope_theta=100.0, rope_local_base_freq=500.0,
        rope_scaling=dict(rope_type="linear", factor=8.0))),
    # q/k/v and gate/up packed; rotary on half of each head (8 of 16)
    Case("phi3-partial", "Phi3ForCausalLM", dict(num_attention_heads=3, num_key_value_heads=1,
                                                  partial_rotary_factor=0.5, tie_word_embeddings=False)),
    # LayerNorms, rotary on a quarter of the head, q/k/v biases, the parallel residual
    Case("stablelm-parallel", "StableLmForCausalLM", dict(
        num_attention_heads=3, num_key_value_heads=3, partial_rotary_factor=0.25, use_qkv_bias=True,
        use_parallel_residual=True, layer_norm_eps=1e-5)),
    # LayerNorms, q/k/v packed per head, rotary on a quarter, GELU, parallel residual, biases everywhere
    Case("gptneox-parallel", "GPTNeoXForCausalLM", dict(num_attention_heads=3, rotary_pct=0.25,
                                                         use_parallel_residual=True, hidden_act="gelu")),
]
CASES = CASES + FAMILY_CASES

# Mixtures of experts, apart from CASES: only some backends run them (the others refuse them by name), and
# the formats' round trips over CASES do not take them yet. Each routes among more experts than it picks.
MOE_CASES = [
    # 5 experts, top 2 renormalised; GQA 2
    Case("mixtral-top2of5", "MixtralForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                                        num_local_experts=5, num_experts_per_tok=2)),
    # top 3 of 6 experts, not renormalised, beside a shared expert (sigmoid-gated); a dense layer between
    # two sparse ones (mlp_only_layers); q/k/v biases
    Case("qwen2moe-shared-dense", "Qwen2MoeForCausalLM", dict(
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, num_experts=6, num_experts_per_tok=3,
        moe_intermediate_size=32, shared_expert_intermediate_size=40, mlp_only_layers=[1], norm_topk_prob=False)),
    # dense and sparse layers in turn (decoder_sparse_step 2); top 2 of 6 renormalised; q/k norm per head
    Case("qwen3moe-step2", "Qwen3MoeForCausalLM", dict(
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=6,
        num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=2, norm_topk_prob=True)),
    # q/k norms over the whole projections; top 3 of 5, not renormalised
    Case("olmoe-top3of5", "OlmoeForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2, num_experts=5,
                                                    num_experts_per_tok=3, norm_topk_prob=False)),
    # Granite's multipliers far from 1; a softmax over the top 2 logits of 5
    Case("granitemoe-multipliers", "GraniteMoeForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=5, num_experts_per_tok=2,
        embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.3, logits_scaling=3.0)),
    # attention sinks; sliding (5 tokens) then global; biases everywhere; YaRN (truncate false); biased
    # experts whose clamped SwiGLU bites (limit 0.5); a softmax over the top 2 logits of 5
    Case("gptoss-sinks-window5", "GptOssForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=5, num_local_experts=5,
        num_experts_per_tok=2, swiglu_limit=0.5, rope_parameters=dict(
            rope_type="yarn", rope_theta=150000.0, factor=8.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
            original_max_position_embeddings=32))),
]
MOE_CASE_IDS = [case.id for case in MOE_CASES]

CASES_BY_ID = {case.id: case for case in CASES + MOE_CASES}
CASE_IDS = [case.id for case in CASES]


# The config class of an architecture whose name does not give it (Gemma3Config is the multimodal model's)
CONFIG_CLASSES = {"Gemma3ForCausalLM": "Gemma3TextConfig"}


def config_class(case: Case) -> str:
    """The name of the transformers config class of the case's architecture."""
    return CONFIG_CLASSES.get(case.architecture, case.architecture.replace("ForCausalLM", "Config"))


def hf_config(case: Case) -> dict[str, Any]:
    """The case's config.json fields (before transformers fills in its defaults)."""
    return {**BASE, **case.config, "architectures": [case.architecture]}


def build_checkpoint(case: Case, directory: Path, dtype: str = "float32", seed: int = 0) -> Path:
    """Save a random-weight model of ``case`` (and a small real tokenizer) under ``directory``."""
    import torch
    import transformers

    config_cls = getattr(transformers, config_class(case))
    model_cls = getattr(transformers, case.architecture)
    config = config_cls(**hf_config(case))
    torch.manual_seed(seed)
    model = model_cls(config).to(getattr(torch, dtype)).eval()
    with torch.no_grad():  # random init is tiny; widen norms and biases so bugs show in the logits
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.5 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * 0.15)
    model.save_pretrained(directory)
    save_tokenizer(directory)
    return directory


def save_tokenizer(directory: Path) -> None:
    """A byte-level BPE tokenizer with BOS/EOS and a ChatML-style template, trained on a fixed text."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB, special_tokens=["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    text = ["The quick brown fox jumps over the lazy dog. Héllo wörld, ünïcode ✓ 日本語."] * 20
    tok.train_from_iterator(text, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(directory / "tokenizer.json"))
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "<|im_end|>", "chat_template": template}))
