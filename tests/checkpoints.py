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

CASES_BY_ID = {case.id: case for case in CASES}
CASE_IDS = [case.id for case in CASES]


def hf_config(case: Case) -> dict[str, Any]:
    """The case's config.json fields (before transformers fills in its defaults)."""
    return {**BASE, **case.config, "architectures": [case.architecture]}


def build_checkpoint(case: Case, directory: Path, dtype: str = "float32", seed: int = 0) -> Path:
    """Save a random-weight model of ``case`` (and a small real tokenizer) under ``directory``."""
    import torch
    import transformers

    config_cls = getattr(transformers, case.architecture.replace("ForCausalLM", "Config"))
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
