"""OLMo 2: norms after each sublayer instead of before (x + norm(attn(x)), then x + norm(mlp(x))), and
RMS norms of the whole q and k projections before the heads are split."""
from linnet.arch import Architecture
from linnet.arch.blocks import LLAMA_NAMES, attention, mlp, needs_head, plain_heads, refuse

NAMES = {
    **{k: v for k, v in LLAMA_NAMES.items() if k not in ("attn_norm", "mlp_norm")},
    "post_attn_norm": ("model.layers.{i}.post_attention_layernorm.weight", "blk.{i}.post_attention_norm.weight"),
    "post_mlp_norm": ("model.layers.{i}.post_feedforward_layernorm.weight", "blk.{i}.post_ffw_norm.weight"),
}


def read_config(c) -> dict:
    refuse(c, "hidden_act", "silu", "OLMo 2's MLP is SwiGLU")
    bias = bool(c.get("attention_bias", False, bool))
    return {"qkv_bias": bias, "o_bias": bias}


def layer(b, kind: str) -> str:
    x = b.add("x", b.rms_norm(attention(b, "x", kind, qk_norm="flat"), "post_attn_norm", "attn_normed"), "x_attn")
    return b.add(x, b.rms_norm(mlp(b, x), "post_mlp_norm", "mlp_normed"), "x_out")


def hf_config(spec) -> dict:
    plain_heads(spec, "OLMo 2's config.json")
    return {"hidden_act": "silu", "attention_bias": spec.qkv_bias}


def gguf_config(keys) -> dict:
    needs_head(keys, tied=False)
    return {}  # llama.cpp's olmo2 graph has no biases: a file with them has tensors it does not know


def gguf_metadata(spec) -> dict:
    plain_heads(spec, "llama.cpp's olmo2 graph")
    return {}


ARCHITECTURE = Architecture("Olmo2ForCausalLM", "olmo2", "olmo2", read_config, layer, NAMES, hf_config=hf_config,
                            gguf_config=gguf_config, gguf_metadata=gguf_metadata)
