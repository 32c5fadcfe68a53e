"""Qwen2-MoE (Qwen1.5-MoE): Qwen2's layer with a mixture of experts for its MLP (the top k of a softmax over
the experts, renormalised where ``norm_topk_prob``) beside a shared expert scaled by a sigmoid gate. Layers
in ``mlp_only_layers``, or off ``decoder_sparse_step``, keep a dense MLP.

llama.cpp's qwen2moe graph makes every layer sparse and never renormalises the top k."""
from linnet.arch import Architecture, moe
from linnet.arch.blocks import LLAMA_NAMES, gguf_biases, refuse

MLP = "model.layers.{i}.mlp"


def read_config(c) -> dict:
    refuse(c, "hidden_act", "silu", "Qwen2-MoE's experts are SwiGLU")
    refuse(c, "use_sliding_window", False, "Qwen2-MoE's sliding window is not supported")
    refuse(c, "layer_types", ["full_attention"] * c.count("num_hidden_layers"), "only full_attention")
    return {"qkv_bias": bool(c.get("qkv_bias", True, bool)), "o_bias": False,
            "moe": moe.read(c, ("num_experts",), "moe_intermediate_size",
                            normalize=bool(c.get("norm_topk_prob", False, bool)),
                            shared_size=c.count("shared_expert_intermediate_size"),
                            dense_layers=moe.qwen_dense_layers(c))}


def hf_config(spec) -> dict:
    assert spec.moe is not None
    return {"hidden_act": "silu", "qkv_bias": spec.qkv_bias, "use_sliding_window": False,
            **moe.hf_config(spec, "num_experts", "moe_intermediate_size"), "norm_topk_prob": spec.moe.normalize,
            "shared_expert_intermediate_size": spec.moe.shared_size, **moe.qwen_hf_layers(spec)}


def gguf_config(keys) -> dict:
    shared = keys.number(moe.SHARED_SIZE, keys.number("feed_forward_length"))  # llama.cpp's default too
    return {**gguf_biases(keys), "moe": moe.gguf_config(keys, moe.gguf_expert_size(keys), shared_size=shared)}


def gguf_metadata(spec) -> dict:
    moe.all_sparse(spec, "llama.cpp's qwen2moe graph")
    return moe.gguf_metadata(spec, moe.EXPERT_SIZE)


ARCHITECTURE = Architecture(
    "Qwen2MoeForCausalLM", "qwen2moe", "qwen2_moe", read_config, moe.layer,
    {**LLAMA_NAMES, **moe.expert_names(MLP), **moe.shared_names(MLP)},
    layer_kinds=moe.layer_kinds, hf_packed=moe.packed(MLP), hf_alternatives=moe.per_expert(MLP),
    hf_config=hf_config, gguf_config=gguf_config, gguf_metadata=gguf_metadata,
    gguf_packed={"blk.{i}.ffn_gate_inp_shexp.weight": moe.SHARED_GATE},
)
