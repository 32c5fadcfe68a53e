"""Llama: pre-norm layers of grouped-query attention and a SwiGLU MLP; ``attention_bias`` puts a bias on
q, k, v and o alike."""
from linnet.arch import Architecture
from linnet.arch.blocks import LLAMA_NAMES, gguf_biases, pre_norm_layer, refuse


def read_config(c) -> dict:
    refuse(c, "hidden_act", "silu", "Llama's MLP is SwiGLU")
    bias = bool(c.get("attention_bias", False, bool))
    return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": bool(c.get("mlp_bias", False, bool))}


def hf_config(spec) -> dict:
    return {"hidden_act": "silu", "attention_bias": spec.qkv_bias, "mlp_bias": spec.mlp_bias}


ARCHITECTURE = Architecture("LlamaForCausalLM", "llama", "llama", read_config, pre_norm_layer, LLAMA_NAMES,
                            hf_config=hf_config, gguf_config=gguf_biases, gguf_interleaved_rope=True)
