"""Write a Hugging Face checkpoint that transformers (4.x and 5.x), vLLM, SGLang and TGI load.

The directory is built under a temporary name beside the target and renamed into place at the end,
so a failed export leaves nothing half-written behind.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from linnet.arch import get_architecture
from linnet.dtypes import DTYPES
from linnet.errors import LinnetError, UnsupportedModel
from linnet.files import atomic_write, check_output
from linnet.loaded_model import LoadedModel
from linnet.names import hf_name
from linnet.spec import ModelSpec

SHARD_BYTES = 2 * 1024**3


def export_hf(model: LoadedModel, out_dir: str | Path, dtype: str, shard_bytes: int = SHARD_BYTES,
              force: bool = False) -> Path:
    """Write ``model`` as an HF checkpoint in ``dtype`` (f32, f16, bf16) to ``out_dir``; returns it.
    An ``out_dir`` that holds anything is replaced only with ``force``."""
    if dtype not in DTYPES:
        raise LinnetError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    spec, tokenizer, eos_ids = model.spec, model.tokenizer, list(model.eos_ids)
    config = hf_config(spec, dtype, eos_ids)  # before any file is touched: it may refuse the model
    out = Path(out_dir)
    check_output(out, force)

    def write(tmp: Path) -> None:
        tmp.mkdir()
        _write_json(tmp / "config.json", config)
        generation = {"bos_token_id": spec.bos_token_id, "eos_token_id": _one_or_list(eos_ids)}
        _write_json(tmp / "generation_config.json", generation)
        _write_safetensors(tmp, model, DTYPES[dtype].numpy, shard_bytes)
        if tokenizer is not None:
            (tmp / "tokenizer.json").write_text(tokenizer.hf.to_str())
            _write_json(tmp / "tokenizer_config.json", {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": tokenizer.bos_token,
                "eos_token": tokenizer.eos_token,
                "chat_template": tokenizer.chat_template,
                "model_max_length": spec.max_positions,
                "clean_up_tokenization_spaces": False,
            })

    return atomic_write(out, write)


def hf_config(spec: ModelSpec, dtype: str, eos_ids: list[int]) -> dict[str, Any]:
    """config.json in both spellings: transformers 4 reads rope_theta and rope_scaling, 5 rope_parameters."""
    arch = get_architecture(spec.architecture)
    if arch.family not in ("llama", "qwen2", "qwen3") or arch.name == "MistralForCausalLM":
        raise UnsupportedModel(f"exporting {spec.architecture} to a Hugging Face checkpoint is not supported yet")
    if spec.qkv_bias != spec.o_bias and arch.family != "qwen2" or spec.qk_norm != (arch.family == "qwen3"):
        raise UnsupportedModel(f"{spec.architecture} in config.json cannot express these attention biases/norms")
    rope = spec.rope
    scaling = None
    if rope.kind == "llama3":
        scaling = {"rope_type": "llama3", "factor": rope.factor, "low_freq_factor": rope.low_freq_factor,
                   "high_freq_factor": rope.high_freq_factor,
                   "original_max_position_embeddings": rope.original_max_positions}
    config = {
        "architectures": [spec.architecture],
        "model_type": arch.family,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": spec.rms_norm_eps,
        "max_position_embeddings": spec.max_positions,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "attention_bias": spec.qkv_bias,  # llama, qwen3: on q, k, v and o; qwen2 always has its q, k, v bias
        "rope_theta": rope.theta,
        "rope_scaling": scaling,
        "rope_parameters": {"rope_type": rope.kind, "rope_theta": rope.theta, **(scaling or {})},
        "torch_dtype": DTYPES[dtype].hf,
        "dtype": DTYPES[dtype].hf,
        "bos_token_id": spec.bos_token_id,
        "eos_token_id": _one_or_list(eos_ids),
        "use_cache": True,
    }
    if arch.family == "llama":
        config["mlp_bias"] = False
    else:
        config["use_sliding_window"] = False
    return config


def _write_safetensors(out: Path, model: LoadedModel, dtype: np.dtype, shard_bytes: int) -> None:
    shards: list[dict[str, np.ndarray]] = [{}]
    size = total = 0
    for canonical, array in model.weights.items():  # a tied head has no lm_head: written tied
        array = np.ascontiguousarray(array.astype(dtype, copy=False))
        if shards[-1] and size + array.nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][hf_name(model.spec, canonical)] = array
        size += array.nbytes
        total += array.nbytes
    if len(shards) == 1:
        save_file(shards[0], out / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    _write_json(out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def _one_or_list(ids: list[int]) -> int | list[int] | None:
    return ids[0] if len(ids) == 1 else (ids or None)
