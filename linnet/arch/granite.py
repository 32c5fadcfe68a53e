"""Granite: Llama's layer with multipliers: the embedding's, each sublayer's output before its residual
add, attention's scale (``attention_multiplier`` in place of 1 / sqrt(head_dim)), and the logits
divided by ``logits_scaling``. GGUF names them embedding_scale, residual_scale, attention.scale and
logit_scale."""
from linnet.arch import Architecture
from linnet.arch.blocks import LLAMA_NAMES, gguf_biases, plain_heads, pre_norm_layer, refuse, shortest


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


def hf_config(spec) -> dict:
    plain_heads(spec, "Granite's config.json")
    return {"hidden_act": "silu", "attention_bias": spec.qkv_bias, "mlp_bias": spec.mlp_bias,
            "embedding_multiplier": spec.embedding_multiplier, "residual_multiplier": spec.residual_multiplier,
            "attention_multiplier": spec.scale,
            "logits_scaling": shortest(1.0 / spec.logit_multiplier, lambda x: 1.0 / x == spec.logit_multiplier)}


def gguf_config(keys) -> dict:
    # llama.cpp leaves out a missing multiplier (and takes head_dim ** -0.5 for attention); logit_scale it needs
    return {**gguf_biases(keys), "embedding_multiplier": keys.number("embedding_scale", 1.0, float),
            "residual_multiplier": keys.number("residual_scale", 1.0, float),
            "attention_scale": keys.optional("attention.scale"),
            "logit_multiplier": 1.0 / keys.number("logit_scale", kind=float)}


def gguf_metadata(spec) -> dict:
    return {"embedding_scale": float(spec.embedding_multiplier), "residual_scale": float(spec.residual_multiplier),
            "attention.scale": spec.scale, "logit_scale": 1.0 / spec.logit_multiplier}


ARCHITECTURE = Architecture("GraniteForCausalLM", "granite", "granite", read_config, pre_norm_layer, LLAMA_NAMES,
                            hf_config=hf_config, gguf_config=gguf_config, gguf_metadata=gguf_metadata,
                            gguf_interleaved_rope=True)
