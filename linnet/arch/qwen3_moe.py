"""Qwen3-MoE: Qwen3's layer (an RMS norm of each q and k head) with a mixture of experts for its MLP: the
top k of a softmax over the experts, renormalised where ``norm_topk_prob``. Layers in ``mlp_only_layers``,
or off ``decoder_sparse_step``, keep a dense MLP.

llama.cpp's qwen3moe graph makes every layer sparse and always renormalises the top k."""
from linnet.arch import Architecture, moe
from linnet.arch.blocks import LLAMA_NAMES, gguf_biases, refuse

MLP = "model.layers.{i}.mlp"


def read_config(c) -> dict:
    refuse(c, "hidden_act", "silu", "Qwen3-MoE's experts are SwiGLU")
    refuse(c, "use_sliding_window", False, "Qwen3-MoE's sliding window is not supported")
    bias = bool(c.get("attention_bias", False, bool))
    return {"qkv_bias": bias, "o_bias": bias, "qk_norm": True,
            "moe": moe.read(c, moe.BOTH, "moe_intermediate_size", normalize=bool(c.get("norm_topk_prob", False, bool)),
                            dense_layers=moe.qwen_dense_layers(c))}


def hf_config(spec) -> dict:
    assert spec.moe is not None
    return {"hidden_act": "silu", "attention_bias": spec.qkv_bias, "use_sliding_window": False,
            **moe.hf_config(spec, "num_experts", "moe_intermediate_size"), "norm_topk_prob": spec.moe.normalize,
            **moe.qwen_hf_layers(spec)}


def gguf_config(keys) -> dict:
    return {**gguf_biases(keys), "qk_norm": True,
            "moe": moe.gguf_config(keys, moe.gguf_expert_size(keys), normalize=True)}


def gguf_metadata(spec) -> dict:
    moe.all_sparse(spec, "llama.cpp's qwen3moe graph")
    return moe.gguf_metadata(spec, moe.EXPERT_SIZE)


ARCHITECTURE = Architecture(
    "Qwen3MoeForCausalLM", "qwen3moe", "qwen3_moe", read_config, lambda b, kind: moe.layer(b, kind, qk_norm="head"),
    {**LLAMA_NAMES, **moe.expert_names(MLP)},
    layer_kinds=moe.layer_kinds, hf_packed=moe.packed(MLP), hf_alternatives=moe.per_expert(MLP),
    hf_config=hf_config, gguf_config=gguf_config, gguf_metadata=gguf_metadata,
)
