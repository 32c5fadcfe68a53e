"""Load a GGUF file (llama, qwen2, qwen3) as a ModelSpec, float32 Weights and a Tokenizer.

Quantised tensors are dequantised once (``dequantise``); the result is kept in the converted-weights
cache, keyed by the file's identity and the dequantising code, so later loads map it instead.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from linnet.arch import architecture_for_family
from linnet.errors import UnsupportedModel, WeightError
from linnet.gguf import dequantise
from linnet.gguf.blocks import GGUFWeights
from linnet.files import naming
from linnet.gguf.format import GGUFFile
from linnet.gguf.rope import llama3_from_factors
from linnet.gguf.tokenizer import tokenizer_from_gguf
from linnet.loaded_model import LoadedModel
from linnet.names import expected_shapes, gguf_name
from linnet.spec import ModelSpec, RopeSpec
from linnet.tokenizer import Tokenizer
from linnet.weight_cache import cached_arrays, source_identity
from linnet.weights import check_shapes

# The types tested against llama.cpp; the i-quants and ternary types are refused rather than trusted.
SUPPORTED_TYPES = frozenset({Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1,
                             Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K})
ROPE_FREQS = "rope_freqs.weight"


def load_gguf(path: str | Path) -> LoadedModel:
    start = time.perf_counter()
    path = Path(path)
    with naming(path):
        return _load(path, start)


def _load(path: Path, start: float) -> LoadedModel:
    gguf = GGUFFile(path)
    spec = spec_from_gguf(gguf)
    names = {gguf_name(spec, c): c for c in expected_shapes(spec)}
    unknown = sorted(set(gguf.tensors) - set(names) - {ROPE_FREQS})
    if unknown:
        raise UnsupportedModel(f"{path.name} has tensors Linnet does not know: {', '.join(unknown[:5])}")
    present = {name: canonical for name, canonical in names.items() if name in gguf.tensors}
    for name in present:  # types, names and shapes are checked before anything is dequantised or cached
        if gguf.tensors[name].type not in SUPPORTED_TYPES:
            raise WeightError(f"tensor {name!r} is stored as {gguf.tensors[name].type.name}, which Linnet "
                              f"cannot read; supported: {', '.join(sorted(t.name for t in SUPPORTED_TYPES))}")
    check_shapes(spec, {canonical: gguf.tensors[name] for name, canonical in present.items()})
    tokenizer = _tokenizer(gguf) if "tokenizer.ggml.model" in gguf.metadata else None
    file, key = source_identity([path]), f"dequantised by {dequantise.code()}"
    # The weights are this file as this code dequantises it (when first read as floats; its Q8_0/Q4_0/Q4_1
    # tensors are also given as stored, linnet.gguf.blocks): plans of them are keyed by both.
    def dequantise_all() -> dict[str, np.ndarray]:
        return cached_arrays(file, key, lambda: dequantise.dequantised(gguf, spec, present))

    weights = GGUFWeights(spec, gguf, present, dequantise_all, time.perf_counter() - start, f"{file}\n{key}")
    return LoadedModel(spec, weights, tokenizer, path)


def spec_from_gguf(gguf: GGUFFile) -> ModelSpec:
    with naming(gguf.path):
        return _spec(gguf)


def _spec(gguf: GGUFFile) -> ModelSpec:
    meta = gguf.metadata
    family = meta.get("general.architecture")
    if not isinstance(family, str):
        raise UnsupportedModel(f"{gguf.path}: general.architecture: expected a name, got {family!r}")
    arch = architecture_for_family(family)

    def key(name: str, default: Any = None, kind: type = int) -> Any:
        """A whole number of at least 1 (``kind`` int) or a finite, positive number (``kind`` float)."""
        value = meta.get(f"{family}.{name}", default)
        if value is None:
            raise UnsupportedModel(f"{gguf.path.name} lacks metadata key {family}.{name}")
        if isinstance(value, list):
            raise UnsupportedModel(f"{family}.{name} differs per layer; Linnet supports uniform layers only")
        if type(value) not in ((int,) if kind is int else (int, float)) or not 0 < value < float("inf"):
            what = "a positive integer" if kind is int else "a finite, positive number"
            raise UnsupportedModel(f"{gguf.path}: {family}.{name}: expected {what}, got {value!r}")
        return value

    if "token_embd.weight" not in gguf.tensors:
        raise WeightError(f"{gguf.path.name} has no token_embd.weight")
    hidden, heads = key("embedding_length"), key("attention.head_count")
    head_dim = key("attention.key_length", hidden // heads)  # llama.cpp's default too
    if key("attention.value_length", head_dim) != head_dim:
        raise UnsupportedModel("attention.value_length differs from key_length; not supported")
    if meta.get(f"{family}.rope.scaling.type", "none") != "none":
        raise UnsupportedModel(f"rope scaling {meta[f'{family}.rope.scaling.type']!r} is not supported")
    theta = _f32(key("rope.freq_base", 10000.0, float))  # llama.cpp's default when the key is absent
    rope = RopeSpec(theta=theta)
    if ROPE_FREQS in gguf.tensors:
        info = gguf.tensors[ROPE_FREQS]
        if info.type != Q.F32 or info.shape != (head_dim // 2,):
            raise WeightError(f"{gguf.path}: {ROPE_FREQS} is {info.type.name}{list(info.shape)}, "
                              f"expected F32[{head_dim // 2}]")
        rope = llama3_from_factors(theta, head_dim, dequantize(gguf.raw(ROPE_FREQS), info.type))
    if family not in ("llama", "qwen2", "qwen3"):
        raise UnsupportedModel(f"GGUF files of llama.cpp's {family!r} graph are not read yet")
    bias = "blk.0.attn_q.bias" in gguf.tensors
    flags = {"qwen2": dict(qkv_bias=True), "qwen3": dict(qkv_bias=bias, o_bias=bias, qk_norm=True)}.get(
        family, dict(qkv_bias=bias, o_bias=bias))
    eos = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return ModelSpec(
        architecture=arch.name,
        vocab_size=gguf.tensors["token_embd.weight"].shape[0],
        hidden_size=hidden,
        intermediate_size=key("feed_forward_length"),
        num_layers=key("block_count"),
        num_heads=heads,
        num_kv_heads=key("attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=_f32(key("attention.layer_norm_rms_epsilon", kind=float)),
        rope=rope,
        max_positions=key("context_length"),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(i for i in eos if i is not None),
        **flags,
    )


# The tokenizer keys and their types, checked before linnet.gguf.tokenizer builds a tokenizer from them.
TOKENIZER_LISTS = {"tokenizer.ggml.tokens": str, "tokenizer.ggml.token_type": int, "tokenizer.ggml.merges": str}
TOKEN_IDS = [f"tokenizer.ggml.{k}_token_id" for k in ("bos", "eos", "eot", "eom")]


def _tokenizer(gguf: GGUFFile) -> Tokenizer:
    meta = gguf.metadata
    for name, kind in TOKENIZER_LISTS.items():
        value = meta.get(name, [])
        if not isinstance(value, list) or not all(type(v) is kind for v in value):
            raise UnsupportedModel(f"{gguf.path}: {name}: expected a list of {kind.__name__}s")
    bad = next((m for m in meta.get("tokenizer.ggml.merges", []) if len(m.split(" ")) != 2), None)
    if bad is not None:
        raise UnsupportedModel(f"{gguf.path}: tokenizer.ggml.merges: {bad!r} is not two tokens and a space")
    count = len(meta.get("tokenizer.ggml.tokens", []))
    for name in TOKEN_IDS:
        value = meta.get(name)
        if value is not None and (type(value) is not int or not 0 <= value < count):
            raise UnsupportedModel(f"{gguf.path}: {name}: {value!r} is not one of the {count} tokens")
    for name in ("tokenizer.ggml.pre", "tokenizer.chat_template"):
        if not isinstance(meta.get(name, ""), str):
            raise UnsupportedModel(f"{gguf.path}: {name}: expected a string, got {meta[name]!r}")
    tokenizer = tokenizer_from_gguf(meta)
    tokenizer.template_origin = f"{gguf.path}: tokenizer.chat_template"
    return tokenizer


def _f32(value: float) -> float:
    """The shortest decimal that is the same float32: GGUF's 9.999999747e-06 reads back as 1e-05."""
    return float(str(np.float32(value)))
