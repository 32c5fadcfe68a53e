"""SmolLM3: Llama's layer, with rotary embedding left out of the layers ``no_rope_layers`` marks 0
(every fourth)."""
from linnet.arch import Architecture
from linnet.arch.blocks import LLAMA_NAMES, pre_norm_layer, refuse, sliding_layers
from linnet.errors import UnsupportedModel


def read_config(c) -> dict:
    refuse(c, "hidden_act", "silu", "SmolLM3's MLP is SwiGLU")
    layers = c.count("num_hidden_layers")
    flags = c.get("no_rope_layers", [1] * layers, list)
    if len(flags) != layers or any(f not in (0, 1) for f in flags):
        raise UnsupportedModel(f"{c.where}: no_rope_layers must be a 0 or 1 per layer, got {flags!r}")
    bias = bool(c.get("attention_bias", False, bool))
    return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": bool(c.get("mlp_bias", False, bool)),
            "nope_layers": tuple(i for i, f in enumerate(flags) if f == 0), **sliding_layers(c)}


ARCHITECTURE = Architecture("SmolLM3ForCausalLM", "smollm3", "smollm3", read_config, pre_norm_layer, LLAMA_NAMES)
