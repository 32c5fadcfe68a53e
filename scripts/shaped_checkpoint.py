"""A random-weight checkpoint with a published model's shapes, for benchmarks where no model hub is reachable.

    python scripts/shaped_checkpoint.py qwen2.5-0.5b-instruct -o /tmp/qwen2.5-0.5b-shaped [--dtype f32]

Speed and memory depend on the shapes, not on the values: this writes the model's published config with
transformers' own initialisation (seed 0) through ``save_pretrained``, and the default model's tokenizer
(SmolLM2's: its ids are all inside the larger vocabulary, and every row of a bench reads the same prompt
ids; `--no-tokenizer` leaves it out). The text such a model writes is noise; its logits are still compared across subjects. Needs
transformers (the bench extra).
"""
from __future__ import annotations

import argparse
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
    return out


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
