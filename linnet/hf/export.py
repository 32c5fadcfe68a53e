"""Write a Hugging Face checkpoint that transformers (4.x and 5.x), vLLM, SGLang and TGI load.

The directory is built under a temporary name beside the target and renamed into place at the end,
so a failed export leaves nothing half-written behind.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from linnet.arch import get_architecture
from linnet.arch.blocks import check_reads_back
from linnet.dtypes import DTYPES
from linnet.errors import LinnetError
from linnet.files import atomic_write, check_output
from linnet.loaded_model import LoadedModel
from linnet.names import hf_alternative, hf_name
from linnet.spec import ModelSpec, RopeSpec, spec_from_hf_config

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
    """config.json in both spellings (transformers 4 reads rope_theta and rope_scaling, 5 rope_parameters),
    with the architecture's own keys; read back first, so a model it would describe otherwise is refused."""
    arch = get_architecture(spec.architecture)
    rope = spec.rope
    scaling = rope_scaling(rope)
    family = arch.hf_config(spec)
    partial = {k: family[k] for k in ("partial_rotary_factor",) if k in family}
    config = {
        "architectures": [spec.architecture],
        "model_type": arch.model_type,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        arch.eps_key: spec.rms_norm_eps,
        "max_position_embeddings": spec.max_positions,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "rope_theta": rope.theta,
        "rope_scaling": scaling,
        # transformers reads a top-level original_max_position_embeddings first (Phi-3's config defaults it)
        **({"original_max_position_embeddings": rope.original_max_positions}
           if rope.kind in ("yarn", "longrope") else {}),
        "rope_parameters": {"rope_type": rope.kind, "rope_theta": rope.theta, **(scaling or {}), **partial},
        "torch_dtype": DTYPES[dtype].hf,
        "dtype": DTYPES[dtype].hf,
        "bos_token_id": spec.bos_token_id,
        "eos_token_id": _one_or_list(eos_ids),
        "pad_token_id": None,  # some families' defaults (SmolLM3's 128004) lie outside a small vocabulary
        "use_cache": True,
        **family,
    }
    expected = replace(spec, eos_token_ids=tuple(eos_ids), dtype=DTYPES[dtype].name)
    check_reads_back(expected, spec_from_hf_config(config, "the exported config.json"),
                     f"{spec.architecture}'s config.json")
    return config


def rope_scaling(rope: RopeSpec) -> dict[str, Any] | None:
    """rope_scaling as transformers reads it; YaRN's optional keys only where they are not its defaults."""
    if rope.kind == "llama3":
        return {"rope_type": "llama3", "factor": rope.factor, "low_freq_factor": rope.low_freq_factor,
                "high_freq_factor": rope.high_freq_factor,
                "original_max_position_embeddings": rope.original_max_positions}
    if rope.kind in ("linear", "dynamic"):
        return {"rope_type": rope.kind, "factor": rope.factor}
    if rope.kind == "yarn":
        optional = {"beta_fast": (rope.beta_fast, 32.0), "beta_slow": (rope.beta_slow, 1.0),
                    "truncate": (rope.truncate, True)}
        return {"rope_type": "yarn", "factor": rope.factor, "attention_factor": rope.attention_factor,
                "original_max_position_embeddings": rope.original_max_positions,
                **{key: value for key, (value, default) in optional.items() if value != default}}
    if rope.kind == "longrope":  # the attention factor given, so that no factor is needed to derive it
        return {"rope_type": "longrope", "short_factor": list(rope.short_factors),
                "long_factor": list(rope.long_factors), "original_max_position_embeddings": rope.original_max_positions,
                "attention_factor": rope.attention_factor}
    return None


def _tensors(model: LoadedModel, dtype: np.dtype) -> Iterator[tuple[str, np.ndarray]]:
    """Each checkpoint tensor, in the layout the family's checkpoints are published in: a part with another
    layout's name (``Architecture.hf_alternatives``: what transformers saves, a tensor per expert) under
    that name, cut per expert; packed ones joined from their parts; load-time transforms undone."""
    spec, weights = model.spec, model.weights
    arch = get_architecture(spec.architecture)
    packed = {}
    for template, pack in arch.hf_packed.items():  # the last template of a part is the one written
        for name, parts in pack.groups(spec, template, weights):
            packed.update(dict.fromkeys(parts, (name, parts, pack)))
    written = set()
    for canonical, array in weights.items():  # a tied head has no lm_head: written tied
        if others := hf_alternative(spec, canonical):
            per_expert = "{e}" in arch.hf_alternatives[canonical.rsplit(".", 1)[-1]]
            yield from zip(others, (_stored(a, dtype) for a in (array if per_expert else [array])))
            continue
        if canonical in packed:
            name, parts, pack = packed[canonical]
            if name not in written:
                written.add(name)
                yield name, _stored(pack.pack(spec, tuple(weights[p] for p in parts)), dtype)
            continue
        transform = arch.hf_transforms.get(canonical.rsplit(".", 1)[-1])
        stored_name = hf_name(spec, canonical)
        assert stored_name is not None  # only a packed part has none, and those are written above
        yield stored_name, _stored(array if transform is None else transform.save(array), dtype)


def _stored(array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    return np.ascontiguousarray(array.astype(dtype, copy=False))


def _write_safetensors(out: Path, model: LoadedModel, dtype: np.dtype, shard_bytes: int) -> None:
    shards: list[dict[str, np.ndarray]] = [{}]
    size = total = 0
    for name, array in _tensors(model, dtype):
        if shards[-1] and size + array.nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = array
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
