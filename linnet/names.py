"""Canonical tensor names, and the one table that maps them to each checkpoint format's names.

Per layer ``i``: ``layers.{i}.<part>``; ``<part>`` is one of LAYER_PARTS. Global: ``embed``, ``norm``,
``lm_head`` (absent when the head is tied to ``embed``). Matrices keep the HF ``[out, in]`` layout.
"""
from __future__ import annotations

from linnet.spec import ModelSpec

LAYER_PARTS = (
    "attn_norm", "q", "q_bias", "k", "k_bias", "v", "v_bias", "o", "o_bias",
    "q_norm", "k_norm", "mlp_norm", "gate", "up", "down",
)

# canonical -> (Hugging Face name, GGUF name); "{i}" is the layer index.
NAME_TABLE: dict[str, tuple[str, str]] = {
    "embed": ("model.embed_tokens.weight", "token_embd.weight"),
    "norm": ("model.norm.weight", "output_norm.weight"),
    "lm_head": ("lm_head.weight", "output.weight"),
    "attn_norm": ("model.layers.{i}.input_layernorm.weight", "blk.{i}.attn_norm.weight"),
    "q": ("model.layers.{i}.self_attn.q_proj.weight", "blk.{i}.attn_q.weight"),
    "q_bias": ("model.layers.{i}.self_attn.q_proj.bias", "blk.{i}.attn_q.bias"),
    "k": ("model.layers.{i}.self_attn.k_proj.weight", "blk.{i}.attn_k.weight"),
    "k_bias": ("model.layers.{i}.self_attn.k_proj.bias", "blk.{i}.attn_k.bias"),
    "v": ("model.layers.{i}.self_attn.v_proj.weight", "blk.{i}.attn_v.weight"),
    "v_bias": ("model.layers.{i}.self_attn.v_proj.bias", "blk.{i}.attn_v.bias"),
    "o": ("model.layers.{i}.self_attn.o_proj.weight", "blk.{i}.attn_output.weight"),
    "o_bias": ("model.layers.{i}.self_attn.o_proj.bias", "blk.{i}.attn_output.bias"),
    "q_norm": ("model.layers.{i}.self_attn.q_norm.weight", "blk.{i}.attn_q_norm.weight"),
    "k_norm": ("model.layers.{i}.self_attn.k_norm.weight", "blk.{i}.attn_k_norm.weight"),
    "mlp_norm": ("model.layers.{i}.post_attention_layernorm.weight", "blk.{i}.ffn_norm.weight"),
    "gate": ("model.layers.{i}.mlp.gate_proj.weight", "blk.{i}.ffn_gate.weight"),
    "up": ("model.layers.{i}.mlp.up_proj.weight", "blk.{i}.ffn_up.weight"),
    "down": ("model.layers.{i}.mlp.down_proj.weight", "blk.{i}.ffn_down.weight"),
}


def expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every canonical tensor the spec needs, with its shape; nothing optional is left in."""
    h, hd = spec.hidden_size, spec.head_dim
    shapes: dict[str, tuple[int, ...]] = {"embed": (spec.vocab_size, h), "norm": (h,)}
    if not spec.tie_word_embeddings:
        shapes["lm_head"] = (spec.vocab_size, h)
    layer = {
        "attn_norm": (h,), "q": (spec.q_size, h), "k": (spec.kv_size, h), "v": (spec.kv_size, h),
        "o": (h, spec.q_size), "mlp_norm": (h,), "gate": (spec.intermediate_size, h),
        "up": (spec.intermediate_size, h), "down": (h, spec.intermediate_size),
    }
    if spec.qkv_bias:
        layer.update(q_bias=(spec.q_size,), k_bias=(spec.kv_size,), v_bias=(spec.kv_size,))
    if spec.o_bias:
        layer["o_bias"] = (h,)
    if spec.qk_norm:
        layer.update(q_norm=(hd,), k_norm=(hd,))
    for i in range(spec.num_layers):
        for part, shape in layer.items():
            shapes[f"layers.{i}.{part}"] = shape
    return shapes


def format_name(canonical: str, fmt: int) -> str:
    """``fmt`` 0 = Hugging Face, 1 = GGUF."""
    if canonical.startswith("layers."):
        _, i, part = canonical.split(".", 2)
        return NAME_TABLE[part][fmt].format(i=i)
    return NAME_TABLE[canonical][fmt]


def hf_name(canonical: str) -> str:
    return format_name(canonical, 0)


def gguf_name(canonical: str) -> str:
    return format_name(canonical, 1)
