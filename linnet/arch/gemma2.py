"""Gemma 2: norms before and after each sublayer (a "sandwich"), RMS norms that scale by 1 + w, a
GELU-tanh gated MLP, the embedding scaled by sqrt(hidden), attention scaled by
``query_pre_attn_scalar`` ** -0.5 with its scores softcapped, sliding and global layers in turn, and
softcapped logits. Canonical norm weights hold 1 + w, as llama.cpp's GGUF files do."""
import math

from linnet.arch import Architecture, Transform
from linnet.arch.blocks import LLAMA_NAMES, activation, attention, mlp, optional_number, sliding_layers

NAMES = {
    **LLAMA_NAMES,
    "post_attn_norm": ("model.layers.{i}.post_attention_layernorm.weight", "blk.{i}.post_attention_norm.weight"),
    "mlp_norm": ("model.layers.{i}.pre_feedforward_layernorm.weight", "blk.{i}.ffn_norm.weight"),
    "post_mlp_norm": ("model.layers.{i}.post_feedforward_layernorm.weight", "blk.{i}.post_ffw_norm.weight"),
}
ONE_PLUS = Transform(load=lambda w: w.astype("float32") + 1, save=lambda w: w.astype("float32") - 1)


def read_config(c) -> dict:
    hidden = c.count("hidden_size")
    return {
        "activation": activation(c, "hidden_activation", "gelu_pytorch_tanh"),
        "qkv_bias": bool(c.get("attention_bias", False, bool)), "o_bias": bool(c.get("attention_bias", False, bool)),
        # transformers rounds sqrt(hidden) to the run dtype; the Program's scale does the same
        "embedding_multiplier": math.sqrt(hidden),
        "attention_scale": c.number("query_pre_attn_scalar") ** -0.5,
        "attn_softcap": optional_number(c, "attn_logit_softcapping"),
        "final_softcap": optional_number(c, "final_logit_softcapping"),
        **sliding_layers(c, default_pattern=2),
    }


def layer(b, kind: str) -> str:
    attn = attention(b, b.rms_norm("x", "attn_norm"), kind)
    x = b.add("x", b.rms_norm(attn, "post_attn_norm", "attn_normed"), "x_attn")
    out = mlp(b, b.rms_norm(x, "mlp_norm", "h_mlp"))
    return b.add(x, b.rms_norm(out, "post_mlp_norm", "mlp_normed"), "x_out")


ARCHITECTURE = Architecture(
    "Gemma2ForCausalLM", "gemma2", "gemma2", read_config, layer, NAMES, tied_by_default=True,
    hf_transforms={part: ONE_PLUS for part in ("attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm", "norm")},
)
