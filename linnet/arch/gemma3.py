"""Gemma 3 (text): Gemma 2's layer with an RMS norm of each q and k head before rotary (1 + w, as its other
norms), five sliding layers to each global one by default, no softcaps by default, and two rotary
embeddings: sliding layers rotate by a local base (``rope_local_base_freq``, 10000) without scaling, global
layers by ``rope_theta`` (1000000) with their own scaling (linear, factor 8, on the 4B and larger). The
spec's ``rope`` is the global one and ``local_rope`` the sliding layers'; transformers 5 spells both as
``rope_parameters`` per layer type.

llama.cpp's gemma3 graph derives the layers that slide (every 6th global), the local rope (base 10000,
unscaled), and the attention scale (head_dim ** -0.5; (hidden / heads) ** -0.5 for the 62-layer 27B); it
has no attention softcap, and no final softcap on a model with sliding layers."""
import math

from linnet.arch import Architecture
from linnet.arch.blocks import (
    HF_ACTIVATIONS,
    activation,
    attention,
    hf_layer_types,
    mlp,
    optional_number,
    refuse,
    shortest,
    sliding_layers,
)
from linnet.arch.gemma2 import NAMES, ONE_PLUS
from linnet.errors import UnsupportedModel
from linnet.spec import ConfigReader, RopeSpec, rope_from_config

THETAS = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}  # Gemma3TextConfig's defaults
LLAMA_CPP_LOCAL = RopeSpec(theta=10_000.0)  # what llama.cpp's gemma3 graph rotates sliding layers by
LLAMA_CPP_PATTERN = 6


def read_config(c) -> dict:
    refuse(c, "use_bidirectional_attention", False, "Gemma 3's bidirectional attention is for embeddings")
    hidden = c.count("hidden_size")
    window = {"sliding_window": 4096} if "sliding_window" not in c.config else {}  # the config class's default
    layers = sliding_layers(ConfigReader({**c.config, **window}, c.where),
                            default_pattern=c.get("sliding_window_pattern", 6, int))
    rope, local = _ropes(c)
    return {
        "activation": activation(c, "hidden_activation", "gelu_pytorch_tanh"),
        "qkv_bias": bool(c.get("attention_bias", False, bool)), "o_bias": bool(c.get("attention_bias", False, bool)),
        "qk_norm": True,
        # transformers rounds sqrt(hidden) to the run dtype; the Program's scale does the same
        "embedding_multiplier": math.sqrt(hidden),
        "attention_scale": c.number("query_pre_attn_scalar", c.get("query_pre_attn_scalar", 256)) ** -0.5,
        "attn_softcap": optional_number(c, "attn_logit_softcapping"),
        "final_softcap": optional_number(c, "final_logit_softcapping"),
        "rope": rope, "local_rope": local, **layers,
    }


def _ropes(c: ConfigReader) -> tuple[RopeSpec, RopeSpec]:
    """The global and the local rope: transformers 5's ``rope_parameters`` per layer type, or transformers
    4's rope_theta and rope_scaling (global) and rope_local_base_freq (local, unscaled)."""
    params = c.get("rope_parameters", None, dict)
    if params and set(params) & set(THETAS):
        ropes = []
        for layer_type, theta in THETAS.items():
            entry = params.get(layer_type) or {}
            if not isinstance(entry, dict):
                raise c.fail(f"rope_parameters.{layer_type}", f"expected an object, got {entry!r}")
            own = {**c.config, "rope_parameters": {"rope_type": "default", "rope_theta": theta, **entry},
                   "rope_scaling": None, "rope_theta": None}
            ropes.append(rope_from_config(ConfigReader(own, f"{c.where}: rope_parameters.{layer_type}")))
        return ropes[0], ropes[1]
    if params:
        raise c.fail("rope_parameters", "expected one entry per layer type (full_attention, sliding_attention)")
    full = {**c.config, "rope_theta": c.get("rope_theta", THETAS["full_attention"])}
    local = {**c.config, "rope_theta": c.get("rope_local_base_freq", THETAS["sliding_attention"]),
             "rope_scaling": None}
    return rope_from_config(ConfigReader(full, c.where)), rope_from_config(ConfigReader(local, c.where))


