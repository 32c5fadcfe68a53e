"""Granite: Llama's layer with multipliers: the embedding's, each sublayer's output before its residual
add, attention's scale (``attention_multiplier`` in place of 1 / sqrt(head_dim)), and the logits
divided by ``logits_scaling``."""
from linnet.arch import Architecture
from linnet.arch.blocks import LLAMA_NAMES, pre_norm_layer, refuse


def read_config(c) -> dict:
    refuse(c, "hidden_act", "silu", "Granite's MLP is SwiGLU")
    bias = bool(c.get("attention_bias", False, bool))
    return {
        "qkv_bias": bias, "o_bias": bias, "mlp_bias": bool(c.get("mlp_bias", False, bool)),
        "embedding_multiplier": c.number("embedding_multiplier"),
        "residual_multiplier": c.number("residual_multiplier"),
        "attention_scale": c.number("attention_multiplier"),
        "logit_multiplier": 1.0 / c.number("logits_scaling"),
    }


ARCHITECTURE = Architecture("GraniteForCausalLM", "granite", "granite", read_config, pre_norm_layer, LLAMA_NAMES)
