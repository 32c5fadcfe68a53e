"""Gemma 2: norms before and after each sublayer (a "sandwich"), RMS norms that scale by 1 + w, a
GELU-tanh gated MLP, the embedding scaled by sqrt(hidden), attention scaled by
``query_pre_attn_scalar`` ** -0.5 with its scores softcapped, sliding and global layers in turn, and
softcapped logits. Canonical norm weights hold 1 + w, as llama.cpp's GGUF files do.

llama.cpp's gemma2 graph derives what config.json states: the embedding scale, the attention scale
(head_dim ** -0.5; (hidden / heads) ** -0.5 for the 46-layer 27B), the layers that slide (every other,
from the first), a tied head, and softcaps of 50 and 30 where the file has none."""
import math

from linnet.arch import Architecture, Transform
from linnet.arch.blocks import (
    HF_ACTIVATIONS,
    LLAMA_NAMES,
    activation,
    attention,
    hf_layer_types,
    mlp,
    needs_head,
    optional_number,
    shortest,
    sliding_layers,
)
from linnet.errors import UnsupportedModel

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


def hf_config(spec) -> dict:
    scalar = shortest(spec.scale ** -2, lambda q: float(q) ** -0.5 == spec.scale)
    return {"hidden_activation": HF_ACTIVATIONS[spec.activation], "attention_bias": spec.qkv_bias,
            "query_pre_attn_scalar": scalar, "attn_logit_softcapping": spec.attn_softcap,
            "final_logit_softcapping": spec.final_softcap, **hf_layer_types(spec)}


def gguf_config(keys) -> dict:
    needs_head(keys, tied=True)
    hidden, heads, layers = (keys.number(k) for k in ("embedding_length", "attention.head_count", "block_count"))
    head_dim = keys.number("attention.key_length", hidden // heads)
    pattern = keys.number("attention.sliding_window_pattern", 2)
    return {"activation": "gelu_tanh", "embedding_multiplier": math.sqrt(hidden),
            "attention_scale": float(hidden // heads if layers == 46 else head_dim) ** -0.5,
            "attn_softcap": keys.number("attn_logit_softcapping", 50.0, float),
            "final_softcap": keys.number("final_logit_softcapping", 30.0, float),
            "layer_types": tuple("sliding" if i % pattern < pattern - 1 else "full" for i in range(layers)),
            "sliding_window": keys.number("attention.sliding_window", 4096)}


def gguf_metadata(spec) -> dict:
    derived = float(spec.hidden_size // spec.num_heads if spec.num_layers == 46 else spec.head_dim) ** -0.5
    if not math.isclose(spec.scale, derived, rel_tol=1e-6):
        raise UnsupportedModel(f"llama.cpp's gemma2 graph scales attention by {derived:.6g}, not this model's "
                               f"{spec.scale:.6g} (query_pre_attn_scalar {spec.scale ** -2:.6g})")
    softcaps = {"attn_logit_softcapping": spec.attn_softcap, "final_logit_softcapping": spec.final_softcap}
    return {**{k: float(v) for k, v in softcaps.items() if v is not None},
            **({"attention.sliding_window": spec.sliding_window} if spec.sliding_window else {})}


ARCHITECTURE = Architecture(
    "Gemma2ForCausalLM", "gemma2", "gemma2", read_config, layer, NAMES, tied_by_default=True,
    hf_transforms={part: ONE_PLUS for part in ("attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm", "norm")},
    hf_config=hf_config, gguf_config=gguf_config, gguf_metadata=gguf_metadata,
)
