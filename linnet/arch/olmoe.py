"""OLMoE: Llama's pre-norm layer with RMS norms of the whole q and k projections (as OLMo 2, before the
heads are split) and a mixture of experts for its MLP: the top k of a softmax over the experts,
renormalised where ``norm_topk_prob``.

llama.cpp's olmoe graph never renormalises the top k, has no attention biases, and sizes the k norm
embedding_length wide: as many kv heads as heads."""
from linnet.arch import Architecture, moe
from linnet.arch.blocks import LLAMA_NAMES, needs_head, refuse
from linnet.errors import UnsupportedModel

MLP = "model.layers.{i}.mlp"


def read_config(c) -> dict:
    refuse(c, "hidden_act", "silu", "OLMoE's experts are SwiGLU")
    refuse(c, "clip_qkv", None, "clipping q, k and v is not supported")
    # its q and k norms are sized hidden_size and (hidden_size / heads) x kv heads: the heads' own width
    refuse(c, "head_dim", c.count("hidden_size") // c.count("num_attention_heads"), "OLMoE's heads are hidden / heads")
    bias = bool(c.get("attention_bias", False, bool))
    return {"qkv_bias": bias, "o_bias": bias,
            "moe": moe.read(c, moe.BOTH, normalize=bool(c.get("norm_topk_prob", False, bool)))}


def hf_config(spec) -> dict:
    assert spec.moe is not None
    return {"hidden_act": "silu", "attention_bias": spec.qkv_bias, "clip_qkv": None, **moe.hf_config(spec),
            "norm_topk_prob": spec.moe.normalize}


def gguf_config(keys) -> dict:
    needs_head(keys, tied=False)
    heads = keys.number("attention.head_count")
    kv_heads = keys.number("attention.head_count_kv", heads)
    if kv_heads != heads:
        raise UnsupportedModel(f"{keys.where}: llama.cpp's olmoe graph sizes the k norm embedding_length wide, "
                               f"for as many kv heads as heads ({heads}), not attention.head_count_kv {kv_heads}")
    return {"moe": moe.gguf_config(keys)}


ARCHITECTURE = Architecture(
    "OlmoeForCausalLM", "olmoe", "olmoe", read_config, lambda b, kind: moe.layer(b, kind, qk_norm="flat"),
    {**LLAMA_NAMES, **moe.expert_names(MLP)},
    layer_kinds=moe.layer_kinds, hf_packed=moe.packed(MLP), hf_alternatives=moe.per_expert(MLP),
    hf_config=hf_config, gguf_config=gguf_config, gguf_metadata=moe.gguf_metadata,
)
