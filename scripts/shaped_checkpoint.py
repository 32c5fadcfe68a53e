"""A random-weight checkpoint with a published model's shapes, for benchmarks where no model hub is reachable.

    python scripts/shaped_checkpoint.py qwen2.5-0.5b-instruct -o /tmp/qwen2.5-0.5b-shaped [--dtype f32]

Speed and memory depend on the shapes, not on the values: this writes the model's published config with
transformers' own initialisation (seed 0) through ``save_pretrained``, and the default model's tokenizer
(SmolLM2's: its ids are all inside the larger vocabulary, and every row of a bench reads the same prompt
ids; `--no-tokenizer` leaves it out). The text such a model writes is noise; its logits are still compared
across subjects. Needs transformers (the bench extra).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

# config.json of each model as published on its hub page (Qwen/Qwen2.5-0.5B-Instruct)
SHAPES = {
    "qwen2.5-0.5b-instruct": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=896, intermediate_size=4864,
        num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
        max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
        hidden_act="silu", use_sliding_window=False, sliding_window=32768, max_window_layers=21,
        bos_token_id=151643, eos_token_id=151645),
    "qwen3-4b": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=2560, intermediate_size=9728,
        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
        hidden_act="silu", attention_bias=False, bos_token_id=151643, eos_token_id=151645),
    "gemma-2-2b-it": dict(
        architectures=["Gemma2ForCausalLM"], model_type="gemma2", hidden_size=2304, intermediate_size=9216,
        num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4, head_dim=256, vocab_size=256000,
        max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=10000.0, query_pre_attn_scalar=256,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, sliding_window=4096,
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, bos_token_id=2, eos_token_id=[1, 107],
        pad_token_id=0),
    "gemma-3-1b-it": dict(
        architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_size=1152, intermediate_size=6912,
        num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
        max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0, rope_local_base_freq=10000.0,
        sliding_window=512, query_pre_attn_scalar=256, hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True, bos_token_id=2, eos_token_id=[1, 106], pad_token_id=0),
    # Phi-3.5-mini's shapes; its LongRoPE scaling (two lists of 48 factors) is left out: it changes no shape
    "phi-3.5-mini-instruct": dict(
        architectures=["Phi3ForCausalLM"], model_type="phi3", hidden_size=3072, intermediate_size=8192,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, vocab_size=32064,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=262144,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=32000, pad_token_id=32000),
    "mistral-7b-instruct-v0.3": dict(
        architectures=["MistralForCausalLM"], model_type="mistral", hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=32768,
        max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1000000.0, sliding_window=None,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
    "olmo-2-0425-1b": dict(
        architectures=["Olmo2ForCausalLM"], model_type="olmo2", hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16, vocab_size=100352,
        max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=500000.0, tie_word_embeddings=False,
        bos_token_id=100257, eos_token_id=100257, pad_token_id=100277),
    "smollm3-3b": dict(
        architectures=["SmolLM3ForCausalLM"], model_type="smollm3", hidden_size=2048, intermediate_size=11008,
        num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=4, vocab_size=128256,
        max_position_embeddings=65536, rms_norm_eps=1e-6, rope_theta=5000000.0, no_rope_layers=[1, 1, 1, 0] * 9,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=128012, pad_token_id=128004),
    "granite-3.3-2b-instruct": dict(
        architectures=["GraniteForCausalLM"], model_type="granite", hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8, vocab_size=49159,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=10000000.0, embedding_multiplier=12.0,
        residual_multiplier=0.22, attention_multiplier=0.015625, logits_scaling=8.0, tie_word_embeddings=True,
        bos_token_id=0, eos_token_id=0, pad_token_id=0),
    "pythia-1b": dict(
        architectures=["GPTNeoXForCausalLM"], model_type="gpt_neox", hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=8, vocab_size=50304, max_position_embeddings=2048,
        layer_norm_eps=1e-5, rotary_pct=0.25, rotary_emb_base=10000, use_parallel_residual=True,
        hidden_act="gelu", tie_word_embeddings=False, bos_token_id=0, eos_token_id=0),
    "stablelm-2-1.6b": dict(
        architectures=["StableLmForCausalLM"], model_type="stablelm", hidden_size=2048, intermediate_size=5632,
        num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=32, vocab_size=100352,
        max_position_embeddings=4096, layer_norm_eps=1e-5, rope_theta=10000.0, partial_rotary_factor=0.25,
        use_qkv_bias=True, use_parallel_residual=False, tie_word_embeddings=False, bos_token_id=100257,
        eos_token_id=100257),
    # Mixtures of experts: the published shapes (the registry's parameter counts are the Programs' of these)
    "olmoe-1b-7b-0924": dict(
        architectures=["OlmoeForCausalLM"], model_type="olmoe", hidden_size=2048, intermediate_size=1024,
        num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16, num_experts=64, num_experts_per_tok=8,
        norm_topk_prob=False, vocab_size=50304, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
        clip_qkv=None, tie_word_embeddings=False, bos_token_id=None, eos_token_id=50279, pad_token_id=1),
    # Granite 3.1 3B-A800M's shapes; its multipliers, rms_norm_eps and token ids, which change no shape and are not
    # confirmed here, are left at GraniteMoeConfig's defaults
    "granite-3.1-3b-a800m-instruct": dict(
        architectures=["GraniteMoeForCausalLM"], model_type="granitemoe", hidden_size=1536, intermediate_size=512,
        num_hidden_layers=32, num_attention_heads=24, num_key_value_heads=8, num_local_experts=40,
        num_experts_per_tok=8, vocab_size=49155, max_position_embeddings=131072, rope_theta=10000000.0,
        tie_word_embeddings=True),
}
DTYPES = ("f32", "bf16", "f16")


def write_shaped(name: str, out: Path, dtype: str = "f32", tokenizer: bool = True) -> Path:
    import torch
    import transformers

    from linnet.default_model import DEFAULT_MODEL
    from linnet.hf.export import export_hf
    from linnet.model import open_model

    config = transformers.AutoConfig.for_model(**SHAPES[name])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.to({"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[dtype])
    out.mkdir(parents=True)
    model.save_pretrained(out)
    if not tokenizer:  # a bench of prompt ids needs none
        return out
    with tempfile.TemporaryDirectory() as tmp:  # the default model's tokenizer, as Linnet exports it
        exported = export_hf(open_model(DEFAULT_MODEL), Path(tmp) / "hf", "f32")
        for file in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(exported / file, out / file)
    fit_tokenizer(out / "tokenizer.json", config.vocab_size)
    return out


def fit_tokenizer(path: Path, vocab_size: int) -> None:
    """Drop the BPE tokenizer's ids at or past ``vocab_size`` (Phi-3.5's 32064 rows are fewer than SmolLM2's
    49152 ids), and the merges that make or use them, so that every id it gives has an embedding row."""
    tokenizer = json.loads(path.read_text())
    vocab = tokenizer["model"]["vocab"]
    if len(vocab) <= vocab_size:
        return
    kept = {token: i for token, i in vocab.items() if i < vocab_size}
    merges = [m for m in tokenizer["model"]["merges"]
              if all(part in kept for part in (m.split(" ") if isinstance(m, str) else m))
              and "".join(m.split(" ") if isinstance(m, str) else m) in kept]
    tokenizer["model"].update(vocab=kept, merges=merges)
    tokenizer["added_tokens"] = [t for t in tokenizer.get("added_tokens", []) if t["id"] < vocab_size]
    path.write_text(json.dumps(tokenizer, ensure_ascii=False))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", choices=sorted(SHAPES))
    parser.add_argument("-o", "--output", required=True, type=Path)
    parser.add_argument("--dtype", choices=DTYPES, default="f32")
    parser.add_argument("--no-tokenizer", action="store_true", help="where the default model is not installed")
    args = parser.parse_args()
    if args.output.exists():
        print(f"shaped_checkpoint: {args.output} exists; remove it first", file=sys.stderr)
        return 2
    print(write_shaped(args.model, args.output, args.dtype, not args.no_tokenizer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
