"""Qwen2: Llama's layer with a bias on q, k and v (never on o)."""
from linnet.arch import Architecture
from linnet.arch.blocks import LLAMA_NAMES, pre_norm_layer, refuse


def read_config(c) -> dict:
    refuse(c, "hidden_act", "silu", "Qwen2's MLP is SwiGLU")
    refuse(c, "use_sliding_window", False, "Qwen2's sliding window is not supported")
    refuse(c, "layer_types", ["full_attention"] * c.count("num_hidden_layers"), "only full_attention")
    return {"qkv_bias": True, "o_bias": False}


ARCHITECTURE = Architecture("Qwen2ForCausalLM", "qwen2", "qwen2", read_config, pre_norm_layer, LLAMA_NAMES,
                            hf_config=lambda spec: {"hidden_act": "silu", "use_sliding_window": False},
                            gguf_config=lambda keys: {"qkv_bias": True})
