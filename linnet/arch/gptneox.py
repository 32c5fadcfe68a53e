"""GPT-NeoX (Pythia): LayerNorms with biases, q/k/v packed per head in ``query_key_value``, partial
rotary (a quarter of each head), biased projections, a plain GELU MLP, and by default a parallel
residual (x + attn(norm1(x)) + mlp(norm2(x))). llama.cpp packs q, k and v one after another in
``attn_qkv`` (its converter reorders the heads) and runs GELU as its tanh approximation."""
import numpy as np

from linnet.arch import Architecture, Packed
from linnet.arch.blocks import (
    HF_ACTIVATIONS,
    activation,
    attention,
    hf_partial_rotary,
    needs_head,
    partial_rotary,
    plain_heads,
    residual,
)
from linnet.errors import UnsupportedModel


def _names(hf: str, gguf: str) -> dict:
    return {"": (hf + ".weight", gguf + ".weight"), "_bias": (hf + ".bias", gguf + ".bias")}


NAMES = {
    part + suffix: names for part, hf, gguf in (
        ("embed", "gpt_neox.embed_in", "token_embd"), ("norm", "gpt_neox.final_layer_norm", "output_norm"),
        ("lm_head", "embed_out", "output"),
        ("attn_norm", "gpt_neox.layers.{i}.input_layernorm", "blk.{i}.attn_norm"),
        ("o", "gpt_neox.layers.{i}.attention.dense", "blk.{i}.attn_output"),
        ("mlp_norm", "gpt_neox.layers.{i}.post_attention_layernorm", "blk.{i}.ffn_norm"),
        ("up", "gpt_neox.layers.{i}.mlp.dense_h_to_4h", "blk.{i}.ffn_up"),
        ("down", "gpt_neox.layers.{i}.mlp.dense_4h_to_h", "blk.{i}.ffn_down"),
    ) for suffix, names in _names(hf, gguf).items()
} | {name: (None, None) for name in ("q", "k", "v", "q_bias", "k_bias", "v_bias")}  # packed below


def _unpack(spec, array):
    """[heads * 3 * head_dim, ...], each head's q, k and v rows in turn -> q, k, v [heads * head_dim, ...]."""
    heads = array.reshape(spec.num_heads, 3, spec.head_dim, *array.shape[1:])
    return tuple(heads[:, j].reshape(spec.q_size, *array.shape[1:]) for j in range(3))


def _pack(spec, arrays):
    split = [a.reshape(spec.num_heads, 1, spec.head_dim, *a.shape[1:]) for a in arrays]
    return np.concatenate(split, axis=1).reshape(3 * spec.q_size, *arrays[0].shape[1:])


def _cut(spec, array):
    """llama.cpp's [q; k; v] -> q, k, v."""
    return tuple(np.split(array, 3, axis=0))


def _join(spec, arrays):
    return np.concatenate(arrays, axis=0)


QKV = Packed(("q", "k", "v"), _unpack, _pack)
QKV_BIAS = Packed(("q_bias", "k_bias", "v_bias"), _unpack, _pack)


def read_config(c) -> dict:
    hidden, heads = c.count("hidden_size"), c.count("num_attention_heads")
    bias = bool(c.get("attention_bias", True, bool))
    return {"norm": "layer", "activation": activation(c, default="gelu"), "qkv_bias": bias, "o_bias": bias,
            "mlp_bias": True, "rope_dim": partial_rotary(c, hidden // heads, default=0.25),
            "parallel_residual": bool(c.get("use_parallel_residual", True, bool))}


def layer(b, kind: str) -> str:
    spec = b.spec
    attn = attention(b, b.layer_norm("x", "attn_norm"), kind)
    x = "x" if spec.parallel_residual else residual(b, "x", attn, "x_attn")
    up = b.linear(b.layer_norm(x, "mlp_norm", "h_mlp"), "up", spec.intermediate_size, bias=True)
    out = b.linear(b.activation(up, spec.activation), "down", spec.hidden_size, bias=True, hint="mlp_out")
    if spec.parallel_residual:
        return residual(b, residual(b, "x", attn, "x_attn"), out, "x_out")
    return residual(b, x, out, "x_out")


def hf_config(spec) -> dict:
    plain_heads(spec, "GPT-NeoX's config.json")  # transformers' GPT-NeoX takes hidden_size / heads
    factor = hf_partial_rotary(spec)["partial_rotary_factor"]
    return {"hidden_act": HF_ACTIVATIONS[spec.activation], "attention_bias": spec.qkv_bias,
            "use_parallel_residual": spec.parallel_residual, "partial_rotary_factor": factor,
            "rotary_pct": factor, "rotary_emb_base": spec.rope.theta}  # transformers 4's names


def gguf_config(keys) -> dict:
    needs_head(keys, tied=False)
    if not keys.has("blk.0.attn_qkv.bias"):
        raise UnsupportedModel(f"{keys.where}: llama.cpp's gptneox graph needs the attention biases")
    # llama.cpp runs GELU as its tanh approximation; every GPT-NeoX config.json names the exact one
    return {"norm": "layer", "activation": "gelu", "qkv_bias": True, "o_bias": True, "mlp_bias": True,
            "parallel_residual": keys.flag("use_parallel_residual", True)}


def gguf_metadata(spec) -> dict:
    plain_heads(spec, "llama.cpp's gptneox graph")
    if spec.activation != "gelu":
        raise UnsupportedModel(f"llama.cpp's gptneox graph has one GELU (config.json's gelu), not {spec.activation}")
    return {"use_parallel_residual": spec.parallel_residual}


ARCHITECTURE = Architecture(
    "GPTNeoXForCausalLM", "gptneox", "gpt_neox", read_config, layer, NAMES, eps_key="layer_norm_eps",
    hf_packed={"gpt_neox.layers.{i}.attention.query_key_value.weight": QKV,
               "gpt_neox.layers.{i}.attention.query_key_value.bias": QKV_BIAS},
    hf_config=hf_config, gguf_config=gguf_config, gguf_metadata=gguf_metadata,
    gguf_packed={"blk.{i}.attn_qkv.weight": Packed(QKV.parts, _cut, _join),
                 "blk.{i}.attn_qkv.bias": Packed(QKV_BIAS.parts, _cut, _join)},
)
