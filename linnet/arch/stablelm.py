"""StableLM: LayerNorms with biases, partial rotary (a quarter of each head), optional q/k/v biases and
an optional parallel residual (one norm feeds both sublayers; llama.cpp's graph takes it when a layer
has no ffn_norm)."""
from linnet.arch import Architecture
from linnet.arch.blocks import (
    LLAMA_NAMES,
    attention,
    hf_partial_rotary,
    mlp,
    needs_head,
    partial_rotary,
    plain_heads,
    refuse,
    residual,
)

NAMES = {
    **LLAMA_NAMES,
    "attn_norm_bias": ("model.layers.{i}.input_layernorm.bias", "blk.{i}.attn_norm.bias"),
    "mlp_norm_bias": ("model.layers.{i}.post_attention_layernorm.bias", "blk.{i}.ffn_norm.bias"),
    "norm_bias": ("model.norm.bias", "output_norm.bias"),
}


def read_config(c) -> dict:
    refuse(c, "hidden_act", "silu", "StableLM's MLP is SwiGLU")
    refuse(c, "qk_layernorm", False, "per-head q/k LayerNorms are not supported")
    hidden, heads = c.count("hidden_size"), c.count("num_attention_heads")
    return {"norm": "layer", "qkv_bias": bool(c.get("use_qkv_bias", False, bool)),
            "rope_dim": partial_rotary(c, hidden // heads, default=0.25),
            "parallel_residual": bool(c.get("use_parallel_residual", False, bool))}


def layer(b, kind: str) -> str:
    h = b.layer_norm("x", "attn_norm")
    attn = attention(b, h, kind)
    if b.spec.parallel_residual:  # StableLM's parallel form shares the one norm
        return residual(b, residual(b, "x", attn, "x_attn"), mlp(b, h), "x_out")
    x = residual(b, "x", attn, "x_attn")
    return residual(b, x, mlp(b, b.layer_norm(x, "mlp_norm", "h_mlp")), "x_out")


def hf_config(spec) -> dict:
    plain_heads(spec, "StableLM's config.json")  # transformers' StableLM takes hidden_size / heads
    return {"hidden_act": "silu", "use_qkv_bias": spec.qkv_bias, "use_parallel_residual": spec.parallel_residual,
            "qk_layernorm": False, **hf_partial_rotary(spec)}


def gguf_config(keys) -> dict:
    needs_head(keys, tied=False)
    return {"norm": "layer", "qkv_bias": keys.has("blk.0.attn_q.bias"),
            "parallel_residual": not keys.has("blk.0.ffn_norm.weight")}


def gguf_metadata(spec) -> dict:
    plain_heads(spec, "llama.cpp's stablelm graph")
    return {"use_parallel_residual": spec.parallel_residual}  # as llama.cpp's converter writes it


ARCHITECTURE = Architecture("StableLmForCausalLM", "stablelm", "stablelm", read_config, layer, NAMES,
                            eps_key="layer_norm_eps", hf_config=hf_config, gguf_config=gguf_config,
                            gguf_metadata=gguf_metadata)