def layer(b, kind: str) -> str:
    attn = attention(b, b.rms_norm("x", "attn_norm"), kind, qk_norm="head")
    x = b.add("x", b.rms_norm(attn, "post_attn_norm", "attn_normed"), "x_attn")
    out = mlp(b, b.rms_norm(x, "mlp_norm", "h_mlp"))
    return b.add(x, b.rms_norm(out, "post_mlp_norm", "mlp_normed"), "x_out")


def hf_config(spec) -> dict:
    from linnet.hf.export import rope_scaling

    local = spec.local_rope or spec.rope
    if local.kind != "default":
        raise UnsupportedModel(f"transformers 4's Gemma 3 config has no scaling for the sliding layers' rope; "
                               f"this model's is {local.kind}")
    scalar = shortest(spec.scale ** -2, lambda q: float(q) ** -0.5 == spec.scale)
    per_type = {"full_attention": spec.rope, "sliding_attention": local}
    return {"hidden_activation": HF_ACTIVATIONS[spec.activation], "attention_bias": spec.qkv_bias,
            "query_pre_attn_scalar": scalar, "attn_logit_softcapping": spec.attn_softcap,
            "final_logit_softcapping": spec.final_softcap, **hf_layer_types(spec),
            "rope_local_base_freq": local.theta,  # transformers 4; 5 reads rope_parameters per layer type
            "rope_parameters": {t: {"rope_type": r.kind, "rope_theta": r.theta, **(rope_scaling(r) or {})}
                                for t, r in per_type.items()}}


def gguf_config(keys) -> dict:
    hidden, heads, layers = (keys.number(k) for k in ("embedding_length", "attention.head_count", "block_count"))
    head_dim = keys.number("attention.key_length", hidden // heads)
    window = keys.optional("attention.sliding_window", int)  # none: every layer global
    return {"activation": "gelu_tanh", "embedding_multiplier": math.sqrt(hidden), "qk_norm": True,
            "attention_scale": float(hidden // heads if layers == 62 else head_dim) ** -0.5,
            "final_softcap": None if window else keys.optional("final_logit_softcapping"),
            "layer_types": tuple("sliding" if window and i % LLAMA_CPP_PATTERN < LLAMA_CPP_PATTERN - 1 else "full"
                                 for i in range(layers)),
            "sliding_window": window, "local_rope": LLAMA_CPP_LOCAL}


def gguf_metadata(spec) -> dict:
    derived = float(spec.hidden_size // spec.num_heads if spec.num_layers == 62 else spec.head_dim) ** -0.5
    if not math.isclose(spec.scale, derived, rel_tol=1e-6):
        raise UnsupportedModel(f"llama.cpp's gemma3 graph scales attention by {derived:.6g}, not this model's "
                               f"{spec.scale:.6g} (query_pre_attn_scalar {spec.scale ** -2:.6g})")
    if spec.attn_softcap is not None:
        raise UnsupportedModel(f"llama.cpp's gemma3 graph has no attention softcap; this model's is "
                               f"{spec.attn_softcap}")
    sliding = "sliding" in spec.layer_types
    if sliding and spec.final_softcap is not None:
        raise UnsupportedModel(f"llama.cpp's gemma3 graph has no final softcap with sliding layers; this model's is "
                               f"{spec.final_softcap}")
    pattern = tuple("sliding" if i % LLAMA_CPP_PATTERN < LLAMA_CPP_PATTERN - 1 else "full"
                    for i in range(spec.num_layers))
    if sliding and spec.layer_types != pattern:
        raise UnsupportedModel(f"llama.cpp's gemma3 graph makes every {LLAMA_CPP_PATTERN}th layer global, not this "
                               f"model's {list(spec.layer_types)}")
    if sliding and spec.local_rope != LLAMA_CPP_LOCAL:
        raise UnsupportedModel(f"llama.cpp's gemma3 graph rotates sliding layers by base 10000 without scaling, not "
                               f"this model's local rope {spec.local_rope}")
    return {**({"attention.sliding_window": spec.sliding_window} if sliding else {}),
            **({"final_logit_softcapping": float(spec.final_softcap)} if spec.final_softcap is not None else {})}


ARCHITECTURE = Architecture(
    "Gemma3ForCausalLM", "gemma3", "gemma3_text", read_config, layer, NAMES, tied_by_default=True,
    hf_transforms={part: ONE_PLUS for part in ("attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm", "norm",
                                               "q_norm", "k_norm")},
    hf_config=hf_config, gguf_config=gguf_config, gguf_metadata=gguf_metadata,
)
