"""Phi-3: Llama's layer, with q, k and v packed in one ``qkv_proj`` and gate and up in one
``gate_up_proj`` (split into canonical tensors at load, views of the mapped file), and partial rotary
(``partial_rotary_factor``, Phi-4-mini's 0.75). llama.cpp keeps both packed (``attn_qkv``, and
``ffn_up`` holding gate then up), and its graph ignores the sliding window."""
import numpy as np

from linnet.arch import Architecture, Packed
from linnet.arch.blocks import (
    LLAMA_NAMES,
    hf_partial_rotary,
    hf_uniform_window,
    no_window,
    partial_rotary,
    plain_heads,
    pre_norm_layer,
    refuse,
    sliding_layers,
)

NAMES = {**LLAMA_NAMES, **{part: (LLAMA_NAMES[part][0], None) for part in ("q", "k", "v", "gate", "up")}}


def _cut(sizes):
    def unpack(spec, array):
        return tuple(np.split(array, np.cumsum(sizes(spec))[:-1], axis=0))
    return unpack


def _join(spec, arrays):
    return np.concatenate(arrays, axis=0)


QKV = Packed(("q", "k", "v"), _cut(lambda s: (s.q_size, s.kv_size, s.kv_size)), _join)
GATE_UP = Packed(("gate", "up"), _cut(lambda s: (s.intermediate_size, s.intermediate_size)), _join)


def read_config(c) -> dict:
    refuse(c, "hidden_act", "silu", "Phi-3's MLP is SwiGLU")
    hidden, heads = c.count("hidden_size"), c.count("num_attention_heads")
    return {"rope_dim": partial_rotary(c, c.count("head_dim", hidden // heads)), **sliding_layers(c)}


def hf_config(spec) -> dict:
    plain_heads(spec, "Phi-3's config.json")
    return {"hidden_act": "silu", **hf_partial_rotary(spec), **hf_uniform_window(spec)}


def gguf_config(keys) -> dict:
    # config.json's window (0: none, as llama.cpp's converter writes), which llama.cpp reads and ignores
    window = keys.number("attention.sliding_window") if keys.meta.get("phi3.attention.sliding_window", 0) else None
    return {"layer_types": ("sliding" if window else "full",) * keys.number("block_count"), "sliding_window": window}


def gguf_metadata(spec) -> dict:
    plain_heads(spec, "llama.cpp's phi3 graph")
    no_window(spec, "llama.cpp's phi3 graph")
    return {"attention.sliding_window": spec.sliding_window if "sliding" in spec.layer_types else 0}


ARCHITECTURE = Architecture(
    "Phi3ForCausalLM", "phi3", "phi3", read_config, pre_norm_layer, NAMES, hf_config=hf_config,
    hf_packed={"model.layers.{i}.self_attn.qkv_proj.weight": QKV, "model.layers.{i}.mlp.gate_up_proj.weight": GATE_UP},
    gguf_config=gguf_config, gguf_metadata=gguf_metadata,
    gguf_packed={"blk.{i}.attn_qkv.weight": QKV, "blk.{i}.ffn_up.weight": GATE_UP},
)
