"""Phi-3: Llama's layer, with q, k and v packed in one ``qkv_proj`` and gate and up in one
``gate_up_proj`` (split into canonical tensors at load, views of the mapped file), and partial rotary
(``partial_rotary_factor``, Phi-4-mini's 0.75). llama.cpp keeps both packed."""
import numpy as np

from linnet.arch import Architecture, Packed
from linnet.arch.blocks import LLAMA_NAMES, partial_rotary, pre_norm_layer, refuse, sliding_layers


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


ARCHITECTURE = Architecture(
    "Phi3ForCausalLM", "phi3", "phi3", read_config, pre_norm_layer, LLAMA_NAMES,
    hf_packed={"model.layers.{i}.self_attn.qkv_proj.weight": QKV, "model.layers.{i}.mlp.gate_up_proj.weight": GATE_UP},
)
