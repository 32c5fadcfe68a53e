"""Qwen3: Llama's layer with an RMS norm of each q and k head before rotary; ``attention_bias`` covers
q, k, v and o."""
from linnet.arch import Architecture
from linnet.arch.blocks import LLAMA_NAMES, gguf_biases, pre_norm_layer, refuse


def read_config(c) -> dict:
    refuse(c, "hidden_act", "silu", "Qwen3's MLP is SwiGLU")
    refuse(c, "use_sliding_window", False, "Qwen3's sliding window is not supported")
    refuse(c, "layer_types", ["full_attention"] * c.count("num_hidden_layers"), "only full_attention")
    bias = bool(c.get("attention_bias", False, bool))
    return {"qkv_bias": bias, "o_bias": bias, "qk_norm": True}


def gguf_config(keys) -> dict:
    return {**gguf_biases(keys), "qk_norm": True}


ARCHITECTURE = Architecture(
    "Qwen3ForCausalLM", "qwen3", "qwen3", read_config, lambda b, kind: pre_norm_layer(b, kind, qk_norm="head"),
    LLAMA_NAMES, gguf_config=gguf_config,
    hf_config=lambda spec: {"hidden_act": "silu", "attention_bias": spec.qkv_bias, "use_sliding_window": False},
)
