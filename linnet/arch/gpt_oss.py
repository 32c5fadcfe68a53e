"""gpt-oss: pre-norm layers, sliding (every other, from the first) and global in turn, with biased q, k, v
and o, a learned sink logit per head in attention's softmax, YaRN rope, and a mixture of experts for its
MLP: a biased router's top k logits, then a softmax over those; each expert a biased, clamped SwiGLU.

Its checkpoint keeps each expert's gate and up interleaved in one ``gate_up_proj`` [E, D, 2F] (gate in the
even columns) and ``down_proj`` [E, F, D]: transposed from a linear's layout, cut and turned on load. The
MXFP4 checkpoints OpenAI published (``quantization_config``) are refused; their bf16 forms load.

llama.cpp's gpt-oss graph fixes the SwiGLU's alpha (1.702) and limit (7), slides every other layer from
the first, rotates sliding and global layers alike, and names the MLP's norm ``post_attention_norm``; its
YaRN rounds the correction range out to whole dims (gpt-oss's own config says truncate false)."""
import numpy as np

from linnet.arch import Architecture, Packed, moe
from linnet.arch.blocks import LLAMA_NAMES, hf_layer_types, needs_head, refuse, sliding_layers
from linnet.errors import UnsupportedModel

MLP = "model.layers.{i}.mlp"


def read_config(c) -> dict:
    refuse(c, "quantization_config", None, "quantised experts (MXFP4) are not supported; a bf16 checkpoint is")
    bias = bool(c.get("attention_bias", True, bool))
    return {"qkv_bias": bias, "o_bias": bias, "attention_sinks": True, **sliding_layers(c, default_pattern=2),
            "moe": moe.read(c, moe.BOTH, gating="topk_softmax", router_bias=True, expert_bias=True,
                            activation="clamped_swiglu", alpha=c.number("swiglu_alpha", c.get("swiglu_alpha", 1.702)),
                            limit=c.number("swiglu_limit", c.get("swiglu_limit", 7.0)))}


def _interleave(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    out = np.empty((*gate.shape[:-1], 2 * gate.shape[-1]), gate.dtype)
    out[..., 0::2], out[..., 1::2] = gate, up
    return out


GATE_UP = Packed(("expert_gate", "expert_up"),  # [E, D, 2F] -> [E, F, D] each
                 lambda spec, a: (a[..., 0::2].swapaxes(1, 2), a[..., 1::2].swapaxes(1, 2)),
                 lambda spec, parts: _interleave(*(p.swapaxes(1, 2) for p in parts)))
GATE_UP_BIAS = Packed(("expert_gate_bias", "expert_up_bias"), lambda spec, a: (a[..., 0::2], a[..., 1::2]),
                      lambda spec, parts: _interleave(*parts))
DOWN = Packed(("expert_down",), lambda spec, a: (a.swapaxes(1, 2),), lambda spec, parts: parts[0].swapaxes(1, 2))

NAMES = {
    **LLAMA_NAMES, **moe.expert_names(MLP, router="router"),
    "mlp_norm": ("model.layers.{i}.post_attention_layernorm.weight", "blk.{i}.post_attention_norm.weight"),
    "expert_down": (None, "blk.{i}.ffn_down_exps.weight"),
    "router_bias": (f"{MLP}.router.bias", "blk.{i}.ffn_gate_inp.bias"),
    "expert_gate_bias": (None, "blk.{i}.ffn_gate_exps.bias"), "expert_up_bias": (None, "blk.{i}.ffn_up_exps.bias"),
    "expert_down_bias": (f"{MLP}.experts.down_proj_bias", "blk.{i}.ffn_down_exps.bias"),
    "sinks": ("model.layers.{i}.self_attn.sinks", "blk.{i}.attn_sinks.weight"),
}


def hf_config(spec) -> dict:
    assert spec.moe is not None
    return {"attention_bias": spec.qkv_bias, **moe.hf_config(spec, "num_local_experts"),
            "swiglu_alpha": spec.moe.alpha, "swiglu_limit": spec.moe.limit, **hf_layer_types(spec)}


ALPHA, LIMIT = 1.702, 7.0  # llama.cpp's swiglu_oai


def gguf_config(keys) -> dict:
    needs_head(keys, tied=False)
    base = keys.meta.get(f"{keys.family}.rope.freq_base")
    if keys.meta.get(f"{keys.family}.rope.freq_base_swa", base) != base:
        raise UnsupportedModel(f"{keys.where}: {keys.family}.rope.freq_base_swa differs from rope.freq_base; "
                               "Linnet rotates gpt-oss's sliding layers as its global ones")
    layers, pattern = keys.number("block_count"), keys.number("attention.sliding_window_pattern", 2)
    return {"qkv_bias": True, "o_bias": True, "attention_sinks": True,
            "layer_types": tuple("sliding" if i % pattern < pattern - 1 else "full" for i in range(layers)),
            "sliding_window": keys.number("attention.sliding_window"),
            "moe": moe.gguf_config(keys, keys.number(moe.EXPERT_SIZE), gating="topk_softmax", router_bias=True,
                                   expert_bias=True, activation="clamped_swiglu", alpha=ALPHA, limit=LIMIT)}


def gguf_metadata(spec) -> dict:
    if spec.sliding_window is None:
        raise UnsupportedModel("llama.cpp's gpt-oss graph slides every other layer; this model has no sliding window")
    return {"attention.sliding_window": spec.sliding_window, **moe.gguf_metadata(spec, moe.EXPERT_SIZE)}


ARCHITECTURE = Architecture(
    "GptOssForCausalLM", "gpt-oss", "gpt_oss", read_config, moe.layer, NAMES, layer_kinds=moe.layer_kinds,
    hf_packed={f"{MLP}.experts.gate_up_proj": GATE_UP, f"{MLP}.experts.gate_up_proj_bias": GATE_UP_BIAS,
               f"{MLP}.experts.down_proj": DOWN},
    hf_config=hf_config, gguf_config=gguf_config, gguf_metadata=gguf_metadata,
)
