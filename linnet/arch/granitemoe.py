"""Granite-MoE: Granite's layer and multipliers (embedding, residual, attention scale, logits) with a
mixture of experts for its MLP: the top k router logits, then a softmax over those. Its checkpoints hold
the experts fused as ``input_linear`` (gate then up) and ``output_linear``, and the router as
``router.layer``; transformers 5's modules name them ``experts.gate_up_proj``, ``experts.down_proj`` and
``router``.

llama.cpp's granitemoe graph takes a softmax over every expert and renormalises the top k: the same weights."""
from linnet.arch import Architecture, granite, moe
from linnet.arch.blocks import LLAMA_NAMES

MOE = "model.layers.{i}.block_sparse_moe"


def read_config(c) -> dict:
    return {**granite.read_config(c), "moe": moe.read(c, ("num_local_experts",), gating="topk_softmax")}


ARCHITECTURE = Architecture(
    "GraniteMoeForCausalLM", "granitemoe", "granitemoe", read_config, moe.layer,
    {**LLAMA_NAMES, **moe.expert_names(MOE, router="router")},
    # the last pack of gate and up is the one written: its checkpoints' own names
    layer_kinds=moe.layer_kinds, hf_packed={**moe.packed(MOE), f"{MOE}.input_linear.weight": moe.GATE_UP},
    hf_alternatives={"router": f"{MOE}.router.layer.weight", "expert_down": f"{MOE}.output_linear.weight"},
    hf_config=lambda spec: {**granite.hf_config(spec), **moe.hf_config(spec, "num_local_experts")},
    gguf_config=lambda keys: {**granite.gguf_config(keys), "moe": moe.gguf_config(keys, gating="topk_softmax")},
    gguf_metadata=lambda spec: {**granite.gguf_metadata(spec), **moe.gguf_metadata(spec)},
    gguf_interleaved_rope=True,
)
