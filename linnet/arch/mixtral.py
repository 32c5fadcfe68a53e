"""Mixtral: Mistral's layer with a mixture of experts for its MLP: a softmax over the experts, the top k
renormalised to sum 1. transformers 5 keeps the experts under ``mlp``, gate and up fused; older checkpoints
(and what transformers saves) under ``block_sparse_moe``, a tensor per expert (w1 the gate, w3 up, w2 down).

llama.cpp reads Mixtral as ``llama`` with ``llama.expert_count``: its graph renormalises the top k and has
no sliding window."""
from linnet.arch import Architecture, moe
from linnet.arch.blocks import LLAMA_NAMES, gguf_biases, hf_uniform_window, no_window, refuse, sliding_layers

MLP, OLD = "model.layers.{i}.mlp", "model.layers.{i}.block_sparse_moe"


def read_config(c) -> dict:
    refuse(c, "hidden_act", "silu", "Mixtral's experts are SwiGLU")
    return {**sliding_layers(c), "moe": moe.read(c, moe.BOTH, normalize=True)}


def gguf_config(keys) -> dict:
    return {**gguf_biases(keys), "moe": moe.gguf_config(keys, normalize=True)}


def gguf_metadata(spec) -> dict:
    no_window(spec, "llama.cpp's llama graph (Mixtral's GGUF form)")
    return moe.gguf_metadata(spec)


ARCHITECTURE = Architecture(
    "MixtralForCausalLM", "llama", "mixtral", read_config, moe.layer, {**LLAMA_NAMES, **moe.expert_names(MLP)},
    layer_kinds=moe.layer_kinds, hf_packed=moe.packed(MLP),
    hf_alternatives={"router": f"{OLD}.gate.weight", **moe.per_expert(OLD, "w1", "w3", "w2")},
    hf_config=lambda spec: {"hidden_act": "silu", **moe.hf_config(spec, "num_local_experts"),
                            **hf_uniform_window(spec)},
    gguf_config=gguf_config, gguf_metadata=gguf_metadata, gguf_interleaved_rope=True,
)
